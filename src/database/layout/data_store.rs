//! The data-store database's tree layout: every branch of a data-store document's revision tree
//! (CouchDB's conflicts) on backends whose records hold one revision each. Every caller reaches a
//! data-store tree through this module ([`revision_tree`], [`has_branches`], [`put_branch`],
//! [`erase_branches`]); on a backend that keeps branches itself
//! ([`DocumentBackend::keeps_branches`]: the CouchDB backend) each forwards to the backend's own
//! method of the same name.
//!
//! ## Storage
//! The document's record holds its winning revision, so everything that reads records (the REST
//! API, the facade, listings, counts, the index, the change feed) sees the winner and nothing
//! else, as before. The other leaves of the tree, each with its path and body, live in the local
//! document `:leaves:{id}` ([`side_name`]). No client can name it: a per-user login's local
//! documents are named `{user}:…` and user ids are never empty, and an admin's `_local/` names
//! starting with [`SIDE_PREFIX`] are refused by the CouchDB face.
//!
//! ## Writes
//! A replicated revision is merged into the tree read from both places with CouchDB's rules
//! ([`RevTree::merge`]); then, in this order, so that a crash between two steps never loses a
//! leaf: the local document is saved with every leaf but the new winner (compare-and-swap on its
//! revision), and when the winner changed the new winner is written to the record with a
//! precondition on the record's revision as read. A record revision or local revision that
//! changed in between makes the write start again from a fresh read ([`GRAFT_ATTEMPTS`]). The
//! local document may therefore hold a leaf the record also holds, or an ancestor of a leaf:
//! merging rebuilds the tree from paths, so such entries fall away on the next read. The leaves
//! are stored as a tree is ([`StoredLeaves`]: each revision once); the array of leaves with whole
//! paths the previous release wrote is still read.
//!
//! A new losing leaf rewrites the record as it is (the same revision, a precondition naming it:
//! [`crate::backend::replicated::judge`]'s rewrite in place), so the document moves in the change feed as
//! in CouchDB and a replica that already read past it learns of the new branch.

use serde_json::{Map, Value};

use serde::Deserialize;

use crate::backend::rev_tree::{Leaf, MergeOutcome, RevPath, RevTree, StoredLeaves, StoredTree};
use crate::backend::{DocumentBackend, Precondition, ReplicatedOutcome, ReplicatedRevision, Revision, RevisionInfo};
use crate::error::{Error, ErrorKind, Result};

/// The start of every local document name that holds a document's other leaves.
pub const SIDE_PREFIX: &str = ":leaves:";
/// The field of that local document holding the leaves.
const LEAVES_FIELD: &str = "leaves";
/// Rounds of read, merge and save against other writers of one document before a conflict.
pub const GRAFT_ATTEMPTS: usize = 16;
/// How many revisions each side leaf's path keeps (CouchDB's default `_revs_limit`).
const SIDE_REVS_LIMIT: usize = crate::backend::DEFAULT_REVS_LIMIT;

/// Refuses a merged tree past `max_tree_bytes` (`couchdb_max_tree_bytes`, the bound of every
/// database) unless it is no larger than the tree read: a document stored under a larger
/// setting can still be written down.
fn check_tree_size(id: &str, before: &RevTree, after: &RevTree, max_tree_bytes: usize) -> Result<()> {
    let held = after.held_bytes();
    if held <= max_tree_bytes || held <= before.held_bytes() {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::TooLarge,
        format!(
            "the revision tree of {id:?} would hold about {held} bytes (its leaves' bodies and paths), more than \
             couchdb_max_tree_bytes ({max_tree_bytes})"
        ),
    ))
}

/// The local document that holds `id`'s other leaves.
pub fn side_name(id: &str) -> String {
    format!("{SIDE_PREFIX}{id}")
}

/// A document's tree as read, with what the next save must match.
#[derive(Debug, Clone)]
pub struct ReadTree {
    pub tree: RevTree,
    /// The record's revision (the winner, live or a tombstone) as read; `None`: no record.
    record: Option<RevisionInfo>,
    /// The revision of the local document holding the other leaves, `None`: there is none.
    side_rev: Option<Revision>,
    /// The leaves the local document held as read.
    side_leaves: Vec<Leaf>,
}

/// The whole revision tree of a data-store document: its winner (the record every other call
/// reads) and every other leaf, each with its path and body. `None` when nothing is stored for
/// the id.
pub async fn revision_tree<B: DocumentBackend + ?Sized>(backend: &B, id: &str) -> Result<Option<RevTree>> {
    if backend.keeps_branches() {
        return backend.revision_tree(id).await;
    }
    Ok(read(backend, id).await?.map(|read| read.tree))
}

/// Whether the document may have leaves besides its winner (conflicts or deleted leaves):
/// `false` means [`revision_tree`] would answer the winner alone. A cheap check (one local
/// document read) for writes and listings that need the tree only when there is more than the
/// winner.
pub async fn has_branches<B: DocumentBackend + ?Sized>(backend: &B, id: &str) -> Result<bool> {
    if backend.keeps_branches() {
        return backend.has_branches(id).await;
    }
    Ok(backend.get_local(&side_name(id)).await?.is_some())
}

/// A replicated revision written keeping every branch, as CouchDB does (`new_edits: false`): one
/// that loses to the winner is kept as a leaf of the tree (`KeptCurrent`), one that wins moves
/// the previous winner among the other leaves (`Applied`), one the tree holds is `AlreadyKnown`.
/// A revision that would grow the tree past `max_tree_bytes` ([`RevTree::held_bytes`],
/// `couchdb_max_tree_bytes`) is refused with [`ErrorKind::TooLarge`] where the tree is laid out
/// here.
pub async fn put_branch<B: DocumentBackend + ?Sized>(
    backend: &B,
    id: &str,
    incoming: &ReplicatedRevision,
    max_tree_bytes: usize,
) -> Result<ReplicatedOutcome> {
    if backend.keeps_branches() {
        return backend.put_branch(id, incoming, max_tree_bytes).await;
    }
    graft(backend, id, incoming, max_tree_bytes).await
}

/// Removes the other branches kept for every id starting with `prefix` (an erasure, after
/// [`DocumentBackend::erase_prefix`], which does not reach local documents).
pub async fn erase_branches<B: DocumentBackend + ?Sized>(backend: &B, prefix: &str) -> Result<()> {
    if backend.keeps_branches() {
        return backend.erase_branches(prefix).await;
    }
    erase_side_documents(backend, prefix).await
}

/// The tree of `id`: the record's revision (its path and body) and the leaves kept beside it.
/// `None` when nothing is stored for the id.
async fn read<B: DocumentBackend + ?Sized>(backend: &B, id: &str) -> Result<Option<ReadTree>> {
    for _ in 0..GRAFT_ATTEMPTS {
        if let Some(read) = read_once(backend, id).await? {
            return Ok(read);
        }
    }
    Err(Error::conflict(format!("document {id:?} kept changing while its revision tree was read")))
}

/// One consistent read; `None` (outer) when the record changed between its two reads.
async fn read_once<B: DocumentBackend + ?Sized>(backend: &B, id: &str) -> Result<Option<Option<ReadTree>>> {
    let record = backend.revisions(id).await?;
    let body = match &record {
        None => None,
        Some(info) => {
            let stored = if info.deleted { backend.get_deleted(id).await? } else { backend.get(id).await? };
            match stored {
                Some(doc) if doc.rev == info.rev => Some(doc.body),
                // A tombstone of an older layout may carry no body record.
                None if info.deleted => Some(Map::new()),
                _ => return Ok(None),
            }
        }
    };
    let side = backend.get_local(&side_name(id)).await?;
    let side_rev = side.as_ref().map(|doc| doc.rev.clone());
    let side_leaves = match &side {
        Some(doc) => leaves_of(id, &doc.body)?,
        None => Vec::new(),
    };
    let Some(info) = record else {
        // Leaves with no record are what an erasure left behind: nothing is stored.
        return Ok(Some(None));
    };
    let mut tree = RevTree::default();
    let path = RevPath { start: info.ancestry.start, ids: info.ancestry.ids.clone() };
    tree.merge(path, info.deleted, body.unwrap_or_default(), usize::MAX);
    for leaf in &side_leaves {
        tree.merge(leaf.path.clone(), leaf.deleted, leaf.body.clone(), usize::MAX);
    }
    Ok(Some(Some(ReadTree { tree, record: Some(info), side_rev, side_leaves })))
}

/// The other leaves a local document holds: in the stored form of a tree (each revision once,
/// [`StoredLeaves`]), or, as the previous release wrote them, an array of leaves with whole paths.
fn leaves_of(id: &str, body: &Map<String, Value>) -> Result<Vec<Leaf>> {
    let unreadable =
        |err: String| Error::new(ErrorKind::Corrupt, format!("the other leaves of {id:?} do not parse: {err}"));
    match body.get(LEAVES_FIELD) {
        None => Ok(Vec::new()),
        Some(leaves @ Value::Array(_)) => Vec::<Leaf>::deserialize(leaves).map_err(|err| unreadable(err.to_string())),
        Some(stored) => StoredTree::deserialize(stored)
            .map_err(|err| unreadable(err.to_string()))?
            .into_leaves()
            .map_err(unreadable),
    }
}

/// Merges a replicated revision into `id`'s tree, keeping every branch (CouchDB's
/// `new_edits: false`): `Applied` when it is the winner now, `KeptCurrent` when it is kept as a
/// losing leaf, `AlreadyKnown` when the tree held it. A merge that would grow the tree past
/// `max_tree_bytes` is refused (`TooLarge`), nothing written.
async fn graft<B: DocumentBackend + ?Sized>(
    backend: &B,
    id: &str,
    incoming: &ReplicatedRevision,
    max_tree_bytes: usize,
) -> Result<ReplicatedOutcome> {
    crate::backend::replicated::check(id, incoming)?;
    let path = path_of(incoming)?;
    for _ in 0..GRAFT_ATTEMPTS {
        // The usual replication: a revision the record knows, or a live child of the record's
        // revision, which wins over every other leaf (its generation is higher than the
        // winner's) and leaves them as they are: decided from the record alone.
        if let Some(record) = backend.revisions(id).await? {
            let known = record.rev == incoming.rev || record.ancestry.revisions().any(|rev| rev == incoming.rev);
            if known {
                return Ok(ReplicatedOutcome::AlreadyKnown);
            }
            let extends = incoming.ancestry.iter().any(|rev| rev == record.rev.as_str());
            if extends && !incoming.deleted {
                let write =
                    ReplicatedRevision { precondition: Precondition::MatchRevision(record.rev), ..incoming.clone() };
                match backend.put_replicated(id, &write).await? {
                    ReplicatedOutcome::Applied => return Ok(ReplicatedOutcome::Applied),
                    _ => continue,
                }
            }
        }
        let Some(current) = read(backend, id).await? else {
            let first = ReplicatedRevision { precondition: Precondition::MustNotExist, ..incoming.clone() };
            match backend.put_replicated(id, &first).await? {
                ReplicatedOutcome::Applied => return Ok(ReplicatedOutcome::Applied),
                _ => continue,
            }
        };
        let mut tree = current.tree.clone();
        let merged = tree.merge(path.clone(), incoming.deleted, incoming.body.clone(), SIDE_REVS_LIMIT);
        if merged == MergeOutcome::AlreadyKnown {
            return Ok(ReplicatedOutcome::AlreadyKnown);
        }
        check_tree_size(id, &current.tree, &tree, max_tree_bytes)?;
        match save(backend, id, &current, &tree, incoming).await? {
            Some(outcome) => return Ok(outcome),
            None => continue,
        }
    }
    Err(Error::conflict(format!(
        "Document update conflict: {GRAFT_ATTEMPTS} attempts met other writers of {id:?}; try again"
    )))
}

/// Saves the merged `tree` over `current`; `None` when another writer got in between.
async fn save<B: DocumentBackend + ?Sized>(
    backend: &B,
    id: &str,
    current: &ReadTree,
    tree: &RevTree,
    incoming: &ReplicatedRevision,
) -> Result<Option<ReplicatedOutcome>> {
    let record = current.record.as_ref().ok_or_else(|| Error::conflict("the record went away"))?;
    let leaves = tree.leaves();
    let winner = (*leaves.first().ok_or_else(|| Error::conflict("an empty tree"))?).clone();
    let winner_rev = winner.rev();
    let incoming_rev = incoming.rev.as_str();
    // A promotion: the winner is neither the record's revision nor the incoming one (the
    // incoming revision deleted the record's, and another leaf is the best left). The promoted
    // leaf stays beside the record until it is in the record.
    let promoted = winner_rev != record.rev.as_str() && winner_rev != incoming_rev;
    let side: Vec<Leaf> =
        leaves.iter().filter(|leaf| promoted || leaf.rev() != winner_rev).map(|leaf| (*leaf).clone()).collect();
    if !save_side(backend, id, current, side).await? {
        return Ok(None);
    }
    if winner_rev == record.rev.as_str() {
        // The record written again as it is, so the document moves in the change feed and a
        // replica downstream learns of the new leaf (CouchDB's feed moves on every tree change).
        let rewrite = ReplicatedRevision {
            rev: record.rev.clone(),
            ancestry: winner.path.revs(),
            deleted: winner.deleted,
            body: winner.body.clone(),
            precondition: Precondition::MatchRevision(record.rev.clone()),
        };
        // Not applied only when the record changed meanwhile: that write moved the document.
        backend.put_replicated(id, &rewrite).await?;
        return Ok(Some(ReplicatedOutcome::KeptCurrent));
    }
    let mut record_rev = record.rev.clone();
    let descends_from_record = incoming.ancestry.iter().any(|rev| rev == record.rev.as_str());
    if winner_rev == incoming_rev || descends_from_record {
        // The incoming revision goes to the record if it is still as read: it wins, or it
        // extends the record's revision (a deletion, after which the promoted leaf wins).
        let write = ReplicatedRevision { precondition: Precondition::MatchRevision(record_rev), ..incoming.clone() };
        if backend.put_replicated(id, &write).await? != ReplicatedOutcome::Applied {
            return Ok(None);
        }
        if !promoted {
            return Ok(Some(ReplicatedOutcome::Applied));
        }
        record_rev = incoming.rev.clone();
    }
    // The promoted leaf wins over what the record holds now (live over deleted, or the higher
    // of two deletions). Failing here leaves the promoted leaf beside the record, where the next
    // write of the document finds it and the tree's winner is computed anew.
    let promote = ReplicatedRevision {
        rev: Revision(winner_rev),
        ancestry: winner.path.revs(),
        deleted: winner.deleted,
        body: winner.body.clone(),
        precondition: Precondition::MatchRevision(record_rev),
    };
    match backend.put_replicated(id, &promote).await? {
        ReplicatedOutcome::Applied => Ok(Some(ReplicatedOutcome::KeptCurrent)),
        _ => Ok(None),
    }
}

/// Writes the local document of other leaves when they changed; `false` when it changed since it
/// was read.
async fn save_side<B: DocumentBackend + ?Sized>(
    backend: &B,
    id: &str,
    current: &ReadTree,
    side: Vec<Leaf>,
) -> Result<bool> {
    if side == current.side_leaves {
        return Ok(true);
    }
    let name = side_name(id);
    let outcome = match (&current.side_rev, side.is_empty()) {
        (None, true) => return Ok(true),
        (Some(rev), true) => backend.delete_local(&name, rev).await,
        (rev, false) => {
            let mut body = Map::new();
            body.insert(
                LEAVES_FIELD.into(),
                serde_json::to_value(StoredLeaves(&side))
                    .map_err(|err| Error::new(ErrorKind::Internal, err.to_string()))?,
            );
            let precondition = match rev {
                Some(rev) => Precondition::MatchRevision(rev.clone()),
                None => Precondition::MustNotExist,
            };
            backend.put_local(&name, &body, precondition).await.map(|_| ())
        }
    };
    match outcome {
        Ok(()) => Ok(true),
        Err(err) if err.is_conflict() || err.is_not_found() => Ok(false),
        Err(err) => Err(err),
    }
}

/// The path of an incoming (checked) revision: its ancestry as generation and ids.
fn path_of(incoming: &ReplicatedRevision) -> Result<RevPath> {
    let start = crate::backend::revision::generation_of(&incoming.rev)
        .ok_or_else(|| Error::invalid("_rev", format!("{:?} has no generation", incoming.rev.as_str())))?;
    let ids = incoming
        .ancestry
        .iter()
        .map(|rev| rev.split_once('-').map(|(_, id)| id.to_owned()))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| Error::invalid("_revisions", "an ancestry entry is not N-id"))?;
    Ok(RevPath { start, ids })
}

/// Removes the other leaves kept for every id starting with `prefix` (an erasure: `erase_prefix`
/// does not reach local documents). Page size of the listing.
const ERASE_PAGE: usize = 100;

/// The side documents of every id starting with `prefix`, removed page by page.
async fn erase_side_documents<B: DocumentBackend + ?Sized>(backend: &B, prefix: &str) -> Result<()> {
    let start = side_name(prefix);
    let range = crate::backend::IdRange {
        start: Some(start.clone()),
        end: None,
        inclusive_end: true,
        descending: false,
        include_design: false,
    };
    loop {
        let page = backend.local_docs(&range, ERASE_PAGE, None).await?;
        let mine: Vec<_> = page
            .items
            .into_iter()
            .filter(|doc| {
                doc.id.strip_prefix(crate::backend::LOCAL_PREFIX).is_some_and(|name| name.starts_with(&start))
            })
            .collect();
        if mine.is_empty() {
            return Ok(());
        }
        for doc in mine {
            let name = doc.id.strip_prefix(crate::backend::LOCAL_PREFIX).unwrap_or(&doc.id);
            match backend.delete_local(name, &doc.rev).await {
                Ok(()) => {}
                Err(err) if err.is_not_found() || err.is_conflict() => {}
                Err(err) => return Err(err),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn leaf(start: u64, ids: &[&str]) -> Leaf {
        let ids = ids.iter().map(|id| (*id).to_owned()).collect();
        Leaf { path: RevPath { start, ids }, deleted: false, body: Map::new() }
    }

    /// The other leaves are written with each revision once and read back as written; the
    /// previous release's array of leaves with whole paths is still read.
    #[test]
    fn side_leaves_are_stored_once_per_revision_and_read_in_either_form() {
        let side = vec![leaf(3, &["c", "b", "a"]), leaf(3, &["d", "b", "a"])];
        let stored = serde_json::to_value(StoredLeaves(&side)).unwrap();
        assert_eq!(stored["r"].as_array().map(Vec::len), Some(4), "a, b, c and d once each: {stored}");
        let mut body = Map::new();
        body.insert(LEAVES_FIELD.into(), stored);
        assert_eq!(leaves_of("x", &body).unwrap(), side);
        body.insert(LEAVES_FIELD.into(), serde_json::to_value(&side).unwrap());
        assert_eq!(leaves_of("x", &body).unwrap(), side);
        body.insert(LEAVES_FIELD.into(), json!({"r": [{"i": "a", "p": 3}], "l": [{"r": 0}]}));
        assert_eq!(leaves_of("x", &body).map_err(|err| err.kind()), Err(ErrorKind::Corrupt));
    }

    /// A new branch whose tree would pass the bound is refused; one that does not grow the tree
    /// (already past it) is not.
    #[test]
    fn a_tree_past_the_bound_is_refused_when_it_grows() {
        let mut body = Map::new();
        body.insert("big".into(), json!("x".repeat(1000)));
        let before = RevTree::default();
        let mut after = RevTree::default();
        after.merge(RevPath { start: 1, ids: vec!["a".into()] }, false, body, usize::MAX);
        let err = check_tree_size("x", &before, &after, 1000).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::TooLarge);
        assert!(err.to_string().contains("couchdb_max_tree_bytes (1000)"), "{err}");
        assert!(check_tree_size("x", &before, &after, 2000).is_ok(), "within the setting");
        assert!(check_tree_size("x", &after, &after, 1000).is_ok());
    }
}
