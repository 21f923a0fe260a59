//! Reduce answers remembered between queries, per view group, until the group's rows change.
//!
//! CouchDB keeps every inner node's reduction in its B-tree, so a `group=true` over a view whose
//! keys each span many rows reads a few nodes per key. The index file here keeps partials per
//! block of rows ([`super::index_store`]), and a block is taken whole only when it lies within
//! one group: keys spanning a few hundred rows each straddle nearly every block, and such a query
//! read every row (a `group=true` of 10 keys over 2,000 rows took as long as in CouchDB). So the
//! answer of a reduce query (its rows after `skip` and `limit`) is kept here, keyed by everything
//! that selects it (group number, view, key ranges, direction, grouping, skip, limit), and a
//! repeated query over an unchanged index is answered without reading the index.
//!
//! **Invalidation.** Every write of a group's rows goes through [`super::index_store::IndexStore`]
//! in one of three places, and each ends the group's cached answers after its commit
//! ([`ReduceCache::invalidate`]): `apply_within` (every catch-up batch: documents written,
//! edited, deleted or purged reach the index only through it), `drop_group` (`_view_cleanup`, an
//! ended incarnation, a deleted database) and `group` when it replaces a group written in an old
//! format (a new number; the old one is ended too). Group numbers are never reused within a file.
//! The index file is held by this process alone (redb locks it), so no other process changes the
//! rows behind this cache.
//!
//! **Races.** A query takes the group's generation ([`ReduceCache::ticket`]) before it opens its
//! read transaction, and its answer is kept only if the generation is still that one when it is
//! stored ([`ReduceCache::put`]); a write bumps the generation after its commit. So an answer read
//! from a snapshot older than a commit is never kept past that commit's invalidation.
//!
//! **Bounds.** At most [`CACHE_BYTES`] of answers (their JSON size, with their keys), each at most
//! [`ENTRY_BYTES`]; storing past the bound drops other answers first (any, not the oldest: it is a
//! memo of queries that repeat, not an LRU). Errors are never kept. Fixed sizes, not settings:
//! the memory is small beside the index's own page cache (docs/views.md, "Bounds").

use std::collections::HashMap;
use std::sync::Mutex;

use serde_json::Value;

use super::builtin_reduce::Builtin;
use super::index_store::RowRange;
use super::query::Grouping;

/// Most bytes of answers (and their keys) kept, all groups together.
pub const CACHE_BYTES: usize = 8 << 20;
/// Largest answer kept: a reduce answering more is computed each time.
pub const ENTRY_BYTES: usize = 256 << 10;

/// What selects a reduce answer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ReduceKey {
    pub number: u64,
    pub view: usize,
    /// The built-in reducing, `None` for the view's JavaScript reduce. A group's views keep
    /// their reduce functions (they are in its signature), but the key does not rely on it.
    pub builtin: Option<Builtin>,
    pub ranges: Vec<RowRange>,
    pub descending: bool,
    pub grouping: Grouping,
    pub skip: u64,
    pub limit: Option<u64>,
}

impl ReduceKey {
    /// Bytes the key holds (its ranges' bounds), counted against [`CACHE_BYTES`].
    fn bytes(&self) -> usize {
        let bound = |bound: &std::ops::Bound<Vec<u8>>| match bound {
            std::ops::Bound::Included(bytes) | std::ops::Bound::Excluded(bytes) => bytes.len(),
            std::ops::Bound::Unbounded => 0,
        };
        64 + self.ranges.iter().map(|range| 16 + bound(&range.low) + bound(&range.high)).sum::<usize>()
    }
}

/// A reduce answer: `(key, value)` per group.
pub type ReduceAnswer = Vec<(Value, Value)>;

struct Entry {
    rows: ReduceAnswer,
    bytes: usize,
}

#[derive(Default)]
struct Inner {
    /// Each group's generation, bumped by every write of its rows (absent: 0).
    generations: HashMap<u64, u64>,
    entries: HashMap<ReduceKey, Entry>,
    bytes: usize,
    /// Answers given from the cache (for the tests).
    hits: u64,
}

/// The remembered reduce answers of one index file.
#[derive(Default)]
pub struct ReduceCache {
    inner: Mutex<Inner>,
}

/// A group's generation as a query saw it before reading the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket(u64);

impl ReduceCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The generation of group `number` now: taken before the index is read.
    pub fn ticket(&self, number: u64) -> Ticket {
        Ticket(self.lock().generations.get(&number).copied().unwrap_or(0))
    }

    /// The answer kept for `key`, if any.
    pub fn get(&self, key: &ReduceKey) -> Option<ReduceAnswer> {
        let mut inner = self.lock();
        let rows = inner.entries.get(key).map(|entry| entry.rows.clone());
        if rows.is_some() {
            inner.hits += 1;
        }
        rows
    }

    /// Keeps `rows` as the answer of `key`, read after `ticket` was taken: dropped when the
    /// group was written since (the answer may predate the write) or when it is too large.
    pub fn put(&self, key: ReduceKey, ticket: Ticket, rows: &ReduceAnswer) {
        let answer_bytes = serde_json::to_string(rows).map_or(usize::MAX, |text| text.len());
        let bytes = answer_bytes.saturating_add(key.bytes());
        if bytes > ENTRY_BYTES {
            return;
        }
        let mut inner = self.lock();
        if inner.generations.get(&key.number).copied().unwrap_or(0) != ticket.0 {
            return;
        }
        while inner.bytes + bytes > CACHE_BYTES {
            let Some(evicted) = inner.entries.keys().next().cloned() else { break };
            if let Some(entry) = inner.entries.remove(&evicted) {
                inner.bytes -= entry.bytes;
            }
        }
        if let Some(replaced) = inner.entries.insert(key, Entry { rows: rows.clone(), bytes }) {
            inner.bytes -= replaced.bytes;
        }
        inner.bytes += bytes;
    }

    /// Ends every answer of group `number`: called after each commit that changes its rows.
    pub fn invalidate(&self, number: u64) {
        let mut inner = self.lock();
        *inner.generations.entry(number).or_insert(0) += 1;
        let mut freed = 0;
        inner.entries.retain(|key, entry| {
            let keep = key.number != number;
            if !keep {
                freed += entry.bytes;
            }
            keep
        });
        inner.bytes -= freed;
    }

    /// Answers given from the cache so far.
    #[cfg(test)]
    pub fn hits(&self) -> u64 {
        self.lock().hits
    }

    /// Bytes held now.
    #[cfg(test)]
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn key(number: u64, skip: u64) -> ReduceKey {
        ReduceKey {
            number,
            view: 0,
            builtin: Some(Builtin::Sum),
            ranges: vec![RowRange::all()],
            descending: false,
            grouping: Grouping::Exact,
            skip,
            limit: None,
        }
    }

    #[test]
    fn an_answer_read_before_a_write_is_not_kept_after_it() {
        let cache = ReduceCache::default();
        let rows = vec![(json!("a"), json!(1))];
        let before = cache.ticket(7);
        cache.invalidate(7);
        cache.put(key(7, 0), before, &rows);
        assert_eq!(cache.get(&key(7, 0)), None);
        let after = cache.ticket(7);
        cache.put(key(7, 0), after, &rows);
        assert_eq!(cache.get(&key(7, 0)), Some(rows.clone()));
        // Another group's write leaves it.
        cache.invalidate(8);
        assert_eq!(cache.get(&key(7, 0)), Some(rows.clone()));
        cache.invalidate(7);
        assert_eq!(cache.get(&key(7, 0)), None);
        assert_eq!(cache.bytes(), 0);
    }

    #[test]
    fn the_cache_stays_within_its_bound() {
        let cache = ReduceCache::default();
        let big = vec![(json!("k"), json!("x".repeat(ENTRY_BYTES / 2)))];
        for skip in 0..(2 * CACHE_BYTES / (ENTRY_BYTES / 2)) as u64 {
            cache.put(key(1, skip), cache.ticket(1), &big);
            assert!(cache.bytes() <= CACHE_BYTES);
        }
        assert!(cache.bytes() > CACHE_BYTES / 2);
        let too_big = vec![(json!("k"), json!("x".repeat(ENTRY_BYTES)))];
        cache.put(key(2, 0), cache.ticket(2), &too_big);
        assert_eq!(cache.get(&key(2, 0)), None);
    }
}
