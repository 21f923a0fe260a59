//! Maps Firestore's answers into the crate's error kinds. Firestore reports errors as
//! `{"error": {"code", "message", "status"}}` with a gRPC status name; the message keeps
//! Firestore's own words (less the resource names, which are the layout's and could reach a
//! client in a reason), and transport and auth errors are kept as the source.

use reqwest::StatusCode;
use serde_json::Value;

use crate::backend::raw::http::{kind_of_status, unexpected_body, Idempotency};
use crate::error::{Error, ErrorKind};

/// The name Firestore goes by in errors.
pub(super) const SERVICE: &str = "Firestore";

/// What deploying the index takes, for the missing-index error.
const INDEX_HELP: &str = "deploy the composite indexes in firestore.indexes.json (userId + namespace for \
                          listings, _deleted + _id both ways for id order; see docs/backends.md, Firestore)";

/// The gRPC status name of an error reply (`ABORTED`, `NOT_FOUND`, …), or `""`.
pub(super) fn status_name(body: &Value) -> &str {
    body.pointer("/error/status").and_then(Value::as_str).unwrap_or("")
}

/// An error for a non-success reply, `doing` saying what we asked for. `ABORTED`, `UNAVAILABLE`
/// and `RESOURCE_EXHAUSTED` had no effect (`Unavailable`, retried); `DEADLINE_EXCEEDED`,
/// `INTERNAL` and `CANCELLED` may have, so for a write they are `OutcomeUnknown`.
pub(super) fn from_reply(status: StatusCode, body: &Value, idempotency: Idempotency, doing: &str) -> Error {
    let name = status_name(body);
    let message = body.pointer("/error/message").and_then(Value::as_str).unwrap_or("");
    let detail = match (name, message) {
        ("", "") => format!("HTTP {status}"),
        _ => format!("HTTP {} {name}: {}", status.as_u16(), without_resource_names(message)),
    };
    if name == "FAILED_PRECONDITION" && message.contains("index") {
        let link = message.split_whitespace().find(|w| w.starts_with("https://")).unwrap_or("(no link given)");
        return Error::new(
            ErrorKind::Misconfigured,
            format!(
                "Firestore has no index for this query while trying to {doing}: {INDEX_HELP}, or create it at {link}"
            ),
        );
    }
    let kind = match name {
        "NOT_FOUND" => ErrorKind::NotFound,
        "ALREADY_EXISTS" | "FAILED_PRECONDITION" => ErrorKind::Conflict,
        "UNAUTHENTICATED" | "PERMISSION_DENIED" => ErrorKind::Unauthorized,
        "INVALID_ARGUMENT" if message.contains("maximum allowed size") || message.contains("too large") => {
            ErrorKind::TooLarge
        }
        "INVALID_ARGUMENT" | "OUT_OF_RANGE" => ErrorKind::InvalidInput,
        "ABORTED" | "UNAVAILABLE" | "RESOURCE_EXHAUSTED" => ErrorKind::Unavailable,
        "DEADLINE_EXCEEDED" | "INTERNAL" | "CANCELLED" => match idempotency {
            Idempotency::Idempotent => ErrorKind::Unavailable,
            Idempotency::NotIdempotent => ErrorKind::OutcomeUnknown,
        },
        _ => match kind_of_status(status, idempotency) {
            // Firestore names its conflicts; a bare 409/412/400 without a status name is not ours.
            ErrorKind::Conflict | ErrorKind::InvalidInput | ErrorKind::TooLarge => ErrorKind::Internal,
            kind => kind,
        },
    };
    let message = match kind {
        ErrorKind::Unauthorized => format!("Firestore refused our credentials while trying to {doing} ({detail})"),
        ErrorKind::OutcomeUnknown => {
            format!("Firestore failed while trying to {doing} ({detail}); the write may have been applied")
        }
        _ => format!("Firestore could not {doing} ({detail})"),
    };
    Error::new(kind, message)
}

/// Firestore's words with every resource name (`projects/{p}/databases/{d}/documents/…`) left
/// out: an error's reason may reach a client, and the names are the layout's, not the client's.
fn without_resource_names(message: &str) -> String {
    const NAME_START: &str = "projects/";
    let mut shown = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(at) = rest.find(NAME_START) {
        shown.push_str(&rest[..at]);
        shown.push_str("(a document name)");
        let name = &rest[at..];
        let end = name.find(|c: char| c.is_whitespace() || c == '"' || c == '\'' || c == '`').unwrap_or(name.len());
        rest = &name[end..];
    }
    shown.push_str(rest);
    shown
}

/// A failure to get an access token from Google. gcp_auth reports a token endpoint it cannot
/// reach as `Other("HTTP request failed", …)` or `Http(…)`: that is unavailability, not refused
/// credentials.
pub(super) fn from_auth(err: gcp_auth::Error, doing: &str) -> Error {
    let kind = match &err {
        gcp_auth::Error::NoAuthMethod(..) => ErrorKind::Misconfigured,
        gcp_auth::Error::Http(..) => ErrorKind::Unavailable,
        gcp_auth::Error::Other(context, _) if context.starts_with("HTTP") => ErrorKind::Unavailable,
        _ => ErrorKind::Unauthorized,
    };
    let message = match kind {
        ErrorKind::Misconfigured => format!(
            "cannot get Google credentials to {doing} (give a service-account key with credentials=FILE or \
             GOOGLE_APPLICATION_CREDENTIALS, run `gcloud auth application-default login`, or run on Google Cloud)"
        ),
        ErrorKind::Unavailable => {
            format!("cannot get Google credentials to {doing}: the token endpoint is unreachable")
        }
        _ => format!("cannot get Google credentials to {doing}: the token request was refused"),
    };
    Error::new(kind, message).with_source(err)
}

/// A response body that is not the JSON Firestore promises.
pub(super) fn bad_body(doing: &str, problem: impl std::fmt::Display) -> Error {
    unexpected_body(SERVICE, doing, problem)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn reply(code: u16, status: &str, message: &str) -> (StatusCode, Value) {
        (StatusCode::from_u16(code).unwrap(), json!({"error": {"code": code, "status": status, "message": message}}))
    }

    #[test]
    fn statuses_map_to_kinds() {
        let cases = [
            (404, "NOT_FOUND", ErrorKind::NotFound),
            (409, "ALREADY_EXISTS", ErrorKind::Conflict),
            (400, "FAILED_PRECONDITION", ErrorKind::Conflict),
            (409, "ABORTED", ErrorKind::Unavailable),
            (429, "RESOURCE_EXHAUSTED", ErrorKind::Unavailable),
            (503, "UNAVAILABLE", ErrorKind::Unavailable),
            (401, "UNAUTHENTICATED", ErrorKind::Unauthorized),
            (403, "PERMISSION_DENIED", ErrorKind::Unauthorized),
            (400, "INVALID_ARGUMENT", ErrorKind::InvalidInput),
            (418, "", ErrorKind::Internal),
        ];
        for (code, name, kind) in cases {
            let (status, body) = reply(code, name, "words from Firestore");
            let err = from_reply(status, &body, Idempotency::Idempotent, "write a document");
            assert_eq!(err.kind(), kind, "{name}");
            if !name.is_empty() {
                assert!(err.to_string().contains("words from Firestore"), "{err}");
            }
        }
        let (status, body) = reply(400, "INVALID_ARGUMENT", "Document exceeds the maximum allowed size");
        assert_eq!(from_reply(status, &body, Idempotency::NotIdempotent, "write").kind(), ErrorKind::TooLarge);
    }

    #[test]
    fn resource_names_never_reach_a_reason() {
        let message = "Document name \"projects/p/databases/(default)/documents/dbs/x/docs/\" lacks \"/\" at index 52.";
        let (status, body) = reply(400, "INVALID_ARGUMENT", message);
        let err = from_reply(status, &body, Idempotency::Idempotent, "read a document").to_string();
        assert!(!err.contains("projects/") && !err.contains("documents/dbs"), "{err}");
        assert!(err.contains("Document name \"(a document name)\" lacks"), "{err}");
    }

    #[test]
    fn a_missing_index_says_so_and_quotes_the_link() {
        let link = "https://console.firebase.google.com/v1/r/project/p/firestore/indexes?create_composite=abc";
        let (status, body) =
            reply(400, "FAILED_PRECONDITION", &format!("The query requires an index. You can create it here: {link}"));
        let err = from_reply(status, &body, Idempotency::Idempotent, "list documents");
        assert_eq!(err.kind(), ErrorKind::Misconfigured);
        assert!(err.to_string().contains(link), "{err}");
        assert!(err.to_string().contains("firestore.indexes.json"), "{err}");
    }

    #[test]
    fn failures_that_may_have_applied_a_write_say_so() {
        for name in ["DEADLINE_EXCEEDED", "INTERNAL"] {
            let (status, body) = reply(500, name, "");
            assert_eq!(from_reply(status, &body, Idempotency::NotIdempotent, "w").kind(), ErrorKind::OutcomeUnknown);
            assert_eq!(from_reply(status, &body, Idempotency::Idempotent, "r").kind(), ErrorKind::Unavailable);
        }
        for name in ["ABORTED", "UNAVAILABLE", "RESOURCE_EXHAUSTED"] {
            let (status, body) = reply(503, name, "");
            assert_eq!(from_reply(status, &body, Idempotency::NotIdempotent, "w").kind(), ErrorKind::Unavailable);
        }
        // An HTML error page from a proxy leaves only the status.
        let kind = from_reply(StatusCode::BAD_GATEWAY, &Value::Null, Idempotency::NotIdempotent, "w").kind();
        assert_eq!(kind, ErrorKind::Unavailable);
    }
}
