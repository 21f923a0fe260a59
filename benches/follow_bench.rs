//! Live migration under load: how far behind the source a following migration runs, and how fast
//! it drains a backlog, for each ordered pair of backends, in one process through the library (so
//! an embedded source, whose file its process locks, can be followed while it is written).
//!
//! Run it with `cargo bench --bench follow_bench`. Settings (environment):
//! - `BENCH_FOLLOW_BACKENDS` (default `embedded,couchdb,dynamodb,firestore`): the backends; every
//!   ordered pair of two of them is measured, and embedded → embedded (a pair of one server
//!   backend with itself would only measure that server twice over);
//! - `BENCH_FOLLOW_RATES` (default `200,2000`): the offered write rates at the source, writes/s;
//! - `BENCH_FOLLOW_DOCS` (default 10,000): documents seeded into each fresh source;
//! - `BENCH_FOLLOW_SECS` (default 20): how long the writers write at each rate;
//! - `BENCH_FOLLOW_BACKLOG` (default 20,000): changed documents the throughput run drains;
//! - `BENCH_FOLLOW_DRAIN_SECS` (default 60): how long, after the writers stop, the follower may
//!   take to show the last marker before the pair is reported as not keeping up;
//! - `BENCH_FOLLOW_FLOOR_SECS` (default 3): length of the probe-floor run (below).
//!
//! The servers are the tests' (`tests/common/servers.rs`): pouchdb-server and dynalite from
//! `node_modules`, the Firestore emulator. DynamoDB stores get `settle_ms=1000&write_timeout_ms=500`
//! and Firestore collections `settle_ms=1000`: their change feeds show a write only once its settle
//! window has passed, so that window is part of every lag measured from them.
//!
//! **Lag.** For each pair and rate, on a fresh source seeded with the data set (~300-byte values
//! over 10 users × 10 namespaces) and a fresh target, a follower (`migrate::run_until`,
//! `FollowMode::Forever`) copies the source; once the target holds every document and a first
//! marker update has come through the follow phase, writers update existing documents through
//! `DataStore::set` at the offered rate (1 in 20 writes creates a document, 1 in 20 deletes one
//! created earlier), at most 64 writes in flight. Every 100 ms a marker document is updated with
//! a sequence number; a probe reads the marker at the target every 5 ms. A marker's lag is the
//! time from its write's acknowledgement at the source to the end of the first target read that
//! shows it or a later marker. Reported: median, p90 and worst over the markers, the write rate
//! achieved, and whether the follower kept up (every marker reached the target within the drain
//! limit, and the lag of the last quarter of markers is not growing away from the first's).
//!
//! **Probe floor.** The same writers and probe, with the probe reading the source itself: the lag
//! this measures is the method's own resolution (poll interval, read latency) on that backend.
//!
//! **Follow throughput.** After the last rate's run, the follower is stopped; the source gets the
//! backlog as fast as it takes it (`bulk_write`, batches of 500, 4 in flight: distinct existing
//! documents updated, then fresh ones created), and `migrate::run` with
//! `FollowMode::UntilCaughtUp` on the same checkpoint drains it: changes applied per second, from
//! its report. Beside it, in the same run: the source's raw change-feed read rate over the same
//! backlog (`changes` in pages of 500) and the target backend's raw `bulk_write` rate (the backlog's
//! size, create-only, into a scratch store), which bound it.
//!
//! Results go to stdout as markdown tables and to `target/bench/follow_bench.json`.

#[allow(dead_code)]
mod common;
#[allow(dead_code)]
#[path = "../tests/common/servers.rs"]
mod servers;

use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentstore::backend::{self, BackendUrl, BulkWrite, DocumentBackend, Precondition};
use agentstore::model::id::encode_key;
use agentstore::store::{DataStore, StoreOptions};
use futures::{StreamExt, TryStreamExt};
use serde_json::{json, Map, Value};
use tokio::sync::Semaphore;

use common::describe;

/// Documents per `bulk_write` (seeding, backlog) and per `changes` page.
const BATCH: usize = 500;
const BULK_IN_FLIGHT: usize = 4;
/// Writes of the paced writer in flight at once; when the source is slower than the offered rate,
/// the writer waits here and the achieved rate shows it.
const WRITES_IN_FLIGHT: usize = 64;
const MARKER_EVERY: Duration = Duration::from_millis(100);
const PROBE_EVERY: Duration = Duration::from_millis(5);
/// The marker document: (user, namespace, key).
const MARKER: (&str, &str, &str) = ("user0", "ns0", "follow-marker");
const DYNAMODB_SETTLE: &str = "&settle_ms=1000&write_timeout_ms=500";
const FIRESTORE_SETTLE: &str = "&settle_ms=1000";

fn main() -> ExitCode {
    common::bench_main("follow_bench", || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("tokio runtime: {e}"))?;
        runtime.block_on(run())
    })
}

/// The bench's settings, from the environment.
struct Settings {
    backends: Vec<Kind>,
    rates: Vec<u32>,
    docs: usize,
    secs: f64,
    backlog: usize,
    drain_limit: Duration,
    floor_secs: f64,
}

fn number<T: std::str::FromStr>(name: &str, default: T) -> Result<T, String> {
    match std::env::var(name) {
        Ok(text) if !text.trim().is_empty() => {
            text.trim().replace('_', "").parse().map_err(|_| format!("{name}={text:?} is not a valid number"))
        }
        _ => Ok(default),
    }
}

fn list(name: &str, default: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_owned())
        .split(',')
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect()
}

impl Settings {
    fn from_env() -> Result<Self, String> {
        let backends = list("BENCH_FOLLOW_BACKENDS", "embedded,couchdb,dynamodb,firestore")
            .iter()
            .map(|name| Kind::parse(name))
            .collect::<Result<Vec<_>, _>>()?;
        let rates = list("BENCH_FOLLOW_RATES", "200,2000")
            .iter()
            .map(|r| match r.replace('_', "").parse::<u32>() {
                Ok(rate) if rate > 0 => Ok(rate),
                _ => Err(format!("BENCH_FOLLOW_RATES: {r:?} is not a positive number of writes/s")),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let settings = Settings {
            backends,
            rates,
            docs: number("BENCH_FOLLOW_DOCS", 10_000usize)?,
            secs: number("BENCH_FOLLOW_SECS", 20.0f64)?,
            backlog: number("BENCH_FOLLOW_BACKLOG", 20_000usize)?,
            drain_limit: Duration::from_secs_f64(number("BENCH_FOLLOW_DRAIN_SECS", 60.0f64)?),
            floor_secs: number("BENCH_FOLLOW_FLOOR_SECS", 3.0f64)?,
        };
        if settings.backends.is_empty() || settings.rates.is_empty() {
            return Err("BENCH_FOLLOW_BACKENDS and BENCH_FOLLOW_RATES must each name at least one".into());
        }
        if settings.docs < 100 {
            return Err("BENCH_FOLLOW_DOCS must be at least 100".into());
        }
        if !(settings.secs > 0.0 && settings.floor_secs > 0.0) {
            return Err("BENCH_FOLLOW_SECS and BENCH_FOLLOW_FLOOR_SECS must be positive".into());
        }
        Ok(settings)
    }
}

/// A backend of the bench.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Embedded,
    CouchDb,
    DynamoDb,
    Firestore,
}

static STORES: AtomicUsize = AtomicUsize::new(0);

impl Kind {
    fn parse(name: &str) -> Result<Self, String> {
        Ok(match name {
            "embedded" => Kind::Embedded,
            "couchdb" => Kind::CouchDb,
            "dynamodb" => Kind::DynamoDb,
            "firestore" => Kind::Firestore,
            other => return Err(format!("BENCH_FOLLOW_BACKENDS names unknown backend {other:?}")),
        })
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Embedded => "embedded",
            Kind::CouchDb => "couchdb",
            Kind::DynamoDb => "dynamodb",
            Kind::Firestore => "firestore",
        }
    }

    /// Which server answers for this backend (starting it if needed).
    fn server(self) -> Result<String, String> {
        Ok(match self {
            Kind::Embedded => "redb file on local disk".to_owned(),
            Kind::CouchDb => servers::couchdb().map(|s| s.product)?,
            Kind::DynamoDb => servers::dynamodb().map(|s| format!("{} at {}", s.product, s.endpoint))?,
            Kind::Firestore => servers::firestore().map(|s| format!("{} at {}", s.product, s.host_port))?,
        })
    }

    /// The URL of a fresh, empty store on this backend, with the bench's settle window.
    fn fresh_url(self, dir: &Path, role: &str) -> Result<String, String> {
        let n = STORES.fetch_add(1, Ordering::Relaxed);
        let name = format!("follow_{role}_{}_{n}", common::run_suffix());
        Ok(match self {
            Kind::Embedded => format!("embedded:{}", dir.join(format!("{name}.redb")).display()),
            Kind::CouchDb => servers::couchdb()?.database_url(&name),
            Kind::DynamoDb => servers::dynamodb()?.table_url(&name) + DYNAMODB_SETTLE,
            Kind::Firestore => servers::firestore()?.collection_url(&name) + FIRESTORE_SETTLE,
        })
    }

    async fn fresh(self, dir: &Path, role: &str) -> Result<Arc<dyn DocumentBackend>, String> {
        let url = self.fresh_url(dir, role)?;
        let parsed: BackendUrl = url.parse().map_err(|e| format!("{url}: {e}"))?;
        backend::open(&parsed).await.map_err(|e| format!("{url}: {}", describe(&e)))
    }
}

/// The `i`-th seeded document: (user, namespace, key).
fn place(i: usize) -> (String, String, String) {
    (format!("user{}", i % 10), format!("ns{}", (i / 10) % 10), format!("k{i:06}"))
}

/// A ~300-byte value; `round` tells writes of one document apart.
fn value(i: usize, round: u64) -> Value {
    json!({
        "index": i,
        "round": round,
        "text": "payload of the follow benchmark, a few hundred bytes in every document ".repeat(4),
    })
}

/// A stored document in the spec's shape, as `bulk_write` takes it.
fn stored(i: usize, round: u64) -> BulkWrite {
    let (user, namespace, key) = place(i);
    let body = match json!({
        "userId": user, "namespace": namespace, "key": key, "value": value(i, round),
        "metadata": {"source": "follow_bench"}, "createdByAgent": "bench", "accessCount": 1,
        "createdAt": "2026-11-24T10:00:00Z", "updatedAt": "2026-11-24T10:00:00Z"
    }) {
        Value::Object(map) => map,
        _ => Map::new(),
    };
    BulkWrite { id: format!("{user}:{namespace}:{}", encode_key(&key)), body, precondition: Precondition::None }
}

/// Writes `writes` through `bulk_write` in batches of [`BATCH`], [`BULK_IN_FLIGHT`] at once;
/// docs/s. Any document refused is an error.
async fn bulk_write_all(backend: &Arc<dyn DocumentBackend>, writes: Vec<BulkWrite>) -> Result<f64, String> {
    let count = writes.len();
    let batches: Vec<Vec<BulkWrite>> = writes.chunks(BATCH).map(<[BulkWrite]>::to_vec).collect();
    let started = Instant::now();
    let failed: usize = futures::stream::iter(batches)
        .map(|batch| {
            let backend = Arc::clone(backend);
            async move {
                let results = backend.bulk_write(batch).await.map_err(|e| describe(&e))?;
                Ok::<_, String>(results.iter().filter(|r| r.is_err()).count())
            }
        })
        .buffer_unordered(BULK_IN_FLIGHT)
        .try_fold(0, |sum, n| async move { Ok(sum + n) })
        .await?;
    if failed > 0 {
        return Err(format!("{failed} of {count} bulk writes failed"));
    }
    Ok(count as f64 / started.elapsed().as_secs_f64().max(1e-9))
}

/// Seeds `docs` documents, create-only; docs/s.
async fn seed(backend: &Arc<dyn DocumentBackend>, docs: usize) -> Result<f64, String> {
    let writes = (0..docs).map(|i| BulkWrite { precondition: Precondition::MustNotExist, ..stored(i, 0) }).collect();
    bulk_write_all(backend, writes).await
}

/// The facade writers use at the source.
async fn facade(backend: &Arc<dyn DocumentBackend>) -> Result<Arc<DataStore>, String> {
    let store = DataStore::open(Arc::clone(backend), StoreOptions::default())
        .await
        .map_err(|e| format!("opening the facade: {}", describe(&e)))?;
    Ok(Arc::new(store))
}

/// Sets the marker document to `seq`.
async fn write_marker(store: &DataStore, seq: u64) -> Result<(), String> {
    let (user, namespace, key) = MARKER;
    store
        .set(user, namespace, key, json!({ "seq": seq }), None, Some("follow-bench"))
        .await
        .map(drop)
        .map_err(|e| format!("marker {seq}: {}", describe(&e)))
}

/// The marker id as the backends store it.
fn marker_id() -> String {
    let (user, namespace, key) = MARKER;
    format!("{user}:{namespace}:{}", encode_key(key))
}

/// Reads the marker's sequence number from `backend`, if the marker is there.
async fn read_marker(backend: &Arc<dyn DocumentBackend>) -> Result<Option<u64>, String> {
    let doc = backend.get(&marker_id()).await.map_err(|e| format!("reading the marker: {}", describe(&e)))?;
    Ok(doc.and_then(|doc| doc.body.get("value").and_then(|v| v.get("seq")).and_then(Value::as_u64)))
}

/// The probe: reads the marker at one backend every [`PROBE_EVERY`] and notes when each new
/// sequence number first shows.
struct Probe {
    /// (sequence number, end of the first read that showed it), in increasing order of both.
    seen: Arc<Mutex<Vec<(u64, Instant)>>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Result<ProbeStats, String>>,
}

/// What the probe's own reads cost.
struct ProbeStats {
    reads: u64,
    /// Median read latency, ms.
    read_median_ms: f64,
}

impl Probe {
    fn start(backend: Arc<dyn DocumentBackend>) -> Self {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(probe_loop(backend, Arc::clone(&seen), Arc::clone(&stop)));
        Probe { seen, stop, task }
    }

    fn latest(&self) -> Option<u64> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).last().map(|(seq, _)| *seq)
    }

    /// Waits until the probe has seen `seq` (or a later marker), at most `limit`; whether it has.
    async fn wait_for(&self, seq: u64, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if self.latest().is_some_and(|latest| latest >= seq) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.latest().is_some_and(|latest| latest >= seq)
    }

    async fn finish(self) -> Result<(Vec<(u64, Instant)>, ProbeStats), String> {
        self.stop.store(true, Ordering::Relaxed);
        let stats = self.task.await.map_err(|e| format!("the probe panicked: {e}"))??;
        let seen = std::mem::take(&mut *self.seen.lock().unwrap_or_else(|e| e.into_inner()));
        Ok((seen, stats))
    }
}

async fn probe_loop(
    backend: Arc<dyn DocumentBackend>,
    seen: Arc<Mutex<Vec<(u64, Instant)>>>,
    stop: Arc<AtomicBool>,
) -> Result<ProbeStats, String> {
    let mut latencies = Vec::new();
    let mut latest = None::<u64>;
    while !stop.load(Ordering::Relaxed) {
        let began = Instant::now();
        let seq = read_marker(&backend).await?;
        let now = Instant::now();
        latencies.push(now - began);
        if let Some(seq) = seq.filter(|seq| latest.is_none_or(|latest| *seq > latest)) {
            latest = Some(seq);
            seen.lock().unwrap_or_else(|e| e.into_inner()).push((seq, now));
        }
        tokio::time::sleep(PROBE_EVERY).await;
    }
    latencies.sort();
    let read_median_ms = latencies.get(latencies.len() / 2).map_or(f64::NAN, |d| d.as_secs_f64() * 1000.0);
    Ok(ProbeStats { reads: latencies.len() as u64, read_median_ms })
}

/// What the writers did.
struct Load {
    offered: u32,
    /// Writes issued and acknowledged (markers not included).
    issued: u64,
    acknowledged: u64,
    errors: u64,
    first_error: Option<String>,
    /// From the first write's start to the last one's acknowledgement.
    elapsed: Duration,
    /// (sequence number, acknowledgement) of each marker written.
    markers: Vec<(u64, Instant)>,
}

impl Load {
    fn achieved(&self) -> f64 {
        self.acknowledged as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Shared tallies of the paced writes.
#[derive(Default)]
struct Tally {
    acknowledged: AtomicU64,
    errors: AtomicU64,
    first_error: Mutex<Option<String>>,
}

impl Tally {
    fn record(&self, result: Result<(), String>) {
        match result {
            Ok(()) => {
                self.acknowledged.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                self.errors.fetch_add(1, Ordering::Relaxed);
                self.first_error.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e);
            }
        }
    }
}

/// The `n`-th paced write: 1 in 20 creates a document, 1 in 20 deletes the one created 10 writes
/// before, the rest update a seeded document (a fixed permutation, so writes in flight together
/// touch different documents).
async fn paced_write(store: &DataStore, n: u64, docs: usize) -> Result<(), String> {
    let fail = |e: agentstore::Error| format!("write {n}: {}", describe(&e));
    match n % 20 {
        0 | 10 => {
            let created = n - n % 20;
            let (user, namespace, _) = place(created as usize);
            let key = format!("new{created}");
            if n % 20 == 0 {
                store.set(&user, &namespace, &key, value(0, n), None, Some("follow-bench")).await.map_err(fail)?;
            } else {
                store.delete(&user, &namespace, &key).await.map_err(fail)?;
            }
        }
        _ => {
            let i = ((n % docs as u64) * 7919 % docs as u64) as usize;
            let (user, namespace, key) = place(i);
            store.set(&user, &namespace, &key, value(i, n), None, Some("follow-bench")).await.map_err(fail)?;
        }
    }
    Ok(())
}

/// Writes at `rate` writes/s for `secs` (at most [`WRITES_IN_FLIGHT`] at once), and the marker
/// every [`MARKER_EVERY`] from sequence number `first_marker` on; waits for every write to end.
async fn paced_load(store: Arc<DataStore>, rate: u32, secs: f64, docs: usize, first_marker: u64) -> Load {
    let window = Duration::from_secs_f64(secs);
    let started = Instant::now();
    let stop_markers = Arc::new(AtomicBool::new(false));
    let markers = tokio::spawn(marker_loop(Arc::clone(&store), first_marker, Arc::clone(&stop_markers)));
    let tally = Arc::new(Tally::default());
    let permits = Arc::new(Semaphore::new(WRITES_IN_FLIGHT));
    let mut writes = tokio::task::JoinSet::new();
    let mut issued = 0u64;
    loop {
        let due = started + Duration::from_secs_f64(issued as f64 / f64::from(rate));
        if due >= started + window {
            break;
        }
        tokio::time::sleep_until(due.into()).await;
        let Ok(permit) = Arc::clone(&permits).acquire_owned().await else { break };
        if started.elapsed() >= window {
            break;
        }
        let (store, tally) = (Arc::clone(&store), Arc::clone(&tally));
        writes.spawn(async move {
            tally.record(paced_write(&store, issued, docs).await);
            drop(permit);
        });
        issued += 1;
    }
    while writes.join_next().await.is_some() {}
    let elapsed = started.elapsed();
    stop_markers.store(true, Ordering::Relaxed);
    let (markers, marker_error) = markers.await.unwrap_or_else(|e| (Vec::new(), Some(format!("markers: {e}"))));
    let tally = Arc::into_inner(tally).unwrap_or_default();
    let mut first_error = tally.first_error.into_inner().unwrap_or_else(|e| e.into_inner());
    let mut errors = tally.errors.into_inner();
    if let Some(e) = marker_error {
        errors += 1;
        first_error.get_or_insert(e);
    }
    Load { offered: rate, issued, acknowledged: tally.acknowledged.into_inner(), errors, first_error, elapsed, markers }
}

/// Updates the marker every [`MARKER_EVERY`] until told to stop (then once more, so the last
/// marker follows every paced write); the markers acknowledged, and the error that ended it.
async fn marker_loop(
    store: Arc<DataStore>,
    first: u64,
    stop: Arc<AtomicBool>,
) -> (Vec<(u64, Instant)>, Option<String>) {
    let mut ticks = tokio::time::interval(MARKER_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut acknowledged = Vec::new();
    let mut seq = first;
    loop {
        let last = stop.load(Ordering::Relaxed);
        if !last {
            ticks.tick().await;
        }
        if let Err(e) = write_marker(&store, seq).await {
            return (acknowledged, Some(e));
        }
        acknowledged.push((seq, Instant::now()));
        seq += 1;
        if last {
            return (acknowledged, None);
        }
    }
}

/// The markers' lags: for each marker written, the time from its acknowledgement to the first
/// probe read that showed it or a later one; `None` for a marker never seen.
fn marker_lags(markers: &[(u64, Instant)], seen: &[(u64, Instant)]) -> Vec<Option<Duration>> {
    markers
        .iter()
        .map(|(seq, acknowledged)| {
            let first = seen.partition_point(|(shown, _)| shown < seq);
            seen.get(first).map(|(_, at)| at.saturating_duration_since(*acknowledged))
        })
        .collect()
}

/// Lag statistics over the markers that reached the other side, ms.
#[derive(Debug, Clone, Default)]
struct LagStats {
    markers: usize,
    unseen: usize,
    median_ms: f64,
    p90_ms: f64,
    worst_ms: f64,
    first_quarter_median_ms: f64,
    last_quarter_median_ms: f64,
}

fn median_ms(lags: &[Duration]) -> f64 {
    quantile_ms(lags, 0.5)
}

/// The `q` quantile of `lags` (nearest rank), ms; NaN when empty.
fn quantile_ms(lags: &[Duration], q: f64) -> f64 {
    let mut sorted = lags.to_vec();
    sorted.sort();
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1].as_secs_f64() * 1000.0
}

impl LagStats {
    fn of(lags: &[Option<Duration>]) -> Self {
        let seen: Vec<Duration> = lags.iter().flatten().copied().collect();
        let quarter = (lags.len() / 4).max(1);
        let in_order: Vec<Duration> = lags.iter().map(|l| l.unwrap_or(Duration::MAX)).collect();
        LagStats {
            markers: lags.len(),
            unseen: lags.len() - seen.len(),
            median_ms: median_ms(&seen),
            p90_ms: quantile_ms(&seen, 0.9),
            worst_ms: seen.iter().max().map_or(f64::NAN, |d| d.as_secs_f64() * 1000.0),
            first_quarter_median_ms: median_ms(&in_order[..quarter.min(in_order.len())]),
            last_quarter_median_ms: median_ms(&in_order[in_order.len().saturating_sub(quarter)..]),
        }
    }

    /// Every marker arrived, and the lag at the end is not growing away from the lag at the start
    /// (more than twice it plus half a second).
    fn kept_up(&self) -> bool {
        self.unseen == 0 && self.last_quarter_median_ms <= 2.0 * self.first_quarter_median_ms + 500.0
    }

    fn to_json(&self) -> Value {
        json!({
            "markers": self.markers, "markers_never_seen": self.unseen, "median_ms": self.median_ms,
            "p90_ms": self.p90_ms, "worst_ms": self.worst_ms,
            "first_quarter_median_ms": self.first_quarter_median_ms,
            "last_quarter_median_ms": self.last_quarter_median_ms, "kept_up": self.kept_up(),
        })
    }
}

/// One probe-floor row: the probe reading the source itself.
struct FloorResult {
    backend: Kind,
    load: Load,
    lag: LagStats,
    probe: ProbeStats,
}

/// The probe floor on `kind`: writers at `rate` for `secs`, the probe reading the same store.
async fn probe_floor(kind: Kind, settings: &Settings, rate: u32, dir: &Path) -> Result<FloorResult, String> {
    let source = kind.fresh(dir, "floor").await?;
    seed(&source, settings.docs).await?;
    let store = facade(&source).await?;
    write_marker(&store, 0).await?;
    let probe = Probe::start(Arc::clone(&source));
    let load = paced_load(store, rate, settings.floor_secs, settings.docs, 1).await;
    probe.wait_for(load.markers.last().map_or(0, |(seq, _)| *seq), settings.drain_limit).await;
    let (seen, probe) = probe.finish().await?;
    let lag = LagStats::of(&marker_lags(&load.markers, &seen));
    Ok(FloorResult { backend: kind, load, lag, probe })
}

fn fmt_ms(ms: f64) -> String {
    if ms.is_nan() {
        "-".into()
    } else if ms >= 100.0 {
        format!("{ms:.0}")
    } else {
        format!("{ms:.1}")
    }
}

fn print_floor_table(rows: &[FloorResult]) {
    println!();
    println!("| backend (probe reads the source) | writes/s offered | writes/s achieved | write errors | markers | probe read median ms | lag median ms | p90 ms | worst ms |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {:.0} | {} | {} | {} | {} | {} | {} |",
            r.backend.name(),
            r.load.offered,
            r.load.achieved(),
            r.load.errors,
            r.lag.markers,
            fmt_ms(r.probe.read_median_ms),
            fmt_ms(r.lag.median_ms),
            fmt_ms(r.lag.p90_ms),
            fmt_ms(r.lag.worst_ms)
        );
    }
}

fn floor_json(r: &FloorResult) -> Value {
    json!({
        "backend": r.backend.name(), "offered_writes_per_s": r.load.offered,
        "achieved_writes_per_s": r.load.achieved(), "writes_issued": r.load.issued,
        "write_errors": r.load.errors, "first_error": r.load.first_error,
        "probe_reads": r.probe.reads, "probe_read_median_ms": r.probe.read_median_ms, "lag": r.lag.to_json(),
    })
}

async fn run() -> Result<bool, String> {
    for (name, value) in [("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"), ("AWS_REGION", "us-east-1")]
    {
        if std::env::var_os(name).is_none() {
            std::env::set_var(name, value);
        }
    }
    let settings = Settings::from_env()?;
    let started = Instant::now();
    let nproc = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    println!(
        "follow_bench: {} documents per source, rates {:?} writes/s for {} s, backlog {}, nproc {nproc}, {}",
        settings.docs,
        settings.rates,
        settings.secs,
        settings.backlog,
        chrono::Utc::now().format("%Y-%m-%d %H:%M UTC")
    );
    for kind in &settings.backends {
        println!("  {:<9} {}", kind.name(), kind.server()?);
    }
    let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
    let floor_rate = settings.rates[0];
    let mut floors = Vec::new();
    for kind in &settings.backends {
        let floor = probe_floor(*kind, &settings, floor_rate, dir.path()).await?;
        println!(
            "  probe floor {}: {:.0} writes/s, lag median {} ms",
            kind.name(),
            floor.load.achieved(),
            fmt_ms(floor.lag.median_ms)
        );
        floors.push(floor);
    }
    print_floor_table(&floors);
    let passed = floors.iter().all(|f| f.load.errors == 0 && f.lag.unseen == 0);
    println!("\nfinished in {:.0} s", started.elapsed().as_secs_f64());
    common::write_report(
        "follow_bench",
        &json!({
            "documents": settings.docs, "rates": settings.rates, "seconds": settings.secs,
            "backlog": settings.backlog, "nproc": nproc,
            "probe_floor": floors.iter().map(floor_json).collect::<Vec<_>>(),
        }),
    )?;
    Ok(passed)
}
