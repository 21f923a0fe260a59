//! The write path's CouchDB-specific part: replicated writes, with CouchDB's own
//! `new_edits: false` (plain puts and deletes are single requests, in `backend.rs`; the guard on
//! tombstone revisions is `live.rs`).
//!
//! The revision is sent as a replicator sends it, `POST /db/_bulk_docs {"docs": [{…, "_rev",
//! "_revisions"}], "new_edits": false}`, and CouchDB merges it into the document's revision tree
//! atomically. `_bulk_docs` with `new_edits: false` answers nothing per document on success, so
//! the outcome is read from the document's revisions: the rules ([`replicated::judge`]) are
//! applied to the state before the write (a revision that is known or loses is not sent at all,
//! so CouchDB keeps no branch for it), and the write counts as applied only if the revision CouchDB
//! shows afterwards is the incoming one (another writer may have won meanwhile).
//!
//! CouchDB keeps every branch of a revision tree, where the trait keeps only the winner: when the
//! incoming revision wins over a live current revision on another branch, that branch's leaf is
//! then deleted (a tombstone on the losing branch, CouchDB's way of resolving a conflict), so it
//! cannot come back as the winner when the incoming branch is deleted later.

use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

use super::backend::CouchDbBackend;
use super::codec::to_couch_doc;
use super::error::from_status;
use crate::backend::replicated::{self, CheckedRevision};
use crate::backend::{ReplicatedOutcome, ReplicatedRevision, Revision};
use crate::error::{Error, ErrorKind, Result};

impl CouchDbBackend {
    pub(super) async fn put_replicated_revision(
        &self,
        id: &str,
        incoming: &ReplicatedRevision,
    ) -> Result<ReplicatedOutcome> {
        let checked = replicated::check(id, incoming)?;
        let before = self.revision_info(id).await?;
        let outcome = replicated::judge(incoming, before.as_ref());
        if outcome != ReplicatedOutcome::Applied {
            return Ok(outcome);
        }
        // An answer lost on the way may hide a write that landed: the revisions tell.
        let unknown = match self.send_new_edits_false(id, incoming, &checked).await {
            Ok(()) => None,
            Err(err) if err.kind() == ErrorKind::OutcomeUnknown => Some(err),
            Err(err) => return Err(err),
        };
        let after = self.revision_info(id).await?;
        if after.as_ref().map(|a| &a.rev) != Some(&incoming.rev) {
            return match unknown {
                Some(err) => Err(err),
                // Merged, but another writer's revision wins over it: the incoming one is kept
                // by CouchDB as a losing branch, as a concurrent replication would leave it.
                None => Ok(ReplicatedOutcome::KeptCurrent),
            };
        }
        if let Some(lost) = before.filter(|b| !b.deleted && !incoming.ancestry.iter().any(|a| a == b.rev.as_str())) {
            self.delete_losing_leaf(id, &lost.rev).await?;
        }
        Ok(ReplicatedOutcome::Applied)
    }

    /// A replicated revision kept with every branch, as CouchDB keeps it natively: written as
    /// sent (nothing deleted after it), then `Applied` when it is the winner.
    pub(super) async fn put_branch_revision(
        &self,
        id: &str,
        incoming: &ReplicatedRevision,
    ) -> Result<ReplicatedOutcome> {
        let checked = replicated::check(id, incoming)?;
        if self.leaves_tree(id).await?.is_some_and(|tree| tree.contains(incoming.rev.as_str())) {
            return Ok(ReplicatedOutcome::AlreadyKnown);
        }
        let unknown = match self.send_new_edits_false(id, incoming, &checked).await {
            Ok(()) => None,
            Err(err) if err.kind() == ErrorKind::OutcomeUnknown => Some(err),
            Err(err) => return Err(err),
        };
        let after = self.revision_info(id).await?;
        if after.as_ref().map(|a| &a.rev) == Some(&incoming.rev) {
            return Ok(ReplicatedOutcome::Applied);
        }
        match (unknown, self.leaves_tree(id).await?) {
            (_, Some(tree)) if tree.contains(incoming.rev.as_str()) => Ok(ReplicatedOutcome::KeptCurrent),
            (Some(err), _) => Err(err),
            (None, _) => {
                Err(Error::new(ErrorKind::Internal, format!("CouchDB did not keep {} of {id:?}", incoming.rev)))
            }
        }
    }

    /// `_bulk_docs` with `new_edits: false` of the incoming revision.
    async fn send_new_edits_false(
        &self,
        id: &str,
        incoming: &ReplicatedRevision,
        checked: &CheckedRevision,
    ) -> Result<()> {
        // A deletion's fields go with it: CouchDB keeps them in the tombstone.
        let mut doc = to_couch_doc(id, &incoming.body, Some(&incoming.rev), self.number_model().await?)?;
        let ids: Vec<&str> = incoming.ancestry.iter().map(|rev| rev.split_once('-').map_or("", |(_, id)| id)).collect();
        doc["_revisions"] = json!({ "start": checked.rev.generation, "ids": ids });
        if incoming.deleted {
            doc["_deleted"] = Value::Bool(true);
        }
        let url = self.client.url(&["_bulk_docs"]);
        let request = json!({ "docs": [doc], "new_edits": false });
        let doing = "write a replicated revision";
        let reply = self.client.send(Method::POST, &url, &[], Some(&request), doing).await?;
        if !reply.status.is_success() {
            return Err(from_status(reply.status, &reply.body, &format!("write a replicated revision of {id:?}")));
        }
        // Success answers `[]`; a refused document answers an entry with `error`.
        match reply.body.as_array().and_then(|results| results.iter().find(|r| r.get("error").is_some())) {
            None => Ok(()),
            Some(refused) => {
                let error = refused.get("error").and_then(Value::as_str).unwrap_or("");
                let reason = refused.get("reason").and_then(Value::as_str).unwrap_or("");
                Err(Error::new(
                    ErrorKind::Internal,
                    format!("CouchDB refused the replicated revision {} of {id:?}: {error}: {reason}", incoming.rev),
                ))
            }
        }
    }

    /// Deletes the leaf `rev` of a branch that lost to the replicated revision.
    async fn delete_losing_leaf(&self, id: &str, rev: &Revision) -> Result<()> {
        let query = [("rev", rev.as_str().to_owned())];
        let doing = "delete a losing branch";
        let reply = self.client.send(Method::DELETE, &self.document_url(id), &query, None, doing).await?;
        match reply.status {
            StatusCode::OK | StatusCode::ACCEPTED => Ok(()),
            // Already deleted or replaced by another writer: nothing left to resolve.
            StatusCode::CONFLICT | StatusCode::NOT_FOUND => Ok(()),
            status => Err(from_status(status, &reply.body, &format!("delete the losing branch {rev} of {id:?}"))),
        }
    }
}
