//! The data-store database's tree layout on a backend that keeps revision trees itself
//! ([`DocumentBackend::keeps_branches`]: the CouchDB backend). The tree is the backend's own
//! document, read whole ([`DocumentBackend::revision_tree`]; a page of them in one batched read,
//! [`DocumentBackend::revision_trees`]); a save writes each leaf the new
//! tree has and the tree read had not through the backend's own calls, so that the backend's
//! document stays what the REST API, the facade and CouchDB's own clients read:
//! - a leaf an ordinary edit made (`new_edits=true`) is written as an edit the backend itself
//!   checks against its parent's revision ([`DocumentBackend::put`] with
//!   [`Precondition::MatchRevision`], [`DocumentBackend::delete`] for a deletion): two servers
//!   editing one document from the same revision get one success and one conflict, never two
//!   acknowledged siblings. The backend assigns the revision an edit stored, so the save answers
//!   it ([`NativeLayout::save_edited`]) and the engine answers the client with that one;
//! - a replicated leaf (`new_edits=false`) is written as sent ([`DocumentBackend::put_branch`]),
//!   idempotent, so a retried save writes nothing twice.
//!
//! Why a layout and not a forward of the database to the backing CouchDB: the data-store rules
//! (ids made of their fields, per-user confinement of ids, local names, listings and the feed)
//! are the engine handlers' already; forwarding would need each of them again at the boundary,
//! rewriting requests and filtering answers (ARCHITECTURE.md, "One set of CouchDB handlers").
//!
//! Crash repair: each backend write here is one atomic revision write of the backend's, and the
//! document's tree is the backend's alone (no side place), so no save is ever unfinished
//! ([`RepairableLayout::unfinished`] is `false`); a crash between two leaves of one save (a
//! replicator's batch of several branches of one document) leaves the leaves written so far,
//! each in the backend's feed, and the replicator sends the rest again
//! (docs/design/crash-points.md). Inner revisions' bodies are the backend's (CouchDB keeps them
//! until its compaction); this layout reads leaves only, so `?rev=` of an inner revision answers
//! as on the other data-store layout (`missing`), and `_compact` is the backend's.

use std::sync::Arc;

use async_trait::async_trait;
use serde_json::Value;

use super::{KeptBodies, LaidOut, RepairableLayout, TreeLayout};
use crate::backend::rev_tree::{parse_rev, Leaf, RevPath, RevTree};
use crate::backend::{DocumentBackend, Precondition, ReplicatedRevision, Revision, StoredDocument};
use crate::error::{Error, ErrorKind, Result};

/// What a save of this layout must match: nothing of its own, the backend checks each write.
#[derive(Debug, Clone, Default)]
pub struct NativeToken;

/// A document's tree as this layout read it.
pub type NativeState = LaidOut<NativeToken>;

/// The revision the backend stored for an edit whose revision the engine computed: the engine's
/// answer to the client is the stored one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredAs {
    pub computed: String,
    pub stored: String,
}

/// The data-store database's layout over a backend keeping trees itself (module doc).
pub struct NativeLayout {
    backend: Arc<dyn DocumentBackend>,
}

impl NativeLayout {
    pub fn new(backend: Arc<dyn DocumentBackend>) -> Self {
        NativeLayout { backend }
    }

    /// Saves `tree` over `before`: every leaf new to it written through the backend, those whose
    /// revisions are in `edited` (the ordinary edits of this save) as edits checked by the
    /// backend against their parents, the rest as replicated branches. Answers the revision the
    /// backend stored for each edit. A leaf of `before` missing from `tree` (a purge) is not
    /// this layout's to write: the backend's `_purge` is reached through [`TreeLayout::erase`]
    /// only, for a document's last leaf.
    pub async fn save_edited(
        &self,
        id: &str,
        before: Option<&NativeState>,
        tree: &RevTree,
        edited: &[String],
    ) -> Result<Vec<StoredAs>> {
        let empty = RevTree::default();
        let before = before.map_or(&empty, |state| &state.tree);
        if let Some(dropped) = before.leaves().into_iter().find(|leaf| !tree.contains(&leaf.rev())) {
            return Err(Error::new(
                ErrorKind::Internal,
                format!("a save of {id:?} would drop the leaf {} the backend keeps; only its purge can", dropped.rev()),
            ));
        }
        let mut stored = Vec::new();
        for leaf in tree.leaves().into_iter().filter(|leaf| !before.contains(&leaf.rev())) {
            let rev = leaf.rev();
            if edited.contains(&rev) {
                let revision = self.write_edit(id, before, leaf).await?;
                stored.push(StoredAs { computed: rev, stored: revision.0 });
            } else {
                self.write_branch(id, leaf).await?;
            }
        }
        Ok(stored)
    }

    /// An ordinary edit's leaf, written as the backend's own edit of its parent.
    async fn write_edit(&self, id: &str, before: &RevTree, leaf: &Leaf) -> Result<Revision> {
        // On a live document the edit names its parent (any leaf, deleted or not, as CouchDB
        // takes it); on nothing, or a deleted document, it is a creation: the backend's write
        // without a revision, which re-creates over a deleted winner as CouchDB does.
        let live_parent = parent_rev(&leaf.path).filter(|_| !before.is_deleted());
        let written = match (live_parent, leaf.deleted) {
            (Some(parent), true) if leaf.body.is_empty() => self.backend.delete(id, &Revision(parent)).await,
            (Some(parent), true) => {
                let mut body = leaf.body.clone();
                body.insert("_deleted".into(), Value::Bool(true));
                self.backend.put(id, &body, Precondition::MatchRevision(Revision(parent))).await
            }
            (Some(parent), false) => {
                self.backend.put(id, &leaf.body, Precondition::MatchRevision(Revision(parent))).await
            }
            (None, false) => self.backend.put(id, &leaf.body, Precondition::MustNotExist).await,
            // A deletion of nothing live: a tombstone where there is no document, written as
            // the branch the engine computed (there is no parent for the backend to check).
            (None, true) => return self.write_branch(id, leaf).await.map(|()| Revision(leaf.rev())),
        };
        // A deletion the backend finds already deleted or gone lost to another writer, as an edit
        // from a stale parent does: the engine reads again and answers the conflict.
        written.map_err(|err| match err.kind() {
            ErrorKind::NotFound => Error::conflict(format!("document {id:?} was changed by another writer")),
            _ => err,
        })
    }

    /// A replicated leaf, written as sent with its path (idempotent).
    async fn write_branch(&self, id: &str, leaf: &Leaf) -> Result<()> {
        let incoming = ReplicatedRevision {
            rev: Revision(leaf.rev()),
            ancestry: leaf.path.revs(),
            deleted: leaf.deleted,
            body: leaf.body.clone(),
            precondition: Precondition::None,
        };
        self.backend.put_branch(id, &incoming, usize::MAX).await.map(|_| ())
    }
}

/// The revision a path's leaf was made from, `None` at generation 1 (or a path that remembers
/// no parent).
fn parent_rev(path: &RevPath) -> Option<String> {
    let parent = path.ids.get(1)?;
    Some(format!("{}-{parent}", path.start.checked_sub(1)?))
}

/// The tree of a listed record alone (its winner, one revision): a listing's rows need only the
/// winner, and reading each listed document's whole tree would cost a request per row.
fn listed_tree(document: &StoredDocument) -> Option<RevTree> {
    let (generation, hash) = parse_rev(document.rev.as_str())?;
    let mut tree = RevTree::default();
    let path = RevPath { start: generation, ids: vec![hash.to_owned()] };
    tree.merge(path, false, document.body.clone(), usize::MAX);
    Some(tree)
}

fn laid_out(tree: RevTree) -> NativeState {
    LaidOut { tree, token: NativeToken }
}

#[async_trait]
impl RepairableLayout for NativeLayout {
    type Token = NativeToken;

    async fn read(&self, id: &str) -> Result<Option<NativeState>> {
        Ok(self.backend.revision_tree(id).await?.filter(|tree| !tree.is_empty()).map(laid_out))
    }

    /// The backend's batched read of the trees ([`DocumentBackend::revision_trees`]: one
    /// request for a page of the change feed or of a listing, not one per row).
    async fn read_many(&self, ids: &[String]) -> Result<Vec<Option<NativeState>>> {
        let trees = self.backend.revision_trees(ids).await?;
        if trees.len() != ids.len() {
            return Err(Error::new(ErrorKind::Internal, "the backend answered a batched tree read with too few trees"));
        }
        Ok(trees.into_iter().map(|tree| tree.filter(|tree| !tree.is_empty()).map(laid_out)).collect())
    }

    async fn save(&self, id: &str, before: Option<&NativeState>, tree: &RevTree) -> Result<()> {
        self.save_edited(id, before, tree, &[]).await.map(|_| ())
    }

    /// Never: each backend write is atomic and there is no side place.
    async fn unfinished(&self, _id: &str, _state: &NativeState) -> Result<bool> {
        Ok(false)
    }
}

#[async_trait]
impl TreeLayout for NativeLayout {
    /// The backend's own erasure of the id, exactly: CouchDB's `_purge` of the leaves read, so
    /// a leaf written since is kept ([`crate::backend::EraseOptions::only_leaves`]).
    async fn erase(&self, id: &str, state: &NativeState) -> Result<()> {
        let read = state.tree.leaves().into_iter().map(|leaf| Revision(leaf.rev())).collect();
        let options = crate::backend::EraseOptions { only_leaves: Some(read), ..Default::default() };
        self.backend.erase_id(id, &options).await.map(|_| ())
    }

    async fn listed(&self, documents: Vec<StoredDocument>) -> Result<Vec<(String, NativeState)>> {
        Ok(documents
            .into_iter()
            .filter_map(|document| Some((document.id.clone(), laid_out(listed_tree(&document)?))))
            .collect())
    }

    /// None here: the backend keeps inner bodies itself, until its own compaction, and the
    /// data-store database takes no attachments.
    fn kept_bodies(&self) -> Option<&dyn KeptBodies<Token = NativeToken>> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Map;

    fn body_of(fields: &[(&str, Value)]) -> Map<String, Value> {
        fields.iter().map(|(name, value)| ((*name).to_owned(), value.clone())).collect()
    }

    #[test]
    fn a_paths_parent_is_the_revision_before_its_leaf() {
        let path = RevPath { start: 3, ids: vec!["c".into(), "b".into(), "a".into()] };
        assert_eq!(parent_rev(&path).as_deref(), Some("2-b"));
        assert_eq!(parent_rev(&RevPath { start: 1, ids: vec!["a".into()] }), None);
    }

    #[test]
    fn a_listed_record_is_its_winner_alone() {
        let document = StoredDocument {
            id: "u:n:k".into(),
            rev: Revision("2-abc".into()),
            body: body_of(&[("value", Value::from(1))]),
        };
        let tree = listed_tree(&document).expect("a tree");
        let winner = tree.winner().expect("a winner");
        assert_eq!((winner.rev(), winner.deleted), ("2-abc".to_owned(), false));
        assert_eq!(winner.body, document.body);
    }
}
