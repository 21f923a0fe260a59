//! Migration: copying a data store from one backend (or NDJSON file) to another, resumably, and
//! checking the result. `agentstore migrate`, `export`, `import` and `verify` are built on this.
//!
//! One pipeline serves `migrate` (backend → backend), `export` (backend → NDJSON) and `import`
//! (NDJSON → backend):
//!
//! 1. A reader task takes pages of `batch_size` documents from the [`source::Source`] (a
//!    backend's stable full scan, or NDJSON lines), applies the [`transform`] rules to each
//!    (foreign documents counted and left out, malformed ones reported, repairs and timestamp
//!    normalisation applied), and sends the batch into a channel of [`CHANNEL_BATCHES`] batches.
//! 2. Up to `concurrency` batches are written at once ([`sink`]), completed in order.
//! 3. After each batch is completely written, in order, the [`checkpoint`] records the source
//!    position after it and the counts so far. A run killed at any moment resumes from the last
//!    checkpoint; the batches written after it are written again, and the target's create-only
//!    precondition plus a content-hash comparison turn those into `already_present`, so nothing
//!    is missing and nothing is duplicated.
//!
//! Memory is bounded by the documents in flight: at most `CHANNEL_BATCHES` batches waiting, one
//! being read, and `concurrency` being written (each held twice while its bulk request is built),
//! i.e. (2 + 2 × concurrency + 1) × `batch_size` documents, whatever the size of the data set.
//! With the defaults (500, 4) that is 5,500 documents.
//!
//! [`verify`] compares two backends document by document with the same rules.
//!
//! [`databases`] moves every other database (revision trees, attachments, settings) between
//! backends and CouchDB-protocol servers: `migrate --all-databases`.

pub mod canonical;
pub mod census;
pub mod checkpoint;
pub mod command;
pub mod deployment;
pub mod follow;
pub mod journal;
pub mod progress;
pub mod report;
pub mod run_record;
pub mod sink;
pub mod source;
pub mod transform;
pub mod verify;

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::StreamExt;
use tokio::sync::mpsc;

use crate::backend::DocumentBackend;
use crate::error::{Error, ErrorKind, Result};
use crate::model::DocumentId;
use checkpoint::{Checkpoint, Identity};
pub use follow::FollowMode;
use follow::{FollowEnd, FollowState, Follower, Lag, StopFlag, StopSignal};
use journal::Journal;
use progress::{Progress, ProgressMode, Snapshot};
use report::{FollowReport, Ledger, Report, Status};
use run_record::RunRecord;
use sink::{ConflictPolicy, FileSink, Outgoing};
use source::{Incoming, Position, Source};
use transform::{AccessTracking, Verdict};

/// Exit status of `verify` when the two sides differ, and of `migrate` when its read-back finds a
/// difference its report does not explain.
pub const EXIT_DIFFERENT: u8 = 6;
/// Exit status of a migration that finished but left data-store documents behind (malformed,
/// refused by the target, unreadable lines).
pub const EXIT_INCOMPLETE: u8 = 7;
/// Exit status of a migration whose copy SIGINT/SIGTERM stopped (the same command resumes it).
pub const EXIT_INTERRUPTED: u8 = 8;

pub const DEFAULT_BATCH_SIZE: usize = 500;
pub const DEFAULT_CONCURRENCY: usize = 4;
/// Read batches waiting for a writer.
pub const CHANNEL_BATCHES: usize = 2;
/// Namespaces the "already indexed at the target" cache holds before it starts over (ensuring is
/// idempotent, so forgetting costs a call, never correctness).
const ENSURED_NAMESPACES_CAP: usize = 100_000;

/// One side of a migration.
#[derive(Clone)]
pub enum Endpoint {
    /// A backend, and the name it goes by in reports and checkpoints (a redacted URL).
    Backend { backend: Arc<dyn DocumentBackend>, name: String },
    /// An NDJSON file, one document per line in the spec's shape.
    File(PathBuf),
}

impl Endpoint {
    /// A backend named by its own description.
    pub fn backend(backend: Arc<dyn DocumentBackend>) -> Self {
        let name = backend.describe();
        Endpoint::Backend { backend, name }
    }

    pub fn name(&self) -> String {
        match self {
            Endpoint::Backend { name, .. } => name.clone(),
            Endpoint::File(path) => {
                format!("file:{}", std::path::absolute(path).unwrap_or_else(|_| path.clone()).display())
            }
        }
    }
}

/// Which command runs the pipeline (it names the checkpoint and the report).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobKind {
    Migrate,
    Export,
    Import,
}

impl JobKind {
    pub fn as_str(self) -> &'static str {
        match self {
            JobKind::Migrate => "migrate",
            JobKind::Export => "export",
            JobKind::Import => "import",
        }
    }
}

/// Which documents to copy: those of the listed users (all when empty) in the listed namespaces
/// (all when empty), going by the parts of the `_id`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    pub users: Vec<String>,
    pub namespaces: Vec<String>,
}

impl Filter {
    pub fn admits(&self, id: &DocumentId) -> bool {
        (self.users.is_empty() || self.users.iter().any(|u| u == id.user_id()))
            && (self.namespaces.is_empty() || self.namespaces.iter().any(|n| n == id.namespace()))
    }
}

/// How a migration runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// Documents per source page and per bulk write.
    pub batch_size: usize,
    /// Batches written at once.
    pub concurrency: usize,
    pub on_conflict: ConflictPolicy,
    pub access_tracking: AccessTracking,
    pub filter: Filter,
    /// Read, check and report; write nothing (no checkpoint either).
    pub dry_run: bool,
    /// The checkpoint file; default [`Identity::default_path`].
    pub checkpoint: Option<PathBuf>,
    /// Start over, ignoring (and replacing) an existing checkpoint.
    pub restart: bool,
    pub progress: ProgressMode,
    /// Documents named per issue kind in the report.
    pub max_issues: usize,
    /// End a finished `migrate` by reading back what it is responsible for
    /// ([`verify::verify_migration`]). Not used by `export` and `import`.
    pub verify: bool,
    /// Whether to follow the source's changes after the copy (`migrate --follow`).
    pub follow: FollowMode,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            batch_size: DEFAULT_BATCH_SIZE,
            concurrency: DEFAULT_CONCURRENCY,
            on_conflict: ConflictPolicy::default(),
            access_tracking: AccessTracking::default(),
            filter: Filter::default(),
            dry_run: false,
            checkpoint: None,
            restart: false,
            progress: ProgressMode::None,
            max_issues: 20,
            verify: true,
            follow: FollowMode::Off,
        }
    }
}

/// A migration to run.
pub struct Job {
    pub kind: JobKind,
    pub source: Endpoint,
    pub target: Endpoint,
    pub options: Options,
}

impl Job {
    pub fn identity(&self) -> Identity {
        Identity {
            command: self.kind.as_str().to_owned(),
            from: self.source.name(),
            to: self.target.name(),
            users: self.options.filter.users.clone(),
            namespaces: self.options.filter.namespaces.clone(),
            access_tracking: self.options.access_tracking,
        }
    }

    /// Where the checkpoint of this job is kept.
    pub fn checkpoint_path(&self) -> PathBuf {
        self.options.checkpoint.clone().unwrap_or_else(|| self.identity().default_path())
    }
}

/// The most documents a migration holds in memory at once (see the module documentation).
pub fn memory_bound_documents(batch_size: usize, concurrency: usize) -> usize {
    (CHANNEL_BATCHES + 2 * concurrency + 1) * batch_size
}

/// One read batch, already transformed.
struct ReadBatch {
    docs: Vec<Outgoing>,
    /// What reading and transforming found (reads, foreign, malformed, repairs, …).
    ledger: Ledger,
    /// Where the source continues after this batch.
    position: Position,
}

/// Sorts one page's items into documents to write and what the report says of the rest.
fn classify(items: Vec<Incoming>, options: &Options) -> (Vec<Outgoing>, Ledger) {
    let max = options.max_issues;
    let mut ledger = Ledger::default();
    let mut docs = Vec::with_capacity(items.len());
    for item in items {
        ledger.counts.read += 1;
        let doc = match item {
            Incoming::Document(doc) => doc,
            Incoming::Unreadable { location, reason } => {
                ledger.counts.unreadable += 1;
                ledger.note(max, &location, "unreadable", reason);
                continue;
            }
        };
        if let Ok(id) = DocumentId::parse(&doc.id) {
            if !options.filter.admits(&id) {
                ledger.counts.filtered_out += 1;
                continue;
            }
        }
        match transform::prepare(&doc.id, doc.body, options.access_tracking) {
            Verdict::Foreign(kind) => {
                ledger.counts.foreign += 1;
                Ledger::tally(&mut ledger.foreign_by_kind, kind.as_str());
                ledger.note(max, &doc.id, "foreign", kind.as_str());
            }
            Verdict::Malformed(reason) => {
                ledger.counts.malformed += 1;
                ledger.note(max, &doc.id, "malformed", reason);
            }
            Verdict::Copy(prepared) => {
                if !prepared.repairs.is_empty() {
                    ledger.counts.repaired += 1;
                    ledger.note(max, &doc.id, "repaired", join_details(&prepared.repairs));
                }
                if !prepared.warnings.is_empty() {
                    ledger.counts.warned += 1;
                    ledger.note(max, &doc.id, "warning", join_details(&prepared.warnings));
                }
                for note in &prepared.repairs {
                    Ledger::tally(&mut ledger.repairs_by_rule, note.rule);
                }
                for note in &prepared.warnings {
                    Ledger::tally(&mut ledger.warnings_by_rule, note.rule);
                }
                docs.push(Outgoing::new(doc.id, doc.rev, prepared.body));
            }
        }
    }
    (docs, ledger)
}

fn join_details(notes: &[transform::Note]) -> String {
    notes.iter().map(|n| format!("{}: {}", n.rule, n.detail)).collect::<Vec<_>>().join("; ")
}

/// The reader task: pages from the source, transformed, into the channel, until the source ends,
/// an error (sent on, then the task stops), or the writer hangs up.
pub(crate) async fn read_batches<T: Send + 'static>(
    side: &'static str,
    mut source: Source,
    batch_size: usize,
    prepare: impl Fn(Vec<Incoming>, Position) -> T + Send + 'static,
    sender: mpsc::Sender<Result<T>>,
) {
    loop {
        let page = match source.next_page(batch_size).await {
            Ok(Some(page)) => page,
            Ok(None) => return,
            Err(err) => {
                let _ = sender.send(Err(Error::new(err.kind(), format!("{side}: read failed")).with_source(err))).await;
                return;
            }
        };
        if sender.send(Ok(prepare(page.items, page.position))).await.is_err() {
            return;
        }
    }
}

/// Opens a source at a position.
pub(crate) fn open_source(endpoint: &Endpoint, position: &Position) -> Result<Source> {
    match endpoint {
        Endpoint::Backend { backend, .. } => Source::backend(Arc::clone(backend), position),
        Endpoint::File(path) => Source::file(path, position),
    }
}

/// Runs a migration (or export, or import) to the end, resuming from its checkpoint. A
/// [`FollowMode::Forever`] migration runs until the process ends; use [`run_until`] to stop it.
pub async fn run(job: Job) -> Result<Report> {
    run_until(job, Box::pin(std::future::pending())).await
}

/// [`run`], stopping cleanly after the current batch (or page of changes) when `stop` resolves.
pub async fn run_until(job: Job, stop: StopSignal) -> Result<Report> {
    let started = Instant::now();
    let identity = job.identity();
    let path = job.checkpoint_path();
    let Job { kind, source, target, mut options } = job;
    options.batch_size = options.batch_size.max(1);
    options.concurrency = options.concurrency.max(1);
    let mut stop = StopFlag::new(stop);
    check_follow(kind, &source, &options)?;

    let (mut checkpoint, resumed) = match open_checkpoint(&path, &identity, &source, &options).await? {
        Opened::AlreadyFinished(saved) => {
            let report = finished_report(kind, &identity, &path, &options, saved, started, Status::AlreadyFinished, 0);
            // Read back again, so a migration whose read-back failed keeps saying so.
            return with_read_back(report, kind, &source, &target, &options).await;
        }
        Opened::Ready { checkpoint, resumed } => (checkpoint, resumed),
    };
    let journal = match &checkpoint.follow {
        Some(_) => Some(Journal::open(&journal::path_for(&path))?),
        None => None,
    };
    let read_before = checkpoint.ledger.counts.read;
    let mut progress = start_progress(kind, &source, &options, &checkpoint, &path, resumed).await;
    if let (Endpoint::Backend { backend, .. }, false) = (&target, options.dry_run) {
        let record = RunRecord::new(Arc::clone(backend), kind.as_str(), &source.name(), &target.name())
            .with_counts(read_before, progress.total());
        progress.keep_record(record);
    }

    // The rest in a block, so that however it ends (a report or an error), the run's record in
    // the target says so ([`run_record`]).
    let outcome: Result<Report> = async {
        if !checkpoint.finished {
            let copy = CopyPhase {
                source: &source,
                target: &target,
                options: &options,
                path: &path,
                journal: journal.as_ref(),
            };
            if copy.run(&mut checkpoint, started, &mut progress, &mut stop).await? == CopyEnd::Interrupted {
                let read_this_run = checkpoint.ledger.counts.read - read_before;
                let mut report = finished_report(
                    kind,
                    &identity,
                    &path,
                    &options,
                    checkpoint,
                    started,
                    Status::Interrupted,
                    read_this_run,
                );
                report.resumed = resumed;
                return Ok(report);
            }
            progress.finish(snapshot(&checkpoint.ledger));
        }
        let read_this_run = checkpoint.ledger.counts.read - read_before;

        let mut status = if options.dry_run { Status::DryRun } else { Status::Finished };
        let mut lag = Lag::default();
        if let (
            Some(journal),
            Endpoint::Backend { backend: source_backend, .. },
            Endpoint::Backend { backend: target_backend, .. },
        ) = (&journal, &source, &target)
        {
            if options.follow != FollowMode::Off {
                let follower = Follower {
                    source: Arc::clone(source_backend),
                    target: Arc::clone(target_backend),
                    journal,
                    options: &options,
                    mode: options.follow,
                    checkpoint: &path,
                    ensured: Mutex::default(),
                };
                status = follow_phase(&follower, &mut checkpoint, &path, started, &mut progress, &mut stop, &mut lag)
                    .await?;
            }
        }
        let delay_ms = match &source {
            Endpoint::Backend { backend, .. } => {
                u64::try_from(backend.change_feed_delay().as_millis()).unwrap_or(u64::MAX)
            }
            Endpoint::File(_) => 0,
        };
        let follow_report = checkpoint.follow.as_ref().map(|state| FollowReport {
            since_recorded_at: state.recorded_at.clone(),
            position: state.position.clone(),
            ledger: state.ledger.clone(),
            lag_changes: lag.changes,
            lag_seconds: lag.seconds,
            change_feed_delay_ms: delay_ms,
        });
        let mut report = finished_report(kind, &identity, &path, &options, checkpoint, started, status, read_this_run);
        report.resumed = resumed;
        report.follow = follow_report;
        if status == Status::Stopped {
            // The source may still be changing: a read-back now would report its latest changes as
            // differences. `verify` after the cutover compares the quiet stores.
            return Ok(report);
        }
        with_read_back(report, kind, &source, &target, &options).await
    }
    .await;
    if let Some(mut record) = progress.take_record() {
        let counts = progress.last_counts();
        match &outcome {
            Ok(report) => record.close(report.status.record_state(), counts, None).await,
            Err(err) => record.close("failed", counts, Some(&err.to_string())).await,
        }
    }
    outcome
}

/// Refuses `--follow` where it cannot work.
fn check_follow(kind: JobKind, source: &Endpoint, options: &Options) -> Result<()> {
    if options.follow == FollowMode::Off {
        return Ok(());
    }
    if kind != JobKind::Migrate || matches!(source, Endpoint::File(_)) {
        return Err(Error::invalid("follow", "only `migrate` from a backend can follow its source"));
    }
    if options.dry_run {
        return Err(Error::invalid("follow", "a dry run cannot follow the source (it writes nothing to follow with)"));
    }
    Ok(())
}

/// A checkpoint to go on from, or the news that there is nothing to do.
enum Opened {
    AlreadyFinished(Checkpoint),
    Ready { checkpoint: Checkpoint, resumed: bool },
}

/// Loads the checkpoint (or starts one, recording the source's change position first when the
/// migration is to follow it) and saves it before anything is written.
async fn open_checkpoint(
    path: &std::path::Path,
    identity: &Identity,
    source: &Endpoint,
    options: &Options,
) -> Result<Opened> {
    let follow = options.follow != FollowMode::Off;
    if options.dry_run {
        return Ok(Opened::Ready { checkpoint: Checkpoint::new(identity.clone()), resumed: false });
    }
    if options.restart {
        checkpoint::remove(path)?;
        journal::remove(&journal::path_for(path))?;
    } else if let Some(mut saved) = checkpoint::load(path)? {
        saved.check_identity(path, identity)?;
        if follow && saved.follow.is_none() {
            return Err(Error::invalid(
                "follow",
                format!(
                    "{} is the checkpoint of a migration that ran without --follow: the source's change position \
                     before its copy was not recorded, so changes made during the copy cannot be found. Use \
                     --restart (documents already at the target are recognised, not copied twice)",
                    path.display()
                ),
            ));
        }
        if saved.finished && !follow {
            return Ok(Opened::AlreadyFinished(saved));
        }
        saved.runs += 1;
        return Ok(Opened::Ready { checkpoint: saved, resumed: true });
    }
    let mut checkpoint = Checkpoint::new(identity.clone());
    if let (true, Endpoint::Backend { backend, .. }) = (follow, source) {
        // Before the first document is read: every change from here on is applied after the copy.
        checkpoint.follow =
            Some(FollowState::record(backend.as_ref()).await.map_err(|e| side_error("source", source, e))?);
    }
    checkpoint::save(path, &checkpoint)?;
    Ok(Opened::Ready { checkpoint, resumed: false })
}

/// The progress display, after saying where the checkpoint is.
async fn start_progress(
    kind: JobKind,
    source: &Endpoint,
    options: &Options,
    checkpoint: &Checkpoint,
    path: &std::path::Path,
    resumed: bool,
) -> Progress {
    let total = match source {
        Endpoint::Backend { backend, .. } if options.progress != ProgressMode::None && !checkpoint.finished => {
            backend.approximate_count().await.ok().flatten()
        }
        _ => None,
    };
    let progress = Progress::new(options.progress, kind.as_str(), checkpoint.ledger.counts.read, total);
    if options.dry_run {
        progress.say(&format!("agentstore {}: dry run, nothing will be written", kind.as_str()));
    } else {
        let how = if resumed { "resuming from" } else { "checkpoint" };
        progress.say(&format!("agentstore {}: {how} {}", kind.as_str(), path.display()));
    }
    progress
}

/// How the copy ended.
#[derive(Debug, PartialEq, Eq)]
enum CopyEnd {
    Finished,
    Interrupted,
}

/// The copy: the source's scan (or file), transformed, written to the target in order-completed
/// batches, checkpointed after each.
struct CopyPhase<'a> {
    source: &'a Endpoint,
    target: &'a Endpoint,
    options: &'a Options,
    path: &'a std::path::Path,
    journal: Option<&'a Journal>,
}

impl CopyPhase<'_> {
    async fn run(
        &self,
        checkpoint: &mut Checkpoint,
        started: Instant,
        progress: &mut Progress,
        stop: &mut StopFlag,
    ) -> Result<CopyEnd> {
        let options = self.options;
        let dry_run = options.dry_run;
        let earlier_secs = checkpoint.elapsed_secs;
        let resumed = checkpoint.runs > 1;
        let mut file_sink = None;
        let target_backend = match self.target {
            Endpoint::Backend { backend, .. } => {
                if !dry_run {
                    backend.ensure_standard_indexes().await.map_err(|e| side_error("target", self.target, e))?;
                }
                Some(Arc::clone(backend))
            }
            Endpoint::File(out) => {
                if !dry_run {
                    file_sink = Some(match checkpoint.output_bytes {
                        Some(bytes) if resumed => FileSink::resume(out, bytes)?,
                        _ => FileSink::create(out, options.restart)?,
                    });
                    checkpoint.output_bytes.get_or_insert(0);
                    checkpoint::save(self.path, checkpoint)?;
                }
                None
            }
        };

        let source_reader = open_source(self.source, &checkpoint.position)?;
        let (sender, mut receiver) = mpsc::channel(CHANNEL_BATCHES);
        let classify_options = options.clone();
        let reader = tokio::spawn(read_batches(
            "source",
            source_reader,
            options.batch_size,
            move |items, position| {
                let (docs, ledger) = classify(items, &classify_options);
                ReadBatch { docs, ledger, position }
            },
            sender,
        ));
        // Stops the reader however this function returns.
        let _stop_reader = AbortOnDrop(reader.abort_handle());
        let ensured = Arc::new(Mutex::new(HashSet::new()));
        let write_options = options.clone();
        let journal = self.journal.cloned();
        let mut completed = futures::stream::poll_fn(move |cx| receiver.poll_recv(cx))
            .map(|batch: Result<ReadBatch>| {
                let target_backend = target_backend.clone();
                let options = write_options.clone();
                let ensured = Arc::clone(&ensured);
                let journal = journal.clone();
                async move {
                    let mut batch = batch?;
                    let outcome = match target_backend {
                        None => Ledger::default(),
                        Some(target) if options.dry_run => {
                            sink::dry_run_against_backend(
                                target.as_ref(),
                                std::mem::take(&mut batch.docs),
                                options.max_issues,
                            )
                            .await?
                        }
                        Some(target) => {
                            ensure_namespaces(target.as_ref(), &batch.docs, &ensured).await?;
                            let docs = std::mem::take(&mut batch.docs);
                            sink::write_to_backend(
                                target.as_ref(),
                                docs,
                                options.on_conflict,
                                options.max_issues,
                                journal.as_ref(),
                            )
                            .await?
                        }
                    };
                    Ok::<_, Error>((batch, outcome))
                }
            })
            .buffered(options.concurrency);

        loop {
            let done = tokio::select! {
                biased;
                () = stop.raised() => return Ok(CopyEnd::Interrupted),
                done = completed.next() => match done {
                    Some(done) => done?,
                    None => break,
                },
            };
            let (batch, mut outcome) = done;
            if let Some(sink) = &mut file_sink {
                checkpoint.output_bytes = Some(sink.append(&batch.docs).await?);
                outcome.counts.written += batch.docs.len() as u64;
            } else if dry_run && matches!(self.target, Endpoint::File(_)) {
                outcome.counts.would_write += batch.docs.len() as u64;
            }
            if outcome.counts.conflicts > 0 {
                return Err(conflict_stop(&outcome, self.path));
            }
            checkpoint.ledger.absorb(batch.ledger, options.max_issues);
            checkpoint.ledger.absorb(outcome, options.max_issues);
            checkpoint.position = batch.position;
            checkpoint.elapsed_secs = earlier_secs + started.elapsed().as_secs_f64();
            checkpoint.updated_at = crate::model::timestamp::now();
            if !dry_run {
                checkpoint::save(self.path, checkpoint)?;
            }
            progress.update(snapshot(&checkpoint.ledger));
        }
        // The channel also closes when the reader panics: only its clean end finishes the copy.
        reader.await.map_err(|e| Error::new(ErrorKind::Internal, "source reader task failed").with_source(e))?;

        checkpoint.position = Position::End;
        checkpoint.finished = true;
        checkpoint.elapsed_secs = earlier_secs + started.elapsed().as_secs_f64();
        checkpoint.updated_at = crate::model::timestamp::now();
        if !dry_run {
            checkpoint::save(self.path, checkpoint)?;
        }
        Ok(CopyEnd::Finished)
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The follow phase: applies the source's changes until stopped or caught up, saving the
/// checkpoint after each page.
async fn follow_phase(
    follower: &Follower<'_>,
    checkpoint: &mut Checkpoint,
    path: &std::path::Path,
    started: Instant,
    progress: &mut Progress,
    stop: &mut StopFlag,
    lag: &mut Lag,
) -> Result<Status> {
    let Some(mut state) = checkpoint.follow.clone() else {
        return Ok(Status::Finished);
    };
    progress.say(&format!("agentstore migrate: following the source's changes since {}", state.recorded_at));
    let earlier_secs = checkpoint.elapsed_secs - started.elapsed().as_secs_f64();
    let end = {
        let save = |state: &FollowState| {
            let mut saved = checkpoint.clone();
            saved.follow = Some(state.clone());
            saved.elapsed_secs = earlier_secs + started.elapsed().as_secs_f64();
            saved.updated_at = crate::model::timestamp::now();
            checkpoint::save(path, &saved)
        };
        follower.run(&mut state, stop, progress, save, lag).await?
    };
    checkpoint.follow = Some(state);
    checkpoint.elapsed_secs = earlier_secs + started.elapsed().as_secs_f64();
    checkpoint.updated_at = crate::model::timestamp::now();
    checkpoint::save(path, checkpoint)?;
    Ok(match end {
        FollowEnd::Stopped => Status::Stopped,
        FollowEnd::CaughtUp => Status::CaughtUp,
    })
}

/// The report, with the read-back's result when the job is a `migrate` that is to verify and
/// has written (or, finished earlier, had written) its documents.
async fn with_read_back(
    mut report: Report,
    kind: JobKind,
    source: &Endpoint,
    target: &Endpoint,
    options: &Options,
) -> Result<Report> {
    if kind == JobKind::Migrate && options.verify && !options.dry_run {
        // What the report explains (refused, failed, skipped documents) includes the follow phase's.
        let mut explained = report.ledger.clone();
        if let Some(follow) = &report.follow {
            explained.absorb(follow.ledger.clone(), options.max_issues);
        }
        report.verification = Some(read_back(source, target, options, &explained).await?);
    }
    Ok(report)
}

/// The read-back that ends a migration, with the migration's own filters and rules.
async fn read_back(
    source: &Endpoint,
    target: &Endpoint,
    options: &Options,
    ledger: &Ledger,
) -> Result<verify::Verification> {
    let verify_options = verify::VerifyOptions {
        batch_size: options.batch_size,
        concurrency: options.concurrency,
        access_tracking: options.access_tracking,
        filter: options.filter.clone(),
        raw: false,
        max_ids: options.max_issues,
        progress: options.progress,
        // The migration's own record says how it ended.
        record: false,
    };
    verify::verify_migration(source, target, &verify_options, ledger).await.map_err(|e| {
        Error::new(
            e.kind(),
            "the migration finished, but reading it back failed; run `agentstore verify` with the same options",
        )
        .with_source(e)
    })
}

/// Ensures the target's index covers each namespace before its first write, once per namespace.
async fn ensure_namespaces(
    target: &dyn DocumentBackend,
    docs: &[Outgoing],
    ensured: &Mutex<HashSet<String>>,
) -> Result<()> {
    let mut fresh = Vec::new();
    {
        let mut seen = ensured.lock().unwrap_or_else(|e| e.into_inner());
        for doc in docs {
            let namespace = doc.body.get(crate::model::fields::NAMESPACE).and_then(|v| v.as_str()).unwrap_or_default();
            if !seen.contains(namespace) {
                if seen.len() >= ENSURED_NAMESPACES_CAP {
                    seen.clear();
                }
                seen.insert(namespace.to_owned());
                fresh.push(namespace.to_owned());
            }
        }
    }
    for namespace in fresh {
        target.ensure_namespace_indexed(&namespace).await.map_err(|e| {
            Error::new(e.kind(), format!("target: ensure the index for namespace {namespace:?}")).with_source(e)
        })?;
    }
    Ok(())
}

/// The error that stops a migration at a conflict under `--on-conflict fail`.
fn conflict_stop(outcome: &Ledger, path: &std::path::Path) -> Error {
    let ids: Vec<&str> =
        outcome.issues.iter().filter(|issue| issue.kind == "conflict").map(|issue| issue.id.as_str()).collect();
    Error::conflict(format!(
        "{} document(s) exist at the target with different content, e.g. {ids:?}; nothing was overwritten. \
         Run the same command with --on-conflict skip or --on-conflict overwrite to go on; the checkpoint {} \
         keeps the progress so far",
        outcome.counts.conflicts,
        path.display()
    ))
}

fn snapshot(ledger: &Ledger) -> Snapshot {
    let c = &ledger.counts;
    Snapshot {
        read: c.read,
        landed: ledger.landed(),
        skipped: c.conflicts_skipped + c.refused + c.failed + c.foreign + c.malformed + c.filtered_out + c.unreadable,
    }
}

/// Wraps an error from one side with which side it is.
pub fn side_error(side: &str, endpoint: &Endpoint, err: Error) -> Error {
    Error::new(err.kind(), format!("{side} {}", endpoint.name())).with_source(err)
}

#[allow(clippy::too_many_arguments)]
fn finished_report(
    kind: JobKind,
    identity: &Identity,
    path: &std::path::Path,
    options: &Options,
    checkpoint: Checkpoint,
    started: Instant,
    status: Status,
    read_this_run: u64,
) -> Report {
    let duration_secs = started.elapsed().as_secs_f64();
    let message = match status {
        Status::AlreadyFinished => {
            format!("already finished on {}; nothing to do (pass --restart to run it again)", checkpoint.updated_at)
        }
        Status::DryRun => "dry run: nothing was written".to_owned(),
        Status::Finished if checkpoint.ledger.incomplete() => {
            "finished, but some documents were not copied (see issues)".to_owned()
        }
        Status::Finished => "finished".to_owned(),
        Status::Interrupted => {
            "stopped by a signal before the copy finished; run the same command to resume".to_owned()
        }
        Status::Stopped => "following stopped by a signal; run the same command to go on following".to_owned(),
        Status::CaughtUp => "caught up: every change committed before this run started is at the target".to_owned(),
    };
    Report {
        command: kind.as_str().to_owned(),
        from: identity.from.clone(),
        to: identity.to.clone(),
        status,
        message,
        checkpoint: (!options.dry_run).then(|| path.display().to_string()),
        resumed: false,
        runs: checkpoint.runs,
        ledger: checkpoint.ledger,
        batch_size: options.batch_size,
        concurrency: options.concurrency,
        memory_bound_documents: memory_bound_documents(options.batch_size, options.concurrency),
        duration_secs,
        total_duration_secs: checkpoint.elapsed_secs,
        docs_per_sec: read_this_run as f64 / duration_secs.max(1e-9),
        peak_rss_bytes: report::peak_rss_bytes(),
        design_documents_left_behind: None,
        verification: None,
        follow: None,
    }
}
