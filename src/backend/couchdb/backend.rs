//! [`CouchDbBackend`]: the `DocumentBackend` over CouchDB's HTTP API.

use std::sync::RwLock;

use async_trait::async_trait;
use reqwest::{Method, StatusCode};
use serde_json::{json, Map, Value};

use super::codec::{to_couch_doc, NumberModel};
use super::config::CouchConfig;
use super::core::{CouchClient, Reply};
use super::counts::CountCache;
use super::error::from_status;
use super::live::LiveRevisions;
use crate::backend::{
    BulkWrite, ChangesPage, DesignRequest, DesignResponse, DocumentBackend, DocumentText, EraseOptions, IdRange,
    LayoutState, Page, Precondition, Projection, Query, ReplicatedOutcome, ReplicatedRevision, Revision, RevisionInfo,
    StoredDocument, UpgradePage,
};
use crate::error::{Error, ErrorKind, Result};
use crate::model::fields;

/// The Mango index the spec names.
pub const INDEX_NAME: &str = "idx-user-namespace";

/// Ids per `_all_docs` request of a batch read, and such requests in flight at once.
const GET_MANY_KEYS: usize = 200;
const GET_MANY_CONCURRENCY: usize = 4;
/// A batch read of at least this many ids in ascending order (a scan's batch, as `verify` and a
/// migration's read-back look up) reads their id range instead of the key list.
const RANGE_READ_MIN_IDS: usize = 100;
/// Rows a range read may hold per id asked before it stops and the key list is read instead.
const RANGE_READ_ROWS_PER_ID: usize = 2;

/// How often an unconditional write re-reads the revision after a conflict.
pub(super) const UNCONDITIONAL_WRITE_ATTEMPTS: usize = 10;

pub struct CouchDbBackend {
    pub(super) client: CouchClient,
    pub(super) config: CouchConfig,
    /// The design document holding `idx-user-namespace`, learned when the index is ensured, so
    /// `_find` can name it in `use_index`.
    index_ddoc: RwLock<Option<String>>,
    /// Revisions seen live, which a conditional write may name without a look (see [`LiveRevisions`]).
    live: LiveRevisions,
    /// Whether the server is pouchdb-server, asked on the first write or `all_docs` that needs
    /// to know: it stores every number as a double ([`NumberModel`]) and bounds id ranges
    /// differently ([`super::ids`]).
    is_pouchdb_server: tokio::sync::OnceCell<bool>,
    /// The document and design-document counts, remembered briefly (see [`super::counts`]).
    pub(super) counts: CountCache,
}

/// A `_find` page token. Real CouchDB pages with bookmarks; a server that returns none
/// (pouchdb-server) is paged with `skip` instead.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
enum FindToken {
    Bookmark(String),
    Skip(usize),
}

impl CouchDbBackend {
    /// Connects and checks the database, creating it when configured to. Nothing is written to
    /// an existing database here.
    pub async fn open(config: &CouchConfig) -> Result<Self> {
        let backend = Self::unchecked(config)?;
        backend.check_database().await?;
        Ok(backend)
    }

    /// The backend of a database known to exist (the catalog has just looked); no request.
    pub(super) fn unchecked(config: &CouchConfig) -> Result<Self> {
        Ok(CouchDbBackend {
            client: CouchClient::new(config)?,
            config: config.clone(),
            index_ddoc: RwLock::new(None),
            live: LiveRevisions::default(),
            is_pouchdb_server: tokio::sync::OnceCell::new(),
            counts: CountCache::new(config.count_max_age),
        })
    }

    async fn check_database(&self) -> Result<()> {
        let db = &self.config.database;
        let url = self.client.url(&[]);
        let reply = self.client.read(Method::GET, &url, &[], None, "open the database").await?;
        match reply.status {
            StatusCode::OK => Ok(()),
            StatusCode::NOT_FOUND if self.config.create => {
                let created = self.client.send(Method::PUT, &url, &[], None, "create the database").await?;
                match created.status {
                    // 412: someone else created it meanwhile.
                    StatusCode::CREATED | StatusCode::ACCEPTED | StatusCode::PRECONDITION_FAILED => {
                        tracing::info!(database = %db, "created CouchDB database");
                        Ok(())
                    }
                    status => Err(from_status(status, &created.body, "create the database")),
                }
            }
            StatusCode::NOT_FOUND => Err(Error::new(
                ErrorKind::Misconfigured,
                format!(
                    "CouchDB database {db:?} does not exist on {}; create it, or add ?create=true to the backend URL",
                    self.config.server
                ),
            )),
            status => Err(from_status(status, &reply.body, &format!("open database {db:?}"))),
        }
    }

    /// POSTs the spec's index definition; CouchDB answers `created` or `exists`.
    async fn ensure_index(&self, why: &str) -> Result<()> {
        let definition = json!({
            "index": { "fields": [fields::USER_ID, fields::NAMESPACE] },
            "name": INDEX_NAME,
            "type": "json"
        });
        let url = self.client.url(&["_index"]);
        // Creating an index is idempotent, so it is retried like a read. It may add a design
        // document.
        let reply = self.client.read(Method::POST, &url, &[], Some(&definition), "ensure the Mango index").await;
        self.counts.wrote_design();
        let reply = reply?;
        if !reply.status.is_success() {
            return Err(from_status(reply.status, &reply.body, &format!("ensure the Mango index {INDEX_NAME}")));
        }
        let result = reply.body.get("result").and_then(Value::as_str).unwrap_or("unknown");
        let ddoc = reply.body.get("id").and_then(Value::as_str).map(str::to_owned);
        tracing::info!(database = %self.config.database, index = INDEX_NAME, result, ddoc = ?ddoc, why, "ensured CouchDB index");
        if let Some(ddoc) = ddoc {
            *self.index_ddoc.write().unwrap_or_else(|e| e.into_inner()) = Some(ddoc);
        }
        Ok(())
    }

    /// Whether the design document the index was last ensured in still exists (`false` when no
    /// index has been ensured yet). Its id is the server's hash of the index definition, so the
    /// document being there means this index is.
    async fn index_design_doc_exists(&self) -> Result<bool> {
        let ddoc = self.index_ddoc.read().unwrap_or_else(|e| e.into_inner()).clone();
        let Some(name) = ddoc.as_deref().and_then(|id| id.strip_prefix("_design/")) else {
            return Ok(false);
        };
        let url = self.client.url(&["_design", name]);
        let head = self.client.read(Method::HEAD, &url, &[], None, "look up the Mango index").await?;
        Ok(head.status == StatusCode::OK)
    }

    /// Whether the server is pouchdb-server (its welcome names `express-pouchdb`), asked once.
    pub(super) async fn pouchdb_server(&self) -> Result<bool> {
        let answer = self
            .is_pouchdb_server
            .get_or_try_init(|| async {
                let root = self.config.server.as_str();
                let reply = self.client.read(Method::GET, root, &[], None, "identify the server").await?;
                Ok::<bool, crate::error::Error>(
                    reply.status == StatusCode::OK && reply.body.get("express-pouchdb").is_some(),
                )
            })
            .await?;
        Ok(*answer)
    }

    /// How the server stores numbers (asked once).
    pub(super) async fn number_model(&self) -> Result<NumberModel> {
        Ok(if self.pouchdb_server().await? { NumberModel::JsDoubles } else { NumberModel::Jiffy })
    }

    pub(super) fn document_url(&self, id: &str) -> String {
        self.client.url(&[id])
    }

    /// The current revision of `id`, or `None` if it does not exist (or was deleted).
    async fn current_revision(&self, id: &str) -> Result<Option<Revision>> {
        Ok(self.get(id).await?.map(|doc| doc.rev))
    }

    /// PUTs one document with the given `_rev` (or none, to create).
    async fn put_with_rev(&self, id: &str, body: &Map<String, Value>, rev: Option<&Revision>) -> Result<Revision> {
        let doc = to_couch_doc(id, body, rev, self.number_model().await?)?;
        let reply = self.client.send(Method::PUT, &self.document_url(id), &[], Some(&doc), "write a document").await?;
        match reply.status {
            // Apache CouchDB 3.4.3 answers a write carrying `_deleted: true` (a deletion keeping
            // fields in its tombstone) 200, pouchdb-server 201; every other write 201 (202 when
            // not yet on a quorum).
            StatusCode::OK | StatusCode::CREATED | StatusCode::ACCEPTED => {
                let rev = revision_of(&reply.body, "write a document")?;
                // A tombstone's revision is never remembered as live ([`LiveRevisions`]).
                if body.get("_deleted") != Some(&Value::Bool(true)) {
                    self.live.remember(id, &rev);
                }
                Ok(rev)
            }
            StatusCode::CONFLICT => Err(Error::conflict(format!("document {id:?} was changed by another writer"))),
            status => Err(from_status(status, &reply.body, &format!("write document {id:?}"))),
        }
    }

    /// Whether `id` is live, when `rev` is not already known to be a live revision of it: a
    /// `HEAD` answers 404 for a deleted (or missing) document, whose tombstone revision a write
    /// must not name (see [`LiveRevisions`]).
    async fn may_be_live_at(&self, id: &str, rev: &Revision) -> Result<bool> {
        if self.live.known(id, rev) {
            return Ok(true);
        }
        let head = self.client.read(Method::HEAD, &self.document_url(id), &[], None, "look up a document").await?;
        match head.status {
            StatusCode::OK => Ok(true),
            StatusCode::NOT_FOUND => Ok(false),
            status => Err(from_status(status, &head.body, &format!("look up document {id:?}"))),
        }
    }

    /// Revisions of many ids in one request (`_all_docs` with `keys`); deleted and missing ids
    /// have none.
    async fn current_revisions(&self, ids: &[&str]) -> Result<Vec<Option<Revision>>> {
        let url = self.client.url(&["_all_docs"]);
        let reply =
            self.client.read(Method::POST, &url, &[], Some(&json!({ "keys": ids })), "look up revisions").await?;
        if !reply.status.is_success() {
            return Err(from_status(reply.status, &reply.body, "look up revisions"));
        }
        let rows = reply.body.get("rows").and_then(Value::as_array).cloned().unwrap_or_default();
        Ok(ids
            .iter()
            .map(|id| {
                rows.iter()
                    .find(|row| row.get("id").and_then(Value::as_str) == Some(id))
                    .filter(|row| row.pointer("/value/deleted").and_then(Value::as_bool) != Some(true))
                    .and_then(|row| row.pointer("/value/rev").and_then(Value::as_str))
                    .map(|rev| Revision(rev.to_owned()))
            })
            .collect())
    }
}

impl CouchDbBackend {
    /// After a write to `id` by this process, whatever its outcome: the remembered counts are
    /// read again (both when `id` is a design document).
    fn wrote(&self, id: &str) {
        if is_design_doc(id) {
            self.counts.wrote_design();
        } else {
            self.counts.wrote_documents();
        }
    }

    async fn put_document(&self, id: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision> {
        match precondition {
            Precondition::MustNotExist => self.put_with_rev(id, body, None).await,
            Precondition::NeverWritten => Err(never_written_unchecked(id)),
            Precondition::MatchRevision(rev) => {
                if !self.may_be_live_at(id, &rev).await? {
                    return Err(Error::conflict(format!("document {id:?} is deleted, not at revision {rev}")));
                }
                self.put_with_rev(id, body, Some(&rev)).await
            }
            Precondition::None => {
                for _ in 0..UNCONDITIONAL_WRITE_ATTEMPTS {
                    let rev = self.current_revision(id).await?;
                    match self.put_with_rev(id, body, rev.as_ref()).await {
                        Err(e) if e.is_conflict() => continue,
                        other => return other,
                    }
                }
                Err(Error::conflict(format!("document {id:?} kept changing during an unconditional write")))
            }
        }
    }

    async fn delete_document(&self, id: &str, rev: &Revision) -> Result<Revision> {
        // CouchDB deletes a tombstone again when named by its own revision; here a deleted
        // document is not found.
        if !self.may_be_live_at(id, rev).await? {
            return Err(Error::not_found(format!("document {id:?} does not exist")));
        }
        let query = [("rev", rev.as_str().to_owned())];
        let reply = self.client.send(Method::DELETE, &self.document_url(id), &query, None, "delete a document").await?;
        match reply.status {
            StatusCode::OK | StatusCode::ACCEPTED => revision_of(&reply.body, "delete a document"),
            // A 409 can mean a newer revision or a newer tombstone (already deleted); a 404 can
            // mean missing or, on pouchdb-server, a stale revision. Look before choosing.
            StatusCode::CONFLICT | StatusCode::NOT_FOUND => match self.get(id).await? {
                Some(_) => Err(Error::conflict(format!("document {id:?} is no longer at revision {rev}"))),
                None => Err(Error::not_found(format!("document {id:?} does not exist"))),
            },
            status => Err(from_status(status, &reply.body, &format!("delete document {id:?}"))),
        }
    }

    /// The current documents of `keys` (distinct ids) in one `_all_docs` request with
    /// `include_docs`. CouchDB answers one row per key: the document, `value.deleted` with a null
    /// `doc` for a deleted one, or `error: "not_found"` for one that never existed.
    async fn read_keys(&self, keys: Vec<String>) -> Result<Vec<(String, StoredDocument)>> {
        const DOING: &str = "read documents in a batch";
        let url = self.client.url(&["_all_docs"]);
        let query = [("include_docs", "true".to_owned())];
        let reply = self.client.read(Method::POST, &url, &query, Some(&json!({ "keys": keys })), DOING).await?;
        if !reply.status.is_success() {
            return Err(from_status(reply.status, &reply.body, "read documents with _all_docs"));
        }
        let rows = take_array(reply.body, "rows", "_all_docs")?;
        let mut found = Vec::with_capacity(rows.len());
        for row in rows {
            let Value::Object(mut row) = row else { continue };
            match row.get("error").and_then(Value::as_str) {
                None => {}
                Some("not_found") => continue,
                Some(error) => {
                    let key = row.get("key").cloned().unwrap_or_default();
                    return Err(Error::new(
                        ErrorKind::Internal,
                        format!("CouchDB _all_docs answered {error} for {key}"),
                    ));
                }
            }
            if let Some(doc) = row.remove("doc").filter(|doc| !doc.is_null()) {
                let doc = from_couch_doc(doc, DOING)?;
                found.push((doc.id.clone(), doc));
            }
        }
        Ok(found)
    }

    /// The current documents of `keys` (distinct, in ascending byte order) by one `_all_docs`
    /// range read from the first to the last, which CouchDB answers from its id order rather than
    /// one lookup per key: what `verify` and a migration's read-back ask for are a scan's
    /// batches, whose ids are the documents of a span. The read is bounded
    /// ([`RANGE_READ_ROWS_PER_ID`] rows per key); keys it did not find (outside a range the
    /// server bounded otherwise, deleted, missing, or past the bound) are then read by key.
    async fn read_id_span(&self, keys: Vec<String>) -> Result<Vec<(String, StoredDocument)>> {
        const DOING: &str = "read documents by id range";
        let (Some(first), Some(last)) = (keys.first(), keys.last()) else { return Ok(Vec::new()) };
        let limit = keys.len() * RANGE_READ_ROWS_PER_ID + 10;
        let query = [
            ("include_docs", "true".to_owned()),
            ("startkey", json_key(first)),
            ("endkey", json_key(last)),
            ("inclusive_end", "true".to_owned()),
            ("limit", limit.to_string()),
        ];
        let ticket = self.counts.ticket();
        let reply = self.client.read(Method::GET, &self.client.url(&["_all_docs"]), &query, None, DOING).await?;
        if !reply.status.is_success() {
            return Err(from_status(reply.status, &reply.body, DOING));
        }
        if let Some(total) = reply.body.get("total_rows").and_then(Value::as_u64) {
            self.counts.remember_total(ticket, total);
        }
        let wanted: std::collections::HashSet<&str> = keys.iter().map(String::as_str).collect();
        let mut found = Vec::with_capacity(keys.len());
        for row in take_array(reply.body, "rows", "_all_docs")? {
            let Value::Object(mut row) = row else { continue };
            let listed = row.get("id").and_then(Value::as_str).is_some_and(|id| wanted.contains(id));
            if let Some(doc) = row.remove("doc").filter(|doc| listed && !doc.is_null()) {
                let doc = from_couch_doc(doc, DOING)?;
                found.push((doc.id.clone(), doc));
            }
        }
        if found.len() < keys.len() {
            let seen: std::collections::HashSet<&str> = found.iter().map(|(id, _)| id.as_str()).collect();
            let rest: Vec<String> = keys.iter().filter(|id| !seen.contains(id.as_str())).cloned().collect();
            found.extend(self.read_keys(rest).await?);
        }
        Ok(found)
    }

    /// `bulk_write` of writes to distinct ids: one `_bulk_docs` request.
    async fn write_distinct_ids(&self, writes: Vec<BulkWrite>) -> Result<Vec<Result<Revision>>> {
        if writes.is_empty() {
            return Ok(Vec::new());
        }
        let unconditional: Vec<&str> =
            writes.iter().filter(|w| w.precondition == Precondition::None).map(|w| w.id.as_str()).collect();
        let mut current = if unconditional.is_empty() {
            Vec::new()
        } else {
            unconditional.iter().copied().zip(self.current_revisions(&unconditional).await?).collect::<Vec<_>>()
        };
        // A document CouchDB cannot store exactly is refused on its own; the others are sent.
        let mut outcomes: Vec<Option<Result<Revision>>> = Vec::with_capacity(writes.len());
        let mut docs = Vec::with_capacity(writes.len());
        let numbers = self.number_model().await?;
        for write in &writes {
            let rev = match &write.precondition {
                Precondition::NeverWritten => {
                    outcomes.push(Some(Err(never_written_unchecked(&write.id))));
                    continue;
                }
                Precondition::MustNotExist => None,
                Precondition::MatchRevision(rev) => Some(rev.clone()),
                Precondition::None => {
                    current.iter_mut().find(|(id, _)| *id == write.id).and_then(|(_, rev)| rev.take())
                }
            };
            match to_couch_doc(&write.id, &write.body, rev.as_ref(), numbers) {
                Ok(doc) => {
                    docs.push(doc);
                    outcomes.push(None);
                }
                Err(refused) => outcomes.push(Some(Err(refused))),
            }
        }
        if docs.is_empty() {
            return Ok(outcomes.into_iter().flatten().collect());
        }
        let sent = docs.len();
        let url = self.client.url(&["_bulk_docs"]);
        let Reply { status, body } = self
            .client
            .send(Method::POST, &url, &[], Some(&json!({ "docs": docs })), "write documents in bulk")
            .await?;
        if !status.is_success() {
            return Err(from_status(status, &body, "write documents in bulk"));
        }
        let results = body.as_array().cloned().unwrap_or_default();
        if results.len() != sent {
            return Err(Error::new(
                ErrorKind::Internal,
                format!("CouchDB _bulk_docs answered {} results for {sent} documents", results.len()),
            ));
        }
        let mut results = results.into_iter();
        Ok(writes
            .iter()
            .zip(outcomes)
            .map(|(write, outcome)| match outcome {
                Some(refused) => refused,
                None => {
                    let result = bulk_result(&write.id, results.next().unwrap_or(Value::Null));
                    // A revision this process wrote is live: a later update naming it needs no look.
                    if let Ok(rev) = &result {
                        self.live.remember(&write.id, rev);
                    }
                    result
                }
            })
            .collect())
    }
}

/// The array `field` of a CouchDB answer to `endpoint` (`rows` of `_all_docs`, `results` of
/// `_changes`), moved out of it.
pub(super) fn take_array(body: Value, field: &str, endpoint: &str) -> Result<Vec<Value>> {
    match body {
        Value::Object(mut body) => match body.remove(field) {
            Some(Value::Array(items)) => Ok(items),
            _ => Err(Error::new(ErrorKind::Internal, format!("CouchDB {endpoint} answered without {field}"))),
        },
        _ => Err(Error::new(ErrorKind::Internal, format!("CouchDB {endpoint} answered with a non-object"))),
    }
}

/// A key of `_all_docs` (`startkey`, `endkey`, `keys`) as the JSON text CouchDB expects.
pub(super) fn json_key(id: &str) -> String {
    Value::String(id.to_owned()).to_string()
}

/// Splits a CouchDB document into id, revision and body.
pub(super) fn from_couch_doc(doc: Value, doing: &str) -> Result<StoredDocument> {
    let Value::Object(mut body) = doc else {
        return Err(Error::new(
            ErrorKind::Internal,
            format!("CouchDB returned a non-object document while trying to {doing}"),
        ));
    };
    // `shift_remove`: the members keep the order CouchDB answered them in (a plain `remove`
    // moves the last member, `_deleted` on a real CouchDB's tombstone, into the gap).
    let id = match body.shift_remove(fields::ID) {
        Some(Value::String(id)) => id,
        _ => {
            return Err(Error::new(
                ErrorKind::Internal,
                format!("CouchDB returned a document without _id while trying to {doing}"),
            ))
        }
    };
    let rev = match body.shift_remove(fields::REV) {
        Some(Value::String(rev)) => rev,
        _ => return Err(Error::new(ErrorKind::Internal, format!("CouchDB returned document {id:?} without _rev"))),
    };
    Ok(StoredDocument { id, rev: Revision(rev), body })
}

pub(super) fn revision_of(reply: &Value, doing: &str) -> Result<Revision> {
    reply.get("rev").and_then(Value::as_str).map(|rev| Revision(rev.to_owned())).ok_or_else(|| {
        Error::new(ErrorKind::Internal, format!("CouchDB did not return a revision while trying to {doing}"))
    })
}

/// One entry of a `_bulk_docs` answer.
fn bulk_result(id: &str, result: Value) -> Result<Revision> {
    match result.get("error").and_then(Value::as_str) {
        None => revision_of(&result, "write documents in bulk"),
        Some("conflict") => Err(Error::conflict(format!("document {id:?} conflicts with the stored one"))),
        Some(error) => {
            let reason = result.get("reason").and_then(Value::as_str).unwrap_or("");
            let kind = match error {
                "forbidden" | "unauthorized" => ErrorKind::Unauthorized,
                "too_large" | "document_too_large" => ErrorKind::TooLarge,
                "doc_validation" | "bad_request" => ErrorKind::InvalidInput,
                _ => ErrorKind::Internal,
            };
            Err(Error::new(kind, format!("CouchDB refused document {id:?}: {error}: {reason}")))
        }
    }
}

pub(super) fn is_design_doc(id: &str) -> bool {
    id.starts_with("_design/")
}

/// The answer to a [`Precondition::NeverWritten`] write: CouchDB re-creates a deleted document
/// on a create without `_rev`, so no request can refuse a tombstone; nothing is written, and the
/// caller writes the document as it finds it ([`DocumentBackend::checks_never_written`]).
fn never_written_unchecked(id: &str) -> Error {
    Error::conflict(format!(
        "document {id:?}: CouchDB cannot check that an id was never written (a create re-creates over a \
         tombstone); nothing was written"
    ))
}

#[async_trait]
impl DocumentBackend for CouchDbBackend {
    fn describe(&self) -> String {
        let CouchConfig { server, database, .. } = &self.config;
        format!(
            "couchdb+{}://{}{}/{database}",
            server.scheme(),
            server.host_str().unwrap_or(""),
            server.port().map(|p| format!(":{p}")).unwrap_or_default()
        )
    }

    fn url(&self) -> Option<crate::backend::BackendUrl> {
        Some(crate::backend::BackendUrl::CouchDb(self.config.clone()))
    }

    async fn get(&self, id: &str) -> Result<Option<StoredDocument>> {
        let reply = self.client.read(Method::GET, &self.document_url(id), &[], None, "read a document").await?;
        match reply.status {
            StatusCode::OK => {
                let doc = from_couch_doc(reply.body, "read a document")?;
                self.live.remember(id, &doc.rev);
                Ok(Some(doc))
            }
            // "missing" and "deleted" alike; a missing database is reported at startup.
            StatusCode::NOT_FOUND => Ok(None),
            status => Err(from_status(status, &reply.body, &format!("read document {id:?}"))),
        }
    }

    async fn get_many(&self, ids: &[String]) -> Result<Vec<Option<StoredDocument>>> {
        let ascending = ids.len() >= RANGE_READ_MIN_IDS && ids.windows(2).all(|w| w[0].as_bytes() < w[1].as_bytes());
        crate::backend::batched_get_many(ids, GET_MANY_KEYS, GET_MANY_CONCURRENCY, |ids| async move {
            if ascending {
                self.read_id_span(ids).await
            } else {
                self.read_keys(ids).await
            }
        })
        .await
    }

    async fn put(&self, id: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision> {
        let written = self.put_document(id, body, precondition).await;
        self.wrote(id);
        written
    }

    async fn delete(&self, id: &str, rev: &Revision) -> Result<Revision> {
        let deleted = self.delete_document(id, rev).await;
        self.wrote(id);
        deleted
    }

    async fn put_replicated(&self, id: &str, incoming: &ReplicatedRevision) -> Result<ReplicatedOutcome> {
        let written = self.put_replicated_revision(id, incoming).await;
        self.wrote(id);
        written
    }

    /// CouchDB keeps every document's tree itself.
    fn keeps_branches(&self) -> bool {
        true
    }

    /// CouchDB keeps the tree and holds it to its own bounds: `max_tree_bytes` is not asked of it.
    async fn put_branch(&self, id: &str, incoming: &ReplicatedRevision, _: usize) -> Result<ReplicatedOutcome> {
        let written = self.put_branch_revision(id, incoming).await;
        self.wrote(id);
        written
    }

    async fn revision_tree(&self, id: &str) -> Result<Option<crate::backend::rev_tree::RevTree>> {
        self.leaves_tree(id).await
    }

    async fn revision_trees(&self, ids: &[String]) -> Result<Vec<Option<crate::backend::rev_tree::RevTree>>> {
        self.leaves_trees(ids).await
    }

    async fn has_branches(&self, id: &str) -> Result<bool> {
        Ok(self.leaves_tree(id).await?.is_some_and(|tree| tree.leaves().len() > 1))
    }

    /// `erase_prefix` purges every revision of each id: no branch is left anywhere.
    async fn erase_branches(&self, _prefix: &str) -> Result<()> {
        Ok(())
    }

    async fn query(&self, query: &Query, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        let limit = limit.max(1);
        let mut selector = Map::new();
        selector.insert(fields::USER_ID.into(), query.user_id.clone().into());
        if let Some(namespace) = &query.namespace {
            selector.insert(fields::NAMESPACE.into(), namespace.clone().into());
        }
        let mut request = Map::new();
        request.insert("selector".into(), Value::Object(selector));
        if let Projection::Fields(wanted) = &query.projection {
            let mut names = vec![fields::ID, fields::REV];
            names.extend(wanted.iter().copied());
            request.insert("fields".into(), json!(names));
        }
        // Always send a limit: without one CouchDB stops at 25 documents.
        request.insert("limit".into(), limit.into());
        let ddoc = self.index_ddoc.read().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(ddoc) = ddoc {
            request.insert("use_index".into(), json!([ddoc, INDEX_NAME]));
        }
        let skip = match page_token.map(serde_json::from_str::<FindToken>) {
            None => 0,
            Some(Ok(FindToken::Bookmark(bookmark))) => {
                request.insert("bookmark".into(), bookmark.into());
                0
            }
            Some(Ok(FindToken::Skip(skip))) => {
                request.insert("skip".into(), skip.into());
                skip
            }
            Some(Err(_)) => return Err(Error::invalid("page token", "was not produced by this backend")),
        };
        let url = self.client.url(&["_find"]);
        let reply = self.client.read(Method::POST, &url, &[], Some(&Value::Object(request)), "query documents").await?;
        if !reply.status.is_success() {
            return Err(from_status(reply.status, &reply.body, "query documents with _find"));
        }
        if let Some(warning) = reply.body.get("warning").and_then(Value::as_str) {
            tracing::warn!(database = %self.config.database, warning, "CouchDB _find warning");
        }
        let Value::Object(mut body) = reply.body else {
            return Err(Error::new(ErrorKind::Internal, "CouchDB _find answered with a non-object"));
        };
        let docs = match body.remove("docs") {
            Some(Value::Array(docs)) => docs,
            _ => return Err(Error::new(ErrorKind::Internal, "CouchDB _find answered without docs")),
        };
        let count = docs.len();
        let items = docs
            .into_iter()
            .map(|doc| from_couch_doc(doc, "query documents"))
            .filter(|doc| !doc.as_ref().is_ok_and(|d| is_design_doc(&d.id)))
            .collect::<Result<Vec<_>>>()?;
        // A short page is the last one; a full page may be followed by more (or by the empty
        // page CouchDB ends with).
        let next = if count < limit {
            None
        } else {
            let token = match body.remove("bookmark") {
                Some(Value::String(bookmark)) => FindToken::Bookmark(bookmark),
                _ => FindToken::Skip(skip + count),
            };
            Some(
                serde_json::to_string(&token)
                    .map_err(|e| Error::new(ErrorKind::Internal, "encode page token").with_source(e))?,
            )
        };
        Ok(Page { items, next })
    }

    async fn ensure_standard_indexes(&self) -> Result<()> {
        self.ensure_index("startup").await
    }

    async fn ensure_namespace_indexed(&self, namespace: &str) -> Result<()> {
        // The one index covers every namespace, so a first write to a namespace only has to see
        // that its design document is still there (a HEAD), and recreates it when it is gone. A
        // POST `_index` here instead made pouchdb-server bring the whole view up to date with
        // every document written since it was last read (CouchDB builds lazily): the first
        // write to each new namespace, and every writer waiting on it, paid for indexing the
        // whole database's recent writes.
        if self.index_design_doc_exists().await? {
            return Ok(());
        }
        self.ensure_index(&format!("first write to namespace {namespace:?}")).await
    }

    async fn bulk_write(&self, writes: Vec<BulkWrite>) -> Result<Vec<Result<Revision>>> {
        // The revisions unconditional writes replace are read before the batch is sent, so a
        // second write to one id waits for the first.
        let design = writes.iter().any(|w| is_design_doc(&w.id));
        let written = crate::backend::bulk_write_in_id_rounds(writes, |round| self.write_distinct_ids(round)).await;
        self.wrote(if design { "_design/" } else { "" });
        written
    }

    async fn scan(&self, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        // Every data document in id order: `all_docs` over the whole range, whose token is the
        // last id returned, as this scan's always was (checkpoints of running migrations stay
        // valid). It also works around pouchdb-server's open-topped ranges, which left ids
        // starting at U+00FF or above out of a plain `_all_docs` read.
        self.all_docs_page(&IdRange::all(), limit, page_token).await
    }

    async fn revisions(&self, id: &str) -> Result<Option<RevisionInfo>> {
        self.revision_info(id).await
    }

    /// CouchDB keeps a deletion's fields in its tombstone itself: the tombstone's revision, then
    /// that revision read (`?rev=` answers a deleted revision with its fields).
    async fn get_deleted(&self, id: &str) -> Result<Option<StoredDocument>> {
        let Some(info) = self.revision_info(id).await?.filter(|info| info.deleted) else { return Ok(None) };
        let query = [("rev", info.rev.as_str().to_owned())];
        let doing = "read a tombstone";
        let reply = self.client.read(Method::GET, &self.document_url(id), &query, None, doing).await?;
        match reply.status {
            StatusCode::OK => {
                let mut doc = from_couch_doc(reply.body, doing)?;
                doc.body.shift_remove("_deleted");
                Ok(Some(doc))
            }
            // Purged or compacted away between the two reads.
            StatusCode::NOT_FOUND => Ok(None),
            status => Err(from_status(status, &reply.body, &format!("read the tombstone of {id:?}"))),
        }
    }

    async fn changes(&self, since: Option<&str>, limit: usize) -> Result<ChangesPage> {
        self.changes_page(since, limit).await
    }

    async fn change_position(&self) -> Result<String> {
        self.feed_position().await
    }

    fn change_feed_delay(&self) -> std::time::Duration {
        // `_changes` lists a write once CouchDB has acknowledged it.
        std::time::Duration::ZERO
    }

    async fn all_docs(&self, range: &IdRange, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        self.all_docs_page(range, limit, page_token).await
    }

    async fn all_docs_text(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> Result<Page<DocumentText>> {
        self.all_docs_text_page(range, limit, page_token).await
    }

    async fn erase_prefix(&self, prefix: &str) -> Result<u64> {
        let erased = self.purge_prefix(prefix).await;
        self.counts.wrote_design();
        erased
    }

    async fn erase_id(&self, id: &str, options: &EraseOptions) -> Result<bool> {
        let erased = self.purge_one_id(id, options).await;
        self.counts.wrote_design();
        erased
    }

    async fn get_local(&self, name: &str) -> Result<Option<StoredDocument>> {
        self.read_local(name).await
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

    /// A CouchDB database is used as the existing system left it: nothing to upgrade, and the
    /// existing system may keep writing to it.
    async fn layout(&self) -> Result<LayoutState> {
        Ok(LayoutState::Current)
    }

    async fn upgrade_page(&self, _page_token: Option<&str>, _limit: usize) -> Result<UpgradePage> {
        Ok(UpgradePage { examined: 0, upgraded: 0, next: None })
    }

    async fn finish_upgrade(&self) -> Result<()> {
        Ok(())
    }

    async fn design_document_count(&self) -> Result<Option<u64>> {
        if let Some(count) = self.counts.design() {
            return Ok(Some(count));
        }
        let ticket = self.counts.ticket();
        // Design document ids sort between "_design/" and "_design0" ('0' follows '/').
        let range = [("startkey", "\"_design/\"".to_owned()), ("endkey", "\"_design0\"".to_owned())];
        let url = self.client.url(&["_all_docs"]);
        let reply = self.client.read(Method::GET, &url, &range, None, "count design documents").await?;
        if !reply.status.is_success() {
            return Err(from_status(reply.status, &reply.body, "count design documents with _all_docs"));
        }
        if let Some(total) = reply.body.get("total_rows").and_then(Value::as_u64) {
            self.counts.remember_total(ticket, total);
        }
        let rows = reply.body.get("rows").and_then(Value::as_array).map_or(0, Vec::len) as u64;
        self.counts.remember_design(ticket, rows);
        Ok(Some(rows))
    }

    fn forwards_requests(&self) -> bool {
        true
    }

    async fn design_request(&self, request: DesignRequest) -> Result<Option<DesignResponse>> {
        let reads = matches!(request.method, Method::GET | Method::HEAD);
        let answer = self.pass_design_request(request).await.map(Some);
        if !reads {
            // The request was passed on: it may have written a design document (or through an
            // update function, any document).
            self.counts.wrote_design();
        }
        answer
    }

    async fn health(&self) -> Result<()> {
        let reply = self.client.read(Method::GET, &self.client.url(&[]), &[], None, "check the database").await?;
        if reply.status.is_success() {
            Ok(())
        } else {
            Err(from_status(reply.status, &reply.body, &format!("check database {:?}", self.config.database)))
        }
    }

    async fn approximate_count(&self) -> Result<Option<u64>> {
        self.exact_count().await
    }

    async fn exact_count(&self) -> Result<Option<u64>> {
        // `doc_count`: live documents, design documents included, deleted and `_local/` ones not;
        // the `total_rows` of every `_all_docs` answer is the same number, so the last one seen
        // serves for a while (see [`super::counts`]).
        if let Some(count) = self.counts.total() {
            return Ok(Some(count));
        }
        let ticket = self.counts.ticket();
        let reply = self.client.read(Method::GET, &self.client.url(&[]), &[], None, "count documents").await?;
        if !reply.status.is_success() {
            return Err(from_status(reply.status, &reply.body, "count documents"));
        }
        let count = reply.body.get("doc_count").and_then(Value::as_u64);
        if let Some(count) = count {
            self.counts.remember_total(ticket, count);
        }
        Ok(count)
    }
}
