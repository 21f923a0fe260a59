//! The view index file: every view group's rows, kept in one redb file per `serve` instance
//! (docs/views.md says where, and why a file of the instance's own rather than the backend).
//!
//! Tables:
//! - `view_rows`: `group (u64 BE) · view (u16 BE) · sort key of the emitted key · escaped doc id ·
//!   emit number (u32 BE)` → JSON `[key, id, value]`. One ordered scan answers any key range of a
//!   view in CouchDB's collation ([`super::sort_key`]); equal keys order by document id, then one
//!   document's rows by value in Erlang's term order, as CouchDB orders them.
//! - `view_back`: `group · doc id` → the row keys the document's last mapping wrote, so the
//!   next one removes exactly those (CouchDB's back-index).
//! - `view_groups`: group name → [`GroupState`] (JSON): its number, the feed position it has
//!   reached, and row counts per view.
//! - `view_blocks`: `group · view · start` → [`BlockSummary`]: the view's rows cut into blocks of
//!   consecutive rows ([`BLOCK_ROWS`] aimed at), each keyed by where it starts and holding its row
//!   count and its `_sum` and `_stats` partial reductions. A row belongs to the block with the
//!   greatest start at or below its key; a view's first block starts at the view prefix itself, so
//!   every row has one. Counting the rows before a key (CouchDB's `offset`) adds whole blocks'
//!   counts and scans within one block; a built-in reduce over a range takes whole blocks'
//!   partials and scans only the edges (docs/views.md, "Index file").
//! - `view_meta`: the next group number.
//!
//! Everything here is synchronous (redb is); callers run it on blocking threads. One write
//! transaction per batch of mapped documents: a batch's rows, their blocks' summaries and the feed
//! position they reach commit together, so a crash never leaves rows ahead of or behind the
//! recorded position, or a block's summary apart from its rows.

use std::ops::{Bound, ControlFlow};
use std::path::{Path, PathBuf};

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::builtin_reduce::{Builtin, Reducer};
use super::reduce_cache::ReduceCache;
use super::sort_key;
use crate::error::{Error, ErrorKind, Result};
use crate::model::depth::parse_stored;

const ROWS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("view_rows");
const BACK: TableDefinition<&[u8], &[u8]> = TableDefinition::new("view_back");
const GROUPS: TableDefinition<&str, &[u8]> = TableDefinition::new("view_groups");
const META: TableDefinition<&str, u64> = TableDefinition::new("view_meta");
const BLOCKS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("view_blocks");
const NEXT_GROUP: &str = "next_group";

/// The layout of a group's tables, recorded in [`GroupState::format`] with the sort-key format:
/// a group written in another layout (before `view_blocks`, or before [`GroupState::stored_bytes`]
/// was counted, say) is dropped and rebuilt.
const LAYOUT: &str = "rows+blocks+bytes/1";

/// The format a group written now records: the sort-key encoding and the table layout.
pub fn current_format() -> String {
    format!("{} {LAYOUT}", sort_key::FORMAT)
}

/// Rows a block aims at: small enough that scanning one is cheap, large enough that a view of
/// millions of rows has thousands of blocks, not millions.
pub const BLOCK_ROWS: u64 = 256;
/// A block grown past this many rows is cut into blocks of about [`BLOCK_ROWS`].
pub const BLOCK_MAX: u64 = 2 * BLOCK_ROWS;
/// A block shrunk below this many rows is merged with its neighbour.
pub const BLOCK_MIN: u64 = BLOCK_ROWS / 4;

/// A view group's state as recorded with its rows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupState {
    /// The prefix of this group's rows.
    pub number: u64,
    /// The backend feed position every change up to which is in the rows (`None`: none yet).
    pub checkpoint: Option<String>,
    /// Rows per view, in the group's view order.
    pub row_counts: Vec<u64>,
    /// The sort-key format and table layout the rows were written with ([`current_format`]).
    pub format: String,
    /// Bytes of the group's rows and back-index entries (keys and values as stored), the size a
    /// database's index is bounded by (`couchdb_view_max_index_bytes`).
    #[serde(default)]
    pub stored_bytes: u64,
}

/// What a block of consecutive rows of a view holds: its row count and partial reductions, for
/// answering counts and built-in reduces without reading its rows.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockSummary {
    pub count: u64,
    /// `_sum` of the block's values; `None` when the block is empty or `_sum` refuses one of its
    /// values (a query then reads the block's rows, and meets the refusal there).
    pub sum: Option<Value>,
    /// `_stats` of the block's values, `None` likewise.
    pub stats: Option<Value>,
}

/// Which partial reductions a view's blocks keep besides their row count: only what the view's
/// reduce function takes. A `_stats` partial is a JSON object merged value by value, a third of a
/// build's work when it was kept for every view whatever its reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Partials {
    pub sum: bool,
    pub stats: bool,
}

impl Partials {
    /// Both partials: what a view past [`ApplyOptions::partials`] keeps.
    pub const BOTH: Partials = Partials { sum: true, stats: true };
    /// Neither: a view whose reduce is `_count`, JavaScript, or none.
    pub const NONE: Partials = Partials { sum: false, stats: false };
}

impl BlockSummary {
    fn empty() -> Self {
        BlockSummary { count: 0, sum: None, stats: None }
    }

    /// The summary of these values (rows as `(ignored key, value)`), both partials kept.
    #[cfg(test)]
    fn of(values: &[(Value, Value)]) -> Self {
        Self::of_kept(values, Partials::BOTH)
    }

    /// The summary of these values with the partials `kept` (the others absent, as a refused one
    /// is: a query then reads the block's rows).
    fn of_kept(values: &[(Value, Value)], kept: Partials) -> Self {
        if values.is_empty() {
            return BlockSummary::empty();
        }
        BlockSummary {
            count: values.len() as u64,
            sum: if kept.sum { Builtin::Sum.reduce(values).ok() } else { None },
            stats: if kept.stats { Builtin::Stats.reduce(values).ok() } else { None },
        }
    }

    /// This summary with `more` rows added (their summary).
    fn joined(self, more: BlockSummary) -> Self {
        if self.count == 0 {
            return more;
        }
        if more.count == 0 {
            return self;
        }
        let join = |builtin: Builtin, a: Option<Value>, b: Option<Value>| match (a, b) {
            (Some(a), Some(b)) => builtin.rereduce(&[a, b]).ok(),
            _ => None,
        };
        BlockSummary {
            count: self.count + more.count,
            sum: join(Builtin::Sum, self.sum, more.sum),
            stats: join(Builtin::Stats, self.stats, more.stats),
        }
    }

    /// `count (u64 BE) · length of the _sum JSON (u32 BE) · _sum JSON · _stats JSON`, an absent
    /// partial written as no bytes; the count first, so counting reads 8 bytes.
    fn encode(&self) -> Result<Vec<u8>> {
        let json = |partial: &Option<Value>| match partial {
            Some(value) => serde_json::to_vec(value)
                .map_err(|err| Error::new(ErrorKind::Internal, format!("encode view block: {err}"))),
            None => Ok(Vec::new()),
        };
        let (sum, stats) = (json(&self.sum)?, json(&self.stats)?);
        let mut bytes = Vec::with_capacity(12 + sum.len() + stats.len());
        bytes.extend_from_slice(&self.count.to_be_bytes());
        bytes.extend_from_slice(&(sum.len() as u32).to_be_bytes());
        bytes.extend_from_slice(&sum);
        bytes.extend_from_slice(&stats);
        Ok(bytes)
    }

    fn decode(bytes: &[u8]) -> Result<Self> {
        let corrupt = || Error::new(ErrorKind::Corrupt, "view block summary: truncated".to_owned());
        let count = block_count(bytes)?;
        let sum_len = bytes.get(8..12).ok_or_else(corrupt)?;
        let sum_len = u32::from_be_bytes([sum_len[0], sum_len[1], sum_len[2], sum_len[3]]) as usize;
        let sum = bytes.get(12..12 + sum_len).ok_or_else(corrupt)?;
        let stats = &bytes[12 + sum_len..];
        let json = |part: &[u8]| -> Result<Option<Value>> {
            if part.is_empty() {
                return Ok(None);
            }
            parse_stored(part)
                .map(Some)
                .map_err(|err| Error::new(ErrorKind::Corrupt, format!("view block summary: {err}")))
        };
        Ok(BlockSummary { count, sum: json(sum)?, stats: json(stats)? })
    }
}

/// The row count of an encoded [`BlockSummary`], without decoding the rest.
fn block_count(bytes: &[u8]) -> Result<u64> {
    let head =
        bytes.get(..8).ok_or_else(|| Error::new(ErrorKind::Corrupt, "view block summary: truncated".to_owned()))?;
    Ok(u64::from_be_bytes([head[0], head[1], head[2], head[3], head[4], head[5], head[6], head[7]]))
}

/// What a scan of a range for a reduce yields: a row, or a whole block of rows in the range taken
/// at once.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Row(IndexRow),
    /// Every row of a block, all within the range. `first_key` and `last_key` are its first and
    /// last rows' emitted keys when the scan was asked for them (`null` otherwise).
    Block {
        summary: BlockSummary,
        first_key: Value,
        last_key: Value,
    },
}

/// One change to a row made by [`IndexStore::apply`], for updating its block afterwards.
struct RowChange {
    /// The row's full key.
    key: Vec<u8>,
    /// Rows added (1), removed (-1) or replaced (0).
    delta: i64,
    /// The value of a row newly added; `None` for a removal or a replacement, which make the
    /// block's partials unknown until its rows are read again.
    added: Option<Value>,
}

/// One document's mapping: per view (in the group's order), the `(key, value)` rows it emitted.
/// No rows at all removes the document from the index (deleted, or every map function threw).
#[derive(Debug, Clone, PartialEq)]
pub struct MappedDoc {
    pub id: String,
    pub rows: Vec<Vec<(Value, Value)>>,
}

/// A row read back.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexRow {
    pub key: Value,
    pub id: String,
    pub value: Value,
}

/// One page of rows read by [`IndexStore::page`], and the part of the range after it (`None`:
/// the range is read to its end).
#[derive(Debug, Clone, PartialEq)]
pub struct RowPage {
    pub rows: Vec<IndexRow>,
    pub rest: Option<RowRange>,
}

/// A range of rows within one view, in row-key bytes after the group and view prefix.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RowRange {
    pub low: Bound<Vec<u8>>,
    pub high: Bound<Vec<u8>>,
}

impl RowRange {
    pub fn all() -> Self {
        RowRange { low: Bound::Unbounded, high: Bound::Unbounded }
    }
}

/// How [`IndexStore::apply_within`] writes a batch of mapped documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApplyOptions<'a> {
    /// The feed position the batch reaches; `None` keeps the recorded one.
    pub checkpoint: Option<&'a str>,
    /// The most [`GroupState::stored_bytes`] the group may reach by growing.
    pub max_bytes: u64,
    /// Whether the commit is on disk when the call returns. A build commits its batches without
    /// waiting (redb's `Durability::None`) and makes its last one durable, which makes the ones
    /// before it durable too: a crash in between goes back to the last durable commit, whose
    /// rows and feed position match, and the build maps those documents again.
    pub durable: bool,
    /// The partials each view's blocks keep, by view number; a view past the end keeps both.
    pub partials: &'a [Partials],
}

/// The index file.
pub struct IndexStore {
    path: PathBuf,
    db: Database,
    /// Reduce answers kept until their group's rows change: every commit that changes a group's
    /// rows below ends them ([`ReduceCache::invalidate`]).
    reductions: ReduceCache,
}

fn failure(path: &Path, doing: &str, err: impl Into<redb::Error>) -> Error {
    let err: redb::Error = err.into();
    let kind = match &err {
        redb::Error::DatabaseAlreadyOpen => ErrorKind::Misconfigured,
        redb::Error::Corrupted(_) => ErrorKind::Corrupt,
        _ => ErrorKind::Internal,
    };
    Error::new(kind, format!("view index {}: {doing}: {err}", path.display()))
}

impl IndexStore {
    /// Opens (or creates) the index file at `path`.
    pub fn open(path: &Path) -> Result<Self> {
        Self::try_open(path)?.ok_or_else(|| failure(path, "open", redb::Error::DatabaseAlreadyOpen))
    }

    /// Opens (or creates) the index file at `path`; `None` when another process (or another
    /// opening in this one) holds it.
    pub fn try_open(path: &Path) -> Result<Option<Self>> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|err| {
                Error::new(ErrorKind::Misconfigured, format!("view index directory {}: {err}", parent.display()))
            })?;
        }
        let db = match Database::create(path) {
            Ok(db) => db,
            Err(redb::DatabaseError::DatabaseAlreadyOpen) => return Ok(None),
            Err(err) => return Err(failure(path, "open", err)),
        };
        let store = IndexStore { path: path.to_owned(), db, reductions: ReduceCache::default() };
        let txn = store.db.begin_write().map_err(|e| store.fail("begin", e))?;
        {
            txn.open_table(ROWS).map_err(|e| store.fail("create tables", e))?;
            txn.open_table(BACK).map_err(|e| store.fail("create tables", e))?;
            txn.open_table(GROUPS).map_err(|e| store.fail("create tables", e))?;
            txn.open_table(META).map_err(|e| store.fail("create tables", e))?;
            txn.open_table(BLOCKS).map_err(|e| store.fail("create tables", e))?;
        }
        txn.commit().map_err(|e| store.fail("create tables", e))?;
        Ok(Some(store))
    }

    fn fail(&self, doing: &str, err: impl Into<redb::Error>) -> Error {
        failure(&self.path, doing, err)
    }

    /// The reduce answers kept for this file's groups ([`super::reduce_cache`]).
    pub fn reductions(&self) -> &ReduceCache {
        &self.reductions
    }

    /// The group named `name` with `views` views, created empty when missing (or when its rows
    /// were written in another format, [`current_format`]: then its old rows are dropped first).
    pub fn group(&self, name: &str, views: usize) -> Result<GroupState> {
        if let Some(state) = self.read_group(name)? {
            if state.format == current_format() && state.row_counts.len() == views {
                return Ok(state);
            }
        }
        let txn = self.db.begin_write().map_err(|e| self.fail("begin", e))?;
        let mut ended = None;
        let state = {
            let mut groups = txn.open_table(GROUPS).map_err(|e| self.fail("open groups", e))?;
            let existing = match groups.get(name).map_err(|e| self.fail("read group", e))? {
                Some(bytes) => Some(decode_state(bytes.value())?),
                None => None,
            };
            match existing {
                Some(state) if state.format == current_format() && state.row_counts.len() == views => state,
                stale => {
                    if let Some(stale) = &stale {
                        self.erase_rows(&txn, stale.number)?;
                    }
                    ended = stale.map(|stale| stale.number);
                    let mut meta = txn.open_table(META).map_err(|e| self.fail("open meta", e))?;
                    let number = meta.get(NEXT_GROUP).map_err(|e| self.fail("read meta", e))?.map_or(1, |v| v.value());
                    meta.insert(NEXT_GROUP, number + 1).map_err(|e| self.fail("write meta", e))?;
                    let state = GroupState {
                        number,
                        checkpoint: None,
                        row_counts: vec![0; views],
                        format: current_format(),
                        stored_bytes: 0,
                    };
                    groups.insert(name, encode_state(&state)?.as_slice()).map_err(|e| self.fail("write group", e))?;
                    state
                }
            }
        };
        txn.commit().map_err(|e| self.fail("commit", e))?;
        if let Some(number) = ended {
            self.reductions.invalidate(number);
        }
        Ok(state)
    }

    /// The recorded state of the group `name`, if it exists.
    pub fn read_group(&self, name: &str) -> Result<Option<GroupState>> {
        let txn = self.db.begin_read().map_err(|e| self.fail("begin read", e))?;
        let groups = txn.open_table(GROUPS).map_err(|e| self.fail("open groups", e))?;
        match groups.get(name).map_err(|e| self.fail("read group", e))? {
            Some(bytes) => Ok(Some(decode_state(bytes.value())?)),
            None => Ok(None),
        }
    }

    /// The names of every group whose name starts with `prefix`.
    pub fn group_names(&self, prefix: &str) -> Result<Vec<String>> {
        let txn = self.db.begin_read().map_err(|e| self.fail("begin read", e))?;
        let groups = txn.open_table(GROUPS).map_err(|e| self.fail("open groups", e))?;
        let mut names = Vec::new();
        for entry in groups.range(prefix..).map_err(|e| self.fail("list groups", e))? {
            let (name, _) = entry.map_err(|e| self.fail("list groups", e))?;
            if !name.value().starts_with(prefix) {
                break;
            }
            names.push(name.value().to_owned());
        }
        Ok(names)
    }

    /// The bytes stored by every group whose name starts with `prefix` (a database's groups)
    /// besides `except`.
    pub fn stored_bytes_besides(&self, prefix: &str, except: &str) -> Result<u64> {
        let txn = self.db.begin_read().map_err(|e| self.fail("begin read", e))?;
        let groups = txn.open_table(GROUPS).map_err(|e| self.fail("open groups", e))?;
        let mut total = 0u64;
        for entry in groups.range(prefix..).map_err(|e| self.fail("list groups", e))? {
            let (name, state) = entry.map_err(|e| self.fail("list groups", e))?;
            if !name.value().starts_with(prefix) {
                break;
            }
            if name.value() != except {
                total = total.saturating_add(decode_state(state.value())?.stored_bytes);
            }
        }
        Ok(total)
    }

    /// Replaces each document's rows with its new mapping and records `checkpoint` as the
    /// group's feed position, in one durable transaction. Returns the new state.
    pub fn apply(&self, name: &str, docs: &[MappedDoc], checkpoint: &str) -> Result<GroupState> {
        let options = ApplyOptions { checkpoint: Some(checkpoint), max_bytes: u64::MAX, durable: true, partials: &[] };
        self.apply_within(name, docs, options)
    }

    /// [`Self::apply`], as `options` say: keeping the recorded feed position when
    /// `checkpoint` is `None` (part of a feed page written before the rest of it is mapped:
    /// mapping those documents again replaces their rows, so rows ahead of the position are
    /// harmless); refused (`TooLarge`, nothing written) when it would leave the group over
    /// `max_bytes` of [`GroupState::stored_bytes`] and larger than it was (a write that shrinks
    /// the group is always taken); committed without waiting for the disk unless `durable`.
    pub fn apply_within(&self, name: &str, docs: &[MappedDoc], options: ApplyOptions<'_>) -> Result<GroupState> {
        let ApplyOptions { checkpoint, max_bytes, durable, partials } = options;
        let mut txn = self.db.begin_write().map_err(|e| self.fail("begin", e))?;
        // Rows and their feed position still commit together; a crash goes back to the last
        // durable commit, whose rows match its own position. Where redb refuses a commit that
        // does not wait for the disk, it waits.
        if !durable && txn.set_durability(redb::Durability::None).is_err() {
            tracing::debug!(path = %self.path.display(), "view index: a durable commit where none was needed");
        }
        let state = {
            let mut groups = txn.open_table(GROUPS).map_err(|e| self.fail("open groups", e))?;
            let mut state = match groups.get(name).map_err(|e| self.fail("read group", e))? {
                Some(bytes) => decode_state(bytes.value())?,
                None => return Err(Error::new(ErrorKind::NotFound, format!("view group {name} was dropped"))),
            };
            let bytes_before = state.stored_bytes;
            // Added and removed apart, so neither underflows whatever the order.
            let (mut added_bytes, mut removed_bytes) = (0u64, 0u64);
            let mut rows = txn.open_table(ROWS).map_err(|e| self.fail("open rows", e))?;
            let mut back = txn.open_table(BACK).map_err(|e| self.fail("open back-index", e))?;
            let mut changes = Vec::new();
            for doc in docs {
                let back_key = back_key(state.number, &doc.id);
                let old = back
                    .remove(back_key.as_slice())
                    .map_err(|e| self.fail("read back-index", e))?
                    .map(|v| v.value().to_vec());
                if let Some(old) = &old {
                    removed_bytes += (back_key.len() + old.len()) as u64;
                }
                for row_key in old.as_deref().map(split_keys).unwrap_or_default() {
                    if let Some(removed) = rows.remove(row_key).map_err(|e| self.fail("remove row", e))? {
                        removed_bytes += (row_key.len() + removed.value().len()) as u64;
                        changes.push(RowChange { key: row_key.to_vec(), delta: -1, added: None });
                        let view = view_of(row_key);
                        if let Some(count) = state.row_counts.get_mut(view) {
                            *count = count.saturating_sub(1);
                        }
                    }
                }
                let mut written = Vec::new();
                for (view, emitted) in doc.rows.iter().enumerate().take(state.row_counts.len()) {
                    // A document's rows with equal keys come back ordered by value, as CouchDB
                    // sorts a document's key/value pairs (Erlang's term order) before storing.
                    let mut emitted: Vec<&(Value, Value)> = emitted.iter().collect();
                    emitted.sort_by(|a, b| {
                        super::collation::compare(&a.0, &b.0).then_with(|| super::collation::compare_raw(&a.1, &b.1))
                    });
                    for (emit, (key, value)) in emitted.into_iter().enumerate() {
                        let row_key = row_key(state.number, view, key, &doc.id, emit);
                        let stored = serde_json::to_vec(&(key, &doc.id, value))
                            .map_err(|err| Error::new(ErrorKind::Internal, format!("encode view row: {err}")))?;
                        added_bytes += (row_key.len() + stored.len()) as u64;
                        let replaced = rows
                            .insert(row_key.as_slice(), stored.as_slice())
                            .map_err(|e| self.fail("write row", e))?
                            .map(|old| old.value().len());
                        if let Some(old_len) = replaced {
                            removed_bytes += (row_key.len() + old_len) as u64;
                        }
                        if replaced.is_none() {
                            state.row_counts[view] += 1;
                            changes.push(RowChange { key: row_key.clone(), delta: 1, added: Some(value.clone()) });
                        } else {
                            changes.push(RowChange { key: row_key.clone(), delta: 0, added: None });
                        }
                        written.extend_from_slice(&(row_key.len() as u32).to_be_bytes());
                        written.extend_from_slice(&row_key);
                    }
                }
                if !written.is_empty() {
                    added_bytes += (back_key.len() + written.len()) as u64;
                    back.insert(back_key.as_slice(), written.as_slice())
                        .map_err(|e| self.fail("write back-index", e))?;
                }
            }
            state.stored_bytes = (bytes_before + added_bytes).saturating_sub(removed_bytes);
            if state.stored_bytes > max_bytes && state.stored_bytes > bytes_before {
                // Dropping the transaction uncommitted leaves the group as it was.
                return Err(Error::new(
                    ErrorKind::TooLarge,
                    format!(
                        "this write would take the index to {} bytes, past its bound of {max_bytes}",
                        state.stored_bytes
                    ),
                ));
            }
            let mut blocks = txn.open_table(BLOCKS).map_err(|e| self.fail("open blocks", e))?;
            self.update_blocks(&rows, &mut blocks, changes, partials)?;
            if let Some(checkpoint) = checkpoint {
                state.checkpoint = Some(checkpoint.to_owned());
            }
            groups.insert(name, encode_state(&state)?.as_slice()).map_err(|e| self.fail("write group", e))?;
            state
        };
        txn.commit().map_err(|e| self.fail("commit", e))?;
        self.reductions.invalidate(state.number);
        Ok(state)
    }

    /// Calls `each` with the rows of view `view` of group `number` within `range`, in key order
    /// (or reversed), until it breaks.
    pub fn scan(
        &self,
        number: u64,
        view: usize,
        range: &RowRange,
        descending: bool,
        mut each: impl FnMut(IndexRow) -> ControlFlow<()>,
    ) -> Result<()> {
        let prefix = view_prefix(number, view);
        let (low, high) = full_bounds(&prefix, range);
        if bounds_are_empty(&low, &high) {
            return Ok(());
        }
        let txn = self.db.begin_read().map_err(|e| self.fail("begin read", e))?;
        let rows = txn.open_table(ROWS).map_err(|e| self.fail("open rows", e))?;
        // Whether `each` broke off is no matter: nothing follows.
        let _ = self.scan_rows(&rows, &low, &high, descending, &mut |_, row| each(row))?;
        Ok(())
    }

    /// At most `max` rows of view `view` of group `number` within `range`, in key order (or
    /// reversed), read in one short read transaction, with the part of `range` after them
    /// (`None` once the range is read to its end). A long answer is read page by page, so
    /// nothing is held between pages: not a transaction, not a thread.
    pub fn page(&self, number: u64, view: usize, range: &RowRange, descending: bool, max: usize) -> Result<RowPage> {
        let prefix = view_prefix(number, view);
        let (low, high) = full_bounds(&prefix, range);
        let mut page = RowPage { rows: Vec::new(), rest: None };
        if bounds_are_empty(&low, &high) || max == 0 {
            return Ok(page);
        }
        let txn = self.db.begin_read().map_err(|e| self.fail("begin read", e))?;
        let rows = txn.open_table(ROWS).map_err(|e| self.fail("open rows", e))?;
        let mut last_key: Vec<u8> = Vec::new();
        let _ = self.scan_rows(&rows, &low, &high, descending, &mut |full_key, row| {
            page.rows.push(row);
            if page.rows.len() < max {
                return ControlFlow::Continue(());
            }
            last_key = full_key.get(VIEW_PREFIX_LEN..).unwrap_or_default().to_vec();
            ControlFlow::Break(())
        })?;
        if page.rows.len() >= max {
            let after = Bound::Excluded(last_key);
            page.rest = Some(if descending {
                RowRange { low: range.low.clone(), high: after }
            } else {
                RowRange { low: after, high: range.high.clone() }
            });
        }
        Ok(page)
    }

    /// How many rows of view `view` lie below `bound`, an upper bound in row-key bytes after the
    /// view prefix (`Excluded(k)`: the rows before `k`; `Included(k)`: those at or before it).
    /// Whole blocks' counts, then a scan within the one block `bound` falls in.
    pub fn count_below(&self, number: u64, view: usize, bound: &Bound<Vec<u8>>) -> Result<u64> {
        let prefix = view_prefix(number, view);
        let (low, high) = full_bounds(&prefix, &RowRange { low: Bound::Unbounded, high: bound.clone() });
        let txn = self.db.begin_read().map_err(|e| self.fail("begin read", e))?;
        let rows = txn.open_table(ROWS).map_err(|e| self.fail("open rows", e))?;
        let blocks = txn.open_table(BLOCKS).map_err(|e| self.fail("open blocks", e))?;
        let at = match &high {
            Bound::Included(bytes) | Bound::Excluded(bytes) => bytes.clone(),
            Bound::Unbounded => next_prefix(&prefix),
        };
        let Some((start, _)) = self.block_at(&blocks, &prefix, &at)? else {
            return self.count_rows(&rows, &low, &high);
        };
        let mut total = 0;
        for entry in
            blocks.range::<&[u8]>(prefix.as_slice()..start.as_slice()).map_err(|e| self.fail("read blocks", e))?
        {
            let (_, summary) = entry.map_err(|e| self.fail("read blocks", e))?;
            total += block_count(summary.value())?;
        }
        Ok(total + self.count_rows(&rows, &Bound::Included(start), &high)?)
    }

    /// How many rows of view `view` lie above `bound`, a lower bound in row-key bytes after the
    /// view prefix (`Excluded(k)`: the rows after `k`; `Included(k)`: those at or after it).
    pub fn count_above(&self, number: u64, view: usize, bound: &Bound<Vec<u8>>) -> Result<u64> {
        let prefix = view_prefix(number, view);
        let (low, high) = full_bounds(&prefix, &RowRange { low: bound.clone(), high: Bound::Unbounded });
        let txn = self.db.begin_read().map_err(|e| self.fail("begin read", e))?;
        let rows = txn.open_table(ROWS).map_err(|e| self.fail("open rows", e))?;
        let blocks = txn.open_table(BLOCKS).map_err(|e| self.fail("open blocks", e))?;
        let at = match &low {
            Bound::Included(bytes) | Bound::Excluded(bytes) => bytes.clone(),
            Bound::Unbounded => prefix.clone(),
        };
        let Some((start, _)) = self.block_at(&blocks, &prefix, &at)? else {
            return self.count_rows(&rows, &low, &high);
        };
        let view_end = next_prefix(&prefix);
        let end = self.block_end(&blocks, &prefix, &start)?;
        let mut total = self.count_rows(&rows, &low, &Bound::Excluded(end.clone()))?;
        if end < view_end {
            for entry in
                blocks.range::<&[u8]>(end.as_slice()..view_end.as_slice()).map_err(|e| self.fail("read blocks", e))?
            {
                let (_, summary) = entry.map_err(|e| self.fail("read blocks", e))?;
                total += block_count(summary.value())?;
            }
        }
        Ok(total)
    }

    /// Calls `each` with the rows of view `view` within `range`, in key order (or reversed), until
    /// it breaks, as [`IndexStore::scan`] does, but hands over a block of rows lying wholly within
    /// the range as one [`Piece::Block`] when `take_whole` accepts it (given its summary and, when
    /// `with_keys`, its first and last rows' keys; `null` otherwise). A block it refuses comes
    /// row by row. Only the range's edges, at most a block at each end, are always read row by
    /// row.
    #[allow(clippy::too_many_arguments)]
    pub fn scan_pieces(
        &self,
        number: u64,
        view: usize,
        range: &RowRange,
        descending: bool,
        with_keys: bool,
        mut take_whole: impl FnMut(&BlockSummary, &Value, &Value) -> bool,
        mut each: impl FnMut(Piece) -> ControlFlow<()>,
    ) -> Result<()> {
        let prefix = view_prefix(number, view);
        let view_end = next_prefix(&prefix);
        let (low, high) = full_bounds(&prefix, range);
        if bounds_are_empty(&low, &high) {
            return Ok(());
        }
        let txn = self.db.begin_read().map_err(|e| self.fail("begin read", e))?;
        let rows = txn.open_table(ROWS).map_err(|e| self.fail("open rows", e))?;
        let blocks = txn.open_table(BLOCKS).map_err(|e| self.fail("open blocks", e))?;
        let (low_bytes, high_bytes) = match (&low, &high) {
            (Bound::Included(l) | Bound::Excluded(l), Bound::Included(h) | Bound::Excluded(h)) => {
                (l.clone(), h.clone())
            }
            _ => (prefix.clone(), view_end.clone()),
        };
        // Every row below a block's `end` is within the range's upper bound.
        let ends_within = |end: &[u8]| end <= high_bytes.as_slice();
        // Every row at or after a block's `start` is within the range's lower bound.
        let starts_within = |start: &[u8]| match &low {
            Bound::Excluded(l) => start > l.as_slice(),
            _ => start >= low_bytes.as_slice(),
        };
        let mut whole = Whole { with_keys, take_whole: &mut take_whole, each: &mut each };
        let read_blocks = |e| self.fail("read blocks", e);
        if !descending {
            let mut cursor = low.clone();
            let mut pending: Option<(Vec<u8>, Vec<u8>)> = None;
            let mut iter = blocks
                .range::<&[u8]>((Bound::Included(low_bytes.as_slice()), Bound::Excluded(view_end.as_slice())))
                .map_err(read_blocks)?;
            loop {
                let next = match iter.next() {
                    Some(entry) => {
                        let (start, summary) = entry.map_err(read_blocks)?;
                        Some((start.value().to_vec(), summary.value().to_vec()))
                    }
                    None => None,
                };
                let next_start = next.as_ref().map_or_else(|| view_end.clone(), |(start, _)| start.clone());
                if let Some((start, summary)) = pending.take() {
                    if !ends_within(&next_start) {
                        break;
                    }
                    let before = Bound::Excluded(start.clone());
                    if self
                        .scan_rows(&rows, &cursor, &before, false, &mut |_, row| (whole.each)(Piece::Row(row)))?
                        .is_break()
                        || self.whole_block(&rows, &mut whole, &start, &next_start, &summary, false)?.is_break()
                    {
                        return Ok(());
                    }
                    cursor = Bound::Included(next_start.clone());
                }
                let Some((start, summary)) = next else { break };
                if starts_within(&start) {
                    pending = Some((start, summary));
                }
            }
            let _ = self.scan_rows(&rows, &cursor, &high, false, &mut |_, row| (whole.each)(Piece::Row(row)))?;
        } else {
            let mut cursor = high.clone();
            let mut end = if high_bytes < view_end {
                let mut after = blocks
                    .range::<&[u8]>((Bound::Excluded(high_bytes.as_slice()), Bound::Excluded(view_end.as_slice())))
                    .map_err(read_blocks)?;
                match after.next() {
                    Some(entry) => entry.map_err(read_blocks)?.0.value().to_vec(),
                    None => view_end.clone(),
                }
            } else {
                view_end.clone()
            };
            let top = if high_bytes < view_end {
                Bound::Included(high_bytes.as_slice())
            } else {
                Bound::Excluded(view_end.as_slice())
            };
            let candidates =
                blocks.range::<&[u8]>((Bound::Included(low_bytes.as_slice()), top)).map_err(read_blocks)?;
            for entry in candidates.rev() {
                let (start, summary) = entry.map_err(read_blocks)?;
                let (start, summary) = (start.value().to_vec(), summary.value().to_vec());
                let block_end = std::mem::replace(&mut end, start.clone());
                if !ends_within(&block_end) {
                    continue;
                }
                if !starts_within(&start) {
                    break;
                }
                let after = Bound::Included(block_end.clone());
                if self.scan_rows(&rows, &after, &cursor, true, &mut |_, row| (whole.each)(Piece::Row(row)))?.is_break()
                    || self.whole_block(&rows, &mut whole, &start, &block_end, &summary, true)?.is_break()
                {
                    return Ok(());
                }
                cursor = Bound::Excluded(start);
            }
            let _ = self.scan_rows(&rows, &low, &cursor, true, &mut |_, row| (whole.each)(Piece::Row(row)))?;
        }
        Ok(())
    }

    /// A block wholly within a scanned range: one piece if `whole` takes it, else its rows.
    fn whole_block<T: ReadableTable<&'static [u8], &'static [u8]>>(
        &self,
        rows: &T,
        whole: &mut Whole<'_, impl FnMut(&BlockSummary, &Value, &Value) -> bool, impl FnMut(Piece) -> ControlFlow<()>>,
        start: &[u8],
        end: &[u8],
        summary: &[u8],
        descending: bool,
    ) -> Result<ControlFlow<()>> {
        let summary = BlockSummary::decode(summary)?;
        if summary.count == 0 {
            return Ok(ControlFlow::Continue(()));
        }
        let (first_key, last_key) =
            if whole.with_keys { self.edge_keys(rows, start, end)? } else { (Value::Null, Value::Null) };
        if (whole.take_whole)(&summary, &first_key, &last_key) {
            return Ok((whole.each)(Piece::Block { summary, first_key, last_key }));
        }
        let (low, high) = (Bound::Included(start.to_vec()), Bound::Excluded(end.to_vec()));
        self.scan_rows(rows, &low, &high, descending, &mut |_, row| (whole.each)(Piece::Row(row)))
    }

    /// The keys of the first and last rows in `[start, end)`.
    fn edge_keys<T: ReadableTable<&'static [u8], &'static [u8]>>(
        &self,
        rows: &T,
        start: &[u8],
        end: &[u8],
    ) -> Result<(Value, Value)> {
        let mut iter = rows.range::<&[u8]>(start..end).map_err(|e| self.fail("scan rows", e))?;
        let key_of = |entry: Option<ScannedEntry>| -> Result<Value> {
            let Some(entry) = entry else { return Ok(Value::Null) };
            let (_, stored) = entry.map_err(|e| self.fail("scan rows", e))?;
            let (key, _, _): (Value, IgnoredAny, IgnoredAny) = parse_stored(stored.value())
                .map_err(|err| Error::new(ErrorKind::Corrupt, format!("view row: {err}")))?;
            Ok(key)
        };
        let first = key_of(iter.next())?;
        let last = match iter.next_back() {
            Some(entry) => key_of(Some(entry))?,
            None => first.clone(),
        };
        Ok((first, last))
    }

    /// Calls `each` with the rows between two full-key bounds, each with its full key; says
    /// whether it broke.
    fn scan_rows<T: ReadableTable<&'static [u8], &'static [u8]>>(
        &self,
        rows: &T,
        low: &Bound<Vec<u8>>,
        high: &Bound<Vec<u8>>,
        descending: bool,
        each: &mut dyn FnMut(&[u8], IndexRow) -> ControlFlow<()>,
    ) -> Result<ControlFlow<()>> {
        if bounds_are_empty(low, high) {
            return Ok(ControlFlow::Continue(()));
        }
        let bounds: (Bound<&[u8]>, Bound<&[u8]>) = (as_slice(low), as_slice(high));
        let iter = rows.range::<&[u8]>(bounds).map_err(|e| self.fail("scan rows", e))?;
        let mut visit = |entry: ScannedEntry| {
            let (full_key, stored) = entry.map_err(|e| self.fail("scan rows", e))?;
            let (key, id, value): (Value, String, Value) = parse_stored(stored.value())
                .map_err(|err| Error::new(ErrorKind::Corrupt, format!("view row: {err}")))?;
            Ok::<_, Error>(each(full_key.value(), IndexRow { key, id, value }))
        };
        if descending {
            for entry in iter.rev() {
                if visit(entry)?.is_break() {
                    return Ok(ControlFlow::Break(()));
                }
            }
        } else {
            for entry in iter {
                if visit(entry)?.is_break() {
                    return Ok(ControlFlow::Break(()));
                }
            }
        }
        Ok(ControlFlow::Continue(()))
    }

    /// How many rows lie between two full-key bounds (keys only: no row is decoded).
    fn count_rows<T: ReadableTable<&'static [u8], &'static [u8]>>(
        &self,
        rows: &T,
        low: &Bound<Vec<u8>>,
        high: &Bound<Vec<u8>>,
    ) -> Result<u64> {
        if bounds_are_empty(low, high) {
            return Ok(0);
        }
        let bounds: (Bound<&[u8]>, Bound<&[u8]>) = (as_slice(low), as_slice(high));
        let mut count = 0;
        for entry in rows.range::<&[u8]>(bounds).map_err(|e| self.fail("count rows", e))? {
            entry.map_err(|e| self.fail("count rows", e))?;
            count += 1;
        }
        Ok(count)
    }

    /// The block holding `key` (a full row key of the view with prefix `prefix`): its start and
    /// summary. `None` when the view has no block yet.
    fn block_at<T: ReadableTable<&'static [u8], &'static [u8]>>(
        &self,
        blocks: &T,
        prefix: &[u8],
        key: &[u8],
    ) -> Result<Option<(Vec<u8>, BlockSummary)>> {
        let mut iter = blocks.range::<&[u8]>(prefix..=key).map_err(|e| self.fail("read blocks", e))?;
        match iter.next_back() {
            Some(entry) => {
                let (start, summary) = entry.map_err(|e| self.fail("read blocks", e))?;
                Ok(Some((start.value().to_vec(), BlockSummary::decode(summary.value())?)))
            }
            None => Ok(None),
        }
    }

    /// Where the block starting at `start` ends: the next block's start, or the view's end.
    fn block_end<T: ReadableTable<&'static [u8], &'static [u8]>>(
        &self,
        blocks: &T,
        prefix: &[u8],
        start: &[u8],
    ) -> Result<Vec<u8>> {
        let view_end = next_prefix(prefix);
        let bounds: (Bound<&[u8]>, Bound<&[u8]>) = (Bound::Excluded(start), Bound::Excluded(view_end.as_slice()));
        if start >= view_end.as_slice() {
            return Ok(view_end);
        }
        let mut iter = blocks.range::<&[u8]>(bounds).map_err(|e| self.fail("read blocks", e))?;
        match iter.next() {
            Some(entry) => Ok(entry.map_err(|e| self.fail("read blocks", e))?.0.value().to_vec()),
            None => Ok(view_end),
        }
    }

    /// The start of the block before the one starting at `start`, if any.
    fn block_before<T: ReadableTable<&'static [u8], &'static [u8]>>(
        &self,
        blocks: &T,
        prefix: &[u8],
        start: &[u8],
    ) -> Result<Option<Vec<u8>>> {
        if start <= prefix {
            return Ok(None);
        }
        let mut iter = blocks.range::<&[u8]>(prefix..start).map_err(|e| self.fail("read blocks", e))?;
        match iter.next_back() {
            Some(entry) => Ok(Some(entry.map_err(|e| self.fail("read blocks", e))?.0.value().to_vec())),
            None => Ok(None),
        }
    }

    /// Brings the blocks the rows in `changes` belong to up to date: counts and partials folded
    /// in for added rows; a block that lost or replaced rows, grew past [`BLOCK_MAX`] or shrank
    /// below [`BLOCK_MIN`] is rebuilt from its rows (split, or merged with a neighbour).
    fn update_blocks(
        &self,
        rows: &redb::Table<&'static [u8], &'static [u8]>,
        blocks: &mut redb::Table<&'static [u8], &'static [u8]>,
        mut changes: Vec<RowChange>,
        partials: &[Partials],
    ) -> Result<()> {
        let kept = |block_start: &[u8]| partials.get(view_of(block_start)).copied().unwrap_or(Partials::BOTH);
        struct Touched {
            start: Vec<u8>,
            old: BlockSummary,
            delta: i64,
            dirty: bool,
            added: Vec<(Value, Value)>,
        }
        changes.sort_by(|a, b| a.key.cmp(&b.key));
        let mut touched: Vec<Touched> = Vec::new();
        let mut end = Vec::new();
        for change in changes {
            if touched.is_empty() || change.key >= end {
                let prefix = change
                    .key
                    .get(..VIEW_PREFIX_LEN)
                    .ok_or_else(|| Error::new(ErrorKind::Internal, "a view row key without its prefix".to_owned()))?;
                let (start, old) = self
                    .block_at(&*blocks, prefix, &change.key)?
                    .unwrap_or_else(|| (prefix.to_vec(), BlockSummary::empty()));
                end = self.block_end(&*blocks, prefix, &start)?;
                touched.push(Touched { start, old, delta: 0, dirty: false, added: Vec::new() });
            }
            if let Some(block) = touched.last_mut() {
                block.delta += change.delta;
                match change.added {
                    Some(value) => block.added.push((Value::Null, value)),
                    None => block.dirty = true,
                }
            }
        }
        let mut to_rebuild = Vec::new();
        for block in touched {
            let count = u64::try_from(block.old.count as i64 + block.delta).unwrap_or(0);
            let summary = if block.dirty {
                BlockSummary { count, sum: None, stats: None }
            } else {
                block.old.joined(BlockSummary::of_kept(&block.added, kept(&block.start)))
            };
            blocks
                .insert(block.start.as_slice(), summary.encode()?.as_slice())
                .map_err(|e| self.fail("write block", e))?;
            if block.dirty || !(BLOCK_MIN..=BLOCK_MAX).contains(&count) {
                to_rebuild.push((block.start, block.dirty));
            }
        }
        for (start, dirty) in to_rebuild {
            let count = match blocks.get(start.as_slice()).map_err(|e| self.fail("read block", e))? {
                Some(summary) => block_count(summary.value())?,
                // Merged into its neighbour by an earlier rebuild.
                None => continue,
            };
            let prefix = start[..VIEW_PREFIX_LEN].to_vec();
            let prefix = prefix.as_slice();
            let view_end = next_prefix(prefix);
            let end = self.block_end(&*blocks, prefix, &start)?;
            let span = if count < BLOCK_MIN {
                if let Some(before) = self.block_before(&*blocks, prefix, &start)? {
                    (before, end)
                } else if end < view_end {
                    let after_end = self.block_end(&*blocks, prefix, &end)?;
                    (start, after_end)
                } else if dirty {
                    (start, end)
                } else {
                    continue;
                }
            } else {
                (start, end)
            };
            self.rebuild_blocks(rows, blocks, prefix, (&span.0, &span.1), kept(prefix))?;
        }
        Ok(())
    }

    /// Replaces the blocks in `[start, end)` (of the view with prefix `prefix`) with blocks made
    /// from its rows: one if they are at most [`BLOCK_MAX`], else even blocks of about
    /// [`BLOCK_ROWS`]. The first keeps `start`, so a view's first block stays at its prefix.
    fn rebuild_blocks(
        &self,
        rows: &redb::Table<&'static [u8], &'static [u8]>,
        blocks: &mut redb::Table<&'static [u8], &'static [u8]>,
        prefix: &[u8],
        (start, end): (&[u8], &[u8]),
        kept: Partials,
    ) -> Result<()> {
        let (low, high) = (Bound::Included(start.to_vec()), Bound::Excluded(end.to_vec()));
        let total = self.count_rows(rows, &low, &high)?;
        let pieces = if total > BLOCK_MAX { total.div_ceil(BLOCK_ROWS) } else { 1 };
        let mut made: Vec<(Vec<u8>, BlockSummary)> = Vec::new();
        let mut piece_start = start.to_vec();
        let mut values = Vec::new();
        let mut piece = 0;
        if total > 0 {
            let bounds: (Bound<&[u8]>, Bound<&[u8]>) = (as_slice(&low), as_slice(&high));
            for (index, entry) in rows.range::<&[u8]>(bounds).map_err(|e| self.fail("scan rows", e))?.enumerate() {
                let (key, stored) = entry.map_err(|e| self.fail("scan rows", e))?;
                if piece + 1 < pieces && index as u64 == (piece + 1) * total / pieces {
                    made.push((
                        std::mem::replace(&mut piece_start, key.value().to_vec()),
                        BlockSummary::of_kept(&values, kept),
                    ));
                    values.clear();
                    piece += 1;
                }
                let (_, _, value): (IgnoredAny, IgnoredAny, Value) = parse_stored(stored.value())
                    .map_err(|err| Error::new(ErrorKind::Corrupt, format!("view row: {err}")))?;
                values.push((Value::Null, value));
            }
        }
        made.push((piece_start, BlockSummary::of_kept(&values, kept)));
        blocks.retain_in::<&[u8], _>(start..end, |_, _| false).map_err(|e| self.fail("rewrite blocks", e))?;
        for (block_start, summary) in made {
            // An empty span keeps no block, except a view's first (every row needs one below it).
            if summary.count == 0 && block_start.as_slice() != prefix {
                continue;
            }
            blocks
                .insert(block_start.as_slice(), summary.encode()?.as_slice())
                .map_err(|e| self.fail("write block", e))?;
        }
        Ok(())
    }

    /// Drops the group `name` and its rows.
    pub fn drop_group(&self, name: &str) -> Result<bool> {
        let txn = self.db.begin_write().map_err(|e| self.fail("begin", e))?;
        let dropped = {
            let mut groups = txn.open_table(GROUPS).map_err(|e| self.fail("open groups", e))?;
            let removed = groups.remove(name).map_err(|e| self.fail("remove group", e))?.map(|v| v.value().to_vec());
            match removed {
                Some(bytes) => {
                    let number = decode_state(&bytes)?.number;
                    self.erase_rows(&txn, number)?;
                    Some(number)
                }
                None => None,
            }
        };
        txn.commit().map_err(|e| self.fail("commit", e))?;
        if let Some(number) = dropped {
            self.reductions.invalidate(number);
        }
        Ok(dropped.is_some())
    }

    fn erase_rows(&self, txn: &redb::WriteTransaction, number: u64) -> Result<()> {
        let prefix = number.to_be_bytes().to_vec();
        let end = next_prefix(&prefix);
        let mut rows = txn.open_table(ROWS).map_err(|e| self.fail("open rows", e))?;
        rows.retain_in::<&[u8], _>(prefix.as_slice()..end.as_slice(), |_, _| false)
            .map_err(|e| self.fail("erase rows", e))?;
        let mut back = txn.open_table(BACK).map_err(|e| self.fail("open back-index", e))?;
        back.retain_in::<&[u8], _>(prefix.as_slice()..end.as_slice(), |_, _| false)
            .map_err(|e| self.fail("erase back-index", e))?;
        let mut blocks = txn.open_table(BLOCKS).map_err(|e| self.fail("open blocks", e))?;
        blocks
            .retain_in::<&[u8], _>(prefix.as_slice()..end.as_slice(), |_, _| false)
            .map_err(|e| self.fail("erase blocks", e))?;
        Ok(())
    }
}

/// One entry of a scan of `view_rows`, as redb yields it.
type ScannedEntry<'a> = std::result::Result<
    (redb::AccessGuard<'a, &'static [u8]>, redb::AccessGuard<'a, &'static [u8]>),
    redb::StorageError,
>;

fn encode_state(state: &GroupState) -> Result<Vec<u8>> {
    serde_json::to_vec(state).map_err(|err| Error::new(ErrorKind::Internal, format!("encode view group: {err}")))
}

fn decode_state(bytes: &[u8]) -> Result<GroupState> {
    parse_stored(bytes).map_err(|err| Error::new(ErrorKind::Corrupt, format!("view group state: {err}")))
}

/// What [`IndexStore::scan_pieces`] does with a block wholly within its range.
struct Whole<'a, T, E> {
    with_keys: bool,
    take_whole: &'a mut T,
    each: &'a mut E,
}

/// The bytes of a view's prefix: group number (8) and view number (2).
const VIEW_PREFIX_LEN: usize = 10;

/// A range within a view as bounds on full row keys (never unbounded: the view's own bounds).
fn full_bounds(prefix: &[u8], range: &RowRange) -> (Bound<Vec<u8>>, Bound<Vec<u8>>) {
    let low = match &range.low {
        Bound::Included(bytes) => Bound::Included(join(prefix, bytes)),
        Bound::Excluded(bytes) => Bound::Excluded(join(prefix, bytes)),
        Bound::Unbounded => Bound::Included(prefix.to_vec()),
    };
    let high = match &range.high {
        Bound::Included(bytes) => Bound::Included(join(prefix, bytes)),
        Bound::Excluded(bytes) => Bound::Excluded(join(prefix, bytes)),
        Bound::Unbounded => Bound::Excluded(next_prefix(prefix)),
    };
    (low, high)
}

fn view_prefix(number: u64, view: usize) -> Vec<u8> {
    let mut prefix = number.to_be_bytes().to_vec();
    prefix.extend_from_slice(&(view as u16).to_be_bytes());
    prefix
}

/// The row key of the `emit`-th row a document emitted with `key` in a view.
fn row_key(number: u64, view: usize, key: &Value, id: &str, emit: usize) -> Vec<u8> {
    let mut bytes = view_prefix(number, view);
    sort_key::encode_into(key, &mut bytes);
    sort_key::escape_into(id.as_bytes(), &mut bytes);
    bytes.extend_from_slice(&(emit as u32).to_be_bytes());
    bytes
}

fn view_of(row_key: &[u8]) -> usize {
    row_key.get(8..10).map_or(usize::MAX, |b| u16::from_be_bytes([b[0], b[1]]) as usize)
}

fn back_key(number: u64, id: &str) -> Vec<u8> {
    let mut bytes = number.to_be_bytes().to_vec();
    bytes.extend_from_slice(id.as_bytes());
    bytes
}

/// The row keys in a back-index entry (each length-prefixed).
fn split_keys(mut bytes: &[u8]) -> Vec<&[u8]> {
    let mut keys = Vec::new();
    while bytes.len() >= 4 {
        let len = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize;
        let Some(key) = bytes.get(4..4 + len) else { break };
        keys.push(key);
        bytes = &bytes[4 + len..];
    }
    keys
}

fn join(prefix: &[u8], rest: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(prefix.len() + rest.len());
    bytes.extend_from_slice(prefix);
    bytes.extend_from_slice(rest);
    bytes
}

/// The smallest byte string greater than every string starting with `prefix`.
fn next_prefix(prefix: &[u8]) -> Vec<u8> {
    let mut bytes = prefix.to_vec();
    while let Some(last) = bytes.pop() {
        if last < 0xFF {
            bytes.push(last + 1);
            return bytes;
        }
    }
    vec![0xFF; prefix.len() + 1]
}

fn as_slice(bound: &Bound<Vec<u8>>) -> Bound<&[u8]> {
    match bound {
        Bound::Included(bytes) => Bound::Included(bytes.as_slice()),
        Bound::Excluded(bytes) => Bound::Excluded(bytes.as_slice()),
        Bound::Unbounded => Bound::Unbounded,
    }
}

/// Whether no key lies between the bounds (redb refuses a range whose start is past its end).
fn bounds_are_empty(low: &Bound<Vec<u8>>, high: &Bound<Vec<u8>>) -> bool {
    match (low, high) {
        (Bound::Included(a), Bound::Included(b)) => a > b,
        (Bound::Included(a) | Bound::Excluded(a), Bound::Excluded(b)) | (Bound::Excluded(a), Bound::Included(b)) => {
            a >= b
        }
        _ => false,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    fn all_rows(store: &IndexStore, number: u64, view: usize, descending: bool) -> Vec<(Value, String, Value)> {
        let mut out = Vec::new();
        store
            .scan(number, view, &RowRange::all(), descending, |row| {
                out.push((row.key, row.id, row.value));
                ControlFlow::Continue(())
            })
            .unwrap();
        out
    }

    fn doc(id: &str, rows: Vec<Vec<(Value, Value)>>) -> MappedDoc {
        MappedDoc { id: id.to_owned(), rows }
    }

    #[test]
    fn rows_come_back_in_collation_order_and_remappings_replace_them() {
        let dir = tempfile::tempdir().unwrap();
        let store = IndexStore::open(&dir.path().join("views.redb")).unwrap();
        let group = store.group("db\u{0}sig", 2).unwrap();
        let docs = vec![
            doc("b", vec![vec![(json!("B"), json!(1)), (json!("a"), json!(2))], vec![(json!(null), json!(null))]]),
            doc("a", vec![vec![(json!("a"), json!(3))], vec![]]),
        ];
        let state = store.apply("db\u{0}sig", &docs, "seq-1").unwrap();
        assert_eq!(state.row_counts, vec![3, 1]);
        assert_eq!(state.checkpoint.as_deref(), Some("seq-1"));
        assert_eq!(
            all_rows(&store, group.number, 0, false),
            vec![
                (json!("a"), "a".into(), json!(3)),
                (json!("a"), "b".into(), json!(2)),
                (json!("B"), "b".into(), json!(1))
            ]
        );
        assert_eq!(all_rows(&store, group.number, 0, true)[0].0, json!("B"));
        // `b` is remapped to one row, `a` is deleted.
        let state = store
            .apply("db\u{0}sig", &[doc("b", vec![vec![(json!(7), json!("x"))], vec![]]), doc("a", vec![])], "seq-2")
            .unwrap();
        assert_eq!(state.row_counts, vec![1, 0]);
        assert_eq!(all_rows(&store, group.number, 0, false), vec![(json!(7), "b".into(), json!("x"))]);
        assert!(all_rows(&store, group.number, 1, false).is_empty());
        // The state survives reopening.
        drop(store);
        let store = IndexStore::open(&dir.path().join("views.redb")).unwrap();
        assert_eq!(store.group("db\u{0}sig", 2).unwrap(), state);
        assert!(store.drop_group("db\u{0}sig").unwrap());
        assert!(all_rows(&store, group.number, 0, false).is_empty());
        assert_ne!(store.group("db\u{0}sig", 2).unwrap().number, group.number);
    }

    #[test]
    fn ranges_select_keys_and_ids() {
        let dir = tempfile::tempdir().unwrap();
        let store = IndexStore::open(&dir.path().join("views.redb")).unwrap();
        let group = store.group("g", 1).unwrap();
        let docs: Vec<MappedDoc> =
            (0..10).map(|i| doc(&format!("d{i}"), vec![vec![(json!(i % 5), json!(i))]])).collect();
        store.apply("g", &docs, "s").unwrap();
        let mut low = sort_key::encode(&json!(1));
        let mut high = sort_key::encode(&json!(3));
        high.push(sort_key::AFTER_ALL);
        let mut ids = Vec::new();
        store
            .scan(
                group.number,
                0,
                &RowRange { low: Bound::Included(low.clone()), high: Bound::Excluded(high) },
                false,
                |row| {
                    ids.push(row.id);
                    ControlFlow::Continue(())
                },
            )
            .unwrap();
        assert_eq!(ids, ["d1", "d6", "d2", "d7", "d3", "d8"]);
        sort_key::escape_into(b"d6", &mut low);
        let mut first = None;
        store
            .scan(group.number, 0, &RowRange { low: Bound::Included(low), high: Bound::Unbounded }, false, |row| {
                first = Some(row.id);
                ControlFlow::Break(())
            })
            .unwrap();
        assert_eq!(first.as_deref(), Some("d6"));
    }

    /// A deterministic pseudo-random source (xorshift64*), so a failing case can be replayed.
    pub(crate) struct Random(u64);

    impl Random {
        pub(crate) fn new(seed: u64) -> Self {
            Random(seed.max(1))
        }

        pub(crate) fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        /// A number in `0..bound`.
        pub(crate) fn below(&mut self, bound: u64) -> u64 {
            self.next() % bound.max(1)
        }
    }

    /// A random emitted key: mostly `[a, b]` arrays (for group levels), some numbers, strings
    /// and shorter arrays, with many repeats.
    pub(crate) fn random_key(random: &mut Random) -> Value {
        match random.below(10) {
            0 => json!(random.below(20)),
            1 => json!(format!("s{}", random.below(15))),
            2 => json!([random.below(6)]),
            _ => json!([random.below(6), random.below(12), random.below(3)]),
        }
    }

    /// Random documents out of `ids` ids for a two-view group: view 0 emits 0 to 3 rows with
    /// integer values; view 1 one row whose value is now and then a string (which `_sum` and
    /// `_stats` refuse). A document with no rows is a deletion.
    pub(crate) fn random_docs(random: &mut Random, count: usize, ids: u64) -> Vec<MappedDoc> {
        (0..count)
            .map(|_| {
                let id = format!("d{:05}", random.below(ids));
                if random.below(8) == 0 {
                    return MappedDoc { id, rows: vec![vec![], vec![]] };
                }
                let first = (0..random.below(4))
                    .map(|_| (random_key(random), json!(random.below(1000) as i64 - 300)))
                    .collect();
                let value = if random.below(3000) == 0 { json!("not a number") } else { json!(random.below(50)) };
                MappedDoc { id, rows: vec![first, vec![(random_key(random), value)]] }
            })
            .collect()
    }

    /// A store whose group `g` (two views) went through `rounds` random batches.
    pub(crate) fn random_store(seed: u64, rounds: usize) -> (tempfile::TempDir, IndexStore, u64) {
        let dir = tempfile::tempdir().unwrap();
        let store = IndexStore::open(&dir.path().join("views.redb")).unwrap();
        let number = store.group("g", 2).unwrap().number;
        let mut random = Random::new(seed);
        for round in 0..rounds {
            let size = [1, 20, 300, 1500][random.below(4) as usize];
            let docs = random_docs(&mut random, size, 4000);
            store.apply("g", &docs, &format!("s{round}")).unwrap();
        }
        (dir, store, number)
    }

    fn blocks_of(store: &IndexStore, number: u64, view: usize) -> Vec<(Vec<u8>, BlockSummary)> {
        let prefix = view_prefix(number, view);
        let end = next_prefix(&prefix);
        let txn = store.db.begin_read().unwrap();
        let blocks = txn.open_table(BLOCKS).unwrap();
        let found = blocks
            .range::<&[u8]>(prefix.as_slice()..end.as_slice())
            .unwrap()
            .map(|entry| {
                let (start, summary) = entry.unwrap();
                (start.value().to_vec(), BlockSummary::decode(summary.value()).unwrap())
            })
            .collect();
        found
    }

    /// Every block of the view holds the count and partials of exactly its rows, the first
    /// starts at the view's prefix, none is over [`BLOCK_MAX`], and only the first is under
    /// [`BLOCK_MIN`].
    fn check_blocks(store: &IndexStore, number: u64, view: usize) {
        let prefix = view_prefix(number, view);
        let blocks = blocks_of(store, number, view);
        let state_rows = all_rows(store, number, view, false).len() as u64;
        if state_rows == 0 && blocks.is_empty() {
            return;
        }
        assert_eq!(blocks[0].0, prefix, "the first block starts at the view's prefix");
        let mut counted = 0;
        for (index, (start, summary)) in blocks.iter().enumerate() {
            let high = match blocks.get(index + 1) {
                Some((next, _)) => Bound::Excluded(next[VIEW_PREFIX_LEN..].to_vec()),
                None => Bound::Unbounded,
            };
            let mut values = Vec::new();
            store
                .scan(
                    number,
                    view,
                    &RowRange { low: Bound::Included(start[VIEW_PREFIX_LEN..].to_vec()), high },
                    false,
                    |row| {
                        values.push((Value::Null, row.value));
                        ControlFlow::Continue(())
                    },
                )
                .unwrap();
            assert_eq!(summary, &BlockSummary::of(&values), "block {index} of {}", blocks.len());
            assert!(summary.count <= BLOCK_MAX, "block {index} has {} rows", summary.count);
            if index > 0 {
                assert!(summary.count >= BLOCK_MIN, "block {index} has {} rows", summary.count);
            }
            counted += summary.count;
        }
        assert_eq!(counted, state_rows);
    }

    /// A random bound within view rows: a key's sort key, with or without an id after it, or
    /// past every row of the key.
    fn random_bound(random: &mut Random) -> Bound<Vec<u8>> {
        let mut bytes = sort_key::encode(&random_key(random));
        match random.below(3) {
            0 => sort_key::escape_into(format!("d{:05}", random.below(4000)).as_bytes(), &mut bytes),
            1 => bytes.push(sort_key::AFTER_ALL),
            _ => {}
        }
        if random.below(2) == 0 {
            Bound::Included(bytes)
        } else {
            Bound::Excluded(bytes)
        }
    }

    fn plain_count(store: &IndexStore, number: u64, view: usize, range: RowRange) -> u64 {
        let mut count = 0;
        store
            .scan(number, view, &range, false, |_| {
                count += 1;
                ControlFlow::Continue(())
            })
            .unwrap();
        count
    }

    #[test]
    fn blocks_follow_random_inserts_updates_and_deletes() {
        let dir = tempfile::tempdir().unwrap();
        let store = IndexStore::open(&dir.path().join("views.redb")).unwrap();
        let number = store.group("g", 2).unwrap().number;
        let mut random = Random::new(26);
        let mut saw_many_blocks = false;
        for round in 0..40 {
            let size = [1, 20, 300, 1500][random.below(4) as usize];
            let docs = random_docs(&mut random, size, 4000);
            store.apply("g", &docs, &format!("s{round}")).unwrap();
            check_blocks(&store, number, 0);
            check_blocks(&store, number, 1);
            saw_many_blocks |= blocks_of(&store, number, 0).len() > 10;
        }
        assert!(saw_many_blocks, "the random data never made more than 10 blocks");
        // Deleting every document leaves each view one empty block.
        let ids: Vec<MappedDoc> =
            (0..4000).map(|i| MappedDoc { id: format!("d{i:05}"), rows: vec![vec![], vec![]] }).collect();
        let state = store.apply("g", &ids, "gone").unwrap();
        assert_eq!(state.row_counts, vec![0, 0]);
        for view in 0..2 {
            check_blocks(&store, number, view);
            assert_eq!(blocks_of(&store, number, view).len(), 1);
        }
    }

    #[test]
    fn block_counts_agree_with_counting_rows() {
        let (_dir, store, number) = random_store(7, 12);
        let mut random = Random::new(8);
        for _ in 0..300 {
            let view = random.below(2) as usize;
            let bound = random_bound(&mut random);
            let below = store.count_below(number, view, &bound).unwrap();
            assert_eq!(
                below,
                plain_count(&store, number, view, RowRange { low: Bound::Unbounded, high: bound.clone() })
            );
            let above = store.count_above(number, view, &bound).unwrap();
            assert_eq!(above, plain_count(&store, number, view, RowRange { low: bound, high: Bound::Unbounded }));
        }
    }

    #[test]
    fn pieces_cover_exactly_the_rows_of_a_range() {
        let (_dir, store, number) = random_store(11, 10);
        let mut random = Random::new(12);
        let mut blocks_taken = 0;
        for _ in 0..200 {
            let view = random.below(2) as usize;
            let (a, b) = (random_bound(&mut random), random_bound(&mut random));
            let range = match (&a, &b) {
                (Bound::Included(x) | Bound::Excluded(x), Bound::Included(y) | Bound::Excluded(y)) if x > y => {
                    RowRange { low: b, high: a }
                }
                _ => RowRange { low: a, high: b },
            };
            let range = match random.below(5) {
                0 => RowRange { low: Bound::Unbounded, high: range.high },
                1 => RowRange { low: range.low, high: Bound::Unbounded },
                _ => range,
            };
            let descending = random.below(2) == 0;
            let mut plain = Vec::new();
            store
                .scan(number, view, &range, descending, |row| {
                    plain.push(row);
                    ControlFlow::Continue(())
                })
                .unwrap();
            // Blocks taken at random: the rows left out are exactly those the blocks stand for.
            let mut rows = Vec::new();
            let mut in_blocks = BlockSummary::empty();
            let mut skipped = 0u64;
            store
                .scan_pieces(
                    number,
                    view,
                    &range,
                    descending,
                    true,
                    |_, _, _| random.below(3) != 0,
                    |piece| {
                        match piece {
                            Piece::Row(row) => rows.push(row),
                            Piece::Block { summary, first_key, last_key } => {
                                assert!(summary.count > 0);
                                let (first, last) = (sort_key::encode(&first_key), sort_key::encode(&last_key));
                                assert!(first <= last);
                                skipped += summary.count;
                                in_blocks = std::mem::replace(&mut in_blocks, BlockSummary::empty()).joined(summary);
                                blocks_taken += 1;
                            }
                        }
                        ControlFlow::Continue(())
                    },
                )
                .unwrap();
            assert_eq!(rows.len() as u64 + skipped, plain.len() as u64);
            let mut plain_left = plain.clone();
            plain_left.retain(|row| rows.contains(row));
            assert_eq!(rows, plain_left, "rows come in the scan's order");
            let left_out: Vec<(Value, Value)> =
                plain.iter().filter(|row| !rows.contains(row)).map(|row| (Value::Null, row.value.clone())).collect();
            let expected = BlockSummary::of(&left_out);
            assert_eq!(in_blocks.count, expected.count);
            assert_eq!(in_blocks.sum, expected.sum);
        }
        assert!(blocks_taken > 50, "only {blocks_taken} blocks were taken whole");
    }

    /// A group counts the bytes it stores; a write that would take it past a bound and grow it
    /// is refused whole, one that shrinks it is taken; a partial write keeps the position.
    /// A view's blocks keep only the partials `ApplyOptions::partials` names for it.
    #[test]
    fn blocks_keep_only_the_partials_their_view_uses() {
        let dir = tempfile::tempdir().unwrap();
        let store = IndexStore::open(&dir.path().join("views.redb")).unwrap();
        let number = store.group("g", 2).unwrap().number;
        let docs: Vec<MappedDoc> = (0..1_000)
            .map(|i| doc(&format!("d{i:04}"), vec![vec![(json!(i % 3), json!(i))], vec![(json!(i % 3), json!(i))]]))
            .collect();
        let kept = [Partials { sum: true, stats: false }, Partials::NONE];
        let options = ApplyOptions { checkpoint: Some("s"), max_bytes: u64::MAX, durable: true, partials: &kept };
        store.apply_within("g", &docs, options).unwrap();
        let summed = blocks_of(&store, number, 0);
        assert!(summed.len() > 2, "{} blocks", summed.len());
        assert!(summed.iter().all(|(_, summary)| summary.sum.is_some() && summary.stats.is_none()));
        let counted = blocks_of(&store, number, 1);
        assert!(counted
            .iter()
            .all(|(_, summary)| summary.count > 0 && summary.sum.is_none() && summary.stats.is_none()));
    }

    /// Options of a durable write recording `checkpoint` within `max_bytes`.
    fn within(checkpoint: Option<&str>, max_bytes: u64) -> ApplyOptions<'_> {
        ApplyOptions { checkpoint, max_bytes, durable: true, partials: &[] }
    }

    #[test]
    fn stored_bytes_are_counted_and_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let store = IndexStore::open(&dir.path().join("views.redb")).unwrap();
        store.group("g", 1).unwrap();
        let big = |id: &str| doc(id, vec![vec![(json!(id), json!("x".repeat(500)))]]);
        let first = store.apply("g", &[big("a"), big("b")], "s1").unwrap();
        assert!(first.stored_bytes > 1_000, "{}", first.stored_bytes);
        let refused = store.apply_within("g", &[big("c")], within(Some("s2"), first.stored_bytes + 100)).unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::TooLarge);
        assert_eq!(store.read_group("g").unwrap().as_ref(), Some(&first), "nothing of the refused write");
        let shrunk = store.apply_within("g", &[doc("a", vec![vec![]])], within(Some("s2"), 10)).unwrap();
        assert!(shrunk.stored_bytes < first.stored_bytes / 2 + 100, "{}", shrunk.stored_bytes);
        let partial = store.apply_within("g", &[doc("a", vec![vec![]])], within(None, u64::MAX)).unwrap();
        assert_eq!(partial.checkpoint.as_deref(), Some("s2"));
        assert_eq!(partial.stored_bytes, shrunk.stored_bytes, "the same mapping again stores the same");
        store.drop_group("g").unwrap();
        assert_eq!(store.stored_bytes_besides("", "none").unwrap(), 0);
    }

    #[test]
    fn groups_written_in_an_older_format_are_rebuilt() {
        let dir = tempfile::tempdir().unwrap();
        let store = IndexStore::open(&dir.path().join("views.redb")).unwrap();
        let old = store.group("g", 1).unwrap();
        store.apply("g", &[doc("a", vec![vec![(json!(1), json!(1))]])], "s1").unwrap();
        // As a file written before blocks existed records it.
        let txn = store.db.begin_write().unwrap();
        {
            let mut groups = txn.open_table(GROUPS).unwrap();
            let mut state = old.clone();
            state.format = sort_key::FORMAT.to_owned();
            state.checkpoint = Some("s1".into());
            groups.insert("g", encode_state(&state).unwrap().as_slice()).unwrap();
        }
        txn.commit().unwrap();
        let fresh = store.group("g", 1).unwrap();
        assert_ne!(fresh.number, old.number);
        assert_eq!(fresh.checkpoint, None);
        assert_eq!(fresh.format, current_format());
        assert!(all_rows(&store, old.number, 0, false).is_empty());
        assert!(blocks_of(&store, old.number, 0).is_empty());
    }
}
