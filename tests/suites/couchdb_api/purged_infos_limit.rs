//! `GET/PUT /{db}/_purged_infos_limit` (issue 35 review), on an ordinary database and on the
//! data-store one, against what CouchDB 3.4.3 answered (checked with curl, and in its
//! `chttpd_db.erl` and `chttpd_auth_request.erl`): a new database's limit is 1000; a server admin
//! reads it and sets it to a positive integer (`{"ok":true}`), anything else is 400
//! "`purged_infos_limit` must be positive integer" (a body that is not JSON: "invalid UTF-8
//! JSON"); every other login, database admins and members included, is refused 401 "You are not
//! a server admin." before the database is opened (on a missing database too); other methods
//! are 405 "Only GET,PUT allowed" with `Allow: GET,PUT`; `GET /{db}` does not show it. On the
//! data-store database a per-user login is a member (401 reading it) and is refused changing it
//! with 403 naming why, as every setting of that shared database.

use super::data_store_admin::admin_logins_config;
use super::logins::PASSWORD;
use super::*;

/// The trial's configuration: an admin and the per-user logins `alice` and `db`.
pub(super) fn config() -> Result<String, Failed> {
    admin_logins_config()
}

/// A request as `login` (Basic, [`PASSWORD`]; `None`: anonymous) with a raw body, answered.
async fn send(
    e: &Endpoint,
    login: Option<&str>,
    method: Method,
    path: &str,
    body: Option<&str>,
) -> Result<Answer, Failed> {
    let mut request = e.client.request(method, e.url(path)).header("Accept", "application/json");
    if let Some(login) = login {
        request = request.basic_auth(login, Some(PASSWORD));
    }
    if let Some(body) = body {
        request = request.header("Content-Type", "application/json").body(body.to_owned());
    }
    Answer::read(request.send().await?).await
}

fn positive_integer_refusal() -> Value {
    json!({"error": "bad_request", "reason": "`purged_infos_limit` must be positive integer"})
}

fn not_a_server_admin() -> Value {
    json!({"error": "unauthorized", "reason": "You are not a server admin."})
}

/// The limit as the admin reads it.
async fn limit_of(e: &Endpoint, db: &str) -> Result<Value, Failed> {
    let path = format!("/{db}/_purged_infos_limit");
    Ok(send(e, Some("admin"), Method::GET, &path, None).await?.expect(200, "GET _purged_infos_limit")?.body)
}

pub(super) async fn purged_infos_limit_as_couchdb(e: Endpoint) -> TestResult {
    on_the_data_store(&e).await?;
    if e.backend == "couchdb" {
        println!("on the CouchDB backend other databases are the backend server's, their answers forwarded");
        return Ok(());
    }
    let mut random = [0u8; 6];
    getrandom::fill(&mut random).map_err(|err| err.to_string())?;
    let db = format!("purged-limit-{}", hex::encode(random));
    send(&e, Some("admin"), Method::PUT, &format!("/{db}"), None).await?.expect(201, "PUT database")?;
    let path = format!("/{db}/_purged_infos_limit");

    check(limit_of(&e, &db).await? == json!(1000), || "a new database's limit is 1000".to_owned())?;
    let set = send(&e, Some("admin"), Method::PUT, &path, Some("5")).await?.expect(200, "PUT 5")?;
    check(set.body == json!({"ok": true}), || format!("PUT 5: {}", set.body))?;
    check(limit_of(&e, &db).await? == json!(5), || "the limit set is read back".to_owned())?;
    let slash = send(&e, Some("admin"), Method::GET, &format!("{path}/"), None).await?.expect(200, "GET with a /")?;
    check(slash.body == json!(5), || format!("GET _purged_infos_limit/: {}", slash.body))?;
    let head = e.client.head(e.url(&path)).basic_auth("admin", Some(PASSWORD)).send().await?;
    check(head.status() == StatusCode::OK, || format!("HEAD: {}", head.status()))?;

    refusals_of_bodies(&e, &path).await?;
    check(limit_of(&e, &db).await? == json!(5), || "a refused PUT leaves the limit".to_owned())?;
    // Kept beside `_revs_limit` and `_security`: changing those keeps it.
    send(&e, Some("admin"), Method::PUT, &format!("/{db}/_revs_limit"), Some("7")).await?.expect(200, "_revs_limit")?;
    check(limit_of(&e, &db).await? == json!(5), || "PUT _revs_limit kept the limit".to_owned())?;
    let largest = u64::MAX.to_string();
    send(&e, Some("admin"), Method::PUT, &path, Some(&largest)).await?.expect(200, "PUT u64::MAX")?;
    check(limit_of(&e, &db).await? == json!(u64::MAX), || "the largest limit kept".to_owned())?;
    let past = send(&e, Some("admin"), Method::PUT, &path, Some("18446744073709551616")).await?.expect(400, "past")?;
    check(past.body["reason"].as_str().is_some_and(|reason| reason.contains(&largest)), || {
        format!("a limit past the largest kept names it: {}", past.body)
    })?;

    refusals_to_others(&e, &db, &path).await?;
    let info = send(&e, Some("admin"), Method::GET, &format!("/{db}"), None).await?.expect(200, "GET /{db}")?;
    check(info.body.get("purged_infos_limit").is_none() && info.body.get("purge_seq").is_some(), || {
        format!("GET /{{db}} shows purge_seq and not the limit, as CouchDB: {}", info.body)
    })?;
    send(&e, Some("admin"), Method::DELETE, &format!("/{db}"), None).await?.expect(200, "DELETE database")?;
    Ok(())
}

/// Bodies that are not a positive integer, and methods other than GET and PUT.
async fn refusals_of_bodies(e: &Endpoint, path: &str) -> TestResult {
    for body in ["0", "-1", "\"5\"", "5.0", "1e3", "null", "true", "[5]", "{\"a\":1}"] {
        let refused = send(e, Some("admin"), Method::PUT, path, Some(body)).await?.expect(400, body)?;
        check(refused.body == positive_integer_refusal(), || format!("PUT {body}: {}", refused.body))?;
    }
    for body in ["abc", ""] {
        let refused = send(e, Some("admin"), Method::PUT, path, Some(body)).await?.expect(400, body)?;
        let reason = refused.body["reason"].as_str().unwrap_or_default();
        check(refused.body["error"] == "bad_request" && reason.starts_with("invalid UTF-8 JSON"), || {
            format!("PUT {body:?}: {}", refused.body)
        })?;
    }
    for method in [Method::POST, Method::DELETE] {
        let refused = send(e, Some("admin"), method.clone(), path, Some("5")).await?.expect(405, method.as_str())?;
        check(
            refused.body == json!({"error": "method_not_allowed", "reason": "Only GET,PUT allowed"})
                && refused.header("allow") == Some("GET,PUT"),
            || format!("{method}: {:?} {}", refused.header("allow"), refused.body),
        )?;
    }
    Ok(())
}

/// Everyone but a server admin is refused 401 before the database is opened: its database admin,
/// a login `_security` does not admit, anonymous requests, and on a missing database too.
async fn refusals_to_others(e: &Endpoint, db: &str, path: &str) -> TestResult {
    let security = json!({"admins": {"names": ["alice"], "roles": []}, "members": {"names": [], "roles": []}});
    let security = security.to_string();
    send(e, Some("admin"), Method::PUT, &format!("/{db}/_security"), Some(&security))
        .await?
        .expect(200, "_security")?;
    send(e, Some("alice"), Method::GET, &format!("/{db}"), None).await?.expect(200, "alice is a database admin")?;
    for login in ["alice", "db"] {
        for (method, body) in [(Method::GET, None), (Method::PUT, Some("3"))] {
            let refused = send(e, Some(login), method.clone(), path, body).await?;
            check(refused.status == StatusCode::UNAUTHORIZED && refused.body == not_a_server_admin(), || {
                format!("{method} by {login}: {} {}", refused.status, refused.body)
            })?;
        }
    }
    let anonymous = send(e, None, Method::GET, path, None).await?;
    check(anonymous.status == StatusCode::UNAUTHORIZED, || {
        format!("anonymous: {} {}", anonymous.status, anonymous.body)
    })?;
    let missing = "/purged-limit-none/_purged_infos_limit";
    let refused = send(e, Some("db"), Method::GET, missing, None).await?;
    check(refused.status == StatusCode::UNAUTHORIZED && refused.body == not_a_server_admin(), || {
        format!("a missing database, by a login: {} {}", refused.status, refused.body)
    })?;
    let absent = send(e, Some("admin"), Method::GET, missing, None).await?.expect(404, "a missing database")?;
    check(absent.body == json!({"error": "not_found", "reason": "Database does not exist."}), || {
        format!("a missing database, by the admin: {}", absent.body)
    })?;
    check(limit_of(e, db).await? != json!(3), || "a refused PUT changed the limit".to_owned())
}

/// The data-store database (the engine's handlers on every backend): the admin reads and sets
/// it; a per-user login is a member, refused reading it (401) and changing it (403 naming why).
async fn on_the_data_store(e: &Endpoint) -> TestResult {
    let path = format!("/{DB}/_purged_infos_limit");
    check(limit_of(e, DB).await? == json!(1000), || "the data-store database's limit is 1000".to_owned())?;
    send(e, Some("admin"), Method::PUT, &path, Some("3")).await?.expect(200, "PUT 3 on the data store")?;
    check(limit_of(e, DB).await? == json!(3), || "the data-store database's limit read back".to_owned())?;
    let refused =
        send(e, Some("admin"), Method::PUT, &path, Some("0")).await?.expect(400, "PUT 0 on the data store")?;
    check(refused.body == positive_integer_refusal(), || format!("PUT 0 on the data store: {}", refused.body))?;
    let read = send(e, Some("alice"), Method::GET, &path, None).await?;
    check(read.status == StatusCode::UNAUTHORIZED && read.body == not_a_server_admin(), || {
        format!("alice reads the data store's limit: {} {}", read.status, read.body)
    })?;
    let changed = send(e, Some("alice"), Method::PUT, &path, Some("9")).await?;
    let reason = changed.body["reason"].as_str().unwrap_or_default();
    check(changed.status == StatusCode::FORBIDDEN && reason.contains("per-user login"), || {
        format!("alice changes the data store's limit: {} {}", changed.status, changed.body)
    })?;
    check(limit_of(e, DB).await? == json!(3), || "alice's refused PUT left the limit".to_owned())
}
