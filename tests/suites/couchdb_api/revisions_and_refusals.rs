//! Issue 34's differences from CouchDB 3.4.3 in revisions and refused writes, on the databases
//! besides the data-store one (and on the data-store one where the same request applies): the
//! revision ids CouchDB gives common edits, the writes it refuses, and the statuses of deletions,
//! attachment writes and `open_revs=[]`.
//!
//! Expected revision ids were computed apart from this server, by Erlang/OTP itself:
//! `erlang:md5(term_to_binary([Deleted, OldStart, OldRev, Body, Atts], [{minor_version, 1}]))`
//! with the terms CouchDB 3.4.3 builds (`couch_db:new_revid/1`; for a re-creation
//! `couch_db_updater:merge_rev_tree/4`), and each was also the answer of a real CouchDB 3.4.3 to
//! the same requests (`fixtures/couchdb-3.4.3-issue34/`). Statuses and bodies follow
//! `chttpd_db.erl` at 3.4.3 and that server's answers.
//!
//! On the CouchDB backend these databases are CouchDB's own (pouchdb-server here, which computes
//! revisions its own way): the trials check the other backends only.

use super::*;

async fn fresh_db(e: &Endpoint, tag: &str) -> Result<String, Failed> {
    fresh_db_named(e, "i34", tag).await
}

/// A request with a raw body and headers; the answer's status and JSON body.
async fn send(e: &Endpoint, method: Method, path: &str, content_type: &str, body: &[u8]) -> Result<Answer, Failed> {
    let request = e.client.request(method, e.url(path)).header("content-type", content_type).body(body.to_vec());
    Answer::read(request.send().await?).await
}

fn same(answer: &Answer, status: u16, body: Value, what: &str) -> TestResult {
    check(answer.status.as_u16() == status && answer.body == body, || {
        format!("{what}: {} {} where CouchDB answers {status} {body}", answer.status, answer.body)
    })
}

fn not_found(reason: &str) -> Value {
    json!({"error": "not_found", "reason": reason})
}

fn conflict() -> Value {
    json!({"error": "conflict", "reason": "Document update conflict."})
}

/// The revision ids CouchDB gives: arrays of small integers (Erlang strings), a standalone
/// attachment added to a document that has one (the new one first), the re-creation of a deleted
/// document with an attachment (`revpos` 1), and a second Mango index in a design document.
pub(super) async fn revisions_as_couchdb(e: Endpoint) -> TestResult {
    if e.backend == "couchdb" {
        return Ok(());
    }
    let db = fresh_db(&e, "revs").await?;

    let ints = e.put(&format!("/{db}/ints"), json!({"a": [1, 2, 3], "z": [0]})).await?.expect(201, "PUT ints")?;
    check(ints.rev()? == "1-02a6620dd4160feb85213d951d769338", || format!("[1,2,3] and [0]: {}", ints.body))?;

    // `application/octet-stream`: CouchDB gzips the types it finds compressible (`text/*`, …)
    // and takes their digest from the compressed bytes (docs/attachments.md).
    let binary = "application/octet-stream";
    let first = send(&e, Method::PUT, &format!("/{db}/att/first.bin"), binary, b"one").await?;
    let first = first.expect(201, "PUT first.bin")?.rev()?;
    check(first == "1-ce94e751becead90988e297331957424", || format!("first attachment: {first}"))?;
    let second = send(&e, Method::PUT, &format!("/{db}/att/second.bin?rev={first}"), binary, b"two").await?;
    let second = second.expect(201, "PUT second.bin")?.rev()?;
    check(second == "2-c9280ffc71df05f7fbe5ade36dfb1e39", || format!("second attachment: {second}"))?;
    let doc = e.get(&format!("/{db}/att")).await?.expect(200, "GET att")?;
    let names: Vec<&String> = doc.body["_attachments"].as_object().map(|a| a.keys().collect()).unwrap_or_default();
    check(names == ["second.bin", "first.bin"], || format!("the new attachment comes first: {}", doc.body))?;

    let one = e.put(&format!("/{db}/re"), json!({"v": 1})).await?.expect(201, "PUT re")?.rev()?;
    check(one == "1-7a7e4b29f3af401e69b6f86e4c26b727", || format!("re: {one}"))?;
    let gone = e.delete(&format!("/{db}/re?rev={one}")).await?.expect(200, "DELETE re")?.rev()?;
    check(gone == "2-d9b15b235a7d0afdfe6058d5fb8afbd1", || format!("re deleted: {gone}"))?;
    let attachment = json!({"a.txt": {"content_type": "text/plain", "data": "aGk="}});
    let again = e.put(&format!("/{db}/re"), json!({"v": 2, "_attachments": attachment})).await?;
    let again = again.expect(201, "re-create re")?.rev()?;
    check(again == "3-3f5c62891cf503cfdd45e180a3722160", || format!("re re-created with an attachment: {again}"))?;
    let doc = e.get(&format!("/{db}/re")).await?.expect(200, "GET re")?;
    check(doc.body["_attachments"]["a.txt"]["revpos"] == json!(1), || {
        format!("revpos of a re-creation: {}", doc.body)
    })?;

    let index = |field: &str, name: &str| json!({"index": {"fields": [field]}, "ddoc": "q", "name": name});
    e.post(&format!("/{db}/_index"), index("a", "i1")).await?.expect(200, "first index")?;
    let ddoc = e.get(&format!("/{db}/_design/q")).await?.expect(200, "GET _design/q")?;
    check(ddoc.body["_rev"] == json!("1-534ec17da87a3a4953d3ba30c6783197"), || format!("one index: {}", ddoc.body))?;
    e.post(&format!("/{db}/_index"), index("b", "i2")).await?.expect(200, "second index")?;
    let ddoc = e.get(&format!("/{db}/_design/q")).await?.expect(200, "GET _design/q")?;
    let members: Vec<&String> = ddoc.body.as_object().map(|d| d.keys().collect()).unwrap_or_default();
    check(members == ["_id", "_rev", "language", "views"], || format!("members in CouchDB's order: {}", ddoc.body))?;
    check(ddoc.body["_rev"] == json!("2-06fc8796fedadc6c10bb4555d25e609b"), || format!("two indexes: {}", ddoc.body))
}

/// Writes CouchDB refuses whole: a local document with an unknown special member (alone or in
/// `_bulk_docs`, where nothing of the request is written) and `all_or_nothing: true` (417).
pub(super) async fn refused_writes_as_couchdb(e: Endpoint) -> TestResult {
    if e.backend == "couchdb" {
        return Ok(());
    }
    let db = fresh_db(&e, "refused").await?;
    let zing = json!({"error": "doc_validation", "reason": "Bad special document member: _zing"});
    let bulk = json!({"docs": [{"_id": "plain", "v": 1}, {"_id": "_local/x", "_zing": 1}]});
    same(&e.post(&format!("/{db}/_bulk_docs"), bulk).await?, 400, zing.clone(), "_bulk_docs with _local/_zing")?;
    e.get(&format!("/{db}/plain")).await?.expect(404, "nothing of the refused request is written")?;
    e.get(&format!("/{db}/_local/x")).await?.expect(404, "nor the local document")?;
    same(&e.put(&format!("/{db}/_local/x"), json!({"_zing": 1})).await?, 400, zing.clone(), "PUT _local/x _zing")?;
    same(&e.put(&format!("/{DB}/_local/x"), json!({"_zing": 1})).await?, 400, zing.clone(), "data-store PUT _local")?;
    let bulk = json!({"docs": [{"_id": "_local/x", "_zing": 1}]});
    same(&e.post(&format!("/{DB}/_bulk_docs"), bulk).await?, 400, zing, "data-store _bulk_docs with _local/_zing")?;

    let not_boolean = json!({"error": "doc_validation", "reason": "Bad special document member: _deleted"});
    let answer = e.put(&format!("/{db}/ds"), json!({"_deleted": "yes"})).await?;
    same(&answer, 400, not_boolean.clone(), "_deleted not a boolean")?;
    let mut data = doc("u34", "ns", "ds", json!(1));
    data["_deleted"] = json!("yes");
    let answer = e.put(&path_of(data["_id"].as_str().unwrap_or_default()), data).await?;
    same(&answer, 400, not_boolean, "data-store _deleted not a boolean")?;

    let rev = e.put(&format!("/{db}/kept"), json!({"v": 1})).await?.expect(201, "PUT kept")?.rev()?;
    let request = json!({"all_or_nothing": true, "docs": [{"_id": "kept", "_rev": rev, "v": 2}, {"_id": "new"}]});
    let refused = |id: &str, rev: &str| json!({"id": id, "rev": rev, "error": "not_implemented", "reason": "all_or_nothing is not supported"});
    let answer = e.post(&format!("/{db}/_bulk_docs"), request).await?;
    same(&answer, 417, json!([refused("kept", &rev), refused("new", "0-")]), "all_or_nothing")?;
    e.get(&format!("/{db}/new")).await?.expect(404, "all_or_nothing writes nothing")?;
    let kept = e.get(&format!("/{db}/kept")).await?.expect(200, "GET kept")?;
    check(kept.body["_rev"] == json!(rev), || format!("all_or_nothing leaves documents as they were: {}", kept.body))?;
    let empty = e.post(&format!("/{db}/_bulk_docs"), json!({"all_or_nothing": true, "docs": []})).await?;
    same(&empty, 201, json!([]), "all_or_nothing of no documents")?;
    let empty = e.post(&format!("/{DB}/_bulk_docs"), json!({"all_or_nothing": true, "docs": []})).await?;
    same(&empty, 201, json!([]), "data-store all_or_nothing of no documents")
}

/// The statuses of deletions (404 for a document missing or deleted, whatever revision is
/// named), of attachment writes naming no document or an unknown revision, of `open_revs=[]` (a
/// plain read) and of an edit both conflicting and refused by `validate_doc_update` (409: the
/// revision is checked first).
pub(super) async fn statuses_as_couchdb(e: Endpoint) -> TestResult {
    if e.backend == "couchdb" {
        return Ok(());
    }
    let db = fresh_db(&e, "statuses").await?;
    let stale = "1-0123456789abcdef0123456789abcdef";
    same(&e.delete(&format!("/{db}/nothing")).await?, 404, not_found("missing"), "DELETE missing")?;
    same(&e.delete(&format!("/{db}/nothing?rev={stale}")).await?, 404, not_found("missing"), "DELETE missing ?rev")?;
    let rev = e.put(&format!("/{db}/gone"), json!({"v": 1})).await?.expect(201, "PUT gone")?.rev()?;
    same(&e.delete(&format!("/{db}/gone")).await?, 409, conflict(), "DELETE without a revision")?;
    same(&e.delete(&format!("/{db}/gone?rev={stale}")).await?, 409, conflict(), "DELETE with a stale revision")?;
    let deleted = e.delete(&format!("/{db}/gone?rev={rev}")).await?.expect(200, "DELETE gone")?.rev()?;
    same(&e.delete(&format!("/{db}/gone")).await?, 404, not_found("deleted"), "DELETE deleted")?;
    let again = e.delete(&format!("/{db}/gone?rev={deleted}")).await?;
    same(&again, 404, not_found("deleted"), "DELETE deleted with its revision")?;

    let missing_rev = json!({"error": "not_found", "reason": "missing_rev"});
    let missing_attachment = not_found("Document is missing attachment");
    let endpoint = &e;
    let delete_att = |path: String| async move { send(endpoint, Method::DELETE, &path, "text/plain", b"").await };
    same(&delete_att(format!("/{db}/nothing/a.txt")).await?, 404, not_found("missing"), "att DELETE, no doc")?;
    let answer = delete_att(format!("/{db}/nothing/a.txt?rev={stale}")).await?;
    same(&answer, 409, missing_rev.clone(), "att DELETE ?rev, no doc")?;
    let answer = send(&e, Method::PUT, &format!("/{db}/nothing/a.txt?rev={stale}"), "text/plain", b"x").await?;
    same(&answer, 409, missing_rev.clone(), "att PUT ?rev, no doc")?;
    let rev = e.put(&format!("/{db}/doc"), json!({"v": 1})).await?.expect(201, "PUT doc")?.rev()?;
    same(&delete_att(format!("/{db}/doc/a.txt")).await?, 404, missing_attachment.clone(), "att DELETE, no att")?;
    let answer = delete_att(format!("/{db}/doc/a.txt?rev={rev}")).await?;
    same(&answer, 404, missing_attachment, "att DELETE ?rev, no att")?;
    let answer = delete_att(format!("/{db}/doc/a.txt?rev={stale}")).await?;
    same(&answer, 409, missing_rev, "att DELETE, unknown revision")?;
    let put = send(&e, Method::PUT, &format!("/{db}/doc/a.txt?rev={rev}"), "text/plain", b"x").await?;
    put.expect(201, "att PUT")?;
    same(&delete_att(format!("/{db}/doc/a.txt")).await?, 409, conflict(), "att DELETE without a revision")?;

    let read = e.get(&format!("/{db}/doc?open_revs=[]")).await?.expect(200, "open_revs=[]")?;
    check(read.body["_id"] == json!("doc") && read.body["_attachments"].is_object(), || {
        format!("open_revs=[] reads the document: {}", read.body)
    })?;
    same(&e.get(&format!("/{db}/nothing?open_revs=[]")).await?, 404, not_found("missing"), "open_revs=[], none")?;
    let data = doc("u34", "ns", "k", json!(1));
    let id = data["_id"].as_str().unwrap_or_default().to_owned();
    e.put(&path_of(&id), data).await?.expect(201, "PUT a data-store document")?;
    let read = e.get(&format!("{}?open_revs=[]", path_of(&id))).await?.expect(200, "data-store open_revs=[]")?;
    check(read.body["_id"] == json!(id), || format!("data-store open_revs=[]: {}", read.body))?;

    let refuse_all = "function(newDoc) { throw({forbidden: 'nothing passes'}); }";
    e.put(&format!("/{db}/_design/guard"), json!({"validate_doc_update": refuse_all})).await?.expect(201, "guard")?;
    same(&e.put(&format!("/{db}/doc"), json!({"v": 2})).await?, 409, conflict(), "PUT without _rev, refused")?;
    let stale_put = e.put(&format!("/{db}/doc"), json!({"_rev": stale, "v": 2})).await?;
    same(&stale_put, 409, conflict(), "PUT with a stale _rev, refused")?;
    let answer = e.delete(&format!("/{db}/nothing?rev={stale}")).await?;
    same(&answer, 404, not_found("missing"), "DELETE of a missing document, refused")?;
    let fresh = e.put(&format!("/{db}/fresh"), json!({"v": 1})).await?;
    same(&fresh, 403, json!({"error": "forbidden", "reason": "nothing passes"}), "a new document is validated")
}
