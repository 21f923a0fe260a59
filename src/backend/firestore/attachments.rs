//! Attachment chunks on Firestore: one document per chunk in the collection
//! `{collection}_attachments` beside the data's (inside a database's instance for the catalog's
//! databases), raw bytes in a `bytesValue` field.
//!
//! A chunk's document id is `{blob}.{index as 16 hex digits}`, its fields `blob` (the blob's
//! name), `index` and `data` (the bytes). A collection of its own, so no query of documents,
//! local documents or the feed ever meets a chunk (queries name their collection id, never its
//! descendants); a blob's chunks are found by an equality query on `blob` and blobs are listed
//! in `blob` order, both over Firestore's automatic single-field index (`data` is exempt from
//! indexing in `firestore.indexes.json`: an index entry of a megabyte buys nothing). The
//! catalog's drop deletes the collection with the database's others; `erase_prefix` erases
//! documents only. Attachments of one chunk may be written with their manifests (local
//! documents) in shared commits ([`FirestoreBackend::put_small`]).

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use bytes::Bytes;
use serde_json::{json, Value};

use super::backend::FirestoreBackend;
use super::core::{field_filter, fields_of, select, text};
use crate::backend::{check_attachment_blob, Page, SmallAttachment};
use crate::error::{Error, ErrorKind, Result};

/// The chunk's fields.
const BLOB: &str = "blob";
const INDEX: &str = "index";
const DATA: &str = "data";

/// Bytes per chunk: 1 MiB less 16 KiB. A document is at most 1 MiB (1,048,576 bytes) counting
/// its name (at most 6 KiB), its field names and values and 32 bytes; the 16 KiB left covers the
/// name and the other fields. The request carries the bytes as base64 (a third more), well
/// under Firestore's 10 MiB request limit.
pub const CHUNK_BYTES: usize = (1 << 20) - (16 << 10);

/// Small attachments written in one commit at most: two writes each (chunk and manifest), within
/// Firestore's 500 writes of a commit.
const SMALL_PER_COMMIT: usize = 200;
/// Bytes of small attachments written in one commit at most: 6 MiB, 8 MiB as base64 in the
/// request, within Firestore's 10 MiB request limit with the manifests and names beside.
const SMALL_BYTES_PER_COMMIT: usize = 6 << 20;

/// Chunk documents read (names only) and deleted per round when a blob is deleted: Firestore's
/// limit of writes in one commit.
const DELETE_PAGE: usize = 500;
/// Chunk documents read (their `blob` only) per query when listing blobs.
const LIST_PAGE: usize = 300;

fn document_id(blob: &str, index: u64) -> String {
    format!("{blob}.{index:016x}")
}

impl FirestoreBackend {
    /// [`CHUNK_BYTES`], for the trait implementation.
    pub(super) fn attachment_chunk_size(&self) -> usize {
        CHUNK_BYTES
    }

    fn attachment_collection(&self) -> String {
        format!("{}_attachments", self.client.collection())
    }

    fn chunk_document_name(&self, blob: &str, index: u64) -> String {
        self.client.name_in(&self.attachment_collection(), &document_id(blob, index))
    }

    pub(super) async fn put_chunk(&self, blob: &str, index: u64, bytes: Bytes) -> Result<()> {
        check_attachment_blob(blob)?;
        if bytes.len() > CHUNK_BYTES {
            return Err(Error::new(
                ErrorKind::TooLarge,
                format!("an attachment chunk of {} bytes; Firestore documents take at most {CHUNK_BYTES}", bytes.len()),
            ));
        }
        let write = self.chunk_write(blob, index, &bytes);
        self.commit(vec![write], "write an attachment chunk").await?;
        Ok(())
    }

    /// The writes of chunk `index` of `blob`.
    fn chunk_write(&self, blob: &str, index: u64, bytes: &Bytes) -> Value {
        json!({
            "update": {
                "name": self.chunk_document_name(blob, index),
                "fields": {
                    BLOB: { "stringValue": blob },
                    INDEX: { "integerValue": index.to_string() },
                    DATA: { "bytesValue": BASE64.encode(bytes) },
                },
            },
        })
    }

    /// Small attachments with their manifests ([`DocumentBackend::put_small_attachments`]):
    /// each one's chunk and its manifest (created only if none exists: `exists: false`) in the
    /// same `:commit`, which Firestore applies whole or not at all, so a manifest is never
    /// stored without its chunk. As many attachments share a commit as
    /// [`SMALL_PER_COMMIT`] and [`SMALL_BYTES_PER_COMMIT`] allow (one commit for the few KiB
    /// attachments of a page of a move, where each was two before). A manifest that exists
    /// fails its commit with a conflict, and nothing of that commit is written; commits before
    /// it stand (their manifests name their own chunks).
    ///
    /// [`DocumentBackend::put_small_attachments`]: crate::backend::DocumentBackend::put_small_attachments
    pub(super) async fn put_small(&self, attachments: &[SmallAttachment]) -> Result<()> {
        let mut writes = Vec::new();
        let (mut count, mut bytes) = (0usize, 0usize);
        for attachment in attachments {
            check_attachment_blob(&attachment.blob)?;
            if attachment.bytes.len() > CHUNK_BYTES {
                return Err(Error::new(
                    ErrorKind::TooLarge,
                    format!(
                        "a small attachment of {} bytes; one chunk holds at most {CHUNK_BYTES}",
                        attachment.bytes.len()
                    ),
                ));
            }
            if count > 0 && (count == SMALL_PER_COMMIT || bytes + attachment.bytes.len() > SMALL_BYTES_PER_COMMIT) {
                self.commit(std::mem::take(&mut writes), "write small attachments and their manifests").await?;
                (count, bytes) = (0, 0);
            }
            if !attachment.bytes.is_empty() {
                writes.push(self.chunk_write(&attachment.blob, 0, &attachment.bytes));
            }
            writes.push(self.local_create_write(&attachment.manifest, &attachment.manifest_body)?);
            count += 1;
            bytes += attachment.bytes.len();
        }
        if !writes.is_empty() {
            self.commit(writes, "write small attachments and their manifests").await?;
        }
        Ok(())
    }

    pub(super) async fn get_chunk(&self, blob: &str, index: u64) -> Result<Option<Bytes>> {
        check_attachment_blob(blob)?;
        let doing = "read an attachment chunk";
        let reply = self.batch_get_fields(&[self.chunk_document_name(blob, index)], Some(&[BLOB, DATA]), doing).await?;
        let Some(document) = reply.as_array().into_iter().flatten().find_map(|entry| entry.get("found")) else {
            return Ok(None);
        };
        let corrupt = || {
            Error::new(
                ErrorKind::Corrupt,
                format!("Firestore document {:?} is no attachment chunk of {blob:?}", text(document, "/name")),
            )
        };
        let fields = fields_of(document);
        if fields.get(BLOB).and_then(|v| v.get("stringValue")).and_then(Value::as_str) != Some(blob) {
            return Err(corrupt());
        }
        let encoded = fields.get(DATA).and_then(|v| v.get("bytesValue")).and_then(Value::as_str).ok_or_else(corrupt)?;
        Ok(Some(Bytes::from(BASE64.decode(encoded).map_err(|_| corrupt())?)))
    }

    /// Deletes every chunk of `blob`: its documents found by an equality query on `blob` (names
    /// only), deleted a commit of [`DELETE_PAGE`] at a time, until the query finds none.
    pub(super) async fn delete_blob(&self, blob: &str) -> Result<u64> {
        check_attachment_blob(blob)?;
        let doing = "delete the chunks of an attachment";
        let query = json!({
            "select": select(&["__name__"]),
            "from": [{ "collectionId": self.attachment_collection() }],
            "where": field_filter(BLOB, "EQUAL", json!({ "stringValue": blob })),
            "limit": DELETE_PAGE,
        });
        let mut deleted = 0;
        loop {
            let answer = self.run_raw_query(&query, None, doing).await?;
            let writes: Vec<Value> =
                answer.documents.iter().map(|document| json!({ "delete": text(document, "/name") })).collect();
            if writes.is_empty() {
                return Ok(deleted);
            }
            deleted += writes.len() as u64;
            self.commit(writes, doing).await?;
        }
    }

    /// Blob names in byte order: queries in `blob` order reading only that field, each starting
    /// past the last blob seen, so a blob's chunks are read at most one query's worth.
    pub(super) async fn list_blobs(&self, limit: usize, page_token: Option<&str>) -> Result<Page<String>> {
        let limit = limit.max(1);
        let mut after = page_token.map(|token| check_attachment_blob(token).map(|()| token.to_owned())).transpose()?;
        let mut items: Vec<String> = Vec::with_capacity(limit.min(1024));
        loop {
            let mut query = json!({
                "select": select(&[BLOB]),
                "from": [{ "collectionId": self.attachment_collection() }],
                "orderBy": [{ "field": { "fieldPath": BLOB }, "direction": "ASCENDING" }],
                "limit": LIST_PAGE,
            });
            if let Some(after) = &after {
                query["where"] = field_filter(BLOB, "GREATER_THAN", json!({ "stringValue": after }));
            }
            let answer = self.run_raw_query(&query, None, "list attachment blobs").await?;
            let full = answer.documents.len() >= LIST_PAGE;
            for document in &answer.documents {
                let blob = text(document, &format!("/fields/{BLOB}/stringValue"));
                if blob.is_empty() || items.last().map(String::as_str) == Some(blob) || after.as_deref() == Some(blob) {
                    continue;
                }
                if items.len() == limit {
                    return Ok(Page { next: items.last().cloned(), items });
                }
                items.push(blob.to_owned());
            }
            match items.last() {
                Some(last) if full => after = Some(last.clone()),
                _ if full => {
                    return Err(Error::new(
                        ErrorKind::Internal,
                        "Firestore listed attachment chunks without a blob name",
                    ))
                }
                _ => return Ok(Page { items, next: None }),
            }
        }
    }
}
