//! The storage-shaped interface every backend adapter implements, and the types it speaks.
//!
//! Adapters know nothing of metadata merging or access counting: they store JSON bodies under
//! composite IDs with revision preconditions, and answer paged queries by `userId` (+ `namespace`).
//! The data-store semantics live once, in [`crate::store::DataStore`].

pub mod couchdb;
pub mod dynamodb;
pub mod embedded;
pub mod firestore;
pub mod raw;
pub mod url;

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use futures::{StreamExt, TryStreamExt};
use serde_json::{Map, Value};

use crate::error::Result;

pub use url::BackendUrl;

/// How many `get`s the default [`DocumentBackend::get_many`] keeps in flight.
const GET_MANY_CONCURRENCY: usize = 16;

/// An opaque revision: CouchDB's `_rev`, or whatever version marker the backend keeps.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Revision(pub String);

impl Revision {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Revision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A document as stored: its id, current revision, and body (every field except `_id`/`_rev`).
#[derive(Debug, Clone, PartialEq)]
pub struct StoredDocument {
    pub id: String,
    pub rev: Revision,
    pub body: Map<String, Value>,
}

impl StoredDocument {
    /// The document in the spec's shape: `_id`, `_rev`, then the body's fields.
    pub fn to_json(&self) -> Value {
        let mut out = Map::with_capacity(self.body.len() + 2);
        out.insert(crate::model::fields::ID.into(), self.id.clone().into());
        out.insert(crate::model::fields::REV.into(), self.rev.0.clone().into());
        out.extend(self.body.iter().map(|(k, v)| (k.clone(), v.clone())));
        Value::Object(out)
    }
}

/// The condition a write must meet, checked atomically by the backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Precondition {
    /// Create only: fail with a conflict if the document exists.
    MustNotExist,
    /// Update only: fail with a conflict unless the stored revision is this one.
    MatchRevision(Revision),
    /// Write whatever is there (migration's overwrite policy).
    None,
}

/// Which fields a query returns besides the id and revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Projection {
    All,
    Fields(Vec<&'static str>),
}

/// Documents of one user, optionally of one namespace, selected by their `userId` and
/// `namespace` fields (the `idx-user-namespace` index on CouchDB).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query {
    pub user_id: String,
    pub namespace: Option<String>,
    pub projection: Projection,
}

/// One page of results and the token that fetches the next one (`None` at the end).
#[derive(Debug, Clone, PartialEq)]
pub struct Page<T> {
    pub items: Vec<T>,
    pub next: Option<String>,
}

/// One write of a bulk request.
#[derive(Debug, Clone, PartialEq)]
pub struct BulkWrite {
    pub id: String,
    pub body: Map<String, Value>,
    pub precondition: Precondition,
}

/// What an adapter implements. Errors use [`crate::error::ErrorKind`]: a failed precondition is
/// `Conflict`, a missing document on delete is `NotFound`.
///
/// A decorator (such as the server's metrics wrapper) must forward every method, the ones with
/// default bodies too, or it would silently replace the adapter's own implementation; a test in
/// `src/http/metrics.rs` checks each one.
#[async_trait]
pub trait DocumentBackend: Send + Sync + 'static {
    /// Where this backend stores data, for logs and test reports (never includes secrets).
    fn describe(&self) -> String;

    /// The document with this id, or `None`.
    async fn get(&self, id: &str) -> Result<Option<StoredDocument>>;

    /// Writes `body` under `id` if `precondition` holds; returns the new revision.
    async fn put(&self, id: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision>;

    /// Deletes the document if its revision is still `rev`.
    async fn delete(&self, id: &str, rev: &Revision) -> Result<()>;

    /// One page (at most `limit` documents) of the documents matching `query`. Pass the previous
    /// page's `next` as `page_token` to continue. Order is unspecified.
    async fn query(&self, query: &Query, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>>;

    /// Ensures the indexes the queries need exist (run at startup). Idempotent.
    async fn ensure_standard_indexes(&self) -> Result<()>;

    /// Ensures the index serves `namespace` (before its first write). Idempotent; the facade
    /// caches which namespaces it has already ensured.
    async fn ensure_namespace_indexed(&self, namespace: &str) -> Result<()>;

    /// Writes many documents; one result per write, in order. A failed write does not stop the
    /// others. The outer error is for failures of the whole request.
    async fn bulk_write(&self, writes: Vec<BulkWrite>) -> Result<Vec<Result<Revision>>>;

    /// One page of every document in the store (design documents excluded), in a stable order, so
    /// a scan resumed from a saved token continues where it stopped.
    async fn scan(&self, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>>;

    /// Checks that the backend is reachable and usable.
    async fn health(&self) -> Result<()>;

    /// About how many documents the store holds, when the backend can tell without reading them
    /// (it may count design documents or be some hours stale); `None` when it cannot. For
    /// progress estimates only, never for correctness.
    async fn approximate_count(&self) -> Result<Option<u64>> {
        Ok(None)
    }

    /// How many live documents the store holds at the moment of the call, exactly (design and
    /// foreign documents included; deleted documents and `_local/` ones never), counted without
    /// reading them; `None` when the backend cannot tell exactly (DynamoDB's `ItemCount` is hours
    /// stale). `verify` uses it to learn, without scanning the target, that the target holds no
    /// document beyond those it found.
    async fn exact_count(&self) -> Result<Option<u64>> {
        Ok(None)
    }

    /// How many documents the store holds that are not data and that [`DocumentBackend::scan`]
    /// therefore never returns (CouchDB's design documents), so a migration can report what it
    /// left behind; `None` for a backend that keeps no such documents.
    async fn design_document_count(&self) -> Result<Option<u64>> {
        Ok(None)
    }

    /// The documents with these ids, one answer per id, in order (`None` for a missing one).
    /// The default runs bounded concurrent `get`s; an adapter may override it with a batch read.
    async fn get_many(&self, ids: &[String]) -> Result<Vec<Option<StoredDocument>>> {
        // A plain loop, not an iterator adapter: a closure here trips rustc's higher-ranked
        // `Send` check on the boxed futures.
        let mut lookups = Vec::with_capacity(ids.len());
        for id in ids {
            lookups.push(self.get(id));
        }
        futures::stream::iter(lookups).buffered(GET_MANY_CONCURRENCY).try_collect().await
    }
}

/// The distinct ids of a `get_many` request, in first-seen order: batch reads ask for each once
/// (DynamoDB refuses a request that names a key twice).
pub(crate) fn distinct_ids(ids: &[String]) -> Vec<String> {
    let mut seen = std::collections::HashSet::with_capacity(ids.len());
    ids.iter().filter(|id| seen.insert(id.as_str())).cloned().collect()
}

/// `get_many` over a backend's own batch call: the distinct ids in calls of at most `per_call`,
/// `concurrency` of them at once; `read` answers one call with the documents found, each under
/// the id it was asked for.
pub(crate) async fn batched_get_many<F, Fut>(
    ids: &[String],
    per_call: usize,
    concurrency: usize,
    read: F,
) -> Result<Vec<Option<StoredDocument>>>
where
    F: FnMut(Vec<String>) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<(String, StoredDocument)>>>,
{
    let calls: Vec<Vec<String>> = distinct_ids(ids).chunks(per_call.max(1)).map(<[String]>::to_vec).collect();
    let answers: Vec<Vec<(String, StoredDocument)>> =
        futures::stream::iter(calls).map(read).buffered(concurrency.max(1)).try_collect().await?;
    Ok(in_request_order(ids, answers.into_iter().flatten().collect()))
}

/// `get_many`'s answer: for each of `ids`, in order, the document found under it, if any (a copy
/// for an id asked more than once).
pub(crate) fn in_request_order(
    ids: &[String],
    mut found: std::collections::HashMap<String, StoredDocument>,
) -> Vec<Option<StoredDocument>> {
    let mut remaining: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for id in ids {
        *remaining.entry(id.as_str()).or_default() += 1;
    }
    ids.iter()
        .map(|id| {
            let left = remaining.get_mut(id.as_str()).map(|n| {
                *n -= 1;
                *n
            });
            // The last time an id is asked for, its document moves out instead of being copied.
            if left == Some(0) {
                found.remove(id)
            } else {
                found.get(id).cloned()
            }
        })
        .collect()
}

/// 64 random bits as 16 hex digits, different on every call in a process (revision and chunk-set
/// tokens). Not for secrets.
pub(crate) fn random_token() -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    hasher.write_u128(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0),
    );
    format!("{:016x}", hasher.finish())
}

/// Opens the backend a URL names.
pub async fn open(url: &BackendUrl) -> Result<Arc<dyn DocumentBackend>> {
    match url {
        BackendUrl::Embedded { path } => {
            let backend = embedded::EmbeddedBackend::open(path).await?;
            Ok(Arc::new(backend))
        }
        BackendUrl::CouchDb(config) => Ok(Arc::new(couchdb::CouchDbBackend::open(config).await?)),
        BackendUrl::DynamoDb(config) => Ok(Arc::new(dynamodb::DynamoDbBackend::open(config).await?)),
        BackendUrl::Firestore(config) => Ok(Arc::new(firestore::FirestoreBackend::open(config).await?)),
    }
}
