//! The Firestore backend against Google's Cloud Firestore emulator in containers: the one Google
//! ships in its Cloud SDK image (`AGENTSTORE_TEST_FIRESTORE_IMAGE`, default
//! `gcr.io/google.com/cloudsdktool/google-cloud-cli:528.0.0-emulators`, running `gcloud emulators
//! firestore start`) and the machine's emulator jar on Java 17 built on the local base
//! (`AGENTSTORE_TEST_FIRESTORE_JAR_IMAGE`, default `agentstore-test/firestore-emulator:local`).
//!
//! Each opens the backend with `emulator=HOST:PORT` of the published port, round-trips the whole
//! value corpus (including the bodies stored compressed and in chunk documents) through the
//! facade, and lists 60 keys in pages of 10.
//!
//! The containers are started with testcontainers' `GenericImage` rather than the
//! `google_cloud_sdk_emulators` module of testcontainers-modules: its newest release (0.15)
//! depends on testcontainers 0.27, which cannot be built together with the 0.28 used here (each
//! pins a different `bollard-stubs` 1.x exactly).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentstore::backend::firestore::{FirestoreBackend, FirestoreConfig};
use agentstore::backend::DocumentBackend;
use agentstore::store::{DataStore, StoreOptions};
use futures::future::BoxFuture;
use testcontainers::core::WaitFor;
use testcontainers::{ContainerAsync, GenericImage};

use crate::harness::{check, launch, Group, ImageRole, Launch, Origin, TrialFn};

const FIRESTORE_PORT: u16 = 8080;
/// The project the emulator is addressed with (it accepts any).
const PROJECT: &str = "agentstore-container-test";
/// How long the emulator may take to answer HTTP after its start.
const UP_DEADLINE: Duration = Duration::from_secs(90);

pub fn groups() -> Vec<Group> {
    let trials = || -> Vec<(&'static str, TrialFn)> {
        vec![
            ("round_trip_corpus", |host_port| Box::pin(round_trip_corpus(host_port))),
            ("list_keys_in_pages_of_10", |host_port| Box::pin(list_keys_in_pages(host_port))),
        ]
    };
    let ready: crate::harness::ReadyFn = |host_port| Box::pin(async move { wait_until_up(&host_port).await });
    vec![
        Group {
            name: "firestore_sdk_image",
            role: ImageRole {
                setting: "AGENTSTORE_TEST_FIRESTORE_IMAGE",
                default: "gcr.io/google.com/cloudsdktool/google-cloud-cli:528.0.0-emulators",
                origin: Origin::Official,
            },
            shared: Some((start_sdk_image, ready)),
            trials: trials(),
        },
        Group {
            name: "firestore_emulator_jar",
            role: ImageRole {
                setting: "AGENTSTORE_TEST_FIRESTORE_JAR_IMAGE",
                default: "agentstore-test/firestore-emulator:local",
                origin: Origin::Local("images"),
            },
            shared: Some((start_jar_image, ready)),
            trials: trials(),
        },
    ]
}

// ---------------------------------------------------------------------------------------------
// Docker.
// ---------------------------------------------------------------------------------------------

/// Google's Cloud SDK image, told to start the emulator; its address. Readiness is polled.
fn start_sdk_image(image: String) -> BoxFuture<'static, Result<(ContainerAsync<GenericImage>, String), String>> {
    Box::pin(async move {
        let cmd = ["gcloud", "emulators", "firestore", "start"].map(str::to_owned).to_vec();
        let cmd = [cmd, vec![format!("--host-port=0.0.0.0:{FIRESTORE_PORT}")]].concat();
        launch(&image, Launch { port: FIRESTORE_PORT, wait: WaitFor::Nothing, cmd, env: vec![] }).await
    })
}

/// The emulator jar image scripts/containers builds (its entrypoint starts the emulator).
fn start_jar_image(image: String) -> BoxFuture<'static, Result<(ContainerAsync<GenericImage>, String), String>> {
    Box::pin(async move {
        launch(&image, Launch { port: FIRESTORE_PORT, wait: WaitFor::Nothing, cmd: vec![], env: vec![] }).await
    })
}

/// Polls `GET /` until the emulator answers 200 (its body is `Ok`), or the deadline passes.
async fn wait_until_up(host_port: &str) -> Result<(), String> {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(5)).build().map_err(|e| e.to_string())?;
    let url = format!("http://{host_port}/");
    let started = Instant::now();
    let mut last = String::from("no answer yet");
    while started.elapsed() < UP_DEADLINE {
        match http.get(&url).send().await {
            Ok(response) if response.status().is_success() => return Ok(()),
            Ok(response) => last = format!("HTTP {}", response.status()),
            Err(e) => last = e.to_string(),
        }
        // Poll interval.
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Err(format!("the Firestore emulator at {host_port} is not answering after {UP_DEADLINE:?}: {last}"))
}

// ---------------------------------------------------------------------------------------------
// The trials.
// ---------------------------------------------------------------------------------------------

/// A new collection name on the emulator (collections need no creating).
fn collection(tag: &str) -> String {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    format!("container_{tag}_{}_{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed))
}

/// The backend on a new collection of the emulator, and the facade over it.
async fn open(host_port: &str, collection: &str, options: StoreOptions) -> Result<DataStore, String> {
    let config = FirestoreConfig::parse(&format!("firestore://{PROJECT}?emulator={host_port}&collection={collection}"))
        .map_err(|e| e.to_string())?;
    let backend: Arc<dyn DocumentBackend> =
        Arc::new(FirestoreBackend::open(&config).await.map_err(|e| format!("FirestoreBackend::open: {e}"))?);
    DataStore::open(backend, options).await.map_err(|e| format!("DataStore::open: {e}"))
}

/// Every corpus value through `set`/`get`, compared by exact decimal value.
async fn round_trip_corpus(host_port: String) -> Result<(), String> {
    let store = open(&host_port, &collection("roundtrip"), StoreOptions::default()).await?;
    let failures = crate::corpus::differences(&store, true).await?;
    check(failures.is_empty(), || format!("values changed:\n  {}", failures.join("\n  ")))
}

/// 60 keys listed with pages of 10; another user's keys stay out. Firestore queries are strongly
/// consistent, so the listing is complete at once.
async fn list_keys_in_pages(host_port: String) -> Result<(), String> {
    let options = StoreOptions { page_size: 10, ..StoreOptions::default() };
    let store = open(&host_port, &collection("paging"), options).await?;
    let keys = crate::corpus::write_paging_keys(&store, 60, 3).await?;

    let listed = store.list_keys("user_p", "paging").await.map_err(|e| format!("list_keys: {e}"))?;
    check(listed == keys, || format!("list_keys returned {} keys, expected the 60 written: {listed:?}", listed.len()))?;

    let pages = crate::corpus::pages_checked(&store, 10, 60).await?;
    let mut paged: Vec<String> = pages.into_iter().flatten().collect();
    paged.sort_unstable();
    check(paged == keys, || format!("the pages hold {paged:?}, expected each of the 60 keys once"))?;
    let other = store.list_keys("user_q", "paging").await.map_err(|e| e.to_string())?;
    check(other == ["other-0", "other-1", "other-2"], || format!("user_q's keys: {other:?}"))
}
