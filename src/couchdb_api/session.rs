//! CouchDB cookie sessions: the `AuthSession` cookie and the `/_session` handlers.
//!
//! The cookie is stateless: it carries the login name and the second it was issued, signed with
//! HMAC-SHA256 under `couchdb_session_secret` (when unset, the secret kept in the backend,
//! [`super::shared_secret`], shared by every instance over it). The signature also
//! covers the login's password hash, so changing a password ends its sessions; for a login of a
//! `_users` document it covers the document's salt instead, as CouchDB's cookie does (a new
//! password always gets a new salt), read from the document at each request
//! ([`super::users`]), so a password changed through any instance ends the sessions everywhere. A cookie is valid
//! for `couchdb_session_timeout_secs` after it was issued (the setting in force when it is read),
//! and once more than a tenth of that has passed, responses carry a fresh one, as CouchDB's do.
//! The secret also keys the feed positions sealed for per-user logins ([`super::position_seal`]).

use std::sync::{Arc, RwLock};

use axum::body::Bytes;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use hmac::{Hmac, Mac};
use serde_json::{json, Map, Value};
use sha2::Sha256;

use super::auth::{json_response, unix_now, CouchAuth, CouchError, Identity, WRONG_CREDENTIALS};
use super::position_seal::PositionSeal;
use crate::config::Settings;
use crate::error::{Error, Result};

/// The cookie's name, as CouchDB and its clients spell it.
pub const AUTH_SESSION_COOKIE: &str = "AuthSession";
/// Longest accepted `couchdb_session_timeout_secs`: a year.
pub const MAX_SESSION_TIMEOUT_SECS: u64 = 365 * 24 * 3600;
/// Shortest accepted `couchdb_session_secret`, in bytes (32 hex digits).
const MIN_SECRET_BYTES: usize = 16;

/// Bytes of a cookie before the name: the issue time and the signature.
const ISSUED_AT_BYTES: usize = 8;
const SIGNATURE_BYTES: usize = 32;

/// The key and lifetime of session cookies.
pub struct SessionKey {
    /// Replaced whole when the secret kept in the backend is rotated ([`super::shared_secret`]).
    secrets: RwLock<Arc<SessionSecrets>>,
    timeout_secs: u64,
}

/// The secrets sessions are signed and checked under.
struct SessionSecrets {
    /// Signs new cookies; checks cookies first.
    current: Vec<u8>,
    /// The secret before the last rotation: its cookies are still accepted.
    previous: Option<Vec<u8>>,
    /// Feed positions shown to per-user logins are sealed under a key derived from the secret.
    positions: PositionSeal,
}

impl std::fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionKey").field("timeout_secs", &self.timeout_secs).finish_non_exhaustive()
    }
}

/// What a cookie says, before its signature is checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionClaim {
    pub name: String,
    pub issued_at: u64,
    signature: [u8; SIGNATURE_BYTES],
}

/// The verdict on a parsed cookie.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CookieCheck {
    /// Signed by us and within its lifetime; `refresh` once a tenth of the lifetime has passed.
    Valid {
        refresh: bool,
    },
    Expired,
    BadSignature,
}

impl SessionKey {
    pub fn new(secret: Vec<u8>, timeout_secs: u64) -> Self {
        let secrets = RwLock::new(Arc::new(SessionSecrets::new(secret, None)));
        SessionKey { secrets, timeout_secs }
    }

    /// Signs with `current` from now on, still accepting cookies and feed positions of `previous`.
    pub fn replace_secrets(&self, current: Vec<u8>, previous: Option<Vec<u8>>) {
        let replaced = Arc::new(SessionSecrets::new(current, previous));
        *self.secrets.write().unwrap_or_else(|poisoned| poisoned.into_inner()) = replaced;
    }

    /// The secrets in force.
    fn secrets(&self) -> Arc<SessionSecrets> {
        Arc::clone(&self.secrets.read().unwrap_or_else(|poisoned| poisoned.into_inner()))
    }

    /// The seal of feed positions shown to per-user logins (derived from the same secret).
    pub fn positions(&self) -> PositionSeal {
        self.secrets().positions.clone()
    }

    /// Reads `couchdb_session_secret` (hex, at least 32 digits) and `couchdb_session_timeout_secs`.
    pub fn from_settings(settings: &Settings) -> Result<Self> {
        let timeout_secs = settings.couchdb_session_timeout_secs;
        if !(1..=MAX_SESSION_TIMEOUT_SECS).contains(&timeout_secs) {
            return Err(Error::invalid(
                "couchdb_session_timeout_secs",
                format!("must be from 1 to {MAX_SESSION_TIMEOUT_SECS} (a year)"),
            ));
        }
        let secret = match &settings.couchdb_session_secret {
            Some(text) => {
                let secret = hex::decode(text.trim()).ok().filter(|bytes| bytes.len() >= MIN_SECRET_BYTES);
                secret.ok_or_else(|| {
                    Error::invalid(
                        "couchdb_session_secret",
                        format!("must be at least {} hex digits (e.g. `openssl rand -hex 32`)", MIN_SECRET_BYTES * 2),
                    )
                })?
            }
            None => {
                let mut secret = vec![0u8; 32];
                getrandom::fill(&mut secret).map_err(|e| {
                    Error::invalid("couchdb_session_secret", format!("is unset and no random one can be made: {e}"))
                })?;
                secret
            }
        };
        Ok(SessionKey::new(secret, timeout_secs))
    }

    pub fn timeout_secs(&self) -> u64 {
        self.timeout_secs
    }

    /// The MAC of a session: issue time, name, and the login's password hash. The name is
    /// length-prefixed so that name and hash cannot be re-split.
    fn mac(secret: &[u8], name: &str, issued_at: u64, password_hash: &str) -> Hmac<Sha256> {
        let mut mac = hmac_sha256(secret);
        mac.update(&issued_at.to_be_bytes());
        mac.update(&(name.len() as u64).to_be_bytes());
        mac.update(name.as_bytes());
        mac.update(password_hash.as_bytes());
        mac
    }

    /// The cookie value: URL-safe base64 of issue time, signature and name.
    pub fn sign(&self, name: &str, password_hash: &str, issued_at: u64) -> String {
        let signature = Self::mac(&self.secrets().current, name, issued_at, password_hash).finalize().into_bytes();
        let mut bytes = Vec::with_capacity(ISSUED_AT_BYTES + SIGNATURE_BYTES + name.len());
        bytes.extend_from_slice(&issued_at.to_be_bytes());
        bytes.extend_from_slice(&signature);
        bytes.extend_from_slice(name.as_bytes());
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    }

    /// Splits a cookie value; CouchDB's 400 when it is not one of ours at all.
    pub fn parse(value: &str) -> Result<SessionClaim, CouchError> {
        let malformed = || CouchError::bad_request("Malformed AuthSession cookie. Please clear your cookies.");
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(value).map_err(|_| malformed())?;
        if bytes.len() < ISSUED_AT_BYTES + SIGNATURE_BYTES {
            return Err(malformed());
        }
        let (issued_at, rest) = bytes.split_at(ISSUED_AT_BYTES);
        let (signature, name) = rest.split_at(SIGNATURE_BYTES);
        Ok(SessionClaim {
            name: String::from_utf8(name.to_vec()).map_err(|_| malformed())?,
            issued_at: u64::from_be_bytes(issued_at.try_into().map_err(|_| malformed())?),
            signature: signature.try_into().map_err(|_| malformed())?,
        })
    }

    /// Whether a claim is signed by this key for this login, and still valid at `now`.
    pub fn check(&self, claim: &SessionClaim, password_hash: &str, now: u64) -> CookieCheck {
        let secrets = self.secrets();
        let signed_under = |secret: &Vec<u8>| {
            Self::mac(secret, &claim.name, claim.issued_at, password_hash).verify_slice(&claim.signature).is_ok()
        };
        if !std::iter::once(&secrets.current).chain(&secrets.previous).any(signed_under) {
            return CookieCheck::BadSignature;
        }
        // A cookie from a clock ahead of ours counts as just issued.
        let age = now.saturating_sub(claim.issued_at);
        if age >= self.timeout_secs {
            return CookieCheck::Expired;
        }
        CookieCheck::Valid { refresh: age.saturating_mul(10) > self.timeout_secs }
    }

    /// A `Set-Cookie` value for a session issued at `now`.
    pub fn set_cookie(&self, name: &str, password_hash: &str, now: u64) -> HeaderValue {
        let value = self.sign(name, password_hash, now);
        let expires = http_date(now.saturating_add(self.timeout_secs));
        let text = format!(
            "{AUTH_SESSION_COOKIE}={value}; Version=1; Expires={expires}; Max-Age={}; Path=/; HttpOnly",
            self.timeout_secs
        );
        // Base64, digits and a formatted date are all visible ASCII.
        HeaderValue::try_from(text).unwrap_or_else(|_| clear_cookie())
    }
}

impl SessionSecrets {
    fn new(current: Vec<u8>, previous: Option<Vec<u8>>) -> Self {
        let positions = PositionSeal::from_secrets(&current, previous.as_deref());
        SessionSecrets { current, previous, positions }
    }
}

/// An HMAC-SHA256 under `key`.
pub(super) fn hmac_sha256(key: &[u8]) -> Hmac<Sha256> {
    // HMAC hashes keys longer than a block and pads shorter ones: no key length is refused.
    <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes a key of any length")
}

/// A `Set-Cookie` value that removes the session cookie.
pub fn clear_cookie() -> HeaderValue {
    HeaderValue::from_static(
        "AuthSession=; Version=1; Expires=Thu, 01 Jan 1970 00:00:00 GMT; Max-Age=0; Path=/; HttpOnly",
    )
}

/// An HTTP date (RFC 1123, GMT) for a Unix time.
fn http_date(unix_secs: u64) -> String {
    i64::try_from(unix_secs).ok().and_then(|secs| chrono::DateTime::from_timestamp(secs, 0)).map_or_else(
        || "Fri, 31 Dec 9999 23:59:59 GMT".to_owned(),
        |t| t.format("%a, %d %b %Y %H:%M:%S GMT").to_string(),
    )
}

/// `POST /_session`: logs in with `name` (or `username`) and `password` from a form-urlencoded or
/// JSON body; sets the cookie. `?next=/path` answers 302 to that path on success.
pub async fn post_session(auth: &CouchAuth, headers: &HeaderMap, query: Option<&str>, body: Bytes) -> Response {
    post_session_from(auth, headers, query, body, None).await
}

/// [`post_session`] for a request from `peer`: a failed login counts toward the lockout of its
/// name from that address (see [`super::auth`]).
pub async fn post_session_from(
    auth: &CouchAuth,
    headers: &HeaderMap,
    query: Option<&str>,
    body: Bytes,
    peer: Option<std::net::IpAddr>,
) -> Response {
    post_session_at(auth, headers, query, &body, peer, unix_now()).await.unwrap_or_else(IntoResponse::into_response)
}

async fn post_session_at(
    auth: &CouchAuth,
    headers: &HeaderMap,
    query: Option<&str>,
    body: &[u8],
    peer: Option<std::net::IpAddr>,
    now: u64,
) -> Result<Response, CouchError> {
    let next = redirect_target(query)?;
    let form = LoginForm::parse(headers, body)?;
    Ok(match auth.log_in(&form.name, &form.password, peer, now).await? {
        Some((roles, cookie)) => {
            let body = json!({ "ok": true, "name": form.name, "roles": roles });
            let status = if next.is_some() { StatusCode::FOUND } else { StatusCode::OK };
            session_response(status, &body, cookie, next)
        }
        // A failed login also ends whatever session the client had, as CouchDB does.
        None => session_response(
            StatusCode::UNAUTHORIZED,
            &CouchError::unauthorized(WRONG_CREDENTIALS).body(),
            clear_cookie(),
            None,
        ),
    })
}

/// `GET /_session`: who the request is. `?basic=true` asks anonymous callers to log in (401).
pub async fn get_session(auth: &CouchAuth, headers: &HeaderMap, query: Option<&str>) -> Response {
    let identity = match auth.identify(headers).await {
        Ok(identity) => identity,
        Err(err) => return err.into_response(),
    };
    session_info(&identity, query).unwrap_or_else(IntoResponse::into_response)
}

fn session_info(identity: &Identity, query: Option<&str>) -> Result<Response, CouchError> {
    if identity.name.is_none() && query_value(query, "basic").as_deref() == Some("true") {
        return Err(CouchError::unauthorized("Please login."));
    }
    let mut info = Map::new();
    info.insert("authentication_handlers".into(), json!(["cookie", "default"]));
    if let Some(handler) = identity.method.handler_name() {
        info.insert("authenticated".into(), json!(handler));
    }
    let body = json!({
        "ok": true,
        "userCtx": { "name": identity.name, "roles": identity.session_roles() },
        "info": info,
    });
    let mut response = json_response(StatusCode::OK, &body);
    identity.add_refreshed_cookie(&mut response);
    Ok(response)
}

/// `DELETE /_session`: clears the cookie (the cookie itself stays valid until it expires: it is
/// stateless). `?next=/path` answers 302 to that path.
pub fn delete_session(query: Option<&str>) -> Response {
    match redirect_target(query) {
        Ok(next) => {
            let status = if next.is_some() { StatusCode::FOUND } else { StatusCode::OK };
            session_response(status, &json!({ "ok": true }), clear_cookie(), next)
        }
        Err(err) => err.into_response(),
    }
}

/// The credentials of a login request.
#[derive(Debug, PartialEq, Eq)]
struct LoginForm {
    name: String,
    password: String,
}

impl LoginForm {
    /// Reads a form-urlencoded or JSON body (by `Content-Type`; without one, a body starting with
    /// `{` is JSON). `name` and `username` are synonyms; CouchDB's 400s when neither is given or
    /// they differ. A missing password is empty (and fails as a wrong one).
    fn parse(headers: &HeaderMap, body: &[u8]) -> Result<Self, CouchError> {
        let fields = match body_media_type(headers, body)?.as_str() {
            "application/x-www-form-urlencoded" => {
                url::form_urlencoded::parse(body).map(|(k, v)| (k.into_owned(), v.into_owned())).collect()
            }
            _ => json_fields(body)?,
        };
        let field = |key: &str| fields.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone());
        let name = match (field("name"), field("username")) {
            (None, None) => return Err(CouchError::bad_request("request body must contain a username")),
            (Some(name), Some(username)) if name != username => {
                return Err(CouchError::bad_request("request body contains different usernames"))
            }
            (Some(name), _) | (None, Some(name)) => name,
        };
        Ok(LoginForm { name, password: field("password").unwrap_or_default() })
    }
}

/// `application/json` or `application/x-www-form-urlencoded`, from the header or the body's first
/// byte; 400 naming the two accepted types otherwise.
fn body_media_type(headers: &HeaderMap, body: &[u8]) -> Result<String, CouchError> {
    let declared = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.split(';').next().unwrap_or_default().trim().to_ascii_lowercase());
    let media_type = declared.unwrap_or_else(|| {
        let json = body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
        if json { "application/json" } else { "application/x-www-form-urlencoded" }.to_owned()
    });
    match media_type.as_str() {
        "application/json" | "application/x-www-form-urlencoded" => Ok(media_type),
        other => Err(CouchError::bad_request(format!(
            "Content-Type {other:?} is not accepted: send application/json or application/x-www-form-urlencoded"
        ))),
    }
}

/// The string fields `name`, `username` and `password` of a JSON object body.
fn json_fields(body: &[u8]) -> Result<Vec<(String, String)>, CouchError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| CouchError::bad_request(format!("request body is not valid JSON: {e}")))?;
    let Value::Object(object) = value else {
        return Err(CouchError::bad_request("request body must be a JSON object"));
    };
    let mut fields = Vec::new();
    for key in ["name", "username", "password"] {
        match object.get(key) {
            None => {}
            Some(Value::String(text)) => fields.push((key.to_owned(), text.clone())),
            Some(_) => return Err(CouchError::bad_request(format!("{key} must be a string"))),
        }
    }
    Ok(fields)
}

/// The `next` query parameter, when it is a path on this server (one leading `/`, visible ASCII);
/// 400 for anything else, so a login cannot redirect to another site.
fn redirect_target(query: Option<&str>) -> Result<Option<HeaderValue>, CouchError> {
    let Some(next) = query_value(query, "next") else { return Ok(None) };
    let simple = next.starts_with('/')
        && !next.starts_with("//")
        && !next.contains('\\')
        && next.bytes().all(|b| b.is_ascii_graphic());
    let refused = || CouchError::bad_request("next must be a path on this server, starting with a single /");
    if !simple {
        return Err(refused());
    }
    HeaderValue::try_from(next).map(Some).map_err(|_| refused())
}

/// The first value of a query parameter, percent-decoded.
fn query_value(query: Option<&str>, key: &str) -> Option<String> {
    url::form_urlencoded::parse(query?.as_bytes()).find(|(k, _)| k == key).map(|(_, v)| v.into_owned())
}

/// A `/_session` answer: JSON body, the cookie to set, and `Location` for a redirect.
fn session_response(status: StatusCode, body: &Value, cookie: HeaderValue, location: Option<HeaderValue>) -> Response {
    let mut response = json_response(status, body);
    response.headers_mut().append(header::SET_COOKIE, cookie);
    if let Some(location) = location {
        response.headers_mut().insert(header::LOCATION, location);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::couchdb_api::auth::tests::{
        basic, cheap_hash, fixture_response, settings, two_logins, AUTH_WRONG_PASSWORD,
    };
    use crate::couchdb_api::auth::{AuthMethod, Principal};

    const NOW: u64 = 1_700_000_000;

    fn key() -> SessionKey {
        SessionKey::new(vec![7; 32], 600)
    }

    /// The `AuthSession=…` value the way couchbackup reads it: `AuthSession=([^;]*);`.
    fn cookie_of(set_cookie: &HeaderValue) -> String {
        let text = set_cookie.to_str().unwrap();
        let rest = text.strip_prefix("AuthSession=").unwrap_or_else(|| panic!("{text}"));
        rest[..rest.find(';').unwrap()].to_owned()
    }

    fn with_cookie(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::COOKIE, HeaderValue::from_str(&format!("AuthSession={value}")).unwrap());
        headers
    }

    fn form_headers(content_type: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_str(content_type).unwrap());
        headers
    }

    async fn body_json(response: Response) -> Value {
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        serde_json::from_slice(&bytes).unwrap()
    }

    #[test]
    fn a_signed_cookie_verifies_until_it_expires() {
        let key = key();
        let claim = SessionKey::parse(&key.sign("alice", "hash-a", NOW)).unwrap();
        assert_eq!((claim.name.as_str(), claim.issued_at), ("alice", NOW));
        assert_eq!(key.check(&claim, "hash-a", NOW), CookieCheck::Valid { refresh: false });
        assert_eq!(key.check(&claim, "hash-a", NOW + 599), CookieCheck::Valid { refresh: true });
        assert_eq!(key.check(&claim, "hash-a", NOW + 600), CookieCheck::Expired);
        // From a clock ahead of ours: as if just issued.
        assert_eq!(key.check(&claim, "hash-a", NOW - 30), CookieCheck::Valid { refresh: false });
    }

    #[test]
    fn the_cookie_is_refreshed_once_a_tenth_of_its_life_has_passed() {
        let key = key();
        let claim = SessionKey::parse(&key.sign("alice", "h", NOW)).unwrap();
        assert_eq!(key.check(&claim, "h", NOW + 60), CookieCheck::Valid { refresh: false });
        assert_eq!(key.check(&claim, "h", NOW + 61), CookieCheck::Valid { refresh: true });
    }

    #[test]
    fn a_tampered_or_foreign_cookie_is_refused() {
        let key = key();
        let value = key.sign("alice", "hash-a", NOW);
        let claim = SessionKey::parse(&value).unwrap();
        // Another secret, another password hash, another name, another issue time.
        assert_eq!(SessionKey::new(vec![8; 32], 600).check(&claim, "hash-a", NOW), CookieCheck::BadSignature);
        assert_eq!(key.check(&claim, "hash-b", NOW), CookieCheck::BadSignature);
        let renamed = SessionClaim { name: "admin".into(), ..claim.clone() };
        assert_eq!(key.check(&renamed, "hash-a", NOW), CookieCheck::BadSignature);
        let later = SessionClaim { issued_at: NOW + 500, ..claim.clone() };
        assert_eq!(key.check(&later, "hash-a", NOW + 600), CookieCheck::BadSignature);
        // Every single flipped bit of the encoded cookie breaks it.
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(&value).unwrap();
        for i in 0..bytes.len() {
            let mut flipped = bytes.clone();
            flipped[i] ^= 1;
            let text = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&flipped);
            if let Ok(claim) = SessionKey::parse(&text) {
                assert_eq!(key.check(&claim, "hash-a", NOW), CookieCheck::BadSignature, "byte {i}");
            }
        }
    }

    #[test]
    fn a_cookie_that_is_not_ours_is_couchdbs_400() {
        for value in ["not base64!", "c2hvcnQ", "YWRtaW46NjU5RjQ1MEI6abc"] {
            let err = SessionKey::parse(value).unwrap_err();
            assert_eq!(err.status, StatusCode::BAD_REQUEST, "{value}");
            assert_eq!(err.reason, "Malformed AuthSession cookie. Please clear your cookies.");
        }
    }

    #[test]
    fn set_cookie_has_the_attributes_clients_parse() {
        let set_cookie = key().set_cookie("alice", "h", NOW);
        let text = set_cookie.to_str().unwrap();
        let expires = chrono::DateTime::from_timestamp((NOW + 600) as i64, 0).unwrap();
        let expected_tail = format!("; Version=1; Expires={}; Max-Age=600; Path=/; HttpOnly", expires.to_rfc2822());
        // chrono writes `+0000` where cookies say `GMT`.
        assert_eq!(
            text.split_once(';').map(|(_, tail)| format!(";{tail}")),
            Some(expected_tail.replace("+0000", "GMT"))
        );
        assert_eq!(text.split("; ").find_map(|a| a.strip_prefix("Expires=")), Some("Tue, 14 Nov 2023 22:23:20 GMT"));
        let claim = SessionKey::parse(&cookie_of(&set_cookie)).unwrap();
        assert_eq!(key().check(&claim, "h", NOW), CookieCheck::Valid { refresh: false });
        assert!(clear_cookie().to_str().unwrap().starts_with("AuthSession=; "));
        assert!(clear_cookie().to_str().unwrap().contains("Max-Age=0"));
    }

    #[test]
    fn login_bodies_in_both_forms() {
        let alice = || LoginForm { name: "alice".into(), password: "p w&=".into() };
        let form = form_headers("application/x-www-form-urlencoded; charset=utf-8");
        let json = form_headers("application/json");
        let none = HeaderMap::new();
        for (headers, body) in [
            (&form, &b"name=alice&password=p+w%26%3D"[..]),
            (&form, b"username=alice&password=p%20w%26%3D&name=alice"),
            (&json, br#"{"name":"alice","password":"p w&="}"#),
            (&json, br#"{"username":"alice","password":"p w&=","extra":[1]}"#),
            (&none, br#" {"username":"alice","password":"p w&="}"#),
            (&none, b"name=alice&password=p+w%26%3D"),
        ] {
            let text = String::from_utf8_lossy(body);
            assert_eq!(LoginForm::parse(headers, body).unwrap(), alice(), "{text}");
        }
        assert_eq!(LoginForm::parse(&json, br#"{"name":"bob"}"#).unwrap().password, "");
        for (headers, body, reason) in [
            (&form, &b"password=x"[..], "request body must contain a username"),
            (&json, br#"{"password":"x"}"#, "request body must contain a username"),
            (&form, b"name=a&username=b", "request body contains different usernames"),
            (&json, br#"{"name":1,"password":"x"}"#, "name must be a string"),
            (&json, br#"{"name":"a","password":null}"#, "password must be a string"),
            (&json, br#"["alice"]"#, "request body must be a JSON object"),
            (&json, b"{", "request body is not valid JSON"),
            (&form_headers("text/plain"), b"name=a", "Content-Type \"text/plain\" is not accepted"),
        ] {
            let err = LoginForm::parse(headers, body).unwrap_err();
            assert_eq!(err.status, StatusCode::BAD_REQUEST);
            assert!(err.reason.starts_with(reason), "{} => {}", String::from_utf8_lossy(body), err.reason);
        }
    }

    #[tokio::test]
    async fn post_session_sets_a_cookie_that_then_authenticates() {
        let auth = two_logins();
        let body = Bytes::from_static(b"name=alice&password=alice-pw");
        let form = form_headers("application/x-www-form-urlencoded");
        let response = post_session(&auth, &form, None, body).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
        let cookie = cookie_of(&response.headers()[header::SET_COOKIE]);
        assert_eq!(body_json(response).await, json!({ "ok": true, "name": "alice", "roles": [] }));
        let identity = auth.identify(&with_cookie(&cookie)).await.unwrap();
        assert_eq!(identity.name.as_deref(), Some("alice"));
        assert_eq!(identity.principal, Some(Principal::User("user_123".into())));
        assert_eq!(identity.method, AuthMethod::Cookie);

        let json = form_headers("application/json");
        let body = Bytes::from_static(br#"{"username":"admin","password":"admin-pw"}"#);
        let response = post_session(&auth, &json, None, body).await;
        assert_eq!(body_json(response).await, json!({ "ok": true, "name": "admin", "roles": ["_admin"] }));
    }

    #[tokio::test]
    async fn a_failed_login_is_couchdbs_401_and_clears_the_cookie() {
        let auth = two_logins();
        let body = Bytes::from_static(b"name=admin&password=wrong");
        let response = post_session(&auth, &form_headers("application/x-www-form-urlencoded"), None, body).await;
        let (status, fixture_body) = fixture_response(AUTH_WRONG_PASSWORD);
        assert_eq!(response.status(), status);
        assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
        assert_eq!(response.headers()[header::SET_COOKIE], clear_cookie());
        assert_eq!(body_json(response).await, fixture_body);
    }

    #[tokio::test]
    async fn next_redirects_only_to_a_path_on_this_server() {
        let auth = two_logins();
        let form = form_headers("application/x-www-form-urlencoded");
        let login = || Bytes::from_static(b"name=alice&password=alice-pw");
        let response = post_session(&auth, &form, Some("next=%2F_utils%2F"), login()).await;
        assert_eq!(response.status(), StatusCode::FOUND);
        assert_eq!(response.headers()[header::LOCATION], "/_utils/");
        assert!(response.headers().contains_key(header::SET_COOKIE));
        for next in ["https%3A%2F%2Fevil.example%2F", "%2F%2Fevil.example", "%2F%5Cevil", "relative", "%2Fa%20b"] {
            let response = post_session(&auth, &form, Some(&format!("next={next}")), login()).await;
            assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{next}");
            assert!(!response.headers().contains_key(header::SET_COOKIE), "{next}");
        }
        let response = delete_session(Some("next=/"));
        assert_eq!(
            (response.status(), &response.headers()[header::LOCATION]),
            (StatusCode::FOUND, &"/".parse().unwrap())
        );
    }

    #[tokio::test]
    async fn get_session_reports_who_asks_and_how() {
        let auth = two_logins();
        let handlers = json!(["cookie", "default"]);
        let anonymous = get_session(&auth, &HeaderMap::new(), None).await;
        assert_eq!(anonymous.headers()[header::CONTENT_TYPE], "application/json");
        assert_eq!(
            body_json(anonymous).await,
            json!({ "ok": true, "userCtx": { "name": null, "roles": [] }, "info": { "authentication_handlers": handlers } })
        );
        let by_basic = body_json(get_session(&auth, &basic("admin", "admin-pw"), None).await).await;
        assert_eq!(by_basic["userCtx"], json!({ "name": "admin", "roles": ["_admin"] }));
        assert_eq!(by_basic["info"]["authenticated"], "default");
        let cookie = auth.sessions.sign("alice", &cheap_hash("alice-pw"), unix_now());
        let by_cookie = body_json(get_session(&auth, &with_cookie(&cookie), None).await).await;
        assert_eq!(by_cookie["userCtx"], json!({ "name": "alice", "roles": [] }));
        assert_eq!(by_cookie["info"]["authenticated"], "cookie");
        // Wrong Basic credentials are refused here too; `?basic=true` asks anonymous callers to log in.
        assert_eq!(get_session(&auth, &basic("admin", "x"), None).await.status(), StatusCode::UNAUTHORIZED);
        let please = get_session(&auth, &HeaderMap::new(), Some("basic=true")).await;
        assert_eq!(please.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(body_json(please).await, json!({ "error": "unauthorized", "reason": "Please login." }));

        let open = CouchAuth::from_settings(&settings("").unwrap()).unwrap();
        let body = body_json(get_session(&open, &HeaderMap::new(), None).await).await;
        assert_eq!(body["userCtx"], json!({ "name": null, "roles": ["_admin"] }));
    }

    #[tokio::test]
    async fn an_aging_cookie_is_refreshed_on_the_response() {
        let auth = two_logins();
        let hash = cheap_hash("alice-pw");
        let issued = unix_now() - 120;
        let old = auth.sessions.sign("alice", &hash, issued);
        let response = get_session(&auth, &with_cookie(&old), None).await;
        let fresh = cookie_of(&response.headers()[header::SET_COOKIE]);
        let claim = SessionKey::parse(&fresh).unwrap();
        assert!(claim.issued_at >= issued + 120, "the new cookie starts now");
        assert_eq!(auth.sessions.check(&claim, &hash, claim.issued_at), CookieCheck::Valid { refresh: false });
        // A young cookie is left alone.
        let young = auth.sessions.sign("alice", &hash, unix_now());
        assert!(!get_session(&auth, &with_cookie(&young), None).await.headers().contains_key(header::SET_COOKIE));
        // A login's own cookie is not overwritten by the refresh.
        let identity = auth.identify(&with_cookie(&old)).await.unwrap();
        let mut response = delete_session(None);
        identity.add_refreshed_cookie(&mut response);
        assert_eq!(response.headers().get_all(header::SET_COOKIE).iter().collect::<Vec<_>>(), vec![clear_cookie()]);
    }

    #[tokio::test]
    async fn expired_or_forged_cookies_fall_back_to_basic_or_anonymous() {
        let auth = two_logins();
        let hash = cheap_hash("alice-pw");
        let expired = auth.sessions.sign("alice", &hash, unix_now() - 601);
        assert_eq!(auth.authenticate(&with_cookie(&expired)).await.unwrap(), None);
        let forged = SessionKey::new(vec![1; 32], 600).sign("admin", &cheap_hash("admin-pw"), unix_now());
        assert_eq!(auth.authenticate(&with_cookie(&forged)).await.unwrap(), None);
        let unknown = auth.sessions.sign("mallory", &hash, unix_now());
        assert_eq!(auth.authenticate(&with_cookie(&unknown)).await.unwrap(), None);
        // An expired cookie beside valid Basic credentials: Basic decides.
        let mut headers = basic("admin", "admin-pw");
        headers.insert(header::COOKIE, HeaderValue::from_str(&format!("AuthSession={expired}")).unwrap());
        assert_eq!(auth.authenticate(&headers).await.unwrap(), Some(Principal::Admin));
        // A valid cookie wins over Basic credentials, as in CouchDB.
        let valid = auth.sessions.sign("alice", &hash, unix_now());
        let mut headers = basic("admin", "wrong");
        headers.insert(header::COOKIE, HeaderValue::from_str(&format!("AuthSession={valid}")).unwrap());
        assert_eq!(auth.authenticate(&headers).await.unwrap(), Some(Principal::User("user_123".into())));
    }

    #[tokio::test]
    async fn delete_session_clears_the_cookie() {
        let response = delete_session(None);
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
        assert_eq!(response.headers()[header::SET_COOKIE], clear_cookie());
        assert_eq!(body_json(response).await, json!({ "ok": true }));
    }

    #[tokio::test]
    async fn with_no_logins_any_login_succeeds_as_admin() {
        // CouchDB's replicator first POSTs /_session and fails the job on anything but 200 or 404.
        let open = CouchAuth::from_settings(&settings("").unwrap()).unwrap();
        let body = Bytes::from_static(br#"{"name":"replicator","password":"x"}"#);
        let response = post_session(&open, &form_headers("application/json"), None, body).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert!(response.headers().contains_key(header::SET_COOKIE));
        assert_eq!(body_json(response).await, json!({ "ok": true, "name": "replicator", "roles": ["_admin"] }));
    }

    #[test]
    fn session_settings_are_read() {
        let loaded =
            settings(&format!("couchdb_session_secret = \"{}\"\ncouchdb_session_timeout_secs = 30", "0f".repeat(16)));
        let key = SessionKey::from_settings(&loaded.unwrap()).unwrap();
        assert_eq!((key.secrets().current.clone(), key.timeout_secs), (vec![0x0f; 16], 30));
        let default = SessionKey::from_settings(&settings("").unwrap()).unwrap();
        assert_eq!((default.secrets().current.len(), default.timeout_secs), (32, 600));
        let other = SessionKey::from_settings(&settings("").unwrap()).unwrap();
        assert_ne!(default.secrets().current, other.secrets().current, "random per process");
    }
}
