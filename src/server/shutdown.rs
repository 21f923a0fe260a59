//! Graceful shutdown: the signal both faces' listeners and the long-running CLI commands
//! (`changes --follow`, `migrate`) stop on.

use std::future::Future;

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
