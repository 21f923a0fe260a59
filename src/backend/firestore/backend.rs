//! [`FirestoreBackend`]: the `DocumentBackend` over Firestore's REST API v1.
//!
//! Every write is one `:commit` (atomic: a document and its chunk documents change together) or,
//! for plain documents in bulk, one `:batchWrite` entry; each carries a precondition in the
//! request body: `exists: false` to create, the `updateTime` read earlier to update or delete.
//! The revision is that `updateTime`, plus `;N` when the document has N chunk documents, so an
//! update or delete knows which chunks to replace without reading first. Listings and the full
//! scan are `:runQuery` ordered by `__name__` and continued with a `startAt` cursor after the last
//! document, so a saved page token resumes exactly where it stopped.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use futures::{stream, StreamExt, TryStreamExt};
use reqwest::Method;
use serde_json::{json, Map, Value};

use super::client::{Call, FirestoreClient};
use super::codec;
use super::config::FirestoreConfig;
use crate::backend::{BulkWrite, DocumentBackend, Page, Precondition, Projection, Query, Revision, StoredDocument};
use crate::error::{Error, ErrorKind, Result};
use crate::model::fields;

/// Firestore's limits on one `:batchWrite`: 500 writes, 10 MiB; a margin on the size.
const BATCH_WRITE_MAX: usize = 500;
const BATCH_WRITE_MAX_BYTES: usize = 9_000_000;
/// Commits and batch writes of one bulk request in flight at once.
const WRITE_CONCURRENCY: usize = 16;
/// Rounds of retrying batch-write entries Firestore answered as busy.
const BUSY_WRITE_ROUNDS: usize = 6;
/// The most chunk documents one document can have.
const MAX_CHUNKS: usize = codec::MAX_COMPRESSED_BYTES.div_ceil(codec::CHUNK_BYTES);
/// Documents per `:batchGet` of a batch read, and such calls in flight at once.
const BATCH_GET_MAX: usize = 100;
const BATCH_GET_CONCURRENCY: usize = 4;
/// Re-reads of a document whose chunks changed under us before giving up.
const CONSISTENT_READ_TRIES: usize = 5;

pub struct FirestoreBackend {
    client: FirestoreClient,
    config: FirestoreConfig,
}

/// A revision split into the `updateTime` precondition and the chunk count; `None` for text that
/// is no Firestore revision (so no document has it).
fn parse_revision(rev: &Revision) -> Option<(&str, usize)> {
    let (time, chunks) = match rev.as_str().split_once(';') {
        Some((time, chunks)) => (time, chunks.parse().ok().filter(|n| *n <= MAX_CHUNKS)?),
        None => (rev.as_str(), 0),
    };
    chrono::DateTime::parse_from_rfc3339(time).ok()?;
    Some((time, chunks))
}

fn stale(id: &str, rev: &Revision) -> Error {
    Error::conflict(format!("document {id:?} is not at revision {rev}"))
}

fn revision(update_time: &str, chunks: usize) -> Revision {
    if chunks == 0 {
        Revision(update_time.to_owned())
    } else {
        Revision(format!("{update_time};{chunks}"))
    }
}

fn update_time_of(reply: &Value, doing: &str) -> Result<String> {
    reply
        .pointer("/writeResults/0/updateTime")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| Error::new(ErrorKind::Internal, format!("Firestore's answer to {doing} has no updateTime")))
}

impl FirestoreBackend {
    /// Connects (credentials, or the emulator) and checks the database answers.
    pub async fn open(config: &FirestoreConfig) -> Result<Self> {
        let client = FirestoreClient::connect(config).await?;
        let backend = FirestoreBackend { client, config: config.clone() };
        backend.health().await?;
        Ok(backend)
    }

    /// The writes of one `:commit` that stores `body` under `id`.
    fn commit_writes(
        &self,
        id: &str,
        body: &Map<String, Value>,
        precondition: &Precondition,
    ) -> Result<(Vec<Value>, usize)> {
        let document_id = codec::document_id(id);
        let encoded = codec::encode(id, body)?;
        let mut main = json!({
            "update": { "name": self.client.document_name(&document_id), "fields": encoded.fields }
        });
        let old_chunks = match precondition {
            Precondition::MustNotExist => {
                main["currentDocument"] = json!({ "exists": false });
                0
            }
            Precondition::MatchRevision(rev) => {
                let (update_time, chunks) = parse_revision(rev).ok_or_else(|| stale(id, rev))?;
                main["currentDocument"] = json!({ "updateTime": update_time });
                chunks
            }
            // Unknown: clear every chunk slot a document can have.
            Precondition::None => MAX_CHUNKS,
        };
        let mut writes = vec![main];
        if let Some(set) = &encoded.chunk_set {
            for (n, chunk) in encoded.extra_chunks.iter().enumerate() {
                writes.push(json!({
                    "update": { "name": self.client.chunk_name(&document_id, n + 1), "fields": codec::chunk_fields(set, chunk) }
                }));
            }
        }
        for n in encoded.extra_chunks.len() + 1..=old_chunks {
            writes.push(json!({ "delete": self.client.chunk_name(&document_id, n) }));
        }
        Ok((writes, encoded.extra_chunks.len()))
    }

    /// Commits the writes that store one document; its new revision.
    async fn commit_document(&self, id: &str, writes: Vec<Value>, chunks: usize) -> Result<Revision> {
        let doing = format!("write document {id:?}");
        match self.commit(writes, &doing).await {
            Ok(reply) => Ok(revision(&update_time_of(&reply, &doing)?, chunks)),
            // An update precondition on a missing document answers NOT_FOUND in production.
            Err(e) if e.kind() == ErrorKind::NotFound => {
                Err(Error::conflict(format!("document {id:?} changed or is gone")))
            }
            Err(e) => Err(e),
        }
    }

    async fn commit(&self, writes: Vec<Value>, doing: &str) -> Result<Value> {
        let body = json!({ "writes": writes });
        self.client.call(Method::POST, &self.client.method_url("commit"), Some(&body), Call::Write, doing).await
    }

    /// A stored document from Firestore's JSON, its chunks fetched when it has any. `None` when
    /// the chunks belong to another version (the document changed between the two reads).
    async fn to_document(&self, document: &Value, doing: &str) -> Result<Option<StoredDocument>> {
        let name = document.get("name").and_then(Value::as_str).unwrap_or("");
        let empty = Map::new();
        let stored = document.get("fields").and_then(Value::as_object).unwrap_or(&empty);
        let update_time = document.get("updateTime").and_then(Value::as_str).unwrap_or("");
        let document_id = self.client.document_id_of(name).unwrap_or(name);
        let id = match codec::stored_id(stored) {
            Some(id) => id.to_owned(),
            None => codec::composite_id(document_id).unwrap_or_else(|| document_id.to_owned()),
        };
        // A projection may leave out `_body` (and `_chunkSet`) but keeps `_chunks`, so the
        // revision always says how many chunks the document has.
        let chunks = codec::chunk_count(stored);
        let mut data = Vec::new();
        if chunks > 0 && stored.contains_key(codec::BODY) {
            let set = codec::chunk_set(stored).ok_or_else(|| {
                Error::new(ErrorKind::Corrupt, format!("Firestore document {id:?} has _chunks but no _chunkSet"))
            })?;
            match self.read_chunks(document_id, chunks, set, doing).await? {
                Some(read) => data = read,
                None => return Ok(None),
            }
        }
        let body = codec::decode(&id, stored, &data)?;
        Ok(Some(StoredDocument { id, rev: revision(update_time, chunks), body }))
    }

    /// One `:batchGet` of these resource names; Firestore's answer, a list of `found`/`missing`.
    async fn batch_get(&self, names: &[String], doing: &str) -> Result<Value> {
        let body = json!({ "documents": names });
        self.client.call(Method::POST, &self.client.method_url("batchGet"), Some(&body), Call::Read, doing).await
    }

    /// The bytes of chunks 1..=count, or `None` if any is missing or of another set.
    async fn read_chunks(
        &self,
        document_id: &str,
        count: usize,
        set: &str,
        doing: &str,
    ) -> Result<Option<Vec<Vec<u8>>>> {
        let names: Vec<String> = (1..=count).map(|n| self.client.chunk_name(document_id, n)).collect();
        let reply = self.batch_get(&names, doing).await?;
        let mut found: Vec<Option<Vec<u8>>> = vec![None; count];
        for entry in reply.as_array().into_iter().flatten() {
            let Some(document) = entry.get("found") else { continue };
            let name = document.get("name").and_then(Value::as_str).unwrap_or("");
            let Some(position) = names.iter().position(|n| n == name) else { continue };
            let empty = Map::new();
            let fields = document.get("fields").and_then(Value::as_object).unwrap_or(&empty);
            found[position] = codec::chunk_data(fields, set);
        }
        Ok(found.into_iter().collect())
    }

    /// `get` without the consistency loop: `None` when the chunks changed between reads. A
    /// `:batchGet` rather than a GET of the document's URL, because names go literally in a
    /// request body, while the emulator decodes `%` in URL paths twice.
    async fn get_once(&self, id: &str) -> Result<Option<Option<StoredDocument>>> {
        let doing = format!("read document {id:?}");
        let name = self.client.document_name(&codec::document_id(id));
        let body = json!({ "documents": [name] });
        let reply = self
            .client
            .call(Method::POST, &self.client.method_url("batchGet"), Some(&body), Call::Read, &doing)
            .await?;
        let entry = reply
            .as_array()
            .and_then(|entries| entries.iter().find(|e| e.get("found").is_some() || e.get("missing").is_some()))
            .ok_or_else(|| super::error::bad_body(&doing, "batchGet answered neither found nor missing"))?;
        match entry.get("found") {
            Some(document) => Ok(self.to_document(document, &doing).await?.map(Some)),
            None => Ok(Some(None)),
        }
    }

    /// The current documents of `ids` (distinct) in one `:batchGet`. Firestore answers each name
    /// with `found` or `missing`, in no promised order, so answers are matched by name. A document
    /// whose chunks changed between the reads, or a name the answer does not mention, is read
    /// again by `get`.
    async fn read_names(&self, ids: Vec<String>) -> Result<Vec<(String, StoredDocument)>> {
        const DOING: &str = "read documents in a batch";
        let names: Vec<String> = ids.iter().map(|id| self.client.document_name(&codec::document_id(id))).collect();
        let position: std::collections::HashMap<&str, usize> =
            names.iter().enumerate().map(|(n, name)| (name.as_str(), n)).collect();
        let reply = self.batch_get(&names, DOING).await?;
        let mut answered = vec![false; ids.len()];
        let mut found = Vec::with_capacity(ids.len());
        for entry in reply.as_array().into_iter().flatten() {
            let (name, document) = match (entry.get("found"), entry.get("missing").and_then(Value::as_str)) {
                (Some(document), _) => (document.get("name").and_then(Value::as_str).unwrap_or(""), Some(document)),
                (None, Some(name)) => (name, None),
                (None, None) => continue,
            };
            let Some(&n) = position.get(name) else { continue };
            if let Some(document) = document {
                if let Some(doc) = self.to_document(document, DOING).await? {
                    found.push((ids[n].clone(), doc));
                    answered[n] = true;
                }
            } else {
                answered[n] = true;
            }
        }
        for (id, _) in ids.iter().zip(answered).filter(|(_, answered)| !answered) {
            if let Some(doc) = self.get(id).await? {
                found.push((id.clone(), doc));
            }
        }
        Ok(found)
    }

    /// Runs a structured query; documents in order, and whether the page was full.
    async fn run_query(
        &self,
        mut query: Value,
        limit: usize,
        page_token: Option<&str>,
        doing: &str,
    ) -> Result<Page<StoredDocument>> {
        let limit = limit.clamp(1, i32::MAX as usize);
        query["from"] = json!([{ "collectionId": self.client.collection() }]);
        query["orderBy"] = json!([{ "field": { "fieldPath": "__name__" }, "direction": "ASCENDING" }]);
        query["limit"] = json!(limit);
        if let Some(token) = page_token {
            query["startAt"] =
                json!({ "values": [{ "referenceValue": self.client.document_name(token) }], "before": false });
        }
        let reply = self
            .client
            .call(
                Method::POST,
                &self.client.method_url("runQuery"),
                Some(&json!({ "structuredQuery": query })),
                Call::Read,
                doing,
            )
            .await?;
        let results =
            reply.as_array().ok_or_else(|| super::error::bad_body(doing, "runQuery did not answer a list"))?;
        let mut items = Vec::with_capacity(results.len());
        let mut last_name = None;
        for result in results {
            let Some(document) = result.get("document") else { continue };
            last_name = document.get("name").and_then(Value::as_str);
            match self.to_document(document, doing).await? {
                Some(doc) => items.push(doc),
                // Its chunks changed after the query read it: take the current version, or leave
                // it out if it is gone.
                None => {
                    let empty = Map::new();
                    let stored = document.get("fields").and_then(Value::as_object).unwrap_or(&empty);
                    if let Some(doc) = self.get(codec::stored_id(stored).unwrap_or("")).await? {
                        items.push(doc);
                    }
                }
            }
        }
        let next = match last_name {
            Some(name) if results.iter().filter(|r| r.get("document").is_some()).count() >= limit => {
                Some(self.client.document_id_of(name).unwrap_or(name).to_owned())
            }
            _ => None,
        };
        Ok(Page { items, next })
    }

    /// Plain writes (no chunks, known preconditions) through `:batchWrite`, busy entries retried.
    async fn batch_write(&self, entries: Vec<(usize, Value)>, results: &mut [Option<Result<Revision>>]) -> Result<()> {
        let mut pending = entries;
        let mut backoff = ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(100))
            .with_max_delay(Duration::from_secs(3))
            .with_jitter()
            .with_max_times(BUSY_WRITE_ROUNDS)
            .build();
        for round in 0..=BUSY_WRITE_ROUNDS {
            if pending.is_empty() {
                break;
            }
            if round > 0 {
                tokio::time::sleep(backoff.next().unwrap_or(Duration::from_secs(3))).await;
            }
            let groups = group_by_size(pending);
            let replies: Vec<(Vec<(usize, Value)>, Value)> = stream::iter(groups)
                .map(|group| async move {
                    let body = json!({ "writes": group.iter().map(|(_, w)| w).collect::<Vec<_>>() });
                    let reply = self
                        .client
                        .call(
                            Method::POST,
                            &self.client.method_url("batchWrite"),
                            Some(&body),
                            Call::Write,
                            "write documents in bulk",
                        )
                        .await?;
                    Ok::<_, Error>((group, reply))
                })
                .buffered(WRITE_CONCURRENCY)
                .try_collect()
                .await?;
            pending = Vec::new();
            for (group, reply) in replies {
                for (position, (slot, write)) in group.into_iter().enumerate() {
                    let status = reply.pointer(&format!("/status/{position}"));
                    let code = status.and_then(|s| s.get("code")).and_then(Value::as_i64).unwrap_or(0);
                    let message = status.and_then(|s| s.get("message")).and_then(Value::as_str).unwrap_or("");
                    let id = write.pointer("/update/fields/_id/stringValue").and_then(Value::as_str).unwrap_or("?");
                    results[slot] = Some(match code {
                        0 => reply
                            .pointer(&format!("/writeResults/{position}/updateTime"))
                            .and_then(Value::as_str)
                            .map(|time| revision(time, 0))
                            .ok_or_else(|| {
                                Error::new(ErrorKind::Internal, "Firestore's batchWrite answer has no updateTime")
                            }),
                        // ABORTED, RESOURCE_EXHAUSTED, UNAVAILABLE: not applied; try again.
                        10 | 8 | 14 if round < BUSY_WRITE_ROUNDS => {
                            pending.push((slot, write));
                            continue;
                        }
                        code => Err(write_error(code, id, message)),
                    });
                }
            }
        }
        Ok(())
    }
}

fn inconsistent(doing: &str) -> Error {
    Error::new(ErrorKind::Unavailable, format!("a document kept changing while trying to {doing}; try again"))
}

/// Splits writes into `:batchWrite` requests within Firestore's count and size limits.
fn group_by_size(entries: Vec<(usize, Value)>) -> Vec<Vec<(usize, Value)>> {
    let mut groups: Vec<Vec<(usize, Value)>> = Vec::new();
    let mut size = 0;
    for entry in entries {
        let entry_size = crate::model::validate::json_size(&entry.1);
        let full =
            groups.last().is_none_or(|g| g.len() >= BATCH_WRITE_MAX || size + entry_size > BATCH_WRITE_MAX_BYTES);
        if full {
            groups.push(Vec::new());
            size = 0;
        }
        size += entry_size;
        if let Some(group) = groups.last_mut() {
            group.push(entry);
        }
    }
    groups
}

/// The error for a failed `:batchWrite` entry (gRPC status codes).
fn write_error(code: i64, id: &str, message: &str) -> Error {
    let kind = match code {
        5 | 6 | 9 => ErrorKind::Conflict, // NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION
        3 | 11 => ErrorKind::InvalidInput,
        7 | 16 => ErrorKind::Unauthorized,
        8 | 10 | 14 | 4 => ErrorKind::Unavailable,
        _ => ErrorKind::Internal,
    };
    Error::new(kind, format!("Firestore did not write document {id:?} (status {code}: {message})"))
}

#[async_trait::async_trait]
impl DocumentBackend for FirestoreBackend {
    fn describe(&self) -> String {
        self.config.redacted()
    }

    async fn get(&self, id: &str) -> Result<Option<StoredDocument>> {
        for _ in 0..CONSISTENT_READ_TRIES {
            if let Some(found) = self.get_once(id).await? {
                return Ok(found);
            }
        }
        Err(inconsistent(&format!("read document {id:?}")))
    }

    async fn get_many(&self, ids: &[String]) -> Result<Vec<Option<StoredDocument>>> {
        crate::backend::batched_get_many(ids, BATCH_GET_MAX, BATCH_GET_CONCURRENCY, |ids| self.read_names(ids)).await
    }

    async fn put(&self, id: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision> {
        let (writes, chunks) = self.commit_writes(id, body, &precondition)?;
        self.commit_document(id, writes, chunks).await
    }

    async fn delete(&self, id: &str, rev: &Revision) -> Result<()> {
        let doing = format!("delete document {id:?}");
        let document_id = codec::document_id(id);
        let outcome = match parse_revision(rev) {
            Some((update_time, chunks)) => {
                let mut writes = vec![json!({
                    "delete": self.client.document_name(&document_id),
                    "currentDocument": { "updateTime": update_time }
                })];
                writes.extend((1..=chunks).map(|n| json!({ "delete": self.client.chunk_name(&document_id, n) })));
                self.commit(writes, &doing).await
            }
            None => Err(stale(id, rev)),
        };
        match outcome {
            Ok(_) => Ok(()),
            Err(e) if matches!(e.kind(), ErrorKind::Conflict | ErrorKind::NotFound) => match self.get(id).await? {
                None => Err(Error::not_found(format!("document {id:?} does not exist"))),
                Some(_) => Err(Error::conflict(format!("document {id:?} has changed since revision {rev}"))),
            },
            Err(e) => Err(e),
        }
    }

    async fn query(&self, query: &Query, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        let equal = |field: &str, value: &str| json!({ "fieldFilter": { "field": { "fieldPath": field }, "op": "EQUAL", "value": { "stringValue": value } } });
        let filter = match &query.namespace {
            Some(namespace) => json!({ "compositeFilter": { "op": "AND", "filters": [
                equal(fields::USER_ID, &query.user_id), equal(fields::NAMESPACE, namespace)
            ] } }),
            None => equal(fields::USER_ID, &query.user_id),
        };
        let mut structured = json!({ "where": filter });
        // Project only fields kept native on every document (see the codec).
        let native_fields = [fields::USER_ID, fields::NAMESPACE, fields::KEY];
        if let Projection::Fields(wanted) = &query.projection {
            if wanted.iter().all(|f| native_fields.contains(f)) {
                let paths: Vec<Value> =
                    wanted.iter().chain([&codec::ID, &codec::CHUNKS]).map(|f| json!({ "fieldPath": f })).collect();
                structured["select"] = json!({ "fields": paths });
            }
        }
        let doing = format!("list the documents of user {:?}", query.user_id);
        let mut page = self.run_query(structured, limit, page_token, &doing).await?;
        if let Projection::Fields(wanted) = &query.projection {
            for doc in &mut page.items {
                doc.body.retain(|name, _| wanted.contains(&name.as_str()));
            }
        }
        Ok(page)
    }

    async fn ensure_standard_indexes(&self) -> Result<()> {
        // Firestore indexes are deployed, not created by clients (firestore.indexes.json). Probe
        // the query the listings use, so a missing index fails startup with Firestore's link.
        let probe = Query {
            user_id: String::new(),
            namespace: Some(String::new()),
            projection: Projection::Fields(vec![fields::KEY]),
        };
        self.query(&probe, 1, None).await.map(|_| ())
    }

    async fn ensure_namespace_indexed(&self, _namespace: &str) -> Result<()> {
        // The composite index covers every namespace.
        Ok(())
    }

    async fn bulk_write(&self, writes: Vec<BulkWrite>) -> Result<Vec<Result<Revision>>> {
        let mut results: Vec<Option<Result<Revision>>> = (0..writes.len()).map(|_| None).collect();
        let mut plain = Vec::new();
        let mut committed = Vec::new();
        for (slot, write) in writes.into_iter().enumerate() {
            let needs_commit = match &write.precondition {
                Precondition::None => true,
                Precondition::MatchRevision(rev) => parse_revision(rev).is_none_or(|(_, chunks)| chunks > 0),
                Precondition::MustNotExist => false,
            };
            match self.commit_writes(&write.id, &write.body, &write.precondition) {
                Err(e) => results[slot] = Some(Err(e)),
                Ok((parts, chunks)) if needs_commit || parts.len() > 1 => {
                    committed.push((slot, write.id, parts, chunks))
                }
                Ok((mut parts, _)) => plain.push((slot, parts.remove(0))),
            }
        }
        let commits: Vec<(usize, Result<Revision>)> = stream::iter(committed)
            .map(|(slot, id, parts, chunks)| async move { (slot, self.commit_document(&id, parts, chunks).await) })
            .buffer_unordered(WRITE_CONCURRENCY)
            .collect()
            .await;
        for (slot, result) in commits {
            results[slot] = Some(result);
        }
        self.batch_write(plain, &mut results).await?;
        Ok(results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| Err(Error::new(ErrorKind::Internal, "Firestore bulk write lost track of a write")))
            })
            .collect())
    }

    async fn scan(&self, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        self.run_query(json!({}), limit, page_token, "scan every document").await
    }

    async fn approximate_count(&self) -> Result<Option<u64>> {
        self.exact_count().await
    }

    async fn exact_count(&self) -> Result<Option<u64>> {
        // A COUNT aggregation (exact; chunk documents live in a subcollection and are not counted): billed as one read per 1,000 index entries, no documents read.
        let query = json!({ "structuredAggregationQuery": {
            "structuredQuery": { "from": [{ "collectionId": self.client.collection() }] },
            "aggregations": [{ "alias": "documents", "count": {} }]
        } });
        let reply = self
            .client
            .call(
                Method::POST,
                &self.client.method_url("runAggregationQuery"),
                Some(&query),
                Call::Read,
                "count documents",
            )
            .await?;
        Ok(reply
            .as_array()
            .into_iter()
            .flatten()
            .find_map(|r| r.pointer("/result/aggregateFields/documents/integerValue"))
            .and_then(|n| n.as_str().and_then(|t| t.parse().ok()).or_else(|| n.as_u64())))
    }

    async fn health(&self) -> Result<()> {
        let query =
            json!({ "structuredQuery": { "from": [{ "collectionId": self.client.collection() }], "limit": 1 } });
        match self
            .client
            .call(Method::POST, &self.client.method_url("runQuery"), Some(&query), Call::Read, "check the database")
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => Err(Error::new(
                ErrorKind::Misconfigured,
                format!("Firestore database {:?} does not exist (or is not in Native mode): {e}", self.config.database),
            )),
            Err(e) => Err(e),
        }
    }
}
