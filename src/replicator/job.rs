//! One replication run: the replication protocol's loop over two [`Side`]s, as the deployment
//! move copies a database ([`crate::migrate::deployment`]), with the replication's filter applied
//! where the source's feed is read, checkpoints in CouchDB's form on both ends
//! ([`super::checkpoint`]) and the statistics CouchDB shows (`_active_tasks`, `_scheduler`).
//!
//! A page: the source's feed after the last sequence ([`JobBounds::batch_size`] changes, each with
//! every leaf), the leaves the target lacks (`_revs_diff`), those leaves read with their
//! ancestry and attachments as stubs (`_bulk_get?revs=true`) and written as replicated revisions
//! (`new_edits: false`), their attachments' bytes moved as the deployment move moves them
//! ([`crate::migrate::deployment::write_page`]: small ones inline in bounded groups, large ones
//! streamed one at a time). A checkpoint is recorded every
//! [`JobBounds::checkpoint_interval`] and when the feed's end is reached; a one-shot replication
//! then ends, a continuous one reads the feed again every [`JobBounds::poll_interval`] until it is
//! stopped (it records its checkpoint first). Its counts go on from those of the checkpoint's
//! newest history entry, as CouchDB's do.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;
use tokio::sync::watch;

use super::checkpoint::{Checkpoints, End};
use super::ids::{replication_id, ReplicationId};
use super::spec::{Endpoint, Replication, ReplicationFilter};
use crate::database::validation::{as_writer, Writer};
use crate::database::Databases;
use crate::error::{Error, ErrorKind, Result};
use crate::migrate::deployment::{write_page, CopyEnds, Side};
use crate::replication_client::CouchClient;

/// A job's bounds ([docs/bounds.md](../../docs/bounds.md)).
#[derive(Debug, Clone, Copy)]
pub struct JobBounds {
    /// Changes read per feed page (CouchDB's `worker_batch_size` is 500).
    pub batch_size: usize,
    /// How often a running job records its checkpoint (CouchDB's 30 s).
    pub checkpoint_interval: Duration,
    /// How long a continuous job waits between two reads of a feed found at its end.
    pub poll_interval: Duration,
    /// A remote endpoint's connect timeout (CouchDB's `connection_timeout`, 30 s).
    pub connect_timeout: Duration,
    /// A remote endpoint's request timeout.
    pub request_timeout: Duration,
}

impl Default for JobBounds {
    fn default() -> Self {
        JobBounds {
            batch_size: 100,
            checkpoint_interval: Duration::from_secs(30),
            poll_interval: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(300),
        }
    }
}

/// What a job has done, as CouchDB counts it (`rep_stats`).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct JobStats {
    pub revisions_checked: u64,
    pub missing_revisions_found: u64,
    pub docs_read: u64,
    pub docs_written: u64,
    pub changes_pending: Option<u64>,
    pub doc_write_failures: u64,
    pub bulk_get_docs: u64,
    pub bulk_get_attempts: u64,
    pub checkpointed_source_seq: Value,
    /// The newest sequence read from the source, and the one every change through is written.
    #[serde(skip)]
    pub source_seq: Value,
    #[serde(skip)]
    pub through_seq: Value,
}

impl JobStats {
    /// The statistics as `_scheduler/jobs`' `info` and `_active_tasks` show them.
    pub fn info(&self) -> serde_json::Map<String, Value> {
        let mut info = match serde_json::to_value(self) {
            Ok(Value::Object(info)) => info,
            _ => serde_json::Map::new(),
        };
        info.insert("source_seq".into(), self.source_seq.clone());
        info.insert("through_seq".into(), self.through_seq.clone());
        info
    }
}

/// What a job runs against: this server's databases, its UUID, its JavaScript engine.
#[derive(Clone)]
pub struct JobContext {
    pub databases: Arc<Databases>,
    pub server_uuid: Arc<str>,
    pub js: Option<crate::js::JsEngine>,
    pub bounds: JobBounds,
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// A one-shot replication reached the end of the source's feed; its answer for `_replicate`.
    Completed(Value),
    /// Stopped from outside (a continuous job, or a document changed or deleted).
    Stopped,
}

/// An endpoint opened: the side and the database on it.
struct Opened {
    side: Side,
    db: String,
}

impl JobContext {
    fn open(&self, endpoint: &Endpoint) -> Result<Opened> {
        match endpoint {
            Endpoint::Local(name) => {
                Ok(Opened { side: Side::local(Arc::clone(&self.databases), "local"), db: name.clone() })
            }
            Endpoint::Remote(remote) => {
                let (server, db) = remote.server_and_db();
                let client = CouchClient::new(server.as_str())?
                    .with_basic_auth(remote.user.clone(), remote.password.clone())
                    .with_headers(remote.headers.clone())
                    .with_timeouts(self.bounds.connect_timeout, self.bounds.request_timeout)?;
                Ok(Opened { side: Side::Remote(client), db })
            }
        }
    }

    /// The replication's id; a design filter's code is read from the source for it.
    pub async fn replication_id(&self, replication: &Replication) -> Result<ReplicationId> {
        let code = match &replication.filter {
            ReplicationFilter::Design { ddoc, name, .. } => {
                let source = self.open(&replication.source)?;
                let id = format!("_design/{ddoc}");
                let doc =
                    source.side.get_doc(&source.db, &id).await?.ok_or_else(|| {
                        Error::not_found(format!("Couldn't open document `{id}` from source database"))
                    })?;
                let code = doc["filters"][name.as_str()].as_str().map(str::to_owned);
                Some(code.ok_or_else(|| Error::not_found(format!("missing json key: {name}")))?)
            }
            _ => None,
        };
        Ok(replication_id(&self.server_uuid, replication, code.as_deref()))
    }
}

/// Runs `replication` (of id `id`) until it completes or `stop` turns true, keeping `stats`
/// current. Local writes are made as a server admin's (as CouchDB's replicator writes with its
/// `_admin` context); a remote end's own rules judge the credentials sent.
pub async fn run(
    context: &JobContext,
    replication: &Replication,
    id: &ReplicationId,
    stats: &Arc<Mutex<JobStats>>,
    stop: watch::Receiver<bool>,
) -> Result<Outcome> {
    let writer = Writer { name: replication.user.clone(), roles: vec!["_admin".to_owned()], data_store: None };
    as_writer(writer, run_as_admin(context, replication, id, stats, stop)).await
}

async fn run_as_admin(
    context: &JobContext,
    replication: &Replication,
    id: &ReplicationId,
    stats: &Arc<Mutex<JobStats>>,
    mut stop: watch::Receiver<bool>,
) -> Result<Outcome> {
    let source = context.open(&replication.source)?;
    let target = context.open(&replication.target)?;
    prepare_ends(replication, &source, &target).await?;
    let (source_end, target_end) =
        (End { side: &source.side, db: &source.db }, End { side: &target.side, db: &target.db });
    let by_doc_ids = matches!(replication.filter, ReplicationFilter::DocIds(_));
    let mut checkpoints =
        Checkpoints::read(&source_end, &target_end, id, replication.since_seq.as_ref(), by_doc_ids).await?;
    let filter = replication.filter.clone();
    let mut since = start_position(&checkpoints.start_seq);
    let kept = checkpoints.history_stats();
    update(stats, |s| {
        s.revisions_checked = s.revisions_checked.max(kept.revisions_checked);
        s.missing_revisions_found = s.missing_revisions_found.max(kept.missing_revisions_found);
        s.docs_read = s.docs_read.max(kept.docs_read);
        s.docs_written = s.docs_written.max(kept.docs_written);
        s.doc_write_failures = s.doc_write_failures.max(kept.doc_write_failures);
        s.bulk_get_docs = s.bulk_get_docs.max(kept.bulk_get_docs);
        s.bulk_get_attempts = s.bulk_get_attempts.max(kept.bulk_get_attempts);
        s.checkpointed_source_seq = checkpoints.start_seq.clone();
        s.through_seq = checkpoints.start_seq.clone();
    });
    let mut last_checkpoint = Instant::now();
    loop {
        if *stop.borrow() {
            record(&mut checkpoints, &source_end, &target_end, &since, stats).await?;
            return Ok(Outcome::Stopped);
        }
        let page = source
            .side
            .changes_filtered(&source.db, &since, context.bounds.batch_size, &filter, context.js.as_ref())
            .await?;
        copy_page(&source, &target, &page.docs, stats).await?;
        since = page.last_seq.clone();
        update(stats, |s| {
            s.source_seq = since.clone();
            s.through_seq = since.clone();
            s.changes_pending = page.at_end.then_some(0);
        });
        if page.at_end || last_checkpoint.elapsed() >= context.bounds.checkpoint_interval {
            record(&mut checkpoints, &source_end, &target_end, &since, stats).await?;
            last_checkpoint = Instant::now();
        }
        if !page.at_end {
            continue;
        }
        if !replication.continuous {
            return Ok(Outcome::Completed(checkpoints.answer()));
        }
        tokio::select! {
            _ = tokio::time::sleep(context.bounds.poll_interval) => {}
            _ = stop.changed() => {}
        }
    }
}

/// Checks both ends exist, creating the target with `create_target` (CouchDB's `db_not_found`
/// reason otherwise).
async fn prepare_ends(replication: &Replication, source: &Opened, target: &Opened) -> Result<()> {
    if !source.side.exists(&source.db).await? {
        return Err(Error::not_found(format!("could not open {}", replication.source.shown())));
    }
    if replication.create_target {
        target.side.ensure(&target.db).await?;
    } else if !target.side.exists(&target.db).await? {
        return Err(Error::not_found(format!("could not open {}", replication.target.shown())));
    }
    Ok(())
}

/// The leaves of a page's changes the target lacks, read and written; the counts added.
async fn copy_page(
    source: &Opened,
    target: &Opened,
    docs: &[crate::replication_client::ChangedDoc],
    stats: &Arc<Mutex<JobStats>>,
) -> Result<()> {
    if docs.is_empty() {
        return Ok(());
    }
    let wanted: Vec<(String, Vec<String>)> = docs.iter().map(|d| (d.id.clone(), d.leaves.clone())).collect();
    let checked: u64 = wanted.iter().map(|(_, revs)| revs.len() as u64).sum();
    let missing = target.side.missing(&target.db, &wanted).await?;
    let found: u64 = missing.iter().map(|(_, revs)| revs.len() as u64).sum();
    let leaves = source.side.read_leaves(&source.db, &missing, false).await?;
    let read = leaves.len() as u64;
    let ends = CopyEnds { source: &source.side, source_db: &source.db, target: &target.side, target_db: &target.db };
    let failures = write_page(&ends, leaves).await?;
    for failure in &failures {
        tracing::warn!(target_db = %target.db, refused = %failure, "replication: the target refused a leaf");
    }
    update(stats, |s| {
        s.revisions_checked += checked;
        s.missing_revisions_found += found;
        s.docs_read += read;
        s.bulk_get_docs += read;
        s.bulk_get_attempts += u64::from(!missing.is_empty());
        s.docs_written += read.saturating_sub(failures.len() as u64);
        s.doc_write_failures += failures.len() as u64;
    });
    Ok(())
}

async fn record(
    checkpoints: &mut Checkpoints,
    source: &End<'_>,
    target: &End<'_>,
    since: &Value,
    stats: &Arc<Mutex<JobStats>>,
) -> Result<()> {
    if since.is_null() {
        return Ok(());
    }
    let now = stats.lock().map(|s| s.clone()).unwrap_or_default();
    checkpoints.record(source, target, since, &now).await?;
    update(stats, |s| s.checkpointed_source_seq = since.clone());
    Ok(())
}

/// Where the feed is read from: `0` (CouchDB's lowest sequence) is the start.
fn start_position(seq: &Value) -> Value {
    match seq {
        Value::Number(n) if n.as_u64() == Some(0) => Value::Null,
        Value::String(text) if text == "0" => Value::Null,
        other => other.clone(),
    }
}

fn update(stats: &Arc<Mutex<JobStats>>, change: impl FnOnce(&mut JobStats)) {
    if let Ok(mut stats) = stats.lock() {
        change(&mut stats);
    }
}

/// Whether an error may pass if the job is tried again (a connection, a 5xx) or will not (a
/// refusal): CouchDB retries both with backoff, and so does the scheduler; this only names it.
pub fn is_transient(err: &Error) -> bool {
    matches!(err.kind(), ErrorKind::Unavailable | ErrorKind::DeadlineExceeded | ErrorKind::OutcomeUnknown)
}
