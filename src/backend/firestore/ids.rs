//! Documents in id order (`_id` order among live documents), erasure by id prefix or of one id,
//! and the composite id of a stored document.

use serde_json::{json, Value};

use super::backend::FirestoreBackend;
use super::codec;
use super::core::{all_of, field_filter, fields_of, select, text, MAX_PAGE};
use super::layout::{self};
use crate::backend::{EraseOptions, IdRange, Page, StoredDocument};
use crate::error::{Error, Result};

/// Documents erased per query and commit (Firestore's limit on one commit is 500 writes; a
/// document may take several with its chunks).
pub(super) const ERASE_PAGE: usize = 100;

/// Writes in one commit at most (Firestore's limit).
const COMMIT_WRITES_MAX: usize = 500;

/// A structured query over `collection` in `_id` order through `range` (its direction and ends
/// as `_id` filters, besides `filters`), at most `limit` documents, after the `_id` `after`.
pub(super) fn id_range_query(
    collection: &str,
    range: &IdRange,
    mut filters: Vec<Value>,
    limit: usize,
    after: Option<&str>,
) -> Value {
    let (low_op, high_op, direction) = match (range.descending, range.inclusive_end) {
        (false, true) => ("GREATER_THAN_OR_EQUAL", "LESS_THAN_OR_EQUAL", "ASCENDING"),
        (false, false) => ("GREATER_THAN_OR_EQUAL", "LESS_THAN", "ASCENDING"),
        (true, true) => ("LESS_THAN_OR_EQUAL", "GREATER_THAN_OR_EQUAL", "DESCENDING"),
        (true, false) => ("LESS_THAN_OR_EQUAL", "GREATER_THAN", "DESCENDING"),
    };
    for (op, bound) in [(low_op, &range.start), (high_op, &range.end)] {
        if let Some(id) = bound {
            filters.push(field_filter(codec::ID, op, json!({ "stringValue": id })));
        }
    }
    let mut query = json!({
        "from": [{ "collectionId": collection }],
        "orderBy": [{ "field": { "fieldPath": codec::ID }, "direction": direction }],
        "limit": limit,
    });
    if !filters.is_empty() {
        query["where"] = all_of(filters);
    }
    if let Some(after) = after {
        query["startAt"] = json!({ "values": [{ "stringValue": after }], "before": false });
    }
    query
}

impl FirestoreBackend {
    pub(super) fn name_of_document<'a>(&self, document: &'a Value) -> &'a str {
        let name = text(document, "/name");
        self.client.document_id_of(name).unwrap_or(name)
    }

    /// The composite id a stored document stands for.
    pub(super) fn id_of(&self, document: &Value) -> String {
        let document_id = self.name_of_document(document);
        match codec::stored_id(fields_of(document)) {
            Some(id) => id.to_owned(),
            None => codec::composite_id(document_id).unwrap_or_else(|| document_id.to_owned()),
        }
    }

    pub(super) async fn id_order_page(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> Result<Page<StoredDocument>> {
        self.require_layout("all_docs").await?;
        let limit = limit.clamp(1, MAX_PAGE);
        if range.holds_nothing() {
            return Ok(Page { items: Vec::new(), next: None });
        }
        let live = field_filter(layout::DELETED, "EQUAL", json!({ "booleanValue": false }));
        let query = id_range_query(self.client.collection(), range, vec![live], limit, page_token);
        let answer = self.run_raw_query(&query, None, "list documents in id order").await?;
        let next = match answer.documents.last() {
            Some(last) if answer.documents.len() >= limit => Some(self.id_of(last)),
            _ => None,
        };
        let mut items = self.live_documents(&answer.documents, "list documents in id order").await?;
        // CouchDB leaves design documents out of `_all_docs`; they are never data here.
        if !range.include_design {
            items.retain(|doc| !doc.id.starts_with("_design/"));
        }
        Ok(Page { items, next })
    }

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
                writes.extend(self.erasing_writes(document));
                erased += 1;
                after = Some(id);
            }
            if !writes.is_empty() {
                // After the page's deletions (the last group): other processes' remembered counts
                // fail their check.
                writes.push(self.purge_trace_write());
            }
            self.commit_in_groups(&writes, &doing).await?;
            if past_prefix || !full {
                return Ok(erased);
            }
        }
    }

    /// Deletes outright (no tombstone) the document `id`, live or deleted, with its chunk
    /// documents, and no other: read by the name its id makes (its chunk count and revision),
    /// then deleted by that name; whether there was one. With `options.if_revision`, the
    /// revision read must be that one, and the deletion carries the `updateTime` read as its
    /// precondition, in the same commit as the chunks' deletions when they fit in one: a write
    /// that landed since makes it a `Conflict` and nothing is erased.
    pub(super) async fn erase_one_id(&self, id: &str, options: &EraseOptions) -> Result<bool> {
        let doing = format!("erase the document {id:?}");
        let name = self.client.document_name(&codec::document_id(id));
        let reply = self.batch_get_fields(&[name], Some(&layout::STATE_FIELDS), &doing).await?;
        let found = reply.as_array().into_iter().flatten().find_map(|entry| entry.get("found"));
        let mut writes = match (found, &options.if_revision) {
            (None, None) => return Ok(false),
            (None, Some(expected)) => {
                return Err(Error::conflict(format!(
                    "document {id:?} does not exist, not at revision {expected}: not erased"
                )))
            }
            (Some(document), _) => self.erasing_writes(document),
        };
        if let (Some(document), Some(expected)) = (found, &options.if_revision) {
            let state = layout::StoredState::of(document);
            if state.rev != *expected {
                let rev = state.rev;
                return Err(Error::conflict(format!(
                    "document {id:?} is at revision {rev}, not {expected}: not erased"
                )));
            }
            writes[0]["currentDocument"] = json!({ "updateTime": state.update_time });
        }
        // With the document's deletion: other processes' remembered counts fail their check.
        writes.insert(1, self.purge_trace_write());
        self.commit_in_groups(&writes, &doing).await.map_err(|err| match &options.if_revision {
            Some(expected) if err.is_conflict() || err.is_not_found() => {
                Error::conflict(format!("document {id:?} is no longer at revision {expected}: not erased"))
            }
            _ => err,
        })?;
        Ok(true)
    }

    /// Commits `writes` in as few commits as Firestore's limit on one allows.
    async fn commit_in_groups(&self, writes: &[Value], doing: &str) -> Result<()> {
        for group in writes.chunks(COMMIT_WRITES_MAX) {
            self.commit(group.to_vec(), doing).await?;
        }
        Ok(())
    }

    /// The writes that delete one stored document and its chunk documents.
    fn erasing_writes(&self, document: &Value) -> Vec<Value> {
        let document_id = self.name_of_document(document);
        let chunks = codec::chunk_count(fields_of(document));
        std::iter::once(json!({ "delete": self.client.document_name(document_id) }))
            .chain((1..=chunks).map(|n| json!({ "delete": self.client.chunk_name(document_id, n) })))
            .collect()
    }
}
