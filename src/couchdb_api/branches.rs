//! The data-store database's conflicts on the CouchDB face: reads that look past the winner
//! (`?conflicts`, `?deleted_conflicts`, `?revs_info`, `?meta`, `?open_revs`, `?rev=` of a losing
//! leaf) and writes that name a losing leaf (an edit, or the deletion that resolves a conflict).
//!
//! The tree comes from the engine's data-store layout
//! ([`crate::database::layout::data_store::revision_tree`]) and is answered with
//! the same code as every other database's documents. A write to a losing leaf is a new
//! revision, the leaf's child, merged into the tree through
//! [`crate::store::DataStore::put_replicated`] (which keeps every branch), so the winner is
//! chosen again by CouchDB's rule: deleting the winner while a live conflict exists makes that
//! conflict the winner, as in CouchDB.

use std::collections::HashMap;

use axum::http::HeaderMap;
use serde_json::{Map, Value};

use super::error::{CouchError, CouchResult};
use super::{Answer, CouchState};
use crate::backend::rev_tree::RevTree;
use crate::backend::revision::RevisionId;
use crate::backend::{Precondition, ReplicatedRevision, Revision};
use crate::database::layout::data_store;

/// Query options that need more than the winner.
const TREE_OPTIONS: [&str; 5] = ["conflicts", "deleted_conflicts", "revs_info", "meta", "open_revs"];

/// Whether a read asks for something only the whole tree answers.
pub(crate) fn wants_tree(params: &HashMap<String, String>) -> bool {
    TREE_OPTIONS.iter().any(|name| params.contains_key(*name))
}

/// The tree of `id` (`None`: nothing stored).
pub(crate) async fn tree_of(state: &CouchState, id: &str) -> CouchResult<Option<RevTree>> {
    Ok(data_store::revision_tree(state.store.backend().as_ref(), id).await?)
}

/// A read answered from the document's whole tree.
pub(crate) async fn read(
    state: &CouchState,
    id: &str,
    params: &HashMap<String, String>,
    headers: &HeaderMap,
) -> Answer {
    let tree = tree_of(state, id).await?;
    super::db::answer_read(id, tree.as_ref(), params, headers)
}

/// Whether the document has leaves besides its winner.
pub(crate) fn has_conflicts(tree: &RevTree) -> bool {
    tree.leaves().len() > 1
}

/// The tree of `id` when it has leaves besides its winner (`None`: the winner alone, or nothing
/// stored): a write that only needs the tree then costs one cheap check.
pub(crate) async fn tree_with_branches(state: &CouchState, id: &str) -> CouchResult<Option<RevTree>> {
    if !data_store::has_branches(state.store.backend().as_ref(), id).await? {
        return Ok(None);
    }
    Ok(tree_of(state, id).await?.filter(has_conflicts))
}

/// A write (`deleted` or not, with `body`) on the leaf `rev` of a document with several leaves:
/// the leaf's child, merged into the tree. `None` when `rev` is not a leaf (the caller answers
/// as for a stale revision).
pub(crate) async fn write_leaf(
    state: &CouchState,
    id: &str,
    tree: &RevTree,
    rev: &Revision,
    deleted: bool,
    body: Map<String, Value>,
) -> CouchResult<Option<Revision>> {
    let Some(leaf) = tree.leaf(rev.as_str()) else { return Ok(None) };
    // A deleted leaf is only ever extended by re-creating the document (no `_rev`), as CouchDB.
    if leaf.deleted {
        return Ok(None);
    }
    let minted = RevisionId::next_after(Some(leaf.path.start))?.to_revision();
    let mut ancestry = vec![minted.as_str().to_owned()];
    ancestry.extend(leaf.path.revs());
    let child = ReplicatedRevision { rev: minted.clone(), ancestry, deleted, body, precondition: Precondition::None };
    let document_id = crate::model::DocumentId::parse(id).map_err(CouchError::from)?;
    state.store.put_replicated(&document_id, &child).await?;
    Ok(Some(minted))
}

/// A write naming `rev` that the winner-only path refused as stale: applied to the leaf `rev`
/// when the document has it, else CouchDB's 409.
pub(crate) async fn write_after_conflict(
    state: &CouchState,
    id: &str,
    rev: &Revision,
    deleted: bool,
    body: Map<String, Value>,
) -> CouchResult<Revision> {
    let Some(tree) = tree_of(state, id).await? else { return Err(CouchError::conflict()) };
    write_leaf(state, id, &tree, rev, deleted, body).await?.ok_or_else(CouchError::conflict)
}

/// How many trees a listing reads at once.
const TREE_READS: usize = 16;

/// The trees of many documents, one per id, in order (`None`: nothing stored, or the winner
/// alone).
pub(crate) async fn trees_of(
    backend: &dyn crate::backend::DocumentBackend,
    ids: &[String],
) -> crate::Result<Vec<Option<RevTree>>> {
    use futures::{StreamExt, TryStreamExt};
    // A plain loop, not an iterator adapter: a closure here trips rustc's higher-ranked `Send`
    // check on the boxed futures.
    let mut reads = Vec::with_capacity(ids.len());
    for id in ids {
        reads.push(tree_if_branched(backend, id));
    }
    futures::stream::iter(reads).buffered(TREE_READS).try_collect().await
}

/// The tree of `id` when it has leaves besides its winner, else `None`: a listing (every
/// replication reads `_changes?style=all_docs`) pays one cheap check per row, and the whole
/// tree only for documents with branches.
async fn tree_if_branched(backend: &dyn crate::backend::DocumentBackend, id: &str) -> crate::Result<Option<RevTree>> {
    if !data_store::has_branches(backend, id).await? {
        return Ok(None);
    }
    data_store::revision_tree(backend, id).await
}

/// Adds `_conflicts` to a document read for a listing, when it has any.
pub(crate) fn add_conflicts(doc: &mut Value, tree: Option<&RevTree>) {
    let conflicts = tree.map(RevTree::conflicts).unwrap_or_default();
    if let (Value::Object(doc), false) = (doc, conflicts.is_empty()) {
        doc.insert("_conflicts".into(), Value::from(conflicts));
    }
}
