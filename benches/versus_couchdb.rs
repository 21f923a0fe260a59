//! agentstore against a real Apache CouchDB 3.4.3 (issue 38): the same client operations on each
//! target in one run, the targets alternated, with ops/s, p50, p99 and the ratio of each target's
//! rate to the real CouchDB's.
//!
//! Run it with `BENCH_COUCHDB_URL=http://admin:password@127.0.0.1:15984 cargo bench --bench benches
//! -- versus_couchdb`. The targets (`BENCH_TARGETS`, names of `benches/common/targets.rs`; by
//! default `apache-couchdb,embedded,couchdb`):
//!
//! - `apache-couchdb`: the server at `BENCH_COUCHDB_URL`, measured directly with the credentials of
//!   that URL (required: every ratio is to it);
//! - `embedded`, `dynamodb`, `firestore`: `agentstore serve --couchdb-listen` (the release binary
//!   cargo built for the bench) over that backend;
//! - `couchdb`: agentstore's CouchDB backend in front of that same real CouchDB;
//! - `pouchdb-leveldb`, `pouchdb-memory`: pouchdb-server 4.2.0 as a user would run it instead.
//!
//! Every agentstore target is started with one admin login and every request to every target
//! carries Basic credentials, as the wrk figures did. On each target, untimed: a fresh
//! database seeded with `BENCH_DOCS` (default 2,000) documents `{"_id": "d000042", "type": "t2",
//! "n": 42, "tag": "g42"}` by `_bulk_docs`; a design document whose view `v` maps
//! `emit(doc.type, doc.n)` with a `_sum` reduce, built by a first query; a json index on `n`,
//! built by a first `_find`; [`SEEDED_ATTACHMENTS`] attachments of `BENCH_ATTACHMENT_MIB`
//! (default 1) MiB; and the data-store documents (1 user × 10 namespaces × 100 keys, the facade's
//! bodies): on agentstore in its data-store database, on the others in a database of their own
//! with a json index on `[userId, namespace]`, as a CouchDB deployment that the data store
//! replaces would have.
//!
//! The workloads ([`Workload`], reads first), each a closed loop of `BENCH_CLIENTS` (default 16)
//! clients, each on a keep-alive connection of its own: on the ordinary database `get`, `create`
//! (`PUT` of a new id), `bulk_100` and `bulk_1000` (`_bulk_docs` of new documents; the writes go
//! to a second ordinary database, so the first one's view and index stay as built), `all_docs` (100 rows with their
//! documents from a varying start), `changes` (a page of 100 from one of the seeded feed's
//! page positions, each the `last_seq` of the page before, read once while seeding), `find` (10 documents by a range of `n` on the json index), `view_key`
//! (`?key=…&reduce=false&limit=10`), `view_group` (`?group=true`, 10 rows), `att_put` and
//! `att_get` (standalone attachment of the size above); on the data-store database `ds_get`,
//! `ds_create`, `ds_find_100` (a namespace by `userId` and `namespace`), `ds_all_docs_100` (a
//! namespace's id range with its documents) and `ds_bulk_100`. `BENCH_WORKLOADS` (names, comma
//! separated) runs a subset.
//!
//! `view_build` is not a closed loop: in a database of its own, loaded once with
//! `BENCH_VIEW_BUILD_DOCS` (default 100,000) documents of the seeded shape by `_bulk_docs` of
//! 1,000, each segment writes a new design document (its map function differs by a comment, so
//! every target builds a new index) and times the first `?reduce=false&limit=1` query, which
//! builds the whole index; its rate is documents indexed per second, its p50/p99 the build's wall
//! time. It runs last, after the write workloads, and only where `BENCH_WORKLOADS` names it or
//! is unset.
//!
//! Alternation: each workload runs `BENCH_SEGMENTS` (default 2) segments of `BENCH_SECONDS`
//! (default 4) / segments per target, the targets in order in even segments and reversed in odd
//! ones (A B C, C B A), so load that changes during the run falls on every target alike; the load
//! average is printed beside every row. Each answer's status and shape is checked (rows counted);
//! any failure fails the target's workload (`failed` in the table) and the bench (exit 1).
//! One table goes to stdout, the JSON to `target/bench/versus_couchdb.json`. The databases made on
//! the real CouchDB (directly or by agentstore's CouchDB backend) are deleted at the end.
//!
//! `cargo test --all-targets` also builds and runs the bench binary (without `--bench`); it then
//! only prints how to run it and exits 0.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use serde_json::{json, Value};

use crate::common;
use crate::common::phase::{keep_alive_client, Latencies};
use crate::common::targets::{load_average, real_couchdb_url, Kind, Running, StartOptions};
use crate::common::workload::{self as seeded, KEYS_PER_NAMESPACE, NAMESPACES, TOTAL_KEYS, USER};

use common::{bench_main, describe, run_suffix, write_report};

const NAME: &str = "versus_couchdb";
/// Per-request timeout: a request that takes longer is an error.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// The timeout of a `view_build`'s query, which builds the whole index before it answers.
const VIEW_BUILD_TIMEOUT: Duration = Duration::from_secs(1_800);
/// Distinct values of `type` (the view's key) and of `tag`.
const TYPES: usize = 10;
const TAGS: usize = 100;
/// Rows each `find` and `view_key` asks for, and each `find` range's width.
const PAGE: usize = 10;
/// Rows of an `all_docs` and a `changes` page.
const LISTING: usize = 100;
/// Attachments seeded for `att_get` to read in turn.
const SEEDED_ATTACHMENTS: usize = 16;
/// Documents per seeding `_bulk_docs`.
const SEED_BATCH: usize = 1_000;
const VIEW: &str = "/_design/bench/_view/v";
const MIB: usize = 1 << 20;

pub fn main() -> std::process::ExitCode {
    bench_main(NAME, run)
}

// ---- settings ----

struct Config {
    /// `BENCH_CLIENTS` (default 16).
    clients: usize,
    /// `BENCH_SECONDS` (default 4): timed seconds per target and workload, over its segments.
    seconds: f64,
    /// `BENCH_SEGMENTS` (default 2): segments per target and workload, alternating the order.
    segments: usize,
    /// `BENCH_DOCS` (default 2,000): documents seeded in the ordinary database.
    docs: usize,
    /// `BENCH_ATTACHMENT_MIB` (default 1).
    attachment_bytes: usize,
    /// `BENCH_VIEW_BUILD_DOCS` (default 100,000): documents of the `view_build` database.
    view_build_docs: usize,
    targets: Vec<Kind>,
    workloads: Vec<Workload>,
}

impl Config {
    fn from_env() -> Result<Self, String> {
        let targets = match std::env::var("BENCH_TARGETS").map(|t| t.trim().is_empty()) {
            Ok(false) => Kind::from_env()?,
            _ => vec![Kind::ApacheCouchDb, Kind::Embedded, Kind::CouchDb],
        };
        if real_couchdb_url().is_none() || !targets.contains(&Kind::ApacheCouchDb) {
            return Err("every ratio is to a real CouchDB: set BENCH_COUCHDB_URL=http://USER:PASSWORD@HOST:PORT \
                        and keep apache-couchdb in BENCH_TARGETS"
                .into());
        }
        let workloads = match std::env::var("BENCH_WORKLOADS") {
            Ok(names) if !names.trim().is_empty() => names
                .split(',')
                .map(|name| {
                    Workload::ALL.into_iter().find(|w| w.name() == name.trim()).ok_or_else(|| {
                        let known: Vec<&str> = Workload::ALL.iter().map(|w| w.name()).collect();
                        format!("BENCH_WORKLOADS names unknown workload {name:?} (known: {})", known.join(", "))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?,
            _ => Workload::ALL.to_vec(),
        };
        let config = Config {
            clients: common::env_number("BENCH_CLIENTS", 16usize)?,
            seconds: common::env_number("BENCH_SECONDS", 4.0f64)?,
            segments: common::env_number("BENCH_SEGMENTS", 2usize)?,
            docs: common::env_number("BENCH_DOCS", 2_000usize)?,
            attachment_bytes: common::env_number("BENCH_ATTACHMENT_MIB", 1usize)?.saturating_mul(MIB),
            view_build_docs: common::env_number("BENCH_VIEW_BUILD_DOCS", 100_000usize)?,
            targets,
            workloads,
        };
        if config.clients == 0 || config.segments == 0 || config.attachment_bytes == 0 || config.view_build_docs == 0 {
            return Err(
                "BENCH_CLIENTS, BENCH_SEGMENTS, BENCH_ATTACHMENT_MIB and BENCH_VIEW_BUILD_DOCS must be at least 1"
                    .into(),
            );
        }
        if config.docs < LISTING + PAGE * 2 {
            return Err(format!("BENCH_DOCS must be at least {}", LISTING + PAGE * 2));
        }
        if !(config.seconds.is_finite() && config.seconds > 0.0) {
            return Err("BENCH_SECONDS must be a positive number".into());
        }
        if config.attachment_bytes > 256 * MIB {
            return Err("BENCH_ATTACHMENT_MIB is at most 256".into());
        }
        Ok(config)
    }
}

// ---- the workloads ----

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Workload {
    Get,
    Create,
    Bulk100,
    Bulk1000,
    AllDocs,
    Changes,
    Find,
    ViewKey,
    ViewGroup,
    AttPut,
    AttGet,
    DsGet,
    DsCreate,
    DsFind,
    DsAllDocs,
    DsBulk,
    ViewBuild,
}

impl Workload {
    /// Reads first, then writes: the data-store writes land in the database the data-store
    /// reads query, whose indexes would otherwise have them to catch up with.
    const ALL: [Workload; 17] = [
        Workload::Get,
        Workload::AllDocs,
        Workload::Changes,
        Workload::Find,
        Workload::ViewKey,
        Workload::ViewGroup,
        Workload::AttGet,
        Workload::DsGet,
        Workload::DsFind,
        Workload::DsAllDocs,
        Workload::Create,
        Workload::Bulk100,
        Workload::Bulk1000,
        Workload::AttPut,
        Workload::DsCreate,
        Workload::DsBulk,
        Workload::ViewBuild,
    ];

    fn name(self) -> &'static str {
        match self {
            Workload::Get => "get",
            Workload::Create => "create",
            Workload::Bulk100 => "bulk_100",
            Workload::Bulk1000 => "bulk_1000",
            Workload::AllDocs => "all_docs",
            Workload::Changes => "changes",
            Workload::Find => "find",
            Workload::ViewKey => "view_key",
            Workload::ViewGroup => "view_group",
            Workload::AttPut => "att_put",
            Workload::AttGet => "att_get",
            Workload::DsGet => "ds_get",
            Workload::DsCreate => "ds_create",
            Workload::DsFind => "ds_find_100",
            Workload::DsAllDocs => "ds_all_docs_100",
            Workload::DsBulk => "ds_bulk_100",
            Workload::ViewBuild => "view_build",
        }
    }

    /// What one timed call stands for: documents indexed for a `view_build`, one request for the
    /// others.
    fn items_per_call(self, config: &Config) -> f64 {
        match self {
            Workload::ViewBuild => config.view_build_docs as f64,
            _ => 1.0,
        }
    }
}

// ---- a target, seeded ----

/// A running target with its databases seeded.
struct Site {
    running: Running,
    /// The ordinary database the reads query.
    db: String,
    /// The ordinary database the writes write to, so that the read database's view and index
    /// stay as built.
    write_db: String,
    /// The data-store documents' database: agentstore's data-store database, or one of its own.
    ds_db: String,
    /// Whether `ds_db` was made here (deleted at the end).
    ds_db_made: bool,
    /// The `view_build` workload's database, made and loaded when that workload first runs.
    build_db: String,
    build_db_loaded: std::sync::atomic::AtomicBool,
    /// One client per simulated client.
    connections: Vec<reqwest::Client>,
    /// Numbers new documents' ids.
    next_id: AtomicU64,
    seeded_docs: usize,
    /// `since` values of full pages of the seeded feed: `0`, then each page's `last_seq`.
    feed_pages: Vec<String>,
    attachment: Bytes,
}

impl Site {
    fn request(&self, http: &reqwest::Client, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.running.request(http, method, path)
    }

    /// Sends a request whose answer must be a 2xx; its body.
    async fn send(
        &self,
        http: &reqwest::Client,
        method: reqwest::Method,
        path: &str,
        body: Option<Bytes>,
        content_type: &str,
    ) -> Result<Bytes, String> {
        let mut request = self.request(http, method.clone(), path).header(reqwest::header::ACCEPT, "application/json");
        if let Some(body) = body {
            request = request.header(reqwest::header::CONTENT_TYPE, content_type).body(body);
        }
        let response = request.send().await.map_err(|e| format!("{method} {path}: {}", describe(&e)))?;
        let status = response.status();
        let bytes = response.bytes().await.map_err(|e| format!("{method} {path}: reading: {}", describe(&e)))?;
        if !status.is_success() {
            let text = String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned();
            return Err(format!("{method} {path}: status {status}: {text}"));
        }
        Ok(bytes)
    }

    async fn send_json(
        &self,
        http: &reqwest::Client,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, String> {
        let body = body.map(|b| Bytes::from(b.to_string()));
        let bytes = self.send(http, method.clone(), path, body, "application/json").await?;
        serde_json::from_slice(&bytes).map_err(|e| format!("{method} {path}: not JSON: {e}"))
    }

    fn new_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// One operation of `workload`, the `round`-th of this phase.
    async fn call(&self, http: &reqwest::Client, workload: Workload, round: u64) -> Result<(), String> {
        use reqwest::Method;
        let db = &self.db;
        let pick = |modulus: usize| (round.wrapping_mul(7919) % modulus as u64) as usize;
        match workload {
            Workload::Get => {
                let doc = self
                    .send_json(http, Method::GET, &format!("/{db}/{}", doc_id(pick(self.seeded_docs))), None)
                    .await?;
                expect(doc["_rev"].is_string(), "get: no _rev")
            }
            Workload::Create => {
                let n = self.new_id();
                let answer = self
                    .send_json(http, Method::PUT, &format!("/{}/c{n:09}", self.write_db), Some(&doc_body(n as usize)))
                    .await?;
                expect(answer["ok"] == true, "create: not ok")
            }
            Workload::Bulk100 | Workload::Bulk1000 => {
                let count = if workload == Workload::Bulk100 { 100 } else { 1000 };
                let docs: Vec<Value> = (0..count)
                    .map(|_| {
                        let n = self.new_id();
                        let mut doc = doc_body(n as usize);
                        doc["_id"] = json!(format!("b{n:09}"));
                        doc
                    })
                    .collect();
                let rows = self
                    .send_json(
                        http,
                        Method::POST,
                        &format!("/{}/_bulk_docs", self.write_db),
                        Some(&json!({ "docs": docs })),
                    )
                    .await?;
                bulk_rows_ok(&rows, count)
            }
            Workload::AllDocs => {
                let start = doc_id(pick(self.seeded_docs - LISTING));
                let path = format!("/{db}/_all_docs?include_docs=true&limit={LISTING}&startkey=%22{start}%22");
                let answer = self.send_json(http, Method::GET, &path, None).await?;
                rows_of(&answer, "rows", LISTING)
            }
            Workload::Changes => {
                let since = &self.feed_pages[pick(self.feed_pages.len())];
                let path = format!("/{db}/_changes?limit={LISTING}&since={}", encode_query(since));
                let answer = self.send_json(http, Method::GET, &path, None).await?;
                rows_of(&answer, "results", LISTING)
            }
            Workload::Find => {
                let from = pick(self.seeded_docs - PAGE);
                let query = json!({ "selector": { "n": { "$gte": from, "$lt": from + PAGE } }, "limit": PAGE });
                let answer = self.send_json(http, Method::POST, &format!("/{db}/_find"), Some(&query)).await?;
                rows_of(&answer, "docs", PAGE)
            }
            Workload::ViewKey => {
                let path = format!("/{db}{VIEW}?key=%22t{}%22&reduce=false&limit={PAGE}", pick(TYPES));
                let answer = self.send_json(http, Method::GET, &path, None).await?;
                rows_of(&answer, "rows", PAGE)
            }
            Workload::ViewGroup => {
                let answer = self.send_json(http, Method::GET, &format!("/{db}{VIEW}?group=true"), None).await?;
                rows_of(&answer, "rows", TYPES)
            }
            Workload::AttPut => {
                let n = self.new_id();
                let path = format!("/{}/att{n:09}/blob.bin", self.write_db);
                let body = self.attachment_body(n as usize);
                let answer = self.send(http, Method::PUT, &path, Some(body), "application/octet-stream").await?;
                let answer: Value = serde_json::from_slice(&answer).map_err(|e| format!("att_put: {e}"))?;
                expect(answer["ok"] == true, "att_put: not ok")
            }
            Workload::AttGet => {
                let path = format!("/{db}/seeded{:02}/blob.bin", pick(SEEDED_ATTACHMENTS));
                let bytes = self.send(http, Method::GET, &path, None, "").await?;
                expect(bytes.len() == self.attachment.len() - SEEDED_ATTACHMENTS, "att_get: wrong length")
            }
            Workload::DsGet => {
                let path = format!("/{}/{}", self.ds_db, seeded_ds_id(pick(TOTAL_KEYS)));
                let doc = self.send_json(http, Method::GET, &path, None).await?;
                expect(doc["_rev"].is_string(), "ds_get: no _rev")
            }
            Workload::DsCreate => {
                let (id, body) = new_ds_document(self.new_id())?;
                let path = format!("/{}/{}", self.ds_db, encode_segment(&id));
                let answer = self.send_json(http, Method::PUT, &path, Some(&Value::Object(body))).await?;
                expect(answer["ok"] == true, "ds_create: not ok")
            }
            Workload::DsFind => {
                let query = json!({
                    "selector": { "userId": USER, "namespace": format!("ns-{}", pick(NAMESPACES)) },
                    "limit": KEYS_PER_NAMESPACE,
                });
                let answer =
                    self.send_json(http, Method::POST, &format!("/{}/_find", self.ds_db), Some(&query)).await?;
                rows_of(&answer, "docs", KEYS_PER_NAMESPACE)
            }
            Workload::DsAllDocs => {
                let prefix = format!("{USER}:ns-{}:", pick(NAMESPACES));
                let path = format!(
                    "/{}/_all_docs?include_docs=true&limit={KEYS_PER_NAMESPACE}&startkey=%22{}%22&endkey=%22{}%EF%BF%B0%22",
                    self.ds_db,
                    encode_query(&prefix),
                    encode_query(&prefix)
                );
                let answer = self.send_json(http, Method::GET, &path, None).await?;
                rows_of(&answer, "rows", KEYS_PER_NAMESPACE)
            }
            Workload::DsBulk => {
                let mut docs = Vec::with_capacity(100);
                for _ in 0..100 {
                    let (id, mut body) = new_ds_document(self.new_id())?;
                    body.insert("_id".into(), json!(id));
                    docs.push(Value::Object(body));
                }
                let path = format!("/{}/_bulk_docs", self.ds_db);
                let rows = self.send_json(http, Method::POST, &path, Some(&json!({ "docs": docs }))).await?;
                bulk_rows_ok(&rows, 100)
            }
            Workload::ViewBuild => Err("view_build is timed a build at a time (`measure_view_builds`)".into()),
        }
    }

    /// The `index`-th attachment body: the buffer from byte `index % SEEDED_ATTACHMENTS` on, so
    /// bodies differ (the store keeps identical bytes once per database).
    fn attachment_body(&self, index: usize) -> Bytes {
        let start = index % SEEDED_ATTACHMENTS;
        self.attachment.slice(start..start + self.attachment.len() - SEEDED_ATTACHMENTS)
    }
}

fn expect(holds: bool, what: &str) -> Result<(), String> {
    if holds {
        Ok(())
    } else {
        Err(what.to_owned())
    }
}

fn rows_of(answer: &Value, field: &str, wanted: usize) -> Result<(), String> {
    let found = answer[field].as_array().map_or(0, Vec::len);
    expect(found == wanted, &format!("{field}: {found} rows, expected {wanted}"))
}

fn bulk_rows_ok(rows: &Value, wanted: usize) -> Result<(), String> {
    let rows = rows.as_array().ok_or("_bulk_docs answered no array")?;
    let ok = rows.iter().filter(|row| row["ok"] == true).count();
    expect(ok == wanted, &format!("_bulk_docs: {ok} of {wanted} rows ok: {:?}", rows.iter().find(|r| r["ok"] != true)))
}

fn doc_id(i: usize) -> String {
    format!("d{i:06}")
}

fn doc_body(i: usize) -> Value {
    json!({ "type": format!("t{}", i % TYPES), "n": i, "tag": format!("g{}", i % TAGS) })
}

/// The `i`-th seeded data-store document's id, as `common::workload` names it.
fn seeded_ds_id(i: usize) -> String {
    let (namespace, key) = seeded::document(i);
    encode_segment(&format!("{USER}:{namespace}:{}", agentstore::model::id::encode_key(&key)))
}

/// A new data-store document in the namespace `ns-new`.
fn new_ds_document(n: u64) -> Result<(String, serde_json::Map<String, Value>), String> {
    seeded::body("ns-new", &format!("new-{n:09}"), n, NAME, &agentstore::model::Limits::default())
}

const SEGMENT: &percent_encoding::AsciiSet =
    &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

fn encode_segment(text: &str) -> String {
    percent_encoding::utf8_percent_encode(text, SEGMENT).to_string()
}

fn encode_query(text: &str) -> String {
    encode_segment(text)
}

// ---- setting a target up ----

async fn set_up(running: Running, config: &Config, attachment: Bytes) -> Result<Site, String> {
    let suffix = run_suffix();
    let db = format!("versus_{}_{suffix}", running_name(&running));
    let write_db = format!("versus_w_{}_{suffix}", running_name(&running));
    let build_db = format!("versus_vb_{}_{suffix}", running_name(&running));
    let (ds_db, ds_db_made) = match &running.data_store {
        Some(name) => (name.clone(), false),
        None => (format!("versus_ds_{}_{suffix}", running_name(&running)), true),
    };
    let connections =
        (0..config.clients).map(|_| keep_alive_client(REQUEST_TIMEOUT)).collect::<Result<Vec<_>, String>>()?;
    let mut site = Site {
        running,
        db,
        write_db,
        ds_db,
        ds_db_made,
        build_db,
        build_db_loaded: std::sync::atomic::AtomicBool::new(false),
        connections,
        next_id: AtomicU64::new(0),
        seeded_docs: config.docs,
        feed_pages: Vec::new(),
        attachment,
    };
    seed(&site, config).await?;
    site.feed_pages = feed_pages(&site, config.docs / LISTING).await?;
    Ok(site)
}

/// A short name for a target's databases.
fn running_name(running: &Running) -> String {
    let label = running.label.to_lowercase();
    let kind = if label.starts_with("apache couchdb") {
        "couchdb"
    } else if label.contains("embedded") {
        "embedded"
    } else if label.contains("over couchdb") {
        "front"
    } else if label.contains("dynamodb") {
        "dynamodb"
    } else if label.contains("firestore") {
        "firestore"
    } else {
        "pouchdb"
    };
    kind.to_owned()
}

async fn seed(site: &Site, config: &Config) -> Result<(), String> {
    use reqwest::Method;
    let http = &site.connections[0];
    let db = &site.db;
    site.send_json(http, Method::PUT, &format!("/{db}"), None).await?;
    site.send_json(http, Method::PUT, &format!("/{}", site.write_db), None).await?;
    load_docs(site, http, db, config.docs).await?;
    let design = json!({
        "views": { "v": { "map": "function (doc) { if (doc.type) { emit(doc.type, doc.n); } }", "reduce": "_sum" } }
    });
    site.send_json(http, Method::PUT, &format!("/{db}/_design/bench"), Some(&design)).await?;
    site.send_json(http, Method::GET, &format!("/{db}{VIEW}?limit=1"), None).await?;
    let index = json!({ "index": { "fields": ["n"] }, "name": "n-idx", "type": "json" });
    site.send_json(http, Method::POST, &format!("/{db}/_index"), Some(&index)).await?;
    site.call(http, Workload::Find, 0).await?;
    for i in 0..SEEDED_ATTACHMENTS {
        let path = format!("/{db}/seeded{i:02}/blob.bin");
        site.send(http, Method::PUT, &path, Some(site.attachment_body(i)), "application/octet-stream").await?;
    }
    seed_data_store(site, http).await
}

async fn seed_data_store(site: &Site, http: &reqwest::Client) -> Result<(), String> {
    use reqwest::Method;
    let ds = &site.ds_db;
    if site.ds_db_made {
        site.send_json(http, Method::PUT, &format!("/{ds}"), None).await?;
        let index =
            json!({ "index": { "fields": ["userId", "namespace"] }, "name": "idx-user-namespace", "type": "json" });
        site.send_json(http, Method::POST, &format!("/{ds}/_index"), Some(&index)).await?;
    }
    let mut docs = Vec::with_capacity(TOTAL_KEYS);
    for i in 0..TOTAL_KEYS {
        let (namespace, key) = seeded::document(i);
        let (id, mut body) = seeded::body(&namespace, &key, i as u64, NAME, &agentstore::model::Limits::default())?;
        body.insert("_id".into(), json!(id));
        docs.push(Value::Object(body));
    }
    let rows = site.send_json(http, Method::POST, &format!("/{ds}/_bulk_docs"), Some(&json!({ "docs": docs }))).await?;
    bulk_rows_ok(&rows, TOTAL_KEYS)?;
    site.call(http, Workload::DsFind, 0).await
}

/// The `since` of up to `wanted` full pages of the feed, read in order.
async fn feed_pages(site: &Site, wanted: usize) -> Result<Vec<String>, String> {
    let http = &site.connections[0];
    let mut pages = vec!["0".to_owned()];
    loop {
        let since = pages.last().map(String::as_str).unwrap_or("0");
        let path = format!("/{}/_changes?limit={LISTING}&since={}", site.db, encode_query(since));
        let answer = site.send_json(http, reqwest::Method::GET, &path, None).await?;
        let full = answer["results"].as_array().is_some_and(|rows| rows.len() == LISTING);
        let next = match &answer["last_seq"] {
            Value::String(seq) => seq.clone(),
            other => other.to_string(),
        };
        if !full || pages.len() > wanted {
            pages.pop_if(|_| !full);
            return match pages.is_empty() {
                true => Err("the feed has no full page".into()),
                false => Ok(pages),
            };
        }
        pages.push(next);
    }
}

/// Deletes what the bench made on `site`; on a real CouchDB also the databases agentstore's
/// CouchDB backend made there in this run.
async fn tear_down(site: &Site) -> Result<(), String> {
    let http = &site.connections[0];
    site.send(http, reqwest::Method::DELETE, &format!("/{}", site.db), None, "").await?;
    site.send(http, reqwest::Method::DELETE, &format!("/{}", site.write_db), None, "").await?;
    if site.ds_db_made {
        site.send(http, reqwest::Method::DELETE, &format!("/{}", site.ds_db), None, "").await?;
    }
    if site.build_db_loaded.load(Ordering::Relaxed) {
        site.send(http, reqwest::Method::DELETE, &format!("/{}", site.build_db), None, "").await?;
    }
    if site.running.pid == 0 {
        // Each backend database agentstore made is named `versus_couchdb_{pid}_…`
        // (`Running::start`'s table name).
        let mine = format!("{NAME}_{}_", std::process::id());
        let all: Value = site.send_json(http, reqwest::Method::GET, "/_all_dbs", None).await?;
        for name in all.as_array().into_iter().flatten().filter_map(Value::as_str).filter(|n| n.starts_with(&mine)) {
            site.send(http, reqwest::Method::DELETE, &format!("/{name}"), None, "").await?;
        }
    }
    Ok(())
}

// ---- measuring ----

/// One target's result for one workload: its latencies over all its segments, or what failed.
type Outcome = Result<Latencies, String>;

fn merge(into: &mut Option<Latencies>, more: Latencies) {
    match into {
        None => *into = Some(more),
        Some(sum) => {
            sum.elapsed += more.elapsed;
            sum.sorted.extend(more.sorted);
            sum.sorted.sort();
        }
    }
}

async fn measure(sites: &[Site], workload: Workload, config: &Config) -> Vec<Outcome> {
    if workload == Workload::ViewBuild {
        return measure_view_builds(sites, config).await;
    }
    let per_segment = Duration::from_secs_f64(config.seconds / config.segments as f64);
    let mut sums: Vec<Option<Latencies>> = sites.iter().map(|_| None).collect();
    let mut failures: Vec<Option<String>> = sites.iter().map(|_| None).collect();
    for segment in 0..config.segments {
        let mut order: Vec<usize> = (0..sites.len()).collect();
        if segment % 2 == 1 {
            order.reverse();
        }
        for index in order {
            if failures[index].is_some() {
                continue;
            }
            let site = &sites[index];
            let measured =
                Latencies::measure(&site.connections, per_segment, |http, round| site.call(http, workload, round))
                    .await;
            match measured {
                Ok(latencies) => merge(&mut sums[index], latencies),
                Err(err) => failures[index] = Some(err),
            }
        }
    }
    sums.into_iter()
        .zip(failures)
        .map(|(sum, failure)| match failure {
            Some(err) => Err(err),
            None => sum.ok_or_else(|| "not measured".to_owned()),
        })
        .collect()
}

/// The `view_build` workload: per segment, targets in the alternating order, one new index
/// built over the build database on each; a target's latencies are its builds' wall times.
async fn measure_view_builds(sites: &[Site], config: &Config) -> Vec<Outcome> {
    let mut outcomes: Vec<Outcome> = Vec::with_capacity(sites.len());
    for site in sites {
        let loaded = load_build_db(site, config.view_build_docs).await;
        outcomes.push(loaded.map(|()| Latencies { elapsed: Duration::ZERO, sorted: Vec::new() }));
    }
    for segment in 0..config.segments {
        let mut order: Vec<usize> = (0..sites.len()).collect();
        if segment % 2 == 1 {
            order.reverse();
        }
        for index in order {
            let Ok(sum) = &mut outcomes[index] else { continue };
            match build_once(&sites[index], segment, config.view_build_docs).await {
                Ok(took) => {
                    // Each build's time in the order run: builds of one target can differ more
                    // than targets do, and the table keeps only their sum and quantiles.
                    eprintln!(
                        "  view_build, segment {segment}: {}: {:.2} s",
                        sites[index].running.label,
                        took.as_secs_f64()
                    );
                    sum.elapsed += took;
                    sum.sorted.push(took);
                    sum.sorted.sort();
                }
                Err(err) => outcomes[index] = Err(err),
            }
        }
    }
    outcomes
}

/// Makes `site`'s build database and loads `docs` documents of the seeded shape into it.
async fn load_build_db(site: &Site, docs: usize) -> Result<(), String> {
    use reqwest::Method;
    let http = &site.connections[0];
    site.send_json(http, Method::PUT, &format!("/{}", site.build_db), None).await?;
    site.build_db_loaded.store(true, Ordering::Relaxed);
    load_docs(site, http, &site.build_db, docs).await
}

/// Loads documents `0..docs` of the seeded shape (`d000042`, [`doc_body`]) into `db` by
/// `_bulk_docs` of [`SEED_BATCH`], each row checked.
async fn load_docs(site: &Site, http: &reqwest::Client, db: &str, docs: usize) -> Result<(), String> {
    let path = format!("/{db}/_bulk_docs");
    for start in (0..docs).step_by(SEED_BATCH) {
        let batch: Vec<Value> = (start..(start + SEED_BATCH).min(docs))
            .map(|i| {
                let mut doc = doc_body(i);
                doc["_id"] = json!(doc_id(i));
                doc
            })
            .collect();
        let count = batch.len();
        let rows = site.send_json(http, reqwest::Method::POST, &path, Some(&json!({ "docs": batch }))).await?;
        bulk_rows_ok(&rows, count)?;
    }
    Ok(())
}

/// Writes segment `segment`'s design document and times the query that builds its view.
async fn build_once(site: &Site, segment: usize, docs: usize) -> Result<Duration, String> {
    use reqwest::Method;
    let http = keep_alive_client(VIEW_BUILD_TIMEOUT)?;
    let design = json!({ "views": { "v": {
        "map": format!("function (doc) {{ emit(doc.type, doc.n); }} // build {segment}"),
        "reduce": "_sum",
    } } });
    let ddoc = format!("/{}/_design/build{segment}", site.build_db);
    site.send_json(&http, Method::PUT, &ddoc, Some(&design)).await?;
    let started = std::time::Instant::now();
    let answer = site.send_json(&http, Method::GET, &format!("{ddoc}/_view/v?reduce=false&limit=1"), None).await?;
    let took = started.elapsed();
    let rows = answer["total_rows"].as_u64();
    expect(rows == Some(docs as u64), &format!("view_build: total_rows {rows:?}, expected {docs}"))?;
    Ok(took)
}

// ---- the run ----

fn run() -> Result<bool, String> {
    let config = Config::from_env()?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| e.to_string())?;
    runtime.block_on(run_all(config))
}

async fn run_all(config: Config) -> Result<bool, String> {
    let attachment = pseudo_random(config.attachment_bytes + SEEDED_ATTACHMENTS);
    let mut sites = Vec::new();
    for kind in &config.targets {
        let running = Running::start_with(*kind, NAME, StartOptions { basic_login: true })?;
        println!("{}: {} (seeding)", kind.name(), running.label);
        sites.push(set_up(running, &config, attachment.clone()).await.map_err(|e| format!("{}: {e}", kind.name()))?);
    }
    println!(
        "\nclients: {}  per target and workload: {} s in {} segments, order alternating  docs: {}  attachment: {} MiB",
        config.clients,
        config.seconds,
        config.segments,
        config.docs,
        config.attachment_bytes / MIB
    );
    let base = 0; // Apache CouchDB is first (`Kind::ALL` order).
    print_heading(&sites);
    let mut ok = true;
    let mut report = Vec::new();
    for workload in &config.workloads {
        let load = load_average();
        let outcomes = measure(&sites, *workload, &config).await;
        ok &= outcomes.iter().all(Result::is_ok);
        print_failed_servers_logs(&sites, &outcomes);
        let items = workload.items_per_call(&config);
        print_row(*workload, &load, &outcomes, base, items);
        report.push(row_json(*workload, &load, &sites, &outcomes, base, items));
    }
    println!("\nload average at the end: {}", load_average());
    for site in &sites {
        if let Err(err) = tear_down(site).await {
            eprintln!("{}: cleaning up: {err}", site.running.label);
        }
    }
    for site in sites {
        site.running.stop()?;
    }
    write_report(NAME, &json!({ "workloads": report, "clients": config.clients, "seconds": config.seconds }))?;
    Ok(ok)
}

/// For each agentstore target whose workload failed, what its server logged last (warnings and
/// errors: the bench starts it with `RUST_LOG=warn`), so a failure says why.
fn print_failed_servers_logs(sites: &[Site], outcomes: &[Outcome]) {
    for (site, outcome) in sites.iter().zip(outcomes) {
        if let (Err(_), common::targets::Process::Agentstore(server)) = (outcome, &site.running.process) {
            eprintln!("{}: the server's last log lines:\n{}", site.running.label, server.tail());
        }
    }
}

fn print_heading(sites: &[Site]) {
    let mut head = "| workload | load avg |".to_owned();
    let mut rule = "|---|---|".to_owned();
    for (index, site) in sites.iter().enumerate() {
        head.push_str(&format!(" {}: ops/s | p50 ms | p99 ms |", site.running.label));
        rule.push_str("---:|---:|---:|");
        if index > 0 {
            head.push_str(" ratio |");
            rule.push_str("---:|");
        }
    }
    println!("{head}\n{rule}");
}

/// One workload's line; `items` is what one call stands for (`Workload::items_per_call`), so
/// rates are items per second.
fn print_row(workload: Workload, load: &str, outcomes: &[Outcome], base: usize, items: f64) {
    let base_rate = outcomes[base].as_ref().ok().map(Latencies::per_s);
    let mut line = format!("| {} | {load} |", workload.name());
    for (index, outcome) in outcomes.iter().enumerate() {
        match outcome {
            Ok(latencies) => line.push_str(&format!(
                " {:.0} | {:.1} | {:.1} |",
                latencies.per_s() * items,
                latencies.quantile_ms(0.5),
                latencies.quantile_ms(0.99)
            )),
            Err(_) => line.push_str(" failed | | |"),
        }
        if index != base {
            match (outcome, base_rate) {
                (Ok(latencies), Some(rate)) if rate > 0.0 => {
                    line.push_str(&format!(" {:.2}x |", latencies.per_s() / rate))
                }
                _ => line.push_str(" - |"),
            }
        }
    }
    println!("{line}");
    for outcome in outcomes {
        if let Err(err) = outcome {
            println!("  {}: failed: {err}", workload.name());
        }
    }
}

fn row_json(workload: Workload, load: &str, sites: &[Site], outcomes: &[Outcome], base: usize, items: f64) -> Value {
    let base_rate = outcomes[base].as_ref().ok().map(Latencies::per_s);
    let targets: Vec<Value> = sites
        .iter()
        .zip(outcomes)
        .map(|(site, outcome)| match outcome {
            Ok(latencies) => {
                let mut out = latencies.to_json();
                out["target"] = json!(site.running.label);
                out["items_per_call"] = json!(items);
                out["items_per_s"] = json!(latencies.per_s() * items);
                out["ratio_to_couchdb"] = json!(base_rate.map(|rate| latencies.per_s() / rate));
                out
            }
            Err(err) => json!({ "target": site.running.label, "failed": err }),
        })
        .collect();
    json!({ "workload": workload.name(), "load_average": load, "targets": targets })
}

/// Incompressible bytes (xorshift), so no target's compression flatters it.
fn pseudo_random(len: usize) -> Bytes {
    let mut state: u64 = 0x5eed_0038;
    let mut bytes = Vec::with_capacity(len + 8);
    while bytes.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        bytes.extend_from_slice(&state.to_le_bytes());
    }
    bytes.truncate(len);
    Bytes::from(bytes)
}
