//! `GET /v1/changes`: the store's change feed for admin tokens, in the shape of CouchDB's
//! `_changes` (`results` of `{seq, id, changes: [{rev}], deleted}`, `last_seq`, `pending`).
//!
//! `feed=normal` answers at once with one page. `feed=longpoll` with nothing new waits, polling
//! the backend with a backoff, until a change arrives or `timeout` passes, whichever is first.
//! The wait is capped at half the server's request timeout, so the answer always comes before the
//! server's hard cut. It ends at once when the server shuts down (answering what it has: nothing
//! new); when the client disconnects, the connection's task drops the handler and with it the wait.

use std::time::Duration;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::time::Instant;

use super::error::ApiError;
use super::routes::AppState;
use crate::backend::{DocumentBackend, LayoutState};
use crate::error::ErrorKind;
use crate::feed::{read_page, resolve_since, FeedPage, PollBackoff, DEFAULT_PAGE, MAX_PAGE};

/// The longpoll wait when the client names none (CouchDB's default).
pub const DEFAULT_TIMEOUT_MS: u64 = 60_000;
/// The longest pause between two polls of the backend while a longpoll waits.
const POLL_CEILING: Duration = Duration::from_secs(1);

/// What the feed route needs from the server: how long a longpoll may wait, and whether the
/// server is shutting down.
#[derive(Clone)]
pub struct FeedSettings {
    pub max_wait: Duration,
    pub stopping: watch::Receiver<bool>,
}

/// The query parameters, as text: each is checked here so a bad one gets a 400 naming it.
#[derive(Debug, Deserialize)]
pub struct ChangesParams {
    since: Option<String>,
    limit: Option<String>,
    feed: Option<String>,
    timeout: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Feed {
    Normal,
    Longpoll,
}

/// The checked parameters.
struct Request {
    since: Option<String>,
    limit: usize,
    feed: Feed,
    wait: Duration,
}

impl ChangesParams {
    fn check(self, max_wait: Duration) -> Result<Request, ApiError> {
        let limit = match self.limit.as_deref() {
            None => DEFAULT_PAGE,
            Some(text) => text.parse::<usize>().ok().filter(|n| (1..=MAX_PAGE).contains(n)).ok_or_else(|| {
                ApiError::bad_request(format!("invalid limit: must be a whole number from 1 to {MAX_PAGE}"))
            })?,
        };
        let feed = match self.feed.as_deref() {
            None | Some("normal") => Feed::Normal,
            Some("longpoll") => Feed::Longpoll,
            Some(_) => return Err(ApiError::bad_request("invalid feed: must be `normal` or `longpoll`")),
        };
        let timeout_ms = match self.timeout.as_deref() {
            None => DEFAULT_TIMEOUT_MS,
            Some(text) => text
                .parse::<u64>()
                .map_err(|_| ApiError::bad_request("invalid timeout: must be a whole number of milliseconds"))?,
        };
        Ok(Request { since: self.since, limit, feed, wait: Duration::from_millis(timeout_ms).min(max_wait) })
    }
}

/// One entry of `results`.
#[derive(Serialize)]
struct ResultRow<'a> {
    seq: &'a str,
    id: &'a str,
    changes: [RevRow<'a>; 1],
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    deleted: bool,
}

#[derive(Serialize)]
struct RevRow<'a> {
    rev: &'a str,
}

#[derive(Serialize)]
struct ChangesBody<'a> {
    results: Vec<ResultRow<'a>>,
    last_seq: &'a str,
    pending: u64,
}

fn body(page: &FeedPage) -> ChangesBody<'_> {
    let results = page
        .changes
        .iter()
        .map(|change| ResultRow {
            seq: &change.seq,
            id: &change.id,
            changes: [RevRow { rev: change.rev.as_str() }],
            deleted: change.deleted,
        })
        .collect();
    ChangesBody { results, last_seq: &page.last_seq, pending: page.pending }
}

/// `GET /v1/changes`.
pub async fn changes(
    State(state): State<AppState>,
    headers: HeaderMap,
    params: Result<Query<ChangesParams>, QueryRejection>,
) -> Result<Response, ApiError> {
    state.auth.authorize_admin(&headers, "the change feed")?;
    let Query(params) = params.map_err(|e| ApiError::bad_request(format!("invalid query: {}", e.body_text())))?;
    let request = params.check(state.feed.max_wait)?;
    let backend = state.store.backend();
    let page = read_feed(backend.as_ref(), &request, state.feed.stopping.clone()).await?;
    Ok(Json(body(&page)).into_response())
}

/// One page after the request's `since`; for a longpoll with nothing new, polls until something
/// arrives, the wait is over, or the server stops.
async fn read_feed(
    backend: &dyn DocumentBackend,
    request: &Request,
    mut stopping: watch::Receiver<bool>,
) -> Result<FeedPage, ApiError> {
    let deadline = Instant::now() + request.wait;
    let since = answerable(backend, resolve_since(backend, request.since.as_deref()).await).await?;
    let mut page = answerable(backend, read_page(backend, since.as_deref(), request.limit).await).await?;
    let mut backoff = PollBackoff::new(POLL_CEILING);
    while request.feed == Feed::Longpoll && page.changes.is_empty() && !*stopping.borrow() {
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        let pause = backoff.idle().min(deadline - now);
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            // Shutting down (or the sender gone, which means the same): answer what there is.
            _ = stopping.changed() => break,
        }
        page = answerable(backend, read_page(backend, Some(&page.last_seq), request.limit).await).await?;
    }
    Ok(page)
}

/// A feed read's result, its error turned into the answer for the client.
async fn answerable<T>(backend: &dyn DocumentBackend, result: crate::Result<T>) -> Result<T, ApiError> {
    match result {
        Ok(value) => Ok(value),
        Err(err) => Err(feed_error(backend, err).await),
    }
}

/// The answer to a failed feed read. A store written by an earlier release gets a reason that
/// says what to run (the route is for admins, who run the server); anything else is answered as
/// every route answers it.
async fn feed_error(backend: &dyn DocumentBackend, err: crate::Error) -> ApiError {
    if err.kind() == ErrorKind::Misconfigured {
        if let Ok(LayoutState::NeedsUpgrade(why)) = backend.layout().await {
            tracing::error!(error = %err, "the change feed needs an upgraded store");
            return ApiError::new(
                axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                "misconfigured",
                format!(
                    "the change feed needs this release's storage layout, and the store was written by an \
                     earlier release ({why}); run `agentstore upgrade` on the server's backend"
                ),
            );
        }
    }
    ApiError::from(err)
}
