//! HTTP error responses: CouchDB-style `{"error": "...", "reason": "..."}` bodies with the status
//! each error kind deserves. Anything a client can cause is a 4xx, whose reason names the problem;
//! a 5xx means our side or the backend failed, and its reason is generic (no backend URLs, hosts
//! or SDK messages) plus the request id, under which the whole error chain is logged.

use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::error::{Error, ErrorKind};
use crate::server::budget::Stopping;

/// An error on its way to the client.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub error: &'static str,
    pub reason: String,
}

impl ApiError {
    pub fn new(status: StatusCode, error: &'static str, reason: impl Into<String>) -> Self {
        ApiError { status, error, reason: reason.into() }
    }

    pub fn bad_request(reason: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "bad_request", reason)
    }

    pub fn not_found(reason: impl Into<String>) -> Self {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", reason)
    }

    pub fn precondition_failed(reason: impl Into<String>) -> Self {
        ApiError::new(StatusCode::PRECONDITION_FAILED, "precondition_failed", reason)
    }
}

impl From<Error> for ApiError {
    fn from(err: Error) -> Self {
        let (status, error) = match err.kind() {
            ErrorKind::InvalidInput => (StatusCode::BAD_REQUEST, "bad_request"),
            ErrorKind::NotFound => (StatusCode::NOT_FOUND, "not_found"),
            ErrorKind::Conflict => (StatusCode::CONFLICT, "conflict"),
            ErrorKind::Forbidden => (StatusCode::FORBIDDEN, "forbidden"),
            ErrorKind::LoginRequired => (StatusCode::UNAUTHORIZED, "unauthorized"),
            ErrorKind::TooLarge => (StatusCode::PAYLOAD_TOO_LARGE, "too_large"),
            ErrorKind::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            // Gave up before sending the next attempt: nothing applied, the client may retry.
            ErrorKind::DeadlineExceeded => (StatusCode::SERVICE_UNAVAILABLE, "deadline_exceeded"),
            // A write was sent and never answered: it may or may not have been applied.
            ErrorKind::OutcomeUnknown => (StatusCode::GATEWAY_TIMEOUT, "outcome_unknown"),
            // The backend refused *our* credentials: not the client's doing.
            ErrorKind::Unauthorized => (StatusCode::BAD_GATEWAY, "backend_unauthorized"),
            ErrorKind::Misconfigured => (StatusCode::INTERNAL_SERVER_ERROR, "misconfigured"),
            ErrorKind::Corrupt => (StatusCode::INTERNAL_SERVER_ERROR, "corrupt_document"),
            ErrorKind::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        if !status.is_server_error() {
            return ApiError::new(status, error, err.to_string());
        }
        // The request span carries the request id, so the log line can be found from the reply.
        tracing::error!(error = %err, kind = %err.kind(), "request failed");
        let reason = match err.kind() {
            ErrorKind::Unavailable => "the storage backend is unavailable; retry later",
            ErrorKind::Unauthorized => "the storage backend refused the server's credentials",
            ErrorKind::Misconfigured => "the server is misconfigured",
            ErrorKind::Corrupt => "a stored document is corrupt",
            _ => "internal error",
        };
        ApiError::new(status, error, reason)
    }
}

tokio::task_local! {
    /// The id of the request being handled, for the reasons of 5xx answers.
    static REQUEST_ID: String;
}

/// Middleware: makes the request id (set by the request-id layer outside) known to the error
/// answers produced while the request is handled.
pub async fn scope_request_id(request: Request, next: Next) -> Response {
    let id = request.headers().get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("-").to_owned();
    REQUEST_ID.scope(id, next.run(request)).await
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut reason = self.reason;
        if self.status.is_server_error() {
            if let Ok(id) = REQUEST_ID.try_with(Clone::clone) {
                reason = format!("{reason} (request id {id})");
            }
        }
        let mut response = (self.status, axum::Json(json!({ "error": self.error, "reason": reason }))).into_response();
        let headers = response.headers_mut();
        match self.status {
            StatusCode::SERVICE_UNAVAILABLE => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            StatusCode::UNAUTHORIZED => {
                headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"agentstore\""));
            }
            _ => {}
        }
        response
    }
}

impl From<Stopping> for ApiError {
    /// A body budget closed under a request: the server is stopping.
    fn from(_: Stopping) -> Self {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "the server is stopping")
    }
}
