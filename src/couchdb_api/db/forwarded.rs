//! The bodies of requests passed to a native database (the CouchDB backend, [`super::forward`]):
//! which are streamed through instead of read whole, and within what bound; and byte ranges of
//! attachments cut here when the backend answers a `Range` with the whole bytes.
//!
//! An attachment upload (`PUT /{db}/{doc}/{att}`, `PUT /{db}/_design/{ddoc}/{att}`) is streamed,
//! held to `couchdb_max_attachment_bytes`; a document write with its attachments
//! (`PUT /{db}/{doc}` with a `multipart/related` body, as CouchDB's replicator sends them) is
//! streamed, held to `couchdb_max_document_bytes` plus `couchdb_max_attachment_bytes`. Both are
//! passed as the client sent them, compressed or not, with their `Content-Length`,
//! `Content-Encoding` and `Content-MD5`, so the bound counts the bytes that came. Past it the
//! request to the backend is aborted mid-body (CouchDB keeps nothing of a body that does not
//! end) and the client is answered 413 naming the setting. Every other body is JSON that CouchDB
//! reads whole anyway, and some must be read here for the access check: those are read whole
//! as before (`couchdb_max_request_bytes`, after decompression, within the in-flight budgets).
//!
//! Ranges: CouchDB answers a single-range `Range` on an attachment with 206 itself, and that
//! answer is passed on as it came; a backend that answers it with the whole bytes (pouchdb-server
//! ignores `Range`) has them cut here to the range, honouring `If-Range`, so a client of this
//! API sees CouchDB's ranges over either.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, Method, StatusCode};
use futures::Stream;

use crate::backend::{BodyError, DesignBody};
use crate::couchdb_api::error::CouchError;

/// Escapes a design document's name as one path segment (everything but RFC 3986 unreserved).
const NAME_SEGMENT: &percent_encoding::AsciiSet =
    &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// The path below the database as it is passed to the backend: a design document named as one
/// segment with its slash encoded (`_design%2F{name}`, as clients that escape a whole id send it)
/// spelled `_design/{name}`. CouchDB answers the encoded form with a redirect to the other (301),
/// which the client of this API would be sent to the backend to follow; read as the document,
/// the answer is the one the redirect leads to.
pub(super) fn design_path_spelled_out(below: &str) -> std::borrow::Cow<'_, str> {
    let (first, rest) = match below.split_once('/') {
        Some((first, rest)) => (first, Some(rest)),
        None => (below, None),
    };
    let decoded = percent_encoding::percent_decode_str(first).decode_utf8_lossy();
    let Some(name) = decoded.strip_prefix("_design/").filter(|_| !first.starts_with("_design/")) else {
        return std::borrow::Cow::Borrowed(below);
    };
    let mut spelled = format!("_design/{}", percent_encoding::utf8_percent_encode(name, NAME_SEGMENT));
    if let Some(rest) = rest {
        spelled.push('/');
        spelled.push_str(rest);
    }
    std::borrow::Cow::Owned(spelled)
}

/// A body streamed through, and what bounds it.
pub(super) struct StreamedBound {
    pub bytes: u64,
    pub setting: &'static str,
}

/// Whether the body of `method` on `below` (the path below the database, as the client encoded
/// it) is streamed through, and within what bound; `None`: read whole.
pub(super) fn streamed_bound(
    method: &Method,
    below: &str,
    headers: &HeaderMap,
    max_document_bytes: usize,
    max_attachment_bytes: u64,
) -> Option<StreamedBound> {
    if *method != Method::PUT {
        return None;
    }
    let segments: Vec<&str> = below.split('/').collect();
    let attachment = match segments.as_slice() {
        // `_design/{ddoc}/{att}`: an attachment of the design document unless it names one of
        // its functions (`_update/…`, `_view/…`).
        ["_design", _, first, ..] => !first.is_empty() && !first.starts_with('_'),
        [doc, first, ..] => !doc.is_empty() && !doc.starts_with('_') && !first.is_empty(),
        _ => false,
    };
    if attachment {
        return Some(StreamedBound { bytes: max_attachment_bytes, setting: "couchdb_max_attachment_bytes" });
    }
    let document = match segments.as_slice() {
        ["_design", ddoc] => !ddoc.is_empty(),
        [doc] => !doc.is_empty() && (!doc.starts_with('_') || doc.starts_with("_design%2")),
        _ => false,
    };
    let related = headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.trim_start().to_ascii_lowercase().starts_with("multipart/related"));
    (document && related).then(|| StreamedBound {
        bytes: (max_document_bytes as u64).saturating_add(max_attachment_bytes),
        setting: "couchdb_max_document_bytes + couchdb_max_attachment_bytes",
    })
}

/// The client's body passed on as it arrives, ending with an error past `bound` (and recording
/// that in `passed`, so the answer is the 413 whatever the backend made of the cut request).
pub(super) fn streamed_body(body: Body, bound: u64, passed: Arc<AtomicBool>) -> DesignBody {
    let stream = Bounded { inner: body.into_data_stream(), left: bound, passed };
    DesignBody::Streamed(Box::pin(stream))
}

/// The 413 of a body past its bound. The rest of the body is not read, so the connection closes
/// after the answer, and says so: a client that reused it would send its next request into the
/// unread bytes.
pub(super) fn too_large(bound: &StreamedBound) -> axum::response::Response {
    let refused = CouchError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "too_large",
        format!(
            "the request body is larger than {} bytes, the most this server passes on ({})",
            bound.bytes, bound.setting
        ),
    );
    let mut response = axum::response::IntoResponse::into_response(refused);
    response.headers_mut().insert(header::CONNECTION, axum::http::HeaderValue::from_static("close"));
    response
}

/// A body stream held to a number of bytes.
struct Bounded {
    inner: axum::body::BodyDataStream,
    left: u64,
    passed: Arc<AtomicBool>,
}

/// The error a body past its bound ends with.
#[derive(Debug)]
struct PastBound;

impl std::fmt::Display for PastBound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the request body is larger than the bound it is passed on within")
    }
}

impl std::error::Error for PastBound {}

impl Stream for Bounded {
    type Item = Result<Bytes, BodyError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.passed.load(Ordering::Acquire) {
            return Poll::Ready(Some(Err(Box::new(PastBound))));
        }
        match Pin::new(&mut self.inner).poll_next(cx) {
            Poll::Ready(Some(Ok(bytes))) => {
                let size = bytes.len() as u64;
                if size > self.left {
                    self.passed.store(true, Ordering::Release);
                    return Poll::Ready(Some(Err(Box::new(PastBound))));
                }
                self.left -= size;
                Poll::Ready(Some(Ok(bytes)))
            }
            Poll::Ready(Some(Err(err))) => Poll::Ready(Some(Err(Box::new(err)))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Whether `below` names an attachment (a document's or a design document's), for a read.
pub(super) fn names_attachment(below: &str) -> bool {
    let segments: Vec<&str> = below.split('/').collect();
    match segments.as_slice() {
        ["_design", _, first, ..] => !first.is_empty() && !first.starts_with('_'),
        [doc, first, ..] => !doc.is_empty() && !doc.starts_with('_') && !first.is_empty(),
        _ => false,
    }
}

/// What a `Range` asks of an answer of `length` bytes.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum RangeAsked {
    /// Not one byte range (another unit, several ranges, unreadable): the whole bytes, as HTTP
    /// lets a server ignore a `Range` (and as CouchDB answers these).
    Whole,
    /// `start..end` of the bytes.
    Part(u64, u64),
    Unsatisfiable,
}

/// `bytes=a-b`, `bytes=a-` or `bytes=-n` (the last n bytes) of `length` bytes.
pub(super) fn range_asked(asked: &str, length: u64) -> RangeAsked {
    let Some(spec) = asked.trim().strip_prefix("bytes=") else { return RangeAsked::Whole };
    if spec.contains(',') {
        return RangeAsked::Whole;
    }
    let Some((first, last)) = spec.split_once('-') else { return RangeAsked::Whole };
    let (first, last) = (first.trim(), last.trim());
    let number = |text: &str| text.parse::<u64>().ok();
    match (first.is_empty(), last.is_empty()) {
        (true, true) => RangeAsked::Whole,
        (true, false) => match number(last) {
            None => RangeAsked::Whole,
            Some(0) => RangeAsked::Unsatisfiable,
            Some(_) if length == 0 => RangeAsked::Unsatisfiable,
            Some(suffix) => RangeAsked::Part(length.saturating_sub(suffix), length),
        },
        (false, _) => {
            let Some(start) = number(first) else { return RangeAsked::Whole };
            let end = if last.is_empty() {
                length
            } else {
                match number(last) {
                    Some(end) if end >= start => end.saturating_add(1).min(length),
                    _ => return RangeAsked::Whole,
                }
            };
            if start >= length {
                RangeAsked::Unsatisfiable
            } else {
                RangeAsked::Part(start, end)
            }
        }
    }
}

/// Bytes `start..end` of a stream of answer pieces.
pub(super) fn slice<S>(pieces: S, start: u64, end: u64) -> impl Stream<Item = crate::error::Result<Bytes>> + Send
where
    S: Stream<Item = crate::error::Result<Bytes>> + Send + Unpin + 'static,
{
    futures::stream::unfold((pieces, 0u64), move |(mut pieces, mut at)| async move {
        loop {
            if at >= end {
                return None;
            }
            let piece = match futures::StreamExt::next(&mut pieces).await? {
                Ok(piece) => piece,
                Err(err) => return Some((Err(err), (pieces, end))),
            };
            let (from, to) = (at, at + piece.len() as u64);
            at = to;
            if to <= start {
                continue;
            }
            let cut_from = start.saturating_sub(from) as usize;
            let cut_to = (end.min(to) - from) as usize;
            return Some((Ok(piece.slice(cut_from..cut_to)), (pieces, at)));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_design_document_named_as_one_segment_is_spelled_out() {
        assert_eq!(design_path_spelled_out("_design%2Fapp"), "_design/app");
        assert_eq!(design_path_spelled_out("_design%2fdata%20store/att.txt"), "_design/data%20store/att.txt");
        assert_eq!(design_path_spelled_out("_design/app/_view/v"), "_design/app/_view/v");
        assert_eq!(design_path_spelled_out("doc%2Fwith%2Fslashes"), "doc%2Fwith%2Fslashes");
        assert_eq!(design_path_spelled_out("_all_docs"), "_all_docs");
    }

    fn bound(method: Method, below: &str, content_type: &str) -> Option<&'static str> {
        let mut headers = HeaderMap::new();
        if let Ok(value) = content_type.parse() {
            headers.insert(header::CONTENT_TYPE, value);
        }
        streamed_bound(&method, below, &headers, 8_000_000, 100).map(|bound| bound.setting)
    }

    #[test]
    fn uploads_stream_and_json_bodies_are_read_whole() {
        let attachment = Some("couchdb_max_attachment_bytes");
        let related = Some("couchdb_max_document_bytes + couchdb_max_attachment_bytes");
        assert_eq!(bound(Method::PUT, "doc/photo.png", "image/png"), attachment);
        assert_eq!(bound(Method::PUT, "doc/dir/a%20b.txt", ""), attachment);
        assert_eq!(bound(Method::PUT, "_design/app/logo.png", ""), attachment);
        assert_eq!(bound(Method::PUT, "doc", "multipart/related; boundary=x"), related);
        assert_eq!(bound(Method::PUT, "_design/app", "Multipart/Related; boundary=x"), related);
        assert_eq!(bound(Method::PUT, "doc", "application/json"), None);
        assert_eq!(bound(Method::PUT, "_design/app/_update/u/doc", ""), None, "an update function");
        assert_eq!(bound(Method::PUT, "_local/cp", "multipart/related"), None);
        assert_eq!(bound(Method::PUT, "_security", ""), None);
        assert_eq!(bound(Method::POST, "doc/photo.png", ""), None, "not a PUT");
        assert_eq!(bound(Method::POST, "_bulk_docs", "application/json"), None, "checked here: read whole");
        assert!(names_attachment("doc/a.txt") && names_attachment("_design/d/a.txt"));
        assert!(!names_attachment("doc") && !names_attachment("_design/d/_view/v") && !names_attachment("_local/x"));
    }

    #[test]
    fn ranges_as_http_reads_them() {
        use RangeAsked::{Part, Unsatisfiable, Whole};
        assert_eq!(range_asked("bytes=0-9", 100), Part(0, 10));
        assert_eq!(range_asked("bytes=90-200", 100), Part(90, 100), "cut to the length");
        assert_eq!(range_asked("bytes=95-", 100), Part(95, 100));
        assert_eq!(range_asked("bytes=-10", 100), Part(90, 100));
        assert_eq!(range_asked("bytes=-1000", 100), Part(0, 100));
        assert_eq!(range_asked("bytes=100-", 100), Unsatisfiable);
        assert_eq!(range_asked("bytes=-0", 100), Unsatisfiable);
        assert_eq!(range_asked("bytes=0-1,5-6", 100), Whole, "several ranges: the whole, as CouchDB");
        assert_eq!(range_asked("items=0-1", 100), Whole);
        assert_eq!(range_asked("bytes=9-1", 100), Whole);
    }

    #[tokio::test]
    async fn a_slice_spans_pieces() {
        use futures::StreamExt;
        let pieces = || {
            futures::stream::iter(
                ["abc", "defg", "", "hij"]
                    .map(|piece| Ok::<_, crate::error::Error>(Bytes::from_static(piece.as_bytes()))),
            )
        };
        for (start, end, expected) in [(0, 10, "abcdefghij"), (2, 5, "cde"), (3, 7, "defg"), (9, 10, "j"), (4, 4, "")] {
            let got: Vec<u8> = slice(pieces(), start, end)
                .map(|piece| piece.map(|bytes| bytes.to_vec()).unwrap_or_default())
                .concat()
                .await;
            assert_eq!(String::from_utf8_lossy(&got), expected, "{start}..{end}");
        }
    }
}
