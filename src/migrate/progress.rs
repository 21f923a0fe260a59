//! Progress on stderr while a migration runs: an `indicatif` spinner with counts and rate on a
//! terminal (the number of documents a backend holds is not known without a scan of its own, so
//! there is no bar to fill), plain log lines every few seconds otherwise.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

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

pub struct Progress {
    label: String,
    bar: Option<ProgressBar>,
    log: bool,
    started: Instant,
    /// Counts when this run started (a resumed run's rate counts only its own work).
    baseline: u64,
    last_log: Instant,
}

impl Progress {
    pub fn new(mode: ProgressMode, label: &str, baseline: u64) -> Self {
        let terminal = std::io::stderr().is_terminal();
        let (bar, log) = match mode {
            ProgressMode::None => (false, false),
            ProgressMode::Bar => (true, false),
            ProgressMode::Log => (false, true),
            ProgressMode::Auto => (terminal, !terminal),
        };
        let bar = bar.then(|| {
            let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
            let style = ProgressStyle::with_template("{spinner} {prefix} [{elapsed_precise}] {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner());
            bar.set_style(style);
            bar.set_prefix(label.to_owned());
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        let now = Instant::now();
        Progress { label: label.to_owned(), bar, log, started: now, baseline, last_log: now }
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
        format!(
            "{} read, {} at the target, {} not copied, {rate:.0} docs/s",
            snapshot.read, snapshot.landed, snapshot.skipped
        )
    }

    pub fn update(&mut self, snapshot: Snapshot) {
        if let Some(bar) = &self.bar {
            bar.set_message(self.line(snapshot));
        } else if self.log && self.last_log.elapsed() >= LOG_INTERVAL {
            self.last_log = Instant::now();
            eprintln!("agentstore {}: {}", self.label, self.line(snapshot));
        }
    }

    pub fn finish(&self, snapshot: Snapshot) {
        let line = self.line(snapshot);
        match &self.bar {
            Some(bar) => bar.finish_with_message(line),
            None if self.log => eprintln!("agentstore {}: done: {line}", self.label),
            None => {}
        }
    }
}
