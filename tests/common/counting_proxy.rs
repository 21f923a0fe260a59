//! A loopback HTTP proxy that counts the requests it forwards: put between the CouchDB backend
//! and its server, it shows how many backend round trips one CouchDB API request costs
//! (`tests/couchdb_round_trips.rs`, `benches/couchdb_api_bench.rs`).
//!
//! Every request is forwarded as it came (method, path, query, headers but `host`, body) over a
//! pooled client and the answer returned whole; each is recorded as `METHOD /path?query` with
//! the database segment left out (the database itself is `/`, the server root `//`), so a test can
//! count, e.g., `GET /_local/agentstore-mango-indexes`. It also keeps the most requests it had
//! under way at once, and can hold each request before forwarding it ([`CountingProxy::hold_each`])
//! so that requests a client sends together overlap here whatever the server's speed.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{to_bytes, Body};
use axum::extract::{Request, State};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::Response;

/// Larger than anything the tests or the bench send or receive in one request.
const MAX_BODY: usize = 256 * 1024 * 1024;

#[derive(Clone)]
struct Forward {
    upstream: String,
    client: reqwest::Client,
    seen: Arc<Mutex<Vec<String>>>,
    gauge: Arc<Gauge>,
}

/// Requests under way now and at most, and how long each is held before it is forwarded.
#[derive(Default)]
struct Gauge {
    now: AtomicUsize,
    most: AtomicUsize,
    hold_ms: AtomicU64,
}

/// The running proxy; stops when dropped.
pub struct CountingProxy {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    seen: Arc<Mutex<Vec<String>>>,
    gauge: Arc<Gauge>,
    task: tokio::task::JoinHandle<()>,
}

impl CountingProxy {
    /// Listens on a free loopback port and forwards to `upstream` (`http://host:port`).
    pub async fn start(upstream: &str) -> Result<CountingProxy, String> {
        let client = reqwest::Client::builder().no_proxy().build().map_err(|e| format!("proxy client: {e}"))?;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let gauge = Arc::new(Gauge::default());
        let forward = Forward {
            upstream: upstream.trim_end_matches('/').to_owned(),
            client,
            seen: Arc::clone(&seen),
            gauge: Arc::clone(&gauge),
        };
        let router = axum::Router::new().fallback(forward_one).with_state(forward);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.map_err(|e| format!("proxy bind: {e}"))?;
        let addr = listener.local_addr().map_err(|e| format!("proxy address: {e}"))?;
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        Ok(CountingProxy { url: format!("http://{addr}"), seen, gauge, task })
    }

    /// Holds each request `hold` before forwarding it (zero: not at all).
    pub fn hold_each(&self, hold: Duration) {
        self.gauge.hold_ms.store(u64::try_from(hold.as_millis()).unwrap_or(u64::MAX), Ordering::SeqCst);
    }

    /// The most requests under way here at once since the last call, and starts counting again.
    pub fn take_most_at_once(&self) -> usize {
        self.gauge.most.swap(0, Ordering::SeqCst)
    }

    /// Requests forwarded so far.
    pub fn count(&self) -> usize {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The requests forwarded so far, as `METHOD /path-below-the-database?query`, and forgets
    /// them.
    pub fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.seen.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl Drop for CountingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `/db/rest` → `/rest`; `/db` (the database itself) → `/`; `/` (the server root) → `//`.
fn below_database(path: &str) -> String {
    match path.trim_start_matches('/').split_once('/') {
        Some((_, rest)) => format!("/{rest}"),
        None if path.trim_start_matches('/').is_empty() => "//".to_owned(),
        None => "/".to_owned(),
    }
}

async fn forward_one(State(forward): State<Forward>, request: Request) -> Response {
    let now = forward.gauge.now.fetch_add(1, Ordering::SeqCst) + 1;
    forward.gauge.most.fetch_max(now, Ordering::SeqCst);
    let hold = forward.gauge.hold_ms.load(Ordering::SeqCst);
    if hold > 0 {
        tokio::time::sleep(Duration::from_millis(hold)).await;
    }
    let answer = try_forward(&forward, request).await;
    forward.gauge.now.fetch_sub(1, Ordering::SeqCst);
    match answer {
        Ok(response) => response,
        Err(e) => Response::builder()
            .status(StatusCode::BAD_GATEWAY)
            .body(Body::from(format!("counting proxy: {e}")))
            .unwrap_or_default(),
    }
}

async fn try_forward(forward: &Forward, request: Request) -> Result<Response, String> {
    let (parts, body) = request.into_parts();
    let path_and_query = parts.uri.path_and_query().map(|pq| pq.as_str()).unwrap_or("/");
    let query = parts.uri.query().map(|q| format!("?{q}")).unwrap_or_default();
    forward.seen.lock().unwrap_or_else(|e| e.into_inner()).push(format!(
        "{} {}{query}",
        parts.method,
        below_database(parts.uri.path())
    ));
    let body = to_bytes(body, MAX_BODY).await.map_err(|e| format!("reading the request: {e}"))?;
    let method = reqwest::Method::from_bytes(parts.method.as_str().as_bytes()).map_err(|e| e.to_string())?;
    let mut upstream = forward.client.request(method, format!("{}{path_and_query}", forward.upstream));
    for (name, value) in &parts.headers {
        if name.as_str() != "host" && name.as_str() != "content-length" {
            upstream = upstream.header(name.as_str(), value.as_bytes());
        }
    }
    let answer = upstream.body(body).send().await.map_err(|e| format!("forwarding: {e}"))?;
    let mut response = Response::builder().status(answer.status().as_u16());
    for (name, value) in answer.headers() {
        if matches!(name.as_str(), "content-length" | "transfer-encoding" | "connection") {
            continue;
        }
        if let (Ok(name), Ok(value)) =
            (HeaderName::from_bytes(name.as_str().as_bytes()), HeaderValue::from_bytes(value.as_bytes()))
        {
            response = response.header(name, value);
        }
    }
    let bytes = answer.bytes().await.map_err(|e| format!("reading the answer: {e}"))?;
    response.body(Body::from(bytes)).map_err(|e| e.to_string())
}
