//! The document model: revisions, tombstones, the change feed, erasure.
//!
//! Where no transcript was recorded (a tombstone read by revision, `_all_docs` with the key of a
//! deleted document, a filtered `_changes`, `_purge`), the answers below are written by hand in
//! the shape CouchDB 3.4.3 documents for them, with the revisions and sequence values of the
//! recorded transcripts; each one says so.

use super::*;

/// The tombstone 022 left (`DELETE` of revision 2).
const GREETING_TOMBSTONE: &str = "3-3de33e0cc73cba641394fa42b596d7d9";

/// The hash part of a revision (what `_revisions.ids` holds).
fn hash_of(rev: &str) -> &str {
    rev.split_once('-').map_or(rev, |(_, hash)| hash)
}

fn json_response(status: u16, body: Value) -> ResponseTemplate {
    ResponseTemplate::new(status).set_body_raw(serde_json::to_vec(&body).expect("serialise"), "application/json")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revisions_of_a_deleted_document_are_read_from_its_tombstone() {
    let server = MockServer::start().await;
    transcript(5).mount(&server).await;
    let url = backend_url(&server, Some("admin:password"), DB, "?revs_limit=2");
    let backend = CouchDbBackend::open(&CouchConfig::parse(&url).unwrap()).await.unwrap();
    // 023: CouchDB answers 404 `deleted` for the document itself, with `revs=true` as without.
    let deleted = transcript(23);
    deleted
        .mock()
        .and(query_param("revs", "true"))
        .and(query_param_is_missing("rev"))
        .respond_with(deleted.response())
        .mount(&server)
        .await;
    // Written by hand: `_all_docs` with `keys` lists a deleted id with its tombstone revision.
    Mock::given(method("POST"))
        .and(DecodedPath::new(&format!("/{DB}/_all_docs")))
        .and(wiremock::matchers::body_json(json!({ "keys": [GREETING_ID] })))
        .respond_with(json_response(
            200,
            json!({"total_rows": 43, "offset": null, "rows": [
                {"id": GREETING_ID, "key": GREETING_ID, "value": {"rev": GREETING_TOMBSTONE, "deleted": true}}
            ]}),
        ))
        .mount(&server)
        .await;
    // Written by hand: the tombstone read by its revision, with its `_revisions` (013, 019, 022).
    Mock::given(method("GET"))
        .and(DecodedPath::new(&format!("/{DB}/{GREETING_ID}")))
        .and(query_param("rev", GREETING_TOMBSTONE))
        .and(query_param("revs", "true"))
        .respond_with(json_response(
            200,
            json!({"_id": GREETING_ID, "_rev": GREETING_TOMBSTONE, "_deleted": true, "_revisions": {
                "start": 3,
                "ids": [hash_of(GREETING_TOMBSTONE), hash_of(GREETING_REV_2), hash_of(GREETING_REV_1)]
            }}),
        ))
        .mount(&server)
        .await;

    let info = backend.revisions(GREETING_ID).await.unwrap().expect("the tombstone is known");
    assert_eq!(info.rev, Revision(GREETING_TOMBSTONE.into()));
    assert!(info.deleted);
    // Cut to the URL's revs_limit=2, newest first.
    let ancestry: Vec<String> = info.ancestry.revisions().map(|r| r.0).collect();
    assert_eq!(ancestry, [GREETING_TOMBSTONE, GREETING_REV_2]);
    assert_all_authorized(&received(&server).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revisions_of_an_unknown_id_are_none() {
    let server = MockServer::start().await;
    let backend = open_backend(&server).await;
    let missing = transcript(20);
    missing.mock().and(query_param("revs", "true")).respond_with(missing.response()).mount(&server).await;
    // 047's row for an id never written: `error: not_found`.
    let listed = transcript(47);
    Mock::given(method("POST"))
        .and(DecodedPath::new(&format!("/{DB}/_all_docs")))
        .respond_with(json_response(
            200,
            json!({"total_rows": 43, "offset": null, "rows": [listed.response_body["rows"][1]]}),
        ))
        .mount(&server)
        .await;
    assert_eq!(backend.revisions("user_123:default:bm9wZQ==").await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_tombstone_is_not_found_and_sends_no_delete() {
    let server = MockServer::start().await;
    let backend = open_backend(&server).await;
    // A HEAD of a deleted document: 023's status and headers, no body.
    let deleted = transcript(23);
    Mock::given(method("HEAD"))
        .and(DecodedPath::new(&deleted.path))
        .respond_with(ResponseTemplate::new(deleted.status).insert_header("content-type", "application/json"))
        .mount(&server)
        .await;
    let err = backend.delete(GREETING_ID, &Revision(GREETING_TOMBSTONE.into())).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    let requests = received(&server).await;
    assert_eq!(requests.iter().filter(|r| r.method.as_str() == "DELETE").count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_update_naming_a_tombstone_conflicts_instead_of_reviving_it() {
    let server = MockServer::start().await;
    let backend = open_backend(&server).await;
    // A HEAD of the deleted document: 023's status, no body. CouchDB would accept a PUT naming
    // the tombstone's revision and bring the document back; none may be sent.
    let deleted = transcript(23);
    Mock::given(method("HEAD"))
        .and(DecodedPath::new(&deleted.path))
        .respond_with(ResponseTemplate::new(deleted.status).insert_header("content-type", "application/json"))
        .mount(&server)
        .await;
    let body = write_body(&transcript(19));
    let err = backend
        .put(GREETING_ID, &body, Precondition::MatchRevision(Revision(GREETING_TOMBSTONE.into())))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    assert_eq!(received(&server).await.iter().filter(|r| r.method.as_str() == "PUT").count(), 0);
}

/// A deletion keeping fields is a `PUT` carrying `_deleted: true`, which CouchDB 3.4.3 answers
/// `200` with the tombstone's revision (no transcript: the status and body as a real CouchDB
/// 3.4.3 answered it to curl; pouchdb-server answers 201). It used to be taken for a failure
/// (500), and a tombstone's revision is never remembered as live: an update naming it looks
/// first (`HEAD`: 404) and conflicts instead of reviving the document.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deletion_keeping_fields_is_answered_200_and_its_revision_is_not_live() {
    let server = MockServer::start().await;
    let backend = open_backend(&server).await;
    let tombstone = "3-6e1627c58535c19af7eda31cb0af3e53";
    Mock::given(method("PUT"))
        .and(DecodedPath::new(&format!("/{DB}/{GREETING_ID}")))
        .and(body_partial_json(json!({"_rev": GREETING_REV_2, "_deleted": true})))
        .respond_with(json_response(200, json!({"ok": true, "id": GREETING_ID, "rev": tombstone})))
        .mount(&server)
        .await;
    // The document is live when the deletion looks, deleted (023's 404) afterwards.
    let deleted = transcript(23);
    Mock::given(method("HEAD"))
        .and(DecodedPath::new(&deleted.path))
        .respond_with(ResponseTemplate::new(200).insert_header("content-type", "application/json"))
        .up_to_n_times(1)
        .with_priority(1)
        .mount(&server)
        .await;
    Mock::given(method("HEAD"))
        .and(DecodedPath::new(&deleted.path))
        .respond_with(ResponseTemplate::new(deleted.status).insert_header("content-type", "application/json"))
        .mount(&server)
        .await;
    let mut deletion = write_body(&transcript(19));
    deletion.insert("_deleted".into(), Value::Bool(true));
    deletion.insert("reason".into(), json!("archived"));
    let known = Precondition::MatchRevision(Revision(GREETING_REV_2.into()));
    let written = backend.put(GREETING_ID, &deletion, known).await.expect("a deletion CouchDB answered 200");
    assert_eq!(written.as_str(), tombstone);
    let body = write_body(&transcript(19));
    let err =
        backend.put(GREETING_ID, &body, Precondition::MatchRevision(Revision(tombstone.into()))).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    let requests = received(&server).await;
    assert_eq!(requests.iter().filter(|r| r.method.as_str() == "PUT").count(), 1, "the tombstone was not revived");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn facade_updates_and_deletes_need_no_look_for_tombstones() {
    let server = MockServer::start().await;
    let (_backend, store) = open_store(&server, StoreOptions::default()).await;
    transcript(16).mount(&server).await;
    transcript(19).mount(&server).await;
    // The facade writes with the revision its GET just returned, which is known live: no HEAD
    // of the document (the index's design document is looked up before a namespace's first
    // write).
    store.set("user_123", "default", "greeting", json!("hi"), None, None).await.unwrap();
    let requests = received(&server).await;
    let document_heads = requests.iter().filter(|r| r.method.as_str() == "HEAD" && !path_of(r).contains("/_design/"));
    assert_eq!(document_heads.count(), 0);
    assert_eq!(requests.iter().filter(|r| r.method.as_str() == "PUT").count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_leave_out_design_documents_refill_the_page_and_keep_opaque_seqs() {
    let server = MockServer::start().await;
    let backend = open_backend(&server).await;
    // 049: five rows from the start, one of them the index's design document.
    let first = transcript(49);
    first.mount(&server).await;
    let recorded = first.response_body["results"].as_array().unwrap().clone();
    let recorded_last_seq = first.response_body["last_seq"].as_str().unwrap().to_owned();
    // Written by hand: the one row that refills the page, read from 049's last_seq.
    let refill_seq = "8-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zEhnwKMpjAZIMDUDqP0htBnMiSy5QgD3F";
    let refill_id = "user_123:notes:bm90ZS0wMDQ=";
    Mock::given(method("GET"))
        .and(DecodedPath::new(&format!("/{DB}/_changes")))
        .and(query_param("since", recorded_last_seq.as_str()))
        .and(query_param("limit", "1"))
        .respond_with(json_response(
            200,
            json!({"results": [{"seq": refill_seq, "id": refill_id, "changes": [{"rev": "1-0d4e1fbd1f4e2a6e0e3c0b1a2f3e4d5c"}]}],
                   "last_seq": refill_seq, "pending": 38}),
        ))
        .mount(&server)
        .await;

    let page = backend.changes(None, 5).await.unwrap();
    let mut expected: Vec<(String, String, bool)> = recorded
        .iter()
        .filter(|row| !row["id"].as_str().unwrap().starts_with("_design/"))
        .map(|row| {
            (row["seq"].as_str().unwrap().to_owned(), row["id"].as_str().unwrap().to_owned(), row["deleted"] == true)
        })
        .collect();
    expected.push((refill_seq.to_owned(), refill_id.to_owned(), false));
    let got: Vec<(String, String, bool)> =
        page.changes.iter().map(|c| (c.seq.clone(), c.id.clone(), c.deleted)).collect();
    assert_eq!(got, expected);
    let tombstone = page.changes.iter().find(|c| c.id == GREETING_ID).expect("the tombstone is in the feed");
    assert_eq!(tombstone.rev, Revision(GREETING_TOMBSTONE.into()));
    assert_eq!(page.last_seq, refill_seq);
    assert_eq!(page.pending, Some(38));
    // The opaque seq went back exactly as CouchDB gave it, unquoted.
    let sinces: Vec<String> = received(&server)
        .await
        .iter()
        .filter(|r| path_of(r) == format!("/{DB}/_changes"))
        .map(|r| r.url.query_pairs().find(|(k, _)| k == "since").map(|(_, v)| v.into_owned()).unwrap_or_default())
        .collect();
    assert_eq!(sinces, ["0".to_owned(), recorded_last_seq]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn change_position_is_the_databases_update_seq() {
    let server = MockServer::start().await;
    // 005 opens the backend; 051 (the same request later) answers the position.
    let backend = open_backend(&server).await;
    server.reset().await;
    transcript(51).mount(&server).await;
    let expected = transcript(51).response_body["update_seq"].as_str().unwrap().to_owned();
    assert_eq!(backend.change_position().await.unwrap(), expected);
}

/// The live document of the erasure test: two leaves after a replication conflict.
const CONFLICTED_ID: &str = "user_123:files:my-repo:c3JjL21haW4ucHk=";
const CONFLICT_LEAVES: [&str; 2] = ["2-6c1f3bd55d2e0a6b1bfbd1b0e4bc1c3e", "2-9a4f5e0c8d7b6a5f4e3d2c1b0a9f8e7d"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn erasure_purges_every_leaf_of_live_documents_and_tombstones() {
    let server = MockServer::start().await;
    let backend = open_backend(&server).await;
    let purge_path = format!("/{DB}/_purge");
    let changes_path = format!("/{DB}/_changes");
    // Written by hand (CouchDB's documented `_purge` answer): an empty purge succeeds.
    Mock::given(method("POST"))
        .and(DecodedPath::new(&purge_path))
        .and(wiremock::matchers::body_json(json!({})))
        .respond_with(json_response(201, json!({"purge_seq": null, "purged": {}})))
        .mount(&server)
        .await;
    // Written by hand: the filtered feed lists the prefix's live document with both leaves and
    // 022's tombstone, then nothing after its end.
    let selector = json!({"selector": {"_id": {"$regex": "^user\\_123\\:"}}});
    let end_seq = "46-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVB4LkGRoAFL_gSArgzlRIhcowJ5iamlpnpaKTR8e0xIZkuqhxoiBjUlKNDNNMzbBpiELAATcKLw";
    let feed = |since: &str, results: Value| {
        Mock::given(method("POST"))
            .and(DecodedPath::new(&changes_path))
            .and(query_param("filter", "_selector"))
            .and(query_param("style", "all_docs"))
            .and(query_param("since", since))
            .and(wiremock::matchers::body_json(selector.clone()))
            .respond_with(json_response(200, json!({"results": results, "last_seq": end_seq, "pending": 0})))
    };
    feed(
        "0",
        json!([
            {"seq": "4-g1AAAAB5", "id": GREETING_ID, "changes": [{"rev": GREETING_TOMBSTONE}], "deleted": true},
            {"seq": "5-g1AAAAB5", "id": CONFLICTED_ID, "changes": [{"rev": CONFLICT_LEAVES[0]}, {"rev": CONFLICT_LEAVES[1]}]}
        ]),
    )
    .mount(&server)
    .await;
    feed(end_seq, json!([])).mount(&server).await;
    let every_leaf = json!({ GREETING_ID: [GREETING_TOMBSTONE], CONFLICTED_ID: CONFLICT_LEAVES });
    Mock::given(method("POST"))
        .and(DecodedPath::new(&purge_path))
        .and(wiremock::matchers::body_json(every_leaf.clone()))
        .respond_with(json_response(201, json!({"purge_seq": null, "purged": every_leaf})))
        .expect(1)
        .mount(&server)
        .await;

    assert_eq!(backend.erase_prefix("user_123:").await.unwrap(), 2);
    let requests = received(&server).await;
    // The support check, one purge of everything found, and two feed reads (the second pass
    // starts at the first one's end and finds nothing).
    assert_eq!(count(&requests, "POST", &purge_path), 2);
    assert_eq!(count(&requests, "POST", &changes_path), 2);
    assert_all_authorized(&requests);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn erasure_on_a_server_without_purge_fails_before_writing() {
    let server = MockServer::start().await;
    let backend = open_backend(&server).await;
    // pouchdb-server 4.2.0's answer to `POST /db/_purge` (seen on the local test server).
    Mock::given(method("POST"))
        .and(DecodedPath::new(&format!("/{DB}/_purge")))
        .respond_with(json_response(400, json!({"error": "bad_request", "reason": "only_multipart_accepted"})))
        .mount(&server)
        .await;
    // The unfiltered feed (049, from the start) shows documents under the prefix.
    let feed = transcript(49);
    Mock::given(method("GET"))
        .and(DecodedPath::new(&feed.path))
        .respond_with(json_response(
            200,
            json!({"results": feed.response_body["results"], "last_seq": feed.response_body["last_seq"]}),
        ))
        .mount(&server)
        .await;
    assert_eq!(backend.erase_prefix("user_999:").await.unwrap(), 0, "nothing under the prefix: nothing to refuse");
    let err = backend.erase_prefix("user_123:").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");
    assert!(err.to_string().contains("cannot purge") && err.to_string().contains("Nothing was erased"), "{err}");
    let requests = received(&server).await;
    assert_eq!(count(&requests, "POST", &format!("/{DB}/_changes")), 0, "no filtered feed is read");
}

/// A local document row of `_local_docs?include_docs=true` as CouchDB 3.x documents it
/// (`couch_mrview.erl`: id and key the whole id, `value.rev` the `0-N` revision), written by hand:
/// no transcript of `_local_docs` was recorded.
fn local_row(name: &str, n: u64) -> Value {
    let id = format!("_local/{name}");
    json!({ "id": id, "key": id, "value": { "rev": "0-1" }, "doc": { "_id": id, "_rev": "0-1", "n": n } })
}

/// `local_docs` reads CouchDB's `_local_docs` (pouchdb-server, the contract suite's CouchDB, has
/// none): the names' range as `_local/` ids closed at the prefix's ends, one row beyond the page,
/// and the next page from the last id, whose row is dropped; a server without the listing is a
/// refusal naming it, never an empty page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_documents_are_listed_from_local_docs_in_pages() {
    let server = MockServer::start().await;
    let backend = open_backend(&server).await;
    let path = format!("/{DB}/_local_docs");
    let answer = |rows: Vec<Value>| json_response(200, json!({ "total_rows": null, "offset": null, "rows": rows }));
    Mock::given(method("GET"))
        .and(wiremock::matchers::path(path.as_str()))
        .and(query_param("include_docs", "true"))
        .and(query_param("limit", "3"))
        .and(query_param("startkey", "\"_local/\""))
        .and(query_param("endkey", "\"_local0\""))
        .and(query_param("inclusive_end", "false"))
        .and(query_param_is_missing("descending"))
        .respond_with(answer(vec![local_row("a", 1), local_row("b", 2), local_row("c", 3)]))
        .mount(&server)
        .await;
    Mock::given(method("GET"))
        .and(wiremock::matchers::path(path.as_str()))
        .and(query_param("limit", "4"))
        .and(query_param("startkey", "\"_local/b\""))
        .respond_with(answer(vec![local_row("b", 2), local_row("c", 3)]))
        .mount(&server)
        .await;
    let first = backend.local_docs(&agentstore::backend::IdRange::all(), 2, None).await.expect("first page");
    let ids: Vec<&str> = first.items.iter().map(|doc| doc.id.as_str()).collect();
    assert_eq!(ids, ["_local/a", "_local/b"]);
    assert_eq!((first.items[1].rev.as_str(), &first.items[1].body["n"]), ("0-1", &json!(2)));
    assert_eq!(first.next.as_deref(), Some("_local/b"));
    let second = backend.local_docs(&agentstore::backend::IdRange::all(), 2, first.next.as_deref()).await;
    let second = second.expect("second page");
    assert_eq!(second.items.iter().map(|doc| doc.id.as_str()).collect::<Vec<_>>(), ["_local/c"]);
    assert_eq!(second.next, None);

    // CouchDB 1.x (and pouchdb-server) read `_local_docs` as a missing document.
    let old = MockServer::start().await;
    let backend = open_backend(&old).await;
    Mock::given(method("GET"))
        .and(wiremock::matchers::path(path.as_str()))
        .respond_with(json_response(404, json!({ "error": "not_found", "reason": "missing" })))
        .mount(&old)
        .await;
    let refused = backend.local_docs(&agentstore::backend::IdRange::all(), 2, None).await.expect_err("no listing");
    assert_eq!(refused.kind(), ErrorKind::Misconfigured, "{refused}");
    assert!(refused.to_string().contains("_local_docs"), "{refused}");
}
