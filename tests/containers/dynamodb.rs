//! The DynamoDB adapter against DynamoDB servers in containers: AWS's DynamoDB Local
//! (`AGENTSTORE_TEST_DYNAMODB_IMAGE`, default `amazon/dynamodb-local:latest`) and dynalite built on
//! the local base (`AGENTSTORE_TEST_DYNALITE_IMAGE`, default `agentstore-test/dynalite:4.0.0`).
//!
//! Each opens the adapter with `create=true`, round-trips the whole value corpus through the
//! facade, and lists 60 keys in pages of 10 through the GSI, whose reads are eventually
//! consistent (so the listing is polled, with a deadline, until it is complete).

use std::sync::Arc;
use std::time::{Duration, Instant};

use agentstore::backend::dynamodb::{DynamoConfig, DynamoDbBackend};
use agentstore::backend::DocumentBackend;
use agentstore::store::{DataStore, StoreOptions};
use futures::future::BoxFuture;
use testcontainers::core::WaitFor;
use testcontainers::{ContainerAsync, GenericImage};

use crate::harness::{check, launch, Group, ImageRole, Launch, Origin, TrialFn};

const DYNAMODB_PORT: u16 = 8000;
/// How long the server may take to answer HTTP after its start.
const UP_DEADLINE: Duration = Duration::from_secs(60);
/// How long the GSI may take to show every written document.
const INDEX_DEADLINE: Duration = Duration::from_secs(30);

pub fn groups() -> Vec<Group> {
    let trials = || -> Vec<(&'static str, TrialFn)> {
        vec![
            ("round_trip_corpus", |endpoint| Box::pin(round_trip_corpus(endpoint))),
            ("list_keys_in_pages_of_10", |endpoint| Box::pin(list_keys_in_pages(endpoint))),
        ]
    };
    let ready: crate::harness::ReadyFn = |endpoint| Box::pin(async move { wait_until_up(&endpoint).await });
    vec![
        Group {
            name: "dynamodb_local",
            role: ImageRole {
                setting: "AGENTSTORE_TEST_DYNAMODB_IMAGE",
                default: "amazon/dynamodb-local:latest",
                origin: Origin::Official,
            },
            shared: Some((start, ready)),
            trials: trials(),
        },
        Group {
            name: "dynamodb_dynalite",
            role: ImageRole {
                setting: "AGENTSTORE_TEST_DYNALITE_IMAGE",
                default: "agentstore-test/dynalite:4.0.0",
                origin: Origin::Local("images"),
            },
            shared: Some((start, ready)),
            trials: trials(),
        },
    ]
}

// ---------------------------------------------------------------------------------------------
// Docker.
// ---------------------------------------------------------------------------------------------

/// Starts the container (both images listen on 8000); its endpoint. Readiness is polled.
fn start(image: String) -> BoxFuture<'static, Result<(ContainerAsync<GenericImage>, String), String>> {
    Box::pin(async move {
        let wait = WaitFor::Nothing;
        let (container, address) =
            launch(&image, Launch { port: DYNAMODB_PORT, wait, cmd: vec![], env: vec![] }).await?;
        Ok((container, format!("http://{address}")))
    })
}

/// Polls the endpoint until the server answers HTTP at all (an unsigned request gets a 400),
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
    Err(format!("the DynamoDB server at {endpoint} is not answering after {UP_DEADLINE:?}: {last}"))
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
    let failures = crate::corpus::differences(&store, true).await?;
    check(failures.is_empty(), || format!("values changed:\n  {}", failures.join("\n  ")))
}

/// 60 keys listed through the GSI with pages of 10, polled until the index shows them all.
async fn list_keys_in_pages(endpoint: String) -> Result<(), String> {
    let options = StoreOptions { page_size: 10, ..StoreOptions::default() };
    let store = open(&endpoint, &table("paging"), options).await?;
    let keys = crate::corpus::write_paging_keys(&store, 60, 3).await?;

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

    crate::corpus::pages_checked(&store, 10, 60).await?;
    let other = store.list_keys("user_q", "paging").await.map_err(|e| e.to_string())?;
    check(other.len() <= 3 && other.iter().all(|k| k.starts_with("other-")), || format!("user_q's keys: {other:?}"))
}
