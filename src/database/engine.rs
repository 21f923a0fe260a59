//! One CouchDB database kept in an ordinary [`DocumentBackend`]: how a document's revision tree
//! is stored, read and changed atomically. The engine serves both tree layouts
//! ([`super::layout::Layout`]): every database of the catalog over the engine's own
//! ([`Database::new`]), and the data-store database over the seed's records
//! ([`Database::data_store`]); every path that depends on where a tree is kept (reads, saves,
//! erasure, the repair of a cut save, listing, compaction's and the collector's scans) asks the
//! layout, and only the batched bulk path ([`bulk`]) groups the engine layout's record writes.
//!
//! ## Storage
//! How a tree is laid out over the backend's records is the layout's. The engine's layout
//! ([`super::layout::record::RecordLayout`]): a document whose winning leaf is live is one
//! backend document under its own id, body `{"revtree": <RevTree>}` (every leaf with its body;
//! each revision stored once, `rev_tree::stored`); a document whose winning leaf is deleted is a
//! backend tombstone, its tree kept in the backend's local document `tree:{id}` (backend
//! tombstones carry no body). So the backend's own machinery serves the database unchanged: id
//! order for `_all_docs`, the change feed (every change to a tree moves the document in it),
//! exact live counts for `doc_count`, and chunking of large documents. The backend's own
//! revision of a record is only a compare-and-swap token, never shown to clients. A write that
//! would make a tree larger than `couchdb_max_tree_bytes` ([`RevTree::held_bytes`], what every
//! read of the document holds) is refused, once the oldest kept inner bodies no longer fit have
//! been dropped.
//!
//! ## Writes
//! A write reads the document's state, applies the edit or merge to the tree, and saves it with
//! the backend's preconditions (the record's revision, the local tree's revision); when another
//! writer got there first it reads again and retries ([`MAX_TRIES`]). A write that changes
//! nothing still saves when the state read is a save a crash cut short (the engine's one
//! crash-repair rule, [`super::layout::must_save`], shared with the data-store layout); so does
//! a read a replicator decides what to send by ([`repairing`]). The order of the two writes
//! of a deletion (tree first, then the tombstone) and of a re-creation (the live record carries
//! the whole tree) means a crash between them never loses a leaf: a live record is always the
//! authority, the local tree only for a tombstone. A live record whose winner is deleted (left by
//! a crash in the middle of saving a deleted document) reads as deleted.
//!
//! Before each save, the manifests of the attachment bytes the tree references are touched
//! ([`Database::keep_references`]), so that a collection running meanwhile, whose scan of the
//! documents reads no snapshot, never frees bytes the save makes visible
//! ([`crate::database::attachments`], "Why a reference is never freed").
//!
//! ## Deletion
//! Deleting the database waits for the writes under way and refuses new ones ([`closing`]);
//! from then on every call answers CouchDB's missing-database `NotFound`
//! ([`Database::while_open`]).
//!
//! ## Earlier revisions' bodies
//! As in CouchDB, a revision that stops being a leaf keeps its body in the tree
//! ([`rev_tree::InnerBody`](super::rev_tree::InnerBody)) until [`Database::compact`] drops every
//! one (`POST /{db}/_compact`); each write keeps at most [`InnerBodyBounds`] of them per document
//! (the oldest go first), and stemming by `_revs_limit` drops those of the revisions it forgets.
//! Their attachments stay referenced, so the collector keeps their bytes until then.
//!
//! ## The data-store database
//! [`Database::data_store`] serves the data-store database over the store's own backend: each
//! record is the seed's document holding the winning revision (its backend revision is the
//! CouchDB `_rev`), written byte for byte as the data-store face's path writes it, the other
//! leaves in `:leaves:{id}` ([`super::layout::data_store`]). It keeps no inner bodies (no place
//! for them), no attachments (a write carrying some is refused), its clients' local documents
//! under their own names and its own under names no client may write
//! ([`super::layout::reserved_local_name`]); reads of a tree finish a save a crash cut short
//! ([`super::layout::Layout::read_as_served`]), as the data-store face's reads always have. The
//! CouchDB backend, which keeps the trees itself, is refused there: that database stays on the
//! data-store face's path over the backend's native calls.

mod bulk;
mod client_local;
mod closing;
#[cfg(test)]
pub(crate) mod counting;
mod map_input;
mod purge_views;
mod repairing;
pub use closing::DRAIN_WAIT;
pub use purge_views::MAX_PURGES_NAMED;

pub use bulk::{DocumentAnswers, ReadBefore};

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use serde_json::{Map, Value};

use super::attachments::{AttachmentStore, GarbageCollected};
use super::doc_attachments;
use super::layout::record::{gone_is_conflict, record_of, record_text, TREE_PREFIX};
use super::layout::{must_save, LaidOut, Layout, LayoutToken, LocalNames, RepairableLayout, Served, TreeLayout};
use super::rev_id;
use super::rev_tree::{parse_rev, EditError, MergeOutcome, RevPath, RevTree};
use crate::backend::revision::random_token;
use crate::backend::{Change, DocumentBackend, IdRange, Page, Precondition, DEFAULT_REVS_LIMIT};
use crate::error::{Error, ErrorKind, Result};
use crate::model::depth::check_document_depth;

/// Attempts of one write against other writers of the same document before giving up with a
/// conflict the client may retry.
pub const MAX_TRIES: usize = 16;

/// A document's revision tree as stored, with what the next save must match (the database's
/// layout's token, [`LayoutToken`]).
pub type DocState = LaidOut<LayoutToken>;

/// One write to a document.
#[derive(Debug, Clone)]
pub enum Write {
    /// A client's edit (`new_edits: true`): `parent` is the `_rev` it sent.
    Edit { parent: Option<String>, deleted: bool, body: Map<String, Value> },
    /// A replicated revision (`new_edits: false`) with its path.
    Replicated { path: RevPath, deleted: bool, body: Map<String, Value> },
}

/// What a write did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Written {
    /// An edit made this revision.
    Edited(String),
    /// A replicated revision was merged (or was already known).
    Merged(MergeOutcome),
}

/// Writes applied to a document's tree in memory, not yet saved.
struct Applied {
    tree: RevTree,
    answers: Vec<Result<Written>>,
    /// Whether the tree differs from the one read (else there is nothing to save).
    changed: bool,
}

/// The per-database settings CouchDB keeps beside the documents.
#[derive(Debug, Clone, PartialEq)]
pub struct DbSettings {
    pub revs_limit: usize,
    pub security: Value,
    /// `_purged_infos_limit`: in CouchDB, how many purge requests the database remembers for
    /// its indexes and internal replication. The engine remembers none (a purge of a document's
    /// last leaf ends the view incarnation instead: [`purge_views`]), so it is kept and answered
    /// and bounds nothing (docs/couchdb-api.md).
    pub purged_infos_limit: u64,
}

/// CouchDB's `_purged_infos_limit` of a new database (its database header's default).
pub const DEFAULT_PURGED_INFOS_LIMIT: u64 = 1000;

impl Default for DbSettings {
    fn default() -> Self {
        DbSettings {
            revs_limit: DEFAULT_REVS_LIMIT,
            security: Value::Object(Map::new()),
            purged_infos_limit: DEFAULT_PURGED_INFOS_LIMIT,
        }
    }
}

/// How many inner revisions' bodies one document keeps until compaction, checked at each write
/// of it: the oldest are dropped past either bound (`couchdb_inner_bodies_max_revisions`,
/// `couchdb_inner_bodies_max_bytes`; 0 keeps none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InnerBodyBounds {
    pub max_revisions: usize,
    /// In [`RevTree::inner_held_bytes`].
    pub max_bytes: usize,
}

/// The default of `couchdb_inner_bodies_max_revisions`.
pub const DEFAULT_INNER_BODIES_MAX_REVISIONS: usize = 100;
/// The default of `couchdb_inner_bodies_max_bytes`.
pub const DEFAULT_INNER_BODIES_MAX_BYTES: usize = 1 << 20;

impl Default for InnerBodyBounds {
    fn default() -> Self {
        InnerBodyBounds { max_revisions: DEFAULT_INNER_BODIES_MAX_REVISIONS, max_bytes: DEFAULT_INNER_BODIES_MAX_BYTES }
    }
}

/// CouchDB's default `max_document_size`: 8,000,000 bytes of a document's JSON.
pub const DEFAULT_MAX_DOCUMENT_BYTES: usize = 8_000_000;

pub use crate::backend::rev_tree::DEFAULT_MAX_TREE_BYTES;

/// The default of `couchdb_max_gzip_ratio`: text and JSON compress 3 to 20 times, deflate at
/// most about 1,032 times (what a gzip bomb reaches).
pub const DEFAULT_MAX_GZIP_RATIO: u64 = 100;

/// The default of `couchdb_max_inflight_inline_bytes`: attachment bytes shown inline
/// (`attachments=true` as JSON) being served at once, server-wide; each costs about four times
/// its length in memory (the bytes, their base64 in the document and in the answer).
pub const DEFAULT_MAX_INFLIGHT_INLINE_BYTES: usize = 128 << 20;

/// The default of `couchdb_inline_wait_ms`: how long a read waits for its share of the inline
/// budget before 429.
pub const DEFAULT_INLINE_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// One database. Cheap to share; calls after the database was deleted fail with `NotFound`.
pub struct Database {
    name: String,
    backend: Arc<dyn DocumentBackend>,
    /// How each document's tree is laid out over the backend's records (shared with the
    /// background collection of attachment bytes, which scans the stored trees).
    layout: Arc<Layout>,
    /// The local documents the database keeps, for itself and for its clients (its layout's).
    local_names: LocalNames,
    dropped: AtomicBool,
    /// The writes under way, which a deletion waits for ([`closing`]).
    in_flight: closing::WritesInFlight,
    /// `_revs_limit` as this process last read or wrote it, on a backend no other process
    /// writes ([`Database::revs_limit`]).
    revs_limit: std::sync::Mutex<Option<usize>>,
    max_document_bytes: usize,
    /// The largest revision tree of one document ([`RevTree::held_bytes`],
    /// `couchdb_max_tree_bytes`).
    max_tree_bytes: usize,
    /// How many inner revisions' bodies one document keeps until compaction.
    inner_bodies: InnerBodyBounds,
    /// Writers of one document in this process take turns on the document's own lock, so they
    /// never spend their tries against each other ([`MAX_TRIES`] is only for writers in other
    /// processes), and writers of other documents never wait for them.
    write_locks: super::keyed_locks::KeyedLocks<String>,
    /// The attachment bytes of the documents ([`doc_attachments`]).
    attachments: AttachmentStore,
    /// The largest attachment stored (`couchdb_max_attachment_bytes`).
    max_attachment_bytes: u64,
    /// The most bytes a gzip-encoded attachment part may decode to per compressed byte
    /// (`couchdb_max_gzip_ratio`).
    max_gzip_ratio: u64,
    /// Attachment bytes shown inline (base64 in JSON) being served at once, shared by every
    /// database of the server (`couchdb_max_inflight_inline_bytes`).
    inline_budget: Arc<crate::server::budget::ByteBudget>,
    /// How long a read waits for its share of `inline_budget` before 429
    /// (`couchdb_inline_wait_ms`).
    inline_wait: std::time::Duration,
    /// Whether a garbage collection of attachment bytes is running, and whether another was
    /// asked for meanwhile (writes that drop references ask; one runs at a time).
    collecting: Arc<Collecting>,
    /// What checks each write against the validation functions ([`super::write_guard`]).
    write_guard: Option<Arc<dyn super::write_guard::WriteGuard>>,
    /// Where reads and changes are counted and `updated` events kept ([`super::activity`]).
    activity: Option<Arc<super::activity::Activity>>,
    /// The average rendered size of a row with its document in this database's last listing
    /// (0 before any): the size the next listing's first backend page is asked for by
    /// ([`Database::listed_row_bytes`]).
    listed_row_bytes: Arc<std::sync::atomic::AtomicUsize>,
    /// What readers parsed from the design documents, until their records change
    /// ([`super::parsed_designs`]).
    parsed_designs: super::parsed_designs::ParsedDesigns,
}

/// The backend's own local document holding the database's incarnation for view indexes: a
/// random id made when an index is first built over the database ([`crate::views::source`]).
/// Not a client's local document (those are kept under another prefix), so no client can change
/// it. The engine's databases' name; the data-store database's is the facade's
/// ([`crate::store::VIEWS_INCARNATION_DOC`]): [`Database::views_incarnation_doc`].
pub const VIEWS_INCARNATION_DOC: &str = "views-incarnation";

/// The state of the background collection of attachment bytes.
#[derive(Default)]
struct Collecting {
    running: AtomicBool,
    again: AtomicBool,
    /// Held by every collection while it runs: a `_compact` waits for a background collection
    /// in progress (whose deletions it would otherwise meet half done and take as kept) and then
    /// makes its own whole pass, so its 202 means the bytes are freed.
    one_at_a_time: tokio::sync::Mutex<()>,
}

impl Database {
    /// The database kept in `backend` (a namespace of its own: see [`crate::backend::catalog`]).
    pub fn new(name: String, backend: Arc<dyn DocumentBackend>) -> Self {
        Self::over(name, Layout::record(Arc::clone(&backend)), backend)
    }

    /// The data-store database over the store's own backend (no namespace: its records are at
    /// the backend's top level, where the facade and the REST API read them), laid out as the
    /// seed's records ([`super::layout::data_store`]). What differs from the other databases:
    /// - a client's `_local/x` is the backend's local document `x` as the data-store face names
    ///   it; the engine's own local documents start with `:` ([`super::layout::reserved_local_name`]);
    /// - no inner revision's body is kept (the layout has no place for one: its bounds are 0,
    ///   `_compact` has nothing to drop);
    /// - attachments are not supported: a write carrying `_attachments` is refused (403
    ///   `forbidden`, as the data-store face refuses it), nothing is collected.
    ///
    /// Refused (`Misconfigured`) on a backend that keeps branches itself (the CouchDB backend,
    /// [`DocumentBackend::keeps_branches`]): there the tree is CouchDB's own document, laid out
    /// by [`Database::native_data_store`] instead (callers that need the seed's records, such as
    /// the data-store views' source, take the refusal to mean the backend runs its own views).
    pub fn data_store(name: String, backend: Arc<dyn DocumentBackend>) -> Result<Self> {
        if backend.keeps_branches() {
            return Err(Error::new(
                ErrorKind::Misconfigured,
                "the data-store layout needs a backend whose records hold one revision each; this backend keeps \
                 revision trees itself (CouchDB): its data-store database is Database::native_data_store",
            ));
        }
        Ok(Self::data_store_laid_out(name, Layout::data_store(Arc::clone(&backend)), backend))
    }

    /// The data-store database over a backend that keeps revision trees itself (the CouchDB
    /// backend, [`DocumentBackend::keeps_branches`]), laid out by [`super::layout::native`]: the
    /// tree is the backend's own document, the backend checks each edit against its parent and
    /// assigns its revision, which the write answers. Otherwise as [`Database::data_store`].
    pub fn native_data_store(name: String, backend: Arc<dyn DocumentBackend>) -> Result<Self> {
        if !backend.keeps_branches() {
            return Err(Error::new(
                ErrorKind::Misconfigured,
                "the native data-store layout needs a backend that keeps revision trees itself",
            ));
        }
        Ok(Self::data_store_laid_out(name, Layout::native(Arc::clone(&backend)), backend))
    }

    fn data_store_laid_out(name: String, layout: Layout, backend: Arc<dyn DocumentBackend>) -> Self {
        Self::over(name, layout, backend).with_inner_body_bounds(InnerBodyBounds { max_revisions: 0, max_bytes: 0 })
    }

    fn over(name: String, layout: Layout, backend: Arc<dyn DocumentBackend>) -> Self {
        Database {
            name,
            dropped: AtomicBool::new(false),
            in_flight: closing::WritesInFlight::default(),
            revs_limit: std::sync::Mutex::new(None),
            max_document_bytes: DEFAULT_MAX_DOCUMENT_BYTES,
            max_tree_bytes: DEFAULT_MAX_TREE_BYTES,
            inner_bodies: InnerBodyBounds::default(),
            write_locks: Default::default(),
            parsed_designs: Default::default(),
            attachments: AttachmentStore::new(Arc::clone(&backend)),
            max_attachment_bytes: u64::MAX,
            max_gzip_ratio: DEFAULT_MAX_GZIP_RATIO,
            inline_budget: Arc::new(crate::server::budget::ByteBudget::new(DEFAULT_MAX_INFLIGHT_INLINE_BYTES)),
            inline_wait: DEFAULT_INLINE_WAIT,
            collecting: Arc::default(),
            write_guard: None,
            activity: None,
            listed_row_bytes: Arc::default(),
            local_names: layout.local_names(),
            layout: Arc::new(layout),
            backend,
        }
    }

    /// The average rendered size of a row with its document in this database's last listing,
    /// 0 before any: a listing's pages are sized from it (`couchdb_api::listing::PageSizer`), so
    /// that a listing of 100 small documents asks the backend once, not for 64 rows first and
    /// then the rest (issue 38: two `_all_docs` requests to CouchDB per client request).
    /// What readers parsed from this database's design documents ([`super::parsed_designs`]).
    pub fn parsed_designs(&self) -> &super::parsed_designs::ParsedDesigns {
        &self.parsed_designs
    }

    pub fn listed_row_bytes(&self) -> &Arc<std::sync::atomic::AtomicUsize> {
        &self.listed_row_bytes
    }

    /// The largest attachment stored and how long unreferenced bytes are kept
    /// ([`AttachmentStore::with_grace`]).
    pub fn with_attachment_bounds(self, max_attachment_bytes: u64, grace: std::time::Duration) -> Self {
        let attachments = self.attachments.clone().with_grace(grace);
        Database { max_attachment_bytes, attachments, ..self }
    }

    /// The attachment bytes of this database's documents.
    pub fn attachments(&self) -> &AttachmentStore {
        &self.attachments
    }

    /// The largest attachment stored (`couchdb_max_attachment_bytes`).
    pub fn max_attachment_bytes(&self) -> u64 {
        self.max_attachment_bytes
    }

    /// The most bytes a gzip-encoded attachment part may decode to per compressed byte.
    pub fn with_max_gzip_ratio(self, max_gzip_ratio: u64) -> Self {
        Database { max_gzip_ratio, ..self }
    }

    /// Shows attachments inline within `budget`, shared with the server's other databases, a
    /// read waiting at most `wait` for its share.
    pub fn with_inline_budget(
        self,
        inline_budget: Arc<crate::server::budget::ByteBudget>,
        inline_wait: std::time::Duration,
    ) -> Self {
        Database { inline_budget, inline_wait, ..self }
    }

    /// The server-wide budget of attachment bytes shown inline at once
    /// (`couchdb_max_inflight_inline_bytes`).
    pub fn inline_budget(&self) -> &crate::server::budget::ByteBudget {
        &self.inline_budget
    }

    /// How long a read waits for its share of the inline budget (`couchdb_inline_wait_ms`).
    pub fn inline_wait(&self) -> std::time::Duration {
        self.inline_wait
    }

    /// `couchdb_max_gzip_ratio`: a gzip part decoding to more than this many times its
    /// compressed bytes (plus a MiB) is refused.
    pub fn max_gzip_ratio(&self) -> u64 {
        self.max_gzip_ratio
    }

    /// `_compact`: drops every document's kept inner bodies ([`Database::drop_inner_bodies`]),
    /// then frees the attachment bytes no longer referenced (where the backend keeps them).
    pub async fn compact(&self) -> Result<Option<GarbageCollected>> {
        self.while_open(self.drop_every_inner_body()).await?;
        if self.attachments_unsupported() {
            return Ok(None);
        }
        self.collect_attachment_garbage().await.map(Some)
    }

    /// Every document whose tree keeps inner bodies, page by page, as the layout finds them;
    /// each is rewritten without them. Nothing where the layout keeps none.
    async fn drop_every_inner_body(&self) -> Result<()> {
        const PAGE: usize = 200;
        let Some(kept) = self.layout.kept_bodies() else { return Ok(()) };
        let mut cursor = None;
        loop {
            let page = kept.inner_bodies_page(cursor, PAGE).await?;
            for id in &page.ids {
                self.drop_inner_bodies(id).await?;
            }
            cursor = page.next;
            if cursor.is_none() {
                return Ok(());
            }
        }
    }

    /// Rewrites one document's tree without its inner bodies, against other writers, as its
    /// layout does it ([`super::layout::KeptBodies::save_without_inner_bodies`]).
    async fn drop_inner_bodies(&self, id: &str) -> Result<()> {
        let _turn = self.write_lock(id).lock_owned().await;
        for _ in 0..MAX_TRIES {
            let Some(state) = self.read(id).await? else { return Ok(()) };
            let mut tree = state.tree.clone();
            if !tree.drop_inner_bodies() {
                return Ok(());
            }
            self.check_open()?;
            let kept = self.layout.kept_bodies().ok_or_else(|| {
                Error::new(ErrorKind::Internal, "inner bodies found on a database whose layout keeps none")
            })?;
            match kept.save_without_inner_bodies(id, &state, &tree).await {
                Ok(()) => return Ok(()),
                Err(err) if err.kind() == ErrorKind::Conflict => continue,
                Err(err) => return Err(err),
            }
        }
        Err(Error::conflict(format!("compacting {id:?} kept meeting other writers; try again")))
    }

    /// Frees the attachment bytes no kept body of any document references any more (past the
    /// grace period): every document's tree is read, page by page, for the SHA-256s its leaves
    /// and kept inner bodies reference.
    pub async fn collect_attachment_garbage(&self) -> Result<GarbageCollected> {
        if self.attachments_unsupported() {
            return Ok(GarbageCollected::default());
        }
        let _alone = self.collecting.one_at_a_time.lock().await;
        self.while_open(collect(Arc::clone(&self.layout), self.attachments.clone())).await
    }

    /// Asks for a collection in the background (a write dropped references): one runs at a time
    /// per database; asked while one runs, another follows it.
    fn collect_soon(&self) {
        if self.attachments_unsupported() {
            return;
        }
        self.collecting.again.store(true, Ordering::SeqCst);
        if self.collecting.running.swap(true, Ordering::SeqCst) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.collecting.running.store(false, Ordering::SeqCst);
            return;
        };
        let (layout, store, collecting) =
            (Arc::clone(&self.layout), self.attachments.clone(), Arc::clone(&self.collecting));
        let name = self.name.clone();
        runtime.spawn(async move {
            while collecting.again.swap(false, Ordering::SeqCst) {
                let _alone = collecting.one_at_a_time.lock().await;
                if let Err(err) = collect(Arc::clone(&layout), store.clone()).await {
                    tracing::warn!(database = %name, error = %err, "collecting unreferenced attachment bytes failed");
                }
            }
            collecting.running.store(false, Ordering::SeqCst);
        });
    }

    /// Whether this database keeps no attachments: the backend keeps no attachment bytes of its
    /// own (the CouchDB backend), or the layout has no place for them (the data-store
    /// database's seed records: [`Database::data_store`]).
    pub fn attachments_unsupported(&self) -> bool {
        self.backend.attachment_chunk_bytes() == 0 || self.layout.is_data_store()
    }

    /// Refuses a write carrying attachments where the database keeps none.
    fn check_attachments_kept(&self, write: &Write) -> Result<()> {
        let (Write::Edit { body, .. } | Write::Replicated { body, .. }) = write;
        if self.layout.is_data_store() && doc_attachments::has_attachments(body) {
            return Err(Error::new(
                ErrorKind::Forbidden,
                "attachments are not supported on this database: agentstore keeps its data-store documents as JSON only",
            ));
        }
        Ok(())
    }

    /// The largest document body this database takes, in bytes of its JSON.
    pub fn with_max_document_bytes(self, max_document_bytes: usize) -> Self {
        Database { max_document_bytes, ..self }
    }

    /// The largest revision tree of one document this database keeps ([`RevTree::held_bytes`]).
    pub fn with_max_tree_bytes(self, max_tree_bytes: usize) -> Self {
        Database { max_tree_bytes, ..self }
    }

    /// How many inner revisions' bodies one document keeps until compaction.
    pub fn with_inner_body_bounds(self, inner_bodies: InnerBodyBounds) -> Self {
        Database { inner_bodies, ..self }
    }

    /// Checks every write with `guard` before it is applied.
    /// Counts this database's reads and changes, and keeps its `updated` events, in `activity`.
    pub fn with_activity(self, activity: Arc<super::activity::Activity>) -> Self {
        Database { activity: Some(activity), ..self }
    }

    /// Records that the database changed (a write or a purge that took effect).
    fn record_change(&self) {
        if let Some(activity) = &self.activity {
            activity.changed(&self.name);
        }
    }

    /// Records `count` documents read.
    pub(crate) fn record_reads(&self, count: usize) {
        if let Some(activity) = &self.activity {
            activity.read(count);
        }
    }

    pub fn with_write_guard(self, write_guard: Option<Arc<dyn super::write_guard::WriteGuard>>) -> Self {
        Database { write_guard, ..self }
    }

    pub fn max_document_bytes(&self) -> usize {
        self.max_document_bytes
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The backend local document holding the database's incarnation for view indexes.
    pub fn views_incarnation_doc(&self) -> &'static str {
        self.local_names.views_incarnation
    }

    /// The local documents the database keeps, for itself and for its clients.
    pub(super) fn local_names(&self) -> LocalNames {
        self.local_names
    }

    /// The backend local document counting the feed entries purges took out
    /// ([`super::seq`]: what keeps the feed's `N` from going back).
    pub fn erased_doc(&self) -> &'static str {
        self.local_names.erased
    }

    /// The database's layout.
    pub(super) fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn backend(&self) -> &Arc<dyn DocumentBackend> {
        &self.backend
    }

    pub(super) fn mark_dropped(&self) {
        self.dropped.store(true, Ordering::SeqCst);
    }

    /// `NotFound` once the database has been deleted: requests in flight end with CouchDB's
    /// `not_found` rather than writing into a deleted database.
    pub fn check_open(&self) -> Result<()> {
        if self.dropped.load(Ordering::SeqCst) {
            return Err(Error::not_found("Database does not exist."));
        }
        Ok(())
    }

    /// Runs `work` on the open database. Whatever `work` answers once the database has been
    /// deleted under it is the deletion's doing (a DynamoDB table or a redb file going away, or
    /// per-document failures inside a bulk answer, or a write into what is gone): the caller
    /// gets CouchDB's `not_found` for the database, not the backend's error about a missing
    /// table nor a success nobody can read back.
    pub async fn while_open<T>(&self, work: impl std::future::Future<Output = Result<T>>) -> Result<T> {
        self.check_open()?;
        let answer = work.await;
        self.check_open()?;
        answer
    }

    /// The document's stored state; `None` when it was never written (or was purged).
    pub async fn read(&self, id: &str) -> Result<Option<DocState>> {
        // The empty id names no document (no database takes it), and a backend may not even be
        // asked for it (a DynamoDB key, a Firestore document name is never empty).
        if id.is_empty() {
            return Ok(None);
        }
        let state = self.while_open(self.layout.read_as_served(id)).await?;
        self.record_reads(usize::from(state.is_some()));
        Ok(state)
    }

    /// The document as a plain read of its winner (no query option) serves it: [`Database::read`],
    /// except that a data-store document with no other leaves comes as its record's text
    /// ([`Layout::read_served`]); `None` when it was never written (or was purged).
    pub async fn read_served(&self, id: &str) -> Result<Option<Served<LayoutToken>>> {
        if id.is_empty() {
            return Ok(None);
        }
        let served = self.while_open(self.layout.read_served(id)).await?;
        self.record_reads(usize::from(served.is_some()));
        Ok(served)
    }

    /// The states of many documents, one per id, in order (a deletion met cut before its
    /// tombstone is finished: [`repairing`]).
    pub async fn read_many(&self, ids: &[String]) -> Result<Vec<Option<DocState>>> {
        let states = self.while_open(self.read_states(ids)).await?;
        self.record_reads(states.iter().filter(|state| state.is_some()).count());
        let read = ids.iter().zip(&states).filter_map(|(id, state)| Some((id.as_str(), state.as_ref()?)));
        self.finish_cut_deletions(read).await;
        Ok(states)
    }

    /// The states of many documents, in order: their records in one batched read, then the
    /// local trees of those without a live record in another (`get_many_local`). The empty id, which a client may name (`keys`, `_bulk_get`, `_revs_diff`), reads as
    /// nothing, without asking the backend ([`Database::read`]).
    async fn read_states(&self, ids: &[String]) -> Result<Vec<Option<DocState>>> {
        if !ids.iter().any(String::is_empty) {
            return self.layout.read_many(ids).await;
        }
        let named: Vec<String> = ids.iter().filter(|id| !id.is_empty()).cloned().collect();
        let mut read = self.layout.read_many(&named).await?.into_iter();
        Ok(ids.iter().map(|id| if id.is_empty() { None } else { read.next().flatten() }).collect())
    }

    /// The states behind a page of the backend's change feed: each change's document as it is now.
    pub async fn read_changes(&self, changes: &[Change]) -> Result<Vec<Option<DocState>>> {
        let ids: Vec<String> = changes.iter().map(|change| change.id.clone()).collect();
        self.read_many(&ids).await
    }

    /// [`Database::read_many`] for readers that show revisions only (a `_changes` row without
    /// its document): where the layout can (the engine's), each live record's tree is read
    /// without its bodies, every leaf's body empty ([`crate::backend::rev_tree::RevTreeOutline`]);
    /// elsewhere the states are read whole. A state from here is never saved: a deletion met
    /// cut before its tombstone is finished from a whole read of it.
    pub async fn read_many_outlines(&self, ids: &[String]) -> Result<Vec<Option<DocState>>> {
        if ids.iter().any(String::is_empty) {
            return self.read_many(ids).await;
        }
        self.check_open()?;
        let Some(states) = self.layout.read_many_outlines(ids).await else { return self.read_many(ids).await };
        let states = states?;
        self.check_open()?;
        self.record_reads(states.iter().filter(|state| state.is_some()).count());
        let cut: Vec<String> = ids
            .iter()
            .zip(&states)
            .filter(|(_, state)| state.as_ref().is_some_and(repairing::cut_deletion))
            .map(|(id, _)| id.clone())
            .collect();
        if !cut.is_empty() {
            let whole = self.while_open(self.read_states(&cut)).await?;
            let read = cut.iter().zip(&whole).filter_map(|(id, state)| Some((id.as_str(), state.as_ref()?)));
            self.finish_cut_deletions(read).await;
        }
        Ok(states)
    }

    /// Applies several writes to one document in order, in one read and one save (a bulk
    /// request's writes to one id: a replicator may send hundreds of branches of one document at
    /// once). Each write has its own answer; a conflicting edit fails alone. Retried as a whole
    /// when another writer got in between the read and the save.
    pub async fn write_batch(&self, id: &str, writes: &[Write]) -> Result<Vec<Result<Written>>> {
        let _under_way = self.start_write()?;
        let answers = self.while_open(self.write_batch_once_open(id, writes)).await?;
        if answers.iter().any(Result::is_ok) {
            self.record_change();
        }
        Ok(answers)
    }

    /// The lock this process's writers of `id` take turns on.
    fn write_lock(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.write_locks.of(id)
    }

    /// The guard's verdict on each write: `None` for writes it lets happen (all of them when
    /// there is no guard, and for local documents, which it does not check; design documents
    /// are checked by [`Database::design_guard`]) and for edits that conflict with the tree as
    /// read (refused as conflicts when applied).
    async fn guard(&self, id: &str, state: Option<&DocState>, writes: &[Write]) -> Result<Vec<Option<Error>>> {
        let Some(guard) = &self.write_guard else {
            return Ok(writes.iter().map(|_| None).collect());
        };
        if id.starts_with("_design/") {
            return self.design_guard(guard.as_ref(), id, state, writes).await;
        }
        if id.starts_with("_local/") || !guard.applies(self).await? {
            return Ok(writes.iter().map(|_| None).collect());
        }
        // An edit the tree as read refuses is a conflict before validation runs, as in CouchDB
        // (`couch_db:prep_and_validate_update` checks the revision first): the guard is not
        // asked, and the edit fails as a conflict when applied.
        let empty = RevTree::default();
        let tree = state.map_or(&empty, |state| &state.tree);
        let asked: Vec<bool> = writes
            .iter()
            .map(|write| match write {
                Write::Edit { parent, deleted, .. } => !tree.edit_conflicts(parent.as_deref(), *deleted),
                Write::Replicated { .. } => true,
            })
            .collect();
        // Copied only when some are not asked (a copy of every body was a thirtieth of a
        // data-store `_bulk_docs`, issue 38).
        let checked: std::borrow::Cow<'_, [Write]> = if asked.iter().all(|asked| *asked) {
            std::borrow::Cow::Borrowed(writes)
        } else {
            writes.iter().zip(&asked).filter(|(_, asked)| **asked).map(|(write, _)| write.clone()).collect()
        };
        if checked.is_empty() {
            return Ok(writes.iter().map(|_| None).collect());
        }
        let mut verdicts = guard.check_writes(self, id, state, &checked).await?;
        verdicts.resize_with(checked.len(), || None);
        let mut verdicts = verdicts.into_iter();
        Ok(asked.into_iter().map(|asked| if asked { verdicts.next().flatten() } else { None }).collect())
    }

    /// The guard's verdict on each write of the design document `id`. A replicated revision
    /// the tree has already is not checked: it changes nothing (CouchDB checks only new leaves).
    async fn design_guard(
        &self,
        guard: &dyn super::write_guard::WriteGuard,
        id: &str,
        state: Option<&DocState>,
        writes: &[Write],
    ) -> Result<Vec<Option<Error>>> {
        let known = |write: &Write| match (write, state) {
            (Write::Replicated { path, .. }, Some(state)) => state.tree.contains(&path.leaf_rev()),
            _ => false,
        };
        let checked: Vec<Write> = writes.iter().filter(|write| !known(write)).cloned().collect();
        let mut verdicts = guard.check_design(self, &super::write_guard::proposed(id, state, &checked)).await?;
        verdicts.resize_with(checked.len(), || None);
        let mut verdicts = verdicts.into_iter();
        Ok(writes.iter().map(|write| if known(write) { None } else { verdicts.next().flatten() }).collect())
    }

    async fn write_batch_once_open(&self, id: &str, writes: &[Write]) -> Result<Vec<Result<Written>>> {
        self.write_batch_reading(id, writes, Unread::Tried).await
    }

    /// [`Database::write_batch_once_open`]; with [`Unread::Skipped`] the document is read before
    /// it is written whatever its writes are (a creation the bulk path already wrote unread and
    /// the backend refused: trying it unread again would only be refused again).
    async fn write_batch_reading(&self, id: &str, writes: &[Write], unread: Unread) -> Result<Vec<Result<Written>>> {
        // `_users`: clear passwords become CouchDB's hash before anything else sees the write
        // (its validation checks the hashed document, as CouchDB's does), once per request.
        let hashed = match super::users::is_users_db(&self.name) {
            true => super::users::hash_passwords(writes).await?,
            false => None,
        };
        let writes = hashed.as_deref().unwrap_or(writes);
        // `_replicator`: a client's document gets its writer as `owner`, as CouchDB's does.
        let owned = match self.name == super::replicator_owner::REPLICATOR_DB {
            true => {
                let writer = super::validation::current_writer();
                let admin = writer.roles.iter().any(|role| role == "_admin");
                super::replicator_owner::with_owner(writes, writer.name.as_deref(), admin)
            }
            false => None,
        };
        let writes = owned.as_deref().unwrap_or(writes);
        let _turn = self.write_lock(id).lock_owned().await;
        if unread == Unread::Tried {
            if let Some(answers) = self.create_unread(id, writes).await? {
                return Ok(answers);
            }
        }
        let (revs_limit, mut state) = tokio::try_join!(self.revs_limit_for(edits_only(writes)), self.read(id))?;
        for attempt in 0..MAX_TRIES {
            if attempt > 0 {
                state = self.read(id).await?;
            }
            let Applied { tree, mut answers, changed } = self.applied(id, state.as_ref(), writes, revs_limit).await?;
            // Nothing new, but a save that a crash cut short (the tree written, the record not)
            // is finished now: else the document stays out of the feed and `_all_docs` for good,
            // since every later replicated write of its leaves changes nothing.
            if !must_save(self.layout.as_ref(), id, state.as_ref(), changed).await? {
                return Ok(answers);
            }
            self.keep_references(state.as_ref(), &tree).await?;
            match self.save_answering(id, state.as_ref(), &tree, &mut answers).await {
                Ok(()) => {
                    self.saved(id, state.as_ref(), &tree);
                    return Ok(answers);
                }
                Err(err) if err.kind() == ErrorKind::Conflict => continue,
                Err(err) => return Err(err),
            }
        }
        Err(Error::conflict(format!(
            "Document update conflict: {MAX_TRIES} attempts met other writers of {id:?}; try again"
        )))
    }

    /// A creation (one edit naming no parent, not a deletion) written without reading the
    /// document first, where the save checks that nothing is there
    /// ([`super::layout::Layout::creates_unread`]: the data-store database on CouchDB, which
    /// refuses a `PUT` without `_rev` over a live document and makes one over a deleted document
    /// its next revision; the engine's layout on a backend checking `NeverWritten`, the embedded
    /// store, DynamoDB, Firestore, once no local tree is found under the id): one backend request
    /// instead of two in front of CouchDB; on the embedded store one read and one write instead
    /// of two of each (issue 38). The write guard sees what it would see
    /// after a read finding nothing (no old document: a deleted winner shows none either, and the
    /// new document names no `_rev`). `None` when it does not apply, when the guard refuses (so
    /// that over a live document the answer stays the conflict a read first finds, as CouchDB
    /// answers before validating) or when the save answers a conflict (something is stored under
    /// the id): the caller then reads and applies as for any write, the guard asked again about
    /// the document as it is. The answer is the revision stored.
    async fn create_unread(&self, id: &str, writes: &[Write]) -> Result<Option<Vec<Result<Written>>>> {
        if !bulk::is_creation(writes) || !self.while_open(self.layout.creates_unread(id)).await? {
            return Ok(None);
        }
        // A new document's tree has one revision: no `_revs_limit` stems it.
        let Applied { tree, mut answers, changed } = self.applied(id, None, writes, usize::MAX).await?;
        if !changed || answers.iter().any(Result::is_err) {
            return Ok(None);
        }
        self.keep_references(None, &tree).await?;
        match self.save_answering(id, None, &tree, &mut answers).await {
            Ok(()) => {
                self.saved(id, None, &tree);
                Ok(Some(answers))
            }
            Err(err) if err.kind() == ErrorKind::Conflict => Ok(None),
            Err(err) => Err(err),
        }
    }

    /// `writes` applied in memory to the document's tree as read (`state`), after the write
    /// guard's verdicts: the tree to save, one answer per write, and whether the tree changed.
    async fn applied(
        &self,
        id: &str,
        state: Option<&DocState>,
        writes: &[Write],
        revs_limit: usize,
    ) -> Result<Applied> {
        let mut tree = state.map(|s| s.tree.clone()).unwrap_or_default();
        let mut refused = self.guard(id, state, writes).await?;
        for (write, refusal) in writes.iter().zip(refused.iter_mut()) {
            if let Err(err) = self.check_attachments_kept(write) {
                *refusal = Some(err);
            }
        }
        // Copied only when some are refused: a copy of every body was a twentieth of a
        // data-store `_bulk_docs` (issue 38).
        let allowed: std::borrow::Cow<'_, [Write]> = if refused.iter().all(Option::is_none) {
            std::borrow::Cow::Borrowed(writes)
        } else {
            writes.iter().zip(&refused).filter(|(_, refusal)| refusal.is_none()).map(|(w, _)| w.clone()).collect()
        };
        let mut applied = apply_all(id, &mut tree, &allowed, revs_limit)?.into_iter();
        let answers: Vec<Result<Written>> = refused
            .into_iter()
            .map(|refusal| match refusal {
                Some(err) => Err(err),
                None => {
                    applied.next().unwrap_or_else(|| Err(Error::new(ErrorKind::Internal, "a write was not answered")))
                }
            })
            .collect();
        let changed = answers.iter().any(|answer| {
            matches!(answer, Ok(Written::Edited(_)))
                || matches!(answer, Ok(Written::Merged(outcome)) if *outcome != MergeOutcome::AlreadyKnown)
        });
        if changed {
            tree.limit_inner_bodies(self.inner_bodies.max_revisions, self.inner_bodies.max_bytes);
            self.check_tree_size(id, state, &mut tree)?;
        }
        Ok(Applied { tree, answers, changed })
    }

    /// Refuses a tree past `couchdb_max_tree_bytes` (every read of the document would hold it),
    /// unless it is no larger than the tree read: a document stored before the bound, or under a
    /// larger one, can still be edited, deleted and purged down. Kept inner bodies give way
    /// first: a tree past the bound only because of them loses the oldest ones, as a compaction
    /// would, rather than refuse the write.
    fn check_tree_size(&self, id: &str, state: Option<&DocState>, tree: &mut RevTree) -> Result<()> {
        let mut held = tree.held_bytes();
        if held > self.max_tree_bytes {
            let excess = held - self.max_tree_bytes;
            tree.limit_inner_bodies(usize::MAX, tree.inner_held_bytes().saturating_sub(excess));
            held = tree.held_bytes();
        }
        if held <= self.max_tree_bytes || state.is_some_and(|state| held <= state.tree.held_bytes()) {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::TooLarge,
            format!(
                "the revision tree of {id:?} would hold about {held} bytes (its leaves' bodies and paths), more than \
                 couchdb_max_tree_bytes ({})",
                self.max_tree_bytes
            ),
        ))
    }

    /// What follows a successful save of `tree` over `before`: attachment bytes it no longer
    /// references are collected, and a design document's change reaches the write guard.
    fn saved(&self, id: &str, before: Option<&DocState>, tree: &RevTree) {
        if let Some(before) = before {
            self.collect_if_dropped(&before.tree, tree);
        }
        if let (true, Some(guard)) = (id.starts_with("_design/"), &self.write_guard) {
            guard.design_changed(self);
        }
    }

    /// Whether `state` is what a save cut short by a crash leaves: the document's tree written
    /// as its local tree record (the first write of a save from nothing or from a tombstone) but
    /// neither its live record nor a backend tombstone after it; or a live tree written as the
    /// local tree of a tombstone (a re-creation, whose record was to replace the tombstone: a
    /// deletion writes its local tree with the deleted winner). Such a document reads as it
    /// should but is missing from the change feed (and, when live, from `_all_docs`); writing it
    /// again (any write, or a replicated one of a leaf it has) repairs it.
    pub async fn half_written(&self, id: &str, state: Option<&DocState>) -> Result<bool> {
        match state {
            Some(state) => self.while_open(self.layout.unfinished(id, state)).await,
            None => Ok(false),
        }
    }

    /// Applies one write atomically against other writers; retries when another writer got in
    /// between the read and the save.
    pub async fn write(&self, id: &str, write: &Write) -> Result<Written> {
        let mut answers = self.write_batch(id, std::slice::from_ref(write)).await?;
        answers.pop().unwrap_or_else(|| Err(Error::new(ErrorKind::Internal, "a write was not answered")))
    }

    /// Removes leaves (`_purge`); returns the revisions purged. A document left with no leaf is
    /// erased from the backend.
    pub async fn purge(&self, id: &str, revs: &[String]) -> Result<Vec<String>> {
        let _under_way = self.start_write()?;
        let purged = self.while_open(self.purge_once_open(id, revs)).await?;
        if !purged.is_empty() {
            self.record_change();
        }
        Ok(purged)
    }

    async fn purge_once_open(&self, id: &str, revs: &[String]) -> Result<Vec<String>> {
        let _turn = self.write_lock(id).lock_owned().await;
        for _ in 0..MAX_TRIES {
            let Some(state) = self.read(id).await? else { return Ok(Vec::new()) };
            let mut tree = state.tree.clone();
            let purged = tree.purge(revs);
            if purged.is_empty() {
                return Ok(purged);
            }
            let saved = if tree.is_empty() {
                // Counted first, so a feed's rank never goes back with the erasure (`seq`).
                super::seq::count_erased(self.backend.as_ref(), self.local_names.erased).await?;
                self.erase(id, &state).await
            } else {
                self.keep_references(Some(&state), &tree).await?;
                self.save(id, Some(&state), &tree).await
            };
            match saved {
                Ok(()) => {
                    self.collect_if_dropped(&state.tree, &tree);
                    return Ok(purged);
                }
                Err(err) if err.kind() == ErrorKind::Conflict => continue,
                Err(err) => return Err(err),
            }
        }
        Err(Error::conflict(format!("purge of {id:?} kept meeting other writers; try again")))
    }

    /// Asks for a collection when `after` references fewer attachment bytes than `before` (a
    /// deleted document's, a removed attachment's, a purged leaf's).
    fn collect_if_dropped(&self, before: &RevTree, after: &RevTree) {
        let before = tree_references(before);
        if !before.is_empty() && !before.is_subset(&tree_references(after)) {
            self.collect_soon();
        }
    }

    /// Touches the manifests of the attachment bytes `tree` references before it is saved over
    /// `before`, so that a collection running meanwhile keeps them
    /// ([`AttachmentStore::keep_referenced`]; docs/attachments.md, "Why a reference is never
    /// freed"). Every save does it, not only those adding references: a save may move the tree
    /// between its record and its local tree, past a collection's scan.
    pub(super) async fn keep_references(&self, before: Option<&DocState>, tree: &RevTree) -> Result<()> {
        let referenced = tree_references(tree);
        if referenced.is_empty() || self.attachments_unsupported() {
            return Ok(());
        }
        let held = before.map(|state| tree_references(&state.tree)).unwrap_or_default();
        let new: HashSet<String> = referenced.difference(&held).cloned().collect();
        self.attachments.keep_referenced(&referenced, &new).await
    }

    /// [`Database::keep_references`] for many documents saved at once (`saves`: each one's state
    /// as read and the tree about to be saved over it): their manifests read in one batched read
    /// ([`AttachmentStore::keep_referenced_by_many`]), not one per document; one answer per
    /// document, in order. Issue 38: a `migrate` page's documents with attachments cost a
    /// manifest read each.
    pub(super) async fn keep_references_of_many(&self, saves: &[(Option<&DocState>, &RevTree)]) -> Vec<Result<()>> {
        if self.attachments_unsupported() {
            return saves.iter().map(|_| Ok(())).collect();
        }
        let documents: Vec<(HashSet<String>, HashSet<String>)> = saves
            .iter()
            .map(|(before, tree)| {
                let referenced = tree_references(tree);
                let held = match before {
                    Some(state) if !referenced.is_empty() => tree_references(&state.tree),
                    _ => HashSet::new(),
                };
                let new = referenced.difference(&held).cloned().collect();
                (referenced, new)
            })
            .collect();
        self.attachments.keep_referenced_by_many(&documents).await
    }

    /// Erases every trace of one document, and of no other (ids that start with it included),
    /// as its layout does ([`TreeLayout::erase`]): the authority for its tree last, so that a
    /// crash in between leaves the document as it was (the engine layout: a live record after
    /// the local tree, a deleted document's local tree after its tombstone; the data-store
    /// layout: the side document before the record).
    ///
    /// The view incarnation ends before the erasure, naming the purge, and after it: its feed
    /// entry gone, the document's rows would stay in an index built before for good, so a crash
    /// between the erasure and the second end must find the indexes of before already ended, and
    /// an index built meanwhile under an incarnation naming the purge ([`purge_views`];
    /// docs/design/crash-points.md).
    async fn erase(&self, id: &str, state: &DocState) -> Result<()> {
        self.begin_purge_for_views(id).await?;
        self.layout.erase(id, state).await?;
        self.end_purge_for_views(id).await
    }

    /// Saves `tree` over `state` with the backend's preconditions (`Conflict` if another writer
    /// got in first, and the caller reads again), as the database's layout writes it
    /// ([`RepairableLayout::save`]; the engine layout serializes every save on one
    /// compare-and-swap, the data-store layout on the record's and its side document's
    /// revisions).
    pub(super) async fn save(&self, id: &str, state: Option<&DocState>, tree: &RevTree) -> Result<()> {
        self.check_open()?;
        self.layout.save(id, state, tree).await
    }

    /// Saves `tree` over `state` as [`Database::save`] does, then answers each edit among
    /// `answers` with the revision the layout stored it as (the backend's own where it assigns
    /// revisions: [`super::layout::native`]).
    async fn save_answering(
        &self,
        id: &str,
        state: Option<&DocState>,
        tree: &RevTree,
        answers: &mut [Result<Written>],
    ) -> Result<()> {
        self.check_open()?;
        let edited: Vec<String> = answers
            .iter()
            .filter_map(|answer| match answer {
                Ok(Written::Edited(rev)) => Some(rev.clone()),
                _ => None,
            })
            .collect();
        let stored = self.layout.save_edited(id, state, tree, &edited).await?;
        for answer in answers.iter_mut() {
            if let Ok(Written::Edited(rev)) = answer {
                if let Some(stored) = stored.iter().find(|stored| stored.computed == *rev) {
                    *rev = stored.stored.clone();
                }
            }
        }
        Ok(())
    }

    /// One page of documents whose winner is live, in id order, with their trees.
    pub async fn all_docs(
        &self,
        range: &IdRange,
        limit: usize,
        token: Option<&str>,
    ) -> Result<Page<(String, DocState)>> {
        let (listed, next) = self.listed_page(range, limit, token).await?;
        let (cut_deletions, items): (Vec<_>, Vec<_>) = listed.into_iter().partition(|(_, state)| state.deleted());
        self.finish_cut_deletions(cut_deletions.iter().map(|(id, state)| (id.as_str(), state))).await;
        Ok(Page { items, next })
    }

    /// [`Database::all_docs`] as a listing with documents (and no query option on them) serves
    /// it, where the layout and the backend can: a data-store document with no other leaves as
    /// its record's text, listed from the records' stored text ([`Layout::listed_served`]);
    /// `None` elsewhere (the caller lists with [`Database::all_docs`]).
    pub async fn all_docs_served(
        &self,
        range: &IdRange,
        limit: usize,
        token: Option<&str>,
    ) -> Result<Option<Page<(String, Served<LayoutToken>)>>> {
        if !self.layout.lists_served() {
            return Ok(None);
        }
        let Some(page) = self.while_open(self.backend.all_docs_stored_text(range, limit, token)).await? else {
            return Ok(None);
        };
        let listed = self.while_open(async { self.layout.listed_served(page.items).await.transpose() }).await?;
        Ok(listed.map(|items| Page { items, next: page.next }))
    }

    /// One page of the backend's listing with each document's state: from the records' stored
    /// text where the layout and the backend can (the engine's records parsed straight into
    /// trees), else from the listed documents.
    async fn listed_page(
        &self,
        range: &IdRange,
        limit: usize,
        token: Option<&str>,
    ) -> Result<(Vec<(String, DocState)>, Option<String>)> {
        if self.layout.as_record().is_some() {
            if let Some(page) = self.while_open(self.backend.all_docs_stored_text(range, limit, token)).await? {
                if let Some(listed) = self.layout.listed_text(page.items) {
                    return Ok((listed?, page.next));
                }
            }
        }
        let page = self.while_open(self.backend.all_docs(range, limit, token)).await?;
        let listed = self.while_open(self.layout.listed(page.items)).await?;
        Ok((listed, page.next))
    }

    /// [`Database::all_docs`] with each listed document's whole tree: where the layout lists
    /// the winners alone ([`Layout::lists_whole_trees`]: the backend's own trees), the page's
    /// trees are read again (what `conflicts=true` shows).
    pub async fn all_docs_whole(
        &self,
        range: &IdRange,
        limit: usize,
        token: Option<&str>,
    ) -> Result<Page<(String, DocState)>> {
        let page = self.all_docs(range, limit, token).await?;
        if self.layout.lists_whole_trees() {
            return Ok(page);
        }
        let ids: Vec<String> = page.items.iter().map(|(id, _)| id.clone()).collect();
        let states = self.read_many(&ids).await?;
        let items = page.items.into_iter().zip(states).map(|((id, listed), whole)| (id, whole.unwrap_or(listed)));
        Ok(Page { items: items.filter(|(_, state)| !state.deleted()).collect(), next: page.next })
    }

    /// The database's settings (`_revs_limit`, `_security`, `_purged_infos_limit`).
    pub async fn settings(&self) -> Result<DbSettings> {
        let Some(stored) = self.while_open(self.backend.get_local(self.local_names.settings)).await? else {
            return Ok(DbSettings::default());
        };
        let revs_limit = stored
            .body
            .get("revs_limit")
            .and_then(Value::as_u64)
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(DEFAULT_REVS_LIMIT);
        let security = stored.body.get("security").cloned().unwrap_or_else(|| Value::Object(Map::new()));
        let purged_infos_limit =
            stored.body.get("purged_infos_limit").and_then(Value::as_u64).unwrap_or(DEFAULT_PURGED_INFOS_LIMIT);
        Ok(DbSettings { revs_limit, security, purged_infos_limit })
    }

    /// Changes the settings with `change`, against other writers of them.
    pub async fn update_settings(&self, change: impl Fn(&mut DbSettings)) -> Result<DbSettings> {
        for _ in 0..MAX_TRIES {
            let stored = self.while_open(self.backend.get_local(self.local_names.settings)).await?;
            let mut settings = self.settings().await?;
            change(&mut settings);
            let mut body = Map::new();
            body.insert("revs_limit".into(), Value::from(settings.revs_limit as u64));
            body.insert("security".into(), settings.security.clone());
            body.insert("purged_infos_limit".into(), Value::from(settings.purged_infos_limit));
            let precondition = match stored {
                Some(doc) => Precondition::MatchRevision(doc.rev),
                None => Precondition::MustNotExist,
            };
            match self.while_open(self.backend.put_local(self.local_names.settings, &body, precondition)).await {
                Ok(_) => {
                    self.remember_revs_limit(settings.revs_limit);
                    return Ok(settings);
                }
                Err(err) if err.kind() == ErrorKind::Conflict => continue,
                Err(err) => return Err(err),
            }
        }
        Err(Error::conflict("the database's settings kept changing under this write; try again"))
    }

    /// `_revs_limit` as the next write applies it. On a backend other processes write too
    /// ([`DocumentBackend::shared_with_other_processes`]: several instances over one DynamoDB
    /// table, say) it is read at every call, so that a limit set through any instance holds at
    /// the next write on every instance, as CouchDB applies it (issue 36); a single-document write
    /// reads it beside the document's state, at the same time, so the read costs a backend call
    /// but no wait, and `_bulk_docs` reads it once per request. On the embedded store, which one
    /// process holds alone, the value this process last read or wrote is kept.
    pub async fn revs_limit(&self) -> Result<usize> {
        if !self.backend.shared_with_other_processes() {
            if let Some(limit) = *self.cached_revs_limit() {
                return Ok(limit);
            }
        }
        let limit = self.settings().await?.revs_limit;
        Ok(self.remember_revs_limit(limit))
    }

    /// `_revs_limit` as writes apply it: [`Database::revs_limit`], except where every write is
    /// an ordinary edit (`edits_only`) and the backend stems edits itself
    /// ([`super::layout::Layout::edits_are_the_backends`]: the data-store database on CouchDB), where
    /// the limit changes nothing stored and is not read (no stemming in memory): one backend
    /// request less per write in front of CouchDB (issue 38). Replicated revisions, written with
    /// the paths the limit stems, read it as everywhere.
    pub(super) async fn revs_limit_for(&self, edits_only: bool) -> Result<usize> {
        if edits_only && self.layout.edits_are_the_backends() {
            return Ok(usize::MAX);
        }
        self.revs_limit().await
    }

    fn cached_revs_limit(&self) -> std::sync::MutexGuard<'_, Option<usize>> {
        self.revs_limit.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keeps `limit` (at least 1) as read or written now; answers it.
    fn remember_revs_limit(&self, limit: usize) -> usize {
        let limit = limit.max(1);
        *self.cached_revs_limit() = Some(limit);
        limit
    }
}

/// Whether a write of one document tries a creation without reading the document first
/// ([`Database::create_unread`]), or reads it whatever its writes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unread {
    Tried,
    Skipped,
}

/// Whether every write is a client's ordinary edit (none replicated).
fn edits_only(writes: &[Write]) -> bool {
    writes.iter().all(|write| matches!(write, Write::Edit { .. }))
}

/// Writes applied to a tree in memory, in order, one answer each. Replicated writes only (a
/// replicator's request) are merged in one rebuild of the tree ([`RevTree::merge_all`]).
fn apply_all(id: &str, tree: &mut RevTree, writes: &[Write], revs_limit: usize) -> Result<Vec<Result<Written>>> {
    let replicated: Option<Vec<_>> = writes
        .iter()
        .map(|write| match write {
            Write::Replicated { path, deleted, body } => Some((path, *deleted, body)),
            Write::Edit { .. } => None,
        })
        .collect();
    if let Some(replicated) = replicated {
        // Stubs are resolved against the tree as read; a write whose stub names nothing is
        // answered alone and left out of the merge.
        let mut answers: Vec<Option<Result<Written>>> = Vec::with_capacity(replicated.len());
        let mut paths = Vec::with_capacity(replicated.len());
        let mut slots = Vec::with_capacity(replicated.len());
        for (path, deleted, body) in replicated {
            match replicated_body(id, tree, path, body) {
                Ok(body) => {
                    slots.push(answers.len());
                    answers.push(None);
                    paths.push((path.clone(), deleted, body));
                }
                Err(err) => answers.push(Some(Err(err))),
            }
        }
        for (slot, outcome) in slots.into_iter().zip(tree.merge_all(paths, revs_limit)) {
            answers[slot] = Some(Ok(Written::Merged(outcome)));
        }
        return Ok(answers
            .into_iter()
            .map(|answer| {
                answer.unwrap_or_else(|| Err(Error::new(ErrorKind::Internal, "a replicated write was not answered")))
            })
            .collect());
    }
    Ok(writes.iter().map(|write| apply(id, tree, write, revs_limit)).collect())
}

/// A replicated revision's body with its attachments resolved: stubs against the nearest leaf
/// of the tree that is on the revision's path (CouchDB's replicated-update stub merge).
fn replicated_body(id: &str, tree: &RevTree, path: &RevPath, body: &Map<String, Value>) -> Result<Map<String, Value>> {
    let mut body = body.clone();
    if doc_attachments::has_attachments(&body) {
        let revs = path.revs();
        let ancestor = revs.iter().find_map(|rev| tree.leaf(rev));
        doc_attachments::resolve(id, &mut body, ancestor.map(|leaf| &leaf.body), path.start, true)?;
    }
    Ok(body)
}

/// An edit's body with its attachments resolved against the leaf it edits: the parent it names,
/// or for the re-creation of a deleted document, the deleted winner it extends.
fn edit_body(id: &str, tree: &RevTree, parent: Option<&str>, body: &Map<String, Value>) -> Result<Map<String, Value>> {
    let mut body = body.clone();
    if !doc_attachments::has_attachments(&body) {
        return Ok(body);
    }
    // An edit the tree refuses (a parent that is no leaf, no parent over a live document) is a
    // conflict before its stubs are looked at, as in CouchDB: it is left for `RevTree::edit`.
    let base = match parent {
        Some(_) if tree.is_deleted() => return Ok(body),
        Some(rev) => match tree.leaf(rev) {
            Some(leaf) => Some(leaf),
            None => return Ok(body),
        },
        None if tree.is_empty() => None,
        None if tree.is_deleted() => tree.winner(),
        None => return Ok(body),
    };
    // CouchDB gives new attachments the generation after the one the client named
    // (`couch_db:set_new_att_revpos`), before a re-creation is moved onto the deleted branch:
    // a re-created document's new attachments have `revpos` 1.
    let generation = parent.and_then(parse_rev).map_or(1, |(generation, _)| generation.saturating_add(1));
    doc_attachments::resolve(id, &mut body, base.map(|leaf| &leaf.body), generation, false)?;
    Ok(body)
}

/// One collection of a database's attachment bytes: what every stored tree references is the
/// layout's to find ([`super::layout::KeptBodies::attachment_references`]; nothing where it
/// keeps no bodies beyond the leaves').
async fn collect(layout: Arc<Layout>, store: AttachmentStore) -> Result<GarbageCollected> {
    store
        .collect_garbage(|| async move {
            match layout.kept_bodies() {
                Some(kept) => kept.attachment_references().await,
                None => Ok(HashSet::new()),
            }
        })
        .await
}

/// The SHA-256s the bodies `tree` keeps reference: its leaves' and its kept inner revisions'.
fn tree_references(tree: &RevTree) -> HashSet<String> {
    let mut referenced = HashSet::new();
    for body in tree.bodies() {
        doc_attachments::referenced(body, &mut referenced);
    }
    referenced
}

/// One write applied to a tree in memory: an edit's new revision (or its conflict), a merge's
/// outcome.
fn apply(id: &str, tree: &mut RevTree, write: &Write, revs_limit: usize) -> Result<Written> {
    let (Write::Edit { body, .. } | Write::Replicated { body, .. }) = write;
    // Within the depth the stored record (the tree around the body) reads back at.
    check_document_depth(body)?;
    match write {
        Write::Edit { parent, deleted, body } => {
            let body = edit_body(id, tree, parent.as_deref(), body)?;
            // A re-creation of a deleted document extends the deleted winner, so CouchDB
            // computes its id from that revision (and its attachments as it sees them then).
            let recreated = match parent {
                Some(_) => None,
                None => tree.is_deleted().then(|| tree.winner().map(|leaf| leaf.rev())).flatten(),
            };
            let computed = match &recreated {
                Some(deleted_winner) => Some(rev_id::recreation_rev_id(deleted_winner, &body)),
                None => rev_id::edit_rev_id(parent.as_deref(), *deleted, &body),
            };
            let new_id = match computed {
                Some(computed) => computed,
                None => hex::encode(random_token()?),
            };
            tree.edit(parent.as_deref(), &new_id, *deleted, body, revs_limit)
                .map(Written::Edited)
                .map_err(|EditError::Conflict| Error::conflict("Document update conflict."))
        }
        Write::Replicated { path, deleted, body } => {
            let body = replicated_body(id, tree, path, body)?;
            Ok(Written::Merged(tree.merge(path.clone(), *deleted, body, revs_limit)))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use super::*;
    use crate::backend::embedded::EmbeddedBackend;
    use crate::backend::Revision;

    fn replicated(start: u64, ids: &[&str], deleted: bool) -> Write {
        let path = RevPath { start, ids: ids.iter().map(|id| (*id).to_owned()).collect() };
        Write::Replicated { path, deleted, body: Map::new() }
    }

    /// The embedded store as a backend that other processes share (which it is not: its file is
    /// locked), so that two `Database`s over it behave as two instances over DynamoDB do.
    struct SharedLike(Arc<dyn DocumentBackend>);

    #[async_trait::async_trait]
    impl crate::backend::raw::layer::Layered for SharedLike {
        fn inner(&self) -> &dyn DocumentBackend {
            self.0.as_ref()
        }

        fn shared_with_other_processes(&self) -> bool {
            true
        }
    }

    /// Two instances over one backend (issue 36): a `_revs_limit` set through one is applied by
    /// the other's very next write, with no wait.
    #[tokio::test]
    async fn a_revs_limit_set_by_another_instance_holds_at_the_next_write() {
        let dir = tempfile::tempdir().unwrap();
        let embedded: Arc<dyn DocumentBackend> =
            Arc::new(EmbeddedBackend::open(&dir.path().join("d.redb")).await.unwrap());
        let backend: Arc<dyn DocumentBackend> = Arc::new(SharedLike(embedded));
        let here = Database::new("d".into(), Arc::clone(&backend));
        let there = Database::new("d".into(), Arc::clone(&backend));
        let edit = |parent: Option<String>| Write::Edit { parent, deleted: false, body: Map::new() };
        let Written::Edited(mut rev) = here.write("x", &edit(None)).await.unwrap() else { panic!("an edit") };
        assert_eq!(here.revs_limit().await.unwrap(), DEFAULT_REVS_LIMIT);
        there.update_settings(|settings| settings.revs_limit = 2).await.unwrap();
        for _ in 0..4 {
            let Written::Edited(next) = here.write("x", &edit(Some(rev))).await.unwrap() else { panic!("an edit") };
            rev = next;
        }
        let state = here.read("x").await.unwrap().expect("written");
        let winner = state.tree.winner().expect("a winner");
        assert_eq!(winner.path.ids.len(), 2, "the writes stem to the limit set through the other instance");
    }

    /// On the embedded store, which one process holds alone, the limit this process read or
    /// set is kept rather than read at every write.
    #[tokio::test]
    async fn an_unshared_backend_keeps_its_revs_limit() {
        let dir = tempfile::tempdir().unwrap();
        let backend: Arc<dyn DocumentBackend> =
            Arc::new(EmbeddedBackend::open(&dir.path().join("d.redb")).await.unwrap());
        let database = Database::new("d".into(), Arc::clone(&backend));
        database.update_settings(|settings| settings.revs_limit = 7).await.unwrap();
        let other = Database::new("d".into(), Arc::clone(&backend));
        other.update_settings(|settings| settings.revs_limit = 3).await.unwrap();
        assert_eq!(database.revs_limit().await.unwrap(), 7, "kept: no other process writes this file");
    }

    /// A backend on which, just before the next create of a record, another writer reads the
    /// local tree that write put first, carries it on with a deletion of its leaf and saves
    /// it (a tombstone).
    struct DeletedMeanwhile {
        inner: Arc<dyn DocumentBackend>,
        armed: AtomicBool,
    }

    #[async_trait::async_trait]
    impl crate::backend::raw::layer::Layered for DeletedMeanwhile {
        fn inner(&self) -> &dyn DocumentBackend {
            self.inner.as_ref()
        }

        async fn put(&self, id: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision> {
            if self.armed.swap(false, Ordering::SeqCst) {
                let other = Database::new("other".into(), Arc::clone(&self.inner));
                other.write(id, &replicated(2, &["b", "a"], true)).await?;
            }
            self.inner.put(id, body, precondition).await
        }
    }

    fn edit(parent: Option<&str>, filler: usize) -> Write {
        let mut body = Map::new();
        body.insert("filler".into(), Value::from("x".repeat(filler)));
        Write::Edit { parent: parent.map(str::to_owned), deleted: false, body }
    }

    /// A tree past `couchdb_max_tree_bytes` only because of its kept inner bodies loses the
    /// oldest of them instead of refusing the write; a leaf alone past it is still refused.
    #[tokio::test]
    async fn kept_inner_bodies_give_way_to_the_tree_bound() {
        let dir = tempfile::tempdir().unwrap();
        let backend: Arc<dyn DocumentBackend> =
            Arc::new(EmbeddedBackend::open(&dir.path().join("d.redb")).await.unwrap());
        let database = Database::new("d".into(), backend)
            .with_max_tree_bytes(3_500)
            .with_inner_body_bounds(InnerBodyBounds { max_revisions: 100, max_bytes: usize::MAX });
        let mut revs = Vec::new();
        let mut parent: Option<String> = None;
        for _ in 0..4 {
            let Written::Edited(rev) = database.write("x", &edit(parent.as_deref(), 1_000)).await.unwrap() else {
                panic!("an edit answers its revision");
            };
            parent = Some(rev.clone());
            revs.push(rev);
        }
        let state = database.read("x").await.unwrap().expect("written");
        assert!(state.tree.held_bytes() <= 3_500, "{} bytes held", state.tree.held_bytes());
        assert!(state.tree.revision(&revs[0]).is_none(), "the oldest inner body went");
        assert!(state.tree.revision(&revs[2]).is_some(), "the newest inner body stays");
        let refused = database.write("x", &edit(parent.as_deref(), 4_000)).await.unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::TooLarge);
    }

    /// A creation on the embedded store (a backend checking `NeverWritten`) is one read, of the
    /// local tree a save cut short would have left, and one write, the record, in one commit
    /// (issue 38: the record and the local tree were read, and the local tree written before
    /// the record, two fsync'd commits); it leaves no local tree behind, and reads back, in the
    /// feed and `_all_docs`.
    #[tokio::test]
    async fn a_creation_is_one_read_and_one_write() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(EmbeddedBackend::open(&dir.path().join("d.redb")).await.unwrap());
        let counting = super::counting::CountingBackend::over(Arc::clone(&store) as Arc<dyn DocumentBackend>, false);
        let database = Database::new("d".into(), counting.clone());
        database.write("first", &edit(None, 10)).await.unwrap();
        counting.taken();
        let before = store.write_transactions();
        let Written::Edited(rev) = database.write("x", &edit(None, 10)).await.unwrap() else { panic!("an edit") };
        assert_eq!(counting.taken(), ["get_local", "put"], "one read (the local tree), one write (the record)");
        assert_eq!(store.write_transactions() - before, 1, "one commit");
        assert!(store.get_local(&format!("{TREE_PREFIX}x")).await.unwrap().is_none(), "no local tree left");
        let state = database.read("x").await.unwrap().expect("written");
        assert_eq!(state.winner_rev(), Some(rev));
        let listed = database.all_docs(&IdRange::default(), 10, None).await.unwrap();
        assert_eq!(listed.items.iter().map(|(id, _)| id.as_str()).collect::<Vec<_>>(), ["first", "x"]);
        let fed: Vec<String> = store.changes(None, 10).await.unwrap().changes.into_iter().map(|c| c.id).collect();
        assert_eq!(fed, ["first", "x"]);
        // Over a live document the creation is the conflict a read finds, after the read.
        let refused = database.write("x", &edit(None, 10)).await.unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::Conflict);
        // Over a tombstone it extends the deleted branch, as in CouchDB.
        let state = database.read("x").await.unwrap().expect("written");
        let deletion = Write::Edit { parent: state.winner_rev(), deleted: true, body: Map::new() };
        database.write("x", &deletion).await.unwrap();
        let Written::Edited(again) = database.write("x", &edit(None, 10)).await.unwrap() else { panic!("an edit") };
        assert!(again.starts_with("3-"), "{again}");
    }

    /// A page of the data-store database's `_all_docs` reads each document's revisions and
    /// other leaves, but not its body again: the listing's own body is used (issue 38: every
    /// body was decoded twice); a document written between the listing and that read is read
    /// again as it is now.
    #[tokio::test]
    async fn a_data_store_listing_reads_no_body_twice() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn DocumentBackend> =
            Arc::new(EmbeddedBackend::open(&dir.path().join("ds.redb")).await.unwrap());
        let counting = super::counting::CountingBackend::over(Arc::clone(&store), false);
        let database = Database::data_store("agent_data_store".into(), counting.clone()).unwrap();
        for n in 0..5u64 {
            let mut body = Map::new();
            body.insert("n".into(), n.into());
            database.write(&format!("u:ns:k{n}"), &Write::Edit { parent: None, deleted: false, body }).await.unwrap();
        }
        counting.taken();
        let listed = database.all_docs(&IdRange::default(), 10, None).await.unwrap();
        let calls = counting.taken_counts();
        assert_eq!(calls.get("get_many"), None, "{calls:?}");
        assert_eq!(calls.get("get"), None, "{calls:?}");
        assert_eq!(listed.items.len(), 5);
        for (n, (id, state)) in listed.items.iter().enumerate() {
            assert_eq!(id, &format!("u:ns:k{n}"));
            let winner = state.tree.winner().expect("a leaf");
            assert_eq!(winner.body.get("n"), Some(&Value::from(n as u64)), "{id}: the listed body");
            assert_eq!(state.tree, database.read(id).await.unwrap().expect("stored").tree);
        }
    }

    /// A save from nothing cut short after its local tree (no record: written by a backend that
    /// does not check `NeverWritten`, or a release before issue 38) reads back, and a creation
    /// of the same id is refused as over any live document, never written over it unread.
    #[tokio::test]
    async fn a_creation_over_a_save_cut_short_is_a_conflict() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn DocumentBackend> =
            Arc::new(EmbeddedBackend::open(&dir.path().join("d.redb")).await.unwrap());
        let cut = Database::new("d".into(), super::counting::CountingBackend::over(Arc::clone(&store), true));
        assert!(cut.write("x", &edit(None, 10)).await.is_err(), "cut before the record");
        let database = Database::new("d".into(), Arc::clone(&store));
        let state = database.read("x").await.unwrap().expect("the cut save reads back");
        assert!(database.half_written("x", Some(&state)).await.unwrap());
        let refused = database.write("x", &edit(None, 10)).await.unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::Conflict, "the cut save's document stands");
        assert_eq!(database.read("x").await.unwrap().expect("still there").winner_rev(), state.winner_rev());
    }

    /// A write from nothing overtaken between its local tree and its record by a writer that
    /// deleted what it wrote does not create its record over that tombstone: it reads again,
    /// and the deletion stands.
    #[tokio::test]
    async fn a_creation_overtaken_by_a_deletion_does_not_undo_it() {
        let dir = tempfile::tempdir().unwrap();
        let inner: Arc<dyn DocumentBackend> =
            Arc::new(EmbeddedBackend::open(&dir.path().join("d.redb")).await.unwrap());
        let layer = Arc::new(DeletedMeanwhile { inner, armed: AtomicBool::new(true) });
        let database = Database::new("d".into(), layer.clone());
        database.write("x", &replicated(1, &["a"], false)).await.unwrap();
        assert!(!layer.armed.load(Ordering::SeqCst), "the other writer wrote");
        let state = database.read("x").await.unwrap().expect("written");
        assert!(state.deleted(), "the deletion stands: {:?}", state.tree.leaves());
        assert_eq!(state.winner_rev().as_deref(), Some("2-b"));
    }
}
