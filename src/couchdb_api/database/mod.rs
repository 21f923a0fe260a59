//! The CouchDB API of every database besides the data-store one: documents of any shape under
//! CouchDB's rules, with their whole revision trees ([`crate::database`]).
//!
//! Requests reach this router through [`dispatch`]: a request whose first path segment names a
//! database other than the data-store one (and is not one of the server's own `_` endpoints)
//! comes here; everything else goes to the data-store router unchanged. Each handler opens its
//! database with the [`OpenDb`] extractor, which answers CouchDB's 400 for an illegal name, 404
//! for a database that does not exist and 403 for a login its `_security` does not admit.
//!
//! - [`admin`]: creating, reading and deleting databases, `_all_dbs`, `_dbs_info`, settings.
//! - [`docs`]: one document: read with every option, write, delete, local documents.
//! - [`bulk`]: `_bulk_docs`, `_bulk_get`, `_revs_diff`, `_missing_revs`, `_purge`.
//! - [`all_docs`]: `_all_docs`, `_design_docs` and `_local_docs`.
//! - `_changes` is the data-store database's feed machinery ([`super::changes`]) over this
//!   database's rows.

mod admin;
mod all_docs;
mod bulk;
mod docs;

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
use serde_json::{Map, Value};
use tower::ServiceExt;

pub(crate) use admin::{all_dbs, dbs_info};

use super::access::Principal;
use super::error::CouchError;
use super::CouchState;
use crate::backend::catalog::DbName;
use crate::database::rev_tree::{Leaf, RevTree};
use crate::database::Database;

/// The routes of a database other than the data-store one.
pub(crate) fn router(state: CouchState) -> Router {
    Router::new()
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
        .route("/{db}/_find", post(docs::mango))
        .route("/{db}/_explain", post(docs::mango))
        .route("/{db}/_index", any(docs::mango))
        .route("/{db}/_index/{*rest}", any(docs::mango))
        .route("/{db}/_changes", get(super::changes::get_database_changes).post(super::changes::post_database_changes))
        .route("/{db}/_revs_limit", get(admin::get_revs_limit).put(admin::put_revs_limit))
        .route("/{db}/_security", get(admin::get_security).put(admin::put_security))
        .route("/{db}/_compact", post(admin::compact))
        .route("/{db}/_compact/{ddoc}", post(admin::compact))
        .route("/{db}/_view_cleanup", post(admin::compact))
        .route("/{db}/_ensure_full_commit", post(admin::ensure_full_commit))
        .route("/{db}/_local/{*name}", get(docs::get_local).put(docs::put_local).delete(docs::delete_local))
        .route("/{db}/_design/{ddoc}", any(docs::design_document))
        .route("/{db}/_design/{ddoc}/{*rest}", any(docs::design_function))
        .route("/{db}/{docid}", any(docs::document))
        .route("/{db}/{docid}/{*attachment}", any(docs::attachment))
        .fallback(super::server::no_route)
        .with_state(state)
}

/// Sends a request for a database other than the data-store one to that database's router;
/// everything else continues to the data-store router.
pub(crate) async fn dispatch(
    axum::extract::State(state): axum::extract::State<CouchState>,
    mut request: Request,
    next: Next,
) -> Response {
    let first = request.uri().path().trim_start_matches('/').split('/').next().unwrap_or_default();
    let first = percent_encoding::percent_decode_str(first).decode_utf8_lossy().into_owned();
    if first.is_empty() || first.starts_with('_') || *first == *state.db {
        return next.run(request).await;
    }
    // Every database route acts for someone, as the data-store routes do.
    if let Err(refusal) = super::require_principal(&mut request) {
        return refusal.into_response();
    }
    let request = match forward_if_native(&state, &first, request).await {
        Ok(answer) => return answer,
        Err(request) => request,
    };
    route(&state, request).await
}

/// The headers a forwarded request carries to the CouchDB backend (never the client's
/// credentials: the backend's own are used).
const FORWARDED_HEADERS: [&str; 5] = ["content-type", "accept", "if-match", "if-none-match", "destination"];

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
    let db = match state.databases.open(&name).await {
        Ok(Some(db)) if db.backend().forwards_requests() => db,
        _ => return Err(request),
    };
    let Some(principal) = request.extensions().get::<Principal>().cloned() else { return Err(request) };
    Ok(forward(state, &db, &principal, &below, request).await.unwrap_or_else(IntoResponse::into_response))
}

async fn forward(
    state: &CouchState,
    db: &Database,
    principal: &Principal,
    below: &str,
    request: Request,
) -> Result<Response, CouchError> {
    admit(db, principal).await?;
    for segment in below.split('/') {
        let decoded = percent_encoding::percent_decode_str(segment).decode_utf8_lossy();
        if decoded == "." || decoded == ".." {
            return Err(CouchError::bad_request(format!("database paths may not contain the segment {segment:?}")));
        }
    }
    let (parts, body) = request.into_parts();
    let (body, _share) = state.bodies.read_bytes(&parts.headers, body).await?;
    let forwarded = crate::backend::DesignRequest {
        method: parts.method,
        path: below.to_owned(),
        query: parts.uri.query().map(str::to_owned),
        headers: FORWARDED_HEADERS
            .iter()
            .filter_map(|name| Some(((*name).to_owned(), parts.headers.get(*name)?.to_str().ok()?.to_owned())))
            .collect(),
        body,
    };
    let Some(answer) = db.backend().design_request(forwarded).await? else {
        return Err(CouchError::internal("the backend forwards requests but did not take this one"));
    };
    let status = axum::http::StatusCode::from_u16(answer.status)
        .map_err(|_| CouchError::internal(format!("the backend answered status {}", answer.status)))?;
    let mut response = (status, axum::body::Body::from_stream(answer.body)).into_response();
    for (name, value) in answer.headers {
        if let (Ok(name), Ok(value)) =
            (axum::http::HeaderName::try_from(name), axum::http::HeaderValue::try_from(value))
        {
            response.headers_mut().insert(name, value);
        }
    }
    Ok(response)
}

/// The database router's answer to a request (a fresh request with the same line, headers and
/// body: see [`dispatch`]).
async fn route(state: &CouchState, request: Request) -> Response {
    // A fresh request with the same line, headers and body: the data-store router's path
    // parameters must not reach the database router's (which sets its own). What the layers
    // before this one learnt travels along: who the request acts for, and its peer.
    let (parts, body) = request.into_parts();
    let mut forwarded = Request::new(body);
    *forwarded.method_mut() = parts.method;
    *forwarded.uri_mut() = parts.uri;
    *forwarded.version_mut() = parts.version;
    *forwarded.headers_mut() = parts.headers;
    let extensions = forwarded.extensions_mut();
    if let Some(principal) = parts.extensions.get::<Principal>() {
        extensions.insert(principal.clone());
    }
    if let Some(identity) = parts.extensions.get::<super::auth::Identity>() {
        extensions.insert(identity.clone());
    }
    if let Some(peer) = parts.extensions.get::<axum::extract::ConnectInfo<std::net::SocketAddr>>() {
        extensions.insert(*peer);
    }
    let router = state.database_router.clone();
    match router.oneshot(forwarded).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}

/// An open database the request may use, with the route's other path parameters in `T`.
pub(crate) struct OpenDb<T = DbOnly> {
    pub db: Arc<Database>,
    pub principal: Principal,
    pub params: T,
}

#[derive(Deserialize)]
pub(crate) struct DbOnly {}

/// The `{db}` path segment checked against CouchDB's name rule (400 `illegal_database_name`).
pub(crate) fn db_name(text: &str) -> Result<DbName, CouchError> {
    DbName::parse(text).map_err(|err| {
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
        let principal = parts
            .extensions
            .get::<Principal>()
            .cloned()
            .ok_or_else(|| CouchError::internal("the request was not identified").into_response())?;
        let db = match state.databases.open(&name).await {
            Ok(Some(db)) => db,
            Ok(None) => return Err(CouchError::no_database().into_response()),
            Err(err) => return Err(CouchError::from(err).into_response()),
        };
        admit(&db, &principal).await.map_err(IntoResponse::into_response)?;
        let Path(params) = Path::<T>::from_request_parts(parts, state).await.map_err(IntoResponse::into_response)?;
        Ok(OpenDb { db, principal, params })
    }
}

/// Whether the principal may use the database: server admins always; another login when the
/// database's `_security` names it among its members or admins. A database with no members is
/// admin-only here (CouchDB 3's default for new databases, `default_security = admin_only`).
async fn admit(db: &Database, principal: &Principal) -> Result<(), CouchError> {
    let Principal::User(name) = principal else { return Ok(()) };
    let security = db.settings().await?.security;
    let named = |group: &str| {
        security
            .get(group)
            .and_then(|g| g.get("names"))
            .and_then(Value::as_array)
            .is_some_and(|names| names.iter().any(|n| n.as_str() == Some(name.as_str())))
    };
    if named("members") || named("admins") {
        Ok(())
    } else {
        Err(CouchError::forbidden("You are not allowed to access this db."))
    }
}

/// What a document read adds to the document (CouchDB's query options).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct DocOptions {
    pub revs: bool,
    pub revs_info: bool,
    pub conflicts: bool,
    pub deleted_conflicts: bool,
}

/// A leaf as CouchDB answers it: `_id`, `_rev`, the body, `_deleted` for a deleted leaf, then
/// what `options` ask for (`_revs_info`, `_conflicts`, `_deleted_conflicts` only for the
/// winner, as CouchDB gives them).
pub(crate) fn leaf_json(id: &str, tree: &RevTree, leaf: &Leaf, options: DocOptions) -> Value {
    let mut doc = Map::with_capacity(leaf.body.len() + 4);
    doc.insert("_id".into(), Value::from(id));
    doc.insert("_rev".into(), Value::from(leaf.path.leaf_rev()));
    for (name, value) in &leaf.body {
        doc.insert(name.clone(), value.clone());
    }
    if leaf.deleted {
        doc.insert("_deleted".into(), Value::Bool(true));
    }
    if options.revs {
        doc.insert("_revisions".into(), leaf.path.to_revisions());
    }
    let is_winner = tree.winner().is_some_and(|winner| winner.path.leaf_rev() == leaf.path.leaf_rev());
    if is_winner {
        if options.revs_info {
            let info: Vec<Value> = tree
                .revs_info()
                .into_iter()
                .map(|(rev, status)| serde_json::json!({ "rev": rev, "status": status.as_str() }))
                .collect();
            doc.insert("_revs_info".into(), Value::Array(info));
        }
        if options.conflicts {
            let conflicts = tree.conflicts();
            if !conflicts.is_empty() {
                doc.insert("_conflicts".into(), Value::from(conflicts));
            }
        }
        if options.deleted_conflicts {
            let deleted = tree.deleted_conflicts();
            if !deleted.is_empty() {
                doc.insert("_deleted_conflicts".into(), Value::from(deleted));
            }
        }
    }
    Value::Object(doc)
}

/// A refusal of a client's document, as CouchDB answers it (400).
pub(crate) fn refused(refusal: crate::database::document::Refusal) -> CouchError {
    CouchError::new(axum::http::StatusCode::BAD_REQUEST, refusal.error, refusal.reason)
}
