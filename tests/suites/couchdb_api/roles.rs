//! Logins with roles, and `_security` deciding who uses each database besides the data-store one
//! (issue 24, "Access"): members and database admins by name and by role, what each may do
//! (CouchDB 3.4's `couch_db` checks: a member writes documents but not design documents nor
//! `_security`; a database admin does both), CouchDB's 401/403 refusals, `_session`'s roles, and
//! the data-store database still refusing a login of the other databases and still scoping a
//! per-user login to its user.

use super::*;

pub(super) const PASSWORD: &str = "battery staple";

/// `admin`; `alice`, a per-user login of the data-store database with the role `readers`; `carol`
/// (role `readers`), `dave` (role `editors`) and `erin` (no role), logins of the other databases
/// only.
pub(super) fn roles_config() -> Result<String, Failed> {
    let hash = agentstore::couchdb_api::auth::hash_password(PASSWORD)?;
    let login =
        |name: &str, rest: &str| format!("[[couchdb_users]]\nname = \"{name}\"\npassword_hash = \"{hash}\"\n{rest}\n");
    Ok([
        login("admin", "admin = true"),
        login("alice", "user = \"alice\"\nroles = [\"readers\"]"),
        login("carol", "roles = [\"readers\"]"),
        login("dave", "roles = [\"editors\"]"),
        login("erin", ""),
    ]
    .concat())
}

/// Names unique to this trial: on the CouchDB backend the server is shared with other trials.
const SHARED: &str = "zz-roles-shared";
const PRIVATE: &str = "zz-roles-private";

pub(super) async fn roles_and_security(e: Endpoint) -> TestResult {
    let as_login = |name: &str, method: Method, path: &str, body: Option<Value>| {
        // `Accept` as `Endpoint::call` sends it: pouchdb-server labels JSON `text/plain` without it.
        let mut request =
            e.client.request(method, e.url(path)).header("Accept", "application/json").basic_auth(name, Some(PASSWORD));
        if let Some(body) = body {
            request = request.json(&body);
        }
        async move { Answer::read(request.send().await?).await }
    };
    for db in [SHARED, PRIVATE] {
        as_login("admin", Method::PUT, &format!("/{db}"), None).await?.expect(201, "admin creates a database")?;
    }
    let shared_security = json!({
        "admins": { "names": [], "roles": ["editors"] },
        "members": { "names": [], "roles": ["readers"] }
    });
    as_login("admin", Method::PUT, &format!("/{SHARED}/_security"), Some(shared_security.clone()))
        .await?
        .expect(200, "admin sets the shared database's _security")?;
    as_login("admin", Method::PUT, &format!("/{PRIVATE}/_security"), Some(json!({ "members": { "names": ["erin"] } })))
        .await?
        .expect(200, "admin sets the private database's _security")?;

    // Admitted by role to one database, refused by the other with CouchDB's 403.
    as_login("carol", Method::GET, &format!("/{SHARED}"), None).await?.expect(200, "carol (readers) opens shared")?;
    let refused =
        as_login("carol", Method::GET, &format!("/{PRIVATE}"), None).await?.expect(403, "carol opens private")?;
    check(refused.body == json!({ "error": "forbidden", "reason": "You are not allowed to access this db." }), || {
        format!("carol on private: {}", refused.body)
    })?;
    as_login("erin", Method::GET, &format!("/{PRIVATE}/_all_docs"), None)
        .await?
        .expect(200, "erin (by name) lists private")?;
    as_login("erin", Method::GET, &format!("/{SHARED}"), None).await?.expect(403, "erin (no role) opens shared")?;
    // A per-user login of the data-store database reaches other databases by its roles too.
    as_login("alice", Method::GET, &format!("/{SHARED}"), None).await?.expect(200, "alice (readers) opens shared")?;
    as_login("alice", Method::GET, &format!("/{PRIVATE}"), None).await?.expect(403, "alice opens private")?;
    // Without credentials: CouchDB's 401.
    let anonymous = e.get(&format!("/{SHARED}")).await?.expect(401, "anonymous opens shared")?;
    check(anonymous.body["error"] == "unauthorized", || format!("anonymous: {}", anonymous.body))?;

    // A member writes and reads documents, and reads `_security`.
    let written = as_login("carol", Method::PUT, &format!("/{SHARED}/note"), Some(json!({ "text": "hi" })))
        .await?
        .expect(201, "carol writes a document")?;
    let rev = written.rev()?;
    let read = as_login("carol", Method::GET, &format!("/{SHARED}/note"), None).await?.expect(200, "carol reads it")?;
    check(read.body["text"] == "hi" && read.body["_rev"] == rev.as_str(), || format!("note: {}", read.body))?;
    as_login("carol", Method::GET, &format!("/{SHARED}/_security"), None)
        .await?
        .expect(200, "carol reads _security")?;
    // ... but not a design document, by PUT or by POST, and not `_security`: CouchDB's 403.
    let ddoc = json!({ "views": { "all": { "map": "function (doc) { emit(doc._id); }" } } });
    let refused = as_login("carol", Method::PUT, &format!("/{SHARED}/_design/app"), Some(ddoc.clone()))
        .await?
        .expect(403, "carol writes a design document")?;
    check(refused.body == json!({ "error": "forbidden", "reason": "You are not a db or server admin." }), || {
        format!("carol's design document: {}", refused.body)
    })?;
    let mut posted = ddoc.clone();
    posted["_id"] = json!("_design/posted");
    as_login("carol", Method::POST, &format!("/{SHARED}"), Some(posted))
        .await?
        .expect(403, "carol posts a design document")?;
    let bulk = json!({ "docs": [{ "_id": "plain" }, { "_id": "_design/bulk" }] });
    let bulk = as_login("carol", Method::POST, &format!("/{SHARED}/_bulk_docs"), Some(bulk)).await?;
    if e.backend == "couchdb" {
        // Passed on as it came, the request cannot be split: refused whole.
        bulk.expect(403, "carol's _bulk_docs with a design document (forwarded)")?;
    } else {
        // CouchDB refuses the design document alone.
        let bulk = bulk.expect(201, "carol's _bulk_docs with a design document")?;
        check(bulk.body[0]["ok"] == true && bulk.body[1]["error"] == "forbidden", || format!("rows: {}", bulk.body))?;
    }
    as_login("carol", Method::GET, &format!("/{SHARED}/_design/bulk"), None)
        .await?
        .expect(404, "no design document")?;
    let refused = as_login("carol", Method::PUT, &format!("/{SHARED}/_security"), Some(json!({})))
        .await?
        .expect(403, "carol changes _security")?;
    check(refused.body["error"] == "forbidden", || format!("carol's _security: {}", refused.body))?;
    as_login("carol", Method::POST, &format!("/{SHARED}/_compact"), Some(json!({})))
        .await?
        .expect(401, "carol compacts")?;

    // A database admin by role writes design documents and `_security`.
    as_login("dave", Method::PUT, &format!("/{SHARED}/_design/app"), Some(ddoc))
        .await?
        .expect(201, "dave (editors) writes a design document")?;
    let mut widened = shared_security.clone();
    widened["members"]["names"] = json!(["erin"]);
    as_login("dave", Method::PUT, &format!("/{SHARED}/_security"), Some(widened))
        .await?
        .expect(200, "dave (editors) changes _security")?;
    as_login("erin", Method::GET, &format!("/{SHARED}/note"), None).await?.expect(200, "erin, now a member, reads")?;
    as_login("dave", Method::GET, &format!("/{PRIVATE}"), None).await?.expect(403, "dave opens private")?;

    // `_session` names the login and its roles.
    let session = as_login("carol", Method::GET, "/_session", None).await?.expect(200, "carol's _session")?;
    check(session.body["userCtx"] == json!({ "name": "carol", "roles": ["readers"] }), || {
        format!("carol's _session: {}", session.body)
    })?;
    let session = as_login("admin", Method::GET, "/_session", None).await?.expect(200, "admin's _session")?;
    check(session.body["userCtx"] == json!({ "name": "admin", "roles": ["_admin"] }), || {
        format!("admin's _session: {}", session.body)
    })?;
    // Database names are for server admins (CouchDB 3's default `admin_only_all_dbs = true`).
    let refused = as_login("carol", Method::GET, "/_all_dbs", None).await?.expect(401, "carol lists databases")?;
    check(refused.body["reason"] == "You are not a server admin.", || format!("_all_dbs: {}", refused.body))?;

    // The data-store database refuses a login of the other databases only, with a reason...
    for path in [format!("/{DB}"), format!("/{DB}/_all_docs"), format!("/{DB}/_changes")] {
        let refused =
            as_login("carol", Method::GET, &path, None).await?.expect(403, "carol on the data-store database")?;
        check(
            refused.body["error"] == "forbidden"
                && refused.body["reason"].as_str().is_some_and(|r| r.contains("no user of the data-store database")),
            || format!("carol on {path}: {}", refused.body),
        )?;
    }
    // ... and still scopes a per-user login to its own user.
    let docs = json!({ "docs": [doc("alice", "ns", "k", json!(1)), doc("bob", "ns", "k", json!(2))] });
    as_login("admin", Method::POST, &format!("/{DB}/_bulk_docs"), Some(docs)).await?.expect(201, "admin seeds")?;
    let listed = as_login("alice", Method::GET, &format!("/{DB}/_all_docs"), None).await?.expect(200, "alice lists")?;
    let ids: Vec<&str> =
        listed.body["rows"].as_array().into_iter().flatten().filter_map(|row| row["id"].as_str()).collect();
    check(ids.len() == 1 && ids[0].starts_with("alice:"), || format!("alice lists {ids:?}"))?;
    let bobs = doc("bob", "ns", "k", json!(2));
    as_login("alice", Method::GET, &path_of(bobs["_id"].as_str().unwrap_or_default()), None)
        .await?
        .expect(403, "alice reads bob's")?;

    for db in [SHARED, PRIVATE] {
        as_login("admin", Method::DELETE, &format!("/{db}"), None).await?.expect(200, "admin deletes a database")?;
    }
    Ok(())
}
