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
    // (`chttpd_auth_request:server_authorization_check`) are a server admin's: 401 otherwise;
    // so are `_membership` and `_node` (the same check; a real CouchDB 3.4.3 answered 401 to a
    // login without roles for each of these paths, 2026-11-29).
    for path in ["/_active_tasks", "/_scheduler/jobs", "/_scheduler/docs", "/_membership", "/_node/_local"] {
        let refused = as_login(&e, "alice", Method::GET, path).await?.expect(401, path)?;
        let body = json!({ "error": "unauthorized", "reason": "You are not a server admin." });
        check(refused.body == body, || format!("{path} as alice: {}", refused.body))?;
        as_login(&e, "admin", Method::GET, path).await?.expect(200, path)?;
    }
    // Runs started in the service (not CouchDB's: docs/migration.md) are a server admin's too,
    // refused as `_active_tasks`, which lists them, is; an admin's empty start is a 400 and a
    // cancel of no run a 404.
    for (method, path) in [(Method::POST, "/_agentstore/runs"), (Method::DELETE, "/_agentstore/runs/no-such-run")] {
        let refused = as_login(&e, "alice", method.clone(), path).await?.expect(401, path)?;
        let body = json!({ "error": "unauthorized", "reason": "You are not a server admin." });
        check(refused.body == body, || format!("{method} {path} as alice: {}", refused.body))?;
    }
    let request = e.client.post(e.url("/_agentstore/runs")).basic_auth("admin", Some(PASSWORD)).json(&json!({}));
    Answer::read(request.send().await?).await?.expect(400, "POST /_agentstore/runs {}")?;
    // Past a start's bounds (docs/bounds.md: a side of 2048 bytes, 100 names): 400 naming them.
    let names: Vec<String> = (0..101).map(|i| format!("db{i}")).collect();
    for (start, bound) in [
        (json!({"command": "verify", "source": "x".repeat(2049), "target": "http://b/"}), "2048 bytes"),
        (json!({"command": "verify", "source": "http://a/", "target": "http://b/", "db": names}), "more than 100"),
    ] {
        let request = e.client.post(e.url("/_agentstore/runs")).basic_auth("admin", Some(PASSWORD)).json(&start);
        let refused = Answer::read(request.send().await?).await?.expect(400, "POST /_agentstore/runs past a bound")?;
        check(refused.body["reason"].as_str().is_some_and(|reason| reason.contains(bound)), || {
            format!("a start past {bound}: {}", refused.body)
        })?;
    }
    as_login(&e, "admin", Method::DELETE, "/_agentstore/runs/no-such-run").await?.expect(404, "DELETE no run")?;

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
/// The positions a per-user login is shown (`update_seq` of `GET /{db}` and of
/// `_all_docs?update_seq=true`, `_changes`' `last_seq` and each row's `seq`) are sealed, so
/// comparing two cannot tell it that another user wrote; its `since` is unsealed, so its feed
/// resumes exactly, and a `since` that does not unseal starts the feed over instead of failing.
/// An admin still sees the store's plain positions.
pub(super) async fn per_user_feed_positions_sealed(endpoint: Endpoint) -> TestResult {
    let e = &endpoint;
    let write = |docs: Vec<Value>| async move {
        let sent = e
            .client
            .post(e.url(&format!("/{DB}/_bulk_docs")))
            .basic_auth("admin", Some(PASSWORD))
            .json(&json!({ "docs": docs }));
        Answer::read(sent.send().await?).await?.expect(201, "admin writes")
    };
    let docs_of = |user: &str, keys: std::ops::Range<usize>| -> Vec<Value> {
        keys.map(|i| doc(user, "ns", &format!("k{i}"), json!(i))).collect()
    };
    write(docs_of("alice", 0..3)).await?;
    let positions = |login: &'static str| async move {
        let info = as_login(e, login, Method::GET, &format!("/{DB}")).await?.expect(200, "GET db")?;
        let all = as_login(e, login, Method::GET, &format!("/{DB}/_all_docs?update_seq=true&limit=0"))
            .await?
            .expect(200, "_all_docs?update_seq=true")?;
        let feed = as_login(e, login, Method::GET, &format!("/{DB}/_changes")).await?.expect(200, "_changes")?;
        let row_seqs: Vec<Value> =
            feed.body["results"].as_array().into_iter().flatten().map(|r| r["seq"].clone()).collect();
        Ok::<_, Failed>((
            info.body["update_seq"].clone(),
            all.body["update_seq"].clone(),
            feed.body["last_seq"].clone(),
            row_seqs,
        ))
    };
    // The same store position sealed twice is two different strings, none the store's own.
    let (info_a, all_a, last_a, rows_a) = positions("alice").await?;
    let (info_b, all_b, last_b, rows_b) = positions("alice").await?;
    let (plain_info, plain_all, plain_last, plain_rows) = positions("admin").await?;
    // The store's position of one change is the same at each read (current positions on some
    // backends are clock-based and move without writes), and an admin is shown it as it is.
    let (.., plain_rows_again) = positions("admin").await?;
    check(!plain_rows.is_empty() && plain_rows == plain_rows_again, || {
        format!("admin's row seqs differ between two reads: {plain_rows:?} then {plain_rows_again:?}")
    })?;
    check(rows_a.len() == 3 && rows_a.iter().zip(&rows_b).all(|(a, b)| a != b), || {
        format!("alice's row seqs are not sealed afresh: {rows_a:?} then {rows_b:?}")
    })?;
    for (what, sealed, again) in
        [("update_seq", &info_a, &info_b), ("_all_docs update_seq", &all_a, &all_b), ("last_seq", &last_a, &last_b)]
    {
        check(sealed.is_string() && sealed != again, || {
            format!("alice's {what} is not sealed afresh: {sealed} then {again}")
        })?;
    }
    let plain: Vec<&Value> = [&plain_info, &plain_all, &plain_last].into_iter().chain(&plain_rows).collect();
    for shown in [&info_a, &all_a, &last_a].into_iter().chain(&rows_a) {
        let leaks = plain.contains(&shown);
        check(!leaks, || format!("alice is shown a store position: {shown} (the admin's: {plain:?})"))?;
    }
    // Other users' writes: alice's positions still only differ, and her feed resumes exactly.
    write(docs_of("bob", 0..6)).await?;
    let (info_c, ..) = positions("alice").await?;
    check(info_c != info_a && info_c != info_b, || "alice's update_seq repeats a former one".to_owned())?;
    let last = last_a.as_str().ok_or("alice's last_seq is not a string")?.to_owned();
    write(docs_of("alice", 3..4).into_iter().chain(docs_of("bob", 6..8)).collect()).await?;
    let new_id = docs_of("alice", 3..4)[0]["_id"].clone();
    let resumed = feed_ids(e, &format!("since={last}")).await?;
    check(resumed == vec![new_id.clone()], || {
        format!("alice's feed from her last_seq: {resumed:?}, wanted [{new_id}]")
    })?;
    // A `since` that does not unseal (garbage, or the store's own position) is the whole feed.
    let mut everything: Vec<Value> = docs_of("alice", 0..4).iter().map(|d| d["_id"].clone()).collect();
    everything.sort_by_key(Value::to_string);
    let plain_since = plain_last.as_str().ok_or("admin's last_seq is not a string")?;
    for since in ["not-a-sealed-position", plain_since] {
        let encoded = percent_encoding::utf8_percent_encode(since, percent_encoding::NON_ALPHANUMERIC);
        let mut ids = feed_ids(e, &format!("since={encoded}")).await?;
        ids.sort_by_key(Value::to_string);
        check(ids == everything, || format!("alice's feed from {since:?}: {ids:?}, wanted all of hers"))?;
    }
    Ok(())
}

/// The ids in alice's `_changes` with `query`.
async fn feed_ids(e: &Endpoint, query: &str) -> Result<Vec<Value>, Failed> {
    let feed = as_login(e, "alice", Method::GET, &format!("/{DB}/_changes?{query}")).await?.expect(200, query)?;
    Ok(feed.body["results"].as_array().into_iter().flatten().map(|r| r["id"].clone()).collect())
}
