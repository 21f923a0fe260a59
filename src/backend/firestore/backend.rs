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
//! last document, so a saved page token resumes exactly where it stopped. The write path is
//! in `write.rs`; the change feed, id order and erasure, local documents and the upgrade in
//! `feed.rs`, `ids.rs`, `local.rs` and `layout.rs`.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;

use futures::{stream, StreamExt, TryStreamExt};
use reqwest::Method;
use serde_json::{json, Map, Value};

use super::codec;
use super::config::FirestoreConfig;
use super::core::{Call, FirestoreClient};
use super::layout::{self, StoredState};
use crate::backend::raw::count_cache::{CountCache, Counted};
use crate::backend::{
    BulkWrite, ChangesPage, DocumentBackend, EraseOptions, IdRange, LayoutState, Page, Precondition, Projection, Query,
    ReplicatedOutcome, ReplicatedRevision, Revision, RevisionInfo, StoredDocument, UpgradePage,
};
use crate::error::{Error, ErrorKind, Result};
use crate::model::fields;

/// Documents per `:batchGet` of a batch read, and such calls in flight at once.
const BATCH_GET_MAX: usize = 100;
const BATCH_GET_CONCURRENCY: usize = 4;
/// Re-reads of a document whose chunks changed under us before giving up.
pub(super) const CONSISTENT_READ_TRIES: usize = 5;

pub struct FirestoreBackend {
    pub(super) client: FirestoreClient,
    pub(super) config: FirestoreConfig,
    /// Set once the collection is known to have this release's layout (it never goes back).
    pub(super) layout_current: AtomicBool,
    /// The count of the feed's entries, remembered for at most `count_max_age_ms` and until this
    /// backend's next commit, served only while its check holds (`count_check.rs`).
    counts: CountCache,
    /// The last floor whose settle window held more reported writes than a one-query sweep asks
    /// for (`feed.rs`, `sweep_in_one_query`): a sweep from it reads the window whole at once
    /// instead of trying one query first. Only which queries to send; never what a read answers.
    pub(super) busy_window_floor: std::sync::Mutex<Option<String>>,
}

/// A query's documents and the read time Firestore answered it at.
pub(super) struct QueryAnswer {
    pub documents: Vec<Value>,
    pub read_time: Option<String>,
}

/// What a read of one document found.
pub(super) enum Fetched {
    Live(StoredDocument),
    Tombstone,
    /// Its chunks belong to another version: it changed between the reads.
    Torn,
}

impl FirestoreBackend {
    /// Connects (credentials, or the emulator), checks the database answers, and marks a new,
    /// empty collection as having this release's layout.
    pub async fn open(config: &FirestoreConfig) -> Result<Self> {
        let client = FirestoreClient::connect(config).await?;
        let backend = FirestoreBackend::with_client(client, config);
        backend.health().await?;
        backend.layout().await?;
        Ok(backend)
    }

    /// A backend over a client already made (the catalog's databases share one); no request.
    pub(super) fn with_client(client: FirestoreClient, config: &FirestoreConfig) -> Self {
        FirestoreBackend {
            client,
            config: config.clone(),
            layout_current: AtomicBool::new(false),
            counts: CountCache::new(config.count_max_age),
            busy_window_floor: std::sync::Mutex::new(None),
        }
    }

    /// What a write needs to know of the stored document `id` (tombstones included), reading
    /// only the model's fields.
    pub(super) async fn read_state(&self, id: &str) -> Result<Option<StoredState>> {
        let name = self.client.document_name(&codec::document_id(id));
        let doing = format!("read the revision of document {id:?}");
        let reply = self.batch_get_fields(&[name], Some(&layout::STATE_FIELDS), &doing).await?;
        Ok(reply.as_array().into_iter().flatten().find_map(|entry| entry.get("found")).map(StoredState::of))
    }

    /// The states of many documents (distinct ids), by `:batchGet`s of the model's fields.
    pub(super) async fn read_states(&self, ids: &[String]) -> Result<HashMap<String, StoredState>> {
        let calls: Vec<Vec<String>> = ids.chunks(BATCH_GET_MAX).map(<[String]>::to_vec).collect();
        let replies: Vec<Value> = stream::iter(calls)
            .map(|ids| async move {
                let names: Vec<String> =
                    ids.iter().map(|id| self.client.document_name(&codec::document_id(id))).collect();
                self.batch_get_fields(&names, Some(&layout::STATE_FIELDS), "read revisions in a batch").await
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

    /// A COUNT of the collection's documents matching `filter`, at `read_time` when given; the
    /// count and the read time it was taken at.
    pub(super) async fn count(&self, filter: Option<Value>, read_time: Option<&str>) -> Result<(u64, Option<String>)> {
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
                &self.client.query_url("runAggregationQuery"),
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

    /// Commits `writes`; whatever the outcome, a count remembered before is not served again (a
    /// commit that timed out may still have landed).
    pub(super) async fn commit(&self, writes: Vec<Value>, doing: &str) -> Result<Value> {
        let body = json!({ "writes": writes });
        let answer =
            self.client.call(Method::POST, &self.client.method_url("commit"), Some(&body), Call::Write, doing).await;
        self.forget_counts();
        answer
    }

    /// After a write of this backend (whatever its outcome): a count remembered before it is not
    /// served again.
    pub(super) fn forget_counts(&self) {
        self.counts.wrote();
    }

    /// A stored document from Firestore's JSON, its chunks fetched when it has any.
    pub(super) async fn to_document(&self, document: &Value, doing: &str) -> Result<Fetched> {
        let name = document.get("name").and_then(Value::as_str).unwrap_or("");
        let empty = Map::new();
        let stored = document.get("fields").and_then(Value::as_object).unwrap_or(&empty);
        if layout::is_tombstone(stored) {
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
        let rev = match layout::stored_revision(stored) {
            Some(rev) => rev.to_revision(),
            None => layout::legacy_revision(update_time, chunks),
        };
        Ok(Fetched::Live(StoredDocument { id, rev, body }))
    }

    /// One `:batchGet` of these resource names; Firestore's answer, a list of `found`/`missing`.
    pub(super) async fn batch_get(&self, names: &[String], doing: &str) -> Result<Value> {
        self.batch_get_fields(names, None, doing).await
    }

    /// The bytes of chunks 1..=count, or `None` if any is missing or of another set.
    pub(super) async fn read_chunks(
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
    pub(super) async fn get_once(&self, id: &str) -> Result<Option<Option<StoredDocument>>> {
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
    pub(super) async fn read_names(&self, ids: Vec<String>) -> Result<Vec<(String, StoredDocument)>> {
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
    pub(super) async fn run_query(
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
            .call(Method::POST, &self.client.query_url("runQuery"), Some(&request), Call::Read, doing)
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
}

pub(super) fn inconsistent(doing: &str) -> Error {
    Error::new(ErrorKind::Unavailable, format!("a document kept changing while trying to {doing}; try again"))
}

#[async_trait::async_trait]
impl DocumentBackend for FirestoreBackend {
    fn describe(&self) -> String {
        self.config.redacted()
    }

    fn url(&self) -> Option<crate::backend::BackendUrl> {
        Some(crate::backend::BackendUrl::Firestore(self.config.clone()))
    }

    async fn get(&self, id: &str) -> Result<Option<StoredDocument>> {
        for _ in 0..CONSISTENT_READ_TRIES {
            if let Some(found) = self.get_once(id).await? {
                return Ok(found);
            }
        }
        Err(inconsistent(&format!("read document {id:?}")))
    }

    async fn get_deleted(&self, id: &str) -> Result<Option<StoredDocument>> {
        let doing = format!("read the tombstone of {id:?}");
        let name = self.client.document_name(&codec::document_id(id));
        let reply = self.batch_get(std::slice::from_ref(&name), &doing).await?;
        let found = reply.as_array().and_then(|entries| entries.iter().find_map(|e| e.get("found")));
        let Some(document) = found else { return Ok(None) };
        let state = StoredState::of(document);
        if !state.deleted {
            return Ok(None);
        }
        let empty = Map::new();
        let fields = document.get("fields").and_then(Value::as_object).unwrap_or(&empty);
        let body = layout::deleted_body(id, fields)?;
        Ok(Some(StoredDocument { id: id.to_owned(), rev: state.rev, body }))
    }

    async fn get_many(&self, ids: &[String]) -> Result<Vec<Option<StoredDocument>>> {
        crate::backend::batched_get_many(ids, BATCH_GET_MAX, BATCH_GET_CONCURRENCY, |ids| self.read_names(ids)).await
    }

    async fn put(&self, id: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision> {
        self.put_document(id, body, precondition).await
    }

    async fn delete(&self, id: &str, rev: &Revision) -> Result<Revision> {
        self.delete_document(id, rev).await
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
                    .chain([&codec::ID, &codec::CHUNKS, &layout::REV])
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

    fn position_order(&self, a: &str, b: &str) -> Option<std::cmp::Ordering> {
        self.feed_position_order(a, b)
    }

    async fn all_docs(&self, range: &IdRange, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        self.id_order_page(range, limit, page_token).await
    }

    async fn erase_prefix(&self, prefix: &str) -> Result<u64> {
        self.erase_ids_with_prefix(prefix).await
    }

    async fn erase_id(&self, id: &str, options: &EraseOptions) -> Result<bool> {
        self.erase_one_id(id, options).await
    }

    async fn get_local(&self, name: &str) -> Result<Option<StoredDocument>> {
        Ok(self.read_local(name).await?.map(|(doc, _)| doc))
    }

    async fn get_many_local(&self, names: &[String]) -> Result<Vec<Option<StoredDocument>>> {
        crate::backend::batched_get_many(names, BATCH_GET_MAX, BATCH_GET_CONCURRENCY, |names| {
            self.read_local_names(names)
        })
        .await
    }

    fn checks_never_written(&self) -> bool {
        // A create's precondition is `exists: false`, which a tombstone document fails.
        true
    }

    async fn put_local(&self, name: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision> {
        self.write_local(name, body, precondition).await
    }

    async fn delete_local(&self, name: &str, rev: &Revision) -> Result<()> {
        self.remove_local(name, rev).await
    }

    async fn local_docs(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> Result<Page<StoredDocument>> {
        self.list_local(range, limit, page_token).await
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
        let tombstone = json!({ "fieldFilter": { "field": { "fieldPath": layout::DELETED }, "op": "EQUAL", "value": { "booleanValue": true } } });
        let (tombstones, _) = self.count(Some(tombstone), read_time.as_deref()).await?;
        Ok(Some(all.saturating_sub(tombstones)))
    }

    async fn feed_length(&self) -> Result<Option<u64>> {
        // One COUNT aggregation over the collection (every document's one entry, live or a
        // tombstone; chunks and local documents live in other collections), billed as one read
        // per 1,000 index entries; served again, for at most `count_max_age_ms` and until this
        // backend commits, only while its check holds (`count_check.rs`: one query reading the
        // window's documents, at least one read, and one document read).
        self.require_layout("the change feed").await?;
        let check = |window| self.count_fingerprint(window);
        self.counts.get_or_count(Counted::FeedEntries, self.feed_count_with_check(), check).await.map(Some)
    }

    async fn health(&self) -> Result<()> {
        let query =
            json!({ "structuredQuery": { "from": [{ "collectionId": self.client.collection() }], "limit": 1 } });
        match self
            .client
            .call(Method::POST, &self.client.query_url("runQuery"), Some(&query), Call::Read, "check the database")
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

    fn attachment_chunk_bytes(&self) -> usize {
        self.attachment_chunk_size()
    }

    async fn put_attachment_chunk(&self, blob: &str, index: u64, bytes: bytes::Bytes) -> Result<()> {
        self.put_chunk(blob, index, bytes).await
    }

    async fn put_small_attachments(&self, attachments: &[crate::backend::SmallAttachment]) -> Result<bool> {
        self.put_small(attachments).await.map(|()| true)
    }

    async fn get_attachment_chunk(&self, blob: &str, index: u64) -> Result<Option<bytes::Bytes>> {
        self.get_chunk(blob, index).await
    }

    async fn delete_attachment_blob(&self, blob: &str) -> Result<u64> {
        self.delete_blob(blob).await
    }

    async fn attachment_blobs(&self, limit: usize, page_token: Option<&str>) -> Result<Page<String>> {
        self.list_blobs(limit, page_token).await
    }
}
