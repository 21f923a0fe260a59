//! Group commit: every write waiting at the moment a transaction begins goes into it, and one
//! fsync'd commit makes them all durable.
//!
//! Each write is a job that runs against the open tables of the shared write transaction. Jobs
//! run one after another, in arrival order, so a later write sees an earlier one of its group
//! exactly as it would see a committed one: two writers updating one document at the same
//! revision still conflict, and neither update is lost. A job's caller is answered only after the
//! commit has returned, with the commit's outcome, so no write is acknowledged before it is
//! durable. Durability is unchanged from one commit per write (redb's `Durability::Immediate`);
//! what changes is that concurrent writers share the fsync.
//!
//! One job's failure must not undo the others. A job that refuses (a failed precondition, a
//! missing document, an invalid input) has changed nothing: the tables' methods check before they
//! write, and the feed position counter is the witness that no document was touched. Such a
//! job is answered at once and the group goes on. Any other failure (a storage error, a job that
//! panicked, or a refusal after the job had written) may have left part of its work in the
//! transaction, so the transaction is dropped, which redb rolls back: the jobs that had run in
//! it are answered "not applied, try again" and the jobs after it start a new transaction.
//!
//! A job may ask for its commit to be deferred ([`Persistence::Deferred`]): an attachment chunk, which
//! no reader can reach before a later write (its manifest) names it. A transaction of deferred
//! jobs alone commits with redb's `Durability::None`, no fsync; any transaction holding a job that
//! is not deferred commits durably. redb's contract (`redb::Durability::None`: such a commit is
//! persisted only if a later `Durability::Immediate` commit follows) and its one-writer-at-a-time
//! file make the later durable commit cover every non-durable one before it: the commit is a new
//! root of the whole file, written after theirs, so the chunks are on disk before the manifest
//! naming them is acknowledged. A crash before that loses only chunks no manifest names.
//!
//! There is no committer thread: the first writer to find the queue idle starts a drain on the
//! blocking pool, which runs groups until the queue is empty. A single writer therefore pays
//! what it paid before (one transaction, one commit), and under load a group holds every write
//! that arrived while the previous commit was being made durable.
//!
//! ## Gathering the writers a group just answered
//! Taking only what waits when a group ends splits steady concurrent writers into two halves that
//! take turns: while one half's commit waits for its fsync, the other half queues; when the
//! commit returns, the next group starts at once with that half alone, and the half just answered
//! comes back during its fsync. Each writer then waits for two commits per write, and a commit
//! (mostly its fsync) carries half the writers. Issue 38 measured this at 16 clients creating
//! documents: about 4 writes per fsync, and creates on a disk at a tenth to a half of their rate
//! on a `tmpfs` (where an fsync costs nothing), in the same run: the fsync wait, not the
//! instructions, bounded them.
//!
//! So before a group begins, the drain waits for the writers that were busy when the last group
//! ended (the ones it answered and the ones queued behind it) to be queued again, but no longer
//! than the last group took (its transaction and commit), and never longer than
//! [`MAX_GATHER`]: past that, the stragglers are better served by the next commit. A writer alone
//! never waits (one busy writer is nothing to wait for), nor does anyone after a quiet spell
//! (the drain ends when the queue is empty and nothing is expected back). The wait only chooses
//! which writes share a transaction; it changes nothing of what a transaction guarantees.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use redb::{Database, Durability};

use super::error::map_redb;
use super::write::Tables;
use crate::error::{Error, ErrorKind, Result};

/// The most jobs one transaction holds, so one group's commit (and its callers' wait) stays
/// short even when thousands of writers queue at once. 1,024 (256 before issue 38): the
/// data-store database's `_bulk_docs` saves each document as a job of its own, and 16 clients'
/// requests of 100 documents (1,600 jobs) took seven commits of 256 at about 8,700 documents/s
/// against 52,000 for the other databases' bulk writes (one job per chunk); the documents a
/// group holds stay bounded by [`MAX_GROUP_DOCUMENTS`].
const MAX_GROUP: usize = 1_024;
/// The most documents one group writes (a job larger than this, such as one big bulk write,
/// goes alone): a write transaction keeps its changed pages in memory until it commits, so this
/// bounds what concurrent bulk writers (an import, a migration) make one commit hold.
pub(super) const MAX_GROUP_DOCUMENTS: usize = 4_096;
/// The longest a group waits for the writers the previous one answered to come back (module
/// doc): 5 ms, a few fsyncs of this machine's disk under load (about 1.4 ms at the median, 10 ms
/// at the 90th percentile with other builds writing). The wait is also never longer than the
/// previous group took, so on a disk whose fsync is fast it is short too.
pub(super) const MAX_GATHER: Duration = Duration::from_millis(5);

/// A write: runs against the group's tables and says how it ended.
pub(super) type Job = Box<dyn for<'t> FnOnce(&mut Tables<'t>) -> JobEnd + Send>;

/// Whether a job's caller may be answered before its write is on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Persistence {
    /// Answered after an fsync'd commit: every document, local document and erasure.
    Durable,
    /// Answered after a commit without fsync, made durable by the next durable commit (module
    /// doc). Only for writes no reader reaches before a later durable write names them.
    Deferred,
}

/// Answers a job's caller.
type Answer = Box<dyn FnOnce() + Send>;

/// How a job ended. Callers are answered only after the group's transaction is over and the
/// database handle released, so a caller that closes the store on its answer can open the file
/// again at once.
pub(super) enum JobEnd {
    /// It wrote; this answers its caller with the commit's outcome.
    Wrote(Box<dyn FnOnce(Result<()>) + Send>),
    /// It refused having changed nothing; this answers its caller.
    Refused(Answer),
    /// It failed and may have written part of its work; this answers its caller.
    Broke(Answer),
}

/// The queue of writes waiting for a transaction.
pub(super) struct GroupCommit {
    /// Weak: the file stays open only while an [`EmbeddedBackend`](super::EmbeddedBackend) holds
    /// it, never because a drain is finishing.
    db: Weak<Database>,
    revs_limit: usize,
    queue: Mutex<Queue>,
    /// Wakes a drain gathering writers (module doc) once enough are queued.
    gathered: Condvar,
    /// The longest a gathering drain waits ([`MAX_GATHER`]; tests lengthen it).
    max_gather: Duration,
    /// Write transactions begun so far ([`GroupCommit::transactions`]).
    transactions: std::sync::atomic::AtomicU64,
    /// Transactions committed durably so far ([`GroupCommit::durable_commits`]).
    durable_commits: std::sync::atomic::AtomicU64,
}

/// A job waiting for a transaction.
struct Queued {
    documents: usize,
    persistence: Persistence,
    job: Job,
}

#[derive(Default)]
struct Queue {
    /// Each job with about how many documents it writes and whether it waits for an fsync.
    jobs: VecDeque<Queued>,
    /// The documents of `jobs`, summed.
    documents: usize,
    /// Whether a drain is running; it takes every job queued before it stops.
    draining: bool,
    /// While a drain gathers writers: how many queued jobs end its wait (0 when none waits).
    gather_until: usize,
}

impl Queue {
    /// Whether a gathering drain has what it waits for: `expected` jobs, or a full group's
    /// documents.
    fn gathered(&self, expected: usize) -> bool {
        self.jobs.len() >= expected || self.documents >= MAX_GROUP_DOCUMENTS
    }
}

/// Whether the drain waits for writers before its next group: only while such waits pay (the
/// writers came back within half a group's time, so one commit carries them all instead of two
/// taking turns), and once every [`GatherPolicy::RETRY_AFTER`] groups to see whether they pay
/// again. When the writers take longer to come back than a commit takes (the processor, not the
/// disk, is what they wait for), a wait would only leave the disk idle while they are processed.
#[derive(Debug, Default)]
struct GatherPolicy {
    /// Whether the last wait saw every writer back before its deadline.
    paying: bool,
    /// Groups run without a wait since the last one.
    skipped: usize,
}

impl GatherPolicy {
    /// Groups run without waiting, after a wait that did not pay, before the next try.
    const RETRY_AFTER: usize = 8;

    fn should_gather(&mut self) -> bool {
        if self.paying || self.skipped >= Self::RETRY_AFTER {
            return true;
        }
        self.skipped += 1;
        false
    }

    fn record(&mut self, everyone_back: bool) {
        self.paying = everyone_back;
        self.skipped = 0;
    }
}

/// What the drain knows of the group it ran last, to decide how long the next one gathers.
#[derive(Debug, Clone, Copy, Default)]
struct LastGroup {
    /// The writers busy when it ended: its jobs and the jobs queued behind it.
    busy_writers: usize,
    /// How long it took, transaction and commit.
    took: Duration,
}

impl GroupCommit {
    pub(super) fn new(db: &Arc<Database>, revs_limit: usize) -> Arc<Self> {
        Self::gathering_at_most(db, revs_limit, MAX_GATHER)
    }

    /// [`GroupCommit::new`] whose groups wait at most `max_gather` for writers (tests).
    fn gathering_at_most(db: &Arc<Database>, revs_limit: usize, max_gather: Duration) -> Arc<Self> {
        Arc::new(GroupCommit {
            db: Arc::downgrade(db),
            revs_limit,
            queue: Mutex::new(Queue::default()),
            gathered: Condvar::new(),
            max_gather,
            transactions: std::sync::atomic::AtomicU64::new(0),
            durable_commits: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// How many write transactions (each one commit, fsync'd unless deferred, or a rollback)
    /// this queue has begun: what shows whether concurrent writes shared their commits.
    pub(super) fn transactions(&self) -> u64 {
        self.transactions.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many transactions this queue has committed durably (each one fsync'd commit): what
    /// shows how many fsyncs a sequence of writes cost.
    pub(super) fn durable_commits(&self) -> u64 {
        self.durable_commits.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Queues `job`, which writes about `documents` documents, starting a drain when none runs.
    /// The job's caller waits on its own channel.
    pub(super) fn submit(self: &Arc<Self>, documents: usize, persistence: Persistence, job: Job) {
        let start_drain = {
            let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
            queue.jobs.push_back(Queued { documents, persistence, job });
            queue.documents += documents;
            if queue.gather_until != 0 && queue.gathered(queue.gather_until) {
                queue.gather_until = 0;
                self.gathered.notify_one();
            }
            !std::mem::replace(&mut queue.draining, true)
        };
        if start_drain {
            let this = Arc::clone(self);
            tokio::task::spawn_blocking(move || this.drain());
        }
    }

    /// Runs groups until the queue is empty and no writer is expected back.
    fn drain(&self) {
        let mut last = LastGroup::default();
        let mut policy = GatherPolicy::default();
        loop {
            let (group, persistence) = {
                let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
                if policy.should_gather() {
                    let (gathered, everyone_back) = self.gather(queue, last);
                    queue = gathered;
                    policy.record(everyone_back);
                }
                if queue.jobs.is_empty() {
                    queue.draining = false;
                    return;
                }
                take_group(&mut queue)
            };
            let started = Instant::now();
            let jobs = group.len();
            self.run_group(group, persistence);
            let took = started.elapsed();
            let queued = self.queue.lock().unwrap_or_else(PoisonError::into_inner).jobs.len();
            tracing::debug!(jobs, queued, took_us = took.as_micros() as u64, "embedded store: group committed");
            last = LastGroup { busy_writers: jobs + queued, took };
        }
    }

    /// Waits, with the queue's lock, until the writers busy at the end of the `last` group are
    /// queued again (as many jobs as there were, up to what one group takes), or for half as long
    /// as that group took, at most `max_gather` ([`MAX_GATHER`]; module doc); whether they all
    /// came back in time. No wait when at most one writer was busy or enough are queued already.
    fn gather<'q>(&self, mut queue: MutexGuard<'q, Queue>, last: LastGroup) -> (MutexGuard<'q, Queue>, bool) {
        let expected = last.busy_writers.min(MAX_GROUP);
        if expected < 2 || queue.gathered(expected) {
            return (queue, true);
        }
        let deadline = Instant::now() + (last.took / 2).min(self.max_gather);
        while !queue.gathered(expected) {
            let Some(left) = deadline.checked_duration_since(Instant::now()).filter(|left| !left.is_zero()) else {
                break;
            };
            queue.gather_until = expected;
            queue = self.gathered.wait_timeout(queue, left).unwrap_or_else(PoisonError::into_inner).0;
        }
        queue.gather_until = 0;
        let everyone_back = queue.gathered(expected);
        (queue, everyone_back)
    }

    /// Runs `jobs` in as few transactions as their failures allow (one when none breaks), each
    /// committed as `persistence` says (durably when any job of the group needs it), then answers
    /// their callers.
    pub(super) fn run_group(&self, jobs: Vec<Job>, persistence: Persistence) {
        let mut answers = Vec::with_capacity(jobs.len());
        let mut waiting = jobs.into_iter();
        if let Some(db) = self.db.upgrade() {
            while waiting.len() > 0 {
                self.transactions.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                match run_transaction(&db, self.revs_limit, persistence, &mut waiting, &mut answers) {
                    Ok(true) => {
                        self.durable_commits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    Ok(false) => {}
                    Err(err) => {
                        // The jobs not run are dropped unanswered below: each caller hears that
                        // its write was not applied.
                        tracing::error!(error = %err, "embedded store: cannot begin a write");
                        break;
                    }
                }
            }
        }
        drop(waiting);
        for answer in answers {
            answer();
        }
    }
}

/// Takes the next group from the queue: every job in arrival order, up to [`MAX_GROUP`] jobs and
/// [`MAX_GROUP_DOCUMENTS`] documents (a larger job alone), committed durably when any job
/// needs it.
fn take_group(queue: &mut Queue) -> (Vec<Job>, Persistence) {
    let mut group = Vec::new();
    let mut documents = 0;
    let mut persistence = Persistence::Deferred;
    while let Some(next) = queue.jobs.front() {
        let full = group.len() == MAX_GROUP || documents + next.documents > MAX_GROUP_DOCUMENTS;
        if !group.is_empty() && full {
            break;
        }
        documents += next.documents;
        if let Some(queued) = queue.jobs.pop_front() {
            queue.documents -= queued.documents;
            if queued.persistence == Persistence::Durable {
                persistence = Persistence::Durable;
            }
            group.push(queued.job);
        }
    }
    (group, persistence)
}

/// Runs jobs from `waiting` in one transaction until they are all run or one breaks, and commits
/// as `persistence` says (or, when one broke, rolls back). The answers are pushed to `answers`;
/// the answer is whether it committed durably, an error that no transaction could be begun.
fn run_transaction(
    db: &Database,
    revs_limit: usize,
    persistence: Persistence,
    waiting: &mut std::vec::IntoIter<Job>,
    answers: &mut Vec<Answer>,
) -> Result<bool> {
    let mut txn = db.begin_write().map_err(map_redb("begin write"))?;
    let mut wrote: Vec<Box<dyn FnOnce(Result<()>) + Send>> = Vec::new();
    let mut broke = false;
    let prepared = Tables::open(&txn, revs_limit).and_then(|mut tables| {
        for job in waiting.by_ref() {
            match catch_unwind(AssertUnwindSafe(|| job(&mut tables))) {
                Ok(JobEnd::Wrote(answer)) => wrote.push(answer),
                Ok(JobEnd::Refused(answer)) => answers.push(answer),
                Ok(JobEnd::Broke(answer)) => {
                    answers.push(answer);
                    broke = true;
                    break;
                }
                // The job's channel was dropped while unwinding: its caller hears that the write
                // was not applied.
                Err(_) => {
                    tracing::error!("embedded store: a write panicked; its transaction is rolled back");
                    broke = true;
                    break;
                }
            }
        }
        if broke {
            Ok(())
        } else {
            tables.finish()
        }
    });
    let committed = if broke {
        drop(txn);
        Err(Error::new(
            ErrorKind::Unavailable,
            "embedded store: not applied, because another write in the same transaction failed; try again",
        ))
    } else {
        let committed = prepared
            .and_then(|()| match persistence {
                Persistence::Durable => Ok(()),
                Persistence::Deferred => txn.set_durability(Durability::None).map_err(map_redb("defer a commit")),
            })
            .and_then(|()| txn.commit().map_err(map_redb("commit")));
        if let Err(err) = &committed {
            tracing::error!(error = %err, "embedded store: a group commit failed; its writes were not applied");
        }
        committed
    };
    for answer in wrote {
        let outcome = match &committed {
            Ok(()) => Ok(()),
            Err(err) => Err(Error::new(err.kind(), err.message().to_owned())),
        };
        answers.push(Box::new(move || answer(outcome)));
    }
    Ok(!broke && persistence == Persistence::Durable && committed.is_ok())
}

/// Whether a job that failed with `error` is known to have changed nothing: the tables' methods
/// refuse with these kinds before they write (and the feed counter confirms no document moved).
pub(super) fn is_clean_refusal(error: &Error) -> bool {
    matches!(
        error.kind(),
        ErrorKind::Conflict | ErrorKind::NotFound | ErrorKind::InvalidInput | ErrorKind::Misconfigured
    )
}

/// The group-commit job that runs `work` and answers on `answer`: with the commit's outcome
/// when it wrote, at once when it refused having changed nothing, or as a broken job (its group
/// rolled back) when it failed after writing or for any other reason.
pub(super) fn job_of<T, F>(work: F, answer: tokio::sync::oneshot::Sender<Result<T>>) -> Job
where
    T: Send + 'static,
    F: FnOnce(&mut Tables<'_>) -> Result<T> + Send + 'static,
{
    Box::new(move |tables: &mut Tables<'_>| {
        // Every document write takes a feed position: an unchanged counter shows that a refusal
        // left the documents alone.
        let feed_before = tables.next_seq;
        match work(tables) {
            Ok(out) => JobEnd::Wrote(Box::new(move |committed| {
                let _ = answer.send(committed.map(|()| out));
            })),
            Err(error) if is_clean_refusal(&error) && tables.next_seq == feed_before => {
                JobEnd::Refused(Box::new(move || {
                    let _ = answer.send(Err(error));
                }))
            }
            Err(error) => JobEnd::Broke(Box::new(move || {
                let _ = answer.send(Err(error));
            })),
        }
    })
}

#[cfg(test)]
mod tests {
    use std::thread;

    use super::*;

    /// A queue over a fresh file, whose drain the test plays itself: `draining` is set, so no
    /// submission starts one.
    fn queue_without_drain(max_gather: Duration) -> (Arc<GroupCommit>, Arc<Database>, tempfile::TempDir) {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let db = Arc::new(Database::create(dir.path().join("g.redb")).expect("a redb file"));
        let commits = GroupCommit::gathering_at_most(&db, 10, max_gather);
        commits.queue.lock().expect("the queue's lock").draining = true;
        (commits, db, dir)
    }

    /// A job that is never run here.
    fn idle_job() -> Job {
        Box::new(|_: &mut Tables<'_>| JobEnd::Refused(Box::new(|| {})))
    }

    /// Submits `count` jobs from another thread, one every `every`.
    fn come_back(commits: &Arc<GroupCommit>, count: usize, every: Duration) -> thread::JoinHandle<()> {
        let commits = Arc::clone(commits);
        thread::spawn(move || {
            for _ in 0..count {
                thread::sleep(every);
                commits.submit(1, Persistence::Durable, idle_job());
            }
        })
    }

    /// Eight writers answered by the last group, coming back one after another, all wait in the
    /// queue when the next group is taken (without the wait, the first alone would be).
    #[test]
    fn a_group_waits_for_the_writers_the_last_one_answered() {
        let (commits, _db, _dir) = queue_without_drain(Duration::from_secs(20));
        let writers = come_back(&commits, 8, Duration::from_millis(20));
        let started = Instant::now();
        let last = LastGroup { busy_writers: 8, took: Duration::from_secs(20) };
        let (queue, everyone_back) = commits.gather(commits.queue.lock().expect("the queue's lock"), last);
        assert_eq!(queue.jobs.len(), 8, "the group holds every writer that came back");
        assert!(everyone_back);
        assert!(started.elapsed() < Duration::from_secs(10), "it stopped waiting once they were all back");
        drop(queue);
        writers.join().expect("the writers' thread");
    }

    /// After a group of one writer nothing is awaited; otherwise the wait ends after the last
    /// group's time or the longest gather, whichever is shorter, with whoever came back.
    #[test]
    fn the_wait_is_bounded_and_a_lone_writer_never_waits() {
        let (commits, _db, _dir) = queue_without_drain(Duration::from_secs(20));
        let started = Instant::now();
        let lone = LastGroup { busy_writers: 1, took: Duration::from_secs(20) };
        assert!(commits.gather(commits.queue.lock().expect("the queue's lock"), lone).1);
        assert!(started.elapsed() < Duration::from_secs(5), "a lone writer's next write does not wait");

        for (max_gather, took) in [
            (Duration::from_secs(20), Duration::from_millis(200)),
            (Duration::from_millis(100), Duration::from_secs(20)),
        ] {
            let (commits, _db, _dir) = queue_without_drain(max_gather);
            let writers = come_back(&commits, 1, Duration::ZERO);
            let started = Instant::now();
            let last = LastGroup { busy_writers: 4, took };
            let (queue, everyone_back) = commits.gather(commits.queue.lock().expect("the queue's lock"), last);
            let waited = started.elapsed();
            assert!(!everyone_back, "one of four came back");
            assert!(waited >= Duration::from_millis(100), "it waited for the others: {waited:?}");
            assert!(waited < Duration::from_secs(10), "and no longer than its bound: {waited:?}");
            assert!(queue.jobs.len() <= 1);
            drop(queue);
            writers.join().expect("the writers' thread");
        }
    }

    /// A group waits for no more documents than one group takes.
    #[test]
    fn the_wait_ends_with_a_full_group() {
        let (commits, _db, _dir) = queue_without_drain(Duration::from_secs(20));
        commits.submit(MAX_GROUP_DOCUMENTS, Persistence::Durable, idle_job());
        let started = Instant::now();
        let last = LastGroup { busy_writers: 16, took: Duration::from_secs(20) };
        assert!(commits.gather(commits.queue.lock().expect("the queue's lock"), last).1);
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    /// Waits go on while they pay; after one that did not, the drain tries again only after
    /// `RETRY_AFTER` groups without.
    #[test]
    fn waits_stop_when_they_do_not_pay_and_are_tried_again_later() {
        let mut policy = GatherPolicy::default();
        assert!(!policy.should_gather(), "a drain's first group takes what is queued");
        let skipped = (1..GatherPolicy::RETRY_AFTER).filter(|_| !policy.should_gather()).count();
        assert_eq!(skipped, GatherPolicy::RETRY_AFTER - 1);
        assert!(policy.should_gather(), "tried again");
        policy.record(true);
        assert!(policy.should_gather() && policy.should_gather(), "kept while it pays");
        policy.record(false);
        assert!(!policy.should_gather(), "dropped when it did not");
    }
}
