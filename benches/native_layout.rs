//! The native layout's hot paths (the data-store database on the CouchDB backend,
//! `src/database/layout/native.rs`): a page of trees read one request per row against one batched
//! read, and how often writes read the database's settings.
//!
//! Run it with `cargo bench --bench benches -- native_layout`. The server is
//! `AGENTSTORE_BENCH_COUCHDB_URL` (e.g. `http://admin:password@127.0.0.1:5984`) when set;
//! otherwise `pouchdb-server` from `node_modules`, started by the tests' launcher
//! (`tests/common/servers.rs`), whose `_bulk_get` answers each document's winner alone, so the
//! adapter reads trees one by one there and both sides below make the same requests. The bench
//! creates a fresh database and `BENCH_PAGE` documents (default 100; every fourth with a
//! conflict, every fourth deleted), then, for `BENCH_ROUNDS` rounds (default 20) in ABBA order:
//! - A, per row: each document's tree read by itself (`DocumentBackend::revision_tree`, 16 at
//!   once), which is how the layout read a page of the change feed or of a listing before;
//! - B, batched: `Database::read_many` of the page, the layout's batched read
//!   (`DocumentBackend::revision_trees`, one `_bulk_get` for the page).
//!
//! Then `BENCH_WRITES` edits (default 300) one after another, counting the reads of the
//! database's settings they make (at most one per `SETTINGS_MAX_AGE`). Times are wall clock per
//! page and per edit. Under `cargo test --all-targets` the target only prints how to run it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentstore::backend::couchdb::{CouchConfig, CouchDbBackend};
use agentstore::backend::raw::layer::Layered;
use agentstore::backend::{DocumentBackend, StoredDocument};
use agentstore::database::rev_tree::RevPath;
use agentstore::database::{Database, Write, Written};
use futures::StreamExt;
use serde_json::{json, Map, Value};

use crate::common;
use crate::servers;

const NAME: &str = "native_layout";
/// The per-row side's requests in flight: the bound the layout read with before.
const PER_ROW_AT_ONCE: usize = 16;

/// The CouchDB backend, its reads of local documents counted.
struct CountingLocals {
    inner: Arc<dyn DocumentBackend>,
    local_reads: AtomicUsize,
}

#[async_trait::async_trait]
impl Layered for CountingLocals {
    fn inner(&self) -> &dyn DocumentBackend {
        self.inner.as_ref()
    }

    async fn get_local(&self, name: &str) -> agentstore::Result<Option<StoredDocument>> {
        self.local_reads.fetch_add(1, Ordering::SeqCst);
        self.inner.get_local(name).await
    }
}

fn seeded(id: &str, value: Value) -> Map<String, Value> {
    let mut body = Map::new();
    body.insert("id".into(), Value::from(id));
    body.insert("value".into(), value);
    body
}

fn edited(written: Written) -> Result<String, String> {
    match written {
        Written::Edited(rev) => Ok(rev),
        other => Err(format!("an edit answered {other:?}")),
    }
}

/// The page's documents: plain, conflicted, deleted.
async fn seed(database: &Database, ids: &[String]) -> Result<(), String> {
    let fail = |err: agentstore::Error| err.to_string();
    for (n, id) in ids.iter().enumerate() {
        let first = Write::Edit { parent: None, deleted: false, body: seeded(id, json!(n)) };
        let r1 = edited(database.write(id, &first).await.map_err(fail)?)?;
        if n % 4 == 1 {
            let second = Write::Edit { parent: Some(r1.clone()), deleted: false, body: seeded(id, json!("winner")) };
            database.write(id, &second).await.map_err(fail)?;
            let (_, hash) = r1.split_once('-').ok_or("a revision without a generation")?;
            let path = RevPath { start: 2, ids: vec!["0".repeat(31) + "1", hash.to_owned()] };
            let conflict = Write::Replicated { path, deleted: false, body: seeded(id, json!("loser")) };
            database.write(id, &conflict).await.map_err(fail)?;
        }
        if n % 4 == 2 {
            let deletion = Write::Edit { parent: Some(r1), deleted: true, body: Map::new() };
            database.write(id, &deletion).await.map_err(fail)?;
        }
    }
    Ok(())
}

async fn per_row(backend: &dyn DocumentBackend, ids: &[String]) -> Result<Duration, String> {
    let started = Instant::now();
    let reads: Vec<_> = ids.iter().map(|id| backend.revision_tree(id)).collect();
    let trees: Vec<_> = futures::stream::iter(reads).buffered(PER_ROW_AT_ONCE).collect().await;
    let elapsed = started.elapsed();
    match trees.into_iter().collect::<agentstore::Result<Vec<_>>>() {
        Ok(trees) if trees.iter().all(Option::is_some) => Ok(elapsed),
        Ok(_) => Err("a tree of the page was not found".into()),
        Err(err) => Err(err.to_string()),
    }
}

async fn batched(database: &Database, ids: &[String]) -> Result<Duration, String> {
    let started = Instant::now();
    let states = database.read_many(ids).await.map_err(|err| err.to_string())?;
    let elapsed = started.elapsed();
    if states.iter().all(Option::is_some) {
        Ok(elapsed)
    } else {
        Err("a tree of the page was not found".into())
    }
}

fn ms(duration: Duration) -> String {
    format!("{:.1}", duration.as_secs_f64() * 1000.0)
}

async fn measure() -> Result<bool, String> {
    let page: usize = common::env_number("BENCH_PAGE", 100)?;
    let rounds: usize = common::env_number("BENCH_ROUNDS", 20)?;
    let writes: usize = common::env_number("BENCH_WRITES", 300)?;
    if page == 0 || rounds == 0 {
        return Err("BENCH_PAGE and BENCH_ROUNDS must be at least 1".into());
    }
    let server = match std::env::var("AGENTSTORE_BENCH_COUCHDB_URL") {
        Ok(url) if !url.trim().is_empty() => url.trim_end_matches('/').to_owned(),
        _ => servers::couchdb()?.url,
    };
    let url = format!("couchdb+{server}/bench_native_{}?create=true", common::run_suffix());
    let config = CouchConfig::parse(&url).map_err(|err| err.to_string())?;
    let couch: Arc<dyn DocumentBackend> = Arc::new(CouchDbBackend::open(&config).await.map_err(|err| err.to_string())?);
    let counting = Arc::new(CountingLocals { inner: Arc::clone(&couch), local_reads: AtomicUsize::new(0) });
    let database =
        Database::native_data_store("agent_data_store".into(), counting.clone()).map_err(|err| err.to_string())?;
    let ids: Vec<String> = (0..page).map(|n| format!("u:bench:k{n:05}")).collect();
    seed(&database, &ids).await?;
    println!("{NAME}: {page} documents (conflicted and deleted among them), {rounds} rounds in ABBA order");

    let (mut rows, mut pages) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        if round % 2 == 0 {
            rows.push(per_row(couch.as_ref(), &ids).await?);
            pages.push(batched(&database, &ids).await?);
        } else {
            pages.push(batched(&database, &ids).await?);
            rows.push(per_row(couch.as_ref(), &ids).await?);
        }
    }
    rows.sort();
    pages.sort();
    println!(
        "a page of {page} trees, ms: per row p50 {} max {}; batched p50 {} max {}",
        ms(rows[rows.len() / 2]),
        ms(rows[rows.len() - 1]),
        ms(pages[pages.len() / 2]),
        ms(pages[pages.len() - 1])
    );

    counting.local_reads.store(0, Ordering::SeqCst);
    let started = Instant::now();
    for n in 0..writes {
        let id = &ids[(n * 4) % page];
        let parent = database.read(id).await.map_err(|err| err.to_string())?.and_then(|state| state.winner_rev());
        let edit = Write::Edit { parent, deleted: false, body: seeded(id, json!(n)) };
        database.write(id, &edit).await.map_err(|err| err.to_string())?;
    }
    let elapsed = started.elapsed();
    println!(
        "{writes} reads and edits in {} ms ({} ms each): {} reads of local documents (the settings)",
        ms(elapsed),
        ms(elapsed / writes.max(1) as u32),
        counting.local_reads.load(Ordering::SeqCst)
    );
    Ok(true)
}

fn run() -> Result<bool, String> {
    let runtime = common::runtime()?;
    runtime.block_on(measure())
}

pub fn main() -> std::process::ExitCode {
    common::bench_main(NAME, run)
}
