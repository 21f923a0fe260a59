//! Standalone attachments over CouchDB's HTTP API (issue 25): `PUT /{db}/{doc}/{att}` and `GET`
//! of it, 1 MiB and 64 MiB, on agentstore over each backend and on pouchdb-server directly, in
//! one run and one table.
//!
//! Run it with `cargo bench --bench benches -- attachments_bench`. The targets, in this order
//! (`BENCH_TARGETS`, a comma-separated subset of the names in brackets):
//!
//! - `agentstore serve --couchdb-listen` (the release binary cargo built for the bench,
//!   `CARGO_BIN_EXE_agentstore`, no logins configured, so every request is admin), one process
//!   per target, over: the embedded store, a fresh redb file in a temporary directory
//!   [`embedded`]; DynamoDB, dynalite [`dynamodb`]; the Firestore emulator [`firestore`]; the
//!   CouchDB backend, pouchdb-server in memory [`couchdb`]. The servers behind the last three are
//!   the tests' (`tests/common/servers.rs`, which the `AGENTSTORE_TEST_*` variables redirect);
//! - pouchdb-server 4.2.0 directly, as a user would run it instead, a process of its own per
//!   target: over LevelDB (its default, files in a temporary directory) [`pouchdb-leveldb`] and
//!   `--in-memory` [`pouchdb-memory`].
//!
//! On each target, in a fresh database, one keep-alive connection for the sequential phases:
//!
//! 1. `BENCH_SMALL_COUNT` (default 32) sequential `PUT`s of `BENCH_SMALL_MIB` (default 1) MiB,
//!    each a new document (`PUT /{db}/{doc}/blob.bin`, no `rev`, `application/octet-stream`),
//!    then sequential `GET`s of them, `BENCH_GET_PASSES` (default 4) times over;
//! 2. the same with `BENCH_LARGE_COUNT` (default 4) attachments of `BENCH_LARGE_MIB` (default
//!    64) MiB;
//! 3. `BENCH_CLIENTS` (default 4) concurrent clients, each on its own connection, each doing
//!    `BENCH_ROUNDS` (default 8) `PUT`s of the small size, then the same clients `GET` them
//!    (`BENCH_GET_PASSES` times over).
//!
//! Every body is a slice of one buffer of pseudo-random (incompressible) bytes the bench holds
//! once; each request's slice starts one byte further, so no two attachments are the same bytes
//! (the store keeps identical bytes once per database: the same body again would measure a
//! deduplicated write). A `GET` streams the answer and discards it, counting its bytes: a wrong
//! length fails the target. After each size's `GET`s one more, untimed, compares the SHA-256 of
//! the bytes with the body sent. Throughput is MB/s (10^6 bytes per second) of attachment bytes
//! over the phase's wall time, from the first request sent to the last answer read.
//!
//! Memory: the server process's peak resident memory (`VmHWM` of `/proc/PID/status`), reset
//! before each phase (`5` written to `/proc/PID/clear_refs`), so each phase has its own peak and
//! the target's peak is the highest; its resident memory (`VmRSS`) once the database exists. For
//! the targets over a backend that is agentstore's process, not the backend server's.
//!
//! A failed request or check fails its target's remaining phases (shown as `failed`) and the
//! bench (exit 1); the other targets still run. One table goes to stdout, the JSON to
//! `target/bench/attachments_bench.json`. The goal (the embedded store at 3x the MB/s of a
//! real CouchDB 3.4.3 on the same machine) cannot be checked: no CouchDB runs on this machine.
//!
//! `cargo test --all-targets` also builds and runs the bench binary (without `--bench`); it then
//! only prints how to run it and exits 0.

use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::common;
use crate::common::targets::{load_average, mib, reset_peak, status_kib, Kind, Running};

use common::{bench_main, describe, run_suffix, write_report};

const NAME: &str = "attachments_bench";
const BIN: &str = env!("CARGO_BIN_EXE_agentstore");
const MIB: usize = 1 << 20;
/// The attachment name every document gets.
const ATTACHMENT: &str = "blob.bin";
/// Per-request timeout: a request that takes longer is an error.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(600);

// ---- settings ----

struct Config {
    /// `BENCH_SMALL_MIB` (default 1): the small attachment's size, MiB.
    small_bytes: usize,
    /// `BENCH_SMALL_COUNT` (default 32): sequential requests of the small size, each way.
    small_count: usize,
    /// `BENCH_LARGE_MIB` (default 64): the large attachment's size, MiB.
    large_bytes: usize,
    /// `BENCH_LARGE_COUNT` (default 4): sequential requests of the large size, each way.
    large_count: usize,
    /// `BENCH_CLIENTS` (default 4): concurrent clients of the last phase.
    clients: usize,
    /// `BENCH_ROUNDS` (default 8): small attachments each concurrent client puts, then gets.
    rounds: usize,
    /// `BENCH_GET_PASSES` (default 4): how many times each `GET` phase reads what its `PUT`
    /// phase wrote (reads are fast: one pass of 32 MiB is tens of milliseconds).
    get_passes: usize,
    /// `BENCH_TARGETS` (default all): what is measured, in [`Kind::ALL`] order.
    targets: Vec<Kind>,
}

impl Config {
    fn from_env() -> Result<Self, String> {
        let small_mib = common::env_number("BENCH_SMALL_MIB", 1usize)?;
        let large_mib = common::env_number("BENCH_LARGE_MIB", 64usize)?;
        let config = Config {
            small_bytes: small_mib.saturating_mul(MIB),
            small_count: common::env_number("BENCH_SMALL_COUNT", 32usize)?,
            large_bytes: large_mib.saturating_mul(MIB),
            large_count: common::env_number("BENCH_LARGE_COUNT", 4usize)?,
            clients: common::env_number("BENCH_CLIENTS", 4usize)?,
            rounds: common::env_number("BENCH_ROUNDS", 8usize)?,
            get_passes: common::env_number("BENCH_GET_PASSES", 4usize)?,
            targets: Kind::from_env()?,
        };
        for (name, value) in [
            ("BENCH_SMALL_MIB", small_mib),
            ("BENCH_LARGE_MIB", large_mib),
            ("BENCH_SMALL_COUNT", config.small_count),
            ("BENCH_LARGE_COUNT", config.large_count),
            ("BENCH_CLIENTS", config.clients),
            ("BENCH_ROUNDS", config.rounds),
            ("BENCH_GET_PASSES", config.get_passes),
        ] {
            if value == 0 {
                return Err(format!("{name} must be at least 1"));
            }
        }
        if small_mib > 1024 || large_mib > 1024 {
            return Err("BENCH_SMALL_MIB and BENCH_LARGE_MIB are at most 1024".into());
        }
        Ok(config)
    }

    /// Distinct small bodies: the sequential ones, then the concurrent clients'.
    fn small_bodies(&self) -> usize {
        self.small_count + self.clients * self.rounds
    }

    /// The phases, in the order they run.
    fn phases(&self) -> [PhaseSpec; 6] {
        let passes = |op| if op == Op::Get { self.get_passes } else { 1 };
        let small = |op, clients, count| PhaseSpec { op, size: Size::Small, clients, count, passes: passes(op) };
        let large = |op| PhaseSpec { op, size: Size::Large, clients: 1, count: self.large_count, passes: passes(op) };
        [
            small(Op::Put, 1, self.small_count),
            small(Op::Get, 1, self.small_count),
            large(Op::Put),
            large(Op::Get),
            small(Op::Put, self.clients, self.rounds),
            small(Op::Get, self.clients, self.rounds),
        ]
    }

    fn bytes(&self, size: Size) -> usize {
        match size {
            Size::Small => self.small_bytes,
            Size::Large => self.large_bytes,
        }
    }
}

// ---- targets: benches/common/targets.rs ----

impl Running {
    /// A JSON request without a body whose answer must be a 2xx `{"ok": true, ...}`.
    async fn expect_ok(&self, http: &reqwest::Client, method: reqwest::Method, path: &str) -> Result<Value, String> {
        let response = self
            .request(http, method.clone(), path)
            .header(reqwest::header::ACCEPT, "application/json")
            .send()
            .await
            .map_err(|e| format!("{method} {path}: {}", describe(&e)))?;
        ok_answer(&format!("{method} {path}"), response).await
    }
}

/// The parsed body of a 2xx answer with `"ok": true`, or what was wrong with it.
async fn ok_answer(what: &str, response: reqwest::Response) -> Result<Value, String> {
    let status = response.status();
    let bytes = response.bytes().await.map_err(|e| format!("{what}: reading the answer: {}", describe(&e)))?;
    let text = || String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned();
    if !status.is_success() {
        return Err(format!("{what}: status {status}: {}", text()));
    }
    let answer: Value = serde_json::from_slice(&bytes).map_err(|e| format!("{what}: not JSON ({e}): {}", text()))?;
    if answer["ok"].as_bool() != Some(true) {
        return Err(format!("{what}: answered {answer}"));
    }
    Ok(answer)
}

// ---- the bodies ----

/// The bytes every body is sliced from, held once.
struct Payload {
    small: Bytes,
    large: Bytes,
}

impl Payload {
    fn new(config: &Config) -> Payload {
        // Each body starts one byte after the previous one: a buffer that long holds them all.
        let large_bodies = config.large_count;
        Payload {
            small: pseudo_random(config.small_bytes + config.small_bodies(), 0x5eed_0001),
            large: pseudo_random(config.large_bytes + large_bodies, 0x5eed_0064),
        }
    }

    /// The `index`-th body of `size`.
    fn body(&self, config: &Config, size: Size, index: usize) -> Bytes {
        let (buffer, length) = match size {
            Size::Small => (&self.small, config.small_bytes),
            Size::Large => (&self.large, config.large_bytes),
        };
        buffer.slice(index..index + length)
    }
}

/// `length` bytes of xorshift64* output: incompressible, the same on every run.
fn pseudo_random(length: usize, seed: u64) -> Bytes {
    let mut state = seed;
    let mut bytes = Vec::with_capacity(length + 8);
    while bytes.len() < length {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        bytes.extend_from_slice(&state.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    bytes.truncate(length);
    Bytes::from(bytes)
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

// ---- phases ----

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Op {
    Put,
    Get,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Size {
    Small,
    Large,
}

/// One phase: `clients` clients each doing `count` requests of `op` on attachments of `size`,
/// `passes` times over.
#[derive(Clone, Copy, Debug)]
struct PhaseSpec {
    op: Op,
    size: Size,
    clients: usize,
    count: usize,
    passes: usize,
}

impl PhaseSpec {
    /// `PUT 1 MiB`, `GET 64 MiB`, `PUT 1 MiB, 4 clients`.
    fn label(&self, config: &Config) -> String {
        let op = match self.op {
            Op::Put => "PUT",
            Op::Get => "GET",
        };
        let mib = config.bytes(self.size) / MIB;
        match self.clients {
            1 => format!("{op} {mib} MiB"),
            n => format!("{op} {mib} MiB, {n} clients"),
        }
    }

    /// The document of the `round`-th request of `client`, and the body index it is written from.
    fn document(&self, config: &Config, client: usize, round: usize) -> (String, usize) {
        match (self.size, self.clients) {
            (Size::Large, _) => (format!("large-{round:04}"), round),
            (Size::Small, 1) => (format!("small-{round:04}"), round),
            (Size::Small, _) => {
                (format!("client{client:02}-{round:04}"), config.small_count + client * config.rounds + round)
            }
        }
    }
}

/// What one phase measured.
struct PhaseResult {
    spec: PhaseSpec,
    label: String,
    bytes: u64,
    elapsed: Duration,
    /// Every request's wall time.
    latencies: Vec<Duration>,
    /// The server's peak resident memory during the phase, KiB.
    peak_kib: Result<u64, String>,
}

impl PhaseResult {
    fn mb_per_s(&self) -> f64 {
        self.bytes as f64 / 1e6 / self.elapsed.as_secs_f64().max(f64::MIN_POSITIVE)
    }

    fn median_ms(&self) -> f64 {
        let mut sorted = self.latencies.clone();
        sorted.sort();
        sorted.get(sorted.len() / 2).map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
    }

    fn to_json(&self) -> Value {
        let ms: Vec<f64> = self.latencies.iter().map(|d| d.as_secs_f64() * 1e3).collect();
        json!({
            "phase": self.label,
            "clients": self.spec.clients,
            "requests": self.latencies.len(),
            "attachment_bytes": self.bytes,
            "elapsed_s": self.elapsed.as_secs_f64(),
            "mb_per_s": self.mb_per_s(),
            "median_request_ms": self.median_ms(),
            "max_request_ms": ms.iter().copied().fold(0.0f64, f64::max),
            "peak_rss_kib": self.peak_kib.as_ref().ok(),
            "peak_rss_not_measured": self.peak_kib.as_ref().err(),
        })
    }
}

/// A client with one keep-alive connection.
fn http_client() -> Result<reqwest::Client, String> {
    crate::common::phase::keep_alive_client(REQUEST_TIMEOUT)
}

/// `PUT /{db}/{doc}/blob.bin` of `body`, creating the document.
async fn put_attachment(
    target: &Running,
    http: &reqwest::Client,
    db: &str,
    doc: &str,
    body: Bytes,
) -> Result<(), String> {
    let path = format!("/{db}/{doc}/{ATTACHMENT}");
    let response = target
        .request(http, reqwest::Method::PUT, &path)
        .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
        .header(reqwest::header::ACCEPT, "application/json")
        .body(body)
        .send()
        .await
        .map_err(|e| format!("PUT {path}: {}", describe(&e)))?;
    let answer = ok_answer(&format!("PUT {path}"), response).await?;
    match answer["rev"].as_str() {
        Some(rev) if rev.starts_with("1-") => Ok(()),
        _ => Err(format!("PUT {path}: answered {answer}, not a first revision")),
    }
}

/// `GET /{db}/{doc}/blob.bin`, streamed; each piece goes to `piece` (counted, or hashed). Fails
/// unless the answer is a 200 of `expected` bytes.
async fn get_attachment(
    target: &Running,
    http: &reqwest::Client,
    db: &str,
    doc: &str,
    expected: usize,
    mut piece: impl FnMut(&[u8]),
) -> Result<(), String> {
    let path = format!("/{db}/{doc}/{ATTACHMENT}");
    let mut response = target
        .request(http, reqwest::Method::GET, &path)
        .send()
        .await
        .map_err(|e| format!("GET {path}: {}", describe(&e)))?;
    if response.status() != reqwest::StatusCode::OK {
        let status = response.status();
        let text = response.text().await.unwrap_or_default();
        return Err(format!("GET {path}: status {status}: {}", &text[..text.len().min(300)]));
    }
    let mut received = 0usize;
    while let Some(chunk) = response.chunk().await.map_err(|e| format!("GET {path}: reading: {}", describe(&e)))? {
        received += chunk.len();
        piece(&chunk);
    }
    if received != expected {
        return Err(format!("GET {path}: {received} bytes, not {expected}"));
    }
    Ok(())
}

/// Runs one phase; each client on a connection of its own, or `shared` for a single client. The
/// clients are futures of this task, not tasks: each mostly waits on its socket.
async fn run_phase(
    target: &Running,
    shared: &reqwest::Client,
    db: &str,
    config: &Config,
    payload: &Payload,
    spec: PhaseSpec,
) -> Result<PhaseResult, String> {
    let connections = match spec.clients {
        1 => vec![shared.clone()],
        n => (0..n).map(|_| http_client()).collect::<Result<Vec<_>, _>>()?,
    };
    let client = |client: usize, http: reqwest::Client| async move {
        let mut latencies = Vec::with_capacity(spec.count * spec.passes);
        for round in (0..spec.passes).flat_map(|_| 0..spec.count) {
            let (doc, index) = spec.document(config, client, round);
            let began = Instant::now();
            match spec.op {
                Op::Put => put_attachment(target, &http, db, &doc, payload.body(config, spec.size, index)).await?,
                Op::Get => get_attachment(target, &http, db, &doc, config.bytes(spec.size), |_| {}).await?,
            }
            latencies.push(began.elapsed());
        }
        Ok::<_, String>(latencies)
    };
    let measured = reset_peak(target.pid);
    let start = Instant::now();
    let outcomes =
        futures::future::join_all(connections.into_iter().enumerate().map(|(i, http)| client(i, http))).await;
    let elapsed = start.elapsed();
    let mut latencies = Vec::new();
    for outcome in outcomes {
        latencies.extend(outcome?);
    }
    let peak_kib = if measured {
        status_kib(target.pid, "VmHWM")
    } else {
        Err(format!("/proc/{}/clear_refs cannot be written: the peak is not this phase's", target.pid))
    };
    let bytes = (latencies.len() * config.bytes(spec.size)) as u64;
    Ok(PhaseResult { spec, label: spec.label(config), bytes, elapsed, latencies, peak_kib })
}

/// One more, untimed `GET` of the first attachment of `size`: its SHA-256 must be the body's.
async fn verify_bytes(
    target: &Running,
    http: &reqwest::Client,
    db: &str,
    config: &Config,
    payload: &Payload,
    size: Size,
) -> Result<String, String> {
    let spec = PhaseSpec { op: Op::Get, size, clients: 1, count: 1, passes: 1 };
    let (doc, index) = spec.document(config, 0, 0);
    let expected = sha256_hex(&payload.body(config, size, index));
    let mut hasher = Sha256::new();
    get_attachment(target, http, db, &doc, config.bytes(size), |piece| hasher.update(piece)).await?;
    let got: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    if got != expected {
        return Err(format!("GET /{db}/{doc}/{ATTACHMENT}: SHA-256 {got}, the body sent was {expected}"));
    }
    Ok(got)
}

// ---- one target ----

/// Everything measured on one target.
struct Measured {
    kind: Kind,
    label: String,
    /// `VmRSS` once the database exists and one tiny attachment went in and out, KiB.
    rss_at_start_kib: Option<u64>,
    phases: Vec<PhaseResult>,
    /// SHA-256s compared, per size.
    verified: Vec<String>,
    /// Why the target stopped early, if it did.
    error: Option<String>,
}

impl Measured {
    fn phase(&self, index: usize) -> Option<&PhaseResult> {
        self.phases.get(index)
    }

    fn peak_kib(&self) -> Option<u64> {
        self.phases.iter().filter_map(|p| p.peak_kib.as_ref().ok().copied()).max()
    }
}

async fn measure(target: &Running, kind: Kind, config: &Config, payload: &Payload) -> Measured {
    let mut measured = Measured {
        kind,
        label: target.label.clone(),
        rss_at_start_kib: None,
        phases: Vec::new(),
        verified: Vec::new(),
        error: None,
    };
    if let Err(e) = measure_phases(target, config, payload, &mut measured).await {
        println!("  FAILED: {e}");
        measured.error = Some(e);
    }
    measured
}

async fn measure_phases(
    target: &Running,
    config: &Config,
    payload: &Payload,
    measured: &mut Measured,
) -> Result<(), String> {
    let http = http_client()?;
    let db = format!("attachments_bench_{}", run_suffix());
    println!("{}: {}/{db}", target.label, target.root);
    target.expect_ok(&http, reqwest::Method::PUT, &format!("/{db}")).await?;
    // A first tiny attachment opens the database and the connection before any clock starts.
    put_attachment(target, &http, &db, "warmup", Bytes::from_static(b"warm")).await?;
    get_attachment(target, &http, &db, "warmup", 4, |_| {}).await?;
    measured.rss_at_start_kib = status_kib(target.pid, "VmRSS").ok();
    for spec in config.phases() {
        let phase = run_phase(target, &http, &db, config, payload, spec).await?;
        println!(
            "  {:<24} {:>8.1} MB/s  median {:>8.1} ms  peak RSS {}",
            phase.label,
            phase.mb_per_s(),
            phase.median_ms(),
            phase.peak_kib.as_ref().map_or_else(|e| e.clone(), |kib| format!("{:.1} MiB", *kib as f64 / 1024.0))
        );
        measured.phases.push(phase);
        if spec.op == Op::Get && spec.clients == 1 {
            let sha = verify_bytes(target, &http, &db, config, payload, spec.size).await?;
            println!("  {} bytes verified: sha256 {sha}", config.bytes(spec.size));
            measured.verified.push(sha);
        }
    }
    // Frees what the backend servers hold in memory before the next target runs.
    target.expect_ok(&http, reqwest::Method::DELETE, &format!("/{db}")).await?;
    Ok(())
}

// ---- reporting ----

/// A Markdown table (pasted as is into docs/attachments-bench.md).
fn markdown(header: &[String], rows: &[Vec<String>]) -> String {
    let line = |cells: &[String]| format!("| {} |\n", cells.join(" | "));
    let mut out = line(header);
    out.push_str(&line(&header.iter().map(|_| "---".to_owned()).collect::<Vec<_>>()));
    for row in rows {
        out.push_str(&line(row));
    }
    out
}

/// A cell of a phase: its value, `failed` for the phase that failed, `-` for the phases after it.
fn phase_cell(m: &Measured, index: usize, value: impl Fn(&PhaseResult) -> String) -> String {
    match m.phase(index) {
        Some(phase) => value(phase),
        None if index == m.phases.len() && m.error.is_some() => "failed".to_owned(),
        None => "-".to_owned(),
    }
}

fn tables(config: &Config, results: &[Measured]) -> String {
    let labels: Vec<String> = config.phases().iter().map(|p| p.label(config)).collect();
    let mut header = vec!["target".to_owned()];
    header.extend(labels.iter().map(|l| format!("{l} MB/s")));
    header.extend(["RSS at start MiB".to_owned(), "peak RSS MiB".to_owned()]);
    let mut rows: Vec<Vec<String>> = Vec::new();
    for m in results {
        let mut row = vec![m.label.clone()];
        row.extend((0..labels.len()).map(|i| phase_cell(m, i, |p| format!("{:.1}", p.mb_per_s()))));
        row.push(m.rss_at_start_kib.map_or("-".to_owned(), mib));
        row.push(m.peak_kib().map_or("-".to_owned(), mib));
        rows.push(row);
    }
    // The embedded store against what a user would run instead, on the same machine.
    let by_kind = |kind| results.iter().find(|m| m.kind == kind && m.error.is_none());
    if let (Some(ours), Some(theirs)) = (by_kind(Kind::Embedded), by_kind(Kind::PouchLevelDb)) {
        let mut row = vec![format!("ratio: {} / {}", ours.label, theirs.label)];
        row.extend(ours.phases.iter().zip(&theirs.phases).map(|(a, b)| format!("{:.2}", a.mb_per_s() / b.mb_per_s())));
        row.push("-".to_owned());
        row.push(match (ours.peak_kib(), theirs.peak_kib()) {
            (Some(a), Some(b)) if b > 0 => format!("{:.2}", a as f64 / b as f64),
            _ => "-".to_owned(),
        });
        rows.push(row);
    }
    let mut out = markdown(&header, &rows);
    let mut header = vec!["peak RSS MiB, per phase".to_owned()];
    header.extend(labels);
    let rows: Vec<Vec<String>> =
        results
            .iter()
            .map(|m| {
                let mut row = vec![m.label.clone()];
                row.extend((0..header.len() - 1).map(|i| {
                    phase_cell(m, i, |p| p.peak_kib.as_ref().map_or("not measured".to_owned(), |kib| mib(*kib)))
                }));
                row
            })
            .collect();
    out.push('\n');
    out.push_str(&markdown(&header, &rows));
    let mut header = vec!["median ms per request".to_owned()];
    header.extend(config.phases().iter().map(|p| p.label(config)));
    let rows: Vec<Vec<String>> = results
        .iter()
        .map(|m| {
            let mut row = vec![m.label.clone()];
            row.extend((0..header.len() - 1).map(|i| phase_cell(m, i, |p| format!("{:.1}", p.median_ms()))));
            row
        })
        .collect();
    out.push('\n');
    out.push_str(&markdown(&header, &rows));
    out
}

fn measured_json(m: &Measured) -> Value {
    json!({
        "target": m.kind.name(),
        "server": m.label,
        "rss_at_start_kib": m.rss_at_start_kib,
        "peak_rss_kib": m.peak_kib(),
        "phases": m.phases.iter().map(PhaseResult::to_json).collect::<Vec<_>>(),
        "sha256_verified": m.verified,
        "error": m.error,
    })
}

pub fn main() -> std::process::ExitCode {
    bench_main(NAME, run)
}

fn run() -> Result<bool, String> {
    let config = Config::from_env()?;
    let nproc = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let load_before = load_average();
    let targets: Vec<&str> = config.targets.iter().map(|k| k.name()).collect();
    println!(
        "{NAME}: nproc {nproc}, load average {load_before}; {} x {} MiB and {} x {} MiB sequential, {} clients x {} x \
         {} MiB concurrent; targets: {}",
        config.small_count,
        config.small_bytes / MIB,
        config.large_count,
        config.large_bytes / MIB,
        config.clients,
        config.rounds,
        config.small_bytes / MIB,
        targets.join(", ")
    );
    println!("binary: {BIN}");
    let payload = Payload::new(&config);
    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| format!("tokio runtime: {e}"))?;
    let mut results = Vec::new();
    let mut loads = vec![json!({ "before": load_before })];
    for &kind in &config.targets {
        let measured = match Running::start(kind, NAME) {
            Ok(target) => {
                let measured = runtime.block_on(measure(&target, kind, &config, &payload));
                if let Err(e) = target.stop() {
                    println!("  stopping it: {e}");
                }
                measured
            }
            Err(e) => {
                println!("{}: did not start: {e}", kind.name());
                Measured {
                    kind,
                    label: kind.name().to_owned(),
                    rss_at_start_kib: None,
                    phases: Vec::new(),
                    verified: Vec::new(),
                    error: Some(format!("did not start: {e}")),
                }
            }
        };
        let load = load_average();
        println!("  load average after it: {load}");
        loads.push(json!({ "after": kind.name(), "load_average": load }));
        results.push(measured);
    }
    drop(runtime);
    println!();
    print!("{}", tables(&config, &results));
    println!(
        "\n(MB/s: 10^6 attachment bytes per second over the phase's wall time; RSS: the server process, agentstore's \
         for the agentstore targets, peak = VmHWM reset before each phase; no real CouchDB 3.4.3 here, so the issue's \
         goal against it is not checked)"
    );
    let passed = results.iter().all(|m| m.error.is_none());
    for m in results.iter().filter(|m| m.error.is_some()) {
        eprintln!("{NAME}: {}: {}", m.label, m.error.as_deref().unwrap_or_default());
    }
    let report = json!({
        "benchmark": NAME,
        "nproc": nproc,
        "load_averages": loads,
        "small_bytes": config.small_bytes,
        "small_count": config.small_count,
        "large_bytes": config.large_bytes,
        "large_count": config.large_count,
        "concurrent_clients": config.clients,
        "concurrent_rounds": config.rounds,
        "passed": passed,
        "targets": results.iter().map(measured_json).collect::<Vec<_>>(),
    });
    write_report(NAME, &report)?;
    if !passed {
        eprintln!("{NAME}: FAILED");
    }
    Ok(passed)
}
