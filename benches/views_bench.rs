//! Design-document views and Mango json indexes over CouchDB's HTTP API (issue 26): the index
//! build of a JavaScript map view with a `_sum` reduce, query throughput under concurrent
//! clients, an incremental update, and a `_find` on a json index, on agentstore over each backend
//! and on pouchdb-server directly, in one run and one table.
//!
//! Run it with `cargo bench --bench benches -- views_bench`. The targets, in this order
//! (`BENCH_TARGETS`, a comma-separated subset of the names in brackets):
//!
//! - `agentstore serve --couchdb-listen` (the release binary cargo built for the bench, no logins
//!   configured, so every request is admin), one process per target, over: the embedded store, a
//!   fresh redb file in a temporary directory [`embedded`]; DynamoDB, dynalite [`dynamodb`]; the
//!   Firestore emulator [`firestore`]; the CouchDB backend, the tests' pouchdb-server in memory,
//!   to which agentstore forwards views and `_find` [`couchdb`]. The servers behind the last three
//!   are the tests' (`tests/common/servers.rs`, which the `AGENTSTORE_TEST_*` variables redirect);
//! - pouchdb-server 4.2.0 directly, a process of its own per target: over LevelDB (its default,
//!   files in a temporary directory) [`pouchdb-leveldb`] and `--in-memory` [`pouchdb-memory`];
//! - a real Apache CouchDB 3.4.3 at `BENCH_COUCHDB_URL` (`http://USER:PASSWORD@HOST:PORT`, every
//!   request with those credentials) [`apache-couchdb`], measured first: by default whenever that
//!   variable is set, and then a second table gives every other target's rates over CouchDB's in
//!   the same run (issue 38's view build goal, 5x, is the `build` column there). CouchDB builds
//!   the view with its own JavaScript engine (quickjs on this machine's build) and its own `_sum`.
//!
//! On each target, in a fresh database (not the data-store one):
//!
//! 1. **load**: `BENCH_DOCS` (default 100,000) documents `{"_id": "d000042", "type": "t2", "n": 42,
//!    "tag": "g42"}` (`type` one of 10, `tag` one of 100) by `POST /{db}/_bulk_docs` in batches of
//!    `BENCH_BATCH` (default 1,000), `BENCH_LOAD_CLIENTS` (default 4) batches in flight; timed on
//!    its own, every row's answer checked;
//! 2. **build**: `PUT /{db}/_design/bench` with the view `v`, map
//!    `function (doc) { emit(doc.type, doc.n); }` and reduce `_sum`, then the first
//!    `GET /{db}/_design/bench/_view/v?limit=1`, which builds the index: build docs/s is the
//!    document count over that request's wall time. Its answer, the reduced total, must be the sum
//!    of every `n`;
//! 3. **queries**: `BENCH_CLIENTS` (default 16) concurrent clients, each on a keep-alive
//!    connection of its own, for `BENCH_SECONDS` (default 10) each: (a) `key`: the map query
//!    `?key="t3"&limit=10&reduce=false` (`reduce=false` because the view has a reduce: without it
//!    CouchDB would answer the key's reduction), 10 rows; (b) `group`: `?group=true` over the whole
//!    view, the 10 types' sums; (c) `include_docs`: `?key="t7"&reduce=false&include_docs=true&limit=10`,
//!    10 rows with their documents. Every answer is parsed and its row count checked;
//! 4. **incremental**: `BENCH_EXTRA_DOCS` (default 1,000) more documents in one `_bulk_docs`, then
//!    `?update=true&limit=1` timed: its total must include them;
//! 5. **Mango**: `POST /{db}/_index` of a json index on `n` (a value field), the first `_find`
//!    `{"selector": {"n": {"$gte": X, "$lt": X + 10}}, "limit": 10}` timed (pouchdb-server builds
//!    its index then), then the same `_find` with varying `X` by the concurrent clients for
//!    `BENCH_SECONDS`, 10 documents each. A target that answers `_index` with 501 (agentstore's
//!    databases besides the data-store one, until issue 26's Mango indexes land) is shown as
//!    `not yet (501)`; that is not a failure.
//!
//! Memory: the server process's resident memory (`VmRSS` of `/proc/PID/status`) after the load,
//! and its peak (`VmHWM`) during the build, reset before it (`5` written to
//! `/proc/PID/clear_refs`). For the targets over a backend that is agentstore's process, not the
//! backend server's; not measured for the real CouchDB (a server this bench did not start).
//!
//! A failed request or check fails its target's remaining steps (shown as `failed`) and the bench
//! (exit 1); the other targets still run. One table goes to stdout, the JSON to
//! `target/bench/views_bench.json`. The targets run one after the other, not alternated (each
//! loads its own 100,000 documents): the load average is printed after each.
//!
//! `cargo test --all-targets` also builds and runs the bench binary (without `--bench`); it then
//! only prints how to run it and exits 0.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common;
use crate::common::phase::Latencies;
use crate::common::targets::{load_average, mib, real_couchdb_url, reset_peak, status_kib, Kind, Running};

use common::{bench_main, describe, run_suffix, write_report};

const NAME: &str = "views_bench";
const BIN: &str = env!("CARGO_BIN_EXE_agentstore");
/// Per-request timeout: an index build over a slow backend may take minutes.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(3600);
/// Distinct values of `type` (the view's key) and of `tag`.
const TYPES: usize = 10;
const TAGS: usize = 100;
/// Rows each query asks for, and each `_find` range's width.
const PAGE: usize = 10;
/// The design document and its view.
const DESIGN: &str = "_design/bench";
const VIEW: &str = "/_design/bench/_view/v";

// ---- settings ----

struct Config {
    /// `BENCH_DOCS` (default 100,000): documents loaded before the index is built.
    docs: usize,
    /// `BENCH_BATCH` (default 1,000): documents per `_bulk_docs`.
    batch: usize,
    /// `BENCH_LOAD_CLIENTS` (default 4): `_bulk_docs` requests in flight while loading.
    load_clients: usize,
    /// `BENCH_CLIENTS` (default 16): concurrent query clients.
    clients: usize,
    /// `BENCH_SECONDS` (default 10): how long each query phase runs.
    seconds: u64,
    /// `BENCH_EXTRA_DOCS` (default 1,000): documents written before the incremental update.
    extra_docs: usize,
    /// `BENCH_TARGETS` (default all): what is measured, in [`Kind::ALL`] order.
    targets: Vec<Kind>,
}

impl Config {
    fn from_env() -> Result<Self, String> {
        let config = Config {
            docs: common::env_number("BENCH_DOCS", 100_000usize)?,
            batch: common::env_number("BENCH_BATCH", 1_000usize)?,
            load_clients: common::env_number("BENCH_LOAD_CLIENTS", 4usize)?,
            clients: common::env_number("BENCH_CLIENTS", 16usize)?,
            seconds: common::env_number("BENCH_SECONDS", 10u64)?,
            extra_docs: common::env_number("BENCH_EXTRA_DOCS", 1_000usize)?,
            targets: targets_from_env()?,
        };
        for (name, value) in [
            ("BENCH_DOCS", config.docs),
            ("BENCH_BATCH", config.batch),
            ("BENCH_LOAD_CLIENTS", config.load_clients),
            ("BENCH_CLIENTS", config.clients),
            ("BENCH_SECONDS", config.seconds as usize),
            ("BENCH_EXTRA_DOCS", config.extra_docs),
        ] {
            if value == 0 {
                return Err(format!("{name} must be at least 1"));
            }
        }
        if config.docs < TYPES * PAGE {
            return Err(format!("BENCH_DOCS must be at least {} (each type needs {PAGE} rows)", TYPES * PAGE));
        }
        Ok(config)
    }
}

/// `BENCH_TARGETS`; by default every target, the real CouchDB at `BENCH_COUCHDB_URL` too when
/// that is set (every ratio is then to it).
fn targets_from_env() -> Result<Vec<Kind>, String> {
    let named = std::env::var("BENCH_TARGETS").is_ok_and(|names| !names.trim().is_empty());
    if !named && real_couchdb_url().is_some() {
        return Ok(Kind::ALL.to_vec());
    }
    Kind::from_env()
}

// ---- targets: benches/common/targets.rs ----

impl Running {
    /// Sends a request (with `body` as JSON, if any) and parses its answer: `Ok(Ok(json))` for a
    /// 2xx, `Ok(Err((status, text)))` for any other status, `Err` when no answer came.
    async fn call(
        &self,
        http: &reqwest::Client,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Result<Value, (u16, String)>, String> {
        let what = format!("{method} {path}");
        let mut request = self.request(http, method, path).header(reqwest::header::ACCEPT, "application/json");
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request.send().await.map_err(|e| format!("{what}: {}", describe(&e)))?;
        let status = response.status();
        let bytes = response.bytes().await.map_err(|e| format!("{what}: reading the answer: {}", describe(&e)))?;
        if !status.is_success() {
            let text = String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned();
            return Ok(Err((status.as_u16(), text)));
        }
        serde_json::from_slice(&bytes)
            .map(Ok)
            .map_err(|e| format!("{what}: not JSON ({e}): {}", String::from_utf8_lossy(&bytes[..bytes.len().min(300)])))
    }

    /// As [`Running::call`], any status but a 2xx being an error.
    async fn expect_success(
        &self,
        http: &reqwest::Client,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, String> {
        let what = format!("{method} {path}");
        self.call(http, method, path, body).await?.map_err(|(status, text)| format!("{what}: status {status}: {text}"))
    }
}

// ---- the documents ----

/// The `i`-th document: `type` and `tag` cycle, `n` is `i`.
fn document(i: usize) -> Value {
    json!({ "_id": format!("d{i:07}"), "type": format!("t{}", i % TYPES), "n": i, "tag": format!("g{}", i % TAGS) })
}

/// The sum of `n` over the first `count` documents: the view's reduced total.
fn total_of(count: usize) -> u64 {
    let count = count as u64;
    count * count.saturating_sub(1) / 2
}

/// A client with one keep-alive connection.
fn http_client() -> Result<reqwest::Client, String> {
    crate::common::phase::keep_alive_client(REQUEST_TIMEOUT)
}

/// `POST /{db}/_bulk_docs` of documents `from..to`; every row must be a new revision.
async fn bulk_docs(target: &Running, http: &reqwest::Client, db: &str, from: usize, to: usize) -> Result<(), String> {
    let docs: Vec<Value> = (from..to).map(document).collect();
    let path = format!("/{db}/_bulk_docs");
    let answer = target.expect_success(http, reqwest::Method::POST, &path, Some(&json!({ "docs": docs }))).await?;
    let rows = answer.as_array().ok_or_else(|| format!("POST {path}: answered {answer}, not an array"))?;
    if rows.len() != to - from {
        return Err(format!("POST {path}: {} rows for {} documents", rows.len(), to - from));
    }
    if let Some(bad) = rows.iter().find(|row| !row["rev"].as_str().is_some_and(|rev| rev.starts_with("1-"))) {
        return Err(format!("POST {path}: a row is {bad}, not a first revision"));
    }
    Ok(())
}

/// Loads documents `from..to`, `clients` batches in flight.
async fn load(
    target: &Running,
    db: &str,
    from: usize,
    to: usize,
    batch: usize,
    clients: usize,
) -> Result<Duration, String> {
    let connections = (0..clients).map(|_| http_client()).collect::<Result<Vec<_>, _>>()?;
    let batches: Vec<(usize, usize)> =
        (from..to).step_by(batch).map(|start| (start, (start + batch).min(to))).collect();
    let started = Instant::now();
    let outcomes = futures::future::join_all(connections.iter().enumerate().map(|(client, http)| {
        let mine: Vec<(usize, usize)> = batches.iter().copied().skip(client).step_by(clients).collect();
        async move {
            for (start, end) in mine {
                bulk_docs(target, http, db, start, end).await?;
            }
            Ok::<_, String>(())
        }
    }))
    .await;
    let elapsed = started.elapsed();
    outcomes.into_iter().collect::<Result<Vec<_>, _>>()?;
    Ok(elapsed)
}

/// The reduced total a `?limit=1` (reduce) view query answered.
fn reduced_total(answer: &Value) -> Option<u64> {
    let rows = answer["rows"].as_array()?;
    match rows.as_slice() {
        [] => Some(0),
        [row] => row["value"].as_f64().map(|v| v as u64),
        _ => None,
    }
}

// ---- the query phases ----

/// A query the concurrent clients repeat.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Query {
    /// `?key="t3"&limit=10&reduce=false`.
    Key,
    /// `?group=true`.
    Group,
    /// `?key="t7"&reduce=false&include_docs=true&limit=10`.
    IncludeDocs,
    /// `_find` of a range of `n` through the json index.
    Find,
}

impl Query {
    const VIEWS: [Query; 3] = [Query::Key, Query::Group, Query::IncludeDocs];

    fn label(self) -> &'static str {
        match self {
            Query::Key => "key",
            Query::Group => "group",
            Query::IncludeDocs => "include_docs",
            Query::Find => "_find",
        }
    }

    /// The request of the `round`-th call: method, path, body.
    fn request(self, db: &str, docs: usize, round: u64) -> (reqwest::Method, String, Option<Value>) {
        let view = |query: &str| (reqwest::Method::GET, format!("/{db}{VIEW}?{query}"), None);
        match self {
            Query::Key => view(&format!("key=%22t3%22&limit={PAGE}&reduce=false")),
            Query::Group => view("group=true"),
            Query::IncludeDocs => view(&format!("key=%22t7%22&reduce=false&include_docs=true&limit={PAGE}")),
            Query::Find => {
                // Ranges spread over the documents, each of PAGE values of `n`, all present.
                let from = (spread(round) % (docs - PAGE)) as u64;
                let body = json!({ "selector": { "n": { "$gte": from, "$lt": from + PAGE as u64 } }, "limit": PAGE });
                (reqwest::Method::POST, format!("/{db}/_find"), Some(body))
            }
        }
    }

    /// Whether `answer` is what this query must answer.
    fn check(self, answer: &Value) -> Result<(), String> {
        let (list, expected) = match self {
            Query::Find => ("docs", PAGE),
            Query::Group => ("rows", TYPES),
            Query::Key | Query::IncludeDocs => ("rows", PAGE),
        };
        let items = answer[list].as_array().ok_or_else(|| format!("no {list:?} in {answer}"))?;
        if items.len() != expected {
            return Err(format!("{} {list}, not {expected}", items.len()));
        }
        let wrong = match self {
            Query::Key => items.iter().find(|row| row["key"] != "t3"),
            Query::IncludeDocs => items.iter().find(|row| row["key"] != "t7" || row["doc"]["type"] != "t7"),
            Query::Group | Query::Find => None,
        };
        match wrong {
            Some(item) => Err(format!("a wrong item: {item}")),
            None => Ok(()),
        }
    }
}

/// A well-spread index for the `round`-th call (splitmix64).
fn spread(round: u64) -> usize {
    let mut z = round.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) as usize
}

/// What one query phase measured.
struct PhaseResult {
    query: Query,
    latencies: Latencies,
}

impl PhaseResult {
    /// `1,234 (2.1 / 9.8)`: queries/s (median / p99 ms); under 10 queries/s with a decimal.
    fn cell(&self) -> String {
        let per_s = self.latencies.per_s();
        let rate = if per_s < 10.0 { format!("{per_s:.1}") } else { thousands(per_s) };
        format!("{rate} ({:.1} / {:.1})", self.latencies.quantile_ms(0.5), self.latencies.quantile_ms(0.99))
    }

    fn to_json(&self) -> Value {
        let mut json = self.latencies.to_json();
        json["query"] = json!(self.query.label());
        json
    }
}

/// `config.clients` clients, each on a connection of its own, repeating `query` for
/// `config.seconds`.
async fn run_phase(target: &Running, db: &str, config: &Config, query: Query) -> Result<PhaseResult, String> {
    let connections = (0..config.clients).map(|_| http_client()).collect::<Result<Vec<_>, _>>()?;
    let docs = config.docs;
    let latencies = Latencies::measure(&connections, Duration::from_secs(config.seconds), |http, round| async move {
        let (method, path, body) = query.request(db, docs, round);
        let answer = target.expect_success(http, method.clone(), &path, body.as_ref()).await?;
        query.check(&answer).map_err(|e| format!("{method} {path}: {e}"))
    })
    .await?;
    Ok(PhaseResult { query, latencies })
}

// ---- one target ----

/// What the Mango step found.
enum Mango {
    /// `_index` answered 501: json indexes are not served on this database yet.
    NotYet(String),
    /// The index's first `_find`, then the concurrent phase.
    Measured { create: Duration, first_find: Duration, phase: PhaseResult },
}

/// Everything measured on one target.
struct Measured {
    kind: Kind,
    label: String,
    load: Option<Duration>,
    rss_after_load_kib: Option<u64>,
    build: Option<Duration>,
    build_peak_kib: Option<Result<u64, String>>,
    phases: Vec<PhaseResult>,
    incremental: Option<Duration>,
    mango: Option<Mango>,
    /// Why the target stopped early, if it did.
    error: Option<String>,
}

async fn measure(target: &Running, kind: Kind, config: &Config) -> Measured {
    let mut measured = Measured {
        kind,
        label: target.label.clone(),
        load: None,
        rss_after_load_kib: None,
        build: None,
        build_peak_kib: None,
        phases: Vec::new(),
        incremental: None,
        mango: None,
        error: None,
    };
    if let Err(e) = measure_steps(target, config, &mut measured).await {
        println!("  FAILED: {e}");
        measured.error = Some(e);
    }
    measured
}

async fn measure_steps(target: &Running, config: &Config, measured: &mut Measured) -> Result<(), String> {
    let http = http_client()?;
    // `BENCH_DB_PREFIX` (default none) names the database apart on a shared CouchDB.
    let prefix = std::env::var("BENCH_DB_PREFIX").unwrap_or_default();
    let db = format!("{prefix}views_bench_{}", run_suffix());
    println!("{}: {}/{db}", target.label, target.root);
    target.expect_success(&http, reqwest::Method::PUT, &format!("/{db}"), None).await?;

    let load_time = load(target, &db, 0, config.docs, config.batch, config.load_clients).await?;
    measured.load = Some(load_time);
    // A server this bench did not start (pid 0) has no memory here to read.
    let own_process = target.pid != 0;
    measured.rss_after_load_kib = own_process.then(|| status_kib(target.pid, "VmRSS").ok()).flatten();
    println!(
        "  load      {} docs in {:.1} s: {} docs/s",
        config.docs,
        load_time.as_secs_f64(),
        thousands(config.docs as f64 / load_time.as_secs_f64())
    );

    let design = json!({
        "language": "javascript",
        "views": { "v": { "map": "function (doc) { emit(doc.type, doc.n); }", "reduce": "_sum" } },
    });
    target.expect_success(&http, reqwest::Method::PUT, &format!("/{db}/{DESIGN}"), Some(&design)).await?;
    let path = format!("/{db}{VIEW}?limit=1");
    let peak_measured = own_process && reset_peak(target.pid);
    let started = Instant::now();
    let answer = target.expect_success(&http, reqwest::Method::GET, &path, None).await?;
    let build = started.elapsed();
    measured.build_peak_kib = Some(if peak_measured {
        status_kib(target.pid, "VmHWM")
    } else if own_process {
        Err(format!("/proc/{}/clear_refs cannot be written", target.pid))
    } else {
        Err("a server this bench did not start".to_owned())
    });
    let expected = total_of(config.docs);
    if reduced_total(&answer) != Some(expected) {
        return Err(format!("GET {path}: answered {answer}, the total is {expected}"));
    }
    measured.build = Some(build);
    println!(
        "  build     {:.1} s: {} docs/s, peak RSS {}",
        build.as_secs_f64(),
        thousands(config.docs as f64 / build.as_secs_f64()),
        measured
            .build_peak_kib
            .as_ref()
            .map_or("-".to_owned(), |peak| peak.as_ref().map_or_else(|e| e.clone(), |k| mib(*k)))
    );

    for query in Query::VIEWS {
        let phase = run_phase(target, &db, config, query).await?;
        println!("  {:<13} {} q/s (median / p99 ms)", query.label(), phase.cell());
        measured.phases.push(phase);
    }

    let total = config.docs + config.extra_docs;
    load(target, &db, config.docs, total, config.extra_docs, 1).await?;
    let path = format!("/{db}{VIEW}?update=true&limit=1");
    let started = Instant::now();
    let answer = target.expect_success(&http, reqwest::Method::GET, &path, None).await?;
    let incremental = started.elapsed();
    if reduced_total(&answer) != Some(total_of(total)) {
        return Err(format!("GET {path}: answered {answer}, the total is {}", total_of(total)));
    }
    measured.incremental = Some(incremental);
    println!("  +{} docs, update=true: {:.1} ms", config.extra_docs, incremental.as_secs_f64() * 1e3);

    let mango = measure_mango(target, &http, &db, config).await?;
    match &mango {
        Mango::NotYet(why) => println!("  _find     not yet: {why}"),
        Mango::Measured { create, first_find, phase } => println!(
            "  _find     index {:.1} ms, first _find {:.1} s, then {} q/s (median / p99 ms)",
            create.as_secs_f64() * 1e3,
            first_find.as_secs_f64(),
            phase.cell()
        ),
    }
    measured.mango = Some(mango);

    // Frees what the backend servers hold before the next target runs.
    target.expect_success(&http, reqwest::Method::DELETE, &format!("/{db}"), None).await?;
    Ok(())
}

async fn measure_mango(target: &Running, http: &reqwest::Client, db: &str, config: &Config) -> Result<Mango, String> {
    let path = format!("/{db}/_index");
    let index = json!({ "index": { "fields": ["n"] }, "name": "by-n", "type": "json" });
    let started = Instant::now();
    match target.call(http, reqwest::Method::POST, &path, Some(&index)).await? {
        Ok(_) => {}
        Err((501, text)) => return Ok(Mango::NotYet(format!("POST {path}: 501 {text}"))),
        Err((status, text)) => return Err(format!("POST {path}: status {status}: {text}")),
    }
    let create = started.elapsed();
    let total = config.docs + config.extra_docs;
    let (method, path, body) = Query::Find.request(db, total, 0);
    let started = Instant::now();
    let answer = target.expect_success(http, method.clone(), &path, body.as_ref()).await?;
    let first_find = started.elapsed();
    Query::Find.check(&answer).map_err(|e| format!("{method} {path}: {e}"))?;
    let phase = run_phase(target, db, config, Query::Find).await?;
    Ok(Mango::Measured { create, first_find, phase })
}

// ---- reporting ----

/// `12,345` (rounded).
fn thousands(value: f64) -> String {
    if !value.is_finite() {
        return "-".to_owned();
    }
    let digits = format!("{:.0}", value);
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A Markdown table (pasted as is into docs/views-bench.md).
fn markdown(header: &[&str], rows: &[Vec<String>]) -> String {
    let line = |cells: &[String]| format!("| {} |\n", cells.join(" | "));
    let header: Vec<String> = header.iter().map(|h| (*h).to_owned()).collect();
    let mut out = line(&header);
    out.push_str(&line(&header.iter().map(|_| "---".to_owned()).collect::<Vec<_>>()));
    for row in rows {
        out.push_str(&line(row));
    }
    out
}

fn table(config: &Config, results: &[Measured]) -> String {
    let header = [
        "target",
        "load docs/s",
        "RSS after load MiB",
        "build s",
        "build docs/s",
        "peak RSS build MiB",
        "key q/s (p50 / p99 ms)",
        "group q/s (p50 / p99 ms)",
        "include_docs q/s (p50 / p99 ms)",
        "+docs update=true ms",
        "_find index s",
        "_find q/s (p50 / p99 ms)",
    ];
    let mut rows = Vec::new();
    for m in results {
        // After the step that failed, `failed` once, then `-`.
        let mut failed_shown = m.error.is_none();
        let mut cell = |value: Option<String>| match value {
            Some(text) => text,
            None if !failed_shown => {
                failed_shown = true;
                "failed".to_owned()
            }
            None => "-".to_owned(),
        };
        let mut row = vec![m.label.clone()];
        row.push(cell(m.load.map(|d| thousands(config.docs as f64 / d.as_secs_f64()))));
        row.push(m.rss_after_load_kib.map_or("-".to_owned(), mib));
        row.push(cell(m.build.map(|d| format!("{:.1}", d.as_secs_f64()))));
        row.push(m.build.map_or("-".to_owned(), |d| thousands(config.docs as f64 / d.as_secs_f64())));
        row.push(match &m.build_peak_kib {
            Some(Ok(kib)) => mib(*kib),
            Some(Err(_)) => "not measured".to_owned(),
            None => "-".to_owned(),
        });
        for i in 0..Query::VIEWS.len() {
            row.push(cell(m.phases.get(i).map(PhaseResult::cell)));
        }
        row.push(cell(m.incremental.map(|d| format!("{:.1}", d.as_secs_f64() * 1e3))));
        match &m.mango {
            Some(Mango::NotYet(_)) => {
                row.push("not yet (501)".to_owned());
                row.push("not yet (501)".to_owned());
            }
            Some(Mango::Measured { create, first_find, phase }) => {
                // pouchdb-server builds a json index when it is created, CouchDB at the first
                // `_find`: the two together are the build, whichever does it.
                row.push(format!("{:.1}", (*create + *first_find).as_secs_f64()));
                row.push(phase.cell());
            }
            None => {
                row.push(cell(None));
                row.push(cell(None));
            }
        }
        rows.push(row);
    }
    markdown(&header, &rows)
}

/// Each agentstore target's rates over the real CouchDB's in this run (`2.50x`), with both p99s
/// for the query phases (`target / CouchDB` ms); `None` when the real CouchDB was not measured.
fn ratios_table(results: &[Measured]) -> Option<String> {
    let couchdb = results.iter().find(|m| m.kind == Kind::ApacheCouchDb && m.error.is_none())?;
    let ratio = |ours: Option<f64>, theirs: Option<f64>| match (ours, theirs) {
        (Some(ours), Some(theirs)) if theirs > 0.0 => format!("{:.2}x", ours / theirs),
        _ => "-".to_owned(),
    };
    let build_rate = |m: &Measured| m.build.map(|d| 1.0 / d.as_secs_f64());
    fn phase(m: &Measured, query: Query) -> Option<&Latencies> {
        m.phases.iter().find(|p| p.query == query).map(|p| &p.latencies)
    }
    fn find(m: &Measured) -> Option<&Latencies> {
        match &m.mango {
            Some(Mango::Measured { phase, .. }) => Some(&phase.latencies),
            _ => None,
        }
    }
    let header = [
        "target",
        "build (x CouchDB)",
        "key",
        "key p99 ms (ours / CouchDB)",
        "group",
        "group p99 ms (ours / CouchDB)",
        "include_docs",
        "+docs update=true (CouchDB ms / ours)",
        "_find",
    ];
    let mut rows = Vec::new();
    for m in results.iter().filter(|m| m.kind != Kind::ApacheCouchDb) {
        let mut row = vec![m.label.clone(), ratio(build_rate(m), build_rate(couchdb))];
        for query in Query::VIEWS {
            let (ours, theirs) = (phase(m, query), phase(couchdb, query));
            row.push(ratio(ours.map(Latencies::per_s), theirs.map(Latencies::per_s)));
            if query != Query::IncludeDocs {
                row.push(match (ours, theirs) {
                    (Some(ours), Some(theirs)) => {
                        format!("{:.1} / {:.1}", ours.quantile_ms(0.99), theirs.quantile_ms(0.99))
                    }
                    _ => "-".to_owned(),
                });
            }
        }
        let update_rate = |m: &Measured| m.incremental.map(|d| 1.0 / d.as_secs_f64());
        row.push(ratio(update_rate(m), update_rate(couchdb)));
        row.push(ratio(find(m).map(Latencies::per_s), find(couchdb).map(Latencies::per_s)));
        rows.push(row);
    }
    Some(format!("Ratios to {} in this run (rates; p99 side by side):\n{}", couchdb.label, markdown(&header, &rows)))
}

fn measured_json(config: &Config, m: &Measured) -> Value {
    let per_s = |d: Option<Duration>, count: usize| d.map(|d| count as f64 / d.as_secs_f64());
    let mango = match &m.mango {
        None => Value::Null,
        Some(Mango::NotYet(why)) => json!({ "not_yet": why }),
        Some(Mango::Measured { create, first_find, phase }) => json!({
            "create_index_s": create.as_secs_f64(),
            "first_find_s": first_find.as_secs_f64(),
            "phase": phase.to_json(),
        }),
    };
    json!({
        "target": m.kind.name(),
        "server": m.label,
        "load_s": m.load.map(|d| d.as_secs_f64()),
        "load_docs_per_s": per_s(m.load, config.docs),
        "rss_after_load_kib": m.rss_after_load_kib,
        "build_s": m.build.map(|d| d.as_secs_f64()),
        "build_docs_per_s": per_s(m.build, config.docs),
        "build_peak_rss_kib": m.build_peak_kib.as_ref().and_then(|p| p.as_ref().ok()),
        "queries": m.phases.iter().map(PhaseResult::to_json).collect::<Vec<_>>(),
        "incremental_update_s": m.incremental.map(|d| d.as_secs_f64()),
        "mango": mango,
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
        "{NAME}: nproc {nproc}, load average {load_before}; {} documents (_bulk_docs of {}, {} in flight), {} \
         clients x {} s per query, +{} documents; targets: {}",
        config.docs,
        config.batch,
        config.load_clients,
        config.clients,
        config.seconds,
        config.extra_docs,
        targets.join(", ")
    );
    println!("binary: {BIN}");
    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| format!("tokio runtime: {e}"))?;
    let mut results = Vec::new();
    let mut loads = vec![json!({ "before": load_before })];
    for &kind in &config.targets {
        let measured = match Running::start(kind, NAME) {
            Ok(target) => {
                let measured = runtime.block_on(measure(&target, kind, &config));
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
                    load: None,
                    rss_after_load_kib: None,
                    build: None,
                    build_peak_kib: None,
                    phases: Vec::new(),
                    incremental: None,
                    mango: None,
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
    print!("{}", table(&config, &results));
    if let Some(ratios) = ratios_table(&results) {
        println!();
        print!("{ratios}");
    }
    println!(
        "\n(build: the first view query after the design document, over {} documents; q/s: {} clients, {} s each; \
         RSS: the server process, agentstore's for the agentstore targets, not measured for a server this \
         bench did not start)",
        config.docs, config.clients, config.seconds
    );
    let passed = results.iter().all(|m| m.error.is_none());
    for m in results.iter().filter(|m| m.error.is_some()) {
        eprintln!("{NAME}: {}: {}", m.label, m.error.as_deref().unwrap_or_default());
    }
    let report = json!({
        "benchmark": NAME,
        "nproc": nproc,
        "load_averages": loads,
        "docs": config.docs,
        "batch": config.batch,
        "load_clients": config.load_clients,
        "clients": config.clients,
        "seconds": config.seconds,
        "extra_docs": config.extra_docs,
        "passed": passed,
        "targets": results.iter().map(|m| measured_json(&config, m)).collect::<Vec<_>>(),
    });
    write_report(NAME, &report)?;
    if !passed {
        eprintln!("{NAME}: FAILED");
    }
    Ok(passed)
}
