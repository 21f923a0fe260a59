//! Facade-vs-raw pairs under closed-loop load.
//!
//! Every phase is a closed loop of `BENCH_CLIENTS` concurrent tasks, each running one operation at
//! a time. Each side of a pair is bounded by `BENCH_SECONDS` and `BENCH_MAX_REQUESTS` in total,
//! split over [`SEGMENTS_PER_SIDE`] short segments run alternately as ABBA BAAB ABBA BAAB
//! (A = facade) after an untimed warm-up of both sides, so drift (the server slowing as revisions
//! pile up, other load on the machine, CPU clocks) lands on both sides alike. Latency is
//! wall-clock around one whole operation (inputs are built before the clock starts); throughput is
//! successful operations over the side's summed segment time. Before and after every timed
//! segment the bench's [`Counters`] are read, so a per-operation figure (raw calls, server writes)
//! and the raw side's conflict retries can be attributed to the side that ran.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde_json::{json, Value};

use super::facade::Facades;
use super::workload::{check_listing, Input, Pair};
use super::Config;

/// How many timed segments each side of a pair gets (even).
pub const SEGMENTS_PER_SIDE: u64 = 8;
/// Untimed operations per client and side before a pair is measured.
pub const WARMUP_OPS_PER_CLIENT: u64 = 5;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Facade,
    Raw,
}

impl Side {
    pub fn name(self) -> &'static str {
        match self {
            Side::Facade => "facade",
            Side::Raw => "raw",
        }
    }
}

/// How a bench names what it measures, in its table and its JSON.
pub struct Labels {
    /// Column of the calls one operation makes (`SDK calls`), also heading the bulk table's.
    pub calls_column: &'static str,
    /// JSON key of the same (`sdk_calls`), in operations and bulk writes.
    pub calls_key: &'static str,
    /// Column of the per-operation counter (`calls/op`).
    pub counter_column: &'static str,
    /// JSON key of the per-operation counter (`sdk_calls_per_op`).
    pub counter_key: &'static str,
    /// JSON key of the counter's total, when reported (`server_writes`).
    pub counter_total_key: Option<&'static str>,
    /// The counter and the conflict retries describe the raw side only: the facade shows `-` and
    /// `null` for them.
    pub raw_only: bool,
    /// What holds the documents (`table`, `collection`), for the bulk verification columns.
    pub container: &'static str,
}

/// What a bench counts, read before and after each timed segment.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counters {
    /// Raw calls made, or server writes seen: shown per operation.
    pub counted: u64,
    /// Failed conditions the raw side retried.
    pub conflicts: u64,
}

/// What the raw side tallies as it goes: its calls and the failed conditions it retried.
#[derive(Debug, Default)]
pub struct Tally {
    calls: AtomicU64,
    conflicts: AtomicU64,
}

impl Tally {
    /// One call made.
    pub fn call(&self) {
        self.calls.fetch_add(1, Ordering::Relaxed);
    }

    /// One failed condition retried.
    pub fn conflict(&self) {
        self.conflicts.fetch_add(1, Ordering::Relaxed);
    }

    /// The tallies so far: calls as [`Counters::counted`].
    pub fn counters(&self) -> Counters {
        Counters { counted: self.calls.load(Ordering::Relaxed), conflicts: self.conflicts.load(Ordering::Relaxed) }
    }
}

/// One bench's two sides.
pub trait Bench: Send + Sync + 'static {
    /// The bench's name, written as the `source` of the metadata `set` merges.
    const SOURCE: &'static str;

    /// The calls one operation of `pair` makes, on both sides (`GetItem + PutItem`).
    fn calls(pair: Pair) -> &'static str;

    /// One line on what `pair` compares.
    fn description(pair: Pair) -> &'static str;

    /// The facade side.
    fn facades(&self) -> &Facades;

    /// One operation of `pair` made by hand: how many documents it read or wrote (a listing's
    /// count is checked by the harness), or what failed.
    fn raw_op(&self, pair: Pair, input: Input) -> impl Future<Output = Result<usize, String>> + Send;

    /// The counters now.
    fn counters(&self) -> impl Future<Output = Result<Counters, String>> + Send;
}

pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("histogram bounds")
}

/// A quantile of a histogram of microseconds, in milliseconds (0 when empty).
pub fn quantile_ms(histogram: &Histogram<u64>, q: f64) -> f64 {
    if histogram.is_empty() {
        0.0
    } else {
        histogram.value_at_quantile(q) as f64 / 1000.0
    }
}

/// One side of one pair, summed over its segments.
pub struct SideResult {
    pub side: Side,
    pub ops: u64,
    pub errors: u64,
    pub warmup_errors: u64,
    pub elapsed: Duration,
    /// Latency of successful operations, in microseconds.
    pub latency: Histogram<u64>,
    pub max: Duration,
    /// Growth of [`Counters::counted`] during the timed segments.
    pub counted: u64,
    pub conflicts: u64,
    pub first_error: Option<String>,
}

impl SideResult {
    fn new(side: Side) -> Self {
        SideResult {
            side,
            ops: 0,
            errors: 0,
            warmup_errors: 0,
            elapsed: Duration::ZERO,
            latency: histogram(),
            max: Duration::ZERO,
            counted: 0,
            conflicts: 0,
            first_error: None,
        }
    }

    fn ok(&self) -> u64 {
        self.ops - self.errors
    }

    pub fn throughput(&self) -> f64 {
        if self.elapsed.is_zero() {
            0.0
        } else {
            self.ok() as f64 / self.elapsed.as_secs_f64()
        }
    }

    pub fn percentile_ms(&self, q: f64) -> f64 {
        quantile_ms(&self.latency, q)
    }

    /// The counter per operation; `None` where [`Labels::raw_only`] hides it.
    pub fn counted_per_op(&self, labels: &Labels) -> Option<f64> {
        if labels.raw_only && self.side != Side::Raw {
            None
        } else if self.ops == 0 {
            (!labels.raw_only).then_some(0.0)
        } else {
            Some(self.counted as f64 / self.ops as f64)
        }
    }

    fn add(&mut self, segment: Segment) {
        self.ops += segment.ops;
        self.errors += segment.errors;
        self.elapsed += segment.elapsed;
        self.latency.add(&segment.latency).expect("same histogram bounds");
        self.max = self.max.max(segment.max);
        if self.first_error.is_none() {
            self.first_error = segment.first_error;
        }
    }

    fn to_json(&self, labels: &Labels) -> Value {
        let mut out = json!({
            "operations": self.ops,
            "errors": self.errors,
            "warmup_errors": self.warmup_errors,
            "elapsed_s": self.elapsed.as_secs_f64(),
            "ops_per_s": self.throughput(),
            "p50_ms": self.percentile_ms(0.50),
            "p99_ms": self.percentile_ms(0.99),
            "max_ms": self.max.as_secs_f64() * 1000.0,
        });
        if let Some(key) = labels.counter_total_key {
            out[key] = json!(self.counted);
        }
        out[labels.counter_key] = json!(self.counted_per_op(labels));
        out["conflicts_retried"] =
            if labels.raw_only && self.side != Side::Raw { Value::Null } else { json!(self.conflicts) };
        out["first_error"] = json!(self.first_error);
        out
    }
}

pub struct PairResult {
    pub pair: Pair,
    pub calls: &'static str,
    pub description: &'static str,
    pub facade: SideResult,
    pub raw: SideResult,
}

impl PairResult {
    /// Facade p50 / raw p50: above 1 means the facade is slower.
    pub fn p50_ratio(&self) -> f64 {
        self.facade.percentile_ms(0.50) / self.raw.percentile_ms(0.50)
    }

    /// Raw ops/s / facade ops/s: above 1 means the facade is slower.
    pub fn throughput_ratio(&self) -> f64 {
        self.raw.throughput() / self.facade.throughput()
    }

    pub fn sides(&self) -> [&SideResult; 2] {
        [&self.facade, &self.raw]
    }

    pub fn to_json(&self, labels: &Labels) -> Value {
        let finite = |x: f64| if x.is_finite() { json!(x) } else { Value::Null };
        json!({
            "operation": self.pair.json_name(),
            labels.calls_key: self.calls,
            "description": self.description,
            "facade": self.facade.to_json(labels),
            "raw": self.raw.to_json(labels),
            "p50_ratio_facade_over_raw": finite(self.p50_ratio()),
            "throughput_ratio_raw_over_facade": finite(self.throughput_ratio()),
        })
    }
}

/// One closed-loop run of one side.
struct Segment {
    ops: u64,
    errors: u64,
    elapsed: Duration,
    latency: Histogram<u64>,
    max: Duration,
    first_error: Option<String>,
}

/// `clients` tasks each running one operation at a time until `seconds` pass or `max_ops` have
/// been started; operations in flight at the deadline are finished and counted.
async fn run_segment<B: Bench>(
    bench: &Arc<B>,
    pair: Pair,
    side: Side,
    seconds: f64,
    max_ops: u64,
    seq_base: u64,
    clients: usize,
) -> Segment {
    let issued = Arc::new(AtomicU64::new(0));
    let first_error = Arc::new(Mutex::new(None::<String>));
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(seconds);
    let mut tasks = Vec::with_capacity(clients);
    for _ in 0..clients {
        let (bench, issued, first_error) = (Arc::clone(bench), Arc::clone(&issued), Arc::clone(&first_error));
        tasks.push(tokio::spawn(async move {
            let mut latency = histogram();
            let (mut ops, mut errors, mut max) = (0u64, 0u64, Duration::ZERO);
            while Instant::now() < deadline {
                let n = issued.fetch_add(1, Ordering::Relaxed);
                if n >= max_ops {
                    break;
                }
                let input = Input::new(pair, seq_base + n, B::SOURCE);
                let listed = matches!(pair, Pair::ListKeys | Pair::GetAll).then(|| input.namespace.clone());
                let began = Instant::now();
                let outcome = match side {
                    Side::Facade => bench.facades().op(pair, input).await,
                    Side::Raw => bench.raw_op(pair, input).await,
                };
                let took = began.elapsed();
                let outcome = outcome.and_then(|found| match &listed {
                    Some(namespace) => check_listing(pair, namespace, found),
                    None => Ok(()),
                });
                ops += 1;
                match outcome {
                    Ok(()) => {
                        latency.saturating_record((took.as_micros() as u64).max(1));
                        max = max.max(took);
                    }
                    Err(message) => {
                        errors += 1;
                        first_error.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(message);
                    }
                }
            }
            (ops, errors, max, latency)
        }));
    }
    let mut segment = Segment {
        ops: 0,
        errors: 0,
        elapsed: Duration::ZERO,
        latency: histogram(),
        max: Duration::ZERO,
        first_error: None,
    };
    for task in tasks {
        let (ops, errors, max, latency) = task.await.expect("client task panicked");
        segment.ops += ops;
        segment.errors += errors;
        segment.max = segment.max.max(max);
        segment.latency.add(&latency).expect("same histogram bounds");
    }
    segment.elapsed = start.elapsed();
    segment.first_error = first_error.lock().unwrap_or_else(|e| e.into_inner()).take();
    segment
}

/// The timed segments of a pair: ABBA, BAAB, ABBA, … (facade = A), which cancels linear and
/// quadratic drift and keeps each segment short, so a burst of outside load lands on both sides
/// alike.
pub fn segment_order() -> Vec<Side> {
    let (a, b) = (Side::Facade, Side::Raw);
    (0..SEGMENTS_PER_SIDE / 2).flat_map(|round| if round % 2 == 0 { [a, b, b, a] } else { [b, a, a, b] }).collect()
}

/// Warm-up of both sides, then [`segment_order`], each segment an equal share of a side's budget.
async fn run_pair<B: Bench>(bench: &Arc<B>, pair: Pair, config: &Config) -> Result<PairResult, String> {
    let mut result = PairResult {
        pair,
        calls: B::calls(pair),
        description: B::description(pair),
        facade: SideResult::new(Side::Facade),
        raw: SideResult::new(Side::Raw),
    };
    let mut seq = 0u64;
    let warmup_ops = WARMUP_OPS_PER_CLIENT * config.clients as u64;
    for side in [Side::Facade, Side::Raw] {
        let warmup = run_segment(bench, pair, side, config.seconds, warmup_ops, seq, config.clients).await;
        seq += warmup.ops;
        let target = if side == Side::Facade { &mut result.facade } else { &mut result.raw };
        target.warmup_errors += warmup.errors;
        if target.first_error.is_none() {
            target.first_error = warmup.first_error.map(|e| format!("(warm-up) {e}"));
        }
    }
    let seconds = config.seconds / SEGMENTS_PER_SIDE as f64;
    let mut segments_done = [0u64; 2];
    for side in segment_order() {
        let (target, done) = match side {
            Side::Facade => (&mut result.facade, &mut segments_done[0]),
            Side::Raw => (&mut result.raw, &mut segments_done[1]),
        };
        // An equal share of the operations still allowed to this side.
        let max_ops = config.max_requests.saturating_sub(target.ops).div_ceil(SEGMENTS_PER_SIDE - *done);
        *done += 1;
        let before = bench.counters().await?;
        let segment = run_segment(bench, pair, side, seconds, max_ops, seq, config.clients).await;
        let after = bench.counters().await?;
        seq += segment.ops;
        target.counted += after.counted.saturating_sub(before.counted);
        target.conflicts += after.conflicts.saturating_sub(before.conflicts);
        target.add(segment);
    }
    Ok(result)
}

/// Measures each of `pairs` in turn, saying when each is done.
pub async fn run_pairs<B: Bench>(bench: &Arc<B>, pairs: &[Pair], config: &Config) -> Result<Vec<PairResult>, String> {
    let mut results = Vec::with_capacity(pairs.len());
    for &pair in pairs {
        let started = Instant::now();
        let result = run_pair(bench, pair, config).await?;
        println!("  {:<10} done in {:.2} s: {}", pair.name(), started.elapsed().as_secs_f64(), result.description);
        results.push(result);
    }
    Ok(results)
}

/// Prints every side that failed or never ran; true when none did.
pub fn report_failures(name: &str, results: &[PairResult]) -> bool {
    let mut passed = true;
    for r in results {
        for side in r.sides() {
            if side.errors + side.warmup_errors > 0 || side.ops == 0 {
                passed = false;
                eprintln!(
                    "{name}: {} {}: {} errors in {} operations (+{} in warm-up); first: {}",
                    r.pair.name(),
                    side.side.name(),
                    side.errors,
                    side.ops,
                    side.warmup_errors,
                    side.first_error.as_deref().unwrap_or("none run")
                );
            }
        }
    }
    passed
}
