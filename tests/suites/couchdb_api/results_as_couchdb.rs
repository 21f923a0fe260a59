//! Answers a differential test (issue 34) found different from a real CouchDB 3.4.3's on
//! ordinary databases, each checked against what CouchDB's source does: `_changes` with a filter,
//! `descending` and `limit`; `_design_docs`' `total_rows` and `keys`; `COPY`'s `Destination`
//! decoding; the empty id in reads; `_local` documents' revisions and `GET` options; the order of
//! one `_bulk_docs`' changes.

use super::*;

/// On the CouchDB backend an ordinary database is the server's own and every request on it is
/// passed on: its answers are that server's (pouchdb-server in these tests, which differs from
/// CouchDB in each of these), not this code's.
fn passed_on(e: &Endpoint) -> bool {
    if e.backend == "couchdb" {
        println!("couchdb: requests on ordinary databases are the CouchDB server's to answer");
    }
    e.backend == "couchdb"
}

/// The ids of a `_changes` answer's rows, in order.
fn change_ids(answer: &Answer) -> Vec<String> {
    answer.body["results"]
        .as_array()
        .map(|rows| rows.iter().filter_map(|row| row["id"].as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

/// The ids of a listing's rows (`key` for error rows), in order.
fn row_keys(answer: &Answer) -> Vec<String> {
    answer.body["rows"]
        .as_array()
        .map(|rows| rows.iter().filter_map(|row| row["key"].as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

/// A request with a raw header value (bytes a `&str` header could not carry).
async fn call_with_header(e: &Endpoint, method: &str, path: &str, name: &str, value: &[u8]) -> Result<Answer, Failed> {
    let method = Method::from_bytes(method.as_bytes()).map_err(|err| err.to_string())?;
    let value = reqwest::header::HeaderValue::from_bytes(value).map_err(|err| err.to_string())?;
    let request = e.client.request(method, e.url(path)).header("Accept", "application/json").header(name, value);
    Answer::read(request.send().await?).await
}

/// `filter=_design&descending=true&limit=N` is the N newest design-document changes, however many
/// other changes are newer (CouchDB counts `limit` in rows sent, after the filter); it used to
/// cut the feed to N changes first, and so answered nothing.
pub(super) async fn changes_filtered_descending_limit(e: Endpoint) -> TestResult {
    if passed_on(&e) {
        return Ok(());
    }
    let db = fresh_db_named(&e, "diffb", "desc").await?;
    e.put(&format!("/{db}/_design/a"), json!({ "views": {} })).await?.expect(201, "_design/a")?;
    for i in 0..3 {
        e.put(&format!("/{db}/doc-{i}"), json!({ "i": i })).await?.expect(201, "a document")?;
    }
    e.put(&format!("/{db}/_design/b"), json!({ "views": {} })).await?.expect(201, "_design/b")?;
    for i in 3..6 {
        e.put(&format!("/{db}/doc-{i}"), json!({ "i": i })).await?.expect(201, "a document")?;
    }
    let feed = |query: &str| format!("/{db}/_changes?filter=_design&descending=true{query}");
    let one = e.get(&feed("&limit=1")).await?.expect(200, "limit=1")?;
    check(change_ids(&one) == ["_design/b"], || format!("limit=1: {}", one.body))?;
    let two = e.get(&feed("&limit=2")).await?.expect(200, "limit=2")?;
    check(change_ids(&two) == ["_design/b", "_design/a"], || format!("limit=2: {}", two.body))?;
    let all = e.get(&feed("")).await?.expect(200, "no limit")?;
    check(change_ids(&all) == ["_design/b", "_design/a"], || format!("no limit: {}", all.body))?;
    // The plain feed, newest first, is cut to the changes asked for.
    let plain = e.get(&format!("/{db}/_changes?descending=true&limit=2")).await?.expect(200, "plain")?;
    check(change_ids(&plain) == ["doc-5", "doc-4"], || format!("plain: {}", plain.body))
}

/// `_design_docs`' `total_rows` is the number of design documents (`couch_mrview:get_total_rows`
/// for the `_design` namespace), and `keys` that are not design ids are dropped
/// (`fabric_view_all_docs:filter_keys_by_namespace`).
pub(super) async fn design_docs_count_design_documents(e: Endpoint) -> TestResult {
    if passed_on(&e) {
        return Ok(());
    }
    let db = fresh_db_named(&e, "diffb", "ddocs").await?;
    for name in ["a", "b"] {
        e.put(&format!("/{db}/_design/{name}"), json!({ "views": {} })).await?.expect(201, "a design document")?;
    }
    for i in 0..3 {
        e.put(&format!("/{db}/doc-{i}"), json!({ "i": i })).await?.expect(201, "a document")?;
    }
    let listed = e.get(&format!("/{db}/_design_docs")).await?.expect(200, "_design_docs")?;
    check(listed.body["total_rows"] == 2 && listed.body["offset"] == 0, || format!("total_rows: {}", listed.body))?;
    check(row_keys(&listed) == ["_design/a", "_design/b"], || format!("rows: {}", listed.body))?;
    let keys = r#"["doc-1","_design/b","_design/zz"]"#;
    let path = format!(
        "/{db}/_design_docs?keys={}",
        percent_encoding::utf8_percent_encode(keys, percent_encoding::NON_ALPHANUMERIC)
    );
    let by_keys = e.get(&path).await?.expect(200, "_design_docs?keys")?;
    check(by_keys.body["total_rows"] == 2, || format!("keys, total_rows: {}", by_keys.body))?;
    check(row_keys(&by_keys) == ["_design/b", "_design/zz"], || format!("keys, rows: {}", by_keys.body))?;
    check(by_keys.body["rows"][1] == json!({ "key": "_design/zz", "error": "not_found" }), || {
        format!("a missing design document: {}", by_keys.body)
    })?;
    let all = e.get(&format!("/{db}/_all_docs")).await?.expect(200, "_all_docs")?;
    check(all.body["total_rows"] == 5, || format!("_all_docs counts every document: {}", all.body))
}

/// `COPY`'s `Destination` is read as CouchDB reads it (`couch_httpd_db:parse_copy_destination_header`,
/// then `chttpd:unquote`): raw UTF-8 bytes are the id, `%XX` is decoded and `+` is a space, and
/// `?rev=` names the revision replaced. A non-ASCII header used to be "missing" (400).
pub(super) async fn copy_destination_as_couchdb(e: Endpoint) -> TestResult {
    if passed_on(&e) {
        return Ok(());
    }
    let db = fresh_db_named(&e, "diffb", "copy").await?;
    e.put(&format!("/{db}/source"), json!({ "v": 1 })).await?.expect(201, "source")?;
    let source = format!("/{db}/source");
    let cases: [(&[u8], &str); 4] =
        [("caf\u{e9}".as_bytes(), "caf\u{e9}"), (b"a+b", "a b"), (b"c%2Bd%20e", "c+d e"), (b"%C3%BCber", "\u{fc}ber")];
    for (header, id) in cases {
        let copied = call_with_header(&e, "COPY", &source, "Destination", header).await?;
        let copied = copied.expect(201, &format!("COPY to {id:?}"))?;
        check(copied.body["id"] == id, || format!("COPY to {id:?}: {}", copied.body))?;
        let read = e
            .get(&format!("/{db}/{}", percent_encoding::utf8_percent_encode(id, percent_encoding::NON_ALPHANUMERIC)))
            .await?;
        let read = read.expect(200, &format!("GET {id:?}"))?;
        check(read.body["v"] == 1, || format!("{id:?}: {}", read.body))?;
    }
    // Over an existing document only with its revision, named after `?`.
    let target = e.get(&format!("/{db}/a%20b")).await?.expect(200, "GET a b")?;
    let rev = target.body["_rev"].as_str().unwrap_or_default().to_owned();
    call_with_header(&e, "COPY", &source, "Destination", b"a+b").await?.expect(409, "COPY over a b")?;
    let replaced = call_with_header(&e, "COPY", &source, "Destination", format!("a+b?rev={rev}").as_bytes()).await?;
    let replaced = replaced.expect(201, "COPY over a b with its rev")?;
    check(replaced.body["id"] == "a b" && replaced.body["rev"].as_str().is_some_and(|r| r.starts_with("2-")), || {
        format!("COPY with ?rev=: {}", replaced.body)
    })?;
    let absolute = call_with_header(&e, "COPY", &source, "Destination", b"http://elsewhere/db/x").await?;
    let absolute = absolute.expect(400, "an absolute Destination")?;
    check(absolute.body["reason"] == "Destination URL must be relative.", || format!("{}", absolute.body))
}

/// The empty id names no document, on every backend: `keys` answers it `not_found`, `_bulk_get`
/// refuses it as `couch_db:validate_docid` does, `_revs_diff` calls its revisions missing. On
/// Firestore it used to be a 400 naming the backend's internal document path.
pub(super) async fn empty_id_reads(e: Endpoint) -> TestResult {
    if passed_on(&e) {
        return Ok(());
    }
    let db = fresh_db_named(&e, "diffb", "empty").await?;
    e.put(&format!("/{db}/a"), json!({ "v": 1 })).await?.expect(201, "a")?;
    let listed = e.post(&format!("/{db}/_all_docs"), json!({ "keys": ["", "a"] })).await?.expect(200, "keys")?;
    check(listed.body["rows"][0] == json!({ "key": "", "error": "not_found" }), || format!("keys: {}", listed.body))?;
    check(listed.body["rows"][1]["id"] == "a", || format!("keys: {}", listed.body))?;
    let got = e.post(&format!("/{db}/_bulk_get"), json!({ "docs": [{ "id": "" }] })).await?.expect(200, "_bulk_get")?;
    let refused = json!({ "id": "", "rev": null, "error": "illegal_docid", "reason": "Document id must not be empty" });
    check(got.body["results"][0] == json!({ "id": "", "docs": [{ "error": refused }] }), || {
        format!("_bulk_get: {}", got.body)
    })?;
    let rev = format!("1-{}", "a".repeat(32));
    let diff = e.post(&format!("/{db}/_revs_diff"), json!({ "": [rev] })).await?.expect(200, "_revs_diff")?;
    check(diff.body == json!({ "": { "missing": [rev] } }), || format!("_revs_diff: {}", diff.body))?;
    for answer in [&listed, &got, &diff] {
        check(!answer.body.to_string().contains("projects/"), || format!("an internal path: {}", answer.body))?;
    }
    Ok(())
}

/// `_local` documents as CouchDB 3.4.3 keeps them (`couch_db_updater:increment_local_doc_revs`):
/// a write is `0-(N+1)` after the `0-N` it names and `0-1` without one, whatever is stored (a
/// stale revision is no conflict); a deletion is `0-0`. `GET` with `rev=` finds nothing (404, the
/// revision is looked for among the documents' trees) unless `latest=true`; `revs=true` shows the
/// one revision; `local_seq=true` adds nothing (a local document has no sequence).
pub(super) async fn local_documents_as_couchdb(e: Endpoint) -> TestResult {
    if passed_on(&e) {
        return Ok(());
    }
    let db = fresh_db_named(&e, "diffb", "local").await?;
    let path = format!("/{db}/_local/cp");
    let revs = |answer: &Answer| answer.body["rev"].as_str().unwrap_or_default().to_owned();
    let first = e.put(&path, json!({ "n": 1 })).await?.expect(201, "first")?;
    check(revs(&first) == "0-1", || format!("first: {}", first.body))?;
    let again = e.put(&path, json!({ "n": 2 })).await?.expect(201, "again without _rev")?;
    check(revs(&again) == "0-1", || format!("without _rev: {}", again.body))?;
    let named = e.put(&path, json!({ "_rev": "0-7", "n": 3 })).await?.expect(201, "with _rev 0-7")?;
    check(revs(&named) == "0-8", || format!("after 0-7: {}", named.body))?;
    let stale = e.put(&path, json!({ "_rev": "0-2", "n": 4 })).await?.expect(201, "with a stale _rev")?;
    check(revs(&stale) == "0-3", || format!("after a stale 0-2: {}", stale.body))?;
    let by_query = e.put(&format!("{path}?rev=0-3"), json!({ "n": 5 })).await?.expect(201, "?rev=0-3")?;
    check(revs(&by_query) == "0-4", || format!("?rev=0-3: {}", by_query.body))?;
    e.put(&path, json!({ "_rev": "1-abc", "n": 6 })).await?.expect(400, "a revision not 0-N")?;

    let read = e.get(&format!("{path}?local_seq=true&revs_info=true&conflicts=true")).await?.expect(200, "GET")?;
    check(read.body == json!({ "_id": "_local/cp", "_rev": "0-4", "n": 5 }), || format!("GET: {}", read.body))?;
    let with_revs = e.get(&format!("{path}?revs=true")).await?.expect(200, "revs=true")?;
    let expected = json!({ "_id": "_local/cp", "_rev": "0-4", "n": 5, "_revisions": { "start": 0, "ids": ["4"] } });
    check(with_revs.body == expected, || format!("revs=true: {}", with_revs.body))?;
    let by_rev = e.get(&format!("{path}?rev=0-4")).await?.expect(404, "rev=")?;
    check(by_rev.body == json!({ "error": "not_found", "reason": "missing" }), || format!("rev=: {}", by_rev.body))?;
    let latest = e.get(&format!("{path}?rev=0-1&latest=true")).await?.expect(200, "rev= with latest=true")?;
    check(latest.body["_rev"] == "0-4", || format!("latest: {}", latest.body))?;
    let listed = e.get(&format!("/{db}/_local_docs")).await?.expect(200, "_local_docs")?;
    check(listed.body["rows"][0]["value"] == json!({ "rev": "0-4" }), || format!("_local_docs: {}", listed.body))?;

    let deleted = e.delete(&format!("{path}?rev=0-1")).await?.expect(200, "DELETE with any rev")?;
    check(deleted.body == json!({ "ok": true, "id": "_local/cp", "rev": "0-0" }), || format!("{}", deleted.body))?;
    e.get(&path).await?.expect(404, "GET after DELETE")?;
    e.delete(&path).await?.expect(404, "DELETE of none")?;
    let back = e.put(&path, json!({ "_rev": "0-9" })).await?.expect(201, "written again")?;
    check(revs(&back) == "0-10", || format!("written again after 0-9: {}", back.body))
}

/// One `_bulk_docs`' changes are in id order, as CouchDB numbers them (`couch_db:group_alike_docs`
/// sorts a request's documents by id before `couch_db_updater` gives each its sequence), a
/// deletion among them included; they used to be in whatever order the writes finished.
pub(super) async fn bulk_docs_changes_in_id_order(e: Endpoint) -> TestResult {
    if passed_on(&e) {
        return Ok(());
    }
    let db = fresh_db_named(&e, "diffb", "order").await?;
    let gone = e.put(&format!("/{db}/m-gone"), json!({ "v": 0 })).await?.expect(201, "m-gone")?;
    let since = e.get(&format!("/{db}/_changes")).await?.expect(200, "since")?;
    let since = since.body["last_seq"].as_str().unwrap_or("0").to_owned();
    let since = percent_encoding::utf8_percent_encode(&since, percent_encoding::NON_ALPHANUMERIC).to_string();
    let mut ids: Vec<String> = (0..40).map(|i| format!("k{:02}", (i * 17) % 40)).collect();
    ids.extend(["zz".to_owned(), "_design/d".to_owned(), "a".to_owned()]);
    let mut docs: Vec<Value> = ids.iter().map(|id| json!({ "_id": id, "v": 1 })).collect();
    docs.insert(20, json!({ "_id": "m-gone", "_rev": gone.rev()?, "_deleted": true }));
    let written = e.post(&format!("/{db}/_bulk_docs"), json!({ "docs": docs })).await?.expect(201, "_bulk_docs")?;
    let written_ids: Vec<&str> =
        written.body.as_array().map(|rows| rows.iter().filter_map(|r| r["id"].as_str()).collect()).unwrap_or_default();
    check(written_ids.len() == docs.len() && written_ids[20] == "m-gone", || {
        format!("rows in request order: {}", written.body)
    })?;
    let mut expected: Vec<String> = docs.iter().filter_map(|doc| doc["_id"].as_str().map(str::to_owned)).collect();
    expected.sort();
    let feed = e.get(&format!("/{db}/_changes?since={since}")).await?.expect(200, "_changes")?;
    check(change_ids(&feed) == expected, || format!("changes {:?}, wanted {expected:?}", change_ids(&feed)))
}
