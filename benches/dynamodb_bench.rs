//! Overhead and throughput of the DynamoDB adapter: the `DataStore` facade over `DynamoDbBackend`
//! against the raw AWS SDK calls it makes, side by side in one run, plus bulk-write throughput.
//!
//! Run it with `cargo bench --bench dynamodb_bench`. The server is
//! `AGENTSTORE_BENCH_DYNAMODB_ENDPOINT` (e.g. `http://127.0.0.1:8000`) when set; otherwise
//! `dynalite` from `node_modules` (installed by `npm ci`) is started in memory on a free port with
//! `--createTableMs 0 --deleteTableMs 0 --updateTableMs 0` by the tests' launcher
//! (`tests/common/servers.rs`), which stops it when the bench process exits. Dummy credentials (`AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY` = `test`) and
//! `AWS_REGION=us-east-1` are put in the environment, when not already set, before the SDK loads.
//! Which server answered is printed.
//!
//! The bench opens the adapter on a fresh table (`create=true`), seeds 1,000 documents (1 user ×
//! 10 namespaces × 100 keys) with the adapter's `bulk_write` and the facade's document bodies, then
//! makes one warm-up `set` per namespace through the facade (none of this is timed). Then it
//! measures five pairs:
//!
//! | pair        | facade                                             | raw (`backend.client()` by hand)                          |
//! |-------------|----------------------------------------------------|-----------------------------------------------------------|
//! | `get`       | `DataStore::get`, `track_reads=false`: one GetItem | GetItem, consistent read                                  |
//! | `get+track` | `DataStore::get`, access tracking                  | GetItem, bump `accessCount`, PutItem `#rev = :rev`        |
//! | `set`       | `DataStore::set` of an existing key                | GetItem, replace value, merge metadata, PutItem `#rev = :rev` |
//! | `list_keys` | `DataStore::list_keys`, 100 keys                   | Query on `idx-user-namespace`, same key condition/projection |
//! | `get_all`   | `DataStore::get_all`, same namespace, full items   | Query on `idx-user-namespace`, no projection, same limit  |
//!
//! The raw side uses the adapter's own SDK client (`DynamoDbBackend::client()`), so both sides share
//! the connection pool, retry and timeout settings; the difference is the facade and adapter code:
//! validation, id building, item encoding/decoding, error mapping, retry wrappers. Listings follow
//! `LastEvaluatedKey` on both sides. Every phase is a closed loop of `BENCH_CLIENTS` (default 8)
//! concurrent tasks; each side of a pair is bounded by `BENCH_SECONDS` (default 3) and
//! `BENCH_MAX_REQUESTS` (default 5,000) in total, split over eight segments run alternately as
//! ABBA BAAB ABBA BAAB (A = facade) after an untimed warm-up of both sides. Latency is wall-clock
//! around one whole operation (inputs are built before the clock starts); throughput is successful
//! operations over the side's summed segment time. The raw side retries a failed condition at once
//! (the facade with backoff), counted as `conflicts_retried`; `calls/op` is the raw side's SDK calls
//! per operation (the facade makes the same requests).
//!
//! Then bulk writes: `BENCH_BULK_DOCS` (default 5,000) fresh documents through
//! `DocumentBackend::bulk_write` in batches of 100 from 4 concurrent callers, once with
//! `Precondition::None` (BatchWriteItem, 25 items a call) and once with `Precondition::MustNotExist`
//! (one conditional PutItem per document), in documents per second.
//! Afterwards (not timed) a consistent Scan counts the documents in the table (the authority: a
//! shortfall is an error) and `DataStore::list_keys` lists the namespace, shown next to it; on
//! dynalite 4.0.0 the paged GSI Query (1,000 per page) returns 4,999 of 5,000, which is printed as a
//! note, not counted as an error.
//!
//! Results go to stdout as tables and to `target/bench/dynamodb_bench.json`. Any failed operation
//! (warm-up included) makes the bench exit 1. The table is deleted at the end (best effort).
//!
//! `cargo test --all-targets` also builds and runs this target (without `--bench`); it then only
//! prints how to run it and exits 0.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, Hasher};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentstore::backend::dynamodb::{DynamoConfig, DynamoDbBackend};
use agentstore::backend::{BulkWrite, DocumentBackend, Precondition};
use agentstore::model::document::{new_body, Access};
use agentstore::model::{id::encode_key, timestamp, DocumentId, Limits};
use agentstore::store::{DataStore, StoreOptions};
use aws_sdk_dynamodb::error::DisplayErrorContext;
use aws_sdk_dynamodb::types::{AttributeValue, ReturnValue};
use hdrhistogram::Histogram;
use serde_json::{json, Map, Value};

#[allow(dead_code)]
#[path = "../tests/common/servers.rs"]
mod servers;

const USER: &str = "bench-user";
const NAMESPACES: usize = 10;
const KEYS_PER_NAMESPACE: usize = 100;
const TOTAL_KEYS: usize = NAMESPACES * KEYS_PER_NAMESPACE;
const AGENT: &str = "bench-agent";
/// The adapter's GSI (default `index=` of the backend URL).
const INDEX: &str = "idx-user-namespace";
/// How often the raw side re-reads after a failed condition, as the facade's default
/// `max_conflict_retries`.
const RAW_CONFLICT_RETRIES: usize = 100;
/// Untimed operations per client and side before a pair is measured.
const WARMUP_OPS_PER_CLIENT: u64 = 5;
/// `DataStore::get_all` asks for pages of at most this many documents.
const GET_ALL_PAGE_SIZE: usize = 100;
/// Bulk phase: documents per `bulk_write` call and concurrent callers.
const BULK_BATCH: usize = 100;
const BULK_CALLERS: usize = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pair {
    Get,
    GetTracked,
    Set,
    ListKeys,
    GetAll,
}

impl Pair {
    const ALL: [Pair; 5] = [Pair::Get, Pair::GetTracked, Pair::Set, Pair::ListKeys, Pair::GetAll];

    fn name(self) -> &'static str {
        match self {
            Pair::Get => "get",
            Pair::GetTracked => "get+track",
            Pair::Set => "set",
            Pair::ListKeys => "list_keys",
            Pair::GetAll => "get_all",
        }
    }

    fn json_name(self) -> &'static str {
        match self {
            Pair::Get => "get_untracked",
            Pair::GetTracked => "get_tracked",
            Pair::Set => "set_update",
            Pair::ListKeys => "list_keys",
            Pair::GetAll => "get_all",
        }
    }

    /// The SDK calls one operation makes, on both sides.
    fn calls(self) -> &'static str {
        match self {
            Pair::Get => "GetItem",
            Pair::GetTracked | Pair::Set => "GetItem + PutItem",
            Pair::ListKeys | Pair::GetAll => "Query (GSI)",
        }
    }

    fn description(self) -> &'static str {
        match self {
            Pair::Get => "facade get with track_reads=false (one consistent GetItem) vs raw GetItem",
            Pair::GetTracked => {
                "facade get with access tracking (GetItem + PutItem if #rev = :rev) vs raw GetItem + the same PutItem"
            }
            Pair::Set => {
                "facade set of an existing key (GetItem + conditional PutItem) vs raw GetItem + the same PutItem"
            }
            Pair::ListKeys => {
                "facade list_keys of a 100-key namespace (Query on the GSI, projection _id/_rev/key, limit 1000) vs \
                 raw Query, same request"
            }
            Pair::GetAll => {
                "facade get_all of a 100-key namespace (Query on the GSI, full items, limit 100, pages followed) vs \
                 raw Query, same request"
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Facade,
    Raw,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Facade => "facade",
            Side::Raw => "raw",
        }
    }
}

struct Config {
    clients: usize,
    seconds: f64,
    max_requests: u64,
    bulk_docs: usize,
}

impl Config {
    fn from_env() -> Result<Self, String> {
        fn var<T: std::str::FromStr>(name: &str, default: T) -> Result<T, String> {
            match std::env::var(name) {
                Ok(text) if !text.trim().is_empty() => {
                    text.trim().parse().map_err(|_| format!("{name}={text:?} is not a valid number"))
                }
                _ => Ok(default),
            }
        }
        let config = Config {
            clients: var("BENCH_CLIENTS", 8usize)?,
            seconds: var("BENCH_SECONDS", 3.0f64)?,
            max_requests: var("BENCH_MAX_REQUESTS", 5_000u64)?,
            bulk_docs: var("BENCH_BULK_DOCS", 5_000usize)?,
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
        if config.bulk_docs == 0 {
            return Err("BENCH_BULK_DOCS must be at least 1".into());
        }
        Ok(config)
    }
}

/// An error and its sources, on one line.
fn describe(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

// ---- the two sides ----

/// Everything the operations need, shared by the client tasks.
struct Ctx {
    /// `track_reads=false`: `get` is exactly one GetItem.
    untracked: DataStore,
    /// Default options: `get` counts an access (GetItem + PutItem); also used for `set`.
    tracked: DataStore,
    raw: Raw,
}

type Item = HashMap<String, AttributeValue>;

/// The raw side: the adapter's own SDK client, requests built by hand.
struct Raw {
    client: aws_sdk_dynamodb::Client,
    table: String,
    /// The Query limit the facade sends for `list_keys`: its page size.
    list_limit: i32,
    /// The Query limit the facade sends for `get_all`.
    get_all_limit: i32,
    /// Failed conditions the raw side retried.
    conflicts: AtomicU64,
    /// SDK calls the raw side made.
    calls: AtomicU64,
}

fn s(text: &str) -> AttributeValue {
    AttributeValue::S(text.to_owned())
}

/// JSON to a native attribute, as a hand-written client would.
fn to_attr(value: &Value) -> AttributeValue {
    match value {
        Value::Null => AttributeValue::Null(true),
        Value::Bool(b) => AttributeValue::Bool(*b),
        Value::Number(n) => AttributeValue::N(n.to_string()),
        Value::String(text) => AttributeValue::S(text.clone()),
        Value::Array(items) => AttributeValue::L(items.iter().map(to_attr).collect()),
        Value::Object(map) => AttributeValue::M(map.iter().map(|(k, v)| (k.clone(), to_attr(v))).collect()),
    }
}

/// A native attribute back to JSON (the types `to_attr` writes).
fn from_attr(value: &AttributeValue) -> Value {
    match value {
        AttributeValue::Bool(b) => Value::Bool(*b),
        AttributeValue::N(text) => serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.clone())),
        AttributeValue::S(text) => Value::String(text.clone()),
        AttributeValue::L(items) => Value::Array(items.iter().map(from_attr).collect()),
        AttributeValue::M(map) => Value::Object(map.iter().map(|(k, v)| (k.clone(), from_attr(v))).collect()),
        _ => Value::Null,
    }
}

/// A fresh revision in the adapter's format: generation and 64 random bits.
fn next_revision(previous: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let generation = previous.split('-').next().and_then(|g| g.parse::<u64>().ok()).unwrap_or(0) + 1;
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    format!("{generation}-{:016x}", hasher.finish())
}

impl Raw {
    async fn get(&self, id: &str) -> Result<Item, String> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let output = self
            .client
            .get_item()
            .table_name(&self.table)
            .key("_id", s(id))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| format!("raw GetItem {id}: {}", DisplayErrorContext(&e)))?;
        match output.item {
            Some(item) if matches!(item.get("_rev"), Some(AttributeValue::S(_))) => Ok(item),
            Some(_) => Err(format!("raw GetItem {id}: an item without a string _rev")),
            None => Err(format!("raw GetItem {id}: missing")),
        }
    }

    /// GetItem, change the item, PutItem it back if `_rev` is unchanged; a failed condition starts
    /// again.
    async fn read_modify_write(&self, id: &str, change: impl Fn(&mut Item)) -> Result<(), String> {
        for _ in 0..=RAW_CONFLICT_RETRIES {
            let mut item = self.get(id).await?;
            let Some(AttributeValue::S(rev)) = item.get("_rev").cloned() else { unreachable!("checked by get") };
            change(&mut item);
            item.insert("_rev".into(), AttributeValue::S(next_revision(&rev)));
            self.calls.fetch_add(1, Ordering::Relaxed);
            let result = self
                .client
                .put_item()
                .table_name(&self.table)
                .set_item(Some(item))
                .return_values(ReturnValue::AllOld)
                .condition_expression("#rev = :rev")
                .expression_attribute_names("#rev", "_rev")
                .expression_attribute_values(":rev", AttributeValue::S(rev))
                .send()
                .await;
            match result {
                Ok(_) => return Ok(()),
                Err(e) if e.as_service_error().is_some_and(|e| e.is_conditional_check_failed_exception()) => {
                    self.conflicts.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => return Err(format!("raw PutItem {id}: {}", DisplayErrorContext(&e))),
            }
        }
        Err(format!("raw PutItem {id}: still conflicting after {RAW_CONFLICT_RETRIES} retries"))
    }

    /// Every item of the namespace through the GSI, following `LastEvaluatedKey`; projected to
    /// `_id`, `_rev`, `key` as the adapter does for `list_keys`.
    async fn query_namespace(&self, namespace: &str, projected: bool) -> Result<Vec<Item>, String> {
        let mut items = Vec::new();
        let mut start: Option<Item> = None;
        loop {
            let mut request = self
                .client
                .query()
                .table_name(&self.table)
                .index_name(INDEX)
                .limit(if projected { self.list_limit } else { self.get_all_limit })
                .expression_attribute_names("#u", "userId")
                .expression_attribute_values(":u", s(USER))
                .key_condition_expression("#u = :u AND #n = :n")
                .expression_attribute_names("#n", "namespace")
                .expression_attribute_values(":n", s(namespace));
            if projected {
                request = request
                    .projection_expression("#pid, #prev, #p0")
                    .expression_attribute_names("#pid", "_id")
                    .expression_attribute_names("#prev", "_rev")
                    .expression_attribute_names("#p0", "key");
            }
            self.calls.fetch_add(1, Ordering::Relaxed);
            let output = request
                .set_exclusive_start_key(start.take())
                .send()
                .await
                .map_err(|e| format!("raw Query {namespace}: {}", DisplayErrorContext(&e)))?;
            items.extend(output.items.unwrap_or_default());
            match output.last_evaluated_key {
                Some(key) if !key.is_empty() => start = Some(key),
                _ => return Ok(items),
            }
        }
    }

    /// Main items of the namespace, by a consistent Scan of the whole table (verification only).
    async fn count_in_table(&self, namespace: &str) -> Result<usize, String> {
        let (mut count, mut start) = (0, None);
        loop {
            let output = self
                .client
                .scan()
                .table_name(&self.table)
                .consistent_read(true)
                .set_exclusive_start_key(start.take())
                .send()
                .await
                .map_err(|e| format!("raw Scan: {}", DisplayErrorContext(&e)))?;
            count += output
                .items()
                .iter()
                .filter(|item| matches!(item.get("namespace"), Some(AttributeValue::S(ns)) if ns == namespace))
                .count();
            match output.last_evaluated_key {
                Some(key) if !key.is_empty() => start = Some(key),
                _ => return Ok(count),
            }
        }
    }

    async fn list_keys(&self, namespace: &str) -> Result<Vec<String>, String> {
        let items = self.query_namespace(namespace, true).await?;
        let mut keys = items
            .iter()
            .map(|item| match item.get("key") {
                Some(AttributeValue::S(key)) => Some(key.clone()),
                _ => None,
            })
            .collect::<Option<Vec<String>>>()
            .ok_or_else(|| format!("raw Query {namespace}: an item without a key"))?;
        keys.sort_unstable();
        Ok(keys)
    }

    async fn get_all(&self, namespace: &str) -> Result<Vec<(String, Value)>, String> {
        let items = self.query_namespace(namespace, false).await?;
        let mut entries = items
            .iter()
            .map(|item| match item.get("key") {
                Some(AttributeValue::S(key)) => {
                    Some((key.clone(), item.get("value").map(from_attr).unwrap_or(Value::Null)))
                }
                _ => None,
            })
            .collect::<Option<Vec<(String, Value)>>>()
            .ok_or_else(|| format!("raw Query {namespace}: an item without a key"))?;
        entries.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        Ok(entries)
    }
}

/// The `i`-th seeded document: (namespace, key).
fn document(i: usize) -> (String, String) {
    let i = i % TOTAL_KEYS;
    (format!("ns-{}", i / KEYS_PER_NAMESPACE), format!("key-{:03}", i % KEYS_PER_NAMESPACE))
}

/// The `seq`-th operation's document: a fixed permutation of the key space, so concurrent clients
/// touch different documents.
fn spread(seq: u64) -> usize {
    // 7919 is prime and coprime with 1000, so this visits every key once per 1000 operations.
    ((seq % TOTAL_KEYS as u64) * 7919 % TOTAL_KEYS as u64) as usize
}

/// A value of about 100 bytes of compact JSON.
fn value(seq: u64) -> Value {
    json!({ "text": "the quick brown fox jumps over the lazy dog", "seq": seq, "tags": ["bench", "overhead"], "ok": true })
}

fn metadata(seq: u64) -> Value {
    json!({ "source": "dynamodb_bench", "seq": seq })
}

/// What one operation works on, built before its clock starts.
struct Input {
    namespace: String,
    key: String,
    /// The document id (`user:namespace:base64url(key)`), for the raw side.
    id: String,
    value: Value,
    metadata: Value,
}

impl Input {
    fn new(pair: Pair, seq: u64) -> Input {
        let (namespace, key) = match pair {
            Pair::ListKeys | Pair::GetAll => (format!("ns-{}", seq % NAMESPACES as u64), String::new()),
            _ => document(spread(seq)),
        };
        let id = format!("{USER}:{namespace}:{}", encode_key(&key));
        let (value, metadata) = match pair {
            Pair::Set => (value(seq), metadata(seq)),
            _ => (Value::Null, Value::Null),
        };
        Input { namespace, key, id, value, metadata }
    }
}

async fn facade_op(ctx: &Ctx, pair: Pair, input: Input) -> Result<(), String> {
    let Input { namespace, key, value, metadata, .. } = input;
    let fail = |e: agentstore::Error| format!("facade {} {namespace}/{key}: {}", pair.name(), describe(&e));
    match pair {
        Pair::Get | Pair::GetTracked => {
            let store = if pair == Pair::Get { &ctx.untracked } else { &ctx.tracked };
            match store.get(USER, &namespace, &key, Some(AGENT)).await.map_err(fail)? {
                Some(_) => Ok(()),
                None => Err(format!("facade {}: {namespace}/{key} is missing", pair.name())),
            }
        }
        Pair::Set => {
            ctx.tracked.set(USER, &namespace, &key, value, Some(metadata), Some(AGENT)).await.map_err(fail)?;
            Ok(())
        }
        Pair::ListKeys => {
            let keys = ctx.untracked.list_keys(USER, &namespace).await.map_err(fail)?;
            check_listing(pair, &namespace, keys.len())
        }
        Pair::GetAll => {
            let entries = ctx.untracked.get_all(USER, &namespace).await.map_err(fail)?;
            check_listing(pair, &namespace, entries.len())
        }
    }
}

async fn raw_op(raw: &Raw, pair: Pair, input: Input) -> Result<(), String> {
    let Input { namespace, id, value, metadata, .. } = input;
    match pair {
        Pair::Get => raw.get(&id).await.map(|_| ()),
        Pair::GetTracked => {
            raw.read_modify_write(&id, |item| {
                let count = match item.get("accessCount") {
                    Some(AttributeValue::N(n)) => n.parse::<u64>().unwrap_or(0),
                    _ => 0,
                };
                item.insert("accessCount".into(), AttributeValue::N((count + 1).to_string()));
                item.insert("lastAccessedAt".into(), AttributeValue::S(timestamp::now()));
                item.insert("lastAccessedByAgent".into(), s(AGENT));
            })
            .await
        }
        Pair::Set => {
            raw.read_modify_write(&id, |item| {
                let now = timestamp::now();
                item.insert("value".into(), to_attr(&value));
                match (item.get_mut("metadata"), &metadata) {
                    (Some(AttributeValue::M(stored)), Value::Object(update)) => {
                        stored.extend(update.iter().map(|(k, v)| (k.clone(), to_attr(v))))
                    }
                    _ => {
                        item.insert("metadata".into(), to_attr(&metadata));
                    }
                }
                let count = match item.get("accessCount") {
                    Some(AttributeValue::N(n)) => n.parse::<u64>().unwrap_or(0),
                    _ => 0,
                };
                item.insert("accessCount".into(), AttributeValue::N((count + 1).to_string()));
                item.insert("updatedAt".into(), AttributeValue::S(now.clone()));
                item.insert("lastAccessedAt".into(), AttributeValue::S(now));
                item.insert("lastAccessedByAgent".into(), s(AGENT));
            })
            .await
        }
        Pair::ListKeys => {
            let keys = raw.list_keys(&namespace).await?;
            check_listing(pair, &namespace, keys.len())
        }
        Pair::GetAll => {
            let entries = raw.get_all(&namespace).await?;
            check_listing(pair, &namespace, entries.len())
        }
    }
}

fn check_listing(pair: Pair, namespace: &str, found: usize) -> Result<(), String> {
    if found == KEYS_PER_NAMESPACE {
        Ok(())
    } else {
        Err(format!("{} of {namespace} found {found} documents, expected {KEYS_PER_NAMESPACE}", pair.name()))
    }
}

async fn op(ctx: &Ctx, pair: Pair, side: Side, input: Input) -> Result<(), String> {
    match side {
        Side::Facade => facade_op(ctx, pair, input).await,
        Side::Raw => raw_op(&ctx.raw, pair, input).await,
    }
}

// ---- the load ----

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("histogram bounds")
}

fn quantile_ms(histogram: &Histogram<u64>, q: f64) -> f64 {
    if histogram.is_empty() {
        0.0
    } else {
        histogram.value_at_quantile(q) as f64 / 1000.0
    }
}

/// One side of one pair, summed over its segments.
struct SideResult {
    side: Side,
    ops: u64,
    errors: u64,
    warmup_errors: u64,
    elapsed: Duration,
    /// Latency of successful operations, in microseconds.
    latency: Histogram<u64>,
    max: Duration,
    /// Raw side: SDK calls made during the timed segments.
    calls: u64,
    conflicts: u64,
    first_error: Option<String>,
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
            calls: 0,
            conflicts: 0,
            first_error: None,
        }
    }

    fn ok(&self) -> u64 {
        self.ops - self.errors
    }

    fn throughput(&self) -> f64 {
        if self.elapsed.is_zero() {
            0.0
        } else {
            self.ok() as f64 / self.elapsed.as_secs_f64()
        }
    }

    fn percentile_ms(&self, q: f64) -> f64 {
        quantile_ms(&self.latency, q)
    }

    fn calls_per_op(&self) -> Option<f64> {
        (self.side == Side::Raw && self.ops > 0).then(|| self.calls as f64 / self.ops as f64)
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

    fn to_json(&self) -> Value {
        json!({
            "operations": self.ops,
            "errors": self.errors,
            "warmup_errors": self.warmup_errors,
            "elapsed_s": self.elapsed.as_secs_f64(),
            "ops_per_s": self.throughput(),
            "p50_ms": self.percentile_ms(0.50),
            "p99_ms": self.percentile_ms(0.99),
            "max_ms": self.max.as_secs_f64() * 1000.0,
            "sdk_calls_per_op": self.calls_per_op(),
            "conflicts_retried": if self.side == Side::Raw { json!(self.conflicts) } else { Value::Null },
            "first_error": self.first_error,
        })
    }
}

struct PairResult {
    pair: Pair,
    facade: SideResult,
    raw: SideResult,
}

impl PairResult {
    /// Facade p50 / raw p50: above 1 means the facade is slower.
    fn p50_ratio(&self) -> f64 {
        self.facade.percentile_ms(0.50) / self.raw.percentile_ms(0.50)
    }

    /// Raw ops/s / facade ops/s: above 1 means the facade is slower.
    fn throughput_ratio(&self) -> f64 {
        self.raw.throughput() / self.facade.throughput()
    }

    fn errors(&self) -> u64 {
        [&self.facade, &self.raw].iter().map(|s| s.errors + s.warmup_errors).sum()
    }

    fn to_json(&self) -> Value {
        let finite = |x: f64| if x.is_finite() { json!(x) } else { Value::Null };
        json!({
            "operation": self.pair.json_name(),
            "sdk_calls": self.pair.calls(),
            "description": self.pair.description(),
            "facade": self.facade.to_json(),
            "raw": self.raw.to_json(),
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
async fn run_segment(
    ctx: &Arc<Ctx>,
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
        let (ctx, issued, first_error) = (Arc::clone(ctx), Arc::clone(&issued), Arc::clone(&first_error));
        tasks.push(tokio::spawn(async move {
            let mut latency = histogram();
            let (mut ops, mut errors, mut max) = (0u64, 0u64, Duration::ZERO);
            while Instant::now() < deadline {
                let n = issued.fetch_add(1, Ordering::Relaxed);
                if n >= max_ops {
                    break;
                }
                let input = Input::new(pair, seq_base + n);
                let began = Instant::now();
                let outcome = op(&ctx, pair, side, input).await;
                let took = began.elapsed();
                ops += 1;
                match outcome {
                    Ok(()) => {
                        latency.saturating_record((took.as_micros() as u64).max(1));
                        max = max.max(took);
                    }
                    Err(message) => {
                        errors += 1;
                        first_error.lock().unwrap().get_or_insert(message);
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
    segment.first_error = first_error.lock().unwrap().take();
    segment
}

/// How many timed segments each side of a pair gets (even).
const SEGMENTS_PER_SIDE: u64 = 8;

/// The timed segments of a pair: ABBA, BAAB, ABBA, … (facade = A), which cancels linear and
/// quadratic drift and keeps each segment short, so a burst of outside load lands on both sides
/// alike.
fn segment_order() -> Vec<Side> {
    let (a, b) = (Side::Facade, Side::Raw);
    (0..SEGMENTS_PER_SIDE / 2).flat_map(|round| if round % 2 == 0 { [a, b, b, a] } else { [b, a, a, b] }).collect()
}

/// Warm-up of both sides, then [`segment_order`], each segment an equal share of a side's budget.
async fn run_pair(ctx: &Arc<Ctx>, pair: Pair, config: &Config) -> PairResult {
    let mut result = PairResult { pair, facade: SideResult::new(Side::Facade), raw: SideResult::new(Side::Raw) };
    let mut seq = 0u64;
    let warmup_ops = WARMUP_OPS_PER_CLIENT * config.clients as u64;
    for side in [Side::Facade, Side::Raw] {
        let warmup = run_segment(ctx, pair, side, config.seconds, warmup_ops, seq, config.clients).await;
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
        let calls_before = ctx.raw.calls.load(Ordering::Relaxed);
        let conflicts_before = ctx.raw.conflicts.load(Ordering::Relaxed);
        let segment = run_segment(ctx, pair, side, seconds, max_ops, seq, config.clients).await;
        seq += segment.ops;
        target.calls += ctx.raw.calls.load(Ordering::Relaxed) - calls_before;
        target.conflicts += ctx.raw.conflicts.load(Ordering::Relaxed) - conflicts_before;
        target.add(segment);
    }
    result
}

/// A document body as the facade writes it on creation.
fn body(namespace: &str, key: &str, seq: u64, limits: &Limits) -> Result<(String, Map<String, Value>), String> {
    let id = DocumentId::new(USER, namespace, key, limits).map_err(|e| describe(&e))?;
    let Value::Object(metadata) = metadata(seq) else { unreachable!("metadata is an object") };
    let access = Access { agent: Some(AGENT), at: timestamp::now() };
    let body = new_body(&id, value(seq), Some(metadata), &access);
    Ok((id.as_str().to_owned(), body))
}

/// Seeds every document through the adapter's `bulk_write` (BatchWriteItem), one call per
/// namespace, with the bodies the facade writes (not timed). Then one warm-up `set` per namespace
/// through the facade, so its once-per-namespace ensure call is never timed.
async fn seed(backend: &Arc<dyn DocumentBackend>, store: &DataStore) -> Result<(), String> {
    let limits = Limits::default();
    for ns in 0..NAMESPACES {
        let mut writes = Vec::with_capacity(KEYS_PER_NAMESPACE);
        for i in ns * KEYS_PER_NAMESPACE..(ns + 1) * KEYS_PER_NAMESPACE {
            let (namespace, key) = document(i);
            let (id, body) = body(&namespace, &key, i as u64, &limits)?;
            writes.push(BulkWrite { id, body, precondition: Precondition::None });
        }
        let results = backend.bulk_write(writes).await.map_err(|e| format!("seeding ns-{ns}: {}", describe(&e)))?;
        if let Some(Err(e)) = results.into_iter().find(Result::is_err) {
            return Err(format!("seeding ns-{ns}: {}", describe(&e)));
        }
    }
    for ns in 0..NAMESPACES {
        let (namespace, key) = document(ns * KEYS_PER_NAMESPACE);
        store
            .set(USER, &namespace, &key, value(0), Some(metadata(0)), Some(AGENT))
            .await
            .map_err(|e| format!("warm-up write to {namespace}/{key}: {}", describe(&e)))?;
    }
    Ok(())
}

// ---- bulk writes ----

struct BulkResult {
    label: &'static str,
    precondition: &'static str,
    sdk_calls: &'static str,
    docs: usize,
    batches: usize,
    errors: u64,
    first_error: Option<String>,
    elapsed: Duration,
    /// Latency of one `bulk_write` call, in microseconds.
    latency: Histogram<u64>,
    /// Documents a consistent Scan finds in the namespace afterwards.
    verified: usize,
    /// Keys `DataStore::list_keys` (GSI Query, pages followed) returns for the namespace afterwards.
    listed: usize,
}

impl BulkResult {
    fn docs_per_s(&self) -> f64 {
        let written = self.docs as u64 - self.errors;
        if self.elapsed.is_zero() {
            0.0
        } else {
            written as f64 / self.elapsed.as_secs_f64()
        }
    }

    fn to_json(&self) -> Value {
        json!({
            "operation": self.label,
            "precondition": self.precondition,
            "sdk_calls": self.sdk_calls,
            "documents": self.docs,
            "batch_size": BULK_BATCH,
            "batches": self.batches,
            "concurrent_callers": BULK_CALLERS,
            "errors": self.errors,
            "elapsed_s": self.elapsed.as_secs_f64(),
            "docs_per_s": self.docs_per_s(),
            "batch_p50_ms": quantile_ms(&self.latency, 0.50),
            "batch_p99_ms": quantile_ms(&self.latency, 0.99),
            "documents_in_table_after": self.verified,
            "facade_list_keys_after": self.listed,
            "first_error": self.first_error,
        })
    }
}

/// `docs` fresh documents in a namespace of their own, through `bulk_write` in batches of
/// [`BULK_BATCH`] from [`BULK_CALLERS`] concurrent tasks. Bodies are built before the clock starts.
async fn bulk_phase(
    backend: &Arc<dyn DocumentBackend>,
    raw: &Raw,
    store: &DataStore,
    precondition: Precondition,
    docs: usize,
) -> Result<BulkResult, String> {
    let (label, precondition_name, namespace, sdk_calls) = match precondition {
        Precondition::None => ("bulk_write", "None", "bulk-none", "BatchWriteItem x25"),
        Precondition::MustNotExist => ("bulk_write", "MustNotExist", "bulk-must-not-exist", "conditional PutItem x1"),
        Precondition::MatchRevision(_) => unreachable!("not benchmarked"),
    };
    let limits = Limits::default();
    let mut queue = VecDeque::new();
    let mut batch = Vec::with_capacity(BULK_BATCH);
    for i in 0..docs {
        let (id, body) = body(namespace, &format!("doc-{i:06}"), i as u64, &limits)?;
        batch.push(BulkWrite { id, body, precondition: precondition.clone() });
        if batch.len() == BULK_BATCH {
            queue.push_back(std::mem::take(&mut batch));
        }
    }
    if !batch.is_empty() {
        queue.push_back(batch);
    }
    let batches = queue.len();
    let queue = Arc::new(Mutex::new(queue));
    let first_error = Arc::new(Mutex::new(None::<String>));
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(BULK_CALLERS);
    for _ in 0..BULK_CALLERS {
        let (backend, queue, first_error) = (Arc::clone(backend), Arc::clone(&queue), Arc::clone(&first_error));
        tasks.push(tokio::spawn(async move {
            let mut latency = histogram();
            let mut errors = 0u64;
            loop {
                let Some(batch) = queue.lock().unwrap().pop_front() else { break };
                let size = batch.len() as u64;
                let began = Instant::now();
                match backend.bulk_write(batch).await {
                    Ok(results) => {
                        latency.saturating_record((began.elapsed().as_micros() as u64).max(1));
                        for result in results {
                            if let Err(e) = result {
                                errors += 1;
                                first_error.lock().unwrap().get_or_insert_with(|| describe(&e));
                            }
                        }
                    }
                    Err(e) => {
                        errors += size;
                        first_error.lock().unwrap().get_or_insert_with(|| describe(&e));
                    }
                }
            }
            (errors, latency)
        }));
    }
    let mut result = BulkResult {
        label,
        precondition: precondition_name,
        sdk_calls,
        docs,
        batches,
        errors: 0,
        first_error: None,
        elapsed: Duration::ZERO,
        latency: histogram(),
        verified: 0,
        listed: 0,
    };
    for task in tasks {
        let (errors, latency) = task.await.expect("bulk caller panicked");
        result.errors += errors;
        result.latency.add(&latency).expect("same histogram bounds");
    }
    result.elapsed = started.elapsed();
    result.first_error = first_error.lock().unwrap().take();
    // Not timed: every written document must be in the table (a consistent Scan is the authority);
    // what the GSI listing shows is recorded next to it.
    result.verified = raw.count_in_table(namespace).await?;
    result.listed = store.list_keys(USER, namespace).await.map_err(|e| describe(&e))?.len();
    if result.verified != docs && result.first_error.is_none() {
        result.errors += docs.abs_diff(result.verified) as u64;
        result.first_error =
            Some(format!("{namespace}: the table holds {} documents after writing {docs}", result.verified));
    }
    Ok(result)
}

// ---- reporting ----

fn aligned(header: &[&str], rows: &[Vec<String>], left: usize) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.len());
        }
    }
    let line = |cells: &[&str]| -> String {
        let mut out = String::new();
        for (i, (cell, width)) in cells.iter().zip(&widths).enumerate() {
            let width = *width;
            if i < left {
                out.push_str(&format!("{cell:<width$}  "));
            } else {
                out.push_str(&format!("{cell:>width$}  "));
            }
        }
        out.truncate(out.trim_end().len());
        out.push('\n');
        out
    };
    let mut out = line(header);
    out.push_str(&line(
        &widths.iter().map(|w| "-".repeat(*w)).collect::<Vec<_>>().iter().map(String::as_str).collect::<Vec<_>>(),
    ));
    for row in rows {
        out.push_str(&line(&row.iter().map(String::as_str).collect::<Vec<_>>()));
    }
    out
}

fn pair_table(results: &[PairResult]) -> String {
    let header = [
        "operation",
        "side",
        "SDK calls",
        "ops",
        "errors",
        "ops/s",
        "p50 ms",
        "p99 ms",
        "calls/op",
        "p50 ratio",
        "ops/s ratio",
    ];
    let mut rows = Vec::new();
    for r in results {
        for side in [&r.facade, &r.raw] {
            let facade = side.side == Side::Facade;
            rows.push(vec![
                if facade { r.pair.name().to_owned() } else { String::new() },
                side.side.name().to_owned(),
                r.pair.calls().to_owned(),
                side.ops.to_string(),
                (side.errors + side.warmup_errors).to_string(),
                format!("{:.0}", side.throughput()),
                format!("{:.3}", side.percentile_ms(0.50)),
                format!("{:.3}", side.percentile_ms(0.99)),
                side.calls_per_op().map(|c| format!("{c:.2}")).unwrap_or_else(|| "-".into()),
                if facade { format!("{:.3}x", r.p50_ratio()) } else { String::new() },
                if facade { format!("{:.3}x", r.throughput_ratio()) } else { String::new() },
            ]);
        }
    }
    aligned(&header, &rows, 3)
}

fn bulk_table(results: &[BulkResult]) -> String {
    let header = [
        "operation",
        "precondition",
        "SDK calls",
        "docs",
        "batches",
        "callers",
        "errors",
        "seconds",
        "docs/s",
        "batch p50 ms",
        "batch p99 ms",
        "in table",
        "listed",
    ];
    let rows: Vec<Vec<String>> = results
        .iter()
        .map(|r| {
            vec![
                r.label.to_owned(),
                r.precondition.to_owned(),
                r.sdk_calls.to_owned(),
                r.docs.to_string(),
                r.batches.to_string(),
                BULK_CALLERS.to_string(),
                r.errors.to_string(),
                format!("{:.2}", r.elapsed.as_secs_f64()),
                format!("{:.0}", r.docs_per_s()),
                format!("{:.1}", quantile_ms(&r.latency, 0.50)),
                format!("{:.1}", quantile_ms(&r.latency, 0.99)),
                r.verified.to_string(),
                r.listed.to_string(),
            ]
        })
        .collect();
    aligned(&header, &rows, 3)
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"))
}

fn main() -> ExitCode {
    // `cargo bench` passes `--bench`; `cargo test --all-targets` runs this target without it.
    if !std::env::args().skip(1).any(|a| a == "--bench") {
        println!("dynamodb_bench: run with `cargo bench --bench dynamodb_bench`");
        return ExitCode::SUCCESS;
    }
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(message) => {
            eprintln!("dynamodb_bench: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the benchmark; Ok(false) when any operation failed.
fn run() -> Result<bool, String> {
    let config = Config::from_env()?;
    let nproc = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    println!(
        "dynamodb_bench: DataStore facade over the DynamoDB adapter vs the same SDK calls by hand, and bulk writes"
    );
    println!(
        "nproc: {nproc}  clients: {}  per side and operation: {} s or {} ops, in {SEGMENTS_PER_SIDE} segments \
         alternating ABBA BAAB (A = facade)",
        config.clients, config.seconds, config.max_requests
    );

    // Local servers accept any credentials; set before the SDK (or any other thread) starts.
    for (name, value) in [("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"), ("AWS_REGION", "us-east-1")]
    {
        if std::env::var_os(name).is_none() {
            std::env::set_var(name, value);
        }
    }

    // The shared test-server launcher: AGENTSTORE_BENCH_DYNAMODB_ENDPOINT names a server, else
    // dynalite from node_modules runs for as long as this process.
    if let Ok(endpoint) = std::env::var("AGENTSTORE_BENCH_DYNAMODB_ENDPOINT") {
        if !endpoint.trim().is_empty() {
            std::env::set_var("AGENTSTORE_TEST_DYNAMODB_ENDPOINT", endpoint.trim().trim_end_matches('/'));
        }
    }
    let server = servers::dynamodb()?;
    let (endpoint, product) = (server.endpoint, server.product);
    let table = format!(
        "agentstore_bench_{}_{}",
        std::process::id(),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0)
    );

    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| format!("tokio runtime: {e}"))?;
    let outcome = runtime.block_on(async {
        println!("server: {product}");

        let url = format!(
            "dynamodb://{table}?region=us-east-1&endpoint={}&create=true",
            percent_encoding::utf8_percent_encode(&endpoint, percent_encoding::NON_ALPHANUMERIC)
        );
        let dynamo = DynamoConfig::parse(&url).map_err(|e| describe(&e))?;
        let opened = Instant::now();
        let concrete = Arc::new(
            DynamoDbBackend::open(&dynamo).await.map_err(|e| format!("opening the adapter: {}", describe(&e)))?,
        );
        println!("table: {table} (fresh, created with its GSI {INDEX} in {:.2} s)", opened.elapsed().as_secs_f64());
        let client = concrete.client().clone();
        let backend: Arc<dyn DocumentBackend> = concrete;
        let untracked =
            DataStore::open(Arc::clone(&backend), StoreOptions { track_reads: false, ..Default::default() })
                .await
                .map_err(|e| format!("opening the facade: {}", describe(&e)))?;
        let tracked = DataStore::open(Arc::clone(&backend), StoreOptions::default())
            .await
            .map_err(|e| format!("opening the facade: {}", describe(&e)))?;
        let page_size = untracked.options().page_size;
        let raw = Raw {
            client,
            table: table.clone(),
            list_limit: i32::try_from(page_size.max(1)).unwrap_or(i32::MAX),
            get_all_limit: i32::try_from(page_size.clamp(1, GET_ALL_PAGE_SIZE)).unwrap_or(i32::MAX),
            conflicts: AtomicU64::new(0),
            calls: AtomicU64::new(0),
        };

        let seeding = Instant::now();
        seed(&backend, &tracked).await?;
        println!(
            "seeded {TOTAL_KEYS} documents (1 user x {NAMESPACES} namespaces x {KEYS_PER_NAMESPACE} keys) with \
             bulk_write (BatchWriteItem), then one facade set per namespace, in {:.2} s (not timed)",
            seeding.elapsed().as_secs_f64()
        );
        let ctx = Arc::new(Ctx { untracked, tracked, raw });
        // Both sides must see the same listing before anything is timed.
        let (namespace, _) = document(0);
        let facade_keys = ctx.untracked.list_keys(USER, &namespace).await.map_err(|e| describe(&e))?;
        let raw_keys = ctx.raw.list_keys(&namespace).await?;
        if facade_keys != raw_keys || facade_keys.len() != KEYS_PER_NAMESPACE {
            return Err(format!(
                "{namespace}: the facade lists {} keys and raw Query {}; expected the same {KEYS_PER_NAMESPACE}",
                facade_keys.len(),
                raw_keys.len()
            ));
        }

        let mut results = Vec::new();
        for pair in Pair::ALL {
            let started = Instant::now();
            let result = run_pair(&ctx, pair, &config).await;
            println!("  {:<10} done in {:.2} s: {}", pair.name(), started.elapsed().as_secs_f64(), pair.description());
            results.push(result);
        }

        let mut bulk = Vec::new();
        for precondition in [Precondition::None, Precondition::MustNotExist] {
            let result = bulk_phase(&backend, &ctx.raw, &ctx.untracked, precondition, config.bulk_docs).await?;
            println!(
                "  {:<10} done in {:.2} s: {} fresh documents, Precondition::{}, batches of {BULK_BATCH}, \
                 {BULK_CALLERS} concurrent callers",
                result.label,
                result.elapsed.as_secs_f64(),
                result.docs,
                result.precondition
            );
            bulk.push(result);
        }

        // Best effort: leave nothing behind on a shared server.
        if let Err(e) = ctx.raw.client.delete_table().table_name(&table).send().await {
            eprintln!("dynamodb_bench: could not delete table {table}: {}", DisplayErrorContext(&e));
        }
        Ok::<_, String>((results, bulk))
    });
    drop(runtime);
    let (results, bulk) = outcome?;

    println!();
    print!("{}", pair_table(&results));
    println!(
        "(ops/s and latency over successful operations; latency is one whole operation; ratios: facade p50 / raw p50 \
         and raw ops/s / facade ops/s, above 1 = facade slower; calls/op = raw SDK calls per operation)"
    );
    println!();
    print!("{}", bulk_table(&bulk));
    println!(
        "(docs/s = documents written / wall time of all batches; batch latency = one bulk_write call; in table = \
         consistent Scan count afterwards; listed = facade list_keys afterwards, GSI Query with pages followed)"
    );
    for b in bulk.iter().filter(|b| b.listed != b.verified) {
        eprintln!(
            "dynamodb_bench: note: the table holds {} Precondition::{} documents but list_keys returns {} \
             (GSI Query paged at {} items; not counted as a write error)",
            b.verified,
            b.precondition,
            b.listed,
            StoreOptions::default().page_size
        );
    }

    let mut passed = results.iter().all(|r| r.errors() == 0 && r.facade.ops > 0 && r.raw.ops > 0);
    for r in &results {
        for side in [&r.facade, &r.raw] {
            if side.errors + side.warmup_errors > 0 || side.ops == 0 {
                eprintln!(
                    "dynamodb_bench: {} {}: {} errors in {} operations (+{} in warm-up); first: {}",
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
    for b in &bulk {
        if b.errors > 0 {
            passed = false;
            eprintln!(
                "dynamodb_bench: bulk_write Precondition::{}: {} of {} documents failed; first: {}",
                b.precondition,
                b.errors,
                b.docs,
                b.first_error.as_deref().unwrap_or("?")
            );
        }
    }

    let report = json!({
        "benchmark": "dynamodb_bench",
        "server": product,
        "server_origin": if std::env::var_os("AGENTSTORE_TEST_DYNAMODB_ENDPOINT").is_some() {
            "AGENTSTORE_BENCH_DYNAMODB_ENDPOINT"
        } else {
            "node_modules/.bin/dynalite --createTableMs 0 --deleteTableMs 0 --updateTableMs 0"
        },
        "nproc": nproc,
        "clients": config.clients,
        "seconds_per_side": config.seconds,
        "max_ops_per_side": config.max_requests,
        "segments_per_side": SEGMENTS_PER_SIDE,
        "segment_order": segment_order().iter().map(|s| s.name()).collect::<Vec<_>>(),
        "warmup_ops_per_side": WARMUP_OPS_PER_CLIENT * config.clients as u64,
        "documents": TOTAL_KEYS,
        "passed": passed,
        "operations": results.iter().map(PairResult::to_json).collect::<Vec<_>>(),
        "bulk_writes": bulk.iter().map(BulkResult::to_json).collect::<Vec<_>>(),
    });
    let out_dir = target_dir().join("bench");
    let path = out_dir.join("dynamodb_bench.json");
    std::fs::create_dir_all(&out_dir).map_err(|e| format!("creating {}: {e}", out_dir.display()))?;
    let text = serde_json::to_string_pretty(&report).expect("serialisable");
    std::fs::write(&path, text + "\n").map_err(|e| format!("writing {}: {e}", path.display()))?;
    println!("wrote {}", path.display());

    if !passed {
        eprintln!("dynamodb_bench: FAILED: some operations errored");
    }
    Ok(passed)
}
