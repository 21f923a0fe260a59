//! CouchDB's error answers: `{"error": "...", "reason": "..."}` with CouchDB's statuses and names,
//! so clients that branch on them (`conflict`, `not_found`, `file_exists`, `forbidden`) keep
//! working. A 5xx keeps its details in the log and tells the client only what failed.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::database::validation::FunctionFailure;
use crate::error::{Error, ErrorKind};
use crate::mango::MangoError;
use crate::server::budget::Stopping;

/// An error on its way to a CouchDB client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CouchError {
    pub status: StatusCode,
    pub error: String,
    pub reason: String,
    /// Made by [`CouchError::missing`] or [`CouchError::deleted`]: the answer is about a document
    /// of a database that was open, and its response says so ([`DocumentNotFound`]).
    document_not_found: bool,
}

/// Marks the response of a document-level 404 (`missing` or `deleted`: a document, revision or
/// local document the open database does not have), so that the database router need not look
/// the database up again to tell it from a database deleted under the request
/// (`db::may_be_a_deleted_database`), and never reads the body to tell.
#[derive(Debug, Clone, Copy)]
pub struct DocumentNotFound;

impl CouchError {
    pub fn new(status: StatusCode, error: impl Into<String>, reason: impl Into<String>) -> Self {
        CouchError { status, error: error.into(), reason: reason.into(), document_not_found: false }
    }

    /// CouchDB's 404 `missing` for a document (or revision, or local document) the open database
    /// does not have; its response is marked [`DocumentNotFound`].
    pub fn missing() -> Self {
        CouchError { document_not_found: true, ..CouchError::not_found("missing") }
    }

    /// CouchDB's 404 `deleted` for a document whose winning revision is a deletion; its response
    /// is marked [`DocumentNotFound`].
    pub fn deleted() -> Self {
        CouchError { document_not_found: true, ..CouchError::not_found("deleted") }
    }

    pub fn bad_request(reason: impl Into<String>) -> Self {
        CouchError::new(StatusCode::BAD_REQUEST, "bad_request", reason)
    }

    pub fn not_found(reason: impl Into<String>) -> Self {
        CouchError::new(StatusCode::NOT_FOUND, "not_found", reason)
    }

    pub fn forbidden(reason: impl Into<String>) -> Self {
        CouchError::new(StatusCode::FORBIDDEN, "forbidden", reason)
    }

    pub fn unauthorized(reason: impl Into<String>) -> Self {
        CouchError::new(StatusCode::UNAUTHORIZED, "unauthorized", reason)
    }

    /// CouchDB's answer to a write whose `_rev` is not the current one.
    pub fn conflict() -> Self {
        CouchError::new(StatusCode::CONFLICT, "conflict", "Document update conflict.")
    }

    /// CouchDB's answer for a database other than the one served.
    pub fn no_database() -> Self {
        CouchError::not_found("Database does not exist.")
    }

    /// A feature this server does not offer over this backend (views, attachments, …).
    pub fn not_supported(what: &str) -> Self {
        CouchError::new(
            StatusCode::NOT_IMPLEMENTED,
            "not_implemented",
            format!("{what} is not supported by agentstore"),
        )
    }

    /// Our side failed (the reason is logged and answered).
    pub(crate) fn internal(reason: impl Into<String>) -> Self {
        CouchError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_server_error", reason)
    }

    /// The `{"error","reason"}` body.
    pub fn body(&self) -> serde_json::Value {
        json!({ "error": self.error, "reason": self.reason })
    }

    /// The body of a per-document error in `_bulk_docs` answers.
    pub fn to_row(&self, id: &str) -> serde_json::Value {
        json!({ "id": id, "error": self.error, "reason": self.reason })
    }
}

/// CouchDB's answer to an error made below the HTTP layer that already knows it (a design
/// function's `compilation_error` or `os_process_error`, a bound an answer's rows passed), carried
/// as the source of the crate's error so that every path answering that error answers it the same
/// way: [`CouchError::from`] gives it back unchanged.
#[derive(Debug, Clone)]
pub struct Answered(pub CouchError);

impl std::fmt::Display for Answered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}): {}", self.0.error, self.0.status.as_u16(), self.0.reason)
    }
}

impl std::error::Error for Answered {}

impl CouchError {
    /// This answer as a crate error that [`CouchError::from`] gives back unchanged.
    pub(crate) fn carried(self) -> Error {
        let kind = match self.status.as_u16() {
            413 => ErrorKind::TooLarge,
            400..=499 => ErrorKind::InvalidInput,
            _ => ErrorKind::Internal,
        };
        Error::new(kind, self.reason.clone()).with_source(Answered(self))
    }
}

impl From<Error> for CouchError {
    fn from(err: Error) -> Self {
        let source = std::error::Error::source(&err);
        if let Some(Answered(answer)) = source.and_then(|s| s.downcast_ref::<Answered>()) {
            return answer.clone();
        }
        if let Some(failure) = source.and_then(|s| s.downcast_ref::<FunctionFailure>()) {
            return CouchError::from(failure.clone());
        }
        let (status, error) = match err.kind() {
            ErrorKind::InvalidInput => (StatusCode::BAD_REQUEST, "bad_request"),
            ErrorKind::NotFound => (StatusCode::NOT_FOUND, "not_found"),
            ErrorKind::Conflict => return CouchError::conflict(),
            // A validation function's own message, as CouchDB answers it.
            ErrorKind::Forbidden => return CouchError::forbidden(err.message().to_owned()),
            ErrorKind::LoginRequired => return CouchError::unauthorized(err.message().to_owned()),
            ErrorKind::TooLarge => (StatusCode::PAYLOAD_TOO_LARGE, "document_too_large"),
            ErrorKind::Unavailable | ErrorKind::DeadlineExceeded => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            ErrorKind::OutcomeUnknown => (StatusCode::GATEWAY_TIMEOUT, "outcome_unknown"),
            ErrorKind::Unauthorized => (StatusCode::BAD_GATEWAY, "backend_unauthorized"),
            ErrorKind::Misconfigured | ErrorKind::Corrupt | ErrorKind::Internal => {
                (StatusCode::INTERNAL_SERVER_ERROR, "internal_server_error")
            }
        };
        if !status.is_server_error() {
            return CouchError::new(status, error, err.to_string());
        }
        tracing::error!(error = %err, kind = %err.kind(), "couchdb api request failed");
        let reason = match err.kind() {
            ErrorKind::Unavailable | ErrorKind::DeadlineExceeded => "the storage backend is unavailable; retry later",
            ErrorKind::OutcomeUnknown => "the storage backend did not answer a write in time; it may have been applied",
            ErrorKind::Unauthorized => "the storage backend refused the server's credentials",
            ErrorKind::Misconfigured => "the server is misconfigured",
            ErrorKind::Corrupt => "a stored document is corrupt",
            _ => "internal error",
        };
        CouchError::new(status, error, reason)
    }
}

impl IntoResponse for CouchError {
    fn into_response(self) -> Response {
        let mut response =
            (self.status, axum::Json(json!({ "error": self.error, "reason": self.reason }))).into_response();
        let headers = response.headers_mut();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if self.document_not_found {
            response.extensions_mut().insert(DocumentNotFound);
        }
        response
    }
}

impl From<MangoError> for CouchError {
    /// Mango's refusals as Mango decided them; the failures below it (the store, a view index)
    /// as every route answers them.
    fn from(error: MangoError) -> Self {
        match error {
            MangoError::Refused(refusal) => CouchError::new(refusal.status, refusal.error, refusal.reason),
            MangoError::Storage(error) => CouchError::from(error),
            MangoError::View(error) => CouchError::from(error),
        }
    }
}

impl From<FunctionFailure> for CouchError {
    /// A design function's failure as CouchDB answers it: `compilation_error` for a design
    /// document's view that does not compile, else as a view's function failing.
    fn from(failure: FunctionFailure) -> Self {
        match failure {
            FunctionFailure::Call(err) => CouchError::from(crate::views::javascript::view_error(err)),
            FunctionFailure::ViewCompilation(reason) => {
                CouchError::new(StatusCode::BAD_REQUEST, "compilation_error", reason)
            }
        }
    }
}

/// Shorthand for handler results.
pub type CouchResult<T> = std::result::Result<T, CouchError>;

impl From<Stopping> for CouchError {
    /// A body budget closed under a request: the server is stopping.
    fn from(_: Stopping) -> Self {
        CouchError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "the server is stopping")
    }
}
