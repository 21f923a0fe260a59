//! Maps CouchDB's answers into the crate's error kinds. The message keeps CouchDB's own
//! `error`/`reason`; what a status means when the body adds nothing (and whether a write that
//! failed may have been applied) is decided once, in [`crate::backend::raw::http`].

use reqwest::StatusCode;
use serde_json::Value;

use crate::backend::raw::http::{kind_of_status, Idempotency};
use crate::error::{Error, ErrorKind};

/// An error for a non-success status of a read (or of a write's 4xx answer), `doing` saying what
/// we asked for.
pub(super) fn from_status(status: StatusCode, body: &Value, doing: &str) -> Error {
    status_error(status, body, Idempotency::Idempotent, doing)
}

/// An error for a non-success status of a request that is or is not idempotent.
pub(super) fn status_error(status: StatusCode, body: &Value, idempotency: Idempotency, doing: &str) -> Error {
    let error = body.get("error").and_then(Value::as_str).unwrap_or("");
    let reason = body.get("reason").and_then(Value::as_str).unwrap_or("");
    let detail = if error.is_empty() && reason.is_empty() {
        format!("HTTP {status}")
    } else {
        format!("HTTP {status} {error}: {reason}")
    };
    let kind = kind_of_status(status, idempotency);
    let message = match kind {
        ErrorKind::Unauthorized => format!("CouchDB refused our credentials while trying to {doing} ({detail})"),
        ErrorKind::TooLarge => format!("CouchDB refused the document as too large while trying to {doing} ({detail})"),
        ErrorKind::OutcomeUnknown => {
            format!("CouchDB failed while trying to {doing} ({detail}); the write may have been applied")
        }
        _ => format!("CouchDB could not {doing} ({detail})"),
    };
    Error::new(kind, message)
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

    #[test]
    fn a_write_answered_500_or_504_may_have_been_applied() {
        for status in [500, 504] {
            let err =
                status_error(StatusCode::from_u16(status).unwrap(), &Value::Null, Idempotency::NotIdempotent, "w");
            assert_eq!(err.kind(), ErrorKind::OutcomeUnknown, "{status}");
        }
        let err = status_error(StatusCode::BAD_GATEWAY, &Value::Null, Idempotency::NotIdempotent, "w");
        assert_eq!(err.kind(), ErrorKind::Unavailable);
    }
}
