//! Many documents' writes at once ([`Database::write_many`]): what a replicator's page costs
//! when each document's write is one read and one save of its own is paid once per page instead.
//!
//! The documents' states are read in one batched read (`get_many`, then the local trees of the
//! ids without a live record), every document's writes are applied in memory exactly as
//! [`Database::write_batch`] applies them (the same guard, merge, stemming and attachment
//! resolution), and the saves are grouped:
//! - a live record whose tree stays live is one write of the record on its revision, and all of
//!   them go in one `bulk_write` (every adapter checks each item's precondition on its own: the
//!   embedded store in its transaction, DynamoDB with a conditional put per item, Firestore with
//!   a precondition per write, CouchDB with each document's `_rev`);
//! - a document created, or re-created over its tombstone, first writes its local tree on the
//!   revision read (the compare-and-swap every save from a tombstone is serialized on), and only
//!   after that its record, in the same one `bulk_write`. A crash between the two leaves what a
//!   crash inside [`Database::write_batch`] leaves, a half-written document, which the next write
//!   of it finishes ([`Database::half_written`]);
//! - anything else (a deletion, a document staying deleted) is saved alone as `write_batch`
//!   saves it.
//!
//! A document whose save met another writer (any failed precondition) is written again alone
//! through [`Database::write_batch`], which reads it again and retries, so conflicts between
//! writers are resolved per document exactly as before. The bulk pass takes none of the
//! per-id write locks: they only spare this process's writers their tries against each other,
//! and a bulk pass holding most of them would serialize every other writer behind it.

use std::collections::HashSet;

use futures::{StreamExt, TryStreamExt};

use super::{gone_is_conflict, record_of, Applied, DocState, Written, TREE_PREFIX};
use crate::backend::{BulkWrite, Precondition};
use crate::database::rev_tree::RevTree;
use crate::database::{Database, Write};
use crate::error::{Error, ErrorKind, Result};

/// Local trees read, and documents saved alone, at once.
const CONCURRENCY: usize = 16;

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

impl Database {
    /// Applies each document's writes as [`Database::write_batch`] does, for many documents in
    /// a few backend calls (see the module's documentation); one answer per document, in order.
    /// An id given twice has its second group applied after its first. The outer error is for a
    /// failure of the whole call (the database deleted, a read or a bulk write that failed).
    pub async fn write_many(&self, documents: &[(String, Vec<Write>)]) -> Result<Vec<DocumentAnswers>> {
        self.while_open(self.write_many_once_open(documents)).await
    }

    async fn write_many_once_open(&self, documents: &[(String, Vec<Write>)]) -> Result<Vec<DocumentAnswers>> {
        let revs_limit = self.revs_limit().await?;
        let mut results: Vec<Option<DocumentAnswers>> = documents.iter().map(|_| None).collect();
        // The first group of each id goes in the bulk pass; a repeated id's later groups are
        // written alone after it, in order.
        let mut seen = HashSet::new();
        let (bulk, repeated): (Vec<usize>, Vec<usize>) =
            (0..documents.len()).partition(|&slot| seen.insert(documents[slot].0.as_str()));
        let ids: Vec<String> = bulk.iter().map(|&slot| documents[slot].0.clone()).collect();
        let states = self.read_states(&ids).await?;

        let mut in_bulk: Vec<Pending> = Vec::new();
        let mut alone: Vec<Pending> = Vec::new();
        for (slot, state) in bulk.into_iter().zip(states) {
            let (id, writes) = &documents[slot];
            let Applied { tree, answers, changed } = self.applied(id, state.as_ref(), writes, revs_limit).await?;
            // As in `write_batch`: a half-written document is finished even when nothing is new.
            if !changed && !(self.half_written(id, state.as_ref()).await?) {
                results[slot] = Some(Ok(answers));
                continue;
            }
            let live = tree.winner().is_some_and(|leaf| !leaf.deleted);
            let pending = Pending { slot, state, tree, answers };
            if live {
                in_bulk.push(pending);
            } else {
                alone.push(pending);
            }
        }

        let mut outcomes: Vec<(Pending, Saved)> = self.save_in_bulk(documents, in_bulk).await?;
        let saved_alone: Vec<(Pending, Saved)> = futures::stream::iter(alone)
            .map(|pending| async move {
                let id = documents[pending.slot].0.as_str();
                let saved = Saved::of(self.save(id, pending.state.as_ref(), &pending.tree).await);
                (pending, saved)
            })
            .buffered(CONCURRENCY)
            .collect()
            .await;
        outcomes.extend(saved_alone);

        let mut again = Vec::new();
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
        // Met another writer: read again and retried, one document at a time each.
        let retried: Vec<(usize, DocumentAnswers)> = futures::stream::iter(again)
            .map(|slot| async move {
                let (id, writes) = &documents[slot];
                (slot, self.write_batch_once_open(id, writes).await)
            })
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
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

    /// The states of distinct documents, in order: their records in one batched read, then the
    /// local trees of those without a live record, several at once.
    async fn read_states(&self, ids: &[String]) -> Result<Vec<Option<DocState>>> {
        let records = self.backend.get_many(ids).await?;
        futures::stream::iter(ids.iter().zip(records))
            .map(|(id, record)| async move {
                match record {
                    Some(record) => Ok(Some(DocState {
                        tree: super::tree_of(&record.body, id)?,
                        record_rev: Some(record.rev),
                        local_rev: None,
                    })),
                    None => self.read_tombstone(id).await,
                }
            })
            .buffered(CONCURRENCY)
            .try_collect()
            .await
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
        let with_local_first: Vec<(Pending, Saved, Option<BulkWrite>)> = futures::stream::iter(pending)
            .map(|pending| async move {
                let id = documents[pending.slot].0.as_str();
                let record = match record_of(&pending.tree) {
                    Ok(record) => record,
                    Err(err) => return (pending, Saved::Failed(err), None),
                };
                let record_rev = pending.state.as_ref().and_then(|s| s.record_rev.clone());
                if let Some(rev) = record_rev {
                    let write = BulkWrite { id: id.to_owned(), body: record, precondition: Precondition::MatchRevision(rev) };
                    return (pending, Saved::Done, Some(write));
                }
                let precondition = match pending.state.as_ref().and_then(|s| s.local_rev.clone()) {
                    Some(local_rev) => Precondition::MatchRevision(local_rev),
                    None => Precondition::MustNotExist,
                };
                let local = self.backend.put_local(&format!("{TREE_PREFIX}{id}"), &record, precondition).await;
                match Saved::of(local) {
                    Saved::Done => {
                        let write =
                            BulkWrite { id: id.to_owned(), body: record, precondition: Precondition::MustNotExist };
                        (pending, Saved::Done, Some(write))
                    }
                    refused => (pending, refused, None),
                }
            })
            .buffered(CONCURRENCY)
            .collect()
            .await;
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
        let written = self.backend.bulk_write(records).await?;
        if written.len() != writing.len() {
            return Err(Error::new(ErrorKind::Internal, "the backend answered a bulk write with too few results"));
        }
        outcomes.extend(writing.into_iter().zip(written).map(|(pending, result)| (pending, Saved::of(result))));
        Ok(outcomes)
    }
}
