//! Bearer-token access control. Tokens are configured by their SHA-256 hash, never in clear; each
//! is scoped to one user id, or to all users (admin). A token for user A gets 403 on user B's
//! paths.

use std::collections::HashMap;

use axum::http::{header, HeaderMap, StatusCode};
use sha2::{Digest, Sha256};

use super::error::ApiError;
use crate::config::TokenSetting;
use crate::error::{Error, Result};
use crate::model::Limits;

/// What a token may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    Admin,
    User(String),
}

/// The configured tokens, keyed by hash.
#[derive(Debug, Default)]
pub struct Auth {
    tokens: HashMap<[u8; 32], Scope>,
}

/// The hex SHA-256 of a token: what goes in the configuration.
pub fn hash_token(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

impl Auth {
    pub fn from_settings(entries: &[TokenSetting], limits: &Limits) -> Result<Self> {
        let mut tokens = HashMap::new();
        for (i, entry) in entries.iter().enumerate() {
            let field = format!("tokens[{i}]");
            let mut hash = [0u8; 32];
            hex::decode_to_slice(entry.sha256.trim(), &mut hash)
                .map_err(|_| Error::invalid(&field, "sha256 must be 64 hex digits (see `agentstore hash-token`)"))?;
            let scope = match (&entry.user, entry.admin) {
                (Some(user), false) => {
                    limits.check_user_id(user).map_err(|e| Error::invalid(&field, e.message()))?;
                    Scope::User(user.clone())
                }
                (None, true) => Scope::Admin,
                _ => return Err(Error::invalid(&field, "needs exactly one of `user = \"…\"` or `admin = true`")),
            };
            if tokens.insert(hash, scope).is_some() {
                return Err(Error::invalid(&field, "the same token hash is configured twice"));
            }
        }
        Ok(Auth { tokens })
    }

    /// No tokens configured: every request is allowed.
    pub fn is_open(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn token_count(&self) -> usize {
        self.tokens.len()
    }

    /// Checks the request's bearer token against the user it addresses.
    pub fn authorize(&self, headers: &HeaderMap, user: &str) -> std::result::Result<(), ApiError> {
        match self.scope(headers)? {
            None | Some(Scope::Admin) => Ok(()),
            Some(Scope::User(allowed)) if allowed == user => Ok(()),
            Some(Scope::User(_)) => Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                format!("this token may not access user {user:?}"),
            )),
        }
    }

    /// Checks that the request's bearer token is an admin token (for routes that see every
    /// user's data).
    pub fn authorize_admin(&self, headers: &HeaderMap, what: &str) -> std::result::Result<(), ApiError> {
        match self.scope(headers)? {
            None | Some(Scope::Admin) => Ok(()),
            Some(Scope::User(_)) => {
                Err(ApiError::new(StatusCode::FORBIDDEN, "forbidden", format!("{what} needs an admin token")))
            }
        }
    }

    /// The scope of the request's bearer token; `None` when no tokens are configured.
    fn scope(&self, headers: &HeaderMap) -> std::result::Result<Option<&Scope>, ApiError> {
        if self.is_open() {
            return Ok(None);
        }
        let unauthorized = |reason: &str| ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", reason);
        let value = headers
            .get(header::AUTHORIZATION)
            .ok_or_else(|| unauthorized("an Authorization: Bearer token is required"))?;
        // The scheme name is case-insensitive (RFC 9110 §11.1); one or more spaces follow it.
        let token = value
            .to_str()
            .ok()
            .and_then(|v| v.trim_start().split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim())
            .filter(|t| !t.is_empty())
            .ok_or_else(|| unauthorized("the Authorization header must be `Bearer <token>`"))?;
        let hash: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        self.tokens.get(&hash).map(Some).ok_or_else(|| unauthorized("the bearer token is not valid"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn auth() -> Auth {
        let entries = vec![
            TokenSetting { sha256: hash_token("alice-token"), user: Some("alice".into()), admin: false },
            TokenSetting { sha256: hash_token("root-token"), user: None, admin: true },
        ];
        Auth::from_settings(&entries, &Limits::default()).unwrap()
    }

    fn headers(token: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_str(&format!("Bearer {token}")).unwrap());
        h
    }

    #[test]
    fn scopes() {
        let auth = auth();
        assert!(auth.authorize(&headers("alice-token"), "alice").is_ok());
        assert_eq!(auth.authorize(&headers("alice-token"), "bob").unwrap_err().status, StatusCode::FORBIDDEN);
        assert!(auth.authorize(&headers("root-token"), "bob").is_ok());
        assert_eq!(auth.authorize(&headers("nope"), "alice").unwrap_err().status, StatusCode::UNAUTHORIZED);
        assert_eq!(auth.authorize(&HeaderMap::new(), "alice").unwrap_err().status, StatusCode::UNAUTHORIZED);
        assert!(auth.authorize_admin(&headers("root-token"), "the feed").is_ok());
        let refused = auth.authorize_admin(&headers("alice-token"), "the feed").unwrap_err();
        assert_eq!((refused.status, refused.reason.as_str()), (StatusCode::FORBIDDEN, "the feed needs an admin token"));
        assert_eq!(auth.authorize_admin(&headers("nope"), "the feed").unwrap_err().status, StatusCode::UNAUTHORIZED);
        assert!(Auth::default().authorize_admin(&HeaderMap::new(), "the feed").is_ok(), "no tokens: open");
    }

    #[test]
    fn the_scheme_is_case_insensitive() {
        let auth = auth();
        let with = |value: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, HeaderValue::from_str(value).unwrap());
            auth.authorize(&h, "alice").map_err(|e| e.status)
        };
        for ok in ["Bearer alice-token", "BEARER alice-token", "bEaReR   alice-token", "bearer alice-token "] {
            assert_eq!(with(ok), Ok(()), "{ok}");
        }
        for bad in ["Basic alice-token", "Bearer", "Bearer ", "Beareralice-token", "alice-token"] {
            assert_eq!(with(bad), Err(StatusCode::UNAUTHORIZED), "{bad}");
        }
    }

    #[test]
    fn bad_settings_are_refused() {
        let bad = |sha256: &str, user: Option<&str>, admin| {
            let entry = TokenSetting { sha256: sha256.into(), user: user.map(Into::into), admin };
            Auth::from_settings(&[entry], &Limits::default()).unwrap_err().to_string()
        };
        assert!(bad("xyz", Some("a"), false).contains("64 hex"));
        assert!(bad(&hash_token("t"), None, false).contains("exactly one"));
        assert!(bad(&hash_token("t"), Some("a"), true).contains("exactly one"));
        assert!(bad(&hash_token("t"), Some("a:b"), false).contains("tokens[0]"));
        assert_eq!(hash_token("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }
}
