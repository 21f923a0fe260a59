//! The raw CouchDB HTTP calls. One pooled `reqwest::Client` per backend; every request carries
//! basic auth (pouchdb-server even crashes on some unauthenticated requests). Idempotent reads are
//! retried on `Unavailable` with exponential backoff and jitter; writes never are, since a write
//! that timed out may have been applied.

use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use reqwest::{Method, StatusCode};
use serde_json::Value;

use super::config::CouchConfig;
use super::error::{bad_body, from_status, from_transport};
use crate::error::{Error, ErrorKind, Result};

/// Everything but RFC 3986 unreserved characters is escaped in a path segment, so document ids
/// with `:`, `=`, `/`, `?` or `%` reach CouchDB intact.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// How many times a read is retried after the first try.
const READ_RETRIES: usize = 4;

/// A CouchDB response: status and parsed JSON body (`Null` for an empty body).
pub(super) struct Reply {
    pub status: StatusCode,
    pub body: Value,
}

pub(super) struct CouchClient {
    http: reqwest::Client,
    config: CouchConfig,
    database_url: String,
}

impl CouchClient {
    pub fn new(config: &CouchConfig) -> Result<Self> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5).min(config.timeout))
            .timeout(config.timeout)
            .pool_idle_timeout(Duration::from_secs(60))
            .user_agent(concat!("agentstore/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| Error::new(ErrorKind::Misconfigured, "cannot build the CouchDB HTTP client").with_source(e))?;
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

    /// One request, no retry. `doing` names the operation for error messages.
    pub async fn send(
        &self,
        method: Method,
        url: &str,
        query: &[(&str, String)],
        body: Option<&Value>,
        doing: &str,
    ) -> Result<Reply> {
        let mut request = self.http.request(method, url).header(reqwest::header::ACCEPT, "application/json");
        if !query.is_empty() {
            request = request.query(query);
        }
        if let Some(user) = &self.config.user {
            request = request.basic_auth(user, self.config.password.as_deref());
        }
        if let Some(body) = body {
            // serde_json with arbitrary_precision writes numbers exactly as they were read.
            let bytes = serde_json::to_vec(body).map_err(|e| bad_body(doing, e))?;
            request = request.header(reqwest::header::CONTENT_TYPE, "application/json").body(bytes);
        }
        let response = request.send().await.map_err(|e| from_transport(e, doing))?;
        let status = response.status();
        let bytes = response.bytes().await.map_err(|e| from_transport(e, doing))?;
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).map_err(|e| bad_body(doing, e))?
        };
        Ok(Reply { status, body })
    }

    /// An idempotent request (a read), retried while CouchDB is unavailable.
    pub async fn read(
        &self,
        method: Method,
        url: &str,
        query: &[(&str, String)],
        body: Option<&Value>,
        doing: &str,
    ) -> Result<Reply> {
        let attempt = || async {
            let reply = self.send(method.clone(), url, query, body, doing).await?;
            if reply.status.is_server_error() || reply.status == StatusCode::TOO_MANY_REQUESTS {
                return Err(from_status(reply.status, &reply.body, doing));
            }
            Ok(reply)
        };
        attempt
            .retry(
                ExponentialBuilder::default()
                    .with_min_delay(Duration::from_millis(50))
                    .with_max_delay(Duration::from_secs(2))
                    .with_max_times(READ_RETRIES)
                    .with_jitter(),
            )
            .sleep(tokio::time::sleep)
            .when(|e: &Error| e.kind() == ErrorKind::Unavailable)
            .notify(|e, after| tracing::warn!(error = %e, retry_in = ?after, "CouchDB unavailable; retrying read"))
            .await
    }
}
