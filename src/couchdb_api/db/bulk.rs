//! Many documents at once: `_bulk_docs` (client edits, or a replicator's revisions with
//! `new_edits: false`), `_bulk_get`, `_revs_diff`, `_missing_revs` and `_purge`, answered from
//! each document's revision tree. The reads a replicator decides what to send by
//! (`_revs_diff`, `_missing_revs`, `_bulk_get`) repair what they read
//! ([`Database::read_many_repairing`]): a leaf a crash left out of the feed is put back in it
//! by the question that would otherwise stop the replicator from sending it again.

use std::collections::HashMap;

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use futures::stream::{self, StreamExt};
use serde_json::{json, Map, Value};

use super::{leaf_json, refused, DocOptions, OpenDb};
use crate::couchdb_api::access::DbAccess;
use crate::couchdb_api::error::{CouchError, CouchResult};
use crate::couchdb_api::request::bool_param;
use crate::couchdb_api::{json, Answer, CouchState};
use crate::database::data_store_rules::Confinement;
use crate::database::document::{self, check_id};
use crate::database::rev_tree::{parse_rev, RevPath};
use crate::database::{Database, Write, Written};

/// The id prefix of local documents, which a bulk request may write too.
const LOCAL_PREFIX: &str = "_local/";

/// Documents of one bulk request written at once (each document's writes stay in order).
const CONCURRENCY: usize = 16;
/// Documents of a replicator's request written in one [`Database::write_many`] call.
const DOCUMENTS_PER_WRITE: usize = 100;
/// Documents of a client's request (`new_edits: true`) written in one [`Database::write_many`]
/// call. Its calls run one after the other, so that the changes reach the feed in id order, and
/// each waits for its own commit: with 100 a call (as a replicator's), a `_bulk_docs` of 1,000
/// paid ten fsync'd commits one after another on the embedded store, and ran at 2.1x a real
/// CouchDB 3.4.3 against 3.3x for 100 (issue 38). 1,000 keeps what one call holds (its batched
/// reads, one bulk write, within the group commit's 4,096 documents a transaction) bounded.
const EDITS_PER_WRITE: usize = 1_000;
/// `write_many` calls of one request at once.
const WRITES_AT_ONCE: usize = 4;

/// A document of a bulk request with its place in the request.
type Positioned = (usize, Map<String, Value>);

/// `POST /{db}/_bulk_docs`.
pub async fn bulk_docs(State(state): State<CouchState>, opened: OpenDb, headers: HeaderMap, body: Body) -> Answer {
    let mut request = state.bodies.read_object(&headers, body).await?.value;
    super::docs::refuse_numbers_beyond_doubles(&state, &opened.db, &request)?;
    // Taken out of the request, not copied (the rest of it is read below).
    let docs = match request.as_object_mut().and_then(|request| request.remove("docs")) {
        Some(Value::Array(docs)) => docs,
        _ => return Err(CouchError::bad_request("POST body must include `docs` parameter.")),
    };
    if docs.len() > MAX_BULK_DOCS {
        return Err(CouchError::bad_request(format!(
            "a _bulk_docs request may hold at most {MAX_BULK_DOCS} documents"
        )));
    }
    let new_edits = match request.get("new_edits") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(flag)) => *flag,
        Some(_) => return Err(CouchError::bad_request("`new_edits` must be a boolean")),
    };
    // Each document is read and checked before anything is written: CouchDB refuses a whole
    // request with a document that is not an object, has an illegal id, an unknown special
    // field or a malformed `_rev` (400, nothing written), as for the data-store database.
    let mut parsed = Vec::with_capacity(docs.len());
    for doc in docs {
        let Value::Object(doc) = doc else {
            return Err(CouchError::bad_request("Document must be a JSON object"));
        };
        // A local document has no revision history: only its special members are checked, as
        // by its own route.
        let local = doc.get("_id").and_then(Value::as_str).is_some_and(|id| id.starts_with(LOCAL_PREFIX));
        if local {
            document::check_local(&doc).map_err(refused)?;
        } else {
            if let Some(Value::String(id)) = doc.get("_id") {
                check_id(id).map_err(refused)?;
            }
            document::check(&doc).map_err(refused)?;
            if !new_edits && !doc.contains_key("_rev") {
                // `validate_revs` in CouchDB's `chttpd_db.erl`.
                return Err(CouchError::bad_request(
                    "When `new_edits: false`, the document needs `_rev` or `_revisions` specified",
                ));
            }
        }
        parsed.push(doc);
    }
    let all_or_nothing = request.get("all_or_nothing") == Some(&Value::Bool(true));
    if new_edits && all_or_nothing && !parsed.is_empty() {
        return all_or_nothing_refused(&parsed);
    }
    // Writes to one id keep their order: documents are grouped by id, groups run concurrently.
    let mut order: Vec<(String, Vec<Positioned>)> = Vec::new();
    let mut index_of: HashMap<String, usize> = HashMap::new();
    let mut early: Vec<Option<Value>> = vec![None; parsed.len()];
    for (position, doc) in parsed.into_iter().enumerate() {
        let id = match doc.get("_id") {
            Some(Value::String(id)) => id.clone(),
            Some(_) => {
                early[position] =
                    Some(json!({ "id": null, "error": "bad_request", "reason": "Document id must be a string" }));
                continue;
            }
            None if new_edits => match super::docs::id_for_new(&state, &opened.db, &doc) {
                Ok(id) => id,
                Err(err) => {
                    early[position] = Some(err.to_row(""));
                    continue;
                }
            },
            None => {
                early[position] =
                    Some(json!({ "id": null, "error": "bad_request", "reason": "Document id must be a string" }));
                continue;
            }
        };
        let group = *index_of.entry(id.clone()).or_insert_with(|| {
            order.push((id.clone(), Vec::new()));
            order.len() - 1
        });
        order[group].1.push((position, doc));
    }
    // CouchDB numbers a request's changes in id order (`couch_db:group_alike_docs` sorts the
    // documents by id, and `couch_db_updater:merge_rev_trees` gives each its sequence in turn):
    // the groups are written in that order.
    order.sort_by(|a, b| a.0.cmp(&b.0));
    let db = &opened.db;
    let access = (opened.access, &opened.confinement);
    let results: Vec<Vec<(usize, Option<Value>)>> = if new_edits {
        write_edits_in_id_order(db, access, order).await
    } else {
        // A replicator's request: every document made ready, then written many at a time
        // (`Database::write_many`: one batched read and one bulk write of records per call).
        // Plain loops of futures, as in `Database::write_many`: closures in iterator adapters
        // can trip rustc's higher-ranked `Send` check under an axum handler.
        let mut preparing = Vec::with_capacity(order.len());
        for (id, docs) in order {
            preparing.push(prepare_group(db, access, id, docs, new_edits));
        }
        let ready: Vec<Ready> = stream::iter(preparing).buffered(CONCURRENCY).collect().await;
        let mut writing = Vec::new();
        let mut ready = ready.into_iter().peekable();
        while ready.peek().is_some() {
            writing.push(write_chunk(db, ready.by_ref().take(DOCUMENTS_PER_WRITE).collect()));
        }
        stream::iter(writing).buffer_unordered(WRITES_AT_ONCE).collect().await
    };
    // A database deleted under the request's writes is CouchDB's 404 for the whole request,
    // never a 201 whose rows say it is missing (PouchDB turns such a row into a 500). Writes
    // that finished before the deletion (which waits for them) are answered as they went.
    if results.iter().flatten().any(|(_, row)| row.as_ref().is_some_and(names_missing_database)) {
        return Err(CouchError::no_database());
    }
    let mut answers = early;
    for (position, row) in results.into_iter().flatten() {
        answers[position] = row;
    }
    // With `new_edits: false` CouchDB answers only the documents that failed.
    let rows: Vec<Value> = answers.into_iter().flatten().collect();
    Ok(json(StatusCode::CREATED, Value::Array(rows)))
}

/// Whether a document's row says its database does not exist (it was deleted meanwhile).
fn names_missing_database(row: &Value) -> bool {
    let missing = CouchError::no_database();
    row["error"] == missing.error.as_str() && row["reason"] == missing.reason.as_str()
}

/// CouchDB 3's answer to `all_or_nothing: true` (417, one `not_implemented` row per document,
/// nothing written; [`all_or_nothing_answer`]): each row names the
/// document's id (a new one for a document without, as CouchDB gives it before refusing) and the
/// revision it names, from `_revisions` or `_rev`.
fn all_or_nothing_refused(docs: &[Map<String, Value>]) -> Answer {
    let mut rows = Vec::with_capacity(docs.len());
    for doc in docs {
        let id = match doc.get("_id") {
            Some(id) => id.clone(),
            None => Value::from(super::docs::new_id()?),
        };
        let named = doc.get("_revisions").and_then(RevPath::from_revisions).map(|path| path.leaf_rev());
        rows.push((id, named.or_else(|| doc.get("_rev").and_then(Value::as_str).map(str::to_owned))));
    }
    Ok(all_or_nothing_answer(rows.into_iter()))
}

/// A client's edits (`new_edits: true`), their groups given in id order, written so that their
/// changes reach the feed in that order, as CouchDB's do: chunks of consecutive groups one
/// after the other, each in one [`Database::write_many`] (whose records go in one bulk write, in
/// order). A group that deletes is a chunk of its own, since `write_many` saves a deleted tree
/// apart from, and after, the records it writes together.
async fn write_edits_in_id_order(
    db: &Database,
    access: Admitted<'_>,
    order: Vec<(String, Vec<Positioned>)>,
) -> Vec<Vec<(usize, Option<Value>)>> {
    // Plain loops of futures, as below: closures in iterator adapters can trip rustc's
    // higher-ranked `Send` check under an axum handler.
    let mut preparing = Vec::with_capacity(order.len());
    for (id, docs) in order {
        preparing.push(prepare_group(db, access, id, docs, true));
    }
    let ready: Vec<Ready> = stream::iter(preparing).buffered(CONCURRENCY).collect().await;
    let mut results = Vec::new();
    let mut chunk: Vec<Ready> = Vec::new();
    for group in ready {
        let deletes = group.writes.iter().any(|write| matches!(write, Write::Edit { deleted: true, .. }));
        if !chunk.is_empty() && (deletes || chunk.len() == EDITS_PER_WRITE) {
            results.push(write_chunk(db, std::mem::take(&mut chunk)).await);
        }
        chunk.push(group);
        if deletes {
            results.push(write_chunk(db, std::mem::take(&mut chunk)).await);
        }
    }
    if !chunk.is_empty() {
        results.push(write_chunk(db, chunk).await);
    }
    results
}

/// The documents of one id made ready to write: the rows answered already (refusals, local
/// documents, which are written here), and the writes with their places in the request.
struct Ready {
    id: String,
    rows: Vec<(usize, Option<Value>)>,
    writes: Vec<Write>,
    positions: Vec<usize>,
}

/// What the login may do on the database, and which documents it may write.
type Admitted<'a> = (DbAccess, &'a Confinement);

/// Checks the documents of one id (in request order), stores their inline attachments and
/// writes the local ones. A design document written by a member is refused in its rows alone
/// (CouchDB's per-document `forbidden`), replicated or not.
async fn prepare_group(
    db: &Database,
    (access, confinement): Admitted<'_>,
    id: String,
    docs: Vec<Positioned>,
    new_edits: bool,
) -> Ready {
    let row_error = |err: CouchError| Some(err.to_row(&id));
    let mut ready =
        Ready { id: id.clone(), rows: Vec::with_capacity(docs.len()), writes: Vec::new(), positions: Vec::new() };
    let admitted = match id.strip_prefix(LOCAL_PREFIX) {
        Some(_) => Ok(()),
        None => confinement.check_id(&id).map_err(CouchError::from),
    };
    if let Err(refused) = admitted.and_then(|()| access.check_write(&id)) {
        ready.rows = docs.into_iter().map(|(position, _)| (position, row_error(refused.clone()))).collect();
        return ready;
    }
    if let Some(name) = id.strip_prefix(LOCAL_PREFIX) {
        // A local document in a bulk request is written as by `PUT /{db}/_local/{name}`.
        for (position, body) in docs {
            ready.rows.push((
                position,
                match super::docs::write_local(db, &confinement.local_name(name), body).await {
                    Ok(rev) => Some(json!({ "ok": true, "id": id, "rev": rev })),
                    Err(err) => row_error(err),
                },
            ));
        }
        return ready;
    }
    for (position, body) in docs {
        match to_write(db, &id, body, new_edits).await {
            Ok(write) => {
                ready.writes.push(write);
                ready.positions.push(position);
            }
            Err(err) => ready.rows.push((position, row_error(err))),
        }
    }
    ready
}

/// The rows of one document's writes, from the engine's answers.
fn answer_rows(
    id: &str,
    positions: Vec<usize>,
    answers: crate::error::Result<Vec<crate::error::Result<Written>>>,
) -> Vec<(usize, Option<Value>)> {
    let row_error = |err: CouchError| Some(err.to_row(id));
    let answers = match answers {
        Ok(answers) => answers,
        Err(err) => {
            let err = CouchError::from(err);
            return positions.into_iter().map(|p| (p, row_error(err.clone()))).collect();
        }
    };
    positions
        .into_iter()
        .zip(answers)
        .map(|(position, answer)| {
            let row = match answer {
                Ok(Written::Edited(rev)) => Some(json!({ "ok": true, "id": id, "rev": rev })),
                Ok(Written::Merged(_)) => None,
                Err(err) => row_error(super::attachments::write_error(err)),
            };
            (position, row)
        })
        .collect()
}

/// Many documents' writes (edits or replicated revisions) in one [`Database::write_many`] call;
/// each gets its answer row (`None` for a replicated write that succeeded); a failure of the
/// whole call answers each of their writes with it.
async fn write_chunk(db: &Database, chunk: Vec<Ready>) -> Vec<(usize, Option<Value>)> {
    let mut rows = Vec::new();
    let mut documents = Vec::with_capacity(chunk.len());
    let mut positions = Vec::with_capacity(chunk.len());
    for ready in chunk {
        rows.extend(ready.rows);
        if !ready.writes.is_empty() {
            positions.push(ready.positions);
            documents.push((ready.id, ready.writes));
        }
    }
    if documents.is_empty() {
        return rows;
    }
    match db.write_many(&documents).await {
        Ok(answers) => {
            for ((id, _), (positions, answers)) in documents.iter().zip(positions.into_iter().zip(answers)) {
                rows.extend(answer_rows(id, positions, answers));
            }
        }
        Err(err) => {
            let err = CouchError::from(err);
            for ((id, _), positions) in documents.iter().zip(positions) {
                rows.extend(positions.into_iter().map(|p| (p, Some(err.to_row(id)))));
            }
        }
    }
    rows
}

/// A bulk document as a write (checked again here: the request was checked as a whole first).
/// Inline attachments are stored first ([`super::attachments::prepare`]).
async fn to_write(db: &Database, id: &str, body: Map<String, Value>, new_edits: bool) -> Result<Write, CouchError> {
    check_id(id).map_err(refused)?;
    let mut doc = document::parse(body).map_err(refused)?;
    super::attachments::prepare(db, &mut doc.body).await?;
    super::docs::check_size(db, id, &doc)?;
    if new_edits {
        return Ok(Write::Edit { parent: doc.rev, deleted: doc.deleted, body: doc.body });
    }
    let path = document::replicated_path(&doc).map_err(refused)?;
    Ok(Write::Replicated { path, deleted: doc.deleted, body: doc.body })
}

/// `POST /{db}/_bulk_get` `{"docs": [{"id", "rev"?}]}` with `?revs=true`, `?latest=true`; as
/// multipart to a client that wants it and not JSON ([`super::attachments::bulk_get_multipart`]).
pub async fn bulk_get(
    State(state): State<CouchState>,
    opened: OpenDb,
    Query(params): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    let BulkGetRequest { docs, revs, latest } = BulkGetRequest::read(&state, &params, &headers, body).await?;
    let inline = super::attachments::inline_wanted(&params)?;
    let db = &opened.db;
    let options = DocOptions { revs, ..DocOptions::default() };
    let confinement = &opened.confinement;
    let all_admitted =
        docs.iter().all(|item| item.get("id").and_then(Value::as_str).is_none_or(|id| confinement.admits_id(id)));
    // Multipart carries no per-entry refusal for another user's documents: such a request is
    // answered in JSON, each of those entries a `forbidden` error.
    let multipart = crate::couchdb_api::multipart::bulk_get_multipart_type(&headers).filter(|_| all_admitted);
    if let Some(media) = multipart {
        // A client that wants multipart and not JSON, as CouchDB decides it.
        return super::attachments::bulk_get_multipart(db, docs, options, latest, media).await;
    }
    let inline = &inline;
    let results: Vec<Value> = stream::iter(docs)
        .map(|item| async move {
            match refused_to(confinement, &item) {
                Some(refusal) => refusal,
                None => bulk_get_one(db, &item, options, latest, inline.as_ref()).await,
            }
        })
        .buffered(CONCURRENCY)
        .collect()
        .await;
    // Rows read while the database was being deleted name it missing: the request is a 404.
    db.check_open()?;
    Ok(json(StatusCode::OK, json!({ "results": results })))
}

async fn bulk_get_one(
    db: &Database,
    item: &Value,
    options: DocOptions,
    latest: bool,
    inline: Option<&super::attachments::Inline>,
) -> Value {
    let Some(id) = item.get("id").and_then(Value::as_str) else {
        return json!({ "id": null, "docs": [{ "error": { "id": null, "rev": null, "error": "bad_request", "reason": "an entry needs an id" } }] });
    };
    // CouchDB checks the id first (`couch_db:validate_docid`), answering its refusal with a
    // `null` revision; a local document's id passes there.
    if !id.starts_with("_local/") {
        if let Err(refusal) = check_id(id) {
            let error = json!({ "id": id, "rev": null, "error": refusal.error, "reason": refusal.reason });
            return json!({ "id": id, "docs": [{ "error": error }] });
        }
    }
    let wanted = item.get("rev").and_then(Value::as_str);
    let error = |error: &str, reason: &str| json!({ "error": { "id": id, "rev": wanted.unwrap_or("undefined"), "error": error, "reason": reason } });
    let state = match db.read_repairing(id).await {
        Ok(state) => state,
        Err(err) => {
            let err = CouchError::from(err);
            return json!({ "id": id, "docs": [error(&err.error, &err.reason)] });
        }
    };
    let Some(state) = state else { return json!({ "id": id, "docs": [error("not_found", "missing")] }) };
    let leaf = match wanted {
        None => state.tree.winner().map(std::borrow::Cow::Borrowed),
        Some(rev) => super::docs::find_leaf(&state.tree, rev, latest),
    };
    let Some(leaf) = leaf else { return json!({ "id": id, "docs": [error("not_found", "missing")] }) };
    let leaf = leaf.as_ref();
    let mut doc = leaf_json(id, &state.tree, leaf, options);
    if let Some(inline) = inline {
        if let Err(err) = super::attachments::inline_into(db, leaf, &mut doc, inline).await {
            return json!({ "id": id, "docs": [error(&err.error, &err.reason)] });
        }
    }
    json!({ "id": id, "docs": [{ "ok": doc }] })
}

/// A `_bulk_get` entry for a document outside the login's confinement: a `forbidden` error of
/// that entry alone, as the data-store database has always answered it.
fn refused_to(confinement: &Confinement, item: &Value) -> Option<Value> {
    let id = item.get("id").and_then(Value::as_str)?;
    if confinement.admits_id(id) {
        return None;
    }
    let wanted = item.get("rev").and_then(Value::as_str).unwrap_or("undefined");
    let reason = "this login may not read that user's documents";
    Some(
        json!({ "id": id, "docs": [{ "error": { "id": id, "rev": wanted, "error": "forbidden", "reason": reason } }] }),
    )
}

/// The `{id: [revs]}` body of `_revs_diff` and `_missing_revs`.
async fn revs_request(
    state: &CouchState,
    headers: &HeaderMap,
    body: Body,
) -> Result<Vec<(String, Vec<String>)>, CouchError> {
    let request = state.bodies.read_object(headers, body).await?.value;
    let Value::Object(map) = request else { return Err(CouchError::bad_request("Request body must be a JSON object")) };
    if map.len() > MAX_BULK_DOCS {
        return Err(CouchError::bad_request(format!("a revision request may name at most {MAX_BULK_DOCS} documents")));
    }
    let mut wanted = Vec::with_capacity(map.len());
    for (id, revs) in map {
        let Value::Array(revs) = revs else {
            return Err(CouchError::bad_request("Each document must map to a list of revisions"));
        };
        let mut list = Vec::with_capacity(revs.len());
        for rev in revs {
            match rev {
                Value::String(rev) if parse_rev(&rev).is_some() => list.push(rev),
                _ => return Err(CouchError::bad_request("Invalid rev format")),
            }
        }
        wanted.push((id, list));
    }
    Ok(wanted)
}

/// The documents of a revision request the login may see. Another user's documents are never
/// sent to a per-user login's replica, so nothing of them is missing: they are left out of the
/// answer, as the data-store database has always answered.
fn confined(confinement: &Confinement, mut wanted: Vec<(String, Vec<String>)>) -> Vec<(String, Vec<String>)> {
    wanted.retain(|(id, _)| confinement.admits_id(id));
    wanted
}

/// `POST /{db}/_revs_diff`: for each document, the revisions this database lacks, and which of
/// its leaves may be their ancestors.
pub async fn revs_diff(State(state): State<CouchState>, opened: OpenDb, headers: HeaderMap, body: Body) -> Answer {
    let wanted = confined(&opened.confinement, revs_request(&state, &headers, body).await?);
    let ids: Vec<String> = wanted.iter().map(|(id, _)| id.clone()).collect();
    let states = opened.db.read_many_repairing(&ids).await?;
    let mut answer = Map::new();
    for ((id, revs), state) in wanted.into_iter().zip(states) {
        let (missing, ancestors) = match state {
            Some(state) => state.tree.missing(&revs),
            None => (revs, Vec::new()),
        };
        if missing.is_empty() {
            continue;
        }
        let mut entry = json!({ "missing": missing });
        if !ancestors.is_empty() {
            entry["possible_ancestors"] = json!(ancestors);
        }
        answer.insert(id, entry);
    }
    Ok(json(StatusCode::OK, Value::Object(answer)))
}

/// `POST /{db}/_missing_revs`: the revisions this database lacks, per document.
pub async fn missing_revs(State(state): State<CouchState>, opened: OpenDb, headers: HeaderMap, body: Body) -> Answer {
    let wanted = confined(&opened.confinement, revs_request(&state, &headers, body).await?);
    let ids: Vec<String> = wanted.iter().map(|(id, _)| id.clone()).collect();
    let states = opened.db.read_many_repairing(&ids).await?;
    let mut answer = Map::new();
    for ((id, revs), state) in wanted.into_iter().zip(states) {
        let missing = match state {
            Some(state) => state.tree.missing(&revs).0,
            None => revs,
        };
        if !missing.is_empty() {
            answer.insert(id, json!(missing));
        }
    }
    Ok(json(StatusCode::OK, json!({ "missing_revs": answer })))
}

/// `POST /{db}/_purge` `{id: [revs]}`: those leaves removed for good.
pub async fn purge(State(state): State<CouchState>, opened: OpenDb, headers: HeaderMap, body: Body) -> Answer {
    opened.check_database_wide("purge it")?;
    opened.access.require_server_admin()?;
    let wanted = revs_request(&state, &headers, body).await?;
    let mut purged = Map::new();
    for (id, revs) in wanted {
        let removed = opened.db.purge(&id, &revs).await?;
        purged.insert(id, json!(removed));
    }
    Ok(json(StatusCode::CREATED, json!({ "purge_seq": null, "purged": purged })))
}

/// Most documents one `_bulk_docs` or `_bulk_get` request may name; the body limit bounds the
/// bytes, this bounds the per-document work.
pub const MAX_BULK_DOCS: usize = 10_000;

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

/// The 417 of `all_or_nothing: true` (not supported) from each document's id and the revision it names
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::backend::embedded::EmbeddedBackend;
    use crate::backend::DocumentBackend;

    /// A client's `_bulk_docs` of 1,000 new documents is one `write_many`, so one commit on the
    /// embedded store (issue 38: ten calls of 100, each waiting for its own fsync'd commit), and
    /// its changes reach the feed in id order, as CouchDB numbers them.
    #[tokio::test]
    async fn a_thousand_edits_are_written_in_one_commit_in_id_order() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(EmbeddedBackend::open(&dir.path().join("d.redb")).await.unwrap());
        let db = Database::new("d".into(), Arc::clone(&store) as Arc<dyn DocumentBackend>);
        // In id order, as the handler sorts them.
        let order: Vec<(String, Vec<Positioned>)> = (0..1_000)
            .map(|n| (format!("d{n:04}"), vec![(n, json!({ "n": n }).as_object().cloned().unwrap_or_default())]))
            .collect();
        let before = store.write_transactions();
        let admitted = (DbAccess::ServerAdmin, &Confinement::Everything);
        let rows: Vec<(usize, Option<Value>)> =
            write_edits_in_id_order(&db, admitted, order).await.into_iter().flatten().collect();
        assert_eq!(store.write_transactions() - before, 1, "one commit for the request");
        assert_eq!(rows.len(), 1_000);
        assert!(rows.iter().all(|(_, row)| row.as_ref().is_some_and(|row| row["ok"] == true)), "every row ok");
        let mut fed = Vec::new();
        let mut since: Option<String> = None;
        loop {
            let page = store.changes(since.as_deref(), 500).await.unwrap();
            if page.changes.is_empty() {
                break;
            }
            fed.extend(page.changes.into_iter().map(|change| change.id));
            since = Some(page.last_seq);
        }
        let ids: Vec<String> = (0..1_000).map(|n| format!("d{n:04}")).collect();
        assert_eq!(fed, ids, "the feed holds the documents in id order");
    }
}
