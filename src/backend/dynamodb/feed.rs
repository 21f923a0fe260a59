//! The change feed, id order and erasure, over the two sharded indexes (docs/dynamodb-layout.md):
//! each reads every shard's index partition in small chunks and merges them
//! ([`crate::backend::raw::sharded`]), so a page costs about the page plus one chunk per shard.

use std::collections::HashMap;

use async_trait::async_trait;
use aws_sdk_dynamodb::types::{AttributeValue, DeleteRequest, WriteRequest};
use serde_json::Value;

use super::backend::DynamoDbBackend;
use super::codec::{self, Item};
use super::error::map_sdk;
use super::layout::{self, FEED_INDEX, ID_INDEX, SEQ, SHARD, SHARD_COUNT};
use crate::backend::raw::sharded::{Chunk, ShardReader, ShardedMerge};
use crate::backend::{
    Change, ChangesPage, DocumentBackend, IdRange, LayoutState, Page, Revision, StoredDocument, LOCAL_PREFIX,
};
use crate::error::{Error, ErrorKind, Result};

/// Ids that `all_docs` never lists besides tombstones: local and design documents.
const DESIGN_PREFIX: &str = "_design/";

fn limit_of(limit: usize) -> i32 {
    i32::try_from(limit.max(1)).unwrap_or(i32::MAX)
}

fn shard_value(shard: u32) -> AttributeValue {
    AttributeValue::N(shard.to_string())
}

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

/// One entry of the id index.
struct IdEntry {
    id: String,
    /// A tombstone or a chunk item: never listed.
    hidden: bool,
}

/// Reads the id index over a range, in its direction, after an id already returned.
struct IdReader<'a> {
    backend: &'a DynamoDbBackend,
    range: &'a IdRange,
    after: Option<String>,
}

#[async_trait]
impl ShardReader for IdReader<'_> {
    type Entry = IdEntry;
    type Key = String;
    type Cursor = Item;

    fn key(entry: &IdEntry) -> String {
        entry.id.clone()
    }

    async fn read(&self, shard: u32, cursor: Option<Item>, limit: usize) -> Result<Chunk<IdEntry, Item>> {
        let mut request = self
            .backend
            .client()
            .query()
            .table_name(self.backend.table())
            .index_name(ID_INDEX)
            .scan_index_forward(!self.range.descending)
            .expression_attribute_names("#shard", SHARD)
            .expression_attribute_values(":shard", shard_value(shard))
            .limit(limit_of(limit))
            .set_exclusive_start_key(cursor);
        // The near end bounds the query; the far end is checked on the entries read.
        let (strict, inclusive) = if self.range.descending { ("<", "<=") } else { (">", ">=") };
        let near = match (&self.after, &self.range.start) {
            (Some(after), _) => Some((strict, after)),
            // DynamoDB refuses an empty string in a key condition (a ValidationException), and
            // every id sorts at or after "": an empty start is no bound (a descending range from
            // "" holds no id and never gets here, see `all_docs_page`).
            (None, Some(start)) if start.is_empty() => None,
            (None, Some(start)) => Some((inclusive, start)),
            (None, None) => None,
        };
        request = match near {
            Some((op, bound)) => request
                .key_condition_expression(format!("#shard = :shard AND #id {op} :near"))
                .expression_attribute_names("#id", codec::ID)
                .expression_attribute_values(":near", AttributeValue::S(bound.clone())),
            None => request.key_condition_expression("#shard = :shard"),
        };
        let output = request.send().await.map_err(|e| map_sdk(e, "read the id index"))?;
        let mut entries = Vec::with_capacity(output.items().len());
        for item in output.items() {
            let id = codec::string_attribute(item, codec::ID).unwrap_or_default().to_owned();
            if !self.range.contains(&id) {
                // Past the far end: this shard is done.
                return Ok(Chunk { entries, cursor: None });
            }
            entries.push(IdEntry { hidden: layout::is_tombstone(item) || codec::is_chunk(item), id });
        }
        Ok(Chunk { entries, cursor: output.last_evaluated_key })
    }
}

/// An `all_docs` page token: the last id returned.
fn encode_after(id: &str) -> String {
    Value::String(id.to_owned()).to_string()
}

fn decode_after(token: &str) -> Result<String> {
    match serde_json::from_str::<Value>(token) {
        // An empty id is never returned, so never a token (and would reach a key condition).
        Ok(Value::String(id)) if !id.is_empty() => Ok(id),
        _ => Err(Error::invalid("page token", "was not produced by this backend")),
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
        let boundary = match &token {
            Some(t) if t.settled > high => t.settled.clone(),
            _ => high,
        };
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
                FeedToken::new(&boundary, last_delivered.as_deref()).render()
            };
        }
        let last_seq = FeedToken::new(&boundary, last_delivered.as_deref()).render();
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

    /// `all_docs(range, limit, token)`: ids merged across shards, then their bodies by one
    /// consistent batch read.
    pub(super) async fn all_docs_page(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> Result<Page<StoredDocument>> {
        self.require_layout("all_docs").await?;
        let after = page_token.map(decode_after).transpose()?;
        // No id is empty (CouchDB refuses an empty `_id`, and DynamoDB an empty key), so a
        // descending range starting at "" holds none; reading it would put "" in a key condition.
        let descending_from_empty = range.descending && range.start.as_deref() == Some("");
        if descending_from_empty {
            return Ok(Page { items: Vec::new(), next: None });
        }
        let limit = limit.max(1);
        let reader = IdReader { backend: self, range, after };
        let chunk = ShardedMerge::<IdReader>::chunk_for(limit, SHARD_COUNT);
        let mut merge = ShardedMerge::new(reader, SHARD_COUNT, chunk, range.descending);
        let listed = |entry: &IdEntry| {
            !entry.hidden && !entry.id.starts_with(LOCAL_PREFIX) && !entry.id.starts_with(DESIGN_PREFIX)
        };
        let mut ids = Vec::with_capacity(limit);
        let mut more = false;
        while let Some(entry) = merge.next().await? {
            if listed(&entry) {
                if ids.len() == limit {
                    more = true;
                    break;
                }
                ids.push(entry.id);
            }
        }
        let next = if more { ids.last().map(|id| encode_after(id)) } else { None };
        // Bodies by consistent reads; an id deleted since the index read drops out.
        let items = self.get_many(&ids).await?.into_iter().flatten().collect();
        Ok(Page { items, next })
    }

    /// `erase_prefix(prefix)`: every item whose id starts with `prefix` (documents, tombstones,
    /// chunk items) found through the id index, shard by shard, deleted outright.
    pub(super) async fn erase_ids_with_prefix(&self, prefix: &str) -> Result<u64> {
        if prefix.is_empty() {
            return Err(Error::invalid("prefix", "must not be empty: erasing every document is not an erasure"));
        }
        if self.layout_state().await? != LayoutState::Current {
            return self.erase_by_scan(prefix).await;
        }
        let mut erased = 0;
        for shard in 0..SHARD_COUNT {
            let mut cursor: Option<Item> = None;
            loop {
                let output = self
                    .client()
                    .query()
                    .table_name(self.table())
                    .index_name(ID_INDEX)
                    .key_condition_expression("#shard = :shard AND begins_with(#id, :prefix)")
                    .expression_attribute_names("#shard", SHARD)
                    .expression_attribute_names("#id", codec::ID)
                    .expression_attribute_values(":shard", shard_value(shard))
                    .expression_attribute_values(":prefix", AttributeValue::S(prefix.to_owned()))
                    .set_exclusive_start_key(cursor.take())
                    .send()
                    .await
                    .map_err(|e| map_sdk(e, "find ids to erase"))?;
                erased += self.erase_items(output.items()).await?;
                cursor = output.last_evaluated_key;
                if cursor.is_none() {
                    break;
                }
            }
        }
        Ok(erased)
    }

    /// Erasure on a table not yet upgraded: its older items are in no id index, so a consistent
    /// scan of the whole table finds them (cost proportional to the table, not the prefix), so
    /// that erasing a user keeps working before the upgrade.
    async fn erase_by_scan(&self, prefix: &str) -> Result<u64> {
        tracing::warn!(table = %self.table(), "erasing by a full table scan: run `agentstore upgrade` to erase by index");
        let mut erased = 0;
        let mut cursor: Option<Item> = None;
        loop {
            let output = self
                .client()
                .scan()
                .table_name(self.table())
                .consistent_read(true)
                .filter_expression("begins_with(#id, :prefix)")
                .projection_expression("#id, #chunk")
                .expression_attribute_names("#id", codec::ID)
                .expression_attribute_names("#chunk", codec::CHUNK_OF)
                .expression_attribute_values(":prefix", AttributeValue::S(prefix.to_owned()))
                .set_exclusive_start_key(cursor.take())
                .send()
                .await
                .map_err(|e| map_sdk(e, "scan the table for ids to erase"))?;
            erased += self.erase_items(output.items()).await?;
            cursor = output.last_evaluated_key;
            if cursor.is_none() {
                return Ok(erased);
            }
        }
    }

    /// Deletes these items outright, 25 a BatchWriteItem; how many were documents (not chunks).
    async fn erase_items(&self, items: &[Item]) -> Result<u64> {
        let ids: Vec<String> =
            items.iter().filter_map(|item| codec::string_attribute(item, codec::ID)).map(str::to_owned).collect();
        let documents = items.iter().filter(|item| !codec::is_chunk(item)).count() as u64;
        for batch in ids.chunks(super::backend::BATCH_WRITE_MAX) {
            let requests = batch
                .iter()
                .map(|id| {
                    let key = HashMap::from([(codec::ID.to_owned(), AttributeValue::S(id.clone()))]);
                    DeleteRequest::builder()
                        .set_key(Some(key))
                        .build()
                        .map(|delete| WriteRequest::builder().delete_request(delete).build())
                        .map_err(|e| Error::new(ErrorKind::Internal, "build delete request").with_source(e))
                })
                .collect::<Result<Vec<_>>>()?;
            let left = self.batch_write_with_retries(requests).await?;
            if !left.is_empty() {
                return Err(Error::new(
                    ErrorKind::Unavailable,
                    format!("DynamoDB left {} deletions of an erasure unprocessed; run the erasure again", left.len()),
                )
                .with_retries_exhausted());
            }
        }
        Ok(documents)
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
    }
}
