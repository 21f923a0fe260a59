//! Mango `_find` benchmark over the embedded store (issue 14's Mango, now `src/mango/`).
//!
//! Run it with `cargo bench --bench benches -- mango_find`. It writes `MANGO_BENCH_DOCS` documents (default
//! 20,000: 20 users × 10 namespaces, a number `n` in 0..1000) to a fresh embedded store, then times
//! each query shape `MANGO_BENCH_ROUNDS` times (default 20) and reports the median and the
//! slowest run, with documents examined and returned:
//!
//! - `user+namespace page`: `{"userId", "namespace"}`, `limit` 25 (the backend's index);
//! - `user, all pages`: `{"userId"}` paged with `bookmark`, `limit` 100, to the end;
//! - `full scan, rare match`: `{"n": 7}`, `limit` 25 (no usable field: every document read);
//! - `sorted by n`: `{"userId"}` sorted by `n` with an index on `n`, `limit` 25.
//!
//! Without `--bench` (as `cargo test --all-targets` runs it) it only prints how to run it.

use std::time::{Duration, Instant};

use agentstore::backend::embedded::EmbeddedBackend;
use agentstore::backend::{BulkWrite, DocumentBackend, Precondition};
use agentstore::mango::{create_index, find, IndexCatalog};
use serde_json::{json, Map, Value};

const USERS: usize = 20;
const NAMESPACES: usize = 10;
const WRITE_BATCH: usize = 500;

fn env_number(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[tokio::main]
pub async fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("mango_find: run with `cargo bench --bench benches -- mango_find`");
        return;
    }
    let total = env_number("MANGO_BENCH_DOCS", 20_000);
    let rounds = env_number("MANGO_BENCH_ROUNDS", 20).max(1);
    let dir = tempfile::tempdir().expect("temp dir");
    let backend = EmbeddedBackend::open(&dir.path().join("bench.redb")).await.expect("open store");
    backend.ensure_standard_indexes().await.expect("indexes");
    load(&backend, total).await;
    create_index(&backend, &json!({"index": {"fields": ["n"]}, "name": "by-n"})).await.expect("index on n");
    let catalog = IndexCatalog::load(&backend).await.expect("catalog");

    println!("mango_find: {total} documents, {rounds} rounds each (median / slowest)");
    let shapes: [(&str, Value, bool); 4] = [
        ("user+namespace page", json!({"selector": {"userId": "user_3", "namespace": "ns4"}, "limit": 25}), false),
        ("user, all pages", json!({"selector": {"userId": "user_3"}, "limit": 100}), true),
        ("full scan, rare match", json!({"selector": {"n": 7}, "limit": 25}), false),
        ("sorted by n", json!({"selector": {"userId": "user_3"}, "sort": ["n"], "limit": 25}), false),
    ];
    for (name, request, follow) in shapes {
        let mut times = Vec::with_capacity(rounds);
        let mut returned = 0;
        for _ in 0..rounds {
            let started = Instant::now();
            returned = run(&backend, &catalog, request.clone(), follow).await;
            times.push(started.elapsed());
        }
        times.sort();
        println!(
            "  {name:<24} {:>9.2} ms / {:>9.2} ms   {returned} documents returned",
            ms(times[times.len() / 2]),
            ms(times[times.len() - 1])
        );
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// One query, following bookmarks to the end when `follow`; how many documents it returned.
async fn run(backend: &EmbeddedBackend, catalog: &IndexCatalog, mut request: Value, follow: bool) -> usize {
    let limit = request["limit"].as_u64().unwrap_or(25) as usize;
    let mut returned = 0;
    loop {
        let answer = find(backend, &request, &agentstore::database::data_store_rules::Confinement::Everything, catalog)
            .await
            .expect("find");
        let page = answer["docs"].as_array().map_or(0, Vec::len);
        returned += page;
        if !follow || page < limit {
            return returned;
        }
        request["bookmark"] = answer["bookmark"].clone();
    }
}

async fn load(backend: &EmbeddedBackend, total: usize) {
    let started = Instant::now();
    let mut batch = Vec::with_capacity(WRITE_BATCH);
    for ns in 0..NAMESPACES {
        backend.ensure_namespace_indexed(&format!("ns{ns}")).await.expect("namespace index");
    }
    for i in 0..total {
        let (user, ns, key) =
            (format!("user_{}", i % USERS), format!("ns{}", (i / USERS) % NAMESPACES), format!("k{i:06}"));
        let mut body = Map::new();
        body.insert("userId".into(), json!(user));
        body.insert("namespace".into(), json!(ns));
        body.insert("key".into(), json!(key));
        body.insert("value".into(), json!({"text": "some value", "i": i}));
        body.insert("n".into(), json!((i * 7919) % 1000));
        let id = format!("{user}:{ns}:{}", agentstore::model::id::encode_key(&key));
        batch.push(BulkWrite { id, body, precondition: Precondition::MustNotExist });
        if batch.len() == WRITE_BATCH || i + 1 == total {
            for result in backend.bulk_write(std::mem::take(&mut batch)).await.expect("bulk write") {
                result.expect("write");
            }
        }
    }
    println!("mango_find: loaded {total} documents in {:.1} s", started.elapsed().as_secs_f64());
}
