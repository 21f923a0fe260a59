//! `GET/POST /{db}/_local_docs` (issue 24) as CouchDB 3.4.3 answers it (`couch_mrview.erl`,
//! `fabric_view_all_docs.erl`: `total_rows`, `offset` and `update_seq` null, rows in raw id order,
//! keys compared with the full `_local/` ids, `keys` without the prefix dropped): on a database
//! kept by agentstore, whose own local documents (revision trees of deleted documents, settings)
//! are never listed, and on the data-store database, where a per-user login lists only its own.

use super::*;

const PASSWORD: &str = "correct horse";

/// A request as `user` (a login of [`logins::logins_config`]).
async fn call_as(e: &Endpoint, user: &str, method: Method, path: &str, body: Option<Value>) -> Result<Answer, Failed> {
    let mut request = e.client.request(method, e.url(path)).basic_auth(user, Some(PASSWORD));
    if let Some(body) = body {
        request = request.json(&body);
    }
    Answer::read(request.send().await?).await
}

fn row_ids(answer: &Answer) -> Vec<String> {
    answer.body["rows"]
        .as_array()
        .map(|rows| rows.iter().filter_map(|row| row["id"].as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

fn ids(names: &[&str]) -> Vec<String> {
    names.iter().map(|name| format!("_local/{name}")).collect()
}

/// `startkey`/`endkey` values as a query string carries them (JSON, percent-encoded).
fn key(id: &str) -> String {
    let json = Value::from(id).to_string();
    percent_encoding::utf8_percent_encode(&json, percent_encoding::NON_ALPHANUMERIC).to_string()
}

pub(super) async fn local_docs_listings(e: Endpoint) -> TestResult {
    if let Some(why) = e._ctx.no_local_listing.clone() {
        // The data-store database's listing is the backend's, which this server cannot make:
        // refused as not implemented, never a 200 with no rows.
        call_as(&e, "alice", Method::PUT, &format!("/{DB}/_local/cp"), Some(json!({"seq": 1})))
            .await?
            .expect(201, "alice's checkpoint")?;
        let refused = call_as(&e, "alice", Method::GET, &format!("/{DB}/_local_docs"), None).await?;
        let refused = refused.expect(501, "_local_docs on a backend without a listing")?;
        check(refused.body["error"] == "not_implemented", || format!("{}", refused.body))?;
        println!("{}: _local_docs refused as it must be: {why}", e.backend);
        return Ok(());
    }
    engine_database(&e).await?;
    data_store_database(&e).await
}

/// A database kept by agentstore (forwarded whole to the backend's own on the CouchDB backend,
/// where the same answers are the server's).
async fn engine_database(e: &Endpoint) -> TestResult {
    call_as(e, "admin", Method::PUT, "/ldocs", None).await?.expect(201, "PUT /ldocs")?;
    // The engine keeps locals of its own: a deleted document's tree, the settings.
    let written =
        call_as(e, "admin", Method::PUT, "/ldocs/gone", Some(json!({"v": 1}))).await?.expect(201, "PUT gone")?;
    call_as(e, "admin", Method::DELETE, &format!("/ldocs/gone?rev={}", written.rev()?), None)
        .await?
        .expect(200, "DELETE gone")?;
    call_as(e, "admin", Method::PUT, "/ldocs/_revs_limit", Some(json!(7))).await?.expect(200, "_revs_limit")?;
    for name in ["cp-c", "cp-a", "cp-b"] {
        let path = format!("/ldocs/_local/{name}");
        call_as(e, "admin", Method::PUT, &path, Some(json!({ "name": name })))
            .await?
            .expect(201, "a client's local")?;
    }
    let all = call_as(e, "admin", Method::GET, "/ldocs/_local_docs", None).await?.expect(200, "_local_docs")?;
    check(all.body["total_rows"].is_null() && all.body["offset"].is_null(), || format!("{}", all.body))?;
    check(row_ids(&all) == ids(&["cp-a", "cp-b", "cp-c"]), || format!("only the clients' locals: {}", all.body))?;
    let first = &all.body["rows"][0];
    check(*first == json!({"id": "_local/cp-a", "key": "_local/cp-a", "value": {"rev": "0-1"}}), || {
        format!("a row: {first}")
    })?;
    let paged =
        call_as(e, "admin", Method::GET, "/ldocs/_local_docs?include_docs=true&skip=1&limit=1&update_seq=true", None)
            .await?
            .expect(200, "skip, limit, include_docs")?;
    check(row_ids(&paged) == ids(&["cp-b"]), || format!("skip 1 limit 1: {}", paged.body))?;
    let doc = &paged.body["rows"][0]["doc"];
    check(*doc == json!({"_id": "_local/cp-b", "_rev": "0-1", "name": "cp-b"}), || format!("doc: {doc}"))?;
    check(paged.body.get("update_seq") == Some(&Value::Null), || format!("update_seq: {}", paged.body))?;
    let down = format!("/ldocs/_local_docs?descending=true&startkey={}", key("_local/cp-b"));
    let down = call_as(e, "admin", Method::GET, &down, None).await?.expect(200, "descending")?;
    check(row_ids(&down) == ids(&["cp-b", "cp-a"]), || format!("descending from cp-b: {}", down.body))?;
    let exclusive =
        format!("/ldocs/_local_docs?startkey={}&endkey={}&inclusive_end=false", key("_local/cp-b"), key("_local/cp-c"));
    let exclusive = call_as(e, "admin", Method::GET, &exclusive, None).await?.expect(200, "exclusive end")?;
    check(row_ids(&exclusive) == ids(&["cp-b"]), || format!("[cp-b, cp-c): {}", exclusive.body))?;
    // Keys without the prefix compare as raw bytes with the `_local/` ids: "a" after them all.
    let above = call_as(e, "admin", Method::GET, &format!("/ldocs/_local_docs?startkey={}", key("a")), None).await?;
    check(row_ids(&above.expect(200, "startkey a")?).is_empty(), || "from \"a\": rows".to_owned())?;
    let below = call_as(e, "admin", Method::GET, &format!("/ldocs/_local_docs?endkey={}", key("a")), None).await?;
    check(row_ids(&below.expect(200, "endkey a")?).len() == 3, || "up to \"a\": every row".to_owned())?;
    let keys = json!({"keys": ["_local/cp-c", "_local/missing", "cp-a", "_local/cp-a"]});
    let by_keys =
        call_as(e, "admin", Method::POST, "/ldocs/_local_docs", Some(keys)).await?.expect(200, "POST keys")?;
    let expected = json!([
        {"id": "_local/cp-c", "key": "_local/cp-c", "value": {"rev": "0-1"}},
        {"key": "_local/missing", "error": "not_found"},
        {"id": "_local/cp-a", "key": "_local/cp-a", "value": {"rev": "0-1"}},
    ]);
    check(by_keys.body["rows"] == expected, || format!("keys (the unprefixed one dropped): {}", by_keys.body))?;
    call_as(e, "admin", Method::DELETE, "/ldocs/_local/cp-b", None).await?.expect(200, "DELETE cp-b")?;
    let left = call_as(e, "admin", Method::GET, "/ldocs/_local_docs", None).await?.expect(200, "after the deletion")?;
    check(row_ids(&left) == ids(&["cp-a", "cp-c"]), || format!("a deleted local is gone: {}", left.body))?;
    call_as(e, "admin", Method::DELETE, "/ldocs", None).await?.expect(200, "DELETE /ldocs")?;
    Ok(())
}

/// The data-store database: each per-user login lists its own checkpoints, shown as it named
/// them; an admin lists every one under its stored name.
async fn data_store_database(e: &Endpoint) -> TestResult {
    for (user, name) in [("alice", "cp-1"), ("bob", "cp-1"), ("bob", "cp-2"), ("admin", "cp-0")] {
        let path = format!("/{DB}/_local/{name}");
        call_as(e, user, Method::PUT, &path, Some(json!({ "owner": user }))).await?.expect(201, "a checkpoint")?;
    }
    let list = |user: &'static str, query: &'static str| async move {
        call_as(e, user, Method::GET, &format!("/{DB}/_local_docs{query}"), None).await?.expect(200, user)
    };
    let alices = list("alice", "?include_docs=true").await?;
    check(row_ids(&alices) == ids(&["cp-1"]), || format!("alice lists only hers: {}", alices.body))?;
    let doc = &alices.body["rows"][0]["doc"];
    check(*doc == json!({"_id": "_local/cp-1", "_rev": "0-1", "owner": "alice"}), || format!("alice's: {doc}"))?;
    let bobs = list("bob", "").await?;
    check(row_ids(&bobs) == ids(&["cp-1", "cp-2"]), || format!("bob lists only his: {}", bobs.body))?;
    let bobs_down = list("bob", "?descending=true&limit=1").await?;
    check(row_ids(&bobs_down) == ids(&["cp-2"]), || format!("bob, descending: {}", bobs_down.body))?;
    // However wide the range, and by keys, alice never reaches bob's.
    let wide = format!("/{DB}/_local_docs?startkey={}&endkey={}", key("_"), key("z"));
    let wide = call_as(e, "alice", Method::GET, &wide, None).await?.expect(200, "alice, wide range")?;
    check(row_ids(&wide) == ids(&["cp-1"]), || format!("alice, every key: {}", wide.body))?;
    let keys = json!({"keys": ["_local/cp-2", "_local/bob:cp-2", "_local/cp-1"]});
    let by_keys = call_as(e, "alice", Method::POST, &format!("/{DB}/_local_docs"), Some(keys)).await?;
    let by_keys = by_keys.expect(200, "alice, keys")?;
    let expected = json!([
        {"key": "_local/cp-2", "error": "not_found"},
        {"key": "_local/bob:cp-2", "error": "not_found"},
        {"id": "_local/cp-1", "key": "_local/cp-1", "value": {"rev": "0-1"}},
    ]);
    check(by_keys.body["rows"] == expected, || format!("alice's keys: {}", by_keys.body))?;
    // `keys` is bounded as `_all_docs`' is (docs/bounds.md): 400 naming the limit.
    let too_many: Vec<String> = (0..10_001).map(|n| format!("_local/k{n}")).collect();
    let path = format!("/{DB}/_local_docs");
    let refused = call_as(e, "alice", Method::POST, &path, Some(json!({ "keys": too_many }))).await?;
    let refused = refused.expect(400, "10,001 keys")?;
    check(refused.body["reason"].as_str().is_some_and(|r| r.contains("10000")), || format!("{}", refused.body))?;
    let all = list("admin", "").await?;
    let every = ids(&["alice:cp-1", "bob:cp-1", "bob:cp-2", "cp-0"]);
    check(every.iter().all(|id| row_ids(&all).contains(id)), || format!("the admin lists all: {}", all.body))?;
    Ok(())
}
