//! Headers every CouchDB answer carries, whatever produced it (handler, error, fallback, 304,
//! HEAD): clients such as aiocouch and pycouchdb read `Content-Type` on every response and parse
//! the body as JSON, so it is `application/json` even where there is no body.

use axum::extract::Request;
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;

/// Middleware: CouchDB's `Content-Type` and `Cache-Control` on every response.
pub async fn couchdb_headers(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    let is_json_or_stream = headers.get(header::CONTENT_TYPE).is_some();
    if !is_json_or_stream {
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    }
    // An event stream (`feed=eventsource`) is `no-cache`, as CouchDB 3.4.3 sends it (`chttpd_db`,
    // `global_changes_httpd`); the console's files say their own (`crate::console`: `private,
    // must-revalidate`); everything else `must-revalidate`.
    let event_stream =
        headers.get(header::CONTENT_TYPE).is_some_and(|t| t.as_bytes().starts_with(b"text/event-stream"));
    if event_stream {
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    } else if !headers.contains_key(header::CACHE_CONTROL) {
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("must-revalidate"));
    }
    headers.insert(header::SERVER, HeaderValue::from_static(concat!("agentstore/", env!("CARGO_PKG_VERSION"))));
    response
}

/// A quoted revision, CouchDB's `ETag`.
pub fn etag(rev: &str) -> HeaderValue {
    HeaderValue::from_str(&format!("\"{rev}\"")).unwrap_or_else(|_| HeaderValue::from_static("\"\""))
}

/// Whether `If-None-Match` names this revision (the client's cached copy is current).
pub fn not_modified(headers: &axum::http::HeaderMap, rev: &str) -> bool {
    headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|tag| tag.trim().trim_start_matches("W/").trim_matches('"') == rev))
}
