//! Mango over HTTP on the data-store database over the CouchDB backend (the data-store router's;
//! elsewhere that database's Mango routes are the engine's, `super::db`): `POST /{db}/_find`,
//! `POST /{db}/_explain`, `GET/POST /{db}/_index` and `DELETE /{db}/_index/{ddoc}/json/{name}`.
//! The language, the plans and the paging live in [`crate::mango`]; this module reads the
//! requests, reads through the login's confinement, and answers (Mango's errors become CouchDB's
//! answers in [`super::error`]). Also the `_selector` filter of `_changes`, on every database.

use axum::body::Body;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, StatusCode};
use serde_json::Value;

use super::access::Principal;
use super::error::CouchError;
use super::served_db::{IndexPath, ServedDb};
use super::{json, Answer, CouchState};
use crate::mango;

/// `POST /{db}/_find`.
pub async fn find(
    State(state): State<CouchState>,
    Extension(principal): Extension<Principal>,
    _served: ServedDb,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    let request = state.bodies.read_object(&headers, body).await?;
    let backend = state.store.backend();
    let catalog = mango::IndexCatalog::load(backend.as_ref()).await?;
    // A CouchDB backend would build its own indexes, but the catalog is this server's: there the
    // created indexes stay definitions and the backend is paged.
    let answer =
        mango::find_on_data_store(backend.as_ref(), None, &request.value, &principal.confinement(), &catalog).await?;
    Ok(json(StatusCode::OK, answer))
}

/// `POST /{db}/_explain`.
pub async fn explain(State(state): State<CouchState>, _served: ServedDb, headers: HeaderMap, body: Body) -> Answer {
    let request = state.bodies.read_object(&headers, body).await?;
    let answer = mango::explain(state.store.backend().as_ref(), &request.value, &state.db).await?;
    Ok(json(StatusCode::OK, answer))
}

/// `GET /{db}/_index`.
pub async fn list_indexes(State(state): State<CouchState>, _served: ServedDb) -> Answer {
    Ok(json(StatusCode::OK, mango::list_indexes(state.store.backend().as_ref()).await?))
}

/// `POST /{db}/_index`: indexes are recorded in the catalog; `_find` chooses among them as CouchDB
/// does and builds a chosen one (as a view group) on its first use; only admins define them, as
/// in CouchDB.
pub async fn create_index(
    State(state): State<CouchState>,
    Extension(principal): Extension<Principal>,
    _served: ServedDb,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    require_admin(&principal)?;
    let request = state.bodies.read_object(&headers, body).await?;
    Ok(json(StatusCode::OK, mango::create_index(state.store.backend().as_ref(), &request.value).await?))
}

/// `DELETE /{db}/_index/{ddoc}/json/{name}` (the ddoc with or without its `_design/` prefix).
pub async fn delete_index(
    State(state): State<CouchState>,
    Extension(principal): Extension<Principal>,
    ServedDb(IndexPath { rest }): ServedDb<IndexPath>,
) -> Answer {
    require_admin(&principal)?;
    let rest = rest.strip_prefix("_design/").unwrap_or(&rest);
    let Some((ddoc, name)) = rest.split_once("/json/") else {
        return Err(CouchError::bad_request("the path must be _index/{ddoc}/json/{name}"));
    };
    Ok(json(StatusCode::OK, mango::delete_index(state.store.backend().as_ref(), ddoc, name).await?))
}

fn require_admin(principal: &Principal) -> Result<(), CouchError> {
    match principal {
        Principal::Admin => Ok(()),
        Principal::User(_) => {
            Err(CouchError::new(StatusCode::UNAUTHORIZED, "unauthorized", "You are not a db or server admin."))
        }
    }
}

/// The `_selector` filter of `_changes`: a Mango selector over each changed document.
pub fn selector_filter(selector: &Value) -> Result<super::changes::DocumentPredicate, CouchError> {
    let Value::Object(selector) = selector else {
        return Err(CouchError::bad_request("Selector error: expected a JSON object"));
    };
    let parsed = mango::selector::parse(selector)?;
    Ok(Box::new(move |doc: &Value| doc.as_object().is_some_and(|doc| mango::eval::matches(&parsed, doc))))
}
