//! The document model's part of the table layout (docs/dynamodb-layout.md): the attributes that
//! carry revisions, ancestry, tombstones and feed positions, the two sharded indexes (the change
//! feed and id order) and the layout marker's item. Creating the indexes and upgrading a table
//! written by the previous release are in `upgrade.rs`.

use std::time::{SystemTime, UNIX_EPOCH};

use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, GlobalSecondaryIndex, IndexStatus, KeySchemaElement, KeyType, Projection,
    ProjectionType, ScalarAttributeType, TableDescription,
};
use sha2::{Digest, Sha256};

use super::codec::{self, Item};
use crate::backend::LOCAL_PREFIX;
use crate::error::{Error, ErrorKind, Result};

/// The packed revision ancestry (16 bytes a revision, newest first).
/// The blob an attachment chunk item belongs to; its presence marks the item as a chunk
/// (`attachments.rs`).
pub const ATTACHMENT_OF: &str = "_attachmentOf";
pub const ANCESTRY: &str = "_anc";
/// `true` on a tombstone.
pub const DELETED: &str = "_deleted";
/// The fields a deletion carried, gzip-compressed JSON, on a tombstone that has any. Not native
/// attributes: a tombstone must stay out of the `userId`/`namespace` index.
pub const DELETED_BODY: &str = "_deletedBody";
/// The document's shard: hash key of both document-model indexes.
pub const SHARD: &str = "_shard";
/// The feed position of the document's latest write.
pub const SEQ: &str = "_seq";
/// The kind of a bookkeeping item (the layout marker); scans and reads skip such items.
pub const META: &str = "_meta";
/// The JSON text of a local document's body.
pub const LOCAL_BODY: &str = "_json";
/// The layout marker's version and shard count.
pub(super) const VERSION: &str = "version";
pub(super) const SHARDS: &str = "shards";
/// A database table's creation id on its layout marker: drawn when the database is created, so
/// every instance tells one incarnation of a name from the next with one consistent read
/// (`catalog.rs`).
pub(super) const CREATION: &str = "creation";
/// Set on a database table's layout marker when the database is deleted, before DeleteTable: the
/// database is gone for every instance from then on, while the table is still being deleted.
pub(super) const DROPPED: &str = "dropped";

/// The change feed's index: hash `_shard`, range `_seq`.
pub const FEED_INDEX: &str = "agentstore-feed";
/// The id-order index: hash `_shard`, range `_id`.
pub const ID_INDEX: &str = "agentstore-ids";
/// How many shards the indexes are split into. Part of the layout: every process of a table must
/// agree, so it is recorded in the layout marker.
pub const SHARD_COUNT: u32 = 16;
/// The first of the shards that hold local documents (`_local/…`) in the id index: a local
/// document's `_shard` is this plus [`shard_of`] its id, so local documents sit in the id index
/// under hash keys of their own, never in the shards `0..SHARD_COUNT` that `all_docs`, erasure
/// and counts read, and `local_docs` reads only these (spread over [`SHARD_COUNT`] keys like the
/// documents, so a burst of local writes, such as a database's deletion trees, is no hot
/// partition). Local documents have no `_seq`, so the feed index never holds them.
pub const LOCAL_SHARD_BASE: u32 = SHARD_COUNT;
/// The layout this release writes.
pub const LAYOUT_VERSION: u32 = 2;
/// The layout marker's id: `_agentstore/` is no data-store id (those are `user:namespace:key`)
/// and no local document's (`_local/`).
pub const MARKER_ID: &str = "_agentstore/layout";

/// The shard of an id: the first 4 bytes of its SHA-256, modulo [`SHARD_COUNT`]. Part of the
/// layout (a reader finds an id's entries only in its shard), so it never changes.
pub fn shard_of(id: &str) -> u32 {
    let digest = Sha256::digest(id.as_bytes());
    u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]) % SHARD_COUNT
}

/// The id-index shard of a local document's id ([`LOCAL_SHARD_BASE`]).
pub fn local_shard_of(id: &str) -> u32 {
    LOCAL_SHARD_BASE + shard_of(id)
}

/// Milliseconds since the epoch by this machine's clock.
pub fn now_millis() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// A fresh feed position: 13 zero-padded milliseconds of the writer's clock, then 8 hex digits of
/// a counter of this process and 8 random ones. Within one process positions only grow (the
/// milliseconds never go below the last ones stamped, and the counter orders stamps of the same
/// millisecond), so one writer's writes are fed in the order it made them; between processes,
/// positions of the same millisecond differ (random digits) and their order is arbitrary but
/// fixed.
pub fn new_position() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static LAST_MILLIS: AtomicU64 = AtomicU64::new(0);
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let now = now_millis();
    let millis = LAST_MILLIS.fetch_max(now, Ordering::SeqCst).max(now);
    let count = COUNTER.fetch_add(1, Ordering::SeqCst) as u32;
    let random = &crate::backend::random_token()[..8];
    format!("{millis:013}{count:08x}{random}")
}

/// The largest millisecond count a position holds (13 digits): the bound made from it sorts
/// after every position.
pub const MAX_POSITION_MILLIS: u64 = 9_999_999_999_999;

/// The feed position that sorts after every position stamped at or before `millis`.
pub fn position_after_millis(millis: u64) -> String {
    format!("{millis:013}g")
}

/// Checks a `since` token: a position [`new_position`] or [`position_after_millis`] made.
pub fn check_position(token: &str) -> Result<()> {
    let (millis, rest) = token.split_at_checked(13).unwrap_or(("", ""));
    let millis_ok = millis.len() == 13 && millis.bytes().all(|b| b.is_ascii_digit());
    let rest_ok = rest == "g" || (rest.len() == 16 && rest.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')));
    if millis_ok && rest_ok {
        Ok(())
    } else {
        Err(Error::invalid("since", format!("{token:?} is not a change feed position of this DynamoDB backend")))
    }
}

/// Whether an item is no document of the data store: a body chunk, an attachment chunk, a local
/// document or bookkeeping.
pub fn is_hidden(item: &Item) -> bool {
    codec::is_chunk(item)
        || item.contains_key(ATTACHMENT_OF)
        || item.contains_key(META)
        || codec::string_attribute(item, codec::ID).is_some_and(|id| id.starts_with(LOCAL_PREFIX))
}

pub fn is_tombstone(item: &Item) -> bool {
    matches!(item.get(DELETED), Some(AttributeValue::Bool(true)))
}

/// The attribute holding the fields a deletion carried; `None` when it carried none (`TooLarge`
/// past [`crate::backend::raw::compressed::MAX_TOMBSTONE_BODY_BYTES`] compressed).
pub fn deleted_body_attribute(
    id: &str,
    body: &serde_json::Map<String, serde_json::Value>,
) -> Result<Option<AttributeValue>> {
    let compressed = crate::backend::raw::compressed::compress_deletion(id, body, "DynamoDB")?;
    Ok(compressed.map(|bytes| AttributeValue::B(aws_sdk_dynamodb::primitives::Blob::new(bytes))))
}

/// The fields a tombstone's deletion carried (empty when none).
pub fn deleted_body(id: &str, item: &Item) -> Result<serde_json::Map<String, serde_json::Value>> {
    match item.get(DELETED_BODY) {
        Some(AttributeValue::B(bytes)) => {
            crate::backend::raw::compressed::decompress(bytes.as_ref().to_vec(), &[], |problem| {
                Error::new(ErrorKind::Corrupt, format!("DynamoDB tombstone {id:?} {problem}"))
            })
        }
        Some(_) => Err(Error::new(
            ErrorKind::Corrupt,
            format!("DynamoDB tombstone {id:?} has a {DELETED_BODY} that is not binary"),
        )),
        None => Ok(serde_json::Map::new()),
    }
}

/// The feed attributes a write stamps on an item: its shard and a fresh position.
pub fn stamp(item: &mut Item, id: &str) {
    item.insert(SHARD.into(), AttributeValue::N(shard_of(id).to_string()));
    item.insert(SEQ.into(), AttributeValue::S(new_position()));
}

pub(super) fn build_error(what: &str) -> impl Fn(aws_sdk_dynamodb::error::BuildError) -> Error + '_ {
    move |e| Error::new(ErrorKind::Internal, format!("build {what}")).with_source(e)
}

/// The attribute definitions the document-model indexes add to a table's.
pub fn index_attributes() -> Result<Vec<AttributeDefinition>> {
    [(SHARD, ScalarAttributeType::N), (SEQ, ScalarAttributeType::S)]
        .into_iter()
        .map(|(name, kind)| {
            AttributeDefinition::builder()
                .attribute_name(name)
                .attribute_type(kind)
                .build()
                .map_err(build_error("attribute definition"))
        })
        .collect()
}

/// The two index definitions: (name, hash key, range key, projected attributes).
pub(super) fn index_shapes() -> [(&'static str, &'static str, &'static str, [&'static str; 2]); 2] {
    [
        // A change needs the revision and whether it is a deletion; nothing else.
        (FEED_INDEX, SHARD, SEQ, [codec::REV, DELETED]),
        // An id listing skips tombstones and chunk items without reading them.
        (ID_INDEX, SHARD, codec::ID, [DELETED, codec::CHUNK_OF]),
    ]
}

pub(super) fn key(name: &str, kind: KeyType) -> Result<KeySchemaElement> {
    KeySchemaElement::builder().attribute_name(name).key_type(kind).build().map_err(build_error("key schema"))
}

pub(super) fn projection(attributes: [&str; 2]) -> Projection {
    Projection::builder()
        .projection_type(ProjectionType::Include)
        .set_non_key_attributes(Some(attributes.iter().map(|a| (*a).to_owned()).collect()))
        .build()
}

/// The document-model indexes, for CreateTable.
pub fn new_indexes() -> Result<Vec<GlobalSecondaryIndex>> {
    index_shapes()
        .into_iter()
        .map(|(name, hash, range, projected)| {
            GlobalSecondaryIndex::builder()
                .index_name(name)
                .key_schema(key(hash, KeyType::Hash)?)
                .key_schema(key(range, KeyType::Range)?)
                .projection(projection(projected))
                .build()
                .map_err(build_error("index definition"))
        })
        .collect()
}

/// Which document-model indexes a table description lacks (ACTIVE or being built counts as there).
pub fn missing_indexes(table: &TableDescription) -> Vec<&'static str> {
    [FEED_INDEX, ID_INDEX]
        .into_iter()
        .filter(|name| !table.global_secondary_indexes().iter().any(|g| g.index_name() == Some(*name)))
        .collect()
}

/// Whether every document-model index of the table is ACTIVE.
pub fn indexes_active(table: &TableDescription) -> bool {
    missing_indexes(table).is_empty()
        && table
            .global_secondary_indexes()
            .iter()
            .filter(|g| matches!(g.index_name(), Some(FEED_INDEX | ID_INDEX)))
            .all(|g| g.index_status() == Some(&IndexStatus::Active))
}

/// A page size as the SDK takes it.
pub(super) fn limit_of(limit: usize) -> i32 {
    i32::try_from(limit.max(1)).unwrap_or(i32::MAX)
}

pub(super) fn shard_value(shard: u32) -> AttributeValue {
    AttributeValue::N(shard.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_process_stamps_growing_positions() {
        let stamped: Vec<String> = (0..2000).map(|_| new_position()).collect();
        assert!(stamped.windows(2).all(|w| w[0] < w[1]), "positions of one process went back");
    }

    #[test]
    fn positions_sort_by_time_and_bounds_sort_after_their_millisecond() {
        let position = new_position();
        check_position(&position).unwrap();
        let millis: u64 = position[..13].parse().unwrap();
        assert!(position.as_str() < position_after_millis(millis).as_str());
        assert!(position_after_millis(millis - 1).as_str() < position.as_str());
        check_position(&position_after_millis(millis)).unwrap();
        for bad in ["", "g", "123", "0000000000000G", "000000000000x0123456789abcdef", &format!("{position}0")] {
            assert!(check_position(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn shards_spread_ids_evenly() {
        let mut counts = [0u32; SHARD_COUNT as usize];
        for n in 0..1600 {
            counts[shard_of(&format!("user:ns:{n}")) as usize] += 1;
        }
        assert!(counts.iter().all(|&c| c > 60), "{counts:?}");
    }
}
