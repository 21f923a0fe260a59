//! Attachment chunks on the embedded store: the `attachment_chunks` table, `(blob, index)` →
//! the chunk's raw bytes. A table of its own, so no listing, feed, count, scan or local-document
//! read ever meets a chunk; a database's chunks live in its own file and go when the catalog
//! deletes the file. `erase_prefix` erases documents by id and leaves chunks alone: a blob is no
//! document, and the blobs no document references any more are freed by the attachment store's
//! garbage collection ([`crate::database::attachments`]).

use std::ops::Bound;

use bytes::Bytes;
use redb::{Database, ReadableDatabase, ReadableTable};

use super::core::ATTACHMENT_CHUNKS;
use super::error::map_redb;
use super::write::Tables;
use crate::backend::Page;
use crate::error::Result;

/// Bytes per chunk: 1 MiB. A chunk is read and written whole, so this is what one read or write
/// of an attachment holds in memory; large enough that the per-record cost (a B-tree entry, a
/// commit's share) is small next to the bytes, small enough that a range read of a few bytes
/// reads little more than it returns. redb keeps such values in overflow pages of their own.
pub(super) const CHUNK_BYTES: usize = 1 << 20;

/// How many documents' worth of a write transaction one chunk counts as in a group commit: a
/// chunk is far larger than a document, and a transaction keeps every page it changes in memory
/// until it commits, so a group holds at most 16 chunks (16 MiB) however many uploads run.
pub(super) const CHUNK_WEIGHT: usize = super::group_commit::MAX_GROUP_DOCUMENTS / 16;

/// Chunks removed per write transaction when a blob is deleted.
pub(super) const DELETE_BATCH: usize = 64;

/// Stores one chunk, replacing what was there.
pub(super) fn put(tables: &mut Tables<'_>, blob: &str, index: u64, bytes: &[u8]) -> Result<()> {
    tables.attachment_chunks.insert((blob, index), bytes).map_err(map_redb("write an attachment chunk"))?;
    Ok(())
}

/// One chunk, read in a read transaction.
pub(super) fn get(db: &Database, blob: &str, index: u64) -> Result<Option<Bytes>> {
    let txn = db.begin_read().map_err(map_redb("begin read"))?;
    let chunks = txn.open_table(ATTACHMENT_CHUNKS).map_err(map_redb("open attachment table"))?;
    let found = chunks.get((blob, index)).map_err(map_redb("read an attachment chunk"))?;
    Ok(found.map(|guard| Bytes::copy_from_slice(guard.value())))
}

/// Removes up to [`DELETE_BATCH`] chunks of `blob`; how many.
pub(super) fn delete_batch(tables: &mut Tables<'_>, blob: &str) -> Result<u64> {
    let mut indexes = Vec::with_capacity(DELETE_BATCH);
    for entry in tables
        .attachment_chunks
        .range::<(&str, u64)>((blob, 0)..=(blob, u64::MAX))
        .map_err(map_redb("find attachment chunks"))?
    {
        if indexes.len() == DELETE_BATCH {
            break;
        }
        indexes.push(entry.map_err(map_redb("find attachment chunks"))?.0.value().1);
    }
    for index in &indexes {
        tables.attachment_chunks.remove((blob, *index)).map_err(map_redb("delete an attachment chunk"))?;
    }
    Ok(indexes.len() as u64)
}

/// Up to `limit` blob names after `after`, in byte order: one seek per blob, past its last
/// possible chunk, so a blob's chunks are never read through.
pub(super) fn list(db: &Database, after: Option<String>, limit: usize) -> Result<Page<String>> {
    let txn = db.begin_read().map_err(map_redb("begin read"))?;
    let chunks = txn.open_table(ATTACHMENT_CHUNKS).map_err(map_redb("open attachment table"))?;
    let mut items: Vec<String> = Vec::with_capacity(limit.min(1024));
    let mut from = after;
    loop {
        let lower = match &from {
            Some(blob) => Bound::Excluded((blob.as_str(), u64::MAX)),
            None => Bound::Unbounded,
        };
        let next = chunks
            .range::<(&str, u64)>((lower, Bound::Unbounded))
            .map_err(map_redb("list attachment blobs"))?
            .next()
            .transpose()
            .map_err(map_redb("list attachment blobs"))?
            .map(|(key, _)| key.value().0.to_owned());
        let Some(blob) = next else { return Ok(Page { items, next: None }) };
        if items.len() == limit {
            // Another blob follows this page.
            return Ok(Page { next: items.last().cloned(), items });
        }
        items.push(blob.clone());
        from = Some(blob);
    }
}
