//! Which backends the contract suite runs on, and how each test gets a fresh, isolated backend.
//!
//! Selection: `AGENTSTORE_TEST_BACKENDS` is a comma-separated list of backend names (default:
//! all of them). A selected backend whose server cannot be reached FAILS its tests; only a
//! backend left out of the list is skipped, and the suite prints which backends ran against which
//! server and which were deselected.
//!
//! Adding a backend: add a [`BackendHarness`] to [`all`] whose `fresh` returns a backend with no
//! data in it (a new temp file, database, table or collection per test). Nothing in `cases.rs`
//! changes.

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use std::sync::atomic::{AtomicUsize, Ordering};

use agentstore::backend::couchdb::{CouchConfig, CouchDbBackend};
use agentstore::backend::dynamodb::{DynamoConfig, DynamoDbBackend};
use agentstore::backend::embedded::EmbeddedBackend;
use agentstore::backend::firestore::{FirestoreBackend, FirestoreConfig};
use agentstore::backend::DocumentBackend;
use agentstore::store::{DataStore, StoreOptions};

use crate::common::servers;

pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// What one test gets: a backend holding no data, and whatever keeps it alive.
pub struct Ctx {
    pub backend: Arc<dyn DocumentBackend>,
    pub backend_name: &'static str,
    /// Why this test server cannot keep numbers beyond double precision, when it cannot (the
    /// production system can; the difference is covered by that backend's replay tests).
    pub inexact_numbers: Option<String>,
    /// The backend's URL, for tests that open it from other processes; `None` for a backend one
    /// process opens at a time (the embedded file).
    pub url: Option<String>,
    /// Why this test server cannot erase without trace, when it cannot (pouchdb-server has no
    /// `_purge`; Apache CouchDB has, covered by the replay tests): erasure must then refuse and
    /// change nothing.
    pub no_purge: Option<String>,
    /// Why this test server cannot list a database whose name holds `/` under its name, when it
    /// cannot (pouchdb-server's `_all_dbs` leaves the `/` out; Apache CouchDB lists it).
    pub slash_names_unlisted: Option<String>,
    /// Why this test server cannot list local documents, when it cannot (pouchdb-server has no
    /// `_local_docs`; Apache CouchDB 2.0 and later have): the listing must then be refused with
    /// an error that says so, never answered empty.
    pub no_local_listing: Option<String>,
    /// The backend's URL as `backend::open` and `open_catalog` take it (for the embedded store
    /// too: its catalog's files go beside the test's data-store file).
    pub backend_url: String,
    _keep_alive: Box<dyn Any + Send + Sync>,
}

impl Ctx {
    /// The facade with default options.
    pub async fn store(&self) -> DataStore {
        self.store_with(StoreOptions::default()).await
    }

    pub async fn store_with(&self, options: StoreOptions) -> DataStore {
        DataStore::open(Arc::clone(&self.backend), options).await.expect("DataStore::open")
    }
}

pub struct BackendHarness {
    pub name: &'static str,
    /// Where this backend's tests run, for the run's report.
    pub describe: fn() -> String,
    /// A fresh backend for one test; an error means the server is unreachable.
    pub fresh: fn() -> BoxFuture<Result<Ctx, String>>,
}

pub fn all() -> Vec<BackendHarness> {
    vec![
        BackendHarness {
            name: "embedded",
            describe: || "redb file in a new temporary directory per test".into(),
            fresh: || Box::pin(fresh_embedded()),
        },
        BackendHarness {
            name: "couchdb",
            describe: || match servers::couchdb() {
                Ok(server) => format!(
                    "{} at {} (a new database per test)",
                    server.product,
                    server.url.rsplit('@').next().unwrap_or("?")
                ),
                Err(e) => format!("UNAVAILABLE: {e}"),
            },
            fresh: || Box::pin(fresh_couchdb()),
        },
        BackendHarness {
            name: "dynamodb",
            describe: || match servers::dynamodb() {
                Ok(server) => format!("{} at {} (a new table per test)", server.product, server.endpoint),
                Err(e) => format!("UNAVAILABLE: {e}"),
            },
            fresh: || Box::pin(fresh_dynamodb()),
        },
        BackendHarness {
            name: "firestore",
            describe: || match servers::firestore() {
                Ok(server) => format!("{} at {} (a new collection per test)", server.product, server.host_port),
                Err(e) => format!("UNAVAILABLE: {e}"),
            },
            fresh: || Box::pin(fresh_firestore()),
        },
    ]
}

async fn fresh_firestore() -> Result<Ctx, String> {
    let server = servers::firestore()?;
    let n = DATABASE_COUNTER.fetch_add(1, Ordering::Relaxed);
    let collection = format!("contract_{}_{n}", std::process::id());
    let url = server.collection_url(&collection);
    let config = FirestoreConfig::parse(&url).map_err(|e| e.to_string())?;
    let backend = FirestoreBackend::open(&config).await.map_err(|e| e.to_string())?;
    Ok(Ctx {
        backend: Arc::new(backend),
        backend_name: "firestore",
        inexact_numbers: None,
        url: Some(url.clone()),
        no_purge: None,
        slash_names_unlisted: None,
        no_local_listing: None,
        backend_url: url,
        _keep_alive: Box::new(()),
    })
}

async fn fresh_dynamodb() -> Result<Ctx, String> {
    let server = servers::dynamodb()?;
    let n = DATABASE_COUNTER.fetch_add(1, Ordering::Relaxed);
    let table = format!("contract_{}_{n}", std::process::id());
    let url = server.table_url(&table);
    let config = DynamoConfig::parse(&url).map_err(|e| e.to_string())?;
    let backend = DynamoDbBackend::open(&config).await.map_err(|e| e.to_string())?;
    Ok(Ctx {
        backend: Arc::new(backend),
        backend_name: "dynamodb",
        inexact_numbers: None,
        url: Some(url.clone()),
        no_purge: None,
        slash_names_unlisted: None,
        no_local_listing: None,
        backend_url: url,
        _keep_alive: Box::new(()),
    })
}

static DATABASE_COUNTER: AtomicUsize = AtomicUsize::new(0);

async fn fresh_couchdb() -> Result<Ctx, String> {
    let server = servers::couchdb()?;
    let n = DATABASE_COUNTER.fetch_add(1, Ordering::Relaxed);
    let database = format!("contract_{}_{n}", std::process::id());
    let url = server.database_url(&database);
    let config = CouchConfig::parse(&url).map_err(|e| e.to_string())?;
    let backend = CouchDbBackend::open(&config).await.map_err(|e| e.to_string())?;
    let inexact_numbers = (!server.exact_numbers)
        .then(|| format!("{} stores numbers as JS doubles (Apache CouchDB keeps them exact)", server.product));
    let no_purge = (!server.exact_numbers)
        .then(|| format!("{} answers _purge with 400 only_multipart_accepted (Apache CouchDB purges)", server.product));
    let slash_names_unlisted = (!server.exact_numbers)
        .then(|| format!("{} lists database a/b as ab in _all_dbs (Apache CouchDB lists a/b)", server.product));
    let no_local_listing = (!server.exact_numbers)
        .then(|| format!("{} has no _local_docs (Apache CouchDB lists local documents)", server.product));
    Ok(Ctx {
        backend: Arc::new(backend),
        backend_name: "couchdb",
        inexact_numbers,
        url: Some(url.clone()),
        no_purge,
        slash_names_unlisted,
        no_local_listing,
        backend_url: url,
        _keep_alive: Box::new(()),
    })
}

async fn fresh_embedded() -> Result<Ctx, String> {
    let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
    let file = dir.path().join("contract.redb");
    let backend = EmbeddedBackend::open(&file).await.map_err(|e| e.to_string())?;
    Ok(Ctx {
        backend: Arc::new(backend),
        backend_name: "embedded",
        inexact_numbers: None,
        url: None,
        no_purge: None,
        slash_names_unlisted: None,
        no_local_listing: None,
        backend_url: format!("embedded:{}", file.display()),
        _keep_alive: Box::new(dir),
    })
}

/// Every backend and the names of those selected, after printing (unless `quiet`, as when only
/// listing tests) which run against which server; `None`, after printing why, when the selection
/// names an unknown backend.
pub fn announce(suite: &str, quiet: bool) -> Option<(Vec<BackendHarness>, Vec<&'static str>)> {
    let backends = all();
    let selected = match selected(&backends) {
        Ok(selected) => selected,
        Err(message) => {
            eprintln!("{suite}: {message}");
            return None;
        }
    };
    if !quiet {
        println!("{suite} backends:");
        for backend in &backends {
            if selected.contains(&backend.name) {
                println!("  {:<10} RUN against {}", backend.name, (backend.describe)());
            } else {
                println!("  {:<10} DESELECTED by AGENTSTORE_TEST_BACKENDS", backend.name);
            }
        }
    }
    Some((backends, selected))
}

/// The backends named by `AGENTSTORE_TEST_BACKENDS`, or all. Unknown names are an error, so a
/// typo cannot deselect a backend silently.
pub fn selected(known: &[BackendHarness]) -> Result<Vec<&'static str>, String> {
    let names: Vec<&'static str> = known.iter().map(|b| b.name).collect();
    let Ok(list) = std::env::var("AGENTSTORE_TEST_BACKENDS") else {
        return Ok(names);
    };
    let mut chosen = Vec::new();
    for wanted in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        match names.iter().find(|n| **n == wanted) {
            Some(name) => chosen.push(*name),
            None => {
                return Err(format!(
                    "AGENTSTORE_TEST_BACKENDS names unknown backend {wanted:?}; known: {}",
                    names.join(", ")
                ))
            }
        }
    }
    Ok(chosen)
}
