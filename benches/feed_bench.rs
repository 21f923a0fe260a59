//! The document model's reads and the writes that maintain it: change-feed read rate, `all_docs`
//! page latency, and write rates, on stores of different sizes, through `DocumentBackend`.
//!
//! Run it with `cargo bench --bench benches -- feed_bench`. `BENCH_FEED_SIZES` (default `10000`) lists the
//! store sizes, e.g. `10000,1000000`; `BENCH_FEED_BACKENDS` (default `embedded`) which backends
//! take part (`couchdb`, `dynamodb`, `firestore`: the local servers the tests start, see
//! `tests/common/servers.rs`).
//!
//! For each backend and size, on a fresh store:
//! - **bulk write**: the data set through `bulk_write` in batches of 500, 4 in flight (docs/s);
//! - **single writes**: 500 updates of existing documents, one `put` at a time, then 2,000 by 16
//!   concurrent writers (writes/s): each is one durable commit with its feed, ancestry and index
//!   entries;
//! - **changes**: the whole feed read from the start in pages of 1,000 (changes/s), and the
//!   latency of one page of 100 from the start and from the middle (median of 30);
//! - **all_docs**: the latency of one page of 100 documents with bodies, from the start, from an
//!   id in the middle, and descending from the end (median of 30).
//!
//! Cost in proportion to the page shows as page latencies that do not grow with the store.
//! Results go to stdout as a markdown table and to `target/bench/feed_bench.json`.

use crate::common;
use crate::servers;

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentstore::backend::{self, BackendUrl, BulkWrite, DocumentBackend, IdRange, Precondition};
use agentstore::model::id::encode_key;
use futures::{StreamExt, TryStreamExt};
use serde_json::{json, Map, Value};

const BATCH: usize = 500;
const BULK_IN_FLIGHT: usize = 4;
const PAGE: usize = 100;
const FEED_PAGE: usize = 1_000;
const SAMPLES: usize = 30;

pub fn main() -> ExitCode {
    common::bench_main("feed_bench", || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("tokio runtime: {e}"))?;
        runtime.block_on(run()).map(|()| true)
    })
}

fn list_setting(name: &str, default: &str) -> Vec<String> {
    std::env::var(name).unwrap_or_else(|_| default.to_owned()).split(',').map(|s| s.trim().to_owned()).collect()
}

async fn run() -> Result<(), String> {
    let sizes: Vec<usize> = list_setting("BENCH_FEED_SIZES", "10000")
        .iter()
        .map(|s| s.replace('_', "").parse().map_err(|_| format!("BENCH_FEED_SIZES: {s:?} is not a number")))
        .collect::<Result<_, _>>()?;
    let backends = list_setting("BENCH_FEED_BACKENDS", "embedded");
    let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
    let mut rows = Vec::new();
    for name in &backends {
        for &size in &sizes {
            let url = fresh_url(name, dir.path(), size)?;
            println!("{name}, {size} documents: {url}");
            let backend: Arc<dyn DocumentBackend> = {
                let parsed: BackendUrl = url.parse().map_err(|e| format!("{url}: {e}"))?;
                backend::open(&parsed).await.map_err(|e| format!("{url}: {e}"))?
            };
            rows.push(measure(name, size, &backend).await?);
        }
    }
    print_table(&rows);
    common::write_report("feed_bench", &json!({ "rows": rows }))
}

fn fresh_url(name: &str, dir: &Path, size: usize) -> Result<String, String> {
    let store = format!("feed_bench_{size}_{}", std::process::id());
    Ok(match name {
        "embedded" => format!("embedded:{}", dir.join(format!("{store}.redb")).display()),
        "couchdb" => servers::couchdb()?.database_url(&store),
        "dynamodb" => servers::dynamodb()?.table_url(&store),
        "firestore" => servers::firestore()?.collection_url(&store),
        other => return Err(format!("unknown backend {other:?}")),
    })
}

fn id_of(i: usize) -> String {
    format!("user{}:ns{}:{}", i % 10, (i / 10) % 10, encode_key(&format!("k{i:08}")))
}

fn body(i: usize, round: usize) -> Map<String, Value> {
    let value =
        json!({ "index": i, "round": round, "text": "a few hundred bytes of payload in every document ".repeat(6) });
    match json!({
        "userId": format!("user{}", i % 10), "namespace": format!("ns{}", (i / 10) % 10), "key": format!("k{i:08}"),
        "value": value, "accessCount": 1, "createdAt": "2026-11-23T10:00:00Z", "updatedAt": "2026-11-23T10:00:00Z"
    }) {
        Value::Object(map) => map,
        _ => Map::new(),
    }
}

async fn measure(name: &str, size: usize, backend: &Arc<dyn DocumentBackend>) -> Result<Value, String> {
    let bulk_rate = bulk_write(backend, size).await?;
    println!("  bulk write {bulk_rate:.0} docs/s");
    let sequential = single_writes(backend, size, 500, 1).await?;
    let concurrent = single_writes(backend, size, 2_000, 16).await?;
    println!("  single writes {sequential:.0}/s one at a time, {concurrent:.0}/s by 16 writers");
    let (feed_rate, feed_total) = read_whole_feed(backend).await?;
    println!("  changes {feed_rate:.0}/s ({feed_total} in the feed)");
    let middle_token = feed_token_at(backend, feed_total / 2).await?;
    let feed_start = median_ms(|| async { backend.changes(None, PAGE).await.map(drop) }).await?;
    let feed_middle = median_ms(|| async { backend.changes(Some(&middle_token), PAGE).await.map(drop) }).await?;
    let middle_id = id_of(size / 2);
    let ranges = [
        ("start", IdRange::all()),
        ("middle", IdRange { start: Some(middle_id), ..IdRange::all() }),
        ("descending", IdRange { descending: true, ..IdRange::all() }),
    ];
    let mut all_docs = Map::new();
    for (label, range) in &ranges {
        let ms = median_ms(|| async {
            let page = backend.all_docs(range, PAGE, None).await?;
            match page.items.len() == PAGE.min(size) {
                true => Ok(()),
                false => Err(agentstore::Error::new(agentstore::ErrorKind::Internal, "all_docs: a short page")),
            }
        })
        .await?;
        all_docs.insert((*label).into(), json!(ms));
    }
    println!("  changes page of {PAGE}: {feed_start:.2} ms from the start, {feed_middle:.2} ms from the middle; all_docs page of {PAGE}: {all_docs:?} ms");
    Ok(json!({
        "backend": name, "documents": size, "bulk_write_docs_per_s": bulk_rate,
        "put_per_s_sequential": sequential, "put_per_s_16_writers": concurrent,
        "changes_per_s": feed_rate, "feed_entries": feed_total,
        "changes_page_ms": { "start": feed_start, "middle": feed_middle },
        "all_docs_page_ms": all_docs,
    }))
}

async fn bulk_write(backend: &Arc<dyn DocumentBackend>, size: usize) -> Result<f64, String> {
    let started = Instant::now();
    let batches: Vec<Vec<BulkWrite>> = (0..size)
        .collect::<Vec<_>>()
        .chunks(BATCH)
        .map(|chunk| {
            chunk
                .iter()
                .map(|&i| BulkWrite { id: id_of(i), body: body(i, 0), precondition: Precondition::MustNotExist })
                .collect()
        })
        .collect();
    let failed: usize = futures::stream::iter(batches)
        .map(|batch| {
            let backend = Arc::clone(backend);
            async move {
                let results = backend.bulk_write(batch).await.map_err(|e| e.to_string())?;
                Ok::<_, String>(results.iter().filter(|r| r.is_err()).count())
            }
        })
        .buffer_unordered(BULK_IN_FLIGHT)
        .try_fold(0, |sum, n| async move { Ok(sum + n) })
        .await?;
    if failed > 0 {
        return Err(format!("{failed} bulk writes failed"));
    }
    Ok(size as f64 / started.elapsed().as_secs_f64())
}

/// `count` updates of existing documents by `writers` concurrent writers; writes/s.
async fn single_writes(
    backend: &Arc<dyn DocumentBackend>,
    size: usize,
    count: usize,
    writers: usize,
) -> Result<f64, String> {
    let started = Instant::now();
    futures::stream::iter(0..count)
        .map(|n| {
            let backend = Arc::clone(backend);
            // Spread over the store, each id written once per phase.
            let i = (n * 7919) % size;
            async move { backend.put(&id_of(i), &body(i, 1), Precondition::None).await.map_err(|e| e.to_string()) }
        })
        .buffer_unordered(writers)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(count as f64 / started.elapsed().as_secs_f64())
}

/// Reads the feed from the start to its end; (changes/s, how many).
async fn read_whole_feed(backend: &Arc<dyn DocumentBackend>) -> Result<(f64, usize), String> {
    let started = Instant::now();
    let (mut since, mut total) = (None::<String>, 0);
    loop {
        let page = backend.changes(since.as_deref(), FEED_PAGE).await.map_err(|e| e.to_string())?;
        total += page.changes.len();
        let done = page.changes.is_empty();
        since = Some(page.last_seq);
        if done {
            return Ok((total as f64 / started.elapsed().as_secs_f64(), total));
        }
    }
}

/// The feed token after the first `n` changes.
async fn feed_token_at(backend: &Arc<dyn DocumentBackend>, n: usize) -> Result<String, String> {
    let (mut since, mut seen) = (None::<String>, 0);
    while seen < n {
        let page = backend.changes(since.as_deref(), FEED_PAGE.min(n - seen)).await.map_err(|e| e.to_string())?;
        seen += page.changes.len();
        since = Some(page.last_seq);
        if page.changes.is_empty() {
            break;
        }
    }
    since.ok_or_else(|| "the feed is empty".to_owned())
}

async fn median_ms<F, Fut>(mut call: F) -> Result<f64, String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = agentstore::Result<()>>,
{
    let mut samples: Vec<Duration> = Vec::with_capacity(SAMPLES);
    for _ in 0..SAMPLES {
        let started = Instant::now();
        call().await.map_err(|e| e.to_string())?;
        samples.push(started.elapsed());
    }
    samples.sort();
    Ok(samples[SAMPLES / 2].as_secs_f64() * 1000.0)
}

fn print_table(rows: &[Value]) {
    println!();
    println!("| backend | documents | bulk write docs/s | put/s (1) | put/s (16) | changes/s | changes page ms (start / middle) | all_docs page ms (start / middle / desc) |");
    println!("|---|---|---|---|---|---|---|---|");
    for row in rows {
        let f = |pointer: &str| row.pointer(pointer).and_then(Value::as_f64).unwrap_or(f64::NAN);
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} / {:.2} | {:.2} / {:.2} / {:.2} |",
            row["backend"].as_str().unwrap_or("?"),
            row["documents"],
            f("/bulk_write_docs_per_s"),
            f("/put_per_s_sequential"),
            f("/put_per_s_16_writers"),
            f("/changes_per_s"),
            f("/changes_page_ms/start"),
            f("/changes_page_ms/middle"),
            f("/all_docs_page_ms/start"),
            f("/all_docs_page_ms/middle"),
            f("/all_docs_page_ms/descending"),
        );
    }
}
