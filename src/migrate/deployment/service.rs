//! Whole-deployment runs started through the service rather than from the command line:
//! `POST /_agentstore/runs` (`crate::couchdb_api`, a server admin's) names a `migrate` or
//! `verify` of every database (or those selected) from a source to a target, each a backend URL
//! or a CouchDB-protocol server URL as `--from`/`--to` take them; the service runs it in its own
//! process with the command line's code ([`super::run_recorded`],
//! [`super::verify::verify_recorded`]) and keeps its progress in a run record in **its own**
//! backend ([`crate::migrate::run_record`]), which `_active_tasks` and the console's service
//! page list. docs/migration.md ("Runs started from the service") says why an endpoint.
//!
//! **One at a time per deployment.** A run holds a lease, the local document
//! `_local/`[`LEASE_NAME`] of the service's backend (owner instance, run id, expiry), taken with
//! the backend's revision precondition, renewed every [`LEASE_RENEW`] and deleted when the run
//! ends; every instance over the backend sees it, so a second start anywhere is refused (409)
//! while it is live. A lease not renewed for [`LEASE_TTL`] (its instance killed) is free again.
//!
//! **Cancelling.** `DELETE /_agentstore/runs/{id}` stops a run of this instance at once, and a
//! run of another instance by writing `cancel` into the lease, which its owner reads at its next
//! renewal: the move stops after the page in hand, as SIGTERM stops the command (its record then
//! says `interrupted`), a comparison before its next page.
//!
//! **Credentials.** The URLs may carry a password; they are used, never kept or answered: the
//! record, the lease and every answer name the sides as [`Side::name`] does (no credentials).
//!
//! **Checkpoints** go to a directory of the run's own under the system's temporary directory,
//! removed when the run ends: a run started again starts over, which costs little, since a
//! target already holding a leaf is not sent it again (`_revs_diff`).

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde_json::{json, Map, Value};

use super::verify::VerifyRun;
use super::{MoveOptions, Selection, Side};
use crate::backend::{BackendUrl, DocumentBackend, Precondition, Revision};
use crate::config::Settings;
use crate::database::Databases;
use crate::error::{Error, ErrorKind, Result};
use crate::migrate::follow::FollowMode;
use crate::migrate::progress::ProgressMode;
use crate::migrate::run_record::RunRecord;

/// The lease's local-document name (below `_local/`); `:` first, as the run records', so no
/// per-user login's `_local_docs` lists it.
pub const LEASE_NAME: &str = ":runs:lease";
/// How long a lease not renewed stays held.
pub const LEASE_TTL: Duration = Duration::from_secs(30);
/// How often a running run renews its lease (and reads whether it was cancelled elsewhere).
pub const LEASE_RENEW: Duration = Duration::from_secs(5);
/// Most bytes of a source or target URL.
pub const MAX_URL_BYTES: usize = 2048;
/// Most names or patterns in `db` and in `exclude`.
pub const MAX_PATTERNS: usize = 100;

/// What a run does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunCommand {
    /// `migrate --all-databases`.
    Migrate,
    /// `verify --all-databases`.
    Verify,
}

impl RunCommand {
    pub fn as_str(self) -> &'static str {
        match self {
            RunCommand::Migrate => "migrate",
            RunCommand::Verify => "verify",
        }
    }
}

/// A run asked for: the command, its two sides as given (credentials included: never kept),
/// and the command line's options that make sense in a service.
#[derive(Debug, Clone)]
pub struct RunRequest {
    pub command: RunCommand,
    pub source: String,
    pub target: String,
    pub selection: Selection,
    /// `migrate` only: follow the source's changes until cancelled (`--follow`).
    pub follow: bool,
    /// `migrate` only: compare the two sides when the copy ends (no `--no-verify`).
    pub verify: bool,
}

impl RunRequest {
    /// Reads a request body: `command` (`migrate` or `verify`), `source`, `target`, and
    /// optionally `db` and `exclude` (lists of names or patterns, as `--db` and `--exclude`),
    /// `follow` and `verify` (booleans, `migrate` only). Anything else is refused, so a
    /// misspelt option is not silently ignored.
    pub fn parse(body: &Map<String, Value>) -> Result<Self> {
        for name in body.keys() {
            if !["command", "source", "target", "db", "exclude", "follow", "verify"].contains(&name.as_str()) {
                return Err(Error::invalid(name, format!("unknown field `{name}`")));
            }
        }
        let command = match body.get("command").and_then(Value::as_str) {
            Some("migrate") => RunCommand::Migrate,
            Some("verify") => RunCommand::Verify,
            _ => return Err(Error::invalid("command", "`command` must be \"migrate\" or \"verify\"")),
        };
        let url = |field: &str| -> Result<String> {
            let text = body.get(field).and_then(Value::as_str).unwrap_or_default();
            if text.is_empty() {
                return Err(Error::invalid(field, format!("`{field}` must be a backend or server URL")));
            }
            if text.len() > MAX_URL_BYTES {
                return Err(Error::invalid(field, format!("`{field}` is longer than {MAX_URL_BYTES} bytes")));
            }
            Ok(text.to_owned())
        };
        let patterns = |field: &str| -> Result<Vec<String>> {
            let Some(value) = body.get(field) else { return Ok(Vec::new()) };
            let list = value.as_array().filter(|list| list.iter().all(Value::is_string)).ok_or_else(|| {
                Error::invalid(field, format!("`{field}` must be a list of database names or patterns"))
            })?;
            if list.len() > MAX_PATTERNS {
                return Err(Error::invalid(field, format!("`{field}` names more than {MAX_PATTERNS}")));
            }
            Ok(list.iter().filter_map(Value::as_str).map(str::to_owned).collect())
        };
        let flag = |field: &str, default: bool| -> Result<bool> {
            match body.get(field) {
                None => Ok(default),
                Some(Value::Bool(value)) => Ok(*value),
                Some(_) => Err(Error::invalid(field, format!("`{field}` must be a boolean"))),
            }
        };
        let (follow, verify) = (flag("follow", false)?, flag("verify", true)?);
        if command == RunCommand::Verify && (body.contains_key("follow") || body.contains_key("verify")) {
            return Err(Error::invalid("follow", "`follow` and `verify` are options of `migrate`"));
        }
        Ok(RunRequest {
            command,
            source: url("source")?,
            target: url("target")?,
            selection: Selection { include: patterns("db")?, exclude: patterns("exclude")? },
            follow,
            verify,
        })
    }
}

/// How a start ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Started {
    /// The run started with this id (its record is `_local/:run:{id}`).
    Run(String),
    /// A run of the deployment is going (this id; `None` when its lease names none).
    Busy(Option<String>),
}

/// The run this instance is running.
struct Running {
    id: String,
    cancel: tokio::sync::watch::Sender<bool>,
}

/// The runs the service starts: at most one per deployment, this instance's in hand.
pub struct ServiceRuns {
    /// The service's backend: the lease and the records are local documents there.
    backend: Arc<dyn DocumentBackend>,
    /// The service's own databases, for a side naming the service's own backend (opening its
    /// embedded files a second time in this process would fail).
    databases: Arc<Databases>,
    settings: Settings,
    /// This instance's name in the lease.
    instance: String,
    running: Mutex<Option<Running>>,
    /// Turns true when the service shuts down: a run stops as if cancelled.
    stopping: tokio::sync::watch::Receiver<bool>,
}

impl ServiceRuns {
    pub fn new(
        backend: Arc<dyn DocumentBackend>,
        databases: Arc<Databases>,
        settings: &Settings,
        stopping: tokio::sync::watch::Receiver<bool>,
    ) -> Result<Arc<Self>> {
        Ok(Arc::new(ServiceRuns {
            backend,
            databases,
            settings: settings.clone(),
            instance: format!("agentstore-{}", random_hex(6)?),
            running: Mutex::new(None),
            stopping,
        }))
    }

    fn running(&self) -> std::sync::MutexGuard<'_, Option<Running>> {
        self.running.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The side `text` names; the service's own backend is its own databases.
    fn side(&self, field: &str, text: &str) -> Result<Side> {
        let refuse = |err: Error| Error::invalid(field, format!("`{field}`: {}", err.message()));
        if !(text.starts_with("http://") || text.starts_with("https://")) {
            let url = self.settings.resolve_backend_url(text).map_err(refuse)?;
            let own = self.databases.source().map(ToString::to_string);
            if !matches!(url, BackendUrl::CouchDb(_)) && own.as_deref() == Some(url.to_string().as_str()) {
                return Ok(Side::local(Arc::clone(&self.databases), url.to_string()));
            }
        }
        Side::parse(text, &self.settings).map_err(refuse)
    }

    /// Opens the two sides, checks both answer and differ, takes the deployment's lease and
    /// starts the run in a task of its own.
    pub async fn start(self: &Arc<Self>, request: RunRequest) -> Result<Started> {
        let source = self.side("source", &request.source)?;
        let target = self.side("target", &request.target)?;
        if source.name() == target.name() {
            return Err(Error::invalid("target", format!("source and target are the same ({})", source.name())));
        }
        for (side, named) in [(&source, "source"), (&target, "target")] {
            side.check().await.map_err(|err| {
                Error::new(err.kind(), format!("{named} {}: {}", side.name(), err.message())).with_source(err)
            })?;
        }
        let id = format!("{}-{}-{}", request.command.as_str(), chrono::Utc::now().timestamp(), random_hex(4)?);
        if let Err(holder) = self.take_lease(&id).await? {
            return Ok(Started::Busy(holder));
        }
        let (cancel, cancelled) = tokio::sync::watch::channel(false);
        *self.running() = Some(Running { id: id.clone(), cancel });
        let record =
            RunRecord::new(Arc::clone(&self.backend), request.command.as_str(), &source.name(), &target.name())
                .with_id(&id)
                .started_by_service();
        let runs = Arc::clone(self);
        let run_id = id.clone();
        tokio::spawn(async move {
            let keeper = tokio::spawn(Arc::clone(&runs).keep_lease(run_id.clone()));
            let outcome = runs.run(request, source, target, record, cancelled, &run_id).await;
            if let Err(err) = outcome {
                tracing::warn!(run = %run_id, error = %err, "a run started through the service failed");
            }
            keeper.abort();
            runs.release_lease(&run_id).await;
            let mut running = runs.running();
            if running.as_ref().is_some_and(|r| r.id == run_id) {
                *running = None;
            }
        });
        Ok(Started::Run(id))
    }

    /// Runs the command to its end, its record kept by the command's own code.
    async fn run(
        &self,
        request: RunRequest,
        source: Side,
        target: Side,
        record: RunRecord,
        cancelled: tokio::sync::watch::Receiver<bool>,
        id: &str,
    ) -> Result<()> {
        let checkpoint = checkpoint_dir(id);
        let stop = {
            let (mut cancelled, mut stopping) = (cancelled.clone(), self.stopping.clone());
            Box::pin(async move {
                tokio::select! {
                    _ = cancelled.wait_for(|raised| *raised) => {}
                    _ = stopping.wait_for(|raised| *raised) => {}
                }
            })
        };
        let outcome = match request.command {
            RunCommand::Migrate => {
                let options = MoveOptions {
                    selection: request.selection,
                    checkpoint: Some(checkpoint.clone()),
                    restart: true,
                    follow: if request.follow { FollowMode::Forever } else { FollowMode::Off },
                    verify: request.verify,
                    progress: ProgressMode::None,
                    ..MoveOptions::default()
                };
                super::run_recorded(source, target, options, stop, Some(record)).await.map(|_| ())
            }
            RunCommand::Verify => {
                let names: Vec<String> =
                    source.list().await?.into_iter().filter(|name| request.selection.admits(name)).collect();
                let run = VerifyRun {
                    batch: crate::migrate::DEFAULT_BATCH_SIZE,
                    max_ids: 20,
                    progress: ProgressMode::None,
                    record: Some(record),
                    stop: Some(crate::migrate::follow::StopFlag::new(stop)),
                };
                super::verify::verify_recorded(&source, &target, &names, run).await.map(|_| ())
            }
        };
        if checkpoint.exists() {
            if let Err(err) = std::fs::remove_dir_all(&checkpoint) {
                tracing::debug!(error = %err, "a service run's checkpoint directory was not removed");
            }
        }
        outcome
    }

    /// Stops the run `id`: this instance's at once, another instance's through its lease.
    /// `false` when no live run of the deployment has that id.
    pub async fn cancel(&self, id: &str) -> Result<bool> {
        if let Some(running) = self.running().as_ref().filter(|r| r.id == id) {
            let _ = running.cancel.send(true);
            return Ok(true);
        }
        let Some(stored) = self.backend.get_local(LEASE_NAME).await? else { return Ok(false) };
        if !lease_is_live(&stored.body) || stored.body.get("run").and_then(Value::as_str) != Some(id) {
            return Ok(false);
        }
        let mut body = stored.body.clone();
        body.insert("cancel".into(), json!(true));
        match self.backend.put_local(LEASE_NAME, &body, Precondition::MatchRevision(stored.rev)).await {
            Ok(_) => Ok(true),
            // Renewed meanwhile by its owner: asked again, the cancel lands on the new revision.
            Err(err) if err.kind() == ErrorKind::Conflict => Box::pin(self.cancel(id)).await,
            Err(err) => Err(err),
        }
    }

    /// Takes the deployment's lease for run `id`: its revision, or who holds it.
    async fn take_lease(&self, id: &str) -> Result<std::result::Result<Revision, Option<String>>> {
        let current = self.backend.get_local(LEASE_NAME).await?;
        let precondition = match &current {
            None => Precondition::MustNotExist,
            Some(stored) if lease_is_live(&stored.body) => {
                return Ok(Err(stored.body.get("run").and_then(Value::as_str).map(str::to_owned)));
            }
            Some(stored) => Precondition::MatchRevision(stored.rev.clone()),
        };
        match self.backend.put_local(LEASE_NAME, &self.lease_body(id), precondition).await {
            Ok(rev) => Ok(Ok(rev)),
            Err(err) if err.kind() == ErrorKind::Conflict => Ok(Err(None)),
            Err(err) => Err(err),
        }
    }

    fn lease_body(&self, id: &str) -> Map<String, Value> {
        let expires = chrono::Utc::now().timestamp_millis() + LEASE_TTL.as_millis() as i64;
        let mut body = Map::new();
        body.insert("owner".into(), json!(self.instance));
        body.insert("run".into(), json!(id));
        body.insert("expires_ms".into(), json!(expires));
        body
    }

    /// Renews the lease every [`LEASE_RENEW`] until aborted, over the revision read each time;
    /// stops the run when the lease says `cancel` or is lost (no longer this run's and this
    /// instance's: another took it, and this one must not go on).
    async fn keep_lease(self: Arc<Self>, id: String) {
        loop {
            tokio::time::sleep(LEASE_RENEW).await;
            let stored = match self.backend.get_local(LEASE_NAME).await {
                Ok(stored) => stored,
                Err(err) => {
                    tracing::warn!(run = %id, error = %err, "cannot read the run's lease; tried again later");
                    continue;
                }
            };
            // Still this run's and this instance's (a cancel from elsewhere rewrote it: a new
            // revision, the same run).
            let ours = stored.as_ref().filter(|s| {
                s.body.get("run").and_then(Value::as_str) == Some(id.as_str())
                    && s.body.get("owner").and_then(Value::as_str) == Some(self.instance.as_str())
            });
            let cancel = ours.is_some_and(|s| s.body.get("cancel") == Some(&Value::Bool(true)));
            let rev = match ours {
                Some(stored) if !cancel => stored.rev.clone(),
                _ => {
                    if ours.is_none() {
                        tracing::warn!(run = %id, "the run's lease was lost; the run stops here");
                    }
                    if let Some(running) = self.running().as_ref().filter(|r| r.id == id) {
                        let _ = running.cancel.send(true);
                    }
                    return;
                }
            };
            match self.backend.put_local(LEASE_NAME, &self.lease_body(&id), Precondition::MatchRevision(rev)).await {
                Ok(_) => {}
                // Cancelled (or taken) between the read and the write: the next round reads it.
                Err(err) if err.kind() == ErrorKind::Conflict => {}
                Err(err) => tracing::warn!(run = %id, error = %err, "cannot renew the run's lease; tried again later"),
            }
        }
    }

    /// Gives the lease up when it still names run `id` (a failure leaves it to expire).
    async fn release_lease(&self, id: &str) {
        let Ok(Some(stored)) = self.backend.get_local(LEASE_NAME).await else { return };
        if stored.body.get("run").and_then(Value::as_str) != Some(id) {
            return;
        }
        if let Err(err) = self.backend.delete_local(LEASE_NAME, &stored.rev).await {
            tracing::debug!(run = %id, error = %err, "a run's lease was not released; it expires");
        }
    }
}

/// Whether a lease read back is still held.
fn lease_is_live(body: &Map<String, Value>) -> bool {
    let expires = body.get("expires_ms").and_then(Value::as_i64).unwrap_or(0);
    expires > chrono::Utc::now().timestamp_millis()
}

/// A run's own checkpoint directory.
fn checkpoint_dir(id: &str) -> PathBuf {
    std::env::temp_dir().join(format!("agentstore-run-{}-{id}", std::process::id()))
}

/// `bytes` random bytes as hex.
fn random_hex(bytes: usize) -> Result<String> {
    let mut buffer = vec![0u8; bytes];
    getrandom::fill(&mut buffer).map_err(|e| Error::new(ErrorKind::Internal, format!("no random run id: {e}")))?;
    Ok(hex::encode(buffer))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(value: Value) -> Map<String, Value> {
        value.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn a_request_names_a_command_two_sides_and_known_options_only() {
        let request = RunRequest::parse(&body(json!({
            "command": "migrate", "source": "http://a/", "target": "embedded:///tmp/x.redb",
            "db": ["app-*"], "exclude": ["_users"], "follow": true
        })))
        .unwrap();
        assert_eq!(request.command, RunCommand::Migrate);
        assert_eq!(request.selection.include, ["app-*"]);
        assert!(request.follow && request.verify);
        for wrong in [
            json!({ "command": "copy", "source": "http://a/", "target": "http://b/" }),
            json!({ "command": "migrate", "target": "http://b/" }),
            json!({ "command": "migrate", "source": "http://a/", "target": "http://b/", "folow": true }),
            json!({ "command": "verify", "source": "http://a/", "target": "http://b/", "follow": true }),
            json!({ "command": "migrate", "source": "http://a/", "target": "http://b/", "db": "app" }),
            json!({ "command": "migrate", "source": "x".repeat(MAX_URL_BYTES + 1), "target": "http://b/" }),
        ] {
            assert!(RunRequest::parse(&body(wrong.clone())).is_err(), "{wrong}");
        }
    }

    /// A database `notes` with `count` documents among `databases`.
    async fn notes_with(databases: &Databases, count: usize) {
        let db = databases.create(&crate::backend::catalog::DbName::parse("notes").unwrap()).await.unwrap();
        for i in 0..count {
            let write = crate::database::Write::Edit { parent: None, deleted: false, body: body(json!({ "n": i })) };
            db.write(&format!("doc-{i}"), &write).await.unwrap();
        }
    }

    /// The record of run `id` once `wanted` accepts it (waiting up to 20 s).
    async fn record_of(
        backend: &dyn DocumentBackend,
        id: &str,
        wanted: impl Fn(&Map<String, Value>) -> bool,
    ) -> Map<String, Value> {
        let name = format!("{}{id}", crate::migrate::run_record::RUN_RECORD_PREFIX);
        for _ in 0..200 {
            if let Some(stored) = backend.get_local(&name).await.unwrap() {
                if wanted(&stored.body) {
                    return stored.body;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("run {id}'s record never reached the state wanted: {:?}", backend.get_local(&name).await);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_run_holds_the_deployment_records_its_progress_and_is_cancelled() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("agentstore.toml");
        std::fs::write(&config, "").unwrap();
        let settings = Settings::load(Some(&config), &crate::config::Overrides::default()).unwrap();
        let service_url: BackendUrl =
            format!("embedded:{}", dir.path().join("service.redb").display()).parse().unwrap();
        let backend = crate::backend::open(&service_url).await.unwrap();
        let databases = Arc::new(Databases::from_url(Some(service_url.clone()), 16));
        notes_with(&databases, 30).await;
        let (_stopping, stopped) = tokio::sync::watch::channel(false);
        let runs = ServiceRuns::new(Arc::clone(&backend), databases, &settings, stopped).unwrap();
        let target = format!("embedded:{}", dir.path().join("target.redb").display());
        let request = |follow: bool| RunRequest {
            command: RunCommand::Migrate,
            // The service's own backend: its own databases, not a second opening of its files.
            source: service_url.to_string(),
            target: target.clone(),
            selection: Selection::default(),
            follow,
            verify: true,
        };

        // A plain move: recorded to its end, verified; the lease given back.
        let Started::Run(id) = runs.start(request(false)).await.unwrap() else { panic!("not started") };
        let finished = record_of(backend.as_ref(), &id, |r| r["state"] == "finished").await;
        assert_eq!(finished["read"], json!(30), "{finished:?}");
        assert_eq!(finished["origin"], json!("service"));
        assert_eq!((finished["databases_done"].clone(), finished["databases_total"].clone()), (json!(1), json!(1)));
        assert_eq!(finished["passed"], json!(true), "{finished:?}");
        for _ in 0..50 {
            if backend.get_local(LEASE_NAME).await.unwrap().is_none() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(backend.get_local(LEASE_NAME).await.unwrap().is_none(), "the lease was not given back");

        // A following move runs until cancelled; another start meanwhile is refused.
        let Started::Run(id) = runs.start(request(true)).await.unwrap() else { panic!("not started") };
        record_of(backend.as_ref(), &id, |r| r["state"] == "running").await;
        assert_eq!(runs.start(request(false)).await.unwrap(), Started::Busy(Some(id.clone())));
        assert!(!runs.cancel("no-such-run").await.unwrap());
        assert!(runs.cancel(&id).await.unwrap());
        record_of(backend.as_ref(), &id, |r| r["state"] == "interrupted").await;

        // Another instance over the same backend: refused while a run goes, and its cancel
        // reaches the running instance through the lease (at its next renewal).
        let (_stopping, stopped) = tokio::sync::watch::channel(false);
        let databases = Arc::new(Databases::from_url(Some(service_url.clone()), 16));
        let other = ServiceRuns::new(Arc::clone(&backend), databases, &settings, stopped).unwrap();
        // The lease of the run cancelled above is given back just after its record is written.
        let mut started = None;
        for _ in 0..100 {
            match runs.start(request(true)).await.unwrap() {
                Started::Run(id) => {
                    started = Some(id);
                    break;
                }
                Started::Busy(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        let id = started.expect("the cancelled run's lease was never given back");
        record_of(backend.as_ref(), &id, |r| r["state"] == "running").await;
        assert_eq!(other.start(request(false)).await.unwrap(), Started::Busy(Some(id.clone())));
        assert!(other.cancel(&id).await.unwrap());
        record_of(backend.as_ref(), &id, |r| r["state"] == "interrupted").await;
    }

    #[test]
    fn a_lease_is_live_until_it_expires() {
        let now = chrono::Utc::now().timestamp_millis();
        assert!(lease_is_live(&body(json!({ "expires_ms": now + 10_000 }))));
        assert!(!lease_is_live(&body(json!({ "expires_ms": now - 1 }))));
        assert!(!lease_is_live(&Map::new()));
    }
}
