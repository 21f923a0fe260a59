//! Moving a whole deployment: every database of a source (a backend's databases, or a
//! CouchDB-protocol server) to a target of either kind, with every leaf of every document's
//! revision tree (deleted leaves too, ancestry as the source keeps it), attachments byte for byte,
//! design documents, `_security` and `_revs_limit`; resumably, and live (`--follow`).
//! `agentstore migrate --all-databases` / `--db` and `verify --all-databases` are built on it
//! (docs/migration.md, "Moving a whole deployment").
//!
//! **How one database is copied.** The replication protocol's loop, with each end a [`Side`]:
//! read a page of the source feed with every leaf (`style=all_docs`); ask the target which of
//! those leaves it lacks (`_revs_diff`); read those leaves from the source with their ancestry
//! and attachment bytes (`_bulk_get?revs=true&attachments=true`); write them to the target as
//! replicated revisions (`new_edits: false`); then record the feed position after the page in
//! the database's checkpoint. While a page is written the next one is read.
//!
//! **Crashes.** A checkpoint moves only after its page is written, so after `kill -9` the pages
//! since are read again; the target then lacks nothing of what was written (`_revs_diff`), and a
//! leaf written twice is merged as already known. Nothing is missing, nothing is duplicated.
//!
//! **Local documents** (`_local/…`) are not copied: they are other peers' replication
//! checkpoints, naming positions in the *source's* feeds, which mean nothing in the target's;
//! a peer that found them at the target would skip changes. CouchDB's replicator does not copy
//! them either. Peers start a new checkpoint against the new endpoint.
//!
//! **Following.** With `--follow`, passes over every selected source database repeat (each
//! database's feed from its own checkpoint) until SIGINT/SIGTERM; the list of databases is read
//! again each pass, so one created at the source meanwhile is created and copied. A database that
//! has a checkpoint but is gone from the source is reported; it is deleted at the target only
//! with `--delete-missing`. `--until-caught-up` makes one more pass after the copy and stops.

pub mod archive;
pub mod checkpoint;
pub mod side;
pub mod verify;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde::Serialize;
use serde_json::{Map, Value};

use super::follow::{FollowMode, StopFlag, StopSignal};
use super::progress::ProgressMode;
use crate::backend::catalog::DbName;
use crate::error::{Error, Result};
use crate::replication_client::FeedPage;
use checkpoint::{Checkpoints, Counts, DbCheckpoint, MoveIdentity};
pub use side::Side;
use verify::VerifyReport;

/// Databases copied at once by default.
pub const DEFAULT_DATABASES_AT_ONCE: usize = 4;
/// The pause between two passes of `--follow` that found nothing to do.
const POLL_INTERVAL: Duration = Duration::from_millis(500);
/// How often progress is printed.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(2);

/// What `local_documents` says in every report.
pub const LOCAL_DOCUMENTS: &str = "not copied: they are peers' replication checkpoints, naming positions in the \
                                   source's feeds that mean nothing at the target (CouchDB's replicator does not \
                                   copy them either)";

/// Which databases a move takes: every one (but CouchDB's system databases, `_users`,
/// `_replicator`, …, which hold the server's configuration, and names no backend here takes),
/// or those matching `include` (exact names, or patterns with `*` and `?`), less those matching
/// `exclude`.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    pub include: Vec<String>,
    pub exclude: Vec<String>,
}

impl Selection {
    pub fn admits(&self, name: &str) -> bool {
        if name.starts_with('_') || DbName::parse(name).is_err() {
            return false;
        }
        (self.include.is_empty() || self.include.iter().any(|p| matches(p, name)))
            && !self.exclude.iter().any(|p| matches(p, name))
    }
}

/// Whether `name` matches `pattern` (`*`: any run of characters, `?`: any one).
pub fn matches(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    // Classic wildcard matching with one backtrack point (the last `*`).
    let (mut pi, mut ni, mut star, mut mark) = (0usize, 0usize, None::<usize>, 0usize);
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ni;
            pi += 1;
        } else if let Some(at) = star {
            pi = at + 1;
            mark += 1;
            ni = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

/// How a move runs.
#[derive(Debug, Clone)]
pub struct MoveOptions {
    pub selection: Selection,
    /// Changes per feed page (and leaves per read and write, about).
    pub batch_size: usize,
    /// Databases copied at once.
    pub databases_at_once: usize,
    /// The checkpoint directory; default [`Checkpoints::default_dir`].
    pub checkpoint: Option<PathBuf>,
    pub restart: bool,
    pub follow: FollowMode,
    /// Delete at the target a database deleted at the source (never without it).
    pub delete_missing: bool,
    /// Compare the two sides when the move ends ([`verify::verify`]).
    pub verify: bool,
    pub progress: ProgressMode,
    /// Failed leaves and differences named per database in the report.
    pub max_issues: usize,
}

impl Default for MoveOptions {
    fn default() -> Self {
        MoveOptions {
            selection: Selection::default(),
            batch_size: super::DEFAULT_BATCH_SIZE,
            databases_at_once: DEFAULT_DATABASES_AT_ONCE,
            checkpoint: None,
            restart: false,
            follow: FollowMode::Off,
            delete_missing: false,
            verify: true,
            progress: ProgressMode::None,
            max_issues: 20,
        }
    }
}

/// How a move ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MoveStatus {
    /// Every selected database copied (and followed, when asked, until stopped or caught up).
    Complete,
    /// SIGINT/SIGTERM stopped the copy before every database was copied; the same command resumes.
    Interrupted,
    /// `--follow` ended by SIGINT/SIGTERM after the copy (its normal end).
    Stopped,
}

/// One database in the report.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DbReport {
    pub name: String,
    /// Whether this run created it at the target.
    pub created: bool,
    /// Whether the source feed was read to its end (by this run or one before).
    pub copied: bool,
    /// The settings copied: `_security` and, where the source knows it, `_revs_limit`.
    pub security: Value,
    pub revs_limit: Option<u64>,
    /// This run's work.
    pub this_run: Counts,
    /// Every run's work.
    pub all_runs: Counts,
    /// The first leaves the target refused.
    pub failures: Vec<Value>,
}

/// The final report of a move.
#[derive(Debug, Clone, Serialize)]
pub struct MoveReport {
    pub command: &'static str,
    pub mode: &'static str,
    pub from: String,
    pub to: String,
    pub status: MoveStatus,
    pub checkpoint: String,
    pub elapsed_seconds: f64,
    /// Passes over the databases (1 for a plain copy; more when following).
    pub passes: u64,
    pub databases: Vec<DbReport>,
    pub totals: Counts,
    /// Changed documents read per second over this run.
    pub docs_per_second: f64,
    /// Databases this move copied that the source no longer has.
    pub deleted_at_source: Vec<String>,
    /// Of those, the ones deleted at the target (`--delete-missing`).
    pub deleted_at_target: Vec<String>,
    pub local_documents: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verification: Option<VerifyReport>,
    pub peak_rss_bytes: Option<u64>,
}

impl MoveReport {
    /// 8 interrupted, 6 the read-back found a difference, 7 leaves were refused, else 0.
    pub fn exit_code(&self) -> u8 {
        if self.status == MoveStatus::Interrupted {
            super::EXIT_INTERRUPTED
        } else if self.verification.as_ref().is_some_and(|v| !v.passed) {
            super::EXIT_DIFFERENT
        } else if self.totals.failed > 0 {
            super::EXIT_INCOMPLETE
        } else {
            0
        }
    }
}

/// Progress of the whole move: per database and overall, with a rate and an ETA.
struct Board {
    mode: ProgressMode,
    started: Instant,
    /// Documents the source feeds are expected to hold past the checkpoints, as estimated.
    expected: AtomicU64,
    done: AtomicU64,
    /// Databases being copied: documents done and expected.
    active: Mutex<BTreeMap<String, (u64, u64)>>,
    finished_dbs: AtomicU64,
    selected_dbs: AtomicU64,
}

impl Board {
    fn line(&self) -> String {
        let done = self.done.load(Ordering::Relaxed);
        let expected = self.expected.load(Ordering::Relaxed).max(done);
        let seconds = self.started.elapsed().as_secs_f64().max(0.001);
        let rate = done as f64 / seconds;
        let eta = if rate > 0.0 && expected > done {
            format!("{:.0}s", (expected - done) as f64 / rate)
        } else {
            "-".to_owned()
        };
        let active: Vec<String> = match self.active.lock() {
            Ok(active) => active.iter().map(|(name, (done, of))| format!("{name} {done}/{of}")).collect(),
            Err(_) => Vec::new(),
        };
        format!(
            "migrate: databases {}/{} done; documents {done}/{expected}; {rate:.0} docs/s; ETA {eta}; copying: {}",
            self.finished_dbs.load(Ordering::Relaxed),
            self.selected_dbs.load(Ordering::Relaxed),
            if active.is_empty() { "-".to_owned() } else { active.join(", ") }
        )
    }

    fn advance(&self, db: &str, docs: u64) {
        self.done.fetch_add(docs, Ordering::Relaxed);
        if let Ok(mut active) = self.active.lock() {
            if let Some(entry) = active.get_mut(db) {
                entry.0 += docs;
            }
        }
    }
}

/// One page read from the source and what of it the target lacks.
struct Fetched {
    page: FeedPage,
    leaves: Vec<Map<String, Value>>,
}

/// Runs a move until it is done, stopped by `stop`, or (following forever) stopped.
pub async fn run(source: Side, target: Side, options: MoveOptions, stop: StopSignal) -> Result<MoveReport> {
    let started = Instant::now();
    let identity = MoveIdentity { format: checkpoint::FORMAT, from: source.name(), to: target.name() };
    let dir = options.checkpoint.clone().unwrap_or_else(|| Checkpoints::default_dir(&identity.from, &identity.to));
    let checkpoints = Checkpoints::open(&dir, &identity, options.restart)?;
    let stop = StopFlag::new(stop);
    let board = Arc::new(Board {
        mode: options.progress,
        started,
        expected: AtomicU64::new(0),
        done: AtomicU64::new(0),
        active: Mutex::new(BTreeMap::new()),
        finished_dbs: AtomicU64::new(0),
        selected_dbs: AtomicU64::new(0),
    });
    let ticker = (options.progress != ProgressMode::None).then(|| {
        let board = Arc::clone(&board);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(PROGRESS_INTERVAL).await;
                if board.mode != ProgressMode::None {
                    eprintln!("{}", board.line());
                }
            }
        })
    });
    let mut mover = Mover {
        source,
        target,
        options,
        checkpoints,
        stop,
        board: Arc::clone(&board),
        reports: BTreeMap::new(),
        deleted_at_source: Vec::new(),
        deleted_at_target: Vec::new(),
        passes: 0,
    };
    let outcome = mover.run_passes().await;
    if let Some(ticker) = ticker {
        ticker.abort();
    }
    let status = outcome?;
    if mover.options.progress != ProgressMode::None {
        eprintln!("{}", board.line());
    }
    // Following forever ends at a signal (`Stopped`) while the source may still be written:
    // nothing to compare then.
    let verification = if status == MoveStatus::Complete && mover.options.verify {
        let names: Vec<String> = mover.reports.keys().cloned().collect();
        Some(
            verify::verify(&mover.source, &mover.target, &names, mover.options.batch_size, mover.options.max_issues)
                .await?,
        )
    } else {
        None
    };
    let mut totals = Counts::default();
    for report in mover.reports.values() {
        totals.add(&report.this_run);
    }
    let elapsed = started.elapsed().as_secs_f64();
    Ok(MoveReport {
        command: "migrate",
        mode: "databases",
        from: mover.source.name(),
        to: mover.target.name(),
        status,
        checkpoint: dir.display().to_string(),
        elapsed_seconds: (elapsed * 1000.0).round() / 1000.0,
        passes: mover.passes,
        databases: mover.reports.into_values().collect(),
        docs_per_second: (totals.docs_seen as f64 / elapsed.max(0.001)).round(),
        totals,
        deleted_at_source: mover.deleted_at_source,
        deleted_at_target: mover.deleted_at_target,
        local_documents: LOCAL_DOCUMENTS,
        verification,
        peak_rss_bytes: super::report::peak_rss_bytes(),
    })
}

struct Mover {
    source: Side,
    target: Side,
    options: MoveOptions,
    checkpoints: Checkpoints,
    stop: StopFlag,
    board: Arc<Board>,
    reports: BTreeMap<String, DbReport>,
    deleted_at_source: Vec<String>,
    deleted_at_target: Vec<String>,
    passes: u64,
}

impl Mover {
    /// The copy pass, then following as asked.
    async fn run_passes(&mut self) -> Result<MoveStatus> {
        if !self.pass().await? {
            return Ok(MoveStatus::Interrupted);
        }
        match self.options.follow {
            FollowMode::Off => {}
            FollowMode::UntilCaughtUp => {
                // The copy pass read every feed to its end after this run began: one more pass
                // takes what came during the copy and databases created meanwhile.
                if !self.pass().await? {
                    return Ok(MoveStatus::Interrupted);
                }
            }
            FollowMode::Forever => loop {
                let mut stop = self.stop.clone();
                tokio::select! {
                    _ = stop.raised() => return Ok(MoveStatus::Stopped),
                    _ = tokio::time::sleep(POLL_INTERVAL) => {}
                }
                if !self.pass().await? {
                    return Ok(MoveStatus::Stopped);
                }
            },
        }
        Ok(MoveStatus::Complete)
    }

    /// One pass over every selected database; `false` when stopped before it ended.
    async fn pass(&mut self) -> Result<bool> {
        self.passes += 1;
        let first = self.passes == 1;
        let names: Vec<String> =
            self.source.list().await?.into_iter().filter(|name| self.options.selection.admits(name)).collect();
        self.board.selected_dbs.store(names.len() as u64, Ordering::Relaxed);
        self.board.finished_dbs.store(0, Ordering::Relaxed);
        for known in self.checkpoints.known()? {
            if names.contains(&known) || !self.options.selection.admits(&known) {
                continue;
            }
            if !self.deleted_at_source.contains(&known) {
                tracing::warn!(database = %known, "the database is gone from the source");
                self.deleted_at_source.push(known.clone());
            }
            if self.options.delete_missing && !self.deleted_at_target.contains(&known) {
                self.target.delete(&known).await?;
                self.checkpoints.remove(&known)?;
                self.deleted_at_target.push(known);
            }
        }
        let this = &*self;
        let results: Vec<(String, Result<(DbReport, bool)>)> = futures::stream::iter(names)
            .map(|name| async move {
                let result = this.copy_database(&name, first).await;
                (name, result)
            })
            .buffer_unordered(this.options.databases_at_once.max(1))
            .collect()
            .await;
        let mut complete = true;
        for (name, result) in results {
            let (report, finished) = result.map_err(|err| {
                Error::new(err.kind(), format!("database {name:?}: {}", err.message())).with_source(err)
            })?;
            complete &= finished;
            match self.reports.get_mut(&name) {
                Some(existing) => {
                    existing.created |= report.created;
                    existing.copied = report.copied;
                    existing.this_run.add(&report.this_run);
                    existing.all_runs = report.all_runs;
                    let room = self.options.max_issues.saturating_sub(existing.failures.len());
                    existing.failures.extend(report.failures.into_iter().take(room));
                }
                None => {
                    self.reports.insert(name, report);
                }
            }
        }
        Ok(complete)
    }

    /// Reads one page from the source and what of it the target lacks.
    async fn fetch(&self, db: &str, since: &Value) -> Result<Fetched> {
        let page = self.source.changes(db, since, self.options.batch_size).await?;
        if page.docs.is_empty() {
            return Ok(Fetched { page, leaves: Vec::new() });
        }
        let wanted: Vec<(String, Vec<String>)> = page.docs.iter().map(|d| (d.id.clone(), d.leaves.clone())).collect();
        let missing = self.target.missing(db, &wanted).await?;
        let leaves = self.source.read_leaves(db, &missing, true).await?;
        Ok(Fetched { page, leaves })
    }

    /// Copies one database from its checkpoint to the end of its source feed; the report of this
    /// pass and whether it got to the end (not stopped).
    async fn copy_database(&self, db: &str, first: bool) -> Result<(DbReport, bool)> {
        let mut state: DbCheckpoint = self.checkpoints.load(db)?;
        let mut report = DbReport { name: db.to_owned(), ..DbReport::default() };
        if first || !state.prepared {
            report.created = self.target.ensure(db).await?;
            let settings = self.source.settings(db).await?;
            self.target.put_settings(db, &settings).await?;
            report.security = settings.security;
            report.revs_limit = settings.revs_limit;
            state.prepared = true;
            self.checkpoints.save(db, &state)?;
        }
        let expected = match state.copied {
            true => 0,
            false => self.source.estimate(db).await?.unwrap_or(0).saturating_sub(state.counts.docs_seen),
        };
        self.board.expected.fetch_add(expected, Ordering::Relaxed);
        if let Ok(mut active) = self.board.active.lock() {
            active.insert(db.to_owned(), (0, expected));
        }
        let mut finished = true;
        let mut next = Some(self.fetch(db, &state.since).await?);
        while let Some(fetched) = next.take() {
            let Fetched { page, leaves } = fetched;
            let mut counts = Counts { docs_seen: page.docs.len() as u64, ..Counts::default() };
            counts.leaves_written = leaves.len() as u64;
            for leaf in &leaves {
                if let Some(Value::Object(attachments)) = leaf.get("_attachments") {
                    counts.attachments += attachments.len() as u64;
                    counts.attachment_bytes += attachments
                        .values()
                        .map(|a| a.get("data").and_then(Value::as_str).map_or(0, |d| d.len() as u64 * 3 / 4))
                        .sum::<u64>();
                }
            }
            let stopping = self.stop.is_raised();
            let write = self.target.write_leaves(db, leaves);
            let failures = if page.at_end || stopping {
                write.await?
            } else {
                let (written, prefetched) = tokio::join!(write, self.fetch(db, &page.last_seq));
                next = Some(prefetched?);
                written?
            };
            counts.failed = failures.len() as u64;
            let room = self.options.max_issues.saturating_sub(report.failures.len());
            report.failures.extend(failures.into_iter().take(room));
            state.since = page.last_seq;
            state.counts.add(&counts);
            state.copied |= page.at_end;
            self.checkpoints.save(db, &state)?;
            report.this_run.add(&counts);
            self.board.advance(db, counts.docs_seen);
            if stopping && !page.at_end {
                finished = false;
                break;
            }
        }
        if let Ok(mut active) = self.board.active.lock() {
            active.remove(db);
        }
        self.board.finished_dbs.fetch_add(1, Ordering::Relaxed);
        report.copied = state.copied;
        report.all_runs = state.counts;
        Ok((report, finished))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_and_selection() {
        assert!(matches("db-*", "db-1") && matches("*", "x") && matches("a?c", "abc") && matches("a*b*c", "aXbYc"));
        assert!(!matches("db-*", "other") && !matches("a?c", "ac") && !matches("abc", "abcd"));
        let selection = Selection { include: vec!["db-*".into(), "logs".into()], exclude: vec!["db-tmp*".into()] };
        assert!(selection.admits("db-1") && selection.admits("logs"));
        assert!(!selection.admits("db-tmp1") && !selection.admits("other"));
        let everything = Selection::default();
        assert!(everything.admits("a/b") && !everything.admits("_users") && !everything.admits("_replicator"));
    }
}
