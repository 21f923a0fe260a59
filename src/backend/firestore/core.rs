//! The raw Firestore REST v1 calls, over the shared HTTP layer ([`crate::backend::raw::http`]):
//! one pooled client, an access token from `gcp_auth` on every request (cached and refreshed by
//! the provider; the emulator gets the fixed `owner` token), and retries within [`RETRY`]'s
//! budget. Replies with `ABORTED`, `UNAVAILABLE` or `RESOURCE_EXHAUSTED` had no effect and are
//! retried for every call; a write that may have been applied (sent, then no answer, or
//! `DEADLINE_EXCEEDED`/`INTERNAL`) is reported as `OutcomeUnknown` and not retried; a token
//! endpoint that cannot be reached is retried for every call (nothing was sent).

use std::sync::Arc;
use std::time::Duration;

use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use reqwest::Method;
use serde_json::{json, Map, Value};

use super::config::FirestoreConfig;
use super::error::{from_auth, from_reply, SERVICE};
use crate::backend::raw::http::{self, Idempotency, RetryPolicy};
use crate::error::{Error, ErrorKind, Result};

/// The OAuth scope Firestore's REST API needs.
pub const SCOPE: &str = "https://www.googleapis.com/auth/datastore";
/// Everything but RFC 3986 unreserved characters and `:` is escaped in a URL path segment.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~').remove(b':');
/// The database segment keeps the parentheses of `(default)` as Google's own clients send it.
const DATABASE_SEGMENT: &AsciiSet = &SEGMENT.remove(b'(').remove(b')');
/// How calls are retried: a Firestore that stays unavailable is reported within 15 s (plus one
/// request timeout) of the first try.
pub const RETRY: RetryPolicy = RetryPolicy {
    retries: 6,
    min_delay: Duration::from_millis(50),
    max_delay: Duration::from_secs(3),
    budget: Duration::from_secs(15),
};

/// Whether a call may be repeated after a failure that may have reached Firestore.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Call {
    Read,
    Write,
}

impl Call {
    fn idempotency(self) -> Idempotency {
        match self {
            Call::Read => Idempotency::Idempotent,
            Call::Write => Idempotency::NotIdempotent,
        }
    }
}

#[derive(Clone)]
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
    /// The document the collections live under, as a resource name and as a URL: the root
    /// itself, or a database's document of the catalog (see [`FirestoreConfig::parent`]).
    parent_name: String,
    parent_url: String,
    collection: String,
}

impl FirestoreClient {
    pub async fn connect(config: &FirestoreConfig) -> Result<Self> {
        let http = http::client(SERVICE, config.timeout)?;
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
        let client = FirestoreClient {
            http,
            auth,
            parent_name: root_name.clone(),
            parent_url: root_url.clone(),
            root_url,
            root_name,
            collection: config.collection.clone(),
        };
        Ok(match &config.parent {
            Some(parent) => client.below(parent, &config.collection),
            None => client,
        })
    }

    /// A client of the same Firestore database (the same connection pool and credentials) whose
    /// collection is `collection` under the document `parent` (a path below the root).
    pub fn below(&self, parent: &str, collection: &str) -> FirestoreClient {
        let encoded: Vec<String> = parent.split('/').map(|s| utf8_percent_encode(s, SEGMENT).to_string()).collect();
        FirestoreClient {
            http: self.http.clone(),
            auth: self.auth.clone(),
            root_url: self.root_url.clone(),
            root_name: self.root_name.clone(),
            parent_name: format!("{}/{parent}", self.root_name),
            parent_url: format!("{}/{}", self.root_url, encoded.join("/")),
            collection: collection.to_owned(),
        }
    }

    /// The resource name of a document by its path below the root (`{collection}/{id}/…`).
    pub fn root_document_name(&self, path: &str) -> String {
        format!("{}/{path}", self.root_name)
    }

    /// The resource name of a document of the collection.
    pub fn document_name(&self, document_id: &str) -> String {
        format!("{}/{}/{document_id}", self.parent_name, self.collection)
    }

    /// The resource name of a document of another collection beside the collection.
    pub fn name_in(&self, collection: &str, document_id: &str) -> String {
        format!("{}/{collection}/{document_id}", self.parent_name)
    }

    /// The collection of local documents (`_local/…`), beside the data's.
    pub fn local_collection(&self) -> String {
        format!("{}_local", self.collection)
    }

    /// The collection holding the layout marker, beside the data's.
    pub fn meta_collection(&self) -> String {
        format!("{}_meta", self.collection)
    }

    /// The resource name of chunk `n` of a document.
    pub fn chunk_name(&self, document_id: &str, n: usize) -> String {
        format!("{}/{}/{document_id}/{}/{n}", self.parent_name, self.collection, super::codec::CHUNK_COLLECTION)
    }

    pub fn collection(&self) -> &str {
        &self.collection
    }

    /// The document id (last path segment) of a resource name of the collection.
    pub fn document_id_of<'a>(&self, name: &'a str) -> Option<&'a str> {
        name.strip_prefix(&self.parent_name)?.strip_prefix('/')?.strip_prefix(&self.collection)?.strip_prefix('/')
    }

    /// The URL of a method on the database's documents (`commit`, `batchGet`, `batchWrite`).
    pub fn method_url(&self, method: &str) -> String {
        format!("{}:{method}", self.root_url)
    }

    /// The URL of a query method (`runQuery`, `runAggregationQuery`) over the collections under
    /// the parent document: a query's `from` names a collection id, found under this parent only.
    pub fn query_url(&self, method: &str) -> String {
        format!("{}:{method}", self.parent_url)
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
        RETRY.run(SERVICE, doing, || self.attempt(method.clone(), url, body, call, doing)).await
    }

    async fn attempt(&self, method: Method, url: &str, body: Option<&Value>, call: Call, doing: &str) -> Result<Value> {
        // Nothing is sent when the token cannot be had: an unreachable token endpoint is
        // `Unavailable`, so any call may try again.
        let token = self.token(doing).await?;
        let request = self.http.request(method, url).bearer_auth(token);
        let reply = http::send(SERVICE, request, body, call.idempotency(), doing).await?;
        if reply.status.is_success() {
            return Ok(reply.body);
        }
        Err(from_reply(reply.status, &reply.body, call.idempotency(), doing))
    }

    async fn token(&self, doing: &str) -> Result<String> {
        match &self.auth {
            Auth::Emulator => Ok("owner".to_owned()),
            Auth::Google(provider) => {
                Ok(provider.token(&[SCOPE]).await.map_err(|e| from_auth(e, doing))?.as_str().to_owned())
            }
        }
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

/// The largest page the feed, id order and upgrade read at once.
pub(super) const MAX_PAGE: usize = 10_000;

pub(super) fn field_filter(field: &str, op: &str, value: Value) -> Value {
    json!({ "fieldFilter": { "field": { "fieldPath": field }, "op": op, "value": value } })
}

pub(super) fn all_of(filters: Vec<Value>) -> Value {
    if filters.len() == 1 {
        filters.into_iter().next().unwrap_or(Value::Null)
    } else {
        json!({ "compositeFilter": { "op": "AND", "filters": filters } })
    }
}

pub(super) fn select(fields: &[&str]) -> Value {
    json!({ "fields": fields.iter().map(|f| json!({ "fieldPath": f })).collect::<Vec<_>>() })
}

pub(super) fn fields_of(document: &Value) -> &Map<String, Value> {
    static EMPTY: std::sync::OnceLock<Map<String, Value>> = std::sync::OnceLock::new();
    document.get("fields").and_then(Value::as_object).unwrap_or_else(|| EMPTY.get_or_init(Map::new))
}

pub(super) fn text<'a>(document: &'a Value, pointer: &str) -> &'a str {
    document.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}
