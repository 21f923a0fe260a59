//! Single documents: `GET/HEAD/PUT/DELETE /{db}/{docid}`, `POST /{db}`, and `_local/` documents.
//!
//! Writes are conditional on `_rev` exactly as CouchDB's: the revision comes from the body's
//! `_rev`, `?rev=` or `If-Match` (they must agree), a write without one creates (a deletion without
//! one writes a tombstone where nothing live is), and a stale one is 409 `conflict`; `DELETE` of a
//! missing or deleted document is 404. `_local/` documents are written and deleted without a
//! revision check, as CouchDB 3 keeps them. A plain read gives the winning revision from the
//! record alone; a read that names another leaf or asks for conflicts is answered from the whole
//! revision tree ([`super::branches`]). An inner revision is `missing` (its body is not kept);
//! with `?latest=true` it is answered by its branch's leaf. `?revs=true` adds `_revisions`.

use std::collections::HashMap;

use axum::body::Body;
use axum::extract::{Extension, Query, RawQuery, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
use serde_json::{json, Map, Value};

use super::access::Principal;
use super::branches;
use super::data_document::{self, id_kind, parse_rev, IdKind, IncomingDocument};
use super::design;
use super::error::{CouchError, CouchResult};
use super::request::{bool_param, json_param, require_json_content_type};
use super::response::{etag, not_modified};
use super::served_db::{DocId, LocalName, ServedDb};
use super::{json, Answer, CouchState};
use crate::backend::revision::RevisionId;
use crate::backend::{Precondition, ReplicatedOutcome, ReplicatedRevision, Revision, RevisionInfo, StoredDocument};

type Params = Query<HashMap<String, String>>;

/// `GET /{db}/{docid}` (and HEAD).
pub async fn get_document(
    State(state): State<CouchState>,
    Extension(principal): Extension<Principal>,
    ServedDb(DocId { docid }): ServedDb<DocId>,
    Query(params): Params,
    method: Method,
    RawQuery(raw_query): RawQuery,
    headers: HeaderMap,
) -> Answer {
    match id_kind(&docid)? {
        IdKind::Data => {}
        IdKind::Local(name) => return local_get(&state, &principal, name).await,
        IdKind::Design => {
            let path = design::path_of_id(&docid);
            return design::run(&state, &principal, method, path, raw_query.as_deref(), &headers, Body::empty()).await;
        }
    }
    principal.confinement().check_id(&docid)?;
    let params = super::db::without_empty_open_revs(&params);
    if branches::wants_tree(&params) {
        return branches::read(&state, &docid, &params, &headers).await;
    }
    let backend = state.store.backend();
    let revs = bool_param("revs", params.get("revs").map(String::as_str), false)?;
    let latest = bool_param("latest", params.get("latest").map(String::as_str), false)?;
    if let Some(open_revs) = params.get("open_revs") {
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
        // `latest=true` asks for the leaf of the named revision's branch: the current revision
        // when the named one is in its ancestry (CouchDB 3.4.3 answers 200 with the leaf, as
        // measured in issue 22; `chttpd_db.erl` opens the document with the `latest` option).
        (Some(doc), Some(rev)) if latest => {
            let info = revision_info(&state, &docid).await?;
            if info.rev != doc.rev || !info.ancestry.revisions().any(|known| known == rev) {
                return Err(CouchError::not_found("missing"));
            }
            doc_json(&doc, revs.then_some(&info))
        }
        // Another leaf than the winner (a conflict), or a tombstone.
        (_, Some(_)) => return branches::read(&state, &docid, &params, &headers).await,
        (None, None) => return missing_or_tombstone(&state, &docid, None, revs, latest).await,
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
/// revision is asked for (replicators fetch deletions so), or with `latest` one of its
/// ancestors, else CouchDB's 404 `missing` or `deleted`.
async fn missing_or_tombstone(
    state: &CouchState,
    id: &str,
    wanted: Option<&Revision>,
    revs: bool,
    latest: bool,
) -> Answer {
    let info = state.store.backend().revisions(id).await?;
    let leads_to = |info: &RevisionInfo, rev: &Revision| {
        &info.rev == rev || (latest && info.ancestry.revisions().any(|known| &known == rev))
    };
    match (info, wanted) {
        (Some(info), Some(rev)) if info.deleted && leads_to(&info, rev) => {
            let fields = deletion_fields(state, id, &info).await?;
            let mut response = json(StatusCode::OK, tombstone_json(id, &info, &fields, revs));
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

/// A deleted document: `{_id, _rev, …the fields its deletion carried, _deleted: true}` (CouchDB's
/// order), with `_revisions` when asked.
pub(crate) fn tombstone_json(id: &str, info: &RevisionInfo, fields: &Map<String, Value>, revs: bool) -> Value {
    let mut doc = tombstone_body(id, info.rev.as_str(), fields);
    if revs {
        doc.insert("_revisions".into(), revisions_json(info));
    }
    Value::Object(doc)
}

/// `{_id, _rev, …the fields its deletion carried, _deleted: true}`, CouchDB's tombstone.
pub(crate) fn tombstone_body(id: &str, rev: &str, fields: &Map<String, Value>) -> Map<String, Value> {
    let mut doc = Map::with_capacity(fields.len() + 4);
    doc.insert("_id".into(), id.into());
    doc.insert("_rev".into(), rev.into());
    doc.extend(fields.iter().map(|(name, value)| (name.clone(), value.clone())));
    doc.insert("_deleted".into(), true.into());
    doc
}

/// The fields the deletion at `info.rev` carried, read from the stored tombstone (none when the
/// tombstone moved on since `info` was read: the next read answers the newer one).
pub(crate) async fn deletion_fields(
    state: &CouchState,
    id: &str,
    info: &RevisionInfo,
) -> CouchResult<Map<String, Value>> {
    Ok(match state.store.backend().get_deleted(id).await? {
        Some(tombstone) if tombstone.rev == info.rev => tombstone.body,
        _ => Map::new(),
    })
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
        // CouchDB 3.4.3 answers `open_revs=all` of a document it never held with 404
        // `not_found`/`missing` (measured in issue 22), not an empty list.
        if info.is_none() {
            return Err(CouchError::not_found("missing"));
        }
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
        Some(info) if info.deleted => Some(tombstone_json(id, info, &deletion_fields(state, id, info).await?, revs)),
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
    named_revision(body_rev, params, headers)?.map(parse_rev).transpose()
}

/// The one revision a write names in its body (`_rev`), its query (`?rev=`) and `If-Match`,
/// unparsed; 400 when they disagree (CouchDB's message). Shared by every database's writes.
pub(crate) fn named_revision<'a>(
    body_rev: Option<&'a str>,
    params: &'a HashMap<String, String>,
    headers: &'a HeaderMap,
) -> CouchResult<Option<&'a str>> {
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
    Ok(chosen)
}

/// `PUT /{db}/{docid}`.
pub async fn put_document(
    State(state): State<CouchState>,
    Extension(principal): Extension<Principal>,
    ServedDb(DocId { docid }): ServedDb<DocId>,
    Query(params): Params,
    RawQuery(raw_query): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> Answer {
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
        let status = if incoming.deleted { StatusCode::OK } else { StatusCode::CREATED };
        replicate(&state, incoming).await?;
        return Ok(written(&state, status, &docid, &rev));
    }
    let rev = write_revision(incoming.rev.as_deref(), &params, &headers)?;
    let batch = batch_mode(&params);
    // CouchDB answers a deletion written by PUT with 200, any other write with 201
    // (`chttpd_db.erl`, `update_doc`: `ok` when the document is deleted, else `created`).
    let status = if incoming.deleted { StatusCode::OK } else { StatusCode::CREATED };
    let new_rev = write(&state, incoming, rev).await?;
    if batch {
        return Ok(batch_accepted(&docid));
    }
    Ok(written(&state, status, &docid, new_rev.as_str()))
}

/// Whether the client asked for CouchDB's `?batch=ok`.
fn batch_mode(params: &HashMap<String, String>) -> bool {
    params.get("batch").is_some_and(|mode| mode == "ok")
}

/// CouchDB's answer to a `?batch=ok` write: 202 `{"ok": true, "id"}` without a revision
/// (`chttpd_db.erl`). CouchDB writes such a document later and drops a failure silently; this
/// server has written it already (every write here is durable when answered), and answers a
/// failure as it answers any write's.
fn batch_accepted(id: &str) -> Response {
    json(StatusCode::ACCEPTED, json!({ "ok": true, "id": id }))
}

/// `POST /{db}`: creates a document; its id is `_id` or derived from its identity fields.
pub async fn post_document(
    State(state): State<CouchState>,
    Extension(principal): Extension<Principal>,
    _served: ServedDb,
    Query(params): Params,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    require_json_content_type(&headers)?;
    let doc = state.bodies.read_object(&headers, body).await?;
    let incoming = data_document::parse(doc.value, None, &principal, &state.store.options().limits)?;
    let id = incoming.id.as_str().to_owned();
    let rev = incoming.rev.as_deref().map(parse_rev).transpose()?;
    let new_rev = write(&state, incoming, rev).await?;
    if batch_mode(&params) {
        return Ok(batch_accepted(&id));
    }
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
        return match rev {
            Some(rev) => delete_revision(state, incoming, &rev).await,
            None => tombstone_without_revision(state, incoming).await,
        };
    }
    let Some(rev) = rev else {
        return Ok(state.store.put_document(&incoming.id, &incoming.body, Precondition::MustNotExist).await?);
    };
    match state.store.put_document(&incoming.id, &incoming.body, Precondition::MatchRevision(rev.clone())).await {
        // Not the winner's revision: a losing leaf's, or stale.
        Err(err) if err.is_conflict() => {
            branches::write_after_conflict(state, incoming.id.as_str(), &rev, false, incoming.body).await
        }
        written => Ok(written?),
    }
}

/// A deletion naming `rev`. A document with conflicts has the leaf `rev` deleted in its tree
/// (the best remaining leaf becomes the winner, as in CouchDB); any other takes the usual path.
async fn delete_revision(state: &CouchState, incoming: IncomingDocument, rev: &Revision) -> CouchResult<Revision> {
    let id = incoming.id.as_str();
    if let Some(tree) = branches::tree_with_branches(state, id).await? {
        return match branches::write_leaf(state, id, &tree, rev, true, incoming.body).await? {
            Some(tombstone) => Ok(tombstone),
            None => Err(CouchError::conflict()),
        };
    }
    if incoming.body.is_empty() {
        delete_at(state, id, rev).await
    } else {
        tombstone_with_fields(state, incoming, rev).await
    }
}

/// A deletion that names no revision. CouchDB treats it as any write without `_rev`: refused
/// (409) while the document is live, and otherwise a new revision, a tombstone, at generation 1
/// for an id never written or one past the deletion it follows (measured on CouchDB 3.4.3 in
/// issue 22: `_bulk_docs` with `_deleted` and `PUT` with `_deleted: true` of a new id give
/// `1-…`). The tombstone goes in as a revision made here, with the previous tombstone as its
/// parent, through the replicated-write path every backend has; if the document changed in
/// between, that path keeps the newer state and this write is a conflict.
async fn tombstone_without_revision(state: &CouchState, incoming: IncomingDocument) -> CouchResult<Revision> {
    let id = incoming.id.as_str();
    let previous = state.store.backend().revisions(id).await?;
    if previous.as_ref().is_some_and(|info| !info.deleted) {
        return Err(CouchError::conflict());
    }
    let parent = previous.as_ref().and_then(|info| RevisionId::parse(info.rev.as_str()));
    let minted = RevisionId::next_after(
        previous.as_ref().map(|info| parent.map_or(info.ancestry.start, |parent| parent.generation)),
    )?;
    let rev = minted.to_revision();
    let mut ancestry = vec![rev.as_str().to_owned()];
    ancestry.extend(parent.map(|parent| parent.to_revision().as_str().to_owned()));
    let tombstone = ReplicatedRevision {
        rev: rev.clone(),
        ancestry,
        deleted: true,
        body: incoming.body,
        precondition: Precondition::None,
    };
    match state.store.put_replicated(&incoming.id, &tombstone).await? {
        ReplicatedOutcome::Applied => Ok(rev),
        _ => Err(CouchError::conflict()),
    }
}

/// A deletion at `rev` that carries fields, which CouchDB keeps in the tombstone: the tombstone
/// goes in as a revision made here, the child of `rev`, through the replicated-write path that
/// keeps a deleted revision's body on every backend. `rev` must be the live current revision
/// (else 409, as for any stale write); a writer that got in between the check and the write
/// holds a live child of `rev`, which wins over this deletion, and the deletion is a conflict.
/// Two deletions of `rev` racing there both delete the document; CouchDB's winner rule between
/// the two tombstones decides whose fields stay (CouchDB would answer the second with 409).
async fn tombstone_with_fields(
    state: &CouchState,
    incoming: IncomingDocument,
    rev: &Revision,
) -> CouchResult<Revision> {
    let id = incoming.id.as_str();
    let current = state.store.backend().revisions(id).await?;
    let Some(current) = current.filter(|info| !info.deleted && &info.rev == rev) else {
        return Err(deletion_refused(state, id).await);
    };
    let parent = RevisionId::parse(current.rev.as_str()).ok_or_else(CouchError::conflict)?;
    let minted = RevisionId::next_after(Some(parent.generation))?.to_revision();
    let ancestry = vec![minted.as_str().to_owned(), current.rev.as_str().to_owned()];
    let tombstone = ReplicatedRevision {
        rev: minted.clone(),
        ancestry,
        deleted: true,
        body: incoming.body,
        precondition: Precondition::None,
    };
    match state.store.put_replicated(&incoming.id, &tombstone).await? {
        ReplicatedOutcome::Applied => Ok(minted),
        _ => Err(CouchError::conflict()),
    }
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
    let replicated = ReplicatedRevision {
        rev,
        ancestry,
        deleted: incoming.deleted,
        body: incoming.body,
        precondition: Precondition::None,
    };
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
pub(crate) fn written(state: &CouchState, status: StatusCode, id: &str, rev: &str) -> Response {
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
    ServedDb(DocId { docid }): ServedDb<DocId>,
    Query(params): Params,
    RawQuery(raw_query): RawQuery,
    headers: HeaderMap,
) -> Answer {
    match id_kind(&docid)? {
        IdKind::Data => {}
        IdKind::Local(name) => return local_delete(&state, &principal, name, &params, &headers).await,
        IdKind::Design => {
            let path = design::path_of_id(&docid);
            let (method, query) = (Method::DELETE, raw_query.as_deref());
            return design::run(&state, &principal, method, path, query, &headers, Body::empty()).await;
        }
    }
    principal.confinement().check_id(&docid)?;
    // CouchDB opens the document first, so deleting one that is missing or already deleted is
    // 404 `missing` / `deleted` whatever the revision (`chttpd_db.erl`, `db_doc_req` DELETE:
    // "check for the existence of the doc to handle the 404 case"). Here the delete is tried
    // first and the document looked at only when it fails, so a delete costs one backend call.
    let Some(rev) = write_revision(None, &params, &headers)? else {
        return Err(deletion_refused(&state, &docid).await);
    };
    if let Some(tree) = branches::tree_with_branches(&state, &docid).await? {
        return match branches::write_leaf(&state, &docid, &tree, &rev, true, Map::new()).await? {
            Some(tombstone) => Ok(written(&state, StatusCode::OK, &docid, tombstone.as_str())),
            None => Err(deletion_refused(&state, &docid).await),
        };
    }
    match state.store.backend().delete(&docid, &rev).await {
        Ok(tombstone) => Ok(written(&state, StatusCode::OK, &docid, tombstone.as_str())),
        Err(err) if err.is_not_found() || err.is_conflict() => Err(deletion_refused(&state, &docid).await),
        Err(err) => Err(err.into()),
    }
}

/// Why a `DELETE` was not applied, as CouchDB answers it: 404 `missing` for a document never
/// written, 404 `deleted` for a deleted one, else 409 (no revision, or a stale one).
async fn deletion_refused(state: &CouchState, id: &str) -> CouchError {
    match state.store.backend().revisions(id).await {
        Ok(None) => CouchError::not_found("missing"),
        Ok(Some(info)) if info.deleted => CouchError::not_found("deleted"),
        Ok(Some(_)) => CouchError::conflict(),
        Err(err) => err.into(),
    }
}

/// `GET /{db}/_local/{name}`.
pub async fn get_local(
    State(state): State<CouchState>,
    Extension(principal): Extension<Principal>,
    ServedDb(LocalName { name }): ServedDb<LocalName>,
) -> Answer {
    local_get(&state, &principal, &name).await
}

/// `PUT /{db}/_local/{name}`.
pub async fn put_local(
    State(state): State<CouchState>,
    Extension(principal): Extension<Principal>,
    ServedDb(LocalName { name }): ServedDb<LocalName>,
    Query(params): Params,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    local_put(&state, &principal, &name, &params, &headers, body).await
}

/// `DELETE /{db}/_local/{name}?rev=`.
pub async fn delete_local(
    State(state): State<CouchState>,
    Extension(principal): Extension<Principal>,
    ServedDb(LocalName { name }): ServedDb<LocalName>,
    Query(params): Params,
    headers: HeaderMap,
) -> Answer {
    local_delete(&state, &principal, &name, &params, &headers).await
}

async fn local_get(state: &CouchState, principal: &Principal, name: &str) -> Answer {
    check_local_name(name)?;
    let doc = state
        .store
        .backend()
        .get_local(&principal.confinement().local_name(name))
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
    crate::database::document::check_local(&body).map_err(crate::couchdb_api::db::refused)?;
    body.shift_remove("_id");
    let body_rev = match body.shift_remove("_rev") {
        Some(Value::String(rev)) => Some(rev),
        _ => None,
    };
    // The revision is still read, so a body `_rev`, `?rev=` and `If-Match` that disagree are
    // refused as for any document, but it is not compared with the stored one (below).
    write_revision(body_rev.as_deref(), params, headers)?;
    let local_name = principal.confinement().local_name(name);
    if body.shift_remove("_deleted") == Some(Value::Bool(true)) {
        // A deletion by PUT writes whatever is there away; nothing there is nothing to do.
        delete_local_unchecked(state, &local_name).await?;
        return Ok(json(StatusCode::OK, json!({ "ok": true, "id": format!("_local/{name}"), "rev": "0-0" })));
    }
    // CouchDB 3 does not check a local document's revision: a write with a stale `_rev`, or none,
    // over an existing one succeeds (measured on CouchDB 3.4.3 in issue 22), which replicators
    // rely on when they write their checkpoints.
    crate::model::depth::check_document_depth(&body)?;
    let rev = state.store.backend().put_local(&local_name, &body, Precondition::None).await?;
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
    write_revision(None, params, headers)?;
    // As CouchDB: a missing one is 404 (the document is opened first), an existing one is
    // deleted whatever revision is named, or none.
    if !delete_local_unchecked(state, &principal.confinement().local_name(name)).await? {
        return Err(CouchError::not_found("missing"));
    }
    Ok(json(StatusCode::OK, json!({ "ok": true, "id": format!("_local/{name}"), "rev": "0-0" })))
}

/// How many times a delete of a local document is retried when another write changed it
/// between the read of its revision and the delete.
const LOCAL_DELETE_ATTEMPTS: usize = 8;

/// Deletes the local document whatever its revision (the backend's delete is conditional: its
/// current revision is read first, and read again if it changed). `false` when there was none.
async fn delete_local_unchecked(state: &CouchState, local_name: &str) -> CouchResult<bool> {
    let backend = state.store.backend();
    for _ in 0..LOCAL_DELETE_ATTEMPTS {
        let Some(current) = backend.get_local(local_name).await? else { return Ok(false) };
        match backend.delete_local(local_name, &current.rev).await {
            Ok(()) => return Ok(true),
            Err(err) if err.is_not_found() => return Ok(false),
            Err(err) if err.is_conflict() => continue,
            Err(err) => return Err(err.into()),
        }
    }
    Err(CouchError::conflict())
}

fn check_local_name(name: &str) -> CouchResult<()> {
    // CouchDB answers `GET /{db}/_local/` (no name) as the open of a document that is not
    // there: 404 `not_found`/`missing` (measured on CouchDB 3.4.3 in issue 22).
    if name.is_empty() {
        return Err(CouchError::not_found("missing"));
    }
    // Where the data-store database keeps each document's conflicts, its design documents, its
    // views' incarnation and the engine's settings: never a client's.
    if super::data_design::is_reserved_local(name) {
        return Err(CouchError::forbidden(format!(
            "local document names starting with any of {:?} are reserved for this database's own records",
            crate::database::layout::RESERVED_LOCAL_PREFIXES
        )));
    }
    Ok(())
}

/// `/{db}/{docid}/{attachment}`: attachments are not kept.
pub async fn attachment(_served: ServedDb) -> Answer {
    Err(CouchError::not_supported("attachments"))
}
