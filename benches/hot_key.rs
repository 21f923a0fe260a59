//! Hot-key benchmark: many writers on one document, across `serve` processes (issue 11, item 6).
//!
//! Run it with `cargo bench --bench benches -- hot_key`. For each backend in `HOT_KEY_BACKENDS` (default
//! `embedded,couchdb,dynamodb`) it starts `agentstore serve` processes over one fresh store (two;
//! one on the embedded store, whose file lock admits a single process), then `BENCH_CLIENTS`
//! clients (default 32, each with its own connection, split evenly across the processes) each
//! run `BENCH_ROUNDS` rounds (default 25) of `PUT` (value, a metadata key of the client's own,
//! `X-Agent-Id`) and `GET` on the **same** key. CouchDB is pouchdb-server and DynamoDB is
//! dynalite, started as the tests start them (`AGENTSTORE_TEST_COUCHDB_URL` /
//! `AGENTSTORE_TEST_DYNAMODB_ENDPOINT` point it at real servers instead; not moto, which loses
//! conditional writes under concurrency).
//!
//! Reported per backend: requests, failed requests (transport error or non-2xx, by status),
//! latency p50/p99/max over all requests, and a check of the final document: `accessCount` must
//! equal the requests (+1 for the check's own GET) and every client's metadata key must hold its
//! last round. The bench exits 1 on any failed request or failed check. Results go to stdout and
//! `target/bench/hot_key.json`. Without `--bench` (as `cargo test --all-targets` runs it) it only
//! prints how to run it.

use crate::servers;

use crate::common::serve;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde_json::{json, Value};

use serve::Server;

const BIN: &str = env!("CARGO_BIN_EXE_agentstore");
/// A request taking longer than this is a failure (the server's own request timeout is 30 s).
const CLIENT_TIMEOUT: Duration = Duration::from_secs(120);
const PATH: &str = "/v1/users/bench/namespaces/hot/keys/the-key";

struct Config {
    backends: Vec<String>,
    clients: usize,
    rounds: usize,
}

impl Config {
    fn from_env() -> Result<Self, String> {
        let number = |name: &str, default: usize| -> Result<usize, String> {
            match std::env::var(name) {
                Ok(text) => text.parse().map_err(|_| format!("{name}={text:?} is not a number")),
                Err(_) => Ok(default),
            }
        };
        let backends = std::env::var("HOT_KEY_BACKENDS").unwrap_or_else(|_| "embedded,couchdb,dynamodb".into());
        Ok(Config {
            backends: backends.split(',').map(str::trim).filter(|b| !b.is_empty()).map(str::to_owned).collect(),
            clients: number("BENCH_CLIENTS", 32)?.max(1),
            rounds: number("BENCH_ROUNDS", 25)?.max(1),
        })
    }
}

/// The backend URL of a fresh store, and how many `serve` processes it admits.
fn fresh_store(backend: &str, dir: &Path) -> Result<(String, usize), String> {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let name = format!("hotkey{}x{}", std::process::id(), now.as_millis());
    match backend {
        "embedded" => Ok((format!("embedded:{}", dir.join("hot.redb").display()), 1)),
        "couchdb" => Ok((servers::couchdb()?.database_url(&name), 2)),
        "dynamodb" => Ok((servers::dynamodb()?.table_url(&name), 2)),
        other => Err(format!("unknown backend {other:?} in HOT_KEY_BACKENDS (embedded, couchdb, dynamodb)")),
    }
}

/// What one client saw.
#[derive(Default)]
struct ClientResult {
    latencies_us: Vec<u64>,
    failures: BTreeMap<String, u64>,
}

async fn client_loop(id: usize, base: String, rounds: usize) -> ClientResult {
    let mut result = ClientResult::default();
    let client = match reqwest::Client::builder().no_proxy().timeout(CLIENT_TIMEOUT).build() {
        Ok(client) => client,
        Err(e) => {
            result.failures.insert(format!("client: {e}"), (rounds * 2) as u64);
            return result;
        }
    };
    let url = format!("{base}{PATH}");
    let agent = format!("client-{id}");
    for round in 0..rounds {
        let put = client
            .put(&url)
            .header("X-Agent-Id", &agent)
            .json(&json!({ "value": { "round": round, "by": id }, "metadata": { agent.clone(): round } }));
        let get = client.get(&url).header("X-Agent-Id", &agent);
        for request in [put, get] {
            let started = Instant::now();
            let outcome = match request.send().await {
                Ok(response) => {
                    let status = response.status();
                    let body = response.bytes().await;
                    match (status.is_success(), body) {
                        (true, Ok(_)) => None,
                        (_, Ok(_)) => Some(status.as_u16().to_string()),
                        (_, Err(e)) => Some(format!("body: {e}")),
                    }
                }
                Err(e) if e.is_timeout() => Some("client timeout".into()),
                Err(_) => Some("transport error".into()),
            };
            result.latencies_us.push(started.elapsed().as_micros() as u64);
            if let Some(failure) = outcome {
                *result.failures.entry(failure).or_default() += 1;
            }
        }
    }
    result
}

/// The final document checked against what every client did.
async fn check_document(base: &str, clients: usize, rounds: usize, requests: u64) -> Result<Vec<String>, String> {
    let client = reqwest::Client::builder().no_proxy().timeout(CLIENT_TIMEOUT).build().map_err(|e| e.to_string())?;
    let doc: Value = client
        .get(format!("{base}{PATH}"))
        .send()
        .await
        .map_err(|e| format!("final GET: {e}"))?
        .json()
        .await
        .map_err(|e| format!("final GET body: {e}"))?;
    let mut problems = Vec::new();
    let count = doc["accessCount"].as_u64().unwrap_or(0);
    if count != requests + 1 {
        problems.push(format!("accessCount {count}, expected {} ({requests} requests and the check)", requests + 1));
    }
    for id in 0..clients {
        let key = format!("client-{id}");
        if doc["metadata"][&key] != json!(rounds - 1) {
            problems.push(format!("metadata {key} is {}, expected {}", doc["metadata"][&key], rounds - 1));
        }
    }
    Ok(problems)
}

/// One backend's run.
fn run_backend(backend: &str, config: &Config) -> Result<Value, String> {
    let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
    let (url, process_count) = fresh_store(backend, dir.path())?;
    let mut processes = Vec::new();
    for _ in 0..process_count {
        processes.push(Server::start(BIN, &url, dir.path())?);
    }
    let bases: Vec<String> = processes.iter().map(|p| p.base.clone()).collect();
    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| format!("tokio runtime: {e}"))?;
    let started = Instant::now();
    let results: Vec<ClientResult> = runtime.block_on(async {
        let tasks: Vec<_> = (0..config.clients)
            .map(|id| tokio::spawn(client_loop(id, bases[id % bases.len()].clone(), config.rounds)))
            .collect();
        let mut results = Vec::new();
        for task in tasks {
            results.push(task.await.unwrap_or_default());
        }
        results
    });
    let wall = started.elapsed();
    let mut histogram = Histogram::<u64>::new(3).map_err(|e| e.to_string())?;
    let mut failures: BTreeMap<String, u64> = BTreeMap::new();
    for result in &results {
        for latency in &result.latencies_us {
            histogram.record((*latency).max(1)).map_err(|e| e.to_string())?;
        }
        for (failure, n) in &result.failures {
            *failures.entry(failure.clone()).or_default() += n;
        }
    }
    let requests = histogram.len();
    let failed: u64 = failures.values().sum();
    let problems = runtime.block_on(check_document(&bases[0], config.clients, config.rounds, requests))?;
    drop(runtime);
    for process in processes {
        process.stop()?;
    }
    let ms = |us: u64| us as f64 / 1000.0;
    let report = json!({
        "backend": backend,
        "processes": process_count,
        "clients": config.clients,
        "rounds": config.rounds,
        "requests": requests,
        "failed": failed,
        "failures": failures,
        "seconds": wall.as_secs_f64(),
        "p50_ms": ms(histogram.value_at_quantile(0.50)),
        "p99_ms": ms(histogram.value_at_quantile(0.99)),
        "max_ms": ms(histogram.max()),
        "document_problems": problems,
    });
    println!(
        "{backend:<9} processes {process_count}  requests {requests:>5}  failed {failed:>3}  p50 {:>8.1} ms  p99 {:>8.1} ms  \
         max {:>8.1} ms  wall {:>6.1} s  document {}",
        ms(histogram.value_at_quantile(0.50)),
        ms(histogram.value_at_quantile(0.99)),
        ms(histogram.max()),
        wall.as_secs_f64(),
        if problems.is_empty() { "ok".to_owned() } else { problems.join("; ") },
    );
    if !failures.is_empty() {
        println!("          failures by cause: {failures:?}");
    }
    Ok(report)
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"))
}

fn run() -> Result<bool, String> {
    let config = Config::from_env()?;
    println!(
        "hot_key: {} clients x {} rounds of PUT + GET on one key, split across the serve processes",
        config.clients, config.rounds
    );
    let mut reports = Vec::new();
    for backend in &config.backends {
        reports.push(run_backend(backend, &config)?);
    }
    let passed = reports.iter().all(|r| r["failed"] == json!(0) && r["document_problems"] == json!([]));
    let path = target_dir().join("bench").join("hot_key.json");
    std::fs::create_dir_all(path.parent().expect("has a parent")).map_err(|e| e.to_string())?;
    let text = serde_json::to_string_pretty(&json!({ "benchmark": "hot_key", "passed": passed, "runs": reports }))
        .expect("serialisable");
    std::fs::write(&path, text + "\n").map_err(|e| format!("writing {}: {e}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(passed)
}

pub fn main() -> ExitCode {
    if !std::env::args().skip(1).any(|a| a == "--bench") {
        println!("hot_key: run with `cargo bench --bench benches -- hot_key`");
        return ExitCode::SUCCESS;
    }
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("hot_key: FAILED: a request failed or the final document is wrong");
            ExitCode::FAILURE
        }
        Err(message) => {
            eprintln!("hot_key: {message}");
            ExitCode::FAILURE
        }
    }
}
