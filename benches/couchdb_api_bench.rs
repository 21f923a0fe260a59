//! CouchDB's HTTP API as clients use it: `agentstore serve --couchdb-listen` against
//! pouchdb-server, and against each backend's own calls.
//!
//! Run it with `cargo bench --bench benches -- couchdb_api_bench`. One run measures the same six client
//! operations, each as a closed loop of `BENCH_CLIENTS` (default 16, as the reference wrk run)
//! concurrent clients, each on its own keep-alive connection, for `BENCH_SECONDS` (default 3) per
//! phase:
//!
//! | operation  | over HTTP                                                      | native call          |
//! |------------|----------------------------------------------------------------|----------------------|
//! | `get`      | `GET /db/{id}` of a seeded document                            | `get`                |
//! | `put_rev`  | `PUT /db/{id}` with the current `_rev`; each client updates its own documents | `put`, `MatchRevision` |
//! | `create`   | `PUT /db/{new id}`                                             | `put`, `MustNotExist`|
//! | `find_100` | `POST /db/_find`, selector `{userId, namespace}` over a 100-document namespace, limit 100 | `query`, limit 100 |
//! | `all_docs` | `GET /db/_all_docs?include_docs=true&limit=100&startkey=…`     | `all_docs`, limit 100|
//! | `bulk_500` | `POST /db/_bulk_docs` of 500 new documents                     | `bulk_write` of 500  |
//!
//! Per backend of `BENCH_BACKENDS` (default `embedded,couchdb,dynamodb,firestore`) the release
//! binary cargo built for the bench (`CARGO_BIN_EXE_agentstore`) is started as `serve
//! --couchdb-listen 127.0.0.1:0` over a fresh store (a redb file; a database on pouchdb-server; a
//! dynalite table; a Firestore emulator collection, the servers started as the tests start them,
//! `tests/common/servers.rs`), 1,000 documents (1 user × 10 namespaces × 100 keys, the facade's
//! bodies) are written through its `_bulk_docs` (not timed), and the six operations are measured
//! over HTTP. Then the server is stopped, the same store is opened in this process, and the same
//! operations are measured as `DocumentBackend` calls: the overhead of the API (HTTP, JSON, the
//! data-store checks) over what the backend itself costs.
//!
//! On the embedded store each operation is also measured, right after the endpoint's phase,
//! against pouchdb-server 4.2.0 itself (`node_modules/.bin/pouchdb-server --in-memory`, i.e.
//! PouchDB over memdown, with admin credentials, on a database of its own seeded the same way and
//! with a Mango index on `[userId, namespace]`), side by side in one table, and, when
//! `BENCH_COUCHDB_URL` names one (e.g. `http://admin:password@127.0.0.1:15984`), against a real
//! Apache CouchDB 3.4.3 on a database of its own seeded and indexed the same way, measured in the
//! same run right after pouchdb-server. Without it the CouchDB column says why it is empty; the
//! fuller comparison with a real CouchDB is `versus_couchdb`.
//!
//! Latency is wall-clock around one whole request including its full body (request bodies are
//! built before the clock starts); throughput is successful requests over the phase's time;
//! requests in flight at the deadline are finished and counted. Any transport error, non-2xx
//! status or wrong answer (a listing without its 100 documents, a per-document error of
//! `_bulk_docs`) is an error, and the bench exits 1 if any phase's error rate is over 1%. Where
//! the endpoint answers `POST _find` with 404 or 405 (not built yet), `find_100` is printed as "not
//! measured" with the reason, never a number. Results go to stdout as two tables and to
//! `target/bench/couchdb_api_bench.json`.
//!
//! `BENCH_MODE=front` measures instead the CouchDB API over the CouchDB backend in front of a
//! CouchDB server against that same server's own answers to the same requests (issue 22): the
//! server the tests use (`tests/common/servers.rs`: pouchdb-server 4.2.0 in memory, or
//! `AGENTSTORE_TEST_COUCHDB_URL`), one database seeded through agentstore, then per operation
//! (`get`, `put_rev`, `create`, `find_100`, `all_docs`, `bulk_100`) a phase straight to the
//! server (Basic auth) and a phase through agentstore, and the embedded store's `bulk_100`
//! against the server's. Before the timed phases, a separate `serve` whose backend URL points at
//! a counting proxy (`tests/common/counting_proxy.rs`) counts how many backend requests one API
//! request costs (20 sequential requests per operation after 3 warm-up ones); the proxy is not in
//! the timed path. One table goes to stdout and the JSON to
//! `target/bench/couchdb_api_bench_front.json`. Each side of each operation is timed in 4
//! segments of `BENCH_SECONDS`/4 alternating ABBA BAAB (the machine is shared; a change of load
//! falls on both sides alike). About 13 × `BENCH_SECONDS` of timed phases in all.
//!
//! `cargo test --all-targets` also builds and runs the bench binary (without `--bench`); it then only
//! prints how to run it and exits 0.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentstore::backend::{self, BulkWrite, DocumentBackend, IdRange, Precondition, Projection, Query, Revision};
use agentstore::model::document::{new_body, Access};
use agentstore::model::{timestamp, DocumentId, Limits};
use futures::StreamExt;
use hdrhistogram::Histogram;
use serde_json::{json, Map, Value};

use crate::common;
use crate::common::serve;
use crate::counting_proxy;
use crate::servers;

use common::load::{histogram, quantile_ms};
use common::report::aligned;
use common::workload::{metadata, value, AGENT, KEYS_PER_NAMESPACE, NAMESPACES, TOTAL_KEYS, USER};
use common::{bench_main, describe, run_suffix, write_report, Kind};
use serve::Server;

const NAME: &str = "couchdb_api_bench";
const BIN: &str = env!("CARGO_BIN_EXE_agentstore");
/// The error rate above which the bench fails.
const MAX_ERROR_RATE: f64 = 0.01;
/// Per-request timeout: a request that takes longer is an error.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// Documents per `_find` and `_all_docs` page: one seeded namespace.
const PAGE: usize = KEYS_PER_NAMESPACE;
/// Documents per `_bulk_docs` request.
const BULK_DOCS: usize = 500;
/// Documents per `_bulk_docs` request in the front mode.
const FRONT_BULK_DOCS: usize = 100;
/// pouchdb-server's credentials, as `tests/common/servers.rs` configures it.
const POUCHDB_LOGIN: (&str, &str) = ("admin", "password");

// ---- settings ----

struct Config {
    /// `BENCH_CLIENTS` (default 16): concurrent clients, one connection each.
    clients: usize,
    /// `BENCH_SECONDS` (default 3): duration of one phase.
    seconds: f64,
    /// `BENCH_BACKENDS` (default all four): the backends measured; pouchdb-server runs with
    /// `embedded`.
    backends: Vec<Kind>,
}

impl Config {
    fn from_env() -> Result<Self, String> {
        let clients = common::env_number("BENCH_CLIENTS", 16usize)?;
        let seconds = common::env_number("BENCH_SECONDS", 3.0f64)?;
        if clients == 0 {
            return Err("BENCH_CLIENTS must be at least 1".into());
        }
        if !(seconds.is_finite() && seconds > 0.0) {
            return Err("BENCH_SECONDS must be a positive number".into());
        }
        let names = std::env::var("BENCH_BACKENDS").unwrap_or_default();
        let backends = if names.trim().is_empty() {
            Kind::ALL.to_vec()
        } else {
            names.split(',').map(|name| Kind::parse(name.trim(), "BENCH_BACKENDS")).collect::<Result<Vec<_>, _>>()?
        };
        Ok(Config { clients, seconds, backends })
    }
}

impl Kind {
    /// A fresh store of this backend (the servers started on first use) and what serves it.
    fn fresh_store(self, dir: &Path) -> Result<(String, String), String> {
        let suffix = run_suffix();
        Ok(match self {
            Kind::Embedded => {
                (format!("embedded:{}", dir.join("bench.redb").display()), "redb file (embedded)".to_owned())
            }
            Kind::CouchDb => {
                let server = servers::couchdb()?;
                (server.database_url(&format!("couchdb_api_bench_{suffix}")), server.product)
            }
            Kind::DynamoDb => {
                let server = servers::dynamodb()?;
                (server.table_url(&format!("couchdb_api_bench_{suffix}")), server.product)
            }
            Kind::Firestore => {
                let server = servers::firestore()?;
                (server.collection_url(&format!("couchdb_api_bench_{suffix}")), server.product)
            }
        })
    }
}

// ---- the operations ----

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Get,
    PutRev,
    Create,
    Find,
    AllDocs,
    Bulk,
    /// `_bulk_docs` of 100 new documents (the front mode's size, as the issue measured).
    Bulk100,
}

impl Op {
    const ALL: [Op; 6] = [Op::Get, Op::PutRev, Op::Create, Op::Find, Op::AllDocs, Op::Bulk];

    fn name(self) -> &'static str {
        match self {
            Op::Get => "get",
            Op::PutRev => "put_rev",
            Op::Create => "create",
            Op::Find => "find_100",
            Op::AllDocs => "all_docs",
            Op::Bulk => "bulk_500",
            Op::Bulk100 => "bulk_100",
        }
    }

    /// Documents one request reads or writes.
    fn docs(self) -> usize {
        match self {
            Op::Get | Op::PutRev | Op::Create => 1,
            Op::Find | Op::AllDocs => PAGE,
            Op::Bulk => BULK_DOCS,
            Op::Bulk100 => FRONT_BULK_DOCS,
        }
    }
}

/// The `i`-th seeded document's id: namespace `ns-{i / 100}`, key `key-{i % 100}`.
fn seeded_id(i: usize) -> String {
    let i = i % TOTAL_KEYS;
    format!("{USER}:ns-{}:{}", i / KEYS_PER_NAMESPACE, agentstore::model::id::encode_key(&key_name(i)))
}

fn key_name(i: usize) -> String {
    format!("key-{:03}", i % KEYS_PER_NAMESPACE)
}

/// A document as a first write makes it: its id and the facade's body with a ~100-byte value.
fn document(namespace: &str, key: &str, seq: u64) -> Result<(String, Map<String, Value>), String> {
    let id = DocumentId::new(USER, namespace, key, &Limits::default()).map_err(|e| describe(&e))?;
    let Value::Object(metadata) = metadata(NAME, seq) else { unreachable!("metadata is an object") };
    let body = new_body(&id, value(seq), Some(metadata), &Access { agent: Some(AGENT), at: timestamp::now() });
    Ok((id.as_str().to_owned(), body))
}

/// The `seq`-th request's seeded document: a fixed permutation of the key space, so concurrent
/// clients read different documents (7919 is prime and coprime with 1,000).
fn spread(seq: u64) -> usize {
    ((seq % TOTAL_KEYS as u64) * 7919 % TOTAL_KEYS as u64) as usize
}

/// The seeded document the `round`-th update of `client` (of `clients`) rewrites: each client
/// owns the documents whose index is its own modulo `clients`, so updates never conflict.
fn owned(client: usize, clients: usize, round: u64) -> usize {
    let owned = TOTAL_KEYS.div_ceil(clients).max(1);
    let index = client + (round as usize % owned) * clients;
    if index < TOTAL_KEYS {
        index
    } else {
        client % TOTAL_KEYS
    }
}

/// What one request works on, built before its clock starts.
enum Input {
    Get { id: String },
    Put { index: usize, id: String, body: Map<String, Value> },
    Create { id: String, body: Map<String, Value> },
    Find { namespace: String },
    AllDocs { start: String },
    Bulk { docs: Vec<(String, Map<String, Value>)> },
}

impl Input {
    /// Request `seq` of `op` (the `round`-th of `client`); new documents go to a namespace of
    /// their own per `side` and operation, so reruns on one store never collide.
    fn new(op: Op, side: &str, client: usize, clients: usize, round: u64, seq: u64) -> Result<Input, String> {
        Ok(match op {
            Op::Get => Input::Get { id: seeded_id(spread(seq)) },
            Op::PutRev => {
                let index = owned(client, clients, round);
                let namespace = format!("ns-{}", index / KEYS_PER_NAMESPACE);
                let (id, body) = document(&namespace, &key_name(index), seq)?;
                Input::Put { index, id, body }
            }
            Op::Create => {
                let (id, body) = document(&format!("new-{side}"), &format!("c-{seq:07}"), seq)?;
                Input::Create { id, body }
            }
            Op::Find => Input::Find { namespace: format!("ns-{}", seq % NAMESPACES as u64) },
            Op::AllDocs => Input::AllDocs { start: format!("{USER}:ns-{}:", seq % NAMESPACES as u64) },
            Op::Bulk | Op::Bulk100 => {
                let namespace = format!("bulk-{side}");
                let docs = (0..op.docs())
                    .map(|i| document(&namespace, &format!("b-{seq:05}-{i:03}"), seq))
                    .collect::<Result<_, _>>()?;
                Input::Bulk { docs }
            }
        })
    }
}

/// What answers the operations: CouchDB's API over HTTP, or a backend in this process.
trait Target: Send + Sync + 'static {
    /// One request, on the calling client's own connection.
    fn call(
        &self,
        http: &reqwest::Client,
        input: Input,
    ) -> impl std::future::Future<Output = Result<(), String>> + Send;
}

// ---- over HTTP ----

/// A CouchDB-protocol database: `db` is `http://host:port/name`.
struct Http {
    db: String,
    login: Option<(&'static str, &'static str)>,
    /// The current `_rev` of each seeded document, for `put_rev` (shared by the two sides of the
    /// front mode, which update the same documents in turn).
    revs: Arc<Vec<Mutex<String>>>,
}

/// A client with one keep-alive connection, as each wrk connection.
fn http_client() -> Result<reqwest::Client, String> {
    reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(1)
        .pool_idle_timeout(Duration::from_secs(90))
        .tcp_nodelay(true)
        .timeout(REQUEST_TIMEOUT)
        .build()
        .map_err(|e| format!("HTTP client: {}", describe(&e)))
}

/// A JSON string as a query parameter's value.
fn json_param(text: &str) -> String {
    percent_encoding::utf8_percent_encode(&Value::from(text).to_string(), percent_encoding::NON_ALPHANUMERIC)
        .to_string()
}

impl Http {
    fn request(&self, http: &reqwest::Client, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let request =
            http.request(method, format!("{}{path}", self.db)).header(reqwest::header::ACCEPT, "application/json");
        match self.login {
            Some((user, password)) => request.basic_auth(user, Some(password)),
            None => request,
        }
    }

    /// Sends a request with an optional JSON body (already encoded); answers status and the
    /// parsed body of a 2xx, or what failed.
    async fn send(
        &self,
        http: &reqwest::Client,
        method: reqwest::Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(u16, Value), String> {
        let mut request = self.request(http, method.clone(), path);
        if let Some(body) = body {
            request = request.header(reqwest::header::CONTENT_TYPE, "application/json").body(body);
        }
        let response = request.send().await.map_err(|e| format!("{method} {path}: {}", describe(&e)))?;
        let status = response.status();
        let bytes = response.bytes().await.map_err(|e| format!("{method} {path}: reading the body: {e}"))?;
        if !status.is_success() {
            let text = String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned();
            return Err(format!("{method} {path}: status {status}: {text}"));
        }
        let body = serde_json::from_slice(&bytes).map_err(|e| format!("{method} {path}: not JSON: {e}"))?;
        Ok((status.as_u16(), body))
    }

    /// Writes the 1,000 seeded documents with `_bulk_docs` in namespace-sized batches and
    /// records their revisions (not timed).
    async fn seed(&mut self, http: &reqwest::Client) -> Result<(), String> {
        let mut revs = vec![String::new(); TOTAL_KEYS];
        for ns in 0..NAMESPACES {
            let range = ns * KEYS_PER_NAMESPACE..(ns + 1) * KEYS_PER_NAMESPACE;
            let docs = range
                .clone()
                .map(|i| document(&format!("ns-{ns}"), &key_name(i), i as u64).map(|(id, body)| with_id(id, body)))
                .collect::<Result<Vec<_>, _>>()?;
            let written = self.bulk_docs(http, docs).await.map_err(|e| format!("seeding: {e}"))?;
            for (i, rev) in range.zip(written) {
                revs[i] = rev;
            }
        }
        self.revs = Arc::new(revs.into_iter().map(Mutex::new).collect());
        Ok(())
    }

    /// `POST _bulk_docs`: the revisions written, in order; any per-document error fails it.
    async fn bulk_docs(&self, http: &reqwest::Client, docs: Vec<Value>) -> Result<Vec<String>, String> {
        let count = docs.len();
        let body = serde_json::to_vec(&json!({ "docs": docs })).map_err(|e| e.to_string())?;
        let (_, answer) = self.send(http, reqwest::Method::POST, "/_bulk_docs", Some(body)).await?;
        let results = answer.as_array().ok_or_else(|| format!("_bulk_docs answered {answer}"))?;
        if results.len() != count {
            return Err(format!("_bulk_docs answered {} results for {count} documents", results.len()));
        }
        results
            .iter()
            .map(|r| match r["rev"].as_str() {
                Some(rev) if r.get("error").is_none() => Ok(rev.to_owned()),
                _ => Err(format!("_bulk_docs: {r}")),
            })
            .collect()
    }

    /// Whether the server answers `POST _find`: a 404 (no such route) or 405 (taken for a
    /// document path) means it has none, and `Err` is the reason `find_100` is not measured.
    async fn probe_find(&self, http: &reqwest::Client) -> Result<(), String> {
        let body = json!({ "selector": { "userId": USER, "namespace": "ns-0" }, "limit": 1 });
        let response = self
            .request(http, reqwest::Method::POST, "/_find")
            .json(&body)
            .send()
            .await
            .map_err(|e| format!("POST _find: {}", describe(&e)))?;
        let status = response.status();
        let text = response.text().await.unwrap_or_default();
        if matches!(status, reqwest::StatusCode::NOT_FOUND | reqwest::StatusCode::METHOD_NOT_ALLOWED) {
            Err(format!("POST {}/_find answered {status}: {}", self.db, text.trim()))
        } else {
            Ok(())
        }
    }
}

/// A body with `_id` first, as clients send it.
fn with_id(id: String, body: Map<String, Value>) -> Value {
    let mut doc = Map::with_capacity(body.len() + 1);
    doc.insert("_id".into(), id.into());
    doc.extend(body);
    Value::Object(doc)
}

/// A listing's documents must be the 100 of one namespace.
fn check_count(what: &str, found: usize) -> Result<(), String> {
    if found == PAGE {
        Ok(())
    } else {
        Err(format!("{what} found {found} documents, expected {PAGE}"))
    }
}

fn path_of(id: &str) -> String {
    format!("/{}", percent_encoding::utf8_percent_encode(id, percent_encoding::NON_ALPHANUMERIC))
}

impl Target for Http {
    async fn call(&self, http: &reqwest::Client, input: Input) -> Result<(), String> {
        use reqwest::Method;
        let encode = |doc: &Value| serde_json::to_vec(doc).map_err(|e| e.to_string());
        match input {
            Input::Get { id } => {
                let (_, doc) = self.send(http, Method::GET, &path_of(&id), None).await?;
                match doc["_id"].as_str() == Some(id.as_str()) {
                    true => Ok(()),
                    false => Err(format!("GET {id} answered {doc}")),
                }
            }
            Input::Put { index, id, body } => {
                let mut doc = with_id(id.clone(), body);
                let rev = self.revs[index].lock().unwrap_or_else(|e| e.into_inner()).clone();
                doc["_rev"] = rev.into();
                let (_, answer) = self.send(http, Method::PUT, &path_of(&id), Some(encode(&doc)?)).await?;
                let rev = answer["rev"].as_str().ok_or_else(|| format!("PUT {id} answered {answer}"))?;
                *self.revs[index].lock().unwrap_or_else(|e| e.into_inner()) = rev.to_owned();
                Ok(())
            }
            Input::Create { id, body } => {
                let doc = with_id(id.clone(), body);
                self.send(http, Method::PUT, &path_of(&id), Some(encode(&doc)?)).await.map(|_| ())
            }
            Input::Find { namespace } => {
                let query = json!({ "selector": { "userId": USER, "namespace": namespace }, "limit": PAGE });
                let (_, answer) = self.send(http, Method::POST, "/_find", Some(encode(&query)?)).await?;
                let found = answer["docs"].as_array().map_or(0, Vec::len);
                check_count(&format!("_find of {namespace}"), found)
            }
            Input::AllDocs { start } => {
                let path = format!("/_all_docs?include_docs=true&limit={PAGE}&startkey={}", json_param(&start));
                let (_, answer) = self.send(http, Method::GET, &path, None).await?;
                let rows = answer["rows"].as_array().map(Vec::as_slice).unwrap_or_default();
                let in_namespace = rows
                    .iter()
                    .filter(|r| r["id"].as_str().is_some_and(|id| id.starts_with(&start)) && r["doc"].is_object())
                    .count();
                check_count(&format!("_all_docs from {start}"), in_namespace)
            }
            Input::Bulk { docs } => {
                let docs = docs.into_iter().map(|(id, body)| with_id(id, body)).collect();
                self.bulk_docs(http, docs).await.map(|_| ())
            }
        }
    }
}

// ---- in process ----

/// The backend's own calls, in this process.
struct Native {
    backend: Arc<dyn DocumentBackend>,
    /// The current revision of each seeded document, for `put_rev`.
    revs: Vec<Mutex<Revision>>,
}

impl Native {
    /// Opens `url` and reads the seeded documents' current revisions (not timed).
    async fn open(url: &str, clients: usize) -> Result<Native, String> {
        let url: backend::BackendUrl = url.parse().map_err(|e| format!("{url}: {}", describe(&e)))?;
        let backend = backend::open(&url).await.map_err(|e| format!("opening {url}: {}", describe(&e)))?;
        let revs: Vec<Result<Revision, String>> = futures::stream::iter(0..TOTAL_KEYS)
            .map(|i| {
                let backend = Arc::clone(&backend);
                async move {
                    let id = seeded_id(i);
                    match backend.get(&id).await {
                        Ok(Some(doc)) => Ok(doc.rev),
                        Ok(None) => Err(format!("{id} is missing")),
                        Err(e) => Err(format!("reading {id}: {}", describe(&e))),
                    }
                }
            })
            .buffered(clients)
            .collect()
            .await;
        let revs = revs.into_iter().map(|r| r.map(Mutex::new)).collect::<Result<_, _>>()?;
        Ok(Native { backend, revs })
    }
}

impl Target for Native {
    async fn call(&self, _http: &reqwest::Client, input: Input) -> Result<(), String> {
        let backend = &self.backend;
        let fail = |what: &str, e: agentstore::Error| format!("{what}: {}", describe(&e));
        match input {
            Input::Get { id } => match backend.get(&id).await.map_err(|e| fail("get", e))? {
                Some(_) => Ok(()),
                None => Err(format!("get: {id} is missing")),
            },
            Input::Put { index, id, body } => {
                let rev = self.revs[index].lock().unwrap_or_else(|e| e.into_inner()).clone();
                let rev =
                    backend.put(&id, &body, Precondition::MatchRevision(rev)).await.map_err(|e| fail("put", e))?;
                *self.revs[index].lock().unwrap_or_else(|e| e.into_inner()) = rev;
                Ok(())
            }
            Input::Create { id, body } => {
                backend.put(&id, &body, Precondition::MustNotExist).await.map(|_| ()).map_err(|e| fail("put", e))
            }
            Input::Find { namespace } => {
                let query =
                    Query { user_id: USER.to_owned(), namespace: Some(namespace.clone()), projection: Projection::All };
                let page = backend.query(&query, PAGE, None).await.map_err(|e| fail("query", e))?;
                check_count(&format!("query of {namespace}"), page.items.len())
            }
            Input::AllDocs { start } => {
                let range = IdRange { start: Some(start.clone()), ..IdRange::all() };
                let page = backend.all_docs(&range, PAGE, None).await.map_err(|e| fail("all_docs", e))?;
                check_count(
                    &format!("all_docs from {start}"),
                    page.items.iter().filter(|d| d.id.starts_with(&start)).count(),
                )
            }
            Input::Bulk { docs } => {
                let writes =
                    docs.into_iter().map(|(id, body)| BulkWrite { id, body, precondition: Precondition::MustNotExist });
                let results = backend.bulk_write(writes.collect()).await.map_err(|e| fail("bulk_write", e))?;
                match results.into_iter().find_map(Result::err) {
                    None => Ok(()),
                    Some(e) => Err(fail("bulk_write", e)),
                }
            }
        }
    }
}

// ---- the closed loop ----

/// One phase's measurements.
struct Phase {
    requests: u64,
    errors: u64,
    elapsed: Duration,
    /// Latency of successful requests, in microseconds.
    latency: Histogram<u64>,
    first_error: Option<String>,
}

impl Phase {
    fn ok(&self) -> u64 {
        self.requests - self.errors
    }

    fn rate(&self) -> f64 {
        if self.elapsed.is_zero() {
            0.0
        } else {
            self.ok() as f64 / self.elapsed.as_secs_f64()
        }
    }

    fn error_rate(&self) -> f64 {
        if self.requests == 0 {
            1.0
        } else {
            self.errors as f64 / self.requests as f64
        }
    }

    fn to_json(&self, op: Op) -> Value {
        json!({
            "requests": self.requests,
            "errors": self.errors,
            "error_rate": self.error_rate(),
            "elapsed_s": self.elapsed.as_secs_f64(),
            "requests_per_s": self.rate(),
            "docs_per_s": self.rate() * op.docs() as f64,
            "p50_ms": quantile_ms(&self.latency, 0.50),
            "p99_ms": quantile_ms(&self.latency, 0.99),
            "first_error": self.first_error,
        })
    }
}

/// `clients` tasks, each on its own connection, sending one `op` at a time until `seconds` pass.
async fn run_phase<T: Target>(target: &Arc<T>, op: Op, side: &'static str, config: &Config) -> Result<Phase, String> {
    let issued = Arc::new(AtomicU64::new(0));
    let first_error = Arc::new(Mutex::new(None::<String>));
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(config.seconds);
    let mut tasks = Vec::with_capacity(config.clients);
    for client in 0..config.clients {
        let (target, issued, first_error) = (Arc::clone(target), Arc::clone(&issued), Arc::clone(&first_error));
        let (clients, http) = (config.clients, http_client()?);
        tasks.push(tokio::spawn(async move {
            let mut latency = histogram();
            let (mut requests, mut errors) = (0u64, 0u64);
            while Instant::now() < deadline {
                let seq = issued.fetch_add(1, Ordering::Relaxed);
                let outcome = match Input::new(op, side, client, clients, requests, seq) {
                    Ok(input) => {
                        let began = Instant::now();
                        let outcome = target.call(&http, input).await;
                        outcome.map(|()| began.elapsed())
                    }
                    Err(e) => Err(e),
                };
                requests += 1;
                match outcome {
                    Ok(took) => latency.saturating_record((took.as_micros() as u64).max(1)),
                    Err(message) => {
                        errors += 1;
                        first_error.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(message);
                    }
                }
            }
            (requests, errors, latency)
        }));
    }
    let mut phase = Phase { requests: 0, errors: 0, elapsed: Duration::ZERO, latency: histogram(), first_error: None };
    for task in tasks {
        let (requests, errors, latency) = task.await.map_err(|e| format!("a client task failed: {e}"))?;
        phase.requests += requests;
        phase.errors += errors;
        phase.latency.add(&latency).map_err(|e| e.to_string())?;
    }
    phase.elapsed = start.elapsed();
    phase.first_error = first_error.lock().unwrap_or_else(|e| e.into_inner()).take();
    Ok(phase)
}

/// One operation on one target: measured, or why not.
enum Outcome {
    Measured(Phase),
    NotMeasured(String),
}

impl Outcome {
    fn phase(&self) -> Option<&Phase> {
        match self {
            Outcome::Measured(phase) => Some(phase),
            Outcome::NotMeasured(_) => None,
        }
    }

    fn to_json(&self, op: Op) -> Value {
        match self {
            Outcome::Measured(phase) => phase.to_json(op),
            Outcome::NotMeasured(why) => json!({ "not_measured": why }),
        }
    }
}

// ---- one backend ----

/// What was measured on one backend: the endpoint, the native calls, and on the embedded store
/// pouchdb-server; one entry per operation of [`Op::ALL`].
struct BackendResult {
    kind: Kind,
    store: String,
    endpoint: Vec<Outcome>,
    native: Vec<Outcome>,
    pouchdb: Option<(String, Vec<Outcome>)>,
    /// The real Apache CouchDB at `BENCH_COUCHDB_URL` beside the embedded store, or why not.
    apache_couchdb: Result<(String, Vec<Outcome>), String>,
}

/// pouchdb-server with a fresh database, seeded as the endpoint is and with a Mango index on
/// `[userId, namespace]`, as CouchDB's `idx-user-namespace`.
async fn pouchdb(http: &reqwest::Client) -> Result<(String, Http), String> {
    let server = servers::couchdb()?;
    let port = server.url.rsplit(':').next().unwrap_or_default();
    let db = format!("http://127.0.0.1:{port}/couchdb_api_bench_{}", run_suffix());
    let target = prepared(http, Http { db, login: Some(POUCHDB_LOGIN), revs: Arc::default() }).await?;
    Ok((format!("{}, in memory (memdown)", server.product), target))
}

/// `target`'s database created, given a Mango index on `[userId, namespace]` (as CouchDB's
/// `idx-user-namespace`) and seeded as the endpoint is.
async fn prepared(http: &reqwest::Client, mut target: Http) -> Result<Http, String> {
    target.send(http, reqwest::Method::PUT, "", None).await.map_err(|e| format!("creating the database: {e}"))?;
    let index = json!({ "index": { "fields": ["userId", "namespace"] }, "name": "idx-user-namespace", "type": "json" });
    target
        .send(http, reqwest::Method::POST, "/_index", Some(index.to_string().into_bytes()))
        .await
        .map_err(|e| format!("creating the index: {e}"))?;
    target.seed(http).await?;
    Ok(target)
}

/// A real Apache CouchDB at `BENCH_COUCHDB_URL` (its credentials in the URL) with a fresh database,
/// seeded and indexed as pouchdb-server's; `Ok(None)` when the variable is unset.
async fn apache_couchdb(http: &reqwest::Client) -> Result<Option<(String, Http)>, String> {
    let Some(url) = crate::common::targets::real_couchdb_url() else { return Ok(None) };
    let mut parsed = reqwest::Url::parse(&url).map_err(|e| format!("BENCH_COUCHDB_URL: {e}"))?;
    let login = match parsed.username() {
        "" => None,
        user => {
            let password = parsed.password().unwrap_or_default().to_owned();
            // Leaked once per run: the targets' logins are `'static` as pouchdb-server's constant is.
            Some((&*Box::leak(user.to_owned().into_boxed_str()), &*Box::leak(password.into_boxed_str())))
        }
    };
    parsed.set_username("").map_err(|()| "BENCH_COUCHDB_URL: cannot drop its user".to_owned())?;
    parsed.set_password(None).map_err(|()| "BENCH_COUCHDB_URL: cannot drop its password".to_owned())?;
    let server = parsed.as_str().trim_end_matches('/').to_owned();
    let welcome = Http { db: server.clone(), login, revs: Arc::default() };
    let (_, about) = welcome.send(http, reqwest::Method::GET, "/", None).await.map_err(|e| format!("GET /: {e}"))?;
    let product = format!("Apache CouchDB {}", about["version"].as_str().unwrap_or("(version unknown)"));
    let db = format!("{server}/couchdb_api_bench_{}", run_suffix());
    let target = prepared(http, Http { db, login, revs: Arc::default() }).await?;
    Ok(Some((product, target)))
}

/// The endpoint over `kind` (and pouchdb-server, and a real CouchDB when one is named, beside it
/// on the embedded store), then the same store in process.
async fn measure_backend(kind: Kind, config: &Config) -> Result<BackendResult, String> {
    let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
    let (url, store) = kind.fresh_store(dir.path())?;
    println!("{}: {store}", kind.name());
    let server = Server::start_with_couchdb(BIN, &url, dir.path())?;
    let db = server.couchdb.clone().ok_or("the server printed no CouchDB API address")?;
    let http = http_client()?;
    let seeding = Instant::now();
    let mut endpoint = Http { db, login: None, revs: Arc::default() };
    endpoint.seed(&http).await?;
    let find = endpoint.probe_find(&http).await;
    let pouch = match kind {
        Kind::Embedded => Some(pouchdb(&http).await.map_err(|e| format!("pouchdb-server: {e}"))?),
        _ => None,
    };
    let apache = match kind {
        Kind::Embedded => apache_couchdb(&http).await.map_err(|e| format!("Apache CouchDB: {e}"))?,
        _ => None,
    };
    println!("  seeded {TOTAL_KEYS} documents in {:.2} s (not timed)", seeding.elapsed().as_secs_f64());
    let endpoint = Arc::new(endpoint);
    let pouch = pouch.map(|(product, target)| (product, Arc::new(target)));
    let apache = apache.map(|(product, target)| (product, Arc::new(target)));
    let (mut endpoint_outcomes, mut pouch_outcomes, mut apache_outcomes) = (Vec::new(), Vec::new(), Vec::new());
    for op in Op::ALL {
        endpoint_outcomes.push(match (&find, op) {
            (Err(why), Op::Find) => Outcome::NotMeasured(why.clone()),
            _ => Outcome::Measured(run_phase(&endpoint, op, "endpoint", config).await?),
        });
        if let Some((_, target)) = &pouch {
            pouch_outcomes.push(Outcome::Measured(run_phase(target, op, "pouchdb", config).await?));
        }
        if let Some((_, target)) = &apache {
            apache_outcomes.push(Outcome::Measured(run_phase(target, op, "apache-couchdb", config).await?));
        }
        println!("  {:<9} over HTTP done", op.name());
    }
    server.stop()?;
    if let Some((_, target)) = &apache {
        if let Err(err) = target.send(&http, reqwest::Method::DELETE, "", None).await {
            println!("  the Apache CouchDB database {} was not deleted: {err}", target.db);
        }
    }
    let native = Arc::new(Native::open(&url, config.clients).await?);
    let mut native_outcomes = Vec::new();
    for op in Op::ALL {
        native_outcomes.push(Outcome::Measured(run_phase(&native, op, "native", config).await?));
    }
    println!("  native calls done");
    Ok(BackendResult {
        kind,
        store,
        endpoint: endpoint_outcomes,
        native: native_outcomes,
        pouchdb: pouch.map(|(product, _)| (product, pouch_outcomes)),
        apache_couchdb: match apache {
            Some((product, _)) => Ok((product, apache_outcomes)),
            None if kind == Kind::Embedded => Err("not measured: BENCH_COUCHDB_URL is not set".to_owned()),
            None => Err("measured beside the embedded store only".to_owned()),
        },
    })
}

// ---- reporting ----

fn cell(value: Option<f64>, decimals: usize) -> String {
    value.filter(|v| v.is_finite()).map_or_else(|| "-".to_owned(), |v| format!("{v:.decimals$}"))
}

/// The columns of one measured side: requests, errors, req/s, docs/s, p50, p99 (or "not
/// measured").
fn side_cells(op: Op, outcome: &Outcome) -> Vec<String> {
    match outcome {
        Outcome::Measured(p) => vec![
            p.requests.to_string(),
            p.errors.to_string(),
            format!("{:.0}", p.rate()),
            format!("{:.0}", p.rate() * op.docs() as f64),
            format!("{:.2}", quantile_ms(&p.latency, 0.50)),
            format!("{:.2}", quantile_ms(&p.latency, 0.99)),
        ],
        Outcome::NotMeasured(_) => {
            let mut cells = vec!["not measured".to_owned()];
            cells.extend(std::iter::repeat_n("-".to_owned(), 5));
            cells
        }
    }
}

/// (a) and (b): the endpoint on the embedded store against pouchdb-server and a real CouchDB.
fn side_by_side(result: &BackendResult) -> Option<String> {
    let (product, pouch) = result.pouchdb.as_ref()?;
    let header =
        ["operation", "server", "requests", "errors", "req/s", "docs/s", "p50 ms", "p99 ms", "x pouchdb", "x CouchDB"];
    let mut rows = Vec::new();
    for (i, op) in Op::ALL.into_iter().enumerate() {
        let (ours, theirs) = (&result.endpoint[i], &pouch[i]);
        let vs_pouch = ours.phase().zip(theirs.phase()).map(|(o, t)| o.rate() / t.rate());
        let apache = result.apache_couchdb.as_ref().ok().map(|(_, outcomes)| &outcomes[i]);
        let vs_apache = ours.phase().zip(apache.and_then(Outcome::phase)).map(|(o, t)| o.rate() / t.rate());
        let mut row = vec![op.name().to_owned(), "agentstore (embedded)".to_owned()];
        row.extend(side_cells(op, ours));
        row.extend([cell(vs_pouch, 2), cell(vs_apache, 2)]);
        rows.push(row);
        let mut row = vec![String::new(), "pouchdb-server".to_owned()];
        row.extend(side_cells(op, theirs));
        row.extend([String::new(), String::new()]);
        rows.push(row);
        if let Some(apache) = apache {
            let mut row = vec![String::new(), "Apache CouchDB".to_owned()];
            row.extend(side_cells(op, apache));
            row.extend([String::new(), String::new()]);
            rows.push(row);
        }
    }
    let apache = match &result.apache_couchdb {
        Ok((product, _)) => format!("{product}, in the same run"),
        Err(why) => format!("Apache CouchDB: {why}"),
    };
    Some(format!("{}({product}; {apache}; x = agentstore req/s over theirs)\n", aligned(&header, &rows, 2)))
}

/// (c): the endpoint on each backend against that backend's own calls.
fn overhead(results: &[BackendResult]) -> String {
    let header = [
        "backend",
        "operation",
        "endpoint req/s",
        "p50 ms",
        "p99 ms",
        "native ops/s",
        "p50 ms",
        "p99 ms",
        "native/endpoint ops/s",
        "endpoint/native p50",
    ];
    let mut rows = Vec::new();
    for result in results {
        for (i, op) in Op::ALL.into_iter().enumerate() {
            let (ours, native) = (result.endpoint[i].phase(), result.native[i].phase());
            let p50 = |p: &Phase| quantile_ms(&p.latency, 0.50);
            let p99 = |p: &Phase| quantile_ms(&p.latency, 0.99);
            rows.push(vec![
                if i == 0 { result.kind.name().to_owned() } else { String::new() },
                op.name().to_owned(),
                ours.map_or_else(|| "not measured".to_owned(), |p| format!("{:.0}", p.rate())),
                cell(ours.map(p50), 2),
                cell(ours.map(p99), 2),
                cell(native.map(Phase::rate), 0),
                cell(native.map(p50), 2),
                cell(native.map(p99), 2),
                cell(ours.zip(native).map(|(o, n)| n.rate() / o.rate()), 2),
                cell(ours.zip(native).map(|(o, n)| p50(o) / p50(n)), 2),
            ]);
        }
    }
    format!(
        "{}(native: the backend's DocumentBackend calls in this process on the same store, measured after the \
         endpoint's phases; ratios above 1 mean the endpoint is slower)\n",
        aligned(&header, &rows, 2)
    )
}

/// Every phase over the error limit, and every operation not measured; whether all passed.
fn report_failures(results: &[BackendResult]) -> bool {
    let mut passed = true;
    for result in results {
        let mut sides = vec![("endpoint", &result.endpoint), ("native", &result.native)];
        if let Some((_, pouch)) = &result.pouchdb {
            sides.push(("pouchdb-server", pouch));
        }
        for (side, outcomes) in sides {
            for (op, outcome) in Op::ALL.into_iter().zip(outcomes.iter()) {
                match outcome {
                    Outcome::NotMeasured(why) => {
                        println!("{} {side} {}: not measured: {why}", result.kind.name(), op.name())
                    }
                    Outcome::Measured(p) if p.errors > 0 || p.requests == 0 => {
                        passed &= p.error_rate() <= MAX_ERROR_RATE;
                        eprintln!(
                            "{NAME}: {} {side} {}: {} errors in {} requests ({:.2}%); first: {}",
                            result.kind.name(),
                            op.name(),
                            p.errors,
                            p.requests,
                            p.error_rate() * 100.0,
                            p.first_error.as_deref().unwrap_or("none sent")
                        );
                    }
                    Outcome::Measured(_) => {}
                }
            }
        }
    }
    passed
}

/// The JSON report; `load` is the load average before and after the run.
fn report_json(config: &Config, nproc: usize, load: [&str; 2], passed: bool, results: &[BackendResult]) -> Value {
    let operations = |outcomes: &[Outcome]| -> Value {
        Op::ALL
            .into_iter()
            .zip(outcomes)
            .map(|(op, o)| (op.name().to_owned(), o.to_json(op)))
            .collect::<Map<_, _>>()
            .into()
    };
    json!({
        "benchmark": NAME,
        "nproc": nproc,
        "load_average_before": load[0],
        "load_average_after": load[1],
        "clients": config.clients,
        "seconds_per_phase": config.seconds,
        "documents_seeded": TOTAL_KEYS,
        "bulk_docs_per_request": BULK_DOCS,
        "max_error_rate": MAX_ERROR_RATE,
        "passed": passed,
        "backends": results.iter().map(|r| json!({
            "backend": r.kind.name(),
            "store": r.store,
            "endpoint": operations(&r.endpoint),
            "native": operations(&r.native),
            "pouchdb_server": r.pouchdb.as_ref().map(|(product, o)| json!({ "server": product, "operations": operations(o) })),
            "apache_couchdb": match &r.apache_couchdb {
                Ok((product, o)) => json!({ "server": product, "operations": operations(o) }),
                Err(why) => json!({ "not_measured": why }),
            },
        })).collect::<Vec<_>>(),
    })
}

/// `uptime`'s load averages, as the machine is shared.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|text| text.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_owned())
}

pub fn main() -> std::process::ExitCode {
    bench_main(NAME, run)
}

fn run() -> Result<bool, String> {
    let config = Config::from_env()?;
    match std::env::var("BENCH_MODE").unwrap_or_default().trim() {
        "" | "backends" => {}
        "front" => return front::run(&config),
        other => return Err(format!("BENCH_MODE={other:?}: expected `backends` (the default) or `front`")),
    }
    let nproc = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let load = load_average();
    println!(
        "{NAME}: nproc {nproc}, load average {load}; {} clients on their own keep-alive connections, {} s per \
         phase; backends: {}",
        config.clients,
        config.seconds,
        config.backends.iter().map(|k| k.name()).collect::<Vec<_>>().join(", ")
    );
    println!("binary: {BIN}");
    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| format!("tokio runtime: {e}"))?;
    let mut results = Vec::new();
    for &kind in &config.backends {
        let result = runtime.block_on(measure_backend(kind, &config)).map_err(|e| format!("{}: {e}", kind.name()))?;
        results.push(result);
    }
    drop(runtime);
    let load_after = load_average();
    println!("\nload average after: {load_after}");
    if let Some(table) = results.iter().find_map(side_by_side) {
        println!();
        print!("{table}");
    }
    println!();
    print!("{}", overhead(&results));
    let passed = report_failures(&results);
    write_report(NAME, &report_json(&config, nproc, [&load, &load_after], passed, &results))?;
    if !passed {
        eprintln!("{NAME}: FAILED: a phase's error rate is over {:.0}%", MAX_ERROR_RATE * 100.0);
    }
    Ok(passed)
}

// ---- front mode ----

/// `BENCH_MODE=front`: the CouchDB API over the CouchDB backend in front of a CouchDB server,
/// against that same server answering the same requests itself.
mod front {
    use super::*;
    use counting_proxy::CountingProxy;

    /// The operations measured, in order.
    const OPS: [Op; 6] = [Op::Get, Op::PutRev, Op::Create, Op::Find, Op::AllDocs, Op::Bulk100];
    /// Requests per operation before counting (namespace indexing, first-use probes, caches).
    const WARM_UP: u64 = 3;
    /// Requests per operation whose backend requests are counted.
    const COUNTED: u64 = 20;
    /// What the issue asks of each operation, as a share of the server's own rate.
    fn goal(op: Op) -> f64 {
        match op {
            Op::Get | Op::Find | Op::AllDocs => 0.9,
            _ => 0.85,
        }
    }

    /// One operation: the server's own phase, agentstore's in front of it, and the backend
    /// requests one API request cost (with the kinds seen).
    struct Row {
        op: Op,
        direct: Phase,
        through: Phase,
        backend_requests: f64,
        kinds: Vec<String>,
    }

    pub fn run(config: &Config) -> Result<bool, String> {
        let nproc = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let load = load_average();
        println!(
            "{NAME} (front): nproc {nproc}, load average {load}; {} clients on their own keep-alive connections, {} s \
             per phase",
            config.clients, config.seconds
        );
        println!("binary: {BIN}");
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("tokio runtime: {e}"))?;
        let (product, rows, embedded_bulk) = runtime.block_on(measure(config))?;
        drop(runtime);
        let load_after = load_average();
        println!("\nload average after: {load_after}\n");
        print!("{}", table(&product, &rows, &embedded_bulk));
        let mut passed = true;
        for (what, phase) in rows
            .iter()
            .flat_map(|r| {
                [(format!("{} direct", r.op.name()), &r.direct), (format!("{} agentstore", r.op.name()), &r.through)]
            })
            .chain([("bulk_100 embedded".to_owned(), &embedded_bulk)])
        {
            if phase.errors > 0 || phase.requests == 0 {
                passed &= phase.error_rate() <= MAX_ERROR_RATE;
                eprintln!(
                    "{NAME}: {what}: {} errors in {} requests; first: {}",
                    phase.errors,
                    phase.requests,
                    phase.first_error.as_deref().unwrap_or("none sent")
                );
            }
        }
        let report = json!({
            "benchmark": format!("{NAME} front"),
            "server": product,
            "nproc": nproc,
            "load_average_before": load,
            "load_average_after": load_after,
            "clients": config.clients,
            "seconds_per_phase": config.seconds,
            "passed": passed,
            "operations": rows.iter().map(|r| json!({
                "operation": r.op.name(),
                "direct": r.direct.to_json(r.op),
                "agentstore": r.through.to_json(r.op),
                "ratio": r.through.rate() / r.direct.rate(),
                "backend_requests_per_request": r.backend_requests,
                "backend_requests_seen": r.kinds,
            })).collect::<Vec<_>>(),
            "embedded_bulk_100": embedded_bulk.to_json(Op::Bulk100),
        });
        write_report(&format!("{NAME}_front"), &report)?;
        Ok(passed)
    }

    async fn measure(config: &Config) -> Result<(String, Vec<Row>, Phase), String> {
        let server = servers::couchdb()?;
        let port = server.url.rsplit(':').next().unwrap_or_default().to_owned();
        let upstream = format!("http://127.0.0.1:{port}");
        let database = format!("couchdb_api_bench_front_{}", run_suffix());
        let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
        let http = http_client()?;
        println!("server: {}", server.product);

        // 1. Counting: agentstore over a counting proxy, requests one at a time.
        let proxy = CountingProxy::start(&upstream).await?;
        let proxied = server.database_url(&database).replace(&upstream[7..], &proxy.url[7..]);
        let agent = Server::start_with_couchdb(BIN, &proxied, dir.path())?;
        let mut endpoint = Http {
            db: agent.couchdb.clone().ok_or("the server printed no CouchDB API address")?,
            login: None,
            revs: Arc::default(),
        };
        endpoint.seed(&http).await?;
        let mut counts = Vec::new();
        for op in OPS {
            if op == Op::PutRev {
                read_all(&endpoint, &http).await?;
            }
            let mut seq = 0;
            for _ in 0..WARM_UP {
                endpoint.call(&http, Input::new(op, "count", 0, 1, seq, seq)?).await?;
                seq += 1;
            }
            proxy.take();
            for _ in 0..COUNTED {
                endpoint.call(&http, Input::new(op, "count", 0, 1, seq, seq)?).await?;
                seq += 1;
            }
            let seen = proxy.take();
            let mut kinds: Vec<String> = seen.iter().map(|r| kind_of(r)).collect();
            kinds.sort();
            kinds.dedup();
            counts.push((seen.len() as f64 / COUNTED as f64, kinds));
        }
        agent.stop()?;
        drop(proxy);
        println!("  counted backend requests per API request");

        // 2. Timed: agentstore straight to the server, and the server itself, in turn.
        let agent = Server::start_with_couchdb(BIN, &server.database_url(&database), dir.path())?;
        let revs = Arc::clone(&endpoint.revs);
        let through = Arc::new(Http {
            db: agent.couchdb.clone().ok_or("the server printed no CouchDB API address")?,
            login: None,
            revs: Arc::clone(&revs),
        });
        let direct = Arc::new(Http { db: format!("{upstream}/{database}"), login: Some(POUCHDB_LOGIN), revs });
        let mut rows = Vec::new();
        // Each side runs in SEGMENTS segments alternating ABBA BAAB, so a change of load on this
        // shared machine falls on both sides alike.
        let segment =
            Config { clients: config.clients, seconds: config.seconds / SEGMENTS as f64, backends: Vec::new() };
        for (op, (backend_requests, kinds)) in OPS.into_iter().zip(counts) {
            let (mut direct_phase, mut through_phase) = (None, None);
            for (segment_index, direct_first) in [true, false, false, true].into_iter().enumerate() {
                for side_is_direct in [direct_first, !direct_first] {
                    if side_is_direct {
                        // A side name per segment: new documents go to namespaces of their own.
                        let side = ["direct-0", "direct-1", "direct-2", "direct-3"][segment_index];
                        let phase = run_phase(&direct, op, side, &segment).await?;
                        direct_phase = Some(merged(direct_phase, phase)?);
                    } else {
                        if op == Op::PutRev {
                            // As a client updates what it has read: every document read through
                            // agentstore (not timed), so the revisions it updates are ones it has
                            // seen.
                            read_all(&through, &http).await?;
                        }
                        let side = ["agentstore-0", "agentstore-1", "agentstore-2", "agentstore-3"][segment_index];
                        let phase = run_phase(&through, op, side, &segment).await?;
                        through_phase = Some(merged(through_phase, phase)?);
                    }
                }
            }
            let (Some(direct_phase), Some(through_phase)) = (direct_phase, through_phase) else {
                return Err("no phase ran".into());
            };
            println!("  {:<9} done", op.name());
            rows.push(Row { op, direct: direct_phase, through: through_phase, backend_requests, kinds });
        }
        agent.stop()?;

        // 3. The embedded store's `_bulk_docs` of 100, against the server's own (above).
        let embedded = Server::start_with_couchdb(
            BIN,
            &format!("embedded:{}", dir.path().join("front.redb").display()),
            dir.path(),
        )?;
        let target = Arc::new(Http {
            db: embedded.couchdb.clone().ok_or("the server printed no CouchDB API address")?,
            login: None,
            revs: Arc::default(),
        });
        let embedded_bulk = run_phase(&target, Op::Bulk100, "embedded", config).await?;
        embedded.stop()?;
        Ok((server.product, rows, embedded_bulk))
    }

    /// Segments per side and operation (ABBA BAAB).
    const SEGMENTS: usize = 4;

    /// Two segments' measurements as one phase.
    fn merged(so_far: Option<Phase>, more: Phase) -> Result<Phase, String> {
        let Some(mut phase) = so_far else { return Ok(more) };
        phase.requests += more.requests;
        phase.errors += more.errors;
        phase.elapsed += more.elapsed;
        phase.latency.add(&more.latency).map_err(|e| e.to_string())?;
        phase.first_error = phase.first_error.or(more.first_error);
        Ok(phase)
    }

    /// Reads every seeded document through `target`, recording its current revision.
    async fn read_all(target: &Http, http: &reqwest::Client) -> Result<(), String> {
        let reads = futures::stream::iter(0..TOTAL_KEYS)
            .map(|i| async move {
                let (_, doc) = target.send(http, reqwest::Method::GET, &path_of(&seeded_id(i)), None).await?;
                let rev = doc["_rev"].as_str().ok_or_else(|| format!("GET {} answered {doc}", seeded_id(i)))?;
                *target.revs[i].lock().unwrap_or_else(|e| e.into_inner()) = rev.to_owned();
                Ok::<(), String>(())
            })
            .buffer_unordered(16)
            .collect::<Vec<_>>()
            .await;
        reads.into_iter().collect()
    }

    /// `GET /_local/x?revs=true` → `GET /_local/{name}`, `GET /some-id` → `GET /{doc}`: what
    /// kind of request it was, for the table.
    fn kind_of(request: &str) -> String {
        let (method, path) = request.split_once(' ').unwrap_or((request, ""));
        let path = path.split('?').next().unwrap_or(path);
        let whole = matches!(path, "" | "/" | "//") || path.starts_with("/_local/") || path.starts_with("/_design/");
        let kind = if whole {
            path.to_owned()
        } else if path.starts_with("/_") {
            path.split('/').take(2).collect::<Vec<_>>().join("/")
        } else {
            "/{doc}".to_owned()
        };
        format!("{method} {kind}")
    }

    fn table(product: &str, rows: &[Row], embedded_bulk: &Phase) -> String {
        let header = [
            "operation",
            "direct req/s",
            "through agentstore req/s",
            "ratio",
            "goal",
            "backend requests per request",
            "p50 ms direct / agentstore",
            "backend requests seen",
        ];
        let p50 = |p: &Phase| quantile_ms(&p.latency, 0.50);
        let mut lines: Vec<Vec<String>> = rows
            .iter()
            .map(|r| {
                vec![
                    r.op.name().to_owned(),
                    format!("{:.0}", r.direct.rate()),
                    format!("{:.0}", r.through.rate()),
                    format!("{:.2}", r.through.rate() / r.direct.rate()),
                    format!("{:.2}", goal(r.op)),
                    format!("{:.2}", r.backend_requests),
                    format!("{:.2} / {:.2}", p50(&r.direct), p50(&r.through)),
                    r.kinds.join(", "),
                ]
            })
            .collect();
        if let Some(direct) = rows.iter().find(|r| r.op == Op::Bulk100).map(|r| &r.direct) {
            lines.push(vec![
                "bulk_100 (embedded store)".to_owned(),
                format!("{:.0}", direct.rate()),
                format!("{:.0}", embedded_bulk.rate()),
                format!("{:.2}", embedded_bulk.rate() / direct.rate()),
                "5 (vs CouchDB 3.4.3)".to_owned(),
                "-".to_owned(),
                format!("{:.2} / {:.2}", p50(direct), p50(embedded_bulk)),
                String::new(),
            ]);
        }
        format!(
            "{}(direct: {product} answering the requests itself, Basic auth; through agentstore: the CouchDB API over \
             the CouchDB backend on that same server and database; ratio = agentstore / direct; backend requests \
             counted through a counting proxy, {COUNTED} sequential requests per operation after {WARM_UP} warm-up \
             ones, in a separate run of the server; each side timed in {SEGMENTS} segments alternating ABBA BAAB)\n",
            aligned(&header, &lines, 1)
        )
    }
}
