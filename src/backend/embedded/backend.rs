//! [`EmbeddedBackend`]: the `DocumentBackend` over a redb file.
//!
//! redb is synchronous, so every call runs on tokio's blocking pool. redb serialises write
//! transactions itself, which is what makes concurrent writers from many tasks safe; readers run
//! on snapshots and never wait for writers. JSON is encoded and decoded outside the write
//! transaction so the write lock is held only for the B-tree work.

use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use redb::{Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, Table, TableDefinition};
use serde_json::{Map, Value};

use super::error::{join_error, map_redb};
use crate::backend::{BulkWrite, DocumentBackend, Page, Precondition, Projection, Query, Revision, StoredDocument};
use crate::error::{Error, ErrorKind, Result};
use crate::model::fields;

const DOCS: TableDefinition<&str, &[u8]> = TableDefinition::new("docs");
const BY_USER_NAMESPACE: TableDefinition<(&str, &str, &str), ()> = TableDefinition::new("by_user_namespace");

/// The embedded store. Cheap to clone; all clones share one open file.
#[derive(Clone)]
pub struct EmbeddedBackend {
    db: Arc<Database>,
    path: PathBuf,
}

impl EmbeddedBackend {
    /// Opens (creating if needed, with its parent directories) the store at `path`. A file that
    /// another process has open gives a `Misconfigured` error at once, not a wait.
    pub async fn open(path: &Path) -> Result<Self> {
        let path = path.to_path_buf();
        let opened = path.clone();
        let db = tokio::task::spawn_blocking(move || -> Result<Database> {
            if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent).map_err(|e| {
                    Error::new(ErrorKind::Misconfigured, format!("cannot create directory {}", parent.display()))
                        .with_source(e)
                })?;
            }
            let db = Database::create(&path).map_err(|e| {
                let err = map_redb("open file")(e);
                Error::new(err.kind(), format!("cannot open embedded store {}: {}", path.display(), err.message()))
                    .with_source(err)
            })?;
            // Create the tables up front so readers never meet a missing table.
            let txn = db.begin_write().map_err(map_redb("begin transaction"))?;
            txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
            txn.open_table(BY_USER_NAMESPACE).map_err(map_redb("open index table"))?;
            txn.commit().map_err(map_redb("commit"))?;
            Ok(db)
        })
        .await
        .map_err(join_error)??;
        Ok(EmbeddedBackend { db: Arc::new(db), path: opened })
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
        let json = serde_json::to_vec(body).map_err(|e| {
            Error::new(ErrorKind::InvalidInput, format!("document {id:?} cannot be encoded as JSON")).with_source(e)
        })?;
        Ok(EncodedWrite { id: id.to_owned(), json, index_key: index_key(body), precondition })
    }
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

/// A document's revision as its record keeps it.
///
/// Revisions are per document and reveal nothing about other documents: `N-<32 hex digits>`, the
/// CouchDB form, where N is the document's own generation (1 on create, +1 on each update) and the
/// hex digits are 128 bits from the operating system's random generator. Releases before this one
/// gave every write the next value of one counter for the whole file ([`StoredRevision::Legacy`]);
/// such records are still read, and updated with the revision they show (the plain counter). Their
/// next revision is generation 2: the counter is no generation of the document's own, and
/// continuing from it (old + 1) would keep publishing the file's write volume. (Such files also
/// hold the counter itself in a `meta` table, which is no longer read or written.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StoredRevision {
    /// The old file-wide counter.
    Legacy(u64),
    Current {
        generation: u64,
        token: [u8; 16],
    },
}

/// First byte of a record in the current layout: tag, generation (u64, big-endian), 16 random
/// bytes, JSON. A legacy record starts with its counter as a big-endian u64, whose first byte is 0
/// for any counter below 2^56, so the two layouts cannot be confused.
const RECORD_TAG_CURRENT: u8 = 1;
const CURRENT_HEADER_BYTES: usize = 1 + 8 + 16;
const LEGACY_HEADER_BYTES: usize = 8;

impl StoredRevision {
    /// The revision of a new version of a document whose previous version had `previous`.
    fn next(previous: Option<&StoredRevision>) -> Result<Self> {
        let generation = match previous {
            None => 1,
            Some(StoredRevision::Legacy(_)) => 2,
            Some(StoredRevision::Current { generation, .. }) => generation.saturating_add(1),
        };
        let mut token = [0u8; 16];
        getrandom::fill(&mut token).map_err(|e| {
            Error::new(ErrorKind::Internal, format!("the operating system's random generator failed: {e}"))
        })?;
        Ok(StoredRevision::Current { generation, token })
    }

    fn to_revision(self) -> Revision {
        match self {
            StoredRevision::Legacy(counter) => Revision(counter.to_string()),
            StoredRevision::Current { generation, token } => Revision(format!("{generation}-{}", hex::encode(token))),
        }
    }

    fn matches(self, expected: &Revision) -> bool {
        self.to_revision() == *expected
    }
}

fn encode_record(rev: &StoredRevision, json: &[u8]) -> Vec<u8> {
    let mut record = Vec::with_capacity(CURRENT_HEADER_BYTES + json.len());
    match rev {
        StoredRevision::Current { generation, token } => {
            record.push(RECORD_TAG_CURRENT);
            record.extend_from_slice(&generation.to_be_bytes());
            record.extend_from_slice(token);
        }
        // Never written any more; kept so tests can build a file as older releases did.
        StoredRevision::Legacy(counter) => record.extend_from_slice(&counter.to_be_bytes()),
    }
    record.extend_from_slice(json);
    record
}

fn decode_record(id: &str, record: &[u8]) -> Result<(StoredRevision, Map<String, Value>)> {
    let corrupt = |why: String| Error::new(ErrorKind::Corrupt, format!("embedded store: record {id:?} {why}"));
    let (rev, json) = match record.first() {
        Some(&RECORD_TAG_CURRENT) => {
            let (header, json) =
                record.split_at_checked(CURRENT_HEADER_BYTES).ok_or_else(|| corrupt("is truncated".into()))?;
            let generation =
                u64::from_be_bytes(header[1..9].try_into().map_err(|_| corrupt("has a bad revision".into()))?);
            let token = header[9..].try_into().map_err(|_| corrupt("has a bad revision".into()))?;
            (StoredRevision::Current { generation, token }, json)
        }
        Some(0) => {
            let (header, json) =
                record.split_at_checked(LEGACY_HEADER_BYTES).ok_or_else(|| corrupt("is truncated".into()))?;
            let counter = u64::from_be_bytes(header.try_into().map_err(|_| corrupt("has a bad revision".into()))?);
            (StoredRevision::Legacy(counter), json)
        }
        Some(tag) => return Err(corrupt(format!("has an unknown layout (first byte {tag})"))),
        None => return Err(corrupt("is empty".into())),
    };
    let body = serde_json::from_slice(json).map_err(|e| corrupt(format!("is not a JSON object: {e}")))?;
    Ok((rev, body))
}

fn stored(id: &str, rev: StoredRevision, body: Map<String, Value>) -> StoredDocument {
    StoredDocument { id: id.to_owned(), rev: rev.to_revision(), body }
}

/// The current revision and index key of `id`, if it exists.
fn current(docs: &Table<&str, &[u8]>, id: &str) -> Result<Option<(StoredRevision, Option<IndexKey>)>> {
    let Some(guard) = docs.get(id).map_err(map_redb("read document"))? else {
        return Ok(None);
    };
    let (rev, body) = decode_record(id, guard.value())?;
    Ok(Some((rev, index_key(&body))))
}

/// Checks the precondition and writes one document inside an open write transaction.
fn write_one(
    docs: &mut Table<&str, &[u8]>,
    index: &mut Table<(&str, &str, &str), ()>,
    write: &EncodedWrite,
) -> Result<Revision> {
    let existing = current(docs, &write.id)?;
    match (&write.precondition, &existing) {
        (Precondition::MustNotExist, Some(_)) => {
            return Err(Error::conflict(format!("document {:?} already exists", write.id)));
        }
        (Precondition::MatchRevision(_), None) => {
            return Err(Error::conflict(format!("document {:?} no longer exists", write.id)));
        }
        (Precondition::MatchRevision(expected), Some((rev, _))) if !rev.matches(expected) => {
            let rev = rev.to_revision();
            return Err(Error::conflict(format!("document {:?} is at revision {rev}, not {expected}", write.id)));
        }
        _ => {}
    }
    if let Some((_, Some((user, ns)))) = &existing {
        index.remove((user.as_str(), ns.as_str(), write.id.as_str())).map_err(map_redb("update index"))?;
    }
    let rev = StoredRevision::next(existing.as_ref().map(|(rev, _)| rev))?;
    docs.insert(write.id.as_str(), encode_record(&rev, &write.json).as_slice()).map_err(map_redb("write document"))?;
    if let Some((user, ns)) = &write.index_key {
        index.insert((user.as_str(), ns.as_str(), write.id.as_str()), ()).map_err(map_redb("update index"))?;
    }
    Ok(rev.to_revision())
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
                        let (rev, body) = decode_record(id, guard.value())?;
                        Some(stored(id, rev, body))
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
        self.blocking(move |db| {
            let txn = db.begin_write().map_err(map_redb("begin write"))?;
            let rev = {
                let mut docs = txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
                let mut index = txn.open_table(BY_USER_NAMESPACE).map_err(map_redb("open index table"))?;
                write_one(&mut docs, &mut index, &write)?
            };
            txn.commit().map_err(map_redb("commit"))?;
            Ok(rev)
        })
        .await
    }

    async fn delete(&self, id: &str, rev: &Revision) -> Result<()> {
        let id = id.to_owned();
        let expected = rev.clone();
        self.blocking(move |db| {
            let txn = db.begin_write().map_err(map_redb("begin write"))?;
            {
                let mut docs = txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
                let mut index = txn.open_table(BY_USER_NAMESPACE).map_err(map_redb("open index table"))?;
                let Some((rev, key)) = current(&docs, &id)? else {
                    return Err(Error::not_found(format!("document {id:?} does not exist")));
                };
                if !rev.matches(&expected) {
                    let rev = rev.to_revision();
                    return Err(Error::conflict(format!("document {id:?} is at revision {rev}, not {expected}")));
                }
                docs.remove(id.as_str()).map_err(map_redb("delete document"))?;
                if let Some((user, ns)) = key {
                    index.remove((user.as_str(), ns.as_str(), id.as_str())).map_err(map_redb("update index"))?;
                }
            }
            txn.commit().map_err(map_redb("commit"))?;
            Ok(())
        })
        .await
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
                let (rev, body) = decode_record(id, guard.value())?;
                items.push(stored(id, rev, project(body, &query.projection)));
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
        self.blocking(move |db| {
            let txn = db.begin_write().map_err(map_redb("begin write"))?;
            let mut results = Vec::with_capacity(encoded.len());
            {
                let mut docs = txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
                let mut index = txn.open_table(BY_USER_NAMESPACE).map_err(map_redb("open index table"))?;
                for write in encoded {
                    let result = match write {
                        Ok(write) => match write_one(&mut docs, &mut index, &write) {
                            Err(e) if e.kind() != ErrorKind::Conflict => return Err(e),
                            other => other,
                        },
                        Err(e) => Err(e),
                    };
                    results.push(result);
                }
            }
            txn.commit().map_err(map_redb("commit"))?;
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
            let mut items = Vec::new();
            for entry in docs.range::<&str>((lower, Bound::Unbounded)).map_err(map_redb("scan documents"))? {
                let (id, record) = entry.map_err(map_redb("scan documents"))?;
                if items.len() == limit {
                    let next = items.last().map(|d: &StoredDocument| d.id.clone());
                    return Ok(Page { items, next });
                }
                let (rev, body) = decode_record(id.value(), record.value())?;
                items.push(stored(id.value(), rev, body));
            }
            Ok(Page { items, next: None })
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
                    docs.insert(id, encode_record(&StoredRevision::Legacy(n), &json).as_slice()).unwrap();
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

    #[test]
    fn records_of_unknown_layout_are_corrupt_not_misread() {
        for record in [&[][..], &[7, b'{', b'}'][..], &[RECORD_TAG_CURRENT, 0, 0][..], &[0, 0, 0][..]] {
            let err = decode_record("x", record).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Corrupt, "{record:?}");
        }
    }
}
