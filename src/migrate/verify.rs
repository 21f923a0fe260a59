//! `verify`: compares two backends document by document, by id and canonical content hash, with
//! memory bounded like a migration's.
//!
//! Pass 1 scans the source, applies the migration's [`transform`](super::transform) rules (so a
//! normalised timestamp is not a difference; `raw` compares bodies untransformed), and looks each
//! batch up at the target: absent is *missing*, another hash is *different*. The target's
//! documents are counted too: by the backend's exact count when it keeps one (no scan), else by a
//! scan of its data-store documents within the filter alongside pass 1. When they are exactly the
//! ones pass 1 found there, nothing is extra. Only when the count says otherwise does pass 2 scan
//! the target again and look its ids up at the source: absent there is *extra*.
//! Documents the migration would not copy (foreign, malformed, outside the filter) are counted,
//! not compared.
//!
//! [`verify_migration`], the read-back that ends every `migrate` unless `--no-verify`, is pass 1
//! alone, judged against the migration's own counts.

use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::canonical::content_hash;
use super::progress::{Progress, ProgressMode, Snapshot};
use super::report::{peak_rss_bytes, Ledger};
use super::run_record::RunRecord;
use super::sink::Outgoing;
use super::source::{Incoming, Position, Source};
use super::transform::AccessTracking;
use super::{classify, read_batches, side_error, Endpoint, Filter, Options, CHANNEL_BATCHES};
use crate::backend::DocumentBackend;
use crate::error::{Error, ErrorKind, Result};
use crate::model::DocumentId;

/// How `verify` runs.
#[derive(Debug, Clone)]
pub struct VerifyOptions {
    pub batch_size: usize,
    pub concurrency: usize,
    /// Must match the migration's, since `reset` changes what the target should hold.
    pub access_tracking: AccessTracking,
    pub filter: Filter,
    /// Compare source bodies as stored, without the migration's repairs and normalisation.
    pub raw: bool,
    /// Ids listed per kind of difference.
    pub max_ids: usize,
    pub progress: ProgressMode,
    /// Keep the comparison's progress record in the target (the `verify` command's: a local
    /// document, [`super::run_record`]), as a `migrate` run keeps its own.
    pub record: bool,
}

impl Default for VerifyOptions {
    fn default() -> Self {
        VerifyOptions {
            batch_size: super::DEFAULT_BATCH_SIZE,
            concurrency: super::DEFAULT_CONCURRENCY,
            access_tracking: AccessTracking::default(),
            filter: Filter::default(),
            raw: false,
            max_ids: 20,
            progress: ProgressMode::None,
            record: false,
        }
    }
}

/// The outcome of `verify`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct VerifyReport {
    pub from: String,
    pub to: String,
    /// No missing, extra or different documents.
    pub identical: bool,
    pub message: String,
    /// Source documents compared.
    pub compared: u64,
    /// Of those, present at the target with the same content.
    pub matching: u64,
    pub missing: u64,
    pub different: u64,
    pub extra: u64,
    /// The first `max_ids` ids of each kind.
    pub missing_ids: Vec<String>,
    pub different_ids: Vec<String>,
    pub extra_ids: Vec<String>,
    /// Source documents not compared because a migration does not copy them.
    pub source_foreign: u64,
    pub source_malformed: u64,
    pub filtered_out: u64,
    /// Target documents read in pass 2, and those of them that are not data-store documents.
    pub target_read: u64,
    pub target_foreign: u64,
    pub raw: bool,
    pub duration_secs: f64,
    pub peak_rss_bytes: Option<u64>,
}

impl VerifyReport {
    /// 0 when identical, [`super::EXIT_DIFFERENT`] otherwise.
    pub fn exit_code(&self) -> u8 {
        if self.identical {
            0
        } else {
            super::EXIT_DIFFERENT
        }
    }

    fn list(ids: &mut Vec<String>, max: usize, id: &str) {
        if ids.len() < max {
            ids.push(id.to_owned());
        }
    }
}

/// What pass 1 expects at the target for one source batch.
struct Expected {
    docs: Vec<Outgoing>,
    ledger: Ledger,
}

fn backend_of<'a>(side: &str, endpoint: &'a Endpoint) -> Result<&'a Arc<dyn DocumentBackend>> {
    match endpoint {
        Endpoint::Backend { backend, .. } => Ok(backend),
        Endpoint::File(path) => Err(Error::invalid(
            side,
            format!("verify compares two backends; {} is a file (import it first)", path.display()),
        )),
    }
}

/// Source documents as the untransformed comparison sees them.
fn expect_raw(items: Vec<Incoming>, filter: &Filter) -> Expected {
    let mut ledger = Ledger::default();
    let mut docs = Vec::new();
    for item in items {
        ledger.counts.read += 1;
        let Incoming::Document(doc) = item else {
            ledger.counts.unreadable += 1;
            continue;
        };
        match DocumentId::parse(&doc.id) {
            Err(_) => ledger.counts.foreign += 1,
            Ok(id) if !filter.admits(&id) => ledger.counts.filtered_out += 1,
            Ok(_) => docs.push(Outgoing::new(doc.id, doc.rev, doc.body)),
        }
    }
    Expected { docs, ledger }
}

/// Compares the source with the target.
pub async fn verify(source: &Endpoint, target: &Endpoint, options: &VerifyOptions) -> Result<VerifyReport> {
    let source_backend = backend_of("from", source)?;
    let target_backend = backend_of("to", target)?;
    let mut progress = progress_for(source_backend.as_ref(), options).await;
    if options.record {
        let total = match progress.total() {
            Some(total) => Some(total),
            None => source_backend.approximate_count().await.ok().flatten(),
        };
        let record =
            RunRecord::new(Arc::clone(target_backend), "verify", &source.name(), &target.name()).with_counts(0, total);
        progress.keep_record(record);
        // Written at once, so a comparison shorter than the record's interval still has one.
        progress.update(Snapshot::default());
    }
    let outcome = compare(source, target, options, &mut progress).await;
    if let Some(mut record) = progress.take_record() {
        let (state, error) = match &outcome {
            Ok(_) => ("finished", None),
            Err(err) => ("failed", Some(err.to_string())),
        };
        record.close(state, progress.last_counts(), error.as_deref()).await;
    }
    outcome
}

/// [`verify`]'s comparison, its progress shown (and recorded) by `progress`.
async fn compare(
    source: &Endpoint,
    target: &Endpoint,
    options: &VerifyOptions,
    progress: &mut Progress,
) -> Result<VerifyReport> {
    let started = Instant::now();
    let mut report = VerifyReport { from: source.name(), to: target.name(), raw: options.raw, ..Default::default() };
    let exact_total = target_document_count(target).await?;
    let census = if let Some(total) = exact_total {
        // The target counts its documents exactly without reading them (once, before pass 1:
        // verify compares quiet stores). When the count equals what pass 1 found there, nothing
        // else is at the target (no scan); otherwise the target is scanned and counted as below,
        // to tell foreign from extra.
        find_missing_and_different(source, target, options, &mut report, progress).await?;
        if total == report.matching + report.different {
            TargetCensus { read: total, foreign: 0, admitted: total }
        } else {
            count_target(target, options).await?
        }
    } else {
        // Pass 1 and a scan counting the target run at once; the slower one sets the time.
        let (_, census) = tokio::try_join!(
            find_missing_and_different(source, target, options, &mut report, progress),
            count_target(target, options),
        )?;
        census
    };
    report.target_read = census.read;
    report.target_foreign = census.foreign;
    // The documents pass 1 found at the target (matching + different) are distinct target ids
    // within the filter; when the target holds no more than those, none is extra, and the source
    // need not be read again. Otherwise pass 2 looks every target id up at the source.
    let present = report.matching + report.different;
    if census.admitted != present {
        let extra = find_extra(source, target, options).await?;
        report.extra = extra.extra;
        report.extra_ids = extra.extra_ids;
    }

    report.identical = report.missing == 0 && report.different == 0 && report.extra == 0;
    report.message = if report.identical {
        format!("identical: {} documents match", report.matching)
    } else {
        format!("{} missing, {} different, {} extra", report.missing, report.different, report.extra)
    };
    report.duration_secs = started.elapsed().as_secs_f64();
    report.peak_rss_bytes = peak_rss_bytes();
    progress.finish(snapshot(&report));
    Ok(report)
}

/// The target's documents that a scan returns, counted exactly without reading them, when the
/// backend can: its exact count less its design documents (CouchDB's, which the count includes
/// and no scan returns; counted, they would always look like extra documents and send `verify`
/// scanning the whole target again).
async fn target_document_count(target: &Endpoint) -> Result<Option<u64>> {
    let backend = backend_of("to", target)?;
    let Some(total) = backend.exact_count().await.map_err(|e| side_error("target", target, e))? else {
        return Ok(None);
    };
    let design = backend.design_document_count().await.map_err(|e| side_error("target", target, e))?;
    Ok(Some(total.saturating_sub(design.unwrap_or(0))))
}

/// The progress display of a comparison, its total the source's own estimate.
async fn progress_for(source: &dyn DocumentBackend, options: &VerifyOptions) -> Progress {
    let total = match options.progress {
        ProgressMode::None => None,
        _ => source.approximate_count().await.ok().flatten(),
    };
    Progress::new(options.progress, "verify", 0, total)
}

fn snapshot(report: &VerifyReport) -> Snapshot {
    Snapshot { read: report.compared, landed: report.matching, skipped: report.missing }
}

/// Pass 1: every source document the migration copies must be at the target, unchanged. The
/// source is scanned in batches and each batch looked up at the target with one `get_many`,
/// `concurrency` batches at once; memory holds only the batches in flight.
async fn find_missing_and_different(
    source: &Endpoint,
    target: &Endpoint,
    options: &VerifyOptions,
    report: &mut VerifyReport,
    progress: &mut Progress,
) -> Result<()> {
    let source_backend = backend_of("from", source)?;
    let target_backend = backend_of("to", target)?;
    let max = options.max_ids;
    let (sender, mut receiver) = mpsc::channel(CHANNEL_BATCHES);
    let migration_options = Options {
        access_tracking: options.access_tracking,
        filter: options.filter.clone(),
        max_issues: 0,
        ..Options::default()
    };
    let raw = options.raw;
    let filter = options.filter.clone();
    let reader = tokio::spawn(read_batches(
        "source",
        Source::backend(Arc::clone(source_backend), &Position::Start)?,
        options.batch_size.max(1),
        move |items, _| {
            if raw {
                expect_raw(items, &filter)
            } else {
                let (docs, ledger) = classify(items, &migration_options);
                Expected { docs, ledger }
            }
        },
        sender,
    ));
    let target_for_lookups = Arc::clone(target_backend);
    let mut compared = futures::stream::poll_fn(move |cx| receiver.poll_recv(cx))
        .map(|expected: Result<Expected>| {
            let lookups = Arc::clone(&target_for_lookups);
            async move {
                let expected = expected?;
                let ids: Vec<String> = expected.docs.iter().map(|doc| doc.id.clone()).collect();
                let found = lookups.get_many(&ids).await.map_err(|e| side_error("target", target, e))?;
                Ok::<_, Error>((expected, found))
            }
        })
        .buffered(options.concurrency.max(1));
    while let Some(result) = compared.next().await {
        let (expected, found) = match result {
            Ok(pair) => pair,
            Err(err) => {
                reader.abort();
                return Err(err);
            }
        };
        let counts = &expected.ledger.counts;
        report.source_foreign += counts.foreign;
        report.source_malformed += counts.malformed + counts.unreadable;
        report.filtered_out += counts.filtered_out;
        for (doc, stored) in expected.docs.iter().zip(found) {
            report.compared += 1;
            match stored {
                None => {
                    report.missing += 1;
                    VerifyReport::list(&mut report.missing_ids, max, &doc.id);
                }
                Some(stored) if content_hash(&stored.id, &stored.body) == doc.hash => report.matching += 1,
                Some(_) => {
                    report.different += 1;
                    VerifyReport::list(&mut report.different_ids, max, &doc.id);
                }
            }
        }
        progress.update(snapshot(report));
    }
    reader.await.map_err(|e| Error::new(ErrorKind::Internal, "source reader task failed").with_source(e))
}

/// The target's documents as pass 2 would sort them.
#[derive(Default)]
struct TargetCensus {
    read: u64,
    /// Not data-store documents (no composite id).
    foreign: u64,
    /// Data-store documents within the filter.
    admitted: u64,
}

/// Scans the target and counts its documents, looking nothing up.
async fn count_target(target: &Endpoint, options: &VerifyOptions) -> Result<TargetCensus> {
    let mut scan = Source::backend(Arc::clone(backend_of("to", target)?), &Position::Start)?;
    let mut census = TargetCensus::default();
    while let Some(page) =
        scan.next_page(options.batch_size.max(1)).await.map_err(|e| side_error("target", target, e))?
    {
        for item in page.items {
            let Incoming::Document(doc) = item else { continue };
            census.read += 1;
            match DocumentId::parse(&doc.id) {
                Err(_) => census.foreign += 1,
                Ok(id) if options.filter.admits(&id) => census.admitted += 1,
                Ok(_) => {}
            }
        }
    }
    Ok(census)
}

/// What pass 2 found.
#[derive(Default)]
struct Extra {
    extra: u64,
    extra_ids: Vec<String>,
}

/// Pass 2, when the counts leave room for extra documents: every target document (within the
/// filter) must exist at the source. Pipelined like pass 1: a reader task scans the target while
/// `concurrency` pages of ids are looked up at the source with `get_many`.
async fn find_extra(source: &Endpoint, target: &Endpoint, options: &VerifyOptions) -> Result<Extra> {
    let source_backend = Arc::clone(backend_of("from", source)?);
    let target_backend = backend_of("to", target)?;
    let filter = options.filter.clone();
    let (sender, mut receiver) = mpsc::channel(CHANNEL_BATCHES);
    let reader = tokio::spawn(read_batches(
        "target",
        Source::backend(Arc::clone(target_backend), &Position::Start)?,
        options.batch_size.max(1),
        move |items, _| {
            let documents = items.into_iter().filter_map(|item| match item {
                Incoming::Document(doc) => Some(doc.id),
                Incoming::Unreadable { .. } => None,
            });
            documents.filter(|id| DocumentId::parse(id).is_ok_and(|id| filter.admits(&id))).collect::<Vec<_>>()
        },
        sender,
    ));
    let mut looked_up = futures::stream::poll_fn(move |cx| receiver.poll_recv(cx))
        .map(|ids: Result<Vec<String>>| {
            let lookups = Arc::clone(&source_backend);
            async move {
                let ids = ids?;
                let found = lookups.get_many(&ids).await.map_err(|e| side_error("source", source, e))?;
                Ok::<_, Error>((ids, found))
            }
        })
        .buffered(options.concurrency.max(1));
    let mut extra = Extra::default();
    while let Some(result) = looked_up.next().await {
        let (ids, at_source) = match result {
            Ok(pair) => pair,
            Err(err) => {
                reader.abort();
                return Err(err);
            }
        };
        for (id, doc) in ids.iter().zip(at_source) {
            if doc.is_none() {
                extra.extra += 1;
                VerifyReport::list(&mut extra.extra_ids, options.max_ids, id);
            }
        }
    }
    reader.await.map_err(|e| Error::new(ErrorKind::Internal, "target reader task failed").with_source(e))?;
    Ok(extra)
}

/// How a migration's own read-back went (the `verification` section of its report).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Verification {
    /// Every difference found is one the report already lists (see [`verify_migration`]).
    pub passed: bool,
    pub message: String,
    /// Source documents the migration is responsible for, looked up at the target.
    pub compared: u64,
    /// Of those, at the target with the same canonical hash.
    pub matching: u64,
    pub missing: u64,
    pub different: u64,
    /// The first `--max-issues` ids of each kind.
    pub missing_ids: Vec<String>,
    pub different_ids: Vec<String>,
    /// Differences the migration's counts already explain: documents the target refused
    /// (`refused`, `failed`) and conflicts left alone by `--on-conflict skip`
    /// (`conflicts_skipped`).
    pub explained: u64,
    pub duration_secs: f64,
    pub docs_per_sec: f64,
}

/// The read-back that ends a migration: pass 1 of [`verify`] with the migration's filters and
/// rules, i.e. every source document the migration is responsible for (the parts written by
/// earlier, interrupted runs too) is looked up at the target in batches and compared by
/// canonical hash. Target documents the migration did not write are not its business, so there is
/// no pass 2. A document the target refused, or a conflict skipped by choice, is missing or
/// different by design and already counted in `ledger`; the verification passes when
/// missing + different is no more than those counts, i.e. when nothing differs that the report
/// does not already name.
pub async fn verify_migration(
    source: &Endpoint,
    target: &Endpoint,
    options: &VerifyOptions,
    ledger: &Ledger,
) -> Result<Verification> {
    let started = Instant::now();
    let mut report = VerifyReport::default();
    let mut progress = progress_for(backend_of("from", source)?.as_ref(), options).await;
    find_missing_and_different(source, target, options, &mut report, &mut progress).await?;
    progress.finish(snapshot(&report));
    let explained = ledger.counts.refused + ledger.counts.failed + ledger.counts.conflicts_skipped;
    let found = report.missing + report.different;
    let passed = found <= explained;
    let message = match (found, passed) {
        (0, _) => format!("verified: all {} documents read back identical", report.matching),
        (_, true) => format!(
            "verified: {} documents read back identical; the {found} that differ are those the report lists as refused, failed or skipped",
            report.matching
        ),
        (_, false) => format!(
            "NOT verified: {} missing and {} different at the target, of which the report explains only {explained}",
            report.missing, report.different
        ),
    };
    let duration_secs = started.elapsed().as_secs_f64();
    Ok(Verification {
        passed,
        message,
        compared: report.compared,
        matching: report.matching,
        missing: report.missing,
        different: report.different,
        missing_ids: report.missing_ids,
        different_ids: report.different_ids,
        explained,
        duration_secs,
        docs_per_sec: report.compared as f64 / duration_secs.max(1e-9),
    })
}
