//! `GET/POST /{db}/_changes`: the backend's change feed in CouchDB's shape.
//!
//! - `feed=normal` streams every change after `since` (up to `limit`), page by page, then
//!   `last_seq` and `pending`; `longpoll` does the same but, with nothing to report, waits until a
//!   change arrives or `timeout` passes; `continuous` writes one line per change as they come,
//!   ending at `timeout` (unless `heartbeat` keeps it open) with a `last_seq` line.
//! - `since` is `0`, `now` or a token from an earlier `last_seq`/`seq`. Tokens are opaque
//!   strings; `pending` is always given, so replicators that cannot compare them know when they
//!   are done.
//! - `filter=_doc_ids` (`doc_ids` in the query or body) and `filter=_selector` (a Mango selector in
//!   the body) narrow the rows; a per-user login sees only its own documents. `style=all_docs`
//!   and `main_only` are the same here: a document has one leaf.
//! - While waiting, the request ends at once when the server shuts down or the client goes away
//!   (the connection task drops the stream). `heartbeat` writes a newline while idle.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Extension, Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::IntoResponse;
use futures::stream;
use serde_json::{json, Map, Value};
use tokio::sync::watch;
use tokio::time::Instant;

use super::access::Principal;
use super::document::doc_json;
use super::error::{CouchError, CouchResult};
use super::request::{bool_param, integer_param, json_param};
use super::{Answer, CouchState};
use crate::backend::{Change, DocumentBackend};
use crate::changes::{read_page, resolve_since, DeliveredTail, PollBackoff, DEFAULT_PAGE};

/// CouchDB's default `timeout` for longpoll and continuous feeds.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// The longest pause between two polls of an idle feed.
const POLL_CEILING: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Feed {
    Normal,
    Longpoll,
    Continuous,
}

/// A predicate over a change's document (the `_selector` filter).
pub(crate) type DocumentPredicate = Box<dyn Fn(&Value) -> bool + Send + Sync>;

/// Which changes a request wants.
enum Filter {
    All,
    DocIds(HashSet<String>),
    Selector(DocumentPredicate),
}

/// The checked request.
struct ChangesRequest {
    feed: Feed,
    since: Option<String>,
    limit: Option<u64>,
    include_docs: bool,
    timeout: Duration,
    heartbeat: Option<Duration>,
    filter: Filter,
}

/// `GET /{db}/_changes`.
pub async fn get_changes(
    State(state): State<CouchState>,
    Extension(principal): Extension<Principal>,
    Path(db): Path<String>,
    Query(params): Query<HashMap<String, String>>,
) -> Answer {
    state.check_db(&db)?;
    let request = parse_request(&params, None)?;
    respond(&state, principal, request).await
}

/// `POST /{db}/_changes`: the same, with `doc_ids` or `selector` in the body.
pub async fn post_changes(
    State(state): State<CouchState>,
    Extension(principal): Extension<Principal>,
    Path(db): Path<String>,
    Query(params): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    state.check_db(&db)?;
    let body = match state.bodies.read_json(&headers, body).await? {
        None => None,
        Some(body) => match body.value {
            Value::Object(map) => Some(map),
            _ => return Err(CouchError::bad_request("Request body must be a JSON object")),
        },
    };
    let request = parse_request(&params, body.as_ref())?;
    respond(&state, principal, request).await
}

fn parse_request(params: &HashMap<String, String>, body: Option<&Map<String, Value>>) -> CouchResult<ChangesRequest> {
    let param = |name: &str| params.get(name).map(String::as_str);
    let feed = match param("feed") {
        None | Some("normal") => Feed::Normal,
        Some("longpoll") => Feed::Longpoll,
        Some("continuous") => Feed::Continuous,
        Some(other) => {
            return Err(CouchError::bad_request(format!(
                "Supported `feed` types: normal, continuous, longpoll (not {other:?})"
            )))
        }
    };
    if bool_param("descending", param("descending"), false)? {
        return Err(CouchError::bad_request("descending=true is not supported on _changes by agentstore"));
    }
    let heartbeat = match param("heartbeat") {
        None | Some("false") => None,
        Some("true") => Some(DEFAULT_TIMEOUT),
        Some(ms) => Some(Duration::from_millis(integer_param("heartbeat", Some(ms))?.unwrap_or(60_000).max(1))),
    };
    let timeout = integer_param("timeout", param("timeout"))?.map(Duration::from_millis).unwrap_or(DEFAULT_TIMEOUT);
    let filter = match param("filter") {
        None => Filter::All,
        Some("_doc_ids") => Filter::DocIds(doc_ids(param("doc_ids"), body)?),
        Some("_selector") => Filter::Selector(selector(body)?),
        Some(other) => {
            return Err(CouchError::bad_request(format!(
            "filter {other:?} is not supported: agentstore runs no design-document filters; use _doc_ids or _selector"
        )))
        }
    };
    let since = match param("since") {
        Some(text) => Some(text.to_owned()),
        None => {
            body.and_then(|b| b.get("since")).map(|v| v.as_str().map(str::to_owned).unwrap_or_else(|| v.to_string()))
        }
    };
    Ok(ChangesRequest {
        feed,
        since,
        limit: integer_param("limit", param("limit"))?,
        include_docs: bool_param("include_docs", param("include_docs"), false)?,
        timeout,
        heartbeat,
        filter,
    })
}

fn doc_ids(query: Option<&str>, body: Option<&Map<String, Value>>) -> CouchResult<HashSet<String>> {
    let ids = match (query, body.and_then(|b| b.get("doc_ids"))) {
        (_, Some(ids)) => ids.clone(),
        (Some(text), None) => json_param("doc_ids", Some(text))?.unwrap_or(Value::Null),
        (None, None) => return Err(CouchError::bad_request("filter=_doc_ids needs a `doc_ids` array")),
    };
    match ids {
        Value::Array(ids) => ids
            .into_iter()
            .map(|id| {
                id.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| CouchError::bad_request("`doc_ids` must be an array of strings"))
            })
            .collect(),
        _ => Err(CouchError::bad_request("`doc_ids` must be an array of strings")),
    }
}

fn selector(body: Option<&Map<String, Value>>) -> CouchResult<DocumentPredicate> {
    let Some(selector) = body.and_then(|b| b.get("selector")) else {
        return Err(CouchError::bad_request("filter=_selector needs a `selector` object in the body"));
    };
    super::query::selector_filter(selector)
}

/// Where the stream is.
struct Cursor {
    backend: Arc<dyn DocumentBackend>,
    principal: Principal,
    request: Arc<ChangesRequest>,
    since: Option<String>,
    last_seq: String,
    pending: u64,
    rows_sent: u64,
    phase: Phase,
    deadline: Instant,
    backoff: PollBackoff,
    stopping: watch::Receiver<bool>,
    /// The unsettled changes this answer sent, not to be sent again when they settle.
    delivered: DeliveredTail,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Start,
    Reading,
    Finished,
}

async fn respond(
    state: &CouchState,
    principal: Principal,
    request: ChangesRequest,
) -> CouchResult<axum::response::Response> {
    let backend = state.store.backend().clone();
    let since = resolve_since(backend.as_ref(), request.since.as_deref()).await?;
    let last_seq = match &since {
        Some(position) => position.clone(),
        None => "0".to_owned(),
    };
    let cursor = Cursor {
        backend,
        principal,
        deadline: Instant::now() + request.timeout,
        request: Arc::new(request),
        since,
        last_seq,
        pending: 0,
        rows_sent: 0,
        phase: Phase::Start,
        backoff: PollBackoff::new(POLL_CEILING),
        stopping: state.stopping.clone(),
        delivered: DeliveredTail::default(),
    };
    let body = stream::try_unfold(cursor, |mut cursor| async move {
        let chunk = match cursor.phase {
            Phase::Finished => return Ok::<_, crate::Error>(None),
            Phase::Start => {
                cursor.phase = Phase::Reading;
                if cursor.request.feed == Feed::Continuous {
                    String::new()
                } else {
                    "{\"results\":[".to_owned()
                }
            }
            Phase::Reading => step(&mut cursor).await?,
        };
        Ok(Some((Bytes::from(chunk), cursor)))
    });
    let mut response = Body::from_stream(body).into_response();
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Ok(response)
}

/// One step of the stream: a page of rows, a heartbeat, or the end.
async fn step(cursor: &mut Cursor) -> crate::Result<String> {
    let request = Arc::clone(&cursor.request);
    let remaining = request.limit.map(|l| l.saturating_sub(cursor.rows_sent));
    if remaining == Some(0) {
        return Ok(finish(cursor));
    }
    let page_size = remaining.map(|r| r.min(DEFAULT_PAGE as u64) as usize).unwrap_or(DEFAULT_PAGE);
    let mut page = read_page(cursor.backend.as_ref(), cursor.since.as_deref(), page_size).await?;
    cursor.delivered.drop_repeats(&mut page);
    cursor.since = Some(page.last_seq.clone());
    cursor.last_seq = page.last_seq.clone();
    cursor.pending = page.pending;
    let rows = rows_of(cursor, &page.changes).await?;
    let mut chunk = String::new();
    for row in &rows {
        match request.feed {
            Feed::Continuous => {
                chunk.push_str(&row.to_string());
                chunk.push('\n');
            }
            _ => {
                if cursor.rows_sent > 0 {
                    chunk.push(',');
                }
                chunk.push('\n');
                chunk.push_str(&row.to_string());
            }
        }
        cursor.rows_sent += 1;
    }
    if !rows.is_empty() {
        cursor.backoff.reset();
    }
    let at_end = page.pending == 0;
    let finished = match request.feed {
        Feed::Normal => at_end,
        Feed::Longpoll => at_end && cursor.rows_sent > 0,
        Feed::Continuous => false,
    };
    if finished {
        chunk.push_str(&finish(cursor));
        return Ok(chunk);
    }
    if !at_end || !chunk.is_empty() {
        return Ok(chunk);
    }
    // At the end with nothing new: wait, then poll again (or end).
    wait_for_changes(cursor).await;
    if cursor.phase == Phase::Finished {
        return Ok(closing(cursor));
    }
    // A heartbeat keeps proxies and clients from timing the connection out while idle.
    Ok(if request.heartbeat.is_some() { "\n".to_owned() } else { String::new() })
}

/// Waits before the next poll of an idle feed; marks the stream finished when the timeout passes
/// (unless a heartbeat keeps it open) or the server stops.
async fn wait_for_changes(cursor: &mut Cursor) {
    if *cursor.stopping.borrow() {
        cursor.phase = Phase::Finished;
        return;
    }
    let now = Instant::now();
    let open_ended = cursor.request.heartbeat.is_some() && cursor.request.feed == Feed::Continuous;
    if !open_ended && now >= cursor.deadline {
        cursor.phase = Phase::Finished;
        return;
    }
    let mut pause = cursor.backoff.idle();
    if let Some(heartbeat) = cursor.request.heartbeat {
        pause = pause.min(heartbeat);
    }
    if !open_ended {
        pause = pause.min(cursor.deadline - now);
    }
    tokio::select! {
        () = tokio::time::sleep(pause) => {}
        _ = cursor.stopping.changed() => cursor.phase = Phase::Finished,
    }
}

/// The closing text, and the stream marked finished.
fn finish(cursor: &mut Cursor) -> String {
    cursor.phase = Phase::Finished;
    closing(cursor)
}

fn closing(cursor: &Cursor) -> String {
    let tail = json!({ "last_seq": cursor.last_seq, "pending": cursor.pending });
    match cursor.request.feed {
        Feed::Continuous => format!("{tail}\n"),
        _ => format!("\n],\"last_seq\":{},\"pending\":{}}}\n", Value::from(cursor.last_seq.as_str()), cursor.pending),
    }
}

/// The rows of one page that the request may see and wants.
async fn rows_of(cursor: &Cursor, changes: &[Change]) -> crate::Result<Vec<Value>> {
    let request = &cursor.request;
    let visible: Vec<&Change> = changes
        .iter()
        .filter(|c| cursor.principal.may_access_id(&c.id))
        .filter(|c| match &request.filter {
            Filter::DocIds(ids) => ids.contains(&c.id),
            _ => true,
        })
        .collect();
    let needs_docs = request.include_docs || matches!(request.filter, Filter::Selector(_));
    let docs = if needs_docs {
        let ids: Vec<String> = visible.iter().filter(|c| !c.deleted).map(|c| c.id.clone()).collect();
        let found = cursor.backend.get_many(&ids).await?;
        ids.into_iter().zip(found).filter_map(|(id, doc)| doc.map(|d| (id, d))).collect::<HashMap<_, _>>()
    } else {
        HashMap::new()
    };
    let mut rows = Vec::with_capacity(visible.len());
    for change in visible {
        let doc = if change.deleted {
            json!({ "_id": change.id, "_rev": change.rev.as_str(), "_deleted": true })
        } else {
            match docs.get(&change.id) {
                Some(doc) => doc_json(doc, None),
                None if needs_docs => continue, // deleted between the feed read and the fetch: its tombstone comes later
                None => Value::Null,
            }
        };
        if let Filter::Selector(matches) = &request.filter {
            if !matches(&doc) {
                continue;
            }
        }
        let mut row = json!({ "seq": change.seq, "id": change.id, "changes": [{ "rev": change.rev.as_str() }] });
        if change.deleted {
            row["deleted"] = Value::Bool(true);
        }
        if request.include_docs {
            row["doc"] = doc;
        }
        rows.push(row);
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn parameters_are_checked_and_name_the_problem() {
        assert!(parse_request(&params(&[("feed", "eventsource")]), None).err().unwrap().reason.contains("feed"));
        assert!(parse_request(&params(&[("descending", "true")]), None).is_err());
        assert!(parse_request(&params(&[("filter", "app/by_user")]), None).is_err());
        let ids = parse_request(&params(&[("filter", "_doc_ids"), ("doc_ids", "[\"a\"]")]), None).unwrap();
        assert!(matches!(ids.filter, Filter::DocIds(ref set) if set.contains("a")));
        let continuous = parse_request(&params(&[("feed", "continuous"), ("heartbeat", "500")]), None).unwrap();
        assert_eq!((continuous.feed, continuous.heartbeat), (Feed::Continuous, Some(Duration::from_millis(500))));
    }
}
