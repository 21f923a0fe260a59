//! What the Firestore adapter stores, read back raw from Google's Firestore emulator: plain
//! Firestore fields where Firestore holds the data exactly, the documented encoding where it
//! cannot (values Firestore refuses, bodies over one document in chunk documents that change
//! atomically with their document), escaped document ids for composite ids Firestore refuses, and
//! documents written by another Firestore client read through the facade.
//!
//! Each test uses a new collection on the emulator from `common::servers`; a missing emulator
//! fails these tests, it never skips them. The layout is documented in `docs/firestore-layout.md`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use agentstore::backend::catalog::{open_catalog, Catalog, DbName};
use agentstore::backend::firestore::{FirestoreBackend, FirestoreConfig};
use agentstore::backend::revision::RevisionId;
use agentstore::backend::{BackendUrl, DocumentBackend, IdRange, LayoutState, Precondition, Revision};
use agentstore::store::{DataStore, StoreOptions};
use agentstore::ErrorKind;
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use serde_json::{json, Map, Value};

use crate::common::corpus::noise;
use crate::common::counting_proxy::CountingProxy;
use crate::common::json::first_difference;
use crate::common::servers;

const PROJECT: &str = "agentstore-test";
const PATH: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~').remove(b':').remove(b'/');

static COLLECTIONS: AtomicUsize = AtomicUsize::new(0);

/// A fresh collection, the backend over it, and raw access to the same collection.
struct Fixture {
    backend: Arc<FirestoreBackend>,
    raw: Raw,
}

struct Raw {
    http: reqwest::Client,
    /// `http://HOST:PORT/v1/projects/P/databases/(default)/documents`
    root: String,
    collection: String,
}

impl Raw {
    /// The stored document's JSON, or `None` when missing. By `:batchGet`, whose names are taken
    /// literally (the emulator decodes `%` in URL paths twice).
    async fn get(&self, document_id: &str) -> Option<Value> {
        let name = format!("projects/{PROJECT}/databases/(default)/documents/{}/{document_id}", self.collection);
        let reply: Value = self
            .http
            .post(format!("{}:batchGet", self.root))
            .bearer_auth("owner")
            .json(&json!({ "documents": [name] }))
            .send()
            .await
            .expect("batchGet")
            .json()
            .await
            .expect("batchGet JSON");
        reply[0].get("found").cloned()
    }

    /// The document ids of the collection (or of a subcollection path under it).
    async fn list(&self, path: &str) -> Vec<String> {
        self.list_in(&self.collection, path).await
    }

    /// The document ids of another collection (or of a subcollection path under it).
    async fn list_in(&self, collection: &str, path: &str) -> Vec<String> {
        let url = format!("{}/{}{}?pageSize=300", self.root, collection, utf8_percent_encode(path, PATH));
        let reply: Value =
            self.http.get(url).bearer_auth("owner").send().await.expect("list").json().await.expect("list JSON");
        reply["documents"]
            .as_array()
            .map(|docs| {
                docs.iter()
                    .filter_map(|d| d["name"].as_str().and_then(|n| n.rsplit('/').next()).map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Writes a document as another Firestore client (or the previous release) would: fields in
    /// Firestore's value format, nothing of the document model.
    async fn write(&self, document_id: &str, fields: Value) {
        let name = format!("projects/{PROJECT}/databases/(default)/documents/{}/{document_id}", self.collection);
        let body = json!({ "writes": [{ "update": { "name": name, "fields": fields } }] });
        let response = self
            .http
            .post(format!("{}:commit", self.root))
            .bearer_auth("owner")
            .json(&body)
            .send()
            .await
            .expect("commit");
        assert!(response.status().is_success(), "raw write: {}", response.text().await.unwrap_or_default());
    }
}

async fn fixture() -> Fixture {
    fixture_with("").await
}

/// A fresh collection, opened with more URL parameters (`&revs_limit=2`).
async fn fixture_with(extra: &str) -> Fixture {
    let server = servers::firestore().expect("Firestore emulator");
    let collection = format!("layout_{}_{}", std::process::id(), COLLECTIONS.fetch_add(1, Ordering::Relaxed));
    let config = FirestoreConfig::parse(&format!("{}{extra}", server.collection_url(&collection))).expect("URL");
    let backend = Arc::new(FirestoreBackend::open(&config).await.expect("open"));
    let raw = Raw {
        http: reqwest::Client::new(),
        root: format!("http://{}/v1/projects/{PROJECT}/databases/(default)/documents", server.host_port),
        collection,
    };
    Fixture { backend, raw }
}

async fn store(fixture: &Fixture) -> DataStore {
    DataStore::open(fixture.backend.clone(), StoreOptions::default()).await.expect("DataStore::open")
}

fn field<'a>(document: &'a Value, name: &str) -> &'a Value {
    &document["fields"][name]
}

#[tokio::test]
async fn plain_documents_are_plain_firestore_fields() {
    let fixture = fixture().await;
    let store = store(&fixture).await;
    let value = json!({"title": "notes", "tags": ["a", "b"], "count": 3, "ratio": 0.25, "done": false, "none": null});
    store.set("user_1", "default", "greeting", value, Some(json!({"source": "test"})), Some("agent-1")).await.unwrap();

    let raw = fixture.raw.get("user_1:default:Z3JlZXRpbmc=").await.expect("stored under the composite id");
    assert_eq!(field(&raw, "_id"), &json!({"stringValue": "user_1:default:Z3JlZXRpbmc="}));
    assert_eq!(field(&raw, "userId"), &json!({"stringValue": "user_1"}));
    assert_eq!(field(&raw, "namespace"), &json!({"stringValue": "default"}));
    assert_eq!(field(&raw, "key"), &json!({"stringValue": "greeting"}));
    assert_eq!(field(&raw, "accessCount"), &json!({"integerValue": "1"}));
    assert_eq!(field(&raw, "createdByAgent"), &json!({"stringValue": "agent-1"}));
    let stored_value = &field(&raw, "value")["mapValue"]["fields"];
    assert_eq!(stored_value["title"], json!({"stringValue": "notes"}));
    assert_eq!(stored_value["count"], json!({"integerValue": "3"}));
    assert_eq!(stored_value["ratio"]["doubleValue"].as_f64(), Some(0.25));
    assert_eq!(stored_value["done"], json!({"booleanValue": false}));
    assert_eq!(stored_value["none"], json!({"nullValue": null}));
    assert_eq!(stored_value["tags"]["arrayValue"]["values"][1], json!({"stringValue": "b"}));
    assert_eq!(field(&raw, "metadata")["mapValue"]["fields"]["source"], json!({"stringValue": "test"}));
    assert!(raw["fields"].get("_format").is_none() && raw["fields"].get("_body").is_none());
    assert_eq!(fixture.backend.approximate_count().await.unwrap(), Some(1), "a COUNT aggregation");
    let created = field(&raw, "createdAt")["stringValue"].as_str().expect("createdAt is a string");
    assert!(created.ends_with('Z') && created.len() == 20, "{created}");
}

#[tokio::test]
async fn values_firestore_refuses_are_encoded_and_still_listed() {
    let fixture = fixture().await;
    let store = store(&fixture).await;
    let cases = [
        ("nested-arrays", json!([[1, 2], [[3]]])),
        ("big-integer", json!(123456789012345678901234567890u128)),
        ("reserved-name", json!({"__name__": 1, "": 2})),
    ];
    for (key, value) in &cases {
        store.set("user_1", "odd", key, value.clone(), None, None).await.unwrap();
    }
    for (key, value) in &cases {
        let id = agentstore::model::DocumentId::new("user_1", "odd", key, &Default::default()).unwrap().to_string();
        let raw = fixture.raw.get(&id).await.expect("stored");
        assert_eq!(field(&raw, "_format"), &json!({"stringValue": "json+gzip"}), "{key}");
        assert!(field(&raw, "_body")["bytesValue"].is_string(), "{key}");
        assert!(raw["fields"].get("value").is_none(), "{key}: value is only in _body");
        // The query fields stay native so listings find the document.
        assert_eq!(field(&raw, "userId"), &json!({"stringValue": "user_1"}));
        assert_eq!(field(&raw, "namespace"), &json!({"stringValue": "odd"}));
        assert_eq!(field(&raw, "key"), &json!({"stringValue": key}));
        let back = store.peek("user_1", "odd", key).await.unwrap().expect("readable");
        assert_eq!(first_difference(value, &back.body["value"]), None, "{key}");
    }
    let mut keys = store.list_keys("user_1", "odd").await.unwrap();
    keys.sort();
    assert_eq!(keys, ["big-integer", "nested-arrays", "reserved-name"]);
    assert_eq!(store.get_all("user_1", "odd").await.unwrap().len(), 3);
}

#[tokio::test]
async fn bodies_over_one_document_live_in_chunks_that_change_with_it() {
    let fixture = fixture().await;
    let backend = &fixture.backend;
    let id = "user_1:big:Ymln";
    let mut body: Map<String, Value> = serde_json::from_value(json!({
        "userId": "user_1", "namespace": "big", "key": "big", "value": noise(3_000_000, 7)
    }))
    .unwrap();

    let rev = backend.put(id, &body, Precondition::MustNotExist).await.unwrap();
    let raw = fixture.raw.get(id).await.expect("stored");
    let chunks: usize = field(&raw, "_chunks")["integerValue"].as_str().unwrap().parse().unwrap();
    assert!(chunks >= 2, "3 MB of noise needs chunk documents, got {chunks}");
    let mut names = fixture.raw.list(&format!("/{id}/agentstore_chunks")).await;
    names.sort();
    assert_eq!(names, (1..=chunks).map(|n| n.to_string()).collect::<Vec<_>>());
    // Chunk documents are not documents of the collection.
    assert_eq!(fixture.raw.list("").await, [id]);

    let got = backend.get(id).await.unwrap().expect("found");
    assert_eq!(got.rev, rev);
    assert!(got.body == body, "the 3 MB body comes back exactly");
    let scanned = backend.scan(10, None).await.unwrap();
    assert_eq!(scanned.items.len(), 1);
    assert!(scanned.items[0].body == body);

    // A smaller version replaces the chunks in the same commit.
    body.insert("value".into(), json!(noise(1_200_000, 9)));
    let rev = backend.put(id, &body, Precondition::MatchRevision(rev)).await.unwrap();
    let raw = fixture.raw.get(id).await.unwrap();
    let fewer: usize = field(&raw, "_chunks")["integerValue"].as_str().map_or(0, |n| n.parse().unwrap());
    assert!(fewer < chunks);
    assert_eq!(fixture.raw.list(&format!("/{id}/agentstore_chunks")).await.len(), fewer);
    assert!(backend.get(id).await.unwrap().unwrap().body == body);

    // A stale revision changes nothing.
    body.insert("value".into(), json!("small"));
    let stale = backend.put(id, &body, Precondition::MatchRevision(got.rev)).await.unwrap_err();
    assert!(stale.is_conflict(), "{stale}");
    assert_eq!(fixture.raw.list(&format!("/{id}/agentstore_chunks")).await.len(), fewer);

    // Deleting the document leaves a tombstone and deletes its chunks.
    backend.delete(id, &rev).await.unwrap();
    assert_tombstone(&fixture.raw.get(id).await.expect("a tombstone"));
    assert!(fixture.raw.list(&format!("/{id}/agentstore_chunks")).await.is_empty());

    // So does deleting through a listing, whose projection leaves the body out.
    backend.put(id, &body_with_noise(&body), Precondition::MustNotExist).await.unwrap();
    assert!(!fixture.raw.list(&format!("/{id}/agentstore_chunks")).await.is_empty());
    let store = store(&fixture).await;
    assert_eq!(store.delete_namespace("user_1", "big").await.unwrap(), 1);
    assert_tombstone(&fixture.raw.get(id).await.expect("a tombstone"));
    assert!(fixture.raw.list(&format!("/{id}/agentstore_chunks")).await.is_empty());
}

/// Asserts a stored document is a tombstone: flagged, and nothing of the body left.
fn assert_tombstone(raw: &Value) {
    assert_eq!(field(raw, "_deleted"), &json!({ "booleanValue": true }), "{raw}");
    for gone in ["userId", "namespace", "key", "value", "_body", "_chunks"] {
        assert!(raw["fields"].get(gone).is_none(), "a tombstone has no {gone}: {raw}");
    }
}

fn body_with_noise(body: &Map<String, Value>) -> Map<String, Value> {
    let mut body = body.clone();
    body.insert("value".into(), json!(noise(2_500_000, 11)));
    body
}

#[tokio::test]
async fn composite_ids_firestore_refuses_are_escaped() {
    let fixture = fixture().await;
    let store = store(&fixture).await;
    // The last id escapes to over 1,500 bytes (250 × `%2F` plus an 800-character key part).
    let long_slashes = "/".repeat(250);
    let long_key = "k".repeat(600);
    let cases = [("a/b", "k/1"), ("..", "k/1"), ("100%", "k/1"), (long_slashes.as_str(), long_key.as_str())];
    for (namespace, key) in cases {
        store.set("user_1", namespace, key, json!(namespace), None, None).await.unwrap();
    }
    for (namespace, key) in cases {
        let doc =
            store.peek("user_1", namespace, key).await.unwrap().unwrap_or_else(|| panic!("{namespace} not found"));
        assert_eq!(doc.body["value"], json!(namespace), "{namespace}");
        assert_eq!(store.list_keys("user_1", namespace).await.unwrap(), [key], "{namespace}");
    }
    let mut listed = store.list_namespaces("user_1").await.unwrap();
    listed.sort();
    let mut expected: Vec<String> = cases.iter().map(|(n, _)| n.to_string()).collect();
    expected.sort();
    assert_eq!(listed, expected);

    let stored = fixture.raw.list("").await;
    assert!(stored.iter().all(|name| !name.contains('/')));
    assert!(stored.contains(&"user_1:a%2Fb:ay8x".to_owned()), "{stored:?}");
    assert!(stored.contains(&"user_1:100%25:ay8x".to_owned()), "{stored:?}");
    assert!(stored.iter().any(|name| name.starts_with("%H")), "the long id is hashed: {stored:?}");
    for name in &stored {
        let raw = fixture.raw.get(name).await.unwrap();
        let id = field(&raw, "_id")["stringValue"].as_str().unwrap();
        assert!(id.starts_with("user_1:"), "{name} keeps its composite id: {id}");
        assert!(
            name.starts_with("%H") || agentstore::backend::firestore::codec::composite_id(name).as_deref() == Some(id)
        );
    }
    for (namespace, key) in cases {
        assert!(store.delete("user_1", namespace, key).await.unwrap(), "{namespace}");
    }
    for name in fixture.raw.list("").await {
        assert_tombstone(&fixture.raw.get(&name).await.expect("listed"));
    }
    assert_eq!(fixture.backend.erase_prefix("user_1:").await.unwrap(), stored.len() as u64);
    assert!(fixture.raw.list("").await.is_empty(), "erasure leaves no tombstone");
}

#[tokio::test]
async fn documents_written_by_another_firestore_client_are_served() {
    let fixture = fixture().await;
    // As a Google client library writes the spec's example: no `_id` field, native values.
    fixture
        .raw
        .write(
            "user_123:default:Z3JlZXRpbmc=",
            json!({
                "userId": {"stringValue": "user_123"},
                "namespace": {"stringValue": "default"},
                "key": {"stringValue": "greeting"},
                "value": {"stringValue": "Hello, World!"},
                "metadata": {"mapValue": {"fields": {"lang": {"stringValue": "en"}, "score": {"doubleValue": 0.5}}}},
                "createdByAgent": {"stringValue": "hello-agent"},
                "accessCount": {"integerValue": "1"},
                "createdAt": {"stringValue": "2026-02-05T10:00:00Z"},
                "updatedAt": {"stringValue": "2026-02-05T10:00:00Z"},
                "legacyFlag": {"booleanValue": true}
            }),
        )
        .await;
    let store = store(&fixture).await;
    assert_eq!(store.list_keys("user_123", "default").await.unwrap(), ["greeting"]);
    let got = store.get("user_123", "default", "greeting", Some("reader")).await.unwrap().expect("found");
    assert_eq!(got.body["value"], json!("Hello, World!"));
    store.set("user_123", "default", "greeting", json!("Hi"), Some(json!({"lang": "de"})), None).await.unwrap();

    let raw = fixture.raw.get("user_123:default:Z3JlZXRpbmc=").await.unwrap();
    assert_eq!(field(&raw, "value"), &json!({"stringValue": "Hi"}));
    assert_eq!(field(&raw, "accessCount"), &json!({"integerValue": "3"}), "stored 1, + our read, + our update");
    assert_eq!(field(&raw, "legacyFlag"), &json!({"booleanValue": true}), "unknown fields are kept");
    assert_eq!(field(&raw, "metadata")["mapValue"]["fields"]["lang"], json!({"stringValue": "de"}));
    assert_eq!(field(&raw, "metadata")["mapValue"]["fields"]["score"]["doubleValue"].as_f64(), Some(0.5));
    assert_eq!(field(&raw, "createdAt"), &json!({"stringValue": "2026-02-05T10:00:00Z"}));
}

fn plain_body(user: &str, key: &str) -> Map<String, Value> {
    json!({ "userId": user, "namespace": "ns", "key": key, "value": key, "accessCount": 0 })
        .as_object()
        .cloned()
        .expect("object")
}

fn generation(rev: &Revision) -> u64 {
    RevisionId::parse(rev.as_str()).unwrap_or_else(|| panic!("{rev} is not N-<32 hex>")).generation
}

#[tokio::test]
async fn revisions_ancestry_and_tombstones_are_stored_fields() {
    let fixture = fixture_with("&revs_limit=2").await;
    let backend = &fixture.backend;
    let id = "user_1:ns:aw==";
    let mut rev = backend.put(id, &plain_body("user_1", "k"), Precondition::MustNotExist).await.unwrap();
    for _ in 0..2 {
        rev = backend.put(id, &plain_body("user_1", "k"), Precondition::MatchRevision(rev)).await.unwrap();
    }
    assert_eq!(generation(&rev), 3);
    backend.delete(id, &rev).await.unwrap();

    let raw = fixture.raw.get(id).await.expect("the tombstone stays");
    let rev4 = field(&raw, "_rev")["stringValue"].as_str().expect("a stored revision").to_owned();
    assert_eq!(generation(&Revision(rev4.clone())), 4);
    assert_eq!(field(&raw, "_deleted"), &json!({ "booleanValue": true }));
    assert!(field(&raw, "_changedAt")["timestampValue"].is_string(), "{raw}");
    let revs = field(&raw, "_revs")["bytesValue"].as_str().expect("bytes");
    use base64::Engine as _;
    assert_eq!(base64::engine::general_purpose::STANDARD.decode(revs).unwrap().len(), 32, "revs_limit=2: two tokens");
    let mut names: Vec<&String> = raw["fields"].as_object().unwrap().keys().collect();
    names.sort();
    assert_eq!(names, ["_changedAt", "_deleted", "_id", "_rev", "_revs"], "no body on a tombstone");
    let info = backend.revisions(id).await.unwrap().expect("known");
    assert!(info.deleted);
    let ancestry: Vec<Revision> = info.ancestry.revisions().collect();
    assert_eq!(ancestry, [Revision(rev4.clone()), rev.clone()], "the last two, newest first");

    // Local documents live beside the collection, never in it.
    let local = backend.put_local("peer-a", &plain_body("x", "y"), Precondition::MustNotExist).await.unwrap();
    assert_eq!(local, Revision("0-1".into()));
    assert_eq!(fixture.raw.list_in(&format!("{}_local", fixture.raw.collection), "").await, ["peer-a"]);
    assert_eq!(fixture.raw.list("").await, [id]);
}

/// What a read of the feed costs when it finds nothing new (every idle reader, every view or
/// Mango index catch-up before a query), counted at a proxy in front of the emulator: one
/// `:runQuery` for the settle window below the floor and what came after it; and the next read
/// still finds a write made after it.
#[tokio::test]
async fn a_read_that_finds_nothing_new_is_one_query() {
    let server = servers::firestore().expect("Firestore emulator");
    let proxy = CountingProxy::start(&format!("http://{}", server.host_port)).await.expect("start the counting proxy");
    let collection = format!("idle_{}_{}", std::process::id(), COLLECTIONS.fetch_add(1, Ordering::Relaxed));
    let url = server.collection_url(&collection).replace(&server.host_port, proxy.url.trim_start_matches("http://"));
    let backend = FirestoreBackend::open(&FirestoreConfig::parse(&url).expect("URL")).await.expect("open");
    backend.put("user_1:ns:YQ==", &plain_body("user_1", "a"), Precondition::MustNotExist).await.unwrap();
    let first = backend.changes(None, 100).await.unwrap();
    assert_eq!(first.changes.len(), 1);
    let queries = |requests: Vec<String>| requests.iter().filter(|r| r.ends_with(":runQuery")).count();

    proxy.take();
    let idle = backend.changes(Some(&first.last_seq), 100).await.unwrap();
    assert!(idle.changes.is_empty(), "the write in the window is reported already: {:?}", idle.changes);
    assert_eq!(idle.pending, Some(0));
    assert_eq!(idle.last_seq, first.last_seq, "nothing written, the same position");
    assert_eq!(queries(proxy.take()), 1, "one query for the window and after it");

    let rev = backend.put("user_1:ns:Yg==", &plain_body("user_1", "b"), Precondition::MustNotExist).await.unwrap();
    let next = backend.changes(Some(&idle.last_seq), 100).await.unwrap();
    let changed: Vec<(&str, Revision)> = next.changes.iter().map(|c| (c.id.as_str(), c.rev.clone())).collect();
    assert_eq!(changed, [("user_1:ns:Yg==", rev)]);
}

#[tokio::test]
async fn a_write_received_before_a_position_but_committed_after_it_is_still_fed() {
    // A write whose request time (`_changedAt`) precedes the position's read time while its commit
    // comes after: written raw, with `_changedAt` one second before the position.
    for (settle, expect_seen) in [("", true), ("&settle_ms=0", false)] {
        let fixture = fixture_with(settle).await;
        let backend = &fixture.backend;
        backend.put("user_1:ns:YQ==", &plain_body("user_1", "a"), Precondition::MustNotExist).await.unwrap();
        let position = backend.change_position().await.unwrap();
        let read_time = chrono::DateTime::parse_from_rfc3339(&position).expect("a floor token is a read time");
        let received = (read_time - chrono::Duration::seconds(1)).to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        let rev = RevisionId::next_after(None).unwrap().to_revision();
        fixture
            .raw
            .write(
                "user_1:ns:Yg==",
                json!({
                    "_id": { "stringValue": "user_1:ns:Yg==" },
                    "userId": { "stringValue": "user_1" },
                    "_rev": { "stringValue": rev.as_str() },
                    "_deleted": { "booleanValue": false },
                    "_changedAt": { "timestampValue": received },
                }),
            )
            .await;
        let page = backend.changes(Some(&position), 100).await.unwrap();
        let ids: Vec<&str> = page.changes.iter().map(|c| c.id.as_str()).collect();
        if expect_seen {
            assert_eq!(ids, ["user_1:ns:Yg=="], "the settle window reaches back; the earlier write is not repeated");
            assert_eq!(page.changes[0].rev, rev);
        } else {
            assert!(ids.is_empty(), "without a settle window the late commit is missed: {ids:?}");
        }
    }
}

/// Writes `count` documents the way the previous release did: `_id`, the query fields and the
/// body, no revision, tombstone flag or change time.
async fn write_previous_release_documents(raw: &Raw, count: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for n in 0..count {
        let id = format!("user_{}:ns:{n}", n % 2);
        raw.write(
            &id,
            json!({
                "_id": { "stringValue": id },
                "userId": { "stringValue": format!("user_{}", n % 2) },
                "namespace": { "stringValue": "ns" },
                "key": { "stringValue": n.to_string() },
                "value": { "integerValue": n.to_string() },
            }),
        )
        .await;
        ids.push(id);
    }
    ids
}

#[tokio::test]
async fn a_collection_of_the_previous_release_keeps_working_and_upgrades_in_place() {
    let fixture = fixture().await;
    // The fixture's open saw an empty collection and marked it current; remove the marker, as a
    // collection of the previous release has none.
    let marker = format!("projects/{PROJECT}/databases/(default)/documents/{}_meta/layout", fixture.raw.collection);
    let deleted = fixture
        .raw
        .http
        .post(format!("{}:commit", fixture.raw.root))
        .bearer_auth("owner")
        .json(&json!({ "writes": [{ "delete": marker }] }))
        .send()
        .await
        .unwrap();
    assert!(deleted.status().is_success());
    let ids = write_previous_release_documents(&fixture.raw, 7).await;
    let config =
        FirestoreConfig::parse(&servers::firestore().unwrap().collection_url(&fixture.raw.collection)).unwrap();
    let backend = FirestoreBackend::open(&config).await.expect("open an old collection");

    assert!(matches!(backend.layout().await.unwrap(), LayoutState::NeedsUpgrade(_)));
    for outcome in
        [backend.changes(None, 10).await.map(|_| ()), backend.all_docs(&IdRange::all(), 10, None).await.map(|_| ())]
    {
        let err = outcome.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");
        assert!(err.to_string().contains("agentstore upgrade"), "{err}");
    }
    // What worked before works: reads with the old revision form, updates and deletes with it.
    let old = backend.get(&ids[0]).await.unwrap().expect("found");
    assert!(chrono::DateTime::parse_from_rfc3339(old.rev.as_str()).is_ok(), "an updateTime revision: {}", old.rev);
    let updated = backend.put(&ids[0], &old.body, Precondition::MatchRevision(old.rev.clone())).await.unwrap();
    assert_eq!(generation(&updated), 2, "the old revision counts as generation 1");
    let gone = backend.get(&ids[1]).await.unwrap().expect("found");
    backend.delete(&ids[1], &gone.rev).await.unwrap();
    assert!(backend.get(&ids[1]).await.unwrap().is_none());
    assert_eq!(backend.scan(100, None).await.unwrap().items.len(), 6, "the tombstone is not scanned");

    // Two pages, then "interrupted": a new process resumes from the saved token.
    let first = backend.upgrade_page(None, 3).await.unwrap();
    // In name order the first three are user_0:ns:0 (rewritten above), user_0:ns:2 and user_0:ns:4.
    assert_eq!((first.examined, first.upgraded), (3, 2), "the first of them was rewritten already");
    let resumed = FirestoreBackend::open(&config).await.unwrap();
    let mut token = first.next.clone();
    let mut upgraded = first.upgraded;
    while let Some(from) = token {
        let page = resumed.upgrade_page(Some(&from), 3).await.unwrap();
        upgraded += page.upgraded;
        token = page.next;
    }
    assert_eq!(upgraded, 5, "every document not rewritten since (user_0:ns:0, and the tombstone user_1:ns:1)");
    // Idempotent: a rerun from the start finds nothing to do.
    let rerun = resumed.upgrade_page(None, 100).await.unwrap();
    assert_eq!((rerun.examined, rerun.upgraded, rerun.next), (7, 0, None));
    resumed.finish_upgrade().await.unwrap();
    assert_eq!(resumed.layout().await.unwrap(), LayoutState::Current);

    // The stamp left the body alone and minted a revision of generation 2.
    let stamped = resumed.get(&ids[2]).await.unwrap().expect("found");
    assert_eq!(stamped.body["value"], json!(2));
    assert_eq!(generation(&stamped.rev), 2);
    let feed = resumed.changes(None, 100).await.unwrap();
    let mut fed: Vec<(&str, bool)> = feed.changes.iter().map(|c| (c.id.as_str(), c.deleted)).collect();
    fed.sort();
    let mut expected: Vec<(&str, bool)> = ids.iter().map(|id| (id.as_str(), id == &ids[1])).collect();
    expected.sort();
    assert_eq!(fed, expected, "every document once, the tombstone flagged");
    let listed: Vec<String> =
        resumed.all_docs(&IdRange::all(), 100, None).await.unwrap().items.into_iter().map(|d| d.id).collect();
    let mut live: Vec<String> = ids.iter().filter(|id| *id != &ids[1]).cloned().collect();
    live.sort();
    assert_eq!(listed, live, "id order, no tombstone");
}

/// The document ids of a collection path below the root, documents that exist only as the
/// parents of subcollections included (`showMissing`).
async fn list_with_missing(raw: &Raw, path: &str) -> Vec<String> {
    let url = format!("{}/{}?pageSize=300&showMissing=true", raw.root, utf8_percent_encode(path, PATH));
    let reply: Value = raw.http.get(url).bearer_auth("owner").send().await.expect("list").json().await.expect("JSON");
    reply["documents"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d| d["name"].as_str().and_then(|n| n.rsplit('/').next()).map(str::to_owned))
        .collect()
}

#[tokio::test]
async fn a_database_lives_under_its_marker_and_a_drop_leaves_nothing() {
    let fixture = fixture().await;
    let server = servers::firestore().expect("Firestore emulator");
    let url: BackendUrl = server.collection_url(&fixture.raw.collection).parse().expect("URL");
    let catalog = open_catalog(&url).await.expect("catalog");
    let name = DbName::parse("big/db").unwrap();
    let db = catalog.create(&name).await.expect("create");

    let big: Map<String, Value> = serde_json::from_value(json!({ "value": noise(3_000_000, 11) })).unwrap();
    db.put("big", &big, Precondition::MustNotExist).await.unwrap();
    let rev = db.put("gone", &Map::new(), Precondition::MustNotExist).await.unwrap();
    db.delete("gone", &rev).await.unwrap();
    db.put_local("checkpoint", &Map::new(), Precondition::None).await.unwrap();

    let catalog_collection = format!("{}_databases", fixture.raw.collection);
    let marker = fixture.raw.list_in(&catalog_collection, "").await;
    assert_eq!(marker, ["big.2fdb"], "one marker, named by the encoded name");
    let instances = list_with_missing(&fixture.raw, &format!("{catalog_collection}/big.2fdb/instances")).await;
    assert_eq!(instances.len(), 1, "one instance: {instances:?}");
    let instance = format!("{catalog_collection}/big.2fdb/instances/{}", instances[0]);
    let mut documents = list_with_missing(&fixture.raw, &format!("{instance}/db_documents")).await;
    documents.sort();
    assert_eq!(documents, ["big", "gone"], "the document and the tombstone, in the database's collection");
    assert!(!list_with_missing(&fixture.raw, &format!("{instance}/db_documents/big/agentstore_chunks"))
        .await
        .is_empty());
    assert_eq!(list_with_missing(&fixture.raw, &format!("{instance}/db_documents_local")).await.len(), 1);
    assert_eq!(fixture.raw.list("").await, Vec::<String>::new(), "nothing in the data store's collection");

    assert!(Catalog::delete(&*catalog, &name).await.expect("drop"));
    for path in ["db_documents", "db_documents/big/agentstore_chunks", "db_documents_local", "db_documents_meta"] {
        let left = list_with_missing(&fixture.raw, &format!("{instance}/{path}")).await;
        assert_eq!(left, Vec::<String>::new(), "{path} is empty after the drop");
    }
    assert_eq!(fixture.raw.list_in(&catalog_collection, "").await, Vec::<String>::new(), "the marker is gone");
    assert!(db.get("big").await.unwrap().is_none(), "a handle from before the drop finds nothing");
}
