//! The scheduler: it follows the `_replicator` database's feed on this server and keeps one job
//! per replication document (CouchDB's `couch_replicator_doc_processor` and
//! `couch_replicator_scheduler`), and runs the transient replications of `POST /_replicate`.
//!
//! **Documents.** Every [`SCAN_INTERVAL`] the feed is read from where it was (from the start when
//! the process starts, so jobs survive a restart: each resumes from its checkpoint). A new or
//! changed document (its body, state fields aside) replaces its job; a deleted one stops it. A
//! document in state `completed` or `failed` is not run; `triggered` or `error` (written by
//! CouchDB before 3.0, or with `update_docs`) have their state fields removed and run, as
//! CouchDB 3.4.3 does. What is written back is what 3.4.3 writes by default: `completed` with
//! `_replication_stats`, and `failed` with `_replication_state_reason` for a document it cannot
//! parse, each with `_replication_state_time` when the state changes.
//!
//! **One instance per job.** With several instances over one backend every instance follows the
//! same documents; a job runs only where its lease is held: a local document of the
//! `_replicator` database's backend (`replicator:lease:{doc id}`, owner and expiry), taken with
//! a compare-and-swap write (`Precondition::MustNotExist` / `MatchRevision`), renewed every
//! [`LEASE_RENEW`] while the job runs, and released when it ends. A lease not renewed for
//! [`SchedulerBounds::lease_ttl`] (its instance killed) is taken over at the next scan elsewhere:
//! a killed instance's jobs pause for at most the lease's time plus a scan.
//!
//! **Errors.** A run that fails is retried with exponential backoff (CouchDB's `crashing` state:
//! 5 s doubling up to [`MAX_BACKOFF`]), its lease released meanwhile. At most
//! [`SchedulerBounds::max_jobs`] jobs run at once on an instance (`couchdb_max_replication_jobs`,
//! CouchDB's `[replicator] max_jobs`); the others wait `pending`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};
use tokio::sync::watch;

use super::ids::ReplicationId;
use super::job::{self, JobContext, JobStats, Outcome};
use super::spec::{self, Replication};
use crate::backend::catalog::DbName;
use crate::backend::{Precondition, Revision};
use crate::database::{Database, Write};
use crate::error::{Error, ErrorKind, Result};

/// The replicator database's name.
pub const REPLICATOR_DB: &str = crate::database::replicator_owner::REPLICATOR_DB;
/// How often the `_replicator` feed is read and leases are looked at.
pub const SCAN_INTERVAL: Duration = Duration::from_secs(1);
/// How often a running job's lease is renewed.
pub const LEASE_RENEW: Duration = Duration::from_secs(5);
/// The first pause after a failed run; it doubles per failure in a row.
const FIRST_BACKOFF: Duration = Duration::from_secs(5);
/// The longest pause between two runs of a failing job.
pub const MAX_BACKOFF: Duration = Duration::from_secs(300);
/// The fields the replicator writes into documents: a change of these alone is not a change of
/// the replication.
const STATE_FIELDS: [&str; 5] = [
    "_replication_state",
    "_replication_state_time",
    "_replication_state_reason",
    "_replication_id",
    "_replication_stats",
];
/// A lease's local-document name prefix on `_replicator`'s backend (the engine's client local
/// documents are `doc:…`, so no client's `_local/` name can be one).
const LEASE_PREFIX: &str = "replicator:lease:";

/// The scheduler's bounds (docs/bounds.md).
#[derive(Debug, Clone, Copy)]
pub struct SchedulerBounds {
    pub max_jobs: usize,
    pub lease_ttl: Duration,
    /// How often `_replicator` is read ([`SCAN_INTERVAL`]; shorter in the crash sweep).
    pub scan_interval: Duration,
    /// The first pause after a failed run ([`FIRST_BACKOFF`]; shorter in the crash sweep).
    pub first_backoff: Duration,
}

impl SchedulerBounds {
    /// `max_jobs` and `lease_ttl` as configured; the scan and the backoff as CouchDB's.
    pub fn new(max_jobs: usize, lease_ttl: Duration) -> Self {
        SchedulerBounds { max_jobs, lease_ttl, scan_interval: SCAN_INTERVAL, first_backoff: FIRST_BACKOFF }
    }
}

/// A job's state as `_scheduler` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobState {
    Pending,
    Running,
    Crashing,
    Completed,
    Failed,
}

impl JobState {
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Pending => "pending",
            JobState::Running => "running",
            JobState::Crashing => "crashing",
            JobState::Completed => "completed",
            JobState::Failed => "failed",
        }
    }
}

/// One replication the scheduler knows.
pub struct JobEntry {
    /// The document's id; `None` for a transient replication.
    pub doc_id: Option<String>,
    pub replication: Replication,
    pub id: Option<ReplicationId>,
    pub state: JobState,
    /// The last error, for `crashing` and `failed`.
    pub error: Option<String>,
    pub error_count: u32,
    pub start_time: chrono::DateTime<chrono::Utc>,
    pub last_updated: chrono::DateTime<chrono::Utc>,
    /// `(event, when)`, newest first: `added`, `started`, `crashed`, `stopped`.
    pub history: Vec<(String, chrono::DateTime<chrono::Utc>)>,
    pub stats: Arc<Mutex<JobStats>>,
    /// The document's body as last seen, state fields aside (what makes it a new job).
    body: Map<String, Value>,
    stop: Option<watch::Sender<bool>>,
    /// When the job may run again after a failure.
    retry_at: Option<Instant>,
    /// The lease's revision while this instance holds it.
    lease: Option<Revision>,
    lease_renewed: Option<Instant>,
    /// Another instance runs it (its lease is live there).
    pub elsewhere: Option<String>,
    /// The number of its current run: a run that ends after its document changed (a new job
    /// under the same key) reports an older number and is not taken for the new job's.
    run: u64,
    /// The state fields the document carries (`_replication_stats`, `_replication_state_time`),
    /// which `_scheduler/docs` shows for a completed or failed document.
    pub written_state: Map<String, Value>,
    /// A completed run whose `completed` state could not be written into its document (a
    /// storage error): written at the next scans until it is, so that a client waiting for the
    /// document's state is not left waiting while the process goes on.
    unwritten: Option<(JobStats, chrono::DateTime<chrono::Utc>)>,
}

/// What a finished run reports back to the scheduler.
struct Finished {
    key: String,
    run: u64,
    outcome: Result<Outcome>,
}

/// The scheduler of one server.
pub struct Scheduler {
    context: JobContext,
    bounds: SchedulerBounds,
    /// This instance's name in leases and `node`.
    pub instance: String,
    /// Jobs by key: the document id, or `+{replication id}` for a transient one.
    pub jobs: Mutex<BTreeMap<String, JobEntry>>,
    finished: tokio::sync::mpsc::UnboundedSender<Finished>,
    finished_rx: tokio::sync::Mutex<tokio::sync::mpsc::UnboundedReceiver<Finished>>,
    /// Runs started so far (each run's number).
    runs: std::sync::atomic::AtomicU64,
    /// Documents that do not parse as replications, as `_scheduler/docs` shows them (no job).
    pub failed: Mutex<BTreeMap<String, Value>>,
}

impl Scheduler {
    pub fn new(context: JobContext, bounds: SchedulerBounds, instance: String) -> Arc<Self> {
        let (finished, finished_rx) = tokio::sync::mpsc::unbounded_channel();
        Arc::new(Scheduler {
            context,
            bounds,
            instance,
            jobs: Mutex::new(BTreeMap::new()),
            finished,
            finished_rx: tokio::sync::Mutex::new(finished_rx),
            runs: std::sync::atomic::AtomicU64::new(0),
            failed: Mutex::new(BTreeMap::new()),
        })
    }

    pub fn context(&self) -> &JobContext {
        &self.context
    }

    fn jobs(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, JobEntry>> {
        self.jobs.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Follows `_replicator` until `stopping` turns true; every job is stopped then.
    pub async fn run(self: Arc<Self>, mut stopping: watch::Receiver<bool>) {
        let mut since: Option<String> = None;
        loop {
            if *stopping.borrow() {
                break;
            }
            match self.scan(&mut since).await {
                Ok(()) => {}
                Err(err) => tracing::warn!(error = %err, "replicator: reading _replicator failed; trying again"),
            }
            tokio::select! {
                _ = tokio::time::sleep(self.bounds.scan_interval) => {}
                _ = stopping.changed() => {}
            }
        }
        let mut leases = Vec::new();
        for (key, job) in self.jobs().iter_mut() {
            stop_job(job);
            if let Some(lease) = job.lease.take() {
                leases.push((key.clone(), lease));
            }
        }
        // Given back, so that another instance takes the jobs over at once rather than when the
        // leases expire.
        if let Ok(Some(db)) = self.replicator_db().await {
            for (doc_id, lease) in leases {
                release_lease(&db, &doc_id, Some(lease)).await;
            }
        }
    }

    async fn replicator_db(&self) -> Result<Option<Arc<Database>>> {
        self.context.databases.open(&DbName::parse(REPLICATOR_DB)?).await
    }

    /// One scan: the feed's new changes, finished runs, leases, and jobs to start.
    async fn scan(self: &Arc<Self>, since: &mut Option<String>) -> Result<()> {
        let Some(db) = self.replicator_db().await? else {
            // `_replicator` deleted: its documents' jobs end (transient ones go on), and a new
            // `_replicator` is read from its start.
            self.jobs().retain(|_, job| {
                if job.doc_id.is_some() {
                    stop_job(job);
                }
                job.doc_id.is_none()
            });
            self.failed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clear();
            *since = None;
            return Ok(());
        };
        loop {
            let page = db.backend().changes(since.as_deref(), 200).await?;
            let states = db.read_changes(&page.changes).await?;
            for (change, state) in page.changes.iter().zip(states) {
                if change.id.starts_with("_design/") {
                    continue;
                }
                let winner = state.as_ref().and_then(|state| {
                    let leaf = state.tree.winner().filter(|leaf| !leaf.deleted)?;
                    Some((leaf.path.leaf_rev(), leaf.body.clone()))
                });
                self.document_changed(&db, &change.id, winner).await;
            }
            *since = Some(page.last_seq);
            if page.changes.is_empty() || page.pending == Some(0) {
                break;
            }
        }
        self.collect_finished(&db).await;
        self.renew_leases(&db).await;
        self.start_due(&db).await;
        Ok(())
    }

    /// A document's new winner (`None`: deleted).
    async fn document_changed(&self, db: &Database, doc_id: &str, winner: Option<(String, Map<String, Value>)>) {
        self.failed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(doc_id);
        let Some((rev, body)) = winner else {
            let removed = self.jobs().remove(doc_id);
            if let Some(mut removed) = removed {
                stop_job(&mut removed);
                release_lease(db, doc_id, removed.lease.take()).await;
            }
            return;
        };
        let replication_body = without_state(&body);
        if self.jobs().get(doc_id).is_some_and(|job| job.body == replication_body) {
            return;
        }
        let replaced = self.jobs().remove(doc_id);
        if let Some(mut replaced) = replaced {
            stop_job(&mut replaced);
            release_lease(db, doc_id, replaced.lease.take()).await;
        }
        let state = body.get("_replication_state").and_then(Value::as_str).unwrap_or_default().to_owned();
        let mut with_id = replication_body.clone();
        with_id.insert("_id".into(), Value::from(doc_id));
        let replication = match spec::parse(&with_id) {
            Ok(replication) => replication,
            Err(reason) => {
                let written = if state == "failed" {
                    state_of(&body)
                } else {
                    write_state(db, doc_id, &rev, DocState::Failed(reason.clone()))
                        .await
                        .ok()
                        .flatten()
                        .unwrap_or_default()
                };
                let shown = failed_doc_json(doc_id, &body, &written, &reason);
                self.failed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(doc_id.to_owned(), shown);
                return;
            }
        };
        let now = chrono::Utc::now();
        let initial = match state.as_str() {
            "completed" => JobState::Completed,
            "failed" => JobState::Failed,
            _ => JobState::Pending,
        };
        if matches!(state.as_str(), "triggered" | "error") {
            let _ = write_state(db, doc_id, &rev, DocState::Cleared).await;
        }
        let entry = JobEntry {
            doc_id: Some(doc_id.to_owned()),
            replication,
            id: None,
            state: initial,
            error: body.get("_replication_state_reason").and_then(Value::as_str).map(str::to_owned),
            error_count: 0,
            start_time: now,
            last_updated: now,
            history: vec![("added".into(), now)],
            stats: Arc::new(Mutex::new(JobStats::default())),
            body: replication_body,
            stop: None,
            retry_at: None,
            lease: None,
            lease_renewed: None,
            elsewhere: None,
            run: 0,
            written_state: state_of(&body),
            unwritten: None,
        };
        self.jobs().insert(doc_id.to_owned(), entry);
    }

    /// Runs that ended since the last scan: the document's state written, the lease released.
    async fn collect_finished(&self, db: &Database) {
        let mut finished = Vec::new();
        {
            let mut receiver = self.finished_rx.lock().await;
            while let Ok(done) = receiver.try_recv() {
                finished.push(done);
            }
        }
        for Finished { key, run, outcome } in finished {
            let now = chrono::Utc::now();
            let (lease, doc_id, stats) = {
                let mut jobs = self.jobs();
                let Some(job) = jobs.get_mut(&key) else { continue };
                if job.stop.is_none() || job.run != run {
                    continue;
                }
                job.stop = None;
                job.last_updated = now;
                match &outcome {
                    Ok(Outcome::Completed(_)) => {
                        job.state = JobState::Completed;
                        job.history.insert(0, ("stopped".into(), now));
                    }
                    Ok(Outcome::Stopped) => {
                        job.state = JobState::Pending;
                        job.history.insert(0, ("stopped".into(), now));
                    }
                    Err(err) => {
                        job.error_count += 1;
                        job.state = JobState::Crashing;
                        job.error = Some(crash_reason(err));
                        let backoff =
                            self.bounds.first_backoff.saturating_mul(1 << job.error_count.min(8)).min(MAX_BACKOFF);
                        job.retry_at = Some(Instant::now() + backoff / 2);
                        job.history.insert(0, ("crashed".into(), now));
                        tracing::warn!(doc = ?job.doc_id, error = %err, "replication crashed; it is tried again");
                    }
                }
                job.history.truncate(20);
                let stats = job.stats.lock().map(|s| s.clone()).unwrap_or_default();
                (job.lease.take(), job.doc_id.clone(), stats)
            };
            let Some(doc_id) = doc_id else {
                if matches!(outcome, Ok(Outcome::Completed(_))) {
                    self.jobs().remove(&key);
                }
                continue;
            };
            if matches!(outcome, Ok(Outcome::Completed(_))) {
                let start_time = self.jobs().get(&key).map(|job| job.start_time).unwrap_or(now);
                self.write_completed(db, &key, &doc_id, stats, start_time).await;
            }
            release_lease(db, &doc_id, lease).await;
        }
        self.write_unwritten(db).await;
    }

    /// Writes `completed` into the document of job `key`; on a storage error the job keeps it
    /// to write at the next scan ([`JobEntry::unwritten`]).
    async fn write_completed(
        &self,
        db: &Database,
        key: &str,
        doc_id: &str,
        stats: JobStats,
        start_time: chrono::DateTime<chrono::Utc>,
    ) {
        let written = match db.read(doc_id).await {
            Ok(Some(state)) => match state.tree.winner().filter(|leaf| !leaf.deleted) {
                Some(winner) => {
                    let rev = winner.path.leaf_rev();
                    write_state(db, doc_id, &rev, DocState::Completed(Box::new(stats.clone()), start_time)).await
                }
                // Deleted since: its job goes at the scan that reads the deletion.
                None => Ok(None),
            },
            Ok(None) => Ok(None),
            Err(err) => Err(err),
        };
        let mut jobs = self.jobs();
        let Some(job) = jobs.get_mut(key) else { return };
        match written {
            Ok(written) => {
                job.unwritten = None;
                if let Some(written) = written {
                    job.written_state = written;
                }
            }
            Err(err) => {
                tracing::warn!(doc = %doc_id, error = %err, "replicator: `completed` not written; tried again");
                job.unwritten = Some((stats, start_time));
            }
        }
    }

    /// The `completed` states a storage error kept from their documents, tried again.
    async fn write_unwritten(&self, db: &Database) {
        let due: Vec<(String, JobStats, chrono::DateTime<chrono::Utc>)> = self
            .jobs()
            .iter()
            .filter(|(_, job)| job.state == JobState::Completed)
            .filter_map(|(key, job)| job.unwritten.as_ref().map(|(stats, at)| (key.clone(), stats.clone(), *at)))
            .collect();
        for (key, stats, start_time) in due {
            self.write_completed(db, &key, &key, stats, start_time).await;
        }
    }

    /// Renews the leases of the jobs running here; a job whose lease was taken is stopped.
    async fn renew_leases(&self, db: &Database) {
        let due: Vec<(String, Revision)> = self
            .jobs()
            .iter()
            .filter(|(_, job)| job.stop.is_some() && job.lease_renewed.is_none_or(|at| at.elapsed() >= LEASE_RENEW))
            .filter_map(|(key, job)| Some((key.clone(), job.lease.clone()?)))
            .collect();
        for (doc_id, rev) in due {
            let renewed =
                write_lease(db, &doc_id, &self.instance, self.bounds.lease_ttl, Precondition::MatchRevision(rev)).await;
            let mut jobs = self.jobs();
            let Some(job) = jobs.get_mut(&doc_id) else { continue };
            match renewed {
                Ok(rev) => {
                    job.lease = Some(rev);
                    job.lease_renewed = Some(Instant::now());
                }
                Err(err) => {
                    tracing::warn!(doc = %doc_id, error = %err, "replication lease lost; the job stops here");
                    job.lease = None;
                    stop_job(job);
                    job.state = JobState::Pending;
                }
            }
        }
    }

    /// Starts the pending jobs whose lease this instance takes, within `max_jobs`.
    async fn start_due(self: &Arc<Self>, db: &Database) {
        let running = self.jobs().values().filter(|job| job.stop.is_some()).count();
        let mut room = self.bounds.max_jobs.saturating_sub(running);
        let candidates: Vec<String> = self
            .jobs()
            .iter()
            .filter(|(_, job)| job.doc_id.is_some() && job.stop.is_none())
            .filter(|(_, job)| matches!(job.state, JobState::Pending | JobState::Crashing))
            .filter(|(_, job)| job.retry_at.is_none_or(|at| Instant::now() >= at))
            .map(|(key, _)| key.clone())
            .collect();
        for doc_id in candidates {
            if room == 0 {
                break;
            }
            match take_lease(db, &doc_id, &self.instance, self.bounds.lease_ttl).await {
                Ok(Lease::Taken(rev)) => {
                    if let Some(job) = self.jobs().get_mut(&doc_id) {
                        job.lease = Some(rev);
                        job.lease_renewed = Some(Instant::now());
                        job.elsewhere = None;
                    }
                    self.spawn(&doc_id);
                    room -= 1;
                }
                Ok(Lease::HeldBy(owner)) => {
                    if let Some(job) = self.jobs().get_mut(&doc_id) {
                        job.elsewhere = Some(owner);
                    }
                }
                Err(err) => tracing::warn!(doc = %doc_id, error = %err, "cannot take a replication's lease"),
            }
        }
    }

    /// Starts the run of job `key` in its own task.
    fn spawn(self: &Arc<Self>, key: &str) {
        let (stop, stopped) = watch::channel(false);
        let run = self.runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        let (replication, stats) = {
            let mut jobs = self.jobs();
            let Some(job) = jobs.get_mut(key) else { return };
            job.stop = Some(stop);
            job.run = run;
            job.state = JobState::Running;
            let now = chrono::Utc::now();
            job.last_updated = now;
            job.history.insert(0, ("started".into(), now));
            (job.replication.clone(), Arc::clone(&job.stats))
        };
        let scheduler = Arc::clone(self);
        let key = key.to_owned();
        tokio::spawn(async move {
            let outcome = async {
                let id = scheduler.context.replication_id(&replication).await?;
                if let Some(job) = scheduler.jobs().get_mut(&key) {
                    job.id = Some(id.clone());
                }
                job::run(&scheduler.context, &replication, &id, &stats, stopped).await
            }
            .await;
            let _ = scheduler.finished.send(Finished { key, run, outcome });
        });
    }

    /// Runs a transient replication (`POST /_replicate`): a one-shot one to its end, answered
    /// with its checkpoint's history; a continuous one started, answered with its id.
    pub async fn replicate(self: &Arc<Self>, replication: Replication) -> Result<Value> {
        let id = self.context.replication_id(&replication).await?;
        let key = format!("+{}", id.full());
        let now = chrono::Utc::now();
        let stats = Arc::new(Mutex::new(JobStats::default()));
        let (stop, stopped) = watch::channel(false);
        {
            let mut jobs = self.jobs();
            if replication.continuous && jobs.contains_key(&key) {
                return Ok(json!({ "ok": true, "_local_id": id.full() }));
            }
            jobs.insert(
                key.clone(),
                JobEntry {
                    doc_id: None,
                    replication: replication.clone(),
                    id: Some(id.clone()),
                    state: JobState::Running,
                    error: None,
                    error_count: 0,
                    start_time: now,
                    last_updated: now,
                    history: vec![("started".into(), now), ("added".into(), now)],
                    stats: Arc::clone(&stats),
                    body: Map::new(),
                    stop: Some(stop),
                    retry_at: None,
                    lease: None,
                    lease_renewed: None,
                    elsewhere: None,
                    run: 0,
                    written_state: Map::new(),
                    unwritten: None,
                },
            );
        }
        if replication.continuous {
            let scheduler = Arc::clone(self);
            let (job_key, job_id) = (key.clone(), id.clone());
            tokio::spawn(async move {
                let outcome = job::run(&scheduler.context, &replication, &job_id, &stats, stopped).await;
                if let Err(err) = &outcome {
                    tracing::warn!(error = %err, "a transient continuous replication ended");
                }
                scheduler.jobs().remove(&job_key);
            });
            return Ok(json!({ "ok": true, "_local_id": id.full() }));
        }
        let outcome = job::run(&self.context, &replication, &id, &stats, stopped).await;
        self.jobs().remove(&key);
        match outcome? {
            Outcome::Completed(answer) => Ok(answer),
            Outcome::Stopped => Err(Error::new(ErrorKind::Unavailable, "the replication was stopped")),
        }
    }

    /// Cancels the transient replication of this id (with or without its suffix); `false` when
    /// none runs.
    pub fn cancel(&self, id: &str) -> bool {
        let mut jobs = self.jobs();
        let key = jobs
            .iter()
            .find(|(_, job)| {
                job.doc_id.is_none() && job.id.as_ref().is_some_and(|known| known.full() == id || known.base == id)
            })
            .map(|(key, _)| key.clone());
        match key.and_then(|key| jobs.remove(&key)) {
            Some(mut job) => {
                stop_job(&mut job);
                true
            }
            None => false,
        }
    }
}

/// A failed run's error as CouchDB shows it in `info.error`: a missing database is
/// `db_not_found: could not open {url}`.
fn crash_reason(err: &Error) -> String {
    if err.kind() == ErrorKind::NotFound && err.message().starts_with("could not open ") {
        return format!("db_not_found: {}", err.message());
    }
    err.message().to_owned()
}

fn stop_job(job: &mut JobEntry) {
    if let Some(stop) = job.stop.take() {
        let _ = stop.send(true);
    }
}

/// A document that does not parse as `_scheduler/docs` shows it: its endpoints as written
/// (credentials taken out of URLs), `failed`, the reason.
fn failed_doc_json(doc_id: &str, body: &Map<String, Value>, written: &Map<String, Value>, reason: &str) -> Value {
    let shown = |end: Option<&Value>| match end {
        Some(Value::String(text)) => match url::Url::parse(text) {
            Ok(mut url) => {
                let _ = url.set_username("");
                let _ = url.set_password(None);
                Value::from(url.to_string())
            }
            Err(_) => Value::from(text.clone()),
        },
        Some(Value::Object(end)) => end.get("url").cloned().unwrap_or(Value::Null),
        _ => Value::Null,
    };
    let now = Value::from(iso8601(chrono::Utc::now()));
    let when = written.get("_replication_state_time").cloned().unwrap_or(now);
    json!({
        "database": REPLICATOR_DB,
        "doc_id": doc_id,
        "id": null,
        "source": shown(body.get("source")),
        "target": shown(body.get("target")),
        "state": "failed",
        "error_count": 1,
        "info": { "error": reason },
        "start_time": when,
        "last_updated": when,
    })
}

/// The replicator's state fields of a document's body.
fn state_of(body: &Map<String, Value>) -> Map<String, Value> {
    body.iter().filter(|(key, _)| STATE_FIELDS.contains(&key.as_str())).map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// A document's body without the replicator's state fields.
fn without_state(body: &Map<String, Value>) -> Map<String, Value> {
    body.iter().filter(|(key, _)| !STATE_FIELDS.contains(&key.as_str())).map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// What is written back into a document.
enum DocState {
    Completed(Box<JobStats>, chrono::DateTime<chrono::Utc>),
    Failed(String),
    /// The state fields of an older replicator removed.
    Cleared,
}

/// Writes a document's state as CouchDB 3.4.3's `update_rep_doc` does, over revision `rev`; a
/// conflict (the document changed meanwhile) is left to the next change of it (`Ok(None)`). The
/// state fields written, when written; a storage error as it came.
async fn write_state(db: &Database, doc_id: &str, rev: &str, state: DocState) -> Result<Option<Map<String, Value>>> {
    let Some(stored) = db.read(doc_id).await? else { return Ok(None) };
    let Some(winner) = stored.tree.winner().filter(|leaf| !leaf.deleted && leaf.path.leaf_rev() == rev) else {
        return Ok(None);
    };
    let mut body = winner.body.clone();
    let before = body.clone();
    let set_state = |body: &mut Map<String, Value>, value: &str| {
        if body.get("_replication_state").and_then(Value::as_str) != Some(value) {
            body.insert("_replication_state".into(), Value::from(value));
            body.insert("_replication_state_time".into(), Value::from(iso8601(chrono::Utc::now())));
        }
    };
    match state {
        DocState::Completed(stats, start_time) => {
            set_state(&mut body, "completed");
            body.shift_remove("_replication_state_reason");
            let mut info = stats.info();
            info.shift_remove("source_seq");
            info.shift_remove("through_seq");
            info.insert("start_time".into(), Value::from(iso8601(start_time)));
            body.insert("_replication_stats".into(), Value::Object(info));
        }
        DocState::Failed(reason) => {
            set_state(&mut body, "failed");
            body.shift_remove("_replication_stats");
            body.insert("_replication_state_reason".into(), Value::from(reason));
        }
        DocState::Cleared => {
            for field in STATE_FIELDS {
                body.shift_remove(field);
            }
        }
    }
    if body == before {
        return Ok(Some(state_of(&body)));
    }
    let written = state_of(&body);
    let write = Write::Edit { parent: Some(rev.to_owned()), deleted: false, body };
    let writer = crate::database::validation::Writer { name: None, roles: vec!["_admin".into()], data_store: None };
    match crate::database::validation::as_writer(writer, db.write(doc_id, &write)).await {
        Ok(_) => Ok(Some(written)),
        Err(err) if err.kind() == ErrorKind::Conflict => {
            tracing::debug!(doc = %doc_id, error = %err, "replicator: the document changed; its state is not written");
            Ok(None)
        }
        Err(err) => Err(err),
    }
}

/// CouchDB's `iso8601` of a time: seconds, `Z`.
pub fn iso8601(at: chrono::DateTime<chrono::Utc>) -> String {
    at.format("%Y-%m-%dT%H:%M:%SZ").to_string()
}

enum Lease {
    Taken(Revision),
    HeldBy(String),
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Takes the lease of a document's job unless another instance holds it unexpired.
async fn take_lease(db: &Database, doc_id: &str, instance: &str, ttl: Duration) -> Result<Lease> {
    let name = format!("{LEASE_PREFIX}{doc_id}");
    let current = db.backend().get_local(&name).await?;
    let precondition = match &current {
        None => Precondition::MustNotExist,
        Some(stored) => {
            let owner = stored.body.get("owner").and_then(Value::as_str).unwrap_or_default();
            let expires = stored.body.get("expires_ms").and_then(Value::as_u64).unwrap_or(0);
            if owner != instance && expires > now_ms() {
                return Ok(Lease::HeldBy(owner.to_owned()));
            }
            Precondition::MatchRevision(stored.rev.clone())
        }
    };
    match write_lease(db, doc_id, instance, ttl, precondition).await {
        Ok(rev) => Ok(Lease::Taken(rev)),
        Err(err) if err.kind() == ErrorKind::Conflict => Ok(Lease::HeldBy("another instance".into())),
        Err(err) => Err(err),
    }
}

async fn write_lease(
    db: &Database,
    doc_id: &str,
    instance: &str,
    ttl: Duration,
    precondition: Precondition,
) -> Result<Revision> {
    let name = format!("{LEASE_PREFIX}{doc_id}");
    let body = json!({ "owner": instance, "expires_ms": now_ms() + ttl.as_millis() as u64 });
    let Value::Object(body) = body else { return Err(Error::new(ErrorKind::Internal, "a lease is an object")) };
    db.backend().put_local(&name, &body, precondition).await
}

/// Gives up a lease this instance holds (a failure leaves it to expire).
async fn release_lease(db: &Database, doc_id: &str, lease: Option<Revision>) {
    let Some(rev) = lease else { return };
    if let Err(err) = db.backend().delete_local(&format!("{LEASE_PREFIX}{doc_id}"), &rev).await {
        tracing::debug!(doc = %doc_id, error = %err, "a replication lease was not released; it expires");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::catalog::EmbeddedCatalog;
    use crate::backend::embedded::EmbeddedOptions;
    use crate::database::Databases;
    use serde_json::json;

    fn body(value: Value) -> Map<String, Value> {
        value.as_object().cloned().unwrap_or_default()
    }

    async fn put(db: &Database, id: &str, value: Value) {
        let write = Write::Edit { parent: None, deleted: false, body: body(value) };
        db.write(id, &write).await.unwrap();
    }

    async fn winner(db: &Database, id: &str) -> Map<String, Value> {
        let state = db.read(id).await.unwrap().unwrap();
        state.tree.winner().unwrap().body.clone()
    }

    /// A scheduler over a fresh embedded store (no write guard, so any document can be written)
    /// with `max_jobs`, and its `_replicator` database.
    async fn scheduler(dir: &std::path::Path, max_jobs: usize) -> (Arc<Scheduler>, Arc<Database>) {
        let catalog = Arc::new(EmbeddedCatalog::new(&dir.join("store.redb"), EmbeddedOptions::default()));
        let databases = Arc::new(Databases::new(Some(catalog), 16));
        let replicator = databases.create(&DbName::parse(REPLICATOR_DB).unwrap()).await.unwrap();
        let context = JobContext {
            databases,
            server_uuid: Arc::from("0123456789abcdef0123456789abcdef"),
            js: None,
            bounds: job::JobBounds::default(),
        };
        let bounds = SchedulerBounds::new(max_jobs, Duration::from_secs(30));
        (Scheduler::new(context, bounds, "test-instance".into()), replicator)
    }

    /// Scans until `done` holds of the document `id`, at most 10 s.
    async fn scan_until(
        scheduler: &Arc<Scheduler>,
        db: &Database,
        id: &str,
        done: impl Fn(&Map<String, Value>) -> bool,
    ) -> Map<String, Value> {
        let mut since = None;
        for _ in 0..100 {
            scheduler.scan(&mut since).await.unwrap();
            let doc = winner(db, id).await;
            if done(&doc) {
                return doc;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("{id} never reached the state wanted: {:?}", winner(db, id).await);
    }

    /// A document that does not parse is written back `failed` with the reason; a one-shot one
    /// is written back `completed` with its statistics and CouchDB's fields.
    #[tokio::test]
    async fn failed_and_completed_written_back() {
        let dir = tempfile::tempdir().unwrap();
        let (scheduler, replicator) = scheduler(dir.path(), 10).await;
        let databases = Arc::clone(&scheduler.context().databases);
        for name in ["src", "dst"] {
            databases.create(&DbName::parse(name).unwrap()).await.unwrap();
        }
        let source = databases.open(&DbName::parse("src").unwrap()).await.unwrap().unwrap();
        put(&source, "d1", json!({"v": 1})).await;
        put(&replicator, "bad", json!({"target": "dst"})).await;
        let failed = scan_until(&scheduler, &replicator, "bad", |doc| doc.contains_key("_replication_state")).await;
        assert_eq!(failed["_replication_state"], "failed");
        assert_eq!(failed["_replication_state_reason"], "Missing replicator database");
        assert!(failed["_replication_state_time"].as_str().is_some_and(|t| t.ends_with('Z')));
        put(&replicator, "good", json!({"source": "src", "target": "dst"})).await;
        let completed = scan_until(&scheduler, &replicator, "good", |doc| {
            doc.get("_replication_state") == Some(&json!("completed"))
        })
        .await;
        let stats = &completed["_replication_stats"];
        assert_eq!((stats["docs_read"].clone(), stats["docs_written"].clone()), (json!(1), json!(1)));
        assert!(stats["start_time"].is_string() && !completed.contains_key("_replication_state_reason"));
        let docs = super::super::Replicator { scheduler: Arc::clone(&scheduler) }.docs_json();
        let states: Vec<&Value> = docs["docs"].as_array().unwrap().iter().map(|d| &d["state"]).collect();
        assert_eq!(states, [&json!("failed"), &json!("completed")]);
    }

    /// Past `max_jobs` the other jobs wait `pending`; a job whose source is missing is
    /// `crashing` with CouchDB's reason and an error count, and waits its backoff.
    #[tokio::test]
    async fn max_jobs_and_crashing() {
        let dir = tempfile::tempdir().unwrap();
        let (scheduler, replicator) = scheduler(dir.path(), 1).await;
        let databases = Arc::clone(&scheduler.context().databases);
        for name in ["src", "a", "b"] {
            databases.create(&DbName::parse(name).unwrap()).await.unwrap();
        }
        put(&replicator, "ra", json!({"source": "src", "target": "a", "continuous": true})).await;
        put(&replicator, "rb", json!({"source": "src", "target": "b", "continuous": true})).await;
        let mut since = None;
        scheduler.scan(&mut since).await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        scheduler.scan(&mut since).await.unwrap();
        let states: Vec<JobState> = scheduler.jobs().values().map(|job| job.state).collect();
        assert_eq!(states, [JobState::Running, JobState::Pending], "one job at a time");
        put(&replicator, "gone", json!({"source": "nowhere", "target": "a"})).await;
        // Room for it: stop the running ones.
        for key in ["ra", "rb"] {
            let removed = scheduler.jobs().remove(key);
            if let Some(mut job) = removed {
                stop_job(&mut job);
            }
        }
        for _ in 0..50 {
            scheduler.scan(&mut since).await.unwrap();
            if scheduler.jobs().get("gone").is_some_and(|job| job.state == JobState::Crashing) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let jobs = scheduler.jobs();
        let gone = jobs.get("gone").expect("the job");
        assert_eq!(gone.state, JobState::Crashing);
        assert_eq!(gone.error_count, 1);
        assert_eq!(gone.error.as_deref(), Some("db_not_found: could not open nowhere"));
        assert!(gone.retry_at.is_some_and(|at| at > Instant::now()), "it waits its backoff");
    }
}
