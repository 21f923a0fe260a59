//! The libtest-mimic suites that run on every selected backend, in one binary: migration
//! (`migrate::…`), moving whole deployments (`migrate_databases::…`), whole databases through a file (`export_import::…`), live migration (`live_migrate::…`), the CouchDB API (`couchdb_api::…`) and
//! real CouchDB clients against it (`couchdb_clients::…`), and three instances behind HAProxy
//! (`balancer::…`), and the console at `/_utils` in a real browser (`console::…`). Each suite prints, before the run,
//! which backends it runs against which server and what does NOT RUN and why; a filter such as
//! `cargo test --test suites -- couchdb_api::` runs one suite.
//!
//! The contract suite (`tests/contract/`) stays a binary of its own: it is every backend's
//! behaviour tests, selected per backend (`-- embedded::`), and other projects' adapters are
//! held to it. The container tests (`tests/containers/`) need a Docker engine and their own
//! runtime and cleanup.

#[path = "../common/mod.rs"]
mod common;

mod balancer;
mod console;
mod couchdb_api;
mod couchdb_clients;
mod export_import;
mod live_migrate;
mod migrate;
mod migrate_databases;

use std::process::ExitCode;

use libtest_mimic::Arguments;

fn main() -> ExitCode {
    // The live migration suite starts this binary again as its writer process.
    if live_migrate::run_if_writer() {
        return ExitCode::SUCCESS;
    }
    let args = Arguments::from_args();
    let mut trials = Vec::new();
    for suite in [
        migrate::trials,
        migrate_databases::trials,
        export_import::trials,
        live_migrate::trials,
        couchdb_api::trials,
        couchdb_clients::trials,
        balancer::trials,
        console::trials,
    ] {
        let Some(suite_trials) = suite(&args) else {
            return ExitCode::FAILURE;
        };
        trials.extend(suite_trials);
    }
    let conclusion = libtest_mimic::run(&args, trials);
    couchdb_clients::stop_started_processes();
    conclusion.exit_code()
}
