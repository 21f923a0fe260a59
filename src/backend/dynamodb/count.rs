//! The exact document count of a database table (docs/databases.md, "Document counts"): live
//! documents counted over the sharded id index without reading a body, and the count remembered
//! for a moment so a client polling `GET /{db}` does not read the whole index every time.
//!
//! The id index (`agentstore-ids`, docs/dynamodb-layout.md) holds one entry per item that carries
//! a shard: every document's main item (live or tombstone) and every body chunk item. Local
//! documents and the layout marker carry none, so they are not in it. A live document is thus an
//! entry that is neither a chunk (`_chunkOf`) nor a tombstone (`_deleted` = true); both are
//! projected into the index, so a `Select=COUNT` query with that filter counts live documents
//! reading index entries only (tens of bytes each), each shard's partition paged through
//! `LastEvaluatedKey`.

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

/// The remembered count of one table, forgotten by every write of this process.
pub(super) struct CountCache {
    max_age: Duration,
    /// Bumped after every document write of this process (whatever its outcome): a count read
    /// while a write was under way was read at an older generation and is never served.
    generation: AtomicU64,
    remembered: Mutex<Option<Remembered>>,
    /// Held while a count is read, so concurrent callers wait for that one and share its answer
    /// rather than each reading the whole index.
    pub(super) counting: tokio::sync::Mutex<()>,
}

impl CountCache {
    pub fn new(max_age: Duration) -> Self {
        CountCache {
            max_age,
            generation: AtomicU64::new(0),
            remembered: Mutex::new(None),
            counting: tokio::sync::Mutex::new(()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Remembered>> {
        self.remembered.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The remembered count, if no write of this process finished since it was read and it is
    /// younger than the max age.
    pub(super) fn fresh(&self) -> Option<u64> {
        let generation = self.generation.load(Ordering::SeqCst);
        self.lock().filter(|r| r.generation == generation && r.read_at.elapsed() < self.max_age).map(|r| r.value)
    }

    /// Before a count is read: the generation it will be remembered at.
    pub(super) fn ticket(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    pub(super) fn remember(&self, ticket: u64, value: u64) {
        *self.lock() = Some(Remembered { generation: ticket, value, read_at: Instant::now() });
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
        assert_eq!(cache.fresh(), None);
        cache.remember(cache.ticket(), 7);
        assert_eq!(cache.fresh(), Some(7));
        cache.wrote();
        assert_eq!(cache.fresh(), None);

        let short = CountCache::new(Duration::from_millis(1));
        short.remember(short.ticket(), 7);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(short.fresh(), None);
    }

    #[test]
    fn a_count_overlapped_by_a_write_is_never_served() {
        let cache = CountCache::new(Duration::from_secs(60));
        let ticket = cache.ticket();
        cache.wrote();
        cache.remember(ticket, 7);
        assert_eq!(cache.fresh(), None);
    }

    #[test]
    fn a_zero_max_age_serves_nothing() {
        let cache = CountCache::new(Duration::ZERO);
        cache.remember(cache.ticket(), 7);
        assert_eq!(cache.fresh(), None);
    }
}
