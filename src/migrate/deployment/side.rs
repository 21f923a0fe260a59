//! One end of a deployment move: a backend's databases in this process ([`Databases`] over the
//! embedded store, DynamoDB or Firestore) or a CouchDB-protocol server over HTTP
//! ([`CouchClient`]). Both answer the same few questions of the replication protocol, in its
//! terms: list the databases, their settings, a page of a feed with every leaf, which leaves are
//! missing (`_revs_diff`), the leaves themselves with `_revisions` and inline attachments
//! (`_bulk_get`), and a replicated write (`_bulk_docs` with `new_edits: false`).
//!
//! A leaf travels as CouchDB shows it: `_id`, `_rev`, `_revisions`, `_deleted` for a deleted
//! leaf, the body, and `_attachments` with each attachment's bytes as base64 `data` (with its
//! `revpos`, `digest` and `content_type`) or, for a read without bodies, as stubs.
//!
//! The replicator ([`crate::replicator`]) runs its jobs over the same two kinds of end, with a
//! filtered feed page ([`Side::changes_filtered`]: on a local side `doc_ids`, a Mango selector or
//! a design document's filter function run here over each changed document's winner), a
//! document read ([`Side::get_doc`]) and the checkpoints' local documents ([`Side::get_local`],
//! [`Side::put_local`]).
//!
//! Attachments too large to travel inline go one at a time as streams
//! ([`Side::attachment`], [`Side::write_leaf_streamed`]): from a backend's attachment store or
//! `GET /{db}/{doc}/{name}?rev=`, into a backend's attachment store (then written as `follows`,
//! [`doc_attachments::prepare`]'s `followed` map) or a multipart `PUT ?new_edits=false`. Only a
//! chunk of each is in memory at a time (the backend's chunk size, or what the connection hands
//! over). Each stream is held to the length its stub says ([`exact_length`]); bytes stored whose
//! digest is not the stub's are logged (the read-back compares digests), but for an attachment
//! the source keeps compressed (`encoding`), whose digest is dropped (verify.rs).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use serde_json::{json, Map, Value};

use crate::backend::catalog::DbName;
use crate::backend::BackendUrl;
use crate::database::attachments::StoredBlob;
use crate::database::doc_attachments::{self, ATTACHMENTS, DEFAULT_CONTENT_TYPE};
use crate::database::document::{self, DocOptions};
use crate::database::{Database, Databases, DocState, ReadBefore, Write};
use crate::error::{Error, ErrorKind, Result};
use crate::replication_client::{self, AttachmentPart, ByteStream, ChangedDoc, CouchClient, FeedFilter, FeedPage};

/// Documents of one page made ready at once (their leaves checked, their attachments stored).
const WRITE_CONCURRENCY: usize = 16;
/// Documents written in one [`Database::write_many`] call: one batched read and one bulk write
/// of their records each.
const DOCUMENTS_PER_WRITE: usize = 100;
/// `write_many` calls of one page at once (the backend's own calls overlap inside each too).
const WRITES_AT_ONCE: usize = 4;
/// Attempts at storing a leaf's attachments against concurrent uploads of the same bytes.
const PREPARE_ATTEMPTS: u64 = 8;
/// Open databases a local side keeps (each is a file handle or a client).
const MAX_OPEN: usize = 64;

/// Documents' states as read, by id (`None`: read as absent).
pub type ReadStates = HashMap<String, Option<DocState>>;

/// The states a local side's last `missing` calls read, per database, newest page last.
pub type ReadForWrite = Arc<std::sync::Mutex<HashMap<String, VecDeque<ReadStates>>>>;

/// Pages of read states kept per database for the writes that follow: a copy fetches the next
/// page while it writes the ones before (`--pages-at-once` of them, at most
/// [`super::MAX_PAGES_AT_ONCE`]), so a later
/// page's states can arrive before an earlier page's write has taken its own (`missing` never
/// waits on the network when it assumes, so this is the usual order then). An older page's
/// states not taken by then are dropped: its write read its documents itself.
const PAGES_OF_STATES_KEPT: usize = super::MAX_PAGES_AT_ONCE + 1;

/// Keeps a page's read states for its write.
fn keep_states(read: &ReadForWrite, db: &str, states: ReadStates) {
    if let Ok(mut read) = read.lock() {
        let pages = read.entry(db.to_owned()).or_default();
        pages.push_back(states);
        while pages.len() > PAGES_OF_STATES_KEPT {
            pages.pop_front();
        }
    }
}

/// Takes the kept states of the documents `docs` name, the newest read of each.
fn take_states(read: &ReadForWrite, db: &str, docs: &[Map<String, Value>]) -> ReadStates {
    let Ok(mut read) = read.lock() else { return ReadStates::new() };
    let Some(pages) = read.get_mut(db) else { return ReadStates::new() };
    let mut taken = ReadStates::new();
    for id in docs.iter().filter_map(|doc| doc.get("_id").and_then(Value::as_str)) {
        if taken.contains_key(id) {
            continue;
        }
        if let Some(state) = pages.iter_mut().rev().find_map(|page| page.remove(id)) {
            taken.insert(id.to_owned(), state);
        }
    }
    pages.retain(|page| !page.is_empty());
    if pages.is_empty() {
        read.remove(db);
    }
    taken
}

/// A database's settings as moved: `_security`, and `_revs_limit` where the side knows it.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub security: Value,
    pub revs_limit: Option<u64>,
}

/// One end of a deployment move. Cheap to clone.
#[derive(Clone)]
pub enum Side {
    /// A backend's databases, opened in this process; `read` holds, per database, the states
    /// of the documents the last [`Side::missing`] calls found lacking leaves, for the writes of
    /// those leaves that follow ([`Database::write_many_over`]), so a page's documents are read
    /// once, not twice ([`PAGES_OF_STATES_KEPT`] pages per database at most).
    Local { databases: Arc<Databases>, name: String, read: ReadForWrite },
    /// A CouchDB-protocol server.
    Remote(CouchClient),
}

impl Side {
    /// The side a command-line text names: an `http(s)://` server URL, a `couchdb+http(s)://`
    /// backend URL (its server: the databases of a CouchDB backend are that server's own), or any
    /// other backend URL, whose databases are opened here.
    pub fn parse(text: &str, settings: &crate::config::Settings) -> Result<Self> {
        if text.starts_with("http://") || text.starts_with("https://") {
            return Ok(Side::Remote(CouchClient::new(text)?));
        }
        let url = settings.resolve_backend_url(text)?;
        if let BackendUrl::CouchDb(config) = &url {
            let mut server = config.server.clone();
            if let Some(user) = &config.user {
                let _ = server.set_username(user);
                let _ = server.set_password(config.password.as_deref());
            }
            return Ok(Side::Remote(CouchClient::new(server.as_str())?));
        }
        let name = url.to_string();
        // The same bound on attachments as the server over these databases keeps.
        let databases = Databases::from_url(Some(url), MAX_OPEN).with_attachment_bounds(
            settings.couchdb_attachment_limit(),
            std::time::Duration::from_secs(settings.couchdb_attachment_grace_secs),
        );
        Ok(Side::local(Arc::new(databases), name))
    }

    /// A side over `databases` in this process, named `name` in reports.
    pub fn local(databases: Arc<Databases>, name: impl Into<String>) -> Side {
        Side::Local { databases, name: name.into(), read: ReadForWrite::default() }
    }

    /// The side in reports and checkpoints (no credentials).
    pub fn name(&self) -> String {
        match self {
            Side::Local { name, .. } => name.clone(),
            Side::Remote(client) => client.describe(),
        }
    }

    /// Checks the side answers.
    pub async fn check(&self) -> Result<()> {
        match self {
            Side::Local { databases, .. } => databases.list().await.map(|_| ()),
            Side::Remote(client) => client.welcome().await.map(|_| ()),
        }
    }

    async fn open(databases: &Databases, db: &str) -> Result<Option<Arc<Database>>> {
        databases.open(&DbName::parse(db)?).await
    }

    async fn must_open(databases: &Databases, db: &str) -> Result<Arc<Database>> {
        Self::open(databases, db).await?.ok_or_else(|| Error::not_found(format!("database {db:?} does not exist")))
    }

    /// Every database's name.
    pub async fn list(&self) -> Result<Vec<String>> {
        match self {
            Side::Local { databases, .. } => {
                Ok(databases.list().await?.into_iter().map(|name| name.as_str().to_owned()).collect())
            }
            Side::Remote(client) => client.all_dbs().await,
        }
    }

    /// Creates the database unless it exists; `true` when this call created it.
    pub async fn ensure(&self, db: &str) -> Result<bool> {
        match self {
            Side::Local { databases, .. } => {
                let name = DbName::parse(db)?;
                if databases.open(&name).await?.is_some() {
                    return Ok(false);
                }
                match databases.create(&name).await {
                    Ok(_) => Ok(true),
                    Err(err) if err.kind() == ErrorKind::Conflict => Ok(false),
                    Err(err) => Err(err),
                }
            }
            Side::Remote(client) => client.create_db(db).await,
        }
    }

    /// Deletes the database; `false` when there was none.
    pub async fn delete(&self, db: &str) -> Result<bool> {
        match self {
            Side::Local { databases, .. } => databases.delete(&DbName::parse(db)?).await,
            Side::Remote(client) => client.delete_db(db).await,
        }
    }

    /// Whether the database exists.
    pub async fn exists(&self, db: &str) -> Result<bool> {
        match self {
            Side::Local { databases, .. } => Ok(Self::open(databases, db).await?.is_some()),
            Side::Remote(client) => Ok(client.db_info(db).await?.is_some()),
        }
    }

    /// About how many documents (deleted ones included where the side says) the feed holds, for
    /// progress; `None` when the side cannot tell cheaply.
    pub async fn estimate(&self, db: &str) -> Result<Option<u64>> {
        match self {
            Side::Local { databases, .. } => match Self::open(databases, db).await? {
                Some(database) => database.backend().approximate_count().await,
                None => Ok(None),
            },
            Side::Remote(client) => Ok(client.db_info(db).await?.map(|info| {
                info.get("doc_count").and_then(Value::as_u64).unwrap_or(0)
                    + info.get("doc_del_count").and_then(Value::as_u64).unwrap_or(0)
            })),
        }
    }

    pub async fn settings(&self, db: &str) -> Result<Settings> {
        match self {
            Side::Local { databases, .. } => {
                let settings = Self::must_open(databases, db).await?.settings().await?;
                Ok(Settings { security: settings.security, revs_limit: Some(settings.revs_limit as u64) })
            }
            Side::Remote(client) => {
                Ok(Settings { security: client.security(db).await?, revs_limit: client.revs_limit(db).await? })
            }
        }
    }

    /// Writes the settings; `_revs_limit` only where known and taken (pouchdb-server has none).
    pub async fn put_settings(&self, db: &str, settings: &Settings) -> Result<()> {
        match self {
            Side::Local { databases, .. } => {
                let database = Self::must_open(databases, db).await?;
                let security = settings.security.clone();
                let revs_limit = settings.revs_limit.and_then(|n| usize::try_from(n).ok()).filter(|n| *n > 0);
                database
                    .update_settings(|stored| {
                        stored.security = security.clone();
                        if let Some(limit) = revs_limit {
                            stored.revs_limit = limit;
                        }
                    })
                    .await
                    .map(|_| ())
            }
            Side::Remote(client) => {
                client.put_security(db, &settings.security).await?;
                if let Some(limit) = settings.revs_limit {
                    if !client.put_revs_limit(db, limit).await? {
                        tracing::warn!(database = db, "the target did not take _revs_limit; it keeps its own");
                    }
                }
                Ok(())
            }
        }
    }

    /// One page of the database's feed after `since` (`Value::Null`: from the start), each
    /// changed document with every leaf.
    pub async fn changes(&self, db: &str, since: &Value, limit: usize) -> Result<FeedPage> {
        match self {
            Side::Local { databases, .. } => {
                let database = Self::must_open(databases, db).await?;
                let since_token = match since {
                    Value::Null => None,
                    Value::String(text) => Some(text.clone()),
                    other => Some(other.to_string()),
                };
                let page = database.while_open(database.backend().changes(since_token.as_deref(), limit)).await?;
                let states = database.read_changes(&page.changes).await?;
                let mut docs = Vec::with_capacity(page.changes.len());
                for (change, state) in page.changes.iter().zip(states) {
                    let Some(state) = state else { continue };
                    let leaves = state.tree.leaves().iter().map(|leaf| leaf.path.leaf_rev()).collect();
                    docs.push(ChangedDoc { id: change.id.clone(), leaves });
                }
                let at_end = page.changes.is_empty() || page.pending == Some(0);
                Ok(FeedPage { docs, last_seq: Value::String(page.last_seq), at_end })
            }
            Side::Remote(client) => client.changes(db, since, limit).await,
        }
    }

    /// One page of the feed after `since` with only the changes `filter` keeps: a remote side's
    /// server filters it; a local side reads the page and filters it here, a design filter run
    /// by `js` (an error without one). `last_seq` is the page's end whatever was kept.
    pub async fn changes_filtered(
        &self,
        db: &str,
        since: &Value,
        limit: usize,
        filter: &FeedFilter,
        js: Option<&crate::js::JsEngine>,
    ) -> Result<FeedPage> {
        let databases = match self {
            Side::Remote(client) => return client.changes_filtered(db, since, limit, filter).await,
            Side::Local { databases, .. } => databases,
        };
        let mut page = self.changes(db, since, limit).await?;
        match filter {
            FeedFilter::All => {}
            FeedFilter::DocIds(ids) => page.docs.retain(|doc| ids.binary_search(&doc.id).is_ok()),
            FeedFilter::Selector(selector) => {
                let selector = crate::mango::selector::parse(selector)
                    .map_err(|err| Error::invalid("selector", err.to_string()))?;
                let winners = self.winners(databases, db, &page.docs).await?;
                let mut kept = winners.iter().map(|winner| {
                    winner
                        .as_ref()
                        .and_then(Value::as_object)
                        .is_some_and(|doc| crate::mango::eval::matches(&selector, doc))
                });
                page.docs.retain(|_| kept.next().unwrap_or(false));
            }
            FeedFilter::Design { ddoc, name, query_params } => {
                let js =
                    js.ok_or_else(|| Error::new(ErrorKind::Internal, "no JavaScript engine for a design filter"))?;
                let passed = self.design_filter(databases, db, &page.docs, (ddoc, name, query_params), js).await?;
                let mut kept = passed.into_iter();
                page.docs.retain(|_| kept.next().unwrap_or(false));
            }
        }
        Ok(page)
    }

    /// Each changed document's winner as CouchDB shows it (`None` for one gone since).
    async fn winners(&self, databases: &Databases, db: &str, docs: &[ChangedDoc]) -> Result<Vec<Option<Value>>> {
        let database = Self::must_open(databases, db).await?;
        let ids: Vec<String> = docs.iter().map(|doc| doc.id.clone()).collect();
        let states = database.read_many(&ids).await?;
        Ok(ids
            .iter()
            .zip(states)
            .map(|(id, state)| {
                let state = state?;
                let winner = state.tree.winner()?;
                Some(document::leaf_json(id, &state.tree, winner, DocOptions::default()))
            })
            .collect())
    }

    /// Which of `docs` pass the design document's filter function, run by `js` over their winners
    /// with CouchDB's `req` (the query parameters, a server admin's `userCtx`).
    async fn design_filter(
        &self,
        databases: &Databases,
        db: &str,
        docs: &[ChangedDoc],
        (ddoc, name, query_params): (&String, &String, &Map<String, Value>),
        js: &crate::js::JsEngine,
    ) -> Result<Vec<bool>> {
        let id = format!("_design/{ddoc}");
        let design =
            self.get_doc(db, &id).await?.ok_or_else(|| Error::not_found(format!("{id} is missing at the source")))?;
        if !design["filters"][name.as_str()].is_string() {
            return Err(Error::not_found(format!("missing json key: {name}")));
        }
        let winners = self.winners(databases, db, docs).await?;
        let present: Vec<Arc<Value>> = winners.iter().flatten().cloned().map(Arc::new).collect();
        if present.is_empty() {
            return Ok(vec![false; docs.len()]);
        }
        let rev = design["_rev"].as_str().unwrap_or_default().to_owned();
        let code = crate::js::DesignCode::new(db, id, rev, Arc::new(design));
        let req = json!({
            "method": "GET", "query": query_params, "headers": {}, "body": "undefined",
            "userCtx": { "db": db, "name": null, "roles": ["_admin"] }, "info": { "db_name": db },
        });
        let answers = js
            .filter(&code, name, present, &req)
            .await
            .map_err(|err| Error::new(ErrorKind::InvalidInput, format!("filter {ddoc}/{name} failed: {err}")))?;
        let mut answers = answers.into_iter();
        Ok(winners.iter().map(|winner| winner.is_some() && answers.next().unwrap_or(false)).collect())
    }

    /// A document's winner as CouchDB shows it (`GET /{db}/{id}`); `None` when missing or
    /// deleted.
    pub async fn get_doc(&self, db: &str, id: &str) -> Result<Option<Value>> {
        match self {
            Side::Local { databases, .. } => {
                let Some(database) = Self::open(databases, db).await? else { return Ok(None) };
                let Some(state) = database.read(id).await? else { return Ok(None) };
                let Some(winner) = state.tree.winner().filter(|leaf| !leaf.deleted) else { return Ok(None) };
                Ok(Some(document::leaf_json(id, &state.tree, winner, DocOptions::default())))
            }
            Side::Remote(client) => client.get_doc(db, id).await,
        }
    }

    /// The local document `_local/{name}` with its `_rev`; `None` when there is none.
    pub async fn get_local(&self, db: &str, name: &str) -> Result<Option<Map<String, Value>>> {
        match self {
            Side::Local { databases, .. } => {
                let database = Self::must_open(databases, db).await?;
                Ok(database.get_local(name).await?.map(|stored| {
                    let mut body = Map::with_capacity(stored.body.len() + 2);
                    body.insert("_id".into(), Value::from(stored.id));
                    body.insert("_rev".into(), Value::from(stored.rev.0));
                    body.extend(stored.body);
                    body
                }))
            }
            Side::Remote(client) => {
                Ok(client.get_doc(db, &format!("_local/{name}")).await?.and_then(|doc| match doc {
                    Value::Object(body) => Some(body),
                    _ => None,
                }))
            }
        }
    }

    /// Writes `_local/{name}` over the revision `rev` read (`None`: none), as CouchDB numbers
    /// local revisions (`0-N`); the new revision.
    pub async fn put_local(
        &self,
        db: &str,
        name: &str,
        rev: Option<&str>,
        body: &Map<String, Value>,
    ) -> Result<String> {
        let mut body = body.clone();
        body.shift_remove("_id");
        body.shift_remove("_rev");
        match self {
            Side::Local { databases, .. } => {
                let database = Self::must_open(databases, db).await?;
                let number =
                    rev.and_then(|rev| rev.strip_prefix("0-")).and_then(|n| n.parse::<u64>().ok()).unwrap_or(0);
                Ok(database.put_local(name, &body, number + 1).await?.0)
            }
            Side::Remote(client) => {
                if let Some(rev) = rev {
                    body.insert("_rev".into(), Value::from(rev));
                }
                client.put_doc(db, &format!("_local/{name}"), &Value::Object(body)).await
            }
        }
    }

    /// [`Side::missing`] of a database this move created and has not written yet: every leaf
    /// named, answered without reading (the target has none of them). The write that follows
    /// does not read these documents either ([`Database::write_many_over`] over states read as
    /// absent): each is created only if nothing was ever written under its id, so a document
    /// someone else wrote there meanwhile (another writer, an earlier page of this pass that
    /// held the same id) makes its creation fail, and that document is read and written again
    /// alone, as any write meeting another writer is. Over a server the leaves go in a
    /// `new_edits: false` `_bulk_docs`, which merges them into whatever is there.
    ///
    /// Why: into a backend whose every call is a network round trip (DynamoDB, Firestore), the
    /// two batched reads per 100 documents `missing` makes cost the target about a third of
    /// what writing them costs (issue 38: a move into the Firestore emulator ran at 0.6 of its
    /// raw bulk rate).
    pub fn assume_missing(&self, db: &str, wanted: &[(String, Vec<String>)]) -> Vec<(String, Vec<String>)> {
        let missing: Vec<(String, Vec<String>)> = wanted.iter().filter(|(_, revs)| !revs.is_empty()).cloned().collect();
        if let Side::Local { read, .. } = self {
            keep_states(read, db, missing.iter().map(|(id, _)| (id.clone(), None)).collect());
        }
        missing
    }

    /// Of the leaves named, those this side lacks (per document).
    pub async fn missing(&self, db: &str, wanted: &[(String, Vec<String>)]) -> Result<Vec<(String, Vec<String>)>> {
        match self {
            Side::Local { databases, read, .. } => {
                let Some(database) = Self::open(databases, db).await? else { return Ok(wanted.to_vec()) };
                let ids: Vec<String> = wanted.iter().map(|(id, _)| id.clone()).collect();
                let states = database.read_many(&ids).await?;
                let mut missing = Vec::new();
                let mut lacking_states = HashMap::new();
                for ((id, revs), state) in wanted.iter().zip(states) {
                    let lacking = match &state {
                        // A save a crash cut short: every leaf is sent again, and the write
                        // finishes the save (`Database::half_written`).
                        Some(state) if database.half_written(id, Some(state)).await? => revs.clone(),
                        Some(state) => state.tree.missing(revs).0,
                        None => revs.clone(),
                    };
                    if !lacking.is_empty() {
                        missing.push((id.clone(), lacking));
                        lacking_states.insert(id.clone(), state);
                    }
                }
                keep_states(read, db, lacking_states);
                Ok(missing)
            }
            Side::Remote(client) => client.revs_diff(db, wanted).await,
        }
    }

    /// The leaves named, as documents with `_revisions`; with `attachments`, every attachment's
    /// bytes inline, else stubs. A leaf this side does not have is left out.
    pub async fn read_leaves(
        &self,
        db: &str,
        wanted: &[(String, Vec<String>)],
        attachments: bool,
    ) -> Result<Vec<Map<String, Value>>> {
        match self {
            Side::Local { databases, .. } => {
                let Some(database) = Self::open(databases, db).await? else { return Ok(Vec::new()) };
                let ids: Vec<String> = wanted.iter().map(|(id, _)| id.clone()).collect();
                let states = database.read_many(&ids).await?;
                let options = DocOptions { revs: true, ..DocOptions::default() };
                let mut docs = Vec::new();
                for ((id, revs), state) in wanted.iter().zip(states) {
                    let Some(state) = state else { continue };
                    for rev in revs {
                        let Some(leaf) = state.tree.leaf(rev) else { continue };
                        let Value::Object(mut doc) = document::leaf_json(id, &state.tree, leaf, options) else {
                            continue;
                        };
                        if attachments {
                            inline_attachments(&database, &leaf.body, &mut doc).await?;
                        }
                        docs.push(doc);
                    }
                }
                Ok(docs)
            }
            Side::Remote(client) => client.bulk_get(db, wanted, attachments).await,
        }
    }

    /// Stores replicated leaves (`new_edits: false`, each with its `_revisions`); returns the
    /// leaves refused, as `{id, rev, error, reason}` rows.
    pub async fn write_leaves(&self, db: &str, docs: Vec<Map<String, Value>>) -> Result<Vec<Value>> {
        self.page_target(db).write_leaves(docs).await
    }

    /// Database `db` of this side as the target of one page's writes ([`PageTarget`]).
    pub fn page_target<'a>(&'a self, db: &'a str) -> PageTarget<'a> {
        PageTarget { side: self, db, database: tokio::sync::OnceCell::new(), revs_limit: tokio::sync::OnceCell::new() }
    }

    /// The bytes of attachment `name` of leaf `rev` of document `id`, streamed: from the
    /// attachment store a chunk at a time, or from the server as they arrive. `NotFound` when the
    /// side has no such leaf or attachment.
    pub async fn attachment(&self, db: &str, id: &str, rev: &str, name: &str) -> Result<ByteStream> {
        match self {
            Side::Local { databases, .. } => {
                let database = Self::must_open(databases, db).await?;
                let states = database.read_many(&[id.to_owned()]).await?;
                let gone = || Error::not_found(format!("{id} {rev}: no attachment {name} at the source"));
                let Some(Some(state)) = states.into_iter().next() else { return Err(gone()) };
                let Some(leaf) = state.tree.leaf(rev) else { return Err(gone()) };
                let Some(kept) = doc_attachments::kept(&leaf.body, name) else { return Err(gone()) };
                database.attachments().read(&kept.sha256, None).await
            }
            Side::Remote(client) => client.attachment(db, id, rev, name).await,
        }
    }

    /// [`PageTarget::write_leaf_streamed`] on a page of its own.
    pub async fn write_leaf_streamed(
        &self,
        db: &str,
        leaf: Map<String, Value>,
        source: &Side,
        source_db: &str,
    ) -> Result<Vec<Value>> {
        self.page_target(db).write_leaf_streamed(leaf, source, source_db).await
    }
}

/// One database of a side as the target of one page's writes (its leaves without attachments,
/// its inline groups, its streamed leaves: [`super::write_page`]): on a local side the database
/// is opened once for all of them, at the first write, and its `_revs_limit` read once, at the
/// first write with something to write, where each write opened it (a read of the catalog's
/// marker of the database on DynamoDB and Firestore) and read the limit itself (issue 38).
///
/// Why the open can be shared: a page is one request of the move, as a `_bulk_docs` is one
/// request, whose writes all go to the database it opened. A database deleted (or deleted and
/// created again) at the target by another process while a page is written is seen at the next
/// page's open, which fails the move's copy of it (`NotFound`), as it did at the next write
/// before; the page's writes after the deletion land in the handle opened, as the writes of one
/// `_bulk_docs` under way during a deletion do, and so does every write already under way when a
/// database is deleted. The limit: docs/migration.md, "Moving a whole deployment" (one read per
/// page, issue 36's rule per request).
pub struct PageTarget<'a> {
    side: &'a Side,
    db: &'a str,
    database: tokio::sync::OnceCell<Arc<Database>>,
    revs_limit: tokio::sync::OnceCell<usize>,
}

impl PageTarget<'_> {
    /// The database, opened at the first call (`NotFound` when it does not exist).
    async fn database(&self, databases: &Databases) -> Result<&Arc<Database>> {
        self.database.get_or_try_init(|| Side::must_open(databases, self.db)).await
    }

    /// Stores replicated leaves (`new_edits: false`, each with its `_revisions`); returns the
    /// leaves refused, as `{id, rev, error, reason}` rows.
    pub async fn write_leaves(&self, docs: Vec<Map<String, Value>>) -> Result<Vec<Value>> {
        let db = self.db;
        match self.side {
            Side::Local { databases, read, .. } => {
                let database = self.database(databases).await?;
                let read = take_states(read, db, &docs);
                let docs = docs.into_iter().map(|doc| (doc, HashMap::new())).collect();
                write_local(database, docs, read, &self.revs_limit).await
            }
            Side::Remote(client) => client.bulk_docs_replicated(db, docs).await,
        }
    }

    /// Stores one replicated leaf read as stubs (`new_edits: false`, with its `_revisions`), its
    /// attachments' bytes streamed from `source` one attachment at a time; an attachment with
    /// inline `data` travels as it is. Returns the refusal rows, as [`Side::write_leaves`]: an
    /// attachment past the target's largest (`couchdb_max_attachment_bytes`, or the server's
    /// 413), one the source no longer has, or bytes not as long as the stub says refuse the
    /// leaf, naming the attachment; the move goes on. The source's database is `source_db` (a
    /// deployment move's is `db` itself; a replication's may be named otherwise).
    pub async fn write_leaf_streamed(
        &self,
        leaf: Map<String, Value>,
        source: &Side,
        source_db: &str,
    ) -> Result<Vec<Value>> {
        let db = self.db;
        let id = leaf.get("_id").and_then(Value::as_str).unwrap_or_default().to_owned();
        let rev = leaf.get("_rev").and_then(Value::as_str).unwrap_or_default().to_owned();
        let refused =
            |error: &str, reason: String| vec![json!({ "id": id, "rev": rev, "error": error, "reason": reason })];
        let mut doc = leaf;
        let mut parts = Vec::new();
        if let Some(Value::Object(attachments)) = doc.get_mut(ATTACHMENTS) {
            for (name, attachment) in attachments.iter_mut() {
                let Value::Object(fields) = attachment else { continue };
                if fields.contains_key("data") {
                    continue;
                }
                let Some(length) = fields.get("length").and_then(Value::as_u64) else {
                    return Ok(refused("attachment", format!("attachment {name} has no length at the source")));
                };
                let content_type =
                    fields.get("content_type").and_then(Value::as_str).unwrap_or(DEFAULT_CONTENT_TYPE).to_owned();
                fields.remove("stub");
                // The bytes come as they are (no `Accept-Encoding` asked for them), never encoded.
                // A source that keeps them compressed gives the MD5 of the compressed bytes as the
                // digest (Apache CouchDB's `compressible_types`): the target would check the
                // bytes against it and refuse them, so it computes its own (verify.rs compares
                // such attachments by their bytes).
                if fields.remove("encoding").is_some() {
                    fields.remove("digest");
                }
                fields.remove("encoded_length");
                fields.insert("follows".into(), Value::Bool(true));
                parts.push(AttachmentPart { name: name.clone(), content_type, length });
            }
        }
        let digests: HashMap<String, String> = doc
            .get(ATTACHMENTS)
            .and_then(Value::as_object)
            .map(|attachments| {
                attachments
                    .iter()
                    .filter_map(|(name, a)| Some((name.clone(), a.get("digest")?.as_str()?.to_owned())))
                    .collect()
            })
            .unwrap_or_default();
        match self.side {
            Side::Local { databases, .. } => {
                let database = self.database(databases).await?;
                let max = database.max_attachment_bytes();
                let mut followed: HashMap<String, StoredBlob> = HashMap::with_capacity(parts.len());
                for part in parts {
                    let name = &part.name;
                    if part.length > max {
                        return Ok(refused("attachment_too_large", too_large_reason(name, part.length, max)));
                    }
                    let bytes = match source.attachment(source_db, &id, &rev, name).await {
                        Ok(bytes) => bytes,
                        Err(err) if err.kind() == ErrorKind::NotFound => {
                            return Ok(refused("not_found", err.message().to_owned()));
                        }
                        Err(err) => return Err(err),
                    };
                    let stored = match database.attachments().write(exact_length(bytes, &part), max).await {
                        Ok(stored) => stored,
                        Err(err) if err.kind() == ErrorKind::TooLarge => {
                            return Ok(refused("attachment_too_large", too_large_reason(name, part.length, max)));
                        }
                        Err(err) if err.kind() == ErrorKind::Corrupt => {
                            return Ok(refused("attachment", err.message().to_owned()));
                        }
                        Err(err) => return Err(err),
                    };
                    // A source that keeps an attachment compressed shows it with `encoding` (its
                    // digest then dropped above). Any other digest the bytes do not have is
                    // logged; the leaf is written as the inline path writes it, and the
                    // read-back names it.
                    if let Some(digest) = digests.get(name).filter(|digest| **digest != stored.digest) {
                        tracing::warn!(
                            database = db, id = %id, rev = %rev, attachment = %name, source = %digest,
                            stored = %stored.digest, "the attachment's bytes do not have the digest the source gives"
                        );
                    }
                    followed.insert(part.name, stored);
                }
                write_local(database, vec![(doc, followed)], HashMap::new(), &self.revs_limit).await
            }
            Side::Remote(client) => {
                if parts.is_empty() {
                    return client.bulk_docs_replicated(db, vec![doc]).await;
                }
                let (source, db_name, doc_id, doc_rev) =
                    (source.clone(), source_db.to_owned(), id.clone(), rev.clone());
                let open = move |part: AttachmentPart| {
                    let (source, db_name, doc_id, doc_rev) =
                        (source.clone(), db_name.clone(), doc_id.clone(), doc_rev.clone());
                    async move {
                        let bytes = source.attachment(&db_name, &doc_id, &doc_rev, &part.name).await?;
                        Ok(exact_length(bytes, &part))
                    }
                };
                match client.put_replicated_multipart(db, &doc, &parts, open).await {
                    Ok(refusal) => Ok(refusal.into_iter().collect()),
                    Err(err) if err.kind() == ErrorKind::NotFound => Ok(refused("not_found", err.message().to_owned())),
                    Err(err) if err.kind() == ErrorKind::Corrupt => Ok(refused("attachment", err.message().to_owned())),
                    Err(err) => Err(err),
                }
            }
        }
    }
}

/// Whether a leaf read as stubs can have its attachments streamed to this kind of target:
/// every name must reach a pouchdb-server intact as a part's filename
/// ([`replication_client::part_name_survives`]). A leaf that cannot travels inline.
pub fn can_stream(leaf: &Map<String, Value>) -> bool {
    leaf.get(ATTACHMENTS)
        .and_then(Value::as_object)
        .is_none_or(|attachments| attachments.keys().all(|name| replication_client::part_name_survives(name)))
}

fn too_large_reason(name: &str, length: u64, max: u64) -> String {
    format!("attachment {name} holds {length} bytes, more than the target takes (couchdb_max_attachment_bytes {max})")
}

/// `bytes` held to the `length` the stub says: an error item as soon as more come, or at the
/// end when fewer came (a source that changed or cut off), so nothing short or long is stored.
pub fn exact_length(bytes: ByteStream, part: &AttachmentPart) -> ByteStream {
    use std::sync::atomic::{AtomicU64, Ordering};
    let (expected, name) = (part.length, part.name.clone());
    let seen = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&seen);
    let over = name.clone();
    let counted = bytes.map(move |item: Result<Bytes>| {
        let chunk = item?;
        let so_far = counter.fetch_add(chunk.len() as u64, Ordering::Relaxed) + chunk.len() as u64;
        if so_far > expected {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!("attachment {over}: the source sent more than the {expected} bytes its stub says"),
            ));
        }
        Ok(chunk)
    });
    // Once the bytes are done, one more item, an error, when they came short.
    let short = futures::stream::once(async move {
        let got = seen.load(Ordering::Relaxed);
        (got < expected).then(|| {
            Err(Error::new(
                ErrorKind::Corrupt,
                format!("attachment {name}: the source sent {got} bytes, its stub says {expected}"),
            ))
        })
    })
    .filter_map(|item| async move { item });
    counted.chain(short).boxed()
}

/// A replicated leaf with the attachments already stored for its `follows` entries, by name.
type FollowedLeaf = (Map<String, Value>, HashMap<String, StoredBlob>);

/// Replicated leaves written to a local database, each with the attachments already stored for
/// its `follows` entries; the refusal rows.
async fn write_local(
    database: &Arc<Database>,
    mut docs: Vec<(Map<String, Value>, HashMap<String, StoredBlob>)>,
    mut read: ReadStates,
    revs_limit: &tokio::sync::OnceCell<usize>,
) -> Result<Vec<Value>> {
    type Leaf = (Map<String, Value>, HashMap<String, StoredBlob>);
    store_small_attachments(database, &mut docs).await?;
    let mut groups: Vec<(String, Vec<Leaf>)> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    for (doc, followed) in docs {
        let id = doc.get("_id").and_then(Value::as_str).unwrap_or_default().to_owned();
        match index.get(&id) {
            Some(&at) => groups[at].1.push((doc, followed)),
            None => {
                index.insert(id.clone(), groups.len());
                groups.push((id, vec![(doc, followed)]));
            }
        }
    }
    let database = &**database;
    let prepared: Vec<Prepared> = futures::stream::iter(groups)
        .map(|(id, docs)| async move { prepare_group(database, id, docs).await })
        .buffered(WRITE_CONCURRENCY)
        .try_collect()
        .await?;
    let chunks: Vec<(Vec<Prepared>, ReadStates)> = chunked(prepared, DOCUMENTS_PER_WRITE)
        .into_iter()
        .map(|chunk| {
            let states = chunk.iter().filter_map(|p| Some((p.id.clone(), read.remove(&p.id)?))).collect();
            (chunk, states)
        })
        .collect();
    // `_revs_limit` read once for the whole page (its plain leaves, its groups of leaves with
    // attachments: [`PageTarget`]), not once per call or chunk: the page is one request of the
    // move, and CouchDB's `_bulk_docs` reads the limit once per request too
    // ([`ReadBefore::revs_limit`]). On a backend several processes share, a limit set elsewhere
    // meanwhile holds from the next page on. Not read when nothing is left to write.
    let revs_limit = match chunks.iter().any(|(chunk, _)| chunk.iter().any(|p| !p.writes.is_empty())) {
        true => Some(*revs_limit.get_or_try_init(|| database.revs_limit()).await?),
        false => None,
    };
    let failures: Vec<Vec<Value>> = futures::stream::iter(chunks)
        .map(|(chunk, states)| async move { write_chunk(database, chunk, ReadBefore { states, revs_limit }).await })
        .buffer_unordered(WRITES_AT_ONCE)
        .try_collect()
        .await?;
    Ok(failures.into_iter().flatten().collect())
}

/// Stores the bytes of the leaves' inline attachments that fit in one chunk of the target's
/// all at once ([`AttachmentStore::write_small_many`]: on Firestore one commit with their
/// manifests, where each was a commit of its chunk and one of its manifest), and leaves each as
/// `follows` with its stored bytes in the leaf's map, as a streamed attachment is
/// ([`doc_attachments::prepare`] takes them from there). Done before any of the leaves is
/// written, so every document still comes after the manifests and chunks it names
/// (docs/attachments.md). An entry this cannot take (not base64, a reserved name, past the
/// target's bound, a leaf whose id is refused) is left as it came, for `prepare` to refuse or
/// store as before.
///
/// [`AttachmentStore::write_small_many`]: crate::database::attachments::AttachmentStore::write_small_many
async fn store_small_attachments(database: &Database, docs: &mut [FollowedLeaf]) -> Result<()> {
    use base64::Engine as _;
    let store = database.attachments();
    let max = database.max_attachment_bytes();
    let mut taken: Vec<(usize, String)> = Vec::new();
    let mut items: Vec<Bytes> = Vec::new();
    for (at, (doc, followed)) in docs.iter().enumerate() {
        let id = doc.get("_id").and_then(Value::as_str).unwrap_or_default();
        if document::check_id(id).is_err() {
            continue;
        }
        let Some(Value::Object(attachments)) = doc.get(ATTACHMENTS) else { continue };
        for (name, attachment) in attachments {
            let Some(Value::String(data)) = attachment.get("data") else { continue };
            let flagged = |field: &str| attachment.get(field) == Some(&Value::Bool(true));
            if name.starts_with('_') || flagged("stub") || flagged("follows") || followed.contains_key(name) {
                continue;
            }
            let Ok(bytes) = base64::engine::general_purpose::STANDARD.decode(data.as_bytes()) else { continue };
            if bytes.len() as u64 > max || !store.fits_one_chunk(bytes.len()) {
                continue;
            }
            taken.push((at, name.clone()));
            items.push(Bytes::from(bytes));
        }
    }
    if items.is_empty() {
        return Ok(());
    }
    let stored = store.write_small_many(&items, max).await?;
    for ((at, name), blob) in taken.into_iter().zip(stored) {
        let (doc, followed) = &mut docs[at];
        if let Some(Value::Object(fields)) = doc.get_mut(ATTACHMENTS).and_then(|a| a.get_mut(&name)) {
            fields.remove("data");
            fields.insert("follows".into(), Value::Bool(true));
            followed.insert(name, blob);
        }
    }
    Ok(())
}

/// One document's leaves made ready to write: the writes, the revision each is of, and the
/// rows of the leaves refused before the write.
struct Prepared {
    id: String,
    writes: Vec<Write>,
    revs: Vec<String>,
    failures: Vec<Value>,
}

/// The leaves of one document checked and their attachments stored. A leaf refused here (a
/// malformed document) is a failure row; a failure of the store stops the move.
async fn prepare_group(
    database: &Database,
    id: String,
    docs: Vec<(Map<String, Value>, HashMap<String, StoredBlob>)>,
) -> Result<Prepared> {
    let mut failures = Vec::new();
    let mut writes = Vec::with_capacity(docs.len());
    let mut revs = Vec::with_capacity(docs.len());
    for (doc, followed) in docs {
        let rev = doc.get("_rev").and_then(Value::as_str).unwrap_or("").to_owned();
        let refused = |error: &str, reason: String| json!({ "id": id, "rev": rev, "error": error, "reason": reason });
        if let Err(refusal) = document::check_id(&id) {
            failures.push(refused(refusal.error, refusal.reason));
            continue;
        }
        let mut parsed = match document::parse(doc) {
            Ok(parsed) => parsed,
            Err(refusal) => {
                failures.push(refused(refusal.error, refusal.reason));
                continue;
            }
        };
        let path = match document::replicated_path(&parsed) {
            Ok(path) => path,
            Err(refusal) => {
                failures.push(refused(refusal.error, refusal.reason));
                continue;
            }
        };
        if let Err(err) = prepare_attachments(database, &mut parsed.body, &followed).await {
            if matches!(err.kind(), ErrorKind::InvalidInput | ErrorKind::TooLarge) {
                failures.push(refused("attachment", err.message().to_owned()));
                continue;
            }
            return Err(err);
        }
        writes.push(Write::Replicated { path, deleted: parsed.deleted, body: parsed.body });
        revs.push(rev);
    }
    Ok(Prepared { id, writes, revs, failures })
}

/// `items` in order, in chunks of at most `size`.
fn chunked<T>(items: Vec<T>, size: usize) -> Vec<Vec<T>> {
    let mut chunks = Vec::with_capacity(items.len().div_ceil(size.max(1)));
    let mut items = items.into_iter().peekable();
    while items.peek().is_some() {
        chunks.push(items.by_ref().take(size.max(1)).collect());
    }
    chunks
}

/// Many documents' leaves written at once, each document's in one write of its tree
/// ([`Database::write_many`]); returns the failure rows. An error of a document's write itself
/// stops the move (the backend failed, and retrying the page is the safe course).
async fn write_chunk(database: &Database, chunk: Vec<Prepared>, before: ReadBefore) -> Result<Vec<Value>> {
    let mut failures = Vec::new();
    let mut documents = Vec::with_capacity(chunk.len());
    let mut revs = Vec::with_capacity(chunk.len());
    for prepared in chunk {
        failures.extend(prepared.failures);
        if !prepared.writes.is_empty() {
            revs.push((prepared.id.clone(), prepared.revs));
            documents.push((prepared.id, prepared.writes));
        }
    }
    if documents.is_empty() {
        return Ok(failures);
    }
    let answers = database.write_many_over(&documents, before).await?;
    for (answers, (id, revs)) in answers.into_iter().zip(revs) {
        for (answer, rev) in answers?.into_iter().zip(revs) {
            if let Err(err) = answer {
                failures.push(json!({ "id": id, "rev": rev, "error": err.kind().as_str(), "reason": err.message() }));
            }
        }
    }
    Ok(failures)
}

/// Stores a leaf's inline attachments ([`doc_attachments::prepare`]). Bytes are
/// content-addressed, so leaves written at once that carry the same attachment (branches of one
/// document, copies across documents) upload the same blob concurrently, and the store answers
/// all but one with a conflict: those are tried again (the blob is then found stored).
async fn prepare_attachments(
    database: &Database,
    body: &mut Map<String, Value>,
    followed: &HashMap<String, StoredBlob>,
) -> Result<()> {
    let mut attempt = 0u64;
    loop {
        let mut prepared = body.clone();
        match doc_attachments::prepare(database.attachments(), database.max_attachment_bytes(), &mut prepared, followed)
            .await
        {
            Ok(()) => {
                *body = prepared;
                return Ok(());
            }
            Err(err) if err.kind() == ErrorKind::Conflict && attempt < PREPARE_ATTEMPTS => {
                attempt += 1;
                tokio::time::sleep(std::time::Duration::from_millis(10 * attempt)).await;
            }
            Err(err) => return Err(err),
        }
    }
}

/// Puts the bytes of every attachment the leaf keeps into `doc` (the leaf as shown) as base64.
async fn inline_attachments(
    database: &Database,
    body: &Map<String, Value>,
    doc: &mut Map<String, Value>,
) -> Result<()> {
    let Some(Value::Object(attachments)) = body.get(ATTACHMENTS) else { return Ok(()) };
    let mut shown = Map::with_capacity(attachments.len());
    for (name, attachment) in attachments {
        let value = match doc_attachments::kept(body, name) {
            Some(kept) => {
                let chunks: Vec<bytes::Bytes> =
                    database.attachments().read(&kept.sha256, None).await?.try_collect().await?;
                let bytes = chunks.concat();
                if bytes.len() as u64 != kept.length {
                    return Err(Error::new(
                        ErrorKind::Corrupt,
                        format!("attachment {name} of a document holds {} bytes, not {}", bytes.len(), kept.length),
                    ));
                }
                doc_attachments::shown_inline(&kept, &bytes)
            }
            None => doc_attachments::shown_stub(attachment),
        };
        shown.insert(name.clone(), value);
    }
    doc.insert(ATTACHMENTS.into(), Value::Object(shown));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collected(chunks: &[&'static [u8]], length: u64) -> Vec<Result<usize>> {
        let part = AttachmentPart { name: "a.bin".into(), content_type: DEFAULT_CONTENT_TYPE.into(), length };
        let chunks: Vec<Result<Bytes>> = chunks.iter().map(|c| Ok(Bytes::from_static(c))).collect();
        let source = futures::stream::iter(chunks).boxed();
        futures::executor::block_on(exact_length(source, &part).map(|item| item.map(|b| b.len())).collect())
    }

    /// A page's write finds its states after the next page's were kept (the copy fetches ahead);
    /// a page older than the kept ones is dropped, and a database's entry goes once taken.
    #[test]
    fn a_page_s_states_survive_the_next_page_s_fetch() {
        let read = ReadForWrite::default();
        let page = |ids: &[&str]| -> ReadStates { ids.iter().map(|id| (id.to_string(), None)).collect() };
        let docs = |ids: &[&str]| -> Vec<Map<String, Value>> {
            ids.iter().map(|id| serde_json::json!({ "_id": id }).as_object().cloned().unwrap()).collect()
        };
        keep_states(&read, "db", page(&["a", "b"]));
        keep_states(&read, "db", page(&["c"]));
        assert_eq!(
            take_states(&read, "db", &docs(&["a", "b"])).len(),
            2,
            "the first page's states, after the second's"
        );
        assert_eq!(take_states(&read, "db", &docs(&["a"])).len(), 0, "taken once");
        let later: Vec<String> = (0..PAGES_OF_STATES_KEPT).map(|n| format!("p{n}")).collect();
        let later: Vec<&str> = later.iter().map(String::as_str).collect();
        for id in &later {
            keep_states(&read, "db", page(&[id]));
        }
        assert_eq!(take_states(&read, "db", &docs(&["c"])).len(), 0, "older than the pages kept");
        assert_eq!(take_states(&read, "db", &docs(&later)).len(), PAGES_OF_STATES_KEPT);
        assert!(read.lock().unwrap().is_empty(), "nothing left behind");
    }

    /// Bytes pass as they come when as long as the stub says; more or fewer end in an error.
    #[test]
    fn streams_are_held_to_the_stubs_length() {
        let exact = collected(&[b"abc", b"de"], 5);
        assert_eq!(exact.iter().map(|r| *r.as_ref().unwrap()).collect::<Vec<_>>(), vec![3, 2]);
        let long = collected(&[b"abc", b"def"], 5);
        assert!(long[1].as_ref().is_err_and(|e| e.kind() == ErrorKind::Corrupt));
        let short = collected(&[b"abc"], 5);
        assert_eq!(short.len(), 2);
        assert!(short[1].as_ref().is_err_and(|e| e.message().contains("sent 3 bytes")));
    }
}
