//! Design documents: `/{db}/_design/…` of the data-store database (the document itself,
//! `_view`, `_info`, `_show`, `_list`, `_update`, …), and its `_view_cleanup` and
//! `_design_docs`.
//!
//! The data-store router reaches these only over the CouchDB backend, which runs design documents
//! itself: a request is passed to the database unchanged and its answer streamed back
//! ([`DocumentBackend::design_request`](crate::backend::DocumentBackend::design_request)), so an
//! existing deployment's views keep answering as CouchDB answers them. Over the other backends
//! the data-store database's design documents and views are the engine's (`super::db`).
//! Design documents are for admins only here: a view reads every user's documents, which a
//! per-user login must not see.

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use percent_encoding::{percent_decode_str, utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};

use super::access::Principal;
use super::error::{CouchError, CouchResult};
use super::served_db::ServedDb;
use super::{Answer, CouchState};
use crate::backend::DesignRequest;

/// The request headers a design request depends on; no other header (credentials, cookies,
/// encodings already undone) is passed on.
const PASSED_HEADERS: [&str; 4] = ["content-type", "accept", "if-match", "if-none-match"];

/// Escapes a design document's name as one path segment (everything but RFC 3986 unreserved).
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// What a backend that neither runs design documents nor lets this process keep them answers.
pub fn not_supported() -> CouchError {
    CouchError::not_supported("design documents (views, shows, lists, update and validation functions)")
}

/// The path below the database of a request for `/{db}/_design/…`, as the client encoded it.
/// A `.` or `..` segment, encoded or not, is refused: it would leave the design document (or the
/// database) once the URL is resolved.
pub fn path_below_db(raw_path: &str) -> CouchResult<String> {
    let below = raw_path.trim_start_matches('/').split_once('/').map(|(_, rest)| rest).unwrap_or("");
    if !below.starts_with("_design/") {
        return Err(CouchError::bad_request("a design document path starts /{db}/_design/"));
    }
    for segment in below.split('/') {
        let decoded = percent_decode_str(segment).decode_utf8_lossy();
        if decoded == "." || decoded == ".." {
            return Err(CouchError::bad_request(format!(
                "design document paths may not contain the segment {segment:?}"
            )));
        }
    }
    Ok(below.to_owned())
}

/// The path of a design document named by a whole (decoded) document id, `_design/{name}`, as
/// `/{db}/_design%2F{name}` reaches the document routes.
pub fn path_of_id(id: &str) -> String {
    let name = id.strip_prefix("_design/").unwrap_or(id);
    format!("_design/{}", utf8_percent_encode(name, SEGMENT))
}

/// Runs a design request through the backend, which runs design documents (the CouchDB backend;
/// no other reaches this router's design routes).
pub async fn run(
    state: &CouchState,
    principal: &Principal,
    method: Method,
    path: String,
    query: Option<&str>,
    headers: &HeaderMap,
    body: Body,
) -> Answer {
    principal.confinement().check_design()?;
    let (body, _share) = state.bodies.read_bytes(headers, body).await?;
    let request = DesignRequest {
        method,
        path,
        query: query.map(str::to_owned),
        headers: PASSED_HEADERS
            .iter()
            .filter_map(|name| Some(((*name).to_owned(), headers.get(*name)?.to_str().ok()?.to_owned())))
            .collect(),
        body: crate::backend::DesignBody::Whole(body),
    };
    let Some(answer) = state.store.backend().design_request(request).await? else {
        return Err(not_supported());
    };
    let status = StatusCode::from_u16(answer.status)
        .map_err(|_| CouchError::internal(format!("the backend answered status {}", answer.status)))?;
    let mut response = (status, Body::from_stream(answer.body)).into_response();
    for (name, value) in answer.headers {
        if let (Ok(name), Ok(value)) = (HeaderName::try_from(name), HeaderValue::try_from(value)) {
            response.headers_mut().insert(name, value);
        }
    }
    Ok(response)
}

/// `/{db}/_design/…`, any method.
pub async fn design_request(
    axum::extract::State(state): axum::extract::State<CouchState>,
    axum::extract::Extension(principal): axum::extract::Extension<Principal>,
    _served: ServedDb,
    method: Method,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let answer = match path_below_db(uri.path()) {
        Ok(path) => run(&state, &principal, method, path, uri.query(), &headers, body).await,
        Err(err) => Err(err),
    };
    answer.unwrap_or_else(IntoResponse::into_response)
}

/// `POST /{db}/_view_cleanup`: passed to the backend, which runs design documents.
pub async fn view_cleanup(
    axum::extract::State(state): axum::extract::State<CouchState>,
    axum::extract::Extension(principal): axum::extract::Extension<Principal>,
    _served: ServedDb,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    run(&state, &principal, Method::POST, "_view_cleanup".to_owned(), uri.query(), &headers, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_stay_below_the_design_document() {
        assert_eq!(path_below_db("/agent_data_store/_design/d/_view/v").unwrap(), "_design/d/_view/v");
        assert_eq!(path_below_db("/db/_design/a%2Fb").unwrap(), "_design/a%2Fb");
        for escaping in ["/db/_design/../_all_docs", "/db/_design/%2e%2E/x", "/db/_design/d/./x", "/db/_all_docs"] {
            assert!(path_below_db(escaping).is_err(), "{escaping}");
        }
        assert_eq!(path_of_id("_design/data store"), "_design/data%20store");
    }
}
