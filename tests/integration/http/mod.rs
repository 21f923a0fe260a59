//! The REST API end to end: every test starts a real server on an ephemeral loopback port (in
//! process over a temporary embedded store, or the built binary for the shutdown test) and drives
//! it over HTTP with a real client.
//!
//! Keys `.` and `..` are not tested: HTTP clients (and the URL standard) normalise dot segments,
//! even percent-encoded ones (`%2E`), so such keys cannot be addressed in a path.
//!
//! This module holds what the topic files share: paths, replies, the in-process server and its
//! settings; each topic file opens with what it covers.

mod binary;
mod change_feed;
mod connections;
mod couchdb_face;
mod documents;
mod errors;
mod failing_backends;
mod load;
mod operations;
mod robustness;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentstore::backend::raw::layer::Layered;
use agentstore::backend::{
    BulkWrite, ChangesPage, DocumentBackend, IdRange, LayoutState, Page, Precondition, Query, ReplicatedOutcome,
    ReplicatedRevision, Revision, RevisionInfo, StoredDocument, UpgradePage,
};
use agentstore::config::{Overrides, Settings, TokenSetting, TokensSetting};
use agentstore::http::{bind, hash_token, App, ROUTES};
use agentstore::model::id::encode_key;
use agentstore::model::DocumentId;
use agentstore::{Error, ErrorKind};
use async_trait::async_trait;
use futures::StreamExt;
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use reqwest::header::{HeaderMap, HeaderValue};
use reqwest::{Method, RequestBuilder, StatusCode};
use serde_json::{json, Map, Value};
use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::common::is_timestamp;

const DOC_ROUTE: &str = "/v1/users/{user}/namespaces/{namespace}/keys/{key}";
const CHANGES_ROUTE: &str = "/v1/changes";
const ALICE: &str = "alice-secret";
const BOB: &str = "bob-secret";
const ADMIN: &str = "admin-secret";

// ---- paths ----

/// Everything but RFC 3986 unreserved characters is percent-encoded.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// One path segment, percent-encoded.
fn seg(text: &str) -> String {
    utf8_percent_encode(text, SEGMENT).to_string()
}

/// A route template with its parameters filled in (each percent-encoded).
fn fill(template: &str, user: &str, namespace: &str, key: &str) -> String {
    template.replace("{user}", &seg(user)).replace("{namespace}", &seg(namespace)).replace("{key}", &seg(key))
}

fn doc_path(user: &str, namespace: &str, key: &str) -> String {
    fill(DOC_ROUTE, user, namespace, key)
}

fn keys_path(user: &str, namespace: &str) -> String {
    fill("/v1/users/{user}/namespaces/{namespace}/keys", user, namespace, "")
}

fn namespace_path(user: &str, namespace: &str) -> String {
    fill("/v1/users/{user}/namespaces/{namespace}", user, namespace, "")
}

fn namespaces_path(user: &str) -> String {
    fill("/v1/users/{user}/namespaces", user, "", "")
}

fn user_path(user: &str) -> String {
    fill("/v1/users/{user}", user, "", "")
}

/// The `/v1` routes of [`ROUTES`] that address one user's data (`/v1/changes`, for admins, has
/// tests of its own).
fn v1_routes() -> Vec<(Method, &'static str)> {
    let admin_only: Vec<_> =
        ROUTES.iter().filter(|(_, path)| path.starts_with("/v1/") && !path.starts_with("/v1/users/")).collect();
    assert_eq!(admin_only, [&("GET", CHANGES_ROUTE)], "a new /v1 route outside /v1/users: review the auth tests");
    let routes: Vec<_> = ROUTES
        .iter()
        .filter(|(_, path)| path.starts_with("/v1/users/"))
        .map(|(method, path)| (Method::from_bytes(method.as_bytes()).expect("valid method"), *path))
        .collect();
    assert_eq!(routes.len(), 9, "the /v1 routes changed; review the tests that loop over them");
    routes
}

// ---- responses ----

/// A response, read to the end.
struct Reply {
    what: String,
    status: StatusCode,
    headers: HeaderMap,
    body: Vec<u8>,
}

impl Reply {
    fn describe(&self) -> String {
        let text = String::from_utf8_lossy(&self.body);
        let text: String = text.chars().take(600).collect();
        format!("{} -> {} {text}", self.what, self.status)
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap_or_else(|_| panic!("{name} is not text: {v:?}")))
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.describe()))
    }

    fn text(&self) -> String {
        String::from_utf8(self.body.clone()).unwrap_or_else(|_| panic!("body is not UTF-8: {}", self.describe()))
    }

    /// Asserts the status and returns the body as JSON.
    fn expect_json(&self, status: StatusCode) -> Value {
        assert_eq!(self.status, status, "{}", self.describe());
        let ctype = self.header("content-type").unwrap_or_default();
        assert!(ctype.starts_with("application/json"), "content type {ctype:?}: {}", self.describe());
        self.json()
    }

    /// Asserts a 200 JSON document response and that its `ETag` is `"<_rev>"`.
    fn document(&self) -> Value {
        let doc = self.expect_json(StatusCode::OK);
        let rev = doc["_rev"].as_str().unwrap_or_else(|| panic!("no _rev: {}", self.describe()));
        assert!(!rev.is_empty());
        assert_eq!(self.header("etag"), Some(format!("\"{rev}\"").as_str()), "{}", self.describe());
        doc
    }

    /// Asserts an error response in the API's format: `{"error": code, "reason": "…"}`, nothing
    /// else. Returns the reason.
    fn expect_error(&self, status: StatusCode, code: &str) -> String {
        let body = self.expect_json(status);
        let object = body.as_object().unwrap_or_else(|| panic!("error body is not an object: {}", self.describe()));
        let fields: BTreeSet<&str> = object.keys().map(String::as_str).collect();
        assert_eq!(fields, BTreeSet::from(["error", "reason"]), "{}", self.describe());
        assert_eq!(object["error"], json!(code), "{}", self.describe());
        let reason = object["reason"].as_str().unwrap_or_else(|| panic!("reason is not text: {}", self.describe()));
        assert!(!reason.is_empty(), "{}", self.describe());
        reason.to_owned()
    }
}

async fn send_with(client: &reqwest::Client, request: reqwest::Request, what: String) -> Reply {
    let response = client.execute(request).await.unwrap_or_else(|e| panic!("{what}: request failed: {e}"));
    let status = response.status();
    let headers = response.headers().clone();
    let body = response.bytes().await.unwrap_or_else(|e| panic!("{what}: reading the body failed: {e}")).to_vec();
    Reply { what, status, headers, body }
}

// ---- servers ----

/// Settings for a server over `dir/s.redb`, with every field these tests rely on set explicitly
/// so a developer's `AGENTSTORE_*` environment cannot change them.
fn settings(dir: &TempDir) -> Settings {
    let overrides =
        Overrides { backend: Some(format!("embedded:{}", dir.path().join("s.redb").display())), ..Default::default() };
    let mut settings = Settings::load(None, &overrides).expect("settings load");
    settings.tokens = TokensSetting::default();
    settings.max_value_bytes = 1024 * 1024;
    settings.track_reads = true;
    settings.max_conflict_retries = 100;
    settings.page_size = 1000;
    settings.allow_unauthenticated = false;
    settings.max_body_bytes = None;
    settings.request_timeout_secs = 30;
    settings.shutdown_grace_secs = 5;
    settings.header_read_timeout_secs = 10;
    settings.idle_timeout_secs = 60;
    settings.max_connections = 1024;
    settings.max_inflight_body_bytes = None;
    settings.max_inflight_parse_bytes = 128 << 20;
    settings
}

fn token_settings() -> TokensSetting {
    TokensSetting::List(vec![
        TokenSetting { sha256: hash_token(ALICE), user: Some("alice".into()), admin: false },
        TokenSetting { sha256: hash_token(BOB), user: Some("bob".into()), admin: false },
        TokenSetting { sha256: hash_token(ADMIN), user: None, admin: true },
    ])
}

/// A server running in this process on an ephemeral loopback port.
struct Server {
    base: String,
    client: reqwest::Client,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<agentstore::Result<()>>>,
    /// The backend the server runs on, for checks that bypass the server.
    backend: Arc<dyn DocumentBackend>,
    _dir: TempDir,
}

impl Server {
    /// Over a fresh embedded store, with default settings.
    async fn start() -> Self {
        Server::start_with(|_| {}).await
    }

    /// Over a fresh embedded store, with `tweak` applied to the settings.
    async fn start_with(tweak: impl FnOnce(&mut Settings)) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut settings = settings(&dir);
        tweak(&mut settings);
        let url = settings.backend.parse().expect("backend url");
        let backend = agentstore::backend::open(&url).await.expect("open embedded store");
        Server::on_backend(backend, &settings, dir).await
    }

    /// Over `backend`.
    async fn on_backend(backend: Arc<dyn DocumentBackend>, settings: &Settings, dir: TempDir) -> Self {
        let app = App::build(Arc::clone(&backend), settings).await.expect("app builds");
        let listener = bind("127.0.0.1:0", &app, false).await.expect("bind loopback");
        let addr: SocketAddr = listener.local_addr().expect("local address");
        let (shutdown, stop) = oneshot::channel::<()>();
        let task = tokio::spawn(app.serve(listener, async move {
            let _ = stop.await;
        }));
        let client = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(20)).build().expect("client");
        Server {
            base: format!("http://{addr}"),
            client,
            shutdown: Some(shutdown),
            task: Some(task),
            backend,
            _dir: dir,
        }
    }

    fn req(&self, method: Method, path: &str) -> RequestBuilder {
        self.client.request(method, format!("{}{path}", self.base))
    }

    async fn send(&self, request: RequestBuilder) -> Reply {
        let built = request.build().expect("request builds");
        let what = format!("{} {}", built.method(), built.url().path());
        send_with(&self.client, built, what).await
    }

    async fn call(&self, method: Method, path: &str) -> Reply {
        self.send(self.req(method, path)).await
    }

    async fn get(&self, path: &str) -> Reply {
        self.call(Method::GET, path).await
    }

    async fn put(&self, path: &str, body: &Value) -> Reply {
        self.send(self.req(Method::PUT, path).json(body)).await
    }

    /// PUTs a document and asserts it was stored.
    async fn put_doc(&self, user: &str, namespace: &str, key: &str, body: &Value) -> Value {
        self.put(&doc_path(user, namespace, key), body).await.document()
    }

    /// Stops the server and checks that it stopped cleanly.
    async fn stop(mut self) {
        let _ = self.shutdown.take().expect("running").send(());
        let task = self.task.take().expect("running");
        let result = tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("server stops within 10 s")
            .expect("server task did not panic");
        result.expect("server stopped without error");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
    }
}

/// A server with alice's, bob's and an admin token configured.
async fn server_with_tokens() -> Server {
    Server::start_with(|s| s.tokens = token_settings()).await
}

/// A request for `route` on user `user` (namespace `ns`, key `k`), with a valid body for PUT.
fn route_request(server: &Server, method: &Method, template: &str, user: &str) -> RequestBuilder {
    let request = server.req(method.clone(), &fill(template, user, "ns", "k"));
    if *method == Method::PUT {
        request.json(&json!({ "value": 1 }))
    } else {
        request
    }
}

/// The address a server listens on.
fn addr_of(server: &Server) -> SocketAddr {
    server.base.trim_start_matches("http://").parse().expect("server address")
}

/// Reads until the end of the HTTP head (`\r\n\r\n`) and returns it.
async fn read_head(stream: &mut tokio::net::TcpStream) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = stream.read(&mut byte).await.expect("read response head");
        assert!(n == 1, "connection closed mid-head: {:?}", String::from_utf8_lossy(&head));
        head.push(byte[0]);
    }
    String::from_utf8(head).expect("head is text")
}
