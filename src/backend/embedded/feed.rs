//! The change feed: the `feed` table read from a position, and the current position.

use std::ops::Bound;

use redb::{Database, ReadOnlyTable, ReadTransaction, ReadableDatabase, ReadableTable, ReadableTableMetadata};

use super::core::{header_of, layout_of, next_feed_position, DOCS, FEED, META, TOMBSTONES};
use super::error::map_redb;
use crate::backend::{needs_upgrade, Change, ChangesPage, LayoutState};
use crate::error::{Error, ErrorKind, Result};

/// A feed token: the position of the last change returned.
pub(super) fn decode_feed_token(token: &str) -> Result<u64> {
    token.parse().map_err(|_| Error::invalid("since", format!("{token:?} is not a change-feed token of this store")))
}

pub(super) type MetaTable = ReadOnlyTable<&'static str, u64>;
pub(super) type FeedTable = ReadOnlyTable<u64, &'static str>;

/// The counters and the feed of a read transaction; an error naming `agentstore upgrade` for a
/// file of an earlier release, whose older records have no feed position.
pub(super) fn feed_tables(txn: &ReadTransaction, store: &str) -> Result<(MetaTable, FeedTable)> {
    let meta = txn.open_table(META).map_err(map_redb("open meta table"))?;
    if let LayoutState::NeedsUpgrade(why) = layout_of(&meta)? {
        return Err(needs_upgrade(store, "the change feed", &why));
    }
    let feed = txn.open_table(FEED).map_err(map_redb("open feed table"))?;
    Ok((meta, feed))
}

/// The changes after position `since`, at most `limit`, of the store `store` (for messages), with
/// `pending` counted exactly up to `pending_bound` entries after the page (past it, `None`: more
/// follow).
pub(super) fn changes(
    db: &Database,
    store: &str,
    since: u64,
    limit: usize,
    pending_bound: usize,
) -> Result<ChangesPage> {
    let txn = db.begin_read().map_err(map_redb("begin read"))?;
    let (meta, feed) = feed_tables(&txn, store)?;
    let docs = txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
    let tombstones = txn.open_table(TOMBSTONES).map_err(map_redb("open tombstones table"))?;
    let mut changes = Vec::with_capacity(limit.min(1024));
    let mut range = feed.range::<u64>((Bound::Excluded(since), Bound::Unbounded)).map_err(map_redb("read feed"))?;
    for entry in range.by_ref().take(limit) {
        let (seq, id) = entry.map_err(map_redb("read feed"))?;
        let (seq, id) = (seq.value(), id.value());
        let Some((header, deleted)) = header_of(&docs, &tombstones, id)? else {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!("embedded store: the feed names {id:?}, which is not stored"),
            ));
        };
        changes.push(Change { seq: seq.to_string(), id: id.to_owned(), rev: header.rev.to_revision(), deleted });
    }
    let last_returned = changes.last().map_or(Ok(since), |c| decode_feed_token(&c.seq))?;
    let entries_read = EntriesRead { since, page: changes.len(), last_returned };
    let waiting = waiting_after(&feed, range, &entries_read, pending_bound)?;
    let pending = (waiting < pending_bound).then_some(waiting as u64);
    let last_seq = if waiting > 0 {
        last_returned
    } else {
        // The end of the feed in this snapshot: its position, which an erasure of the newest
        // entries does not move back (the recorded floor), so a `last_seq` handed out before a
        // purge is never ahead of one handed out after it.
        last_returned.max(next_feed_position(&feed, &meta)? - 1)
    };
    let last_seq = last_seq.to_string();
    Ok(ChangesPage { changes, last_seq, pending, unsettled: 0 })
}

/// Where a page of the feed was read: after position `since`, `page` entries, the last at
/// `last_returned` (`since` for an empty page).
struct EntriesRead {
    since: u64,
    page: usize,
    last_returned: u64,
}

/// The changes still waiting after a page (`after_page`: the feed's entries following it), counted
/// exactly up to `bound` (CouchDB's `pending` is exact, and replicators sum it per batch to show
/// progress); at `bound` or more the answer is `bound` (the caller's "more follow"), so a page's
/// cost stays bounded on a long feed.
///
/// Counted from the shorter end (issue 38: counting to the end of the feed was a quarter of a
/// `_changes` page): the feed's length is kept by redb with the table (`len` reads no entry), so
/// the entries after the page are also the length less those up to `since` and the page's own.
/// Positions are distinct integers, so at most `since + 1` entries lie at or before `since`, and
/// at most `highest - last_returned` after the page: the entries before the page are counted
/// instead of those after it only when that span is the smaller one (and below `bound`), so the
/// count reads no more entries than the forward one did, and the answer is the same number.
fn waiting_after(
    feed: &FeedTable,
    after_page: redb::Range<'_, u64, &'static str>,
    read: &EntriesRead,
    bound: usize,
) -> Result<usize> {
    let highest = feed.last().map_err(map_redb("read feed"))?.map_or(0, |(seq, _)| seq.value());
    let span_after = highest.saturating_sub(read.last_returned);
    let span_before = read.since.saturating_add(1);
    if span_before < span_after.min(bound as u64) {
        let length = feed.len().map_err(map_redb("count feed"))?;
        let mut before = 0u64;
        for entry in feed.range::<u64>(..=read.since).map_err(map_redb("read feed"))? {
            entry.map_err(map_redb("read feed"))?;
            before += 1;
        }
        let waiting = length.saturating_sub(before).saturating_sub(read.page as u64);
        return Ok(usize::try_from(waiting).unwrap_or(usize::MAX).min(bound));
    }
    let mut waiting = 0usize;
    for entry in after_page.take(bound) {
        entry.map_err(map_redb("read feed"))?;
        waiting += 1;
    }
    Ok(waiting)
}

/// Feed entries after a page that are counted for its `pending` before the answer becomes "more
/// follow" (reading a key costs about a microsecond).
pub(super) const PENDING_COUNT_BOUND: usize = 10_000;

/// The position of the latest change.
pub(super) fn change_position(db: &Database, store: &str) -> Result<String> {
    let txn = db.begin_read().map_err(map_redb("begin read"))?;
    let (meta, feed) = feed_tables(&txn, store)?;
    Ok((next_feed_position(&feed, &meta)? - 1).to_string())
}
