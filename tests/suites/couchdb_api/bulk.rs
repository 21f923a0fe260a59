//! `_bulk_docs` and `_bulk_get`: per-document results, whole-request errors, and `all_or_nothing`.

use super::*;

pub(super) async fn bulk_docs_and_bulk_get(e: Endpoint) -> TestResult {
    let request = fixture("024-bulk-docs")["request"]["body"].clone();
    let docs = request["docs"].as_array().cloned().unwrap_or_default();
    let written = e.post(&format!("/{DB}/_bulk_docs"), request.clone()).await?.expect(201, "_bulk_docs")?;
    let rows = written.body.as_array().cloned().unwrap_or_default();
    check(rows.len() == docs.len() && rows.iter().all(|r| r["ok"] == true), || {
        format!("_bulk_docs: {}", written.body)
    })?;
    for (row, sent) in rows.iter().zip(&docs) {
        check(row["id"] == sent["_id"], || "rows follow request order".into())?;
    }
    let one_conflict = fixture("025-bulk-docs-one-conflict")["request"]["body"].clone();
    let answer = e.post(&format!("/{DB}/_bulk_docs"), one_conflict).await?.expect(201, "_bulk_docs conflict")?;
    let expected = couchdb_body("025-bulk-docs-one-conflict");
    check(answer.body[0] == expected[0], || {
        format!("per-document conflict: {} (CouchDB: {})", answer.body[0], expected[0])
    })?;
    check(answer.body[1]["ok"] == true, || format!("the other document is written: {}", answer.body))?;
    let get = fixture("048-bulk-get")["request"]["body"].clone();
    let got = e.post(&format!("/{DB}/_bulk_get"), get).await?.expect(200, "_bulk_get")?;
    let couch = couchdb_body("048-bulk-get");
    check(
        got.body.as_object().is_some_and(|o| o.len() == 1)
            && got.body["results"].as_array().is_some_and(|r| r.len() == 2),
        || format!("_bulk_get is exactly {{results}}: {}", got.body),
    )?;
    check(got.body["results"][0]["docs"][0]["ok"]["value"] == couch["results"][0]["docs"][0]["ok"]["value"], || {
        "found doc".into()
    })?;
    check(
        got.body["results"][1]["docs"][0]["error"]["error"] == couch["results"][1]["docs"][0]["error"]["error"],
        || format!("missing doc: {} (CouchDB: {})", got.body["results"][1], couch["results"][1]),
    )?;
    let empty = e.post(&format!("/{DB}/_bulk_get"), json!({"docs": []})).await?.expect(200, "_bulk_get of nothing")?;
    check(empty.body == json!({"results": []}), || format!("empty _bulk_get: {}", empty.body))?;
    // Delete through _bulk_docs, then read the tombstone by revision as replicators do.
    let first = rows[0].clone();
    let deleted = e
        .post(
            &format!("/{DB}/_bulk_docs"),
            json!({"docs": [{"_id": first["id"], "_rev": first["rev"], "_deleted": true}]}),
        )
        .await?
        .expect(201, "_bulk_docs delete")?;
    let tombstone_rev = deleted.body[0]["rev"].clone();
    let by_rev = e
        .post(&format!("/{DB}/_bulk_get?revs=true"), json!({"docs": [{"id": first["id"], "rev": tombstone_rev}]}))
        .await?
        .expect(200, "_bulk_get tombstone")?;
    let tombstone = &by_rev.body["results"][0]["docs"][0]["ok"];
    check(tombstone["_deleted"] == true && tombstone["_revisions"]["start"] == 2, || {
        format!("tombstone: {}", by_rev.body)
    })
}

/// A `_bulk_docs` request holding an invalid document is refused whole with 400, nothing of it
/// written, in both `new_edits` modes. Expected answers: `053-doc-invalid-id` (CouchDB 3.4.3's
/// `illegal_docid` body) and CouchDB's `couch_doc.erl` (`Bad special document member: _~s`,
/// `doc_validation`); `chttpd_db.erl` validates every document of `docs` before writing any.
pub(super) async fn bulk_docs_whole_request_errors(e: Endpoint) -> TestResult {
    let good = doc("user_1", "ns", "bulk-good", json!(1));
    let good_path = path_of(good["_id"].as_str().unwrap_or_default());
    let bad_id = json!({"_id": "_notallowed", "userId": "u"});
    let answer = e.post(&format!("/{DB}/_bulk_docs"), json!({"docs": [good.clone(), bad_id.clone()]})).await?;
    same_error(&answer, "053-doc-invalid-id")?;
    let mut bad_member = doc("user_1", "ns", "bulk-zing", json!(1));
    bad_member["_zing"] = json!(1);
    let zing = json!({"error": "doc_validation", "reason": "Bad special document member: _zing"});
    let answer = e.post(&format!("/{DB}/_bulk_docs"), json!({"docs": [good.clone(), bad_member.clone()]})).await?;
    check(answer.status == StatusCode::BAD_REQUEST && answer.body == zing, || {
        format!("_zing: {} {}", answer.status, answer.body)
    })?;
    let mut replicated_good = good.clone();
    replicated_good["_rev"] = json!(format!("1-{}", "b".repeat(32)));
    bad_member["_rev"] = json!(format!("1-{}", "c".repeat(32)));
    let answer = e
        .post(&format!("/{DB}/_bulk_docs"), json!({"docs": [replicated_good, bad_member], "new_edits": false}))
        .await?;
    check(answer.status == StatusCode::BAD_REQUEST && answer.body == zing, || {
        format!("_zing, new_edits=false: {} {}", answer.status, answer.body)
    })?;
    // `validate_revs` in `chttpd_db.erl`: a replicated document needs `_rev` or `_revisions`.
    let answer = e.post(&format!("/{DB}/_bulk_docs"), json!({"docs": [good.clone()], "new_edits": false})).await?;
    let no_rev = json!({"error": "bad_request",
        "reason": "When `new_edits: false`, the document needs `_rev` or `_revisions` specified"});
    check(answer.status == StatusCode::BAD_REQUEST && answer.body == no_rev, || {
        format!("new_edits=false without _rev: {} {}", answer.status, answer.body)
    })?;
    same_error(&e.get(&good_path).await?, "020-doc-get-missing")?;
    // A document the data-store rules refuse still fails alone (a validate_doc_update refusal).
    let mut not_data = doc("user_1", "ns", "bulk-other", json!(1));
    not_data["key"] = json!("something else");
    let answer = e.post(&format!("/{DB}/_bulk_docs"), json!({"docs": [good, not_data]})).await?.expect(201, "mixed")?;
    check(answer.body[0]["ok"] == true && answer.body[1]["error"] == "forbidden", || format!("{}", answer.body))
}

/// `all_or_nothing: true` is refused as CouchDB 3 refuses it: 417, a `not_implemented` row per
/// document with the sent revision (`0-` for none), nothing written (`fabric_doc_update.erl`,
/// `validate_atomic_update`; `chttpd_db.erl` sends the rows with 417; issue 22 item 2c.12).
pub(super) async fn bulk_docs_all_or_nothing(e: Endpoint) -> TestResult {
    let first = doc("user_1", "ns", "aon-1", json!(1));
    let mut second = doc("user_1", "ns", "aon-2", json!(2));
    second["_rev"] = json!("1-0123456789abcdef0123456789abcdef");
    let answer = e
        .post(&format!("/{DB}/_bulk_docs"), json!({"docs": [first.clone(), second.clone()], "all_or_nothing": true}))
        .await?
        .expect(417, "all_or_nothing")?;
    let row = |id: &Value, rev: &str| json!({"id": id, "rev": rev, "error": "not_implemented", "reason": "all_or_nothing is not supported"});
    let expected = json!([row(&first["_id"], "0-"), row(&second["_id"], "1-0123456789abcdef0123456789abcdef")]);
    check(answer.body == expected, || format!("all_or_nothing: {} (CouchDB: {expected})", answer.body))?;
    same_error(&e.get(&path_of(first["_id"].as_str().unwrap_or_default())).await?, "020-doc-get-missing")?;
    e.post(&format!("/{DB}/_bulk_docs"), json!({"docs": [first], "all_or_nothing": false}))
        .await?
        .expect(201, "all_or_nothing false is an ordinary request")?;
    Ok(())
}
