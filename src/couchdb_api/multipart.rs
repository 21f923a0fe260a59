//! CouchDB's multipart bodies, streamed both ways: reading a `multipart/related` document upload
//! (`PUT /{db}/{doc}`, also `?new_edits=false` from CouchDB's replicator), decoding its
//! gzip-encoded attachment parts ([`Gunzip`]), and writing `multipart/related`
//! (`GET /{db}/{doc}?attachments=true`), `multipart/mixed` (`GET /{db}/{doc}?open_revs=…`) and
//! `_bulk_get` ([`bulk_get_response`], a framing of its own) answers, and deciding from `Accept`
//! when to ([`accepts`], [`bulk_get_multipart_type`]). Attachment bytes pass through as streams
//! and are never held whole; only the document's JSON is read into memory, within the request
//! limits.
//!
//! ## Framing (CouchDB 3.x, `couch_httpd_multipart.erl` and `chttpd_db.erl`)
//! A `multipart/related` document is `--B`, `\r\nContent-Type: application/json\r\n\r\n`, the
//! JSON, then per attachment `\r\n--B`, `\r\nContent-Disposition: attachment; filename="NAME"`,
//! `\r\nContent-Type: TYPE`, `\r\nContent-Length: N` (and `\r\nContent-Encoding: gzip` when the
//! bytes are sent encoded), `\r\n\r\n` and the bytes; it ends `\r\n--B--` with no line break
//! after it. The response's `Content-Type` quotes the boundary
//! (`multipart/related; boundary="B"`); a document with no attachment to send is plain
//! `application/json`. A `multipart/mixed` answer has one part per requested leaf, each with a
//! `Content-Type` header only: `multipart/related; boundary="I"` (the document as above) or
//! `application/json` when it has no attachment to send, or `application/json; error="true"` with
//! `{"missing": REV}`. Boundaries are 32 random hex digits, as CouchDB's `couch_uuids:random()`.
//!
//! The JSON part's `_attachments` entries that say `follows: true` are matched to the parts after
//! it **in order**, as CouchDB does (its parser ignores the attachment parts' headers), and each
//! part carries exactly `length` bytes, or `encoded_length` when the entry has an `encoding`.
//! CouchDB's replicator reads a `multipart/mixed` part's type exactly (`application/json` with no
//! parameter, or `application/json; error="true"`); PouchDB's replicator never asks for
//! multipart (it fetches attachments one by one), so CouchDB's replicator is the reader that
//! matters. docs/attachments.md ("Multipart") states the bounds and the differences.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::future::BoxFuture;
use futures::stream::{self, BoxStream};
use futures::{FutureExt, Stream, StreamExt, TryStreamExt};
use serde_json::{Map, Value};

use super::error::{CouchError, CouchResult};
use super::request::Bodies;
use crate::error::{Error, ErrorKind};

/// Most parts one `multipart/related` upload may have, the JSON part included: the same bound as
/// the documents of one `_bulk_docs`. Each attachment part costs a store round (a manifest), so
/// a body of countless empty parts is refused up front, from the JSON part's `follows` entries.
pub(crate) const MAX_RELATED_PARTS: usize = 10_000;

/// A stream of attachment bytes, as [`crate::database::attachments::AttachmentStore`] reads and
/// writes them.
pub(crate) type ByteStream = BoxStream<'static, crate::error::Result<Bytes>>;

// ---------------------------------------------------------------------------------------------
// Content negotiation
// ---------------------------------------------------------------------------------------------

/// Whether the request's body is `multipart/related` (a document with attachments that follow).
pub(crate) fn is_multipart_related(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .is_some_and(|mime| mime.trim().eq_ignore_ascii_case("multipart/related"))
}

/// Whether the request's `Accept` header accepts `content_type` the way CouchDB decides it
/// (mochiweb's `accepts_content_type`): no `Accept` header counts as `*/*`; the type is accepted
/// when `*/*`, its `main/*` or itself has a quality above zero, unless the type itself or its
/// `main/*` is listed with quality zero. So a client sending `Accept: */*` (curl) or nothing gets
/// multipart from CouchDB; clients wanting JSON send `Accept: application/json` (PouchDB does).
/// An unparsable quality accepts nothing.
pub(crate) fn accepts(headers: &HeaderMap, content_type: &str) -> bool {
    let mut values = headers.get_all(header::ACCEPT).iter().peekable();
    let accept = if values.peek().is_none() {
        "*/*".to_owned()
    } else {
        let mut joined = Vec::new();
        for value in values {
            match value.to_str() {
                Ok(text) => joined.push(text.to_owned()),
                Err(_) => return false,
            }
        }
        joined.join(",")
    };
    let wanted = content_type.to_ascii_lowercase();
    let Some((main, _)) = wanted.split_once('/') else { return false };
    let super_type = format!("{main}/*");
    let mut ranges = Vec::new();
    for range in accept.split(',').map(str::trim).filter(|range| !range.is_empty()) {
        let mut pieces = range.split(';').map(str::trim);
        let media = pieces.next().unwrap_or_default().to_ascii_lowercase();
        let mut quality = 1.0_f64;
        for parameter in pieces {
            if let Some((name, value)) = parameter.split_once('=') {
                if name.trim().eq_ignore_ascii_case("q") {
                    match value.trim().parse::<f64>() {
                        Ok(q) if (0.0..=1.0).contains(&q) => quality = q,
                        _ => return false,
                    }
                }
            }
        }
        ranges.push((media, quality));
    }
    let accepted =
        ranges.iter().any(|(media, q)| *q > 0.0 && (media == "*/*" || *media == wanted || *media == super_type));
    let refused = ranges.iter().any(|(media, q)| *q == 0.0 && (*media == wanted || *media == super_type));
    accepted && !refused
}

// ---------------------------------------------------------------------------------------------
// Reading a multipart/related upload
// ---------------------------------------------------------------------------------------------

/// The bounds of one `multipart/related` upload besides the JSON part's, which is held to the
/// request limits of [`Bodies`] (the endpoint's limit, the body budgets, the parse budget).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RelatedLimits {
    /// The largest attachment, in bytes as sent (`couchdb_max_attachment_bytes`; `u64::MAX` when
    /// unset). Past it: 413 `attachment_too_large` naming the attachment, as CouchDB answers.
    pub max_attachment_bytes: u64,
    /// The most parts, the JSON part included ([`MAX_RELATED_PARTS`] by default).
    pub max_parts: usize,
}

impl RelatedLimits {
    /// Attachments of at most `max_attachment_bytes` (`u64::MAX`: no bound, as
    /// `Database::max_attachment_bytes` gives it when the setting is unset), at most
    /// [`MAX_RELATED_PARTS`] parts.
    pub fn new(max_attachment_bytes: u64) -> Self {
        RelatedLimits { max_attachment_bytes, max_parts: MAX_RELATED_PARTS }
    }
}

/// An attachment the JSON part says follows (`follows: true`), in the order its part comes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FollowingAttachment {
    pub name: String,
    /// The entry's `content_type`, if it has one (CouchDB's default is
    /// `application/octet-stream`; the part's own `Content-Type` header is ignored, as CouchDB
    /// ignores it).
    pub content_type: Option<String>,
    /// The entry's `length`: the attachment's size once decoded.
    pub length: Option<u64>,
    /// The entry's `encoding` (`gzip`) when the bytes are sent encoded.
    pub encoding: Option<String>,
    /// The bytes the part must carry: `encoded_length` (else `length`) when encoded, `length`
    /// otherwise; `None` when the entry gives no length (then the part's end ends the bytes).
    pub part_length: Option<u64>,
    /// The entry's `digest` when it is CouchDB's `md5-…`: the MD5 of the part's bytes as sent
    /// (encoded ones when encoded, as CouchDB checks it); other digests are not checked, as
    /// CouchDB ignores them.
    pub digest: Option<String>,
}

/// Where the attachments of an upload go: called once per attachment, in order, with the bytes
/// of its part as a stream, and returning what it stored. Any `FnMut(FollowingAttachment,
/// AttachmentBytes) -> impl Future<Output = CouchResult<T>> + Send` is one.
///
/// The sink must read the stream to its end (as `AttachmentStore::write` does). When the part is
/// malformed (longer or shorter than its length, past the bound, the body cut off) the stream
/// ends with an error item; the sink should then discard what it wrote and fail, and the upload
/// answers with the part's error, not the sink's.
pub(crate) trait AttachmentSink {
    type Stored;
    fn store(
        &mut self,
        attachment: FollowingAttachment,
        bytes: AttachmentBytes,
    ) -> impl Future<Output = CouchResult<Self::Stored>> + Send;
}

impl<F, Fut, T> AttachmentSink for F
where
    F: FnMut(FollowingAttachment, AttachmentBytes) -> Fut,
    Fut: Future<Output = CouchResult<T>> + Send,
{
    type Stored = T;
    fn store(
        &mut self,
        attachment: FollowingAttachment,
        bytes: AttachmentBytes,
    ) -> impl Future<Output = CouchResult<T>> + Send {
        self(attachment, bytes)
    }
}

/// An attachment as the sink stored it.
#[derive(Debug)]
pub(crate) struct StoredAttachment<T> {
    pub attachment: FollowingAttachment,
    pub stored: T,
}

/// A `multipart/related` upload whose JSON part has been read; its attachment parts are still
/// unread, so the caller can check the document (revision, permissions) before any byte is
/// stored.
pub(crate) struct RelatedUpload {
    document: Value,
    following: Vec<FollowingAttachment>,
    parts: multer::Multipart<'static>,
    flow: Arc<Flow>,
    limits: RelatedLimits,
}

/// A `multipart/related` upload read to its end.
pub(crate) struct RelatedDocument<T> {
    /// The JSON part (its `_attachments` entries still say `follows: true`).
    pub document: Value,
    /// The attachments, in the order they came.
    pub attachments: Vec<StoredAttachment<T>>,
}

impl RelatedUpload {
    /// Reads a `multipart/related` body up to the end of its JSON part. 400 for a body without a
    /// boundary, a JSON part that is not an object or has malformed `follows` entries, more
    /// `follows` entries than the part bound; 415 for a first part that is not
    /// `application/json` or a compressed body; 413 for a JSON part past the request limits or an
    /// entry whose length is past the attachment bound.
    pub async fn read(bodies: &Bodies, headers: &HeaderMap, body: Body, limits: RelatedLimits) -> CouchResult<Self> {
        let boundary = related_boundary(headers)?;
        if let Some(encoding) = headers.get(header::CONTENT_ENCODING) {
            let encoding = encoding.to_str().unwrap_or("").trim();
            if !encoding.is_empty() && !encoding.eq_ignore_ascii_case("identity") {
                return Err(CouchError::new(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "bad_content_type",
                    format!(
                        "Content-Encoding {encoding:?} is not supported on multipart bodies; send them uncompressed"
                    ),
                ));
            }
        }
        let flow = Arc::new(Flow::default());
        let source = BodyPieces::new(body.into_data_stream(), Arc::clone(&flow));
        let mut parts = multer::Multipart::new(source, boundary);
        let first = match parts.next_field().await {
            Ok(Some(field)) => field,
            Ok(None) => {
                return Err(CouchError::bad_request(
                    "the multipart body has no parts; the first must be the document's JSON",
                ))
            }
            Err(err) => return Err(malformed(&err)),
        };
        let json_type = first
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.split(';').next())
            .is_some_and(|mime| mime.trim().eq_ignore_ascii_case("application/json"));
        if !json_type {
            // CouchDB's answer (`couch_httpd_multipart:mp_parse_doc`).
            return Err(CouchError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "bad_content_type",
                "Content-Type must be application/json",
            ));
        }
        flow.part_begun();
        // Read like any JSON body: the endpoint's limit, the body budgets, the parse budget. The
        // budgets' shares are given back (with the `JsonBody`) as soon as it is parsed: held while
        // the attachments stream (minutes, for a large one) they would stall the other bodies of
        // the face. The tree stays bounded by the limit it was read within.
        let delivered = Arc::clone(&flow);
        let json_part = first.inspect_ok(move |chunk| {
            delivered.delivered.fetch_add(chunk.len() as u64, Ordering::SeqCst);
        });
        let document = bodies.read_json(&HeaderMap::new(), Body::from_stream(json_part)).await?;
        let Some(document) = document.map(|body| body.value) else {
            return Err(CouchError::bad_request("Document must be a JSON object"));
        };
        let Some(object) = document.as_object() else {
            return Err(CouchError::bad_request("Document must be a JSON object"));
        };
        let following = following_attachments(object, limits)?;
        Ok(RelatedUpload { document, following, parts, flow, limits })
    }

    /// The document, as its JSON part says (entries of attachments to come say `follows: true`).
    pub fn document(&self) -> &Value {
        &self.document
    }

    /// The attachments whose parts follow, in order.
    #[cfg(test)]
    pub fn following(&self) -> &[FollowingAttachment] {
        &self.following
    }

    /// Streams each attachment part into `sink`, in order, then checks the body ends there.
    /// 400 for a body with fewer or more attachment parts than the JSON part says follow, a
    /// part longer or shorter than its length, or a body cut off or malformed; 413
    /// `attachment_too_large` for a part past the attachment bound. Attachments stored before an
    /// error are left to the store's garbage collection (nothing references them).
    pub async fn store_attachments<S: AttachmentSink>(
        mut self,
        mut sink: S,
    ) -> CouchResult<RelatedDocument<S::Stored>> {
        let mut attachments = Vec::with_capacity(self.following.len());
        let total = self.following.len();
        for (index, attachment) in std::mem::take(&mut self.following).into_iter().enumerate() {
            let field = match self.parts.next_field().await {
                Ok(Some(field)) => field,
                Ok(None) => {
                    return Err(CouchError::bad_request(format!(
                        "the document says {total} attachments follow, the body has {index} attachment parts \
                         (attachment {:?} is missing)",
                        attachment.name
                    )))
                }
                Err(err) => return Err(malformed(&err)),
            };
            if field.headers().is_empty() {
                // A part without a header line is misread by the parser (its bytes up to the next
                // blank line are taken for headers), so it is refused rather than stored wrong.
                return Err(CouchError::bad_request(format!(
                    "the part of attachment {:?} has no header lines; send at least its Content-Type",
                    attachment.name
                )));
            }
            self.flow.part_begun();
            let state = Arc::new(Mutex::new(PartState::default()));
            let bytes = AttachmentBytes {
                field: Some(field),
                flow: Arc::clone(&self.flow),
                name: attachment.name.clone(),
                expected: attachment.part_length,
                max: self.limits.max_attachment_bytes,
                received: 0,
                state: Arc::clone(&state),
            };
            let result = sink.store(attachment.clone(), bytes).await;
            let (part_error, finished) = {
                let mut state = state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                (state.error.take(), state.finished)
            };
            if let Some(err) = part_error {
                return Err(err);
            }
            let stored = result?;
            if !finished {
                return Err(CouchError::internal(format!(
                    "the attachment store returned before the end of attachment {:?}'s part",
                    attachment.name
                )));
            }
            attachments.push(StoredAttachment { attachment, stored });
        }
        match self.parts.next_field().await {
            Ok(None) => {}
            Ok(Some(_)) => {
                return Err(CouchError::bad_request(format!(
                    "the body has more parts than the document's {total} attachments that follow"
                )))
            }
            Err(err) => return Err(malformed(&err)),
        }
        Ok(RelatedDocument { document: self.document, attachments })
    }
}

/// The boundary of a `multipart/related` request: 400 when there is none.
fn related_boundary(headers: &HeaderMap) -> CouchResult<String> {
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|value| value.to_str().ok()).unwrap_or("");
    let mut pieces = content_type.split(';');
    let mime = pieces.next().unwrap_or("").trim();
    if !mime.to_ascii_lowercase().starts_with("multipart/") {
        return Err(CouchError::bad_request(format!("expected a multipart/related body, not {mime:?}")));
    }
    let boundary = pieces.find_map(|parameter| {
        let (name, value) = parameter.split_once('=')?;
        name.trim().eq_ignore_ascii_case("boundary").then(|| value.trim())
    });
    let boundary = boundary.map(|value| value.strip_prefix('"').and_then(|v| v.strip_suffix('"')).unwrap_or(value));
    match boundary {
        // RFC 2046: 1 to 70 characters.
        Some(boundary) if (1..=70).contains(&boundary.len()) => Ok(boundary.to_owned()),
        Some(boundary) => Err(CouchError::bad_request(format!(
            "the multipart boundary must be 1 to 70 characters; {boundary:?} is {}",
            boundary.len()
        ))),
        None => Err(CouchError::bad_request("the multipart/related Content-Type has no boundary parameter")),
    }
}

/// The entries of `_attachments` that say `follows: true`, in order, checked against `limits`.
fn following_attachments(
    document: &Map<String, Value>,
    limits: RelatedLimits,
) -> CouchResult<Vec<FollowingAttachment>> {
    let Some(attachments) = document.get("_attachments") else { return Ok(Vec::new()) };
    let Some(attachments) = attachments.as_object() else {
        return Err(CouchError::bad_request("_attachments must be a JSON object"));
    };
    let mut following = Vec::new();
    for (name, entry) in attachments {
        let Some(entry) = entry.as_object() else {
            return Err(CouchError::bad_request(format!("attachment {name:?} must be a JSON object")));
        };
        if entry.get("follows") != Some(&Value::Bool(true)) || entry.get("stub") == Some(&Value::Bool(true)) {
            continue;
        }
        if following.len() + 2 > limits.max_parts {
            return Err(CouchError::bad_request(format!(
                "a multipart body may have at most {} parts; the document says more attachments follow",
                limits.max_parts
            )));
        }
        let length = optional_length(name, entry, "length")?;
        let encoding = match entry.get("encoding") {
            None | Some(Value::Null) => None,
            Some(Value::String(encoding)) => Some(encoding.clone()),
            Some(_) => return Err(CouchError::bad_request(format!("attachment {name:?}: encoding must be a string"))),
        };
        let part_length = match encoding {
            Some(_) => optional_length(name, entry, "encoded_length")?.or(length),
            None => length,
        };
        // The bound is on the bytes stored, which are the decoded ones: a declared `length` past
        // it is refused before any byte is read, as an encoded length past it is.
        let past_bound = |bytes: Option<u64>| bytes.is_some_and(|bytes| bytes > limits.max_attachment_bytes);
        if past_bound(part_length) || past_bound(length) {
            return Err(too_large(name));
        }
        let content_type = match entry.get("content_type") {
            None | Some(Value::Null) => None,
            Some(Value::String(content_type)) => Some(content_type.clone()),
            Some(_) => {
                return Err(CouchError::bad_request(format!("attachment {name:?}: content_type must be a string")))
            }
        };
        let digest = entry.get("digest").and_then(Value::as_str).filter(|d| d.starts_with("md5-")).map(str::to_owned);
        following.push(FollowingAttachment { name: name.clone(), content_type, length, encoding, part_length, digest });
    }
    Ok(following)
}

fn optional_length(name: &str, entry: &Map<String, Value>, field: &str) -> CouchResult<Option<u64>> {
    match entry.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(value) => value.as_u64().map(Some).ok_or_else(|| {
            CouchError::bad_request(format!("attachment {name:?}: {field} must be a non-negative integer, not {value}"))
        }),
    }
}

/// CouchDB's answer to an attachment past `max_attachment_size`.
fn too_large(name: &str) -> CouchError {
    CouchError::new(StatusCode::PAYLOAD_TOO_LARGE, "attachment_too_large", name)
}

fn malformed(err: &multer::Error) -> CouchError {
    // The cause (a body read failing, the framing bound) is multer's error's source.
    match std::error::Error::source(err) {
        Some(cause) => CouchError::bad_request(format!("malformed multipart body: {err}: {cause}")),
        None => CouchError::bad_request(format!("malformed multipart body: {err}")),
    }
}

/// What the parser learned about a part while the sink read it.
#[derive(Default)]
struct PartState {
    /// Why the part is refused, when it is (the answer, whatever the sink returns).
    error: Option<CouchError>,
    /// The part was read to its end, its length checked.
    finished: bool,
}

/// The bytes of one attachment part, chunk by chunk as they arrive: an error item (and the end)
/// when the part goes past its length or the attachment bound, ends short of its length, or the
/// body breaks off. Only the chunk being handed over is held.
pub(crate) struct AttachmentBytes {
    field: Option<multer::Field<'static>>,
    flow: Arc<Flow>,
    name: String,
    expected: Option<u64>,
    max: u64,
    received: u64,
    state: Arc<Mutex<PartState>>,
}

impl AttachmentBytes {
    /// Records why the part is refused and ends the stream with an error item for the sink.
    fn refuse(&mut self, answer: CouchError) -> Poll<Option<crate::error::Result<Bytes>>> {
        self.field = None;
        let item = Error::new(
            if answer.status == StatusCode::PAYLOAD_TOO_LARGE { ErrorKind::TooLarge } else { ErrorKind::InvalidInput },
            format!("attachment {:?}: {}", self.name, answer.reason),
        );
        let mut state = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        state.error.get_or_insert(answer);
        Poll::Ready(Some(Err(item)))
    }
}

impl Stream for AttachmentBytes {
    type Item = crate::error::Result<Bytes>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let Some(field) = this.field.as_mut() else { return Poll::Ready(None) };
        match field.poll_next_unpin(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(chunk))) => {
                this.flow.delivered.fetch_add(chunk.len() as u64, Ordering::SeqCst);
                this.received = this.received.saturating_add(chunk.len() as u64);
                if this.expected.is_some_and(|expected| this.received > expected) {
                    // CouchDB's words (`couch_att:write_streamed_attachment`).
                    let reason = format!("attachment longer than expected: {:?}", this.name);
                    return this.refuse(CouchError::bad_request(reason));
                }
                if this.received > this.max {
                    let name = this.name.clone();
                    return this.refuse(too_large(&name));
                }
                Poll::Ready(Some(Ok(chunk)))
            }
            Poll::Ready(Some(Err(err))) => this.refuse(malformed(&err)),
            Poll::Ready(None) => {
                if this.expected.is_some_and(|expected| this.received < expected) {
                    let reason = format!("attachment shorter than expected: {:?}", this.name);
                    return this.refuse(CouchError::bad_request(reason));
                }
                this.field = None;
                this.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).finished = true;
                Poll::Ready(None)
            }
        }
    }
}

/// The largest piece of the body handed to the parser at once: a body chunk larger than this
/// (hyper's come as large as its read buffer) is split, without copying.
const BODY_PIECE_BYTES: usize = 64 << 10;
/// Bytes of the body the parser may take, since the last part began, that no part delivered:
/// a boundary, a part's headers and the data buffered between polls take a few pieces; past it a
/// part's headers never end (or the preamble never does), and the body is refused instead of
/// filling memory.
const MAX_UNDELIVERED_BYTES: u64 = 1 << 20;

/// Counts shared by the body stream and the parts: bytes handed to the parser, bytes the parts
/// delivered (JSON and attachments), and the difference of the two when the last part began.
#[derive(Default)]
struct Flow {
    taken: AtomicU64,
    delivered: AtomicU64,
    baseline: AtomicU64,
}

impl Flow {
    /// Bytes taken and not delivered.
    fn held(&self) -> u64 {
        self.taken.load(Ordering::SeqCst).saturating_sub(self.delivered.load(Ordering::SeqCst))
    }

    /// A part's headers are read: what the parser took for framing so far no longer counts.
    fn part_begun(&self) {
        self.baseline.store(self.held(), Ordering::SeqCst);
    }

    /// Bytes taken and not delivered since the last part began.
    fn undelivered(&self) -> u64 {
        self.held().saturating_sub(self.baseline.load(Ordering::SeqCst))
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The request body as the parser reads it: one piece of at most [`BODY_PIECE_BYTES`] per poll,
/// and no more once the parser holds [`MAX_UNDELIVERED_BYTES`] no part delivered.
///
/// `multer` pulls chunks from its source until the source is pending, so a body arriving faster
/// than the store takes it (a fast client, a slow backend, a test's ready stream) would pile up
/// whole in its buffer; yielding after each piece (and waking at once) bounds that buffer to a
/// few pieces. And it looks for the end of a part's headers in everything it holds, so headers
/// that never end would grow the buffer without bound: the undelivered count stops that.
struct BodyPieces<S> {
    inner: S,
    flow: Arc<Flow>,
    rest: Option<Bytes>,
    just_yielded: bool,
    failed: bool,
}

impl<S> BodyPieces<S> {
    fn new(inner: S, flow: Arc<Flow>) -> Self {
        BodyPieces { inner, flow, rest: None, just_yielded: false, failed: false }
    }
}

impl<S, E> Stream for BodyPieces<S>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
    E: Into<BoxError>,
{
    type Item = Result<Bytes, BoxError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.failed {
            return Poll::Ready(None);
        }
        if this.just_yielded {
            this.just_yielded = false;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        if this.flow.undelivered() > MAX_UNDELIVERED_BYTES {
            this.failed = true;
            return Poll::Ready(Some(Err(format!(
                "more than {MAX_UNDELIVERED_BYTES} bytes of part headers or framing (headers that never end?)"
            )
            .into())));
        }
        let mut chunk = match this.rest.take() {
            Some(rest) => rest,
            None => match this.inner.poll_next_unpin(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Ready(Some(Err(err))) => {
                    this.failed = true;
                    return Poll::Ready(Some(Err(err.into())));
                }
                Poll::Ready(Some(Ok(chunk))) => chunk,
            },
        };
        if chunk.len() > BODY_PIECE_BYTES {
            this.rest = Some(chunk.split_off(BODY_PIECE_BYTES));
        }
        this.flow.taken.fetch_add(chunk.len() as u64, Ordering::SeqCst);
        this.just_yielded = true;
        Poll::Ready(Some(Ok(chunk)))
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding gzip-encoded attachment parts
// ---------------------------------------------------------------------------------------------

/// Compressed bytes written into the decoder at once: deflate expands a byte to at most about
/// 1,032, so one slice decodes to at most about a MiB whatever the input (a gzip bomb included).
const GUNZIP_INPUT_SLICE: usize = 1 << 10;
/// Decoded bytes handed on at once (when that many are ready).
const GUNZIP_OUTPUT_CHUNK: usize = 64 << 10;
/// Decoded bytes any gzip part may have whatever its ratio, on top of `couchdb_max_gzip_ratio`
/// times its compressed bytes: small attachments of very repetitive text compress past any
/// ratio worth setting (10 KiB of spaces is a few dozen bytes of gzip).
pub(crate) const GUNZIP_RATIO_ALLOWANCE: u64 = 1 << 20;

/// Why a gzip part was cut: it decoded to more than `couchdb_max_gzip_ratio` times its
/// compressed bytes (plus [`GUNZIP_RATIO_ALLOWANCE`]). Carried as the source of the error.
#[derive(Debug)]
pub(crate) struct DecodedPastRatio {
    pub reason: String,
}

impl fmt::Display for DecodedPastRatio {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

impl std::error::Error for DecodedPastRatio {}

/// The decoded bytes of a gzip stream, decoded as the compressed bytes arrive: what CouchDB's
/// replicator sends for an attachment its source keeps compressed (`encoding: "gzip"`). Memory
/// holds one compressed piece and at most about a MiB of decoded bytes, whatever the ratio; the
/// bound on what is decoded is the reader's (the attachment store stops reading past
/// `couchdb_max_attachment_bytes`, and nothing more is decoded). Bytes that are not gzip, or
/// end before the gzip trailer, end the stream with an `InvalidInput` error.
pub(crate) struct Gunzip {
    inner: ByteStream,
    name: String,
    decoder: flate2::write::MultiGzDecoder<Vec<u8>>,
    input: Bytes,
    /// Decoded bytes taken from the decoder and not yet handed on: handed on at most
    /// [`GUNZIP_OUTPUT_CHUNK`] at a time, so the reader's own bound (the attachment's stated
    /// length, `couchdb_max_attachment_bytes`) sees the first bytes past it before this stream's
    /// ratio does, however the compressed bytes arrived.
    pending: Bytes,
    /// Compressed bytes read so far, and decoded bytes handed on.
    encoded: u64,
    decoded: u64,
    /// The most decoded bytes per compressed byte (`couchdb_max_gzip_ratio`; `None`: no bound).
    max_ratio: Option<u64>,
    /// The compressed bytes have ended and the trailer was checked: what is decoded is all.
    ended: bool,
    done: bool,
}

impl Gunzip {
    /// Decodes `encoded`, the gzip bytes of attachment `name`.
    pub fn new(name: impl Into<String>, encoded: ByteStream) -> Self {
        Gunzip {
            inner: encoded,
            name: name.into(),
            decoder: flate2::write::MultiGzDecoder::new(Vec::new()),
            input: Bytes::new(),
            pending: Bytes::new(),
            encoded: 0,
            decoded: 0,
            max_ratio: None,
            ended: false,
            done: false,
        }
    }

    /// Ends the stream with a `TooLarge` error ([`DecodedPastRatio`]) once the bytes decoded
    /// pass `max_ratio` times the compressed bytes read so far plus [`GUNZIP_RATIO_ALLOWANCE`]:
    /// a gzip bomb stops after about that many bytes, whatever it would decode to.
    pub fn with_max_ratio(self, max_ratio: u64) -> Self {
        Gunzip { max_ratio: Some(max_ratio), ..self }
    }

    fn undecodable(&mut self, err: &std::io::Error) -> Poll<Option<crate::error::Result<Bytes>>> {
        self.done = true;
        Poll::Ready(Some(Err(Error::new(
            ErrorKind::InvalidInput,
            format!("attachment {:?} is sent as gzip, and its bytes do not decode: {err}", self.name),
        ))))
    }

    fn decoded(&mut self) -> Poll<Option<crate::error::Result<Bytes>>> {
        if self.pending.is_empty() {
            self.pending = Bytes::from(std::mem::take(self.decoder.get_mut()));
        }
        let piece = self.pending.split_to(self.pending.len().min(GUNZIP_OUTPUT_CHUNK));
        self.decoded = self.decoded.saturating_add(piece.len() as u64);
        if let Some(ratio) = self.max_ratio {
            let allowed = self.encoded.saturating_mul(ratio).saturating_add(GUNZIP_RATIO_ALLOWANCE);
            if self.decoded > allowed {
                self.done = true;
                let reason = format!(
                    "attachment {:?} decodes to more than {ratio} times its {} bytes of gzip (couchdb_max_gzip_ratio)",
                    self.name, self.encoded
                );
                let err = Error::new(ErrorKind::TooLarge, reason.clone()).with_source(DecodedPastRatio { reason });
                return Poll::Ready(Some(Err(err)));
            }
        }
        Poll::Ready(Some(Ok(piece)))
    }
}

impl Stream for Gunzip {
    type Item = crate::error::Result<Bytes>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        use std::io::Write as _;
        let this = self.get_mut();
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            if !this.pending.is_empty() {
                return this.decoded();
            }
            let ready = this.decoder.get_ref().len();
            if ready >= GUNZIP_OUTPUT_CHUNK || (this.ended && ready > 0) {
                return this.decoded();
            }
            if this.ended {
                this.done = true;
                return Poll::Ready(None);
            }
            if !this.input.is_empty() {
                let slice = this.input.split_to(this.input.len().min(GUNZIP_INPUT_SLICE));
                if let Err(err) = this.decoder.write_all(&slice) {
                    return this.undecodable(&err);
                }
                continue;
            }
            match this.inner.poll_next_unpin(cx) {
                Poll::Pending if ready > 0 => return this.decoded(),
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(chunk))) => {
                    this.encoded = this.encoded.saturating_add(chunk.len() as u64);
                    this.input = chunk;
                }
                Poll::Ready(Some(Err(err))) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(err)));
                }
                Poll::Ready(None) => {
                    // Checks the trailer (CRC and length): bytes cut short are an error, not a
                    // shorter attachment.
                    if let Err(err) = this.decoder.try_finish() {
                        return this.undecodable(&err);
                    }
                    this.ended = true;
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Writing multipart/related and multipart/mixed answers
// ---------------------------------------------------------------------------------------------

type OpenBytes = Box<dyn FnOnce() -> BoxFuture<'static, crate::error::Result<ByteStream>> + Send>;

/// An attachment to send after a document's JSON: what its part headers say, and how to open its
/// bytes (opened only when the answer reaches its part).
pub(crate) struct OutgoingAttachment {
    pub name: String,
    pub content_type: String,
    /// The bytes the part carries: the encoded length when `encoding` is set.
    pub length: u64,
    /// `gzip` when the bytes are sent as stored, compressed (`Content-Encoding` of the part).
    pub encoding: Option<String>,
    open: OpenBytes,
}

impl OutgoingAttachment {
    /// An attachment of `length` bytes whose stream `open` gives (for instance
    /// `move || async move { store.read(&sha256, None).await }`).
    pub fn new<F, Fut>(name: impl Into<String>, content_type: impl Into<String>, length: u64, open: F) -> Self
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = crate::error::Result<ByteStream>> + Send + 'static,
    {
        OutgoingAttachment {
            name: name.into(),
            content_type: content_type.into(),
            length,
            encoding: None,
            open: Box::new(move || open().boxed()),
        }
    }

    /// The same attachment, sent encoded (`length` is then the encoded length). This server keeps
    /// attachments decoded and sends them so (docs/attachments.md, "Compression"), so only the
    /// framing test sends encoded parts.
    #[cfg(test)]
    pub fn with_encoding(self, encoding: impl Into<String>) -> Self {
        OutgoingAttachment { encoding: Some(encoding.into()), ..self }
    }

    /// The part's headers, from the `\r\n` after the boundary to the blank line.
    fn headers(&self) -> Bytes {
        let mut text = format!(
            "\r\nContent-Disposition: attachment; filename=\"{}\"\r\nContent-Type: {}\r\nContent-Length: {}",
            quoted_string_body(&self.name),
            header_text(&self.content_type),
            self.length
        );
        if let Some(encoding) = &self.encoding {
            text.push_str("\r\nContent-Encoding: ");
            text.push_str(&header_text(encoding));
        }
        text.push_str("\r\n\r\n");
        Bytes::from(text)
    }

    /// The attachment's bytes, exactly `length` of them: a stream that gives more or fewer ends
    /// with an error (the answer is cut off; its headers are long gone).
    fn into_stream(self) -> ByteStream {
        let name = self.name;
        let opened = stream::once((self.open)())
            .map(|opened| match opened {
                Ok(bytes) => bytes,
                Err(err) => stream::once(async move { Err(err) }).boxed(),
            })
            .flatten();
        ExactLength { inner: opened.boxed(), name, remaining: self.length, done: false }.boxed()
    }
}

/// A stream that must give exactly `remaining` bytes.
struct ExactLength {
    inner: ByteStream,
    name: String,
    remaining: u64,
    done: bool,
}

impl Stream for ExactLength {
    type Item = crate::error::Result<Bytes>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        let wrong = |this: &mut ExactLength, what: &str| {
            this.done = true;
            tracing::warn!(attachment = %this.name, "{what}: the multipart answer is cut off");
            Poll::Ready(Some(Err(Error::new(
                ErrorKind::Corrupt,
                format!("attachment {:?}: {what} than its recorded length", this.name),
            ))))
        };
        match this.inner.poll_next_unpin(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(chunk))) => {
                if chunk.len() as u64 > this.remaining {
                    return wrong(this, "the stored bytes are longer");
                }
                this.remaining -= chunk.len() as u64;
                Poll::Ready(Some(Ok(chunk)))
            }
            Poll::Ready(Some(Err(err))) => {
                this.done = true;
                tracing::warn!(attachment = %this.name, error = %err, "reading an attachment failed: the multipart answer is cut off");
                Poll::Ready(Some(Err(err)))
            }
            Poll::Ready(None) if this.remaining > 0 => wrong(this, "the stored bytes are shorter"),
            Poll::Ready(None) => {
                this.done = true;
                Poll::Ready(None)
            }
        }
    }
}

/// A document to send with the attachments that follow its JSON.
pub(crate) struct DocumentWithAttachments {
    json: Bytes,
    attachments: Vec<OutgoingAttachment>,
}

impl DocumentWithAttachments {
    /// `document` as CouchDB sends it with its attachments following: the entry of each of
    /// `attachments` in `_attachments` loses `stub` and `data` and says `follows: true` (its
    /// other fields, `content_type`, `digest`, `revpos`, `length`, `encoding`, `encoded_length`,
    /// stay as given); entries not among `attachments` stay as they are (stubs). The parts
    /// follow in the order of `_attachments`, as readers match them. An attachment without an
    /// entry, or whose length disagrees with its entry's, is our error (500).
    pub fn new(mut document: Value, attachments: Vec<OutgoingAttachment>) -> CouchResult<Self> {
        let mut ordered = Vec::with_capacity(attachments.len());
        if !attachments.is_empty() {
            let mut remaining: Vec<Option<OutgoingAttachment>> = attachments.into_iter().map(Some).collect();
            let entries = document
                .as_object_mut()
                .and_then(|object| object.get_mut("_attachments"))
                .and_then(Value::as_object_mut)
                .ok_or_else(|| CouchError::internal("attachments to send with a document that has no _attachments"))?;
            for (name, entry) in entries.iter_mut() {
                let Some(slot) = remaining.iter_mut().find(|slot| slot.as_ref().is_some_and(|a| &a.name == name))
                else {
                    continue;
                };
                let Some(attachment) = slot.take() else { continue };
                let Some(entry) = entry.as_object_mut() else {
                    return Err(CouchError::internal(format!("attachment entry {name:?} is not an object")));
                };
                entry.remove("stub");
                entry.remove("data");
                entry.insert("follows".to_owned(), Value::Bool(true));
                let recorded = match entry.get("encoding") {
                    Some(Value::String(_)) => entry.get("encoded_length").or_else(|| entry.get("length")),
                    _ => entry.get("length"),
                };
                match recorded.map(Value::as_u64) {
                    None => {
                        entry.insert("length".to_owned(), Value::from(attachment.length));
                    }
                    Some(Some(length)) if length == attachment.length => {}
                    Some(_) => {
                        return Err(CouchError::internal(format!(
                            "attachment {name:?}: its entry's length disagrees with the {} bytes to send",
                            attachment.length
                        )))
                    }
                }
                ordered.push(attachment);
            }
            if let Some(missing) = remaining.into_iter().flatten().next() {
                return Err(CouchError::internal(format!(
                    "attachment {:?} to send has no entry in the document's _attachments",
                    missing.name
                )));
            }
        }
        let json = serde_json::to_vec(&document).map_err(|e| CouchError::internal(e.to_string()))?;
        Ok(DocumentWithAttachments { json: Bytes::from(json), attachments: ordered })
    }

    /// The `Content-Type` of this document's body (part) with inner boundary `boundary`.
    fn content_type(&self, boundary: &str) -> String {
        if self.attachments.is_empty() {
            "application/json".to_owned()
        } else {
            format!("multipart/related; boundary=\"{boundary}\"")
        }
    }

    /// The body's pieces in order: fixed bytes and attachments to stream.
    fn segments(self, boundary: &str, out: &mut Vec<Segment>) {
        if self.attachments.is_empty() {
            out.push(Segment::Fixed(self.json));
            return;
        }
        out.push(Segment::Fixed(Bytes::from(format!("--{boundary}\r\nContent-Type: application/json\r\n\r\n"))));
        out.push(Segment::Fixed(self.json));
        out.push(Segment::Fixed(Bytes::from(format!("\r\n--{boundary}"))));
        for attachment in self.attachments {
            out.push(Segment::Fixed(attachment.headers()));
            out.push(Segment::Attachment(attachment));
            out.push(Segment::Fixed(Bytes::from(format!("\r\n--{boundary}"))));
        }
        out.push(Segment::Fixed(Bytes::from_static(b"--")));
    }
}

/// One leaf of an `open_revs` answer.
pub(crate) enum OpenRevsLeaf {
    /// The leaf's document and the attachments to send with it.
    Found(DocumentWithAttachments),
    /// A requested revision that does not exist (`{"missing": REV}`).
    Missing(String),
}

/// A piece of a multipart answer.
enum Segment {
    Fixed(Bytes),
    Attachment(OutgoingAttachment),
}

impl Segment {
    fn length(&self) -> u64 {
        match self {
            Segment::Fixed(bytes) => bytes.len() as u64,
            Segment::Attachment(attachment) => attachment.length,
        }
    }
}

/// The answer's body: fixed pieces as they are, attachments opened one at a time when reached.
fn segments_body(segments: Vec<Segment>) -> Body {
    let pieces = stream::iter(segments).flat_map(|segment| match segment {
        Segment::Fixed(bytes) => stream::once(async move { Ok::<_, Error>(bytes) }).boxed(),
        Segment::Attachment(attachment) => attachment.into_stream(),
    });
    Body::from_stream(pieces)
}

/// A fresh boundary: 32 random hex digits, as CouchDB makes them.
fn new_boundary() -> CouchResult<String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| CouchError::internal(format!("no random boundary: {e}")))?;
    Ok(hex::encode(bytes))
}

/// `GET /{db}/{doc}?attachments=true` for a client that accepts `multipart/related`: 200 with
/// the document's JSON and its attachments as parts, with a `Content-Length` (CouchDB's
/// `send_doc_efficiently`); plain `application/json` when no attachment follows. The caller adds
/// headers such as `ETag` to the response.
pub(crate) fn related_response(document: DocumentWithAttachments) -> CouchResult<Response> {
    let boundary = new_boundary()?;
    let content_type = document.content_type(&boundary);
    let mut segments = Vec::new();
    document.segments(&boundary, &mut segments);
    let length: u64 = segments.iter().map(Segment::length).sum();
    let mut response = (StatusCode::OK, segments_body(segments)).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, header_value(&content_type)?);
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
    Ok(response)
}

/// `GET /{db}/{doc}?open_revs=…` for a client that accepts `multipart/mixed`: 200, chunked, one
/// part per leaf in the order given (CouchDB's `send_docs_multipart`).
pub(crate) fn mixed_response(leaves: Vec<OpenRevsLeaf>) -> CouchResult<Response> {
    let outer = new_boundary()?;
    let inner = new_boundary()?;
    let mut segments = vec![Segment::Fixed(Bytes::from(format!("--{outer}")))];
    for leaf in leaves {
        match leaf {
            OpenRevsLeaf::Found(document) => {
                let content_type = document.content_type(&inner);
                segments.push(Segment::Fixed(Bytes::from(format!("\r\nContent-Type: {content_type}\r\n\r\n"))));
                document.segments(&inner, &mut segments);
            }
            OpenRevsLeaf::Missing(rev) => {
                let json = serde_json::json!({ "missing": rev }).to_string();
                segments.push(Segment::Fixed(Bytes::from(format!(
                    "\r\nContent-Type: application/json; error=\"true\"\r\n\r\n{json}"
                ))));
            }
        }
        segments.push(Segment::Fixed(Bytes::from(format!("\r\n--{outer}"))));
    }
    segments.push(Segment::Fixed(Bytes::from_static(b"--")));
    let mut response = (StatusCode::OK, segments_body(segments)).into_response();
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, header_value(&format!("multipart/mixed; boundary=\"{outer}\""))?);
    Ok(response)
}

/// The multipart type a `_bulk_get` answer takes, as CouchDB 3.4 decides it
/// (`chttpd_db:bulk_get_is_multipart`): only for a client that does **not** accept
/// `application/json` (so never for one sending no `Accept`, or `*/*`) and accepts
/// `multipart/mixed` (preferred) or `multipart/related`.
pub(crate) fn bulk_get_multipart_type(headers: &HeaderMap) -> Option<&'static str> {
    if accepts(headers, "application/json") {
        return None;
    }
    ["multipart/mixed", "multipart/related"].into_iter().find(|media| accepts(headers, media))
}

/// One answer of a multipart `_bulk_get`.
pub(crate) enum BulkGetPart {
    /// A leaf of document `id`, at revision `rev`, with the attachments that follow it.
    Found { id: String, rev: String, document: DocumentWithAttachments },
    /// An error, as CouchDB writes it in a part: `{"rev","error","reason"}` for a revision,
    /// `{"id","rev","error","reason"}` for a document.
    Error(Value),
}

/// `POST /{db}/_bulk_get` for a client that wants multipart ([`bulk_get_multipart_type`]):
/// 200, chunked, of type `media` (CouchDB's `bulk_get_ret_multipart` and
/// `send_docs_multipart_bulk_get`). Its framing is not `open_revs`'s: boundaries are `--` and 32
/// hex digits; each part is preceded by `\r\n--B`; a leaf with attachments to send is
/// `X-Doc-Id`, `X-Rev-Id` and `Content-Type: multipart/related; boundary=I` (unquoted), one
/// without is `Content-Type: application/json`; an error is `application/json; error="true"`;
/// the body ends `\r\n--B--\r\n`, or is empty when no document was asked for.
pub(crate) fn bulk_get_response(media: &str, parts: Vec<BulkGetPart>) -> CouchResult<Response> {
    let outer = format!("--{}", new_boundary()?);
    let inner = format!("--{}", new_boundary()?);
    let asked = !parts.is_empty();
    let mut segments = Vec::new();
    for part in parts {
        segments.push(Segment::Fixed(Bytes::from(format!("\r\n--{outer}"))));
        match part {
            BulkGetPart::Found { id, rev, document } => {
                let headers = if document.attachments.is_empty() {
                    "\r\nContent-Type: application/json\r\n\r\n".to_owned()
                } else {
                    format!(
                        "\r\nX-Doc-Id: {}\r\nX-Rev-Id: {}\r\nContent-Type: multipart/related; boundary={inner}\r\n\r\n",
                        header_text(&id),
                        header_text(&rev)
                    )
                };
                segments.push(Segment::Fixed(Bytes::from(headers)));
                document.segments(&inner, &mut segments);
            }
            BulkGetPart::Error(error) => segments.push(Segment::Fixed(Bytes::from(format!(
                "\r\nContent-Type: application/json; error=\"true\"\r\n\r\n{error}"
            )))),
        }
    }
    if asked {
        segments.push(Segment::Fixed(Bytes::from(format!("\r\n--{outer}--\r\n"))));
    }
    let mut response = (StatusCode::OK, segments_body(segments)).into_response();
    response.headers_mut().insert(header::CONTENT_TYPE, header_value(&format!("{media}; boundary=\"{outer}\""))?);
    Ok(response)
}

fn header_value(text: &str) -> CouchResult<HeaderValue> {
    HeaderValue::from_str(text).map_err(|e| CouchError::internal(format!("{text:?} is no header value: {e}")))
}

/// `text` made safe inside a part header: control characters (a CR or LF would end the header)
/// percent-encoded.
fn header_text(text: &str) -> String {
    let mut safe = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            let mut buffer = [0u8; 4];
            for byte in c.encode_utf8(&mut buffer).bytes() {
                safe.push_str(&format!("%{byte:02X}"));
            }
        } else {
            safe.push(c);
        }
    }
    safe
}

/// `name` as the inside of a quoted string: `"` and `\` escaped with `\`, control characters
/// percent-encoded; other characters (UTF-8 included) as they are, as CouchDB writes them.
fn quoted_string_body(name: &str) -> String {
    let mut quoted = String::with_capacity(name.len());
    for c in header_text(name).chars() {
        if c == '"' || c == '\\' {
            quoted.push('\\');
        }
        quoted.push(c);
    }
    quoted
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use serde_json::json;
    use sha2::{Digest, Sha256};

    use super::*;

    const MIB: usize = 1 << 20;

    fn bodies() -> Bodies {
        Bodies::new(MIB, 8 * MIB)
    }

    fn related_headers(content_type: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_str(content_type).unwrap());
        headers
    }

    /// A multipart body written by hand: each part's header lines, then its bytes.
    fn handmade(boundary: &str, parts: &[(&str, &[u8])], end: &str) -> Vec<u8> {
        let mut body = Vec::new();
        for (headers, bytes) in parts {
            body.extend_from_slice(format!("--{boundary}\r\n{headers}\r\n\r\n").as_bytes());
            body.extend_from_slice(bytes);
            body.extend_from_slice(b"\r\n");
        }
        body.extend_from_slice(end.as_bytes());
        body
    }

    /// A sink that keeps each attachment's bytes; a stream error becomes a 500, so a test can tell
    /// the part's answer from the sink's.
    async fn keep(attachment: FollowingAttachment, bytes: AttachmentBytes) -> CouchResult<(String, Vec<u8>)> {
        let chunks: Vec<Bytes> =
            bytes.try_collect().await.map_err(|e: Error| CouchError::internal(format!("the sink saw: {e}")))?;
        Ok((attachment.name, chunks.concat()))
    }

    async fn upload(
        headers: HeaderMap,
        body: Body,
        limits: RelatedLimits,
    ) -> CouchResult<(Value, Vec<(String, Vec<u8>)>)> {
        let bodies = bodies();
        let upload = RelatedUpload::read(&bodies, &headers, body, limits).await?;
        let done = upload.store_attachments(keep).await?;
        Ok((done.document, done.attachments.into_iter().map(|a| a.stored).collect()))
    }

    async fn upload_bytes(boundary: &str, body: Vec<u8>) -> CouchResult<(Value, Vec<(String, Vec<u8>)>)> {
        let headers = related_headers(&format!("multipart/related; boundary=\"{boundary}\""));
        upload(headers, Body::from(body), RelatedLimits::new(u64::MAX)).await
    }

    fn fixed(bytes: &'static [u8]) -> impl FnOnce() -> futures::future::Ready<crate::error::Result<ByteStream>> {
        move || futures::future::ready(Ok(stream::iter(bytes.chunks(3).map(|c| Ok(Bytes::from_static(c)))).boxed()))
    }

    fn binary() -> &'static [u8] {
        // Every byte value, and what looks like a boundary and a header end inside the bytes.
        static BYTES: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
        BYTES.get_or_init(|| {
            let mut bytes: Vec<u8> = (0..=255u8).cycle().take(3000).collect();
            bytes.extend_from_slice(b"\r\n--not-the-boundary\r\n\r\n--");
            bytes.extend((0..=255u8).rev());
            bytes
        })
    }

    fn stub(content_type: &str, length: usize) -> Value {
        json!({"content_type": content_type, "revpos": 1, "digest": "md5-AAAAAAAAAAAAAAAAAAAAAA==", "length": length, "stub": true})
    }

    fn boundary_of(content_type: &str) -> String {
        let (_, quoted) = content_type.split_once("boundary=").unwrap();
        quoted.trim_matches('"').to_owned()
    }

    async fn body_bytes(response: Response) -> Bytes {
        axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap()
    }

    #[tokio::test]
    async fn a_related_answer_is_framed_as_couchdb_frames_it() {
        let document = json!({"_id": "d", "_rev": "1-x", "_attachments": {"a.txt": stub("text/plain", 5)}});
        let hello = OutgoingAttachment::new("a.txt", "text/plain", 5, fixed(b"hello"));
        let response = related_response(DocumentWithAttachments::new(document, vec![hello]).unwrap()).unwrap();
        let content_type = response.headers()[header::CONTENT_TYPE].to_str().unwrap().to_owned();
        let length: usize = response.headers()[header::CONTENT_LENGTH].to_str().unwrap().parse().unwrap();
        let boundary = boundary_of(&content_type);
        assert_eq!(content_type, format!("multipart/related; boundary=\"{boundary}\""));
        assert_eq!(boundary.len(), 32);
        assert!(boundary.chars().all(|c| c.is_ascii_hexdigit()));
        let body = body_bytes(response).await;
        let expected = format!(
            "--{boundary}\r\nContent-Type: application/json\r\n\r\n\
             {{\"_id\":\"d\",\"_rev\":\"1-x\",\"_attachments\":{{\"a.txt\":{{\"content_type\":\"text/plain\",\"revpos\":1,\
             \"digest\":\"md5-AAAAAAAAAAAAAAAAAAAAAA==\",\"length\":5,\"follows\":true}}}}}}\
             \r\n--{boundary}\r\nContent-Disposition: attachment; filename=\"a.txt\"\r\nContent-Type: text/plain\r\n\
             Content-Length: 5\r\n\r\nhello\r\n--{boundary}--"
        );
        assert_eq!(std::str::from_utf8(&body).unwrap(), expected);
        assert_eq!(length, body.len());
    }

    #[tokio::test]
    async fn a_document_with_nothing_to_send_is_plain_json() {
        let document = json!({"_id": "d", "_attachments": {"a": stub("text/plain", 1)}});
        let response = related_response(DocumentWithAttachments::new(document.clone(), Vec::new()).unwrap()).unwrap();
        assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
        let body = body_bytes(response).await;
        assert_eq!(serde_json::from_slice::<Value>(&body).unwrap(), document, "stubs stay stubs");
    }

    #[tokio::test]
    async fn round_trip_with_empty_and_binary_attachments() {
        let document = json!({
            "_id": "d", "_rev": "2-y", "n": 1,
            "_attachments": {
                "first.txt": stub("text/plain", 11),
                "empty": stub("application/octet-stream", 0),
                "blob.bin": stub("application/octet-stream", binary().len()),
                "kept": stub("text/plain", 4),
            }
        });
        // Given out of order: the parts follow the order of `_attachments`.
        let outgoing = vec![
            OutgoingAttachment::new("blob.bin", "application/octet-stream", binary().len() as u64, fixed(binary())),
            OutgoingAttachment::new("empty", "application/octet-stream", 0, fixed(b"")),
            OutgoingAttachment::new("first.txt", "text/plain", 11, fixed(b"hello world")),
        ];
        let response = related_response(DocumentWithAttachments::new(document, outgoing).unwrap()).unwrap();
        let headers = related_headers(response.headers()[header::CONTENT_TYPE].to_str().unwrap());
        let body = body_bytes(response).await;
        let (value, stored) = upload(headers, Body::from(body), RelatedLimits::new(u64::MAX)).await.unwrap();
        assert_eq!(value["n"], 1);
        assert_eq!(value["_attachments"]["first.txt"]["follows"], true);
        assert_eq!(value["_attachments"]["first.txt"].get("stub"), None);
        assert_eq!(value["_attachments"]["kept"]["stub"], true, "an attachment not sent stays a stub");
        assert_eq!(
            stored,
            vec![
                ("first.txt".to_owned(), b"hello world".to_vec()),
                ("empty".to_owned(), Vec::new()),
                ("blob.bin".to_owned(), binary().to_vec()),
            ]
        );
    }

    /// What CouchDB's replicator sends (`couch_replicator_api_wrap:update_doc`): a quoted
    /// boundary, `Content-Disposition` on each attachment part, gzip bytes with their encoded
    /// length, no line break after the closing boundary.
    #[tokio::test]
    async fn couchdb_replicator_uploads_are_read() {
        let json = br#"{"_id":"d","_rev":"3-c","_revisions":{"start":3,"ids":["c","b","a"]},"_attachments":{"z.gz":{"content_type":"text/plain","revpos":2,"digest":"md5-x","length":100,"follows":true,"encoding":"gzip","encoded_length":4},"old":{"stub":true,"length":3,"revpos":1,"digest":"md5-y"}}}"#;
        let body = handmade(
            "b0a1",
            &[
                ("Content-Type: application/json", json),
                ("Content-Disposition: attachment; filename=\"z.gz\"\r\nContent-Type: text/plain\r\nContent-Length: 4\r\nContent-Encoding: gzip", b"\x1f\x8b\x08\x00"),
            ],
            "--b0a1--",
        );
        let (value, stored) = upload_bytes("b0a1", body).await.unwrap();
        assert_eq!(value["_revisions"]["start"], 3);
        assert_eq!(stored, vec![("z.gz".to_owned(), b"\x1f\x8b\x08\x00".to_vec())], "encoded_length counts");
    }

    /// What nano's `multipart.insert` sends: an unquoted boundary, lower-case headers with no
    /// `Content-Disposition`, a line break after the closing boundary.
    #[tokio::test]
    async fn nano_uploads_are_read() {
        let json = br#"{"a":1,"_attachments":{"x.txt":{"follows":true,"content_type":"text/plain","length":3}}}"#;
        let body = handmade(
            "Q9xZ",
            &[
                ("content-type: application/json\r\ncontent-length: 87", json),
                ("content-type: text/plain\r\ncontent-length: 3", b"abc"),
            ],
            "--Q9xZ--\r\n",
        );
        let headers = related_headers("multipart/related; boundary=Q9xZ");
        let bodies = bodies();
        let upload =
            RelatedUpload::read(&bodies, &headers, Body::from(body), RelatedLimits::new(u64::MAX)).await.unwrap();
        assert_eq!(
            upload.following(),
            &[FollowingAttachment {
                name: "x.txt".to_owned(),
                content_type: Some("text/plain".to_owned()),
                length: Some(3),
                encoding: None,
                part_length: Some(3),
                digest: None,
            }]
        );
        assert_eq!(upload.document()["a"], 1);
        let done = upload.store_attachments(keep).await.unwrap();
        assert_eq!(done.attachments[0].stored, ("x.txt".to_owned(), b"abc".to_vec()));
        assert_eq!(done.attachments[0].attachment.name, "x.txt");
    }

    fn doc_with(follows: &[(&str, u64)]) -> Vec<u8> {
        let entries: Map<String, Value> = follows
            .iter()
            .map(|(name, length)| (name.to_string(), json!({"follows": true, "length": length})))
            .collect();
        serde_json::to_vec(&json!({"_id": "d", "_attachments": entries})).unwrap()
    }

    async fn refused(boundary: &str, body: Vec<u8>) -> CouchError {
        upload_bytes(boundary, body).await.expect_err("refused")
    }

    #[tokio::test]
    async fn malformed_bodies_are_400s() {
        let json = doc_with(&[("a", 3)]);
        let ok = |attachment: &'static [u8]| {
            handmade(
                "B",
                &[("Content-Type: application/json", &json), ("Content-Type: text/plain", attachment)],
                "--B--",
            )
        };
        // The well-formed body these variations break.
        assert!(upload_bytes("B", ok(b"abc")).await.is_ok());

        // No boundary.
        let err = upload(related_headers("multipart/related"), Body::from(ok(b"abc")), RelatedLimits::new(u64::MAX))
            .await
            .err()
            .unwrap();
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
        assert!(err.reason.contains("no boundary"), "{}", err.reason);

        // The JSON part is not an object.
        let err = refused("B", handmade("B", &[("Content-Type: application/json", b"[1,2]")], "--B--")).await;
        assert_eq!((err.status, err.reason.as_str()), (StatusCode::BAD_REQUEST, "Document must be a JSON object"));
        let err = refused("B", handmade("B", &[("Content-Type: application/json", b"{\"a\":")], "--B--")).await;
        assert_eq!(err.status, StatusCode::BAD_REQUEST);

        // The first part is not JSON.
        let err = refused("B", handmade("B", &[("Content-Type: text/plain", &json)], "--B--")).await;
        assert_eq!((err.status, err.error.as_str()), (StatusCode::UNSUPPORTED_MEDIA_TYPE, "bad_content_type"));

        // Fewer parts than `follows` entries.
        let err = refused("B", handmade("B", &[("Content-Type: application/json", &json)], "--B--")).await;
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
        assert!(err.reason.contains("missing"), "{}", err.reason);

        // A part longer, then shorter, than its length: the part's answer, not the sink's 500.
        let err = refused("B", ok(b"abcd")).await;
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
        assert!(err.reason.contains("longer than expected"), "{}", err.reason);
        let err = refused("B", ok(b"ab")).await;
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
        assert!(err.reason.contains("shorter than expected"), "{}", err.reason);

        // More parts than `follows` entries.
        let body = handmade(
            "B",
            &[
                ("Content-Type: application/json", &json),
                ("Content-Type: text/plain", b"abc"),
                ("Content-Type: text/plain", b"x"),
            ],
            "--B--",
        );
        let err = refused("B", body).await;
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
        assert!(err.reason.contains("more parts"), "{}", err.reason);

        // Cut off: no closing boundary, or inside a part.
        let mut cut = ok(b"abc");
        cut.truncate(cut.len() - "--B--".len());
        assert_eq!(refused("B", cut).await.status, StatusCode::BAD_REQUEST);
        let mut cut = ok(b"abc");
        cut.truncate(cut.len() - "bc\r\n--B--".len());
        assert_eq!(refused("B", cut).await.status, StatusCode::BAD_REQUEST);

        // A part without header lines, whose bytes would otherwise be misread.
        let mut headerless = b"--B\r\nContent-Type: application/json\r\n\r\n".to_vec();
        headerless.extend_from_slice(&json);
        headerless.extend_from_slice(b"\r\n--B\r\n\r\nX\r\n\r\nabc\r\n--B--");
        let err = refused("B", headerless).await;
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
        assert!(err.reason.contains("no header lines"), "{}", err.reason);

        // Malformed `follows` entries.
        let bad_length = br#"{"_attachments":{"a":{"follows":true,"length":-1}}}"#;
        let err = refused("B", handmade("B", &[("Content-Type: application/json", bad_length)], "--B--")).await;
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
        assert!(err.reason.contains("length"), "{}", err.reason);
        let not_object = br#"{"_attachments":[1]}"#;
        let err = refused("B", handmade("B", &[("Content-Type: application/json", not_object)], "--B--")).await;
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
    }

    #[tokio::test]
    async fn compressed_multipart_bodies_are_415() {
        let json = doc_with(&[]);
        let mut headers = related_headers("multipart/related; boundary=B");
        headers.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        let body = handmade("B", &[("Content-Type: application/json", &json)], "--B--");
        let err = upload(headers, Body::from(body), RelatedLimits::new(u64::MAX)).await.err().unwrap();
        assert_eq!(err.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    }

    #[tokio::test]
    async fn bounds_hold() {
        // An attachment past the bound: refused from its declared length, before any byte…
        let json = doc_with(&[("big", 11)]);
        let body = handmade("B", &[("Content-Type: application/json", &json), ("X-A: 1", b"01234567890")], "--B--");
        let headers = related_headers("multipart/related; boundary=B");
        let limits = RelatedLimits { max_attachment_bytes: 10, max_parts: 10 };
        let err = upload(headers.clone(), Body::from(body), limits).await.err().unwrap();
        assert_eq!(
            (err.status, err.error.as_str(), err.reason.as_str()),
            (StatusCode::PAYLOAD_TOO_LARGE, "attachment_too_large", "big")
        );

        // …and, without a declared length, from the bytes as they come.
        let json = br#"{"_attachments":{"big":{"follows":true}}}"#;
        let body = handmade("B", &[("Content-Type: application/json", json), ("X-A: 1", b"01234567890")], "--B--");
        let err = upload(headers.clone(), Body::from(body), limits).await.err().unwrap();
        assert_eq!((err.status, err.error.as_str()), (StatusCode::PAYLOAD_TOO_LARGE, "attachment_too_large"));
        let body = handmade("B", &[("Content-Type: application/json", json), ("X-A: 1", b"0123456789")], "--B--");
        let (_, stored) = upload(headers.clone(), Body::from(body), limits).await.unwrap();
        assert_eq!(stored[0].1, b"0123456789", "without a length, the part's end ends the bytes");

        // The part count.
        let names: Vec<String> = (0..10).map(|i| format!("a{i}")).collect();
        let many: Vec<(&str, u64)> = names.iter().map(|name| (name.as_str(), 0)).collect();
        let json = doc_with(&many);
        let body = handmade("B", &[("Content-Type: application/json", &json)], "--B--");
        let err = upload(headers.clone(), Body::from(body), limits).await.err().unwrap();
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
        assert!(err.reason.contains("at most 10 parts"), "{}", err.reason);

        // The JSON part, by the request limit of `Bodies`.
        let json = serde_json::to_vec(&json!({"pad": "x".repeat(MIB)})).unwrap();
        let body = handmade("B", &[("Content-Type: application/json", &json)], "--B--");
        let err = upload(headers, Body::from(body), RelatedLimits::new(u64::MAX)).await.err().unwrap();
        assert_eq!(err.status, StatusCode::PAYLOAD_TOO_LARGE);
    }

    #[tokio::test]
    async fn the_sinks_own_failure_is_answered() {
        let json = doc_with(&[("a", 3)]);
        let body =
            handmade("B", &[("Content-Type: application/json", &json), ("Content-Type: text/plain", b"abc")], "--B--");
        let headers = related_headers("multipart/related; boundary=B");
        let bodies = bodies();
        let upload =
            RelatedUpload::read(&bodies, &headers, Body::from(body), RelatedLimits::new(u64::MAX)).await.unwrap();
        let unavailable = |_: FollowingAttachment, _: AttachmentBytes| async {
            Err::<(), _>(CouchError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "backend down"))
        };
        let err = upload.store_attachments(unavailable).await.err().unwrap();
        assert_eq!(err.status, StatusCode::SERVICE_UNAVAILABLE);
    }

    /// 16 MiB through the parser, from a body that is always ready: what the parser holds between
    /// the body and the sink (bytes taken from the body, not yet handed to the sink) stays a
    /// chunk or two, and the bytes arrive exact.
    #[tokio::test]
    async fn a_16_mib_part_streams_through_without_being_held() {
        const CHUNK: usize = 64 << 10;
        const CHUNKS: usize = 256;
        let chunk_of = |index: usize| Bytes::from(vec![(index % 251) as u8; CHUNK]);
        let mut expected = Sha256::new();
        for index in 0..CHUNKS {
            expected.update(chunk_of(index));
        }
        let json = doc_with(&[("big", (CHUNK * CHUNKS) as u64)]);
        let mut head = b"--B\r\nContent-Type: application/json\r\n\r\n".to_vec();
        head.extend_from_slice(&json);
        head.extend_from_slice(b"\r\n--B\r\nContent-Type: application/octet-stream\r\n\r\n");

        let taken = Arc::new(AtomicU64::new(0));
        let handed = Arc::new(AtomicU64::new(0));
        let peak = Arc::new(AtomicU64::new(0));
        let (taken_in_body, handed_in_body, peak_in_body) =
            (Arc::clone(&taken), Arc::clone(&handed), Arc::clone(&peak));
        let data = stream::iter(0..CHUNKS).map(move |index| {
            let chunk = chunk_of(index);
            let held = taken_in_body.fetch_add(CHUNK as u64, Ordering::SeqCst) + CHUNK as u64
                - handed_in_body.load(Ordering::SeqCst);
            peak_in_body.fetch_max(held, Ordering::SeqCst);
            Ok::<_, Infallible>(chunk)
        });
        let source = stream::once(async move { Ok::<_, Infallible>(Bytes::from(head)) })
            .chain(data)
            .chain(stream::once(async { Ok(Bytes::from_static(b"\r\n--B--")) }));

        let handed_in_sink = Arc::clone(&handed);
        let sink = move |_: FollowingAttachment, mut bytes: AttachmentBytes| {
            let handed = Arc::clone(&handed_in_sink);
            async move {
                let mut digest = Sha256::new();
                let mut largest = 0;
                while let Some(chunk) = bytes.next().await {
                    let chunk = chunk.map_err(|e| CouchError::internal(e.to_string()))?;
                    handed.fetch_add(chunk.len() as u64, Ordering::SeqCst);
                    largest = largest.max(chunk.len());
                    digest.update(&chunk);
                }
                Ok((digest.finalize(), largest))
            }
        };
        let headers = related_headers("multipart/related; boundary=B");
        let bodies = bodies();
        let upload = RelatedUpload::read(&bodies, &headers, Body::from_stream(source), RelatedLimits::new(u64::MAX))
            .await
            .unwrap();
        let done = upload.store_attachments(sink).await.unwrap();
        let (digest, largest) = &done.attachments[0].stored;
        assert_eq!(*digest, expected.finalize(), "the bytes arrive exact");
        assert_eq!(handed.load(Ordering::SeqCst), (CHUNK * CHUNKS) as u64);
        let peak = peak.load(Ordering::SeqCst);
        // A few chunks, not the part: without `BodyPieces` the parser takes all 16 MiB at once.
        assert!(peak <= 4 * CHUNK as u64, "the parser held {peak} bytes at once of a 16 MiB part");
        assert!(*largest <= 4 * CHUNK, "the sink got a chunk of {largest} bytes");
    }

    /// Part headers that never end are refused once the parser holds about a MiB of them, not
    /// read (and buffered) to the end of the body.
    #[tokio::test]
    async fn headers_that_never_end_are_refused_early() {
        const CHUNK: usize = 64 << 10;
        let taken = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&taken);
        let json = doc_with(&[("a", 1)]);
        let mut head = b"--B\r\nContent-Type: application/json\r\n\r\n".to_vec();
        head.extend_from_slice(&json);
        head.extend_from_slice(b"\r\n--B\r\nX-Endless: ");
        let endless = stream::iter(0..256).map(move |_| {
            counted.fetch_add(CHUNK as u64, Ordering::SeqCst);
            Ok::<_, Infallible>(Bytes::from(vec![b'x'; CHUNK]))
        });
        let source = stream::once(async move { Ok::<_, Infallible>(Bytes::from(head)) }).chain(endless);
        let headers = related_headers("multipart/related; boundary=B");
        let err = upload(headers, Body::from_stream(source), RelatedLimits::new(u64::MAX)).await.err().unwrap();
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
        assert!(err.reason.contains("headers"), "{}", err.reason);
        let taken = taken.load(Ordering::SeqCst);
        assert!(taken < 2 * MIB as u64, "read {taken} bytes of endless headers");
    }

    /// A body chunk larger than a piece (hyper hands over what it read) reaches the sink in
    /// pieces.
    #[tokio::test]
    async fn large_body_chunks_are_handed_over_in_pieces() {
        let big = vec![7u8; 3 * MIB];
        let json = doc_with(&[("big", big.len() as u64)]);
        let body = handmade("B", &[("Content-Type: application/json", &json), ("X-A: 1", &big)], "--B--");
        let sink = |_: FollowingAttachment, bytes: AttachmentBytes| async move {
            let sizes: Vec<usize> = bytes
                .map_ok(|chunk| chunk.len())
                .try_collect()
                .await
                .map_err(|e: Error| CouchError::internal(e.to_string()))?;
            Ok(sizes)
        };
        let headers = related_headers("multipart/related; boundary=B");
        let bodies = bodies();
        let upload =
            RelatedUpload::read(&bodies, &headers, Body::from(body), RelatedLimits::new(u64::MAX)).await.unwrap();
        let done = upload.store_attachments(sink).await.unwrap();
        let sizes = &done.attachments[0].stored;
        assert_eq!(sizes.iter().sum::<usize>(), big.len());
        let largest = sizes.iter().max().copied().unwrap_or(0);
        assert!(largest <= 4 * BODY_PIECE_BYTES, "a chunk of {largest} bytes");
    }

    /// A `multipart/mixed` answer read back by `multer` itself, an independent parser, part by
    /// part and (for a leaf with attachments) its inner `multipart/related` likewise.
    #[tokio::test]
    async fn a_mixed_answer_parses_back_with_an_independent_parser() {
        let with_attachments = json!({
            "_id": "d", "_rev": "2-b",
            "_attachments": {
                "ünï/cødé.bin": stub("application/octet-stream", binary().len()),
                "empty.txt": stub("text/plain", 0),
                "z.gz": {"content_type": "text/plain", "revpos": 2, "length": 100, "encoding": "gzip", "encoded_length": 4, "stub": true},
            }
        });
        let outgoing = vec![
            OutgoingAttachment::new("ünï/cødé.bin", "application/octet-stream", binary().len() as u64, fixed(binary())),
            OutgoingAttachment::new("empty.txt", "text/plain", 0, fixed(b"")),
            OutgoingAttachment::new("z.gz", "text/plain", 4, fixed(b"\x1f\x8b\x08\x00")).with_encoding("gzip"),
        ];
        let plain = json!({"_id": "d", "_rev": "2-c", "x": true});
        let leaves = vec![
            OpenRevsLeaf::Found(DocumentWithAttachments::new(with_attachments, outgoing).unwrap()),
            OpenRevsLeaf::Found(DocumentWithAttachments::new(plain.clone(), Vec::new()).unwrap()),
            OpenRevsLeaf::Missing("3-zzz".to_owned()),
        ];
        let response = mixed_response(leaves).unwrap();
        assert_eq!(response.headers().get(header::CONTENT_LENGTH), None, "chunked, as CouchDB sends it");
        let content_type = response.headers()[header::CONTENT_TYPE].to_str().unwrap().to_owned();
        assert!(content_type.starts_with("multipart/mixed; boundary=\""), "{content_type}");
        let outer_boundary = boundary_of(&content_type);
        let body = body_bytes(response).await;
        assert!(body.ends_with(format!("\r\n--{outer_boundary}--").as_bytes()));

        let mut outer = multer::Multipart::new(stream::once(async move { Ok::<_, Infallible>(body) }), outer_boundary);
        let mut types = Vec::new();
        let mut inner_bodies = Vec::new();
        while let Some(part) = outer.next_field().await.unwrap() {
            types.push(part.headers()[header::CONTENT_TYPE].to_str().unwrap().to_owned());
            inner_bodies.push(part.bytes().await.unwrap());
        }
        assert_eq!(types.len(), 3);
        assert!(types[0].starts_with("multipart/related; boundary=\""), "{}", types[0]);
        assert_eq!(types[1], "application/json", "exactly, as CouchDB's replicator matches it");
        assert_eq!(types[2], "application/json; error=\"true\"");
        assert_eq!(serde_json::from_slice::<Value>(&inner_bodies[1]).unwrap(), plain);
        assert_eq!(serde_json::from_slice::<Value>(&inner_bodies[2]).unwrap(), json!({"missing": "3-zzz"}));

        let related = inner_bodies[0].clone();
        let mut inner =
            multer::Multipart::new(stream::once(async move { Ok::<_, Infallible>(related) }), boundary_of(&types[0]));
        let document = inner.next_field().await.unwrap().unwrap();
        assert_eq!(document.headers()[header::CONTENT_TYPE], "application/json");
        let document: Value = serde_json::from_slice(&document.bytes().await.unwrap()).unwrap();
        assert_eq!(document["_rev"], "2-b");
        let mut seen = Vec::new();
        while let Some(part) = inner.next_field().await.unwrap() {
            let name = part.file_name().unwrap().to_owned();
            assert_eq!(document["_attachments"][&name]["follows"], true);
            assert_eq!(document["_attachments"][&name].get("stub"), None);
            let headers = part.headers().clone();
            let bytes = part.bytes().await.unwrap();
            assert_eq!(headers[header::CONTENT_LENGTH].to_str().unwrap(), bytes.len().to_string());
            seen.push((
                name,
                headers[header::CONTENT_TYPE].to_str().unwrap().to_owned(),
                headers.get(header::CONTENT_ENCODING).map(|v| v.to_str().unwrap().to_owned()),
                bytes.to_vec(),
            ));
        }
        assert_eq!(
            seen,
            vec![
                ("ünï/cødé.bin".to_owned(), "application/octet-stream".to_owned(), None, binary().to_vec()),
                ("empty.txt".to_owned(), "text/plain".to_owned(), None, Vec::new()),
                ("z.gz".to_owned(), "text/plain".to_owned(), Some("gzip".to_owned()), b"\x1f\x8b\x08\x00".to_vec()),
            ]
        );
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        use std::io::Write as _;
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        encoder.write_all(bytes).unwrap();
        encoder.finish().unwrap()
    }

    /// `bytes` as a stream of `piece`-byte chunks.
    fn pieces(bytes: Vec<u8>, piece: usize) -> ByteStream {
        let chunks: Vec<crate::error::Result<Bytes>> =
            bytes.chunks(piece).map(|chunk| Ok(Bytes::copy_from_slice(chunk))).collect();
        stream::iter(chunks).boxed()
    }

    #[tokio::test]
    async fn gzip_parts_decode_exactly_whatever_the_pieces() {
        let text: Vec<u8> =
            (0..50_000u32).flat_map(|i| format!("{i} ").into_bytes()).chain(binary().to_vec()).collect();
        let encoded = gzip(&text);
        for piece in [1, 7, 1024, 65_536, encoded.len()] {
            let decoded: Vec<Bytes> = Gunzip::new("t", pieces(encoded.clone(), piece)).try_collect().await.unwrap();
            assert_eq!(decoded.concat(), text, "in pieces of {piece}");
        }
        // Two members one after the other decode as one.
        let mut two = gzip(b"first ");
        two.extend(gzip(b"second"));
        let decoded: Vec<Bytes> = Gunzip::new("t", pieces(two, 5)).try_collect().await.unwrap();
        assert_eq!(decoded.concat(), b"first second");
        // Empty content.
        let decoded: Vec<Bytes> = Gunzip::new("t", pieces(gzip(b""), 3)).try_collect().await.unwrap();
        assert!(decoded.concat().is_empty());
    }

    #[tokio::test]
    async fn bytes_that_are_not_gzip_or_cut_short_are_errors() {
        let err = Gunzip::new("x.txt", pieces(b"plainly not gzip".to_vec(), 4)).try_collect::<Vec<Bytes>>().await;
        let err = err.err().unwrap();
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
        assert!(err.to_string().contains("x.txt"), "{err}");
        let encoded = gzip(&binary().repeat(10));
        for cut in [encoded.len() - 1, encoded.len() - 8, encoded.len() / 2, 5] {
            let cut = encoded[..cut].to_vec();
            let result = Gunzip::new("t", pieces(cut, 100)).try_collect::<Vec<Bytes>>().await;
            assert_eq!(result.err().map(|e| e.kind()), Some(ErrorKind::InvalidInput));
        }
        // An error of the bytes themselves passes through.
        let failing = stream::iter(vec![Err(Error::new(ErrorKind::TooLarge, "past the bound"))]).boxed();
        let result = Gunzip::new("t", failing).try_collect::<Vec<Bytes>>().await;
        assert_eq!(result.err().map(|e| e.kind()), Some(ErrorKind::TooLarge));
    }

    /// 256 MiB of zeros in about 256 KiB: decoded in pieces of about a MiB at most, and a reader
    /// that stops early (the attachment store past its bound) stops the decoding there.
    #[tokio::test]
    async fn a_gzip_bomb_decodes_a_bounded_piece_at_a_time() {
        let bomb = gzip(&vec![0u8; 256 << 20]);
        assert!(bomb.len() < 1 << 20, "{} bytes", bomb.len());
        let taken = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&taken);
        let encoded = pieces(bomb.clone(), 64 << 10)
            .inspect_ok(move |chunk| {
                counted.fetch_add(chunk.len() as u64, Ordering::SeqCst);
            })
            .boxed();
        let mut decoded = Gunzip::new("bomb", encoded);
        let mut total = 0usize;
        let mut largest = 0usize;
        while let Some(chunk) = decoded.next().await {
            let chunk = chunk.unwrap();
            largest = largest.max(chunk.len());
            total += chunk.len();
            if total > 4 * MIB {
                break;
            }
        }
        assert!(largest <= 2 * MIB, "a decoded piece of {largest} bytes");
        let taken = taken.load(Ordering::SeqCst);
        assert!(taken <= 2 * (64 << 10), "read {taken} compressed bytes to decode {total}");
    }

    /// A bomb arriving a few bytes at a time, with a ratio bound: its first decoded bytes are
    /// handed on (at most [`GUNZIP_OUTPUT_CHUNK`] of them) before the ratio cuts it, so the
    /// reader's own bound (an attachment's stated length) is the one that answers, however the
    /// body was split on the wire (`couchdb_api::attachments_gzip_parts` once saw the ratio's
    /// reason instead of the attachment's name).
    #[tokio::test]
    async fn a_bomb_hands_on_its_first_bytes_before_its_ratio_cuts_it() {
        let bomb = gzip(&vec![0u8; 16 << 20]);
        for piece in [7, 100, 1 << 10, 64 << 10] {
            let mut decoded = Gunzip::new("bomb", pieces(bomb.clone(), piece)).with_max_ratio(100);
            let first = decoded.next().await.expect("a first piece");
            let first = first.unwrap_or_else(|err| panic!("pieces of {piece}: the first decoded piece is {err}"));
            assert!(
                !first.is_empty() && first.len() <= GUNZIP_OUTPUT_CHUNK,
                "pieces of {piece}: {} bytes",
                first.len()
            );
            let mut cut = false;
            while let Some(next) = decoded.next().await {
                if let Err(err) = next {
                    assert_eq!(err.kind(), ErrorKind::TooLarge, "pieces of {piece}: {err}");
                    cut = true;
                    break;
                }
            }
            assert!(cut, "pieces of {piece}: the ratio never cut the bomb");
        }
    }

    /// `_bulk_get`'s framing, byte for byte as CouchDB's `send_docs_multipart_bulk_get` writes it,
    /// and read back by `multer`; no document asked for is an empty body.
    #[tokio::test]
    async fn a_bulk_get_answer_is_framed_as_couchdb_frames_it() {
        let plain = json!({"_id": "p", "_rev": "1-a"});
        let with = json!({"_id": "w", "_rev": "2-b", "_attachments": {"a.txt": stub("text/plain", 5)}});
        let hello = OutgoingAttachment::new("a.txt", "text/plain", 5, fixed(b"hello"));
        let parts = vec![
            BulkGetPart::Found {
                id: "p".to_owned(),
                rev: "1-a".to_owned(),
                document: DocumentWithAttachments::new(plain.clone(), Vec::new()).unwrap(),
            },
            BulkGetPart::Found {
                id: "w".to_owned(),
                rev: "2-b".to_owned(),
                document: DocumentWithAttachments::new(with, vec![hello]).unwrap(),
            },
            BulkGetPart::Error(json!({"rev": "3-c", "error": "not_found", "reason": "missing"})),
        ];
        let response = bulk_get_response("multipart/mixed", parts).unwrap();
        let content_type = response.headers()[header::CONTENT_TYPE].to_str().unwrap().to_owned();
        let outer = boundary_of(&content_type);
        assert!(outer.starts_with("--") && outer.len() == 34, "{outer}");
        assert_eq!(content_type, format!("multipart/mixed; boundary=\"{outer}\""));
        let body = String::from_utf8(body_bytes(response).await.to_vec()).unwrap();
        let inner_at = body.find("boundary=--").unwrap() + "boundary=".len();
        let inner = &body[inner_at..inner_at + 34];
        let expected = format!(
            "\r\n--{outer}\r\nContent-Type: application/json\r\n\r\n{plain}\
             \r\n--{outer}\r\nX-Doc-Id: w\r\nX-Rev-Id: 2-b\r\nContent-Type: multipart/related; boundary={inner}\r\n\r\n\
             --{inner}\r\nContent-Type: application/json\r\n\r\n\
             {{\"_id\":\"w\",\"_rev\":\"2-b\",\"_attachments\":{{\"a.txt\":{{\"content_type\":\"text/plain\",\"revpos\":1,\
             \"digest\":\"md5-AAAAAAAAAAAAAAAAAAAAAA==\",\"length\":5,\"follows\":true}}}}}}\
             \r\n--{inner}\r\nContent-Disposition: attachment; filename=\"a.txt\"\r\nContent-Type: text/plain\r\n\
             Content-Length: 5\r\n\r\nhello\r\n--{inner}--\
             \r\n--{outer}\r\nContent-Type: application/json; error=\"true\"\r\n\r\n\
             {{\"rev\":\"3-c\",\"error\":\"not_found\",\"reason\":\"missing\"}}\
             \r\n--{outer}--\r\n"
        );
        assert_eq!(body, expected);
        let mut read = multer::Multipart::new(stream::once(async move { Ok::<_, Infallible>(body) }), outer);
        let mut count = 0;
        while read.next_field().await.unwrap().is_some() {
            count += 1;
        }
        assert_eq!(count, 3);

        let response = bulk_get_response("multipart/related", Vec::new()).unwrap();
        assert!(response.headers()[header::CONTENT_TYPE].to_str().unwrap().starts_with("multipart/related; boundary="));
        assert!(body_bytes(response).await.is_empty());
    }

    #[test]
    fn bulk_get_is_multipart_only_without_json() {
        let with = |accept: Option<&str>| {
            let mut headers = HeaderMap::new();
            if let Some(accept) = accept {
                headers.insert(header::ACCEPT, HeaderValue::from_str(accept).unwrap());
            }
            bulk_get_multipart_type(&headers)
        };
        assert_eq!(with(None), None);
        assert_eq!(with(Some("*/*")), None);
        assert_eq!(with(Some("application/json")), None);
        assert_eq!(with(Some("multipart/mixed, application/json")), None);
        assert_eq!(with(Some("multipart/mixed")), Some("multipart/mixed"));
        assert_eq!(with(Some("multipart/related")), Some("multipart/related"));
        assert_eq!(with(Some("multipart/*")), Some("multipart/mixed"));
        assert_eq!(with(Some("multipart/mixed;q=0, multipart/related")), Some("multipart/related"));
    }

    #[tokio::test]
    async fn stored_bytes_of_the_wrong_length_cut_the_answer_off() {
        let document = json!({"_attachments": {"a": stub("text/plain", 5)}});
        let short = OutgoingAttachment::new("a", "text/plain", 5, fixed(b"abc"));
        let response = related_response(DocumentWithAttachments::new(document, vec![short]).unwrap()).unwrap();
        assert!(axum::body::to_bytes(response.into_body(), usize::MAX).await.is_err());
    }

    #[test]
    fn attachments_must_match_the_documents_entries() {
        let document = json!({"_attachments": {"a": stub("text/plain", 5)}});
        let unknown = OutgoingAttachment::new("b", "text/plain", 5, fixed(b"abcde"));
        assert!(DocumentWithAttachments::new(document.clone(), vec![unknown]).is_err());
        let wrong_length = OutgoingAttachment::new("a", "text/plain", 4, fixed(b"abcd"));
        assert!(DocumentWithAttachments::new(document, vec![wrong_length]).is_err());
    }

    #[test]
    fn part_headers_cannot_be_broken_by_names() {
        let attachment = OutgoingAttachment::new("a\"b\\c\r\nX-Evil: 1", "text/plain\r\nX: y", 0, fixed(b""));
        let headers = attachment.headers();
        assert_eq!(
            std::str::from_utf8(&headers).unwrap(),
            "\r\nContent-Disposition: attachment; filename=\"a\\\"b\\\\c%0D%0AX-Evil: 1\"\r\n\
             Content-Type: text/plain%0D%0AX: y\r\nContent-Length: 0\r\n\r\n"
        );
    }

    /// mochiweb's own cases (`mochiweb_request_tests:accepts_content_type_test`), and a missing
    /// header counting as `*/*`.
    #[test]
    fn accept_follows_couchdb() {
        let with = |accept: Option<&str>| {
            let mut headers = HeaderMap::new();
            if let Some(accept) = accept {
                headers.insert(header::ACCEPT, HeaderValue::from_str(accept).unwrap());
            }
            accepts(&headers, "multipart/related")
        };
        assert!(with(None));
        assert!(with(Some("*/*")));
        assert!(with(Some("multipart/related")));
        assert!(!with(Some("text/html")));
        assert!(!with(Some("application/json")));
        assert!(with(Some("text/html, multipart/*")));
        assert!(!with(Some("text/html, multipart/*; q=0.0")));
        assert!(!with(Some("text/html, multipart/*; q=0")));
        assert!(!with(Some("text/html, */*; q=0.0")));
        assert!(!with(Some("multipart/*; q=0.0, */*")));
        assert!(with(Some("*/*; q=0.0, multipart/*")));
        assert!(with(Some("*/*; q=0.0, multipart/related")));
        assert!(!with(Some("multipart/related; q=x")));
    }

    #[test]
    fn related_content_types_are_recognised() {
        assert!(is_multipart_related(&related_headers("multipart/related; boundary=x")));
        assert!(is_multipart_related(&related_headers("Multipart/Related;boundary=\"x\"")));
        assert!(!is_multipart_related(&related_headers("application/json")));
        assert!(!is_multipart_related(&HeaderMap::new()));
    }
}
