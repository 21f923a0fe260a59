//! What a migration has done so far (the [`Ledger`], kept in the checkpoint so the counts survive a
//! restart) and the final JSON [`Report`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Document counts. Every document read lands in exactly one of `written`, `deleted`, `already_present`,
/// `overwritten`, `conflicts_skipped`, `conflicts`, `refused`, `failed`, `foreign`, `malformed`,
/// `filtered_out`, `unreadable`, or, in a dry run, `would_write` / `would_conflict`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    /// Documents (or NDJSON lines) read from the source.
    pub read: u64,
    /// Written to the target by this migration.
    pub written: u64,
    /// Already at the target with identical content (a resumed batch, or an earlier run).
    pub already_present: u64,
    /// Deleted at the target because the source deleted them (the follow phase of `--follow`).
    #[serde(default)]
    pub deleted: u64,
    /// Different at the target and replaced (`--on-conflict overwrite`).
    pub overwritten: u64,
    /// Different at the target and left alone (`--on-conflict skip`).
    pub conflicts_skipped: u64,
    /// Different at the target, stopping the migration (`--on-conflict fail`).
    pub conflicts: u64,
    /// Refused by the target because it cannot store the document as it is (a number it would
    /// change, a size over its limit); never written altered. Each is listed with its reason.
    #[serde(default)]
    pub refused: u64,
    /// Not written for any other reason (the target kept failing); each is listed with its reason.
    pub failed: u64,
    /// Not data-store documents (design documents, ids that are not composite ids).
    pub foreign: u64,
    /// Data-store documents whose fields contradict their id; not copied.
    pub malformed: u64,
    /// Outside the `--user` / `--namespace` filter.
    pub filtered_out: u64,
    /// NDJSON lines that are not a JSON object with a string `_id`.
    pub unreadable: u64,
    /// Copied after at least one repair or normalisation rule changed them.
    pub repaired: u64,
    /// Copied with a problem reported and left in place.
    pub warned: u64,
    /// Dry run: would be written.
    pub would_write: u64,
    /// Dry run: present at the target with different content.
    pub would_conflict: u64,
}

/// One document the report names, with why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Issue {
    /// The `_id`, or `line N` of an NDJSON input.
    pub id: String,
    /// `foreign`, `malformed`, `unreadable`, `conflict`, `conflict_skipped`, `overwritten`,
    /// `refused`, `failed`, `repaired`, `warning`.
    pub kind: String,
    pub reason: String,
}

/// Counts, counts by reason, and the first few documents of each kind of issue.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ledger {
    pub counts: Counts,
    /// Foreign documents by kind (`design_document`, `not_a_composite_id`, …).
    pub foreign_by_kind: BTreeMap<String, u64>,
    /// Documents changed, by rule (a document can count under several rules).
    pub repairs_by_rule: BTreeMap<String, u64>,
    /// Problems copied unchanged, by rule.
    pub warnings_by_rule: BTreeMap<String, u64>,
    /// Write failures by error kind.
    pub failures_by_kind: BTreeMap<String, u64>,
    /// At most `max_issues` documents of each issue kind.
    pub issues: Vec<Issue>,
}

impl Ledger {
    /// Adds a tally.
    pub fn tally(map: &mut BTreeMap<String, u64>, name: &str) {
        *map.entry(name.to_owned()).or_default() += 1;
    }

    /// Names one document, unless `max_issues` of its kind are named already.
    pub fn note(&mut self, max_issues: usize, id: &str, kind: &str, reason: impl Into<String>) {
        if self.issues.iter().filter(|issue| issue.kind == kind).count() < max_issues {
            self.issues.push(Issue { id: id.to_owned(), kind: kind.to_owned(), reason: reason.into() });
        }
    }

    /// Adds another ledger (one batch's) to this one.
    pub fn absorb(&mut self, other: Ledger, max_issues: usize) {
        let a = &mut self.counts;
        let b = other.counts;
        a.read += b.read;
        a.written += b.written;
        a.already_present += b.already_present;
        a.deleted += b.deleted;
        a.overwritten += b.overwritten;
        a.conflicts_skipped += b.conflicts_skipped;
        a.conflicts += b.conflicts;
        a.refused += b.refused;
        a.failed += b.failed;
        a.foreign += b.foreign;
        a.malformed += b.malformed;
        a.filtered_out += b.filtered_out;
        a.unreadable += b.unreadable;
        a.repaired += b.repaired;
        a.warned += b.warned;
        a.would_write += b.would_write;
        a.would_conflict += b.would_conflict;
        for (mine, theirs) in [
            (&mut self.foreign_by_kind, other.foreign_by_kind),
            (&mut self.repairs_by_rule, other.repairs_by_rule),
            (&mut self.warnings_by_rule, other.warnings_by_rule),
            (&mut self.failures_by_kind, other.failures_by_kind),
        ] {
            for (name, count) in theirs {
                *mine.entry(name).or_default() += count;
            }
        }
        for issue in other.issues {
            self.note(max_issues, &issue.id, &issue.kind, issue.reason);
        }
    }

    /// Documents the target now holds on this migration's account (or would, in a dry run).
    pub fn landed(&self) -> u64 {
        let c = &self.counts;
        c.written + c.already_present + c.overwritten + c.would_write
    }

    /// Whether some data-store documents did not reach the target for reasons other than the
    /// caller's choice (`--on-conflict skip`, filters).
    pub fn incomplete(&self) -> bool {
        let c = &self.counts;
        c.refused + c.failed + c.malformed + c.unreadable + c.conflicts > 0
    }
}

/// How the run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Every document was read and handled.
    Finished,
    /// The checkpoint says a previous run finished; nothing was done.
    AlreadyFinished,
    /// A dry run: nothing was written.
    DryRun,
    /// SIGINT/SIGTERM stopped the copy after a batch; the same command resumes it.
    Interrupted,
    /// `--follow`: the copy is finished, and SIGINT/SIGTERM stopped the following after a page.
    Stopped,
    /// `--until-caught-up`: every change committed before the run started is applied.
    CaughtUp,
}

impl Status {
    /// The run's state as its progress record says it ([`super::run_record`]).
    pub fn record_state(self) -> &'static str {
        match self {
            Status::Finished | Status::AlreadyFinished | Status::DryRun | Status::CaughtUp => "finished",
            Status::Interrupted | Status::Stopped => "interrupted",
        }
    }
}

/// The follow phase of `migrate --follow`, over every run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FollowReport {
    /// When the source's change position was recorded, before the copy began.
    pub since_recorded_at: String,
    /// The feed position the next run continues after.
    pub position: String,
    /// Changes read and what became of their documents.
    #[serde(flatten)]
    pub ledger: Ledger,
    /// Changes waiting at the source when the run ended (a lower bound where the feed cannot count).
    pub lag_changes: u64,
    /// Seconds since the moment up to which every change was applied, when the run ended.
    pub lag_seconds: f64,
    /// The source feed's settle window: a write shows in the feed this long after it commits.
    pub change_feed_delay_ms: u64,
}

/// The final JSON report of `migrate`, `export` and `import`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    pub command: String,
    pub from: String,
    pub to: String,
    pub status: Status,
    /// Human-readable summary of the status.
    pub message: String,
    /// The checkpoint file (none in a dry run).
    pub checkpoint: Option<String>,
    /// Whether this run continued from a checkpoint.
    pub resumed: bool,
    /// How many runs the migration took, this one included.
    pub runs: u32,
    /// Totals over every run.
    #[serde(flatten)]
    pub ledger: Ledger,
    pub batch_size: usize,
    pub concurrency: usize,
    /// Most documents held in memory at once: (channel capacity + 2 × concurrency + 1) × batch size.
    pub memory_bound_documents: usize,
    /// This run's wall-clock time.
    pub duration_secs: f64,
    /// All runs' wall-clock time.
    pub total_duration_secs: f64,
    /// Documents read per second in this run.
    pub docs_per_sec: f64,
    /// The process's peak resident memory (Linux `VmHWM`), when known.
    pub peak_rss_bytes: Option<u64>,
    /// Design documents at a CouchDB source: never read by the scan, never copied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub design_documents_left_behind: Option<u64>,
    /// The read-back that ends a finished (or already finished) `migrate`; absent with
    /// `--no-verify`, in a dry run, and for `export`/`import`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verification: Option<super::verify::Verification>,
    /// `migrate --follow`: the follow phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub follow: Option<FollowReport>,
}

impl Report {
    /// 0 when every data-store document reached the target (or was skipped by choice), else
    /// [`crate::migrate::EXIT_INCOMPLETE`]; [`crate::migrate::EXIT_DIFFERENT`] before either when
    /// the read-back found a difference the report does not explain; [`crate::migrate::EXIT_INTERRUPTED`]
    /// when a signal stopped the copy.
    pub fn exit_code(&self) -> u8 {
        if self.status == Status::Interrupted {
            return super::EXIT_INTERRUPTED;
        }
        let follow_incomplete = self.follow.as_ref().is_some_and(|follow| follow.ledger.incomplete());
        if self.verification.as_ref().is_some_and(|v| !v.passed) {
            super::EXIT_DIFFERENT
        } else if self.ledger.incomplete() || follow_incomplete {
            super::EXIT_INCOMPLETE
        } else {
            0
        }
    }
}

/// The peak resident set size of this process, from `/proc/self/status` (Linux only).
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with("VmHWM:"))?;
    let kib: u64 = line.trim_start_matches("VmHWM:").trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absorb_adds_and_caps_named_issues() {
        let mut total = Ledger::default();
        for batch in 0..3 {
            let mut ledger = Ledger::default();
            ledger.counts.read = 10;
            ledger.counts.malformed = 2;
            Ledger::tally(&mut ledger.repairs_by_rule, "key_from_id");
            ledger.note(5, &format!("a{batch}"), "malformed", "x");
            ledger.note(5, &format!("b{batch}"), "malformed", "y");
            total.absorb(ledger, 4);
        }
        assert_eq!(total.counts.read, 30);
        assert_eq!(total.counts.malformed, 6);
        assert_eq!(total.repairs_by_rule["key_from_id"], 3);
        let named: Vec<&str> = total.issues.iter().map(|i| i.id.as_str()).collect();
        assert_eq!(named, ["a0", "b0", "a1", "b1"]);
        assert!(total.incomplete());
    }

    #[test]
    fn peak_rss_is_read_on_linux() {
        if cfg!(target_os = "linux") {
            assert!(peak_rss_bytes().is_some_and(|bytes| bytes > 0));
        }
    }
}
