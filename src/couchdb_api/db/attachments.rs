//! Attachments on the CouchDB face of a database besides the data-store one: the standalone
//! routes `GET/HEAD/PUT/DELETE /{db}/{docid}/{attachment}` (names may hold `/`), and what reads
//! and writes of whole documents do with `_attachments` (`attachments=true`, `atts_since`,
//! inline `data` stored before the write). The storage is [`crate::database::attachments`], the
//! rules of stubs [`crate::database::doc_attachments`].

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use futures::{StreamExt, TryStreamExt};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::OpenDb;
use crate::couchdb_api::error::{CouchError, CouchResult};
use crate::couchdb_api::multipart::Gunzip;
use crate::couchdb_api::request::{bool_param, json_param};
use crate::couchdb_api::{json, Answer, CouchState};
use crate::database::attachments::{AttachmentStore, StoredBlob};
use crate::database::doc_attachments::{self, KeptAttachment, MissingStub, ATTACHMENTS, DEFAULT_CONTENT_TYPE};
use crate::database::rev_tree::{parse_rev, Leaf, RevTree};
use crate::database::Database;
use crate::error::{Error, ErrorKind};

#[derive(Deserialize)]
pub(crate) struct AttachmentPath {
    docid: String,
    attachment: String,
}

/// Which attachments a read shows with their bytes: none (stubs, the default), all
/// (`attachments=true`), or those newer than the revisions `atts_since` names.
#[derive(Debug, Clone, Default)]
pub(crate) struct Inline {
    /// `atts_since`: only attachments whose `revpos` is past the newest of these revisions on
    /// the leaf's path.
    pub since: Option<Vec<String>>,
}

/// What a read's query asks of attachments; `None`: stubs only. `att_encoding_info` is read
/// and changes nothing: attachments are kept as sent, never compressed, so there is no
/// encoding to report.
pub(crate) fn inline_wanted(params: &HashMap<String, String>) -> CouchResult<Option<Inline>> {
    let all = bool_param("attachments", params.get("attachments").map(String::as_str), false)?;
    bool_param("att_encoding_info", params.get("att_encoding_info").map(String::as_str), false)?;
    let since = match json_param("atts_since", params.get("atts_since").map(String::as_str))? {
        None => None,
        Some(Value::Array(revs)) => Some(revs.into_iter().filter_map(|rev| rev.as_str().map(str::to_owned)).collect()),
        Some(_) => return Err(CouchError::bad_request("atts_since must be a JSON array of revisions")),
    };
    // `atts_since` implies attachments, as CouchDB's parser adds the option with it.
    Ok((all || since.is_some()).then_some(Inline { since }))
}

/// The generation below which a leaf's attachments stay stubs: the newest revision of the leaf's
/// path that `since` names (CouchDB's `find_ancestor_rev_pos`), 0 when none is or none given.
fn since_generation(leaf: &Leaf, since: Option<&[String]>) -> u64 {
    let Some(since) = since else { return 0 };
    leaf.path.revs().iter().find(|rev| since.contains(rev)).and_then(|rev| parse_rev(rev)).map_or(0, |(gen, _)| gen)
}

/// Puts the bytes of `leaf`'s attachments into `doc` (the leaf as shown) as `inline` asks, each
/// within the server-wide budget of inline bytes ([`super::inline`]).
pub(crate) async fn inline_into(db: &Database, leaf: &Leaf, doc: &mut Value, inline: &Inline) -> CouchResult<()> {
    let Some(Value::Object(attachments)) = leaf.body.get(ATTACHMENTS) else { return Ok(()) };
    let since = since_generation(leaf, inline.since.as_deref());
    let mut shown = Map::with_capacity(attachments.len());
    // Shares taken outside a request's scope, held until the document is built.
    let mut shares = Vec::new();
    for (name, attachment) in attachments {
        let kept = doc_attachments::kept(&leaf.body, name);
        let value = match kept {
            Some(kept) if kept.revpos > since => {
                shares.push(super::inline::take_share(db, name, kept.length).await?);
                let bytes = read_all(db, &kept).await?;
                doc_attachments::shown_inline(&kept, &bytes)
            }
            _ => doc_attachments::shown_stub(attachment),
        };
        shown.insert(name.clone(), value);
    }
    if let Value::Object(doc) = doc {
        doc.insert(ATTACHMENTS.into(), Value::Object(shown));
    }
    Ok(())
}

/// `doc` (the leaf as shown, stubs) ready for a multipart answer: each attachment kept here whose
/// `revpos` is past `inline`'s `atts_since` (every one without it) follows the JSON as a part,
/// its entry saying `follows: true`; the others stay stubs. The bytes are opened from the store
/// only when the answer reaches the part, and streamed.
pub(crate) fn with_following(
    db: &Database,
    leaf: &Leaf,
    doc: Value,
    inline: &Inline,
) -> CouchResult<crate::couchdb_api::multipart::DocumentWithAttachments> {
    use crate::couchdb_api::multipart::{DocumentWithAttachments, OutgoingAttachment};
    let since = since_generation(leaf, inline.since.as_deref());
    let names = match leaf.body.get(ATTACHMENTS) {
        Some(Value::Object(attachments)) => attachments.keys().cloned().collect(),
        _ => Vec::new(),
    };
    let mut following = Vec::with_capacity(names.len());
    for name in names {
        let Some(kept) = doc_attachments::kept(&leaf.body, &name).filter(|kept| kept.revpos > since) else {
            continue;
        };
        let store = db.attachments().clone();
        let sha256 = kept.sha256;
        following.push(OutgoingAttachment::new(name, kept.content_type, kept.length, move || async move {
            store.read(&sha256, None).await
        }));
    }
    DocumentWithAttachments::new(doc, following)
}

/// `POST /{db}/_bulk_get` for a client that wants multipart (`media`, from
/// [`crate::couchdb_api::multipart::bulk_get_multipart_type`]): the same documents as the JSON
/// answer (the leaf `rev` names, or with `latest` the leaf of its branch, else the winner), each
/// with every attachment's bytes following it but those the entry's `atts_since` leaves as
/// stubs (CouchDB's multipart `_bulk_get` sends attachments whether or not `attachments=true`
/// is given).
pub(crate) async fn bulk_get_multipart(
    db: &Database,
    docs: Vec<Value>,
    options: super::DocOptions,
    latest: bool,
    media: &'static str,
) -> crate::couchdb_api::Answer {
    let parts: Vec<crate::couchdb_api::multipart::BulkGetPart> = futures::stream::iter(docs)
        .map(|item| async move { bulk_get_part(db, &item, options, latest).await })
        .buffered(16)
        .collect()
        .await;
    crate::couchdb_api::multipart::bulk_get_response(media, parts)
}

async fn bulk_get_part(
    db: &Database,
    item: &Value,
    options: super::DocOptions,
    latest: bool,
) -> crate::couchdb_api::multipart::BulkGetPart {
    use crate::couchdb_api::multipart::BulkGetPart;
    let wanted = item.get("rev").and_then(Value::as_str);
    let Some(id) = item.get("id").and_then(Value::as_str) else {
        return BulkGetPart::Error(
            json!({"id": null, "rev": wanted, "error": "bad_request", "reason": "an entry needs an id"}),
        );
    };
    let document_error = |error: &str, reason: &str| {
        BulkGetPart::Error(json!({"id": id, "rev": wanted.unwrap_or("undefined"), "error": error, "reason": reason}))
    };
    let missing = || match wanted {
        // CouchDB's part for a revision not found.
        Some(rev) => BulkGetPart::Error(json!({"rev": rev, "error": "not_found", "reason": "missing"})),
        None => document_error("not_found", "missing"),
    };
    // A replicator's read, which repairs as `_bulk_get`'s JSON answer does (`bulk.rs`).
    let state = match db.read_repairing(id).await {
        Ok(Some(state)) => state,
        Ok(None) => return missing(),
        Err(err) => {
            let err = CouchError::from(err);
            return document_error(&err.error, &err.reason);
        }
    };
    let leaf = match wanted {
        None => state.tree.winner().map(std::borrow::Cow::Borrowed),
        Some(rev) => super::docs::find_leaf(&state.tree, rev, latest),
    };
    let Some(leaf) = leaf else { return missing() };
    let leaf = leaf.as_ref();
    let since = match item.get("atts_since") {
        Some(Value::Array(revs)) => Some(revs.iter().filter_map(|rev| rev.as_str().map(str::to_owned)).collect()),
        _ => None,
    };
    let rev = leaf.path.leaf_rev();
    let doc = super::leaf_json(id, &state.tree, leaf, options);
    match with_following(db, leaf, doc, &Inline { since }) {
        Ok(document) => BulkGetPart::Found { id: id.to_owned(), rev, document },
        Err(err) => document_error(&err.error, &err.reason),
    }
}

/// The whole bytes of an attachment (for inline `data`, which JSON holds whole anyway).
async fn read_all(db: &Database, kept: &KeptAttachment) -> CouchResult<Vec<u8>> {
    let mut stream = db.attachments().read(&kept.sha256, None).await?;
    let mut bytes = Vec::with_capacity(usize::try_from(kept.length).unwrap_or(0));
    while let Some(chunk) = stream.next().await {
        bytes.extend_from_slice(&chunk?);
    }
    Ok(bytes)
}

/// A write's error as CouchDB answers it: 412 `missing_stub`, 413 `attachment_too_large`, else
/// as any error.
pub(crate) fn write_error(err: Error) -> CouchError {
    let source = std::error::Error::source(&err);
    if let Some(missing) = source.and_then(|source| source.downcast_ref::<MissingStub>()) {
        return CouchError::new(StatusCode::PRECONDITION_FAILED, "missing_stub", missing.reason.clone());
    }
    if let Some(large) = source.and_then(|source| source.downcast_ref::<doc_attachments::AttachmentTooLarge>()) {
        return CouchError::new(StatusCode::PAYLOAD_TOO_LARGE, "attachment_too_large", large.name.clone());
    }
    if err.kind() == ErrorKind::Conflict {
        return CouchError::conflict();
    }
    err.into()
}

/// Stores the bytes of a client's inline attachments before its write
/// ([`doc_attachments::prepare`]).
pub(crate) async fn prepare(db: &Database, body: &mut Map<String, Value>) -> CouchResult<()> {
    prepare_with(db, body, &HashMap::new()).await
}

/// [`prepare`] for a document whose attachments marked `follows: true` came as parts of a
/// `multipart/related` body and are stored already (`followed`, by name).
pub(crate) async fn prepare_with(
    db: &Database,
    body: &mut Map<String, Value>,
    followed: &HashMap<String, StoredBlob>,
) -> CouchResult<()> {
    if !body.contains_key(ATTACHMENTS) {
        return Ok(());
    }
    doc_attachments::prepare(db.attachments(), db.max_attachment_bytes(), body, followed).await.map_err(write_error)
}

/// A `multipart/related` document body (CouchDB's replicator's `PUT`): the document, and each
/// attachment part streamed into the database's attachment store as it arrives
/// ([`store_part`]: gzip-encoded parts decoded on the way, digests checked).
pub(crate) async fn read_related(
    state: &CouchState,
    db: &Database,
    headers: &HeaderMap,
    body: Body,
) -> CouchResult<(Map<String, Value>, HashMap<String, StoredBlob>)> {
    use crate::couchdb_api::multipart::{AttachmentBytes, FollowingAttachment, RelatedLimits, RelatedUpload};
    let max = db.max_attachment_bytes();
    let upload = RelatedUpload::read(&state.bodies, headers, body, RelatedLimits::new(max)).await?;
    super::docs::refuse_numbers_beyond_doubles(state, db, upload.document())?;
    let store = db.attachments().clone();
    let bounds = PartBounds { max_bytes: max, max_gzip_ratio: db.max_gzip_ratio() };
    let stored = upload
        .store_attachments(move |attachment: FollowingAttachment, bytes: AttachmentBytes| {
            let store = store.clone();
            async move { store_part(&store, bounds, &attachment, bytes).await }
        })
        .await?;
    let followed = stored.attachments.into_iter().map(|a| (a.attachment.name, a.stored)).collect();
    match stored.document {
        Value::Object(doc) => Ok((doc, followed)),
        _ => Err(CouchError::bad_request("Document must be a JSON object")),
    }
}

/// What one attachment part may store: `couchdb_max_attachment_bytes` and, for a gzip part,
/// `couchdb_max_gzip_ratio`.
#[derive(Clone, Copy)]
struct PartBounds {
    max_bytes: u64,
    max_gzip_ratio: u64,
}

/// One attachment part into the store, within `bounds.max_bytes` bytes stored.
///
/// Bytes sent as they are (no `encoding`, or `identity`) are stored as sent. Bytes sent
/// `encoding: "gzip"` (what CouchDB's replicator sends for an attachment its source keeps
/// compressed, a compressible type by default) are decoded as they stream and the decoded bytes
/// stored, bounded as any attachment and by `couchdb_max_gzip_ratio` (a gzip bomb stops at
/// whichever comes first: 413, nothing kept); their
/// `length` must be what they decode to. Any other encoding is 415. The entry's `md5-` digest is
/// checked against the bytes as sent (the encoded ones when encoded), as CouchDB checks it
/// (`couch_db:with_stream`); what is stored, and shown from then on, is the digest of the
/// decoded bytes, which are what this server serves.
async fn store_part(
    store: &AttachmentStore,
    bounds: PartBounds,
    attachment: &crate::couchdb_api::multipart::FollowingAttachment,
    bytes: crate::couchdb_api::multipart::AttachmentBytes,
) -> CouchResult<StoredBlob> {
    use crate::couchdb_api::multipart::DecodedPastRatio;
    use md5::Digest as _;
    let (name, max) = (attachment.name.as_str(), bounds.max_bytes);
    let refused = |err: Error| {
        let past_ratio = std::error::Error::source(&err).and_then(|source| source.downcast_ref::<DecodedPastRatio>());
        match (past_ratio, err.kind()) {
            (Some(past), _) => {
                CouchError::new(StatusCode::PAYLOAD_TOO_LARGE, "attachment_too_large", past.reason.clone())
            }
            (None, ErrorKind::TooLarge) => write_error(doc_attachments::too_large(name)),
            (None, _) => write_error(err),
        }
    };
    match attachment.encoding.as_deref() {
        None | Some("identity") => {
            let stored = store.write(bytes, max).await.map_err(refused)?;
            check_sent_digest(attachment, &stored.digest)?;
            Ok(stored)
        }
        Some("gzip") => {
            let md5 = Arc::new(Mutex::new(md5::Md5::new()));
            let seen = Arc::clone(&md5);
            let encoded = bytes
                .inspect_ok(move |chunk| seen.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).update(chunk))
                .boxed();
            let decoded = Gunzip::new(name, encoded).with_max_ratio(bounds.max_gzip_ratio);
            let stored = store.write(decoded, max).await.map_err(refused)?;
            let sent = std::mem::take(&mut *md5.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
            check_sent_digest(attachment, &format!("md5-{}", BASE64.encode(sent.finalize())))?;
            if let Some(length) = attachment.length.filter(|length| *length != stored.length) {
                return Err(CouchError::bad_request(format!(
                    "attachment {name:?} decodes to {} bytes, its length says {length}",
                    stored.length
                )));
            }
            Ok(stored)
        }
        Some(encoding) => Err(CouchError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "bad_content_type",
            format!("attachment {name:?} is sent with encoding {encoding:?}; only gzip (or none) is read"),
        )),
    }
}

/// CouchDB's check of a part's bytes against the digest its entry gives (none given: no check).
fn check_sent_digest(attachment: &crate::couchdb_api::multipart::FollowingAttachment, sent: &str) -> CouchResult<()> {
    match &attachment.digest {
        Some(digest) if digest != sent => {
            Err(CouchError::new(StatusCode::BAD_REQUEST, "content_md5_mismatch", "Possible message corruption."))
        }
        _ => Ok(()),
    }
}

/// `/{db}/{docid}/{attachment}`, every method.
pub async fn attachment(
    State(_state): State<CouchState>,
    opened: OpenDb<AttachmentPath>,
    method: Method,
    Query(params): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    let (id, name) = (&opened.params.docid, &opened.params.attachment);
    one_attachment(&opened.db, opened.access, id, name, method, &params, &headers, body).await
}

/// One attachment of document `id` (a design document's too), every method; writes need what
/// writing the document needs.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn one_attachment(
    db: &Database,
    access: crate::couchdb_api::access::DbAccess,
    id: &str,
    name: &str,
    method: Method,
    params: &HashMap<String, String>,
    headers: &HeaderMap,
    body: Body,
) -> Answer {
    match method.as_str() {
        "GET" => read(db, id, name, params, headers, true).await,
        "HEAD" => read(db, id, name, params, headers, false).await,
        "PUT" => {
            access.check_write(id)?;
            put(db, id, name, params, headers, body).await
        }
        "DELETE" => {
            access.check_write(id)?;
            delete(db, id, name, params, headers).await
        }
        _ => Ok(crate::couchdb_api::root::method_not_allowed().await),
    }
}

fn missing_attachment() -> CouchError {
    CouchError::not_found("Document is missing attachment")
}

/// The revision a read answers: `?rev=` (a leaf, or an inner revision whose body is kept) or the
/// live winner.
fn read_leaf<'a>(tree: &'a RevTree, params: &HashMap<String, String>) -> CouchResult<std::borrow::Cow<'a, Leaf>> {
    match params.get("rev") {
        Some(rev) => {
            parse_rev(rev).ok_or_else(|| CouchError::bad_request("Invalid rev format"))?;
            tree.revision(rev).ok_or_else(CouchError::missing)
        }
        None => match tree.winner() {
            Some(winner) if !winner.deleted => Ok(std::borrow::Cow::Borrowed(winner)),
            Some(_) => Err(CouchError::deleted()),
            None => Err(CouchError::missing()),
        },
    }
}

/// `GET`/`HEAD`: the bytes streamed from the store, with CouchDB's headers; `If-None-Match` on
/// the digest answers 304; one `Range: bytes=…` answers 206 (416 when it lies past the end).
async fn read(
    db: &Database,
    id: &str,
    name: &str,
    params: &HashMap<String, String>,
    headers: &HeaderMap,
    with_body: bool,
) -> Answer {
    let Some(state) = db.read(id).await? else { return Err(CouchError::missing()) };
    let leaf = read_leaf(&state.tree, params)?;
    let kept = doc_attachments::kept(&leaf.body, name).ok_or_else(missing_attachment)?;
    let md5 = kept.digest.strip_prefix("md5-").unwrap_or(&kept.digest).to_owned();
    let etag = HeaderValue::from_str(&format!("\"{md5}\"")).unwrap_or_else(|_| HeaderValue::from_static("\"\""));
    if crate::couchdb_api::response::not_modified(headers, &md5) {
        let mut response = StatusCode::NOT_MODIFIED.into_response();
        response.headers_mut().insert(header::ETAG, etag);
        return Ok(response);
    }
    let range = match headers.get(header::RANGE).and_then(|v| v.to_str().ok()) {
        Some(asked) => match byte_range(asked, kept.length) {
            RangeAsked::Whole => None,
            RangeAsked::Part(range) => Some(range),
            RangeAsked::Unsatisfiable => {
                let mut response = CouchError::new(
                    StatusCode::RANGE_NOT_SATISFIABLE,
                    "requested_range_not_satisfiable",
                    "Requested range not satisfiable",
                )
                .into_response();
                if let Ok(value) = HeaderValue::from_str(&format!("bytes */{}", kept.length)) {
                    response.headers_mut().insert(header::CONTENT_RANGE, value);
                }
                return Ok(response);
            }
        },
        None => None,
    };
    let (status, length) = match &range {
        Some(range) => (StatusCode::PARTIAL_CONTENT, range.end - range.start),
        None => (StatusCode::OK, kept.length),
    };
    let body = if with_body {
        let stream = db.attachments().read(&kept.sha256, range.clone()).await?;
        Body::from_stream(stream.map_err(|err| std::io::Error::other(err.to_string())))
    } else {
        Body::empty()
    };
    let mut response = (status, body).into_response();
    let out = response.headers_mut();
    let content_type =
        HeaderValue::from_str(&kept.content_type).unwrap_or_else(|_| HeaderValue::from_static(DEFAULT_CONTENT_TYPE));
    out.insert(header::CONTENT_TYPE, content_type);
    out.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
    out.insert(header::ETAG, etag);
    out.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    if let Ok(value) = HeaderValue::from_str(&md5) {
        out.insert("content-md5", value);
    }
    if let Some(range) = &range {
        let shown = format!("bytes {}-{}/{}", range.start, range.end - 1, kept.length);
        if let Ok(value) = HeaderValue::from_str(&shown) {
            out.insert(header::CONTENT_RANGE, value);
        }
    }
    Ok(response)
}

/// What a `Range` header asks of `length` bytes.
#[derive(Debug, PartialEq, Eq)]
enum RangeAsked {
    /// Not one byte range this answers (another unit, several ranges, unreadable): the whole
    /// bytes, as HTTP lets a server ignore a `Range`.
    Whole,
    Part(Range<u64>),
    Unsatisfiable,
}

/// `bytes=a-b`, `bytes=a-` or `bytes=-n` (the last n bytes).
fn byte_range(asked: &str, length: u64) -> RangeAsked {
    let Some(spec) = asked.trim().strip_prefix("bytes=") else { return RangeAsked::Whole };
    if spec.contains(',') {
        return RangeAsked::Whole;
    }
    let Some((first, last)) = spec.trim().split_once('-') else { return RangeAsked::Whole };
    let (first, last) = (first.trim(), last.trim());
    let number = |text: &str| text.parse::<u64>().ok();
    let (start, end) = match (first.is_empty(), last.is_empty()) {
        (true, true) => return RangeAsked::Whole,
        (true, false) => {
            let Some(suffix) = number(last) else { return RangeAsked::Whole };
            if suffix == 0 || length == 0 {
                return RangeAsked::Unsatisfiable;
            }
            (length.saturating_sub(suffix), length - 1)
        }
        (false, _) => {
            let Some(start) = number(first) else { return RangeAsked::Whole };
            let end = if last.is_empty() {
                length.saturating_sub(1)
            } else {
                let Some(end) = number(last) else { return RangeAsked::Whole };
                if end < start {
                    return RangeAsked::Whole;
                }
                end.min(length.saturating_sub(1))
            };
            if start >= length {
                return RangeAsked::Unsatisfiable;
            }
            (start, end)
        }
    };
    RangeAsked::Part(start..end + 1)
}

/// The leaf a standalone write edits: the one `rev` (or `If-Match`) names, none for a new
/// document or the re-creation of a deleted one; 409 as any write that names no leaf.
fn write_base<'a>(tree: Option<&'a RevTree>, rev: Option<&str>) -> CouchResult<Option<&'a Leaf>> {
    match (tree, rev) {
        (None, None) => Ok(None),
        (Some(tree), None) if tree.is_empty() || tree.is_deleted() => Ok(None),
        (Some(_), None) => Err(CouchError::conflict()),
        (tree, Some(rev)) => {
            let leaf = named_leaf(tree, rev)?;
            // Only a re-creation without a revision edits a deleted document.
            if tree.is_some_and(RevTree::is_deleted) {
                return Err(CouchError::conflict());
            }
            Ok(Some(leaf))
        }
    }
}

/// The leaf (deleted or not) a standalone write names by `rev`. CouchDB opens that revision
/// first (`fabric:open_revs`): one it does not know is 409 `not_found`/`missing_rev`; one it
/// knows that is no leaf fails as the write would, 409 `conflict`.
fn named_leaf<'a>(tree: Option<&'a RevTree>, rev: &str) -> CouchResult<&'a Leaf> {
    let missing_rev = || CouchError::new(StatusCode::CONFLICT, "not_found", "missing_rev");
    let Some(tree) = tree else { return Err(missing_rev()) };
    if let Some(leaf) = tree.leaf(rev) {
        return Ok(leaf);
    }
    let known = tree.leaves().iter().any(|leaf| leaf.path.revs().iter().any(|known| known == rev));
    Err(if known { CouchError::conflict() } else { missing_rev() })
}

/// `PUT`: the body streamed into the store, then a new revision with the attachment.
async fn put(
    db: &Database,
    id: &str,
    name: &str,
    params: &HashMap<String, String>,
    headers: &HeaderMap,
    body: Body,
) -> Answer {
    crate::database::document::check_id(id).map_err(super::refused)?;
    if name.starts_with('_') {
        return Err(CouchError::bad_request("Attachment name '_' prefix is reserved."));
    }
    let rev = crate::couchdb_api::document::named_revision(None, params, headers)?.map(str::to_owned);
    if let Some(rev) = &rev {
        parse_rev(rev).ok_or_else(|| CouchError::bad_request("Invalid rev format"))?;
    }
    let state = db.read(id).await?;
    // Checked before the bytes are read, so a conflicting upload is refused at once (the write
    // checks again against concurrent writers).
    write_base(state.as_ref().map(|s| &s.tree), rev.as_deref())?;
    let content_type =
        headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or(DEFAULT_CONTENT_TYPE).to_owned();
    let stream = body
        .into_data_stream()
        .map_err(|err| Error::new(ErrorKind::InvalidInput, format!("the attachment's body could not be read: {err}")));
    let stored = db.attachments().write(stream, db.max_attachment_bytes()).await.map_err(|err| match err.kind() {
        ErrorKind::TooLarge => write_error(doc_attachments::too_large(name)),
        _ => write_error(err),
    })?;
    if let Some(sent) = headers.get("content-md5").and_then(|v| v.to_str().ok()) {
        if format!("md5-{}", sent.trim()) != stored.digest {
            return Err(CouchError::new(
                StatusCode::BAD_REQUEST,
                "content_md5_mismatch",
                "Possible message corruption.",
            ));
        }
    }
    let mut new_body = match write_base(db.read(id).await?.as_ref().map(|s| &s.tree), rev.as_deref())? {
        Some(leaf) => leaf.body.clone(),
        None => Map::new(),
    };
    let attachments = new_body.entry(ATTACHMENTS).or_insert_with(|| Value::Object(Map::new()));
    if !attachments.is_object() {
        *attachments = Value::Object(Map::new());
    }
    if let Value::Object(attachments) = attachments {
        // CouchDB puts the new attachment first and keeps the others in their order
        // (`NewAtt ++ [A || A <- Atts, name(A) /= FileName]`): the order is part of the new
        // revision's id.
        let others = std::mem::take(attachments);
        attachments.insert(name.to_owned(), doc_attachments::kept_stub(&content_type, None, &stored, true));
        attachments.extend(others.into_iter().filter(|(other, _)| other != name));
    }
    let new_rev = write_edit(db, id, rev, new_body).await?;
    Ok(written(StatusCode::CREATED, id, &new_rev))
}

/// `DELETE`: a new revision without the attachment. As CouchDB, the document (or the revision
/// named) and the attachment are looked for before the write: 404 when either is missing, 409
/// `missing_rev` for a revision not known; a `DELETE` naming no revision of a document that has
/// the attachment is then a conflict, as any write naming none.
async fn delete(db: &Database, id: &str, name: &str, params: &HashMap<String, String>, headers: &HeaderMap) -> Answer {
    let rev = crate::couchdb_api::document::named_revision(None, params, headers)?.map(str::to_owned);
    if let Some(rev) = &rev {
        parse_rev(rev).ok_or_else(|| CouchError::bad_request("Invalid rev format"))?;
    }
    let state = db.read(id).await?;
    let tree = state.as_ref().map(|state| &state.tree);
    let Some(rev) = rev else {
        let Some(tree) = tree else { return Err(CouchError::missing()) };
        let winner = read_leaf(tree, params)?;
        doc_attachments::kept(&winner.body, name).ok_or_else(missing_attachment)?;
        return Err(CouchError::conflict());
    };
    let leaf = named_leaf(tree, &rev)?;
    let mut new_body = leaf.body.clone();
    let removed = match new_body.get_mut(ATTACHMENTS) {
        Some(Value::Object(attachments)) => attachments.shift_remove(name).is_some(),
        _ => false,
    };
    if !removed {
        return Err(missing_attachment());
    }
    write_base(tree, Some(&rev))?;
    if new_body.get(ATTACHMENTS).and_then(Value::as_object).is_some_and(Map::is_empty) {
        new_body.shift_remove(ATTACHMENTS);
    }
    let new_rev = write_edit(db, id, Some(rev), new_body).await?;
    Ok(written(StatusCode::OK, id, &new_rev))
}

async fn write_edit(db: &Database, id: &str, parent: Option<String>, body: Map<String, Value>) -> CouchResult<String> {
    let write = crate::database::Write::Edit { parent, deleted: false, body };
    match db.write(id, &write).await {
        Ok(crate::database::Written::Edited(rev)) => Ok(rev),
        Ok(crate::database::Written::Merged(_)) => Err(CouchError::internal("an edit was answered as a merge")),
        Err(err) => Err(write_error(err)),
    }
}

fn written(status: StatusCode, id: &str, rev: &str) -> Response {
    let mut response = json(status, json!({ "ok": true, "id": id, "rev": rev }));
    response.headers_mut().insert(header::ETAG, crate::couchdb_api::response::etag(rev));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_ranges_as_http_reads_them() {
        assert_eq!(byte_range("bytes=0-3", 10), RangeAsked::Part(0..4));
        assert_eq!(byte_range("bytes=5-", 10), RangeAsked::Part(5..10));
        assert_eq!(byte_range("bytes=-3", 10), RangeAsked::Part(7..10));
        assert_eq!(byte_range("bytes=8-20", 10), RangeAsked::Part(8..10));
        assert_eq!(byte_range("bytes=10-12", 10), RangeAsked::Unsatisfiable);
        assert_eq!(byte_range("bytes=0-0", 0), RangeAsked::Unsatisfiable);
        assert_eq!(byte_range("bytes=0-1,4-5", 10), RangeAsked::Whole);
        assert_eq!(byte_range("items=0-1", 10), RangeAsked::Whole);
        assert_eq!(byte_range("bytes=4-2", 10), RangeAsked::Whole);
    }
}
