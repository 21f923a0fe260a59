//! `agentstore serve`: the data store as a JSON REST API.
//!
//! [`App`] puts the pieces together: the facade over a metered backend, bearer-token auth on
//! `/v1`, request ids, tracing spans, Prometheus metrics, timeouts, a body limit and budget
//! (`body`), connection limits and graceful shutdown (`crate::server`). [`ROUTES`] lists every route;
//! `openapi.json` documents exactly those (a test checks).

mod auth;
mod body;
mod changes;
mod error;
mod metrics;
mod routes;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{MatchedPath, Request};
use axum::http::HeaderName;
use axum::middleware::{from_fn, from_fn_with_state};
use axum::routing::{get, put};
use axum::Router;
use tokio::net::TcpListener;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;

pub use auth::{hash_token, Auth, Scope};
use body::BodyBudget;
pub use error::ApiError;
pub use metrics::{MeteredBackend, Metrics};
use routes::AppState;
pub use routes::AGENT_HEADER;

use crate::backend::DocumentBackend;
use crate::config::Settings;
use crate::error::{Error, ErrorKind, Result};
use crate::server::{self, ConnectionLimits, Exposure};
use crate::store::{DataStore, StoreOptions};

/// The OpenAPI 3 description served at `/openapi.json`.
pub const OPENAPI_JSON: &str = include_str!("openapi.json");

/// Every route the server answers: (method, path template).
pub const ROUTES: &[(&str, &str)] = &[
    ("GET", "/v1/users/{user}/namespaces"),
    ("DELETE", "/v1/users/{user}"),
    ("GET", "/v1/users/{user}/namespaces/{namespace}"),
    ("DELETE", "/v1/users/{user}/namespaces/{namespace}"),
    ("GET", "/v1/users/{user}/namespaces/{namespace}/keys"),
    ("PUT", "/v1/users/{user}/namespaces/{namespace}/keys/{key}"),
    ("GET", "/v1/users/{user}/namespaces/{namespace}/keys/{key}"),
    ("HEAD", "/v1/users/{user}/namespaces/{namespace}/keys/{key}"),
    ("DELETE", "/v1/users/{user}/namespaces/{namespace}/keys/{key}"),
    ("GET", "/v1/changes"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
];

/// The hard per-request timeout is this many request timeouts.
const HARD_TIMEOUT_FACTOR: u32 = 2;

/// A configured server, ready to serve on a listener.
pub struct App {
    store: Arc<DataStore>,
    /// Its counters, shared with the CouchDB listener's `/_node/{node}/_prometheus`.
    metrics: Arc<Metrics>,
    router: Router,
    grace: Duration,
    connections: ConnectionLimits,
    auth_open: bool,
    token_count: usize,
    /// Tells waiting change-feed requests that the server is shutting down.
    stopping: tokio::sync::watch::Sender<bool>,
    /// Turns `/readyz` not ready at SIGTERM, before the listener stops.
    draining: server::Draining,
}

impl App {
    /// Builds the server over `backend` (wrapped for metrics) with `settings`.
    pub async fn build(backend: Arc<dyn DocumentBackend>, settings: &Settings) -> Result<Self> {
        let limits = settings.store_options().limits;
        let auth = Auth::from_settings(&settings.tokens.entries()?, &limits)?;
        let metrics = Arc::new(Metrics::new());
        let backend: Arc<dyn DocumentBackend> = Arc::new(MeteredBackend::new(backend, Arc::clone(&metrics)));
        let request_timeout = Duration::from_secs(settings.request_timeout_secs);
        // Document operations stop cooperatively at the request timeout (503, nothing applied);
        // the hard cut in `router` is only a safety net behind it.
        let options = StoreOptions { deadline: Some(request_timeout), ..settings.store_options() };
        let store = Arc::new(DataStore::open(backend, options).await?);
        let (auth_open, token_count) = (auth.is_open(), auth.token_count());
        let bodies = Arc::new(BodyBudget::new(
            settings.inflight_body_budget(),
            settings.max_inflight_parse_bytes,
            settings.body_limit(),
            limits,
        ));
        let (stopping, stopping_seen) = tokio::sync::watch::channel(false);
        // A longpoll waits at most half the request timeout: the other half is for the reads
        // around the wait, so the answer comes well before the hard cut, and before a client
        // that gives up after the same time as the server.
        let feed = changes::FeedSettings { max_wait: request_timeout / 2, stopping: stopping_seen };
        let state_store = Arc::clone(&store);
        let draining = server::Draining::default();
        let state = AppState {
            store,
            auth: Arc::new(auth),
            metrics: Arc::clone(&metrics),
            bodies,
            feed,
            draining: draining.clone(),
        };
        // A safety net well behind the facade's cooperative deadline: a request cut there may have had
        // a write in flight, so the answer is 504 (outcome unknown), never 408.
        let router = router(state, request_timeout.saturating_mul(HARD_TIMEOUT_FACTOR));
        let router = match cors(&settings.cors_origins.origins()?) {
            Some(layer) => router.layer(layer),
            None => router,
        };
        let connections = ConnectionLimits::from_settings(settings);
        Ok(App {
            metrics,
            store: state_store,
            router,
            grace: Duration::from_secs(settings.shutdown_grace_secs),
            connections,
            auth_open,
            token_count,
            stopping,
            draining,
        })
    }

    /// What turns this face's `/readyz` not ready when the process is told to stop
    /// ([`server::drain_after_signal`]).
    pub fn draining(&self) -> server::Draining {
        self.draining.clone()
    }

    /// The facade the server writes through, for another protocol face served beside it.
    pub fn store(&self) -> Arc<DataStore> {
        Arc::clone(&self.store)
    }

    /// The counters `/metrics` shows, for another face served beside it.
    pub fn metrics(&self) -> Arc<Metrics> {
        Arc::clone(&self.metrics)
    }

    /// Whether requests need no token (no tokens configured).
    pub fn is_open(&self) -> bool {
        self.auth_open
    }

    /// Serves until `shutdown` resolves, then lets in-flight requests finish for up to the grace
    /// period.
    pub async fn serve(self, listener: TcpListener, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<()> {
        let stopping = self.stopping;
        let shutdown = async move {
            shutdown.await;
            let _ = stopping.send(true);
        };
        let router = self.draining.close_connections_while_draining(self.router);
        server::serve(listener, router, self.connections, shutdown, self.grace).await;
        Ok(())
    }
}

fn router(state: AppState, timeout: Duration) -> Router {
    let document = "/v1/users/{user}/namespaces/{namespace}/keys/{key}";
    let v1 = Router::new()
        .route("/v1/users/{user}", axum::routing::delete(routes::purge_user))
        .route("/v1/users/{user}/namespaces", get(routes::list_namespaces))
        .route("/v1/users/{user}/namespaces/{namespace}", get(routes::get_all).delete(routes::delete_namespace))
        .route("/v1/users/{user}/namespaces/{namespace}/keys", get(routes::list_keys))
        .route(
            document,
            put(routes::put_document)
                .get(routes::get_document)
                .head(routes::head_document)
                .delete(routes::delete_document),
        )
        .route_layer(from_fn_with_state(state.clone(), routes::require_auth));
    let request_id = HeaderName::from_static(routes::REQUEST_ID_HEADER);
    Router::new()
        .route("/healthz", get(routes::healthz))
        .route("/readyz", get(routes::readyz))
        .route("/metrics", get(routes::metrics))
        .route("/openapi.json", get(routes::openapi))
        // Admin tokens only: checked by the handler, since the route names no user.
        .route("/v1/changes", get(changes::changes))
        .merge(v1)
        .fallback(routes::no_route)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(from_fn_with_state(timeout, routes::request_timeout))
        .layer(from_fn_with_state(Arc::clone(&state.metrics), metrics::track_requests))
        .layer(server::catch_panics("rest", routes::internal_error))
        .layer(TraceLayer::new_for_http().make_span_with(|request: &Request| {
            // The route template, not the path: paths carry user ids and keys.
            let route = request.extensions().get::<MatchedPath>().map(|p| p.as_str()).unwrap_or("unmatched");
            let id = request.headers().get(routes::REQUEST_ID_HEADER).and_then(|v| v.to_str().ok()).unwrap_or("-");
            tracing::info_span!("request", method = %request.method(), route, request_id = id)
        }))
        .layer(from_fn(error::scope_request_id))
        .layer(PropagateRequestIdLayer::new(request_id.clone()))
        .layer(SetRequestIdLayer::new(request_id, MakeRequestUuid))
        .layer(from_fn(routes::drop_unusable_request_id))
        .with_state(state)
}

/// Browsers' cross-origin calls from the origins of `cors_origins` (the console at `/_utils` on
/// the CouchDB listener: `docs/console.md`), outside every other layer so a preflight `OPTIONS`
/// is answered before authentication; with none listed, no CORS header is ever sent (the layer
/// is absent). The bearer token travels in `Authorization`, never in a cookie, so no credentials
/// mode is allowed.
fn cors(origins: &[String]) -> Option<tower_http::cors::CorsLayer> {
    use axum::http::{header, HeaderValue, Method};
    if origins.is_empty() {
        return None;
    }
    let allowed: Vec<HeaderValue> = origins.iter().filter_map(|o| HeaderValue::from_str(o).ok()).collect();
    Some(
        tower_http::cors::CorsLayer::new()
            .allow_origin(allowed)
            .allow_methods([Method::GET, Method::HEAD, Method::PUT, Method::DELETE])
            .allow_headers([
                header::AUTHORIZATION,
                header::CONTENT_TYPE,
                header::IF_MATCH,
                header::IF_NONE_MATCH,
                HeaderName::from_static(routes::AGENT_HEADER),
            ])
            .expose_headers([header::ETAG, HeaderName::from_static(routes::REQUEST_ID_HEADER)])
            .max_age(Duration::from_secs(600)),
    )
}

/// Resolves `listen` and binds it, refusing non-loopback addresses when no tokens are configured
/// unless `allow_unauthenticated` says otherwise.
pub async fn bind(listen: &str, app: &App, allow_unauthenticated: bool) -> Result<TcpListener> {
    let exposure = Exposure {
        setting: "listen",
        open: app.is_open(),
        allow_unauthenticated,
        refusal: format!(
            "refusing to listen on {listen} with no tokens configured: anyone who can reach it could read \
             and write every user's data. Configure tokens, listen on loopback, or pass \
             --allow-unauthenticated"
        ),
    };
    let listener = server::bind(listen, exposure).await?;
    let local = listener.local_addr().map_err(|e| Error::new(ErrorKind::Internal, "local address").with_source(e))?;
    if app.is_open() {
        tracing::warn!(%local, "no tokens configured: every request is allowed (authentication is off)");
    } else {
        tracing::info!(%local, tokens = app.token_count, "bearer-token authentication on");
    }
    Ok(listener)
}
