//! Local documents on CouchDB: its own `_local/` documents (replication checkpoints), which
//! CouchDB never replicates, lists in `_all_docs` or feeds to `_changes`, and revises as `0-N`.
//!
//! A delete is `PUT /db/_local/name {"_rev": "0-N", "_deleted": true}` rather than
//! `DELETE ?rev=`: both servers check the revision of such a PUT, while pouchdb-server 4.2.0 deletes
//! a local document on `DELETE` whatever revision is named. A deleted local document is gone on
//! both, so re-creating it starts again at `0-1`.

use reqwest::{Method, StatusCode};
use serde_json::{Map, Value};

use super::backend::{from_couch_doc, revision_of, CouchDbBackend, UNCONDITIONAL_WRITE_ATTEMPTS};
use super::codec::to_couch_doc;
use super::error::from_status;
use crate::backend::revision::local_number;
use crate::backend::{Precondition, Revision, StoredDocument, LOCAL_PREFIX};
use crate::error::{Error, Result};

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

    pub(super) async fn write_local(
        &self,
        name: &str,
        body: &Map<String, Value>,
        precondition: Precondition,
    ) -> Result<Revision> {
        match precondition {
            Precondition::MustNotExist => self.put_local_with_rev(name, body, None).await,
            Precondition::MatchRevision(rev) => {
                check_local_revision(name, &rev)?;
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
        check_local_revision(name, rev)?;
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
