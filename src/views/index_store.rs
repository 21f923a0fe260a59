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
//! - `view_meta`: the next group number.
//!
//! Everything here is synchronous (redb is); callers run it on blocking threads. One write
//! transaction per batch of mapped documents: a batch's rows and the feed position they reach
//! commit together, so a crash never leaves rows ahead of or behind the recorded position.

use std::ops::{Bound, ControlFlow};
use std::path::{Path, PathBuf};

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::sort_key;
use crate::error::{Error, ErrorKind, Result};

const ROWS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("view_rows");
const BACK: TableDefinition<&[u8], &[u8]> = TableDefinition::new("view_back");
const GROUPS: TableDefinition<&str, &[u8]> = TableDefinition::new("view_groups");
const META: TableDefinition<&str, u64> = TableDefinition::new("view_meta");
const NEXT_GROUP: &str = "next_group";

/// A view group's state as recorded with its rows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupState {
    /// The prefix of this group's rows.
    pub number: u64,
    /// The backend feed position every change up to which is in the rows (`None`: none yet).
    pub checkpoint: Option<String>,
    /// Rows per view, in the group's view order.
    pub row_counts: Vec<u64>,
    /// The sort-key format the rows were written with ([`sort_key::FORMAT`]).
    pub format: String,
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

/// A range of rows within one view, in row-key bytes after the group and view prefix.
#[derive(Debug, Clone, PartialEq)]
pub struct RowRange {
    pub low: Bound<Vec<u8>>,
    pub high: Bound<Vec<u8>>,
}

impl RowRange {
    pub fn all() -> Self {
        RowRange { low: Bound::Unbounded, high: Bound::Unbounded }
    }
}

/// The index file.
pub struct IndexStore {
    path: PathBuf,
    db: Database,
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
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|err| {
                Error::new(ErrorKind::Misconfigured, format!("view index directory {}: {err}", parent.display()))
            })?;
        }
        let db = Database::create(path).map_err(|e| failure(path, "open", e))?;
        let store = IndexStore { path: path.to_owned(), db };
        let txn = store.db.begin_write().map_err(|e| store.fail("begin", e))?;
        {
            txn.open_table(ROWS).map_err(|e| store.fail("create tables", e))?;
            txn.open_table(BACK).map_err(|e| store.fail("create tables", e))?;
            txn.open_table(GROUPS).map_err(|e| store.fail("create tables", e))?;
            txn.open_table(META).map_err(|e| store.fail("create tables", e))?;
        }
        txn.commit().map_err(|e| store.fail("create tables", e))?;
        Ok(store)
    }

    fn fail(&self, doing: &str, err: impl Into<redb::Error>) -> Error {
        failure(&self.path, doing, err)
    }

    /// The group named `name` with `views` views, created empty when missing (or when its rows
    /// were written in another sort-key format: then its old rows are dropped first).
    pub fn group(&self, name: &str, views: usize) -> Result<GroupState> {
        if let Some(state) = self.read_group(name)? {
            if state.format == sort_key::FORMAT && state.row_counts.len() == views {
                return Ok(state);
            }
        }
        let txn = self.db.begin_write().map_err(|e| self.fail("begin", e))?;
        let state = {
            let mut groups = txn.open_table(GROUPS).map_err(|e| self.fail("open groups", e))?;
            let existing = match groups.get(name).map_err(|e| self.fail("read group", e))? {
                Some(bytes) => Some(decode_state(bytes.value())?),
                None => None,
            };
            match existing {
                Some(state) if state.format == sort_key::FORMAT && state.row_counts.len() == views => state,
                stale => {
                    if let Some(stale) = stale {
                        self.erase_rows(&txn, stale.number)?;
                    }
                    let mut meta = txn.open_table(META).map_err(|e| self.fail("open meta", e))?;
                    let number = meta.get(NEXT_GROUP).map_err(|e| self.fail("read meta", e))?.map_or(1, |v| v.value());
                    meta.insert(NEXT_GROUP, number + 1).map_err(|e| self.fail("write meta", e))?;
                    let state = GroupState {
                        number,
                        checkpoint: None,
                        row_counts: vec![0; views],
                        format: sort_key::FORMAT.to_owned(),
                    };
                    groups.insert(name, encode_state(&state)?.as_slice()).map_err(|e| self.fail("write group", e))?;
                    state
                }
            }
        };
        txn.commit().map_err(|e| self.fail("commit", e))?;
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

    /// Replaces each document's rows with its new mapping and records `checkpoint` as the
    /// group's feed position, in one transaction. Returns the new state.
    pub fn apply(&self, name: &str, docs: &[MappedDoc], checkpoint: &str) -> Result<GroupState> {
        let txn = self.db.begin_write().map_err(|e| self.fail("begin", e))?;
        let state = {
            let mut groups = txn.open_table(GROUPS).map_err(|e| self.fail("open groups", e))?;
            let mut state = match groups.get(name).map_err(|e| self.fail("read group", e))? {
                Some(bytes) => decode_state(bytes.value())?,
                None => return Err(Error::new(ErrorKind::NotFound, format!("view group {name} was dropped"))),
            };
            let mut rows = txn.open_table(ROWS).map_err(|e| self.fail("open rows", e))?;
            let mut back = txn.open_table(BACK).map_err(|e| self.fail("open back-index", e))?;
            for doc in docs {
                let back_key = back_key(state.number, &doc.id);
                let old = back
                    .remove(back_key.as_slice())
                    .map_err(|e| self.fail("read back-index", e))?
                    .map(|v| v.value().to_vec());
                for row_key in old.as_deref().map(split_keys).unwrap_or_default() {
                    if rows.remove(row_key).map_err(|e| self.fail("remove row", e))?.is_some() {
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
                        if rows
                            .insert(row_key.as_slice(), stored.as_slice())
                            .map_err(|e| self.fail("write row", e))?
                            .is_none()
                        {
                            state.row_counts[view] += 1;
                        }
                        written.extend_from_slice(&(row_key.len() as u32).to_be_bytes());
                        written.extend_from_slice(&row_key);
                    }
                }
                if !written.is_empty() {
                    back.insert(back_key.as_slice(), written.as_slice())
                        .map_err(|e| self.fail("write back-index", e))?;
                }
            }
            state.checkpoint = Some(checkpoint.to_owned());
            groups.insert(name, encode_state(&state)?.as_slice()).map_err(|e| self.fail("write group", e))?;
            state
        };
        txn.commit().map_err(|e| self.fail("commit", e))?;
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
        let low = match &range.low {
            Bound::Included(bytes) => Bound::Included(join(&prefix, bytes)),
            Bound::Excluded(bytes) => Bound::Excluded(join(&prefix, bytes)),
            Bound::Unbounded => Bound::Included(prefix.clone()),
        };
        let high = match &range.high {
            Bound::Included(bytes) => Bound::Included(join(&prefix, bytes)),
            Bound::Excluded(bytes) => Bound::Excluded(join(&prefix, bytes)),
            Bound::Unbounded => Bound::Excluded(next_prefix(&prefix)),
        };
        if bounds_are_empty(&low, &high) {
            return Ok(());
        }
        let txn = self.db.begin_read().map_err(|e| self.fail("begin read", e))?;
        let rows = txn.open_table(ROWS).map_err(|e| self.fail("open rows", e))?;
        let bounds: (Bound<&[u8]>, Bound<&[u8]>) = (as_slice(&low), as_slice(&high));
        let iter = rows.range::<&[u8]>(bounds).map_err(|e| self.fail("scan rows", e))?;
        let mut visit = |entry: ScannedEntry| {
            let (_, stored) = entry.map_err(|e| self.fail("scan rows", e))?;
            let (key, id, value): (Value, String, Value) = serde_json::from_slice(stored.value())
                .map_err(|err| Error::new(ErrorKind::Corrupt, format!("view row: {err}")))?;
            Ok::<_, Error>(each(IndexRow { key, id, value }))
        };
        if descending {
            for entry in iter.rev() {
                if visit(entry)?.is_break() {
                    break;
                }
            }
        } else {
            for entry in iter {
                if visit(entry)?.is_break() {
                    break;
                }
            }
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
                    self.erase_rows(&txn, decode_state(&bytes)?.number)?;
                    true
                }
                None => false,
            }
        };
        txn.commit().map_err(|e| self.fail("commit", e))?;
        Ok(dropped)
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
    serde_json::from_slice(bytes).map_err(|err| Error::new(ErrorKind::Corrupt, format!("view group state: {err}")))
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
mod tests {
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
}
