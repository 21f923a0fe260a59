//! The check that a remembered count of a database table still holds
//! ([`crate::backend::raw::count_cache`]; docs/dynamodb-layout.md, "Remembered counts"): the
//! feed index's entries at or after a window start, and the purge trace, a counter item every
//! erasure bumps.
//!
//! The window starts `settle_ms` before this process's clock when the count begins. Under the
//! feed's settle assumption (a write is in the index by its position's time plus the settle), a
//! write not yet in the index when the fingerprint is read has a position at or after the window,
//! so any create, update or delete landing after the fingerprint puts an entry in the window that
//! was not there: the fingerprint changes. An erasure removes an entry rather than moving it, so
//! it bumps the trace after it (whatever its outcome), before it is acknowledged.

use aws_sdk_dynamodb::types::AttributeValue;
use futures::{StreamExt, TryStreamExt};

use super::backend::DynamoDbBackend;
use super::codec::{self, Item};
use super::error::map_sdk;
use super::layout::{self, limit_of, shard_value, FEED_INDEX, META, SEQ, SHARD, SHARD_COUNT};
use crate::backend::raw::count_cache::{Check, Fingerprint, FINGERPRINT_ENTRIES_MAX};
use crate::error::Result;

/// The purge trace's item: `_agentstore/` is no data-store id and no local document's, and its
/// `_meta` hides it from every listing and scan ([`layout::is_hidden`]), as the layout marker's.
pub const PURGE_TRACE_ID: &str = "_agentstore/purges";
/// The purge trace's counter attribute.
const PURGE_COUNT: &str = "purges";
/// Feed shards read at once by a fingerprint.
const FINGERPRINT_CONCURRENCY: usize = 16;

impl DynamoDbBackend {
    /// A count read by `count`, with the check read before it: the fingerprint of the window
    /// starting `settle_ms` before now.
    pub(super) async fn count_with_check<F>(&self, count: F) -> Result<(u64, Option<Check>)>
    where
        F: std::future::Future<Output = Result<u64>>,
    {
        let millis = layout::now_millis().saturating_sub(u64::try_from(self.settle().as_millis()).unwrap_or(u64::MAX));
        // Every position stamped at or after that millisecond sorts at or after its digits alone.
        let window = format!("{millis:013}");
        let fingerprint = self.count_fingerprint(window.clone()).await?;
        let value = count.await?;
        Ok((value, fingerprint.map(|fingerprint| Check { window, fingerprint })))
    }

    /// The fingerprint of the feed entries at or after `window` and of the purge trace: one
    /// `Query` per feed shard projecting the keys only, and the trace's consistent `GetItem`, at
    /// once. `None` past [`FINGERPRINT_ENTRIES_MAX`] entries.
    pub(super) async fn count_fingerprint(&self, window: String) -> Result<Option<Fingerprint>> {
        let entries = futures::stream::iter(0..SHARD_COUNT)
            .map(|shard| self.window_entries(shard, &window))
            .buffer_unordered(FINGERPRINT_CONCURRENCY)
            .try_fold(Vec::new(), |mut all, mut some| async move {
                all.append(&mut some);
                Ok(all)
            });
        let (entries, purges) = futures::try_join!(entries, self.purge_trace())?;
        Ok(Fingerprint::of(entries, purges))
    }

    /// One shard's feed entries at or after `window` (id and position), at most one past
    /// [`FINGERPRINT_ENTRIES_MAX`] (enough to know the window is too full).
    async fn window_entries(&self, shard: u32, window: &str) -> Result<Vec<(String, String)>> {
        let output = self
            .client()
            .query()
            .table_name(self.table())
            .index_name(FEED_INDEX)
            .key_condition_expression("#shard = :shard AND #seq >= :window")
            .projection_expression("#id, #seq")
            .expression_attribute_names("#shard", SHARD)
            .expression_attribute_names("#seq", SEQ)
            .expression_attribute_names("#id", codec::ID)
            .expression_attribute_values(":shard", shard_value(shard))
            .expression_attribute_values(":window", AttributeValue::S(window.to_owned()))
            .limit(limit_of(FINGERPRINT_ENTRIES_MAX + 1))
            .send()
            .await
            .map_err(|e| map_sdk(e, "read the change feed's latest entries"))?;
        let field = |item: &Item, name| codec::string_attribute(item, name).unwrap_or_default().to_owned();
        Ok(output.items().iter().map(|item| (field(item, codec::ID), field(item, SEQ))).collect())
    }

    /// How many erasures the table has seen (0 before the first).
    async fn purge_trace(&self) -> Result<u64> {
        let item =
            self.consistent_get(PURGE_TRACE_ID).send().await.map_err(|e| map_sdk(e, "read the purge trace"))?.item;
        Ok(match item.as_ref().and_then(|item| item.get(PURGE_COUNT)) {
            Some(AttributeValue::N(n)) => n.parse().unwrap_or(0),
            _ => 0,
        })
    }

    /// Runs `erasure` between two bumps of the purge trace, so that other processes'
    /// remembered counts fail their check. The bump after (whatever the outcome but a conflict,
    /// which erased nothing: an erasure that failed part way may have erased some) is what a
    /// count re-read while the erasure ran needs; the bump before is for a crash between the
    /// erasure and the bump after, which would otherwise leave a count that includes the erased
    /// documents passing its check until `count_max_age_ms` (the client's retry may find nothing
    /// left to erase). The bump before failing erases nothing. An erasure that succeeded fails if
    /// the trace cannot be bumped after it (it is safe to repeat); one that failed keeps its own
    /// error, the trace's only logged.
    pub(super) async fn traced<T>(&self, erasure: impl std::future::Future<Output = Result<T>>) -> Result<T> {
        self.trace_purge().await?;
        let erasure = erasure.await;
        if matches!(&erasure, Err(err) if err.is_conflict()) {
            return erasure;
        }
        let traced = self.trace_purge().await;
        match (erasure, traced) {
            (Ok(_), Err(err)) => Err(err),
            (Err(err), Err(trace)) => {
                tracing::warn!(table = %self.table(), error = %trace, "a failed erasure left the purge trace as it was");
                Err(err)
            }
            (erasure, Ok(())) => erasure,
        }
    }

    async fn trace_purge(&self) -> Result<()> {
        self.client()
            .update_item()
            .table_name(self.table())
            .set_key(Some(Self::key(PURGE_TRACE_ID)))
            .update_expression("SET #meta = :meta ADD #purges :one")
            .expression_attribute_names("#meta", META)
            .expression_attribute_names("#purges", PURGE_COUNT)
            .expression_attribute_values(":meta", AttributeValue::S("purges".into()))
            .expression_attribute_values(":one", AttributeValue::N("1".into()))
            .send()
            .await
            .map_err(|e| map_sdk(e, "record an erasure in the purge trace"))?;
        Ok(())
    }
}
