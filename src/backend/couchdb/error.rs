//! Maps CouchDB's answers into the crate's error kinds. The message keeps CouchDB's own
//! `error`/`reason`, and transport errors are kept as the source.

use reqwest::StatusCode;
use serde_json::Value;

use crate::error::{Error, ErrorKind};

/// An error for a non-success status, `doing` saying what we asked for.
pub(super) fn from_status(status: StatusCode, body: &Value, doing: &str) -> Error {
    let error = body.get("error").and_then(Value::as_str).unwrap_or("");
    let reason = body.get("reason").and_then(Value::as_str).unwrap_or("");
    let detail = if error.is_empty() && reason.is_empty() {
        format!("HTTP {status}")
    } else {
        format!("HTTP {status} {error}: {reason}")
    };
    let kind = match status {
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => ErrorKind::Unauthorized,
        StatusCode::NOT_FOUND => ErrorKind::NotFound,
        StatusCode::CONFLICT | StatusCode::PRECONDITION_FAILED => ErrorKind::Conflict,
        StatusCode::PAYLOAD_TOO_LARGE => ErrorKind::TooLarge,
        StatusCode::BAD_REQUEST => ErrorKind::InvalidInput,
        StatusCode::TOO_MANY_REQUESTS => ErrorKind::Unavailable,
        s if s.is_server_error() => ErrorKind::Unavailable,
        _ => ErrorKind::Internal,
    };
    let message = match kind {
        ErrorKind::Unauthorized => format!("CouchDB refused our credentials while trying to {doing} ({detail})"),
        ErrorKind::TooLarge => format!("CouchDB refused the document as too large while trying to {doing} ({detail})"),
        _ => format!("CouchDB could not {doing} ({detail})"),
    };
    Error::new(kind, message)
}

/// A transport failure: connection refused, timeout, TLS — the server is unavailable to us.
pub(super) fn from_transport(err: reqwest::Error, doing: &str) -> Error {
    let kind = if err.is_decode() || err.is_builder() { ErrorKind::Internal } else { ErrorKind::Unavailable };
    Error::new(kind, format!("CouchDB request failed while trying to {doing}")).with_source(err)
}

/// A response body that is not the JSON CouchDB promises.
pub(super) fn bad_body(doing: &str, source: serde_json::Error) -> Error {
    Error::new(ErrorKind::Internal, format!("CouchDB answered with unexpected JSON while trying to {doing}"))
        .with_source(source)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn statuses_map_to_kinds() {
        let body = json!({"error": "conflict", "reason": "Document update conflict."});
        let cases = [
            (401, ErrorKind::Unauthorized),
            (403, ErrorKind::Unauthorized),
            (404, ErrorKind::NotFound),
            (409, ErrorKind::Conflict),
            (412, ErrorKind::Conflict),
            (413, ErrorKind::TooLarge),
            (400, ErrorKind::InvalidInput),
            (429, ErrorKind::Unavailable),
            (500, ErrorKind::Unavailable),
            (503, ErrorKind::Unavailable),
            (415, ErrorKind::Internal),
        ];
        for (status, kind) in cases {
            let err = from_status(StatusCode::from_u16(status).unwrap(), &body, "write a document");
            assert_eq!(err.kind(), kind, "{status}");
            assert!(err.to_string().contains("Document update conflict."));
        }
    }
}
