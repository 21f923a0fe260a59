//! Earlier revisions' bodies on a database besides the data-store one (issue 35): as in CouchDB,
//! a revision that stops being a leaf keeps its body until `POST /{db}/_compact`, so `GET ?rev=`
//! of it, `open_revs=[it]`, its attachments and `_revs_info` `available` answer until then, and
//! its attachment bytes are not collected; the ancestors a replicated path brings never had a
//! body (`missing`); stemming by `_revs_limit` drops the bodies of the revisions it forgets; and
//! `couchdb_inner_bodies_max_revisions` bounds how many one document keeps (the oldest go).
//! The expected answers are Apache CouchDB 3.4.3's (checked against one with curl), except the
//! bound, which is this server's own (docs/couchdb-api.md). On the CouchDB backend the databases
//! are the backend's own: nothing of this engine to check there.

use libtest_mimic::Failed;
use reqwest::StatusCode;
use serde_json::{json, Value};

use super::attachments::blob_count;
use super::{fresh_db_named, Endpoint};
use crate::common::{check, TestResult};

/// The configuration of [`inner_bodies_freed_by_stemming_and_bounds`] (that of
/// [`inner_bodies_kept_until_compaction`] frees unreferenced attachment bytes at once).
pub(super) const INNER_BODIES_BOUND_CONFIG: &str = "couchdb_inner_bodies_max_revisions = 2\n";

async fn put(e: &Endpoint, path: &str, body: Value) -> Result<String, Failed> {
    e.put(path, body).await?.expect(201, &format!("PUT {path}"))?.rev()
}

/// `GET path` must answer 200 with exactly `wanted`.
async fn reads(e: &Endpoint, path: &str, wanted: Value) -> TestResult {
    let got = e.get(path).await?.expect(200, &format!("GET {path}"))?;
    check(got.body == wanted, || format!("GET {path}: {} (CouchDB answers {wanted})", got.body))
}

/// `GET path` must answer CouchDB's 404 `missing`.
async fn missing(e: &Endpoint, path: &str) -> TestResult {
    let got = e.get(path).await?.expect(404, &format!("GET {path}"))?;
    let wanted = json!({ "error": "not_found", "reason": "missing" });
    check(got.body == wanted, || format!("GET {path}: {} (CouchDB answers {wanted})", got.body))
}

/// The statuses of `_revs_info` of the winner, newest first.
async fn revs_info(e: &Endpoint, path: &str) -> Result<Vec<String>, Failed> {
    let got = e.get(&format!("{path}?revs_info=true")).await?.expect(200, &format!("GET {path}?revs_info"))?;
    let info = got.body["_revs_info"].as_array().cloned().unwrap_or_default();
    Ok(info.iter().map(|row| row["status"].as_str().unwrap_or_default().to_owned()).collect())
}

/// The bytes of an attachment as read over raw HTTP, with the status.
async fn attachment(e: &Endpoint, path: &str) -> Result<(StatusCode, Vec<u8>), Failed> {
    let response = e.client.get(e.url(path)).send().await?;
    let status = response.status();
    Ok((status, response.bytes().await?.to_vec()))
}

pub(super) async fn inner_bodies_kept_until_compaction(e: Endpoint) -> TestResult {
    if e.backend == "couchdb" {
        return Ok(());
    }
    let db = fresh_db_named(&e, "inner", "kept").await?;
    let doc = format!("/{db}/doc");
    let r1 = put(&e, &doc, json!({ "a": 1 })).await?;
    let r2 = put(&e, &format!("{doc}?rev={r1}"), json!({ "a": 2 })).await?;
    reads(&e, &format!("{doc}?rev={r1}"), json!({ "_id": "doc", "_rev": r1, "a": 1 })).await?;
    let r3 = e.delete(&format!("{doc}?rev={r2}")).await?.expect(200, "DELETE doc")?.rev()?;
    // The revision before the deletion (PouchDB's "Get revisions of removed doc").
    reads(&e, &format!("{doc}?rev={r2}"), json!({ "_id": "doc", "_rev": r2, "a": 2 })).await?;
    let opened = e.get(&format!("{doc}?open_revs=[\"{r1}\"]")).await?.expect(200, "open_revs of the first")?;
    let wanted = json!([{ "ok": { "_id": "doc", "_rev": r1, "a": 1 } }]);
    check(opened.body == wanted, || format!("open_revs=[{r1}]: {} (CouchDB answers {wanted})", opened.body))?;
    // Re-created: the deletion is an inner revision now, kept as a deletion.
    let r4 = put(&e, &doc, json!({ "a": 4 })).await?;
    reads(&e, &format!("{doc}?rev={r3}"), json!({ "_id": "doc", "_rev": r3, "_deleted": true })).await?;
    let statuses = revs_info(&e, &doc).await?;
    check(statuses == ["available", "deleted", "available", "available"], || {
        format!("_revs_info of {r4} before compaction: {statuses:?}")
    })?;

    // A replicated path's ancestors never had a body.
    let replicated = json!({ "new_edits": false, "docs": [
        { "_id": "rep", "_rev": "3-c", "_revisions": { "start": 3, "ids": ["c", "b", "a"] }, "x": 1 }
    ] });
    e.post(&format!("/{db}/_bulk_docs"), replicated).await?.expect(201, "replicated write")?;
    let statuses = revs_info(&e, &format!("/{db}/rep")).await?;
    check(statuses == ["available", "missing", "missing"], || {
        format!("_revs_info of a replicated path: {statuses:?}")
    })?;
    missing(&e, &format!("/{db}/rep?rev=2-b")).await?;

    // An earlier revision's attachment, its bytes kept (the collector sees the reference).
    let with_file =
        json!({ "a": 1, "_attachments": { "f.txt": { "content_type": "text/plain", "data": "aGVsbG8=" } } });
    let a1 = put(&e, &format!("/{db}/att"), with_file).await?;
    put(&e, &format!("/{db}/att?rev={a1}"), json!({ "a": 2 })).await?;
    // Another document's purge makes a collection run (no grace period here); a deletion would
    // not, its previous revision keeping its attachment.
    let other = json!({ "_attachments": { "g.txt": { "content_type": "text/plain", "data": "Ynll" } } });
    let o1 = put(&e, &format!("/{db}/other"), other).await?;
    e.post(&format!("/{db}/_purge"), json!({ "other": [o1] })).await?.expect(201, "purge other")?;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let (status, bytes) = attachment(&e, &format!("/{db}/att/f.txt?rev={a1}")).await?;
    check(status == StatusCode::OK && bytes == b"hello", || {
        format!("the first revision's attachment: {status} {:?}", String::from_utf8_lossy(&bytes))
    })?;
    let first = e.get(&format!("/{db}/att?rev={a1}")).await?.expect(200, "GET att?rev=1")?;
    let stub = &first.body["_attachments"]["f.txt"];
    // (CouchDB's digest is of the bytes as it keeps them, gzip-compressed for text; these are
    // kept decoded: docs/attachments.md, "Compression".)
    check(stub["stub"] == true && stub["revpos"] == 1 && stub["length"] == 5, || {
        format!("the first revision's attachment stub: {}", first.body)
    })?;

    e.post(&format!("/{db}/_compact"), json!({})).await?.expect(202, "_compact")?;
    for rev in [&r1, &r2, &r3] {
        missing(&e, &format!("{doc}?rev={rev}")).await?;
    }
    let statuses = revs_info(&e, &doc).await?;
    check(statuses == ["available", "missing", "missing", "missing"], || {
        format!("_revs_info after compaction: {statuses:?}")
    })?;
    let opened = e.get(&format!("{doc}?open_revs=[\"{r1}\"]")).await?.expect(200, "open_revs after compaction")?;
    check(opened.body == json!([{ "missing": r1 }]), || format!("open_revs after compaction: {}", opened.body))?;
    missing(&e, &format!("/{db}/att?rev={a1}")).await?;
    let (status, _) = attachment(&e, &format!("/{db}/att/f.txt?rev={a1}")).await?;
    check(status == StatusCode::NOT_FOUND, || format!("the first revision's attachment after compaction: {status}"))?;
    let blobs = blob_count(&e, &db).await?;
    check(blobs == 0, || format!("{blobs} attachment blobs kept after compaction; no kept body references one"))
}

pub(super) async fn inner_bodies_freed_by_stemming_and_bounds(e: Endpoint) -> TestResult {
    if e.backend == "couchdb" {
        return Ok(());
    }
    let db = fresh_db_named(&e, "inner", "stemmed").await?;
    let doc = format!("/{db}/doc");
    let r1 = put(&e, &doc, json!({ "n": 1 })).await?;
    let r2 = put(&e, &format!("{doc}?rev={r1}"), json!({ "n": 2 })).await?;
    let r3 = put(&e, &format!("{doc}?rev={r2}"), json!({ "n": 3 })).await?;
    reads(&e, &format!("{doc}?rev={r1}"), json!({ "_id": "doc", "_rev": r1, "n": 1 })).await?;
    e.put(&format!("/{db}/_revs_limit"), json!(2)).await?.expect(200, "_revs_limit 2")?;
    let r4 = put(&e, &format!("{doc}?rev={r3}"), json!({ "n": 4 })).await?;
    missing(&e, &format!("{doc}?rev={r1}")).await?;
    missing(&e, &format!("{doc}?rev={r2}")).await?;
    reads(&e, &format!("{doc}?rev={r3}"), json!({ "_id": "doc", "_rev": r3, "n": 3 })).await?;
    let statuses = revs_info(&e, &doc).await?;
    check(statuses == ["available", "available"], || format!("_revs_info of {r4} after stemming: {statuses:?}"))?;

    // couchdb_inner_bodies_max_revisions = 2: the third inner body kept drops the oldest.
    let bounded = fresh_db_named(&e, "inner", "bounded").await?;
    let doc = format!("/{bounded}/doc");
    let mut revs = vec![put(&e, &doc, json!({ "n": 1 })).await?];
    for n in 2..=4 {
        let parent = revs.last().cloned().unwrap_or_default();
        revs.push(put(&e, &format!("{doc}?rev={parent}"), json!({ "n": n })).await?);
    }
    missing(&e, &format!("{doc}?rev={}", revs[0])).await?;
    reads(&e, &format!("{doc}?rev={}", revs[1]), json!({ "_id": "doc", "_rev": revs[1], "n": 2 })).await?;
    let statuses = revs_info(&e, &doc).await?;
    check(statuses == ["available", "available", "available", "missing"], || {
        format!("_revs_info with two inner bodies kept: {statuses:?}")
    })
}
