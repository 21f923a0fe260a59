//! Whole-deployment runs started through the service (`crate::migrate::deployment::service`):
//! `POST /_agentstore/runs` starts a `migrate` or `verify` of every database from a source to a
//! target (202 with its id; 409 while a run of the deployment is going anywhere), `DELETE
//! /_agentstore/runs/{id}` cancels one. Both are a server admin's, as `_active_tasks`, which
//! lists the runs' progress, is. `_agentstore` is no CouchDB path: CouchDB has no such runs
//! (docs/migration.md, "Runs started from the service").

use axum::body::Body;
use axum::extract::{Extension, Path, State};
use axum::http::{HeaderMap, StatusCode};
use serde_json::{json, Value};

use super::auth::Identity;
use super::error::CouchError;
use super::root::server_admin_only;
use super::{json, Answer, CouchState};
use crate::migrate::deployment::service::{RunRequest, Started};

/// `POST /_agentstore/runs`.
pub async fn start(
    State(state): State<CouchState>,
    Extension(identity): Extension<Identity>,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    server_admin_only(&identity)?;
    let body = state.bodies.read_object(&headers, body).await?;
    let Value::Object(props) = &body.value else {
        return Err(CouchError::bad_request("Request body must be a JSON object"));
    };
    let request = RunRequest::parse(props)?;
    let secrets = [request.source.clone(), request.target.clone()];
    let started = state.runs.start(request).await.map_err(|err| {
        // A side's error may quote the URL it was given: never with its password.
        let message = redact(err.message(), &secrets);
        CouchError::from(crate::error::Error::new(err.kind(), message))
    })?;
    match started {
        Started::Run(id) => Ok(json(StatusCode::ACCEPTED, json!({ "ok": true, "id": id }))),
        Started::Busy(id) => Ok(json(
            StatusCode::CONFLICT,
            json!({ "error": "conflict", "reason": "a run of this deployment is going; cancel it or wait", "id": id }),
        )),
    }
}

/// `DELETE /_agentstore/runs/{id}`.
pub async fn cancel(
    State(state): State<CouchState>,
    Extension(identity): Extension<Identity>,
    Path(id): Path<String>,
) -> Answer {
    server_admin_only(&identity)?;
    if state.runs.cancel(&id).await? {
        Ok(json(StatusCode::OK, json!({ "ok": true, "id": id })))
    } else {
        Err(CouchError::not_found("no run of that id is going"))
    }
}

/// `message` with the password of each URL of `urls` replaced by `***`.
fn redact(message: &str, urls: &[String]) -> String {
    let mut message = message.to_owned();
    for text in urls {
        let password = url::Url::parse(text).ok().and_then(|url| url.password().map(str::to_owned));
        if let Some(password) = password.filter(|p| !p.is_empty()) {
            message = message.replace(&password, "***");
            let decoded = percent_encoding::percent_decode_str(&password).decode_utf8_lossy().into_owned();
            message = message.replace(&decoded, "***");
        }
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_password_in_a_url_never_reaches_an_answer() {
        let urls = ["http://admin:s%40cret@host:5984/".to_owned(), "dynamodb://table".to_owned()];
        let message = "source http://admin:s%40cret@host:5984/ (s@cret): refused";
        let redacted = redact(message, &urls);
        assert!(!redacted.contains("s%40cret") && !redacted.contains("s@cret"), "{redacted}");
        assert!(redacted.contains("admin:***@host"), "{redacted}");
    }
}
