//! Backend URLs: one string names a backend and where it lives, as database URLs do everywhere.
//!
//! `embedded:PATH` is the embedded store in one file (relative paths are relative to the working
//! directory). `couchdb+http(s)://`, `dynamodb://` and `firestore://` are documented with their
//! adapters' configs.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use super::couchdb::CouchConfig;
use super::dynamodb::DynamoConfig;
use super::embedded::EmbeddedOptions;
use super::firestore::FirestoreConfig;
use crate::error::{Error, Result};
use query::QueryParams;

pub mod query;

/// The default backend: the embedded store under `./data`.
pub const DEFAULT_BACKEND_URL: &str = "embedded:./data/agentstore.redb";

/// A parsed backend URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendUrl {
    Embedded { path: PathBuf, options: EmbeddedOptions },
    CouchDb(CouchConfig),
    DynamoDb(DynamoConfig),
    Firestore(FirestoreConfig),
}

impl FromStr for BackendUrl {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        let (scheme, rest) = text.split_once(':').ok_or_else(|| {
            Error::invalid("backend", format!("{text:?} is not a backend URL; expected e.g. {DEFAULT_BACKEND_URL}"))
        })?;
        match scheme {
            "embedded" => {
                // Accept `embedded:PATH` and `embedded://PATH`, with optional `?revs_limit=N&cache_mb=M`.
                let path = rest.strip_prefix("//").unwrap_or(rest);
                let (path, options) = embedded_options(path)?;
                if path.is_empty() {
                    return Err(Error::invalid(
                        "backend",
                        "embedded: needs a file path, e.g. embedded:./data/agentstore.redb",
                    ));
                }
                Ok(BackendUrl::Embedded { path: PathBuf::from(path), options })
            }
            "couchdb+http" | "couchdb+https" => Ok(BackendUrl::CouchDb(CouchConfig::parse(text)?)),
            "dynamodb" => Ok(BackendUrl::DynamoDb(DynamoConfig::parse(text)?)),
            "firestore" => Ok(BackendUrl::Firestore(FirestoreConfig::parse(text)?)),
            other => Err(Error::invalid(
                "backend",
                format!(
                    "unknown backend scheme {other:?}; supported: embedded:PATH, couchdb+http://USER:PASS@HOST:PORT/DB, \
                     couchdb+https://…, dynamodb://TABLE?region=R&endpoint=URL, \
                     firestore://PROJECT?database=DB&emulator=HOST:PORT"
                ),
            )),
        }
    }
}

impl fmt::Display for BackendUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendUrl::Embedded { path, options } if *options == EmbeddedOptions::default() => {
                write!(f, "embedded:{}", path.display())
            }
            BackendUrl::Embedded { path, options } => {
                let defaults = EmbeddedOptions::default();
                let mut settings = Vec::new();
                if options.revs_limit != defaults.revs_limit {
                    settings.push(format!("revs_limit={}", options.revs_limit));
                }
                if options.cache_bytes != defaults.cache_bytes {
                    settings.push(format!("cache_mb={}", options.cache_bytes >> 20));
                }
                write!(f, "embedded:{}?{}", path.display(), settings.join("&"))
            }
            BackendUrl::CouchDb(config) => f.write_str(&config.redacted()),
            BackendUrl::DynamoDb(config) => f.write_str(&config.redacted()),
            BackendUrl::Firestore(config) => f.write_str(&config.redacted()),
        }
    }
}

/// The settings an embedded URL may carry after `?`.
const EMBEDDED_SETTINGS: [&str; 2] = ["revs_limit", "cache_mb"];

/// Splits `?revs_limit=N&cache_mb=M` off an embedded path. A `?` followed by none of these
/// settings is part of the file name, so a path that merely contains `?` keeps working; a query
/// that names one of them must name only known settings.
fn embedded_options(path: &str) -> Result<(&str, EmbeddedOptions)> {
    let Some((file, query)) = path.rsplit_once('?') else {
        return Ok((path, EmbeddedOptions::default()));
    };
    let pairs = query::split_pairs(query);
    if !pairs.iter().any(|(key, value)| value.is_some() && EMBEDDED_SETTINGS.contains(&key.as_str())) {
        return Ok((path, EmbeddedOptions::default()));
    }
    if query.split('&').count() != pairs.len() || pairs.iter().any(|(_, value)| value.is_none()) {
        return Err(query::url_error("embedded", format!("{query:?}: settings are KEY=VALUE pairs joined by &")));
    }
    let params = QueryParams::parse("embedded", query, &EMBEDDED_SETTINGS)?;
    let cache_mb = params.whole("cache_mb", 1..=u64::MAX)?;
    let options = EmbeddedOptions {
        revs_limit: params.revs_limit(usize::MAX)?,
        cache_bytes: match cache_mb {
            // Saturating, as before: an absurd size asks for the most, never wraps to a small one.
            Some(mb) => usize::try_from(mb).unwrap_or(usize::MAX).saturating_mul(1 << 20),
            None => EmbeddedOptions::default().cache_bytes,
        },
    };
    Ok((file, options))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_embedded() {
        let url: BackendUrl = DEFAULT_BACKEND_URL.parse().unwrap();
        assert_eq!(url, BackendUrl::Embedded { path: "./data/agentstore.redb".into(), options: Default::default() });
        assert_eq!(url.to_string(), DEFAULT_BACKEND_URL);
        let url: BackendUrl = "embedded:///var/lib/a.redb".parse().unwrap();
        assert_eq!(url, BackendUrl::Embedded { path: "/var/lib/a.redb".into(), options: Default::default() });
        let url: BackendUrl = "embedded:a.redb?revs_limit=10".parse().unwrap();
        let options = EmbeddedOptions { revs_limit: 10, ..Default::default() };
        assert_eq!(url, BackendUrl::Embedded { path: "a.redb".into(), options });
        assert_eq!(url.to_string(), "embedded:a.redb?revs_limit=10");
        let url: BackendUrl = "embedded:a.redb?cache_mb=16&revs_limit=3".parse().unwrap();
        let options = EmbeddedOptions { revs_limit: 3, cache_bytes: 16 << 20 };
        assert_eq!(url, BackendUrl::Embedded { path: "a.redb".into(), options });
        assert_eq!(url.to_string(), "embedded:a.redb?revs_limit=3&cache_mb=16");
        let url: BackendUrl = "embedded:odd?name.redb".parse().unwrap();
        assert_eq!(url, BackendUrl::Embedded { path: "odd?name.redb".into(), options: Default::default() });
        for bad in ["embedded:a.redb?revs_limit=0", "embedded:a.redb?cache_mb=0", "embedded:a.redb?cache_mb=1&size=2"] {
            assert!(bad.parse::<BackendUrl>().is_err(), "{bad}");
        }
    }

    #[test]
    fn rejects_unknown_and_empty() {
        for bad in ["", "embedded:", "nosuch://x", "/just/a/path"] {
            let err = bad.parse::<BackendUrl>().unwrap_err();
            assert!(err.to_string().contains("backend"), "{bad}: {err}");
        }
    }

    /// Every adapter's URL refuses an unknown parameter and a bad `revs_limit` in the one style,
    /// naming the adapter and the parameter (before issue 23 each adapter worded these its own way).
    #[test]
    fn every_adapter_words_parameter_errors_alike() {
        for (url, adapter) in [
            ("embedded:a.redb?revs_limit=1&nope=1", "embedded"),
            ("couchdb+http://h/db?nope=1", "CouchDB"),
            ("dynamodb://t11?nope=1", "DynamoDB"),
            ("firestore://p?nope=1", "Firestore"),
        ] {
            let err = url.parse::<BackendUrl>().unwrap_err().to_string();
            let start = format!("invalid backend: {adapter} URL: unknown parameter \"nope\" (known: ");
            assert!(err.starts_with(&start), "{url}: {err}");
            assert!(err.contains("revs_limit"), "{url}: the known parameters are listed: {err}");
        }
        for (url, adapter) in [
            ("embedded:a.redb?revs_limit=0", "embedded"),
            ("couchdb+http://h/db?revs_limit=0", "CouchDB"),
            ("dynamodb://t11?revs_limit=0", "DynamoDB"),
            ("firestore://p?revs_limit=0", "Firestore"),
        ] {
            let err = url.parse::<BackendUrl>().unwrap_err().to_string();
            let start = format!("invalid backend: {adapter} URL: revs_limit=0 is not a whole number ");
            assert!(err.starts_with(&start), "{url}: {err}");
        }
    }
}
