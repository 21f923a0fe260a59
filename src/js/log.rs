//! What design functions may write to the server's log: `log(message)` lines and the messages of
//! map functions that throw, bounded per line (`couchdb_js_log_line_bytes`) and in rate, per
//! database (`couchdb_js_log_bytes_per_minute`) and for the whole server
//! (`couchdb_js_log_server_bytes_per_minute`): [`LogLimits`].
//!
//! Why: a function runs for every document of a view and may call `log()` in a loop for as long
//! as its time bound allows, so without a rate one design document writes hundreds of MiB of
//! log a minute (a five-document view wrote 883 MiB in 20 s). CouchDB writes every line; here a
//! line past its database's budget (or the server's) is dropped and counted, the first drop is
//! noted at once, and the next line that fits is preceded by a note of how many lines and bytes
//! were dropped, so the log always says that something is missing. The request that ran the
//! function is answered as if every line had been written: a client's view query is never
//! refused because its functions log (CouchDB answers the same).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// The default of `couchdb_js_log_line_bytes` ([`LogLimits::line_bytes`]).
pub const DEFAULT_LOG_LINE_BYTES: usize = 4096;

/// The default of `couchdb_js_log_bytes_per_minute` ([`LogLimits::database_bytes_per_minute`]).
pub const DEFAULT_DATABASE_LOG_BYTES_PER_MINUTE: u64 = 1 << 20;

/// The default of `couchdb_js_log_server_bytes_per_minute`
/// ([`LogLimits::server_bytes_per_minute`]).
pub const DEFAULT_SERVER_LOG_BYTES_PER_MINUTE: u64 = 8 << 20;

/// The bounds of design functions' log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogLimits {
    /// The longest line passed on to the log, in bytes (at a character boundary); the rest is
    /// cut and the line says how long it was. The JavaScript side cuts a message to this many
    /// UTF-16 units before it crosses, so a huge message is never copied out of the engine.
    pub line_bytes: usize,
    /// Log bytes one database's functions may write per minute, refilled continuously (a burst
    /// of up to this much is allowed).
    pub database_bytes_per_minute: u64,
    /// Log bytes the functions of every database together may write per minute.
    pub server_bytes_per_minute: u64,
}

impl Default for LogLimits {
    fn default() -> Self {
        LogLimits {
            line_bytes: DEFAULT_LOG_LINE_BYTES,
            database_bytes_per_minute: DEFAULT_DATABASE_LOG_BYTES_PER_MINUTE,
            server_bytes_per_minute: DEFAULT_SERVER_LOG_BYTES_PER_MINUTE,
        }
    }
}

/// Databases whose budgets are remembered; past it, the budgets that are full again are
/// forgotten (and, if none is, all of them).
const MAX_TRACKED_DATABASES: usize = 4096;

/// A token bucket of log bytes, with what it dropped since it last let a line through.
struct Bucket {
    bytes: f64,
    refilled: Instant,
    dropped_lines: u64,
    dropped_bytes: u64,
}

impl Bucket {
    fn full(capacity: u64, now: Instant) -> Self {
        Bucket { bytes: capacity as f64, refilled: now, dropped_lines: 0, dropped_bytes: 0 }
    }

    fn refill(&mut self, capacity: u64, now: Instant) {
        let per_second = capacity as f64 / 60.0;
        let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.bytes = (self.bytes + elapsed * per_second).min(capacity as f64);
        self.refilled = now;
    }

    fn is_idle_and_full(&self, capacity: u64) -> bool {
        self.dropped_lines == 0 && self.bytes >= capacity as f64
    }
}

struct Budgets {
    server: Bucket,
    databases: HashMap<String, Bucket>,
}

/// The log budgets of the engine, shared by its workers.
pub(super) struct LogBudget {
    limits: LogLimits,
    budgets: Mutex<Budgets>,
    /// Bytes of function lines written so far (the notes of drops not counted).
    written: AtomicU64,
}

/// What to write for one line.
#[derive(Debug, PartialEq)]
enum Verdict {
    /// Write it, after a note of `(lines, bytes)` dropped before it, if any.
    Write { dropped_before: Option<(u64, u64)> },
    /// Drop it; `first` when it is the first drop since a line was last written.
    Drop { first: bool },
}

impl LogBudget {
    pub(super) fn new(limits: LogLimits) -> Self {
        let now = Instant::now();
        LogBudget {
            limits,
            budgets: Mutex::new(Budgets {
                server: Bucket::full(limits.server_bytes_per_minute, now),
                databases: HashMap::new(),
            }),
            written: AtomicU64::new(0),
        }
    }

    /// Bytes of function lines written to the log so far.
    pub(super) fn written_bytes(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }

    /// The longest line passed on to the log, in bytes ([`LogLimits::line_bytes`]).
    pub(super) fn line_bytes(&self) -> usize {
        self.limits.line_bytes
    }

    /// Writes one line of the design document `ddoc_id` of `database` to the log, cut to
    /// [`LogLimits::line_bytes`], if the budgets allow it. `length` is the message's whole length as
    /// the function wrote it (UTF-16 units) when the JavaScript side cut it before it crossed.
    pub(super) fn line(&self, database: &str, ddoc_id: &str, message: &str, length: Option<usize>) {
        let LogLimits { line_bytes, database_bytes_per_minute, server_bytes_per_minute } = self.limits;
        let (kept, cut) = bounded_line(message, line_bytes);
        let cut = cut || length.is_some();
        let size = kept.len() as u64;
        match self.verdict(database, size, Instant::now()) {
            Verdict::Write { dropped_before } => {
                self.written.fetch_add(size, Ordering::Relaxed);
                if let Some((lines, bytes)) = dropped_before {
                    tracing::warn!(
                        target: "agentstore::js",
                        database,
                        "{lines} log lines ({bytes} bytes) of this database's design functions were dropped: over the log budget (couchdb_js_log_bytes_per_minute {database_bytes_per_minute} per database, couchdb_js_log_server_bytes_per_minute {server_bytes_per_minute} for the server)"
                    );
                }
                if cut {
                    let whole = length.map_or_else(|| message.len().to_string(), |units| format!("{units} characters"));
                    tracing::info!(
                        target: "agentstore::js",
                        database,
                        design_doc = ddoc_id,
                        "{kept} … (cut at couchdb_js_log_line_bytes, {line_bytes} bytes, of {whole})"
                    );
                } else {
                    tracing::info!(target: "agentstore::js", database, design_doc = ddoc_id, "{kept}");
                }
            }
            Verdict::Drop { first: true } => tracing::warn!(
                target: "agentstore::js",
                database,
                design_doc = ddoc_id,
                "this database's design functions log more than the log budget allows (couchdb_js_log_bytes_per_minute {database_bytes_per_minute} per database, couchdb_js_log_server_bytes_per_minute {server_bytes_per_minute} for the server): lines are dropped until it refills, then counted"
            ),
            Verdict::Drop { first: false } => {}
        }
    }

    fn verdict(&self, database: &str, size: u64, now: Instant) -> Verdict {
        let LogLimits { database_bytes_per_minute, server_bytes_per_minute, .. } = self.limits;
        let mut budgets = self.budgets.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let Budgets { server, databases } = &mut *budgets;
        if !databases.contains_key(database) && databases.len() >= MAX_TRACKED_DATABASES {
            databases.retain(|_, bucket| {
                bucket.refill(database_bytes_per_minute, now);
                !bucket.is_idle_and_full(database_bytes_per_minute)
            });
            if databases.len() >= MAX_TRACKED_DATABASES {
                databases.clear();
            }
        }
        let bucket =
            databases.entry(database.to_owned()).or_insert_with(|| Bucket::full(database_bytes_per_minute, now));
        bucket.refill(database_bytes_per_minute, now);
        server.refill(server_bytes_per_minute, now);
        let cost = size as f64;
        if bucket.bytes >= cost && server.bytes >= cost {
            bucket.bytes -= cost;
            server.bytes -= cost;
            let dropped_before = (bucket.dropped_lines > 0).then_some((bucket.dropped_lines, bucket.dropped_bytes));
            bucket.dropped_lines = 0;
            bucket.dropped_bytes = 0;
            return Verdict::Write { dropped_before };
        }
        bucket.dropped_lines += 1;
        bucket.dropped_bytes += size;
        Verdict::Drop { first: bucket.dropped_lines == 1 }
    }
}

/// The first `line_bytes` of `message` at most (on a character boundary), and whether anything
/// was cut.
pub(super) fn bounded_line(message: &str, line_bytes: usize) -> (&str, bool) {
    let mut end = message.len().min(line_bytes);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    (&message[..end], end < message.len())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_database_past_its_budget_is_dropped_then_noted_when_it_refills() {
        let budget = LogBudget::new(LogLimits::default());
        let start = Instant::now();
        let line = DEFAULT_LOG_LINE_BYTES as u64;
        let fits = DEFAULT_DATABASE_LOG_BYTES_PER_MINUTE / line;
        for _ in 0..fits {
            assert_eq!(budget.verdict("loud", line, start), Verdict::Write { dropped_before: None });
        }
        assert_eq!(budget.verdict("loud", line, start), Verdict::Drop { first: true });
        assert_eq!(budget.verdict("loud", line, start), Verdict::Drop { first: false });
        // Another database keeps its own budget.
        assert_eq!(budget.verdict("quiet", 10, start), Verdict::Write { dropped_before: None });
        // A second later the loud one has refilled a line's worth and says what it dropped.
        let later = start + Duration::from_secs(1);
        assert_eq!(budget.verdict("loud", line, later), Verdict::Write { dropped_before: Some((2, 2 * line)) });
    }

    #[test]
    fn the_server_budget_bounds_every_database_together() {
        let budget = LogBudget::new(LogLimits::default());
        let now = Instant::now();
        let mut written = 0u64;
        // Each database tries four times its own budget (a bounded loop, so a budget that lets
        // everything through fails here rather than never ending).
        let tries = 4 * DEFAULT_DATABASE_LOG_BYTES_PER_MINUTE / 4096;
        for database in 0..64 {
            for _ in 0..tries {
                if let Verdict::Write { .. } = budget.verdict(&format!("db{database}"), 4096, now) {
                    written += 4096;
                }
            }
        }
        assert!(written <= DEFAULT_SERVER_LOG_BYTES_PER_MINUTE, "{written}");
    }
}
