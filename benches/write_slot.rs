//! Why a write waited 0.93 s before group commit: redb's write slot is not handed out in order.
//!
//! Run it with `cargo bench --bench benches -- write_slot`. Sixteen threads each commit one small durable
//! write transaction at a time into one redb file, as `serve` did before group commit (one
//! transaction per request, each on a blocking thread waiting for the write slot). For every
//! write the bench records its wall time and how many other writes committed while it waited for
//! the slot. In a first-come-first-served queue of 16 writers that is at most 15; redb wakes one
//! waiter when the slot frees, and a writer arriving just then can take it first, so an unlucky
//! waiter loses again and again. The group commit queue (`src/backend/embedded/group_commit.rs`)
//! is first come, first served, and only its drainer takes the slot.
//!
//! Settings: `BENCH_SECONDS` (default 20), `BENCH_WRITERS` (default 16). Under
//! `cargo test --all-targets` the target only prints how to run it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redb::{Database, TableDefinition};

use crate::common;

const NAME: &str = "write_slot";
const TABLE: TableDefinition<u64, &[u8]> = TableDefinition::new("writes");
/// About the size of a small document.
const VALUE: [u8; 200] = [7; 200];

/// One writer's measurements: per write, its wall time and the commits that overtook it.
struct Writer {
    latency: Vec<Duration>,
    overtaken: Vec<u64>,
}

fn write_loop(db: &Database, commits: &AtomicU64, writer: u64, deadline: Instant) -> Result<Writer, String> {
    let mut out = Writer { latency: Vec::new(), overtaken: Vec::new() };
    let mut seq = 0u64;
    while Instant::now() < deadline {
        let before = commits.load(Ordering::SeqCst);
        let began = Instant::now();
        let txn = db.begin_write().map_err(|e| e.to_string())?;
        let overtaken = commits.load(Ordering::SeqCst) - before;
        {
            let mut table = txn.open_table(TABLE).map_err(|e| e.to_string())?;
            table.insert((writer << 40) | seq, &VALUE[..]).map_err(|e| e.to_string())?;
        }
        txn.commit().map_err(|e| e.to_string())?;
        commits.fetch_add(1, Ordering::SeqCst);
        out.latency.push(began.elapsed());
        out.overtaken.push(overtaken);
        seq += 1;
    }
    Ok(out)
}

fn quantile<T: Copy>(sorted: &[T], q: f64) -> T {
    sorted[((sorted.len() - 1) as f64 * q) as usize]
}

fn run() -> Result<bool, String> {
    let seconds: u64 = common::env_number("BENCH_SECONDS", 20)?;
    let writers: u64 = common::env_number("BENCH_WRITERS", 16)?;
    if writers == 0 || seconds == 0 {
        return Err("BENCH_SECONDS and BENCH_WRITERS must be at least 1".into());
    }
    let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
    let db = Database::builder()
        .set_cache_size(64 << 20)
        .create(dir.path().join("slot.redb"))
        .map_err(|e| format!("creating the store: {e}"))?;
    let db = Arc::new(db);
    let commits = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(seconds);
    println!("{NAME}: {writers} threads, one durable redb write transaction each at a time, for {seconds} s");
    let threads: Vec<_> = (0..writers)
        .map(|writer| {
            let (db, commits) = (Arc::clone(&db), Arc::clone(&commits));
            std::thread::spawn(move || write_loop(&db, &commits, writer, deadline))
        })
        .collect();
    let (mut latency, mut overtaken) = (Vec::new(), Vec::new());
    for thread in threads {
        let writer = thread.join().map_err(|_| "a writer thread panicked".to_string())??;
        latency.extend(writer.latency);
        overtaken.extend(writer.overtaken);
    }
    if latency.is_empty() {
        return Err("no write finished".into());
    }
    latency.sort();
    overtaken.sort();
    let ms = |d: Duration| format!("{:.1}", d.as_secs_f64() * 1000.0);
    println!(
        "writes: {} ({:.0}/s); latency ms: p50 {}  p99 {}  p99.9 {}  max {}",
        latency.len(),
        latency.len() as f64 / seconds as f64,
        ms(quantile(&latency, 0.5)),
        ms(quantile(&latency, 0.99)),
        ms(quantile(&latency, 0.999)),
        ms(quantile(&latency, 1.0))
    );
    println!(
        "commits by other writers while one waited for the slot: p50 {}  p99 {}  p99.9 {}  max {}  \
         (first come, first served: at most {})",
        quantile(&overtaken, 0.5),
        quantile(&overtaken, 0.99),
        quantile(&overtaken, 0.999),
        quantile(&overtaken, 1.0),
        writers - 1
    );
    Ok(true)
}

pub fn main() -> std::process::ExitCode {
    common::bench_main(NAME, run)
}
