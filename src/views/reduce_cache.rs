//! Reduce answers and map answers' offsets remembered between queries, per view group, until the
//! group's rows change.
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
//! A map answer's `offset` (the rows before where it starts) is kept the same way, keyed by the
//! bound it counts to ([`OffsetKey`]): counting it reads the block summaries before the bound and
//! then every row of the bound's block up to it (a block holds up to 512 rows), which was a sixth
//! of a `key=` query with `limit=10` (issue 38); its rows are still read each time.
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
//! **Bounds.** At most [`CACHE_BYTES`] of answers (their JSON size, with their keys; an offset
//! counts its key's bound and [`OFFSET_BYTES`]), each at most [`ENTRY_BYTES`]; storing past the
//! bound drops other answers first (any, not the oldest: it is a memo of queries that repeat, not
//! an LRU). Errors are never kept. Fixed sizes, not settings:
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

/// What selects a map answer's offset: the rows of view `view` of group `number` before `bound`
/// (an upper bound in row-key bytes after the view prefix), or after it when `descending` (a lower
/// bound then).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OffsetKey {
    pub number: u64,
    pub view: usize,
    pub descending: bool,
    pub bound: std::ops::Bound<Vec<u8>>,
}

/// Bytes an offset is counted as besides its bound (the count, the key's other fields, the map's
/// own entry).
pub const OFFSET_BYTES: usize = 64;

impl OffsetKey {
    fn bytes(&self) -> usize {
        OFFSET_BYTES
            + match &self.bound {
                std::ops::Bound::Included(bytes) | std::ops::Bound::Excluded(bytes) => bytes.len(),
                std::ops::Bound::Unbounded => 0,
            }
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
    offsets: HashMap<OffsetKey, u64>,
    bytes: usize,
    /// Answers given from the cache (for the tests).
    hits: u64,
}

impl Inner {
    /// Drops kept answers (reduce answers first, then offsets) until `bytes` more fit.
    fn make_room(&mut self, bytes: usize) {
        while self.bytes + bytes > CACHE_BYTES {
            if let Some(evicted) = self.entries.keys().next().cloned() {
                if let Some(entry) = self.entries.remove(&evicted) {
                    self.bytes -= entry.bytes;
                }
            } else if let Some(evicted) = self.offsets.keys().next().cloned() {
                self.offsets.remove(&evicted);
                self.bytes -= evicted.bytes();
            } else {
                break;
            }
        }
    }
}

/// The remembered reduce answers and offsets of one index file.
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
        let Some(mut inner) = self.admit(key.number, ticket, bytes) else { return };
        if let Some(replaced) = inner.entries.insert(key, Entry { rows: rows.clone(), bytes }) {
            inner.bytes -= replaced.bytes;
        }
        inner.bytes += bytes;
    }

    /// The cache locked with room made for an entry of `bytes` of group `number`; `None` when the
    /// entry is too large to keep or the group was written since `ticket` was taken (what was
    /// read may predate that write).
    fn admit(&self, number: u64, ticket: Ticket, bytes: usize) -> Option<std::sync::MutexGuard<'_, Inner>> {
        if bytes > ENTRY_BYTES {
            return None;
        }
        let mut inner = self.lock();
        if inner.generations.get(&number).copied().unwrap_or(0) != ticket.0 {
            return None;
        }
        inner.make_room(bytes);
        Some(inner)
    }

    /// The offset kept for `key`, if any.
    pub fn offset(&self, key: &OffsetKey) -> Option<u64> {
        let mut inner = self.lock();
        let offset = inner.offsets.get(key).copied();
        if offset.is_some() {
            inner.hits += 1;
        }
        offset
    }

    /// Keeps `offset` for `key`, counted after `ticket` was taken: dropped when the group was
    /// written since.
    pub fn put_offset(&self, key: OffsetKey, ticket: Ticket, offset: u64) {
        let bytes = key.bytes();
        let Some(mut inner) = self.admit(key.number, ticket, bytes) else { return };
        // A key kept already holds the same count (the generation is unchanged) and its bytes.
        if inner.offsets.insert(key, offset).is_none() {
            inner.bytes += bytes;
        }
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
        inner.offsets.retain(|key, _| {
            let keep = key.number != number;
            if !keep {
                freed += key.bytes();
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
    fn an_offset_counted_before_a_write_is_not_kept_and_offsets_share_the_bound() {
        let cache = ReduceCache::default();
        let offset_key = |number: u64, bound: Vec<u8>| OffsetKey {
            number,
            view: 0,
            descending: false,
            bound: std::ops::Bound::Included(bound),
        };
        let before = cache.ticket(3);
        cache.invalidate(3);
        cache.put_offset(offset_key(3, vec![1, 2, 3]), before, 10);
        assert_eq!(cache.offset(&offset_key(3, vec![1, 2, 3])), None);
        cache.put_offset(offset_key(3, vec![1, 2, 3]), cache.ticket(3), 10);
        cache.put_offset(offset_key(3, vec![1, 2, 3]), cache.ticket(3), 10);
        assert_eq!(cache.offset(&offset_key(3, vec![1, 2, 3])), Some(10));
        assert_eq!(cache.bytes(), OFFSET_BYTES + 3, "kept once");
        cache.invalidate(4);
        assert_eq!(cache.offset(&offset_key(3, vec![1, 2, 3])), Some(10));
        cache.invalidate(3);
        assert_eq!(cache.offset(&offset_key(3, vec![1, 2, 3])), None);
        assert_eq!(cache.bytes(), 0);
        // Offsets and reduce answers fill one bound together.
        let rows = vec![(json!("k"), json!("x".repeat(ENTRY_BYTES / 2)))];
        cache.put(key(1, 0), cache.ticket(1), &rows);
        for n in 0..(CACHE_BYTES / OFFSET_BYTES) as u64 {
            cache.put_offset(offset_key(2, n.to_be_bytes().to_vec()), cache.ticket(2), n);
            assert!(cache.bytes() <= CACHE_BYTES);
        }
        assert_eq!(cache.get(&key(1, 0)), None, "the reduce answer made room first");
        assert!(cache.bytes() > CACHE_BYTES - OFFSET_BYTES - 8);
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
