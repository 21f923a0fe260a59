//! Following a live source (`migrate --follow`): after the copy, the source's change feed is read
//! from the position recorded before the copy began, and each changed document's current state is
//! applied to the target, until the run is stopped or, with `--until-caught-up`, has caught up.
//!
//! **Order.** Pages of changes are applied one after another, and each document's state is read
//! from the source when its page is applied, never earlier. The source only moves forward, so the
//! target receives each document's states in the source's order: an older state never replaces a
//! newer one. A change whose document has changed again since simply applies the newer state (and
//! the later change finds the target already in sync).
//!
//! **Idempotence and crashes.** The checkpoint records the feed position after each page, once its
//! every document is handled. After `kill -9` the pages after it are read again; their documents
//! are compared with the target first and those already in the source's state are left alone.
//!
//! **Conflicts.** A target document this migration did not put there (the [`Journal`] has no
//! fingerprint of its content) was changed at the target independently. It is not overwritten
//! silently: `--on-conflict fail` stops, `skip` leaves it and reports it, `overwrite` replaces it
//! and reports it. Every write is conditional on the target revision just read, so a target change
//! that races the migration is caught too.
//!
//! **Lag.** `lag_changes` is how many changes the feed says wait after the page just applied;
//! `lag_seconds` is the time since the moment up to which every change is applied (the read of
//! the last page that reached the end of the feed, less the feed's settle window), 0 when nothing
//! waits.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use serde::{Deserialize, Serialize};

use super::canonical::content_hash;
use super::journal::{fingerprint, Fingerprint, Journal, ABSENT};
use super::progress::Progress;
use super::report::Ledger;
use super::sink::{self, ConflictPolicy, Outgoing};
use super::{Filter, Options};
use crate::backend::{BulkWrite, DocumentBackend, Precondition, StoredDocument};
use crate::error::{Error, Result};
use crate::feed::{read_page, FeedPage, PollBackoff};
use crate::model::DocumentId;

/// How many times a document is applied again when the target moves between the read and the
/// conditional write (or a write fails temporarily).
const APPLY_ATTEMPTS: u32 = 5;
/// Deletes sent at once (the trait has no bulk delete).
const DELETE_CONCURRENCY: usize = 8;
/// The longest pause between polls of a feed that has nothing new.
const POLL_CEILING: Duration = Duration::from_secs(1);
/// How often an idle follower saves its position (a busy one saves after every page).
const IDLE_SAVE_INTERVAL: Duration = Duration::from_secs(10);

/// Whether and how long a migration follows the source after its copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FollowMode {
    /// Copy a snapshot and stop (plain `migrate`).
    #[default]
    Off,
    /// Follow until stopped (`--follow`).
    Forever,
    /// Follow until every change committed before the run started is applied
    /// (`--until-caught-up`).
    UntilCaughtUp,
}

/// A future that resolves when the run is to stop (SIGINT/SIGTERM for the command).
pub type StopSignal = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A [`StopSignal`] that can be waited for any number of times, and asked.
#[derive(Clone)]
pub struct StopFlag(tokio::sync::watch::Receiver<bool>);

impl StopFlag {
    pub fn new(signal: StopSignal) -> Self {
        let (raise, flag) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            signal.await;
            let _ = raise.send(true);
        });
        StopFlag(flag)
    }

    /// Resolves once the stop signal has come (at once if it already has).
    pub async fn raised(&mut self) {
        if self.0.wait_for(|raised| *raised).await.is_err() {
            // The signal's task ended without a stop (its runtime is shutting down).
            std::future::pending::<()>().await;
        }
    }

    pub fn is_raised(&self) -> bool {
        *self.0.borrow()
    }
}

/// The follow phase's part of the checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FollowState {
    /// The next page of changes starts after this feed position.
    pub position: String,
    /// When the position was first recorded (before the copy began).
    pub recorded_at: String,
    /// Every change committed before this moment (milliseconds since the Unix epoch) is applied.
    pub applied_through_ms: u64,
    /// What the follow phase did, over every run.
    pub ledger: Ledger,
}

impl FollowState {
    /// The state of a migration about to copy: the source's feed position now.
    pub async fn record(source: &dyn DocumentBackend) -> Result<Self> {
        let position = source.change_position().await?;
        Ok(FollowState {
            position,
            recorded_at: crate::model::timestamp::now(),
            applied_through_ms: now_ms().saturating_sub(millis(source.change_feed_delay())),
            ledger: Ledger::default(),
        })
    }
}

/// How far behind the source the target is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Lag {
    /// Changes known to wait at the source (exact where the feed counts them, else a lower bound).
    pub changes: u64,
    /// Seconds since the moment up to which every change is applied; 0 when nothing waits.
    pub seconds: f64,
}

/// How the follow phase ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FollowEnd {
    Stopped,
    CaughtUp,
}

/// The follow loop's inputs that stay the same for the whole run.
pub struct Follower<'a> {
    pub source: Arc<dyn DocumentBackend>,
    pub target: Arc<dyn DocumentBackend>,
    pub journal: &'a Journal,
    pub options: &'a Options,
    pub mode: FollowMode,
    /// The checkpoint file, named when a conflict stops the run.
    pub checkpoint: &'a std::path::Path,
    /// Namespaces whose index the target has been asked to ensure (before their first write).
    pub ensured: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl Follower<'_> {
    /// Follows until `stop` resolves or (with [`FollowMode::UntilCaughtUp`]) the lag is zero for
    /// every change committed before this call; `save` is called with the state after each page.
    pub async fn run(
        &self,
        state: &mut FollowState,
        stop: &mut StopFlag,
        progress: &mut Progress,
        mut save: impl FnMut(&FollowState) -> Result<()>,
        lag: &mut Lag,
    ) -> Result<FollowEnd> {
        let started_ms = now_ms();
        let mut backoff = PollBackoff::new(POLL_CEILING);
        let mut last_save = std::time::Instant::now();
        // A page read while the one before it was being applied.
        let mut prefetched: Option<(Result<FeedPage>, u64)> = None;
        loop {
            if stop.is_raised() {
                return Ok(FollowEnd::Stopped);
            }
            let (page, seen_through_ms) = match prefetched.take() {
                Some((page, seen_through_ms)) => (page?, seen_through_ms),
                None => {
                    let seen_through_ms = self.seen_through_now();
                    tokio::select! {
                        biased;
                        () = stop.raised() => return Ok(FollowEnd::Stopped),
                        page = self.read_changes(&state.position) => (page?, seen_through_ms),
                    }
                }
            };
            // Every change of the page, the unsettled tail too: `last_seq` says the page was taken
            // whole, so a read from it may skip the tail when it settles (a DynamoDB token names
            // the tail it handed out). Each document's current state is read when it is applied,
            // so a tail change applies no state out of the source's order, and one that does come
            // again finds the target in sync.
            let ids: Vec<String> = page.changes.iter().map(|change| change.id.clone()).collect();
            let changed = !ids.is_empty();
            // While a full page is applied, the next one is read: only reading a document's state
            // must wait for the page before it, and that happens inside `apply_page`.
            let outcome = if page.pending > 0 {
                let seen_through_ms = self.seen_through_now();
                let (outcome, next) = tokio::join!(self.apply_page(ids), self.read_changes(&page.last_seq));
                prefetched = Some((next, seen_through_ms));
                outcome?
            } else {
                self.apply_page(ids).await?
            };
            if outcome.counts.conflicts > 0 {
                return Err(super::conflict_stop(&outcome, self.checkpoint));
            }
            state.ledger.absorb(outcome, self.options.max_issues);
            let moved = state.position != page.last_seq;
            state.position = page.last_seq;
            if page.pending == 0 {
                state.applied_through_ms = state.applied_through_ms.max(seen_through_ms);
            }
            *lag = Lag {
                changes: page.pending,
                seconds: if page.pending == 0 {
                    0.0
                } else {
                    now_ms().saturating_sub(state.applied_through_ms) as f64 / 1000.0
                },
            };
            if changed || (moved && last_save.elapsed() >= IDLE_SAVE_INTERVAL) {
                save(state)?;
                last_save = std::time::Instant::now();
            }
            progress.update_follow(&state.ledger, *lag);
            if self.mode == FollowMode::UntilCaughtUp && page.pending == 0 && seen_through_ms >= started_ms {
                // The caller saves the final state.
                return Ok(FollowEnd::CaughtUp);
            }
            if changed {
                backoff.reset();
                continue;
            }
            tokio::select! {
                biased;
                () = stop.raised() => return Ok(FollowEnd::Stopped),
                () = tokio::time::sleep(backoff.idle()) => {}
            }
        }
    }

    /// The moment up to which a feed read starting now sees every committed write: now, less the
    /// feed's settle window. Taken before the read, so a write committed during it is not counted.
    fn seen_through_now(&self) -> u64 {
        now_ms().saturating_sub(millis(self.source.change_feed_delay()))
    }

    /// One page of changes after `position`.
    async fn read_changes(&self, position: &str) -> Result<FeedPage> {
        let batch = self.options.batch_size.clamp(1, crate::feed::MAX_PAGE);
        read_page(self.source.as_ref(), Some(position), batch)
            .await
            .map_err(|e| Error::new(e.kind(), "source: read the change feed").with_source(e))
    }

    /// Applies the current source state of each changed document (one page, distinct ids).
    async fn apply_page(&self, ids: Vec<String>) -> Result<Ledger> {
        let max = self.options.max_issues;
        let mut ledger = Ledger::default();
        let wanted_ids = select_ids(ids, &self.options.filter, &mut ledger, max);
        if wanted_ids.is_empty() {
            return Ok(ledger);
        }
        let current = self
            .source
            .get_many(&wanted_ids)
            .await
            .map_err(|e| Error::new(e.kind(), "source: read changed documents").with_source(e))?;
        let mut items = Vec::with_capacity(wanted_ids.len());
        let mut present = Vec::new();
        for (id, doc) in wanted_ids.into_iter().zip(current) {
            match doc {
                Some(doc) => present.push(super::source::Incoming::Document(doc)),
                None => {
                    ledger.counts.read += 1;
                    items.push(Wanted { id, state: None });
                }
            }
        }
        let (docs, classified) = super::classify(present, self.options);
        ledger.absorb(classified, max);
        super::ensure_namespaces(self.target.as_ref(), &docs, &self.ensured).await?;
        items.extend(docs.into_iter().map(|doc| Wanted { id: doc.id.clone(), state: Some(doc) }));
        let applied = apply(self.target.as_ref(), self.journal, items, self.options.on_conflict, max).await?;
        ledger.absorb(applied, max);
        Ok(ledger)
    }
}

/// The changed ids a migration copies; the others are counted (read, and foreign or filtered out).
fn select_ids(ids: Vec<String>, filter: &Filter, ledger: &mut Ledger, max: usize) -> Vec<String> {
    let mut wanted = Vec::with_capacity(ids.len());
    for id in ids {
        if let Some(kind) = super::transform::foreign_kind(&id) {
            ledger.counts.read += 1;
            ledger.counts.foreign += 1;
            Ledger::tally(&mut ledger.foreign_by_kind, kind.as_str());
            ledger.note(max, &id, "foreign", kind.as_str());
        } else if DocumentId::parse(&id).is_ok_and(|parsed| !filter.admits(&parsed)) {
            ledger.counts.read += 1;
            ledger.counts.filtered_out += 1;
        } else {
            // Counted as read when its state is known (by `classify` for a present document).
            wanted.push(id);
        }
    }
    wanted
}

/// The source's state of one document as the migration would write it: `None` when the source no
/// longer has it.
pub struct Wanted {
    pub id: String,
    pub state: Option<Outgoing>,
}

impl Wanted {
    fn fingerprint(&self) -> Fingerprint {
        self.state.as_ref().map_or(ABSENT, |doc| fingerprint(&doc.hash))
    }
}

/// What to do with one document at the target.
enum Plan {
    Put(BulkWrite),
    Delete { id: String, rev: crate::backend::Revision },
}

/// Brings each document at the target to the source's state (distinct ids), telling this
/// migration's earlier writes from independent target changes through the journal. Documents the
/// target moves between the read and the write are done again from a fresh read.
pub async fn apply(
    target: &dyn DocumentBackend,
    journal: &Journal,
    items: Vec<Wanted>,
    policy: ConflictPolicy,
    max: usize,
) -> Result<Ledger> {
    let mut ledger = Ledger::default();
    let mut pending = items;
    for attempt in 1..=APPLY_ATTEMPTS {
        if pending.is_empty() {
            break;
        }
        let last_attempt = attempt == APPLY_ATTEMPTS;
        let (plans, decided) = plan(target, journal, pending, policy, &mut ledger, max).await?;
        let mut again = Vec::new();
        for (wanted, plan, result) in execute(target, plans).await {
            match result {
                Ok(()) => count_applied(&mut ledger, max, &wanted, decided.contains(&wanted.id)),
                Err(err) if (err.is_conflict() || err.kind() == crate::error::ErrorKind::NotFound) && !last_attempt => {
                    again.push(wanted)
                }
                Err(err) if sink::is_retryable(&err) && !last_attempt => again.push(wanted),
                Err(err) => sink::note_failure(&mut ledger, max, plan_id(&plan), &err),
            }
        }
        if !again.is_empty() {
            sink::back_off(attempt).await;
        }
        pending = again;
    }
    Ok(ledger)
}

fn plan_id(plan: &Plan) -> &str {
    match plan {
        Plan::Put(write) => &write.id,
        Plan::Delete { id, .. } => id,
    }
}

fn count_applied(ledger: &mut Ledger, max: usize, wanted: &Wanted, overwrote_a_conflict: bool) {
    if overwrote_a_conflict {
        ledger.counts.overwritten += 1;
        ledger.note(max, &wanted.id, "overwritten", "changed at the target independently; replaced with the source's");
    } else if wanted.state.is_some() {
        ledger.counts.written += 1;
    } else {
        ledger.counts.deleted += 1;
    }
}

/// Reads the target and the journal and decides each document: in sync (counted, nothing to do),
/// a conflict (counted under the policy; planned when it is `overwrite`), or planned. Records the
/// planned states in the journal before returning, so they are known as this migration's before
/// any of them is written. Returns the plans and the ids planned as conflict overwrites.
async fn plan(
    target: &dyn DocumentBackend,
    journal: &Journal,
    items: Vec<Wanted>,
    policy: ConflictPolicy,
    ledger: &mut Ledger,
    max: usize,
) -> Result<(Vec<(Wanted, Plan)>, std::collections::HashSet<String>)> {
    let ids: Vec<String> = items.iter().map(|item| item.id.clone()).collect();
    let stored = target.get_many(&ids).await.map_err(|e| sink::target_error("read documents to update", e))?;
    let owned = journal.lookup(ids).await?;
    let mut plans = Vec::new();
    let mut overwrites = std::collections::HashSet::new();
    let mut entries = Vec::new();
    for ((item, stored), owned) in items.into_iter().zip(stored).zip(owned) {
        let at_target = stored.as_ref().map_or(ABSENT, |doc| fingerprint(&content_hash(&doc.id, &doc.body)));
        let wanted = item.fingerprint();
        if at_target == wanted {
            ledger.counts.already_present += 1;
            if stored.is_some() && !owned.as_ref().is_some_and(|prints| prints.contains(&wanted)) {
                entries.push((item.id, with_latest(owned, &[wanted])));
            }
            continue;
        }
        let ours = match &owned {
            Some(prints) => prints.contains(&at_target),
            None => stored.is_none(),
        };
        if !ours {
            match policy {
                ConflictPolicy::Fail => {
                    ledger.counts.conflicts += 1;
                    ledger.note(max, &item.id, "conflict", "changed at the target independently of the migration");
                    continue;
                }
                ConflictPolicy::Skip => {
                    ledger.counts.conflicts_skipped += 1;
                    ledger.note(
                        max,
                        &item.id,
                        "conflict_skipped",
                        "changed at the target independently of the migration; left as it is",
                    );
                    continue;
                }
                ConflictPolicy::Overwrite => {
                    overwrites.insert(item.id.clone());
                }
            }
        }
        let Some(plan) = plan_one(&item, stored) else {
            continue;
        };
        entries.push((item.id.clone(), with_latest(owned, &[at_target, wanted])));
        plans.push((item, plan));
    }
    journal.record(entries).await?;
    Ok((plans, overwrites))
}

/// The fingerprints to keep for a document: those recorded before, then `latest` (moved to the
/// end if already there); the journal keeps the last [`MAX_KEPT`](super::journal::MAX_KEPT).
/// Earlier ones stay because a write sent by a run that was killed can still land after the next
/// run has read the target (a request already on its way to the store).
fn with_latest(owned: Option<Vec<Fingerprint>>, latest: &[Fingerprint]) -> Vec<Fingerprint> {
    let mut prints = owned.unwrap_or_default();
    prints.retain(|print| !latest.contains(print));
    prints.extend_from_slice(latest);
    prints
}

/// The write that brings one document from `stored` to the wanted state (`None` when both are
/// absent, which the caller has already counted as in sync).
fn plan_one(item: &Wanted, stored: Option<StoredDocument>) -> Option<Plan> {
    match (&item.state, stored) {
        (Some(doc), stored) => Some(Plan::Put(BulkWrite {
            id: item.id.clone(),
            body: doc.body.clone(),
            precondition: stored.map_or(Precondition::MustNotExist, |s| Precondition::MatchRevision(s.rev)),
        })),
        (None, Some(stored)) => Some(Plan::Delete { id: item.id.clone(), rev: stored.rev }),
        (None, None) => None,
    }
}

/// Sends the writes (in bulk) and the deletes (a few at a time); one result per plan.
async fn execute(target: &dyn DocumentBackend, plans: Vec<(Wanted, Plan)>) -> Vec<(Wanted, Plan, Result<()>)> {
    let (puts, deletes): (Vec<_>, Vec<_>) = plans.into_iter().partition(|(_, plan)| matches!(plan, Plan::Put(_)));
    let mut done = Vec::with_capacity(puts.len() + deletes.len());
    if !puts.is_empty() {
        let writes: Vec<BulkWrite> = puts
            .iter()
            .filter_map(|(_, plan)| match plan {
                Plan::Put(write) => Some(write.clone()),
                Plan::Delete { .. } => None,
            })
            .collect();
        match target.bulk_write(writes).await {
            Ok(results) if results.len() == puts.len() => {
                for ((wanted, plan), result) in puts.into_iter().zip(results) {
                    done.push((wanted, plan, result.map(|_| ())));
                }
            }
            Ok(results) => {
                let err = Error::new(
                    crate::error::ErrorKind::Internal,
                    format!("target answered {} results for {} writes", results.len(), puts.len()),
                );
                for (wanted, plan) in puts {
                    done.push((wanted, plan, Err(err.copy_for_each())));
                }
            }
            Err(err) => {
                for (wanted, plan) in puts {
                    done.push((wanted, plan, Err(err.copy_for_each())));
                }
            }
        }
    }
    let deleted: Vec<(Wanted, Plan, Result<()>)> = futures::stream::iter(deletes)
        .map(|(wanted, plan)| async move {
            let result = match &plan {
                Plan::Delete { id, rev } => target.delete(id, rev).await.map(drop),
                Plan::Put(_) => Ok(()),
            };
            (wanted, plan, result)
        })
        .buffer_unordered(DELETE_CONCURRENCY)
        .collect()
        .await;
    done.extend(deleted);
    done
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, millis)
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::embedded::EmbeddedBackend;
    use serde_json::{json, Map, Value};

    fn body(value: Value) -> Map<String, Value> {
        match json!({ "userId": "u", "namespace": "ns", "key": "k", "value": value }) {
            Value::Object(map) => map,
            _ => unreachable!(),
        }
    }

    fn wanted(id: &str, value: Option<Value>) -> Wanted {
        Wanted {
            id: id.to_owned(),
            state: value.map(|v| Outgoing::new(id.to_owned(), crate::backend::Revision("1-x".into()), body(v))),
        }
    }

    async fn setup() -> (tempfile::TempDir, EmbeddedBackend, Journal) {
        let dir = tempfile::tempdir().expect("temp dir");
        let target = EmbeddedBackend::open(&dir.path().join("t.redb")).await.expect("open");
        let journal = Journal::open(&dir.path().join("j")).expect("journal");
        (dir, target, journal)
    }

    #[tokio::test]
    async fn own_writes_are_replaced_and_deleted_independent_changes_are_conflicts() {
        let (_dir, target, journal) = setup().await;
        let ledger = apply(
            &target,
            &journal,
            vec![wanted("a", Some(json!(1))), wanted("b", Some(json!(1)))],
            ConflictPolicy::Fail,
            5,
        )
        .await
        .expect("create");
        assert_eq!((ledger.counts.written, ledger.counts.conflicts), (2, 0));
        // "b" is changed at the target by someone else.
        let rev = target.get("b").await.expect("get").expect("b").rev;
        target.put("b", &body(json!("theirs")), Precondition::MatchRevision(rev)).await.expect("their write");
        let next = vec![wanted("a", Some(json!(2))), wanted("b", Some(json!(2)))];
        let ledger = apply(&target, &journal, next, ConflictPolicy::Fail, 5).await.expect("update");
        assert_eq!((ledger.counts.written, ledger.counts.conflicts), (1, 1), "{ledger:?}");
        assert_eq!(target.get("a").await.expect("get").expect("a").body["value"], 2);
        assert_eq!(target.get("b").await.expect("get").expect("b").body["value"], "theirs");
        let skipped =
            apply(&target, &journal, vec![wanted("b", Some(json!(2)))], ConflictPolicy::Skip, 5).await.expect("skip");
        assert_eq!(skipped.counts.conflicts_skipped, 1);
        let overwritten = apply(&target, &journal, vec![wanted("b", Some(json!(3)))], ConflictPolicy::Overwrite, 5)
            .await
            .expect("overwrite");
        assert_eq!(overwritten.counts.overwritten, 1);
        assert_eq!(target.get("b").await.expect("get").expect("b").body["value"], 3);
        // Now "b" is the migration's again: a source delete removes it without a conflict.
        let deleted =
            apply(&target, &journal, vec![wanted("b", None), wanted("a", Some(json!(2)))], ConflictPolicy::Fail, 5)
                .await
                .expect("delete");
        assert_eq!((deleted.counts.deleted, deleted.counts.already_present), (1, 1), "{deleted:?}");
        assert!(target.get("b").await.expect("get").is_none());
    }

    #[tokio::test]
    async fn a_write_cut_short_after_its_journal_entry_is_still_the_migrations() {
        let (_dir, target, journal) = setup().await;
        apply(&target, &journal, vec![wanted("a", Some(json!(1)))], ConflictPolicy::Fail, 5).await.expect("create");
        // A killed run recorded state 2 and wrote it, but never read the target again; the next
        // run brings state 3. Then a run recorded state 4 and died before writing it.
        let two = Outgoing::new("a".into(), crate::backend::Revision("2-x".into()), body(json!(2)));
        let rev = target.get("a").await.expect("get").expect("a").rev;
        let mut prints = journal.lookup(vec!["a".into()]).await.expect("lookup")[0].clone().expect("entry");
        prints.push(fingerprint(&two.hash));
        prints
            .push(fingerprint(&Outgoing::new("a".into(), crate::backend::Revision("4-x".into()), body(json!(4))).hash));
        journal.record(vec![("a".into(), prints)]).await.expect("record");
        target.put("a", &two.body, Precondition::MatchRevision(rev)).await.expect("the killed run's write");
        let ledger =
            apply(&target, &journal, vec![wanted("a", Some(json!(3)))], ConflictPolicy::Fail, 5).await.expect("apply");
        assert_eq!((ledger.counts.written, ledger.counts.conflicts), (1, 0), "{ledger:?}");
        assert_eq!(target.get("a").await.expect("get").expect("a").body["value"], 3);
    }

    #[tokio::test]
    async fn a_document_already_at_the_target_before_the_migration_is_a_conflict_unless_identical() {
        let (_dir, target, journal) = setup().await;
        target.put("a", &body(json!("old")), Precondition::MustNotExist).await.expect("pre-existing");
        target.put("b", &body(json!(1)), Precondition::MustNotExist).await.expect("pre-existing");
        let items = vec![wanted("a", Some(json!("new"))), wanted("b", Some(json!(1))), wanted("c", None)];
        let ledger = apply(&target, &journal, items, ConflictPolicy::Fail, 5).await.expect("apply");
        assert_eq!((ledger.counts.conflicts, ledger.counts.already_present, ledger.counts.written), (1, 2, 0));
    }

    /// Records the namespaces the target is asked to index.
    struct NamespaceLog {
        inner: EmbeddedBackend,
        asked: std::sync::Mutex<Vec<String>>,
    }

    #[async_trait::async_trait]
    impl crate::backend::raw::layer::Layered for NamespaceLog {
        fn inner(&self) -> &dyn DocumentBackend {
            &self.inner
        }

        async fn ensure_namespace_indexed(&self, namespace: &str) -> Result<()> {
            self.asked.lock().expect("lock").push(namespace.to_owned());
            self.inner.ensure_namespace_indexed(namespace).await
        }
    }

    #[tokio::test]
    async fn a_namespace_first_seen_while_following_is_indexed_at_the_target_before_its_write() {
        let dir = tempfile::tempdir().expect("temp dir");
        let source: Arc<dyn DocumentBackend> =
            Arc::new(EmbeddedBackend::open(&dir.path().join("s.redb")).await.expect("source"));
        let target = Arc::new(NamespaceLog {
            inner: EmbeddedBackend::open(&dir.path().join("t.redb")).await.expect("target"),
            asked: Default::default(),
        });
        let id = |ns: &str| DocumentId::new("u", ns, "k", &Default::default()).expect("id").as_str().to_owned();
        let doc = |ns: &str| match json!({ "userId": "u", "namespace": ns, "key": "k", "value": 1 }) {
            Value::Object(map) => map,
            _ => unreachable!(),
        };
        source.put(&id("first"), &doc("first"), Precondition::MustNotExist).await.expect("seed");
        let job = |follow| super::super::Job {
            kind: super::super::JobKind::Migrate,
            source: super::super::Endpoint::backend(Arc::clone(&source)),
            target: super::super::Endpoint::backend(target.clone()),
            options: Options { follow, checkpoint: Some(dir.path().join("cp.json")), ..Default::default() },
        };
        super::super::run(job(FollowMode::UntilCaughtUp)).await.expect("copy");
        source.put(&id("later"), &doc("later"), Precondition::MustNotExist).await.expect("new namespace");
        let report = super::super::run(job(FollowMode::UntilCaughtUp)).await.expect("follow");
        assert_eq!(report.follow.expect("follow report").ledger.counts.written, 1);
        assert!(target.inner.get(&id("later")).await.expect("get").is_some());
        assert_eq!(*target.asked.lock().expect("lock"), ["first", "later"]);
    }

    #[tokio::test]
    async fn a_write_from_a_killed_run_that_lands_late_is_still_the_migrations() {
        let (_dir, target, journal) = setup().await;
        apply(&target, &journal, vec![wanted("a", Some(json!(1)))], ConflictPolicy::Fail, 5).await.expect("create");
        // A run recorded state 2 and sent its write, then was killed; the write is still on its way.
        let two = Outgoing::new("a".into(), crate::backend::Revision("2-x".into()), body(json!(2)));
        let mut prints = journal.lookup(vec!["a".into()]).await.expect("lookup")[0].clone().expect("entry");
        prints.push(fingerprint(&two.hash));
        journal.record(vec![("a".into(), prints)]).await.expect("record");
        // The next run finds state 1 at the target and writes state 3.
        apply(&target, &journal, vec![wanted("a", Some(json!(3)))], ConflictPolicy::Fail, 5).await.expect("apply 3");
        // Then the killed run's write of state 2 lands.
        let rev = target.get("a").await.expect("get").expect("a").rev;
        target.put("a", &two.body, Precondition::MatchRevision(rev)).await.expect("the late write");
        let ledger = apply(&target, &journal, vec![wanted("a", Some(json!(4)))], ConflictPolicy::Fail, 5)
            .await
            .expect("apply 4");
        assert_eq!((ledger.counts.written, ledger.counts.conflicts), (1, 0), "{ledger:?}");
        assert_eq!(target.get("a").await.expect("get").expect("a").body["value"], 4);
    }
}
