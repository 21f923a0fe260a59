//! [`DataStore`]: the data-store semantics, written once for every backend.
//!
//! `set`, access-counting `get` and `delete` are read-modify-write cycles guarded by the backend's
//! revision precondition. Inside one process, cycles on one document id never compete: they wait
//! their turn in a per-id queue ([`WriteQueues`]), so a hot key costs queueing, not conflicts.
//! Writers in other processes can still get in between; then the backend reports a conflict and
//! the cycle starts again from a fresh read, with jittered exponential backoff, a bounded number
//! of times. That is why N concurrent `set`/`get` calls on one key raise `accessCount` by exactly
//! N and lose no metadata key.
//!
//! A call may have a deadline ([`StoreOptions::deadline`]). It is checked while waiting for the
//! turn, before each attempt and before each write is sent, never while a write is in flight: a
//! call that passes its deadline fails with [`ErrorKind::DeadlineExceeded`] and is then known to
//! have applied nothing, while a write already sent is awaited and its real outcome reported.

use std::collections::{BTreeSet, HashMap};
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use serde_json::{Map, Value};
use tokio::sync::{OnceCell, OwnedMutexGuard};
use tokio::time::Instant;

use crate::backend::rev_tree::RevTree;
use crate::backend::{
    DocumentBackend, IdRange, Precondition, Projection, Query, ReplicatedOutcome, ReplicatedRevision, Revision,
    StoredDocument, LOCAL_PREFIX,
};
use crate::database::layout::{data_store, DESIGN_SIDE_PREFIX};
use crate::database::{Database, Write};
use crate::error::{Error, ErrorKind, Result};
use crate::model::document::{self, Access};
use crate::model::{fields, timestamp, DocumentId};

/// The local document naming the incarnation of the data-store database's view indexes (where this
/// process builds them: `crate::database::Database::kept_views_incarnation`). `purge_user` removes it,
/// which ends every index built over documents it erased (docs/design-documents.md).
pub const VIEWS_INCARNATION_DOC: &str = ":views:incarnation";
/// How often ending the views' incarnation is tried when another process replaces it meanwhile.
const INCARNATION_END_ATTEMPTS: usize = 5;
/// How many namespaces the "already indexed" cache remembers before it starts over. Ensuring is
/// idempotent, so forgetting costs one extra index call, never correctness.
/// Passes of count-then-erase an erasure makes before it reports that documents keep being
/// listed (a loop that could otherwise run forever).
const PURGE_PASSES: usize = 20;
const ENSURED_NAMESPACES_CAP: usize = 100_000;
/// How many deletes of one listing page run at once.
const DELETE_CONCURRENCY: usize = 8;
/// Largest page `get_all_pages` asks for: values can be 1 MiB each.
const GET_ALL_PAGE_SIZE: usize = 100;
/// Shards of the per-document write queues: the map lock is held for a hash lookup only, and
/// sharding keeps unrelated documents from even meeting there.
const WRITE_QUEUE_SHARDS: usize = 64;
/// Backoff between attempts after a conflict with another process: from 2 ms, doubling, up to
/// this ceiling. Measured with the hot-key bench (two processes, 32 writers on one key): a 250 ms
/// ceiling let the process that lost a conflict sleep while the other ran its whole queue, and
/// doubled the p99 on pouchdb-server against 50 ms.
const CONFLICT_BACKOFF_MAX: Duration = Duration::from_millis(50);

/// A caller's own precondition on a write (HTTP `If-Match` / `If-None-Match`). With anything but
/// `Any` the write is attempted once: a mismatch is the caller's conflict to resolve, not ours.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Expect {
    /// No precondition: conflicts with concurrent writers are retried.
    #[default]
    Any,
    /// The document must exist (`If-Match: *`).
    Exists,
    /// The document must not exist (`If-None-Match: *`).
    Absent,
    /// The document must be at this revision.
    Revision(Revision),
}

/// How [`DataStore::set_with`] writes, beside which document and value (object_store's
/// `PutOptions` style): the default is a plain [`DataStore::set`] with no metadata, no agent and
/// no precondition.
#[derive(Debug, Clone, Default)]
pub struct SetOptions<'a> {
    /// Merged shallowly into the stored metadata; must be a JSON object.
    pub metadata: Option<Value>,
    /// The agent the write is counted against.
    pub agent: Option<&'a str>,
    /// The caller's precondition; a mismatch is a `Conflict`.
    pub expect: Expect,
}

/// A stream of listing pages, each already checked out of the backend.
pub type PageStream<T> = BoxStream<'static, Result<Vec<T>>>;

/// Behaviour of the facade, declared beside the settings it is made from (so that the settings
/// need not import the facade, which imports the engine's data-store layout).
pub use crate::config::StoreOptions;

/// The data store over one backend.
pub struct DataStore {
    backend: Arc<dyn DocumentBackend>,
    options: StoreOptions,
    ensured_namespaces: Mutex<HashMap<String, Arc<OnceCell<()>>>>,
    write_queues: WriteQueues,
}

/// When one facade call must give up, if ever.
#[derive(Debug, Clone, Copy)]
struct Deadline(Option<Instant>);

impl Deadline {
    fn after(limit: Option<Duration>) -> Self {
        Deadline(limit.map(|limit| Instant::now() + limit))
    }

    /// No deadline: for calls that may apply part of their work before failing (bulk deletes),
    /// where "gave up, nothing applied" could not be promised.
    fn none() -> Self {
        Deadline(None)
    }

    /// Fails if the deadline has passed. Call only where nothing of the current attempt was sent.
    fn check(&self, id: &str) -> Result<()> {
        match self.0 {
            Some(at) if Instant::now() >= at => Err(Self::exceeded(id)),
            _ => Ok(()),
        }
    }

    /// Whether sleeping `delay` still leaves the deadline ahead.
    fn allows_sleep(&self, delay: Duration) -> bool {
        self.0.is_none_or(|at| Instant::now() + delay < at)
    }

    fn exceeded(id: &str) -> Error {
        Error::new(
            ErrorKind::DeadlineExceeded,
            format!("gave up on document {id:?} before the next attempt: the request's deadline passed; nothing was applied"),
        )
    }
}

/// One FIFO queue per document id with a read-modify-write in flight in this process. An entry
/// lives only while some call holds or waits for its turn, so the map is bounded by the calls in
/// flight, not by the number of documents ever written.
struct WriteQueues {
    hasher: std::collections::hash_map::RandomState,
    shards: Vec<Mutex<HashMap<String, QueueEntry>>>,
}

/// A document's queue and how many calls hold or wait for a turn on it. The count, kept under the
/// shard lock, decides when the entry goes: an `Arc` count could not, since a cancelled wait's
/// lock future may still hold a clone when its turn is dropped.
struct QueueEntry {
    queue: Arc<tokio::sync::Mutex<()>>,
    users: usize,
}

/// A call's turn on one document: held while it reads, modifies and writes. Dropping it (also
/// when the call is cancelled or gives up waiting) lets the next waiter in and forgets an idle
/// queue.
struct Turn<'a> {
    queues: &'a WriteQueues,
    id: String,
    guard: Option<OwnedMutexGuard<()>>,
}

impl WriteQueues {
    fn new() -> Self {
        WriteQueues {
            hasher: std::collections::hash_map::RandomState::new(),
            shards: (0..WRITE_QUEUE_SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
        }
    }

    fn shard(&self, id: &str) -> std::sync::MutexGuard<'_, HashMap<String, QueueEntry>> {
        let shard = &self.shards[(self.hasher.hash_one(id) as usize) % self.shards.len()];
        shard.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for the turn on `id` (first come, first served) until `deadline`.
    async fn turn(&self, id: &str, deadline: Deadline) -> Result<Turn<'_>> {
        let queue = {
            let mut shard = self.shard(id);
            let entry = shard.entry(id.to_owned()).or_insert_with(|| QueueEntry { queue: Arc::default(), users: 0 });
            entry.users += 1;
            Arc::clone(&entry.queue)
        };
        // From here on, dropping `turn` gives the place in the queue back.
        let mut turn = Turn { queues: self, id: id.to_owned(), guard: None };
        let guard = match deadline.0 {
            None => queue.lock_owned().await,
            Some(at) => tokio::time::timeout_at(at, queue.lock_owned()).await.map_err(|_| Deadline::exceeded(id))?,
        };
        turn.guard = Some(guard);
        Ok(turn)
    }

    /// How many documents have a queue right now (tests check that idle queues are forgotten).
    fn len(&self) -> usize {
        self.shards.iter().map(|shard| shard.lock().unwrap_or_else(|e| e.into_inner()).len()).sum()
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut shard = self.queues.shard(&self.id);
        if let Some(entry) = shard.get_mut(&self.id) {
            entry.users -= 1;
            if entry.users == 0 {
                shard.remove(&self.id);
            }
        }
    }
}

impl DataStore {
    /// Wraps `backend` and ensures its standard indexes (the startup step of the spec).
    pub async fn open(backend: Arc<dyn DocumentBackend>, options: StoreOptions) -> Result<Self> {
        backend.ensure_standard_indexes().await?;
        // The data-store database's design documents as records, where a previous release kept
        // them as local documents (`crate::upgrade`, which does the same every run); once per
        // store, not at every open (a scan of local documents). Not a reason to refuse
        // the data: a failure leaves them where they are for the next open or `upgrade`.
        if let Err(err) = move_data_store_design_documents_once(&backend).await {
            tracing::warn!(error = %err, "design documents of the data-store database not moved into records yet");
        }
        Ok(DataStore {
            backend,
            options,
            ensured_namespaces: Mutex::new(HashMap::new()),
            write_queues: WriteQueues::new(),
        })
    }

    pub fn backend(&self) -> &Arc<dyn DocumentBackend> {
        &self.backend
    }

    pub fn options(&self) -> &StoreOptions {
        &self.options
    }

    fn id(&self, user_id: &str, namespace: &str, key: &str) -> Result<DocumentId> {
        DocumentId::new(user_id, namespace, key, &self.options.limits)
    }

    fn access<'a>(&self, agent: Option<&'a str>) -> Result<Access<'a>> {
        if let Some(agent) = agent {
            self.options.limits.check_agent(agent)?;
        }
        Ok(Access { agent, at: timestamp::now() })
    }

    /// How many read-modify-write queues exist now: one per document with a call in flight.
    pub fn write_queue_count(&self) -> usize {
        self.write_queues.len()
    }

    fn retry_policy(&self) -> ExponentialBuilder {
        ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(2))
            .with_max_delay(CONFLICT_BACKOFF_MAX)
            .with_max_times(self.options.max_conflict_retries)
            .with_jitter()
    }

    /// Runs a read-modify-write cycle until it does not conflict, the retries run out, or the
    /// deadline would pass before the next attempt.
    async fn retry_conflicts<T, F, Fut>(&self, id: &DocumentId, deadline: Deadline, mut attempt: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let mut delays = self.retry_policy().build();
        loop {
            deadline.check(id.as_str())?;
            let conflict = match attempt().await {
                Err(e) if e.is_conflict() => e,
                done => return done,
            };
            match delays.next() {
                Some(delay) if deadline.allows_sleep(delay) => tokio::time::sleep(delay).await,
                Some(_) => return Err(Deadline::exceeded(id.as_str()).with_source(conflict)),
                None => {
                    return Err(Error::conflict(format!(
                        "document {id} kept changing under concurrent writers; gave up after {} retries",
                        self.options.max_conflict_retries
                    ))
                    .with_source(conflict))
                }
            }
        }
    }

    /// Ensures the backend's index covers `namespace`, once per namespace per process; concurrent
    /// first writes to one namespace share one call.
    async fn ensure_namespace(&self, namespace: &str) -> Result<()> {
        let cell = {
            let mut ensured = self.ensured_namespaces.lock().unwrap_or_else(|e| e.into_inner());
            if ensured.len() >= ENSURED_NAMESPACES_CAP && !ensured.contains_key(namespace) {
                ensured.clear();
            }
            Arc::clone(ensured.entry(namespace.to_owned()).or_default())
        };
        cell.get_or_try_init(|| self.backend.ensure_namespace_indexed(namespace)).await.map(|_| ())
    }

    /// Writes a whole document as a client of a document protocol sent it (the CouchDB API):
    /// the data-store limits checked, its namespace indexed before its first write, then written
    /// under `precondition`. No access is counted: the client writes every field itself.
    pub async fn put_document(
        &self,
        id: &DocumentId,
        body: &Map<String, Value>,
        precondition: Precondition,
    ) -> Result<Revision> {
        self.check_document(body)?;
        self.ensure_namespace(id.namespace()).await?;
        self.backend.put(id.as_str(), body, precondition).await
    }

    /// [`DataStore::put_document`] for many documents: one result per write, in order. A write
    /// that breaks a limit fails alone; the others are sent as one bulk request.
    pub async fn put_documents(
        &self,
        writes: Vec<(DocumentId, Map<String, Value>, Precondition)>,
    ) -> Result<Vec<Result<Revision>>> {
        let mut results: Vec<Option<Result<Revision>>> = Vec::with_capacity(writes.len());
        let mut valid = Vec::new();
        let mut namespaces = BTreeSet::new();
        for (id, body, precondition) in writes {
            match self.check_document(&body) {
                Ok(()) => {
                    namespaces.insert(id.namespace().to_owned());
                    valid.push(crate::backend::BulkWrite { id: id.as_str().to_owned(), body, precondition });
                    results.push(None);
                }
                Err(err) => results.push(Some(Err(err))),
            }
        }
        for namespace in &namespaces {
            self.ensure_namespace(namespace).await?;
        }
        let mut written = if valid.is_empty() { Vec::new() } else { self.backend.bulk_write(valid).await? }.into_iter();
        results
            .into_iter()
            .map(|slot| match slot {
                Some(result) => Ok(result),
                None => written.next().ok_or_else(|| {
                    Error::new(ErrorKind::Internal, "the backend answered fewer writes than it was sent")
                }),
            })
            .collect()
    }

    /// Writes a revision made elsewhere, with its history, as a replicator sends it (CouchDB's
    /// `new_edits: false`): the limits checked and the namespace indexed as for any write, then
    /// the backend decides by the stored revisions (see [`DocumentBackend::put_replicated`]).
    pub async fn put_replicated(&self, id: &DocumentId, incoming: &ReplicatedRevision) -> Result<ReplicatedOutcome> {
        // A deletion's fields are kept in its tombstone: within the same limits.
        self.check_document(&incoming.body)?;
        if !incoming.deleted {
            self.ensure_namespace(id.namespace()).await?;
        }
        // Every branch is kept: a revision that loses to the winner stays as a conflict.
        data_store::put_branch(self.backend.as_ref(), id.as_str(), incoming, self.options.max_tree_bytes).await
    }

    /// The limits a whole document must meet: its `value` and `metadata` within the size limit,
    /// the whole within the nesting depth.
    fn check_document(&self, body: &Map<String, Value>) -> Result<()> {
        crate::model::depth::check_document_depth(body)?;
        if let Some(value) = body.get(fields::VALUE) {
            self.options.limits.check_value(value)?;
        }
        if let Some(metadata) = body.get(fields::METADATA).filter(|m| !m.is_null()) {
            self.options.limits.check_metadata(metadata)?;
        }
        Ok(())
    }

    /// Creates or updates a document: `value` replaced, `metadata` merged shallowly into what is
    /// stored, the write counted as an access. Returns the stored document.
    pub async fn set(
        &self,
        user_id: &str,
        namespace: &str,
        key: &str,
        value: Value,
        metadata: Option<Value>,
        agent: Option<&str>,
    ) -> Result<StoredDocument> {
        self.set_with(user_id, namespace, key, value, SetOptions { metadata, agent, expect: Expect::Any }).await
    }

    /// [`DataStore::set`] with its [`SetOptions`]: under the caller's precondition `expect`, a
    /// mismatch is a `Conflict`.
    pub async fn set_with(
        &self,
        user_id: &str,
        namespace: &str,
        key: &str,
        value: Value,
        options: SetOptions<'_>,
    ) -> Result<StoredDocument> {
        let SetOptions { metadata, agent, expect } = options;
        let id = self.id(user_id, namespace, key)?;
        self.options.limits.check_value(&value)?;
        let metadata = match metadata {
            None => None,
            Some(metadata) => {
                self.options.limits.check_metadata(&metadata)?;
                match metadata {
                    Value::Object(map) => Some(map),
                    _ => return Err(Error::invalid("metadata", "must be a JSON object")),
                }
            }
        };
        self.access(agent)?;
        let deadline = Deadline::after(self.options.deadline);
        self.ensure_namespace(namespace).await?;
        let _turn = self.write_queues.turn(id.as_str(), deadline).await?;
        // The value moves into the body, and back out of it when the write fails, so a retry
        // reuses it instead of every attempt holding its own copy of a possibly large tree.
        let value_slot = std::sync::Mutex::new(Some(value));
        let attempt = || async {
            let access = self.access(agent)?;
            let existing = self.backend.get(id.as_str()).await?;
            check_expectation(&id, &expect, existing.as_ref())?;
            deadline.check(id.as_str())?;
            let value = value_slot
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
                .ok_or_else(|| Error::new(ErrorKind::Internal, format!("the value of a write to {id} was lost")))?;
            let (mut body, precondition) = match existing {
                None => (document::new_body(&id, value, metadata.clone(), &access), Precondition::MustNotExist),
                Some(existing) => {
                    let mut body = existing.body;
                    document::apply_update(&id, &mut body, value, metadata.clone(), &access)?;
                    (body, Precondition::MatchRevision(existing.rev))
                }
            };
            match self.backend.put(id.as_str(), &body, precondition).await {
                Ok(rev) => Ok(StoredDocument { id: id.as_str().to_owned(), rev, body }),
                Err(err) => {
                    *value_slot.lock().unwrap_or_else(|e| e.into_inner()) = body.remove(fields::VALUE);
                    Err(err)
                }
            }
        };
        if expect == Expect::Any {
            self.retry_conflicts(&id, deadline, attempt).await
        } else {
            deadline.check(id.as_str())?;
            attempt().await
        }
    }

    /// The stored document, or `None`. Unless reads are configured not to write, the read counts
    /// as an access and the returned document already includes it.
    pub async fn get(
        &self,
        user_id: &str,
        namespace: &str,
        key: &str,
        agent: Option<&str>,
    ) -> Result<Option<StoredDocument>> {
        let id = self.id(user_id, namespace, key)?;
        self.access(agent)?;
        if !self.options.track_reads {
            return self.backend.get(id.as_str()).await;
        }
        let deadline = Deadline::after(self.options.deadline);
        let _turn = self.write_queues.turn(id.as_str(), deadline).await?;
        self.retry_conflicts(&id, deadline, || async {
            let Some(existing) = self.backend.get(id.as_str()).await? else {
                return Ok(None);
            };
            deadline.check(id.as_str())?;
            let mut body = existing.body;
            let access = self.access(agent)?;
            document::record_access(id.as_str(), &mut body, &access)?;
            let rev = self.backend.put(id.as_str(), &body, Precondition::MatchRevision(existing.rev)).await?;
            Ok(Some(StoredDocument { id: id.as_str().to_owned(), rev, body }))
        })
        .await
    }

    /// Whether the document exists. Not counted as an access.
    pub async fn exists(&self, user_id: &str, namespace: &str, key: &str) -> Result<bool> {
        Ok(self.peek(user_id, namespace, key).await?.is_some())
    }

    /// The stored document without counting an access (for existence checks and revisions).
    pub async fn peek(&self, user_id: &str, namespace: &str, key: &str) -> Result<Option<StoredDocument>> {
        let id = self.id(user_id, namespace, key)?;
        self.backend.get(id.as_str()).await
    }

    /// Deletes the document; `false` when there was none.
    pub async fn delete(&self, user_id: &str, namespace: &str, key: &str) -> Result<bool> {
        Ok(self.delete_with(user_id, namespace, key, Expect::Any).await?.is_some())
    }

    /// [`DataStore::delete`] under the caller's precondition (`Exists` or `Revision`); a mismatch
    /// is a `Conflict`, tried once. Returns the tombstone's revision; `None` when there was no
    /// document.
    pub async fn delete_with(
        &self,
        user_id: &str,
        namespace: &str,
        key: &str,
        expect: Expect,
    ) -> Result<Option<Revision>> {
        let id = self.id(user_id, namespace, key)?;
        let deadline = Deadline::after(self.options.deadline);
        let _turn = self.write_queues.turn(id.as_str(), deadline).await?;
        let existing = self.backend.get(id.as_str()).await?;
        check_expectation(&id, &expect, existing.as_ref())?;
        deadline.check(id.as_str())?;
        match (existing, expect) {
            (None, _) => Ok(None),
            (Some(doc), Expect::Any) => self.delete_document(doc, deadline).await,
            (Some(doc), _) => match self.delete_other_leaves(&doc.id).await.and(Ok(())) {
                Err(e) => Err(e),
                Ok(()) => match self.backend.delete(&doc.id, &doc.rev).await {
                    Ok(tombstone) => Ok(Some(tombstone)),
                    Err(e) if e.is_not_found() => {
                        Err(Error::conflict(format!("document {id} was deleted concurrently")))
                    }
                    Err(e) => Err(e),
                },
            },
        }
    }

    /// Deletes one document, following its revision if it changes under us; the tombstone's
    /// revision, `None` when the document was gone. The caller holds the document's turn, or
    /// deletes in bulk (no turn, no deadline).
    async fn delete_document(&self, doc: StoredDocument, deadline: Deadline) -> Result<Option<Revision>> {
        self.delete_other_leaves(&doc.id).await?;
        let mut rev = doc.rev;
        for _ in 0..=self.options.max_conflict_retries {
            deadline.check(&doc.id)?;
            match self.backend.delete(&doc.id, &rev).await {
                Ok(tombstone) => return Ok(Some(tombstone)),
                Err(e) if e.is_not_found() => return Ok(None),
                Err(e) if e.is_conflict() => match self.backend.get(&doc.id).await? {
                    None => return Ok(None),
                    Some(current) => rev = current.rev,
                },
                Err(e) => return Err(e),
            }
        }
        Err(Error::conflict(format!("document {:?} kept changing while being deleted", doc.id)))
    }

    /// Deletes every live leaf but the winner (conflicts a replicator brought in), so that deleting
    /// the winner next deletes the key, as a data-store delete means, instead of making a
    /// conflict the winner as a CouchDB delete of one revision would.
    async fn delete_other_leaves(&self, id: &str) -> Result<()> {
        if !data_store::has_branches(self.backend.as_ref(), id).await? {
            return Ok(());
        }
        let Some(tree) = data_store::revision_tree(self.backend.as_ref(), id).await? else { return Ok(()) };
        for leaf in tree.leaves().into_iter().skip(1).filter(|leaf| !leaf.deleted) {
            let tombstone = crate::backend::revision::RevisionId::next_after(Some(leaf.path.start))?.to_revision();
            let mut ancestry = vec![tombstone.as_str().to_owned()];
            ancestry.extend(leaf.path.revs());
            let deletion = ReplicatedRevision {
                rev: tombstone,
                ancestry,
                deleted: true,
                body: Map::new(),
                precondition: Precondition::None,
            };
            data_store::put_branch(self.backend.as_ref(), id, &deletion, self.options.max_tree_bytes).await?;
        }
        Ok(())
    }

    /// Deletes one listed document in a bulk delete, in its turn with this process's other
    /// writers of the same id.
    async fn delete_listed(&self, doc: StoredDocument) -> Result<bool> {
        let _turn = self.write_queues.turn(&doc.id, Deadline::none()).await?;
        Ok(self.delete_document(doc, Deadline::none()).await?.is_some())
    }

    /// The keys of a namespace, page by page, in backend order (unsorted).
    pub fn list_keys_pages(&self, user_id: &str, namespace: &str) -> Result<PageStream<String>> {
        let query = self.query(user_id, Some(namespace), Projection::Fields(vec![fields::KEY]))?;
        Ok(query_pages(Arc::clone(&self.backend), query, self.options.page_size)
            .map(|page| page?.into_iter().map(|doc| document::key_of(&doc.id, &doc.body)).collect())
            .boxed())
    }

    /// The key → value entries of a namespace, page by page, in backend order. Pages are at most
    /// 100 documents, so memory stays bounded even when every value is at the size limit.
    pub fn get_all_pages(&self, user_id: &str, namespace: &str) -> Result<PageStream<(String, Value)>> {
        let query = self.query(user_id, Some(namespace), Projection::All)?;
        Ok(query_pages(Arc::clone(&self.backend), query, self.options.page_size.min(GET_ALL_PAGE_SIZE))
            .map(|page| {
                page?
                    .into_iter()
                    .map(|mut doc| {
                        let key = document::key_of(&doc.id, &doc.body)?;
                        Ok((key, doc.body.remove(fields::VALUE).unwrap_or(Value::Null)))
                    })
                    .collect()
            })
            .boxed())
    }

    fn query(&self, user_id: &str, namespace: Option<&str>, projection: Projection) -> Result<Query> {
        self.options.limits.check_user_id(user_id)?;
        if let Some(namespace) = namespace {
            self.options.limits.check_namespace(namespace)?;
        }
        Ok(Query { user_id: user_id.to_owned(), namespace: namespace.map(str::to_owned), projection })
    }

    /// The keys in a namespace, sorted.
    pub async fn list_keys(&self, user_id: &str, namespace: &str) -> Result<Vec<String>> {
        let pages: Vec<Vec<String>> = self.list_keys_pages(user_id, namespace)?.try_collect().await?;
        let mut keys: Vec<String> = pages.into_iter().flatten().collect();
        keys.sort_unstable();
        Ok(keys)
    }

    /// The user's namespaces, distinct and sorted.
    pub async fn list_namespaces(&self, user_id: &str) -> Result<Vec<String>> {
        let query = self.query(user_id, None, Projection::Fields(vec![fields::NAMESPACE]))?;
        let mut namespaces = BTreeSet::new();
        let mut pages = query_pages(Arc::clone(&self.backend), query, self.options.page_size);
        while let Some(page) = pages.try_next().await? {
            for doc in page {
                namespaces.insert(document::namespace_of(&doc.id, &doc.body)?);
            }
        }
        Ok(namespaces.into_iter().collect())
    }

    /// Every key → value of a namespace, ordered by key. Not counted as accesses.
    pub async fn get_all(&self, user_id: &str, namespace: &str) -> Result<Map<String, Value>> {
        let pages: Vec<Vec<(String, Value)>> = self.get_all_pages(user_id, namespace)?.try_collect().await?;
        let mut entries: Vec<(String, Value)> = pages.into_iter().flatten().collect();
        entries.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        Ok(entries.into_iter().collect())
    }

    /// Deletes every document of a namespace; returns how many were deleted.
    pub async fn delete_namespace(&self, user_id: &str, namespace: &str) -> Result<u64> {
        let query = self.query(user_id, Some(namespace), Projection::Fields(vec![]))?;
        self.delete_matching(&query).await
    }

    /// Erases everything a user owns (an erasure request): their documents and the deletion
    /// records (tombstones) of their earlier deletes, so no id carrying the user id is left in
    /// the store (on CouchDB, `_purge`). Returns how many live documents were erased. Replicas of
    /// the store elsewhere keep their copies until they are purged themselves.
    pub async fn purge_user(&self, user_id: &str) -> Result<u64> {
        let query = self.query(user_id, None, Projection::Fields(vec![]))?;
        let prefix = format!("{user_id}:");
        let mut erased = 0;
        // The views' incarnation ends before the erasure too: a crash after the erasure would
        // otherwise leave the purged rows in every index built before, for good (the feed no
        // longer names them; docs/design/crash-points.md, "Views").
        self.end_views_incarnation().await?;
        // Count what is live, erase everything under the prefix, and go again while documents
        // written meanwhile are still listed; a bounded number of times.
        for _ in 0..PURGE_PASSES {
            let live = self.count_matching(&query).await?;
            if live == 0 && erased > 0 {
                self.end_views_incarnation().await?;
                return Ok(erased);
            }
            self.backend.erase_prefix(&prefix).await?;
            data_store::erase_branches(self.backend.as_ref(), &prefix).await?;
            erased += live;
            if live == 0 {
                self.end_views_incarnation().await?;
                return Ok(erased);
            }
        }
        Err(Error::conflict(format!(
            "documents of user {user_id:?} are still listed after {PURGE_PASSES} erasure passes: writers keep \
             adding them, or a stored document names the user without its id starting with {prefix:?}"
        )))
    }

    /// After a purge: the erased documents' feed entries are gone, so no index update would
    /// remove their rows from the view indexes (the data-store database's views and Mango
    /// indexes, built by this server where the backend does not run design documents). Removing
    /// the incarnation document makes every process that indexes this store start new indexes,
    /// built from the feed without them, and drop the old ones. Over the CouchDB backend, which
    /// indexes its own documents and updates its indexes after a purge, there is nothing to do.
    async fn end_views_incarnation(&self) -> Result<()> {
        end_data_store_views_incarnation(self.backend.as_ref()).await
    }

    /// How many documents a query lists.
    async fn count_matching(&self, query: &Query) -> Result<u64> {
        let mut pages = query_pages(Arc::clone(&self.backend), query.clone(), self.options.page_size);
        let mut count = 0;
        while let Some(page) = pages.try_next().await? {
            count += page.len() as u64;
        }
        Ok(count)
    }

    /// Deletes page by page, then passes again until a pass finds nothing left to delete, so
    /// documents written while the first pass ran are caught too.
    async fn delete_matching(&self, query: &Query) -> Result<u64> {
        let mut total = 0;
        loop {
            let mut pass = 0;
            let mut pages = query_pages(Arc::clone(&self.backend), query.clone(), self.options.page_size);
            while let Some(page) = pages.try_next().await? {
                let deleted: Vec<bool> = futures::stream::iter(page)
                    .map(|doc| self.delete_listed(doc))
                    .buffer_unordered(DELETE_CONCURRENCY)
                    .try_collect()
                    .await?;
                pass += deleted.into_iter().filter(|d| *d).count() as u64;
            }
            total += pass;
            if pass == 0 {
                return Ok(total);
            }
        }
    }
}

/// Checks a caller's precondition against what is stored.
fn check_expectation(id: &DocumentId, expect: &Expect, existing: Option<&StoredDocument>) -> Result<()> {
    match (expect, existing) {
        (Expect::Any, _) | (Expect::Exists, Some(_)) | (Expect::Absent, None) => Ok(()),
        (Expect::Revision(rev), Some(doc)) if &doc.rev == rev => Ok(()),
        (Expect::Exists | Expect::Revision(_), None) => Err(Error::conflict(format!("document {id} does not exist"))),
        (Expect::Absent, Some(_)) => Err(Error::conflict(format!("document {id} already exists"))),
        (Expect::Revision(rev), Some(doc)) => {
            Err(Error::conflict(format!("document {id} is at revision {}, not {rev}", doc.rev)))
        }
    }
}

/// Every page of `query`'s results, following page tokens to the end; one page in memory at a
/// time. A backend that hands back the token it was given would loop forever, so that is an error.
pub fn query_pages(backend: Arc<dyn DocumentBackend>, query: Query, page_size: usize) -> PageStream<StoredDocument> {
    // State: None = finished; Some(token) = fetch the page after `token` (None: the first).
    futures::stream::try_unfold(Some(None::<String>), move |state| {
        let backend = Arc::clone(&backend);
        let query = query.clone();
        async move {
            let Some(token) = state else { return Ok(None) };
            let page = backend.query(&query, page_size, token.as_deref()).await?;
            let next_state = match page.next {
                None => None,
                Some(next) if token.as_deref() == Some(next.as_str()) => {
                    return Err(Error::new(ErrorKind::Internal, "backend returned the same page token twice"));
                }
                Some(next) => Some(Some(next)),
            };
            // A design document is a record of the data-store database too; one holding a data
            // document's identity fields matches a user's query on backends that query by field,
            // and is never a data document of the facade.
            let documents = page.items.into_iter().filter(|doc| !doc.id.starts_with(DESIGN_ID_PREFIX)).collect();
            Ok(Some((documents, next_state)))
        }
    })
    .boxed()
}

/// Ends the data-store database's view incarnation (removes its local document,
/// [`VIEWS_INCARNATION_DOC`]), against other writers of it: every process that indexes this store
/// then builds new index groups from the feed and drops the old ones at its next index use.
/// Needs no HTTP face: `purge_user` and the move of design documents call it. Over a backend
/// that runs its own views (the CouchDB backend) there is nothing to do.
pub async fn end_data_store_views_incarnation(backend: &dyn DocumentBackend) -> Result<()> {
    if backend.forwards_requests() {
        return Ok(());
    }
    for _ in 0..INCARNATION_END_ATTEMPTS {
        let Some(kept) = backend.get_local(VIEWS_INCARNATION_DOC).await? else { return Ok(()) };
        match backend.delete_local(VIEWS_INCARNATION_DOC, &kept.rev).await {
            Ok(()) => return Ok(()),
            // Replaced meanwhile (perhaps by an index built during the erasure): end that one.
            Err(err) if err.is_conflict() || err.kind() == ErrorKind::NotFound => continue,
            Err(err) => return Err(err),
        }
    }
    Err(Error::conflict("the view indexes' incarnation kept changing while it was ended; try again"))
}

/// The start of a design document's id.
const DESIGN_ID_PREFIX: &str = "_design/";
/// The field of a previous release's `:design:{name}` local document holding its revision tree.
const DESIGN_TREE_FIELD: &str = "tree";
/// Local documents read per page while moving design documents.
const DESIGN_MOVE_PAGE: usize = 100;
/// The local document marking a store whose design documents were moved into records (a whole
/// pass of [`move_data_store_design_documents`] finished): opening the store then scans nothing.
/// Reserved (`:db:`), never a client's, and outside the `:design:` names the move scans.
pub const DESIGN_MOVE_MARK: &str = ":db:design-documents-moved";

/// [`move_data_store_design_documents`] unless a whole pass of it finished on this store before
/// ([`DESIGN_MOVE_MARK`]): what opening the store runs. One read of the mark once it is there.
/// A design document written as a local document after the mark (by a previous release still
/// serving the store during an upgrade) is moved by `agentstore upgrade`, which always scans.
pub async fn move_data_store_design_documents_once(backend: &Arc<dyn DocumentBackend>) -> Result<u64> {
    if backend.keeps_branches() || backend.get_local(DESIGN_MOVE_MARK).await?.is_some() {
        return Ok(0);
    }
    move_data_store_design_documents(backend).await
}

/// Moves every design document of the data-store database the previous release kept as a local
/// document `:design:{name}` into the record `_design/{name}` (module documentation); answers how
/// many were moved. Nothing to do on a backend that keeps revision trees itself (the CouchDB
/// backend runs its own design documents).
pub async fn move_data_store_design_documents(backend: &Arc<dyn DocumentBackend>) -> Result<u64> {
    if backend.keeps_branches() {
        return Ok(0);
    }
    let database = Database::data_store(crate::model::COLLECTION.to_owned(), Arc::clone(backend))?;
    let names = IdRange { inclusive_end: true, ..IdRange::all() }.under_prefix(DESIGN_SIDE_PREFIX);
    let mut moved = 0;
    let mut token: Option<String> = None;
    loop {
        let page = backend.local_docs(&names, DESIGN_MOVE_PAGE, token.as_deref()).await?;
        for kept in &page.items {
            let local = kept.id.strip_prefix(LOCAL_PREFIX).unwrap_or(&kept.id);
            let Some(name) = local.strip_prefix(DESIGN_SIDE_PREFIX) else { continue };
            move_design_document(&database, name, kept).await?;
            match backend.delete_local(local, &kept.rev).await {
                Ok(()) => moved += 1,
                // Moved (or changed) by another process meanwhile: its run, or the next, settles it.
                Err(err) if err.is_conflict() || err.kind() == ErrorKind::NotFound => {}
                Err(err) => return Err(err),
            }
        }
        match page.next {
            Some(next) => token = Some(next),
            None => break,
        }
    }
    // Index groups built over the previous release's source are built again, not read as this
    // release's (the same incarnation document: the engine's name on this layout).
    if moved > 0 {
        end_data_store_views_incarnation(backend.as_ref()).await?;
    }
    // Every local design document there was is a record now: later opens need not look again.
    // Written whatever another process wrote (the same mark): running this again is harmless.
    let mut mark = serde_json::Map::new();
    mark.insert("moved_at".into(), serde_json::Value::from(timestamp::now()));
    backend.put_local(DESIGN_MOVE_MARK, &mark, Precondition::None).await?;
    Ok(moved)
}

/// Writes every leaf of the design document `_design/{name}` kept in `kept` (a previous
/// release's local document) as a replicated revision with its whole path.
async fn move_design_document(database: &Database, name: &str, kept: &crate::backend::StoredDocument) -> Result<()> {
    let tree: RevTree =
        serde_json::from_value(kept.body.get(DESIGN_TREE_FIELD).cloned().unwrap_or_default()).map_err(|err| {
            Error::new(
                ErrorKind::Corrupt,
                format!("the design document {name:?} kept as {:?} does not parse: {err}", kept.id),
            )
        })?;
    let id = format!("_design/{name}");
    let writes: Vec<Write> = tree
        .leaves()
        .into_iter()
        .map(|leaf| Write::Replicated { path: leaf.path.clone(), deleted: leaf.deleted, body: leaf.body.clone() })
        .collect();
    for answer in database.write_batch(&id, &writes).await? {
        answer?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Opening the store moves a previous release's design documents once: after a finished
    /// pass (the mark) an open scans no local documents, while `upgrade`'s move still does, and
    /// moving again changes nothing.
    #[tokio::test]
    async fn design_documents_are_moved_at_the_first_open_only() {
        let dir = tempfile::tempdir().unwrap();
        let backend: Arc<dyn DocumentBackend> =
            Arc::new(crate::backend::embedded::EmbeddedBackend::open(&dir.path().join("store.redb")).await.unwrap());
        let old_layout = |name: &str| {
            let mut tree = RevTree::default();
            let mut body = serde_json::Map::new();
            body.insert("views".into(), serde_json::json!({}));
            tree.edit(None, "a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1", false, body, 1000).unwrap();
            let mut kept = serde_json::Map::new();
            kept.insert(DESIGN_TREE_FIELD.into(), serde_json::to_value(&tree).unwrap());
            (format!("{DESIGN_SIDE_PREFIX}{name}"), kept)
        };
        let (first, kept) = old_layout("first");
        backend.put_local(&first, &kept, Precondition::None).await.unwrap();
        DataStore::open(Arc::clone(&backend), StoreOptions::default()).await.unwrap();
        assert!(backend.get_local(&first).await.unwrap().is_none(), "moved at the first open");
        assert!(backend.get_local(DESIGN_MOVE_MARK).await.unwrap().is_some(), "the pass is marked");

        let (late, kept) = old_layout("late");
        backend.put_local(&late, &kept, Precondition::None).await.unwrap();
        DataStore::open(Arc::clone(&backend), StoreOptions::default()).await.unwrap();
        assert!(backend.get_local(&late).await.unwrap().is_some(), "a later open scans nothing");
        assert_eq!(move_data_store_design_documents(&backend).await.unwrap(), 1, "upgrade's move still scans");
        assert_eq!(move_data_store_design_documents(&backend).await.unwrap(), 0, "and again changes nothing");
        assert!(backend.get("_design/late").await.unwrap().is_some());
    }

    /// Waiters that give up at their deadline, or are cancelled while waiting, give their place
    /// back: once the holder is done, no queue is left behind.
    #[tokio::test]
    async fn queues_are_forgotten_after_timeouts_and_cancellations() {
        let queues = WriteQueues::new();
        let holder = queues.turn("doc", Deadline::none()).await.unwrap();
        let gave_up = queues.turn("doc", Deadline::after(Some(Duration::from_millis(20)))).await;
        assert_eq!(gave_up.err().map(|e| e.kind()), Some(ErrorKind::DeadlineExceeded));
        let cancelled = tokio::time::timeout(Duration::from_millis(20), queues.turn("doc", Deadline::none())).await;
        assert!(cancelled.is_err(), "the holder still has the turn");
        assert_eq!(queues.len(), 1);
        drop(holder);
        assert_eq!(queues.len(), 0);
        // And the document can be taken again right away.
        let again = queues.turn("doc", Deadline::after(Some(Duration::from_millis(20)))).await;
        assert!(again.is_ok());
    }
}
