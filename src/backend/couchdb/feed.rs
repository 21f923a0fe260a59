//! The change feed on CouchDB: its own `_changes`.
//!
//! `changes(since, limit)` is `GET /db/_changes?since=&limit=` (default `style=main_only`: each
//! document once, at its winning revision, `deleted` flagged), `since=0` for the start. Sequence
//! values are passed through untouched and unquoted: CouchDB's are opaque strings
//! (`7-g1AAAA…`), pouchdb-server's are numbers, and pouchdb-server reads a quoted `since="3"` as a
//! string that collates before every number (so it would replay the feed). Design documents are
//! dropped from the page (they are not data); the page is refilled after them, so a page is short
//! only at the end of the feed. `_local/` documents are never in `_changes`.
//!
//! A follower never misses a committed write: CouchDB gives every committed update a place in the
//! database's sequence, and a `_changes` read from a `last_seq` returns every document updated
//! after it (at its latest revision), so a follower that keeps calling with the last token sees
//! the final state of every document. On a clustered CouchDB a shard that moves may replay some
//! changes (never lose them), so a follower may see a document again, at a revision it has.
//!
//! `change_position` is the database's `update_seq` (`GET /db`), which CouchDB accepts as `since`.

use reqwest::{Method, StatusCode};
use serde_json::Value;

use super::backend::{is_design_doc, take_array, CouchDbBackend};
use super::error::from_status;
use crate::backend::{Change, ChangesPage, Revision, LOCAL_PREFIX};
use crate::error::{Error, ErrorKind, Result};

/// The `since` of the start of the feed.
const FEED_START: &str = "0";

impl CouchDbBackend {
    pub(super) async fn changes_page(&self, since: Option<&str>, limit: usize) -> Result<ChangesPage> {
        let limit = limit.max(1);
        if let Some(since) = since.filter(|since| !is_sequence(since)) {
            return Err(Error::invalid("since", format!("{since:?} is not a change-feed position of this backend")));
        }
        let mut changes = Vec::with_capacity(limit.min(1024));
        let mut last_seq = since.unwrap_or(FEED_START).to_owned();
        loop {
            let wanted = limit - changes.len();
            let read = self.read_changes(&last_seq, wanted).await?;
            let full = read.rows == wanted;
            changes.extend(read.changes);
            last_seq = read.last_seq;
            // A full read that lost rows to design documents leaves room: read on after it.
            if !full {
                // Fewer rows than asked: the end of the feed (pouchdb-server sends no `pending`).
                return Ok(ChangesPage { changes, last_seq, pending: Some(0), unsettled: 0 });
            }
            if changes.len() >= limit {
                return Ok(ChangesPage { changes, last_seq, pending: read.pending, unsettled: 0 });
            }
        }
    }

    pub(super) async fn feed_position(&self) -> Result<String> {
        let doing = "read the database's update sequence";
        let reply = self.client.read(Method::GET, &self.client.url(&[]), &[], None, doing).await?;
        if reply.status != StatusCode::OK {
            return Err(from_status(reply.status, &reply.body, doing));
        }
        reply
            .body
            .get("update_seq")
            .and_then(seq_text)
            .ok_or_else(|| Error::new(ErrorKind::Internal, "CouchDB's database information has no update_seq"))
    }

    /// One `_changes` request of at most `limit` rows after `since`.
    async fn read_changes(&self, since: &str, limit: usize) -> Result<ChangesRead> {
        let doing = "read the change feed";
        let query = [("since", since.to_owned()), ("limit", limit.to_string())];
        let reply = self.client.read(Method::GET, &self.client.url(&["_changes"]), &query, None, doing).await?;
        if reply.status != StatusCode::OK {
            return Err(from_status(reply.status, &reply.body, doing));
        }
        let last_seq = reply.body.get("last_seq").and_then(seq_text);
        let pending = reply.body.get("pending").and_then(Value::as_u64);
        let results = take_array(reply.body, "results", "_changes")?;
        let rows = results.len();
        let mut changes = Vec::with_capacity(rows);
        for row in &results {
            let change = change_of(row)?;
            if !is_design_doc(&change.id) && !change.id.starts_with(LOCAL_PREFIX) {
                changes.push(change);
            }
        }
        let last_seq = match (last_seq, results.last()) {
            (Some(seq), _) => seq,
            // Without last_seq, the last row's seq is where the next read starts.
            (None, Some(row)) => row.get("seq").and_then(seq_text).unwrap_or_else(|| since.to_owned()),
            (None, None) => since.to_owned(),
        };
        Ok(ChangesRead { changes, rows, last_seq, pending })
    }
}

/// What one `_changes` request gave.
struct ChangesRead {
    changes: Vec<Change>,
    /// Rows CouchDB returned, design documents included.
    rows: usize,
    last_seq: String,
    pending: Option<u64>,
}

/// Whether `text` has the form of a CouchDB sequence: a number (CouchDB 1.x, pouchdb-server), or
/// a number, `-` and a base64url token (CouchDB 2 and later, Cloudant). Checked here because
/// pouchdb-server answers any `since` it cannot read with an empty page instead of a 400.
fn is_sequence(text: &str) -> bool {
    let (number, token) = text.split_once('-').unwrap_or((text, "x"));
    !number.is_empty()
        && number.bytes().all(|b| b.is_ascii_digit())
        && !token.is_empty()
        && token.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A sequence value as text: CouchDB's opaque string, or pouchdb-server's number.
fn seq_text(seq: &Value) -> Option<String> {
    match seq {
        Value::String(text) => Some(text.clone()),
        Value::Number(number) => Some(number.to_string()),
        _ => None,
    }
}

/// One `_changes` row: `{seq, id, changes: [{rev}], deleted?}`.
fn change_of(row: &Value) -> Result<Change> {
    let bad = |what: &str| Error::new(ErrorKind::Internal, format!("CouchDB _changes answered a row {what}: {row}"));
    let seq = row.get("seq").and_then(seq_text).ok_or_else(|| bad("without seq"))?;
    let id = row.get("id").and_then(Value::as_str).ok_or_else(|| bad("without id"))?;
    let rev = row.pointer("/changes/0/rev").and_then(Value::as_str).ok_or_else(|| bad("without a revision"))?;
    let deleted = row.get("deleted").and_then(Value::as_bool).unwrap_or(false);
    Ok(Change { seq, id: id.to_owned(), rev: Revision(rev.to_owned()), deleted })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_of_both_servers_are_recognised() {
        let couchdb = "7-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zEhnwKMpjAZIMDUDqP0htBnMiey5QgD3F1NLSPC0Vm74sAJcNIHk";
        for good in ["0", "42", couchdb] {
            assert!(is_sequence(good), "{good}");
        }
        for bad in ["", "not a token", "-1", "7-", "7-a b", "now"] {
            assert!(!is_sequence(bad), "{bad}");
        }
    }
}
