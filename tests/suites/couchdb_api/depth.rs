//! Issue 34's nesting depth and numbers: a document nested as deep as the limit allows (128
//! levels, its own object counting as one: CouchDB 3.4.3 keeps such documents) is written, read,
//! listed, fed, found, indexed, deleted and purged on every database, and the database keeps
//! working; a document one level deeper is refused on write with a 400, never stored to break
//! reads later. A view key emitted or asked for at the limit reads back; deeper is refused with a
//! 400 (a query) or counts as the map function's error (a key emitted), never a 500. Numbers no
//! double holds (`1e400`) are refused on every write of a database with CouchDB's exact answer
//! (`fixtures/couchdb-numbers-3.4.3.json`); the data-store database keeps them exactly
//! (docs/numbers.md).
//!
//! Answers are read with the service's own parser of stored JSON: serde_json's default stops at
//! 127 levels, below what these answers hold.

use agentstore::model::depth::{parse_stored, value_depth, MAX_DOCUMENT_DEPTH};

use super::*;

/// On the CouchDB backend the databases are CouchDB's own (requests are forwarded).
fn kept_here(e: &Endpoint) -> bool {
    e.backend != "couchdb"
}

/// An answer read at any depth the service stores.
struct Deep {
    status: u16,
    body: Value,
}

impl Deep {
    fn expect(self, status: u16, what: &str) -> Result<Self, Failed> {
        if self.status != status {
            return Err(format!("{what}: status {} (wanted {status}), body {:.400}", self.status, self.body).into());
        }
        Ok(self)
    }
}

async fn send(e: &Endpoint, method: Method, path: &str, body: Option<String>) -> Result<Deep, Failed> {
    let mut request = e.client.request(method, e.url(path)).header("Accept", "application/json");
    if let Some(body) = body {
        request = request.header("Content-Type", "application/json").body(body);
    }
    let response = request.send().await?;
    let status = response.status().as_u16();
    let text = response.text().await?;
    let body = if text.trim().is_empty() {
        Value::Null
    } else {
        parse_stored(text.as_bytes()).map_err(|err| format!("{status}: not JSON ({err}): {text:.300}"))?
    };
    Ok(Deep { status, body })
}

/// `{"n":{"n":…{}}}`, `depth` levels (at least 1).
fn nested(depth: usize) -> String {
    format!("{}{{}}{}", "{\"n\":".repeat(depth - 1), "}".repeat(depth - 1))
}

/// A document of `fields` (JSON members, without braces) whose field `n` makes it `depth` deep.
fn nested_doc(fields: &str, depth: usize) -> String {
    format!("{{{fields},\"n\":{}}}", nested(depth - 1))
}

fn percent(text: &str) -> String {
    percent_encoding::utf8_percent_encode(text, percent_encoding::NON_ALPHANUMERIC).to_string()
}

/// A view key nested `depth` deep, as the `deep_key` map function below builds it: `[[…[0]…]]`.
fn wrapped_zero(depth: usize) -> String {
    format!("{}0{}", "[".repeat(depth), "]".repeat(depth))
}

const DESIGN: &str = r#"{"views": {
    "by_n": {"map": "function(doc) { if (doc.n) { emit(doc.n, null); } }"},
    "deep_key": {"map": "function(doc) { if (doc.k) { var k = 0; for (var i = 0; i < doc.k; i++) { k = [k]; } emit(k, doc.k); } }"}
}}"#;

/// The ids of an `_all_docs`, `_find` or view answer's rows, and whether each included document
/// is as deep as its id says.
fn ids_of(rows: &Value) -> Vec<String> {
    rows.as_array()
        .into_iter()
        .flatten()
        .filter_map(|row| row["id"].as_str().or(row["_id"].as_str()))
        .map(str::to_owned)
        .collect()
}

/// Every read of a database holding `deep` (a live document at the limit) answers, with it.
async fn every_read_answers(e: &Endpoint, db: &str, deep: &str) -> TestResult {
    let read =
        send(e, Method::GET, &format!("/{db}/{}", percent(deep)), None).await?.expect(200, "GET at the limit")?;
    check(value_depth(&read.body) == MAX_DOCUMENT_DEPTH, || format!("read back {} deep", value_depth(&read.body)))?;
    let all =
        send(e, Method::GET, &format!("/{db}/_all_docs?include_docs=true"), None).await?.expect(200, "_all_docs")?;
    check(ids_of(&all.body["rows"]).iter().any(|id| id == deep), || format!("_all_docs: {:.300}", all.body))?;
    let changes =
        send(e, Method::GET, &format!("/{db}/_changes?include_docs=true"), None).await?.expect(200, "_changes")?;
    check(ids_of(&changes.body["results"]).iter().any(|id| id == deep), || format!("_changes: {:.300}", changes.body))?;
    let find = send(e, Method::POST, &format!("/{db}/_find"), Some(r#"{"selector":{"n":{"$exists":true}}}"#.into()))
        .await?
        .expect(200, "_find")?;
    check(ids_of(&find.body["docs"]).iter().any(|id| id == deep), || format!("_find: {:.300}", find.body))?;
    let view = send(e, Method::GET, &format!("/{db}/_design/d/_view/by_n?include_docs=true"), None)
        .await?
        .expect(200, "a view keyed by the deep field")?;
    check(ids_of(&view.body["rows"]).iter().any(|id| id == deep), || format!("by_n: {:.300}", view.body))
}

/// A Mango JSON index on the deep field, so `_find` reads it from the index.
async fn index_the_deep_field(e: &Endpoint, db: &str) -> TestResult {
    let index = r#"{"index":{"fields":["n"]},"name":"by-n","type":"json"}"#;
    send(e, Method::POST, &format!("/{db}/_index"), Some(index.into())).await?.expect(200, "_index on n")?;
    Ok(())
}

/// Keys emitted at the limit are indexed and queried; one level deeper is the map function's
/// error for that document (no row, no 500); a query key past the limit is a 400 naming the
/// nesting depth.
async fn deep_view_keys(e: &Endpoint, db: &str, fields: &(dyn Fn(&str) -> String + Sync)) -> TestResult {
    for depth in [MAX_DOCUMENT_DEPTH - 1, MAX_DOCUMENT_DEPTH, MAX_DOCUMENT_DEPTH + 1] {
        let id = format!("k{depth}");
        let doc = format!("{{{},\"k\":{depth}}}", fields(&id));
        send(e, Method::PUT, &format!("/{db}/{}", percent(&doc_id(&id, fields))), Some(doc))
            .await?
            .expect(201, "key doc")?;
    }
    let view =
        send(e, Method::GET, &format!("/{db}/_design/d/_view/deep_key"), None).await?.expect(200, "deep keys")?;
    let emitted: Vec<u64> =
        view.body["rows"].as_array().into_iter().flatten().filter_map(|row| row["value"].as_u64()).collect();
    check(emitted == [MAX_DOCUMENT_DEPTH as u64 - 1, MAX_DOCUMENT_DEPTH as u64], || {
        format!("keys up to the limit are rows, the deeper one is not: {emitted:?}")
    })?;
    let at = wrapped_zero(MAX_DOCUMENT_DEPTH);
    let one = send(e, Method::GET, &format!("/{db}/_design/d/_view/deep_key?key={}", percent(&at)), None)
        .await?
        .expect(200, "a query key at the limit")?;
    check(one.body["rows"].as_array().map(Vec::len) == Some(1), || format!("key at the limit: {:.300}", one.body))?;
    let past = wrapped_zero(MAX_DOCUMENT_DEPTH + 1);
    let refused = send(e, Method::GET, &format!("/{db}/_design/d/_view/deep_key?key={}", percent(&past)), None).await?;
    // Refused as past the bound, naming it, not merely as JSON that does not parse.
    let names_depth = refused.body["reason"].as_str().is_some_and(|r| r.contains("nesting depth"));
    check(refused.status == 400 && refused.body["error"] == "bad_request" && names_depth, || {
        format!("a query key past the limit: {} {:.300}", refused.status, refused.body)
    })
}

/// A `_bulk_docs` of one document: written, or (past the limit) refused with a 400 naming the
/// depth, for the whole request (its body is past what is read) or in the document's row.
/// A PUT of a document `depth` deep: its revision when within the bound (201), `None` when
/// refused past it (400 naming the nesting depth).
fn put_written_or_refused(put: Deep, depth: usize) -> Result<Option<Value>, Failed> {
    if depth <= MAX_DOCUMENT_DEPTH {
        return Ok(Some(put.expect(201, &format!("PUT {depth} deep"))?.body["rev"].clone()));
    }
    check(put.status == 400 && put.body["reason"].as_str().is_some_and(|r| r.contains("nesting depth")), || {
        format!("PUT {depth} deep: {} {:.300}", put.status, put.body)
    })?;
    Ok(None)
}

async fn bulk_written_or_refused(e: &Endpoint, db: &str, body: String, ok: bool) -> TestResult {
    let bulk = send(e, Method::POST, &format!("/{db}/_bulk_docs"), Some(body)).await?;
    let names_depth = |reason: &Value| reason.as_str().is_some_and(|r| r.contains("nesting depth"));
    let answered = if ok {
        bulk.status == 201 && bulk.body[0]["ok"] == true
    } else {
        (bulk.status == 400 && names_depth(&bulk.body["reason"]))
            || (bulk.status == 201 && bulk.body[0]["error"].is_string() && names_depth(&bulk.body[0]["reason"]))
    };
    check(answered, || format!("_bulk_docs (written: {ok}): {} {:.300}", bulk.status, bulk.body))
}

/// The id a document of `fields` has (the data-store database's ids are built from its fields).
fn doc_id(id: &str, fields: &(dyn Fn(&str) -> String + Sync)) -> String {
    let fields: Value = serde_json::from_str(&format!("{{{}}}", fields(id))).unwrap_or(Value::Null);
    fields["_id"].as_str().unwrap_or(id).to_owned()
}

/// Documents at the limit less one, at it, and past it, on a database other than the data-store
/// one, by every write path; then every read, deletion and purge.
pub(super) async fn nesting_depth_on_databases(e: Endpoint) -> TestResult {
    if !kept_here(&e) {
        return Ok(());
    }
    let db = fresh_db_named(&e, "depth", "docs").await?;
    send(&e, Method::PUT, &format!("/{db}/_design/d"), Some(DESIGN.into())).await?.expect(201, "design")?;
    index_the_deep_field(&e, &db).await?;
    let plain = |id: &str| format!("\"_id\":\"{id}\"");
    let mut revs = std::collections::HashMap::new();
    for depth in [MAX_DOCUMENT_DEPTH - 1, MAX_DOCUMENT_DEPTH, MAX_DOCUMENT_DEPTH + 1] {
        let ok = depth <= MAX_DOCUMENT_DEPTH;
        let id = format!("d{depth}");
        let put = send(&e, Method::PUT, &format!("/{db}/{id}"), Some(nested_doc(&plain(&id), depth))).await?;
        if let Some(rev) = put_written_or_refused(put, depth)? {
            revs.insert(id, rev);
        }
        let post =
            send(&e, Method::POST, &format!("/{db}"), Some(nested_doc(&plain(&format!("p{depth}")), depth))).await?;
        check(post.status == if ok { 201 } else { 400 }, || format!("POST {depth} deep: {}", post.status))?;
        let local =
            send(&e, Method::PUT, &format!("/{db}/_local/l{depth}"), Some(nested_doc("\"a\":1", depth))).await?;
        check(local.status == if ok { 201 } else { 400 }, || format!("_local {depth}: {}", local.status))?;
        let bulk = format!("{{\"docs\":[{}]}}", nested_doc(&plain(&format!("b{depth}")), depth));
        bulk_written_or_refused(&e, &db, bulk, ok).await?;
        let gone = send(&e, Method::GET, &format!("/{db}/d{depth}"), None).await?;
        check(gone.status == if ok { 200 } else { 404 }, || format!("GET {depth}: {}", gone.status))?;
    }
    every_read_answers(&e, &db, &format!("d{MAX_DOCUMENT_DEPTH}")).await?;
    send(&e, Method::GET, &format!("/{db}/_local/l{MAX_DOCUMENT_DEPTH}"), None).await?.expect(200, "_local read")?;
    deep_view_keys(&e, &db, &plain).await?;

    let deep = format!("d{MAX_DOCUMENT_DEPTH}");
    let rev = revs[&deep].as_str().unwrap_or_default().to_owned();
    send(&e, Method::DELETE, &format!("/{db}/{deep}?rev={rev}"), None).await?.expect(200, "DELETE at the limit")?;
    let below = format!("d{}", MAX_DOCUMENT_DEPTH - 1);
    let purge = format!("{{\"{below}\":[{}]}}", revs[&below]);
    let purged = send(&e, Method::POST, &format!("/{db}/_purge"), Some(purge)).await?.expect(201, "_purge")?;
    check(purged.body["purged"][&below].as_array().map(Vec::len) == Some(1), || format!("_purge: {}", purged.body))?;
    // The database keeps working.
    send(&e, Method::PUT, &format!("/{db}/after"), Some("{\"a\":1}".into())).await?.expect(201, "a write after")?;
    every_read_answers(&e, &db, &format!("b{MAX_DOCUMENT_DEPTH}")).await
}

/// The same on the data-store database: its documents carry their fields, the depth is the whole
/// document's.
pub(super) async fn nesting_depth_on_the_data_store(e: Endpoint) -> TestResult {
    if !kept_here(&e) {
        return Ok(());
    }
    let db = DB;
    send(&e, Method::PUT, &format!("/{db}/_design/d"), Some(DESIGN.into())).await?.expect(201, "design")?;
    index_the_deep_field(&e, db).await?;
    let fields = |key: &str| {
        let id = doc("deep", "depth", key, Value::Null)["_id"].as_str().unwrap_or_default().to_owned();
        format!("\"_id\":\"{id}\",\"userId\":\"deep\",\"namespace\":\"depth\",\"key\":\"{key}\",\"value\":1")
    };
    let mut revs = std::collections::HashMap::new();
    for depth in [MAX_DOCUMENT_DEPTH - 1, MAX_DOCUMENT_DEPTH, MAX_DOCUMENT_DEPTH + 1] {
        let ok = depth <= MAX_DOCUMENT_DEPTH;
        let key = format!("d{depth}");
        let id = doc_id(&key, &fields);
        let put =
            send(&e, Method::PUT, &format!("/{db}/{}", percent(&id)), Some(nested_doc(&fields(&key), depth))).await?;
        if let Some(rev) = put_written_or_refused(put, depth)? {
            revs.insert(id, rev);
        }
        let bulk = format!("{{\"docs\":[{}]}}", nested_doc(&fields(&format!("b{depth}")), depth));
        bulk_written_or_refused(&e, db, bulk, ok).await?;
        let local =
            send(&e, Method::PUT, &format!("/{db}/_local/l{depth}"), Some(nested_doc("\"a\":1", depth))).await?;
        check(local.status == if ok { 201 } else { 400 }, || format!("_local {depth}: {}", local.status))?;
    }
    let deep = doc_id(&format!("d{MAX_DOCUMENT_DEPTH}"), &fields);
    every_read_answers(&e, db, &deep).await?;
    send(&e, Method::GET, &format!("/{db}/_local/l{MAX_DOCUMENT_DEPTH}"), None).await?.expect(200, "_local read")?;
    deep_view_keys(&e, db, &fields).await?;
    let rev = revs[&deep].as_str().unwrap_or_default().to_owned();
    send(&e, Method::DELETE, &format!("/{db}/{}?rev={rev}", percent(&deep)), None).await?.expect(200, "DELETE")?;
    let facade = DataStore::open(Arc::clone(&e._ctx.backend), StoreOptions::default()).await?;
    if e._ctx.no_purge.is_none() {
        facade.purge_user("deep").await?;
    }
    send(&e, Method::GET, &format!("/{db}/_all_docs?include_docs=true"), None).await?.expect(200, "_all_docs after")?;
    send(&e, Method::GET, &format!("/{db}/_changes?include_docs=true"), None).await?.expect(200, "_changes after")?;
    Ok(())
}

/// `1e400` and its kin on a database's every write path: CouchDB's 400, nothing written. On the
/// data-store database the same numbers are kept by value, as docs/numbers.md says.
pub(super) async fn numbers_beyond_doubles(e: Endpoint) -> TestResult {
    if !kept_here(&e) {
        return Ok(());
    }
    let recorded: Value = serde_json::from_str(&std::fs::read_to_string(format!(
        "{}/fixtures/couchdb-numbers-3.4.3.json",
        env!("CARGO_MANIFEST_DIR")
    ))?)?;
    let db = fresh_db_named(&e, "depth", "numbers").await?;
    let refused_rows: Vec<&Value> =
        recorded["rows"].as_array().into_iter().flatten().filter(|row| row["put_status"] == 400).collect();
    check(!refused_rows.is_empty(), || "the recording has refused numbers".to_owned())?;
    for row in refused_rows {
        let (sent, couchdb) = (row["sent"].as_str().unwrap_or_default(), &row["put_response"]);
        let doc = format!("{{\"v\":{sent}}}");
        let same = |what: &str, answer: &Deep| {
            check(answer.status == 400 && answer.body == *couchdb, || {
                format!("{what} of {sent}: {} {} where CouchDB answered 400 {couchdb}", answer.status, answer.body)
            })
        };
        same("PUT", &send(&e, Method::PUT, &format!("/{db}/x"), Some(doc.clone())).await?)?;
        same("POST", &send(&e, Method::POST, &format!("/{db}"), Some(doc.clone())).await?)?;
        same("_local", &send(&e, Method::PUT, &format!("/{db}/_local/x"), Some(doc.clone())).await?)?;
        let bulk = format!("{{\"docs\":[{{\"_id\":\"y\"}},{{\"_id\":\"x\",\"v\":{sent}}}]}}");
        same("_bulk_docs", &send(&e, Method::POST, &format!("/{db}/_bulk_docs"), Some(bulk)).await?)?;
        let boundary = "numbers";
        let related = format!("--{boundary}\r\nContent-Type: application/json\r\n\r\n{doc}\r\n--{boundary}--");
        let answer = e
            .client
            .put(e.url(&format!("/{db}/x")))
            .header("Content-Type", format!("multipart/related; boundary=\"{boundary}\""))
            .header("Accept", "application/json")
            .body(related)
            .send()
            .await?;
        same("multipart", &Deep { status: answer.status().as_u16(), body: answer.json().await? })?;
    }
    for id in ["x", "y", "_local/x"] {
        send(&e, Method::GET, &format!("/{db}/{id}"), None).await?.expect(404, "nothing was written")?;
    }
    // The largest double and integers of any size are numbers CouchDB keeps.
    send(
        &e,
        Method::PUT,
        &format!("/{db}/x"),
        Some(r#"{"v":1.7976931348623157e308,"i":1000000000000000000000000000000000000000000000000000}"#.into()),
    )
    .await?
    .expect(201, "the largest double")?;

    // The data-store database keeps the value exactly (docs/numbers.md: nothing is refused on
    // these backends); its text may change.
    let id = doc("numbers", "n", "big", Value::Null)["_id"].as_str().unwrap_or_default().to_owned();
    let body =
        format!("{{\"_id\":\"{id}\",\"userId\":\"numbers\",\"namespace\":\"n\",\"key\":\"big\",\"value\":1e400}}");
    send(&e, Method::PUT, &path_of(&id), Some(body)).await?.expect(201, "1e400 in the data store")?;
    let read = send(&e, Method::GET, &path_of(&id), None).await?.expect(200, "read back")?;
    let text = read.body["value"].to_string();
    check(agentstore::model::number::same_decimal_value(&text, "1e400"), || format!("1e400 read back as {text}"))
}
