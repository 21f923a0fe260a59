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

use reqwest::{Method, StatusCode};
use serde_json::{json, Map, Value};

use super::backend::{is_design_doc, take_array, CouchDbBackend};
use super::error::from_status;
use crate::error::{Error, ErrorKind, Result};

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
