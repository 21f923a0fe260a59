//! Attachment bytes of a database, on every backend that keeps them itself: streamed in and out
//! in chunks of the backend's record size, content-addressed by SHA-256 so identical bytes are
//! stored once per database, and freed by garbage collection once no revision references them.
//!
//! ## Storage
//! An upload streams into chunks of [`DocumentBackend::attachment_chunk_bytes`] under a fresh
//! *blob* name, `u{unix milliseconds}-{random}`, computing on the way CouchDB's digest (`md5-`
//! and the standard base64 of the MD5 of the bytes) and the SHA-256 that addresses the content
//! (MD5 is not collision-safe: two different files must never share storage because their MD5s
//! agree). Only one chunk is held in memory at a time. Once every chunk is written a *manifest*
//! is created, the local document `att:{sha256}` (blob, length, digest, chunk count and size,
//! when it was last stored), only if none exists: when one does (the same bytes were stored
//! before, or a concurrent upload of them won), it is touched and the new chunks deleted, so the
//! bytes are kept once. A reader finds bytes only through a manifest, and a manifest is written
//! after its chunks: an upload cut short while its bytes stream in (a client that disconnects,
//! an error item in the stream, a body past the bound, its task dropped mid-way) deletes what it
//! wrote and leaves nothing a reader can see; one cut short by a crash, or failing while its
//! manifest is written (which may have been stored though its answer was lost), leaves its
//! chunks, which garbage collection frees once no manifest names them
//! (docs/design/crash-points.md).
//!
//! Local-document names: the engine keeps its clients' local documents under `doc:`, deleted
//! documents' trees under `tree:` and its settings as `db:settings`
//! ([`crate::database::engine`]), so `att:` meets none of them, and no client listing
//! ([`crate::database::Database::local_docs`]) shows a manifest.
//!
//! ## Freeing
//! [`AttachmentStore::collect_garbage`] lists the manifests, then has the SHA-256s the
//! database's revisions still reference read (by the caller's scan, after compaction or when
//! documents go), and deletes every other manifest listed with its blob, then every blob without
//! a manifest, unless either is younger than the grace period ([`DEFAULT_GRACE`]): an upload in
//! progress has written chunks and no manifest yet, and a manifest just stored or touched may be
//! about to be referenced by the document write that follows it. A dropped database takes its
//! chunks with it (each backend's catalog removes the namespace whole).
//!
//! ## Why a reference is never freed
//! The scan of references reads no snapshot: a document written behind it, or moved between its
//! live record and its local tree while it runs, is not seen. So every document save first
//! touches the manifest of each SHA-256 its tree references ([`AttachmentStore::keep_referenced`],
//! called by the engine), and a collection deletes a manifest only on the revision it listed
//! *before* the scan began, and only if that revision was already older than the grace period.
//! A touch after the listing changed the revision (the deletion fails; the touch and the
//! deletion are compare-and-swaps on the same record, so exactly one wins, and a touch that
//! loses fails a write adding the reference); a touch before it made the manifest young. A
//! touch is skipped for a manifest stored within half the grace period, so the rule holds for
//! every save that ends within half the grace period of its touch. A manifest is only ever
//! re-created by an upload, with the chunks of that upload, never over a blob being deleted.
//! docs/attachments.md, "Why a reference is never freed".

use std::collections::HashSet;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use bytes::{Bytes, BytesMut};
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use md5::Md5;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use crate::backend::{
    attachments_unsupported, DocumentBackend, IdRange, Precondition, SmallAttachment, StoredDocument, LOCAL_PREFIX,
};
use crate::error::{Error, ErrorKind, Result};

/// The local-document name prefix of manifests.
pub const MANIFEST_PREFIX: &str = "att:";

/// How long a blob without a manifest, or a manifest no revision references, is kept after it
/// was written (or, for a manifest, last stored again): 24 hours. Past any upload the server
/// lets run (a request body is cut once it has taken half of `couchdb_attachment_grace_secs`,
/// `src/server/conn.rs`; 1 GiB at 1 MB/s takes 17 minutes) and any gap between storing bytes and
/// writing the document that references them; the cost is that bytes of an upload cut short by a
/// crash take a day to go.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(24 * 60 * 60);

/// Manifests and blob names read per page by garbage collection.
const GC_PAGE: usize = 200;
/// Rounds of storing a manifest that keep meeting concurrent uploads or collections of the same
/// bytes before giving up with a conflict the client may retry.
const MANIFEST_TRIES: usize = 8;

/// Stored attachment bytes, as their manifest records them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredBlob {
    /// The SHA-256 of the bytes, 64 lowercase hex digits: the content address.
    pub sha256: String,
    /// CouchDB's digest: `md5-` and the standard base64 of the bytes' MD5.
    pub digest: String,
    pub length: u64,
    /// The name the chunks are stored under.
    pub blob: String,
    pub chunks: u64,
    /// The size of every chunk but the last (the backend's chunk size when they were written).
    pub chunk_bytes: u64,
}

/// What [`AttachmentStore::collect_garbage`] removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GarbageCollected {
    /// Manifests no reference held, deleted with their blobs.
    pub manifests: u64,
    /// Blobs deleted: those of the manifests, and those without a manifest past the grace period.
    pub blobs: u64,
    /// Chunk records deleted.
    pub chunks: u64,
}

/// The attachment bytes of one database, over its backend.
#[derive(Clone)]
pub struct AttachmentStore {
    backend: Arc<dyn DocumentBackend>,
    grace: Duration,
}

impl AttachmentStore {
    pub fn new(backend: Arc<dyn DocumentBackend>) -> Self {
        AttachmentStore { backend, grace: DEFAULT_GRACE }
    }

    /// The same store with another grace period for garbage collection.
    pub fn with_grace(self, grace: Duration) -> Self {
        AttachmentStore { grace, ..self }
    }

    /// Stores the bytes of `stream` (at most `max_bytes` of them, the setting
    /// `couchdb_max_attachment_bytes`) and returns their manifest. Past `max_bytes` the upload
    /// stops, what it wrote is deleted and the error is `TooLarge`; an error item of the stream
    /// (a client that went away) likewise deletes what was written and is returned as it came.
    pub async fn write<S>(&self, stream: S, max_bytes: u64) -> Result<StoredBlob>
    where
        S: Stream<Item = Result<Bytes>> + Send,
    {
        let chunk_bytes = self.backend.attachment_chunk_bytes();
        if chunk_bytes == 0 {
            return Err(attachments_unsupported(&self.backend.describe()));
        }
        let blob = new_blob_name();
        // Dropped before the end (the request's task cancelled: a client gone, a shutdown),
        // the upload's chunks are deleted by a task of their own.
        let mut guard = DiscardOnDrop { backend: Some(Arc::clone(&self.backend)), blob: blob.clone() };
        let mut upload = Upload::new(&blob, chunk_bytes);
        let written = upload.run(self.backend.as_ref(), stream, max_bytes).await;
        let stored = match written {
            Ok(()) => upload.finish(),
            Err(err) => {
                self.discard(&blob, upload.chunks).await;
                guard.disarm();
                return Err(err);
            }
        };
        // From here on the chunks are never deleted unless a manifest naming other chunks was
        // read: a manifest write whose answer was lost (or whose task was dropped) may have
        // stored the manifest naming these, and a later upload of the same bytes would keep it.
        // Chunks no manifest names are freed by garbage collection after the grace period.
        guard.disarm();
        let recorded = self.record(&stored).await;
        if let Ok(kept) = &recorded {
            if kept.blob != stored.blob {
                // The same bytes were stored before: they stay there, these go.
                self.discard(&stored.blob, stored.chunks).await;
            }
        }
        recorded
    }

    /// Stores many attachments' bytes at once, each `items` entry whole in memory and at most
    /// one chunk long ([`Self::fits_one_chunk`]), and returns their manifests in order. Where
    /// the backend writes chunks with their manifests together
    /// ([`DocumentBackend::put_small_attachments`]: Firestore's atomic commit) the distinct ones
    /// go in one such write, each manifest created only if none exists, so the rule of the
    /// module doc (a reader finds bytes only through a manifest, written no earlier than its
    /// chunks) holds as it does for [`Self::write`]. Otherwise, or when a manifest existed
    /// (the same bytes stored before: nothing of that write was stored), each is written as
    /// [`Self::write`] writes it. `max_bytes` as for [`Self::write`].
    pub async fn write_small_many(&self, items: &[Bytes], max_bytes: u64) -> Result<Vec<StoredBlob>> {
        let chunk_bytes = self.backend.attachment_chunk_bytes();
        if chunk_bytes == 0 {
            return Err(attachments_unsupported(&self.backend.describe()));
        }
        let mut stored: Vec<StoredBlob> = Vec::with_capacity(items.len());
        let mut distinct: Vec<SmallAttachment> = Vec::new();
        let mut seen: std::collections::HashMap<String, StoredBlob> = std::collections::HashMap::new();
        for bytes in items {
            if bytes.len() > chunk_bytes || bytes.len() as u64 > max_bytes {
                return Err(Error::new(
                    ErrorKind::TooLarge,
                    format!("an attachment of {} bytes is no small attachment here", bytes.len()),
                ));
            }
            let blob = small_blob(bytes, chunk_bytes);
            // The same bytes twice are one attachment, under the first one's blob name.
            if let Some(first) = seen.get(&blob.sha256) {
                stored.push(first.clone());
                continue;
            }
            distinct.push(SmallAttachment {
                blob: blob.blob.clone(),
                bytes: bytes.clone(),
                manifest: manifest_name(&blob.sha256),
                manifest_body: manifest_body(&blob),
            });
            seen.insert(blob.sha256.clone(), blob.clone());
            stored.push(blob);
        }
        match self.backend.put_small_attachments(&distinct).await {
            Ok(true) => return Ok(stored),
            Ok(false) => {}
            // A manifest of the same bytes exists: each is stored (or found) as one upload is.
            Err(err) if err.is_conflict() => {}
            Err(err) => return Err(err),
        }
        let mut kept = std::collections::HashMap::with_capacity(distinct.len());
        for attachment in distinct {
            let bytes = attachment.bytes;
            let blob = self.write(futures::stream::once(async move { Ok(bytes) }), max_bytes).await?;
            kept.insert(blob.sha256.clone(), blob);
        }
        stored
            .into_iter()
            .map(|blob| {
                kept.get(&blob.sha256).cloned().ok_or_else(|| {
                    Error::new(ErrorKind::Internal, format!("attachment {} was not stored", blob.sha256))
                })
            })
            .collect()
    }

    /// Whether bytes this long go to [`Self::write_small_many`]: at most one chunk of the
    /// backend's.
    pub fn fits_one_chunk(&self, length: usize) -> bool {
        length <= self.backend.attachment_chunk_bytes()
    }

    /// Deletes the chunks of an upload that will not be kept. A failure is logged, not
    /// returned: the chunks have no manifest, so no reader sees them, and garbage collection
    /// frees them after the grace period.
    async fn discard(&self, blob: &str, chunks: u64) {
        if chunks == 0 {
            return;
        }
        if let Err(err) = self.backend.delete_attachment_blob(blob).await {
            tracing::warn!(blob, error = %err, "left the chunks of an attachment upload behind for garbage collection");
        }
    }

    /// Creates the manifest of `stored`, or touches the one already there for the same bytes;
    /// the manifest that now stands.
    async fn record(&self, stored: &StoredBlob) -> Result<StoredBlob> {
        let name = manifest_name(&stored.sha256);
        for _ in 0..MANIFEST_TRIES {
            match self.backend.put_local(&name, &manifest_body(stored), Precondition::MustNotExist).await {
                Ok(_) => return Ok(stored.clone()),
                Err(err) if err.is_conflict() => {}
                Err(err) => return Err(err),
            }
            let Some(existing) = self.backend.get_local(&name).await? else { continue };
            let kept = parse_manifest(&stored.sha256, &existing)?;
            // Touched, so a collection running now (which deletes on the revision it read)
            // keeps it for another grace period; not written at all when it is fresh, so the
            // uploads of one `_bulk_docs` carrying the same bytes many times never contend for
            // the manifest (each write would move its revision under the others).
            if self.touch(&stored.sha256, existing).await? {
                return Ok(kept);
            }
            // A collection deleted it meanwhile: ours is stored in its place on the next round.
        }
        Err(Error::conflict(format!(
            "attachment {}: its manifest kept changing under concurrent uploads; try again",
            stored.sha256
        )))
    }

    /// The manifest of the bytes whose SHA-256 is `sha256`, or `None`.
    pub async fn stat(&self, sha256: &str) -> Result<Option<StoredBlob>> {
        check_sha256(sha256)?;
        match self.backend.get_local(&manifest_name(sha256)).await? {
            Some(doc) => parse_manifest(sha256, &doc).map(Some),
            None => Ok(None),
        }
    }

    /// The bytes whose SHA-256 is `sha256`, or the `range` of them (`start..end`, byte offsets,
    /// end excluded), chunk by chunk: only the chunks the range covers are read, one at a time.
    /// `NotFound` when nothing is stored under `sha256`; `InvalidInput` for a range that does not
    /// lie within the bytes. A chunk gone while the stream runs (the bytes were collected) ends it
    /// with a `NotFound` error.
    pub async fn read(&self, sha256: &str, range: Option<Range<u64>>) -> Result<BoxStream<'static, Result<Bytes>>> {
        let Some(stored) = self.stat(sha256).await? else {
            return Err(Error::not_found(format!("no attachment bytes with SHA-256 {sha256}")));
        };
        let range = range.unwrap_or(0..stored.length);
        if range.start > range.end || range.end > stored.length {
            return Err(Error::invalid(
                "range",
                format!("{}..{} does not lie within the attachment's {} bytes", range.start, range.end, stored.length),
            ));
        }
        if range.start == range.end {
            return Ok(futures::stream::empty().boxed());
        }
        let chunk_bytes = stored.chunk_bytes.max(1);
        let first = range.start / chunk_bytes;
        let last = (range.end - 1) / chunk_bytes;
        let reader = ChunkReader { backend: Arc::clone(&self.backend), stored, range };
        Ok(futures::stream::iter(first..=last)
            .then(move |index| {
                let reader = reader.clone();
                async move { reader.chunk(index).await }
            })
            .boxed())
    }

    /// Keeps the bytes of `referenced` (the SHA-256s a document's tree is about to reference)
    /// from a collection running now: every manifest among them older than half the grace period
    /// is touched (stored again on the revision read, with a fresh time), before the write that
    /// makes the references visible (module doc, "Why a reference is never freed"). A manifest
    /// that is gone fails the write with a conflict when its SHA-256 is in `new` (references the
    /// document's tree did not hold before: the source of a `COPY` deleted and collected, an
    /// upload collected before its write); one the tree held already is only logged, so that a
    /// document whose bytes were lost stays writable.
    pub async fn keep_referenced(&self, referenced: &HashSet<String>, new: &HashSet<String>) -> Result<()> {
        if referenced.is_empty() {
            return Ok(());
        }
        let standing = self.touch_all(referenced).await?;
        references_stand(referenced, new, &standing)
    }

    /// [`AttachmentStore::keep_referenced`] for many documents saved at once (`documents`: each
    /// one's references and its new ones): the manifests of every SHA-256 any of them references
    /// read in one batched read, not one per document, and touched once each; one answer per
    /// document, the one `keep_referenced` gives it. The touches all come before the saves, as
    /// each document's own did before its save. A failure of the read or of a touch is the
    /// answer of every document that references anything.
    pub async fn keep_referenced_by_many(&self, documents: &[(HashSet<String>, HashSet<String>)]) -> Vec<Result<()>> {
        let all: HashSet<String> = documents.iter().flat_map(|(referenced, _)| referenced.iter().cloned()).collect();
        if all.is_empty() {
            return documents.iter().map(|_| Ok(())).collect();
        }
        let standing = self.touch_all(&all).await;
        documents
            .iter()
            .map(|(referenced, new)| match &standing {
                _ if referenced.is_empty() => Ok(()),
                Ok(standing) => references_stand(referenced, new, standing),
                Err(err) => Err(Error::new(err.kind(), err.message().to_owned())),
            })
            .collect()
    }

    /// Reads the manifests of `shas` in one batched read and touches each ([`Self::touch`]);
    /// the SHA-256s whose manifest stands.
    async fn touch_all(&self, shas: &HashSet<String>) -> Result<HashSet<String>> {
        let shas: Vec<&String> = shas.iter().collect();
        let names: Vec<String> = shas.iter().map(|sha256| manifest_name(sha256)).collect();
        let manifests = self.backend.get_many_local(&names).await?;
        let mut standing = HashSet::with_capacity(shas.len());
        for (sha256, manifest) in shas.into_iter().zip(manifests) {
            let kept = match manifest {
                Some(manifest) => self.touch(sha256, manifest).await?,
                None => false,
            };
            if kept {
                standing.insert(sha256.clone());
            }
        }
        Ok(standing)
    }

    /// Touches the manifest of `sha256`, read as `manifest`, unless it was stored within half
    /// the grace period; whether it stands (false: a collection deleted it first).
    async fn touch(&self, sha256: &str, mut manifest: StoredDocument) -> Result<bool> {
        let name = manifest_name(sha256);
        for _ in 0..MANIFEST_TRIES {
            if unix_millis().saturating_sub(stored_millis(&manifest)) < self.grace_millis() / 2 {
                return Ok(true);
            }
            let mut body = manifest.body.clone();
            body.insert("stored_ms".into(), Value::from(unix_millis()));
            match self.backend.put_local(&name, &body, Precondition::MatchRevision(manifest.rev.clone())).await {
                Ok(_) => return Ok(true),
                Err(err) if matches!(err.kind(), ErrorKind::Conflict | ErrorKind::NotFound) => {}
                Err(err) => return Err(err),
            }
            // Stored again by another writer (then fresh), or deleted by a collection.
            match self.backend.get_local(&name).await? {
                Some(again) => manifest = again,
                None => return Ok(false),
            }
        }
        Err(Error::conflict(format!(
            "attachment {sha256}: its manifest kept changing under concurrent writers; try again"
        )))
    }

    fn grace_millis(&self) -> u64 {
        u64::try_from(self.grace.as_millis()).unwrap_or(u64::MAX)
    }

    /// Deletes every manifest no reference holds and every blob without a manifest, each once
    /// it is older than the grace period (module doc). `scan_references` reads the SHA-256s the
    /// database's revisions reference; it is called after the manifests are listed, and a
    /// manifest is deleted only on the revision listed, so one touched since (by an upload of the
    /// same bytes, or by a write about to reference it, [`AttachmentStore::keep_referenced`])
    /// stays. Safe while uploads, reads and document writes run.
    pub async fn collect_garbage<F, Fut>(&self, scan_references: F) -> Result<GarbageCollected>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<HashSet<String>>>,
    {
        let now = unix_millis();
        let Listed { old, mut kept_blobs } = self.list_manifests(now).await?;
        let referenced = scan_references().await?;
        let mut collected = GarbageCollected::default();
        for manifest in old {
            if referenced.contains(&manifest.stored.sha256) {
                kept_blobs.insert(manifest.stored.blob);
                continue;
            }
            match self.backend.delete_local(&manifest_name(&manifest.stored.sha256), &manifest.rev).await {
                Ok(()) => {
                    collected.manifests += 1;
                    if manifest.stored.chunks > 0 {
                        collected.chunks += self.backend.delete_attachment_blob(&manifest.stored.blob).await?;
                        collected.blobs += 1;
                    }
                }
                // Stored again since it was listed: it stays.
                Err(err) if matches!(err.kind(), ErrorKind::Conflict | ErrorKind::NotFound) => {
                    kept_blobs.insert(manifest.stored.blob);
                }
                Err(err) => return Err(err),
            }
        }
        self.collect_orphan_blobs(now, &kept_blobs, &mut collected).await?;
        Ok(collected)
    }

    /// Every manifest, page by page: those stored before `now` less the grace period (deletion
    /// candidates, with the revision read), and the blobs of the others.
    async fn list_manifests(&self, now: u64) -> Result<Listed> {
        let grace = self.grace_millis();
        let mut listed = Listed::default();
        let manifests = IdRange::all().under_prefix(MANIFEST_PREFIX);
        let mut token: Option<String> = None;
        loop {
            let page = self.backend.local_docs(&manifests, GC_PAGE, token.as_deref()).await?;
            for doc in page.items {
                let Some(sha256) = doc.id.strip_prefix(LOCAL_PREFIX).and_then(|n| n.strip_prefix(MANIFEST_PREFIX))
                else {
                    continue;
                };
                let stored = parse_manifest(sha256, &doc)?;
                if now.saturating_sub(stored_millis(&doc)) < grace {
                    listed.kept_blobs.insert(stored.blob);
                } else {
                    listed.old.push(ListedManifest { stored, rev: doc.rev });
                }
            }
            token = page.next;
            if token.is_none() {
                return Ok(listed);
            }
        }
    }

    /// Deletes every blob older than the grace period at `now` that no manifest listed names.
    async fn collect_orphan_blobs(
        &self,
        now: u64,
        kept_blobs: &HashSet<String>,
        collected: &mut GarbageCollected,
    ) -> Result<()> {
        let grace = self.grace_millis();
        let mut token: Option<String> = None;
        loop {
            let page = self.backend.attachment_blobs(GC_PAGE, token.as_deref()).await?;
            for blob in &page.items {
                let young = blob_created_millis(blob).is_some_and(|created| now.saturating_sub(created) < grace);
                if kept_blobs.contains(blob) || young {
                    continue;
                }
                collected.chunks += self.backend.delete_attachment_blob(blob).await?;
                collected.blobs += 1;
            }
            token = page.next;
            if token.is_none() {
                return Ok(());
            }
        }
    }
}

/// What a collection's listing of manifests found.
#[derive(Default)]
struct Listed {
    /// Manifests older than the grace period: deleted unless referenced or stored again.
    old: Vec<ListedManifest>,
    /// The blobs of the younger manifests.
    kept_blobs: HashSet<String>,
}

/// A manifest as a collection listed it.
struct ListedManifest {
    stored: StoredBlob,
    /// The revision read: the manifest is deleted only if it is still this one.
    rev: crate::backend::Revision,
}

/// Deletes an upload's chunks from a task of its own when the upload is dropped unfinished.
struct DiscardOnDrop {
    /// `None` once the upload has ended and dealt with its chunks itself.
    backend: Option<Arc<dyn DocumentBackend>>,
    blob: String,
}

impl DiscardOnDrop {
    fn disarm(&mut self) {
        self.backend = None;
    }
}

impl Drop for DiscardOnDrop {
    fn drop(&mut self) {
        let Some(backend) = self.backend.take() else { return };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(blob = %self.blob, "an attachment upload was dropped outside a runtime; its chunks wait for garbage collection");
            return;
        };
        let blob = std::mem::take(&mut self.blob);
        runtime.spawn(async move {
            if let Err(err) = backend.delete_attachment_blob(&blob).await {
                tracing::warn!(blob, error = %err, "left the chunks of a dropped attachment upload for garbage collection");
            }
        });
    }
}

/// Reads the chunks of one stored blob for [`AttachmentStore::read`].
#[derive(Clone)]
struct ChunkReader {
    backend: Arc<dyn DocumentBackend>,
    stored: StoredBlob,
    range: Range<u64>,
}

impl ChunkReader {
    /// Chunk `index`, cut to the range.
    async fn chunk(&self, index: u64) -> Result<Bytes> {
        let stored = &self.stored;
        let Some(bytes) = self.backend.get_attachment_chunk(&stored.blob, index).await? else {
            return Err(Error::not_found(format!(
                "chunk {index} of attachment {} is gone (deleted while it was read)",
                stored.sha256
            )));
        };
        let chunk_start = index * stored.chunk_bytes;
        let expected = stored.chunk_bytes.min(stored.length - chunk_start);
        if bytes.len() as u64 != expected {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!(
                    "chunk {index} of attachment {} holds {} bytes where {expected} were written",
                    stored.sha256,
                    bytes.len()
                ),
            ));
        }
        let from = self.range.start.saturating_sub(chunk_start).min(expected);
        let to = (self.range.end - chunk_start).min(expected);
        Ok(bytes.slice(from as usize..to as usize))
    }
}

/// One upload in progress: the chunk being filled, how many were written, the running digests.
struct Upload<'a> {
    blob: &'a str,
    chunk_bytes: usize,
    buffer: BytesMut,
    chunks: u64,
    length: u64,
    md5: Md5,
    sha256: Sha256,
}

impl<'a> Upload<'a> {
    fn new(blob: &'a str, chunk_bytes: usize) -> Self {
        Upload {
            blob,
            chunk_bytes,
            buffer: BytesMut::new(),
            chunks: 0,
            length: 0,
            md5: Md5::new(),
            sha256: Sha256::new(),
        }
    }

    /// Reads the whole stream into chunks; the last, partial chunk is written too.
    async fn run<S>(&mut self, backend: &dyn DocumentBackend, stream: S, max_bytes: u64) -> Result<()>
    where
        S: Stream<Item = Result<Bytes>> + Send,
    {
        let mut stream = std::pin::pin!(stream);
        while let Some(item) = stream.next().await {
            let mut bytes = item?;
            self.length += bytes.len() as u64;
            if self.length > max_bytes {
                return Err(Error::new(
                    ErrorKind::TooLarge,
                    format!(
                        "the attachment is larger than {max_bytes} bytes, the most this server stores \
                         (couchdb_max_attachment_bytes)"
                    ),
                ));
            }
            self.md5.update(&bytes);
            self.sha256.update(&bytes);
            while !bytes.is_empty() {
                if self.buffer.is_empty() && bytes.len() >= self.chunk_bytes {
                    // A whole chunk in the item: written as it is, not copied.
                    let chunk = bytes.split_to(self.chunk_bytes);
                    self.put(backend, chunk).await?;
                    continue;
                }
                if self.buffer.is_empty() {
                    // One allocation per chunk, not a doubling series of them.
                    self.buffer.reserve(self.chunk_bytes);
                }
                let room = self.chunk_bytes - self.buffer.len();
                let taken = bytes.split_to(room.min(bytes.len()));
                self.buffer.extend_from_slice(&taken);
                if self.buffer.len() == self.chunk_bytes {
                    self.flush(backend).await?;
                }
            }
        }
        if !self.buffer.is_empty() {
            self.flush(backend).await?;
        }
        Ok(())
    }

    /// Writes the chunk being filled.
    async fn flush(&mut self, backend: &dyn DocumentBackend) -> Result<()> {
        let chunk = self.buffer.split().freeze();
        self.put(backend, chunk).await
    }

    /// Writes the next chunk.
    async fn put(&mut self, backend: &dyn DocumentBackend, chunk: Bytes) -> Result<()> {
        // Counted before the write: a write that fails may still have landed, and the chunks
        // counted are the ones deleted when the upload is discarded.
        self.chunks += 1;
        backend.put_attachment_chunk(self.blob, self.chunks - 1, chunk).await
    }

    fn finish(self) -> StoredBlob {
        StoredBlob {
            sha256: hex::encode(self.sha256.finalize()),
            digest: md5_digest(self.md5),
            length: self.length,
            blob: self.blob.to_owned(),
            chunks: self.chunks,
            chunk_bytes: self.chunk_bytes as u64,
        }
    }
}

/// The manifest of `bytes` (at most one chunk of `chunk_bytes`) stored under a fresh blob name:
/// one chunk, none when empty, as [`Upload`] would record them.
fn small_blob(bytes: &Bytes, chunk_bytes: usize) -> StoredBlob {
    let mut md5 = Md5::new();
    md5.update(bytes);
    StoredBlob {
        sha256: hex::encode(Sha256::digest(bytes)),
        digest: md5_digest(md5),
        length: bytes.len() as u64,
        blob: new_blob_name(),
        chunks: u64::from(!bytes.is_empty()),
        chunk_bytes: chunk_bytes as u64,
    }
}

/// CouchDB's digest of what `md5` has seen: `md5-` and the standard base64 of the MD5.
fn md5_digest(md5: Md5) -> String {
    format!("md5-{}", BASE64.encode(md5.finalize()))
}

/// CouchDB's digest of `bytes`.
pub fn couchdb_digest(bytes: &[u8]) -> String {
    let mut md5 = Md5::new();
    md5.update(bytes);
    md5_digest(md5)
}

/// CouchDB's digest of the bytes a stream yields, read a chunk at a time (never held whole).
pub async fn couchdb_digest_of<S>(stream: S) -> Result<String>
where
    S: futures::Stream<Item = Result<Bytes>>,
{
    use futures::StreamExt;
    let mut md5 = Md5::new();
    let mut stream = std::pin::pin!(stream);
    while let Some(chunk) = stream.next().await {
        md5.update(&chunk?);
    }
    Ok(md5_digest(md5))
}

fn unix_millis() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)).unwrap_or(0)
}

/// A fresh blob name that says when it was made: `u{unix milliseconds}-{16 random hex digits}`.
fn new_blob_name() -> String {
    format!("u{}-{}", unix_millis(), crate::backend::random_token())
}

/// When a blob [`new_blob_name`] made was made; `None` for any other name (which garbage
/// collection treats as old: nothing of this store made it, so no upload is writing it).
fn blob_created_millis(blob: &str) -> Option<u64> {
    let (millis, random) = blob.strip_prefix('u')?.split_once('-')?;
    (!random.is_empty()).then_some(())?;
    millis.parse().ok()
}

fn manifest_name(sha256: &str) -> String {
    format!("{MANIFEST_PREFIX}{sha256}")
}

/// A SHA-256 as manifests name it: 64 lowercase hex digits.
fn check_sha256(sha256: &str) -> Result<()> {
    if sha256.len() == 64 && sha256.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        Ok(())
    } else {
        Err(Error::invalid("attachment SHA-256", format!("{sha256:?} is not 64 lowercase hex digits")))
    }
}

/// The manifest's body, stamped with the time it is written.
fn manifest_body(stored: &StoredBlob) -> Map<String, Value> {
    let body = json!({
        "blob": stored.blob,
        "length": stored.length,
        "digest": stored.digest,
        "chunks": stored.chunks,
        "chunk_bytes": stored.chunk_bytes,
        "stored_ms": unix_millis(),
    });
    match body {
        Value::Object(map) => map,
        _ => Map::new(),
    }
}

fn parse_manifest(sha256: &str, doc: &StoredDocument) -> Result<StoredBlob> {
    let corrupt = |what: &str| Error::new(ErrorKind::Corrupt, format!("the manifest of attachment {sha256} {what}"));
    let text = |field: &str| doc.body.get(field).and_then(Value::as_str).map(str::to_owned);
    let number = |field: &str| doc.body.get(field).and_then(Value::as_u64);
    let stored = StoredBlob {
        sha256: sha256.to_owned(),
        digest: text("digest").ok_or_else(|| corrupt("has no digest"))?,
        length: number("length").ok_or_else(|| corrupt("has no length"))?,
        blob: text("blob").ok_or_else(|| corrupt("names no blob"))?,
        chunks: number("chunks").ok_or_else(|| corrupt("has no chunk count"))?,
        chunk_bytes: number("chunk_bytes").ok_or_else(|| corrupt("has no chunk size"))?,
    };
    if stored.chunk_bytes == 0 || stored.length.div_ceil(stored.chunk_bytes) != stored.chunks {
        return Err(corrupt("counts chunks that do not hold its length"));
    }
    Ok(stored)
}

/// When a manifest was last stored (0, long ago, when it does not say).
fn stored_millis(doc: &StoredDocument) -> u64 {
    doc.body.get("stored_ms").and_then(Value::as_u64).unwrap_or(0)
}

/// A document's answer once the manifests of its references were touched (`standing`: those that
/// stand): a reference it adds (`new`) whose manifest is gone fails it with a conflict; one it
/// held already is only logged ([`AttachmentStore::keep_referenced`]).
fn references_stand(referenced: &HashSet<String>, new: &HashSet<String>, standing: &HashSet<String>) -> Result<()> {
    for sha256 in referenced.iter().filter(|sha256| !standing.contains(*sha256)) {
        if new.contains(sha256) {
            return Err(Error::conflict(format!(
                "the bytes of attachment {sha256} were freed while this write was made (the document they came \
                 from changed); try again"
            )));
        }
        tracing::warn!(sha256, "a document keeps a reference to attachment bytes that are gone");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The expected digests were computed apart from this code:
    /// `printf hello | openssl md5 -binary | base64` (and `printf '' | …`, and the 1 MiB of
    /// `head -c 1048576 /dev/zero | …`).
    #[test]
    fn digests_are_couchdbs() {
        assert_eq!(couchdb_digest(b"hello"), "md5-XUFAKrxLKna5cZ2REBfFkg==");
        assert_eq!(couchdb_digest(b""), "md5-1B2M2Y8AsgTpgAmY7PhCfg==");
        assert_eq!(couchdb_digest(&vec![0u8; 1 << 20]), "md5-ttgbNgpWctgMJ0MPORU+LA==");
    }

    /// On the embedded store attachment chunks commit without an fsync of their own: an upload
    /// of six chunks is one durable commit, its manifest's, which makes the chunks durable with
    /// it (redb persists `Durability::None` commits with the next `Immediate` one; issue 38:
    /// each 1 MiB chunk was an fsync'd commit, 68 `fdatasync` for 64 MiB). The bytes read back,
    /// also after the file is closed and opened again, and a document write still commits
    /// durably.
    #[tokio::test]
    async fn embedded_chunks_are_made_durable_by_the_manifest() {
        use crate::backend::embedded::EmbeddedBackend;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.redb");
        let store = EmbeddedBackend::open(&path).await.unwrap();
        let attachments = AttachmentStore::new(Arc::new(store.clone()));
        let chunk = store.attachment_chunk_bytes();
        let bytes: Vec<u8> = (0..5 * chunk + 10).map(|n| (n % 251) as u8).collect();
        let pieces: Vec<Result<Bytes>> = bytes.chunks(64 * 1024).map(|part| Ok(Bytes::copy_from_slice(part))).collect();
        let (transactions, durable) = (store.write_transactions(), store.durable_commits());
        let stored = attachments.write(futures::stream::iter(pieces), u64::MAX).await.unwrap();
        assert_eq!(stored.chunks, 6);
        assert_eq!(store.write_transactions() - transactions, 7, "six chunks and the manifest");
        assert_eq!(store.durable_commits() - durable, 1, "one fsync'd commit: the manifest's");
        drop((attachments, store));
        let reopened = EmbeddedBackend::open(&path).await.unwrap();
        let mut read = Vec::new();
        for index in 0..stored.chunks {
            read.extend_from_slice(&reopened.get_attachment_chunk(&stored.blob, index).await.unwrap().unwrap());
        }
        assert!(read == bytes, "the chunks read back");
        let durable = reopened.durable_commits();
        reopened.put("doc", &Map::new(), Precondition::MustNotExist).await.unwrap();
        assert_eq!(reopened.durable_commits() - durable, 1, "a document write commits durably");
    }

    /// Many documents' references kept at once answer each document as `keep_referenced` alone
    /// would: a stored manifest keeps its references; a manifest that is gone fails the
    /// documents to which its SHA-256 is new (conflict), and not one that held it already, nor
    /// one referencing nothing.
    #[tokio::test]
    async fn many_documents_references_are_each_answered_as_alone() {
        let dir = tempfile::tempdir().unwrap();
        let backend: Arc<dyn DocumentBackend> =
            Arc::new(crate::backend::embedded::EmbeddedBackend::open(&dir.path().join("a.redb")).await.unwrap());
        let attachments = AttachmentStore::new(backend);
        let stored =
            attachments.write(futures::stream::iter([Ok(Bytes::from_static(b"kept bytes"))]), u64::MAX).await.unwrap();
        let gone = "e".repeat(64);
        let set = |shas: &[&str]| shas.iter().map(|sha| (*sha).to_owned()).collect::<HashSet<String>>();
        let documents = [
            (set(&[&stored.sha256]), set(&[&stored.sha256])),
            (set(&[&stored.sha256, &gone]), set(&[&gone])),
            (set(&[&gone]), set(&[])),
            (set(&[]), set(&[])),
        ];
        let answers = attachments.keep_referenced_by_many(&documents).await;
        assert_eq!(answers.len(), 4);
        assert!(answers[0].is_ok(), "{:?}", answers[0]);
        assert_eq!(
            answers[1].as_ref().map_err(Error::kind).err(),
            Some(ErrorKind::Conflict),
            "a new reference to gone bytes"
        );
        assert!(answers[2].is_ok(), "a reference held already is kept: {:?}", answers[2]);
        assert!(answers[3].is_ok());
        for (referenced, new) in &documents {
            let alone = attachments.keep_referenced(referenced, new).await.map_err(|err| err.kind());
            let together =
                attachments.keep_referenced_by_many(std::slice::from_ref(&(referenced.clone(), new.clone()))).await;
            assert_eq!(together[0].as_ref().map(|_| ()).map_err(Error::kind), alone, "{referenced:?}");
        }
    }

    /// Fed in pieces that straddle chunk boundaries every way (smaller than a chunk, a whole
    /// one, several, after a partial one), the digests and chunks are those of the whole; the
    /// SHA-256 of "hello" is `printf hello | sha256sum`'s.
    #[tokio::test]
    async fn an_upload_in_pieces_digests_the_whole() {
        let dir = tempfile::tempdir().unwrap();
        let backend: Arc<dyn DocumentBackend> =
            Arc::new(crate::backend::embedded::EmbeddedBackend::open(&dir.path().join("a.redb")).await.unwrap());
        let splits: [&[&[u8]]; 4] =
            [&[b"he", b"llo"], &[b"h", b"ello"], &[b"hello"], &[b"h", b"e", b"l", b"", b"l", b"o"]];
        for (n, pieces) in splits.iter().enumerate() {
            let blob = format!("u1-{n}");
            let items: Vec<Result<Bytes>> = pieces.iter().map(|p| Ok(Bytes::copy_from_slice(p))).collect();
            let mut upload = Upload::new(&blob, 2);
            upload.run(backend.as_ref(), futures::stream::iter(items), 5).await.unwrap();
            let stored = upload.finish();
            assert_eq!(stored.sha256, "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824");
            assert_eq!(stored.digest, "md5-XUFAKrxLKna5cZ2REBfFkg==");
            assert_eq!((stored.length, stored.chunks), (5, 3));
            let chunks: Vec<Option<Bytes>> =
                futures::future::try_join_all((0..4).map(|i| backend.get_attachment_chunk(&blob, i))).await.unwrap();
            let expected = [Some(&b"he"[..]), Some(b"ll"), Some(b"o"), None];
            assert_eq!(chunks.iter().map(Option::as_deref).collect::<Vec<_>>(), expected, "{pieces:?}");
        }
    }

    #[test]
    fn blob_names_carry_their_time() {
        let before = unix_millis();
        let name = new_blob_name();
        crate::backend::check_attachment_blob(&name).unwrap();
        let created = blob_created_millis(&name).unwrap();
        assert!(created >= before && created <= unix_millis(), "{name}");
        assert_eq!(blob_created_millis("u1000-abc"), Some(1000));
        for other in ["x1000-abc", "u-abc", "u1000-", "u10x-a", "u1000"] {
            assert_eq!(blob_created_millis(other), None, "{other}");
        }
        assert!(check_sha256(&"a".repeat(64)).is_ok());
        for bad in ["A".repeat(64), "a".repeat(63), "g".repeat(64)] {
            assert!(check_sha256(&bad).is_err(), "{bad}");
        }
    }
}
