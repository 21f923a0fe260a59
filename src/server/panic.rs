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

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use axum::response::IntoResponse;
    use axum::routing::get;
    use axum::Router;
    use tower::ServiceExt;

    use super::*;

    async fn buggy_handler() -> &'static str {
        panic!("a bug in a handler")
    }

    /// A panicking handler is answered by the face's own 500, and the router goes on serving.
    #[tokio::test]
    async fn a_panic_is_answered_by_the_faces_500() {
        let answer = || (StatusCode::INTERNAL_SERVER_ERROR, "the face's own 500").into_response();
        let router = Router::new().route("/", get(buggy_handler)).layer(catch_panics("test", answer));
        for _ in 0..2 {
            let request = Request::get("/").body(Body::empty()).unwrap();
            let response = router.clone().oneshot(request).await.unwrap();
            assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
            let body = axum::body::to_bytes(response.into_body(), 1 << 10).await.unwrap();
            assert_eq!(&body[..], b"the face's own 500");
        }
    }
}
