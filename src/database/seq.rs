//! Feed positions as a database shows them: CouchDB 3's form `N-opaque`, where clients treat the
//! whole as opaque but read `N` as how far the feed is (PouchDB's checkpointer and its tests do,
//! and replicators sum `pending` to show progress). The backend's own position token is the part
//! after the first `-`, and only it positions a read.
//!
//! `N` is the position's **rank in the database's feed**: how many documents (live or deleted)
//! have their latest change at or before it (the feed holds one entry per document). So a
//! database at rest has `update_seq` `doc_count + doc_del_count`, a reader from `0` counts its
//! rows, and `pending` after a page is the feed's length less the rank of the page's last
//! position (docs/couchdb-api.md, "Sequences").
//!
//! - Where the backend's positions carry such a number already (the embedded store's counter,
//!   CouchDB's own `N`), `N` is the token's leading digits ([`show`]): the backend counts
//!   nothing more ([`crate::backend::DocumentBackend::feed_length`] is `None`).
//! - Elsewhere (DynamoDB, Firestore, whose tokens are times) `N` is counted ([`Ranks`]): the
//!   rank of the `since` an answer reads from (the `N` of a sequence this server issued, 0 from
//!   the start, the feed's length for `now` or a token without one) plus each row's place in the
//!   answer; at the end of the feed, the feed's length. The length is the backend's count,
//!   served again only after a check that nothing changed since (`raw::count_cache`), plus the
//!   entries purges took out ([`erased`], read each time).
//! - A rank is exact while the documents before the reader's position stay where they are. A
//!   document changed again after a reader passed it moves to the end of the feed, so the reader's
//!   `N` runs ahead by one until it reaches the end of the feed, where `N` is the count again (so
//!   does a DynamoDB tail change past the most a token remembers, which comes once more when it
//!   settles). `N` is for progress, never for positioning: where the next page starts is the
//!   token's alone (trial `couchdb_api::paged_changes_list_each_change_once`).

use crate::backend::DocumentBackend;

/// The backend's position `token` as a database shows it when the backend numbers its own
/// positions: `N` is its leading digits.
pub fn show(token: &str) -> String {
    let digits = leading_digits(token);
    let n = if digits.is_empty() { "0" } else { digits };
    format!("{n}-{token}")
}

/// The backend's position `token` at `rank` in the feed, as a database shows it.
pub fn show_ranked(rank: u64, token: &str) -> String {
    format!("{rank}-{token}")
}

/// The backend's position inside a sequence a client sends back: the part after `N-` when the
/// text has that form, else the text itself (`0`, `now`, and tokens of earlier releases).
pub fn read(text: &str) -> &str {
    split(text).map_or(text, |(_, token)| token)
}

/// The rank a sequence this server issued carries: its `N` when that is not the token's own
/// leading digits ([`show`]'s form, which an earlier release gave every backend, with a time for
/// `N`). A rank that happens to equal them reads as no rank, and is counted again.
pub fn rank_of(text: &str) -> Option<u64> {
    let (n, token) = split(text)?;
    if n == leading_digits(token) {
        return None;
    }
    n.parse().ok()
}

fn split(text: &str) -> Option<(&str, &str)> {
    match text.split_once('-') {
        Some((n, token)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => Some((n, token)),
        _ => None,
    }
}

fn leading_digits(token: &str) -> &str {
    let end = token.bytes().position(|b| !b.is_ascii_digit()).unwrap_or(token.len());
    &token[..end]
}

// The engine's local document counting the feed entries purges took out of the feed (a document
// purged whole leaves it), so that a rank, which counts the entries left, never goes back with a
// purge: it is added to the feed's length. Its name is the database's layout's
// (`crate::database::layout::LocalNames::erased`: `db:erased`, on the data-store database
// `:db:erased`, out of every client's reach), handed in as `erased_name` below.
/// Attempts at counting one more erased entry against other purges of the database.
const ERASED_TRIES: usize = 16;

/// Counts one more feed entry taken out by a purge. Called before the erasure, so a crash
/// between the two leaves `N` one ahead, never behind (and a purge retried against another
/// writer counts again: `N` only runs ahead). One small write per document purged whole. The
/// same write records the feed's position before the erasure ([`POSITION_FIELD`]): a feed read
/// to its end never answers a `last_seq` before it ([`purge_floor`]), though the erased entry may
/// have been the feed's last.
pub async fn count_erased(backend: &dyn DocumentBackend, erased_name: &str) -> crate::Result<()> {
    let position = backend.change_position().await?;
    for _ in 0..ERASED_TRIES {
        let stored = backend.get_local(erased_name).await?;
        let (count, precondition) = match &stored {
            Some(doc) => (
                doc.body.get("count").and_then(serde_json::Value::as_u64).unwrap_or(0),
                crate::backend::Precondition::MatchRevision(doc.rev.clone()),
            ),
            None => (0, crate::backend::Precondition::MustNotExist),
        };
        let mut body = serde_json::Map::new();
        body.insert("count".into(), serde_json::Value::from(count.saturating_add(1)));
        body.insert(POSITION_FIELD.into(), serde_json::Value::from(position.as_str()));
        match backend.put_local(erased_name, &body, precondition).await {
            Ok(_) => return Ok(()),
            Err(err) if err.is_conflict() => continue,
            Err(err) => return Err(err),
        }
    }
    Err(crate::Error::conflict("other purges kept counting the feed's erased entries; try again"))
}

/// The field of the erased count's local document holding the feed's position the latest purge
/// read before its erasure.
pub const POSITION_FIELD: &str = "position";

/// The feed's position the latest purge read before erasing a document ([`count_erased`]);
/// `None` before any. A read of the feed that reaches its end answers at least this position:
/// a purge of the feed's last entry would otherwise move the end of a fresh read back on
/// backends whose end is their last entry's position (DynamoDB, Firestore).
pub async fn purge_floor(backend: &dyn DocumentBackend, erased_name: &str) -> crate::Result<Option<String>> {
    Ok(backend.get_local(erased_name).await?.and_then(|doc| match doc.body.get(POSITION_FIELD) {
        Some(serde_json::Value::String(position)) => Some(position.clone()),
        _ => None,
    }))
}

/// The `last_seq` a feed read that reached the end answers: `last_seq` itself, or the position
/// of the latest purge ([`purge_floor`]) when the backend places `last_seq` before it (or it is
/// the start of the feed, `0`).
pub async fn at_least_purge_floor(
    backend: &dyn DocumentBackend,
    erased_name: &str,
    last_seq: String,
) -> crate::Result<String> {
    let Some(floor) = purge_floor(backend, erased_name).await? else { return Ok(last_seq) };
    let before = last_seq == "0" || backend.position_order(&last_seq, &floor) == Some(std::cmp::Ordering::Less);
    Ok(if before { floor } else { last_seq })
}

/// How many feed entries purges took out ([`count_erased`]), read from the backend.
pub async fn erased(backend: &dyn DocumentBackend, erased_name: &str) -> crate::Result<u64> {
    Ok(backend
        .get_local(erased_name)
        .await?
        .and_then(|doc| doc.body.get("count").and_then(serde_json::Value::as_u64))
        .unwrap_or(0))
}

/// The feed's length where the backend counts it, and the entries purges took out of it.
pub async fn counted(backend: &dyn DocumentBackend, erased_name: &str) -> crate::Result<Option<(u64, u64)>> {
    // The erased count is read each time, after the length: a purge counts its entry before it
    // takes it out of the feed, so a length without the entry is followed by a count with it (the
    // sum never goes back), and a purge through another process shows at once. Remembering it
    // while the length stays (as earlier releases did, for 1 s) would miss a purge and a create
    // elsewhere that leave the length as it was; the read is one small local document, where the
    // length's own check is a query per feed shard (`raw::count_cache`).
    match backend.feed_length().await? {
        Some(entries) => Ok(Some((entries, erased(backend, erased_name).await?))),
        None => Ok(None),
    }
}

/// The length ranks count against where the backend counts its feed: the entries it holds
/// plus those purges took out ([`erased`]); `None` where the backend does not count.
pub async fn counted_length(backend: &dyn DocumentBackend, erased_name: &str) -> crate::Result<Option<u64>> {
    Ok(counted(backend, erased_name).await?.map(|(entries, erased)| entries.saturating_add(erased)))
}

/// A database's current position as it shows it (`update_seq`): the backend's position now,
/// numbered by the feed's length where the backend counts it.
pub async fn current(backend: &dyn DocumentBackend, erased_name: &str) -> crate::Result<String> {
    current_and_length(backend, erased_name).await.map(|(shown, _)| shown)
}

/// [`current`], and the feed's length where the backend counts it.
pub async fn current_and_length(
    backend: &dyn DocumentBackend,
    erased_name: &str,
) -> crate::Result<(String, Option<u64>)> {
    let position = backend.change_position().await?;
    let shown = match counted(backend, erased_name).await? {
        Some((entries, erased)) => (show_ranked(entries.saturating_add(erased), &position), Some(entries)),
        None => (show(&position), None),
    };
    Ok(shown)
}

/// The most feed entries read past a position to learn its rank ([`shown_position`]).
pub const RANK_READ_LIMIT: usize = crate::feed::DEFAULT_PAGE;

/// An earlier position `token` of the feed as a database shows it (a view's `update_seq`): where
/// the backend counts its feed, ranked as the feed's length less the entries after it, read up to
/// [`RANK_READ_LIMIT`] of them (a view is seldom further behind); past that, or where the backend
/// does not count, numbered by [`show`].
pub async fn shown_position(backend: &dyn DocumentBackend, erased_name: &str, token: &str) -> crate::Result<String> {
    let Some(length) = counted_length(backend, erased_name).await? else { return Ok(show(token)) };
    let after = crate::feed::read_page(backend, Some(token), RANK_READ_LIMIT).await?;
    Ok(match after.pending {
        0 => show_ranked(length.saturating_sub(after.changes.len() as u64), token),
        _ => show(token),
    })
}

/// The ranks of one feed answer on a backend that counts its feed (see the module's docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ranks {
    /// The rank of the position the answer has read up to (its `last_seq` so far).
    pub at: u64,
}

impl Ranks {
    /// The ranks of an answer reading from `since` as the client gave it (`None`: the start),
    /// on a feed `length` entries long now.
    pub fn from_since(since: Option<&str>, length: u64) -> Ranks {
        let at = match since {
            None | Some("") | Some("0") => 0,
            Some(text) => rank_of(text).unwrap_or(length),
        };
        Ranks { at }
    }

    /// The shown sequences of the next `tokens` of the feed after the rank so far, in order.
    pub fn shown<'a>(&self, tokens: impl IntoIterator<Item = &'a str>) -> Vec<String> {
        tokens.into_iter().zip(self.at + 1..).map(|(token, rank)| show_ranked(rank, token)).collect()
    }

    /// Past `entries` more of the feed.
    pub fn advance(&mut self, entries: usize) {
        self.at = self.at.saturating_add(entries as u64);
    }

    /// The rank of the answer's last position and its `pending`, the feed being `length` entries
    /// long now: at its end (`waiting` 0) the length and 0; else the rank so far, and what is left
    /// of the length past it, at least what the read saw waiting.
    pub fn closing(&self, length: u64, waiting: u64) -> (u64, u64) {
        if waiting == 0 {
            (length, 0)
        } else {
            (self.at, length.saturating_sub(self.at).max(waiting))
        }
    }
}

/// The shown sequences of `tokens`: ranked after `ranks` when the feed is counted, else by the
/// tokens' own numbers.
pub fn shown_all<'a>(ranks: Option<&Ranks>, tokens: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    match ranks {
        Some(ranks) => ranks.shown(tokens),
        None => tokens.into_iter().map(show).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A backend that counts its feed (`entries`, set by the test) over the embedded store, and
    /// counts the reads of local documents.
    struct Counting {
        store: crate::backend::embedded::EmbeddedBackend,
        entries: std::sync::atomic::AtomicU64,
        local_reads: std::sync::atomic::AtomicU64,
    }

    #[async_trait::async_trait]
    impl crate::backend::raw::layer::Layered for Counting {
        fn inner(&self) -> &dyn DocumentBackend {
            &self.store
        }
        async fn feed_length(&self) -> crate::Result<Option<u64>> {
            Ok(Some(self.entries.load(std::sync::atomic::Ordering::SeqCst)))
        }
        async fn get_local(&self, name: &str) -> crate::Result<Option<crate::backend::StoredDocument>> {
            self.local_reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            self.store.get_local(name).await
        }
    }

    #[tokio::test]
    async fn the_erased_count_is_read_after_the_length_each_time() {
        use std::sync::atomic::Ordering::SeqCst;
        const NAME: &str = "db:erased";
        let dir = tempfile::tempdir().expect("temp dir");
        let store = crate::backend::embedded::EmbeddedBackend::open(&dir.path().join("s.redb")).await.expect("open");
        let backend = Counting { store, entries: 5.into(), local_reads: 0.into() };
        let reads = || backend.local_reads.load(SeqCst);
        assert_eq!(counted_length(&backend, NAME).await.expect("count"), Some(5));
        // A purge through another process: counted, then its entry taken out of the feed, then a
        // create there: the feed's length is as it was, the erased count is not.
        let other = Counting { store: backend.store.clone(), entries: 5.into(), local_reads: 0.into() };
        count_erased(&other, NAME).await.expect("count erased");
        let before = reads();
        assert_eq!(counted_length(&backend, NAME).await.expect("count"), Some(6), "N shows the purge at once");
        assert_eq!(reads(), before + 1, "one read of the erased count");
        backend.entries.store(4, SeqCst);
        assert_eq!(counted(&backend, NAME).await.expect("count"), Some((4, 1)));
        assert_eq!(erased(&backend, "other").await.expect("other name"), 0, "each name its own count");
    }

    #[test]
    fn shown_positions_read_back_to_the_token() {
        for token in ["1", "42", "1795686448525g~179568645352900000008fe5bcfe8", "abc", "7-x"] {
            assert_eq!(read(&show(token)), token, "{token}");
            assert_eq!(read(&show_ranked(3, token)), token, "{token}");
        }
        assert_eq!(show("12"), "12-12");
        assert!(show("abc").starts_with("0-"));
        assert_eq!(read("0"), "0");
        assert_eq!(read("now"), "now");
    }

    #[test]
    fn a_rank_is_read_back_but_an_earlier_release_s_time_is_not() {
        let dynamodb = "0000000000000g~179595087521000001";
        let firestore = "2026-11-29T12:00:00.5Z";
        assert_eq!(rank_of(&show_ranked(0, dynamodb)), Some(0));
        assert_eq!(rank_of(&show_ranked(7, firestore)), Some(7));
        // Earlier releases showed the token's leading digits (a time): no rank.
        assert_eq!(rank_of(&show(dynamodb)), None);
        assert_eq!(rank_of(&show(firestore)), None);
        assert_eq!(rank_of("1795686448525-1795686448525g~1"), None);
        for none in ["0", "now", "", "abc", "-x", "x-1"] {
            assert_eq!(rank_of(none), None, "{none}");
        }
    }

    #[test]
    fn ranks_count_from_since_and_close_on_the_length() {
        assert_eq!(Ranks::from_since(None, 10).at, 0);
        assert_eq!(Ranks::from_since(Some("0"), 10).at, 0);
        assert_eq!(Ranks::from_since(Some("now"), 10).at, 10);
        assert_eq!(Ranks::from_since(Some("4-2026-01-01T00:00:00Z"), 10).at, 4);
        assert_eq!(Ranks::from_since(Some("2026-2026-01-01T00:00:00Z"), 10).at, 10);
        let mut ranks = Ranks::from_since(None, 10);
        assert_eq!(ranks.shown(["a", "b"]), ["1-a", "2-b"]);
        ranks.advance(4);
        assert_eq!(ranks.closing(10, 2), (4, 6));
        assert_eq!(ranks.closing(10, 0), (10, 0));
        // The read saw more waiting than the count says (a count a moment old): at least that.
        ranks.advance(6);
        assert_eq!(ranks.closing(10, 1), (10, 1));
        assert_eq!(shown_all(None, ["12"]), ["12-12"]);
        assert_eq!(shown_all(Some(&Ranks { at: 2 }), ["x"]), ["3-x"]);
    }
}
