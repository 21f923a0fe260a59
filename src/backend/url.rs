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
                // Accept `embedded:PATH` and `embedded://PATH`, with an optional `?revs_limit=N`.
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
                write!(f, "embedded:{}?revs_limit={}", path.display(), options.revs_limit)
            }
            BackendUrl::CouchDb(config) => f.write_str(&config.redacted()),
            BackendUrl::DynamoDb(config) => f.write_str(&config.redacted()),
            BackendUrl::Firestore(config) => f.write_str(&config.redacted()),
        }
    }
}

/// Splits `?revs_limit=N` off an embedded path. Only that exact setting is recognised, so a path
/// that merely contains `?` keeps working.
fn embedded_options(path: &str) -> Result<(&str, EmbeddedOptions)> {
    let mut options = EmbeddedOptions::default();
    let Some((file, query)) = path.rsplit_once("?revs_limit=") else {
        return Ok((path, options));
    };
    options.revs_limit = match query.parse::<usize>() {
        Ok(limit) if limit >= 1 => limit,
        _ => {
            return Err(Error::invalid(
                "backend",
                format!("revs_limit must be a whole number of at least 1, not {query:?}"),
            ))
        }
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
        assert_eq!(url, BackendUrl::Embedded { path: "a.redb".into(), options: EmbeddedOptions { revs_limit: 10 } });
        assert_eq!(url.to_string(), "embedded:a.redb?revs_limit=10");
        assert!("embedded:a.redb?revs_limit=0".parse::<BackendUrl>().is_err());
    }

    #[test]
    fn rejects_unknown_and_empty() {
        for bad in ["", "embedded:", "nosuch://x", "/just/a/path"] {
            let err = bad.parse::<BackendUrl>().unwrap_err();
            assert!(err.to_string().contains("backend"), "{bad}: {err}");
        }
    }
}
