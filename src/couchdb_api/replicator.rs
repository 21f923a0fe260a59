//! The replicator's HTTP side (CouchDB's `couch_replicator_httpd`): `GET /_scheduler/jobs`,
//! `GET /_scheduler/docs` (and `/_scheduler/docs/_replicator/{doc id}`) and `POST /_replicate`
//! (`GET /_active_tasks` is [`super::root`]'s, replications listed first), over [`crate::replicator::Replicator`]. Who may ask is CouchDB 3.4.3's:
//! `_scheduler` and `_active_tasks` are a server admin's, `_replicate` any login's (a replication
//! with a local endpoint a server admin's, as its reads and writes here are an admin's).
//!
//! On the CouchDB backend no replicator runs here (the databases are CouchDB's, and so is its
//! replicator): these answer empty lists, and `_replicate` CouchDB's 404 `not_found` for a
//! cancellation, 503 otherwise.

use std::collections::HashMap;

use axum::body::Body;
use axum::extract::{Extension, Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use serde_json::{json, Value};

use super::auth::Identity;
use super::error::CouchError;
use super::root::server_admin_only;
use super::{json, Answer, CouchState};
use crate::replicator::spec;

/// CouchDB's default `limit` of `_scheduler/jobs`.
const DEFAULT_LIMIT: usize = 100;

/// `GET /_scheduler/jobs[?limit=&skip=]`, sorted by id as CouchDB sorts them.
pub async fn scheduler_jobs(
    State(state): State<CouchState>,
    Extension(identity): Extension<Identity>,
    Query(params): Query<HashMap<String, String>>,
) -> Answer {
    server_admin_only(&identity)?;
    let limit = super::request::integer_param("limit", params.get("limit").map(String::as_str))?
        .map_or(DEFAULT_LIMIT, |n| usize::try_from(n).unwrap_or(usize::MAX));
    let skip = super::request::integer_param("skip", params.get("skip").map(String::as_str))?
        .map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX));
    let mut jobs = match state.replicator.as_ref().map(|r| r.jobs_json()) {
        Some(Value::Object(mut answer)) => match answer.remove("jobs") {
            Some(Value::Array(jobs)) => jobs,
            _ => Vec::new(),
        },
        _ => Vec::new(),
    };
    jobs.sort_by(|a, b| a["id"].as_str().cmp(&b["id"].as_str()));
    let total = jobs.len();
    let offset = skip.min(total);
    let page: Vec<Value> = jobs.into_iter().skip(offset).take(limit).collect();
    Ok(json(StatusCode::OK, json!({ "total_rows": total, "offset": offset, "jobs": page })))
}

/// `GET /_scheduler/docs` and `/_scheduler/docs/_replicator`.
pub async fn scheduler_docs(State(state): State<CouchState>, Extension(identity): Extension<Identity>) -> Answer {
    server_admin_only(&identity)?;
    let answer = state
        .replicator
        .as_ref()
        .map(|r| r.docs_json())
        .unwrap_or_else(|| json!({ "total_rows": 0, "offset": 0, "docs": [] }));
    Ok(json(StatusCode::OK, answer))
}

/// `GET /_scheduler/docs/_replicator` (the database alone) or `/_scheduler/docs/_replicator/{id}`.
pub async fn scheduler_doc(
    State(state): State<CouchState>,
    Extension(identity): Extension<Identity>,
    Path(rest): Path<String>,
) -> Answer {
    server_admin_only(&identity)?;
    let rest = percent_encoding::percent_decode_str(&rest).decode_utf8_lossy().into_owned();
    let doc_id = match rest.strip_prefix(crate::replicator::REPLICATOR_DB) {
        Some("") | Some("/") => return scheduler_docs(State(state), Extension(identity)).await,
        Some(below) => below.strip_prefix('/').unwrap_or(below).to_owned(),
        None => return Err(CouchError::bad_request("Invalid path")),
    };
    let doc = state.replicator.as_ref().and_then(|r| r.doc_json_of(&doc_id));
    doc.map(|doc| json(StatusCode::OK, doc)).ok_or_else(|| CouchError::not_found("missing"))
}

/// `POST /_replicate`: a transient replication (one-shot: answered when done, with its history;
/// continuous: 202 with its id), or `cancel: true` to stop a continuous one.
pub async fn replicate(
    State(state): State<CouchState>,
    Extension(identity): Extension<Identity>,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    identity.require_login()?;
    let body = state.bodies.read_object(&headers, body).await?;
    let Value::Object(props) = &body.value else {
        return Err(CouchError::bad_request("Request body must be a JSON object"));
    };
    let Some(replicator) = state.replicator.as_ref() else {
        return Err(CouchError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "this server's databases are CouchDB's own: replicate through that CouchDB",
        ));
    };
    let cancel = match props.get("cancel") {
        None | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) => true,
        Some(_) => return Err(CouchError::bad_request("parameter `cancel` must be a boolean")),
    };
    let named_id = ["replication_id", "_local_id", "id"].iter().find_map(|k| props.get(*k)).and_then(Value::as_str);
    if cancel {
        let id = match named_id {
            Some(id) => id.replace(' ', "+"),
            None => {
                let replication = spec::parse(props).map_err(CouchError::bad_request)?;
                replicator.replication_id(&replication).await?.full()
            }
        };
        return if replicator.cancel(&id) {
            Ok(json(StatusCode::OK, json!({ "ok": true, "_local_id": id })))
        } else {
            Ok(json(StatusCode::NOT_FOUND, json!({ "error": "not_found", "reason": "missing" })))
        };
    }
    let mut replication = spec::parse(props).map_err(CouchError::bad_request)?;
    let local = [&replication.source, &replication.target].iter().any(|e| matches!(e, spec::Endpoint::Local(_)));
    if local && !identity.is_server_admin() {
        return Err(CouchError::forbidden("local_endpoints_not_supported"));
    }
    replication.user = identity.user_ctx().name.map(str::to_owned);
    let continuous = replication.continuous;
    match replicator.replicate(replication).await {
        Ok(answer) if continuous => Ok(json(StatusCode::ACCEPTED, answer)),
        Ok(answer) => Ok(json(StatusCode::OK, answer)),
        // CouchDB 3.4.3 answers a missing database with a 500 (fixture 119).
        Err(err) if err.kind() == crate::ErrorKind::NotFound => {
            Ok(json(StatusCode::INTERNAL_SERVER_ERROR, json!({ "error": "db_not_found", "reason": err.message() })))
        }
        Err(err) => Ok(json(
            StatusCode::INTERNAL_SERVER_ERROR,
            json!({ "error": err.kind().as_str(), "reason": err.message() }),
        )),
    }
}
