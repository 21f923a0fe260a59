//! The data-store database's tree layout: every branch of a data-store document's revision tree
//! (CouchDB's conflicts) on backends whose records hold one revision each. Every caller reaches a
//! data-store tree through this module ([`revision_tree`], [`has_branches`], [`put_branch`],
//! [`erase_branches`]); on a backend that keeps branches itself
//! ([`DocumentBackend::keeps_branches`]: the CouchDB backend) each forwards to the backend's own
//! method of the same name. Elsewhere the tree is laid out by [`DataStoreView`] (over a borrowed
//! backend: the free functions' calls: what the crash-repair rule needs, [`RepairableLayout`]),
//! and by
//! [`DataStoreLayout`], the same over the backend it owns: what the engine's data-store database
//! holds (`crate::database::Database::data_store`). Both write the same records.
//!
//! ## Storage
//! The document's record holds its winning revision, so everything that reads records (the REST
//! API, the facade, listings, counts, the index, the change feed) sees the winner and nothing
//! else, byte for byte as before this layout was the engine's. The other leaves of the tree, each
//! with its path and body, live in the local document `:leaves:{id}` ([`side_name`]). No client
//! can name it: a per-user login's local documents are named `{user}:…` and user ids are never
//! empty, and an admin's `_local/` names starting with [`SIDE_PREFIX`] are refused
//! ([`super::reserved_local_name`], which both the data-store face and the engine check). The leaves are stored as a tree is ([`StoredLeaves`]: each revision once); the array of
//! leaves with whole paths the previous release wrote is still read. The side document may hold
//! a leaf the record also holds, or an ancestor of a leaf: the tree is rebuilt from paths, so
//! such entries fall away on reading.
//!
//! ## Reads
//! A plain read of a document's winner ([`DataStoreView::read_served`]) and a listing with
//! documents ([`DataStoreView::listed_served`]) take a live record with no side document as its
//! stored text ([`Served::Alone`]): with no other leaf there is nothing to merge and no save to
//! finish, and the text is the answer's members as they are (issue 38). Every other document is
//! read as a tree.
//!
//! ## Writes
//! A replicated revision is merged into the tree read from both places with CouchDB's rules
//! ([`RevTree::merge`]) and the tree is saved ([`DataStoreLayout`]'s `save`). A save that leaves
//! the side document as it was is one write of the record. One that changes it (a new conflict,
//! a promotion, a resolved conflict: the rare writes) follows the engine's crash-repair rule
//! ([`super`]), in three steps:
//! 1. the side document is written with every leaf of the new tree and the mark
//!    [`UNFINISHED_FIELD`] (compare-and-swap on its revision as read);
//! 2. the record is brought to the new winner, each write on the record's revision: rewritten in
//!    place when it holds the winner already (a new losing leaf: the same revision, written again
//!    so that the document moves in the change feed, as in CouchDB, and a replica that read past
//!    it learns of the new branch); else, when the record's revision is no longer a leaf, the
//!    leaf that extends it first (a deletion of the winner), then the winner; when no leaf holds
//!    the record's revision (a purged winner), the record is erased and the winner written anew
//!    (a crash between leaves the marked side document with no record: a read of it still finds
//!    the tree and finishes the save);
//! 3. the side document is written again without the mark and without the winner.
//!
//! A crash after step 1 leaves the mark: the document's next write through this layout, and the
//! next read of its tree, save the tree read over itself, which does steps 2 and 3. The
//! cost of the rule: one more write (step 3) on the writes that change the side document.
//! A record or side revision that changed in between makes the write start again from a fresh
//! read ([`GRAFT_ATTEMPTS`]).

use std::sync::Arc;

use async_trait::async_trait;
use serde::Deserialize;
use serde_json::{Map, Value};

use super::{AnswerableWinner, KeptBodies, LaidOut, RepairableLayout, Served, TreeLayout};
use crate::backend::rev_tree::{Leaf, MergeOutcome, RevPath, RevTree, StoredLeaves, StoredTree};
use crate::backend::{
    DocumentBackend, EraseOptions, Precondition, RecordWithLocal, ReplicatedLeaf, ReplicatedOutcome,
    ReplicatedRevision, Revision, RevisionInfo, StoredDocument, StoredText,
};
use crate::error::{Error, ErrorKind, Result};

/// The start of every local document name that holds a document's other leaves.
pub const SIDE_PREFIX: &str = ":leaves:";
/// The field of that local document holding the leaves.
const LEAVES_FIELD: &str = "leaves";
/// The field of that local document marking a save not finished yet (step 1 done, the record not
/// yet brought to the winner): `true` when present. Absent from every side document a save
/// finished, so those are byte for byte what the previous release wrote.
pub const UNFINISHED_FIELD: &str = "unfinished";
/// Rounds of read, merge and save against other writers of one document before a conflict.
pub const GRAFT_ATTEMPTS: usize = 16;
/// How many revisions each side leaf's path keeps (CouchDB's default `_revs_limit`).
const SIDE_REVS_LIMIT: usize = crate::backend::DEFAULT_REVS_LIMIT;

/// The whole revision tree of a data-store document: its winner (the record every other call
/// reads) and every other leaf, each with its path and body. `None` when nothing is stored for
/// the id.
pub async fn revision_tree<B: DocumentBackend + ?Sized>(backend: &B, id: &str) -> Result<Option<RevTree>> {
    if backend.keeps_branches() {
        return backend.revision_tree(id).await;
    }
    Ok(super::read_repairing(&DataStoreView::new(backend), id).await?.map(|read| read.tree))
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

/// What a save of a data-store tree must match: the two places as read.
#[derive(Debug, Clone)]
pub struct SideToken {
    /// The record's revision (the winner, live or a tombstone) as read; `None`: no record.
    record: Option<RevisionInfo>,
    /// The revision of the local document holding the other leaves, `None`: there is none.
    side_rev: Option<Revision>,
    /// The leaves the local document held as read.
    side_leaves: Vec<Leaf>,
    /// Whether the local document carried the mark of an unfinished save.
    marked: bool,
}

impl SideToken {
    /// Whether the side document as read carried the mark of an unfinished save.
    pub fn marked(&self) -> bool {
        self.marked
    }
}

/// A data-store document's tree as read.
pub type ReadTree = LaidOut<SideToken>;

/// The data-store database's layout over the backend it owns (module doc): what the engine's
/// data-store database holds ([`crate::database::Database::data_store`]). Each call goes through
/// a [`DataStoreView`] of the backend, as the free functions here do, so both write the same
/// records.
pub struct DataStoreLayout {
    backend: Arc<dyn DocumentBackend>,
}

impl DataStoreLayout {
    pub fn new(backend: Arc<dyn DocumentBackend>) -> Self {
        DataStoreLayout { backend }
    }

    fn view(&self) -> DataStoreView<'_, dyn DocumentBackend> {
        DataStoreView::new(self.backend.as_ref())
    }

    /// [`DataStoreView::save_over`].
    pub(super) async fn save_over(&self, id: &str, token: Option<&SideToken>, tree: &RevTree) -> Result<()> {
        self.view().save_over(id, token, tree).await
    }

    /// [`DataStoreView::read_served`].
    pub(super) async fn read_served(&self, id: &str) -> Result<Option<Served<SideToken>>> {
        self.view().read_served(id).await
    }

    /// [`DataStoreView::listed_served`].
    pub(super) async fn listed_served(&self, documents: Vec<StoredText>) -> Result<Vec<(String, Served<SideToken>)>> {
        self.view().listed_served(documents).await
    }

    /// [`DataStoreView::save_records`].
    pub async fn save_records(&self, writes: &[RecordWrite<'_>]) -> Result<Vec<Result<()>>> {
        self.view().save_records(writes).await
    }

    /// [`DataStoreView::erase_of`].
    pub(super) async fn erase_of(&self, id: &str, token: &SideToken) -> Result<()> {
        self.view().erase_of(id, token).await
    }

    /// Whether a creation of `id` may skip the read ([`super::Layout::creates_unread`]): no side
    /// document is under the id. The save from nothing is then the record alone, written with
    /// `MustNotExist`, which a record or a tombstone under the id refuses; a side document
    /// (a save cut short before its record, the leaves an erasure left) sends the creation the
    /// reading way, which finishes or ignores it as every read does. One read (the side
    /// document) where a whole read is two (the record's revision, then the side document).
    pub(super) async fn creates_unread(&self, id: &str) -> Result<bool> {
        Ok(self.backend.get_local(&side_name(id)).await?.is_none())
    }
}

#[async_trait]
impl RepairableLayout for DataStoreLayout {
    type Token = SideToken;

    async fn read(&self, id: &str) -> Result<Option<ReadTree>> {
        self.view().read(id).await
    }

    async fn read_many(&self, ids: &[String]) -> Result<Vec<Option<ReadTree>>> {
        self.view().read_many(ids).await
    }

    async fn save(&self, id: &str, before: Option<&ReadTree>, tree: &RevTree) -> Result<()> {
        self.view().save(id, before, tree).await
    }

    async fn unfinished(&self, id: &str, state: &ReadTree) -> Result<bool> {
        self.view().unfinished(id, state).await
    }
}

#[async_trait]
impl TreeLayout for DataStoreLayout {
    async fn erase(&self, id: &str, state: &ReadTree) -> Result<()> {
        self.view().erase_of(id, &state.token).await
    }

    async fn listed(&self, documents: Vec<StoredDocument>) -> Result<Vec<(String, ReadTree)>> {
        self.view().listed(documents).await
    }

    /// None: the seed's layout has no place for an inner revision's body (a tree read holds its
    /// leaves' bodies only), so none is ever kept; a write carrying attachments is refused on
    /// the data-store database.
    fn kept_bodies(&self) -> Option<&dyn KeptBodies<Token = SideToken>> {
        None
    }
}

/// The data-store layout over a borrowed backend: what the free functions here (the facade's and
/// the data-store handlers' calls) and [`DataStoreLayout`] use.
pub struct DataStoreView<'a, B: ?Sized> {
    backend: &'a B,
}

impl<'a, B: DocumentBackend + ?Sized> DataStoreView<'a, B> {
    pub fn new(backend: &'a B) -> Self {
        DataStoreView { backend }
    }

    /// One consistent read; `None` (outer) when the record changed between its two reads.
    async fn read_once(&self, id: &str) -> Result<Option<Option<ReadTree>>> {
        let backend = self.backend;
        if let Some(read) = backend.record_with_local(id, &side_name(id)).await? {
            return Self::assembled_read(id, read).map(Some);
        }
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
        Self::assembled(id, record, body, side).map(Some)
    }

    /// The tree of `id` from its record and side document read in one snapshot
    /// ([`DocumentBackend::record_with_local`]): the body is the record's own, at the revision
    /// read.
    fn assembled_read(id: &str, read: RecordWithLocal) -> Result<Option<ReadTree>> {
        let (record, body) = match read.record {
            Some((info, json)) => (Some(info), Some(stored_body(id, &json)?)),
            None => (None, None),
        };
        Self::assembled(id, record, body, read.local)
    }

    /// One document as a plain read of its winner serves it ([`super::Layout::read_served`]):
    /// a live record with no side document is its winner alone, and no save of it is
    /// unfinished (the mark is in the side document), so its stored text is the answer
    /// ([`Served::Alone`], where [`AnswerableWinner::answerable`]); any other document is read as
    /// [`super::read_repairing`] reads it, from the same snapshot where the backend reads
    /// record and side together. `None`: nothing stored.
    pub async fn read_served(&self, id: &str) -> Result<Option<Served<SideToken>>> {
        let Some(read) = self.backend.record_with_local(id, &side_name(id)).await? else {
            return Ok(super::read_repairing(self, id).await?.map(Served::State));
        };
        let read = match read {
            RecordWithLocal { record: Some((info, json)), local: None } if !info.deleted => {
                match AnswerableWinner::answerable(info.rev, json) {
                    Some(text) => return Ok(Some(Served::Alone(text))),
                    None => return Ok(super::read_repairing(self, id).await?.map(Served::State)),
                }
            }
            read => read,
        };
        let state = Self::assembled_read(id, read)?;
        Ok(super::finished(self, id, state).await.map(Served::State))
    }

    /// A listing's page of live records as [`Self::listed`] would list them, but each record
    /// with no side document (one batched read of them) as its stored text ([`Served::Alone`]:
    /// issue 38, a data-store `_all_docs` with documents parsed each body, copied it into its
    /// row and wrote it again); the others' trees read as `listed` reads them.
    pub async fn listed_served(&self, documents: Vec<StoredText>) -> Result<Vec<(String, Served<SideToken>)>> {
        let side_names: Vec<String> = documents.iter().map(|doc| side_name(&doc.id)).collect();
        let sides = self.backend.get_many_local(&side_names).await?;
        let mut listed: Vec<(String, Option<Served<SideToken>>)> = Vec::with_capacity(documents.len());
        let mut branched = Vec::new();
        for (doc, side) in documents.into_iter().zip(sides) {
            let alone = match side {
                None => AnswerableWinner::answerable(doc.rev, doc.json),
                Some(_) => None,
            };
            if alone.is_none() {
                branched.push(doc.id.clone());
            }
            listed.push((doc.id, alone.map(Served::Alone)));
        }
        let mut trees = self.read_batched(&branched).await?.into_iter();
        let mut served = Vec::with_capacity(listed.len());
        for (id, alone) in listed {
            let item = match alone {
                Some(alone) => Some(alone),
                // Deleted meanwhile: left out, as `listed` leaves it out.
                None => trees.next().flatten().filter(|state| !state.deleted()).map(Served::State),
            };
            served.extend(item.map(|item| (id, item)));
        }
        Ok(served)
    }

    /// The tree of `id` from its record's revision, the record's body (when the record is
    /// there) and its side document, as read.
    fn assembled(
        id: &str,
        record: Option<RevisionInfo>,
        body: Option<Map<String, Value>>,
        side: Option<StoredDocument>,
    ) -> Result<Option<ReadTree>> {
        let side_rev = side.as_ref().map(|doc| doc.rev.clone());
        let (side_leaves, marked) = match &side {
            Some(doc) => (leaves_of(id, &doc.body)?, doc.body.get(UNFINISHED_FIELD) == Some(&Value::Bool(true))),
            None => (Vec::new(), false),
        };
        let mut tree = RevTree::default();
        match &record {
            Some(info) => {
                let path = RevPath { start: info.ancestry.start, ids: info.ancestry.ids.clone() };
                tree.merge(path, info.deleted, body.unwrap_or_default(), usize::MAX);
            }
            // A marked side document with no record is a save cut before its record write (one
            // that erased the record of a purged winner, or a first save with several leaves):
            // the side holds the whole tree, and finishing the save writes the record. Unmarked
            // leaves with no record are what an erasure left behind: nothing is stored.
            None if marked && !side_leaves.is_empty() => {}
            None => return Ok(None),
        }
        for leaf in &side_leaves {
            tree.merge(leaf.path.clone(), leaf.deleted, leaf.body.clone(), usize::MAX);
        }
        let token = SideToken { record, side_rev, side_leaves, marked };
        Ok(Some(LaidOut { tree, token }))
    }

    /// The trees of `ids` in three batched reads (every record's revision, every side
    /// document, the live records' bodies) instead of two or three reads per id: a page of 100
    /// took 300 backend calls (issue 38: the data-store `_all_docs` of 100 with its documents
    /// ran at a fraction of the other databases'). An id whose body read does not hold the
    /// revision read (written in between), or whose record is a tombstone, is read again alone
    /// as [`RepairableLayout::read`] reads it.
    async fn read_batched(&self, ids: &[String]) -> Result<Vec<Option<ReadTree>>> {
        self.read_batched_over(ids, None).await
    }

    /// [`Self::read_batched`], with the live records' bodies already read (`listed`: a listing's
    /// page, in the order of `ids`) instead of read again; each is used only where it holds the
    /// revision the batched read finds, as a body read separately is.
    async fn read_batched_over(
        &self,
        ids: &[String],
        listed: Option<Vec<StoredDocument>>,
    ) -> Result<Vec<Option<ReadTree>>> {
        let side_names: Vec<String> = ids.iter().map(|id| side_name(id)).collect();
        let (records, sides) =
            tokio::try_join!(self.backend.revisions_many(ids), self.backend.get_many_local(&side_names))?;
        let mut bodies = match listed {
            Some(listed) => {
                // Only the bodies of records still live, in the order `get_many` would give them.
                let live = listed
                    .into_iter()
                    .zip(&records)
                    .filter_map(|(doc, record)| record.as_ref().is_some_and(|info| !info.deleted).then_some(Some(doc)));
                live.collect::<Vec<_>>().into_iter()
            }
            None => {
                let live: Vec<String> = ids
                    .iter()
                    .zip(&records)
                    .filter(|(_, record)| record.as_ref().is_some_and(|info| !info.deleted))
                    .map(|(id, _)| id.clone())
                    .collect();
                self.backend.get_many(&live).await?.into_iter()
            }
        };
        let mut trees = Vec::with_capacity(ids.len());
        for ((id, record), side) in ids.iter().zip(records).zip(sides) {
            let tree = match record {
                None => Self::assembled(id, None, None, side)?,
                Some(info) if !info.deleted => match bodies.next().flatten() {
                    Some(doc) if doc.rev == info.rev => Self::assembled(id, Some(info), Some(doc.body), side)?,
                    _ => self.read(id).await?,
                },
                Some(_) => self.read(id).await?,
            };
            trees.push(tree);
        }
        Ok(trees)
    }

    /// Writes the side document with `leaves` (and the mark when `unfinished`) over `rev`, or
    /// deletes it when there is nothing to keep; its new revision. `Conflict` when it changed
    /// since it was read.
    async fn write_side(
        &self,
        id: &str,
        rev: Option<&Revision>,
        leaves: &[Leaf],
        unfinished: bool,
    ) -> Result<Option<Revision>> {
        let name = side_name(id);
        let written = if leaves.is_empty() && !unfinished {
            match rev {
                None => return Ok(None),
                Some(rev) => self.backend.delete_local(&name, rev).await.map(|()| None),
            }
        } else {
            let mut body = Map::new();
            body.insert(
                LEAVES_FIELD.into(),
                serde_json::to_value(StoredLeaves(leaves))
                    .map_err(|err| Error::new(ErrorKind::Internal, err.to_string()))?,
            );
            if unfinished {
                body.insert(UNFINISHED_FIELD.into(), Value::Bool(true));
            }
            let precondition = match rev {
                Some(rev) => Precondition::MatchRevision(rev.clone()),
                None => Precondition::MustNotExist,
            };
            self.backend.put_local(&name, &body, precondition).await.map(Some)
        };
        written.map_err(|err| {
            if err.is_conflict() || err.is_not_found() {
                Error::conflict(format!("the other leaves of {id:?} changed under this write"))
            } else {
                err
            }
        })
    }

    /// Writes `leaf` to the record over `expected` (`None`: no record); `Conflict` when the record
    /// is no longer as read.
    async fn write_record(&self, id: &str, leaf: &Leaf, expected: Option<&Revision>) -> Result<()> {
        let head = record_head(leaf, expected);
        let written =
            self.backend.put_replicated_leaves(&[ReplicatedLeaf { id, head: &head, body: &leaf.body }]).await?;
        match written.into_iter().next() {
            Some(outcome) => record_written(id, outcome?),
            None => Err(Error::new(ErrorKind::Internal, "the backend answered a record write with no outcome")),
        }
    }

    /// The saves of many documents whose saves are each one write of the record
    /// ([`record_write_of`]), in one backend call
    /// ([`DocumentBackend::put_replicated_leaves`]): on the embedded store one job of its group
    /// commit, so a data-store `_bulk_docs` is made durable by one commit, as another database's
    /// bulk write is (issue 38: a job per document met the group commit in two groups or more,
    /// 1.79 fsyncs per request). Each answered as [`Self::save_over`] answers it (`Conflict`
    /// when the record is no longer as read); the outer error fails them all.
    pub async fn save_records(&self, writes: &[RecordWrite<'_>]) -> Result<Vec<Result<()>>> {
        let leaves: Vec<ReplicatedLeaf<'_>> =
            writes.iter().map(|write| ReplicatedLeaf { id: write.id, head: &write.head, body: write.body }).collect();
        let written = self.backend.put_replicated_leaves(&leaves).await?;
        if written.len() != writes.len() {
            return Err(Error::new(ErrorKind::Internal, "the backend answered record writes with too few outcomes"));
        }
        Ok(writes.iter().zip(written).map(|(write, outcome)| record_written(write.id, outcome?)).collect())
    }

    /// Saves `tree` over the places as read (`token`; `None`: nothing was stored): the module
    /// doc's three steps where the side document changes, else the record alone ([`record_write_of`]
    /// says which saves are that one write).
    pub async fn save_over(&self, id: &str, token: Option<&SideToken>, tree: &RevTree) -> Result<()> {
        let winner_rev = tree.winner().map(Leaf::rev);
        let final_side: Vec<Leaf> =
            tree.leaves().into_iter().filter(|leaf| Some(leaf.rev()) != winner_rev).cloned().collect();
        let (record, side_rev, side_leaves, marked) = match token {
            Some(token) => (token.record.as_ref(), token.side_rev.clone(), &token.side_leaves[..], token.marked),
            None => (None, None, &[][..], false),
        };
        if !marked && final_side == side_leaves {
            return self.bring_record_to_winner(id, record, tree).await;
        }
        let every_leaf: Vec<Leaf> = tree.leaves().into_iter().cloned().collect();
        // Finishing a save step 1 of which is stored as this one would write it: on from step 2.
        let marked_rev = if marked && side_leaves == every_leaf.as_slice() {
            side_rev
        } else {
            self.write_side(id, side_rev.as_ref(), &every_leaf, true).await?
        };
        self.bring_record_to_winner(id, record, tree).await?;
        self.write_side(id, marked_rev.as_ref(), &final_side, false).await.map(|_| ())
    }

    /// The side document first, then the record: a crash in between leaves the winner alone,
    /// never leaves beside no record that a later creation of the id would take up. Each only as
    /// read, so a write another process made since survives (`Conflict`, and the purge reads
    /// again): the side on its revision, the record on its own ([`EraseOptions`]). Read with no
    /// record (a marked side, a save cut before its record write), the record a save finishing
    /// it meanwhile wrote, the side's winner, is erased too; any other is a writer's.
    pub async fn erase_of(&self, id: &str, token: &SideToken) -> Result<()> {
        if let Some(rev) = &token.side_rev {
            match self.backend.delete_local(&side_name(id), rev).await {
                Ok(()) => {}
                Err(err) if err.is_not_found() => {}
                Err(err) if err.is_conflict() => return Err(Error::conflict("the other leaves changed")),
                Err(err) => return Err(err),
            }
        }
        let expected = match &token.record {
            Some(record) => record.rev.clone(),
            None => match self.backend.revisions(id).await? {
                None => return Ok(()),
                Some(stored) if Some(stored.rev.as_str()) == winner_of(&token.side_leaves).as_deref() => stored.rev,
                Some(_) => return Err(Error::conflict(format!("document {id:?} was written under this purge"))),
            },
        };
        self.erase_record(id, expected).await
    }

    /// The record erased only while it holds `expected` (`Conflict` otherwise, nothing erased).
    async fn erase_record(&self, id: &str, expected: Revision) -> Result<()> {
        match self.backend.erase_id(id, &EraseOptions::if_revision(expected)).await {
            Ok(_) => Ok(()),
            Err(err) if err.is_conflict() || err.is_not_found() => {
                Err(Error::conflict(format!("the record of {id:?} changed under this write")))
            }
            Err(err) => Err(err),
        }
    }

    /// Each listed record's whole tree, read again with its other leaves (the listing holds the
    /// winner only; [`RepairableLayout::read_many`]); those deleted meanwhile are left out.
    /// The listing's bodies are used where they still hold the record's revision (a page of
    /// 100 decoded each body twice: issue 38).
    pub async fn listed(&self, documents: Vec<StoredDocument>) -> Result<Vec<(String, ReadTree)>> {
        let ids: Vec<String> = documents.iter().map(|doc| doc.id.clone()).collect();
        let states = self.read_batched_over(&ids, Some(documents)).await?;
        Ok(ids
            .into_iter()
            .zip(states)
            .filter_map(|(id, state)| state.filter(|state| !state.deleted()).map(|state| (id, state)))
            .collect())
    }

    /// The record, holding `expected`, erased and `winner` written in its place: a record moved
    /// to a leaf that does not descend from it (its own revision purged). Erased only while it
    /// still holds `expected`, checked by the backend in the erasure; a crash between the two
    /// leaves no record beside the marked side document, which a read finishes
    /// ([`Self::read_once`]).
    async fn replace_record(&self, id: &str, expected: &Revision, winner: &Leaf) -> Result<()> {
        self.erase_record(id, expected.clone()).await?;
        self.write_record(id, winner, None).await
    }

    /// Step 2 of a save: the record brought to `tree`'s winner from what it held as read.
    async fn bring_record_to_winner(&self, id: &str, record: Option<&RevisionInfo>, tree: &RevTree) -> Result<()> {
        let winner = tree.winner().ok_or_else(|| Error::conflict(format!("the tree of {id:?} has no leaf")))?;
        let Some(record) = record else { return self.write_record(id, winner, None).await };
        let mut current = record.rev.clone();
        let on_winner_branch = winner.path.revs().iter().any(|rev| *rev == current.as_str());
        if !on_winner_branch && tree.leaf(current.as_str()).is_none() {
            // The record's revision was extended off the winner's branch (the winner deleted, a
            // conflict promoted): that leaf goes to the record first, which the winner then beats.
            let extension =
                tree.leaves().into_iter().find(|leaf| leaf.path.revs().iter().any(|rev| *rev == current.as_str()));
            match extension {
                Some(extension) => {
                    self.write_record(id, extension, Some(&current)).await?;
                    current = Revision(extension.rev());
                }
                // No leaf holds the record's revision (it was purged): the record cannot move to
                // a leaf it would beat, so it is erased and the winner written anew. The side
                // document holds the whole tree with the mark meanwhile (step 1).
                None => return self.replace_record(id, &current, winner).await,
            }
        }
        // Written also when the record holds the winner already: rewritten in place, the
        // document moves in the change feed.
        self.write_record(id, winner, Some(&current)).await
    }
}

#[async_trait]
impl<B: DocumentBackend + ?Sized> RepairableLayout for DataStoreView<'_, B> {
    type Token = SideToken;

    /// The tree of `id`: the record's revision (its path and body) and the leaves kept beside it.
    async fn read(&self, id: &str) -> Result<Option<ReadTree>> {
        for _ in 0..GRAFT_ATTEMPTS {
            if let Some(read) = self.read_once(id).await? {
                return Ok(read);
            }
        }
        Err(Error::conflict(format!("document {id:?} kept changing while its revision tree was read")))
    }

    /// Each id's tree, as [`RepairableLayout::read`] reads it, in batched reads
    /// ([`DataStoreView::read_batched`]), in order.
    async fn read_many(&self, ids: &[String]) -> Result<Vec<Option<ReadTree>>> {
        self.read_batched(ids).await
    }

    async fn save(&self, id: &str, before: Option<&ReadTree>, tree: &RevTree) -> Result<()> {
        self.save_over(id, before.map(|read| &read.token), tree).await
    }

    async fn unfinished(&self, _id: &str, state: &ReadTree) -> Result<bool> {
        Ok(state.token.marked)
    }
}

/// One save that is one write of the record: the document's id, the winner's revision (with
/// the precondition on the record as read) and its body, borrowed from the tree.
pub struct RecordWrite<'t> {
    pub id: &'t str,
    head: ReplicatedRevision,
    body: &'t Map<String, Value>,
}

/// The one record write that saving `tree` over `token` is, when that is all it is: the side
/// document stays as read and carries no mark, and the record holds nothing or a revision on
/// the winner's branch (or a leaf of the tree), so that [`DataStoreView::save_over`] would write
/// the winner to the record and nothing else. A new document's save, and an edit of one without
/// conflicts: nearly every save. `None` for a save of more steps (module doc), which goes through
/// `save_over`.
pub fn record_write_of<'t>(id: &'t str, token: Option<&SideToken>, tree: &'t RevTree) -> Option<RecordWrite<'t>> {
    let (winner, expected) = record_write_target(token, tree)?;
    Some(RecordWrite { id, head: record_head(winner, expected), body: &winner.body })
}

/// Whether saving `tree` over `token` is one record write ([`record_write_of`] is `Some`),
/// decided without writing that write's head.
pub fn is_record_write(token: Option<&SideToken>, tree: &RevTree) -> bool {
    record_write_target(token, tree).is_some()
}

/// The leaf [`record_write_of`] writes and the record revision it writes over (`None`: no
/// record), when the save is that one write. Decided from the paths as they are: no revision
/// written out as text (a data-store `_bulk_docs` decided it twice per document, issue 38).
fn record_write_target<'t, 'k>(
    token: Option<&'k SideToken>,
    tree: &'t RevTree,
) -> Option<(&'t Leaf, Option<&'k Revision>)> {
    let winner = tree.winner()?;
    let (record, side_leaves, marked) = match token {
        Some(token) => (token.record.as_ref(), &token.side_leaves[..], token.marked),
        None => (None, &[][..], false),
    };
    if marked {
        return None;
    }
    let leaves = tree.leaves();
    let mut others = leaves.iter().filter(|leaf| !leaf.path.same_leaf_rev(&winner.path));
    let side_unchanged = side_leaves.iter().all(|side| others.next().is_some_and(|leaf| *leaf == side));
    if !side_unchanged || others.next().is_some() {
        return None;
    }
    let expected = match record {
        None => None,
        Some(record) => {
            let current = record.rev.as_str();
            if !winner.path.holds(current) && tree.leaf(current).is_none() {
                return None;
            }
            Some(&record.rev)
        }
    };
    Some((winner, expected))
}

/// A record write of `leaf` without its body, over `expected` (`None`: no record).
fn record_head(leaf: &Leaf, expected: Option<&Revision>) -> ReplicatedRevision {
    let precondition = match expected {
        Some(rev) => Precondition::MatchRevision(rev.clone()),
        None => Precondition::MustNotExist,
    };
    ReplicatedRevision {
        rev: Revision(leaf.rev()),
        ancestry: leaf.path.revs(),
        deleted: leaf.deleted,
        body: Map::new(),
        precondition,
    }
}

/// A record write's answer: only `Applied` wrote it; any other outcome is the record no longer
/// as read.
fn record_written(id: &str, outcome: ReplicatedOutcome) -> Result<()> {
    match outcome {
        ReplicatedOutcome::Applied => Ok(()),
        _ => Err(Error::conflict(format!("the record of {id:?} changed under this write"))),
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
    let layout = DataStoreView::new(backend);
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
        let current = layout.read(id).await?;
        let mut tree = current.as_ref().map(|read| read.tree.clone()).unwrap_or_default();
        let merged = tree.merge(path.clone(), incoming.deleted, incoming.body.clone(), SIDE_REVS_LIMIT);
        let changed = merged != MergeOutcome::AlreadyKnown;
        if !super::must_save(&layout, id, current.as_ref(), changed).await? {
            return Ok(ReplicatedOutcome::AlreadyKnown);
        }
        let empty = RevTree::default();
        check_tree_size(id, current.as_ref().map_or(&empty, |read| &read.tree), &tree, max_tree_bytes)?;
        match layout.save(id, current.as_ref(), &tree).await {
            Ok(()) => {}
            Err(err) if err.is_conflict() => continue,
            Err(err) => return Err(err),
        }
        return Ok(match tree.winner() {
            _ if !changed => ReplicatedOutcome::AlreadyKnown,
            Some(winner) if winner.rev() == incoming.rev.as_str() => ReplicatedOutcome::Applied,
            _ => ReplicatedOutcome::KeptCurrent,
        });
    }
    Err(Error::conflict(format!(
        "Document update conflict: {GRAFT_ATTEMPTS} attempts met other writers of {id:?}; try again"
    )))
}

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

/// The revision of the winner among `leaves` (CouchDB's rule, [`RevTree::winner`]): what the
/// record holds once a save of a tree with only these leaves is finished.
fn winner_of(leaves: &[Leaf]) -> Option<String> {
    let mut tree = RevTree::default();
    for leaf in leaves {
        tree.merge(leaf.path.clone(), leaf.deleted, Map::new(), usize::MAX);
    }
    tree.winner().map(Leaf::rev)
}

/// A record's body from its stored text ([`RecordWithLocal`]): empty text (a tombstone without
/// fields) is the empty body.
fn stored_body(id: &str, json: &[u8]) -> Result<Map<String, Value>> {
    if json.is_empty() {
        return Ok(Map::new());
    }
    crate::model::depth::parse_stored(json)
        .map_err(|e| Error::new(ErrorKind::Corrupt, format!("the record of {id:?} holds no JSON object: {e}")))
}

/// The local document that holds `id`'s other leaves.
pub fn side_name(id: &str) -> String {
    format!("{SIDE_PREFIX}{id}")
}

/// The other leaves a local document holds: in the stored form of a tree (each revision once,
/// [`StoredLeaves`]), or, as the previous release wrote them, an array of leaves with whole paths.
fn leaves_of(id: &str, body: &Map<String, Value>) -> Result<Vec<Leaf>> {
    let unreadable =
        |err: String| Error::new(ErrorKind::Corrupt, format!("the other leaves of {id:?} do not parse: {err}"));
    match body.get(LEAVES_FIELD) {
        None => Ok(Vec::new()),
        Some(leaves @ Value::Array(_)) => Vec::<Leaf>::deserialize(leaves).map_err(|err| unreadable(err.to_string())),
        Some(stored) => StoredTree::<Map<String, Value>>::deserialize(stored)
            .map_err(|err| unreadable(err.to_string()))?
            .into_leaves()
            .map_err(unreadable),
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
