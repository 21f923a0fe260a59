//! Where a migration writes: a backend through `bulk_write`, or an NDJSON file.
//!
//! Backend writes are create-only (`Precondition::MustNotExist`), so nothing at the target is
//! ever replaced by accident. A write that meets an existing document is resolved by content: the
//! same canonical hash means the document is already there (a batch written by a run that was
//! killed before its checkpoint, which is what makes resuming idempotent); a different one is a
//! conflict, handled by the [`ConflictPolicy`].

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::canonical::{content_hash, ContentHash};
use super::checkpoint::io_error;
use super::follow::Wanted;
use super::journal::{fingerprint, Journal, ABSENT};
use super::report::Ledger;
use crate::backend::{BulkWrite, DocumentBackend, Precondition, Revision, StoredDocument};
use crate::error::{Error, ErrorKind, Result};
use crate::model::validate::json_size;

/// How many times a write the target reports as unavailable is tried.
const WRITE_ATTEMPTS: u32 = 5;
/// How many times an overwrite that keeps meeting a concurrent writer is tried.
const OVERWRITE_ATTEMPTS: u32 = 5;
/// Most body JSON in one bulk request: CouchDB's default `max_http_request_size` is 4 GiB but
/// proxies in front of it commonly allow far less, and smaller requests keep memory even.
pub const MAX_BULK_BYTES: usize = 8 * 1024 * 1024;

/// What to do with a document that exists at the target with different content.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ConflictPolicy {
    /// Stop the migration and name the documents (the checkpoint stays before their batch).
    #[default]
    Fail,
    /// Leave the target's document alone and report it.
    Skip,
    /// Replace the target's document with the source's and report it.
    Overwrite,
}

/// A document on its way to the target.
#[derive(Debug, Clone)]
pub struct Outgoing {
    pub id: String,
    /// The source's revision (written to NDJSON exports; backends assign their own).
    pub source_rev: Revision,
    pub body: Map<String, Value>,
    pub hash: ContentHash,
}

impl Outgoing {
    pub fn new(id: String, source_rev: Revision, body: Map<String, Value>) -> Self {
        let hash = content_hash(&id, &body);
        Outgoing { id, source_rev, body, hash }
    }
}

/// Whether the sink tries a failed write again: only a temporary failure that no retry owner
/// below (the SDK, the shared HTTP layer) has already given up on, so retries do not stack.
pub(super) fn is_retryable(err: &Error) -> bool {
    err.is_retryable()
}

pub(super) async fn back_off(attempt: u32) {
    tokio::time::sleep(Duration::from_millis(100u64 << attempt.min(5))).await;
}

pub(super) fn target_error(what: &str, err: Error) -> Error {
    Error::new(err.kind(), format!("target: {what}")).with_source(err)
}

/// Records a document the target did not take: `refused` when the target cannot store it as it
/// is (it would alter a number, or the document is over its size limit), `failed` otherwise.
pub(super) fn note_failure(ledger: &mut Ledger, max_issues: usize, id: &str, err: &Error) {
    let refused = matches!(err.kind(), ErrorKind::InvalidInput | ErrorKind::TooLarge);
    if refused {
        ledger.counts.refused += 1;
    } else {
        ledger.counts.failed += 1;
    }
    Ledger::tally(&mut ledger.failures_by_kind, err.kind().as_str());
    ledger.note(max_issues, id, if refused { "refused" } else { "failed" }, err.to_string());
}

/// Writes one batch to a backend; the ledger says what became of each document. Fails as a whole
/// only when the target keeps failing whole requests. The batch goes out in bulk requests of at
/// most [`MAX_BULK_BYTES`] of JSON (and at least one document), so large documents do not make
/// requests the target refuses for their size.
///
/// With a `journal` (a migration that will follow the source), each document's state is recorded
/// in it before it is written, and a document already at the target is resolved as the follow
/// phase resolves it: this migration's own earlier write (a killed run's, of an older state) is
/// replaced, anything else is a conflict ([`super::follow::apply`]).
pub async fn write_to_backend(
    target: &dyn DocumentBackend,
    docs: Vec<Outgoing>,
    policy: ConflictPolicy,
    max_issues: usize,
    journal: Option<&Journal>,
) -> Result<Ledger> {
    let mut ledger = Ledger::default();
    for chunk in chunks_by_size(docs, MAX_BULK_BYTES) {
        if let Some(journal) = journal {
            record_intents(journal, &chunk).await?;
        }
        let written = write_chunk(target, chunk, policy, max_issues, journal).await?;
        ledger.absorb(written, max_issues);
    }
    Ok(ledger)
}

/// Splits documents into runs of at most `max_bytes` of body JSON (a larger document alone).
fn chunks_by_size(docs: Vec<Outgoing>, max_bytes: usize) -> Vec<Vec<Outgoing>> {
    let mut chunks = Vec::new();
    let mut current = Vec::new();
    let mut bytes = 0;
    for doc in docs {
        let size = json_size(&doc.body) + doc.id.len();
        if !current.is_empty() && bytes + size > max_bytes {
            chunks.push(std::mem::take(&mut current));
            bytes = 0;
        }
        bytes += size;
        current.push(doc);
    }
    if !current.is_empty() {
        chunks.push(current);
    }
    chunks
}

/// Adds each document's state to what the journal holds for it (nothing is known yet about the
/// target, so earlier fingerprints stay). A document the journal has never seen also gets
/// [`ABSENT`]: the copy writes it create-only, so "absent" is the state it replaces, and a run
/// killed between this record and the write leaves the target without it. Without `ABSENT`, a
/// later run finding it still absent (the source deleted it meanwhile, then wrote it again) would
/// take its absence for someone else's delete and stop on a conflict.
async fn record_intents(journal: &Journal, docs: &[Outgoing]) -> Result<()> {
    let ids: Vec<String> = docs.iter().map(|doc| doc.id.clone()).collect();
    let known = journal.lookup(ids).await?;
    let entries = docs
        .iter()
        .zip(known)
        .filter_map(|(doc, known)| {
            let print = fingerprint(&doc.hash);
            let mut prints = known.unwrap_or_else(|| vec![ABSENT]);
            if prints.contains(&print) {
                return None;
            }
            prints.push(print);
            Some((doc.id.clone(), prints))
        })
        .collect();
    journal.record(entries).await
}

async fn write_chunk(
    target: &dyn DocumentBackend,
    docs: Vec<Outgoing>,
    policy: ConflictPolicy,
    max_issues: usize,
    journal: Option<&Journal>,
) -> Result<Ledger> {
    let mut ledger = Ledger::default();
    let mut pending = docs;
    let mut attempt = 0;
    while !pending.is_empty() {
        attempt += 1;
        let last_attempt = attempt >= WRITE_ATTEMPTS;
        let writes = pending
            .iter()
            .map(|doc| BulkWrite {
                id: doc.id.clone(),
                body: doc.body.clone(),
                precondition: Precondition::MustNotExist,
            })
            .collect();
        let results = match target.bulk_write(writes).await {
            Ok(results) => results,
            Err(err) if is_retryable(&err) && !last_attempt => {
                tracing::warn!(error = %err, attempt, "bulk write failed; retrying");
                back_off(attempt).await;
                continue;
            }
            Err(err) => return Err(target_error(&format!("bulk write of {} documents failed", pending.len()), err)),
        };
        if results.len() != pending.len() {
            return Err(Error::new(
                ErrorKind::Internal,
                format!("target answered {} results for {} writes", results.len(), pending.len()),
            ));
        }
        let mut retry = Vec::new();
        let mut conflicted = Vec::new();
        for (doc, result) in pending.into_iter().zip(results) {
            match result {
                Ok(_) => ledger.counts.written += 1,
                Err(err) if err.is_conflict() => conflicted.push(doc),
                Err(err) if is_retryable(&err) && !last_attempt => retry.push(doc),
                Err(err) => note_failure(&mut ledger, max_issues, &doc.id, &err),
            }
        }
        let vanished = match journal {
            Some(journal) => {
                let wanted =
                    conflicted.into_iter().map(|doc| Wanted { id: doc.id.clone(), state: Some(doc) }).collect();
                let resolved = super::follow::apply(target, journal, wanted, policy, max_issues).await?;
                ledger.absorb(resolved, max_issues);
                Vec::new()
            }
            None => resolve_conflicts(target, conflicted, policy, &mut ledger, max_issues).await?,
        };
        retry.extend(vanished);
        if !retry.is_empty() {
            if last_attempt {
                for doc in &retry {
                    let err =
                        Error::new(ErrorKind::Unavailable, format!("not written after {WRITE_ATTEMPTS} attempts"));
                    note_failure(&mut ledger, max_issues, &doc.id, &err);
                }
                break;
            }
            back_off(attempt).await;
        }
        pending = retry;
    }
    Ok(ledger)
}

/// Sorts documents the target already holds into identical ones and conflicts. Returns the ones
/// that disappeared from the target meanwhile, to be written again.
async fn resolve_conflicts(
    target: &dyn DocumentBackend,
    conflicted: Vec<Outgoing>,
    policy: ConflictPolicy,
    ledger: &mut Ledger,
    max_issues: usize,
) -> Result<Vec<Outgoing>> {
    if conflicted.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<String> = conflicted.iter().map(|doc| doc.id.clone()).collect();
    let stored = target.get_many(&ids).await.map_err(|e| target_error("read back existing documents", e))?;
    let mut vanished = Vec::new();
    for (doc, stored) in conflicted.into_iter().zip(stored) {
        let Some(stored) = stored else {
            vanished.push(doc);
            continue;
        };
        if same_content(&doc, &stored) {
            ledger.counts.already_present += 1;
            continue;
        }
        match policy {
            ConflictPolicy::Skip => {
                ledger.counts.conflicts_skipped += 1;
                ledger.note(max_issues, &doc.id, "conflict_skipped", "differs at the target; left as it is");
            }
            ConflictPolicy::Fail => {
                ledger.counts.conflicts += 1;
                ledger.note(max_issues, &doc.id, "conflict", "exists at the target with different content");
            }
            ConflictPolicy::Overwrite => overwrite(target, &doc, stored.rev, ledger, max_issues).await,
        }
    }
    Ok(vanished)
}

pub(super) fn same_content(doc: &Outgoing, stored: &StoredDocument) -> bool {
    content_hash(&stored.id, &stored.body) == doc.hash
}

/// Replaces the target's document, following its revision if another writer moves it.
async fn overwrite(target: &dyn DocumentBackend, doc: &Outgoing, rev: Revision, ledger: &mut Ledger, max: usize) {
    let mut precondition = Precondition::MatchRevision(rev);
    for _ in 0..OVERWRITE_ATTEMPTS {
        match target.put(&doc.id, &doc.body, precondition.clone()).await {
            Ok(_) => {
                ledger.counts.overwritten += 1;
                ledger.note(max, &doc.id, "overwritten", "differed at the target; replaced with the source's");
                return;
            }
            Err(err) if err.is_conflict() || is_retryable(&err) => match target.get(&doc.id).await {
                Ok(None) => precondition = Precondition::MustNotExist,
                Ok(Some(stored)) if same_content(doc, &stored) => {
                    ledger.counts.already_present += 1;
                    return;
                }
                Ok(Some(stored)) => precondition = Precondition::MatchRevision(stored.rev),
                Err(err) => return note_failure(ledger, max, &doc.id, &err),
            },
            Err(err) => return note_failure(ledger, max, &doc.id, &err),
        }
    }
    let err = Error::conflict(format!("kept changing at the target; gave up after {OVERWRITE_ATTEMPTS} overwrites"));
    note_failure(ledger, max, &doc.id, &err);
}

/// A dry run's "write": what would become of each document, from what the target holds now.
pub async fn dry_run_against_backend(
    target: &dyn DocumentBackend,
    docs: Vec<Outgoing>,
    max_issues: usize,
) -> Result<Ledger> {
    let mut ledger = Ledger::default();
    let ids: Vec<String> = docs.iter().map(|doc| doc.id.clone()).collect();
    let stored = target.get_many(&ids).await.map_err(|e| target_error("read documents for the dry run", e))?;
    for (doc, stored) in docs.iter().zip(stored) {
        match stored {
            None => ledger.counts.would_write += 1,
            Some(stored) if same_content(doc, &stored) => ledger.counts.already_present += 1,
            Some(_) => {
                ledger.counts.would_conflict += 1;
                ledger.note(max_issues, &doc.id, "conflict", "exists at the target with different content");
            }
        }
    }
    Ok(ledger)
}

/// An NDJSON file being written, one document per line.
pub struct FileSink {
    path: PathBuf,
    file: Option<File>,
    bytes: u64,
}

impl FileSink {
    /// Starts a new file. An existing non-empty file is refused unless `replace` is set, so an
    /// export never overwrites a file it did not write.
    pub fn create(path: &Path, replace: bool) -> Result<Self> {
        let existing = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        if existing > 0 && !replace {
            return Err(Error::invalid(
                "out",
                format!("{} exists and is not empty; remove it, or pass --restart to replace it", path.display()),
            ));
        }
        let file = File::create(path).map_err(|e| io_error(path, "create", e))?;
        Ok(FileSink { path: path.to_path_buf(), file: Some(file), bytes: 0 })
    }

    /// Continues a file this migration was writing: lines after `bytes` (written by a run that
    /// was killed before its checkpoint) are cut off.
    pub fn resume(path: &Path, bytes: u64) -> Result<Self> {
        let file = OpenOptions::new().write(true).open(path).map_err(|e| io_error(path, "open", e))?;
        let length = file.metadata().map_err(|e| io_error(path, "stat", e))?.len();
        if length < bytes {
            return Err(Error::invalid(
                "checkpoint",
                format!("says {} holds {bytes} bytes, but it has {length}; it was changed since", path.display()),
            ));
        }
        file.set_len(bytes).map_err(|e| io_error(path, "truncate", e))?;
        let mut sink = FileSink { path: path.to_path_buf(), file: Some(file), bytes };
        sink.seek_to_end()?;
        Ok(sink)
    }

    fn seek_to_end(&mut self) -> Result<()> {
        use std::io::Seek;
        if let Some(file) = &mut self.file {
            file.seek(std::io::SeekFrom::Start(self.bytes)).map_err(|e| io_error(&self.path, "seek in", e))?;
        }
        Ok(())
    }

    /// Appends the documents and makes them durable; returns the file's new length.
    pub async fn append(&mut self, docs: &[Outgoing]) -> Result<u64> {
        let mut lines = Vec::new();
        for doc in docs {
            let stored = StoredDocument { id: doc.id.clone(), rev: doc.source_rev.clone(), body: doc.body.clone() };
            serde_json::to_writer(&mut lines, &stored.to_json())
                .map_err(|e| Error::new(ErrorKind::Internal, format!("encode document {:?}", doc.id)).with_source(e))?;
            lines.push(b'\n');
        }
        let mut file = self
            .file
            .take()
            .ok_or_else(|| Error::new(ErrorKind::Internal, "NDJSON output lost after a failed write"))?;
        let path = self.path.clone();
        let (file, written) = tokio::task::spawn_blocking(move || {
            let written = file
                .write_all(&lines)
                .and_then(|()| file.sync_data())
                .map(|()| lines.len() as u64)
                .map_err(|e| io_error(&path, "write", e));
            (file, written)
        })
        .await
        .map_err(|e| Error::new(ErrorKind::Internal, "NDJSON writer task failed").with_source(e))?;
        self.file = Some(file);
        self.bytes += written?;
        Ok(self.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn doc(id: &str, filler: usize) -> Outgoing {
        let body = json!({ "value": "x".repeat(filler) }).as_object().cloned().unwrap_or_default();
        Outgoing::new(id.into(), Revision(String::new()), body)
    }

    /// A copy run killed after recording a document's state but before writing it; the source then
    /// deletes the document and writes it again. The next run finds the target without it: that is
    /// the migration's doing, not a conflict.
    #[tokio::test]
    async fn a_copy_write_cut_short_before_it_landed_leaves_an_absence_that_is_the_migrations() {
        let dir = tempfile::tempdir().expect("temp dir");
        let target = crate::backend::embedded::EmbeddedBackend::open(&dir.path().join("t.redb")).await.expect("open");
        let journal = Journal::open(&dir.path().join("j")).expect("journal");
        let body = |value: Value| json!({ "userId": "u", "namespace": "ns", "key": "k", "value": value });
        let first =
            Outgoing::new("a".into(), Revision("1-x".into()), body(json!(1)).as_object().cloned().unwrap_or_default());
        record_intents(&journal, &[first]).await.expect("record");
        let again =
            Outgoing::new("a".into(), Revision("3-x".into()), body(json!(3)).as_object().cloned().unwrap_or_default());
        let wanted = vec![Wanted { id: "a".into(), state: Some(again) }];
        let ledger =
            super::super::follow::apply(&target, &journal, wanted, ConflictPolicy::Fail, 5).await.expect("apply");
        assert_eq!((ledger.counts.written, ledger.counts.conflicts), (1, 0), "{ledger:?}");
        assert_eq!(target.get("a").await.expect("get").expect("a").body["value"], 3);
    }

    #[test]
    fn bulk_requests_are_split_by_size() {
        let docs = vec![doc("a", 40), doc("b", 40), doc("c", 200), doc("d", 10)];
        let sizes: Vec<Vec<String>> =
            chunks_by_size(docs, 120).into_iter().map(|chunk| chunk.into_iter().map(|d| d.id).collect()).collect();
        assert_eq!(sizes, [vec!["a", "b"], vec!["c"], vec!["d"]]);
    }
}
