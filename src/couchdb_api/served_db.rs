//! The `{db}` path segment, checked once for every route under it: an extractor that answers
//! CouchDB's 404 `not_found` / `Database does not exist.` unless the segment names the one
//! database this server serves, and hands the handler the route's other path parameters.

use std::collections::HashMap;

use axum::extract::{FromRequestParts, Path};
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde::Deserialize;

use super::CouchState;

/// Proof that the request's `{db}` path parameter names the served database, with the route's
/// other path parameters read by name into `T` (`/{db}/_index/{*rest}` gives [`IndexPath`]); routes with
/// `{db}` alone take the default, [`DbOnly`].
pub(crate) struct ServedDb<T = DbOnly>(pub T);

/// No path parameter beside `{db}`.
#[derive(Deserialize)]
pub(crate) struct DbOnly {}

/// `/{db}/_index/{*rest}`.
#[derive(Deserialize)]
pub(crate) struct IndexPath {
    pub rest: String,
}

impl<T: DeserializeOwned + Send> FromRequestParts<CouchState> for ServedDb<T> {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &CouchState) -> Result<Self, Self::Rejection> {
        // A path that does not decode is refused as `Path` refuses it, so the answer is the one
        // handlers gave when they extracted `{db}` themselves.
        let Path(params) = Path::<HashMap<String, String>>::from_request_parts(parts, state)
            .await
            .map_err(IntoResponse::into_response)?;
        // Only routes with `{db}` use this extractor; a missing one is a routing mistake, answered
        // like any other database name that is not served.
        let db = params.get("db").map(String::as_str).unwrap_or_default();
        state.check_db(db).map_err(IntoResponse::into_response)?;
        let Path(rest) = Path::<T>::from_request_parts(parts, state).await.map_err(IntoResponse::into_response)?;
        Ok(ServedDb(rest))
    }
}
