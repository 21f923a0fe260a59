//! The drop-in test: a database written by the existing system is served by our facade without
//! breaking it.
//!
//! Each test makes a new database on the local CouchDB-protocol server (`common::servers`), fills
//! it with plain HTTP the way the existing system would (the spec's three example documents as the
//! spec shows them, one document with fields we do not know, one in the earlier revision's shape
//! with its `_rev`, one minimal document of another user, the earlier revision's design document
//! `_design/data_store`, and, in one test, the Mango index as the spec's `curl` creates it). Then
//! it goes through `DataStore` over `CouchDbBackend`, and finally reads the raw documents back by
//! plain HTTP to check that they are still the existing system's documents: same ids, every field
//! kept, unknown fields untouched, `accessCount` raised by exactly our accesses, timestamps in the
//! spec's form, the design document byte-for-byte unchanged.
//!
//! A missing server fails these tests (with `servers::couchdb()`'s message); it never skips them.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use agentstore::backend::couchdb::{CouchConfig, CouchDbBackend, INDEX_NAME};
use agentstore::backend::DocumentBackend;
use agentstore::store::{DataStore, StoreOptions};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

use crate::common::json::first_difference;
use crate::common::servers;

/// The spec's three example documents, with their `_id`s.
const SPEC_EXAMPLES: &str = include_str!("../../fixtures/seed-documents.json");
/// The recorded PUT of the earlier revision's design document; its request body is what the
/// existing system wrote.
const LEGACY_DDOC_TRANSCRIPT: &str = include_str!("../../fixtures/couchdb-3.4.3/041-legacy-design-doc-put.json");
const LEGACY_DDOC_ID: &str = "_design/data_store";
/// The index definition exactly as the spec's `curl -d` sends it.
const SPEC_INDEX_REQUEST: &str = r#"{
"index": { "fields": ["userId", "namespace"] },
"name": "idx-user-namespace",
"type": "json"
}"#;

/// Every field name the spec's document schema has.
const SPEC_FIELDS: [&str; 13] = [
    "_id",
    "_rev",
    "userId",
    "namespace",
    "key",
    "value",
    "metadata",
    "createdByAgent",
    "lastAccessedByAgent",
    "accessCount",
    "createdAt",
    "updatedAt",
    "lastAccessedAt",
];

/// What our reads record as the accessing agent.
const READER: &str = "dropin-reader";
/// What our writes record as the accessing agent.
const WRITER: &str = "dropin-writer";

/// Path-segment escaping: everything but RFC 3986 unreserved characters.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

static DATABASES: AtomicUsize = AtomicUsize::new(0);

// ---------------------------------------------------------------------------------------------
// The existing system: plain HTTP.
// ---------------------------------------------------------------------------------------------

/// Plain HTTP to one database, always with basic auth (pouchdb-server crashes on an
/// unauthenticated `PUT /db`).
struct RawCouch {
    http: reqwest::Client,
    /// `http://host:port` without credentials.
    base: String,
    user: String,
    password: String,
    database: String,
    /// `http://admin:password@host:port` as the server helper gives it.
    server_url: String,
}

impl RawCouch {
    /// A new, uniquely named (not yet created) database on the test server.
    fn new(tag: &str) -> RawCouch {
        let server = servers::couchdb().unwrap_or_else(|message| panic!("{message}"));
        let url = reqwest::Url::parse(&server.url).unwrap_or_else(|e| panic!("server URL {:?}: {e}", server.url));
        let decode = |s: &str| percent_encoding::percent_decode_str(s).decode_utf8_lossy().into_owned();
        let user = if url.username().is_empty() { "admin".to_owned() } else { decode(url.username()) };
        let password = url.password().map(decode).unwrap_or_else(|| "password".to_owned());
        let base = format!(
            "{}://{}{}",
            url.scheme(),
            url.host_str().expect("server host"),
            url.port().map(|p| format!(":{p}")).unwrap_or_default()
        );
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let database = format!(
            "dropin_{tag}_{}_{}_{}",
            std::process::id(),
            DATABASES.fetch_add(1, Ordering::Relaxed),
            nanos % 1_000_000_000
        );
        RawCouch {
            http: reqwest::Client::new(),
            base,
            user,
            password,
            database,
            server_url: server.url.trim_end_matches('/').to_owned(),
        }
    }

    /// The backend URL our adapter is opened with (no `create=true`: the database exists).
    fn adapter_url(&self) -> String {
        format!("couchdb+{}/{}", self.server_url, self.database)
    }

    fn doc_url(&self, id: &str) -> String {
        let path = match id.strip_prefix("_design/") {
            Some(name) => format!("_design/{}", utf8_percent_encode(name, SEGMENT)),
            None => utf8_percent_encode(id, SEGMENT).to_string(),
        };
        format!("{}/{}/{path}", self.base, self.database)
    }

    fn db_url(&self, rest: &str) -> String {
        format!("{}/{}{rest}", self.base, self.database)
    }

    /// One authenticated request; the status and the raw body bytes.
    async fn request(&self, method: Method, url: &str, body: Option<Vec<u8>>) -> (StatusCode, Vec<u8>) {
        let mut request = self
            .http
            .request(method.clone(), url)
            .basic_auth(&self.user, Some(&self.password))
            .header("Accept", "application/json");
        if let Some(body) = body {
            request = request.header("Content-Type", "application/json").body(body);
        }
        let response = request.send().await.unwrap_or_else(|e| panic!("{method} {url}: {e}"));
        let status = response.status();
        let bytes = response.bytes().await.unwrap_or_else(|e| panic!("{method} {url}: body: {e}"));
        (status, bytes.to_vec())
    }

    async fn request_json(&self, method: Method, url: &str, body: Option<Vec<u8>>) -> (StatusCode, Value) {
        let (status, bytes) = self.request(method.clone(), url, body).await;
        let value = serde_json::from_slice(&bytes)
            .unwrap_or_else(|e| panic!("{method} {url}: not JSON ({e}): {}", String::from_utf8_lossy(&bytes)));
        (status, value)
    }

    async fn create_database(&self) {
        let (status, body) = self.request_json(Method::PUT, &self.db_url(""), None).await;
        assert_eq!(status, StatusCode::CREATED, "PUT /{}: {body}", self.database);
    }

    async fn delete_database(&self) {
        let (status, body) = self.request_json(Method::DELETE, &self.db_url(""), None).await;
        assert!(status.is_success(), "DELETE /{}: {status} {body}", self.database);
    }

    /// PUTs a document as given (it carries its `_id`); returns the new `_rev`.
    async fn put(&self, doc: &Value) -> String {
        let id = doc["_id"].as_str().expect("document _id");
        let bytes = serde_json::to_vec(doc).unwrap();
        let (status, body) = self.request_json(Method::PUT, &self.doc_url(id), Some(bytes)).await;
        assert_eq!(status, StatusCode::CREATED, "PUT {id}: {body}");
        body["rev"].as_str().expect("rev").to_owned()
    }

    /// Stores a document with the `_rev` it already carries (as replication does), so a document
    /// of the earlier revision keeps exactly the `_rev` the spec shows.
    async fn put_keeping_rev(&self, doc: &Value) {
        let request = serde_json::to_vec(&json!({ "new_edits": false, "docs": [doc] })).unwrap();
        let (status, body) = self.request_json(Method::POST, &self.db_url("/_bulk_docs"), Some(request)).await;
        assert_eq!(status, StatusCode::CREATED, "_bulk_docs new_edits=false: {body}");
        let stored = self.get(doc["_id"].as_str().unwrap()).await.expect("stored");
        assert_eq!(stored["_rev"], doc["_rev"]);
    }

    /// The raw response bytes of `GET /db/id` (200 expected).
    async fn get_bytes(&self, id: &str) -> Vec<u8> {
        let (status, bytes) = self.request(Method::GET, &self.doc_url(id), None).await;
        assert_eq!(status, StatusCode::OK, "GET {id}: {}", String::from_utf8_lossy(&bytes));
        bytes
    }

    /// The document, or `None` on 404.
    async fn get(&self, id: &str) -> Option<Value> {
        let (status, body) = self.request_json(Method::GET, &self.doc_url(id), None).await;
        match status {
            StatusCode::OK => Some(body),
            StatusCode::NOT_FOUND => None,
            other => panic!("GET {id}: {other} {body}"),
        }
    }

    /// `POST /db/_index` with the spec's JSON, as the existing system (or its operator) does.
    async fn create_spec_index(&self) {
        let url = self.db_url("/_index");
        let (status, body) = self.request_json(Method::POST, &url, Some(SPEC_INDEX_REQUEST.as_bytes().to_vec())).await;
        assert_eq!(status, StatusCode::OK, "POST /_index: {body}");
        assert_eq!(body["result"], "created", "{body}");
        assert_eq!(body["name"], INDEX_NAME, "{body}");
    }

    /// The `indexes` array of `GET /db/_index`.
    async fn indexes(&self) -> Vec<Value> {
        let (status, body) = self.request_json(Method::GET, &self.db_url("/_index"), None).await;
        assert_eq!(status, StatusCode::OK, "GET /_index: {body}");
        body["indexes"].as_array().unwrap_or_else(|| panic!("GET /_index without indexes: {body}")).clone()
    }

    /// Every id in `_all_docs`, design documents included.
    async fn all_ids(&self) -> Vec<String> {
        let (status, body) = self.request_json(Method::GET, &self.db_url("/_all_docs"), None).await;
        assert_eq!(status, StatusCode::OK, "GET /_all_docs: {body}");
        body["rows"].as_array().expect("rows").iter().map(|row| row["id"].as_str().unwrap().to_owned()).collect()
    }
}

/// The entries of `GET /_index` named `idx-user-namespace`.
fn spec_indexes(indexes: &[Value]) -> Vec<&Value> {
    indexes.iter().filter(|index| index["name"] == INDEX_NAME).collect()
}

/// Asserts `GET /_index` lists `idx-user-namespace` once, as a json index over userId, namespace,
/// and returns its design document's id.
async fn assert_spec_index(couch: &RawCouch, when: &str) -> String {
    let indexes = couch.indexes().await;
    let found = spec_indexes(&indexes);
    assert_eq!(found.len(), 1, "{when}: expected exactly one {INDEX_NAME} in GET /_index: {indexes:?}");
    let index = found[0];
    assert_eq!(index["type"], "json", "{when}: {index}");
    assert_eq!(index["def"]["fields"], json!([{"userId": "asc"}, {"namespace": "asc"}]), "{when}: {index}");
    let ddoc = index["ddoc"].as_str().unwrap_or_else(|| panic!("{when}: index without ddoc: {index}"));
    assert!(ddoc.starts_with("_design/"), "{when}: {index}");
    ddoc.to_owned()
}

// ---------------------------------------------------------------------------------------------
// The existing system's data.
// ---------------------------------------------------------------------------------------------

/// One document the existing system wrote, as it wrote it.
struct Seed {
    doc: Value,
    user: &'static str,
    namespace: &'static str,
    key: &'static str,
}

impl Seed {
    fn id(&self) -> &str {
        self.doc["_id"].as_str().unwrap()
    }

    fn field(&self, name: &str) -> Option<&Value> {
        self.doc.get(name)
    }
}

const GREETING: &str = "user_123:default:Z3JlZXRpbmc=";
const MAIN_PY: &str = "user_123:files:my-repo:c3JjL21haW4ucHk=";
const REPOS: &str = "user_123:cache:github:cmVwb3M=";
/// The earlier revision's "Data Store Entry" example.
const MY_KEY: &str = "user_123:default:bXkta2V5";
/// A document carrying fields the spec does not name.
const NOTES: &str = "user_123:default:bm90ZXM=";
/// Another user's document with the required fields only.
const PROFILE: &str = "user_456:notes:cHJvZmlsZQ==";

fn seeds() -> Vec<Seed> {
    let examples: Vec<Value> = serde_json::from_str(SPEC_EXAMPLES).expect("seed-documents.json");
    let example = |id: &str| examples.iter().find(|d| d["_id"] == id).unwrap_or_else(|| panic!("{id}")).clone();
    vec![
        Seed { doc: example(GREETING), user: "user_123", namespace: "default", key: "greeting" },
        Seed { doc: example(MAIN_PY), user: "user_123", namespace: "files:my-repo", key: "src/main.py" },
        Seed { doc: example(REPOS), user: "user_123", namespace: "cache:github", key: "repos" },
        Seed {
            // The earlier revision's "Data Store Entry", with its `_rev` as shown.
            doc: json!({
                "_id": MY_KEY,
                "_rev": "1-abc123def456",
                "userId": "user_123",
                "namespace": "default",
                "key": "my-key",
                "value": {"result": "analysis complete", "score": 95, "items": ["a", "b", "c"]},
                "metadata": {"version": "1.0", "source": "analyzer-agent"},
                "createdByAgent": "data-processor",
                "lastAccessedByAgent": "report-generator",
                "accessCount": 5,
                "createdAt": "2026-02-01T10:30:00Z",
                "updatedAt": "2026-02-05T14:22:00Z",
                "lastAccessedAt": "2026-02-05T14:22:00Z"
            }),
            user: "user_123",
            namespace: "default",
            key: "my-key",
        },
        Seed {
            doc: json!({
                "_id": NOTES,
                "userId": "user_123",
                "namespace": "default",
                "key": "notes",
                "value": {"text": "remember the milk", "tags": ["errand"]},
                "metadata": {"version": "1.0", "author": "alice"},
                "createdByAgent": "note-taker",
                "accessCount": 2,
                "createdAt": "2026-02-03T08:00:00Z",
                "updatedAt": "2026-02-04T08:00:00Z",
                "lastAccessedAt": "2026-02-04T08:00:00Z",
                "x_legacyOwner": {"team": "core", "ids": [1, 2.5, "three", null, true]},
                "schemaVersion": 1,
                "tags": []
            }),
            user: "user_123",
            namespace: "default",
            key: "notes",
        },
        Seed {
            doc: json!({
                "_id": PROFILE,
                "userId": "user_456",
                "namespace": "notes",
                "key": "profile",
                "value": {"lang": "en"},
                "createdAt": "2026-01-15T07:45:00Z",
                "updatedAt": "2026-01-15T07:45:00Z"
            }),
            user: "user_456",
            namespace: "notes",
            key: "profile",
        },
    ]
}

/// Writes every seed, the legacy design document and (if asked) the spec's index, by plain HTTP.
async fn populate(couch: &RawCouch, seeds: &[Seed], with_index: bool) {
    couch.create_database().await;
    for seed in seeds {
        if seed.field("_rev").is_some() {
            couch.put_keeping_rev(&seed.doc).await;
        } else {
            couch.put(&seed.doc).await;
        }
    }
    couch.put(&legacy_design_doc()).await;
    if with_index {
        couch.create_spec_index().await;
    }
}

fn legacy_design_doc() -> Value {
    let transcript: Value = serde_json::from_str(LEGACY_DDOC_TRANSCRIPT).expect("041 transcript");
    let body = transcript["request"]["body"].clone();
    assert_eq!(body["_id"], LEGACY_DDOC_ID);
    assert!(body["views"]["by_user_namespace"]["map"].is_string() && body["views"]["by_user"]["map"].is_string());
    body
}

/// The design document as the server returns it, raw and parsed.
struct DesignDocSnapshot {
    bytes: Vec<u8>,
    doc: Value,
}

async fn snapshot_design_doc(couch: &RawCouch) -> DesignDocSnapshot {
    let bytes = couch.get_bytes(LEGACY_DDOC_ID).await;
    let doc: Value = serde_json::from_slice(&bytes).expect("design doc JSON");
    let mut without_rev = doc.clone();
    without_rev.as_object_mut().unwrap().remove("_rev");
    assert!(
        first_difference(&legacy_design_doc(), &without_rev).is_none(),
        "the legacy design document was not stored as written: {doc}"
    );
    DesignDocSnapshot { bytes, doc }
}

async fn assert_design_doc_unchanged(couch: &RawCouch, before: &DesignDocSnapshot, when: &str) {
    let after = couch.get_bytes(LEGACY_DDOC_ID).await;
    let doc: Value = serde_json::from_slice(&after).expect("design doc JSON");
    assert_eq!(doc["_rev"], before.doc["_rev"], "{when}: {LEGACY_DDOC_ID} got a new revision: {doc}");
    assert!(
        after == before.bytes,
        "{when}: {LEGACY_DDOC_ID} changed:\nbefore {}\nafter  {}",
        String::from_utf8_lossy(&before.bytes),
        String::from_utf8_lossy(&after)
    );
}

// ---------------------------------------------------------------------------------------------
// Checks on raw documents.
// ---------------------------------------------------------------------------------------------

/// `YYYY-MM-DDTHH:MM:SSZ`, and a real date.
fn assert_spec_timestamp(id: &str, field: &str, value: Option<&Value>) {
    let text = value.and_then(Value::as_str).unwrap_or_else(|| panic!("{id}: {field} missing or not a string"));
    let bytes = text.as_bytes();
    let shape_ok = bytes.len() == 20
        && bytes.iter().enumerate().all(|(i, c)| match i {
            4 | 7 => *c == b'-',
            10 => *c == b'T',
            13 | 16 => *c == b':',
            19 => *c == b'Z',
            _ => c.is_ascii_digit(),
        });
    assert!(shape_ok, "{id}: {field} = {text:?} is not YYYY-MM-DDTHH:MM:SSZ");
    agentstore::model::timestamp::parse(text).unwrap_or_else(|e| panic!("{id}: {field} = {text:?}: {e}"));
}

/// A revision's generation (`3-abc` → 3).
fn generation(rev: &Value) -> u64 {
    let rev = rev.as_str().unwrap_or_else(|| panic!("_rev {rev} is not a string"));
    rev.split_once('-').and_then(|(n, _)| n.parse().ok()).unwrap_or_else(|| panic!("_rev {rev:?} has no generation"))
}

fn assert_exact(what: &str, expected: &Value, actual: &Value) {
    if let Some(diff) = first_difference(expected, actual) {
        panic!("{what}: {diff}\nexpected {expected}\nactual   {actual}");
    }
}

/// What our facade did to one seed document.
#[derive(Default, Clone)]
struct Touched {
    /// Facade accesses (each `get` and `set`).
    accesses: u64,
    /// The value and merged metadata our last `set` wrote, if any.
    set: Option<(Value, Value)>,
    /// The agent of the last access.
    last_agent: Option<&'static str>,
}

/// Counts one facade access of `id` by `agent`.
fn touch(touched: &mut BTreeMap<String, Touched>, id: &str, agent: &'static str) {
    let t = touched.get_mut(id).unwrap_or_else(|| panic!("{id} is not a seed"));
    t.accesses += 1;
    t.last_agent = Some(agent);
}

/// The raw document after our facade used it: everything the existing system wrote is still
/// there; only the fields a data-store access or update changes have changed, and as the spec says.
fn check_seed_after(seed: &Seed, raw: &Value, touched: &Touched) {
    let id = seed.id();
    let raw_obj = raw.as_object().unwrap_or_else(|| panic!("{id}: not an object: {raw}"));
    assert_eq!(raw["_id"], id, "{id}: _id changed");

    // Only these may change, and only through our accesses.
    let mut may_change: BTreeSet<&str> = ["_rev", "accessCount", "lastAccessedAt", "lastAccessedByAgent"].into();
    if touched.set.is_some() {
        may_change.extend(["value", "metadata", "updatedAt"]);
    }
    for (field, written) in seed.doc.as_object().unwrap() {
        let now = raw_obj.get(field).unwrap_or_else(|| panic!("{id}: field {field} was removed: {raw}"));
        if !may_change.contains(field.as_str()) {
            assert_exact(&format!("{id}: field {field} changed"), written, now);
        }
    }
    // Fields we added are spec fields that access tracking writes; nothing of ours.
    for field in raw_obj.keys() {
        if seed.field(field).is_none() {
            assert!(
                ["_rev", "accessCount", "lastAccessedAt", "lastAccessedByAgent", "metadata"].contains(&field.as_str()),
                "{id}: field {field:?} was added: {raw}"
            );
        }
    }

    let written_count = seed.field("accessCount").map_or(0, |c| c.as_u64().expect("seed accessCount"));
    assert_eq!(
        raw["accessCount"].as_u64(),
        Some(written_count + touched.accesses),
        "{id}: accessCount should be {written_count} + {} facade accesses: {raw}",
        touched.accesses
    );
    // One write per access: nothing else rewrote the document.
    let written_generation = seed.field("_rev").map_or(1, generation);
    assert_eq!(generation(&raw["_rev"]), written_generation + touched.accesses, "{id}: _rev {}", raw["_rev"]);
    assert_eq!(raw["createdAt"], seed.doc["createdAt"], "{id}: createdAt changed");
    assert_spec_timestamp(id, "updatedAt", raw.get("updatedAt"));
    if touched.accesses > 0 {
        assert_spec_timestamp(id, "lastAccessedAt", raw.get("lastAccessedAt"));
        assert_eq!(raw["lastAccessedByAgent"].as_str(), touched.last_agent, "{id}: lastAccessedByAgent");
        assert!(
            raw["lastAccessedAt"].as_str() >= raw["updatedAt"].as_str(),
            "{id}: lastAccessedAt before updatedAt: {raw}"
        );
    }
    match &touched.set {
        Some((value, metadata)) => {
            assert_exact(&format!("{id}: value"), value, &raw["value"]);
            assert_exact(&format!("{id}: metadata"), metadata, &raw["metadata"]);
            assert_ne!(raw["updatedAt"], seed.doc["updatedAt"], "{id}: updatedAt not updated by set");
        }
        None => assert_eq!(raw["updatedAt"], seed.doc["updatedAt"], "{id}: updatedAt changed by reads"),
    }
}

/// A document our facade created has exactly the spec's field names.
fn check_created_shape(raw: &Value, expected_fields: &[&str]) {
    let id = raw["_id"].as_str().expect("_id");
    let names: BTreeSet<&str> = raw.as_object().unwrap().keys().map(String::as_str).collect();
    let expected: BTreeSet<&str> = expected_fields.iter().copied().collect();
    assert_eq!(names, expected, "{id}: raw fields of a document our facade created");
    assert!(names.iter().all(|n| SPEC_FIELDS.contains(n)), "{id}: a field outside the spec: {raw}");
    for field in ["createdAt", "updatedAt", "lastAccessedAt"] {
        assert_spec_timestamp(id, field, raw.get(field));
    }
    assert_eq!(raw["createdAt"], raw["updatedAt"], "{id}");
    assert_eq!(raw["accessCount"], json!(1), "{id}: creation is the first access");
    assert_eq!(generation(&raw["_rev"]), 1, "{id}");
}

/// Every document a full `scan` returns, following its pages.
async fn scan_all(backend: &dyn DocumentBackend, page_size: usize) -> Vec<String> {
    let mut ids = Vec::new();
    let mut token: Option<String> = None;
    for _ in 0..1000 {
        let page = backend.scan(page_size, token.as_deref()).await.expect("scan");
        assert!(page.items.len() <= page_size, "scan page of {} > {page_size}", page.items.len());
        ids.extend(page.items.into_iter().map(|doc| doc.id));
        match page.next {
            None => return ids,
            Some(next) => {
                assert_ne!(token.as_deref(), Some(next.as_str()), "scan returned the same token twice");
                token = Some(next);
            }
        }
    }
    panic!("scan with page size {page_size} did not finish in 1000 pages");
}

async fn open_store(couch: &RawCouch) -> (Arc<dyn DocumentBackend>, DataStore) {
    let config = CouchConfig::parse(&couch.adapter_url()).expect("CouchDB URL");
    let backend: Arc<dyn DocumentBackend> =
        Arc::new(CouchDbBackend::open(&config).await.unwrap_or_else(|e| panic!("CouchDbBackend::open: {e}")));
    let store = DataStore::open(Arc::clone(&backend), StoreOptions::default())
        .await
        .unwrap_or_else(|e| panic!("DataStore::open: {e}"));
    (backend, store)
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

// ---------------------------------------------------------------------------------------------
// The scenario.
// ---------------------------------------------------------------------------------------------

async fn drop_in(with_index: bool) {
    let couch = RawCouch::new(if with_index { "indexed" } else { "unindexed" });
    let seeds = seeds();
    populate(&couch, &seeds, with_index).await;
    let ddoc = snapshot_design_doc(&couch).await;
    let before = couch.indexes().await;
    let existing_index = if with_index {
        let ddoc = assert_spec_index(&couch, "as the existing system created it").await;
        Some((ddoc.clone(), couch.get_bytes(&ddoc).await))
    } else {
        assert!(spec_indexes(&before).is_empty(), "no index yet: {before:?}");
        None
    };

    // Startup ensures the index (and creates nothing else when it already exists).
    let (backend, store) = open_store(&couch).await;
    let index_ddoc = assert_spec_index(&couch, "after DataStore::open").await;
    let index_bytes = couch.get_bytes(&index_ddoc).await;
    if let Some((ddoc, bytes)) = &existing_index {
        assert_eq!(&index_ddoc, ddoc, "the existing index's design document was replaced");
        assert!(bytes == &index_bytes, "DataStore::open rewrote the existing index's design document {ddoc}");
    }
    let after_open = couch.indexes().await;
    assert_eq!(after_open.len(), before.len() + usize::from(!with_index), "indexes after open: {after_open:?}");
    assert_design_doc_unchanged(&couch, &ddoc, "after DataStore::open").await;

    let mut touched: BTreeMap<String, Touched> =
        seeds.iter().map(|s| (s.id().to_owned(), Touched::default())).collect();

    // get: every value exactly as written, every field there.
    for seed in &seeds {
        let doc = store
            .get(seed.user, seed.namespace, seed.key, Some(READER))
            .await
            .unwrap_or_else(|e| panic!("get {}: {e}", seed.id()))
            .unwrap_or_else(|| panic!("get {}: not found", seed.id()));
        touch(&mut touched, seed.id(), READER);
        assert_eq!(doc.id, seed.id());
        assert_exact(&format!("get {}: value", seed.id()), &seed.doc["value"], &doc.body["value"]);
        for (field, written) in seed.doc.as_object().unwrap() {
            if field.starts_with('_')
                || ["accessCount", "lastAccessedAt", "lastAccessedByAgent"].contains(&field.as_str())
            {
                continue;
            }
            assert_exact(&format!("get {}: {field}", seed.id()), written, &doc.body[field]);
        }
        let written_count = seed.field("accessCount").map_or(0, |c| c.as_u64().unwrap());
        assert_eq!(doc.body["accessCount"].as_u64(), Some(written_count + 1), "get {}: accessCount", seed.id());
    }

    // Listings, sorted, from the existing documents.
    assert_eq!(store.list_keys("user_123", "default").await.unwrap(), strings(&["greeting", "my-key", "notes"]));
    assert_eq!(store.list_keys("user_123", "files:my-repo").await.unwrap(), strings(&["src/main.py"]));
    assert_eq!(store.list_keys("user_123", "cache:github").await.unwrap(), strings(&["repos"]));
    assert_eq!(store.list_keys("user_456", "notes").await.unwrap(), strings(&["profile"]));
    assert!(store.list_keys("user_123", "notes").await.unwrap().is_empty());
    assert_eq!(
        store.list_namespaces("user_123").await.unwrap(),
        strings(&["cache:github", "default", "files:my-repo"])
    );
    assert_eq!(store.list_namespaces("user_456").await.unwrap(), strings(&["notes"]));
    assert!(store.list_namespaces("user_789").await.unwrap().is_empty());
    let seed_value = |id: &str| seeds.iter().find(|s| s.id() == id).unwrap().doc["value"].clone();
    let all = store.get_all("user_123", "default").await.unwrap();
    assert_exact(
        "get_all user_123/default",
        &json!({"greeting": seed_value(GREETING), "my-key": seed_value(MY_KEY), "notes": seed_value(NOTES)}),
        &Value::Object(all),
    );
    let all = store.get_all("user_123", "files:my-repo").await.unwrap();
    assert_exact("get_all files:my-repo", &json!({"src/main.py": seed_value(MAIN_PY)}), &Value::Object(all));
    let all = store.get_all("user_123", "cache:github").await.unwrap();
    assert_exact("get_all cache:github", &json!({"repos": seed_value(REPOS)}), &Value::Object(all));

    // set with metadata: the spec's merge example, on a document with unknown fields.
    let notes_value = json!({"text": "buy oat milk", "tags": ["errand", "today"]});
    let merged = json!({"version": "2.0", "author": "alice", "reviewer": "bob"});
    let written = store
        .set(
            "user_123",
            "default",
            "notes",
            notes_value.clone(),
            Some(json!({"version": "2.0", "reviewer": "bob"})),
            Some(WRITER),
        )
        .await
        .unwrap_or_else(|e| panic!("set notes: {e}"));
    touch(&mut touched, NOTES, WRITER);
    assert_eq!(written.id, NOTES);
    assert_exact("set notes: metadata", &merged, &written.body["metadata"]);
    touched.get_mut(NOTES).unwrap().set = Some((notes_value.clone(), merged.clone()));
    let again = store.get("user_123", "default", "notes", Some(READER)).await.unwrap().expect("notes");
    touch(&mut touched, NOTES, READER);
    assert_exact("get notes after set: value", &notes_value, &again.body["value"]);
    assert_exact("get notes after set: metadata", &merged, &again.body["metadata"]);
    assert_exact("get notes after set: unknown field", &seeds[4].doc["x_legacyOwner"], &again.body["x_legacyOwner"]);

    // set with metadata on a spec example: new keys added, the others kept.
    let main_value =
        json!({"content": "def main():\n    print('Hi')\n", "lines": 2, "language": "python", "functions": ["main"]});
    let written = store
        .set(
            "user_123",
            "files:my-repo",
            "src/main.py",
            main_value.clone(),
            Some(json!({"sha256": "def456...", "reviewed": true})),
            Some(WRITER),
        )
        .await
        .unwrap_or_else(|e| panic!("set src/main.py: {e}"));
    touch(&mut touched, MAIN_PY, WRITER);
    let main_metadata =
        json!({"indexed_at": "2026-02-05T09:00:00Z", "file_size": 42, "sha256": "def456...", "reviewed": true});
    assert_exact("set src/main.py: metadata", &main_metadata, &written.body["metadata"]);
    touched.get_mut(MAIN_PY).unwrap().set = Some((main_value, main_metadata));

    // Documents our facade creates beside the existing ones.
    const FRESH: &str = "user_123:default:ZnJlc2gta2V5";
    const BARE: &str = "user_123:files:my-repo:UkVBRE1FLm1k";
    let created = store
        .set("user_123", "default", "fresh-key", json!({"k": [1, 2]}), Some(json!({"source": "dropin"})), Some(WRITER))
        .await
        .unwrap();
    assert_eq!(created.id, FRESH);
    let created = store.set("user_123", "files:my-repo", "README.md", json!("# hi"), None, None).await.unwrap();
    assert_eq!(created.id, BARE);
    assert_eq!(
        store.list_keys("user_123", "default").await.unwrap(),
        strings(&["fresh-key", "greeting", "my-key", "notes"])
    );
    assert_eq!(store.list_keys("user_123", "files:my-repo").await.unwrap(), strings(&["README.md", "src/main.py"]));

    // The raw documents, read back as the existing system reads them.
    let mut after_use = BTreeMap::new();
    for seed in &seeds {
        let raw = couch.get(seed.id()).await.unwrap_or_else(|| panic!("{} is gone", seed.id()));
        check_seed_after(seed, &raw, &touched[seed.id()]);
        after_use.insert(seed.id().to_owned(), raw);
    }
    check_created_shape(&couch.get(FRESH).await.expect("fresh-key"), &SPEC_FIELDS);
    let bare = couch.get(BARE).await.expect("README.md");
    check_created_shape(
        &bare,
        &SPEC_FIELDS
            .into_iter()
            .filter(|f| !["metadata", "createdByAgent", "lastAccessedByAgent"].contains(f))
            .collect::<Vec<_>>(),
    );
    assert_eq!(bare["value"], "# hi");

    // The earlier revision's design document and the spec's index.
    assert_design_doc_unchanged(&couch, &ddoc, "after using the facade").await;
    assert_eq!(assert_spec_index(&couch, "after using the facade").await, index_ddoc);
    assert!(
        couch.get_bytes(&index_ddoc).await == index_bytes,
        "first writes to namespaces rewrote the index's design document {index_ddoc}"
    );

    // The trait's full scan returns the data documents only, on every page size.
    let mut expected: Vec<String> =
        seeds.iter().map(|s| s.id().to_owned()).chain([FRESH.into(), BARE.into()]).collect();
    expected.sort();
    let raw_ids = couch.all_ids().await;
    assert!(raw_ids.iter().filter(|id| id.starts_with("_design/")).count() >= 2, "{raw_ids:?}");
    for page_size in [1, 2, 3, 1000] {
        let mut scanned = scan_all(backend.as_ref(), page_size).await;
        assert!(scanned.iter().all(|id| !id.starts_with("_design/")), "scan returned a design document: {scanned:?}");
        scanned.sort();
        assert_eq!(scanned, expected, "scan with page size {page_size}");
    }

    // Erasing a user removes that user's documents only; design documents stay as they were.
    // Erasure purges (`_purge`): pouchdb-server has none, so there it must be refused with nothing
    // changed, and the user's namespaces are deleted instead to go on checking the rest (Apache
    // CouchDB's purge is covered by the replay tests).
    let server = servers::couchdb().unwrap_or_else(|message| panic!("{message}"));
    if server.exact_numbers {
        let purged = store.purge_user("user_123").await.unwrap();
        assert_eq!(purged, 7, "user_123 had 5 existing + 2 created documents");
    } else {
        let ids_before = couch.all_ids().await;
        let refused = store.purge_user("user_123").await.expect_err("erasure without _purge is refused");
        assert!(refused.to_string().contains("_purge"), "{refused}");
        assert_eq!(couch.all_ids().await, ids_before, "a refused erasure changed nothing");
        let mut deleted = 0;
        for namespace in store.list_namespaces("user_123").await.unwrap() {
            deleted += store.delete_namespace("user_123", &namespace).await.unwrap();
        }
        assert_eq!(deleted, 7, "user_123 had 5 existing + 2 created documents");
    }
    assert!(store.list_namespaces("user_123").await.unwrap().is_empty());
    for id in [GREETING, MAIN_PY, REPOS, MY_KEY, NOTES, FRESH, BARE] {
        assert!(couch.get(id).await.is_none(), "{id} survived purge_user");
    }
    assert_eq!(couch.get(PROFILE).await.as_ref(), after_use.get(PROFILE), "another user's document changed");
    assert_design_doc_unchanged(&couch, &ddoc, "after purge_user").await;
    assert_eq!(assert_spec_index(&couch, "after purge_user").await, index_ddoc);
    assert!(couch.get_bytes(&index_ddoc).await == index_bytes, "purge_user changed {index_ddoc}");
    let left = couch.all_ids().await;
    let design_before: Vec<&String> = raw_ids.iter().filter(|id| id.starts_with("_design/")).collect();
    let design_after: Vec<&String> = left.iter().filter(|id| id.starts_with("_design/")).collect();
    assert_eq!(design_after, design_before, "design documents after purge_user");
    assert_eq!(scan_all(backend.as_ref(), 2).await, strings(&[PROFILE]));

    couch.delete_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_in_on_a_database_with_the_existing_mango_index() {
    drop_in(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_in_on_a_database_without_the_mango_index_creates_it_at_startup() {
    drop_in(false).await;
}

/// The spec's examples written by our facade get exactly the spec's `_id`s and field names, and
/// read back through the existing system's plain HTTP as the spec shows them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documents_written_by_the_facade_are_the_spec_documents() {
    let couch = RawCouch::new("written");
    couch.create_database().await;
    couch.put(&legacy_design_doc()).await;
    let ddoc = snapshot_design_doc(&couch).await;
    let (_backend, store) = open_store(&couch).await;
    assert_spec_index(&couch, "after DataStore::open on an empty database").await;
    for seed in seeds().into_iter().take(3) {
        let agent = seed.doc["createdByAgent"].as_str().unwrap().to_owned();
        let metadata = seed.field("metadata").cloned();
        let written = store
            .set(seed.user, seed.namespace, seed.key, seed.doc["value"].clone(), metadata.clone(), Some(&agent))
            .await
            .unwrap_or_else(|e| panic!("set {}: {e}", seed.id()));
        assert_eq!(written.id, seed.id());
        let raw = couch.get(seed.id()).await.unwrap_or_else(|| panic!("{} not found by its spec id", seed.id()));
        let mut fields: Vec<&str> = SPEC_FIELDS.to_vec();
        if metadata.is_none() {
            fields.retain(|f| *f != "metadata");
        }
        check_created_shape(&raw, &fields);
        for field in ["userId", "namespace", "key", "value", "metadata", "createdByAgent"] {
            assert_exact(
                &format!("{}: {field}", seed.id()),
                &seed.doc.get(field).cloned().unwrap_or(Value::Null),
                raw.get(field).unwrap_or(&Value::Null),
            );
        }
        assert_eq!(raw["lastAccessedByAgent"], seed.doc["createdByAgent"]);
    }
    let mut metadata_doc = couch.get(MAIN_PY).await.unwrap();
    // The spec's metadata merge on what we wrote, read by plain HTTP.
    store
        .set("user_123", "files:my-repo", "src/main.py", json!(1), Some(json!({"file_size": 43, "lang": "py"})), None)
        .await
        .unwrap();
    let merged = couch.get(MAIN_PY).await.unwrap();
    metadata_doc["metadata"]["file_size"] = json!(43);
    metadata_doc["metadata"]["lang"] = json!("py");
    assert_exact("merged metadata", &metadata_doc["metadata"], &merged["metadata"]);
    assert_eq!(merged["accessCount"], json!(2));
    assert_eq!(merged["createdAt"], metadata_doc["createdAt"]);
    assert_eq!(merged["createdByAgent"], "repo-indexer");
    assert_eq!(merged["lastAccessedByAgent"], "repo-indexer", "a write without an agent keeps the last agent");
    assert_design_doc_unchanged(&couch, &ddoc, "after writing").await;
    couch.delete_database().await;
}

/// A key whose base64 differs between the standard and the URL-safe alphabet (and is padded) is
/// found under the id the existing system computed: URL-safe base64 with `=` padding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_use_url_safe_base64_with_padding_like_the_existing_system() {
    let couch = RawCouch::new("ids");
    couch.create_database().await;
    let (_backend, store) = open_store(&couch).await;
    // "ü?>" is w7w/Pg== in standard base64 and w7w_Pg== in URL-safe base64.
    let existing = json!({
        "_id": "user_123:default:w7w_Pg==",
        "userId": "user_123",
        "namespace": "default",
        "key": "ü?>",
        "value": 1,
        "createdAt": "2026-02-05T10:00:00Z",
        "updatedAt": "2026-02-05T10:00:00Z"
    });
    couch.put(&existing).await;
    let doc = store.get("user_123", "default", "ü?>", None).await.unwrap().expect("found by the existing id");
    assert_eq!(doc.id, "user_123:default:w7w_Pg==");
    assert_eq!(store.list_keys("user_123", "default").await.unwrap(), strings(&["ü?>"]));
    couch.delete_database().await;
}
