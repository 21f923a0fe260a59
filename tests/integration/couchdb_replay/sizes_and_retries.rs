//! Too large documents are `TooLarge`, and server errors retry reads but never writes.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_large_documents_are_too_large() {
    let server = MockServer::start().await;
    let backend = open_backend(&server).await;
    let t = transcript(52);
    // The recording omits the 9 MiB value; match everything else and send a small stand-in.
    t.mock_with_partial_body(without(&t.request_body, "value")).respond_with(t.response()).mount(&server).await;
    let mut body = write_body(&t);
    body.insert("value".into(), json!("x"));
    let err = backend.put("user_123:big:dG9vLWJpZw==", &body, Precondition::MustNotExist).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TooLarge, "{err}");
    assert!(err.to_string().contains("document_too_large"), "{err}");
    let requests = received(&server).await;
    assert_eq!(requests.iter().filter(|r| r.method.as_str() == "PUT").count(), 1);
    assert_all_authorized(&requests);
}

fn unavailable() -> ResponseTemplate {
    ResponseTemplate::new(503)
        .set_body_raw(r#"{"error":"service_unavailable","reason":"try again"}"#, "application/json")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_retry_reads_but_never_writes() {
    let server = MockServer::start().await;
    let backend = open_backend(&server).await;
    let doc_path = format!("/{DB}/{GREETING_ID}");
    let find_path = format!("/{DB}/_find");

    // get: one 503, then 016.
    Mock::given(method("GET"))
        .and(DecodedPath::new(&doc_path))
        .respond_with(unavailable())
        .up_to_n_times(1)
        .with_priority(1)
        .mount(&server)
        .await;
    transcript(16).mount(&server).await;
    let doc = backend.get(GREETING_ID).await.expect("retried after the 503").expect("016");
    assert_eq!(doc.rev, Revision(GREETING_REV_1.into()));
    assert_eq!(count(&received(&server).await, "GET", &doc_path), 2);

    // query: one 503, then 029.
    Mock::given(method("POST"))
        .and(DecodedPath::new(&find_path))
        .respond_with(unavailable())
        .up_to_n_times(1)
        .with_priority(1)
        .mount(&server)
        .await;
    let last = transcript(29);
    last.mock()
        .respond_with(last.response_with_body(&with_ids_and_revs(&last.response_body, "user_123", "notes")))
        .mount(&server)
        .await;
    let page = backend.query(&notes_query(), 12, None).await.expect("retried after the 503");
    assert_eq!(page.items.len(), 7);
    assert_eq!(count(&received(&server).await, "POST", &find_path), 2);

    // put: a 503 is Unavailable at once; the write may have been applied, so it is not repeated.
    Mock::given(method("PUT")).and(DecodedPath::new(&doc_path)).respond_with(unavailable()).mount(&server).await;
    let err = backend.put(GREETING_ID, &write_body(&transcript(13)), Precondition::MustNotExist).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert_eq!(count(&received(&server).await, "PUT", &doc_path), 1);

    // A read that stays unavailable gives up with Unavailable after a few tries.
    let gone = format!("/{DB}/user_123:default:Z29uZQ==");
    Mock::given(method("GET")).and(DecodedPath::new(&gone)).respond_with(unavailable()).mount(&server).await;
    let err = backend.get("user_123:default:Z29uZQ==").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    let tries = count(&received(&server).await, "GET", &gone);
    assert!((2..=10).contains(&tries), "{tries} tries");
    assert_all_authorized(&received(&server).await);
}
