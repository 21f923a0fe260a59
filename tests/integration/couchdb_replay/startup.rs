//! Every transcript loads and replays (by raw or percent-encoded path); startup ensures the index
//! and learns its design document; a missing database is misconfigured without `create=true` and
//! created with it; refused credentials are unauthorized.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_transcript_loads_and_replays_by_raw_or_encoded_path() {
    let files = transcript_files();
    assert_eq!(files.len(), 119, "INDEX.md lists 119 transcripts");
    for file in &files {
        let t = Transcript::load(file);
        assert!(t.path.starts_with('/'), "{}: {}", t.file, t.path);
        assert!((200..600).contains(&t.status), "{}: {}", t.file, t.status);
        let _ = t.mock().respond_with(t.response());
    }

    // 016 records the id raw, 018 percent-encoded; each mock answers both spellings with the
    // recorded status, Content-Type, ETag and body.
    let http = reqwest::Client::new();
    for number in [16, 18] {
        let server = MockServer::start().await;
        transcript(number).mount(&server).await;
        for spelling in ["user_123:default:Z3JlZXRpbmc=", "user_123%3Adefault%3AZ3JlZXRpbmc%3D"] {
            let response = http
                .get(format!("{}/{DB}/{spelling}", server.uri()))
                .header("authorization", BASIC_ADMIN)
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200, "{number:03} {spelling}");
            assert_eq!(response.headers()["content-type"], "application/json");
            assert_eq!(response.headers()["etag"], format!("\"{GREETING_REV_1}\""));
            let body: Value = response.json().await.unwrap();
            assert_eq!(body, transcript(16).response_body);
        }
        // Without credentials the recorded (authenticated) request does not match.
        let response = http.get(format!("{}/{DB}/{GREETING_ID}", server.uri())).send().await.unwrap();
        assert_eq!(response.status(), 404, "{number:03}");
        // wiremock's own `path` matcher compares the raw path, so it cannot be used for ids.
        let raw = wiremock::matchers::path(format!("/{DB}/{GREETING_ID}"));
        let encoded = received(&server).await.into_iter().find(|r| r.url.path().contains("%3A")).unwrap();
        assert!(!raw.matches(&encoded), "wiremock started decoding paths; DecodedPath may be unnecessary");
    }
}

// ---------------------------------------------------------------------------------------------
// Startup, missing database, credentials
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_ensures_the_index_and_finds_name_the_learned_design_doc() {
    let server = MockServer::start().await;
    // An empty page (030) answers every _find; this test is about what the _find says.
    let empty = transcript(30);
    Mock::given(method("POST"))
        .and(DecodedPath::new(&format!("/{DB}/_find")))
        .respond_with(empty.response())
        .mount(&server)
        .await;
    // The index's design document answers a HEAD as an existing document does (017's status):
    // a first write to a namespace looks it up instead of POSTing `_index` again.
    Mock::given(method("HEAD"))
        .and(DecodedPath::new(&format!("/{DB}/{INDEX_DDOC}")))
        .respond_with(ResponseTemplate::new(transcript(17).status))
        .mount(&server)
        .await;
    let (backend, store) = open_store(&server, page_size(12)).await;
    backend.ensure_namespace_indexed("notes").await.expect("the index exists");
    assert_eq!(store.list_keys("user_123", "notes").await.unwrap(), Vec::<String>::new());

    let requests = received(&server).await;
    let sequence: Vec<(String, String)> = requests.iter().map(|r| (r.method.to_string(), path_of(r))).collect();
    let expected: Vec<(String, String)> = [
        ("GET", format!("/{DB}")),
        ("POST", format!("/{DB}/_index")),
        ("HEAD", format!("/{DB}/{INDEX_DDOC}")),
        ("POST", format!("/{DB}/_find")),
    ]
    .into_iter()
    .map(|(m, p)| (m.to_owned(), p))
    .collect();
    assert_eq!(sequence, expected);
    // The index definition is exactly the recorded one (010/011).
    for request in requests.iter().filter(|r| is(r, "POST", &format!("/{DB}/_index"))) {
        assert_eq!(json_body(request), transcript(10).request_body);
    }
    let find = &find_bodies(&requests)[0];
    assert_eq!(find["use_index"], json!([INDEX_DDOC, INDEX_NAME]), "{find}");
    assert_eq!(find["selector"], json!({"userId": "user_123", "namespace": "notes"}));
    assert_eq!(find["limit"], json!(12));
    assert_eq!(find["fields"], json!(["_id", "_rev", "key"]));
    assert!(find.get("bookmark").is_none(), "the first page has no bookmark: {find}");
    assert_all_authorized(&requests);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_database_is_misconfigured_without_create() {
    let server = MockServer::start().await;
    let missing = transcript(6);
    missing.mount(&server).await;
    let url = backend_url(&server, Some("admin:password"), "no_such_db", "");
    let err = match CouchDbBackend::open(&CouchConfig::parse(&url).unwrap()).await {
        Ok(_) => panic!("opened a database that 006 says does not exist"),
        Err(err) => err,
    };
    assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");
    let message = err.to_string();
    assert!(message.contains("no_such_db") && message.contains("create=true"), "{message}");
    let requests = received(&server).await;
    assert_eq!(requests.len(), 1, "only the GET, and nothing created: {requests:?}");
    assert_eq!(count(&requests, "GET", "/no_such_db"), 1);
    assert_all_authorized(&requests);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_database_is_created_with_create_true() {
    // 003: created; 004: someone else created it meanwhile (412 file_exists) — both are fine.
    for create in [3, 4] {
        let server = MockServer::start().await;
        let missing = transcript(6);
        Mock::given(method("GET"))
            .and(DecodedPath::new(&format!("/{DB}")))
            .respond_with(missing.response())
            .mount(&server)
            .await;
        transcript(create).mount(&server).await;
        let url = backend_url(&server, Some("admin:password"), DB, "?create=true");
        let opened = CouchDbBackend::open(&CouchConfig::parse(&url).unwrap()).await;
        assert!(opened.is_ok(), "{create:03}: {:?}", opened.err());
        let requests = received(&server).await;
        assert_eq!(count(&requests, "GET", &format!("/{DB}")), 1, "{create:03}");
        assert_eq!(count(&requests, "PUT", &format!("/{DB}")), 1, "{create:03}");
        assert_eq!(requests.len(), 2, "{create:03}");
        assert_all_authorized(&requests);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_credentials_are_unauthorized() {
    // 007 (no credentials) and 008 (admin:wrong, whose header the transcript records literally).
    for (number, credentials) in [(7, None), (8, Some("admin:wrong"))] {
        let server = MockServer::start().await;
        transcript(number).mount(&server).await;
        let url = backend_url(&server, credentials, DB, "");
        let err = match CouchDbBackend::open(&CouchConfig::parse(&url).unwrap()).await {
            Ok(_) => panic!("{number:03}: opened despite a 401"),
            Err(err) => err,
        };
        assert_eq!(err.kind(), ErrorKind::Unauthorized, "{number:03}: {err}");
        assert!(err.to_string().contains("credentials"), "{number:03}: {err}");
        assert_eq!(received(&server).await.len(), 1, "{number:03}: a 401 is not retried");
    }

    // With the right credentials every request carries them, and a 401 later on (a password
    // rotated under us) is Unauthorized too, not retried.
    let server = MockServer::start().await;
    let backend = open_backend(&server).await;
    let refused = transcript(8);
    Mock::given(method("GET"))
        .and(DecodedPath::new(&format!("/{DB}/{GREETING_ID}")))
        .respond_with(refused.response())
        .mount(&server)
        .await;
    let err = backend.get(GREETING_ID).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unauthorized, "{err}");
    assert!(err.to_string().contains("credentials"), "{err}");
    let requests = received(&server).await;
    assert_eq!(count(&requests, "GET", &format!("/{DB}/{GREETING_ID}")), 1);
    assert_all_authorized(&requests);
}
