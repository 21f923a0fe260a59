//! The change feed: its positions and the sweeps that read it (see `docs/firestore-layout.md`, "Change feed").
//!
//! Every write sets `_changedAt` to the server's request time, which Firestore may assign a
//! little before the commit time (`updateTime`): up to the settle window `W`. A feed token says
//! that every write committed at or before its `floor` (a read time) has been reported. The next
//! sweep reads, at one snapshot `R`, the documents with `_changedAt > floor - W` in
//! (`_changedAt`, `__name__`) order, skips those whose `updateTime <= floor` (reported already),
//! and when it reaches the end the new floor is the latest `updateTime` it saw (or the old floor
//! when it saw nothing later): every write committed by then was reported, and unlike `R` it does
//! not move while nothing is written. A sweep longer than one page keeps its snapshot and a cursor
//! in the token, so every page of it reads the same committed state, and ends at the floor `R`.

use chrono::{DateTime, SecondsFormat, Utc};

use serde_json::{json, Value};

use super::backend::FirestoreBackend;
use super::core::{all_of, field_filter, select, text, MAX_PAGE};
use super::layout::FEED_FIELDS;
use super::layout::{self, StoredState};
use super::upgrade::LAYOUT_DOCUMENT;
use crate::backend::{Change, ChangesPage};
use crate::error::{Error, Result};

/// A position in the feed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FeedToken {
    /// Every write committed at or before this read time has been reported; `None`: nothing yet.
    pub floor: Option<String>,
    /// A sweep under way.
    pub sweep: Option<Sweep>,
}

/// A sweep of the feed that took more than one page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sweep {
    /// The read time every page of the sweep reads at.
    pub snapshot: String,
    /// The last position returned: `_changedAt` and the Firestore document id.
    pub changed_at: String,
    pub document_id: String,
}

const SEPARATOR: char = '~';

/// Documents beyond the page that a sweep from a floor asks for in its one query, for the settle
/// window's writes reported already ([`FirestoreBackend::sweep_in_one_query`]); a fuller window
/// is read first, whole, in a query of its own.
const WINDOW_ALLOWANCE: usize = 1_000;

/// The floor of a sweep from the start of the feed that found nothing: nothing was committed by
/// then, so it is true of every store, and it does not move while the store stays empty.
pub const START_FLOOR: &str = "1970-01-01T00:00:00Z";

impl FeedToken {
    pub fn after_sweep(read_time: &str) -> FeedToken {
        FeedToken { floor: Some(read_time.to_owned()), sweep: None }
    }

    /// The token after a sweep that began at this token, read at one snapshot, and looked at
    /// every document committed by then that it had to (`update_times`: their commit times): a
    /// floor at the latest of those commit times, or this token's floor when it is later (or
    /// none was seen), or [`START_FLOOR`] when there is neither.
    ///
    /// Any time between this floor and the sweep's snapshot is a valid floor: every write
    /// committed in between was visible at the snapshot, inside the sweep's filter, and reported
    /// (the proof in docs/firestore-layout.md). The latest commit time seen is the one that stays
    /// the same while nothing is written, so two reads with no write between answer the same
    /// `last_seq`, as CouchDB's do; the snapshot would move with every read. It is also the
    /// lowest such floor that re-reports nothing: every change reported committed by it.
    pub fn after_complete_sweep<'a>(&self, update_times: impl IntoIterator<Item = &'a str>) -> FeedToken {
        let mut latest = self.floor.as_deref().and_then(|floor| Some((timestamp(floor)?, floor)));
        for update_time in update_times {
            let Some(committed) = timestamp(update_time) else { continue };
            if latest.is_none_or(|(time, _)| committed > time) {
                latest = Some((committed, update_time));
            }
        }
        FeedToken::after_sweep(latest.map_or(START_FLOOR, |(_, text)| text))
    }

    pub fn parse(text: &str) -> Result<FeedToken> {
        let bad = || Error::invalid("since", format!("{text:?} is not a position of this Firestore change feed"));
        let mut parts = text.splitn(4, SEPARATOR);
        let floor = parts.next().filter(|f| !f.is_empty()).map(str::to_owned);
        if let Some(floor) = &floor {
            timestamp(floor).ok_or_else(bad)?;
        }
        let sweep = match (parts.next(), parts.next(), parts.next()) {
            (None, None, None) => None,
            (Some(snapshot), Some(changed_at), Some(document_id)) if !document_id.is_empty() => {
                timestamp(snapshot).ok_or_else(bad)?;
                timestamp(changed_at).ok_or_else(bad)?;
                Some(Sweep {
                    snapshot: snapshot.to_owned(),
                    changed_at: changed_at.to_owned(),
                    document_id: document_id.to_owned(),
                })
            }
            _ => return Err(bad()),
        };
        Ok(FeedToken { floor, sweep })
    }

    pub fn render(&self) -> String {
        let floor = self.floor.as_deref().unwrap_or("");
        match &self.sweep {
            None => floor.to_owned(),
            Some(s) => {
                format!("{floor}{SEPARATOR}{}{SEPARATOR}{}{SEPARATOR}{}", s.snapshot, s.changed_at, s.document_id)
            }
        }
    }

    /// The lowest `_changedAt` a sweep from this token must read: the floor less the settle window.
    pub fn lowest_changed_at(&self, settle: chrono::Duration) -> Option<String> {
        let floor = timestamp(self.floor.as_deref()?)?;
        Some((floor - settle).to_rfc3339_opts(SecondsFormat::Nanos, true))
    }

    /// Whether a document committed at `update_time` was already reported before this token.
    pub fn reported(&self, update_time: &str) -> bool {
        match (self.floor.as_deref().and_then(timestamp), timestamp(update_time)) {
            (Some(floor), Some(committed)) => committed <= floor,
            _ => false,
        }
    }
}

/// Gives each row of a sweep that began with this read and ended in it (`changes`, committed at
/// `committed`) a floor for its `seq` instead of a position in the sweep, which names the sweep's
/// snapshot and so changes with every read: the last row's is the sweep's `end` floor, and each
/// earlier row's is just below the earliest commit among the rows after it (not past `end`); a
/// row whose floor that way would not be past the token's keeps its position in the sweep. A reader that stops at a row misses nothing from it: every write
/// committed after the token's floor and by the snapshot is a row of the sweep, so one committed
/// by the row's floor is that row or one before it; what was committed later is read again
/// (a row after it, or a write made since). Like `last_seq`, a row's `seq` then stays the same
/// while nothing is written (CouchDB's descending `_changes` answers the first change's as its
/// `last_seq`).
fn floors_of_rows(token: &FeedToken, end: &FeedToken, changes: &mut [Change], committed: &[String]) {
    let lowest = token.floor.clone().unwrap_or_else(|| START_FLOOR.to_owned());
    let Some(lowest_time) = timestamp(&lowest) else { return };
    let Some(mut floor) = end.floor.clone() else { return };
    let Some(mut floor_time) = timestamp(&floor) else { return };
    for (change, committed) in changes.iter_mut().zip(committed).rev() {
        // Only a floor past the token's: a reader that resumes from a row must get past it. A row
        // whose floor would be the token's own (a row after it committed first, just past the
        // token's floor) keeps its position in the sweep, which resumes after the row; with its
        // floor, a filtered read (`_doc_ids`) that hides the rows after it answered the same rows
        // with the same `seq` again and again, and a replicator never ended.
        if floor_time > lowest_time {
            change.seq = FeedToken::after_sweep(&floor).render();
        }
        // The rows before this one must leave it unreported: a floor below its commit time (when
        // that cannot be read, the lowest floor). Any step below does; a microsecond keeps the
        // floor a time Firestore holds exactly (its timestamps have microseconds).
        let below = timestamp(committed).map_or(lowest_time, |time| time - chrono::Duration::microseconds(1));
        if below < floor_time {
            (floor, floor_time) = if below > lowest_time {
                (below.to_rfc3339_opts(SecondsFormat::AutoSi, true), below)
            } else {
                (lowest.clone(), lowest_time)
            };
        }
    }
}

/// The commit times (`updateTime`) of documents a query answered.
fn update_times(documents: &[Value]) -> impl Iterator<Item = &str> {
    documents.iter().map(|document| text(document, "/updateTime"))
}

pub fn timestamp(text: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(text).ok().map(|t| t.with_timezone(&Utc))
}

/// How two tokens compare in feed order: by their floors' times. `None` for a token in the middle
/// of a sweep (its floor says only where the sweep began) or one without a floor.
fn position_order(a: &str, b: &str) -> Option<std::cmp::Ordering> {
    let floor = |text: &str| {
        let token = FeedToken::parse(text).ok()?;
        match (token.sweep, token.floor) {
            (None, Some(floor)) => timestamp(&floor),
            _ => None,
        }
    };
    Some(floor(a)?.cmp(&floor(b)?))
}

impl FirestoreBackend {
    /// How two of this feed's tokens compare in feed order ([`position_order`]).
    pub(super) fn feed_position_order(&self, a: &str, b: &str) -> Option<std::cmp::Ordering> {
        position_order(a, b)
    }

    pub(super) async fn feed_page(&self, since: Option<&str>, limit: usize) -> Result<ChangesPage> {
        self.require_layout("the change feed").await?;
        let token = since.map(FeedToken::parse).transpose()?.unwrap_or_default();
        let limit = limit.clamp(1, MAX_PAGE);
        let settle = chrono::Duration::from_std(self.config.settle).unwrap_or(chrono::Duration::zero());
        // A sweep that begins at a floor first re-reads the window below it whole, so the writes
        // already reported there (skipped) do not fill the caller's page: with them counted, a
        // window holding more writes than a page never let a sweep end in one page, and so never
        // let a reader with small pages learn that it had reached the present until the window
        // had passed.
        if let (None, Some(floor)) = (&token.sweep, &token.floor) {
            if let Some(page) = self.feed_page_from_floor(&token, floor, settle, limit).await? {
                return Ok(page);
            }
        }
        let mut query = self.feed_query(limit);
        if let Some(lowest) = token.lowest_changed_at(settle) {
            query["where"] =
                field_filter(layout::CHANGED_AT, "GREATER_THAN_OR_EQUAL", json!({ "timestampValue": lowest }));
        }
        if let Some(sweep) = &token.sweep {
            query["startAt"] = json!({ "values": [
                { "timestampValue": sweep.changed_at },
                { "referenceValue": self.client.document_name(&sweep.document_id) }
            ], "before": false });
        }
        let snapshot = token.sweep.as_ref().map(|s| s.snapshot.clone());
        let answer = self.run_raw_query(&query, snapshot.as_deref(), "read the change feed").await?;
        let snapshot = snapshot
            .or(answer.read_time)
            .ok_or_else(|| super::error::bad_body("read the change feed", "runQuery answered no readTime"))?;
        let full = answer.documents.len() >= limit;
        let mut changes = Vec::with_capacity(answer.documents.len());
        let mut committed = Vec::with_capacity(answer.documents.len());
        let last = self.sweep_changes(&token, &snapshot, &answer.documents, limit, &mut changes, &mut committed);
        let last_seq = match last {
            Some(position) if full => position,
            // A sweep that began with this read and ended in it looked at every document of the
            // sweep here: the floor is the latest commit among them, and each row's is a floor too.
            _ if token.sweep.is_none() => {
                let end = token.after_complete_sweep(update_times(&answer.documents));
                floors_of_rows(&token, &end, &mut changes, &committed);
                end.render()
            }
            // The end of a sweep of several pages: everything committed by its snapshot is
            // reported. This read is not at the present (below), so the next one, a sweep from
            // this floor, says the end, with a floor that then stays put.
            _ => FeedToken::after_sweep(&snapshot).render(),
        };
        // A full query page leaves the sweep open, however many of its documents were reported
        // already and dropped: more may follow. A sweep resumed from a token ends at the snapshot
        // it began with, which may be long past (a replicator resumes from a row's `seq` and
        // stops at the first empty answer): only a sweep that began with this read reaches the
        // present. So the end of a resumed sweep is not the end of the feed; the next read, from
        // its floor, starts a sweep at the current time.
        let at_present = !full && token.sweep.is_none();
        // Nothing is held back: a sweep reads everything committed by its snapshot, so the
        // floor after it is safe to resume from (the settle window only reaches back below it).
        Ok(ChangesPage { changes, last_seq, pending: if at_present { Some(0) } else { None }, unsettled: 0 })
    }

    /// The feed query in (`_changedAt`, `__name__`) order, without filter or cursor.
    pub(super) fn feed_query(&self, limit: usize) -> Value {
        json!({
            "select": select(&FEED_FIELDS),
            "from": [{ "collectionId": self.client.collection() }],
            "orderBy": [
                { "field": { "fieldPath": layout::CHANGED_AT }, "direction": "ASCENDING" },
                { "field": { "fieldPath": "__name__" }, "direction": "ASCENDING" }
            ],
            "limit": limit,
        })
    }

    /// Appends the changes among `documents` (one sweep's, at `snapshot`) not reported before
    /// `token`, until `changes` holds `limit`, and their commit times to `committed`; the position
    /// of the last document looked at.
    pub(super) fn sweep_changes(
        &self,
        token: &FeedToken,
        snapshot: &str,
        documents: &[Value],
        limit: usize,
        changes: &mut Vec<Change>,
        committed: &mut Vec<String>,
    ) -> Option<String> {
        let mut last = None;
        for document in documents {
            if changes.len() >= limit {
                break;
            }
            let position = FeedToken {
                floor: token.floor.clone(),
                sweep: Some(Sweep {
                    snapshot: snapshot.to_owned(),
                    changed_at: text(document, &format!("/fields/{}/timestampValue", layout::CHANGED_AT)).to_owned(),
                    document_id: self.name_of_document(document).to_owned(),
                }),
            }
            .render();
            // Committed at or before the floor: the sweep that set the floor reported it.
            if !token.reported(text(document, "/updateTime")) {
                committed.push(text(document, "/updateTime").to_owned());
                let state = StoredState::of(document);
                changes.push(Change {
                    seq: position.clone(),
                    id: self.id_of(document),
                    rev: state.rev,
                    deleted: state.deleted,
                });
            }
            last = Some(position);
        }
        last
    }

    /// A sweep beginning at `floor`, at one snapshot: the window `[floor - W, floor]` read whole
    /// (up to [`MAX_PAGE`] documents), then what changed after the floor, up to the page; in one
    /// query when the window holds at most [`WINDOW_ALLOWANCE`] documents
    /// ([`Self::sweep_in_one_query`]), else in two. `None` when the window holds more than
    /// [`MAX_PAGE`]: the caller sweeps it page by page instead.
    pub(super) async fn feed_page_from_floor(
        &self,
        token: &FeedToken,
        floor: &str,
        settle: chrono::Duration,
        limit: usize,
    ) -> Result<Option<ChangesPage>> {
        let Some(lowest) = token.lowest_changed_at(settle) else { return Ok(None) };
        let busy = |floor: &str| self.busy_window_floor.lock().is_ok_and(|busy| busy.as_deref() == Some(floor));
        if !busy(floor) {
            if let Some(page) = self.sweep_in_one_query(token, &lowest, limit).await? {
                return Ok(Some(page));
            }
            // An idle reader's floor stays while nothing is written: its next sweeps go straight
            // to the two queries below.
            if let Ok(mut busy) = self.busy_window_floor.lock() {
                *busy = Some(floor.to_owned());
            }
        }
        let mut window = self.feed_query(MAX_PAGE);
        window["where"] = all_of(vec![
            field_filter(layout::CHANGED_AT, "GREATER_THAN_OR_EQUAL", json!({ "timestampValue": lowest })),
            field_filter(layout::CHANGED_AT, "LESS_THAN_OR_EQUAL", json!({ "timestampValue": floor })),
        ]);
        let doing = "read the change feed";
        let answer = self.run_raw_query(&window, None, doing).await?;
        if answer.documents.len() >= MAX_PAGE {
            return Ok(None);
        }
        let snapshot =
            answer.read_time.ok_or_else(|| super::error::bad_body(doing, "runQuery answered no readTime"))?;
        let (mut changes, mut committed) = (Vec::new(), Vec::new());
        let mut last = self.sweep_changes(token, &snapshot, &answer.documents, limit, &mut changes, &mut committed);
        // A page filled inside the window (writes that committed late, rare): the sweep goes on
        // from the last of them.
        let mut full = changes.len() >= limit;
        let mut looked_at: Vec<Value> = Vec::new();
        if changes.len() < limit {
            let mut after = self.feed_query(limit - changes.len());
            after["where"] = field_filter(layout::CHANGED_AT, "GREATER_THAN", json!({ "timestampValue": floor }));
            let later = self.run_raw_query(&after, Some(&snapshot), doing).await?;
            full = later.documents.len() >= limit - changes.len();
            if let Some(position) =
                self.sweep_changes(token, &snapshot, &later.documents, limit, &mut changes, &mut committed)
            {
                last = Some(position);
            }
            looked_at = later.documents;
        }
        let (last_seq, pending) = match last {
            Some(position) if full => (position, None),
            // Not full: every document of the window and after it was looked at.
            _ => {
                let end = token.after_complete_sweep(update_times(&answer.documents).chain(update_times(&looked_at)));
                floors_of_rows(token, &end, &mut changes, &committed);
                (end.render(), Some(0))
            }
        };
        Ok(Some(ChangesPage { changes, last_seq, pending, unsettled: 0 }))
    }

    /// [`Self::feed_page_from_floor`] in one query: everything from the window's start
    /// (`lowest`, the floor less the settle window) in feed order, up to the page plus
    /// [`WINDOW_ALLOWANCE`] documents, at one snapshot; the window's documents come first and are
    /// left out where reported, then the changes after the floor fill the page. A reader with
    /// nothing new (an index catch-up before each query) pays one query, not two. `None` when the
    /// answer was cut before the page filled (the window held more than the allowance): the
    /// caller reads the window whole first, so a busy window still ends in one page (issue 22).
    async fn sweep_in_one_query(&self, token: &FeedToken, lowest: &str, limit: usize) -> Result<Option<ChangesPage>> {
        let asked = limit.saturating_add(WINDOW_ALLOWANCE).min(MAX_PAGE);
        let mut query = self.feed_query(asked);
        query["where"] = field_filter(layout::CHANGED_AT, "GREATER_THAN_OR_EQUAL", json!({ "timestampValue": lowest }));
        let doing = "read the change feed";
        let answer = self.run_raw_query(&query, None, doing).await?;
        let snapshot =
            answer.read_time.ok_or_else(|| super::error::bad_body(doing, "runQuery answered no readTime"))?;
        let (mut changes, mut committed) = (Vec::new(), Vec::new());
        let last = self.sweep_changes(token, &snapshot, &answer.documents, limit, &mut changes, &mut committed);
        let full = changes.len() >= limit;
        if answer.documents.len() >= asked && !full {
            return Ok(None);
        }
        let (last_seq, pending) = match last {
            Some(position) if full => (position, None),
            // Not full, and the answer not cut: every document of the window and after it was
            // looked at.
            _ => {
                let end = token.after_complete_sweep(update_times(&answer.documents));
                floors_of_rows(token, &end, &mut changes, &committed);
                (end.render(), Some(0))
            }
        };
        Ok(Some(ChangesPage { changes, last_seq, pending, unsettled: 0 }))
    }

    pub(super) async fn feed_position(&self) -> Result<String> {
        self.require_layout("the change feed").await?;
        let name = self.client.name_in(&self.client.meta_collection(), LAYOUT_DOCUMENT);
        let reply = self.batch_get_fields(&[name], Some(&["version"]), "read the time").await?;
        let read_time = reply
            .as_array()
            .into_iter()
            .flatten()
            .find_map(|entry| entry.get("readTime").and_then(Value::as_str))
            .ok_or_else(|| super::error::bad_body("read the time", "batchGet answered no readTime"))?;
        Ok(FeedToken::after_sweep(read_time).render())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Revision;

    #[test]
    pub(super) fn tokens_round_trip_and_refuse_garbage() {
        let tokens = [
            FeedToken::default(),
            FeedToken::after_sweep("2026-01-01T00:00:01.5Z"),
            FeedToken {
                floor: None,
                sweep: Some(Sweep {
                    snapshot: "2026-01-01T00:00:02Z".into(),
                    changed_at: "2026-01-01T00:00:01.001Z".into(),
                    document_id: "u:a~b:k".into(),
                }),
            },
        ];
        for token in tokens {
            assert_eq!(FeedToken::parse(&token.render()).unwrap(), token);
        }
        for bad in ["yesterday", "2026-01-01T00:00:00Z~x", "~2026-01-01T00:00:00Z~2026-01-01T00:00:00Z~"] {
            assert!(FeedToken::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    pub(super) fn the_window_reaches_back_and_reported_writes_are_skipped() {
        let token = FeedToken::after_sweep("2026-01-01T00:00:10Z");
        assert_eq!(token.lowest_changed_at(chrono::Duration::seconds(5)).unwrap(), "2026-01-01T00:00:05.000000000Z");
        assert!(token.reported("2026-01-01T00:00:09.999999Z"));
        assert!(token.reported("2026-01-01T00:00:10Z"));
        assert!(!token.reported("2026-01-01T00:00:10.000001Z"));
        assert!(!FeedToken::default().reported("2026-01-01T00:00:10Z"));
    }

    #[test]
    pub(super) fn each_row_of_a_complete_sweep_gets_a_floor_below_the_commits_after_it() {
        let token = FeedToken::after_sweep("2026-01-01T00:00:10Z");
        let committed =
            ["2026-01-01T00:00:12Z", "2026-01-01T00:00:11Z", "2026-01-01T00:00:13Z", "2026-01-01T00:00:10.5Z"];
        let end = token.after_complete_sweep(committed);
        let mut changes: Vec<Change> = (0..4)
            .map(|n| Change {
                seq: format!("position {n}"),
                id: format!("d{n}"),
                rev: Revision(format!("1-{n}")),
                deleted: false,
            })
            .collect();
        let committed = committed.map(str::to_owned);
        floors_of_rows(&token, &end, &mut changes, &committed);
        let seqs: Vec<&str> = changes.iter().map(|c| c.seq.as_str()).collect();
        // Row 0 is committed at 12 s, but row 1 at 11 s and row 3 at 10.5 s come after it: a
        // reader stopping at row 0 has not seen them, so its floor stays below 10.5 s.
        assert_eq!(
            seqs,
            [
                "2026-01-01T00:00:10.499999Z",
                "2026-01-01T00:00:10.499999Z",
                "2026-01-01T00:00:10.499999Z",
                "2026-01-01T00:00:13Z",
            ]
        );
        // Each row's floor covers its own commit only when no earlier commit follows it.
        let in_order = ["2026-01-01T00:00:11Z", "2026-01-01T00:00:12Z"].map(str::to_owned);
        let mut two = changes[..2].to_vec();
        floors_of_rows(&token, &token.after_complete_sweep(in_order.iter().map(String::as_str)), &mut two, &in_order);
        assert_eq!((two[0].seq.as_str(), two[1].seq.as_str()), ("2026-01-01T00:00:11.999999Z", "2026-01-01T00:00:12Z"));
        // Never below the token's floor, and from the start never below the start floor.
        let unreadable = ["2026-01-01T00:00:11Z".to_owned(), "yesterday".to_owned()];
        // A row whose floor would not be past the token's keeps its position in the sweep, so a
        // reader resuming from it gets past it.
        two[0].seq = "position 0".to_owned();
        floors_of_rows(&token, &FeedToken::after_sweep("2026-01-01T00:00:11Z"), &mut two, &unreadable);
        assert_eq!((two[0].seq.as_str(), two[1].seq.as_str()), ("position 0", "2026-01-01T00:00:11Z"));
        let just_past = ["2026-01-01T00:00:11Z", "2026-01-01T00:00:10.000001Z"].map(str::to_owned);
        two[0].seq = "position 0".to_owned();
        floors_of_rows(&token, &FeedToken::after_sweep("2026-01-01T00:00:11Z"), &mut two, &just_past);
        assert_eq!(two[0].seq, "position 0");
        floors_of_rows(&FeedToken::default(), &FeedToken::after_sweep("2026-01-01T00:00:11Z"), &mut two, &unreadable);
        assert_eq!(two[0].seq, "position 0");
    }

    #[test]
    pub(super) fn a_complete_sweep_ends_at_the_latest_commit_it_saw_or_keeps_its_floor() {
        let token = FeedToken::after_sweep("2026-01-01T00:00:10Z");
        // Compared as times, not as text: `.5Z` is later than `.25Z` and than a whole second.
        let seen = ["2026-01-01T00:00:09Z", "2026-01-01T00:00:11.5Z", "2026-01-01T00:00:11.25Z", "not a time"];
        assert_eq!(token.after_complete_sweep(seen), FeedToken::after_sweep("2026-01-01T00:00:11.5Z"));
        // Nothing committed after the floor: the floor stays.
        assert_eq!(token.after_complete_sweep(["2026-01-01T00:00:09.999Z"]), token);
        assert_eq!(token.after_complete_sweep([]), token);
        // From the start: the latest commit seen, or the start floor for an empty feed.
        assert_eq!(
            FeedToken::default().after_complete_sweep(["2026-01-01T00:00:01Z"]),
            FeedToken::after_sweep("2026-01-01T00:00:01Z")
        );
        let start = FeedToken::default().after_complete_sweep([]);
        assert_eq!(start, FeedToken::after_sweep(START_FLOOR));
        assert_eq!(FeedToken::parse(&start.render()).unwrap(), start);
        assert!(!start.reported("1970-01-01T00:00:00.000001Z"));
    }
}
