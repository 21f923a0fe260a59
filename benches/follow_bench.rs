//! Live migration under load: how far behind the source a following migration runs, and how fast
//! it drains a backlog, for each ordered pair of backends, in one process through the library (so
//! an embedded source, whose file its process locks, can be followed while it is written).
//!
//! Run it with `cargo bench --bench benches -- follow_bench`. Settings (environment):
//! - `BENCH_FOLLOW_BACKENDS` (default `embedded,couchdb,dynamodb,firestore`): the backends; every
//!   ordered pair of two of them is measured, and embedded → embedded (a pair of one server
//!   backend with itself would only measure that server twice over);
//! - `BENCH_FOLLOW_RATES` (default `200,2000`): the offered write rates at the source, writes/s;
//! - `BENCH_FOLLOW_DOCS` (default 10,000): documents seeded into each fresh source;
//! - `BENCH_FOLLOW_SECS` (default 20): how long the writers write at each rate;
//! - `BENCH_FOLLOW_BACKLOG` (default 10,000: every seeded document updated once; more also creates
//!   documents): changed documents the throughput run drains;
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
//! limit, at least half of them while the writes went on, and the lag of the last quarter of
//! markers is not growing away from the first's).
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

use crate::common;
use crate::servers;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentstore::backend::{self, BackendUrl, BulkWrite, DocumentBackend, Precondition};
use agentstore::migrate::report::{Counts, Report, Status};
use agentstore::migrate::{self, checkpoint, Endpoint, FollowMode, Job, JobKind, Options};
use agentstore::model::id::encode_key;
use agentstore::store::{DataStore, StoreOptions};
use futures::{StreamExt, TryStreamExt};
use serde_json::{json, Map, Value};
use tokio::sync::Semaphore;

use common::{describe, Kind};

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
/// How long the target may take to hold the copied data set, or to show the first marker.
const SETUP_LIMIT: Duration = Duration::from_secs(900);
const DYNAMODB_SETTLE: &str = "&settle_ms=1000&write_timeout_ms=500";
const FIRESTORE_SETTLE: &str = "&settle_ms=1000";

pub fn main() -> ExitCode {
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
            .map(|name| Kind::parse(name, "BENCH_FOLLOW_BACKENDS"))
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
            backlog: number("BENCH_FOLLOW_BACKLOG", 10_000usize)?,
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

/// Fresh stores made so far, for unique names.
static STORES: AtomicUsize = AtomicUsize::new(0);

impl Kind {
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
    /// When the last paced write was acknowledged (the last marker is written after it).
    writes_ended: Instant,
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
            if n.is_multiple_of(20) {
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
    let writes_ended = Instant::now();
    stop_markers.store(true, Ordering::Relaxed);
    let (markers, marker_error) = markers.await.unwrap_or_else(|e| (Vec::new(), Some(format!("markers: {e}"))));
    let tally = Arc::into_inner(tally).unwrap_or_default();
    let mut first_error = tally.first_error.into_inner().unwrap_or_else(|e| e.into_inner());
    let mut errors = tally.errors.into_inner();
    if let Some(e) = marker_error {
        errors += 1;
        first_error.get_or_insert(e);
    }
    Load {
        offered: rate,
        issued,
        acknowledged: tally.acknowledged.into_inner(),
        errors,
        first_error,
        elapsed,
        writes_ended,
        markers,
    }
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

/// When each marker written first showed: the end of the first probe read that showed it or a
/// later one; `None` for a marker never seen.
fn marker_arrivals(markers: &[(u64, Instant)], seen: &[(u64, Instant)]) -> Vec<Option<Instant>> {
    markers.iter().map(|(seq, _)| seen.get(seen.partition_point(|(shown, _)| shown < seq)).map(|(_, at)| *at)).collect()
}

/// Lag statistics over the markers that reached the other side, ms.
#[derive(Debug, Clone, Default)]
struct LagStats {
    markers: usize,
    unseen: usize,
    /// Markers that reached the other side before the paced writes ended.
    shown_during_writes: usize,
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
    /// The lags of `load`'s markers, given when each arrived.
    fn of(load: &Load, arrivals: &[Option<Instant>]) -> Self {
        let lags: Vec<Option<Duration>> = load
            .markers
            .iter()
            .zip(arrivals)
            .map(|((_, acknowledged), arrived)| arrived.map(|at| at.saturating_duration_since(*acknowledged)))
            .collect();
        let seen: Vec<Duration> = lags.iter().flatten().copied().collect();
        let quarter = (lags.len() / 4).max(1);
        let in_order: Vec<Duration> = lags.iter().map(|l| l.unwrap_or(Duration::MAX)).collect();
        LagStats {
            markers: lags.len(),
            unseen: lags.len() - seen.len(),
            shown_during_writes: arrivals.iter().flatten().filter(|at| **at < load.writes_ended).count(),
            median_ms: median_ms(&seen),
            p90_ms: quantile_ms(&seen, 0.9),
            worst_ms: seen.iter().max().map_or(f64::NAN, |d| d.as_secs_f64() * 1000.0),
            first_quarter_median_ms: median_ms(&in_order[..quarter.min(in_order.len())]),
            last_quarter_median_ms: median_ms(&in_order[in_order.len().saturating_sub(quarter)..]),
        }
    }

    /// Why the follower did not keep up, or `None` when it did: every marker arrived, most of them
    /// while the writes were still going on (not all at once when they stopped), and the lag at the
    /// end is not growing away from the lag at the start (more than twice it plus half a second).
    fn shortfall(&self, drain_limit: Duration, waiting: u64) -> Option<String> {
        if self.unseen > 0 {
            Some(format!(
                "{} markers not at the target {} s after the writes; {waiting} changes waiting",
                self.unseen,
                drain_limit.as_secs()
            ))
        } else if self.shown_during_writes * 2 < self.markers {
            Some(format!(
                "stalled: {} of {} markers reached the target before the writes stopped",
                self.shown_during_writes, self.markers
            ))
        } else if self.last_quarter_median_ms > 2.0 * self.first_quarter_median_ms + 500.0 {
            Some("lag growing".into())
        } else {
            None
        }
    }

    fn kept_up(&self) -> bool {
        self.shortfall(Duration::ZERO, 0).is_none()
    }

    fn to_json(&self) -> Value {
        json!({
            "markers": self.markers, "markers_never_seen": self.unseen,
            "markers_shown_during_writes": self.shown_during_writes, "median_ms": self.median_ms,
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
    let lag = LagStats::of(&load, &marker_arrivals(&load.markers, &seen));
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

/// A migration running in a task of this process.
struct Running {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<agentstore::Result<Report>>,
}

/// The migration of `source` to `target` under `mode`, checkpointed at `checkpoint`; no read-back
/// (a follower is stopped while the source changes, and the drain is timed alone).
fn job(stores: &Stores, mode: FollowMode) -> Job {
    Job {
        kind: JobKind::Migrate,
        source: Endpoint::backend(Arc::clone(&stores.source)),
        target: Endpoint::backend(Arc::clone(&stores.target)),
        options: Options {
            follow: mode,
            checkpoint: Some(stores.checkpoint.clone()),
            verify: false,
            ..Default::default()
        },
    }
}

impl Running {
    fn start(job: Job) -> Self {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let signal = Box::pin(async move {
            let _ = stopped.await;
        });
        Running { stop, task: tokio::spawn(migrate::run_until(job, signal)) }
    }

    /// Waits until the checkpoint says the copy is finished; how long that took. A migration that
    /// ends meanwhile is an error.
    async fn wait_for_copy(&self, checkpoint: &Path, limit: Duration) -> Result<Duration, String> {
        let started = Instant::now();
        while started.elapsed() < limit {
            if self.task.is_finished() {
                return Err("the follower ended during its copy".into());
            }
            let saved = checkpoint::load(checkpoint).map_err(|e| describe(&e))?;
            if saved.is_some_and(|saved| saved.finished) {
                return Ok(started.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(format!("the copy did not finish within {} s", limit.as_secs()))
    }

    /// Stops it after its current page; its report, which must say `stopped`.
    async fn stop(self) -> Result<Report, String> {
        let _ = self.stop.send(());
        let report = self
            .task
            .await
            .map_err(|e| format!("the follower panicked: {e}"))?
            .map_err(|e| format!("the follower failed: {}", describe(&e)))?;
        match report.status {
            Status::Stopped => Ok(report),
            other => Err(format!("the follower ended {other:?}: {}", report.message)),
        }
    }
}

/// The stores of one measured pair.
struct Stores {
    source: Arc<dyn DocumentBackend>,
    target: Arc<dyn DocumentBackend>,
    /// The writers' facade over the source.
    facade: Arc<DataStore>,
    checkpoint: PathBuf,
}

static CHECKPOINTS: AtomicUsize = AtomicUsize::new(0);

impl Stores {
    /// A fresh source seeded with `docs` documents and the marker, and a fresh target.
    async fn fresh(from: Kind, to: Kind, docs: usize, dir: &Path) -> Result<Self, String> {
        let source = from.fresh(dir, "src").await?;
        let target = to.fresh(dir, "dst").await?;
        seed(&source, docs).await?;
        let facade = facade(&source).await?;
        write_marker(&facade, 0).await?;
        let checkpoint = dir.join(format!("checkpoint-{}.json", CHECKPOINTS.fetch_add(1, Ordering::Relaxed)));
        Ok(Stores { source, target, facade, checkpoint })
    }
}

/// An ordered pair of backends.
#[derive(Clone, Copy)]
struct Pair {
    from: Kind,
    to: Kind,
}

impl Pair {
    fn name(self) -> String {
        format!("{} → {}", self.from.name(), self.to.name())
    }
}

/// One lag row.
struct LagResult {
    pair: Pair,
    settle: Duration,
    copy: Duration,
    load: Load,
    lag: LagStats,
    probe: ProbeStats,
    /// The follower's own report when it was stopped: changes it still saw waiting.
    lag_changes_at_stop: u64,
    follow_counts: Counts,
}

/// The lag of `pair` under writes at `rate`, on fresh stores; the stores are returned with their
/// follower stopped (copy done, follow position saved).
async fn lag_run(pair: Pair, rate: u32, settings: &Settings, dir: &Path) -> Result<(LagResult, Stores), String> {
    let stores = Stores::fresh(pair.from, pair.to, settings.docs, dir).await?;
    let settle = stores.source.change_feed_delay();
    let follower = Running::start(job(&stores, FollowMode::Forever));
    let probe = Probe::start(Arc::clone(&stores.target));
    let copy = follower.wait_for_copy(&stores.checkpoint, SETUP_LIMIT).await?;
    // The first marker through the follow phase: the follower is applying changes.
    write_marker(&stores.facade, 1).await?;
    if !probe.wait_for(1, SETUP_LIMIT).await {
        return Err(format!("{}: the first marker never reached the target", pair.name()));
    }
    let load = paced_load(Arc::clone(&stores.facade), rate, settings.secs, settings.docs, 2).await;
    let last = load.markers.last().map_or(1, |(seq, _)| *seq);
    probe.wait_for(last, settings.drain_limit).await;
    let (seen, probe) = probe.finish().await?;
    let report = follower.stop().await?;
    let follow = report.follow.ok_or("the follower's report has no follow section")?;
    let lag = LagStats::of(&load, &marker_arrivals(&load.markers, &seen));
    let result = LagResult {
        pair,
        settle,
        copy,
        load,
        lag,
        probe,
        lag_changes_at_stop: follow.lag_changes,
        follow_counts: follow.ledger.counts,
    };
    Ok((result, stores))
}

/// One follow-throughput row.
struct CeilingResult {
    pair: Pair,
    settle: Duration,
    /// Documents changed at the source while the follower was stopped.
    backlog: usize,
    /// The source's `bulk_write` rate taking the backlog, docs/s.
    backlog_write_rate: f64,
    /// Changes the catching-up run read, and applied (written or deleted).
    read: u64,
    applied: u64,
    drain: Duration,
    /// The source's raw change-feed read rate over the same backlog, changes/s.
    feed_rate: f64,
    /// The target backend's raw `bulk_write` rate (create-only, into a scratch store), docs/s.
    target_write_rate: f64,
}

impl CeilingResult {
    fn applied_rate(&self) -> f64 {
        self.applied as f64 / self.drain.as_secs_f64().max(1e-9)
    }

    fn bound(&self) -> f64 {
        self.feed_rate.min(self.target_write_rate)
    }
}

/// The backlog: the first `backlog` seeded documents updated, then fresh ones created past them,
/// so that every write changes a distinct document (the feed shows each document once).
fn backlog_writes(docs: usize, backlog: usize) -> Vec<BulkWrite> {
    (0..backlog)
        .map(|i| match i < docs {
            true => stored(i, u64::MAX),
            false => BulkWrite { precondition: Precondition::MustNotExist, ..stored(i, 0) },
        })
        .collect()
}

/// Reads the source's feed from `since` to its end in pages of [`BATCH`]; (changes, changes/s).
async fn feed_read_rate(source: &Arc<dyn DocumentBackend>, since: String) -> Result<(usize, f64), String> {
    let started = Instant::now();
    let (mut since, mut total) = (since, 0);
    loop {
        let page = source.changes(Some(&since), BATCH).await.map_err(|e| format!("changes: {}", describe(&e)))?;
        total += page.changes.len();
        if page.changes.is_empty() {
            return Ok((total, total as f64 / started.elapsed().as_secs_f64().max(1e-9)));
        }
        since = page.last_seq;
    }
}

/// The follow throughput of `pair` on `stores` (follower stopped after its copy and its lag run):
/// the backlog written, then drained by an `--until-caught-up` run on the same checkpoint.
async fn ceiling_run(
    pair: Pair,
    stores: &Stores,
    stopped: &Counts,
    settings: &Settings,
    target_write_rate: f64,
) -> Result<CeilingResult, String> {
    let before = stores.source.change_position().await.map_err(|e| describe(&e))?;
    let backlog_write_rate = bulk_write_all(&stores.source, backlog_writes(settings.docs, settings.backlog)).await?;
    let started = Instant::now();
    let report = migrate::run(job(stores, FollowMode::UntilCaughtUp))
        .await
        .map_err(|e| format!("catching up: {}", describe(&e)))?;
    let drain = started.elapsed();
    if report.status != Status::CaughtUp {
        return Err(format!("{}: catching up ended {:?}: {}", pair.name(), report.status, report.message));
    }
    let after = report.follow.ok_or("the catching-up report has no follow section")?.ledger.counts;
    if after.failed > stopped.failed || after.conflicts > stopped.conflicts {
        return Err(format!("{}: catching up failed or met conflicts: {after:?}", pair.name()));
    }
    let (in_feed, feed_rate) = feed_read_rate(&stores.source, before).await?;
    if in_feed < settings.backlog {
        return Err(format!("{}: the source's feed shows {in_feed} of the {} changes", pair.name(), settings.backlog));
    }
    Ok(CeilingResult {
        pair,
        settle: stores.source.change_feed_delay(),
        backlog: settings.backlog,
        backlog_write_rate,
        read: after.read - stopped.read,
        applied: (after.written + after.deleted) - (stopped.written + stopped.deleted),
        drain,
        feed_rate,
        target_write_rate,
    })
}

/// The raw `bulk_write` rate of `kind` for `docs` fresh documents, on a scratch store.
async fn raw_write_rate(kind: Kind, docs: usize, dir: &Path) -> Result<f64, String> {
    let scratch = kind.fresh(dir, "scratch").await?;
    let writes = (0..docs).map(|i| BulkWrite { precondition: Precondition::MustNotExist, ..stored(i, 0) }).collect();
    bulk_write_all(&scratch, writes).await
}

/// The pairs measured: every ordered pair of distinct backends, and embedded → embedded.
fn pairs(backends: &[Kind]) -> Vec<Pair> {
    let mut pairs = Vec::new();
    for &from in backends {
        for &to in backends {
            if from != to || from == Kind::Embedded {
                pairs.push(Pair { from, to });
            }
        }
    }
    pairs
}

fn print_lag_table(rows: &[LagResult], drain_limit: Duration) {
    println!();
    println!("| pair | source settle window ms | copy s | writes/s offered | writes/s achieved | write errors | markers | lag median ms | p90 ms | worst ms | median first → last quarter ms | kept up |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let kept_up = match r.lag.shortfall(drain_limit, r.lag_changes_at_stop) {
            None => "yes".to_owned(),
            Some(why) => format!("**no**: {why}"),
        };
        println!(
            "| {} | {} | {:.1} | {} | {:.0} | {} | {} | {} | {} | {} | {} → {} | {kept_up} |",
            r.pair.name(),
            r.settle.as_millis(),
            r.copy.as_secs_f64(),
            r.load.offered,
            r.load.achieved(),
            r.load.errors,
            r.lag.markers,
            fmt_ms(r.lag.median_ms),
            fmt_ms(r.lag.p90_ms),
            fmt_ms(r.lag.worst_ms),
            fmt_ms(r.lag.first_quarter_median_ms),
            fmt_ms(r.lag.last_quarter_median_ms),
        );
    }
}

fn print_ceiling_table(rows: &[CeilingResult]) {
    println!();
    println!("| pair | source settle window ms | backlog (changed documents) | source took it at docs/s | drain s | changes applied/s | source feed read changes/s | target bulk_write docs/s | applied ÷ slower raw rate |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {} | {:.0} | {:.2} | {:.0} | {:.0} | {:.0} | {:.2} |",
            r.pair.name(),
            r.settle.as_millis(),
            r.backlog,
            r.backlog_write_rate,
            r.drain.as_secs_f64(),
            r.applied_rate(),
            r.feed_rate,
            r.target_write_rate,
            r.applied_rate() / r.bound()
        );
    }
}

fn lag_json(r: &LagResult) -> Value {
    json!({
        "pair": r.pair.name(), "source_settle_ms": r.settle.as_millis() as u64, "copy_s": r.copy.as_secs_f64(),
        "offered_writes_per_s": r.load.offered, "achieved_writes_per_s": r.load.achieved(),
        "writes_issued": r.load.issued, "writes_acknowledged": r.load.acknowledged,
        "write_errors": r.load.errors, "first_error": r.load.first_error,
        "probe_reads": r.probe.reads, "probe_read_median_ms": r.probe.read_median_ms,
        "lag": r.lag.to_json(), "lag_changes_at_stop": r.lag_changes_at_stop,
        "follow_counts": serde_json::to_value(&r.follow_counts).unwrap_or(Value::Null),
    })
}

fn ceiling_json(r: &CeilingResult) -> Value {
    json!({
        "pair": r.pair.name(), "source_settle_ms": r.settle.as_millis() as u64, "backlog": r.backlog,
        "backlog_write_docs_per_s": r.backlog_write_rate, "read": r.read, "applied": r.applied,
        "drain_s": r.drain.as_secs_f64(), "applied_per_s": r.applied_rate(),
        "source_feed_changes_per_s": r.feed_rate, "target_bulk_write_docs_per_s": r.target_write_rate,
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
    let floors = measure_floors(&settings, dir.path()).await?;
    let (lags, ceilings) = measure_pairs(&settings, dir.path()).await?;
    print_floor_table(&floors);
    print_lag_table(&lags, settings.drain_limit);
    print_ceiling_table(&ceilings);
    let passed =
        floors.iter().all(|f| f.load.errors == 0 && f.lag.unseen == 0) && lags.iter().all(|l| l.load.errors == 0);
    println!("\nfinished in {:.0} s", started.elapsed().as_secs_f64());
    common::write_report(
        "follow_bench",
        &json!({
            "documents": settings.docs, "rates": settings.rates, "seconds": settings.secs,
            "backlog": settings.backlog, "drain_limit_s": settings.drain_limit.as_secs_f64(), "nproc": nproc,
            "probe_floor": floors.iter().map(floor_json).collect::<Vec<_>>(),
            "lag": lags.iter().map(lag_json).collect::<Vec<_>>(),
            "follow_throughput": ceilings.iter().map(ceiling_json).collect::<Vec<_>>(),
        }),
    )?;
    Ok(passed)
}

/// The probe floor of each backend, at the first rate.
async fn measure_floors(settings: &Settings, dir: &Path) -> Result<Vec<FloorResult>, String> {
    let mut floors = Vec::new();
    for kind in &settings.backends {
        let floor = probe_floor(*kind, settings, settings.rates[0], dir).await?;
        println!(
            "  probe floor {}: {:.0} writes/s, lag median {} ms",
            kind.name(),
            floor.load.achieved(),
            fmt_ms(floor.lag.median_ms)
        );
        floors.push(floor);
    }
    Ok(floors)
}

/// For each pair: a lag run per rate, then the follow throughput on the last run's stores.
async fn measure_pairs(settings: &Settings, dir: &Path) -> Result<(Vec<LagResult>, Vec<CeilingResult>), String> {
    let mut target_rates: HashMap<&'static str, f64> = HashMap::new();
    let (mut lags, mut ceilings) = (Vec::new(), Vec::new());
    for pair in pairs(&settings.backends) {
        let mut last = None;
        for &rate in &settings.rates {
            let (result, stores) = lag_run(pair, rate, settings, dir).await?;
            println!(
                "  {} at {rate}/s: {:.0} writes/s, lag median {} ms, worst {} ms, kept up: {}",
                pair.name(),
                result.load.achieved(),
                fmt_ms(result.lag.median_ms),
                fmt_ms(result.lag.worst_ms),
                result.lag.kept_up()
            );
            last = Some((result.follow_counts.clone(), stores));
            lags.push(result);
        }
        let Some((stopped, stores)) = last else { continue };
        let target_rate = match target_rates.get(pair.to.name()) {
            Some(rate) => *rate,
            None => {
                let rate = raw_write_rate(pair.to, settings.backlog, dir).await?;
                target_rates.insert(pair.to.name(), rate);
                rate
            }
        };
        let ceiling = ceiling_run(pair, &stores, &stopped, settings, target_rate).await?;
        println!(
            "  {} follow throughput: {} changes in {:.2} s, {:.0}/s",
            pair.name(),
            ceiling.applied,
            ceiling.drain.as_secs_f64(),
            ceiling.applied_rate()
        );
        ceilings.push(ceiling);
    }
    Ok((lags, ceilings))
}
