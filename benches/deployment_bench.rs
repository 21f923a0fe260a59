//! Moving a whole deployment (issue 27): `agentstore migrate --all-databases` from a
//! CouchDB-protocol server into each backend, and the same copy done by pouchdb-server's own
//! replicator (`POST /_replicate`), in one run.
//!
//! Run it with `cargo bench --bench benches -- deployment_bench`. The source is `BENCH_SOURCE`
//! (started as the other benches start their targets, `common/targets.rs`):
//! `pouchdb-memory` (the default: pouchdb-server 4.2.0 `--in-memory`), `embedded` (`agentstore
//! serve` over a fresh embedded store, no logins) or `apache-couchdb` (the real CouchDB at
//! `BENCH_COUCHDB_URL`, not started here; its databases are named `BENCH_DB_PREFIX`, default
//! `bench_`, followed by `dNN`, deleted before seeding and after the run). pouchdb-server serves a
//! move at about 5,800 documents/s here, below the Firestore emulator's raw bulk rate, so a move
//! into the emulator measured from it says what the source serves (issue 38); the move into the
//! embedded store (`embedded` in `BENCH_TARGETS`) is the same move into a target that binds
//! nothing, and the table gives each move's rate over it too (`÷ source`). The source holds
//! `BENCH_DATABASES` (default 20) databases of `BENCH_DOCS` (default 200,000) documents in all,
//! written with `new_edits: false`: `BENCH_CONFLICT_PERCENT` (default 5) % of them with two
//! leaves (a conflict), `BENCH_ATTACHMENT_PERCENT` (default 1) % with an attachment of
//! `BENCH_ATTACHMENT_BYTES` (default 4096) bytes of its own, the rest a ~150-byte body, plus one
//! design document per database. Then, in order:
//!
//! 1. for each target of `BENCH_TARGETS` (default `embedded,dynamodb,firestore`; the tests' local
//!    servers: a fresh redb file, dynalite, the Firestore emulator): the release binary's
//!    `migrate --all-databases --db 'bench_*'` (`BENCH_DB_PREFIX`) `--no-verify --progress none` into a fresh store,
//!    timed from start to exit; its report gives the documents and leaves copied and its peak
//!    RSS (`VmHWM`). Then `verify --all-databases` compares the two sides leaf for leaf (timed
//!    apart); any difference fails the bench. The target's **raw bulk rate** is measured in the
//!    same run, once before the move and once after it ([`raw_bulk_write`]: as many documents of
//!    the seed's plain shape through the backend's own `bulk_write`, 100 a call and 16 calls at
//!    once, `migrate`'s own batch and concurrency, into a fresh store), and the migration's
//!    docs/s is given over the faster of the two (issue 38's goal: at least 0.9 into DynamoDB
//!    and Firestore). The first raw run also warms the server: the Firestore emulator served the
//!    same move three times slower as the first thing it did after starting (session 21);
//! 2. with `BENCH_FILE` (default 1; 0 skips it): the same databases through a file
//!    (docs/migration.md, "Whole databases in a file"): `export --db 'bench_*'` from the source
//!    to an NDJSON file, then `import --all-databases` of it into a fresh embedded store, each
//!    timed from start to exit, then `verify --all-databases` between the source and that store
//!    (`BENCH_FILE_GZIP=1`: the file is `.ndjson.gz`, gzip-compressed);
//! 3. `replicator → pouchdb-server`: a second pouchdb-server `--in-memory` pulls every database
//!    from the source with `POST /_replicate` (`create_target: true`), 4 databases at once (as
//!    `migrate` copies 4 at once by default);
//! 4. `replicator → agentstore (embedded)`: the source pouchdb-server pushes every database with
//!    `POST /_replicate` into `agentstore serve --couchdb-listen` over a fresh embedded store (the
//!    standard alternative to `migrate`, docs/migration.md), 4 at once.
//!
//! `BENCH_PAGES_AT_ONCE=N` runs every `migrate` with `--pages-at-once N` (pages of a database
//! written at once; `migrate`'s default without it).
//!
//! `BENCH_REPLICATORS=0` leaves out steps 3 and 4 (pouchdb-server's replicator holds every
//! attachment whole, so the attachment-heavy variant below is run without it).
//!
//! **Attachment-heavy variant** (memory bound of `migrate`, docs/migration.md): attachments far
//! larger than the inline bound, many times more bytes in all than the peak RSS allowed, e.g.
//! `BENCH_TARGETS=embedded BENCH_REPLICATORS=0 BENCH_DATABASES=4 BENCH_DOCS=1000
//! BENCH_ATTACHMENT_PERCENT=10 BENCH_ATTACHMENT_BYTES=6000000`; the table's `att MiB` column is
//! the attachment bytes the copy moved, beside its peak RSS.
//!
//! Rates are documents (changed documents of the source feeds) per second of wall clock. One
//! table goes to stdout, the JSON to `target/bench/deployment_bench.json`. A failed copy, a
//! failed replication or a verification that differs fails the bench (exit 1).
//!
//! `cargo test --all-targets` also builds and runs the bench binary (without `--bench`); it then
//! only prints how to run it and exits 0.

use std::process::Command;
use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use futures::StreamExt;
use serde_json::{json, Value};

use crate::common;
use crate::common::targets::{Kind, Running};
use crate::servers;

use common::report::aligned;
use common::{bench_main, env_number, run_suffix, write_report};

const NAME: &str = "deployment_bench";
const BIN: &str = env!("CARGO_BIN_EXE_agentstore");
/// Documents per `_bulk_docs` while seeding.
const SEED_BATCH: usize = 1000;
/// Databases copied at once by the replicator runs (`migrate`'s default too).
const AT_ONCE: usize = 4;
/// Attachment bytes (before base64) per `_bulk_docs` while seeding, besides [`SEED_BATCH`].
const SEED_BATCH_ATTACHMENT_BYTES: usize = 16 << 20;

struct Config {
    databases: usize,
    docs: usize,
    conflict_percent: usize,
    attachment_percent: usize,
    attachment_bytes: usize,
    targets: Vec<String>,
    replicators: bool,
    file: bool,
    gzip: bool,
}

fn config() -> Result<Config, String> {
    let targets = std::env::var("BENCH_TARGETS").unwrap_or_else(|_| "embedded,dynamodb,firestore".into());
    Ok(Config {
        databases: env_number("BENCH_DATABASES", 20usize)?.max(1),
        docs: env_number("BENCH_DOCS", 200_000usize)?,
        conflict_percent: env_number("BENCH_CONFLICT_PERCENT", 5usize)?,
        attachment_percent: env_number("BENCH_ATTACHMENT_PERCENT", 1usize)?,
        attachment_bytes: env_number("BENCH_ATTACHMENT_BYTES", 4096usize)?.max(8),
        replicators: env_number("BENCH_REPLICATORS", 1usize)? != 0,
        targets: targets.split(',').map(|t| t.trim().to_owned()).filter(|t| !t.is_empty()).collect(),
        file: env_number("BENCH_FILE", 1usize)? != 0,
        gzip: env_number("BENCH_FILE_GZIP", 0usize)? != 0,
    })
}

pub fn main() -> std::process::ExitCode {
    bench_main(NAME, run)
}

fn run() -> Result<bool, String> {
    let config = config()?;
    let runtime = crate::common::runtime()?;
    runtime.block_on(measure(config))
}

/// A source database's name: `BENCH_DB_PREFIX` (default `bench_`) and its number.
fn db_name(n: usize) -> String {
    format!("{}d{n:02}", db_prefix())
}

/// The source databases' common prefix (`BENCH_DB_PREFIX`).
fn db_prefix() -> String {
    std::env::var("BENCH_DB_PREFIX").ok().filter(|p| !p.trim().is_empty()).unwrap_or_else(|| "bench_".to_owned())
}

/// The `--db` pattern selecting the source databases.
fn db_pattern() -> String {
    format!("{}*", db_prefix())
}

/// The source of `BENCH_SOURCE` (module doc).
fn source_kind() -> Result<Kind, String> {
    match std::env::var("BENCH_SOURCE").unwrap_or_default().trim() {
        "" | "pouchdb-memory" => Ok(Kind::PouchMemory),
        "embedded" => Ok(Kind::Embedded),
        "apache-couchdb" => Ok(Kind::ApacheCouchDb),
        other => Err(format!("BENCH_SOURCE={other:?}: pouchdb-memory, embedded or apache-couchdb")),
    }
}

/// Deletes the source databases this bench names, if there (a real CouchDB keeps them between
/// runs).
async fn drop_databases(http: &reqwest::Client, root: &str, databases: usize) -> Result<(), String> {
    for n in 0..databases {
        let db = db_name(n);
        let response = http.delete(format!("{root}/{db}")).send().await.map_err(|e| format!("DELETE {db}: {e}"))?;
        if !response.status().is_success() && response.status() != reqwest::StatusCode::NOT_FOUND {
            return Err(format!("DELETE {db}: {}", response.status()));
        }
    }
    Ok(())
}

/// `http://admin:password@HOST:PORT` of a pouchdb-server started by [`Running::start`].
fn with_login(running: &Running) -> String {
    match &running.login {
        Some((user, password)) => running.root.replacen("http://", &format!("http://{user}:{password}@"), 1),
        None => running.root.clone(),
    }
}

async fn post(http: &reqwest::Client, url: &str, body: &Value) -> Result<Value, String> {
    let response = http.post(url).json(body).send().await.map_err(|e| format!("POST {url}: {e}"))?;
    let status = response.status();
    let value: Value = response.json().await.map_err(|e| format!("POST {url}: {e}"))?;
    if !status.is_success() {
        return Err(format!("POST {url}: {status} {value}"));
    }
    Ok(value)
}

/// Seeds the source; the documents, leaves and attachments written.
async fn seed(http: &reqwest::Client, root: &str, config: &Config) -> Result<(usize, usize, usize), String> {
    let (mut docs, mut leaves, mut attachments) = (0, 0, 0);
    let per_db = config.docs.div_ceil(config.databases);
    for n in 0..config.databases {
        let db = db_name(n);
        let response = http.put(format!("{root}/{db}")).send().await.map_err(|e| format!("PUT {db}: {e}"))?;
        if !response.status().is_success() {
            return Err(format!("PUT {db}: {}", response.status()));
        }
        let mut batch_attachment_bytes = 0usize;
        let mut batch = vec![
            json!({"_id": "_design/app", "_rev": "1-d0", "views": {"by_n": {"map": "function (doc) { emit(doc.n, null); }"}}}),
        ];
        for i in 0..per_db.min(config.docs.saturating_sub(docs)) {
            let global = n * per_db + i;
            let id = format!("doc{i:07}");
            let mut doc = json!({"_id": id, "_rev": format!("1-{global:032x}"), "n": global, "kind": "bench",
                "text": "a body of about one hundred and fifty bytes, like a small record of an application", "tags": ["a", "b"]});
            if config.attachment_percent > 0 && global % (100 / config.attachment_percent.min(100)) == 7 {
                // Bytes of its own per document, with its number in them.
                let mut bytes: Vec<u8> = (global as u64).to_le_bytes().to_vec();
                bytes.extend((0..config.attachment_bytes - 8).map(|b| (b * 7 + global * 13) as u8));
                batch_attachment_bytes += bytes.len();
                doc["_attachments"] =
                    json!({"blob.bin": {"content_type": "application/octet-stream", "data": BASE64.encode(bytes)}});
                attachments += 1;
            }
            batch.push(doc);
            leaves += 1;
            if config.conflict_percent > 0 && global % (100 / config.conflict_percent.min(100)) == 3 {
                for branch in ["a", "b"] {
                    batch.push(json!({"_id": id, "_rev": format!("2-{branch}{global:031x}"),
                        "_revisions": {"start": 2, "ids": [format!("{branch}{global:031x}"), format!("{global:032x}")]},
                        "n": global, "branch": branch}));
                    leaves += 1;
                }
                leaves -= 1; // the first leaf is now the branches' parent
            }
            docs += 1;
            if batch.len() >= SEED_BATCH || batch_attachment_bytes >= SEED_BATCH_ATTACHMENT_BYTES {
                post(http, &format!("{root}/{db}/_bulk_docs"), &json!({"docs": batch, "new_edits": false})).await?;
                batch = Vec::new();
                batch_attachment_bytes = 0;
            }
        }
        if !batch.is_empty() {
            post(http, &format!("{root}/{db}/_bulk_docs"), &json!({"docs": batch, "new_edits": false})).await?;
        }
    }
    Ok((docs + config.databases, leaves + config.databases, attachments))
}

/// One measured copy.
struct Measured {
    label: String,
    seconds: f64,
    docs: u64,
    leaves: Option<u64>,
    /// Attachment bytes the copy moved, MiB (`migrate`'s report).
    attachment_mib: Option<f64>,
    peak_rss_mib: Option<f64>,
    verify_seconds: Option<f64>,
    /// A move's rate over its target's raw bulk rate in the same run.
    over_raw: Option<f64>,
    /// A move's rate over the move into the embedded store ([`over_the_source`]).
    over_source: Option<f64>,
    ok: bool,
    note: String,
}

impl Measured {
    fn rate(&self) -> f64 {
        self.docs as f64 / self.seconds.max(0.001)
    }
}

/// `--pages-at-once N` (pages of a database written at once) when `BENCH_PAGES_AT_ONCE` says
/// N; else `migrate`'s default.
fn pages_args() -> Vec<String> {
    match std::env::var("BENCH_PAGES_AT_ONCE").ok().filter(|n| !n.trim().is_empty()) {
        Some(n) => vec!["--pages-at-once".to_owned(), n.trim().to_owned()],
        None => Vec::new(),
    }
}

/// `migrate --all-databases` into `target`, then `verify`.
fn migrate_into(source: &str, target: &str, label: &str, dir: &std::path::Path) -> Result<Measured, String> {
    let started = Instant::now();
    let output = Command::new(BIN)
        .args(["migrate", "--from", source, "--to", target, "--all-databases", "--db", &db_pattern()])
        .args(["--no-verify", "--progress", "none", "--checkpoint"])
        .arg(dir.join(format!("cp-{label}")))
        .args(pages_args())
        .current_dir(dir)
        .output()
        .map_err(|e| format!("cannot run {BIN}: {e}"))?;
    let seconds = started.elapsed().as_secs_f64();
    let report: Value = serde_json::from_slice(&output.stdout).map_err(|e| {
        format!("migrate into {label} printed no report ({e}); stderr: {}", String::from_utf8_lossy(&output.stderr))
    })?;
    let mut ok = output.status.success() && report["status"] == "complete" && report["totals"]["failed"] == 0;
    let started = Instant::now();
    let verify = Command::new(BIN)
        .args(["verify", "--from", source, "--to", target, "--all-databases", "--db", &db_pattern()])
        .args(["--progress", "none"])
        .current_dir(dir)
        .output()
        .map_err(|e| format!("cannot run {BIN}: {e}"))?;
    let verify_seconds = started.elapsed().as_secs_f64();
    let verified: Value = serde_json::from_slice(&verify.stdout).unwrap_or(Value::Null);
    let passed = verify.status.success() && verified["passed"] == true;
    ok &= passed;
    Ok(Measured {
        label: format!("migrate → {label}"),
        seconds,
        docs: report["totals"]["docs_seen"].as_u64().unwrap_or(0),
        leaves: report["totals"]["leaves_written"].as_u64(),
        attachment_mib: report["totals"]["attachment_bytes"].as_f64().map(|b| b / 1048576.0),
        peak_rss_mib: report["peak_rss_bytes"].as_f64().map(|b| b / 1048576.0),
        verify_seconds: Some(verify_seconds),
        over_raw: None,
        over_source: None,
        ok,
        note: if passed {
            format!("verify: {} leaves equal", verified["leaves"])
        } else {
            format!("verify FAILED: {}", String::from_utf8_lossy(&verify.stdout).chars().take(400).collect::<String>())
        },
    })
}

/// Documents per `bulk_write` of the raw rate: what one `Database::write_many` call of
/// `migrate` writes (`DOCUMENTS_PER_WRITE` in `src/migrate/deployment/side.rs`).
const RAW_BATCH: usize = 100;
/// `bulk_write` calls in flight for the raw rate: `migrate`'s databases at once times its
/// `write_many` calls at once per database (`WRITES_AT_ONCE`).
const RAW_IN_FLIGHT: usize = AT_ONCE * 4;

/// The target's own bulk rate in the same run: `docs` new documents shaped as the seed's plain
/// ones, written straight through the backend's `bulk_write` (a DynamoDB `PutItem` per document,
/// 16 at a time; a Firestore batch write) into a fresh store, [`RAW_BATCH`] a call,
/// [`RAW_IN_FLIGHT`] calls at once: what a migration's writes into that backend could reach
/// without reading anything or keeping revision trees.
async fn raw_bulk_write(url: &str, kind: &str, docs: usize) -> Result<Measured, String> {
    use agentstore::backend::{self, BackendUrl, BulkWrite, Precondition};
    let parsed: BackendUrl = url.parse().map_err(|e| format!("{url}: {e}"))?;
    let store = backend::open(&parsed).await.map_err(|e| format!("{url}: {e}"))?;
    let writes: Vec<BulkWrite> = (0..docs)
        .map(|n| BulkWrite {
            id: format!("doc{n:07}"),
            body: match json!({"n": n, "kind": "bench",
                "text": "a body of about one hundred and fifty bytes, like a small record of an application",
                "tags": ["a", "b"]})
            {
                Value::Object(body) => body,
                _ => serde_json::Map::new(),
            },
            precondition: Precondition::MustNotExist,
        })
        .collect();
    let batches: Vec<Vec<BulkWrite>> = writes.chunks(RAW_BATCH).map(<[BulkWrite]>::to_vec).collect();
    let started = Instant::now();
    let failed: Vec<usize> = futures::stream::iter(batches)
        .map(|batch| {
            let store = std::sync::Arc::clone(&store);
            async move {
                let written = store.bulk_write(batch).await.map_err(|e| e.to_string())?;
                Ok::<usize, String>(written.iter().filter(|w| w.is_err()).count())
            }
        })
        .buffer_unordered(RAW_IN_FLIGHT)
        .collect::<Vec<Result<usize, String>>>()
        .await
        .into_iter()
        .collect::<Result<_, _>>()?;
    let seconds = started.elapsed().as_secs_f64();
    let failed: usize = failed.iter().sum();
    Ok(Measured {
        label: format!("raw bulk_write → {kind}"),
        seconds,
        docs: docs as u64,
        leaves: None,
        attachment_mib: None,
        peak_rss_mib: None,
        verify_seconds: None,
        over_raw: None,
        over_source: None,
        ok: failed == 0,
        note: format!("{RAW_BATCH} a call, {RAW_IN_FLIGHT} at once; {failed} failed"),
    })
}

/// [`raw_bulk_write`] into a fresh store of `kind`, labelled with `when` it ran.
async fn raw_rate(kind: &str, docs: usize, when: &str) -> Result<Measured, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let mut raw = raw_bulk_write(&target_url(kind, dir.path())?, kind, docs).await?;
    println!("{NAME}:   raw bulk_write into {kind}, {when}: {:.0} docs/s", raw.rate());
    raw.label = format!("{} ({when})", raw.label);
    Ok(raw)
}

/// Each move's rate over the move into the embedded store, when measured: that target writes
/// far faster than any source here serves, so its move runs at the source's serving rate, and a
/// move near it is bound by the source, not by its target.
fn over_the_source(results: &mut [Measured]) {
    let Some(serving) = results.iter().find(|m| m.label == "migrate → embedded").map(Measured::rate) else {
        return;
    };
    println!("{NAME}: the source serves a move at {serving:.0} docs/s (the move into the embedded store)");
    for measured in results.iter_mut().filter(|m| m.label.starts_with("migrate → ")) {
        measured.over_source = Some(measured.rate() / serving.max(0.001));
    }
}

/// Runs the release binary to its end; the seconds it took, its JSON report, and whether it
/// exited 0.
fn timed(args: &[&str], dir: &std::path::Path) -> Result<(f64, Value, bool), String> {
    let started = Instant::now();
    let output =
        Command::new(BIN).args(args).current_dir(dir).output().map_err(|e| format!("cannot run {BIN}: {e}"))?;
    let seconds = started.elapsed().as_secs_f64();
    let report: Value = serde_json::from_slice(&output.stdout).map_err(|e| {
        format!("{args:?} printed no report ({e}); stderr: {}", String::from_utf8_lossy(&output.stderr))
    })?;
    Ok((seconds, report, output.status.success()))
}

/// `export` of the source to a file, then `import` of it into a fresh embedded store, then
/// `verify` between the source and that store: two rows.
fn through_a_file(source: &str, dir: &std::path::Path, gzip: bool) -> Result<Vec<Measured>, String> {
    let file = dir.join(if gzip { "deployment.ndjson.gz" } else { "deployment.ndjson" });
    let file_text = file.display().to_string();
    let target = format!("embedded:{}", dir.join("imported.redb").display());
    let pattern = db_pattern();
    let export = ["export", "--from", source, "--db", &pattern, "--progress", "none", "--out", &file_text];
    let (seconds, report, success) = timed(&export, dir)?;
    let file_mib = report["file_bytes"].as_f64().unwrap_or(0.0) / 1048576.0;
    let exported = Measured {
        label: if gzip { "export → file (.gz)".into() } else { "export → file".into() },
        seconds,
        docs: report["documents"].as_u64().unwrap_or(0),
        leaves: report["leaves"].as_u64(),
        attachment_mib: None,
        peak_rss_mib: report["peak_rss_bytes"].as_f64().map(|b| b / 1048576.0),
        verify_seconds: None,
        over_raw: None,
        over_source: None,
        ok: success && report["status"] == "complete",
        note: format!("{file_mib:.0} MiB file"),
    };
    let import = ["import", "--to", &target, "--all-databases", "--progress", "none", "--in", &file_text];
    let (seconds, report, success) = timed(&import, dir)?;
    let mut ok = success && report["status"] == "complete" && report["totals"]["failed"] == 0;
    let verify =
        ["verify", "--from", source, "--to", &target, "--all-databases", "--db", &pattern, "--progress", "none"];
    let (verify_seconds, verified, verify_success) = timed(&verify, dir)?;
    let passed = verify_success && verified["passed"] == true;
    ok &= passed;
    let imported = Measured {
        label: "file → import (embedded)".into(),
        seconds,
        // The same documents as the export's: the import counts leaves, the rates compare documents.
        docs: exported.docs,
        leaves: report["totals"]["leaves_written"].as_u64(),
        attachment_mib: None,
        peak_rss_mib: report["peak_rss_bytes"].as_f64().map(|b| b / 1048576.0),
        verify_seconds: Some(verify_seconds),
        over_raw: None,
        over_source: None,
        ok,
        note: if passed {
            format!("verify: {} leaves equal", verified["leaves"])
        } else {
            format!("verify FAILED: {}", verified.to_string().chars().take(400).collect::<String>())
        },
    };
    Ok(vec![exported, imported])
}

/// The replicator of the server at `runner` copying every database from `source` to `target`
/// (URLs with credentials), `AT_ONCE` at a time.
async fn replicate(
    http: &reqwest::Client,
    runner: &str,
    source: &str,
    target: &str,
    databases: usize,
    label: &str,
    docs: u64,
) -> Measured {
    let started = Instant::now();
    let results: Vec<Result<Value, String>> = futures::stream::iter(0..databases)
        .map(|n| {
            let body = json!({"source": format!("{source}/{}", db_name(n)), "target": format!("{target}/{}", db_name(n)), "create_target": true});
            async move { post(http, &format!("{runner}/_replicate"), &body).await }
        })
        .buffer_unordered(AT_ONCE)
        .collect()
        .await;
    let seconds = started.elapsed().as_secs_f64();
    let failures: Vec<String> = results
        .iter()
        .filter_map(|r| match r {
            Err(e) => Some(e.clone()),
            Ok(v) if v["ok"] != true => Some(v.to_string()),
            Ok(_) => None,
        })
        .collect();
    let written: u64 =
        results.iter().filter_map(|r| r.as_ref().ok()).map(|v| v["docs_written"].as_u64().unwrap_or(0)).sum();
    Measured {
        label: label.to_owned(),
        seconds,
        docs,
        leaves: Some(written),
        attachment_mib: None,
        peak_rss_mib: None,
        verify_seconds: None,
        over_raw: None,
        over_source: None,
        ok: failures.is_empty(),
        note: if failures.is_empty() {
            format!("docs_written {written} (the replicator's count)")
        } else {
            format!("FAILED: {}", failures.join("; ").chars().take(400).collect::<String>())
        },
    }
}

/// Steps 2 and 3 (module doc): pouchdb-server's replicator into a second pouchdb-server, and
/// into `agentstore serve` over the embedded store.
async fn replicators(
    http: &reqwest::Client,
    source_url: &str,
    config: &Config,
    docs: u64,
    results: &mut Vec<Measured>,
) -> Result<(), String> {
    println!("{NAME}: pouchdb-server's replicator into a second pouchdb-server…");
    let second = Running::start(Kind::PouchMemory, NAME)?;
    let second_url = with_login(&second);
    let measured =
        replicate(http, &second_url, source_url, &second_url, config.databases, "replicator → pouchdb-server", docs)
            .await;
    println!("{NAME}:   {:.1}s, {:.0} docs/s, {}", measured.seconds, measured.rate(), measured.note);
    results.push(measured);
    second.stop()?;
    println!("{NAME}: pouchdb-server's replicator into agentstore serve (embedded)…");
    let agentstore = Running::start(Kind::Embedded, NAME)?;
    let agentstore_url = agentstore.root.clone();
    let measured = replicate(
        http,
        source_url,
        source_url,
        &agentstore_url,
        config.databases,
        "replicator → agentstore (embedded)",
        docs,
    )
    .await;
    println!("{NAME}:   {:.1}s, {:.0} docs/s, {}", measured.seconds, measured.rate(), measured.note);
    results.push(measured);
    agentstore.stop()?;
    Ok(())
}

fn target_url(kind: &str, dir: &std::path::Path) -> Result<String, String> {
    let name = format!("deploy_{}", run_suffix());
    match kind {
        "embedded" => Ok(format!("embedded:{}", dir.join("target.redb").display())),
        "dynamodb" => Ok(servers::dynamodb()?.table_url(&name)),
        "firestore" => Ok(servers::firestore()?.collection_url(&name)),
        other => Err(format!("BENCH_TARGETS: unknown target {other:?} (embedded, dynamodb, firestore)")),
    }
}

async fn measure(config: Config) -> Result<bool, String> {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(3600)).build().map_err(|e| e.to_string())?;
    let source = Running::start(source_kind()?, NAME)?;
    let source_url = with_login(&source);
    let external = matches!(source.process, common::targets::Process::External);
    if external {
        drop_databases(&http, &source_url, config.databases).await?;
    }
    println!(
        "{NAME}: seeding {} ({}) with {} databases, {} documents, {} % conflicts, {} % attachments of {} bytes",
        source.label,
        source.root,
        config.databases,
        config.docs,
        config.conflict_percent,
        config.attachment_percent,
        config.attachment_bytes
    );
    let started = Instant::now();
    let (docs, leaves, attachments) = seed(&http, &source_url, &config).await?;
    println!(
        "{NAME}: seeded {docs} documents ({leaves} leaves, {attachments} attachments) in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    let mut results = Vec::new();
    for kind in &config.targets {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let target = target_url(kind, dir.path())?;
        // The raw rate before the move warms the server up (an emulator's first seconds are
        // several times slower than its steady rate), and the one after it shows whether the
        // server's speed changed meanwhile; the move is compared with the faster of the two.
        let raw_before = raw_rate(kind, docs, "before the move").await?;
        println!("{NAME}: migrate into {kind}…");
        let mut measured = migrate_into(&source_url, &target, kind, dir.path())?;
        println!("{NAME}:   {:.1}s, {:.0} docs/s, {}", measured.seconds, measured.rate(), measured.note);
        let raw_after = raw_rate(kind, docs, "after the move").await?;
        let fastest = raw_before.rate().max(raw_after.rate());
        let ratio = measured.rate() / fastest.max(0.001);
        println!("{NAME}:   migrate ÷ raw (the faster of the two) = {ratio:.2}");
        measured.over_raw = Some(ratio);
        results.push(measured);
        results.push(raw_before);
        results.push(raw_after);
    }
    over_the_source(&mut results);
    if config.file {
        println!("{NAME}: export to a file, import into embedded…");
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        for measured in through_a_file(&source_url, dir.path(), config.gzip)? {
            println!(
                "{NAME}:   {}: {:.1}s, {:.0} docs/s, {}",
                measured.label,
                measured.seconds,
                measured.rate(),
                measured.note
            );
            results.push(measured);
        }
    }
    if config.replicators {
        replicators(&http, &source_url, &config, docs as u64, &mut results).await?;
    }
    if external {
        drop_databases(&http, &source_url, config.databases).await?;
    }
    let source_label = source.label.clone();
    source.stop()?;

    let rows: Vec<Vec<String>> = results
        .iter()
        .map(|m| {
            vec![
                m.label.clone(),
                format!("{:.1}", m.seconds),
                format!("{:.0}", m.rate()),
                m.leaves.map_or("-".into(), |l| l.to_string()),
                m.attachment_mib.map_or("-".into(), |b| format!("{b:.0}")),
                m.peak_rss_mib.map_or("-".into(), |r| format!("{r:.0}")),
                m.verify_seconds.map_or("-".into(), |s| format!("{s:.1}")),
                m.over_raw.map_or("-".into(), |r| format!("{r:.2}")),
                m.over_source.map_or("-".into(), |r| format!("{r:.2}")),
                if m.ok { "ok".into() } else { "FAILED".into() },
            ]
        })
        .collect();
    println!(
        "\n{}",
        aligned(
            &[
                "copy",
                "seconds",
                "docs/s",
                "leaves",
                "att MiB",
                "peak RSS MiB",
                "verify s",
                "÷ raw",
                "÷ source",
                "result"
            ],
            &rows,
            1
        )
    );
    let json_rows: Vec<Value> = results
        .iter()
        .map(|m| {
            json!({"copy": m.label, "seconds": m.seconds, "docs_per_second": m.rate(), "documents": m.docs,
                "leaves": m.leaves, "attachment_mib": m.attachment_mib, "peak_rss_mib": m.peak_rss_mib, "verify_seconds": m.verify_seconds,
                "over_raw": m.over_raw, "over_source": m.over_source, "ok": m.ok, "note": m.note})
        })
        .collect();
    write_report(
        NAME,
        &json!({"source": source_label, "databases": config.databases, "documents": docs, "leaves": leaves, "attachments": attachments,
            "conflict_percent": config.conflict_percent, "attachment_percent": config.attachment_percent,
            "attachment_bytes": config.attachment_bytes,
            "load_average": common::targets::load_average(), "results": json_rows}),
    )?;
    Ok(results.iter().all(|m| m.ok))
}
