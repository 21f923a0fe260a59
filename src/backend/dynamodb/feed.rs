//! The change feed over the sharded feed index (docs/dynamodb-layout.md): every shard's index
//! partition is read in small chunks and merged ([`crate::backend::raw::sharded`]), so a page
//! costs about the page plus one chunk per shard.

use async_trait::async_trait;
use aws_sdk_dynamodb::types::AttributeValue;

use super::backend::DynamoDbBackend;
use super::codec::{self, Item};
use super::error::map_sdk;
use super::layout::{self, limit_of, shard_value, FEED_INDEX, SEQ, SHARD, SHARD_COUNT};
use crate::backend::raw::sharded::{Chunk, ShardReader, ShardedMerge};
use crate::backend::{Change, ChangesPage, Revision};
use crate::error::{Error, ErrorKind, Result};

/// Reads the feed index between two positions (both inclusive), one shard at a time.
struct FeedReader<'a> {
    backend: &'a DynamoDbBackend,
    low: String,
    high: String,
}

#[async_trait]
impl ShardReader for FeedReader<'_> {
    type Entry = Change;
    type Key = (String, String);
    type Cursor = Item;

    fn key(change: &Change) -> (String, String) {
        (change.seq.clone(), change.id.clone())
    }

    async fn read(&self, shard: u32, cursor: Option<Item>, limit: usize) -> Result<Chunk<Change, Item>> {
        let output = self
            .backend
            .client()
            .query()
            .table_name(self.backend.table())
            .index_name(FEED_INDEX)
            .key_condition_expression("#shard = :shard AND #seq BETWEEN :low AND :high")
            .expression_attribute_names("#shard", SHARD)
            .expression_attribute_names("#seq", SEQ)
            .expression_attribute_values(":shard", shard_value(shard))
            .expression_attribute_values(":low", AttributeValue::S(self.low.clone()))
            .expression_attribute_values(":high", AttributeValue::S(self.high.clone()))
            .limit(limit_of(limit))
            .set_exclusive_start_key(cursor)
            .send()
            .await
            .map_err(|e| map_sdk(e, "read the change feed index"))?;
        let mut entries = Vec::with_capacity(output.items().len());
        for item in output.items() {
            let field = |name| codec::string_attribute(item, name).map(str::to_owned);
            let (Some(id), Some(seq), Some(rev)) = (field(codec::ID), field(SEQ), field(codec::REV)) else {
                return Err(Error::new(ErrorKind::Corrupt, "a change feed index entry lacks _id, _seq or _rev"));
            };
            entries.push(Change { seq, id, rev: Revision(rev), deleted: layout::is_tombstone(item) });
        }
        Ok(Chunk { entries, cursor: output.last_evaluated_key })
    }
}

/// A change feed token: the settled position every change up to which has been returned, and
/// the last position of the unsettled tail already delivered past it, if any. Written
/// `<settled>` or `<settled>~<delivered>`; both parts are positions [`layout::check_position`]
/// accepts.
///
/// A read from a token reads the settled feed from `settled` (so a write that lands late, with a
/// position below what was delivered, is still found) and the tail only after `delivered` (so a
/// follower that polls within the settle window is not handed the same tail again and again).
#[derive(Debug, Clone, PartialEq, Eq)]
struct FeedToken {
    settled: String,
    delivered: Option<String>,
}

/// Separates a token's two positions (`~` needs no escaping in a URL).
const TOKEN_SEPARATOR: char = '~';

impl FeedToken {
    fn parse(text: &str) -> Result<FeedToken> {
        let (settled, delivered) = match text.split_once(TOKEN_SEPARATOR) {
            Some((settled, delivered)) => (settled, Some(delivered)),
            None => (text, None),
        };
        let refuse =
            || Error::invalid("since", format!("{text:?} is not a change feed position of this DynamoDB backend"));
        layout::check_position(settled).map_err(|_| refuse())?;
        if let Some(delivered) = delivered {
            layout::check_position(delivered).map_err(|_| refuse())?;
        }
        Ok(FeedToken { settled: settled.to_owned(), delivered: delivered.map(str::to_owned) })
    }

    /// The token for `settled`, keeping `delivered` only while it lies past it.
    fn new(settled: &str, delivered: Option<&str>) -> FeedToken {
        FeedToken { settled: settled.to_owned(), delivered: delivered.filter(|d| *d > settled).map(str::to_owned) }
    }

    fn render(&self) -> String {
        match &self.delivered {
            Some(delivered) => format!("{}{TOKEN_SEPARATOR}{delivered}", self.settled),
            None => self.settled.clone(),
        }
    }
}

/// The first position after `position` in the index's order: `-` sorts before every digit, `g`
/// and hex digit a position continues with.
fn after(position: &str) -> String {
    format!("{position}-")
}

/// The position every stamped position lies past: the bound of the clock's millisecond 0 (a
/// position is stamped with a clock past 1970). A read from the start of the feed that finds no
/// settled change resumes from it.
fn lowest_position() -> String {
    layout::position_after_millis(0)
}

/// Reads the feed index from `low` to `high` (both inclusive), merged across shards, into
/// `changes` until it holds `limit` entries; whether the index ran out first. An index that has not
/// yet dropped a document's previous entry can show it twice; the later position is its latest.
async fn read_feed_into(
    backend: &DynamoDbBackend,
    low: String,
    high: String,
    changes: &mut Vec<Change>,
    limit: usize,
) -> Result<bool> {
    let wanted = limit.saturating_sub(changes.len()).max(1);
    let reader = FeedReader { backend, low, high };
    let mut merge =
        ShardedMerge::new(reader, SHARD_COUNT, ShardedMerge::<FeedReader>::chunk_for(wanted, SHARD_COUNT), false);
    while changes.len() < limit {
        match merge.next().await? {
            Some(change) => {
                changes.retain(|c| c.id != change.id);
                changes.push(change);
            }
            None => return Ok(true),
        }
    }
    Ok(false)
}

impl DynamoDbBackend {
    /// `changes(since, limit)`: the settled positions after `since` up to the settle bound, then,
    /// once those are exhausted, the unsettled tail the index shows past it, merged across shards
    /// by (position, id). Every `seq` and `last_seq` handed out names a settled position (with the
    /// tail already delivered past it), never a tail position alone.
    pub(super) async fn changes_page(&self, since: Option<&str>, limit: usize) -> Result<ChangesPage> {
        self.require_layout("the change feed").await?;
        let token = since.map(FeedToken::parse).transpose()?;
        let limit = limit.max(1);
        let high = self.settled_position();
        let delivered = token.as_ref().and_then(|t| t.delivered.clone());
        let low = token.as_ref().map_or_else(|| "0".to_owned(), |t| after(&t.settled));
        let mut changes: Vec<Change> = Vec::with_capacity(limit);
        // A token's settled position can lie past this clock's bound (another process's clock
        // runs ahead, or the follower asked again within a millisecond): then nothing settled is
        // new, and the token's position stays the boundary.
        let settled_done = low > high || read_feed_into(self, low, high.clone(), &mut changes, limit).await?;
        if !settled_done {
            for change in &mut changes {
                change.seq = FeedToken::new(&change.seq, delivered.as_deref()).render();
            }
            let last_seq = changes.last().map_or_else(|| high.clone(), |c| c.seq.clone());
            return Ok(ChangesPage { changes, last_seq, pending: None, unsettled: 0 });
        }
        // Every settled change up to the last one seen has been returned, and the settled range
        // past it up to the bound was read empty (no write can land there any more: that is what
        // settled means), so a token naming that change instead of the bound misses nothing and
        // re-reads only an empty range. Unlike the bound, it stays the same while nothing is
        // written: two reads with no write between answer the same `last_seq`, as CouchDB's do.
        // With nothing settled seen, it is the token's own position, or from the start of the
        // feed the lowest position (every stamp lies past it).
        let settled_seen = changes.last().map(|c| c.seq.clone()).or_else(|| token.as_ref().map(|t| t.settled.clone()));
        let boundary = match &token {
            Some(t) if t.settled > high => t.settled.clone(),
            _ => high,
        };
        let resume_from = settled_seen.unwrap_or_else(lowest_position);
        // The unsettled tail: past the boundary and past what an earlier read delivered.
        let tail_from = match delivered.as_deref() {
            Some(d) if d > boundary.as_str() => d.to_owned(),
            _ => boundary.clone(),
        };
        let tail_end = layout::position_after_millis(layout::MAX_POSITION_MILLIS);
        let tail_done = read_feed_into(self, after(&tail_from), tail_end, &mut changes, limit).await?;
        // Settled positions lie at or below the boundary, the tail's past it (a document whose
        // settled entry the tail superseded has left the settled part).
        let unsettled = changes.iter().filter(|c| c.seq > boundary).count();
        let settled_count = changes.len() - unsettled;
        let mut last_delivered = delivered.clone();
        for (n, change) in changes.iter_mut().enumerate() {
            change.seq = if n < settled_count {
                FeedToken::new(&change.seq, delivered.as_deref()).render()
            } else {
                last_delivered = Some(std::mem::take(&mut change.seq));
                FeedToken::new(&resume_from, last_delivered.as_deref()).render()
            };
        }
        let last_seq = FeedToken::new(&resume_from, last_delivered.as_deref()).render();
        Ok(ChangesPage { changes, last_seq, pending: tail_done.then_some(0), unsettled })
    }

    /// The feed position up to which a change feed read now is complete: `now - settle`.
    pub(super) fn settled_position(&self) -> String {
        let settle = u64::try_from(self.settle().as_millis()).unwrap_or(u64::MAX);
        layout::position_after_millis(layout::now_millis().saturating_sub(settle))
    }

    /// `change_position()`: the settled position, with the tail up to the millisecond before now
    /// marked delivered, so a `since=now` reader is not handed the writes of the last settle
    /// window as new (it sees them once more when they settle, as it did before there was a tail).
    /// Writes stamped from this millisecond on, by this process's clock, show at once.
    pub(super) fn position_now(&self) -> String {
        let before_now = layout::position_after_millis(layout::now_millis().saturating_sub(1));
        FeedToken::new(&self.settled_position(), Some(&before_now)).render()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_keep_only_a_delivered_position_past_the_settled_one_and_refuse_garbage() {
        let settled = layout::position_after_millis(1_000);
        let delivered = layout::new_position();
        let token = FeedToken::new(&settled, Some(&delivered));
        assert_eq!(token.render(), format!("{settled}~{delivered}"));
        assert_eq!(FeedToken::parse(&token.render()).unwrap(), token);
        // A delivered position at or below the settled one says nothing more: the plain form.
        assert_eq!(FeedToken::new(&delivered, Some(&settled)).render(), delivered);
        assert_eq!(FeedToken::parse(&delivered).unwrap(), FeedToken { settled: delivered.clone(), delivered: None });
        for bad in ["", "~", &format!("{settled}~"), &format!("~{settled}"), &format!("{settled}~x"), "abc"] {
            let err = FeedToken::parse(bad).unwrap_err();
            assert!(err.message().contains("since"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn the_position_after_one_sorts_before_every_later_position() {
        let earlier = layout::new_position();
        let later = layout::new_position();
        assert!(earlier < after(&earlier) && after(&earlier) < later);
        let bound = layout::position_after_millis(5);
        assert!(bound < after(&bound) && after(&bound) < layout::position_after_millis(6));
        assert!(later < layout::position_after_millis(layout::MAX_POSITION_MILLIS));
        // A read from the lowest position reads every stamped position, and it is a valid token.
        assert!(after(&lowest_position()) < earlier);
        assert_eq!(FeedToken::parse(&lowest_position()).unwrap().settled, lowest_position());
    }
}
