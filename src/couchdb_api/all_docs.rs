//! `GET/POST /{db}/_all_docs`: documents in id order (raw UTF-8 collation, the backend's
//! `all_docs`), or the documents named by `keys`.
//!
//! Parameters come from the query string (JSON-encoded keys, as nano and PouchDB send them) or
//! from a POST body (the Cloudant SDKs send everything there). A range answer is streamed page by
//! page, so a request without `limit` over a large store holds one backend page at a time, each
//! page sized from the rows before it to about [`PAGE_TARGET_BYTES`] ([`PageSizer`]). A
//! per-user login's range is cut to its own ids. `total_rows` is the store's live document count
//! where the backend knows it exactly (0 for a per-user login, which must not watch others' writes); `offset` is only known when the range starts at the
//! beginning, and is `null` otherwise (see docs/couchdb-api.md). With `keys`, `descending`,
//! `skip` and `limit` pick from the keys as CouchDB's do, and `update_seq` is `null`.

use std::collections::HashMap;

use axum::body::{Body, Bytes};
use axum::extract::{Extension, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::IntoResponse;
use futures::future::FutureExt;
use futures::stream::{self, StreamExt};
use serde_json::{json, Map, Value};

use super::access::Principal;
use super::db::MAX_BULK_DOCS;
use super::error::{CouchError, CouchResult};
use super::request::{bool_param, integer_param, json_param};
use super::served_db::ServedDb;
use super::{json, Answer, CouchState};
use crate::backend::{DocumentBackend, DocumentText, IdRange, Page, StoredDocument};
// Where design documents sit among ids: no data-store id starts with `_`, so every one sorts
// either below `_design/` or above every `_design/…` id.
use crate::database::data_store_rules::{Confinement, DESIGN_PREFIX};

/// The most rows asked of the backend per page while streaming a range.
const PAGE: usize = 500;

/// Rendered bytes each page of a streamed listing aims at, from the size of the rows read so
/// far ([`PageSizer`]): what a connection whose client stops reading holds of the listing besides
/// hyper's buffer (`max_connection_buffer_bytes`), whatever the documents' size.
pub(crate) const PAGE_TARGET_BYTES: usize = 256 * 1024;

/// Rows the first page of a listing with documents (`include_docs`) asks for, before any row's
/// size is known. A listing without documents starts at its largest page: its rows (an id and a
/// revision) are small enough that [`PAGE`] of them stay well within [`PAGE_TARGET_BYTES`].
pub(crate) const FIRST_PAGE_WITH_DOCS: usize = 64;

/// The parameters, from the query string or the body, checked.
pub(crate) struct AllDocsRequest {
    pub keys: Option<Vec<String>>,
    pub range: IdRange,
    pub limit: Option<u64>,
    pub skip: u64,
    pub include_docs: bool,
    pub update_seq: bool,
    /// `conflicts=true`: documents carry `_conflicts` (with `include_docs`).
    pub conflicts: bool,
}

/// `GET /{db}/_design_docs`: `_all_docs` over the design documents' ids (passed to a backend that
/// runs its own design documents).
pub async fn get_design_docs(
    State(state): State<CouchState>,
    Extension(principal): Extension<Principal>,
    _served: ServedDb,
    Query(params): Query<HashMap<String, String>>,
    uri: axum::http::Uri,
) -> Answer {
    if state.store.backend().forwards_requests() {
        let (method, path) = (axum::http::Method::GET, "_design_docs".to_owned());
        return super::design::run(&state, &principal, method, path, uri.query(), &HeaderMap::new(), Body::empty())
            .await;
    }
    let mut request = parse_request(&query_fields(&params)?)?;
    let (low, high) = (DESIGN_PREFIX.to_owned(), "_design0".to_owned());
    let range = &mut request.range;
    if range.descending {
        range.start = Some(range.start.take().map_or(high.clone(), |start| start.min(high.clone())));
        if range.end.as_ref().is_none_or(|end| *end <= low) {
            range.end = Some(low);
            range.inclusive_end = true;
        }
    } else {
        range.start = Some(range.start.take().map_or(low.clone(), |start| start.max(low)));
        if range.end.as_ref().is_none_or(|end| *end >= high) {
            range.end = Some(high);
            range.inclusive_end = false;
        }
    }
    answer(&state, &principal, request).await
}

/// The fields of a `GET` request's query string, as JSON values.
pub(crate) fn query_fields(params: &HashMap<String, String>) -> CouchResult<Map<String, Value>> {
    let mut fields = Map::new();
    for (name, text) in params {
        let value = match name.as_str() {
            // CouchDB takes `startkey_docid`/`endkey_docid` raw (python-couchdb sends them so).
            "startkey_docid" | "endkey_docid" => Value::from(text.as_str()),
            "key" | "keys" | "startkey" | "start_key" | "endkey" | "end_key" => {
                json_param(name, Some(text))?.unwrap_or(Value::Null)
            }
            "limit" | "skip" => Value::from(integer_param(name, Some(text))?.unwrap_or(0)),
            _ => match text.as_str() {
                "true" => Value::Bool(true),
                "false" => Value::Bool(false),
                other => Value::from(other),
            },
        };
        fields.insert(name.clone(), value);
    }
    Ok(fields)
}

/// The fields of a `POST` request: its query string, then its body's members over them.
pub(crate) async fn post_fields(
    state: &CouchState,
    params: &HashMap<String, String>,
    headers: &HeaderMap,
    body: Body,
) -> CouchResult<Map<String, Value>> {
    let mut fields = Map::new();
    for (name, text) in params {
        let value = match name.as_str() {
            "limit" | "skip" => Value::from(integer_param(name, Some(text))?.unwrap_or(0)),
            "include_docs" | "descending" | "inclusive_end" | "update_seq" | "conflicts" => {
                Value::Bool(bool_param(name, Some(text), false)?)
            }
            _ => json_param(name, Some(text)).ok().flatten().unwrap_or_else(|| Value::from(text.as_str())),
        };
        fields.insert(name.clone(), value);
    }
    if let Some(body) = state.bodies.read_json(headers, body).await? {
        match body.value {
            Value::Object(map) => fields.extend(map),
            _ => return Err(CouchError::bad_request("Request body must be a JSON object")),
        }
    }
    Ok(fields)
}

pub(crate) fn parse_request(fields: &Map<String, Value>) -> CouchResult<AllDocsRequest> {
    let string_key = |names: &[&str]| -> CouchResult<Option<String>> {
        for name in names {
            match fields.get(*name) {
                None | Some(Value::Null) => {}
                Some(Value::String(text)) => return Ok(Some(text.clone())),
                Some(_) => {
                    return Err(CouchError::bad_request(format!("{name} must be a document id (a JSON string)")))
                }
            }
        }
        Ok(None)
    };
    let flag = |name: &str, default: bool| -> CouchResult<bool> {
        match fields.get(name) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(flag)) => Ok(*flag),
            Some(_) => Err(CouchError::bad_request(format!("{name} must be true or false"))),
        }
    };
    let number = |name: &str| -> CouchResult<Option<u64>> {
        match fields.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => value
                .as_u64()
                .map(Some)
                .ok_or_else(|| CouchError::bad_request(format!("{name} must be a non-negative integer"))),
        }
    };
    let keys = match fields.get("keys") {
        None | Some(Value::Null) => None,
        Some(Value::Array(keys)) if keys.len() <= MAX_BULK_DOCS => Some(
            keys.iter()
                .map(|k| {
                    k.as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| CouchError::bad_request("keys must be document ids (strings)"))
                })
                .collect::<CouchResult<Vec<_>>>()?,
        ),
        Some(Value::Array(_)) => {
            return Err(CouchError::bad_request(format!("keys may name at most {MAX_BULK_DOCS} documents")))
        }
        Some(_) => return Err(CouchError::bad_request("`keys` must be an array")),
    };
    let given = |name: &str| fields.get(name).is_some_and(|value| !value.is_null());
    if keys.is_some() && ["key", "startkey", "start_key", "endkey", "end_key"].iter().any(|name| given(name)) {
        // couch_mrview_util's check, answered before any row is read.
        return Err(CouchError::new(
            axum::http::StatusCode::BAD_REQUEST,
            "query_parse_error",
            "`keys` is incompatible with `key`, `start_key` and `end_key`",
        ));
    }
    let descending = flag("descending", false)?;
    let key = string_key(&["key"])?;
    let (start, end) = match key {
        Some(key) => (Some(key.clone()), Some(key)),
        None => (string_key(&["startkey", "start_key"])?, string_key(&["endkey", "end_key"])?),
    };
    Ok(AllDocsRequest {
        keys,
        range: IdRange { start, end, inclusive_end: flag("inclusive_end", true)?, descending, include_design: false },
        limit: number("limit")?,
        skip: number("skip")?.unwrap_or(0),
        include_docs: flag("include_docs", false)?,
        update_seq: flag("update_seq", false)?,
        conflicts: flag("conflicts", false)?,
    })
}

async fn answer(state: &CouchState, principal: &Principal, request: AllDocsRequest) -> Answer {
    let backend = state.store.backend().clone();
    let designs = design_docs_listed(backend.as_ref(), principal).await?;
    // CouchDB counts and lists design documents with the others (fixture 046: 41 documents and 2
    // design documents make `total_rows` 43). A per-user login is shown 0: the store's count
    // moves with every user's writes (docs/couchdb-api.md, "Counts").
    let total_rows = match principal.only_user() {
        Some(_) => 0,
        // The design documents are records, counted with the others.
        None => super::server::live_document_count(backend.as_ref()).await?,
    };
    if let Some(keys) = &request.keys {
        let keys = keys_page(keys, &request);
        let rows = key_rows(backend.as_ref(), principal, &keys, request.include_docs, &designs).await?;
        let mut body = json!({ "total_rows": total_rows, "offset": null, "rows": rows });
        // CouchDB answers `update_seq` with `null` when `keys` are given
        // (`fabric_view_all_docs.erl`: `{update_seq, null}` in the keys branch's meta).
        if request.update_seq {
            body["update_seq"] = Value::Null;
        }
        return Ok(json(StatusCode::OK, body));
    }
    let update_seq = if request.update_seq {
        Some(state.auth.sessions.positions().shown(principal, &backend.change_position().await?)?)
    } else {
        None
    };
    // An ascending range from "" starts at the beginning too: no id sorts before "".
    let from_the_beginning =
        request.range.start.as_deref().is_none_or(|start| start.is_empty() && !request.range.descending);
    let offset =
        if from_the_beginning && principal.only_user().is_none() { Value::from(request.skip) } else { Value::Null };
    let range = principal.confinement().clip(request.range.clone());
    let mut head = format!("{{\"total_rows\":{total_rows},\"offset\":{offset},");
    if let Some(seq) = update_seq {
        head.push_str(&format!("\"update_seq\":{},", Value::from(seq)));
    }
    head.push_str("\"rows\":[");
    let designs: Vec<StoredDocument> = designs.into_iter().filter(|doc| range.contains(&doc.id)).collect();
    let mut rows = Box::pin(range_rows(backend, principal.confinement(), range, request, designs));
    // The first page is read before the status is sent, so a backend that refuses the range
    // answers with an error status, not a 200 cut short after `"rows":[`. A failure on a later
    // page can only end the body early: the chunked transfer then ends without its last chunk,
    // which every HTTP client reports as an error, never as a complete answer.
    let first = rows.next().await.transpose()?;
    let mut response = match first {
        Some(first) => match rows.next().await.transpose()? {
            // A listing one page long (any `limit` up to a page, the common case) is sent whole:
            // one body with a length, not a chunked stream of a head, a page and a tail, which
            // costs a client the round trips of its small writes.
            None => {
                let mut whole = Vec::with_capacity(head.len() + first.len() + 5);
                whole.extend_from_slice(head.as_bytes());
                whole.extend_from_slice(&first);
                whole.extend_from_slice(b"\n]}\n");
                Body::from(whole).into_response()
            }
            Some(second) => {
                let body = stream::once(async move { Ok::<_, crate::Error>(Bytes::from(head)) })
                    .chain(stream::iter([Ok(first), Ok(second)]))
                    .chain(rows)
                    .chain(stream::once(async { Ok(Bytes::from_static(b"\n]}\n")) }));
                Body::from_stream(body).into_response()
            }
        },
        None => Body::from(format!("{head}\n]}}\n")).into_response(),
    };
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Ok(response)
}

/// The keys a `keys` request answers, as CouchDB picks them (`fabric_view_all_docs.erl`): in
/// reverse order when `descending`, then `skip` of them dropped, then at most `limit` kept.
pub(crate) fn keys_page(keys: &[String], request: &AllDocsRequest) -> Vec<String> {
    let skip = usize::try_from(request.skip).unwrap_or(usize::MAX);
    let limit = request.limit.map_or(usize::MAX, |limit| usize::try_from(limit).unwrap_or(usize::MAX));
    let ordered: Box<dyn Iterator<Item = &String>> =
        if request.range.descending { Box::new(keys.iter().rev()) } else { Box::new(keys.iter()) };
    ordered.skip(skip).take(limit).cloned().collect()
}

fn row(doc: &StoredDocument, include_docs: bool) -> Value {
    let mut row = json!({ "id": doc.id, "key": doc.id, "value": { "rev": doc.rev.as_str() } });
    if include_docs {
        row["doc"] = doc.to_json();
    }
    row
}

/// A range row without its document, written straight from the listed one: the same text as
/// [`row`]'s.
struct RowText<'a>(&'a StoredDocument);

/// A range row with its document (`include_docs`), the document's text passed on as the backend
/// listed it ([`DocumentBackend::all_docs_text`]: CouchDB's own text in front of CouchDB, never
/// parsed into values here): the same JSON as [`row`]'s.
struct TextRow<'a>(&'a DocumentText);

impl serde::Serialize for RowText<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(None)?;
        map.serialize_entry("id", &self.0.id)?;
        map.serialize_entry("key", &self.0.id)?;
        map.serialize_entry("value", &RevValue(self.0.rev.as_str()))?;
        map.end()
    }
}

impl serde::Serialize for TextRow<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(None)?;
        map.serialize_entry("id", &self.0.id)?;
        map.serialize_entry("key", &self.0.id)?;
        map.serialize_entry("value", &RevValue(self.0.rev.as_str()))?;
        map.serialize_entry("doc", &self.0.json)?;
        map.end()
    }
}

/// Adds `_conflicts` to each listed document that has any (`conflicts=true`), read from its
/// revision tree; the document's text is otherwise passed on as listed.
async fn with_conflicts(backend: &dyn DocumentBackend, docs: &mut [DocumentText]) -> crate::Result<()> {
    let ids: Vec<String> = docs.iter().map(|doc| doc.id.clone()).collect();
    let trees = super::branches::trees_of(backend, &ids).await?;
    for (doc, tree) in docs.iter_mut().zip(trees) {
        let conflicts = tree.map(|tree| tree.conflicts()).unwrap_or_default();
        let text = doc.json.get();
        let Some(open) = text.trim_end().strip_suffix('}') else { continue };
        if conflicts.is_empty() {
            continue;
        }
        let separator = if open.trim_end().ends_with('{') { "" } else { "," };
        let added = format!("{open}{separator}\"_conflicts\":{}}}", Value::from(conflicts));
        doc.json = serde_json::value::RawValue::from_string(added).map_err(|e| {
            crate::Error::new(crate::error::ErrorKind::Internal, format!("cannot add _conflicts to a row: {e}"))
        })?;
    }
    Ok(())
}

/// A row's `value`: `{"rev": …}`.
struct RevValue<'a>(&'a str);

impl serde::Serialize for RevValue<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(1))?;
        map.serialize_entry("rev", self.0)?;
        map.end()
    }
}

/// The rows of a range, as JSON text chunks (`,` between rows), one backend page at a time, with
/// `designs` (the design documents in the range, kept by this server) in their place in id order.
fn range_rows(
    backend: std::sync::Arc<dyn DocumentBackend>,
    confinement: Confinement,
    range: IdRange,
    request: AllDocsRequest,
    designs: Vec<StoredDocument>,
) -> futures::stream::BoxStream<'static, crate::Result<Bytes>> {
    let unwritable = |e: serde_json::Error| {
        crate::Error::new(crate::error::ErrorKind::Internal, format!("cannot write an _all_docs row: {e}"))
    };
    if request.include_docs {
        let conflicts = request.conflicts;
        let designs = designs.iter().map(DocumentText::of).collect::<crate::Result<Vec<_>>>();
        let fetch = move |range: IdRange, want: usize, token: Option<String>| {
            let backend = backend.clone();
            async move {
                let mut page = backend.all_docs_text(&range, want, token.as_deref()).await?;
                if conflicts {
                    with_conflicts(backend.as_ref(), &mut page.items).await?;
                }
                Ok(page)
            }
            .boxed()
        };
        let render = move |doc: &DocumentText| {
            if !doc.id.starts_with(DESIGN_PREFIX) && !confinement.admits_id(&doc.id) {
                return Ok(None);
            }
            serde_json::to_string(&TextRow(doc)).map(Some).map_err(unwritable)
        };
        return match designs {
            Ok(designs) => {
                let sizer = PageSizer::for_listing(true);
                paged_rows(spliced(fetch, range, designs), render, request.skip, request.limit, sizer).boxed()
            }
            Err(err) => stream::once(async move { Err(err) }).boxed(),
        };
    }
    let fetch = move |range: IdRange, want: usize, token: Option<String>| {
        let backend = backend.clone();
        async move { backend.all_docs(&range, want, token.as_deref()).await }.boxed()
    };
    let render = move |doc: &StoredDocument| {
        if !doc.id.starts_with(DESIGN_PREFIX) && !confinement.admits_id(&doc.id) {
            return Ok(None);
        }
        serde_json::to_string(&RowText(doc)).map(Some).map_err(unwritable)
    };
    let sizer = PageSizer::for_listing(false);
    paged_rows(spliced(fetch, range, designs), render, request.skip, request.limit, sizer).boxed()
}

/// The design documents an `_all_docs` listing shows: those this server keeps for the data-store
/// database (none where the backend runs its own, the CouchDB backend), to admins only, as every
/// design document is here.
async fn design_docs_listed(backend: &dyn DocumentBackend, principal: &Principal) -> CouchResult<Vec<StoredDocument>> {
    if backend.forwards_requests() || principal.only_user().is_some() {
        return Ok(Vec::new());
    }
    Ok(super::data_design::live_design_docs(backend).await?)
}

/// A range's pages in three parts, in the range's direction: the backend's ids on one side of the
/// design documents, the design documents (`designs`, ascending, all in the range), the
/// backend's ids on the other side. The page token says which part a page continues
/// (`0:`, `1:`, `2:`, then the backend's own token). Without design documents, the range is
/// read whole with the backend's own tokens: one backend request per page, as before there were
/// any (and always over the CouchDB backend, which lists its own).
fn spliced<T: Clone + Send + Sync + 'static>(
    fetch: impl Fn(IdRange, usize, Option<String>) -> futures::future::BoxFuture<'static, crate::Result<Page<T>>>
        + Clone
        + Send
        + Sync
        + 'static,
    range: IdRange,
    mut designs: Vec<T>,
) -> impl Fn(usize, Option<String>) -> futures::future::BoxFuture<'static, crate::Result<Page<T>>> + Clone {
    let (below, above) = (part_of(&range, DESIGN_PREFIX, true), part_of(&range, DESIGN_PREFIX, false));
    let (first, last) = if range.descending { (above, below) } else { (below, above) };
    if range.descending {
        designs.reverse();
    }
    let whole = designs.is_empty().then_some(range);
    let designs = std::sync::Arc::new(designs);
    move |want, token| {
        let (fetch, first, last, designs) = (fetch.clone(), first.clone(), last.clone(), designs.clone());
        let whole = whole.clone();
        async move {
            if let Some(range) = whole {
                return fetch(range, want, token).await;
            }
            let (part, inner) = match token.as_deref() {
                None => ("0", None),
                Some(token) => {
                    let (part, inner) = token.split_at(token.len().min(2));
                    (part.trim_end_matches(':'), Some(inner.to_owned()).filter(|inner| !inner.is_empty()))
                }
            };
            let within = |part: &IdRange| !part.holds_nothing();
            match part {
                "0" if within(&first) => {
                    let page = fetch(first, want, inner).await?;
                    let next = page.next.map_or_else(|| "1:".to_owned(), |next| format!("0:{next}"));
                    Ok(Page { items: page.items, next: Some(next) })
                }
                "0" | "1" => Ok(Page { items: designs.as_ref().clone(), next: Some("2:".to_owned()) }),
                _ if within(&last) => {
                    let page = fetch(last, want, inner).await?;
                    Ok(Page { items: page.items, next: page.next.map(|next| format!("2:{next}")) })
                }
                _ => Ok(Page { items: Vec::new(), next: None }),
            }
        }
        .boxed()
    }
}

/// The part of `range` holding the ids below `split` (`below`), or those from `split` on.
fn part_of(range: &IdRange, split: &str, below: bool) -> IdRange {
    let mut part = range.clone();
    let split_id = Some(split.to_owned());
    match (range.descending, below) {
        (false, true) if range.end.as_deref().is_none_or(|end| end >= split) => {
            part.end = split_id;
            part.inclusive_end = false;
        }
        (false, false) if range.start.as_deref().is_none_or(|start| start < split) => part.start = split_id,
        (true, true) if range.start.as_deref().is_none_or(|start| start >= split) => part.start = split_id,
        (true, false) if range.end.as_deref().is_none_or(|end| end < split) => {
            part.end = split_id;
            part.inclusive_end = true;
        }
        _ => {}
    }
    part
}

/// A listing's answer streamed: `head` (the JSON up to and including `"rows":[`), the first
/// page's rows (read before the status is sent, so a failure there is an error status), the
/// rest as they are read, then the closing `]}`.
pub(crate) fn streamed_listing(
    head: String,
    first: Option<Bytes>,
    rest: impl futures::Stream<Item = crate::Result<Bytes>> + Send + 'static,
) -> axum::response::Response {
    let body = stream::once(async move { Ok::<_, crate::Error>(Bytes::from(head)) })
        .chain(stream::iter(first.map(Ok)))
        .chain(rest)
        .chain(stream::once(async { Ok(Bytes::from_static(b"\n]}\n")) }));
    let mut response = Body::from_stream(body).into_response();
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// How many rows each page of a listing asks for. The first page's size is a guess; each next
/// page asks for as many rows of the previous page's average rendered size as fit in
/// [`PAGE_TARGET_BYTES`], at least one and at most `largest`. Small rows reach `largest` after
/// one page (few backend round trips); rows of 100 KB make pages of two. The target is aimed
/// at, not enforced: rows far larger than the previous page's make one page larger than it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PageSizer {
    next: usize,
    largest: usize,
}

impl PageSizer {
    /// A sizer whose first page asks for `first` rows and no page for more than `largest`.
    pub(crate) fn new(first: usize, largest: usize) -> Self {
        let largest = largest.max(1);
        PageSizer { next: first.clamp(1, largest), largest }
    }

    /// The sizer of an `_all_docs`-like listing: its first page [`FIRST_PAGE_WITH_DOCS`] rows when
    /// the rows carry documents, [`PAGE`] otherwise.
    pub(crate) fn for_listing(with_docs: bool) -> Self {
        PageSizer::new(if with_docs { FIRST_PAGE_WITH_DOCS } else { PAGE }, PAGE)
    }

    /// Rows the next page asks for.
    pub(crate) fn rows(&self) -> usize {
        self.next
    }

    /// Takes in what a page rendered: `rows` rows of `bytes` in all. A page that rendered no
    /// row (all hidden) tells nothing and leaves the size as it was.
    pub(crate) fn saw(&mut self, rows: usize, bytes: usize) {
        if rows == 0 {
            return;
        }
        let average = bytes.div_ceil(rows).max(1);
        self.next = (PAGE_TARGET_BYTES / average).clamp(1, self.largest);
    }
}

/// A listing's rows as JSON text chunks (`,` between rows), one page at a time: `fetch(want,
/// token)` reads a page, `render` writes an item's row (`None`: the item is not shown and does not
/// count), after `skip` shown rows and up to `limit` of them. Each page asks for no more items
/// than the rows still wanted, and no more than `sizer` gives for the rows seen so far.
pub(crate) fn paged_rows<T, F, Fut, R>(
    fetch: F,
    render: R,
    skip: u64,
    limit: Option<u64>,
    sizer: PageSizer,
) -> impl futures::Stream<Item = crate::Result<Bytes>>
where
    F: Fn(usize, Option<String>) -> Fut + Clone,
    Fut: std::future::Future<Output = crate::Result<crate::backend::Page<T>>>,
    R: Fn(&T) -> crate::Result<Option<String>> + Clone,
{
    struct Cursor {
        token: Option<String>,
        started: bool,
        done: bool,
        to_skip: u64,
        remaining: u64,
        first_row: bool,
        sizer: PageSizer,
    }
    let cursor = Cursor {
        token: None,
        started: false,
        done: false,
        to_skip: skip,
        remaining: limit.unwrap_or(u64::MAX),
        first_row: true,
        sizer,
    };
    stream::try_unfold(cursor, move |mut cursor| {
        let fetch = fetch.clone();
        let render = render.clone();
        async move {
            if cursor.done || cursor.remaining == 0 || (cursor.started && cursor.token.is_none()) {
                return Ok(None);
            }
            let wanted = cursor.remaining.saturating_add(cursor.to_skip);
            let want = usize::try_from(wanted).unwrap_or(usize::MAX).min(cursor.sizer.rows());
            let page = fetch(want.max(1), cursor.token.take()).await?;
            cursor.started = true;
            cursor.token = page.next;
            let mut chunk = String::new();
            let (mut rendered_rows, mut rendered_bytes) = (0, 0);
            for item in &page.items {
                let Some(row) = render(item)? else { continue };
                rendered_rows += 1;
                rendered_bytes += row.len();
                if cursor.to_skip > 0 {
                    cursor.to_skip -= 1;
                    continue;
                }
                if cursor.remaining == 0 {
                    cursor.done = true;
                    break;
                }
                cursor.remaining -= 1;
                if !cursor.first_row {
                    chunk.push(',');
                }
                cursor.first_row = false;
                chunk.push('\n');
                chunk.push_str(&row);
            }
            cursor.sizer.saw(rendered_rows, rendered_bytes);
            Ok(Some((Bytes::from(chunk), cursor)))
        }
    })
}

/// The rows for `keys`, in the order given: live documents, deletions (`value.deleted`, `doc:
/// null`), and `not_found` for the rest.
async fn key_rows(
    backend: &dyn DocumentBackend,
    principal: &Principal,
    keys: &[String],
    include_docs: bool,
    designs: &[StoredDocument],
) -> CouchResult<Vec<Value>> {
    let confinement = principal.confinement();
    let visible: Vec<String> =
        keys.iter().filter(|k| !k.starts_with(DESIGN_PREFIX) && confinement.admits_id(k)).cloned().collect();
    let found = backend.get_many(&visible).await?;
    let mut by_id: HashMap<&str, &StoredDocument> = HashMap::new();
    for doc in found.iter().flatten().chain(designs) {
        by_id.insert(doc.id.as_str(), doc);
    }
    let mut rows = Vec::with_capacity(keys.len());
    for key in keys {
        if let Some(doc) = by_id.get(key.as_str()) {
            rows.push(row(doc, include_docs));
            continue;
        }
        let visible = !key.starts_with(DESIGN_PREFIX) && confinement.admits_id(key);
        let info = if visible { backend.revisions(key).await? } else { None };
        match info {
            Some(info) if info.deleted => {
                let mut row = json!({ "id": key, "key": key, "value": { "rev": info.rev.as_str(), "deleted": true } });
                if include_docs {
                    row["doc"] = Value::Null;
                }
                rows.push(row);
            }
            _ => rows.push(json!({ "key": key, "error": "not_found" })),
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(start: Option<&str>, end: Option<&str>, descending: bool) -> IdRange {
        IdRange {
            start: start.map(str::to_owned),
            end: end.map(str::to_owned),
            inclusive_end: true,
            descending,
            include_design: false,
        }
    }

    #[test]
    fn a_range_is_split_around_the_design_documents_in_both_directions() {
        for descending in [false, true] {
            let whole = range(None, None, descending);
            let (below, above) = (part_of(&whole, DESIGN_PREFIX, true), part_of(&whole, DESIGN_PREFIX, false));
            for (id, low) in [("A1:x:a", true), ("Z:x:a", true), ("a:x:a", false), ("user_1:x:a", false)] {
                assert_eq!((below.contains(id), above.contains(id)), (low, !low), "{id}, descending {descending}");
            }
        }
        // A range on one side only leaves the other part empty.
        assert!(part_of(&range(Some("A"), Some("B"), false), DESIGN_PREFIX, false).holds_nothing());
        assert!(part_of(&range(Some("u"), Some("v"), false), DESIGN_PREFIX, true).holds_nothing());
        assert!(part_of(&range(Some("B"), Some("A"), true), DESIGN_PREFIX, false).holds_nothing());
        assert!(part_of(&range(Some("v"), Some("u"), true), DESIGN_PREFIX, true).holds_nothing());
    }

    /// Every id `spliced` pages through, `want` at a time, over a backend holding `ids`.
    async fn spliced_ids(ids: &[&str], designs: &[&str], whole: IdRange, want: usize) -> (Vec<String>, usize) {
        let stored: Vec<String> = ids.iter().map(|id| (*id).to_owned()).collect();
        let reads = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = std::sync::Arc::clone(&reads);
        let fetch = move |range: IdRange, want: usize, token: Option<String>| {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut listed: Vec<String> = stored.iter().filter(|id| range.contains(id)).cloned().collect();
            if range.descending {
                listed.reverse();
            }
            let from: usize = token.as_deref().and_then(|t| t.parse().ok()).unwrap_or(0);
            let items: Vec<String> = listed.iter().skip(from).take(want).cloned().collect();
            let next = (from + want < listed.len()).then(|| (from + want).to_string());
            async move { Ok(Page { items, next }) }.boxed()
        };
        let pages = spliced(fetch, whole, designs.iter().map(|id| (*id).to_owned()).collect());
        let (mut seen, mut token) = (Vec::new(), None);
        loop {
            let page = pages(want, token).await.unwrap();
            seen.extend(page.items);
            match page.next {
                Some(next) => token = Some(next),
                None => break,
            }
        }
        (seen, reads.load(std::sync::atomic::Ordering::SeqCst))
    }

    #[tokio::test]
    async fn design_documents_are_listed_between_the_two_parts_of_a_range() {
        let ids = ["A1", "B2", "u1", "u2", "u3"];
        let designs = ["_design/a", "_design/b"];
        let ascending = ["A1", "B2", "_design/a", "_design/b", "u1", "u2", "u3"];
        let (seen, _) = spliced_ids(&ids, &designs, range(None, None, false), 2).await;
        assert_eq!(seen, ascending);
        let (seen, _) = spliced_ids(&ids, &designs, range(None, None, true), 2).await;
        assert_eq!(seen, ascending.iter().rev().copied().collect::<Vec<_>>());
        let (seen, _) = spliced_ids(&ids, &designs, range(Some("B"), Some("u2"), false), 1).await;
        assert_eq!(seen, ["B2", "_design/a", "_design/b", "u1", "u2"]);
        // Without design documents the range is read whole: one backend read per page.
        let (seen, reads) = spliced_ids(&ids, &[], range(None, None, false), 5).await;
        assert_eq!((seen, reads), (ids.iter().map(|id| (*id).to_owned()).collect::<Vec<_>>(), 1));
    }

    /// The rows each page asks for while `paged_rows` lists `count` items rendered as rows of
    /// `row_bytes` bytes each, `limit` of them at most, with a listing's sizer.
    async fn page_sizes(count: usize, row_bytes: usize, limit: Option<u64>, with_docs: bool) -> Vec<usize> {
        let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let asks = std::sync::Arc::clone(&asked);
        let fetch = move |want: usize, token: Option<String>| {
            asks.lock().unwrap().push(want);
            let from: usize = token.as_deref().and_then(|t| t.parse().ok()).unwrap_or(0);
            let until = (from + want).min(count);
            let next = (until < count).then(|| until.to_string());
            async move { Ok(Page { items: (from..until).collect::<Vec<usize>>(), next }) }
        };
        let render = move |_: &usize| Ok(Some("x".repeat(row_bytes)));
        let sizer = PageSizer::for_listing(with_docs);
        let chunks: Vec<Bytes> = paged_rows(fetch, render, 0, limit, sizer).map(|chunk| chunk.unwrap()).collect().await;
        let rows: usize = chunks.iter().map(|chunk| chunk.iter().filter(|byte| **byte == b'\n').count()).sum();
        assert_eq!(rows, limit.map_or(count, |limit| count.min(limit as usize)), "every row is listed once");
        let asked = asked.lock().unwrap().clone();
        asked
    }

    #[tokio::test]
    async fn pages_are_sized_by_the_bytes_of_their_rows() {
        // Documents of 100 KB: after the first page, pages of two rows (256 KiB at most).
        let large = page_sizes(100, 100_000, None, true).await;
        assert_eq!(large[0], FIRST_PAGE_WITH_DOCS);
        assert!(large[1..].iter().all(|&rows| rows * 100_000 <= PAGE_TARGET_BYTES), "{large:?}");
        // Documents of 50 bytes: the second page is the largest, so a listing of 564 rows costs
        // two backend reads.
        assert_eq!(page_sizes(564, 50, None, true).await, [FIRST_PAGE_WITH_DOCS, PAGE]);
        // Rows without documents start at the largest page: one read for up to 500 rows.
        assert_eq!(page_sizes(500, 90, None, false).await, [PAGE]);
        // A limit below the first page is asked for as it is.
        assert_eq!(page_sizes(100, 50, Some(20), true).await, [20]);
        // Documents past the target: one row a page after the first.
        let huge = page_sizes(70, 1_000_000, None, true).await;
        assert_eq!(huge, [FIRST_PAGE_WITH_DOCS, 1, 1, 1, 1, 1, 1]);
        // Rows of mixed sizes follow the previous page's average.
        let mut sizer = PageSizer::for_listing(true);
        sizer.saw(64, 64 * 2_100);
        assert_eq!(sizer.rows(), PAGE_TARGET_BYTES / 2_100);
        sizer.saw(0, 0);
        assert_eq!(sizer.rows(), PAGE_TARGET_BYTES / 2_100, "a page of hidden rows changes nothing");
    }

    #[test]
    fn a_row_written_in_place_is_the_row_built_as_a_value() {
        let body: Map<String, Value> =
            serde_json::from_str(r#"{"userId":"u","value":{"a":[1,2.5,null,"é"]},"z":true,"_attachments":{}}"#)
                .unwrap();
        let doc = StoredDocument { id: "u:n:aw==".into(), rev: crate::backend::Revision("1-ab".into()), body };
        let written = serde_json::to_string(&RowText(&doc)).unwrap();
        assert_eq!(written, row(&doc, false).to_string(), "without the document");
        let text = DocumentText::of(&doc).unwrap();
        let written = serde_json::to_string(&TextRow(&text)).unwrap();
        assert_eq!(written, row(&doc, true).to_string(), "with the document");
    }

    #[test]
    fn parameters_are_read_from_json_fields() {
        let fields: Map<String, Value> =
            serde_json::from_str(r#"{"start_key":"a","endkey":"b","limit":2,"include_docs":true,"descending":true}"#)
                .unwrap();
        let request = parse_request(&fields).unwrap();
        assert_eq!(request.range.start.as_deref(), Some("a"));
        assert!(request.range.descending && request.include_docs);
        assert_eq!(request.limit, Some(2));
        let bad: Map<String, Value> = serde_json::from_str(r#"{"startkey":1}"#).unwrap();
        assert!(parse_request(&bad).is_err());
    }
}
