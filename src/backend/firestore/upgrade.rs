//! The layout marker (`{collection}_meta/layout`) and the upgrade that stamps documents of the
//! previous release with this release's fields (see `docs/firestore-layout.md`).

use std::sync::atomic::Ordering;

use futures::{stream, StreamExt, TryStreamExt};
use serde_json::{json, Map, Value};

use super::backend::FirestoreBackend;
use super::codec;
use super::core::{field_filter, fields_of, select, text, MAX_PAGE};
use super::layout::{self, has_layout, stored_revision, StoredState, DELETED, FEED_FIELDS, REV, REVS};
use crate::backend::revision::{PackedAncestry, RevisionId};
use crate::backend::{needs_upgrade, DocumentBackend, LayoutState, UpgradePage};
use crate::error::{Error, ErrorKind, Result};

/// The layout marker's document and the version this release writes.
pub(super) const LAYOUT_DOCUMENT: &str = "layout";
pub(super) const LAYOUT_VERSION: i64 = 2;
/// Upgrade stamps in flight at once, and tries of a stamp that meets a concurrent write.
const UPGRADE_CONCURRENCY: usize = 16;
const UPGRADE_TRIES: usize = 3;

impl FirestoreBackend {
    pub(super) fn layout_marker_name(&self) -> String {
        self.client.name_in(&self.client.meta_collection(), LAYOUT_DOCUMENT)
    }

    /// `Current` when the marker says so, or when the collection is empty (a new store: the
    /// marker is written then, so later writes by this release keep it current).
    pub(super) async fn layout_state(&self) -> Result<LayoutState> {
        if self.layout_current.load(Ordering::Relaxed) {
            return Ok(LayoutState::Current);
        }
        let reply = self.batch_get_fields(&[self.layout_marker_name()], None, "read the layout marker").await?;
        let version = reply
            .as_array()
            .into_iter()
            .flatten()
            .find_map(|entry| entry.pointer("/found/fields/version/integerValue"))
            .and_then(Value::as_str)
            .and_then(|v| v.parse::<i64>().ok());
        if version.is_some_and(|v| v >= LAYOUT_VERSION) {
            self.layout_current.store(true, Ordering::Relaxed);
            return Ok(LayoutState::Current);
        }
        let probe = json!({ "select": select(&[codec::ID]), "from": [{ "collectionId": self.client.collection() }], "limit": 1 });
        let answer = self.run_raw_query(&probe, None, "check whether the collection is empty").await?;
        if answer.documents.is_empty() {
            self.record_layout().await?;
            return Ok(LayoutState::Current);
        }
        Ok(LayoutState::NeedsUpgrade(format!(
            "collection {:?} has documents but no layout marker {}_meta/{LAYOUT_DOCUMENT}: documents of an earlier \
             release have no stored revision, tombstone flag or change time",
            self.client.collection(),
            self.client.collection()
        )))
    }

    pub(super) async fn require_layout(&self, feature: &str) -> Result<()> {
        match self.layout_state().await? {
            LayoutState::Current => Ok(()),
            LayoutState::NeedsUpgrade(why) => Err(needs_upgrade(&self.describe(), feature, &why)),
        }
    }

    pub(super) async fn record_layout(&self) -> Result<()> {
        let write = json!({ "update": {
            "name": self.layout_marker_name(),
            "fields": { "version": { "integerValue": LAYOUT_VERSION.to_string() } }
        } });
        self.commit(vec![write], "write the layout marker").await?;
        self.layout_current.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// One page of the upgrade in `__name__` order: documents without this layout's fields get
    /// them (a new revision, its ancestry, `_deleted: false`, `_changedAt`, and `_id` when a
    /// foreign client left it out), each conditional on the `updateTime` read; the body is not
    /// touched.
    pub(super) async fn upgrade_step(&self, page_token: Option<&str>, limit: usize) -> Result<UpgradePage> {
        if page_token.is_none() {
            // Firestore's indexes are deployed, not created by clients: probe the id-order query
            // so a missing index fails here with Firestore's link.
            let probe = json!({
                "from": [{ "collectionId": self.client.collection() }],
                "where": field_filter(DELETED, "EQUAL", json!({ "booleanValue": false })),
                "orderBy": [{ "field": { "fieldPath": codec::ID }, "direction": "ASCENDING" }],
                "limit": 1,
            });
            self.run_raw_query(&probe, None, "check the id-order index").await?;
        }
        let limit = limit.clamp(1, MAX_PAGE);
        let mut query = json!({
            "select": select(&FEED_FIELDS),
            "from": [{ "collectionId": self.client.collection() }],
            "orderBy": [{ "field": { "fieldPath": "__name__" }, "direction": "ASCENDING" }],
            "limit": limit,
        });
        if let Some(token) = page_token {
            query["startAt"] =
                json!({ "values": [{ "referenceValue": self.client.document_name(token) }], "before": false });
        }
        let answer = self.run_raw_query(&query, None, "read a page to upgrade").await?;
        let next = match answer.documents.last() {
            Some(last) if answer.documents.len() >= limit => Some(self.name_of_document(last).to_owned()),
            _ => None,
        };
        let examined = answer.documents.len() as u64;
        // A plain loop, not a closure in an iterator adapter: that trips rustc's higher-ranked
        // `Send` check.
        let mut stamps = Vec::with_capacity(answer.documents.len());
        for document in answer.documents {
            stamps.push(self.upgrade_document(document));
        }
        let upgraded: Vec<bool> = stream::iter(stamps).buffered(UPGRADE_CONCURRENCY).try_collect().await?;
        Ok(UpgradePage { examined, upgraded: upgraded.iter().filter(|u| **u).count() as u64, next })
    }

    /// Stamps one document with this layout's fields unless it has them; whether it stamped it.
    pub(super) async fn upgrade_document(&self, document: Value) -> Result<bool> {
        let document_id = self.name_of_document(&document).to_owned();
        let mut current = document;
        for _ in 0..UPGRADE_TRIES {
            let fields = fields_of(&current);
            if has_layout(fields) {
                return Ok(false);
            }
            let id = self.id_of(&current);
            let state = StoredState::of(&current);
            let (rev, ancestry) = match stored_revision(fields) {
                Some(rev) => (rev, state.ancestry.clone()),
                None => {
                    let rev = RevisionId::next_after(Some(state.counted_generation()))?;
                    (rev, PackedAncestry::extend(None, &rev, self.config.revs_limit))
                }
            };
            let mut stamp = Map::new();
            stamp.insert(codec::ID.into(), json!({ "stringValue": id }));
            layout::stamp(&mut stamp, &rev, &ancestry, state.deleted);
            let write = json!({
                "update": { "name": self.client.document_name(&document_id), "fields": stamp },
                "updateMask": { "fieldPaths": [codec::ID, REV, REVS, DELETED] },
                "updateTransforms": layout::changed_at_transform(),
                "currentDocument": { "updateTime": text(&current, "/updateTime") },
            });
            match self.commit(vec![write], &format!("upgrade document {id:?}")).await {
                Ok(_) => return Ok(true),
                // Another writer got there first: look again.
                Err(e) if matches!(e.kind(), ErrorKind::Conflict | ErrorKind::NotFound) => {
                    let name = self.client.document_name(&document_id);
                    let reply =
                        self.batch_get_fields(&[name], Some(&FEED_FIELDS), "read a document to upgrade").await?;
                    match reply.as_array().into_iter().flatten().find_map(|entry| entry.get("found")) {
                        Some(found) => current = found.clone(),
                        None => return Ok(false),
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Err(Error::new(
            ErrorKind::Unavailable,
            format!("document {document_id:?} kept changing during the upgrade; run it again"),
        ))
    }
}
