//! The engine's tree layout, every database but the data-store one: a document whose winning
//! leaf is live is one backend record under its own id, body `{"revtree": <RevTree>}` (every leaf
//! with its body); a document whose winning leaf is deleted is a backend tombstone, its tree kept
//! in the local document `tree:{id}` ([`TREE_PREFIX`]). The record is the authority: a live record
//! always holds the whole tree (even with a deleted winner, left by a crash in the middle of a
//! deletion: it reads as deleted), the local tree is read only where there is no live record.
//!
//! A save from a live record is one compare-and-swap on the record's revision (then, for a
//! deletion, the local tree and the tombstone carry the tree on); a save from a tombstone or
//! nothing writes the local tree first (on its revision as read), then the record: the side
//! place first, the record last, as the engine's crash-repair rule wants ([`super`]). The one
//! exception is a live creation where nothing was read, on a backend that checks
//! [`Precondition::NeverWritten`] in the write: the record alone, as the bulk path creates. A local
//! tree with neither a live record nor the tombstone after it is an unfinished save
//! ([`RepairableLayout::unfinished`]), and so is a live record holding a deleted winner (a deletion
//! cut before its tombstone); saving the tree read over itself finishes either.
//! docs/design/crash-points.md has every step and crash point.

use std::collections::HashSet;
use std::sync::Arc;

use async_trait::async_trait;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::{KeptBodies, LaidOut, RepairableLayout, ScanCursor, ScanPage, TreeLayout};
use crate::backend::rev_tree::{RevTree, RevTreeOutline, WinnerText};
use crate::backend::{DocumentBackend, EraseOptions, IdRange, Precondition, Revision, StoredDocument, StoredText};
use crate::database::doc_attachments;
use crate::error::{Error, ErrorKind, Result};

/// The one field of a backend record: the revision tree (the documents' own fields are inside
/// it, so nothing can collide with it; not `_`-prefixed, which a CouchDB backend would refuse).
const TREE_FIELD: &str = "revtree";
/// The local-document names holding the trees of deleted documents.
pub(in crate::database) const TREE_PREFIX: &str = "tree:";

/// What a save of the engine's layout must match.
#[derive(Debug, Clone, Default)]
pub struct RecordToken {
    /// The live backend record's revision (`None`: a tombstone, or never written).
    pub(in crate::database) record_rev: Option<Revision>,
    /// For a tombstone, the revision of its local tree record as read with it: a write from the
    /// tombstone is serialized on it.
    pub(in crate::database) local_rev: Option<Revision>,
}

/// A document's tree as the engine's layout read it.
pub type RecordState = LaidOut<RecordToken>;

/// The engine's layout over one database's backend (module doc).
pub struct RecordLayout {
    backend: Arc<dyn DocumentBackend>,
}

impl RecordLayout {
    pub fn new(backend: Arc<dyn DocumentBackend>) -> Self {
        RecordLayout { backend }
    }

    /// Whether a save from nothing is the record alone ([`Self::save_over`]): the backend checks
    /// [`Precondition::NeverWritten`] in the write.
    fn checks_never_written(&self) -> bool {
        self.backend.checks_never_written()
    }

    /// Whether a creation of `id` may skip the read ([`super::Layout::creates_unread`]): a save
    /// from nothing is the record alone and no local tree is under the id. A record or a
    /// tombstone under it fails the save (`NeverWritten`); a local tree written after this check
    /// is another writer's save from nothing or from a tombstone, whose record then fails (or
    /// fails this one), or a save cut short before it was acknowledged.
    pub(super) async fn creates_unread(&self, id: &str) -> Result<bool> {
        if !self.checks_never_written() {
            return Ok(false);
        }
        Ok(self.backend.get_local(&format!("{TREE_PREFIX}{id}")).await?.is_none())
    }

    /// The state a live record (`rev`, `body`) holds.
    pub(in crate::database) fn state_of_record(
        id: &str,
        rev: Revision,
        body: &Map<String, Value>,
    ) -> Result<RecordState> {
        Ok(LaidOut { tree: tree_of(body, id)?, token: RecordToken { record_rev: Some(rev), local_rev: None } })
    }

    /// The state of a live record at `rev` holding `tree`.
    fn state_of_tree(rev: Revision, tree: RevTree) -> RecordState {
        LaidOut { tree, token: RecordToken { record_rev: Some(rev), local_rev: None } }
    }

    /// The live records of `ids` in one batched read, each tree read as `T`: straight from the
    /// stored text where the backend keeps it (no `Value` tree in between), else from the
    /// decoded body by `from_body`.
    async fn records<T: Into<RevTree> + serde::de::DeserializeOwned>(
        &self,
        ids: &[String],
        from_body: fn(&Map<String, Value>, &str) -> Result<T>,
    ) -> Result<Vec<Option<(Revision, RevTree)>>> {
        let too_few = || Error::new(ErrorKind::Internal, "the backend answered a batched read with too few documents");
        if let Some(texts) = self.backend.get_many_text(ids).await? {
            if texts.len() != ids.len() {
                return Err(too_few());
            }
            let parsed = texts.into_iter().zip(ids).map(|(text, id)| match text {
                Some(text) => Ok(Some((text.rev, tree_of_text::<T>(&text.json, id)?.into()))),
                None => Ok(None),
            });
            return parsed.collect();
        }
        let records = self.backend.get_many(ids).await?;
        if records.len() != ids.len() {
            return Err(too_few());
        }
        let parsed = records.into_iter().zip(ids).map(|(record, id)| match record {
            Some(record) => Ok(Some((record.rev, from_body(&record.body, id)?.into()))),
            None => Ok(None),
        });
        parsed.collect()
    }

    /// [`RepairableLayout::read_many`] with each live record's tree read as `T`
    /// ([`Self::records`]); the local trees of deleted documents are read whole.
    async fn read_many_as<T: Into<RevTree> + serde::de::DeserializeOwned>(
        &self,
        ids: &[String],
        from_body: fn(&Map<String, Value>, &str) -> Result<T>,
    ) -> Result<Vec<Option<RecordState>>> {
        let records = self.records::<T>(ids, from_body).await?;
        let without_record: Vec<String> = ids
            .iter()
            .zip(&records)
            .filter(|(_, record)| record.is_none())
            .map(|(id, _)| format!("{TREE_PREFIX}{id}"))
            .collect();
        let mut trees = if without_record.is_empty() {
            Vec::new().into_iter()
        } else {
            let trees = self.backend.get_many_local(&without_record).await?;
            if trees.len() != without_record.len() {
                return Err(Error::new(ErrorKind::Internal, "the backend answered a batched read with too few trees"));
            }
            trees.into_iter()
        };
        let mut states = Vec::with_capacity(ids.len());
        for (id, record) in ids.iter().zip(records) {
            states.push(match record {
                Some((rev, tree)) => Some(Self::state_of_tree(rev, tree)),
                None => match trees.next().flatten() {
                    Some(local) => Some(Self::state_of_tombstone(id, local.rev, &local.body)?),
                    None => None,
                },
            });
        }
        Ok(states)
    }

    /// The states of `ids` as [`RepairableLayout::read_many`] reads them, but each live record's
    /// tree without its bodies ([`RevTreeOutline`]): for readers that show revisions only (a
    /// `_changes` row). Never to be saved.
    pub(in crate::database) async fn read_many_outlines(&self, ids: &[String]) -> Result<Vec<Option<RecordState>>> {
        self.read_many_as::<RevTreeOutline>(ids, |body, id| tree_of(body, id).map(RevTreeOutline)).await
    }

    /// The winning leaf of each live record of `ids` read from the record's stored text with its
    /// body unparsed ([`WinnerText`]), one answer per id (`None`: no live record; the tree, if
    /// any, is in a local document, read by [`RepairableLayout::read_many`]); `None` when the
    /// backend keeps no such text. For a view build's map input; never saved.
    pub(in crate::database) async fn winner_texts(&self, ids: &[String]) -> Result<Option<Vec<Option<WinnerText>>>> {
        let Some(texts) = self.backend.get_many_text(ids).await? else { return Ok(None) };
        if texts.len() != ids.len() {
            return Err(Error::new(ErrorKind::Internal, "the backend answered a batched read with too few documents"));
        }
        let parsed = texts.into_iter().zip(ids).map(|(text, id)| match text {
            Some(text) => tree_of_text::<WinnerText>(&text.json, id).map(Some),
            None => Ok(None),
        });
        parsed.collect::<Result<Vec<_>>>().map(Some)
    }

    /// [`TreeLayout::listed`] from the stored text of each record
    /// ([`DocumentBackend::all_docs_stored_text`]).
    pub(in crate::database) fn listed_text(documents: Vec<StoredText>) -> Result<Vec<(String, RecordState)>> {
        let mut listed = Vec::with_capacity(documents.len());
        for StoredText { id, rev, json } in documents {
            let tree = tree_of_text::<RevTree>(&json, &id)?;
            listed.push((id, Self::state_of_tree(rev, tree)));
        }
        Ok(listed)
    }

    /// The state a local tree (`rev`, `body`) holds, for an id without a live record.
    fn state_of_tombstone(id: &str, rev: Revision, body: &Map<String, Value>) -> Result<RecordState> {
        Ok(LaidOut { tree: tree_of(body, id)?, token: RecordToken { record_rev: None, local_rev: Some(rev) } })
    }

    /// Every save is serialized on one compare-and-swap: from a live record, on the record's
    /// revision (the new tree goes into the record first, even when its winner is deleted);
    /// from a tombstone (or nothing), on the revision of the tombstone's local tree read with it.
    /// Whoever passes it holds every leaf acknowledged before; the writes after it (the local
    /// tree, the tombstone) only carry that tree on, and a later writer that overtakes them has
    /// read it already.
    pub(super) async fn save_over(&self, id: &str, token: Option<&RecordToken>, tree: &RevTree) -> Result<()> {
        let live = tree.winner().is_some_and(|leaf| !leaf.deleted);
        let tree_name = format!("{TREE_PREFIX}{id}");
        match token.and_then(|t| t.record_rev.clone()) {
            Some(rev) => {
                let next = self
                    .backend
                    .put_text(id, &record_text(tree)?, Precondition::MatchRevision(rev))
                    .await
                    .map_err(gone_is_conflict)?;
                if !live {
                    let record = record_of(tree)?;
                    // The record now holds the tree with its deleted winner (reads treat it as
                    // deleted); the local tree and the tombstone follow. Either may meet a later
                    // writer, who read this tree from the record and carries it on: then this
                    // write is done.
                    let precondition = match self.backend.get_local(&tree_name).await? {
                        Some(local) => Precondition::MatchRevision(local.rev),
                        None => Precondition::MustNotExist,
                    };
                    match self.backend.put_local(&tree_name, &record, precondition).await {
                        Ok(_) => {}
                        Err(err) if err.kind() == ErrorKind::Conflict => return Ok(()),
                        Err(err) => return Err(err),
                    }
                    match self.backend.delete(id, &next).await {
                        Ok(_) => {}
                        Err(err) if matches!(err.kind(), ErrorKind::Conflict | ErrorKind::NotFound) => {}
                        Err(err) => return Err(err),
                    }
                }
            }
            None if token.is_none() && live && self.checks_never_written() => {
                // A creation where nothing was read: the record alone, created only where
                // nothing (no record, no tombstone) was ever written, which the backend checks
                // in the write itself. No local tree is needed to serialize on: a tombstone left
                // meanwhile fails the create, and the caller reads again and takes the local-tree
                // way below; a local tree another writer wrote meanwhile without its record is
                // either followed by that writer's record (which then fails, and it reads this
                // one) or was cut short before its write was acknowledged, and the record is the
                // authority. One write, one commit, instead of two (issue 38), as the bulk path
                // creates (`engine/bulk.rs`).
                self.backend
                    .put_text(id, &record_text(tree)?, Precondition::NeverWritten)
                    .await
                    .map_err(gone_is_conflict)?;
            }
            None => {
                let record = record_of(tree)?;
                let precondition = match token.and_then(|t| t.local_rev.clone()) {
                    Some(local_rev) => Precondition::MatchRevision(local_rev),
                    None => Precondition::MustNotExist,
                };
                self.backend.put_local(&tree_name, &record, precondition).await.map_err(gone_is_conflict)?;
                // A new document, one re-created over its tombstone, or one that stays deleted:
                // in the last case it is written live and deleted again, so it moves in the feed.
                // From nothing, the record is created only where still nothing is, where the
                // backend can tell: another writer may have read the local tree just written,
                // carried it on and deleted it meanwhile, and a create over that tombstone would
                // drop what it wrote.
                let create = if token.is_none() && self.backend.checks_never_written() {
                    Precondition::NeverWritten
                } else {
                    Precondition::MustNotExist
                };
                let rev = self.backend.put(id, &record, create).await.map_err(gone_is_conflict)?;
                if !live {
                    self.backend.delete(id, &rev).await.map_err(gone_is_conflict)?;
                }
            }
        }
        Ok(())
    }

    /// The authority for the tree last, so that a crash in between leaves the document as it
    /// was: a live record goes after the local tree (then only an earlier tree left by a save
    /// from nothing, which read would bring back); a deleted document's local tree goes after
    /// its tombstone (left alone, it reads as the document before the purge, half written,
    /// finished by its next write). Only what was read is erased, so a write another process
    /// made since survives: the record on its revision as read ([`EraseOptions`]), the tombstone
    /// on its own ([`Self::erase_tombstone`]); else `Conflict`, and the purge reads again.
    pub(super) async fn erase_of(&self, id: &str, token: &RecordToken) -> Result<()> {
        let tree_name = format!("{TREE_PREFIX}{id}");
        match (&token.record_rev, &token.local_rev) {
            (Some(record_rev), _) => {
                if let Some(local) = self.backend.get_local(&tree_name).await? {
                    self.backend.delete_local(&tree_name, &local.rev).await.map_err(gone_is_conflict)?;
                }
                let if_read = EraseOptions::if_revision(record_rev.clone());
                self.backend.erase_id(id, &if_read).await.map_err(gone_is_conflict)?;
            }
            (None, local_rev) => {
                self.erase_tombstone(id, &tree_name, local_rev.as_ref()).await?;
                if let Some(local_rev) = local_rev {
                    self.backend.delete_local(&tree_name, local_rev).await.map_err(gone_is_conflict)?;
                }
            }
        }
        Ok(())
    }

    /// The tombstone of a document read deleted (its tree in the local tree at `local_rev`),
    /// erased only while both are as read: its revision is read first, then the local tree is
    /// checked unchanged (a writer re-creating the document writes the local tree first), then
    /// the tombstone is erased on that revision. A writer that gets in after the check writes a
    /// record the erasure misses or the deletion of the local tree meets (`Conflict` either
    /// way). No tombstone (a save from nothing cut before its record) leaves nothing to erase.
    async fn erase_tombstone(&self, id: &str, tree_name: &str, local_rev: Option<&Revision>) -> Result<()> {
        let Some(stored) = self.backend.revisions(id).await? else { return Ok(()) };
        if !stored.deleted {
            return Err(Error::conflict(format!("document {id:?} was written again under this purge")));
        }
        let local_now = self.backend.get_local(tree_name).await?.map(|local| local.rev);
        if local_now.as_ref() != local_rev {
            return Err(Error::conflict(format!("the tree of {id:?} changed under this purge")));
        }
        self.backend.erase_id(id, &EraseOptions::if_revision(stored.rev)).await.map_err(gone_is_conflict)?;
        Ok(())
    }

    /// The document's tree written as its local tree record (the first write of a save from
    /// nothing or from a tombstone) but neither its live record nor a backend tombstone after it;
    /// or a live tree written as the local tree of a tombstone (a re-creation, whose record was
    /// to replace the tombstone); or a deletion cut after its record write (a live record holding
    /// a deleted winner), whose tombstone is still to come: the backend counts the document live
    /// (`doc_count`) until it does. Only the first case costs a backend read.
    pub(super) async fn unfinished_of(&self, id: &str, token: &RecordToken, deleted: bool) -> Result<bool> {
        if token.record_rev.is_some() {
            return Ok(deleted);
        }
        if token.local_rev.is_none() {
            return Ok(false);
        }
        if !deleted {
            return Ok(true);
        }
        Ok(self.backend.get_deleted(id).await?.is_none())
    }

    /// A live record is written again (so the document moves in the change feed, its revisions
    /// the same); a deleted document's tree is rewritten in place (its tombstone stays).
    pub(super) async fn save_without_inner_bodies_of(
        &self,
        id: &str,
        token: &RecordToken,
        tree: &RevTree,
    ) -> Result<()> {
        match (&token.record_rev, &token.local_rev) {
            (None, Some(local_rev)) => self
                .backend
                .put_local(
                    &format!("{TREE_PREFIX}{id}"),
                    &record_of(tree)?,
                    Precondition::MatchRevision(local_rev.clone()),
                )
                .await
                .map(|_| ())
                .map_err(gone_is_conflict),
            _ => self.save_over(id, Some(token), tree).await,
        }
    }
}

#[async_trait]
impl RepairableLayout for RecordLayout {
    type Token = RecordToken;

    /// The live record, else the local tree of a tombstone.
    async fn read(&self, id: &str) -> Result<Option<RecordState>> {
        let mut records = self.records::<RevTree>(std::slice::from_ref(&id.to_owned()), tree_of).await?;
        if let Some((rev, tree)) = records.pop().flatten() {
            return Ok(Some(Self::state_of_tree(rev, tree)));
        }
        match self.backend.get_local(&format!("{TREE_PREFIX}{id}")).await? {
            Some(local) => Ok(Some(Self::state_of_tombstone(id, local.rev, &local.body)?)),
            None => Ok(None),
        }
    }

    /// The records in one batched read, then the local trees of those without a live record in
    /// another (`get_many_local`).
    async fn read_many(&self, ids: &[String]) -> Result<Vec<Option<RecordState>>> {
        self.read_many_as::<RevTree>(ids, tree_of).await
    }

    async fn save(&self, id: &str, state: Option<&RecordState>, tree: &RevTree) -> Result<()> {
        self.save_over(id, state.map(|state| &state.token), tree).await
    }

    async fn unfinished(&self, id: &str, state: &RecordState) -> Result<bool> {
        self.unfinished_of(id, &state.token, state.deleted()).await
    }
}

#[async_trait]
impl TreeLayout for RecordLayout {
    async fn erase(&self, id: &str, state: &RecordState) -> Result<()> {
        self.erase_of(id, &state.token).await
    }

    /// Each listed record holds its whole tree: no read.
    async fn listed(&self, documents: Vec<StoredDocument>) -> Result<Vec<(String, RecordState)>> {
        let mut listed = Vec::with_capacity(documents.len());
        for StoredDocument { id, rev, body } in documents {
            listed.push((id.clone(), Self::state_of_record(&id, rev, &body)?));
        }
        Ok(listed)
    }

    fn kept_bodies(&self) -> Option<&dyn KeptBodies<Token = RecordToken>> {
        Some(self)
    }
}

#[async_trait]
impl KeptBodies for RecordLayout {
    type Token = RecordToken;

    /// Live records first, then the local trees of deleted documents.
    async fn inner_bodies_page(&self, cursor: Option<ScanCursor>, limit: usize) -> Result<ScanPage> {
        let (page, in_records) = match cursor {
            None => (self.backend.all_docs(&every_record(), limit, None).await?, true),
            Some(ScanCursor::Records(token)) => {
                (self.backend.all_docs(&every_record(), limit, Some(&token)).await?, true)
            }
            Some(ScanCursor::SidePlaces(token)) => {
                (self.backend.local_docs(&every_side_tree(), limit, token.as_deref()).await?, false)
            }
        };
        let mut ids = Vec::new();
        for doc in &page.items {
            if !tree_of(&doc.body, &doc.id)?.inner_bodies().is_empty() {
                ids.push(if in_records { doc.id.clone() } else { tree_document_id(&doc.id).to_owned() });
            }
        }
        let next = match (page.next, in_records) {
            (Some(token), true) => Some(ScanCursor::Records(token)),
            (None, true) => Some(ScanCursor::SidePlaces(None)),
            (Some(token), false) => Some(ScanCursor::SidePlaces(Some(token))),
            (None, false) => None,
        };
        Ok(ScanPage { ids, next })
    }

    async fn save_without_inner_bodies(&self, id: &str, state: &RecordState, tree: &RevTree) -> Result<()> {
        self.save_without_inner_bodies_of(id, &state.token, tree).await
    }

    /// Read page by page: live records, and the trees of deleted documents (those whose id has
    /// no live record: a re-created document's old tree record is left behind and no longer its
    /// tree).
    async fn attachment_references(&self) -> Result<HashSet<String>> {
        const PAGE: usize = 200;
        let mut referenced = HashSet::new();
        let mut token: Option<String> = None;
        loop {
            let page = self.backend.all_docs(&every_record(), PAGE, token.as_deref()).await?;
            for doc in &page.items {
                for body in tree_of(&doc.body, &doc.id)?.bodies() {
                    doc_attachments::referenced(body, &mut referenced);
                }
            }
            token = page.next;
            if token.is_none() {
                break;
            }
        }
        loop {
            let page = self.backend.local_docs(&every_side_tree(), PAGE, token.as_deref()).await?;
            let ids: Vec<String> = page.items.iter().map(|doc| tree_document_id(&doc.id).to_owned()).collect();
            let live = self.backend.get_many(&ids).await?;
            for (doc, record) in page.items.iter().zip(live) {
                if record.is_some() {
                    continue;
                }
                for body in tree_of(&doc.body, &doc.id)?.bodies() {
                    doc_attachments::referenced(body, &mut referenced);
                }
            }
            token = page.next;
            if token.is_none() {
                return Ok(referenced);
            }
        }
    }
}

/// Every record of the database, design documents included.
fn every_record() -> IdRange {
    IdRange { include_design: true, ..IdRange::all() }
}

/// Every local tree of a deleted document.
fn every_side_tree() -> IdRange {
    IdRange::all().under_prefix(TREE_PREFIX)
}

/// The document whose deleted tree a `tree:` local document (as the backend lists it) holds.
pub(in crate::database) fn tree_document_id(local_id: &str) -> &str {
    let name = local_id.strip_prefix(crate::backend::LOCAL_PREFIX).unwrap_or(local_id);
    name.strip_prefix(TREE_PREFIX).unwrap_or(name)
}

/// A precondition that failed because the record went away under the write (another writer
/// deleted or re-created it) is a conflict like any other: the write reads again.
pub(in crate::database) fn gone_is_conflict(err: Error) -> Error {
    if err.kind() == ErrorKind::NotFound {
        Error::conflict(format!("the document changed under this write: {}", err.message()))
    } else {
        err
    }
}

/// The tree a stored body holds.
pub(in crate::database) fn tree_of(body: &Map<String, Value>, id: &str) -> Result<RevTree> {
    let Some(tree) = body.get(TREE_FIELD) else {
        return Err(Error::new(ErrorKind::Corrupt, format!("document {id:?} has no revision tree")));
    };
    // Read from the record in place, not from a copy of it.
    RevTree::deserialize(tree)
        .map_err(|e| Error::new(ErrorKind::Corrupt, format!("document {id:?} has an unreadable revision tree: {e}")))
}

/// A record's one field as read from its text.
#[derive(Deserialize)]
struct TreeText<T> {
    #[serde(rename = "revtree")]
    tree: T,
}

/// The tree a record's stored JSON text holds, parsed as `T` straight from the text.
fn tree_of_text<T: serde::de::DeserializeOwned>(json: &[u8], id: &str) -> Result<T> {
    crate::model::depth::parse_stored::<TreeText<T>>(json)
        .map(|record| record.tree)
        .map_err(|e| Error::new(ErrorKind::Corrupt, format!("document {id:?} has an unreadable revision tree: {e}")))
}

/// The stored body of a tree as the JSON text [`record_of`] would encode to, written straight
/// from the tree: no values built (a copy of every body in the tree) only to be encoded and
/// dropped, which was an eighth of an ordinary `_bulk_docs` on the embedded store (issue 38).
pub(in crate::database) fn record_text(tree: &RevTree) -> Result<Box<RawValue>> {
    /// The record's one field, named as [`TREE_FIELD`] names it.
    #[derive(serde::Serialize)]
    struct Record<'a> {
        revtree: &'a RevTree,
    }
    serde_json::value::to_raw_value(&Record { revtree: tree })
        .map_err(|e| Error::new(ErrorKind::Internal, format!("cannot encode a revision tree: {e}")))
}

/// The stored body of a tree.
pub(in crate::database) fn record_of(tree: &RevTree) -> Result<Map<String, Value>> {
    let tree = serde_json::to_value(tree)
        .map_err(|e| Error::new(ErrorKind::Internal, format!("cannot encode a revision tree: {e}")))?;
    let mut record = Map::new();
    record.insert(TREE_FIELD.into(), tree);
    Ok(record)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::backend::rev_tree::RevPath;

    /// Every literal value of the round-trip corpus (`fixtures/values/roundtrip.json`): deep,
    /// unicode, escapes, numbers past a double, big objects.
    fn corpus_values() -> Vec<Value> {
        let text = include_str!("../../../fixtures/values/roundtrip.json");
        let file: Value = serde_json::from_str(text).expect("the corpus is JSON");
        let cases = file["cases"].as_array().expect("the corpus has cases");
        cases.iter().filter_map(|case| case.get("value").cloned()).collect()
    }

    /// A tree of two branches (one deleted), kept inner bodies, and `value` in every body.
    fn tree_holding(value: &Value) -> RevTree {
        let body = |n: u64| match json!({"n": n, "value": value}) {
            Value::Object(body) => body,
            _ => unreachable!("an object literal"),
        };
        let mut tree = RevTree::default();
        let first = tree.edit(None, "a1", false, body(1), usize::MAX).expect("a creation");
        let second = tree.edit(Some(&first), "b2", false, body(2), usize::MAX).expect("an edit");
        tree.edit(Some(&second), "c3", false, body(3), usize::MAX).expect("an edit");
        let side = RevPath { start: 2, ids: vec!["d2".into(), "a1".into()] };
        tree.merge(side, true, body(4), usize::MAX);
        tree
    }

    /// What a map function is shown of a document, written from the record's stored text
    /// (`winner_json`), is byte for byte what the document's value from the whole tree writes
    /// (`leaf_json` with `MAP_INPUT`, as the view build wrote it before), for every value of the
    /// corpus in trees with and without conflicts, deleted leaves, kept inner bodies and an empty
    /// body; and the documents it cannot write so (a deleted winner, `_`-members, attachments)
    /// are left to the whole read.
    #[test]
    fn a_map_input_written_from_the_stored_text_is_the_one_written_from_the_tree() {
        use crate::database::document::{leaf_json, winner_json, MAP_INPUT};
        let body = |value: Value| match value {
            Value::Object(body) => body,
            _ => unreachable!("an object literal"),
        };
        let whole_text = |tree: &RevTree, id: &str| {
            let winner = tree.winner().filter(|winner| !winner.deleted)?;
            Some(leaf_json(id, tree, winner, MAP_INPUT).to_string())
        };
        let from_text = |tree: &RevTree, id: &str| {
            let text = record_text(tree).expect("encodes");
            let winner = tree_of_text::<WinnerText>(text.get().as_bytes(), id).expect("reads");
            winner_json(id, &winner)
        };
        let values = corpus_values();
        assert!(values.len() >= 20, "read {} values of the corpus", values.len());
        let mut written = 0;
        for value in &values {
            let mut trees = vec![tree_holding(value)];
            // One leaf, members in an order that is not sorted.
            let mut single = RevTree::default();
            single.edit(None, "a1", false, body(json!({"z": value, "a": 1, "m": [value]})), usize::MAX).expect("made");
            trees.push(single.clone());
            // Live conflicts on both sides of the winner's generation, and a deleted one.
            let mut conflicted = single;
            for (start, ids, deleted) in
                [(2, ["f2", "a1"], false), (2, ["aa", "a1"], false), (2, ["0b", "a1"], false), (2, ["ff", "a1"], true)]
            {
                let path = RevPath { start, ids: ids.iter().map(|id| (*id).to_owned()).collect() };
                conflicted.merge(path, deleted, body(json!({"v": value})), usize::MAX);
            }
            let longer = RevPath { start: 3, ids: vec!["c3".into(), "0b".into(), "a1".into()] };
            conflicted.merge(longer, false, body(json!({"w": value, "n": -0.0})), usize::MAX);
            assert_eq!(conflicted.conflicts().len(), 2, "the tree has the conflicts meant");
            assert_eq!(conflicted.deleted_conflicts().len(), 1, "the tree has the conflicts meant");
            trees.push(conflicted);
            for tree in &trees {
                for id in ["d", "é \"quoted\" \u{1}/"] {
                    let expected = whole_text(tree, id).expect("a live winner");
                    assert_eq!(from_text(tree, id).as_deref(), Some(expected.as_str()), "for {value}");
                    written += 1;
                }
            }
        }
        assert!(written >= values.len() * 6);
        let mut empty = RevTree::default();
        empty.edit(None, "a1", false, Map::new(), usize::MAX).expect("made");
        assert_eq!(from_text(&empty, "e"), whole_text(&empty, "e"));
        assert_eq!(from_text(&empty, "e").as_deref(), Some(r#"{"_id":"e","_rev":"1-a1"}"#));
        // Left to the whole read: a deleted winner, attachments (shown as stubs), `_` in a value.
        let mut deleted = empty.clone();
        deleted.edit(Some("1-a1"), "b2", true, Map::new(), usize::MAX).expect("deleted");
        let stubbed = json!({"_attachments": {"a.txt": {"content_type": "text/plain", "revpos": 1,
            "digest": "md5-x", "length": 1, "stub": true}}});
        for (tree, why) in [
            (deleted, "deleted"),
            (tree_with(body(stubbed)), "attachments"),
            (tree_with(body(json!({"k": "_v"}))), "underscore"),
        ] {
            assert_eq!(from_text(&tree, "x"), None, "{why}");
        }
    }

    fn tree_with(body: Map<String, Value>) -> RevTree {
        let mut tree = RevTree::default();
        tree.edit(None, "a1", false, body, usize::MAX).expect("made");
        tree
    }

    /// The text written straight from a tree is, byte for byte, what the record's values encode
    /// to (so records written either way are one encoding, and every reader of the values' text
    /// reads it), and it reads back as the same tree.
    #[test]
    fn record_text_is_the_records_encoding() {
        let values = corpus_values();
        assert!(values.len() >= 20, "read {} values of the corpus", values.len());
        for value in &values {
            let tree = tree_holding(value);
            assert!(!tree.inner_bodies().is_empty() && tree.leaves().len() == 2, "the tree has what it should");
            let text = record_text(&tree).expect("encodes");
            let encoded = serde_json::to_string(&record_of(&tree).expect("encodes")).expect("encodes");
            assert_eq!(text.get(), encoded, "for {value}");
            let body: Map<String, Value> = crate::model::depth::parse_stored(text.get().as_bytes()).expect("parses");
            assert_eq!(tree_of(&body, "doc").expect("reads"), tree, "for {value}");
        }
    }
}
