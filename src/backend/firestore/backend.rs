//! [`FirestoreBackend`]: the `DocumentBackend` over Firestore's REST API v1.
//!
//! Every write is one `:commit` (atomic: a document and its chunk documents change together) or,
//! for plain documents in bulk, one `:batchWrite` entry. A write mints its own revision
//! (`N-<32 hex>`, stored in `_rev` with the ancestry in `_revs`) and carries a precondition in
//! the request body: `exists: false` to create, or the `updateTime` of the version it read and
//! checked, so a write that read, checked and then lost a race fails instead of overwriting.
//! Deletes leave tombstones. Documents of the previous release (no `_rev`) keep their old
//! revision, `updateTime[;N]`, which needs no read to use as a precondition. Listings and the
//! full scan are `:runQuery` ordered by `__name__` and continued with a `startAt` cursor after the
//! last document, so a saved page token resumes exactly where it stopped. The document model's
//! listings (feed, id order, erasure, local documents, upgrades) are in `listing.rs`.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use futures::{stream, StreamExt, TryStreamExt};
use reqwest::Method;
use serde_json::{json, Map, Value};

use super::client::{Call, FirestoreClient};
use super::codec;
use super::config::FirestoreConfig;
use super::model::{self, StoredState};
use crate::backend::replicated;
use crate::backend::revision::{PackedAncestry, RevisionId};
use crate::backend::{
    BulkWrite, ChangesPage, DocumentBackend, IdRange, LayoutState, Page, Precondition, Projection, Query,
    ReplicatedOutcome, ReplicatedRevision, Revision, RevisionInfo, StoredDocument, UpgradePage,
};
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
    pub(super) client: FirestoreClient,
    pub(super) config: FirestoreConfig,
    /// Set once the collection is known to have this release's layout (it never goes back).
    pub(super) layout_current: AtomicBool,
}

/// One `:batchWrite` entry: the result slot, the write, and the revision it mints.
type BatchEntry = (usize, Value, Revision);

/// A query's documents and the read time Firestore answered it at.
pub(super) struct QueryAnswer {
    pub documents: Vec<Value>,
    pub read_time: Option<String>,
}

/// A write ready to commit: Firestore's writes, and the revision it mints.
pub(super) struct PlannedWrite {
    pub writes: Vec<Value>,
    pub rev: Revision,
}

/// What a read of one document found.
pub(super) enum Fetched {
    Live(StoredDocument),
    Tombstone,
    /// Its chunks belong to another version: it changed between the reads.
    Torn,
}

fn stale(id: &str, rev: &Revision) -> Error {
    Error::conflict(format!("document {id:?} is not at revision {rev}"))
}

/// The state a revision given as a precondition stands for without a read: a previous-release
/// revision says its `updateTime` and chunk count itself.
fn legacy_state(rev: &Revision) -> Option<StoredState> {
    model::parse_legacy(rev, MAX_CHUNKS).map(|(time, chunks)| StoredState::legacy(time, chunks))
}

impl FirestoreBackend {
    /// Connects (credentials, or the emulator), checks the database answers, and marks a new,
    /// empty collection as having this release's layout.
    pub async fn open(config: &FirestoreConfig) -> Result<Self> {
        let client = FirestoreClient::connect(config).await?;
        let backend = FirestoreBackend { client, config: config.clone(), layout_current: AtomicBool::new(false) };
        backend.health().await?;
        backend.layout().await?;
        Ok(backend)
    }

    /// The writes that store `body` under `id` if `precondition` holds against `current` (the
    /// stored version that was read, or `None` for none): the main document with the new
    /// revision and a precondition on exactly the version checked, its chunks, and deletes of
    /// the chunk slots the replaced version used beyond the new count.
    pub(super) fn plan_write(
        &self,
        id: &str,
        body: &Map<String, Value>,
        precondition: &Precondition,
        current: Option<&StoredState>,
    ) -> Result<PlannedWrite> {
        let parent = match (precondition, current) {
            (Precondition::MustNotExist, Some(state)) if !state.deleted => {
                return Err(Error::conflict(format!("document {id:?} already exists")))
            }
            (Precondition::MatchRevision(rev), None) => return Err(stale(id, rev)),
            (Precondition::MatchRevision(rev), Some(state)) if state.deleted || &state.rev != rev => {
                return Err(stale(id, rev))
            }
            (_, current) => current,
        };
        let rev = RevisionId::next_after(parent.map(StoredState::counted_generation))?;
        let ancestry = PackedAncestry::extend(parent.map(|p| &p.ancestry), &rev, self.config.revs_limit);
        self.plan_version(id, Some(body), &rev, &ancestry, parent)
    }

    /// The writes that replace `current` (`None`: no document) by revision `rev` with `ancestry`:
    /// the main document, conditional on exactly the version read, with `body` or, for `None`, as
    /// a tombstone; the body's chunks; and deletes of the chunk slots the replaced version used
    /// beyond the new count.
    pub(super) fn plan_version(
        &self,
        id: &str,
        body: Option<&Map<String, Value>>,
        rev: &RevisionId,
        ancestry: &PackedAncestry,
        current: Option<&StoredState>,
    ) -> Result<PlannedWrite> {
        let document_id = codec::document_id(id);
        let (fields, chunk_set, extra_chunks) = match body {
            Some(body) => {
                let codec::Encoded { mut fields, chunk_set, extra_chunks } = codec::encode(id, body)?;
                model::stamp(&mut fields, rev, ancestry, false);
                (fields, chunk_set, extra_chunks)
            }
            None => (model::tombstone_fields(id, rev, ancestry), None, Vec::new()),
        };
        let mut main = json!({
            "update": { "name": self.client.document_name(&document_id), "fields": fields },
            "updateTransforms": model::changed_at_transform(),
        });
        main["currentDocument"] = match current {
            Some(state) => json!({ "updateTime": state.update_time }),
            None => json!({ "exists": false }),
        };
        let mut writes = vec![main];
        if let Some(set) = &chunk_set {
            for (n, chunk) in extra_chunks.iter().enumerate() {
                writes.push(json!({
                    "update": { "name": self.client.chunk_name(&document_id, n + 1), "fields": codec::chunk_fields(set, chunk) }
                }));
            }
        }
        let chunk_count = extra_chunks.len();
        for n in chunk_count + 1..=current.map_or(0, |p| p.chunks) {
            writes.push(json!({ "delete": self.client.chunk_name(&document_id, n) }));
        }
        Ok(PlannedWrite { writes, rev: rev.to_revision() })
    }

    /// Stores a revision made elsewhere if the rules of [`replicated::judge`] say so against the
    /// stored state, conditional on the version read; a lost race reads again and judges anew.
    async fn put_replicated_version(&self, id: &str, incoming: &ReplicatedRevision) -> Result<ReplicatedOutcome> {
        let checked = replicated::check(id, incoming)?;
        let ancestry = checked.stored_ancestry(self.config.revs_limit);
        let body = (!incoming.deleted).then_some(&incoming.body);
        for _ in 0..CONSISTENT_READ_TRIES {
            let current = self.read_state(id).await?;
            let outcome = replicated::judge(incoming, current.as_ref().map(StoredState::info).as_ref());
            if outcome != ReplicatedOutcome::Applied {
                return Ok(outcome);
            }
            let plan = self.plan_version(id, body, &checked.rev, &ancestry, current.as_ref())?;
            match self.commit_planned(id, plan).await {
                Err(e) if e.is_conflict() => continue,
                outcome => return outcome.map(|_| ReplicatedOutcome::Applied),
            }
        }
        Err(inconsistent(&format!("write a replicated revision of document {id:?}")))
    }

    /// Commits a planned write; its revision. A write whose answer was lost is looked up: if the
    /// document holds the revision it minted (random, so no other writer's), it was applied.
    pub(super) async fn commit_planned(&self, id: &str, plan: PlannedWrite) -> Result<Revision> {
        let doing = format!("write document {id:?}");
        match self.commit(plan.writes, &doing).await {
            Ok(_) => Ok(plan.rev),
            Err(e) if e.kind() == ErrorKind::OutcomeUnknown => {
                if self.holds_revision(id, &plan.rev).await {
                    tracing::warn!(id, rev = %plan.rev, "a write whose answer was lost had been applied");
                    Ok(plan.rev)
                } else {
                    Err(e)
                }
            }
            // An update precondition on a missing document answers NOT_FOUND in production.
            Err(e) if matches!(e.kind(), ErrorKind::Conflict | ErrorKind::NotFound) => {
                Err(Error::conflict(format!("document {id:?} changed or is gone")).with_source(e))
            }
            Err(e) => Err(e),
        }
    }

    /// Whether the document `id` is now at `rev` (false when that cannot be read).
    async fn holds_revision(&self, id: &str, rev: &Revision) -> bool {
        matches!(self.read_state(id).await, Ok(Some(state)) if &state.rev == rev)
    }

    /// What a write needs to know of the stored document `id` (tombstones included), reading
    /// only the model's fields.
    pub(super) async fn read_state(&self, id: &str) -> Result<Option<StoredState>> {
        let name = self.client.document_name(&codec::document_id(id));
        let doing = format!("read the revision of document {id:?}");
        let reply = self.batch_get_fields(&[name], Some(&model::STATE_FIELDS), &doing).await?;
        Ok(reply.as_array().into_iter().flatten().find_map(|entry| entry.get("found")).map(StoredState::of))
    }

    /// The states of many documents (distinct ids), by `:batchGet`s of the model's fields.
    async fn read_states(&self, ids: &[String]) -> Result<HashMap<String, StoredState>> {
        let calls: Vec<Vec<String>> = ids.chunks(BATCH_GET_MAX).map(<[String]>::to_vec).collect();
        let replies: Vec<Value> = stream::iter(calls)
            .map(|ids| async move {
                let names: Vec<String> =
                    ids.iter().map(|id| self.client.document_name(&codec::document_id(id))).collect();
                self.batch_get_fields(&names, Some(&model::STATE_FIELDS), "read revisions in a batch").await
            })
            .buffered(BATCH_GET_CONCURRENCY)
            .try_collect()
            .await?;
        let mut states = HashMap::new();
        for document in replies.iter().flat_map(|r| r.as_array().into_iter().flatten()).filter_map(|e| e.get("found")) {
            if let Some(id) = document.get("fields").and_then(Value::as_object).and_then(codec::stored_id) {
                states.insert(id.to_owned(), StoredState::of(document));
            }
        }
        Ok(states)
    }

    /// One `:batchGet` of these resource names, optionally only some fields; Firestore's answer,
    /// a list of `found`/`missing`.
    pub(super) async fn batch_get_fields(&self, names: &[String], mask: Option<&[&str]>, doing: &str) -> Result<Value> {
        let mut body = json!({ "documents": names });
        if let Some(fields) = mask {
            body["mask"] = json!({ "fieldPaths": fields });
        }
        self.client.call(Method::POST, &self.client.method_url("batchGet"), Some(&body), Call::Read, doing).await
    }

    /// `put` with no precondition: replaces whatever is there (live or tombstone, continuing its
    /// generation), conditional on the version read, read again when another writer wins.
    async fn overwrite(&self, id: &str, body: &Map<String, Value>) -> Result<Revision> {
        for _ in 0..CONSISTENT_READ_TRIES {
            let current = self.read_state(id).await?;
            let plan = self.plan_write(id, body, &Precondition::None, current.as_ref())?;
            match self.commit_planned(id, plan).await {
                Err(e) if e.is_conflict() => continue,
                outcome => return outcome,
            }
        }
        Err(inconsistent(&format!("write document {id:?}")))
    }

    /// A COUNT of the collection's documents matching `filter`, at `read_time` when given; the
    /// count and the read time it was taken at.
    async fn count(&self, filter: Option<Value>, read_time: Option<&str>) -> Result<(u64, Option<String>)> {
        let mut structured = json!({ "from": [{ "collectionId": self.client.collection() }] });
        if let Some(filter) = filter {
            structured["where"] = filter;
        }
        let mut query = json!({ "structuredAggregationQuery": {
            "structuredQuery": structured,
            "aggregations": [{ "alias": "documents", "count": {} }]
        } });
        if let Some(time) = read_time {
            query["readTime"] = json!(time);
        }
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
        let results = reply.as_array().into_iter().flatten();
        let count = results
            .clone()
            .find_map(|r| r.pointer("/result/aggregateFields/documents/integerValue"))
            .and_then(|n| n.as_str().and_then(|t| t.parse().ok()).or_else(|| n.as_u64()))
            .ok_or_else(|| super::error::bad_body("count documents", "the aggregation answered no count"))?;
        let time = results.filter_map(|r| r.get("readTime").and_then(Value::as_str)).next().map(str::to_owned);
        Ok((count, time))
    }

    pub(super) async fn commit(&self, writes: Vec<Value>, doing: &str) -> Result<Value> {
        let body = json!({ "writes": writes });
        self.client.call(Method::POST, &self.client.method_url("commit"), Some(&body), Call::Write, doing).await
    }

    /// A stored document from Firestore's JSON, its chunks fetched when it has any.
    pub(super) async fn to_document(&self, document: &Value, doing: &str) -> Result<Fetched> {
        let name = document.get("name").and_then(Value::as_str).unwrap_or("");
        let empty = Map::new();
        let stored = document.get("fields").and_then(Value::as_object).unwrap_or(&empty);
        if model::is_tombstone(stored) {
            return Ok(Fetched::Tombstone);
        }
        let update_time = document.get("updateTime").and_then(Value::as_str).unwrap_or("");
        let document_id = self.client.document_id_of(name).unwrap_or(name);
        let id = match codec::stored_id(stored) {
            Some(id) => id.to_owned(),
            None => codec::composite_id(document_id).unwrap_or_else(|| document_id.to_owned()),
        };
        // A projection may leave out `_body` (and `_chunkSet`) but keeps `_chunks` and `_rev`.
        let chunks = codec::chunk_count(stored);
        let mut data = Vec::new();
        if chunks > 0 && stored.contains_key(codec::BODY) {
            let set = codec::chunk_set(stored).ok_or_else(|| {
                Error::new(ErrorKind::Corrupt, format!("Firestore document {id:?} has _chunks but no _chunkSet"))
            })?;
            match self.read_chunks(document_id, chunks, set, doing).await? {
                Some(read) => data = read,
                None => return Ok(Fetched::Torn),
            }
        }
        let body = codec::decode(&id, stored, &data)?;
        let rev = match model::stored_revision(stored) {
            Some(rev) => rev.to_revision(),
            None => model::legacy_revision(update_time, chunks),
        };
        Ok(Fetched::Live(StoredDocument { id, rev, body }))
    }

    /// One `:batchGet` of these resource names; Firestore's answer, a list of `found`/`missing`.
    async fn batch_get(&self, names: &[String], doing: &str) -> Result<Value> {
        self.batch_get_fields(names, None, doing).await
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
            Some(document) => Ok(match self.to_document(document, &doing).await? {
                Fetched::Live(doc) => Some(Some(doc)),
                Fetched::Tombstone => Some(None),
                Fetched::Torn => None,
            }),
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
                match self.to_document(document, DOING).await? {
                    Fetched::Live(doc) => {
                        found.push((ids[n].clone(), doc));
                        answered[n] = true;
                    }
                    Fetched::Tombstone => answered[n] = true,
                    Fetched::Torn => {}
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

    /// Runs a structured query over the collection ordered by `__name__`, continued after the
    /// document `page_token` names; live documents in order, and the next token when the page
    /// was full.
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
        let answer = self.run_raw_query(&query, None, doing).await?;
        let next = match answer.documents.last() {
            Some(document) if answer.documents.len() >= limit => {
                let name = document.get("name").and_then(Value::as_str).unwrap_or("");
                Some(self.client.document_id_of(name).unwrap_or(name).to_owned())
            }
            _ => None,
        };
        Ok(Page { items: self.live_documents(&answer.documents, doing).await?, next })
    }

    /// Runs a structured query (at `read_time` when given); the documents, and the read time.
    pub(super) async fn run_raw_query(
        &self,
        query: &Value,
        read_time: Option<&str>,
        doing: &str,
    ) -> Result<QueryAnswer> {
        let mut request = json!({ "structuredQuery": query });
        if let Some(time) = read_time {
            request["readTime"] = json!(time);
        }
        let reply = self
            .client
            .call(Method::POST, &self.client.method_url("runQuery"), Some(&request), Call::Read, doing)
            .await?;
        let results =
            reply.as_array().ok_or_else(|| super::error::bad_body(doing, "runQuery did not answer a list"))?;
        let read_time = results.iter().rev().find_map(|r| r.get("readTime")).and_then(Value::as_str).map(str::to_owned);
        let documents = results.iter().filter_map(|r| r.get("document").cloned()).collect();
        Ok(QueryAnswer { documents, read_time })
    }

    /// The live documents among a query's answer, in order: tombstones left out, a document whose
    /// chunks changed after the query read it taken at its current version (or left out if gone).
    pub(super) async fn live_documents(&self, documents: &[Value], doing: &str) -> Result<Vec<StoredDocument>> {
        let mut items = Vec::with_capacity(documents.len());
        for document in documents {
            match self.to_document(document, doing).await? {
                Fetched::Live(doc) => items.push(doc),
                // Never data; skipping it costs its read (see the layout doc).
                Fetched::Tombstone => {}
                Fetched::Torn => {
                    let empty = Map::new();
                    let stored = document.get("fields").and_then(Value::as_object).unwrap_or(&empty);
                    if let Some(doc) = self.get(codec::stored_id(stored).unwrap_or("")).await? {
                        items.push(doc);
                    }
                }
            }
        }
        Ok(items)
    }

    /// Single-document writes through `:batchWrite`, busy entries retried; each entry is the
    /// result slot, the write and the revision it mints.
    async fn batch_write(&self, entries: Vec<BatchEntry>, results: &mut [Option<Result<Revision>>]) -> Result<()> {
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
            let replies: Vec<(Vec<BatchEntry>, Value)> = stream::iter(groups)
                .map(|group| async move {
                    let body = json!({ "writes": group.iter().map(|(_, w, _)| w).collect::<Vec<_>>() });
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
                for (position, (slot, write, rev)) in group.into_iter().enumerate() {
                    let status = reply.pointer(&format!("/status/{position}"));
                    let code = status.and_then(|s| s.get("code")).and_then(Value::as_i64).unwrap_or(0);
                    let message = status.and_then(|s| s.get("message")).and_then(Value::as_str).unwrap_or("");
                    let id = write.pointer("/update/fields/_id/stringValue").and_then(Value::as_str).unwrap_or("?");
                    results[slot] = Some(match code {
                        0 => Ok(rev),
                        // ABORTED, RESOURCE_EXHAUSTED, UNAVAILABLE: not applied; try again.
                        10 | 8 | 14 if round < BUSY_WRITE_ROUNDS => {
                            pending.push((slot, write, rev));
                            continue;
                        }
                        code => Err(write_error(code, id, message)),
                    });
                }
            }
        }
        Ok(())
    }

    /// `bulk_write` of writes to distinct ids.
    async fn write_distinct_ids(&self, writes: Vec<BulkWrite>) -> Result<Vec<Result<Revision>>> {
        let mut results: Vec<Option<Result<Revision>>> = (0..writes.len()).map(|_| None).collect();
        // Updates and overwrites need the stored version (its revision, ancestry and chunks);
        // creates are tried blind.
        let to_read: Vec<String> = crate::backend::distinct_ids(
            &writes
                .iter()
                .filter(|w| match &w.precondition {
                    Precondition::MustNotExist => false,
                    Precondition::MatchRevision(rev) => legacy_state(rev).is_none(),
                    Precondition::None => true,
                })
                .map(|w| w.id.clone())
                .collect::<Vec<_>>(),
        );
        let states = self.read_states(&to_read).await?;
        let mut plain = Vec::new();
        let mut committed = Vec::new();
        for (slot, write) in writes.iter().enumerate() {
            let current = match &write.precondition {
                Precondition::MustNotExist => None,
                Precondition::MatchRevision(rev) => legacy_state(rev).or_else(|| states.get(&write.id).cloned()),
                Precondition::None => states.get(&write.id).cloned(),
            };
            match self.plan_write(&write.id, &write.body, &write.precondition, current.as_ref()) {
                Err(e) => results[slot] = Some(Err(e)),
                Ok(plan) if plan.writes.len() > 1 => committed.push((slot, write.id.clone(), plan)),
                Ok(mut plan) => plain.push((slot, plan.writes.remove(0), plan.rev)),
            }
        }
        // Plain loops of futures, not closures in iterator adapters: those trip rustc's
        // higher-ranked `Send` check here.
        let mut commit_futures = Vec::with_capacity(committed.len());
        for (slot, id, plan) in committed {
            commit_futures.push(async move { (slot, self.commit_planned(&id, plan).await) });
        }
        let commits: Vec<(usize, Result<Revision>)> =
            stream::iter(commit_futures).buffer_unordered(WRITE_CONCURRENCY).collect().await;
        for (slot, result) in commits {
            results[slot] = Some(result);
        }
        self.batch_write(plain, &mut results).await?;
        // A blind create that met a tombstone, or an overwrite that lost a race, is done again
        // alone from a fresh read; a failed revision match stands.
        let again: Vec<usize> = results
            .iter()
            .enumerate()
            .filter(|(slot, r)| {
                matches!(r, Some(Err(e)) if e.is_conflict())
                    && !matches!(writes[*slot].precondition, Precondition::MatchRevision(_))
            })
            .map(|(slot, _)| slot)
            .collect();
        let mut redo_futures = Vec::with_capacity(again.len());
        for slot in again {
            let write = writes[slot].clone();
            redo_futures.push(async move { (slot, self.put(&write.id, &write.body, write.precondition).await) });
        }
        let redone: Vec<(usize, Result<Revision>)> =
            stream::iter(redo_futures).buffer_unordered(WRITE_CONCURRENCY).collect().await;
        for (slot, result) in redone {
            results[slot] = Some(result);
        }
        Ok(results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| Err(Error::new(ErrorKind::Internal, "Firestore bulk write lost track of a write")))
            })
            .collect())
    }
}

fn inconsistent(doing: &str) -> Error {
    Error::new(ErrorKind::Unavailable, format!("a document kept changing while trying to {doing}; try again"))
}

/// Splits writes into `:batchWrite` requests within Firestore's count and size limits.
fn group_by_size<T>(entries: Vec<(usize, Value, T)>) -> Vec<Vec<(usize, Value, T)>> {
    let mut groups: Vec<Vec<(usize, Value, T)>> = Vec::new();
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
        match &precondition {
            Precondition::MustNotExist => {
                // Tried blind first (most creates are of new ids); a tombstone in the way is read
                // and replaced conditionally.
                let plan = self.plan_write(id, body, &precondition, None)?;
                match self.commit_planned(id, plan).await {
                    Err(e) if e.is_conflict() => {
                        let current = self.read_state(id).await?;
                        let plan = self.plan_write(id, body, &precondition, current.as_ref())?;
                        self.commit_planned(id, plan).await
                    }
                    outcome => outcome,
                }
            }
            Precondition::MatchRevision(rev) => {
                let current = match legacy_state(rev) {
                    Some(state) => Some(state),
                    None if RevisionId::parse(rev.as_str()).is_some() => self.read_state(id).await?,
                    None => return Err(stale(id, rev)),
                };
                let plan = self.plan_write(id, body, &precondition, current.as_ref())?;
                self.commit_planned(id, plan).await
            }
            Precondition::None => self.overwrite(id, body).await,
        }
    }

    async fn delete(&self, id: &str, rev: &Revision) -> Result<Revision> {
        let doing = format!("delete document {id:?}");
        let current = match legacy_state(rev) {
            Some(state) => Some(state),
            None => self.read_state(id).await?,
        };
        let current = match current {
            None => return Err(Error::not_found(format!("document {id:?} does not exist"))),
            Some(state) if state.deleted => return Err(Error::not_found(format!("document {id:?} is deleted"))),
            Some(state) if &state.rev != rev => return Err(stale(id, rev)),
            Some(state) => state,
        };
        let next = RevisionId::next_after(Some(current.counted_generation()))?;
        let ancestry = PackedAncestry::extend(Some(&current.ancestry), &next, self.config.revs_limit);
        let plan = self.plan_version(id, None, &next, &ancestry, Some(&current))?;
        match self.commit(plan.writes, &doing).await {
            Ok(_) => Ok(plan.rev),
            Err(e) if e.kind() == ErrorKind::OutcomeUnknown && self.holds_revision(id, &plan.rev).await => Ok(plan.rev),
            Err(e) if matches!(e.kind(), ErrorKind::Conflict | ErrorKind::NotFound) => {
                match self.read_state(id).await? {
                    None => Err(Error::not_found(format!("document {id:?} does not exist"))),
                    Some(state) if state.deleted => Err(Error::not_found(format!("document {id:?} is deleted"))),
                    Some(_) => Err(Error::conflict(format!("document {id:?} has changed since revision {rev}"))),
                }
            }
            Err(e) => Err(e),
        }
    }

    async fn put_replicated(&self, id: &str, incoming: &ReplicatedRevision) -> Result<ReplicatedOutcome> {
        self.put_replicated_version(id, incoming).await
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
                let paths: Vec<Value> = wanted
                    .iter()
                    .chain([&codec::ID, &codec::CHUNKS, &model::REV])
                    .map(|f| json!({ "fieldPath": f }))
                    .collect();
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
        crate::backend::bulk_write_in_id_rounds(writes, |round| self.write_distinct_ids(round)).await
    }

    async fn revisions(&self, id: &str) -> Result<Option<RevisionInfo>> {
        Ok(self.read_state(id).await?.map(|state| state.info()))
    }

    async fn changes(&self, since: Option<&str>, limit: usize) -> Result<ChangesPage> {
        self.feed_page(since, limit).await
    }

    async fn change_position(&self) -> Result<String> {
        self.feed_position().await
    }

    fn change_feed_delay(&self) -> std::time::Duration {
        self.config.settle
    }

    async fn all_docs(&self, range: &IdRange, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        self.id_order_page(range, limit, page_token).await
    }

    async fn erase_prefix(&self, prefix: &str) -> Result<u64> {
        self.erase_ids_with_prefix(prefix).await
    }

    async fn get_local(&self, name: &str) -> Result<Option<StoredDocument>> {
        Ok(self.read_local(name).await?.map(|(doc, _)| doc))
    }

    async fn put_local(&self, name: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision> {
        self.write_local(name, body, precondition).await
    }

    async fn delete_local(&self, name: &str, rev: &Revision) -> Result<()> {
        self.remove_local(name, rev).await
    }

    async fn layout(&self) -> Result<LayoutState> {
        self.layout_state().await
    }

    async fn upgrade_page(&self, page_token: Option<&str>, limit: usize) -> Result<UpgradePage> {
        self.upgrade_step(page_token, limit).await
    }

    async fn finish_upgrade(&self) -> Result<()> {
        self.record_layout().await
    }

    async fn scan(&self, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        self.run_query(json!({}), limit, page_token, "scan every document").await
    }

    async fn approximate_count(&self) -> Result<Option<u64>> {
        self.exact_count().await
    }

    async fn exact_count(&self) -> Result<Option<u64>> {
        // COUNT aggregations (exact; chunk documents live in a subcollection and are not
        // counted), billed as one read per 1,000 index entries, no documents read: every document,
        // less the tombstones counted at the same read time.
        let (all, read_time) = self.count(None, None).await?;
        let tombstone = json!({ "fieldFilter": { "field": { "fieldPath": model::DELETED }, "op": "EQUAL", "value": { "booleanValue": true } } });
        let (tombstones, _) = self.count(Some(tombstone), read_time.as_deref()).await?;
        Ok(Some(all.saturating_sub(tombstones)))
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
