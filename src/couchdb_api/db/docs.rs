//! One document of a database: `GET`/`HEAD` with CouchDB's read options (`rev`, `revs`,
//! `revs_info`, `conflicts`, `deleted_conflicts`, `meta`, `open_revs`, `latest`, and
//! `attachments`/`atts_since`), answered as JSON or, to a client that accepts it as CouchDB
//! decides, as `multipart/mixed` (`open_revs`) or `multipart/related` (`attachments=true`) with
//! the attachments' bytes streamed from the store; `PUT` (also `new_edits=false`, also a
//! `multipart/related` body), `POST /{db}`, `DELETE`, `COPY`, design documents as documents, and
//! local documents (`_local/{name}`, never replicated, revision `0-N`, written whatever `_rev`
//! says, as CouchDB 3 does).

use std::borrow::Cow;
use std::collections::HashMap;

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::{leaf_json, refused, DocOptions, OpenDb};
use crate::couchdb_api::access::DbAccess;
use crate::couchdb_api::error::{CouchError, CouchResult};
use crate::couchdb_api::multipart;
use crate::couchdb_api::request::{bool_param, json_param};
use crate::couchdb_api::response::{etag, not_modified};
use crate::couchdb_api::{json, Answer, CouchState};
use crate::database::doc_attachments::has_attachments;
use crate::database::document::{self, check_id, ClientDoc};
use crate::database::layout::Served;
use crate::database::rev_tree::{parse_rev, Leaf, RevTree};
use crate::database::{Database, Write, Written};

type Params = Query<HashMap<String, String>>;

#[derive(Deserialize)]
pub(crate) struct DocId {
    docid: String,
}

#[derive(Deserialize)]
pub(crate) struct DesignName {
    ddoc: String,
}

#[derive(Deserialize)]
pub(crate) struct LocalName {
    name: String,
}

/// `/{db}/{docid}`, every method.
pub async fn document(
    State(state): State<CouchState>,
    opened: OpenDb<DocId>,
    method: Method,
    Query(params): Params,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    let id = opened.params.docid.clone();
    one_document(&state, &opened, &id, method, &params, &headers, body).await
}

/// `/{db}/_design/{ddoc}`: a design document is a document (its functions run in issue 26).
pub async fn design_document(
    State(state): State<CouchState>,
    opened: OpenDb<DesignName>,
    method: Method,
    Query(params): Params,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    let id = format!("_design/{}", opened.params.ddoc);
    one_document(&state, &opened, &id, method, &params, &headers, body).await
}

/// `/{db}/_design/{ddoc}/...`: an attachment of the design document (a name not starting with
/// `_`), or a show, list, update function or rewrite: 501 (views have routes of their own).
pub async fn design_function(
    opened: OpenDb<HashMap<String, String>>,
    method: Method,
    Query(params): Params,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    let rest = opened.params.get("rest").cloned().unwrap_or_default();
    if rest.starts_with('_') || rest.is_empty() {
        return Err(CouchError::not_supported(
            "shows, lists, update functions and rewrites (deprecated in CouchDB 3; views, validation and filters run here)",
        ));
    }
    let id = format!("_design/{}", opened.params.get("ddoc").map(String::as_str).unwrap_or_default());
    super::attachments::one_attachment(&opened.db, opened.access, &id, &rest, method, &params, &headers, body).await
}

/// `_find`, `_explain`, `_index` on a database other than the data-store one
/// ([`super::mango`]).
pub async fn mango(
    State(state): State<CouchState>,
    opened: OpenDb<HashMap<String, String>>,
    method: Method,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    super::mango::route(&state, opened, method, &uri, headers, body).await
}

/// One document, every method; writes of a design document (by `PUT`, `DELETE` or as `COPY`'s
/// destination) need a database admin, as CouchDB's `validate_doc_update` checks.
async fn one_document<T>(
    state: &CouchState,
    opened: &OpenDb<T>,
    id: &str,
    method: Method,
    params: &HashMap<String, String>,
    headers: &HeaderMap,
    body: Body,
) -> Answer {
    let db = &opened.db;
    opened.confinement.check_id(id)?;
    match method.as_str() {
        "GET" | "HEAD" => read_document(db, id, params, headers).await,
        "PUT" => {
            opened.access.check_write(id)?;
            if crate::couchdb_api::multipart::is_multipart_related(headers) {
                // What CouchDB's replicator sends: the document, then each attachment's bytes.
                let (doc, followed) = super::attachments::read_related(state, db, headers, body).await?;
                return put_document(db, id, doc, &followed, params, headers).await;
            }
            let doc = read_doc_body(state, db, headers, body).await?;
            put_document(db, id, doc, &HashMap::new(), params, headers).await
        }
        "DELETE" => {
            opened.access.check_write(id)?;
            delete_document(db, id, params, headers).await
        }
        "COPY" => copy_document(db, opened.access, id, params, headers).await,
        _ => Ok(crate::couchdb_api::root::method_not_allowed().await),
    }
}

/// The options of a read, from the query string.
fn read_options(params: &HashMap<String, String>) -> CouchResult<DocOptions> {
    let flag = |name: &str| bool_param(name, params.get(name).map(String::as_str), false);
    let meta = flag("meta")?;
    Ok(DocOptions {
        revs: flag("revs")?,
        revs_info: flag("revs_info")? || meta,
        conflicts: flag("conflicts")? || meta,
        deleted_conflicts: flag("deleted_conflicts")? || meta,
    })
}

async fn read_document(db: &Database, id: &str, params: &HashMap<String, String>, headers: &HeaderMap) -> Answer {
    if params.is_empty() {
        return read_plain(db, id, headers).await;
    }
    let params = &without_empty_open_revs(params);
    // `open_revs` is what a replicator fetches leaves by: that read repairs, as `_bulk_get` does.
    let state = if params.contains_key("open_revs") { db.read_repairing(id).await? } else { db.read(id).await? };
    let tree = state.map(|state| state.tree);
    let inline = super::attachments::inline_wanted(params)?;
    if params.contains_key("open_revs") && multipart::accepts(headers, "multipart/mixed") {
        // What CouchDB's replicator reads (`?revs=true&open_revs=[…]&latest=true&atts_since=[…]`
        // with `Accept: multipart/mixed`, never `attachments=true`): CouchDB sends every
        // attachment's bytes in this answer, except those `atts_since` leaves as stubs.
        let inline = inline.unwrap_or_default();
        return open_revs_mixed(id, tree.as_ref(), params, |leaf, doc| {
            super::attachments::with_following(db, leaf, doc, &inline)
        });
    }
    let Some(inline) = inline else {
        return answer_read(id, tree.as_ref(), params, headers);
    };
    // Attachments with their bytes: each leaf answered gets them from the store.
    match read_value(id, tree.as_ref(), params, headers)? {
        ReadValue::Doc(mut doc, rev) => {
            if let Some(leaf) = tree.as_ref().and_then(|tree| tree.revision(&rev)) {
                let leaf = leaf.as_ref();
                // CouchDB's `send_doc_efficiently`: a document with attachments, asked for with
                // them by a client accepting `multipart/related`, is sent as that (plain JSON,
                // stubs, when `atts_since` leaves no attachment to send).
                if has_attachments(&leaf.body) && multipart::accepts(headers, "multipart/related") {
                    let document = super::attachments::with_following(db, leaf, doc, &inline)?;
                    let mut response = multipart::related_response(document)?;
                    response.headers_mut().insert(header::ETAG, etag(&rev));
                    return Ok(response);
                }
                super::attachments::inline_into(db, leaf, &mut doc, &inline).await?;
            }
            Ok(doc_response(doc, &rev))
        }
        ReadValue::OpenRevs(mut answer) => {
            if let (Some(tree), Value::Array(items)) = (tree.as_ref(), &mut answer) {
                for item in items {
                    let Some(doc) = item.get_mut("ok") else { continue };
                    let rev = doc.get("_rev").and_then(Value::as_str).unwrap_or_default().to_owned();
                    if let Some(leaf) = tree.revision(&rev) {
                        super::attachments::inline_into(db, &leaf, doc, &inline).await?;
                    }
                }
            }
            Ok(json(StatusCode::OK, answer))
        }
        other => Ok(other.into_response()),
    }
}

/// A read with no query option: the winner as it is. A data-store document with no other leaves
/// is answered from its record's text, unparsed ([`Database::read_served`]: issue 38); any other
/// as [`answer_read`] answers it from the tree.
async fn read_plain(db: &Database, id: &str, headers: &HeaderMap) -> Answer {
    let no_params = HashMap::new();
    match db.read_served(id).await? {
        Some(Served::Alone(winner)) => {
            let rev = winner.rev.as_str();
            if not_modified(headers, rev) {
                return Ok(ReadValue::NotModified(rev.to_owned()).into_response());
            }
            let mut text = String::new();
            winner.write_document(id, &mut text);
            let mut response = crate::couchdb_api::json_text(StatusCode::OK, text);
            response.headers_mut().insert(header::ETAG, etag(rev));
            Ok(response)
        }
        Some(Served::State(state)) => answer_read(id, Some(&state.tree), &no_params, headers),
        None => answer_read(id, None, &no_params, headers),
    }
}

/// `?open_revs=…` for a client accepting `multipart/mixed` (CouchDB's `send_docs_multipart`):
/// one part per leaf answered, each the leaf as `follow` makes it (with the attachments that
/// follow it), and `{"missing": REV}` parts; 404 for `open_revs=all` of nothing stored.
fn open_revs_mixed(
    id: &str,
    tree: Option<&RevTree>,
    params: &HashMap<String, String>,
    mut follow: impl FnMut(&Leaf, Value) -> CouchResult<multipart::DocumentWithAttachments>,
) -> Answer {
    let options = read_options(params)?;
    let latest = bool_param("latest", params.get("latest").map(String::as_str), false)?;
    let open_revs = params.get("open_revs").map(String::as_str).unwrap_or("all");
    let mut parts = Vec::new();
    for opened in open_revs_leaves(tree, open_revs, latest)? {
        parts.push(match opened {
            Opened::Leaf(tree, leaf) => {
                multipart::OpenRevsLeaf::Found(follow(&leaf, leaf_json(id, tree, &leaf, open_revs_options(options)))?)
            }
            Opened::Missing(rev) => multipart::OpenRevsLeaf::Missing(rev),
        });
    }
    multipart::mixed_response(parts)
}

/// What a read answers, before it is a response.
enum ReadValue {
    /// `If-None-Match` names the revision read.
    NotModified(String),
    /// One leaf as shown, and its revision.
    Doc(Value, String),
    /// The answer of `open_revs`.
    OpenRevs(Value),
}

impl ReadValue {
    fn into_response(self) -> Response {
        match self {
            ReadValue::NotModified(rev) => {
                let mut response = StatusCode::NOT_MODIFIED.into_response();
                response.headers_mut().insert(header::ETAG, etag(&rev));
                response
            }
            ReadValue::Doc(doc, rev) => doc_response(doc, &rev),
            ReadValue::OpenRevs(answer) => json(StatusCode::OK, answer),
        }
    }
}

fn doc_response(doc: Value, rev: &str) -> Response {
    let mut response = json(StatusCode::OK, doc);
    response.headers_mut().insert(header::ETAG, etag(rev));
    response
}

/// A read's query without `open_revs` when it names no revision (`open_revs=[]`): CouchDB then
/// reads the document as without it (`chttpd_db.erl`: an empty `open_revs` list is its default,
/// a plain read), not an empty list of revisions.
pub(crate) fn without_empty_open_revs(
    params: &HashMap<String, String>,
) -> std::borrow::Cow<'_, HashMap<String, String>> {
    let empty = params
        .get("open_revs")
        .and_then(|open_revs| serde_json::from_str::<Value>(open_revs).ok())
        .is_some_and(|open_revs| open_revs.as_array().is_some_and(Vec::is_empty));
    if !empty {
        return std::borrow::Cow::Borrowed(params);
    }
    let mut plain = params.clone();
    plain.remove("open_revs");
    std::borrow::Cow::Owned(plain)
}

/// A read of one document from its revision tree (`None`: nothing stored), with every query
/// option CouchDB takes. Shared by every database, the data-store one included.
pub(crate) fn answer_read(
    id: &str,
    tree: Option<&RevTree>,
    params: &HashMap<String, String>,
    headers: &HeaderMap,
) -> Answer {
    let params = &without_empty_open_revs(params);
    if params.contains_key("open_revs") && multipart::accepts(headers, "multipart/mixed") {
        // Bodies without attachments kept here (the data-store database keeps none; the other
        // databases' reads send theirs in `read_document`): each leaf is an `application/json` part.
        return open_revs_mixed(id, tree, params, |_, doc| multipart::DocumentWithAttachments::new(doc, Vec::new()));
    }
    Ok(read_value(id, tree, params, headers)?.into_response())
}

fn read_value(
    id: &str,
    tree: Option<&RevTree>,
    params: &HashMap<String, String>,
    headers: &HeaderMap,
) -> CouchResult<ReadValue> {
    let options = read_options(params)?;
    let latest = bool_param("latest", params.get("latest").map(String::as_str), false)?;
    if let Some(open_revs) = params.get("open_revs") {
        return Ok(ReadValue::OpenRevs(open_revs_answer(id, tree, open_revs, options, latest)?));
    }
    let Some(tree) = tree else { return Err(CouchError::missing()) };
    let leaf = match params.get("rev") {
        Some(rev) => {
            parse_rev(rev).ok_or_else(|| CouchError::bad_request("Invalid rev format"))?;
            find_leaf(tree, rev, latest).ok_or_else(CouchError::missing)?
        }
        None => match tree.winner() {
            Some(winner) if !winner.deleted => Cow::Borrowed(winner),
            Some(_) => return Err(CouchError::deleted()),
            None => return Err(CouchError::missing()),
        },
    };
    let rev = leaf.path.leaf_rev();
    if not_modified(headers, &rev) {
        return Ok(ReadValue::NotModified(rev));
    }
    Ok(ReadValue::Doc(leaf_json(id, tree, &leaf, options), rev))
}

/// The revision a read of `rev` answers: that leaf, with `latest` the leaf whose branch holds
/// it, else the inner revision `rev` while its body is kept (until compaction).
pub(super) fn find_leaf<'a>(tree: &'a RevTree, rev: &str, latest: bool) -> Option<Cow<'a, Leaf>> {
    if let Some(leaf) = tree.leaf(rev) {
        return Some(Cow::Borrowed(leaf));
    }
    if latest {
        if let Some(leaf) = tree.leaves().into_iter().find(|leaf| leaf.path.revs().iter().any(|known| known == rev)) {
            return Some(Cow::Borrowed(leaf));
        }
    }
    tree.revision(rev)
}

/// A revision `open_revs` answers, or a revision it does not find.
enum Opened<'a> {
    /// The revision (a leaf, or an inner revision whose body is kept), and its tree.
    Leaf(&'a RevTree, Cow<'a, Leaf>),
    Missing(String),
}

/// The options `open_revs` answers with: `revs` only (CouchDB shows no `_revs_info` or
/// `_conflicts` there).
fn open_revs_options(options: DocOptions) -> DocOptions {
    DocOptions { revs_info: false, conflicts: false, deleted_conflicts: false, ..options }
}

/// `?open_revs=all` (every leaf in revision order; 404 when nothing is stored) or `?open_revs=[...]` (each
/// revision's leaf, or missing), in the order asked.
fn open_revs_leaves<'a>(tree: Option<&'a RevTree>, open_revs: &str, latest: bool) -> CouchResult<Vec<Opened<'a>>> {
    if open_revs == "all" {
        let Some(tree) = tree else { return Err(CouchError::missing()) };
        // CouchDB 3.4.3 answers every leaf in revision order (generation, then revision id),
        // not the winner first.
        let mut leaves = tree.leaves();
        leaves.sort_by_cached_key(|leaf| {
            leaf.path
                .leaf_rev()
                .split_once('-')
                .map(|(generation, id)| (generation.parse::<u64>().unwrap_or(u64::MAX), id.to_owned()))
        });
        return Ok(leaves.into_iter().map(|leaf| Opened::Leaf(tree, Cow::Borrowed(leaf))).collect());
    }
    let wanted = match json_param("open_revs", Some(open_revs))? {
        Some(Value::Array(items)) => items,
        _ => return Err(CouchError::bad_request("open_revs must be `all` or a JSON array of revisions")),
    };
    let mut opened = Vec::with_capacity(wanted.len());
    // With `latest`, a revision answers every leaf descending from it (CouchDB's
    // `couch_key_tree:get_key_leafs`), and revisions of one branch lead to the same leaves,
    // each answered once.
    let mut answered = std::collections::HashSet::new();
    for item in wanted {
        let Value::String(rev) = item else {
            return Err(CouchError::bad_request("open_revs must be an array of revision strings"));
        };
        parse_rev(&rev).ok_or_else(|| CouchError::bad_request("Invalid rev format"))?;
        let Some(tree) = tree else {
            opened.push(Opened::Missing(rev));
            continue;
        };
        let leaves: Vec<Cow<'_, Leaf>> = match tree.leaf(&rev) {
            Some(leaf) => vec![Cow::Borrowed(leaf)],
            None if latest => {
                tree.leaves().into_iter().filter(|leaf| leaf.path.revs().contains(&rev)).map(Cow::Borrowed).collect()
            }
            None => Vec::new(),
        };
        // Not a leaf (nor, with `latest`, below one): an inner revision answers while its body
        // is kept.
        let leaves = match (leaves.is_empty(), tree.revision(&rev)) {
            (true, Some(inner)) => vec![inner],
            _ => leaves,
        };
        if leaves.is_empty() {
            opened.push(Opened::Missing(rev));
        }
        for leaf in leaves {
            if answered.insert(leaf.path.leaf_rev()) {
                opened.push(Opened::Leaf(tree, leaf));
            }
        }
    }
    Ok(opened)
}

/// `?open_revs=…` as JSON: `{"ok": doc}` or `{"missing": rev}` each.
fn open_revs_answer(
    id: &str,
    tree: Option<&RevTree>,
    open_revs: &str,
    options: DocOptions,
    latest: bool,
) -> CouchResult<Value> {
    let options = open_revs_options(options);
    let answer = open_revs_leaves(tree, open_revs, latest)?
        .into_iter()
        .map(|opened| match opened {
            Opened::Leaf(tree, leaf) => json!({ "ok": leaf_json(id, tree, &leaf, options) }),
            Opened::Missing(rev) => json!({ "missing": rev }),
        })
        .collect();
    Ok(Value::Array(answer))
}

/// A request body that must be one JSON object, within the document size limit.
async fn read_doc_body(
    state: &CouchState,
    db: &Database,
    headers: &HeaderMap,
    body: Body,
) -> CouchResult<Map<String, Value>> {
    let doc = state.bodies.read_object(headers, body).await?;
    refuse_numbers_beyond_doubles(state, db, &doc.value)?;
    match doc.value {
        Value::Object(map) => Ok(map),
        _ => Err(CouchError::bad_request("Document must be a JSON object")),
    }
}

/// CouchDB's refusal of a document holding a number no double holds (`1e400`): its JSON decoder
/// fails on the whole body, so every write of a database answers as CouchDB 3.4.3 does
/// (`fixtures/couchdb-numbers-3.4.3.json`, docs/numbers.md). The data-store database keeps such
/// numbers exactly instead, as the REST API does.
pub(crate) fn refuse_numbers_beyond_doubles(state: &CouchState, db: &Database, body: &Value) -> CouchResult<()> {
    if state.is_data_store(db) {
        return Ok(());
    }
    match crate::model::number::first_beyond_doubles(body) {
        Some(_) => Err(CouchError::bad_request("invalid UTF-8 JSON")),
        None => Ok(()),
    }
}

/// CouchDB's 413 for a document over the database's `max_document_size`
/// (`couchdb_max_document_bytes`).
pub(crate) fn check_size(db: &Database, id: &str, doc: &ClientDoc) -> CouchResult<()> {
    // Counted, not written out: the text would be thrown away.
    let size = crate::model::validate::json_size(&doc.body);
    if size > db.max_document_bytes() {
        return Err(CouchError::new(StatusCode::PAYLOAD_TOO_LARGE, "document_too_large", id.to_owned()));
    }
    Ok(())
}

/// The revision a write names: body `_rev`, `?rev=` and `If-Match` must agree.
fn write_revision(
    body_rev: Option<&str>,
    params: &HashMap<String, String>,
    headers: &HeaderMap,
) -> CouchResult<Option<String>> {
    let chosen = crate::couchdb_api::document::named_revision(body_rev, params, headers)?;
    if let Some(rev) = chosen {
        parse_rev(rev).ok_or_else(|| CouchError::bad_request("Invalid rev format"))?;
    }
    Ok(chosen.map(str::to_owned))
}

async fn put_document(
    db: &Database,
    id: &str,
    body: Map<String, Value>,
    followed: &HashMap<String, crate::database::attachments::StoredBlob>,
    params: &HashMap<String, String>,
    headers: &HeaderMap,
) -> Answer {
    check_id(id).map_err(refused)?;
    let mut doc = document::parse(body).map_err(refused)?;
    let new_edits = bool_param("new_edits", params.get("new_edits").map(String::as_str), true)?;
    super::attachments::prepare_with(db, &mut doc.body, followed).await?;
    check_size(db, id, &doc)?;
    // CouchDB's `update_doc` answers a deletion 200 `ok`, a live document 201 `created`.
    let status = if doc.deleted { StatusCode::OK } else { StatusCode::CREATED };
    let rev = if new_edits {
        let parent = write_revision(doc.rev.as_deref(), params, headers)?;
        edit(db, id, parent, doc.deleted, doc.body).await?
    } else {
        let path = document::replicated_path(&doc).map_err(refused)?;
        let rev = path.leaf_rev();
        db.write(id, &Write::Replicated { path, deleted: doc.deleted, body: doc.body })
            .await
            .map_err(super::attachments::write_error)?;
        rev
    };
    if params.get("batch").is_some_and(|mode| mode == "ok") {
        return Ok(json(StatusCode::ACCEPTED, json!({ "ok": true, "id": id })));
    }
    Ok(written(status, db, id, &rev))
}

/// A client's edit; 409 `conflict` when `parent` is not a leaf (or missing over a live document).
pub(crate) async fn edit(
    db: &Database,
    id: &str,
    parent: Option<String>,
    deleted: bool,
    body: Map<String, Value>,
) -> CouchResult<String> {
    match db.write(id, &Write::Edit { parent, deleted, body }).await {
        Ok(Written::Edited(rev)) => Ok(rev),
        Ok(Written::Merged(_)) => Err(CouchError::internal("an edit was answered as a merge")),
        Err(err) => Err(super::attachments::write_error(err)),
    }
}

/// `{"ok": true, "id", "rev"}` with the `ETag` and `Location` CouchDB sends.
fn written(status: StatusCode, db: &Database, id: &str, rev: &str) -> Response {
    let mut response = json(status, json!({ "ok": true, "id": id, "rev": rev }));
    response.headers_mut().insert(header::ETAG, etag(rev));
    let location =
        format!("/{}/{}", db.name(), percent_encoding::utf8_percent_encode(id, percent_encoding::NON_ALPHANUMERIC));
    if let Ok(location) = HeaderValue::from_str(&location) {
        response.headers_mut().insert(header::LOCATION, location);
    }
    response
}

/// `POST /{db}`: a new document, its id from the body or a new uuid.
pub async fn post_document(
    State(state): State<CouchState>,
    opened: OpenDb,
    Query(params): Params,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    // CouchDB takes a new document as JSON only (`couch_httpd:validate_ctype`): 415 otherwise.
    crate::couchdb_api::request::require_json_content_type(&headers)?;
    let body = read_doc_body(&state, &opened.db, &headers, body).await?;
    if let Some(name) = body.get("_id").and_then(Value::as_str).and_then(|id| id.strip_prefix("_local/")) {
        let name = name.to_owned();
        let rev = write_local(&opened.db, &opened.confinement.local_name(&name), body).await?;
        return Ok(json(StatusCode::CREATED, json!({ "ok": true, "id": format!("_local/{name}"), "rev": rev })));
    }
    let mut doc = document::parse(body).map_err(refused)?;
    let id = match &doc.id {
        Some(id) => id.clone(),
        None => id_for_new(&state, &opened.db, &doc.body)?,
    };
    opened.access.check_write(&id)?;
    super::attachments::prepare(&opened.db, &mut doc.body).await?;
    check_size(&opened.db, &id, &doc)?;
    let rev = edit(&opened.db, &id, doc.rev.clone(), doc.deleted, doc.body).await?;
    if params.get("batch").is_some_and(|mode| mode == "ok") {
        return Ok(json(StatusCode::ACCEPTED, json!({ "ok": true, "id": id })));
    }
    Ok(written(StatusCode::CREATED, &opened.db, &id, &rev))
}

/// The id of a new document written without one: on the data-store database, the id its
/// identity fields make (403 without them); elsewhere a new uuid ([`new_id`]).
pub(crate) fn id_for_new(state: &CouchState, db: &Database, body: &Map<String, Value>) -> CouchResult<String> {
    if !state.is_data_store(db) {
        return new_id();
    }
    let id = crate::database::data_store_rules::derived_id(body, &state.store.options().limits)?;
    Ok(id.as_str().to_owned())
}

/// A new document id: 128 random bits in hex, as CouchDB's default uuid algorithm.
pub(crate) fn new_id() -> CouchResult<String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| CouchError::internal(e.to_string()))?;
    Ok(hex::encode(bytes))
}

/// `DELETE /{db}/{docid}?rev=` (or `If-Match`). CouchDB opens the document before deleting it
/// (`chttpd_db.erl`, `db_doc_req` DELETE), so one never written is 404 `missing` and a deleted
/// one 404 `deleted`, whatever revision is named; else naming none, or a stale one, is 409. Here
/// the deletion is tried first and the document looked at only when it fails.
async fn delete_document(db: &Database, id: &str, params: &HashMap<String, String>, headers: &HeaderMap) -> Answer {
    let Some(parent) = write_revision(None, params, headers)? else { return Err(deletion_refused(db, id).await) };
    match edit(db, id, Some(parent), true, Map::new()).await {
        Ok(rev) => Ok(written(StatusCode::OK, db, id, &rev)),
        Err(err) if err.status == StatusCode::CONFLICT => Err(deletion_refused(db, id).await),
        Err(err) => Err(err),
    }
}

/// Why a `DELETE` was not applied: 404 `missing` or `deleted` when the document is not live,
/// else 409 `conflict`.
async fn deletion_refused(db: &Database, id: &str) -> CouchError {
    match db.read(id).await {
        Ok(state) => match state.and_then(|state| state.tree.winner().map(|winner| winner.deleted)) {
            None => CouchError::missing(),
            Some(true) => CouchError::deleted(),
            Some(false) => CouchError::conflict(),
        },
        Err(err) => err.into(),
    }
}

/// `COPY /{db}/{docid}` with `Destination: target` or `target?rev=R`.
async fn copy_document(
    db: &Database,
    access: DbAccess,
    id: &str,
    params: &HashMap<String, String>,
    headers: &HeaderMap,
) -> Answer {
    let (target, target_rev) = crate::couchdb_api::request::copy_destination(headers)?;
    check_id(&target).map_err(refused)?;
    access.check_write(&target)?;
    let Some(state) = db.read(id).await? else { return Err(CouchError::missing()) };
    let leaf = match params.get("rev") {
        Some(rev) => state.tree.revision(rev).ok_or_else(CouchError::missing)?,
        None => Cow::Borrowed(state.tree.winner().filter(|w| !w.deleted).ok_or_else(CouchError::deleted)?),
    };
    let rev = edit(db, &target, target_rev, false, leaf.body.clone()).await?;
    Ok(written(StatusCode::CREATED, db, &target, &rev))
}

/// `GET /{db}/_local/{name}`, as CouchDB 3.4.3 answers it: a local document has no revision tree
/// and no sequence, so `rev=` (without `latest=true`) finds nothing (CouchDB looks for the
/// revision among the documents' trees: 404 `missing`), `revs=true` shows `_revisions` with the
/// one revision, and `local_seq`, `revs_info`, `conflicts` add nothing.
pub async fn get_local(opened: OpenDb<LocalName>, uri: axum::http::Uri, Query(params): Params) -> Answer {
    check_local_path(&uri)?;
    let name = local_name(&opened.params.name)?;
    let latest = bool_param("latest", params.get("latest").map(String::as_str), false)?;
    if params.contains_key("rev") && !latest {
        return Err(CouchError::missing());
    }
    let stored = opened.confinement.local_name(name);
    let doc = opened.db.get_local(&stored).await?.ok_or_else(CouchError::missing)?;
    let revisions = bool_param("revs", params.get("revs").map(String::as_str), false)?.then(|| {
        let number = doc.rev.0.strip_prefix("0-").unwrap_or_default().to_owned();
        json!({ "start": 0, "ids": [number] })
    });
    let mut body = Map::new();
    // The name asked, not the one it is stored under for a per-user login.
    body.insert("_id".into(), Value::from(format!("_local/{name}")));
    body.insert("_rev".into(), Value::from(doc.rev.0));
    body.extend(doc.body);
    if let Some(revisions) = revisions {
        body.insert("_revisions".into(), revisions);
    }
    Ok(json(StatusCode::OK, Value::Object(body)))
}

/// `PUT /{db}/_local/{name}`: written at the revision after the one named (in the body, `?rev=`
/// or `If-Match`), as CouchDB 3 writes local documents: their revision is never checked against
/// the stored one, and replicators rely on it for their checkpoints.
pub async fn put_local(
    State(state): State<CouchState>,
    opened: OpenDb<LocalName>,
    uri: axum::http::Uri,
    Query(params): Params,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    check_local_path(&uri)?;
    let name = local_name(&opened.params.name)?.to_owned();
    let mut body = read_doc_body(&state, &opened.db, &headers, body).await?;
    let body_rev = match body.get("_rev") {
        None => None,
        Some(Value::String(rev)) => Some(rev.clone()),
        Some(_) => return Err(CouchError::bad_request("Invalid rev format")),
    };
    if let Some(rev) = crate::couchdb_api::document::named_revision(body_rev.as_deref(), &params, &headers)? {
        body.insert("_rev".into(), Value::from(rev));
    }
    let deleting = body.get("_deleted") == Some(&Value::Bool(true));
    let rev = write_local(&opened.db, &opened.confinement.local_name(&name), body).await?;
    let status = if deleting { StatusCode::OK } else { StatusCode::CREATED };
    Ok(json(status, json!({ "ok": true, "id": format!("_local/{name}"), "rev": rev })))
}

/// Writes (or with `_deleted`, deletes) a local document; its new revision: `0-0` once deleted,
/// else `0-{N+1}` after the `0-N` its `_rev` names, `0-1` without one.
pub(crate) async fn write_local(db: &Database, name: &str, mut body: Map<String, Value>) -> CouchResult<String> {
    local_name(name)?;
    document::check_local(&body).map_err(refused)?;
    let named = match body.get("_rev") {
        None => None,
        Some(Value::String(rev)) => Some(rev.as_str()),
        Some(_) => return Err(CouchError::bad_request("Invalid rev format")),
    };
    let deleting = body.get("_deleted") == Some(&Value::Bool(true));
    let number = if deleting { 0 } else { next_local_rev(named)? };
    // Revision fields mean nothing on a local document (it has no history): CouchDB drops them,
    // and its attachments, which a local document does not keep.
    for special in [
        "_id",
        "_rev",
        "_revisions",
        "_conflicts",
        "_deleted_conflicts",
        "_revs_info",
        "_local_seq",
        "_attachments",
        "_deleted",
    ] {
        body.shift_remove(special);
    }
    if deleting {
        db.delete_local(name).await?;
        return Ok("0-0".to_owned());
    }
    Ok(db.put_local(name, &body, number).await?.0)
}

/// The number of a local document's next revision: one more than the `0-N` named, 1 when none
/// is (`couch_db_updater:increment_local_doc_revs`); a revision of another form is CouchDB's
/// `Invalid rev format` (a 400 here: CouchDB's updater answers it as an unknown 500).
fn next_local_rev(named: Option<&str>) -> CouchResult<u64> {
    let Some(rev) = named else { return Ok(1) };
    let invalid = || CouchError::bad_request("Invalid rev format");
    let (generation, number) = rev.split_once('-').ok_or_else(invalid)?;
    let number: u64 = match generation {
        "0" if number.bytes().all(|b| b.is_ascii_digit()) => number.parse().map_err(|_| invalid())?,
        _ => return Err(invalid()),
    };
    number.checked_add(1).ok_or_else(invalid)
}

/// `DELETE /{db}/_local/{name}`: 404 when there is none; any revision (or none) deletes it,
/// as CouchDB deletes local documents, at `0-0`.
pub async fn delete_local(opened: OpenDb<LocalName>, uri: axum::http::Uri) -> Answer {
    check_local_path(&uri)?;
    let name = local_name(&opened.params.name)?.to_owned();
    if !opened.db.delete_local(&opened.confinement.local_name(&name)).await? {
        return Err(CouchError::missing());
    }
    Ok(json(StatusCode::OK, json!({ "ok": true, "id": format!("_local/{name}"), "rev": "0-0" })))
}

/// `/{db}/_local/{name}/{more}` (a `/` in the raw path, not `%2F` in the name) names an
/// attachment of a local document: CouchDB's 400, local documents keep none.
fn check_local_path(uri: &axum::http::Uri) -> CouchResult<()> {
    let below = uri.path().split_once("/_local/").map(|(_, name)| name).unwrap_or_default();
    if below.contains('/') {
        return Err(CouchError::bad_request("_local documents do not accept attachments."));
    }
    Ok(())
}

fn local_name(name: &str) -> CouchResult<&str> {
    if name.is_empty() {
        return Err(CouchError::missing());
    }
    Ok(name)
}
