//! A plain read of one data-store document on the CouchDB backend, passed to CouchDB as it came
//! and its answer streamed back, instead of read through the engine (issue 38).
//!
//! The engine's read of a data-store document over CouchDB asks for the document's whole tree
//! (`?open_revs=all&revs=true`), parses every leaf, picks the winner by CouchDB's rules and writes
//! it out again; for `GET /{db}/{docid}` with no query, that is CouchDB's own answer to a plain
//! `GET` of the document, which names the same winner (CouchDB's rules are the engine's), in
//! CouchDB's member order and number text. Passing that answer on costs agentstore about what a
//! forwarded read of another database costs, and CouchDB a plain read of the winner instead of
//! every leaf with its history (docs/benchmarks.md, "In front of CouchDB (session 19)").
//!
//! The rules stay applied: the request acts for a principal (checked before it reaches here),
//! a per-user login reads only its own user's ids ([`Confinement::check_id`]), and the read is
//! counted in the node's statistics as the engine counts it. Only CouchDB's 200 is passed on as
//! it came. A 404 `deleted` is answered as the engine answers it; any other answer (`missing`,
//! which pouchdb-server also answers for a deleted document, a database gone, a server error)
//! sends the request on to the engine's handlers, which answer it as before: a missing
//! document costs two backend requests, a found one one.

use axum::extract::Request;
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::backend::{DesignBody, DesignRequest, DesignResponse};
use crate::couchdb_api::auth::Identity;
use crate::couchdb_api::error::CouchError;
use crate::couchdb_api::CouchState;
use crate::database::data_store_rules::Confinement;

/// The most of a CouchDB 404's body read to tell a deleted document from anything else (its
/// `{"error":"not_found","reason":"deleted"}` is 41 bytes).
const MAX_NOT_FOUND_BYTES: usize = 4 * 1024;

/// The request headers a plain read passes on: which answer the client accepts.
const PASSED_HEADERS: [&str; 1] = ["accept"];

/// The document id a request reads plainly, percent-decoded: `GET /{db}/{docid}` with no query
/// string and no body, no validator (`If-None-Match`), and an id that is neither a design nor a
/// local document nor any other `_` path. `None`: the engine's handlers answer it.
pub(super) fn plain_read_id(request: &Request, below: &str) -> Option<String> {
    if request.method() != Method::GET || request.uri().query().is_some_and(|query| !query.is_empty()) {
        return None;
    }
    let headers = request.headers();
    if headers.contains_key(header::IF_NONE_MATCH)
        || headers.contains_key(header::TRANSFER_ENCODING)
        || headers.get(header::CONTENT_LENGTH).is_some_and(|length| length.as_bytes() != b"0")
    {
        return None;
    }
    if below.is_empty() || below.contains('/') {
        return None;
    }
    let id = percent_encoding::percent_decode_str(below).decode_utf8().ok()?;
    (!id.is_empty() && !id.starts_with('_')).then(|| id.into_owned())
}

/// Passes the plain read of `id` (below the database as `below`) to CouchDB: `Ok` with the
/// answer, or the request handed back (`Err`) for the engine's handlers to answer.
pub(super) async fn pass_plain_read(
    state: &CouchState,
    id: &str,
    below: &str,
    request: Request,
) -> Result<Response, Request> {
    let Some(confinement) = confinement_of(&request) else { return Err(request) };
    if let Err(refusal) = confinement.check_id(id) {
        return Ok(CouchError::from(refusal).into_response());
    }
    let db = &state.data_store_database;
    let asked = DesignRequest {
        method: Method::GET,
        path: below.to_owned(),
        query: None,
        headers: PASSED_HEADERS
            .iter()
            .filter_map(|name| Some(((*name).to_owned(), request.headers().get(*name)?.to_str().ok()?.to_owned())))
            .collect(),
        body: DesignBody::Whole(bytes::Bytes::new()),
    };
    let answer = match db.backend().design_request(asked).await {
        Ok(Some(answer)) => answer,
        // No answer, or a failure to reach CouchDB: the engine's read reports it as it always has.
        _ => return Err(request),
    };
    match answer.status {
        200 => {
            db.record_reads(1);
            Ok(passed_on(answer))
        }
        // pouchdb-server answers a deleted document `missing` too, which the engine, reading
        // the tree, answers `deleted` as CouchDB does: only `deleted` is taken as said.
        404 => match not_found_reason(answer).await.as_deref() {
            Some("deleted") => Ok(CouchError::deleted().into_response()),
            _ => Err(request),
        },
        _ => Err(request),
    }
}

/// The login's confinement on the data-store database (its principal's), or `None` when the
/// request acts for none (the engine's handlers answer the refusal).
fn confinement_of(request: &Request) -> Option<Confinement> {
    let identity = request.extensions().get::<Identity>()?;
    identity.require().ok().map(|principal| principal.confinement())
}

/// CouchDB's 200 as it came: status, the headers [`DesignResponse`] keeps (length, `ETag`), and
/// the body streamed; its type is `application/json`, as the engine's read answers it, whatever
/// the server behind said (pouchdb-server, like CouchDB for a client that does not ask for JSON,
/// answers `text/plain`, which JSON clients such as aiocouch refuse: suite
/// `couchdb_clients::aiocouch` over the CouchDB backend).
fn passed_on(answer: DesignResponse) -> Response {
    let mut response = (StatusCode::OK, axum::body::Body::from_stream(answer.body)).into_response();
    for (name, value) in answer.headers {
        if name.eq_ignore_ascii_case(header::CONTENT_TYPE.as_str()) {
            continue;
        }
        if let (Ok(name), Ok(value)) = (header::HeaderName::try_from(name), HeaderValue::try_from(value)) {
            response.headers_mut().insert(name, value);
        }
    }
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// The `reason` of CouchDB's 404 `not_found` answer, or `None` for any other body.
async fn not_found_reason(answer: DesignResponse) -> Option<String> {
    let body = answer.body_within(MAX_NOT_FOUND_BYTES, "CouchDB's 404 answer").await.ok()?;
    let body: serde_json::Value = serde_json::from_slice(&body).ok()?;
    if body.get("error").and_then(serde_json::Value::as_str) != Some("not_found") {
        return None;
    }
    body.get("reason").and_then(serde_json::Value::as_str).map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(method: Method, uri: &str, headers: &[(&str, &str)]) -> Request {
        let mut builder = axum::http::Request::builder().method(method).uri(uri);
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        builder.body(axum::body::Body::empty()).expect("a request")
    }

    fn id_of(method: Method, uri: &str, headers: &[(&str, &str)]) -> Option<String> {
        let below = uri.trim_start_matches('/').split('?').next().unwrap_or_default();
        let below = below.split_once('/').map_or("", |(_, below)| below);
        plain_read_id(&request(method, uri, headers), below)
    }

    #[test]
    fn only_a_plain_read_of_a_document_is_passed() {
        assert_eq!(id_of(Method::GET, "/db/u%3Ans%3Aa2V5", &[]).as_deref(), Some("u:ns:a2V5"));
        assert_eq!(id_of(Method::GET, "/db/u%3Ans%3Aa2V5?", &[]).as_deref(), Some("u:ns:a2V5"));
        assert_eq!(id_of(Method::GET, "/db/doc", &[("content-length", "0")]).as_deref(), Some("doc"));
        assert_eq!(id_of(Method::GET, "/db/doc?conflicts=true", &[]), None, "any option");
        assert_eq!(id_of(Method::GET, "/db/doc?rev=1-a", &[]), None);
        assert_eq!(id_of(Method::HEAD, "/db/doc", &[]), None);
        assert_eq!(id_of(Method::PUT, "/db/doc", &[]), None);
        assert_eq!(id_of(Method::GET, "/db/doc", &[("if-none-match", "\"1-a\"")]), None);
        assert_eq!(id_of(Method::GET, "/db/doc", &[("content-length", "2")]), None);
        assert_eq!(id_of(Method::GET, "/db/doc/att.txt", &[]), None, "an attachment");
        assert_eq!(id_of(Method::GET, "/db/_all_docs", &[]), None);
        assert_eq!(id_of(Method::GET, "/db/%5Fall_docs", &[]), None, "an encoded underscore");
        assert_eq!(id_of(Method::GET, "/db/_local/x", &[]), None);
        assert_eq!(id_of(Method::GET, "/db/", &[]), None);
        assert_eq!(id_of(Method::GET, "/db/%FF", &[]), None, "not UTF-8");
    }
}
