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

use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use redb::{Database, ReadableDatabase, ReadableTable};
use serde_json::{Map, Value};

use super::error::{join_error, map_redb};
use super::group_commit::{job_of, GroupCommit, Persistence};
use super::write::{EncodedWrite, ReplicatedWrite, Tables};
use super::{attachments, codec, core, feed, ids, local};
use crate::backend::revision::{random_token, random_tokens};
use crate::backend::{
    BulkWrite, BulkWriteText, ChangesPage, DocumentBackend, EraseOptions, IdRange, LayoutState, Page, Precondition,
    Query, RecordWithLocal, ReplicatedLeaf, ReplicatedOutcome, ReplicatedRevision, Revision, RevisionInfo,
    StoredDocument, StoredText, UpgradePage, DEFAULT_REVS_LIMIT,
};
use crate::error::{Error, ErrorKind, Result};

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
    options: EmbeddedOptions,
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
            core::create_tables(&db)?;
            Ok(db)
        })
        .await
        .map_err(join_error)??;
        let db = Arc::new(db);
        let commits = GroupCommit::new(&db, options.revs_limit);
        Ok(EmbeddedBackend { db, commits, path: opened, options })
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

    /// How many write transactions the store has begun since it was opened (each ends in one
    /// fsync'd commit or a rollback): the tests' witness that writes made together share
    /// commits ([`group_commit`]).
    pub fn write_transactions(&self) -> u64 {
        self.commits.transactions()
    }

    /// How many of those were committed durably (each one fsync): attachment chunks commit
    /// without one, made durable by the next durable commit ([`group_commit`]).
    pub fn durable_commits(&self) -> u64 {
        self.commits.durable_commits()
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
        self.write_as(documents, Persistence::Durable, work).await
    }

    /// [`EmbeddedBackend::write`], answered once the commit is made as `persistence` says: a
    /// [`Persistence::Deferred`] write is answered without an fsync of its own and is durable
    /// once the next durable commit is ([`group_commit`]).
    async fn write_as<T, F>(&self, documents: usize, persistence: Persistence, work: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Tables<'_>) -> Result<T> + Send + 'static,
    {
        let (answer, answered) = tokio::sync::oneshot::channel::<Result<T>>();
        let job = job_of(work, answer);
        self.commits.submit(documents, persistence, job);
        answered.await.map_err(|_| {
            Error::new(
                ErrorKind::Unavailable,
                "embedded store: the write was not applied (its transaction failed; the log says why); try again",
            )
        })?
    }

    /// Writes encoded before the transaction, in one write of the group commit: each answered
    /// on its own (one that could not be encoded, or whose precondition fails, fails alone).
    async fn write_encoded(&self, encoded: Vec<Result<EncodedWrite>>) -> Result<Vec<Result<Revision>>> {
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
}

#[async_trait]
impl DocumentBackend for EmbeddedBackend {
    fn describe(&self) -> String {
        format!("embedded:{}", self.path.display())
    }

    fn url(&self) -> Option<crate::backend::BackendUrl> {
        Some(crate::backend::BackendUrl::Embedded { path: self.path.clone(), options: self.options })
    }

    async fn get(&self, id: &str) -> Result<Option<StoredDocument>> {
        Ok(self.get_many(&[id.to_owned()]).await?.pop().flatten())
    }

    async fn get_many(&self, ids: &[String]) -> Result<Vec<Option<StoredDocument>>> {
        let ids = ids.to_vec();
        self.blocking(move |db| core::get_many(db, &ids)).await
    }

    async fn get_many_text(&self, ids: &[String]) -> Result<Option<Vec<Option<StoredText>>>> {
        let ids = ids.to_vec();
        self.blocking(move |db| ids::get_many_text(db, &ids)).await.map(Some)
    }

    /// One read transaction on one trip to the blocking pool.
    async fn record_with_local(&self, id: &str, local_name: &str) -> Result<Option<RecordWithLocal>> {
        let (id, local_name) = (id.to_owned(), local_name.to_owned());
        self.blocking(move |db| {
            let txn = db.begin_read().map_err(map_redb("begin read"))?;
            Ok(Some(RecordWithLocal {
                record: core::record_text_in(&txn, &id)?,
                local: local::get_in(&txn, &local_name)?,
            }))
        })
        .await
    }

    async fn put(&self, id: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision> {
        let write = EncodedWrite::new(id, body, precondition, random_token()?)?;
        self.write(1, move |tables| tables.write_one(&write)).await
    }

    async fn delete(&self, id: &str, rev: &Revision) -> Result<Revision> {
        let (id, expected) = (id.to_owned(), rev.clone());
        let token = random_token()?;
        self.write(1, move |tables| tables.delete_one(&id, &expected, token)).await
    }

    async fn put_replicated(&self, id: &str, incoming: &ReplicatedRevision) -> Result<ReplicatedOutcome> {
        // Checked and encoded first: a refused revision changes nothing and takes no write lock.
        let write = ReplicatedWrite::new(id, incoming)?;
        self.write(1, move |tables| tables.write_replicated(&write)).await
    }

    /// Checked and encoded first, each from its borrowed body (one that cannot be fails alone),
    /// then written in one job of the group commit, in order: one transaction and one fsync'd
    /// commit for all of them. A refused precondition is that write's outcome alone; a storage
    /// failure fails the job, and the transaction is rolled back (nothing of it written).
    async fn put_replicated_leaves(&self, leaves: &[ReplicatedLeaf<'_>]) -> Result<Vec<Result<ReplicatedOutcome>>> {
        let encoded: Vec<Result<ReplicatedWrite>> = leaves.iter().map(ReplicatedWrite::of_leaf).collect();
        self.write(encoded.len(), move |tables| {
            let mut outcomes = Vec::with_capacity(encoded.len());
            for write in encoded {
                let outcome = match write {
                    Ok(write) => match tables.write_replicated(&write) {
                        Err(e) if e.kind() != ErrorKind::Conflict => return Err(e),
                        other => other,
                    },
                    Err(e) => Err(e),
                };
                outcomes.push(outcome);
            }
            Ok(outcomes)
        })
        .await
    }

    async fn query(&self, query: &Query, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        let query = query.clone();
        let after = page_token.map(core::decode_query_token).transpose()?;
        let limit = limit.max(1);
        self.blocking(move |db| core::query_page(db, &query, after, limit)).await
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
        let tokens = random_tokens(writes.len())?;
        let encoded: Vec<Result<EncodedWrite>> = writes
            .into_iter()
            .zip(tokens)
            .map(|(w, token)| EncodedWrite::new(&w.id, &w.body, w.precondition, token))
            .collect();
        self.write_encoded(encoded).await
    }

    /// The text is stored as it is: no values built, none encoded.
    async fn put_text(
        &self,
        id: &str,
        json: &serde_json::value::RawValue,
        precondition: Precondition,
    ) -> Result<Revision> {
        let write = EncodedWrite::from_text(id, json, precondition, random_token()?)?;
        self.write(1, move |tables| tables.write_one(&write)).await
    }

    async fn bulk_write_text(&self, writes: Vec<BulkWriteText>) -> Result<Vec<Result<Revision>>> {
        let tokens = random_tokens(writes.len())?;
        let encoded: Vec<Result<EncodedWrite>> = writes
            .into_iter()
            .zip(tokens)
            .map(|(w, token)| EncodedWrite::from_text(&w.id, &w.json, w.precondition, token))
            .collect();
        self.write_encoded(encoded).await
    }

    async fn scan(&self, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        let (after, limit) = (page_token.map(str::to_owned), limit.max(1));
        self.blocking(move |db| ids::scan(db, after, limit)).await
    }

    async fn health(&self) -> Result<()> {
        self.blocking(core::health).await
    }

    async fn revisions(&self, id: &str) -> Result<Option<RevisionInfo>> {
        let id = id.to_owned();
        self.blocking(move |db| core::revisions(db, &id)).await
    }

    async fn revisions_many(&self, ids: &[String]) -> Result<Vec<Option<RevisionInfo>>> {
        let ids = ids.to_vec();
        self.blocking(move |db| core::revisions_many(db, &ids)).await
    }

    async fn get_deleted(&self, id: &str) -> Result<Option<StoredDocument>> {
        let id = id.to_owned();
        self.blocking(move |db| core::get_deleted(db, &id)).await
    }

    async fn changes(&self, since: Option<&str>, limit: usize) -> Result<ChangesPage> {
        let since = since.map(feed::decode_feed_token).transpose()?.unwrap_or(0);
        let limit = limit.max(1);
        let store = self.describe();
        self.blocking(move |db| feed::changes(db, &store, since, limit, feed::PENDING_COUNT_BOUND)).await
    }

    /// Counts no further than the first change after the page.
    async fn changes_to_end(&self, since: Option<&str>, limit: usize) -> Result<ChangesPage> {
        let since = since.map(feed::decode_feed_token).transpose()?.unwrap_or(0);
        let limit = limit.max(1);
        let store = self.describe();
        self.blocking(move |db| feed::changes(db, &store, since, limit, 1)).await
    }

    async fn change_position(&self) -> Result<String> {
        let store = self.describe();
        self.blocking(move |db| feed::change_position(db, &store)).await
    }

    fn change_feed_delay(&self) -> std::time::Duration {
        // One writer at a time assigns feed positions in commit order.
        std::time::Duration::ZERO
    }

    /// Positions are the feed's counter: compared as numbers.
    fn position_order(&self, a: &str, b: &str) -> Option<std::cmp::Ordering> {
        Some(a.parse::<u64>().ok()?.cmp(&b.parse::<u64>().ok()?))
    }

    async fn all_docs(&self, range: &IdRange, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        let (range, after, limit) = (range.clone(), page_token.map(str::to_owned), limit.max(1));
        self.blocking(move |db| ids::all_docs(db, &range, after, limit)).await
    }

    async fn all_docs_stored_text(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> Result<Option<Page<StoredText>>> {
        let (range, after, limit) = (range.clone(), page_token.map(str::to_owned), limit.max(1));
        self.blocking(move |db| ids::all_docs(db, &range, after, limit)).await.map(Some)
    }

    async fn erase_prefix(&self, prefix: &str) -> Result<u64> {
        let mut erased = 0;
        loop {
            let prefix = prefix.to_owned();
            let batch = self.write(ids::ERASE_BATCH, move |tables| ids::erase_batch(tables, &prefix)).await?;
            erased += batch;
            if batch == 0 {
                return Ok(erased);
            }
        }
    }

    async fn erase_id(&self, id: &str, options: &EraseOptions) -> Result<bool> {
        let (id, if_revision) = (id.to_owned(), options.if_revision.clone());
        self.write(1, move |tables| tables.erase(&id, if_revision.as_ref())).await
    }

    async fn get_local(&self, name: &str) -> Result<Option<StoredDocument>> {
        let name = name.to_owned();
        self.blocking(move |db| local::get(db, &name)).await
    }

    async fn get_many_local(&self, names: &[String]) -> Result<Vec<Option<StoredDocument>>> {
        let names = names.to_vec();
        self.blocking(move |db| local::get_many(db, &names)).await
    }

    fn checks_never_written(&self) -> bool {
        // `write_one` sees the tombstone table in the write's own transaction.
        true
    }

    fn shared_with_other_processes(&self) -> bool {
        // redb holds the file under an exclusive lock: a second process cannot open it.
        false
    }

    async fn put_local(&self, name: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision> {
        let (name, json) = (name.to_owned(), codec::encode_json(name, body)?);
        self.write(1, move |tables| local::put(tables, &name, &json, &precondition)).await
    }

    async fn delete_local(&self, name: &str, rev: &Revision) -> Result<()> {
        let (name, expected) = (name.to_owned(), rev.clone());
        self.write(1, move |tables| local::delete(tables, &name, &expected)).await
    }

    async fn local_docs(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> Result<Page<StoredDocument>> {
        let (range, after, limit) = (range.clone(), page_token.map(str::to_owned), limit.max(1));
        self.blocking(move |db| local::list(db, &range, after, limit)).await
    }

    async fn layout(&self) -> Result<LayoutState> {
        self.blocking(core::layout).await
    }

    async fn upgrade_page(&self, page_token: Option<&str>, limit: usize) -> Result<UpgradePage> {
        let (after, limit) = (page_token.map(str::to_owned), limit.max(1));
        self.write(limit, move |tables| {
            let lower = after.as_deref().map_or(std::ops::Bound::Unbounded, std::ops::Bound::Excluded);
            let mut ids = Vec::with_capacity(limit.min(4096));
            for entry in
                tables.docs.range::<&str>((lower, std::ops::Bound::Unbounded)).map_err(map_redb("read documents"))?
            {
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
                if codec::split(id.value(), stored_record.value())?.0.seq.is_none() {
                    return Err(Error::new(
                        ErrorKind::Misconfigured,
                        format!("document {:?} has not been upgraded yet; run the upgrade to the end", id.value()),
                    ));
                }
            }
            tables.meta.insert(core::META_LAYOUT, core::LAYOUT_CURRENT).map_err(map_redb("write layout"))?;
            Ok(())
        })
        .await
    }

    async fn approximate_count(&self) -> Result<Option<u64>> {
        self.exact_count().await
    }

    async fn exact_count(&self) -> Result<Option<u64>> {
        self.blocking(core::count).await
    }

    fn attachment_chunk_bytes(&self) -> usize {
        attachments::CHUNK_BYTES
    }

    async fn put_attachment_chunk(&self, blob: &str, index: u64, bytes: bytes::Bytes) -> Result<()> {
        crate::backend::check_attachment_blob(blob)?;
        check_chunk_size(bytes.len())?;
        let blob = blob.to_owned();
        // No fsync of its own: no reader reaches a chunk before its manifest, a durable write
        // made after it, names it (the trait's contract; [`group_commit`]).
        self.write_as(attachments::CHUNK_WEIGHT, Persistence::Deferred, move |tables| {
            attachments::put(tables, &blob, index, &bytes)
        })
        .await
    }

    async fn get_attachment_chunk(&self, blob: &str, index: u64) -> Result<Option<bytes::Bytes>> {
        crate::backend::check_attachment_blob(blob)?;
        let blob = blob.to_owned();
        self.blocking(move |db| attachments::get(db, &blob, index)).await
    }

    async fn delete_attachment_blob(&self, blob: &str) -> Result<u64> {
        crate::backend::check_attachment_blob(blob)?;
        let mut deleted = 0;
        loop {
            let blob = blob.to_owned();
            let batch =
                self.write(attachments::CHUNK_WEIGHT, move |tables| attachments::delete_batch(tables, &blob)).await?;
            deleted += batch;
            if batch < attachments::DELETE_BATCH as u64 {
                return Ok(deleted);
            }
        }
    }

    async fn attachment_blobs(&self, limit: usize, page_token: Option<&str>) -> Result<Page<String>> {
        let after = page_token.map(|token| crate::backend::check_attachment_blob(token).map(|()| token.to_owned()));
        let (after, limit) = (after.transpose()?, limit.max(1));
        self.blocking(move |db| attachments::list(db, after, limit)).await
    }
}

/// Refuses a chunk larger than the backend's chunk size (the attachment store never writes one).
fn check_chunk_size(len: usize) -> Result<()> {
    if len > attachments::CHUNK_BYTES {
        return Err(Error::new(
            ErrorKind::TooLarge,
            format!(
                "an attachment chunk of {len} bytes; the embedded store takes at most {}",
                attachments::CHUNK_BYTES
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::embedded::codec::StoredRevision;
    use crate::backend::embedded::core::{write_previous_release_file, BY_USER_NAMESPACE, DOCS};
    use crate::backend::embedded::group_commit::Job;
    use crate::backend::Projection;
    use crate::model::fields;
    use redb::{ReadableDatabase, TableDefinition};
    use serde_json::json;

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
        let token = random_token().expect("a token");
        let write =
            EncodedWrite::new(&format!("u:ns:{key}"), &body(key, Value::from(1)), Precondition::MustNotExist, token)
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
        store.commits.run_group(vec![first, refused, last], Persistence::Durable);
        assert!(first_answer.await.unwrap().is_ok());
        assert_eq!(refused_answer.await.unwrap().unwrap_err().kind(), ErrorKind::Conflict);
        assert!(last_answer.await.unwrap().is_ok());

        let (before, before_answer) = create_job("before");
        let (broken_answer_to, broken_answer) = tokio::sync::oneshot::channel::<Result<()>>();
        let token = random_token().expect("a token");
        let write =
            EncodedWrite::new("u:ns:broken", &body("broken", Value::from(1)), Precondition::MustNotExist, token)
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
        store.commits.run_group(vec![before, broken, after], Persistence::Durable);
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

    /// A body written as text is stored as the same body written as values is: read back equal,
    /// the same bytes on disk, indexed under its `userId` and `namespace` (read from the text),
    /// its precondition checked; a body without them, or with one that is not a string, is in
    /// no index, as with values.
    #[tokio::test]
    async fn a_body_written_as_text_is_stored_as_its_values_are() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedBackend::open(&dir.path().join("store.redb")).await.unwrap();
        let text = |body: &Map<String, Value>| serde_json::value::to_raw_value(body).unwrap();
        let value = r#"{"deep": [1, 2.50, "é\u0000"], "big": 123456789012345678901234567890}"#;
        let indexed = body("t", serde_json::from_str(value).unwrap());
        store.put("values", &indexed, Precondition::MustNotExist).await.unwrap();
        let rev = store.put_text("text", &text(&indexed), Precondition::MustNotExist).await.unwrap();
        let err = store.put_text("text", &text(&indexed), Precondition::MustNotExist).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
        let mut unindexed = indexed.clone();
        unindexed.insert(fields::NAMESPACE.into(), json!(7));
        let bulk = vec![
            BulkWriteText { id: "text".into(), json: text(&indexed), precondition: Precondition::MatchRevision(rev) },
            BulkWriteText { id: "other".into(), json: text(&unindexed), precondition: Precondition::MustNotExist },
            BulkWriteText { id: "values".into(), json: text(&indexed), precondition: Precondition::MustNotExist },
        ];
        let answers = store.bulk_write_text(bulk).await.unwrap();
        assert!(answers[0].is_ok() && answers[1].is_ok(), "{answers:?}");
        assert_eq!(answers[2].as_ref().unwrap_err().kind(), ErrorKind::Conflict);
        let (values, written) =
            (store.get("values").await.unwrap().unwrap(), store.get("text").await.unwrap().unwrap());
        assert_eq!(written.body, values.body);
        assert_eq!(store.get("other").await.unwrap().unwrap().body, unindexed);
        let read = store.db.begin_read().unwrap();
        let docs = read.open_table(DOCS).unwrap();
        let stored = |id: &str| docs.get(id).unwrap().unwrap().value().to_vec();
        let (of_values, of_text) = (stored("values"), stored("text"));
        let json = |id: &str, record: &[u8]| codec::split(id, record).unwrap().1.to_vec();
        assert_eq!(json("text", &of_text), json("values", &of_values), "the same JSON stored");
        let query = Query { user_id: "u".into(), namespace: Some("ns".into()), projection: Projection::All };
        let listed = store.query(&query, 10, None).await.unwrap();
        let ids: Vec<&str> = listed.items.iter().map(|doc| doc.id.as_str()).collect();
        assert_eq!(ids, ["text", "values"], "indexed from the text, and not under a namespace that is no string");
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
                    docs.insert(id, codec::encode_previous(&StoredRevision::Counter(n), &json).as_slice()).unwrap();
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

    /// The text reads answer what the parsing reads answer, record for record, over records of
    /// every layout (the two older ones written by `write_previous_release_file`, then one in
    /// this release's), a missing id included; the listing's pages and page tokens too.
    #[tokio::test]
    async fn text_reads_hold_what_the_parsed_reads_hold_in_every_layout() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.redb");
        let documents: Vec<(String, Map<String, Value>)> = (0..6)
            .map(|n| (format!("u:ns:k{n:02}"), body(&format!("k{n:02}"), serde_json::json!({"n": n, "s": "é\"x"}))))
            .collect();
        write_previous_release_file(&path, &documents).unwrap();
        let store = EmbeddedBackend::open(&path).await.unwrap();
        store.put("u:ns:k99", &body("k99", Value::from(99)), Precondition::MustNotExist).await.unwrap();
        let mut ids: Vec<String> = documents.iter().map(|(id, _)| id.clone()).collect();
        ids.extend(["u:ns:k99".to_owned(), "u:ns:missing".to_owned()]);
        let parsed = store.get_many(&ids).await.unwrap();
        let texts = store.get_many_text(&ids).await.unwrap().expect("the embedded store keeps text");
        assert_eq!(texts.len(), ids.len());
        let as_documents = |texts: Vec<Option<StoredText>>| -> Vec<Option<StoredDocument>> {
            texts
                .into_iter()
                .map(|text| {
                    text.map(|t| StoredDocument {
                        id: t.id,
                        rev: t.rev,
                        body: serde_json::from_slice(&t.json).unwrap(),
                    })
                })
                .collect()
        };
        assert_eq!(as_documents(texts), parsed);
        assert!(parsed[0].as_ref().is_some_and(|doc| doc.rev.as_str() == "1"), "a counter record among them");
        assert!(parsed[7].is_none());

        let range = IdRange::all();
        let (mut token, mut pages) = (None::<String>, 0);
        loop {
            let listed = store.all_docs(&range, 4, token.as_deref()).await.unwrap();
            let text = store.all_docs_stored_text(&range, 4, token.as_deref()).await.unwrap().expect("text");
            assert_eq!(text.next, listed.next);
            assert_eq!(
                as_documents(text.items.into_iter().map(Some).collect()),
                listed.items.into_iter().map(Some).collect::<Vec<_>>()
            );
            pages += 1;
            match listed.next {
                Some(next) => token = Some(next),
                None => break,
            }
        }
        assert_eq!(pages, 2);
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

    /// Erasing one id takes no other (not one that starts with it), and the end of the feed a
    /// read reports stays where it was when the erased id was the newest change.
    #[tokio::test]
    async fn erasing_one_id_keeps_the_others_and_the_feed_end() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedBackend::open(&dir.path().join("store.redb")).await.unwrap();
        let longer = store.put("abcd", &body("a", 1.into()), Precondition::MustNotExist).await.unwrap();
        let tombstone = store.delete("abcd", &longer).await.unwrap();
        store.put("abc", &body("b", 1.into()), Precondition::MustNotExist).await.unwrap();
        let before = store.changes(None, 10).await.unwrap().last_seq;
        assert!(store.erase_id("abc", &EraseOptions::default()).await.unwrap());
        assert!(!store.erase_id("abc", &EraseOptions::default()).await.unwrap(), "nothing left to erase");
        let after = store.changes(None, 10).await.unwrap();
        let listed: Vec<(&str, bool)> = after.changes.iter().map(|c| (c.id.as_str(), c.deleted)).collect();
        assert_eq!(listed, [("abcd", true)]);
        assert_eq!(after.changes[0].rev, tombstone);
        assert_eq!(after.last_seq, before, "the feed's end did not move back");
        assert_eq!(store.changes(Some(&before), 10).await.unwrap().last_seq, before);
    }

    /// A page read for an index catch-up tells only whether it reaches the end (`Some(0)`) or not
    /// (`None`), with the same changes and position as the counted read.
    #[tokio::test]
    async fn a_page_read_to_its_end_tells_the_end_without_counting_what_waits() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedBackend::open(&dir.path().join("s.redb")).await.unwrap();
        for key in ["a", "b", "c"] {
            store.put(&format!("u:ns:{key}"), &body(key, Value::from(1)), Precondition::MustNotExist).await.unwrap();
        }
        let counted = store.changes(None, 1).await.unwrap();
        assert_eq!(counted.pending, Some(2));
        let to_end = store.changes_to_end(None, 1).await.unwrap();
        assert_eq!(to_end.pending, None, "more follow");
        assert_eq!(to_end.changes, counted.changes);
        assert_eq!(to_end.last_seq, counted.last_seq);
        let rest = store.changes_to_end(Some(&to_end.last_seq), 2).await.unwrap();
        assert_eq!(rest.pending, Some(0), "the page reaches the end");
        assert_eq!(rest.changes.len(), 2);
        assert_eq!(rest.last_seq, store.changes(None, 3).await.unwrap().last_seq);
    }

    /// `pending` is the same count whichever end of the feed it is counted from (the entries
    /// after the page, or the feed's length less those up to it: `feed::waiting_after`), on a
    /// feed with gaps (documents changed again move to its end, an erased one leaves none), and
    /// turns into "more follow" at the bound from either end.
    #[tokio::test]
    async fn pending_counts_the_same_from_either_end_of_the_feed() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedBackend::open(&dir.path().join("s.redb")).await.unwrap();
        let mut revs = Vec::new();
        for n in 0..40 {
            let id = format!("u:ns:k{n:02}");
            revs.push(store.put(&id, &body("k", Value::from(n)), Precondition::MustNotExist).await.unwrap());
        }
        for n in (0..40).step_by(3) {
            let id = format!("u:ns:k{n:02}");
            store
                .put(&id, &body("k", Value::from(n + 100)), Precondition::MatchRevision(revs[n].clone()))
                .await
                .unwrap();
        }
        assert!(store.erase_id("u:ns:k07", &EraseOptions::default()).await.unwrap());
        let whole = store.changes(None, 1000).await.unwrap();
        let positions: Vec<u64> = whole.changes.iter().map(|c| c.seq.parse().unwrap()).collect();
        assert_eq!((positions.len(), whole.pending), (39, Some(0)));
        let highest = *positions.last().unwrap();
        for since in 0..=highest {
            for limit in [1, 5, 30] {
                let page = store.changes(Some(&since.to_string()), limit).await.unwrap();
                let last = page.changes.last().map_or(since, |c| c.seq.parse().unwrap());
                let after = positions.iter().filter(|&&p| p > last).count() as u64;
                assert_eq!(page.pending, Some(after), "since {since}, limit {limit}");
                for bound in [1, 4, 10] {
                    let bounded = feed::changes(&store.db, "s", since, limit, bound).unwrap();
                    let expected = (after < bound as u64).then_some(after);
                    assert_eq!(bounded.pending, expected, "since {since}, limit {limit}, bound {bound}");
                    assert_eq!(bounded.changes, page.changes);
                    assert_eq!(bounded.last_seq, page.last_seq);
                }
            }
        }
    }
}
