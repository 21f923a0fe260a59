//! Bringing a view group up to date: reading the database's change feed from the group's
//! checkpoint ([`ViewSource`], any database: the data-store one or another), mapping what
//! changed, and writing the rows with the new checkpoint.
//!
//! One update of a group runs at a time in this process (a lock per group); a query that wants
//! the index current waits for the running update, then runs its own catch-up, which finds
//! nothing or little left. An update reads the feed until a page reports its end *as that read
//! saw it*: every write acknowledged before the update began is in the feed by then (the feed's
//! guarantee, docs/change-feed.md), so a view read after a write reflects it.
//!
//! Memory is bounded by the page size and [`BuildBounds`]: [`FEED_PAGE`] documents are read at a
//! time, each within the database's `max_document_bytes`; their rows are held at most
//! [`BuildBounds::batch_bytes`] at a time (written, then the page's next documents mapped), and a
//! document whose rows pass a per-document bound is left out of the index and logged, as
//! CouchDB's `couch_views` does with its key and value size limits. A database's index stops
//! growing at [`BuildBounds::max_index_bytes`]: the catch-up that would pass it fails
//! ([`ViewError::IndexFull`]), writing nothing of the batch that would.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde_json::Value;

use super::builtin_reduce::Builtin;
use super::design::DesignViews;
use super::design::ReduceFn;
use super::index_store::{ApplyOptions, GroupState, IndexStore, MappedDoc, Partials};
use super::source::{SourceDoc, ViewSource};
use super::ViewError;
use crate::js::DocText;

/// Documents read from the feed and mapped per step.
pub const FEED_PAGE: usize = 128;
/// Longest a catch-up goes without a durable commit of the index file: what a crash during a
/// long build may cost in mapping done again.
pub const DURABLE_EVERY: Duration = Duration::from_secs(1);

/// A write of the index file started on the blocking pool ([`ViewIndexer::start_apply`]).
struct PendingWrite {
    database: String,
    task: tokio::task::JoinHandle<crate::error::Result<GroupState>>,
}

/// A catch-up's writes: the one in progress, and when the last durable one was.
struct Writes {
    pending: Option<PendingWrite>,
    last_durable: Instant,
    /// Whether the last write started was committed without waiting for the disk.
    durable_behind: bool,
    /// What each view's blocks keep ([`partials_of`]).
    partials: Arc<[Partials]>,
}

/// The partial reductions each view of `design` can use: `_sum`'s or `_stats`' for those
/// built-ins, none for the others (`_count` reads the counts every block keeps).
fn partials_of(design: &DesignViews) -> Arc<[Partials]> {
    design
        .views
        .iter()
        .map(|view| match &view.reduce {
            Some(ReduceFn::Builtin(Builtin::Sum)) => Partials { sum: true, stats: false },
            Some(ReduceFn::Builtin(Builtin::Stats)) => Partials { sum: false, stats: true },
            _ => Partials::NONE,
        })
        .collect()
}

impl Writes {
    /// Notes a write just started, durable or not.
    fn note(&mut self, durable: bool) {
        self.durable_behind = !durable;
        if durable {
            self.last_durable = Instant::now();
        }
    }
}

/// A page's last batch of mapped documents, with the feed position the page reaches.
struct LastBatch {
    docs: Vec<MappedDoc>,
    last_seq: String,
}

/// What building a group may hold and write: the settings `couchdb_view_max_rows_per_doc`,
/// `couchdb_view_max_key_bytes`, `couchdb_view_max_doc_bytes`, `couchdb_view_batch_bytes` and
/// `couchdb_view_max_index_bytes` (docs/bounds.md, docs/views.md "Bounds").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BuildBounds {
    /// Most rows one document may emit in a group, its views together.
    pub max_rows_per_doc: usize,
    /// Largest key a row may have, in bytes of its JSON.
    pub max_key_bytes: usize,
    /// Most bytes of JSON (keys and values) one document's rows may take in a group.
    pub max_doc_bytes: usize,
    /// Bytes of mapped rows held before they are written.
    pub batch_bytes: usize,
    /// Largest index of one database, its groups together ([`GroupState::stored_bytes`]).
    pub max_index_bytes: u64,
}

impl Default for BuildBounds {
    fn default() -> Self {
        BuildBounds {
            max_rows_per_doc: 10_000,
            max_key_bytes: 8_000,
            max_doc_bytes: 16 << 20,
            batch_bytes: 16 << 20,
            max_index_bytes: 16 << 30,
        }
    }
}

/// Runs map functions (JavaScript, or Mango's field maps).
#[async_trait]
pub trait Mapper: Send + Sync {
    /// For each document, for each view of `design` (in its order), the rows it emitted; a
    /// document a map function threw for has no rows in that view (CouchDB skips it and logs).
    /// A mapper may answer only the first documents (at least one), to bound what one call
    /// holds; the caller maps the rest in further calls.
    async fn map(
        &self,
        design: &DesignViews,
        docs: Vec<Arc<DocText>>,
    ) -> Result<Vec<Vec<Vec<(Value, Value)>>>, ViewError>;

    /// How many [`Mapper::map`] calls of `design` run at once to good effect (its worker
    /// threads): a build maps that many parts of a page together.
    fn parallel_calls(&self, _design: &DesignViews) -> usize {
        1
    }
}

/// Fewest documents in a part of a page mapped beside others: below it, a call's own cost
/// outweighs what running it beside another saves.
const MIN_PART: usize = 16;

/// The view groups of this process: where their rows are, who maps, and who is updating what.
pub struct ViewIndexer {
    store: Arc<IndexStore>,
    mapper: Arc<dyn Mapper>,
    bounds: BuildBounds,
    updating: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Each database's group prefix (name and incarnation) as this process last saw it.
    prefixes: Mutex<HashMap<String, String>>,
}

/// A group ready to be read: its name in the store and its state.
#[derive(Debug, Clone)]
pub struct ReadyGroup {
    pub name: String,
    pub state: GroupState,
    /// What the catch-up that made it ready read of the feed; `None` for a group read as it is
    /// ([`ViewIndexer::current`]).
    pub feed_read: Option<FeedRead>,
}

/// The stretch of a database's feed one catch-up read: from the group's checkpoint `from` to its
/// new one (the group's `state.checkpoint`), and whether a design document changed in it. Mango
/// confirms a remembered index catalog with it (`src/mango/catalog_watch.rs`): a catalog known
/// to hold every design document written up to `from` holds those up to the new checkpoint too
/// when none changed in between.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeedRead {
    pub from: Option<String>,
    pub design_changed: bool,
}

impl ViewIndexer {
    pub fn new(store: Arc<IndexStore>, mapper: Arc<dyn Mapper>) -> Self {
        ViewIndexer {
            store,
            mapper,
            bounds: BuildBounds::default(),
            updating: Mutex::new(HashMap::new()),
            prefixes: Mutex::new(HashMap::new()),
        }
    }

    /// This indexer building within `bounds`.
    pub fn with_bounds(self, bounds: BuildBounds) -> Self {
        ViewIndexer { bounds, ..self }
    }

    pub fn store(&self) -> &Arc<IndexStore> {
        &self.store
    }

    /// The prefix of `source`'s groups ([`ViewSource::group_prefix`]). When it is not the one this
    /// process saw last (the first use, or the incarnation ended: a purge, or the database deleted
    /// and created again), every group of the database kept under another incarnation is dropped
    /// from the file: nothing reads those again, and a purge's rows must not stay on disk.
    async fn prefix_of(&self, source: &dyn ViewSource) -> Result<String, ViewError> {
        let prefix = source.group_prefix().await?;
        let database = format!("{}\u{0}", source.name());
        let changed = {
            let mut seen = self.prefixes.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            seen.insert(database.clone(), prefix.clone()).as_deref() != Some(prefix.as_str())
        };
        if changed {
            let store = Arc::clone(&self.store);
            let kept = prefix.clone();
            let dropped = blocking(move || {
                let mut dropped = 0usize;
                for name in store.group_names(&database)? {
                    if !name.starts_with(&kept) && store.drop_group(&name)? {
                        dropped += 1;
                    }
                }
                Ok(dropped)
            })
            .await?;
            if dropped > 0 {
                tracing::info!(database = %source.name(), dropped, "dropped the view groups of an ended incarnation");
            }
        }
        Ok(prefix)
    }

    /// The group of `design` over `source` as it is, creating it empty if it does not exist.
    pub async fn current(&self, source: &dyn ViewSource, design: &DesignViews) -> Result<ReadyGroup, ViewError> {
        let name = format!("{}{}", self.prefix_of(source).await?, design.signature);
        self.group_named(name, design).await
    }

    /// The group `name` of `design` as recorded now, creating it empty if it does not exist.
    async fn group_named(&self, name: String, design: &DesignViews) -> Result<ReadyGroup, ViewError> {
        let store = Arc::clone(&self.store);
        let views = design.views.len();
        let (name, state) = blocking(move || store.group(&name, views).map(|state| (name, state))).await?;
        Ok(ReadyGroup { name, state, feed_read: None })
    }

    /// The group of `design` over `source`, brought up to the end of the feed as of now.
    pub async fn catch_up(&self, source: &dyn ViewSource, design: &DesignViews) -> Result<ReadyGroup, ViewError> {
        // Queries waiting together share a feed read that began after each of them arrived.
        if let Some(shared) = super::freshness::shared_catch_up(self, source, design).await {
            return shared;
        }
        let name = format!("{}{}", self.prefix_of(source).await?, design.signature);
        let lock = self.lock_of(&name);
        let _updating = lock.lock().await;
        // Read once the lock is held: another update may have run while this one waited.
        let mut group = self.group_named(name, design).await?;
        let mut feed_read = FeedRead { from: group.state.checkpoint.clone(), design_changed: false };
        self.follow_feed(source, design, &mut group, &mut feed_read).await?;
        group.feed_read = Some(feed_read);
        Ok(group)
    }

    /// Reads the feed from the group's position to its end as read now, mapping and writing each
    /// page, three steps at once: while a page is mapped, the next one is read and the one before
    /// is written (a write is started on the blocking pool and awaited before the next write
    /// starts, so the writes stay in feed order). Writes are committed without waiting for the
    /// disk ([`ApplyOptions::durable`]) but the last one of the catch-up, and one at least every
    /// [`DURABLE_EVERY`], so a crash during a long build costs at most that much mapping again.
    async fn follow_feed(
        &self,
        source: &dyn ViewSource,
        design: &DesignViews,
        group: &mut ReadyGroup,
        feed_read: &mut FeedRead,
    ) -> Result<(), ViewError> {
        let database = source.name();
        let mut note = |page: &crate::views::source::SourcePage| {
            feed_read.design_changed |= page.docs.iter().any(|doc| doc.id.starts_with("_design/"));
        };
        let mut writes = Writes {
            pending: None,
            last_durable: Instant::now(),
            durable_behind: false,
            partials: partials_of(design),
        };
        let mut page = source.feed_page(group.state.checkpoint.as_deref(), FEED_PAGE).await?;
        note(&page);
        loop {
            if page.docs.is_empty() {
                self.finish_write(&mut writes, group).await?;
                if group.state.checkpoint.as_deref() != Some(page.last_seq.as_str()) || writes.durable_behind {
                    let end = self.start_apply(
                        database,
                        &group.name,
                        Vec::new(),
                        Some(page.last_seq),
                        true,
                        Arc::clone(&writes.partials),
                    );
                    group.state = self.finish_apply(end).await?;
                }
                return Ok(());
            }
            let complete = page.complete;
            let next_since = page.last_seq.clone();
            let read_next = async {
                match complete {
                    true => Ok(None),
                    false => source.feed_page(Some(&next_since), FEED_PAGE).await.map(Some),
                }
            };
            let (last_batch, next) =
                tokio::try_join!(self.map_page(database, group, design, page, &mut writes), read_next)?;
            // The page's last batch records its end; it is written while the next page is mapped.
            self.finish_write(&mut writes, group).await?;
            let durable = complete || writes.last_durable.elapsed() >= DURABLE_EVERY;
            writes.pending = Some(self.start_apply(
                database,
                &group.name,
                last_batch.docs,
                Some(last_batch.last_seq),
                durable,
                Arc::clone(&writes.partials),
            ));
            writes.note(durable);
            match next {
                Some(next) => {
                    note(&next);
                    page = next;
                }
                None => return self.finish_write(&mut writes, group).await,
            }
        }
    }

    /// Waits for the write in progress, if any, and takes the group's state it left.
    async fn finish_write(&self, writes: &mut Writes, group: &mut ReadyGroup) -> Result<(), ViewError> {
        if let Some(pending) = writes.pending.take() {
            group.state = self.finish_apply(pending).await?;
        }
        Ok(())
    }

    /// Maps a feed page's documents. A batch whose rows pass [`BuildBounds::batch_bytes`] is
    /// written before the rest is mapped (keeping the recorded feed position; the write before it
    /// awaited first); the page's last batch, with the page's end, is returned to be written.
    async fn map_page(
        &self,
        database: &str,
        group: &mut ReadyGroup,
        design: &DesignViews,
        page: super::source::SourcePage,
        writes: &mut Writes,
    ) -> Result<LastBatch, ViewError> {
        let mut batch = Vec::with_capacity(page.docs.len());
        let mut batch_bytes = 0usize;
        let mut inputs = Vec::new();
        let mut input_ids = Vec::new();
        for SourceDoc { id, doc } in page.docs {
            match doc.filter(|_| is_mapped(&id, design)) {
                Some(doc) => {
                    input_ids.push(id);
                    inputs.push(Arc::new(doc));
                }
                // Deleted, never indexed, or not for this group: its rows (if any) go.
                None => batch.push(MappedDoc { id, rows: Vec::new() }),
            }
        }
        let mut ids = input_ids.into_iter();
        let mut mapped = 0;
        while mapped < inputs.len() {
            let outcomes = self.map_parts(design, &inputs[mapped..]).await?;
            if outcomes.is_empty() {
                return Err(ViewError::Storage(crate::error::Error::new(
                    crate::error::ErrorKind::Internal,
                    "a map call answered no document",
                )));
            }
            // Outcomes first: `zip` takes from its first side before the second, and an id taken
            // past the last outcome would be lost.
            for (rows, id) in outcomes.into_iter().zip(ids.by_ref()) {
                mapped += 1;
                let (rows, bytes) = self.bounded(database, design, &id, rows);
                batch.push(MappedDoc { id, rows });
                batch_bytes += bytes;
                if batch_bytes >= self.bounds.batch_bytes && mapped < inputs.len() {
                    let written = std::mem::take(&mut batch);
                    batch_bytes = 0;
                    self.finish_write(writes, group).await?;
                    let durable = writes.last_durable.elapsed() >= DURABLE_EVERY;
                    let part =
                        self.start_apply(database, &group.name, written, None, durable, Arc::clone(&writes.partials));
                    group.state = self.finish_apply(part).await?;
                    writes.note(durable);
                }
            }
        }
        Ok(LastBatch { docs: batch, last_seq: page.last_seq })
    }

    /// A document's rows within the per-document bounds, with the bytes of their JSON; no rows
    /// (the document is left out of every view of the group, and logged) past any of them, as
    /// CouchDB's `couch_views` leaves out a document with a key or value past its size limits.
    fn bounded(
        &self,
        database: &str,
        design: &DesignViews,
        id: &str,
        rows: Vec<Vec<(Value, Value)>>,
    ) -> (Vec<Vec<(Value, Value)>>, usize) {
        match rows_past_bounds(&rows, &self.bounds) {
            Ok(bytes) => (rows, bytes),
            Err(past) => {
                tracing::error!(
                    database,
                    design = %design.id,
                    doc_id = id,
                    "view rows of the document are left out of the index: {past}"
                );
                (Vec::new(), 0)
            }
        }
    }

    /// Maps the first of `docs` (at least one), cut into parts mapped at once, as many as the
    /// mapper runs in parallel ([`Mapper::parallel_calls`]): the outcomes in order up to the first
    /// part the mapper answered only in part (a mapper may stop early to bound what a call holds);
    /// the caller maps the rest again.
    async fn map_parts(
        &self,
        design: &DesignViews,
        docs: &[Arc<DocText>],
    ) -> Result<Vec<Vec<Vec<(Value, Value)>>>, ViewError> {
        let parts = self.mapper.parallel_calls(design).min(docs.len() / MIN_PART).max(1);
        if parts == 1 {
            return self.mapper.map(design, docs.to_vec()).await;
        }
        let per_part = docs.len().div_ceil(parts);
        let calls = docs.chunks(per_part).map(|part| self.mapper.map(design, part.to_vec()));
        let answers = futures::future::try_join_all(calls).await?;
        let mut outcomes = Vec::with_capacity(docs.len());
        for (answer, part) in answers.into_iter().zip(docs.chunks(per_part)) {
            let whole = answer.len() == part.len();
            outcomes.extend(answer);
            if !whole {
                break;
            }
        }
        Ok(outcomes)
    }

    /// Starts writing `mapped` to the group (recording `checkpoint` when given) on the blocking
    /// pool, within what [`BuildBounds::max_index_bytes`] leaves the group beside the database's
    /// other groups; [`Self::finish_apply`] waits for it.
    fn start_apply(
        &self,
        database: &str,
        name: &str,
        mapped: Vec<MappedDoc>,
        checkpoint: Option<String>,
        durable: bool,
        partials: Arc<[Partials]>,
    ) -> PendingWrite {
        let store = Arc::clone(&self.store);
        let name = name.to_owned();
        let database_prefix = format!("{database}\u{0}");
        let max_bytes = self.bounds.max_index_bytes;
        let task = tokio::task::spawn_blocking(move || {
            let others = store.stored_bytes_besides(&database_prefix, &name)?;
            let options = ApplyOptions {
                checkpoint: checkpoint.as_deref(),
                max_bytes: max_bytes.saturating_sub(others),
                durable,
                partials: &partials,
            };
            store.apply_within(&name, &mapped, options)
        });
        PendingWrite { database: database.to_owned(), task }
    }

    /// The group's state after the write `pending`, or why it failed (past
    /// [`BuildBounds::max_index_bytes`]: [`ViewError::IndexFull`]).
    async fn finish_apply(&self, pending: PendingWrite) -> Result<GroupState, ViewError> {
        let max_index_bytes = self.bounds.max_index_bytes;
        let database = pending.database;
        let applied = pending
            .task
            .await
            .map_err(|err| {
                ViewError::Storage(crate::error::Error::new(
                    crate::error::ErrorKind::Internal,
                    format!("view index task: {err}"),
                ))
            })?
            .map_err(ViewError::Storage);
        applied.map_err(|err| match err {
            ViewError::Storage(err) if err.kind() == crate::error::ErrorKind::TooLarge => {
                ViewError::IndexFull(format!(
                    "the view index of database {database} is at its bound of {max_index_bytes} bytes \
                     (couchdb_view_max_index_bytes): {}; update=false answers from the index as it is",
                    err.message()
                ))
            }
            other => other,
        })
    }

    fn lock_of(&self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut updating = self.updating.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        Arc::clone(updating.entry(name.to_owned()).or_default())
    }

    /// Forgets the deleted database `database`: what this process keeps about it (its group
    /// prefix, its groups' update locks, their shared catch-ups) and its groups in the index
    /// file, so neither memory nor the file grows with databases created and deleted. Returns
    /// how many groups were dropped from the file.
    pub async fn forget_database(&self, database: &str) -> Result<usize, ViewError> {
        let key = format!("{database}\u{0}");
        self.prefixes.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).remove(&key);
        self.updating.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).retain(|name, _| !name.starts_with(&key));
        super::freshness::forget_database(self, database);
        let store = Arc::clone(&self.store);
        blocking(move || {
            let mut dropped = 0;
            for name in store.group_names(&key)? {
                if store.drop_group(&name)? {
                    dropped += 1;
                }
            }
            Ok(dropped)
        })
        .await
    }

    /// Entries this indexer keeps in memory about databases: group prefixes and update locks
    /// (for the tests of [`ViewIndexer::forget_database`]).
    #[cfg(test)]
    pub(crate) fn kept_entries(&self) -> (usize, usize) {
        let prefixes = self.prefixes.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).len();
        let updating = self.updating.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).len();
        (prefixes, updating)
    }

    /// Drops every group of `source` that no design document in `keep` (signatures) uses:
    /// CouchDB's `_view_cleanup`. Returns how many were dropped.
    pub async fn clean_up(&self, source: &dyn ViewSource, keep: &[String]) -> Result<usize, ViewError> {
        let prefix = self.prefix_of(source).await?;
        let store = Arc::clone(&self.store);
        let keep: Vec<String> = keep.iter().map(|signature| format!("{prefix}{signature}")).collect();
        blocking(move || {
            let mut dropped = 0;
            for name in store.group_names(&prefix)? {
                if !keep.contains(&name) && store.drop_group(&name)? {
                    dropped += 1;
                }
            }
            Ok(dropped)
        })
        .await
    }
}

/// The bytes of JSON of a document's rows, or which bound they pass (naming its setting).
fn rows_past_bounds(rows: &[Vec<(Value, Value)>], bounds: &BuildBounds) -> Result<usize, String> {
    let count: usize = rows.iter().map(Vec::len).sum();
    if count > bounds.max_rows_per_doc {
        return Err(format!("{count} rows, past couchdb_view_max_rows_per_doc ({})", bounds.max_rows_per_doc));
    }
    let mut total = 0usize;
    for (key, value) in rows.iter().flatten() {
        let key_bytes = json_bytes(key);
        if key_bytes > bounds.max_key_bytes {
            return Err(format!(
                "a key of {key_bytes} bytes, past couchdb_view_max_key_bytes ({})",
                bounds.max_key_bytes
            ));
        }
        total += key_bytes + json_bytes(value);
        if total > bounds.max_doc_bytes {
            return Err(format!(
                "rows of over {total} bytes, past couchdb_view_max_doc_bytes ({})",
                bounds.max_doc_bytes
            ));
        }
    }
    Ok(total)
}

/// The length of `value` written as compact JSON, without writing it anywhere.
fn json_bytes(value: &Value) -> usize {
    struct Counted(usize);
    impl std::io::Write for Counted {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 += bytes.len();
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut counted = Counted(0);
    // Writing a `Value` to a writer that never fails cannot fail.
    let _ = serde_json::to_writer(&mut counted, value);
    counted.0
}

/// Whether a (live) document is mapped by `design`'s group: never a local document, a design
/// document only with `options.include_design`.
fn is_mapped(id: &str, design: &DesignViews) -> bool {
    !id.starts_with("_local/") && (!id.starts_with("_design/") || design.include_design)
}

/// Runs store work on a blocking thread.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> crate::error::Result<T> + Send + 'static,
) -> Result<T, ViewError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|err| {
            ViewError::Storage(crate::error::Error::new(
                crate::error::ErrorKind::Internal,
                format!("view index task: {err}"),
            ))
        })?
        .map_err(ViewError::Storage)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::catalog::{DbName, EmbeddedCatalog};
    use crate::backend::embedded::EmbeddedOptions;
    use crate::database::{Databases, Write};
    use crate::views::index_store::RowRange;
    use serde_json::json;
    use std::ops::ControlFlow;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Emits `(doc.type, doc._rev)` in the first view and, for documents with conflicts,
    /// `(doc._conflicts, null)` in the second; counts the documents it is given.
    struct TypeMapper {
        mapped: AtomicUsize,
    }

    #[async_trait]
    impl Mapper for TypeMapper {
        async fn map(
            &self,
            _: &DesignViews,
            docs: Vec<Arc<DocText>>,
        ) -> Result<Vec<Vec<Vec<(Value, Value)>>>, ViewError> {
            self.mapped.fetch_add(docs.len(), Ordering::SeqCst);
            Ok(docs
                .iter()
                .map(|doc| {
                    let doc = doc.value();
                    let by_type = vec![(doc["type"].clone(), doc["_rev"].clone())];
                    let conflicts = doc.get("_conflicts").map(|c| vec![(c.clone(), Value::Null)]).unwrap_or_default();
                    vec![by_type, conflicts]
                })
                .collect())
        }
    }

    fn edit(parent: Option<String>, value: Value) -> Write {
        Write::Edit { parent, deleted: false, body: value.as_object().cloned().unwrap_or_default() }
    }

    fn rows(indexer: &ViewIndexer, group: &ReadyGroup, view: usize) -> Vec<(Value, String)> {
        let mut out = Vec::new();
        indexer
            .store()
            .scan(group.state.number, view, &RowRange::all(), false, |row| {
                out.push((row.key, row.id));
                ControlFlow::Continue(())
            })
            .unwrap();
        out
    }

    #[tokio::test]
    async fn groups_follow_writes_deletes_and_conflicts_incrementally() {
        let dir = tempfile::tempdir().unwrap();
        let catalog = Arc::new(EmbeddedCatalog::new(&dir.path().join("store.redb"), EmbeddedOptions::default()));
        let databases = Databases::new(Some(catalog), 4);
        let db = databases.create(&DbName::parse("app").unwrap()).await.unwrap();
        let store = Arc::new(IndexStore::open(&dir.path().join("views.redb")).unwrap());
        let mapper = Arc::new(TypeMapper { mapped: AtomicUsize::new(0) });
        let indexer = ViewIndexer::new(store, mapper.clone());
        let design = DesignViews::parse(&json!({"_id": "_design/d", "views": {
            "by_type": {"map": "…"}, "conflicted": {"map": "…"}}}))
        .unwrap();
        let (by_type, conflicted) = (design.view("by_type").unwrap().0, design.view("conflicted").unwrap().0);

        let mut revs = Vec::new();
        for (i, kind) in ["b", "a", "c"].iter().enumerate() {
            match db.write(&format!("doc{i}"), &edit(None, json!({"type": kind}))).await.unwrap() {
                crate::database::Written::Edited(rev) => revs.push(rev),
                other => panic!("unexpected {other:?}"),
            }
        }
        db.write("_design/d", &edit(None, json!({"type": "design"}))).await.unwrap();
        let group = indexer.catch_up(db.as_ref(), &design).await.unwrap();
        let keys: Vec<Value> = rows(&indexer, &group, by_type).into_iter().map(|(k, _)| k).collect();
        assert_eq!(keys, [json!("a"), json!("b"), json!("c")], "design documents are not mapped");
        assert_eq!(mapper.mapped.load(Ordering::SeqCst), 3);

        // Nothing changed: nothing is mapped again.
        indexer.catch_up(db.as_ref(), &design).await.unwrap();
        assert_eq!(mapper.mapped.load(Ordering::SeqCst), 3);

        // An update, a delete, and a conflicting branch: only those are mapped.
        db.write("doc0", &edit(Some(revs[0].clone()), json!({"type": "z"}))).await.unwrap();
        db.write("doc1", &Write::Edit { parent: Some(revs[1].clone()), deleted: true, body: Default::default() })
            .await
            .unwrap();
        let branch = crate::database::rev_tree::RevPath::from_revisions(&json!({"start": 1, "ids": ["ffff"]})).unwrap();
        db.write("doc2", &Write::Replicated { path: branch, deleted: false, body: Default::default() }).await.unwrap();
        let stale = indexer.current(db.as_ref(), &design).await.unwrap();
        assert_eq!(rows(&indexer, &stale, by_type).len(), 3, "update=false reads the index as it was");
        let group = indexer.catch_up(db.as_ref(), &design).await.unwrap();
        assert_eq!(mapper.mapped.load(Ordering::SeqCst), 5, "the deleted document is not mapped");
        let by_type_rows = rows(&indexer, &group, by_type);
        assert_eq!(by_type_rows.iter().map(|(_, id)| id.as_str()).collect::<Vec<_>>(), ["doc2", "doc0"]);
        let conflicts = rows(&indexer, &group, conflicted);
        assert_eq!(conflicts.len(), 1, "the map function sees _conflicts");
        assert_eq!(conflicts[0].1, "doc2");
        assert_eq!(group.state.row_counts, vec![2, 1]);
    }

    /// Databases with views created, queried and deleted leave nothing behind: no group prefix,
    /// update lock or shared catch-up in memory, no group in the index file; a database kept
    /// keeps its own.
    #[tokio::test]
    async fn deleted_databases_leave_no_view_state() {
        let dir = tempfile::tempdir().unwrap();
        let catalog = Arc::new(EmbeddedCatalog::new(&dir.path().join("store.redb"), EmbeddedOptions::default()));
        let databases = Databases::new(Some(catalog), 8);
        let store = Arc::new(IndexStore::open(&dir.path().join("views.redb")).unwrap());
        let indexer = ViewIndexer::new(Arc::clone(&store), Arc::new(TypeMapper { mapped: AtomicUsize::new(0) }));
        let design = DesignViews::parse(&json!({"_id": "_design/d", "views": {"v": {"map": "…"}}})).unwrap();
        let names: Vec<DbName> = (0..5).map(|n| DbName::parse(&format!("db{n}")).unwrap()).collect();
        for name in &names {
            let db = databases.create(name).await.unwrap();
            db.write("doc", &edit(None, json!({"type": "t"}))).await.unwrap();
            indexer.catch_up(db.as_ref(), &design).await.unwrap();
        }
        assert_eq!(indexer.kept_entries(), (5, 5));
        for name in &names[1..] {
            assert!(databases.delete(name).await.unwrap());
            assert_eq!(indexer.forget_database(name.as_str()).await.unwrap(), 1, "{name}'s group dropped");
        }
        assert_eq!(indexer.kept_entries(), (1, 1), "only the database kept is remembered");
        for name in &names[1..] {
            assert_eq!(crate::views::freshness::flights_of(&indexer, name.as_str()), 0);
            assert!(store.group_names(&format!("{name}\u{0}")).unwrap().is_empty());
        }
        assert_eq!(crate::views::freshness::flights_of(&indexer, "db0"), 1);
        assert_eq!(store.group_names("db0\u{0}").unwrap().len(), 1);
    }

    /// Two `Database`s over one backend, as two serving processes hold them (issue 36): a purge
    /// through one ends the view incarnation the other read before, so the other's next view
    /// answer (even `update=false`) no longer holds the purged document's rows.
    #[tokio::test]
    async fn a_purge_through_another_database_reaches_this_ones_views() {
        let dir = tempfile::tempdir().unwrap();
        let backend: Arc<dyn crate::backend::DocumentBackend> =
            Arc::new(crate::backend::embedded::EmbeddedBackend::open(&dir.path().join("store.redb")).await.unwrap());
        let serving = crate::database::Database::new("app".into(), Arc::clone(&backend));
        let purging = crate::database::Database::new("app".into(), Arc::clone(&backend));
        let store = Arc::new(IndexStore::open(&dir.path().join("views.redb")).unwrap());
        let indexer = ViewIndexer::new(store, Arc::new(TypeMapper { mapped: AtomicUsize::new(0) }));
        let design = DesignViews::parse(&json!({"_id": "_design/d", "views": {"v": {"map": "…"}}})).unwrap();
        let mut revs = Vec::new();
        for (id, kind) in [("kept", "a"), ("purged", "b")] {
            match serving.write(id, &edit(None, json!({"type": kind}))).await.unwrap() {
                crate::database::Written::Edited(rev) => revs.push(rev),
                other => panic!("unexpected {other:?}"),
            }
        }
        let group = indexer.catch_up(&serving, &design).await.unwrap();
        let ids = |rows: Vec<(Value, String)>| rows.into_iter().map(|(_, id)| id).collect::<Vec<_>>();
        assert_eq!(ids(rows(&indexer, &group, 0)), ["kept", "purged"]);

        purging.purge("purged", &[revs[1].clone()]).await.unwrap();
        let stale = indexer.current(&serving, &design).await.unwrap();
        assert!(!ids(rows(&indexer, &stale, 0)).contains(&"purged".to_owned()), "a stale read after the purge");
        let fresh = indexer.catch_up(&serving, &design).await.unwrap();
        assert_eq!(ids(rows(&indexer, &fresh, 0)), ["kept"]);
    }

    /// Answers one document per call, emitting one row of about 1,000 bytes, and records how many
    /// rows the index file held at each call.
    struct OneAtATime {
        store: Arc<IndexStore>,
        rows_seen: Mutex<Vec<u64>>,
    }

    #[async_trait]
    impl Mapper for OneAtATime {
        async fn map(
            &self,
            _: &DesignViews,
            docs: Vec<Arc<DocText>>,
        ) -> Result<Vec<Vec<Vec<(Value, Value)>>>, ViewError> {
            let mut rows = 0;
            for name in self.store.group_names("").unwrap() {
                rows += self.store.read_group(&name).unwrap().map_or(0, |state| state.row_counts.iter().sum());
            }
            self.rows_seen.lock().unwrap().push(rows);
            Ok(vec![vec![vec![(docs[0].value()["_id"].clone(), json!("x".repeat(1000)))]]])
        }
    }

    /// A page whose rows pass `batch_bytes` is written in parts, its first documents' rows in the
    /// file before the rest is mapped, and a mapper answering part of a call is called again for
    /// the rest.
    #[tokio::test]
    async fn a_page_is_written_a_batch_of_bytes_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let catalog = Arc::new(EmbeddedCatalog::new(&dir.path().join("store.redb"), EmbeddedOptions::default()));
        let databases = Databases::new(Some(catalog), 4);
        let db = databases.create(&DbName::parse("app").unwrap()).await.unwrap();
        for i in 0..6 {
            db.write(&format!("doc{i}"), &edit(None, json!({"n": i}))).await.unwrap();
        }
        let store = Arc::new(IndexStore::open(&dir.path().join("views.redb")).unwrap());
        let mapper = Arc::new(OneAtATime { store: Arc::clone(&store), rows_seen: Mutex::new(Vec::new()) });
        let bounds = BuildBounds { batch_bytes: 2_500, ..BuildBounds::default() };
        let indexer = ViewIndexer::new(store, mapper.clone()).with_bounds(bounds);
        let design = DesignViews::parse(&json!({"_id": "_design/d", "views": {"v": {"map": "…"}}})).unwrap();
        let group = indexer.catch_up(db.as_ref(), &design).await.unwrap();
        assert_eq!(rows(&indexer, &group, 0).len(), 6);
        assert_eq!(*mapper.rows_seen.lock().unwrap(), [0, 0, 0, 3, 3, 3], "three rows pass 2,500 bytes");
        assert!(group.state.stored_bytes > 6_000, "{}", group.state.stored_bytes);
    }

    /// A document past a per-document bound is left out of the index; the others are kept.
    #[test]
    fn rows_past_a_bound_name_it() {
        let bounds =
            BuildBounds { max_rows_per_doc: 2, max_key_bytes: 10, max_doc_bytes: 40, ..BuildBounds::default() };
        let row = |key: Value, value: Value| vec![(key, value)];
        assert_eq!(
            rows_past_bounds(&[row(json!("k"), json!(1)), row(json!(2), json!(null))], &bounds),
            Ok(3 + 1 + 1 + 4)
        );
        let many = rows_past_bounds(&[vec![(json!(1), json!(1)); 3]], &bounds).unwrap_err();
        assert!(many.contains("couchdb_view_max_rows_per_doc"), "{many}");
        let key = rows_past_bounds(&[row(json!("a long key"), json!(1))], &bounds).unwrap_err();
        assert!(key.contains("couchdb_view_max_key_bytes"), "{key}");
        let total = rows_past_bounds(&[row(json!(1), json!("x".repeat(40)))], &bounds).unwrap_err();
        assert!(total.contains("couchdb_view_max_doc_bytes"), "{total}");
    }

    /// A purge that erases a document erases its feed entry too; the purge ends the database's
    /// incarnation, so the next catch-up builds a new group without the document, and the old
    /// group (with its rows) leaves the index file.
    #[tokio::test]
    async fn a_purged_document_leaves_no_row_and_no_old_group() {
        let dir = tempfile::tempdir().unwrap();
        let catalog = Arc::new(EmbeddedCatalog::new(&dir.path().join("store.redb"), EmbeddedOptions::default()));
        let databases = Databases::new(Some(catalog), 4);
        let db = databases.create(&DbName::parse("app").unwrap()).await.unwrap();
        let store = Arc::new(IndexStore::open(&dir.path().join("views.redb")).unwrap());
        let indexer = ViewIndexer::new(store, Arc::new(TypeMapper { mapped: AtomicUsize::new(0) }));
        let design = DesignViews::parse(&json!({"_id": "_design/d", "views": {
            "by_type": {"map": "…"}, "conflicted": {"map": "…"}}}))
        .unwrap();
        let by_type = design.view("by_type").unwrap().0;
        let kept = match db.write("kept", &edit(None, json!({"type": "k"}))).await.unwrap() {
            crate::database::Written::Edited(rev) => rev,
            other => panic!("unexpected {other:?}"),
        };
        let purged = match db.write("secret", &edit(None, json!({"type": "s"}))).await.unwrap() {
            crate::database::Written::Edited(rev) => rev,
            other => panic!("unexpected {other:?}"),
        };
        let before = indexer.catch_up(db.as_ref(), &design).await.unwrap();
        assert_eq!(rows(&indexer, &before, by_type).len(), 2);

        assert_eq!(db.purge("secret", &[purged]).await.unwrap().len(), 1);
        let after = indexer.catch_up(db.as_ref(), &design).await.unwrap();
        let ids: Vec<String> = rows(&indexer, &after, by_type).into_iter().map(|(_, id)| id).collect();
        assert_eq!(ids, ["kept"], "the purged document's row is gone");
        assert_ne!(after.name, before.name, "a new incarnation's group");
        assert_eq!(indexer.store().read_group(&before.name).unwrap(), None, "the old group left the file");
        assert!(!kept.is_empty());
    }
}
