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

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, PoisonError, Weak};

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
    /// Whether a drain is running; it takes every job queued before it stops.
    draining: bool,
}

impl GroupCommit {
    pub(super) fn new(db: &Arc<Database>, revs_limit: usize) -> Arc<Self> {
        Arc::new(GroupCommit {
            db: Arc::downgrade(db),
            revs_limit,
            queue: Mutex::new(Queue::default()),
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
            !std::mem::replace(&mut queue.draining, true)
        };
        if start_drain {
            let this = Arc::clone(self);
            tokio::task::spawn_blocking(move || this.drain());
        }
    }

    /// Runs groups until the queue is empty.
    fn drain(&self) {
        loop {
            let (group, persistence) = {
                let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
                if queue.jobs.is_empty() {
                    queue.draining = false;
                    return;
                }
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
                        if queued.persistence == Persistence::Durable {
                            persistence = Persistence::Durable;
                        }
                        group.push(queued.job);
                    }
                }
                (group, persistence)
            };
            self.run_group(group, persistence);
        }
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
