//! The contract suite: every facade operation and the `DocumentBackend` trait's semantics,
//! run unchanged on every backend. See `tests/common/harness.rs` for how backends are selected and added.

#[path = "../common/mod.rs"]
mod common;

mod attachments;
mod branches;
mod cases;
mod catalog;
mod crash;
mod crash_catalog;
mod crash_sweep;
mod crash_sweep_data_store;
mod crash_sweep_data_store_bulk;
mod crash_sweep_migrate;
mod crash_sweep_replicator;
mod crash_sweep_views;
mod document_model;
mod engine_data_store;
mod local_docs;
mod purge_races;
mod replication;
mod rev_trees;
mod writer;

use std::process::ExitCode;

use common::harness;
use libtest_mimic::{Arguments, Failed, Trial};

fn main() -> ExitCode {
    if writer::run_if_writer() {
        return ExitCode::SUCCESS;
    }
    let args = Arguments::from_args();
    let Some((backends, selected)) = harness::announce("contract suite", args.list) else {
        return ExitCode::FAILURE;
    };

    let mut trials = Vec::new();
    for backend in &backends {
        let run_it = selected.contains(&backend.name);
        for case in cases::all() {
            let fresh = backend.fresh;
            let run = case.run;
            let trial = Trial::test(format!("{}::{}", backend.name, case.name), move || {
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .map_err(|e| Failed::from(format!("tokio runtime: {e}")))?;
                runtime.block_on(async move {
                    let ctx = fresh().await.map_err(|e| Failed::from(format!("backend unavailable: {e}")))?;
                    run(ctx).await;
                    Ok(())
                })
            })
            .with_kind(backend.name)
            .with_ignored_flag(!run_it);
            trials.push(trial);
        }
    }
    libtest_mimic::run(&args, trials).exit_code()
}
