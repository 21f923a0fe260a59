//! Migration throughput against each backend's own bulk limits, measured in one run.
//!
//! Run it with `cargo bench --bench benches -- migrate_bench`. `BENCH_MIGRATE_DOCS` sets the data set size
//! (default 100,000); `BENCH_MIGRATE_BACKENDS` (default `embedded,couchdb,dynamodb,firestore`)
//! which backends take part. The servers are pouchdb-server and dynalite from `node_modules` and
//! the Firestore emulator, started by the tests' launcher (`tests/common/servers.rs`;
//! `AGENTSTORE_TEST_COUCHDB_URL`, `AGENTSTORE_TEST_DYNAMODB_ENDPOINT` and
//! `AGENTSTORE_TEST_FIRESTORE_EMULATOR` point it at others). `BENCH_MIGRATE_BIN` names the
//! `agentstore` binary to run instead of the one cargo built (useful when several checkouts share
//! one target directory and another build may replace `target/release/agentstore` meanwhile).
//!
//! For each backend, on a fresh store: the **bulk write rate** (the data set through
//! `DocumentBackend::bulk_write` in batches of 500, 4 in flight, create-only like the migration's
//! writes) and the **bulk read rate** (one full `scan` in pages of 500, one page at a time, like
//! the migration's reader). Then for each ordered pair of distinct backends, the release
//! `agentstore migrate` binary copies the data set into a fresh target with the default options;
//! its JSON report gives docs/s (the copy alone), the rate of the read-back that ends it (its
//! `verification` section: documents compared per second) and the child's own peak RSS
//! (`VmHWM`). Then the release `agentstore verify` compares the two sides (both passes: source →
//! target, then target → source); its rate is documents compared over its duration. The ratio is
//! migration docs/s over min(source read rate, target write rate): the fraction of the slower
//! side's limit the migration reaches. Documents are the spec's shape with a ~300-byte value, over
//! 10 users × 10 namespaces.
//!
//! Results go to stdout as a markdown table and to `target/bench/migrate_bench.json`. Under
//! `cargo test --all-targets` (no `--bench` argument) it only prints how to run it.

use crate::servers;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use agentstore::backend::{self, BackendUrl, BulkWrite, DocumentBackend, Precondition};
use agentstore::model::id::encode_key;
use futures::{StreamExt, TryStreamExt};
use serde_json::{json, Map, Value};

const BUILT_BIN: &str = env!("CARGO_BIN_EXE_agentstore");

/// The `agentstore` binary the pairs run: `BENCH_MIGRATE_BIN`, else the one cargo built.
fn binary() -> String {
    std::env::var("BENCH_MIGRATE_BIN").unwrap_or_else(|_| BUILT_BIN.to_owned())
}
const BATCH: usize = 500;
const WRITERS: usize = 4;

pub fn main() -> ExitCode {
    // `cargo bench` passes `--bench`; `cargo test --all-targets` runs the bench binary without it.
    if !std::env::args().skip(1).any(|a| a == "--bench") {
        println!(
            "migrate_bench: run with `cargo bench --bench benches -- migrate_bench` (BENCH_MIGRATE_DOCS=N to size it)"
        );
        return ExitCode::SUCCESS;
    }
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("migrate_bench: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Where a backend of the bench lives.
struct Place {
    name: &'static str,
    server: String,
}

static STORES: AtomicUsize = AtomicUsize::new(0);

impl Place {
    /// The URL of a fresh, empty store on this backend.
    fn fresh_url(&self, dir: &Path, role: &str) -> Result<String, String> {
        let n = STORES.fetch_add(1, Ordering::Relaxed);
        let name = format!("bench_{role}_{}_{n}", std::process::id());
        Ok(match self.name {
            "embedded" => format!("embedded:{}", dir.join(format!("{name}.redb")).display()),
            "couchdb" => servers::couchdb()?.database_url(&name),
            "dynamodb" => servers::dynamodb()?.table_url(&name),
            "firestore" => servers::firestore()?.collection_url(&name),
            other => return Err(format!("unknown backend {other}")),
        })
    }
}

fn body(user: &str, namespace: &str, key: &str, i: usize) -> Map<String, Value> {
    let value = json!({
        "index": i,
        "text": format!("document {i} of the migration benchmark, with a few hundred bytes of payload ").repeat(3),
        "numbers": [i, i * 2, i * 3],
    });
    match json!({
        "userId": user, "namespace": namespace, "key": key, "value": value,
        "metadata": {"source": "migrate_bench"}, "createdByAgent": "bench", "accessCount": i % 10,
        "createdAt": "2026-02-05T10:00:00Z", "updatedAt": "2026-02-05T10:00:00Z"
    }) {
        Value::Object(map) => map,
        _ => Map::new(),
    }
}

fn writes(docs: usize) -> Vec<Vec<BulkWrite>> {
    let all: Vec<BulkWrite> = (0..docs)
        .map(|i| {
            let (user, namespace, key) = (format!("user{}", i % 10), format!("ns{}", (i / 10) % 10), format!("k{i}"));
            BulkWrite {
                id: format!("{user}:{namespace}:{}", encode_key(&key)),
                body: body(&user, &namespace, &key, i),
                precondition: Precondition::MustNotExist,
            }
        })
        .collect();
    all.chunks(BATCH).map(<[BulkWrite]>::to_vec).collect()
}

async fn open(url: &str) -> Result<Arc<dyn DocumentBackend>, String> {
    let parsed: BackendUrl = url.parse().map_err(|e| format!("{url}: {e}"))?;
    backend::open(&parsed).await.map_err(|e| format!("{url}: {e}"))
}

/// Writes the data set; returns docs/s.
async fn bulk_write_rate(backend: &Arc<dyn DocumentBackend>, docs: usize) -> Result<f64, String> {
    let batches = writes(docs);
    let started = Instant::now();
    let failures: usize = futures::stream::iter(batches)
        .map(|batch| {
            let backend = Arc::clone(backend);
            async move {
                let results = backend.bulk_write(batch).await.map_err(|e| e.to_string())?;
                Ok::<_, String>(results.iter().filter(|r| r.is_err()).count())
            }
        })
        .buffer_unordered(WRITERS)
        .try_fold(0, |sum, failed| async move { Ok(sum + failed) })
        .await?;
    if failures > 0 {
        return Err(format!("{failures} documents failed to write"));
    }
    Ok(docs as f64 / started.elapsed().as_secs_f64())
}

/// Scans everything; returns docs/s, checking the count.
async fn scan_rate(backend: &Arc<dyn DocumentBackend>, docs: usize) -> Result<f64, String> {
    let started = Instant::now();
    let mut token = None;
    let mut seen = 0;
    loop {
        let page = backend.scan(BATCH, token.as_deref()).await.map_err(|e| e.to_string())?;
        seen += page.items.len();
        match page.next {
            Some(next) => token = Some(next),
            None => break,
        }
    }
    if seen != docs {
        return Err(format!("scan saw {seen} of {docs} documents"));
    }
    Ok(docs as f64 / started.elapsed().as_secs_f64())
}

struct Side {
    name: &'static str,
    url: String,
    write_rate: f64,
    read_rate: f64,
}

struct PairResult {
    from: &'static str,
    to: &'static str,
    docs_per_sec: f64,
    /// The migration's own read-back, documents compared per second.
    read_back_per_sec: f64,
    /// `agentstore verify` (both passes), documents compared per second.
    verify_per_sec: f64,
    peak_rss_bytes: u64,
    limit: f64,
}

fn run() -> Result<(), String> {
    for (name, value) in [("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"), ("AWS_REGION", "us-east-1")]
    {
        if std::env::var_os(name).is_none() {
            std::env::set_var(name, value);
        }
    }
    let docs: usize = match std::env::var("BENCH_MIGRATE_DOCS") {
        Ok(text) => text.parse().map_err(|_| format!("BENCH_MIGRATE_DOCS={text} is not a number"))?,
        Err(_) => 100_000,
    };
    let names =
        std::env::var("BENCH_MIGRATE_BACKENDS").unwrap_or_else(|_| "embedded,couchdb,dynamodb,firestore".into());
    let mut places = Vec::new();
    for name in names.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let (name, server) = match name {
            "embedded" => ("embedded", "redb file on local disk".to_owned()),
            "couchdb" => (
                "couchdb",
                servers::couchdb().map(|s| format!("{} at {}", s.product, s.url.rsplit('@').next().unwrap_or("?")))?,
            ),
            "dynamodb" => ("dynamodb", servers::dynamodb().map(|s| format!("{} at {}", s.product, s.endpoint))?),
            "firestore" => ("firestore", servers::firestore().map(|s| format!("{} at {}", s.product, s.host_port))?),
            other => return Err(format!("BENCH_MIGRATE_BACKENDS names unknown backend {other:?}")),
        };
        places.push(Place { name, server });
    }
    let nproc = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    println!("migrate_bench: {docs} documents, nproc {nproc}, binary {}", binary());
    for place in &places {
        println!("  {:<9} {}", place.name, place.server);
    }
    let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
    let runtime = tokio::runtime::Runtime::new().map_err(|e| format!("tokio: {e}"))?;

    let mut sides = Vec::new();
    for place in &places {
        let url = place.fresh_url(dir.path(), "src")?;
        let (write_rate, read_rate) = runtime.block_on(async {
            let backend = open(&url).await?;
            let write_rate = bulk_write_rate(&backend, docs).await?;
            let read_rate = scan_rate(&backend, docs).await?;
            Ok::<_, String>((write_rate, read_rate))
        })?;
        // The backend is closed here, so an embedded file is free for the migration process.
        println!("  {:<9} bulk write {write_rate:>8.0} docs/s   full scan {read_rate:>8.0} docs/s", place.name);
        sides.push(Side { name: place.name, url, write_rate, read_rate });
    }

    let mut results = Vec::new();
    for source in &sides {
        for (target_place, target_side) in places.iter().zip(&sides) {
            if source.name == target_side.name {
                continue;
            }
            let to = target_place.fresh_url(dir.path(), "dst")?;
            let report = run_binary(dir.path(), "migrate", &source.url, &to)?;
            let docs_per_sec = report["docs_per_sec"].as_f64().unwrap_or(0.0);
            let written = report["counts"]["written"].as_u64().unwrap_or(0);
            if written != docs as u64 {
                return Err(format!("{} -> {}: wrote {written} of {docs}: {report}", source.name, target_side.name));
            }
            let read_back = &report["verification"];
            if read_back["passed"] != true || read_back["matching"] != docs {
                return Err(format!("{} -> {}: read-back {read_back}", source.name, target_side.name));
            }
            let read_back_per_sec = read_back["docs_per_sec"].as_f64().unwrap_or(0.0);
            let verdict = run_binary(dir.path(), "verify", &source.url, &to)?;
            if verdict["identical"] != true || verdict["matching"] != docs {
                return Err(format!("{} -> {}: verify {verdict}", source.name, target_side.name));
            }
            let verify_per_sec = docs as f64 / verdict["duration_secs"].as_f64().unwrap_or(f64::INFINITY);
            let limit = source.read_rate.min(target_side.write_rate);
            let peak_rss_bytes = report["peak_rss_bytes"].as_u64().unwrap_or(0);
            println!(
                "  {} -> {}: migrate {docs_per_sec:.0} docs/s, read-back {read_back_per_sec:.0} docs/s, \
                 verify {verify_per_sec:.0} docs/s, peak RSS {:.1} MiB",
                source.name,
                target_side.name,
                peak_rss_bytes as f64 / 1048576.0
            );
            results.push(PairResult {
                from: source.name,
                to: target_side.name,
                docs_per_sec,
                read_back_per_sec,
                verify_per_sec,
                peak_rss_bytes,
                limit,
            });
        }
    }

    println!();
    println!("| backend | bulk write docs/s | full scan docs/s |");
    println!("|---|---|---|");
    for side in &sides {
        println!("| {} | {:.0} | {:.0} |", side.name, side.write_rate, side.read_rate);
    }
    println!();
    println!(
        "| migration | migrate docs/s | read-back docs/s | verify docs/s | verify ÷ migrate | slower side's limit docs/s | fraction of limit | peak RSS MiB |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for r in &results {
        println!(
            "| {} → {} | {:.0} | {:.0} | {:.0} | {:.2} | {:.0} | {:.2} | {:.1} |",
            r.from,
            r.to,
            r.docs_per_sec,
            r.read_back_per_sec,
            r.verify_per_sec,
            r.verify_per_sec / r.docs_per_sec,
            r.limit,
            r.docs_per_sec / r.limit,
            r.peak_rss_bytes as f64 / 1048576.0
        );
    }
    let json = json!({
        "docs": docs,
        "backends": sides.iter().map(|s| json!({"name": s.name, "bulk_write_docs_per_sec": s.write_rate, "scan_docs_per_sec": s.read_rate})).collect::<Vec<_>>(),
        "migrations": results.iter().map(|r| json!({"from": r.from, "to": r.to, "docs_per_sec": r.docs_per_sec, "read_back_docs_per_sec": r.read_back_per_sec, "verify_docs_per_sec": r.verify_per_sec, "limit_docs_per_sec": r.limit, "fraction": r.docs_per_sec / r.limit, "peak_rss_bytes": r.peak_rss_bytes})).collect::<Vec<_>>(),
    });
    let out = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/bench");
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    std::fs::write(out.join("migrate_bench.json"), format!("{json:#}\n")).map_err(|e| format!("write results: {e}"))?;
    Ok(())
}

/// Runs the release binary's `migrate` (default options: it ends with its read-back) or `verify`
/// and returns its JSON report.
fn run_binary(dir: &Path, command: &str, from: &str, to: &str) -> Result<Value, String> {
    let bin = binary();
    let mut child = Command::new(&bin);
    child.current_dir(dir).args([command, "--from", from, "--to", to, "--progress", "none"]);
    if command == "migrate" {
        let checkpoint = dir.join(format!("cp-{}.json", STORES.fetch_add(1, Ordering::Relaxed)));
        child.arg("--checkpoint").arg(checkpoint);
    }
    let output = child.stdin(Stdio::null()).output().map_err(|e| format!("cannot run {bin}: {e}"))?;
    if !output.status.success() {
        return Err(format!("{command} {from} -> {to} failed: {}", String::from_utf8_lossy(&output.stderr)));
    }
    serde_json::from_slice(&output.stdout).map_err(|e| format!("{command} printed no JSON report: {e}"))
}
