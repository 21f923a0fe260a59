//! The raw Firestore REST v1 calls: one pooled `reqwest::Client`, an access token from `gcp_auth`
//! on every request (cached and refreshed by the provider; the emulator gets the fixed `owner`
//! token), and retries with exponential backoff and jitter. Replies with `ABORTED`, `UNAVAILABLE`
//! or `RESOURCE_EXHAUSTED` had no effect and are retried for every call; transport failures
//! (timeouts, resets) are retried only for reads, since a write that timed out may have been
//! applied; a token endpoint that cannot be reached is retried for every call (nothing was sent).

use std::sync::Arc;
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use reqwest::{Method, StatusCode};
use serde_json::Value;

use super::config::FirestoreConfig;
use super::error::{bad_body, from_auth, from_reply, from_transport, is_retryable};
use crate::error::{Error, ErrorKind, Result};

/// The OAuth scope Firestore's REST API needs.
pub const SCOPE: &str = "https://www.googleapis.com/auth/datastore";
/// Everything but RFC 3986 unreserved characters and `:` is escaped in a URL path segment.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~').remove(b':');
/// The database segment keeps the parentheses of `(default)` as Google's own clients send it.
const DATABASE_SEGMENT: &AsciiSet = &SEGMENT.remove(b'(').remove(b')');
/// Retries after the first try.
const RETRIES: usize = 6;

/// Whether a call may be repeated after a transport failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Call {
    Read,
    Write,
}

enum Auth {
    /// The emulator accepts this fixed token and skips security rules.
    Emulator,
    Google(Arc<dyn gcp_auth::TokenProvider>),
}

pub(super) struct FirestoreClient {
    http: reqwest::Client,
    auth: Auth,
    /// `{endpoint}/v1/projects/{p}/databases/{d}/documents`
    root_url: String,
    /// `projects/{p}/databases/{d}/documents`, the prefix of every resource name.
    root_name: String,
    collection: String,
}

/// One failed attempt and whether another may follow.
struct Failed {
    error: Error,
    retry: bool,
}

impl FirestoreClient {
    pub async fn connect(config: &FirestoreConfig) -> Result<Self> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5).min(config.timeout))
            .timeout(config.timeout)
            .pool_idle_timeout(Duration::from_secs(60))
            .user_agent(concat!("agentstore/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| {
                Error::new(ErrorKind::Misconfigured, "cannot build the Firestore HTTP client").with_source(e)
            })?;
        let auth = if config.is_emulator() {
            Auth::Emulator
        } else {
            let provider: Arc<dyn gcp_auth::TokenProvider> = match &config.credentials {
                Some(file) => Arc::new(gcp_auth::CustomServiceAccount::from_file(file).map_err(|e| {
                    Error::new(ErrorKind::Misconfigured, format!("cannot read the service-account key {file:?}"))
                        .with_source(e)
                })?),
                None => gcp_auth::provider().await.map_err(|e| from_auth(e, "connect to Firestore"))?,
            };
            Auth::Google(provider)
        };
        let project = match &config.project {
            Some(project) => project.clone(),
            None => project_from_environment(&auth).await?,
        };
        let root_name = format!("projects/{project}/databases/{}/documents", config.database);
        let root_url = format!(
            "{}/v1/projects/{}/databases/{}/documents",
            config.endpoint,
            utf8_percent_encode(&project, SEGMENT),
            utf8_percent_encode(&config.database, DATABASE_SEGMENT),
        );
        Ok(FirestoreClient { http, auth, root_url, root_name, collection: config.collection.clone() })
    }

    /// The resource name of a document of the collection.
    pub fn document_name(&self, document_id: &str) -> String {
        format!("{}/{}/{document_id}", self.root_name, self.collection)
    }

    /// The resource name of chunk `n` of a document.
    pub fn chunk_name(&self, document_id: &str, n: usize) -> String {
        format!("{}/{}/{document_id}/{}/{n}", self.root_name, self.collection, super::codec::CHUNK_COLLECTION)
    }

    pub fn collection(&self) -> &str {
        &self.collection
    }

    /// The document id (last path segment) of a resource name of the collection.
    pub fn document_id_of<'a>(&self, name: &'a str) -> Option<&'a str> {
        name.strip_prefix(&self.root_name)?.strip_prefix('/')?.strip_prefix(&self.collection)?.strip_prefix('/')
    }

    /// The URL of a method on the database's documents (`commit`, `runQuery`, `batchGet`, …).
    pub fn method_url(&self, method: &str) -> String {
        format!("{}:{method}", self.root_url)
    }

    /// One call, retried as the module doc says. Returns the reply's JSON on success.
    pub async fn call(
        &self,
        method: Method,
        url: &str,
        body: Option<&Value>,
        call: Call,
        doing: &str,
    ) -> Result<Value> {
        let attempt = || async {
            // Nothing was sent yet when the token cannot be had, so any call may try again.
            let token = self
                .token(doing)
                .await
                .map_err(|error| Failed { retry: error.kind() == ErrorKind::Unavailable, error })?;
            let (status, reply) = self.send(method.clone(), url, &token, body, doing).await.map_err(|error| {
                Failed { retry: call == Call::Read && error.kind() == ErrorKind::Unavailable, error }
            })?;
            if status.is_success() {
                return Ok(reply);
            }
            Err(Failed { retry: is_retryable(status, &reply), error: from_reply(status, &reply, doing) })
        };
        attempt
            .retry(
                ExponentialBuilder::default()
                    .with_min_delay(Duration::from_millis(50))
                    .with_max_delay(Duration::from_secs(3))
                    .with_max_times(RETRIES)
                    .with_jitter(),
            )
            .sleep(tokio::time::sleep)
            .when(|failed: &Failed| failed.retry)
            .notify(
                |failed, after| tracing::warn!(error = %failed.error, retry_in = ?after, "Firestore request failed; retrying"),
            )
            .await
            .map_err(|failed| failed.error)
    }

    async fn token(&self, doing: &str) -> Result<String> {
        match &self.auth {
            Auth::Emulator => Ok("owner".to_owned()),
            Auth::Google(provider) => {
                Ok(provider.token(&[SCOPE]).await.map_err(|e| from_auth(e, doing))?.as_str().to_owned())
            }
        }
    }

    async fn send(
        &self,
        method: Method,
        url: &str,
        token: &str,
        body: Option<&Value>,
        doing: &str,
    ) -> Result<(StatusCode, Value)> {
        let mut request =
            self.http.request(method, url).bearer_auth(token).header(reqwest::header::ACCEPT, "application/json");
        if let Some(body) = body {
            // serde_json with arbitrary_precision writes numbers exactly as they were read.
            let bytes = serde_json::to_vec(body).map_err(|e| bad_body(doing, e))?;
            request = request.header(reqwest::header::CONTENT_TYPE, "application/json").body(bytes);
        }
        let response = request.send().await.map_err(|e| from_transport(e, doing))?;
        let status = response.status();
        let bytes = response.bytes().await.map_err(|e| from_transport(e, doing))?;
        let reply = if bytes.is_empty() {
            Value::Null
        } else {
            match serde_json::from_slice(&bytes) {
                Ok(json) => json,
                // Proxies and load balancers answer errors in HTML; keep the status, not the page.
                Err(_) if !status.is_success() => Value::Null,
                Err(e) => return Err(bad_body(doing, e)),
            }
        };
        Ok((status, reply))
    }
}

async fn project_from_environment(auth: &Auth) -> Result<String> {
    for variable in ["GOOGLE_CLOUD_PROJECT", "GCLOUD_PROJECT"] {
        if let Ok(project) = std::env::var(variable) {
            if !project.is_empty() {
                return Ok(project);
            }
        }
    }
    if let Auth::Google(provider) = auth {
        if let Ok(project) = provider.project_id().await {
            return Ok(project.to_string());
        }
    }
    Err(Error::new(
        ErrorKind::Misconfigured,
        "Firestore needs a project: name it in the URL (firestore://PROJECT) or set GOOGLE_CLOUD_PROJECT",
    ))
}
