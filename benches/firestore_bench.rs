//! Overhead and throughput of the Firestore adapter: the `DataStore` facade over
//! `FirestoreBackend` against the raw REST v1 calls it makes, side by side in one run, plus
//! bulk-write throughput, on Google's Firestore emulator.
//!
//! Run it with `cargo bench --bench benches -- firestore_bench`. The server is
//! `AGENTSTORE_BENCH_FIRESTORE_EMULATOR` (`HOST:PORT` of a running emulator) when set; otherwise
//! the emulator jar of Debian's google-cloud-cli-firestore-emulator package is started on a free
//! port by the tests' launcher (`tests/common/servers.rs`), which stops it when the bench process
//! exits. Which server answered is printed. The emulator is a Java process on the same machine as
//! the bench, so the numbers say how the adapter compares with hand-made calls, not what
//! production Firestore does.
//!
//! The bench opens the adapter on a fresh project (`agentstore-bench-PID`) and collection,
//! seeds 1,000 documents (1 user × 10 namespaces × 100 keys) with the adapter's `bulk_write`
//! (`Precondition::MustNotExist`: one `:batchWrite` per namespace) and the facade's document
//! bodies, then makes one warm-up `set` per namespace through the facade (none of this is timed).
//! Then it measures five pairs:
//!
//! | pair        | facade                                          | raw (reqwest by hand)                                         |
//! |-------------|-------------------------------------------------|---------------------------------------------------------------|
//! | `get`       | `DataStore::get`, `track_reads=false`: one GET  | `GET …/documents/{collection}/{id}`                           |
//! | `get+track` | `DataStore::get`, access tracking               | GET, bump `accessCount`, `:commit` with `currentDocument.updateTime` |
//! | `set`       | `DataStore::set` of an existing key             | GET, replace value, merge metadata, the same `:commit`        |
//! | `list_keys` | `DataStore::list_keys`, 100 keys                | `:runQuery`, same filter, `select`, order, limit and cursor   |
//! | `get_all`   | `DataStore::get_all`, same namespace, all fields | `:runQuery` without `select`, limit 100, cursor followed     |
//!
//! The raw side has its own `reqwest::Client` built like the adapter's (keep-alive pool, same
//! timeouts, the emulator's `Bearer owner` token, `Accept: application/json`) and converts JSON to
//! Firestore values and back by hand, so the difference is the facade and adapter code:
//! validation, id building, the lossless codec, error mapping, retry wrappers. Listings are
//! `:runQuery` with equality filters on `userId` and `namespace`, ordered by `__name__`, continued
//! with a `startAt` cursor after a full page, on both sides. The measurement is the harness shared
//! with the other adapter benches (`benches/common/`, see `common::load`): every phase is a closed
//! loop of `BENCH_CLIENTS` (default 8) concurrent tasks; each side of a pair is bounded by
//! `BENCH_SECONDS` (default 3) and `BENCH_MAX_REQUESTS` (default 5,000) in total, split over eight
//! segments run alternately as ABBA BAAB ABBA BAAB (A = facade) after an untimed warm-up of both
//! sides. Latency is wall-clock around one whole operation (inputs are built before the clock
//! starts); throughput is successful operations over the side's summed segment time. The raw side
//! retries a failed precondition (or `ABORTED`) at once (the facade with backoff), counted as
//! `conflicts_retried`; `calls/op` is the raw side's REST calls per operation (the facade makes
//! the same requests).
//!
//! Then bulk writes (`common::bulk`): `BENCH_BULK_DOCS` (default 5,000) fresh documents through
//! `DocumentBackend::bulk_write` in batches of 100 from 4 concurrent callers, once with
//! `Precondition::None` (one `:commit` per document: the adapter cannot know whether an old
//! version has chunk documents, so each commit also deletes every chunk slot) and once with
//! `Precondition::MustNotExist` (`:batchWrite`, up to 500 writes a call), in documents per second.
//! Afterwards (not timed) a `:runQuery` over the whole collection ordered by `__name__` (no
//! filter, so no composite index involved) counts the namespace's documents (the authority: a
//! shortfall is an error) and `DataStore::list_keys` lists the namespace, shown next to it.
//!
//! Results go to stdout as tables and to `target/bench/firestore_bench.json`. Any failed operation
//! (warm-up included) makes the bench exit 1. The emulator's copy of the project is cleared at the
//! end (best effort).
//!
//! `cargo test --all-targets` also builds and runs the bench binary (without `--bench`); it then only
//! prints how to run it and exits 0.

use std::sync::Arc;
use std::time::{Duration, Instant};

use agentstore::backend::firestore::{FirestoreBackend, FirestoreConfig};
use agentstore::backend::{DocumentBackend, Precondition};
use agentstore::model::timestamp;
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use reqwest::{Method, StatusCode};
use serde_json::{json, Map, Value};

use crate::common;
use crate::servers;

use common::bulk::{run_bulk, BulkBench};
use common::facade::{print_seeded, Facades};
use common::load::{run_pairs, Bench, Counters, Labels, Tally};
use common::report::{conclude, print_tables, Origin};
use common::workload::{document, Input, Pair, AGENT, USER};
use common::{describe, Config};

const NAME: &str = "firestore_bench";
/// The adapter's default request timeout (`timeout_ms` of the backend URL).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How often the raw side re-reads after a failed precondition, as the facade's default
/// `max_conflict_retries`.
const RAW_CONFLICT_RETRIES: usize = 100;
/// `DataStore::get_all` asks for pages of at most this many documents.
const GET_ALL_PAGE_SIZE: usize = 100;
/// Page size of the verification count.
const COUNT_PAGE: usize = 1000;
/// A document id path segment, escaped as the adapter does: everything but RFC 3986 unreserved
/// characters and `:`.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~').remove(b':');
/// The adapter's fields for the listing filter and the `list_keys` projection.
const USER_ID_FIELD: &str = "userId";
const NAMESPACE_FIELD: &str = "namespace";
const KEY_FIELD: &str = "key";
/// Fields the adapter adds to every `list_keys` projection: the stored `_id` and the chunk count.
const ID_FIELD: &str = "_id";
const CHUNKS_FIELD: &str = "_chunks";
const PAIRS: [Pair; 5] = [Pair::Get, Pair::GetTracked, Pair::Set, Pair::ListKeys, Pair::GetAll];
const LABELS: Labels = Labels {
    calls_column: "REST calls",
    calls_key: "rest_calls",
    counter_column: "calls/op",
    counter_key: "rest_calls_per_op",
    counter_total_key: None,
    raw_only: true,
    container: "collection",
};

// ---- the two sides ----

/// Everything the operations need, shared by the client tasks.
struct Ctx {
    /// `get` without tracking is one GET; with tracking GET + `:commit`.
    facades: Facades,
    raw: Raw,
}

/// The raw side: reqwest by hand, on its own client built like the adapter's.
struct Raw {
    http: reqwest::Client,
    /// `http://HOST:PORT` of the emulator.
    base: String,
    project: String,
    /// `http://HOST:PORT/v1/projects/{project}/databases/(default)/documents`.
    root_url: String,
    /// `projects/{project}/databases/(default)/documents`: the prefix of resource names.
    root_name: String,
    collection: String,
    /// The `:runQuery` limit the facade sends for `list_keys`: its page size.
    list_limit: usize,
    /// The `:runQuery` limit the facade sends for `get_all`.
    get_all_limit: usize,
    /// Calls made and failed conditions retried.
    tally: Tally,
}

/// One response: status and parsed JSON body.
struct Reply {
    status: StatusCode,
    body: Value,
}

impl Reply {
    /// Firestore's gRPC status name of an error reply (`FAILED_PRECONDITION`), or `""`.
    fn status_name(&self) -> &str {
        self.body.pointer("/error/status").and_then(Value::as_str).unwrap_or("")
    }
}

/// A document as GET returns it: its fields and `updateTime`.
struct Fetched {
    fields: Map<String, Value>,
    update_time: String,
}

/// JSON to a Firestore value, as a hand-written client would (integers as `integerValue`).
fn to_fs(value: &Value) -> Value {
    match value {
        Value::Null => json!({ "nullValue": null }),
        Value::Bool(b) => json!({ "booleanValue": b }),
        Value::Number(n) => match n.as_i64() {
            Some(i) => json!({ "integerValue": i.to_string() }),
            None => json!({ "doubleValue": n }),
        },
        Value::String(text) => json!({ "stringValue": text }),
        Value::Array(items) => json!({ "arrayValue": { "values": items.iter().map(to_fs).collect::<Vec<_>>() } }),
        Value::Object(map) => {
            let fields: Map<String, Value> = map.iter().map(|(k, v)| (k.clone(), to_fs(v))).collect();
            json!({ "mapValue": { "fields": fields } })
        }
    }
}

/// A Firestore value back to JSON (the types `to_fs` writes; anything else is null).
fn from_fs(value: &Value) -> Value {
    let Some((kind, inner)) = value.as_object().and_then(|o| o.iter().next()) else { return Value::Null };
    match kind.as_str() {
        "booleanValue" => inner.as_bool().map(Value::Bool).unwrap_or(Value::Null),
        "integerValue" => inner.as_str().and_then(|i| i.parse::<i64>().ok()).map(Value::from).unwrap_or(Value::Null),
        "doubleValue" => inner.clone(),
        "stringValue" => inner.clone(),
        "arrayValue" => {
            Value::Array(inner.get("values").and_then(Value::as_array).into_iter().flatten().map(from_fs).collect())
        }
        "mapValue" => Value::Object(
            inner
                .get("fields")
                .and_then(Value::as_object)
                .into_iter()
                .flatten()
                .map(|(k, v)| (k.clone(), from_fs(v)))
                .collect(),
        ),
        _ => Value::Null,
    }
}

fn string_value(text: &str) -> Value {
    json!({ "stringValue": text })
}

/// The `integerValue` of a field, 0 when missing.
fn integer_field(fields: &Map<String, Value>, name: &str) -> i64 {
    fields
        .get(name)
        .and_then(|v| v.get("integerValue"))
        .and_then(Value::as_str)
        .and_then(|i| i.parse().ok())
        .unwrap_or(0)
}

impl Raw {
    /// The same client settings as the adapter's `FirestoreClient`.
    fn client() -> Result<reqwest::Client, String> {
        reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .timeout(REQUEST_TIMEOUT)
            .pool_idle_timeout(Duration::from_secs(60))
            .user_agent(concat!("agentstore-bench/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| format!("HTTP client: {}", describe(&e)))
    }

    /// One call with the emulator's token; counted.
    async fn call(&self, method: Method, url: &str, body: Option<&Value>) -> Result<Reply, String> {
        self.tally.call();
        let mut builder = self
            .http
            .request(method.clone(), url)
            .bearer_auth("owner")
            .header(reqwest::header::ACCEPT, "application/json");
        if let Some(body) = body {
            let bytes = serde_json::to_vec(body).map_err(|e| format!("encoding a body: {e}"))?;
            builder = builder.header(reqwest::header::CONTENT_TYPE, "application/json").body(bytes);
        }
        let response = builder.send().await.map_err(|e| format!("{method} {url}: {}", describe(&e)))?;
        let status = response.status();
        let bytes =
            response.bytes().await.map_err(|e| format!("{method} {url}: reading the body: {}", describe(&e)))?;
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).map_err(|e| format!("{method} {url}: {status} with bad JSON: {e}"))?
        };
        Ok(Reply { status, body })
    }

    fn method_url(&self, method: &str) -> String {
        format!("{}:{method}", self.root_url)
    }

    /// The resource name of a document of the collection. The bench's ids contain no `/` or `%`,
    /// so the Firestore document id is the composite id itself.
    fn document_name(&self, id: &str) -> String {
        format!("{}/{}/{id}", self.root_name, self.collection)
    }

    async fn get(&self, id: &str) -> Result<Fetched, String> {
        let url = format!("{}/{}/{}", self.root_url, self.collection, utf8_percent_encode(id, SEGMENT));
        let reply = self.call(Method::GET, &url, None).await?;
        if reply.status != StatusCode::OK {
            return Err(format!("raw GET {id}: {}: {}", reply.status, reply.body));
        }
        let Value::Object(mut document) = reply.body else {
            return Err(format!("raw GET {id}: not a document: {}", reply.body));
        };
        match (document.remove("fields"), document.remove("updateTime")) {
            (Some(Value::Object(fields)), Some(Value::String(update_time))) => Ok(Fetched { fields, update_time }),
            _ => Err(format!("raw GET {id}: a document without fields or updateTime")),
        }
    }

    /// GET, change the fields, `:commit` them back under `currentDocument.updateTime`; a failed
    /// precondition (or `ABORTED`) starts again.
    async fn read_modify_write(&self, id: &str, change: impl Fn(&mut Map<String, Value>)) -> Result<(), String> {
        let url = self.method_url("commit");
        for _ in 0..=RAW_CONFLICT_RETRIES {
            let Fetched { mut fields, update_time } = self.get(id).await?;
            change(&mut fields);
            let body = json!({ "writes": [{
                "update": { "name": self.document_name(id), "fields": fields },
                "currentDocument": { "updateTime": update_time },
            }] });
            let reply = self.call(Method::POST, &url, Some(&body)).await?;
            if reply.status == StatusCode::OK {
                if reply.body.pointer("/writeResults/0/updateTime").is_some_and(Value::is_string) {
                    return Ok(());
                }
                return Err(format!("raw :commit {id}: no updateTime in {}", reply.body));
            }
            match reply.status_name() {
                "FAILED_PRECONDITION" | "ABORTED" => {
                    self.tally.conflict();
                }
                _ => return Err(format!("raw :commit {id}: {}: {}", reply.status, reply.body)),
            }
        }
        Err(format!("raw :commit {id}: still conflicting after {RAW_CONFLICT_RETRIES} retries"))
    }

    /// Runs `structured` (without `from`, `orderBy`, `limit`, `startAt`) over the collection in
    /// pages of `limit` ordered by `__name__`, following the cursor after every full page as the
    /// adapter does; the documents.
    async fn run_query(&self, structured: Value, limit: usize) -> Result<Vec<Value>, String> {
        let url = self.method_url("runQuery");
        let mut documents = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let mut query = structured.clone();
            query["from"] = json!([{ "collectionId": self.collection }]);
            query["orderBy"] = json!([{ "field": { "fieldPath": "__name__" }, "direction": "ASCENDING" }]);
            query["limit"] = json!(limit);
            if let Some(name) = after.take() {
                query["startAt"] = json!({ "values": [{ "referenceValue": name }], "before": false });
            }
            let reply = self.call(Method::POST, &url, Some(&json!({ "structuredQuery": query }))).await?;
            if reply.status != StatusCode::OK {
                return Err(format!("raw :runQuery: {}: {}", reply.status, reply.body));
            }
            let Value::Array(results) = reply.body else {
                return Err(format!("raw :runQuery: not a list: {}", reply.body));
            };
            let page: Vec<Value> =
                results.into_iter().filter_map(|mut r| r.get_mut("document").map(Value::take)).collect();
            if page.len() >= limit {
                after = page.last().and_then(|d| d.get("name")).and_then(Value::as_str).map(str::to_owned);
            }
            documents.extend(page);
            if after.is_none() {
                return Ok(documents);
            }
        }
    }

    /// The listing filter: `userId` and `namespace` equal, as the adapter sends it.
    fn namespace_filter(namespace: &str) -> Value {
        let equal = |field: &str, value: &str| json!({ "fieldFilter": { "field": { "fieldPath": field }, "op": "EQUAL", "value": string_value(value) } });
        json!({ "compositeFilter": { "op": "AND", "filters": [equal(USER_ID_FIELD, USER), equal(NAMESPACE_FIELD, namespace)] } })
    }

    async fn list_keys(&self, namespace: &str) -> Result<Vec<String>, String> {
        let fields: Vec<Value> =
            [KEY_FIELD, ID_FIELD, CHUNKS_FIELD].iter().map(|f| json!({ "fieldPath": f })).collect();
        let query = json!({ "where": Self::namespace_filter(namespace), "select": { "fields": fields } });
        let documents = self.run_query(query, self.list_limit).await?;
        let mut keys = documents
            .iter()
            .map(|d| d.pointer("/fields/key/stringValue").and_then(Value::as_str).map(str::to_owned))
            .collect::<Option<Vec<String>>>()
            .ok_or_else(|| format!("raw :runQuery {namespace}: a document without a key"))?;
        keys.sort_unstable();
        Ok(keys)
    }

    async fn get_all(&self, namespace: &str) -> Result<Vec<(String, Value)>, String> {
        let query = json!({ "where": Self::namespace_filter(namespace) });
        let documents = self.run_query(query, self.get_all_limit).await?;
        let mut entries = documents
            .iter()
            .map(|d| {
                let key = d.pointer("/fields/key/stringValue").and_then(Value::as_str)?;
                Some((key.to_owned(), d.pointer("/fields/value").map(from_fs).unwrap_or(Value::Null)))
            })
            .collect::<Option<Vec<(String, Value)>>>()
            .ok_or_else(|| format!("raw :runQuery {namespace}: a document without a key"))?;
        entries.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        Ok(entries)
    }

    /// Documents of the namespace, by a query over the whole collection with no filter, only
    /// ordered by `__name__` (verification only).
    async fn count_in_collection(&self, namespace: &str) -> Result<usize, String> {
        let query = json!({ "select": { "fields": [{ "fieldPath": NAMESPACE_FIELD }] } });
        let documents = self.run_query(query, COUNT_PAGE).await?;
        Ok(documents
            .iter()
            .filter(|d| d.pointer("/fields/namespace/stringValue").and_then(Value::as_str) == Some(namespace))
            .count())
    }

    /// Clears the emulator's copy of the bench's project (emulator-only endpoint).
    async fn clear_project(&self) -> Result<(), String> {
        let url = format!("{}/emulator/v1/projects/{}/databases/(default)/documents", self.base, self.project);
        let reply = self.call(Method::DELETE, &url, None).await?;
        if reply.status.is_success() {
            Ok(())
        } else {
            Err(format!("DELETE {url}: {}: {}", reply.status, reply.body))
        }
    }
}

/// Counts an access in the fields, as the facade does.
fn record_access(fields: &mut Map<String, Value>, now: &str) {
    let count = integer_field(fields, "accessCount");
    fields.insert("accessCount".into(), json!({ "integerValue": (count + 1).to_string() }));
    fields.insert("lastAccessedAt".into(), string_value(now));
    fields.insert("lastAccessedByAgent".into(), string_value(AGENT));
}

impl Bench for Ctx {
    const SOURCE: &'static str = NAME;

    /// The REST calls one operation makes, on both sides.
    fn calls(pair: Pair) -> &'static str {
        match pair {
            Pair::Get => "GET",
            Pair::GetTracked | Pair::Set => "GET + :commit",
            Pair::ListKeys | Pair::GetAll => ":runQuery",
        }
    }

    fn description(pair: Pair) -> &'static str {
        match pair {
            Pair::Get => "facade get with track_reads=false (one GET of the document) vs raw GET",
            Pair::GetTracked => {
                "facade get with access tracking (GET + :commit under currentDocument.updateTime) vs raw GET + the \
                 same :commit"
            }
            Pair::Set => {
                "facade set of an existing key (GET + :commit under currentDocument.updateTime) vs raw GET + the same \
                 :commit"
            }
            Pair::ListKeys => {
                "facade list_keys of a 100-key namespace (:runQuery, userId/namespace equality, select key/_id/_chunks, \
                 orderBy __name__, limit 1000) vs raw :runQuery, same body"
            }
            Pair::GetAll => {
                "facade get_all of a 100-key namespace (:runQuery, all fields, limit 100, startAt cursor after a full \
                 page) vs raw :runQuery, same bodies"
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
            Pair::GetTracked => {
                raw.read_modify_write(&id, |fields| record_access(fields, &timestamp::now())).await.map(|()| 1)
            }
            Pair::Set => raw
                .read_modify_write(&id, |fields| {
                    let now = timestamp::now();
                    fields.insert("value".into(), to_fs(&value));
                    let stored = fields.get_mut("metadata").and_then(|m| m.pointer_mut("/mapValue/fields"));
                    match (stored, &metadata) {
                        (Some(Value::Object(stored)), Value::Object(update)) => {
                            stored.extend(update.iter().map(|(k, v)| (k.clone(), to_fs(v))))
                        }
                        _ => {
                            fields.insert("metadata".into(), to_fs(&metadata));
                        }
                    }
                    fields.insert("updatedAt".into(), string_value(&now));
                    record_access(fields, &now);
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
            Precondition::MustNotExist => ":batchWrite x100",
            _ => ":commit x1",
        }
    }

    /// An unfiltered query of the whole collection.
    async fn count(&self, namespace: &str) -> Result<usize, String> {
        self.raw.count_in_collection(namespace).await
    }
}

/// Documents written by each side of the model phase's write comparison.
const MODEL_WRITES: usize = 2_000;
/// Concurrent writers in that comparison.
const MODEL_WRITERS: usize = 8;
/// Page sizes of the feed read and of `all_docs`, and `all_docs` pages timed.
const FEED_PAGE: usize = 1_000;
const ALL_DOCS_PAGE: usize = 100;
const ALL_DOCS_PAGES: usize = 200;

/// The document model's costs (printed, not in the JSON report):
/// - creates of one document by `:commit`, `MODEL_WRITERS` at a time: the previous release's
///   fields against the same plus `_rev`, `_revs`, `_deleted` and the `_changedAt` transform
///   (what the new layout adds to every write, and its extra index entries);
/// - the whole change feed read from the start in pages of `FEED_PAGE` (changes per second);
/// - `all_docs` pages of `ALL_DOCS_PAGE` from evenly spread start ids, both directions (p50, p99).
async fn model_phase(backend: &Arc<dyn DocumentBackend>, raw: &Raw) -> Result<(), String> {
    use agentstore::backend::revision::{PackedAncestry, RevisionId};
    use agentstore::backend::IdRange;
    use base64::Engine as _;
    use futures::StreamExt;

    println!("\ndocument model ({MODEL_WRITES} creates a side, {MODEL_WRITERS} at a time; feed pages of {FEED_PAGE}; all_docs pages of {ALL_DOCS_PAGE})");
    for with_model in [false, true] {
        let started = Instant::now();
        let mut failures = 0usize;
        let outcomes: Vec<bool> = futures::stream::iter(0..MODEL_WRITES)
            .map(|n| async move {
                let id = format!("model_user:{}:{n}", if with_model { "after" } else { "before" });
                let mut fields = json!({
                    "_id": string_value(&id), "userId": string_value("model_user"), "namespace": string_value("m"),
                    "key": string_value(&n.to_string()), "value": { "integerValue": n.to_string() },
                });
                let mut write = json!({ "currentDocument": { "exists": false } });
                if with_model {
                    let rev = RevisionId::next_after(None).expect("random");
                    let ancestry = PackedAncestry::extend(None, &rev, 1000);
                    fields["_rev"] = string_value(rev.to_revision().as_str());
                    fields["_revs"] =
                        json!({ "bytesValue": base64::engine::general_purpose::STANDARD.encode(&ancestry.0) });
                    fields["_deleted"] = json!({ "booleanValue": false });
                    write["updateTransforms"] =
                        json!([{ "fieldPath": "_changedAt", "setToServerValue": "REQUEST_TIME" }]);
                }
                write["update"] = json!({ "name": raw.document_name(&id), "fields": fields });
                let reply =
                    raw.call(Method::POST, &raw.method_url("commit"), Some(&json!({ "writes": [write] }))).await;
                matches!(reply, Ok(r) if r.status.is_success())
            })
            .buffer_unordered(MODEL_WRITERS)
            .collect()
            .await;
        failures += outcomes.iter().filter(|ok| !**ok).count();
        let seconds = started.elapsed().as_secs_f64();
        println!(
            "  creates, {:<40} {:>8.0} docs/s ({failures} failed)",
            if with_model { "with the model's fields (this release)" } else { "previous release's fields" },
            MODEL_WRITES as f64 / seconds
        );
        if failures > 0 {
            return Err(format!("{failures} model-phase creates failed"));
        }
    }

    let started = Instant::now();
    let (mut since, mut fed, mut pages, mut ids) = (None::<String>, 0usize, 0usize, Vec::new());
    loop {
        let page = backend.changes(since.as_deref(), FEED_PAGE).await.map_err(|e| describe(&e))?;
        pages += 1;
        fed += page.changes.len();
        ids.extend(page.changes.iter().filter(|c| !c.deleted).map(|c| c.id.clone()));
        let done = page.changes.len() < FEED_PAGE;
        since = Some(page.last_seq);
        if done {
            break;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "  changes from the start: {fed} changes in {pages} pages, {:.0} changes/s, {:.1} ms a page",
        fed as f64 / seconds,
        seconds * 1000.0 / pages as f64
    );

    ids.sort();
    let mut histogram = common::load::histogram();
    for n in 0..ALL_DOCS_PAGES {
        let start = ids.get(n * ids.len() / ALL_DOCS_PAGES).cloned();
        let range = IdRange { start, end: None, inclusive_end: true, descending: n % 2 == 1, include_design: false };
        let started = Instant::now();
        let page = backend.all_docs(&range, ALL_DOCS_PAGE, None).await.map_err(|e| describe(&e))?;
        histogram.record(started.elapsed().as_micros().max(1) as u64).map_err(|e| format!("histogram: {e}"))?;
        if page.items.is_empty() {
            return Err("an all_docs page from a live id came back empty".into());
        }
    }
    println!(
        "  all_docs pages of {ALL_DOCS_PAGE} over {} live documents: p50 {:.1} ms, p99 {:.1} ms ({ALL_DOCS_PAGES} pages, half descending)",
        ids.len(),
        common::load::quantile_ms(&histogram, 0.5),
        common::load::quantile_ms(&histogram, 0.99)
    );
    Ok(())
}

pub fn main() -> std::process::ExitCode {
    common::bench_main(NAME, run)
}

/// Runs the benchmark; Ok(false) when any operation failed.
fn run() -> Result<bool, String> {
    let config = Config::from_env(true)?;
    println!(
        "firestore_bench: DataStore facade over the Firestore adapter vs the same REST calls by hand, and bulk writes"
    );
    let nproc = config.print();

    // The shared test-server launcher: AGENTSTORE_BENCH_FIRESTORE_EMULATOR names an emulator, else
    // the emulator jar runs for as long as this process.
    let external = match std::env::var("AGENTSTORE_BENCH_FIRESTORE_EMULATOR") {
        Ok(host_port) if !host_port.trim().is_empty() => {
            let host_port = host_port.trim().trim_start_matches("http://").trim_end_matches('/');
            std::env::set_var("AGENTSTORE_TEST_FIRESTORE_EMULATOR", host_port);
            true
        }
        _ => false,
    };
    let server = servers::firestore()?;
    let (host_port, product) = (server.host_port, server.product);
    let suffix = common::run_suffix();
    let project = format!("agentstore-bench-{}", std::process::id());
    let collection = format!("agentstore_bench_{suffix}");

    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| format!("tokio runtime: {e}"))?;
    let outcome = runtime.block_on(async {
        println!("server: {product} at {host_port}");

        let url = format!("firestore://{project}?emulator={host_port}&collection={collection}");
        let firestore = FirestoreConfig::parse(&url).map_err(|e| describe(&e))?;
        let backend: Arc<dyn DocumentBackend> = Arc::new(
            FirestoreBackend::open(&firestore).await.map_err(|e| format!("opening the adapter: {}", describe(&e)))?,
        );
        println!("project: {project}, collection: {collection} (fresh)");
        let facades = Facades::open(&backend).await?;
        let page_size = facades.page_size();
        let base = format!("http://{host_port}");
        let root_name = format!("projects/{project}/databases/(default)/documents");
        let raw = Raw {
            http: Raw::client()?,
            root_url: format!("{base}/v1/{root_name}"),
            base,
            project: project.clone(),
            root_name,
            collection: collection.clone(),
            list_limit: page_size.max(1),
            get_all_limit: page_size.clamp(1, GET_ALL_PAGE_SIZE),
            tally: Tally::default(),
        };

        let seeding = Instant::now();
        facades.seed(&backend, NAME, Precondition::MustNotExist).await?;
        print_seeded("bulk_write (:batchWrite)", seeding.elapsed().as_secs_f64());
        let ctx = Arc::new(Ctx { facades, raw });
        ctx.facades.check_same_listing(ctx.raw.list_keys(&document(0).0).await?, ":runQuery").await?;

        let results = run_pairs(&ctx, &PAIRS, &config).await?;
        let bulk_results = run_bulk(ctx.as_ref(), &backend, config.bulk_docs, &LABELS).await?;
        model_phase(&backend, &ctx.raw).await?;

        // Best effort: leave nothing behind on a shared emulator.
        if let Err(e) = ctx.raw.clear_project().await {
            eprintln!("firestore_bench: could not clear project {project}: {e}");
        }
        Ok::<_, String>((results, bulk_results))
    });
    drop(runtime);
    let (results, bulk) = outcome?;

    print_tables(
        &LABELS,
        &results,
        "(ops/s and latency over successful operations; latency is one whole operation; ratios: facade p50 / raw p50 \
         and raw ops/s / facade ops/s, above 1 = facade slower; calls/op = raw REST calls per operation)",
        Some((
            &bulk,
            "(docs/s = documents written / wall time of all batches; batch latency = one bulk_write call; in \
             collection = documents of the namespace in an unfiltered :runQuery of the collection afterwards; listed \
             = facade list_keys afterwards, pages followed)",
        )),
    );
    for b in bulk.iter().filter(|b| b.listed != b.verified) {
        eprintln!(
            "firestore_bench: note: the collection holds {} Precondition::{} documents but list_keys returns {}",
            b.verified, b.precondition, b.listed
        );
    }

    let origin = Origin {
        name: NAME,
        server: &product,
        server_origin: if external {
            "AGENTSTORE_BENCH_FIRESTORE_EMULATOR"
        } else {
            "java -cp cloud-firestore-emulator.jar (google-cloud-cli-firestore-emulator), started by tests/common/servers.rs"
        },
    };
    conclude(&origin, &config, nproc, &results, Some(&bulk), &LABELS)
}
