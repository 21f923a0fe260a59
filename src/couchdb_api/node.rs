//! Two of CouchDB's node endpoints, for the console's service page (`docs/console.md`) and any
//! client that reads them from CouchDB: `GET /_node/{node}/_config`, the settings this process
//! runs with that bound what a client may do (every number of `docs/bounds.md`'s table), with the
//! backend it serves, and `GET /_node/{node}/_prometheus`, the Prometheus text of the counters the
//! REST listener's `/metrics` shows (one registry: the same numbers on both listeners). Both are a
//! server admin's, as CouchDB's (`chttpd_auth_request`: every `/_node` path). CouchDB's
//! `_config` lists its ini file's sections; this one answers two sections of its own,
//! `agentstore` (the bounds, as strings, as CouchDB answers every value) and `backend`; no
//! secret is among them (the logins, tokens, session secret and backend credentials are not
//! listed, and the backend is its redacted description). `PUT`/`DELETE` of a setting is not
//! offered (405): settings change by restarting with new ones.

use std::sync::Arc;

use axum::extract::{Extension, Path, State};
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use serde_json::{json, Map, Value};

use super::auth::Identity;
use super::error::CouchError;
use super::root::{server_admin_only, this_node};
use super::{json, Answer, CouchState};
use crate::config::Settings;

/// What `_config` answers, built once at startup from the settings.
pub(crate) fn config_sections(settings: &Settings, backend: &str) -> Value {
    let mut bounds = Map::new();
    macro_rules! list {
        ($($field:ident),* $(,)?) => {
            $(bounds.insert(stringify!($field).to_owned(), Value::String(settings.$field.to_string()));)*
        };
    }
    list!(
        max_value_bytes,
        max_conflict_retries,
        page_size,
        request_timeout_secs,
        header_read_timeout_secs,
        idle_timeout_secs,
        max_connections,
        max_inflight_parse_bytes,
        shutdown_grace_secs,
        shutdown_drain_secs,
        body_read_timeout_secs,
        body_min_bytes_per_sec,
        max_connection_buffer_bytes,
        couchdb_session_timeout_secs,
        couchdb_max_document_bytes,
        couchdb_max_login_bytes,
        couchdb_max_query_bytes,
        couchdb_max_dbs_info_keys,
        couchdb_max_view_queries,
        couchdb_max_open_databases,
        couchdb_max_tree_bytes,
        couchdb_max_gzip_ratio,
        couchdb_max_inflight_inline_bytes,
        couchdb_inline_wait_ms,
        couchdb_inner_bodies_max_revisions,
        couchdb_inner_bodies_max_bytes,
        couchdb_attachment_grace_secs,
        couchdb_changes_timeout_ms,
        couchdb_changes_max_feed_secs,
        couchdb_changes_min_heartbeat_ms,
        couchdb_max_feeds_per_login,
        couchdb_max_descending_changes,
        couchdb_lockout_threshold,
        couchdb_lockout_secs,
        couchdb_lockout_max_entries,
        couchdb_max_queued_suspect_logins,
        couchdb_database_recheck_ms,
        couchdb_js_workers,
        couchdb_js_timeout_ms,
        couchdb_js_memory_bytes,
        couchdb_view_max_doc_bytes,
        couchdb_view_max_key_bytes,
        couchdb_view_max_rows_per_doc,
        couchdb_view_max_index_bytes,
        couchdb_view_batch_bytes,
    );
    // Those whose default is computed from others: the value in force.
    bounds.insert("max_body_bytes".to_owned(), Value::String(settings.body_limit().to_string()));
    bounds.insert("max_inflight_body_bytes".to_owned(), Value::String(settings.inflight_body_budget().to_string()));
    bounds.insert("couchdb_max_request_bytes".to_owned(), Value::String(settings.couchdb_request_limit().to_string()));
    let unbounded = |limit: u64| if limit == u64::MAX { "none".to_owned() } else { limit.to_string() };
    bounds.insert(
        "couchdb_max_attachment_bytes".to_owned(),
        Value::String(unbounded(settings.couchdb_attachment_limit())),
    );
    bounds.insert("track_reads".to_owned(), Value::String(settings.track_reads.to_string()));
    json!({
        "agentstore": bounds,
        "backend": { "describe": backend, "database": settings.couchdb_db },
    })
}

/// `GET /_node/{node}/_config`.
pub async fn config(
    State(state): State<CouchState>,
    Extension(identity): Extension<Identity>,
    Path(node): Path<String>,
) -> Answer {
    server_admin_only(&identity)?;
    this_node(&node)?;
    Ok(json(StatusCode::OK, (*state.node_config).clone()))
}

/// `GET /_node/{node}/_prometheus`: the REST listener's registry, or 404 when this API is served
/// without one (a test's bare `CouchApp`).
pub async fn prometheus(
    State(state): State<CouchState>,
    Extension(identity): Extension<Identity>,
    Path(node): Path<String>,
) -> Answer {
    server_admin_only(&identity)?;
    this_node(&node)?;
    let metrics: &Arc<crate::http::Metrics> =
        state.metrics.as_ref().ok_or_else(|| CouchError::not_found("no metrics are kept by this server"))?;
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], metrics.render()).into_response())
}
