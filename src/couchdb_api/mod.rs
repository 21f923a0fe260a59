//! The CouchDB HTTP API, served over whichever backend is configured.
//!
//! Existing deployments talk CouchDB's API to `agent_data_store` with their own programs:
//! application clients, backup tools, replicators. [`CouchApp`] answers that API on its own
//! listener (`--couchdb-listen`) beside the REST API, for the server root and one database, over
//! the same [`DataStore`] facade and [`DocumentBackend`] trait as everything else: it never
//! reaches into an adapter, so it works the same over the embedded store, DynamoDB, Firestore
//! and CouchDB itself.
//!
//! Each request is authenticated first ([`auth`]: Basic or an `AuthSession` cookie from
//! [`session`], resolved to an [`access::Principal`]). Every database is answered by one set of
//! handlers, [`db`], over the engine ([`crate::database`]): the data-store database too, on every
//! backend (one engine database built at startup, [`CouchState::data_store_database`], its
//! login's confinement applied by the handlers; on the CouchDB backend its tree layout is
//! CouchDB's own trees, `crate::database::layout::native`, and its design documents and views
//! are passed to CouchDB as that backend's other databases' requests are). The router here
//! answers the server's own endpoints ([`root`], `_all_dbs`, `_dbs_info`, `_session`, the node's
//! [`node`] with the request counts of [`stats`], `_db_updates` [`db_updates`]) and hands
//! every path below a database to [`db`]. What the handlers share stays here: the listings'
//! parameters and paging ([`listing`]), the revision a write names ([`document`]) and the
//! `_local_docs` listing ([`local_docs`]).
//! Responses follow CouchDB 3.x field for field: `docs/couchdb-api.md` lists what is supported
//! and how it differs.

pub mod access;
pub mod auth;
mod changes;
mod client_address;
mod db;
mod db_updates;
mod document;
pub mod error;
mod listing;
mod local_docs;
mod multipart;
mod node;
mod position_seal;
mod replicator;
mod request;
mod response;
mod root;
mod runs;
pub mod session;
pub mod shared_lockout;
pub mod shared_secret;
mod stats;
pub mod users;
mod validation;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{RawQuery, Request, State};
use axum::http::HeaderMap;
use axum::middleware::{from_fn, from_fn_with_state, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::Router;
use tokio::net::TcpListener;

pub use access::Principal;
pub use error::CouchError;

use crate::config::Settings;
use crate::error::Result;
use crate::server::{ConnectionLimits, Exposure};
use crate::store::DataStore;

/// What every handler shares, behind one reference count.
///
/// axum hands each handler and each `from_fn_with_state` layer a clone of its state on every
/// request; a clone of [`CouchShared`] itself takes and drops a reference on each of its members
/// (about twenty counts, shared by every core), which showed as 4% of a `GET`'s processor time
/// (`perf`, issue 38). A clone of this one is one count.
#[derive(Clone)]
pub(crate) struct CouchState(Arc<CouchShared>);

impl std::ops::Deref for CouchState {
    type Target = CouchShared;

    fn deref(&self) -> &CouchShared {
        &self.0
    }
}

/// What every handler shares ([`CouchState`] holds it).
#[derive(Clone)]
pub(crate) struct CouchShared {
    pub store: Arc<DataStore>,
    pub db: Arc<str>,
    pub bodies: Arc<request::Bodies>,
    pub server_uuid: Arc<str>,
    pub auth: Arc<auth::CouchAuth>,
    /// Tells waiting `_changes` requests that the server is shutting down.
    pub stopping: tokio::sync::watch::Receiver<bool>,
    /// Set on SIGTERM/SIGINT: `/_up` answers 404 `nolb` while requests are still served.
    pub draining: crate::server::Draining,
    /// Bounds on `_changes` waits and long-lived feeds per login.
    pub feeds: Arc<changes::FeedBounds>,
    /// The databases besides the data-store one (built with the same bounds as
    /// [`Self::data_store_database`]).
    pub databases: Arc<crate::database::Databases>,
    /// Most names one `POST /_dbs_info` may ask about, and databases one `GET /_dbs_info` answers
    /// (`couchdb_max_dbs_info_keys`).
    pub max_dbs_info_keys: usize,
    /// Most queries one `POST …/_view/{view}/queries` may ask (`couchdb_max_view_queries`).
    pub max_view_queries: usize,
    /// Their views ([`crate::views`]): the index file and the engine running design functions.
    pub views: Arc<crate::views::service::Views>,
    /// The JavaScript engine running design documents' functions (views, filters).
    pub js: crate::js::JsEngine,
    /// The data-store database as the engine serves it (through [`db::router`], like the
    /// others), built once here: it is the facade's backend, not one of the catalog's databases,
    /// so it is kept apart from [`crate::database::Databases`]' open-database bound. On the
    /// CouchDB backend its tree layout is the backend's own trees
    /// ([`crate::database::layout::native`]).
    pub data_store_database: Arc<crate::database::Database>,
    /// Their routes ([`db::router`]); empty inside those routes' own state.
    pub database_router: axum::Router,
    /// The replications this server runs (`_replicator`, `_replicate`); `None` on the CouchDB
    /// backend, whose databases are CouchDB's and replicated by it.
    pub replicator: Option<crate::replicator::Replicator>,
    /// What the node endpoints show: request counts, settings ([`node`]).
    pub node: Arc<node::NodeInfo>,
    /// The REST listener's counters, appended to `GET /_node/{node}/_prometheus` ([`node`]);
    /// `None` when this API is built without that listener.
    pub metrics: Option<Arc<crate::http::Metrics>>,
    /// The whole-deployment runs started through this API (`/_agentstore/runs`, [`runs`]).
    pub runs: Arc<crate::migrate::deployment::service::ServiceRuns>,
}

/// What [`CouchApp::build_with`] takes besides the store and the settings.
#[derive(Default)]
pub struct CouchOptions {
    /// The REST listener's metrics, served again at `/_node/{node}/_prometheus`.
    pub metrics: Option<Arc<crate::http::Metrics>>,
}

impl CouchShared {
    /// Whether `db` is the data-store database as the engine serves it.
    pub fn is_data_store(&self, db: &crate::database::Database) -> bool {
        std::ptr::eq(self.data_store_database.as_ref(), db)
    }
}

/// The CouchDB API, configured and ready to serve on a listener.
pub struct CouchApp {
    router: Router,
    /// The databases besides the data-store one, as the routes share them.
    databases: Arc<crate::database::Databases>,
    open: bool,
    stopping: tokio::sync::watch::Sender<bool>,
    /// Turns `/_up` not ready at SIGTERM, before the listener stops.
    draining: crate::server::Draining,
}

impl CouchApp {
    /// Builds the API over `store` (shared with the REST API, so both see one set of write
    /// queues and namespace caches). Without `couchdb_session_secret`, sessions are signed under
    /// the secret kept in the backend ([`shared_secret`]), created there by the first instance
    /// and re-read every [`shared_secret::SESSION_SECRET_REFRESH_SECS`]; failed logins are counted
    /// there too ([`shared_lockout`]), so every instance locks a name at the same count.
    pub async fn build(store: Arc<DataStore>, settings: &Settings) -> Result<Self> {
        Self::build_with(store, settings, CouchOptions::default()).await
    }

    /// [`Self::build`], with what the REST listener beside it shares ([`CouchOptions`]).
    pub async fn build_with(store: Arc<DataStore>, settings: &Settings, options: CouchOptions) -> Result<Self> {
        let (stopping, stopping_seen) = tokio::sync::watch::channel(false);
        let bodies = request::Bodies::from_settings(settings);
        let server_uuid = match &settings.couchdb_server_uuid {
            Some(uuid) => uuid.clone(),
            None => root::stable_uuid(&store.backend().describe()),
        };
        let databases_url = store.backend().url();
        let view_index = view_index_slots(settings, databases_url.as_ref(), &store.backend().describe());
        let js = crate::js::JsEngine::new(settings.js_limits())
            .map_err(|err| crate::error::Error::new(crate::error::ErrorKind::Internal, err.to_string()))?;
        let auth = Arc::new(auth::CouchAuth::from_settings(settings)?);
        if settings.couchdb_session_secret.is_none() {
            let stored = shared_secret::load_or_create(store.backend().as_ref()).await?;
            auth.use_session_secrets(stored.current, stored.previous);
            shared_secret::keep_refreshed(&auth, store.backend());
        }
        auth.share_lockout(Arc::clone(store.backend()));
        let engine: Arc<dyn crate::views::service::ViewEngine> = Arc::new(crate::mango::index_map::WithMangoIndexes(
            crate::views::javascript::JavaScriptViews::new(js.clone()),
        ));
        let views = Arc::new(
            claim_views(databases_url.as_ref(), &view_index, engine)?.with_bounds(view_build_bounds(settings)),
        );
        let databases = Arc::new(
            crate::database::Databases::from_url(databases_url, settings.couchdb_max_open_databases)
                .with_recheck(Duration::from_millis(settings.couchdb_database_recheck_ms))
                .with_max_document_bytes(settings.couchdb_max_document_bytes)
                .with_max_tree_bytes(settings.couchdb_max_tree_bytes)
                .with_inner_body_bounds(crate::database::InnerBodyBounds {
                    max_revisions: settings.couchdb_inner_bodies_max_revisions,
                    max_bytes: settings.couchdb_inner_bodies_max_bytes,
                })
                .with_max_gzip_ratio(settings.couchdb_max_gzip_ratio)
                .with_inline_budget(
                    settings.couchdb_max_inflight_inline_bytes,
                    Duration::from_millis(settings.couchdb_inline_wait_ms),
                )
                .with_attachment_bounds(
                    settings.couchdb_attachment_limit(),
                    Duration::from_secs(settings.couchdb_attachment_grace_secs),
                )
                .with_database_guard(
                    crate::replicator::REPLICATOR_DB,
                    Arc::new(crate::replicator::rules::ReplicatorRules),
                )
                .with_write_guard(Arc::new(crate::database::validation::DesignValidation::new(js.clone()))),
        );
        // Not fatal: an embedded store's `_users` file held by another process in this one (a
        // test's second server), or a backend briefly away, leaves it to the first request.
        if let Err(err) = databases.ensure_users_db().await {
            tracing::warn!(error = %err, "cannot make sure the _users database exists");
        }
        auth.use_users_db(Arc::new(users::UsersDb::new(Arc::clone(&databases))));
        let replicator = start_replicator(settings, &databases, &server_uuid, &js, &stopping_seen).await?;
        let data_store_database =
            databases.data_store(&settings.couchdb_db, Arc::clone(store.backend()), store.options().limits)?;
        crate::database::global_changes::keep_flushing(
            &databases,
            Duration::from_millis(settings.couchdb_db_updates_flush_ms),
        );
        let node = Arc::new(node::NodeInfo {
            requests: Arc::default(),
            config: node::NodeConfig::from_settings(settings, &server_uuid, &store.backend().describe())?,
        });
        let runs = crate::migrate::deployment::service::ServiceRuns::new(
            Arc::clone(store.backend()),
            Arc::clone(&databases),
            settings,
            stopping_seen.clone(),
        )?;
        let shared = CouchShared {
            runs,
            node,
            metrics: options.metrics,
            data_store_database,
            auth,
            store,
            db: Arc::from(settings.couchdb_db.as_str()),
            bodies: Arc::new(bodies),
            server_uuid: Arc::from(server_uuid.as_str()),
            stopping: stopping_seen,
            draining: crate::server::Draining::default(),
            feeds: Arc::new(changes::FeedBounds::from_settings(settings)),
            databases,
            max_dbs_info_keys: settings.couchdb_max_dbs_info_keys,
            max_view_queries: settings.couchdb_max_view_queries,
            views,
            js,
            database_router: axum::Router::new(),
            replicator,
        };
        // The database routes' own state has no routes of its own (they would hold themselves).
        let database_router = db::router(CouchState(Arc::new(shared.clone())));
        let state = CouchState(Arc::new(CouchShared { database_router, ..shared }));
        let open = state.auth.is_open();
        let databases = Arc::clone(&state.databases);
        let draining = state.draining.clone();
        Ok(CouchApp { router: router(state), databases, open, stopping, draining })
    }

    /// What turns this face's `/_up` not ready when the process is told to stop
    /// ([`crate::server::drain_after_signal`]).
    pub fn draining(&self) -> crate::server::Draining {
        self.draining.clone()
    }

    /// The databases besides the data-store one this API serves (tests look at their storage).
    pub fn databases(&self) -> Arc<crate::database::Databases> {
        Arc::clone(&self.databases)
    }

    /// Whether requests need no credentials (no CouchDB users configured).
    pub fn is_open(&self) -> bool {
        self.open
    }

    /// Serves until `shutdown` resolves; connection limits and the grace period are the REST
    /// API's.
    pub async fn serve(
        self,
        listener: TcpListener,
        settings: &Settings,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<()> {
        let stopping = self.stopping;
        let shutdown = async move {
            shutdown.await;
            let _ = stopping.send(true);
        };
        let limits = ConnectionLimits::from_settings(settings);
        crate::server::serve(
            listener,
            self.draining.close_connections_while_draining(self.router),
            limits,
            shutdown,
            Duration::from_secs(settings.shutdown_grace_secs),
        )
        .await;
        Ok(())
    }
}

fn router(state: CouchState) -> Router {
    // The server's own endpoints take any login, a login of the other databases only too.
    let server_endpoints = Router::new()
        .route("/_all_dbs", get(db::all_dbs))
        .route("/_dbs_info", get(db::get_dbs_info).post(db::dbs_info))
        .route("/_active_tasks", get(root::active_tasks))
        .route("/_membership", get(root::membership))
        .route("/_scheduler/jobs", get(replicator::scheduler_jobs))
        .route("/_scheduler/docs", get(replicator::scheduler_docs))
        .route("/_scheduler/docs/{*rest}", get(replicator::scheduler_doc))
        .route("/_replicate", axum::routing::post(replicator::replicate))
        .route("/_uuids", get(root::uuids))
        .route("/_agentstore/runs", axum::routing::post(runs::start))
        .route("/_agentstore/runs/{id}", axum::routing::delete(runs::cancel))
        .route_layer(from_fn(authenticate_login));
    // The node endpoints and `_db_updates` check who asks themselves, to answer CouchDB's own
    // refusals (a `_metrics` role reads the statistics).
    let node_endpoints = Router::new()
        .route("/_db_updates", get(db_updates::db_updates).fallback(node::only_get))
        .route("/_node/{node}", get(node::node))
        .route("/_node/{node}/_stats", get(node::stats).fallback(node::only_get))
        .route("/_node/{node}/_stats/{*path}", get(node::stats_path).fallback(node::only_get))
        .route("/_node/{node}/_prometheus", get(node::prometheus).fallback(node::only_get))
        .route("/_node/{node}/_system", get(node::system).fallback(node::only_get))
        .route("/_node/{node}/_versions", get(node::versions).fallback(node::only_get))
        .route("/_node/{node}/_config", get(node::config_all).fallback(node::only_get))
        .route("/_node/{node}/_config/{section}", get(node::config_section).fallback(node::only_get))
        .route(
            "/_node/{node}/_config/{section}/{key}",
            get(node::config_key)
                .put(node::config_write)
                .delete(node::config_write)
                .fallback(node::only_get_put_delete),
        );
    // Names starting with `_` that no endpoint above takes (every other name is a database's,
    // [`db::dispatch`]): no database here is named so. `PUT` is CouchDB's server-admin check
    // and name rule ([`db::create_db`]); anything else is CouchDB's 404 for a missing database.
    let underscored = Router::new()
        .route("/{db}", get(root::no_such_database).put(db::create_db).delete(root::no_such_database))
        // PouchDB asks for a database with a trailing slash.
        .route("/{db}/", get(root::no_such_database).put(db::create_db).delete(root::no_such_database))
        .route("/{db}/{*below}", any(root::no_such_database))
        .route_layer(from_fn(authenticate))
        .merge(server_endpoints)
        .merge(node_endpoints);
    Router::new()
        .route("/", get(root::welcome))
        .route("/_up", get(root::up))
        .route("/_session", get(get_session).post(post_session).delete(delete_session))
        // The console (`crate::console`): its files need no login, as CouchDB's `/_utils`.
        .route("/_utils", any(crate::console::redirect))
        .route("/_utils/", any(crate::console::index))
        .route("/_utils/{*file}", any(crate::console::file))
        .merge(underscored)
        .fallback(root::no_route)
        .method_not_allowed_fallback(root::method_not_allowed)
        // Before routing: every path below a database goes to the databases' routes.
        // After identification, which it needs.
        .layer(from_fn_with_state(state.clone(), db::dispatch))
        // Outside the dispatch, so the inline attachments of every database's answers are held
        // in the server-wide budget until the answer is sent.
        .layer(from_fn(db::hold_inline_until_sent))
        .layer(from_fn_with_state(Arc::clone(&state.auth), auth::identify_request))
        .layer(crate::server::catch_panics("couchdb", root::internal_error))
        .layer(from_fn_with_state(Arc::clone(&state.node.requests), stats::count_requests))
        .layer(from_fn(response::couchdb_headers))
        .with_state(state)
}

/// The replicator over `databases`, following `_replicator` until the server stops; `None` on
/// the CouchDB backend (its `_replicator` is CouchDB's, run by CouchDB). `_replicator` is created
/// first when missing (not fatal, as `_users`).
async fn start_replicator(
    settings: &Settings,
    databases: &Arc<crate::database::Databases>,
    server_uuid: &str,
    js: &crate::js::JsEngine,
    stopping: &tokio::sync::watch::Receiver<bool>,
) -> Result<Option<crate::replicator::Replicator>> {
    use crate::replicator::{job, scheduler};
    if databases.source().is_none() || matches!(databases.source(), Some(crate::backend::BackendUrl::CouchDb(_))) {
        return Ok(None);
    }
    if let Err(err) = databases.ensure_system_db(crate::replicator::REPLICATOR_DB).await {
        tracing::warn!(error = %err, "cannot make sure the _replicator database exists");
    }
    let context = job::JobContext {
        databases: Arc::clone(databases),
        server_uuid: Arc::from(server_uuid),
        js: Some(js.clone()),
        bounds: job::JobBounds {
            connect_timeout: Duration::from_millis(settings.couchdb_replication_connect_timeout_ms),
            checkpoint_interval: Duration::from_millis(settings.couchdb_replication_checkpoint_ms),
            ..job::JobBounds::default()
        },
    };
    let bounds = scheduler::SchedulerBounds::new(
        settings.couchdb_max_replication_jobs,
        Duration::from_secs(settings.couchdb_replication_lease_secs),
    );
    let replicator = crate::replicator::Replicator::new(context, bounds)?;
    replicator.start(stopping.clone());
    Ok(Some(replicator))
}

/// Middleware on the routes of names starting with `_`, as on the data-store database's: the request must act for someone (CouchDB's
/// 401 otherwise; 403 for a login with no data-store user); handlers get that [`Principal`].
async fn authenticate(mut request: Request, next: Next) -> Response {
    if let Err(refusal) = require_principal(&mut request) {
        return refusal.into_response();
    }
    next.run(request).await
}

/// Middleware on the server's own endpoints: any login (CouchDB's 401 without one); handlers
/// read the request's [`auth::Identity`].
async fn authenticate_login(request: Request, next: Next) -> Response {
    if let Err(refusal) = require_login(&request) {
        return refusal.into_response();
    }
    next.run(request).await
}

/// A request made with a login (or to the open API), or CouchDB's 401.
pub(crate) fn require_login(request: &Request) -> std::result::Result<(), CouchError> {
    match request.extensions().get::<auth::Identity>() {
        Some(identity) => identity.require_login(),
        None => Err(CouchError::internal("the request was not identified")),
    }
}

/// Puts the [`Principal`] the request acts for into its extensions, or answers CouchDB's 401 (403
/// for a login with no data-store user).
pub(crate) fn require_principal(request: &mut Request) -> std::result::Result<(), CouchError> {
    let principal = match request.extensions().get::<auth::Identity>().map(auth::Identity::require) {
        Some(Ok(principal)) => principal.clone(),
        Some(Err(err)) => return Err(err),
        None => return Err(CouchError::internal("the request was not identified")),
    };
    request.extensions_mut().insert(principal);
    Ok(())
}

/// `POST /_session`: a login, form-encoded or JSON (possibly gzip-compressed).
async fn post_session(
    State(state): State<CouchState>,
    RawQuery(query): RawQuery,
    peer: Option<axum::Extension<axum::extract::ConnectInfo<SocketAddr>>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let peer = peer.map(|info| info.0 .0.ip());
    match state.bodies.read_login(&headers, body).await {
        Ok(body) => session::post_session_from(&state.auth, &headers, query.as_deref(), body, peer).await,
        Err(err) => err.into_response(),
    }
}

/// `GET /_session`: who the request acts as.
async fn get_session(State(state): State<CouchState>, RawQuery(query): RawQuery, headers: HeaderMap) -> Response {
    session::get_session(&state.auth, &headers, query.as_deref()).await
}

/// `DELETE /_session`: a logout (clears the cookie).
async fn delete_session(RawQuery(query): RawQuery) -> Response {
    session::delete_session(query.as_deref())
}

/// Binds the CouchDB listener, refusing non-loopback addresses when anyone could act as admin.
pub async fn bind(listen: &str, app: &CouchApp, allow_unauthenticated: bool) -> Result<TcpListener> {
    let exposure = Exposure {
        setting: "couchdb_listen",
        open: app.is_open(),
        allow_unauthenticated,
        refusal: format!(
            "refusing to serve the CouchDB API on {listen} with no CouchDB users configured: anyone who can \
             reach it would be admin. Configure couchdb_users, listen on loopback, or pass --allow-unauthenticated"
        ),
    };
    crate::server::bind(listen, exposure).await
}

/// Handler results.
pub(crate) type Answer = std::result::Result<Response, CouchError>;

/// A JSON answer with a status.
pub(crate) fn json(status: axum::http::StatusCode, body: serde_json::Value) -> Response {
    (status, axum::Json(body)).into_response()
}

/// A response of JSON text already written, labelled as [`json`] labels its own.
pub(crate) fn json_text(status: axum::http::StatusCode, text: String) -> Response {
    let content_type = [(axum::http::header::CONTENT_TYPE, axum::http::HeaderValue::from_static("application/json"))];
    (status, content_type, text).into_response()
}

/// The view index files this process may claim over the backend `url` (described as
/// `describe`), first tried first ([`crate::views::index_file`], docs/views.md): slots
/// `views-{digest}-{k}.redb` in `couchdb_view_index_dir`, else the one file beside an embedded
/// store's file (that store admits one process), else slots in the user's state directory. Here
/// rather than in `config`, as [`view_build_bounds`] is.
fn view_index_slots(
    settings: &Settings,
    url: Option<&crate::backend::BackendUrl>,
    describe: &str,
) -> crate::views::index_file::IndexSlots {
    use crate::views::index_file::IndexSlots;
    use std::path::{Path, PathBuf};
    // One set of files per backend, named so two backends never share one.
    let digest = <sha2::Sha256 as sha2::Digest>::digest(describe.as_bytes());
    let named: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    let stem = format!("views-{named}");
    let slots = settings.couchdb_view_index_slots;
    if let Some(dir) = &settings.couchdb_view_index_dir {
        return IndexSlots::in_directory(Path::new(dir), &stem, slots, "couchdb_view_index_dir");
    }
    if let Some(crate::backend::BackendUrl::Embedded { path, .. }) = url {
        let mut file = path.clone().into_os_string();
        file.push(".views.redb");
        return IndexSlots::single(PathBuf::from(file), "couchdb_view_index_dir");
    }
    let state = std::env::var_os("XDG_STATE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".local/state")))
        .map(|base| base.join("agentstore/views"))
        .unwrap_or_else(|| PathBuf::from("agentstore-views"));
    IndexSlots::in_directory(&state, &stem, slots, "couchdb_view_index_dir")
}

/// This process's views: over the CouchDB backend none are kept here (CouchDB indexes its own
/// databases), so nothing is claimed; over the others the first free index slot is claimed now,
/// and a process that cannot claim one stops here rather than at its first view query.
fn claim_views(
    url: Option<&crate::backend::BackendUrl>,
    slots: &crate::views::index_file::IndexSlots,
    engine: Arc<dyn crate::views::service::ViewEngine>,
) -> Result<crate::views::service::Views> {
    use crate::views::service::Views;
    if matches!(url, Some(crate::backend::BackendUrl::CouchDb(_))) {
        let unused = slots.files.first().cloned().unwrap_or_default();
        return Ok(Views::new(unused, engine));
    }
    Ok(Views::claimed(crate::views::index_file::claim(slots)?, engine))
}

/// What building a view index may hold and write (`couchdb_view_*`, docs/views.md), from the
/// settings. Here rather than in `config`, which `views` would otherwise close a cycle with.
fn view_build_bounds(settings: &Settings) -> crate::views::updater::BuildBounds {
    crate::views::updater::BuildBounds {
        max_rows_per_doc: settings.couchdb_view_max_rows_per_doc,
        max_key_bytes: settings.couchdb_view_max_key_bytes,
        max_doc_bytes: settings.couchdb_view_max_doc_bytes,
        batch_bytes: settings.couchdb_view_batch_bytes,
        max_index_bytes: settings.couchdb_view_max_index_bytes,
    }
}
