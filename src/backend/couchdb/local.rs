//! Local documents on CouchDB: its own `_local/` documents (replication checkpoints), which
//! CouchDB never replicates, lists in `_all_docs` or feeds to `_changes`, and revises as `0-N`.
//!
//! A delete is `PUT /db/_local/name {"_rev": "0-N", "_deleted": true}` rather than
//! `DELETE ?rev=`: pouchdb-server 4.2.0 checks the revision of such a PUT, while it deletes a local
//! document on `DELETE` whatever revision is named. Apache CouchDB 3.4.3 checks no local
//! document's revision at all (a stale one, or none over an existing document, is written), so
//! every conditional write or delete reads the document first and refuses a stale revision itself
//! (`check_local_at`: not atomic, two writers of one revision at one moment can both succeed).
//! A deleted local document is gone on both, so re-creating it starts again at `0-1`.
//!
//! Listing: `GET /db/_local_docs?include_docs=true` (CouchDB 2.0 and later), its `startkey`,
//! `endkey` (the `_local/` ids of the range's names, an open end closed at the prefix's),
//! `inclusive_end`, `descending` and `limit` from the range; paged as `_all_docs` is ([`super::ids`]): the token is the last id returned,
//! the next page starts at it with one row more and drops it, and one row beyond the page tells
//! whether another follows. CouchDB leaves its own system locals (`_local/purge-…`,
//! `_local/shard-sync-…`) out unless asked. pouchdb-server 4.2.0 has no such listing (nor any
//! other way to enumerate local documents): there the listing is refused with an error that says
//! so, never answered empty.

use reqwest::{Method, StatusCode};
use serde_json::{Map, Value};

use super::backend::{from_couch_doc, json_key, revision_of, take_array, CouchDbBackend, UNCONDITIONAL_WRITE_ATTEMPTS};
use super::codec::to_couch_doc;
use super::error::from_status;
use crate::backend::revision::local_number;
use crate::backend::{IdRange, Page, Precondition, Revision, StoredDocument, LOCAL_PREFIX};
use crate::error::{Error, ErrorKind, Result};

impl CouchDbBackend {
    fn local_url(&self, name: &str) -> String {
        self.client.url(&["_local", name])
    }

    pub(super) async fn read_local(&self, name: &str) -> Result<Option<StoredDocument>> {
        let doing = "read a local document";
        let reply = self.client.read(Method::GET, &self.local_url(name), &[], None, doing).await?;
        match reply.status {
            StatusCode::OK => from_couch_doc(reply.body, doing).map(Some),
            StatusCode::NOT_FOUND => Ok(None),
            status => Err(from_status(status, &reply.body, &format!("read local document {name:?}"))),
        }
    }

    /// One page of the local documents whose names lie in `range` (see the module's doc).
    pub(super) async fn list_local(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> Result<Page<StoredDocument>> {
        if self.pouchdb_server().await? {
            return Err(no_local_listing("pouchdb-server has no `_local_docs`"));
        }
        let limit = limit.max(1);
        let ids = range.under_prefix(LOCAL_PREFIX);
        if ids.holds_nothing() {
            return Ok(Page { items: Vec::new(), next: None });
        }
        let after = page_token.map(str::to_owned);
        // The row of the document the read starts at (already returned), and one to learn
        // whether more follow.
        let wanted = limit + 1 + usize::from(after.is_some());
        let mut query = vec![("include_docs", "true".to_owned()), ("limit", wanted.to_string())];
        if ids.descending {
            query.push(("descending", "true".to_owned()));
        }
        if let Some(from) = after.as_ref().or(ids.start.as_ref()) {
            query.push(("startkey", json_key(from)));
        }
        if let Some(end) = &ids.end {
            query.push(("endkey", json_key(end)));
            query.push(("inclusive_end", ids.inclusive_end.to_string()));
        }
        let doing = "list local documents";
        let reply = self.client.read(Method::GET, &self.client.url(&["_local_docs"]), &query, None, doing).await?;
        match reply.status {
            StatusCode::OK => {}
            // CouchDB 1.x reads `_local_docs` as a document id it refuses or cannot find.
            StatusCode::BAD_REQUEST | StatusCode::NOT_FOUND if reply.body.get("rows").is_none() => {
                return Err(no_local_listing("this CouchDB server has no `_local_docs` (CouchDB 2.0 and later have)"))
            }
            status => return Err(from_status(status, &reply.body, doing)),
        }
        let mut items = Vec::with_capacity(limit.min(1024) + 1);
        for row in take_array(reply.body, "rows", "_local_docs")? {
            let Value::Object(mut row) = row else { continue };
            let Some(id) = row.get("id").and_then(Value::as_str) else { continue };
            if after.as_deref() == Some(id) || !id.starts_with(LOCAL_PREFIX) {
                continue;
            }
            if let Some(doc) = row.remove("doc").filter(|doc| !doc.is_null()) {
                items.push(from_couch_doc(doc, doing)?);
            }
        }
        if items.len() > limit {
            items.truncate(limit);
            let next = items.last().map(|doc| doc.id.clone());
            return Ok(Page { items, next });
        }
        Ok(Page { items, next: None })
    }

    pub(super) async fn write_local(
        &self,
        name: &str,
        body: &Map<String, Value>,
        precondition: Precondition,
    ) -> Result<Revision> {
        match precondition {
            // Local documents leave no tombstone.
            Precondition::MustNotExist | Precondition::NeverWritten => {
                if self.read_local(name).await?.is_some() {
                    return Err(Error::conflict(format!("local document {name:?} already exists")));
                }
                self.put_local_with_rev(name, body, None).await
            }
            Precondition::MatchRevision(rev) => {
                self.check_local_at(name, &rev).await?;
                self.put_local_with_rev(name, body, Some(&rev)).await
            }
            Precondition::None => {
                for _ in 0..UNCONDITIONAL_WRITE_ATTEMPTS {
                    let current = self.read_local(name).await?.map(|doc| doc.rev);
                    match self.put_local_with_rev(name, body, current.as_ref()).await {
                        Err(e) if e.is_conflict() => continue,
                        other => return other,
                    }
                }
                Err(Error::conflict(format!("local document {name:?} kept changing during an unconditional write")))
            }
        }
    }

    pub(super) async fn remove_local(&self, name: &str, rev: &Revision) -> Result<()> {
        // A missing one is not found, a stale revision a conflict ([`Self::check_local_at`]).
        if let Err(stale) = self.check_local_at(name, rev).await {
            return match self.read_local(name).await? {
                None => Err(Error::not_found(format!("local document {name:?} does not exist"))),
                Some(_) => Err(stale),
            };
        }
        let mut deletion = Map::new();
        deletion.insert("_deleted".into(), true.into());
        match self.put_local_with_rev(name, &deletion, Some(rev)).await {
            Ok(_) => Ok(()),
            // CouchDB answers 409 for a missing one, pouchdb-server 404: look before choosing.
            Err(e) if e.is_conflict() || e.kind() == crate::ErrorKind::NotFound => match self.read_local(name).await? {
                Some(_) => Err(Error::conflict(format!("local document {name:?} is no longer at revision {rev}"))),
                None => Err(Error::not_found(format!("local document {name:?} does not exist"))),
            },
            Err(e) => Err(e),
        }
    }

    /// Apache CouchDB 3.4.3 checks no local document's revision (a write naming a stale one, or
    /// none over an existing one, succeeds; checked with curl), so the precondition is checked
    /// here by a read just before the write: a stale writer is refused, but two writers naming
    /// the same revision at the same moment can both succeed (CouchDB offers no atomic check of a
    /// local document). pouchdb-server 4.2.0 checks the written revision itself as well.
    async fn check_local_at(&self, name: &str, rev: &Revision) -> Result<()> {
        check_local_revision(name, rev)?;
        match self.read_local(name).await? {
            Some(current) if current.rev == *rev => Ok(()),
            Some(current) => {
                Err(Error::conflict(format!("local document {name:?} is at revision {}, not {rev}", current.rev)))
            }
            None => Err(Error::conflict(format!("local document {name:?} does not exist, not at revision {rev}"))),
        }
    }

    async fn put_local_with_rev(
        &self,
        name: &str,
        body: &Map<String, Value>,
        rev: Option<&Revision>,
    ) -> Result<Revision> {
        let doing = "write a local document";
        let doc = to_couch_doc(&format!("{LOCAL_PREFIX}{name}"), body, rev, self.number_model().await?)?;
        let reply = self.client.send(Method::PUT, &self.local_url(name), &[], Some(&doc), doing).await?;
        match reply.status {
            StatusCode::OK | StatusCode::CREATED | StatusCode::ACCEPTED => revision_of(&reply.body, doing),
            StatusCode::CONFLICT => {
                Err(Error::conflict(format!("local document {name:?} was changed by another writer")))
            }
            status => Err(from_status(status, &reply.body, &format!("write local document {name:?}"))),
        }
    }
}

/// A local document's revision is `0-N`; any other text can never match one, so it is a
/// conflict without asking (CouchDB would fail to parse it).
fn check_local_revision(name: &str, rev: &Revision) -> Result<()> {
    if local_number(rev).is_some() {
        Ok(())
    } else {
        Err(Error::conflict(format!("local document {name:?} is not at revision {rev} (local revisions are 0-N)")))
    }
}

/// The refusal of a listing of local documents on a server that cannot list them.
fn no_local_listing(why: &str) -> Error {
    Error::new(ErrorKind::Misconfigured, format!("cannot list local documents: {why}"))
}
