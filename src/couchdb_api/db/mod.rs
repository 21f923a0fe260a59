//! The CouchDB API of every database: documents under CouchDB's rules, with their whole revision
//! trees ([`crate::database`]), the data-store database's under its rules too.
//!
//! Requests reach this router through [`dispatch`]: every request whose first path segment names
//! a database (anything but the server's own `_` endpoints), the data-store one included on every
//! backend ([`CouchState::data_store_database`]). Each handler opens its database with the
//! [`OpenDb`] extractor, which answers CouchDB's 400 for an illegal name, 404 for a database that
//! does not exist and 403 for a login its `_security` does not admit (on the data-store database:
//! 401/403 for a request acting for no principal), and hands the handler what that login may do
//! there ([`DbAccess`], see [`super::access`]) and which documents it may see ([`Confinement`]: a
//! per-user login's own on the data-store database, everything elsewhere), which every handler
//! that reads applies.
//!
//! On the CouchDB backend the databases other than the data-store one are passed to CouchDB as
//! they came ([`forward_if_native`], [`forwarded`]); so are the data-store database's design
//! documents, everything below them (views, shows, lists, updates, rewrites) and
//! `_view_cleanup`, an admin's only ([`runs_on_the_backend`]), so an existing deployment's views
//! answer as CouchDB answers them, and a plain `GET` of one of its documents ([`passed_read`]:
//! CouchDB's own answer names the winner the engine would). Its documents, listings (`_design_docs` too), feed and Mango
//! are this router's, over its native tree layout (`crate::database::layout::native`).
//!
//! - [`admin`]: creating, reading and deleting databases (never the data-store one), `_all_dbs`,
//!   `_dbs_info`, settings; [`info`]: a database's information as a login is shown it.
//! - [`docs`]: one document: read with every option, write, delete, local documents.
//! - [`attachments`]: standalone attachments, and `_attachments` in reads and writes.
//! - [`inline`]: the server-wide budget of attachment bytes answered inline.
//! - [`bulk`]: `_bulk_docs`, `_bulk_get`, `_revs_diff`, `_missing_revs`, `_purge`.
//! - [`all_docs`]: `_all_docs`, `_design_docs` and `_local_docs`.
//! - [`mango`]: `_find`, `_explain`, `_index` ([`crate::mango`]).
//! - [`views`]: `_view` queries, `_info` and `_view_cleanup` ([`crate::views`]).
//! - `_changes` is the data-store database's feed machinery ([`super::changes`]) over this
//!   database's rows.

mod admin;
mod all_docs;
mod attachments;
mod bulk;
mod docs;
mod forwarded;
mod info;
mod inline;
mod mango;
mod passed_read;
mod views;

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{FromRequestParts, Path, Request};
use axum::http::request::Parts;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::Router;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;
use tower::ServiceExt;

pub(crate) use admin::{all_dbs, create_db, dbs_info, get_dbs_info};
pub(crate) use attachments::{inline_into, inline_wanted, Inline};
pub(crate) use bulk::MAX_BULK_DOCS;
pub(crate) use inline::{hold_inline_until_sent, with_own_shares};

use super::access::{db_access, not_admitted, DbAccess};
use super::auth::Identity;
use super::error::CouchError;
use super::CouchState;
use crate::backend::catalog::DbName;
use crate::database::data_store_rules::Confinement;
use crate::database::validation::{as_writer, Writer};
use crate::database::Database;

/// The routes of every database, the data-store one included.
pub(crate) fn router(state: CouchState) -> Router {
    // Bodies that are a query or a selector take `couchdb_max_query_bytes` (docs/bounds.md).
    let queries = Router::new()
        .route("/{db}/_find", post(docs::mango))
        .route("/{db}/_explain", post(docs::mango))
        .route("/{db}/_index", any(docs::mango))
        .route("/{db}/_changes", get(super::changes::get_database_changes).post(super::changes::post_database_changes))
        .route_layer(axum::middleware::from_fn_with_state(
            state.bodies.query_endpoint_limit(),
            super::request::limit_bodies,
        ));
    Router::new()
        .merge(queries)
        .route("/{db}", get(admin::db_info).put(admin::create_db).delete(admin::delete_db).post(docs::post_document))
        .route("/{db}/", get(admin::db_info).put(admin::create_db).delete(admin::delete_db).post(docs::post_document))
        .route("/{db}/_all_docs", get(all_docs::get_all_docs).post(all_docs::post_all_docs))
        .route("/{db}/_design_docs", get(all_docs::get_design_docs))
        .route("/{db}/_local_docs", get(all_docs::local_docs).post(all_docs::local_docs))
        .route("/{db}/_bulk_docs", post(bulk::bulk_docs))
        .route("/{db}/_bulk_get", post(bulk::bulk_get))
        .route("/{db}/_revs_diff", post(bulk::revs_diff))
        .route("/{db}/_missing_revs", post(bulk::missing_revs))
        .route("/{db}/_purge", post(bulk::purge))
        .route("/{db}/_index/{*rest}", any(docs::mango))
        .route("/{db}/_revs_limit", get(admin::get_revs_limit).put(admin::put_revs_limit))
        .route("/{db}/_purged_infos_limit", any(admin::purged_infos_limit))
        .route("/{db}/_purged_infos_limit/", any(admin::purged_infos_limit))
        .route("/{db}/_security", get(admin::get_security).put(admin::put_security))
        .route("/{db}/_compact", post(admin::compact))
        .route("/{db}/_compact/{ddoc}", post(admin::compact))
        .route("/{db}/_view_cleanup", post(views::view_cleanup))
        .route("/{db}/_ensure_full_commit", post(admin::ensure_full_commit))
        .route("/{db}/_local/{*name}", get(docs::get_local).put(docs::put_local).delete(docs::delete_local))
        .route("/{db}/_design/{ddoc}", any(docs::design_document))
        .route("/{db}/_design/{ddoc}/_view/{view}", any(views::view))
        .route("/{db}/_design/{ddoc}/_view/{view}/queries", post(views::view_queries))
        .route("/{db}/_design/{ddoc}/_info", get(views::design_info))
        .route("/{db}/_design/{ddoc}/{*rest}", any(docs::design_function))
        .route("/{db}/{docid}", any(docs::document))
        .route("/{db}/{docid}/{*attachment}", any(attachments::attachment))
        .fallback(super::root::no_route)
        .with_state(state)
}

/// Sends a request below a database (the data-store one included) to the databases' router;
/// the server's own endpoints (a first segment starting with `_`) continue to the server's.
///
/// Each branch's future is boxed, so that this middleware's own future, which axum moves into a
/// box of its own on every request, does not hold the largest of them inline (the forwarding
/// with its HTTP client's request). Copies of futures were 7% of a forwarded `GET`'s
/// instructions (callgrind, issue 38); this removed only a sixth of them, the rest being axum's
/// layers' own (docs/benchmarks.md, "In front of CouchDB (session 17)").
pub(crate) async fn dispatch(
    axum::extract::State(state): axum::extract::State<CouchState>,
    request: Request,
    next: Next,
) -> Response {
    let first = request.uri().path().trim_start_matches('/').split('/').next().unwrap_or_default();
    let first = percent_encoding::percent_decode_str(first).decode_utf8_lossy().into_owned();
    let system_database = crate::backend::catalog::SYSTEM_DATABASES.contains(&first.as_str());
    if first.is_empty() || (first.starts_with('_') && !system_database) {
        return next.run(request).await;
    }
    if let Err(refusal) = server_admin_only_paths(&first, &request) {
        return refusal.into_response();
    }
    if *first == *state.db {
        return Box::pin(serve_data_store(&state, request)).await;
    }
    // Every database route needs a login, as the data-store routes do; its `_security` decides
    // the rest.
    if let Err(refusal) = super::require_login(&request) {
        return refusal.into_response();
    }
    let mut request = match Box::pin(forward_if_native(&state, &first, request)).await {
        Ok(answer) => return answer,
        Err(request) => request,
    };
    let opened = OpenedDatabase::default();
    request.extensions_mut().insert(opened.clone());
    let answer = Box::pin(route(&state, request)).await;
    Box::pin(missing_if_deleted(&state, &first, opened.get(), answer)).await
}

/// The database a request below a database opened ([`OpenDb`] sets it), kept by [`dispatch`] to
/// tell, when the answer is a server error, whether that database was deleted under the request
/// even though its name was created again since ([`missing_if_deleted`]).
#[derive(Clone, Default)]
struct OpenedDatabase(Arc<std::sync::OnceLock<Arc<Database>>>);

impl OpenedDatabase {
    fn set(&self, database: &Arc<Database>) {
        // The first database a request opens is the one it was sent to.
        let _ = self.0.set(Arc::clone(database));
    }

    fn get(&self) -> Option<Arc<Database>> {
        self.0.get().cloned()
    }
}

/// CouchDB's checks before a system database's `_security` (`chttpd_auth_request`): `_users`'
/// `_all_docs` and `_changes` are a server admin's (401 "You are not a server admin.").
fn server_admin_only_paths(db: &str, request: &Request) -> Result<(), CouchError> {
    let below = request.uri().path().trim_start_matches('/').split('/').nth(1).unwrap_or_default();
    let admin_only = crate::database::users::is_users_db(db) && matches!(below, "_all_docs" | "_changes");
    let identity = request.extensions().get::<Identity>();
    if admin_only && !identity.is_some_and(Identity::is_server_admin) {
        return Err(CouchError::unauthorized("You are not a server admin."));
    }
    Ok(())
}

/// Whether `db` is the data-store database as the engine serves it.
pub(crate) fn is_data_store(state: &CouchState, db: &Arc<Database>) -> bool {
    state.is_data_store(db)
}

/// A request on the data-store database served by the engine: it acts for a principal (401
/// without a login, 403 for a login with no data-store user), as every data-store route does.
async fn serve_data_store(state: &CouchState, mut request: Request) -> Response {
    if let Err(refusal) = super::require_principal(&mut request) {
        return refusal.into_response();
    }
    // As it always answered them (its design paths were passed to a backend once).
    let path = request.uri().path();
    let below = path.trim_start_matches('/').split_once('/').map_or("", |(_, below)| below).to_owned();
    if let Err(refusal) = refuse_dot_segments(&below) {
        return refusal.into_response();
    }
    let native = state.data_store_database.backend().forwards_requests();
    if native && runs_on_the_backend(&below) {
        return forward_data_store_design(state, &below, request).await.unwrap_or_else(IntoResponse::into_response);
    }
    if let Some(id) = native.then(|| passed_read::plain_read_id(&request, &below)).flatten() {
        request = match Box::pin(passed_read::pass_plain_read(state, &id, &below, request)).await {
            Ok(answer) => return answer,
            Err(request) => request,
        };
    }
    route(state, request).await
}

/// Whether a path below the data-store database (as the client encoded it) is one a backend
/// that runs design documents itself answers: a design document (`_design/{ddoc}`, also with its
/// slash encoded) and everything below it (`_view`, `_info`, `_show`, `_list`, `_update`,
/// `_rewrite`, attachments), and `_view_cleanup`. An existing deployment's views keep answering
/// as the backing CouchDB answers them.
fn runs_on_the_backend(below: &str) -> bool {
    let first = below.split('/').next().unwrap_or_default();
    // Only a segment that decodes to a leading `_` can be one: a document id (most requests) is
    // not decoded for nothing.
    if !(first.starts_with('_') || first.get(..3).is_some_and(|start| start.eq_ignore_ascii_case("%5F"))) {
        return false;
    }
    let first = percent_encoding::percent_decode_str(first).decode_utf8_lossy();
    (first == "_design" && below.len() > "_design/".len()) || first.starts_with("_design/") || first == "_view_cleanup"
}

/// A design path of the data-store database on the CouchDB backend ([`runs_on_the_backend`]),
/// passed to it as the backend's other databases' requests are ([`forward`]): an admin's only,
/// as every design route of the data-store database is (a view reads every user's documents).
async fn forward_data_store_design(state: &CouchState, below: &str, request: Request) -> Result<Response, CouchError> {
    let Some(identity) = request.extensions().get::<Identity>().cloned() else {
        return Err(CouchError::internal("the request was not identified"));
    };
    let principal = identity.require()?;
    principal.confinement().check_design()?;
    forward(state, &state.data_store_database, &identity, below, request).await
}

/// A path below a database with a `.` or `..` segment (encoded or not) is refused (400): resolved,
/// it would leave what it names (a design document, or the database).
fn refuse_dot_segments(below: &str) -> Result<(), CouchError> {
    // `..` takes at most six characters encoded (`%2E%2E`): a longer segment is not decoded.
    for segment in below.split('/').filter(|segment| segment.len() <= "%2E%2E".len()) {
        let decoded = percent_encoding::percent_decode_str(segment).decode_utf8_lossy();
        if decoded == "." || decoded == ".." {
            return Err(CouchError::bad_request(format!("database paths may not contain the segment {segment:?}")));
        }
    }
    Ok(())
}

/// A server error answered on a database that no longer exists was caused by its deletion
/// racing the request (a table or file gone under a backend call that no engine check saw):
/// CouchDB answers a missing database 404 `not_found`, whatever raced with it. So is one on the
/// database the request `opened` when its name now holds another database (deleted and created
/// again meanwhile): the request's database is gone all the same.
async fn missing_if_deleted(
    state: &CouchState,
    name: &str,
    opened: Option<Arc<Database>>,
    answer: Response,
) -> Response {
    if !may_be_a_deleted_database(&answer) {
        return answer;
    }
    let Ok(name) = DbName::parse(name) else { return answer };
    let gone = match state.databases.open(&name).await {
        Ok(None) => true,
        Ok(Some(current)) => opened.is_some_and(|opened| !Arc::ptr_eq(&opened, &current)),
        Err(_) => false,
    };
    if gone {
        return CouchError::no_database().into_response();
    }
    answer
}

/// Whether an answer may come from the database being deleted under the request, so that
/// [`missing_if_deleted`] looks the database up: a server error, or a 404 about a part of the
/// database (a view group dropped with it: CouchDB's missing-database answer once the database
/// is gone). A document-level 404 (`missing`, `deleted`: [`CouchError::missing`]) was answered
/// by the open database, whose reads after a deletion answer the missing database themselves
/// ([`Database::while_open`]): the most common 404 costs no look-up. Told by the response's
/// mark, never by its body.
fn may_be_a_deleted_database(answer: &Response) -> bool {
    let status = answer.status();
    if status.is_server_error() {
        return true;
    }
    status == axum::http::StatusCode::NOT_FOUND && answer.extensions().get::<super::error::DocumentNotFound>().is_none()
}

/// The headers a forwarded request carries to the CouchDB backend (never the client's
/// credentials: the backend's own are used). `Content-Length` and `Content-Encoding` go only with
/// a body streamed as it came ([`forwarded`]).
const FORWARDED_HEADERS: [&str; 10] = [
    "content-type",
    "accept",
    "if-match",
    "if-none-match",
    "if-range",
    "range",
    "destination",
    "content-md5",
    "content-length",
    "content-encoding",
];

/// On a backend whose databases stay native (the CouchDB backend), every request on an existing
/// database but its creation and deletion is passed to that database as it came, its answer
/// streamed back. The request is handed back (`Err`) where the database's documents are kept
/// here, or it does not exist (the router answers then).
async fn forward_if_native(state: &CouchState, name: &str, request: Request) -> Result<Response, Request> {
    let path = request.uri().path().to_owned();
    let below = path.trim_start_matches('/').split_once('/').map(|(_, rest)| rest).unwrap_or("").to_owned();
    if below.is_empty() && matches!(*request.method(), axum::http::Method::PUT | axum::http::Method::DELETE) {
        return Err(request);
    }
    let Ok(name) = DbName::parse(name) else { return Err(request) };
    // A database held open is passed on without asking the backend first whether it still
    // exists: the forwarded request itself asks it (one backend request per client request,
    // issue 38; `Databases::held_open` says why that is safe).
    let held = state.databases.held_open(&name).filter(|db| db.backend().forwards_requests());
    let unconfirmed = held.is_some();
    let db = match held {
        Some(db) => db,
        None => match state.databases.open(&name).await {
            Ok(Some(db)) if db.backend().forwards_requests() => db,
            _ => return Err(request),
        },
    };
    let Some(identity) = request.extensions().get::<Identity>().cloned() else { return Err(request) };
    let answer = forward(state, &db, &identity, &below, request).await.unwrap_or_else(IntoResponse::into_response);
    // A 404 may be the database gone (deleted through another instance): confirmed with the
    // catalog as before, so that it is let go here and answered in CouchDB's words whatever
    // server is behind (pouchdb-server says `no_db_file`). A missing document costs that one
    // more request; nothing else does.
    if unconfirmed && answer.status() == axum::http::StatusCode::NOT_FOUND {
        if let Ok(None) = state.databases.open(&name).await {
            return Ok(CouchError::no_database().into_response());
        }
    }
    Ok(answer)
}

/// Whether a request passed to a native database changes it when it succeeds (an `updated`
/// event for `_db_updates`, `crate::database::activity`): every `PUT`, `DELETE` and `COPY`,
/// and the `POST`s that write (a new document, `_bulk_docs`, `_purge`, an update function).
fn changes_the_database(method: &axum::http::Method, below: &str) -> bool {
    use axum::http::Method;
    match *method {
        Method::PUT | Method::DELETE => true,
        Method::POST => {
            matches!(below, "" | "_bulk_docs" | "_purge")
                || below.starts_with("_design/") && below.split('/').nth(2) == Some("_update")
        }
        _ => method.as_str() == "COPY",
    }
}

async fn forward(
    state: &CouchState,
    db: &Database,
    identity: &Identity,
    below: &str,
    request: Request,
) -> Result<Response, CouchError> {
    let access = admit(db, identity).await?;
    refuse_dot_segments(below)?;
    let below = &*forwarded::design_path_spelled_out(below);
    let (parts, body) = request.into_parts();
    // Read as CouchDB reads it (raw bytes, `+` a space): a header that is not ASCII still names
    // the id the backend will write, and is checked as that id.
    let destination = parts
        .headers
        .get("destination")
        .map(|value| crate::couchdb_api::request::copy_destination_id(value.as_bytes()));
    let destination = destination.as_deref();
    let streamed = forwarded::streamed_bound(
        &parts.method,
        below,
        &parts.headers,
        db.max_document_bytes(),
        db.max_attachment_bytes(),
    );
    let passed_bound = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Kept until the answer is back: the body's share of the in-flight budgets.
    let mut _share = None;
    let body = match &streamed {
        Some(bound) => {
            let declared = parts.headers.get(axum::http::header::CONTENT_LENGTH);
            let declared = declared.and_then(|value| value.to_str().ok()?.trim().parse::<u64>().ok());
            if declared.is_some_and(|length| length > bound.bytes) {
                return Ok(forwarded::too_large(bound));
            }
            // Streamed bodies are PUTs, whose access does not depend on the body.
            check_forwarded(access, &parts.method, below, destination, &[])?;
            forwarded::streamed_body(body, bound.bytes, Arc::clone(&passed_bound))
        }
        None => {
            let (body, share) = state.bodies.read_bytes(&parts.headers, body).await?;
            _share = Some(share);
            check_forwarded(access, &parts.method, below, destination, &body)?;
            crate::backend::DesignBody::Whole(body)
        }
    };
    let range = parts.headers.get(axum::http::header::RANGE).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let if_range = parts.headers.get(axum::http::header::IF_RANGE).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let forwarded_request = crate::backend::DesignRequest {
        method: parts.method.clone(),
        path: below.to_owned(),
        query: parts.uri.query().map(str::to_owned),
        headers: FORWARDED_HEADERS
            .iter()
            .filter(|name| streamed.is_some() || !matches!(**name, "content-length" | "content-encoding"))
            .filter_map(|name| Some(((*name).to_owned(), parts.headers.get(*name)?.to_str().ok()?.to_owned())))
            .collect(),
        body,
    };
    let answer = db.backend().design_request(forwarded_request).await;
    if let Some(bound) = streamed.as_ref().filter(|_| passed_bound.load(std::sync::atomic::Ordering::Acquire)) {
        return Ok(forwarded::too_large(bound));
    }
    let Some(answer) = answer? else {
        return Err(CouchError::internal("the backend forwards requests but did not take this one"));
    };
    let status = axum::http::StatusCode::from_u16(answer.status)
        .map_err(|_| CouchError::internal(format!("the backend answered status {}", answer.status)))?;
    if status.is_success() && changes_the_database(&parts.method, below) {
        state.databases.activity().changed(db.name());
    }
    let mut headers = axum::http::HeaderMap::new();
    for (name, value) in answer.headers {
        if let (Ok(name), Ok(value)) =
            (axum::http::HeaderName::try_from(name), axum::http::HeaderValue::try_from(value))
        {
            headers.insert(name, value);
        }
    }
    let cut = match range {
        Some(range) if parts.method == axum::http::Method::GET && status == axum::http::StatusCode::OK => {
            cut_to_range(below, &range, if_range.as_deref(), &headers)
        }
        _ => None,
    };
    let mut response = match cut {
        None => (status, axum::body::Body::from_stream(answer.body)).into_response(),
        Some(forwarded::RangeAsked::Part(start, end)) => {
            let length = headers.get(axum::http::header::CONTENT_LENGTH).cloned();
            let total = length.as_ref().and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
            headers.insert(axum::http::header::CONTENT_LENGTH, axum::http::HeaderValue::from(end - start));
            if let Ok(value) = axum::http::HeaderValue::from_str(&format!("bytes {start}-{}/{total}", end - 1)) {
                headers.insert(axum::http::header::CONTENT_RANGE, value);
            }
            let part = forwarded::slice(answer.body, start, end);
            (axum::http::StatusCode::PARTIAL_CONTENT, axum::body::Body::from_stream(part)).into_response()
        }
        Some(_) => {
            // Unsatisfiable: CouchDB's 416, the length the range was asked of.
            let total = headers.get(axum::http::header::CONTENT_LENGTH).cloned();
            let mut refused = CouchError::new(
                axum::http::StatusCode::RANGE_NOT_SATISFIABLE,
                "requested_range_not_satisfiable",
                "Requested range not satisfiable",
            )
            .into_response();
            if let Some(value) = total.as_ref().and_then(|v| v.to_str().ok()) {
                if let Ok(value) = axum::http::HeaderValue::from_str(&format!("bytes */{value}")) {
                    refused.headers_mut().insert(axum::http::header::CONTENT_RANGE, value);
                }
            }
            return Ok(refused);
        }
    };
    response.headers_mut().extend(headers);
    Ok(response)
}

/// The range to cut a backend's whole answer (200) to a `Range` on an attachment to, as CouchDB
/// answers it itself ([`forwarded`]); `None` to pass the whole answer on: not an attachment, an
/// `If-Range` the answer's `ETag` does not match, an answer of unknown length or one kept
/// compressed (CouchDB serves no ranges of those), or a `Range` that asks for the whole.
fn cut_to_range(
    below: &str,
    range: &str,
    if_range: Option<&str>,
    headers: &axum::http::HeaderMap,
) -> Option<forwarded::RangeAsked> {
    if !forwarded::names_attachment(below) || headers.contains_key(axum::http::header::CONTENT_ENCODING) {
        return None;
    }
    if let Some(validator) = if_range {
        let etag = headers.get(axum::http::header::ETAG).and_then(|v| v.to_str().ok());
        if etag.is_none_or(|etag| etag.starts_with("W/") || etag != validator.trim()) {
            return None;
        }
    }
    let length = headers.get(axum::http::header::CONTENT_LENGTH)?.to_str().ok()?.trim().parse::<u64>().ok()?;
    match forwarded::range_asked(range, length) {
        forwarded::RangeAsked::Whole => None,
        asked => Some(asked),
    }
}

/// The database router's answer to a request (a fresh request with the same line, headers and
/// body: see [`dispatch`]).
async fn route(state: &CouchState, request: Request) -> Response {
    // A fresh request with the same line, headers and body: the server router's path
    // parameters must not reach the database router's (which sets its own). What the layers
    // before this one learnt travels along: who the request acts for, and its peer.
    let (parts, body) = request.into_parts();
    let mut forwarded = Request::new(body);
    *forwarded.method_mut() = parts.method;
    *forwarded.uri_mut() = parts.uri;
    *forwarded.version_mut() = parts.version;
    *forwarded.headers_mut() = parts.headers;
    let extensions = forwarded.extensions_mut();
    // Who writes, for the databases' validation functions (`validate_doc_update`'s `userCtx`) and
    // the data-store database's rules (its confinement).
    let mut writer = Writer::anonymous();
    if let Some(identity) = parts.extensions.get::<super::auth::Identity>() {
        writer = Writer {
            name: identity.user_ctx().name.map(str::to_owned),
            roles: identity.session_roles(),
            data_store: identity.principal.as_ref().map(super::access::Principal::confinement),
        };
        extensions.insert(identity.clone());
    }
    if let Some(peer) = parts.extensions.get::<axum::extract::ConnectInfo<std::net::SocketAddr>>() {
        extensions.insert(*peer);
    }
    let router = state.database_router.clone();
    match as_writer(writer, router.oneshot(forwarded)).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}

/// An open database the request may use, what its login may do there, and the route's other
/// path parameters in `T`.
pub(crate) struct OpenDb<T = DbOnly> {
    pub db: Arc<Database>,
    pub access: DbAccess,
    /// What the login may read and write there: on the data-store database, its principal's
    /// ([`Confinement::User`] for a per-user login); everything on the others.
    pub confinement: Confinement,
    pub params: T,
}

impl<T> OpenDb<T> {
    /// What acts on the whole database (`what`: purging, compacting, changing its settings) is
    /// never a per-user login's on the data-store database, which every user shares: 403 naming
    /// why, before CouchDB's own checks of the login's rights.
    pub fn check_database_wide(&self, what: &str) -> Result<(), CouchError> {
        Ok(self.confinement.check_database_wide(what)?)
    }
}

#[derive(Deserialize)]
pub(crate) struct DbOnly {}

/// The `{db}` path segment checked against CouchDB's name rule (400 `illegal_database_name`), and
/// against the length every backend keeps (400 `database_name_too_long`, CouchDB's answer to a
/// name its file system refuses: docs/couchdb-api.md).
pub(crate) fn db_name(text: &str) -> Result<DbName, CouchError> {
    DbName::parse(text).map_err(|err| {
        if DbName::only_too_long(text) {
            return CouchError::new(
                axum::http::StatusCode::BAD_REQUEST,
                "database_name_too_long",
                format!("At least one path segment of `{text}` is too long."),
            );
        }
        CouchError::new(axum::http::StatusCode::BAD_REQUEST, "illegal_database_name", err.message().to_owned())
    })
}

impl<T: DeserializeOwned + Send> FromRequestParts<CouchState> for OpenDb<T> {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &CouchState) -> Result<Self, Self::Rejection> {
        let Path(params) = Path::<HashMap<String, String>>::from_request_parts(parts, state)
            .await
            .map_err(IntoResponse::into_response)?;
        let name =
            db_name(params.get("db").map(String::as_str).unwrap_or_default()).map_err(IntoResponse::into_response)?;
        let identity = parts
            .extensions
            .get::<Identity>()
            .cloned()
            .ok_or_else(|| CouchError::internal("the request was not identified").into_response())?;
        let (db, access, confinement) = match data_store_admission(state, &name, &identity) {
            Some(admitted) => admitted.map_err(IntoResponse::into_response)?,
            None => {
                let db = match state.databases.open(&name).await {
                    Ok(Some(db)) => db,
                    Ok(None) => return Err(CouchError::no_database().into_response()),
                    Err(err) => return Err(CouchError::from(err).into_response()),
                };
                if let Some(opened) = parts.extensions.get::<OpenedDatabase>() {
                    opened.set(&db);
                }
                let access = admit(&db, &identity).await.map_err(IntoResponse::into_response)?;
                (db, access, Confinement::Everything)
            }
        };
        confine_path(&confinement, &params).map_err(IntoResponse::into_response)?;
        let Path(params) = Path::<T>::from_request_parts(parts, state).await.map_err(IntoResponse::into_response)?;
        Ok(OpenDb { db, access, confinement, params })
    }
}

/// A database opened for a request: it, what the login may do there, what it may see.
type Admission = (Arc<Database>, DbAccess, Confinement);

/// The data-store database as the engine serves it, what the request's principal may do there and
/// its confinement: an admin everything (a server admin's rights), a per-user login a member's
/// rights on its own user's documents. CouchDB's 401 without a login, 403 for a login with no
/// data-store user ([`Identity::require`]). `None` for any other database.
fn data_store_admission(
    state: &CouchState,
    name: &DbName,
    identity: &Identity,
) -> Option<Result<Admission, CouchError>> {
    let db = Some(&state.data_store_database).filter(|_| name.as_str() == &*state.db)?;
    Some(identity.require().map(|principal| {
        let access = match principal {
            super::access::Principal::Admin => DbAccess::ServerAdmin,
            super::access::Principal::User(_) => DbAccess::Member,
        };
        (Arc::clone(db), access, principal.confinement())
    }))
}

/// The document a path names (`{docid}`, with its attachments) must be one the login may use,
/// and a design document's routes (`{ddoc}`) are an admin's on the data-store database.
fn confine_path(confinement: &Confinement, params: &HashMap<String, String>) -> Result<(), CouchError> {
    if let Some(id) = params.get("docid") {
        if id.starts_with(crate::database::data_store_rules::DESIGN_PREFIX) {
            confinement.check_design()?;
        }
        confinement.check_id(id)?;
    }
    if params.contains_key("ddoc") {
        confinement.check_design()?;
    }
    Ok(())
}

/// What the login may do on the database ([`db_access`]: server admins everything, then its
/// `_security` by name and role), or CouchDB's 401/403 when it may not use it.
async fn admit(db: &Database, identity: &Identity) -> Result<DbAccess, CouchError> {
    let who = identity.user_ctx();
    if who.server_admin {
        return Ok(DbAccess::ServerAdmin);
    }
    let security = security_of(db).await?;
    db_access(&security, who).ok_or_else(|| not_admitted(who))
}

/// The database's `_security` object: where it is kept here, or on a backend whose databases stay
/// native (the CouchDB backend, which is passed `PUT /{db}/_security` as it came), that
/// database's own.
pub(crate) async fn security_of(db: &Database) -> Result<Value, CouchError> {
    if !db.backend().forwards_requests() {
        // `_users` is admin only whatever its stored `_security` says: `PUT` cannot change it,
        // and a start cut between creating `_users` and storing its `_security` (or another
        // instance reading it in between) must not leave the password hashes open to members.
        if crate::database::users::is_users_db(db.name()) {
            return Ok(crate::database::users::admin_only_security());
        }
        return Ok(db.settings().await?.security);
    }
    let asked = crate::backend::DesignRequest::get_json("_security".to_owned(), None);
    let Some(answer) = db.backend().design_request(asked).await? else {
        return Err(CouchError::internal("the backend forwards requests but did not answer GET _security"));
    };
    let status = answer.status;
    let body = answer
        .body_within(MAX_SECURITY_BYTES, "the backend's _security object")
        .await
        .map_err(|e| CouchError::internal(e.to_string()))?;
    if !(200..300).contains(&status) {
        return Err(CouchError::internal(format!("the backend answered GET _security with status {status}")));
    }
    serde_json::from_slice(&body)
        .map_err(|e| CouchError::internal(format!("the backend's _security object is not JSON: {e}")))
}

/// The most of a native database's `_security` object read (a few names and roles in practice).
const MAX_SECURITY_BYTES: usize = 1 << 20;

/// What a request passed as it came to a native database needs beyond membership, as CouchDB
/// checks it: `_security` and `_revs_limit` changes, design document writes (by path, by
/// `COPY`'s destination, by `POST /{db}` or in `_bulk_docs`), and index changes (which write
/// design documents) need a database admin (403); compaction a database admin (401); `_purge` a
/// server admin (401). A design function (`_design/{ddoc}/_view/…`, `_update/…`) is a member's.
///
/// A `_bulk_docs` with one design document among others is refused whole here, where CouchDB
/// would refuse that document alone: the request is passed on as it came, so it cannot be split.
/// `destination` is a `COPY`'s target id, read from its header by
/// [`copy_destination_id`](crate::couchdb_api::request::copy_destination_id).
fn check_forwarded(
    access: DbAccess,
    method: &axum::http::Method,
    below: &str,
    destination: Option<&str>,
    body: &[u8],
) -> Result<(), CouchError> {
    use axum::http::Method;
    if access == DbAccess::ServerAdmin {
        return Ok(());
    }
    let reads = matches!(*method, Method::GET | Method::HEAD);
    // Empty segments are skipped, as CouchDB's path split skips them: `/{db}//_security` is its
    // `_security`.
    let mut segments = below
        .split('/')
        .filter(|segment| !segment.is_empty())
        .map(|segment| percent_encoding::percent_decode_str(segment).decode_utf8_lossy());
    let first = segments.next().unwrap_or_default();
    match first.as_ref() {
        "_purge" | "_purged_infos_limit" => return access.require_server_admin(),
        "_compact" | "_view_cleanup" => return access.require_db_admin_to_compact(),
        "_security" | "_revs_limit" if !reads => return access.require_db_admin(),
        "_index" if !reads => return access.require_db_admin(),
        _ => {}
    }
    // `_design/{ddoc}` (or `_design%2F{ddoc}` as one segment) and its attachments are the design
    // document; `_design/{ddoc}/_view/…` and the other `_`-functions run it.
    let design_document = if first == "_design" {
        segments.nth(1).is_none_or(|part| !part.starts_with('_'))
    } else {
        first.starts_with("_design/")
    };
    if design_document && !reads {
        access.require_db_admin()?;
    }
    if method.as_str() == "COPY" && destination.is_some_and(|target| target.starts_with("_design/")) {
        access.require_db_admin()?;
    }
    if *method == Method::POST && (first.is_empty() || first == "_bulk_docs") {
        // Every `_id` the body names is looked at, duplicates included: a JSON parser that keeps
        // the last of two `_id` members must not let a design document past a check that the
        // backend's parser (which may keep the first) then writes. A body that is not JSON is
        // the backend's to refuse; it names no id here.
        let ids = BodyIds::of(body, !first.is_empty());
        if ids.ids.iter().any(|id| id.starts_with("_design/")) {
            access.require_db_admin()?;
        }
    }
    Ok(())
}

/// Every `_id` member of a posted document, or of each document of a `_bulk_docs` body's `docs`,
/// duplicates included.
#[derive(Default)]
struct BodyIds {
    ids: Vec<String>,
}

impl BodyIds {
    fn of(body: &[u8], bulk: bool) -> Self {
        let mut ids = BodyIds::default();
        let mut deserializer = serde_json::Deserializer::from_slice(body);
        let _ = serde::Deserializer::deserialize_any(&mut deserializer, IdCollector { ids: &mut ids.ids, bulk });
        ids
    }
}

/// Walks one JSON object: `_id` strings are collected; with `bulk`, so are those of the
/// objects in `docs`. Everything else is skipped unread.
struct IdCollector<'a> {
    ids: &'a mut Vec<String>,
    bulk: bool,
}

impl<'de> serde::de::Visitor<'de> for IdCollector<'_> {
    type Value = ();

    fn expecting(&self, formatter: &mut std::fmt::Formatter) -> std::fmt::Result {
        formatter.write_str("a JSON object")
    }

    // Values that are not objects name no id (and a `docs` entry that is one is CouchDB's to
    // refuse): skipped, so the walk goes on to the next document.
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
        Ok(())
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            match key.as_ref() {
                "_id" => {
                    if let Value::String(id) = map.next_value::<Value>()? {
                        self.ids.push(id);
                    }
                }
                "docs" if self.bulk => {
                    map.next_value_seed(DocsSeed { ids: &mut *self.ids })?;
                }
                _ => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

/// `docs` of a `_bulk_docs` body: each object's `_id`s collected.
struct DocsSeed<'a> {
    ids: &'a mut Vec<String>,
}

impl<'de> serde::de::DeserializeSeed<'de> for DocsSeed<'_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for DocsSeed<'_> {
    type Value = ();

    fn expecting(&self, formatter: &mut std::fmt::Formatter) -> std::fmt::Result {
        formatter.write_str("an array of documents")
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(DocSeed { ids: &mut *self.ids })?.is_some() {}
        Ok(())
    }
}

/// One document of `docs`.
struct DocSeed<'a> {
    ids: &'a mut Vec<String>,
}

impl<'de> serde::de::DeserializeSeed<'de> for DocSeed<'_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(IdCollector { ids: self.ids, bulk: false })
    }
}

pub(crate) use crate::database::document::{leaf_json, DocOptions};

/// A refusal of a client's document, as CouchDB answers it (400).
pub(crate) fn refused(refusal: crate::database::document::Refusal) -> CouchError {
    CouchError::new(axum::http::StatusCode::BAD_REQUEST, refusal.error, refusal.reason)
}

#[cfg(test)]
mod tests {
    /// Only answers a deletion under the request can explain send the database router to look
    /// the database up: never a document's `missing`/`deleted`, even though a route's own 404
    /// (an unknown path) says `missing` too.
    #[test]
    fn only_answers_a_deletion_can_explain_are_looked_up() {
        use axum::http::StatusCode;
        let looked_up = |answer: Response| may_be_a_deleted_database(&answer);
        assert!(!looked_up(CouchError::missing().into_response()), "a missing document");
        assert!(!looked_up(CouchError::deleted().into_response()), "a deleted document");
        let carried: CouchError = CouchError::missing().carried().into();
        assert!(!looked_up(carried.into_response()), "a missing document carried through the crate's error");
        assert!(looked_up(CouchError::not_found("missing").into_response()), "a route's own 404");
        assert!(looked_up(CouchError::no_database().into_response()), "the missing database");
        assert!(looked_up(CouchError::not_found("missing_named_view").into_response()), "a view gone with it");
        assert!(looked_up(CouchError::internal("a table went away").into_response()), "a 500");
        let unavailable = CouchError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "later");
        assert!(looked_up(unavailable.into_response()), "a 503");
        for status in [StatusCode::OK, StatusCode::CREATED, StatusCode::CONFLICT, StatusCode::BAD_REQUEST] {
            assert!(!looked_up(CouchError::new(status, "x", "y").into_response()), "{status}");
        }
    }

    /// A start cut between creating `_users` and storing its `_security` (the crash point of
    /// `Databases::ensure_users_db`) leaves it with none stored: it is admin only all the same.
    #[tokio::test]
    async fn users_db_is_admin_only_without_its_stored_security() {
        use crate::backend::catalog::EmbeddedCatalog;
        use crate::backend::embedded::EmbeddedOptions;
        let dir = tempfile::tempdir().unwrap();
        let catalog =
            std::sync::Arc::new(EmbeddedCatalog::new(&dir.path().join("store.redb"), EmbeddedOptions::default()));
        let databases = crate::database::Databases::new(Some(catalog), 2);
        let users = databases.create(&crate::backend::catalog::DbName::parse("_users").unwrap()).await.unwrap();
        let other = databases.create(&crate::backend::catalog::DbName::parse("open").unwrap()).await.unwrap();
        assert_eq!(users.settings().await.unwrap().security, serde_json::json!({}), "nothing stored");
        assert_eq!(super::security_of(&users).await.unwrap(), crate::database::users::admin_only_security());
        assert_eq!(super::security_of(&other).await.unwrap(), serde_json::json!({}), "another database's own");
    }

    #[test]
    fn every_id_of_a_posted_body_is_seen_duplicates_included() {
        let ids = |body: &str, bulk: bool| BodyIds::of(body.as_bytes(), bulk).ids;
        assert_eq!(ids(r#"{"_id":"_design/x","_id":"plain","n":1.5}"#, false), ["_design/x", "plain"]);
        assert_eq!(
            ids(
                r#"{"new_edits":true,"docs":[1,"s",null,[{"_id":"no"}],{"a":{"_id":"inner"},"_id":"a"},{"_id":"_design/d"}]}"#,
                true
            ),
            ["a", "_design/d"],
            "each document's own _id, after entries that are not documents"
        );
        assert!(ids("not json", false).is_empty());
    }

    use super::*;
    use axum::http::{Method, StatusCode};

    /// The data-store database's paths the CouchDB backend answers itself, by the path below it.
    #[test]
    fn design_paths_and_view_cleanup_run_on_the_backend() {
        for passed in ["_design/app", "_design/app/_view/v", "_design%2Fapp", "_design%2fapp/att", "_view_cleanup"] {
            assert!(runs_on_the_backend(passed), "{passed}");
        }
        for passed in ["%5Fdesign/app", "%5fdesign%2Fapp/_show/s", "%5Fview_cleanup"] {
            assert!(runs_on_the_backend(passed), "{passed}: an encoded underscore");
        }
        for served in ["_design", "_design/", "_design_docs", "_find", "_index", "_all_docs", "doc", "_local/x", ""] {
            assert!(!runs_on_the_backend(served), "{served}");
        }
        for served in ["u%3Ans%3Aa2V5", "%5F", "%5Fdesign_docs", "%2Fdesign/app", "x_design/app"] {
            assert!(!runs_on_the_backend(served), "{served}");
        }
    }

    /// `.` and `..` are refused however they are spelled, and only as a whole segment.
    #[test]
    fn dot_segments_are_refused_encoded_or_not() {
        for refused in [".", "..", "%2E", "%2e", ".%2E", "%2E.", "%2e%2E", "a/../b", "_design/d/%2E%2E/x", "a/."] {
            assert!(refuse_dot_segments(refused).is_err(), "{refused}");
        }
        for passed in ["...", "%2E%2E%2E", "%2E%2E.", ".a", "a.", "%252E", "u%3Ans%3Aa2V5LTAwMQ%3D%3D", "", "a//b"] {
            assert!(refuse_dot_segments(passed).is_ok(), "{passed}");
        }
    }

    fn status(access: DbAccess, method: Method, below: &str, destination: Option<&str>, body: &str) -> StatusCode {
        let target = destination.map(|header| crate::couchdb_api::request::copy_destination_id(header.as_bytes()));
        match check_forwarded(access, &method, below, target.as_deref(), body.as_bytes()) {
            Ok(()) => StatusCode::OK,
            Err(refused) => refused.status,
        }
    }

    /// A forwarded request (method, path below the database, `Destination`, body) and the status
    /// of its check for a member, a database admin and a server admin.
    type Case<'a> = (Method, &'a str, Option<&'a str>, &'a str, [StatusCode; 3]);

    /// What a member, a database admin and a server admin may pass on to a native database.
    #[test]
    fn forwarded_requests_are_checked_as_couchdb_checks_them() {
        use DbAccess::{DbAdmin, Member, ServerAdmin};
        let (ok, forbidden, unauthorized) = (StatusCode::OK, StatusCode::FORBIDDEN, StatusCode::UNAUTHORIZED);
        let copy = Method::from_bytes(b"COPY").unwrap();
        let cases: Vec<Case> = vec![
            // Documents, local documents, reads of anything, design functions: members.
            (Method::PUT, "doc", None, "{}", [ok, ok, ok]),
            (Method::POST, "", None, r#"{"_id":"doc"}"#, [ok, ok, ok]),
            (Method::POST, "_bulk_docs", None, r#"{"docs":[{"_id":"a"},{"b":1}]}"#, [ok, ok, ok]),
            (Method::PUT, "_local/cp", None, "{}", [ok, ok, ok]),
            (Method::GET, "_security", None, "", [ok, ok, ok]),
            (Method::GET, "_design/app", None, "", [ok, ok, ok]),
            (Method::GET, "_design/app/_view/v", None, "", [ok, ok, ok]),
            (Method::POST, "_design/app/_view/v", None, r#"{"keys":[1]}"#, [ok, ok, ok]),
            (Method::PUT, "_design/app/_update/u/doc", None, "{}", [ok, ok, ok]),
            (copy.clone(), "doc", Some("other"), "", [ok, ok, ok]),
            // Design documents, `_security`, `_revs_limit`, indexes: database admins (403).
            (Method::PUT, "_design/app", None, "{}", [forbidden, ok, ok]),
            (Method::DELETE, "_design/app", None, "", [forbidden, ok, ok]),
            (Method::PUT, "_design%2Fapp", None, "{}", [forbidden, ok, ok]),
            (Method::PUT, "_design/app/logo.png", None, "", [forbidden, ok, ok]),
            (Method::PUT, "_design//app", None, "{}", [forbidden, ok, ok]),
            (Method::PUT, "/_security", None, "{}", [forbidden, ok, ok]),
            (Method::POST, "//_compact", None, "", [unauthorized, ok, ok]),
            (Method::POST, "/", None, r#"{"_id":"_design/app"}"#, [forbidden, ok, ok]),
            (copy.clone(), "doc", Some("_design/app"), "", [forbidden, ok, ok]),
            (copy.clone(), "doc", Some("_design%2Fapp?rev=1-a"), "", [forbidden, ok, ok]),
            (copy.clone(), "doc", Some("_design/caf\u{e9}"), "", [forbidden, ok, ok]),
            (Method::POST, "", None, r#"{"_id":"_design/app"}"#, [forbidden, ok, ok]),
            (Method::POST, "_bulk_docs", None, r#"{"docs":[{"_id":"a"},{"_id":"_design/app"}]}"#, [forbidden, ok, ok]),
            (Method::PUT, "_security", None, "{}", [forbidden, ok, ok]),
            (Method::PUT, "_revs_limit", None, "5", [forbidden, ok, ok]),
            (Method::POST, "_index", None, "{}", [forbidden, ok, ok]),
            (Method::DELETE, "_index/_design/i/json/x", None, "", [forbidden, ok, ok]),
            // Compaction: database admins (401); purge: server admins (401).
            (Method::POST, "_compact", None, "", [unauthorized, ok, ok]),
            (Method::POST, "_compact/app", None, "", [unauthorized, ok, ok]),
            (Method::POST, "_view_cleanup", None, "", [unauthorized, ok, ok]),
            (Method::POST, "_purge", None, "{}", [unauthorized, unauthorized, ok]),
            (Method::PUT, "_purged_infos_limit", None, "5", [unauthorized, unauthorized, ok]),
            (Method::GET, "_purged_infos_limit", None, "", [unauthorized, unauthorized, ok]),
        ];
        for (method, below, destination, body, expected) in cases {
            let got =
                [Member, DbAdmin, ServerAdmin].map(|access| status(access, method.clone(), below, destination, body));
            assert_eq!(got, expected, "{method} {below} {destination:?} {body}");
        }
    }
}
