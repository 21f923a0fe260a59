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
    config: CouchConfig,
    database_url: String,
}

/// Whether a client's header may go on to CouchDB: never the client's credentials (the backend
/// authenticates as itself; the CouchDB API has already decided who may make the request), nor
/// the connection's own headers.
fn passes_on(name: &str) -> bool {
    !["authorization", "cookie", "proxy-authorization", "host", "content-length", "connection", "transfer-encoding"]
        .iter()
        .any(|refused| name.eq_ignore_ascii_case(refused))
}

impl CouchClient {
    pub fn new(config: &CouchConfig) -> Result<Self> {
        let http = http::client(SERVICE, config.timeout)?;
        let database_url = format!("{}{}", config.server, utf8_percent_encode(&config.database, SEGMENT));
        Ok(CouchClient { http, config: config.clone(), database_url })
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
                let mut request = self.http.request(Method::GET, url);
                if !query.is_empty() {
                    request = request.query(query);
                }
                if let Some(user) = &self.config.user {
                    request = request.basic_auth(user, self.config.password.as_deref());
                }
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

    /// A request passed through below the database (design documents, or any path of a database
    /// whose requests are all forwarded): `path_and_query` is already percent-encoded, and empty
    /// (or a bare `?query`) for the database itself. The reply is returned unread, whatever its
    /// status, so its body can be streamed; idempotent requests are retried while CouchDB is
    /// unreachable or answers 503/429, others are sent once. The client's credentials
    /// (`Authorization`, `Cookie`) never go through: ours replace them.
    pub async fn pass_through(
        &self,
        method: Method,
        path_and_query: &str,
        headers: &[(String, String)],
        body: bytes::Bytes,
        doing: &str,
    ) -> Result<reqwest::Response> {
        let url = match path_and_query {
            "" => self.database_url.clone(),
            query if query.starts_with('?') => format!("{}{query}", self.database_url),
            path => format!("{}/{path}", self.database_url),
        };
        let idempotency = if matches!(method, Method::GET | Method::HEAD) {
            Idempotency::Idempotent
        } else {
            Idempotency::NotIdempotent
        };
        let attempt = || async {
            let mut request = self.http.request(method.clone(), &url).body(body.clone());
            for (name, value) in headers.iter().filter(|(name, _)| passes_on(name)) {
                request = request.header(name.as_str(), value.as_str());
            }
            if let Some(user) = &self.config.user {
                request = request.basic_auth(user, self.config.password.as_deref());
            }
            let response = request.send().await.map_err(|e| http::transport_error(SERVICE, e, idempotency, doing))?;
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

    async fn attempt(
        &self,
        method: Method,
        url: &str,
        query: &[(&str, String)],
        body: Option<&Value>,
        idempotency: Idempotency,
        doing: &str,
    ) -> Result<Reply> {
        let mut request = self.http.request(method, url);
        if !query.is_empty() {
            request = request.query(query);
        }
        if let Some(user) = &self.config.user {
            request = request.basic_auth(user, self.config.password.as_deref());
        }
        let reply = http::send(SERVICE, request, body, idempotency, doing).await?;
        if reply.status.is_server_error() || reply.status == StatusCode::TOO_MANY_REQUESTS {
            return Err(status_error(reply.status, &reply.body, idempotency, doing));
        }
        Ok(reply)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_credentials_never_pass_on() {
        for refused in ["authorization", "Authorization", "COOKIE", "proxy-authorization", "host", "content-length"] {
            assert!(!passes_on(refused), "{refused}");
        }
        for passed in ["content-type", "accept", "if-match", "if-none-match"] {
            assert!(passes_on(passed), "{passed}");
        }
    }
}
