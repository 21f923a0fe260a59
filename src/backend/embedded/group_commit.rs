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
//! There is no committer thread: the first writer to find the queue idle starts a drain on the
//! blocking pool, which runs groups until the queue is empty. A single writer therefore pays
//! what it paid before (one transaction, one commit), and under load a group holds every write
//! that arrived while the previous commit was being made durable.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use redb::Database;

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
}

#[derive(Default)]
struct Queue {
    /// Each job with about how many documents it writes.
    jobs: VecDeque<(usize, Job)>,
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
        })
    }

    /// How many write transactions (each one fsync'd commit, or a rollback) this queue has
    /// begun: what shows whether concurrent writes shared their commits.
    pub(super) fn transactions(&self) -> u64 {
        self.transactions.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Queues `job`, which writes about `documents` documents, starting a drain when none runs.
    /// The job's caller waits on its own channel.
    pub(super) fn submit(self: &Arc<Self>, documents: usize, job: Job) {
        let start_drain = {
            let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
            queue.jobs.push_back((documents, job));
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
            let group: Vec<Job> = {
                let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
                if queue.jobs.is_empty() {
                    queue.draining = false;
                    return;
                }
                let mut group = Vec::new();
                let mut documents = 0;
                while let Some((size, _)) = queue.jobs.front() {
                    let full = group.len() == MAX_GROUP || documents + size > MAX_GROUP_DOCUMENTS;
                    if !group.is_empty() && full {
                        break;
                    }
                    documents += size;
                    group.extend(queue.jobs.pop_front().map(|(_, job)| job));
                }
                group
            };
            self.run_group(group);
        }
    }

    /// Runs `jobs` in as few transactions as their failures allow (one when none breaks), then
    /// answers their callers.
    pub(super) fn run_group(&self, jobs: Vec<Job>) {
        let mut answers = Vec::with_capacity(jobs.len());
        let mut waiting = jobs.into_iter();
        if let Some(db) = self.db.upgrade() {
            while waiting.len() > 0 {
                self.transactions.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                match run_transaction(&db, self.revs_limit, &mut waiting, &mut answers) {
                    Ok(()) => {}
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
/// (or, when one broke, rolls back). The answers are pushed to `answers`; an error means no
/// transaction could be begun.
fn run_transaction(
    db: &Database,
    revs_limit: usize,
    waiting: &mut std::vec::IntoIter<Job>,
    answers: &mut Vec<Answer>,
) -> Result<()> {
    let txn = db.begin_write().map_err(map_redb("begin write"))?;
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
        let committed = prepared.and_then(|()| txn.commit().map_err(map_redb("commit")));
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
    Ok(())
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
