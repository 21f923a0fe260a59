//! The Firestore backend against a wiremock server speaking Firestore's REST API v1 and Google's
//! OAuth token endpoint, for what a real server (or the emulator, which takes no credentials)
//! cannot show on demand: access tokens cached, refreshed and refused; a missing composite index;
//! `ABORTED`, `UNAVAILABLE` and `RESOURCE_EXHAUSTED` answers and per-write `:batchWrite` statuses;
//! errors that must not be retried; and requests that time out.
//!
//! Every test opens the backend the production way: `firestore://test-project?endpoint=<mock>` with
//! `credentials=<key file>`, the key being a copy of `fixtures/firestore/test-service-account.json`
//! whose `token_uri` is the mock's `/token`, so `gcp_auth` signs a real JWT and fetches its access
//! tokens from the mock. Answers have the shapes Firestore gives (checked against the Cloud
//! Firestore emulator): `{"writeResults": [{"updateTime"}], "commitTime"}` for `:commit`, a JSON
//! list of `{"document", "readTime"}` for `:runQuery`, `{"writeResults", "status"}` for
//! `:batchWrite`, and `{"error": {"code", "message", "status"}}` for errors.
//!
//! The client retries busy answers up to 6 times with 50 ms–3 s backoff and jitter, so the one
//! test that exhausts the retries takes a few seconds.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentstore::backend::firestore::{FirestoreBackend, FirestoreConfig};
use agentstore::backend::revision::RevisionId;
use agentstore::backend::{BulkWrite, DocumentBackend, Precondition, Projection, Query, Revision};
use agentstore::store::{DataStore, StoreOptions};
use agentstore::{ErrorKind, Result};
use base64::Engine as _;
use serde_json::{json, Map, Value};
use wiremock::matchers::{method, path};
use wiremock::{Match, Mock, MockBuilder, MockServer, Request, Respond, ResponseTemplate};

use crate::common::{self, request_json};

const PROJECT: &str = "test-project";
/// The database's documents as the REST paths name them.
const DOCUMENTS: &str = "/v1/projects/test-project/databases/(default)/documents";
/// The resource-name prefix of the collection's documents.
const NAME_PREFIX: &str = "projects/test-project/databases/(default)/documents/agent_data_store/";
/// The OAuth scope Firestore needs.
const DATASTORE_SCOPE: &str = "https://www.googleapis.com/auth/datastore";
const TOKEN_PATH: &str = "/token";
const KEY_FIXTURE: &str = include_str!("../../fixtures/firestore/test-service-account.json");
/// gcp_auth 0.12 tries a failing token request 5 times itself (`RETRY_COUNT` in its types.rs).
const GCP_AUTH_TOKEN_ATTEMPTS: usize = 5;
/// The client's first try plus its 6 retries.
const CLIENT_ATTEMPTS: usize = 7;
/// A document of the collection (composite id; valid as a Firestore document id as it is).
const ID: &str = "user_1:default:Z3JlZXRpbmc=";
/// The layout marker's path under the database's documents.
const LAYOUT_MARKER: &str = "agent_data_store_meta/layout";
/// Update times the mock hands out.
const T1: &str = "2026-03-02T10:15:30.123456Z";
const T2: &str = "2026-03-02T10:15:31.654321Z";
/// The link Firestore gives in a missing-index error (its `create_composite` is the index
/// definition, base64 protobuf).
const INDEX_LINK: &str = "https://console.firebase.google.com/v1/r/project/test-project/firestore/indexes?create_composite=\
ClVwcm9qZWN0cy90ZXN0LXByb2plY3QvZGF0YWJhc2VzLyhkZWZhdWx0KS9jb2xsZWN0aW9uR3JvdXBzL2FnZW50X2RhdGFfc3RvcmUvaW5kZXhlcy9fEAEaCgoGdXNlcklkEAEaDQoJbmFtZXNwYWNlEAEaDAoIX19uYW1lX18QAQ";

// ---------------------------------------------------------------------------------------------
// The mock and its answers.
// ---------------------------------------------------------------------------------------------

/// A mock Firestore plus the service-account key file the backend is opened with.
struct Firestore {
    server: MockServer,
    key: tempfile::NamedTempFile,
}

impl Firestore {
    /// A mock with nothing mounted; tokens are asked of the same server.
    async fn bare() -> Self {
        let server = MockServer::start().await;
        let key = key_file(&format!("{}{TOKEN_PATH}", server.uri()));
        Firestore { server, key }
    }

    /// A mock whose tokens come from another server (one the test can stop).
    async fn with_token_server(token_server: &MockServer) -> Self {
        let server = MockServer::start().await;
        let key = key_file(&format!("{}{TOKEN_PATH}", token_server.uri()));
        Firestore { server, key }
    }

    /// A mock handing out one long-lived token and answering the health check (`open`'s query
    /// without a filter) with no documents.
    async fn ready() -> Self {
        let firestore = Self::bare().await;
        token_endpoint().respond_with(token("tok-long-lived", 3600)).mount(&firestore.server).await;
        firestore.answer_health_checks().await;
        firestore
    }

    /// Answers `open`'s health check (a query without a filter) with no documents, and its read
    /// of the layout marker with a current marker.
    async fn answer_health_checks(&self) {
        run_query(false).respond_with(answer(200, json!([{ "readTime": T1, "done": true }]))).mount(&self.server).await;
        let marker = json!({
            "name": format!("projects/{PROJECT}/databases/(default)/documents/{LAYOUT_MARKER}"),
            "fields": { "version": { "integerValue": "2" } },
            "createTime": T1, "updateTime": T1
        });
        call("batchGet").and(LayoutMarker).respond_with(found(marker)).with_priority(1).mount(&self.server).await;
    }

    fn url(&self, extra: &str) -> String {
        let key = self.key.path().to_str().expect("temp paths are UTF-8");
        let key = percent_encoding::utf8_percent_encode(key, percent_encoding::NON_ALPHANUMERIC);
        format!("firestore://{PROJECT}?endpoint={}&credentials={key}{extra}", self.server.uri())
    }

    async fn open(&self) -> Result<FirestoreBackend> {
        self.open_with("").await
    }

    /// Opens with more URL parameters (`&timeout_ms=…`).
    async fn open_with(&self, extra: &str) -> Result<FirestoreBackend> {
        FirestoreBackend::open(&FirestoreConfig::parse(&self.url(extra))?).await
    }

    async fn requests(&self) -> Vec<Request> {
        self.server.received_requests().await.expect("request recording is on")
    }

    /// The Firestore requests (not token requests, nor `open`'s read of the layout marker), in
    /// order.
    async fn firestore_requests(&self) -> Vec<Request> {
        self.requests().await.into_iter().filter(|r| r.url.path() != TOKEN_PATH && !LayoutMarker.matches(r)).collect()
    }

    /// The requests to one method (`commit`, `runQuery`, …), in order, the layout marker's read
    /// left out.
    async fn calls(&self, name: &str) -> Vec<Request> {
        let wanted = format!("{DOCUMENTS}:{name}");
        self.requests().await.into_iter().filter(|r| r.url.path() == wanted && !LayoutMarker.matches(r)).collect()
    }

    /// The `:runQuery` requests with a `where` (listings), in order.
    async fn listings(&self) -> Vec<Request> {
        self.calls("runQuery").await.into_iter().filter(|r| RunQuery { filtered: true }.matches(r)).collect()
    }
}

/// A copy of the fixture key whose `token_uri` is `token_uri`.
fn key_file(token_uri: &str) -> tempfile::NamedTempFile {
    let mut key: Value = serde_json::from_str(KEY_FIXTURE).expect("the fixture key is JSON");
    key["token_uri"] = json!(token_uri);
    let file = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(file.path(), key.to_string()).expect("write the key file");
    file
}

fn token_endpoint() -> MockBuilder {
    Mock::given(method("POST")).and(path(TOKEN_PATH))
}

/// Google's answer to a JWT-bearer grant.
fn token(access_token: &str, expires_in: u64) -> ResponseTemplate {
    answer(200, json!({ "access_token": access_token, "expires_in": expires_in, "token_type": "Bearer" }))
}

/// A `POST …/documents:{name}` call.
fn call(name: &str) -> MockBuilder {
    Mock::given(method("POST")).and(path(format!("{DOCUMENTS}:{name}")))
}

/// A `:runQuery` with (`filtered`) or without a `where`: listings and the index probe filter on
/// `userId`/`namespace`, the health check does not.
struct RunQuery {
    filtered: bool,
}

impl Match for RunQuery {
    fn matches(&self, request: &Request) -> bool {
        let body: Value = serde_json::from_slice(&request.body).unwrap_or(Value::Null);
        body.pointer("/structuredQuery/where").is_some() == self.filtered
    }
}

/// A request naming the layout marker document.
struct LayoutMarker;

impl Match for LayoutMarker {
    fn matches(&self, request: &Request) -> bool {
        String::from_utf8_lossy(&request.body).contains(LAYOUT_MARKER)
    }
}

fn run_query(filtered: bool) -> MockBuilder {
    call("runQuery").and(RunQuery { filtered })
}

/// `:batchGet`'s answer for one document that is there.
fn found(document: Value) -> ResponseTemplate {
    answer(200, json!([{ "found": document, "readTime": T2 }]))
}

/// A JSON answer.
fn answer(status: u16, body: Value) -> ResponseTemplate {
    ResponseTemplate::new(status).set_body_raw(body.to_string().into_bytes(), "application/json; charset=UTF-8")
}

/// A Firestore error answer.
fn firestore_error(http_status: u16, status: &str, message: &str) -> ResponseTemplate {
    answer(http_status, json!({ "error": { "code": http_status, "message": message, "status": status } }))
}

fn commit_reply(update_time: &str) -> Value {
    json!({ "writeResults": [{ "updateTime": update_time }], "commitTime": update_time })
}

/// A stored document as `:batchGet` and `:runQuery` give it (native fields).
fn stored_document(id: &str, update_time: &str) -> Value {
    json!({
        "name": format!("{NAME_PREFIX}{id}"),
        "fields": {
            "_id": { "stringValue": id },
            "userId": { "stringValue": "user_1" },
            "namespace": { "stringValue": "default" },
            "key": { "stringValue": "greeting" },
            "value": { "mapValue": { "fields": { "text": { "stringValue": "hello" }, "n": { "integerValue": "42" } } } },
            "accessCount": { "integerValue": "3" }
        },
        "createTime": "2026-03-01T08:00:00.000001Z",
        "updateTime": update_time
    })
}

/// Mounts `responses` on one call so they are given in order, the last one from then on.
async fn in_order(server: &MockServer, mock: impl Fn() -> MockBuilder, responses: Vec<ResponseTemplate>) {
    let last = responses.len().saturating_sub(1);
    for (n, response) in responses.into_iter().enumerate() {
        let priority = u8::try_from(n + 1).expect("a short sequence");
        let builder = mock().respond_with(response).with_priority(priority);
        let builder = if n < last { builder.up_to_n_times(1) } else { builder };
        builder.mount(server).await;
    }
}

/// user_1's `key` in `default`, value `{"n": 1}`, never read (`accessCount` 0).
fn body(key: &str) -> Map<String, Value> {
    let mut body = common::body("user_1", "default", key, json!({ "n": 1 }));
    body.insert("accessCount".into(), json!(0));
    body
}

fn listing() -> Query {
    Query { user_id: "user_1".into(), namespace: Some("default".into()), projection: Projection::All }
}

/// Asserts `rev` is a first revision minted by the adapter (`1-<32 hex>`) and is the `_rev` the
/// write carried.
fn assert_minted_first_revision(rev: &Revision, write: &Value) {
    let parsed = RevisionId::parse(rev.as_str()).unwrap_or_else(|| panic!("{rev} is not N-<32 hex>"));
    assert_eq!(parsed.generation, 1, "{rev}");
    assert_eq!(write["update"]["fields"]["_rev"]["stringValue"], rev.as_str(), "the stored revision: {write}");
}

fn bearer(request: &Request) -> Option<&str> {
    request.headers.get("authorization")?.to_str().ok()?.strip_prefix("Bearer ")
}

/// Asserts an outcome is an error of `kind` whose message contains every one of `words`.
fn expect_error<T: std::fmt::Debug>(outcome: Result<T>, kind: ErrorKind, words: &[&str], what: &str) {
    match outcome {
        Ok(value) => panic!("{what}: expected a {kind} error, got Ok({value:?})"),
        Err(err) => {
            assert_eq!(err.kind(), kind, "{what}: {err}");
            for word in words {
                assert!(err.to_string().contains(word), "{what}: {err:?} does not mention {word:?}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Access tokens.
// ---------------------------------------------------------------------------------------------

/// The claims of the JWT a token request carries (`grant_type` checked).
fn jwt_claims(request: &Request) -> Value {
    let form: Vec<(String, String)> = url::form_urlencoded::parse(&request.body).into_owned().collect();
    let field = |name: &str| form.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str());
    assert_eq!(field("grant_type"), Some("urn:ietf:params:oauth:grant-type:jwt-bearer"), "token request {form:?}");
    let assertion = field("assertion").expect("a JWT assertion");
    let claims = assertion.split('.').nth(1).expect("a JWT has three parts");
    let engine = base64::engine::GeneralPurpose::new(
        &base64::alphabet::URL_SAFE,
        base64::engine::GeneralPurposeConfig::new()
            .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
    );
    serde_json::from_slice(&engine.decode(claims).expect("base64url claims")).expect("JSON claims")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_valid_token_is_fetched_once_and_sent_on_every_call() {
    let firestore = Firestore::ready().await;
    call("commit").respond_with(answer(200, commit_reply(T1))).mount(&firestore.server).await;
    call("batchGet").respond_with(found(stored_document(ID, T1))).mount(&firestore.server).await;
    run_query(true)
        .respond_with(answer(200, json!([{ "document": stored_document(ID, T1), "readTime": T1 }])))
        .mount(&firestore.server)
        .await;

    let backend = firestore.open().await.expect("open");
    let rev = backend.put(ID, &body("greeting"), Precondition::MustNotExist).await.expect("put");
    assert_minted_first_revision(&rev, &request_json(&firestore.calls("commit").await[0])["writes"][0]);
    assert!(backend.get(ID).await.expect("get").is_some());
    assert_eq!(backend.query(&listing(), 10, None).await.expect("query").items.len(), 1);
    backend.health().await.expect("health");

    let requests = firestore.requests().await;
    let token_requests: Vec<&Request> = requests.iter().filter(|r| r.url.path() == TOKEN_PATH).collect();
    assert_eq!(token_requests.len(), 1, "one token for the whole session");
    let claims = jwt_claims(token_requests[0]);
    assert_eq!(claims["scope"], DATASTORE_SCOPE, "{claims}");
    assert_eq!(claims["iss"], "agentstore-test@test-project.iam.gserviceaccount.com", "{claims}");

    let calls = firestore.firestore_requests().await;
    assert_eq!(calls.len(), 5, "health at open, put, get, query, health");
    for request in &calls {
        assert_eq!(bearer(request), Some("tok-long-lived"), "{} {}", request.method, request.url);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expiring_token_is_replaced_on_next_use() {
    let firestore = Firestore::bare().await;
    // gcp_auth counts a token as expired 20 s before its end, so `expires_in: 1` is stale at once.
    in_order(&firestore.server, token_endpoint, vec![token("tok-1", 1), token("tok-2", 3600)]).await;
    firestore.answer_health_checks().await;
    call("commit").respond_with(answer(200, commit_reply(T1))).mount(&firestore.server).await;
    call("batchGet").respond_with(found(stored_document(ID, T1))).mount(&firestore.server).await;

    let backend = firestore.open().await.expect("open");
    backend.put(ID, &body("greeting"), Precondition::MustNotExist).await.expect("put");
    backend.get(ID).await.expect("get");
    backend.health().await.expect("health");

    let tokens: Vec<Option<String>> =
        firestore.firestore_requests().await.iter().map(|r| bearer(r).map(str::to_owned)).collect();
    let expected: Vec<Option<String>> =
        ["tok-1", "tok-2", "tok-2", "tok-2"].into_iter().map(|t| Some(t.to_owned())).collect();
    assert_eq!(tokens, expected, "bearer tokens of health at open, put, get, health");
    let token_requests = firestore.requests().await.iter().filter(|r| r.url.path() == TOKEN_PATH).count();
    assert_eq!(token_requests, 2, "the expired token is replaced once, the new one kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_token_request_fails_open_as_unauthorized() {
    let firestore = Firestore::bare().await;
    token_endpoint()
        .respond_with(answer(400, json!({ "error": "invalid_grant", "error_description": "Invalid JWT Signature." })))
        .mount(&firestore.server)
        .await;
    firestore.answer_health_checks().await;

    expect_error(firestore.open().await.map(|_| ()), ErrorKind::Unauthorized, &["Google credentials"], "open");
    assert!(firestore.firestore_requests().await.is_empty(), "no Firestore call without a token");
    let token_requests = firestore.requests().await.iter().filter(|r| r.url.path() == TOKEN_PATH).count();
    assert_eq!(token_requests, GCP_AUTH_TOKEN_ATTEMPTS, "gcp_auth's own attempts, not repeated by the client");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_token_refresh_fails_the_call_as_unauthorized() {
    let firestore = Firestore::bare().await;
    in_order(
        &firestore.server,
        token_endpoint,
        vec![
            // Open's health check, then its read of the layout marker, each with a token that
            // is stale at once.
            token("tok-1", 1),
            token("tok-2", 1),
            answer(400, json!({ "error": "invalid_grant", "error_description": "Invalid JWT Signature." })),
        ],
    )
    .await;
    firestore.answer_health_checks().await;
    call("batchGet").respond_with(found(stored_document(ID, T1))).mount(&firestore.server).await;

    let backend = firestore.open().await.expect("open with the first two tokens");
    expect_error(backend.get(ID).await, ErrorKind::Unauthorized, &["Google credentials"], "get");
    expect_error(
        backend.put(ID, &body("greeting"), Precondition::MustNotExist).await,
        ErrorKind::Unauthorized,
        &["Google credentials"],
        "put",
    );
    assert_eq!(firestore.firestore_requests().await.len(), 1, "only the health check at open reached Firestore");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_token_endpoint_is_unavailable_not_unauthorized() {
    // The token server answers one short-lived token and is then shut down (connections refused).
    let token_server = MockServer::builder().start().await;
    token_endpoint().respond_with(token("tok-1", 1)).mount(&token_server).await;
    let firestore = Firestore::with_token_server(&token_server).await;
    firestore.answer_health_checks().await;
    call("commit").respond_with(answer(200, commit_reply(T1))).mount(&firestore.server).await;
    let backend = firestore.open().await.expect("open with the first token");
    drop(token_server);

    // A write is not retried by the client, so this takes only gcp_auth's own attempts.
    let outcome = backend.put(ID, &body("greeting"), Precondition::MustNotExist).await;
    expect_error(outcome, ErrorKind::Unavailable, &["Google credentials"], "put with the token endpoint down");
    assert!(firestore.calls("commit").await.is_empty());
}

// ---------------------------------------------------------------------------------------------
// A missing composite index.
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_index_is_misconfigured_and_quotes_firestores_link() {
    let firestore = Firestore::ready().await;
    run_query(true)
        .respond_with(firestore_error(
            400,
            "FAILED_PRECONDITION",
            &format!("The query requires an index. You can create it here: {INDEX_LINK}"),
        ))
        .mount(&firestore.server)
        .await;
    let backend: Arc<dyn DocumentBackend> =
        Arc::new(firestore.open().await.expect("open: the health check needs no index"));

    let opened = DataStore::open(Arc::clone(&backend), StoreOptions::default()).await.map(|_| ());
    expect_error(opened, ErrorKind::Misconfigured, &[INDEX_LINK, "firestore.indexes.json"], "DataStore::open");
    let listed = backend.query(&listing(), 10, None).await;
    expect_error(listed, ErrorKind::Misconfigured, &[INDEX_LINK, "firestore.indexes.json"], "query");

    let listings = firestore.listings().await;
    assert_eq!(listings.len(), 2, "the startup probe and the listing, neither retried");
    for request in &listings {
        let query = &request_json(request)["structuredQuery"];
        let filters = query.pointer("/where/compositeFilter/filters").and_then(Value::as_array).expect("two filters");
        let fields: Vec<&str> =
            filters.iter().filter_map(|f| f.pointer("/fieldFilter/field/fieldPath").and_then(Value::as_str)).collect();
        assert_eq!(fields, ["userId", "namespace"], "the probe asks what listings ask: {query}");
        assert_eq!(query["orderBy"][0]["field"]["fieldPath"], "__name__", "{query}");
    }
}

// ---------------------------------------------------------------------------------------------
// Busy answers are retried; others are not.
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_is_retried_through_aborted_unavailable_and_resource_exhausted() {
    let firestore = Firestore::ready().await;
    in_order(
        &firestore.server,
        || call("commit"),
        vec![
            firestore_error(409, "ABORTED", "Too much contention on these documents. Please try again."),
            firestore_error(503, "UNAVAILABLE", "The service is currently unavailable."),
            firestore_error(429, "RESOURCE_EXHAUSTED", "Quota exceeded."),
            answer(200, commit_reply(T1)),
        ],
    )
    .await;
    let backend = firestore.open().await.expect("open");

    let rev = backend.put(ID, &body("greeting"), Precondition::MustNotExist).await.expect("put after busy answers");
    let commits = firestore.calls("commit").await;
    assert_minted_first_revision(&rev, &request_json(&commits[3])["writes"][0]);
    assert_eq!(commits.len(), 4, "three busy answers, then the one that worked");
    let first = request_json(&commits[0]);
    for retry in &commits[1..] {
        assert_eq!(request_json(retry), first, "a retry is the same commit");
    }
    assert_eq!(first["writes"][0]["update"]["name"], format!("{NAME_PREFIX}{ID}"));
    assert_eq!(first["writes"][0]["currentDocument"], json!({ "exists": false }), "create precondition");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_is_retried_after_unavailable() {
    let firestore = Firestore::ready().await;
    in_order(
        &firestore.server,
        || run_query(true),
        vec![
            firestore_error(503, "UNAVAILABLE", "The service is currently unavailable."),
            answer(200, json!([{ "document": stored_document(ID, T1), "readTime": T2 }])),
        ],
    )
    .await;
    let backend = firestore.open().await.expect("open");

    let page = backend.query(&listing(), 10, None).await.expect("query after UNAVAILABLE");
    assert_eq!(page.items.len(), 1);
    assert_eq!(page.items[0].id, ID);
    assert_eq!(page.items[0].rev, Revision(T1.into()));
    assert_eq!(page.items[0].body["value"], json!({ "text": "hello", "n": 42 }));
    assert_eq!(page.items[0].body["accessCount"], json!(3));
    assert_eq!(page.next, None, "fewer documents than the limit: no next page");
    let listings = firestore.listings().await;
    assert_eq!(listings.len(), 2);
    assert_eq!(request_json(&listings[0]), request_json(&listings[1]), "a retry is the same query");
}

/// Answers `:batchWrite`, each write of `busy` getting ABORTED (gRPC code 10) the first time it
/// is seen; the other writes succeed with the update time of the request's round.
struct BusyOnce {
    busy: HashSet<String>,
    seen: Mutex<HashSet<String>>,
    round: AtomicUsize,
}

impl Respond for BusyOnce {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let time = if self.round.fetch_add(1, Ordering::SeqCst) == 0 { T1 } else { T2 };
        let body: Value = serde_json::from_slice(&request.body).unwrap_or(Value::Null);
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let (mut results, mut statuses) = (Vec::new(), Vec::new());
        for write in body["writes"].as_array().into_iter().flatten() {
            let name = write["update"]["name"].as_str().unwrap_or_default().to_owned();
            if self.busy.contains(&name) && seen.insert(name) {
                results.push(json!({}));
                statuses.push(json!({ "code": 10, "message": "Too much contention on these documents." }));
            } else {
                results.push(json!({ "updateTime": time }));
                statuses.push(json!({}));
            }
        }
        answer(200, json!({ "writeResults": results, "status": statuses }))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_batch_write_entry_is_resent_alone() {
    let firestore = Firestore::ready().await;
    let ids: Vec<String> = (0..3).map(|i| format!("user_1:bulk:{i}")).collect();
    let busy = format!("{NAME_PREFIX}{}", ids[1]);
    let responder = BusyOnce { busy: [busy.clone()].into(), seen: Mutex::default(), round: AtomicUsize::new(0) };
    call("batchWrite").respond_with(responder).mount(&firestore.server).await;
    let backend = firestore.open().await.expect("open");

    let writes = ids
        .iter()
        .map(|id| BulkWrite { id: id.clone(), body: body(id), precondition: Precondition::MustNotExist })
        .collect();
    let results = backend.bulk_write(writes).await.expect("bulk_write as a whole");
    let revs: Vec<Revision> = results.into_iter().map(|r| r.expect("every write succeeds")).collect();

    let batches = firestore.calls("batchWrite").await;
    let sent = request_json(&batches[0])["writes"].as_array().cloned().expect("writes");
    for (rev, write) in revs.iter().zip(&sent) {
        assert_minted_first_revision(rev, write);
    }
    assert_eq!(batches.len(), 2, "one batch, then the busy write again");
    let first = request_json(&batches[0])["writes"].as_array().cloned().expect("writes");
    let second = request_json(&batches[1])["writes"].as_array().cloned().expect("writes");
    assert_eq!(first.len(), 3);
    assert_eq!(second, [first[1].clone()], "only the busy write, unchanged");
    assert_eq!(second[0]["update"]["name"], busy.as_str());
    assert!(firestore.calls("commit").await.is_empty(), "plain creates go through batchWrite");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_stays_busy_gives_up_as_unavailable() {
    let firestore = Firestore::ready().await;
    call("commit")
        .respond_with(firestore_error(409, "ABORTED", "Too much contention on these documents. Please try again."))
        .mount(&firestore.server)
        .await;
    let backend = firestore.open().await.expect("open");

    let outcome = backend.put(ID, &body("greeting"), Precondition::MustNotExist).await;
    expect_error(outcome, ErrorKind::Unavailable, &["ABORTED", "Too much contention"], "put");
    assert_eq!(firestore.calls("commit").await.len(), CLIENT_ATTEMPTS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_argument_is_not_retried() {
    let firestore = Firestore::ready().await;
    let message = "Property value contains an invalid nested entity.";
    call("commit").respond_with(firestore_error(400, "INVALID_ARGUMENT", message)).mount(&firestore.server).await;
    let backend = firestore.open().await.expect("open");

    let outcome = backend.put(ID, &body("greeting"), Precondition::MustNotExist).await;
    expect_error(outcome, ErrorKind::InvalidInput, &[message], "put");
    assert_eq!(firestore.calls("commit").await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn already_exists_on_create_is_a_conflict_not_retried() {
    let firestore = Firestore::ready().await;
    call("commit")
        .respond_with(firestore_error(409, "ALREADY_EXISTS", &format!("Document already exists: {NAME_PREFIX}{ID}")))
        .mount(&firestore.server)
        .await;
    // What is there is live (not a tombstone a create could replace).
    call("batchGet").respond_with(found(stored_document(ID, T1))).mount(&firestore.server).await;
    let backend = firestore.open().await.expect("open");

    let outcome = backend.put(ID, &body("greeting"), Precondition::MustNotExist).await;
    expect_error(outcome, ErrorKind::Conflict, &["already exists"], "create");
    assert_eq!(firestore.calls("commit").await.len(), 1, "not sent again");
    assert_eq!(firestore.calls("batchGet").await.len(), 1, "one read to tell a tombstone from a live document");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_found_for_an_update_precondition_is_a_conflict() {
    // Production answers NOT_FOUND when an update's document is gone.
    let firestore = Firestore::ready().await;
    call("commit")
        .respond_with(firestore_error(404, "NOT_FOUND", &format!("No document to update: {NAME_PREFIX}{ID}")))
        .mount(&firestore.server)
        .await;
    let backend = firestore.open().await.expect("open");

    let outcome = backend.put(ID, &body("greeting"), Precondition::MatchRevision(Revision(T1.into()))).await;
    expect_error(outcome, ErrorKind::Conflict, &[ID], "update");
    let commits = firestore.calls("commit").await;
    assert_eq!(commits.len(), 1);
    assert_eq!(request_json(&commits[0])["writes"][0]["currentDocument"], json!({ "updateTime": T1 }));
}

// ---------------------------------------------------------------------------------------------
// Requests that time out.
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_write_is_not_retried_but_a_timed_out_read_is() {
    let firestore = Firestore::ready().await;
    let late = Duration::from_secs(3);
    call("commit").respond_with(answer(200, commit_reply(T1)).set_delay(late)).mount(&firestore.server).await;
    in_order(
        &firestore.server,
        || call("batchGet"),
        vec![found(stored_document(ID, T1)).set_delay(late), found(stored_document(ID, T2))],
    )
    .await;
    let backend = firestore.open_with("&timeout_ms=300").await.expect("open");

    // The commit may have been applied: repeating it could apply it twice, and the error says so.
    let outcome = backend.put(ID, &body("greeting"), Precondition::MustNotExist).await;
    expect_error(
        outcome,
        ErrorKind::OutcomeUnknown,
        &["write document", "may have been applied"],
        "put that timed out",
    );
    assert_eq!(firestore.calls("commit").await.len(), 1, "a timed-out write is not sent again");

    // The lost answer was looked up (a read that timed out too and was sent again): the document
    // does not hold the revision the write minted, so the outcome stays unknown.
    let doc = backend.get(ID).await.expect("get after a timeout").expect("found");
    assert_eq!(doc.rev, Revision(T2.into()), "a previous-release document keeps its updateTime revision");
    let reads = firestore.calls("batchGet").await;
    assert_eq!(reads.len(), 3, "the lookup, sent again after its timeout, then the get");
    assert_eq!(request_json(&reads[0])["documents"], json!([format!("{NAME_PREFIX}{ID}")]));
    assert_eq!(request_json(&reads[0]), request_json(&reads[1]), "the same read");
}

// ---------------------------------------------------------------------------------------------
// Lost answers and lost races of conditional writes.
// ---------------------------------------------------------------------------------------------

/// Answers every `:commit` with `INTERNAL` after keeping (`applied`) or dropping its write, and
/// every `:batchGet` with what was kept: a write applied whose answer was lost.
struct LostAnswer {
    applied: bool,
    stored: Arc<Mutex<Option<Value>>>,
}

impl Respond for LostAnswer {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let body: Value = serde_json::from_slice(&request.body).unwrap_or(Value::Null);
        let mut stored = self.stored.lock().unwrap_or_else(|e| e.into_inner());
        if request.url.path().ends_with(":commit") {
            if self.applied {
                let mut document = body["writes"][0]["update"].clone();
                document["updateTime"] = json!(T2);
                *stored = Some(document);
            }
            return firestore_error(500, "INTERNAL", "Internal error encountered.");
        }
        match stored.as_ref() {
            Some(document) => found(document.clone()),
            None => answer(200, json!([{ "missing": format!("{NAME_PREFIX}{ID}"), "readTime": T2 }])),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_whose_answer_was_lost_is_recognised_by_its_own_revision() {
    for applied in [true, false] {
        let firestore = Firestore::ready().await;
        let stored = Arc::new(Mutex::new(None));
        for name in ["commit", "batchGet"] {
            call(name).respond_with(LostAnswer { applied, stored: Arc::clone(&stored) }).mount(&firestore.server).await;
        }
        let backend = firestore.open().await.expect("open");

        let outcome = backend.put(ID, &body("greeting"), Precondition::MustNotExist).await;
        let commits = firestore.calls("commit").await;
        assert_eq!(commits.len(), 1, "a write that may have been applied is not sent again");
        if applied {
            let rev = outcome.expect("the document holds the revision this write minted: it was applied");
            assert_minted_first_revision(&rev, &request_json(&commits[0])["writes"][0]);
        } else {
            expect_error(
                outcome,
                ErrorKind::OutcomeUnknown,
                &["may have been applied"],
                "put whose write is not there",
            );
        }
        assert_eq!(firestore.calls("batchGet").await.len(), 1, "one lookup of the stored revision");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_update_is_conditional_on_the_version_it_checked() {
    let firestore = Firestore::ready().await;
    let current = RevisionId::next_after(Some(2)).expect("random").to_revision();
    let mut document = stored_document(ID, T1);
    document["fields"]["_rev"] = json!({ "stringValue": current.as_str() });
    document["fields"]["_deleted"] = json!({ "booleanValue": false });
    call("batchGet").respond_with(found(document)).mount(&firestore.server).await;
    // Another writer commits between our read and our commit.
    call("commit")
        .respond_with(firestore_error(
            400,
            "FAILED_PRECONDITION",
            "the stored version does not match the required base version",
        ))
        .mount(&firestore.server)
        .await;
    let backend = firestore.open().await.expect("open");

    let outcome = backend.put(ID, &body("greeting"), Precondition::MatchRevision(current.clone())).await;
    expect_error(outcome, ErrorKind::Conflict, &[ID], "update that lost the race");
    let commits = firestore.calls("commit").await;
    assert_eq!(commits.len(), 1);
    let write = &request_json(&commits[0])["writes"][0];
    assert_eq!(write["currentDocument"], json!({ "updateTime": T1 }), "conditional on the version read: {write}");
    let minted =
        RevisionId::parse(write["update"]["fields"]["_rev"]["stringValue"].as_str().unwrap_or("")).expect("N-hex");
    assert_eq!(minted.generation, 4, "generation 3 + 1");
    assert_eq!(write["updateTransforms"][0]["setToServerValue"], "REQUEST_TIME", "the feed time: {write}");

    // A stale revision is refused after the read, with no write.
    let stale = RevisionId::next_after(Some(2)).expect("random").to_revision();
    let outcome = backend.put(ID, &body("greeting"), Precondition::MatchRevision(stale)).await;
    expect_error(outcome, ErrorKind::Conflict, &[ID], "update with a stale revision");
    assert_eq!(firestore.calls("commit").await.len(), 1, "nothing written");
}
