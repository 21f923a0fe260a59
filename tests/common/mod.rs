//! What the test binaries share: a deployment of several instances behind HAProxy (`balancer`), the round-trip value corpus, JSON comparison by exact decimal
//! value, the local test servers, the backends the suites run on (`harness`), the counting
//! proxy, and the small helpers below (one runtime per libtest-mimic trial, the `check` those
//! trials use, the `agentstore` command, the timestamp shape, documents in the spec's shape).
//!
//! Each binary (`integration`, `suites`, `contract`, `containers`) includes this module once, at
//! its root, as `common`.

// Every binary uses a different part of this module, and an unused item of a binary crate is a
// warning even when public.
#![allow(dead_code)]

pub mod balancer;
pub mod corpus;
pub mod counting_proxy;
pub mod harness;
pub mod json;
pub mod servers;

use std::future::Future;
use std::path::Path;
use std::process::{Command, Stdio};

use libtest_mimic::Failed;
use serde_json::{json, Map, Value};

/// The `agentstore` binary cargo built for these tests.
pub const AGENTSTORE: &str = env!("CARGO_BIN_EXE_agentstore");

/// What a libtest-mimic trial answers.
pub type TestResult = Result<(), Failed>;

/// Runs one libtest-mimic trial's future on a runtime of its own (two workers, as the 2-core CI
/// machine has), so trials on parallel threads share nothing but the process.
pub fn block_on(test: impl Future<Output = TestResult>) -> TestResult {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Failed::from(format!("tokio runtime: {e}")))?
        .block_on(test)
}

/// `Err(message())` unless `condition`: an assertion that fails a libtest-mimic trial instead
/// of panicking.
pub fn check(condition: bool, message: impl FnOnce() -> String) -> TestResult {
    if condition {
        Ok(())
    } else {
        Err(message().into())
    }
}

/// A command for the `agentstore` binary cargo built, run in `dir`; see [`agentstore_at`].
pub fn agentstore(dir: &Path) -> Command {
    let mut command = agentstore_at(Path::new(AGENTSTORE));
    command.current_dir(dir);
    command
}

/// A command for the `agentstore` binary at `program`, with stdin from `/dev/null` and none of
/// the caller's `AGENTSTORE_*` settings nor its `RUST_LOG`: what a test reads from the process
/// (its output, its log lines, which settings it used) never depends on the environment the
/// tests were started in. A test that wants a setting or a log level sets it on the command.
pub fn agentstore_at(program: &Path) -> Command {
    let mut command = Command::new(program);
    command.stdin(Stdio::null());
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("AGENTSTORE_") {
            command.env_remove(&name);
        }
    }
    command.env_remove("RUST_LOG");
    command
}

/// `^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$` (the service's timestamps), checked by hand.
pub fn is_timestamp(text: &str) -> bool {
    let bytes = text.as_bytes();
    bytes.len() == 20
        && bytes.iter().enumerate().all(|(i, &b)| match i {
            4 | 7 => b == b'-',
            10 => b == b'T',
            13 | 16 => b == b':',
            19 => b == b'Z',
            _ => b.is_ascii_digit(),
        })
}

/// Test data that must be a JSON object, as an object (a test's own literal: never client input).
pub fn object(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        other => panic!("test data is not an object: {other}"),
    }
}

/// A document body in the spec's shape, fields in the spec's order: `userId`, `namespace`,
/// `key`, `value`.
pub fn body(user: &str, namespace: &str, key: &str, value: Value) -> Map<String, Value> {
    object(json!({ "userId": user, "namespace": namespace, "key": key, "value": value }))
}

/// The JSON body of a request a mock server received (the adapters send nothing else).
pub fn request_json(request: &wiremock::Request) -> Value {
    serde_json::from_slice(&request.body)
        .unwrap_or_else(|e| panic!("a request body that is not JSON ({e}): {}", String::from_utf8_lossy(&request.body)))
}
