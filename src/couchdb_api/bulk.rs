//! Bulk and replication endpoints: `_bulk_docs` (both `new_edits` modes), `_bulk_get`,
//! `_revs_diff` and `_ensure_full_commit`.
//!
//! `_bulk_docs` answers per document, in request order. With `new_edits: false` (a replicator
//! writing revisions it already has) a known revision changes nothing, a revision whose history
//! holds the current one fast-forwards, and otherwise CouchDB's deterministic winner is kept (see
//! `DocumentBackend::put_replicated`), and the answer lists errors only, as CouchDB's does. A
//! document that is not a data-store document gets a per-document `forbidden`, which both
//! CouchDB's and PouchDB's replicators skip.

use std::collections::{HashMap, HashSet};

use axum::body::Body;
use axum::extract::{Extension, Query, State};
use axum::http::{HeaderMap, StatusCode};
use futures::stream::{self, StreamExt};
use serde_json::{json, Map, Value};

use super::access::Principal;
use super::data_document::{self, parse_rev, IncomingDocument};
use super::document::{deletion_fields, doc_json, replicate, tombstone_json, write};
use super::error::{CouchError, CouchResult};
use super::request::bool_param;
use super::served_db::ServedDb;
use super::{json, Answer, CouchState};
use crate::backend::{Precondition, Revision, RevisionInfo, StoredDocument};

/// Most documents one `_bulk_docs` or `_bulk_get` request may name; the body limit bounds the
/// bytes, this bounds the per-document work.
pub const MAX_BULK_DOCS: usize = 10_000;
/// Replicated writes and per-document reads in flight at once within one request.
const CONCURRENCY: usize = 16;

/// `POST /{db}/_bulk_docs`.
pub async fn bulk_docs(
    State(state): State<CouchState>,
    Extension(principal): Extension<Principal>,
    _served: ServedDb,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    let request = state.bodies.read_object(&headers, body).await?;
    let Value::Object(mut request) = request.value else {
        return Err(CouchError::bad_request("Request body must be a JSON object"));
    };
    let new_edits = match request.remove("new_edits") {
        None => true,
        Some(Value::Bool(flag)) => flag,
        Some(_) => return Err(CouchError::bad_request("new_edits must be a boolean")),
    };
    let docs = match request.remove("docs") {
        Some(Value::Array(docs)) => docs,
        _ => return Err(CouchError::bad_request("POST body must include `docs` parameter.")),
    };
    if docs.len() > MAX_BULK_DOCS {
        return Err(CouchError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            format!("a _bulk_docs request may hold at most {MAX_BULK_DOCS} documents; it held {}", docs.len()),
        ));
    }
    let all_or_nothing = request.get("all_or_nothing") == Some(&Value::Bool(true));
    let parsed = parse_all(&state, &principal, docs, new_edits)?;
    // An empty request writes nothing either way: CouchDB answers it 201 `[]` before looking at
    // `all_or_nothing` (`fabric_doc_update:go/3`).
    if new_edits && all_or_nothing && !parsed.is_empty() {
        return Ok(all_or_nothing_refused(&parsed));
    }
    let results =
        if new_edits { write_new_edits(&state, parsed).await? } else { write_replicated(&state, parsed).await };
    Ok(json(StatusCode::CREATED, Value::Array(results)))
}

/// A document of the request: the `_id` to report for it, and the document taken apart or the
/// reason it is refused.
type ParsedDoc = (Value, CouchResult<IncomingDocument>);

/// Takes every document of a `_bulk_docs` request apart before anything is written. A malformed
/// document (an illegal id, a bad special member, a bad revision: a 400) fails the whole request
/// and nothing is written, as CouchDB 3.4.3 parses the whole `docs` array first
/// (`chttpd_db.erl`, `couch_db:doc_from_json_obj_validate` for each document before
/// `fabric:update_docs`; with `new_edits: false` a document without `_rev` or `_revisions` is
/// such a 400 too, `validate_revs`). A document the data-store rules refuse (403) fails alone,
/// as CouchDB's `validate_doc_update` refusals do.
fn parse_all(
    state: &CouchState,
    principal: &Principal,
    docs: Vec<Value>,
    new_edits: bool,
) -> CouchResult<Vec<ParsedDoc>> {
    let limits = state.store.options().limits;
    let mut parsed = Vec::with_capacity(docs.len());
    for doc in docs {
        let reported = reported_id(&doc);
        let result = data_document::parse(doc, None, principal, &limits);
        match &result {
            Err(err) if err.status == StatusCode::BAD_REQUEST => return Err(err.clone()),
            Ok(doc) => {
                if !new_edits && doc.rev.is_none() && doc.revisions.is_none() {
                    return Err(CouchError::bad_request(
                        "When `new_edits: false`, the document needs `_rev` or `_revisions` specified",
                    ));
                }
                if let Some(rev) = &doc.rev {
                    parse_rev(rev).map_err(|_| CouchError::bad_request("Invalid rev format"))?;
                }
            }
            Err(_) => {}
        }
        parsed.push((reported, result));
    }
    Ok(parsed)
}

/// CouchDB 3's answer to `all_or_nothing: true`: 417, and for every document
/// `{id, rev, error: "not_implemented", reason: "all_or_nothing is not supported"}` (`rev` is the
/// one sent, `0-` for none), nothing written (`fabric_doc_update.erl`, `validate_atomic_update`,
/// answered by `chttpd_db.erl` as 417).
fn all_or_nothing_refused(parsed: &[ParsedDoc]) -> axum::response::Response {
    all_or_nothing_answer(parsed.iter().map(|(reported, doc)| match doc {
        Ok(doc) => (Value::from(doc.id.as_str()), doc.rev.clone()),
        Err(_) => (reported.clone(), None),
    }))
}

/// The 417 of [`all_or_nothing_refused`] from each document's id and the revision it names
/// (`None`: `0-`), in request order; every database's `_bulk_docs` answers it.
pub(crate) fn all_or_nothing_answer(docs: impl Iterator<Item = (Value, Option<String>)>) -> axum::response::Response {
    let rows: Vec<Value> = docs
        .map(|(id, rev)| {
            let rev = rev.unwrap_or_else(|| "0-".into());
            json!({ "id": id, "rev": rev, "error": "not_implemented", "reason": "all_or_nothing is not supported" })
        })
        .collect();
    json(StatusCode::EXPECTATION_FAILED, Value::Array(rows))
}

/// The `id` to report for a document that could not even be parsed.
fn reported_id(doc: &Value) -> Value {
    doc.get("_id").cloned().unwrap_or(Value::Null)
}

/// `new_edits: true`: ordinary writes. Creates and updates go to the backend as one bulk
/// request; deletions, and every write of a request that names an id twice (which must apply in
/// order), go one by one.
async fn write_new_edits(state: &CouchState, parsed: Vec<ParsedDoc>) -> CouchResult<Vec<Value>> {
    let mut seen = HashSet::new();
    let repeated = parsed.iter().any(|(_, p)| p.as_ref().is_ok_and(|d| !seen.insert(d.id.as_str().to_owned())));
    let mut results: Vec<Option<Value>> = vec![None; parsed.len()];
    let mut batch = Vec::new();
    let mut batch_slots = Vec::new();
    let mut one_by_one = Vec::new();
    for (slot, (reported, parsed)) in parsed.into_iter().enumerate() {
        let doc = match parsed {
            Ok(doc) => doc,
            Err(err) => {
                results[slot] = Some(error_row(&reported, &err));
                continue;
            }
        };
        let rev = match doc.rev.as_deref().map(parse_rev).transpose() {
            Ok(rev) => rev,
            Err(err) => {
                results[slot] = Some(err.to_row(doc.id.as_str()));
                continue;
            }
        };
        if doc.deleted || repeated {
            one_by_one.push((slot, doc, rev));
        } else {
            let precondition = rev.map(Precondition::MatchRevision).unwrap_or(Precondition::MustNotExist);
            batch_slots.push((slot, doc.id.as_str().to_owned()));
            batch.push((doc.id, doc.body, precondition));
        }
    }
    if !batch.is_empty() {
        let written = state.store.put_documents(batch).await?;
        for ((slot, id), result) in batch_slots.into_iter().zip(written) {
            results[slot] = Some(result_row(&id, result.map_err(CouchError::from)));
        }
    }
    for (slot, doc, rev) in one_by_one {
        let id = doc.id.as_str().to_owned();
        results[slot] = Some(result_row(&id, write(state, doc, rev).await));
    }
    Ok(results.into_iter().map(|row| row.unwrap_or(Value::Null)).collect())
}

fn result_row(id: &str, result: CouchResult<Revision>) -> Value {
    match result {
        Ok(rev) => json!({ "ok": true, "id": id, "rev": rev.as_str() }),
        Err(err) => err.to_row(id),
    }
}

fn error_row(id: &Value, err: &CouchError) -> Value {
    json!({ "id": id, "error": err.error, "reason": err.reason })
}

/// `new_edits: false`: each document's revision and history as the replicator sent them. The
/// answer lists only the documents that failed.
async fn write_replicated(state: &CouchState, parsed: Vec<ParsedDoc>) -> Vec<Value> {
    // Writes to one id apply in request order: group by id, run groups concurrently.
    let mut groups: Vec<Vec<(usize, Value, IncomingDocument)>> = Vec::new();
    let mut group_of: HashMap<String, usize> = HashMap::new();
    let mut failures: Vec<(usize, Value)> = Vec::new();
    for (index, (reported, doc)) in parsed.into_iter().enumerate() {
        let doc = match doc {
            Ok(doc) => doc,
            Err(err) => {
                failures.push((index, error_row(&reported, &err)));
                continue;
            }
        };
        let group = *group_of.entry(doc.id.as_str().to_owned()).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        groups[group].push((index, reported, doc));
    }
    let written: Vec<(usize, Value)> = stream::iter(groups)
        .map(|group| async move {
            let mut failures = Vec::new();
            for (index, reported, incoming) in group {
                if let Err(err) = replicate(state, incoming).await {
                    failures.push((index, error_row(&reported, &err)));
                }
            }
            failures
        })
        .buffer_unordered(CONCURRENCY)
        .flat_map(stream::iter)
        .collect()
        .await;
    failures.extend(written);
    failures.sort_by_key(|(index, _)| *index);
    failures.into_iter().map(|(_, row)| row).collect()
}

/// A `_bulk_get` request, checked: the entries and the `revs` and `latest` options. Shared by
/// the data-store database and every other one.
pub(crate) struct BulkGetRequest {
    pub docs: Vec<Value>,
    pub revs: bool,
    pub latest: bool,
}

impl BulkGetRequest {
    pub(crate) async fn read(
        state: &CouchState,
        params: &HashMap<String, String>,
        headers: &HeaderMap,
        body: Body,
    ) -> CouchResult<Self> {
        let revs = bool_param("revs", params.get("revs").map(String::as_str), false)?;
        let latest = bool_param("latest", params.get("latest").map(String::as_str), false)?;
        let request = state.bodies.read_object(headers, body).await?;
        let docs = match request.value {
            Value::Object(mut map) => match map.remove("docs") {
                Some(Value::Array(docs)) => docs,
                _ => return Err(CouchError::bad_request("Missing JSON list of 'docs'.")),
            },
            _ => return Err(CouchError::bad_request("Missing JSON list of 'docs'.")),
        };
        if docs.len() > MAX_BULK_DOCS {
            return Err(CouchError::bad_request(format!(
                "a _bulk_get request may name at most {MAX_BULK_DOCS} documents"
            )));
        }
        Ok(BulkGetRequest { docs, revs, latest })
    }
}

/// `POST /{db}/_bulk_get`: `{"results": [{id, docs: [{ok: doc} | {error: …}]}]}` in request
/// order. A named revision that is the current one (or the current tombstone) is answered;
/// an older one is `missing`; a deleted document asked without a revision is its tombstone.
pub async fn bulk_get(
    State(state): State<CouchState>,
    Extension(principal): Extension<Principal>,
    _served: ServedDb,
    Query(params): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    let BulkGetRequest { docs, revs, latest } = BulkGetRequest::read(&state, &params, &headers, body).await?;
    let results: Vec<Value> = stream::iter(docs)
        .map(|item| {
            let state = &state;
            let principal = &principal;
            async move { bulk_get_one(state, principal, &item, revs, latest).await }
        })
        .buffered(CONCURRENCY)
        .collect()
        .await;
    Ok(json(StatusCode::OK, json!({ "results": results })))
}

async fn bulk_get_one(state: &CouchState, principal: &Principal, item: &Value, revs: bool, latest: bool) -> Value {
    let Some(id) = item.get("id").and_then(Value::as_str) else {
        return json!({ "id": null, "docs": [{ "error": { "id": null, "rev": null, "error": "bad_request", "reason": "an entry needs an id" } }] });
    };
    let wanted = item.get("rev").and_then(Value::as_str);
    let error = |error: &str, reason: &str| json!({ "id": id, "docs": [{ "error": { "id": id, "rev": wanted.unwrap_or("undefined"), "error": error, "reason": reason } }] });
    if !principal.confinement().admits_id(id) {
        return error("forbidden", "this login may not read that user's documents");
    }
    let backend = state.store.backend();
    let found = match backend.get(id).await {
        Ok(found) => found,
        Err(err) => {
            let err = CouchError::from(err);
            return error(&err.error, &err.reason);
        }
    };
    let is_current_rev = |rev: &str| found.as_ref().is_some_and(|doc| doc.rev.as_str() == rev);
    let needs_info = revs || found.is_none() || wanted.is_some_and(|rev| !is_current_rev(rev));
    let info = if needs_info {
        match backend.revisions(id).await {
            Ok(info) => info,
            Err(err) => {
                let err = CouchError::from(err);
                return error(&err.error, &err.reason);
            }
        }
    } else {
        None
    };
    let doc = match answered_state(found.as_ref(), info.as_ref(), wanted, latest) {
        Some(AnsweredState::Live(doc)) => {
            doc_json(doc, if revs { info.as_ref().filter(|i| i.rev == doc.rev) } else { None })
        }
        // Without a revision CouchDB 3.4.3 answers a deleted document with its tombstone,
        // `{"ok": {…, "_deleted": true}}` (measured in issue 22), not an error.
        Some(AnsweredState::Tombstone(info)) => match deletion_fields(state, id, info).await {
            Ok(fields) => tombstone_json(id, info, &fields, revs),
            Err(err) => return error(&err.error, &err.reason),
        },
        None if wanted.is_none() && info.as_ref().is_some_and(|i| i.deleted) => match &info {
            Some(info) => match deletion_fields(state, id, info).await {
                Ok(fields) => tombstone_json(id, info, &fields, revs),
                Err(err) => return error(&err.error, &err.reason),
            },
            None => return error("not_found", "missing"),
        },
        // Another leaf than the winner: a conflict.
        None => match wanted {
            Some(rev) => match super::branches::tree_of(state, id).await {
                Ok(Some(tree)) => match tree.leaf(rev).or_else(|| {
                    latest.then(|| tree.leaves().into_iter().find(|leaf| leaf.path.revs().iter().any(|r| r == rev)))?
                }) {
                    Some(leaf) => {
                        let options = super::db::DocOptions { revs, ..Default::default() };
                        super::db::leaf_json(id, &tree, leaf, options)
                    }
                    None => return error("not_found", "missing"),
                },
                Ok(None) => return error("not_found", "missing"),
                Err(err) => return error(&err.error, &err.reason),
            },
            None => return error("not_found", "missing"),
        },
    };
    json!({ "id": id, "docs": [{ "ok": doc }] })
}

/// What a read of one revision answers.
pub(crate) enum AnsweredState<'a> {
    Live(&'a StoredDocument),
    Tombstone(&'a RevisionInfo),
}

/// The state that answers a request for revision `wanted` (`None`: the current one): the current
/// document or tombstone when `wanted` is its revision, or, with `latest` (CouchDB's "the latest
/// leaf of that revision's branch"), when `wanted` is one of its ancestors. A replicator asks with
/// `latest=true` for the revision it saw in the feed; if the document changed since, it gets the
/// newer one, as from CouchDB. `None`: this store holds no body for that revision.
pub(crate) fn answered_state<'a>(
    found: Option<&'a StoredDocument>,
    info: Option<&'a RevisionInfo>,
    wanted: Option<&str>,
    latest: bool,
) -> Option<AnsweredState<'a>> {
    let current_rev = found.map(|doc| doc.rev.as_str()).or(info.map(|i| i.rev.as_str()))?;
    let answers_current = match wanted {
        None => true,
        Some(rev) if rev == current_rev => true,
        Some(rev) => latest && info.is_some_and(|i| i.ancestry.revisions().any(|known| known.as_str() == rev)),
    };
    if !answers_current {
        return None;
    }
    match (found, info) {
        (Some(doc), _) => Some(AnsweredState::Live(doc)),
        (None, Some(info)) if info.deleted && wanted.is_some() => Some(AnsweredState::Tombstone(info)),
        _ => None,
    }
}

/// `POST /{db}/_revs_diff`: for each id, the named revisions this store does not know (neither
/// the current one nor in its remembered ancestry).
pub async fn revs_diff(
    State(state): State<CouchState>,
    Extension(principal): Extension<Principal>,
    _served: ServedDb,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    let request = state.bodies.read_object(&headers, body).await?;
    let Value::Object(request) = request.value else {
        return Err(CouchError::bad_request("Request body must be a JSON object"));
    };
    if request.len() > MAX_BULK_DOCS {
        return Err(CouchError::bad_request(format!(
            "a _revs_diff request may name at most {MAX_BULK_DOCS} documents"
        )));
    }
    let answers: Vec<CouchResult<Option<(String, Value)>>> = stream::iter(request)
        .map(|(id, revs)| {
            let state = &state;
            let principal = &principal;
            async move { revs_diff_one(state, principal, id, revs).await }
        })
        .buffered(CONCURRENCY)
        .collect()
        .await;
    let mut missing = Map::new();
    for answer in answers {
        if let Some((id, entry)) = answer? {
            missing.insert(id, entry);
        }
    }
    Ok(json(StatusCode::OK, Value::Object(missing)))
}

async fn revs_diff_one(
    state: &CouchState,
    principal: &Principal,
    id: String,
    revs: Value,
) -> CouchResult<Option<(String, Value)>> {
    let Value::Array(revs) = revs else {
        return Err(CouchError::bad_request(format!("the revisions of {id:?} must be an array")));
    };
    // Another user's documents are never sent to a per-user login's store: nothing is missing.
    if !principal.confinement().admits_id(&id) {
        return Ok(None);
    }
    let info = state.store.backend().revisions(&id).await?;
    let known: HashSet<String> =
        info.map(|info| info.ancestry.revisions().map(|r| r.0).chain([info.rev.0]).collect()).unwrap_or_default();
    let missing: Vec<Value> =
        revs.into_iter().filter(|rev| rev.as_str().is_some_and(|rev| !known.contains(rev))).collect();
    if missing.is_empty() {
        return Ok(None);
    }
    // Not on the winner's branch: the other branches may hold them.
    let Some(tree) = super::branches::tree_of(state, &id).await? else {
        return Ok(Some((id, json!({ "missing": missing }))));
    };
    let asked: Vec<String> = missing.iter().filter_map(Value::as_str).map(str::to_owned).collect();
    let (missing, possible_ancestors) = tree.missing(&asked);
    if missing.is_empty() {
        return Ok(None);
    }
    let mut entry = json!({ "missing": missing });
    if !possible_ancestors.is_empty() {
        entry["possible_ancestors"] = Value::from(possible_ancestors);
    }
    Ok(Some((id, entry)))
}

/// `POST /{db}/_ensure_full_commit`: every acknowledged write is already durable.
pub async fn ensure_full_commit(_served: ServedDb) -> Answer {
    Ok(json(StatusCode::CREATED, json!({ "ok": true, "instance_start_time": "0" })))
}
