//! Server-wide rules of issue 34, each against CouchDB 3.4.3's source (cited per check): the
//! admin-only endpoints, names starting with `_`, long database names, malformed
//! `Authorization` headers, and `_revs_diff` bodies the size a replicator sends.

use base64::Engine;

use super::logins::PASSWORD;
use super::*;

/// CouchDB's `illegal_database_name` reason (`chttpd:error_info`).
fn illegal_name_reason(name: &str) -> String {
    format!(
        "Name: '{name}'. Only lowercase characters (a-z), digits (0-9), and any of the characters _, $, (, ), +, -, \
         and / are allowed. Must begin with a letter."
    )
}

async fn as_login(e: &Endpoint, login: &str, method: Method, path: &str) -> Result<Answer, Failed> {
    Answer::read(e.client.request(method, e.url(path)).basic_auth(login, Some(PASSWORD)).send().await?).await
}

pub(super) async fn admin_endpoints_names_and_headers(e: Endpoint) -> TestResult {
    // `_active_tasks` (`chttpd_misc:handle_task_status_req`) and every `_scheduler` path
    // (`chttpd_auth_request:server_authorization_check`) are a server admin's: 401 otherwise.
    for path in ["/_active_tasks", "/_scheduler/jobs", "/_scheduler/docs"] {
        let refused = as_login(&e, "alice", Method::GET, path).await?.expect(401, path)?;
        let body = json!({ "error": "unauthorized", "reason": "You are not a server admin." });
        check(refused.body == body, || format!("{path} as alice: {}", refused.body))?;
        as_login(&e, "admin", Method::GET, path).await?.expect(200, path)?;
    }

    // A name starting with `_` that is no system database breaks the name rule: 400 for an
    // admin (`fabric_db_create:validate_dbname`), 401 for anyone else (`require_admin` first).
    let refused = as_login(&e, "admin", Method::PUT, "/_name").await?.expect(400, "PUT /_name")?;
    let body = json!({ "error": "illegal_database_name", "reason": illegal_name_reason("_name") });
    check(refused.body == body, || format!("PUT /_name: {}", refused.body))?;

    // On the CouchDB backend the databases are the backend server's own (pouchdb-server in these
    // tests), and so are its answers about their names.
    if e.backend != "couchdb" {
        long_names(&e).await?;
    }

    // `Authorization: Basic: <base64>` (PouchDB's test helper) and other headers that are not
    // `Basic <credentials>` are ignored (`couch_httpd_auth:basic_name_pw`): an anonymous client.
    let credentials = base64::engine::general_purpose::STANDARD.encode(format!("admin:{PASSWORD}"));
    for header in [format!("Basic: {credentials}"), format!("Basic:{credentials}"), "Bearer abc".to_owned()] {
        let welcome = e.client.get(e.url("/")).header("Authorization", &header).send().await?;
        Answer::read(welcome).await?.expect(200, &format!("GET / with {header:?}"))?;
        let db = e.client.get(e.url(&format!("/{DB}"))).header("Authorization", &header).send().await?;
        same_error(&Answer::read(db).await?, "007-auth-none")?;
    }
    Ok(())
}

/// Documents a `_revs_diff` below names, with 140 revisions each: 2.6 MB.
const IDS: usize = 500;

/// A `_revs_diff` of 2.5 MB, as a replicator sends for a batch of conflicted documents, is
/// answered on the data-store database and on another one (docs/bounds.md: the request limit).
pub(super) async fn revs_diff_takes_replicator_sized_bodies(e: Endpoint) -> TestResult {
    let revs: Vec<String> = (0..140).map(|i| format!("{}-{:032x}", i + 1, i)).collect();
    let body = |id: &dyn Fn(usize) -> String| {
        let asked: serde_json::Map<String, Value> = (0..IDS).map(|i| (id(i), json!(revs))).collect();
        Value::Object(asked)
    };
    let data_store =
        body(&|i| doc("u", "ns", &format!("k{i}"), json!(0))["_id"].as_str().unwrap_or_default().to_owned());
    check(data_store.to_string().len() > 2_500_000, || "the body is 2.5 MB".to_owned())?;
    let answer = e.post(&format!("/{DB}/_revs_diff"), data_store).await?.expect(200, "data-store _revs_diff")?;
    check(answer.body.as_object().is_some_and(|missing| missing.len() == IDS), || "every id is missing".to_owned())?;
    let other = fresh_db_named(&e, "revsdiff", "big").await?;
    let answer = e
        .post(&format!("/{other}/_revs_diff"), body(&|i| format!("doc-{i:06}")))
        .await?
        .expect(200, "database _revs_diff")?;
    check(answer.body.as_object().is_some_and(|missing| missing.len() == IDS), || "every id is missing".to_owned())
}

/// What a per-user login is shown of the data-store database's counts does not move with other
/// users' writes: `doc_count`, `_all_docs`' `total_rows` and `_changes`' `pending`
/// (docs/couchdb-api.md, "Counts").
pub(super) async fn per_user_counts_ignore_other_users(endpoint: Endpoint) -> TestResult {
    let e = &endpoint;
    let seed = |user: &str, from: usize| {
        let docs: Vec<Value> = (from..from + 3).map(|i| doc(user, "ns", &format!("k{i}"), json!(i))).collect();
        json!({ "docs": docs })
    };
    let write = |body: Value| async move {
        let sent = e.client.post(e.url(&format!("/{DB}/_bulk_docs"))).basic_auth("admin", Some(PASSWORD)).json(&body);
        Answer::read(sent.send().await?).await?.expect(201, "admin writes")
    };
    write(seed("alice", 0)).await?;
    let counts = || async {
        let info = as_login(e, "alice", Method::GET, &format!("/{DB}")).await?.expect(200, "GET db")?;
        let all = as_login(e, "alice", Method::GET, &format!("/{DB}/_all_docs")).await?.expect(200, "_all_docs")?;
        let feed =
            as_login(e, "alice", Method::GET, &format!("/{DB}/_changes?limit=1")).await?.expect(200, "_changes")?;
        Ok::<_, Failed>((info.body["doc_count"].clone(), all.body["total_rows"].clone(), feed.body["pending"].clone()))
    };
    let before = counts().await?;
    write(seed("bob", 0)).await?;
    write(seed("bob", 3)).await?;
    let after = counts().await?;
    check(before == after, || format!("alice's counts moved with bob's writes: {before:?} then {after:?}"))?;
    // An admin sees the store's counts (DynamoDB's data-store count is its hours-stale estimate).
    if e.backend == "dynamodb" {
        return Ok(());
    }
    let info = as_login(e, "admin", Method::GET, &format!("/{DB}")).await?.expect(200, "GET db as admin")?;
    check(info.body["doc_count"] == json!(9), || format!("admin's doc_count: {}", info.body))
}

/// Long names: one of `$` (a single path segment for CouchDB, created up to 238 bytes) and one of
/// `/` (segments for CouchDB), both created; past 238 bytes, CouchDB's `database_name_too_long`;
/// never a 500.
async fn long_names(e: &Endpoint) -> TestResult {
    let dollars = format!("a{}", "$".repeat(119));
    let slashes = format!("b{}", "/b".repeat(59));
    for name in [&dollars, &slashes] {
        let path = format!("/{}", name.replace('$', "%24").replace('/', "%2F"));
        as_login(e, "admin", Method::PUT, &path).await?.expect(201, &format!("PUT {name}"))?;
        let info = as_login(e, "admin", Method::GET, &path).await?.expect(200, &format!("GET {name}"))?;
        check(info.body["db_name"] == json!(name), || format!("db_name of {name}: {}", info.body))?;
        as_login(e, "admin", Method::DELETE, &path).await?.expect(200, &format!("DELETE {name}"))?;
    }
    let too_long = "c".repeat(239);
    let refused = as_login(e, "admin", Method::PUT, &format!("/{too_long}")).await?.expect(400, "239 bytes")?;
    let body = json!({
        "error": "database_name_too_long",
        "reason": format!("At least one path segment of `{too_long}` is too long."),
    });
    check(refused.body == body, || format!("a 239-byte name: {}", refused.body))?;
    let longest = format!("d{}", "$".repeat(237));
    let created = as_login(e, "admin", Method::PUT, &format!("/{}", longest.replace('$', "%24"))).await?;
    check(created.status == 201 || (e.backend == "dynamodb" && created.status == 400), || {
        format!("a 238-byte name: {} {}", created.status, created.body)
    })?;

    Ok(())
}
