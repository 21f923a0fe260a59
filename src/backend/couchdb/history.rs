//! A document's revision history on CouchDB: the current revision, whether it is a tombstone, and
//! the ancestry CouchDB itself keeps (`_revisions`, up to the database's `_revs_limit`).
//!
//! A live document answers `GET /db/id?revs=true` directly. A deleted one answers 404 there (the
//! reason is `deleted` on CouchDB, `missing` on pouchdb-server), so its tombstone revision is
//! looked up with `POST /db/_all_docs {"keys": [id]}`, the one listing both servers answer for a
//! deleted id (`value: {rev, deleted: true}`), and the tombstone itself is then read by revision,
//! `GET /db/id?rev=<tombstone>&revs=true`. `?deleted=true` is not used: pouchdb-server ignores it,
//! and `?open_revs=all` would need multipart handling on CouchDB unless asked for JSON.

use futures::StreamExt;
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

use super::backend::{take_array, CouchDbBackend};
use super::error::from_status;
use crate::backend::rev_tree::{RevPath, RevTree};
use crate::backend::{Ancestry, Revision, RevisionInfo};
use crate::error::{Error, ErrorKind, Result};

/// How often the lookup starts over when the document changes between its steps (deleted after
/// the first read, or re-created after the tombstone was found).
const LOOKUP_ATTEMPTS: usize = 5;

/// What `_all_docs` says of one id.
enum Listed {
    Live,
    Tombstone(Revision),
    Unknown,
}

impl CouchDbBackend {
    pub(super) async fn revision_info(&self, id: &str) -> Result<Option<RevisionInfo>> {
        for _ in 0..LOOKUP_ATTEMPTS {
            if let Some(live) = self.read_with_revisions(id, None).await? {
                return Ok(Some(live));
            }
            match self.listed(id).await? {
                Listed::Unknown => return Ok(None),
                // Re-created since the first read: read it again.
                Listed::Live => continue,
                Listed::Tombstone(rev) => {
                    if let Some(tombstone) = self.read_with_revisions(id, Some(&rev)).await? {
                        return Ok(Some(tombstone));
                    }
                    // Purged meanwhile, or replaced by a newer tombstone: look again.
                }
            }
        }
        Err(Error::conflict(format!("document {id:?} kept changing while its revisions were read")))
    }

    /// Every leaf of the document's tree, CouchDB's own (`?open_revs=all&revs=true`, asked for
    /// as JSON); `None` when CouchDB knows no revision of the id.
    pub(super) async fn leaves_tree(&self, id: &str) -> Result<Option<RevTree>> {
        let query = [("open_revs", "all".to_owned()), ("revs", "true".to_owned())];
        let doing = "read every leaf of a document";
        let reply = self.client.read(Method::GET, &self.document_url(id), &query, None, doing).await?;
        match reply.status {
            StatusCode::OK => {}
            StatusCode::NOT_FOUND => return Ok(None),
            status => return Err(from_status(status, &reply.body, &format!("read every leaf of {id:?}"))),
        }
        let corrupt =
            |what: &str| Error::new(ErrorKind::Internal, format!("CouchDB answered {what} for the leaves of {id:?}"));
        let Value::Array(answers) = reply.body else { return Err(corrupt("no array")) };
        tree_of_leaves(id, answers)
    }

    /// Every leaf of each of `ids`' trees, one per id in order, by `POST _bulk_get?revs=true`
    /// naming the ids alone, which CouchDB answers with every leaf of each (as `open_revs=all`
    /// does), [`LEAVES_PER_BULK_GET`] ids a request: a page of a listing or of the change feed
    /// costs a request, not one per row. pouchdb-server answers such a `_bulk_get` with the
    /// winner alone (and nothing for a deleted document), so there each tree is read by itself,
    /// [`LEAVES_READS_AT_ONCE`] at a time.
    pub(super) async fn leaves_trees(&self, ids: &[String]) -> Result<Vec<Option<RevTree>>> {
        if self.pouchdb_server().await? {
            // Collected first: a closure over the ids trips rustc's higher-ranked `Send` check.
            let mut reads = Vec::with_capacity(ids.len());
            for id in ids {
                reads.push(self.leaves_tree(id));
            }
            let stream = futures::stream::iter(reads).buffered(LEAVES_READS_AT_ONCE);
            return stream.collect::<Vec<_>>().await.into_iter().collect();
        }
        let mut trees = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(LEAVES_PER_BULK_GET) {
            trees.extend(self.leaves_trees_at_once(chunk).await?);
        }
        Ok(trees)
    }

    async fn leaves_trees_at_once(&self, ids: &[String]) -> Result<Vec<Option<RevTree>>> {
        let doing = "read every leaf of many documents";
        let asked = json!({ "docs": ids.iter().map(|id| json!({ "id": id })).collect::<Vec<_>>() });
        let url = self.client.url(&["_bulk_get"]);
        let reply = self.client.read(Method::POST, &url, &[("revs", "true".to_owned())], Some(&asked), doing).await?;
        if !reply.status.is_success() {
            return Err(from_status(reply.status, &reply.body, doing));
        }
        let results = take_array(reply.body, "results", "_bulk_get")?;
        if results.len() != ids.len() {
            return Err(Error::new(
                ErrorKind::Internal,
                format!("CouchDB answered _bulk_get of {} ids with {} results", ids.len(), results.len()),
            ));
        }
        let mut trees = Vec::with_capacity(ids.len());
        for (id, mut result) in ids.iter().zip(results) {
            if result.get("id").and_then(Value::as_str) != Some(id.as_str()) {
                return Err(Error::new(
                    ErrorKind::Internal,
                    format!("CouchDB's _bulk_get answered out of order at {id:?}"),
                ));
            }
            let Some(Value::Array(answers)) = result.get_mut("docs").map(Value::take) else {
                return Err(Error::new(
                    ErrorKind::Internal,
                    format!("CouchDB's _bulk_get answered no docs for {id:?}"),
                ));
            };
            trees.push(tree_of_leaves(id, answers)?);
        }
        Ok(trees)
    }

    /// `GET /db/id?revs=true` (of the current revision, or of `rev`); `None` on 404.
    async fn read_with_revisions(&self, id: &str, rev: Option<&Revision>) -> Result<Option<RevisionInfo>> {
        let mut query = vec![("revs", "true".to_owned())];
        if let Some(rev) = rev {
            query.push(("rev", rev.as_str().to_owned()));
        }
        let doing = "read a document's revisions";
        let reply = self.client.read(Method::GET, &self.document_url(id), &query, None, doing).await?;
        match reply.status {
            StatusCode::OK => revision_info_of(id, &reply.body, self.config.revs_limit).map(Some),
            StatusCode::NOT_FOUND => Ok(None),
            status => Err(from_status(status, &reply.body, &format!("read the revisions of {id:?}"))),
        }
    }

    /// Whether `_all_docs` knows `id`, and its tombstone's revision when it is deleted.
    async fn listed(&self, id: &str) -> Result<Listed> {
        let doing = "look up a tombstone";
        let url = self.client.url(&["_all_docs"]);
        let reply = self.client.read(Method::POST, &url, &[], Some(&json!({ "keys": [id] })), doing).await?;
        if !reply.status.is_success() {
            return Err(from_status(reply.status, &reply.body, doing));
        }
        let row = take_array(reply.body, "rows", "_all_docs")?.into_iter().next().unwrap_or(Value::Null);
        if row.get("error").is_some() || row.get("id").and_then(Value::as_str) != Some(id) {
            return Ok(Listed::Unknown);
        }
        if row.pointer("/value/deleted").and_then(Value::as_bool) != Some(true) {
            return Ok(Listed::Live);
        }
        match row.pointer("/value/rev").and_then(Value::as_str) {
            Some(rev) => Ok(Listed::Tombstone(Revision(rev.to_owned()))),
            None => {
                Err(Error::new(ErrorKind::Internal, format!("CouchDB listed the tombstone of {id:?} without a rev")))
            }
        }
    }
}

/// Ids one `_bulk_get` of many documents' leaves names ([`CouchDbBackend::leaves_trees`]): a
/// page of the change feed or a listing fits in one request.
pub(super) const LEAVES_PER_BULK_GET: usize = 200;
/// Trees read at once, one request each, where `_bulk_get` does not answer every leaf
/// (pouchdb-server).
const LEAVES_READS_AT_ONCE: usize = 16;

/// The tree of `id`'s leaves as CouchDB answers them (`[{"ok": doc}, …]`, each with its
/// `_revisions`; `{"error": …}` entries, a missing id's, are skipped); `None` with no leaf.
fn tree_of_leaves(id: &str, answers: Vec<Value>) -> Result<Option<RevTree>> {
    let corrupt =
        |what: &str| Error::new(ErrorKind::Internal, format!("CouchDB answered {what} for the leaves of {id:?}"));
    let mut tree = RevTree::default();
    for mut answer in answers {
        let Some(Value::Object(mut doc)) = answer.get_mut("ok").map(Value::take) else { continue };
        // `shift_remove`: the body keeps CouchDB's member order (a plain `remove` moves the
        // last member into each gap, so a read answered `lastAccessedAt` before `userId`).
        let path = doc
            .shift_remove("_revisions")
            .as_ref()
            .and_then(RevPath::from_revisions)
            .ok_or_else(|| corrupt("a leaf without _revisions"))?;
        let deleted = doc.shift_remove("_deleted") == Some(Value::Bool(true));
        doc.shift_remove("_id");
        doc.shift_remove("_rev");
        tree.merge(path, deleted, doc, usize::MAX);
    }
    Ok((!tree.is_empty()).then_some(tree))
}

/// A document read with `revs=true` as a [`RevisionInfo`]: CouchDB's `_revisions` is already
/// `{start, ids}` newest first; it is cut to `revs_limit`. A document without `_revisions` (a
/// server that does not keep them) remembers only its current revision.
pub(super) fn revision_info_of(id: &str, doc: &Value, revs_limit: usize) -> Result<RevisionInfo> {
    let corrupt = |what: &str| Error::new(ErrorKind::Corrupt, format!("CouchDB answered {what} for document {id:?}"));
    let rev = doc.get("_rev").and_then(Value::as_str).ok_or_else(|| corrupt("no _rev"))?;
    let (generation, hash) = rev.split_once('-').ok_or_else(|| corrupt("a _rev without a generation"))?;
    let generation: u64 = generation.parse().map_err(|_| corrupt("a _rev without a generation"))?;
    let deleted = doc.get("_deleted").and_then(Value::as_bool).unwrap_or(false);
    let mut ancestry = match doc.get("_revisions") {
        None => Ancestry { start: generation, ids: vec![hash.to_owned()] },
        Some(revisions) => {
            let start = revisions.get("start").and_then(Value::as_u64);
            let ids: Option<Vec<String>> = revisions
                .get("ids")
                .and_then(Value::as_array)
                .and_then(|ids| ids.iter().map(|id| id.as_str().map(str::to_owned)).collect());
            match (start, ids) {
                (Some(start), Some(ids)) if start == generation && ids.first().map(String::as_str) == Some(hash) => {
                    Ancestry { start, ids }
                }
                _ => return Err(corrupt("_revisions that do not start at its _rev")),
            }
        }
    };
    ancestry.ids.truncate(revs_limit.max(1));
    Ok(RevisionInfo { rev: Revision(rev.to_owned()), deleted, ancestry })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn revisions_become_ancestry_cut_to_the_limit() {
        let doc = json!({"_id": "a", "_rev": "3-ccc", "_deleted": true, "_revisions": {"start": 3, "ids": ["ccc", "bbb", "aaa"]}});
        let info = revision_info_of("a", &doc, 2).unwrap();
        assert_eq!(info.rev, Revision("3-ccc".into()));
        assert!(info.deleted);
        assert_eq!(info.ancestry.revisions().map(|r| r.0).collect::<Vec<_>>(), ["3-ccc", "2-bbb"]);
        let plain = revision_info_of("a", &json!({"_id": "a", "_rev": "7-x"}), 10).unwrap();
        assert_eq!((plain.deleted, plain.ancestry), (false, Ancestry { start: 7, ids: vec!["x".into()] }));
    }

    #[test]
    fn a_leaf_keeps_couchdbs_member_order() {
        let answers = vec![json!({"ok": {
            "_id": "u:n:k", "_rev": "1-a", "userId": "u", "namespace": "n", "key": "k",
            "updatedAt": "t", "lastAccessedAt": "t", "_revisions": {"start": 1, "ids": ["a"]}
        }})];
        let tree = tree_of_leaves("u:n:k", answers).unwrap().expect("a tree");
        let names: Vec<&str> = tree.winner().expect("a winner").body.keys().map(String::as_str).collect();
        assert_eq!(names, ["userId", "namespace", "key", "updatedAt", "lastAccessedAt"]);
    }

    #[test]
    fn revisions_that_do_not_match_the_rev_are_corrupt() {
        for doc in [
            json!({"_rev": "3-ccc", "_revisions": {"start": 2, "ids": ["ccc"]}}),
            json!({"_rev": "3-ccc", "_revisions": {"start": 3, "ids": ["bbb"]}}),
            json!({"_rev": "3-ccc", "_revisions": {"start": 3}}),
            json!({"_rev": "ccc"}),
            json!({}),
        ] {
            assert_eq!(revision_info_of("a", &doc, 10).unwrap_err().kind(), ErrorKind::Corrupt, "{doc}");
        }
    }
}
