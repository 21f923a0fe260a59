//! Graceful shutdown: the signal both faces' listeners and the long-running CLI commands
//! (`changes --follow`, `migrate`) stop on, and `serve`'s drain before its listeners stop
//! ([`Draining`], [`drain_after_signal`]; docs/operations.md, "Rolling restarts").

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::{header, HeaderValue};
use axum::response::Response;
use axum::Router;

/// Resolves on SIGTERM or SIGINT. The handlers are installed when this is called, not when the
/// future is first polled, so a signal arriving right after startup still shuts down gracefully.
/// Call it inside the runtime.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    let (mut terminate, mut interrupt) = {
        use tokio::signal::unix::{signal, SignalKind};
        (signal(SignalKind::terminate()).ok(), signal(SignalKind::interrupt()).ok())
    };
    async move {
        #[cfg(unix)]
        {
            async fn recv(signal: &mut Option<tokio::signal::unix::Signal>) {
                match signal {
                    Some(signal) => {
                        signal.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            }
            tokio::select! {
                () = recv(&mut terminate) => {}
                () = recv(&mut interrupt) => {}
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Whether this process is draining: told to stop, still serving every request, but no longer
/// ready (the REST face's `/readyz` answers 503, the CouchDB face's `/_up` 404 `nolb`), so a load
/// balancer's health check takes it out of rotation before its listeners close. Cloned into
/// every face of one process; set once, never cleared.
#[derive(Debug, Clone, Default)]
pub struct Draining(Arc<AtomicBool>);

impl Draining {
    /// Marks the process as draining.
    pub fn begin(&self) {
        self.0.store(true, Ordering::Release);
    }

    /// Whether the process is draining.
    pub fn is_draining(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }

    /// `router` answering `Connection: close` while draining: a keep-alive client (a balancer's
    /// pooled connections among them) opens its next connection elsewhere instead of sending its
    /// next request on a connection this process is about to close.
    pub fn close_connections_while_draining(&self, router: Router) -> Router {
        let draining = self.clone();
        router.layer(axum::middleware::map_response(move |mut response: Response| {
            if draining.is_draining() {
                response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            std::future::ready(response)
        }))
    }
}

/// `serve`'s way to stop: resolves `drain` after the first SIGTERM or SIGINT. At the signal every
/// face in `faces` turns not ready at once, then the listeners keep accepting for `drain` (the
/// setting `shutdown_drain_secs`: requests a balancer still routes here until its health check
/// notices are served); a second signal cuts that window short. What follows, stopping the
/// accept loops and the grace period, is the caller's.
pub async fn drain_after_signal(signal: impl Future<Output = ()>, faces: Vec<Draining>, drain: Duration) {
    signal.await;
    for face in &faces {
        face.begin();
    }
    if drain.is_zero() {
        tracing::info!("shutting down: not ready, no drain delay");
        return;
    }
    tracing::info!(drain_secs = drain.as_secs(), "shutting down: not ready, still serving for the drain delay");
    // Installed only now: the first signal must not also end the drain.
    let again = shutdown_signal();
    tokio::select! {
        () = tokio::time::sleep(drain) => {}
        () = again => tracing::info!("a second signal: ending the drain delay early"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The faces turn not ready when the signal arrives, and the drain lasts its delay.
    #[tokio::test]
    async fn faces_turn_not_ready_at_the_signal_and_the_drain_lasts_its_delay() {
        const DELAY: Duration = Duration::from_millis(300);
        let faces = [Draining::default(), Draining::default()];
        let (signal_tx, signal_rx) = tokio::sync::oneshot::channel::<()>();
        let signal = async move {
            let _ = signal_rx.await;
        };
        let started = tokio::time::Instant::now();
        let drain = tokio::spawn(drain_after_signal(signal, faces.to_vec(), DELAY));
        tokio::task::yield_now().await;
        assert!(faces.iter().all(|face| !face.is_draining()), "ready before the signal");
        let _ = signal_tx.send(());
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(faces.iter().all(Draining::is_draining), "not ready at once after the signal");
        assert!(!drain.is_finished(), "the drain ended before its delay");
        drain.await.expect("the drain task");
        assert!(started.elapsed() >= DELAY, "the drain ended after {:?}", started.elapsed());
    }
}
