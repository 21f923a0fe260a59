//! One instance against three behind a load balancer (issue 36): the same CouchDB operations
//! through HAProxy in front of one `agentstore serve` and then in front of three, over the same
//! backend and data in one run, and how long a new instance takes to serve a view of the whole
//! database.
//!
//! Run it with `cargo bench --bench benches -- balanced_bench`. For each backend of
//! `BENCH_TARGETS` (default `dynamodb`; also `firestore`: the tests' dynalite and Firestore
//! emulator, `tests/common/servers.rs`; the embedded store is one process's file and cannot be
//! shared), over a fresh table or collection:
//!
//! 1. **one instance**: a deployment of one release-built `serve` behind HAProxy
//!    (`tests/common/balancer.rs`: round-robin, no stickiness, `/readyz` health checks, no logins
//!    configured), which loads `BENCH_DOCS` (default 100,000) documents
//!    `{"_id": "d0000042", "type": "t2", "n": 42}` into the database `bench` by `_bulk_docs` of
//!    1,000 (4 in flight), then the design document `_design/bench` (map
//!    `emit(doc.type, doc.n)`) and a Mango json index on `n`;
//! 2. every instance of the deployment is warmed directly (not through the balancer): the first
//!    view query (`?limit=1`) builds that instance's own view index file and the first `_find` its
//!    Mango index; each is timed, per instance;
//! 3. four phases of `BENCH_CLIENTS` (default 16) concurrent keep-alive clients for
//!    `BENCH_SECONDS` (default 10) each, through the balancer: `read` (`GET /bench/{id}`, a
//!    spread id), `find` (`_find` of `n` in a range of 10, 10 documents), `view`
//!    (`?key="tK"&reduce=false&limit=10`, 10 rows) and `create` (`POST /bench` of a new document);
//!    every answer is checked;
//! 4. the deployment stops, and **three instances** start over the same backend and data: steps
//!    2 and 3 again;
//! 5. **a new instance**: one more `serve` is started beside the three: the time from its start to
//!    `/readyz`, and then to the answer of its first view query over the whole database, which
//!    builds its index from the backend (docs/operations.md: every instance keeps its own index
//!    files).
//!
//! On two cores the backend's server (dynalite, the Firestore emulator), HAProxy, the instances
//! and the clients share the machine, so three instances cannot add cores: the run shows what a
//! balancer and more processes cost or gain on the same hardware, not a cluster's scaling.
//! One Markdown table goes to stdout, the JSON to `target/bench/balanced_bench.json`.
//!
//! `cargo test --all-targets` also builds and runs the bench binary (without `--bench`); it then
//! only prints how to run it and exits 0.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::balancer::{Deployment, DeploymentSpec};
use crate::common;
use crate::common::phase::Latencies;
use crate::common::workload::spread;
use crate::servers;

use common::{bench_main, describe, run_suffix, write_report};

const NAME: &str = "balanced_bench";
const BIN: &str = env!("CARGO_BIN_EXE_agentstore");
/// Per-request timeout: an index build over a slow backend may take minutes.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(3600);
/// The database the bench fills.
const DB: &str = "bench";
/// Distinct values of `type` (the view's key).
const TYPES: usize = 10;
/// Rows each view query and `_find` asks for.
const PAGE: usize = 10;
/// Documents per `_bulk_docs` while loading, and how many are in flight.
const BATCH: usize = 1_000;
const LOAD_IN_FLIGHT: usize = 4;
const VIEW: &str = "/_design/bench/_view/v";

// ---- settings ----

/// A backend the instances share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    DynamoDb,
    Firestore,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::DynamoDb => "dynamodb",
            Backend::Firestore => "firestore",
        }
    }

    /// A fresh table or collection on the tests' server, and what that server is.
    fn fresh_url(self, suffix: &str) -> Result<(String, String), String> {
        match self {
            Backend::DynamoDb => {
                let server = servers::dynamodb()?;
                Ok((server.table_url(&format!("balanced_{suffix}")), server.product))
            }
            Backend::Firestore => {
                let server = servers::firestore()?;
                Ok((server.collection_url(&format!("balanced_{suffix}")), server.product))
            }
        }
    }
}

struct Config {
    /// `BENCH_DOCS` (default 100,000): documents loaded before anything is measured.
    docs: usize,
    /// `BENCH_CLIENTS` (default 16): concurrent clients of each phase.
    clients: usize,
    /// `BENCH_SECONDS` (default 10): how long each phase runs.
    seconds: u64,
    /// `BENCH_INSTANCES` (default 3): the balanced deployment's size, measured after one.
    instances: usize,
    /// `BENCH_TARGETS` (default `dynamodb`).
    backends: Vec<Backend>,
}

impl Config {
    fn from_env() -> Result<Self, String> {
        let backends = std::env::var("BENCH_TARGETS")
            .unwrap_or_else(|_| "dynamodb".into())
            .split(',')
            .filter(|name| !name.trim().is_empty())
            .map(|name| match name.trim() {
                "dynamodb" => Ok(Backend::DynamoDb),
                "firestore" => Ok(Backend::Firestore),
                other => Err(format!("BENCH_TARGETS: unknown backend {other:?} (dynamodb, firestore)")),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let config = Config {
            docs: common::env_number("BENCH_DOCS", 100_000usize)?,
            clients: common::env_number("BENCH_CLIENTS", 16usize)?,
            seconds: common::env_number("BENCH_SECONDS", 10u64)?,
            instances: common::env_number("BENCH_INSTANCES", 3usize)?,
            backends,
        };
        if config.docs < TYPES * PAGE {
            return Err(format!("BENCH_DOCS must be at least {}", TYPES * PAGE));
        }
        if config.clients == 0 || config.seconds == 0 || config.instances < 2 {
            return Err("BENCH_CLIENTS and BENCH_SECONDS must be at least 1, BENCH_INSTANCES at least 2".into());
        }
        Ok(config)
    }
}

// ---- requests ----

/// A client with one keep-alive connection.
fn http_client() -> Result<reqwest::Client, String> {
    crate::common::phase::keep_alive_client(REQUEST_TIMEOUT)
}

/// Sends a request and parses its JSON answer; any status but a 2xx is an error naming it.
async fn call(
    http: &reqwest::Client,
    method: reqwest::Method,
    url: &str,
    body: Option<&Value>,
) -> Result<Value, String> {
    let what = format!("{method} {url}");
    let mut request = http.request(method, url).header(reqwest::header::ACCEPT, "application/json");
    if let Some(body) = body {
        request = request.json(body);
    }
    let response = request.send().await.map_err(|e| format!("{what}: {}", describe(&e)))?;
    let status = response.status();
    let bytes = response.bytes().await.map_err(|e| format!("{what}: reading the answer: {}", describe(&e)))?;
    let shown = || String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned();
    if !status.is_success() {
        return Err(format!("{what}: status {status}: {}", shown()));
    }
    serde_json::from_slice(&bytes).map_err(|e| format!("{what}: not JSON ({e}): {}", shown()))
}

/// The `i`-th loaded document.
fn document(i: usize) -> Value {
    json!({ "_id": format!("d{i:07}"), "type": format!("t{}", i % TYPES), "n": i })
}

/// Creates the database, loads the documents, the design document and the Mango index.
async fn load(base: &str, docs: usize) -> Result<Duration, String> {
    let http = http_client()?;
    call(&http, reqwest::Method::PUT, &format!("{base}/{DB}"), None).await?;
    let started = Instant::now();
    let batches: Vec<(usize, usize)> = (0..docs).step_by(BATCH).map(|from| (from, (from + BATCH).min(docs))).collect();
    for group in batches.chunks(LOAD_IN_FLIGHT) {
        let sent = group.iter().map(|&(from, to)| {
            let http = &http;
            async move {
                let body = json!({ "docs": (from..to).map(document).collect::<Vec<_>>() });
                let rows = call(http, reqwest::Method::POST, &format!("{base}/{DB}/_bulk_docs"), Some(&body)).await?;
                let written = rows.as_array().map_or(0, |rows| rows.iter().filter(|row| row["ok"] == true).count());
                if written != to - from {
                    return Err(format!("_bulk_docs of {from}..{to} wrote {written}: {rows}"));
                }
                Ok(())
            }
        });
        futures::future::try_join_all(sent).await?;
    }
    let loaded = started.elapsed();
    let design = json!({ "views": { "v": { "map": "function (doc) { emit(doc.type, doc.n); }" } } });
    call(&http, reqwest::Method::PUT, &format!("{base}/{DB}/_design/bench"), Some(&design)).await?;
    let index = json!({ "index": { "fields": ["n"] }, "ddoc": "by-n", "name": "by-n" });
    call(&http, reqwest::Method::POST, &format!("{base}/{DB}/_index"), Some(&index)).await?;
    Ok(loaded)
}

/// The first view query and the first `_find` on one instance, each timed: they build its index
/// files from the backend.
async fn warm(instance: &str) -> Result<(Duration, Duration), String> {
    let http = http_client()?;
    let started = Instant::now();
    call(&http, reqwest::Method::GET, &format!("{instance}/{DB}{VIEW}?limit=1"), None).await?;
    let view = started.elapsed();
    let started = Instant::now();
    call(&http, reqwest::Method::POST, &format!("{instance}/{DB}/_find"), Some(&Op::find_body(0))).await?;
    Ok((view, started.elapsed()))
}

// ---- the phases ----

#[derive(Debug, Clone, Copy)]
enum Op {
    Read,
    Find,
    View,
    Create,
}

impl Op {
    const ALL: [Op; 4] = [Op::Read, Op::Find, Op::View, Op::Create];

    fn label(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Find => "find",
            Op::View => "view",
            Op::Create => "create",
        }
    }

    fn find_body(start: usize) -> Value {
        json!({ "selector": { "n": { "$gte": start, "$lt": start + PAGE } }, "limit": PAGE })
    }

    /// The `round`-th call: what to send, and what its answer must hold.
    async fn call(self, http: &reqwest::Client, base: &str, docs: usize, round: u64, tag: &str) -> Result<(), String> {
        let pick = spread(round);
        match self {
            Op::Read => {
                let id = format!("d{:07}", pick % docs);
                let answer = call(http, reqwest::Method::GET, &format!("{base}/{DB}/{id}"), None).await?;
                check(answer["_id"] == id.as_str(), || format!("GET {id} answered {answer}"))
            }
            Op::Find => {
                let body = Op::find_body(pick % (docs - PAGE));
                let answer = call(http, reqwest::Method::POST, &format!("{base}/{DB}/_find"), Some(&body)).await?;
                let found = answer["docs"].as_array().map_or(0, Vec::len);
                check(found == PAGE, || format!("_find found {found}: {body}"))
            }
            Op::View => {
                let key = format!("t{}", pick % TYPES);
                let url = format!("{base}/{DB}{VIEW}?key=%22{key}%22&reduce=false&limit={PAGE}");
                let answer = call(http, reqwest::Method::GET, &url, None).await?;
                let rows = answer["rows"].as_array().map_or(0, Vec::len);
                check(rows == PAGE, || format!("the view answered {rows} rows for {key}"))
            }
            Op::Create => {
                let body = json!({ "_id": format!("c-{tag}-{round}"), "type": "created", "n": -1 });
                let answer = call(http, reqwest::Method::POST, &format!("{base}/{DB}"), Some(&body)).await?;
                check(answer["ok"] == true, || format!("POST answered {answer}"))
            }
        }
    }
}

fn check(holds: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if holds {
        Ok(())
    } else {
        Err(what())
    }
}

/// What one phase measured.
struct Phase {
    op: Op,
    latencies: Latencies,
}

impl Phase {
    /// `1234 (2.1 / 9.8)`: requests/s (median / p99 ms).
    fn cell(&self) -> String {
        let latencies = &self.latencies;
        format!("{:.0} ({:.1} / {:.1})", latencies.per_s(), latencies.quantile_ms(0.5), latencies.quantile_ms(0.99))
    }

    fn to_json(&self) -> Value {
        let mut json = self.latencies.to_json();
        json["op"] = json!(self.op.label());
        json
    }
}

/// `config.clients` clients through `base` repeating `op` for `config.seconds`.
async fn run_phase(base: &str, config: &Config, op: Op, tag: &str) -> Result<Phase, String> {
    let connections = (0..config.clients).map(|_| http_client()).collect::<Result<Vec<_>, _>>()?;
    let duration = Duration::from_secs(config.seconds);
    let latencies =
        Latencies::measure(&connections, duration, |http, round| op.call(http, base, config.docs, round, tag)).await?;
    Ok(Phase { op, latencies })
}

// ---- one deployment ----

/// What one deployment size measured.
struct Sized {
    instances: usize,
    /// Per instance: its first view query and first `_find` (index builds).
    warm: Vec<(Duration, Duration)>,
    phases: Vec<Phase>,
}

async fn measure_deployment(deployment: &Deployment, config: &Config, tag: &str) -> Result<Sized, String> {
    let mut warmed = Vec::new();
    for instance in deployment.instance_urls() {
        warmed.push(warm(&instance).await?);
    }
    let mut phases = Vec::new();
    for op in Op::ALL {
        let phase = run_phase(&deployment.url(), config, op, tag).await?;
        println!("  {} instance(s), {}: {}", deployment.instance_urls().len(), op.label(), phase.cell());
        phases.push(phase);
    }
    Ok(Sized { instances: deployment.instance_urls().len(), warm: warmed, phases })
}

/// What a new instance beside a running deployment took.
struct NewInstance {
    ready: Duration,
    first_view: Duration,
}

/// Everything measured over one backend.
struct Measured {
    backend: Backend,
    product: String,
    load: Duration,
    sizes: Vec<Sized>,
    new_instance: NewInstance,
}

fn spec(binary: &str, backend_url: &str, instances: usize, work_dir: PathBuf) -> DeploymentSpec {
    DeploymentSpec {
        binary: PathBuf::from(binary),
        backend_url: backend_url.to_owned(),
        env: Vec::new(),
        config_toml: String::new(),
        instances,
        work_dir,
    }
}

async fn measure_backend(backend: Backend, config: &Config, dir: &std::path::Path) -> Result<Measured, String> {
    let (backend_url, product) = backend.fresh_url(&run_suffix())?;
    println!("{NAME}: {} ({product}), {} documents", backend.name(), config.docs);
    let one = Deployment::start(spec(BIN, &backend_url, 1, dir.join("one")))?;
    let load = load(&one.url(), config.docs).await?;
    println!("  loaded in {:.1} s", load.as_secs_f64());
    let mut sizes = vec![measure_deployment(&one, config, "one").await?];
    drop(one);
    let mut many = Deployment::start(spec(BIN, &backend_url, config.instances, dir.join("many")))?;
    sizes.push(measure_deployment(&many, config, "many").await?);
    let started = Instant::now();
    let url = many.start_instance()?;
    let ready = started.elapsed();
    let http = http_client()?;
    call(&http, reqwest::Method::GET, &format!("{url}/{DB}{VIEW}?limit=1"), None).await?;
    let new_instance = NewInstance { ready, first_view: started.elapsed() };
    Ok(Measured { backend, product, load, sizes, new_instance })
}

// ---- the report ----

fn table(config: &Config, results: &[Measured]) -> String {
    let mut out = String::from("| backend | instances | read req/s (p50 / p99 ms) | find | view | create | first view per instance s | first _find per instance s |\n");
    out.push_str("| --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for measured in results {
        for sized in &measured.sizes {
            let cells: Vec<String> = sized.phases.iter().map(Phase::cell).collect();
            let seconds = |pick: fn(&(Duration, Duration)) -> Duration| {
                sized.warm.iter().map(|w| format!("{:.1}", pick(w).as_secs_f64())).collect::<Vec<_>>().join(", ")
            };
            out.push_str(&format!(
                "| {} ({}) | {} | {} | {} | {} |\n",
                measured.backend.name(),
                measured.product,
                sized.instances,
                cells.join(" | "),
                seconds(|w| w.0),
                seconds(|w| w.1),
            ));
        }
    }
    out.push_str(&format!(
        "\n{} documents; {} clients for {} s per phase. A new instance beside the running ones:\n\n",
        config.docs, config.clients, config.seconds
    ));
    for measured in results {
        out.push_str(&format!(
            "- {}: ready after {:.1} s, its first view over every document answered after {:.1} s (load {:.1} s)\n",
            measured.backend.name(),
            measured.new_instance.ready.as_secs_f64(),
            measured.new_instance.first_view.as_secs_f64(),
            measured.load.as_secs_f64(),
        ));
    }
    out
}

fn to_json(config: &Config, results: &[Measured]) -> Value {
    json!({
        "docs": config.docs,
        "clients": config.clients,
        "seconds": config.seconds,
        "backends": results.iter().map(|m| json!({
            "backend": m.backend.name(),
            "server": m.product,
            "load_s": m.load.as_secs_f64(),
            "sizes": m.sizes.iter().map(|s| json!({
                "instances": s.instances,
                "first_view_s": s.warm.iter().map(|w| w.0.as_secs_f64()).collect::<Vec<_>>(),
                "first_find_s": s.warm.iter().map(|w| w.1.as_secs_f64()).collect::<Vec<_>>(),
                "phases": s.phases.iter().map(Phase::to_json).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "new_instance_ready_s": m.new_instance.ready.as_secs_f64(),
            "new_instance_first_view_s": m.new_instance.first_view.as_secs_f64(),
        })).collect::<Vec<_>>(),
    })
}

pub fn main() -> std::process::ExitCode {
    bench_main(NAME, run)
}

fn run() -> Result<bool, String> {
    let config = Config::from_env()?;
    let dir = tempfile::tempdir().map_err(|e| format!("temporary directory: {e}"))?;
    let runtime = tokio::runtime::Runtime::new().map_err(|e| format!("runtime: {e}"))?;
    let mut results = Vec::new();
    let mut failed = false;
    for backend in config.backends.clone() {
        match runtime.block_on(measure_backend(backend, &config, &dir.path().join(backend.name()))) {
            Ok(measured) => results.push(measured),
            Err(message) => {
                eprintln!("{NAME}: {}: {message}", backend.name());
                failed = true;
            }
        }
    }
    println!("\n{}", table(&config, &results));
    write_report(NAME, &to_json(&config, &results))?;
    Ok(!failed)
}
