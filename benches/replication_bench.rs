//! Replication of 100,000 documents both ways between a real Apache CouchDB 3.4.3 and agentstore
//! (issue 38), beside CouchDB replicating into itself, in one run: docs/s and the ratio of each
//! copy's rate to CouchDB's own.
//!
//! Run it with `BENCH_COUCHDB_URL=http://admin:password@127.0.0.1:15984 cargo bench --bench
//! benches -- replication_bench`; `BENCH_REPL_DOCS` (default 100,000) sets how many documents,
//! `BENCH_REPL_COPIES` (names, comma separated; by default all five below) which copies run.
//!
//! Untimed: a source database on the real CouchDB seeded with the documents by `_bulk_docs` of
//! [`SEED_BATCH`] (`{"_id": "r0000042", "n": 42, "kind": "bench", "text": …}`, about 150 bytes,
//! each one revision). Then, each timed from the request (or the command's start) to its end,
//! every copy into a database that does not exist yet (`create_target: true`):
//!
//! 1. `couchdb_to_couchdb`: CouchDB's replicator (`POST /_replicate` on the real CouchDB) into
//!    another database of the same CouchDB, the reference every ratio is to;
//! 2. `couchdb_to_embedded`: CouchDB's replicator pushing into `agentstore serve --couchdb-listen`
//!    over a fresh embedded store (one admin login, Basic credentials in the target URL);
//! 3. `couchdb_to_over_couchdb`: the same into agentstore's CouchDB backend in front of that same
//!    CouchDB (every request of the replicator passed on to it);
//! 4. `embedded_to_couchdb_replicate`: agentstore's replicator (`POST /_replicate` on the
//!    agentstore of copy 2) pushing the database copy 2 made back into the real CouchDB;
//! 5. `embedded_to_couchdb_migrate`: that agentstore stopped, `agentstore migrate --db NAME`
//!    (release binary, `--no-verify`) from its embedded store file into the real CouchDB.
//!
//! Copies 4 and 5 read the database copy 2 wrote, so they need it (they are skipped, and say so,
//! without it). Both replicators run with their default settings (CouchDB 3.4.3: 4 workers,
//! batches of 500, 20 connections). After each copy the target's `doc_count` must be the
//! source's; a copy that fails or counts otherwise fails the bench (exit 1). The load average
//! is printed beside each row. One table goes to stdout, the JSON to
//! `target/bench/replication_bench.json`. Every database this run made on the real CouchDB
//! (`replication_bench_{pid}_…`, agentstore's data-store database there included) is deleted
//! at the end, whatever failed.
//!
//! `cargo test --all-targets` also builds and runs the bench binary (without `--bench`); it then
//! only prints how to run it and exits 0.

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common;
use crate::common::report::aligned;
use crate::common::targets::{
    load_average, real_couchdb_url, Kind, Running, StartOptions, ADMIN_LOGIN, EMBEDDED_STORE_FILE,
};

use common::{bench_main, env_number, write_report};

const NAME: &str = "replication_bench";
const BIN: &str = env!("CARGO_BIN_EXE_agentstore");
/// Documents per seeding `_bulk_docs`.
const SEED_BATCH: usize = 1_000;
/// The longest one copy may take (a request to a replicator is answered when it is done).
const COPY_TIMEOUT: Duration = Duration::from_secs(3_600);

/// A copy the bench makes, in the order it runs them.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Copy {
    CouchDbToCouchDb,
    CouchDbToEmbedded,
    CouchDbToOverCouchDb,
    EmbeddedToCouchDbReplicate,
    EmbeddedToCouchDbMigrate,
}

impl Copy {
    const ALL: [Copy; 5] = [
        Copy::CouchDbToCouchDb,
        Copy::CouchDbToEmbedded,
        Copy::CouchDbToOverCouchDb,
        Copy::EmbeddedToCouchDbReplicate,
        Copy::EmbeddedToCouchDbMigrate,
    ];

    fn name(self) -> &'static str {
        match self {
            Copy::CouchDbToCouchDb => "couchdb_to_couchdb",
            Copy::CouchDbToEmbedded => "couchdb_to_embedded",
            Copy::CouchDbToOverCouchDb => "couchdb_to_over_couchdb",
            Copy::EmbeddedToCouchDbReplicate => "embedded_to_couchdb_replicate",
            Copy::EmbeddedToCouchDbMigrate => "embedded_to_couchdb_migrate",
        }
    }

    /// The table's words for it.
    fn label(self) -> &'static str {
        match self {
            Copy::CouchDbToCouchDb => "CouchDB → CouchDB (CouchDB's replicator; the reference)",
            Copy::CouchDbToEmbedded => "CouchDB → agentstore, embedded (CouchDB's replicator)",
            Copy::CouchDbToOverCouchDb => "CouchDB → agentstore over that CouchDB (CouchDB's replicator)",
            Copy::EmbeddedToCouchDbReplicate => "agentstore, embedded → CouchDB (agentstore's POST /_replicate)",
            Copy::EmbeddedToCouchDbMigrate => "agentstore, embedded → CouchDB (agentstore migrate --db)",
        }
    }
}

struct Config {
    docs: usize,
    copies: Vec<Copy>,
    couchdb: String,
}

fn config() -> Result<Config, String> {
    let couchdb = real_couchdb_url()
        .ok_or("every ratio is to a real CouchDB: set BENCH_COUCHDB_URL=http://USER:PASSWORD@HOST:PORT")?;
    let copies = match std::env::var("BENCH_REPL_COPIES") {
        Ok(names) if !names.trim().is_empty() => {
            let mut wanted = Vec::new();
            for name in names.split(',').map(str::trim) {
                let copy = Copy::ALL.into_iter().find(|c| c.name() == name).ok_or_else(|| {
                    let known: Vec<&str> = Copy::ALL.iter().map(|c| c.name()).collect();
                    format!("BENCH_REPL_COPIES names unknown copy {name:?} (known: {})", known.join(", "))
                })?;
                wanted.push(copy);
            }
            Copy::ALL.into_iter().filter(|c| wanted.contains(c)).collect()
        }
        _ => Copy::ALL.to_vec(),
    };
    let docs = env_number("BENCH_REPL_DOCS", 100_000usize)?;
    if docs == 0 {
        return Err("BENCH_REPL_DOCS must be at least 1".into());
    }
    Ok(Config { docs, copies, couchdb })
}

pub fn main() -> std::process::ExitCode {
    bench_main(NAME, run)
}

fn run() -> Result<bool, String> {
    let config = config()?;
    let runtime = crate::common::runtime()?;
    runtime.block_on(async {
        let http = reqwest::Client::builder().timeout(COPY_TIMEOUT).build().map_err(|e| e.to_string())?;
        let databases = Databases::of_this_run();
        let outcome = measure(&http, &config, &databases).await;
        // Whatever happened, the real CouchDB is left as it was found.
        let cleaned = clean_up(&http, &config.couchdb, &databases).await;
        let ok = outcome?;
        cleaned?;
        Ok(ok)
    })
}

/// The names of the databases of one run: every one starts with `replication_bench_{pid}_`, as
/// agentstore's data-store database on the real CouchDB does (`Running::start`'s table name), so
/// that one sweep deletes them all.
struct Databases {
    prefix: String,
}

impl Databases {
    fn of_this_run() -> Self {
        Databases { prefix: format!("{NAME}_{}_", std::process::id()) }
    }

    fn named(&self, what: &str) -> String {
        format!("{}{what}", self.prefix)
    }
}

/// One measured copy.
struct Measured {
    copy: Copy,
    seconds: f64,
    docs: usize,
    load_average: String,
    ok: bool,
    note: String,
}

impl Measured {
    fn rate(&self) -> f64 {
        self.docs as f64 / self.seconds.max(0.001)
    }
}

async fn measure(http: &reqwest::Client, config: &Config, databases: &Databases) -> Result<bool, String> {
    let couchdb = &config.couchdb;
    let source = databases.named("source");
    println!("{NAME}: seeding {}/{source} with {} documents…", root_of(couchdb), config.docs);
    let started = Instant::now();
    seed(http, &format!("{couchdb}/{source}"), config.docs).await?;
    println!("{NAME}: seeded in {:.1}s (load average {})", started.elapsed().as_secs_f64(), load_average());
    let source_url = format!("{couchdb}/{source}");
    let mut results = Vec::new();
    let wants = |copy: Copy| config.copies.contains(&copy);

    if wants(Copy::CouchDbToCouchDb) {
        let target = format!("{couchdb}/{}", databases.named("couchdb"));
        results.push(replicate(http, Copy::CouchDbToCouchDb, couchdb, &source_url, &target, config.docs).await);
    }
    // Copy 2's agentstore, kept for copies 4 and 5.
    let mut embedded: Option<(Running, String)> = None;
    if wants(Copy::CouchDbToEmbedded) {
        let running = Running::start_with(Kind::Embedded, NAME, StartOptions { basic_login: true })?;
        let target = format!("{}/{}", with_login(&running), databases.named("agentstore"));
        let measured = replicate(http, Copy::CouchDbToEmbedded, couchdb, &source_url, &target, config.docs).await;
        if measured.ok {
            embedded = Some((running, target));
        } else {
            running.stop()?;
        }
        results.push(measured);
    }
    if wants(Copy::CouchDbToOverCouchDb) {
        let running = Running::start_with(Kind::CouchDb, NAME, StartOptions { basic_login: true })?;
        let target = format!("{}/{}", with_login(&running), databases.named("over"));
        results.push(replicate(http, Copy::CouchDbToOverCouchDb, couchdb, &source_url, &target, config.docs).await);
        running.stop()?;
    }
    for copy in [Copy::EmbeddedToCouchDbReplicate, Copy::EmbeddedToCouchDbMigrate] {
        if wants(copy) && embedded.is_none() {
            println!("{NAME}: {} skipped: it copies what couchdb_to_embedded wrote, which did not run", copy.name());
        }
    }
    if let Some((running, agentstore_db)) = embedded {
        if wants(Copy::EmbeddedToCouchDbReplicate) {
            let runner = with_login(&running);
            let target = format!("{couchdb}/{}", databases.named("pushed"));
            let copy = Copy::EmbeddedToCouchDbReplicate;
            results.push(replicate(http, copy, &runner, &agentstore_db, &target, config.docs).await);
        }
        let dir = running.stop_keeping_dir()?.ok_or("the embedded target kept no directory")?;
        if wants(Copy::EmbeddedToCouchDbMigrate) {
            let store = format!("embedded:{}", dir.path().join(EMBEDDED_STORE_FILE).display());
            results
                .push(migrate(http, &store, couchdb, &databases.named("agentstore"), dir.path(), config.docs).await?);
        }
    }
    print_and_write(config, &results)?;
    Ok(results.iter().all(|m| m.ok))
}

/// A URL without its credentials, for messages.
fn root_of(url: &str) -> String {
    match (url.split_once("://"), url.split_once('@')) {
        (Some((scheme, _)), Some((_, rest))) => format!("{scheme}://{rest}"),
        _ => url.to_owned(),
    }
}

/// `http://admin:password@HOST:PORT` of an agentstore target started with its admin login.
fn with_login(running: &Running) -> String {
    let (user, password) = running.login.clone().unwrap_or((ADMIN_LOGIN.0.into(), ADMIN_LOGIN.1.into()));
    running.root.replacen("http://", &format!("http://{user}:{password}@"), 1)
}

/// A request whose answer must be a success with a JSON body.
async fn send_json(
    http: &reqwest::Client,
    method: reqwest::Method,
    url: &str,
    body: Option<&Value>,
) -> Result<Value, String> {
    let what = format!("{method} {}", root_of(url));
    let mut request = http.request(method, url);
    if let Some(body) = body {
        request = request.json(body);
    }
    let response = request.send().await.map_err(|e| format!("{what}: {}", common::describe(&e)))?;
    let status = response.status();
    let text = response.text().await.map_err(|e| format!("{what}: {e}"))?;
    if !status.is_success() {
        return Err(format!("{what}: {status} {}", text.chars().take(400).collect::<String>()));
    }
    serde_json::from_str(&text).map_err(|e| format!("{what}: the answer is not JSON ({e})"))
}

/// Creates the source database and writes `docs` documents into it.
async fn seed(http: &reqwest::Client, db_url: &str, docs: usize) -> Result<(), String> {
    send_json(http, reqwest::Method::PUT, db_url, None).await?;
    let bulk = format!("{db_url}/_bulk_docs");
    for first in (0..docs).step_by(SEED_BATCH) {
        let batch: Vec<Value> = (first..docs.min(first + SEED_BATCH))
            .map(|n| {
                json!({"_id": format!("r{n:07}"), "n": n, "kind": "bench",
                    "text": "a body of about one hundred and fifty bytes, like a small record of an application"})
            })
            .collect();
        let written = send_json(http, reqwest::Method::POST, &bulk, Some(&json!({ "docs": batch }))).await?;
        let refused = written.as_array().into_iter().flatten().filter(|row| row.get("error").is_some()).count();
        if refused > 0 {
            return Err(format!("seeding: {refused} documents refused"));
        }
    }
    Ok(())
}

/// The replicator of the server at `runner` (a root URL with credentials) copying `source` to
/// `target` (database URLs with credentials, the target created), timed; then the target's
/// `doc_count` checked.
async fn replicate(
    http: &reqwest::Client,
    copy: Copy,
    runner: &str,
    source: &str,
    target: &str,
    docs: usize,
) -> Measured {
    println!("{NAME}: {}…", copy.label());
    let load_average = load_average();
    let started = Instant::now();
    let body = json!({"source": source, "target": target, "create_target": true});
    let answer = send_json(http, reqwest::Method::POST, &format!("{runner}/_replicate"), Some(&body)).await;
    let seconds = started.elapsed().as_secs_f64();
    let (ok, note) = match answer {
        Err(err) => (false, format!("FAILED: {err}")),
        Ok(answer) if answer["ok"] != true => (false, format!("FAILED: {answer}")),
        Ok(answer) => {
            let written = answer["history"][0]["docs_written"].as_u64().or_else(|| answer["docs_written"].as_u64());
            let written = written.map_or("?".to_owned(), |n| n.to_string());
            match counted(http, target, docs).await {
                Ok(()) => (true, format!("docs_written {written} (the replicator's count)")),
                Err(err) => (false, format!("FAILED: {err}")),
            }
        }
    };
    let measured = Measured { copy, seconds, docs, load_average, ok, note };
    println!("{NAME}:   {:.1}s, {:.0} docs/s, {}", measured.seconds, measured.rate(), measured.note);
    measured
}

/// The target database holds `docs` documents.
async fn counted(http: &reqwest::Client, db_url: &str, docs: usize) -> Result<(), String> {
    let info = send_json(http, reqwest::Method::GET, db_url, None).await?;
    match info["doc_count"].as_u64() {
        Some(count) if count == docs as u64 => Ok(()),
        other => Err(format!("the target counts {other:?} documents, the source {docs}")),
    }
}

/// `agentstore migrate --db NAME` from the embedded store `store` into the CouchDB at `couchdb`
/// (the same database name there), timed from the command's start to its exit.
async fn migrate(
    http: &reqwest::Client,
    store: &str,
    couchdb: &str,
    db: &str,
    dir: &std::path::Path,
    docs: usize,
) -> Result<Measured, String> {
    let copy = Copy::EmbeddedToCouchDbMigrate;
    println!("{NAME}: {}…", copy.label());
    let load_average = load_average();
    let started = Instant::now();
    let output = Command::new(BIN)
        .args(["migrate", "--from", store, "--to", couchdb, "--db", db, "--no-verify", "--progress", "none"])
        .arg("--checkpoint")
        .arg(dir.join("migrate-checkpoint"))
        .current_dir(dir)
        .output()
        .map_err(|e| format!("cannot run {BIN}: {e}"))?;
    let seconds = started.elapsed().as_secs_f64();
    let report: Value = serde_json::from_slice(&output.stdout).unwrap_or(Value::Null);
    let complete = output.status.success() && report["status"] == "complete" && report["totals"]["failed"] == 0;
    let (ok, note) = if !complete {
        let stderr = String::from_utf8_lossy(&output.stderr);
        (false, format!("FAILED: {} {}", report, stderr.chars().take(400).collect::<String>()))
    } else {
        match counted(http, &format!("{couchdb}/{db}"), docs).await {
            Ok(()) => {
                let rss = report["peak_rss_bytes"].as_f64().map_or("?".to_owned(), |b| format!("{:.0}", b / 1048576.0));
                (true, format!("leaves_written {}, peak RSS {rss} MiB", report["totals"]["leaves_written"]))
            }
            Err(err) => (false, format!("FAILED: {err}")),
        }
    };
    let measured = Measured { copy, seconds, docs, load_average, ok, note };
    println!("{NAME}:   {:.1}s, {:.0} docs/s, {}", measured.seconds, measured.rate(), measured.note);
    Ok(measured)
}

/// The table (with each copy's ratio to CouchDB's own replication) and the JSON report.
fn print_and_write(config: &Config, results: &[Measured]) -> Result<(), String> {
    let reference = results.iter().find(|m| m.copy == Copy::CouchDbToCouchDb && m.ok).map(Measured::rate);
    let ratio = |m: &Measured| reference.filter(|_| m.ok).map(|r| m.rate() / r);
    let rows: Vec<Vec<String>> = results
        .iter()
        .map(|m| {
            vec![
                m.copy.label().to_owned(),
                m.load_average.clone(),
                format!("{:.1}", m.seconds),
                format!("{:.0}", m.rate()),
                ratio(m).map_or("-".into(), |r| format!("{r:.2}×")),
                if m.ok { "ok".into() } else { "FAILED".into() },
            ]
        })
        .collect();
    println!(
        "\n{} documents\n{}",
        config.docs,
        aligned(&["copy", "load avg", "seconds", "docs/s", "× CouchDB → CouchDB", "result"], &rows, 1)
    );
    let json_rows: Vec<Value> = results
        .iter()
        .map(|m| {
            json!({"copy": m.copy.name(), "label": m.copy.label(), "load_average": m.load_average,
                "seconds": m.seconds, "docs_per_second": m.rate(), "ratio_to_couchdb": ratio(m), "ok": m.ok,
                "note": m.note})
        })
        .collect();
    write_report(NAME, &json!({"documents": config.docs, "results": json_rows}))
}

/// Deletes every database of this run on the real CouchDB ([`Databases`]).
async fn clean_up(http: &reqwest::Client, couchdb: &str, databases: &Databases) -> Result<(), String> {
    let all = send_json(http, reqwest::Method::GET, &format!("{couchdb}/_all_dbs"), None).await?;
    let mine =
        all.as_array().into_iter().flatten().filter_map(Value::as_str).filter(|n| n.starts_with(&databases.prefix));
    for name in mine {
        send_json(http, reqwest::Method::DELETE, &format!("{couchdb}/{name}"), None).await?;
    }
    Ok(())
}
