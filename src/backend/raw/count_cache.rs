//! Counts a backend makes over an index rather than by reading documents (DynamoDB's
//! `Select=COUNT`, Firestore's COUNT aggregation), remembered for a moment so that a client
//! polling `GET /{db}` or `_changes` does not have the whole index read every time
//! (docs/databases.md, "Document counts"; docs/couchdb-api.md, "Sequences").
//!
//! Each kind of count ([`Counted`]) is remembered apart. A count is served again until its max
//! age (the backend URL's `count_max_age_ms`) passes or a document write of this process
//! finishes: so this process's own writes show at once, another process's within the max age.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A count and the write generation it was read at.
#[derive(Clone, Copy)]
struct Remembered {
    generation: u64,
    value: u64,
    read_at: Instant,
}

/// What a count counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counted {
    /// Live documents (`exact_count`).
    LiveDocuments,
    /// Entries of the change feed: one per document, live or deleted (`feed_length`).
    FeedEntries,
}

impl Counted {
    fn slot(self) -> usize {
        match self {
            Counted::LiveDocuments => 0,
            Counted::FeedEntries => 1,
        }
    }
}

/// The remembered counts of one store, forgotten by every write of this process.
pub struct CountCache {
    max_age: Duration,
    /// Bumped after every document write of this process (whatever its outcome): a count read
    /// while a write was under way was read at an older generation and is never served.
    generation: AtomicU64,
    remembered: Mutex<[Option<Remembered>; 2]>,
    /// Held while a count is read, so concurrent callers wait for that one and share its answer
    /// rather than each reading the whole index.
    counting: tokio::sync::Mutex<()>,
}

impl CountCache {
    pub fn new(max_age: Duration) -> Self {
        CountCache {
            max_age,
            generation: AtomicU64::new(0),
            remembered: Mutex::new([None, None]),
            counting: tokio::sync::Mutex::new(()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, [Option<Remembered>; 2]> {
        self.remembered.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The remembered count of `what`, if no write of this process finished since it was read
    /// and it is younger than the max age.
    pub fn fresh(&self, what: Counted) -> Option<u64> {
        let generation = self.generation.load(Ordering::SeqCst);
        self.lock()[what.slot()]
            .filter(|r| r.generation == generation && r.read_at.elapsed() < self.max_age)
            .map(|r| r.value)
    }

    /// Before a count is read: the generation it will be remembered at.
    pub fn ticket(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    pub fn remember(&self, what: Counted, ticket: u64, value: u64) {
        self.lock()[what.slot()] = Some(Remembered { generation: ticket, value, read_at: Instant::now() });
    }

    /// The count of `what`: the remembered one when fresh, else `count()`'s, remembered. Callers
    /// at once wait for one count and share it rather than each reading the whole index.
    pub async fn get_or_count<F>(&self, what: Counted, count: F) -> crate::Result<u64>
    where
        F: std::future::Future<Output = crate::Result<u64>>,
    {
        if let Some(value) = self.fresh(what) {
            return Ok(value);
        }
        let _turn = self.counting.lock().await;
        // The count this caller waited for may serve it.
        if let Some(value) = self.fresh(what) {
            return Ok(value);
        }
        let ticket = self.ticket();
        let value = count.await?;
        self.remember(what, ticket, value);
        Ok(value)
    }

    /// After a document write of this process: the next count is read anew.
    pub fn wrote(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_is_served_until_a_write_or_its_age_runs_out() {
        let cache = CountCache::new(Duration::from_secs(60));
        assert_eq!(cache.fresh(Counted::LiveDocuments), None);
        cache.remember(Counted::LiveDocuments, cache.ticket(), 7);
        assert_eq!(cache.fresh(Counted::LiveDocuments), Some(7));
        cache.wrote();
        assert_eq!(cache.fresh(Counted::LiveDocuments), None);

        let short = CountCache::new(Duration::from_millis(1));
        short.remember(Counted::LiveDocuments, short.ticket(), 7);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(short.fresh(Counted::LiveDocuments), None);
    }

    #[test]
    fn a_count_overlapped_by_a_write_is_never_served() {
        let cache = CountCache::new(Duration::from_secs(60));
        let ticket = cache.ticket();
        cache.wrote();
        cache.remember(Counted::LiveDocuments, ticket, 7);
        assert_eq!(cache.fresh(Counted::LiveDocuments), None);
    }

    #[test]
    fn each_kind_is_remembered_apart_and_every_write_forgets_both() {
        let cache = CountCache::new(Duration::from_secs(60));
        cache.remember(Counted::FeedEntries, cache.ticket(), 9);
        assert_eq!((cache.fresh(Counted::LiveDocuments), cache.fresh(Counted::FeedEntries)), (None, Some(9)));
        cache.remember(Counted::LiveDocuments, cache.ticket(), 7);
        assert_eq!((cache.fresh(Counted::LiveDocuments), cache.fresh(Counted::FeedEntries)), (Some(7), Some(9)));
        cache.wrote();
        assert_eq!((cache.fresh(Counted::LiveDocuments), cache.fresh(Counted::FeedEntries)), (None, None));
    }

    #[test]
    fn a_zero_max_age_serves_nothing() {
        let cache = CountCache::new(Duration::ZERO);
        cache.remember(Counted::LiveDocuments, cache.ticket(), 7);
        assert_eq!(cache.fresh(Counted::LiveDocuments), None);
    }
}
