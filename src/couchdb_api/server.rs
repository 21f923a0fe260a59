//! The server root and the data-store database: `GET /`, `/_up`, `/_uuids`, the probes
//! (`_active_tasks`, `_scheduler`, `_membership`, `_node`), and `PUT/DELETE /{db}` of the
//! data-store database (`GET/HEAD` too on the CouchDB backend; on the others the databases'
//! router answers them, with [`data_store_info_seen_by`]). `PUT` of it answers 412 as CouchDB
//! does for a database that exists (PouchDB and aiocouch create-if-missing); `PUT` of a name
//! starting with `_` answers as CouchDB (other names are the databases' router's).

use axum::extract::{Extension, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::auth::Identity;
use super::error::CouchError;
use super::served_db::ServedDb;
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

/// `GET /_up`: the backend answers.
pub async fn up(State(state): State<CouchState>) -> Response {
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

/// `GET /{db}` (and HEAD) on the CouchDB backend (the databases' router answers it on the others):
/// the database's information, with the counts the backend can give. A
/// per-user login is shown `doc_count` 0: the store's count moves with every user's writes, and
/// counting its own documents would read them all (docs/couchdb-api.md, "Counts"), and its
/// `update_seq` sealed ([`super::position_seal`]).
pub async fn db_info(
    State(state): State<CouchState>,
    Extension(principal): Extension<super::access::Principal>,
    _served: ServedDb,
) -> Answer {
    Ok(json(StatusCode::OK, data_store_info_seen_by(&state, &principal.confinement()).await?))
}

/// The data-store database's information as a login confined to `confinement` is shown it
/// (`GET /{db}` through either router): everything for an admin ([`data_store_info`]); for a
/// per-user login `doc_count` 0 and `update_seq` sealed.
pub(crate) async fn data_store_info_seen_by(
    state: &CouchState,
    confinement: &crate::database::data_store_rules::Confinement,
) -> crate::Result<Value> {
    if confinement.only_user().is_none() {
        return data_store_info(state).await;
    }
    let update_seq = state.store.backend().change_position().await?;
    let update_seq = state.auth.sessions.positions().shown_to(confinement, &update_seq)?;
    Ok(db_info_json(&state.db, 0, &update_seq))
}

/// The data-store database's information (`GET /{db}`, `_dbs_info`).
pub(crate) async fn data_store_info(state: &CouchState) -> crate::Result<Value> {
    let backend = state.store.backend();
    // The design documents are records of the data-store database, counted with the others as
    // CouchDB counts them (fixture 051: 41 documents and 2 design documents are `doc_count` 43).
    let doc_count = live_document_count(backend.as_ref()).await?;
    let update_seq = backend.change_position().await?;
    Ok(db_info_json(&state.db, doc_count, &update_seq))
}

/// A database's information in CouchDB 3's shape (`GET /{db}`): the fields every client reads,
/// the sizes and counts this server does not keep as 0.
pub(crate) fn db_info_json(name: &str, doc_count: u64, update_seq: &str) -> Value {
    json!({
        "db_name": name,
        "purge_seq": "0",
        "update_seq": update_seq,
        "sizes": { "file": 0, "external": 0, "active": 0 },
        "props": {},
        "doc_del_count": 0,
        "doc_count": doc_count,
        "disk_format_version": 8,
        "compact_running": false,
        "cluster": { "q": 1, "n": 1, "w": 1, "r": 1 },
        "instance_start_time": "0"
    })
}

/// How many data documents the store holds: exact where the backend counts without reading
/// (its design documents left out, as `_all_docs` leaves them out), else the backend's estimate
/// (DynamoDB's item count, some hours stale), else 0. Clients read it as a number
/// (`doc_count`, `total_rows`), and couchrestore demands 0 of an empty target.
pub async fn live_document_count(backend: &dyn crate::backend::DocumentBackend) -> crate::Result<u64> {
    let count = match backend.exact_count().await? {
        Some(count) => count.saturating_sub(backend.design_document_count().await?.unwrap_or(0)),
        None => backend.approximate_count().await?.unwrap_or(0),
    };
    Ok(count)
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

/// CouchDB's system databases, the only names starting with `_` it takes.
const SYSTEM_DATABASES: [&str; 3] = ["_users", "_replicator", "_global_changes"];

/// `PUT /{db}` for the served database or a name starting with `_` (every other name goes to the
/// databases' router): the served database exists already (412, as CouchDB answers); a name
/// starting with `_` that is no system database breaks CouchDB's name rule (its 400
/// `illegal_database_name`, after its server-admin check); CouchDB's system databases are not
/// kept here.
pub async fn create_db(
    State(state): State<CouchState>,
    Extension(identity): Extension<Identity>,
    Path(db): Path<String>,
) -> Answer {
    if *db == *state.db {
        return Err(CouchError::new(
            StatusCode::PRECONDITION_FAILED,
            "file_exists",
            "The database could not be created, the file already exists.",
        ));
    }
    server_admin_only(&identity)?;
    if !SYSTEM_DATABASES.contains(&db.as_str()) {
        return Err(super::db::db_name(&db)
            .err()
            .unwrap_or_else(|| CouchError::internal(format!("{db:?} starts with `_` yet passed the name rule"))));
    }
    Err(CouchError::forbidden(format!("agentstore does not keep CouchDB's system database {db}")))
}

/// `DELETE /{db}`: refused; the data store is not deleted through the API.
pub async fn delete_db(_served: ServedDb) -> Answer {
    Err(CouchError::forbidden("agentstore does not delete its database through the CouchDB API"))
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

/// The node name the probes below report: one node, this process.
const NODE_NAME: &str = "agentstore@localhost";

/// `GET /_active_tasks`: no compaction, indexing or replication task ever runs here. A server
/// admin's, as CouchDB's (`chttpd_misc:handle_task_status_req`).
pub async fn active_tasks(Extension(identity): Extension<Identity>) -> Answer {
    server_admin_only(&identity)?;
    Ok(json(StatusCode::OK, json!([])))
}

/// `GET /_membership`: a cluster of one node. A server admin's, as CouchDB's (every `/_membership`
/// and `/_node` path is in `chttpd_auth_request:server_authorization_check`'s admin list).
pub async fn membership(Extension(identity): Extension<Identity>) -> Answer {
    server_admin_only(&identity)?;
    Ok(json(StatusCode::OK, json!({ "all_nodes": [NODE_NAME], "cluster_nodes": [NODE_NAME] })))
}

/// `GET /_scheduler/jobs` and `/_scheduler/docs`: no replicator runs inside this server. A server
/// admin's, as every `/_scheduler` path is CouchDB's (`chttpd_auth_request`).
pub async fn scheduler_jobs(Extension(identity): Extension<Identity>) -> Answer {
    server_admin_only(&identity)?;
    Ok(json(StatusCode::OK, json!({ "total_rows": 0, "offset": 0, "jobs": [] })))
}

pub async fn scheduler_docs(Extension(identity): Extension<Identity>) -> Answer {
    server_admin_only(&identity)?;
    Ok(json(StatusCode::OK, json!({ "total_rows": 0, "offset": 0, "docs": [] })))
}

/// `GET /_node/_local` (and `/_node/{name}` for this node's name): the node's name. A server
/// admin's, as `_membership`.
pub async fn node(Extension(identity): Extension<Identity>, Path(node): Path<String>) -> Answer {
    server_admin_only(&identity)?;
    if node != "_local" && node != NODE_NAME {
        return Err(CouchError::not_found(format!("no node named {node}")));
    }
    Ok(json(StatusCode::OK, json!({ "name": NODE_NAME })))
}
