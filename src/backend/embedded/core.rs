//! The embedded store's schema and its reads: the tables of the redb file (see the layout in
//! [`super`]), creating them, the layout mark, and the read transactions behind `get`, `query`
//! and `revisions`. Never imports [`super::backend`]: the trait impl calls down into this.

use std::ops::Bound;
use std::path::Path;

use redb::{Database, ReadTransaction, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};
use serde_json::{Map, Value};

use super::codec::{self, Header, StoredRevision};
use super::error::map_redb;
use crate::backend::revision::{PackedAncestry, RevisionId};
use crate::backend::{Ancestry, LayoutState, Page, Projection, Query, RevisionInfo, StoredDocument};
use crate::error::{Error, ErrorKind, Result};
use crate::model::fields;

/// `(blob, index)` → an attachment chunk's bytes (`attachments.rs`).
pub(super) const ATTACHMENT_CHUNKS: TableDefinition<(&str, u64), &[u8]> = TableDefinition::new("attachment_chunks");
/// Live documents: `_id` → record (see [`codec`]).
pub(super) const DOCS: TableDefinition<IdKey, &[u8]> = TableDefinition::new("docs");
/// Deleted documents: `_id` → record with an empty body.
pub(super) const TOMBSTONES: TableDefinition<IdKey, &[u8]> = TableDefinition::new("tombstones");
pub(super) const BY_USER_NAMESPACE: TableDefinition<(&str, &str, &str), ()> = TableDefinition::new("by_user_namespace");
/// The change feed: position → `_id`, one entry per document (its latest write).
pub(super) const FEED: TableDefinition<u64, &str> = TableDefinition::new("feed");
/// Revision ancestry: `_id` → the last `revs_limit` revision tokens, newest first.
pub(super) const ANCESTRY: TableDefinition<IdKey, &[u8]> = TableDefinition::new("ancestry");
/// Local documents: name after `_local/` → revision number (u64 BE) + JSON body.
pub(super) const LOCAL: TableDefinition<IdKey, &[u8]> = TableDefinition::new("local");
/// Counters. Older files hold `seq` (their file-wide revision counter), no longer read.
pub(super) const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
/// A floor under the next feed position: recorded when an erasure removes feed entries, which may
/// include the highest one (the next position must never fall back to one a follower has passed).
/// Otherwise the next position is one past the feed's highest entry: that needs no write of its
/// own in every transaction (each table a commit touches is more pages to write and fsync).
pub(super) const META_FEED_NEXT: &str = "feed_next";
/// The key of the tables keyed by a document id or local name: a `&str` as redb stores it (the
/// same bytes, and the same type name, so files written with `&str` keys open as they are and
/// the other way round), compared as bytes. redb's own `&str` key checks both keys as UTF-8 at
/// every comparison of a B-tree search: 15% of a `_bulk_docs` of 100 new documents, nearly all
/// of it on the group commit's thread while every writer waits (issue 38). UTF-8 orders as its
/// bytes, so the order is the same; every key was checked as a `&str` when it was written, and is
/// checked again when read back as one ([`redb::Value::from_bytes`] is `&str`'s). The
/// separators stored in branch pages are `&str`'s own, so they stay whole characters for any
/// reader comparing them as `&str`.
#[derive(Debug)]
pub(super) struct IdKey;

impl redb::Value for IdKey {
    type SelfType<'a>
        = &'a str
    where
        Self: 'a;
    type AsBytes<'a>
        = &'a str
    where
        Self: 'a;

    fn fixed_width() -> Option<usize> {
        <&str as redb::Value>::fixed_width()
    }

    fn from_bytes<'a>(data: &'a [u8]) -> &'a str
    where
        Self: 'a,
    {
        <&str as redb::Value>::from_bytes(data)
    }

    fn as_bytes<'a, 'b: 'a>(value: &'a &'b str) -> &'a str
    where
        Self: 'b,
    {
        value
    }

    fn type_name() -> redb::TypeName {
        <&str as redb::Value>::type_name()
    }
}

impl redb::Key for IdKey {
    fn compare(data1: &[u8], data2: &[u8]) -> std::cmp::Ordering {
        data1.cmp(data2)
    }

    fn separator<'a>(left: &'a [u8], right: &'a [u8]) -> std::borrow::Cow<'a, [u8]> {
        <&str as redb::Key>::separator(left, right)
    }

    fn min_encoded_key() -> Option<std::borrow::Cow<'static, [u8]>> {
        <&str as redb::Key>::min_encoded_key()
    }
}

/// The layout version of the file; absent in files of older releases.
pub(super) const META_LAYOUT: &str = "layout";
pub(super) const LAYOUT_CURRENT: u64 = 2;

/// Creates every table up front, so readers never meet a missing one, and marks a new file (no
/// documents yet) as having the current layout.
pub(super) fn create_tables(db: &Database) -> Result<()> {
    let txn = db.begin_write().map_err(map_redb("begin transaction"))?;
    {
        let docs = txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
        let tombstones = txn.open_table(TOMBSTONES).map_err(map_redb("open tombstones table"))?;
        txn.open_table(BY_USER_NAMESPACE).map_err(map_redb("open index table"))?;
        txn.open_table(FEED).map_err(map_redb("open feed table"))?;
        txn.open_table(ANCESTRY).map_err(map_redb("open ancestry table"))?;
        txn.open_table(LOCAL).map_err(map_redb("open local table"))?;
        txn.open_table(ATTACHMENT_CHUNKS).map_err(map_redb("open attachment table"))?;
        let mut meta = txn.open_table(META).map_err(map_redb("open meta table"))?;
        let empty = docs.is_empty().map_err(map_redb("count documents"))?
            && tombstones.is_empty().map_err(map_redb("count tombstones"))?;
        if empty && meta.get(META_LAYOUT).map_err(map_redb("read layout"))?.is_none() {
            meta.insert(META_LAYOUT, LAYOUT_CURRENT).map_err(map_redb("write layout"))?;
        }
    }
    txn.commit().map_err(map_redb("commit"))
}

/// `(userId, namespace)`: where a document sits in the secondary index.
pub(super) type IndexKey = (String, String);

/// The `(userId, namespace)` a document is indexed under; documents lacking either string field
/// are not indexed, as CouchDB's Mango index leaves out documents missing an indexed field.
pub(super) fn index_key(body: &Map<String, Value>) -> Option<IndexKey> {
    match (body.get(fields::USER_ID), body.get(fields::NAMESPACE)) {
        (Some(Value::String(user)), Some(Value::String(ns))) => Some((user.clone(), ns.clone())),
        _ => None,
    }
}

/// The next feed position: past the feed's highest entry and the recorded floor.
pub(super) fn next_feed_position(
    feed: &impl ReadableTable<u64, &'static str>,
    meta: &impl ReadableTable<&'static str, u64>,
) -> Result<u64> {
    let past_highest = feed.last().map_err(map_redb("read feed"))?.map_or(1, |(seq, _)| seq.value() + 1);
    let floor = meta.get(META_FEED_NEXT).map_err(map_redb("read feed floor"))?.map_or(1, |v| v.value());
    Ok(past_highest.max(floor))
}

pub(super) fn stored(id: &str, header: Header, body: Map<String, Value>) -> StoredDocument {
    StoredDocument { id: id.to_owned(), rev: header.rev.to_revision(), body }
}

/// A query page token: the `(namespace, _id)` of the last index entry returned.
pub(super) fn decode_query_token(token: &str) -> Result<(String, String)> {
    serde_json::from_str(token).map_err(|_| Error::invalid("page token", "was not produced by this backend"))
}

pub(super) fn project(mut body: Map<String, Value>, projection: &Projection) -> Map<String, Value> {
    if let Projection::Fields(wanted) = projection {
        body.retain(|name, _| wanted.contains(&name.as_str()));
    }
    body
}

pub(super) fn layout_of(meta: &impl ReadableTable<&'static str, u64>) -> Result<LayoutState> {
    Ok(match meta.get(META_LAYOUT).map_err(map_redb("read layout"))? {
        Some(v) if v.value() >= LAYOUT_CURRENT => LayoutState::Current,
        _ => LayoutState::NeedsUpgrade("documents written before the change feed have no feed position".into()),
    })
}

/// The record header of `id` and whether it is a tombstone, read in a read transaction; `None`
/// when the id is not stored.
pub(super) fn header_of(
    docs: &impl ReadableTable<IdKey, &'static [u8]>,
    tombstones: &impl ReadableTable<IdKey, &'static [u8]>,
    id: &str,
) -> Result<Option<(Header, bool)>> {
    if let Some(guard) = docs.get(id).map_err(map_redb("read document"))? {
        return Ok(Some((codec::split(id, guard.value())?.0, false)));
    }
    match tombstones.get(id).map_err(map_redb("read tombstone"))? {
        Some(guard) => Ok(Some((codec::split(id, guard.value())?.0, true))),
        None => Ok(None),
    }
}

/// What `revisions(id)` answers for the record `header` (a tombstone's when `deleted`), with the
/// ancestry kept in `ancestry`.
pub(super) fn revision_info_in(
    ancestry: &impl ReadableTable<IdKey, &'static [u8]>,
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

/// The tombstone under `id` with the fields its deletion carried (empty when none).
pub(super) fn get_deleted(db: &Database, id: &str) -> Result<Option<StoredDocument>> {
    let txn = db.begin_read().map_err(map_redb("begin read"))?;
    let tombstones = txn.open_table(TOMBSTONES).map_err(map_redb("open tombstones table"))?;
    let Some(guard) = tombstones.get(id).map_err(map_redb("read tombstone"))? else { return Ok(None) };
    let (header, json) = codec::split(id, guard.value())?;
    Ok(Some(stored(id, header, tombstone_body(id, json)?)))
}

/// The fields a tombstone's deletion carried, from its record's JSON (empty when none).
fn tombstone_body(id: &str, json: &[u8]) -> Result<Map<String, Value>> {
    if json.is_empty() {
        return Ok(Map::new());
    }
    crate::model::depth::parse_stored(json).map_err(|e| {
        Error::new(ErrorKind::Corrupt, format!("embedded store: tombstone {id:?} holds no JSON object: {e}"))
    })
}

/// The record of `id` as `revisions` and then `get` (live) or `get_deleted` (a tombstone)
/// answer it, its body as the stored JSON text (empty for a tombstone without fields), read in
/// the transaction `txn`; `None` when nothing is stored under `id`.
pub(super) fn record_text_in(txn: &ReadTransaction, id: &str) -> Result<Option<(RevisionInfo, Vec<u8>)>> {
    let docs = txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
    let (header, deleted, body) = match docs.get(id).map_err(map_redb("read document"))? {
        Some(guard) => {
            let (header, json) = codec::split(id, guard.value())?;
            (header, false, json.to_vec())
        }
        None => {
            let tombstones = txn.open_table(TOMBSTONES).map_err(map_redb("open tombstones table"))?;
            let Some(guard) = tombstones.get(id).map_err(map_redb("read tombstone"))? else { return Ok(None) };
            let (header, json) = codec::split(id, guard.value())?;
            (header, true, json.to_vec())
        }
    };
    let ancestry = txn.open_table(ANCESTRY).map_err(map_redb("open ancestry table"))?;
    Ok(Some((revision_info_in(&ancestry, id, header, deleted)?, body)))
}

/// The live documents stored under `ids`, in one read transaction (one consistent snapshot).
pub(super) fn get_many(db: &Database, ids: &[String]) -> Result<Vec<Option<StoredDocument>>> {
    let txn = db.begin_read().map_err(map_redb("begin read"))?;
    let docs = txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
    let mut found = Vec::with_capacity(ids.len());
    for id in ids {
        let doc = match docs.get(id.as_str()).map_err(map_redb("read document"))? {
            Some(guard) => {
                let (header, body) = codec::decode(id, guard.value())?;
                Some(stored(id, header, body))
            }
            None => None,
        };
        found.push(doc);
    }
    Ok(found)
}

/// One page of a query over the `(userId, namespace, _id)` index, after the entry `after`.
pub(super) fn query_page(
    db: &Database,
    query: &Query,
    after: Option<(String, String)>,
    limit: usize,
) -> Result<Page<StoredDocument>> {
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
            return Err(Error::new(ErrorKind::Corrupt, format!("embedded store: index names missing document {id:?}")));
        };
        let (header, body) = codec::decode(id, guard.value())?;
        items.push(stored(id, header, project(body, &query.projection)));
        last = Some((entry_ns.to_owned(), id.to_owned()));
    }
    Ok(Page { items, next: None })
}

/// What `revisions(id)` answers, read in one read transaction.
pub(super) fn revisions(db: &Database, id: &str) -> Result<Option<RevisionInfo>> {
    let txn = db.begin_read().map_err(map_redb("begin read"))?;
    let docs = txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
    let tombstones = txn.open_table(TOMBSTONES).map_err(map_redb("open tombstones table"))?;
    let Some((header, deleted)) = header_of(&docs, &tombstones, id)? else { return Ok(None) };
    let ancestry = txn.open_table(ANCESTRY).map_err(map_redb("open ancestry table"))?;
    revision_info_in(&ancestry, id, header, deleted).map(Some)
}

/// [`revisions`] of each id, in one read transaction.
pub(super) fn revisions_many(db: &Database, ids: &[String]) -> Result<Vec<Option<RevisionInfo>>> {
    let txn = db.begin_read().map_err(map_redb("begin read"))?;
    let docs = txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
    let tombstones = txn.open_table(TOMBSTONES).map_err(map_redb("open tombstones table"))?;
    let ancestry = txn.open_table(ANCESTRY).map_err(map_redb("open ancestry table"))?;
    let mut infos = Vec::with_capacity(ids.len());
    for id in ids {
        infos.push(match header_of(&docs, &tombstones, id)? {
            Some((header, deleted)) => Some(revision_info_in(&ancestry, id, header, deleted)?),
            None => None,
        });
    }
    Ok(infos)
}

/// Whether the file can be read: its `docs` table opens.
pub(super) fn health(db: &Database) -> Result<()> {
    let txn = db.begin_read().map_err(map_redb("begin read"))?;
    txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
    Ok(())
}

/// The file's layout.
pub(super) fn layout(db: &Database) -> Result<LayoutState> {
    let txn = db.begin_read().map_err(map_redb("begin read"))?;
    layout_of(&txn.open_table(META).map_err(map_redb("open meta table"))?)
}

/// How many live documents the file holds.
pub(super) fn count(db: &Database) -> Result<Option<u64>> {
    let txn = db.begin_read().map_err(map_redb("begin read"))?;
    let docs = txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
    Ok(Some(docs.len().map_err(map_redb("count documents"))?))
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
            let stored = codec::encode_previous(&rev, &codec::encode_json(id, body)?);
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
    use redb::{ReadableDatabase, ReadableTable};

    use super::*;

    const AS_STR: TableDefinition<&str, &[u8]> = TableDefinition::new("docs");

    /// Ids of many lengths with multi-byte characters at every place, enough for branch pages.
    fn ids() -> Vec<String> {
        (0..3_000).map(|n| format!("{}é{n}€{}😀", "a".repeat(n % 7), "z".repeat(n % 5))).collect()
    }

    /// A table written with redb's `&str` key opens with [`IdKey`] and the other way round (the
    /// same type name, the same bytes), finds every key, and lists them in the same order, so
    /// files of earlier releases read as they are and a file written now reads with either.
    #[test]
    fn id_keys_are_str_keys_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.redb");
        let mut expected = ids();
        let (old, new) = expected.split_at(expected.len() / 2);
        let (old, new) = (old.to_vec(), new.to_vec());
        {
            let db = Database::create(&path).unwrap();
            let txn = db.begin_write().unwrap();
            let mut table = txn.open_table(AS_STR).unwrap();
            for id in &old {
                table.insert(id.as_str(), id.as_bytes()).unwrap();
            }
            drop(table);
            txn.commit().unwrap();
            let txn = db.begin_write().unwrap();
            let mut table = txn.open_table(DOCS).unwrap();
            for id in &old {
                assert_eq!(table.get(id.as_str()).unwrap().map(|v| v.value().to_vec()), Some(id.as_bytes().to_vec()));
            }
            for id in &new {
                table.insert(id.as_str(), id.as_bytes()).unwrap();
            }
            drop(table);
            txn.commit().unwrap();
        }
        expected.sort();
        let db = Database::open(&path).unwrap();
        let txn = db.begin_read().unwrap();
        let as_str = txn.open_table(AS_STR).unwrap();
        let listed: Vec<String> = as_str.iter().unwrap().map(|row| row.unwrap().0.value().to_owned()).collect();
        assert_eq!(listed, expected, "listed in str order");
        for id in &expected {
            assert!(as_str.get(id.as_str()).unwrap().is_some(), "{id} found as a str key");
        }
        let as_id = txn.open_table(DOCS).unwrap();
        let listed: Vec<String> = as_id.iter().unwrap().map(|row| row.unwrap().0.value().to_owned()).collect();
        assert_eq!(listed, expected, "listed in the same order as IdKey");
        let from = expected[100].as_str();
        let after: Vec<String> = as_id.range(from..).unwrap().map(|row| row.unwrap().0.value().to_owned()).collect();
        assert_eq!(after, expected[100..].to_vec());
    }
}
