//! Deleting a database that writes are using: the deletion waits (at most [`DRAIN_WAIT`]) for
//! the writes already under way to finish, and every write that starts after it began fails
//! with CouchDB's missing-database `not_found`. So a write that reached the engine before the
//! `DELETE` is answered as it went (its document then deleted with the database), as when it had
//! finished a moment earlier, and never with the errors of a table or file taken away under it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use super::Database;
use crate::error::{Error, Result};

/// The longest a deletion waits for the writes under way on its database; past it the database
/// is deleted anyway, and those writes end with `not_found`.
pub const DRAIN_WAIT: Duration = Duration::from_secs(30);

/// The writes under way on a database, and whether its deletion has begun.
#[derive(Default)]
pub(super) struct WritesInFlight {
    closing: AtomicBool,
    count: Mutex<usize>,
    idle: tokio::sync::Notify,
}

impl WritesInFlight {
    fn count(&self) -> std::sync::MutexGuard<'_, usize> {
        self.count.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A write under way: counted until dropped.
pub(super) struct WriteUnderWay<'a>(&'a WritesInFlight);

impl Drop for WriteUnderWay<'_> {
    fn drop(&mut self) {
        let mut count = self.0.count();
        *count = count.saturating_sub(1);
        if *count == 0 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Database {
    /// Counts a write as under way, or `NotFound` once the database's deletion has begun.
    pub(super) fn start_write(&self) -> Result<WriteUnderWay<'_>> {
        // Counted before the flag is read: a deletion that sets the flag and then finds no write
        // counted cannot miss one that read the flag unset.
        *self.in_flight.count() += 1;
        let under_way = WriteUnderWay(&self.in_flight);
        if self.in_flight.closing.load(Ordering::SeqCst) {
            return Err(Error::not_found("Database does not exist."));
        }
        self.check_open()?;
        Ok(under_way)
    }

    /// Refuses new writes, waits (at most `wait`) for those under way, then marks the database
    /// deleted: every call from then on fails with `NotFound`.
    pub(in crate::database) async fn close(&self, wait: Duration) {
        self.in_flight.closing.store(true, Ordering::SeqCst);
        let drained = tokio::time::timeout(wait, async {
            loop {
                let idle = self.in_flight.idle.notified();
                tokio::pin!(idle);
                idle.as_mut().enable();
                if *self.in_flight.count() == 0 {
                    return;
                }
                idle.await;
            }
        })
        .await;
        if drained.is_err() {
            tracing::warn!(database = %self.name(), "deleted with writes still under way after {wait:?}");
        }
        self.mark_dropped();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::embedded::EmbeddedBackend;
    use crate::error::ErrorKind;
    use std::sync::Arc;

    /// A deletion waits for the write under way, refuses writes that start meanwhile, and marks
    /// the database deleted once that write is done; past its wait it goes on anyway.
    #[tokio::test]
    async fn a_deletion_waits_for_the_writes_under_way() {
        let dir = tempfile::tempdir().unwrap();
        let backend = Arc::new(EmbeddedBackend::open(&dir.path().join("d.redb")).await.unwrap());
        let db = Arc::new(Database::new("d".into(), backend));
        let under_way = db.start_write().unwrap();
        let closing = tokio::spawn({
            let db = Arc::clone(&db);
            async move { db.close(Duration::from_secs(30)).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!closing.is_finished(), "the deletion waits for the write under way");
        assert!(db.check_open().is_ok(), "the write under way still sees its database");
        let late = db.start_write().err().map(|err| err.kind());
        assert_eq!(late, Some(ErrorKind::NotFound), "a write starting after the deletion began");
        drop(under_way);
        tokio::time::timeout(Duration::from_secs(5), closing).await.unwrap().unwrap();
        assert_eq!(db.check_open().err().map(|err| err.kind()), Some(ErrorKind::NotFound));

        let stuck =
            Database::new("s".into(), Arc::new(EmbeddedBackend::open(&dir.path().join("s.redb")).await.unwrap()));
        let _never_ends = stuck.start_write().unwrap();
        stuck.close(Duration::from_millis(20)).await;
        assert!(stuck.check_open().is_err(), "deleted anyway past the wait");
    }
}
