//! Load and memory benchmark of the embedded store: `agentstore serve` and the bulk commands on
//! stores of 10,000 and (opt-in) 1,000,000 documents, side by side with pouchdb-server doing the
//! same logical operations, in one run.
//!
//! Run it with `cargo bench --bench benches -- serve_load`; the 1M case with
//! `BENCH_STORE_DOCS=10000,1000000 cargo bench --bench benches -- serve_load` (about 15 minutes here, most of
//! it seeding pouchdb-server). For every store size N it:
//!
//! 1. **Builds the store** (not part of the load phases): N documents of about 500 bytes of NDJSON
//!    in namespaces of 100 keys (100 users × N/10,000 namespaces), written with `agentstore
//!    import`, then runs `export`, `migrate` (into a second store; it reads everything back) and
//!    `verify` over it. Each command's wall time, documents per second and peak RSS (the child's
//!    `ru_maxrss`, from `wait4`: measured from outside, whole process lifetime) are printed, with
//!    the store file's size per document.
//! 2. **Serves it** (`agentstore serve`, the product's defaults) and runs closed-loop phases with
//!    `BENCH_CLIENTS` clients: `set` (PUT a key: read-modify-write), `get` (GET a key: counts an
//!    access, a write), `list_keys` and `get_all` of a 100-key namespace, and `mixed` (6 gets,
//!    2 sets, 1 list, 1 get-all in every 10 requests). Requests stride over the whole store, so a
//!    large store is not measured on a hot corner. The server's peak RSS (`VmHWM`) is read after
//!    the phases.
//! 3. **pouchdb-server 4.2.0** (on disk, LevelDB, the database seeded with the same documents by
//!    `_bulk_docs` and a Mango index on `[userId, namespace]` like `idx-user-namespace`) gets the
//!    same phases as a CouchDB application does them: `set` and `get` are GET + PUT with the
//!    revision (retried on 409), the lists are `_find` with the index. `BENCH_POUCHDB=0` leaves it
//!    out (printed as not run).
//!
//! Each phase stops at `BENCH_SECONDS` (default 5) or `BENCH_MAX_REQUESTS` (default 20,000),
//! whichever comes first. Latency is wall-clock around the whole operation, including the full
//! body; every list's length is checked. Any transport error, non-2xx status or wrong list is an
//! error; the bench exits 1 if any phase's error rate is over 1%. With two or more sizes, a scale
//! table gives each operation's throughput on the smallest store over that on the largest (the
//! issue's goal: at most 1.5). Results go to stdout and `target/bench/serve_load.json`.
//! `BENCH_CACHE_MB` sets the served store's page cache (`?cache_mb=`), else the product default.
//!
//! `cargo test --all-targets` also builds and runs the bench binary (without `--bench`); it then only
//! prints how to run it and exits 0.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use hdrhistogram::Histogram;
use serde_json::{json, Map, Value};

use crate::common;
use crate::common::serve;

use common::load::{histogram, quantile_ms};
use common::report::aligned;
use common::{bench_main, env_number, write_report};
use serve::Server;

const NAME: &str = "serve_load";
/// The binary cargo built for the bench.
const BUILT_BIN: &str = env!("CARGO_BIN_EXE_agentstore");
const AGENT: &str = "bench-agent";
/// Users in every store; each has N / (100 × USERS) namespaces of [`KEYS_PER_NAMESPACE`] keys.
const USERS: usize = 100;
const KEYS_PER_NAMESPACE: usize = 100;
/// The error rate above which the bench fails.
const MAX_ERROR_RATE: f64 = 0.01;
/// Per-request timeout: a request that takes longer is an error.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// A prime larger than any store here: request `seq` works on document `seq × STRIDE mod N`, a
/// permutation of the store, so consecutive requests (and concurrent clients) land far apart.
const STRIDE: u64 = 1_000_003;
/// Documents per `_bulk_docs` request when seeding pouchdb-server, and requests in flight.
const POUCH_BULK: usize = 1_000;
const POUCH_BULK_IN_FLIGHT: usize = 4;
/// pouchdb-server's admin, written into its config.json.
const POUCH_LOGIN: (&str, &str) = ("admin", "password");
/// How often a pouchdb-server read-modify-write is retried after a 409.
const POUCH_CONFLICT_RETRIES: usize = 10;

// ---- settings ----

struct Config {
    /// `BENCH_CLIENTS` (default 16).
    clients: usize,
    /// `BENCH_SECONDS` (default 5): the longest a phase runs.
    seconds: f64,
    /// `BENCH_MAX_REQUESTS` (default 20,000): the most requests a phase sends.
    max_requests: u64,
    /// `BENCH_STORE_DOCS` (default `10000`): the store sizes, comma-separated, each a multiple of
    /// 10,000.
    store_docs: Vec<usize>,
    /// `BENCH_POUCHDB` (default 1): measure pouchdb-server beside the service.
    pouchdb: bool,
    /// `BENCH_CACHE_MB`: the served store's page cache, when not the product default.
    cache_mb: Option<u32>,
    /// `BENCH_PHASES` (default all): the phases run, comma-separated, e.g. `set,mixed`.
    phases: Vec<Op>,
    /// `BENCH_AGENTSTORE`: another `agentstore` binary to measure (an earlier build, say), else
    /// the one cargo built for the bench.
    binary: String,
}

impl Config {
    fn from_env() -> Result<Self, String> {
        let store_docs = match std::env::var("BENCH_STORE_DOCS") {
            Ok(text) if !text.trim().is_empty() => text
                .split(',')
                .map(|n| n.trim().replace('_', "").parse::<usize>().map_err(|_| format!("BENCH_STORE_DOCS: {n:?}")))
                .collect::<Result<Vec<_>, _>>()?,
            _ => vec![10_000],
        };
        if let Some(bad) = store_docs.iter().find(|&&n| n == 0 || n % (USERS * KEYS_PER_NAMESPACE) != 0) {
            return Err(format!(
                "BENCH_STORE_DOCS: {bad} is not a positive multiple of {}",
                USERS * KEYS_PER_NAMESPACE
            ));
        }
        let cache_mb: u32 = env_number("BENCH_CACHE_MB", 0)?;
        let phases = match std::env::var("BENCH_PHASES") {
            Ok(text) if !text.trim().is_empty() => {
                text.split(',')
                    .map(|name| {
                        Op::ALL.into_iter().find(|op| op.name() == name.trim()).ok_or_else(|| {
                            format!("BENCH_PHASES: no phase {name:?} (set, get, list_keys, get_all, mixed)")
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
            _ => Op::ALL.to_vec(),
        };
        let config = Config {
            clients: env_number("BENCH_CLIENTS", 16usize)?,
            seconds: env_number("BENCH_SECONDS", 5.0f64)?,
            max_requests: env_number("BENCH_MAX_REQUESTS", 20_000u64)?,
            store_docs,
            pouchdb: env_number("BENCH_POUCHDB", 1u8)? != 0,
            cache_mb: (cache_mb > 0).then_some(cache_mb),
            phases,
            binary: std::env::var("BENCH_AGENTSTORE").ok().filter(|b| !b.trim().is_empty()).unwrap_or(BUILT_BIN.into()),
        };
        if config.clients == 0 || config.max_requests == 0 {
            return Err("BENCH_CLIENTS and BENCH_MAX_REQUESTS must be at least 1".into());
        }
        if !(config.seconds.is_finite() && config.seconds > 0.0) {
            return Err("BENCH_SECONDS must be a positive number".into());
        }
        Ok(config)
    }
}

// ---- the documents ----

/// Where document `i` of a store lives: namespace group `i / 100` spread over the users.
struct Place {
    user: String,
    namespace: String,
    key: String,
}

impl Place {
    fn of_document(i: usize) -> Place {
        let mut place = Place::of_namespace(i / KEYS_PER_NAMESPACE);
        place.key = format!("key-{:02}", i % KEYS_PER_NAMESPACE);
        place
    }

    fn of_namespace(group: usize) -> Place {
        Place {
            user: format!("user-{:02}", group % USERS),
            namespace: format!("ns-{:04}", group / USERS),
            key: String::new(),
        }
    }

    fn id(&self) -> String {
        let key = base64::engine::general_purpose::URL_SAFE.encode(self.key.as_bytes());
        format!("{}:{}:{key}", self.user, self.namespace)
    }

    fn keys_path(&self) -> String {
        format!("/v1/users/{}/namespaces/{}/keys", self.user, self.namespace)
    }
}

/// Text that makes a seeded document about 500 bytes of NDJSON.
const FILLER: &str = "an agent remembers what the user asked for, what it tried, what worked and what did not; \
                      this text stands for that memory and pads the document to the size of a real one: \
                      a few hundred bytes of JSON, neither a bare counter nor a file";

/// The stored form of seeded document `i`, as `export` writes it (and pouchdb-server keeps it).
fn seeded_document(i: usize) -> Value {
    let place = Place::of_document(i);
    json!({
        "_id": place.id(),
        "userId": place.user,
        "namespace": place.namespace,
        "key": place.key,
        "value": { "text": FILLER, "n": i, "tags": ["bench", "seed"], "ok": true },
        "metadata": { "source": "serve_load", "seq": i },
        "accessCount": 0,
        "createdAt": "2026-01-01T00:00:00Z",
        "updatedAt": "2026-01-01T00:00:00Z"
    })
}

/// The value a `set` writes.
fn new_value(seq: u64) -> Value {
    json!({ "text": "the quick brown fox jumps over the lazy dog", "seq": seq, "tags": ["bench", "load"], "ok": true })
}

/// Writes the store's documents as NDJSON; returns the file's size.
fn write_ndjson(path: &Path, docs: usize) -> Result<u64, String> {
    let file = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut out = BufWriter::new(file);
    for i in 0..docs {
        serde_json::to_writer(&mut out, &seeded_document(i)).map_err(|e| e.to_string())?;
        out.write_all(b"\n").map_err(|e| e.to_string())?;
    }
    out.flush().map_err(|e| e.to_string())?;
    std::fs::metadata(path).map(|m| m.len()).map_err(|e| e.to_string())
}

// ---- the bulk commands ----

/// One `agentstore` command run over the store.
struct CommandRun {
    name: &'static str,
    wall: Duration,
    docs: usize,
    peak_rss: u64,
}

impl CommandRun {
    fn to_json(&self) -> Value {
        json!({
            "command": self.name,
            "seconds": self.wall.as_secs_f64(),
            "docs_per_s": self.docs as f64 / self.wall.as_secs_f64(),
            "peak_rss_bytes": self.peak_rss,
        })
    }
}

/// Runs `agentstore ARGS` to the end; its wall time and peak RSS (`ru_maxrss` from `wait4`).
fn run_command(binary: &str, name: &'static str, args: &[&str], dir: &Path, docs: usize) -> Result<CommandRun, String> {
    // stderr goes to a file, not a pipe: a pipe nobody reads while the child runs could fill.
    let log_path = dir.join(format!("{name}.stderr"));
    let log = std::fs::File::create(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
    let started = Instant::now();
    let child = Command::new(binary)
        .args(args)
        .current_dir(dir)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| format!("cannot start {binary}: {e}"))?;
    let pid = child.id() as libc::pid_t;
    // Reaped here rather than by `Child::wait`, which does not report the child's resource use.
    let mut status = 0;
    // SAFETY: rusage is plain data, for which all-zero bytes are a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `pid` is our own unreaped child; both pointers are to live locals.
    let reaped = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    let wall = started.elapsed();
    if reaped != pid {
        return Err(format!("{name}: wait4 failed: {}", std::io::Error::last_os_error()));
    }
    if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        return Err(format!("`agentstore {}` failed (wait status {status}): {text}", args.join(" ")));
    }
    // ru_maxrss is in KiB on Linux.
    Ok(CommandRun { name, wall, docs, peak_rss: usage.ru_maxrss as u64 * 1024 })
}

/// Builds the store at `store` with `import`, then runs `export`, `migrate` and `verify` over it.
fn bulk_commands(binary: &str, dir: &Path, store: &str, docs: usize) -> Result<(Vec<CommandRun>, u64), String> {
    let ndjson = dir.join("seed.ndjson");
    let ndjson_bytes = write_ndjson(&ndjson, docs)?;
    let copy = format!("embedded:{}", dir.join("copy.redb").display());
    let export = dir.join("export.ndjson");
    let ndjson_arg = ndjson.display().to_string();
    let export_arg = export.display().to_string();
    let quiet = ["--progress", "none"];
    let runs = vec![
        run_command(
            binary,
            "import",
            &[&["import", "--to", store, "--in", &ndjson_arg], &quiet[..]].concat(),
            dir,
            docs,
        )?,
        run_command(
            binary,
            "export",
            &[&["export", "--from", store, "--out", &export_arg], &quiet[..]].concat(),
            dir,
            docs,
        )?,
        run_command(
            binary,
            "migrate",
            &[&["migrate", "--from", store, "--to", &copy], &quiet[..]].concat(),
            dir,
            docs,
        )?,
        run_command(binary, "verify", &["verify", "--from", store, "--to", &copy], dir, docs)?,
    ];
    for file in [ndjson, export, dir.join("copy.redb")] {
        let _ = std::fs::remove_file(file);
    }
    Ok((runs, ndjson_bytes))
}

// ---- the load ----

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Set,
    Get,
    ListKeys,
    GetAll,
    Mixed,
}

impl Op {
    const ALL: [Op; 5] = [Op::Set, Op::Get, Op::ListKeys, Op::GetAll, Op::Mixed];

    fn name(self) -> &'static str {
        match self {
            Op::Set => "set",
            Op::Get => "get",
            Op::ListKeys => "list_keys",
            Op::GetAll => "get_all",
            Op::Mixed => "mixed",
        }
    }

    /// The single operation request `seq` of this phase performs.
    fn step(self, seq: u64) -> Op {
        match self {
            Op::Mixed => match seq % 10 {
                0..=5 => Op::Get,
                6 | 7 => Op::Set,
                8 => Op::ListKeys,
                _ => Op::GetAll,
            },
            op => op,
        }
    }
}

/// What one request works on: a document, or for the lists a namespace.
fn place(op: Op, seq: u64, docs: usize) -> Place {
    let spread = seq.wrapping_mul(STRIDE);
    match op {
        Op::ListKeys | Op::GetAll => Place::of_namespace((spread % (docs / KEYS_PER_NAMESPACE) as u64) as usize),
        _ => Place::of_document((spread % docs as u64) as usize),
    }
}

/// A server the phases run against.
trait Target: Send + Sync + 'static {
    fn call(&self, op: Op, seq: u64) -> impl std::future::Future<Output = Result<(), String>> + Send;
}

fn http_client(clients: usize) -> Result<reqwest::Client, String> {
    reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(clients)
        .tcp_nodelay(true)
        .timeout(REQUEST_TIMEOUT)
        .build()
        .map_err(|e| format!("HTTP client: {e}"))
}

/// Sends a request; its body as JSON when the status is 2xx.
async fn send_json(builder: reqwest::RequestBuilder) -> Result<(reqwest::StatusCode, Value), String> {
    let response = builder.send().await.map_err(|e| format!("transport error: {e}"))?;
    let status = response.status();
    let body = response.bytes().await.map_err(|e| format!("reading the body (status {status}): {e}"))?;
    let value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    if status.is_success() || status == reqwest::StatusCode::CONFLICT {
        Ok((status, value))
    } else {
        Err(format!("status {status}: {}", String::from_utf8_lossy(&body[..body.len().min(300)])))
    }
}

fn check_count(what: &str, found: usize) -> Result<(), String> {
    if found == KEYS_PER_NAMESPACE {
        Ok(())
    } else {
        Err(format!("{what} returned {found} entries, expected {KEYS_PER_NAMESPACE}"))
    }
}

/// `agentstore serve`'s REST API.
struct Service {
    http: reqwest::Client,
    base: String,
    docs: usize,
}

impl Target for Service {
    async fn call(&self, op: Op, seq: u64) -> Result<(), String> {
        let op = op.step(seq);
        let at = place(op, seq, self.docs);
        let keys = format!("{}{}", self.base, at.keys_path());
        let builder = match op {
            Op::Set => self
                .http
                .put(format!("{keys}/{}", at.key))
                .header("x-agent-id", AGENT)
                .json(&json!({ "value": new_value(seq), "metadata": { "source": "serve_load", "seq": seq } })),
            Op::Get => self.http.get(format!("{keys}/{}", at.key)).header("x-agent-id", AGENT),
            Op::ListKeys => self.http.get(keys),
            Op::GetAll | Op::Mixed => self.http.get(keys.trim_end_matches("/keys")),
        };
        let (status, body) = send_json(builder).await?;
        if status == reqwest::StatusCode::CONFLICT {
            return Err(format!("status 409: {body}"));
        }
        match op {
            Op::ListKeys => check_count("list_keys", body.as_array().map_or(0, Vec::len)),
            Op::GetAll => check_count("get_all", body.as_object().map_or(0, Map::len)),
            _ => Ok(()),
        }
    }
}

/// pouchdb-server, used as a CouchDB application uses CouchDB.
struct Pouch {
    http: reqwest::Client,
    db: String,
    docs: usize,
}

impl Pouch {
    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http.request(method, format!("{}{path}", self.db)).basic_auth(POUCH_LOGIN.0, Some(POUCH_LOGIN.1))
    }

    /// GET the document, change it, PUT it back with its revision; again on a 409.
    async fn read_modify_write(&self, id: &str, change: impl Fn(&mut Map<String, Value>)) -> Result<(), String> {
        let path = format!("/{id}");
        for _ in 0..POUCH_CONFLICT_RETRIES {
            let (_, doc) = send_json(self.request(reqwest::Method::GET, &path)).await?;
            let Value::Object(mut doc) = doc else { return Err(format!("GET {id}: not a document")) };
            change(&mut doc);
            let (status, _) = send_json(self.request(reqwest::Method::PUT, &path).json(&doc)).await?;
            if status != reqwest::StatusCode::CONFLICT {
                return Ok(());
            }
        }
        Err(format!("{id}: still in conflict after {POUCH_CONFLICT_RETRIES} tries"))
    }

    async fn find(&self, at: &Place, fields: &[&str]) -> Result<usize, String> {
        let query = json!({
            "selector": { "userId": at.user, "namespace": at.namespace },
            "fields": fields,
            "limit": KEYS_PER_NAMESPACE * 2,
        });
        let (_, body) = send_json(self.request(reqwest::Method::POST, "/_find").json(&query)).await?;
        Ok(body["docs"].as_array().map_or(0, Vec::len))
    }
}

fn now() -> String {
    chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ").to_string()
}

impl Target for Pouch {
    async fn call(&self, op: Op, seq: u64) -> Result<(), String> {
        let op = op.step(seq);
        let at = place(op, seq, self.docs);
        match op {
            Op::Set => {
                self.read_modify_write(&at.id(), |doc| {
                    doc.insert("value".into(), new_value(seq));
                    if let Some(Value::Object(metadata)) = doc.get_mut("metadata") {
                        metadata.insert("seq".into(), json!(seq));
                    }
                    doc.insert("updatedAt".into(), json!(now()));
                })
                .await
            }
            Op::Get => {
                self.read_modify_write(&at.id(), |doc| {
                    let count = doc.get("accessCount").and_then(Value::as_u64).unwrap_or(0);
                    doc.insert("accessCount".into(), json!(count + 1));
                    doc.insert("lastAccessedAt".into(), json!(now()));
                })
                .await
            }
            Op::ListKeys => check_count("_find (keys)", self.find(&at, &["key"]).await?),
            Op::GetAll | Op::Mixed => check_count("_find (key, value)", self.find(&at, &["key", "value"]).await?),
        }
    }
}

/// One phase's measurements.
struct Phase {
    op: Op,
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

    fn error_rate(&self) -> f64 {
        if self.requests == 0 {
            1.0
        } else {
            self.errors as f64 / self.requests as f64
        }
    }

    fn throughput(&self) -> f64 {
        self.ok() as f64 / self.elapsed.as_secs_f64()
    }

    fn max_ms(&self) -> f64 {
        if self.latency.is_empty() {
            0.0
        } else {
            self.latency.max() as f64 / 1000.0
        }
    }

    fn passed(&self) -> bool {
        self.requests > 0 && self.error_rate() <= MAX_ERROR_RATE
    }

    fn to_json(&self) -> Value {
        json!({
            "operation": self.op.name(),
            "requests": self.requests,
            "errors": self.errors,
            "elapsed_s": self.elapsed.as_secs_f64(),
            "throughput_rps": self.throughput(),
            "p50_ms": quantile_ms(&self.latency, 0.50),
            "p99_ms": quantile_ms(&self.latency, 0.99),
            "max_ms": self.max_ms(),
            "first_error": self.first_error,
        })
    }
}

/// Runs one closed-loop phase: `clients` tasks each sending one request at a time until the
/// deadline passes or `max_requests` have been started.
async fn run_phase<T: Target>(target: &Arc<T>, op: Op, config: &Config) -> Result<Phase, String> {
    let issued = Arc::new(AtomicU64::new(0));
    let first_error = Arc::new(Mutex::new(None::<String>));
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(config.seconds);
    let mut tasks = Vec::with_capacity(config.clients);
    for _ in 0..config.clients {
        let (target, issued, first_error) = (Arc::clone(target), Arc::clone(&issued), Arc::clone(&first_error));
        let max_requests = config.max_requests;
        tasks.push(tokio::spawn(async move {
            let mut latency = histogram();
            let (mut requests, mut errors) = (0u64, 0u64);
            while Instant::now() < deadline {
                let seq = issued.fetch_add(1, Ordering::Relaxed);
                if seq >= max_requests {
                    break;
                }
                let began = Instant::now();
                let outcome = target.call(op, seq).await;
                let took = began.elapsed();
                requests += 1;
                match outcome {
                    Ok(()) => latency.saturating_record((took.as_micros() as u64).max(1)),
                    Err(message) => {
                        errors += 1;
                        first_error.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(message);
                    }
                }
            }
            (requests, errors, latency)
        }));
    }
    let mut phase =
        Phase { op, requests: 0, errors: 0, elapsed: Duration::ZERO, latency: histogram(), first_error: None };
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

async fn run_phases<T: Target>(target: T, config: &Config) -> Result<Vec<Phase>, String> {
    let target = Arc::new(target);
    let mut phases = Vec::new();
    for &op in &config.phases {
        phases.push(run_phase(&target, op, config).await?);
    }
    Ok(phases)
}

/// A process's peak and current resident set, from `/proc/PID/status`, in bytes.
fn memory_of(pid: u32) -> Result<(u64, u64), String> {
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| format!("/proc/{pid}/status: {e}"))?;
    let field = |name: &str| -> Result<u64, String> {
        let line =
            status.lines().find(|l| l.starts_with(name)).ok_or_else(|| format!("no {name} in /proc/{pid}/status"))?;
        let kib = line[name.len()..].trim().trim_end_matches("kB").trim();
        kib.parse::<u64>().map(|k| k * 1024).map_err(|_| format!("/proc/{pid}/status: {line}"))
    };
    Ok((field("VmHWM:")?, field("VmRSS:")?))
}

// ---- pouchdb-server ----

/// A pouchdb-server process on a LevelDB directory; killed on drop.
struct PouchServer {
    child: std::process::Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Drop for PouchServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_pouchdb_server() -> Result<PouchServer, String> {
    let binary = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("node_modules/.bin/pouchdb-server");
    if !binary.exists() {
        return Err(format!("pouchdb-server is not installed at {} (run `npm ci`)", binary.display()));
    }
    let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
    let config = json!({ "admins": { POUCH_LOGIN.0: POUCH_LOGIN.1 } });
    std::fs::write(dir.path().join("config.json"), config.to_string()).map_err(|e| e.to_string())?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port: {e}"))?;
    let log = std::fs::File::create(dir.path().join("server.log")).map_err(|e| e.to_string())?;
    let child = Command::new(&binary)
        .args(["--host", "127.0.0.1", "--port", &port.to_string(), "--dir", "."])
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(log.try_clone().map_err(|e| e.to_string())?)
        .stderr(log)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", binary.display()))?;
    let server = PouchServer { child, url: format!("http://127.0.0.1:{port}"), _dir: dir };
    let started = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if started.elapsed() > Duration::from_secs(30) {
            return Err("pouchdb-server did not listen within 30 s".into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(server)
}

/// Creates the database and its index, writes the store's documents with `_bulk_docs`, and builds
/// the index with a first query; returns how long that query took.
async fn seed_pouch(pouch: &Pouch) -> Result<Duration, String> {
    use futures::StreamExt;
    send_json(pouch.request(reqwest::Method::PUT, "")).await.map_err(|e| format!("creating the database: {e}"))?;
    let index = json!({ "index": { "fields": ["userId", "namespace"] }, "name": "idx-user-namespace", "type": "json" });
    send_json(pouch.request(reqwest::Method::POST, "/_index").json(&index))
        .await
        .map_err(|e| format!("creating the index: {e}"))?;
    let batches = (0..pouch.docs).step_by(POUCH_BULK).map(|start| {
        let docs: Vec<Value> = (start..(start + POUCH_BULK).min(pouch.docs)).map(seeded_document).collect();
        async move {
            let (_, body) =
                send_json(pouch.request(reqwest::Method::POST, "/_bulk_docs").json(&json!({ "docs": docs })))
                    .await
                    .map_err(|e| format!("_bulk_docs: {e}"))?;
            let failed = body.as_array().map_or(0, |rows| rows.iter().filter(|r| r.get("error").is_some()).count());
            if failed > 0 {
                return Err(format!("_bulk_docs: {failed} documents refused"));
            }
            Ok(())
        }
    });
    let results: Vec<Result<(), String>> =
        futures::stream::iter(batches).buffer_unordered(POUCH_BULK_IN_FLIGHT).collect().await;
    results.into_iter().collect::<Result<(), String>>()?;
    // The first query builds the index over the whole database (minutes on a million documents:
    // longer than a request's timeout), so it gets a client without one, and the phases measure
    // queries, not the build.
    let building = Instant::now();
    let patient = reqwest::Client::builder().no_proxy().build().map_err(|e| format!("HTTP client: {e}"))?;
    let query =
        json!({ "selector": { "userId": "user-00", "namespace": "ns-0000" }, "fields": ["key"], "limit": 1000 });
    let request =
        patient.post(format!("{}/_find", pouch.db)).basic_auth(POUCH_LOGIN.0, Some(POUCH_LOGIN.1)).json(&query);
    let (_, body) = send_json(request).await.map_err(|e| format!("the first _find (building the index): {e}"))?;
    check_count("the first _find", body["docs"].as_array().map_or(0, Vec::len))?;
    Ok(building.elapsed())
}

// ---- one store size ----

/// A side's phases and its server's memory, or why it did not run, or why it could not be
/// measured (a failure: the bench exits 1, after printing what the other side measured).
enum Side {
    Measured { phases: Vec<Phase>, peak_rss: u64, rss: u64, seed_seconds: f64 },
    NotRun(String),
    Failed(String),
}

impl Side {
    fn phases(&self) -> &[Phase] {
        match self {
            Side::Measured { phases, .. } => phases,
            Side::NotRun(_) | Side::Failed(_) => &[],
        }
    }

    fn to_json(&self) -> Value {
        match self {
            Side::Measured { phases, peak_rss, rss, seed_seconds } => json!({
                "phases": phases.iter().map(Phase::to_json).collect::<Vec<_>>(),
                "peak_rss_bytes": peak_rss,
                "rss_after_bytes": rss,
                "seed_seconds": seed_seconds,
            }),
            Side::NotRun(why) => json!({ "not_run": why }),
            Side::Failed(why) => json!({ "failed": why }),
        }
    }
}

struct SizeResult {
    docs: usize,
    ndjson_bytes: u64,
    /// The store file's length after the phases.
    store_bytes: u64,
    /// The bytes of its pages in use then (see [`store_bytes_in_use`]).
    store_in_use_bytes: u64,
    commands: Vec<CommandRun>,
    service: Side,
    pouchdb: Side,
}

fn measure_size(docs: usize, config: &Config, runtime: &tokio::runtime::Runtime) -> Result<SizeResult, String> {
    println!("\n== store of {docs} documents ==");
    let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
    let store_path = dir.path().join("store.redb");
    let store = format!("embedded:{}", store_path.display());
    let (commands, ndjson_bytes) = bulk_commands(&config.binary, dir.path(), &store, docs)?;
    for run in &commands {
        println!(
            "{:<8} {:>7.1} s  {:>8.0} docs/s  peak RSS {:>4} MiB",
            run.name,
            run.wall.as_secs_f64(),
            run.docs as f64 / run.wall.as_secs_f64(),
            mib(run.peak_rss)
        );
    }
    let served = match config.cache_mb {
        Some(mb) => format!("{store}?cache_mb={mb}"),
        None => store.clone(),
    };
    let service = runtime.block_on(measure_service(&served, dir.path(), docs, config))?;
    let store_bytes = std::fs::metadata(&store_path).map(|m| m.len()).map_err(|e| e.to_string())?;
    let store_in_use_bytes = store_bytes_in_use(&store_path)?;
    let pouchdb = if config.pouchdb {
        runtime.block_on(measure_pouchdb(docs, config))?
    } else {
        Side::NotRun("deselected with BENCH_POUCHDB=0".into())
    };
    Ok(SizeResult { docs, ndjson_bytes, store_bytes, store_in_use_bytes, commands, service, pouchdb })
}

/// The bytes of the store's allocated pages. redb grows its file ahead of need (doubling up to
/// its 4 GiB region size, then by regions) and reuses the free space later, so the file's length
/// overstates what the documents take.
fn store_bytes_in_use(path: &Path) -> Result<u64, String> {
    let fail = |e: &dyn std::fmt::Display| format!("reading the page statistics of {}: {e}", path.display());
    let db = redb::Database::builder().set_cache_size(16 << 20).open(path).map_err(|e| fail(&e))?;
    let txn = db.begin_write().map_err(|e| fail(&e))?;
    let stats = txn.stats().map_err(|e| fail(&e))?;
    let bytes = stats.allocated_pages() * stats.page_size() as u64;
    txn.abort().map_err(|e| fail(&e))?;
    Ok(bytes)
}

async fn measure_service(store: &str, dir: &Path, docs: usize, config: &Config) -> Result<Side, String> {
    let server = Server::start(&config.binary, store, dir)?;
    println!("agentstore serve on {store}: {}", server.base);
    let service = Service { http: http_client(config.clients)?, base: server.base.clone(), docs };
    let phases = run_phases(service, config).await;
    let memory = memory_of(server.pid());
    server.stop()?;
    let (peak_rss, rss) = memory?;
    Ok(Side::Measured { phases: phases?, peak_rss, rss, seed_seconds: 0.0 })
}

async fn measure_pouchdb(docs: usize, config: &Config) -> Result<Side, String> {
    let server = match start_pouchdb_server() {
        Ok(server) => server,
        Err(why) => return Ok(Side::NotRun(why)),
    };
    let pouch = Pouch { http: http_client(config.clients)?, db: format!("{}/serve_load", server.url), docs };
    let seeding = Instant::now();
    let index_build = match seed_pouch(&pouch).await {
        Ok(took) => took,
        Err(e) => return Ok(Side::Failed(format!("seeding pouchdb-server: {e}"))),
    };
    let seed_seconds = seeding.elapsed().as_secs_f64();
    println!(
        "pouchdb-server (LevelDB) {}: seeded {docs} documents in {seed_seconds:.1} s, of which the index build {:.1} s",
        server.url,
        index_build.as_secs_f64()
    );
    let phases = run_phases(pouch, config).await?;
    let (peak_rss, rss) = memory_of(server.child.id())?;
    Ok(Side::Measured { phases, peak_rss, rss, seed_seconds })
}

// ---- reporting ----

fn phase_row(docs: usize, server: &str, phase: &Phase) -> Vec<String> {
    vec![
        docs.to_string(),
        server.to_owned(),
        phase.op.name().to_owned(),
        phase.requests.to_string(),
        phase.errors.to_string(),
        format!("{:.0}", phase.throughput()),
        format!("{:.2}", quantile_ms(&phase.latency, 0.50)),
        format!("{:.2}", quantile_ms(&phase.latency, 0.99)),
        format!("{:.1}", phase.max_ms()),
    ]
}

fn print_results(results: &[SizeResult]) {
    let mut rows = Vec::new();
    for result in results {
        for (server, side) in [("agentstore", &result.service), ("pouchdb-server", &result.pouchdb)] {
            match side {
                Side::Measured { phases, .. } => rows.extend(phases.iter().map(|p| phase_row(result.docs, server, p))),
                Side::NotRun(why) => {
                    rows.push(vec![result.docs.to_string(), server.to_owned(), format!("NOT RUN: {why}")])
                }
                Side::Failed(why) => {
                    rows.push(vec![result.docs.to_string(), server.to_owned(), format!("FAILED: {why}")])
                }
            }
        }
    }
    let header = ["docs", "server", "operation", "requests", "errors", "req/s", "p50 ms", "p99 ms", "max ms"];
    println!();
    print!("{}", aligned(&header, &rows, 3));
    println!("(latency per operation including the full body; pouchdb-server's set and get are GET + PUT)");

    let mut rows = Vec::new();
    for result in results {
        for (server, side) in [("agentstore serve", &result.service), ("pouchdb-server", &result.pouchdb)] {
            if let Side::Measured { peak_rss, rss, .. } = side {
                rows.push(vec![result.docs.to_string(), server.to_owned(), mib(*peak_rss), mib(*rss)]);
            }
        }
        for run in &result.commands {
            rows.push(vec![
                result.docs.to_string(),
                format!("agentstore {}", run.name),
                mib(run.peak_rss),
                String::new(),
            ]);
        }
    }
    println!();
    print!("{}", aligned(&["docs", "process", "peak RSS MiB", "RSS after MiB"], &rows, 2));
    for result in results {
        let per_doc = |bytes: u64| bytes as f64 / result.docs as f64;
        println!(
            "store of {}: file {:.0} MiB ({:.0} bytes per document); pages in use {:.0} MiB ({:.0} bytes per \
             document, {:.2}x its NDJSON of {:.0} bytes per document)",
            result.docs,
            result.store_bytes as f64 / 1048576.0,
            per_doc(result.store_bytes),
            result.store_in_use_bytes as f64 / 1048576.0,
            per_doc(result.store_in_use_bytes),
            result.store_in_use_bytes as f64 / result.ndjson_bytes as f64,
            per_doc(result.ndjson_bytes)
        );
    }
    if let Some(scale) = scale_rows(results) {
        println!();
        print!("{}", aligned(&["server", "operation", "req/s small", "req/s large", "small / large"], &scale, 2));
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.0}", bytes as f64 / 1048576.0)
}

/// Throughput on the smallest store over throughput on the largest, per server and operation.
fn scale_rows(results: &[SizeResult]) -> Option<Vec<Vec<String>>> {
    let (small, large) = (results.iter().min_by_key(|r| r.docs)?, results.iter().max_by_key(|r| r.docs)?);
    if small.docs == large.docs {
        return None;
    }
    println!("\nscale: {} documents against {}", small.docs, large.docs);
    let mut rows = Vec::new();
    for (server, a, b) in
        [("agentstore", &small.service, &large.service), ("pouchdb-server", &small.pouchdb, &large.pouchdb)]
    {
        for (p, q) in a.phases().iter().zip(b.phases()) {
            rows.push(vec![
                server.to_owned(),
                p.op.name().to_owned(),
                format!("{:.0}", p.throughput()),
                format!("{:.0}", q.throughput()),
                format!("{:.2}", p.throughput() / q.throughput()),
            ]);
        }
    }
    Some(rows)
}

fn report_json(config: &Config, passed: bool, results: &[SizeResult]) -> Value {
    json!({
        "benchmark": NAME,
        "nproc": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "clients": config.clients,
        "seconds": config.seconds,
        "max_requests": config.max_requests,
        "cache_mb": config.cache_mb,
        "passed": passed,
        "stores": results.iter().map(|r| json!({
            "docs": r.docs,
            "ndjson_bytes": r.ndjson_bytes,
            "store_bytes": r.store_bytes,
            "store_in_use_bytes": r.store_in_use_bytes,
            "commands": r.commands.iter().map(CommandRun::to_json).collect::<Vec<_>>(),
            "agentstore": r.service.to_json(),
            "pouchdb_server": r.pouchdb.to_json(),
        })).collect::<Vec<_>>(),
    })
}

pub fn main() -> std::process::ExitCode {
    bench_main(NAME, run)
}

/// Runs the benchmark; Ok(false) when a phase's error rate is over the limit.
fn run() -> Result<bool, String> {
    let config = Config::from_env()?;
    println!("{NAME}: the embedded store behind agentstore serve, and pouchdb-server, over loopback HTTP/1.1");
    println!(
        "nproc: {}  clients: {}  per phase: {} s or {} requests  stores: {:?}  binary: {}",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        config.clients,
        config.seconds,
        config.max_requests,
        config.store_docs,
        config.binary
    );
    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| format!("tokio runtime: {e}"))?;
    let mut results = Vec::new();
    for &docs in &config.store_docs {
        results.push(measure_size(docs, &config, &runtime)?);
    }
    print_results(&results);

    let mut passed = true;
    for result in &results {
        for (server, side) in [("agentstore", &result.service), ("pouchdb-server", &result.pouchdb)] {
            if let Side::Failed(why) = side {
                passed = false;
                eprintln!("{NAME}: {} docs, {server}: {why}", result.docs);
            }
            for phase in side.phases().iter().filter(|p| !p.passed()) {
                passed = false;
                eprintln!(
                    "{NAME}: {} docs, {server}, {}: {} errors in {} requests; first: {}",
                    result.docs,
                    phase.op.name(),
                    phase.errors,
                    phase.requests,
                    phase.first_error.as_deref().unwrap_or("none sent")
                );
            }
        }
    }
    write_report(NAME, &report_json(&config, passed, &results))?;
    if !passed {
        eprintln!("{NAME}: FAILED: a phase's error rate is over {:.0}%", MAX_ERROR_RATE * 100.0);
    }
    Ok(passed)
}
