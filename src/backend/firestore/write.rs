//! The write path: a write mints its revision and becomes one `:commit` (a document and its chunk
//! documents change together) with a precondition on exactly the version it checked, or, for
//! plain documents in bulk, `:batchWrite` entries; deletes leave tombstones; replicated revisions
//! are stored as CouchDB's rules say.

use futures::{stream, StreamExt, TryStreamExt};
use reqwest::Method;
use serde_json::{json, Map, Value};

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};

use super::backend::{inconsistent, FirestoreBackend, CONSISTENT_READ_TRIES};
use super::codec;
use super::core::Call;
use super::layout::{self, StoredState};
use crate::backend::replicated;
use crate::backend::revision::{PackedAncestry, RevisionId};
use crate::backend::{BulkWrite, DocumentBackend, Precondition, ReplicatedOutcome, ReplicatedRevision, Revision};
use crate::error::{Error, ErrorKind, Result};

/// Firestore's limits on one `:batchWrite`: 500 writes, 10 MiB; a margin on the size.
pub(super) const BATCH_WRITE_MAX: usize = 500;
pub(super) const BATCH_WRITE_MAX_BYTES: usize = 9_000_000;
/// Commits and batch writes of one bulk request in flight at once.
pub(super) const WRITE_CONCURRENCY: usize = 16;
/// Rounds of retrying batch-write entries Firestore answered as busy.
pub(super) const BUSY_WRITE_ROUNDS: usize = 6;
/// The most chunk documents one document can have.
pub(super) const MAX_CHUNKS: usize = codec::MAX_COMPRESSED_BYTES.div_ceil(codec::CHUNK_BYTES);
/// One `:batchWrite` entry: the result slot, the write, and the revision it mints.
pub(super) type BatchEntry = (usize, Value, Revision);
/// A write ready to commit: Firestore's writes, and the revision it mints.
pub(super) struct PlannedWrite {
    pub writes: Vec<Value>,
    pub rev: Revision,
}

pub(super) fn stale(id: &str, rev: &Revision) -> Error {
    Error::conflict(format!("document {id:?} is not at revision {rev}"))
}

/// The state a revision given as a precondition stands for without a read: a previous-release
/// revision says its `updateTime` and chunk count itself.
pub(super) fn legacy_state(rev: &Revision) -> Option<StoredState> {
    layout::parse_legacy(rev, MAX_CHUNKS).map(|(time, chunks)| StoredState::legacy(time, chunks))
}

/// Splits writes into `:batchWrite` requests within Firestore's count and size limits.
pub(super) fn group_by_size<T>(entries: Vec<(usize, Value, T)>) -> Vec<Vec<(usize, Value, T)>> {
    let mut groups: Vec<Vec<(usize, Value, T)>> = Vec::new();
    let mut size = 0;
    for entry in entries {
        let entry_size = crate::model::validate::json_size(&entry.1);
        let full =
            groups.last().is_none_or(|g| g.len() >= BATCH_WRITE_MAX || size + entry_size > BATCH_WRITE_MAX_BYTES);
        if full {
            groups.push(Vec::new());
            size = 0;
        }
        size += entry_size;
        if let Some(group) = groups.last_mut() {
            group.push(entry);
        }
    }
    groups
}

/// The error for a failed `:batchWrite` entry (gRPC status codes).
pub(super) fn write_error(code: i64, id: &str, message: &str) -> Error {
    let kind = match code {
        5 | 6 | 9 => ErrorKind::Conflict, // NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION
        3 | 11 => ErrorKind::InvalidInput,
        7 | 16 => ErrorKind::Unauthorized,
        8 | 10 | 14 | 4 => ErrorKind::Unavailable,
        _ => ErrorKind::Internal,
    };
    Error::new(kind, format!("Firestore did not write document {id:?} (status {code}: {message})"))
}

impl FirestoreBackend {
    /// The writes that store `body` under `id` if `precondition` holds against `current` (the
    /// stored version that was read, or `None` for none): the main document with the new
    /// revision and a precondition on exactly the version checked, its chunks, and deletes of
    /// the chunk slots the replaced version used beyond the new count.
    pub(super) fn plan_write(
        &self,
        id: &str,
        body: &Map<String, Value>,
        precondition: &Precondition,
        current: Option<&StoredState>,
    ) -> Result<PlannedWrite> {
        let parent = match (precondition, current) {
            (Precondition::MustNotExist, Some(state)) if !state.deleted => {
                return Err(Error::conflict(format!("document {id:?} already exists")))
            }
            (Precondition::NeverWritten, Some(_)) => {
                return Err(Error::conflict(format!("document {id:?} was written before (it is live or deleted)")))
            }
            (Precondition::MatchRevision(rev), None) => return Err(stale(id, rev)),
            (Precondition::MatchRevision(rev), Some(state)) if state.deleted || &state.rev != rev => {
                return Err(stale(id, rev))
            }
            (_, current) => current,
        };
        let rev = RevisionId::next_after(parent.map(StoredState::counted_generation))?;
        let ancestry = PackedAncestry::extend(parent.map(|p| &p.ancestry), &rev, self.config.revs_limit);
        self.plan_version(id, Some(body), &rev, &ancestry, parent)
    }

    /// The writes that replace `current` (`None`: no document) by revision `rev` with `ancestry`:
    /// the main document, conditional on exactly the version read, with `body` or, for `None`, as
    /// a tombstone; the body's chunks; and deletes of the chunk slots the replaced version used
    /// beyond the new count.
    pub(super) fn plan_version(
        &self,
        id: &str,
        body: Option<&Map<String, Value>>,
        rev: &RevisionId,
        ancestry: &PackedAncestry,
        current: Option<&StoredState>,
    ) -> Result<PlannedWrite> {
        let document_id = codec::document_id(id);
        let (fields, chunk_set, extra_chunks) = match body {
            Some(body) => {
                let codec::Encoded { mut fields, chunk_set, extra_chunks } = codec::encode(id, body)?;
                layout::stamp(&mut fields, rev, ancestry, false);
                (fields, chunk_set, extra_chunks)
            }
            None => (layout::tombstone_fields(id, rev, ancestry), None, Vec::new()),
        };
        let mut main = json!({
            "update": { "name": self.client.document_name(&document_id), "fields": fields },
            "updateTransforms": layout::changed_at_transform(),
        });
        main["currentDocument"] = match current {
            Some(state) => json!({ "updateTime": state.update_time }),
            None => json!({ "exists": false }),
        };
        let mut writes = vec![main];
        if let Some(set) = &chunk_set {
            for (n, chunk) in extra_chunks.iter().enumerate() {
                writes.push(json!({
                    "update": { "name": self.client.chunk_name(&document_id, n + 1), "fields": codec::chunk_fields(set, chunk) }
                }));
            }
        }
        let chunk_count = extra_chunks.len();
        for n in chunk_count + 1..=current.map_or(0, |p| p.chunks) {
            writes.push(json!({ "delete": self.client.chunk_name(&document_id, n) }));
        }
        Ok(PlannedWrite { writes, rev: rev.to_revision() })
    }

    /// Stores a revision made elsewhere if the rules of [`replicated::judge`] say so against the
    /// stored state, conditional on the version read; a lost race reads again and judges anew.
    pub(super) async fn put_replicated_version(
        &self,
        id: &str,
        incoming: &ReplicatedRevision,
    ) -> Result<ReplicatedOutcome> {
        let checked = replicated::check(id, incoming)?;
        let ancestry = checked.stored_ancestry(self.config.revs_limit);
        let body = (!incoming.deleted).then_some(&incoming.body);
        // A deletion's fields go in its tombstone (the main write, the first of the plan).
        let deleted_body = if incoming.deleted { layout::deleted_body_field(id, &incoming.body)? } else { None };
        for _ in 0..CONSISTENT_READ_TRIES {
            let current = self.read_state(id).await?;
            let outcome = replicated::judge(incoming, current.as_ref().map(StoredState::info).as_ref());
            if outcome != ReplicatedOutcome::Applied {
                return Ok(outcome);
            }
            let mut plan = self.plan_version(id, body, &checked.rev, &ancestry, current.as_ref())?;
            if let Some(field) = deleted_body.as_ref() {
                plan.writes[0]["update"]["fields"][layout::DELETED_BODY] = field.clone();
            }
            match self.commit_planned(id, plan).await {
                Err(e) if e.is_conflict() => continue,
                outcome => return outcome.map(|_| ReplicatedOutcome::Applied),
            }
        }
        Err(inconsistent(&format!("write a replicated revision of document {id:?}")))
    }

    /// Commits a planned write; its revision. A write whose answer was lost is looked up: if the
    /// document holds the revision it minted (random, so no other writer's), it was applied.
    pub(super) async fn commit_planned(&self, id: &str, plan: PlannedWrite) -> Result<Revision> {
        let doing = format!("write document {id:?}");
        match self.commit(plan.writes, &doing).await {
            Ok(_) => Ok(plan.rev),
            Err(e) if e.kind() == ErrorKind::OutcomeUnknown => {
                if self.holds_revision(id, &plan.rev).await {
                    tracing::warn!(id, rev = %plan.rev, "a write whose answer was lost had been applied");
                    Ok(plan.rev)
                } else {
                    Err(e)
                }
            }
            // An update precondition on a missing document answers NOT_FOUND in production.
            Err(e) if matches!(e.kind(), ErrorKind::Conflict | ErrorKind::NotFound) => {
                Err(Error::conflict(format!("document {id:?} changed or is gone")).with_source(e))
            }
            Err(e) => Err(e),
        }
    }

    /// Whether the document `id` is now at `rev` (false when that cannot be read).
    pub(super) async fn holds_revision(&self, id: &str, rev: &Revision) -> bool {
        matches!(self.read_state(id).await, Ok(Some(state)) if &state.rev == rev)
    }

    /// `put` with no precondition: replaces whatever is there (live or tombstone, continuing its
    /// generation), conditional on the version read, read again when another writer wins.
    pub(super) async fn overwrite(&self, id: &str, body: &Map<String, Value>) -> Result<Revision> {
        for _ in 0..CONSISTENT_READ_TRIES {
            let current = self.read_state(id).await?;
            let plan = self.plan_write(id, body, &Precondition::None, current.as_ref())?;
            match self.commit_planned(id, plan).await {
                Err(e) if e.is_conflict() => continue,
                outcome => return outcome,
            }
        }
        Err(inconsistent(&format!("write document {id:?}")))
    }

    /// Single-document writes through `:batchWrite`, busy entries retried; each entry is the
    /// result slot, the write and the revision it mints.
    pub(super) async fn batch_write(
        &self,
        entries: Vec<BatchEntry>,
        results: &mut [Option<Result<Revision>>],
    ) -> Result<()> {
        let mut pending = entries;
        let mut backoff = ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(100))
            .with_max_delay(Duration::from_secs(3))
            .with_jitter()
            .with_max_times(BUSY_WRITE_ROUNDS)
            .build();
        for round in 0..=BUSY_WRITE_ROUNDS {
            if pending.is_empty() {
                break;
            }
            if round > 0 {
                tokio::time::sleep(backoff.next().unwrap_or(Duration::from_secs(3))).await;
            }
            let groups = group_by_size(pending);
            let replies: Vec<(Vec<BatchEntry>, Value)> = stream::iter(groups)
                .map(|group| async move {
                    let body = json!({ "writes": group.iter().map(|(_, w, _)| w).collect::<Vec<_>>() });
                    let reply = self
                        .client
                        .call(
                            Method::POST,
                            &self.client.method_url("batchWrite"),
                            Some(&body),
                            Call::Write,
                            "write documents in bulk",
                        )
                        .await;
                    // Whatever the outcome (a write that timed out may have landed).
                    self.forget_counts();
                    Ok::<_, Error>((group, reply?))
                })
                .buffered(WRITE_CONCURRENCY)
                .try_collect()
                .await?;
            pending = Vec::new();
            for (group, reply) in replies {
                for (position, (slot, write, rev)) in group.into_iter().enumerate() {
                    let status = reply.pointer(&format!("/status/{position}"));
                    let code = status.and_then(|s| s.get("code")).and_then(Value::as_i64).unwrap_or(0);
                    let message = status.and_then(|s| s.get("message")).and_then(Value::as_str).unwrap_or("");
                    let id = write.pointer("/update/fields/_id/stringValue").and_then(Value::as_str).unwrap_or("?");
                    results[slot] = Some(match code {
                        0 => Ok(rev),
                        // ABORTED, RESOURCE_EXHAUSTED, UNAVAILABLE: not applied; try again.
                        10 | 8 | 14 if round < BUSY_WRITE_ROUNDS => {
                            pending.push((slot, write, rev));
                            continue;
                        }
                        code => Err(write_error(code, id, message)),
                    });
                }
            }
        }
        Ok(())
    }

    /// `bulk_write` of writes to distinct ids.
    pub(super) async fn write_distinct_ids(&self, writes: Vec<BulkWrite>) -> Result<Vec<Result<Revision>>> {
        let mut results: Vec<Option<Result<Revision>>> = (0..writes.len()).map(|_| None).collect();
        // Updates and overwrites need the stored version (its revision, ancestry and chunks);
        // creates are tried blind.
        let to_read: Vec<String> = crate::backend::distinct_ids(
            &writes
                .iter()
                .filter(|w| match &w.precondition {
                    Precondition::MustNotExist | Precondition::NeverWritten => false,
                    Precondition::MatchRevision(rev) => legacy_state(rev).is_none(),
                    Precondition::None => true,
                })
                .map(|w| w.id.clone())
                .collect::<Vec<_>>(),
        );
        let states = self.read_states(&to_read).await?;
        let mut plain = Vec::new();
        let mut committed = Vec::new();
        for (slot, write) in writes.iter().enumerate() {
            let current = match &write.precondition {
                Precondition::MustNotExist | Precondition::NeverWritten => None,
                Precondition::MatchRevision(rev) => legacy_state(rev).or_else(|| states.get(&write.id).cloned()),
                Precondition::None => states.get(&write.id).cloned(),
            };
            match self.plan_write(&write.id, &write.body, &write.precondition, current.as_ref()) {
                Err(e) => results[slot] = Some(Err(e)),
                Ok(plan) if plan.writes.len() > 1 => committed.push((slot, write.id.clone(), plan)),
                Ok(mut plan) => plain.push((slot, plan.writes.remove(0), plan.rev)),
            }
        }
        // Plain loops of futures, not closures in iterator adapters: those trip rustc's
        // higher-ranked `Send` check here.
        let mut commit_futures = Vec::with_capacity(committed.len());
        for (slot, id, plan) in committed {
            commit_futures.push(async move { (slot, self.commit_planned(&id, plan).await) });
        }
        let commits: Vec<(usize, Result<Revision>)> =
            stream::iter(commit_futures).buffer_unordered(WRITE_CONCURRENCY).collect().await;
        for (slot, result) in commits {
            results[slot] = Some(result);
        }
        self.batch_write(plain, &mut results).await?;
        // A blind create that met a tombstone, or an overwrite that lost a race, is done again
        // alone from a fresh read; a failed revision match stands, and so does a `NeverWritten`
        // create that met anything (its `exists: false` is the whole check).
        let again: Vec<usize> = results
            .iter()
            .enumerate()
            .filter(|(slot, r)| {
                matches!(r, Some(Err(e)) if e.is_conflict())
                    && !matches!(
                        writes[*slot].precondition,
                        Precondition::MatchRevision(_) | Precondition::NeverWritten
                    )
            })
            .map(|(slot, _)| slot)
            .collect();
        let mut redo_futures = Vec::with_capacity(again.len());
        for slot in again {
            let write = writes[slot].clone();
            redo_futures.push(async move { (slot, self.put(&write.id, &write.body, write.precondition).await) });
        }
        let redone: Vec<(usize, Result<Revision>)> =
            stream::iter(redo_futures).buffer_unordered(WRITE_CONCURRENCY).collect().await;
        for (slot, result) in redone {
            results[slot] = Some(result);
        }
        Ok(results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| Err(Error::new(ErrorKind::Internal, "Firestore bulk write lost track of a write")))
            })
            .collect())
    }

    pub(super) async fn put_document(
        &self,
        id: &str,
        body: &Map<String, Value>,
        precondition: Precondition,
    ) -> Result<Revision> {
        match &precondition {
            Precondition::MustNotExist => {
                // Tried blind first (most creates are of new ids); a tombstone in the way is read
                // and replaced conditionally.
                let plan = self.plan_write(id, body, &precondition, None)?;
                match self.commit_planned(id, plan).await {
                    Err(e) if e.is_conflict() => {
                        let current = self.read_state(id).await?;
                        let plan = self.plan_write(id, body, &precondition, current.as_ref())?;
                        self.commit_planned(id, plan).await
                    }
                    outcome => outcome,
                }
            }
            Precondition::NeverWritten => {
                // `exists: false` fails over a tombstone as over a live document.
                let plan = self.plan_write(id, body, &precondition, None)?;
                self.commit_planned(id, plan).await
            }
            Precondition::MatchRevision(rev) => {
                let current = match legacy_state(rev) {
                    Some(state) => Some(state),
                    None if RevisionId::parse(rev.as_str()).is_some() => self.read_state(id).await?,
                    None => return Err(stale(id, rev)),
                };
                let plan = self.plan_write(id, body, &precondition, current.as_ref())?;
                self.commit_planned(id, plan).await
            }
            Precondition::None => self.overwrite(id, body).await,
        }
    }

    pub(super) async fn delete_document(&self, id: &str, rev: &Revision) -> Result<Revision> {
        let doing = format!("delete document {id:?}");
        let current = match legacy_state(rev) {
            Some(state) => Some(state),
            None => self.read_state(id).await?,
        };
        let current = match current {
            None => return Err(Error::not_found(format!("document {id:?} does not exist"))),
            Some(state) if state.deleted => return Err(Error::not_found(format!("document {id:?} is deleted"))),
            Some(state) if &state.rev != rev => return Err(stale(id, rev)),
            Some(state) => state,
        };
        let next = RevisionId::next_after(Some(current.counted_generation()))?;
        let ancestry = PackedAncestry::extend(Some(&current.ancestry), &next, self.config.revs_limit);
        let plan = self.plan_version(id, None, &next, &ancestry, Some(&current))?;
        match self.commit(plan.writes, &doing).await {
            Ok(_) => Ok(plan.rev),
            Err(e) if e.kind() == ErrorKind::OutcomeUnknown && self.holds_revision(id, &plan.rev).await => Ok(plan.rev),
            Err(e) if matches!(e.kind(), ErrorKind::Conflict | ErrorKind::NotFound) => {
                match self.read_state(id).await? {
                    None => Err(Error::not_found(format!("document {id:?} does not exist"))),
                    Some(state) if state.deleted => Err(Error::not_found(format!("document {id:?} is deleted"))),
                    Some(_) => Err(Error::conflict(format!("document {id:?} has changed since revision {rev}"))),
                }
            }
            Err(e) => Err(e),
        }
    }
}
