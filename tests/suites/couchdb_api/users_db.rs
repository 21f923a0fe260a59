//! The `_users` database (issue 37): it exists on every backend, a password written in clear is
//! stored as CouchDB 3.4.3's hash, its users log in with Basic and cookies and carry their roles
//! into `_security`, a changed password ends the old one and its cookies on every instance,
//! CouchDB's rules and refusals (`fixtures/couchdb-3.4.3/055`–`066`), and a user document whose
//! hash the real CouchDB made, replicated in with `new_edits: false`, logs in with its password.
//!
//! On the CouchDB backend `_users` is that server's own (it hashes and checks its documents'
//! rules itself: pouchdb-server, CI's stand-in, with its own hash parameters), so the stored
//! fields' exact values are checked on the other backends only.

use super::*;

/// The configured admin's password (`roles::roles_config`).
const ADMIN_PASSWORD: &str = "battery staple";

/// The bound on one document's body, small enough to pass with a `_users` document.
const MAX_DOCUMENT_BYTES: usize = 65_536;

/// `roles::roles_config`'s logins (the admin `admin`), documents bounded to [`MAX_DOCUMENT_BYTES`].
pub(super) fn config() -> Result<String, Failed> {
    Ok(format!("couchdb_max_document_bytes = {MAX_DOCUMENT_BYTES}\n{}", super::roles::roles_config()?))
}

/// A user of `_users` documents, for the trials of one run (the CouchDB backend's server is
/// shared by runs).
fn unique_name(tag: &str) -> Result<String, Failed> {
    let mut random = [0u8; 4];
    getrandom::fill(&mut random).map_err(|err| err.to_string())?;
    Ok(format!("u37-{tag}-{}", hex::encode(random)))
}

fn user_path(name: &str) -> String {
    format!("/_users/org.couchdb.user:{name}")
}

/// One request with Basic credentials, or none.
async fn send(
    e: &Endpoint,
    login: Option<(&str, &str)>,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> Result<Answer, Failed> {
    send_to(&e.client, &e.root, login, method, path, body).await
}

async fn send_to(
    client: &reqwest::Client,
    root: &str,
    login: Option<(&str, &str)>,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> Result<Answer, Failed> {
    let mut request = client.request(method, format!("{root}{path}")).header("Accept", "application/json");
    if let Some((name, password)) = login {
        request = request.basic_auth(name, Some(password));
    }
    if let Some(body) = body {
        request = request.json(&body);
    }
    Answer::read(request.send().await?).await
}

fn admin() -> Option<(&'static str, &'static str)> {
    Some(("admin", ADMIN_PASSWORD))
}

/// `POST /_session` as `name`: the `AuthSession=…` pair to send back.
async fn session_cookie(e: &Endpoint, name: &str, password: &str) -> Result<String, Failed> {
    let login = e.client.post(e.url("/_session")).json(&json!({ "name": name, "password": password })).send().await?;
    let set_cookie = login.headers().get("set-cookie").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    Answer::read(login).await?.expect(200, "POST /_session")?;
    Ok(set_cookie.split(';').next().unwrap_or_default().to_owned())
}

/// `GET {path}` with a session cookie.
async fn with_cookie(e: &Endpoint, cookie: &str, path: &str) -> Result<Answer, Failed> {
    // `Accept` as `Endpoint::call` sends it: pouchdb-server labels JSON `text/plain` without it.
    let request = e.client.get(e.url(path)).header("Cookie", cookie).header("Accept", "application/json");
    Answer::read(request.send().await?).await
}

/// The status and error body of `answer` must be the transcript's.
fn as_transcript(answer: &Answer, transcript: &str, what: &str) -> TestResult {
    let expected = fixture(transcript);
    check(
        answer.status.as_u16() as u64 == expected["response"]["status"].as_u64().unwrap_or_default()
            && answer.body == expected["response"]["body"],
        || format!("{what}: {} {} (CouchDB 3.4.3: {})", answer.status, answer.body, expected["response"]),
    )
}

/// Create, read back, log in, roles in `_security`, CouchDB's refusals, a password change seen
/// on another instance, and a configured admin's name keeping its configured password.
pub(super) async fn users_db_logins(e: Endpoint) -> TestResult {
    let on_couchdb = e.backend == "couchdb";
    let info = send(&e, admin(), Method::GET, "/_users", None).await?.expect(200, "GET /_users")?;
    check(info.body["db_name"] == "_users", || format!("GET /_users: {}", info.body))?;
    if !on_couchdb {
        let security = send(&e, admin(), Method::GET, "/_users/_security", None).await?.expect(200, "_security")?;
        check(security.body == couchdb_body("056-users-security"), || format!("_users' _security: {}", security.body))?;
    }
    let bob = unique_name("bob")?;
    let db = format!("zz-{}", unique_name("readers")?);
    let outcome = async {
        created_and_stored_as_couchdb(&e, &bob, on_couchdb).await?;
        logins_and_roles(&e, &bob, &db).await?;
        refusals_as_couchdb(&e, &bob).await?;
        password_change_ends_the_old_one(&e, &bob, &db).await
    }
    .await;
    // Names of this run only, removed even after a failure (the CouchDB backend's server is shared).
    send(&e, admin(), Method::DELETE, &format!("/{db}"), None).await?;
    delete_user(&e, &bob).await?;
    outcome
}

/// The admin creates a user with a clear password: CouchDB's hash fields are stored, not it.
async fn created_and_stored_as_couchdb(e: &Endpoint, bob: &str, on_couchdb: bool) -> TestResult {
    let doc = json!({ "name": bob, "type": "user", "roles": ["readers"], "password": "pw-one" });
    send(e, admin(), Method::PUT, &user_path(bob), Some(doc)).await?.expect(201, "admin creates a user")?;
    let stored = send(e, admin(), Method::GET, &user_path(bob), None).await?.expect(200, "admin reads it")?;
    check(stored.body.get("password").is_none() && stored.body["password_scheme"] == "pbkdf2", || {
        format!("stored user document: {}", stored.body)
    })?;
    // Every write path hashes: `POST /_users` and `_bulk_docs` too.
    for (how, path) in [("POST /_users", "/_users"), ("_bulk_docs", "/_users/_bulk_docs")] {
        let other = unique_name("other")?;
        let doc = json!({ "_id": format!("org.couchdb.user:{other}"), "name": other, "type": "user", "roles": [],
            "password": "pw-other" });
        let body = if path.ends_with("_bulk_docs") { json!({ "docs": [doc] }) } else { doc };
        send(e, admin(), Method::POST, path, Some(body)).await?.expect(201, how)?;
        let written = send(e, admin(), Method::GET, &user_path(&other), None).await?.expect(200, how)?;
        check(written.body.get("password").is_none() && written.body["derived_key"].is_string(), || {
            format!("written by {how}: {}", written.body)
        })?;
        send(e, Some((&other, "pw-other")), Method::GET, "/_session", None).await?.expect(200, how)?;
        delete_user(e, &other).await?;
    }
    if on_couchdb {
        return Ok(());
    }
    let couchdb = couchdb_body("055-users-doc-hashed-by-couchdb");
    let fields = |doc: &Value| doc.as_object().map(|o| o.keys().cloned().collect::<Vec<_>>()).unwrap_or_default();
    let hex_of = |value: &Value, len: usize| {
        value.as_str().is_some_and(|t| t.len() == len && t.bytes().all(|b| b.is_ascii_hexdigit()))
    };
    check(
        fields(&stored.body) == fields(&couchdb)
            && stored.body["pbkdf2_prf"] == "sha256"
            && stored.body["iterations"] == 600_000
            && hex_of(&stored.body["salt"], 32)
            && hex_of(&stored.body["derived_key"], 64)
            && stored.body["roles"] == json!(["readers"]),
        || format!("stored {} (CouchDB 3.4.3 stores {couchdb})", stored.body),
    )
}

/// Basic and cookie logins carry the document's roles; `_security` admits by them.
async fn logins_and_roles(e: &Endpoint, bob: &str, db: &str) -> TestResult {
    let basic = Some((bob, "pw-one"));
    let who = send(e, basic, Method::GET, "/_session", None).await?.expect(200, "GET /_session as bob")?;
    check(who.body["userCtx"] == json!({ "name": bob, "roles": ["readers"] }), || format!("bob: {}", who.body))?;
    send(e, Some((bob, "pw-wrong")), Method::GET, "/_session", None).await?.expect(401, "a wrong password")?;
    let cookie = session_cookie(e, bob, "pw-one").await?;
    let who = with_cookie(e, &cookie, "/_session").await?.expect(200, "GET /_session with bob's cookie")?;
    check(who.body["userCtx"]["name"] == json!(bob), || format!("bob's cookie: {}", who.body))?;
    send(e, admin(), Method::PUT, &format!("/{db}"), None).await?.expect(201, "admin creates a database")?;
    let security = json!({ "members": { "roles": ["readers"] } });
    send(e, admin(), Method::PUT, &format!("/{db}/_security"), Some(security)).await?.expect(200, "its _security")?;
    send(e, basic, Method::GET, &format!("/{db}"), None).await?.expect(200, "bob (readers) opens it")?;
    with_cookie(e, &cookie, &format!("/{db}")).await?.expect(200, "bob's cookie opens it")?;
    // A user without the role is refused with CouchDB's 403.
    let eve = unique_name("eve")?;
    let doc = json!({ "name": eve, "type": "user", "roles": [], "password": "pw-eve" });
    send(e, admin(), Method::PUT, &user_path(&eve), Some(doc)).await?.expect(201, "admin creates eve")?;
    let refused = send(e, Some((&eve, "pw-eve")), Method::GET, &format!("/{db}"), None).await?;
    as_transcript(&refused, "057-users-own-doc-non-admin", "eve opens the readers' database")?;
    delete_user(e, &eve).await
}

/// What CouchDB 3.4.3 refuses on `_users`, with its statuses and bodies.
async fn refusals_as_couchdb(e: &Endpoint, bob: &str) -> TestResult {
    if on_pouchdb_server(e) {
        // pouchdb-server's `_users` has neither CouchDB's admin-only `_security` nor its rules.
        return Ok(());
    }
    let basic = Some((bob, "pw-one"));
    let own = send(e, basic, Method::GET, &user_path(bob), None).await?;
    as_transcript(&own, "057-users-own-doc-non-admin", "bob reads his own document")?;
    let listed = send(e, basic, Method::GET, "/_users/_all_docs", None).await?;
    as_transcript(&listed, "058-users-all-docs-non-admin", "bob lists _users")?;
    let feed = send(e, basic, Method::GET, "/_users/_changes", None).await?;
    as_transcript(&feed, "059-users-changes-non-admin", "bob reads _users' _changes")?;
    let found = send(e, basic, Method::POST, "/_users/_find", Some(json!({ "selector": {} }))).await?;
    as_transcript(&found, "067-users-find-non-admin", "bob's _find on _users")?;
    let view = send(e, basic, Method::GET, "/_users/_design/_auth/_view/none", None).await?;
    as_transcript(&view, "068-users-view-non-admin", "bob's view query on _users")?;
    let stored = send(e, admin(), Method::GET, &user_path(bob), None).await?.expect(200, "admin reads bob")?;
    let rev = stored.body["_rev"].clone();
    let promoted = json!({ "_rev": rev, "name": bob, "type": "user", "roles": ["boss"], "password": "x" });
    let own_roles = send(e, basic, Method::PUT, &user_path(bob), Some(promoted)).await?;
    as_transcript(&own_roles, "061-users-own-roles-non-admin", "bob gives himself a role")?;
    // A `_users` write is bounded as any document's (on the CouchDB backend: CouchDB's bound).
    if e.backend != "couchdb" {
        let large = json!({ "name": "u37x", "type": "user", "roles": [], "password": "x".repeat(MAX_DOCUMENT_BYTES) });
        let refused = send(e, admin(), Method::PUT, &user_path("u37x"), Some(large)).await?.expect(413, "too large")?;
        check(refused.body["error"] == "document_too_large", || format!("a large user document: {}", refused.body))?;
    }
    let anonymous = json!({ "name": "u37x", "type": "user", "roles": [], "password": "x" });
    let signed_up = send(e, None, Method::PUT, &user_path("u37x"), Some(anonymous)).await?;
    as_transcript(&signed_up, "065-users-put-anonymous", "an anonymous sign-up")?;
    let security = json!({ "members": {}, "admins": {} });
    let edited = send(e, admin(), Method::PUT, "/_users/_security", Some(security)).await?;
    as_transcript(&edited, "060-users-put-security", "admin edits _users' _security")?;
    let refused = [
        ("062-users-bad-type", json!({ "name": "u37x", "type": "person", "roles": [] }), "u37x"),
        ("063-users-system-role", json!({ "name": "u37x", "type": "user", "roles": ["_admin"] }), "u37x"),
        (
            "064-users-password-not-string",
            json!({ "name": "u37x", "type": "user", "roles": [], "password": 123 }),
            "u37x",
        ),
        ("066-users-bad-id", json!({ "name": "u37x", "type": "user", "roles": [] }), "u37y"),
    ];
    for (transcript, doc, id_name) in refused {
        let answer = send(e, admin(), Method::PUT, &user_path(id_name), Some(doc)).await?;
        as_transcript(&answer, transcript, transcript)?;
    }
    Ok(())
}

/// The admin changes bob's password on one instance: on another, which had verified the old one,
/// the old password fails at the next request and the new one works; bob's old cookie stops.
async fn password_change_ends_the_old_one(e: &Endpoint, bob: &str, db: &str) -> TestResult {
    // The embedded store admits one process (its databases' files are locked): one instance.
    let other = match e.backend {
        "embedded" => None,
        _ => Some(e.beside_configured().await?),
    };
    let (client, root) = other.as_ref().map_or((&e.client, &e.root), |other| (&other.client, &other.root));
    let path = format!("/{db}");
    let on_other = |password: &'static str| send_to(client, root, Some((bob, password)), Method::GET, &path, None);
    on_other("pw-one").await?.expect(200, "bob on the other instance")?;
    let cookie = session_cookie(e, bob, "pw-one").await?;
    let stored = send(e, admin(), Method::GET, &user_path(bob), None).await?.expect(200, "admin reads bob")?;
    let mut changed = stored.body.clone();
    changed["password"] = json!("pw-two");
    send(e, admin(), Method::PUT, &user_path(bob), Some(changed)).await?.expect(201, "admin changes bob's password")?;
    let old = on_other("pw-one").await?;
    check(old.status == StatusCode::UNAUTHORIZED && old.body["reason"] == "Name or password is incorrect.", || {
        format!("the old password on the other instance: {} {}", old.status, old.body)
    })?;
    on_other("pw-two").await?.expect(200, "the new password on the other instance")?;
    let who = with_cookie(e, &cookie, "/_session").await?.expect(200, "GET /_session with the old cookie")?;
    check(who.body["userCtx"]["name"].is_null(), || format!("the old cookie still names {}", who.body))?;
    with_cookie(e, &cookie, &format!("/{db}")).await?.expect(401, "the old cookie on the database")?;
    Ok(())
}

/// A user document as the real CouchDB 3.4.3 stored it (its hash made there from `secret37`),
/// replicated in with `new_edits: false` as `migrate --db _users` writes it, logs in with that
/// password; a stored hash claiming 10^9 iterations fails quickly as a wrong password does; a
/// `_users` document named as a configured admin does not replace the admin's password.
pub(super) async fn users_db_couchdb_hash_moves_in(e: Endpoint) -> TestResult {
    let recorded = couchdb_body("055-users-doc-hashed-by-couchdb");
    let moved = json!({ "new_edits": false, "docs": [recorded.clone()] });
    send(&e, admin(), Method::POST, "/_users/_bulk_docs", Some(moved)).await?.expect(201, "replicated in")?;
    let stored = send(&e, admin(), Method::GET, "/_users/org.couchdb.user:u37bob", None).await?.expect(200, "read")?;
    check(stored.body == recorded, || format!("kept as written: {} (written {recorded})", stored.body))?;
    let who = send(&e, Some(("u37bob", "secret37")), Method::GET, "/_session", None).await?.expect(200, "its login")?;
    check(who.body["userCtx"] == json!({ "name": "u37bob", "roles": [] }), || format!("u37bob: {}", who.body))?;
    send(&e, Some(("u37bob", "secret38")), Method::GET, "/_session", None).await?.expect(401, "a wrong password")?;

    // A second live leaf: CouchDB refuses the login until the conflict is resolved
    // (pouchdb-server, CI's stand-in, keeps no such conflict in its `_users`).
    if !on_pouchdb_server(&e) {
        conflicted_login_refused(&e, &recorded).await?;
    }

    let slow = unique_name("slow")?;
    let mut claimed = recorded.clone();
    claimed["_id"] = json!(format!("org.couchdb.user:{slow}"));
    claimed["name"] = json!(slow);
    claimed["iterations"] = json!(1_000_000_000u64);
    let moved = json!({ "new_edits": false, "docs": [claimed] });
    send(&e, admin(), Method::POST, "/_users/_bulk_docs", Some(moved)).await?.expect(201, "a costly hash")?;
    let started = std::time::Instant::now();
    let refused = send(&e, Some((&slow, "secret37")), Method::GET, "/_session", None).await?;
    check(refused.status == StatusCode::UNAUTHORIZED && started.elapsed() < Duration::from_secs(20), || {
        format!("10^9 iterations: {} {} after {:?}", refused.status, refused.body, started.elapsed())
    })?;

    if e.backend != "couchdb" {
        let shadow = json!({ "name": "admin", "type": "user", "roles": [], "password": "not the admin's" });
        send(&e, admin(), Method::PUT, "/_users/org.couchdb.user:admin", Some(shadow)).await?.expect(201, "shadow")?;
        send(&e, Some(("admin", "not the admin's")), Method::GET, "/_session", None)
            .await?
            .expect(401, "a _users document does not replace a configured admin's password")?;
        send(&e, admin(), Method::GET, "/_users", None).await?.expect(200, "the configured admin still logs in")?;
        delete_user(&e, "admin").await?;
    }
    delete_user(&e, &slow).await?;
    delete_user(&e, "u37bob").await
}

/// A user document with two live leaves does not log in (CouchDB's 401), and does again once one
/// leaf is gone.
async fn conflicted_login_refused(e: &Endpoint, recorded: &Value) -> TestResult {
    let mut conflicting = recorded.clone();
    conflicting["_rev"] = json!("1-00000000000000000000000000000001");
    let moved = json!({ "new_edits": false, "docs": [conflicting] });
    send(e, admin(), Method::POST, "/_users/_bulk_docs", Some(moved)).await?.expect(201, "a conflicting leaf")?;
    let refused = send(e, Some(("u37bob", "secret37")), Method::GET, "/_session", None).await?;
    as_transcript(&refused, "069-users-login-conflicted", "a conflicted user's login")?;
    let purge = json!({ "org.couchdb.user:u37bob": ["1-00000000000000000000000000000001"] });
    send(e, admin(), Method::POST, "/_users/_purge", Some(purge)).await?.expect(201, "the conflicting leaf purged")?;
    send(e, Some(("u37bob", "secret37")), Method::GET, "/_session", None).await?.expect(200, "resolved")?;
    Ok(())
}

/// Removes a user document, purged where the server purges (the CouchDB backend's server is
/// shared by runs, and a recorded revision replicated in again must be new to it).
async fn delete_user(e: &Endpoint, name: &str) -> TestResult {
    let stored = send(e, admin(), Method::GET, &user_path(name), None).await?;
    let Some(rev) = stored.body["_rev"].as_str() else { return Ok(()) };
    let purge = json!({ format!("org.couchdb.user:{name}"): [rev] });
    let purged = send(e, admin(), Method::POST, "/_users/_purge", Some(purge)).await?;
    if purged.status.is_success() {
        return Ok(());
    }
    let path = format!("{}?rev={rev}", user_path(name));
    let deleted = send(e, admin(), Method::DELETE, &path, None).await?;
    check(deleted.status.is_success(), || format!("DELETE {path}: {} {}", deleted.status, deleted.body))
}
