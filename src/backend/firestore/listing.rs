//! The document model's listings and housekeeping on Firestore: the change feed (`_changedAt`
//! order at one read time), id order (`_id` order among live documents), erasure by id prefix,
//! local documents (the `{collection}_local` collection), and the layout marker and upgrade
//! (`{collection}_meta/layout`). See `docs/firestore-layout.md`.

use std::sync::atomic::Ordering;

use futures::{stream, StreamExt, TryStreamExt};
use serde_json::{json, Map, Value};

use super::backend::FirestoreBackend;
use super::codec;
use super::feed::{FeedToken, Sweep};
use super::model::{self, StoredState};
use crate::backend::revision::{next_local_revision, PackedAncestry, RevisionId};
use crate::backend::{
    needs_upgrade, Change, ChangesPage, DocumentBackend, IdRange, LayoutState, Page, Precondition, Revision,
    StoredDocument, UpgradePage, LOCAL_PREFIX,
};
use crate::error::{Error, ErrorKind, Result};

/// The layout marker's document and the version this release writes.
const LAYOUT_DOCUMENT: &str = "layout";
const LAYOUT_VERSION: i64 = 2;
/// The largest page the feed, id order and upgrade read at once.
const MAX_PAGE: usize = 10_000;
/// Documents erased per query and commit (Firestore's limit on one commit is 500 writes; a
/// document may take several with its chunks).
const ERASE_PAGE: usize = 100;
/// Upgrade stamps in flight at once, and tries of a stamp that meets a concurrent write.
const UPGRADE_CONCURRENCY: usize = 16;
const UPGRADE_TRIES: usize = 3;
/// Tries of a local-document write with no precondition that keeps meeting other writers.
const LOCAL_TRIES: usize = 5;
/// What the feed and the upgrade read of each document.
const FEED_FIELDS: [&str; 6] = [codec::ID, model::REV, model::REVS, model::DELETED, model::CHANGED_AT, codec::CHUNKS];

fn field_filter(field: &str, op: &str, value: Value) -> Value {
    json!({ "fieldFilter": { "field": { "fieldPath": field }, "op": op, "value": value } })
}

fn all_of(filters: Vec<Value>) -> Value {
    if filters.len() == 1 {
        filters.into_iter().next().unwrap_or(Value::Null)
    } else {
        json!({ "compositeFilter": { "op": "AND", "filters": filters } })
    }
}

fn select(fields: &[&str]) -> Value {
    json!({ "fields": fields.iter().map(|f| json!({ "fieldPath": f })).collect::<Vec<_>>() })
}

fn fields_of(document: &Value) -> &Map<String, Value> {
    static EMPTY: std::sync::OnceLock<Map<String, Value>> = std::sync::OnceLock::new();
    document.get("fields").and_then(Value::as_object).unwrap_or_else(|| EMPTY.get_or_init(Map::new))
}

fn text<'a>(document: &'a Value, pointer: &str) -> &'a str {
    document.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

/// The revision of a local document: `0-N`.
impl FirestoreBackend {
    fn name_of_document<'a>(&self, document: &'a Value) -> &'a str {
        let name = text(document, "/name");
        self.client.document_id_of(name).unwrap_or(name)
    }

    /// The composite id a stored document stands for.
    fn id_of(&self, document: &Value) -> String {
        let document_id = self.name_of_document(document);
        match codec::stored_id(fields_of(document)) {
            Some(id) => id.to_owned(),
            None => codec::composite_id(document_id).unwrap_or_else(|| document_id.to_owned()),
        }
    }

    // ---------------------------------------------------------------------------------------
    // The change feed.
    // ---------------------------------------------------------------------------------------

    pub(super) async fn feed_page(&self, since: Option<&str>, limit: usize) -> Result<ChangesPage> {
        self.require_layout("the change feed").await?;
        let token = since.map(FeedToken::parse).transpose()?.unwrap_or_default();
        let limit = limit.clamp(1, MAX_PAGE);
        let settle = chrono::Duration::from_std(self.config.settle).unwrap_or(chrono::Duration::zero());
        // A sweep that begins at a floor first re-reads the window below it whole, so the writes
        // already reported there (skipped) do not fill the caller's page: with them counted, a
        // window holding more writes than a page never let a sweep end in one page, and so never
        // let a reader with small pages learn that it had reached the present until the window
        // had passed.
        if let (None, Some(floor)) = (&token.sweep, &token.floor) {
            if let Some(page) = self.feed_page_from_floor(&token, floor, settle, limit).await? {
                return Ok(page);
            }
        }
        let mut query = self.feed_query(limit);
        if let Some(lowest) = token.lowest_changed_at(settle) {
            query["where"] =
                field_filter(model::CHANGED_AT, "GREATER_THAN_OR_EQUAL", json!({ "timestampValue": lowest }));
        }
        if let Some(sweep) = &token.sweep {
            query["startAt"] = json!({ "values": [
                { "timestampValue": sweep.changed_at },
                { "referenceValue": self.client.document_name(&sweep.document_id) }
            ], "before": false });
        }
        let snapshot = token.sweep.as_ref().map(|s| s.snapshot.clone());
        let answer = self.run_raw_query(&query, snapshot.as_deref(), "read the change feed").await?;
        let snapshot = snapshot
            .or(answer.read_time)
            .ok_or_else(|| super::error::bad_body("read the change feed", "runQuery answered no readTime"))?;
        let full = answer.documents.len() >= limit;
        let mut changes = Vec::with_capacity(answer.documents.len());
        let last = self.sweep_changes(&token, &snapshot, &answer.documents, limit, &mut changes);
        let last_seq = match last {
            Some(position) if full => position,
            // The sweep reached the end: everything committed by its read time is reported.
            _ => FeedToken::after_sweep(&snapshot).render(),
        };
        // A full query page leaves the sweep open, however many of its documents were reported
        // already and dropped: more may follow. A sweep resumed from a token ends at the snapshot
        // it began with, which may be long past (a replicator resumes from a row's `seq` and
        // stops at the first empty answer): only a sweep that began with this read reaches the
        // present. So the end of a resumed sweep is not the end of the feed; the next read, from
        // its floor, starts a sweep at the current time.
        let at_present = !full && token.sweep.is_none();
        // Nothing is held back: a sweep reads everything committed by its snapshot, so the
        // floor after it is safe to resume from (the settle window only reaches back below it).
        Ok(ChangesPage { changes, last_seq, pending: if at_present { Some(0) } else { None }, unsettled: 0 })
    }

    /// The feed query in (`_changedAt`, `__name__`) order, without filter or cursor.
    fn feed_query(&self, limit: usize) -> Value {
        json!({
            "select": select(&FEED_FIELDS),
            "from": [{ "collectionId": self.client.collection() }],
            "orderBy": [
                { "field": { "fieldPath": model::CHANGED_AT }, "direction": "ASCENDING" },
                { "field": { "fieldPath": "__name__" }, "direction": "ASCENDING" }
            ],
            "limit": limit,
        })
    }

    /// Appends the changes among `documents` (one sweep's, at `snapshot`) not reported before
    /// `token`, until `changes` holds `limit`; the position of the last document looked at.
    fn sweep_changes(
        &self,
        token: &FeedToken,
        snapshot: &str,
        documents: &[Value],
        limit: usize,
        changes: &mut Vec<Change>,
    ) -> Option<String> {
        let mut last = None;
        for document in documents {
            if changes.len() >= limit {
                break;
            }
            let position = FeedToken {
                floor: token.floor.clone(),
                sweep: Some(Sweep {
                    snapshot: snapshot.to_owned(),
                    changed_at: text(document, &format!("/fields/{}/timestampValue", model::CHANGED_AT)).to_owned(),
                    document_id: self.name_of_document(document).to_owned(),
                }),
            }
            .render();
            // Committed at or before the floor: the sweep that set the floor reported it.
            if !token.reported(text(document, "/updateTime")) {
                let state = StoredState::of(document);
                changes.push(Change {
                    seq: position.clone(),
                    id: self.id_of(document),
                    rev: state.rev,
                    deleted: state.deleted,
                });
            }
            last = Some(position);
        }
        last
    }

    /// A sweep beginning at `floor`, at one snapshot: the window `[floor - W, floor]` read whole
    /// (up to [`MAX_PAGE`] documents), then what changed after the floor, up to the page. `None`
    /// when the window holds more than that: the caller sweeps it page by page instead.
    async fn feed_page_from_floor(
        &self,
        token: &FeedToken,
        floor: &str,
        settle: chrono::Duration,
        limit: usize,
    ) -> Result<Option<ChangesPage>> {
        let Some(lowest) = token.lowest_changed_at(settle) else { return Ok(None) };
        let mut window = self.feed_query(MAX_PAGE);
        window["where"] = all_of(vec![
            field_filter(model::CHANGED_AT, "GREATER_THAN_OR_EQUAL", json!({ "timestampValue": lowest })),
            field_filter(model::CHANGED_AT, "LESS_THAN_OR_EQUAL", json!({ "timestampValue": floor })),
        ]);
        let doing = "read the change feed";
        let answer = self.run_raw_query(&window, None, doing).await?;
        if answer.documents.len() >= MAX_PAGE {
            return Ok(None);
        }
        let snapshot =
            answer.read_time.ok_or_else(|| super::error::bad_body(doing, "runQuery answered no readTime"))?;
        let mut changes = Vec::new();
        let mut last = self.sweep_changes(token, &snapshot, &answer.documents, limit, &mut changes);
        // A page filled inside the window (writes that committed late, rare): the sweep goes on
        // from the last of them.
        let mut full = changes.len() >= limit;
        if changes.len() < limit {
            let mut after = self.feed_query(limit - changes.len());
            after["where"] = field_filter(model::CHANGED_AT, "GREATER_THAN", json!({ "timestampValue": floor }));
            let later = self.run_raw_query(&after, Some(&snapshot), doing).await?;
            full = later.documents.len() >= limit - changes.len();
            if let Some(position) = self.sweep_changes(token, &snapshot, &later.documents, limit, &mut changes) {
                last = Some(position);
            }
        }
        let (last_seq, pending) = match last {
            Some(position) if full => (position, None),
            _ => (FeedToken::after_sweep(&snapshot).render(), Some(0)),
        };
        Ok(Some(ChangesPage { changes, last_seq, pending, unsettled: 0 }))
    }

    pub(super) async fn feed_position(&self) -> Result<String> {
        self.require_layout("the change feed").await?;
        let name = self.client.name_in(&self.client.meta_collection(), LAYOUT_DOCUMENT);
        let reply = self.batch_get_fields(&[name], Some(&["version"]), "read the time").await?;
        let read_time = reply
            .as_array()
            .into_iter()
            .flatten()
            .find_map(|entry| entry.get("readTime").and_then(Value::as_str))
            .ok_or_else(|| super::error::bad_body("read the time", "batchGet answered no readTime"))?;
        Ok(FeedToken::after_sweep(read_time).render())
    }

    // ---------------------------------------------------------------------------------------
    // Id order.
    // ---------------------------------------------------------------------------------------

    pub(super) async fn id_order_page(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> Result<Page<StoredDocument>> {
        self.require_layout("all_docs").await?;
        let limit = limit.clamp(1, MAX_PAGE);
        let (low_op, high_op, direction) = if range.descending {
            (
                "LESS_THAN_OR_EQUAL",
                if range.inclusive_end { "GREATER_THAN_OR_EQUAL" } else { "GREATER_THAN" },
                "DESCENDING",
            )
        } else {
            ("GREATER_THAN_OR_EQUAL", if range.inclusive_end { "LESS_THAN_OR_EQUAL" } else { "LESS_THAN" }, "ASCENDING")
        };
        let empty = match (&range.start, &range.end) {
            (Some(start), Some(end)) => {
                let (start, end) = (start.as_bytes(), end.as_bytes());
                if range.descending {
                    start < end || (start == end && !range.inclusive_end)
                } else {
                    start > end || (start == end && !range.inclusive_end)
                }
            }
            _ => false,
        };
        if empty {
            return Ok(Page { items: Vec::new(), next: None });
        }
        let mut filters = vec![field_filter(model::DELETED, "EQUAL", json!({ "booleanValue": false }))];
        if let Some(start) = &range.start {
            filters.push(field_filter(codec::ID, low_op, json!({ "stringValue": start })));
        }
        if let Some(end) = &range.end {
            filters.push(field_filter(codec::ID, high_op, json!({ "stringValue": end })));
        }
        let mut query = json!({
            "from": [{ "collectionId": self.client.collection() }],
            "where": all_of(filters),
            "orderBy": [{ "field": { "fieldPath": codec::ID }, "direction": direction }],
            "limit": limit,
        });
        if let Some(after) = page_token {
            query["startAt"] = json!({ "values": [{ "stringValue": after }], "before": false });
        }
        let answer = self.run_raw_query(&query, None, "list documents in id order").await?;
        let next = match answer.documents.last() {
            Some(last) if answer.documents.len() >= limit => Some(self.id_of(last)),
            _ => None,
        };
        let mut items = self.live_documents(&answer.documents, "list documents in id order").await?;
        // CouchDB leaves design documents out of `_all_docs`; they are never data here.
        items.retain(|doc| !doc.id.starts_with("_design/"));
        Ok(Page { items, next })
    }

    // ---------------------------------------------------------------------------------------
    // Erasure.
    // ---------------------------------------------------------------------------------------

    /// Deletes outright (no tombstone) every document whose `_id` starts with `prefix`, with its
    /// chunk documents: pages of `_id` order from `prefix`, until an id past the prefix.
    pub(super) async fn erase_ids_with_prefix(&self, prefix: &str) -> Result<u64> {
        let mut erased = 0;
        let mut after: Option<String> = None;
        loop {
            let mut query = json!({
                "select": select(&[codec::ID, codec::CHUNKS]),
                "from": [{ "collectionId": self.client.collection() }],
                "where": field_filter(codec::ID, "GREATER_THAN_OR_EQUAL", json!({ "stringValue": prefix })),
                "orderBy": [{ "field": { "fieldPath": codec::ID }, "direction": "ASCENDING" }],
                "limit": ERASE_PAGE,
            });
            if let Some(after) = &after {
                query["startAt"] = json!({ "values": [{ "stringValue": after }], "before": false });
            }
            let doing = format!("erase the documents whose ids start with {prefix:?}");
            let answer = self.run_raw_query(&query, None, &doing).await?;
            let full = answer.documents.len() >= ERASE_PAGE;
            let mut writes = Vec::new();
            let mut past_prefix = false;
            for document in &answer.documents {
                let id = self.id_of(document);
                if !id.starts_with(prefix) {
                    past_prefix = true;
                    break;
                }
                let document_id = self.name_of_document(document).to_owned();
                writes.push(json!({ "delete": self.client.document_name(&document_id) }));
                let chunks = codec::chunk_count(fields_of(document));
                writes.extend((1..=chunks).map(|n| json!({ "delete": self.client.chunk_name(&document_id, n) })));
                erased += 1;
                after = Some(id);
            }
            for group in writes.chunks(500) {
                self.commit(group.to_vec(), &doing).await?;
            }
            if past_prefix || !full {
                return Ok(erased);
            }
        }
    }

    // ---------------------------------------------------------------------------------------
    // Local documents.
    // ---------------------------------------------------------------------------------------

    fn local_name(&self, name: &str) -> String {
        self.client.name_in(&self.client.local_collection(), &codec::document_id(name))
    }

    /// The local document and its `updateTime`.
    pub(super) async fn read_local(&self, name: &str) -> Result<Option<(StoredDocument, String)>> {
        let doing = format!("read local document {name:?}");
        let reply = self.batch_get_fields(&[self.local_name(name)], None, &doing).await?;
        let Some(document) = reply.as_array().into_iter().flatten().find_map(|entry| entry.get("found")) else {
            return Ok(None);
        };
        let id = format!("{LOCAL_PREFIX}{name}");
        let fields = fields_of(document);
        let rev = text(document, &format!("/fields/{}/stringValue", model::REV)).to_owned();
        let body = codec::decode(&id, fields, &[])?;
        Ok(Some((StoredDocument { id, rev: Revision(rev), body }, text(document, "/updateTime").to_owned())))
    }

    pub(super) async fn write_local(
        &self,
        name: &str,
        body: &Map<String, Value>,
        precondition: Precondition,
    ) -> Result<Revision> {
        let id = format!("{LOCAL_PREFIX}{name}");
        let encoded = codec::encode(&id, body)?;
        if !encoded.extra_chunks.is_empty() {
            return Err(Error::new(
                ErrorKind::TooLarge,
                format!("local document {id:?} is over one Firestore document"),
            ));
        }
        for _ in 0..LOCAL_TRIES {
            // A create needs no read: the precondition `exists: false` is the check.
            let current = match precondition {
                Precondition::MustNotExist => None,
                _ => self.read_local(name).await?,
            };
            let rev = next_local_revision(&id, &precondition, current.as_ref().map(|(doc, _)| &doc.rev))?;
            let previous_update_time = current.map(|(_, update_time)| update_time);
            let mut fields = encoded.fields.clone();
            fields.insert(model::REV.into(), json!({ "stringValue": rev.0 }));
            let mut write = json!({ "update": { "name": self.local_name(name), "fields": fields } });
            write["currentDocument"] = match &previous_update_time {
                Some(update_time) => json!({ "updateTime": update_time }),
                None => json!({ "exists": false }),
            };
            match self.commit(vec![write], &format!("write local document {id:?}")).await {
                Ok(_) => return Ok(rev),
                Err(e) if matches!(e.kind(), ErrorKind::Conflict | ErrorKind::NotFound) => {
                    if precondition != Precondition::None {
                        return Err(Error::conflict(format!("local document {id:?} changed")).with_source(e));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Err(Error::new(ErrorKind::Unavailable, format!("local document {id:?} kept changing; try again")))
    }

    pub(super) async fn remove_local(&self, name: &str, rev: &Revision) -> Result<()> {
        let id = format!("{LOCAL_PREFIX}{name}");
        let Some((doc, update_time)) = self.read_local(name).await? else {
            return Err(Error::not_found(format!("local document {id:?} does not exist")));
        };
        if &doc.rev != rev {
            return Err(Error::conflict(format!("local document {id:?} is not at revision {rev}")));
        }
        let write = json!({ "delete": self.local_name(name), "currentDocument": { "updateTime": update_time } });
        match self.commit(vec![write], &format!("delete local document {id:?}")).await {
            Ok(_) => Ok(()),
            Err(e) if matches!(e.kind(), ErrorKind::Conflict | ErrorKind::NotFound) => {
                match self.read_local(name).await? {
                    None => Err(Error::not_found(format!("local document {id:?} does not exist"))),
                    Some(_) => Err(Error::conflict(format!("local document {id:?} changed")).with_source(e)),
                }
            }
            Err(e) => Err(e),
        }
    }

    // ---------------------------------------------------------------------------------------
    // Layout and upgrade.
    // ---------------------------------------------------------------------------------------

    fn layout_marker_name(&self) -> String {
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

    async fn require_layout(&self, feature: &str) -> Result<()> {
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
                "where": field_filter(model::DELETED, "EQUAL", json!({ "booleanValue": false })),
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
    async fn upgrade_document(&self, document: Value) -> Result<bool> {
        let document_id = self.name_of_document(&document).to_owned();
        let mut current = document;
        for _ in 0..UPGRADE_TRIES {
            let fields = fields_of(&current);
            if model::has_layout(fields) {
                return Ok(false);
            }
            let id = self.id_of(&current);
            let state = StoredState::of(&current);
            let (rev, ancestry) = match model::stored_revision(fields) {
                Some(rev) => (rev, state.ancestry.clone()),
                None => {
                    let rev = RevisionId::next_after(Some(state.counted_generation()))?;
                    (rev, PackedAncestry::extend(None, &rev, self.config.revs_limit))
                }
            };
            let mut stamp = Map::new();
            stamp.insert(codec::ID.into(), json!({ "stringValue": id }));
            model::stamp(&mut stamp, &rev, &ancestry, state.deleted);
            let write = json!({
                "update": { "name": self.client.document_name(&document_id), "fields": stamp },
                "updateMask": { "fieldPaths": [codec::ID, model::REV, model::REVS, model::DELETED] },
                "updateTransforms": model::changed_at_transform(),
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
