//! Every container test, in one binary: the service's own image, the testcontainers recipes for
//! users' integration tests (Rust, Python, Node), the compose files (the local stack, and three
//! instances behind HAProxy), and the backends against their servers in containers.
//!
//! Each group of trials runs against one image, named by a setting; it prints, before any trial
//! runs, `RUN against IMAGE on ENGINE`, or `NOT RUN: reason` (its trials then show as ignored), or
//! `FAILS: reason` (see [`harness`]). scripts/test starts the engine and builds the local images
//! with scripts/containers before it runs this; `AGENTSTORE_TEST_CONTAINERS=0` deselects it.
//!
//! Containers are reached only through ports published on 127.0.0.1, never through the bridge
//! network's addresses.

#[path = "../common/mod.rs"]
mod common;

mod balanced;
mod compose;
mod corpus;
mod couchdb;
mod dynamodb;
mod firestore;
mod harness;
mod readme;
mod recipes;
mod service;

use std::process::ExitCode;
use std::sync::Arc;

use libtest_mimic::Arguments;

fn main() -> ExitCode {
    let args = Arguments::from_args();
    // DynamoDB Local and dynalite accept any credentials; without any the AWS SDK would look for
    // them as far as the instance metadata service.
    for (name, value) in [("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"), ("AWS_REGION", "us-east-1")]
    {
        if std::env::var_os(name).is_none() {
            std::env::set_var(name, value);
        }
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build() {
        Ok(runtime) => Arc::new(runtime),
        Err(e) => {
            eprintln!("containers: cannot build a tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // These machines have /.dockerenv without running inside a container: testcontainers would
    // reach the service through the bridge gateway instead of the loopback it is published on.
    if std::env::var_os("TESTCONTAINERS_HOST_OVERRIDE").is_none() {
        std::env::set_var("TESTCONTAINERS_HOST_OVERRIDE", "localhost");
    }
    // The recipes take the image from AGENTSTORE_IMAGE, as users' CI jobs would.
    std::env::set_var("AGENTSTORE_IMAGE", service::service_image_role().image());
    let groups = [
        service::groups(),
        readme::groups(),
        recipes::groups(),
        compose::groups(),
        balanced::groups(),
        couchdb::groups(),
        dynamodb::groups(),
        firestore::groups(),
    ]
    .into_iter()
    .flatten()
    .collect();
    let engine = if args.list { Err("listing only".to_owned()) } else { harness::engine() };
    let (trials, cleanup) = harness::trials(groups, &engine, &runtime, !args.list);
    let conclusion = libtest_mimic::run(&args, trials);
    cleanup.remove_all(&runtime);
    conclusion.exit_code()
}
