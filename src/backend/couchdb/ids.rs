//! Documents in id order, and erasure by id prefix or of one id.
//!
//! Documents in id order on CouchDB: its own `_all_docs`.
//!
//! `GET /db/_all_docs?include_docs=true` with `startkey`, `endkey` (JSON-encoded), `inclusive_end`,
//! `descending` and `limit` taken from the [`IdRange`]. `_all_docs` never lists tombstones or
//! `_local/` documents; design documents it does list, and they sit inside the id order (`_` sorts
//! between uppercase and lowercase letters), so they are dropped from a page and the page is
//! filled on from after them: a page is short only at the end of the range.
//!
//! pouchdb-server (the local test server) leaves ids beginning with U+00FF or above out of a range
//! open at the top; it is sent an explicit high end ([`POUCHDB_HIGH_END`]). Apache CouchDB is not.
//!
//! The page token is the id of the page's last document. The next page starts at it
//! (`startkey=<token>`, one row more, the row with that id dropped) rather than with `skip=1`: if
//! that document was deleted meanwhile, `skip=1` would skip a different one. One row beyond the
//! page is read to learn whether another page follows, so the last page carries no token.
//!
//! Erasure on CouchDB: `_purge`, which removes documents, tombstones, their revision trees and
//! their change-feed entries. A plain delete would leave a tombstone whose id carries the user id
//! forever, and replicate it.
//!
//! Finding what to purge: tombstones are not in `_all_docs`, so the ids under the prefix come
//! from `POST /db/_changes?filter=_selector&style=all_docs` with the selector
//! `{"_id": {"$regex": "^<escaped prefix>"}}`. CouchDB opens every leaf of every document, deleted
//! ones included, for a `_selector` filter, and `style=all_docs` lists every leaf revision, which
//! is what `_purge` needs to remove a document entirely (conflicting branches included). A regex
//! is used rather than a `$gte`/`$lt` range because Mango compares strings with ICU collation, in
//! which a prefix's documents are not one range. Cost: CouchDB reads its whole change feed
//! (every document of the database once) to answer, and only the matches cross the network; so an
//! erasure costs a scan of the database on the server, which is acceptable for an operation as
//! rare as erasing a user.
//!
//! Purging: `POST /db/_purge {id: [leaf revs]}`, at most [`PURGE_IDS`] ids a request (CouchDB's
//! default `max_document_id_number` is 100) and [`PURGE_REVS`] revisions (`max_revisions_number`,
//! 1000). A document written while the erasure runs gets a later place in the feed, so the scan
//! meets it again further on; after a full pass the next pass reads only the feed after the
//! previous one's end, until a pass finds nothing (at most [`PASSES`]).
//!
//! Before anything is read, `POST /db/_purge {}` checks that the server purges at all (Apache
//! CouchDB 2.3 and later answer 201 with an empty `purged`). pouchdb-server 4.2.0 has no `_purge`
//! (it answers 400 `only_multipart_accepted`), and a `_selector` filter crashes it: there, the
//! unfiltered feed is read, and erasure answers 0 when nothing lies under the prefix, and
//! otherwise fails before touching anything, with an error that says so.
//!
//! Purging is local to the database: replicas (other CouchDB nodes replicating this database,
//! PouchDB clients, backups) keep their copies until they are purged themselves.

use std::borrow::Cow;

use reqwest::{Method, StatusCode};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Map, Value};

use super::backend::{from_couch_doc, is_design_doc, json_key, take_array, CouchDbBackend};
use super::error::from_status;
use crate::backend::{DocumentText, EraseOptions, IdRange, Page, Revision, StoredDocument, LOCAL_PREFIX};
use crate::error::{Error, ErrorKind, Result};

impl CouchDbBackend {
    pub(super) async fn all_docs_page(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> Result<Page<StoredDocument>> {
        self.id_range_page(range, limit, page_token, |_, doc| {
            let doc = crate::model::depth::parse_stored(doc.get().as_bytes()).map_err(|e| unreadable_page(&e))?;
            from_couch_doc(doc, LISTING)
        })
        .await
    }

    /// [`CouchDbBackend::all_docs_page`] with each document as the text CouchDB sent, never
    /// parsed into values: what an answer that passes documents on unchanged needs.
    pub(super) async fn all_docs_text_page(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> Result<Page<DocumentText>> {
        self.id_range_page(range, limit, page_token, |row, doc| {
            let rev = row.value.as_ref().map(|value| value.rev.to_string()).ok_or_else(|| {
                Error::new(ErrorKind::Internal, format!("CouchDB listed document {:?} without its revision", row.id))
            })?;
            Ok(DocumentText { id: row.id.to_string(), rev: Revision(rev), json: doc.to_owned() })
        })
        .await
    }

    /// One page of the documents in `range`, each made by `item` from its row and its JSON text.
    async fn id_range_page<T>(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
        item: impl Fn(&RangeRow<'_>, &RawValue) -> Result<T>,
    ) -> Result<Page<T>>
    where
        T: Listed,
    {
        let limit = limit.max(1);
        if is_empty(range) {
            return Ok(Page { items: Vec::new(), next: None });
        }
        let mut items: Vec<T> = Vec::with_capacity(limit.min(1024) + 1);
        let mut after = page_token.map(str::to_owned);
        // Rows for the design documents the range may hold, when their number is known: read
        // along with the page, they cost no second request.
        let mut design_rows = match self.counts.design() {
            Some(count) if may_hold_design_documents(range) => usize::try_from(count).unwrap_or(0).min(MAX_DESIGN_ROWS),
            _ => 0,
        };
        loop {
            // One row for the document the read starts at (already returned), one to learn
            // whether more follow.
            let wanted = limit + 1 - items.len() + usize::from(after.is_some()) + std::mem::take(&mut design_rows);
            let ticket = self.counts.ticket();
            let text = self.read_id_range(range, after.as_deref(), wanted).await?;
            let reply: RangeReply<'_> = serde_json::from_slice(&text).map_err(|e| unreadable_page(&e))?;
            // Every answer carries the database's document count: the next `total_rows` needs
            // no request of its own (see [`super::counts`]).
            if let Some(total) = reply.total_rows {
                self.counts.remember_total(ticket, total);
            }
            let full = reply.rows.len() == wanted;
            let mut last_row_id = None;
            for row in reply.rows {
                let already_returned = after.as_deref() == Some(&*row.id);
                let data = (range.include_design || !is_design_doc(&row.id))
                    && !row.id.starts_with(LOCAL_PREFIX)
                    && range.contains(&row.id);
                if !already_returned && data {
                    if let Some(doc) = row.doc {
                        items.push(item(&row, doc)?);
                    }
                }
                last_row_id = Some(row.id.into_owned());
            }
            if items.len() > limit {
                items.truncate(limit);
                let next = items.last().map(|doc| doc.listed_id().to_owned());
                return Ok(Page { items, next });
            }
            match last_row_id {
                // Rows went to design documents: read on from the last one seen.
                Some(id) if full => after = Some(id),
                _ => return Ok(Page { items, next: None }),
            }
        }
    }

    /// One `_all_docs` read of `limit` rows of `range`, from `after` (inclusive) when given: the
    /// answer's text, read by the caller into [`RangeReply`] (take a count ticket before it).
    async fn read_id_range(&self, range: &IdRange, after: Option<&str>, limit: usize) -> Result<bytes::Bytes> {
        let mut query = vec![("include_docs", "true".to_owned()), ("limit", limit.to_string())];
        if range.descending {
            query.push(("descending", "true".to_owned()));
        }
        let start = after.or(range.start.as_deref());
        if let Some(start) = start {
            query.push(("startkey", json_key(start)));
        }
        if let Some(end) = &range.end {
            query.push(("endkey", json_key(end)));
            query.push(("inclusive_end", range.inclusive_end.to_string()));
        }
        let high_end_open = if range.descending { start.is_none() } else { range.end.is_none() };
        if high_end_open && self.pouchdb_server().await? {
            query.push((if range.descending { "startkey" } else { "endkey" }, json_key(POUCHDB_HIGH_END)));
        }
        self.client.read_text(&self.client.url(&["_all_docs"]), &query, LISTING).await
    }
}

/// What [`CouchDbBackend::all_docs_page`] and [`CouchDbBackend::all_docs_text_page`] say they
/// were doing, in errors.
const LISTING: &str = "list documents in id order";

/// An `_all_docs` answer with `include_docs=true`, read in one pass without building values: the
/// document count, and each row's id and its document's text (`key` and `value` are skipped).
#[derive(Deserialize)]
struct RangeReply<'a> {
    total_rows: Option<u64>,
    #[serde(borrow)]
    rows: Vec<RangeRow<'a>>,
}

#[derive(Deserialize)]
struct RangeRow<'a> {
    #[serde(borrow)]
    id: Cow<'a, str>,
    #[serde(borrow, default)]
    value: Option<RowValue<'a>>,
    #[serde(borrow, default)]
    doc: Option<&'a RawValue>,
}

/// A row's `value`: the listed revision.
#[derive(Deserialize)]
struct RowValue<'a> {
    #[serde(borrow)]
    rev: Cow<'a, str>,
}

/// A listed item's id: the page token of a page that ends with it.
trait Listed {
    fn listed_id(&self) -> &str;
}

impl Listed for StoredDocument {
    fn listed_id(&self) -> &str {
        &self.id
    }
}

impl Listed for DocumentText {
    fn listed_id(&self) -> &str {
        &self.id
    }
}

fn unreadable_page(err: &serde_json::Error) -> Error {
    Error::new(ErrorKind::Internal, format!("CouchDB answered _all_docs with JSON that could not be read: {err}"))
}

/// The explicit high end sent to pouchdb-server for a range open at the top: without one,
/// pouchdb-server 4.2.0 leaves out every id whose first character is U+00FF or above (its store
/// keys documents under a prefix ending in `ÿ` and bounds an open range there). It compares ids
/// as UTF-16, in which nothing sorts above U+FFFF U+FFFF.
const POUCHDB_HIGH_END: &str = "\u{FFFF}\u{FFFF}";

/// Rows read beyond a page at most for design documents; a database with more pages on past them.
const MAX_DESIGN_ROWS: usize = 100;

/// Whether design document ids (`_design/…`, which sort below `_design0`) may lie in the range.
fn may_hold_design_documents(range: &IdRange) -> bool {
    let (low, high) = if range.descending { (&range.end, &range.start) } else { (&range.start, &range.end) };
    low.as_deref().is_none_or(|low| low < "_design0") && high.as_deref().is_none_or(|high| high >= "_design/")
}

/// Whether the range's ends are in the wrong order for its direction, so nothing lies inside.
/// CouchDB answers such a request with 400 (`reverse your start_key and end_key`) rather than an
/// empty list.
fn is_empty(range: &IdRange) -> bool {
    match (&range.start, &range.end) {
        (Some(start), Some(end)) if range.descending => start.as_bytes() < end.as_bytes(),
        (Some(start), Some(end)) => start.as_bytes() > end.as_bytes(),
        _ => false,
    }
}

/// Ids in one `_purge` request (CouchDB's default `max_document_id_number`).
const PURGE_IDS: usize = 100;
/// Revisions in one `_purge` request (CouchDB's default `max_revisions_number`).
const PURGE_REVS: usize = 1000;
/// Matching documents read from the feed per request.
const FEED_PAGE: usize = 500;
/// Passes over the feed before giving up on a prefix that keeps being written to.
const PASSES: usize = 10;

/// Documents waiting to be purged, with every leaf revision of each.
#[derive(Default)]
struct PurgeBatch {
    docs: Map<String, Value>,
    revs: usize,
}

impl CouchDbBackend {
    pub(super) async fn purge_prefix(&self, prefix: &str) -> Result<u64> {
        if prefix.is_empty() {
            return Err(Error::invalid("prefix", "an empty prefix would erase every document of the database"));
        }
        if let Some(unsupported) = self.purge_unsupported().await? {
            // Nothing to erase is a success anywhere; anything to erase is refused untouched.
            return match self.first_id_under(prefix).await? {
                None => Ok(0),
                Some(id) => Err(Error::new(
                    ErrorKind::Misconfigured,
                    format!(
                        "{unsupported}; {id:?} and any other document under {prefix:?} are kept. Nothing was erased"
                    ),
                )),
            };
        }
        let mut erased = 0;
        let mut since = "0".to_owned();
        for _ in 0..PASSES {
            let (found, end) = self.purge_pass(prefix, &since, &mut erased).await?;
            if found == 0 {
                return Ok(erased);
            }
            since = end;
        }
        Err(Error::conflict(format!(
            "documents under {prefix:?} kept being written during {PASSES} erasure passes; {erased} were erased, \
             run the erasure again once the writes stop"
        )))
    }

    /// `erase_id(id)`: every leaf of `id` purged, read again and purged again while a writer
    /// adds leaves meanwhile (a bounded number of times); no other id is named to `_purge`.
    /// A conditional erasure is [`Self::purge_named_leaves`] instead.
    pub(super) async fn purge_one_id(&self, id: &str, options: &EraseOptions) -> Result<bool> {
        if options.is_conditional() {
            return self.purge_named_leaves(id, options).await;
        }
        let mut erased = false;
        for _ in 0..PASSES {
            let Some(tree) = self.leaves_tree(id).await? else { return Ok(erased) };
            if let Some(unsupported) = self.purge_unsupported().await? {
                return Err(Error::new(ErrorKind::Misconfigured, format!("{unsupported}; {id:?} is kept")));
            }
            let revs: Vec<Value> = tree.leaves().iter().map(|leaf| Value::String(leaf.rev())).collect();
            let mut batch = PurgeBatch { revs: revs.len(), ..PurgeBatch::default() };
            batch.docs.insert(id.to_owned(), Value::Array(revs));
            erased |= self.purge(batch).await? > 0;
        }
        Err(Error::conflict(format!("{id:?} kept being written during {PASSES} erasure passes; run the erasure again")))
    }

    /// `erase_id(id)` under [`EraseOptions`]: one `_purge` naming the leaves the caller read
    /// (`only_leaves`; else those read here, once the winner is found at `if_revision`).
    /// CouchDB removes a named revision only while it is a leaf, in its own update of the
    /// document, so a leaf written since (an edit extending a named leaf, a new branch) is kept:
    /// the purge is conditional by construction, as `_purge` is in CouchDB. `Conflict` when the
    /// winner is not `if_revision`, or when none of the named leaves was purged.
    async fn purge_named_leaves(&self, id: &str, options: &EraseOptions) -> Result<bool> {
        let read = match (&options.if_revision, &options.only_leaves) {
            (None, Some(_)) => None,
            _ => Some(
                self.leaves_tree(id)
                    .await?
                    .ok_or_else(|| Error::conflict(format!("document {id:?} does not exist: not erased")))?,
            ),
        };
        if let (Some(expected), Some(tree)) = (&options.if_revision, &read) {
            let winner = tree.winner().map(|leaf| leaf.rev()).unwrap_or_default();
            if winner != expected.as_str() {
                return Err(Error::conflict(format!(
                    "document {id:?} is at revision {winner}, not {expected}: not erased"
                )));
            }
        }
        let named: Vec<Value> = match (&options.only_leaves, &read) {
            (Some(leaves), _) => leaves.iter().map(|rev| Value::String(rev.0.clone())).collect(),
            (None, Some(tree)) => tree.leaves().iter().map(|leaf| Value::String(leaf.rev())).collect(),
            (None, None) => Vec::new(),
        };
        if let Some(unsupported) = self.purge_unsupported().await? {
            return Err(Error::new(ErrorKind::Misconfigured, format!("{unsupported}; {id:?} is kept")));
        }
        let mut batch = PurgeBatch { revs: named.len(), ..PurgeBatch::default() };
        batch.docs.insert(id.to_owned(), Value::Array(named));
        if self.purge(batch).await? == 0 {
            return Err(Error::conflict(format!("no leaf of {id:?} named to the purge is a leaf still: not erased")));
        }
        Ok(true)
    }

    /// One pass over the feed after `since`: purges every document under `prefix` it meets.
    /// Returns how many it found and the feed position it ended at.
    async fn purge_pass(&self, prefix: &str, since: &str, erased: &mut u64) -> Result<(usize, String)> {
        let selector = json!({ "selector": { "_id": { "$regex": format!("^{}", regex_escape(prefix)) } } });
        let mut since = since.to_owned();
        let mut found = 0;
        let mut batch = PurgeBatch::default();
        loop {
            let (rows, last_seq) = self.matching_changes(&selector, &since).await?;
            let full = rows.len() == FEED_PAGE;
            for row in rows {
                let Some(id) = row.get("id").and_then(Value::as_str) else { continue };
                // The regex already selected them; design documents are never data to erase.
                if !id.starts_with(prefix) || is_design_doc(id) {
                    continue;
                }
                let revs: Vec<Value> = row
                    .get("changes")
                    .and_then(Value::as_array)
                    .map(|changes| changes.iter().filter_map(|c| c.get("rev").cloned()).collect())
                    .unwrap_or_default();
                if revs.is_empty() {
                    continue;
                }
                found += 1;
                if batch.docs.len() == PURGE_IDS || batch.revs + revs.len() > PURGE_REVS {
                    *erased += self.purge(std::mem::take(&mut batch)).await?;
                }
                batch.revs += revs.len();
                batch.docs.insert(id.to_owned(), Value::Array(revs));
            }
            since = last_seq;
            if !full {
                break;
            }
        }
        if !batch.docs.is_empty() {
            *erased += self.purge(batch).await?;
        }
        Ok((found, since))
    }

    /// One page of the feed filtered by `selector`, every leaf revision of each row.
    async fn matching_changes(&self, selector: &Value, since: &str) -> Result<(Vec<Value>, String)> {
        let doing = "find the documents to erase";
        let query = [
            ("filter", "_selector".to_owned()),
            ("style", "all_docs".to_owned()),
            ("since", since.to_owned()),
            ("limit", FEED_PAGE.to_string()),
        ];
        let url = self.client.url(&["_changes"]);
        let reply = self.client.read(Method::POST, &url, &query, Some(selector), doing).await?;
        if reply.status != StatusCode::OK {
            return Err(from_status(reply.status, &reply.body, doing));
        }
        let last_seq = match reply.body.get("last_seq") {
            Some(Value::String(seq)) => seq.clone(),
            Some(Value::Number(seq)) => seq.to_string(),
            _ => return Err(Error::new(ErrorKind::Internal, "CouchDB _changes answered without last_seq")),
        };
        Ok((take_array(reply.body, "results", "_changes")?, last_seq))
    }

    /// Purges one batch; returns how many documents CouchDB reports purged.
    async fn purge(&self, batch: PurgeBatch) -> Result<u64> {
        let doing = "purge documents";
        let asked = batch.docs.len();
        let reply = self
            .client
            .send(Method::POST, &self.client.url(&["_purge"]), &[], Some(&Value::Object(batch.docs)), doing)
            .await?;
        if !matches!(reply.status, StatusCode::OK | StatusCode::CREATED | StatusCode::ACCEPTED) {
            return Err(from_status(reply.status, &reply.body, doing));
        }
        let purged = reply.body.get("purged").and_then(Value::as_object).ok_or_else(|| {
            Error::new(ErrorKind::Internal, format!("CouchDB _purge answered without `purged` for {asked} documents"))
        })?;
        Ok(purged.values().filter(|revs| revs.as_array().is_some_and(|revs| !revs.is_empty())).count() as u64)
    }

    /// `None` when the server purges; otherwise why it cannot (the server's answer).
    async fn purge_unsupported(&self) -> Result<Option<String>> {
        let doing = "check that the server supports _purge";
        let reply = self.client.send(Method::POST, &self.client.url(&["_purge"]), &[], Some(&json!({})), doing).await?;
        if matches!(reply.status, StatusCode::OK | StatusCode::CREATED | StatusCode::ACCEPTED)
            && reply.body.get("purged").is_some()
        {
            return Ok(None);
        }
        if matches!(reply.status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN) {
            return Err(from_status(reply.status, &reply.body, doing));
        }
        let error = reply.body.get("error").and_then(Value::as_str).unwrap_or("");
        let reason = reply.body.get("reason").and_then(Value::as_str).unwrap_or("");
        Ok(Some(format!(
            "the CouchDB server at {} cannot purge documents (POST /{}/_purge answered HTTP {} {error}: {reason}); \
             erasure needs _purge, which Apache CouchDB 2.3 and later provide (pouchdb-server does not)",
            self.config.server,
            self.config.database,
            reply.status.as_u16()
        )))
    }

    /// The first id under `prefix` in the unfiltered feed (tombstones included), read page by
    /// page: on a server without `_purge` the `_selector` filter cannot be trusted either
    /// (pouchdb-server 4.2.0 crashes on it).
    async fn first_id_under(&self, prefix: &str) -> Result<Option<String>> {
        let mut since = None;
        loop {
            let page = self.changes_page(since.as_deref(), FEED_PAGE).await?;
            if let Some(change) = page.changes.iter().find(|c| c.id.starts_with(prefix)) {
                return Ok(Some(change.id.clone()));
            }
            if page.changes.len() < FEED_PAGE {
                return Ok(None);
            }
            since = Some(page.last_seq);
        }
    }
}

/// `text` as a PCRE pattern that matches it literally: in PCRE a backslash before any ASCII
/// punctuation character stands for that character, so all of them are escaped; letters, digits
/// and non-ASCII characters stand for themselves.
fn regex_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 2);
    for c in text.chars() {
        if c.is_ascii_punctuation() {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(start: &str, end: &str, descending: bool) -> IdRange {
        IdRange {
            start: Some(start.into()),
            end: Some(end.into()),
            inclusive_end: true,
            descending,
            include_design: false,
        }
    }

    #[test]
    fn reversed_ends_make_an_empty_range() {
        assert!(is_empty(&range("b", "a", false)));
        assert!(is_empty(&range("a", "b", true)));
        assert!(!is_empty(&range("a", "b", false)));
        assert!(!is_empty(&range("b", "a", true)));
        assert!(!is_empty(&range("a", "a", false)));
        assert!(!is_empty(&IdRange::all()));
    }

    #[test]
    fn design_documents_lie_only_in_ranges_that_reach_them() {
        assert!(may_hold_design_documents(&IdRange::all()));
        assert!(may_hold_design_documents(&range("A", "z", false)));
        assert!(may_hold_design_documents(&range("z", "A", true)));
        assert!(!may_hold_design_documents(&range("user:", "user;", false)));
        assert!(!may_hold_design_documents(&range("user;", "user:", true)));
        assert!(!may_hold_design_documents(&range("A", "Z", false)));
        let from_user = IdRange { start: Some("user:".into()), ..IdRange::all() };
        assert!(!may_hold_design_documents(&from_user));
    }

    #[test]
    fn regex_metacharacters_are_escaped() {
        assert_eq!(regex_escape("user_1:"), "user\\_1\\:");
        assert_eq!(
            regex_escape("a.b*c(d)[e]{f}|g+h?i^j$k\\l"),
            "a\\.b\\*c\\(d\\)\\[e\\]\\{f\\}\\|g\\+h\\?i\\^j\\$k\\\\l"
        );
        assert_eq!(regex_escape("é 9"), "é 9");
    }
}
