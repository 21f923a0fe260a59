//! Faults are classified once and reported within a documented bound. A CouchDB behind a proxy
//! that answers HTML error pages, and a Firestore that is down, are played by wiremock; each
//! test checks the error's kind, that its retry owner marked it exhausted (so nothing further out
//! retries it again), how many requests were sent, and that it arrived within the bound the
//! adapter documents. The bounds are generous on purpose: they check that retries do not stack,
//! not speed. (DynamoDB's are in `tests/dynamodb_mock.rs`.)

use std::time::{Duration, Instant};

use agentstore::backend::couchdb::{CouchConfig, CouchDbBackend, READ_RETRY as COUCH_READ_RETRY};
use agentstore::backend::firestore::{FirestoreBackend, FirestoreConfig, RETRY as FIRESTORE_RETRY};
use agentstore::backend::{DocumentBackend, Precondition};
use agentstore::ErrorKind;
use serde_json::{json, Map, Value};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::common;

const DOC: &str = "user_1:default:Z3JlZXRpbmc=";
/// What a proxy in front of a server that is down answers.
const PROXY_PAGE: &str = "<html><head><title>502 Bad Gateway</title></head><body><center><h1>502 Bad Gateway</h1>\
                          </center><hr><center>nginx</center></body></html>";
/// Slack on top of a retry budget: one request timeout (the URLs below set 2 s) and scheduling.
const SLACK: Duration = Duration::from_secs(10);

fn html(status: u16) -> ResponseTemplate {
    ResponseTemplate::new(status).set_body_raw(PROXY_PAGE.as_bytes().to_vec(), "text/html")
}

fn body() -> Map<String, Value> {
    common::body("user_1", "default", "greeting", json!(1))
}

/// A CouchDB database that opened fine and then went behind a failing proxy: every request on
/// the document gets `answer`.
async fn couchdb_behind_proxy(answer: ResponseTemplate) -> (MockServer, CouchDbBackend) {
    let server = MockServer::start().await;
    Mock::given(method("GET"))
        .and(path("/db"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({ "db_name": "db", "doc_count": 0 })))
        .mount(&server)
        .await;
    Mock::given(path(format!("/db/{}", DOC.replace(':', "%3A").replace('=', "%3D"))))
        .respond_with(answer)
        .mount(&server)
        .await;
    let config = CouchConfig::parse(&format!("couchdb+{}/db?timeout_secs=2", server.uri())).expect("url");
    let backend = CouchDbBackend::open(&config).await.expect("open");
    (server, backend)
}

async fn document_requests(server: &MockServer, verb: &str) -> usize {
    let requests = server.received_requests().await.expect("recording on");
    requests.iter().filter(|r| r.method.as_str() == verb && r.url.path() != "/db").count()
}

/// Before: the HTML page failed JSON parsing and became `Internal` (a 500 to the client, never
/// retried). Now a read is `Unavailable`, retried as the read policy says, then reported.
#[tokio::test]
async fn couchdb_behind_a_proxy_answering_html_502_is_unavailable_and_reads_are_retried() {
    let (server, backend) = couchdb_behind_proxy(html(502)).await;
    let started = Instant::now();
    let error = backend.get(DOC).await.expect_err("the proxy fails every read");
    let took = started.elapsed();
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    assert!(error.retries_exhausted(), "{error}");
    assert!(!error.is_retryable(), "outer layers must not retry it again: {error}");
    assert_eq!(document_requests(&server, "GET").await, COUCH_READ_RETRY.retries + 1);
    assert!(took < COUCH_READ_RETRY.budget + SLACK, "reported after {took:?}");
}

/// A write refused by the proxy (503: not forwarded) had no effect: `Unavailable`, sent once.
#[tokio::test]
async fn couchdb_write_refused_by_a_proxy_is_unavailable_and_sent_once() {
    let (server, backend) = couchdb_behind_proxy(html(503)).await;
    let error = backend.put(DOC, &body(), Precondition::MustNotExist).await.expect_err("refused");
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    assert_eq!(document_requests(&server, "PUT").await, 1);
}

/// A gateway timeout on a write says nothing about whether CouchDB applied it: `OutcomeUnknown`
/// (HTTP 504 to the client), never retried.
#[tokio::test]
async fn couchdb_write_answered_by_a_gateway_timeout_may_have_been_applied() {
    let (server, backend) = couchdb_behind_proxy(html(504)).await;
    let error = backend.put(DOC, &body(), Precondition::MustNotExist).await.expect_err("timed out");
    assert_eq!(error.kind(), ErrorKind::OutcomeUnknown, "{error}");
    assert!(error.to_string().contains("may have been applied"), "{error}");
    assert_eq!(document_requests(&server, "PUT").await, 1);
}

/// A Firestore whose every answer is a proxy's HTML 503 is reported `Unavailable` within the
/// retry budget, marked exhausted.
#[tokio::test]
async fn firestore_that_is_down_is_reported_within_the_retry_budget() {
    let server = MockServer::start().await;
    Mock::given(wiremock::matchers::any()).respond_with(html(503)).mount(&server).await;
    let host = server.uri().trim_start_matches("http://").to_owned();
    let config =
        FirestoreConfig::parse(&format!("firestore://test-project?emulator={host}&timeout_ms=2000")).expect("url");
    let started = Instant::now();
    let error = match FirestoreBackend::open(&config).await {
        Ok(_) => panic!("opened a Firestore that answers only 503"),
        Err(error) => error,
    };
    let took = started.elapsed();
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    assert!(error.retries_exhausted(), "{error}");
    let sent = server.received_requests().await.expect("recording on").len();
    assert_eq!(sent, FIRESTORE_RETRY.retries + 1, "one retry owner, no stacked loops");
    assert!(took < FIRESTORE_RETRY.budget + SLACK, "reported after {took:?}");
}

/// A Firestore that cannot be connected to at all: same bound.
#[tokio::test]
async fn firestore_that_refuses_connections_is_reported_within_the_retry_budget() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("addr").port()
    };
    let config = FirestoreConfig::parse(&format!("firestore://test-project?emulator=127.0.0.1:{port}&timeout_ms=2000"))
        .expect("url");
    let started = Instant::now();
    let error = match FirestoreBackend::open(&config).await {
        Ok(_) => panic!("opened a Firestore on a closed port"),
        Err(error) => error,
    };
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    assert!(error.retries_exhausted(), "{error}");
    assert!(started.elapsed() < FIRESTORE_RETRY.budget + SLACK, "reported after {:?}", started.elapsed());
}
