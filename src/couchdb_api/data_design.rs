//! The data-store database's design documents and views on backends that do not run them
//! (the embedded store, DynamoDB, Firestore; the CouchDB backend runs its own, and
//! [`super::design`] passes requests to it).
//!
//! ## Storage
//! A design document `_design/{name}` is a record of the data-store database as the engine keeps
//! it ([`crate::database::Database::data_store`], the data-store layout): in the change feed, in
//! `_all_docs` and `doc_count` for an admin, replicated and migrated like every other database's
//! (CouchDB's behaviour). A write is the engine's edit (`new_edits=true`). The previous release
//! kept each as a local document `:design:{name}` ([`DESIGN_SIDE_PREFIX`]);
//! [`crate::upgrade::move_data_store_design_documents`] moves them into records (`agentstore
//! upgrade`, and the facade when it opens the store). The facade never lists them: its queries
//! are a user's documents. A view never maps a design document unless its design document asks
//! (`options.include_design`).
//!
//! ## Views
//! [`DataStoreSource`] is the data-store database as a [`ViewSource`]: the engine's source of
//! its [`Database`] (its change feed, each changed document's winner with `_conflicts` from its
//! tree, [`crate::views::source`]), and the engine's incarnation document of this layout
//! ([`INCARNATION_DOC`]), read at every use rather than remembered. The HTTP answers are the
//! other databases' ([`super::db::Viewed`]). Its created Mango JSON indexes are groups over the
//! same source ([`crate::mango::index_source`]). What is left for the merge with the routing of
//! the data-store database through `super::db`: its `Viewed` becomes the data-store
//! `Database`'s, with the incarnation read as here, and this module goes.
//!
//! ## Purges
//! `purge_user` erases a user's documents with their feed entries, so no feed page tells an
//! index to remove their rows. It ends the incarnation instead
//! ([`crate::store::end_data_store_views_incarnation`], no HTTP face needed):
//! the incarnation is read at every index use, so every process then builds new groups from
//! the feed without the purged documents, and drops the groups of the ended incarnation from
//! its index file (at its next index use, or its first after a restart).
//!
//! ## What is refused
//! `validate_doc_update`: the data-store database's writes go through the data-store rules
//! ([`super::data_document`]) and the facade, not through the write guard of the other
//! databases, so a validation function would never run; a design document holding one is
//! refused (501) rather than stored and silently ignored. A design document whose view functions
//! do not compile (400 `compilation_error`, as on every database). Attachments (the data-store
//! database keeps none), and `new_edits=false` writes of design documents (a replicator's:
//! refused as every `_design/` id is refused by `_bulk_docs` here).

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use axum::body::Body;
use axum::http::{HeaderMap, Method, StatusCode};
use percent_encoding::percent_decode_str;
use serde_json::{Map, Value};

use super::db::{answer_read, cleanup_answer, info_answer, leaf_json, queries_answer, view_answer, DocOptions, Viewed};
use super::error::{CouchError, CouchResult};
use super::{Answer, CouchState};
use crate::backend::rev_tree::RevTree;
use crate::backend::{DocumentBackend, IdRange, StoredDocument};
use crate::database::{Database, Write, Written};
use crate::views::{SourcePage, ViewError, ViewSource};

/// The start of every local document name holding a design document.
pub const DESIGN_SIDE_PREFIX: &str = crate::database::layout::DESIGN_SIDE_PREFIX;
/// The local document holding the data-store database's incarnation for view indexes (the
/// facade's `purge_user` removes it, [`crate::store::VIEWS_INCARNATION_DOC`]).
pub const INCARNATION_DOC: &str = crate::store::VIEWS_INCARNATION_DOC;
/// Design documents read per page when all of them are listed.
const LIST_PAGE: usize = 100;

/// Whether a local document name is kept by this database for itself (conflicts, design
/// documents, the views' incarnation): never a client's.
pub fn is_reserved_local(name: &str) -> bool {
    crate::database::layout::reserved_local_name(name)
}

/// The data-store database as the engine serves it, for its design documents' records (its
/// name is the views' business only, not needed here).
fn engine(backend: &Arc<dyn DocumentBackend>) -> crate::Result<Database> {
    Database::data_store(crate::model::COLLECTION.to_owned(), Arc::clone(backend))
}

/// The design document `_design/{name}`'s tree, `None` when nothing is stored for it.
async fn read_tree(backend: &Arc<dyn DocumentBackend>, name: &str) -> crate::Result<Option<RevTree>> {
    Ok(engine(backend)?.read(&format!("_design/{name}")).await?.map(|state| state.tree))
}

/// A new revision of `_design/{name}` over `parent` (CouchDB's `new_edits=true` rules, the
/// engine's write): the new revision, or 409 `conflict`.
async fn edit(
    backend: &Arc<dyn DocumentBackend>,
    name: &str,
    parent: Option<&str>,
    deleted: bool,
    body: Map<String, Value>,
) -> CouchResult<String> {
    let id = format!("_design/{name}");
    let database = engine(backend)?;
    // A deletion of a document that is not there is CouchDB's 404, not a conflict.
    if deleted {
        let tree = database.read(&id).await?.map(|state| state.tree).unwrap_or_default();
        if tree.winner().is_none_or(|winner| winner.deleted) {
            return Err(CouchError::not_found(if tree.is_empty() { "missing" } else { "deleted" }));
        }
    }
    match database.write(&id, &Write::Edit { parent: parent.map(str::to_owned), deleted, body }).await? {
        Written::Edited(rev) => Ok(rev),
        Written::Merged(_) => Err(CouchError::internal("an edit was answered as a replicated revision")),
    }
}

/// The live design documents, in id order, as `_all_docs` lists them: id, the winner's revision
/// and the document (their records).
pub(crate) async fn live_design_docs(backend: &dyn DocumentBackend) -> crate::Result<Vec<StoredDocument>> {
    let range = IdRange::design_documents();
    let mut found = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let page = backend.all_docs(&range, LIST_PAGE, token.as_deref()).await?;
        found.extend(page.items.into_iter().filter(|doc| doc.id.starts_with("_design/")));
        match page.next {
            Some(next) => token = Some(next),
            None => return Ok(found),
        }
    }
}

/// The data-store database as a source of view indexes: the engine's source of its
/// [`Database`] ([`crate::views::source`]), with the incarnation read at every use.
pub struct DataStoreSource {
    backend: Arc<dyn DocumentBackend>,
    name: String,
    /// The engine's data-store database; `None` over a backend that keeps revision trees itself
    /// (the CouchDB backend runs its own views: nothing is indexed here).
    database: Option<Database>,
}

impl DataStoreSource {
    pub fn new(backend: Arc<dyn DocumentBackend>, name: &str) -> Self {
        let database = Database::data_store(name.to_owned(), Arc::clone(&backend)).ok();
        DataStoreSource { backend, name: name.to_owned(), database }
    }

    fn database(&self) -> Result<&Database, ViewError> {
        self.database.as_ref().ok_or_else(|| {
            ViewError::Storage(crate::Error::new(
                crate::error::ErrorKind::Misconfigured,
                "this backend runs the data-store database's views itself",
            ))
        })
    }

    /// The view group signatures of its created Mango indexes (`_view_cleanup` keeps them).
    pub(crate) async fn mango_index_signatures(&self) -> CouchResult<Vec<String>> {
        Ok(crate::mango::index::data_store_signatures(self.backend.as_ref()).await?)
    }

    /// The live design document `_design/{name}` as CouchDB shows it (404 `missing`/`deleted`).
    pub(crate) async fn design_doc(&self, name: &str) -> CouchResult<Value> {
        let tree = read_tree(&self.backend, name).await?.ok_or_else(|| CouchError::not_found("missing"))?;
        let winner = tree.winner().ok_or_else(|| CouchError::not_found("missing"))?;
        if winner.deleted {
            return Err(CouchError::not_found("deleted"));
        }
        Ok(leaf_json(&format!("_design/{name}"), &tree, winner, DocOptions::default()))
    }

    /// Every live design document as CouchDB shows it.
    pub(crate) async fn design_docs(&self) -> CouchResult<Vec<Value>> {
        Ok(live_design_docs(self.backend.as_ref()).await?.iter().map(StoredDocument::to_json).collect())
    }

    /// The documents `include_docs` shows for rows linking to `ids`: the current revision (with
    /// `_conflicts` when asked), `null` when it is deleted, missing, or not the revision a row's
    /// value names (`wanted`: only the winner is kept readable here without its tree).
    pub(crate) async fn included_docs(
        &self,
        ids: &[String],
        wanted: &[Option<&str>],
        conflicts: bool,
    ) -> crate::Result<Vec<Value>> {
        let found = self.backend.get_many(ids).await?;
        let trees = if conflicts { super::branches::trees_of(self.backend.as_ref(), ids).await? } else { Vec::new() };
        Ok(found
            .into_iter()
            .enumerate()
            .map(|(i, doc)| match doc {
                Some(doc) if wanted.get(i).copied().flatten().is_none_or(|rev| rev == doc.rev.as_str()) => {
                    let mut shown = doc.to_json();
                    if conflicts {
                        super::branches::add_conflicts(&mut shown, trees.get(i).and_then(Option::as_ref));
                    }
                    shown
                }
                _ => Value::Null,
            })
            .collect())
    }
}

#[async_trait]
impl ViewSource for DataStoreSource {
    fn name(&self) -> &str {
        &self.name
    }

    /// Read from the backend at every call, not remembered as the engine's databases remember
    /// theirs: `purge_user` ends the incarnation (removes its local document, the engine's
    /// [`crate::database::layout::LocalNames::views_incarnation`] of this layout) from the facade,
    /// in this process or another, so that every process's groups of this database, holding rows
    /// of the purged documents, are left for new ones built from the feed the purge erased from.
    /// The indexer drops the old groups from its file when it sees a new incarnation. A `_purge`
    /// stopped between its erasure and its last step is settled first, as the engine does.
    async fn incarnation(&self) -> Result<String, ViewError> {
        ViewSource::incarnation(self.database()?).await
    }

    /// The engine's feed of the data-store database: each changed document's winner as CouchDB
    /// shows it to a map function, `_conflicts` from its tree.
    async fn feed_page(&self, since: Option<&str>, limit: usize) -> Result<SourcePage, ViewError> {
        ViewSource::feed_page(self.database()?, since, limit).await
    }
}

/// A request below `/{db}/_design/` of the data-store database, answered here: the design
/// document itself, its views and `_info`. `path` is the path below the database as the client
/// encoded it (`_design/{name}…`); the caller checked that the principal is an admin.
pub(crate) async fn answer(
    state: &CouchState,
    method: Method,
    path: &str,
    query: Option<&str>,
    headers: &HeaderMap,
    body: Body,
) -> Answer {
    // In the client's order: a view query reads its parameters in order, as CouchDB does.
    let ordered: Vec<(String, String)> =
        query.map(|query| url::form_urlencoded::parse(query.as_bytes()).into_owned().collect()).unwrap_or_default();
    let params: HashMap<String, String> = ordered.iter().cloned().collect();
    let segments: Vec<String> =
        path.split('/').skip(1).map(|segment| percent_decode_str(segment).decode_utf8_lossy().into_owned()).collect();
    let viewed = Viewed::DataStore(Arc::clone(&state.data_store_views));
    match segments.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        [] | [""] => Err(CouchError::bad_request("a design document needs a name: _design/{name}")),
        [name] => document(state, method, name, &params, headers, body).await,
        [name, "_view", view] => view_answer(state, &viewed, name, view, method, &ordered, headers, body).await,
        [name, "_view", view, "queries"] if method == Method::POST => {
            queries_answer(state, &viewed, name, view, &ordered, headers, body).await
        }
        [name, "_info"] if method == Method::GET || method == Method::HEAD => info_answer(state, &viewed, name).await,
        [_, function, ..] if function.starts_with('_') => Err(CouchError::not_supported(
            "shows, lists, update functions and rewrites (deprecated in CouchDB 3; views run here)",
        )),
        _ => Err(CouchError::not_supported("attachments: the data-store database keeps JSON documents only")),
    }
}

/// `POST /{db}/_view_cleanup` of the data-store database (the caller checked the principal).
pub(crate) async fn view_cleanup(state: &CouchState, headers: &HeaderMap) -> Answer {
    cleanup_answer(state, &Viewed::DataStore(Arc::clone(&state.data_store_views)), headers).await
}

/// `_design/{name}` itself, every method.
async fn document(
    state: &CouchState,
    method: Method,
    name: &str,
    params: &HashMap<String, String>,
    headers: &HeaderMap,
    body: Body,
) -> Answer {
    let backend = state.store.backend();
    let id = format!("_design/{name}");
    match method.as_str() {
        "GET" | "HEAD" => {
            let tree = read_tree(backend, name).await?;
            answer_read(&id, tree.as_ref(), params, headers)
        }
        "PUT" => {
            let doc = state.bodies.read_object(headers, body).await?;
            let Value::Object(doc) = doc.value else {
                return Err(CouchError::bad_request("Document must be a JSON object"));
            };
            let parsed = crate::database::document::parse(doc).map_err(super::db::refused)?;
            if parsed.id.as_deref().is_some_and(|sent| sent != id) {
                return Err(CouchError::bad_request("Document id must match"));
            }
            if !super::request::bool_param("new_edits", params.get("new_edits").map(String::as_str), true)? {
                return Err(CouchError::forbidden(
                    "new_edits=false writes of design documents are not kept by the data-store database",
                ));
            }
            check_body(&parsed.body)?;
            check_compiles(state, &id, &parsed.body).await?;
            let parent = super::document::named_revision(parsed.rev.as_deref(), params, headers)?.map(str::to_owned);
            let status = if parsed.deleted { StatusCode::OK } else { StatusCode::CREATED };
            let rev = edit(backend, name, parent.as_deref(), parsed.deleted, parsed.body).await?;
            Ok(super::document::written(state, status, &id, &rev))
        }
        "DELETE" => {
            let parent = super::document::named_revision(None, params, headers)?.map(str::to_owned);
            let Some(parent) = parent else {
                return Err(deletion_refused(backend, name).await);
            };
            let rev = edit(backend, name, Some(&parent), true, Map::new()).await?;
            Ok(super::document::written(state, StatusCode::OK, &id, &rev))
        }
        "COPY" => copy(state, name, params, headers).await,
        _ => Ok(super::server::method_not_allowed().await),
    }
}

/// CouchDB's answer to a `DELETE` without a revision: 404 for a missing or deleted document,
/// else 409.
async fn deletion_refused(backend: &Arc<dyn DocumentBackend>, name: &str) -> CouchError {
    match read_tree(backend, name).await {
        Ok(None) => CouchError::not_found("missing"),
        Ok(Some(tree)) if tree.winner().is_none_or(|winner| winner.deleted) => CouchError::not_found("deleted"),
        Ok(Some(_)) => CouchError::conflict(),
        Err(err) => err.into(),
    }
}

/// What a design document of the data-store database may not hold (module documentation).
fn check_body(body: &Map<String, Value>) -> CouchResult<()> {
    if body.get("_attachments").is_some_and(|a| a.as_object().is_some_and(|m| !m.is_empty())) {
        return Err(CouchError::forbidden("attachments are not supported: agentstore keeps JSON documents only"));
    }
    if body.contains_key("validate_doc_update") {
        return Err(CouchError::not_supported(
            "validate_doc_update on the data-store database (its writes keep the data-store rules; \
             see docs/design-documents.md)",
        ));
    }
    Ok(())
}

/// CouchDB's check of a design document's view functions on write
/// ([`crate::database::validation::design_compile_error`]), for `_design/{name}` (`id`) with `body`.
async fn check_compiles(state: &CouchState, id: &str, body: &Map<String, Value>) -> CouchResult<()> {
    let mut doc = body.clone();
    doc.insert("_id".into(), Value::from(id));
    match crate::database::validation::design_compile_error(&state.js, &state.db, &Value::Object(doc)).await {
        Some(refusal) => Err(refusal.into()),
        None => Ok(()),
    }
}

/// `COPY /{db}/_design/{name}` with `Destination: _design/{target}` (or `…?rev=R`): only to
/// another design document, since a data document's id is made of its fields.
async fn copy(state: &CouchState, name: &str, params: &HashMap<String, String>, headers: &HeaderMap) -> Answer {
    let (target, target_rev) = super::request::copy_destination(headers)?;
    let Some(target_name) = target.strip_prefix("_design/").filter(|name| !name.is_empty()) else {
        return Err(CouchError::forbidden(format!(
            "{target:?} is not a design document: a design document is copied only to another one here"
        )));
    };
    let backend = state.store.backend();
    let tree = read_tree(backend, name).await?.ok_or_else(|| CouchError::not_found("missing"))?;
    let leaf = match params.get("rev") {
        Some(rev) => tree.leaf(rev).ok_or_else(|| CouchError::not_found("missing"))?,
        None => tree.winner().filter(|w| !w.deleted).ok_or_else(|| CouchError::not_found("deleted"))?,
    };
    check_compiles(state, &target, &leaf.body).await?;
    let rev = edit(backend, target_name, target_rev.as_deref(), false, leaf.body.clone()).await?;
    Ok(super::document::written(state, StatusCode::CREATED, &target, &rev))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_databases_own_local_names_are_reserved() {
        for reserved in [":leaves:a:b:c", ":design:data_store", ":views:incarnation"] {
            assert!(is_reserved_local(reserved), "{reserved}");
        }
        for client in ["checkpoint", "user_123:checkpoint", "design:x", "_design/x"] {
            assert!(!is_reserved_local(client), "{client}");
        }
    }
}
