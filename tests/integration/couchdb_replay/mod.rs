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
//!
//! This module holds the transcript loading and matching, opening the adapter against the mock
//! and looking at what it sent, and the documents the transcripts imply; each topic file opens
//! with what it covers.

mod bulk_and_scans;
mod document_model;
mod documents;
mod find;
mod numbers;
mod sizes_and_retries;
mod startup;

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

use crate::common::json::exact_eq;

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
