//! Views answered from this process's index ([`crate::views`]), on every database whose
//! backend does not forward requests (the embedded store, DynamoDB, Firestore): the databases
//! of [`crate::database`] and the data-store database alike. `GET/POST
//! /{db}/_design/{ddoc}/_view/{view}`, `POST …/_view/{view}/queries`, `GET
//! /{db}/_design/{ddoc}/_info` and `POST /{db}/_view_cleanup`. Over the CouchDB backend these
//! requests are forwarded before they reach here, and CouchDB answers them itself.
//!
//! Every database is an engine [`Database`] and its own [`crate::views::ViewSource`] (its feed,
//! its view incarnation read at every use, so a purge or `purge_user` in another process reaches
//! the index). What the data-store database adds is in [`Viewed`]: `_view_cleanup` keeps its
//! created Mango indexes' groups too, and `update_seq` shows its feed's positions as its
//! `_changes` does (the backend's own tokens).
//!
//! On a database of [`crate::database`], anyone who may read it may query its views (a view
//! holds only that database's documents), as in CouchDB. On the data-store database, views are
//! for admins (`OpenDb` refuses a design document's routes to a per-user login): a view reads
//! every user's documents.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, Method, StatusCode};
use futures::stream::{self, BoxStream, StreamExt, TryStreamExt};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::{leaf_json, DocOptions, OpenDb};
use crate::backend::IdRange;
use crate::couchdb_api::error::{CouchError, CouchResult};
use crate::couchdb_api::listing::streamed_listing;
use crate::couchdb_api::{json, Answer, CouchState};
use crate::database::Database;
use crate::views::design::DesignViews;
use crate::views::index_store::IndexRow;
use crate::views::query::{Plan, Update, ViewQuery};
use crate::views::run::{map_rows, reduce_rows, ReduceRunner};
use crate::views::updater::ReadyGroup;
use crate::views::{ViewError, ViewSource};

/// Rows whose documents are read together for `include_docs`.
const DOCS_PER_READ: usize = 64;

/// A query string's parameters in the order the client wrote them: CouchDB reads them in that
/// order, so `key=1&end_key=3` and `end_key=3&key=1` differ (a later `key` sets both ends).
pub(crate) type OrderedParams = Vec<(String, String)>;

#[derive(Deserialize)]
pub(crate) struct ViewPath {
    ddoc: String,
    view: String,
}

#[derive(Deserialize)]
pub(crate) struct DesignPath {
    ddoc: String,
}

impl From<ViewError> for CouchError {
    fn from(err: ViewError) -> Self {
        match err {
            ViewError::QueryParse(reason) => CouchError::new(StatusCode::BAD_REQUEST, "query_parse_error", reason),
            ViewError::BadRequest(reason) => CouchError::bad_request(reason),
            ViewError::NotFound(reason) => CouchError::not_found(reason),
            ViewError::InvalidDesign(reason) => CouchError::new(StatusCode::BAD_REQUEST, "invalid_design_doc", reason),
            ViewError::Reduce(error) => CouchError::new(StatusCode::BAD_REQUEST, "builtin_reduce_error", error.reason),
            ViewError::Function { error, reason } => CouchError::new(StatusCode::BAD_REQUEST, error, reason),
            ViewError::Busy => CouchError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_requests",
                "every JavaScript worker is busy (couchdb_js_workers); try again",
            ),
            ViewError::IndexFull(reason) => CouchError::new(StatusCode::PAYLOAD_TOO_LARGE, "too_large", reason),
            ViewError::Storage(error) => CouchError::from(error),
        }
    }
}

/// The database a view request is on, and whether it is the data-store database (what differs:
/// its created Mango indexes' groups, the positions its feed shows).
#[derive(Clone)]
pub(crate) struct Viewed {
    db: Arc<Database>,
    data_store: bool,
}

impl Viewed {
    /// The opened database of a request.
    fn of(state: &CouchState, db: &Arc<Database>) -> Self {
        Viewed { db: Arc::clone(db), data_store: super::is_data_store(state, db) }
    }

    fn source(&self) -> Arc<dyn ViewSource> {
        Arc::clone(&self.db) as Arc<dyn ViewSource>
    }

    /// The design document `_design/{name}`'s views (404 `missing` / `deleted` as CouchDB).
    async fn design(&self, name: &str) -> CouchResult<DesignViews> {
        let id = format!("_design/{name}");
        let state = self.db.read(&id).await?.ok_or_else(CouchError::missing)?;
        if state.deleted() {
            return Err(CouchError::deleted());
        }
        // Parsed once per write of the document ([`crate::database::parsed_designs`]).
        if let Some(kept) = self.db.parsed_designs().get::<DesignViews>(&id, &state) {
            return Ok(DesignViews::clone(&kept));
        }
        let winner = state.tree.winner().ok_or_else(CouchError::missing)?;
        let doc = leaf_json(&id, &state.tree, winner, DocOptions::default());
        let design = DesignViews::parse(&doc).map_err(|invalid| ViewError::InvalidDesign(invalid.0))?;
        let design = design.in_database(self.source().name());
        self.db.parsed_designs().keep(&id, &state, Arc::new(design.clone()));
        Ok(design)
    }

    /// The signatures of every live design document's views (`_view_cleanup` keeps them).
    async fn signatures(&self) -> CouchResult<Vec<String>> {
        let mut keep = Vec::new();
        let range = IdRange::design_documents();
        let mut token: Option<String> = None;
        loop {
            let page = self.db.all_docs(&range, 100, token.as_deref()).await?;
            for (id, state) in &page.items {
                if let Some(winner) = state.tree.winner() {
                    let doc = leaf_json(id, &state.tree, winner, DocOptions::default());
                    if let Ok(design) = DesignViews::parse(&doc) {
                        keep.push(design.signature);
                    }
                }
            }
            match page.next {
                Some(next) => token = Some(next),
                None => break,
            }
        }
        if self.data_store {
            // Its created Mango indexes are groups too, recorded in its index catalog.
            keep.extend(crate::mango::index::data_store_signatures(self.db.backend().as_ref()).await?);
        }
        Ok(keep)
    }
}

/// `GET/POST /{db}/_design/{ddoc}/_view/{view}`.
pub async fn view(
    State(state): State<CouchState>,
    opened: OpenDb<ViewPath>,
    method: Method,
    Query(params): Query<OrderedParams>,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    let viewed = Viewed::of(&state, &opened.db);
    view_answer(&state, &viewed, &opened.params.ddoc, &opened.params.view, method, &params, &headers, body).await
}

/// A view's answer: the query from `params` and, for a `POST`, the body.
#[allow(clippy::too_many_arguments)]
async fn view_answer(
    state: &CouchState,
    viewed: &Viewed,
    ddoc: &str,
    view: &str,
    method: Method,
    params: &[(String, String)],
    headers: &HeaderMap,
    body: Body,
) -> Answer {
    let mut query = parsed_params(params)?;
    if method == Method::POST {
        if let Some(body) = read_object(state, headers, body).await? {
            query.merge_body(&body)?;
        }
    } else if method != Method::GET && method != Method::HEAD {
        return Err(method_not_allowed("GET,HEAD,POST"));
    }
    let design = viewed.design(ddoc).await?;
    Ok(prepared(state, viewed, &design, view, query).await?.into_response())
}

fn parsed_params(params: &[(String, String)]) -> Result<ViewQuery, ViewError> {
    ViewQuery::parse(params.iter().map(|(k, v)| (k.as_str(), v.as_str())))
}

/// `POST /{db}/_design/{ddoc}/_view/{view}/queries`: several queries of one view, answered in
/// order as `{"results": [...]}`.
pub async fn view_queries(
    State(state): State<CouchState>,
    opened: OpenDb<ViewPath>,
    Query(params): Query<OrderedParams>,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    let viewed = Viewed::of(&state, &opened.db);
    queries_answer(&state, &viewed, &opened.params.ddoc, &opened.params.view, &params, &headers, body).await
}

/// The answer of `…/_view/{view}/queries`, on any database, streamed as CouchDB streams it:
/// every query is checked first (a bad one is a 400 before anything is sent), then each is
/// answered in turn, its rows written as they are read, so the answer holds one query's rows in
/// flight at a time however many queries there are (`couchdb_max_view_queries` at most: CouchDB
/// sets none, only its body limit; the bound is on the work one request queues, not on memory,
/// docs/bounds.md).
async fn queries_answer(
    state: &CouchState,
    viewed: &Viewed,
    ddoc: &str,
    view: &str,
    params: &[(String, String)],
    headers: &HeaderMap,
    body: Body,
) -> Answer {
    let body = read_object(state, headers, body).await?.unwrap_or_default();
    let Some(Value::Array(queries)) = body.get("queries") else {
        return Err(CouchError::bad_request("`queries` member must be an array"));
    };
    if queries.len() > state.max_view_queries {
        return Err(CouchError::bad_request(format!(
            "`queries` must not hold more than {} queries (couchdb_max_view_queries)",
            state.max_view_queries
        )));
    }
    let design = viewed.design(ddoc).await?;
    let checked = checked_queries(params, queries, &design, view)?;
    let mut queries = checked.into_iter();
    let Some(first) = queries.next() else {
        return Ok(streamed_listing("{\"results\":[".to_owned(), None, stream::empty()));
    };
    // The first answer is prepared before the status is sent, so its failure (an index that
    // cannot be brought up to date, say) is an error status, as a single query's is.
    let first = prepared(state, viewed, &design, view, first).await?.into_chunks();
    let (state, viewed, design, view) = (state.clone(), viewed.clone(), design.clone(), view.to_owned());
    let rest = stream::iter(queries)
        .then(move |query| {
            let (state, viewed, design, view) = (state.clone(), viewed.clone(), design.clone(), view.clone());
            async move {
                let answer = prepared(&state, &viewed, &design, &view, query)
                    .await
                    .map_err(|err| crate::Error::new(crate::error::ErrorKind::Internal, err.reason))?;
                Ok::<_, crate::Error>(
                    stream::once(async { Ok(Bytes::from_static(b",\n")) }).chain(answer.into_chunks()),
                )
            }
        })
        .try_flatten();
    Ok(streamed_listing("{\"results\":[\n".to_owned(), None, first.chain(rest)))
}

/// Each query of a `queries` body parsed over the query string's parameters and checked
/// against the view, as CouchDB does before it answers any: each starts from the query string
/// without its `keys`, `group` and `group_level` (`couch_mrview_http:parse_params` clears them
/// for every query).
fn checked_queries(
    params: &[(String, String)],
    queries: &[Value],
    design: &DesignViews,
    view: &str,
) -> CouchResult<Vec<ViewQuery>> {
    let (_, spec) = design.view(view).ok_or_else(|| CouchError::not_found("missing_named_view"))?;
    let mut base = parsed_params(params)?;
    base.keys = None;
    base.group = None;
    base.group_level = None;
    let mut checked = Vec::with_capacity(queries.len());
    for each in queries {
        let Value::Object(fields) = each else {
            return Err(CouchError::bad_request("each query must be an object"));
        };
        let mut query = base.clone();
        query.merge_body(fields)?;
        query.plan(spec.reduce.is_some())?;
        checked.push(query);
    }
    Ok(checked)
}

/// `GET /{db}/_design/{ddoc}/_info`.
pub async fn design_info(State(state): State<CouchState>, opened: OpenDb<DesignPath>) -> Answer {
    info_answer(&state, &Viewed::of(&state, &opened.db), &opened.params.ddoc).await
}

/// The answer of `_design/{ddoc}/_info`, on any database.
async fn info_answer(state: &CouchState, viewed: &Viewed, ddoc: &str) -> Answer {
    let design = viewed.design(ddoc).await?;
    let indexer = state.views.indexer().await?;
    let group = indexer.current(viewed.source().as_ref(), &design).await?;
    let language = match design.language {
        crate::views::design::Language::JavaScript => "javascript",
        crate::views::design::Language::Query => "query",
    };
    Ok(json(
        StatusCode::OK,
        json!({
            "name": ddoc,
            "view_index": {
                "signature": design.signature,
                "language": language,
                "sizes": {"active": 0, "external": 0, "file": 0},
                "update_seq": shown_seq(viewed, &group).await?,
                "purge_seq": 0,
                "updater_running": false,
                "compact_running": false,
                "waiting_clients": 0,
                "waiting_commit": false,
            }
        }),
    ))
}

/// `POST /{db}/_view_cleanup`: drops the indexes no design document of the database uses.
pub async fn view_cleanup(State(state): State<CouchState>, opened: OpenDb, headers: HeaderMap) -> Answer {
    opened.access.require_db_admin_to_compact()?;
    cleanup_answer(&state, &Viewed::of(&state, &opened.db), &headers).await
}

/// The answer of `_view_cleanup`, on any database (its caller checked who asks).
async fn cleanup_answer(state: &CouchState, viewed: &Viewed, headers: &HeaderMap) -> Answer {
    crate::couchdb_api::request::require_json_content_type(headers)?;
    let keep = viewed.signatures().await?;
    let source = viewed.source();
    let dropped = state.views.indexer().await?.clean_up(source.as_ref(), &keep).await?;
    tracing::debug!(database = source.name(), dropped, "view cleanup");
    Ok(json(StatusCode::ACCEPTED, json!({ "ok": true })))
}

fn method_not_allowed(allowed: &str) -> CouchError {
    CouchError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", format!("Only {allowed} allowed"))
}

async fn read_object(state: &CouchState, headers: &HeaderMap, body: Body) -> CouchResult<Option<Map<String, Value>>> {
    match state.bodies.read_json(headers, body).await? {
        None => Ok(None),
        Some(body) => match body.value {
            Value::Object(map) => Ok(Some(map)),
            _ => Err(CouchError::bad_request("Request body must be a JSON object")),
        },
    }
}

/// The group's feed position as the database's `_changes` shows a sequence.
async fn shown_seq(viewed: &Viewed, group: &ReadyGroup) -> crate::Result<Value> {
    let db = &viewed.db;
    Ok(match &group.state.checkpoint {
        None => Value::from(0),
        // The data-store database's feed shows its backend's tokens as they are.
        Some(token) if viewed.data_store => Value::from(token.as_str()),
        Some(token) => Value::from(
            db.while_open(crate::database::seq::shown_position(db.backend().as_ref(), db.erased_doc(), token)).await?,
        ),
    })
}

/// One query's answer, ready to be written: a reduce's rows (held, as they are few next to the
/// rows they reduce), or a map answer's head and its rows as they are read.
enum Prepared {
    Reduce(Value),
    Map { head: String, rows: BoxStream<'static, crate::Result<Bytes>> },
}

impl Prepared {
    /// The answer of a query on its own.
    fn into_response(self) -> axum::response::Response {
        match self {
            Prepared::Reduce(body) => json(StatusCode::OK, body),
            Prepared::Map { head, rows } => streamed_listing(head, None, rows),
        }
    }

    /// The answer as JSON text chunks, to be written inside a larger answer (`queries`).
    fn into_chunks(self) -> BoxStream<'static, crate::Result<Bytes>> {
        match self {
            Prepared::Reduce(body) => stream::once(async move { Ok(Bytes::from(body.to_string())) }).boxed(),
            Prepared::Map { head, rows } => stream::once(async move { Ok(Bytes::from(head)) })
                .chain(rows)
                .chain(stream::once(async { Ok(Bytes::from_static(b"\n]}")) }))
                .boxed(),
        }
    }
}

/// Brings the view's index up to date as `query` asks and starts its answer.
async fn prepared(
    state: &CouchState,
    viewed: &Viewed,
    design: &DesignViews,
    view_name: &str,
    query: ViewQuery,
) -> CouchResult<Prepared> {
    let (number, spec) = design.view(view_name).ok_or_else(|| CouchError::not_found("missing_named_view"))?;
    let plan = query.plan(spec.reduce.is_some())?;
    let indexer = Arc::clone(state.views.indexer().await?);
    let source = viewed.source();
    let group = match query.update {
        Update::True => indexer.catch_up(source.as_ref(), design).await?,
        Update::False => indexer.current(source.as_ref(), design).await?,
        Update::Lazy => {
            let group = indexer.current(source.as_ref(), design).await?;
            let (design, indexer) = (design.clone(), Arc::clone(&indexer));
            tokio::spawn(async move {
                if let Err(err) = indexer.catch_up(source.as_ref(), &design).await {
                    tracing::warn!(database = source.name(), design = design.id, %err, "lazy view update failed");
                }
            });
            group
        }
    };
    let store = Arc::clone(indexer.store());
    match plan {
        Plan::Reduce { ranges, grouping } => {
            let reduce = spec.reduce.as_ref().ok_or_else(|| CouchError::internal("a reduce plan without a reduce"))?;
            let reducer = ReduceRunner::of(reduce, state.views.reducer(), design, view_name);
            let rows = reduce_rows(
                store,
                group.state.number,
                number,
                ranges,
                query.descending,
                grouping,
                &reducer,
                query.skip,
                query.limit,
            )
            .await?;
            let rows: Vec<Value> = rows.into_iter().map(|(key, value)| json!({"key": key, "value": value})).collect();
            let mut body = json!({ "rows": rows });
            if query.update_seq {
                body["update_seq"] = shown_seq(viewed, &group).await?;
            }
            Ok(Prepared::Reduce(body))
        }
        Plan::Map { ranges } => {
            let total_rows = group.state.row_counts.get(number).copied().unwrap_or(0);
            let answer =
                map_rows(store, group.state.number, number, ranges, query.descending, query.skip, query.limit).await?;
            let mut head = format!("{{\"total_rows\":{total_rows},\"offset\":{}", answer.offset);
            if query.update_seq {
                head.push_str(&format!(",\"update_seq\":{}", shown_seq(viewed, &group).await?));
            }
            head.push_str(",\"rows\":[\n");
            let docs = query.include_docs.then(|| IncludedDocs {
                viewed: viewed.clone(),
                options: DocOptions { conflicts: query.conflicts.unwrap_or(false), ..DocOptions::default() },
                inline: query.attachments.then_some(super::attachments::Inline { since: None }),
            });
            Ok(Prepared::Map { head, rows: rendered_rows(answer.rows, docs) })
        }
    }
}

/// What `include_docs` adds to each row: the documents of this database, shown with these
/// options, attachments inline when `attachments=true` (the data-store database keeps none).
struct IncludedDocs {
    viewed: Viewed,
    options: DocOptions,
    inline: Option<super::attachments::Inline>,
}

/// A map row as written: written straight from the row read (no `serde_json::Value` built for it
/// and copied into; issue 38), members in CouchDB's order.
#[derive(serde::Serialize)]
struct ShownRow<'a> {
    id: &'a str,
    key: &'a Value,
    value: &'a Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    doc: Option<&'a Value>,
}

/// The map rows as JSON text chunks, documents read in batches when `docs` is given.
fn rendered_rows(
    rows: tokio::sync::mpsc::Receiver<Result<IndexRow, ViewError>>,
    docs: Option<IncludedDocs>,
) -> BoxStream<'static, crate::Result<Bytes>> {
    struct Cursor {
        rows: tokio::sync::mpsc::Receiver<Result<IndexRow, ViewError>>,
        docs: Option<IncludedDocs>,
        first: bool,
    }
    let cursor = Cursor { rows, docs, first: true };
    stream::try_unfold(cursor, |mut cursor| async move {
        let Some(first) = cursor.rows.recv().await else {
            return Ok(None);
        };
        let mut batch = vec![first];
        while batch.len() < DOCS_PER_READ {
            match cursor.rows.try_recv() {
                Ok(row) => batch.push(row),
                Err(_) => break,
            }
        }
        let batch: Vec<IndexRow> = batch
            .into_iter()
            .collect::<Result<_, ViewError>>()
            .map_err(|err| crate::Error::new(crate::error::ErrorKind::Internal, err.to_string()))?;
        let shown_docs = match &cursor.docs {
            Some(included) => Some(included_docs(included, &batch).await?),
            None => None,
        };
        let mut chunk = String::new();
        for (i, row) in batch.iter().enumerate() {
            if !cursor.first {
                chunk.push_str(",\n");
            }
            cursor.first = false;
            let doc = shown_docs.as_ref().map(|docs| docs.get(i).unwrap_or(&Value::Null));
            let shown = ShownRow { id: &row.id, key: &row.key, value: &row.value, doc };
            let text = serde_json::to_string(&shown)
                .map_err(|err| crate::Error::new(crate::error::ErrorKind::Internal, format!("a view row: {err}")))?;
            chunk.push_str(&text);
        }
        Ok(Some((Bytes::from(chunk), cursor)))
    })
    .boxed()
}

/// The document each row includes: the one a value `{"_id": …}` links to, else the row's own;
/// `null` when it does not exist or is deleted.
async fn included_docs(included: &IncludedDocs, rows: &[IndexRow]) -> crate::Result<Vec<Value>> {
    let ids: Vec<String> = rows
        .iter()
        .map(|row| row.value.get("_id").and_then(Value::as_str).map(str::to_owned).unwrap_or_else(|| row.id.clone()))
        .collect();
    let db = &included.viewed.db;
    let states = db.read_many(&ids).await?;
    let mut docs = Vec::with_capacity(rows.len());
    for ((id, row), state) in ids.iter().zip(rows).zip(states) {
        let Some(state) = state else {
            docs.push(Value::Null);
            continue;
        };
        let wanted_rev = row.value.get("_rev").and_then(Value::as_str);
        let leaf = match wanted_rev {
            Some(rev) => state.tree.leaves().into_iter().find(|leaf| leaf.path.leaf_rev() == rev),
            None => state.tree.winner().filter(|winner| !winner.deleted),
        };
        let Some(leaf) = leaf else {
            docs.push(Value::Null);
            continue;
        };
        let mut doc = leaf_json(id, &state.tree, leaf, included.options);
        if let Some(inline) = &included.inline {
            super::attachments::inline_into(db, leaf, &mut doc, inline).await.map_err(CouchError::carried)?;
        }
        docs.push(doc);
    }
    Ok(docs)
}
