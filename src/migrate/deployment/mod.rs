//! Moving a whole deployment: every database of a source (a backend's databases, or a
//! CouchDB-protocol server) to a target of either kind, with every leaf of every document's
//! revision tree (deleted leaves too, ancestry as the source keeps it), attachments byte for byte,
//! design documents, `_security` and `_revs_limit`; resumably, and live (`--follow`).
//! `agentstore migrate --all-databases` / `--db` and `verify --all-databases` are built on it
//! (docs/migration.md, "Moving a whole deployment").
//!
//! **How one database is copied.** The replication protocol's loop, with each end a [`Side`]:
//! read a page of the source feed with every leaf (`style=all_docs`); ask the target which of
//! those leaves it lacks (`_revs_diff`); read those leaves from the source with their ancestry,
//! attachments as stubs (`_bulk_get?revs=true`); write them to the target as replicated
//! revisions (`new_edits: false`), their attachments' bytes fetched as below; then record the
//! feed position after the page in the database's checkpoint. While a page is written the next
//! one is read (stubs only).
//!
//! **Memory.** Attachment bytes are never gathered per page. A leaf without attachments is
//! written as read. A leaf whose attachments add up to at most [`INLINE_ATTACHMENT_BYTES`]
//! (256 KiB) travels inline: such leaves are read again with their bytes as base64
//! (`_bulk_get?attachments=true`) and written in groups of at most [`INLINE_GROUP_BYTES`] (4 MiB)
//! of attachment bytes, one group at a time. Every other leaf is written on its own with its
//! attachments streamed one at a time from the source to the target
//! ([`Side::write_leaf_streamed`]), a chunk at a time (the store's chunk, 256 KiB to 1 MiB, or
//! what the connection hands over). So a database being copied holds at most one inline group
//! (its base64 text, parsed JSON and request body: a few times 4 MiB) plus one streamed chunk,
//! plus the page of stubs being written and the next one read, whatever the attachments' sizes;
//! the whole move holds that times `--databases-at-once` (4 by default: about 100 MiB at most,
//! with the process's own 30 to 60 MiB). One exception: when the target is a CouchDB-protocol
//! server, a leaf with an attachment whose name pouchdb-server's multipart reader would change
//! (a backslash, `%22`, `&#`, a control character) travels inline whatever its size.
//!
//! **Too large.** An attachment longer than the target takes (a backend's
//! `couchdb_max_attachment_bytes`, checked from the stub before any byte moves; a server's 413)
//! refuses its leaf with a failure row naming it (`attachment_too_large`), as does one whose bytes
//! are not as long as its stub says; the move goes on, and ends with exit status 7.
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
//! `_security` and `_revs_limit` are not in the feed: following reads them again every
//! [`SETTINGS_INTERVAL`] (and on the last pass of `--until-caught-up`) and copies a change.

pub mod archive;
pub mod board;
pub mod checkpoint;
pub mod service;
pub mod side;
pub mod verify;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::{BoxFuture, OptionFuture};
use futures::stream::FuturesOrdered;
use futures::StreamExt;
use serde::Serialize;
use serde_json::{Map, Value};

use super::follow::{FollowMode, StopFlag, StopSignal};
use super::progress::ProgressMode;
use super::run_record::RunRecord;
use crate::backend::catalog::DbName;
use crate::error::{Error, Result};
use crate::replication_client::FeedPage;
use board::Board;
use checkpoint::{Checkpoints, Counts, DbCheckpoint, MoveIdentity};
use side::Settings;
pub use side::Side;
use verify::VerifyReport;

/// Databases copied at once by default.
pub const DEFAULT_DATABASES_AT_ONCE: usize = 4;
/// Pages of one database written at once by default (`--pages-at-once`; the next page fetched
/// meanwhile). One page at a time left a target whose every call is a round trip (DynamoDB,
/// Firestore) waiting on each page's slowest chunk and its attachments before the next page
/// began: a move into the Firestore emulator kept about 5 calls in flight where its raw bulk
/// rate is measured with 16 (issue 38). Not more by default: each page is up to
/// `WRITES_AT_ONCE` (side.rs) bulk writes at once, and on DynamoDB each of those 16 `PutItem`s,
/// so four pages of four databases kept about a thousand requests in flight and dynalite timed
/// some out (issue 38, session 19).
pub const DEFAULT_PAGES_AT_ONCE: usize = 2;
/// The most pages of one database `--pages-at-once` takes: each page under way holds its stubs
/// (`--batch-size` leaves without attachment bytes), so a database holds at most
/// `MAX_PAGES_AT_ONCE + 1` pages of stubs; attachment bytes are bounded apart (module doc,
/// "Memory").
pub const MAX_PAGES_AT_ONCE: usize = 16;
/// A leaf whose attachments add up to at most this many bytes travels inline (base64 in JSON).
pub const INLINE_ATTACHMENT_BYTES: u64 = 256 << 10;
/// Attachment bytes (as the stubs count them) of the inline leaves read and written at once.
pub const INLINE_GROUP_BYTES: u64 = 4 << 20;
/// The most attachment bytes of a page's first inline group that is written with the page's
/// leaves without attachments, in the same bulk writes, into a backend: that write then waits
/// for the group's read from the source (its bytes, at most this many) and the store of its
/// attachments (one commit on Firestore) before it starts, where it went beside them.
const JOINED_GROUP_BYTES: u64 = 256 << 10;
/// The unit of the move's attachment budget: a database's share is [`INLINE_GROUP_BYTES`] of
/// them, an inline group takes its bytes' worth (rounded up), a streamed leaf a whole share.
const BUDGET_UNIT_BYTES: u64 = 1 << 10;
/// A database's share of the attachment budget, in units.
const BUDGET_UNITS_PER_DATABASE: u64 = INLINE_GROUP_BYTES / BUDGET_UNIT_BYTES;
/// The pause between two passes of `--follow` that found nothing to do.
const POLL_INTERVAL: Duration = Duration::from_millis(500);
/// How often `--follow` reads each database's `_security` and `_revs_limit` again: they change
/// outside the feed, so only asking tells; every 0.5 s pass asking would double an idle
/// follow's requests.
const SETTINGS_INTERVAL: Duration = Duration::from_secs(5);

/// What `local_documents` says in every report.
pub const LOCAL_DOCUMENTS: &str = "not copied: they are peers' replication checkpoints, naming positions in the \
                                   source's feeds that mean nothing at the target (CouchDB's replicator does not \
                                   copy them either)";

/// The system databases a move without `--db` takes: the deployment's logins and replications.
/// `_global_changes` (the `_db_updates` events each server writes of its own databases) is taken
/// only when named.
pub const MOVED_BY_DEFAULT: [&str; 2] = ["_users", "_replicator"];

/// Which databases a move takes: every one, or those matching `include` (exact names, or
/// patterns with `*` and `?`), less those matching `exclude`. The system databases this server
/// keeps ([`SYSTEM_DATABASES`](crate::backend::catalog::SYSTEM_DATABASES)) are taken with `--db`
/// only when named exactly, never by a pattern; those of [`MOVED_BY_DEFAULT`], a deployment's
/// logins and replications, also without `--db` (issue 37: "unless excluded"), never
/// by a pattern (`--db '*'` means the application's databases); `--exclude` takes them out by
/// name or pattern. Their documents are replicated as they are, CouchDB's password hashes
/// included, so users log in at the target with the passwords they had. Other names starting
/// with `_` and names no backend here takes are never taken.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    pub include: Vec<String>,
    pub exclude: Vec<String>,
}

impl Selection {
    pub fn admits(&self, name: &str) -> bool {
        let excluded = self.exclude.iter().any(|p| matches(p, name));
        if crate::backend::catalog::SYSTEM_DATABASES.contains(&name) {
            let by_default = self.include.is_empty() && MOVED_BY_DEFAULT.contains(&name);
            let taken = by_default || self.include.iter().any(|pattern| pattern == name);
            return taken && !excluded;
        }
        if name.starts_with('_') || DbName::parse(name).is_err() {
            return false;
        }
        (self.include.is_empty() || self.include.iter().any(|p| matches(p, name))) && !excluded
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
    /// Pages of one database written at once (1 to [`MAX_PAGES_AT_ONCE`]; `--pages-at-once`).
    pub pages_at_once: usize,
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
            pages_at_once: DEFAULT_PAGES_AT_ONCE,
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
    /// The settings copied: `_security` and, where the source knows it, `_revs_limit` (the last
    /// ones, when following copied a change).
    pub security: Value,
    pub revs_limit: Option<u64>,
    /// Changes of those settings at the source that following copied after the first copy.
    pub settings_updated: u64,
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
    /// 8 interrupted, 6 the read-back found a difference the report does not explain, 7 leaves
    /// were refused, else 0 (as plain `migrate`'s statuses, docs/migration.md).
    pub fn exit_code(&self) -> u8 {
        if self.status == MoveStatus::Interrupted {
            super::EXIT_INTERRUPTED
        } else if self.verification.as_ref().is_some_and(|v| !v.passed && !self.refusals_explain(v)) {
            super::EXIT_DIFFERENT
        } else if self.totals.failed > 0 {
            super::EXIT_INCOMPLETE
        } else {
            0
        }
    }

    /// Whether the read-back's differences are the leaves this run's report names as refused:
    /// in every database only leaves missing at the target (and so documents missing from its
    /// feed), no more of them than the target refused this run (a leaf refused before is sent
    /// and refused again), and nothing else different.
    fn refusals_explain(&self, verification: &VerifyReport) -> bool {
        verification.databases.iter().all(|db| {
            let refused = self.databases.iter().find(|r| r.name == db.name).map_or(0, |r| r.this_run.failed);
            !db.missing_database
                && db.extra_at_target == 0
                && db.different == 0
                && db.security_equal
                && db.revs_limit_equal
                && db.missing_at_target <= refused
                && db.source_documents.saturating_sub(db.target_documents) <= db.missing_at_target
                && db.target_documents <= db.source_documents
        })
    }
}

/// One page read from the source and what of it the target lacks, as stubs.
struct Fetched {
    page: FeedPage,
    leaves: Vec<Map<String, Value>>,
}

/// A page being fetched ([`Mover::fetch_page`]).
type PageFetch<'a> = BoxFuture<'a, Result<Fetched>>;
/// A page being written ([`Mover::write_fetched`]).
type PageWrite<'a> = BoxFuture<'a, Result<(FeedPage, Counts, Vec<Value>)>>;

/// What a fetched page will count once written (its failures are counted then).
fn page_counts(page: &FeedPage, leaves: &[Map<String, Value>]) -> Counts {
    let mut counts = Counts { docs_seen: page.docs.len() as u64, ..Counts::default() };
    counts.leaves_written = leaves.len() as u64;
    for leaf in leaves {
        if let Some(Value::Object(attachments)) = leaf.get("_attachments") {
            counts.attachments += attachments.len() as u64;
            counts.attachment_bytes += attachments.values().filter_map(attachment_length).sum::<u64>();
        }
    }
    counts
}

/// How a leaf's attachments travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Travel {
    /// No attachments: the leaf as read.
    Plain,
    /// Inline, read again with its bytes; the bytes its attachments add up to.
    Inline(u64),
    /// Each attachment streamed on its own.
    Streamed,
}

/// The attachment bytes a stub (or an inline attachment) stands for; `None` when it says not.
fn attachment_length(attachment: &Value) -> Option<u64> {
    attachment
        .get("length")
        .and_then(Value::as_u64)
        .or_else(|| attachment.get("data").and_then(Value::as_str).map(|data| data.len() as u64 / 4 * 3))
}

/// How `leaf` (read as stubs) travels to a target of this kind (module doc, "Memory").
fn travel(leaf: &Map<String, Value>, remote_target: bool) -> Travel {
    let Some(Value::Object(attachments)) = leaf.get("_attachments") else { return Travel::Plain };
    if attachments.is_empty() {
        return Travel::Plain;
    }
    // An attachment that does not say its length is counted as a whole inline share.
    let bytes: u64 = attachments
        .values()
        .map(|a| attachment_length(a).unwrap_or(INLINE_ATTACHMENT_BYTES))
        .fold(0, u64::saturating_add);
    let streamable = attachments.values().all(|a| a.get("length").and_then(Value::as_u64).is_some())
        && (!remote_target || side::can_stream(leaf));
    if bytes <= INLINE_ATTACHMENT_BYTES || !streamable {
        Travel::Inline(bytes)
    } else {
        Travel::Streamed
    }
}

/// An inline group's leaves, as `(id, revs)` to read again with their attachments' bytes.
type InlineGroup = Vec<(String, Vec<String>)>;

/// A page's leaves sorted by how they travel: those without attachments, the inline ones in
/// groups of at most [`INLINE_GROUP_BYTES`] (as `(id, revs)` to read again), the streamed ones.
#[derive(Debug, Default)]
struct Plan {
    plain: Vec<Map<String, Value>>,
    inline_groups: Vec<Vec<(String, Vec<String>)>>,
    /// The attachment bytes of each inline group, in order.
    inline_group_bytes: Vec<u64>,
    streamed: Vec<Map<String, Value>>,
}

fn plan(leaves: Vec<Map<String, Value>>, remote_target: bool) -> Plan {
    let mut plan = Plan::default();
    let mut group: Vec<(String, Vec<String>)> = Vec::new();
    let mut group_bytes = 0u64;
    for leaf in leaves {
        match travel(&leaf, remote_target) {
            Travel::Plain => plan.plain.push(leaf),
            Travel::Streamed => plan.streamed.push(leaf),
            Travel::Inline(bytes) => {
                if !group.is_empty() && group_bytes.saturating_add(bytes) > INLINE_GROUP_BYTES {
                    plan.inline_groups.push(std::mem::take(&mut group));
                    plan.inline_group_bytes.push(group_bytes);
                    group_bytes = 0;
                }
                group_bytes = group_bytes.saturating_add(bytes);
                let text = |field: &str| leaf.get(field).and_then(Value::as_str).unwrap_or_default().to_owned();
                let (id, rev) = (text("_id"), text("_rev"));
                match group.last_mut() {
                    Some((last, revs)) if *last == id => revs.push(rev),
                    _ => group.push((id, vec![rev])),
                }
            }
        }
    }
    if !group.is_empty() {
        plan.inline_groups.push(group);
        plan.inline_group_bytes.push(group_bytes);
    }
    plan
}

/// The two ends of one database's copy: a side and a database name on each (the same name in a
/// deployment move; a replication's may differ).
pub struct CopyEnds<'a> {
    pub source: &'a Side,
    pub source_db: &'a str,
    pub target: &'a Side,
    pub target_db: &'a str,
}

/// Writes a page's leaves (read from the source as stubs) to the target, their attachments'
/// bytes moved as the module doc's "Memory" says (also for the replicator, `crate::replicator`);
/// the refusal rows.
pub async fn write_page(ends: &CopyEnds<'_>, leaves: Vec<Map<String, Value>>) -> Result<Vec<Value>> {
    write_page_gated(ends, leaves, None).await
}

/// [`write_page`], the leaves with attachments written while holding their share of
/// `attachments` (when given; [`write_attached`]): pages written at once then share the one
/// budget for attachment bytes that the "Memory" section of docs/migration.md gives the move,
/// however many of its pages are under way. The leaves without attachments are written beside those with (one page's plain write
/// does not wait for its attachments' reads and uploads, three round trips each on Firestore),
/// unless a document has leaves of both kinds: then one after the other, as two writers of one
/// document would otherwise meet. Into a backend, the first inline group, when it holds at most
/// [`JOINED_GROUP_BYTES`], is read first and written with the plain leaves in the same bulk
/// writes (its attachments stored at once before them, [`side::PageTarget::write_leaves`]).
async fn write_page_gated(
    ends: &CopyEnds<'_>,
    leaves: Vec<Map<String, Value>>,
    attachments: Option<&tokio::sync::Semaphore>,
) -> Result<Vec<Value>> {
    let Plan { plain, inline_groups, inline_group_bytes, streamed } =
        plan(leaves, matches!(ends.target, Side::Remote(_)));
    let mut groups: Vec<(InlineGroup, u64)> = inline_groups.into_iter().zip(inline_group_bytes).collect();
    // Into a backend, a first inline group of at most `JOINED_GROUP_BYTES` is written with the
    // plain leaves, in the same bulk writes (issue 38: on Firestore each write of a page is a
    // `:batchWrite`, and a page's few small attachments made one of their own).
    let joined = match groups.first() {
        Some((_, bytes)) if matches!(ends.target, Side::Local { .. }) && *bytes <= JOINED_GROUP_BYTES => {
            Some(groups.remove(0))
        }
        _ => None,
    };
    let first_ids: std::collections::HashSet<&str> = plain
        .iter()
        .filter_map(|leaf| leaf.get("_id").and_then(Value::as_str))
        .chain(joined.iter().flat_map(|(group, _)| group.iter().map(|(id, _)| id.as_str())))
        .collect();
    let shared = groups.iter().flat_map(|(group, _)| group).any(|(id, _)| first_ids.contains(id.as_str()))
        || streamed.iter().any(|leaf| leaf.get("_id").and_then(Value::as_str).is_some_and(|id| first_ids.contains(id)));
    drop(first_ids);
    // The target opened once for the page's writes, its `_revs_limit` read once
    // ([`side::PageTarget`]).
    let target = ends.target.page_target(ends.target_db);
    let target = &target;
    // Both writes boxed: side by side inline, their states made this function's future large
    // enough to overflow a 2 MiB thread stack where the replicator's job (which awaits it through
    // `write_page`) was polled in a debug build (contract `crash_sweep_replication_job`).
    let plain_write = Box::pin(async {
        let mut docs = plain;
        // The joined group holds its share of the budget while it is read and written.
        let mut _share = None;
        if let Some((group, bytes)) = &joined {
            _share = budget_share(attachments, bytes.div_ceil(BUDGET_UNIT_BYTES)).await?;
            docs.extend(ends.source.read_leaves(ends.source_db, group, true).await?);
        }
        match docs.is_empty() {
            true => Ok(Vec::new()),
            false => target.write_leaves(docs).await,
        }
    });
    let attached_write = Box::pin(write_attached(ends, target, groups, streamed, attachments));
    if shared {
        let mut failures = plain_write.await?;
        failures.extend(attached_write.await?);
        return Ok(failures);
    }
    let (mut failures, attached) = futures::try_join!(plain_write, attached_write)?;
    failures.extend(attached);
    Ok(failures)
}

/// The leaves of a page with attachments: the inline groups (with their attachment bytes) read
/// again with their bytes and written, then the streamed leaves. Each inline group holds its
/// bytes' worth of the budget `attachments` (when given) while it is read and written, each
/// streamed leaf a whole database's share ([`INLINE_GROUP_BYTES`]): so the attachment bytes in
/// memory stay within the budget's `--databases-at-once` shares, while pages whose attachments
/// are small (a few KiB) go on at once instead of waiting on each other's round trips (one
/// permit per page with any attachment let at most `--databases-at-once` pages of the whole move
/// past that point at once, issue 38).
async fn write_attached(
    ends: &CopyEnds<'_>,
    target: &side::PageTarget<'_>,
    inline_groups: Vec<(InlineGroup, u64)>,
    streamed: Vec<Map<String, Value>>,
    attachments: Option<&tokio::sync::Semaphore>,
) -> Result<Vec<Value>> {
    let mut failures = Vec::new();
    for (group, bytes) in inline_groups {
        let _share = budget_share(attachments, bytes.div_ceil(BUDGET_UNIT_BYTES)).await?;
        let docs = ends.source.read_leaves(ends.source_db, &group, true).await?;
        failures.extend(target.write_leaves(docs).await?);
    }
    for leaf in streamed {
        let _share = budget_share(attachments, BUDGET_UNITS_PER_DATABASE).await?;
        failures.extend(target.write_leaf_streamed(leaf, ends.source, ends.source_db).await?);
    }
    Ok(failures)
}

/// `units` of the attachment budget (at least 1, at most a database's share), held until
/// dropped; nothing without a budget.
async fn budget_share(
    budget: Option<&tokio::sync::Semaphore>,
    units: u64,
) -> Result<Option<tokio::sync::SemaphorePermit<'_>>> {
    let Some(budget) = budget else { return Ok(None) };
    let units = u32::try_from(units.clamp(1, BUDGET_UNITS_PER_DATABASE)).unwrap_or(u32::MAX);
    budget
        .acquire_many(units)
        .await
        .map(Some)
        .map_err(|_| Error::new(crate::error::ErrorKind::Internal, "the attachment budget was closed"))
}

/// The move's attachment budget: `databases_at_once` shares of [`INLINE_GROUP_BYTES`].
fn attachment_budget(databases_at_once: usize) -> tokio::sync::Semaphore {
    let units = (databases_at_once.max(1) as u64).saturating_mul(BUDGET_UNITS_PER_DATABASE);
    tokio::sync::Semaphore::new(usize::try_from(units).unwrap_or(usize::MAX).min(tokio::sync::Semaphore::MAX_PERMITS))
}

/// Runs a move until it is done, stopped by `stop`, or (following forever) stopped.
pub async fn run(source: Side, target: Side, options: MoveOptions, stop: StopSignal) -> Result<MoveReport> {
    run_recorded(source, target, options, stop, None).await
}

/// [`run`], keeping `record` written with the move's progress ([`board`]) and, when it ends,
/// how it ended.
pub async fn run_recorded(
    source: Side,
    target: Side,
    options: MoveOptions,
    stop: StopSignal,
    record: Option<RunRecord>,
) -> Result<MoveReport> {
    let board = Board::new("migrate", "copying", options.progress, record);
    let outcome = run_on_board(source, target, options, stop, &board).await;
    if let Some(verification) = outcome.as_ref().ok().and_then(|report| report.verification.as_ref()) {
        board.note("passed", Value::Bool(verification.passed));
    }
    let (state, error) = match &outcome {
        Ok(report) if report.status == MoveStatus::Complete => ("finished", None),
        Ok(_) => ("interrupted", None),
        Err(err) => ("failed", Some(err.to_string())),
    };
    board.close(state, error.as_deref()).await;
    outcome
}

async fn run_on_board(
    source: Side,
    target: Side,
    options: MoveOptions,
    stop: StopSignal,
    board: &Arc<Board>,
) -> Result<MoveReport> {
    let started = Instant::now();
    let identity = MoveIdentity { format: checkpoint::FORMAT, from: source.name(), to: target.name() };
    let dir = options.checkpoint.clone().unwrap_or_else(|| Checkpoints::default_dir(&identity.from, &identity.to));
    let checkpoints = Checkpoints::open(&dir, &identity, options.restart)?;
    let stop = StopFlag::new(stop);
    let ticker = board.ticker();
    let attachment_budget = attachment_budget(options.databases_at_once);
    let mut mover = Mover {
        source,
        target,
        options,
        checkpoints,
        stop,
        board: Arc::clone(board),
        reports: BTreeMap::new(),
        deleted_at_source: Vec::new(),
        deleted_at_target: Vec::new(),
        passes: 0,
        settings_copied: Mutex::new(BTreeMap::new()),
        settings_checked: None,
        attachment_budget,
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
    /// The settings this run last wrote at the target, per database.
    settings_copied: Mutex<BTreeMap<String, Settings>>,
    /// When the settings were last read from the source.
    settings_checked: Option<Instant>,
    /// A share of [`INLINE_GROUP_BYTES`] per database copied at once ([`attachment_budget`]):
    /// the leaves with attachments of the pages being written hold their bytes' worth
    /// ([`write_attached`]), so writing several pages at once does not raise the move's
    /// attachment memory above `--databases-at-once` shares.
    attachment_budget: tokio::sync::Semaphore,
}

impl Mover {
    /// The copy pass, then following as asked.
    async fn run_passes(&mut self) -> Result<MoveStatus> {
        if !self.pass(true).await? {
            return Ok(MoveStatus::Interrupted);
        }
        match self.options.follow {
            FollowMode::Off => {}
            FollowMode::UntilCaughtUp => {
                // The copy pass read every feed to its end after this run began: one more pass
                // takes what came during the copy and databases created meanwhile.
                if !self.pass(true).await? {
                    return Ok(MoveStatus::Interrupted);
                }
            }
            FollowMode::Forever => loop {
                self.board.following();
                let mut stop = self.stop.clone();
                tokio::select! {
                    _ = stop.raised() => return Ok(MoveStatus::Stopped),
                    _ = tokio::time::sleep(POLL_INTERVAL) => {}
                }
                let settings_due = self.settings_checked.is_none_or(|at| at.elapsed() >= SETTINGS_INTERVAL);
                if !self.pass(settings_due).await? {
                    return Ok(MoveStatus::Stopped);
                }
            },
        }
        Ok(MoveStatus::Complete)
    }

    /// One pass over every selected database, reading their settings again when
    /// `settings_due`; `false` when stopped before it ended.
    async fn pass(&mut self, settings_due: bool) -> Result<bool> {
        self.passes += 1;
        let first = self.passes == 1;
        if settings_due {
            self.settings_checked = Some(Instant::now());
        }
        let names: Vec<String> =
            self.source.list().await?.into_iter().filter(|name| self.options.selection.admits(name)).collect();
        self.board.start_pass(names.len());
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
                let result = this.copy_database(&name, first, settings_due).await;
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
                    if report.settings_updated > 0 {
                        existing.security = report.security;
                        existing.revs_limit = report.revs_limit;
                        existing.settings_updated += report.settings_updated;
                    }
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

    /// Reads one page from the source and what of it the target lacks: everything, unread, when
    /// `target_fresh` (the target database was created by this pass: [`Side::assume_missing`]).
    async fn fetch(&self, db: &str, since: &Value, target_fresh: bool) -> Result<Fetched> {
        let page = self.source.changes(db, since, self.options.batch_size).await?;
        if page.docs.is_empty() {
            return Ok(Fetched { page, leaves: Vec::new() });
        }
        let wanted: Vec<(String, Vec<String>)> = page.docs.iter().map(|d| (d.id.clone(), d.leaves.clone())).collect();
        let missing = match target_fresh {
            true => self.target.assume_missing(db, &wanted),
            false => self.target.missing(db, &wanted).await?,
        };
        let leaves = self.source.read_leaves(db, &missing, false).await?;
        Ok(Fetched { page, leaves })
    }

    /// Copies the database's settings when this run has not, or when they changed at the source
    /// since this run copied them; whether they were written.
    async fn copy_settings(&self, db: &str, report: &mut DbReport) -> Result<bool> {
        let settings = self.source.settings(db).await?;
        let known = self.settings_copied.lock().ok().and_then(|copied| copied.get(db).cloned());
        if known.as_ref() == Some(&settings) {
            return Ok(false);
        }
        self.target.put_settings(db, &settings).await?;
        report.security = settings.security.clone();
        report.revs_limit = settings.revs_limit;
        if let Ok(mut copied) = self.settings_copied.lock() {
            copied.insert(db.to_owned(), settings);
        }
        Ok(known.is_some())
    }

    /// Writes a page's leaves (read as stubs) to the target ([`write_page`]).
    async fn write_page(&self, db: &str, leaves: Vec<Map<String, Value>>) -> Result<Vec<Value>> {
        let ends = CopyEnds { source: &self.source, source_db: db, target: &self.target, target_db: db };
        write_page_gated(&ends, leaves, Some(&self.attachment_budget)).await
    }

    /// [`Mover::fetch`] from `since`, boxed to be awaited beside the writes of earlier pages.
    fn fetch_page<'a>(&'a self, db: &'a str, since: Value, target_fresh: bool) -> PageFetch<'a> {
        Box::pin(async move { self.fetch(db, &since, target_fresh).await })
    }

    /// A fetched page written ([`Mover::write_page`]), boxed; answers the page, what it counts
    /// and the leaves refused.
    fn write_fetched<'a>(&'a self, db: &'a str, page: FeedPage, leaves: Vec<Map<String, Value>>) -> PageWrite<'a> {
        Box::pin(async move {
            let counts = page_counts(&page, &leaves);
            let failures = self.write_page(db, leaves).await?;
            Ok((page, counts, failures))
        })
    }

    /// Copies one database from its checkpoint to the end of its source feed; the report of this
    /// pass and whether it got to the end (not stopped). Its settings are copied on the first
    /// pass, and on a later one (`settings_due`) when they changed at the source.
    async fn copy_database(&self, db: &str, first: bool, settings_due: bool) -> Result<(DbReport, bool)> {
        let mut state: DbCheckpoint = self.checkpoints.load(db)?;
        let mut report = DbReport { name: db.to_owned(), ..DbReport::default() };
        if first || !state.prepared {
            report.created = self.target.ensure(db).await?;
            self.copy_settings(db, &mut report).await?;
            state.prepared = true;
            self.checkpoints.save(db, &state)?;
        } else if settings_due && self.copy_settings(db, &mut report).await? {
            report.settings_updated = 1;
            tracing::info!(database = db, "copied a change of _security or _revs_limit at the source");
        }
        let expected = match state.copied {
            true => 0,
            false => self.source.estimate(db).await?.unwrap_or(0).saturating_sub(state.counts.docs_seen),
        };
        self.board.start_db(db, expected);
        // A database this pass created holds nothing but what this pass writes into it.
        let target_fresh = report.created;
        // Pages are fetched one after another, each while the pages before it are written, and
        // up to `pages_at_once` are written at once; a page is checkpointed once it and
        // every page before it are written, so a checkpoint never passes an unwritten page.
        // (Boxed futures and a loop, not stream adapters over closures: those trip rustc's
        // higher-ranked `Send` check where the service spawns a run.)
        let mut fetching: Option<PageFetch<'_>> = Some(self.fetch_page(db, state.since.clone(), target_fresh));
        let mut writing: FuturesOrdered<PageWrite<'_>> = FuturesOrdered::new();
        let mut finished = false;
        loop {
            let may_fetch =
                fetching.is_some() && writing.len() < self.options.pages_at_once.clamp(1, MAX_PAGES_AT_ONCE);
            tokio::select! {
                biased;
                Some(written) = writing.next(), if !writing.is_empty() => {
                    let (page, mut counts, failures) = written?;
                    counts.failed = failures.len() as u64;
                    let room = self.options.max_issues.saturating_sub(report.failures.len());
                    report.failures.extend(failures.into_iter().take(room));
                    state.since = page.last_seq;
                    state.counts.add(&counts);
                    state.copied |= page.at_end;
                    self.checkpoints.save(db, &state)?;
                    report.this_run.add(&counts);
                    let landed = counts.docs_seen.saturating_sub(counts.failed);
                    self.board.advance(db, counts.docs_seen, landed, counts.failed);
                    finished = page.at_end;
                }
                Some(fetched) = OptionFuture::from(fetching.as_mut()), if may_fetch => {
                    let Fetched { page, leaves } = fetched?;
                    // Stopping: the page fetched last is written, and no other is fetched.
                    fetching = match page.at_end || self.stop.is_raised() {
                        true => None,
                        false => Some(self.fetch_page(db, page.last_seq.clone(), target_fresh)),
                    };
                    writing.push_back(self.write_fetched(db, page, leaves));
                }
                else => break,
            }
        }
        self.board.end_db(db);
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
        assert!(everything.admits("a/b") && !everything.admits("_global_changes"));
        let patterns = Selection { include: vec!["*".into(), "_*".into()], exclude: vec![] };
        let without = Selection { include: vec![], exclude: vec!["_*".into()] };
        for system in crate::backend::catalog::SYSTEM_DATABASES {
            let by_default = MOVED_BY_DEFAULT.contains(&system);
            assert_eq!(everything.admits(system), by_default, "{system}: taken by default or not");
            assert!(!patterns.admits(system), "{system}: never by a pattern");
            assert!(!without.admits(system), "{system}: excluded by a pattern");
            let named = Selection { include: vec![system.into()], exclude: vec![] };
            assert!(named.admits(system) && !named.admits("a"), "{system}: named exactly");
        }
        assert!(everything.admits("_users") && !everything.admits("_global_changes"));
        assert!(!everything.admits("_other"), "not kept here");
    }

    /// A catalog over embedded databases that hands out each database behind one counting
    /// layer, so a test sees every call the move made to it.
    struct CountingCatalog {
        inner: crate::backend::catalog::EmbeddedCatalog,
        layers: Mutex<std::collections::HashMap<String, Arc<crate::database::engine::counting::CountingBackend>>>,
        /// How long each `bulk_write` of every database waits (none: at once).
        bulk_pause: Option<std::time::Duration>,
        /// Whether each database's layer claims other processes share it (settings read at
        /// every request, as over DynamoDB or Firestore).
        shared: bool,
        /// Whether each database's layer takes small attachments at once, as Firestore does.
        small_at_once: bool,
        /// The catalog's opens, by database name.
        opens: Mutex<std::collections::HashMap<String, usize>>,
    }

    impl CountingCatalog {
        fn layer(
            &self,
            name: &DbName,
            backend: Arc<dyn crate::backend::DocumentBackend>,
        ) -> Arc<dyn crate::backend::DocumentBackend> {
            let mut layers = self.layers.lock().unwrap();
            let layer = layers.entry(name.to_string()).or_insert_with(|| {
                let layer = crate::database::engine::counting::CountingBackend::over(backend, false);
                if let Some(pause) = self.bulk_pause {
                    layer.pause_bulk_writes(pause);
                }
                if self.shared {
                    layer.claim_shared();
                }
                if self.small_at_once {
                    layer.take_small_attachments_at_once();
                }
                layer
            });
            Arc::clone(layer) as Arc<dyn crate::backend::DocumentBackend>
        }

        fn reads(&self, name: &str) -> usize {
            let layers = self.layers.lock().unwrap();
            let counts = layers.get(name).map(|layer| layer.taken_counts()).unwrap_or_default();
            // The documents' reads; a database's settings (`get_local` of its own `_local`
            // document) are read once per database whatever the pages do.
            counts
                .iter()
                .filter(|(call, _)| matches!(**call, "get" | "get_many" | "get_many_local"))
                .map(|(_, n)| n)
                .sum()
        }
    }

    #[async_trait::async_trait]
    impl crate::backend::catalog::Catalog for CountingCatalog {
        fn describe(&self) -> String {
            "counting".into()
        }
        async fn create(&self, name: &DbName) -> Result<Arc<dyn crate::backend::DocumentBackend>> {
            let backend = self.inner.create(name).await?;
            Ok(self.layer(name, backend))
        }
        async fn open(&self, name: &DbName) -> Result<Option<Arc<dyn crate::backend::DocumentBackend>>> {
            *self.opens.lock().unwrap().entry(name.to_string()).or_default() += 1;
            Ok(self.inner.open(name).await?.map(|backend| self.layer(name, backend)))
        }
        async fn delete(&self, name: &DbName) -> Result<bool> {
            self.inner.delete(name).await
        }
        async fn list(&self) -> Result<Vec<DbName>> {
            self.inner.list().await
        }
    }

    /// The target's settings read by a move of one database besides its pages' writes: copying
    /// its `_security` and `_revs_limit` (`Database::update_settings` reads the stored
    /// settings document, then the settings).
    const SETTINGS_READS_BESIDE_PAGES: usize = 2;
    /// The target's catalog opens of a move of one database besides its pages' writes.
    const OPENS_BESIDE_PAGES: usize = 2;

    fn replicated(id: &str, rev: &str, n: u64) -> (String, Vec<crate::database::Write>) {
        let (generation, hash) = rev.split_once('-').unwrap();
        let path = crate::backend::rev_tree::RevPath { start: generation.parse().unwrap(), ids: vec![hash.to_owned()] };
        let body = serde_json::json!({ "n": n }).as_object().cloned().unwrap();
        (id.to_owned(), vec![crate::database::Write::Replicated { path, deleted: false, body }])
    }

    /// The databases of an embedded catalog in `dir`'s file `file`.
    fn embedded_databases(dir: &std::path::Path, file: &str) -> Arc<crate::database::Databases> {
        let catalog = crate::backend::catalog::EmbeddedCatalog::new(&dir.join(file), Default::default());
        Arc::new(crate::database::Databases::new(Some(Arc::new(catalog)), 4))
    }

    /// Writes `docs` into `db`, every one acknowledged.
    async fn write_all(db: &crate::database::Database, docs: &[(String, Vec<crate::database::Write>)]) {
        for answers in db.write_many(docs).await.unwrap() {
            answers.unwrap().into_iter().for_each(|answer| drop(answer.unwrap()));
        }
    }

    impl CountingCatalog {
        /// A counting catalog over the embedded file `path`.
        fn over_file(path: &std::path::Path, bulk_pause: Option<std::time::Duration>, shared: bool) -> Arc<Self> {
            Arc::new(CountingCatalog {
                inner: crate::backend::catalog::EmbeddedCatalog::new(path, Default::default()),
                layers: Mutex::new(Default::default()),
                bulk_pause,
                shared,
                small_at_once: false,
                opens: Mutex::new(Default::default()),
            })
        }
    }

    /// A move in pages of `batch_size`, not verified, checkpointed under `checkpoints`.
    fn unverified_move(batch_size: usize, checkpoints: std::path::PathBuf) -> MoveOptions {
        MoveOptions { batch_size, verify: false, checkpoint: Some(checkpoints), ..MoveOptions::default() }
    }

    /// Runs a move from `source` into `target` to its end (never stopped) and checks it completed.
    async fn move_to_the_end(source: Side, target: Side, options: MoveOptions) -> MoveReport {
        let stop: StopSignal = Box::pin(futures::future::pending());
        let report = run(source, target, options, stop).await.unwrap();
        assert_eq!(report.status, MoveStatus::Complete);
        report
    }

    /// Into a database the move creates, the pages' documents are written without reading
    /// them at the target first (`Side::assume_missing`); into one that already exists they are
    /// read (which leaves it lacks). A document someone else wrote into the fresh database before
    /// the page's write keeps its branch beside the copied one: nothing is lost.
    #[tokio::test]
    async fn a_database_the_move_creates_is_written_without_reading_it_first() {
        let dir = tempfile::tempdir().unwrap();
        let source = embedded_databases(dir.path(), "source.redb");
        for name in ["fresh", "existing"] {
            let db = source.create(&DbName::parse(name).unwrap()).await.unwrap();
            let docs: Vec<_> = (0..250).map(|i| replicated(&format!("doc{i:03}"), "1-aaaa", i)).collect();
            write_all(&db, &docs).await;
        }
        let target_catalog = CountingCatalog::over_file(&dir.path().join("target.redb"), None, false);
        let target = Arc::new(crate::database::Databases::new(Some(target_catalog.clone()), 4));
        let existing = target.create(&DbName::parse("existing").unwrap()).await.unwrap();
        drop(existing.write_many(&[replicated("doc007", "1-bbbb", 7)]).await.unwrap());
        target_catalog.reads("existing");
        let options = unverified_move(100, dir.path().join("checkpoints"));
        move_to_the_end(Side::local(source, "source"), Side::local(Arc::clone(&target), "target"), options).await;
        assert_eq!(
            target_catalog.reads("fresh"),
            0,
            "pages written into the database the move created read nothing first"
        );
        assert!(target_catalog.reads("existing") >= 2, "pages into an existing database read their documents first");
        for name in ["fresh", "existing"] {
            let db = target.open(&DbName::parse(name).unwrap()).await.unwrap().unwrap();
            let ids: Vec<String> = (0..250).map(|i| format!("doc{i:03}")).collect();
            let states = db.read_many(&ids).await.unwrap();
            assert!(states.iter().all(Option::is_some), "{name}: every document copied");
        }
        let kept = target
            .open(&DbName::parse("existing").unwrap())
            .await
            .unwrap()
            .unwrap()
            .read("doc007")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(kept.tree.leaves().len(), 2, "the target's own branch and the copied one");

        // Assumed missing but written meanwhile by another writer: the creation fails, and the
        // document is read and merged, keeping both branches.
        let side = Side::local(Arc::clone(&target), "target");
        let fresh = target.open(&DbName::parse("fresh").unwrap()).await.unwrap().unwrap();
        drop(fresh.write_many(&[replicated("late", "1-bbbb", 1)]).await.unwrap());
        let lacking = side.assume_missing("fresh", &[("late".to_owned(), vec!["1-aaaa".to_owned()])]);
        assert_eq!(lacking, vec![("late".to_owned(), vec!["1-aaaa".to_owned()])]);
        let leaf =
            serde_json::json!({"_id": "late", "_rev": "1-aaaa", "_revisions": {"start": 1, "ids": ["aaaa"]}, "n": 2});
        let refused = side.write_leaves("fresh", vec![leaf.as_object().cloned().unwrap()]).await.unwrap();
        assert!(refused.is_empty(), "{refused:?}");
        let merged = fresh.read("late").await.unwrap().unwrap();
        assert_eq!(merged.tree.leaves().len(), 2, "the other writer's branch and the copied one");
    }

    /// Over a backend other processes share, where `_revs_limit` is read at every request
    /// (issue 36), a page's writes read it once, not once per 100-document write: a move of
    /// 1,000 documents in pages of 500 (5 writes each) reads the target's settings twice for
    /// its pages, beside the reads of creating the database and copying its settings.
    #[tokio::test]
    async fn a_page_reads_the_target_s_revs_limit_once() {
        let dir = tempfile::tempdir().unwrap();
        let source = embedded_databases(dir.path(), "source.redb");
        let db = source.create(&DbName::parse("limits").unwrap()).await.unwrap();
        let docs: Vec<_> = (0..1000).map(|i| replicated(&format!("doc{i:04}"), "1-aaaa", i)).collect();
        write_all(&db, &docs).await;
        let target_catalog = CountingCatalog::over_file(&dir.path().join("target.redb"), None, true);
        let target = Arc::new(crate::database::Databases::new(Some(target_catalog.clone()), 4));
        let options = unverified_move(500, dir.path().join("checkpoints"));
        let report =
            move_to_the_end(Side::local(source, "source"), Side::local(Arc::clone(&target), "target"), options).await;
        assert_eq!(report.totals.docs_seen, 1000);
        let counts = target_catalog.layers.lock().unwrap()["limits"].taken_counts();
        let settings_reads = counts.get("get_local").copied().unwrap_or(0);
        assert_eq!(settings_reads, SETTINGS_READS_BESIDE_PAGES + 2, "one read of the settings per page: {counts:?}");
    }

    /// `count` first-revision leaves `doc00`, `doc01`, …, every even one with a small inline
    /// attachment `a.txt` of its own bytes.
    fn leaves_every_other_with_an_attachment(count: usize) -> Vec<Map<String, Value>> {
        (0..count)
            .map(|i| {
                let mut leaf = serde_json::json!({
                    "_id": format!("doc{i:02}"), "_rev": "1-aaaa", "_revisions": {"start": 1, "ids": ["aaaa"]}, "n": i,
                });
                if i % 2 == 0 {
                    let data = base64::Engine::encode(
                        &base64::engine::general_purpose::STANDARD,
                        format!("bytes of document {i}"),
                    );
                    leaf["_attachments"] =
                        serde_json::json!({ "a.txt": { "content_type": "text/plain", "data": data } });
                }
                leaf.as_object().cloned().unwrap()
            })
            .collect()
    }

    /// The leaves of a page that carry attachments are saved in one bulk write, and the
    /// manifests of their bytes (touched before the save, so that a garbage collection running
    /// meanwhile keeps them) are read in one batched read for all of them, not one per
    /// document: a page of 20 documents, 10 with an attachment of their own, reads manifests
    /// once.
    #[tokio::test]
    async fn a_page_s_attachment_manifests_are_read_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let source = embedded_databases(dir.path(), "source.redb");
        let source_side = Side::local(Arc::clone(&source), "source");
        assert!(source_side.ensure("atts").await.unwrap());
        let leaves = leaves_every_other_with_an_attachment(20);
        assert!(source_side.write_leaves("atts", leaves).await.unwrap().is_empty());
        let target_catalog = CountingCatalog::over_file(&dir.path().join("target.redb"), None, false);
        let target = Arc::new(crate::database::Databases::new(Some(target_catalog.clone()), 4));
        let options = unverified_move(100, dir.path().join("checkpoints"));
        let report = move_to_the_end(source_side, Side::local(Arc::clone(&target), "target"), options).await;
        assert_eq!(report.totals.docs_seen, 20);
        let counts = target_catalog.layers.lock().unwrap()["atts"].taken_counts();
        assert_eq!(counts.get("get_many_local").copied(), Some(1), "one batched read of the manifests: {counts:?}");
        let copied = target.open(&DbName::parse("atts").unwrap()).await.unwrap().unwrap();
        let state = copied.read("doc04").await.unwrap().unwrap();
        let body = state.tree.winner().map(|leaf| leaf.body.clone()).unwrap_or_default();
        assert!(body.get("_attachments").is_some_and(|a| a.get("a.txt").is_some()), "the attachment copied: {body:?}");
    }

    /// A page's small attachments are stored with their manifests in one call where the
    /// target's backend takes them so (Firestore's commit), not a chunk and a manifest each;
    /// its leaves with and without attachments go in the same bulk write; and the page opens
    /// the target once for its writes (a read of the catalog's marker on DynamoDB and
    /// Firestore) and reads its `_revs_limit` once: a move of 40 documents in two pages of 20,
    /// 10 of each page's with an attachment of their own, over a backend other processes share.
    #[tokio::test]
    async fn a_page_s_small_attachments_are_stored_at_once_and_its_target_opened_once() {
        let dir = tempfile::tempdir().unwrap();
        let source = embedded_databases(dir.path(), "source.redb");
        let source_side = Side::local(Arc::clone(&source), "source");
        assert!(source_side.ensure("atts").await.unwrap());
        let leaves = leaves_every_other_with_an_attachment(40);
        assert!(source_side.write_leaves("atts", leaves).await.unwrap().is_empty());
        let mut catalog = CountingCatalog::over_file(&dir.path().join("target.redb"), None, true);
        Arc::get_mut(&mut catalog).unwrap().small_at_once = true;
        let target = Arc::new(crate::database::Databases::new(Some(catalog.clone()), 4));
        let options = MoveOptions { pages_at_once: 1, ..unverified_move(20, dir.path().join("checkpoints")) };
        let report = move_to_the_end(source_side, Side::local(Arc::clone(&target), "target"), options).await;
        assert_eq!(report.totals.docs_seen, 40);
        let counts = catalog.layers.lock().unwrap()["atts"].taken_counts();
        assert_eq!(counts.get("put_small_attachments").copied(), Some(2), "one call a page: {counts:?}");
        assert_eq!(counts.get("put_attachment_chunk"), None, "no chunk alone: {counts:?}");
        assert_eq!(counts.get("bulk_write").copied(), Some(2), "one bulk write a page, with and without attachments");
        assert_eq!(counts.get("get_local").copied(), Some(SETTINGS_READS_BESIDE_PAGES + 2), "{counts:?}");
        let opens = catalog.opens.lock().unwrap().get("atts").copied().unwrap_or(0);
        assert_eq!(opens, OPENS_BESIDE_PAGES + 2, "the target opened once a page");
        let copied = target.open(&DbName::parse("atts").unwrap()).await.unwrap().unwrap();
        for i in (0..40).step_by(2) {
            let state = copied.read(&format!("doc{i:02}")).await.unwrap().unwrap();
            let body = state.tree.winner().map(|leaf| leaf.body.clone()).unwrap_or_default();
            let sha = body["_attachments"]["a.txt"][crate::database::doc_attachments::SHA256_FIELD].as_str().unwrap();
            let bytes: Vec<bytes::Bytes> =
                futures::TryStreamExt::try_collect(copied.attachments().read(sha, None).await.unwrap()).await.unwrap();
            assert_eq!(bytes.concat(), format!("bytes of document {i}").into_bytes());
        }
    }

    /// `pages_at_once` pages of a database are written at once, no more: with every bulk write
    /// of the target slowed down, a move of 20 pages of 100 documents (one bulk write a page)
    /// keeps exactly that many in flight, and every document arrives.
    #[tokio::test]
    async fn a_database_s_pages_are_written_as_many_at_once_as_asked() {
        let dir = tempfile::tempdir().unwrap();
        let source = embedded_databases(dir.path(), "source.redb");
        let db = source.create(&DbName::parse("pages").unwrap()).await.unwrap();
        let docs: Vec<_> = (0..2000).map(|i| replicated(&format!("doc{i:04}"), "1-aaaa", i)).collect();
        write_all(&db, &docs).await;
        for pages_at_once in [1, 4] {
            let target_catalog = CountingCatalog::over_file(
                &dir.path().join(format!("target{pages_at_once}.redb")),
                Some(std::time::Duration::from_millis(40)),
                false,
            );
            let target = Arc::new(crate::database::Databases::new(Some(target_catalog.clone()), 4));
            let options = MoveOptions {
                pages_at_once,
                ..unverified_move(100, dir.path().join(format!("checkpoints{pages_at_once}")))
            };
            let source_side = Side::local(Arc::clone(&source), "source");
            let report = move_to_the_end(source_side, Side::local(Arc::clone(&target), "target"), options).await;
            assert_eq!(report.totals.docs_seen, 2000);
            let most = target_catalog.layers.lock().unwrap()["pages"].most_bulk_writes_at_once();
            assert_eq!(most, pages_at_once, "bulk writes in flight at once with pages_at_once {pages_at_once}");
            let copied = target.open(&DbName::parse("pages").unwrap()).await.unwrap().unwrap();
            let ids: Vec<String> = (0..2000).map(|i| format!("doc{i:04}")).collect();
            assert!(copied.read_many(&ids).await.unwrap().iter().all(Option::is_some), "every document copied");
        }
    }

    /// The attachment budget in bytes: two pages' small inline groups hold their shares at once
    /// (one permit per page made the second wait), a streamed leaf takes a database's whole
    /// share, and no share is more than that: the memory bound stays `--databases-at-once`
    /// groups of INLINE_GROUP_BYTES.
    #[tokio::test]
    async fn small_attachments_share_the_budget_and_large_ones_take_a_whole_share() {
        let budget = attachment_budget(1);
        let total = BUDGET_UNITS_PER_DATABASE as usize;
        assert_eq!(budget.available_permits(), total);
        let group = (4u64 << 10).div_ceil(BUDGET_UNIT_BYTES);
        let first = budget_share(Some(&budget), group).await.unwrap();
        let second = budget_share(Some(&budget), group).await.unwrap();
        assert_eq!(budget.available_permits(), total - 8, "two groups of 4 KiB under way at once");
        let streamed = tokio::time::timeout(
            std::time::Duration::from_millis(50),
            budget_share(Some(&budget), BUDGET_UNITS_PER_DATABASE),
        )
        .await;
        assert!(streamed.is_err(), "a streamed leaf waits for the whole share");
        drop((first, second));
        let whole = budget_share(Some(&budget), u64::MAX).await.unwrap();
        assert_eq!(budget.available_permits(), 0, "no share is more than a database's");
        drop(whole);
        assert!(budget_share(None, u64::MAX).await.unwrap().is_none(), "no budget, no wait");
    }

    /// Refused leaves make the status 7 even though the read-back misses them; anything the
    /// refusals do not explain is 6.
    #[test]
    fn refused_leaves_explain_the_read_back() {
        let refused = Counts { failed: 2, ..Counts::default() };
        let database = DbReport { name: "db".into(), this_run: refused, ..DbReport::default() };
        let read_back = verify::DbVerify {
            name: "db".into(),
            leaves: 10,
            missing_at_target: 2,
            source_documents: 8,
            target_documents: 7,
            security_equal: true,
            revs_limit_equal: true,
            ..verify::DbVerify::default()
        };
        let report = |read_back: verify::DbVerify| MoveReport {
            command: "migrate",
            mode: "databases",
            from: "a".into(),
            to: "b".into(),
            status: MoveStatus::Complete,
            checkpoint: String::new(),
            elapsed_seconds: 0.0,
            passes: 1,
            databases: vec![database.clone()],
            totals: refused,
            docs_per_second: 0.0,
            deleted_at_source: Vec::new(),
            deleted_at_target: Vec::new(),
            local_documents: LOCAL_DOCUMENTS,
            verification: Some(VerifyReport {
                passed: false,
                databases: vec![read_back],
                leaves: 10,
                interrupted: false,
            }),
            peak_rss_bytes: None,
        };
        assert_eq!(report(read_back.clone()).exit_code(), crate::migrate::EXIT_INCOMPLETE);
        let more_missing = verify::DbVerify { missing_at_target: 3, ..read_back.clone() };
        assert_eq!(report(more_missing).exit_code(), crate::migrate::EXIT_DIFFERENT);
        let different = verify::DbVerify { different: 1, ..read_back.clone() };
        assert_eq!(report(different).exit_code(), crate::migrate::EXIT_DIFFERENT);
        let extra = verify::DbVerify { extra_at_target: 1, ..read_back };
        assert_eq!(report(extra).exit_code(), crate::migrate::EXIT_DIFFERENT);
    }

    fn leaf(id: &str, rev: &str, attachments: Value) -> Map<String, Value> {
        let mut leaf = Map::new();
        leaf.insert("_id".into(), Value::from(id));
        leaf.insert("_rev".into(), Value::from(rev));
        if !attachments.is_null() {
            leaf.insert("_attachments".into(), attachments);
        }
        leaf
    }

    fn stub(length: u64) -> Value {
        serde_json::json!({"content_type": "application/octet-stream", "revpos": 1, "digest": "md5-x", "length": length, "stub": true})
    }

    /// Leaves without attachments go as read; small ones inline in groups of at most
    /// INLINE_GROUP_BYTES (a document's leaves side by side); larger ones streamed; a name
    /// pouchdb-server would change keeps a leaf inline only for a server target.
    #[test]
    fn leaves_travel_by_their_attachments_sizes() {
        let small = INLINE_ATTACHMENT_BYTES / 2;
        let leaves = vec![
            leaf("plain", "1-a", Value::Null),
            leaf("s1", "1-a", serde_json::json!({"a": stub(small), "b": stub(small)})),
            leaf("s1", "2-b", serde_json::json!({"a": stub(small)})),
            leaf("big", "1-a", serde_json::json!({"a": stub(small), "b": stub(small + 1)})),
            leaf("odd", "1-a", serde_json::json!({"x\\y": stub(INLINE_ATTACHMENT_BYTES * 4)})),
        ];
        let local = plan(leaves.clone(), false);
        assert_eq!(local.plain.len(), 1);
        assert_eq!(local.inline_groups, vec![vec![("s1".to_owned(), vec!["1-a".to_owned(), "2-b".to_owned()])]]);
        let streamed: Vec<&Value> = local.streamed.iter().map(|l| &l["_id"]).collect();
        assert_eq!(streamed, vec!["big", "odd"]);
        let remote = plan(leaves, true);
        assert_eq!(remote.streamed.len(), 1);
        assert_eq!(remote.inline_groups.concat().len(), 2);

        // Groups close before they pass INLINE_GROUP_BYTES of attachment bytes.
        let many: Vec<Map<String, Value>> = (0..40)
            .map(|i| leaf(&format!("d{i}"), "1-a", serde_json::json!({"a": stub(INLINE_ATTACHMENT_BYTES)})))
            .collect();
        let grouped = plan(many, false);
        let per_group = (INLINE_GROUP_BYTES / INLINE_ATTACHMENT_BYTES) as usize;
        assert_eq!(grouped.inline_groups.len(), 40usize.div_ceil(per_group));
        assert!(grouped.inline_groups.iter().all(|group| group.len() <= per_group));
    }
}
