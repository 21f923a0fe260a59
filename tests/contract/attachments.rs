//! Attachment bytes on every backend that keeps them itself (`DocumentBackend`'s attachment
//! chunks and [`AttachmentStore`] over them): byte-exact round trips of every size around the
//! backend's chunk size and of 64 MiB, ranges across chunk boundaries, identical content stored
//! once, interrupted and over-limit uploads leaving nothing, garbage collection, chunks invisible
//! to every document call, a dropped database taking its chunks, and small attachments stored
//! with their manifests at once (all or nothing where the backend writes them together). On the CouchDB backend,
//! whose databases keep CouchDB's own attachments, each case checks that the calls refuse.

use std::collections::{BTreeSet, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agentstore::backend::catalog::{open_catalog, Catalog, DbName};
use agentstore::backend::raw::layer::Layered;
use agentstore::backend::{BackendUrl, DocumentBackend, IdRange, Precondition, Projection, Query, SmallAttachment};
use agentstore::database::attachments::{AttachmentStore, StoredBlob, MANIFEST_PREFIX};
use agentstore::database::Database;
use agentstore::{Error, ErrorKind};
use bytes::Bytes;
use futures::{Stream, StreamExt};
use md5::Md5;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use crate::harness::Ctx;

/// No bound on the size (the setting's default).
const UNBOUNDED: u64 = u64::MAX;
/// Bytes per item of the generated streams: prime, so items straddle every chunk boundary.
const PIECE: u64 = 65_521;

/// A byte of the content `seed` makes, at `offset`: splitmix64 of the seed and the 8-byte word
/// the offset falls in, so no two chunks of a stream hold the same bytes.
fn byte_at(seed: u64, offset: u64) -> u8 {
    let mut z = (seed ^ (offset / 8).wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> ((offset % 8) * 8)) as u8
}

fn content(seed: u64, len: u64) -> Vec<u8> {
    (0..len).map(|offset| byte_at(seed, offset)).collect()
}

/// The content `seed` makes, `len` bytes, generated item by item (never held whole).
fn generated(seed: u64, len: u64) -> impl Stream<Item = agentstore::Result<Bytes>> + Send + 'static {
    futures::stream::unfold(0u64, move |offset| async move {
        (offset < len).then(|| {
            let end = (offset + PIECE).min(len);
            let piece: Vec<u8> = (offset..end).map(|at| byte_at(seed, at)).collect();
            (Ok(Bytes::from(piece)), end)
        })
    })
}

/// The SHA-256 (hex) and MD5 digest (`md5-` + base64) of the content `seed` makes, computed
/// here with the hash crates directly, apart from the store's code.
fn expected_digests(seed: u64, len: u64) -> (String, String) {
    let (mut sha, mut md5) = (Sha256::new(), Md5::new());
    let mut offset = 0;
    while offset < len {
        let end = (offset + PIECE).min(len);
        let piece: Vec<u8> = (offset..end).map(|at| byte_at(seed, at)).collect();
        sha.update(&piece);
        md5.update(&piece);
        offset = end;
    }
    use base64::Engine as _;
    (hex::encode(sha.finalize()), format!("md5-{}", base64::engine::general_purpose::STANDARD.encode(md5.finalize())))
}

/// Reads a stream to its end: the SHA-256 (hex) and length of what it gave.
async fn hash_of(mut stream: impl Stream<Item = agentstore::Result<Bytes>> + Unpin) -> (String, u64) {
    let (mut sha, mut len) = (Sha256::new(), 0u64);
    while let Some(piece) = stream.next().await {
        let piece = piece.expect("a chunk of the read");
        sha.update(&piece);
        len += piece.len() as u64;
    }
    (hex::encode(sha.finalize()), len)
}

async fn read_all(store: &AttachmentStore, sha256: &str, range: Option<std::ops::Range<u64>>) -> Vec<u8> {
    let mut stream = store.read(sha256, range).await.expect("read");
    let mut out = Vec::new();
    while let Some(piece) = stream.next().await {
        out.extend_from_slice(&piece.expect("a chunk of the read"));
    }
    out
}

/// Every blob name the backend lists, page by page with `limit`, each checked listed once.
async fn blobs(b: &dyn DocumentBackend, limit: usize) -> BTreeSet<String> {
    let (mut all, mut token) = (BTreeSet::new(), None::<String>);
    for _ in 0..1000 {
        let page = b.attachment_blobs(limit, token.as_deref()).await.expect("attachment_blobs");
        assert!(page.items.len() <= limit, "a page of {} where {limit} were asked", page.items.len());
        for blob in page.items {
            assert!(all.insert(blob.clone()), "{blob} listed twice");
        }
        token = page.next;
        if token.is_none() {
            return all;
        }
    }
    panic!("attachment_blobs kept paging");
}

/// The manifests (`_local/att:…`) the backend holds.
async fn manifests(b: &dyn DocumentBackend) -> Vec<String> {
    let range = IdRange::all().under_prefix(MANIFEST_PREFIX);
    let page = b.local_docs(&range, 1000, None).await.expect("local_docs");
    page.items.into_iter().map(|doc| doc.id).filter(|id| id.starts_with("_local/att:")).collect()
}

fn body(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        other => panic!("not an object: {other}"),
    }
}

/// On a backend that keeps no attachment bytes (the CouchDB backend, whose databases keep
/// CouchDB's own), checks that every attachment call refuses naming the backend, and returns
/// `true`: the case does not apply.
async fn not_applicable(ctx: &Ctx) -> bool {
    let b = ctx.backend.as_ref();
    let keeps_none = b.attachment_chunk_bytes() == 0;
    assert_eq!(keeps_none, ctx.backend_name == "couchdb", "only the CouchDB backend keeps no attachment chunks");
    if !keeps_none {
        return false;
    }
    let store = b.describe();
    let refusals = [
        b.put_attachment_chunk("u1-a", 0, Bytes::from_static(b"x")).await.err(),
        b.get_attachment_chunk("u1-a", 0).await.err(),
        b.delete_attachment_blob("u1-a").await.err(),
        b.attachment_blobs(10, None).await.err(),
        AttachmentStore::new(Arc::clone(&ctx.backend)).write(generated(1, 0), UNBOUNDED).await.err(),
    ];
    for refusal in refusals {
        let refusal = refusal.expect("an attachment call on a backend that keeps no attachment chunks");
        assert_eq!(refusal.kind(), ErrorKind::Misconfigured, "{refusal}");
        assert!(refusal.to_string().contains(&store), "the refusal names the backend: {refusal}");
    }
    let (empty_sha256, _) = expected_digests(1, 0);
    let manifest = b.get_local(&format!("{MANIFEST_PREFIX}{empty_sha256}")).await.expect("get_local");
    assert!(manifest.is_none(), "a refused upload records nothing");
    println!(
        "{}: not applicable: its databases keep CouchDB's own attachments (requests are forwarded); \
         the attachment calls refuse as they must",
        ctx.backend_name
    );
    true
}

async fn stored(store: &AttachmentStore, seed: u64, len: u64) -> StoredBlob {
    store.write(generated(seed, len), UNBOUNDED).await.expect("write")
}

pub async fn attachments_round_trip_byte_exact(ctx: Ctx) {
    if not_applicable(&ctx).await {
        return;
    }
    let b = ctx.backend.as_ref();
    let chunk = b.attachment_chunk_bytes() as u64;
    let store = AttachmentStore::new(Arc::clone(&ctx.backend));
    for (seed, len) in [(1, 0), (2, 1), (3, chunk), (4, chunk + 1), (5, 2 * chunk + 3), (6, 64 << 20)] {
        let written = stored(&store, seed, len).await;
        let (sha256, digest) = expected_digests(seed, len);
        assert_eq!((&written.sha256, &written.digest, written.length), (&sha256, &digest, len), "{len} bytes");
        assert_eq!(written.chunks, len.div_ceil(chunk), "{len} bytes in chunks of {chunk}");
        assert_eq!(store.stat(&sha256).await.expect("stat"), Some(written.clone()));
        let (read_sha, read_len) = hash_of(store.read(&sha256, None).await.expect("read")).await;
        assert_eq!((read_sha, read_len), (sha256, len), "{len} bytes read back exactly");
        // Chunk by chunk through the trait: each as large as the backend says, the last the rest.
        if len > 0 {
            let last = written.chunks - 1;
            let tail = b.get_attachment_chunk(&written.blob, last).await.expect("chunk").expect("the last chunk");
            assert_eq!(tail.len() as u64, len - last * chunk);
            assert!(b.get_attachment_chunk(&written.blob, written.chunks).await.expect("past the end").is_none());
        }
    }
    assert_eq!(blobs(b, 100).await.len(), 5, "one blob per non-empty content");
}

/// The backend, counting the chunks read through it.
struct CountingChunkReads {
    inner: Arc<dyn DocumentBackend>,
    reads: Arc<AtomicU64>,
}

#[async_trait::async_trait]
impl Layered for CountingChunkReads {
    fn inner(&self) -> &dyn DocumentBackend {
        self.inner.as_ref()
    }

    async fn get_attachment_chunk(&self, blob: &str, index: u64) -> agentstore::Result<Option<Bytes>> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        self.inner.get_attachment_chunk(blob, index).await
    }
}

pub async fn attachment_ranges_read_only_what_they_cover(ctx: Ctx) {
    if not_applicable(&ctx).await {
        return;
    }
    let chunk = ctx.backend.attachment_chunk_bytes() as u64;
    let reads = Arc::new(AtomicU64::new(0));
    let counted = CountingChunkReads { inner: Arc::clone(&ctx.backend), reads: Arc::clone(&reads) };
    let store = AttachmentStore::new(Arc::new(counted));
    let len = 2 * chunk + 100;
    let whole = content(7, len);
    let written = stored(&store, 7, len).await;
    // Each range with the chunks it covers.
    let ranges = [
        (0..1, 1),
        (0..len, 3),
        (chunk - 1..chunk + 1, 2),
        (chunk..chunk, 0),
        (chunk - 5..2 * chunk + 5, 3),
        (2 * chunk..len, 1),
        (len - 1..len, 1),
        (3..chunk, 1),
        (chunk..2 * chunk, 1),
        (len..len, 0),
    ];
    for (range, chunks) in ranges {
        let before = reads.load(Ordering::SeqCst);
        let read = read_all(&store, &written.sha256, Some(range.clone())).await;
        assert!(read == whole[range.start as usize..range.end as usize], "range {range:?} of {len}");
        assert_eq!(reads.load(Ordering::SeqCst) - before, chunks, "chunks read for {range:?}");
    }
    let past = store.read(&written.sha256, Some(len - 1..len + 1)).await.err().expect("a range past the end");
    assert_eq!(past.kind(), ErrorKind::InvalidInput, "{past}");
    let missing = store.read(&"0".repeat(64), None).await.err().expect("bytes never stored");
    assert_eq!(missing.kind(), ErrorKind::NotFound, "{missing}");
    assert_eq!(store.stat(&"0".repeat(64)).await.expect("stat"), None);
    assert_eq!(store.stat("not-a-sha").await.err().map(|e| e.kind()), Some(ErrorKind::InvalidInput));
}

pub async fn identical_attachments_are_stored_once(ctx: Ctx) {
    if not_applicable(&ctx).await {
        return;
    }
    let b = ctx.backend.as_ref();
    let chunk = b.attachment_chunk_bytes() as u64;
    let store = AttachmentStore::new(Arc::clone(&ctx.backend));
    let first = stored(&store, 8, chunk + 1).await;
    let second = stored(&store, 8, chunk + 1).await;
    assert_eq!(first, second, "the same bytes answer the same manifest, blob included");
    assert_eq!(blobs(b, 10).await, BTreeSet::from([first.blob.clone()]), "stored once");
    // Two uploads of the same bytes at once: one blob stays, both answer it.
    let (a, c) = tokio::join!(stored(&store, 9, 2 * chunk), stored(&store, 9, 2 * chunk));
    assert_eq!(a.blob, c.blob);
    // Many at once, as a `_bulk_docs` of documents carrying one attachment each (PouchDB's
    // replication tests send ten): every upload succeeds, none is a conflict.
    let uploads = (0..16).map(|_| store.write(generated(15, 40), UNBOUNDED));
    let answers = futures::future::join_all(uploads).await;
    let kept: BTreeSet<String> = answers
        .into_iter()
        .map(|answer| answer.expect("a concurrent upload of the same bytes succeeds").blob)
        .collect();
    assert_eq!(kept.len(), 1, "every concurrent upload answers the one manifest: {kept:?}");
    // Other bytes are another blob; listed page by page, each once.
    for seed in 10..14 {
        stored(&store, seed, 10).await;
    }
    let all = blobs(b, 100).await;
    assert_eq!(all.len(), 7, "{all:?}");
    for limit in [1, 2, 5] {
        assert_eq!(blobs(b, limit).await, all, "paged by {limit}");
    }
    assert_eq!(manifests(b).await.len(), 7);
    let (sha256, _) = expected_digests(8, chunk + 1);
    let (read, _) = hash_of(store.read(&sha256, None).await.expect("read")).await;
    assert_eq!(read, sha256);
}

/// The bytes `seed` makes, `len` of them, whole.
fn bytes_of(seed: u64, len: u64) -> Bytes {
    Bytes::from((0..len).map(|at| byte_at(seed, at)).collect::<Vec<u8>>())
}

/// `AttachmentStore::write_small_many`: attachments of at most one chunk stored at once (on
/// Firestore one commit with their manifests), each read back byte for byte under the digests
/// computed here, identical bytes stored once, an empty one a manifest without chunks. Where
/// the backend writes them together (`put_small_attachments` answers other than `Ok(false)`),
/// a write one of whose manifests exists stores nothing at all (no chunk, no manifest of the
/// others: the all-or-nothing the ordering rule rests on), and the store then stores each as
/// one upload does, the existing manifest kept.
pub async fn small_attachments_are_stored_with_their_manifests_at_once(ctx: Ctx) {
    if not_applicable(&ctx).await {
        return;
    }
    let b = ctx.backend.as_ref();
    let chunk = b.attachment_chunk_bytes() as u64;
    let store = AttachmentStore::new(Arc::clone(&ctx.backend));
    let items = [bytes_of(20, 4096), bytes_of(21, chunk), bytes_of(20, 4096), Bytes::new()];
    let stored = store.write_small_many(&items, UNBOUNDED).await.expect("write_small_many");
    assert_eq!(stored.len(), 4);
    for (blob, (seed, len)) in stored.iter().zip([(20, 4096), (21, chunk), (20, 4096), (1, 0)]) {
        let (sha256, digest) = expected_digests(seed, len);
        assert_eq!((&blob.sha256, &blob.digest, blob.length), (&sha256, &digest, len));
        assert_eq!(read_all(&store, &sha256, None).await, bytes_of(seed, len).to_vec(), "read back");
    }
    assert_eq!(stored[0], stored[2], "the same bytes answer the same manifest, blob included");
    assert_eq!(blobs(b, 10).await.len(), 2, "identical bytes stored once, the empty ones in no chunk");
    assert_eq!(manifests(b).await.len(), 3);

    let (fresh, existing) = (bytes_of(22, 100), bytes_of(20, 4096));
    let fresh_sha = expected_digests(22, 100).0;
    let small = |blob: &str, bytes: &Bytes, sha256: &str| SmallAttachment {
        blob: blob.to_owned(),
        bytes: bytes.clone(),
        manifest: format!("{MANIFEST_PREFIX}{sha256}"),
        manifest_body: body(json!({ "blob": blob, "length": bytes.len(), "chunks": 1, "chunk_bytes": chunk })),
    };
    let together = [small("u1-fresh", &fresh, &fresh_sha), small("u1-again", &existing, &stored[0].sha256)];
    match b.put_small_attachments(&together).await {
        Ok(false) => println!("{}: writes small attachments one at a time", ctx.backend_name),
        Ok(true) => panic!("a write of small attachments one of whose manifests exists succeeded"),
        Err(err) => {
            assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
            assert_eq!(blobs(b, 10).await.len(), 2, "no chunk of the refused write stored");
            let manifest = b.get_local(&format!("{MANIFEST_PREFIX}{fresh_sha}")).await.expect("get_local");
            assert!(manifest.is_none(), "no manifest of the refused write stored");
        }
    }
    let again = store.write_small_many(&[fresh.clone(), existing], UNBOUNDED).await.expect("write_small_many");
    assert_eq!(again[1], stored[0], "the bytes stored before keep their manifest and blob");
    assert_eq!(read_all(&store, &fresh_sha, None).await, fresh.to_vec());
    assert_eq!(blobs(b, 10).await.len(), 3, "the refused write's blob names left nothing behind");
    let too_large = store.write_small_many(&[bytes_of(23, chunk + 1)], UNBOUNDED).await;
    assert_eq!(too_large.map(|_| ()).unwrap_err().kind(), ErrorKind::TooLarge, "past one chunk");
}

pub async fn interrupted_and_oversized_uploads_leave_nothing(ctx: Ctx) {
    if not_applicable(&ctx).await {
        return;
    }
    let b = ctx.backend.as_ref();
    let chunk = b.attachment_chunk_bytes() as u64;
    let store = AttachmentStore::new(Arc::clone(&ctx.backend));
    // A client that goes away after a chunk and a half.
    let cut = generated(15, chunk + chunk / 2)
        .chain(futures::stream::iter([Err(Error::new(ErrorKind::Unavailable, "the client went away"))]));
    let err = store.write(cut, UNBOUNDED).await.expect_err("an interrupted upload fails");
    assert_eq!((err.kind(), err.message()), (ErrorKind::Unavailable, "the client went away"));
    assert!(blobs(b, 10).await.is_empty(), "no chunk left behind");
    assert!(manifests(b).await.is_empty(), "no manifest");
    // An upload whose task is dropped after writing a chunk (a request cancelled mid-body):
    // its chunks are deleted by a task of their own.
    let (reached, reached_rx) = tokio::sync::oneshot::channel::<()>();
    let stalled = generated(17, chunk).chain(futures::stream::once(async move {
        let _ = reached.send(());
        futures::future::pending::<agentstore::Result<Bytes>>().await
    }));
    let upload = {
        let store = store.clone();
        tokio::spawn(async move { store.write(stalled, UNBOUNDED).await })
    };
    reached_rx.await.expect("the upload wrote its first chunk and waits for more");
    assert_eq!(blobs(b, 10).await.len(), 1, "the chunk written so far");
    upload.abort();
    assert!(upload.await.expect_err("aborted").is_cancelled());
    let mut left = blobs(b, 10).await;
    for _ in 0..600 {
        if left.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        left = blobs(b, 10).await;
    }
    assert!(left.is_empty(), "a dropped upload's chunks are deleted: {left:?}");
    assert!(manifests(b).await.is_empty(), "no manifest");
    // One past the bound: refused naming the setting, nothing left.
    let err = store.write(generated(16, 2 * chunk + 1), 2 * chunk).await.expect_err("over the bound");
    assert_eq!(err.kind(), ErrorKind::TooLarge, "{err}");
    assert!(err.to_string().contains("couchdb_max_attachment_bytes"), "{err}");
    assert!(blobs(b, 10).await.is_empty(), "no chunk left behind");
    assert!(manifests(b).await.is_empty(), "no manifest");
    // Exactly at the bound is stored.
    let at_bound = store.write(generated(16, 2 * chunk), 2 * chunk).await.expect("at the bound");
    assert_eq!(at_bound.length, 2 * chunk);
}

pub async fn garbage_collection_keeps_referenced_and_fresh_bytes(ctx: Ctx) {
    if not_applicable(&ctx).await {
        return;
    }
    let b = ctx.backend.as_ref();
    let chunk = b.attachment_chunk_bytes() as u64;
    let store = AttachmentStore::new(Arc::clone(&ctx.backend));
    let referenced = stored(&store, 20, chunk + 1).await;
    let unreferenced = stored(&store, 21, 2 * chunk + 1).await;
    let fresh_unreferenced = stored(&store, 22, 5).await;
    // Time passes for the first two: their manifests say they were stored in 1970.
    for kept in [&referenced, &unreferenced] {
        let name = format!("{MANIFEST_PREFIX}{}", kept.sha256);
        let mut manifest = b.get_local(&name).await.expect("get_local").expect("the manifest");
        manifest.body.insert("stored_ms".into(), json!(1000));
        b.put_local(&name, &manifest.body, Precondition::MatchRevision(manifest.rev)).await.expect("age it");
    }
    // A crash left an upload of 1970 without a manifest; an upload in progress has none yet.
    let old_orphan = "u1000-00000000000000aa";
    let in_progress = format!(
        "u{}-00000000000000bb",
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis()
    );
    for blob in [old_orphan, in_progress.as_str()] {
        b.put_attachment_chunk(blob, 0, Bytes::from_static(b"partial")).await.expect("put chunk");
    }
    let collected =
        store.collect_garbage(|| async { Ok(HashSet::from([referenced.sha256.clone()])) }).await.expect("collect");
    assert_eq!((collected.manifests, collected.blobs), (1, 2), "{collected:?}");
    assert_eq!(collected.chunks, unreferenced.chunks + 1, "{collected:?}");
    let left = blobs(b, 10).await;
    let expected = BTreeSet::from([referenced.blob.clone(), fresh_unreferenced.blob.clone(), in_progress.clone()]);
    assert_eq!(left, expected);
    assert!(store.stat(&unreferenced.sha256).await.expect("stat").is_none());
    let (read, _) = hash_of(store.read(&referenced.sha256, None).await.expect("read")).await;
    assert_eq!(read, referenced.sha256, "referenced bytes intact");
    assert!(store.stat(&fresh_unreferenced.sha256).await.expect("stat").is_some(), "young manifests stay");
    // With no grace, everything unreferenced goes; the referenced bytes still stay.
    let sweeping = store.clone().with_grace(Duration::ZERO);
    let collected =
        sweeping.collect_garbage(|| async { Ok(HashSet::from([referenced.sha256.clone()])) }).await.expect("collect");
    assert_eq!((collected.manifests, collected.blobs), (1, 2), "{collected:?}");
    assert_eq!(blobs(b, 10).await, BTreeSet::from([referenced.blob.clone()]));
    assert_eq!(manifests(b).await, [format!("_local/{MANIFEST_PREFIX}{}", referenced.sha256)]);
    // Stored again after its manifest went, the same bytes are a new blob that reads back.
    let again = stored(&store, 21, 2 * chunk + 1).await;
    assert_ne!(again.blob, unreferenced.blob);
    let (read, _) = hash_of(store.read(&again.sha256, None).await.expect("read")).await;
    assert_eq!(read, unreferenced.sha256);
}

pub async fn attachment_chunks_are_invisible_to_documents(ctx: Ctx) {
    if not_applicable(&ctx).await {
        return;
    }
    let b = ctx.backend.as_ref();
    let chunk = b.attachment_chunk_bytes() as u64;
    let doc = json!({ "userId": "u", "namespace": "ns", "key": "k", "value": 1 });
    b.put("u:ns:k", &body(doc), Precondition::MustNotExist).await.expect("put");
    let store = AttachmentStore::new(Arc::clone(&ctx.backend));
    let written = stored(&store, 30, 3 * chunk + 7).await;
    let ids = |docs: Vec<agentstore::backend::StoredDocument>| docs.into_iter().map(|d| d.id).collect::<Vec<_>>();
    let everything = IdRange { include_design: true, ..IdRange::all() };
    assert_eq!(ids(b.all_docs(&everything, 100, None).await.expect("all_docs").items), ["u:ns:k"]);
    let texts = b.all_docs_text(&everything, 100, None).await.expect("all_docs_text").items;
    assert_eq!(texts.iter().map(|t| t.id.as_str()).collect::<Vec<_>>(), ["u:ns:k"]);
    let feed = b.changes(None, 100).await.expect("changes");
    assert_eq!(feed.changes.iter().map(|c| c.id.as_str()).collect::<Vec<_>>(), ["u:ns:k"]);
    if let Some(count) = b.exact_count().await.expect("exact_count") {
        assert_eq!(count, 1, "chunks are not counted");
    }
    // Every page of the scan: a page may end early, even empty (DynamoDB reads at most 1 MB of
    // items a page, chunk items included, and drops those).
    let (mut scanned, mut token) = (Vec::new(), None::<String>);
    for _ in 0..1000 {
        let page = b.scan(100, token.as_deref()).await.expect("scan");
        scanned.extend(ids(page.items));
        token = page.next;
        if token.is_none() {
            break;
        }
    }
    assert!(token.is_none(), "the scan kept paging");
    assert_eq!(scanned, ["u:ns:k"]);
    let query = Query { user_id: "u".into(), namespace: None, projection: Projection::All };
    assert_eq!(ids(b.query(&query, 100, None).await.expect("query").items), ["u:ns:k"]);
    // Only the manifest among the local documents; none at all in a database's clients' listing.
    let locals = ids(b.local_docs(&IdRange::all(), 100, None).await.expect("local_docs").items);
    assert_eq!(locals, [format!("_local/{MANIFEST_PREFIX}{}", written.sha256)]);
    let database = Database::new("contract".into(), Arc::clone(&ctx.backend));
    assert!(database.local_docs(&IdRange::all(), 100, None).await.expect("local_docs").items.is_empty());
    // Reads by the ids a chunk is kept under on any backend answer nothing.
    let chunk_ids: Vec<String> = [
        format!("_attachment/{}/{:016x}", written.blob, 0),
        format!("{}.{:016x}", written.blob, 0),
        written.blob.clone(),
    ]
    .into();
    for id in &chunk_ids {
        assert!(b.get(id).await.expect("get").is_none(), "{id}");
        assert!(b.get_deleted(id).await.expect("get_deleted").is_none(), "{id}");
        assert!(b.revisions(id).await.expect("revisions").is_none(), "{id}");
    }
    assert!(b.get_many(&chunk_ids).await.expect("get_many").iter().all(Option::is_none));
    // Erasing every document by prefix leaves the bytes (garbage collection frees them).
    if ctx.no_purge.is_none() {
        b.erase_prefix("u:").await.expect("erase");
        let (read, _) = hash_of(store.read(&written.sha256, None).await.expect("read")).await;
        assert_eq!(read, written.sha256);
    }
}

pub async fn a_dropped_database_takes_its_attachments(ctx: Ctx) {
    if not_applicable(&ctx).await {
        return;
    }
    let url: BackendUrl = ctx.backend_url.parse().expect("the harness's backend URL parses");
    let catalog = open_catalog(&url).await.expect("open_catalog");
    let name = DbName::parse(&format!("att{}x{}", std::process::id(), ctx.backend_name)).expect("a name");
    let database = catalog.create(&name).await.expect("create");
    let chunk = database.attachment_chunk_bytes() as u64;
    let store = AttachmentStore::new(Arc::clone(&database));
    let written = stored(&store, 40, 2 * chunk + 1).await;
    assert_eq!(blobs(database.as_ref(), 10).await, BTreeSet::from([written.blob.clone()]));
    assert!(Catalog::delete(catalog.as_ref(), &name).await.expect("drop"));
    match ctx.backend_name {
        // The file is deleted; a handle opened before keeps its unlinked file until it is let
        // go, when the space is freed.
        "embedded" => println!("embedded: the dropped database's file is deleted with its chunks"),
        // The table or the instance's documents are gone: the handle opened before lists no
        // chunk (or cannot find its table).
        _ => match database.attachment_blobs(10, None).await {
            Ok(page) => assert!(page.items.is_empty(), "chunks left after the drop: {:?}", page.items),
            Err(err) => assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}"),
        },
    }
    let recreated = catalog.create(&name).await.expect("create again");
    assert!(blobs(recreated.as_ref(), 10).await.is_empty(), "a re-created database starts without chunks");
    assert!(manifests(recreated.as_ref()).await.is_empty());
    assert!(Catalog::delete(catalog.as_ref(), &name).await.expect("drop again"));
}

/// The backend, pausing a collection's scan of the documents once between its first page and
/// its second (issue 35): armed, the scan's first page (`all_docs` with design documents) is read
/// one document long, and the request of the second waits for the test to resume it.
struct PausedScan {
    inner: Arc<dyn DocumentBackend>,
    /// Told when the scan is paused; awaited to resume it. `None` once used (or never armed).
    pause: std::sync::Mutex<Option<(tokio::sync::oneshot::Sender<()>, tokio::sync::oneshot::Receiver<()>)>>,
}

#[async_trait::async_trait]
impl Layered for PausedScan {
    fn inner(&self) -> &dyn DocumentBackend {
        self.inner.as_ref()
    }

    async fn all_docs(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> agentstore::Result<agentstore::backend::Page<agentstore::backend::StoredDocument>> {
        let armed = self.pause.lock().expect("the pause's lock").is_some();
        if !armed || !range.include_design {
            return self.inner.all_docs(range, limit, page_token).await;
        }
        if page_token.is_none() {
            return self.inner.all_docs(range, 1, None).await;
        }
        let taken = self.pause.lock().expect("the pause's lock").take();
        if let Some((paused, resume)) = taken {
            let _ = paused.send(());
            let _ = resume.await;
        }
        self.inner.all_docs(range, limit, page_token).await
    }
}

/// How the reference to the source's bytes is written while the collection is paused.
#[derive(Debug, Clone, Copy)]
enum NewReference {
    /// `COPY /{db}/b` with `Destination: a0`: the source's leaf body, kept attachments and all,
    /// written as a new document (what `copy_document` does).
    Copy,
    /// A replicator's `_bulk_docs` with `new_edits: false`: a new document whose attachment has
    /// the same bytes, so its upload touches the existing manifest and stores nothing new.
    ReplicatedSameBytes,
}

/// Issue 35, §1: a reference written while a collection runs keeps its bytes. `b` holds an
/// attachment; a collection (no grace period) is paused after the first page of its scan of the
/// documents (`a1`); meanwhile the reference is written into `a0` (which sorts before the page's
/// end, so the scan does not see it) and `b` is deleted (so the scan finds no reference in it).
/// Resumed, the collection must keep the bytes, and `a0`'s attachment reads back byte-exact, on
/// every backend.
pub async fn a_reference_written_during_a_collection_keeps_its_bytes(ctx: Ctx) {
    if not_applicable(&ctx).await {
        return;
    }
    // Each round's ids sort before the last's, so its scan's first page is its own filler.
    for (how, prefix) in [(NewReference::Copy, "m-"), (NewReference::ReplicatedSameBytes, "f-")] {
        reference_during_collection(&ctx, how, prefix).await;
    }
}

async fn reference_during_collection(ctx: &Ctx, how: NewReference, prefix: &str) {
    let [a0, a1, b] = ["a0", "a1", "b"].map(|id| format!("{prefix}{id}"));
    use agentstore::database::doc_attachments;
    use agentstore::database::{Write, Written};
    let layer = Arc::new(PausedScan { inner: Arc::clone(&ctx.backend), pause: std::sync::Mutex::new(None) });
    let database = Arc::new(
        Database::new("contract".into(), Arc::clone(&layer) as Arc<dyn DocumentBackend>)
            .with_attachment_bounds(UNBOUNDED, Duration::ZERO),
    );
    let bytes = content(50 + how as u64, 1000);
    let (sha256, _) = expected_digests(50 + how as u64, 1000);
    let with_attachment = || {
        use base64::Engine as _;
        let data = base64::engine::general_purpose::STANDARD.encode(&bytes);
        body(json!({"v": 1, "_attachments": {"f.bin": {"content_type": "application/octet-stream", "data": data}}}))
    };
    let edit = |body: Map<String, Value>| Write::Edit { parent: None, deleted: false, body };
    database.write(&a1, &edit(body(json!({"filler": true})))).await.expect("write a1");
    let mut source = with_attachment();
    let none = std::collections::HashMap::new();
    doc_attachments::prepare(database.attachments(), UNBOUNDED, &mut source, &none).await.expect("store b's bytes");
    let Written::Edited(b_rev) = database.write(&b, &edit(source)).await.expect("write b") else {
        panic!("an edit answered as a merge");
    };

    let (paused_tx, paused) = tokio::sync::oneshot::channel();
    let (resume, resume_rx) = tokio::sync::oneshot::channel();
    *layer.pause.lock().expect("the pause's lock") = Some((paused_tx, resume_rx));
    let collecting = tokio::spawn({
        let database = Arc::clone(&database);
        async move { database.collect_attachment_garbage().await }
    });
    tokio::time::timeout(Duration::from_secs(60), paused).await.expect("the scan pauses").expect("paused");

    match how {
        NewReference::Copy => {
            let state = database.read(&b).await.expect("read b").expect("b exists");
            let leaf = state.tree.winner().expect("b's winner");
            database.write(&a0, &edit(leaf.body.clone())).await.expect("copy b to a0");
        }
        NewReference::ReplicatedSameBytes => {
            let mut copy = with_attachment();
            doc_attachments::prepare(database.attachments(), UNBOUNDED, &mut copy, &none).await.expect("store a0's");
            let path = agentstore::database::rev_tree::RevPath { start: 1, ids: vec!["0123456789abcdef".into()] };
            let answers = database
                .write_many(&[(a0.clone(), vec![Write::Replicated { path, deleted: false, body: copy }])])
                .await
                .expect("write_many");
            assert!(answers.iter().all(|answer| answer.as_ref().is_ok_and(|a| a.iter().all(Result::is_ok))));
        }
    }
    let deletion = Write::Edit { parent: Some(b_rev), deleted: true, body: Map::new() };
    database.write(&b, &deletion).await.expect("delete b");
    let _ = resume.send(());
    let collected = tokio::time::timeout(Duration::from_secs(60), collecting)
        .await
        .expect("the collection ends")
        .expect("the collection's task")
        .expect("the collection");
    // And one more, after any the deletion asked for in the background.
    database.collect_attachment_garbage().await.expect("a later collection");

    let state = database.read(&a0).await.expect("read a0").expect("a0 exists");
    let leaf = state.tree.winner().expect("a0's winner");
    let kept = doc_attachments::kept(&leaf.body, "f.bin").expect("a0 keeps the attachment");
    assert_eq!(kept.sha256, sha256, "{how:?}");
    let stream = database.attachments().read(&kept.sha256, None).await;
    let stream = stream.unwrap_or_else(|err| panic!("{how:?}: a0's bytes were freed ({collected:?}): {err}"));
    let (read, len) = hash_of(stream).await;
    assert_eq!((read, len), (sha256, bytes.len() as u64), "{how:?}: a0's bytes read back");

    // Bytes stored for a write and collected before it (no grace period): the write fails with
    // a conflict instead of referencing nothing.
    let mut late = body(json!({"_attachments": {"g.bin": {"data": "bGF0ZQ=="}}}));
    doc_attachments::prepare(database.attachments(), UNBOUNDED, &mut late, &none).await.expect("store late bytes");
    database.collect_attachment_garbage().await.expect("collect the unreferenced bytes");
    let refused = database.write(&format!("{prefix}late"), &edit(late)).await.expect_err("the write refused");
    assert_eq!(refused.kind(), ErrorKind::Conflict, "{how:?}: {refused}");
    assert!(database.read(&format!("{prefix}late")).await.expect("read").is_none(), "{how:?}: nothing written");
}

/// What a save does to the manifests its tree references (`AttachmentStore::keep_referenced`):
/// one stored within half the grace period is left as it is; an older one is stored again with a
/// fresh time (a new revision, so a collection that listed it before deletes nothing); one that
/// is gone fails the save when the reference is new, and is let be when the tree held it.
pub async fn saves_touch_the_manifests_they_reference(ctx: Ctx) {
    if not_applicable(&ctx).await {
        return;
    }
    let b = ctx.backend.as_ref();
    let store = AttachmentStore::new(Arc::clone(&ctx.backend)).with_grace(Duration::from_secs(3600));
    let fresh = stored(&store, 60, 10).await;
    let stale = stored(&store, 61, 10).await;
    let name = |sha256: &str| format!("{MANIFEST_PREFIX}{sha256}");
    let mut aged = b.get_local(&name(&stale.sha256)).await.expect("get_local").expect("the manifest");
    aged.body.insert("stored_ms".into(), json!(1000));
    b.put_local(&name(&stale.sha256), &aged.body, Precondition::MatchRevision(aged.rev)).await.expect("age it");
    let before =
        |sha256: String| async move { b.get_local(&name(&sha256)).await.expect("get_local").expect("manifest") };
    let (fresh_before, stale_before) = (before(fresh.sha256.clone()).await, before(stale.sha256.clone()).await);

    let both = HashSet::from([fresh.sha256.clone(), stale.sha256.clone()]);
    store.keep_referenced(&both, &both).await.expect("keep both");
    let fresh_after = before(fresh.sha256.clone()).await;
    let stale_after = before(stale.sha256.clone()).await;
    assert_eq!(fresh_after.rev, fresh_before.rev, "a fresh manifest is not written");
    assert_ne!(stale_after.rev, stale_before.rev, "a stale manifest is stored again");
    let stored_ms = stale_after.body.get("stored_ms").and_then(Value::as_u64).expect("stored_ms");
    assert!(stored_ms > 1000, "with a fresh time: {stored_ms}");
    for field in ["blob", "length", "digest", "chunks", "chunk_bytes"] {
        assert_eq!(stale_after.body.get(field), stale_before.body.get(field), "{field} kept");
    }
    let (read, _) = hash_of(store.read(&stale.sha256, None).await.expect("read")).await;
    assert_eq!(read, stale.sha256);

    let gone = "0".repeat(64);
    let with_gone = HashSet::from([fresh.sha256.clone(), gone.clone()]);
    let refused = store.keep_referenced(&with_gone, &HashSet::from([gone.clone()])).await;
    assert_eq!(refused.err().map(|err| err.kind()), Some(ErrorKind::Conflict), "a new reference to nothing");
    store.keep_referenced(&with_gone, &HashSet::new()).await.expect("a reference the tree held already");
}
