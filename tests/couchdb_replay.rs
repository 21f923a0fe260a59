//! Replays the real Apache CouchDB 3.4.3 transcripts in `fixtures/couchdb-3.4.3/` against the
//! CouchDB adapter with wiremock, for the behaviour pouchdb-server (the local test server of the
//! contract suite) cannot show: the 25-document default `_find` limit, bookmark paging and its
//! empty last page, invalid bookmarks, 409s on stale deletes, `deleted` tombstones, exact big
//! numbers, 413s, 401s, and index-id learning (see `../shared/TEST-SERVERS.md`); and how
//! CouchDB 3.4.3 stored 36 number texts (`fixtures/couchdb-numbers-3.4.3.json`), replayed to
//! prove that a write is refused, never acknowledged, when CouchDB would store another number.
//!
//! Every transcript is one recorded request and response. [`Transcript::mock`] turns one into a
//! wiremock `Mock` that matches the recorded method, path (compared percent-decoded, see
//! [`DecodedPath`]), query and credentials, and [`Transcript::response`] answers with the recorded
//! status, headers and body.

#[path = "common/json.rs"]
#[allow(dead_code)]
mod json;

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentstore::backend::couchdb::{CouchConfig, CouchDbBackend, INDEX_NAME};
use agentstore::backend::{BulkWrite, DocumentBackend, Precondition, Projection, Query, Revision};
use agentstore::model::id::encode_key;
use agentstore::store::{DataStore, StoreOptions};
use agentstore::ErrorKind;
use serde_json::{json, Map, Value};
use wiremock::matchers::{body_partial_json, header, method, query_param, query_param_is_missing};
use wiremock::{Match, Mock, MockBuilder, MockServer, Request, Respond, ResponseTemplate};

/// The database the transcripts were recorded on.
const DB: &str = "agent_data_store";
/// `Basic` credentials of admin:password, the transcripts' `Basic <admin:password>`.
const BASIC_ADMIN: &str = "Basic YWRtaW46cGFzc3dvcmQ=";
/// The design document CouchDB 3.4.3 created for `idx-user-namespace` (010/011).
const INDEX_DDOC: &str = "_design/6b616e35af647bddcf8e10c3787b8f7ef20b3545";
/// The seed example's document (013–023).
const GREETING_ID: &str = "user_123:default:Z3JlZXRpbmc=";
const GREETING_REV_1: &str = "1-1ea410be77d7d321ddb3d11183608911";
const GREETING_REV_2: &str = "2-47c8d6274f4b40cbbec48d4d8b0b9450";

// ---------------------------------------------------------------------------------------------
// Transcripts → wiremock
// ---------------------------------------------------------------------------------------------

/// One recorded request to CouchDB 3.4.3 and its response.
#[derive(Debug, Clone)]
struct Transcript {
    file: String,
    method: String,
    /// The request path without its query, as recorded (percent-encoded or not).
    path: String,
    query: Vec<(String, String)>,
    /// The `Authorization` header sent, with `<admin:password>` replaced by the real encoding.
    authorization: Option<String>,
    request_body: Value,
    status: u16,
    response_headers: Vec<(String, String)>,
    response_body: Value,
}

fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures").join("couchdb-3.4.3")
}

fn transcript_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .expect("fixtures/couchdb-3.4.3 is readable")
        .map(|entry| entry.expect("directory entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "json"))
        .collect();
    files.sort();
    files
}

/// The transcript whose file name starts with the three-digit `number`.
fn transcript(number: u32) -> Transcript {
    let prefix = format!("{number:03}-");
    let file = transcript_files()
        .into_iter()
        .find(|path| path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(&prefix)))
        .unwrap_or_else(|| panic!("no transcript {prefix}*.json in {}", fixtures_dir().display()));
    Transcript::load(&file)
}

impl Transcript {
    fn load(file: &std::path::Path) -> Transcript {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("read {name}: {e}"));
        let raw: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {name}: {e}"));
        let request = &raw["request"];
        let response = &raw["response"];
        let full_path = request["path"].as_str().unwrap_or_else(|| panic!("{name}: no request.path"));
        let (path, query) = match full_path.split_once('?') {
            Some((path, query)) => (
                path.to_owned(),
                url::form_urlencoded::parse(query.as_bytes()).map(|(k, v)| (k.into_owned(), v.into_owned())).collect(),
            ),
            None => (full_path.to_owned(), Vec::new()),
        };
        let authorization = request["headers"]
            .as_object()
            .and_then(|h| h.iter().find(|(k, _)| k.eq_ignore_ascii_case("authorization")))
            .and_then(|(_, v)| v.as_str())
            .map(|v| if v == "Basic <admin:password>" { BASIC_ADMIN.to_owned() } else { v.to_owned() });
        let response_headers = response["headers"]
            .as_object()
            .map(|h| h.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned())).collect())
            .unwrap_or_default();
        Transcript {
            method: request["method"].as_str().unwrap_or_else(|| panic!("{name}: no method")).to_owned(),
            path,
            query,
            authorization,
            request_body: request["body"].clone(),
            status: response["status"].as_u64().unwrap_or_else(|| panic!("{name}: no status")) as u16,
            response_headers,
            response_body: response["body"].clone(),
            file: name,
        }
    }

    /// The recorded response: status, headers (Content-Type included) and body.
    fn response(&self) -> ResponseTemplate {
        self.response_with_body(&self.response_body)
    }

    /// The recorded status and headers with another body (for synthesised documents).
    fn response_with_body(&self, body: &Value) -> ResponseTemplate {
        let mut template = ResponseTemplate::new(self.status);
        let mut content_type = "application/json".to_owned();
        for (name, value) in &self.response_headers {
            match name.to_ascii_lowercase().as_str() {
                // Framing of the recorded connection, not of this body: hyper sets its own.
                "transfer-encoding" | "content-length" => {}
                "content-type" => content_type = value.clone(),
                _ => template = template.insert_header(name.as_str(), value.as_str()),
            }
        }
        if body.is_null() {
            template.insert_header("content-type", content_type.as_str())
        } else {
            template.set_body_raw(serde_json::to_vec(body).expect("serialise a transcript body"), &content_type)
        }
    }

    /// A mock matching the recorded method, path (percent-decoded), query and credentials.
    fn mock(&self) -> MockBuilder {
        let mut builder = Mock::given(method(self.method.as_str())).and(DecodedPath::new(&self.path));
        for (name, value) in &self.query {
            builder = builder.and(query_param(name.as_str(), value.as_str()));
        }
        match &self.authorization {
            Some(authorization) => builder.and(header("authorization", authorization.as_str())),
            None => builder.and(NoHeader("authorization")),
        }
    }

    /// [`Transcript::mock`] that also requires the recorded JSON body (as a subset of the sent one).
    fn mock_with_body(&self) -> MockBuilder {
        self.mock_with_partial_body(self.request_body.clone())
    }

    /// [`Transcript::mock`] that also requires `partial` to be a subset of the sent JSON body.
    fn mock_with_partial_body(&self, partial: Value) -> MockBuilder {
        assert!(!partial.is_null(), "{}: no request body to match", self.file);
        self.mock().and(body_partial_json(partial))
    }

    /// Mounts the transcript: recorded request → recorded response.
    async fn mount(&self, server: &MockServer) {
        self.mock().respond_with(self.response()).named(self.file.clone()).mount(server).await;
    }
}

fn percent_decoded(text: &str) -> String {
    percent_encoding::percent_decode_str(text).decode_utf8_lossy().into_owned()
}

/// Matches the request path after percent-decoding both sides.
///
/// wiremock's own `path` matcher compares `Url::path()`, which is the path as sent, still
/// percent-encoded: `path("/agent_data_store/user_123:default:Z3JlZXRpbmc=")` does NOT match the
/// `/agent_data_store/user_123%3Adefault%3AZ3JlZXRpbmc%3D` the adapter sends (it escapes every
/// reserved character of an id), while the transcripts record ids raw (013–023) or encoded (018).
/// CouchDB decodes the path before looking the id up, so compare decoded paths, as it does.
struct DecodedPath(String);

impl DecodedPath {
    fn new(path: &str) -> Self {
        DecodedPath(percent_decoded(path))
    }
}

impl Match for DecodedPath {
    fn matches(&self, request: &Request) -> bool {
        percent_decoded(request.url.path()) == self.0
    }
}

/// Matches requests that do not carry the header (007: no credentials).
struct NoHeader(&'static str);

impl Match for NoHeader {
    fn matches(&self, request: &Request) -> bool {
        !request.headers.contains_key(self.0)
    }
}

/// Matches requests whose JSON body is an object without `key` (a `_find` without a bookmark, or
/// without a limit).
struct BodyLacks(&'static str);

impl Match for BodyLacks {
    fn matches(&self, request: &Request) -> bool {
        serde_json::from_slice::<Value>(&request.body).is_ok_and(|body| body.is_object() && body.get(self.0).is_none())
    }
}

/// Matches requests whose JSON body has the top-level `key`.
struct BodyHas(&'static str);

impl Match for BodyHas {
    fn matches(&self, request: &Request) -> bool {
        serde_json::from_slice::<Value>(&request.body).is_ok_and(|body| body.get(self.0).is_some())
    }
}

/// Matches every request to a document of the database (not `_find`, `_index`, …).
struct AnyDocumentPath;

impl Match for AnyDocumentPath {
    fn matches(&self, request: &Request) -> bool {
        percent_decoded(request.url.path()).strip_prefix(&format!("/{DB}/")).is_some_and(|id| !id.starts_with('_'))
    }
}

// ---------------------------------------------------------------------------------------------
// Opening the backend and looking at what it sent
// ---------------------------------------------------------------------------------------------

/// `couchdb+http://[credentials@]127.0.0.1:PORT/{database}{suffix}` for the mock server.
fn backend_url(server: &MockServer, credentials: Option<&str>, database: &str, suffix: &str) -> String {
    let uri = server.uri();
    let authority = uri.strip_prefix("http://").expect("wiremock serves plain http");
    let credentials = credentials.map(|c| format!("{c}@")).unwrap_or_default();
    format!("couchdb+http://{credentials}{authority}/{database}{suffix}")
}

fn config(server: &MockServer) -> CouchConfig {
    CouchConfig::parse(&backend_url(server, Some("admin:password"), DB, "")).expect("valid backend URL")
}

/// Mounts 005 (the database exists) and opens the backend as admin:password.
async fn open_backend(server: &MockServer) -> Arc<CouchDbBackend> {
    transcript(5).mount(server).await;
    Arc::new(CouchDbBackend::open(&config(server)).await.expect("open the backend"))
}

/// Mounts 005, 010 for the first `POST /_index` (`created`) and 011 for the next ones (`exists`).
async fn mount_startup(server: &MockServer) {
    transcript(5).mount(server).await;
    let created = transcript(10);
    created.mock_with_body().respond_with(created.response()).up_to_n_times(1).named(created.file).mount(server).await;
    let exists = transcript(11);
    exists.mock_with_body().respond_with(exists.response()).named(exists.file).mount(server).await;
}

/// The backend and a facade over it, started as the service starts (index ensured).
async fn open_store(server: &MockServer, options: StoreOptions) -> (Arc<CouchDbBackend>, DataStore) {
    mount_startup(server).await;
    let backend = Arc::new(CouchDbBackend::open(&config(server)).await.expect("open the backend"));
    let store = DataStore::open(Arc::clone(&backend) as Arc<dyn DocumentBackend>, options).await.expect("open store");
    (backend, store)
}

fn page_size(n: usize) -> StoreOptions {
    StoreOptions { page_size: n, ..StoreOptions::default() }
}

async fn received(server: &MockServer) -> Vec<Request> {
    server.received_requests().await.expect("wiremock records requests")
}

fn path_of(request: &Request) -> String {
    percent_decoded(request.url.path())
}

fn is(request: &Request, verb: &str, path: &str) -> bool {
    request.method.as_str() == verb && path_of(request) == path
}

fn count(requests: &[Request], verb: &str, path: &str) -> usize {
    requests.iter().filter(|r| is(r, verb, path)).count()
}

fn json_body(request: &Request) -> Value {
    serde_json::from_slice(&request.body)
        .unwrap_or_else(|e| panic!("{} {}: body is not JSON: {e}", request.method, request.url))
}

/// The JSON bodies of every `POST /{db}/_find`, in order.
fn find_bodies(requests: &[Request]) -> Vec<Value> {
    requests.iter().filter(|r| is(r, "POST", &format!("/{DB}/_find"))).map(json_body).collect()
}

/// Every request carried admin:password as basic auth.
fn assert_all_authorized(requests: &[Request]) {
    assert!(!requests.is_empty(), "no request reached the mock server");
    for request in requests {
        let sent = request.headers.get("authorization").and_then(|v| v.to_str().ok());
        assert_eq!(sent, Some(BASIC_ADMIN), "{} {} without admin:password basic auth", request.method, request.url);
    }
}

/// Every `_find` body sent names a numeric `limit` (CouchDB stops at 25 without one, see 026).
fn assert_every_find_has_a_limit(requests: &[Request]) {
    for body in find_bodies(requests) {
        assert!(body["limit"].as_u64().is_some_and(|l| l > 0), "_find without a positive limit: {body}");
    }
}

// ---------------------------------------------------------------------------------------------
// Documents the transcripts imply
// ---------------------------------------------------------------------------------------------

/// Revisions CouchDB gave the documents created by 024 and 025, by id.
fn recorded_revisions() -> HashMap<String, String> {
    let mut revs = HashMap::new();
    for number in [24, 25] {
        for result in transcript(number).response_body.as_array().expect("_bulk_docs answers an array") {
            if let (Some(id), Some(rev)) = (result["id"].as_str(), result["rev"].as_str()) {
                revs.insert(id.to_owned(), rev.to_owned());
            }
        }
    }
    revs
}

fn document_id(user: &str, namespace: &str, key: &str) -> String {
    format!("{user}:{namespace}:{}", encode_key(key))
}

/// A recorded `_find` answer with `_id` and `_rev` added to every doc.
///
/// The transcripts' `_find` requests asked for `fields: ["key"]` only, so their docs hold just
/// `key`; the adapter always asks for `_id` and `_rev` too (it needs them, and errors without
/// them). They are synthesised here: `_id` from the key by the spec's id scheme, `_rev` from the
/// revision CouchDB returned when 024/025 created that document.
fn with_ids_and_revs(body: &Value, user: &str, namespace: &str) -> Value {
    let revs = recorded_revisions();
    let mut body = body.clone();
    for doc in body["docs"].as_array_mut().expect("_find answers docs") {
        let key = doc["key"].as_str().expect("docs of the listing transcripts have a key").to_owned();
        let id = document_id(user, namespace, &key);
        let rev = revs.get(&id).unwrap_or_else(|| panic!("no recorded revision for {id}")).clone();
        let doc = doc.as_object_mut().expect("doc is an object");
        doc.insert("_id".into(), id.into());
        doc.insert("_rev".into(), rev.into());
    }
    body
}

/// The keys in a recorded `_find` page.
fn keys_of(t: &Transcript) -> Vec<String> {
    t.response_body["docs"].as_array().unwrap().iter().map(|d| d["key"].as_str().unwrap().to_owned()).collect()
}

fn bookmark_of(t: &Transcript) -> String {
    t.response_body["bookmark"].as_str().expect("page has a bookmark").to_owned()
}

/// `value` without the top-level `key`.
fn without(value: &Value, key: &str) -> Value {
    let mut value = value.clone();
    value.as_object_mut().expect("an object").remove(key);
    value
}

/// A recorded request body as a backend write body: everything but `_id` and `_rev`.
fn write_body(t: &Transcript) -> Map<String, Value> {
    let mut body = t.request_body.as_object().expect("request body is an object").clone();
    body.remove("_id");
    body.remove("_rev");
    body
}

fn notes_query() -> Query {
    Query { user_id: "user_123".into(), namespace: Some("notes".into()), projection: Projection::Fields(vec!["key"]) }
}

fn page_token(bookmark: &str) -> String {
    json!({ "bookmark": bookmark }).to_string()
}

// ---------------------------------------------------------------------------------------------
// The helper itself
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_transcript_loads_and_replays_by_raw_or_encoded_path() {
    let files = transcript_files();
    assert_eq!(files.len(), 54, "INDEX.md lists 54 transcripts");
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

// ---------------------------------------------------------------------------------------------
// _find: the default limit, bookmarks, bad requests
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn find_always_sends_a_limit() {
    let server = MockServer::start().await;
    let (backend, store) = open_store(&server, page_size(100)).await;
    // What real CouchDB does: without a limit it stops at 25 (026)…
    let capped = transcript(26);
    capped
        .mock()
        .and(BodyLacks("limit"))
        .respond_with(capped.response_with_body(&with_ids_and_revs(&capped.response_body, "user_123", "notes")))
        .named("026 without limit")
        .mount(&server)
        .await;
    // …and with one it answers every match up to the limit: the 31 notes of 027–029.
    let mut all = Vec::new();
    for number in [27, 28, 29] {
        let page = with_ids_and_revs(&transcript(number).response_body, "user_123", "notes");
        all.extend(page["docs"].as_array().unwrap().iter().cloned());
    }
    let first = transcript(27);
    let everything = json!({ "docs": all, "bookmark": bookmark_of(&transcript(29)) });
    first
        .mock()
        .and(BodyHas("limit"))
        .respond_with(first.response_with_body(&everything))
        .named("all notes with a limit")
        .mount(&server)
        .await;

    let expected: Vec<String> = [27, 28, 29].into_iter().flat_map(|n| keys_of(&transcript(n))).collect();
    assert_eq!(expected.len(), 31);
    assert_eq!(store.list_keys("user_123", "notes").await.unwrap(), expected);
    assert_eq!(store.list_namespaces("user_123").await.unwrap(), vec!["notes".to_owned()]);
    assert_eq!(store.get_all("user_123", "notes").await.unwrap().len(), 31);
    for limit in [0, 1, 7] {
        backend.query(&notes_query(), limit, None).await.unwrap();
    }

    let requests = received(&server).await;
    let limits: Vec<Value> = find_bodies(&requests).iter().map(|b| b["limit"].clone()).collect();
    // list_keys and list_namespaces use the page size, get_all at most 100, query its own (≥ 1).
    assert_eq!(limits, vec![json!(100), json!(100), json!(100), json!(1), json!(1), json!(7)]);
    assert_every_find_has_a_limit(&requests);
    assert_all_authorized(&requests);
}

/// Mounts 027–030 as CouchDB answered them: each page for the bookmark its request carried.
async fn mount_recorded_pages(server: &MockServer, numbers: &[u32]) {
    for &number in numbers {
        let t = transcript(number);
        // Our fields differ from the recorded ones (we also ask for _id and _rev): match the rest.
        let partial = without(&t.request_body, "fields");
        let mut mock = t.mock_with_partial_body(partial);
        if t.request_body.get("bookmark").is_none() {
            mock = mock.and(BodyLacks("bookmark"));
        }
        let body = with_ids_and_revs(&t.response_body, "user_123", "notes");
        mock.respond_with(t.response_with_body(&body)).named(t.file.clone()).mount(server).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_keys_follows_bookmarks_and_stops_after_the_short_page() {
    let server = MockServer::start().await;
    let (_backend, store) = open_store(&server, page_size(12)).await;
    mount_recorded_pages(&server, &[27, 28, 29, 30]).await;

    let keys = store.list_keys("user_123", "notes").await.unwrap();
    // 027–029 hold 12 + 12 + 7 keys: note-000 … note-029 and note-new (created by 025).
    let expected: Vec<String> = [27, 28, 29].into_iter().flat_map(|n| keys_of(&transcript(n))).collect();
    assert_eq!(keys.len(), 31, "{keys:?}");
    assert_eq!(keys.iter().collect::<BTreeSet<_>>().len(), keys.len(), "a key came back twice: {keys:?}");
    assert_eq!(keys, expected);

    let requests = received(&server).await;
    let finds = find_bodies(&requests);
    assert_eq!(finds.len(), 3, "page 3 (029) had 7 < 12 docs, so no request for page 4: {finds:#?}");
    assert!(finds[0].get("bookmark").is_none(), "{}", finds[0]);
    assert_eq!(finds[1]["bookmark"], json!(bookmark_of(&transcript(27))));
    assert_eq!(finds[2]["bookmark"], json!(bookmark_of(&transcript(28))));
    for find in &finds {
        assert_eq!(find["limit"], json!(12));
        assert_eq!(find["selector"], json!({"userId": "user_123", "namespace": "notes"}));
        assert_eq!(find["use_index"], json!([INDEX_DDOC, INDEX_NAME]));
    }
    assert_all_authorized(&requests);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_keys_stops_at_the_empty_page_that_echoes_the_bookmark() {
    let server = MockServer::start().await;
    let (backend, store) = open_store(&server, page_size(12)).await;
    // Two full pages (027, 028), then — as 030 does after 029 — an empty page that echoes the
    // bookmark it was sent. Taking that bookmark as a next page would ask for the same page again.
    mount_recorded_pages(&server, &[27, 28]).await;
    let echo = transcript(30);
    let second = bookmark_of(&transcript(28));
    echo.mock_with_partial_body(json!({ "selector": echo.request_body["selector"], "bookmark": second }))
        .respond_with(echo.response_with_body(&json!({ "docs": [], "bookmark": second })))
        .named("empty page echoing 028's bookmark")
        .mount(&server)
        .await;

    let keys = store.list_keys("user_123", "notes").await.unwrap();
    let expected: Vec<String> = [27, 28].into_iter().flat_map(|n| keys_of(&transcript(n))).collect();
    assert_eq!(keys, expected);
    let finds = find_bodies(&received(&server).await);
    assert_eq!(finds.len(), 3, "{finds:#?}");
    assert_eq!(finds[2]["bookmark"], json!(second));

    // 030 itself, replayed verbatim at the backend level: no items, no next page.
    mount_recorded_pages(&server, &[30]).await;
    let page = backend.query(&notes_query(), 12, Some(&page_token(&bookmark_of(&transcript(29))))).await.unwrap();
    assert!(page.items.is_empty());
    assert_eq!(page.next, None);
    let requests = received(&server).await;
    assert_eq!(find_bodies(&requests).len(), 4);
    assert_all_authorized(&requests);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_bookmark_and_refused_finds_are_invalid_input() {
    let server = MockServer::start().await;
    let backend = open_backend(&server).await;
    let bad = transcript(35);
    bad.mock_with_body().respond_with(bad.response()).named(bad.file.clone()).mount(&server).await;
    let err = backend.query(&notes_query(), 12, Some(&page_token("not-a-bookmark"))).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains("invalid_bookmark"), "{err}");
    let requests = received(&server).await;
    assert_eq!(find_bodies(&requests).len(), 1, "a 400 is not retried");
    assert_every_find_has_a_limit(&requests);

    // A token this backend never produced is refused before anything is sent.
    let err = backend.query(&notes_query(), 12, Some("not json")).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert_eq!(find_bodies(&received(&server).await).len(), 1);
    assert_all_authorized(&received(&server).await);

    // 036–038: the adapter never sends such bodies, so their responses are replayed for any
    // _find; what matters is that a 400 maps to InvalidInput with CouchDB's reason, unretried.
    for (number, error) in [(36, "invalid_operator"), (37, "missing_required_key"), (38, "no_usable_index")] {
        let server = MockServer::start().await;
        let backend = open_backend(&server).await;
        let t = transcript(number);
        t.mock().respond_with(t.response()).named(t.file.clone()).mount(&server).await;
        let err = backend.query(&notes_query(), 12, None).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{number:03}: {err}");
        assert!(err.to_string().contains(error), "{number:03}: {err}");
        let requests = received(&server).await;
        assert_eq!(find_bodies(&requests).len(), 1, "{number:03}");
        assert_all_authorized(&requests);
    }
}

// ---------------------------------------------------------------------------------------------
// Documents: conflicts, missing, deleted
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// Numbers, sizes, availability
// ---------------------------------------------------------------------------------------------

const INT38: &str = "12345678901234567890123456789012345678";
const U64_MAX: &str = "18446744073709551615";
const BEYOND_DOUBLE: &str = "9007199254740993";
const SMALL: &str = "1e-07";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn big_numbers_keep_every_digit_both_ways() {
    let server = MockServer::start().await;
    let (backend, store) = open_store(&server, StoreOptions::default()).await;
    let id = document_id("user_123", "numbers", "big");
    // Written out by hand, as a real CouchDB stores and returns them (it keeps 38-digit integers
    // exactly); never parsed into serde_json before it is served.
    let raw = format!(
        r#"{{"_id":"{id}","_rev":"1-0123456789abcdef0123456789abcdef","userId":"user_123","namespace":"numbers","key":"big","value":{{"int38":{INT38},"u64max":{U64_MAX},"beyond_double":{BEYOND_DOUBLE},"small":{SMALL},"list":[{INT38},-{INT38},{SMALL}]}},"accessCount":1,"createdAt":"2026-02-05T10:00:00Z","updatedAt":"2026-02-05T10:00:00Z"}}"#
    );
    Mock::given(method("GET"))
        .and(DecodedPath::new(&format!("/{DB}/{id}")))
        .respond_with(ResponseTemplate::new(200).set_body_raw(raw.into_bytes(), "application/json"))
        .mount(&server)
        .await;
    let created = transcript(13);
    Mock::given(method("PUT")).and(AnyDocumentPath).respond_with(created.response()).mount(&server).await;
    let missing = transcript(20);
    Mock::given(method("GET")).and(AnyDocumentPath).respond_with(missing.response()).mount(&server).await;

    let doc = backend.get(&id).await.unwrap().expect("the document");
    let value = &doc.body["value"];
    assert_eq!(value["int38"].to_string(), INT38);
    assert_eq!(value["u64max"].to_string(), U64_MAX);
    assert_eq!(value["beyond_double"].to_string(), BEYOND_DOUBLE);
    assert_eq!(value["small"].to_string(), SMALL);
    assert_eq!(value["list"].to_string(), format!("[{INT38},-{INT38},{SMALL}]"));

    // Written back unchanged, the same digits go out.
    backend.put(&id, &doc.body, Precondition::MatchRevision(doc.rev.clone())).await.unwrap();
    // And through the facade, from a value parsed from text (as the HTTP layer parses it).
    let parsed: Value =
        serde_json::from_str(&format!(r#"{{"n":{INT38},"m":{U64_MAX},"d":{BEYOND_DOUBLE},"s":{SMALL}}}"#))
            .expect("a JSON value");
    store.set("user_123", "numbers", "fresh", parsed, None, None).await.unwrap();

    let requests = received(&server).await;
    let puts: Vec<String> = requests
        .iter()
        .filter(|r| r.method.as_str() == "PUT")
        .map(|r| String::from_utf8(r.body.clone()).expect("UTF-8 body"))
        .collect();
    assert_eq!(puts.len(), 2, "{puts:#?}");
    let expected = format!(
        r#""value":{{"int38":{INT38},"u64max":{U64_MAX},"beyond_double":{BEYOND_DOUBLE},"small":{SMALL},"list":[{INT38},-{INT38},{SMALL}]}}"#
    );
    assert!(puts[0].contains(&expected), "{}", puts[0]);
    let expected = format!(r#""value":{{"n":{INT38},"m":{U64_MAX},"d":{BEYOND_DOUBLE},"s":{SMALL}}}"#);
    assert!(puts[1].contains(&expected), "{}", puts[1]);
    assert_all_authorized(&requests);
}

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

// ---------------------------------------------------------------------------------------------
// Bulk writes, scans, namespace index caching
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// Numbers: how a real CouchDB 3.4.3 stored each number text, replayed
// ---------------------------------------------------------------------------------------------

/// One row of `fixtures/couchdb-numbers-3.4.3.json`: a document `{"v": <sent>}` was PUT to a real
/// CouchDB 3.4.3 and read back.
#[derive(Debug, Clone)]
struct NumberRow {
    sent: String,
    put_status: u16,
    put_response: Value,
    /// The number's text in the GET response; `None` when the PUT failed.
    stored_as: Option<String>,
}

fn number_rows() -> Vec<NumberRow> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures").join("couchdb-numbers-3.4.3.json");
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("numbers fixture"))
        .expect("numbers fixture is JSON");
    fixture["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .map(|row| NumberRow {
            sent: row["sent"].as_str().expect("sent").to_owned(),
            put_status: row["put_status"].as_u64().expect("put_status") as u16,
            put_response: row["put_response"].clone(),
            stored_as: row["stored_as"].as_str().map(str::to_owned),
        })
        .collect()
}

/// A stand-in CouchDB for documents whose `value.v` is one number: it stores (or refuses) that
/// number exactly as the recorded CouchDB 3.4.3 did for the same text. A number text the
/// recording does not cover is answered 500 and remembered, so the test fails: the adapter may
/// only send number texts whose fate on a real CouchDB is known.
struct RecordedNumbers {
    rows: HashMap<String, NumberRow>,
    docs: Mutex<HashMap<String, Value>>,
    unrecorded: Mutex<Vec<String>>,
}

impl RecordedNumbers {
    /// The recorded row for a number text, allowing only other spellings of the exponent marker
    /// (`E`/`e`, `+`/none), which the recording shows CouchDB treats alike (`1E2` and `1e+2` were
    /// both stored as `100.0`), and which serde_json itself changes (`1E2` is held as `1e+2`).
    fn row_for(&self, sent: &str) -> Option<&NumberRow> {
        let spelling = |text: &str| text.replace('E', "e").replace("e+", "e");
        self.rows.get(sent).or_else(|| self.rows.values().find(|row| spelling(&row.sent) == spelling(sent)))
    }
}

impl Respond for RecordedNumbers {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let path = percent_decoded(request.url.path());
        let id = path.strip_prefix(&format!("/{DB}/")).unwrap_or_default().to_owned();
        let json = |status: u16, body: Value| ResponseTemplate::new(status).set_body_json(body);
        match request.method.as_str() {
            "GET" => match self.docs.lock().unwrap().get(&id) {
                Some(doc) => json(200, doc.clone()),
                None => json(404, json!({"error": "not_found", "reason": "missing"})),
            },
            "PUT" => {
                let mut doc: Value = serde_json::from_slice(&request.body).expect("the adapter sends JSON");
                let sent = doc["value"]["v"].to_string();
                let Some(row) = self.row_for(&sent) else {
                    self.unrecorded.lock().unwrap().push(sent);
                    return json(500, json!({"error": "unrecorded_number", "reason": "not in the recording"}));
                };
                let Some(stored_as) = &row.stored_as else {
                    return json(row.put_status, row.put_response.clone());
                };
                doc["value"]["v"] = serde_json::from_str(stored_as).expect("a recorded number");
                doc["_rev"] = json!("1-00000000000000000000000000000001");
                self.docs.lock().unwrap().insert(id.clone(), doc);
                json(201, json!({"ok": true, "id": id, "rev": "1-00000000000000000000000000000001"}))
            }
            other => panic!("unexpected {other} {path}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn numbers_couchdb_would_alter_are_refused_never_acknowledged() {
    let server = MockServer::start().await;
    let (_backend, store) = open_store(&server, StoreOptions::default()).await;
    let rows = number_rows();
    assert_eq!(rows.len(), 36, "the recording has 36 number texts");
    let recorded = Arc::new(RecordedNumbers {
        rows: rows.iter().map(|row| (row.sent.clone(), row.clone())).collect(),
        docs: Mutex::default(),
        unrecorded: Mutex::default(),
    });
    Mock::given(AnyDocumentPath).respond_with(SharedResponder(Arc::clone(&recorded))).mount(&server).await;

    let mut accepted = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        let value: Value = serde_json::from_str(&format!("{{\"v\": {}}}", row.sent)).expect("a JSON number");
        let key = format!("n{i}");
        // What the recorded CouchDB keeps when sent this very text: the same value, or not.
        let couchdb_keeps_it = row.stored_as.as_deref().is_some_and(|stored| {
            json::exact_eq(&serde_json::from_str(stored).unwrap(), &serde_json::from_str(&row.sent).unwrap())
        });
        match store.set("user_123", "numbers", &key, value.clone(), None, None).await {
            Ok(written) => {
                let read = store.peek("user_123", "numbers", &key).await.unwrap().expect("stored");
                assert!(
                    json::exact_eq(&read.body["value"], &value) && json::exact_eq(&written.body["value"], &value),
                    "{}: acknowledged as {}, reads back as {}",
                    row.sent,
                    written.body["value"],
                    read.body["value"]
                );
                accepted.push(row.sent.clone());
            }
            Err(err) => {
                assert!(!couchdb_keeps_it, "{}: refused, though CouchDB stores it exactly: {err}", row.sent);
                assert_eq!(err.kind(), ErrorKind::InvalidInput, "{}: {err}", row.sent);
                assert!(err.to_string().starts_with("invalid value.v: the number"), "{}: {err}", row.sent);
                assert!(recorded.docs.lock().unwrap().get(&document_id("user_123", "numbers", &key)).is_none());
            }
        }
        if couchdb_keeps_it {
            assert!(accepted.contains(&row.sent), "{} is stored exactly by CouchDB and must be accepted", row.sent);
        }
    }
    assert_eq!(*recorded.unrecorded.lock().unwrap(), Vec::<String>::new(), "number texts CouchDB was never tried with");
    // The one number CouchDB misreads as written but reads exactly in another form.
    assert!(accepted.contains(&"5e-324".to_owned()), "accepted: {accepted:?}");
    let requests = received(&server).await;
    let sent_for_min_subnormal = requests
        .iter()
        .filter(|r| r.method.as_str() == "PUT")
        .map(|r| String::from_utf8_lossy(&r.body).into_owned())
        .find(|body| body.contains("4.9406564584124654e-324") && !body.contains("\"5e-324\""));
    assert!(sent_for_min_subnormal.is_some(), "5e-324 is sent as 4.9406564584124654e-324");
    assert_eq!(accepted.len(), 36 - 13, "accepted: {accepted:?}");
    // Nothing was written for a refused number: one PUT per accepted number, no more.
    assert_eq!(requests.iter().filter(|r| r.method.as_str() == "PUT").count(), accepted.len());
}

/// Lets one [`RecordedNumbers`] answer while the test still reads its state.
struct SharedResponder(Arc<RecordedNumbers>);

impl Respond for SharedResponder {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        self.0.respond(request)
    }
}

// ---------------------------------------------------------------------------------------------
// The document model: revisions, tombstones, the change feed, erasure
//
// Where no transcript was recorded (a tombstone read by revision, `_all_docs` with the key of a
// deleted document, a filtered `_changes`, `_purge`), the answers below are written by hand in
// the shape CouchDB 3.4.3 documents for them, with the revisions and sequence values of the
// recorded transcripts; each one says so.
// ---------------------------------------------------------------------------------------------

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
