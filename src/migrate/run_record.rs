//! A run's progress kept where a service can read it: a `migrate` (or `import`) run from the
//! command line is another process than `serve`, so its progress, printed on its own stderr
//! ([`super::progress`]), is also written as a local document of the **target** backend, which a
//! service over that backend lists in `GET /_active_tasks` (`crate::couchdb_api`), and the
//! console's service page shows (`docs/console.md`). Local documents are never fed, listed by
//! `_all_docs` or migrated, and the name starts with `:` (no user id does), so a per-user login's
//! `_local_docs` never lists it.
//!
//! The record is first written when the first batch has landed, then at most every
//! [`RECORD_INTERVAL`] while the run goes (one write in flight at a time, never holding the copy
//! up: a failed write is logged and the next one tried later), and once more, awaited, when the
//! run ends. Its fields: [`RunRecord::body`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use crate::backend::{DocumentBackend, Precondition};

/// The local documents' names start with this; the rest is the run's id.
pub const RUN_RECORD_PREFIX: &str = ":run:";
/// Most often a running record is written.
pub const RECORD_INTERVAL: Duration = Duration::from_secs(5);
/// A record still `running` but not written for this long belongs to a run that stopped without
/// saying so (killed): readers show it as `stopped`.
pub const STALE_AFTER: Duration = Duration::from_secs(60);

/// What a run has done so far, as written.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counts {
    pub read: u64,
    pub landed: u64,
    pub skipped: u64,
}

/// One run's record and its writer.
pub struct RunRecord {
    backend: Arc<dyn DocumentBackend>,
    name: String,
    command: String,
    source: String,
    target: String,
    started_on: i64,
    started: Instant,
    /// Counts when the run started (a resumed run's rate counts only its own work).
    baseline: u64,
    total: Option<u64>,
    last_write: Option<Instant>,
    writing: Option<tokio::task::JoinHandle<()>>,
    /// Whether the copy is done and the run follows the source's changes (`--follow`).
    following: bool,
    /// Who started the run: `command line`, or `service` for one started through the CouchDB
    /// API (`crate::runs`).
    origin: &'static str,
    /// Fields only some runs have (a whole-deployment run's databases: [`RunRecord::set_detail`]).
    detail: Map<String, Value>,
}

impl RunRecord {
    /// A record for a run of `command` from `source` to `target` (redacted names), written into
    /// `backend`.
    pub fn new(backend: Arc<dyn DocumentBackend>, command: &str, source: &str, target: &str) -> Self {
        let started_on = chrono::Utc::now().timestamp();
        let name = format!("{RUN_RECORD_PREFIX}{command}-{started_on}-{}", std::process::id());
        RunRecord {
            backend,
            name,
            command: command.to_owned(),
            source: source.to_owned(),
            target: target.to_owned(),
            started_on,
            started: Instant::now(),
            baseline: 0,
            total: None,
            last_write: None,
            writing: None,
            following: false,
            origin: "command line",
            detail: Map::new(),
        }
    }

    /// The record under the id `id` (below [`RUN_RECORD_PREFIX`]) instead of one made of the
    /// command, the time and the process.
    pub fn with_id(mut self, id: &str) -> Self {
        self.name = format!("{RUN_RECORD_PREFIX}{id}");
        self
    }

    /// Marks the run as started by the service rather than from the command line.
    pub fn started_by_service(mut self) -> Self {
        self.origin = "service";
        self
    }

    /// A new estimate of how many will be read in all (a whole-deployment run learns it a
    /// database at a time).
    pub fn set_total(&mut self, total: Option<u64>) {
        if !self.following {
            self.total = total.filter(|t| *t > 0);
        }
    }

    /// Fields written besides the common ones from now on (the common ones win a clash).
    pub fn set_detail(&mut self, detail: Map<String, Value>) {
        self.detail = detail;
    }

    /// Where the counts start and about how many will be read.
    pub fn with_counts(mut self, baseline: u64, total: Option<u64>) -> Self {
        self.baseline = baseline;
        self.total = total.filter(|t| *t > 0);
        self
    }

    /// From now on the run follows the source's changes: the counts are the changes applied.
    pub fn following(&mut self) {
        if !self.following {
            // The rate is now of changes applied, counted from here; no total, no ETA.
            self.following = true;
            self.baseline = 0;
            self.started = Instant::now();
            self.total = None;
        }
    }

    /// The local document's name (below `_local/`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The record's fields: `command`, `source`, `target`, `state` (`running`, `finished`,
    /// `interrupted`, `failed`), `phase` (`copying`, or `following` the source's changes, when
    /// the counts are the changes applied), `read`, `landed`, `skipped`, `total` (the source's estimate, or
    /// null), `rate` (documents read per second by this run), `eta_secs` (or null), `error` (or
    /// null), `pid`, `origin` (`command line` or `service`), `started_on` and `updated_on` (Unix
    /// seconds); then a whole-deployment run's `databases_done`, `databases_total` and
    /// `databases_now` (each database being worked on: `name`, `done`, `of`).
    pub fn body(&self, state: &str, counts: Counts, error: Option<&str>) -> Map<String, Value> {
        let secs = self.started.elapsed().as_secs_f64().max(1e-3);
        let rate = counts.read.saturating_sub(self.baseline) as f64 / secs;
        let eta = self
            .total
            .filter(|_| state == "running" && rate > 0.0)
            .map(|total| (total.saturating_sub(counts.read) as f64 / rate).round() as u64);
        let body = json!({
            "command": self.command,
            "source": self.source,
            "target": self.target,
            "state": state,
            "phase": if self.following { "following" } else { "copying" },
            "read": counts.read,
            "landed": counts.landed,
            "skipped": counts.skipped,
            "total": self.total,
            "rate": (rate * 10.0).round() / 10.0,
            "eta_secs": eta,
            "error": error,
            "pid": std::process::id(),
            "origin": self.origin,
            "started_on": self.started_on,
            "updated_on": chrono::Utc::now().timestamp(),
        });
        let mut body = match body {
            Value::Object(map) => map,
            _ => Map::new(),
        };
        for (name, value) in &self.detail {
            body.entry(name.clone()).or_insert_with(|| value.clone());
        }
        body
    }

    /// Writes the running record when [`RECORD_INTERVAL`] has passed since the last write (the
    /// first at once) and no write is in flight; never waits.
    pub fn update(&mut self, counts: Counts) {
        if self.last_write.is_some_and(|at| at.elapsed() < RECORD_INTERVAL) {
            return;
        }
        if self.writing.as_ref().is_some_and(|write| !write.is_finished()) {
            return;
        }
        self.last_write = Some(Instant::now());
        let (backend, name, body) = (Arc::clone(&self.backend), self.name.clone(), self.body("running", counts, None));
        self.writing = Some(tokio::spawn(async move { write(backend.as_ref(), &name, &body).await }));
    }

    /// Writes the final record, after any write in flight, and waits for it. A run that ends
    /// before its first batch (refused at the start, or with nothing to copy) leaves no record:
    /// it wrote nothing into the target, and its answer is on its own stderr.
    pub async fn close(&mut self, state: &str, counts: Counts, error: Option<&str>) {
        if self.last_write.is_none() {
            return;
        }
        if let Some(write) = self.writing.take() {
            let _ = write.await;
        }
        let body = self.body(state, counts, error);
        write(self.backend.as_ref(), &self.name, &body).await;
    }
}

async fn write(backend: &dyn DocumentBackend, name: &str, body: &Map<String, Value>) {
    if let Err(err) = backend.put_local(name, body, Precondition::None).await {
        tracing::warn!(error = %err, record = name, "cannot write the run's progress record into the target");
    }
}

/// Whether a record read back says its run is still going: `running` and written within
/// [`STALE_AFTER`]; a `running` record older than that is a run that stopped without saying so.
pub fn state_now(body: &Map<String, Value>, now: i64) -> &str {
    let state = body.get("state").and_then(Value::as_str).unwrap_or("unknown");
    let updated = body.get("updated_on").and_then(Value::as_i64).unwrap_or(0);
    if state == "running" && now.saturating_sub(updated) > STALE_AFTER.as_secs() as i64 {
        return "stopped";
    }
    state
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_running_record_not_written_for_a_minute_is_stopped() {
        let mut body = Map::new();
        body.insert("state".into(), json!("running"));
        body.insert("updated_on".into(), json!(1_000));
        assert_eq!(state_now(&body, 1_030), "running");
        assert_eq!(state_now(&body, 1_061), "stopped");
        body.insert("state".into(), json!("finished"));
        assert_eq!(state_now(&body, 9_999), "finished");
    }
}
