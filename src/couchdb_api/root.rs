//! The server root: `GET /`, `/_up`, `/_uuids`, the probes (`_active_tasks`, `_membership`; the
//! node's own endpoints are [`super::node`]'s, `_scheduler` and `_replicate`
//! [`super::replicator`]'s), the server admins' check, and
//! the answers to paths and methods no route takes (and to a handler that panicked). Databases
//! are [`super::db`]'s.

use axum::extract::{Extension, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::auth::Identity;
use super::error::CouchError;
use super::node::NODE_NAME;
use super::{json, Answer, CouchState};

/// The CouchDB API version reported: the 3.x API these endpoints follow. Clients gate features
/// on it (python-couchdb parses each part as a number), so it is CouchDB's, and the vendor says
/// who is answering.
pub const API_VERSION: &str = "3.4.3";

/// The commit this server was built from, when the build names it (`AGENTSTORE_GIT_SHA` at
/// compile time), reported as CouchDB reports its own `git_sha`; `unknown` otherwise.
pub const GIT_SHA: &str = match option_env!("AGENTSTORE_GIT_SHA") {
    Some(sha) => sha,
    None => "unknown",
};

/// A server uuid that stays the same across restarts over the same store, so replication
/// peers that key checkpoints on it keep them.
pub fn stable_uuid(describe: &str) -> String {
    hex::encode(&Sha256::digest(format!("agentstore couchdb api {describe}").as_bytes())[..16])
}

/// `GET /`.
pub async fn welcome(State(state): State<CouchState>) -> Response {
    json(
        StatusCode::OK,
        json!({
            "couchdb": "Welcome",
            "version": API_VERSION,
            "git_sha": GIT_SHA,
            "uuid": &*state.server_uuid,
            // CouchDB 3.4.3 lists `quickjs`, `access-ready`, `partitioned`,
            // `pluggable-storage-engines`, `reshard` and `scheduler` here; clients switch those
            // features' endpoints on by them, and this server offers none of them.
            "features": [],
            "vendor": { "name": "agentstore", "version": env!("CARGO_PKG_VERSION") }
        }),
    )
}

/// `GET /_up`: the backend answers. While the process drains before it stops, 404 `nolb`: what
/// CouchDB answers with `[couchdb] maintenance_mode = nolb`, "take me out of the load balancer".
pub async fn up(State(state): State<CouchState>) -> Response {
    if state.draining.is_draining() {
        return json(StatusCode::NOT_FOUND, json!({ "status": "nolb" }));
    }
    match state.store.backend().health().await {
        Ok(()) => json(StatusCode::OK, json!({ "status": "ok", "seeds": {} })),
        Err(err) => {
            tracing::warn!(error = %err, "couchdb api: backend unhealthy");
            json(StatusCode::NOT_FOUND, json!({ "status": "maintenance_mode" }))
        }
    }
}

#[derive(serde::Deserialize)]
pub struct UuidsParams {
    count: Option<String>,
}

/// Most uuids one `GET /_uuids` hands out (CouchDB's default `max_count`).
const MAX_UUIDS: u64 = 1000;

/// `GET /_uuids?count=N`: random 128-bit ids, as CouchDB's `random` algorithm makes them.
pub async fn uuids(Query(params): Query<UuidsParams>) -> Answer {
    let count = super::request::integer_param("count", params.count.as_deref())?.unwrap_or(1);
    if count > MAX_UUIDS {
        return Err(CouchError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("count must not exceed {MAX_UUIDS}"),
        ));
    }
    let mut uuids = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let mut bytes = [0u8; 16];
        getrandom::fill(&mut bytes)
            .map_err(|e| CouchError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_server_error", e.to_string()))?;
        uuids.push(hex::encode(bytes));
    }
    Ok(json(StatusCode::OK, json!({ "uuids": uuids })))
}

/// CouchDB's 401 for a server-admin endpoint asked by anyone else
/// (`chttpd:verify_is_server_admin`: 401 even for a login that is not an admin).
pub(crate) fn server_admin_only(identity: &Identity) -> Result<(), CouchError> {
    if identity.is_server_admin() {
        Ok(())
    } else {
        Err(CouchError::unauthorized("You are not a server admin."))
    }
}

/// Any path below a name starting with `_` that names no endpoint of the server: CouchDB's
/// 404 for a database that does not exist (no database's name starts with `_` here).
pub async fn no_such_database() -> Response {
    CouchError::no_database().into_response()
}

/// Any path no route matches.
pub async fn no_route() -> Response {
    CouchError::not_found("missing").into_response()
}

/// A known path with a method it does not take (CouchDB's 405 body).
pub async fn method_not_allowed() -> Response {
    CouchError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "Only the documented methods are allowed")
        .into_response()
}

/// The answer to a handler that panicked (logged by `crate::server::catch_panics`): a 500 in
/// CouchDB's shape.
pub fn internal_error() -> Response {
    CouchError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_server_error", "internal error").into_response()
}

/// `GET /_active_tasks`: the replications this server runs ([`super::replicator`]); no
/// compaction or indexing task runs inside this server; then the `migrate`/`import` runs whose target is this server's backend, from
/// the progress records they keep there ([`crate::migrate::run_record`]): those still going, and
/// those that ended within [`ENDED_TASKS_SHOWN`], newest first, at most [`MAX_TASKS_LISTED`] (none
/// when the backend cannot list its local documents). A server admin's, as CouchDB's (`chttpd_misc:handle_task_status_req`).
pub async fn active_tasks(State(state): State<CouchState>, Extension(identity): Extension<Identity>) -> Answer {
    server_admin_only(&identity)?;
    // The replications running here first ([`crate::replicator`]), then the migration runs.
    let mut tasks = state.replicator.as_ref().map(|r| r.active_tasks()).unwrap_or_default();
    tasks.extend(match migration_tasks(state.store.backend().as_ref()).await {
        Ok(tasks) => tasks,
        // A backend that cannot list local documents (a CouchDB backend server without
        // `_local_docs`, as pouchdb-server) or is briefly away: no run is listed, as before runs
        // kept records; the tasks are a report, never a reason to fail the probe.
        Err(err) => {
            tracing::warn!(error = %err, "_active_tasks: cannot read the migration runs' records");
            Vec::new()
        }
    });
    Ok(json(StatusCode::OK, Value::Array(tasks)))
}

/// How long a run that ended stays in `_active_tasks` (its record stays in the backend).
pub const ENDED_TASKS_SHOWN: std::time::Duration = std::time::Duration::from_secs(3600);
/// Most run records `_active_tasks` reads.
pub const MAX_TASKS_LISTED: usize = 100;

/// The run records as CouchDB-shaped tasks: `type` `agentstore_migration`, CouchDB's
/// `changes_done`, `total_changes`, `progress` (percent, when the total is known), `started_on`,
/// `updated_on`, `pid`, `node`, `run_id` (the record's name below `_local/:run:`), and the
/// record's own fields (`command`, `source`, `target`, `state`, `rate`, `eta_secs`, `landed`,
/// `skipped`, `error`, `origin`; a whole-deployment run's `databases_done`, `databases_total`,
/// `databases_now`, and `passed` once a comparison ends).
async fn migration_tasks(backend: &dyn crate::backend::DocumentBackend) -> crate::error::Result<Vec<Value>> {
    use crate::migrate::run_record::{state_now, RUN_RECORD_PREFIX};
    let prefix = RUN_RECORD_PREFIX;
    // `;` follows `:` in byte order: every name starting with the prefix is below it.
    let end = format!("{};", &prefix[..prefix.len() - 1]);
    let range = crate::backend::IdRange {
        start: Some(prefix.to_owned()),
        end: Some(end),
        inclusive_end: false,
        descending: false,
        include_design: false,
    };
    let page = backend.local_docs(&range, MAX_TASKS_LISTED, None).await?;
    let now = chrono::Utc::now().timestamp();
    let mut tasks: Vec<Value> = page
        .items
        .into_iter()
        .filter_map(|record| {
            let run_id = record.id.trim_start_matches("_local/").trim_start_matches(prefix).to_owned();
            let body = record.body;
            let state = state_now(&body, now).to_owned();
            let updated = body.get("updated_on").and_then(Value::as_i64).unwrap_or(0);
            let ended = state != "running";
            if ended && now.saturating_sub(updated) > ENDED_TASKS_SHOWN.as_secs() as i64 {
                return None;
            }
            let read = body.get("read").and_then(Value::as_u64).unwrap_or(0);
            let total = body.get("total").and_then(Value::as_u64);
            let mut task = serde_json::Map::new();
            task.insert("type".into(), json!("agentstore_migration"));
            task.insert("node".into(), json!(NODE_NAME));
            task.insert("changes_done".into(), json!(read));
            task.insert("total_changes".into(), json!(total));
            task.insert("progress".into(), json!(total.filter(|t| *t > 0).map(|t| (read.min(t) * 100) / t)));
            for (name, value) in body {
                task.entry(name).or_insert(value);
            }
            task.insert("state".into(), json!(state));
            // The id `DELETE /_agentstore/runs/{id}` takes (a run the service started).
            task.insert("run_id".into(), json!(run_id));
            Some(Value::Object(task))
        })
        .collect();
    let started = |task: &Value| task.get("started_on").and_then(Value::as_i64).unwrap_or(0);
    tasks.sort_by_key(|task| std::cmp::Reverse(started(task)));
    Ok(tasks)
}

/// `GET /_membership`: a cluster of one node. A server admin's, as CouchDB's (every `/_membership`
/// and `/_node` path is in `chttpd_auth_request:server_authorization_check`'s admin list).
pub async fn membership(Extension(identity): Extension<Identity>) -> Answer {
    server_admin_only(&identity)?;
    Ok(json(StatusCode::OK, json!({ "all_nodes": [NODE_NAME], "cluster_nodes": [NODE_NAME] })))
}
