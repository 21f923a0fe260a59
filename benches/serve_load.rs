//! Load benchmark of `agentstore serve` on the embedded backend, over loopback HTTP.
//!
//! Run it with `cargo bench --bench serve_load`. It spawns the release binary cargo built for the
//! bench (`CARGO_BIN_EXE_agentstore`) on a fresh store file in a temporary directory, seeds 1,000
//! documents (2 users × 5 namespaces × 100 keys; not timed), then runs one closed-loop phase per
//! operation with `BENCH_CLIENTS` concurrent clients:
//!
//! | phase       | request                                                        |
//! |-------------|----------------------------------------------------------------|
//! | `set`       | `PUT …/keys/{key}`: a ~100-byte JSON value with metadata, agent header |
//! | `get`       | `GET …/keys/{key}` of an existing key (counts an access: a write) |
//! | `list_keys` | `GET …/namespaces/{namespace}/keys` of a 100-key namespace     |
//! | `get_all`   | `GET …/namespaces/{namespace}` of a 100-key namespace          |
//!
//! Each phase stops at `BENCH_SECONDS` (default 5) or `BENCH_MAX_REQUESTS` (default 20,000),
//! whichever comes first; requests in flight at the deadline are finished and counted. Latency is
//! wall-clock around the whole request including reading the full body, on one shared keep-alive
//! `reqwest::Client`; nothing is retried. Any transport error or non-2xx status is an error; the
//! bench exits 1 if any phase's error rate is over 1%. Latency percentiles and throughput are over
//! the successful requests. Results go to stdout as a table and to `target/bench/serve_load.json`.
//!
//! `cargo test --all-targets` also builds and runs this target (without `--bench`); it then only
//! prints how to run it and exits 0.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde_json::{json, Value};

#[path = "common/serve.rs"]
mod serve;
use serve::Server;

const BIN: &str = env!("CARGO_BIN_EXE_agentstore");
const USERS: usize = 2;
const NAMESPACES: usize = 5;
const KEYS_PER_NAMESPACE: usize = 100;
const TOTAL_KEYS: usize = USERS * NAMESPACES * KEYS_PER_NAMESPACE;
const AGENT: &str = "bench-agent";
/// The error rate above which the bench fails.
const MAX_ERROR_RATE: f64 = 0.01;
/// Per-request timeout: a request that takes longer is an error.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Set,
    Get,
    ListKeys,
    GetAll,
}

impl Op {
    const ALL: [Op; 4] = [Op::Set, Op::Get, Op::ListKeys, Op::GetAll];

    fn name(self) -> &'static str {
        match self {
            Op::Set => "set",
            Op::Get => "get",
            Op::ListKeys => "list_keys",
            Op::GetAll => "get_all",
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
            clients: var("BENCH_CLIENTS", 16usize)?,
            seconds: var("BENCH_SECONDS", 5.0f64)?,
            max_requests: var("BENCH_MAX_REQUESTS", 20_000u64)?,
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

/// The `i`-th document of the seeded key space: (user, namespace, key).
fn document(i: usize) -> (String, String, String) {
    let i = i % TOTAL_KEYS;
    let key = i % KEYS_PER_NAMESPACE;
    let namespace = (i / KEYS_PER_NAMESPACE) % NAMESPACES;
    let user = i / (KEYS_PER_NAMESPACE * NAMESPACES);
    (format!("bench-user-{user}"), format!("ns-{namespace}"), format!("key-{key:03}"))
}

/// The `i`-th request's document: a fixed permutation of the key space, so consecutive requests
/// (and concurrent clients) touch different users, namespaces and keys.
fn spread(i: u64) -> usize {
    // 7919 is prime and coprime with 1000, so this visits every key once per 1000 requests.
    ((i % TOTAL_KEYS as u64) * 7919 % TOTAL_KEYS as u64) as usize
}

/// The PUT body: a value of about 100 bytes of compact JSON, and metadata.
fn put_body(seq: u64) -> Vec<u8> {
    let body = json!({
        "value": {
            "text": "the quick brown fox jumps over the lazy dog",
            "seq": seq,
            "tags": ["bench", "load"],
            "ok": true,
            "score": 0.5
        },
        "metadata": { "source": "serve_load", "seq": seq }
    });
    serde_json::to_vec(&body).expect("serialisable")
}

// ---- the server ----

// ---- the load ----

/// One phase's measurements.
struct PhaseResult {
    op: Op,
    requests: u64,
    errors: u64,
    elapsed: Duration,
    /// Latency of successful requests, in microseconds.
    latency: Histogram<u64>,
    max: Duration,
    first_error: Option<String>,
}

impl PhaseResult {
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

    fn percentile_ms(&self, q: f64) -> f64 {
        if self.latency.is_empty() {
            0.0
        } else {
            self.latency.value_at_quantile(q) as f64 / 1000.0
        }
    }

    fn max_ms(&self) -> f64 {
        self.max.as_secs_f64() * 1000.0
    }

    fn passed(&self) -> bool {
        self.requests > 0 && self.error_rate() <= MAX_ERROR_RATE
    }

    fn to_json(&self) -> Value {
        json!({
            "operation": self.op.name(),
            "requests": self.requests,
            "errors": self.errors,
            "error_rate": self.error_rate(),
            "elapsed_s": self.elapsed.as_secs_f64(),
            "throughput_rps": self.throughput(),
            "p50_ms": self.percentile_ms(0.50),
            "p99_ms": self.percentile_ms(0.99),
            "max_ms": self.max_ms(),
            "first_error": self.first_error,
        })
    }
}

/// Builds request `seq` of `op`.
fn request(client: &reqwest::Client, base: &str, op: Op, seq: u64) -> reqwest::RequestBuilder {
    let (user, namespace, key) = document(spread(seq));
    match op {
        Op::Set => client
            .put(format!("{base}/v1/users/{user}/namespaces/{namespace}/keys/{key}"))
            .header("x-agent-id", AGENT)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(put_body(seq)),
        Op::Get => {
            client.get(format!("{base}/v1/users/{user}/namespaces/{namespace}/keys/{key}")).header("x-agent-id", AGENT)
        }
        Op::ListKeys => client.get(format!("{base}/v1/users/{user}/namespaces/{namespace}/keys")),
        Op::GetAll => client.get(format!("{base}/v1/users/{user}/namespaces/{namespace}")),
    }
}

/// Sends one request and reads its whole body. Err describes a transport error or non-2xx status.
async fn send(builder: reqwest::RequestBuilder) -> Result<(), String> {
    let response = builder.send().await.map_err(|e| format!("transport error: {e}"))?;
    let status = response.status();
    let body = response.bytes().await.map_err(|e| format!("reading body (status {status}): {e}"))?;
    if status.is_success() {
        Ok(())
    } else {
        let text = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
        Err(format!("status {status}: {text}"))
    }
}

/// Runs one closed-loop phase: `clients` tasks each sending one request at a time until the
/// deadline passes or `max_requests` have been started.
async fn run_phase(client: &reqwest::Client, base: &str, op: Op, config: &Config) -> PhaseResult {
    let issued = Arc::new(AtomicU64::new(0));
    let first_error = Arc::new(Mutex::new(None::<String>));
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(config.seconds);
    let mut tasks = Vec::with_capacity(config.clients);
    for _ in 0..config.clients {
        let (client, base, issued, first_error) =
            (client.clone(), base.to_owned(), Arc::clone(&issued), Arc::clone(&first_error));
        let max_requests = config.max_requests;
        tasks.push(tokio::spawn(async move {
            let mut latency = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).expect("histogram bounds");
            let (mut requests, mut errors, mut max) = (0u64, 0u64, Duration::ZERO);
            while Instant::now() < deadline {
                let seq = issued.fetch_add(1, Ordering::Relaxed);
                if seq >= max_requests {
                    break;
                }
                let builder = request(&client, &base, op, seq);
                let began = Instant::now();
                let outcome = send(builder).await;
                let took = began.elapsed();
                requests += 1;
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
            (requests, errors, max, latency)
        }));
    }
    let mut result = PhaseResult {
        op,
        requests: 0,
        errors: 0,
        elapsed: Duration::ZERO,
        latency: Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("histogram bounds"),
        max: Duration::ZERO,
        first_error: None,
    };
    for task in tasks {
        let (requests, errors, max, latency) = task.await.expect("client task panicked");
        result.requests += requests;
        result.errors += errors;
        result.max = result.max.max(max);
        result.latency.add(&latency).expect("same histogram bounds");
    }
    result.elapsed = start.elapsed();
    result.first_error = first_error.lock().unwrap().take();
    result
}

/// Writes every document of the key space (not timed), `clients` at a time, then checks that a
/// namespace lists exactly its 100 keys.
async fn seed(client: &reqwest::Client, base: &str, clients: usize) -> Result<(), String> {
    use futures::StreamExt;
    let results: Vec<Result<(), String>> = futures::stream::iter(0..TOTAL_KEYS)
        .map(|i| {
            let (user, namespace, key) = document(i);
            let builder = client
                .put(format!("{base}/v1/users/{user}/namespaces/{namespace}/keys/{key}"))
                .header("x-agent-id", AGENT)
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(put_body(i as u64));
            async move { send(builder).await.map_err(|e| format!("seeding {user}/{namespace}/{key}: {e}")) }
        })
        .buffer_unordered(clients)
        .collect()
        .await;
    results.into_iter().collect::<Result<(), String>>()?;
    let (user, namespace, _) = document(0);
    let keys: Vec<String> = client
        .get(format!("{base}/v1/users/{user}/namespaces/{namespace}/keys"))
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .map_err(|e| format!("checking the seed: {e}"))?
        .json()
        .await
        .map_err(|e| format!("checking the seed: {e}"))?;
    if keys.len() != KEYS_PER_NAMESPACE {
        return Err(format!("seeded namespace lists {} keys, expected {KEYS_PER_NAMESPACE}", keys.len()));
    }
    Ok(())
}

// ---- reporting ----

fn table(results: &[PhaseResult]) -> String {
    let header = ["operation", "requests", "errors", "req/s", "p50 ms", "p99 ms", "max ms"];
    let rows: Vec<[String; 7]> = results
        .iter()
        .map(|r| {
            [
                r.op.name().to_owned(),
                r.requests.to_string(),
                r.errors.to_string(),
                format!("{:.0}", r.throughput()),
                format!("{:.3}", r.percentile_ms(0.50)),
                format!("{:.3}", r.percentile_ms(0.99)),
                format!("{:.3}", r.max_ms()),
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.len());
        }
    }
    let line = |cells: &[&str]| -> String {
        let mut out = String::new();
        for (i, (cell, width)) in cells.iter().zip(widths).enumerate() {
            if i == 0 {
                out.push_str(&format!("{cell:<width$}"));
            } else {
                out.push_str(&format!("  {cell:>width$}"));
            }
        }
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
        println!("serve_load: run with `cargo bench --bench serve_load`");
        return ExitCode::SUCCESS;
    }
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(message) => {
            eprintln!("serve_load: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the benchmark; Ok(false) when a phase's error rate is over the limit.
fn run() -> Result<bool, String> {
    let config = Config::from_env()?;
    let nproc = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    println!("serve_load: agentstore serve, embedded backend, HTTP/1.1 keep-alive over loopback");
    println!(
        "nproc: {nproc}  clients: {}  seconds per phase: {}  max requests per phase: {}",
        config.clients, config.seconds, config.max_requests
    );
    println!("binary: {BIN}");

    let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
    let store = dir.path().join("bench.redb");
    let server = Server::start(BIN, &format!("embedded:{}", store.display()), dir.path())?;
    println!("server: {}", server.base);

    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| format!("tokio runtime: {e}"))?;
    let outcome = runtime.block_on(async {
        let client = reqwest::Client::builder()
            .no_proxy()
            .pool_max_idle_per_host(config.clients)
            .pool_idle_timeout(Duration::from_secs(90))
            .tcp_nodelay(true)
            .timeout(REQUEST_TIMEOUT)
            .build()
            .map_err(|e| format!("HTTP client: {e}"))?;
        let seeding = Instant::now();
        seed(&client, &server.base, config.clients).await?;
        println!(
            "seeded {TOTAL_KEYS} documents ({USERS} users x {NAMESPACES} namespaces x {KEYS_PER_NAMESPACE} keys) \
             in {:.2} s (not timed)",
            seeding.elapsed().as_secs_f64()
        );
        let mut results = Vec::new();
        for op in Op::ALL {
            results.push(run_phase(&client, &server.base, op, &config).await);
        }
        Ok::<_, String>(results)
    });
    drop(runtime);
    let stopped = server.stop();
    let results = outcome?;

    println!();
    print!("{}", table(&results));
    println!("(throughput and latency over successful requests; latency is per request including the full body)");

    let passed = results.iter().all(PhaseResult::passed);
    for r in results.iter().filter(|r| r.errors > 0 || r.requests == 0) {
        eprintln!(
            "serve_load: {}: {} errors in {} requests ({:.2}%); first: {}",
            r.op.name(),
            r.errors,
            r.requests,
            r.error_rate() * 100.0,
            r.first_error.as_deref().unwrap_or("none sent")
        );
    }

    let report = json!({
        "benchmark": "serve_load",
        "backend": "embedded",
        "nproc": nproc,
        "clients": config.clients,
        "seconds": config.seconds,
        "max_requests": config.max_requests,
        "max_error_rate": MAX_ERROR_RATE,
        "passed": passed,
        "operations": results.iter().map(PhaseResult::to_json).collect::<Vec<_>>(),
    });
    let out_dir = target_dir().join("bench");
    let path = out_dir.join("serve_load.json");
    std::fs::create_dir_all(&out_dir).map_err(|e| format!("creating {}: {e}", out_dir.display()))?;
    let text = serde_json::to_string_pretty(&report).expect("serialisable");
    std::fs::write(&path, text + "\n").map_err(|e| format!("writing {}: {e}", path.display()))?;
    println!("wrote {}", path.display());

    if !passed {
        eprintln!("serve_load: FAILED: a phase's error rate is over {:.0}%", MAX_ERROR_RATE * 100.0);
    }
    stopped?;
    Ok(passed)
}
