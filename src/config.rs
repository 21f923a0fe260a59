//! Settings: defaults, then a TOML file, then `AGENTSTORE_*` environment variables, then
//! command-line flags, each overriding the one before (the `config` crate does the layering).

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::backend::url::DEFAULT_BACKEND_URL;
use crate::backend::BackendUrl;
use crate::error::{Error, ErrorKind, Result};
use crate::model::validate::DEFAULT_MAX_VALUE_BYTES;
use crate::model::Limits;

/// Behaviour of the facade.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    pub limits: Limits,
    /// Whether `get` counts the read as an access (a write). Off makes reads read-only.
    pub track_reads: bool,
    /// How many times a conflicting read-modify-write is retried before giving up.
    pub max_conflict_retries: usize,
    /// Documents asked for per backend query page.
    pub page_size: usize,
    /// How long one `set`, tracked `get` or single-document `delete` may take before it gives up
    /// with [`ErrorKind::DeadlineExceeded`] (checked only where giving up leaves nothing applied);
    /// `None` waits as long as the retries allow. The server sets its request timeout here.
    pub deadline: Option<std::time::Duration>,
    /// The largest revision tree of one document, as a read holds it (`couchdb_max_tree_bytes`,
    /// the same bound as every other database's): a replicated revision that would grow a tree
    /// past it is refused ([`crate::database::layout::data_store::put_branch`]).
    pub max_tree_bytes: usize,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            limits: Limits::default(),
            track_reads: true,
            max_conflict_retries: 100,
            page_size: 1000,
            deadline: None,
            max_tree_bytes: crate::backend::rev_tree::DEFAULT_MAX_TREE_BYTES,
        }
    }
}

/// The config file read when present and no other is named.
pub const DEFAULT_CONFIG_FILE: &str = "agentstore.toml";

/// The default `shutdown_drain_secs`: longer than the shipped HAProxy configuration takes to mark
/// a server down (`inter 1s fall 2`, deploy/haproxy/haproxy.cfg) with room for a slow check, and
/// short enough that a rolling restart of three instances is not slowed much.
pub const DEFAULT_SHUTDOWN_DRAIN_SECS: u64 = 5;

/// The default `body_min_bytes_per_sec`: 16 KiB/s (128 kbit/s), below any link an upload is
/// made over in practice, yet holding all of `max_connections`' default 1024 slots this way costs
/// a client 16 MiB/s of sustained sending, where the trickle it bounds costs nothing.
pub const DEFAULT_BODY_MIN_BYTES_PER_SEC: u64 = 16 << 10;

/// Most connections `max_connections` may allow.
pub const MAX_CONNECTIONS: usize = 1_000_000;
/// Largest `max_inflight_body_bytes` and `max_inflight_parse_bytes` (budgets are counted in KiB
/// permits of a `u32`).
pub const MAX_INFLIGHT_BODY_BYTES: usize = (u32::MAX as usize) << 10;

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// Everything configurable. Field names are the config file keys and, upper-cased with the
/// `AGENTSTORE_` prefix, the environment variables (`AGENTSTORE_BACKEND`, …).
#[derive(Debug, Clone, Deserialize)]
pub struct Settings {
    /// Backend URL, e.g. `embedded:./data/agentstore.redb`.
    pub backend: String,
    /// Largest accepted value, in bytes of compact JSON.
    pub max_value_bytes: usize,
    /// Whether `get` counts reads as accesses (writes `accessCount`).
    pub track_reads: bool,
    /// Retries of a read-modify-write that meets a concurrent writer.
    pub max_conflict_retries: usize,
    /// Documents per backend query page.
    pub page_size: usize,
    /// `text` or `json` logs on stderr.
    pub log_format: LogFormat,
    /// Address `serve` listens on.
    pub listen: String,
    /// Bearer tokens `serve` accepts, by SHA-256 hash (see [`TokenSetting`]).
    #[serde(default)]
    pub tokens: TokensSetting,
    /// Logins of the CouchDB API (see [`CouchUsersSetting`]); none: anonymous requests act as admin.
    #[serde(default)]
    pub couchdb_users: CouchUsersSetting,
    /// Hex key signing the CouchDB API's `AuthSession` cookies; unset: the secret kept in the
    /// backend (`couchdb_api::shared_secret`), created by the first instance and shared by all.
    pub couchdb_session_secret: Option<String>,
    /// How long an `AuthSession` cookie is valid, in seconds.
    pub couchdb_session_timeout_secs: u64,
    /// Allow `serve` to listen beyond loopback with no tokens configured.
    pub allow_unauthenticated: bool,
    /// Largest request body `serve` reads; default 4 × `max_value_bytes` + 64 KiB (a value and
    /// its metadata, with room for whitespace).
    pub max_body_bytes: Option<usize>,
    /// Document operations give up at this deadline before their next attempt (503, nothing
    /// applied); any request still running at twice it is cut with 504 `{"error": "timeout"}`.
    pub request_timeout_secs: u64,
    /// A request's head must arrive whole within this many seconds, counted from when the server
    /// starts waiting for it (on a keep-alive connection: from the end of the previous response).
    pub header_read_timeout_secs: u64,
    /// A connection with no request being handled and no byte moving either way for this many
    /// seconds is closed.
    pub idle_timeout_secs: u64,
    /// Connections served at once; further ones wait in the listen backlog until one closes.
    pub max_connections: usize,
    /// Bytes of request bodies being read at once, server-wide; requests beyond it wait.
    /// Default 4 × the body limit.
    pub max_inflight_body_bytes: Option<usize>,
    /// Estimated memory of parsed request bodies held at once, server-wide; requests beyond it
    /// wait (one alone may exceed it).
    pub max_inflight_parse_bytes: usize,
    /// On SIGTERM/SIGINT, how long in-flight requests may take to finish.
    pub shutdown_grace_secs: u64,
    /// On SIGTERM/SIGINT, `serve` first answers not ready (`/readyz` 503, the CouchDB API's
    /// `/_up` 404 `nolb`) and keeps accepting and serving for this many seconds, so a load
    /// balancer's health check takes the instance out before its listeners close; then the grace
    /// period starts. 0: stop accepting at once. A second signal ends the delay early.
    pub shutdown_drain_secs: u64,
    /// CouchDB user, when the backend URL carries none.
    pub couchdb_user: Option<String>,
    /// CouchDB password, when the backend URL carries none.
    pub couchdb_password: Option<String>,
    /// Where `serve` answers CouchDB's HTTP API (`--couchdb-listen`); none: no CouchDB listener.
    pub couchdb_listen: Option<String>,
    /// The database name the CouchDB API serves.
    pub couchdb_db: String,
    /// Largest request body the CouchDB API reads (after gzip decompression): `_bulk_docs` and
    /// restores send many documents at once. Default 64 MiB, never below the body limit.
    pub couchdb_max_request_bytes: Option<usize>,
    /// How long a request body may go without a byte arriving, and the time every body gets
    /// before `body_min_bytes_per_sec` is asked of it, in seconds (both APIs); a client past
    /// either gets 408 (docs/bounds.md, "Request bodies").
    pub body_read_timeout_secs: u64,
    /// Past its first `body_read_timeout_secs`, a request body must have kept arriving at this
    /// average rate, in bytes per second: a big upload that keeps going finishes, a trickle is
    /// cut (408). 0: no rate; every body must then arrive whole within `body_read_timeout_secs`.
    pub body_min_bytes_per_sec: u64,
    /// Largest body of the CouchDB API's query endpoints (`_find`, `_explain`, `_index`,
    /// `POST _changes`, `_revs_diff`), after decompression.
    pub couchdb_max_query_bytes: usize,
    /// Largest `POST /_session` login body, after decompression (read without credentials).
    pub couchdb_max_login_bytes: usize,
    /// Longest `timeout` a `_changes` longpoll or continuous feed may ask for, in milliseconds; also
    /// the default and the longest heartbeat interval (CouchDB's `changes_timeout`).
    pub couchdb_changes_timeout_ms: u64,
    /// Shortest `heartbeat` interval of a `_changes` feed, in milliseconds; smaller ones are raised.
    pub couchdb_changes_min_heartbeat_ms: u64,
    /// Longest life of a continuous `_changes` feed kept open by heartbeats, in seconds.
    pub couchdb_changes_max_feed_secs: u64,
    /// Long-lived `_changes` feeds (longpoll, continuous) one login holds at once (per peer address
    /// when the API is open); past it, 429.
    pub couchdb_max_feeds_per_login: usize,
    /// Databases (besides the data-store one) kept open at once; the least recently used idle
    /// one is closed past it, and opened again on its next request. Bounds memory and file
    /// descriptors with thousands of databases.
    pub couchdb_max_open_databases: usize,
    /// How long, in milliseconds, an open database is served before the backend is asked again
    /// whether it still exists and is the same one (not deleted, nor deleted and created again,
    /// through another instance over the same backend). 0, the default: on every request, so
    /// such a change holds on this instance at its next request; a larger value saves that
    /// backend call per request and lets the change arrive that much later.
    pub couchdb_database_recheck_ms: u64,
    /// Largest document body on a database besides the data-store one, in bytes of its JSON
    /// (CouchDB's `max_document_size`); past it, 413 `document_too_large`.
    pub couchdb_max_document_bytes: usize,
    /// Largest revision tree of one document on any database, the data-store one included, in
    /// bytes as a read of the document holds it: every leaf's body (JSON) and the revision ids of
    /// its whole path (docs/bounds.md). A write past it is refused with 413 naming this setting; a
    /// replicator's thousands of branches off a long history cost leaves × history length.
    pub couchdb_max_tree_bytes: usize,
    /// Most bodies of inner revisions (revisions that are no longer leaves) one document keeps on
    /// a database besides the data-store one, as CouchDB keeps them until compaction: `GET
    /// ?rev=` of an earlier revision, its attachments and `_revs_info` `available` answer until
    /// `POST /{db}/_compact` drops them. A write that leaves more drops the oldest; 0 keeps none
    /// (docs/couchdb-api.md, "Earlier revisions' bodies").
    pub couchdb_inner_bodies_max_revisions: usize,
    /// Most bytes (as JSON) of inner revisions' bodies one document keeps, the same way; a write
    /// that leaves more drops the oldest; 0 keeps none. Each write of a document rewrites them.
    pub couchdb_inner_bodies_max_bytes: usize,
    /// Largest attachment on a database besides the data-store one, in bytes (CouchDB's
    /// `max_attachment_size`); past it, 413. Unset (the default) means no bound, as CouchDB's
    /// default `infinity`: attachments stream through in chunks, so their size costs storage,
    /// never memory.
    pub couchdb_max_attachment_bytes: Option<u64>,
    /// Most bytes a gzip-encoded attachment part (`encoding: "gzip"` in a `multipart/related`
    /// upload) may decode to per compressed byte, plus 1 MiB; past it, 413 naming this setting.
    /// Attachments are stored decoded (docs/attachments.md, "Compression"), so without it a MiB of
    /// gzip could take 2 GiB of storage.
    pub couchdb_max_gzip_ratio: u64,
    /// Attachment bytes shown inline (`attachments=true` answered as JSON, base64 in the
    /// document) being served at once, server-wide; each costs about four times its length in
    /// memory until its answer is sent. A read waits for its share (429 after
    /// `couchdb_inline_wait_ms`); one answer whose inline attachments alone pass it is 413 naming
    /// this setting (read them as multipart or one by one). Default 128 MiB.
    pub couchdb_max_inflight_inline_bytes: usize,
    /// Longest a read waits for its share of `couchdb_max_inflight_inline_bytes`, in
    /// milliseconds; past it, 429 naming both settings. An answer that holds shares and waits for
    /// more could otherwise wait for ever on another doing the same. Default 30000.
    pub couchdb_inline_wait_ms: u64,
    /// How long attachment bytes no revision references are kept before `_compact` or a
    /// document's deletion frees them, in seconds (docs/attachments.md, "When bytes are freed"):
    /// an upload in progress and bytes just stored for a document write about to reference them
    /// must not be freed under it. 86400 (a day) by default; 0 frees at once (tests).
    pub couchdb_attachment_grace_secs: u64,
    /// Where this process keeps its view index (docs/views.md): each serving process claims a
    /// free slot `views-{digest}-{k}.redb` there at startup, so processes on one host may share
    /// the directory. Unset: beside the store file on the embedded store (one file: that store
    /// admits one process), else `$XDG_STATE_HOME/agentstore/views` (or
    /// `~/.local/state/agentstore/views`, or `./agentstore-views`).
    pub couchdb_view_index_dir: Option<String>,
    /// Most view index files (slots) per backend in one directory, so most `serve` processes
    /// over one backend on one host sharing `couchdb_view_index_dir`; one past it stops at
    /// startup naming this setting. Default 16.
    pub couchdb_view_index_slots: usize,
    /// Most rows one document may emit in one design document's views (together); a document
    /// past it is left out of that index and logged (docs/views.md "Bounds").
    pub couchdb_view_max_rows_per_doc: usize,
    /// Largest emitted key, in bytes of its JSON (CouchDB's `couch_views` `key_size_limit`); a
    /// document emitting a larger one is left out of the index and logged.
    pub couchdb_view_max_key_bytes: usize,
    /// Most bytes of JSON (keys and values) one document's rows may take in one design
    /// document's views; a document past it is left out of the index and logged.
    pub couchdb_view_max_doc_bytes: usize,
    /// Bytes of mapped rows an index build holds before writing them (CouchDB's `[view_updater]
    /// min_writer_size`).
    pub couchdb_view_batch_bytes: usize,
    /// Largest view index of one database (every design document's, as stored), in bytes; a
    /// query that would index past it gets 413 `too_large` (`update=false` still answers).
    pub couchdb_view_max_index_bytes: u64,
    /// Longest one call of a design document's JavaScript may run, in milliseconds (CouchDB's
    /// `os_process_timeout`): a map, reduce, validation or filter function past it is stopped
    /// and the request answered 400 `os_process_error` (docs/design-documents.md).
    pub couchdb_js_timeout_ms: u64,
    /// Memory of each JavaScript worker's runtime, in bytes; a function past it is stopped.
    pub couchdb_js_memory_bytes: usize,
    /// JavaScript worker threads (0: one per core).
    pub couchdb_js_workers: usize,
    /// Most names one `POST /_dbs_info` may ask about (CouchDB's
    /// `max_db_number_for_dbs_info_req`), and most databases one `GET /_dbs_info` answers
    /// (CouchDB has no bound there; `limit` and `startkey` page through them).
    pub couchdb_max_dbs_info_keys: usize,
    /// Most replications that run at once on one instance (CouchDB's `[replicator] max_jobs`,
    /// 500); more wait `pending` (docs/couchdb-api.md, "`_replicator` and the scheduler").
    pub couchdb_max_replication_jobs: usize,
    /// How long a replication's lease lasts without being renewed: how long a job pauses when
    /// the instance running it is killed, before another instance takes it over.
    pub couchdb_replication_lease_secs: u64,
    /// A replication's connect timeout to a remote endpoint (CouchDB's `connection_timeout`).
    pub couchdb_replication_connect_timeout_ms: u64,
    /// How often a running replication records its checkpoint (CouchDB's
    /// `checkpoint_interval`, 30 s).
    pub couchdb_replication_checkpoint_ms: u64,
    /// The server's UUID (`GET /`'s `uuid`, and part of every replication id). Unset, it is made
    /// from the backend's description; set it to a moved CouchDB's `uuid` so that its
    /// replications keep their ids and resume from their checkpoints.
    pub couchdb_server_uuid: Option<String>,
    /// Longest database feed `_changes?descending=true` reads (it reads the whole feed to answer
    /// the newest first); longer ones are refused with 400.
    pub couchdb_max_descending_changes: usize,
    /// How long database events (`created`, `updated`, `deleted`) wait before they are written to
    /// `_global_changes`, the feed `_db_updates` reads (CouchDB's `[global_changes]
    /// max_write_delay`): each distinct event is written once per interval however often it
    /// happened, and another instance's events show this much later at most. Default 500.
    pub couchdb_db_updates_flush_ms: u64,
    /// Most queries one `POST …/_view/{view}/queries` may ask (CouchDB sets none); past it, 400
    /// naming this setting. Each query is checked before the answer starts and then streams, so
    /// this bounds the work one request queues, not memory. Default 1000.
    pub couchdb_max_view_queries: usize,
    /// Longest line a design function writes to the server's log (`log()`, a map function's
    /// throw), in bytes; the rest is cut and the line says how long it was. Default 4096.
    pub couchdb_js_log_line_bytes: usize,
    /// Log bytes one database's design functions may write per minute (refilled continuously);
    /// lines past it are dropped and counted in the log, the request still answered. Default
    /// 1 MiB.
    pub couchdb_js_log_bytes_per_minute: u64,
    /// Log bytes the design functions of every database together may write per minute; as
    /// above. Default 8 MiB.
    pub couchdb_js_log_server_bytes_per_minute: u64,
    /// Failed logins per (name, peer address) after which that pair is locked out (403), like
    /// CouchDB's `chttpd_auth_lockout` `threshold`; 0 turns the lockout off.
    pub couchdb_lockout_threshold: u32,
    /// How long failures are counted and a lockout lasts, in seconds (CouchDB's `max_lifetime`).
    pub couchdb_lockout_secs: u64,
    /// Most (name, peer address) pairs the lockout remembers; the oldest go first (CouchDB's
    /// `max_objects`).
    pub couchdb_lockout_max_entries: usize,
    /// Password checks from peers with `couchdb_lockout_threshold` recent failed logins (any
    /// names) that may wait at once for their own (single) verification slot; past it, 429 at once.
    pub couchdb_max_queued_suspect_logins: usize,
    /// The load balancers and proxies in front of the CouchDB API, as IPs or CIDR networks (see
    /// [`TrustedProxiesSetting`]); default none. A request whose TCP peer is one of them counts
    /// toward the lockout and the suspect lane (and its feeds toward per-address bounds) as the
    /// right-most `X-Forwarded-For` address that is not itself one of them; from any other peer
    /// the header is ignored, so a client cannot choose its own address.
    #[serde(default)]
    pub couchdb_trusted_proxies: TrustedProxiesSetting,
    /// Origins (`http://host:port`) whose pages may call the REST API from a browser (CORS): the
    /// console at `/_utils` on the CouchDB listener is another origin than the REST listener, so
    /// its data-store page reaches the REST API only when its origin is listed. None by default.
    #[serde(default)]
    pub cors_origins: CorsOriginsSetting,
    /// Bytes hyper's buffer of one connection holds: an answer's bytes queued ahead of a client
    /// that does not read (plus the one piece of the answer being queued), and the longest
    /// request head (request line and headers; CouchDB 3.4.3 refuses a request line past 8 KB).
    /// At least [`MIN_CONNECTION_BUFFER_BYTES`]. Both faces.
    pub max_connection_buffer_bytes: usize,
}

/// The default `max_connection_buffer_bytes`: 64 KiB, chosen by measurement (docs/bounds.md,
/// "Slow readers"): a 100 MB download is as fast as with hyper's own ~400 KiB, since the
/// kernel's socket buffer, not this one, keeps the link busy.
pub const DEFAULT_CONNECTION_BUFFER_BYTES: usize = 64 << 10;
/// The least `max_connection_buffer_bytes` hyper takes.
pub const MIN_CONNECTION_BUFFER_BYTES: usize = 8 << 10;

/// `cors_origins`: in a config file a list of strings (`["http://127.0.0.1:5984"]`); in the
/// environment (`AGENTSTORE_CORS_ORIGINS`) a comma-separated list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum CorsOriginsSetting {
    List(Vec<String>),
    Compact(String),
}

impl Default for CorsOriginsSetting {
    fn default() -> Self {
        CorsOriginsSetting::List(Vec::new())
    }
}

impl CorsOriginsSetting {
    /// The origins listed, each `scheme://host[:port]` with nothing after it (what a browser
    /// sends as `Origin`); anything else is an error naming the entry.
    pub fn origins(&self) -> Result<Vec<String>> {
        let entries: Vec<&str> = match self {
            CorsOriginsSetting::List(list) => list.iter().map(|entry| entry.trim()).collect(),
            CorsOriginsSetting::Compact(text) => text.split(',').map(str::trim).filter(|e| !e.is_empty()).collect(),
        };
        entries
            .into_iter()
            .enumerate()
            .map(|(i, entry)| {
                let origin = url::Url::parse(entry).ok().filter(|url| {
                    matches!(url.scheme(), "http" | "https")
                        && url.host_str().is_some()
                        && url.path() == "/"
                        && url.query().is_none()
                        && url.fragment().is_none()
                        && !entry.ends_with('/')
                });
                origin.map(|url| url.origin().ascii_serialization()).ok_or_else(|| {
                    Error::invalid(
                        &format!("cors_origins[{i}]"),
                        format!("{entry:?} is not an origin like http://127.0.0.1:5984 (scheme, host, port, no path)"),
                    )
                })
            })
            .collect()
    }
}

/// `couchdb_trusted_proxies`: in a config file a list of strings (`["10.0.0.0/8", "192.0.2.7"]`);
/// in the environment (`AGENTSTORE_COUCHDB_TRUSTED_PROXIES`) a comma-separated list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum TrustedProxiesSetting {
    List(Vec<String>),
    Compact(String),
}

impl Default for TrustedProxiesSetting {
    fn default() -> Self {
        TrustedProxiesSetting::List(Vec::new())
    }
}

impl TrustedProxiesSetting {
    /// The networks listed (an address alone is a network of that one address); an entry that is
    /// neither an IP nor a CIDR network is an error naming it.
    pub fn networks(&self) -> Result<Vec<ipnet::IpNet>> {
        let entries: Vec<&str> = match self {
            TrustedProxiesSetting::List(list) => list.iter().map(|entry| entry.trim()).collect(),
            TrustedProxiesSetting::Compact(text) => {
                text.split(',').map(str::trim).filter(|entry| !entry.is_empty()).collect()
            }
        };
        entries
            .into_iter()
            .enumerate()
            .map(|(i, entry)| {
                entry
                    .parse::<ipnet::IpNet>()
                    .or_else(|_| entry.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
                    .map_err(|_| {
                        Error::invalid(
                            &format!("couchdb_trusted_proxies[{i}]"),
                            format!("{entry:?} is neither an IP address nor a CIDR network (like 10.0.0.0/8)"),
                        )
                    })
            })
            .collect()
    }
}

/// Tokens: in a config file a list of `{ sha256 = "…", user = "…" }` or
/// `{ sha256 = "…", admin = true }` tables; in the environment (`AGENTSTORE_TOKENS`) a
/// comma-separated list of `SCOPE:SHA256`, where SCOPE is a user id or `*` for admin.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum TokensSetting {
    List(Vec<TokenSetting>),
    Compact(String),
}

impl Default for TokensSetting {
    fn default() -> Self {
        TokensSetting::List(Vec::new())
    }
}

/// One accepted token: the hex SHA-256 of the token, and the one user it may act for (or admin).
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct TokenSetting {
    pub sha256: String,
    pub user: Option<String>,
    #[serde(default)]
    pub admin: bool,
}

impl TokensSetting {
    /// The tokens as a list, whichever form they were given in.
    pub fn entries(&self) -> Result<Vec<TokenSetting>> {
        match self {
            TokensSetting::List(list) => Ok(list.clone()),
            TokensSetting::Compact(text) => text
                .split(',')
                .map(str::trim)
                .filter(|entry| !entry.is_empty())
                .map(|entry| {
                    let (scope, sha256) = entry.rsplit_once(':').ok_or_else(|| {
                        Error::invalid("tokens", "entries must be SCOPE:SHA256 (SCOPE a user id or *)")
                    })?;
                    Ok(TokenSetting {
                        sha256: sha256.to_owned(),
                        user: (scope != "*").then(|| scope.to_owned()),
                        admin: scope == "*",
                    })
                })
                .collect(),
        }
    }
}

/// CouchDB API logins: in a config file a list of `{ name = "…", password_hash = "…", admin = true }`,
/// `{ name = "…", password_hash = "…", user = "…" }` or `{ name = "…", password_hash = "…" }`
/// tables, each with optional `roles = ["…"]`; in the environment (`AGENTSTORE_COUCHDB_USERS`)
/// entries `NAME:SCOPE:PHC` or `NAME:SCOPE:PHC:ROLE,ROLE…` separated by `;` or whitespace, SCOPE a
/// user id, `*` for admin, or empty for a login of the other databases only (a PHC string holds
/// `$`, `,` and `=` but never `:` or `;`, so the fourth part is unambiguous; a role holding `:`,
/// `,`, `;` or whitespace needs the list form).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum CouchUsersSetting {
    List(Vec<CouchUserSetting>),
    Compact(String),
}

impl Default for CouchUsersSetting {
    fn default() -> Self {
        CouchUsersSetting::List(Vec::new())
    }
}

/// One CouchDB API login: its name, the PHC string of its password (`agentstore hash-password`),
/// the one data-store user it may act for (or admin, or neither: then it reaches only the other
/// databases), and its CouchDB roles, which those databases' `_security` may name.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct CouchUserSetting {
    pub name: String,
    pub password_hash: String,
    pub user: Option<String>,
    #[serde(default)]
    pub admin: bool,
    #[serde(default)]
    pub roles: Vec<String>,
}

impl CouchUsersSetting {
    /// The logins as a list, whichever form they were given in.
    pub fn entries(&self) -> Result<Vec<CouchUserSetting>> {
        match self {
            CouchUsersSetting::List(list) => Ok(list.clone()),
            CouchUsersSetting::Compact(text) => text
                .split(|c: char| c == ';' || c.is_whitespace())
                .filter(|entry| !entry.is_empty())
                .enumerate()
                .map(|(i, entry)| {
                    let mut parts = entry.splitn(4, ':');
                    let (Some(name), Some(scope), Some(hash)) = (parts.next(), parts.next(), parts.next()) else {
                        return Err(Error::invalid(
                            &format!("couchdb_users[{i}]"),
                            "entries must be NAME:SCOPE:PHC or NAME:SCOPE:PHC:ROLES (SCOPE a user id, * or empty; \
                             ROLES separated by commas)",
                        ));
                    };
                    let roles = parts.next().map_or_else(Vec::new, |roles| {
                        roles.split(',').filter(|role| !role.is_empty()).map(str::to_owned).collect()
                    });
                    Ok(CouchUserSetting {
                        name: name.to_owned(),
                        password_hash: hash.to_owned(),
                        user: (scope != "*" && !scope.is_empty()).then(|| scope.to_owned()),
                        admin: scope == "*",
                        roles,
                    })
                })
                .collect(),
        }
    }
}

/// Values given on the command line; `None` leaves the lower layers' value.
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    pub backend: Option<String>,
    pub couchdb_listen: Option<String>,
    pub couchdb_db: Option<String>,
    pub max_value_bytes: Option<usize>,
    pub log_format: Option<LogFormat>,
    pub listen: Option<String>,
    pub allow_unauthenticated: Option<bool>,
    pub header_read_timeout_secs: Option<u64>,
    pub idle_timeout_secs: Option<u64>,
    pub max_connections: Option<usize>,
    pub max_inflight_body_bytes: Option<usize>,
    pub max_inflight_parse_bytes: Option<usize>,
}

impl Settings {
    /// Loads the layers. `file` must exist when given; otherwise `agentstore.toml` is read if it
    /// is in the working directory.
    pub fn load(file: Option<&Path>, overrides: &Overrides) -> Result<Self> {
        let bad = |e: config::ConfigError| Error::new(ErrorKind::InvalidInput, format!("configuration: {e}"));
        let mut builder = config::Config::builder()
            .set_default("backend", DEFAULT_BACKEND_URL)
            .and_then(|b| b.set_default("max_value_bytes", DEFAULT_MAX_VALUE_BYTES as u64))
            .and_then(|b| b.set_default("track_reads", true))
            .and_then(|b| b.set_default("max_conflict_retries", StoreOptions::default().max_conflict_retries as u64))
            .and_then(|b| b.set_default("page_size", StoreOptions::default().page_size as u64))
            .and_then(|b| b.set_default("log_format", "text"))
            .and_then(|b| b.set_default("listen", "127.0.0.1:8080"))
            .and_then(|b| b.set_default("allow_unauthenticated", false))
            .and_then(|b| b.set_default("couchdb_session_timeout_secs", 600u64))
            .and_then(|b| b.set_default("request_timeout_secs", 30u64))
            .and_then(|b| b.set_default("shutdown_grace_secs", 30u64))
            .and_then(|b| b.set_default("shutdown_drain_secs", DEFAULT_SHUTDOWN_DRAIN_SECS))
            .and_then(|b| b.set_default("header_read_timeout_secs", 10u64))
            .and_then(|b| b.set_default("idle_timeout_secs", 60u64))
            .and_then(|b| b.set_default("max_connections", 1024u64))
            .and_then(|b| b.set_default("max_inflight_parse_bytes", 128u64 << 20))
            .and_then(|b| b.set_default("couchdb_db", crate::model::COLLECTION))
            .and_then(|b| b.set_default("body_read_timeout_secs", 30u64))
            .and_then(|b| b.set_default("body_min_bytes_per_sec", DEFAULT_BODY_MIN_BYTES_PER_SEC))
            .and_then(|b| b.set_default("couchdb_max_query_bytes", 1u64 << 20))
            .and_then(|b| b.set_default("couchdb_max_login_bytes", 16u64 << 10))
            .and_then(|b| b.set_default("couchdb_changes_timeout_ms", 60_000u64))
            .and_then(|b| b.set_default("couchdb_changes_min_heartbeat_ms", 1_000u64))
            .and_then(|b| b.set_default("couchdb_changes_max_feed_secs", 3_600u64))
            .and_then(|b| b.set_default("couchdb_max_feeds_per_login", 16u64))
            .and_then(|b| b.set_default("couchdb_max_open_databases", 128u64))
            .and_then(|b| b.set_default("couchdb_database_recheck_ms", 0u64))
            .and_then(|b| b.set_default("couchdb_max_document_bytes", 8_000_000u64))
            .and_then(|b| b.set_default("couchdb_max_tree_bytes", 32u64 << 20))
            .and_then(|b| b.set_default("couchdb_inner_bodies_max_revisions", 100u64))
            .and_then(|b| b.set_default("couchdb_inner_bodies_max_bytes", 1u64 << 20))
            .and_then(|b| b.set_default("couchdb_max_gzip_ratio", 100u64))
            .and_then(|b| b.set_default("couchdb_max_inflight_inline_bytes", 128u64 << 20))
            .and_then(|b| b.set_default("couchdb_inline_wait_ms", 30_000u64))
            .and_then(|b| b.set_default("couchdb_attachment_grace_secs", 86_400u64))
            .and_then(|b| b.set_default("couchdb_view_index_slots", 16u64))
            .and_then(|b| b.set_default("couchdb_view_max_rows_per_doc", 10_000u64))
            .and_then(|b| b.set_default("couchdb_view_max_key_bytes", 8_000u64))
            .and_then(|b| b.set_default("couchdb_view_max_doc_bytes", 16u64 << 20))
            .and_then(|b| b.set_default("couchdb_view_batch_bytes", 16u64 << 20))
            .and_then(|b| b.set_default("couchdb_view_max_index_bytes", 16u64 << 30))
            .and_then(|b| b.set_default("couchdb_js_timeout_ms", 5_000u64))
            .and_then(|b| b.set_default("couchdb_js_memory_bytes", 64u64 << 20))
            .and_then(|b| b.set_default("couchdb_js_workers", 0u64))
            .and_then(|b| b.set_default("couchdb_max_dbs_info_keys", 100u64))
            .and_then(|b| b.set_default("couchdb_max_replication_jobs", 500u64))
            .and_then(|b| b.set_default("couchdb_replication_lease_secs", 30u64))
            .and_then(|b| b.set_default("couchdb_replication_connect_timeout_ms", 30_000u64))
            .and_then(|b| b.set_default("couchdb_replication_checkpoint_ms", 30_000u64))
            .and_then(|b| b.set_default("couchdb_max_descending_changes", 100_000u64))
            .and_then(|b| b.set_default("couchdb_db_updates_flush_ms", 500u64))
            .and_then(|b| b.set_default("couchdb_max_view_queries", 1_000u64))
            .and_then(|b| b.set_default("couchdb_js_log_line_bytes", 4_096u64))
            .and_then(|b| b.set_default("couchdb_js_log_bytes_per_minute", 1u64 << 20))
            .and_then(|b| b.set_default("couchdb_js_log_server_bytes_per_minute", 8u64 << 20))
            .and_then(|b| b.set_default("couchdb_lockout_threshold", 5u64))
            .and_then(|b| b.set_default("couchdb_lockout_secs", 300u64))
            .and_then(|b| b.set_default("couchdb_lockout_max_entries", 10_000u64))
            .and_then(|b| b.set_default("couchdb_max_queued_suspect_logins", 8u64))
            .and_then(|b| b.set_default("max_connection_buffer_bytes", DEFAULT_CONNECTION_BUFFER_BYTES as u64))
            .map_err(bad)?;
        builder = match file {
            Some(path) => {
                if !path.exists() {
                    return Err(Error::invalid("config", format!("file {} does not exist", path.display())));
                }
                builder.add_source(config::File::from(path.to_path_buf()).format(config::FileFormat::Toml))
            }
            None => builder.add_source(
                config::File::from(PathBuf::from(DEFAULT_CONFIG_FILE)).format(config::FileFormat::Toml).required(false),
            ),
        };
        builder = builder.add_source(config::Environment::with_prefix("AGENTSTORE").try_parsing(true));
        if let Some(backend) = &overrides.backend {
            builder = builder.set_override("backend", backend.as_str()).map_err(bad)?;
        }
        if let Some(max) = overrides.max_value_bytes {
            builder = builder.set_override("max_value_bytes", max as u64).map_err(bad)?;
        }
        if let Some(format) = overrides.log_format {
            let name = match format {
                LogFormat::Text => "text",
                LogFormat::Json => "json",
            };
            builder = builder.set_override("log_format", name).map_err(bad)?;
        }
        if let Some(listen) = &overrides.listen {
            builder = builder.set_override("listen", listen.as_str()).map_err(bad)?;
        }
        if let Some(listen) = &overrides.couchdb_listen {
            builder = builder.set_override("couchdb_listen", listen.as_str()).map_err(bad)?;
        }
        if let Some(db) = &overrides.couchdb_db {
            builder = builder.set_override("couchdb_db", db.as_str()).map_err(bad)?;
        }
        if let Some(allow) = overrides.allow_unauthenticated {
            builder = builder.set_override("allow_unauthenticated", allow).map_err(bad)?;
        }
        for (key, value) in [
            ("header_read_timeout_secs", overrides.header_read_timeout_secs),
            ("idle_timeout_secs", overrides.idle_timeout_secs),
            ("max_connections", overrides.max_connections.map(|n| n as u64)),
            ("max_inflight_body_bytes", overrides.max_inflight_body_bytes.map(|n| n as u64)),
            ("max_inflight_parse_bytes", overrides.max_inflight_parse_bytes.map(|n| n as u64)),
        ] {
            if let Some(value) = value {
                builder = builder.set_override(key, value).map_err(bad)?;
            }
        }
        let settings: Settings = builder.build().and_then(|c| c.try_deserialize()).map_err(bad)?;
        if settings.page_size == 0 {
            return Err(Error::invalid("page_size", "must be at least 1"));
        }
        if settings.max_value_bytes == 0 {
            return Err(Error::invalid("max_value_bytes", "must be at least 1"));
        }
        settings.check_serve_limits()?;
        settings.couchdb_trusted_proxies.networks()?;
        settings.cors_origins.origins()?;
        Ok(settings)
    }

    /// The connection and body settings `serve` needs to be usable.
    fn check_serve_limits(&self) -> Result<()> {
        // Durations and counts alike: zero would refuse every request or end every wait at once.
        let as_u64 = |count: usize| u64::try_from(count).unwrap_or(u64::MAX);
        for (field, value) in [
            ("request_timeout_secs", self.request_timeout_secs),
            ("header_read_timeout_secs", self.header_read_timeout_secs),
            ("idle_timeout_secs", self.idle_timeout_secs),
            ("body_read_timeout_secs", self.body_read_timeout_secs),
            ("couchdb_changes_timeout_ms", self.couchdb_changes_timeout_ms),
            ("couchdb_js_timeout_ms", self.couchdb_js_timeout_ms),
            ("couchdb_js_memory_bytes", as_u64(self.couchdb_js_memory_bytes)),
            ("couchdb_changes_min_heartbeat_ms", self.couchdb_changes_min_heartbeat_ms),
            ("couchdb_changes_max_feed_secs", self.couchdb_changes_max_feed_secs),
            ("couchdb_lockout_secs", self.couchdb_lockout_secs),
            ("couchdb_max_query_bytes", as_u64(self.couchdb_max_query_bytes)),
            ("couchdb_max_login_bytes", as_u64(self.couchdb_max_login_bytes)),
            ("couchdb_max_feeds_per_login", as_u64(self.couchdb_max_feeds_per_login)),
            ("couchdb_max_open_databases", as_u64(self.couchdb_max_open_databases)),
            ("couchdb_max_document_bytes", as_u64(self.couchdb_max_document_bytes)),
            ("couchdb_max_tree_bytes", as_u64(self.couchdb_max_tree_bytes)),
            ("couchdb_max_gzip_ratio", self.couchdb_max_gzip_ratio),
            ("couchdb_max_inflight_inline_bytes", as_u64(self.couchdb_max_inflight_inline_bytes)),
            ("couchdb_inline_wait_ms", self.couchdb_inline_wait_ms),
            ("couchdb_max_dbs_info_keys", as_u64(self.couchdb_max_dbs_info_keys)),
            ("couchdb_max_replication_jobs", as_u64(self.couchdb_max_replication_jobs)),
            ("couchdb_replication_lease_secs", self.couchdb_replication_lease_secs),
            ("couchdb_replication_connect_timeout_ms", self.couchdb_replication_connect_timeout_ms),
            ("couchdb_replication_checkpoint_ms", self.couchdb_replication_checkpoint_ms),
            ("couchdb_max_descending_changes", as_u64(self.couchdb_max_descending_changes)),
            ("couchdb_db_updates_flush_ms", self.couchdb_db_updates_flush_ms),
            ("couchdb_max_view_queries", as_u64(self.couchdb_max_view_queries)),
            ("couchdb_js_log_line_bytes", as_u64(self.couchdb_js_log_line_bytes)),
            ("couchdb_js_log_bytes_per_minute", self.couchdb_js_log_bytes_per_minute),
            ("couchdb_js_log_server_bytes_per_minute", self.couchdb_js_log_server_bytes_per_minute),
            ("couchdb_lockout_max_entries", as_u64(self.couchdb_lockout_max_entries)),
            ("couchdb_view_index_slots", as_u64(self.couchdb_view_index_slots)),
            ("couchdb_view_max_rows_per_doc", as_u64(self.couchdb_view_max_rows_per_doc)),
            ("couchdb_view_max_key_bytes", as_u64(self.couchdb_view_max_key_bytes)),
            ("couchdb_view_max_doc_bytes", as_u64(self.couchdb_view_max_doc_bytes)),
            ("couchdb_view_batch_bytes", as_u64(self.couchdb_view_batch_bytes)),
            ("couchdb_view_max_index_bytes", self.couchdb_view_max_index_bytes),
        ] {
            if value == 0 {
                return Err(Error::invalid(field, "must be at least 1"));
            }
        }
        if self.couchdb_max_attachment_bytes == Some(0) {
            return Err(Error::invalid(
                "couchdb_max_attachment_bytes",
                "must be at least 1 (leave it unset for no bound)",
            ));
        }
        if self.couchdb_changes_min_heartbeat_ms > self.couchdb_changes_timeout_ms {
            return Err(Error::invalid(
                "couchdb_changes_min_heartbeat_ms",
                "must be at most couchdb_changes_timeout_ms (the longest heartbeat interval)",
            ));
        }
        if !(1..=MAX_CONNECTIONS).contains(&self.max_connections) {
            return Err(Error::invalid("max_connections", format!("must be from 1 to {MAX_CONNECTIONS}")));
        }
        let budget = self.inflight_body_budget();
        if budget < self.body_limit() || budget > MAX_INFLIGHT_BODY_BYTES {
            return Err(Error::invalid(
                "max_inflight_body_bytes",
                format!(
                    "is {budget}; it must hold at least one body of the body limit ({} bytes) and be at most \
                     {MAX_INFLIGHT_BODY_BYTES}",
                    self.body_limit()
                ),
            ));
        }
        if self.max_inflight_parse_bytes == 0 || self.max_inflight_parse_bytes > MAX_INFLIGHT_BODY_BYTES {
            return Err(Error::invalid(
                "max_inflight_parse_bytes",
                format!("must be from 1 to {MAX_INFLIGHT_BODY_BYTES}"),
            ));
        }
        if self.max_connection_buffer_bytes < MIN_CONNECTION_BUFFER_BYTES {
            return Err(Error::invalid(
                "max_connection_buffer_bytes",
                format!("must be at least {MIN_CONNECTION_BUFFER_BYTES}"),
            ));
        }
        Ok(())
    }

    /// The backend URL, with credentials from the settings filled in where the URL has none.
    pub fn backend_url(&self) -> Result<BackendUrl> {
        self.resolve_backend_url(&self.backend)
    }

    /// Parses a backend URL (the configured one, or one named on the command line, as `migrate`
    /// does), with credentials from the settings filled in where the URL has none.
    pub fn resolve_backend_url(&self, text: &str) -> Result<BackendUrl> {
        let mut url: BackendUrl = text.parse()?;
        if let BackendUrl::CouchDb(config) = &mut url {
            if config.user.is_none() {
                config.user = self.couchdb_user.clone();
                config.password = self.couchdb_password.clone();
            }
        }
        Ok(url)
    }

    /// The request body limit in force.
    pub fn body_limit(&self) -> usize {
        self.max_body_bytes.unwrap_or_else(|| self.max_value_bytes.saturating_mul(4).saturating_add(64 * 1024))
    }

    /// The JavaScript engine's bounds (`couchdb_js_*`, docs/design-documents.md).
    pub fn js_limits(&self) -> crate::js::JsLimits {
        let defaults = crate::js::JsLimits::default();
        let workers = if self.couchdb_js_workers == 0 { defaults.workers } else { self.couchdb_js_workers };
        crate::js::JsLimits {
            call_timeout: std::time::Duration::from_millis(self.couchdb_js_timeout_ms),
            memory_bytes: self.couchdb_js_memory_bytes,
            workers,
            queue: 64 * workers,
            // Room for the JSON around the rows (brackets and commas, a few bytes a row), so a
            // document within the views' bounds is always read; the views check the bounds.
            map_answer_bytes: self
                .couchdb_view_max_doc_bytes
                .saturating_add(self.couchdb_view_max_rows_per_doc.saturating_mul(8))
                .saturating_add(1024),
            map_call_bytes: self.couchdb_view_batch_bytes,
            log: crate::js::LogLimits {
                line_bytes: self.couchdb_js_log_line_bytes,
                database_bytes_per_minute: self.couchdb_js_log_bytes_per_minute,
                server_bytes_per_minute: self.couchdb_js_log_server_bytes_per_minute,
            },
            ..defaults
        }
    }

    /// The largest attachment stored (`couchdb_max_attachment_bytes`; no bound when unset).
    pub fn couchdb_attachment_limit(&self) -> u64 {
        self.couchdb_max_attachment_bytes.unwrap_or(u64::MAX)
    }

    /// The CouchDB API's request-body limit.
    pub fn couchdb_request_limit(&self) -> usize {
        self.couchdb_max_request_bytes.unwrap_or(64 << 20).max(self.body_limit())
    }

    /// The server-wide budget of request-body bytes being read and parsed at once.
    pub fn inflight_body_budget(&self) -> usize {
        self.max_inflight_body_bytes.unwrap_or_else(|| self.body_limit().saturating_mul(4))
    }

    /// The facade's options these settings describe.
    pub fn store_options(&self) -> StoreOptions {
        StoreOptions {
            limits: Limits { max_value_bytes: self.max_value_bytes },
            track_reads: self.track_reads,
            max_conflict_retries: self.max_conflict_retries,
            page_size: self.page_size,
            deadline: None,
            max_tree_bytes: self.couchdb_max_tree_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `couchdb_js_log_*` become the JavaScript engine's log bounds (the engine's own test,
    /// `js::tests::the_log_bounds_are_taken_from_the_settings`, shows it keeps to them).
    #[test]
    fn the_js_log_settings_reach_the_engine_s_limits() {
        let dir = tempfile::tempdir().expect("a directory");
        let file = dir.path().join("agentstore.toml");
        let config = "couchdb_js_log_line_bytes = 64\ncouchdb_js_log_bytes_per_minute = 1000\n\
                      couchdb_js_log_server_bytes_per_minute = 1500\n";
        std::fs::write(&file, config).expect("the configuration written");
        let log = Settings::load(Some(&file), &Overrides::default()).expect("settings").js_limits().log;
        assert_eq!((log.line_bytes, log.database_bytes_per_minute, log.server_bytes_per_minute), (64, 1000, 1500));
    }

    fn load(toml: &str) -> Result<Settings> {
        let dir = tempfile::tempdir().map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?;
        let path = dir.path().join("agentstore.toml");
        std::fs::write(&path, toml).map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?;
        Settings::load(Some(&path), &Overrides::default())
    }

    /// The bounds of issue 22 have defaults (CouchDB's own where it has one) and refuse values
    /// that would switch them off, naming the setting.
    #[test]
    fn the_bounds_have_defaults_and_refuse_unusable_values() {
        let settings = load("").unwrap();
        assert_eq!(settings.body_read_timeout_secs, 30);
        assert_eq!(settings.body_min_bytes_per_sec, 16384, "16 KiB/s, 128 kbit/s");
        assert_eq!(load("body_min_bytes_per_sec = 0").unwrap().body_min_bytes_per_sec, 0, "0: no rate, the old rule");
        assert_eq!(settings.couchdb_max_query_bytes, 1 << 20);
        assert_eq!(settings.couchdb_max_login_bytes, 16 << 10);
        assert_eq!(settings.couchdb_changes_timeout_ms, 60_000);
        assert_eq!(settings.couchdb_changes_min_heartbeat_ms, 1_000);
        assert_eq!(settings.couchdb_changes_max_feed_secs, 3_600);
        assert_eq!(settings.couchdb_max_feeds_per_login, 16);
        assert_eq!(settings.couchdb_max_open_databases, 128);
        assert_eq!(settings.couchdb_database_recheck_ms, 0);
        assert_eq!(settings.couchdb_max_document_bytes, 8_000_000);
        assert_eq!(settings.couchdb_max_attachment_bytes, None, "no bound, as CouchDB's `infinity`");
        assert_eq!(settings.couchdb_attachment_grace_secs, 86_400, "a day, as the storage layer's grace");
        assert_eq!(settings.couchdb_attachment_limit(), u64::MAX);
        assert_eq!(settings.couchdb_max_dbs_info_keys, 100);
        assert_eq!(settings.couchdb_max_replication_jobs, 500, "CouchDB's [replicator] max_jobs");
        assert_eq!(settings.couchdb_max_descending_changes, 100_000);
        assert_eq!(settings.couchdb_db_updates_flush_ms, 500, "CouchDB's max_write_delay");
        assert_eq!(
            (settings.couchdb_lockout_threshold, settings.couchdb_lockout_secs, settings.couchdb_lockout_max_entries),
            (5, 300, 10_000)
        );
        assert_eq!(settings.couchdb_max_queued_suspect_logins, 8);
        assert_eq!(settings.couchdb_inline_wait_ms, 30_000);
        assert_eq!(settings.couchdb_max_view_queries, 1_000);
        assert_eq!(settings.couchdb_view_index_slots, 16);
        assert_eq!(
            (
                settings.couchdb_js_log_line_bytes,
                settings.couchdb_js_log_bytes_per_minute,
                settings.couchdb_js_log_server_bytes_per_minute
            ),
            (4096, 1 << 20, 8 << 20)
        );
        assert_eq!(settings.store_options().max_tree_bytes, settings.couchdb_max_tree_bytes, "one tree bound");
        assert_eq!(
            (
                settings.couchdb_view_max_rows_per_doc,
                settings.couchdb_view_max_key_bytes,
                settings.couchdb_view_max_doc_bytes,
                settings.couchdb_view_batch_bytes,
                settings.couchdb_view_max_index_bytes
            ),
            (10_000, 8_000, 16 << 20, 16 << 20, 16 << 30)
        );
        for (toml, field) in [
            ("body_read_timeout_secs = 0", "body_read_timeout_secs"),
            ("couchdb_max_query_bytes = 0", "couchdb_max_query_bytes"),
            ("couchdb_max_feeds_per_login = 0", "couchdb_max_feeds_per_login"),
            ("couchdb_changes_timeout_ms = 0", "couchdb_changes_timeout_ms"),
            ("couchdb_changes_min_heartbeat_ms = 70000", "couchdb_changes_min_heartbeat_ms"),
            ("couchdb_lockout_max_entries = 0", "couchdb_lockout_max_entries"),
            ("couchdb_max_attachment_bytes = 0", "couchdb_max_attachment_bytes"),
            ("couchdb_inline_wait_ms = 0", "couchdb_inline_wait_ms"),
            ("couchdb_max_view_queries = 0", "couchdb_max_view_queries"),
            ("couchdb_js_log_line_bytes = 0", "couchdb_js_log_line_bytes"),
            ("couchdb_js_log_bytes_per_minute = 0", "couchdb_js_log_bytes_per_minute"),
            ("couchdb_js_log_server_bytes_per_minute = 0", "couchdb_js_log_server_bytes_per_minute"),
        ] {
            let message = load(toml).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(message.contains(field), "{toml}: {message:?}");
        }
        assert_eq!(load("couchdb_lockout_threshold = 0").unwrap().couchdb_lockout_threshold, 0, "0 turns it off");
        let bounded = load("couchdb_max_attachment_bytes = 1048576").unwrap();
        assert_eq!(bounded.couchdb_attachment_limit(), 1 << 20);
    }

    /// hyper's buffer of a connection is a setting with hyper's minimum (hyper panics below it).
    #[test]
    fn the_connection_buffer_is_a_setting_of_at_least_hyper_s_minimum() {
        assert_eq!(load("").unwrap().max_connection_buffer_bytes, 64 << 10);
        assert_eq!(load("max_connection_buffer_bytes = 8192").unwrap().max_connection_buffer_bytes, 8192);
        let message = load("max_connection_buffer_bytes = 8191").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(message.contains("max_connection_buffer_bytes"), "{message:?}");
    }

    /// `cors_origins`: none by default; origins as a browser sends them, listed or comma
    /// separated; a path, a missing scheme or host refused, naming the entry.
    #[test]
    fn cors_origins_are_origins() {
        assert!(load("").unwrap().cors_origins.origins().unwrap().is_empty());
        let listed = load("cors_origins = [\"http://127.0.0.1:5984\", \"https://console.example\"]").unwrap();
        assert_eq!(listed.cors_origins.origins().unwrap(), ["http://127.0.0.1:5984", "https://console.example"]);
        let compact = load("cors_origins = \"http://a:1, http://b:2\"").unwrap();
        assert_eq!(compact.cors_origins.origins().unwrap(), ["http://a:1", "http://b:2"]);
        for bad in ["http://a:1/_utils", "127.0.0.1:5984", "http://a:1/", "ftp://a"] {
            let refused = load(&format!("cors_origins = [\"http://ok:1\", \"{bad}\"]")).unwrap_err().to_string();
            assert!(refused.contains("cors_origins[1]"), "{bad}: {refused}");
        }
    }

    /// `couchdb_trusted_proxies`: none by default; a TOML list or a comma-separated string (the
    /// environment's form) of IPs and CIDR networks; anything else refused, naming the entry.
    #[test]
    fn trusted_proxies_are_ips_or_networks() {
        assert!(load("").unwrap().couchdb_trusted_proxies.networks().unwrap().is_empty());
        let listed = load("couchdb_trusted_proxies = [\"10.0.0.0/8\", \"192.0.2.7\", \"::1\"]").unwrap();
        let networks = listed.couchdb_trusted_proxies.networks().unwrap();
        let texts: Vec<String> = networks.iter().map(ToString::to_string).collect();
        assert_eq!(texts, ["10.0.0.0/8", "192.0.2.7/32", "::1/128"]);
        let compact = load("couchdb_trusted_proxies = \" 10.0.0.0/8 , 192.0.2.7\"").unwrap();
        assert_eq!(compact.couchdb_trusted_proxies.networks().unwrap().len(), 2);
        let refused = load("couchdb_trusted_proxies = [\"10.0.0.1\", \"balancer.local\"]").unwrap_err().to_string();
        assert!(refused.contains("couchdb_trusted_proxies[1]") && refused.contains("balancer.local"), "{refused}");
    }
}
