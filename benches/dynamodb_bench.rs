//! Overhead and throughput of the DynamoDB adapter: the `DataStore` facade over `DynamoDbBackend`
//! against the raw AWS SDK calls it makes, side by side in one run, plus bulk-write throughput.
//!
//! Run it with `cargo bench --bench benches -- dynamodb_bench`. The server is
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
//! operations over the side's summed segment time (the shared harness in `benches/common/`, see
//! `common::load`). The raw side retries a failed condition at once
//! (the facade with backoff), counted as `conflicts_retried`; `calls/op` is the raw side's SDK calls
//! per operation (the facade makes the same requests).
//!
//! Then bulk writes (`common::bulk`): `BENCH_BULK_DOCS` (default 5,000) fresh documents through
//! `DocumentBackend::bulk_write` in batches of 100 from 4 concurrent callers, once with
//! `Precondition::None` and once with `Precondition::MustNotExist`, in documents per second. Both
//! read what they replace in consistent BatchGetItems (100 ids a call) and write one conditional
//! PutItem per document (the document model continues generations and ancestry even for
//! unconditional writes, so BatchWriteItem, which carries no condition, is no longer used).
//! Afterwards (not timed) a consistent Scan counts the documents in the table (the authority: a
//! shortfall is an error) and `DataStore::list_keys` lists the namespace, shown next to it; on
//! dynalite 4.0.0 the paged GSI Query (1,000 per page) returns 4,999 of 5,000, which is printed as a
//! note, not counted as an error.
//!
//! Last, the document model (`model_phase`, printed only): write throughput of `BENCH_MODEL_DOCS`
//! (default 2,000) fresh documents from 8 concurrent tasks, four ways: raw PutItem of a
//! previous-release item into a previous-release table (the userId index only); raw PutItem of the
//! same item with this release's attributes (`_anc`, `_shard`, `_seq`) into a table with this
//! release's three indexes (the index-write overhead alone); the adapter's `put(MustNotExist)`
//! (a consistent GetItem, then the conditional PutItem); raw BatchWriteItem of 25 previous-release
//! items, 4 in flight (the previous release's unconditional bulk path); and `bulk_write(None)` in
//! calls of 100.
//! Then the latency of one page of 100 of `changes` (the whole feed read page by page) and of
//! `all_docs` (the first 20 pages), with the table at that size and again after raw writes grow it
//! tenfold: equal latencies at both sizes show a page costs what the page holds, not the table.
//!
//! Results go to stdout as tables and to `target/bench/dynamodb_bench.json`. Any failed operation
//! (warm-up included) makes the bench exit 1. The table is deleted at the end (best effort).
//!
//! `cargo test --all-targets` also builds and runs the bench binary (without `--bench`); it then only
//! prints how to run it and exits 0.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use agentstore::backend::dynamodb::{DynamoConfig, DynamoDbBackend};
use agentstore::backend::{DocumentBackend, Precondition};
use agentstore::model::timestamp;
use agentstore::store::StoreOptions;
use aws_sdk_dynamodb::error::DisplayErrorContext;
use aws_sdk_dynamodb::types::{AttributeValue, ReturnValue};
use serde_json::Value;

use crate::common;
use crate::servers;

use common::bulk::{run_bulk, BulkBench};
use common::facade::{print_seeded, Facades};
use common::load::{run_pairs, Bench, Counters, Labels, Tally};
use common::report::{conclude, print_tables, Origin};
use common::workload::{document, Input, Pair, AGENT, USER};
use common::{describe, Config};

const NAME: &str = "dynamodb_bench";
/// The adapter's GSI (default `index=` of the backend URL).
const INDEX: &str = "idx-user-namespace";
/// How often the raw side re-reads after a failed condition, as the facade's default
/// `max_conflict_retries`.
const RAW_CONFLICT_RETRIES: usize = 100;
/// `DataStore::get_all` asks for pages of at most this many documents.
const GET_ALL_PAGE_SIZE: usize = 100;
const PAIRS: [Pair; 5] = [Pair::Get, Pair::GetTracked, Pair::Set, Pair::ListKeys, Pair::GetAll];
const LABELS: Labels = Labels {
    calls_column: "SDK calls",
    calls_key: "sdk_calls",
    counter_column: "calls/op",
    counter_key: "sdk_calls_per_op",
    counter_total_key: None,
    raw_only: true,
    container: "table",
};

// ---- the two sides ----

/// Everything the operations need, shared by the client tasks.
struct Ctx {
    /// `get` without tracking is one GetItem; with tracking GetItem + PutItem.
    facades: Facades,
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
    /// Calls made and failed conditions retried.
    tally: Tally,
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
        self.tally.call();
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
            self.tally.call();
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
                    self.tally.conflict();
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
            self.tally.call();
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

impl Bench for Ctx {
    const SOURCE: &'static str = NAME;

    /// The SDK calls one operation makes, on both sides.
    fn calls(pair: Pair) -> &'static str {
        match pair {
            Pair::Get => "GetItem",
            Pair::GetTracked | Pair::Set => "GetItem + PutItem",
            Pair::ListKeys | Pair::GetAll => "Query (GSI)",
        }
    }

    fn description(pair: Pair) -> &'static str {
        match pair {
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

    fn facades(&self) -> &Facades {
        &self.facades
    }

    async fn raw_op(&self, pair: Pair, input: Input) -> Result<usize, String> {
        let raw = &self.raw;
        let Input { namespace, id, value, metadata, .. } = input;
        match pair {
            Pair::Get => raw.get(&id).await.map(|_| 1),
            Pair::GetTracked => raw
                .read_modify_write(&id, |item| {
                    let count = match item.get("accessCount") {
                        Some(AttributeValue::N(n)) => n.parse::<u64>().unwrap_or(0),
                        _ => 0,
                    };
                    item.insert("accessCount".into(), AttributeValue::N((count + 1).to_string()));
                    item.insert("lastAccessedAt".into(), AttributeValue::S(timestamp::now()));
                    item.insert("lastAccessedByAgent".into(), s(AGENT));
                })
                .await
                .map(|()| 1),
            Pair::Set => raw
                .read_modify_write(&id, |item| {
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
                .map(|()| 1),
            Pair::ListKeys => Ok(raw.list_keys(&namespace).await?.len()),
            Pair::GetAll => Ok(raw.get_all(&namespace).await?.len()),
        }
    }

    async fn counters(&self) -> Result<Counters, String> {
        Ok(self.raw.tally.counters())
    }
}

impl BulkBench for Ctx {
    fn bulk_calls(precondition: &Precondition) -> &'static str {
        match precondition {
            // Both read what they replace first, 100 ids a BatchGetItem.
            Precondition::MustNotExist => "BatchGetItem + conditional PutItem x1",
            _ => "BatchGetItem + conditional PutItem x1 (unconditional: continues the generation)",
        }
    }

    /// A consistent Scan of the whole table.
    async fn count(&self, namespace: &str) -> Result<usize, String> {
        self.raw.count_in_table(namespace).await
    }
}

pub fn main() -> std::process::ExitCode {
    common::bench_main(NAME, run)
}

/// Runs the benchmark; Ok(false) when any operation failed.
fn run() -> Result<bool, String> {
    let config = Config::from_env(true)?;
    println!(
        "dynamodb_bench: DataStore facade over the DynamoDB adapter vs the same SDK calls by hand, and bulk writes"
    );
    let nproc = config.print();

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
    let table = format!("agentstore_bench_{}", common::run_suffix());

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
        let facades = Facades::open(&backend).await?;
        let page_size = facades.page_size();
        let raw = Raw {
            client,
            table: table.clone(),
            list_limit: i32::try_from(page_size.max(1)).unwrap_or(i32::MAX),
            get_all_limit: i32::try_from(page_size.clamp(1, GET_ALL_PAGE_SIZE)).unwrap_or(i32::MAX),
            tally: Tally::default(),
        };

        let seeding = Instant::now();
        facades.seed(&backend, NAME, Precondition::None).await?;
        print_seeded("bulk_write", seeding.elapsed().as_secs_f64());
        let ctx = Arc::new(Ctx { facades, raw });
        ctx.facades.check_same_listing(ctx.raw.list_keys(&document(0).0).await?, "Query").await?;

        let results = run_pairs(&ctx, &PAIRS, &config).await?;
        let bulk_results = run_bulk(ctx.as_ref(), &backend, config.bulk_docs, &LABELS).await?;
        model::model_phase(&ctx.raw.client, &endpoint).await?;

        // Best effort: leave nothing behind on a shared server.
        if let Err(e) = ctx.raw.client.delete_table().table_name(&table).send().await {
            eprintln!("dynamodb_bench: could not delete table {table}: {}", DisplayErrorContext(&e));
        }
        Ok::<_, String>((results, bulk_results))
    });
    drop(runtime);
    let (results, bulk) = outcome?;

    print_tables(
        &LABELS,
        &results,
        "(ops/s and latency over successful operations; latency is one whole operation; ratios: facade p50 / raw p50 \
         and raw ops/s / facade ops/s, above 1 = facade slower; calls/op = raw SDK calls per operation)",
        Some((
            &bulk,
            "(docs/s = documents written / wall time of all batches; batch latency = one bulk_write call; in table = \
             consistent Scan count afterwards; listed = facade list_keys afterwards, GSI Query with pages followed)",
        )),
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

    let origin = Origin {
        name: NAME,
        server: &product,
        server_origin: if std::env::var_os("AGENTSTORE_TEST_DYNAMODB_ENDPOINT").is_some() {
            "AGENTSTORE_BENCH_DYNAMODB_ENDPOINT"
        } else {
            "node_modules/.bin/dynalite --createTableMs 0 --deleteTableMs 0 --updateTableMs 0"
        },
    };
    conclude(&origin, &config, nproc, &results, Some(&bulk), &LABELS)
}

/// The document model's costs: write throughput with and without its attributes and indexes, and
/// the page latency of `changes` and `all_docs` at two table sizes.
mod model {
    use std::collections::HashMap;
    use std::time::{Duration, Instant};

    use agentstore::backend::dynamodb::{layout, DynamoConfig, DynamoDbBackend};
    use agentstore::backend::{BulkWrite, DocumentBackend, IdRange, Precondition};
    use aws_sdk_dynamodb::primitives::Blob;
    use aws_sdk_dynamodb::types::{
        AttributeDefinition, AttributeValue, BillingMode, GlobalSecondaryIndex, KeySchemaElement, KeyType, Projection,
        ProjectionType, ScalarAttributeType,
    };
    use aws_sdk_dynamodb::Client;
    use futures::{StreamExt, TryStreamExt};
    use serde_json::{json, Map, Value};

    const CONCURRENCY: usize = 8;
    const PAGE: usize = 100;
    /// `settle_ms` of the bench table: the feed shows writes this long after they are made.
    const SETTLE_MS: u64 = 1000;

    fn docs() -> usize {
        std::env::var("BENCH_MODEL_DOCS").ok().and_then(|v| v.parse().ok()).unwrap_or(2000)
    }

    fn s(text: &str) -> AttributeValue {
        AttributeValue::S(text.to_owned())
    }

    fn id(n: usize) -> String {
        format!("bench_user:notes:{n:07}")
    }

    fn body(n: usize) -> Map<String, Value> {
        let doc = json!({"userId": "bench_user", "namespace": "notes", "key": format!("k{n}"),
            "value": {"text": "a short note", "n": n}, "accessCount": 0});
        doc.as_object().cloned().unwrap_or_default()
    }

    /// An item as the previous release wrote it, or with this release's attributes.
    fn item(n: usize, current_layout: bool) -> HashMap<String, AttributeValue> {
        let id = id(n);
        let mut item: HashMap<String, AttributeValue> =
            body(n).iter().map(|(k, v)| (k.clone(), super::to_attr(v))).collect();
        item.insert("_id".into(), s(&id));
        if current_layout {
            item.insert("_rev".into(), s(&format!("1-{:032x}", n)));
            item.insert("_anc".into(), AttributeValue::B(Blob::new(vec![7u8; 16])));
            item.insert("_shard".into(), AttributeValue::N(layout::shard_of(&id).to_string()));
            item.insert("_seq".into(), s(&layout::new_position()));
        } else {
            item.insert("_rev".into(), s(&format!("1-{:016x}", n)));
        }
        item
    }

    async fn raw_put(client: &Client, table: &str, item: HashMap<String, AttributeValue>) -> Result<(), String> {
        client
            .put_item()
            .table_name(table)
            .set_item(Some(item))
            .condition_expression("attribute_not_exists(#id)")
            .expression_attribute_names("#id", "_id")
            .send()
            .await
            .map(|_| ())
            .map_err(|e| format!("raw PutItem: {}", aws_sdk_dynamodb::error::DisplayErrorContext(&e)))
    }

    /// Writes documents `range` with `write`, `CONCURRENCY` at a time; documents per second.
    async fn throughput<F, Fut>(range: std::ops::Range<usize>, write: F) -> Result<f64, String>
    where
        F: Fn(usize) -> Fut,
        Fut: std::future::Future<Output = Result<(), String>>,
    {
        let count = range.len();
        let started = Instant::now();
        futures::stream::iter(range).map(write).buffer_unordered(CONCURRENCY).try_collect::<Vec<()>>().await?;
        Ok(count as f64 / started.elapsed().as_secs_f64())
    }

    /// A table as the previous release created it: the userId + namespace index only.
    async fn previous_release_table(client: &Client, table: &str) -> Result<(), String> {
        let key = |name: &str, kind| KeySchemaElement::builder().attribute_name(name).key_type(kind).build();
        let attribute = |name: &str| {
            AttributeDefinition::builder().attribute_name(name).attribute_type(ScalarAttributeType::S).build()
        };
        let built = |e: aws_sdk_dynamodb::error::BuildError| e.to_string();
        let index = GlobalSecondaryIndex::builder()
            .index_name("idx-user-namespace")
            .key_schema(key("userId", KeyType::Hash).map_err(built)?)
            .key_schema(key("namespace", KeyType::Range).map_err(built)?)
            .projection(Projection::builder().projection_type(ProjectionType::All).build())
            .build()
            .map_err(built)?;
        client
            .create_table()
            .table_name(table)
            .billing_mode(BillingMode::PayPerRequest)
            .attribute_definitions(attribute("_id").map_err(built)?)
            .attribute_definitions(attribute("userId").map_err(built)?)
            .attribute_definitions(attribute("namespace").map_err(built)?)
            .key_schema(key("_id", KeyType::Hash).map_err(built)?)
            .global_secondary_indexes(index)
            .send()
            .await
            .map_err(|e| {
                format!("create the previous-release table: {}", aws_sdk_dynamodb::error::DisplayErrorContext(&e))
            })?;
        Ok(())
    }

    /// The previous release's unconditional bulk path: BatchWriteItem of 25 items, 4 in flight;
    /// documents per second.
    async fn raw_batch_writes(client: &Client, table: &str, range: std::ops::Range<usize>) -> Result<f64, String> {
        use aws_sdk_dynamodb::types::{PutRequest, WriteRequest};
        let count = range.len();
        let ids: Vec<usize> = range.collect();
        let started = Instant::now();
        futures::stream::iter(ids.chunks(25).map(<[usize]>::to_vec))
            .map(|batch| async move {
                let requests = batch
                    .iter()
                    .map(|&i| {
                        PutRequest::builder()
                            .set_item(Some(item(i, false)))
                            .build()
                            .map(|put| WriteRequest::builder().put_request(put).build())
                            .map_err(|e| e.to_string())
                    })
                    .collect::<Result<Vec<_>, String>>()?;
                let output =
                    client.batch_write_item().request_items(table, requests).send().await.map_err(|e| {
                        format!("raw BatchWriteItem: {}", aws_sdk_dynamodb::error::DisplayErrorContext(&e))
                    })?;
                match output.unprocessed_items().map_or(0, |m| m.values().map(Vec::len).sum()) {
                    0 => Ok(()),
                    left => Err(format!("raw BatchWriteItem left {left} items unprocessed")),
                }
            })
            .buffer_unordered(4)
            .try_collect::<Vec<()>>()
            .await?;
        Ok(count as f64 / started.elapsed().as_secs_f64())
    }

    fn p50(mut samples: Vec<Duration>) -> f64 {
        samples.sort_unstable();
        samples.get(samples.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    }

    /// p50 latency (ms) of a `changes` page over the whole feed and of the first 20 `all_docs`
    /// pages, and how many changes the feed held.
    async fn page_latencies(backend: &DynamoDbBackend) -> Result<(f64, f64, usize), String> {
        tokio::time::sleep(Duration::from_millis(SETTLE_MS + 200)).await;
        let (mut changes, mut since, mut fed) = (Vec::new(), None::<String>, 0);
        loop {
            let started = Instant::now();
            let page = backend.changes(since.as_deref(), PAGE).await.map_err(|e| super::describe(&e))?;
            changes.push(started.elapsed());
            fed += page.changes.len();
            since = Some(page.last_seq);
            if page.changes.len() < PAGE {
                break;
            }
        }
        let (mut listed, mut token) = (Vec::new(), None::<String>);
        for _ in 0..20 {
            let started = Instant::now();
            let page =
                backend.all_docs(&IdRange::all(), PAGE, token.as_deref()).await.map_err(|e| super::describe(&e))?;
            listed.push(started.elapsed());
            token = page.next;
            if token.is_none() {
                break;
            }
        }
        Ok((p50(changes), p50(listed), fed))
    }

    pub async fn model_phase(client: &Client, endpoint: &str) -> Result<(), String> {
        let n = docs();
        let suffix = crate::common::run_suffix();
        let (old_table, new_table, adapter_table) =
            (format!("bench_prev_{suffix}"), format!("bench_model_{suffix}"), format!("bench_adapter_{suffix}"));
        let url = |table: &str| {
            format!(
                "dynamodb://{table}?region=us-east-1&endpoint={}&create=true&settle_ms={SETTLE_MS}&write_timeout_ms=800",
                percent_encoding::utf8_percent_encode(endpoint, percent_encoding::NON_ALPHANUMERIC)
            )
        };
        let open = |table: String| async move {
            let config = DynamoConfig::parse(&url(&table)).map_err(|e| super::describe(&e))?;
            DynamoDbBackend::open(&config).await.map_err(|e| super::describe(&e))
        };
        previous_release_table(client, &old_table).await?;
        let new_layout = open(new_table.clone()).await?;
        let adapter = open(adapter_table.clone()).await?;

        let old = throughput(0..n, |i| raw_put(client, &old_table, item(i, false))).await?;
        let old_batch = raw_batch_writes(client, &old_table, n..2 * n).await?;
        let new = throughput(0..n, |i| raw_put(client, &new_table, item(i, true))).await?;
        let put = throughput(0..n, |i| {
            let adapter = &adapter;
            async move {
                adapter
                    .put(&id(i), &body(i), Precondition::MustNotExist)
                    .await
                    .map(|_| ())
                    .map_err(|e| super::describe(&e))
            }
        })
        .await?;
        let bulk_started = Instant::now();
        let batches: Vec<Vec<BulkWrite>> = (n..2 * n)
            .map(|i| BulkWrite { id: id(i), body: body(i), precondition: Precondition::None })
            .collect::<Vec<_>>()
            .chunks(PAGE)
            .map(<[BulkWrite]>::to_vec)
            .collect();
        let results: Vec<Vec<agentstore::Result<agentstore::backend::Revision>>> = futures::stream::iter(batches)
            .map(|batch| adapter.bulk_write(batch))
            .buffer_unordered(4)
            .try_collect()
            .await
            .map_err(|e| super::describe(&e))?;
        if let Some(Err(e)) = results.iter().flatten().find(|r| r.is_err()) {
            return Err(format!("bulk_write: {}", super::describe(e)));
        }
        let bulk = n as f64 / bulk_started.elapsed().as_secs_f64();

        println!();
        println!("document model: write throughput, {n} fresh documents, {CONCURRENCY} concurrent writers");
        println!("  raw PutItem, previous-release item and table (1 index)      {old:>9.0} docs/s");
        println!(
            "  raw PutItem, this release's item and table (3 indexes)      {new:>9.0} docs/s  ({:+.1}% vs previous)",
            (new / old - 1.0) * 100.0
        );
        println!("  adapter put(MustNotExist): GetItem + conditional PutItem    {put:>9.0} docs/s");
        println!("  raw BatchWriteItem x25, 4 in flight (previous bulk path)     {old_batch:>9.0} docs/s");
        println!("  adapter bulk_write(None), 100 a call, 4 calls in flight      {bulk:>9.0} docs/s");

        let (changes_small, all_docs_small, fed_small) = page_latencies(&new_layout).await?;
        throughput(n..10 * n, |i| raw_put(client, &new_table, item(i, true))).await?;
        let (changes_large, all_docs_large, fed_large) = page_latencies(&new_layout).await?;
        println!("document model: page latency (p50, pages of {PAGE}, 16 shards)");
        println!(
            "  table of {fed_small:>7} documents: changes {changes_small:>7.1} ms  all_docs {all_docs_small:>7.1} ms"
        );
        println!(
            "  table of {fed_large:>7} documents: changes {changes_large:>7.1} ms  all_docs {all_docs_large:>7.1} ms"
        );
        for table in [old_table, new_table, adapter_table] {
            let _ = client.delete_table().table_name(&table).send().await;
        }
        Ok(())
    }
}
