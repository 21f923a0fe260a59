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
/// the last position of the unsettled tail already delivered past it, if any, with the marks of
/// the tail changes delivered ([`mark_of`]). Written `<settled>`, `<settled>~<delivered>` or
/// `<settled>~<delivered>~<marks>`; both positions are positions [`layout::check_position`]
/// accepts, the marks [`MARK_DIGITS`] hex digits each, at most [`REMEMBERED_TAIL`] of them,
/// oldest first.
///
/// A read from a token reads the settled feed from `settled` (so a write that lands late, with a
/// position below what was delivered, is still found) and the tail only after `delivered` (so a
/// follower that polls within the settle window is not handed the same tail again and again).
/// The settled read skips the changes whose marks the token carries: those the tail delivered,
/// so that a reader continuing from the token is not handed them again when they settle, while a
/// late write between them, which no mark names, is. A reader that continues from a token has
/// therefore taken every change of the page that handed it out, the tail included (a follower
/// that left the tail for later would lose it: `migrate --follow` applies the tail too).
#[derive(Debug, Clone, PartialEq, Eq)]
struct FeedToken {
    settled: String,
    delivered: Option<String>,
    marks: Vec<String>,
}

/// Separates a token's parts (`~` needs no escaping in a URL).
const TOKEN_SEPARATOR: char = '~';
/// The most tail changes one token remembers as delivered, one per document: past them the
/// oldest is forgotten and may come once more when it settles (a token stays under 900
/// characters).
pub const REMEMBERED_TAIL: usize = 32;
/// Hex digits of a mark's document part (32 bits of the SHA-256 of the id), by which a later
/// write of the same document replaces the mark of an earlier one.
const MARK_DOCUMENT_DIGITS: usize = 8;
/// Hex digits of one mark: the document part, then 64 bits of the SHA-256 of id and position,
/// which name one write.
const MARK_DIGITS: usize = MARK_DOCUMENT_DIGITS + 16;

/// How two tokens compare in feed order: by the furthest position each names (the delivered one
/// when past the settled one). Positions are fixed-width (13 digits of milliseconds, then a
/// counter or `g`, which sorts after every counter of its millisecond): compared as text.
fn position_order(a: &str, b: &str) -> Option<std::cmp::Ordering> {
    let furthest = |text: &str| {
        let token = FeedToken::parse(text).ok()?;
        Some(token.delivered.filter(|delivered| *delivered > token.settled).unwrap_or(token.settled))
    };
    Some(furthest(a)?.cmp(&furthest(b)?))
}

/// The mark of a change read from the feed index (its `seq` still the index position).
fn mark_of(change: &Change) -> String {
    use sha2::{Digest, Sha256};
    let document = Sha256::digest(change.id.as_bytes());
    let mut write = Sha256::new();
    write.update(change.id.as_bytes());
    write.update([0]);
    write.update(change.seq.as_bytes());
    let write = write.finalize();
    let document_bytes = MARK_DOCUMENT_DIGITS / 2;
    format!("{}{}", hex::encode(&document[..document_bytes]), hex::encode(&write[..(MARK_DIGITS / 2) - document_bytes]))
}

/// Adds `mark` to the marks a token carries: it replaces the mark of an earlier write of the
/// same document (that write is superseded, its entry gone from the index), and past
/// [`REMEMBERED_TAIL`] the oldest mark is forgotten. Forgetting a mark costs at most a repeat,
/// never a change.
fn remember(marks: &mut Vec<String>, mark: String) {
    marks.retain(|m| m.get(..MARK_DOCUMENT_DIGITS) != mark.get(..MARK_DOCUMENT_DIGITS));
    if marks.len() >= REMEMBERED_TAIL {
        marks.remove(0);
    }
    marks.push(mark);
}

impl FeedToken {
    fn parse(text: &str) -> Result<FeedToken> {
        let refuse =
            || Error::invalid("since", format!("{text:?} is not a change feed position of this DynamoDB backend"));
        let mut parts = text.splitn(3, TOKEN_SEPARATOR);
        let settled = parts.next().unwrap_or_default();
        let delivered = parts.next();
        let marks = match parts.next() {
            Some(marks) => parse_marks(marks).ok_or_else(refuse)?,
            None => Vec::new(),
        };
        layout::check_position(settled).map_err(|_| refuse())?;
        if let Some(delivered) = delivered {
            layout::check_position(delivered).map_err(|_| refuse())?;
        }
        Ok(FeedToken { settled: settled.to_owned(), delivered: delivered.map(str::to_owned), marks })
    }

    /// The token for `settled`, keeping `delivered` and the `marks` only while it lies past it
    /// (every mark names a change at or below `delivered`).
    fn new(settled: &str, delivered: Option<&str>, marks: &[String]) -> FeedToken {
        let delivered = delivered.filter(|d| *d > settled).map(str::to_owned);
        let marks = if delivered.is_some() { marks.to_vec() } else { Vec::new() };
        FeedToken { settled: settled.to_owned(), delivered, marks }
    }

    fn render(&self) -> String {
        match &self.delivered {
            Some(delivered) if self.marks.is_empty() => format!("{}{TOKEN_SEPARATOR}{delivered}", self.settled),
            Some(delivered) => {
                format!("{}{TOKEN_SEPARATOR}{delivered}{TOKEN_SEPARATOR}{}", self.settled, self.marks.concat())
            }
            None => self.settled.clone(),
        }
    }
}

/// A token's marks, concatenated; `None` when there are none, when they are not [`MARK_DIGITS`]
/// lowercase hex digits each, or when there are more than [`REMEMBERED_TAIL`].
fn parse_marks(text: &str) -> Option<Vec<String>> {
    let well_formed = !text.is_empty()
        && text.len().is_multiple_of(MARK_DIGITS)
        && text.len() / MARK_DIGITS <= REMEMBERED_TAIL
        && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    well_formed.then(|| text.as_bytes().chunks(MARK_DIGITS).map(|m| String::from_utf8_lossy(m).into_owned()).collect())
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

/// What one read of the feed index between two positions found.
struct IndexRead {
    /// Whether the index ran out before the read held `limit` changes.
    ran_out: bool,
    /// The highest position read, skipped changes included.
    last_position: Option<String>,
    /// The position at which each mark of the token was found (and its change skipped).
    found: Vec<(String, String)>,
}

/// Reads the feed index from `low` to `high` (both inclusive), merged across shards, into
/// `changes` until it holds `limit` entries, skipping the changes whose marks are in `skip` (the
/// tail a reader was handed already). An index that has not yet dropped a document's previous
/// entry can show it twice; the later position is its latest.
async fn read_feed_into(
    backend: &DynamoDbBackend,
    (low, high): (String, String),
    skip: &[String],
    changes: &mut Vec<Change>,
    limit: usize,
) -> Result<IndexRead> {
    let wanted = limit.saturating_sub(changes.len()).max(1);
    let reader = FeedReader { backend, low, high };
    let mut merge =
        ShardedMerge::new(reader, SHARD_COUNT, ShardedMerge::<FeedReader>::chunk_for(wanted, SHARD_COUNT), false);
    let mut read = IndexRead { ran_out: false, last_position: None, found: Vec::new() };
    while changes.len() < limit {
        let Some(change) = merge.next().await? else {
            read.ran_out = true;
            break;
        };
        read.last_position = Some(change.seq.clone());
        if !skip.is_empty() {
            let mark = mark_of(&change);
            if skip.contains(&mark) {
                read.found.push((mark, change.seq));
                continue;
            }
        }
        changes.retain(|c| c.id != change.id);
        changes.push(change);
    }
    Ok(read)
}

/// [`read_feed_into`] of the settled range `low..=high` and the tail past it in one read of each
/// shard (`low` to the highest position): a reader with nothing new then pays one query per shard,
/// not two. Only for a token whose tail starts at `high` (nothing delivered past it), so the
/// tail is everything after `high`. Returns the settled part's read (it ran out once the read
/// passed `high`; `last_position` and the marks found are the settled part's), and whether the
/// index ran out (the tail's end).
async fn read_settled_and_tail(
    backend: &DynamoDbBackend,
    (low, high): (String, String),
    skip: &[String],
    changes: &mut Vec<Change>,
    limit: usize,
) -> Result<(IndexRead, bool)> {
    let wanted = limit.saturating_sub(changes.len()).max(1);
    let reader = FeedReader { backend, low, high: layout::position_after_millis(layout::MAX_POSITION_MILLIS) };
    let mut merge =
        ShardedMerge::new(reader, SHARD_COUNT, ShardedMerge::<FeedReader>::chunk_for(wanted, SHARD_COUNT), false);
    let mut settled = IndexRead { ran_out: false, last_position: None, found: Vec::new() };
    let mut ran_out = false;
    while changes.len() < limit {
        let Some(change) = merge.next().await? else {
            ran_out = true;
            settled.ran_out = true;
            break;
        };
        if change.seq > high {
            settled.ran_out = true;
        } else {
            settled.last_position = Some(change.seq.clone());
            if !skip.is_empty() {
                let mark = mark_of(&change);
                if skip.contains(&mark) {
                    settled.found.push((mark, change.seq));
                    continue;
                }
            }
        }
        changes.retain(|c| c.id != change.id);
        changes.push(change);
    }
    Ok((settled, ran_out))
}

/// The marks of `marks` still ahead of a reader at `position`: those not found at or below it.
fn marks_ahead_of(marks: &[String], found: &[(String, String)], position: &str) -> Vec<String> {
    marks.iter().filter(|mark| !found.iter().any(|(m, at)| m == *mark && at.as_str() <= position)).cloned().collect()
}

impl DynamoDbBackend {
    /// How two of this feed's tokens compare in feed order ([`position_order`]).
    pub(super) fn feed_position_order(&self, a: &str, b: &str) -> Option<std::cmp::Ordering> {
        position_order(a, b)
    }

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
        let marks = token.as_ref().map(|t| t.marks.clone()).unwrap_or_default();
        let low = token.as_ref().map_or_else(|| "0".to_owned(), |t| after(&t.settled));
        let mut changes: Vec<Change> = Vec::with_capacity(limit);
        // Settled positions lie at or below the boundary, the tail's past it.
        let boundary = match &token {
            Some(t) if t.settled > high => t.settled.clone(),
            _ => high.clone(),
        };
        // The unsettled tail: past the boundary and past what an earlier read delivered.
        let tail_from = match delivered.as_deref() {
            Some(d) if d > boundary.as_str() => d.to_owned(),
            _ => boundary.clone(),
        };
        // A token's settled position can lie past this clock's bound (another process's clock
        // runs ahead, or the follower asked again within a millisecond): then nothing settled is
        // new, and the token's position stays the boundary. When the tail starts right at the
        // bound, the settled range and the tail are read together.
        let (settled_read, tail_ran_out) = if low > high {
            (IndexRead { ran_out: true, last_position: None, found: Vec::new() }, None)
        } else if tail_from == high {
            let (settled, ran_out) =
                read_settled_and_tail(self, (low, high.clone()), &marks, &mut changes, limit).await?;
            (settled, Some(ran_out))
        } else {
            (read_feed_into(self, (low, high.clone()), &marks, &mut changes, limit).await?, None)
        };
        let settled_token = |position: &str| {
            FeedToken::new(position, delivered.as_deref(), &marks_ahead_of(&marks, &settled_read.found, position))
                .render()
        };
        if !settled_read.ran_out {
            for change in &mut changes {
                change.seq = settled_token(&change.seq);
            }
            let last_seq = changes.last().map_or_else(|| high.clone(), |c| c.seq.clone());
            return Ok(ChangesPage { changes, last_seq, pending: None, unsettled: 0 });
        }
        // Every settled change up to the last one seen has been returned (or was delivered in a
        // tail before, its mark found), and the settled range past it up to the bound was read
        // empty (no write can land there any more: that is what settled means), so a token naming
        // that change instead of the bound misses nothing and re-reads only an empty range. Unlike
        // the bound, it stays the same while nothing is written: two reads with no write between
        // answer the same `last_seq`, as CouchDB's do. With nothing settled seen, it is the
        // token's own position, or from the start of the feed the lowest position (every stamp
        // lies past it).
        let settled_seen = settled_read.last_position.clone().or_else(|| token.as_ref().map(|t| t.settled.clone()));
        let resume_from = settled_seen.unwrap_or_else(lowest_position);
        let tail_ran_out = match tail_ran_out {
            Some(ran_out) => ran_out,
            None => {
                let tail_end = layout::position_after_millis(layout::MAX_POSITION_MILLIS);
                read_feed_into(self, (after(&tail_from), tail_end), &[], &mut changes, limit).await?.ran_out
            }
        };
        // A document whose settled entry the tail superseded has left the settled part.
        let unsettled = changes.iter().filter(|c| c.seq > boundary).count();
        let settled_count = changes.len() - unsettled;
        // The marks the tail's tokens carry: those of the reader's token not yet found, then one
        // for each tail change delivered (past the bound the oldest may come again).
        let mut tail_marks = marks_ahead_of(&marks, &settled_read.found, &resume_from);
        let mut last_delivered = delivered.clone();
        for (n, change) in changes.iter_mut().enumerate() {
            if n < settled_count {
                change.seq = settled_token(&change.seq);
                continue;
            }
            remember(&mut tail_marks, mark_of(change));
            last_delivered = Some(std::mem::take(&mut change.seq));
            change.seq = FeedToken::new(&resume_from, last_delivered.as_deref(), &tail_marks).render();
        }
        let last_seq = FeedToken::new(&resume_from, last_delivered.as_deref(), &tail_marks).render();
        Ok(ChangesPage { changes, last_seq, pending: tail_ran_out.then_some(0), unsettled })
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
        FeedToken::new(&self.settled_position(), Some(&before_now), &[]).render()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_keep_only_a_delivered_position_past_the_settled_one_and_refuse_garbage() {
        let settled = layout::position_after_millis(1_000);
        let delivered = layout::new_position();
        let token = FeedToken::new(&settled, Some(&delivered), &[]);
        assert_eq!(token.render(), format!("{settled}~{delivered}"));
        assert_eq!(FeedToken::parse(&token.render()).unwrap(), token);
        let change = Change { seq: delivered.clone(), id: "a".into(), rev: Revision("1-x".into()), deleted: false };
        let other_mark = "0123456789abcdef01234567".to_owned();
        let marked = FeedToken::new(&settled, Some(&delivered), &[mark_of(&change), other_mark]);
        assert_eq!(FeedToken::parse(&marked.render()).unwrap(), marked);
        // A delivered position at or below the settled one says nothing more: the plain form.
        assert_eq!(FeedToken::new(&delivered, Some(&settled), &marked.marks).render(), delivered);
        let plain = FeedToken { settled: delivered.clone(), delivered: None, marks: Vec::new() };
        assert_eq!(FeedToken::parse(&delivered).unwrap(), plain);
        let too_many = "0123456789abcdef01234567".repeat(REMEMBERED_TAIL + 1);
        for bad in [
            "",
            "~",
            &format!("{settled}~"),
            &format!("~{settled}"),
            &format!("{settled}~x"),
            "abc",
            &format!("{settled}~{delivered}~"),
            &format!("{settled}~{delivered}~0123456789abcdef"),
            &format!("{settled}~{delivered}~0123456789ABCDEF01234567"),
            &format!("{settled}~{delivered}~{too_many}"),
            &format!("{settled}~{delivered}~0123456789abcdef01234567~"),
        ] {
            let err = FeedToken::parse(bad).unwrap_err();
            assert!(err.message().contains("since"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn a_mark_stays_ahead_of_a_reader_until_found_at_or_below_its_position() {
        let marks = vec!["a".repeat(MARK_DIGITS), "b".repeat(MARK_DIGITS)];
        let found = vec![(marks[0].clone(), "0000000000005".to_owned())];
        assert_eq!(marks_ahead_of(&marks, &found, "0000000000004"), marks);
        assert_eq!(marks_ahead_of(&marks, &found, "0000000000005"), &marks[1..]);
    }

    #[test]
    fn a_later_write_of_a_document_replaces_its_mark_and_the_oldest_mark_goes_first() {
        let change = |id: &str| Change {
            seq: layout::new_position(),
            id: id.into(),
            rev: Revision("1-x".into()),
            deleted: false,
        };
        let (first_a, b, second_a) = (mark_of(&change("a")), mark_of(&change("b")), mark_of(&change("a")));
        assert_eq!(first_a.len(), MARK_DIGITS);
        assert_ne!(first_a, second_a, "two writes of one document have different marks");
        let mut marks = Vec::new();
        for mark in [&first_a, &b, &second_a] {
            remember(&mut marks, mark.clone());
        }
        assert_eq!(marks, [b.clone(), second_a.clone()]);
        for n in 0..REMEMBERED_TAIL {
            remember(&mut marks, mark_of(&change(&format!("d{n}"))));
        }
        assert_eq!(marks.len(), REMEMBERED_TAIL);
        assert!(!marks.contains(&b) && !marks.contains(&second_a), "the oldest marks are forgotten first");
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
