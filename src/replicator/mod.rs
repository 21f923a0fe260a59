//! The replicator (CouchDB's `couch_replicator`, as its own application): replications this
//! server runs, described by documents of its `_replicator` database or by `POST /_replicate`.
//!
//! - [`spec`]: a replication document read as CouchDB reads it (endpoints, options, refusals).
//! - [`term`] and [`ids`]: the replication id, computed as CouchDB 3.4.3 computes it.
//! - [`checkpoint`]: the `_local/{id}` checkpoints on both ends, in CouchDB's form.
//! - [`job`]: one run of one replication, over the deployment move's two kinds of end
//!   ([`crate::migrate::deployment::Side`]: this server's databases in-process, or a
//!   CouchDB-protocol server through [`crate::replication_client`]).
//! - [`scheduler`]: the `_replicator` feed followed, jobs started and stopped, their state
//!   written back, one instance per job (a lease in the backend).
//! - [`rules`]: the `_replicator` database's write guard (CouchDB's `before_doc_update`).
//!
//! The HTTP side (`_scheduler`, `_active_tasks`, `_replicate`) is
//! `crate::couchdb_api::replicator`; this module shapes what it shows ([`Replicator::jobs_json`]
//! and the others). On the CouchDB backend the databases are CouchDB's own, `_replicator`
//! included, and CouchDB's replicator runs them: nothing is started here.

pub mod checkpoint;
pub mod ids;
pub mod job;
pub mod rules;
pub mod scheduler;
pub mod spec;
pub mod term;

use std::sync::Arc;

use serde_json::{json, Map, Value};

use scheduler::{iso8601, JobEntry, JobState, Scheduler};

pub use scheduler::REPLICATOR_DB;

/// The replicator of one server: its scheduler and what the HTTP layer asks of it.
#[derive(Clone)]
pub struct Replicator {
    scheduler: Arc<Scheduler>,
}

impl Replicator {
    pub fn new(context: job::JobContext, bounds: scheduler::SchedulerBounds) -> crate::Result<Self> {
        let instance = format!("agentstore-{}", &checkpoint::random_hex()?[..12]);
        Ok(Replicator { scheduler: Scheduler::new(context, bounds, instance) })
    }

    /// Follows `_replicator` in a task of its own until `stopping` turns true.
    pub fn start(&self, stopping: tokio::sync::watch::Receiver<bool>) {
        tokio::spawn(Arc::clone(&self.scheduler).run(stopping));
    }

    /// This instance's name (`node` in what `_scheduler` shows).
    pub fn node(&self) -> &str {
        &self.scheduler.instance
    }

    /// `POST /_replicate` of a parsed body.
    pub async fn replicate(&self, replication: spec::Replication) -> crate::Result<Value> {
        self.scheduler.replicate(replication).await
    }

    /// The replication id `POST /_replicate` with `cancel` names by its body.
    pub async fn replication_id(&self, replication: &spec::Replication) -> crate::Result<ids::ReplicationId> {
        self.scheduler.context().replication_id(replication).await
    }

    /// Stops the transient replication `id`; `false` when none runs.
    pub fn cancel(&self, id: &str) -> bool {
        self.scheduler.cancel(id)
    }

    fn with_jobs<T>(&self, read: impl FnOnce(&std::collections::BTreeMap<String, JobEntry>) -> T) -> T {
        let jobs = self.scheduler.jobs.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        read(&jobs)
    }

    /// `GET /_scheduler/jobs`: the jobs running or waiting to run here (CouchDB's `job_ejson`,
    /// `database` first as its HTTP layer moves it).
    pub fn jobs_json(&self) -> Value {
        let node = self.node().to_owned();
        let jobs: Vec<Value> = self.with_jobs(|jobs| {
            jobs.values()
                .filter(|job| matches!(job.state, JobState::Running | JobState::Pending | JobState::Crashing))
                .filter(|job| job.elsewhere.is_none() && job.id.is_some())
                .map(|job| {
                    let history: Vec<Value> = job
                        .history
                        .iter()
                        .map(|(kind, when)| json!({ "timestamp": iso8601(*when), "type": kind }))
                        .collect();
                    json!({
                        "database": job.doc_id.as_ref().map(|_| REPLICATOR_DB),
                        "id": job.id.as_ref().map(ids::ReplicationId::full),
                        "pid": (job.state == JobState::Running).then(|| pid_of(job)),
                        "source": job.replication.source.shown(),
                        "target": job.replication.target.shown(),
                        "user": job.replication.user,
                        "doc_id": job.doc_id,
                        "info": info_of(job),
                        "history": history,
                        "node": node,
                        "start_time": iso8601(job.start_time),
                    })
                })
                .collect()
        });
        json!({ "total_rows": jobs.len(), "offset": 0, "jobs": jobs })
    }

    /// `GET /_scheduler/docs`: every replication document's state (CouchDB's `ejson_doc`).
    pub fn docs_json(&self) -> Value {
        let mut docs: Vec<Value> = self.with_jobs(|jobs| jobs.values().filter_map(|job| self.doc_json(job)).collect());
        docs.extend(self.failed().values().cloned());
        docs.sort_by(|a, b| a["doc_id"].as_str().cmp(&b["doc_id"].as_str()));
        json!({ "total_rows": docs.len(), "offset": 0, "docs": docs })
    }

    /// `GET /_scheduler/docs/_replicator/{doc_id}`.
    pub fn doc_json_of(&self, doc_id: &str) -> Option<Value> {
        self.with_jobs(|jobs| jobs.get(doc_id).and_then(|job| self.doc_json(job)))
            .or_else(|| self.failed().get(doc_id).cloned())
    }

    fn failed(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<String, Value>> {
        self.scheduler.failed.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn doc_json(&self, job: &JobEntry) -> Option<Value> {
        let doc_id = job.doc_id.as_ref()?;
        if matches!(job.state, JobState::Completed | JobState::Failed) {
            return Some(finished_doc_json(doc_id, job));
        }
        let (state, node) = match (&job.elsewhere, job.state) {
            (Some(owner), JobState::Pending) => ("running", owner.clone()),
            (_, state) => (state.as_str(), self.node().to_owned()),
        };
        let info = match job.state {
            JobState::Crashing => job.error.as_ref().map_or(Value::Null, |error| json!({ "error": error })),
            _ => info_of(job),
        };
        Some(json!({
            "database": REPLICATOR_DB,
            "doc_id": doc_id,
            "id": job.id.as_ref().map(ids::ReplicationId::full),
            "node": node,
            "source": job.replication.source.shown(),
            "target": job.replication.target.shown(),
            "state": state,
            "info": info,
            "error_count": job.error_count,
            "last_updated": iso8601(job.last_updated),
            "start_time": iso8601(job.start_time),
            "source_proxy": null,
            "target_proxy": null,
        }))
    }

    /// `GET /_active_tasks`' replication rows: the jobs running here, members as CouchDB lists
    /// them (`node`, `pid`, `process_status`, then the others by name).
    pub fn active_tasks(&self) -> Vec<Value> {
        let node = self.node().to_owned();
        let interval = self.scheduler.context().bounds.checkpoint_interval.as_millis() as u64;
        self.with_jobs(|jobs| {
            jobs.values()
                .filter(|job| job.state == JobState::Running && job.id.is_some())
                .map(|job| {
                    let stats = job.stats.lock().map(|s| s.clone()).unwrap_or_default();
                    let mut rest: std::collections::BTreeMap<String, Value> = stats.info().into_iter().collect();
                    rest.insert("type".into(), Value::from("replication"));
                    rest.insert("user".into(), job.replication.user.clone().map_or(Value::Null, Value::from));
                    rest.insert("replication_id".into(), Value::from(job.id.as_ref().map(ids::ReplicationId::full)));
                    rest.insert(
                        "database".into(),
                        job.doc_id.as_ref().map_or(Value::Null, |_| Value::from(REPLICATOR_DB)),
                    );
                    rest.insert("doc_id".into(), job.doc_id.clone().map_or(Value::Null, Value::from));
                    rest.insert("source".into(), Value::from(job.replication.source.shown()));
                    rest.insert("target".into(), Value::from(job.replication.target.shown()));
                    rest.insert("continuous".into(), Value::from(job.replication.continuous));
                    rest.insert("checkpoint_interval".into(), Value::from(interval));
                    rest.insert("started_on".into(), Value::from(job.start_time.timestamp()));
                    rest.insert("updated_on".into(), Value::from(chrono::Utc::now().timestamp()));
                    let mut task = Map::new();
                    task.insert("node".into(), Value::from(node.clone()));
                    task.insert("pid".into(), Value::from(pid_of(job)));
                    task.insert("process_status".into(), Value::from("waiting"));
                    task.extend(rest);
                    Value::Object(task)
                })
                .collect()
        })
    }
}

/// A name for a running job in CouchDB's process-id form (there is no Erlang process here).
fn pid_of(job: &JobEntry) -> String {
    format!("<0.{}.0>", job.start_time.timestamp_subsec_micros())
}

/// A completed or failed document as `_scheduler/docs` shows it: what the document says of its
/// run (`_replication_stats` without `start_time`, or the failure's reason), no id, no node.
fn finished_doc_json(doc_id: &str, job: &JobEntry) -> Value {
    let written = &job.written_state;
    let mut stats = written.get("_replication_stats").and_then(Value::as_object).cloned().unwrap_or_default();
    let start_time = stats.shift_remove("start_time").unwrap_or_else(|| Value::from(iso8601(job.start_time)));
    let info = match job.state {
        JobState::Failed => {
            json!({ "error": written.get("_replication_state_reason").cloned().unwrap_or(Value::Null) })
        }
        _ => Value::Object(stats),
    };
    json!({
        "database": REPLICATOR_DB,
        "doc_id": doc_id,
        "id": null,
        "source": job.replication.source.shown(),
        "target": job.replication.target.shown(),
        "state": job.state.as_str(),
        "error_count": 0,
        "info": info,
        "start_time": start_time,
        "last_updated": written.get("_replication_state_time").cloned().unwrap_or_else(|| Value::from(iso8601(job.last_updated))),
    })
}

/// A job's statistics as `info` shows them; `null` before its first run, as CouchDB's.
fn info_of(job: &JobEntry) -> Value {
    if job.history.iter().all(|(kind, _)| kind == "added") {
        return Value::Null;
    }
    let stats = job.stats.lock().map(|s| s.clone()).unwrap_or_default();
    Value::Object(stats.info())
}
