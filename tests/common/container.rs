//! The frame of the testcontainers tests: one container per test process, started by the first
//! trial that needs it and removed after the run, and trials reported as `ignored`, with a plain
//! "NOT RUN: no Docker engine reachable" line, when there is no engine. Asking for ignored trials
//! (`--ignored` / `--include-ignored`) without an engine fails them, so a run never looks as if it
//! tested a container when it did not.

use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use libtest_mimic::{Arguments, Failed, Trial};
use testcontainers::{ContainerAsync, GenericImage};

/// One trial: gets the address the container's server answers on.
pub type TrialFn = fn(String) -> BoxFuture<'static, Result<(), String>>;

/// How a test starts its container: the started container, kept for removal whatever happens
/// next, and its address.
pub type StartFn = fn() -> BoxFuture<'static, Result<(ContainerAsync<GenericImage>, String), String>>;

/// Waits until the server at the address answers.
pub type ReadyFn = fn(String) -> BoxFuture<'static, Result<(), String>>;

/// Runs `trials` against one container started with `start`; `label` names the test in its
/// report lines (`couchdb`, `dynamodb`, …), `image` the image.
pub fn run(label: &str, image: &str, trials: Vec<(&'static str, TrialFn)>, start: StartFn, ready: ReadyFn) -> ExitCode {
    let args = Arguments::from_args();
    let engine = super::docker::engine();
    if !args.list {
        match &engine {
            Ok(engine) => println!("{label} testcontainers test RUN against {image} on {engine}"),
            Err(reason) => println!("{label} testcontainers test NOT RUN: no Docker engine reachable ({reason})"),
        }
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build() {
        Ok(runtime) => Arc::new(runtime),
        Err(e) => {
            eprintln!("{label} testcontainers test: cannot build a tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let container =
        Arc::new(SharedContainer { start, ready, address: Default::default(), container: Mutex::new(None) });
    let trials = trials
        .into_iter()
        .map(|(name, run)| {
            let ignored = engine.is_err();
            let engine = engine.clone();
            let runtime = Arc::clone(&runtime);
            let container = Arc::clone(&container);
            Trial::test(name, move || {
                if let Err(reason) = engine {
                    return Err(Failed::from(format!("no Docker engine reachable ({reason})")));
                }
                runtime.block_on(async move {
                    let address = container.address().await.map_err(Failed::from)?;
                    run(address).await.map_err(Failed::from)
                })
            })
            .with_kind("testcontainers")
            .with_ignored_flag(ignored)
        })
        .collect();
    let conclusion = libtest_mimic::run(&args, trials);
    if let Some(container) = container.container.lock().unwrap_or_else(|e| e.into_inner()).take() {
        let id = container.id().to_owned();
        if let Err(e) = runtime.block_on(container.rm()) {
            eprintln!("{label} testcontainers test: could not remove container {id}: {e}");
        }
    }
    conclusion.exit_code()
}

struct SharedContainer {
    start: StartFn,
    ready: ReadyFn,
    address: tokio::sync::OnceCell<Result<String, String>>,
    container: Mutex<Option<ContainerAsync<GenericImage>>>,
}

impl SharedContainer {
    /// The running container's address, starting it on first use.
    async fn address(&self) -> Result<String, String> {
        self.address
            .get_or_init(|| async {
                let (container, address) = (self.start)().await?;
                *self.container.lock().unwrap_or_else(|e| e.into_inner()) = Some(container);
                (self.ready)(address.clone()).await?;
                Ok(address)
            })
            .await
            .clone()
    }
}

/// `Err(message())` unless `condition`.
pub fn check(condition: bool, message: impl FnOnce() -> String) -> Result<(), String> {
    if condition {
        Ok(())
    } else {
        Err(message())
    }
}

/// Writes every corpus value with `set` and reads it back with `get`; the values that came back
/// changed (compared by exact decimal value), as `name: what differs` lines.
pub async fn corpus_differences(store: &agentstore::store::DataStore) -> Result<Vec<String>, String> {
    use super::json::first_difference;
    let mut failures = Vec::new();
    for case in &super::corpus::cases() {
        let written = store
            .set("corpus", "values", &case.name, case.value.clone(), None, Some("container-test"))
            .await
            .map_err(|e| format!("set {}: {e}", case.name))?;
        if let Some(diff) = first_difference(&case.value, &written.body["value"]) {
            failures.push(format!("{}: set returned {diff}", case.name));
        }
        let read = store
            .get("corpus", "values", &case.name, None)
            .await
            .map_err(|e| format!("get {}: {e}", case.name))?
            .ok_or_else(|| format!("get {}: not found after set", case.name))?;
        if let Some(diff) = first_difference(&case.value, &read.body["value"]) {
            failures.push(format!("{}: read back {diff}", case.name));
        }
    }
    Ok(failures)
}
