//! The crash layer: a backend around another one that lets the first `k` storage calls through
//! and then stands for a crash at that point, for the crash-point sweep (`crash_sweep.rs`,
//! docs/design/crash-points.md).
//!
//! Two kinds of cut:
//! - [`Cut::Stop`]: the process stopped after `k` calls. Call `k` (counting from 0) and every
//!   later one fail with `Unavailable` without reaching storage. (A crash after call `k - 1`
//!   committed but before its caller saw the answer leaves storage as `Stop` at `k` does.)
//! - [`Cut::LoseAnswer`]: call `k` reaches storage, but its answer is lost (the caller gets
//!   `Unavailable`, as after a timeout of a request that committed), and the process goes on:
//!   every later call passes. This is the half of a crash point the caller's error handling sees.
//!
//! Every method of [`DocumentBackend`] that reaches storage is counted: the layer overrides them
//! all through one macro, and [`every_storage_method_is_counted`] checks the list against the
//! trait's source, so a new trait method cannot pass by uncounted. [`CrashingCatalog`] counts
//! a catalog's own calls and those of every database it opens at one [`CrashPoint`].

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use agentstore::backend::catalog::{Catalog, DbName};
use agentstore::backend::raw::layer::Layered;
use agentstore::backend::rev_tree::RevTree;
use agentstore::backend::{
    BulkWrite, BulkWriteText, ChangesPage, DesignRequest, DesignResponse, DocumentBackend, DocumentText, EraseOptions,
    IdRange, LayoutState, Page, Precondition, Query, ReplicatedLeaf, ReplicatedOutcome, ReplicatedRevision, Revision,
    RevisionInfo, StoredDocument, UpgradePage,
};
use agentstore::{Error, ErrorKind, Result};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

/// How the `k`-th call is cut (module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    Stop,
    LoseAnswer,
}

/// What the layer does with one call.
enum Admission {
    Pass,
    Refuse,
    PassAndLoseAnswer,
}

/// Where the crash falls, and what was called: shared by every backend of one process (the
/// databases a catalog opens, [`CrashingCatalog`]), so the count runs over all of them.
pub struct CrashPoint {
    limit: usize,
    cut: Cut,
    calls: AtomicUsize,
    cut_made: AtomicBool,
    /// Set once the operation under test has returned: the calls of work it left running in
    /// the background (a collection it asked for) are refused uncounted, as if the process
    /// ended there, so the count is the operation's own.
    ended: AtomicBool,
    /// The methods called, in order (for the sweep's report of each operation's steps).
    called: Mutex<Vec<&'static str>>,
}

impl CrashPoint {
    pub fn new(limit: usize, cut: Cut) -> Arc<Self> {
        Arc::new(CrashPoint {
            limit,
            cut,
            calls: AtomicUsize::new(0),
            cut_made: AtomicBool::new(false),
            ended: AtomicBool::new(false),
            called: Mutex::new(Vec::new()),
        })
    }

    /// Whether a call has been cut yet.
    pub fn cut_made(&self) -> bool {
        self.cut_made.load(Ordering::SeqCst)
    }

    /// How many storage calls were asked for so far (cut ones included).
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// Ends the process after the operation returned (see `ended`).
    pub fn end(&self) {
        self.ended.store(true, Ordering::SeqCst);
    }

    /// The methods called so far, in order.
    pub fn called(&self) -> Vec<&'static str> {
        self.called.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone()
    }

    /// Waits until a call has been cut (polled: the sweep's operations are short).
    pub async fn cut_reached(&self) {
        while !self.cut_made() {
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
    }

    fn admit(&self, method: &'static str) -> Admission {
        if self.ended.load(Ordering::SeqCst) {
            return Admission::Refuse;
        }
        self.called.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(method);
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        let admission = match self.cut {
            Cut::Stop if call >= self.limit => Admission::Refuse,
            Cut::LoseAnswer if call == self.limit => Admission::PassAndLoseAnswer,
            _ => Admission::Pass,
        };
        if !matches!(admission, Admission::Pass) {
            self.cut_made.store(true, Ordering::SeqCst);
        }
        admission
    }

    /// Runs `call` (a future that has not started: nothing reaches storage before it is polled)
    /// as the crash point says.
    pub async fn gate<T>(&self, method: &'static str, call: impl std::future::Future<Output = Result<T>>) -> Result<T> {
        match self.admit(method) {
            Admission::Pass => call.await,
            Admission::Refuse => Err(Error::new(
                ErrorKind::Unavailable,
                format!("crash layer: the process stopped after {} calls", self.limit),
            )),
            Admission::PassAndLoseAnswer => {
                let _lost = call.await;
                Err(Error::new(
                    ErrorKind::Unavailable,
                    format!("crash layer: the answer of call {} was lost", self.limit),
                ))
            }
        }
    }
}

/// The backend `inner` with a crash at the `limit`-th storage call of its [`CrashPoint`].
pub struct CrashLayer {
    inner: Arc<dyn DocumentBackend>,
    point: Arc<CrashPoint>,
}

impl CrashLayer {
    pub fn new(inner: Arc<dyn DocumentBackend>, limit: usize, cut: Cut) -> Self {
        Self::at(inner, CrashPoint::new(limit, cut))
    }

    /// `inner`, counted with the other backends sharing `point`.
    pub fn at(inner: Arc<dyn DocumentBackend>, point: Arc<CrashPoint>) -> Self {
        CrashLayer { inner, point }
    }

    pub fn cut_made(&self) -> bool {
        self.point.cut_made()
    }

    pub fn calls(&self) -> usize {
        self.point.calls()
    }

    pub fn end(&self) {
        self.point.end()
    }

    pub fn called(&self) -> Vec<&'static str> {
        self.point.called()
    }
}

/// A catalog whose databases (and its own calls) crash at one shared [`CrashPoint`]: the sink
/// of a deployment move, or the databases created and deleted by the catalog sweep.
pub struct CrashingCatalog {
    inner: Arc<dyn Catalog>,
    point: Arc<CrashPoint>,
    /// The layer made over each handle of the inner catalog (by its address), handed out again
    /// for the same handle: a catalog gives the same handle while a database is the same one,
    /// and `Databases` lets go of an open database whose handle changed.
    layers: std::sync::Mutex<Vec<(usize, Arc<dyn DocumentBackend>)>>,
}

impl CrashingCatalog {
    pub fn new(inner: Arc<dyn Catalog>, point: Arc<CrashPoint>) -> Self {
        CrashingCatalog { inner, point, layers: std::sync::Mutex::new(Vec::new()) }
    }

    fn layered(&self, backend: Arc<dyn DocumentBackend>) -> Arc<dyn DocumentBackend> {
        let address = Arc::as_ptr(&backend).cast::<()>() as usize;
        let mut layers = self.layers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((_, layer)) = layers.iter().find(|(kept, _)| *kept == address) {
            return Arc::clone(layer);
        }
        let layer: Arc<dyn DocumentBackend> = Arc::new(CrashLayer::at(backend, Arc::clone(&self.point)));
        layers.push((address, Arc::clone(&layer)));
        layer
    }
}

#[async_trait::async_trait]
impl Catalog for CrashingCatalog {
    fn describe(&self) -> String {
        self.inner.describe()
    }

    async fn create(&self, name: &DbName) -> Result<Arc<dyn DocumentBackend>> {
        let created = self.point.gate("Catalog::create", self.inner.create(name)).await?;
        Ok(self.layered(created))
    }

    async fn open(&self, name: &DbName) -> Result<Option<Arc<dyn DocumentBackend>>> {
        let opened = self.point.gate("Catalog::open", self.inner.open(name)).await?;
        Ok(opened.map(|backend| self.layered(backend)))
    }

    async fn delete(&self, name: &DbName) -> Result<bool> {
        self.point.gate("Catalog::delete", self.inner.delete(name)).await
    }

    async fn list(&self) -> Result<Vec<DbName>> {
        self.point.gate("Catalog::list", self.inner.list()).await
    }

    async fn forget(&self, name: &DbName) {
        self.inner.forget(name).await
    }
}

/// The trait's methods that never reach storage (they describe the backend): forwarded uncounted.
pub const DESCRIPTIVE: &[&str] = &[
    "describe",
    "change_feed_delay",
    "position_order",
    "url",
    "forwards_requests",
    "attachment_chunk_bytes",
    "checks_never_written",
    "keeps_branches",
    "shared_with_other_processes",
];

/// Methods a layer answers itself without reaching storage: the reads of stored text, which
/// layers do not forward (`DocumentBackend::get_many_text`), so the engine reads through the
/// counted `get_many` and `all_docs` under this layer; and `record_with_local`, which layers do
/// not forward either (the data-store layout then reads through the counted `revisions`, `get`
/// and `get_local`).
pub const ANSWERED_BY_THE_LAYER: &[&str] = &["get_many_text", "all_docs_stored_text", "record_with_local"];

macro_rules! counted_layer {
    ($(fn $name:ident(&self $(, $arg:ident: $ty:ty)*) -> $answer:ty;)*) => {
        #[async_trait::async_trait]
        impl Layered for CrashLayer {
            fn inner(&self) -> &dyn DocumentBackend {
                self.inner.as_ref()
            }
            $(
                async fn $name(&self $(, $arg: $ty)*) -> $answer {
                    self.point.gate(stringify!($name), self.inner.$name($($arg),*)).await
                }
            )*
        }

        /// The trait's methods the layer counts (every one that reaches storage).
        pub const COUNTED: &[&str] = &[$(stringify!($name)),*];
    };
}

counted_layer! {
    fn get(&self, id: &str) -> Result<Option<StoredDocument>>;
    fn put(&self, id: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision>;
    fn delete(&self, id: &str, rev: &Revision) -> Result<Revision>;
    fn put_replicated(&self, id: &str, incoming: &ReplicatedRevision) -> Result<ReplicatedOutcome>;
    fn put_replicated_leaves(&self, leaves: &[ReplicatedLeaf<'_>]) -> Result<Vec<Result<ReplicatedOutcome>>>;
    fn put_branch(&self, id: &str, incoming: &ReplicatedRevision, max_tree_bytes: usize) -> Result<ReplicatedOutcome>;
    fn revision_tree(&self, id: &str) -> Result<Option<RevTree>>;
    fn revision_trees(&self, ids: &[String]) -> Result<Vec<Option<RevTree>>>;
    fn erase_branches(&self, prefix: &str) -> Result<()>;
    fn has_branches(&self, id: &str) -> Result<bool>;
    fn query(&self, query: &Query, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>>;
    fn ensure_standard_indexes(&self) -> Result<()>;
    fn ensure_namespace_indexed(&self, namespace: &str) -> Result<()>;
    fn bulk_write(&self, writes: Vec<BulkWrite>) -> Result<Vec<Result<Revision>>>;
    fn put_text(&self, id: &str, json: &RawValue, precondition: Precondition) -> Result<Revision>;
    fn bulk_write_text(&self, writes: Vec<BulkWriteText>) -> Result<Vec<Result<Revision>>>;
    fn scan(&self, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>>;
    fn health(&self) -> Result<()>;
    fn revisions(&self, id: &str) -> Result<Option<RevisionInfo>>;
    fn get_deleted(&self, id: &str) -> Result<Option<StoredDocument>>;
    fn changes(&self, since: Option<&str>, limit: usize) -> Result<ChangesPage>;
    fn changes_to_end(&self, since: Option<&str>, limit: usize) -> Result<ChangesPage>;
    fn change_position(&self) -> Result<String>;
    fn all_docs(&self, range: &IdRange, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>>;
    fn erase_prefix(&self, prefix: &str) -> Result<u64>;
    fn erase_id(&self, id: &str, options: &EraseOptions) -> Result<bool>;
    fn get_local(&self, name: &str) -> Result<Option<StoredDocument>>;
    fn put_local(&self, name: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision>;
    fn delete_local(&self, name: &str, rev: &Revision) -> Result<()>;
    fn local_docs(&self, range: &IdRange, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>>;
    fn layout(&self) -> Result<LayoutState>;
    fn upgrade_page(&self, page_token: Option<&str>, limit: usize) -> Result<UpgradePage>;
    fn finish_upgrade(&self) -> Result<()>;
    fn approximate_count(&self) -> Result<Option<u64>>;
    fn exact_count(&self) -> Result<Option<u64>>;
    fn feed_length(&self) -> Result<Option<u64>>;
    fn design_document_count(&self) -> Result<Option<u64>>;
    fn get_many(&self, ids: &[String]) -> Result<Vec<Option<StoredDocument>>>;
    fn get_many_local(&self, names: &[String]) -> Result<Vec<Option<StoredDocument>>>;
    fn revisions_many(&self, ids: &[String]) -> Result<Vec<Option<RevisionInfo>>>;
    fn all_docs_text(&self, range: &IdRange, limit: usize, page_token: Option<&str>) -> Result<Page<DocumentText>>;
    fn design_request(&self, request: DesignRequest) -> Result<Option<DesignResponse>>;
    fn put_attachment_chunk(&self, blob: &str, index: u64, bytes: bytes::Bytes) -> Result<()>;
    fn put_small_attachments(&self, attachments: &[agentstore::backend::SmallAttachment]) -> Result<bool>;
    fn get_attachment_chunk(&self, blob: &str, index: u64) -> Result<Option<bytes::Bytes>>;
    fn delete_attachment_blob(&self, blob: &str) -> Result<u64>;
    fn attachment_blobs(&self, limit: usize, page_token: Option<&str>) -> Result<Page<String>>;
}

/// The method names of `DocumentBackend` as its source declares them.
fn trait_methods() -> Vec<String> {
    let source = include_str!("../../src/backend/mod.rs");
    let start = source.find("pub trait DocumentBackend").expect("the trait's declaration");
    let body = &source[start..];
    let end = body.find("\n}\n").expect("the end of the trait");
    body[..end]
        .lines()
        .filter_map(|line| {
            let line = line.trim_start();
            let rest = line.strip_prefix("async fn ").or_else(|| line.strip_prefix("fn "))?;
            let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            (!name.is_empty()).then_some(name)
        })
        .collect()
}

/// Checks, as a contract case on any backend, that the layer counts every trait method that
/// reaches storage and names no method the trait lacks.
pub async fn every_storage_method_is_counted(_ctx: crate::harness::Ctx) {
    let methods = trait_methods();
    assert!(methods.len() >= 45, "read {} methods of DocumentBackend: {methods:?}", methods.len());
    for method in &methods {
        assert!(
            COUNTED.contains(&method.as_str())
                || DESCRIPTIVE.contains(&method.as_str())
                || ANSWERED_BY_THE_LAYER.contains(&method.as_str()),
            "DocumentBackend::{method} is not counted by the crash layer (tests/contract/crash.rs): add it to \
             `counted_layer!` (or to DESCRIPTIVE if it never reaches storage)"
        );
    }
    for listed in COUNTED.iter().chain(DESCRIPTIVE).chain(ANSWERED_BY_THE_LAYER) {
        assert!(methods.iter().any(|method| method == listed), "the crash layer lists {listed}, not in the trait");
    }
}
