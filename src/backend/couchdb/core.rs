//! The raw CouchDB HTTP calls, over the shared HTTP layer ([`crate::backend::raw::http`]): one
//! pooled client per backend, basic auth on every request (pouchdb-server even crashes on some
//! unauthenticated requests). Reads are retried while CouchDB is unavailable, within
//! [`READ_RETRY`]'s budget; writes are sent once, and a write that may have been applied is
//! reported as such (`OutcomeUnknown`), never retried.

use std::time::Duration;

use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use reqwest::{Method, StatusCode};
use serde_json::Value;

use super::config::CouchConfig;
use super::error::status_error;
use crate::backend::raw::http::{self, Idempotency, RawReply, RetryPolicy};
use crate::backend::{BodyError, DesignBody};
use crate::error::Result;

/// The name CouchDB goes by in errors.
pub(super) const SERVICE: &str = "CouchDB";

/// Everything but RFC 3986 unreserved characters is escaped in a path segment, so document ids
/// with `:`, `=`, `/`, `?` or `%` reach CouchDB intact.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// How reads are retried: a CouchDB that stays down is reported within 10 s (plus one request
/// timeout) of the first try.
pub const READ_RETRY: RetryPolicy = RetryPolicy {
    retries: 4,
    min_delay: Duration::from_millis(50),
    max_delay: Duration::from_secs(2),
    budget: Duration::from_secs(10),
};

/// A CouchDB response: status and parsed JSON body (`Null` for an empty body or an error page
/// that is not JSON).
pub(super) type Reply = RawReply;

pub(super) struct CouchClient {
    http: reqwest::Client,
    /// The client of requests passed through ([`CouchClient::pass_through`]): no total timeout,
    /// since an attachment may take minutes to go either way; each request bounds the wait for
    /// its answer itself, and its caller each wait for the next piece of the answer.
    passing: reqwest::Client,
    config: CouchConfig,
    database_url: String,
    /// `database_url` parsed once: a passed request's URL is this one with its path and query
    /// set ([`CouchClient::passed_url`]), not a string parsed again, host and all, on every
    /// request.
    database: reqwest::Url,
    /// The backend's Basic credentials as a header, encoded once rather than per request.
    authorization: Option<reqwest::header::HeaderValue>,
}

/// Whether a client's header may go on to CouchDB: never the client's credentials (the backend
/// authenticates as itself; the CouchDB API has already decided who may make the request), nor
/// the connection's own headers. The body's `Content-Length` and `Content-Encoding` go only with
/// a body `streamed` as the client sent it: a whole body was read and decompressed, and the
/// client sets the length of what it sends.
fn passes_on(name: &str, streamed: bool) -> bool {
    let refused = ["authorization", "cookie", "proxy-authorization", "host", "connection", "transfer-encoding"];
    if refused.iter().any(|refused| name.eq_ignore_ascii_case(refused)) {
        return false;
    }
    streamed || !(name.eq_ignore_ascii_case("content-length") || name.eq_ignore_ascii_case("content-encoding"))
}

impl CouchClient {
    pub fn new(config: &CouchConfig) -> Result<Self> {
        let http = http::client(SERVICE, config.timeout)?;
        let passing = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5).min(config.timeout))
            .pool_idle_timeout(Duration::from_secs(60))
            .user_agent(concat!("agentstore/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| {
                crate::error::Error::new(
                    crate::error::ErrorKind::Misconfigured,
                    format!("cannot build the {SERVICE} HTTP client"),
                )
                .with_source(e)
            })?;
        let database_url = format!("{}{}", config.server, utf8_percent_encode(&config.database, SEGMENT));
        let database = reqwest::Url::parse(&database_url).map_err(|e| {
            crate::error::Error::new(
                crate::error::ErrorKind::Misconfigured,
                format!("the {SERVICE} database URL {database_url:?} is not a URL: {e}"),
            )
        })?;
        let authorization = config.user.as_deref().map(|user| basic_authorization(user, config.password.as_deref()));
        Ok(CouchClient { http, passing, config: config.clone(), database_url, database, authorization })
    }

    /// The URL of a passed request: the database's, with the path below it (as the client
    /// encoded it) and the query. The same URL the string `{database_url}/{path}?{query}` parses
    /// to: the path and query are escaped by the same rules, and the path holds no `?` or `#`
    /// (it is the part of a request's path before its query).
    fn passed_url(&self, path_and_query: &str) -> reqwest::Url {
        let (path, query) = match path_and_query.split_once('?') {
            Some((path, query)) => (path, Some(query)),
            None => (path_and_query, None),
        };
        let mut url = self.database.clone();
        if !path.is_empty() {
            let below = format!("{}/{path}", url.path());
            url.set_path(&below);
        }
        url.set_query(query);
        url
    }

    /// The URL a request to `url` goes to, made from the database's parsed URL when `url` is
    /// one below it (what [`CouchClient::url`] makes), as a passed request's is
    /// ([`CouchClient::passed_url`]): reqwest given the string would parse it again, host, IDNA
    /// checks and all, on every request (5% of a data-store create's instructions, issue 38).
    /// `None` for any other URL (the server's own endpoints), which reqwest parses.
    fn url_below_database(&self, url: &str) -> Option<reqwest::Url> {
        let rest = url.strip_prefix(self.database_url.as_str())?;
        let below = match rest.strip_prefix('/') {
            None if rest.is_empty() => "",
            Some(below) if !below.is_empty() && !below.contains(['?', '#']) => below,
            _ => return None,
        };
        Some(self.passed_url(below))
    }

    /// A request of `method` to `url` on the client `http`, its URL parsed once
    /// ([`CouchClient::url_below_database`]) where it can be.
    fn request_to(&self, http: &reqwest::Client, method: Method, url: &str) -> reqwest::RequestBuilder {
        match self.url_below_database(url) {
            Some(parsed) => http.request(method, parsed),
            None => http.request(method, url),
        }
    }

    /// `request` with the backend's credentials, if it has any.
    fn authorized(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.authorization {
            Some(value) => request.header(reqwest::header::AUTHORIZATION, value.clone()),
            None => request,
        }
    }

    /// `{server}/{database}` plus escaped path segments.
    pub fn url(&self, segments: &[&str]) -> String {
        let mut url = self.database_url.clone();
        for segment in segments {
            url.push('/');
            url.extend(utf8_percent_encode(segment, SEGMENT));
        }
        url
    }

    /// A write, sent once. `doing` names the operation for error messages. A reply that says the
    /// server failed (5xx, 429) is an error here, classified for a write: it may say the write
    /// was not applied (`Unavailable`) or that nobody knows (`OutcomeUnknown`).
    pub async fn send(
        &self,
        method: Method,
        url: &str,
        query: &[(&str, String)],
        body: Option<&Value>,
        doing: &str,
    ) -> Result<Reply> {
        self.attempt(method, url, query, body, Idempotency::NotIdempotent, doing).await
    }

    /// An idempotent request (a read, or creating an index), retried while CouchDB is
    /// unavailable.
    pub async fn read(
        &self,
        method: Method,
        url: &str,
        query: &[(&str, String)],
        body: Option<&Value>,
        doing: &str,
    ) -> Result<Reply> {
        READ_RETRY
            .run(SERVICE, doing, || self.attempt(method.clone(), url, query, body, Idempotency::Idempotent, doing))
            .await
    }

    /// [`CouchClient::read`] of a successful answer whose body the caller reads itself (a page
    /// of documents read into its own types, not a tree of values). Any other status is an error
    /// here, made from the body as [`CouchClient::read`]'s callers make theirs.
    pub async fn read_text(&self, url: &str, query: &[(&str, String)], doing: &str) -> Result<bytes::Bytes> {
        READ_RETRY
            .run(SERVICE, doing, || async {
                let mut request = self.request_to(&self.http, Method::GET, url);
                if !query.is_empty() {
                    request = request.query(query);
                }
                let request = self.authorized(request);
                let (status, bytes) =
                    http::send_for_text(SERVICE, request, None, Idempotency::Idempotent, doing).await?;
                if status.is_success() {
                    return Ok(bytes);
                }
                let reply = http::reply_of(SERVICE, status, &bytes, doing)?;
                if status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS {
                    return Err(status_error(status, &reply.body, Idempotency::Idempotent, doing));
                }
                Err(super::error::from_status(status, &reply.body, doing))
            })
            .await
    }

    /// `{server}/` plus escaped path segments (server-level endpoints such as `_all_dbs`).
    pub fn server_url(&self, segments: &[&str]) -> String {
        let mut url = self.config.server.as_str().trim_end_matches('/').to_owned();
        for segment in segments {
            url.push('/');
            url.extend(utf8_percent_encode(segment, SEGMENT));
        }
        url
    }

    /// How long a request passed through waits for its answer once its body is sent, and then
    /// for each piece of the answer's body: the backend URL's `timeout_secs`.
    pub fn pass_through_timeout(&self) -> Duration {
        self.config.timeout
    }

    /// How long a passed request that may build an index before answering (a view, `_find`)
    /// waits for its answer to begin: the backend URL's `query_timeout_secs`.
    pub fn query_timeout(&self) -> Duration {
        self.config.query_timeout
    }

    /// Sends a request as a client made it, for [`super::design`]. A whole body is sent again
    /// when a read is retried; a streamed one is sent once, as it arrives. The answer must begin
    /// within `answer_within` of the body's end (not of the request's start: an upload may take
    /// long), and is returned as soon as its head arrives.
    pub async fn pass_through(
        &self,
        method: Method,
        path_and_query: &str,
        headers: &[(String, String)],
        body: DesignBody,
        answer_within: Duration,
        doing: &str,
    ) -> Result<reqwest::Response> {
        let url = self.passed_url(path_and_query);
        let idempotency = if matches!(method, Method::GET | Method::HEAD) {
            Idempotency::Idempotent
        } else {
            Idempotency::NotIdempotent
        };
        let build = |streamed: bool| {
            let mut request = self.passing.request(method.clone(), url.clone());
            for (name, value) in headers.iter().filter(|(name, _)| passes_on(name, streamed)) {
                request = request.header(name.as_str(), value.as_str());
            }
            self.authorized(request)
        };
        let whole = match body {
            DesignBody::Whole(whole) => whole,
            DesignBody::Streamed(stream) => {
                let (sent, body_sent) = tokio::sync::oneshot::channel();
                let stream = NoticeEnd { inner: stream, sent: Some(sent) };
                let request = build(true).body(reqwest::Body::wrap_stream(stream));
                return self.answer_of(request.send(), body_sent, answer_within, idempotency, doing).await;
            }
        };
        let attempt = || async {
            let (sent, body_sent) = tokio::sync::oneshot::channel();
            let _ = sent.send(());
            let request = build(false).body(whole.clone());
            let response = self.answer_of(request.send(), body_sent, answer_within, idempotency, doing).await?;
            let status = response.status();
            if idempotency == Idempotency::Idempotent
                && (status == StatusCode::SERVICE_UNAVAILABLE || status == StatusCode::TOO_MANY_REQUESTS)
            {
                return Err(status_error(status, &Value::Null, idempotency, doing));
            }
            Ok(response)
        };
        match idempotency {
            Idempotency::Idempotent => READ_RETRY.run(SERVICE, doing, attempt).await,
            Idempotency::NotIdempotent => attempt().await,
        }
    }

    /// The answer to a request being sent, which must begin within `timeout` of its body's end
    /// (`body_sent` resolves then, or fails when the body was dropped unfinished).
    async fn answer_of(
        &self,
        sending: impl std::future::Future<Output = reqwest::Result<reqwest::Response>>,
        body_sent: tokio::sync::oneshot::Receiver<()>,
        timeout: Duration,
        idempotency: Idempotency,
        doing: &str,
    ) -> Result<reqwest::Response> {
        let deadline = async move {
            let _ = body_sent.await;
            tokio::time::sleep(timeout).await;
        };
        tokio::select! {
            answer = sending => answer.map_err(|e| http::transport_error(SERVICE, e, idempotency, doing)),
            () = deadline => Err(no_answer(idempotency, doing, timeout)),
        }
    }

    async fn attempt(
        &self,
        method: Method,
        url: &str,
        query: &[(&str, String)],
        body: Option<&Value>,
        idempotency: Idempotency,
        doing: &str,
    ) -> Result<Reply> {
        let mut request = self.request_to(&self.http, method, url);
        if !query.is_empty() {
            request = request.query(query);
        }
        let request = self.authorized(request);
        let reply = http::send(SERVICE, request, body, idempotency, doing).await?;
        if reply.status.is_server_error() || reply.status == StatusCode::TOO_MANY_REQUESTS {
            return Err(status_error(reply.status, &reply.body, idempotency, doing));
        }
        Ok(reply)
    }
}

/// `Authorization: Basic …` of `user` and `password`, marked sensitive (kept out of debug
/// output), as reqwest's `basic_auth` makes it.
fn basic_authorization(user: &str, password: Option<&str>) -> reqwest::header::HeaderValue {
    use base64::Engine as _;
    let pair = format!("{user}:{}", password.unwrap_or_default());
    let encoded = base64::engine::general_purpose::STANDARD.encode(pair);
    let mut value = reqwest::header::HeaderValue::from_str(&format!("Basic {encoded}"))
        .unwrap_or_else(|_| reqwest::header::HeaderValue::from_static("Basic"));
    value.set_sensitive(true);
    value
}

/// A request passed through whose answer did not begin in time.
fn no_answer(idempotency: Idempotency, doing: &str, timeout: Duration) -> crate::error::Error {
    let (kind, applied) = match idempotency {
        Idempotency::Idempotent => (crate::error::ErrorKind::Unavailable, ""),
        Idempotency::NotIdempotent => (crate::error::ErrorKind::OutcomeUnknown, "; it may have been applied"),
    };
    crate::error::Error::new(
        kind,
        format!(
            "{SERVICE} did not answer within {} s of the request while trying to {doing}{applied}",
            timeout.as_secs()
        ),
    )
}

/// A streamed request body that tells when it has been sent whole.
struct NoticeEnd {
    inner: futures::stream::BoxStream<'static, std::result::Result<bytes::Bytes, BodyError>>,
    sent: Option<tokio::sync::oneshot::Sender<()>>,
}

impl futures::Stream for NoticeEnd {
    type Item = std::result::Result<bytes::Bytes, BodyError>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let next = self.inner.as_mut().poll_next(cx);
        if let std::task::Poll::Ready(None) = next {
            if let Some(sent) = self.sent.take() {
                let _ = sent.send(());
            }
        }
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_passed_url_is_the_string_parsed() {
        let config = CouchConfig::parse("couchdb+http://u:p@127.0.0.1:5984/my%24db").expect("a backend URL");
        let client = CouchClient::new(&config).expect("a client");
        for path_and_query in [
            "",
            "?q=1",
            "doc",
            "doc%2Fwith%2Fslashes?rev=1-a&x=%22y%22",
            "_design/d/_view/v?key=%22t1%22&reduce=false",
            "d%C3%A9j%C3%A0 vu/att name.txt",
            "a/b/../c",
        ] {
            let parsed = match path_and_query {
                "" => client.database_url.clone(),
                query if query.starts_with('?') => format!("{}{query}", client.database_url),
                path => format!("{}/{path}", client.database_url),
            };
            let parsed = reqwest::Url::parse(&parsed).expect("a URL");
            assert_eq!(client.passed_url(path_and_query), parsed, "{path_and_query}");
        }
    }

    #[test]
    fn a_url_below_the_database_is_the_string_parsed() {
        let config = CouchConfig::parse("couchdb+http://u:p@127.0.0.1:5984/my%24db").expect("a backend URL");
        let client = CouchClient::new(&config).expect("a client");
        for segments in [
            vec![],
            vec!["doc"],
            vec!["user_1:ns:a2V5LzE="],
            vec!["d\u{e9}j\u{e0} vu", "att name.txt"],
            vec!["_design/d", "x?y#z"],
            vec!["_bulk_get"],
            vec!["%2F.."],
        ] {
            let url = client.url(&segments);
            let parsed = reqwest::Url::parse(&url).expect("a URL");
            assert_eq!(client.url_below_database(&url), Some(parsed), "{segments:?}");
        }
        let server = client.server_url(&["_session"]);
        assert_eq!(client.url_below_database(&server), None, "not below the database");
        assert_eq!(client.url_below_database(&format!("{}/", client.database_url)), None);
        assert_eq!(client.url_below_database(&format!("{}x", client.database_url)), None, "another database");
    }

    #[test]
    fn the_credentials_header_is_basic_of_user_and_password() {
        let value = basic_authorization("admin", Some("pass:word"));
        assert_eq!(value.to_str().ok(), Some("Basic YWRtaW46cGFzczp3b3Jk"));
        assert!(value.is_sensitive());
    }

    #[test]
    fn client_credentials_never_pass_on() {
        for streamed in [false, true] {
            for refused in ["authorization", "Authorization", "COOKIE", "proxy-authorization", "host", "connection"] {
                assert!(!passes_on(refused, streamed), "{refused}");
            }
            for passed in ["content-type", "accept", "if-match", "if-none-match", "range", "if-range", "content-md5"] {
                assert!(passes_on(passed, streamed), "{passed}");
            }
        }
        for framing in ["content-length", "Content-Encoding"] {
            assert!(!passes_on(framing, false), "{framing} of a body read whole and decompressed");
            assert!(passes_on(framing, true), "{framing} of a body streamed as it came");
        }
    }
}
