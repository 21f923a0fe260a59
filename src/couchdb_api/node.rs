//! The node endpoints, as CouchDB 3.4.3's `chttpd_node` answers them for the one node this
//! process is (`_local`, or its name [`NODE_NAME`]; any other name is 404 `no such node`):
//!
//! - `/_node/{node}`: the node's name.
//! - `/_node/{node}/_stats[/{group}/{metric}…]`: CouchDB's statistics tree (`{"value", "type",
//!   "desc"}` leaves, histograms summarised as CouchDB summarises them) for what this server
//!   counts: the CouchDB API's requests ([`super::stats`]), documents read and databases changed
//!   ([`crate::database::activity`]), open databases, `_global_changes` writes. A path that names
//!   nothing is `null`, as CouchDB answers it. The statistics CouchDB keeps of its own machinery
//!   (Erlang processes, shards, its query servers, couch_replicator, mango, fabric, rexi, …) have
//!   no counterpart and are left out (docs/couchdb-api.md lists them).
//! - `/_node/{node}/_prometheus`: the same numbers under CouchDB's metric names, in Prometheus'
//!   text format 0.0.4, followed by the REST listener's own counters (`agentstore_*`, what its
//!   `/metrics` shows) when this API is served beside it.
//! - `/_node/{node}/_system`: `uptime`; CouchDB's other fields describe the Erlang VM and are
//!   left out.
//! - `/_node/{node}/_versions`: the JavaScript engine and the collation library.
//! - `/_node/{node}/_config[/{section}[/{key}]]`: this server's settings under CouchDB's
//!   sections and keys where CouchDB has one ([`NodeConfig::from_settings`]), and two sections of
//!   its own: `agentstore`, every bound in force by its setting's name (docs/bounds.md), and
//!   `backend`, the backend's redacted description; secrets are never
//!   shown (server admins' entries show a placeholder where CouchDB shows their hashes). The
//!   settings are read-only over HTTP: `PUT`/`DELETE` of a key are answered 403 `forbidden`, as
//!   CouchDB answers a change to a section it does not let HTTP change (a `DELETE` of a key that
//!   does not exist stays CouchDB's 404).
//!
//! `_stats`, `_prometheus` and `_system` are a server admin's or a `_metrics` role's; the others
//! a server admin's (CouchDB's `chttpd_auth_request`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;

use axum::extract::{Extension, Path, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

use super::auth::Identity;
use super::error::{CouchError, CouchResult};
use super::root::server_admin_only;
use super::stats::RequestStats;
use super::{json, Answer, CouchState};
use crate::config::Settings;

/// The node name this process answers to: one node, itself.
pub const NODE_NAME: &str = "agentstore@localhost";

/// The role that reads the statistics (`_stats`, `_prometheus`, `_system`) without being an
/// admin: CouchDB's, held by a `_users` user or a configured login.
pub const METRICS_ROLE: &str = "_metrics";

/// What a server admin's entry in `_config/admins` shows instead of a password hash.
pub const HIDDEN: &str = "(hidden)";

/// The node's state the endpoints read: request counts and the settings as CouchDB names them.
pub struct NodeInfo {
    pub requests: Arc<RequestStats>,
    pub config: NodeConfig,
}

/// Every bound of docs/bounds.md's table that a setting sets, by the setting's name, as strings
/// (as CouchDB answers every `_config` value): the console's service page lists them.
fn bounds_in_force(settings: &Settings) -> BTreeMap<String, String> {
    let mut bounds = BTreeMap::new();
    macro_rules! list {
        ($($field:ident),* $(,)?) => {
            $(bounds.insert(stringify!($field).to_owned(), settings.$field.to_string());)*
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
        couchdb_db_updates_flush_ms,
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
    bounds.insert("max_body_bytes".to_owned(), settings.body_limit().to_string());
    bounds.insert("max_inflight_body_bytes".to_owned(), settings.inflight_body_budget().to_string());
    bounds.insert("couchdb_max_request_bytes".to_owned(), settings.couchdb_request_limit().to_string());
    let attachments = settings.couchdb_attachment_limit();
    let attachments = if attachments == u64::MAX { "none".to_owned() } else { attachments.to_string() };
    bounds.insert("couchdb_max_attachment_bytes".to_owned(), attachments);
    bounds.insert("track_reads".to_owned(), settings.track_reads.to_string());
    bounds
}

/// Settings by CouchDB section and key, as strings (CouchDB's `_config` values are strings).
pub struct NodeConfig(BTreeMap<&'static str, BTreeMap<String, String>>);

impl NodeConfig {
    /// The settings of `settings` that have a CouchDB counterpart, under its section and key.
    /// `server_uuid` is `couchdb/uuid` (the uuid `GET /` shows).
    pub fn from_settings(settings: &Settings, server_uuid: &str, backend: &str) -> crate::Result<Self> {
        let mut sections: BTreeMap<&'static str, BTreeMap<String, String>> = BTreeMap::new();
        sections.insert("agentstore", bounds_in_force(settings));
        sections.insert(
            "backend",
            BTreeMap::from([
                ("describe".to_owned(), backend.to_owned()),
                ("database".to_owned(), settings.couchdb_db.clone()),
            ]),
        );
        let mut set = |section: &'static str, key: &str, value: String| {
            sections.entry(section).or_default().insert(key.to_owned(), value);
        };
        set("couchdb", "uuid", server_uuid.to_owned());
        set("couchdb", "single_node", "true".to_owned());
        set("couchdb", "js_engine", "quickjs".to_owned());
        set("couchdb", "max_document_size", settings.couchdb_max_document_bytes.to_string());
        set("couchdb", "max_dbs_open", settings.couchdb_max_open_databases.to_string());
        set("couchdb", "os_process_timeout", settings.couchdb_js_timeout_ms.to_string());
        if let Some(bytes) = settings.couchdb_max_attachment_bytes {
            set("couchdb", "max_attachment_size", bytes.to_string());
        }
        if let Some(listen) = &settings.couchdb_listen {
            if let Some((address, port)) = listen.rsplit_once(':') {
                set("chttpd", "bind_address", address.trim_start_matches('[').trim_end_matches(']').to_owned());
                set("chttpd", "port", port.to_owned());
            }
        }
        if let Some(bytes) = settings.couchdb_max_request_bytes {
            set("chttpd", "max_http_request_size", bytes.to_string());
        }
        set("chttpd", "changes_timeout", settings.couchdb_changes_timeout_ms.to_string());
        set("chttpd", "max_db_number_for_dbs_info_req", settings.couchdb_max_dbs_info_keys.to_string());
        set("chttpd_auth", "authentication_db", crate::database::users::USERS_DB.to_owned());
        set("chttpd_auth", "timeout", settings.couchdb_session_timeout_secs.to_string());
        set("chttpd_auth_lockout", "mode", "enforce".to_owned());
        set("chttpd_auth_lockout", "threshold", settings.couchdb_lockout_threshold.to_string());
        set("chttpd_auth_lockout", "max_lifetime", (settings.couchdb_lockout_secs.saturating_mul(1000)).to_string());
        set("chttpd_auth_lockout", "max_objects", settings.couchdb_lockout_max_entries.to_string());
        set("global_changes", "max_write_delay", settings.couchdb_db_updates_flush_ms.to_string());
        set("stats", "interval", super::stats::WINDOW.as_secs().to_string());
        for user in settings.couchdb_users.entries()? {
            if user.admin {
                set("admins", &user.name, HIDDEN.to_owned());
            }
        }
        Ok(NodeConfig(sections))
    }

    fn all(&self) -> Value {
        Value::Object(self.0.iter().map(|(section, keys)| (section.to_string(), section_json(keys))).collect())
    }

    fn section(&self, section: &str) -> Value {
        self.0.get(section).map(section_json).unwrap_or_else(|| json!({}))
    }

    fn value(&self, section: &str, key: &str) -> Option<&str> {
        self.0.get(section)?.get(key).map(String::as_str)
    }
}

fn section_json(keys: &BTreeMap<String, String>) -> Value {
    Value::Object(keys.iter().map(|(key, value)| (key.clone(), Value::from(value.as_str()))).collect())
}

/// `_local` or this node's own name; CouchDB's 404 for any other.
fn this_node(node: &str) -> CouchResult<()> {
    if node == "_local" || node == NODE_NAME {
        Ok(())
    } else {
        Err(CouchError::not_found(format!("no such node: {node}")))
    }
}

/// A server admin or a login with the `_metrics` role (CouchDB's `require_metrics`).
fn metrics_reader(identity: &Identity) -> CouchResult<()> {
    if identity.is_server_admin() || identity.roles.iter().any(|role| role == METRICS_ROLE) {
        Ok(())
    } else {
        Err(CouchError::unauthorized("You are not a server admin or read-only metrics user"))
    }
}

/// CouchDB's 405 for a method a node endpoint does not take.
fn only(methods: &str) -> Response {
    CouchError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", format!("Only {methods} allowed"))
        .into_response()
}

pub async fn only_get() -> Response {
    only("GET")
}

pub async fn only_get_put_delete() -> Response {
    only("GET,PUT,DELETE")
}

/// `GET /_node/{node}`: the node's name. A server admin's (every `/_node` path not listed in
/// `chttpd_auth_request` is).
pub async fn node(Extension(identity): Extension<Identity>, Path(node): Path<String>) -> Answer {
    server_admin_only(&identity)?;
    this_node(&node)?;
    Ok(json(StatusCode::OK, json!({ "name": NODE_NAME })))
}

/// `GET /_node/{node}/_stats`.
pub async fn stats(
    State(state): State<CouchState>,
    Extension(identity): Extension<Identity>,
    Path(node): Path<String>,
) -> Answer {
    stats_at(&state, &identity, &node, "")
}

/// `GET /_node/{node}/_stats/{group}/{metric}…`: the part of the tree the path names, `null`
/// when it names nothing.
pub async fn stats_path(
    State(state): State<CouchState>,
    Extension(identity): Extension<Identity>,
    Path((node, path)): Path<(String, String)>,
) -> Answer {
    stats_at(&state, &identity, &node, &path)
}

fn stats_at(state: &CouchState, identity: &Identity, node: &str, path: &str) -> Answer {
    metrics_reader(identity)?;
    this_node(node)?;
    let mut tree = stats_tree(state);
    for key in path.split('/').filter(|key| !key.is_empty()) {
        tree = match tree {
            Value::Object(mut children) => children.remove(key).unwrap_or(Value::Null),
            _ => Value::Null,
        };
    }
    Ok(json(StatusCode::OK, tree))
}

const OPEN_DATABASES_DESC: &str = "databases open in this process, the data-store database included";
const REQUEST_TIME_DESC: &str =
    "milliseconds from a CouchDB API request's arrival to its response's start, over the last 10 seconds";

fn counter(value: u64, desc: &str) -> Value {
    json!({ "value": value, "type": "counter", "desc": desc })
}

/// The statistics tree, CouchDB's groups and names.
fn stats_tree(state: &CouchState) -> Value {
    let requests = &state.node.requests;
    let activity = state.databases.activity();
    let methods: Map<String, Value> = requests
        .by_method()
        .map(|(method, count)| (method.to_owned(), counter(count, &format!("{method} requests to the CouchDB API"))))
        .collect();
    let statuses: Map<String, Value> = requests
        .by_status()
        .map(|(status, count)| {
            (status.to_string(), counter(count, &format!("CouchDB API responses with status {status}")))
        })
        .collect();
    json!({
        "couchdb": {
            "database_reads": counter(activity.documents_read(), "documents read from the databases"),
            "database_writes": counter(activity.databases_changed(), "writes and purges that changed a database"),
            "open_databases": counter(open_databases(state), OPEN_DATABASES_DESC),
            "request_time": {
                "value": requests.request_time().to_json(),
                "type": "histogram",
                "desc": REQUEST_TIME_DESC,
            },
            "httpd": { "requests": counter(requests.requests(), "CouchDB API requests") },
            "httpd_request_methods": methods,
            "httpd_status_codes": statuses,
        },
        "global_changes": {
            "db_writes": counter(activity.event_writes(), "event documents written to _global_changes"),
            "server_pending_updates": {
                "value": activity.pending_events(),
                "type": "gauge",
                "desc": "database events waiting to be written to _global_changes",
            },
        },
    })
}

fn open_databases(state: &CouchState) -> u64 {
    state.databases.open_count() as u64 + 1
}

/// `GET /_node/{node}/_prometheus`: written here rather than through the `prometheus` crate's
/// registry (which `/metrics` uses) because these are CouchDB's names over counters kept
/// elsewhere, and the crate has no summary whose quantiles are given rather than observed.
pub async fn prometheus(
    State(state): State<CouchState>,
    Extension(identity): Extension<Identity>,
    Path(node): Path<String>,
) -> Answer {
    metrics_reader(&identity)?;
    this_node(&node)?;
    let mut response = prometheus_text(&state).into_response();
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
    Ok(response)
}

/// One metric family of the text format: its name, type, help, and samples (label set, value),
/// the label set written as it is (`""` or `{name="value"}`). A summary's samples include its
/// `_sum` and `_count`, named in full.
struct Family {
    name: &'static str,
    kind: &'static str,
    help: &'static str,
    samples: Vec<(String, String)>,
}

impl Family {
    fn single(name: &'static str, kind: &'static str, help: &'static str, value: u64) -> Self {
        Family { name, kind, help, samples: vec![(String::new(), value.to_string())] }
    }

    fn write(&self, out: &mut String) {
        let Family { name, kind, help, samples } = self;
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, value) in samples {
            // A summary's `_sum`/`_count` samples carry their suffix in place of labels.
            let _ = writeln!(out, "{name}{labels} {value}");
        }
    }
}

fn prometheus_text(state: &CouchState) -> String {
    let requests = &state.node.requests;
    let activity = state.databases.activity();
    let labelled = |label: &str, samples: Vec<(String, u64)>| -> Vec<(String, String)> {
        samples.into_iter().map(|(value, count)| (format!("{{{label}=\"{value}\"}}"), count.to_string())).collect()
    };
    let time = requests.request_time();
    let mut quantiles: Vec<(String, String)> = time
        .percentiles
        .iter()
        .map(|(name, ms)| {
            // CouchDB names the 99.9th percentile `999`; Prometheus quantiles are fractions.
            let quantile = if *name == 999 { 0.999 } else { f64::from(*name) / 100.0 };
            (format!("{{quantile=\"{quantile}\"}}"), (ms / 1000.0).to_string())
        })
        .collect();
    quantiles.push(("_sum".to_owned(), (time.sum / 1000.0).to_string()));
    quantiles.push(("_count".to_owned(), time.n.to_string()));
    let families = [
        Family::single(
            "couchdb_database_reads_total",
            "counter",
            "documents read from the databases",
            activity.documents_read(),
        ),
        Family::single(
            "couchdb_database_writes_total",
            "counter",
            "writes and purges that changed a database",
            activity.databases_changed(),
        ),
        Family::single("couchdb_httpd_requests_total", "counter", "CouchDB API requests", requests.requests()),
        Family {
            name: "couchdb_httpd_request_methods",
            kind: "counter",
            help: "CouchDB API requests by method",
            samples: labelled("method", requests.by_method().map(|(m, c)| (m.to_owned(), c)).collect()),
        },
        Family {
            name: "couchdb_httpd_status_codes",
            kind: "counter",
            help: "CouchDB API responses by status",
            samples: labelled("code", requests.by_status().map(|(s, c)| (s.to_string(), c)).collect()),
        },
        Family::single("couchdb_open_databases", "gauge", "databases open in this process", open_databases(state)),
        Family {
            name: "couchdb_request_time_seconds",
            kind: "summary",
            help: "seconds from a CouchDB API request's arrival to its response's start, over the last 10 seconds",
            samples: quantiles,
        },
        Family::single(
            "couchdb_global_changes_db_writes_total",
            "counter",
            "event documents written to _global_changes",
            activity.event_writes(),
        ),
        Family::single(
            "couchdb_global_changes_server_pending_updates",
            "gauge",
            "database events waiting to be written to _global_changes",
            activity.pending_events() as u64,
        ),
        Family::single(
            "couchdb_uptime_seconds",
            "counter",
            "seconds since this process started serving",
            requests.uptime_secs(),
        ),
    ];
    let mut out = String::new();
    for family in &families {
        family.write(&mut out);
    }
    // The REST listener's registry after CouchDB's names (its families are `agentstore_*`, so
    // none repeats one above): the console's service page charts its request and backend-call
    // counters from here (docs/console.md).
    if let Some(metrics) = &state.metrics {
        out.push_str(&metrics.render());
    }
    out
}

/// `GET /_node/{node}/_system`.
pub async fn system(
    State(state): State<CouchState>,
    Extension(identity): Extension<Identity>,
    Path(node): Path<String>,
) -> Answer {
    metrics_reader(&identity)?;
    this_node(&node)?;
    Ok(json(StatusCode::OK, json!({ "uptime": state.node.requests.uptime_secs() })))
}

/// `GET /_node/{node}/_versions`.
pub async fn versions(Extension(identity): Extension<Identity>, Path(node): Path<String>) -> Answer {
    server_admin_only(&identity)?;
    this_node(&node)?;
    Ok(json(
        StatusCode::OK,
        json!({
            "javascript_engine": { "name": "quickjs" },
            "collation_driver": { "name": "icu4x" },
        }),
    ))
}

/// `GET /_node/{node}/_config`.
pub async fn config_all(
    State(state): State<CouchState>,
    Extension(identity): Extension<Identity>,
    Path(node): Path<String>,
) -> Answer {
    server_admin_only(&identity)?;
    this_node(&node)?;
    Ok(json(StatusCode::OK, state.node.config.all()))
}

/// `GET /_node/{node}/_config/{section}`: `{}` for a section with nothing set, as CouchDB.
pub async fn config_section(
    State(state): State<CouchState>,
    Extension(identity): Extension<Identity>,
    Path((node, section)): Path<(String, String)>,
) -> Answer {
    server_admin_only(&identity)?;
    this_node(&node)?;
    Ok(json(StatusCode::OK, state.node.config.section(&section)))
}

/// `GET /_node/{node}/_config/{section}/{key}`: the value as a JSON string.
pub async fn config_key(
    State(state): State<CouchState>,
    Extension(identity): Extension<Identity>,
    Path((node, section, key)): Path<(String, String, String)>,
) -> Answer {
    server_admin_only(&identity)?;
    this_node(&node)?;
    let value = state.node.config.value(&section, &key).ok_or_else(unknown_config_value)?;
    Ok(json(StatusCode::OK, Value::from(value)))
}

/// `PUT` or `DELETE /_node/{node}/_config/{section}/{key}`: refused, the settings being this
/// server's configuration (docs/configuration.md), not the node's to change over HTTP.
pub async fn config_write(
    State(state): State<CouchState>,
    method: axum::http::Method,
    Extension(identity): Extension<Identity>,
    Path((node, section, key)): Path<(String, String, String)>,
) -> Answer {
    server_admin_only(&identity)?;
    this_node(&node)?;
    if method == axum::http::Method::DELETE && state.node.config.value(&section, &key).is_none() {
        return Err(unknown_config_value());
    }
    Err(CouchError::forbidden(format!(
        "Settings are read-only over the HTTP API here: {section}/{key} is set in agentstore's configuration \
         (docs/configuration.md)."
    )))
}

fn unknown_config_value() -> CouchError {
    CouchError::not_found("unknown_config_value")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_are_written_in_the_text_format() {
        let mut out = String::new();
        Family::single("a_total", "counter", "things", 3).write(&mut out);
        let summary = Family {
            name: "t_seconds",
            kind: "summary",
            help: "times",
            samples: vec![
                ("{quantile=\"0.5\"}".to_owned(), "0.25".to_owned()),
                ("_sum".to_owned(), "1.5".to_owned()),
                ("_count".to_owned(), "4".to_owned()),
            ],
        };
        summary.write(&mut out);
        let expected = "# HELP a_total things\n# TYPE a_total counter\na_total 3\n\
                        # HELP t_seconds times\n# TYPE t_seconds summary\nt_seconds{quantile=\"0.5\"} 0.25\n\
                        t_seconds_sum 1.5\nt_seconds_count 4\n";
        assert_eq!(out, expected);
    }

    #[test]
    fn settings_map_to_couchdb_s_keys_and_hide_secrets() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("agentstore.toml");
        let toml = "couchdb_listen = \"127.0.0.1:5984\"\ncouchdb_max_document_bytes = 1234\n\
                    couchdb_session_secret = \"s3cret-value-s3cret-value-s3cret-value\"\n";
        std::fs::write(&file, toml).unwrap();
        let mut settings = Settings::load(Some(&file), &crate::config::Overrides::default()).unwrap();
        settings.couchdb_users =
            crate::config::CouchUsersSetting::Compact("admin:*:$argon2id$v=19$m=19456,t=2,p=1$c2FsdA$aGFzaA".into());
        let config = NodeConfig::from_settings(&settings, "u-u-i-d", "embedded store").unwrap();
        assert_eq!(config.value("couchdb", "max_document_size"), Some("1234"));
        assert_eq!(config.value("couchdb", "uuid"), Some("u-u-i-d"));
        assert_eq!(config.value("chttpd", "port"), Some("5984"));
        assert_eq!(config.value("chttpd", "bind_address"), Some("127.0.0.1"));
        assert_eq!(config.value("admins", "admin"), Some(HIDDEN));
        let everything = config.all().to_string();
        assert!(!everything.contains("s3cret") && !everything.contains("argon2"), "{everything}");
        assert_eq!(config.section("no_such_section"), json!({}));
    }
}
