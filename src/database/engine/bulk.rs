//! Many documents' writes at once ([`Database::write_many`]): what a replicator's page costs
//! when each document's write is one read and one save of its own is paid once per page instead.
//!
//! The documents' states are read in two batched reads (`get_many` for the records, then
//! `get_many_local` for the local trees of the ids without a live record), every document's
//! writes are applied in memory exactly as [`Database::write_batch`] applies them (the same
//! guard, merge, stemming and attachment resolution), and the saves are grouped:
//! - a live record whose tree stays live is one write of the record on its revision, and all of
//!   them go in one `bulk_write` (every adapter checks each item's precondition on its own: the
//!   embedded store in its transaction, DynamoDB with a conditional put per item, Firestore with
//!   a precondition per write, CouchDB with each document's `_rev`);
//! - a document under whose id nothing was read (no record, no local tree) is created in the
//!   same `bulk_write` with [`Precondition::NeverWritten`], which fails over a tombstone as over
//!   a live record: so it needs no local tree. A tombstone is what a re-creation must serialize
//!   on (its local tree's revision), and whoever left one in the meantime makes the create fail,
//!   and the document is written again alone (below), the local-tree way. A writer that wrote a
//!   local tree under the id meanwhile without its record is either still writing (its record
//!   then fails to be created and it reads again, finding this one) or was cut short before its
//!   write was acknowledged; the record created here is then the document, the local tree left
//!   behind unread (a live record is the authority);
//! - a document re-created over its tombstone, or one a crash left half-written, or a creation on
//!   a backend that cannot check `NeverWritten` (CouchDB), first writes its local tree on the
//!   revision read (the compare-and-swap every save from a tombstone is serialized on), and only
//!   after that its record, in the same one `bulk_write`. A crash between the two leaves what a
//!   crash inside [`Database::write_batch`] leaves, a half-written document, which the next write
//!   of it finishes ([`Database::half_written`]);
//! - anything else (a deletion, a document staying deleted) is saved alone as `write_batch`
//!   saves it.
//!
//! So a page of new documents costs two batched reads and one bulk write, whatever its size; and
//! only the bulk write when the caller read those states just before
//! ([`Database::write_many_over`]: `migrate --all-databases` reads them to answer `_revs_diff`).
//! Each document that references attachment bytes first touches their manifests
//! ([`Database::keep_references`]: a write only for a manifest stored more than half the grace
//! period ago), as every save does; the documents saved in one bulk write read their manifests
//! in one batched read together ([`Database::keep_references_of_many`]), not one per document.
//!
//! The grouping is the engine's layout's ([`crate::database::layout::record`]). Over the
//! data-store database's layouts (whose saves write the record and its side document in steps of
//! their own, or, on CouchDB, each leaf through the backend's own calls) the states are read in
//! one batched read too and the writes applied in memory the same way. On the data-store layout
//! the saves that are one write of the record each (a new document, an edit of one whose other
//! leaves stay as they are: nearly all) go in one backend call, in id order
//! ([`Database::save_records_together`]: one job of the embedded store's group commit, so one
//! fsync'd commit for a `_bulk_docs`; issue 38: saved one after another, the data-store
//! `_bulk_docs` of 100 ran at 2.3x a real CouchDB 3.4.3 against 8.3x for single creates, and
//! started all at once, a job each, they still met the commit in two groups or more, 1.8 fsyncs
//! per request). Every other save is started at once ([`SAVES_AT_ONCE`] in flight), each as
//! [`Database::write_batch`] saves it. On CouchDB (the native
//! layout) the creations among them go in one `bulk_write`, CouchDB's `_bulk_docs`
//! ([`Database::create_in_bulk`]), and the other edits' requests overlap. Those creations are
//! not read first either, as a single creation there is not (`Database::create_unread`): CouchDB
//! refuses a write without `_rev` over a live document and makes it the next revision of a
//! deleted one, so the batched tree read (`_bulk_get`) before the `_bulk_docs` told nothing
//! CouchDB does not check itself. A page of new documents costs one request; a creation CouchDB
//! refuses (a live document under its id), or one the write guard refuses, is written again
//! alone, read first, and answered as a read-first write is.
//!
//! A document whose save met another writer (any failed precondition) is written again alone
//! through [`Database::write_batch`], which reads it again and retries, so conflicts between
//! writers are resolved per document exactly as before. The bulk pass takes none of the
//! per-id write locks: they only spare this process's writers their tries against each other,
//! and a bulk pass holding most of them would serialize every other writer behind it.

use std::collections::{HashMap, HashSet};

use futures::StreamExt;

use super::{gone_is_conflict, record_of, record_text, Applied, DocState, Unread, Written, TREE_PREFIX};
use crate::backend::{BulkWrite, BulkWriteText, Precondition};
use crate::database::rev_tree::RevTree;
use crate::database::{Database, Write};
use crate::error::{Error, ErrorKind, Result};

/// Local trees written first, and documents saved alone or written again, at once.
const CONCURRENCY: usize = 16;
/// Saves of the data-store layouts made alone (those of more than one record write; on CouchDB
/// every edit that is not a creation) in flight at once: enough that many reach the embedded
/// store's group commit together, few enough that a request of thousands does not queue them
/// all at once (on the CouchDB backend creations go in one `_bulk_docs` and only
/// the other edits are requests of their own).
const SAVES_AT_ONCE: usize = 128;

/// One document's answers: one per write, or the error that stopped its save.
pub type DocumentAnswers = Result<Vec<Result<Written>>>;

/// A document of the bulk pass whose tree changed, between the read and the save.
struct Pending {
    slot: usize,
    state: Option<DocState>,
    tree: RevTree,
    answers: Vec<Result<Written>>,
}

/// How a saved document fared.
enum Saved {
    Done,
    /// Another writer got in first: written again alone.
    Conflict,
    Failed(Error),
}

impl Saved {
    fn of<T>(result: Result<T>) -> Saved {
        match result.map_err(gone_is_conflict) {
            Ok(_) => Saved::Done,
            Err(err) if err.kind() == ErrorKind::Conflict => Saved::Conflict,
            Err(err) => Saved::Failed(err),
        }
    }
}

/// What a caller of [`Database::write_many_over`] read for the write just before it, so the
/// write does not read it again.
#[derive(Debug, Default)]
pub struct ReadBefore {
    /// Documents' states by id, as [`Database::read_many`] answered them (`None`: read as
    /// absent).
    pub states: HashMap<String, Option<DocState>>,
    /// `_revs_limit` as [`Database::revs_limit`] answered it for this write. On a backend other
    /// processes share, [`Database::revs_limit`] reads the setting at every call so that a limit
    /// set through any instance holds from the next request on (issue 36); a caller whose one
    /// request is written in several `write_many_over` calls (a `migrate` page: 500 documents
    /// written 100 at a time) reads it once for all of them, as CouchDB's `_bulk_docs` reads it
    /// once per request, not once per document.
    pub revs_limit: Option<usize>,
}

impl Database {
    /// Applies each document's writes as [`Database::write_batch`] does, for many documents in
    /// a few backend calls (see the module's documentation); one answer per document, in order.
    /// An id given twice has its second group applied after its first. The outer error is for a
    /// failure of the whole call (the database deleted, a read or a bulk write that failed).
    pub async fn write_many(&self, documents: &[(String, Vec<Write>)]) -> Result<Vec<DocumentAnswers>> {
        self.write_many_over(documents, ReadBefore::default()).await
    }

    /// [`Database::write_many`] over what the caller read just before (`before`): the states of
    /// [`ReadBefore::states`] and the `_revs_limit` of [`ReadBefore::revs_limit`] are not read
    /// again. A `migrate --all-databases` page reads its target's states to answer which leaves
    /// it lacks, and writes them right after: one read of the page, not two. A state that changed
    /// since it was read (another writer) is what a write meeting another writer sees inside
    /// `write_many` too: its save's precondition fails, and the document is read again and
    /// written alone.
    pub async fn write_many_over(
        &self,
        documents: &[(String, Vec<Write>)],
        before: ReadBefore,
    ) -> Result<Vec<DocumentAnswers>> {
        let _under_way = self.start_write()?;
        self.while_open(self.write_many_once_open(documents, before)).await
    }

    async fn write_many_once_open(
        &self,
        documents: &[(String, Vec<Write>)],
        before: ReadBefore,
    ) -> Result<Vec<DocumentAnswers>> {
        let ReadBefore { states: mut read, revs_limit: limit_read } = before;
        // `_users` documents are written one by one, each hashing its password first.
        if super::super::users::is_users_db(self.name()) {
            return Ok(self.write_each(documents).await);
        }
        // The engine's layout saves live records in one bulk write; the data-store layouts save
        // each document alone, all at once (module doc).
        let records_in_bulk = self.layout().as_record().is_some();
        let edits_only = documents.iter().all(|(_, writes)| super::edits_only(writes));
        let revs_limit = match limit_read {
            Some(limit) if !(edits_only && self.layout().edits_are_the_backends()) => limit.max(1),
            _ => self.revs_limit_for(edits_only).await?,
        };
        let mut results: Vec<Option<DocumentAnswers>> = documents.iter().map(|_| None).collect();
        // The first group of each id goes in the bulk pass; a repeated id's later groups are
        // written alone after it, in order.
        let mut seen = HashSet::new();
        let (bulk, repeated): (Vec<usize>, Vec<usize>) =
            (0..documents.len()).partition(|&slot| seen.insert(documents[slot].0.as_str()));
        // Where the backend checks a creation itself, creations are not read first (module doc);
        // states the caller read already (`write_many_over`) are not read again.
        let unread_creations: HashSet<usize> = match self.layout().edits_are_the_backends() {
            true => bulk.iter().copied().filter(|&slot| is_creation(&documents[slot].1)).collect(),
            false => HashSet::new(),
        };
        let to_read: Vec<String> = bulk
            .iter()
            .filter(|slot| !unread_creations.contains(slot))
            .map(|&slot| documents[slot].0.clone())
            .filter(|id| !read.contains_key(id))
            .collect();
        let mut fresh = if to_read.is_empty() { Vec::new() } else { self.read_states(&to_read).await? }.into_iter();
        if fresh.len() != to_read.len() {
            return Err(Error::new(ErrorKind::Internal, "a batched read answered too few documents"));
        }
        let states: Vec<Option<DocState>> = bulk
            .iter()
            .map(|&slot| match unread_creations.contains(&slot) {
                true => None,
                false => read.remove(&documents[slot].0).unwrap_or_else(|| fresh.next().flatten()),
            })
            .collect();

        let mut in_bulk: Vec<Pending> = Vec::new();
        let mut created_in_bulk: Vec<Pending> = Vec::new();
        let mut alone: Vec<Pending> = Vec::new();
        // Unread creations the guard refused: written again alone, read first, so that over a
        // live document the answer is the conflict a read finds (as `create_unread` falls back).
        let mut read_first: Vec<usize> = Vec::new();
        for (slot, state) in bulk.into_iter().zip(states) {
            let (id, writes) = &documents[slot];
            // A failure here (the guard's, a read of the tombstone) is this document's alone,
            // as it is in `write_batch`.
            let Applied { tree, answers, changed } = match self.applied(id, state.as_ref(), writes, revs_limit).await {
                Ok(applied) => applied,
                Err(err) => {
                    results[slot] = Some(Err(err));
                    continue;
                }
            };
            if unread_creations.contains(&slot) && (!changed || answers.iter().any(Result::is_err)) {
                read_first.push(slot);
                continue;
            }
            // As in `write_batch`: a half-written document is finished even when nothing is new.
            if !changed {
                match self.half_written(id, state.as_ref()).await {
                    Ok(false) => {
                        results[slot] = Some(Ok(answers));
                        continue;
                    }
                    Ok(true) => {}
                    Err(err) => {
                        results[slot] = Some(Err(err));
                        continue;
                    }
                }
            }
            let live = tree.winner().is_some_and(|leaf| !leaf.deleted);
            let pending = Pending { slot, state, tree, answers };
            if live && records_in_bulk {
                in_bulk.push(pending);
            } else if live && self.layout().edits_are_the_backends() && is_creation(writes) {
                created_in_bulk.push(pending);
            } else {
                alone.push(pending);
            }
        }

        let mut outcomes: Vec<(Pending, Saved)> = self.save_in_bulk(documents, in_bulk).await?;
        outcomes.extend(self.create_in_bulk(documents, created_in_bulk).await?);
        let alone = self.save_records_together(documents, alone, &mut outcomes).await?;
        // Plain loops of futures, not closures in iterator adapters: those trip rustc's
        // higher-ranked `Send` check where an HTTP handler awaits this.
        let mut saving = Vec::with_capacity(alone.len());
        for pending in alone {
            saving.push(self.save_alone(&documents[pending.slot].0, pending));
        }
        let at_once = if records_in_bulk { CONCURRENCY } else { SAVES_AT_ONCE };
        let saved_alone: Vec<(Pending, Saved)> = futures::stream::iter(saving).buffered(at_once).collect().await;
        outcomes.extend(saved_alone);

        let mut again = read_first;
        for (pending, saved) in outcomes {
            let id = documents[pending.slot].0.as_str();
            match saved {
                Saved::Done => {
                    self.saved(id, pending.state.as_ref(), &pending.tree);
                    results[pending.slot] = Some(Ok(pending.answers));
                }
                Saved::Conflict => again.push(pending.slot),
                Saved::Failed(err) => results[pending.slot] = Some(Err(err)),
            }
        }
        // Met another writer (or, unread, a live document): read again and retried, one
        // document at a time each.
        let mut retrying = Vec::with_capacity(again.len());
        for slot in again {
            let (id, writes) = &documents[slot];
            retrying.push(async move { (slot, self.write_batch_reading(id, writes, Unread::Skipped).await) });
        }
        let retried: Vec<(usize, DocumentAnswers)> =
            futures::stream::iter(retrying).buffer_unordered(CONCURRENCY).collect().await;
        for (slot, answers) in retried {
            results[slot] = Some(answers);
        }
        for slot in repeated {
            let (id, writes) = &documents[slot];
            results[slot] = Some(self.write_batch_once_open(id, writes).await);
        }
        Ok(results
            .into_iter()
            .map(|result| {
                result.unwrap_or_else(|| Err(Error::new(ErrorKind::Internal, "a document's writes were not answered")))
            })
            .collect())
    }

    /// Each document's writes as `write_batch` applies them, one document after another (so a
    /// repeated id's groups apply in order).
    async fn write_each(&self, documents: &[(String, Vec<Write>)]) -> Vec<DocumentAnswers> {
        let mut answers = Vec::with_capacity(documents.len());
        for (id, writes) in documents {
            answers.push(self.write_batch_once_open(id, writes).await);
        }
        answers
    }

    /// A document saved alone, as `write_batch` saves it: its edits answered with the revisions
    /// the layout stored them as (the backend's own on CouchDB).
    async fn save_alone(&self, id: &str, mut pending: Pending) -> (Pending, Saved) {
        if let Err(err) = self.keep_references(pending.state.as_ref(), &pending.tree).await {
            return (pending, Saved::Failed(err));
        }
        let Pending { state, tree, answers, .. } = &mut pending;
        let saved = Saved::of(self.save_answering(id, state.as_ref(), tree, answers).await);
        (pending, saved)
    }

    /// On the data-store layout, the saves that are each one write of the record (a new
    /// document's, an edit of one without conflicts: [`Layout::record_write_of`]) in one backend
    /// call ([`DataStoreLayout::save_records`]: one job of the embedded store's group commit,
    /// one fsync'd commit); their outcomes go to `outcomes`. The others (a save of more steps,
    /// every save on another layout) are returned, to be saved alone as `write_batch` saves them.
    ///
    /// [`Layout::record_write_of`]: crate::database::layout::Layout::record_write_of
    /// [`DataStoreLayout::save_records`]: crate::database::layout::data_store::DataStoreLayout::save_records
    async fn save_records_together(
        &self,
        documents: &[(String, Vec<Write>)],
        pending: Vec<Pending>,
        outcomes: &mut Vec<(Pending, Saved)>,
    ) -> Result<Vec<Pending>> {
        let Some(data_store) = self.layout().as_data_store() else { return Ok(pending) };
        let mut together = Vec::with_capacity(pending.len());
        let mut others = Vec::new();
        for pending in pending {
            if !self.layout().is_record_write(pending.state.as_ref(), &pending.tree) {
                others.push(pending);
                continue;
            }
            // As `save_alone` does before its save.
            match self.keep_references(pending.state.as_ref(), &pending.tree).await {
                Ok(()) => together.push(pending),
                Err(err) => outcomes.push((pending, Saved::Failed(err))),
            }
        }
        if together.is_empty() {
            return Ok(others);
        }
        self.check_open()?;
        let writes: Vec<_> = together
            .iter()
            .filter_map(|pending| {
                let id = documents[pending.slot].0.as_str();
                self.layout().record_write_of(id, pending.state.as_ref(), &pending.tree)
            })
            .collect();
        if writes.len() != together.len() {
            return Err(Error::new(ErrorKind::Internal, "a record write of the bulk pass was no longer one"));
        }
        let saved = data_store.save_records(&writes).await?;
        drop(writes);
        outcomes.extend(together.into_iter().zip(saved).map(|(pending, result)| (pending, Saved::of(result))));
        Ok(others)
    }

    /// Saves documents whose tree is live: the local trees of those without a live record
    /// first (each on the revision read), then every record in one `bulk_write`.
    async fn save_in_bulk(
        &self,
        documents: &[(String, Vec<Write>)],
        pending: Vec<Pending>,
    ) -> Result<Vec<(Pending, Saved)>> {
        self.check_open()?;
        let mut outcomes = Vec::with_capacity(pending.len());
        let mut records = Vec::with_capacity(pending.len());
        let mut writing = Vec::with_capacity(pending.len());
        // Every document's references kept in one batched read of their manifests, before any
        // of them is saved, as each one's own did before its save.
        let saves: Vec<(Option<&DocState>, &RevTree)> = pending.iter().map(|p| (p.state.as_ref(), &p.tree)).collect();
        let kept = self.keep_references_of_many(&saves).await;
        drop(saves);
        let mut firsts = Vec::with_capacity(pending.len());
        for (pending, kept) in pending.into_iter().zip(kept) {
            firsts.push(self.local_first(&documents[pending.slot].0, pending, kept));
        }
        let with_local_first: Vec<(Pending, Saved, Option<BulkWriteText>)> =
            futures::stream::iter(firsts).buffered(CONCURRENCY).collect().await;
        for (pending, saved, write) in with_local_first {
            match write {
                Some(write) => {
                    records.push(write);
                    writing.push(pending);
                }
                None => outcomes.push((pending, saved)),
            }
        }
        if records.is_empty() {
            return Ok(outcomes);
        }
        let written = self.backend.bulk_write_text(records).await?;
        if written.len() != writing.len() {
            return Err(Error::new(ErrorKind::Internal, "the backend answered a bulk write with too few results"));
        }
        outcomes.extend(writing.into_iter().zip(written).map(|(pending, result)| (pending, Saved::of(result))));
        Ok(outcomes)
    }

    /// Creations on a layout whose edits are the backend's own (the data-store database on
    /// CouchDB): each new winner sent as a write without revision in one `bulk_write` (CouchDB's
    /// `_bulk_docs`), which CouchDB checks per document as it checks a `PUT` without `_rev`
    /// (refused over a live document, the next revision of a deleted one). Each edit is answered
    /// with the revision CouchDB stored; a conflict is written again alone. One backend request
    /// for a page of new documents instead of one per document (issue 38).
    async fn create_in_bulk(
        &self,
        documents: &[(String, Vec<Write>)],
        pending: Vec<Pending>,
    ) -> Result<Vec<(Pending, Saved)>> {
        if pending.is_empty() {
            return Ok(Vec::new());
        }
        self.check_open()?;
        let writes: Vec<BulkWrite> = pending
            .iter()
            .map(|pending| BulkWrite {
                id: documents[pending.slot].0.clone(),
                body: pending.tree.winner().map(|leaf| leaf.body.clone()).unwrap_or_default(),
                precondition: Precondition::MustNotExist,
            })
            .collect();
        let written = self.backend.bulk_write(writes).await?;
        if written.len() != pending.len() {
            return Err(Error::new(ErrorKind::Internal, "the backend answered a bulk write with too few results"));
        }
        Ok(pending
            .into_iter()
            .zip(written)
            .map(|(mut pending, result)| {
                if let Ok(stored) = &result {
                    for answer in &mut pending.answers {
                        if let Ok(Written::Edited(rev)) = answer {
                            *rev = stored.0.clone();
                        }
                    }
                }
                let saved = Saved::of(result);
                (pending, saved)
            })
            .collect())
    }

    /// A live tree's record as one write of the bulk write: on the record's revision when it
    /// is live; for an id under which nothing was read, as a create that fails over a tombstone
    /// (`NeverWritten`, where the backend checks it); else (a re-creation over a tombstone, a
    /// half-written document, a creation where the backend cannot check `NeverWritten`) once
    /// its local tree is written on the revision read.
    async fn local_first(
        &self,
        id: &str,
        pending: Pending,
        references_kept: Result<()>,
    ) -> (Pending, Saved, Option<BulkWriteText>) {
        if let Err(err) = references_kept {
            return (pending, Saved::Failed(err), None);
        }
        let record = match record_text(&pending.tree) {
            Ok(record) => record,
            Err(err) => return (pending, Saved::Failed(err), None),
        };
        let token = pending.state.as_ref().and_then(|s| s.token.record());
        let (record_rev, local_rev) = match token {
            Some(token) => (token.record_rev.clone(), token.local_rev.clone()),
            None if pending.state.is_some() => {
                let err = Error::new(ErrorKind::Internal, "the batched bulk path met a state of another layout");
                return (pending, Saved::Failed(err), None);
            }
            None => (None, None),
        };
        if let Some(rev) = record_rev {
            let write =
                BulkWriteText { id: id.to_owned(), json: record, precondition: Precondition::MatchRevision(rev) };
            return (pending, Saved::Done, Some(write));
        }
        if pending.state.is_none() && self.backend.checks_never_written() {
            let write = BulkWriteText { id: id.to_owned(), json: record, precondition: Precondition::NeverWritten };
            return (pending, Saved::Done, Some(write));
        }
        let precondition = match local_rev {
            Some(local_rev) => Precondition::MatchRevision(local_rev),
            None => Precondition::MustNotExist,
        };
        let local = match record_of(&pending.tree) {
            Ok(body) => self.backend.put_local(&format!("{TREE_PREFIX}{id}"), &body, precondition).await,
            Err(err) => Err(err),
        };
        match Saved::of(local) {
            Saved::Done => {
                let write = BulkWriteText { id: id.to_owned(), json: record, precondition: Precondition::MustNotExist };
                (pending, Saved::Done, Some(write))
            }
            refused => (pending, refused, None),
        }
    }
}

/// Whether `writes` are one creation: an edit naming no parent that does not delete.
pub(super) fn is_creation(writes: &[Write]) -> bool {
    matches!(writes, [Write::Edit { parent: None, deleted: false, .. }])
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use serde_json::{json, Map, Value};

    use super::*;
    use crate::backend::embedded::EmbeddedBackend;
    use crate::backend::{DocumentBackend, Revision};
    use crate::database::rev_tree::RevPath;

    fn body(value: Value) -> Map<String, Value> {
        value.as_object().cloned().unwrap_or_default()
    }

    fn leaf(start: u64, ids: &[&str], deleted: bool, value: Value) -> Write {
        Write::Replicated {
            path: RevPath { start, ids: ids.iter().map(|id| (*id).to_owned()).collect() },
            deleted,
            body: body(value),
        }
    }

    async fn embedded(dir: &tempfile::TempDir, file: &str) -> Arc<dyn DocumentBackend> {
        Arc::new(EmbeddedBackend::open(&dir.path().join(file)).await.unwrap())
    }

    /// What an answer says, comparable (errors by kind).
    fn shown(answers: &DocumentAnswers) -> Vec<std::result::Result<Written, ErrorKind>> {
        match answers {
            Ok(answers) => answers.iter().map(|a| a.as_ref().cloned().map_err(Error::kind)).collect(),
            Err(err) => vec![Err(err.kind())],
        }
    }

    /// Documents in every state a save starts from (never written, live, deleted, re-created,
    /// already known, half a batch refused) and an id given twice.
    async fn history(database: &Database) {
        let setup = [
            ("live", leaf(1, &["a1"], false, json!({"v": 1}))),
            ("gone", leaf(1, &["g1"], false, json!({"v": 1}))),
            ("gone", leaf(2, &["g2", "g1"], true, json!({}))),
            ("known", leaf(1, &["k1"], false, json!({"v": 1}))),
            ("_design/d", leaf(1, &["d1"], false, json!({"views": {}}))),
        ];
        for (id, write) in setup {
            database.write(id, &write).await.unwrap();
        }
    }

    fn page() -> Vec<(String, Vec<Write>)> {
        vec![
            ("new".into(), vec![leaf(3, &["n3", "n2", "n1"], false, json!({"v": 3}))]),
            (
                "live".into(),
                vec![leaf(2, &["a2", "a1"], false, json!({"v": 2})), leaf(2, &["b2", "a1"], false, json!({"v": 9}))],
            ),
            ("gone".into(), vec![leaf(3, &["g3", "g2", "g1"], false, json!({"back": true}))]),
            ("known".into(), vec![leaf(1, &["k1"], false, json!({"v": 1}))]),
            ("deleting".into(), vec![leaf(1, &["x1"], true, json!({}))]),
            ("live".into(), vec![leaf(3, &["a3", "a2", "a1"], true, json!({}))]),
            ("_design/d".into(), vec![leaf(2, &["d2", "d1"], false, json!({"views": {"v": {}}}))]),
            (
                "guarded".into(),
                vec![leaf(1, &["ok1"], false, json!({})), leaf(1, &["no1"], false, json!({"forbidden": true}))],
            ),
            (
                "stub".into(),
                vec![leaf(1, &["s1"], false, json!({"_attachments": {"f": {"stub": true, "digest": "md5-x"}}}))],
            ),
        ]
    }

    /// Refuses every proposed document with `"forbidden": true` (a `validate_doc_update`).
    struct RefuseForbidden;

    #[async_trait::async_trait]
    impl crate::database::write_guard::WriteGuard for RefuseForbidden {
        async fn applies(&self, _: &Database) -> Result<bool> {
            Ok(true)
        }

        async fn check(
            &self,
            _: &Database,
            writes: &[crate::database::write_guard::ProposedWrite],
        ) -> Result<Vec<Option<Error>>> {
            Ok(writes
                .iter()
                .map(|write| {
                    (write.new_doc.get("forbidden") == Some(&Value::Bool(true)))
                        .then(|| Error::new(ErrorKind::Forbidden, "forbidden"))
                })
                .collect())
        }

        fn design_changed(&self, _: &Database) {}
    }

    /// The data-store database's `write_many` (a `_bulk_docs`) writes the records of the saves
    /// that are one record write each (new documents, edits of documents without a conflict
    /// moving) in one backend call: one write transaction on the embedded store, one fsync'd
    /// commit (issue 38: a job per document met the group commit in two groups or more, 1.8
    /// fsyncs per data-store `_bulk_docs` of 100). Each is answered and stored, in the feed in id
    /// order; a save of more steps (an edit of a losing leaf, which moves the old winner to the
    /// side document) is made alone beside them, in its own steps.
    #[tokio::test]
    async fn data_store_records_are_written_in_one_transaction() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(EmbeddedBackend::open(&dir.path().join("ds.redb")).await.unwrap());
        let backend: Arc<dyn DocumentBackend> = Arc::clone(&store) as Arc<dyn DocumentBackend>;
        let database = Database::data_store("agent_data_store".into(), backend).unwrap();
        let ids: Vec<String> = (0..100).map(|i| format!("u:ns:k{i:03}")).collect();
        let documents: Vec<(String, Vec<Write>)> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                (id.clone(), vec![Write::Edit { parent: None, deleted: false, body: body(json!({ "value": i })) }])
            })
            .collect();
        let before = store.write_transactions();
        let answers = database.write_many(&documents).await.unwrap();
        assert_eq!(store.write_transactions() - before, 1, "100 new documents in one write transaction");
        let mut revs = Vec::new();
        for ((id, _), answers) in documents.iter().zip(&answers) {
            match answers.as_ref().unwrap().as_slice() {
                [Ok(Written::Edited(rev))] if rev.starts_with("1-") => revs.push(rev.clone()),
                other => panic!("{id}: {other:?}"),
            }
            assert!(database.read(id).await.unwrap().is_some(), "{id} is stored");
        }
        let feed: Vec<String> =
            store.changes(None, 200).await.unwrap().changes.into_iter().map(|change| change.id).collect();
        assert_eq!(feed, ids, "the feed holds the request's documents in id order");

        // One document gets a losing leaf (all zeros sorts below any computed revision); the
        // next request edits that leaf, and every other document's winner.
        let loser = format!("1-{}", "0".repeat(32));
        let conflicted = ids[7].as_str();
        let path = RevPath { start: 1, ids: vec!["0".repeat(32)] };
        database
            .write(conflicted, &Write::Replicated { path, deleted: false, body: body(json!({"side": 1})) })
            .await
            .unwrap();
        let edits: Vec<(String, Vec<Write>)> = ids
            .iter()
            .zip(&revs)
            .map(|(id, rev)| {
                let parent = if id == conflicted { loser.clone() } else { rev.clone() };
                (
                    id.clone(),
                    vec![Write::Edit { parent: Some(parent), deleted: false, body: body(json!({"edited": true})) }],
                )
            })
            .collect();
        let before = store.write_transactions();
        let answers = database.write_many(&edits).await.unwrap();
        // The 99 records in one; the conflicted document's three steps (the side document
        // marked, the record, the side document again) after it.
        assert_eq!(store.write_transactions() - before, 4, "99 records at once, one save of three steps");
        assert!(answers.iter().all(|a| a.as_ref().is_ok_and(|a| a.iter().all(Result::is_ok))), "{answers:?}");
        for id in &ids {
            let tree = database.read(id).await.unwrap().unwrap().tree;
            let winner = tree.winner().unwrap();
            assert!(winner.rev().starts_with("2-") && winner.body["edited"] == true, "{id}");
            let leaves = tree.leaves().len();
            assert_eq!(leaves, if id == conflicted { 2 } else { 1 }, "{id}");
        }
        let conflicted_tree = database.read(conflicted).await.unwrap().unwrap().tree;
        assert!(conflicted_tree.leaf(&revs[7]).is_some(), "the old winner is kept as the losing leaf");
    }

    /// `write_many` answers and stores each document exactly as `write_batch` called once per
    /// document does, and every changed document reaches the change feed.
    #[tokio::test]
    async fn many_documents_are_written_as_one_by_one() {
        let dir = tempfile::tempdir().unwrap();
        let guard: Arc<dyn crate::database::write_guard::WriteGuard> = Arc::new(RefuseForbidden);
        let one_by_one =
            Database::new("a".into(), embedded(&dir, "a.redb").await).with_write_guard(Some(Arc::clone(&guard)));
        let bulk = Database::new("b".into(), embedded(&dir, "b.redb").await).with_write_guard(Some(guard));
        history(&one_by_one).await;
        history(&bulk).await;
        let documents = page();
        let mut expected = Vec::new();
        for (id, writes) in &documents {
            expected.push(shown(&one_by_one.write_batch(id, writes).await));
        }
        let answers = bulk.write_many(&documents).await.unwrap();
        assert_eq!(answers.iter().map(shown).collect::<Vec<_>>(), expected);
        assert!(expected.iter().flatten().any(|a| a == &Err(ErrorKind::Forbidden)), "the guard refused a write");
        assert!(expected.iter().flatten().filter(|a| a.is_err()).count() >= 2, "a stub naming nothing is refused too");
        for id in ["new", "live", "gone", "known", "deleting", "_design/d", "guarded", "stub"] {
            let (a, b) = (one_by_one.read(id).await.unwrap(), bulk.read(id).await.unwrap());
            assert_eq!(a.map(|s| s.tree), b.map(|s| s.tree), "{id}");
        }
        let feed: HashSet<String> =
            bulk.backend().changes(None, 100).await.unwrap().changes.into_iter().map(|c| c.id).collect();
        for id in ["new", "live", "gone", "known", "deleting", "_design/d", "guarded"] {
            assert!(feed.contains(id), "{id} is in the feed");
        }
        let live = bulk.read("live").await.unwrap().unwrap().tree;
        assert!(live.leaf("3-a3").is_some_and(|leaf| leaf.deleted), "the repeated id's group was applied after");
    }

    /// The revisions stored beyond `revs_limit` are stemmed in the bulk path too.
    #[tokio::test]
    async fn revs_limit_stems_bulk_writes() {
        let dir = tempfile::tempdir().unwrap();
        let database = Database::new("d".into(), embedded(&dir, "d.redb").await);
        database.update_settings(|settings| settings.revs_limit = 2).await.unwrap();
        let documents = vec![("doc".to_owned(), vec![leaf(4, &["r4", "r3", "r2", "r1"], false, json!({}))])];
        database.write_many(&documents).await.unwrap();
        let tree = database.read("doc").await.unwrap().unwrap().tree;
        let winner = tree.winner().unwrap();
        assert_eq!(winner.path.revs(), ["4-r4", "3-r3"]);
    }

    /// A backend on which another writer changes `target` just before a bulk write lands.
    struct Interloper {
        inner: Arc<dyn DocumentBackend>,
        target: String,
        armed: AtomicBool,
    }

    #[async_trait::async_trait]
    impl crate::backend::raw::layer::Layered for Interloper {
        fn inner(&self) -> &dyn DocumentBackend {
            self.inner.as_ref()
        }

        async fn bulk_write(&self, writes: Vec<BulkWrite>) -> Result<Vec<Result<Revision>>> {
            if self.armed.swap(false, Ordering::SeqCst) {
                let other = Database::new("other".into(), Arc::clone(&self.inner));
                other.write(&self.target, &leaf(2, &["other2", "o1"], false, json!({"by": "other"}))).await?;
            }
            self.inner.bulk_write(writes).await
        }
    }

    /// A document another writer changed between the bulk read and the bulk save is read again
    /// and written alone: both writers' leaves are kept, the other documents of the page saved.
    #[tokio::test]
    async fn a_concurrent_writer_is_retried_per_document() {
        let dir = tempfile::tempdir().unwrap();
        let inner = embedded(&dir, "d.redb").await;
        let layer = Arc::new(Interloper { inner, target: "doc".into(), armed: AtomicBool::new(false) });
        let database = Database::new("d".into(), layer.clone());
        database.write("doc", &leaf(1, &["o1"], false, json!({}))).await.unwrap();
        layer.armed.store(true, Ordering::SeqCst);
        let documents = vec![
            ("doc".to_owned(), vec![leaf(2, &["mine2", "o1"], false, json!({"by": "me"}))]),
            ("fresh".to_owned(), vec![leaf(1, &["f1"], false, json!({}))]),
        ];
        let answers = database.write_many(&documents).await.unwrap();
        assert!(answers.iter().all(|a| a.as_ref().is_ok_and(|a| a.iter().all(Result::is_ok))), "{answers:?}");
        assert!(!layer.armed.load(Ordering::SeqCst), "the other writer did write");
        let tree = database.read("doc").await.unwrap().unwrap().tree;
        let mut leaves: Vec<String> = tree.leaves().iter().map(|leaf| leaf.rev()).collect();
        leaves.sort();
        assert_eq!(leaves, ["2-mine2", "2-other2"]);
        assert!(database.read("fresh").await.unwrap().is_some());
    }

    /// A backend whose next bulk write fails before writing, as a process killed between a
    /// page's local trees and its records would leave it; `checks_never_written` says whether
    /// it takes `NeverWritten` creates (as the embedded store, DynamoDB and Firestore do) or
    /// not (as CouchDB).
    struct CrashBeforeRecords {
        inner: Arc<dyn DocumentBackend>,
        armed: AtomicBool,
        checks_never_written: bool,
    }

    #[async_trait::async_trait]
    impl crate::backend::raw::layer::Layered for CrashBeforeRecords {
        fn inner(&self) -> &dyn DocumentBackend {
            self.inner.as_ref()
        }

        fn checks_never_written(&self) -> bool {
            self.checks_never_written && self.inner.checks_never_written()
        }

        async fn bulk_write(&self, writes: Vec<BulkWrite>) -> Result<Vec<Result<Revision>>> {
            if self.armed.swap(false, Ordering::SeqCst) {
                return Err(Error::new(ErrorKind::Unavailable, "killed"));
            }
            self.inner.bulk_write(writes).await
        }
    }

    /// Five documents of two leaves each.
    fn two_leaved_page() -> Vec<(String, Vec<Write>)> {
        (0..5)
            .map(|n| {
                (
                    format!("doc{n}"),
                    vec![leaf(2, &["b", "a"], false, json!({"n": n})), leaf(2, &["c", "a"], false, json!({}))],
                )
            })
            .collect()
    }

    /// On a backend that cannot check `NeverWritten` (new documents go the local-tree way), a
    /// bulk save cut short after the local trees leaves every new document readable with its
    /// whole tree (never half a document), and writing the page again finishes them into the
    /// feed, as a resumed migration does.
    #[tokio::test]
    async fn a_bulk_save_cut_short_is_finished_by_writing_the_page_again() {
        let dir = tempfile::tempdir().unwrap();
        let inner = embedded(&dir, "d.redb").await;
        let layer = Arc::new(CrashBeforeRecords { inner, armed: AtomicBool::new(true), checks_never_written: false });
        let database = Database::new("d".into(), layer.clone());
        let documents = two_leaved_page();
        assert!(database.write_many(&documents).await.is_err(), "the first save is cut short");
        for (id, _) in &documents {
            let state = database.read(id).await.unwrap().expect("the tree was written");
            assert_eq!(state.tree.leaves().len(), 2, "{id}: both leaves or none");
            assert!(database.half_written(id, Some(&state)).await.unwrap());
        }
        assert!(database.backend().changes(None, 10).await.unwrap().changes.is_empty());
        let answers = database.write_many(&documents).await.unwrap();
        assert!(answers.iter().all(|a| a.as_ref().is_ok_and(|a| a.iter().all(Result::is_ok))));
        let feed = database.backend().changes(None, 10).await.unwrap().changes;
        assert_eq!(feed.len(), documents.len(), "every document reaches the feed once finished");
        for (id, _) in &documents {
            let state = database.read(id).await.unwrap();
            assert!(!database.half_written(id, state.as_ref()).await.unwrap());
        }
    }

    /// Where the backend checks `NeverWritten`, new documents write nothing before their
    /// records: a bulk save cut short leaves no trace of them (no record, no local tree), and
    /// writing the page again writes each whole, into the feed once.
    #[tokio::test]
    async fn a_bulk_save_of_new_documents_cut_short_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let inner = embedded(&dir, "d.redb").await;
        let layer = Arc::new(CrashBeforeRecords { inner, armed: AtomicBool::new(true), checks_never_written: true });
        let database = Database::new("d".into(), layer.clone());
        let documents = two_leaved_page();
        assert!(database.write_many(&documents).await.is_err(), "the first save is cut short");
        for (id, _) in &documents {
            assert!(database.read(id).await.unwrap().is_none(), "{id}: nothing of it was written");
            assert!(layer.get_local(&format!("{TREE_PREFIX}{id}")).await.unwrap().is_none(), "{id}: no local tree");
        }
        assert!(database.backend().changes(None, 10).await.unwrap().changes.is_empty());
        let answers = database.write_many(&documents).await.unwrap();
        assert!(answers.iter().all(|a| a.as_ref().is_ok_and(|a| a.iter().all(Result::is_ok))));
        let feed = database.backend().changes(None, 10).await.unwrap().changes;
        assert_eq!(feed.len(), documents.len(), "every document in the feed once");
        for (id, _) in &documents {
            let state = database.read(id).await.unwrap().expect("written");
            assert_eq!(state.tree.leaves().len(), 2, "{id}: both leaves");
            assert!(state.token.record().is_some_and(|t| t.record_rev.is_some()), "{id}: a live record");
        }
    }

    /// Documents re-created over their tombstones still go the local-tree way, on every
    /// backend: a bulk save cut short between their local trees and their records leaves them
    /// half-written (readable, live, missing from the feed's latest changes), and writing the
    /// page again finishes them, although the tombstones are still there.
    #[tokio::test]
    async fn a_re_creation_cut_short_is_finished_by_writing_the_page_again() {
        let dir = tempfile::tempdir().unwrap();
        let inner = embedded(&dir, "d.redb").await;
        let layer = Arc::new(CrashBeforeRecords { inner, armed: AtomicBool::new(false), checks_never_written: true });
        let database = Database::new("d".into(), layer.clone());
        for n in 0..3 {
            let id = format!("doc{n}");
            database.write(&id, &leaf(1, &["a"], false, json!({}))).await.unwrap();
            database.write(&id, &leaf(2, &["d", "a"], true, json!({}))).await.unwrap();
        }
        let documents: Vec<(String, Vec<Write>)> =
            (0..3).map(|n| (format!("doc{n}"), vec![leaf(2, &["b", "a"], false, json!({"n": n}))])).collect();
        layer.armed.store(true, Ordering::SeqCst);
        assert!(database.write_many(&documents).await.is_err(), "the first save is cut short");
        for (id, _) in &documents {
            let state = database.read(id).await.unwrap().expect("the tree was written");
            assert!(!state.deleted(), "{id}: its local tree holds the re-creation");
            assert!(database.half_written(id, Some(&state)).await.unwrap(), "{id}: half-written");
        }
        let answers = database.write_many(&documents).await.unwrap();
        assert!(answers.iter().all(|a| a.as_ref().is_ok_and(|a| a.iter().all(Result::is_ok))));
        let feed = database.backend().changes(None, 10).await.unwrap().changes;
        assert_eq!(feed.len(), documents.len());
        assert!(feed.iter().all(|change| !change.deleted), "every re-created document is live in the feed");
        for (id, _) in &documents {
            let state = database.read(id).await.unwrap().expect("written");
            assert!(state.token.record().is_some_and(|t| t.record_rev.is_some()), "{id}: a live record");
            assert!(!database.half_written(id, Some(&state)).await.unwrap());
            assert_eq!(state.tree.leaves().len(), 2, "{id}: the deleted leaf and the new one");
        }
    }

    /// A page of new documents costs two batched reads and one bulk write, whatever its size:
    /// no local-tree read or write per document. Re-creations over tombstones in a page cost
    /// their local trees' writes, one each, and the page's reads stay batched.
    #[tokio::test]
    async fn a_page_of_new_documents_costs_three_batched_calls() {
        let dir = tempfile::tempdir().unwrap();
        let layer = super::super::counting::CountingBackend::over(embedded(&dir, "d.redb").await, false);
        let database = Database::new("d".into(), layer.clone());
        database.revs_limit().await.unwrap();
        let documents: Vec<(String, Vec<Write>)> = (0..50)
            .map(|n| {
                let body = json!({"n": n});
                (format!("doc{n:02}"), vec![leaf(2, &["b", "a"], false, body), leaf(2, &["c", "a"], false, json!({}))])
            })
            .collect();
        layer.taken_counts();
        let answers = database.write_many(&documents).await.unwrap();
        assert!(answers.iter().all(|a| a.as_ref().is_ok_and(|a| a.iter().all(Result::is_ok))));
        assert_eq!(layer.taken_counts(), [("bulk_write", 1), ("get_many", 1), ("get_many_local", 1)].into());
        assert_eq!(database.backend().changes(None, 100).await.unwrap().changes.len(), documents.len());

        for n in 0..3 {
            database.write(&format!("doc{n:02}"), &leaf(3, &["x", "b", "a"], true, json!({}))).await.unwrap();
            database.write(&format!("doc{n:02}"), &leaf(3, &["y", "c", "a"], true, json!({}))).await.unwrap();
        }
        let again: Vec<(String, Vec<Write>)> = (0..6)
            .map(|n| (format!("doc{n:02}"), vec![leaf(3, &["z", "b", "a"], false, json!({"again": n}))]))
            .collect();
        layer.taken_counts();
        let answers = database.write_many(&again).await.unwrap();
        assert!(answers.iter().all(|a| a.as_ref().is_ok_and(|a| a.iter().all(Result::is_ok))));
        assert_eq!(
            layer.taken_counts(),
            [("bulk_write", 1), ("get_many", 1), ("get_many_local", 1), ("put_local", 3)].into(),
            "three re-creations write their local trees first, three live records do not"
        );
        for n in 0..6 {
            let state = database.read(&format!("doc{n:02}")).await.unwrap().expect("written");
            assert!(
                state.token.record().is_some_and(|t| t.record_rev.is_some()) && !state.deleted(),
                "doc{n:02} is live"
            );
        }
    }

    /// A backend on which another writer creates `target` and deletes it again just before the
    /// next bulk write lands, leaving a tombstone where the page read nothing.
    struct TombstoneMeanwhile {
        inner: Arc<dyn DocumentBackend>,
        target: String,
        armed: AtomicBool,
    }

    #[async_trait::async_trait]
    impl crate::backend::raw::layer::Layered for TombstoneMeanwhile {
        fn inner(&self) -> &dyn DocumentBackend {
            self.inner.as_ref()
        }

        async fn bulk_write(&self, writes: Vec<BulkWrite>) -> Result<Vec<Result<Revision>>> {
            if self.armed.swap(false, Ordering::SeqCst) {
                let other = Database::new("other".into(), Arc::clone(&self.inner));
                other.write(&self.target, &leaf(1, &["o1"], false, json!({"by": "other"}))).await?;
                other.write(&self.target, &leaf(2, &["o2", "o1"], true, json!({}))).await?;
            }
            self.inner.bulk_write(writes).await
        }
    }

    /// A create of an id the page read as never written, over which another writer left a
    /// tombstone meanwhile, fails (a tombstone is what creations serialize on) and is written
    /// again alone: the other writer's deleted branch and the page's leaf are both kept.
    #[tokio::test]
    async fn a_tombstone_left_meanwhile_is_not_written_over() {
        let dir = tempfile::tempdir().unwrap();
        let inner = embedded(&dir, "d.redb").await;
        let layer = Arc::new(TombstoneMeanwhile { inner, target: "doc".into(), armed: AtomicBool::new(true) });
        let database = Database::new("d".into(), layer.clone());
        let documents = vec![
            ("doc".to_owned(), vec![leaf(1, &["m1"], false, json!({"by": "me"}))]),
            ("fresh".to_owned(), vec![leaf(1, &["f1"], false, json!({}))]),
        ];
        let answers = database.write_many(&documents).await.unwrap();
        assert!(answers.iter().all(|a| a.as_ref().is_ok_and(|a| a.iter().all(Result::is_ok))), "{answers:?}");
        assert!(!layer.armed.load(Ordering::SeqCst), "the other writer did write");
        let state = database.read("doc").await.unwrap().expect("written");
        let mut leaves: Vec<(String, bool)> = state.tree.leaves().iter().map(|l| (l.rev(), l.deleted)).collect();
        leaves.sort();
        assert_eq!(leaves, [("1-m1".to_owned(), false), ("2-o2".to_owned(), true)]);
        assert!(
            state.token.record().is_some_and(|t| t.record_rev.is_some()),
            "re-created over the tombstone: a live record"
        );
        assert!(database.read("fresh").await.unwrap().is_some());
    }
}
