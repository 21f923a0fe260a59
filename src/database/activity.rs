//! What the databases of this process did since it started, for the node's statistics and the
//! feed of database events: documents read, databases changed, and the events (`created`,
//! `updated`, `deleted`) of each database waiting to be written to `_global_changes`
//! ([`super::global_changes`]).
//!
//! One [`Activity`] is shared by every database a [`super::Databases`] opens (and its data-store
//! database). Recording costs a write nothing at the backend: a counter and, for an event, a
//! set insertion under a lock held for that insertion only. The set holds each `event:name` key
//! once however often it happens between two flushes (CouchDB's `global_changes` coalesces the
//! same way), so it is bounded by three keys per database changed within one flush interval,
//! and by [`MAX_PENDING_EVENTS`] whatever happens.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// The database that keeps the events: CouchDB's name for it. Its own changes are never events
/// (CouchDB's listener leaves them out too, or every flush would make the next one).
pub const GLOBAL_CHANGES_DB: &str = "_global_changes";

/// Most distinct events kept between two flushes; past it new keys are dropped and counted
/// ([`Activity::dropped_events`]). Three per database changed in one flush interval: reached
/// only by creating and deleting this many distinct names within one interval.
pub const MAX_PENDING_EVENTS: usize = 100_000;

/// A database event as CouchDB names it in `_db_updates`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DbEvent {
    Created,
    Updated,
    Deleted,
}

impl DbEvent {
    pub fn as_str(self) -> &'static str {
        match self {
            DbEvent::Created => "created",
            DbEvent::Updated => "updated",
            DbEvent::Deleted => "deleted",
        }
    }
}

/// The counters and the pending events of one process's databases.
#[derive(Default)]
pub struct Activity {
    documents_read: AtomicU64,
    databases_changed: AtomicU64,
    /// `event:name` keys not yet written to [`GLOBAL_CHANGES_DB`].
    pending: Mutex<BTreeSet<String>>,
    dropped_events: AtomicU64,
    /// Event documents written to [`GLOBAL_CHANGES_DB`] ([`super::global_changes`]).
    event_writes: AtomicU64,
}

impl Activity {
    /// `count` documents were read from a database (CouchDB's `database_reads`).
    pub fn read(&self, count: usize) {
        self.documents_read.fetch_add(count as u64, Ordering::Relaxed);
    }

    /// A database was changed (CouchDB's `database_writes`): an `updated` event.
    pub fn changed(&self, database: &str) {
        self.databases_changed.fetch_add(1, Ordering::Relaxed);
        self.event(DbEvent::Updated, database);
    }

    /// A database's event, kept for the next flush.
    pub fn event(&self, event: DbEvent, database: &str) {
        if database == GLOBAL_CHANGES_DB {
            return;
        }
        let key = format!("{}:{database}", event.as_str());
        let mut pending = self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if pending.len() >= MAX_PENDING_EVENTS && !pending.contains(&key) {
            self.dropped_events.fetch_add(1, Ordering::Relaxed);
            return;
        }
        pending.insert(key);
    }

    /// The events kept since the last call, in key order; the set is empty afterwards.
    pub fn take_pending(&self) -> Vec<String> {
        let mut pending = self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        std::mem::take(&mut *pending).into_iter().collect()
    }

    /// Events waiting for the next flush (CouchDB's `global_changes.server_pending_updates`).
    pub fn pending_events(&self) -> usize {
        self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner).len()
    }

    /// `count` event documents were written.
    pub fn wrote_events(&self, count: usize) {
        self.event_writes.fetch_add(count as u64, Ordering::Relaxed);
    }

    pub fn documents_read(&self) -> u64 {
        self.documents_read.load(Ordering::Relaxed)
    }

    pub fn databases_changed(&self) -> u64 {
        self.databases_changed.load(Ordering::Relaxed)
    }

    pub fn event_writes(&self) -> u64 {
        self.event_writes.load(Ordering::Relaxed)
    }

    pub fn dropped_events(&self) -> u64 {
        self.dropped_events.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_kept_once_each_until_taken() {
        let activity = Activity::default();
        activity.changed("a");
        activity.changed("a");
        activity.event(DbEvent::Created, "b");
        activity.changed(GLOBAL_CHANGES_DB);
        assert_eq!(activity.databases_changed(), 3);
        assert_eq!(activity.pending_events(), 2);
        assert_eq!(activity.take_pending(), vec!["created:b".to_owned(), "updated:a".to_owned()]);
        assert_eq!(activity.pending_events(), 0);
    }

    #[test]
    fn past_the_bound_new_events_are_dropped_and_counted() {
        let activity = Activity::default();
        for n in 0..MAX_PENDING_EVENTS + 3 {
            activity.event(DbEvent::Created, &format!("db{n}"));
        }
        activity.event(DbEvent::Created, "db0");
        assert_eq!(activity.pending_events(), MAX_PENDING_EVENTS);
        assert_eq!(activity.dropped_events(), 3);
    }
}
