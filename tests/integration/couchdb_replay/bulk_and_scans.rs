//! Bulk writes report each document, scans never return design documents, and a namespace's
//! index is ensured once per namespace.

use super::*;

fn bulk_writes(t: &Transcript) -> Vec<BulkWrite> {
    t.request_body["docs"]
        .as_array()
        .expect("_bulk_docs request docs")
        .iter()
        .map(|doc| {
            let mut body = doc.as_object().unwrap().clone();
            let id = body.remove("_id").and_then(|v| v.as_str().map(str::to_owned)).unwrap();
            BulkWrite { id, body, precondition: Precondition::MustNotExist }
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_docs_report_each_document() {
    let server = MockServer::start().await;
    let backend = open_backend(&server).await;
    for number in [24, 25] {
        let t = transcript(number);
        t.mock_with_body().respond_with(t.response()).named(t.file.clone()).mount(&server).await;
    }
    // 025: the first document exists already.
    let results = backend.bulk_write(bulk_writes(&transcript(25))).await.unwrap();
    assert_eq!(results.len(), 2);
    assert_eq!(results[0].as_ref().unwrap_err().kind(), ErrorKind::Conflict, "{:?}", results[0]);
    assert_eq!(results[1].as_ref().unwrap(), &Revision("1-a7f3c81ec4f5986555515eb9bb5361c0".into()));
    // 024: every document created, each with the revision CouchDB gave it, in order.
    let t = transcript(24);
    let results = backend.bulk_write(bulk_writes(&t)).await.unwrap();
    let expected: Vec<String> =
        t.response_body.as_array().unwrap().iter().map(|r| r["rev"].as_str().unwrap().to_owned()).collect();
    let got: Vec<String> = results.into_iter().map(|r| r.unwrap().0).collect();
    assert_eq!(got, expected);
    let requests = received(&server).await;
    assert_eq!(count(&requests, "POST", &format!("/{DB}/_bulk_docs")), 2);
    assert_all_authorized(&requests);
}

/// An `_all_docs?include_docs=true` row for a document.
fn all_docs_row(doc: &Value) -> Value {
    let id = doc["_id"].clone();
    json!({ "id": id, "key": id, "value": { "rev": doc["_rev"] }, "doc": doc })
}

/// A stored data document of 024, with the revision 024 recorded.
fn recorded_doc(id: &str) -> Value {
    let t = transcript(24);
    let mut doc = t.request_body["docs"].as_array().unwrap().iter().find(|d| d["_id"] == id).unwrap().clone();
    doc["_rev"] = json!(recorded_revisions()[id]);
    doc
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scan_never_returns_design_documents() {
    let server = MockServer::start().await;
    let backend = open_backend(&server).await;
    // The legacy design document of 041 as stored, and the Mango index's own design document.
    let legacy = transcript(41);
    let mut legacy_doc = legacy.request_body.clone();
    legacy_doc["_rev"] = legacy.response_body["rev"].clone();
    let index_doc = json!({
        "_id": INDEX_DDOC,
        "_rev": "1-f0b4d3bf4f2e8b5d33a5a0c56e3a3e53",
        "language": "query",
        "views": { INDEX_NAME: { "map": { "fields": { "userId": "asc", "namespace": "asc" } } } }
    });
    let cache = recorded_doc("user_123:cache:github:cmVwb3M=");
    let files = recorded_doc("user_123:files:my-repo:c3JjL21haW4ucHk=");
    let note = recorded_doc("user_123:notes:bm90ZS0wMDA=");
    // _all_docs in id order: design documents sort first. scan reads one row more than it needs
    // (to learn whether more follow), drops design documents and reads on from the last row seen
    // until the page is full; the next page starts at the page's last id.
    let all_docs = format!("/{DB}/_all_docs");
    let template = transcript(47);
    let key = |id: &str| serde_json::to_string(id).unwrap();
    let reads = [
        ("3", None, json!([all_docs_row(&index_doc), all_docs_row(&legacy_doc), all_docs_row(&cache)])),
        (
            "3",
            Some(key("user_123:cache:github:cmVwb3M=")),
            json!([all_docs_row(&cache), all_docs_row(&files), all_docs_row(&note)]),
        ),
        ("4", Some(key("user_123:files:my-repo:c3JjL21haW4ucHk=")), json!([all_docs_row(&files), all_docs_row(&note)])),
    ];
    for (limit, startkey, rows) in reads {
        let mock = Mock::given(method("GET"))
            .and(DecodedPath::new(&all_docs))
            .and(query_param("include_docs", "true"))
            .and(query_param("limit", limit));
        let mock = match &startkey {
            Some(startkey) => mock.and(query_param("startkey", startkey.as_str())),
            None => mock.and(query_param_is_missing("startkey")),
        };
        let body = json!({ "total_rows": 5, "offset": 0, "rows": rows });
        mock.respond_with(template.response_with_body(&body)).expect(1).mount(&server).await;
    }

    let first = backend.scan(2, None).await.unwrap();
    let ids: Vec<&str> = first.items.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, vec!["user_123:cache:github:cmVwb3M=", "user_123:files:my-repo:c3JjL21haW4ucHk="]);
    assert_eq!(first.next.as_deref(), Some("user_123:files:my-repo:c3JjL21haW4ucHk="));
    let second = backend.scan(2, first.next.as_deref()).await.unwrap();
    let ids: Vec<&str> = second.items.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, vec!["user_123:notes:bm90ZS0wMDA="]);
    assert_eq!(second.next, None);
    for doc in first.items.iter().chain(&second.items) {
        assert!(!doc.id.starts_with("_design/"), "{}", doc.id);
        assert!(!doc.body.contains_key("views") && !doc.body.contains_key("language"), "{:?}", doc.body);
    }
    assert_eq!(first.items[1].body["value"], files["value"]);

    // One page holding everything, the legacy design document in the middle of it.
    let server = MockServer::start().await;
    let backend = open_backend(&server).await;
    let everything = json!({ "total_rows": 3, "offset": 0, "rows": [all_docs_row(&legacy_doc), all_docs_row(&note)] });
    Mock::given(method("GET"))
        .and(DecodedPath::new(&all_docs))
        .and(query_param("include_docs", "true"))
        .respond_with(template.response_with_body(&everything))
        .mount(&server)
        .await;
    let page = backend.scan(100, None).await.unwrap();
    let ids: Vec<&str> = page.items.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, vec!["user_123:notes:bm90ZS0wMDA="]);
    assert_eq!(page.next, None);
    assert_all_authorized(&received(&server).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespace_index_is_ensured_once_per_namespace() {
    let server = MockServer::start().await;
    transcript(5).mount(&server).await;
    // Every POST /_index answers 011 ("exists"), slowly enough that all first writes overlap it.
    let exists = transcript(11);
    exists
        .mock_with_body()
        .respond_with(exists.response().set_delay(Duration::from_millis(150)))
        .named(exists.file.clone())
        .mount(&server)
        .await;
    let missing = transcript(20);
    Mock::given(method("GET")).and(AnyDocumentPath).respond_with(missing.response()).mount(&server).await;
    let created = transcript(13);
    Mock::given(method("PUT")).and(AnyDocumentPath).respond_with(created.response()).mount(&server).await;

    let backend = Arc::new(CouchDbBackend::open(&config(&server)).await.unwrap());
    let store = DataStore::open(backend as Arc<dyn DocumentBackend>, StoreOptions::default()).await.unwrap();
    let index_path = format!("/{DB}/_index");
    assert_eq!(count(&received(&server).await, "POST", &index_path), 1, "startup");

    let keys: Vec<String> = (0..8).map(|i| format!("k{i}")).collect();
    let writes =
        keys.iter().enumerate().map(|(i, key)| store.set("user_123", "notes", key, json!(i), None, Some("agent")));
    for result in futures::future::join_all(writes).await {
        result.unwrap();
    }
    let requests = received(&server).await;
    assert_eq!(count(&requests, "POST", &index_path), 2, "8 concurrent first writes to one namespace");
    assert_eq!(requests.iter().filter(|r| r.method.as_str() == "PUT").count(), 8);

    let writes = keys.iter().enumerate().map(|(i, key)| store.set("user_123", "other", key, json!(i), None, None));
    for result in futures::future::join_all(writes).await {
        result.unwrap();
    }
    store.set("user_123", "notes", "again", json!(1), None, None).await.unwrap();
    let requests = received(&server).await;
    assert_eq!(count(&requests, "POST", &index_path), 3, "one more for the second namespace, none for the first");
    assert_eq!(requests.iter().filter(|r| r.method.as_str() == "PUT").count(), 17);
    assert_all_authorized(&requests);
}
