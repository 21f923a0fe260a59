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

use aws_sdk_dynamodb::types::{AttributeValue, Select};
use futures::{StreamExt, TryStreamExt};

use super::backend::DynamoDbBackend;
use super::codec::{self, Item};
use super::error::map_sdk;
use super::layout::{shard_value, DELETED, ID_INDEX, SHARD, SHARD_COUNT};
use crate::backend::LayoutState;
use crate::error::Result;

/// How long a count is served again by default (`count_max_age_ms`).
pub const DEFAULT_COUNT_MAX_AGE: Duration = Duration::from_secs(1);

/// Shards counted at once.
const COUNT_CONCURRENCY: usize = 8;

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
    counting: tokio::sync::Mutex<()>,
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
    fn fresh(&self) -> Option<u64> {
        let generation = self.generation.load(Ordering::SeqCst);
        self.lock().filter(|r| r.generation == generation && r.read_at.elapsed() < self.max_age).map(|r| r.value)
    }

    /// Before a count is read: the generation it will be remembered at.
    fn ticket(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    fn remember(&self, ticket: u64, value: u64) {
        *self.lock() = Some(Remembered { generation: ticket, value, read_at: Instant::now() });
    }

    /// After a document write of this process: the next count is read anew.
    pub fn wrote(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
    }
}

impl DynamoDbBackend {
    /// The exact count behind `exact_count` for a database table; `None` for the data-store
    /// table and for a table without this release's layout (its older items are in no id index).
    pub(super) async fn live_document_count(&self) -> Result<Option<u64>> {
        if !self.counts_exactly() || self.layout_state().await? != LayoutState::Current {
            return Ok(None);
        }
        let cache = self.count_cache();
        if let Some(count) = cache.fresh() {
            return Ok(Some(count));
        }
        let _turn = cache.counting.lock().await;
        // The count this caller waited for may serve it.
        if let Some(count) = cache.fresh() {
            return Ok(Some(count));
        }
        let ticket = cache.ticket();
        let count = futures::stream::iter(0..SHARD_COUNT)
            .map(|shard| self.count_shard(shard))
            .buffer_unordered(COUNT_CONCURRENCY)
            .try_fold(0u64, |total, n| async move { Ok(total + n) })
            .await?;
        cache.remember(ticket, count);
        Ok(Some(count))
    }

    /// Live documents in one shard of the id index: `Select=COUNT` pages, each at most 1 MB of
    /// index entries read, filtered to entries that are neither chunks nor tombstones.
    async fn count_shard(&self, shard: u32) -> Result<u64> {
        let mut total = 0u64;
        let mut cursor: Option<Item> = None;
        loop {
            let output = self
                .client()
                .query()
                .table_name(self.table())
                .index_name(ID_INDEX)
                .select(Select::Count)
                .key_condition_expression("#shard = :shard")
                // `NOT (x = true)` also holds where `_deleted` is absent (a comparison with a
                // missing attribute is false): the entries `layout::is_tombstone` says are live.
                .filter_expression("attribute_not_exists(#chunk) AND NOT (#deleted = :true)")
                .expression_attribute_names("#shard", SHARD)
                .expression_attribute_names("#chunk", codec::CHUNK_OF)
                .expression_attribute_names("#deleted", DELETED)
                .expression_attribute_values(":shard", shard_value(shard))
                .expression_attribute_values(":true", AttributeValue::Bool(true))
                .set_exclusive_start_key(cursor.take())
                .send()
                .await
                .map_err(|e| map_sdk(e, "count the documents of the id index"))?;
            total += u64::try_from(output.count()).unwrap_or(0);
            cursor = output.last_evaluated_key;
            if cursor.is_none() {
                return Ok(total);
            }
        }
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
