//! The storage-shaped interface every backend adapter implements, and the types it speaks.
//!
//! Adapters know nothing of metadata merging or access counting: they store JSON bodies under
//! composite IDs with revision preconditions, and answer paged queries by `userId` (+ `namespace`).
//! The data-store semantics live once, in [`crate::store::DataStore`].

pub mod catalog;
pub mod couchdb;
pub mod dynamodb;
pub mod embedded;
pub mod firestore;
pub mod raw;
pub mod replicated;
pub mod rev_tree;
pub mod revision;
pub mod url;

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use futures::{StreamExt, TryStreamExt};
use serde_json::{Map, Value};

use crate::error::Result;

pub use revision::{Ancestry, DEFAULT_REVS_LIMIT};
pub use url::BackendUrl;

/// The prefix of local documents' ids (replication checkpoints): never listed, scanned, fed or
/// migrated.
pub const LOCAL_PREFIX: &str = "_local/";

/// How many `get`s the default [`DocumentBackend::get_many`] keeps in flight (and `get_local`s
/// the default [`DocumentBackend::get_many_local`]).
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
    /// Create only, where the id holds neither a document nor a tombstone (never written, or
    /// erased): fail with a conflict otherwise. [`Precondition::MustNotExist`] re-creates over a
    /// tombstone; this one does not, so a writer that read nothing under an id can create it
    /// without first serializing on what a deletion left. Only an adapter whose
    /// [`DocumentBackend::checks_never_written`] says so checks it; any other answers every such
    /// write with a conflict and writes nothing. On a local document (which leaves no tombstone)
    /// it is `MustNotExist`.
    NeverWritten,
}

/// The condition of an erasure ([`DocumentBackend::erase_id`]), checked by the backend in the
/// erasure itself, as a [`Precondition`] is in a write: a caller that read the document and
/// decided to erase what it read erases nothing another writer stored since (another process
/// behind the same load balancer). `Default` erases whatever is stored.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EraseOptions {
    /// Erase only while the id's stored revision, the live document's or its tombstone's (what
    /// [`DocumentBackend::revisions`] answers), is this one; otherwise, nothing stored under the
    /// id included, answer `Conflict` (as `put` does for [`Precondition::MatchRevision`]) and
    /// erase nothing.
    pub if_revision: Option<Revision>,
    /// On a backend that keeps a document's whole revision tree itself
    /// ([`DocumentBackend::keeps_branches`]: CouchDB), the leaves the caller read: only these
    /// are purged, each only while it is still a leaf (CouchDB's `_purge` names the revisions it
    /// removes), so a leaf written since is kept; `Conflict` when none of them was purged.
    /// Ignored by a backend whose record holds one revision (`if_revision` says it all there).
    pub only_leaves: Option<Vec<Revision>>,
}

impl EraseOptions {
    /// Erase only while the stored revision is `rev`.
    pub fn if_revision(rev: Revision) -> Self {
        EraseOptions { if_revision: Some(rev), only_leaves: None }
    }

    /// Whether the erasure is conditional at all.
    pub fn is_conditional(&self) -> bool {
        self.if_revision.is_some() || self.only_leaves.is_some()
    }
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

/// One write of [`DocumentBackend::bulk_write_text`]: a [`BulkWrite`] whose body is given as the
/// compact JSON text of an object instead of as values.
#[derive(Debug, Clone)]
pub struct BulkWriteText {
    pub id: String,
    pub json: Box<serde_json::value::RawValue>,
    pub precondition: Precondition,
}

impl BulkWriteText {
    /// The same write with its body parsed into values.
    pub fn into_values(self) -> Result<BulkWrite> {
        let body = body_of_text(&self.id, &self.json)?;
        Ok(BulkWrite { id: self.id, body, precondition: self.precondition })
    }
}

/// The object a body given as JSON text holds (the text comes from this process's own encoding,
/// so a failure to parse it is internal).
pub fn body_of_text(id: &str, json: &serde_json::value::RawValue) -> Result<Map<String, Value>> {
    crate::model::depth::parse_stored(json.get().as_bytes()).map_err(|e| {
        crate::error::Error::new(
            crate::error::ErrorKind::Internal,
            format!("the body written for {id:?} is not a JSON object: {e}"),
        )
    })
}

/// One entry of the change feed: a document's latest revision at the moment it was read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// Where this change sits in the feed: pass it as `since` to continue after it. Opaque.
    pub seq: String,
    pub id: String,
    pub rev: Revision,
    pub deleted: bool,
}

/// One page of the change feed.
///
/// On a feed with a settle window (DynamoDB) a page holds first the *settled* changes, whose
/// order no later commit can change, then, once those reach the settled end, the *unsettled
/// tail*: the changes the read sees past it. Neither `last_seq` nor any change's `seq` leads past
/// a position where a change may still land, so reading from them later never misses a change
/// but may deliver an unsettled one again, once, when it settles (docs/document-model.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChangesPage {
    /// Each changed document once, at its latest revision, in feed order.
    pub changes: Vec<Change>,
    /// The token to continue from: every change up to it has been returned (CouchDB's `last_seq`).
    pub last_seq: String,
    /// How many more changes are waiting after this page: `Some(0)` when the page reaches the end
    /// of the feed as this read saw it (the unsettled tail included), `Some(n)` when the backend
    /// counts them, `None` when it cannot tell and more may follow (read again from `last_seq`).
    /// A page shorter than asked is not the end by itself: a backend may drop entries it has
    /// already reported.
    pub pending: Option<u64>,
    /// How many of `changes`, at its end, are the unsettled tail (0 where the feed is exact: the
    /// embedded store, CouchDB, Firestore).
    pub unsettled: usize,
}

/// A range of document ids for [`DocumentBackend::all_docs`], in CouchDB's `_all_docs` terms:
/// iteration starts at `start` and stops at `end`; with `descending`, `start` is the high end.
/// Ids compare as their UTF-8 bytes (CouchDB's raw collation).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IdRange {
    pub start: Option<String>,
    pub end: Option<String>,
    /// Whether a document whose id equals `end` is included (CouchDB's default: yes).
    pub inclusive_end: bool,
    pub descending: bool,
    /// Whether design documents (`_design/…`) are listed: never in the data-store database,
    /// where they hold no data; always in other databases ([`crate::database`]), as CouchDB
    /// lists them.
    pub include_design: bool,
}

impl IdRange {
    /// Every id, ascending.
    pub fn all() -> Self {
        IdRange { start: None, end: None, inclusive_end: true, descending: false, include_design: false }
    }

    /// Every design document (`_design/…`), ascending.
    pub fn design_documents() -> Self {
        IdRange {
            start: Some("_design/".into()),
            end: Some("_design0".into()),
            inclusive_end: false,
            descending: false,
            include_design: true,
        }
    }

    /// The same range over ids stored under `prefix` (`prefix` put before both ends), cut to the
    /// ids that start with it: an open end becomes the prefix's own end. A descending range open
    /// at the top starts at the id just past the prefix's ids (inclusive: a caller drops an id that
    /// does not start with `prefix`).
    pub fn under_prefix(&self, prefix: &str) -> IdRange {
        if prefix.is_empty() {
            return self.clone();
        }
        let prefixed = |id: &String| format!("{prefix}{id}");
        // The first text after every text that starts with `prefix`: its last character's
        // successor (UTF-8 byte order is code point order).
        let past = prefix
            .char_indices()
            .last()
            .and_then(|(at, last)| char::from_u32(u32::from(last) + 1).map(|next| format!("{}{next}", &prefix[..at])));
        let mut range = self.clone();
        if self.descending {
            range.start = self.start.as_ref().map(prefixed).or(past);
            range.end = Some(self.end.as_ref().map_or_else(|| prefix.to_owned(), prefixed));
            range.inclusive_end = self.end.is_none() || self.inclusive_end;
        } else {
            range.start = Some(self.start.as_ref().map_or_else(|| prefix.to_owned(), prefixed));
            range.end = self.end.as_ref().map(prefixed).or(past);
            range.inclusive_end = self.end.is_some() && self.inclusive_end;
        }
        range
    }

    /// Whether no id can lie inside: the ends are reversed for the range's direction, or equal with
    /// the end excluded. (CouchDB answers reversed ends with a 400; a listing answers nothing.)
    pub fn holds_nothing(&self) -> bool {
        let (Some(start), Some(end)) = (&self.start, &self.end) else { return false };
        let (start, end) = (start.as_bytes(), end.as_bytes());
        let reversed = if self.descending { start < end } else { start > end };
        reversed || (start == end && !self.inclusive_end)
    }

    /// Whether `id` lies inside the range (both ends checked, in the range's direction).
    pub fn contains(&self, id: &str) -> bool {
        let id = id.as_bytes();
        let after_start = match &self.start {
            None => true,
            Some(start) if self.descending => id <= start.as_bytes(),
            Some(start) => id >= start.as_bytes(),
        };
        let before_end = match &self.end {
            None => true,
            Some(end) if self.descending => id > end.as_bytes() || (self.inclusive_end && id == end.as_bytes()),
            Some(end) => id < end.as_bytes() || (self.inclusive_end && id == end.as_bytes()),
        };
        after_start && before_end
    }
}

/// What a backend knows of a document's revisions, tombstones included.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RevisionInfo {
    /// The current revision (the tombstone's, when deleted).
    pub rev: Revision,
    pub deleted: bool,
    /// The remembered revision ids, newest first, starting with `rev`; at most the backend's
    /// `revs_limit`. Documents written before ancestry was kept remember only `rev`.
    pub ancestry: Ancestry,
}

/// A revision made elsewhere, as a replicator sends it (`_bulk_docs` with `new_edits: false`).
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicatedRevision {
    /// `N-<32 lowercase hex>`.
    pub rev: Revision,
    /// `_revisions` expanded to full revision ids, newest first, starting with `rev`.
    pub ancestry: Vec<String>,
    pub deleted: bool,
    /// Every field except `_id`/`_rev`/`_revisions`/`_deleted`. A deleted revision's fields are
    /// kept in its tombstone, as CouchDB keeps them ([`DocumentBackend::get_deleted`]).
    pub body: Map<String, Value>,
    /// What the stored revision (live or a tombstone) must be for the write to apply, besides
    /// the winner rule: `MustNotExist` (nothing stored), `MatchRevision` (that revision), or
    /// `None`. A caller that keeps a document's other branches itself (the engine's data-store layout,
    /// `crate::database::layout::data_store`) decided the
    /// write against the state it read; any other state is answered `KeptCurrent`, nothing
    /// written.
    pub precondition: Precondition,
}

/// A replicated revision whose body stays where its caller keeps it, for
/// [`DocumentBackend::put_replicated_leaves`]: the data-store layout writes a document's winner
/// from the revision tree it applied the edit to, and a copy of each body into a
/// [`ReplicatedRevision`] was 5% of a data-store `_bulk_docs` (issue 38).
#[derive(Debug, Clone, Copy)]
pub struct ReplicatedLeaf<'a> {
    pub id: &'a str,
    /// The revision, its ancestry, deletion and precondition; its own `body` is not read.
    pub head: &'a ReplicatedRevision,
    /// The revision's body, in place of `head.body`.
    pub body: &'a Map<String, Value>,
}

impl ReplicatedLeaf<'_> {
    /// The revision with its body copied in: what a backend without a borrowing write takes.
    pub fn to_revision(&self) -> ReplicatedRevision {
        ReplicatedRevision {
            rev: self.head.rev.clone(),
            ancestry: self.head.ancestry.clone(),
            deleted: self.head.deleted,
            body: self.body.clone(),
            precondition: self.head.precondition.clone(),
        }
    }
}

/// Writes of [`DocumentBackend::put_replicated_leaves`]'s default body in flight at once (the
/// data-store layout's saves of a `_bulk_docs` ran this many at once before the call existed).
const REPLICATED_LEAVES_AT_ONCE: usize = 128;

/// What [`DocumentBackend::put_replicated`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicatedOutcome {
    /// The incoming revision is now the document's current one.
    Applied,
    /// The incoming revision is the current one or one of its ancestors: nothing was written.
    AlreadyKnown,
    /// The incoming revision is on another branch and loses to the current one: nothing was
    /// written.
    KeptCurrent,
}

/// Whether a store has the layout this release's document model needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayoutState {
    Current,
    /// Written by an earlier release: `agentstore upgrade` brings it up to date. The text says what
    /// is missing.
    NeedsUpgrade(String),
}

/// What one step of [`DocumentBackend::upgrade_page`] did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UpgradePage {
    /// Documents looked at in this step.
    pub examined: u64,
    /// Of those, documents rewritten into the new layout (the rest already had it).
    pub upgraded: u64,
    /// The token for the next step; `None` when every document has been examined.
    pub next: Option<String>,
}

/// The error a feature of the document model gives on a store that has not been upgraded.
pub fn needs_upgrade(store: &str, feature: &str, why: &str) -> crate::error::Error {
    crate::error::Error::new(
        crate::error::ErrorKind::Misconfigured,
        format!(
            "{feature} needs this release's storage layout, and the store {store} was written by an earlier \
             release ({why}); run `agentstore upgrade --backend URL` with this store's backend URL once \
             (resumable, and safe while the service runs)"
        ),
    )
}

/// A request on a design document (`_design/{name}` and what lies below it: views, shows, lists,
/// update functions), for a backend that runs design documents itself
/// ([`DocumentBackend::design_request`]); on a backend that forwards every request
/// ([`DocumentBackend::forwards_requests`]), a request on any path below the database.
#[derive(Debug)]
pub struct DesignRequest {
    pub method: reqwest::Method,
    /// The path below the database, percent-encoded, without a leading `/`: starting `_design/`,
    /// or, to a backend that forwards every request, any path (`""` for the database itself,
    /// `_all_docs`, `{docid}`, `_changes`, `_bulk_docs`, `_local/{name}`, …); no segment is `.`
    /// or `..` (the caller checks).
    pub path: String,
    /// The query string without `?`, as the client sent it.
    pub query: Option<String>,
    /// The headers a design request depends on (`Content-Type`, `Accept`, `If-Match`,
    /// `If-None-Match`, `Range`, …), lowercase names. `Authorization` and `Cookie` are never
    /// passed on, whoever puts them here: the backend sends its own credentials. `Content-Length`
    /// and `Content-Encoding` go only with a [`DesignBody::Streamed`] body, which is sent as the
    /// client sent it (a whole body was read, and decompressed).
    pub headers: Vec<(String, String)>,
    pub body: DesignBody,
}

/// The body of a [`DesignRequest`].
pub enum DesignBody {
    /// Read whole (and decompressed): sent as it is, and again when a read is retried.
    Whole(bytes::Bytes),
    /// Passed on as it arrives, never held whole, and sent once: an attachment upload or a
    /// `multipart/related` document write. An error item (the client went away, a bound was
    /// passed) aborts the request to the backend, so a truncated body is never taken as whole.
    Streamed(futures::stream::BoxStream<'static, std::result::Result<bytes::Bytes, BodyError>>),
}

/// Why a streamed [`DesignBody`] ended early.
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

impl DesignBody {
    /// No body.
    pub fn empty() -> Self {
        DesignBody::Whole(bytes::Bytes::new())
    }
}

impl std::fmt::Debug for DesignBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DesignBody::Whole(bytes) => write!(f, "Whole({} bytes)", bytes.len()),
            DesignBody::Streamed(_) => f.write_str("Streamed"),
        }
    }
}

/// The backend's answer to a [`DesignRequest`], its body streamed so a large view result or
/// attachment is never held in memory at once.
pub struct DesignResponse {
    pub status: u16,
    /// The headers a client of the answer reads (`Content-Type`, `ETag`, `Content-Length`,
    /// `Content-Range`, …), lowercase names.
    pub headers: Vec<(String, String)>,
    pub body: futures::stream::BoxStream<'static, Result<bytes::Bytes>>,
}

impl DesignRequest {
    /// A `GET` of `path` below the database (percent-encoded, as [`DesignRequest::path`])
    /// asking for JSON, with no body: what the server reads of a forwarding backend itself.
    pub fn get_json(path: String, query: Option<String>) -> Self {
        DesignRequest {
            method: reqwest::Method::GET,
            path,
            query,
            headers: vec![("accept".to_owned(), "application/json".to_owned())],
            body: DesignBody::empty(),
        }
    }
}

impl DesignResponse {
    /// The whole body, read until it passes `max_bytes`, which is `TooLarge` naming `what`: for
    /// the small answers the server reads itself (a `_security` object, a user document), never
    /// for what is passed on to a client.
    pub async fn body_within(self, max_bytes: usize, what: &str) -> crate::error::Result<Vec<u8>> {
        let mut bytes = Vec::new();
        let mut chunks = self.body;
        while let Some(chunk) = futures::StreamExt::next(&mut chunks).await {
            bytes.extend_from_slice(&chunk?);
            if bytes.len() > max_bytes {
                return Err(crate::error::Error::new(
                    crate::error::ErrorKind::TooLarge,
                    format!("{what} is over {max_bytes} bytes"),
                ));
            }
        }
        Ok(bytes)
    }
}

/// The error of a branch method asked of a backend that keeps no branches itself
/// ([`DocumentBackend::keeps_branches`]): a caller that skipped the engine's data-store layout.
fn keeps_no_branches<B: DocumentBackend + ?Sized>(backend: &B, method: &str, id: &str) -> crate::error::Error {
    crate::error::Error::new(
        crate::error::ErrorKind::Internal,
        format!(
            "{method} of {id:?} asked of {}, which keeps no branches itself: data-store trees go through \
             the engine's data-store layout",
            backend.describe()
        ),
    )
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

    /// Deletes the document if its revision is still `rev`; returns the tombstone's revision.
    async fn delete(&self, id: &str, rev: &Revision) -> Result<Revision>;

    /// Stores a revision made elsewhere, keeping its revision id and ancestry (CouchDB's
    /// `new_edits: false`, what a replicator writes), atomically against the stored state. The
    /// rules ([`replicated::judge`]): a revision already known changes nothing; one that descends
    /// from the current revision replaces it; on divergent branches CouchDB's winner is kept and
    /// the other branch dropped. Only `Applied` moves the document in the change feed.
    async fn put_replicated(&self, id: &str, incoming: &ReplicatedRevision) -> Result<ReplicatedOutcome>;

    /// Many [`DocumentBackend::put_replicated`] writes of distinct documents, each judged and
    /// answered on its own, in as few backend calls as the backend can make them: the embedded store
    /// writes them all in one job of its group commit (one fsync'd commit for a data-store
    /// `_bulk_docs`, where a job per document met the commit in two or more groups). The outer
    /// error fails the whole call (nothing of it to be taken as written). The default writes
    /// each through `put_replicated`, [`REPLICATED_LEAVES_AT_ONCE`] at once, each body copied.
    async fn put_replicated_leaves(&self, leaves: &[ReplicatedLeaf<'_>]) -> Result<Vec<Result<ReplicatedOutcome>>> {
        let revisions: Vec<ReplicatedRevision> = leaves.iter().map(ReplicatedLeaf::to_revision).collect();
        // A plain loop of futures: closures in iterator adapters trip rustc's higher-ranked
        // `Send` check here.
        let mut writes = Vec::with_capacity(leaves.len());
        for (leaf, revision) in leaves.iter().zip(&revisions) {
            writes.push(self.put_replicated(leaf.id, revision));
        }
        Ok(futures::stream::iter(writes).buffered(REPLICATED_LEAVES_AT_ONCE).collect().await)
    }

    /// One page (at most `limit` documents) of the documents matching `query`. Pass the previous
    /// page's `next` as `page_token` to continue. Order is unspecified.
    async fn query(&self, query: &Query, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>>;

    /// Ensures the indexes the queries need exist (run at startup). Idempotent.
    async fn ensure_standard_indexes(&self) -> Result<()>;

    /// Ensures the index serves `namespace` (before its first write). Idempotent; the facade
    /// caches which namespaces it has already ensured.
    async fn ensure_namespace_indexed(&self, namespace: &str) -> Result<()>;

    /// Writes many documents; one result per write, in order. A failed write does not stop the
    /// others. Writes to the same id take effect in the order given, as CouchDB's `_bulk_docs`
    /// applies them (adapters that write concurrently use [`bulk_write_in_id_rounds`]). The outer
    /// error is for failures of the whole request.
    async fn bulk_write(&self, writes: Vec<BulkWrite>) -> Result<Vec<Result<Revision>>>;

    /// [`DocumentBackend::put`] of a body given as the compact JSON text of an object, as a
    /// caller that encodes its own types straight to text has it (the database engine's records,
    /// `layout::record`). A backend that stores JSON text stores it as it is (the embedded store
    /// overrides this), sparing the values that would be built only to be written out again (an
    /// eighth of a `_bulk_docs` of 100 on the embedded store, issue 38). The default parses the
    /// text and puts the values.
    async fn put_text(
        &self,
        id: &str,
        json: &serde_json::value::RawValue,
        precondition: Precondition,
    ) -> Result<Revision> {
        let body = body_of_text(id, json)?;
        self.put(id, &body, precondition).await
    }

    /// [`DocumentBackend::bulk_write`] of bodies given as JSON text, as
    /// [`DocumentBackend::put_text`] takes them. The default parses them and calls `bulk_write`.
    async fn bulk_write_text(&self, writes: Vec<BulkWriteText>) -> Result<Vec<Result<Revision>>> {
        let writes = writes.into_iter().map(BulkWriteText::into_values).collect::<Result<Vec<_>>>()?;
        self.bulk_write(writes).await
    }

    /// One page of every document in the store (design documents excluded), in a stable order, so
    /// a scan resumed from a saved token continues where it stopped.
    async fn scan(&self, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>>;

    /// Checks that the backend is reachable and usable.
    async fn health(&self) -> Result<()>;

    /// A document's current revision, whether it is deleted, and its revision ancestry; `None`
    /// when the id was never written or was erased.
    async fn revisions(&self, id: &str) -> Result<Option<RevisionInfo>>;

    /// A deleted document's tombstone: its revision and the fields its deletion carried (a
    /// replicated deleted revision's body; empty for a plain delete), as CouchDB keeps them and
    /// answers them to `?rev=`, `open_revs`, `_bulk_get` and `_changes?include_docs`. `None`
    /// when the document is live, was never written or was erased.
    async fn get_deleted(&self, id: &str) -> Result<Option<StoredDocument>>;

    /// One page of the change feed after `since` (`None`: from the start, every live document and
    /// tombstone). Each document appears once in a page, at its latest revision; cost is
    /// proportional to the page. Local documents never appear. A read that reaches the end of the
    /// feed (`pending: Some(0)`) holds every write acknowledged before it began, the unsettled
    /// tail included ([`ChangesPage`]).
    async fn changes(&self, since: Option<&str>, limit: usize) -> Result<ChangesPage>;

    /// [`Self::changes`] for a reader that asks only whether the page reaches the end of the
    /// feed, not how many changes wait after it (an index catching up): `pending` is `Some(0)`
    /// or `None`. A backend whose exact count costs reads answers it without them (the
    /// embedded store counted up to 10,000 feed entries after every page of a view build).
    async fn changes_to_end(&self, since: Option<&str>, limit: usize) -> Result<ChangesPage> {
        let mut page = self.changes(since, limit).await?;
        if page.pending != Some(0) {
            page.pending = None;
        }
        Ok(page)
    }

    /// The feed position now (CouchDB's `since=now`): `changes(Some(position))` returns the
    /// changes committed after this call; on a feed with a settle window also, once more when
    /// they settle, changes committed up to that window before it.
    async fn change_position(&self) -> Result<String>;

    /// How far behind a read the settled end of the feed lies: the settle window of a feed
    /// without one sequence authority (DynamoDB, Firestore), zero where the feed is exact (the
    /// embedded store, CouchDB). A follower that reads the end of the feed at time T and applies
    /// only settled changes has applied every write committed before T minus this; the read
    /// itself shows later writes too (the unsettled tail).
    fn change_feed_delay(&self) -> std::time::Duration;

    /// How two positions of this backend's feed (tokens it handed out: `last_seq`s, change
    /// `seq`s, [`Self::change_position`]s) compare in feed order: `Less` when `a` lies before `b`.
    /// `None` when it cannot tell (a token it does not read as a point of its feed, or a backend
    /// whose positions say nothing of order). Reads nothing: decided from the tokens alone.
    fn position_order(&self, _a: &str, _b: &str) -> Option<std::cmp::Ordering> {
        None
    }

    /// One page of live documents in `range`, in id order (raw UTF-8 collation; tombstones, local
    /// and design documents never included); pass `next` back to continue.
    async fn all_docs(&self, range: &IdRange, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>>;

    /// Removes every document whose id starts with `prefix`, live ones and tombstones, with their
    /// ancestry and feed entries, leaving no trace of their ids (CouchDB's `_purge`); returns how
    /// many ids were removed. Replicas elsewhere keep their copies until purged themselves. Only
    /// for a real prefix (a user's `{user}:`); one document is erased by [`Self::erase_id`].
    async fn erase_prefix(&self, prefix: &str) -> Result<u64>;

    /// Removes the one document `id`, live or a tombstone, with its ancestry and feed entry,
    /// leaving no trace of it and touching no other id, not even one that starts with `id`
    /// (CouchDB's `_purge` of a document's last leaves); whether there was anything to remove.
    /// The feed's end does not move back: a position handed out before stays at or before it.
    /// Only while `options` hold, checked atomically with the erasure ([`EraseOptions`]: a
    /// failed condition is `Conflict`, nothing erased).
    async fn erase_id(&self, id: &str, options: &EraseOptions) -> Result<bool>;

    /// The local document `_local/{name}`, revision `0-N`.
    async fn get_local(&self, name: &str) -> Result<Option<StoredDocument>>;

    /// Writes the local document `_local/{name}` if `precondition` holds; returns `0-N`.
    async fn put_local(&self, name: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision>;

    /// Deletes the local document `_local/{name}` if its revision is still `rev` (no tombstone).
    async fn delete_local(&self, name: &str, rev: &Revision) -> Result<()>;

    /// One page (at most `limit`) of the local documents whose *names* lie in `range` (the bounds
    /// are names, without `_local/`, compared as UTF-8 bytes like ids in `all_docs`;
    /// `include_design` means nothing here), in name order (reversed with `descending`), each
    /// with its id `_local/{name}`, revision `0-N` and body; pass `next` back to continue. A
    /// deleted local document is gone, so never listed. Callers that keep locals of their own
    /// beside their clients' (the engine's `tree:`/`db:` names) give a range that holds only the
    /// clients' names, and drop anything else the page holds.
    async fn local_docs(&self, range: &IdRange, limit: usize, page_token: Option<&str>)
        -> Result<Page<StoredDocument>>;

    /// Whether the store has this release's layout.
    async fn layout(&self) -> Result<LayoutState>;

    /// One resumable, idempotent step of bringing the store to this release's layout in place:
    /// pass the previous step's `next` (`None` to start; the first step also creates any index
    /// the layout needs). Safe to rerun from any earlier token, and while the service writes.
    async fn upgrade_page(&self, page_token: Option<&str>, limit: usize) -> Result<UpgradePage>;

    /// Records that every document has been upgraded, so [`DocumentBackend::layout`] answers
    /// `Current`. Called by `agentstore upgrade` after the last step.
    async fn finish_upgrade(&self) -> Result<()>;

    /// About how many documents the store holds, when the backend can tell without reading them
    /// (it may count design documents or be some hours stale); `None` when it cannot. For
    /// progress estimates only, never for correctness.
    async fn approximate_count(&self) -> Result<Option<u64>> {
        Ok(None)
    }

    /// How many live documents the store holds at the moment of the call, exactly (design and
    /// foreign documents included; deleted documents and `_local/` ones never), counted without
    /// reading them; `None` when the backend cannot tell exactly (DynamoDB's data-store table,
    /// whose `ItemCount` is hours stale; its database tables count over their id index, see
    /// docs/databases.md, "Document counts"). `verify` uses it to learn, without scanning the target, that the target holds no
    /// document beyond those it found.
    async fn exact_count(&self) -> Result<Option<u64>> {
        Ok(None)
    }

    /// How many entries the change feed holds now (one per document, live or deleted: each at its
    /// latest change; local documents never), counted without reading the documents, for the
    /// `N` of the positions a database shows (`crate::database::seq`: a position's rank in the
    /// feed). Exact for this process's own writes, and for other processes' within a bounded
    /// age (the backend's `count_max_age_ms`). `None` when the backend cannot count them, or
    /// when its positions carry such a number already (the embedded store's counter, CouchDB's
    /// own `N`), the default.
    async fn feed_length(&self) -> Result<Option<u64>> {
        Ok(None)
    }

    /// How many documents the store holds that are not data and that [`DocumentBackend::scan`]
    /// therefore never returns (CouchDB's design documents), so a migration can report what it
    /// left behind; `None` for a backend that keeps no such documents.
    async fn design_document_count(&self) -> Result<Option<u64>> {
        Ok(None)
    }

    /// Runs a request on a design document where the backend runs design documents itself (the
    /// CouchDB backend passes it to its database); `None` when it cannot, the default: the
    /// embedded store, DynamoDB and Firestore keep no design documents.
    async fn design_request(&self, request: DesignRequest) -> Result<Option<DesignResponse>> {
        let _ = request;
        Ok(None)
    }

    /// The URL this backend was opened from, credentials included (never logged: `describe` is
    /// what logs show), from which the catalog of the databases it keeps beside this one opens
    /// ([`catalog::open_catalog`]); `None`, the default, for a backend that keeps no others.
    fn url(&self) -> Option<BackendUrl> {
        None
    }

    /// Whether [`DocumentBackend::design_request`] takes a request on any path below the
    /// database, not only `_design/`: the CouchDB backend's databases of the catalog
    /// ([`catalog`]) stay native CouchDB, so the CouchDB API forwards every request on them
    /// instead of keeping revision trees itself. `false`, the default, elsewhere.
    fn forwards_requests(&self) -> bool {
        false
    }

    /// Whether this backend keeps every branch of a data-store document's revision tree itself
    /// (the CouchDB backend: CouchDB's own trees), answering [`DocumentBackend::revision_tree`],
    /// [`DocumentBackend::has_branches`], [`DocumentBackend::put_branch`] and
    /// [`DocumentBackend::erase_branches`] natively. `false`, the default: the tree is laid out
    /// over the backend's records by the engine's data-store layout
    /// (`crate::database::layout::data_store`, which every caller goes through; it calls the
    /// four methods below only on a backend answering `true`).
    fn keeps_branches(&self) -> bool {
        false
    }

    /// The whole revision tree of a data-store document, on a backend that keeps branches
    /// itself ([`DocumentBackend::keeps_branches`]): its winner (the record every other call
    /// reads) and every other leaf, each with its path and body. `None` when nothing is stored
    /// for the id. The default answers that the backend keeps no branches.
    async fn revision_tree(&self, id: &str) -> Result<Option<rev_tree::RevTree>> {
        Err(keeps_no_branches(self, "revision_tree", id))
    }

    /// [`DocumentBackend::revision_tree`] of each of `ids`, one per id in order, in as few
    /// requests as the backend allows: a page of a listing or of the change feed reads its trees
    /// at once. The default answers that the backend keeps no branches.
    async fn revision_trees(&self, ids: &[String]) -> Result<Vec<Option<rev_tree::RevTree>>> {
        Err(keeps_no_branches(self, "revision_trees", ids.first().map_or("", String::as_str)))
    }

    /// Whether the document may have leaves besides its winner (conflicts or deleted leaves), on
    /// a backend that keeps branches itself: `false` means [`DocumentBackend::revision_tree`]
    /// would answer the winner alone. The default answers that the backend keeps no branches.
    async fn has_branches(&self, id: &str) -> Result<bool> {
        Err(keeps_no_branches(self, "has_branches", id))
    }

    /// [`DocumentBackend::put_replicated`] keeping every branch, as CouchDB does, on a backend
    /// that keeps branches itself: an incoming revision that loses to the winner is kept as a
    /// leaf of the tree (`KeptCurrent`), one that wins moves the previous winner among the other
    /// leaves (`Applied`). `max_tree_bytes` is the bound of `couchdb_max_tree_bytes`, for a
    /// backend that holds trees to it. The default answers that the backend keeps no branches.
    async fn put_branch(
        &self,
        id: &str,
        incoming: &ReplicatedRevision,
        max_tree_bytes: usize,
    ) -> Result<ReplicatedOutcome> {
        let _ = (incoming, max_tree_bytes);
        Err(keeps_no_branches(self, "put_branch", id))
    }

    /// Removes the other branches kept for every id starting with `prefix` (an erasure, after
    /// [`DocumentBackend::erase_prefix`]), on a backend that keeps branches itself. The default
    /// answers that the backend keeps no branches.
    async fn erase_branches(&self, prefix: &str) -> Result<()> {
        Err(keeps_no_branches(self, "erase_branches", prefix))
    }

    /// The most bytes one attachment chunk record of this backend holds (what
    /// [`crate::database::attachments::AttachmentStore`] cuts attachments into): DynamoDB's item
    /// and Firestore's document bounds less room for the record's key and names, 1 MiB on the
    /// embedded store. `0`, the default, on a backend that keeps no attachment bytes itself
    /// (the CouchDB backend, whose databases keep CouchDB's own attachments).
    fn attachment_chunk_bytes(&self) -> usize {
        0
    }

    /// Stores chunk `index` of the attachment blob `blob` (a name of
    /// [`check_attachment_blob`]'s form), raw bytes, at most [`DocumentBackend::attachment_chunk_bytes`]
    /// of them, replacing a chunk stored there before. Chunk records are invisible to every
    /// other call (listings, feed, counts, scans, queries, local documents, reads by id) and
    /// removed with the database. A backend may answer before the chunk is durable, provided it
    /// is durable once any write the backend acknowledges after it is (the attachment store
    /// writes a manifest naming the chunks after them, and no reader finds a chunk without
    /// one): the embedded store commits chunks without an fsync of their own, which the
    /// manifest's commit covers (issue 38). The default refuses: the backend keeps no
    /// attachment bytes.
    async fn put_attachment_chunk(&self, blob: &str, index: u64, bytes: bytes::Bytes) -> Result<()> {
        let _ = (blob, index, bytes);
        Err(attachments_unsupported(&self.describe()))
    }

    /// Stores each of `attachments` (bytes that fit in one chunk, each under a fresh blob name)
    /// with its manifest, the local document `manifest` created only if none exists, such that
    /// no reader ever finds a manifest without its chunk: a backend that overrides this writes
    /// them all in one atomic write (Firestore: one `:commit`, issue 38), instead of a chunk and
    /// then a manifest per attachment. `Ok(false)`, the default: this backend has no such write
    /// and wrote nothing (the attachment store then writes each the usual way). A `Conflict`
    /// means a manifest existed, and nothing was written. Any other error may leave chunks and
    /// manifests written together (an answer lost), never one without the other
    /// (docs/design/crash-points.md, "Small attachments at once").
    async fn put_small_attachments(&self, attachments: &[SmallAttachment]) -> Result<bool> {
        let _ = attachments;
        Ok(false)
    }

    /// Chunk `index` of the blob `blob` as stored, or `None`. The default refuses.
    async fn get_attachment_chunk(&self, blob: &str, index: u64) -> Result<Option<bytes::Bytes>> {
        let _ = (blob, index);
        Err(attachments_unsupported(&self.describe()))
    }

    /// Deletes every chunk of the blob `blob` (none is an answer of 0, not an error); returns
    /// how many were deleted. The default refuses.
    async fn delete_attachment_blob(&self, blob: &str) -> Result<u64> {
        let _ = blob;
        Err(attachments_unsupported(&self.describe()))
    }

    /// One page (at most `limit`) of the names of every blob with at least one chunk stored,
    /// each once, in an order the backend chooses; pass `next` back to continue (garbage
    /// collection reads them all). The default refuses.
    async fn attachment_blobs(&self, limit: usize, page_token: Option<&str>) -> Result<Page<String>> {
        let _ = (limit, page_token);
        Err(attachments_unsupported(&self.describe()))
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

    /// [`DocumentBackend::get_many`] with each body as the JSON text the backend stores, for a
    /// reader that parses it straight into its own types (the engine's revision trees: a
    /// `serde_json::Value` tree built and dropped in between was a third of a `_changes` page,
    /// issue 38). `None`: the backend keeps no such text, and the caller reads `get_many`
    /// (the default; the embedded store answers it). Layers do not forward it, so that a layer
    /// changing what `get_many` answers is read through.
    async fn get_many_text(&self, ids: &[String]) -> Result<Option<Vec<Option<StoredText>>>> {
        let _ = ids;
        Ok(None)
    }

    /// [`DocumentBackend::all_docs`] with each body as stored JSON text
    /// ([`DocumentBackend::get_many_text`]); `None` where the backend keeps no such text.
    async fn all_docs_stored_text(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> Result<Option<Page<StoredText>>> {
        let _ = (range, limit, page_token);
        Ok(None)
    }

    /// The record of `id` and the local document `local_name`, read together in one consistent
    /// snapshot ([`RecordWithLocal`]): what the data-store layout reads for every document (its
    /// record's revision and body, and its side document of other leaves). `None`: the backend
    /// reads them no cheaper together, and the caller makes the three reads (`revisions`, `get`
    /// or `get_deleted`, `get_local`); the default. The embedded store answers it in one read
    /// transaction on one trip to its blocking pool instead of three (issue 38: a data-store
    /// `GET` cost half again an ordinary one's). Layers do not forward it, so that a layer
    /// changing what the three reads answer is read through.
    async fn record_with_local(&self, id: &str, local_name: &str) -> Result<Option<RecordWithLocal>> {
        let _ = (id, local_name);
        Ok(None)
    }

    /// The local documents with these names, one answer per name, in order (`None` for a
    /// missing one), as [`DocumentBackend::get_local`] answers each. The default runs bounded
    /// concurrent `get_local`s; an adapter may override it with a batch read.
    async fn get_many_local(&self, names: &[String]) -> Result<Vec<Option<StoredDocument>>> {
        // A plain loop, as in `get_many`.
        let mut lookups = Vec::with_capacity(names.len());
        for name in names {
            lookups.push(self.get_local(name));
        }
        futures::stream::iter(lookups).buffered(GET_MANY_CONCURRENCY).try_collect().await
    }

    /// Each id's [`DocumentBackend::revisions`], one answer per id, in order. The default runs
    /// bounded concurrent `revisions`; the embedded store reads them in one read transaction
    /// (the data-store layout's batched tree reads: `_all_docs` pages, `_bulk_docs`).
    async fn revisions_many(&self, ids: &[String]) -> Result<Vec<Option<RevisionInfo>>> {
        // A plain loop, as in `get_many`.
        let mut lookups = Vec::with_capacity(ids.len());
        for id in ids {
            lookups.push(self.revisions(id));
        }
        futures::stream::iter(lookups).buffered(GET_MANY_CONCURRENCY).try_collect().await
    }

    /// Whether `put` and `bulk_write` check [`Precondition::NeverWritten`] atomically (the
    /// embedded store in its transaction, DynamoDB's `attribute_not_exists`, Firestore's
    /// `exists: false`, all of which a tombstone fails). `false`, the default, for a backend
    /// that cannot tell a tombstone apart in the write itself (CouchDB re-creates a deleted
    /// document on a create): it answers every such write with a conflict.
    fn checks_never_written(&self) -> bool {
        false
    }

    /// Whether other processes may write this backend's data at the same time (several
    /// `serve` instances over one DynamoDB table, Firestore project or CouchDB server): settings a
    /// database keeps in its local documents (`_revs_limit`) are then read again at every write
    /// instead of remembered (issue 36). `true`, the default; `false` for a backend that one
    /// process holds alone (the embedded store's exclusive file lock), where this process's own
    /// writes of a setting are the only ones.
    fn shared_with_other_processes(&self) -> bool {
        true
    }

    /// [`DocumentBackend::all_docs`] with each document as JSON text (`_id`, `_rev`, then the
    /// body, as [`StoredDocument::to_json`] orders them), for answers that pass documents on
    /// unchanged (`_all_docs?include_docs=true`). The default writes each listed document; the
    /// CouchDB adapter overrides it with CouchDB's own text, never parsed into values (most of the
    /// cost of a listing in front of CouchDB was building and dropping those values).
    async fn all_docs_text(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> Result<Page<DocumentText>> {
        let page = self.all_docs(range, limit, page_token).await?;
        let items = page.items.iter().map(DocumentText::of).collect::<Result<_>>()?;
        Ok(Page { items, next: page.next })
    }
}

/// An attachment of at most one chunk with its manifest, for
/// [`DocumentBackend::put_small_attachments`].
#[derive(Debug, Clone)]
pub struct SmallAttachment {
    /// The fresh blob name its chunk goes under ([`check_attachment_blob`]'s form).
    pub blob: String,
    /// The bytes: chunk 0, none at all when empty (a manifest of zero chunks).
    pub bytes: bytes::Bytes,
    /// The manifest's local-document name (`att:{sha256}`) and body.
    pub manifest: String,
    pub manifest_body: Map<String, Value>,
}

/// The longest attachment blob name a backend takes.
pub const MAX_ATTACHMENT_BLOB_LEN: usize = 100;

/// Checks an attachment blob name: 1 to [`MAX_ATTACHMENT_BLOB_LEN`] ASCII letters, digits, `-`
/// and `_`. Backends build record keys from it (`_attachment/{blob}/{index}` on DynamoDB,
/// `{blob}.{index}` on Firestore), so it holds neither separator nor anything a key escapes:
/// every key of a blob's chunks then starts with `{blob}/` (or `{blob}.`), and the DynamoDB
/// listing skips them all by the key `{blob}/g`, past every hex index.
pub fn check_attachment_blob(blob: &str) -> Result<()> {
    let well_formed = !blob.is_empty()
        && blob.len() <= MAX_ATTACHMENT_BLOB_LEN
        && blob.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if well_formed {
        Ok(())
    } else {
        Err(crate::error::Error::invalid(
            "attachment blob",
            format!("{blob:?} is not 1 to {MAX_ATTACHMENT_BLOB_LEN} ASCII letters, digits, '-' and '_'"),
        ))
    }
}

/// The error of the attachment-chunk methods on a backend that keeps no attachment bytes itself.
/// `Misconfigured` (a 500 if it ever reached a client): no other kind fits a call the backend
/// does not serve, and the CouchDB backend, the one that refuses, forwards its databases'
/// attachment requests to CouchDB instead of calling these.
pub fn attachments_unsupported(store: &str) -> crate::error::Error {
    crate::error::Error::new(
        crate::error::ErrorKind::Misconfigured,
        format!(
            "{store} keeps no attachment chunks (the CouchDB backend's databases keep CouchDB's own \
             attachments, reached by forwarding the request)"
        ),
    )
}

/// A record and a local document read in one snapshot ([`DocumentBackend::record_with_local`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RecordWithLocal {
    /// The record's revision information (as `revisions` answers it) and its body as the
    /// stored JSON text of an object, unparsed (a tombstone's: the fields its deletion carried,
    /// empty text when none); `None` when nothing is stored under the id. Text, so that a read
    /// answering the body as stored (the data-store `GET` of a document with no other leaves:
    /// `crate::database::layout::data_store`) copies it instead of parsing and writing it again.
    pub record: Option<(RevisionInfo, Vec<u8>)>,
    /// The local document, as `get_local` answers it.
    pub local: Option<StoredDocument>,
}

/// A live document as its backend keeps it: the id, current revision, and the body (every field
/// but `_id`/`_rev`) as the stored JSON text of an object, unparsed ([`DocumentBackend::get_many_text`]).
#[derive(Debug, Clone, PartialEq)]
pub struct StoredText {
    pub id: String,
    pub rev: Revision,
    pub json: Vec<u8>,
}

/// A listed document as JSON text: its id and revision, and the whole document (`_id`, `_rev`,
/// then the body) as written by the store.
#[derive(Debug, Clone)]
pub struct DocumentText {
    pub id: String,
    pub rev: Revision,
    pub json: Box<serde_json::value::RawValue>,
}

impl DocumentText {
    /// The text of a stored document, in [`StoredDocument::to_json`]'s order.
    pub fn of(doc: &StoredDocument) -> Result<Self> {
        let json = serde_json::value::to_raw_value(&doc.to_json()).map_err(|e| {
            crate::error::Error::new(
                crate::error::ErrorKind::Internal,
                format!("cannot write document {:?}: {e}", doc.id),
            )
        })?;
        Ok(DocumentText { id: doc.id.clone(), rev: doc.rev.clone(), json })
    }
}

/// A page of [`DocumentBackend::local_docs`] over names stored under `prefix` (a database's or a
/// user's), as its owner names them: `_local/{prefix}{name}` shown as `_local/{name}`, and any
/// document whose name does not start with `prefix` dropped (a range open at the top of a prefix
/// ends at the first name past it, inclusive: [`IdRange::under_prefix`]).
pub fn shown_without_prefix(page: Page<StoredDocument>, prefix: &str) -> Page<StoredDocument> {
    let stored = format!("{LOCAL_PREFIX}{prefix}");
    let items = page
        .items
        .into_iter()
        .filter_map(|mut doc| {
            let name = doc.id.strip_prefix(&stored)?;
            doc.id = format!("{LOCAL_PREFIX}{name}");
            Some(doc)
        })
        .collect();
    Page { items, next: page.next }
}

/// The distinct ids of a `get_many` request, in first-seen order: batch reads ask for each once
/// (DynamoDB refuses a request that names a key twice).
pub(crate) fn distinct_ids(ids: &[String]) -> Vec<String> {
    let mut seen = std::collections::HashSet::with_capacity(ids.len());
    ids.iter().filter(|id| seen.insert(id.as_str())).cloned().collect()
}

/// `bulk_write` for adapters that write a batch's documents concurrently, keeping the order of
/// writes to the same id: the batch is split into rounds, the k-th round holding each id's k-th
/// write, and the rounds go one after another through `write_distinct`, which may apply a round's
/// writes in any order. A batch of distinct ids (the usual case) is one round.
pub(crate) async fn bulk_write_in_id_rounds<F, Fut>(
    writes: Vec<BulkWrite>,
    mut write_distinct: F,
) -> Result<Vec<Result<Revision>>>
where
    F: FnMut(Vec<BulkWrite>) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<Result<Revision>>>>,
{
    let mut seen: std::collections::HashMap<&str, usize> = std::collections::HashMap::with_capacity(writes.len());
    let round_of: Vec<usize> = writes
        .iter()
        .map(|w| {
            let count = seen.entry(w.id.as_str()).or_default();
            *count += 1;
            *count - 1
        })
        .collect();
    let round_count = seen.into_values().max().unwrap_or(0);
    if round_count <= 1 {
        return write_distinct(writes).await;
    }
    let total = writes.len();
    let mut rounds: Vec<(Vec<usize>, Vec<BulkWrite>)> = (0..round_count).map(|_| Default::default()).collect();
    for ((slot, write), round) in writes.into_iter().enumerate().zip(round_of) {
        rounds[round].0.push(slot);
        rounds[round].1.push(write);
    }
    let mut results: Vec<Option<Result<Revision>>> = (0..total).map(|_| None).collect();
    for (slots, batch) in rounds {
        let written = write_distinct(batch).await?;
        for (slot, result) in slots.into_iter().zip(written) {
            results[slot] = Some(result);
        }
    }
    Ok(results
        .into_iter()
        .map(|r| {
            r.unwrap_or_else(|| {
                Err(crate::error::Error::new(
                    crate::error::ErrorKind::Internal,
                    "a bulk write returned fewer results than writes",
                ))
            })
        })
        .collect())
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
        BackendUrl::Embedded { path, options } => {
            let backend = embedded::EmbeddedBackend::open_with(path, *options).await?;
            Ok(Arc::new(backend))
        }
        BackendUrl::CouchDb(config) => Ok(Arc::new(couchdb::CouchDbBackend::open(config).await?)),
        BackendUrl::DynamoDb(config) => Ok(Arc::new(dynamodb::DynamoDbBackend::open(config).await?)),
        BackendUrl::Firestore(config) => Ok(Arc::new(firestore::FirestoreBackend::open(config).await?)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(start: Option<&str>, end: Option<&str>, inclusive_end: bool, descending: bool) -> IdRange {
        IdRange {
            start: start.map(str::to_owned),
            end: end.map(str::to_owned),
            inclusive_end,
            descending,
            include_design: false,
        }
    }

    #[test]
    fn a_range_under_a_prefix_holds_only_that_prefix_s_ids() {
        let open = range(None, None, true, false).under_prefix("doc:");
        assert_eq!(open, range(Some("doc:"), Some("doc;"), false, false));
        let open_descending = range(None, None, true, true).under_prefix("doc:");
        assert_eq!(open_descending, range(Some("doc;"), Some("doc:"), true, true));
        let bounded = range(Some("a"), Some("c"), false, false).under_prefix("alice:");
        assert_eq!(bounded, range(Some("alice:a"), Some("alice:c"), false, false));
        let from = range(Some("c"), None, true, true).under_prefix("u:");
        assert_eq!(from, range(Some("u:c"), Some("u:"), true, true));
        let all = range(Some("x"), None, true, false);
        assert_eq!(all.under_prefix(""), all);
        assert!(!open.holds_nothing() && !open_descending.holds_nothing() && !all.holds_nothing());
        assert!(range(Some("b"), Some("a"), true, false).holds_nothing());
        assert!(range(Some("a"), Some("b"), true, true).holds_nothing());
        assert!(range(Some("a"), Some("a"), false, false).holds_nothing());
        assert!(!range(Some("a"), Some("a"), true, true).holds_nothing());
        for id in ["doc:", "doc:a", "doc:\u{10FFFF}"] {
            assert!(open.contains(id) && open_descending.contains(id), "{id}");
        }
        for id in ["doc", "doc;", "doc;a", "tree:doc:a", "db:settings"] {
            assert!(!open.contains(id), "{id}");
        }
    }

    #[test]
    fn locals_under_a_prefix_are_shown_without_it() {
        let local = |id: &str| StoredDocument { id: id.into(), rev: Revision("0-1".into()), body: Map::new() };
        let page = Page { items: vec![local("_local/alice:cp"), local("_local/alice;x")], next: Some("t".into()) };
        let shown = shown_without_prefix(page, "alice:");
        assert_eq!(shown.items.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(), ["_local/cp"]);
        assert_eq!(shown.next.as_deref(), Some("t"));
    }
}
