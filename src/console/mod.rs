//! The console at `/_utils` (issue 39): a small single-page application, its files compiled into
//! the binary, served on the CouchDB listener as CouchDB 3.4.3 serves Fauxton there.
//!
//! This module owns those files ([`ASSETS`], from `src/console/assets/`) and how they are
//! answered: `GET /_utils` redirects (301) to `/_utils/`, `GET /_utils/` is `index.html`, and
//! `GET /_utils/{file}` one of the files, with its content type, a strong `ETag` (the SHA-256 of
//! its bytes, so `If-None-Match` answers 304), CouchDB's `Cache-Control: private,
//! must-revalidate`, and a `Content-Security-Policy` that lets the page load nothing but this
//! origin's own files ([`CONTENT_SECURITY_POLICY`]). Any other method is 405 `Allow: GET,HEAD`,
//! as CouchDB's (`chttpd_misc:handle_utils_dir_req`); a file the console does not hold 404 in
//! CouchDB's JSON error shape (CouchDB's file server answers a plain-text 404 there). Like CouchDB's, the
//! files need no login: the page logs in through `POST /_session` and every call it makes is the
//! CouchDB API any client makes, so a login sees in the console exactly what CouchDB would show
//! it. Why no crate (`rust-embed`, `include_dir`): the files are a dozen, listed once below with
//! `include_bytes!`; a crate would only walk a directory for us. What the pages do:
//! `docs/console.md`.

use std::sync::LazyLock;

use axum::extract::Path;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

/// One file of the console: its name below `/_utils/`, its content type, its bytes.
pub struct Asset {
    pub name: &'static str,
    pub content_type: &'static str,
    pub bytes: &'static [u8],
}

const JS: &str = "text/javascript; charset=utf-8";

macro_rules! asset {
    ($name:literal, $type:expr) => {
        Asset { name: $name, content_type: $type, bytes: include_bytes!(concat!("assets/", $name)) }
    };
}

/// Every file the console is made of. A file added to `assets/` is served once it is listed
/// here (a unit test checks that every file of the folder is).
pub const ASSETS: &[Asset] = &[
    asset!("index.html", "text/html; charset=utf-8"),
    asset!("console.css", "text/css; charset=utf-8"),
    asset!("favicon.svg", "image/svg+xml"),
    asset!("app.js", JS),
    asset!("api.js", JS),
    asset!("ui.js", JS),
    asset!("pages/login.js", JS),
    asset!("pages/databases.js", JS),
    asset!("pages/documents.js", JS),
    asset!("pages/document.js", JS),
    asset!("pages/mango.js", JS),
    asset!("pages/views.js", JS),
    asset!("pages/service.js", JS),
    asset!("pages/replication.js", JS),
    asset!("pages/data_store.js", JS),
];

/// What the page may load: this origin's files only (scripts as modules from files, no inline
/// script, no `eval`, no inline style), pictures also from `data:` and `blob:`. It may call
/// other HTTP(S) origins: the data-store page calls the REST listener, another port (its
/// address is typed in the page, not known here); the page builds no markup from text, so what
/// it is sent cannot become a script that sends anything elsewhere.
const CONTENT_SECURITY_POLICY: &str = "default-src 'self'; script-src 'self'; style-src 'self'; \
     img-src 'self' data: blob:; connect-src 'self' http: https:; frame-ancestors 'none'; form-action 'self'";

/// The `ETag` of each asset, in [`ASSETS`]' order, computed once.
static ETAGS: LazyLock<Vec<HeaderValue>> = LazyLock::new(|| {
    ASSETS
        .iter()
        .map(|asset| {
            let digest = hex::encode(&Sha256::digest(asset.bytes)[..16]);
            HeaderValue::from_str(&format!("\"{digest}\"")).unwrap_or_else(|_| HeaderValue::from_static("\"\""))
        })
        .collect()
});

/// `/_utils` without its slash: CouchDB's 301 to `/_utils/`, an absolute location built from the
/// request's `Host` (CouchDB's `absolute_uri`); a relative one without a usable `Host`.
pub async fn redirect(method: Method, headers: HeaderMap) -> Response {
    if method != Method::GET && method != Method::HEAD {
        return method_not_allowed();
    }
    let location = match headers.get(header::HOST).and_then(|h| h.to_str().ok()) {
        Some(host) if !host.is_empty() && !host.contains(['/', ' ']) => format!("http://{host}/_utils/"),
        _ => "/_utils/".to_owned(),
    };
    let mut response = StatusCode::MOVED_PERMANENTLY.into_response();
    if let Ok(value) = HeaderValue::from_str(&location) {
        response.headers_mut().insert(header::LOCATION, value);
    }
    response
}

/// `/_utils/`: the page itself.
pub async fn index(method: Method, headers: HeaderMap) -> Response {
    answer(&method, &headers, "index.html")
}

/// `/_utils/{file}`.
pub async fn file(method: Method, headers: HeaderMap, Path(name): Path<String>) -> Response {
    // The page's own paths (`#/…`) never reach the server; a name ending in `/` is the page.
    let name = if name.is_empty() || name.ends_with('/') { "index.html" } else { name.as_str() };
    answer(&method, &headers, name)
}

fn answer(method: &Method, headers: &HeaderMap, name: &str) -> Response {
    if method != Method::GET && method != Method::HEAD {
        return method_not_allowed();
    }
    let Some(index) = ASSETS.iter().position(|asset| asset.name == name) else {
        return couch_error(StatusCode::NOT_FOUND, "not_found", "no such file in the console");
    };
    let asset = &ASSETS[index];
    let etag = &ETAGS[index];
    let fresh = headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|tags| tags.split(',').any(|tag| tag.trim().trim_start_matches("W/") == etag));
    let mut response =
        if fresh { StatusCode::NOT_MODIFIED.into_response() } else { (StatusCode::OK, asset.bytes).into_response() };
    let out = response.headers_mut();
    out.insert(header::ETAG, etag.clone());
    out.insert(header::CACHE_CONTROL, HeaderValue::from_static("private, must-revalidate"));
    out.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CONTENT_SECURITY_POLICY));
    out.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    if !fresh {
        out.insert(header::CONTENT_TYPE, HeaderValue::from_static(asset.content_type));
    }
    response
}

/// CouchDB's 405 for a method `/_utils` does not take (`send_method_not_allowed(Req, "GET,HEAD")`).
fn method_not_allowed() -> Response {
    let mut response = couch_error(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "Only GET,HEAD allowed");
    response.headers_mut().insert(header::ALLOW, HeaderValue::from_static("GET,HEAD"));
    response
}

fn couch_error(status: StatusCode, error: &str, reason: &str) -> Response {
    let body = serde_json::json!({ "error": error, "reason": reason }).to_string();
    let mut response = (status, body).into_response();
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every file under `assets/` is listed in [`ASSETS`] (else the page would ask for a file the
    /// binary does not hold), and every listed one exists (`include_bytes!` checks that at build).
    #[test]
    fn every_asset_file_is_served() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/console/assets");
        let mut stack = vec![root.clone()];
        let mut missing = Vec::new();
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).expect("assets folder") {
                let path = entry.expect("entry").path();
                if path.is_dir() {
                    stack.push(path);
                    continue;
                }
                let name = path.strip_prefix(&root).expect("below root").to_string_lossy().replace('\\', "/");
                if !ASSETS.iter().any(|asset| asset.name == name) {
                    missing.push(name);
                }
            }
        }
        assert!(missing.is_empty(), "files in src/console/assets/ not listed in ASSETS: {missing:?}");
    }

    /// Every module the page imports is a listed asset: a relative `import … from './x.js'` of a
    /// file not in [`ASSETS`] would be a 404 in the browser.
    #[test]
    fn every_imported_module_is_served() {
        for asset in ASSETS.iter().filter(|a| a.name.ends_with(".js")) {
            let text = std::str::from_utf8(asset.bytes).expect("utf-8");
            let dir = asset.name.rsplit_once('/').map(|(d, _)| d).unwrap_or("");
            for line in text.lines().filter(|l| l.trim_start().starts_with("import ")) {
                let Some(spec) = line.split(['\'', '"']).nth(1) else { continue };
                let mut parts: Vec<&str> = if dir.is_empty() { vec![] } else { dir.split('/').collect() };
                for piece in spec.split('/') {
                    match piece {
                        "." => {}
                        ".." => {
                            parts.pop();
                        }
                        other => parts.push(other),
                    }
                }
                let target = parts.join("/");
                assert!(
                    ASSETS.iter().any(|a| a.name == target),
                    "{} imports {spec}: {target} is not served",
                    asset.name
                );
            }
        }
    }

    #[tokio::test]
    async fn if_none_match_answers_304_and_a_changed_tag_the_file() {
        let first = index(Method::GET, HeaderMap::new()).await;
        assert_eq!(first.status(), StatusCode::OK);
        assert_eq!(first.headers()[header::CONTENT_TYPE], "text/html; charset=utf-8");
        let etag = first.headers()[header::ETAG].clone();
        let mut again = HeaderMap::new();
        again.insert(header::IF_NONE_MATCH, etag);
        assert_eq!(index(Method::GET, again).await.status(), StatusCode::NOT_MODIFIED);
        let mut stale = HeaderMap::new();
        stale.insert(header::IF_NONE_MATCH, HeaderValue::from_static("\"0123\""));
        assert_eq!(index(Method::GET, stale).await.status(), StatusCode::OK);
    }

    #[tokio::test]
    async fn other_methods_and_files_are_refused_as_couchdb_refuses_them() {
        let post = file(Method::POST, HeaderMap::new(), Path("app.js".to_owned())).await;
        assert_eq!(post.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(post.headers()[header::ALLOW], "GET,HEAD");
        let missing = file(Method::GET, HeaderMap::new(), Path("nothing.js".to_owned())).await;
        assert_eq!(missing.status(), StatusCode::NOT_FOUND);
        let mut headers = HeaderMap::new();
        headers.insert(header::HOST, HeaderValue::from_static("127.0.0.1:5984"));
        let moved = redirect(Method::GET, headers).await;
        assert_eq!(moved.status(), StatusCode::MOVED_PERMANENTLY);
        assert_eq!(moved.headers()[header::LOCATION], "http://127.0.0.1:5984/_utils/");
    }
}
