//! What a whole-deployment run (`migrate --all-databases`, `verify --all-databases`) has done
//! so far, shared by the tasks working on its databases: documents done of about how many,
//! databases done of how many, and each database being worked on. It is printed every
//! [`PROGRESS_INTERVAL`] when the command shows progress, and kept in the run's progress record
//! ([`crate::migrate::run_record`]) when the run has one, for `_active_tasks` and the console's
//! service page, as a single-store `migrate` keeps its own.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use crate::migrate::progress::ProgressMode;
use crate::migrate::run_record::{Counts, RunRecord};

/// How often progress is printed and the record offered a write (it writes at most every
/// [`crate::migrate::run_record::RECORD_INTERVAL`]).
pub const PROGRESS_INTERVAL: Duration = Duration::from_secs(2);

/// Progress of a whole-deployment run: per database and overall, with a rate and an ETA.
pub struct Board {
    /// What the printed line starts with (`migrate`, `verify`).
    label: &'static str,
    /// What the databases being worked on are called in the printed line.
    doing: &'static str,
    mode: ProgressMode,
    started: Instant,
    /// Documents (or leaves) expected past the checkpoints, as estimated.
    expected: AtomicU64,
    done: AtomicU64,
    /// Of what is done, what landed at the target (or compared equal).
    landed: AtomicU64,
    /// Of what is done, what did not land (refused) or differed.
    skipped: AtomicU64,
    /// Databases being worked on: documents done and expected.
    active: Mutex<BTreeMap<String, (u64, u64)>>,
    finished_dbs: AtomicU64,
    selected_dbs: AtomicU64,
    /// Whether the copy is done and the run follows the source's changes.
    following: AtomicBool,
    record: Mutex<Option<RunRecord>>,
    /// Fields the run adds to its record (how it ended: [`Board::note`]).
    notes: Mutex<Map<String, Value>>,
}

impl Board {
    /// A board for a run printed as `label` (`doing` its databases at work), keeping `record`
    /// written when there is one.
    pub fn new(label: &'static str, doing: &'static str, mode: ProgressMode, record: Option<RunRecord>) -> Arc<Self> {
        Arc::new(Board {
            label,
            doing,
            mode,
            started: Instant::now(),
            expected: AtomicU64::new(0),
            done: AtomicU64::new(0),
            landed: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
            active: Mutex::new(BTreeMap::new()),
            finished_dbs: AtomicU64::new(0),
            selected_dbs: AtomicU64::new(0),
            following: AtomicBool::new(false),
            record: Mutex::new(record),
            notes: Mutex::new(Map::new()),
        })
    }

    fn active(&self) -> MutexGuard<'_, BTreeMap<String, (u64, u64)>> {
        self.active.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn record(&self) -> MutexGuard<'_, Option<RunRecord>> {
        self.record.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The line printed.
    pub fn line(&self) -> String {
        let done = self.done.load(Ordering::Relaxed);
        let expected = self.expected.load(Ordering::Relaxed).max(done);
        let seconds = self.started.elapsed().as_secs_f64().max(0.001);
        let rate = done as f64 / seconds;
        let eta = if rate > 0.0 && expected > done {
            format!("{:.0}s", (expected - done) as f64 / rate)
        } else {
            "-".to_owned()
        };
        let active: Vec<String> =
            self.active().iter().map(|(name, (done, of))| format!("{name} {done}/{of}")).collect();
        format!(
            "{}: databases {}/{} done; documents {done}/{expected}; {rate:.0} docs/s; ETA {eta}; {}: {}",
            self.label,
            self.finished_dbs.load(Ordering::Relaxed),
            self.selected_dbs.load(Ordering::Relaxed),
            self.doing,
            if active.is_empty() { "-".to_owned() } else { active.join(", ") }
        )
    }

    /// A pass over `count` selected databases begins. While following, the databases done stay
    /// those the copy finished: every pass visits each again.
    pub fn start_pass(&self, count: usize) {
        self.selected_dbs.store(count as u64, Ordering::Relaxed);
        if !self.following.load(Ordering::Relaxed) {
            self.finished_dbs.store(0, Ordering::Relaxed);
        }
    }

    /// Work on `db` begins, about `expected` documents.
    pub fn start_db(&self, db: &str, expected: u64) {
        self.expected.fetch_add(expected, Ordering::Relaxed);
        self.active().insert(db.to_owned(), (0, expected));
    }

    /// `docs` more of `db` done, of which `landed` landed (or compared equal) and `skipped` did
    /// not.
    pub fn advance(&self, db: &str, docs: u64, landed: u64, skipped: u64) {
        self.done.fetch_add(docs, Ordering::Relaxed);
        self.landed.fetch_add(landed, Ordering::Relaxed);
        self.skipped.fetch_add(skipped, Ordering::Relaxed);
        if let Some(entry) = self.active().get_mut(db) {
            entry.0 += docs;
        }
    }

    /// Work on `db` ended.
    pub fn end_db(&self, db: &str) {
        self.active().remove(db);
        if !self.following.load(Ordering::Relaxed) {
            self.finished_dbs.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The copy is done; what is counted from now on is the changes followed.
    pub fn following(&self) {
        if !self.following.swap(true, Ordering::Relaxed) {
            if let Some(record) = self.record().as_mut() {
                record.following();
            }
        }
    }

    fn counts(&self) -> Counts {
        Counts {
            read: self.done.load(Ordering::Relaxed),
            landed: self.landed.load(Ordering::Relaxed),
            skipped: self.skipped.load(Ordering::Relaxed),
        }
    }

    /// The record's fields besides a single-store run's: databases done of how many, and those
    /// being worked on.
    fn detail(&self) -> Map<String, Value> {
        let now: Vec<Value> =
            self.active().iter().map(|(name, (done, of))| json!({ "name": name, "done": done, "of": of })).collect();
        let mut detail = Map::new();
        detail.insert("databases_done".into(), json!(self.finished_dbs.load(Ordering::Relaxed)));
        detail.insert("databases_total".into(), json!(self.selected_dbs.load(Ordering::Relaxed)));
        detail.insert("databases_now".into(), Value::Array(now));
        for (name, value) in self.notes.lock().unwrap_or_else(PoisonError::into_inner).iter() {
            detail.insert(name.clone(), value.clone());
        }
        detail
    }

    /// A field the record carries from now on (`passed`: what a comparison found).
    pub fn note(&self, name: &str, value: Value) {
        self.notes.lock().unwrap_or_else(PoisonError::into_inner).insert(name.to_owned(), value);
    }

    /// Prints the line (when the command shows progress) and offers the record a write.
    pub fn tick(&self) {
        if self.mode != ProgressMode::None {
            eprintln!("{}", self.line());
        }
        let (counts, detail) = (self.counts(), self.detail());
        let expected = self.expected.load(Ordering::Relaxed);
        if let Some(record) = self.record().as_mut() {
            if !self.following.load(Ordering::Relaxed) {
                record.set_total(Some(expected.max(counts.read)));
            }
            record.set_detail(detail);
            record.update(counts);
        }
    }

    /// A task ticking every [`PROGRESS_INTERVAL`] until aborted, when there is anything to show
    /// or keep; one tick at once, so a record exists from the start.
    pub fn ticker(self: &Arc<Self>) -> Option<tokio::task::JoinHandle<()>> {
        let keeps_record = self.record().is_some();
        if self.mode == ProgressMode::None && !keeps_record {
            return None;
        }
        if keeps_record {
            // Only the record: printing waits for the first interval as before.
            let (counts, detail) = (self.counts(), self.detail());
            if let Some(record) = self.record().as_mut() {
                record.set_detail(detail);
                record.update(counts);
            }
        }
        let board = Arc::clone(self);
        Some(tokio::spawn(async move {
            loop {
                tokio::time::sleep(PROGRESS_INTERVAL).await;
                board.tick();
            }
        }))
    }

    /// Writes the record's last state (`finished`, `interrupted`, `failed`) and waits for it.
    pub async fn close(&self, state: &str, error: Option<&str>) {
        let taken = self.record().take();
        let Some(mut record) = taken else { return };
        let counts = self.counts();
        if !self.following.load(Ordering::Relaxed) {
            record.set_total(Some(self.expected.load(Ordering::Relaxed).max(counts.read)));
        }
        record.set_detail(self.detail());
        record.close(state, counts, error).await;
    }
}
