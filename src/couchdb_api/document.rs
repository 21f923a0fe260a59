//! What every database's document writes share at the HTTP layer: the one revision a write
//! names ([`named_revision`]: body `_rev`, `?rev=` and `If-Match` must agree); and the data-store router's `/{db}/{docid}`
//! ([`by_id`]), which only ids the engine's routes leave to it reach: a design document named
//! with its slash encoded (`_design%2Fname`, a design request) and the reserved names the
//! router keeps (`_security`, …: refused as ids, as CouchDB refuses them). The data-store
//! database's documents are the engine's on every backend (`super::db`).

use std::collections::HashMap;

use axum::body::Body;
use axum::extract::{Extension, Path, RawQuery, State};
use axum::http::{header, HeaderMap, Method};

use super::access::Principal;
use super::error::{CouchError, CouchResult};
use super::{Answer, CouchState};
use crate::database::data_store_rules::DESIGN_PREFIX;

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

/// `GET/HEAD/PUT/DELETE /{db}/{docid}` on the data-store router: a design document named with its
/// slash encoded is a design request ([`super::design::run`]); any other id reaching this router
/// is one of the names it keeps, refused as an id (CouchDB's 400 for a reserved `_` prefix).
pub async fn by_id(
    State(state): State<CouchState>,
    Extension(principal): Extension<Principal>,
    Path((db, docid)): Path<(String, String)>,
    method: Method,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    state.check_db(&db)?;
    if !docid.starts_with(DESIGN_PREFIX) {
        crate::database::document::check_id(&docid).map_err(super::db::refused)?;
        return Ok(super::server::no_route().await);
    }
    let path = super::design::path_of_id(&docid);
    super::design::run(&state, &principal, method, path, query.as_deref(), &headers, body).await
}
