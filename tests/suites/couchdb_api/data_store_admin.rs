//! The data-store database's own endpoints through the databases' handlers (issue 35 §2):
//! `GET/HEAD /{db}`, `_security`, `_revs_limit`, `_purge` and `_compact` for an admin (a server
//! admin's rights) and a per-user login (a member's, never purging, compacting or changing the
//! settings of the database every user shares); a purge's effect on the REST API and the feed;
//! and the purge count (`:db:erased`) out of every client's reach.

use super::logins::{as_login, PASSWORD};
use super::*;

/// An admin login and per-user logins for the users `alice` and `db` (whose `_local/erased`
/// would be the backend's `db:erased`), all with [`PASSWORD`].
pub(super) fn admin_logins_config() -> Result<String, Failed> {
    let hash = agentstore::couchdb_api::auth::hash_password(PASSWORD)?;
    let mut config = format!("[[couchdb_users]]\nname = \"admin\"\npassword_hash = \"{hash}\"\nadmin = true\n");
    for user in ["alice", "db"] {
        config.push_str(&format!(
            "[[couchdb_users]]\nname = \"{user}\"\npassword_hash = \"{hash}\"\nuser = \"{user}\"\n"
        ));
    }
    Ok(config)
}

/// The CouchDB backend's data-store database is not the engine's (ARCHITECTURE.md).
fn engine_backend(e: &Endpoint) -> bool {
    e.backend != "couchdb"
}

/// A per-user login is refused what acts on the whole shared database with 403, naming why.
fn refused_to_per_user(answer: &Answer, what: &str) -> TestResult {
    let reason = answer.body["reason"].as_str().unwrap_or_default();
    check(
        answer.status == StatusCode::FORBIDDEN
            && answer.body["error"] == "forbidden"
            && reason.contains("per-user login")
            && reason.contains("shared"),
        || format!("{what} by a per-user login: {} {}", answer.status, answer.body),
    )
}

/// `GET/HEAD /{db}`, `_security`, `_revs_limit` and `_compact` on the data-store database: the
/// admin reads and changes them as a server admin does; a per-user login reads `_security` and
/// `_revs_limit` as a CouchDB member does, and is refused the changes and `_compact` (403 naming
/// why); `PUT`/`DELETE /{db}` are refused (401 to a per-user login, which is no server admin).
pub(super) async fn data_store_settings_by_login(e: Endpoint) -> TestResult {
    let db = format!("/{DB}");
    let alices = doc("alice", "ns", "k", json!(1));
    let path = path_of(alices["_id"].as_str().unwrap_or_default());
    as_login(&e, "admin", Method::PUT, &path, Some(alices)).await?.expect(201, "a document")?;

    let admin_info = as_login(&e, "admin", Method::GET, &db, None).await?.expect(200, "GET /{db} as admin")?;
    same_fields(&admin_info.body, &couchdb_body("005-db-info"), "GET /{db}", &[])?;
    let changes = as_login(&e, "admin", Method::GET, &format!("{db}/_changes"), None).await?.expect(200, "_changes")?;
    check(admin_info.body["db_name"] == DB && admin_info.body["doc_count"].is_u64(), || {
        format!("the admin's GET /{{db}}: {}", admin_info.body)
    })?;
    // The store's own position, as `_changes` shows them (on the embedded store, where it is the
    // feed's counter, the very `last_seq`; elsewhere a position at "now").
    check(e.backend != "embedded" || admin_info.body["update_seq"] == changes.body["last_seq"], || {
        format!("update_seq {} where the feed ends at {}", admin_info.body["update_seq"], changes.body["last_seq"])
    })?;
    let alice_info = as_login(&e, "alice", Method::GET, &db, None).await?.expect(200, "GET /{db} as alice")?;
    // Sealed afresh on each answer (as her `_changes` positions are): never the admin's token.
    check(
        alice_info.body["doc_count"] == 0
            && alice_info.body["update_seq"].is_string()
            && alice_info.body["update_seq"] != admin_info.body["update_seq"],
        || format!("alice's GET /{{db}} (no count, a sealed position): {}", alice_info.body),
    )?;
    let head = e.client.head(e.url(&db)).basic_auth("alice", Some(PASSWORD)).send().await?;
    check(head.status() == StatusCode::OK, || format!("HEAD /{{db}}: {}", head.status()))?;

    let security = json!({ "admins": { "names": ["ann"], "roles": [] }, "members": { "names": [], "roles": ["r"] } });
    let got = as_login(&e, "admin", Method::GET, &format!("{db}/_security"), None).await?.expect(200, "_security")?;
    check(got.body == json!({}), || format!("a new _security: {}", got.body))?;
    as_login(&e, "admin", Method::PUT, &format!("{db}/_security"), Some(security.clone()))
        .await?
        .expect(200, "PUT _security as admin")?;
    as_login(&e, "admin", Method::PUT, &format!("{db}/_revs_limit"), Some(json!(7)))
        .await?
        .expect(200, "PUT _revs_limit as admin")?;
    for login in ["admin", "alice"] {
        let got = as_login(&e, login, Method::GET, &format!("{db}/_security"), None).await?.expect(200, "_security")?;
        check(got.body == security, || format!("{login} reads _security: {}", got.body))?;
        let got = as_login(&e, login, Method::GET, &format!("{db}/_revs_limit"), None).await?;
        let got = got.expect(200, "_revs_limit")?;
        check(got.body == json!(7), || format!("{login} reads _revs_limit: {}", got.body))?;
    }
    for (method, below, body, what) in [
        (Method::PUT, "_security", Some(json!({})), "PUT _security"),
        (Method::PUT, "_revs_limit", Some(json!(3)), "PUT _revs_limit"),
        (Method::POST, "_compact", Some(json!({})), "_compact"),
        (Method::POST, "_purge", Some(json!({})), "_purge"),
    ] {
        let refused = as_login(&e, "alice", method, &format!("{db}/{below}"), body).await?;
        refused_to_per_user(&refused, what)?;
    }
    // A design document's compaction names the design document: refused as every design route is.
    let refused = as_login(&e, "alice", Method::POST, &format!("{db}/_compact/app"), Some(json!({}))).await?;
    check(refused.status == StatusCode::FORBIDDEN, || format!("alice's _compact/{{ddoc}}: {}", refused.body))?;
    let kept = as_login(&e, "admin", Method::GET, &format!("{db}/_revs_limit"), None).await?.expect(200, "kept")?;
    check(kept.body == json!(7), || format!("_revs_limit after alice's refused change: {}", kept.body))?;
    for below in ["_compact", "_compact/app"] {
        let compacted = as_login(&e, "admin", Method::POST, &format!("{db}/{below}"), Some(json!({}))).await?;
        compacted.expect(202, below)?;
    }

    // The database itself is never created or deleted through the API; a per-user login is no
    // server admin, CouchDB's 401 (data_store_routes.rs).
    for (login, exists, refused) in [
        ("admin", StatusCode::PRECONDITION_FAILED, StatusCode::FORBIDDEN),
        ("alice", StatusCode::UNAUTHORIZED, StatusCode::UNAUTHORIZED),
    ] {
        let created = as_login(&e, login, Method::PUT, &db, None).await?;
        check(created.status == exists, || format!("PUT /{{db}} as {login}: {} {}", created.status, created.body))?;
        let deleted = as_login(&e, login, Method::DELETE, &db, None).await?;
        check(deleted.status == refused, || format!("DELETE /{{db}} as {login}: {} {}", deleted.status, deleted.body))?;
    }
    Ok(())
}

/// The id of a data document of `user` under namespace `ns`.
fn id_of(user: &str, key: &str) -> String {
    doc(user, "ns", key, json!(null))["_id"].as_str().unwrap_or_default().to_owned()
}

/// `last_seq` of the whole feed as `login` reads it, and the ids it lists.
async fn feed(e: &Endpoint, login: &str, since: Option<&str>) -> Result<(Value, Vec<String>), Failed> {
    let path = match since {
        Some(since) => format!(
            "/{DB}/_changes?since={}",
            percent_encoding::utf8_percent_encode(since, percent_encoding::NON_ALPHANUMERIC)
        ),
        None => format!("/{DB}/_changes"),
    };
    let answer = as_login(e, login, Method::GET, &path, None).await?.expect(200, "_changes")?;
    let ids = answer.body["results"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|row| row["id"].as_str().map(str::to_owned))
        .collect();
    Ok((answer.body["last_seq"].clone(), ids))
}

/// The purge count is the data-store database's own (`:db:erased`), never the local document a
/// per-user login `db` writes as `_local/erased` (the backend's `db:erased`): an admin's purge
/// leaves that login's document as it wrote it, and what it wrote moves no one's position; the
/// `last_seq` of a read from 0 does not go back when the newest document is purged. After
/// the purge every other document's feed entry is kept and a `since` from before it reads on.
pub(super) async fn data_store_purge_count_out_of_reach(e: Endpoint) -> TestResult {
    if !engine_backend(&e) {
        return Ok(());
    }
    let erased_path = format!("/{DB}/_local/erased");
    let planted = as_login(&e, "db", Method::PUT, &erased_path, Some(json!({ "count": 1_000_000 }))).await?;
    let planted_rev = planted.expect(201, "the login db's _local/erased")?.rev()?;
    let (kept_id, purged_id) = (id_of("alice", "kept"), id_of("alice", "purged"));
    let mut revs = Vec::new();
    for (user, key) in [("alice", "kept"), ("db", "own"), ("alice", "purged")] {
        let body = doc(user, "ns", key, json!(key));
        let id = body["_id"].as_str().unwrap_or_default().to_owned();
        revs.push(
            as_login(&e, "admin", Method::PUT, &path_of(&id), Some(body)).await?.expect(201, "a document")?.rev()?,
        );
    }
    let (before, _) = feed(&e, "admin", None).await?;
    let (alice_before, _) = feed(&e, "alice", None).await?;
    let info_before = as_login(&e, "admin", Method::GET, &format!("/{DB}"), None).await?.expect(200, "GET /{db}")?;

    let purged = as_login(
        &e,
        "admin",
        Method::POST,
        &format!("/{DB}/_purge"),
        Some(json!({ purged_id.clone(): [revs[2].clone()] })),
    )
    .await?
    .expect(201, "_purge of a whole document")?;
    check(purged.body["purged"][&purged_id] == json!([revs[2]]), || format!("_purge: {}", purged.body))?;

    let planted =
        as_login(&e, "db", Method::GET, &erased_path, None).await?.expect(200, "the login db's _local/erased")?;
    check(planted.body["count"] == 1_000_000 && planted.body["_rev"] == planted_rev.as_str(), || {
        format!("the login db's _local/erased after an admin's purge (was {planted_rev}): {}", planted.body)
    })?;
    let (after, ids) = feed(&e, "admin", None).await?;
    check(ids.contains(&kept_id) && ids.contains(&id_of("db", "own")) && !ids.contains(&purged_id), || {
        format!("the feed after the purge keeps every other document: {ids:?}")
    })?;
    let info_after = as_login(&e, "admin", Method::GET, &format!("/{DB}"), None).await?.expect(200, "GET /{db}")?;
    let (was, now) = (&info_before.body["update_seq"], &info_after.body["update_seq"]);
    check(position_order(was)? <= position_order(now)?, || {
        format!("update_seq went back with the purge: {was} -> {now}")
    })?;
    // A fresh read from 0 ends no earlier than before the purge of the newest document (issue
    // 35), on every backend (DynamoDB's and Firestore's feeds end at their last entry, which the
    // purge took away): ordered as the backend orders its own positions.
    let order = match (before.as_str(), after.as_str()) {
        (Some(was), Some(now)) => e._ctx.backend.position_order(was, now),
        _ => None,
    };
    check(matches!(order, Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)), || {
        format!("last_seq of a read from 0 went back with the purge: {before} -> {after} ({order:?})")
    })?;
    // A `since` from before the purge reads on: a later write is listed after it.
    let later = doc("alice", "ns", "later", json!(2));
    as_login(&e, "admin", Method::PUT, &path_of(&id_of("alice", "later")), Some(later)).await?.expect(201, "later")?;
    for (login, since) in [("admin", &before), ("alice", &alice_before)] {
        let (_, listed) = feed(&e, login, since.as_str()).await?;
        check(listed == vec![id_of("alice", "later")], || {
            format!("{login}'s feed since before the purge ({since}): {listed:?}")
        })?;
    }
    Ok(())
}

/// An admin's purge on the data-store database erases exactly the leaf named: a purged winner
/// (the only leaf) is gone for the REST API too; a purged losing leaf leaves the record as it was;
/// a purged winner of a document with other leaves gives way to the next winner (CouchDB's
/// rules), which the REST API reads too; then the last leaf purged.
pub(super) async fn data_store_purge_by_admin(e: Endpoint) -> TestResult {
    if !engine_backend(&e) {
        return Ok(());
    }
    let store = DataStore::open(Arc::clone(&e._ctx.backend), StoreOptions::default()).await?;
    let single = doc("carol", "ns", "single", json!("only"));
    let single_id = id_of("carol", "single");
    let single_rev = e.put(&path_of(&single_id), single).await?.expect(201, "single")?.rev()?;

    // A document with two leaves: `2-b…` wins over `2-a…`.
    let two = id_of("carol", "two");
    let first = e.put(&path_of(&two), doc("carol", "ns", "two", json!(1))).await?.expect(201, "two")?.rev()?;
    let root = first.split_once('-').map(|(_, hash)| hash.to_owned()).unwrap_or_default();
    let (a, b) = (format!("2-{}", "a".repeat(32)), format!("2-{}", "b".repeat(32)));
    let branch = |rev: &str, value: &str| {
        let mut body = doc("carol", "ns", "two", json!(value));
        body["_rev"] = json!(rev);
        body["_revisions"] =
            json!({ "start": 2, "ids": [rev.split_once('-').map(|(_, h)| h).unwrap_or_default(), root.clone()] });
        body
    };
    e.post(
        &format!("/{DB}/_bulk_docs"),
        json!({ "new_edits": false, "docs": [branch(&a, "loser"), branch(&b, "winner")] }),
    )
    .await?
    .expect(201, "two leaves")?;

    let purged = e
        .post(&format!("/{DB}/_purge"), json!({ single_id.clone(): [single_rev.clone()], two.clone(): [a.clone()] }))
        .await?
        .expect(201, "_purge")?;
    check(
        purged.body["purged"][&single_id] == json!([single_rev]) && purged.body["purged"][&two] == json!([a]),
        || format!("_purge: {}", purged.body),
    )?;
    let gone = store.peek("carol", "ns", "single").await?;
    check(gone.is_none(), || format!("the REST API after the winner's purge: {gone:?}"))?;
    let keys = store.list_keys("carol", "ns").await?;
    check(keys == vec!["two".to_owned()], || format!("the REST listing after the purge: {keys:?}"))?;
    e.get(&path_of(&single_id)).await?.expect(404, "the purged document")?;
    let record = store.peek("carol", "ns", "two").await?;
    check(record.as_ref().is_some_and(|r| r.rev.as_str() == b && r.body["value"] == "winner"), || {
        format!("the record after its losing leaf's purge: {record:?}")
    })?;
    let read = e.get(&format!("{}?conflicts=true", path_of(&two))).await?.expect(200, "after the loser's purge")?;
    check(read.body["_rev"] == b.as_str() && read.body.get("_conflicts").is_none(), || {
        format!("no conflict left: {}", read.body)
    })?;

    // The winner purged while a conflict stands: as in CouchDB, the next winner by its rules
    // becomes the document, for the CouchDB face, `_all_docs`, the feed and the REST API alike.
    let c = format!("2-{}", "c".repeat(32));
    e.post(&format!("/{DB}/_bulk_docs"), json!({ "new_edits": false, "docs": [branch(&c, "newer")] }))
        .await?
        .expect(201, "a conflict again")?;
    let purged = e.post(&format!("/{DB}/_purge"), json!({ two.clone(): [c.clone()] })).await?.expect(201, "winner")?;
    check(purged.body["purged"][&two] == json!([c]), || format!("purging the winner of a conflict: {}", purged.body))?;
    let read = e.get(&format!("{}?conflicts=true", path_of(&two))).await?.expect(200, "after the winner's purge")?;
    check(
        read.body["_rev"] == b.as_str() && read.body["value"] == "winner" && read.body.get("_conflicts").is_none(),
        || format!("the next winner after the winner's purge: {}", read.body),
    )?;
    let record = store.peek("carol", "ns", "two").await?;
    check(record.as_ref().is_some_and(|r| r.rev.as_str() == b && r.body["value"] == "winner"), || {
        format!("the REST API after the winner's purge: {record:?}")
    })?;
    let listed = e.post(&format!("/{DB}/_all_docs"), json!({ "keys": [two] })).await?.expect(200, "_all_docs")?;
    check(listed.body["rows"][0]["value"]["rev"] == b.as_str(), || format!("_all_docs: {}", listed.body))?;
    let feed = e.get(&format!("/{DB}/_changes")).await?.expect(200, "_changes")?;
    let fed = feed.body["results"].as_array().and_then(|rows| rows.iter().find(|row| row["id"] == two.as_str()));
    check(fed.is_some_and(|row| row["changes"] == json!([{ "rev": b }])), || format!("_changes: {}", feed.body))?;
    e.post(&format!("/{DB}/_purge"), json!({ two.clone(): [b] })).await?.expect(201, "purge the last leaf")?;
    let gone = store.peek("carol", "ns", "two").await?;
    check(gone.is_none(), || format!("the REST API after purging every leaf: {gone:?}"))?;
    Ok(())
}

/// Where a store position is, comparable across positions of one backend: the embedded store's
/// counter, DynamoDB's leading time in milliseconds, Firestore's RFC 3339 time in nanoseconds.
fn position_order(position: &Value) -> Result<i128, Failed> {
    let text = position.as_str().ok_or_else(|| format!("{position} is not a string"))?;
    let digits: String = text.chars().take_while(char::is_ascii_digit).collect();
    if !text.contains('T') && !digits.is_empty() {
        return Ok(digits.parse::<i128>().map_err(|e| e.to_string())?);
    }
    let time = chrono::DateTime::parse_from_rfc3339(text).map_err(|e| format!("{text}: {e}"))?;
    Ok(i128::from(time.timestamp()) * 1_000_000_000 + i128::from(time.timestamp_subsec_nanos()))
}
