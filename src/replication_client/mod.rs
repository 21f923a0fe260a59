//! The HTTP side of moving a deployment: a client of CouchDB's replication protocol for any
//! CouchDB-protocol server (Apache CouchDB, pouchdb-server, or an agentstore `serve` with its
//! CouchDB face). `agentstore migrate --all-databases` reads and writes a server's databases
//! through it ([`crate::migrate::deployment`]); everything this project says to a CouchDB server
//! for that is here.
//!
//! What it uses, all of it in CouchDB 2.x/3.x and pouchdb-server:
//! `GET /_all_dbs`, `GET|PUT|DELETE /{db}`, `GET|PUT /{db}/_security`, `GET|PUT /{db}/_revs_limit`
//! (pouchdb-server has no such route: read as unknown, written as best effort),
//! `GET /{db}/_changes?style=all_docs&since=&limit=`, `POST /{db}/_revs_diff`,
//! `POST /{db}/_bulk_get?revs=true[&attachments=true]` (JSON; attachments as stubs, or as base64
//! for small ones), `POST /{db}/_bulk_docs` with `new_edits: false`, and for attachments too large
//! to travel inline (`crate::migrate::deployment`, "Memory"): `GET /{db}/{doc}/{name}?rev=` (the
//! bytes streamed) and `PUT /{db}/{doc}?new_edits=false` as `multipart/related`, the document's
//! JSON then each attachment's bytes streamed as a part. CouchDB reads the parts in the order the
//! JSON's `follows` entries come and ignores their headers; pouchdb-server (express-pouchdb with
//! `multiparty`) instead takes each part's name from its `Content-Disposition` filename and its
//! type from its `Content-Type`, so both headers are sent, and the body's exact `Content-Length`
//! (never chunked).
//!
//! Credentials come from the URL's user info (or [`CouchClient::with_basic_auth`]) and are sent
//! as HTTP basic authentication; the URL is only ever shown redacted ([`CouchClient::describe`]).
//!
//! The replicator ([`crate::replicator`]) reads and writes through it too, and adds: a filtered
//! feed page ([`FeedFilter`]: `filter=_doc_ids`, `filter=_selector`, `filter=ddoc/name` with the
//! replication's `query_params`, run by the source server as CouchDB's replicator asks it),
//! `GET /{db}/{doc}` (a design filter's code), `GET|PUT /{db}/_local/{id}` (checkpoints), the
//! headers a replication names, and its connect timeout.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use reqwest::{Method, StatusCode};
use serde_json::{json, Map, Value};
use url::Url;

use crate::error::{Error, ErrorKind, Result};

/// Characters of a database name or document id that stay as they are in a path segment; every
/// other one (`/` above all, which CouchDB names may hold) is percent-encoded.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC.remove(b'_').remove(b'-').remove(b'.').remove(b'~');
/// How long one request may take, attachments included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);
/// Attempts of a request that failed for a reason that may pass (connection, 5xx, 429).
const ATTEMPTS: u32 = 5;

/// Attachment bytes as they stream, in the chunks they come in.
pub type ByteStream = BoxStream<'static, Result<Bytes>>;

/// One attachment part of a `multipart/related` upload: its name, type and exact length.
#[derive(Debug, Clone, PartialEq)]
pub struct AttachmentPart {
    pub name: String,
    pub content_type: String,
    pub length: u64,
}

/// Whether pouchdb-server's multipart reader (`multiparty`) gives back `name` exactly as sent in
/// a `Content-Disposition` filename: it cuts at a backslash and decodes `%22` and `&#N;`, and
/// header values end at a line break. Names it would change cannot travel as parts.
pub fn part_name_survives(name: &str) -> bool {
    !name.contains('\\') && !name.contains("%22") && !name.contains("&#") && !name.chars().any(char::is_control)
}

/// One change of a database's feed with every leaf of the document (`style=all_docs`).
#[derive(Debug, Clone, PartialEq)]
pub struct ChangedDoc {
    pub id: String,
    /// Every leaf revision, deleted ones included.
    pub leaves: Vec<String>,
}

/// One page of a database's change feed.
#[derive(Debug, Clone, PartialEq)]
pub struct FeedPage {
    pub docs: Vec<ChangedDoc>,
    /// Where the next page starts (CouchDB's `last_seq`: a string on CouchDB 2+, a number on
    /// pouchdb-server; kept as sent).
    pub last_seq: Value,
    /// Whether this page reached the end of the feed as the server saw it.
    pub at_end: bool,
}

/// Which changes of a feed page a reader keeps: a replication's filter, run where the feed is
/// read (by the source server for a remote source).
#[derive(Debug, Clone, PartialEq)]
pub enum FeedFilter {
    All,
    DocIds(Vec<String>),
    Selector(Map<String, Value>),
    /// A design document's filter function `ddoc/name`, with the query parameters it is given.
    Design {
        ddoc: String,
        name: String,
        query_params: Map<String, Value>,
    },
}

/// A client of one CouchDB-protocol server.
#[derive(Clone)]
pub struct CouchClient {
    http: reqwest::Client,
    /// The server's root, without credentials, ending in `/`.
    base: Url,
    user: Option<String>,
    password: Option<String>,
    /// Headers sent with every request (a replication's `headers`).
    headers: Vec<(String, String)>,
}

impl CouchClient {
    /// A client of the server at `url` (`http(s)://[user:password@]host:port[/prefix]`).
    pub fn new(url: &str) -> Result<Self> {
        let mut base = Url::parse(url).map_err(|e| Error::invalid("url", format!("{url:?} is not a URL: {e}")))?;
        if !matches!(base.scheme(), "http" | "https") {
            return Err(Error::invalid("url", format!("{} is not an http(s) URL", redact(&base))));
        }
        let user = (!base.username().is_empty()).then(|| decode(base.username()));
        let password = base.password().map(decode);
        let _ = base.set_username("");
        let _ = base.set_password(None);
        base.set_query(None);
        base.set_fragment(None);
        if !base.path().ends_with('/') {
            let path = format!("{}/", base.path());
            base.set_path(&path);
        }
        let http = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .pool_max_idle_per_host(16)
            .build()
            .map_err(|e| Error::new(ErrorKind::Internal, "cannot build an HTTP client").with_source(e))?;
        Ok(CouchClient { http, base, user, password, headers: Vec::new() })
    }

    /// The same server with these Basic credentials instead of the URL's.
    pub fn with_basic_auth(self, user: Option<String>, password: Option<String>) -> Self {
        CouchClient { user, password, ..self }
    }

    /// The same server, every request carrying `headers` too.
    pub fn with_headers(self, headers: Vec<(String, String)>) -> Self {
        CouchClient { headers, ..self }
    }

    /// The same server, a connection given up after `connect` and a request after `request`.
    pub fn with_timeouts(self, connect: Duration, request: Duration) -> Result<Self> {
        let http = reqwest::Client::builder()
            .connect_timeout(connect)
            .timeout(request)
            .pool_max_idle_per_host(16)
            .build()
            .map_err(|e| Error::new(ErrorKind::Internal, "cannot build an HTTP client").with_source(e))?;
        Ok(CouchClient { http, ..self })
    }

    /// The server's URL without credentials.
    pub fn describe(&self) -> String {
        self.base.as_str().trim_end_matches('/').to_owned()
    }

    fn url(&self, segments: &[&str], query: &[(&str, String)]) -> Result<Url> {
        let path: Vec<String> = segments.iter().map(|s| utf8_percent_encode(s, SEGMENT).to_string()).collect();
        let mut url = self
            .base
            .join(&path.join("/"))
            .map_err(|e| Error::new(ErrorKind::Internal, format!("cannot form a URL under {}: {e}", self.base)))?;
        if !query.is_empty() {
            url.query_pairs_mut().extend_pairs(query.iter().map(|(k, v)| (*k, v.as_str())));
        }
        Ok(url)
    }

    /// Sends one request (retrying what may pass) and returns its status and JSON body.
    async fn send(&self, method: Method, url: Url, body: Option<&Value>) -> Result<(StatusCode, Value)> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut request = self.http.request(method.clone(), url.clone()).header("accept", "application/json");
            for (name, value) in &self.headers {
                request = request.header(name.as_str(), value.as_str());
            }
            if let Some(user) = &self.user {
                request = request.basic_auth(user, self.password.as_deref());
            }
            if let Some(body) = body {
                request = request.json(body);
            }
            let outcome = async {
                let response = request.send().await?;
                let status = response.status();
                let bytes = response.bytes().await?;
                Ok::<_, reqwest::Error>((status, bytes))
            }
            .await;
            let shown = format!("{method} {}", redact(&url));
            match outcome {
                Ok((status, bytes)) => {
                    let retry = status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS;
                    if retry && attempt < ATTEMPTS {
                        tokio::time::sleep(backoff(attempt)).await;
                        continue;
                    }
                    let value = if bytes.is_empty() {
                        Value::Null
                    } else {
                        crate::model::depth::parse_stored(&bytes).map_err(|e| {
                            Error::new(
                                ErrorKind::Unavailable,
                                format!("{shown}: the answer ({status}) is not JSON: {e}"),
                            )
                        })?
                    };
                    return Ok((status, value));
                }
                Err(err) if attempt < ATTEMPTS => {
                    tracing::debug!(error = %err, request = %shown, "retrying");
                    tokio::time::sleep(backoff(attempt)).await;
                }
                Err(err) => {
                    return Err(Error::new(ErrorKind::Unavailable, format!("{shown}: {err}")).with_source(err));
                }
            }
        }
    }

    /// Sends a request that must succeed (2xx); any other status is an error naming CouchDB's.
    async fn answer_ok(&self, method: Method, url: Url, body: Option<&Value>) -> Result<Value> {
        let shown = format!("{method} {}", redact(&url));
        let (status, value) = self.send(method, url, body).await?;
        if status.is_success() {
            return Ok(value);
        }
        Err(status_error(&shown, status, &value))
    }

    /// `GET /`: checks the server answers as a CouchDB does.
    pub async fn welcome(&self) -> Result<Value> {
        let value = self.answer_ok(Method::GET, self.url(&[], &[])?, None).await?;
        // CouchDB says `"couchdb": "Welcome"`, pouchdb-server `"express-pouchdb": "Welcome!"`.
        if value.get("couchdb").is_none() && value.get("express-pouchdb").is_none() {
            return Err(Error::invalid("url", format!("{} does not answer as a CouchDB server", self.describe())));
        }
        Ok(value)
    }

    /// `GET /_all_dbs`.
    pub async fn all_dbs(&self) -> Result<Vec<String>> {
        let value = self.answer_ok(Method::GET, self.url(&["_all_dbs"], &[])?, None).await?;
        let Value::Array(names) = value else {
            return Err(Error::new(ErrorKind::Unavailable, "_all_dbs did not answer a list"));
        };
        Ok(names.into_iter().filter_map(|n| n.as_str().map(str::to_owned)).collect())
    }

    /// `GET /{db}`; `None` when it does not exist.
    pub async fn db_info(&self, db: &str) -> Result<Option<Value>> {
        let url = self.url(&[db], &[])?;
        let shown = format!("GET {}", redact(&url));
        match self.send(Method::GET, url, None).await? {
            (status, value) if status.is_success() => Ok(Some(value)),
            (StatusCode::NOT_FOUND, _) => Ok(None),
            (status, value) => Err(status_error(&shown, status, &value)),
        }
    }

    /// `PUT /{db}`; `false` when it existed already.
    pub async fn create_db(&self, db: &str) -> Result<bool> {
        let url = self.url(&[db], &[])?;
        let shown = format!("PUT {}", redact(&url));
        match self.send(Method::PUT, url, None).await? {
            (status, _) if status.is_success() => Ok(true),
            (StatusCode::PRECONDITION_FAILED, _) => Ok(false),
            (status, value) => Err(status_error(&shown, status, &value)),
        }
    }

    /// `DELETE /{db}`; `false` when there was none.
    pub async fn delete_db(&self, db: &str) -> Result<bool> {
        let url = self.url(&[db], &[])?;
        let shown = format!("DELETE {}", redact(&url));
        match self.send(Method::DELETE, url, None).await? {
            (status, _) if status.is_success() => Ok(true),
            (StatusCode::NOT_FOUND, _) => Ok(false),
            (status, value) => Err(status_error(&shown, status, &value)),
        }
    }

    /// `GET /{db}/_security`.
    pub async fn security(&self, db: &str) -> Result<Value> {
        self.answer_ok(Method::GET, self.url(&[db, "_security"], &[])?, None).await
    }

    /// `PUT /{db}/_security`.
    pub async fn put_security(&self, db: &str, security: &Value) -> Result<()> {
        self.answer_ok(Method::PUT, self.url(&[db, "_security"], &[])?, Some(security)).await.map(|_| ())
    }

    /// `GET /{db}/_revs_limit`; `None` where the server has no such route (pouchdb-server).
    pub async fn revs_limit(&self, db: &str) -> Result<Option<u64>> {
        match self.send(Method::GET, self.url(&[db, "_revs_limit"], &[])?, None).await? {
            (status, value) if status.is_success() => Ok(value.as_u64()),
            _ => Ok(None),
        }
    }

    /// `PUT /{db}/_revs_limit`; `false` where the server refuses or has no such route.
    pub async fn put_revs_limit(&self, db: &str, limit: u64) -> Result<bool> {
        let (status, _) = self.send(Method::PUT, self.url(&[db, "_revs_limit"], &[])?, Some(&json!(limit))).await?;
        Ok(status.is_success())
    }

    /// One page of `GET /{db}/_changes?style=all_docs` after `since` (`Value::Null`: the start).
    pub async fn changes(&self, db: &str, since: &Value, limit: usize) -> Result<FeedPage> {
        self.changes_filtered(db, since, limit, &FeedFilter::All).await
    }

    /// One page of the feed after `since` with only the changes `filter` keeps, asked of the
    /// server (`POST` with `doc_ids` or `selector` in the body, as CouchDB's replicator asks).
    pub async fn changes_filtered(
        &self,
        db: &str,
        since: &Value,
        limit: usize,
        filter: &FeedFilter,
    ) -> Result<FeedPage> {
        let mut query = vec![("style", "all_docs".to_owned()), ("limit", limit.to_string())];
        match since {
            Value::Null => {}
            Value::String(text) => query.push(("since", text.clone())),
            other => query.push(("since", other.to_string())),
        }
        let (method, body) = match filter {
            FeedFilter::All => (Method::GET, None),
            FeedFilter::DocIds(ids) => {
                query.push(("filter", "_doc_ids".to_owned()));
                (Method::POST, Some(json!({ "doc_ids": ids })))
            }
            FeedFilter::Selector(selector) => {
                query.push(("filter", "_selector".to_owned()));
                (Method::POST, Some(json!({ "selector": selector })))
            }
            FeedFilter::Design { ddoc, name, query_params } => {
                query.push(("filter", format!("{ddoc}/{name}")));
                for (param, value) in query_params {
                    let text = value.as_str().map_or_else(|| value.to_string(), str::to_owned);
                    query.push((param.as_str(), text));
                }
                (Method::GET, None)
            }
        };
        let value = self.answer_ok(method, self.url(&[db, "_changes"], &query)?, body.as_ref()).await?;
        Ok(feed_page(&value, since, limit))
    }

    /// `GET /{db}/{id}` (a design document's id keeps its `/`, a local one too); `None` when the
    /// server has no such document.
    pub async fn get_doc(&self, db: &str, id: &str) -> Result<Option<Value>> {
        let url = self.url(&doc_segments(db, id), &[])?;
        let shown = format!("GET {}", redact(&url));
        match self.send(Method::GET, url, None).await? {
            (status, value) if status.is_success() => Ok(Some(value)),
            (StatusCode::NOT_FOUND, _) => Ok(None),
            (status, value) => Err(status_error(&shown, status, &value)),
        }
    }

    /// `PUT /{db}/{id}` of `body` (with its `_rev`); the new revision.
    pub async fn put_doc(&self, db: &str, id: &str, body: &Value) -> Result<String> {
        let value = self.answer_ok(Method::PUT, self.url(&doc_segments(db, id), &[])?, Some(body)).await?;
        Ok(value.get("rev").and_then(Value::as_str).unwrap_or_default().to_owned())
    }

    /// `POST /{db}/_revs_diff`: for each document, the revisions the server lacks.
    pub async fn revs_diff(&self, db: &str, wanted: &[(String, Vec<String>)]) -> Result<Vec<(String, Vec<String>)>> {
        if wanted.is_empty() {
            return Ok(Vec::new());
        }
        let body: Map<String, Value> = wanted.iter().map(|(id, revs)| (id.clone(), json!(revs))).collect();
        let value =
            self.answer_ok(Method::POST, self.url(&[db, "_revs_diff"], &[])?, Some(&Value::Object(body))).await?;
        let Value::Object(answer) = value else {
            return Err(Error::new(ErrorKind::Unavailable, "_revs_diff did not answer an object"));
        };
        let mut missing = Vec::new();
        for (id, _) in wanted {
            let Some(entry) = answer.get(id) else { continue };
            let revs: Vec<String> = entry
                .get("missing")
                .and_then(Value::as_array)
                .map(|revs| revs.iter().filter_map(|r| r.as_str().map(str::to_owned)).collect())
                .unwrap_or_default();
            if !revs.is_empty() {
                missing.push((id.clone(), revs));
            }
        }
        Ok(missing)
    }

    /// `POST /{db}/_bulk_get?revs=true[&attachments=true]`: each asked leaf as a document with
    /// `_revisions` (and its attachments inline when `attachments`); a leaf the server does not
    /// have is left out.
    pub async fn bulk_get(
        &self,
        db: &str,
        wanted: &[(String, Vec<String>)],
        attachments: bool,
    ) -> Result<Vec<Map<String, Value>>> {
        let asked: Vec<Value> =
            wanted.iter().flat_map(|(id, revs)| revs.iter().map(move |rev| json!({ "id": id, "rev": rev }))).collect();
        if asked.is_empty() {
            return Ok(Vec::new());
        }
        let mut query = vec![("revs", "true".to_owned())];
        if attachments {
            query.push(("attachments", "true".to_owned()));
        } else {
            // Stubs say which attachments the server keeps compressed (`encoding`): their digest
            // is the MD5 of the compressed bytes, not of the bytes served (verify.rs).
            query.push(("att_encoding_info", "true".to_owned()));
        }
        let body = json!({ "docs": asked, "revs": true, "attachments": attachments });
        let value = self.answer_ok(Method::POST, self.url(&[db, "_bulk_get"], &query)?, Some(&body)).await?;
        // Taken apart by value: with attachments inline, a copy would hold their bytes again.
        let mut docs = Vec::with_capacity(asked.len());
        for mut result in take_array(value, "results") {
            for mut entry in take_array(result.take(), "docs") {
                if let Some(Value::Object(doc)) = entry.get_mut("ok").map(Value::take) {
                    docs.push(doc);
                }
            }
        }
        Ok(docs)
    }

    /// `POST /{db}/_bulk_docs` with `new_edits: false`: the documents' revisions stored with
    /// their ancestry as they are. Returns the rows that failed (`{id, error, reason}`).
    pub async fn bulk_docs_replicated(&self, db: &str, docs: Vec<Map<String, Value>>) -> Result<Vec<Value>> {
        if docs.is_empty() {
            return Ok(Vec::new());
        }
        // Built by moving the documents in: a copy would hold their inline attachments again.
        let mut body = Map::with_capacity(2);
        body.insert("docs".into(), Value::Array(docs.into_iter().map(Value::Object).collect()));
        body.insert("new_edits".into(), Value::Bool(false));
        let body = Value::Object(body);
        let value = self.answer_ok(Method::POST, self.url(&[db, "_bulk_docs"], &[])?, Some(&body)).await?;
        let rows = value.as_array().cloned().unwrap_or_default();
        Ok(rows.into_iter().filter(|row| row.get("error").is_some()).collect())
    }

    /// `GET /{db}/{doc}/{name}?rev=`: the bytes of one attachment of one leaf, streamed as they
    /// arrive (no `Accept-Encoding` is sent, so CouchDB answers the bytes themselves even where
    /// it keeps them compressed). Connection failures and 5xx before the answer are retried;
    /// `NotFound` when the server has no such leaf or attachment.
    pub async fn attachment(&self, db: &str, id: &str, rev: &str, name: &str) -> Result<ByteStream> {
        let mut segments = doc_segments(db, id);
        segments.push(name);
        let url = self.url(&segments, &[("rev", rev.to_owned())])?;
        let shown = format!("GET {}", redact(&url));
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut request = self.http.get(url.clone());
            for (name, value) in &self.headers {
                request = request.header(name.as_str(), value.as_str());
            }
            if let Some(user) = &self.user {
                request = request.basic_auth(user, self.password.as_deref());
            }
            match request.send().await {
                Ok(response) if response.status().is_success() => {
                    let shown = shown.clone();
                    return Ok(response
                        .bytes_stream()
                        .map_err(move |err| {
                            Error::new(ErrorKind::Unavailable, format!("{shown}: the bytes stopped: {err}"))
                                .with_source(err)
                        })
                        .boxed());
                }
                Ok(response) => {
                    let status = response.status();
                    let retry = status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS;
                    if retry && attempt < ATTEMPTS {
                        tokio::time::sleep(backoff(attempt)).await;
                        continue;
                    }
                    let bytes = response.bytes().await.unwrap_or_default();
                    let value = crate::model::depth::parse_stored(&bytes).unwrap_or(Value::Null);
                    return Err(status_error(&shown, status, &value));
                }
                Err(err) if attempt < ATTEMPTS => {
                    tracing::debug!(error = %err, request = %shown, "retrying");
                    tokio::time::sleep(backoff(attempt)).await;
                }
                Err(err) => {
                    return Err(Error::new(ErrorKind::Unavailable, format!("{shown}: {err}")).with_source(err));
                }
            }
        }
    }

    /// `PUT /{db}/{doc}?new_edits=false` as `multipart/related`: `doc` (the leaf with
    /// `_revisions`; each attachment in `parts` marked `follows: true` with its `length`) then
    /// each part's bytes, from `open(part)`, streamed. Only one part's bytes are read at a time,
    /// and only as the connection takes them. A failure reading the bytes (`open`, or its stream)
    /// is returned as it came, not retried here; a connection failure or a 5xx is retried with
    /// the bytes opened again. Returns the refusal (`{id, rev, error, reason}`) when the server
    /// refused the leaf with a 4xx.
    pub async fn put_replicated_multipart<F, Fut>(
        &self,
        db: &str,
        doc: &Map<String, Value>,
        parts: &[AttachmentPart],
        open: F,
    ) -> Result<Option<Value>>
    where
        F: Fn(AttachmentPart) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Result<ByteStream>> + Send + 'static,
    {
        let id = doc.get("_id").and_then(Value::as_str).unwrap_or_default().to_owned();
        let rev = doc.get("_rev").and_then(Value::as_str).unwrap_or_default().to_owned();
        let url = self.url(&doc_segments(db, &id), &[("new_edits", "false".to_owned())])?;
        let shown = format!("PUT {}", redact(&url));
        let mut random = [0u8; 16];
        getrandom::fill(&mut random)
            .map_err(|e| Error::new(ErrorKind::Internal, format!("no random multipart boundary: {e}")))?;
        let boundary: String = random.iter().map(|b| format!("{b:02x}")).collect();
        let json = serde_json::to_vec(doc)
            .map_err(|e| Error::new(ErrorKind::Internal, format!("cannot serialize {id}: {e}")))?;
        let head =
            Bytes::from([format!("--{boundary}\r\nContent-Type: application/json\r\n\r\n").as_bytes(), &json].concat());
        let part_heads: Vec<Bytes> = parts
            .iter()
            .map(|part| {
                Bytes::from(format!(
                    "\r\n--{boundary}\r\nContent-Disposition: attachment; filename=\"{}\"\r\nContent-Type: {}\r\nContent-Length: {}\r\n\r\n",
                    part.name.replace('"', "\\\""),
                    part.content_type.replace(['\r', '\n'], " "),
                    part.length
                ))
            })
            .collect();
        let tail = Bytes::from(format!("\r\n--{boundary}--"));
        let total = head.len() as u64
            + part_heads.iter().map(|h| h.len() as u64).sum::<u64>()
            + parts.iter().map(|p| p.length).sum::<u64>()
            + tail.len() as u64;
        let mut attempt = 0;
        loop {
            attempt += 1;
            // The first failure of the bytes' own source, kept apart from the connection's.
            let source_failure: Arc<Mutex<Option<Error>>> = Arc::new(Mutex::new(None));
            let pairs: Vec<(AttachmentPart, Bytes)> = parts.iter().cloned().zip(part_heads.iter().cloned()).collect();
            let pieces = pairs.into_iter().map({
                let open = open.clone();
                let source_failure = Arc::clone(&source_failure);
                move |(part, part_head)| {
                    let open = open.clone();
                    let source_failure = Arc::clone(&source_failure);
                    let bytes = futures::stream::once(async move { open(part).await }).try_flatten();
                    futures::stream::once(async move { Ok::<Bytes, Error>(part_head) }).chain(bytes).map(move |item| {
                        item.map_err(|err| {
                            let message = err.message().to_owned();
                            if let Ok(mut slot) = source_failure.lock() {
                                slot.get_or_insert(err);
                            }
                            std::io::Error::other(message)
                        })
                    })
                }
            });
            let (head, tail) = (head.clone(), tail.clone());
            let body = futures::stream::once(async move { Ok::<Bytes, std::io::Error>(head) })
                .chain(futures::stream::iter(pieces).flatten())
                .chain(futures::stream::once(async move { Ok(tail) }));
            let mut request = self
                .http
                .put(url.clone())
                .header("accept", "application/json")
                .header("content-type", format!("multipart/related; boundary=\"{boundary}\""))
                .header("content-length", total)
                .body(reqwest::Body::wrap_stream(body));
            if let Some(user) = &self.user {
                request = request.basic_auth(user, self.password.as_deref());
            }
            let outcome = async {
                let response = request.send().await?;
                let status = response.status();
                let bytes = response.bytes().await?;
                Ok::<_, reqwest::Error>((status, bytes))
            }
            .await;
            if let Some(err) = source_failure.lock().ok().and_then(|mut slot| slot.take()) {
                return Err(err);
            }
            match outcome {
                Ok((status, _)) if status.is_success() => return Ok(None),
                Ok((status, _))
                    if (status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS) && attempt < ATTEMPTS =>
                {
                    tokio::time::sleep(backoff(attempt)).await;
                }
                Ok((status, bytes)) if status.is_client_error() => {
                    let value: Value = crate::model::depth::parse_stored(&bytes).unwrap_or(Value::Null);
                    let error = value.get("error").and_then(Value::as_str).unwrap_or("refused").to_owned();
                    let reason = value.get("reason").and_then(Value::as_str).map(str::to_owned);
                    let reason = reason.unwrap_or_else(|| format!("{shown}: {status}"));
                    return Ok(Some(json!({ "id": id, "rev": rev, "error": error, "reason": reason })));
                }
                Ok((status, bytes)) => {
                    let value: Value = crate::model::depth::parse_stored(&bytes).unwrap_or(Value::Null);
                    return Err(status_error(&shown, status, &value));
                }
                Err(err) if attempt < ATTEMPTS => {
                    tracing::debug!(error = %err, request = %shown, "retrying");
                    tokio::time::sleep(backoff(attempt)).await;
                }
                Err(err) => {
                    return Err(Error::new(ErrorKind::Unavailable, format!("{shown}: {err}")).with_source(err));
                }
            }
        }
    }
}

/// The path segments of a document: a design or local document's `_design/` or `_local/` keeps
/// its literal `/` (as CouchDB's clients send it), every other id is one segment.
fn doc_segments<'a>(db: &'a str, id: &'a str) -> Vec<&'a str> {
    if let Some(name) = id.strip_prefix("_design/") {
        return vec![db, "_design", name];
    }
    if let Some(name) = id.strip_prefix("_local/") {
        return vec![db, "_local", name];
    }
    vec![db, id]
}

/// A `_changes` answer as a page: each change's id with every leaf (local documents left out),
/// where the next page starts, and whether this one reached the end.
fn feed_page(value: &Value, since: &Value, limit: usize) -> FeedPage {
    let rows = value.get("results").and_then(Value::as_array).cloned().unwrap_or_default();
    let mut docs = Vec::with_capacity(rows.len());
    for row in &rows {
        let Some(id) = row.get("id").and_then(Value::as_str) else { continue };
        if id.starts_with("_local/") {
            continue;
        }
        let leaves = row
            .get("changes")
            .and_then(Value::as_array)
            .map(|changes| {
                changes.iter().filter_map(|c| c.get("rev").and_then(Value::as_str).map(str::to_owned)).collect()
            })
            .unwrap_or_default();
        docs.push(ChangedDoc { id: id.to_owned(), leaves });
    }
    let last_seq = match value.get("last_seq") {
        Some(seq) if !seq.is_null() => seq.clone(),
        _ => rows.last().and_then(|row| row.get("seq")).cloned().unwrap_or_else(|| since.clone()),
    };
    let pending = value.get("pending").and_then(Value::as_u64);
    let at_end = rows.len() < limit || pending == Some(0);
    FeedPage { docs, last_seq, at_end }
}

/// The array `field` of a JSON object, taken out of it (empty when it is not there).
fn take_array(value: Value, field: &str) -> Vec<Value> {
    match value {
        Value::Object(mut object) => match object.remove(field) {
            Some(Value::Array(items)) => items,
            _ => Vec::new(),
        },
        _ => Vec::new(),
    }
}

/// The pause before attempt `attempt + 1`.
fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(200u64.saturating_mul(1 << attempt.min(5)))
}

/// A URL's user info, percent-decoded.
fn decode(text: &str) -> String {
    percent_encoding::percent_decode_str(text).decode_utf8_lossy().into_owned()
}

/// A URL as shown in messages: without credentials.
pub fn redact(url: &Url) -> String {
    let mut shown = url.clone();
    let _ = shown.set_username("");
    let _ = shown.set_password(None);
    shown.to_string()
}

/// An error for a status CouchDB answered, with its `error` and `reason`.
fn status_error(request: &str, status: StatusCode, body: &Value) -> Error {
    let error = body.get("error").and_then(Value::as_str).unwrap_or("");
    let reason = body.get("reason").and_then(Value::as_str).unwrap_or("");
    let kind = match status {
        StatusCode::UNAUTHORIZED => ErrorKind::Unauthorized,
        StatusCode::FORBIDDEN => ErrorKind::Forbidden,
        StatusCode::NOT_FOUND => ErrorKind::NotFound,
        StatusCode::CONFLICT | StatusCode::PRECONDITION_FAILED => ErrorKind::Conflict,
        StatusCode::BAD_REQUEST => ErrorKind::InvalidInput,
        StatusCode::PAYLOAD_TOO_LARGE => ErrorKind::TooLarge,
        _ => ErrorKind::Unavailable,
    };
    Error::new(kind, format!("{request}: {status} {error} {reason}").trim_end().to_owned())
}

/// The bytes of an inline attachment (`data`, base64), as sent.
pub fn attachment_bytes(attachment: &Value) -> Option<Vec<u8>> {
    attachment.get("data").and_then(Value::as_str).and_then(|data| BASE64.decode(data.as_bytes()).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_leave_the_url_and_names_are_encoded() {
        let client = CouchClient::new("http://admin:p%40ss@127.0.0.1:5984").unwrap();
        assert_eq!(client.describe(), "http://127.0.0.1:5984");
        assert_eq!(client.user.as_deref(), Some("admin"));
        assert_eq!(client.password.as_deref(), Some("p@ss"));
        let url = client.url(&["a/b", "_changes"], &[("since", "0".into())]).unwrap();
        assert_eq!(url.as_str(), "http://127.0.0.1:5984/a%2Fb/_changes?since=0");
        assert!(CouchClient::new("ftp://x").is_err());
    }
}
