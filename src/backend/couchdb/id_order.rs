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

use reqwest::{Method, StatusCode};
use serde_json::Value;

use super::backend::{from_couch_doc, is_design_doc, json_key, take_array, CouchDbBackend};
use super::error::from_status;
use crate::backend::{IdRange, Page, StoredDocument, LOCAL_PREFIX};
use crate::error::Result;

impl CouchDbBackend {
    pub(super) async fn all_docs_page(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> Result<Page<StoredDocument>> {
        let limit = limit.max(1);
        if is_empty(range) {
            return Ok(Page { items: Vec::new(), next: None });
        }
        let mut items: Vec<StoredDocument> = Vec::with_capacity(limit.min(1024) + 1);
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
            let rows = self.read_id_range(range, after.as_deref(), wanted).await?;
            let full = rows.len() == wanted;
            let mut last_row_id = None;
            for row in rows {
                let Value::Object(mut row) = row else { continue };
                let Some(id) = row.get("id").and_then(Value::as_str).map(str::to_owned) else { continue };
                let already_returned = after.as_deref() == Some(id.as_str());
                let data = !is_design_doc(&id) && !id.starts_with(LOCAL_PREFIX) && range.contains(&id);
                if !already_returned && data {
                    if let Some(doc) = row.remove("doc").filter(|doc| !doc.is_null()) {
                        items.push(from_couch_doc(doc, "list documents in id order")?);
                    }
                }
                last_row_id = Some(id);
            }
            if items.len() > limit {
                items.truncate(limit);
                let next = items.last().map(|doc| doc.id.clone());
                return Ok(Page { items, next });
            }
            match last_row_id {
                // Rows went to design documents: read on from the last one seen.
                Some(id) if full => after = Some(id),
                _ => return Ok(Page { items, next: None }),
            }
        }
    }

    /// One `_all_docs` read of `limit` rows of `range`, from `after` (inclusive) when given.
    async fn read_id_range(&self, range: &IdRange, after: Option<&str>, limit: usize) -> Result<Vec<Value>> {
        let doing = "list documents in id order";
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
        let ticket = self.counts.ticket();
        let reply = self.client.read(Method::GET, &self.client.url(&["_all_docs"]), &query, None, doing).await?;
        if reply.status != StatusCode::OK {
            return Err(from_status(reply.status, &reply.body, doing));
        }
        // Every answer carries the database's document count: the next `total_rows` needs no
        // request of its own (see [`super::counts`]).
        if let Some(total) = reply.body.get("total_rows").and_then(Value::as_u64) {
            self.counts.remember_total(ticket, total);
        }
        take_array(reply.body, "rows", "_all_docs")
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn range(start: &str, end: &str, descending: bool) -> IdRange {
        IdRange { start: Some(start.into()), end: Some(end.into()), inclusive_end: true, descending }
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
}
