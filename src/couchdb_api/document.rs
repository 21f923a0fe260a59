//! Single documents: `GET/HEAD/PUT/DELETE /{db}/{docid}`, `POST /{db}`, and `_local/` documents.
//!
//! Writes are conditional on `_rev` exactly as CouchDB's: the revision comes from the body's
//! `_rev`, `?rev=` or `If-Match` (they must agree), a write without one creates, and a stale one is
//! 409 `conflict`. Reads give the current revision; an older revision is `missing`, since each
//! backend keeps only a document's winning revision and its ancestry (CouchDB's `_revs_limit`
//! worth of ids), not old bodies; with `?latest=true` an ancestor is answered by the current
//! revision, as CouchDB answers with its branch's leaf. `?revs=true` adds `_revisions`; `?open_revs=` answers a JSON
//! array as PouchDB's replicator reads it.

use std::collections::HashMap;

use axum::body::Body;
use axum::extract::{Extension, Path, Query, RawQuery, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
use serde_json::{json, Map, Value};

use super::access::Principal;
use super::data_document::{self, id_kind, parse_rev, IdKind, IncomingDocument};
use super::design;
use super::error::{CouchError, CouchResult};
use super::request::{bool_param, json_param, require_json_content_type};
use super::response::{etag, not_modified};
use super::{json, Answer, CouchState};
use crate::backend::{Precondition, ReplicatedOutcome, ReplicatedRevision, Revision, RevisionInfo, StoredDocument};

type Params = Query<HashMap<String, String>>;

/// `GET /{db}/{docid}` (and HEAD).
pub async fn get_document(
    State(state): State<CouchState>,
    Extension(principal): Extension<Principal>,
    Path((db, docid)): Path<(String, String)>,
    Query(params): Params,
    method: Method,
    RawQuery(raw_query): RawQuery,
    headers: HeaderMap,
) -> Answer {
    state.check_db(&db)?;
    match id_kind(&docid)? {
        IdKind::Data => {}
        IdKind::Local(name) => return local_get(&state, &principal, name).await,
        IdKind::Design => {
            let path = design::path_of_id(&docid);
            return design::run(&state, &principal, method, path, raw_query.as_deref(), &headers, Body::empty()).await;
        }
    }
    principal.check_id(&docid)?;
    let backend = state.store.backend();
    let revs = bool_param("revs", params.get("revs").map(String::as_str), false)?;
    if let Some(open_revs) = params.get("open_revs") {
        let latest = bool_param("latest", params.get("latest").map(String::as_str), false)?;
        let body = open_revs_answer(&state, &docid, open_revs, revs, latest).await?;
        return Ok(json(StatusCode::OK, body));
    }
    let wanted_rev = params.get("rev").map(|r| parse_rev(r)).transpose()?;
    let current = backend.get(&docid).await?;
    let doc = match (current, wanted_rev) {
        // The ancestry only when asked: `then_some` would read it (a second backend request) for
        // every GET.
        (Some(doc), None) => {
            doc_json(&doc, if revs { Some(revision_info(&state, &docid).await?) } else { None }.as_ref())
        }
        (Some(doc), Some(rev)) if doc.rev == rev => {
            doc_json(&doc, if revs { Some(revision_info(&state, &docid).await?) } else { None }.as_ref())
        }
        (_, wanted) => return missing_or_tombstone(&state, &docid, wanted.as_ref(), revs).await,
    };
    let rev = doc.get("_rev").and_then(Value::as_str).unwrap_or_default().to_owned();
    if not_modified(&headers, &rev) {
        let mut response = StatusCode::NOT_MODIFIED.into_response();
        response.headers_mut().insert(header::ETAG, etag(&rev));
        return Ok(response);
    }
    let mut response = json(StatusCode::OK, doc);
    response.headers_mut().insert(header::ETAG, etag(&rev));
    Ok(response)
}

/// The answer for a document that is not live at the asked revision: the tombstone when its
/// revision is asked for (replicators fetch deletions so), else CouchDB's 404 `missing` or
/// `deleted`.
async fn missing_or_tombstone(state: &CouchState, id: &str, wanted: Option<&Revision>, revs: bool) -> Answer {
    let info = state.store.backend().revisions(id).await?;
    match (info, wanted) {
        (Some(info), Some(rev)) if info.deleted && &info.rev == rev => {
            let mut response = json(StatusCode::OK, tombstone_json(id, &info, revs));
            response.headers_mut().insert(header::ETAG, etag(info.rev.as_str()));
            Ok(response)
        }
        (Some(info), None) if info.deleted => Err(CouchError::not_found("deleted")),
        _ => Err(CouchError::not_found("missing")),
    }
}

/// The document as CouchDB returns it, with `_revisions` when asked.
pub(crate) fn doc_json(doc: &StoredDocument, info: Option<&RevisionInfo>) -> Value {
    let mut value = doc.to_json();
    if let (Some(info), Value::Object(map)) = (info, &mut value) {
        map.insert("_revisions".into(), revisions_json(info));
    }
    value
}

/// A deleted document: `{_id, _rev, _deleted: true}`, with `_revisions` when asked.
pub(crate) fn tombstone_json(id: &str, info: &RevisionInfo, revs: bool) -> Value {
    let mut doc = Map::new();
    doc.insert("_id".into(), id.into());
    doc.insert("_rev".into(), info.rev.as_str().into());
    doc.insert("_deleted".into(), true.into());
    if revs {
        doc.insert("_revisions".into(), revisions_json(info));
    }
    Value::Object(doc)
}

fn revisions_json(info: &RevisionInfo) -> Value {
    json!({ "start": info.ancestry.start, "ids": info.ancestry.ids })
}

async fn revision_info(state: &CouchState, id: &str) -> CouchResult<RevisionInfo> {
    state.store.backend().revisions(id).await?.ok_or_else(|| CouchError::not_found("missing"))
}

/// `?open_revs=all` or `?open_revs=["rev",…]`: a JSON array with `{"ok": doc}` for each revision
/// held (the current one, live or deleted) and `{"missing": rev}` for the others.
async fn open_revs_answer(
    state: &CouchState,
    id: &str,
    open_revs: &str,
    revs: bool,
    latest: bool,
) -> CouchResult<Value> {
    let info = state.store.backend().revisions(id).await?;
    let wanted: Option<Vec<String>> = if open_revs == "all" {
        None
    } else {
        match json_param("open_revs", Some(open_revs))? {
            Some(Value::Array(items)) => Some(
                items
                    .into_iter()
                    .map(|item| match item {
                        Value::String(rev) => Ok(rev),
                        _ => Err(CouchError::bad_request("open_revs must be an array of revision strings")),
                    })
                    .collect::<CouchResult<_>>()?,
            ),
            _ => return Err(CouchError::bad_request("open_revs must be `all` or a JSON array of revisions")),
        }
    };
    let current = match &info {
        Some(info) if info.deleted => Some(tombstone_json(id, info, revs)),
        Some(info) => match state.store.backend().get(id).await? {
            Some(doc) if doc.rev == info.rev => Some(doc_json(&doc, revs.then_some(info))),
            // Changed between the two reads: the newer state is answered by the next request.
            _ => None,
        },
        None => None,
    };
    let current_rev = info.as_ref().map(|i| i.rev.as_str().to_owned());
    let answer: Vec<Value> = match wanted {
        None => current.into_iter().map(|doc| json!({ "ok": doc })).collect(),
        Some(wanted) => wanted
            .into_iter()
            .map(|rev| {
                // With `latest`, an ancestor of the current revision is answered by the current one.
                let leads_here =
                    latest && info.as_ref().is_some_and(|i| i.ancestry.revisions().any(|known| known.0 == rev));
                match (&current, &current_rev) {
                    (Some(doc), Some(current_rev)) if *current_rev == rev || leads_here => json!({ "ok": doc }),
                    _ => json!({ "missing": rev }),
                }
            })
            .collect(),
    };
    Ok(Value::Array(answer))
}

/// The revision a write names: body `_rev`, `?rev=` and `If-Match` must agree.
fn write_revision(
    body_rev: Option<&str>,
    params: &HashMap<String, String>,
    headers: &HeaderMap,
) -> CouchResult<Option<Revision>> {
    let query_rev = params.get("rev").map(String::as_str);
    let header_rev = headers.get(header::IF_MATCH).and_then(|v| v.to_str().ok()).map(|v| v.trim().trim_matches('"'));
    let mut chosen: Option<&str> = None;
    for rev in [body_rev, query_rev, header_rev].into_iter().flatten() {
        match chosen {
            Some(previous) if previous != rev => {
                return Err(CouchError::bad_request(
                    "Document rev from request body and query string have different values",
                ))
            }
            _ => chosen = Some(rev),
        }
    }
    chosen.map(parse_rev).transpose()
}

/// `PUT /{db}/{docid}`.
pub async fn put_document(
    State(state): State<CouchState>,
    Extension(principal): Extension<Principal>,
    Path((db, docid)): Path<(String, String)>,
    Query(params): Params,
    RawQuery(raw_query): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    state.check_db(&db)?;
    match id_kind(&docid)? {
        IdKind::Data => {}
        IdKind::Local(name) => return local_put(&state, &principal, name, &params, &headers, body).await,
        IdKind::Design => {
            let path = design::path_of_id(&docid);
            return design::run(&state, &principal, Method::PUT, path, raw_query.as_deref(), &headers, body).await;
        }
    }
    let doc = state.bodies.read_object(&headers, body).await?;
    let incoming = data_document::parse(doc.value, Some(&docid), &principal, &state.store.options().limits)?;
    if !bool_param("new_edits", params.get("new_edits").map(String::as_str), true)? {
        let rev =
            incoming.rev.clone().ok_or_else(|| CouchError::bad_request("new_edits=false needs the document's _rev"))?;
        replicate(&state, incoming).await?;
        return Ok(written(&state, StatusCode::CREATED, &docid, &rev));
    }
    let rev = write_revision(incoming.rev.as_deref(), &params, &headers)?;
    let new_rev = write(&state, incoming, rev).await?;
    Ok(written(&state, StatusCode::CREATED, &docid, new_rev.as_str()))
}

/// `POST /{db}`: creates a document; its id is `_id` or derived from its identity fields.
pub async fn post_document(
    State(state): State<CouchState>,
    Extension(principal): Extension<Principal>,
    Path(db): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    state.check_db(&db)?;
    require_json_content_type(&headers)?;
    let doc = state.bodies.read_object(&headers, body).await?;
    let incoming = data_document::parse(doc.value, None, &principal, &state.store.options().limits)?;
    let id = incoming.id.as_str().to_owned();
    let rev = incoming.rev.as_deref().map(parse_rev).transpose()?;
    let new_rev = write(&state, incoming, rev).await?;
    Ok(written(&state, StatusCode::CREATED, &id, new_rev.as_str()))
}

/// Applies one ordinary write (`new_edits` true): an update when `rev` is given, else a create;
/// `_deleted: true` deletes.
pub(crate) async fn write(
    state: &CouchState,
    incoming: IncomingDocument,
    rev: Option<Revision>,
) -> CouchResult<Revision> {
    if incoming.deleted {
        let rev = rev.ok_or_else(CouchError::conflict)?;
        return delete_at(state, incoming.id.as_str(), &rev).await;
    }
    let precondition = match rev {
        Some(rev) => Precondition::MatchRevision(rev),
        None => Precondition::MustNotExist,
    };
    Ok(state.store.put_document(&incoming.id, &incoming.body, precondition).await?)
}

/// Deletes at `rev`; a document already gone is a conflict, as CouchDB answers a stale rev.
pub(crate) async fn delete_at(state: &CouchState, id: &str, rev: &Revision) -> CouchResult<Revision> {
    match state.store.backend().delete(id, rev).await {
        Ok(tombstone) => Ok(tombstone),
        Err(err) if err.is_not_found() => Err(CouchError::conflict()),
        Err(err) => Err(err.into()),
    }
}

/// Applies one `new_edits: false` write (a replicator's): the revision and its history as sent.
pub(crate) async fn replicate(state: &CouchState, incoming: IncomingDocument) -> CouchResult<ReplicatedOutcome> {
    let rev = incoming.rev.as_deref().ok_or_else(|| CouchError::bad_request("a replicated document needs _rev"))?;
    let rev = parse_rev(rev)?;
    let ancestry = ancestry_of(&rev, incoming.revisions.as_ref())?;
    let replicated = ReplicatedRevision { rev, ancestry, deleted: incoming.deleted, body: incoming.body };
    Ok(state.store.put_replicated(&incoming.id, &replicated).await?)
}

/// The full revision ids of `_revisions` (`{start, ids}`), newest first; without it, the
/// revision alone.
fn ancestry_of(rev: &Revision, revisions: Option<&Value>) -> CouchResult<Vec<String>> {
    let Some(revisions) = revisions else { return Ok(vec![rev.as_str().to_owned()]) };
    let bad = || CouchError::bad_request("_revisions must be {\"start\": N, \"ids\": [\"…\"]} and match _rev");
    let start = revisions.get("start").and_then(Value::as_u64).ok_or_else(bad)?;
    let ids = revisions.get("ids").and_then(Value::as_array).ok_or_else(bad)?;
    let mut ancestry = Vec::with_capacity(ids.len());
    for (i, id) in ids.iter().enumerate() {
        let id = id.as_str().ok_or_else(bad)?;
        let generation = start.checked_sub(i as u64).filter(|g| *g >= 1).ok_or_else(bad)?;
        ancestry.push(format!("{generation}-{id}"));
    }
    if ancestry.first().map(String::as_str) != Some(rev.as_str()) {
        return Err(bad());
    }
    Ok(ancestry)
}

/// CouchDB's answer to a write: `{"ok": true, "id", "rev"}` with `ETag` and `Location`.
fn written(state: &CouchState, status: StatusCode, id: &str, rev: &str) -> Response {
    let mut response = json(status, json!({ "ok": true, "id": id, "rev": rev }));
    let headers = response.headers_mut();
    headers.insert(header::ETAG, etag(rev));
    let location =
        format!("/{}/{}", utf8_percent_encode(&state.db, NON_ALPHANUMERIC), utf8_percent_encode(id, NON_ALPHANUMERIC));
    if let Ok(location) = HeaderValue::from_str(&location) {
        headers.insert(header::LOCATION, location);
    }
    response
}

/// `DELETE /{db}/{docid}?rev=` (or `If-Match`).
pub async fn delete_document(
    State(state): State<CouchState>,
    Extension(principal): Extension<Principal>,
    Path((db, docid)): Path<(String, String)>,
    Query(params): Params,
    RawQuery(raw_query): RawQuery,
    headers: HeaderMap,
) -> Answer {
    state.check_db(&db)?;
    match id_kind(&docid)? {
        IdKind::Data => {}
        IdKind::Local(name) => return local_delete(&state, &principal, name, &params, &headers).await,
        IdKind::Design => {
            let path = design::path_of_id(&docid);
            let (method, query) = (Method::DELETE, raw_query.as_deref());
            return design::run(&state, &principal, method, path, query, &headers, Body::empty()).await;
        }
    }
    principal.check_id(&docid)?;
    let rev = write_revision(None, &params, &headers)?.ok_or_else(CouchError::conflict)?;
    let tombstone = delete_at(&state, &docid, &rev).await?;
    Ok(written(&state, StatusCode::OK, &docid, tombstone.as_str()))
}

/// `GET /{db}/_local/{name}`.
pub async fn get_local(
    State(state): State<CouchState>,
    Extension(principal): Extension<Principal>,
    Path((db, name)): Path<(String, String)>,
) -> Answer {
    state.check_db(&db)?;
    local_get(&state, &principal, &name).await
}

/// `PUT /{db}/_local/{name}`.
pub async fn put_local(
    State(state): State<CouchState>,
    Extension(principal): Extension<Principal>,
    Path((db, name)): Path<(String, String)>,
    Query(params): Params,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    state.check_db(&db)?;
    local_put(&state, &principal, &name, &params, &headers, body).await
}

/// `DELETE /{db}/_local/{name}?rev=`.
pub async fn delete_local(
    State(state): State<CouchState>,
    Extension(principal): Extension<Principal>,
    Path((db, name)): Path<(String, String)>,
    Query(params): Params,
    headers: HeaderMap,
) -> Answer {
    state.check_db(&db)?;
    local_delete(&state, &principal, &name, &params, &headers).await
}

async fn local_get(state: &CouchState, principal: &Principal, name: &str) -> Answer {
    check_local_name(name)?;
    let doc = state
        .store
        .backend()
        .get_local(&principal.local_name(name))
        .await?
        .ok_or_else(|| CouchError::not_found("missing"))?;
    let mut body = doc.body;
    body.insert("_id".into(), format!("_local/{name}").into());
    body.insert("_rev".into(), doc.rev.as_str().into());
    Ok(json(StatusCode::OK, Value::Object(body)))
}

async fn local_put(
    state: &CouchState,
    principal: &Principal,
    name: &str,
    params: &HashMap<String, String>,
    headers: &HeaderMap,
    body: Body,
) -> Answer {
    check_local_name(name)?;
    let doc = state.bodies.read_object(headers, body).await?;
    let Value::Object(mut body) = doc.value else {
        return Err(CouchError::bad_request("Document must be a JSON object"));
    };
    body.remove("_id");
    let body_rev = match body.remove("_rev") {
        Some(Value::String(rev)) => Some(rev),
        _ => None,
    };
    if body.remove("_deleted") == Some(Value::Bool(true)) {
        let rev = write_revision(body_rev.as_deref(), params, headers)?.ok_or_else(CouchError::conflict)?;
        state.store.backend().delete_local(&principal.local_name(name), &rev).await.map_err(local_conflict)?;
        return Ok(json(StatusCode::OK, json!({ "ok": true, "id": format!("_local/{name}"), "rev": "0-0" })));
    }
    let precondition = match write_revision(body_rev.as_deref(), params, headers)? {
        Some(rev) => Precondition::MatchRevision(rev),
        None => Precondition::MustNotExist,
    };
    let rev = state
        .store
        .backend()
        .put_local(&principal.local_name(name), &body, precondition)
        .await
        .map_err(local_conflict)?;
    Ok(json(StatusCode::CREATED, json!({ "ok": true, "id": format!("_local/{name}"), "rev": rev.as_str() })))
}

async fn local_delete(
    state: &CouchState,
    principal: &Principal,
    name: &str,
    params: &HashMap<String, String>,
    headers: &HeaderMap,
) -> Answer {
    check_local_name(name)?;
    let rev = write_revision(None, params, headers)?.ok_or_else(CouchError::conflict)?;
    state.store.backend().delete_local(&principal.local_name(name), &rev).await.map_err(local_conflict)?;
    Ok(json(StatusCode::OK, json!({ "ok": true, "id": format!("_local/{name}"), "rev": "0-0" })))
}

fn check_local_name(name: &str) -> CouchResult<()> {
    if name.is_empty() {
        return Err(CouchError::bad_request("a _local document needs a name"));
    }
    Ok(())
}

/// A missing local document on delete is a conflict, as a stale revision is.
fn local_conflict(err: crate::Error) -> CouchError {
    if err.is_not_found() {
        CouchError::conflict()
    } else {
        err.into()
    }
}

/// `/{db}/{docid}/{attachment}`: attachments are not kept.
pub async fn attachment(
    State(state): State<CouchState>,
    Path((db, _docid, _name)): Path<(String, String, String)>,
) -> Answer {
    state.check_db(&db)?;
    Err(CouchError::not_supported("attachments"))
}
