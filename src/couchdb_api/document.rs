//! What every database's document writes share at the HTTP layer: the one revision a write
//! names ([`named_revision`]: body `_rev`, `?rev=` and `If-Match` must agree).

use std::collections::HashMap;

use axum::http::{header, HeaderMap};

use super::error::{CouchError, CouchResult};

/// The one revision a write names in its body (`_rev`), its query (`?rev=`) and `If-Match`,
/// unparsed; 400 when they disagree (CouchDB's message). Shared by every database's writes.
pub(crate) fn named_revision<'a>(
    body_rev: Option<&'a str>,
    params: &'a HashMap<String, String>,
    headers: &'a HeaderMap,
) -> CouchResult<Option<&'a str>> {
    let query_rev = params.get("rev").map(String::as_str);
    let header_rev = headers.get(header::IF_MATCH).and_then(|v| v.to_str().ok()).map(|v| v.trim().trim_matches('"'));
    let mut chosen: Option<&str> = None;
    for rev in [body_rev, query_rev, header_rev].into_iter().flatten() {
        match chosen {
            Some(previous) if previous != rev => {
                return Err(CouchError::bad_request(
                    "Document rev from request body and query string have different values",
                ))
            }
            _ => chosen = Some(rev),
        }
    }
    Ok(chosen)
}
