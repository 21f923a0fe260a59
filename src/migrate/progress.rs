//! Progress on stderr while a migration runs: an `indicatif` bar with counts, rate and ETA on a
//! terminal, plain log lines every few seconds otherwise. The total is the source backend's own
//! estimate of its size ([`crate::backend::DocumentBackend::approximate_count`]); a source that
//! cannot tell (an NDJSON file) gets a spinner with counts and rate, and no ETA. A run into a
//! backend also keeps its counts in a record there for a service to show
//! ([`super::run_record`]).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::run_record::{Counts, RunRecord};

/// How often a plain progress line is printed when stderr is not a terminal.
const LOG_INTERVAL: Duration = Duration::from_secs(5);

/// How progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ProgressMode {
    /// A live spinner on a terminal, log lines otherwise.
    #[default]
    Auto,
    /// A live spinner.
    Bar,
    /// A line every 5 seconds.
    Log,
    /// Nothing.
    None,
}

/// The counters shown.
#[derive(Debug, Clone, Copy, Default)]
pub struct Snapshot {
    pub read: u64,
    pub landed: u64,
    pub skipped: u64,
}

/// What a snapshot's counters beyond `read` mean, in words (a migration's by default).
pub type Detail = fn(&Snapshot) -> String;

/// A migration's words: what landed at the target, what was not copied.
fn migration_detail(snapshot: &Snapshot) -> String {
    format!("{} at the target, {} not copied", snapshot.landed, snapshot.skipped)
}

pub struct Progress {
    label: String,
    detail: Detail,
    bar: Option<ProgressBar>,
    log: bool,
    started: Instant,
    /// Counts when this run started (a resumed run's rate counts only its own work).
    baseline: u64,
    /// About how many documents will be read in all.
    total: Option<u64>,
    last_log: Instant,
    /// The lag (in changes) last shown by the follow phase.
    last_lag: Option<u64>,
    /// The counts last shown.
    last: Snapshot,
    /// The run's record in the target, written as the display is ([`super::run_record`]).
    record: Option<RunRecord>,
}

impl Progress {
    pub fn new(mode: ProgressMode, label: &str, baseline: u64, total: Option<u64>) -> Self {
        Progress::with_detail(mode, label, baseline, total, migration_detail)
    }

    /// Like [`Progress::new`], for a command whose counters `detail` puts into words.
    pub fn with_detail(mode: ProgressMode, label: &str, baseline: u64, total: Option<u64>, detail: Detail) -> Self {
        // A stale zero (DynamoDB's ItemCount on a new table) says nothing.
        let total = total.filter(|t| *t > 0);
        let terminal = std::io::stderr().is_terminal();
        let (bar, log) = match mode {
            ProgressMode::None => (false, false),
            ProgressMode::Bar => (true, false),
            ProgressMode::Log => (false, true),
            ProgressMode::Auto => (terminal, !terminal),
        };
        let bar = bar.then(|| {
            let (bar, template) = match total {
                Some(total) => (
                    ProgressBar::with_draw_target(Some(total.max(baseline)), ProgressDrawTarget::stderr()),
                    "{prefix} [{elapsed_precise}] {wide_bar} {pos}/~{len} {per_sec} ETA {eta} {msg}",
                ),
                None => (
                    ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr()),
                    "{spinner} {prefix} [{elapsed_precise}] {msg}",
                ),
            };
            let style = ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_spinner());
            bar.set_style(style);
            bar.set_prefix(label.to_owned());
            bar.set_position(baseline);
            // A resumed run's rate and ETA count only its own work.
            bar.reset_eta();
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        let now = Instant::now();
        Progress {
            label: label.to_owned(),
            detail,
            bar,
            log,
            started: now,
            baseline,
            total,
            last_log: now,
            last_lag: None,
            last: Snapshot { read: baseline, ..Snapshot::default() },
            record: None,
        }
    }

    /// About how many documents will be read in all (the source's estimate), if known.
    pub fn total(&self) -> Option<u64> {
        self.total
    }

    /// Keeps `record` written with every update from now on.
    pub fn keep_record(&mut self, record: RunRecord) {
        self.record = Some(record);
    }

    /// The record, to close it when the run ends.
    pub fn take_record(&mut self) -> Option<RunRecord> {
        self.record.take()
    }

    /// The counts last shown, as a record writes them.
    pub fn last_counts(&self) -> Counts {
        Counts { read: self.last.read, landed: self.last.landed, skipped: self.last.skipped }
    }

    /// Prints a line above the spinner, or to stderr.
    pub fn say(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None if self.log => eprintln!("{line}"),
            None => {}
        }
    }

    fn line(&self, snapshot: Snapshot) -> String {
        let secs = self.started.elapsed().as_secs_f64().max(1e-3);
        let rate = snapshot.read.saturating_sub(self.baseline) as f64 / secs;
        let mut line = format!("{} read, {}, {rate:.0} docs/s", snapshot.read, (self.detail)(&snapshot));
        if let Some(total) = self.total.filter(|t| *t > 0) {
            let left = total.saturating_sub(snapshot.read);
            line.push_str(&format!(", ~{}% of ~{total}", (snapshot.read.min(total) * 100) / total));
            if rate > 0.0 && left > 0 {
                line.push_str(&format!(", ETA {}", eta(left as f64 / rate)));
            }
        }
        line
    }

    pub fn update(&mut self, snapshot: Snapshot) {
        self.last = snapshot;
        let counts = self.last_counts();
        if let Some(record) = &mut self.record {
            record.update(counts);
        }
        if let Some(bar) = &self.bar {
            if bar.length().is_some_and(|len| snapshot.read > len) {
                // The estimate was low: the bar grows rather than overflowing.
                bar.set_length(snapshot.read);
            }
            bar.set_position(snapshot.read);
            bar.set_message((self.detail)(&snapshot));
        } else if self.log && self.last_log.elapsed() >= LOG_INTERVAL {
            self.last_log = Instant::now();
            eprintln!("agentstore {}: {}", self.label, self.line(snapshot));
        }
    }

    /// Shows the follow phase: what it applied and the lag. In log mode a line every few seconds,
    /// and at once whenever the lag reaches zero from above (the moment a cutover waits for).
    pub fn update_follow(&mut self, ledger: &super::report::Ledger, lag: super::follow::Lag) {
        if let Some(record) = &mut self.record {
            // While following, what the record counts is the changes applied.
            record.following();
            let c = &ledger.counts;
            record.update(Counts { read: c.read, landed: c.written + c.deleted, skipped: c.already_present });
        }
        let line = follow_line(ledger, lag);
        if let Some(bar) = &self.bar {
            bar.set_message(line);
        } else if self.log {
            let reached_zero = lag.changes == 0 && self.last_lag.is_some_and(|before| before > 0);
            if reached_zero || self.last_log.elapsed() >= LOG_INTERVAL {
                self.last_log = Instant::now();
                eprintln!("agentstore {}: {line}", self.label);
            }
        }
        self.last_lag = Some(lag.changes);
    }

    pub fn finish(&mut self, snapshot: Snapshot) {
        self.last = snapshot;
        let line = self.line(snapshot);
        match &self.bar {
            Some(bar) => {
                bar.set_length(snapshot.read);
                bar.set_position(snapshot.read);
                bar.finish_with_message((self.detail)(&snapshot));
            }
            None if self.log => eprintln!("agentstore {}: done: {line}", self.label),
            None => {}
        }
    }
}

/// `following: 120 changes read, 100 written, 15 deleted, 5 in sync, 0 conflicts; lag 3 changes, 0.8 s`.
fn follow_line(ledger: &super::report::Ledger, lag: super::follow::Lag) -> String {
    let c = &ledger.counts;
    let conflicts = c.conflicts + c.conflicts_skipped + c.overwritten;
    format!(
        "following: {} changes read, {} written, {} deleted, {} in sync, {conflicts} conflicts; lag {} changes, {:.1} s",
        c.read, c.written, c.deleted, c.already_present, lag.changes, lag.seconds
    )
}

/// `1h02m03s`, `2m03s`, `3s`.
fn eta(secs: f64) -> String {
    let secs = secs.round() as u64;
    match (secs / 3600, (secs % 3600) / 60, secs % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, s) => format!("{m}m{s:02}s"),
        (h, m, s) => format!("{h}h{m:02}m{s:02}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_lines_estimate_what_is_left() {
        let progress = Progress::new(ProgressMode::None, "migrate", 0, Some(1000));
        let line = progress.line(Snapshot { read: 250, landed: 240, skipped: 10 });
        assert!(line.starts_with("250 read, 240 at the target, 10 not copied"), "{line}");
        assert!(line.contains("~25% of ~1000") && line.contains("ETA"), "{line}");
        let unknown = Progress::new(ProgressMode::None, "migrate", 0, None);
        assert!(!unknown.line(Snapshot { read: 5, landed: 5, skipped: 0 }).contains("ETA"));
        assert_eq!(eta(3723.0), "1h02m03s");
        assert_eq!(eta(123.0), "2m03s");
        assert_eq!(eta(3.2), "3s");
    }
}
