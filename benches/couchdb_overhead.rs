//! Overhead of the CouchDB adapter: the `DataStore` facade over `CouchDbBackend` against the raw
//! HTTP calls it makes, side by side in one run.
//!
//! Run it with `cargo bench --bench couchdb_overhead`. The server is `AGENTSTORE_BENCH_COUCHDB_URL`
//! (e.g. `http://admin:password@127.0.0.1:5984`) when set; otherwise `pouchdb-server` from
//! `node_modules` (installed by `npm ci`) is started in memory on a free port by the tests'
//! launcher (`tests/common/servers.rs`), which stops it when the bench process exits. Which server answered (product
//! and version from `GET /`) is printed. The bench creates a fresh database, seeds 1,000 documents
//! (1 user × 10 namespaces × 100 keys) with the adapter's `_bulk_docs` and the facade's document
//! bodies, then makes one warm-up `set` per namespace through the facade, so its once-per-namespace
//! ensure-index call is never timed (none of this is timed). Then it measures four pairs:
//!
//! | pair        | facade                                          | raw (reqwest by hand)                                   |
//! |-------------|-------------------------------------------------|---------------------------------------------------------|
//! | `get`       | `DataStore::get`, `track_reads=false`: one GET  | `GET /db/{id}` + JSON parse                             |
//! | `get+track` | `DataStore::get`, access tracking: GET + PUT    | `GET /db/{id}`, bump `accessCount`, `PUT` with `_rev`   |
//! | `set`       | `DataStore::set` of an existing key: GET + PUT  | `GET`, replace value, merge metadata, `PUT` with `_rev` |
//! | `list_keys` | `DataStore::list_keys`, 100 keys: one `_find`   | `POST /db/_find`, same selector/fields/limit/use_index  |
//!
//! Both sides make the same HTTP calls, each on its own `reqwest::Client` built like the adapter's
//! (keep-alive pool, same timeouts, basic auth, `Accept: application/json`), so the difference is
//! the facade and adapter code: validation, id building, body conversion, error mapping, retry
//! wrappers. Every phase is a closed loop of `BENCH_CLIENTS` (default 8) concurrent tasks, and each
//! side of a pair is bounded by `BENCH_SECONDS` (default 3) and `BENCH_MAX_REQUESTS` (default
//! 5,000) in total. To cancel drift (the server slowing as revisions pile up, other load on the
//! machine, CPU clocks), each side's budget is split over eight short segments (`SEGMENTS_PER_SIDE`)
//! run alternately as ABBA BAAB ABBA BAAB (A = facade), after an untimed warm-up of
//! both sides. Latency is wall-clock around one whole operation (inputs are built before the clock
//! starts); throughput is successful operations over the side's summed segment time. The
//! raw side retries a 409 at once (the facade with backoff), counted as `conflicts_retried`. `writes/op` is the
//! database's `update_seq` growth per operation, which shows the call pattern from the server's
//! side (0 for reads, 1 for one PUT).
//!
//! Results go to stdout as a table and to `target/bench/couchdb_overhead.json`. Any failed
//! operation (warm-up included) makes the bench exit 1.
//!
//! `cargo test --all-targets` also builds and runs this target (without `--bench`); it then only
//! prints how to run it and exits 0.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentstore::backend::couchdb::{CouchConfig, CouchDbBackend, INDEX_NAME};
use agentstore::backend::{BulkWrite, DocumentBackend, Precondition};
use agentstore::model::document::{new_body, Access};
use agentstore::model::{id::encode_key, timestamp, DocumentId, Limits};
use agentstore::store::{DataStore, StoreOptions};
use hdrhistogram::Histogram;
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use reqwest::{Method, StatusCode};
use serde_json::{json, Map, Value};

#[allow(dead_code)]
#[path = "../tests/common/servers.rs"]
mod servers;

const USER: &str = "bench-user";
const NAMESPACES: usize = 10;
const KEYS_PER_NAMESPACE: usize = 100;
const TOTAL_KEYS: usize = NAMESPACES * KEYS_PER_NAMESPACE;
const AGENT: &str = "bench-agent";
/// The adapter's default request timeout (`timeout_secs` of the backend URL).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How often the raw side re-reads after a 409, as the facade's default `max_conflict_retries`.
const RAW_CONFLICT_RETRIES: usize = 100;
/// Untimed operations per client and side before a pair is measured.
const WARMUP_OPS_PER_CLIENT: u64 = 5;
/// Path-segment escaping, as the adapter does it: everything but RFC 3986 unreserved characters.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pair {
    Get,
    GetTracked,
    Set,
    ListKeys,
}

impl Pair {
    const ALL: [Pair; 4] = [Pair::Get, Pair::GetTracked, Pair::Set, Pair::ListKeys];

    fn name(self) -> &'static str {
        match self {
            Pair::Get => "get",
            Pair::GetTracked => "get+track",
            Pair::Set => "set",
            Pair::ListKeys => "list_keys",
        }
    }

    fn json_name(self) -> &'static str {
        match self {
            Pair::Get => "get_untracked",
            Pair::GetTracked => "get_tracked",
            Pair::Set => "set_update",
            Pair::ListKeys => "list_keys",
        }
    }

    /// The HTTP calls one operation makes, on both sides.
    fn calls(self) -> &'static str {
        match self {
            Pair::Get => "GET",
            Pair::GetTracked => "GET + PUT",
            Pair::Set => "GET + PUT",
            Pair::ListKeys => "POST _find",
        }
    }

    fn description(self) -> &'static str {
        match self {
            Pair::Get => "facade get with track_reads=false (exactly one GET) vs raw GET /db/{id} + JSON parse",
            Pair::GetTracked => "facade get with access tracking (GET + PUT) vs raw GET + PUT with _rev",
            Pair::Set => {
                "facade set of an existing key (GET + PUT; namespace index already ensured) vs raw GET + PUT with _rev"
            }
            Pair::ListKeys => {
                "facade list_keys of a 100-key namespace (one _find, page_size 1000) vs raw POST /db/_find, same body"
            }
        }
    }

    /// Server-side writes one successful operation makes.
    fn writes_per_op(self) -> u64 {
        match self {
            Pair::Get | Pair::ListKeys => 0,
            Pair::GetTracked | Pair::Set => 1,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Facade,
    Raw,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Facade => "facade",
            Side::Raw => "raw",
        }
    }
}

struct Config {
    clients: usize,
    seconds: f64,
    max_requests: u64,
}

impl Config {
    fn from_env() -> Result<Self, String> {
        fn var<T: std::str::FromStr>(name: &str, default: T) -> Result<T, String> {
            match std::env::var(name) {
                Ok(text) if !text.trim().is_empty() => {
                    text.trim().parse().map_err(|_| format!("{name}={text:?} is not a valid number"))
                }
                _ => Ok(default),
            }
        }
        let config = Config {
            clients: var("BENCH_CLIENTS", 8usize)?,
            seconds: var("BENCH_SECONDS", 3.0f64)?,
            max_requests: var("BENCH_MAX_REQUESTS", 5_000u64)?,
        };
        if config.clients == 0 {
            return Err("BENCH_CLIENTS must be at least 1".into());
        }
        if !(config.seconds.is_finite() && config.seconds > 0.0) {
            return Err("BENCH_SECONDS must be a positive number".into());
        }
        if config.max_requests == 0 {
            return Err("BENCH_MAX_REQUESTS must be at least 1".into());
        }
        Ok(config)
    }
}

/// An error and its sources, on one line.
fn describe(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

// ---- the server ----

/// Where the server is: `base` has no credentials and no trailing slash.
struct ServerAddress {
    url: url::Url,
    base: String,
    user: Option<String>,
    password: Option<String>,
}

impl ServerAddress {
    fn parse(text: &str) -> Result<Self, String> {
        let url = url::Url::parse(text.trim()).map_err(|e| format!("server URL {text:?}: {e}"))?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none_or(str::is_empty) {
            return Err(format!("server URL {text:?} must be http(s)://[user:password@]host[:port]"));
        }
        let decode = |part: &str| percent_encoding::percent_decode_str(part).decode_utf8_lossy().into_owned();
        let user = (!url.username().is_empty()).then(|| decode(url.username()));
        let password = url.password().map(decode);
        let mut base = url.clone();
        let _ = base.set_username("");
        let _ = base.set_password(None);
        base.set_path("");
        base.set_query(None);
        let base = base.as_str().trim_end_matches('/').to_owned();
        Ok(ServerAddress { url, base, user, password })
    }

    /// The adapter's backend URL for `database`, created if missing.
    fn backend_url(&self, database: &str) -> String {
        let mut url = self.url.clone();
        url.set_path(database);
        url.set_query(Some("create=true"));
        format!("couchdb+{url}")
    }

    /// The server with the password hidden.
    fn redacted(&self) -> String {
        match &self.user {
            Some(user) => {
                let (scheme, rest) = self.base.split_once("://").unwrap_or(("http", &self.base));
                format!("{scheme}://{user}:***@{rest}")
            }
            None => self.base.clone(),
        }
    }
}

/// A request to the server with the credentials and `Accept` header the adapter sends.
fn request(http: &reqwest::Client, address: &ServerAddress, method: Method, url: &str) -> reqwest::RequestBuilder {
    let request = http.request(method, url).header(reqwest::header::ACCEPT, "application/json");
    match &address.user {
        Some(user) => request.basic_auth(user, address.password.as_deref()),
        None => request,
    }
}

/// What answered `GET /`: `pouchdb-server 4.2.0` or `Apache CouchDB 3.4.3`.
async fn identify(http: &reqwest::Client, address: &ServerAddress) -> Result<String, String> {
    let url = format!("{}/", address.base);
    let welcome: Value = request(http, address, Method::GET, &url)
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .map_err(|e| format!("GET {}/: {}", address.base, describe(&e)))?
        .json()
        .await
        .map_err(|e| format!("GET {}/ is not CouchDB's welcome: {}", address.base, describe(&e)))?;
    let version = welcome["version"].as_str().unwrap_or("?");
    Ok(if welcome.get("express-pouchdb").is_some() {
        format!("pouchdb-server {version}")
    } else if welcome.get("couchdb").is_some() {
        format!("Apache CouchDB {version}")
    } else {
        format!("unknown CouchDB-protocol server {version} ({welcome})")
    })
}

// ---- the two sides ----

/// Everything the operations need, shared by the client tasks.
struct Ctx {
    /// `track_reads=false`: `get` is exactly one GET.
    untracked: DataStore,
    /// Default options: `get` counts an access (GET + PUT); also used for `set`.
    tracked: DataStore,
    raw: Raw,
}

/// The raw side: reqwest by hand, on its own client built like the adapter's.
struct Raw {
    http: reqwest::Client,
    address: ServerAddress,
    /// `{base}/{database}`.
    db_url: String,
    /// The `_find` limit the facade sends: its page size.
    find_limit: usize,
    /// The design document of `idx-user-namespace`, as the adapter learns it from `POST _index`.
    index_ddoc: Option<String>,
    /// 409s the raw side retried.
    conflicts: AtomicU64,
}

/// One response: status and parsed JSON body.
struct RawReply {
    status: StatusCode,
    body: Value,
}

impl Raw {
    /// The same client settings as the adapter's `CouchClient`.
    fn client() -> Result<reqwest::Client, String> {
        reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .timeout(REQUEST_TIMEOUT)
            .pool_idle_timeout(Duration::from_secs(60))
            .user_agent(concat!("agentstore-bench/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| format!("HTTP client: {}", describe(&e)))
    }

    async fn call(&self, method: Method, url: &str, body: Option<&Value>) -> Result<RawReply, String> {
        let mut builder = request(&self.http, &self.address, method.clone(), url);
        if let Some(body) = body {
            let bytes = serde_json::to_vec(body).map_err(|e| format!("encoding a body: {e}"))?;
            builder = builder.header(reqwest::header::CONTENT_TYPE, "application/json").body(bytes);
        }
        let response = builder.send().await.map_err(|e| format!("{method} {url}: {}", describe(&e)))?;
        let status = response.status();
        let bytes =
            response.bytes().await.map_err(|e| format!("{method} {url}: reading the body: {}", describe(&e)))?;
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).map_err(|e| format!("{method} {url}: {status} with bad JSON: {e}"))?
        };
        Ok(RawReply { status, body })
    }

    fn doc_url(&self, namespace: &str, key: &str) -> String {
        let id = format!("{USER}:{namespace}:{}", encode_key(key));
        format!("{}/{}", self.db_url, utf8_percent_encode(&id, SEGMENT))
    }

    async fn get(&self, url: &str) -> Result<Map<String, Value>, String> {
        let reply = self.call(Method::GET, url, None).await?;
        match (reply.status, reply.body) {
            (StatusCode::OK, Value::Object(doc)) if doc.get("_rev").is_some_and(Value::is_string) => Ok(doc),
            (status, body) => Err(format!("GET {url}: {status}: {body}")),
        }
    }

    /// GET, change the document, PUT it back with its `_rev`; a 409 starts again.
    async fn read_modify_write(&self, url: &str, change: impl Fn(&mut Map<String, Value>)) -> Result<(), String> {
        for _ in 0..=RAW_CONFLICT_RETRIES {
            let mut doc = self.get(url).await?;
            change(&mut doc);
            let reply = self.call(Method::PUT, url, Some(&Value::Object(doc))).await?;
            match reply.status {
                StatusCode::CREATED | StatusCode::ACCEPTED if reply.body.get("rev").is_some_and(Value::is_string) => {
                    return Ok(())
                }
                StatusCode::CONFLICT => {
                    self.conflicts.fetch_add(1, Ordering::Relaxed);
                }
                status => return Err(format!("PUT {url}: {status}: {}", reply.body)),
            }
        }
        Err(format!("PUT {url}: still conflicting after {RAW_CONFLICT_RETRIES} retries"))
    }

    fn find_body(&self, namespace: &str) -> Value {
        let mut body = json!({
            "selector": { "userId": USER, "namespace": namespace },
            "fields": ["_id", "_rev", "key"],
            "limit": self.find_limit,
        });
        if let Some(ddoc) = &self.index_ddoc {
            body["use_index"] = json!([ddoc, INDEX_NAME]);
        }
        body
    }

    async fn list_keys(&self, namespace: &str) -> Result<Vec<String>, String> {
        let url = format!("{}/_find", self.db_url);
        let reply = self.call(Method::POST, &url, Some(&self.find_body(namespace))).await?;
        if reply.status != StatusCode::OK {
            return Err(format!("POST {url}: {}: {}", reply.status, reply.body));
        }
        let Some(docs) = reply.body.get("docs").and_then(Value::as_array) else {
            return Err(format!("POST {url}: no docs in {}", reply.body));
        };
        let mut keys = docs
            .iter()
            .map(|doc| doc.get("key").and_then(Value::as_str).map(str::to_owned))
            .collect::<Option<Vec<String>>>()
            .ok_or_else(|| format!("POST {url}: a document without a key"))?;
        keys.sort_unstable();
        Ok(keys)
    }

    /// The database's `update_seq` (a number on pouchdb-server, `"N-…"` on CouchDB).
    async fn update_seq(&self) -> Result<u64, String> {
        let reply = self.call(Method::GET, &self.db_url, None).await?;
        let seq = match &reply.body["update_seq"] {
            Value::Number(n) => n.as_u64(),
            Value::String(s) => s.split('-').next().and_then(|n| n.parse().ok()),
            _ => None,
        };
        seq.ok_or_else(|| format!("GET {}: no update_seq in {}", self.db_url, reply.body))
    }
}

/// The `i`-th seeded document: (namespace, key).
fn document(i: usize) -> (String, String) {
    let i = i % TOTAL_KEYS;
    (format!("ns-{}", i / KEYS_PER_NAMESPACE), format!("key-{:03}", i % KEYS_PER_NAMESPACE))
}

/// The `seq`-th operation's document: a fixed permutation of the key space, so concurrent clients
/// touch different documents.
fn spread(seq: u64) -> usize {
    // 7919 is prime and coprime with 1000, so this visits every key once per 1000 operations.
    ((seq % TOTAL_KEYS as u64) * 7919 % TOTAL_KEYS as u64) as usize
}

/// A value of about 100 bytes of compact JSON.
fn value(seq: u64) -> Value {
    json!({ "text": "the quick brown fox jumps over the lazy dog", "seq": seq, "tags": ["bench", "overhead"], "ok": true })
}

fn metadata(seq: u64) -> Value {
    json!({ "source": "couchdb_overhead", "seq": seq })
}

/// What one operation works on, built before its clock starts.
struct Input {
    namespace: String,
    key: String,
    value: Value,
    metadata: Value,
}

impl Input {
    fn new(pair: Pair, seq: u64) -> Input {
        let (namespace, key) = match pair {
            Pair::ListKeys => (format!("ns-{}", seq % NAMESPACES as u64), String::new()),
            _ => document(spread(seq)),
        };
        let (value, metadata) = match pair {
            Pair::Set => (value(seq), metadata(seq)),
            _ => (Value::Null, Value::Null),
        };
        Input { namespace, key, value, metadata }
    }
}

async fn facade_op(ctx: &Ctx, pair: Pair, input: Input) -> Result<(), String> {
    let Input { namespace, key, value, metadata } = input;
    let fail = |e: agentstore::Error| format!("facade {} {namespace}/{key}: {}", pair.name(), describe(&e));
    match pair {
        Pair::Get | Pair::GetTracked => {
            let store = if pair == Pair::Get { &ctx.untracked } else { &ctx.tracked };
            match store.get(USER, &namespace, &key, Some(AGENT)).await.map_err(fail)? {
                Some(_) => Ok(()),
                None => Err(format!("facade {}: {namespace}/{key} is missing", pair.name())),
            }
        }
        Pair::Set => {
            ctx.tracked.set(USER, &namespace, &key, value, Some(metadata), Some(AGENT)).await.map_err(fail)?;
            Ok(())
        }
        Pair::ListKeys => {
            let keys = ctx.untracked.list_keys(USER, &namespace).await.map_err(fail)?;
            check_listing(&namespace, keys.len())
        }
    }
}

async fn raw_op(raw: &Raw, pair: Pair, input: Input) -> Result<(), String> {
    let Input { namespace, key, value, metadata } = input;
    match pair {
        Pair::Get => raw.get(&raw.doc_url(&namespace, &key)).await.map(|_| ()),
        Pair::GetTracked => {
            raw.read_modify_write(&raw.doc_url(&namespace, &key), |doc| {
                let count = doc.get("accessCount").and_then(Value::as_u64).unwrap_or(0);
                doc.insert("accessCount".into(), (count + 1).into());
                doc.insert("lastAccessedAt".into(), timestamp::now().into());
                doc.insert("lastAccessedByAgent".into(), AGENT.into());
            })
            .await
        }
        Pair::Set => {
            raw.read_modify_write(&raw.doc_url(&namespace, &key), |doc| {
                let now = timestamp::now();
                doc.insert("value".into(), value.clone());
                match (doc.get_mut("metadata"), &metadata) {
                    (Some(Value::Object(stored)), Value::Object(update)) => {
                        stored.extend(update.iter().map(|(k, v)| (k.clone(), v.clone())))
                    }
                    _ => {
                        doc.insert("metadata".into(), metadata.clone());
                    }
                }
                let count = doc.get("accessCount").and_then(Value::as_u64).unwrap_or(0);
                doc.insert("accessCount".into(), (count + 1).into());
                doc.insert("updatedAt".into(), now.clone().into());
                doc.insert("lastAccessedAt".into(), now.into());
                doc.insert("lastAccessedByAgent".into(), AGENT.into());
            })
            .await
        }
        Pair::ListKeys => {
            let keys = raw.list_keys(&namespace).await?;
            check_listing(&namespace, keys.len())
        }
    }
}

fn check_listing(namespace: &str, found: usize) -> Result<(), String> {
    if found == KEYS_PER_NAMESPACE {
        Ok(())
    } else {
        Err(format!("list_keys of {namespace} found {found} keys, expected {KEYS_PER_NAMESPACE}"))
    }
}

async fn op(ctx: &Ctx, pair: Pair, side: Side, input: Input) -> Result<(), String> {
    match side {
        Side::Facade => facade_op(ctx, pair, input).await,
        Side::Raw => raw_op(&ctx.raw, pair, input).await,
    }
}

// ---- the load ----

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("histogram bounds")
}

/// One side of one pair, summed over its segments.
struct SideResult {
    side: Side,
    ops: u64,
    errors: u64,
    warmup_errors: u64,
    elapsed: Duration,
    /// Latency of successful operations, in microseconds.
    latency: Histogram<u64>,
    max: Duration,
    /// Growth of the database's update_seq during the timed segments.
    writes: u64,
    conflicts: u64,
    first_error: Option<String>,
}

impl SideResult {
    fn new(side: Side) -> Self {
        SideResult {
            side,
            ops: 0,
            errors: 0,
            warmup_errors: 0,
            elapsed: Duration::ZERO,
            latency: histogram(),
            max: Duration::ZERO,
            writes: 0,
            conflicts: 0,
            first_error: None,
        }
    }

    fn ok(&self) -> u64 {
        self.ops - self.errors
    }

    fn throughput(&self) -> f64 {
        if self.elapsed.is_zero() {
            0.0
        } else {
            self.ok() as f64 / self.elapsed.as_secs_f64()
        }
    }

    fn percentile_ms(&self, q: f64) -> f64 {
        if self.latency.is_empty() {
            0.0
        } else {
            self.latency.value_at_quantile(q) as f64 / 1000.0
        }
    }

    fn writes_per_op(&self) -> f64 {
        if self.ops == 0 {
            0.0
        } else {
            self.writes as f64 / self.ops as f64
        }
    }

    fn add(&mut self, segment: Segment) {
        self.ops += segment.ops;
        self.errors += segment.errors;
        self.elapsed += segment.elapsed;
        self.latency.add(&segment.latency).expect("same histogram bounds");
        self.max = self.max.max(segment.max);
        if self.first_error.is_none() {
            self.first_error = segment.first_error;
        }
    }

    fn to_json(&self) -> Value {
        json!({
            "operations": self.ops,
            "errors": self.errors,
            "warmup_errors": self.warmup_errors,
            "elapsed_s": self.elapsed.as_secs_f64(),
            "ops_per_s": self.throughput(),
            "p50_ms": self.percentile_ms(0.50),
            "p99_ms": self.percentile_ms(0.99),
            "max_ms": self.max.as_secs_f64() * 1000.0,
            "server_writes": self.writes,
            "server_writes_per_op": self.writes_per_op(),
            "conflicts_retried": self.conflicts,
            "first_error": self.first_error,
        })
    }
}

struct PairResult {
    pair: Pair,
    facade: SideResult,
    raw: SideResult,
}

impl PairResult {
    /// Facade p50 / raw p50: above 1 means the facade is slower.
    fn p50_ratio(&self) -> f64 {
        self.facade.percentile_ms(0.50) / self.raw.percentile_ms(0.50)
    }

    /// Raw ops/s / facade ops/s: above 1 means the facade is slower.
    fn throughput_ratio(&self) -> f64 {
        self.raw.throughput() / self.facade.throughput()
    }

    fn errors(&self) -> u64 {
        [&self.facade, &self.raw].iter().map(|s| s.errors + s.warmup_errors).sum()
    }

    fn to_json(&self) -> Value {
        let finite = |x: f64| if x.is_finite() { json!(x) } else { Value::Null };
        json!({
            "operation": self.pair.json_name(),
            "http_calls_per_op": self.pair.calls(),
            "description": self.pair.description(),
            "facade": self.facade.to_json(),
            "raw": self.raw.to_json(),
            "p50_ratio_facade_over_raw": finite(self.p50_ratio()),
            "throughput_ratio_raw_over_facade": finite(self.throughput_ratio()),
        })
    }
}

/// One closed-loop run of one side.
struct Segment {
    ops: u64,
    errors: u64,
    elapsed: Duration,
    latency: Histogram<u64>,
    max: Duration,
    first_error: Option<String>,
}

/// `clients` tasks each running one operation at a time until `seconds` pass or `max_ops` have
/// been started; operations in flight at the deadline are finished and counted.
async fn run_segment(
    ctx: &Arc<Ctx>,
    pair: Pair,
    side: Side,
    seconds: f64,
    max_ops: u64,
    seq_base: u64,
    clients: usize,
) -> Segment {
    let issued = Arc::new(AtomicU64::new(0));
    let first_error = Arc::new(Mutex::new(None::<String>));
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(seconds);
    let mut tasks = Vec::with_capacity(clients);
    for _ in 0..clients {
        let (ctx, issued, first_error) = (Arc::clone(ctx), Arc::clone(&issued), Arc::clone(&first_error));
        tasks.push(tokio::spawn(async move {
            let mut latency = histogram();
            let (mut ops, mut errors, mut max) = (0u64, 0u64, Duration::ZERO);
            while Instant::now() < deadline {
                let n = issued.fetch_add(1, Ordering::Relaxed);
                if n >= max_ops {
                    break;
                }
                let input = Input::new(pair, seq_base + n);
                let began = Instant::now();
                let outcome = op(&ctx, pair, side, input).await;
                let took = began.elapsed();
                ops += 1;
                match outcome {
                    Ok(()) => {
                        latency.saturating_record((took.as_micros() as u64).max(1));
                        max = max.max(took);
                    }
                    Err(message) => {
                        errors += 1;
                        first_error.lock().unwrap().get_or_insert(message);
                    }
                }
            }
            (ops, errors, max, latency)
        }));
    }
    let mut segment = Segment {
        ops: 0,
        errors: 0,
        elapsed: Duration::ZERO,
        latency: histogram(),
        max: Duration::ZERO,
        first_error: None,
    };
    for task in tasks {
        let (ops, errors, max, latency) = task.await.expect("client task panicked");
        segment.ops += ops;
        segment.errors += errors;
        segment.max = segment.max.max(max);
        segment.latency.add(&latency).expect("same histogram bounds");
    }
    segment.elapsed = start.elapsed();
    segment.first_error = first_error.lock().unwrap().take();
    segment
}

/// How many timed segments each side of a pair gets (even).
const SEGMENTS_PER_SIDE: u64 = 8;

/// The timed segments of a pair: ABBA, BAAB, ABBA, … (facade = A), which cancels linear and
/// quadratic drift and keeps each segment short, so a burst of outside load lands on both sides
/// alike.
fn segment_order() -> Vec<Side> {
    let (a, b) = (Side::Facade, Side::Raw);
    (0..SEGMENTS_PER_SIDE / 2).flat_map(|round| if round % 2 == 0 { [a, b, b, a] } else { [b, a, a, b] }).collect()
}

/// Warm-up of both sides, then [`segment_order`], each segment an equal share of a side's budget.
async fn run_pair(ctx: &Arc<Ctx>, pair: Pair, config: &Config) -> Result<PairResult, String> {
    let mut result = PairResult { pair, facade: SideResult::new(Side::Facade), raw: SideResult::new(Side::Raw) };
    let mut seq = 0u64;
    let warmup_ops = WARMUP_OPS_PER_CLIENT * config.clients as u64;
    for side in [Side::Facade, Side::Raw] {
        let warmup = run_segment(ctx, pair, side, config.seconds, warmup_ops, seq, config.clients).await;
        seq += warmup.ops;
        let target = if side == Side::Facade { &mut result.facade } else { &mut result.raw };
        target.warmup_errors += warmup.errors;
        if target.first_error.is_none() {
            target.first_error = warmup.first_error.map(|e| format!("(warm-up) {e}"));
        }
    }
    let seconds = config.seconds / SEGMENTS_PER_SIDE as f64;
    let mut segments_done = [0u64; 2];
    for side in segment_order() {
        let (target, done) = match side {
            Side::Facade => (&mut result.facade, &mut segments_done[0]),
            Side::Raw => (&mut result.raw, &mut segments_done[1]),
        };
        // An equal share of the operations still allowed to this side.
        let max_ops = config.max_requests.saturating_sub(target.ops).div_ceil(SEGMENTS_PER_SIDE - *done);
        *done += 1;
        let before = ctx.raw.update_seq().await?;
        let conflicts_before = ctx.raw.conflicts.load(Ordering::Relaxed);
        let segment = run_segment(ctx, pair, side, seconds, max_ops, seq, config.clients).await;
        let after = ctx.raw.update_seq().await?;
        seq += segment.ops;
        target.writes += after.saturating_sub(before);
        target.conflicts += ctx.raw.conflicts.load(Ordering::Relaxed) - conflicts_before;
        target.add(segment);
    }
    Ok(result)
}

/// Seeds every document through the adapter's `_bulk_docs`, one request per namespace, with the
/// bodies the facade writes (not timed). Then one warm-up `set` per namespace through the facade
/// that the `set` pair uses: the store ensures a namespace's index on its first write and remembers
/// it, so no timed `set` pays for that call.
async fn seed(backend: &Arc<dyn DocumentBackend>, store: &DataStore) -> Result<(), String> {
    let limits = Limits::default();
    for ns in 0..NAMESPACES {
        let access = Access { agent: Some(AGENT), at: timestamp::now() };
        let mut writes = Vec::with_capacity(KEYS_PER_NAMESPACE);
        for i in ns * KEYS_PER_NAMESPACE..(ns + 1) * KEYS_PER_NAMESPACE {
            let (namespace, key) = document(i);
            let id = DocumentId::new(USER, &namespace, &key, &limits).map_err(|e| describe(&e))?;
            let Value::Object(metadata) = metadata(i as u64) else { unreachable!("metadata is an object") };
            let body = new_body(&id, value(i as u64), Some(metadata), &access);
            writes.push(BulkWrite { id: id.as_str().to_owned(), body, precondition: Precondition::MustNotExist });
        }
        let results = backend.bulk_write(writes).await.map_err(|e| format!("seeding ns-{ns}: {}", describe(&e)))?;
        if let Some(Err(e)) = results.into_iter().find(Result::is_err) {
            return Err(format!("seeding ns-{ns}: {}", describe(&e)));
        }
    }
    for ns in 0..NAMESPACES {
        let (namespace, key) = document(ns * KEYS_PER_NAMESPACE);
        store
            .set(USER, &namespace, &key, value(0), Some(metadata(0)), Some(AGENT))
            .await
            .map_err(|e| format!("warm-up write to {namespace}/{key}: {}", describe(&e)))?;
    }
    Ok(())
}

// ---- reporting ----

fn table(results: &[PairResult]) -> String {
    let header = [
        "operation",
        "side",
        "HTTP calls",
        "ops",
        "errors",
        "ops/s",
        "p50 ms",
        "p99 ms",
        "writes/op",
        "p50 ratio",
        "ops/s ratio",
    ];
    let mut rows: Vec<[String; 11]> = Vec::new();
    for r in results {
        for side in [&r.facade, &r.raw] {
            let facade = side.side == Side::Facade;
            rows.push([
                if facade { r.pair.name().to_owned() } else { String::new() },
                side.side.name().to_owned(),
                r.pair.calls().to_owned(),
                side.ops.to_string(),
                (side.errors + side.warmup_errors).to_string(),
                format!("{:.0}", side.throughput()),
                format!("{:.3}", side.percentile_ms(0.50)),
                format!("{:.3}", side.percentile_ms(0.99)),
                format!("{:.2}", side.writes_per_op()),
                if facade { format!("{:.3}x", r.p50_ratio()) } else { String::new() },
                if facade { format!("{:.3}x", r.throughput_ratio()) } else { String::new() },
            ]);
        }
    }
    let mut widths = header.map(str::len);
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.len());
        }
    }
    let line = |cells: &[&str]| -> String {
        let mut out = String::new();
        for (i, (cell, width)) in cells.iter().zip(widths).enumerate() {
            if i < 3 {
                out.push_str(&format!("{cell:<width$}  "));
            } else {
                out.push_str(&format!("{cell:>width$}  "));
            }
        }
        out.truncate(out.trim_end().len());
        out.push('\n');
        out
    };
    let mut out = line(&header);
    out.push_str(&line(&widths.map(|w| "-".repeat(w)).iter().map(String::as_str).collect::<Vec<_>>()));
    for row in &rows {
        out.push_str(&line(&row.iter().map(String::as_str).collect::<Vec<_>>()));
    }
    out
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"))
}

fn main() -> ExitCode {
    // `cargo bench` passes `--bench`; `cargo test --all-targets` runs this target without it.
    if !std::env::args().skip(1).any(|a| a == "--bench") {
        println!("couchdb_overhead: run with `cargo bench --bench couchdb_overhead`");
        return ExitCode::SUCCESS;
    }
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(message) => {
            eprintln!("couchdb_overhead: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the benchmark; Ok(false) when any operation failed.
fn run() -> Result<bool, String> {
    let config = Config::from_env()?;
    let nproc = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    println!("couchdb_overhead: DataStore facade over the CouchDB adapter vs the same HTTP calls by hand");
    println!(
        "nproc: {nproc}  clients: {}  per side and operation: {} s or {} ops, in {SEGMENTS_PER_SIDE} segments \
         alternating ABBA BAAB (A = facade)",
        config.clients, config.seconds, config.max_requests
    );

    // The shared test-server launcher: AGENTSTORE_BENCH_COUCHDB_URL names a server, else
    // pouchdb-server from node_modules runs (in memory) for as long as this process.
    let external = std::env::var("AGENTSTORE_BENCH_COUCHDB_URL").is_ok_and(|url| !url.trim().is_empty());
    if external {
        if let Ok(url) = std::env::var("AGENTSTORE_BENCH_COUCHDB_URL") {
            std::env::set_var("AGENTSTORE_TEST_COUCHDB_URL", url.trim());
        }
    }
    let server_url = servers::couchdb()?.url;
    let address = ServerAddress::parse(&server_url)?;
    let database = format!(
        "agentstore_bench_{}_{}",
        std::process::id(),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0)
    );

    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| format!("tokio runtime: {e}"))?;
    let outcome = runtime.block_on(async {
        let http = Raw::client()?;
        let product = identify(&http, &address).await?;
        let origin = if external { "AGENTSTORE_BENCH_COUCHDB_URL" } else { "started from node_modules, in memory" };
        println!("server: {product} at {} ({origin})", address.redacted());
        println!("database: {database} (fresh)");

        let couch = CouchConfig::parse(&address.backend_url(&database)).map_err(|e| describe(&e))?;
        let backend: Arc<dyn DocumentBackend> =
            Arc::new(CouchDbBackend::open(&couch).await.map_err(|e| format!("opening the adapter: {}", describe(&e)))?);
        let untracked =
            DataStore::open(Arc::clone(&backend), StoreOptions { track_reads: false, ..Default::default() })
                .await
                .map_err(|e| format!("opening the facade: {}", describe(&e)))?;
        let tracked = DataStore::open(Arc::clone(&backend), StoreOptions::default())
            .await
            .map_err(|e| format!("opening the facade: {}", describe(&e)))?;
        let find_limit = untracked.options().page_size;

        let mut raw = Raw {
            http,
            db_url: format!("{}/{}", address.base, utf8_percent_encode(&database, SEGMENT)),
            address,
            find_limit,
            index_ddoc: None,
            conflicts: AtomicU64::new(0),
        };
        // The index exists already (the facade ensured it at open); this learns its design doc,
        // as the adapter does.
        let definition = json!({ "index": { "fields": ["userId", "namespace"] }, "name": INDEX_NAME, "type": "json" });
        let reply = raw.call(Method::POST, &format!("{}/_index", raw.db_url), Some(&definition)).await?;
        if !reply.status.is_success() {
            return Err(format!("POST _index: {}: {}", reply.status, reply.body));
        }
        raw.index_ddoc = reply.body.get("id").and_then(Value::as_str).map(str::to_owned);

        let seeding = Instant::now();
        seed(&backend, &tracked).await?;
        println!(
            "seeded {TOTAL_KEYS} documents (1 user x {NAMESPACES} namespaces x {KEYS_PER_NAMESPACE} keys) with \
             _bulk_docs, then one facade set per namespace (ensures its index), in {:.2} s (not timed)",
            seeding.elapsed().as_secs_f64()
        );
        let ctx = Arc::new(Ctx { untracked, tracked, raw });
        // Both sides must see the same listing before anything is timed.
        let (namespace, _) = document(0);
        let facade_keys = ctx.untracked.list_keys(USER, &namespace).await.map_err(|e| describe(&e))?;
        let raw_keys = ctx.raw.list_keys(&namespace).await?;
        if facade_keys != raw_keys || facade_keys.len() != KEYS_PER_NAMESPACE {
            return Err(format!(
                "{namespace}: the facade lists {} keys and raw _find {}; expected the same {KEYS_PER_NAMESPACE}",
                facade_keys.len(),
                raw_keys.len()
            ));
        }

        let mut results = Vec::new();
        for pair in Pair::ALL {
            let started = Instant::now();
            let result = run_pair(&ctx, pair, &config).await?;
            println!("  {:<10} done in {:.2} s: {}", pair.name(), started.elapsed().as_secs_f64(), pair.description());
            results.push(result);
        }

        // Best effort: leave nothing behind on a shared server.
        match ctx.raw.call(Method::DELETE, &ctx.raw.db_url, None).await {
            Ok(reply) if reply.status.is_success() => {}
            Ok(reply) => eprintln!("couchdb_overhead: could not delete {database}: {}: {}", reply.status, reply.body),
            Err(e) => eprintln!("couchdb_overhead: could not delete {database}: {e}"),
        }
        Ok::<_, String>((product, results))
    });
    drop(runtime);
    let (product, results) = outcome?;

    println!();
    print!("{}", table(&results));
    println!(
        "(ops/s and latency over successful operations; latency is one whole operation; ratios: facade p50 / raw p50 \
         and raw ops/s / facade ops/s, above 1 = facade slower; writes/op = database update_seq growth per operation)"
    );

    let passed = results.iter().all(|r| r.errors() == 0 && r.facade.ops > 0 && r.raw.ops > 0);
    for r in &results {
        for side in [&r.facade, &r.raw] {
            if side.errors + side.warmup_errors > 0 || side.ops == 0 {
                eprintln!(
                    "couchdb_overhead: {} {}: {} errors in {} operations (+{} in warm-up); first: {}",
                    r.pair.name(),
                    side.side.name(),
                    side.errors,
                    side.ops,
                    side.warmup_errors,
                    side.first_error.as_deref().unwrap_or("none run")
                );
            }
            let expected = r.pair.writes_per_op() as f64;
            if side.ops > 0 && (side.writes_per_op() - expected).abs() > 0.01 {
                eprintln!(
                    "couchdb_overhead: note: {} {} made {:.3} server writes per operation, expected {expected}",
                    r.pair.name(),
                    side.side.name(),
                    side.writes_per_op()
                );
            }
        }
    }

    let report = json!({
        "benchmark": "couchdb_overhead",
        "server": product,
        "server_origin": if external { "AGENTSTORE_BENCH_COUCHDB_URL" } else { "node_modules/.bin/pouchdb-server --in-memory" },
        "nproc": nproc,
        "clients": config.clients,
        "seconds_per_side": config.seconds,
        "max_ops_per_side": config.max_requests,
        "segments_per_side": SEGMENTS_PER_SIDE,
        "segment_order": segment_order().iter().map(|s| s.name()).collect::<Vec<_>>(),
        "warmup_ops_per_side": WARMUP_OPS_PER_CLIENT * config.clients as u64,
        "documents": TOTAL_KEYS,
        "passed": passed,
        "operations": results.iter().map(PairResult::to_json).collect::<Vec<_>>(),
    });
    let out_dir = target_dir().join("bench");
    let path = out_dir.join("couchdb_overhead.json");
    std::fs::create_dir_all(&out_dir).map_err(|e| format!("creating {}: {e}", out_dir.display()))?;
    let text = serde_json::to_string_pretty(&report).expect("serialisable");
    std::fs::write(&path, text + "\n").map_err(|e| format!("writing {}: {e}", path.display()))?;
    println!("wrote {}", path.display());

    if !passed {
        eprintln!("couchdb_overhead: FAILED: some operations errored");
    }
    Ok(passed)
}
