//! A handler that panics: logged, and answered as a 500 in the face's own error shape, so one bug
//! costs one request, never the connection or the server.

use std::any::Any;

use axum::response::Response;
use tower_http::catch_panic::{CatchPanicLayer, ResponseForPanic};

/// The router layer that catches a panicking handler of `face` (named in the log) and answers
/// with `answer`, the face's 500.
pub fn catch_panics(
    face: &'static str,
    answer: fn() -> Response,
) -> CatchPanicLayer<impl ResponseForPanic<ResponseBody = axum::body::Body> + Send + Sync + 'static> {
    CatchPanicLayer::custom(move |panic: Box<dyn Any + Send + 'static>| {
        // The panic's message is for the log only: it may quote request data.
        let what =
            panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned());
        tracing::error!(face, panic = what.as_deref().unwrap_or("?"), "a request handler panicked");
        answer()
    })
}
