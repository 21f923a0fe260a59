//! The data-store database's design documents and views on backends that do not run them
//! (the embedded store, DynamoDB, Firestore; the CouchDB backend runs its own, and
//! [`super::design`] passes requests to it).
//!
//! ## Storage
//! A design document `_design/{name}` is kept as the backend's local document
//! `:design:{name}` ([`DESIGN_SIDE_PREFIX`]), as each document's conflicts are kept beside it
//! (`:leaves:{id}`, [`crate::database::layout::data_store`]): its revision tree, one branch (every write
//! names the current revision, as CouchDB's `new_edits=true` writes do), deleted or not. No
//! client can name these local documents (the CouchDB face refuses `_local/` names with these
//! prefixes). A write reads the tree, edits it with CouchDB's rules
//! ([`crate::backend::rev_tree::RevTree::edit`]) and saves it with a precondition on the local
//! document's revision, starting again from a fresh read when another writer got in between.
//!
//! Local documents are not in the change feed and are not migrated (`agentstore migrate`
//! copies documents), so design documents are neither: a view never maps a design document
//! here (`options.include_design` has nothing to map), and a migration leaves them behind
//! (docs/design-documents.md).
//!
//! ## Views
//! [`DataStoreSource`] is the data-store database as a [`ViewSource`]: its change feed, each
//! changed document as CouchDB shows it (with `_conflicts` from its revision tree), and an
//! incarnation kept in the local document [`INCARNATION_DOC`]. The HTTP answers are the other
//! databases' ([`super::db::Viewed`]). Its created Mango JSON indexes are groups over the
//! same source ([`crate::mango::index_source`]).
//!
//! ## Purges
//! `purge_user` erases a user's documents with their feed entries, so no feed page tells an
//! index to remove their rows. It ends the incarnation instead (removes [`INCARNATION_DOC`]):
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
use crate::backend::rev_tree::{EditError, RevTree};
use crate::backend::revision::random_token;
use crate::backend::{DocumentBackend, IdRange, Precondition, Revision, StoredDocument, DEFAULT_REVS_LIMIT};
use crate::error::{Error, ErrorKind};
use crate::views::source::kept_incarnation;
use crate::views::{SourceDoc, SourcePage, ViewError, ViewSource};

/// The start of every local document name holding a design document.
pub const DESIGN_SIDE_PREFIX: &str = crate::database::layout::DESIGN_SIDE_PREFIX;
/// The local document holding the data-store database's incarnation for view indexes (the
/// facade's `purge_user` removes it, [`crate::store::VIEWS_INCARNATION_DOC`]).
pub const INCARNATION_DOC: &str = crate::store::VIEWS_INCARNATION_DOC;
/// The field of a design document's local document holding its revision tree.
const TREE_FIELD: &str = "tree";
/// Rounds of read, edit and save against other writers of one design document before a 409.
const WRITE_ATTEMPTS: usize = 16;
/// Design documents read per page when all of them are listed.
const LIST_PAGE: usize = 100;

/// Whether a local document name is kept by this database for itself (conflicts, design
/// documents, the views' incarnation): never a client's.
pub fn is_reserved_local(name: &str) -> bool {
    crate::database::layout::reserved_local_name(name)
}

/// The design document `_design/{name}`'s tree and its local document's revision.
async fn read_tree(backend: &dyn DocumentBackend, name: &str) -> crate::Result<Option<(RevTree, Revision)>> {
    let Some(stored) = backend.get_local(&format!("{DESIGN_SIDE_PREFIX}{name}")).await? else { return Ok(None) };
    Ok(Some((tree_of(name, &stored.body)?, stored.rev)))
}

fn tree_of(name: &str, body: &Map<String, Value>) -> crate::Result<RevTree> {
    serde_json::from_value(body.get(TREE_FIELD).cloned().unwrap_or(Value::Null)).map_err(|err| {
        Error::new(
            ErrorKind::Corrupt,
            format!("the design document {name:?} kept by this database does not parse: {err}"),
        )
    })
}

/// A new revision of `_design/{name}` over `parent` (CouchDB's `new_edits=true` rules): the new
/// revision, or 409 `conflict`.
async fn edit(
    backend: &dyn DocumentBackend,
    name: &str,
    parent: Option<&str>,
    deleted: bool,
    body: Map<String, Value>,
) -> CouchResult<String> {
    let local = format!("{DESIGN_SIDE_PREFIX}{name}");
    for _ in 0..WRITE_ATTEMPTS {
        let (mut tree, precondition) = match read_tree(backend, name).await? {
            Some((tree, rev)) => (tree, Precondition::MatchRevision(rev)),
            None => (RevTree::default(), Precondition::MustNotExist),
        };
        // A deletion of a document that is not there is CouchDB's 404, not a conflict.
        if deleted && tree.winner().is_none_or(|winner| winner.deleted) {
            return Err(CouchError::not_found(if tree.is_empty() { "missing" } else { "deleted" }));
        }
        let new_id = hex::encode(random_token()?);
        let rev = match tree.edit(parent, &new_id, deleted, body.clone(), DEFAULT_REVS_LIMIT) {
            Ok(rev) => rev,
            Err(EditError::Conflict) => return Err(CouchError::conflict()),
        };
        let mut stored = Map::new();
        stored.insert(
            TREE_FIELD.into(),
            serde_json::to_value(&tree).map_err(|err| CouchError::internal(err.to_string()))?,
        );
        match backend.put_local(&local, &stored, precondition).await {
            Ok(_) => return Ok(rev),
            Err(err) if err.is_conflict() => continue,
            Err(err) => return Err(err.into()),
        }
    }
    Err(CouchError::conflict())
}

/// Every design document kept (live or deleted), in id order: `(id, tree)`.
async fn all_trees(backend: &dyn DocumentBackend) -> crate::Result<Vec<(String, RevTree)>> {
    let names = IdRange { inclusive_end: true, ..IdRange::all() }.under_prefix(DESIGN_SIDE_PREFIX);
    let mut found = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let page = backend.local_docs(&names, LIST_PAGE, token.as_deref()).await?;
        for doc in &page.items {
            let Some(name) =
                doc.id.strip_prefix(crate::backend::LOCAL_PREFIX).and_then(|n| n.strip_prefix(DESIGN_SIDE_PREFIX))
            else {
                continue;
            };
            found.push((format!("_design/{name}"), tree_of(name, &doc.body)?));
        }
        match page.next {
            Some(next) => token = Some(next),
            None => break,
        }
    }
    found.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(found)
}

/// The live design documents, in id order, as `_all_docs` lists them: id, the winner's revision
/// and the document.
pub(crate) async fn live_design_docs(backend: &dyn DocumentBackend) -> crate::Result<Vec<StoredDocument>> {
    Ok(all_trees(backend)
        .await?
        .into_iter()
        .filter_map(|(id, tree)| {
            let winner = tree.winner().filter(|winner| !winner.deleted)?;
            Some(StoredDocument { id: id.clone(), rev: Revision(winner.rev()), body: winner.body.clone() })
        })
        .collect())
}

/// The data-store database as a source of view indexes.
pub struct DataStoreSource {
    backend: Arc<dyn DocumentBackend>,
    name: String,
}

impl DataStoreSource {
    pub fn new(backend: Arc<dyn DocumentBackend>, name: &str) -> Self {
        DataStoreSource { backend, name: name.to_owned() }
    }

    /// The view group signatures of its created Mango indexes (`_view_cleanup` keeps them).
    pub(crate) async fn mango_index_signatures(&self) -> CouchResult<Vec<String>> {
        Ok(crate::mango::index::data_store_signatures(self.backend.as_ref()).await?)
    }

    /// The live design document `_design/{name}` as CouchDB shows it (404 `missing`/`deleted`).
    pub(crate) async fn design_doc(&self, name: &str) -> CouchResult<Value> {
        let (tree, _) =
            read_tree(self.backend.as_ref(), name).await?.ok_or_else(|| CouchError::not_found("missing"))?;
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

    /// Read from the backend at every call, not remembered: `purge_user` ends the incarnation
    /// (removes its local document) so that every process's groups of this database, holding
    /// rows of the purged documents, are left for new ones built from the feed the purge erased
    /// from. The indexer drops the old groups from its file when it sees a new incarnation.
    async fn incarnation(&self) -> Result<String, ViewError> {
        kept_incarnation(self.backend.as_ref(), INCARNATION_DOC).await
    }

    async fn feed_page(&self, since: Option<&str>, limit: usize) -> Result<SourcePage, ViewError> {
        let page = self.backend.changes(since, limit).await.map_err(ViewError::Storage)?;
        let live: Vec<String> = page.changes.iter().filter(|c| !c.deleted).map(|c| c.id.clone()).collect();
        let found = self.backend.get_many(&live).await.map_err(ViewError::Storage)?;
        // CouchDB passes `_conflicts` to map functions: one cheap check per document, the tree
        // read only for documents with branches.
        let trees = super::branches::trees_of(self.backend.as_ref(), &live).await.map_err(ViewError::Storage)?;
        let mut docs: HashMap<String, Value> = HashMap::with_capacity(live.len());
        for ((id, doc), tree) in live.into_iter().zip(found).zip(trees) {
            if let Some(doc) = doc {
                let mut shown = doc.to_json();
                super::branches::add_conflicts(&mut shown, tree.as_ref());
                docs.insert(id, shown);
            }
        }
        let docs = page
            .changes
            .into_iter()
            .map(|change| {
                let doc = if change.deleted { None } else { docs.remove(&change.id) };
                SourceDoc { id: change.id, doc }
            })
            .collect();
        Ok(SourcePage { docs, last_seq: page.last_seq, complete: page.pending == Some(0) })
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
    let backend = state.store.backend().as_ref();
    let id = format!("_design/{name}");
    match method.as_str() {
        "GET" | "HEAD" => {
            let tree = read_tree(backend, name).await?.map(|(tree, _)| tree);
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
async fn deletion_refused(backend: &dyn DocumentBackend, name: &str) -> CouchError {
    match read_tree(backend, name).await {
        Ok(None) => CouchError::not_found("missing"),
        Ok(Some((tree, _))) if tree.winner().is_none_or(|winner| winner.deleted) => CouchError::not_found("deleted"),
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
    let backend = state.store.backend().as_ref();
    let (tree, _) = read_tree(backend, name).await?.ok_or_else(|| CouchError::not_found("missing"))?;
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
