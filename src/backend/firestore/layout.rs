//! The document model's fields on a Firestore document (see `docs/firestore-layout.md`): the
//! stored revision `_rev` (`N-<32 hex>`), the packed ancestry `_revs`, the tombstone flag
//! `_deleted` and the feed position `_changedAt` (the server's request time, set by a field
//! transform). Documents written by the previous release have none of them: their revision is
//! still read as `updateTime[;N]` until they are rewritten or upgraded.

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use serde_json::{json, Map, Value};

use super::codec;
pub(super) use super::codec::{CHANGED_AT, DELETED, REV, REVS};
use crate::backend::revision::{PackedAncestry, RevisionId};
use crate::backend::{Ancestry, Revision, RevisionInfo};

/// The fields a conditional write needs to read of the current document.
pub const STATE_FIELDS: [&str; 5] = [codec::ID, REV, REVS, DELETED, codec::CHUNKS];

/// What a write must know of the document it replaces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredState {
    /// The Firestore `updateTime`: the precondition of the write that replaces this version.
    pub update_time: String,
    pub rev: Revision,
    /// `None` for a previous-release revision (`updateTime[;N]`), which counts as generation 1.
    pub generation: Option<u64>,
    pub ancestry: PackedAncestry,
    pub deleted: bool,
    /// Chunk documents of this version.
    pub chunks: usize,
}

impl StoredState {
    /// The state of a Firestore document (all fields, or at least [`STATE_FIELDS`]).
    pub fn of(document: &Value) -> StoredState {
        let empty = Map::new();
        let fields = document.get("fields").and_then(Value::as_object).unwrap_or(&empty);
        let update_time = document.get("updateTime").and_then(Value::as_str).unwrap_or("").to_owned();
        let chunks = codec::chunk_count(fields);
        let stored = stored_revision(fields);
        match stored {
            Some(rev) => StoredState {
                update_time,
                rev: rev.to_revision(),
                generation: Some(rev.generation),
                ancestry: stored_ancestry(fields),
                deleted: is_tombstone(fields),
                chunks,
            },
            None => StoredState::legacy(&update_time, chunks),
        }
    }

    /// The state a previous-release revision stands for: no read needed, its text says it all.
    pub fn legacy(update_time: &str, chunks: usize) -> StoredState {
        StoredState {
            update_time: update_time.to_owned(),
            rev: legacy_revision(update_time, chunks),
            generation: None,
            ancestry: PackedAncestry::default(),
            deleted: false,
            chunks,
        }
    }

    /// The generation of this version, a previous-release revision counting as generation 1.
    pub fn counted_generation(&self) -> u64 {
        self.generation.unwrap_or(1)
    }

    pub fn info(&self) -> RevisionInfo {
        let ancestry = match self.generation {
            Some(generation) if !self.ancestry.is_empty() => self.ancestry.unpack(generation),
            // A previous-release revision has no generation; it stands as generation 1.
            _ => Ancestry { start: self.generation.unwrap_or(1), ids: vec![self.rev_suffix()] },
        };
        RevisionInfo { rev: self.rev.clone(), deleted: self.deleted, ancestry }
    }

    pub(super) fn rev_suffix(&self) -> String {
        match self.generation {
            Some(_) => self.rev.as_str().split_once('-').map_or("", |(_, hex)| hex).to_owned(),
            None => self.rev.as_str().to_owned(),
        }
    }
}

/// The previous release's revision: the `updateTime`, plus `;N` with N chunk documents.
pub fn legacy_revision(update_time: &str, chunks: usize) -> Revision {
    if chunks == 0 {
        Revision(update_time.to_owned())
    } else {
        Revision(format!("{update_time};{chunks}"))
    }
}

/// A previous-release revision split into its `updateTime` and chunk count; `None` for any other
/// text.
pub fn parse_legacy(rev: &Revision, max_chunks: usize) -> Option<(&str, usize)> {
    let (time, chunks) = match rev.as_str().split_once(';') {
        Some((time, chunks)) => (time, chunks.parse().ok().filter(|n| *n <= max_chunks)?),
        None => (rev.as_str(), 0),
    };
    chrono::DateTime::parse_from_rfc3339(time).ok()?;
    Some((time, chunks))
}

/// The stored `_rev`, when the document has this layout.
pub fn stored_revision(fields: &Map<String, Value>) -> Option<RevisionId> {
    fields.get(REV).and_then(|v| v.get("stringValue")).and_then(Value::as_str).and_then(RevisionId::parse)
}

fn stored_ancestry(fields: &Map<String, Value>) -> PackedAncestry {
    let packed = fields
        .get(REVS)
        .and_then(|v| v.get("bytesValue"))
        .and_then(Value::as_str)
        .and_then(|b| BASE64.decode(b).ok())
        .map(PackedAncestry)
        .unwrap_or_default();
    if packed.is_well_formed() {
        packed
    } else {
        PackedAncestry::default()
    }
}

pub fn is_tombstone(fields: &Map<String, Value>) -> bool {
    fields.get(DELETED).and_then(|v| v.get("booleanValue")).and_then(Value::as_bool) == Some(true)
}

/// Whether a document has every field of this layout (the upgrade's test).
pub fn has_layout(fields: &Map<String, Value>) -> bool {
    stored_revision(fields).is_some()
        && fields.contains_key(DELETED)
        && fields.contains_key(CHANGED_AT)
        && fields.contains_key(codec::ID)
}

/// Adds the model's fields for revision `rev` (its ancestry `ancestry`) to a document's fields.
pub fn stamp(fields: &mut Map<String, Value>, rev: &RevisionId, ancestry: &PackedAncestry, deleted: bool) {
    fields.insert(REV.into(), json!({ "stringValue": rev.to_revision().0 }));
    fields.insert(REVS.into(), json!({ "bytesValue": BASE64.encode(&ancestry.0) }));
    fields.insert(DELETED.into(), json!({ "booleanValue": deleted }));
}

/// The field transform every write carries: `_changedAt` = the server's time of the request.
pub fn changed_at_transform() -> Value {
    json!([{ "fieldPath": CHANGED_AT, "setToServerValue": "REQUEST_TIME" }])
}

/// The fields of a tombstone: the id, the revision and ancestry, nothing of the body.
pub fn tombstone_fields(id: &str, rev: &RevisionId, ancestry: &PackedAncestry) -> Map<String, Value> {
    let mut fields = Map::new();
    fields.insert(codec::ID.into(), json!({ "stringValue": id }));
    stamp(&mut fields, rev, ancestry, true);
    fields
}

/// The fields a deletion carried, gzip-compressed JSON in a `bytesValue`, on a tombstone that
/// has any (not the body's own fields: a tombstone matches no query).
pub const DELETED_BODY: &str = "_deletedBody";

/// The field holding the fields a deletion carried; `None` when it carried none (`TooLarge`
/// past [`crate::backend::raw::compressed::MAX_TOMBSTONE_BODY_BYTES`] compressed).
pub fn deleted_body_field(id: &str, body: &Map<String, Value>) -> crate::error::Result<Option<Value>> {
    let compressed = crate::backend::raw::compressed::compress_deletion(id, body, "Firestore")?;
    Ok(compressed.map(|bytes| json!({ "bytesValue": BASE64.encode(bytes) })))
}

/// The fields a tombstone's deletion carried (empty when none).
pub fn deleted_body(id: &str, fields: &Map<String, Value>) -> crate::error::Result<Map<String, Value>> {
    let corrupt = |problem: &str| {
        crate::error::Error::new(crate::error::ErrorKind::Corrupt, format!("Firestore tombstone {id:?} {problem}"))
    };
    let Some(field) = fields.get(DELETED_BODY) else { return Ok(Map::new()) };
    let bytes = field
        .get("bytesValue")
        .and_then(Value::as_str)
        .and_then(|text| BASE64.decode(text).ok())
        .ok_or_else(|| corrupt(&format!("has a {DELETED_BODY} that is not base64 bytes")))?;
    crate::backend::raw::compressed::decompress(bytes, &[], corrupt)
}

/// What the feed and the upgrade read of each document.
pub(super) const FEED_FIELDS: [&str; 6] = [codec::ID, REV, REVS, DELETED, CHANGED_AT, codec::CHUNKS];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(super) fn states_read_both_layouts() {
        let rev = RevisionId::next_after(Some(4)).unwrap();
        let ancestry = PackedAncestry::extend(None, &rev, 10);
        let mut fields = tombstone_fields("u:n:k", &rev, &ancestry);
        fields.insert(CHANGED_AT.into(), json!({ "timestampValue": "2026-01-01T00:00:00Z" }));
        let state = StoredState::of(&json!({ "fields": fields, "updateTime": "2026-01-01T00:00:00.1Z" }));
        assert_eq!((state.generation, state.deleted, state.rev.clone()), (Some(5), true, rev.to_revision()));
        assert_eq!(state.info().ancestry.revisions().collect::<Vec<_>>(), [rev.to_revision()]);
        assert!(has_layout(&fields));

        let old = json!({ "fields": { "_id": { "stringValue": "x" }, "_chunks": { "integerValue": "2" } },
                          "updateTime": "2026-01-01T00:00:00.5Z" });
        let state = StoredState::of(&old);
        assert_eq!(state.rev, Revision("2026-01-01T00:00:00.5Z;2".into()));
        assert_eq!((state.generation, state.counted_generation(), state.chunks), (None, 1, 2));
        assert_eq!(parse_legacy(&state.rev, 8), Some(("2026-01-01T00:00:00.5Z", 2)));
        assert_eq!(parse_legacy(&rev.to_revision(), 8), None);
        assert!(!has_layout(old["fields"].as_object().unwrap()));
    }
}
