//! Connections: the accept loop behind `serve`, with the limits `axum::serve` does not offer.
//!
//! - At most `max_connections` connections are served at once. The loop accepts only when a slot
//!   is free, so further clients wait in the kernel's listen backlog (and get a connection refused
//!   only when that overflows) instead of being accepted and starved.
//! - A request head must arrive whole within `header_read_timeout` (hyper's HTTP/1 timer; on a
//!   keep-alive connection it runs from the end of the previous response).
//! - A connection where no request is being handled and no byte moved either way for
//!   `idle_timeout` is closed: idle keep-alive connections, clients that stop reading a response.
//!   (It does not run while a request is handled, so it never cut a stalled body: the next bound
//!   does.)
//! - A request body must arrive whole within `body_read_timeout`, counted from when the handler
//!   first asks for it (a body that stops, trickles, or a chunked body that never ends). The
//!   handler then sees a read error, and whatever it answers is replaced by a 408 naming the bound:
//!   one implementation for every router served here (the REST API and the CouchDB API), so
//!   neither face holds a connection for a stalled body, and neither answers it with a 5xx.
//! - Each request carries the peer's address (`ConnectInfo<SocketAddr>` in its extensions), for
//!   limits kept per client (failed logins, long-lived feeds).
//! - Closing is a *lingering* close: the server half-closes its side, then reads and discards what
//!   the client is still sending (bounded in bytes and time) before it closes the socket. Closing
//!   with unread bytes in the receive buffer makes the kernel send a reset, and a client still
//!   writing a body the server answered early (401, 403, 413) would see that reset instead of the
//!   answer.
//!
//! HTTP/1.1 only: detecting HTTP/2 first would read bytes before any header timer runs, so a
//! client trickling the HTTP/2 preface could hold a connection forever. Nothing here needs HTTP/2.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::ConnectInfo;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tower::ServiceExt;

use crate::config::Settings;

/// How long a lingering close keeps reading what the client still sends.
const LINGER_TIME: Duration = Duration::from_secs(5);

/// The connection limits of one server.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    /// Most bytes a lingering close reads and discards.
    pub linger_bytes: usize,
    /// Longest time a request body may take to arrive, from the handler's first read.
    pub body_read_timeout: Duration,
}

impl ConnectionLimits {
    /// The connection limits `settings` give, for every listener `serve` runs.
    pub fn from_settings(settings: &Settings) -> Self {
        ConnectionLimits {
            max_connections: settings.max_connections,
            header_read_timeout: Duration::from_secs(settings.header_read_timeout_secs),
            idle_timeout: Duration::from_secs(settings.idle_timeout_secs),
            // Enough to take in a whole body of twice the limit that the server refused early.
            linger_bytes: settings.body_limit().saturating_mul(2).saturating_add(1 << 20),
            body_read_timeout: Duration::from_secs(settings.body_read_timeout_secs),
        }
    }
}

/// The setting that bounds how long a request body may take to arrive (named in the 408).
pub const BODY_READ_TIMEOUT_SETTING: &str = "body_read_timeout_secs";

/// Serves `router` on `listener` until `shutdown` resolves; then stops accepting, asks every
/// connection to finish its request in flight and close, and waits up to `grace` for them.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let (stopping, stop) = watch::channel(false);
    accept_until(&listener, &router, limits, &slots, &stop, shutdown).await;
    drop(listener);
    tracing::info!("shutting down: finishing in-flight requests");
    let _ = stopping.send(true);
    // Every connection holds a slot until it is closed: all slots free means all closed.
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    if tokio::time::timeout(grace, slots.acquire_many(all)).await.is_err() {
        tracing::warn!(grace_secs = grace.as_secs(), "grace period over; stopping with requests still in flight");
    }
}

/// The accept loop: takes a free slot, then a connection, and serves it on its own task.
async fn accept_until(
    listener: &TcpListener,
    router: &Router,
    limits: ConnectionLimits,
    slots: &Arc<Semaphore>,
    stop: &watch::Receiver<bool>,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            () = &mut shutdown => return,
            slot = Arc::clone(slots).acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => return,
            },
        };
        let stream = tokio::select! {
            () = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let (stream, peer) = stream;
        let _ = stream.set_nodelay(true);
        tokio::spawn(serve_connection(stream, peer, router.clone(), limits, stop.clone(), slot));
    }
}

/// Serves one connection until it closes, is idle too long, or the server stops.
async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    router: Router,
    limits: ConnectionLimits,
    mut stop: watch::Receiver<bool>,
    _slot: OwnedSemaphorePermit,
) {
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(TrackedStream::new(stream, Arc::clone(&activity), limits.linger_bytes));
    let service = hyper::service::service_fn({
        let activity = Arc::clone(&activity);
        move |request: hyper::Request<Incoming>| {
            let handling = activity.begin_request();
            let timed_out = Arc::new(AtomicBool::new(false));
            let timeout = limits.body_read_timeout;
            let mut request = request.map(|body| Body::new(TimedBody::new(body, timeout, Arc::clone(&timed_out))));
            request.extensions_mut().insert(ConnectInfo(peer));
            let response = router.clone().oneshot(request);
            async move {
                let response = response.await;
                drop(handling);
                // Whatever the handler made of the read error, the client stalled: a 4xx.
                response.map(|response| {
                    if timed_out.load(Ordering::Acquire) {
                        body_timeout_response(response, timeout)
                    } else {
                        response
                    }
                })
            }
        }
    });
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1.timer(TokioTimer::new()).header_read_timeout(limits.header_read_timeout).keep_alive(true);
    let connection = http1.serve_connection(io, service);
    tokio::pin!(connection);
    let mut stopping = *stop.borrow_and_update();
    if stopping {
        connection.as_mut().graceful_shutdown();
    }
    let mut idle_closes = 0;
    loop {
        tokio::select! {
            result = connection.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            changed = stop.changed(), if !stopping => {
                stopping = true;
                let _ = changed;
                connection.as_mut().graceful_shutdown();
            }
            () = activity.idle_for(limits.idle_timeout) => {
                idle_closes += 1;
                if idle_closes > 1 {
                    // Still stuck after being asked to close (a response the client does not read).
                    tracing::debug!("dropping a connection that stayed idle after being closed");
                    return;
                }
                tracing::debug!("closing an idle connection");
                activity.touch();
                connection.as_mut().graceful_shutdown();
            }
        }
    }
}

/// When a connection last moved a byte, and how many of its requests are being handled.
struct Activity {
    started: Instant,
    last_millis: AtomicU64,
    handling: AtomicUsize,
}

/// Marks a request as being handled while alive.
struct Handling(Arc<Activity>);

impl Drop for Handling {
    fn drop(&mut self) {
        self.0.touch();
        self.0.handling.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Activity {
    fn new() -> Self {
        Activity { started: Instant::now(), last_millis: AtomicU64::new(0), handling: AtomicUsize::new(0) }
    }

    fn touch(&self) {
        let millis = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_millis.store(millis, Ordering::Relaxed);
    }

    fn begin_request(self: &Arc<Self>) -> Handling {
        self.handling.fetch_add(1, Ordering::AcqRel);
        Handling(Arc::clone(self))
    }

    /// Resolves once no request is being handled and nothing moved for `limit`.
    async fn idle_for(&self, limit: Duration) {
        loop {
            let last = self.started + Duration::from_millis(self.last_millis.load(Ordering::Relaxed));
            let due = last + limit;
            if self.handling.load(Ordering::Acquire) == 0 && Instant::now() >= due {
                return;
            }
            // A request being handled is bounded by the request timeout; check again later.
            tokio::time::sleep_until(due.max(Instant::now() + Duration::from_millis(100))).await;
        }
    }
}

/// A TCP stream that records activity and closes with a bounded lingering close.
struct TrackedStream {
    inner: TcpStream,
    activity: Arc<Activity>,
    linger_bytes: usize,
    linger: Option<Lingering>,
}

/// The state of a lingering close, once the write side is shut.
struct Lingering {
    discarded: usize,
    deadline: Pin<Box<Sleep>>,
}

impl TrackedStream {
    fn new(inner: TcpStream, activity: Arc<Activity>, linger_bytes: usize) -> Self {
        activity.touch();
        TrackedStream { inner, activity, linger_bytes, linger: None }
    }

    /// Reads and discards what the peer still sends, until it closes, the byte bound, the
    /// deadline, or an error.
    fn poll_discard(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(linger) = self.linger.as_mut() else { return Poll::Ready(()) };
        let mut scratch = [0u8; 8192];
        loop {
            if linger.discarded >= self.linger_bytes || linger.deadline.as_mut().poll(cx).is_ready() {
                return Poll::Ready(());
            }
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut self.inner).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if !buf.filled().is_empty() => linger.discarded += buf.filled().len(),
                Poll::Ready(_) => return Poll::Ready(()),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl AsyncRead for TrackedStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(result, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.touch();
        }
        result
    }
}

impl AsyncWrite for TrackedStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write(cx, data);
        if matches!(result, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        result
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(result, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        result
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    /// Half-closes, then lingers: see the module documentation.
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.linger.is_none() {
            if let Err(e) = std::task::ready!(Pin::new(&mut self.inner).poll_shutdown(cx)) {
                // Already reset or closed by the peer: nothing to linger for.
                tracing::debug!(error = %e, "shutting down the write side failed");
                return Poll::Ready(Ok(()));
            }
            self.linger = Some(Lingering { discarded: 0, deadline: Box::pin(tokio::time::sleep(LINGER_TIME)) });
        }
        self.poll_discard(cx).map(Ok)
    }
}

/// A request body that must arrive whole within a time, counted from its first read. Past it, the
/// body ends with an error and `timed_out` is set, so the connection answers 408 whatever the
/// handler made of the error.
struct TimedBody {
    inner: Incoming,
    limit: Duration,
    deadline: Option<Pin<Box<Sleep>>>,
    timed_out: Arc<AtomicBool>,
}

/// The error a stalled body ends with.
#[derive(Debug)]
struct BodyTimedOut(Duration);

impl std::fmt::Display for BodyTimedOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the request body did not arrive within {} s", self.0.as_secs())
    }
}

impl std::error::Error for BodyTimedOut {}

impl TimedBody {
    fn new(inner: Incoming, limit: Duration, timed_out: Arc<AtomicBool>) -> Self {
        TimedBody { inner, limit, deadline: None, timed_out }
    }
}

impl hyper::body::Body for TimedBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.timed_out.load(Ordering::Acquire) {
            return Poll::Ready(Some(Err(Box::new(BodyTimedOut(self.limit)))));
        }
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|frame| frame.map_err(Into::into)));
        }
        let limit = self.limit;
        let deadline = self.deadline.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match deadline.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.timed_out.store(true, Ordering::Release);
                Poll::Ready(Some(Err(Box::new(BodyTimedOut(limit)))))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The 408 for a client whose body stalled: the handler's headers (request id, server name) with
/// the error body both faces use, `{"error", "reason"}`, naming the bound and its setting.
fn body_timeout_response(response: Response, limit: Duration) -> Response {
    let (mut parts, _) = response.into_parts();
    parts.status = StatusCode::REQUEST_TIMEOUT;
    for name in [header::CONTENT_LENGTH, header::CONTENT_ENCODING, header::TRANSFER_ENCODING, header::ETAG] {
        parts.headers.remove(name);
    }
    parts.headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    parts.headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
    let body = serde_json::json!({
        "error": "request_timeout",
        "reason": format!(
            "the request body did not arrive within {} s ({BODY_READ_TIMEOUT_SETTING})",
            limit.as_secs()
        ),
    });
    Response::from_parts(parts, Body::from(body.to_string()))
}
