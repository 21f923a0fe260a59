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
//! - A request body must keep arriving, counted from when the handler first asks for it: it is
//!   cut when no byte arrived for `body_read_timeout` (a body that stops, or a chunked body that
//!   never ends), when past its first `body_read_timeout` it has arrived at less than
//!   `body_min_bytes_per_sec` on average (a trickle), or when it has taken `body_max_time` in all
//!   (half the attachment grace period: bytes of an upload must not outlive it unreferenced).
//!   A big upload that keeps going finishes, however long it is. The handler then sees a read
//!   error, and whatever it answers is replaced by a 408 naming the bound: one implementation for
//!   every router served here (the REST API and the CouchDB API), so neither face holds a
//!   connection for a stalled body, and neither answers it with a 5xx.
//! - At shutdown, a body still arriving when the grace period ends is cut the same way, and its
//!   answer is a 503 naming `shutdown_grace_secs` (send it again, to another instance), given
//!   within [`ANSWER_TIME`] before the server stops, rather than a connection dropped unanswered.
//! - hyper's buffer of a connection holds at most `max_connection_buffer_bytes` (plus the piece
//!   of an answer being queued): a client that stops reading a streamed answer holds that much
//!   of it here (and the listing's page, docs/bounds.md "Slow readers"), not hyper's ~400 KB.
//!   The same bound is hyper's longest request head.
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
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
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

/// After the grace period, how long the requests whose bodies were cut get to send their 503.
pub const ANSWER_TIME: Duration = Duration::from_secs(2);

/// The setting of the grace period (named in the 503 of a body cut when it ends).
pub const SHUTDOWN_GRACE_SETTING: &str = "shutdown_grace_secs";

/// The connection limits of one server.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    /// Most bytes a lingering close reads and discards.
    pub linger_bytes: usize,
    /// The time bounds of a request body.
    pub body: BodyTimeLimits,
    /// hyper's buffer of one connection (`max_connection_buffer_bytes`): what an answer queues
    /// ahead of a client that does not read, and the longest request head.
    pub buffer_bytes: usize,
}

/// How a request body must keep arriving, from the handler's first read (module documentation).
#[derive(Debug, Clone, Copy)]
pub struct BodyTimeLimits {
    /// Longest time without a byte; also the time every body gets before the rate is asked.
    pub idle: Duration,
    /// Average rate a body must keep past its first `idle`, in bytes per second; 0: none, so a
    /// body must arrive whole within `idle`.
    pub min_bytes_per_sec: u64,
    /// Longest time a body may take in all.
    pub max_time: Duration,
}

impl BodyTimeLimits {
    /// The limits `settings` give. The whole-body bound is half of `couchdb_attachment_grace_secs`
    /// (never below `body_read_timeout_secs`): an upload's chunks are written before any manifest
    /// names them, and garbage collection frees such chunks once they are older than the grace
    /// period, so an upload must end well within it.
    pub fn from_settings(settings: &Settings) -> Self {
        let idle = Duration::from_secs(settings.body_read_timeout_secs);
        BodyTimeLimits {
            idle,
            min_bytes_per_sec: settings.body_min_bytes_per_sec,
            max_time: Duration::from_secs(settings.couchdb_attachment_grace_secs / 2).max(idle),
        }
    }

    /// When a body that started at `started`, last moved at `last_progress` and has brought
    /// `received` bytes so far is cut, and by which bound.
    fn due(&self, started: Instant, last_progress: Instant, received: u64) -> (Instant, BodyCut) {
        let idle = (last_progress + self.idle, BodyCut::Idle);
        let earned = match self.min_bytes_per_sec {
            0 => Duration::ZERO,
            rate => Duration::try_from_secs_f64(received as f64 / rate as f64).unwrap_or(Duration::MAX),
        };
        let slow = (started + self.idle.saturating_add(earned.min(self.max_time)), BodyCut::Slow);
        let total = (started + self.max_time, BodyCut::Total);
        [idle, slow, total].into_iter().min_by_key(|(at, _)| *at).unwrap_or(idle)
    }
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
            body: BodyTimeLimits::from_settings(settings),
            buffer_bytes: settings.max_connection_buffer_bytes,
        }
    }
}

/// The setting that bounds how long a request body may go without a byte (named in the 408).
pub const BODY_READ_TIMEOUT_SETTING: &str = "body_read_timeout_secs";
/// The setting of the rate a request body must keep (named in the 408).
pub const BODY_MIN_RATE_SETTING: &str = "body_min_bytes_per_sec";
/// The setting the longest time of a whole body is drawn from (named in the 408).
pub const BODY_MAX_TIME_SETTING: &str = "couchdb_attachment_grace_secs";

/// Serves `router` on `listener` until `shutdown` resolves; then stops accepting, asks every
/// connection to finish its request in flight and close, and waits up to `grace` for them. Bodies
/// still arriving then are cut (503), and their answers get up to [`ANSWER_TIME`].
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let (stopping, stop) = watch::channel(false);
    let grace_over = Arc::new(AtomicBool::new(false));
    accept_until(&listener, &router, limits, &slots, &stop, &grace_over, shutdown).await;
    drop(listener);
    tracing::info!("shutting down: finishing in-flight requests");
    let _ = stopping.send(true);
    // Every connection holds a slot until it is closed: all slots free means all closed.
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    if tokio::time::timeout(grace, slots.acquire_many(all)).await.is_err() {
        tracing::warn!(grace_secs = grace.as_secs(), "grace period over: cutting request bodies still arriving");
        grace_over.store(true, Ordering::Release);
        if tokio::time::timeout(ANSWER_TIME, slots.acquire_many(all)).await.is_err() {
            tracing::warn!("stopping with requests still in flight");
        }
    }
}

/// The accept loop: takes a free slot, then a connection, and serves it on its own task.
async fn accept_until(
    listener: &TcpListener,
    router: &Router,
    limits: ConnectionLimits,
    slots: &Arc<Semaphore>,
    stop: &watch::Receiver<bool>,
    grace_over: &Arc<AtomicBool>,
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
        let stopping = (stop.clone(), Arc::clone(grace_over));
        tokio::spawn(serve_connection(stream, peer, router.clone(), limits, stopping, slot));
    }
}

/// Serves one connection until it closes, is idle too long, or the server stops.
async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    router: Router,
    limits: ConnectionLimits,
    (mut stop, grace_over): (watch::Receiver<bool>, Arc<AtomicBool>),
    _slot: OwnedSemaphorePermit,
) {
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(TrackedStream::new(stream, Arc::clone(&activity), limits.linger_bytes));
    let service = hyper::service::service_fn({
        let activity = Arc::clone(&activity);
        move |request: hyper::Request<Incoming>| {
            let handling = activity.begin_request();
            let cut = Arc::new(CutFlag::default());
            let bounds = limits.body;
            let grace_over = Arc::clone(&grace_over);
            let mut request = request.map(|body| Body::new(TimedBody::new(body, bounds, Arc::clone(&cut), grace_over)));
            request.extensions_mut().insert(ConnectInfo(peer));
            let response = router.clone().oneshot(request);
            async move {
                let response = response.await;
                drop(handling);
                // Whatever the handler made of the read error, the client stalled: a 4xx.
                response.map(|response| match cut.get() {
                    Some(how) => body_cut_response(response, how, &bounds),
                    None => response,
                })
            }
        }
    });
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1.timer(TokioTimer::new()).header_read_timeout(limits.header_read_timeout).keep_alive(true);
    // hyper asserts its minimum; the setting is checked against it when loaded.
    http1.max_buf_size(limits.buffer_bytes.max(crate::config::MIN_CONNECTION_BUFFER_BYTES));
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

/// A request body held to [`BodyTimeLimits`], counted from its first read. Past them, the body
/// ends with an error and `cut` records which bound it met, so the connection answers 408
/// whatever the handler made of the error.
struct TimedBody {
    inner: Incoming,
    limits: BodyTimeLimits,
    /// When the handler first found the body not ready, and when a byte last arrived.
    started: Option<(Instant, Instant)>,
    received: u64,
    deadline: Option<Pin<Box<Sleep>>>,
    cut: Arc<CutFlag>,
    /// Set when the server's shutdown grace period ends: the body is cut at its next read.
    grace_over: Arc<AtomicBool>,
}

/// Which bound cut a body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyCut {
    /// No byte for `body_read_timeout_secs`.
    Idle,
    /// Under `body_min_bytes_per_sec` on average past the first `body_read_timeout_secs`.
    Slow,
    /// Longer than the whole-body bound.
    Total,
    /// Still arriving when the shutdown grace period ended.
    Shutdown,
}

/// Which bound, if any, cut a request's body: set by the body, read by the connection.
#[derive(Default)]
struct CutFlag(AtomicU8);

impl CutFlag {
    fn set(&self, how: BodyCut) {
        let code = match how {
            BodyCut::Idle => 1,
            BodyCut::Slow => 2,
            BodyCut::Total => 3,
            BodyCut::Shutdown => 4,
        };
        self.0.store(code, Ordering::Release);
    }

    fn get(&self) -> Option<BodyCut> {
        match self.0.load(Ordering::Acquire) {
            1 => Some(BodyCut::Idle),
            2 => Some(BodyCut::Slow),
            3 => Some(BodyCut::Total),
            4 => Some(BodyCut::Shutdown),
            _ => None,
        }
    }
}

/// The error a body that met a bound ends with.
#[derive(Debug)]
struct BodyTimedOut(String);

impl std::fmt::Display for BodyTimedOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BodyTimedOut {}

impl TimedBody {
    fn new(inner: Incoming, limits: BodyTimeLimits, cut: Arc<CutFlag>, grace_over: Arc<AtomicBool>) -> Self {
        TimedBody { inner, limits, started: None, received: 0, deadline: None, cut, grace_over }
    }

    fn cut_error(&self, how: BodyCut) -> Box<dyn std::error::Error + Send + Sync> {
        Box::new(BodyTimedOut(cut_reason(how, &self.limits)))
    }
}

impl hyper::body::Body for TimedBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(how) = self.cut.get() {
            return Poll::Ready(Some(Err(self.cut_error(how))));
        }
        if self.grace_over.load(Ordering::Acquire) {
            self.cut.set(BodyCut::Shutdown);
            return Poll::Ready(Some(Err(self.cut_error(BodyCut::Shutdown))));
        }
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            if let Some(Ok(data)) = frame.as_ref().map(|frame| frame.as_ref().map(Frame::data_ref)) {
                let arrived = data.map_or(0, |data| data.len() as u64);
                self.received = self.received.saturating_add(arrived);
                if let Some((_, last_progress)) = self.started.as_mut() {
                    *last_progress = Instant::now();
                }
            }
            return Poll::Ready(frame.map(|frame| frame.map_err(Into::into)));
        }
        let now = Instant::now();
        let (started, last_progress) = *self.started.get_or_insert((now, now));
        let (due, how) = self.limits.due(started, last_progress, self.received);
        let deadline = self.deadline.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(due)));
        if deadline.deadline() != due {
            deadline.as_mut().reset(due);
        }
        match deadline.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.cut.set(how);
                Poll::Ready(Some(Err(self.cut_error(how))))
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

/// Why a body was cut, naming the setting that bounds it.
fn cut_reason(how: BodyCut, limits: &BodyTimeLimits) -> String {
    let idle = limits.idle.as_secs();
    match how {
        BodyCut::Idle => format!("no byte of the request body arrived for {idle} s ({BODY_READ_TIMEOUT_SETTING})"),
        BodyCut::Slow if limits.min_bytes_per_sec == 0 => {
            format!("the request body did not arrive within {idle} s ({BODY_READ_TIMEOUT_SETTING})")
        }
        BodyCut::Slow => format!(
            "the request body arrived too slowly: past its first {idle} s ({BODY_READ_TIMEOUT_SETTING}) a body must \
             keep arriving at {} bytes/s on average ({BODY_MIN_RATE_SETTING})",
            limits.min_bytes_per_sec
        ),
        BodyCut::Total => format!(
            "the request body took more than {} s, the longest a body may take (half of {BODY_MAX_TIME_SETTING})",
            limits.max_time.as_secs()
        ),
        BodyCut::Shutdown => format!(
            "the server is shutting down and the request body was still arriving when its grace period \
             ({SHUTDOWN_GRACE_SETTING}) ended; nothing of it was stored: send the request again"
        ),
    }
}

/// The 408 for a client whose body stalled (503 for one cut by the shutdown): the handler's
/// headers (request id, server name) with the error body both faces use, `{"error", "reason"}`,
/// naming the bound and its setting.
fn body_cut_response(response: Response, how: BodyCut, limits: &BodyTimeLimits) -> Response {
    let (mut parts, _) = response.into_parts();
    let (status, error) = match how {
        BodyCut::Shutdown => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
        _ => (StatusCode::REQUEST_TIMEOUT, "request_timeout"),
    };
    parts.status = status;
    for name in [header::CONTENT_LENGTH, header::CONTENT_ENCODING, header::TRANSFER_ENCODING, header::ETAG] {
        parts.headers.remove(name);
    }
    parts.headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    parts.headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
    let body = serde_json::json!({ "error": error, "reason": cut_reason(how, limits) });
    Response::from_parts(parts, Body::from(body.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::post;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn a_body_earns_time_by_what_it_brings_and_loses_it_by_stopping() {
        let limits = BodyTimeLimits { idle: SECOND, min_bytes_per_sec: 1000, max_time: 60 * SECOND };
        let start = Instant::now();
        assert_eq!(
            limits.due(start, start, 0),
            (start + SECOND, BodyCut::Idle),
            "nothing yet: the first second, and nothing came in it"
        );
        let later = start + 10 * SECOND;
        assert_eq!(
            limits.due(start, later, 20_000),
            (later + SECOND, BodyCut::Idle),
            "20 s earned, but a body that stops is cut a second after its last byte"
        );
        assert_eq!(
            limits.due(start, start + 5 * SECOND + SECOND / 2, 5_000),
            (start + 6 * SECOND, BodyCut::Slow),
            "5,000 bytes earn 5 s past the first, however recent the last"
        );
        assert_eq!(limits.due(start, start + 59 * SECOND + SECOND / 2, 1 << 30), (start + 60 * SECOND, BodyCut::Total));
        let whole = BodyTimeLimits { min_bytes_per_sec: 0, ..limits };
        let moving = start + SECOND / 2;
        assert_eq!(whole.due(start, moving, 1 << 30), (start + SECOND, BodyCut::Slow), "0: whole within the first");
        let endless = BodyTimeLimits { min_bytes_per_sec: 1, ..limits };
        assert_eq!(endless.due(start, start, u64::MAX).1, BodyCut::Idle, "no overflow");
    }

    /// Serves a route that reads the whole body and answers its length, with `body` limits.
    async fn body_server(body: BodyTimeLimits) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let router = Router::new().route(
            "/",
            post(|body: Body| async move {
                match axum::body::to_bytes(body, usize::MAX).await {
                    Ok(bytes) => (StatusCode::OK, bytes.len().to_string()),
                    // Replaced by the 408 when a bound cut the body.
                    Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
                }
            }),
        );
        let limits = ConnectionLimits {
            max_connections: 8,
            header_read_timeout: 5 * SECOND,
            idle_timeout: 60 * SECOND,
            linger_bytes: 1 << 20,
            body,
            buffer_bytes: crate::config::DEFAULT_CONNECTION_BUFFER_BYTES,
        };
        tokio::spawn(serve(listener, router, limits, std::future::pending(), SECOND));
        addr
    }

    /// Sends a body of `declared` bytes as `first` bytes at once, then `piece` bytes every
    /// `every` (until the server closes or all are sent); answers the status line's code and the
    /// response body.
    async fn send(addr: SocketAddr, declared: usize, first: usize, piece: usize, every: Duration) -> (u16, String) {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let (mut reader, mut writer) = stream.into_split();
        let head = format!("POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {declared}\r\n\r\n");
        let sender = tokio::spawn(async move {
            writer.write_all(head.as_bytes()).await?;
            writer.write_all(&vec![b'x'; first]).await?;
            let mut sent = first;
            while sent < declared && piece > 0 {
                tokio::time::sleep(every).await;
                let now = piece.min(declared - sent);
                writer.write_all(&vec![b'x'; now]).await?;
                sent += now;
            }
            // Keeps the write side open (a body that stops) until the reader is done.
            std::future::pending::<()>().await;
            Ok::<(), io::Error>(())
        });
        let mut response = Vec::new();
        let _ = tokio::time::timeout(60 * SECOND, reader.read_to_end(&mut response)).await;
        sender.abort();
        let response = String::from_utf8_lossy(&response).into_owned();
        let status = response.get(9..12).and_then(|code| code.parse().ok()).unwrap_or(0);
        let body = response.split_once("\r\n\r\n").map(|(_, body)| body.to_owned()).unwrap_or_default();
        (status, body)
    }

    fn reason(body: &str) -> String {
        let value: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
        assert_eq!(value["error"], "request_timeout", "{body}");
        value["reason"].as_str().unwrap_or_default().to_owned()
    }

    const LIMITS: BodyTimeLimits =
        BodyTimeLimits { idle: SECOND, min_bytes_per_sec: 1000, max_time: SECOND.saturating_mul(60) };

    #[tokio::test]
    async fn a_body_that_keeps_coming_finishes_past_the_first_timeout() {
        let addr = body_server(LIMITS).await;
        // 30,000 bytes over about 3 s: three times the timeout, at ten times the rate.
        let (status, body) = send(addr, 30_000, 1_000, 1_000, Duration::from_millis(100)).await;
        assert_eq!((status, body.as_str()), (200, "30000"));
    }

    #[tokio::test]
    async fn a_trickle_is_cut_by_the_rate() {
        let addr = body_server(LIMITS).await;
        // 100 bytes/s, a byte never more than 100 ms apart: only the rate catches it.
        let (status, body) = send(addr, 100_000, 10, 10, Duration::from_millis(100)).await;
        assert_eq!(status, 408, "{body}");
        let reason = reason(&body);
        assert!(reason.contains("body_min_bytes_per_sec") && reason.contains("body_read_timeout_secs"), "{reason}");
    }

    #[tokio::test]
    async fn a_body_that_stops_after_a_fast_start_is_cut_when_idle() {
        let addr = body_server(LIMITS).await;
        // 20,000 bytes at once earn 20 s of rate, but not a stall of more than a second.
        let (status, body) = send(addr, 100_000, 20_000, 0, SECOND).await;
        assert_eq!(status, 408, "{body}");
        let reason = reason(&body);
        assert!(reason.contains("no byte") && reason.contains("body_read_timeout_secs"), "{reason}");
    }

    #[tokio::test]
    async fn the_whole_body_bound_holds_at_any_rate() {
        let addr = body_server(BodyTimeLimits { max_time: 2 * SECOND, ..LIMITS }).await;
        let (status, body) = send(addr, 1_000_000, 1_000, 1_000, Duration::from_millis(100)).await;
        assert_eq!(status, 408, "{body}");
        let reason = reason(&body);
        assert!(reason.contains("couchdb_attachment_grace_secs"), "{reason}");
    }

    #[tokio::test]
    async fn without_a_rate_a_body_must_arrive_within_the_timeout() {
        let addr = body_server(BodyTimeLimits { min_bytes_per_sec: 0, ..LIMITS }).await;
        let (status, body) = send(addr, 30_000, 1_000, 1_000, Duration::from_millis(100)).await;
        assert_eq!(status, 408, "{body}");
        let reason = reason(&body);
        assert!(reason.contains("did not arrive within 1 s (body_read_timeout_secs)"), "{reason}");
    }
}
