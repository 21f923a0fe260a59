//! Databases themselves: `PUT`/`GET`/`HEAD`/`DELETE /{db}`, `GET /_all_dbs`,
//! `GET`/`POST /_dbs_info`, `_revs_limit`, `_purged_infos_limit`, `_security`, and the
//! maintenance endpoints that have nothing to do here (`_compact`, `_view_cleanup`,
//! `_ensure_full_commit`), answered as CouchDB answers them, with CouchDB's checks: server
//! admins create and delete databases, read `_dbs_info` and read and change
//! `_purged_infos_limit`; a database's admins change its `_security` and `_revs_limit` and
//! compact it; its members read the rest. On the data-store database an admin has a server
//! admin's rights and a per-user login a member's, but never compacts it or changes its settings
//! ([`super::OpenDb::check_database_wide`]).

use std::collections::HashMap;

use axum::body::Body;
use axum::extract::{Extension, FromRequestParts, Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use super::info::{data_store_info, data_store_info_seen_by, db_info_json, live_document_count};
use super::{db_name, OpenDb};
use crate::couchdb_api::auth::Identity;
use crate::couchdb_api::error::CouchError;
use crate::couchdb_api::request::{bool_param, integer_param, json_param};
use crate::couchdb_api::root::server_admin_only;
use crate::couchdb_api::{json, Answer, CouchState};
use crate::database::Database;
use crate::error::ErrorKind;

/// `PUT /{db}`: 201 `{"ok":true}`; 412 `file_exists` when it exists. A server admin's, as in
/// CouchDB (401 for anyone else, whatever the name). The data-store database is never created
/// through the API: it exists (412, which PouchDB and aiocouch take as "create if missing"). A
/// name starting with `_` reaches here only from the server's router: CouchDB's name rule
/// refuses it (400 `illegal_database_name`) unless it names one of CouchDB's system databases,
/// which are not kept here (403).
pub async fn create_db(
    State(state): State<CouchState>,
    Extension(identity): Extension<Identity>,
    Path(db): Path<String>,
) -> Answer {
    server_admin_only(&identity)?;
    if *db == *state.db {
        return Err(database_exists());
    }
    let kept = crate::backend::catalog::SYSTEM_DATABASES.contains(&db.as_str());
    if SYSTEM_DATABASES.contains(&db.as_str()) && !kept {
        return Err(CouchError::forbidden(format!("agentstore does not keep CouchDB's system database {db}")));
    }
    let name = db_name(&db)?;
    match state.databases.create(&name).await {
        Ok(created) => {
            // The events name every database: `_global_changes` is for server admins only, as
            // `_users` is (CouchDB 3.4.3 makes every new database so by default).
            if db == crate::database::activity::GLOBAL_CHANGES_DB && !created.backend().forwards_requests() {
                created
                    .update_settings(|settings| settings.security = crate::database::users::admin_only_security())
                    .await?;
            }
            let mut response = json(StatusCode::CREATED, json!({ "ok": true }));
            if let Ok(location) = HeaderValue::from_str(&format!("/{db}")) {
                response.headers_mut().insert(header::LOCATION, location);
            }
            Ok(response)
        }
        Err(err) if err.kind() == ErrorKind::Conflict => Err(database_exists()),
        Err(err) => Err(err.into()),
    }
}

/// CouchDB's system databases, the only names starting with `_` it takes.
const SYSTEM_DATABASES: [&str; 3] = ["_users", "_replicator", "_global_changes"];

/// CouchDB's 412 for creating a database that exists.
fn database_exists() -> CouchError {
    CouchError::new(
        StatusCode::PRECONDITION_FAILED,
        "file_exists",
        "The database could not be created, the file already exists.",
    )
}

/// `DELETE /{db}`: everything of it removed from the backend. A server admin's, as in CouchDB
/// (401 for anyone else); the data-store database is never deleted through the API (403).
pub async fn delete_db(
    State(state): State<CouchState>,
    Extension(identity): Extension<Identity>,
    Path(db): Path<String>,
) -> Answer {
    server_admin_only(&identity)?;
    if *db == *state.db {
        return Err(CouchError::forbidden("agentstore does not delete its database through the CouchDB API"));
    }
    let name = db_name(&db)?;
    if state.databases.delete(&name).await? {
        // The views' state of a deleted database is never read again: dropped, so it does not
        // pile up as databases come and go. The database is gone whatever this answers.
        if let Err(err) = state.views.forget_database(name.as_str()).await {
            tracing::warn!(database = %name, %err, "kept the view state of a deleted database");
        }
        Ok(json(StatusCode::OK, json!({ "ok": true })))
    } else {
        Err(CouchError::no_database())
    }
}

/// `GET /{db}`: counts and the feed position. The data-store database answers as it always has
/// ([`data_store_info_seen_by`]): its `update_seq` is the store's own token, as its `_changes`
/// shows positions, and a per-user login sees neither the other users' count nor an unsealed
/// position.
pub async fn db_info(State(state): State<CouchState>, opened: OpenDb) -> Answer {
    let info = if state.is_data_store(&opened.db) {
        data_store_info_seen_by(&state, &opened.confinement).await?
    } else {
        info_of(&opened.db).await?
    };
    Ok(json(StatusCode::OK, info))
}

async fn info_of(db: &Database) -> crate::Result<Value> {
    let backend = db.backend();
    let doc_count = db.while_open(live_document_count(backend.as_ref())).await?;
    let (update_seq, length) =
        db.while_open(crate::database::seq::current_and_length(backend.as_ref(), db.erased_doc())).await?;
    let mut info = db_info_json(db.name(), doc_count, &update_seq);
    // Where the feed is counted (one entry per document, live or deleted), the deleted ones are
    // what it holds beyond the live: `update_seq`'s `N` at rest is `doc_count + doc_del_count`.
    if let Some(length) = length {
        info["doc_del_count"] = Value::from(length.saturating_sub(doc_count));
    }
    Ok(info)
}

/// Every database's name: the data-store one and the backend's others, in byte order.
async fn every_name(state: &CouchState) -> crate::Result<Vec<String>> {
    let mut names: Vec<String> = state.databases.list().await?.into_iter().map(|n| n.to_string()).collect();
    names.push(state.db.to_string());
    names.sort();
    names.dedup();
    Ok(names)
}

/// `GET /_all_dbs` with `startkey`/`endkey` (JSON strings), `limit`, `skip`, `descending`,
/// `inclusive_end`.
///
/// Server admins only, as CouchDB 3 answers it by default (`[chttpd] admin_only_all_dbs = true`):
/// the names of every database are not for every login to read.
pub async fn all_dbs(
    State(state): State<CouchState>,
    Extension(identity): Extension<Identity>,
    Query(params): Query<HashMap<String, String>>,
) -> Answer {
    server_admin_only(&identity)?;
    Ok(json(StatusCode::OK, json!(selected_names(&state, &params).await?)))
}

/// The names `GET /_all_dbs` and `GET /_dbs_info` answer, selected by their parameters.
async fn selected_names(state: &CouchState, params: &HashMap<String, String>) -> Result<Vec<String>, CouchError> {
    let param = |name: &str| params.get(name).map(String::as_str);
    let key = |names: [&str; 2]| -> Result<Option<String>, CouchError> {
        for name in names {
            match json_param(name, param(name))? {
                None => {}
                Some(Value::String(text)) => return Ok(Some(text)),
                Some(_) => return Err(CouchError::bad_request(format!("{name} must be a JSON string"))),
            }
        }
        Ok(None)
    };
    let descending = bool_param("descending", param("descending"), false)?;
    let inclusive_end = bool_param("inclusive_end", param("inclusive_end"), true)?;
    let start = key(["startkey", "start_key"])?;
    let end = key(["endkey", "end_key"])?;
    let skip = integer_param("skip", param("skip"))?.unwrap_or(0);
    let limit = integer_param("limit", param("limit"))?;
    let mut names = every_name(state).await?;
    if descending {
        names.reverse();
    }
    Ok(names
        .into_iter()
        .filter(|name| match &start {
            None => true,
            Some(start) if descending => name <= start,
            Some(start) => name >= start,
        })
        .filter(|name| match &end {
            None => true,
            Some(end) if descending => name > end || (inclusive_end && name == end),
            Some(end) => name < end || (inclusive_end && name == end),
        })
        .skip(usize::try_from(skip).unwrap_or(usize::MAX))
        .take(limit.map_or(usize::MAX, |l| usize::try_from(l).unwrap_or(usize::MAX)))
        .collect())
}

/// `GET /_dbs_info` with `_all_dbs`' parameters: the info of each database they select, as
/// `POST` answers it; one deleted since the listing is left out, as CouchDB leaves it out. At
/// most `couchdb_max_dbs_info_keys` databases (CouchDB answers any number): a larger selection
/// is 400 naming the setting, and `limit`/`startkey` page through them. Server admins only.
pub async fn get_dbs_info(
    State(state): State<CouchState>,
    Extension(identity): Extension<Identity>,
    Query(params): Query<HashMap<String, String>>,
) -> Answer {
    server_admin_only(&identity)?;
    let names = selected_names(&state, &params).await?;
    if names.len() > state.max_dbs_info_keys {
        return Err(CouchError::bad_request(format!(
            "GET /_dbs_info would answer {} databases, more than {} (couchdb_max_dbs_info_keys); page with limit \
             and startkey",
            names.len(),
            state.max_dbs_info_keys
        )));
    }
    let mut answer = Vec::with_capacity(names.len());
    for name in names {
        if let Some(info) = info_named(&state, &name).await? {
            answer.push(json!({ "key": name, "info": info }));
        }
    }
    Ok(json(StatusCode::OK, Value::Array(answer)))
}

/// `POST /_dbs_info` `{"keys": [...]}`: each database's info, or `{"error": "not_found"}`.
pub async fn dbs_info(
    State(state): State<CouchState>,
    Extension(identity): Extension<Identity>,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    server_admin_only(&identity)?;
    let request = state.bodies.read_object(&headers, body).await?;
    let Some(Value::Array(keys)) = request.value.get("keys") else {
        return Err(CouchError::bad_request("`keys` member must exist."));
    };
    if keys.len() > state.max_dbs_info_keys {
        return Err(CouchError::bad_request(format!(
            "`keys` member must not exceed {} names (couchdb_max_dbs_info_keys)",
            state.max_dbs_info_keys
        )));
    }
    let mut answer = Vec::with_capacity(keys.len());
    for key in keys {
        let info = match key.as_str() {
            Some(name) => info_named(&state, name).await?,
            None => None,
        };
        answer.push(match info {
            Some(info) => json!({ "key": key, "info": info }),
            None => json!({ "key": key, "error": "not_found" }),
        });
    }
    Ok(json(StatusCode::OK, Value::Array(answer)))
}

/// The info of the database `name` as `GET /{db}` shows it to a server admin; `None` when there
/// is no such database (or it was deleted while it was read).
async fn info_named(state: &CouchState, name: &str) -> crate::Result<Option<Value>> {
    if name == &*state.db {
        return Ok(Some(data_store_info(state).await?));
    }
    let Ok(name) = db_name(name) else { return Ok(None) };
    let Some(db) = state.databases.open(&name).await? else { return Ok(None) };
    match info_of(&db).await {
        Ok(info) => Ok(Some(info)),
        Err(err) if err.kind() == ErrorKind::NotFound => Ok(None),
        Err(err) => Err(err),
    }
}

/// `GET /{db}/_revs_limit`.
pub async fn get_revs_limit(opened: OpenDb) -> Answer {
    Ok(json(StatusCode::OK, json!(opened.db.revs_limit().await?)))
}

/// `PUT /{db}/_revs_limit` with a positive integer body; database admins only.
pub async fn put_revs_limit(State(state): State<CouchState>, opened: OpenDb, headers: HeaderMap, body: Body) -> Answer {
    opened.check_database_wide("change its _revs_limit")?;
    opened.access.require_db_admin()?;
    let value = state.bodies.read_json(&headers, body).await?.map(|b| b.value);
    let limit = match value.as_ref().and_then(Value::as_u64) {
        Some(limit) if limit > 0 => usize::try_from(limit).unwrap_or(usize::MAX),
        _ => return Err(CouchError::bad_request("The revs limit must be a positive integer")),
    };
    opened.db.update_settings(|settings| settings.revs_limit = limit).await?;
    Ok(json(StatusCode::OK, json!({ "ok": true })))
}

/// `GET/HEAD/PUT /{db}/_purged_infos_limit`, as CouchDB 3.4.3 answers it: for server admins
/// only, checked before the database is opened (401 to anyone else, on a database that does not
/// exist too); `GET` the number (1000 on a new database), `PUT` a positive integer, 405 for any
/// other method. On the data-store database an admin has a server admin's rights and a per-user
/// login a member's (401 reading it, 403 naming why changing it). What the number means here,
/// where no purge history is kept: [`crate::database::engine::DbSettings::purged_infos_limit`].
pub async fn purged_infos_limit(
    State(state): State<CouchState>,
    Extension(identity): Extension<Identity>,
    Path(db): Path<String>,
    request: axum::extract::Request,
) -> Response {
    // The data-store database's logins are admitted by its own rules ([`OpenDb`]).
    if db != *state.db {
        if let Err(refused) = server_admin_only(&identity) {
            return refused.into_response();
        }
    }
    let (mut parts, body) = request.into_parts();
    let opened = match OpenDb::from_request_parts(&mut parts, &state).await {
        Ok(opened) => opened,
        Err(refusal) => return refusal,
    };
    let answer = match parts.method {
        Method::GET | Method::HEAD => read_purged_infos_limit(&opened).await,
        Method::PUT => put_purged_infos_limit(&state, &opened, &parts.headers, body).await,
        _ => Ok(only_get_and_put()),
    };
    answer.unwrap_or_else(IntoResponse::into_response)
}

async fn read_purged_infos_limit(opened: &OpenDb) -> Answer {
    opened.access.require_server_admin()?;
    Ok(json(StatusCode::OK, json!(opened.db.settings().await?.purged_infos_limit)))
}

async fn put_purged_infos_limit(state: &CouchState, opened: &OpenDb, headers: &HeaderMap, body: Body) -> Answer {
    opened.check_database_wide("change its _purged_infos_limit")?;
    opened.access.require_server_admin()?;
    // An empty body is not JSON to CouchDB either.
    let Some(body) = state.bodies.read_json(headers, body).await? else {
        return Err(CouchError::bad_request("invalid UTF-8 JSON"));
    };
    let limit = positive_purged_infos_limit(&body.value)?;
    opened.db.update_settings(|settings| settings.purged_infos_limit = limit).await?;
    Ok(json(StatusCode::OK, json!({ "ok": true })))
}

/// A `_purged_infos_limit` body: a JSON integer above 0. CouchDB takes any such integer; the
/// largest kept here is `u64::MAX` (docs/bounds.md), a larger one is refused naming it.
fn positive_purged_infos_limit(value: &Value) -> Result<u64, CouchError> {
    if let Some(limit) = value.as_u64().filter(|limit| *limit > 0) {
        return Ok(limit);
    }
    // An integer past `u64::MAX` is parsed as a float (serde_json's fallback for it).
    if value.as_f64().is_some_and(|n| n >= u64::MAX as f64 && n.fract() == 0.0) {
        return Err(CouchError::bad_request(format!("`purged_infos_limit` must be at most {} here", u64::MAX)));
    }
    Err(CouchError::bad_request("`purged_infos_limit` must be positive integer"))
}

/// CouchDB's 405 for `_purged_infos_limit`, with its `Allow`.
fn only_get_and_put() -> Response {
    let mut refused =
        CouchError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "Only GET,PUT allowed").into_response();
    refused.headers_mut().insert(header::ALLOW, HeaderValue::from_static("GET,PUT"));
    refused
}

/// `GET /{db}/_security`: members may read it, as in CouchDB.
pub async fn get_security(opened: OpenDb) -> Answer {
    let users_db = crate::database::users::is_users_db(opened.db.name()) && !opened.db.backend().forwards_requests();
    let security =
        if users_db { crate::database::users::admin_only_security() } else { opened.db.settings().await?.security };
    Ok(json(StatusCode::OK, security))
}

/// `PUT /{db}/_security`: `admins` and `members`, each `{names, roles}` of strings; database
/// admins only.
pub async fn put_security(State(state): State<CouchState>, opened: OpenDb, headers: HeaderMap, body: Body) -> Answer {
    opened.check_database_wide("change its _security")?;
    opened.access.require_db_admin()?;
    // CouchDB's `users_db_security_editable = false`: `_users` stays admin only.
    if crate::database::users::is_users_db(opened.db.name()) {
        return Err(CouchError::forbidden("You can't edit the security object of the user database."));
    }
    let security = state.bodies.read_object(&headers, body).await?.value;
    for group in ["admins", "members"] {
        let Some(value) = security.get(group) else { continue };
        for list in ["names", "roles"] {
            match value.get(list) {
                None => {}
                Some(Value::Array(items)) if items.iter().all(Value::is_string) => {}
                Some(_) => return Err(CouchError::bad_request(format!("{group}.{list} must be an array of strings"))),
            }
        }
    }
    opened.db.update_settings(|settings| settings.security = security.clone()).await?;
    Ok(json(StatusCode::OK, json!({ "ok": true })))
}

/// `POST /{db}/_compact`, `_compact/{ddoc}`, `_view_cleanup`: `_compact` of the database drops
/// the bodies inner revisions kept ([`crate::database::Database::compact`]) and frees the
/// attachment bytes no kept body references any more (past the grace period,
/// `couchdb_attachment_grace_secs`), before it answers, so a client that waits for the answer
/// sees the storage freed.
pub async fn compact(
    opened: OpenDb<std::collections::HashMap<String, String>>,
    uri: axum::http::Uri,
    headers: HeaderMap,
) -> Answer {
    opened.check_database_wide("compact it")?;
    opened.access.require_db_admin_to_compact()?;
    crate::couchdb_api::request::require_json_content_type(&headers)?;
    let whole_database = uri.path().trim_end_matches('/').ends_with("/_compact");
    if whole_database {
        let collected = opened.db.compact().await?;
        tracing::debug!(database = opened.db.name(), ?collected, "compaction freed attachment bytes");
    }
    Ok(json(StatusCode::ACCEPTED, json!({ "ok": true })))
}

/// `POST /{db}/_ensure_full_commit`: every acknowledged write is already durable.
pub async fn ensure_full_commit(_opened: OpenDb) -> Answer {
    Ok(json(StatusCode::CREATED, json!({ "ok": true, "instance_start_time": "0" })))
}
