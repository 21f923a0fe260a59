//! Overhead of the CouchDB adapter: the `DataStore` facade over `CouchDbBackend` against the raw
//! HTTP calls it makes, side by side in one run.
//!
//! Run it with `cargo bench --bench benches -- couchdb_overhead`. The server is `AGENTSTORE_BENCH_COUCHDB_URL`
//! (e.g. `http://admin:password@127.0.0.1:5984`) when set; otherwise `pouchdb-server` from
//! `node_modules` (installed by `npm ci`) is started in memory on a free port by the tests'
//! launcher (`tests/common/servers.rs`), which stops it when the bench process exits. Which server answered (product
//! and version from `GET /`) is printed. The bench creates a fresh database, seeds 1,000 documents
//! (1 user × 10 namespaces × 100 keys) with the adapter's `_bulk_docs` and the facade's document
//! bodies, then makes one warm-up `set` per namespace through the facade, so its once-per-namespace
//! ensure-index call is never timed (none of this is timed). Then it measures four pairs:
//!
//! | pair        | facade                                          | raw (reqwest by hand)                                   |
//! |-------------|-------------------------------------------------|---------------------------------------------------------|
//! | `get`       | `DataStore::get`, `track_reads=false`: one GET  | `GET /db/{id}` + JSON parse                             |
//! | `get+track` | `DataStore::get`, access tracking: GET + PUT    | `GET /db/{id}`, bump `accessCount`, `PUT` with `_rev`   |
//! | `set`       | `DataStore::set` of an existing key: GET + PUT  | `GET`, replace value, merge metadata, `PUT` with `_rev` |
//! | `list_keys` | `DataStore::list_keys`, 100 keys: one `_find`   | `POST /db/_find`, same selector/fields/limit/use_index  |
//!
//! Both sides make the same HTTP calls, each on its own `reqwest::Client` built like the adapter's
//! (keep-alive pool, same timeouts, basic auth, `Accept: application/json`), so the difference is
//! the facade and adapter code: validation, id building, body conversion, error mapping, retry
//! wrappers. Every phase is a closed loop of `BENCH_CLIENTS` (default 8) concurrent tasks, and each
//! side of a pair is bounded by `BENCH_SECONDS` (default 3) and `BENCH_MAX_REQUESTS` (default
//! 5,000) in total (the harness shared with the other adapter benches, `benches/common/`). To cancel drift (the server slowing as revisions pile up, other load on the
//! machine, CPU clocks), each side's budget is split over eight short segments (`SEGMENTS_PER_SIDE`)
//! run alternately as ABBA BAAB ABBA BAAB (A = facade), after an untimed warm-up of
//! both sides. Latency is wall-clock around one whole operation (inputs are built before the clock
//! starts); throughput is successful operations over the side's summed segment time. The
//! raw side retries a 409 at once (the facade with backoff), counted as `conflicts_retried`. `writes/op` is the
//! database's `update_seq` growth per operation, which shows the call pattern from the server's
//! side (0 for reads, 1 for one PUT).
//!
//! Then the document model's reads, one client, eight rounds a side in ABBA order: the `changes`
//! read rate (whole passes over the feed of the 1,000 documents in pages of 100, adapter vs
//! `GET _changes?since=&limit=` by hand) and the `all_docs` page latency (pages of 100 in id
//! order, adapter vs `GET _all_docs?include_docs=true&startkey=&limit=` by hand); printed after
//! the table.
//!
//! Results go to stdout as a table and to `target/bench/couchdb_overhead.json`. Any failed
//! operation (warm-up included) makes the bench exit 1.
//!
//! `cargo test --all-targets` also builds and runs the bench binary (without `--bench`); it then only
//! prints how to run it and exits 0.

use std::sync::Arc;
use std::time::{Duration, Instant};

use agentstore::backend::couchdb::{CouchConfig, CouchDbBackend, INDEX_NAME};
use agentstore::backend::{DocumentBackend, Precondition};
use agentstore::model::{id::encode_key, timestamp};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use reqwest::{Method, StatusCode};
use serde_json::{json, Map, Value};

use crate::common;
use crate::servers;

use common::facade::Facades;
use common::load::{run_pairs, Bench, Counters, Labels, Tally};
use common::report::{conclude, print_tables, Origin};
use common::workload::{document, Input, Pair, AGENT, KEYS_PER_NAMESPACE, NAMESPACES, TOTAL_KEYS, USER};
use common::{describe, Config};

const NAME: &str = "couchdb_overhead";
/// The adapter's default request timeout (`timeout_secs` of the backend URL).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How often the raw side re-reads after a 409, as the facade's default `max_conflict_retries`.
const RAW_CONFLICT_RETRIES: usize = 100;
/// Path-segment escaping, as the adapter does it: everything but RFC 3986 unreserved characters.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');
/// `get_all` is measured by the DynamoDB and Firestore benches only.
const NOT_MEASURED: &str = "get_all is not measured by couchdb_overhead";
const PAIRS: [Pair; 4] = [Pair::Get, Pair::GetTracked, Pair::Set, Pair::ListKeys];
const LABELS: Labels = Labels {
    calls_column: "HTTP calls",
    calls_key: "http_calls_per_op",
    counter_column: "writes/op",
    counter_key: "server_writes_per_op",
    counter_total_key: Some("server_writes"),
    raw_only: false,
    container: "database",
};

/// Server-side writes one successful operation makes.
fn writes_per_op(pair: Pair) -> u64 {
    match pair {
        Pair::Get | Pair::ListKeys | Pair::GetAll => 0,
        Pair::GetTracked | Pair::Set => 1,
    }
}

// ---- the server ----

/// Where the server is: `base` has no credentials and no trailing slash.
struct ServerAddress {
    url: url::Url,
    base: String,
    user: Option<String>,
    password: Option<String>,
}

impl ServerAddress {
    fn parse(text: &str) -> Result<Self, String> {
        let url = url::Url::parse(text.trim()).map_err(|e| format!("server URL {text:?}: {e}"))?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none_or(str::is_empty) {
            return Err(format!("server URL {text:?} must be http(s)://[user:password@]host[:port]"));
        }
        let decode = |part: &str| percent_encoding::percent_decode_str(part).decode_utf8_lossy().into_owned();
        let user = (!url.username().is_empty()).then(|| decode(url.username()));
        let password = url.password().map(decode);
        let mut base = url.clone();
        let _ = base.set_username("");
        let _ = base.set_password(None);
        base.set_path("");
        base.set_query(None);
        let base = base.as_str().trim_end_matches('/').to_owned();
        Ok(ServerAddress { url, base, user, password })
    }

    /// The adapter's backend URL for `database`, created if missing.
    fn backend_url(&self, database: &str) -> String {
        let mut url = self.url.clone();
        url.set_path(database);
        url.set_query(Some("create=true"));
        format!("couchdb+{url}")
    }

    /// The server with the password hidden.
    fn redacted(&self) -> String {
        match &self.user {
            Some(user) => {
                let (scheme, rest) = self.base.split_once("://").unwrap_or(("http", &self.base));
                format!("{scheme}://{user}:***@{rest}")
            }
            None => self.base.clone(),
        }
    }
}

/// A request to the server with the credentials and `Accept` header the adapter sends.
fn request(http: &reqwest::Client, address: &ServerAddress, method: Method, url: &str) -> reqwest::RequestBuilder {
    let request = http.request(method, url).header(reqwest::header::ACCEPT, "application/json");
    match &address.user {
        Some(user) => request.basic_auth(user, address.password.as_deref()),
        None => request,
    }
}

/// What answered `GET /`: `pouchdb-server 4.2.0` or `Apache CouchDB 3.4.3`.
async fn identify(http: &reqwest::Client, address: &ServerAddress) -> Result<String, String> {
    let url = format!("{}/", address.base);
    let welcome: Value = request(http, address, Method::GET, &url)
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .map_err(|e| format!("GET {}/: {}", address.base, describe(&e)))?
        .json()
        .await
        .map_err(|e| format!("GET {}/ is not CouchDB's welcome: {}", address.base, describe(&e)))?;
    let version = welcome["version"].as_str().unwrap_or("?");
    Ok(if welcome.get("express-pouchdb").is_some() {
        format!("pouchdb-server {version}")
    } else if welcome.get("couchdb").is_some() {
        format!("Apache CouchDB {version}")
    } else {
        format!("unknown CouchDB-protocol server {version} ({welcome})")
    })
}

// ---- the two sides ----

/// Everything the operations need, shared by the client tasks.
struct Ctx {
    /// `get` without tracking is one GET; with tracking GET + PUT.
    facades: Facades,
    raw: Raw,
}

/// The raw side: reqwest by hand, on its own client built like the adapter's.
struct Raw {
    http: reqwest::Client,
    address: ServerAddress,
    /// `{base}/{database}`.
    db_url: String,
    /// The `_find` limit the facade sends: its page size.
    find_limit: usize,
    /// The design document of `idx-user-namespace`, as the adapter learns it from `POST _index`.
    index_ddoc: Option<String>,
    /// 409s retried (calls are counted by the server's update_seq).
    tally: Tally,
}

/// One response: status and parsed JSON body.
struct RawReply {
    status: StatusCode,
    body: Value,
}

impl Raw {
    /// The same client settings as the adapter's `CouchClient`.
    fn client() -> Result<reqwest::Client, String> {
        reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .timeout(REQUEST_TIMEOUT)
            .pool_idle_timeout(Duration::from_secs(60))
            .user_agent(concat!("agentstore-bench/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| format!("HTTP client: {}", describe(&e)))
    }

    async fn call(&self, method: Method, url: &str, body: Option<&Value>) -> Result<RawReply, String> {
        let mut builder = request(&self.http, &self.address, method.clone(), url);
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
        Ok(RawReply { status, body })
    }

    fn doc_url(&self, namespace: &str, key: &str) -> String {
        let id = format!("{USER}:{namespace}:{}", encode_key(key));
        format!("{}/{}", self.db_url, utf8_percent_encode(&id, SEGMENT))
    }

    async fn get(&self, url: &str) -> Result<Map<String, Value>, String> {
        let reply = self.call(Method::GET, url, None).await?;
        match (reply.status, reply.body) {
            (StatusCode::OK, Value::Object(doc)) if doc.get("_rev").is_some_and(Value::is_string) => Ok(doc),
            (status, body) => Err(format!("GET {url}: {status}: {body}")),
        }
    }

    /// GET, change the document, PUT it back with its `_rev`; a 409 starts again.
    async fn read_modify_write(&self, url: &str, change: impl Fn(&mut Map<String, Value>)) -> Result<(), String> {
        for _ in 0..=RAW_CONFLICT_RETRIES {
            let mut doc = self.get(url).await?;
            change(&mut doc);
            let reply = self.call(Method::PUT, url, Some(&Value::Object(doc))).await?;
            match reply.status {
                StatusCode::CREATED | StatusCode::ACCEPTED if reply.body.get("rev").is_some_and(Value::is_string) => {
                    return Ok(())
                }
                StatusCode::CONFLICT => {
                    self.tally.conflict();
                }
                status => return Err(format!("PUT {url}: {status}: {}", reply.body)),
            }
        }
        Err(format!("PUT {url}: still conflicting after {RAW_CONFLICT_RETRIES} retries"))
    }

    fn find_body(&self, namespace: &str) -> Value {
        let mut body = json!({
            "selector": { "userId": USER, "namespace": namespace },
            "fields": ["_id", "_rev", "key"],
            "limit": self.find_limit,
        });
        if let Some(ddoc) = &self.index_ddoc {
            body["use_index"] = json!([ddoc, INDEX_NAME]);
        }
        body
    }

    async fn list_keys(&self, namespace: &str) -> Result<Vec<String>, String> {
        let url = format!("{}/_find", self.db_url);
        let reply = self.call(Method::POST, &url, Some(&self.find_body(namespace))).await?;
        if reply.status != StatusCode::OK {
            return Err(format!("POST {url}: {}: {}", reply.status, reply.body));
        }
        let Some(docs) = reply.body.get("docs").and_then(Value::as_array) else {
            return Err(format!("POST {url}: no docs in {}", reply.body));
        };
        let mut keys = docs
            .iter()
            .map(|doc| doc.get("key").and_then(Value::as_str).map(str::to_owned))
            .collect::<Option<Vec<String>>>()
            .ok_or_else(|| format!("POST {url}: a document without a key"))?;
        keys.sort_unstable();
        Ok(keys)
    }

    /// The database's `update_seq` (a number on pouchdb-server, `"N-…"` on CouchDB).
    async fn update_seq(&self) -> Result<u64, String> {
        let reply = self.call(Method::GET, &self.db_url, None).await?;
        let seq = match &reply.body["update_seq"] {
            Value::Number(n) => n.as_u64(),
            Value::String(s) => s.split('-').next().and_then(|n| n.parse().ok()),
            _ => None,
        };
        seq.ok_or_else(|| format!("GET {}: no update_seq in {}", self.db_url, reply.body))
    }
}

impl Bench for Ctx {
    const SOURCE: &'static str = NAME;

    /// The HTTP calls one operation makes, on both sides.
    fn calls(pair: Pair) -> &'static str {
        match pair {
            Pair::Get => "GET",
            Pair::GetTracked => "GET + PUT",
            Pair::Set => "GET + PUT",
            Pair::ListKeys => "POST _find",
            Pair::GetAll => "-",
        }
    }

    fn description(pair: Pair) -> &'static str {
        match pair {
            Pair::Get => "facade get with track_reads=false (exactly one GET) vs raw GET /db/{id} + JSON parse",
            Pair::GetTracked => "facade get with access tracking (GET + PUT) vs raw GET + PUT with _rev",
            Pair::Set => {
                "facade set of an existing key (GET + PUT; namespace index already ensured) vs raw GET + PUT with _rev"
            }
            Pair::ListKeys => {
                "facade list_keys of a 100-key namespace (one _find, page_size 1000) vs raw POST /db/_find, same body"
            }
            Pair::GetAll => NOT_MEASURED,
        }
    }

    fn facades(&self) -> &Facades {
        &self.facades
    }

    async fn raw_op(&self, pair: Pair, input: Input) -> Result<usize, String> {
        let raw = &self.raw;
        let Input { namespace, key, value, metadata, .. } = input;
        match pair {
            Pair::Get => raw.get(&raw.doc_url(&namespace, &key)).await.map(|_| 1),
            Pair::GetTracked => raw
                .read_modify_write(&raw.doc_url(&namespace, &key), |doc| {
                    let count = doc.get("accessCount").and_then(Value::as_u64).unwrap_or(0);
                    doc.insert("accessCount".into(), (count + 1).into());
                    doc.insert("lastAccessedAt".into(), timestamp::now().into());
                    doc.insert("lastAccessedByAgent".into(), AGENT.into());
                })
                .await
                .map(|()| 1),
            Pair::Set => raw
                .read_modify_write(&raw.doc_url(&namespace, &key), |doc| {
                    let now = timestamp::now();
                    doc.insert("value".into(), value.clone());
                    match (doc.get_mut("metadata"), &metadata) {
                        (Some(Value::Object(stored)), Value::Object(update)) => {
                            stored.extend(update.iter().map(|(k, v)| (k.clone(), v.clone())))
                        }
                        _ => {
                            doc.insert("metadata".into(), metadata.clone());
                        }
                    }
                    let count = doc.get("accessCount").and_then(Value::as_u64).unwrap_or(0);
                    doc.insert("accessCount".into(), (count + 1).into());
                    doc.insert("updatedAt".into(), now.clone().into());
                    doc.insert("lastAccessedAt".into(), now.into());
                    doc.insert("lastAccessedByAgent".into(), AGENT.into());
                })
                .await
                .map(|()| 1),
            Pair::ListKeys => Ok(raw.list_keys(&namespace).await?.len()),
            Pair::GetAll => Err(NOT_MEASURED.into()),
        }
    }

    /// The database's `update_seq` (server writes) and the raw side's retried 409s.
    async fn counters(&self) -> Result<Counters, String> {
        Ok(Counters { counted: self.raw.update_seq().await?, conflicts: self.raw.tally.counters().conflicts })
    }
}

pub fn main() -> std::process::ExitCode {
    common::bench_main(NAME, run)
}

/// Runs the benchmark; Ok(false) when any operation failed.
fn run() -> Result<bool, String> {
    let config = Config::from_env(false)?;
    println!("couchdb_overhead: DataStore facade over the CouchDB adapter vs the same HTTP calls by hand");
    let nproc = config.print();

    // The shared test-server launcher: AGENTSTORE_BENCH_COUCHDB_URL names a server, else
    // pouchdb-server from node_modules runs (in memory) for as long as this process.
    let external = std::env::var("AGENTSTORE_BENCH_COUCHDB_URL").is_ok_and(|url| !url.trim().is_empty());
    if external {
        if let Ok(url) = std::env::var("AGENTSTORE_BENCH_COUCHDB_URL") {
            std::env::set_var("AGENTSTORE_TEST_COUCHDB_URL", url.trim());
        }
    }
    let server_url = servers::couchdb()?.url;
    let address = ServerAddress::parse(&server_url)?;
    let database = format!("agentstore_bench_{}", common::run_suffix());

    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| format!("tokio runtime: {e}"))?;
    let outcome = runtime.block_on(async {
        let http = Raw::client()?;
        let product = identify(&http, &address).await?;
        let origin = if external { "AGENTSTORE_BENCH_COUCHDB_URL" } else { "started from node_modules, in memory" };
        println!("server: {product} at {} ({origin})", address.redacted());
        println!("database: {database} (fresh)");

        let couch = CouchConfig::parse(&address.backend_url(&database)).map_err(|e| describe(&e))?;
        let backend: Arc<dyn DocumentBackend> =
            Arc::new(CouchDbBackend::open(&couch).await.map_err(|e| format!("opening the adapter: {}", describe(&e)))?);
        let facades = Facades::open(&backend).await?;
        let find_limit = facades.page_size();

        let mut raw = Raw {
            http,
            db_url: format!("{}/{}", address.base, utf8_percent_encode(&database, SEGMENT)),
            address,
            find_limit,
            index_ddoc: None,
            tally: Tally::default(),
        };
        // The index exists already (the facade ensured it at open); this learns its design doc,
        // as the adapter does.
        let definition = json!({ "index": { "fields": ["userId", "namespace"] }, "name": INDEX_NAME, "type": "json" });
        let reply = raw.call(Method::POST, &format!("{}/_index", raw.db_url), Some(&definition)).await?;
        if !reply.status.is_success() {
            return Err(format!("POST _index: {}: {}", reply.status, reply.body));
        }
        raw.index_ddoc = reply.body.get("id").and_then(Value::as_str).map(str::to_owned);

        let seeding = Instant::now();
        facades.seed(&backend, NAME, Precondition::MustNotExist).await?;
        println!(
            "seeded {TOTAL_KEYS} documents (1 user x {NAMESPACES} namespaces x {KEYS_PER_NAMESPACE} keys) with \
             _bulk_docs, then one facade set per namespace (ensures its index), in {:.2} s (not timed)",
            seeding.elapsed().as_secs_f64()
        );
        let ctx = Arc::new(Ctx { facades, raw });
        ctx.facades.check_same_listing(ctx.raw.list_keys(&document(0).0).await?, "_find").await?;

        let results = run_pairs(&ctx, &PAIRS, &config).await?;
        let model = document_model::measure(&backend, &ctx.raw, product.starts_with("pouchdb-server")).await?;

        // Best effort: leave nothing behind on a shared server.
        match ctx.raw.call(Method::DELETE, &ctx.raw.db_url, None).await {
            Ok(reply) if reply.status.is_success() => {}
            Ok(reply) => eprintln!("couchdb_overhead: could not delete {database}: {}: {}", reply.status, reply.body),
            Err(e) => eprintln!("couchdb_overhead: could not delete {database}: {e}"),
        }
        Ok::<_, String>((product, results, model))
    });
    drop(runtime);
    let (product, results, model) = outcome?;

    print_tables(
        &LABELS,
        &results,
        "(ops/s and latency over successful operations; latency is one whole operation; ratios: facade p50 / raw p50 \
         and raw ops/s / facade ops/s, above 1 = facade slower; writes/op = database update_seq growth per operation)",
        None,
    );
    for r in &results {
        for side in r.sides() {
            let expected = writes_per_op(r.pair) as f64;
            let made = side.counted_per_op(&LABELS).unwrap_or(0.0);
            if side.ops > 0 && (made - expected).abs() > 0.01 {
                eprintln!(
                    "couchdb_overhead: note: {} {} made {made:.3} server writes per operation, expected {expected}",
                    r.pair.name(),
                    side.side.name(),
                );
            }
        }
    }

    model.print();

    let origin = Origin {
        name: NAME,
        server: &product,
        server_origin: if external {
            "AGENTSTORE_BENCH_COUCHDB_URL"
        } else {
            "node_modules/.bin/pouchdb-server --in-memory"
        },
    };
    conclude(&origin, &config, nproc, &results, None, &LABELS)
}

/// The document model's reads: the change feed and id-ordered pages, through the adapter and by
/// hand, one client, in alternating rounds (ABBA) after one untimed pass of each.
mod document_model {
    use std::time::{Duration, Instant};

    use agentstore::backend::{DocumentBackend, IdRange};
    use reqwest::Method;
    use serde_json::Value;

    use super::Raw;

    /// Rounds of each measurement per side.
    const ROUNDS: usize = 8;
    /// Changes or documents per page, on both sides.
    const PAGE: usize = 100;
    /// The explicit high end the adapter sends pouchdb-server for an open range (see
    /// `src/backend/couchdb/ids.rs`); the raw side sends the same.
    const POUCHDB_HIGH_END: &str = "\u{FFFF}\u{FFFF}";

    #[derive(Default)]
    pub struct Measured {
        /// Changes read per second over one whole pass of the feed, one value per round.
        feed_adapter: Vec<f64>,
        feed_raw: Vec<f64>,
        /// Latency of one `all_docs` page.
        page_adapter: Vec<Duration>,
        page_raw: Vec<Duration>,
        changes_per_pass: usize,
        pages_per_pass: usize,
    }

    pub async fn measure(
        backend: &std::sync::Arc<dyn DocumentBackend>,
        raw: &Raw,
        pouchdb: bool,
    ) -> Result<Measured, String> {
        let mut measured = Measured::default();
        feed_adapter(backend.as_ref()).await?;
        feed_raw(raw).await?;
        pages_adapter(backend.as_ref()).await?;
        pages_raw(raw, pouchdb).await?;
        for round in 0..ROUNDS {
            let adapter_first = matches!(round % 4, 0 | 3);
            for adapter in [adapter_first, !adapter_first] {
                if adapter {
                    let (changes, took) = feed_adapter(backend.as_ref()).await?;
                    measured.changes_per_pass = changes;
                    measured.feed_adapter.push(changes as f64 / took.as_secs_f64());
                    let pages = pages_adapter(backend.as_ref()).await?;
                    measured.pages_per_pass = pages.len();
                    measured.page_adapter.extend(pages);
                } else {
                    let (changes, took) = feed_raw(raw).await?;
                    measured.feed_raw.push(changes as f64 / took.as_secs_f64());
                    measured.page_raw.extend(pages_raw(raw, pouchdb).await?);
                }
            }
        }
        Ok(measured)
    }

    /// One pass over the whole feed through the adapter: changes seen and time taken.
    async fn feed_adapter(backend: &dyn DocumentBackend) -> Result<(usize, Duration), String> {
        let started = Instant::now();
        let (mut seen, mut since) = (0, None);
        loop {
            let page = backend.changes(since.as_deref(), PAGE).await.map_err(|e| format!("changes: {e}"))?;
            seen += page.changes.len();
            if page.changes.len() < PAGE {
                return Ok((seen, started.elapsed()));
            }
            since = Some(page.last_seq);
        }
    }

    /// The same pass by hand: `GET _changes?since=&limit=`.
    async fn feed_raw(raw: &Raw) -> Result<(usize, Duration), String> {
        let started = Instant::now();
        let (mut seen, mut since) = (0, "0".to_owned());
        loop {
            let url = format!("{}/_changes?since={}&limit={PAGE}", raw.db_url, encoded(&since));
            let reply = raw.call(Method::GET, &url, None).await?;
            let results = reply.body["results"].as_array().ok_or_else(|| format!("_changes: {}", reply.body))?;
            seen += results.len();
            if results.len() < PAGE {
                return Ok((seen, started.elapsed()));
            }
            since = match &reply.body["last_seq"] {
                Value::String(seq) => seq.clone(),
                other => other.to_string(),
            };
        }
    }

    /// Every page of `all_docs` through the adapter; the latency of each.
    async fn pages_adapter(backend: &dyn DocumentBackend) -> Result<Vec<Duration>, String> {
        let (mut times, mut token) = (Vec::new(), None);
        loop {
            let started = Instant::now();
            let page = backend
                .all_docs(&IdRange::all(), PAGE, token.as_deref())
                .await
                .map_err(|e| format!("all_docs: {e}"))?;
            times.push(started.elapsed());
            match page.next {
                Some(next) => token = Some(next),
                None => return Ok(times),
            }
        }
    }

    /// The same pages by hand: `GET _all_docs?include_docs=true&limit=&startkey=` (one row more to
    /// learn whether another page follows, one more again for the row the page resumes at).
    async fn pages_raw(raw: &Raw, pouchdb: bool) -> Result<Vec<Duration>, String> {
        let (mut times, mut after): (Vec<Duration>, Option<String>) = (Vec::new(), None);
        loop {
            let started = Instant::now();
            let mut url =
                format!("{}/_all_docs?include_docs=true&limit={}", raw.db_url, PAGE + 1 + usize::from(after.is_some()));
            if let Some(after) = &after {
                url.push_str(&format!("&startkey={}", encoded(&Value::String(after.clone()).to_string())));
            }
            if pouchdb {
                url.push_str(&format!("&endkey={}", encoded(&Value::String(POUCHDB_HIGH_END.into()).to_string())));
            }
            let reply = raw.call(Method::GET, &url, None).await?;
            let rows = reply.body["rows"].as_array().ok_or_else(|| format!("_all_docs: {}", reply.body))?;
            let ids: Vec<&str> = rows
                .iter()
                .filter_map(|row| row["id"].as_str())
                .filter(|id| !id.starts_with("_design/") && Some(*id) != after.as_deref())
                .collect();
            times.push(started.elapsed());
            if ids.len() <= PAGE {
                return Ok(times);
            }
            after = Some(ids[PAGE - 1].to_owned());
        }
    }

    fn encoded(text: &str) -> String {
        url::form_urlencoded::byte_serialize(text.as_bytes()).collect()
    }

    fn median(values: &mut [f64]) -> f64 {
        values.sort_by(f64::total_cmp);
        values.get(values.len() / 2).copied().unwrap_or(0.0)
    }

    fn percentile(values: &mut [Duration], fraction: f64) -> f64 {
        values.sort();
        let index = ((values.len() as f64 * fraction).ceil() as usize).saturating_sub(1);
        values.get(index).map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    }

    impl Measured {
        pub fn print(mut self) {
            println!();
            println!(
                "document model (1 client, {ROUNDS} rounds a side, ABBA; pages of {PAGE}; the feed holds {} changes, \
                 all_docs {} pages)",
                self.changes_per_pass, self.pages_per_pass
            );
            let (adapter, raw) = (median(&mut self.feed_adapter), median(&mut self.feed_raw));
            println!(
                "  changes read rate, median of passes: adapter {adapter:.0} changes/s, raw {raw:.0} changes/s (raw/adapter {:.2})",
                raw / adapter.max(f64::MIN_POSITIVE)
            );
            let (a50, a95) = (percentile(&mut self.page_adapter, 0.5), percentile(&mut self.page_adapter, 0.95));
            let (r50, r95) = (percentile(&mut self.page_raw, 0.5), percentile(&mut self.page_raw, 0.95));
            println!(
                "  all_docs page latency: adapter p50 {a50:.2} ms p95 {a95:.2} ms, raw p50 {r50:.2} ms p95 {r95:.2} ms \
                 (adapter/raw p50 {:.2})",
                a50 / r50.max(f64::MIN_POSITIVE)
            );
        }
    }
}
