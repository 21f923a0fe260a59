//! Attachment chunks on DynamoDB: one item per chunk in the database's own table, raw bytes in a
//! binary attribute, found again through the id index under shards of their own.
//!
//! A chunk's item is `_id` = `_attachment/{blob}/{index as 16 hex digits}` (no document id
//! starts with `_` but `_design/` and `_local/`, so none collides), `_attachmentOf` = the blob,
//! `_data` = the bytes, and `_shard` = [`ATTACHMENT_SHARD_BASE`] plus the blob's shard. That
//! shard puts every chunk of a blob in one partition of the id index, in index order, where no
//! listing, count or erasure of documents looks (they read shards below
//! [`layout::LOCAL_SHARD_BASE`] + [`SHARD_COUNT`]); chunks carry no `_seq`, so the feed index
//! never holds them, and no `userId`, so the user index neither. Reads by id, batch reads,
//! scans and the upgrade skip them ([`layout::is_hidden`]). Deleting the database's table
//! removes them with everything else; `erase_prefix` erases documents only.

use std::collections::HashMap;

use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::{AttributeValue, DeleteRequest, WriteRequest};
use bytes::Bytes;
use serde_json::Value;

use super::backend::DynamoDbBackend;
use super::codec::{self, Item};
use super::error::{map_sdk, map_sdk_write};
use super::layout::{self, shard_value, ATTACHMENT_OF, ID_INDEX, SHARD, SHARD_COUNT};
use crate::backend::{check_attachment_blob, Page};
use crate::error::{Error, ErrorKind, Result};

/// The chunk's bytes.
const DATA: &str = "_data";
/// The first id-index shard of attachment chunks, past the documents' and the local documents'.
pub const ATTACHMENT_SHARD_BASE: u32 = layout::LOCAL_SHARD_BASE + SHARD_COUNT;
/// The prefix of every chunk item's id.
const ID_PREFIX: &str = "_attachment/";

/// Bytes per chunk: 384 KiB. An item is at most 400 KiB (409,600 bytes) counting every
/// attribute's name and value; the other attributes of a chunk item take about 150 bytes (an id
/// of at most 130), so 16 KiB is left to spare.
pub const CHUNK_BYTES: usize = 384 << 10;

/// Index entries read per query when listing blobs or a blob's chunks.
const LIST_PAGE: i32 = 500;

/// The id of chunk `index` of `blob`: hex digits of a fixed width, so id order is index order.
fn chunk_id(blob: &str, index: u64) -> String {
    format!("{ID_PREFIX}{blob}/{index:016x}")
}

/// The prefix of every chunk id of `blob`.
fn blob_prefix(blob: &str) -> String {
    format!("{ID_PREFIX}{blob}/")
}

/// The id just past every chunk of `blob` (`g` sorts after every hex digit).
fn past_blob(blob: &str) -> String {
    format!("{ID_PREFIX}{blob}/g")
}

/// The blob and index a chunk id names.
fn parse_chunk_id(id: &str) -> Option<(&str, u64)> {
    let (blob, index) = id.strip_prefix(ID_PREFIX)?.rsplit_once('/')?;
    Some((blob, u64::from_str_radix(index, 16).ok()?))
}

fn blob_shard(blob: &str) -> u32 {
    ATTACHMENT_SHARD_BASE + layout::shard_of(blob)
}

/// A listing's page token: the attachment shard (0-based) to read on and the id to read from
/// (inclusive) in it.
fn encode_token(shard: u32, from: &str) -> String {
    serde_json::json!([shard, from]).to_string()
}

fn decode_token(token: &str) -> Result<(u32, String)> {
    let bad = || Error::invalid("page token", "was not produced by this backend");
    let value: Value = serde_json::from_str(token).map_err(|_| bad())?;
    let shard = value.get(0).and_then(Value::as_u64).and_then(|n| u32::try_from(n).ok()).ok_or_else(bad)?;
    let from = value.get(1).and_then(Value::as_str).filter(|id| id.starts_with(ID_PREFIX)).ok_or_else(bad)?;
    if shard >= SHARD_COUNT {
        return Err(bad());
    }
    Ok((shard, from.to_owned()))
}

impl DynamoDbBackend {
    /// [`CHUNK_BYTES`], for the trait implementation.
    pub(super) fn attachment_chunk_size(&self) -> usize {
        CHUNK_BYTES
    }

    pub(super) async fn put_chunk(&self, blob: &str, index: u64, bytes: Bytes) -> Result<()> {
        check_attachment_blob(blob)?;
        if bytes.len() > CHUNK_BYTES {
            return Err(Error::new(
                ErrorKind::TooLarge,
                format!("an attachment chunk of {} bytes; DynamoDB items take at most {CHUNK_BYTES}", bytes.len()),
            ));
        }
        let item = HashMap::from([
            (codec::ID.to_owned(), AttributeValue::S(chunk_id(blob, index))),
            (SHARD.to_owned(), AttributeValue::N(blob_shard(blob).to_string())),
            (ATTACHMENT_OF.to_owned(), AttributeValue::S(blob.to_owned())),
            (DATA.to_owned(), AttributeValue::B(Blob::new(bytes))),
        ]);
        self.client()
            .put_item()
            .table_name(self.table())
            .set_item(Some(item))
            .send()
            .await
            .map_err(|e| map_sdk_write(e, "write an attachment chunk"))?;
        Ok(())
    }

    pub(super) async fn get_chunk(&self, blob: &str, index: u64) -> Result<Option<Bytes>> {
        check_attachment_blob(blob)?;
        let output = self
            .consistent_get(&chunk_id(blob, index))
            .projection_expression("#of, #data")
            .expression_attribute_names("#of", ATTACHMENT_OF)
            .expression_attribute_names("#data", DATA)
            .send()
            .await
            .map_err(|e| map_sdk(e, "read an attachment chunk"))?;
        let Some(item) = output.item else { return Ok(None) };
        match (codec::string_attribute(&item, ATTACHMENT_OF), item.get(DATA)) {
            (Some(of), Some(AttributeValue::B(data))) if of == blob => Ok(Some(Bytes::from(data.clone().into_inner()))),
            _ => Err(Error::new(
                ErrorKind::Corrupt,
                format!("DynamoDB item {:?} is no attachment chunk of {blob:?}", chunk_id(blob, index)),
            )),
        }
    }

    /// Every chunk of `blob`: those the id index lists, deleted 25 a BatchWriteItem, then, by
    /// key, the ones past the highest listed until one is missing. The index is eventually
    /// consistent, so the chunks written last may not be in it yet; an upload writes its chunks
    /// in index order, so those are the highest ones.
    pub(super) async fn delete_blob(&self, blob: &str) -> Result<u64> {
        check_attachment_blob(blob)?;
        let mut deleted = 0;
        let mut next_index = 0;
        let mut cursor: Option<Item> = None;
        loop {
            let prefix = blob_prefix(blob);
            let doing = "find the chunks of an attachment";
            let output = self.query_id_prefix(blob_shard(blob), &prefix, Some(LIST_PAGE), cursor.take(), doing).await?;
            let ids: Vec<String> = output
                .items()
                .iter()
                .filter_map(|item| codec::string_attribute(item, codec::ID))
                .map(str::to_owned)
                .collect();
            for id in &ids {
                if let Some((_, index)) = parse_chunk_id(id) {
                    next_index = next_index.max(index + 1);
                }
            }
            deleted += self.delete_ids(&ids).await?;
            cursor = output.last_evaluated_key;
            if cursor.is_none() {
                break;
            }
        }
        loop {
            let deleting = self
                .client()
                .delete_item()
                .table_name(self.table())
                .set_key(Some(Self::key(&chunk_id(blob, next_index))))
                .condition_expression("attribute_exists(#id)")
                .expression_attribute_names("#id", codec::ID)
                .send()
                .await;
            match deleting {
                Ok(_) => {
                    deleted += 1;
                    next_index += 1;
                }
                Err(err) => {
                    let err = map_sdk_write(err, "delete an attachment chunk");
                    return if err.is_conflict() { Ok(deleted) } else { Err(err) };
                }
            }
        }
    }

    /// Deletes these items, 25 a BatchWriteItem; how many.
    async fn delete_ids(&self, ids: &[String]) -> Result<u64> {
        for batch in ids.chunks(super::backend::BATCH_WRITE_MAX) {
            let requests = batch
                .iter()
                .map(|id| {
                    DeleteRequest::builder()
                        .set_key(Some(Self::key(id)))
                        .build()
                        .map(|delete| WriteRequest::builder().delete_request(delete).build())
                        .map_err(|e| Error::new(ErrorKind::Internal, "build delete request").with_source(e))
                })
                .collect::<Result<Vec<_>>>()?;
            let left = self.batch_write_with_retries(requests).await?;
            if !left.is_empty() {
                return Err(Error::new(
                    ErrorKind::Unavailable,
                    format!("DynamoDB left {} deletions of attachment chunks unprocessed; delete again", left.len()),
                )
                .with_retries_exhausted());
            }
        }
        Ok(ids.len() as u64)
    }

    /// Blob names, shard by shard of the attachment shards, each in id order; within a shard,
    /// the next query starts past the last blob seen, so a blob's chunks are read at most one
    /// query's worth.
    pub(super) async fn list_blobs(&self, limit: usize, page_token: Option<&str>) -> Result<Page<String>> {
        let limit = limit.max(1);
        // Where to read on: the shard, and the id to read from (inclusive) within it.
        let (mut shard, mut from) = match page_token {
            Some(token) => {
                let (shard, from) = decode_token(token)?;
                (shard, Some(from))
            }
            None => (0, None),
        };
        let mut items: Vec<String> = Vec::with_capacity(limit.min(1024));
        while shard < SHARD_COUNT {
            let mut request = self
                .client()
                .query()
                .table_name(self.table())
                .index_name(ID_INDEX)
                .expression_attribute_names("#shard", SHARD)
                .expression_attribute_values(":shard", shard_value(ATTACHMENT_SHARD_BASE + shard))
                .limit(LIST_PAGE);
            request = match &from {
                Some(from) => request
                    .key_condition_expression("#shard = :shard AND #id >= :from")
                    .expression_attribute_names("#id", codec::ID)
                    .expression_attribute_values(":from", AttributeValue::S(from.clone())),
                None => request.key_condition_expression("#shard = :shard"),
            };
            let output = request.send().await.map_err(|e| map_sdk(e, "list attachment blobs"))?;
            let mut last_blob: Option<String> = None;
            for item in output.items() {
                let Some(id) = codec::string_attribute(item, codec::ID) else { continue };
                let Some((blob, _)) = parse_chunk_id(id) else { continue };
                if last_blob.as_deref() == Some(blob) {
                    continue;
                }
                if items.len() == limit {
                    // Another blob follows the page: the next one starts at its first chunk.
                    return Ok(Page { items, next: Some(encode_token(shard, id)) });
                }
                items.push(blob.to_owned());
                last_blob = Some(blob.to_owned());
            }
            // The last blob seen, or, for a page holding only the rest of a blob listed before,
            // that blob: on from past its chunks.
            let seen_last = last_blob.or_else(|| {
                let key = output.last_evaluated_key.as_ref()?;
                parse_chunk_id(codec::string_attribute(key, codec::ID)?).map(|(blob, _)| blob.to_owned())
            });
            match (seen_last, output.last_evaluated_key.is_some()) {
                (Some(blob), true) => from = Some(past_blob(&blob)),
                _ => {
                    shard += 1;
                    from = None;
                }
            }
        }
        Ok(Page { items, next: None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_ids_sort_by_index_and_parse_back() {
        let ids: Vec<String> = [0u64, 9, 10, 255, 4096].iter().map(|n| chunk_id("u1-ab", *n)).collect();
        let mut sorted = ids.clone();
        sorted.sort();
        assert_eq!(ids, sorted, "id order is index order");
        assert_eq!(parse_chunk_id(&ids[3]), Some(("u1-ab", 255)));
        assert!(ids.iter().all(|id| id.as_str() < past_blob("u1-ab").as_str()));
        // A blob whose name continues another's sorts past the other's chunks.
        assert!(past_blob("u1-ab").as_str() < chunk_id("u1-abc", 0).as_str());
        assert!(ids.iter().all(|id| id.starts_with(&blob_prefix("u1-ab"))));
        assert!(!chunk_id("u1-abc", 0).starts_with(&blob_prefix("u1-ab")));
        let (shard, after) = decode_token(&encode_token(3, &past_blob("b"))).unwrap();
        assert_eq!((shard, after), (3, past_blob("b")));
        assert!(decode_token("[99, \"_attachment/b/g\"]").is_err());
        assert!(decode_token("[1, \"x\"]").is_err());
    }
}
