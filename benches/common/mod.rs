//! The harness the benches share (the adapter benches `couchdb_overhead`, `dynamodb_bench` and
//! `firestore_bench` use all of it), a module of the one bench binary (`benches/main.rs`):
//!
//! - this module: the `BENCH_*` settings, error formatting, the `--bench` guard, the JSON report;
//! - [`workload`]: the seeded documents, the values written, what one operation works on;
//! - [`facade`]: the facade side of every pair, and seeding;
//! - [`load`]: facade-vs-raw pairs measured as closed loops in ABBA-alternated segments;
//! - [`bulk`]: `bulk_write` throughput from concurrent callers;
//! - [`report`]: the stdout tables, the failure summary and the JSON report;
//! - [`serve`]: a spawned `agentstore serve` for the HTTP benches.
//! - [`phase`]: a timed phase of concurrent HTTP clients and its latencies.
//! - [`targets`]: the targets the HTTP benches measure side by side, pouchdb-server among them.
//!
//! A bench supplies its raw side by implementing [`load::Bench`] (and [`bulk::BulkBench`] for a
//! bulk phase) and keeps everything backend-specific (its raw calls, server, verification) to
//! itself.

pub mod bulk;
pub mod facade;
pub mod load;
pub mod phase;
pub mod report;
pub mod serve;
pub mod targets;
pub mod workload;

use std::path::PathBuf;
use std::process::ExitCode;

use serde_json::Value;

/// The knobs every adapter bench reads from the environment.
pub struct Config {
    /// `BENCH_CLIENTS` (default 8): concurrent closed-loop clients.
    pub clients: usize,
    /// `BENCH_SECONDS` (default 3): time budget of one side of one pair, over all its segments.
    pub seconds: f64,
    /// `BENCH_MAX_REQUESTS` (default 5,000): operation budget of one side of one pair.
    pub max_requests: u64,
    /// `BENCH_BULK_DOCS` (default 5,000): documents per bulk-write phase.
    pub bulk_docs: usize,
}

impl Config {
    /// Reads the knobs; `BENCH_BULK_DOCS` only when `bulk` (the bench has a bulk phase).
    pub fn from_env(bulk: bool) -> Result<Self, String> {
        let config = Config {
            clients: env_number("BENCH_CLIENTS", 8usize)?,
            seconds: env_number("BENCH_SECONDS", 3.0f64)?,
            max_requests: env_number("BENCH_MAX_REQUESTS", 5_000u64)?,
            bulk_docs: if bulk { env_number("BENCH_BULK_DOCS", 5_000usize)? } else { 0 },
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
        if bulk && config.bulk_docs == 0 {
            return Err("BENCH_BULK_DOCS must be at least 1".into());
        }
        Ok(config)
    }

    /// Prints the settings line every bench starts with; returns the number of CPUs.
    pub fn print(&self) -> usize {
        let nproc = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        println!(
            "nproc: {nproc}  clients: {}  per side and operation: {} s or {} ops, in {} segments alternating ABBA \
             BAAB (A = facade)",
            self.clients,
            self.seconds,
            self.max_requests,
            load::SEGMENTS_PER_SIDE
        );
        nproc
    }
}

/// A backend a bench runs over, as `BENCH_*_BACKENDS` lists name them.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Embedded,
    CouchDb,
    DynamoDb,
    Firestore,
}

impl Kind {
    pub const ALL: [Kind; 4] = [Kind::Embedded, Kind::CouchDb, Kind::DynamoDb, Kind::Firestore];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Embedded => "embedded",
            Kind::CouchDb => "couchdb",
            Kind::DynamoDb => "dynamodb",
            Kind::Firestore => "firestore",
        }
    }

    /// The backend `name` names; `setting` (the variable it came from) is named when it is none.
    pub fn parse(name: &str, setting: &str) -> Result<Kind, String> {
        Kind::ALL.into_iter().find(|k| k.name() == name).ok_or_else(|| {
            format!("{setting} names unknown backend {name:?} (known: embedded, couchdb, dynamodb, firestore)")
        })
    }
}

/// The number in the environment variable `name`, or `default` when it is unset or blank.
pub fn env_number<T: std::str::FromStr>(name: &str, default: T) -> Result<T, String> {
    match std::env::var(name) {
        Ok(text) if !text.trim().is_empty() => {
            text.trim().parse().map_err(|_| format!("{name}={text:?} is not a valid number"))
        }
        _ => Ok(default),
    }
}

/// An error and its sources, on one line.
pub fn describe(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// The runtime a bench's clients and servers run on: two workers, as the machine has two cores.
pub fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))
}

/// The bench's `main`: `cargo bench` passes `--bench`; `cargo test --all-targets` runs the target
/// without it, and then it only prints how to run it and exits 0. `run` returns `Ok(false)` when
/// any operation failed (exit 1); an `Err` is printed and exits 1 too.
pub fn bench_main(name: &str, run: fn() -> Result<bool, String>) -> ExitCode {
    if !std::env::args().skip(1).any(|a| a == "--bench") {
        println!("{name}: run with `cargo bench --bench benches -- {name}`");
        return ExitCode::SUCCESS;
    }
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(message) => {
            eprintln!("{name}: {message}");
            ExitCode::FAILURE
        }
    }
}

/// A suffix that makes a run's table, database or collection name fresh: pid and milliseconds.
pub fn run_suffix() -> String {
    format!(
        "{}_{}",
        std::process::id(),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0)
    )
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"))
}

/// Writes `report` to `target/bench/{name}.json` and says where.
pub fn write_report(name: &str, report: &Value) -> Result<(), String> {
    let out_dir = target_dir().join("bench");
    let path = out_dir.join(format!("{name}.json"));
    std::fs::create_dir_all(&out_dir).map_err(|e| format!("creating {}: {e}", out_dir.display()))?;
    let text = serde_json::to_string_pretty(report).map_err(|e| format!("encoding the report: {e}"))?;
    std::fs::write(&path, text + "\n").map_err(|e| format!("writing {}: {e}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}
