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
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const SEQ: &str = "seq";

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
            txn.open_table(META).map_err(map_redb("open meta table"))?;
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

fn encode_record(rev: u64, json: &[u8]) -> Vec<u8> {
    let mut record = Vec::with_capacity(8 + json.len());
    record.extend_from_slice(&rev.to_be_bytes());
    record.extend_from_slice(json);
    record
}

fn decode_record(id: &str, record: &[u8]) -> Result<(u64, Map<String, Value>)> {
    let corrupt = |why: String| Error::new(ErrorKind::Corrupt, format!("embedded store: record {id:?} {why}"));
    let (rev, json) = record.split_at_checked(8).ok_or_else(|| corrupt("is truncated".into()))?;
    let rev = u64::from_be_bytes(rev.try_into().map_err(|_| corrupt("has a bad revision".into()))?);
    let body = serde_json::from_slice(json).map_err(|e| corrupt(format!("is not a JSON object: {e}")))?;
    Ok((rev, body))
}

fn revision_number(rev: &Revision) -> Option<u64> {
    rev.0.parse().ok()
}

fn stored(id: &str, rev: u64, body: Map<String, Value>) -> StoredDocument {
    StoredDocument { id: id.to_owned(), rev: Revision(rev.to_string()), body }
}

/// The current revision and index key of `id`, if it exists.
fn current(docs: &Table<&str, &[u8]>, id: &str) -> Result<Option<(u64, Option<IndexKey>)>> {
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
    meta: &mut Table<&str, u64>,
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
        (Precondition::MatchRevision(expected), Some((rev, _))) if revision_number(expected) != Some(*rev) => {
            return Err(Error::conflict(format!("document {:?} is at revision {rev}, not {expected}", write.id)));
        }
        _ => {}
    }
    if let Some((_, Some((user, ns)))) = &existing {
        index.remove((user.as_str(), ns.as_str(), write.id.as_str())).map_err(map_redb("update index"))?;
    }
    let seq = meta.get(SEQ).map_err(map_redb("read sequence"))?.map(|g| g.value()).unwrap_or(0) + 1;
    meta.insert(SEQ, seq).map_err(map_redb("write sequence"))?;
    docs.insert(write.id.as_str(), encode_record(seq, &write.json).as_slice()).map_err(map_redb("write document"))?;
    if let Some((user, ns)) = &write.index_key {
        index.insert((user.as_str(), ns.as_str(), write.id.as_str()), ()).map_err(map_redb("update index"))?;
    }
    Ok(Revision(seq.to_string()))
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
        let id = id.to_owned();
        self.blocking(move |db| {
            let txn = db.begin_read().map_err(map_redb("begin read"))?;
            let docs = txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
            let Some(guard) = docs.get(id.as_str()).map_err(map_redb("read document"))? else {
                return Ok(None);
            };
            let (rev, body) = decode_record(&id, guard.value())?;
            Ok(Some(stored(&id, rev, body)))
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
                let mut meta = txn.open_table(META).map_err(map_redb("open meta table"))?;
                write_one(&mut docs, &mut index, &mut meta, &write)?
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
                if revision_number(&expected) != Some(rev) {
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
                let mut meta = txn.open_table(META).map_err(map_redb("open meta table"))?;
                for write in encoded {
                    let result = match write {
                        Ok(write) => match write_one(&mut docs, &mut index, &mut meta, &write) {
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
        self.blocking(|db| {
            let txn = db.begin_read().map_err(map_redb("begin read"))?;
            let docs = txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
            Ok(Some(docs.len().map_err(map_redb("count documents"))?))
        })
        .await
    }
}
