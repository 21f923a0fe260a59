//! Request bodies and query parameters as CouchDB clients send them.
//!
//! Bodies may be gzip-compressed (`Content-Encoding: gzip`: the IBM Cloudant SDKs and couchbackup
//! compress every body) or chunked. Each is read within its endpoint's limit ([`EndpointLimit`]:
//! the router gives the query endpoints a small one, the bulk and document endpoints
//! `couchdb_max_request_bytes`), and its *decompressed* size is held to the same limit. Two
//! server-wide budgets bound the memory of bodies at once, as on the REST face: the raw bytes
//! being read, then (taken in that order, so waiting for the second never blocks a holder of it)
//! the decompressed bytes plus the estimated size of the parsed tree. The estimate comes from a
//! byte scan of the text, or where that scan is unsure a streaming serde pass (the REST face's
//! measure too: `crate::server::tree_size::measure_body`), before any tree is built; a gzip body is first inflated into a counter, not memory,
//! so its size is known before memory is taken for it. A body whose tree alone would exceed the
//! parse budget is refused (413). Query parameters follow CouchDB's conventions: keys of
//! `_all_docs` are JSON (`key="a"`), booleans are `true`/`false`.

use std::io::Read;

use axum::body::{Body, Bytes, HttpBody as _};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use futures::StreamExt;
use serde_json::Value;
use tokio::sync::OwnedSemaphorePermit;

use super::error::{CouchError, CouchResult};
use crate::config::Settings;
use crate::model::depth::MAX_REQUEST_DEPTH;
use crate::server::tree_size::measure_body;
use crate::server::ByteBudget;

/// The body limit of one group of endpoints, and the setting that sets it (named in the 413).
#[derive(Debug, Clone, Copy)]
pub struct EndpointLimit {
    pub bytes: usize,
    pub setting: &'static str,
}

tokio::task_local! {
    /// The limit of the endpoint whose handler is running (set by [`limit_bodies`]).
    static ENDPOINT_LIMIT: EndpointLimit;
}

/// Router middleware (`route_layer`): bodies read by the handlers it wraps are held to `limit`
/// instead of the general request limit.
pub async fn limit_bodies(State(limit): State<EndpointLimit>, request: Request, next: Next) -> Response {
    ENDPOINT_LIMIT.scope(limit, next.run(request)).await
}

/// The request limits and the server-wide budgets of body memory.
pub struct Bodies {
    /// The limit of endpoints the router gives none: `couchdb_max_request_bytes`.
    default_limit: EndpointLimit,
    login_limit: EndpointLimit,
    /// The limit of the query endpoints' bodies ([`Bodies::query_limit`]).
    query_limit: EndpointLimit,
    /// Raw body bytes being read.
    raw: ByteBudget,
    /// Decompressed bytes and estimated parsed trees.
    decoded: ByteBudget,
    /// A single body's tree may not be estimated above this (the parse budget).
    max_tree_bytes: usize,
}

/// A body's shares of the budgets, held until dropped.
pub struct BodyShare {
    _raw: OwnedSemaphorePermit,
    _decoded: Option<OwnedSemaphorePermit>,
}

/// A parsed body, holding its share of the budgets until dropped.
pub struct JsonBody {
    pub value: Value,
    _share: Option<BodyShare>,
}

impl Bodies {
    /// Bodies of up to `limit` bytes (after decompression); `budget` raw bytes of them being read
    /// at once, and as much again of decompressed bytes and parsed trees.
    #[cfg(test)]
    pub fn new(limit: usize, budget: usize) -> Self {
        Bodies {
            default_limit: EndpointLimit { bytes: limit, setting: "couchdb_max_request_bytes" },
            login_limit: EndpointLimit { bytes: 64 << 10, setting: "couchdb_max_login_bytes" },
            query_limit: EndpointLimit { bytes: limit, setting: "couchdb_max_query_bytes" },
            raw: ByteBudget::new(budget),
            decoded: ByteBudget::new(budget),
            max_tree_bytes: budget,
        }
    }

    /// The limits and budgets `settings` give.
    pub fn from_settings(settings: &Settings) -> Self {
        Bodies {
            default_limit: EndpointLimit {
                bytes: settings.couchdb_request_limit(),
                setting: "couchdb_max_request_bytes",
            },
            login_limit: EndpointLimit { bytes: settings.couchdb_max_login_bytes, setting: "couchdb_max_login_bytes" },
            query_limit: Self::query_limit(settings),
            raw: ByteBudget::new(settings.inflight_body_budget()),
            decoded: ByteBudget::new(settings.max_inflight_parse_bytes),
            max_tree_bytes: settings.max_inflight_parse_bytes,
        }
    }

    /// The limit of the query endpoints' bodies `settings` give (never above the general one).
    pub fn query_limit(settings: &Settings) -> EndpointLimit {
        EndpointLimit {
            bytes: settings.couchdb_max_query_bytes.min(settings.couchdb_request_limit()),
            setting: "couchdb_max_query_bytes",
        }
    }

    /// The limit of the query endpoints' bodies these bodies are read with
    /// (`couchdb_max_query_bytes`), for a router's [`limit_bodies`] layer.
    pub fn query_endpoint_limit(&self) -> EndpointLimit {
        self.query_limit
    }

    /// The limit in force for the running handler.
    fn limit(&self) -> EndpointLimit {
        ENDPOINT_LIMIT.try_with(|limit| *limit).unwrap_or(self.default_limit)
    }

    /// Reads and parses a JSON body. An empty body is `None`.
    pub async fn read_json(&self, headers: &HeaderMap, body: Body) -> CouchResult<Option<JsonBody>> {
        let (bytes, raw) = self.read_raw(headers, body, self.limit()).await?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(None);
        }
        let invalid = |e: serde_json::Error| CouchError::bad_request(format!("invalid UTF-8 JSON: {e}"));
        // The tree's cost, measured before the tree exists.
        let measured = measure_body(&bytes, MAX_REQUEST_DEPTH, self.max_tree_bytes).map_err(invalid)?;
        let tree = measured.tree_bytes;
        if tree > self.max_tree_bytes {
            return Err(CouchError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "too_large",
                format!(
                    "the request body would take about {tree} bytes parsed; a body may take at most {} \
                     (max_inflight_parse_bytes)",
                    self.max_tree_bytes
                ),
            ));
        }
        let decoded_extra = if bytes.len() > raw.compressed { bytes.len() } else { 0 };
        let decoded = self.decoded.take(tree.saturating_add(decoded_extra)).await?;
        let value = measured.parse().map_err(invalid)?;
        Ok(Some(JsonBody { value, _share: Some(BodyShare { _raw: raw.share, _decoded: Some(decoded) }) }))
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

/// A raw body's share of the raw budget and its compressed size.
struct RawShare {
    share: OwnedSemaphorePermit,
    compressed: usize,
}

impl Bodies {
    /// Reads a body as bytes, decompressed, holding its share of the budgets (for a request passed
    /// on unparsed).
    pub async fn read_bytes(&self, headers: &HeaderMap, body: Body) -> CouchResult<(Bytes, BodyShare)> {
        let (bytes, raw) = self.read_raw(headers, body, self.limit()).await?;
        let decoded = if bytes.len() > raw.compressed { Some(self.decoded.take(bytes.len()).await?) } else { None };
        Ok((bytes, BodyShare { _raw: raw.share, _decoded: decoded }))
    }

    /// Reads a body within `limit` and decompresses it within the same limit, first taking its
    /// size from the raw budget (the declared size, or the limit when none is). A gzip body is
    /// inflated twice: into a counter, then (within the limit, its size now known and taken from
    /// the decoded budget by the caller) into memory.
    async fn read_raw(&self, headers: &HeaderMap, body: Body, limit: EndpointLimit) -> CouchResult<(Bytes, RawShare)> {
        let encoding = content_encoding(headers)?;
        let declared = declared_length(headers)?;
        if let Some(length) = declared.filter(|&length| length > limit.bytes) {
            return Err(too_large(length, limit));
        }
        let share = self.raw.take(expected_length(declared, &body).unwrap_or(limit.bytes)).await?;
        let raw = read_limited(body, limit).await?;
        let compressed = raw.len();
        let bytes = match encoding {
            Encoding::Identity => raw,
            Encoding::Gzip => {
                inflated_size(&raw, limit)?;
                gunzip(&raw, limit)?
            }
        };
        Ok((bytes, RawShare { share, compressed }))
    }

    /// Reads the raw (decompressed) body of a `POST /_session` login, form-encoded or JSON; at
    /// most `couchdb_max_login_bytes` (it is read before anyone is known).
    pub async fn read_login(&self, headers: &HeaderMap, body: Body) -> CouchResult<Bytes> {
        let limit = self.login_limit;
        let raw = read_limited(body, limit).await?;
        match content_encoding(headers)? {
            Encoding::Identity => Ok(raw),
            Encoding::Gzip => gunzip(&raw, limit),
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

/// A `COPY` request's `Destination` header read as CouchDB 3.4.3 reads it
/// (`couch_httpd_db:parse_copy_destination_header`, then `chttpd:unquote`): an absolute URL is
/// refused; the part before a `?` is the target id, URL-decoded as a query string is (`%XX` and
/// `+` as a space; the header's raw bytes kept, so UTF-8 sent unencoded is the id too); after
/// the `?`, one `name=rev` pair names the revision the copy replaces. Answers the id and that
/// revision (400 when the header is missing, as CouchDB; 400 `illegal_docid` when the id is not
/// UTF-8).
pub fn copy_destination(headers: &HeaderMap) -> CouchResult<(String, Option<String>)> {
    let destination = headers
        .get("destination")
        .map(|v| v.as_bytes())
        .ok_or_else(|| CouchError::bad_request("Destination header is mandatory for COPY."))?;
    if destination.starts_with(b"http://") || destination.starts_with(b"https://") {
        return Err(CouchError::bad_request("Destination URL must be relative."));
    }
    let (target, target_rev) = match destination.iter().position(|&byte| byte == b'?') {
        None => (destination, None),
        Some(at) => (&destination[..at], Some(destination_rev(&destination[at + 1..])?)),
    };
    let target = String::from_utf8(unquote_plus(target))
        .map_err(|_| CouchError::new(StatusCode::BAD_REQUEST, "illegal_docid", "Document id must be valid UTF-8"))?;
    Ok((target, target_rev))
}

/// The target id a `Destination` header names, for access checks before the request is passed
/// on: decoded as [`copy_destination`] decodes it, invalid UTF-8 replaced.
pub fn copy_destination_id(destination: &[u8]) -> String {
    let target = destination.split(|&byte| byte == b'?').next().unwrap_or_default();
    String::from_utf8_lossy(&unquote_plus(target)).into_owned()
}

/// The revision of a `Destination`'s `?name=rev` (CouchDB reads any name, and the revision as it
/// stands, not URL-decoded).
fn destination_rev(query: &[u8]) -> CouchResult<String> {
    let malformed = || CouchError::bad_request("The Destination header's query must be one name=rev pair.");
    if query.contains(&b'?') {
        return Err(malformed());
    }
    let mut parts = query.split(|&byte| byte == b'=');
    let (Some(_name), Some(rev), None) = (parts.next(), parts.next(), parts.next()) else { return Err(malformed()) };
    let rev = std::str::from_utf8(rev).map_err(|_| CouchError::bad_request("Invalid rev format"))?;
    match rev.split_once('-') {
        Some((generation, _)) if !generation.is_empty() && generation.parse::<u64>().is_ok() => Ok(rev.to_owned()),
        _ => Err(CouchError::bad_request("Invalid rev format")),
    }
}

/// URL-decoding as a query string's values are decoded (mochiweb's `unquote`, which CouchDB's
/// `chttpd:unquote` uses by default): `+` is a space, `%XX` a byte, any other `%` itself.
fn unquote_plus(text: &[u8]) -> Vec<u8> {
    let spaced: Vec<u8> = text.iter().map(|&byte| if byte == b'+' { b' ' } else { byte }).collect();
    percent_encoding::percent_decode(&spaced).collect()
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

/// The length a body will have, when known before it is read: the declared `Content-Length`, or
/// none at all for a request with neither `Content-Length` nor `Transfer-Encoding` (HTTP/1.1 says
/// it has no body; hyper's exact size hint of 0). Only a body of unknown length (chunked) is
/// charged the whole limit up front. A bodiless request charged the limit would hold the whole
/// budget (the limit is above it by default), and a passed `GET` holds its share until CouchDB's
/// answer begins: every forwarded read would wait for the one before (issue 38).
fn expected_length(declared: Option<usize>, body: &Body) -> Option<usize> {
    declared.or_else(|| body.size_hint().exact().and_then(|length| usize::try_from(length).ok()))
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

fn too_large(length: usize, limit: EndpointLimit) -> CouchError {
    CouchError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "too_large",
        format!(
            "the request body is {length} bytes or more; the limit for this endpoint is {} bytes ({})",
            limit.bytes, limit.setting
        ),
    )
}

async fn read_limited(body: Body, limit: EndpointLimit) -> CouchResult<Bytes> {
    let mut stream = body.into_data_stream();
    let mut collected: Vec<u8> = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| CouchError::bad_request(format!("could not read the request body: {e}")))?;
        if collected.len() + chunk.len() > limit.bytes {
            return Err(too_large(collected.len() + chunk.len(), limit));
        }
        collected.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(collected))
}

fn not_gzip(e: std::io::Error) -> CouchError {
    CouchError::bad_request(format!("the gzip-compressed body is not valid gzip: {e}"))
}

/// The size a gzip body inflates to, counted without keeping it; 413 past `limit`.
fn inflated_size(raw: &[u8], limit: EndpointLimit) -> CouchResult<usize> {
    let decoder = flate2::read::MultiGzDecoder::new(raw);
    let counted = std::io::copy(&mut decoder.take(limit.bytes as u64 + 1), &mut std::io::sink()).map_err(not_gzip)?;
    let counted = usize::try_from(counted).unwrap_or(usize::MAX);
    if counted > limit.bytes {
        return Err(too_large(counted, limit));
    }
    Ok(counted)
}

/// Decompresses a gzip body, refusing to produce more than `limit` bytes.
fn gunzip(raw: &[u8], limit: EndpointLimit) -> CouchResult<Bytes> {
    let mut out = Vec::new();
    let decoder = flate2::read::MultiGzDecoder::new(raw);
    let read = decoder.take(limit.bytes as u64 + 1).read_to_end(&mut out).map_err(not_gzip)?;
    if read > limit.bytes {
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

    /// Every body the measuring pass lets through parses as the depth-checked parse reads it,
    /// at the deepest nesting a request may have too; one level deeper never reaches the parse.
    #[test]
    fn a_measured_body_parses_as_parse_within_does() {
        let budget = usize::MAX;
        let deepest = format!("{}1{}", "[".repeat(MAX_REQUEST_DEPTH), "]".repeat(MAX_REQUEST_DEPTH));
        let bodies = [
            r#"{"_id":"a","n":12345678901234567890,"f":0.1,"e":1E2,"s":"caf\u00e9 \"q\"","l":[true,null,{}]}"#
                .to_owned(),
            "  [1, 2.50, -0]  ".to_owned(),
            deepest.clone(),
            "{\"a\":1} x".to_owned(),
            "{\"a\":".to_owned(),
        ];
        for body in &bodies {
            let checked: serde_json::Result<Value> =
                crate::model::depth::parse_within(body.as_bytes(), MAX_REQUEST_DEPTH);
            match measure_body(body.as_bytes(), MAX_REQUEST_DEPTH, budget) {
                Ok(measured) => assert_eq!(
                    measured.parse::<Value>().map_err(|e| e.to_string()),
                    checked.map_err(|e| e.to_string()),
                    "{body:.60}"
                ),
                Err(_) => assert!(checked.is_err(), "{body:.60}: refused by the measure only"),
            }
        }
        let measured = measure_body(deepest.as_bytes(), MAX_REQUEST_DEPTH, budget);
        assert!(
            measured.map(|m| m.parse::<Value>().is_ok()).unwrap_or(false),
            "serde_json's own recursion limit is off"
        );
        let deeper = format!("[{deepest}]");
        assert!(measure_body(deeper.as_bytes(), MAX_REQUEST_DEPTH, budget).is_err(), "refused before the parse");
    }

    #[test]
    fn copy_destinations_are_read_as_couchdb_reads_them() {
        let mut headers = HeaderMap::new();
        assert_eq!(copy_destination(&headers).map_err(|e| e.status.as_u16()), Err(400));
        headers.insert("destination", "_design/b%2Fc".parse().unwrap());
        assert_eq!(copy_destination(&headers).ok(), Some(("_design/b/c".to_owned(), None)));
        headers.insert("destination", "target?rev=2-abc".parse().unwrap());
        assert_eq!(copy_destination(&headers).ok(), Some(("target".to_owned(), Some("2-abc".to_owned()))));
        // `+` is a space and raw UTF-8 bytes are the id's, as `chttpd:unquote` reads them.
        headers.insert("destination", "a+b%2Bc".parse().unwrap());
        assert_eq!(copy_destination(&headers).ok(), Some(("a b+c".to_owned(), None)));
        headers.insert("destination", axum::http::HeaderValue::from_bytes("caf\u{e9}".as_bytes()).unwrap());
        assert_eq!(copy_destination(&headers).ok(), Some(("caf\u{e9}".to_owned(), None)));
        headers.insert("destination", axum::http::HeaderValue::from_bytes(b"bad\xff").unwrap());
        assert_eq!(copy_destination(&headers).map_err(|e| e.error), Err("illegal_docid".into()));
        for refused in ["http://host/db/x", "x?rev=abc", "x?rev=1-a=b", "x?a?rev=1-a", "x?rev"] {
            headers.insert("destination", refused.parse().unwrap());
            assert_eq!(copy_destination(&headers).map_err(|e| e.status.as_u16()), Err(400), "{refused}");
        }
        assert_eq!(copy_destination_id(b"_design%2Fx?rev=1-a"), "_design/x");
    }

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

    /// A request without a body (a passed `GET`) takes one permit of the raw budget, not the whole
    /// limit: two of them hold their shares at once (on main the first took the whole budget, and
    /// every forwarded read waited for the one before to be answered). A body of unknown length
    /// is still charged the limit up front, so it waits for the budget as before.
    #[tokio::test]
    async fn bodiless_requests_do_not_take_the_whole_budget() {
        let within = std::time::Duration::from_secs(5);
        // The defaults' shape: the limit (64 MiB) above the budget (4 × the REST limit).
        let bodies = Bodies::new(64 << 10, 16 << 10);
        let headers = HeaderMap::new();
        let (_, first) = bodies.read_bytes(&headers, Body::empty()).await.unwrap();
        let second = tokio::time::timeout(within, bodies.read_bytes(&headers, Body::empty())).await;
        let (_, second) = second.expect("a second bodiless request waited for the first's share").unwrap();
        drop((first, second));
        let chunked = || Body::from_stream(futures::stream::iter([Ok::<_, std::io::Error>(Bytes::from_static(b"{}"))]));
        let (_, whole) = bodies.read_bytes(&headers, chunked()).await.unwrap();
        let waiting =
            tokio::time::timeout(std::time::Duration::from_millis(200), bodies.read_bytes(&headers, chunked()));
        assert!(waiting.await.is_err(), "a body of unknown length is charged the whole limit");
        drop(whole);
    }

    #[tokio::test]
    async fn an_oversized_body_is_refused_before_it_is_read() {
        let bodies = Bodies::new(8, 4096);
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, "100".parse().unwrap());
        let err = bodies.read_json(&headers, Body::from(vec![b'1'; 100])).await.err().unwrap();
        assert_eq!(err.status, StatusCode::PAYLOAD_TOO_LARGE);
    }

    /// The decoded budget is charged by what a gzip body inflates to, not by its compressed size.
    #[tokio::test]
    async fn a_gzip_body_is_charged_by_its_inflated_size() {
        let bodies = Bodies::new(8 << 20, 16 << 20);
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_ENCODING, "gzip".parse().unwrap());
        let inflated = format!("{{\"pad\": \"{}\"}}", " ".repeat(4 << 20));
        let compressed = gzip(inflated.as_bytes());
        assert!(compressed.len() < 64 << 10, "{} bytes compressed", compressed.len());
        // Declared, as clients do: the compressed size is all the raw budget learns up front.
        headers.insert(header::CONTENT_LENGTH, compressed.len().into());
        let before = bodies.decoded.available_bytes();
        let body = bodies.read_json(&headers, Body::from(compressed)).await.unwrap().unwrap();
        let taken = before - bodies.decoded.available_bytes();
        assert!(taken >= inflated.len(), "charged {taken} bytes for a body inflating to {}", inflated.len());
        drop(body);
        assert_eq!(bodies.decoded.available_bytes(), before, "given back with the body");
    }

    /// The query endpoints' limit holds for the handler it wraps, on the inflated size, and the
    /// 413 names the setting.
    #[tokio::test]
    async fn an_endpoint_limit_holds_inflated_bodies_and_names_its_setting() {
        let bodies = Bodies::new(64 << 20, 256 << 20);
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_ENCODING, "gzip".parse().unwrap());
        let selector = format!("{{\"selector\": {{\"a\": \"{}\"}}}}", "x".repeat(2 << 20));
        let small = EndpointLimit { bytes: 1 << 20, setting: "couchdb_max_query_bytes" };
        let err = ENDPOINT_LIMIT
            .scope(small, bodies.read_json(&headers, Body::from(gzip(selector.as_bytes()))))
            .await
            .err()
            .unwrap();
        assert_eq!(err.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert!(err.reason.contains("couchdb_max_query_bytes"), "{}", err.reason);
        // The same body is fine where the general limit holds.
        assert!(bodies.read_json(&headers, Body::from(gzip(selector.as_bytes()))).await.unwrap().is_some());
    }

    /// A body whose parsed tree alone would exceed the parse budget is refused before parsing.
    #[tokio::test]
    async fn a_body_whose_tree_exceeds_the_parse_budget_is_413() {
        let bodies = Bodies::new(1 << 20, 256 << 10);
        let numbers = format!("[{}1]", "1,".repeat(100_000));
        let err = bodies.read_json(&HeaderMap::new(), Body::from(numbers)).await.err().unwrap();
        assert_eq!(err.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert!(err.reason.contains("max_inflight_parse_bytes"), "{}", err.reason);
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
