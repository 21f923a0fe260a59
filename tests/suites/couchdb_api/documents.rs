//! Documents: the lifecycle, deletions and revision reads as CouchDB answers them, local
//! documents, and design documents (passed through over the CouchDB backend, kept by this
//! server elsewhere).

use super::*;

pub(super) async fn document_lifecycle(e: Endpoint) -> TestResult {
    let transcript = fixture("013-doc-put-create");
    let body = transcript["request"]["body"].clone();
    let id = body["_id"].as_str().unwrap_or_default().to_owned();
    let raw_path = format!("/{DB}/{id}");
    let created = e.put(&raw_path, body.clone()).await?.expect(201, "PUT create")?;
    let rev1 = created.rev()?;
    check(created.body["ok"] == true && created.body["id"] == id.as_str(), || format!("create: {}", created.body))?;
    check(rev1.starts_with("1-"), || format!("first revision {rev1}"))?;
    check(created.header("etag") == Some(&format!("\"{rev1}\"")), || format!("ETag {:?}", created.header("etag")))?;
    check(created.header("location").is_some(), || "Location missing".into())?;
    same_error(&e.put(&raw_path, body.clone()).await?, "014-doc-put-conflict-no-rev")?;
    let fetched = e.get(&raw_path).await?.expect(200, "GET")?;
    check(fetched.body["_rev"] == rev1.as_str() && fetched.body["value"] == body["value"], || {
        format!("GET: {}", fetched.body)
    })?;
    same_fields(&fetched.body, &couchdb_body("016-doc-get"), "GET doc", &[])?;
    let encoded = e.get(&path_of(&id)).await?.expect(200, "GET percent-encoded")?;
    check(encoded.body == fetched.body, || "the percent-encoded id reads the same document".into())?;
    let head = e.call(Method::HEAD, &raw_path, None).await?.expect(200, "HEAD")?;
    check(head.header("etag") == Some(&format!("\"{rev1}\"")), || "HEAD ETag".into())?;
    let cached = e.client.get(e.url(&raw_path)).header("If-None-Match", format!("\"{rev1}\"")).send().await?;
    check(cached.status() == StatusCode::NOT_MODIFIED, || format!("If-None-Match: {}", cached.status()))?;
    let mut update = body.clone();
    update["_rev"] = json!(rev1);
    update["value"] = json!("updated");
    let updated = e.put(&raw_path, update.clone()).await?.expect(201, "PUT update")?;
    let rev2 = updated.rev()?;
    check(rev2.starts_with("2-"), || format!("second revision {rev2}"))?;
    same_error(&e.put(&raw_path, update).await?, "015-doc-put-conflict-stale-rev")?;
    same_error(&e.delete(&format!("{raw_path}?rev={rev1}")).await?, "021-doc-delete-stale-rev")?;
    let deleted = e.delete(&format!("{raw_path}?rev={rev2}")).await?.expect(200, "DELETE")?;
    check(deleted.rev()?.starts_with("3-"), || format!("delete: {}", deleted.body))?;
    same_error(&e.get(&raw_path).await?, "023-doc-get-deleted")?;
    same_error(&e.get(&format!("/{DB}/user_123:default:bm9wZQ==")).await?, "020-doc-get-missing")?;
    let recreated = e.put(&raw_path, body).await?.expect(201, "re-create")?;
    check(recreated.rev()?.starts_with("4-"), || format!("re-create continues the generation: {}", recreated.body))?;
    let with_revs = e.get(&format!("{raw_path}?revs=true")).await?.expect(200, "GET ?revs=true")?;
    check(
        with_revs.body["_revisions"]["start"] == 4
            && with_revs.body["_revisions"]["ids"].as_array().is_some_and(|i| i.len() == 4),
        || format!("_revisions: {}", with_revs.body["_revisions"]),
    )?;
    let open = e.get(&format!("{raw_path}?open_revs=all")).await?.expect(200, "open_revs=all")?;
    check(open.body.as_array().is_some_and(|a| a.len() == 1 && a[0]["ok"]["_id"] == id.as_str()), || {
        format!("open_revs: {}", open.body)
    })?;
    let missing_rev = e.get(&format!("{raw_path}?open_revs=[\"{rev1}\"]")).await?.expect(200, "open_revs=[old]")?;
    check(missing_rev.body == json!([{ "missing": rev1 }]), || format!("open_revs old: {}", missing_rev.body))
}

/// The status line of a `GET` sent byte for byte as given, path unresolved.
async fn raw_get_status_line(e: &Endpoint, path: &str) -> Result<String, Failed> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let address = e.root.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await?;
    let text = String::from_utf8_lossy(&answer);
    Ok(text.lines().next().unwrap_or_default().to_owned())
}

/// The legacy design document of fixture 041 and its views (042, 043) on every backend: over the
/// CouchDB backend they pass through to the database, over the others this server keeps the
/// design document and answers the views; both answer the views exactly as CouchDB 3.4.3 did over
/// the same documents (fixtures 024 and 025's writes: the 41 documents CouchDB held). A path that
/// would climb out of the design document is refused before any backend sees it.
pub(super) async fn design_documents(e: Endpoint) -> TestResult {
    let ddoc = fixture("041-legacy-design-doc-put")["request"]["body"].clone();
    let ddoc_path = format!("/{DB}/_design/data_store");
    // Sent as raw HTTP: URL libraries resolve these segments before sending.
    for escaping in ["_design/%2e%2e/_all_docs", "_design/x/./_view/v", "_design/x/%2E/%2E%2E/y"] {
        let status_line = raw_get_status_line(&e, &format!("/{DB}/{escaping}")).await?;
        check(status_line.starts_with("HTTP/1.1 400"), || format!("GET {escaping}: {status_line}"))?;
    }
    let created = e.put(&ddoc_path, ddoc.clone()).await?.expect(201, "PUT the legacy design document")?;
    same_fields(&created.body, &couchdb_body("041-legacy-design-doc-put"), "PUT _design", &[])?;
    let rev = created.rev()?;
    check(rev.starts_with("1-") && created.header("etag") == Some(&format!("\"{rev}\"")), || {
        format!("PUT _design: {} (ETag {:?})", created.body, created.header("etag"))
    })?;
    let read = e.get(&path_of("_design/data_store")).await?.expect(200, "GET _design%2Fdata_store")?;
    check(read.body["views"] == ddoc["views"] && read.body["_rev"] == rev.as_str(), || format!("ddoc: {}", read.body))?;
    let by_path = e.get(&ddoc_path).await?.expect(200, "GET _design/data_store")?;
    check(by_path.body == read.body, || format!("the two paths read {} and {}", by_path.body, read.body))?;
    // The documents CouchDB held when it answered 042 and 043: 024's and 025's new one (025's
    // first document is a conflict there as here).
    let first = fixture("024-bulk-docs")["request"]["body"].clone();
    e.post(&format!("/{DB}/_bulk_docs"), first).await?.expect(201, "024's documents")?;
    let second = fixture("025-bulk-docs-one-conflict")["request"]["body"].clone();
    e.post(&format!("/{DB}/_bulk_docs"), second).await?.expect(201, "025's documents")?;
    for transcript in ["042-legacy-view-by-user-namespace", "043-legacy-view-by-user-grouped"] {
        let path = fixture(transcript)["request"]["path"].as_str().unwrap_or_default().to_owned();
        let mut answer = e.get(&path).await?.expect(200, transcript)?;
        let mut expected = couchdb_body(transcript);
        if e.backend == "couchdb" {
            // pouchdb-server, the CouchDB of these tests, counts `offset` from the start of the
            // key range instead of the start of the view (0 where CouchDB says 2): everything
            // else it answers as CouchDB did.
            check(answer.body["offset"].is_u64(), || format!("{transcript}: offset in {}", answer.body))?;
            answer.body["offset"] = json!(null);
            expected["offset"] = json!(null);
        }
        check(answer.body == expected, || format!("{transcript}: {} where CouchDB answered {expected}", answer.body))?;
    }
    let stale = e.put(&ddoc_path, ddoc.clone()).await?;
    check(stale.status == StatusCode::CONFLICT, || format!("a second PUT without _rev: {}", stale.status))?;
    let mut edited = ddoc.clone();
    edited["_rev"] = json!(rev);
    edited["views"]["by_namespace"] = json!({"map": "function(doc) { emit(doc.namespace, 1); }", "reduce": "_count"});
    let rev2 = e.put(&ddoc_path, edited).await?.expect(201, "PUT with _rev")?.rev()?;
    check(rev2.starts_with("2-"), || format!("second revision {rev2}"))?;
    let counted = e
        .get(&format!("{ddoc_path}/_view/by_namespace?group=true"))
        .await?
        .expect(200, "a grouped _count over the data-store database")?;
    let expected = json!({"rows": [
        {"key": "cache:github", "value": 1}, {"key": "files:my-repo", "value": 1},
        {"key": "notes", "value": 34}, {"key": "weird keys", "value": 5}]});
    check(counted.body == expected, || format!("grouped _count: {}", counted.body))?;
    let stale_delete = e.delete(&format!("{ddoc_path}?rev={rev}")).await?;
    if e.backend == "couchdb" {
        // pouchdb-server's reason lacks CouchDB's final full stop.
        let stale_delete = stale_delete.expect(409, "DELETE at a stale revision")?;
        check(stale_delete.body["error"] == "conflict", || format!("stale DELETE: {}", stale_delete.body))?;
    } else {
        same_error(&stale_delete, "021-doc-delete-stale-rev")?;
    }
    e.delete(&format!("{ddoc_path}?rev={rev2}")).await?.expect(200, "DELETE the design document")?;
    // CouchDB's reason for a deleted document is `deleted`; pouchdb-server says `missing`.
    let deleted_reason =
        |body: &Value| body["reason"] == "deleted" || (e.backend == "couchdb" && body["reason"] == "missing");
    let gone = e.get(&ddoc_path).await?.expect(404, "the deleted design document")?;
    check(deleted_reason(&gone.body), || format!("a deleted design document: {}", gone.body))?;
    let view = e.get(&format!("{ddoc_path}/_view/by_user")).await?.expect(404, "a view of the deleted document")?;
    check(deleted_reason(&view.body), || format!("a view of a deleted design document: {}", view.body))?;
    e.get(&format!("/{DB}/_design/never/_view/v")).await?.expect(404, "a view of a missing design document")?;
    Ok(())
}

/// Deletions as CouchDB 3.4.3 answers them (issue 22 items 2c.6 and 2c.13): DELETE of a missing
/// or deleted document is 404 `missing`/`deleted` (`chttpd_db.erl` opens the document first;
/// bodies from `020-doc-get-missing` and `023-doc-get-deleted`); a deletion of an id never written
/// makes a tombstone at generation 1; PUT with `_deleted` answers 200; `?batch=ok` answers 202
/// `{"ok": true, "id"}` (`chttpd_db.erl`).
pub(super) async fn deletions_as_couchdb(e: Endpoint) -> TestResult {
    let never = doc("user_1", "ns", "never-written", json!(1));
    let never_path = path_of(never["_id"].as_str().unwrap_or_default());
    same_error(&e.delete(&never_path).await?, "020-doc-get-missing")?;
    same_error(&e.delete(&format!("{never_path}?rev=1-{}", "a".repeat(32))).await?, "020-doc-get-missing")?;
    let live = doc("user_1", "ns", "to-delete", json!(1));
    let live_path = path_of(live["_id"].as_str().unwrap_or_default());
    let rev = e.put(&live_path, live.clone()).await?.expect(201, "create")?.rev()?;
    same_error(&e.delete(&live_path).await?, "014-doc-put-conflict-no-rev")?;
    let deleted = e.put(&live_path, json!({"_id": live["_id"], "_rev": rev, "_deleted": true})).await?;
    let deleted = deleted.expect(200, "PUT with _deleted answers 200")?;
    check(deleted.body["ok"] == true && deleted.rev()?.starts_with("2-"), || format!("{}", deleted.body))?;
    same_error(&e.delete(&live_path).await?, "023-doc-get-deleted")?;
    same_error(&e.delete(&format!("{live_path}?rev={}", deleted.rev()?)).await?, "023-doc-get-deleted")?;
    // Deleting ids never written: tombstones at generation 1.
    let tombstone = e.put(&never_path, json!({"_id": never["_id"], "_deleted": true})).await?;
    let tombstone = tombstone.expect(200, "PUT _deleted of a new id")?;
    check(tombstone.rev()?.starts_with("1-"), || format!("tombstone of a new id: {}", tombstone.body))?;
    same_error(&e.get(&never_path).await?, "023-doc-get-deleted")?;
    let other = doc("user_1", "ns", "never-written-2", json!(1));
    let bulk = e
        .post(&format!("/{DB}/_bulk_docs"), json!({"docs": [{"_id": other["_id"], "_deleted": true}]}))
        .await?
        .expect(201, "_bulk_docs _deleted of a new id")?;
    check(bulk.body[0]["ok"] == true && bulk.body[0]["rev"].as_str().is_some_and(|r| r.starts_with("1-")), || {
        format!("_bulk_docs tombstone: {}", bulk.body)
    })?;
    // A deletion without a revision of a deleted document is a conflict, as CouchDB 3.4.3
    // answers it, on every backend (the CouchDB backend's data-store database is the engine's
    // too: ARCHITECTURE.md).
    let again = e.put(&never_path, json!({"_id": never["_id"], "_deleted": true})).await?;
    let as_couchdb = again.status == StatusCode::CONFLICT && again.body["error"] == "conflict";
    check(as_couchdb, || format!("a second deletion without a revision: {} {}", again.status, again.body))?;
    // Re-creating after the deletion still works.
    e.put(&live_path, live.clone()).await?.expect(201, "re-create")?;
    // batch=ok: 202 without a revision, and the document is there.
    let batched = doc("user_1", "ns", "batched", json!(1));
    let batched_path = path_of(batched["_id"].as_str().unwrap_or_default());
    let answer = e.put(&format!("{batched_path}?batch=ok"), batched.clone()).await?.expect(202, "PUT batch=ok")?;
    check(answer.body == json!({"ok": true, "id": batched["_id"]}), || format!("batch=ok: {}", answer.body))?;
    e.get(&batched_path).await?.expect(200, "the batched document")?;
    let mut posted = doc("user_1", "ns", "batched-post", json!(1));
    posted.as_object_mut().map(|m| m.remove("_id"));
    let answer = e.post(&format!("/{DB}?batch=ok"), posted).await?.expect(202, "POST batch=ok")?;
    check(answer.body["ok"] == true && answer.body.get("rev").is_none(), || format!("{}", answer.body))
}

/// Reads of deleted and older revisions as CouchDB 3.4.3 answers them (issue 22 item 2c.9):
/// `_bulk_get` of a deleted document without a rev gives its tombstone; `GET ?rev=<older>&
/// latest=true` gives the current leaf; `GET ?open_revs=all` of a missing document is 404.
pub(super) async fn revision_reads_as_couchdb(e: Endpoint) -> TestResult {
    let sent = doc("user_1", "ns", "revs", json!(1));
    let id = sent["_id"].as_str().unwrap_or_default().to_owned();
    let first = e.put(&path_of(&id), sent.clone()).await?.expect(201, "create")?.rev()?;
    let mut update = sent.clone();
    update["_rev"] = json!(first);
    update["value"] = json!(2);
    let second = e.put(&path_of(&id), update).await?.expect(201, "update")?.rev()?;
    let latest = e.get(&format!("{}?rev={first}&latest=true", path_of(&id))).await?.expect(200, "latest")?;
    check(latest.body["_rev"] == json!(second) && latest.body["value"] == 2, || format!("{}", latest.body))?;
    e.get(&format!("{}?rev={first}", path_of(&id))).await?.expect(404, "older rev without latest")?;
    let missing = doc("user_1", "ns", "revs-missing", json!(1));
    let answer = e.get(&format!("{}?open_revs=all", path_of(missing["_id"].as_str().unwrap_or_default()))).await?;
    same_error(&answer, "020-doc-get-missing")?;
    let gone = e.delete(&format!("{}?rev={second}", path_of(&id))).await?.expect(200, "delete")?.rev()?;
    let latest = e.get(&format!("{}?rev={first}&latest=true", path_of(&id))).await?.expect(200, "latest tombstone")?;
    check(latest.body["_rev"] == json!(gone) && latest.body["_deleted"] == true, || format!("{}", latest.body))?;
    let got = e.post(&format!("/{DB}/_bulk_get"), json!({"docs": [{"id": id}]})).await?.expect(200, "_bulk_get")?;
    let tombstone = &got.body["results"][0]["docs"][0]["ok"];
    check(tombstone["_deleted"] == true && tombstone["_rev"] == json!(gone) && tombstone["_id"] == json!(id), || {
        format!("_bulk_get of a deleted document: {}", got.body)
    })
}

pub(super) async fn local_documents(e: Endpoint) -> TestResult {
    let path = format!("/{DB}/_local/replication-checkpoint");
    same_error(&e.get(&path).await?, "020-doc-get-missing")?;
    let first = e.put(&path, json!({"history": [], "session_id": "s"})).await?.expect(201, "_local put")?;
    check(first.rev()? == "0-1", || format!("local rev: {}", first.body))?;
    let read = e.get(&path).await?.expect(200, "_local get")?;
    check(read.body["_id"] == "_local/replication-checkpoint" && read.body["_rev"] == "0-1", || {
        format!("{}", read.body)
    })?;
    let second = e.put(&path, json!({"_rev": "0-1", "history": [1]})).await?.expect(201, "_local update")?;
    check(second.rev()? == "0-2", || format!("{}", second.body))?;
    // CouchDB 3 does not check local revisions (issue 22 item 2c.7): a stale one is written.
    e.put(&path, json!({"_rev": "0-1"})).await?.expect(201, "_local stale")?;
    let changes = e.get(&format!("/{DB}/_changes")).await?.expect(200, "_changes")?;
    check(changes.body["results"] == json!([]), || "local documents are not in the feed".into())?;
    e.delete(&format!("{path}?rev=0-2")).await?.expect(200, "_local delete")?;
    e.get(&path).await?.expect(404, "deleted local")?;
    Ok(())
}

/// `_local` documents as CouchDB 3.4.3 keeps them (issue 22 item 2c.7): no revision check on
/// write or delete (a replicator's checkpoint write with a stale `_rev` succeeds), DELETE of a
/// missing one 404, `GET /{db}/_local/` 404.
pub(super) async fn local_documents_unchecked(e: Endpoint) -> TestResult {
    let path = format!("/{DB}/_local/checkpoint-unchecked");
    e.put(&path, json!({"history": []})).await?.expect(201, "first write")?;
    e.put(&path, json!({"history": [1]})).await?.expect(201, "write without _rev over an existing one")?;
    e.put(&path, json!({"_rev": "0-1", "history": [2]})).await?.expect(201, "write with a stale _rev")?;
    let read = e.get(&path).await?.expect(200, "read")?;
    check(read.body["history"] == json!([2]), || format!("the last write wins: {}", read.body))?;
    e.delete(&path).await?.expect(200, "DELETE without rev")?;
    same_error(&e.get(&path).await?, "020-doc-get-missing")?;
    same_error(&e.delete(&path).await?, "020-doc-get-missing")?;
    same_error(&e.delete(&format!("{path}?rev=0-1")).await?, "020-doc-get-missing")?;
    e.put(&path, json!({"x": 1})).await?.expect(201, "re-create")?;
    e.delete(&format!("{path}?rev=0-7")).await?.expect(200, "DELETE with a stale rev")?;
    same_error(&e.get(&format!("/{DB}/_local/")).await?, "020-doc-get-missing")
}

/// A deletion that carries fields keeps them in its tombstone, as CouchDB 3.4.3 does: `?rev=`,
/// `open_revs`, `_bulk_get` and `_changes?include_docs` answer them, and a `_selector` filter
/// matches them. By `PUT` with `_deleted` and by `_bulk_docs` alike; a plain `DELETE` keeps none.
pub(super) async fn deletion_fields(e: Endpoint) -> TestResult {
    let id = "user_123:default:Z29uZQ==";
    let path = format!("/{DB}/{id}");
    let doc = json!({"_id": id, "userId": "user_123", "namespace": "default", "key": "gone", "value": 1});
    let rev1 = e.put(&path, doc.clone()).await?.expect(201, "PUT create")?.rev()?;
    let mut deletion = doc.clone();
    deletion["_rev"] = json!(rev1);
    deletion["_deleted"] = json!(true);
    deletion["value"] = json!({"last": 1.5, "text": "é"});
    deletion["reason"] = json!("archived");
    let rev2 = e.put(&path, deletion).await?.expect(200, "PUT with _deleted and fields")?.rev()?;
    check(rev2.starts_with("2-"), || format!("the deletion's revision {rev2}"))?;
    e.get(&path).await?.expect(404, "GET of the deleted document")?;
    let kept = |doc: &Value, what: &str| {
        check(
            doc["_deleted"] == true
                && doc["_rev"] == rev2.as_str()
                && doc["reason"] == "archived"
                && doc["value"] == json!({"last": 1.5, "text": "é"}),
            || format!("{what}: {doc}"),
        )
    };
    let by_rev = e.get(&format!("{path}?rev={rev2}")).await?.expect(200, "GET ?rev= of the tombstone")?;
    kept(&by_rev.body, "GET ?rev=")?;
    let open = e.get(&format!("{path}?open_revs=all")).await?.expect(200, "open_revs=all")?;
    kept(&open.body[0]["ok"], "open_revs=all")?;
    let bulk = e.post(&format!("/{DB}/_bulk_get"), json!({"docs": [{"id": id}]})).await?.expect(200, "_bulk_get")?;
    kept(&bulk.body["results"][0]["docs"][0]["ok"], "_bulk_get")?;
    let feed = e.get(&format!("/{DB}/_changes?include_docs=true")).await?.expect(200, "_changes")?;
    let row = feed.body["results"].as_array().and_then(|rows| rows.iter().find(|r| r["id"] == id)).cloned();
    kept(&row.unwrap_or_default()["doc"], "_changes?include_docs")?;
    let selected = e
        .post(&format!("/{DB}/_changes?filter=_selector"), json!({"selector": {"reason": "archived"}}))
        .await?
        .expect(200, "_changes filtered by the deletion's field")?;
    check(selected.body["results"].as_array().is_some_and(|rows| rows.len() == 1 && rows[0]["id"] == id), || {
        format!("the _selector filter matches the tombstone's fields: {}", selected.body)
    })?;

    // By `_bulk_docs`, and a plain DELETE beside it.
    let other = "user_123:default:YnVsaw==";
    let body = json!({"_id": other, "userId": "user_123", "namespace": "default", "key": "bulk", "value": 2});
    let rev = e.put(&format!("/{DB}/{other}"), body.clone()).await?.expect(201, "PUT bulk")?.rev()?;
    let mut bulk_deletion = body;
    bulk_deletion["_rev"] = json!(rev);
    bulk_deletion["_deleted"] = json!(true);
    bulk_deletion["reason"] = json!("bulk");
    let written =
        e.post(&format!("/{DB}/_bulk_docs"), json!({"docs": [bulk_deletion]})).await?.expect(201, "_bulk_docs")?;
    let bulk_rev = written.body[0]["rev"].as_str().unwrap_or_default().to_owned();
    let tombstone = e.get(&format!("/{DB}/{other}?rev={bulk_rev}")).await?.expect(200, "GET ?rev= after _bulk_docs")?;
    check(tombstone.body["reason"] == "bulk" && tombstone.body["_deleted"] == true, || {
        format!("_bulk_docs deletion: {}", tombstone.body)
    })?;
    let plain = "user_123:default:cGxhaW4=";
    let body = json!({"_id": plain, "userId": "user_123", "namespace": "default", "key": "plain", "value": 3});
    let rev = e.put(&format!("/{DB}/{plain}"), body).await?.expect(201, "PUT plain")?.rev()?;
    let gone = e.delete(&format!("/{DB}/{plain}?rev={rev}")).await?.expect(200, "DELETE")?.rev()?;
    let tombstone = e.get(&format!("/{DB}/{plain}?rev={gone}")).await?.expect(200, "GET ?rev= of a plain delete")?;
    check(tombstone.body == json!({"_id": plain, "_rev": gone, "_deleted": true}), || {
        format!("a plain delete's tombstone: {}", tombstone.body)
    })
}
