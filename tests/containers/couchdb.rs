//! The CouchDB adapter against CouchDB servers in containers: the official Apache CouchDB 3 image
//! (`AGENTSTORE_TEST_COUCHDB_IMAGE`, default `couchdb:3`) and pouchdb-server built on the local
//! base (`AGENTSTORE_TEST_POUCHDB_IMAGE`, default `agentstore-test/pouchdb-server:4.2.0`).
//!
//! Real CouchDB differs from pouchdb-server in exactly the ways that matter here (see
//! ../shared/TEST-SERVERS.md): numbers are kept exactly, and `_find` answers at most 25 documents
//! unless given a limit, paging with bookmarks. So the trials ask the server what it is: on
//! Apache CouchDB the round-trip corpus is compared exactly and the 25-document trap is checked to
//! be real; on pouchdb-server (JS doubles) the values beyond double precision must be refused, not
//! stored altered. Both list more than 25 documents with small pages and give the spec's example
//! documents the spec's ids.

use std::sync::Arc;
use std::time::{Duration, Instant};

use agentstore::backend::couchdb::{CouchConfig, CouchDbBackend};
use agentstore::backend::DocumentBackend;
use agentstore::store::{DataStore, StoreOptions};
use futures::future::BoxFuture;
use serde_json::{json, Value};
use testcontainers::core::WaitFor;
use testcontainers::{ContainerAsync, GenericImage};

use crate::common::json::first_difference;
use crate::harness::{check, launch, Group, ImageRole, Launch, Origin, TrialFn};

const SPEC_EXAMPLES: &str = include_str!("../../fixtures/seed-documents.json");
const COUCHDB_PORT: u16 = 5984;
/// How long the server may take to answer `GET /_up` after its start.
const UP_DEADLINE: Duration = Duration::from_secs(120);

pub fn groups() -> Vec<Group> {
    let trials = || -> Vec<(&'static str, TrialFn)> {
        vec![
            ("round_trip_corpus", |url| Box::pin(round_trip_corpus(url))),
            ("list_keys_pages_past_the_default_limit", |url| Box::pin(list_past_default_limit(url))),
            ("seed_documents_get_the_spec_ids", |url| Box::pin(seed_document_ids(url))),
        ]
    };
    vec![
        Group {
            name: "couchdb_official",
            role: ImageRole {
                setting: "AGENTSTORE_TEST_COUCHDB_IMAGE",
                default: "couchdb:3",
                origin: Origin::Official,
            },
            shared: Some((start_couchdb, |url| Box::pin(async move { wait_until_up(&url, "/_up").await }))),
            trials: trials(),
        },
        Group {
            name: "couchdb_pouchdb_server",
            role: ImageRole {
                setting: "AGENTSTORE_TEST_POUCHDB_IMAGE",
                default: "agentstore-test/pouchdb-server:4.2.0",
                origin: Origin::Local("images"),
            },
            // pouchdb-server has no `/_up`; its welcome at `/` means it serves.
            shared: Some((start_pouchdb_server, |url| Box::pin(async move { wait_until_up(&url, "/").await }))),
            trials: trials(),
        },
    ]
}

// ---------------------------------------------------------------------------------------------
// Docker.
// ---------------------------------------------------------------------------------------------

/// Apache CouchDB's image, with the admin its entrypoint creates from the environment.
fn start_couchdb(image: String) -> BoxFuture<'static, Result<(ContainerAsync<GenericImage>, String), String>> {
    Box::pin(async move {
        let wait = WaitFor::message_on_either_std("Apache CouchDB has started");
        let env = vec![("COUCHDB_USER", "admin"), ("COUCHDB_PASSWORD", "password")];
        let (container, address) = launch(&image, Launch { port: COUCHDB_PORT, wait, cmd: vec![], env }).await?;
        Ok((container, format!("http://admin:password@{address}")))
    })
}

/// The pouchdb-server image scripts/containers builds: its admin is in its config.json.
fn start_pouchdb_server(image: String) -> BoxFuture<'static, Result<(ContainerAsync<GenericImage>, String), String>> {
    Box::pin(async move {
        let wait = WaitFor::Nothing;
        let (container, address) =
            launch(&image, Launch { port: COUCHDB_PORT, wait, cmd: vec![], env: vec![] }).await?;
        Ok((container, format!("http://admin:password@{address}")))
    })
}

/// Whether the server keeps numbers exactly: Apache CouchDB does, pouchdb-server (which answers
/// `GET /` with `express-pouchdb`) stores JS doubles.
async fn keeps_exact_numbers(server: &str) -> Result<bool, String> {
    let (base, user, password) = split_credentials(server)?;
    let welcome: Value = reqwest::Client::new()
        .get(format!("{base}/"))
        .basic_auth(&user, Some(&password))
        .send()
        .await
        .map_err(|e| format!("GET /: {e}"))?
        .json()
        .await
        .map_err(|e| format!("GET / body: {e}"))?;
    Ok(welcome.get("express-pouchdb").is_none())
}

/// Polls `GET {path}` until the server answers 200, or the deadline passes.
async fn wait_until_up(url: &str, path: &str) -> Result<(), String> {
    let (base, user, password) = split_credentials(url)?;
    let http = reqwest::Client::builder().timeout(Duration::from_secs(5)).build().map_err(|e| e.to_string())?;
    let started = Instant::now();
    let mut last = String::from("no answer yet");
    while started.elapsed() < UP_DEADLINE {
        match http.get(format!("{base}{path}")).basic_auth(&user, Some(&password)).send().await {
            Ok(response) if response.status().is_success() => return Ok(()),
            Ok(response) => last = format!("HTTP {}", response.status()),
            Err(e) => last = e.to_string(),
        }
        // Poll interval.
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Err(format!("CouchDB at {base} not up after {UP_DEADLINE:?}: {last}"))
}

/// `http://user:pass@host:port` → (`http://host:port`, user, pass).
fn split_credentials(url: &str) -> Result<(String, String, String), String> {
    let mut parsed = reqwest::Url::parse(url).map_err(|e| format!("{url}: {e}"))?;
    let user = parsed.username().to_owned();
    let password = parsed.password().unwrap_or_default().to_owned();
    let _ = parsed.set_username("");
    let _ = parsed.set_password(None);
    Ok((parsed.as_str().trim_end_matches('/').to_owned(), user, password))
}

// ---------------------------------------------------------------------------------------------
// The trials.
// ---------------------------------------------------------------------------------------------

/// A new database name on the container's server.
fn database(tag: &str) -> String {
    static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    format!("container_{tag}_{}", COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

/// The adapter opened with `?create=true` on a new database, and the facade over it.
async fn open(
    server: &str,
    database: &str,
    options: StoreOptions,
) -> Result<(Arc<dyn DocumentBackend>, DataStore), String> {
    let config = CouchConfig::parse(&format!("couchdb+{server}/{database}?create=true")).map_err(|e| e.to_string())?;
    let backend: Arc<dyn DocumentBackend> =
        Arc::new(CouchDbBackend::open(&config).await.map_err(|e| format!("CouchDbBackend::open: {e}"))?);
    let store = DataStore::open(Arc::clone(&backend), options).await.map_err(|e| format!("DataStore::open: {e}"))?;
    Ok((backend, store))
}

/// Every corpus value through `set`/`get`/`get_all`, compared by exact decimal value: real
/// CouchDB keeps 38-digit integers, int64 and 2^53 + 1; on a server storing JS doubles those must
/// be refused.
async fn round_trip_corpus(server: String) -> Result<(), String> {
    let exact = keeps_exact_numbers(&server).await?;
    let (_backend, store) = open(&server, &database("roundtrip"), StoreOptions::default()).await?;
    let cases: Vec<_> = crate::common::corpus::cases()
        .into_iter()
        .filter(|c| exact || crate::common::json::survives_f64(&c.value))
        .collect();
    let mut failures = crate::corpus::differences(&store, exact).await?;
    let all = store.get_all("corpus", "values").await.map_err(|e| format!("get_all: {e}"))?;
    check(all.len() == cases.len(), || format!("get_all returned {} of {} values", all.len(), cases.len()))?;
    for case in &cases {
        match all.get(&case.name) {
            None => failures.push(format!("{}: missing from get_all", case.name)),
            Some(value) => {
                if let Some(diff) = first_difference(&case.value, value) {
                    failures.push(format!("{}: get_all {diff}", case.name));
                }
            }
        }
    }
    check(failures.is_empty(), || format!("values changed:\n  {}", failures.join("\n  ")))
}

/// Listings over more than 25 documents (where `_find` without a limit stops) with pages of 10.
async fn list_past_default_limit(server: String) -> Result<(), String> {
    let db = database("paging");
    let options = StoreOptions { page_size: 10, ..StoreOptions::default() };
    let (_backend, store) = open(&server, &db, options).await?;
    // 40 keys in one namespace (a multiple of the page size: the last page CouchDB sends is
    // empty and echoes the bookmark), 30 single-key namespaces, and another user's documents.
    let keys = crate::corpus::write_paging_keys(&store, 40, 5).await?;
    let mut namespaces: Vec<String> = (0..30).map(|i| format!("ns-{i:02}")).collect();
    for namespace in &namespaces {
        store.set("user_p", namespace, "k", json!(1), None, None).await.map_err(|e| format!("set {namespace}: {e}"))?;
    }

    // The trap is real on Apache CouchDB: no limit, 25 documents.
    let exact = keeps_exact_numbers(&server).await?;
    let (base, user, password) = split_credentials(&server)?;
    let response: Value = reqwest::Client::new()
        .post(format!("{base}/{db}/_find"))
        .basic_auth(&user, Some(&password))
        .json(&json!({"selector": {"userId": "user_p", "namespace": "paging"}, "fields": ["key"]}))
        .send()
        .await
        .map_err(|e| format!("raw _find: {e}"))?
        .json()
        .await
        .map_err(|e| format!("raw _find body: {e}"))?;
    let raw_count = response["docs"].as_array().map_or(0, Vec::len);
    check(!exact || raw_count == 25, || {
        format!("expected Apache CouchDB to answer 25 documents without a limit, got {raw_count}")
    })?;

    let listed = store.list_keys("user_p", "paging").await.map_err(|e| format!("list_keys: {e}"))?;
    check(listed == keys, || format!("list_keys returned {} keys, expected 40: {listed:?}", listed.len()))?;
    crate::corpus::pages_checked(&store, 10, 40).await?;
    let all = store.get_all("user_p", "paging").await.map_err(|e| format!("get_all: {e}"))?;
    check(all.len() == 40 && keys.iter().all(|k| all.get(k) == Some(&json!(k))), || {
        format!("get_all returned {} entries", all.len())
    })?;
    namespaces.push("paging".to_owned());
    namespaces.sort();
    let listed = store.list_namespaces("user_p").await.map_err(|e| format!("list_namespaces: {e}"))?;
    check(listed == namespaces, || format!("list_namespaces over 70 documents: {listed:?}"))?;
    let other = store.list_keys("user_q", "paging").await.map_err(|e| e.to_string())?;
    check(other.len() == 5, || format!("user_q's keys: {other:?}"))?;
    let deleted = store.delete_namespace("user_p", "paging").await.map_err(|e| format!("delete_namespace: {e}"))?;
    check(deleted == 40, || format!("delete_namespace deleted {deleted}, expected 40"))?;
    let left = store.list_keys("user_p", "paging").await.map_err(|e| e.to_string())?;
    check(left.is_empty(), || format!("keys left after delete_namespace: {left:?}"))
}

/// The spec's example documents written through the facade land under the spec's `_id`s, and the
/// same documents written by plain HTTP are read by the facade exactly.
async fn seed_document_ids(server: String) -> Result<(), String> {
    let seeds: Vec<Value> = serde_json::from_str(SPEC_EXAMPLES).map_err(|e| e.to_string())?;
    let (base, user, password) = split_credentials(&server)?;
    let http = reqwest::Client::new();
    let raw_get = |db: &str, id: &str| {
        let url =
            format!("{base}/{db}/{}", percent_encoding::utf8_percent_encode(id, percent_encoding::NON_ALPHANUMERIC));
        http.get(url).basic_auth(&user, Some(&password)).send()
    };

    // Through the facade.
    let db = database("seeds");
    let (_backend, store) = open(&server, &db, StoreOptions::default()).await?;
    for seed in &seeds {
        let field = |name: &str| seed[name].as_str().unwrap_or_default().to_owned();
        let (id, user_id, namespace, key) = (field("_id"), field("userId"), field("namespace"), field("key"));
        let agent = field("createdByAgent");
        let written = store
            .set(&user_id, &namespace, &key, seed["value"].clone(), seed.get("metadata").cloned(), Some(&agent))
            .await
            .map_err(|e| format!("set {id}: {e}"))?;
        check(written.id == id, || {
            format!("set {user_id}/{namespace}/{key} wrote id {:?}, the spec says {id:?}", written.id)
        })?;
        let response = raw_get(&db, &id).await.map_err(|e| format!("GET {id}: {e}"))?;
        check(response.status().is_success(), || format!("GET {id} by its spec id: {}", response.status()))?;
        let raw: Value = response.json().await.map_err(|e| format!("GET {id}: {e}"))?;
        for name in ["userId", "namespace", "key", "value", "metadata", "createdByAgent"] {
            let expected = seed.get(name).cloned().unwrap_or(Value::Null);
            let actual = raw.get(name).cloned().unwrap_or(Value::Null);
            if let Some(diff) = first_difference(&expected, &actual) {
                return Err(format!("{id}: {name}: {diff}"));
            }
        }
    }

    // Written by plain HTTP, as the existing system does, then read through the facade.
    let db = database("seeded");
    let (_backend, store) = open(&server, &db, StoreOptions::default()).await?;
    for seed in &seeds {
        let id = seed["_id"].as_str().unwrap_or_default();
        let url =
            format!("{base}/{db}/{}", percent_encoding::utf8_percent_encode(id, percent_encoding::NON_ALPHANUMERIC));
        let response = http
            .put(url)
            .basic_auth(&user, Some(&password))
            .json(seed)
            .send()
            .await
            .map_err(|e| format!("PUT {id}: {e}"))?;
        check(response.status().as_u16() == 201, || format!("PUT {id}: {}", response.status()))?;
    }
    for seed in &seeds {
        let id = seed["_id"].as_str().unwrap_or_default();
        let field = |name: &str| seed[name].as_str().unwrap_or_default().to_owned();
        let doc = store
            .get(&field("userId"), &field("namespace"), &field("key"), None)
            .await
            .map_err(|e| format!("get {id}: {e}"))?
            .ok_or_else(|| format!("get {id}: not found"))?;
        check(doc.id == id, || format!("{id}: facade read {:?}", doc.id))?;
        if let Some(diff) = first_difference(&seed["value"], &doc.body["value"]) {
            return Err(format!("{id}: value {diff}"));
        }
        let count = seed["accessCount"].as_u64().unwrap_or(0);
        check(doc.body["accessCount"] == json!(count + 1), || {
            format!("{id}: accessCount {}", doc.body["accessCount"])
        })?;
    }
    let namespaces = store.list_namespaces("user_123").await.map_err(|e| e.to_string())?;
    check(namespaces == ["cache:github", "default", "files:my-repo"], || format!("list_namespaces: {namespaces:?}"))
}
