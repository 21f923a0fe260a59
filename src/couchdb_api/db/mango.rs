//! Mango's routes on every database whose requests are not passed to the backend as they came
//! (the CouchDB backend's databases other than the data-store one are forwarded before they reach
//! here): `POST /{db}/_find`, `POST /{db}/_explain`, `GET/POST /{db}/_index`,
//! `DELETE /{db}/_index/{ddoc}/json/{name}` and `POST /{db}/_index/_bulk_delete`, answered by
//! [`crate::mango::database`], or on the data-store database (every backend) by its own catalog
//! and query planner ([`crate::mango::find_on_data_store`]: the seed's `userId`/`namespace`
//! index, created indexes as view groups over its feed; on the CouchDB backend, which runs design
//! documents itself, created indexes stay definitions and the backend is read instead:
//! [`data_store_views`]).
//!
//! Anyone who may read the database may query it; creating or deleting an index writes a design
//! document, so it needs a database admin, as in CouchDB. On the data-store database a per-user
//! login's `_find` reads through its [`Confinement`](crate::database::data_store_rules::Confinement)
//! (its own documents only), and its index writes are refused 401, as they always were there.

use std::collections::HashMap;

use axum::body::Body;
use axum::http::{HeaderMap, Method, StatusCode, Uri};

use super::OpenDb;
use crate::couchdb_api::error::CouchError;
use crate::couchdb_api::{json, Answer, CouchState};
use crate::mango::database::{self as mango_db, DatabaseIndexes};

/// Every Mango route of the database router, told apart by the path below `/{db}`.
pub async fn route(
    state: &CouchState,
    opened: OpenDb<HashMap<String, String>>,
    method: Method,
    uri: &Uri,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    let below_db = uri.path().trim_start_matches('/').split_once('/').map_or("", |(_, below)| below);
    let below: Vec<&str> = below_db.split('/').collect();
    if super::is_data_store(state, &opened.db) {
        return data_store_route(state, &opened, &method, &below, uri, headers, body).await;
    }
    let db = &opened.db;
    match (below.as_slice(), &method) {
        (["_find"], &Method::POST) => {
            let request = state.bodies.read_object(&headers, body).await?;
            Ok(json(StatusCode::OK, mango_db::find_remembering(db, &state.views, &request.value).await?))
        }
        (["_explain"], &Method::POST) => {
            let request = state.bodies.read_object(&headers, body).await?;
            let indexes = DatabaseIndexes::load(db).await?;
            Ok(json(StatusCode::OK, mango_db::explain(indexes, &request.value, db.name())?))
        }
        (["_index"], &Method::GET) => {
            let listed = DatabaseIndexes::load(db).await?.catalog.to_json();
            Ok(json(StatusCode::OK, page_of_listing(listed, uri.query().unwrap_or(""))?))
        }
        (["_index"], &Method::POST) => {
            opened.access.require_db_admin()?;
            let request = state.bodies.read_object(&headers, body).await?;
            Ok(json(StatusCode::OK, mango_db::create_index(db, &request.value).await?))
        }
        (["_index"], _) => Err(method_not_allowed("GET,POST")),
        (["_index", "_bulk_delete"], &Method::POST) => {
            opened.access.require_db_admin()?;
            let request = state.bodies.read_object(&headers, body).await?;
            Ok(json(StatusCode::OK, mango_db::bulk_delete(db, &request.value).await?))
        }
        (["_index", "_bulk_delete"], _) => Err(method_not_allowed("POST")),
        // `_index/{ddoc}/{type}/{name}` or `_index/_design/{ddoc}/{type}/{name}`.
        (["_index", "_design", ddoc, kind, name] | ["_index", ddoc, kind, name], method) => {
            if method != Method::DELETE {
                return Err(method_not_allowed("DELETE"));
            }
            opened.access.require_db_admin()?;
            let (ddoc, kind, name) = (decode(ddoc), decode(kind), decode(name));
            Ok(json(StatusCode::OK, mango_db::delete_index(db, &ddoc, &kind, &name).await?))
        }
        (["_find" | "_explain"], _) => Err(method_not_allowed("POST")),
        _ => Err(CouchError::not_found("missing")),
    }
}

/// Mango's routes on the data-store database: its index catalog (the seed's index and the created
/// ones), the data-store planner, the login's confinement.
async fn data_store_route(
    state: &CouchState,
    opened: &OpenDb<HashMap<String, String>>,
    method: &Method,
    below: &[&str],
    uri: &Uri,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    let db = &opened.db;
    let backend = db.backend().as_ref();
    match (below, method) {
        (["_find"], &Method::POST) => {
            let request = state.bodies.read_object(&headers, body).await?;
            let catalog = crate::mango::IndexCatalog::load(backend).await?;
            let views = data_store_views(state, db);
            let found =
                crate::mango::find_on_data_store(backend, views, &request.value, &opened.confinement, &catalog).await?;
            Ok(json(StatusCode::OK, found))
        }
        (["_explain"], &Method::POST) => {
            let request = state.bodies.read_object(&headers, body).await?;
            Ok(json(StatusCode::OK, crate::mango::explain(backend, &request.value, db.name()).await?))
        }
        (["_index"], &Method::GET) => {
            let listed = crate::mango::list_indexes(backend).await?;
            Ok(json(StatusCode::OK, page_of_listing(listed, uri.query().unwrap_or(""))?))
        }
        (["_index"], &Method::POST) => {
            require_data_store_admin(opened)?;
            let request = state.bodies.read_object(&headers, body).await?;
            Ok(json(StatusCode::OK, crate::mango::create_index(backend, &request.value).await?))
        }
        (["_index"], _) => Err(method_not_allowed("GET,POST")),
        (["_index", "_design", ddoc, kind, name] | ["_index", ddoc, kind, name], &Method::DELETE) => {
            require_data_store_admin(opened)?;
            if decode(kind) != "json" {
                return Err(CouchError::bad_request("the path must be _index/{ddoc}/json/{name}"));
            }
            Ok(json(StatusCode::OK, crate::mango::delete_index(backend, &decode(ddoc), &decode(name)).await?))
        }
        (["_index", ..], _) => Err(method_not_allowed("DELETE")),
        (["_find" | "_explain"], _) => Err(method_not_allowed("POST")),
        _ => Err(CouchError::not_found("missing")),
    }
}

/// The views the data-store database's created indexes are built as, or `None` on a backend that
/// runs design documents itself (the CouchDB backend): there the catalog is still this server's,
/// so a created index stays a definition and `_find` reads the backend (its `userId`/`namespace`
/// index where the selector fixes `userId`, else every document a page at a time).
fn data_store_views<'a>(
    state: &'a CouchState,
    db: &'a std::sync::Arc<crate::database::Database>,
) -> Option<crate::mango::DataStoreViews<'a>> {
    let runs_own_designs = db.backend().forwards_requests();
    (!runs_own_designs).then(|| crate::mango::DataStoreViews { views: state.views.as_ref(), source: db.as_ref() })
}

/// A per-user login's index writes on the data-store database: the 401 that database has always
/// answered (its indexes serve every user).
fn require_data_store_admin(opened: &OpenDb<HashMap<String, String>>) -> Result<(), CouchError> {
    match opened.confinement.only_user() {
        None => Ok(()),
        Some(_) => Err(CouchError::new(StatusCode::UNAUTHORIZED, "unauthorized", "You are not a db or server admin.")),
    }
}

/// `GET _index?limit=&skip=` (`mango_httpd:handle_index_req`): `total_rows` counts every index,
/// `indexes` holds the page; a limit under 1, a negative skip or a non-integer is CouchDB's 500
/// `invalid_list_index_params`.
fn page_of_listing(mut listed: serde_json::Value, query: &str) -> Result<serde_json::Value, CouchError> {
    let invalid = || {
        CouchError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "invalid_list_index_params",
            "Index parameter ranges: limit > 1, skip > 0",
        )
    };
    let total = listed["indexes"].as_array().map_or(0, Vec::len) as i64;
    let (mut limit, mut skip) = (total, 0i64);
    for (key, value) in url::form_urlencoded::parse(query.as_bytes()) {
        match key.as_ref() {
            "limit" => limit = value.parse().map_err(|_| invalid())?,
            "skip" => skip = value.parse().map_err(|_| invalid())?,
            _ => {}
        }
    }
    if limit < 1 || skip < 0 {
        return Err(invalid());
    }
    let skip = usize::try_from(skip.min(total)).unwrap_or(0);
    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
    if let Some(indexes) = listed["indexes"].as_array_mut() {
        *indexes = indexes.iter().skip(skip).take(limit).cloned().collect();
    }
    Ok(listed)
}

/// A path segment, percent-decoded.
fn decode(segment: &str) -> String {
    percent_encoding::percent_decode_str(segment).decode_utf8_lossy().into_owned()
}

fn method_not_allowed(allowed: &str) -> CouchError {
    CouchError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", format!("Only {allowed} allowed"))
}
