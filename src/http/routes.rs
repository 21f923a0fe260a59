//! The REST API's handlers: each maps one route onto the facade.
//!
//! Listings stream: the first page is fetched before the status line is sent (so a backend error
//! is still a proper error response), then the rest follows page by page. An error after that
//! aborts the connection, so a client never mistakes a cut-off listing for a whole one.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequestParts, Path, RawPathParams, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::{StreamExt, TryStreamExt};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

use super::auth::Auth;
use super::body::BodyBudget;
use super::error::ApiError;
use super::metrics::Metrics;
use crate::backend::{Revision, StoredDocument};
use crate::error::ErrorKind;
use crate::store::{DataStore, Expect, PageStream, SetOptions};

/// The header naming the calling agent.
pub const AGENT_HEADER: &str = "x-agent-id";
/// The header carrying the request id (the client's, or one the server makes).
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState {
    pub store: Arc<DataStore>,
    pub auth: Arc<Auth>,
    pub metrics: Arc<Metrics>,
    pub bodies: Arc<BodyBudget>,
    pub feed: super::changes::FeedSettings,
    /// Set on SIGTERM/SIGINT: `/readyz` answers 503 while requests are still served.
    pub draining: crate::server::Draining,
}

type ApiResult<T> = Result<T, ApiError>;

/// `Path`, with its rejections answered in our error format.
pub struct ApiPath<T>(pub T);

impl<T, S> FromRequestParts<S> for ApiPath<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> ApiResult<Self> {
        Path::<T>::from_request_parts(parts, state)
            .await
            .map(|Path(value)| ApiPath(value))
            .map_err(|e| ApiError::bad_request(format!("invalid path: {}", e.body_text())))
    }
}

/// Middleware on `/v1`: the bearer token must allow the `{user}` of the path.
pub async fn require_auth(
    State(state): State<AppState>,
    params: Result<RawPathParams, axum::extract::rejection::RawPathParamsRejection>,
    request: Request,
    next: Next,
) -> Response {
    let params = match params {
        Ok(params) => params,
        Err(e) => return ApiError::bad_request(format!("invalid path: {}", e.body_text())).into_response(),
    };
    let user = params.iter().find(|(name, _)| *name == "user").map(|(_, value)| value).unwrap_or_default();
    match state.auth.authorize(request.headers(), user) {
        Ok(()) => next.run(request).await,
        Err(e) => e.into_response(),
    }
}

fn agent(headers: &HeaderMap) -> ApiResult<Option<String>> {
    headers
        .get(AGENT_HEADER)
        .map(|v| {
            std::str::from_utf8(v.as_bytes())
                .map(str::to_owned)
                .map_err(|_| ApiError::bad_request("invalid agent: the X-Agent-Id header must be UTF-8"))
        })
        .transpose()
}

/// The caller's precondition from `If-Match` / `If-None-Match`.
fn expectation(headers: &HeaderMap) -> ApiResult<Expect> {
    let text = |name: header::HeaderName| -> ApiResult<Option<String>> {
        headers
            .get(&name)
            .map(|v| {
                v.to_str()
                    .map(|s| s.trim().to_owned())
                    .map_err(|_| ApiError::bad_request(format!("invalid {name} header")))
            })
            .transpose()
    };
    match (text(header::IF_MATCH)?, text(header::IF_NONE_MATCH)?) {
        (None, None) => Ok(Expect::Any),
        (Some(_), Some(_)) => Err(ApiError::bad_request("send If-Match or If-None-Match, not both")),
        (None, Some(star)) if star == "*" => Ok(Expect::Absent),
        (None, Some(_)) => Err(ApiError::bad_request("If-None-Match on a write must be `*`")),
        (Some(star), None) if star == "*" => Ok(Expect::Exists),
        (Some(tag), None) => {
            let tag = tag.strip_prefix("W/").unwrap_or(&tag);
            match tag.strip_prefix('"').and_then(|t| t.strip_suffix('"')) {
                Some(rev) if !rev.is_empty() && !rev.contains('"') => Ok(Expect::Revision(Revision(rev.to_owned()))),
                _ => Err(ApiError::bad_request("If-Match must be `*` or one quoted ETag")),
            }
        }
    }
}

/// A facade error under a caller's precondition: a conflict is then a 412.
fn under(expect: &Expect) -> impl Fn(crate::Error) -> ApiError + '_ {
    move |err| {
        if *expect != Expect::Any && err.kind() == ErrorKind::Conflict {
            ApiError::precondition_failed(err.to_string())
        } else {
            err.into()
        }
    }
}

fn etag(rev: &Revision) -> Option<HeaderValue> {
    HeaderValue::from_str(&format!("\"{}\"", rev.as_str())).ok()
}

/// A stored document in the spec's shape (`_id`, `_rev`, then the body's fields), serialised
/// from the stored body without copying it into a new tree.
struct DocumentJson<'a>(&'a StoredDocument);

impl serde::Serialize for DocumentJson<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let doc = self.0;
        let mut map = serializer.serialize_map(Some(doc.body.len() + 2))?;
        map.serialize_entry(crate::model::fields::ID, &doc.id)?;
        map.serialize_entry(crate::model::fields::REV, doc.rev.as_str())?;
        for (field, value) in &doc.body {
            if field != crate::model::fields::ID && field != crate::model::fields::REV {
                map.serialize_entry(field, value)?;
            }
        }
        map.end()
    }
}

fn document_response(doc: &StoredDocument) -> Response {
    let mut response = Json(DocumentJson(doc)).into_response();
    if let Some(tag) = etag(&doc.rev) {
        response.headers_mut().insert(header::ETAG, tag);
    }
    response
}

fn missing(user: &str, namespace: &str, key: &str) -> ApiError {
    ApiError::not_found(format!("no document for user {user:?}, namespace {namespace:?}, key {key:?}"))
}

// ---- documents ----

pub async fn put_document(
    State(state): State<AppState>,
    ApiPath((user, namespace, key)): ApiPath<(String, String, String)>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    let expect = expectation(&headers)?;
    let agent = agent(&headers)?;
    // Holds its share of the body budget until the response is built.
    let put = state.bodies.read_put_body(&headers, body).await?;
    let doc = state
        .store
        .set_with(
            &user,
            &namespace,
            &key,
            put.value,
            SetOptions { metadata: put.metadata, agent: agent.as_deref(), expect: expect.clone() },
        )
        .await
        .map_err(under(&expect))?;
    Ok(document_response(&doc))
}

pub async fn get_document(
    State(state): State<AppState>,
    ApiPath((user, namespace, key)): ApiPath<(String, String, String)>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let agent = agent(&headers)?;
    let doc = state.store.get(&user, &namespace, &key, agent.as_deref()).await?;
    doc.map(|doc| document_response(&doc)).ok_or_else(|| missing(&user, &namespace, &key))
}

/// Existence, without counting an access.
pub async fn head_document(
    State(state): State<AppState>,
    ApiPath((user, namespace, key)): ApiPath<(String, String, String)>,
) -> ApiResult<Response> {
    match state.store.peek(&user, &namespace, &key).await? {
        None => Ok(StatusCode::NOT_FOUND.into_response()),
        Some(doc) => {
            let mut response = StatusCode::OK.into_response();
            if let Some(tag) = etag(&doc.rev) {
                response.headers_mut().insert(header::ETAG, tag);
            }
            Ok(response)
        }
    }
}

pub async fn delete_document(
    State(state): State<AppState>,
    ApiPath((user, namespace, key)): ApiPath<(String, String, String)>,
    headers: HeaderMap,
) -> ApiResult<Json<Value>> {
    let expect = expectation(&headers)?;
    if expect == Expect::Absent {
        return Err(ApiError::bad_request("If-None-Match makes no sense on DELETE"));
    }
    if state.store.delete_with(&user, &namespace, &key, expect.clone()).await.map_err(under(&expect))?.is_none() {
        return Err(missing(&user, &namespace, &key));
    }
    Ok(Json(json!({ "ok": true, "deleted": 1 })))
}

// ---- listings ----

pub async fn list_namespaces(
    State(state): State<AppState>,
    ApiPath(user): ApiPath<String>,
) -> ApiResult<Json<Vec<String>>> {
    Ok(Json(state.store.list_namespaces(&user).await?))
}

pub async fn list_keys(
    State(state): State<AppState>,
    ApiPath((user, namespace)): ApiPath<(String, String)>,
) -> ApiResult<Response> {
    let pages = state.store.list_keys_pages(&user, &namespace)?;
    stream_json(pages, b'[', b']', |key, out| serde_json::to_writer(out, key)).await
}

pub async fn get_all(
    State(state): State<AppState>,
    ApiPath((user, namespace)): ApiPath<(String, String)>,
) -> ApiResult<Response> {
    let pages = state.store.get_all_pages(&user, &namespace)?;
    stream_json(pages, b'{', b'}', |(key, value), out| {
        serde_json::to_writer(&mut *out, key)?;
        out.push(b':');
        serde_json::to_writer(out, value)
    })
    .await
}

/// Streams pages as one JSON array or object: `open`, the items separated by commas, `close`.
async fn stream_json<T: Send + 'static>(
    mut pages: PageStream<T>,
    open: u8,
    close: u8,
    write_item: fn(&T, &mut Vec<u8>) -> serde_json::Result<()>,
) -> ApiResult<Response> {
    let first = pages.try_next().await?.unwrap_or_default();
    let mut wrote_any = false;
    let mut encode = move |page: Vec<T>| -> crate::Result<Bytes> {
        let mut out = Vec::new();
        for item in &page {
            if wrote_any {
                out.push(b',');
            }
            write_item(item, &mut out)
                .map_err(|e| crate::Error::new(ErrorKind::Internal, "cannot encode listing").with_source(e))?;
            wrote_any = true;
        }
        Ok(Bytes::from(out))
    };
    let head = encode(first).map_err(ApiError::from)?;
    let mut opening = vec![open];
    opening.extend_from_slice(&head);
    let body = futures::stream::once(async move { Ok::<_, crate::Error>(Bytes::from(opening)) })
        .chain(pages.map(move |page| page.and_then(&mut encode)))
        .chain(futures::stream::once(async move { Ok(Bytes::from(vec![close])) }));
    Ok(([(header::CONTENT_TYPE, "application/json")], Body::from_stream(body)).into_response())
}

pub async fn delete_namespace(
    State(state): State<AppState>,
    ApiPath((user, namespace)): ApiPath<(String, String)>,
) -> ApiResult<Json<Value>> {
    let deleted = state.store.delete_namespace(&user, &namespace).await?;
    Ok(Json(json!({ "ok": true, "deleted": deleted })))
}

pub async fn purge_user(State(state): State<AppState>, ApiPath(user): ApiPath<String>) -> ApiResult<Json<Value>> {
    let deleted = state.store.purge_user(&user).await?;
    Ok(Json(json!({ "ok": true, "deleted": deleted })))
}

// ---- operations ----

pub async fn healthz() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

pub async fn readyz(State(state): State<AppState>) -> Response {
    // Told to stop: out of a balancer's rotation before the listener closes (the drain delay).
    if state.draining.is_draining() {
        return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "the server is shutting down")
            .into_response();
    }
    match state.store.backend().health().await {
        Ok(()) => Json(json!({ "status": "ready" })).into_response(),
        Err(e) => {
            // Unauthenticated: the chain (backend URLs, hosts, SDK messages) goes to the log only.
            tracing::warn!(error = %e, kind = %e.kind(), "backend not ready");
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "the storage backend is not ready")
                .into_response()
        }
    }
}

pub async fn metrics(State(state): State<AppState>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render()).into_response()
}

pub async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], super::OPENAPI_JSON).into_response()
}

pub async fn no_route() -> ApiError {
    ApiError::not_found("no such route; see /openapi.json")
}

pub async fn method_not_allowed() -> ApiError {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "this route does not accept that method")
}

/// Middleware: a request still unanswered after the request timeout gets 504 `timeout`. The
/// handler is dropped at that point.
pub async fn request_timeout(State(limit): State<std::time::Duration>, request: Request, next: Next) -> Response {
    match tokio::time::timeout(limit, next.run(request)).await {
        Ok(response) => response,
        Err(_) => ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "timeout",
            format!("the server gave up on the request after {} s", limit.as_secs()),
        )
        .into_response(),
    }
}

/// Longest client-sent `X-Request-Id` the server keeps.
pub const MAX_REQUEST_ID_BYTES: usize = 200;

/// Middleware, outside the request-id layer: a client's `X-Request-Id` is kept only if it is
/// 1-200 visible ASCII characters; otherwise it is removed, so the server makes a fresh one. An
/// empty or unprintable id would be echoed, logged and quoted in 5xx reasons, where it could not
/// identify the request.
pub async fn drop_unusable_request_id(mut request: Request, next: Next) -> Response {
    let usable = |id: &HeaderValue| {
        let bytes = id.as_bytes();
        !bytes.is_empty() && bytes.len() <= MAX_REQUEST_ID_BYTES && bytes.iter().all(u8::is_ascii_graphic)
    };
    if request.headers().get(REQUEST_ID_HEADER).is_some_and(|id| !usable(id)) {
        request.headers_mut().remove(REQUEST_ID_HEADER);
    }
    next.run(request).await
}

/// The answer to a handler that panicked (a bug; logged by `crate::server::catch_panics`): a 500
/// in our format.
pub fn internal_error() -> Response {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "internal error").into_response()
}
