//! Request bodies and query parameters as CouchDB clients send them.
//!
//! Bodies may be gzip-compressed (`Content-Encoding: gzip`: the IBM Cloudant SDKs and couchbackup
//! compress every body) or chunked. Each is read within the request limit, decompressed within
//! the same limit (a small gzip body must not inflate into gigabytes), and counted against a
//! server-wide budget of body bytes held at once, so concurrent large requests wait instead of
//! exhausting memory. Query parameters follow CouchDB's conventions: keys of `_all_docs` are
//! JSON (`key="a"`), booleans are `true`/`false`.

use std::io::Read;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, StatusCode};
use futures::StreamExt;
use serde_json::Value;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::error::{CouchError, CouchResult};

/// Budget permits are counted in units of this many bytes (a semaphore counts in `u32`).
const PERMIT_BYTES: usize = 1024;
/// A parsed JSON tree costs several times its text (every number a heap string under
/// `arbitrary_precision`, every object an `IndexMap`); the budget reserves this much per byte.
const TREE_FACTOR: usize = 4;

/// The request-size limit and the server-wide budget of body bytes.
pub struct Bodies {
    limit: usize,
    budget: Arc<Semaphore>,
    budget_permits: u32,
}

/// A parsed body, holding its share of the budget until dropped.
pub struct JsonBody {
    pub value: Value,
    _share: Option<OwnedSemaphorePermit>,
}

impl Bodies {
    /// Bodies of up to `limit` bytes (after decompression); `budget` bytes of them at once.
    pub fn new(limit: usize, budget: usize) -> Self {
        let budget_permits = u32::try_from(budget.div_ceil(PERMIT_BYTES).max(1)).unwrap_or(u32::MAX);
        Bodies { limit, budget: Arc::new(Semaphore::new(budget_permits as usize)), budget_permits }
    }

    /// Reads and parses a JSON body. An empty body is `None`.
    pub async fn read_json(&self, headers: &HeaderMap, body: Body) -> CouchResult<Option<JsonBody>> {
        let (bytes, share) = self.read_decoded(headers, body, TREE_FACTOR).await?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(None);
        }
        let value =
            serde_json::from_slice(&bytes).map_err(|e| CouchError::bad_request(format!("invalid UTF-8 JSON: {e}")))?;
        Ok(Some(JsonBody { value, _share: Some(share) }))
    }

    /// Reads a JSON body that must be an object.
    pub async fn read_object(&self, headers: &HeaderMap, body: Body) -> CouchResult<JsonBody> {
        match self.read_json(headers, body).await? {
            Some(body) if body.value.is_object() => Ok(body),
            Some(_) => Err(CouchError::bad_request("Request body must be a JSON object")),
            None => Err(CouchError::bad_request("Request body must be a JSON object")),
        }
    }
}

impl Bodies {
    /// Reads a body as bytes, decompressed, holding its share of the budget (for a request passed
    /// on unparsed).
    pub async fn read_bytes(&self, headers: &HeaderMap, body: Body) -> CouchResult<(Bytes, OwnedSemaphorePermit)> {
        self.read_decoded(headers, body, 1).await
    }

    /// Reads a body within the limit and decompresses it within the same limit, first taking
    /// `factor` times its size from the budget (the declared size, or the limit when none is).
    async fn read_decoded(
        &self,
        headers: &HeaderMap,
        body: Body,
        factor: usize,
    ) -> CouchResult<(Bytes, OwnedSemaphorePermit)> {
        let declared = declared_length(headers)?;
        if let Some(length) = declared.filter(|&length| length > self.limit) {
            return Err(too_large(length, self.limit));
        }
        let wanted = declared.unwrap_or(self.limit).saturating_mul(factor);
        let permits = u32::try_from(wanted.div_ceil(PERMIT_BYTES).max(1)).unwrap_or(u32::MAX).min(self.budget_permits);
        let share = Arc::clone(&self.budget)
            .acquire_many_owned(permits)
            .await
            .map_err(|_| CouchError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "the server is stopping"))?;
        let raw = read_limited(body, self.limit).await?;
        let bytes = match content_encoding(headers)? {
            Encoding::Identity => raw,
            Encoding::Gzip => gunzip(&raw, self.limit)?,
        };
        Ok((bytes, share))
    }

    /// Reads the raw (decompressed) body of a `POST /_session` login, form-encoded or JSON; at
    /// most 64 KiB.
    pub async fn read_login(&self, headers: &HeaderMap, body: Body) -> CouchResult<Bytes> {
        const LOGIN_LIMIT: usize = 64 * 1024;
        let raw = read_limited(body, LOGIN_LIMIT).await?;
        match content_encoding(headers)? {
            Encoding::Identity => Ok(raw),
            Encoding::Gzip => gunzip(&raw, LOGIN_LIMIT),
        }
    }
}

enum Encoding {
    Identity,
    Gzip,
}

fn content_encoding(headers: &HeaderMap) -> CouchResult<Encoding> {
    match headers.get(header::CONTENT_ENCODING).map(|v| v.to_str().unwrap_or("").trim().to_ascii_lowercase()) {
        None => Ok(Encoding::Identity),
        Some(e) if e.is_empty() || e == "identity" => Ok(Encoding::Identity),
        Some(e) if e == "gzip" || e == "x-gzip" => Ok(Encoding::Gzip),
        Some(other) => Err(CouchError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "bad_content_type",
            format!("Content-Encoding {other:?} is not supported; send gzip or no encoding"),
        )),
    }
}

/// Whether the request says its body is JSON (CouchDB demands it where it validates the type).
pub fn require_json_content_type(headers: &HeaderMap) -> CouchResult<()> {
    let is_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|mime| mime.trim().eq_ignore_ascii_case("application/json"));
    if is_json {
        Ok(())
    } else {
        Err(CouchError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "bad_content_type",
            "Content-Type must be application/json",
        ))
    }
}

fn declared_length(headers: &HeaderMap) -> CouchResult<Option<usize>> {
    match headers.get(header::CONTENT_LENGTH) {
        None => Ok(None),
        Some(value) => value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .map(Some)
            .ok_or_else(|| CouchError::bad_request("invalid Content-Length")),
    }
}

fn too_large(length: usize, limit: usize) -> CouchError {
    CouchError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "too_large",
        format!("the request body is {length} bytes or more; the limit is {limit} bytes"),
    )
}

async fn read_limited(body: Body, limit: usize) -> CouchResult<Bytes> {
    let mut stream = body.into_data_stream();
    let mut collected: Vec<u8> = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| CouchError::bad_request(format!("could not read the request body: {e}")))?;
        if collected.len() + chunk.len() > limit {
            return Err(too_large(collected.len() + chunk.len(), limit));
        }
        collected.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(collected))
}

/// Decompresses a gzip body, refusing to produce more than `limit` bytes.
fn gunzip(raw: &[u8], limit: usize) -> CouchResult<Bytes> {
    let mut out = Vec::new();
    let decoder = flate2::read::MultiGzDecoder::new(raw);
    let read = decoder
        .take(limit as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| CouchError::bad_request(format!("the gzip-compressed body is not valid gzip: {e}")))?;
    if read > limit {
        return Err(too_large(read, limit));
    }
    Ok(Bytes::from(out))
}

/// CouchDB's boolean query parameters: `true` or `false`.
pub fn bool_param(name: &str, value: Option<&str>, default: bool) -> CouchResult<bool> {
    match value {
        None => Ok(default),
        Some("true") => Ok(true),
        Some("false") => Ok(false),
        Some(other) => Err(CouchError::bad_request(format!("Invalid boolean parameter: {name}={other:?}"))),
    }
}

/// A whole-number query parameter.
pub fn integer_param(name: &str, value: Option<&str>) -> CouchResult<Option<u64>> {
    value
        .map(|text| {
            text.parse::<u64>().map_err(|_| {
                CouchError::bad_request(format!("Invalid value for {name}: {text:?}; must be a non-negative integer"))
            })
        })
        .transpose()
}

/// A JSON-encoded query parameter (`key="a"`, `keys=["a","b"]`).
pub fn json_param(name: &str, value: Option<&str>) -> CouchResult<Option<Value>> {
    value
        .map(|text| {
            serde_json::from_str(text)
                .map_err(|_| CouchError::bad_request(format!("Invalid JSON in the {name} parameter: {text:?}")))
        })
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::write::GzEncoder;
    use std::io::Write;

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut encoder = GzEncoder::new(Vec::new(), flate2::Compression::default());
        encoder.write_all(bytes).unwrap();
        encoder.finish().unwrap()
    }

    #[tokio::test]
    async fn gzip_bodies_are_decompressed() {
        let bodies = Bodies::new(1024, 4096);
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_ENCODING, "gzip".parse().unwrap());
        let body = bodies.read_json(&headers, Body::from(gzip(br#"{"a":1}"#))).await.unwrap().unwrap();
        assert_eq!(body.value, serde_json::json!({"a": 1}));
    }

    #[tokio::test]
    async fn a_gzip_bomb_is_refused_by_its_inflated_size() {
        let limit = 64 * 1024;
        let bodies = Bodies::new(limit, 4 * limit);
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_ENCODING, "gzip".parse().unwrap());
        let bomb = gzip(&vec![b' '; 16 << 20]);
        assert!(bomb.len() < limit, "the compressed body ({} bytes) fits the limit", bomb.len());
        let err = bodies.read_json(&headers, Body::from(bomb)).await.err().unwrap();
        assert_eq!(err.status, StatusCode::PAYLOAD_TOO_LARGE);
    }

    #[tokio::test]
    async fn an_oversized_body_is_refused_before_it_is_read() {
        let bodies = Bodies::new(8, 4096);
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, "100".parse().unwrap());
        let err = bodies.read_json(&headers, Body::from(vec![b'1'; 100])).await.err().unwrap();
        assert_eq!(err.status, StatusCode::PAYLOAD_TOO_LARGE);
    }

    #[test]
    fn parameters_follow_couchdb_conventions() {
        assert!(bool_param("descending", Some("true"), false).unwrap());
        assert!(bool_param("descending", Some("yes"), false).is_err());
        assert_eq!(json_param("key", Some("\"a\"")).unwrap(), Some(Value::from("a")));
        assert!(json_param("key", Some("a")).is_err());
        assert_eq!(integer_param("limit", Some("5")).unwrap(), Some(5));
        assert!(integer_param("limit", Some("-1")).is_err());
    }
}
