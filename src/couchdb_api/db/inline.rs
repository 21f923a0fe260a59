//! The server-wide budget of attachment bytes shown inline (`attachments=true` answered as JSON:
//! base64 in the document), `couchdb_max_inflight_inline_bytes` (issue 34). JSON holds an inline
//! attachment whole: its bytes, their base64 in the document and again in the serialised answer,
//! about four times its length until the answer is sent. So before an attachment is read for
//! an inline answer it takes its length from the budget ([`take_share`]), and the share is held
//! until the answer's body has been sent ([`hold_inline_until_sent`], a middleware over every
//! route): four readers of a 200 MiB attachment wait for each other instead of holding 1.4 GiB.
//!
//! - A share waits at most `couchdb_inline_wait_ms` ([`Database::inline_wait`]), then 429 naming
//!   both settings: an answer that already
//!   holds shares and waits for more could otherwise wait for ever on another doing the same.
//! - One answer whose inline attachments together pass the whole budget can never be served: 413
//!   naming the setting (the client reads them as multipart, `Accept: multipart/related`, or one
//!   by one with `GET /{db}/{doc}/{att}`, both streamed).
//! - Outside a request's scope (pages of an `_all_docs` or `_changes` body built while it is
//!   sent), a page's shares are counted as one answer's and held while the page is built
//!   ([`with_own_shares`]), then given back.
//!
//! Multipart answers and standalone attachment reads stream chunk by chunk and take no share.

use std::sync::{Arc, Mutex};

use axum::body::{Body, HttpBody as _};
use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use futures::StreamExt;
use tokio::sync::OwnedSemaphorePermit;

use crate::couchdb_api::error::{CouchError, CouchResult};
use crate::database::Database;

tokio::task_local! {
    /// The shares the answer being built holds, kept until its body is sent.
    static ANSWER_SHARES: Shares;
}

/// Shares of the inline budget one answer holds.
#[derive(Clone, Default)]
struct Shares(Arc<Mutex<Held>>);

#[derive(Default)]
struct Held {
    permits: Vec<OwnedSemaphorePermit>,
    bytes: usize,
}

/// A share taken outside a request's scope: held by whoever builds the document, dropped after.
pub(crate) struct Share(#[allow(dead_code)] Option<OwnedSemaphorePermit>);

/// The shares a part of an answer built outside its request's scope took (a page of a streamed
/// listing): given back when dropped.
pub(crate) struct PartShares(#[allow(dead_code)] Shares);

/// Runs `work` (building part of an answer that streams, such as a page of `_all_docs` rows):
/// within a request's scope, as any of its work (the request holds the shares); outside one,
/// with shares of its own, counted together as one answer, handed to the caller to hold while
/// the part lives.
pub(crate) async fn with_own_shares<T>(work: impl std::future::Future<Output = T>) -> (T, PartShares) {
    let shares = Shares::default();
    if ANSWER_SHARES.try_with(|_| ()).is_ok() {
        return (work.await, PartShares(shares));
    }
    let output = ANSWER_SHARES.scope(shares.clone(), work).await;
    (output, PartShares(shares))
}

/// Takes `length` bytes of `db`'s inline budget for attachment `name` of an answer: waits for
/// them (at most [`Database::inline_wait`], then 429), or 413 when this answer's shares would pass the
/// whole budget.
pub(crate) async fn take_share(db: &Database, name: &str, length: u64) -> CouchResult<Share> {
    let budget = db.inline_budget();
    let total = budget.total_bytes();
    let length = usize::try_from(length).unwrap_or(usize::MAX);
    let shares = ANSWER_SHARES.try_with(Shares::clone).ok();
    // Counted for the answer before waiting, so that attachments of one answer read at once
    // (a `_bulk_get`'s documents) see each other's and the answer past the budget is refused
    // rather than waiting on itself.
    let answer_bytes = match &shares {
        Some(shares) => {
            let mut held = lock(shares);
            held.bytes = held.bytes.saturating_add(length);
            held.bytes
        }
        None => length,
    };
    let taken =
        if answer_bytes > total { Err(past_budget(name, answer_bytes, total)) } else { wait_for(db, length).await };
    match (taken, &shares) {
        (Ok(permit), Some(shares)) => {
            lock(shares).permits.push(permit);
            Ok(Share(None))
        }
        (Ok(permit), None) => Ok(Share(Some(permit))),
        (Err(refused), shares) => {
            if let Some(shares) = shares {
                let mut held = lock(shares);
                held.bytes = held.bytes.saturating_sub(length);
            }
            Err(refused)
        }
    }
}

/// `length` bytes of `db`'s inline budget, waited for at most its `couchdb_inline_wait_ms`.
async fn wait_for(db: &Database, length: usize) -> CouchResult<OwnedSemaphorePermit> {
    let (budget, wait) = (db.inline_budget(), db.inline_wait());
    match tokio::time::timeout(wait, budget.take(length)).await {
        Ok(Ok(permit)) => Ok(permit),
        Ok(Err(stopping)) => Err(stopping.into()),
        Err(_waited) => Err(CouchError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "too_many_requests",
            format!(
                "attachments shown inline by other answers held couchdb_max_inflight_inline_bytes ({}) for longer \
                 than couchdb_inline_wait_ms ({}); try again",
                budget.total_bytes(),
                wait.as_millis()
            ),
        )),
    }
}

/// The 413 of an answer whose inline attachments alone pass the whole budget.
fn past_budget(name: &str, answer_bytes: usize, total: usize) -> CouchError {
    CouchError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "too_large",
        format!(
            "attachment {name:?} would make this answer show {answer_bytes} bytes of attachments inline, more than \
             couchdb_max_inflight_inline_bytes ({total}); read them as multipart (Accept: multipart/related) or \
             one by one"
        ),
    )
}

fn lock(shares: &Shares) -> std::sync::MutexGuard<'_, Held> {
    shares.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Middleware over every route: runs the request with a place for its answer's shares, and when
/// the answer took any, keeps them until its body has been sent (or dropped, the client gone).
pub(crate) async fn hold_inline_until_sent(request: Request, next: Next) -> Response {
    let shares = Shares::default();
    let response = ANSWER_SHARES.scope(shares.clone(), next.run(request)).await;
    if lock(&shares).permits.is_empty() {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    // The body becomes a stream that holds the shares; its length, when known, is kept.
    if let Some(length) = body.size_hint().exact() {
        parts.headers.entry(header::CONTENT_LENGTH).or_insert_with(|| HeaderValue::from(length));
    }
    let held = body.into_data_stream().map(move |chunk| {
        let _ = &shares;
        chunk
    });
    Response::from_parts(parts, Body::from_stream(held))
}
