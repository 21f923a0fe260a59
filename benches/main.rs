//! Every benchmark, in one binary: each is a module, selected by name as the first argument that
//! is not an option (`cargo bench --bench benches -- serve_load`); with none named, all run in
//! the order below. Each reads the same `BENCH_*` settings as before it was a module.
//!
//! `cargo bench` passes `--bench`; `cargo test --all-targets` runs this binary without it, and
//! then each bench only prints how to run it (`couchdb_auth`, which needs no server and takes
//! seconds, runs either way).

mod common;
// Shared with the tests (`tests/common/`); the benches use part of each.
#[allow(dead_code)]
#[path = "../tests/common/balancer.rs"]
mod balancer;
#[allow(dead_code)]
#[path = "../tests/common/counting_proxy.rs"]
mod counting_proxy;
#[allow(dead_code)]
#[path = "../tests/common/servers.rs"]
mod servers;

mod attachments_bench;
mod balanced_bench;
mod couchdb_api_bench;
mod couchdb_auth;
mod couchdb_overhead;
mod databases_bench;
mod deployment_bench;
mod dynamodb_bench;
mod feed_bench;
mod firestore_bench;
mod follow_bench;
mod hot_key;
mod mango_find;
mod migrate_bench;
mod native_layout;
mod replication_bench;
mod serve_load;
mod versus_couchdb;
mod views_bench;
mod write_slot;

use std::process::ExitCode;

/// A bench's `main`.
type BenchMain = fn() -> ExitCode;

/// Each bench by name, and its `main`.
const BENCHES: [(&str, BenchMain); 20] = [
    ("serve_load", serve_load::main),
    ("write_slot", write_slot::main),
    ("couchdb_overhead", couchdb_overhead::main),
    ("couchdb_auth", || {
        couchdb_auth::main();
        ExitCode::SUCCESS
    }),
    ("dynamodb_bench", dynamodb_bench::main),
    ("migrate_bench", migrate_bench::main),
    ("firestore_bench", firestore_bench::main),
    ("hot_key", hot_key::main),
    ("feed_bench", feed_bench::main),
    ("follow_bench", follow_bench::main),
    ("couchdb_api_bench", couchdb_api_bench::main),
    ("databases_bench", databases_bench::main),
    ("deployment_bench", deployment_bench::main),
    ("attachments_bench", attachments_bench::main),
    ("views_bench", views_bench::main),
    ("mango_find", || {
        mango_find::main();
        ExitCode::SUCCESS
    }),
    ("native_layout", native_layout::main),
    ("balanced_bench", balanced_bench::main),
    ("versus_couchdb", versus_couchdb::main),
    ("replication_bench", replication_bench::main),
];

fn main() -> ExitCode {
    let Some(name) = std::env::args().skip(1).find(|a| !a.starts_with('-')) else {
        // All of them; the run fails if any did.
        let failed: Vec<&str> = BENCHES.iter().filter(|(_, run)| run() != ExitCode::SUCCESS).map(|(n, _)| *n).collect();
        if failed.is_empty() {
            return ExitCode::SUCCESS;
        }
        eprintln!("benches that failed: {}", failed.join(", "));
        return ExitCode::FAILURE;
    };
    match BENCHES.iter().find(|(n, _)| *n == name) {
        Some((_, run)) => run(),
        None => {
            let names: Vec<&str> = BENCHES.iter().map(|(n, _)| *n).collect();
            eprintln!("no bench named {name:?}; the benches: {}", names.join(", "));
            ExitCode::FAILURE
        }
    }
}
