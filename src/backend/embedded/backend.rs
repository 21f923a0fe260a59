//! [`EmbeddedBackend`]: the `DocumentBackend` over a redb file.
//!
//! redb is synchronous, so every call runs on tokio's blocking pool. redb serialises write
//! transactions itself, which is what makes concurrent writers from many tasks safe; readers run
//! on snapshots and never wait for writers. JSON is encoded and decoded outside the write
//! transaction so the write lock is held only for the B-tree work.
//!
//! The change feed needs no clock: every write transaction takes the next numbers of one counter
//! kept in the file, and a reader's snapshot holds every transaction committed before it, so a
//! feed position once returned is never followed by a smaller one committing later. The file is
//! open in one process at a time (redb's lock), so that counter is the one sequence authority.

use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use redb::{
    Database, ReadOnlyTable, ReadTransaction, ReadableDatabase, ReadableTable, ReadableTableMetadata, Table,
    TableDefinition, WriteTransaction,
};
use serde_json::{Map, Value};

use super::error::{join_error, map_redb};
use super::group_commit::{self, GroupCommit, Job, JobEnd};
use super::record::{self, Header, StoredRevision};
use crate::backend::replicated::{self, CheckedRevision};
use crate::backend::revision::{local_number, local_revision, next_local_revision, PackedAncestry, RevisionId};
use crate::backend::{
    needs_upgrade, Ancestry, BulkWrite, Change, ChangesPage, DocumentBackend, IdRange, LayoutState, Page, Precondition,
    Projection, Query, ReplicatedOutcome, ReplicatedRevision, Revision, RevisionInfo, StoredDocument, UpgradePage,
    DEFAULT_REVS_LIMIT, LOCAL_PREFIX,
};
use crate::error::{Error, ErrorKind, Result};
use crate::model::fields;

/// Live documents: `_id` → record (see [`record`]).
const DOCS: TableDefinition<&str, &[u8]> = TableDefinition::new("docs");
/// Deleted documents: `_id` → record with an empty body.
const TOMBSTONES: TableDefinition<&str, &[u8]> = TableDefinition::new("tombstones");
const BY_USER_NAMESPACE: TableDefinition<(&str, &str, &str), ()> = TableDefinition::new("by_user_namespace");
/// The change feed: position → `_id`, one entry per document (its latest write).
const FEED: TableDefinition<u64, &str> = TableDefinition::new("feed");
/// Revision ancestry: `_id` → the last `revs_limit` revision tokens, newest first.
const ANCESTRY: TableDefinition<&str, &[u8]> = TableDefinition::new("ancestry");
/// Local documents: name after `_local/` → revision number (u64 BE) + JSON body.
const LOCAL: TableDefinition<&str, &[u8]> = TableDefinition::new("local");
/// Counters. Older files hold `seq` (their file-wide revision counter), no longer read.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
/// A floor under the next feed position: recorded when an erasure removes feed entries, which may
/// include the highest one (the next position must never fall back to one a follower has passed).
/// Otherwise the next position is one past the feed's highest entry: that needs no write of its
/// own in every transaction (each table a commit touches is more pages to write and fsync).
const META_FEED_NEXT: &str = "feed_next";
/// The layout version of the file; absent in files of older releases.
const META_LAYOUT: &str = "layout";
const LAYOUT_CURRENT: u64 = 2;

/// Documents one erasure transaction removes at most, so a large erasure does not hold the write
/// lock for long.
const ERASE_BATCH: usize = 1_000;

/// Settings of the embedded store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbeddedOptions {
    /// How many revision ids of each document are remembered (CouchDB's `_revs_limit`).
    pub revs_limit: usize,
    /// The most bytes of file pages redb keeps cached in memory (`cache_mb=` in the URL). Pages
    /// beyond it are read again through the operating system's page cache, which does not count
    /// against the process.
    pub cache_bytes: usize,
}

/// The default page cache: 64 MiB (redb's own default is 1 GiB), so a process stays within
/// about 256 MB even on a store of millions of documents.
pub const DEFAULT_CACHE_BYTES: usize = 64 << 20;

impl Default for EmbeddedOptions {
    fn default() -> Self {
        EmbeddedOptions { revs_limit: DEFAULT_REVS_LIMIT, cache_bytes: DEFAULT_CACHE_BYTES }
    }
}

/// The embedded store. Cheap to clone; all clones share one open file.
#[derive(Clone)]
pub struct EmbeddedBackend {
    db: Arc<Database>,
    /// The queue of writes, committed in groups.
    commits: Arc<GroupCommit>,
    path: PathBuf,
}

impl EmbeddedBackend {
    /// Opens (creating if needed, with its parent directories) the store at `path` with default
    /// settings. A file that another process has open gives a `Misconfigured` error at once.
    pub async fn open(path: &Path) -> Result<Self> {
        Self::open_with(path, EmbeddedOptions::default()).await
    }

    pub async fn open_with(path: &Path, options: EmbeddedOptions) -> Result<Self> {
        let path = path.to_path_buf();
        let opened = path.clone();
        let db = tokio::task::spawn_blocking(move || -> Result<Database> {
            if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent).map_err(|e| {
                    Error::new(ErrorKind::Misconfigured, format!("cannot create directory {}", parent.display()))
                        .with_source(e)
                })?;
            }
            let db = Database::builder().set_cache_size(options.cache_bytes).create(&path).map_err(|e| {
                let err = map_redb("open file")(e);
                Error::new(err.kind(), format!("cannot open embedded store {}: {}", path.display(), err.message()))
                    .with_source(err)
            })?;
            create_tables(&db)?;
            Ok(db)
        })
        .await
        .map_err(join_error)??;
        let db = Arc::new(db);
        let commits = GroupCommit::new(&db, options.revs_limit);
        Ok(EmbeddedBackend { db, commits, path: opened })
    }

    /// Runs blocking redb work on the blocking pool.
    async fn blocking<T, F>(&self, work: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Database) -> Result<T> + Send + 'static,
    {
        let db = Arc::clone(&self.db);
        tokio::task::spawn_blocking(move || work(&db)).await.map_err(join_error)?
    }

    /// Runs `work` in the next group's write transaction ([`group_commit`]) and answers once that
    /// transaction is committed. `work` must refuse before it writes: a refusal after writing
    /// rolls back the whole group (and the others are told to try again). `documents` is about
    /// how many documents it writes, which bounds how much one transaction holds.
    async fn write<T, F>(&self, documents: usize, work: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Tables<'_>) -> Result<T> + Send + 'static,
    {
        let (answer, answered) = tokio::sync::oneshot::channel::<Result<T>>();
        let job = job_of(work, answer);
        self.commits.submit(documents, job);
        answered.await.map_err(|_| {
            Error::new(
                ErrorKind::Unavailable,
                "embedded store: the write was not applied (its transaction failed; the log says why); try again",
            )
        })?
    }
}

/// Creates every table up front, so readers never meet a missing one, and marks a new file (no
/// documents yet) as having the current layout.
fn create_tables(db: &Database) -> Result<()> {
    let txn = db.begin_write().map_err(map_redb("begin transaction"))?;
    {
        let docs = txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
        let tombstones = txn.open_table(TOMBSTONES).map_err(map_redb("open tombstones table"))?;
        txn.open_table(BY_USER_NAMESPACE).map_err(map_redb("open index table"))?;
        txn.open_table(FEED).map_err(map_redb("open feed table"))?;
        txn.open_table(ANCESTRY).map_err(map_redb("open ancestry table"))?;
        txn.open_table(LOCAL).map_err(map_redb("open local table"))?;
        let mut meta = txn.open_table(META).map_err(map_redb("open meta table"))?;
        let empty = docs.is_empty().map_err(map_redb("count documents"))?
            && tombstones.is_empty().map_err(map_redb("count tombstones"))?;
        if empty && meta.get(META_LAYOUT).map_err(map_redb("read layout"))?.is_none() {
            meta.insert(META_LAYOUT, LAYOUT_CURRENT).map_err(map_redb("write layout"))?;
        }
    }
    txn.commit().map_err(map_redb("commit"))
}

/// The group-commit job that runs `work` and answers on `answer`: with the commit's outcome
/// when it wrote, at once when it refused having changed nothing, or as a broken job (its group
/// rolled back) when it failed after writing or for any other reason.
fn job_of<T, F>(work: F, answer: tokio::sync::oneshot::Sender<Result<T>>) -> Job
where
    T: Send + 'static,
    F: FnOnce(&mut Tables<'_>) -> Result<T> + Send + 'static,
{
    Box::new(move |tables: &mut Tables<'_>| {
        // Every document write takes a feed position: an unchanged counter shows that a refusal
        // left the documents alone.
        let feed_before = tables.next_seq;
        match work(tables) {
            Ok(out) => JobEnd::Wrote(Box::new(move |committed| {
                let _ = answer.send(committed.map(|()| out));
            })),
            Err(error) if group_commit::is_clean_refusal(&error) && tables.next_seq == feed_before => {
                JobEnd::Refused(Box::new(move || {
                    let _ = answer.send(Err(error));
                }))
            }
            Err(error) => JobEnd::Broke(Box::new(move || {
                let _ = answer.send(Err(error));
            })),
        }
    })
}

/// A write with its body already encoded.
struct EncodedWrite {
    id: String,
    json: Vec<u8>,
    index_key: Option<IndexKey>,
    precondition: Precondition,
}

impl EncodedWrite {
    fn new(id: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Self> {
        let json = encode_json(id, body)?;
        Ok(EncodedWrite { id: id.to_owned(), json, index_key: index_key(body), precondition })
    }
}

/// A replicated write, checked and with its body encoded, outside the write transaction.
struct ReplicatedWrite {
    id: String,
    /// The incoming revision without its body (what the rules look at).
    incoming: ReplicatedRevision,
    checked: CheckedRevision,
    /// The encoded body; `None` for a tombstone.
    json: Option<Vec<u8>>,
    index_key: Option<IndexKey>,
}

impl ReplicatedWrite {
    fn new(id: &str, incoming: &ReplicatedRevision) -> Result<Self> {
        let checked = replicated::check(id, incoming)?;
        let json = if incoming.deleted { None } else { Some(encode_json(id, &incoming.body)?) };
        let index_key = if incoming.deleted { None } else { index_key(&incoming.body) };
        let incoming = ReplicatedRevision {
            rev: incoming.rev.clone(),
            ancestry: incoming.ancestry.clone(),
            deleted: incoming.deleted,
            body: Map::new(),
        };
        Ok(ReplicatedWrite { id: id.to_owned(), incoming, checked, json, index_key })
    }
}

fn encode_json(id: &str, body: &Map<String, Value>) -> Result<Vec<u8>> {
    serde_json::to_vec(body).map_err(|e| {
        Error::new(ErrorKind::InvalidInput, format!("document {id:?} cannot be encoded as JSON")).with_source(e)
    })
}

/// `(userId, namespace)`: where a document sits in the secondary index.
type IndexKey = (String, String);

/// The `(userId, namespace)` a document is indexed under; documents lacking either string field
/// are not indexed, as CouchDB's Mango index leaves out documents missing an indexed field.
fn index_key(body: &Map<String, Value>) -> Option<IndexKey> {
    match (body.get(fields::USER_ID), body.get(fields::NAMESPACE)) {
        (Some(Value::String(user)), Some(Value::String(ns))) => Some((user.clone(), ns.clone())),
        _ => None,
    }
}

/// What is stored under an id: a live document (with its index key) or a tombstone.
enum Existing {
    Live(Header, Option<IndexKey>),
    Deleted(Header),
}

impl Existing {
    fn header(&self) -> Header {
        match self {
            Existing::Live(header, _) | Existing::Deleted(header) => *header,
        }
    }
}

/// The tables of one write transaction, and the feed counter it advances.
pub(super) struct Tables<'t> {
    docs: Table<'t, &'static str, &'static [u8]>,
    tombstones: Table<'t, &'static str, &'static [u8]>,
    index: Table<'t, (&'static str, &'static str, &'static str), ()>,
    feed: Table<'t, u64, &'static str>,
    ancestry: Table<'t, &'static str, &'static [u8]>,
    local: Table<'t, &'static str, &'static [u8]>,
    meta: Table<'t, &'static str, u64>,
    next_seq: u64,
    /// Whether feed entries were removed without a later one added (an erasure): the floor must
    /// then be recorded.
    feed_shrunk: bool,
    revs_limit: usize,
}

impl<'t> Tables<'t> {
    pub(super) fn open(txn: &'t WriteTransaction, revs_limit: usize) -> Result<Self> {
        let meta = txn.open_table(META).map_err(map_redb("open meta table"))?;
        let feed = txn.open_table(FEED).map_err(map_redb("open feed table"))?;
        let next_seq = next_feed_position(&feed, &meta)?;
        Ok(Tables {
            docs: txn.open_table(DOCS).map_err(map_redb("open docs table"))?,
            tombstones: txn.open_table(TOMBSTONES).map_err(map_redb("open tombstones table"))?,
            index: txn.open_table(BY_USER_NAMESPACE).map_err(map_redb("open index table"))?,
            feed,
            ancestry: txn.open_table(ANCESTRY).map_err(map_redb("open ancestry table"))?,
            local: txn.open_table(LOCAL).map_err(map_redb("open local table"))?,
            meta,
            next_seq,
            feed_shrunk: false,
            revs_limit,
        })
    }

    /// Records the feed's floor when this transaction removed feed entries (before it commits).
    pub(super) fn finish(&mut self) -> Result<()> {
        if self.feed_shrunk {
            self.meta.insert(META_FEED_NEXT, self.next_seq).map_err(map_redb("write feed floor"))?;
        }
        Ok(())
    }

    fn existing(&self, id: &str) -> Result<Option<Existing>> {
        if let Some(guard) = self.docs.get(id).map_err(map_redb("read document"))? {
            let (header, body) = record::decode(id, guard.value())?;
            return Ok(Some(Existing::Live(header, index_key(&body))));
        }
        match self.tombstones.get(id).map_err(map_redb("read tombstone"))? {
            Some(guard) => Ok(Some(Existing::Deleted(record::split(id, guard.value())?.0))),
            None => Ok(None),
        }
    }

    /// Mints the revision that follows `previous`, extends the ancestry and moves the document
    /// to the end of the feed; returns the new revision and feed position.
    fn advance(&mut self, id: &str, previous: Option<Header>) -> Result<(RevisionId, u64)> {
        let rev = RevisionId::next_after(previous.map(|h| h.rev.generation()))?;
        let parent = match self.ancestry.get(id).map_err(map_redb("read ancestry"))? {
            Some(guard) => Some(PackedAncestry(guard.value().to_vec())),
            None => match previous.map(|h| h.rev) {
                Some(StoredRevision::Minted(old)) => Some(PackedAncestry(old.token.to_vec())),
                _ => None,
            },
        };
        let packed = PackedAncestry::extend(parent.as_ref(), &rev, self.revs_limit);
        let seq = self.record_version(id, &packed, previous.and_then(|h| h.seq))?;
        Ok((rev, seq))
    }

    /// Stores `packed` as the ancestry of `id` and moves it from its feed position `old_seq` to
    /// the end of the feed; returns the new position.
    fn record_version(&mut self, id: &str, packed: &PackedAncestry, old_seq: Option<u64>) -> Result<u64> {
        self.ancestry.insert(id, packed.0.as_slice()).map_err(map_redb("write ancestry"))?;
        if let Some(old) = old_seq {
            self.feed.remove(old).map_err(map_redb("update feed"))?;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.feed.insert(seq, id).map_err(map_redb("update feed"))?;
        Ok(seq)
    }

    /// Removes the stored record of `id` (live document with its index entry, or tombstone).
    fn remove_record(&mut self, id: &str, existing: &Existing) -> Result<()> {
        match existing {
            Existing::Live(_, key) => {
                self.docs.remove(id).map_err(map_redb("remove document"))?;
                self.unindex(id, key.as_ref())
            }
            Existing::Deleted(_) => {
                self.tombstones.remove(id).map_err(map_redb("remove tombstone"))?;
                Ok(())
            }
        }
    }

    /// Stores a revision made elsewhere if the rules of [`replicated::judge`] say so.
    fn write_replicated(&mut self, write: &ReplicatedWrite) -> Result<ReplicatedOutcome> {
        let id = write.id.as_str();
        let existing = self.existing(id)?;
        let stored = match &existing {
            Some(existing) => {
                let deleted = matches!(existing, Existing::Deleted(_));
                Some(revision_info_in(&self.ancestry, id, existing.header(), deleted)?)
            }
            None => None,
        };
        let outcome = replicated::judge(&write.incoming, stored.as_ref());
        if outcome != ReplicatedOutcome::Applied {
            return Ok(outcome);
        }
        if let Some(existing) = &existing {
            self.remove_record(id, existing)?;
        }
        let packed = write.checked.stored_ancestry(self.revs_limit);
        let seq = self.record_version(id, &packed, existing.as_ref().and_then(|e| e.header().seq))?;
        let rev = &write.checked.rev;
        match &write.json {
            None => {
                self.tombstones
                    .insert(id, record::encode(rev, seq, b"").as_slice())
                    .map_err(map_redb("write tombstone"))?;
            }
            Some(json) => {
                self.docs.insert(id, record::encode(rev, seq, json).as_slice()).map_err(map_redb("write document"))?;
                if let Some((user, ns)) = &write.index_key {
                    self.index.insert((user.as_str(), ns.as_str(), id), ()).map_err(map_redb("update index"))?;
                }
            }
        };
        Ok(ReplicatedOutcome::Applied)
    }

    fn unindex(&mut self, id: &str, key: Option<&IndexKey>) -> Result<()> {
        if let Some((user, ns)) = key {
            self.index.remove((user.as_str(), ns.as_str(), id)).map_err(map_redb("update index"))?;
        }
        Ok(())
    }

    /// Checks the precondition and writes one document.
    fn write_one(&mut self, write: &EncodedWrite) -> Result<Revision> {
        let existing = self.existing(&write.id)?;
        let live = match &existing {
            Some(Existing::Live(header, _)) => Some(header.rev),
            _ => None,
        };
        check_precondition(&write.id, &write.precondition, live)?;
        if let Some(Existing::Live(_, key)) = &existing {
            self.unindex(&write.id, key.as_ref())?;
        }
        if let Some(Existing::Deleted(_)) = &existing {
            self.tombstones.remove(write.id.as_str()).map_err(map_redb("remove tombstone"))?;
        }
        let (rev, seq) = self.advance(&write.id, existing.as_ref().map(Existing::header))?;
        let stored = record::encode(&rev, seq, &write.json);
        self.docs.insert(write.id.as_str(), stored.as_slice()).map_err(map_redb("write document"))?;
        if let Some((user, ns)) = &write.index_key {
            self.index.insert((user.as_str(), ns.as_str(), write.id.as_str()), ()).map_err(map_redb("update index"))?;
        }
        Ok(rev.to_revision())
    }

    /// Replaces a live document at `expected` by its tombstone.
    fn delete_one(&mut self, id: &str, expected: &Revision) -> Result<Revision> {
        let Some(Existing::Live(header, key)) = self.existing(id)? else {
            return Err(Error::not_found(format!("document {id:?} does not exist")));
        };
        if !header.rev.matches(expected) {
            let rev = header.rev.to_revision();
            return Err(Error::conflict(format!("document {id:?} is at revision {rev}, not {expected}")));
        }
        self.docs.remove(id).map_err(map_redb("delete document"))?;
        self.unindex(id, key.as_ref())?;
        let (rev, seq) = self.advance(id, Some(header))?;
        self.tombstones.insert(id, record::encode(&rev, seq, b"").as_slice()).map_err(map_redb("write tombstone"))?;
        Ok(rev.to_revision())
    }

    /// Removes every trace of `id`; whether there was any.
    fn erase(&mut self, id: &str) -> Result<bool> {
        let Some(existing) = self.existing(id)? else { return Ok(false) };
        self.remove_record(id, &existing)?;
        if let Some(seq) = existing.header().seq {
            self.feed.remove(seq).map_err(map_redb("update feed"))?;
            self.feed_shrunk = true;
        }
        self.ancestry.remove(id).map_err(map_redb("erase ancestry"))?;
        Ok(true)
    }

    /// Gives a record of an older layout its feed position (and a minted revision when it had
    /// only a file-wide counter); whether it needed it.
    fn upgrade_one(&mut self, id: &str) -> Result<bool> {
        let (header, json) = {
            let Some(guard) = self.docs.get(id).map_err(map_redb("read document"))? else { return Ok(false) };
            let (header, json) = record::split(id, guard.value())?;
            (header, json.to_vec())
        };
        if header.seq.is_some() {
            return Ok(false);
        }
        let rev = match header.rev {
            StoredRevision::Minted(rev) => rev,
            StoredRevision::Counter(_) => RevisionId::next_after(None)?,
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        self.feed.insert(seq, id).map_err(map_redb("update feed"))?;
        self.ancestry.insert(id, rev.token.as_slice()).map_err(map_redb("write ancestry"))?;
        self.docs.insert(id, record::encode(&rev, seq, &json).as_slice()).map_err(map_redb("upgrade document"))?;
        Ok(true)
    }
}

/// The next feed position: past the feed's highest entry and the recorded floor.
fn next_feed_position(
    feed: &impl ReadableTable<u64, &'static str>,
    meta: &impl ReadableTable<&'static str, u64>,
) -> Result<u64> {
    let past_highest = feed.last().map_err(map_redb("read feed"))?.map_or(1, |(seq, _)| seq.value() + 1);
    let floor = meta.get(META_FEED_NEXT).map_err(map_redb("read feed floor"))?.map_or(1, |v| v.value());
    Ok(past_highest.max(floor))
}

/// Whether a write's precondition holds against the live revision (`None`: no live document,
/// whether never written or deleted).
fn check_precondition(id: &str, precondition: &Precondition, live: Option<StoredRevision>) -> Result<()> {
    match (precondition, live) {
        (Precondition::MustNotExist, Some(_)) => Err(Error::conflict(format!("document {id:?} already exists"))),
        (Precondition::MatchRevision(_), None) => Err(Error::conflict(format!("document {id:?} does not exist"))),
        (Precondition::MatchRevision(expected), Some(rev)) if !rev.matches(expected) => {
            let rev = rev.to_revision();
            Err(Error::conflict(format!("document {id:?} is at revision {rev}, not {expected}")))
        }
        _ => Ok(()),
    }
}

fn stored(id: &str, header: Header, body: Map<String, Value>) -> StoredDocument {
    StoredDocument { id: id.to_owned(), rev: header.rev.to_revision(), body }
}

/// A query page token: the `(namespace, _id)` of the last index entry returned.
fn decode_query_token(token: &str) -> Result<(String, String)> {
    serde_json::from_str(token).map_err(|_| Error::invalid("page token", "was not produced by this backend"))
}

fn project(mut body: Map<String, Value>, projection: &Projection) -> Map<String, Value> {
    if let Projection::Fields(wanted) = projection {
        body.retain(|name, _| wanted.contains(&name.as_str()));
    }
    body
}

/// A feed token: the position of the last change returned.
fn decode_feed_token(token: &str) -> Result<u64> {
    token.parse().map_err(|_| Error::invalid("since", format!("{token:?} is not a change-feed token of this store")))
}

fn layout_of(meta: &impl ReadableTable<&'static str, u64>) -> Result<LayoutState> {
    Ok(match meta.get(META_LAYOUT).map_err(map_redb("read layout"))? {
        Some(v) if v.value() >= LAYOUT_CURRENT => LayoutState::Current,
        _ => LayoutState::NeedsUpgrade("documents written before the change feed have no feed position".into()),
    })
}

/// A local document's record: its revision number, then the JSON body.
fn encode_local(n: u64, json: &[u8]) -> Vec<u8> {
    let mut record = Vec::with_capacity(8 + json.len());
    record.extend_from_slice(&n.to_be_bytes());
    record.extend_from_slice(json);
    record
}

fn decode_local(name: &str, record: &[u8]) -> Result<(u64, Map<String, Value>)> {
    let corrupt = || Error::new(ErrorKind::Corrupt, format!("embedded store: local document {name:?} is damaged"));
    let (n, json) = record.split_at_checked(8).ok_or_else(corrupt)?;
    let n = u64::from_be_bytes(n.try_into().map_err(|_| corrupt())?);
    Ok((n, serde_json::from_slice(json).map_err(|_| corrupt())?))
}

/// The id bounds of an `all_docs` page, ascending: (lower, upper).
fn all_docs_bounds<'a>(range: &'a IdRange, after: Option<&'a str>) -> (Bound<&'a str>, Bound<&'a str>) {
    let end_bound = |id: &'a str| if range.inclusive_end { Bound::Included(id) } else { Bound::Excluded(id) };
    let (start, end) = (range.start.as_deref(), range.end.as_deref());
    let from = match (after, start) {
        (Some(after), _) => Bound::Excluded(after),
        (None, Some(start)) => Bound::Included(start),
        (None, None) => Bound::Unbounded,
    };
    let to = end.map_or(Bound::Unbounded, end_bound);
    if range.descending {
        (to, from)
    } else {
        (from, to)
    }
}

/// Whether `(lower, upper)` is an empty range (redb panics on a range whose start is past its end).
fn is_empty_range(lower: &Bound<&str>, upper: &Bound<&str>) -> bool {
    match (lower, upper) {
        (Bound::Included(l), Bound::Included(u)) => l > u,
        (Bound::Included(l) | Bound::Excluded(l), Bound::Excluded(u)) | (Bound::Excluded(l), Bound::Included(u)) => {
            l >= u
        }
        _ => false,
    }
}

type MetaTable = ReadOnlyTable<&'static str, u64>;
type FeedTable = ReadOnlyTable<u64, &'static str>;

/// The counters and the feed of a read transaction; an error naming `agentstore upgrade` for a
/// file of an earlier release, whose older records have no feed position.
fn feed_tables(txn: &ReadTransaction, store: &str) -> Result<(MetaTable, FeedTable)> {
    let meta = txn.open_table(META).map_err(map_redb("open meta table"))?;
    if let LayoutState::NeedsUpgrade(why) = layout_of(&meta)? {
        return Err(needs_upgrade(store, "the change feed", &why));
    }
    let feed = txn.open_table(FEED).map_err(map_redb("open feed table"))?;
    Ok((meta, feed))
}

/// The record header of `id` and whether it is a tombstone, read in a read transaction; `None`
/// when the id is not stored.
fn header_of(
    docs: &impl ReadableTable<&'static str, &'static [u8]>,
    tombstones: &impl ReadableTable<&'static str, &'static [u8]>,
    id: &str,
) -> Result<Option<(Header, bool)>> {
    if let Some(guard) = docs.get(id).map_err(map_redb("read document"))? {
        return Ok(Some((record::split(id, guard.value())?.0, false)));
    }
    match tombstones.get(id).map_err(map_redb("read tombstone"))? {
        Some(guard) => Ok(Some((record::split(id, guard.value())?.0, true))),
        None => Ok(None),
    }
}

/// What `revisions(id)` answers for the record `header` (a tombstone's when `deleted`), with the
/// ancestry kept in `ancestry`.
fn revision_info_in(
    ancestry: &impl ReadableTable<&'static str, &'static [u8]>,
    id: &str,
    header: Header,
    deleted: bool,
) -> Result<RevisionInfo> {
    let remembered = match header.rev {
        // A plain counter has no CouchDB form, so no ancestry until `upgrade` mints one.
        StoredRevision::Counter(_) => Ancestry { start: 1, ids: Vec::new() },
        StoredRevision::Minted(rev) => {
            let packed = match ancestry.get(id).map_err(map_redb("read ancestry"))? {
                Some(guard) => PackedAncestry(guard.value().to_vec()),
                None => PackedAncestry(rev.token.to_vec()),
            };
            if !packed.is_well_formed() {
                return Err(Error::new(ErrorKind::Corrupt, format!("embedded store: ancestry of {id:?}")));
            }
            packed.unpack(rev.generation)
        }
    };
    Ok(RevisionInfo { rev: header.rev.to_revision(), deleted, ancestry: remembered })
}

/// One page of live documents in id order between `bounds` (design documents skipped), and the
/// id to continue after.
fn id_ordered_page(
    docs: &impl ReadableTable<&'static str, &'static [u8]>,
    bounds: (Bound<&str>, Bound<&str>),
    descending: bool,
    limit: usize,
) -> Result<Page<StoredDocument>> {
    let entries = docs.range::<&str>(bounds).map_err(map_redb("read documents"))?;
    let entries: Box<dyn Iterator<Item = _>> = if descending { Box::new(entries.rev()) } else { Box::new(entries) };
    let mut items = Vec::with_capacity(limit.min(1024));
    for entry in entries {
        let (id, stored_record) = entry.map_err(map_redb("read documents"))?;
        if id.value().starts_with("_design/") {
            continue;
        }
        if items.len() == limit {
            let next = items.last().map(|d: &StoredDocument| d.id.clone());
            return Ok(Page { items, next });
        }
        let (header, body) = record::decode(id.value(), stored_record.value())?;
        items.push(stored(id.value(), header, body));
    }
    Ok(Page { items, next: None })
}

#[async_trait]
impl DocumentBackend for EmbeddedBackend {
    fn describe(&self) -> String {
        format!("embedded:{}", self.path.display())
    }

    async fn get(&self, id: &str) -> Result<Option<StoredDocument>> {
        Ok(self.get_many(&[id.to_owned()]).await?.pop().flatten())
    }

    async fn get_many(&self, ids: &[String]) -> Result<Vec<Option<StoredDocument>>> {
        // One read transaction: one consistent snapshot, one trip to the blocking pool.
        let ids = ids.to_vec();
        self.blocking(move |db| {
            let txn = db.begin_read().map_err(map_redb("begin read"))?;
            let docs = txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
            let mut found = Vec::with_capacity(ids.len());
            for id in &ids {
                let doc = match docs.get(id.as_str()).map_err(map_redb("read document"))? {
                    Some(guard) => {
                        let (header, body) = record::decode(id, guard.value())?;
                        Some(stored(id, header, body))
                    }
                    None => None,
                };
                found.push(doc);
            }
            Ok(found)
        })
        .await
    }

    async fn put(&self, id: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision> {
        let write = EncodedWrite::new(id, body, precondition)?;
        self.write(1, move |tables| tables.write_one(&write)).await
    }

    async fn delete(&self, id: &str, rev: &Revision) -> Result<Revision> {
        let (id, expected) = (id.to_owned(), rev.clone());
        self.write(1, move |tables| tables.delete_one(&id, &expected)).await
    }

    async fn put_replicated(&self, id: &str, incoming: &ReplicatedRevision) -> Result<ReplicatedOutcome> {
        // Checked and encoded first: a refused revision changes nothing and takes no write lock.
        let write = ReplicatedWrite::new(id, incoming)?;
        self.write(1, move |tables| tables.write_replicated(&write)).await
    }

    async fn query(&self, query: &Query, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        let query = query.clone();
        let after = page_token.map(decode_query_token).transpose()?;
        let limit = limit.max(1);
        self.blocking(move |db| {
            let txn = db.begin_read().map_err(map_redb("begin read"))?;
            let index = txn.open_table(BY_USER_NAMESPACE).map_err(map_redb("open index table"))?;
            let docs = txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
            let user = query.user_id.as_str();
            let start_ns = query.namespace.as_deref().unwrap_or("");
            let lower = match &after {
                Some((ns, id)) => Bound::Excluded((user, ns.as_str(), id.as_str())),
                None => Bound::Included((user, start_ns, "")),
            };
            let range = index.range::<(&str, &str, &str)>((lower, Bound::Unbounded)).map_err(map_redb("scan index"))?;
            let mut items = Vec::new();
            let mut last = None;
            for entry in range {
                let (key, _) = entry.map_err(map_redb("scan index"))?;
                let (entry_user, entry_ns, id) = key.value();
                if entry_user != user || query.namespace.as_deref().is_some_and(|ns| ns != entry_ns) {
                    break;
                }
                if items.len() == limit {
                    // Another match exists past this page.
                    let token = serde_json::to_string(&last)
                        .map_err(|e| Error::new(ErrorKind::Internal, "encode page token").with_source(e))?;
                    return Ok(Page { items, next: Some(token) });
                }
                let Some(guard) = docs.get(id).map_err(map_redb("read document"))? else {
                    return Err(Error::new(
                        ErrorKind::Corrupt,
                        format!("embedded store: index names missing document {id:?}"),
                    ));
                };
                let (header, body) = record::decode(id, guard.value())?;
                items.push(stored(id, header, project(body, &query.projection)));
                last = Some((entry_ns.to_owned(), id.to_owned()));
            }
            Ok(Page { items, next: None })
        })
        .await
    }

    async fn ensure_standard_indexes(&self) -> Result<()> {
        // The index is a table created when the file is opened.
        Ok(())
    }

    async fn ensure_namespace_indexed(&self, _namespace: &str) -> Result<()> {
        // Every namespace is covered by the one (userId, namespace, _id) table.
        Ok(())
    }

    async fn bulk_write(&self, writes: Vec<BulkWrite>) -> Result<Vec<Result<Revision>>> {
        // Encode first: a write that cannot be encoded fails alone, outside the transaction.
        let encoded: Vec<Result<EncodedWrite>> =
            writes.into_iter().map(|w| EncodedWrite::new(&w.id, &w.body, w.precondition)).collect();
        self.write(encoded.len(), move |tables| {
            let mut results = Vec::with_capacity(encoded.len());
            for write in encoded {
                let result = match write {
                    Ok(write) => match tables.write_one(&write) {
                        Err(e) if e.kind() != ErrorKind::Conflict => return Err(e),
                        other => other,
                    },
                    Err(e) => Err(e),
                };
                results.push(result);
            }
            Ok(results)
        })
        .await
    }

    async fn scan(&self, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        let after = page_token.map(str::to_owned);
        let limit = limit.max(1);
        self.blocking(move |db| {
            let txn = db.begin_read().map_err(map_redb("begin read"))?;
            let docs = txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
            let lower = match &after {
                Some(id) => Bound::Excluded(id.as_str()),
                None => Bound::Unbounded,
            };
            id_ordered_page(&docs, (lower, Bound::Unbounded), false, limit)
        })
        .await
    }

    async fn health(&self) -> Result<()> {
        self.blocking(|db| {
            let txn = db.begin_read().map_err(map_redb("begin read"))?;
            txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
            Ok(())
        })
        .await
    }

    async fn revisions(&self, id: &str) -> Result<Option<RevisionInfo>> {
        let id = id.to_owned();
        self.blocking(move |db| {
            let txn = db.begin_read().map_err(map_redb("begin read"))?;
            let docs = txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
            let tombstones = txn.open_table(TOMBSTONES).map_err(map_redb("open tombstones table"))?;
            let Some((header, deleted)) = header_of(&docs, &tombstones, &id)? else { return Ok(None) };
            let ancestry = txn.open_table(ANCESTRY).map_err(map_redb("open ancestry table"))?;
            revision_info_in(&ancestry, &id, header, deleted).map(Some)
        })
        .await
    }

    async fn changes(&self, since: Option<&str>, limit: usize) -> Result<ChangesPage> {
        let since = since.map(decode_feed_token).transpose()?.unwrap_or(0);
        let limit = limit.max(1);
        let store = self.describe();
        self.blocking(move |db| {
            let txn = db.begin_read().map_err(map_redb("begin read"))?;
            let (_, feed) = feed_tables(&txn, &store)?;
            let docs = txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
            let tombstones = txn.open_table(TOMBSTONES).map_err(map_redb("open tombstones table"))?;
            let mut changes = Vec::with_capacity(limit.min(1024));
            let mut range =
                feed.range::<u64>((Bound::Excluded(since), Bound::Unbounded)).map_err(map_redb("read feed"))?;
            for entry in range.by_ref().take(limit) {
                let (seq, id) = entry.map_err(map_redb("read feed"))?;
                let (seq, id) = (seq.value(), id.value());
                let Some((header, deleted)) = header_of(&docs, &tombstones, id)? else {
                    return Err(Error::new(
                        ErrorKind::Corrupt,
                        format!("embedded store: the feed names {id:?}, which is not stored"),
                    ));
                };
                changes.push(Change {
                    seq: seq.to_string(),
                    id: id.to_owned(),
                    rev: header.rev.to_revision(),
                    deleted,
                });
            }
            let more = range.next().is_some();
            let last_seq = changes.last().map_or_else(|| since.to_string(), |c| c.seq.clone());
            Ok(ChangesPage { changes, last_seq, pending: (!more).then_some(0), unsettled: 0 })
        })
        .await
    }

    async fn change_position(&self) -> Result<String> {
        let store = self.describe();
        self.blocking(move |db| {
            let txn = db.begin_read().map_err(map_redb("begin read"))?;
            let (meta, feed) = feed_tables(&txn, &store)?;
            Ok((next_feed_position(&feed, &meta)? - 1).to_string())
        })
        .await
    }

    fn change_feed_delay(&self) -> std::time::Duration {
        // One writer at a time assigns feed positions in commit order.
        std::time::Duration::ZERO
    }

    async fn all_docs(&self, range: &IdRange, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        let (range, after, limit) = (range.clone(), page_token.map(str::to_owned), limit.max(1));
        self.blocking(move |db| {
            let txn = db.begin_read().map_err(map_redb("begin read"))?;
            let docs = txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
            let (lower, upper) = all_docs_bounds(&range, after.as_deref());
            if is_empty_range(&lower, &upper) {
                return Ok(Page { items: Vec::new(), next: None });
            }
            id_ordered_page(&docs, (lower, upper), range.descending, limit)
        })
        .await
    }

    async fn erase_prefix(&self, prefix: &str) -> Result<u64> {
        let mut erased = 0;
        loop {
            let prefix = prefix.to_owned();
            let batch = self
                .write(ERASE_BATCH, move |tables| {
                    let mut ids = Vec::new();
                    for table in [&tables.docs, &tables.tombstones] {
                        for entry in table.range::<&str>(prefix.as_str()..).map_err(map_redb("find documents"))? {
                            let (id, _) = entry.map_err(map_redb("find documents"))?;
                            if !id.value().starts_with(prefix.as_str()) || ids.len() >= ERASE_BATCH {
                                break;
                            }
                            ids.push(id.value().to_owned());
                        }
                    }
                    let mut count = 0;
                    for id in &ids {
                        count += u64::from(tables.erase(id)?);
                    }
                    Ok(count)
                })
                .await?;
            erased += batch;
            if batch == 0 {
                return Ok(erased);
            }
        }
    }

    async fn get_local(&self, name: &str) -> Result<Option<StoredDocument>> {
        let name = name.to_owned();
        self.blocking(move |db| {
            let txn = db.begin_read().map_err(map_redb("begin read"))?;
            let local = txn.open_table(LOCAL).map_err(map_redb("open local table"))?;
            let Some(guard) = local.get(name.as_str()).map_err(map_redb("read local document"))? else {
                return Ok(None);
            };
            let (n, body) = decode_local(&name, guard.value())?;
            Ok(Some(StoredDocument { id: format!("{LOCAL_PREFIX}{name}"), rev: local_revision(n), body }))
        })
        .await
    }

    async fn put_local(&self, name: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision> {
        let (name, json) = (name.to_owned(), encode_json(name, body)?);
        self.write(1, move |tables| {
            let current = match tables.local.get(name.as_str()).map_err(map_redb("read local document"))? {
                Some(guard) => Some(decode_local(&name, guard.value())?.0),
                None => None,
            };
            let id = format!("{LOCAL_PREFIX}{name}");
            let rev = next_local_revision(&id, &precondition, current.map(local_revision).as_ref())?;
            let n = local_number(&rev).unwrap_or(1);
            tables.local.insert(name.as_str(), encode_local(n, &json).as_slice()).map_err(map_redb("write local"))?;
            Ok(rev)
        })
        .await
    }

    async fn delete_local(&self, name: &str, rev: &Revision) -> Result<()> {
        let (name, expected) = (name.to_owned(), rev.clone());
        self.write(1, move |tables| {
            let current = match tables.local.get(name.as_str()).map_err(map_redb("read local document"))? {
                Some(guard) => decode_local(&name, guard.value())?.0,
                None => return Err(Error::not_found(format!("document \"{LOCAL_PREFIX}{name}\" does not exist"))),
            };
            if local_revision(current) != expected {
                return Err(Error::conflict(format!(
                    "document \"{LOCAL_PREFIX}{name}\" is at revision 0-{current}, not {expected}"
                )));
            }
            tables.local.remove(name.as_str()).map_err(map_redb("delete local document"))?;
            Ok(())
        })
        .await
    }

    async fn layout(&self) -> Result<LayoutState> {
        self.blocking(|db| {
            let txn = db.begin_read().map_err(map_redb("begin read"))?;
            layout_of(&txn.open_table(META).map_err(map_redb("open meta table"))?)
        })
        .await
    }

    async fn upgrade_page(&self, page_token: Option<&str>, limit: usize) -> Result<UpgradePage> {
        let (after, limit) = (page_token.map(str::to_owned), limit.max(1));
        self.write(limit, move |tables| {
            let lower = after.as_deref().map_or(Bound::Unbounded, Bound::Excluded);
            let mut ids = Vec::with_capacity(limit.min(4096));
            for entry in tables.docs.range::<&str>((lower, Bound::Unbounded)).map_err(map_redb("read documents"))? {
                if ids.len() == limit {
                    break;
                }
                ids.push(entry.map_err(map_redb("read documents"))?.0.value().to_owned());
            }
            let mut page = UpgradePage { examined: ids.len() as u64, ..UpgradePage::default() };
            for id in &ids {
                page.upgraded += u64::from(tables.upgrade_one(id)?);
            }
            page.next = if ids.len() == limit { ids.pop() } else { None };
            Ok(page)
        })
        .await
    }

    async fn finish_upgrade(&self) -> Result<()> {
        self.write(1, |tables| {
            // Refuse to mark the file current while a record still lacks its feed position.
            for entry in tables.docs.iter().map_err(map_redb("read documents"))? {
                let (id, stored_record) = entry.map_err(map_redb("read documents"))?;
                if record::split(id.value(), stored_record.value())?.0.seq.is_none() {
                    return Err(Error::new(
                        ErrorKind::Misconfigured,
                        format!("document {:?} has not been upgraded yet; run the upgrade to the end", id.value()),
                    ));
                }
            }
            tables.meta.insert(META_LAYOUT, LAYOUT_CURRENT).map_err(map_redb("write layout"))?;
            Ok(())
        })
        .await
    }

    async fn approximate_count(&self) -> Result<Option<u64>> {
        self.exact_count().await
    }

    async fn exact_count(&self) -> Result<Option<u64>> {
        self.blocking(|db| {
            let txn = db.begin_read().map_err(map_redb("begin read"))?;
            let docs = txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
            Ok(Some(docs.len().map_err(map_redb("count documents"))?))
        })
        .await
    }
}

/// Writes a store file as the previous release did (records without feed positions, no layout
/// mark, the first half with plain-counter revisions as the oldest releases wrote), for tests of
/// `agentstore upgrade`. Not for production use.
#[doc(hidden)]
pub fn write_previous_release_file(path: &Path, documents: &[(String, Map<String, Value>)]) -> Result<()> {
    let db = Database::create(path).map_err(map_redb("create file"))?;
    let txn = db.begin_write().map_err(map_redb("begin write"))?;
    {
        let mut docs = txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
        let mut index = txn.open_table(BY_USER_NAMESPACE).map_err(map_redb("open index table"))?;
        for (n, (id, body)) in documents.iter().enumerate() {
            let rev = if n < documents.len() / 2 {
                StoredRevision::Counter(n as u64 + 1)
            } else {
                StoredRevision::Minted(RevisionId::next_after(None)?)
            };
            let stored = record::encode_previous(&rev, &encode_json(id, body)?);
            docs.insert(id.as_str(), stored.as_slice()).map_err(map_redb("write document"))?;
            if let Some((user, ns)) = index_key(body) {
                index.insert((user.as_str(), ns.as_str(), id.as_str()), ()).map_err(map_redb("update index"))?;
            }
        }
    }
    txn.commit().map_err(map_redb("commit"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(key: &str, value: Value) -> Map<String, Value> {
        let mut body = Map::new();
        body.insert(fields::USER_ID.into(), "u".into());
        body.insert(fields::NAMESPACE.into(), "ns".into());
        body.insert(fields::KEY.into(), key.into());
        body.insert("value".into(), value);
        body
    }

    /// A job writing document `key` (create-only), and the channel its answer comes on.
    fn create_job(key: &str) -> (Job, tokio::sync::oneshot::Receiver<Result<Revision>>) {
        let write = EncodedWrite::new(&format!("u:ns:{key}"), &body(key, Value::from(1)), Precondition::MustNotExist)
            .expect("encodes");
        let (answer, answered) = tokio::sync::oneshot::channel();
        (job_of(move |tables| tables.write_one(&write), answer), answered)
    }

    /// A group whose middle job refuses cleanly commits the others and answers the refusal; a
    /// group whose middle job fails after writing is rolled back whole (the jobs before it are
    /// told to try again, nothing of them or of it is stored) and the jobs after it commit in a
    /// transaction of their own.
    #[tokio::test]
    async fn a_group_survives_a_refusal_and_rolls_back_a_broken_job_alone() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedBackend::open(&dir.path().join("s.redb")).await.unwrap();
        store.put("u:ns:taken", &body("taken", Value::from(0)), Precondition::MustNotExist).await.unwrap();

        let (first, first_answer) = create_job("one");
        let (refused, refused_answer) = create_job("taken");
        let (last, last_answer) = create_job("two");
        store.commits.run_group(vec![first, refused, last]);
        assert!(first_answer.await.unwrap().is_ok());
        assert_eq!(refused_answer.await.unwrap().unwrap_err().kind(), ErrorKind::Conflict);
        assert!(last_answer.await.unwrap().is_ok());

        let (before, before_answer) = create_job("before");
        let (broken_answer_to, broken_answer) = tokio::sync::oneshot::channel::<Result<()>>();
        let write = EncodedWrite::new("u:ns:broken", &body("broken", Value::from(1)), Precondition::MustNotExist)
            .expect("encodes");
        // Writes, then refuses: the feed counter moved, so this is no clean refusal.
        let broken = job_of(
            move |tables| {
                tables.write_one(&write)?;
                Err(Error::conflict("refused after writing"))
            },
            broken_answer_to,
        );
        let (after, after_answer) = create_job("after");
        store.commits.run_group(vec![before, broken, after]);
        assert_eq!(before_answer.await.unwrap().unwrap_err().kind(), ErrorKind::Unavailable);
        assert_eq!(broken_answer.await.unwrap().unwrap_err().kind(), ErrorKind::Conflict);
        assert!(after_answer.await.unwrap().is_ok());
        for (key, stored) in [("one", true), ("two", true), ("before", false), ("broken", false), ("after", true)] {
            let found = store.get(&format!("u:ns:{key}")).await.unwrap().is_some();
            assert_eq!(found, stored, "{key}");
        }
        let feed = store.changes(None, 100).await.unwrap();
        let fed: Vec<&str> = feed.changes.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(
            fed,
            ["u:ns:taken", "u:ns:one", "u:ns:two", "u:ns:after"],
            "the rolled-back writes left no feed entry"
        );
    }

    /// Hundreds of concurrent writers: each is answered with a revision that reads back, also
    /// after the file is closed and opened again, and concurrent updates of one document at one
    /// revision let exactly one through.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_writers_share_commits_and_lose_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.redb");
        let store = EmbeddedBackend::open(&path).await.unwrap();
        let base = store.put("u:ns:shared", &body("shared", Value::from(0)), Precondition::MustNotExist).await.unwrap();
        let mut tasks = Vec::new();
        for i in 0..300 {
            let store = store.clone();
            let base = base.clone();
            tasks.push(tokio::spawn(async move {
                let key = format!("k{i}");
                let rev =
                    store.put(&format!("u:ns:{key}"), &body(&key, Value::from(i)), Precondition::MustNotExist).await;
                let update =
                    store.put("u:ns:shared", &body("shared", Value::from(i)), Precondition::MatchRevision(base)).await;
                (key, rev.unwrap(), update.is_ok())
            }));
        }
        let mut written = Vec::new();
        let mut updates_through = 0;
        for task in tasks {
            let (key, rev, updated) = task.await.unwrap();
            updates_through += usize::from(updated);
            written.push((key, rev));
        }
        assert_eq!(updates_through, 1, "one update at the base revision, the others conflict");
        drop(store);
        let reopened = EmbeddedBackend::open(&path).await.unwrap();
        for (key, rev) in written {
            let doc = reopened.get(&format!("u:ns:{key}")).await.unwrap().unwrap_or_else(|| panic!("{key} lost"));
            assert_eq!(doc.rev, rev, "{key}");
        }
        assert_eq!(generation_of(&reopened.get("u:ns:shared").await.unwrap().unwrap().rev), 2);
    }

    /// `N-<32 lowercase hex>`, and N.
    fn generation_of(rev: &Revision) -> u64 {
        let (generation, token) = rev.as_str().split_once('-').unwrap_or_else(|| panic!("{rev} has no '-'"));
        assert!(
            token.len() == 32 && token.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            "{rev}: the part after '-' is not 32 lowercase hex digits"
        );
        assert!(!generation.starts_with('0'), "{rev}: generation with a leading zero");
        generation.parse().unwrap_or_else(|_| panic!("{rev}: generation is not a number"))
    }

    #[tokio::test]
    async fn revisions_count_only_the_documents_own_writes() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedBackend::open(&dir.path().join("store.redb")).await.unwrap();
        let mut rev_a = store.put("a", &body("a", Value::from(0)), Precondition::MustNotExist).await.unwrap();
        let mut rev_b = store.put("b", &body("b", Value::from(0)), Precondition::MustNotExist).await.unwrap();
        assert_eq!((generation_of(&rev_a), generation_of(&rev_b)), (1, 1));
        // Interleaved: b is written three times for each write of a.
        for round in 1..=4u64 {
            rev_a = store.put("a", &body("a", round.into()), Precondition::MatchRevision(rev_a)).await.unwrap();
            for _ in 0..3 {
                rev_b = store.put("b", &body("b", round.into()), Precondition::MatchRevision(rev_b)).await.unwrap();
            }
            assert_eq!(generation_of(&rev_a), 1 + round, "a's generation counts a's writes only");
        }
        assert_eq!(generation_of(&rev_b), 13);
        // Bulk writes too, and what is read is what was returned.
        let results = store
            .bulk_write(vec![
                BulkWrite {
                    id: "a".into(),
                    body: body("a", 9.into()),
                    precondition: Precondition::MatchRevision(rev_a),
                },
                BulkWrite { id: "c".into(), body: body("c", 9.into()), precondition: Precondition::MustNotExist },
            ])
            .await
            .unwrap();
        let (new_a, new_c) = (results[0].as_ref().unwrap().clone(), results[1].as_ref().unwrap().clone());
        assert_eq!((generation_of(&new_a), generation_of(&new_c)), (6, 1));
        assert_eq!(store.get("a").await.unwrap().unwrap().rev, new_a);
        assert_ne!(new_c.as_str()[2..], rev_b.as_str()[3..], "random parts differ");
    }

    #[tokio::test]
    async fn files_with_counter_revisions_still_work() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.redb");
        // A file as older releases wrote it: the counter in `meta`, records with the counter.
        {
            let db = Database::create(&path).unwrap();
            let txn = db.begin_write().unwrap();
            {
                let mut docs = txn.open_table(DOCS).unwrap();
                let mut index = txn.open_table(BY_USER_NAMESPACE).unwrap();
                let mut meta = txn.open_table(TableDefinition::<&str, u64>::new("meta")).unwrap();
                for (n, id) in [(41u64, "old-1"), (42, "old-2")] {
                    let json = serde_json::to_vec(&body(id, Value::from(n))).unwrap();
                    docs.insert(id, record::encode_previous(&StoredRevision::Counter(n), &json).as_slice()).unwrap();
                    index.insert(("u", "ns", id), ()).unwrap();
                }
                meta.insert("seq", 42).unwrap();
            }
            txn.commit().unwrap();
        }
        let store = EmbeddedBackend::open(&path).await.unwrap();
        let old = store.get("old-1").await.unwrap().unwrap();
        assert_eq!(old.rev, Revision("41".into()));
        assert_eq!(old.body["value"], 41);
        // A stale counter is refused; the current one updates, and the next revision is generation 2.
        let stale = Precondition::MatchRevision(Revision("40".into()));
        assert_eq!(store.put("old-1", &body("old-1", 0.into()), stale).await.unwrap_err().kind(), ErrorKind::Conflict);
        let updated = store.put("old-1", &body("old-1", 1.into()), Precondition::MatchRevision(old.rev)).await.unwrap();
        assert_eq!(generation_of(&updated), 2);
        // Old and new records side by side: listing, scanning, batch reads and deletes.
        let query = Query { user_id: "u".into(), namespace: Some("ns".into()), projection: Projection::All };
        assert_eq!(store.query(&query, 10, None).await.unwrap().items.len(), 2);
        assert_eq!(store.scan(10, None).await.unwrap().items.len(), 2);
        let both = store.get_many(&["old-2".into(), "old-1".into()]).await.unwrap();
        assert_eq!(both[0].as_ref().unwrap().rev, Revision("42".into()));
        assert_eq!(both[1].as_ref().unwrap().rev, updated);
        store.delete("old-2", &Revision("42".into())).await.unwrap();
        assert!(store.get("old-2").await.unwrap().is_none());
    }

    #[tokio::test]
    async fn a_previous_release_file_is_upgraded_in_resumable_steps() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.redb");
        let documents: Vec<(String, Map<String, Value>)> =
            (0..10).map(|n| (format!("u:ns:k{n:02}"), body(&format!("k{n:02}"), n.into()))).collect();
        write_previous_release_file(&path, &documents).unwrap();
        let store = EmbeddedBackend::open(&path).await.unwrap();
        assert!(matches!(store.layout().await.unwrap(), LayoutState::NeedsUpgrade(_)));
        let refused = store.changes(None, 10).await.unwrap_err();
        assert!(refused.message().contains("agentstore upgrade --backend"), "{refused}");
        // Everything that worked before still works: a write even lands in the feed already.
        let old = store.get("u:ns:k09").await.unwrap().unwrap();
        store.put("u:ns:k09", &body("k09", 99.into()), Precondition::MatchRevision(old.rev)).await.unwrap();
        assert_eq!(store.finish_upgrade().await.unwrap_err().kind(), ErrorKind::Misconfigured, "not yet upgraded");

        // Three steps, then "a crash": start again from the first step's token.
        let first = store.upgrade_page(None, 3).await.unwrap();
        assert_eq!((first.examined, first.upgraded), (3, 3));
        let second = store.upgrade_page(first.next.as_deref(), 3).await.unwrap();
        assert_eq!(second.upgraded, 3);
        let mut token = first.next.clone();
        let mut upgraded = 6;
        loop {
            let page = store.upgrade_page(token.as_deref(), 3).await.unwrap();
            upgraded += page.upgraded;
            match page.next {
                Some(next) => token = Some(next),
                None => break,
            }
        }
        assert_eq!(upgraded, 9, "every old record once; the one written since was already current");
        store.finish_upgrade().await.unwrap();
        assert_eq!(store.layout().await.unwrap(), LayoutState::Current);
        let feed = store.changes(None, 100).await.unwrap();
        let mut ids: Vec<&str> = feed.changes.iter().map(|c| c.id.as_str()).collect();
        ids.sort_unstable();
        let expected: Vec<&str> = documents.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, expected, "every document in the feed exactly once");
        for change in &feed.changes {
            let current = store.get(&change.id).await.unwrap().unwrap();
            assert_eq!(change.rev, current.rev);
            generation_of(&current.rev);
            let info = store.revisions(&change.id).await.unwrap().unwrap();
            assert_eq!(info.ancestry.revisions().next(), Some(current.rev));
        }
    }

    /// Erasing the document at the head of the feed must not let the next write take a position
    /// a follower has already passed.
    #[tokio::test]
    async fn positions_are_never_handed_out_twice_after_an_erasure() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store.redb");
        let store = EmbeddedBackend::open(&path).await.unwrap();
        store.put("keep:ns:a", &body("a", 1.into()), Precondition::MustNotExist).await.unwrap();
        store.put("gone:ns:b", &body("b", 1.into()), Precondition::MustNotExist).await.unwrap();
        let follower = store.changes(None, 10).await.unwrap().last_seq;
        assert_eq!(store.erase_prefix("gone:").await.unwrap(), 1);
        // Also across a reopen: the floor is in the file.
        drop(store);
        let store = EmbeddedBackend::open(&path).await.unwrap();
        assert_eq!(store.change_position().await.unwrap(), follower, "now is still past the erased position");
        store.put("keep:ns:c", &body("c", 1.into()), Precondition::MustNotExist).await.unwrap();
        let seen: Vec<String> =
            store.changes(Some(&follower), 10).await.unwrap().changes.into_iter().map(|c| c.id).collect();
        assert_eq!(seen, ["keep:ns:c"], "the follower sees the write made after the erasure");
    }
}
