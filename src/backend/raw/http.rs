//! The one HTTP layer of the REST adapters (CouchDB, Firestore): building the `reqwest` client,
//! sending a JSON request, reading the reply whatever its body is, classifying what went wrong,
//! and owning the retries of a call.
//!
//! Classification is what makes retrying safe, so it is done here once:
//! - `Unavailable` always means *the request had no effect*: the connection could not be made,
//!   or the server (or a proxy in front of it) answered 429, 502 or 503, or an idempotent request
//!   failed in any transient way. Such a failure may be retried, writes included.
//! - `OutcomeUnknown` means a non-idempotent request was sent and no definite answer came back:
//!   the connection broke or timed out after sending, or the answer was 500, 504 or another 5xx.
//!   It may have been applied, so it is never retried here; the client is told (HTTP 504).
//! - A reply that is not JSON keeps its status: proxies answer errors with HTML pages, and a 502
//!   page is the backend being unavailable, not an internal error. A *successful* reply that is
//!   not JSON is a broken server (`Internal`).
//!
//! Retries: [`RetryPolicy::run`] retries `Unavailable` with exponential backoff and jitter until
//! its attempts or its total budget run out, then marks the error
//! [`crate::error::Error::with_retries_exhausted`] so no outer layer retries it again. A call is
//! therefore reported within `budget` plus one request timeout of its first attempt.

use std::future::Future;
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBuilder};
use reqwest::{RequestBuilder, StatusCode};
use serde_json::Value;

use crate::error::{Error, ErrorKind, Result};

/// Whether repeating a request could apply it twice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Idempotency {
    /// Reads, index creation: repeating them changes nothing.
    Idempotent,
    /// Writes: once sent, their outcome must be known before anything is repeated.
    NotIdempotent,
}

/// A reply: its status and JSON body (`Null` for an empty body, or for an error page that is not
/// JSON).
#[derive(Debug)]
pub struct RawReply {
    pub status: StatusCode,
    pub body: Value,
}

/// A pooled client for one backend, with its connect and request timeouts. `service` names the
/// backend in errors. Connections are reused: reqwest keeps every idle keep-alive connection per
/// host (no cap by default) for `pool_idle_timeout`, with `TCP_NODELAY` on (its default), so after
/// warm-up a request to the backend costs its round trip, not a connection.
pub fn client(service: &str, timeout: Duration) -> Result<reqwest::Client> {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(5).min(timeout))
        .timeout(timeout)
        .pool_idle_timeout(Duration::from_secs(60))
        .user_agent(concat!("agentstore/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| {
            Error::new(ErrorKind::Misconfigured, format!("cannot build the {service} HTTP client")).with_source(e)
        })
}

/// Sends `request` once, with `body` as JSON, and reads the whole reply. Transport failures are
/// errors (classified as the module doc says); every status, success or not, is a reply.
pub async fn send(
    service: &str,
    request: RequestBuilder,
    body: Option<&Value>,
    idempotency: Idempotency,
    doing: &str,
) -> Result<RawReply> {
    let (status, bytes) = send_for_text(service, request, body, idempotency, doing).await?;
    reply_of(service, status, &bytes, doing)
}

/// [`send`], the reply's body left as the bytes that came: for a caller that reads a large
/// answer into its own types (or passes parts of it on) instead of a tree of values.
pub async fn send_for_text(
    service: &str,
    request: RequestBuilder,
    body: Option<&Value>,
    idempotency: Idempotency,
    doing: &str,
) -> Result<(StatusCode, bytes::Bytes)> {
    let mut request = request.header(reqwest::header::ACCEPT, "application/json");
    if let Some(body) = body {
        // serde_json with arbitrary_precision writes numbers exactly as they were read.
        let bytes = serde_json::to_vec(body).map_err(|e| unexpected_body(service, doing, e))?;
        request = request.header(reqwest::header::CONTENT_TYPE, "application/json").body(bytes);
    }
    let response = request.send().await.map_err(|e| transport_error(service, e, idempotency, doing))?;
    let status = response.status();
    let bytes = response.bytes().await.map_err(|e| transport_error(service, e, idempotency, doing))?;
    Ok((status, bytes))
}

/// A reply's body read as JSON: `Null` when empty, or when an error status came with a body that
/// is not JSON (a proxy's page); a successful reply that is not JSON is an error.
pub fn reply_of(service: &str, status: StatusCode, bytes: &[u8], doing: &str) -> Result<RawReply> {
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        // A document read back (Firestore, CouchDB) is as deep as it was accepted, plus the reply's levels.
        match crate::model::depth::parse_stored(bytes) {
            Ok(json) => json,
            Err(_) if !status.is_success() => Value::Null,
            Err(e) => return Err(unexpected_body(service, doing, e)),
        }
    };
    Ok(RawReply { status, body })
}

/// A transport failure. Nothing was sent when the connection could not be made; otherwise an
/// idempotent request is merely unavailable and a write's outcome is unknown.
pub fn transport_error(service: &str, err: reqwest::Error, idempotency: Idempotency, doing: &str) -> Error {
    let kind = if err.is_decode() || err.is_builder() {
        ErrorKind::Internal
    } else if err.is_connect() || idempotency == Idempotency::Idempotent {
        ErrorKind::Unavailable
    } else {
        ErrorKind::OutcomeUnknown
    };
    let message = match kind {
        ErrorKind::OutcomeUnknown => {
            format!("{service} request failed after it was sent while trying to {doing}; it may have been applied")
        }
        _ => format!("{service} request failed while trying to {doing}"),
    };
    Error::new(kind, message).with_source(err)
}

/// The kind a status means when the body says nothing more specific.
pub fn kind_of_status(status: StatusCode, idempotency: Idempotency) -> ErrorKind {
    match status {
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => ErrorKind::Unauthorized,
        StatusCode::NOT_FOUND => ErrorKind::NotFound,
        StatusCode::CONFLICT | StatusCode::PRECONDITION_FAILED => ErrorKind::Conflict,
        StatusCode::PAYLOAD_TOO_LARGE => ErrorKind::TooLarge,
        StatusCode::BAD_REQUEST => ErrorKind::InvalidInput,
        // Refused before any work: nothing applied.
        StatusCode::TOO_MANY_REQUESTS | StatusCode::BAD_GATEWAY | StatusCode::SERVICE_UNAVAILABLE => {
            ErrorKind::Unavailable
        }
        s if s.is_server_error() => match idempotency {
            Idempotency::Idempotent => ErrorKind::Unavailable,
            // A 500 or a gateway timeout on a write says nothing about whether it was applied.
            Idempotency::NotIdempotent => ErrorKind::OutcomeUnknown,
        },
        _ => ErrorKind::Internal,
    }
}

/// A body that is not the JSON the backend promises (or that we could not encode).
pub fn unexpected_body(service: &str, doing: &str, problem: impl std::fmt::Display) -> Error {
    Error::new(
        ErrorKind::Internal,
        format!("{service} answered with unexpected JSON while trying to {doing}: {problem}"),
    )
}

/// How one call is retried: after the first attempt, up to `retries` more, with jittered
/// exponential backoff from `min_delay` to `max_delay`, and never a new attempt once `budget`
/// has passed since the first began.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    pub retries: usize,
    pub min_delay: Duration,
    pub max_delay: Duration,
    pub budget: Duration,
}

impl RetryPolicy {
    /// Runs `attempt` until it succeeds, fails with anything but `Unavailable`, or the policy is
    /// spent; a failure the policy gave up on is marked as having exhausted its retries.
    pub async fn run<T, F, Fut>(&self, service: &str, doing: &str, mut attempt: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let started = Instant::now();
        let mut delays = ExponentialBuilder::default()
            .with_min_delay(self.min_delay)
            .with_max_delay(self.max_delay)
            .with_max_times(self.retries)
            .with_jitter()
            .build();
        let mut tries = 0;
        loop {
            tries += 1;
            let error = match attempt().await {
                Ok(done) => return Ok(done),
                Err(e) if e.kind() == ErrorKind::Unavailable && !e.retries_exhausted() => e,
                Err(e) => return Err(e),
            };
            match delays.next() {
                Some(delay) if started.elapsed() + delay < self.budget => {
                    tracing::warn!(error = %error, retry_in = ?delay, "{service} unavailable; retrying");
                    tokio::time::sleep(delay).await;
                }
                _ => {
                    let waited = started.elapsed();
                    return Err(Error::new(
                        ErrorKind::Unavailable,
                        format!("{service} stayed unavailable while trying to {doing} ({tries} tries in {waited:.1?})"),
                    )
                    .with_source(error)
                    .with_retries_exhausted());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_that_mean_nothing_was_applied_are_unavailable_for_writes_too() {
        for status in [429, 502, 503] {
            let status = StatusCode::from_u16(status).unwrap();
            assert_eq!(kind_of_status(status, Idempotency::NotIdempotent), ErrorKind::Unavailable);
        }
        for status in [500, 504, 507] {
            let status = StatusCode::from_u16(status).unwrap();
            assert_eq!(kind_of_status(status, Idempotency::NotIdempotent), ErrorKind::OutcomeUnknown);
            assert_eq!(kind_of_status(status, Idempotency::Idempotent), ErrorKind::Unavailable);
        }
    }

    /// Runs `policy` over an attempt that always fails with `kind`; the error and the tries.
    async fn always_failing(policy: RetryPolicy, kind: ErrorKind) -> (Error, usize) {
        let mut tries = 0;
        let result: Result<()> = policy
            .run("Test", "do a thing", || {
                tries += 1;
                async move { Err(Error::new(kind, "failed")) }
            })
            .await;
        (result.unwrap_err(), tries)
    }

    #[tokio::test]
    async fn retries_stop_at_the_budget_and_mark_the_error() {
        let policy = RetryPolicy {
            retries: 1000,
            min_delay: Duration::from_millis(5),
            max_delay: Duration::from_millis(20),
            budget: Duration::from_millis(200),
        };
        let started = Instant::now();
        let (error, tries) = always_failing(policy, ErrorKind::Unavailable).await;
        assert!(error.retries_exhausted(), "{error}");
        assert!(tries > 1 && tries < 1000, "{tries}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn errors_that_may_have_been_applied_are_not_retried() {
        let policy = RetryPolicy {
            retries: 5,
            min_delay: Duration::from_millis(1),
            max_delay: Duration::from_millis(1),
            budget: Duration::from_secs(5),
        };
        let (error, tries) = always_failing(policy, ErrorKind::OutcomeUnknown).await;
        assert_eq!(error.kind(), ErrorKind::OutcomeUnknown);
        assert_eq!(tries, 1);
    }
}
