//! Documents: puts that create, update and conflict; gets of missing and deleted documents; batch
//! reads through `_all_docs` with keys (at most 200 keys a request); a delete with a stale
//! revision conflicting while the document exists.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn puts_create_update_and_conflict() {
    let server = MockServer::start().await;
    let backend = open_backend(&server).await;
    // 017: the look before the update naming a revision this backend never saw live.
    transcript(17).mount(&server).await;
    // 013 and 014 sent the same body: the first PUT created the document, the second conflicted.
    let create = transcript(13);
    create.mock_with_body().respond_with(create.response()).up_to_n_times(1).mount(&server).await;
    for number in [14, 15, 19] {
        let t = transcript(number);
        t.mock_with_body().respond_with(t.response()).named(t.file.clone()).mount(&server).await;
    }
    // 013: create.
    let rev = backend.put(GREETING_ID, &write_body(&transcript(13)), Precondition::MustNotExist).await.unwrap();
    assert_eq!(rev, Revision(GREETING_REV_1.into()));
    // 014: create again without a _rev → 409.
    let err = backend.put(GREETING_ID, &write_body(&transcript(14)), Precondition::MustNotExist).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    // 015: update with a stale _rev → 409.
    let stale = Precondition::MatchRevision(Revision("1-00000000000000000000000000000000".into()));
    let err = backend.put(GREETING_ID, &write_body(&transcript(15)), stale).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    // 019: update with the current _rev.
    let current = Precondition::MatchRevision(Revision(GREETING_REV_1.into()));
    let rev = backend.put(GREETING_ID, &write_body(&transcript(19)), current).await.unwrap();
    assert_eq!(rev, Revision(GREETING_REV_2.into()));

    let requests = received(&server).await;
    let puts: Vec<Value> = requests.iter().filter(|r| r.method.as_str() == "PUT").map(json_body).collect();
    assert_eq!(puts.len(), 4, "conflicts are not retried by the adapter");
    assert!(puts[1].get("_rev").is_none(), "a create sends no _rev: {}", puts[1]);
    assert_eq!(puts[2]["_rev"], json!("1-00000000000000000000000000000000"));
    for request in requests.iter().filter(|r| r.method.as_str() == "PUT") {
        assert!(request.url.path().contains("%3A") && request.url.path().contains("%3D"), "{}", request.url);
    }
    assert_all_authorized(&requests);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_returns_the_document_or_none_when_missing_or_deleted() {
    let server = MockServer::start().await;
    let backend = open_backend(&server).await;
    transcript(16).mount(&server).await;
    transcript(20).mount(&server).await;
    let doc = backend.get(GREETING_ID).await.unwrap().expect("016: the document");
    assert_eq!(doc.id, GREETING_ID);
    assert_eq!(doc.rev, Revision(GREETING_REV_1.into()));
    assert_eq!(Value::Object(doc.body), without(&without(&transcript(16).response_body, "_id"), "_rev"));
    assert!(backend.get("user_123:default:bm9wZQ==").await.unwrap().is_none(), "020: missing");
    assert_all_authorized(&received(&server).await);

    let server = MockServer::start().await;
    let backend = open_backend(&server).await;
    transcript(23).mount(&server).await;
    assert!(backend.get(GREETING_ID).await.unwrap().is_none(), "023: deleted");
    let requests = received(&server).await;
    assert_eq!(count(&requests, "GET", &format!("/{DB}/{GREETING_ID}")), 1, "a 404 is not retried");
    assert_all_authorized(&requests);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_many_reads_all_docs_with_keys() {
    let server = MockServer::start().await;
    let backend = open_backend(&server).await;
    let recorded = transcript(47);
    let keys = keys_of_request(&recorded);
    recorded.mock_with_body().respond_with(recorded.response()).named(recorded.file.clone()).mount(&server).await;
    let answers = backend.get_many(&keys).await.expect("047: one _all_docs request");
    let doc = answers[0].as_ref().expect("047: the first key's document");
    let row = &recorded.response_body["rows"][0]["doc"];
    assert_eq!(doc.id, keys[0]);
    assert_eq!(doc.rev.as_str(), row["_rev"].as_str().unwrap());
    assert_eq!(Value::Object(doc.body.clone()), without(&without(row, "_id"), "_rev"));
    assert!(answers[1].is_none(), "047: not_found");
    assert_all_authorized(&received(&server).await);
}

fn keys_of_request(t: &Transcript) -> Vec<String> {
    t.request_body["keys"].as_array().unwrap().iter().map(|k| k.as_str().unwrap().to_owned()).collect()
}

/// Answers `POST /{db}/_all_docs` as CouchDB does for `keys`: ids ending in 0 were never written,
/// ids ending in 1 are deleted, the rest are documents.
struct AllDocsByKeys;

impl wiremock::Respond for AllDocsByKeys {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let rows: Vec<Value> = json_body(request)["keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|key| {
                let id = key.as_str().unwrap();
                match id.chars().last() {
                    Some('0') => json!({"key": id, "error": "not_found"}),
                    Some('1') => json!({"id": id, "key": id, "value": {"rev": "2-ab", "deleted": true}, "doc": null}),
                    _ => json!({"id": id, "key": id, "value": {"rev": "1-ab"},
                                "doc": {"_id": id, "_rev": "1-ab", "value": id}}),
                }
            })
            .collect();
        ResponseTemplate::new(200).set_body_json(json!({"total_rows": rows.len(), "offset": null, "rows": rows}))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_many_asks_for_at_most_200_keys_a_request() {
    let server = MockServer::start().await;
    let backend = open_backend(&server).await;
    Mock::given(method("POST"))
        .and(wiremock::matchers::path(format!("/{DB}/_all_docs")))
        .and(query_param("include_docs", "true"))
        .respond_with(AllDocsByKeys)
        .mount(&server)
        .await;
    let mut ids: Vec<String> = (0..450).map(|i| format!("doc-{i:03}")).collect();
    ids.push("doc-002".into());
    let answers = backend.get_many(&ids).await.expect("get_many");
    for (id, answer) in ids.iter().zip(&answers) {
        match id.chars().last() {
            Some('0' | '1') => assert!(answer.is_none(), "{id}: missing or deleted"),
            _ => assert_eq!(answer.as_ref().map(|d| d.body["value"].clone()), Some(json!(id)), "{id}"),
        }
    }
    let requests = received(&server).await;
    let mut sizes: Vec<usize> = requests
        .iter()
        .filter(|r| is(r, "POST", &format!("/{DB}/_all_docs")))
        .map(|r| json_body(r)["keys"].as_array().unwrap().len())
        .collect();
    sizes.sort();
    assert_eq!(sizes, [50, 200, 200], "450 distinct ids in requests of at most 200");
    assert_eq!(count(&requests, "GET", &format!("/{DB}/doc-002")), 0, "no single reads");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_with_a_stale_revision_conflicts_while_the_document_exists() {
    let server = MockServer::start().await;
    let backend = open_backend(&server).await;
    transcript(17).mount(&server).await;
    transcript(21).mount(&server).await;
    transcript(22).mount(&server).await;
    transcript(16).mount(&server).await;
    // 017: the HEAD before a DELETE naming a revision not seen live finds a live document (a
    // tombstone would be NotFound).
    // 021: 409; the follow-up GET (016) shows the document is there, at another revision.
    let err = backend.delete(GREETING_ID, &Revision(GREETING_REV_1.into())).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    // 022: the current revision deletes.
    backend.delete(GREETING_ID, &Revision(GREETING_REV_2.into())).await.unwrap();

    let requests = received(&server).await;
    let doc_path = format!("/{DB}/{GREETING_ID}");
    let sequence: Vec<String> = requests
        .iter()
        .filter(|r| path_of(r) == doc_path)
        .map(|r| format!("{} {:?}", r.method, r.url.query()))
        .collect();
    assert_eq!(
        sequence,
        vec![
            "HEAD None".to_owned(),
            format!("DELETE Some(\"rev={GREETING_REV_1}\")"),
            "GET None".to_owned(),
            "HEAD None".to_owned(),
            format!("DELETE Some(\"rev={GREETING_REV_2}\")"),
        ]
    );
    assert_all_authorized(&requests);

    // 021 then 023: the 409 was a newer tombstone — the document is gone, so NotFound.
    let server = MockServer::start().await;
    let backend = open_backend(&server).await;
    transcript(17).mount(&server).await;
    transcript(21).mount(&server).await;
    transcript(23).mount(&server).await;
    let err = backend.delete(GREETING_ID, &Revision(GREETING_REV_1.into())).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    assert_all_authorized(&received(&server).await);
}
