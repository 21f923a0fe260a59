//! The DynamoDB adapter against DynamoDB Local in a container (testcontainers, image
//! `amazon/dynamodb-local`), where a Docker engine is reachable.
//!
//! DynamoDB Local is AWS's own local implementation, closer to the service than dynalite (which
//! the contract suite uses). This test opens the adapter with `create=true`, round-trips the whole
//! value corpus through the facade, and lists 60 keys in pages of 10 through the GSI, whose reads
//! are eventually consistent (so the listing is polled, with a deadline, until it is complete).
//!
//! Without a reachable Docker engine the trials are reported as `ignored` and a line saying
//! "dynamodb testcontainers test NOT RUN: no Docker engine reachable (...)" is printed, so a run
//! never looks as if it tested DynamoDB Local when it did not. Asking for ignored trials
//! (`--ignored` / `--include-ignored`) without an engine fails them.

mod common;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentstore::backend::dynamodb::{DynamoConfig, DynamoDbBackend};
use agentstore::backend::DocumentBackend;
use agentstore::store::{DataStore, StoreOptions};
use futures::future::BoxFuture;
use futures::TryStreamExt;
use serde_json::json;
use testcontainers::core::{IntoContainerPort, WaitFor};
use testcontainers::runners::AsyncRunner;
use testcontainers::{ContainerAsync, GenericImage, ImageExt};

use common::container::{check, TrialFn};

const IMAGE: &str = "amazon/dynamodb-local";
const TAG: &str = "latest";
const DYNAMODB_PORT: u16 = 8000;
/// Pulling the image on a cold machine plus its start.
const CONTAINER_STARTUP_TIMEOUT: Duration = Duration::from_secs(600);
/// How long DynamoDB Local may take to answer HTTP after its start message.
const UP_DEADLINE: Duration = Duration::from_secs(60);
/// How long the GSI may take to show every written document.
const INDEX_DEADLINE: Duration = Duration::from_secs(30);

fn main() -> ExitCode {
    let trials: Vec<(&'static str, TrialFn)> = vec![
        ("dynamodb_local::round_trip_corpus", |endpoint| Box::pin(round_trip_corpus(endpoint))),
        ("dynamodb_local::list_keys_in_pages_of_10", |endpoint| Box::pin(list_keys_in_pages(endpoint))),
    ];
    common::container::run("dynamodb", &format!("{IMAGE}:{TAG}"), trials, start, |endpoint| {
        Box::pin(async move { wait_until_up(&endpoint).await })
    })
}

// ---------------------------------------------------------------------------------------------
// Docker.
// ---------------------------------------------------------------------------------------------

/// Starts the container; its address once the image's start message is seen.
fn start() -> BoxFuture<'static, Result<(ContainerAsync<GenericImage>, String), String>> {
    Box::pin(async {
        let container = GenericImage::new(IMAGE, TAG)
            .with_exposed_port(DYNAMODB_PORT.tcp())
            .with_wait_for(WaitFor::message_on_either_std("Initializing DynamoDB Local"))
            .with_startup_timeout(CONTAINER_STARTUP_TIMEOUT)
            .start()
            .await
            .map_err(|e| format!("cannot start {IMAGE}:{TAG}: {e}"))?;
        let host = container.get_host().await.map_err(|e| format!("{IMAGE} container host: {e}"));
        let port = container.get_host_port_ipv4(DYNAMODB_PORT.tcp()).await.map_err(|e| format!("port {e}"));
        let endpoint = format!("http://{}:{}", host?, port?);
        Ok((container, endpoint))
    })
}

/// Polls the endpoint until DynamoDB Local answers HTTP at all (an unsigned request gets a 400),
/// or the deadline passes.
async fn wait_until_up(endpoint: &str) -> Result<(), String> {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(5)).build().map_err(|e| e.to_string())?;
    let started = Instant::now();
    let mut last = String::from("no answer yet");
    while started.elapsed() < UP_DEADLINE {
        match http.post(endpoint).header("X-Amz-Target", "DynamoDB_20120810.ListTables").body("{}").send().await {
            Ok(_) => return Ok(()),
            Err(e) => last = e.to_string(),
        }
        // Poll interval.
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Err(format!("DynamoDB Local at {endpoint} not answering after {UP_DEADLINE:?}: {last}"))
}

// ---------------------------------------------------------------------------------------------
// The trials.
// ---------------------------------------------------------------------------------------------

/// A new table name on the container's server.
fn table(tag: &str) -> String {
    static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    format!("container_{tag}_{}", COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

/// The adapter opened with `?create=true` on a new table, and the facade over it.
async fn open(endpoint: &str, table: &str, options: StoreOptions) -> Result<DataStore, String> {
    let config = DynamoConfig::parse(&format!("dynamodb://{table}?region=us-east-1&endpoint={endpoint}&create=true"))
        .map_err(|e| e.to_string())?;
    let backend: Arc<dyn DocumentBackend> =
        Arc::new(DynamoDbBackend::open(&config).await.map_err(|e| format!("DynamoDbBackend::open: {e}"))?);
    DataStore::open(backend, options).await.map_err(|e| format!("DataStore::open: {e}"))
}

/// Every corpus value through `set`/`get`, compared by exact decimal value.
async fn round_trip_corpus(endpoint: String) -> Result<(), String> {
    let store = open(&endpoint, &table("roundtrip"), StoreOptions::default()).await?;
    let failures = common::container::corpus_differences(&store).await?;
    check(failures.is_empty(), || format!("values changed on DynamoDB Local:\n  {}", failures.join("\n  ")))
}

/// 60 keys listed through the GSI with pages of 10, polled until the index shows them all.
async fn list_keys_in_pages(endpoint: String) -> Result<(), String> {
    let options = StoreOptions { page_size: 10, ..StoreOptions::default() };
    let store = open(&endpoint, &table("paging"), options).await?;
    let keys: Vec<String> = (0..60).map(|i| format!("key-{i:02}")).collect();
    for key in &keys {
        store.set("user_p", "paging", key, json!(key), None, None).await.map_err(|e| format!("set {key}: {e}"))?;
    }
    for i in 0..3 {
        store.set("user_q", "paging", &format!("other-{i}"), json!(i), None, None).await.map_err(|e| e.to_string())?;
    }

    let started = Instant::now();
    let listed = loop {
        let listed = store.list_keys("user_p", "paging").await.map_err(|e| format!("list_keys: {e}"))?;
        if listed.len() >= keys.len() || started.elapsed() > INDEX_DEADLINE {
            break listed;
        }
        // Poll interval while the GSI catches up.
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    check(listed == keys, || {
        format!(
            "list_keys returned {} keys after {:?}, expected the 60 written: {listed:?}",
            listed.len(),
            started.elapsed()
        )
    })?;

    let pages: Vec<Vec<String>> = store
        .list_keys_pages("user_p", "paging")
        .map_err(|e| e.to_string())?
        .try_collect()
        .await
        .map_err(|e| format!("list_keys_pages: {e}"))?;
    let sizes: Vec<usize> = pages.iter().map(Vec::len).collect();
    check(sizes.iter().all(|n| *n <= 10) && sizes.iter().sum::<usize>() == 60 && sizes.len() >= 6, || {
        format!("page sizes {sizes:?} (page_size 10, 60 keys)")
    })?;
    let other = store.list_keys("user_q", "paging").await.map_err(|e| e.to_string())?;
    check(other.len() <= 3 && other.iter().all(|k| k.starts_with("other-")), || format!("user_q's keys: {other:?}"))
}
