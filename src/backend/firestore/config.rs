//! The Firestore backend URL:
//! `firestore://PROJECT?database=DB&collection=NAME&emulator=HOST:PORT&credentials=FILE&endpoint=URL`.
//!
//! The database defaults to `(default)` and the collection to `agent_data_store`. The project may
//! be left out (`firestore://`) and is then taken from `GOOGLE_CLOUD_PROJECT` or the credentials.
//! With `emulator=` (or `FIRESTORE_EMULATOR_HOST` in the environment) requests go to that emulator
//! over plain HTTP with no credentials. Otherwise credentials come from `credentials=FILE` (a
//! service-account key) or Google's application-default chain. `endpoint=` replaces
//! `https://firestore.googleapis.com` (a regional endpoint, or a test server). `revs_limit=N`
//! (default 1000, at most 2000 so the ancestry fits beside a full document) is how many revision
//! ids each document remembers; `settle_ms=N` (default 5000) is the change feed's settle window
//! (see `docs/firestore-layout.md`); `count_max_age_ms=N` (default 60000; `0` counts every time)
//! is the most a count of the change feed's entries is served again, each time only after a check
//! that no write or erasure landed since (`raw::count_cache`, `count_check.rs`).

use std::time::Duration;

use crate::backend::url::query::{decode, url_error, QueryParams};
use crate::error::Result;

/// How errors name this adapter's URL.
const ADAPTER: &str = "Firestore";

pub const DEFAULT_DATABASE: &str = "(default)";
pub const DEFAULT_COLLECTION: &str = crate::model::COLLECTION;
pub const PRODUCTION_ENDPOINT: &str = "https://firestore.googleapis.com";
/// The environment variable Google's client libraries read for the emulator's address.
pub const EMULATOR_ENV: &str = "FIRESTORE_EMULATOR_HOST";
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// The most revision ids a document may remember: 16 bytes each, beside a body of up to
/// 1,000,000 bytes in a document Firestore limits to 1,048,576.
pub const MAX_REVS_LIMIT: usize = 2000;
/// How far before the last read time a change-feed sweep looks for late request times.
pub const DEFAULT_SETTLE: Duration = Duration::from_secs(5);
/// The most a count of the feed's entries is served again, unless this process writes first.
/// Each use is checked first (the feed's latest entries and the purge trace), so another
/// process's write shows at the next request whatever the age.
pub const DEFAULT_COUNT_MAX_AGE: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FirestoreConfig {
    /// `None`: find it in the environment or the credentials when connecting.
    pub project: Option<String>,
    pub database: String,
    pub collection: String,
    /// `HOST:PORT` of an emulator: plain HTTP, no credentials.
    pub emulator: Option<String>,
    /// A service-account key file; `None` uses the application-default chain.
    pub credentials: Option<String>,
    /// Base URL of the REST API (no trailing slash).
    pub endpoint: String,
    pub timeout: Duration,
    /// How many revision ids each document remembers.
    pub revs_limit: usize,
    /// The change feed's settle window: the most a write's request time may precede its commit.
    pub settle: Duration,
    /// The most a checked count of the feed's entries is served again (`count_max_age_ms`).
    pub count_max_age: Duration,
    /// The document the collections live under (`{catalog collection}/{database}` for a
    /// database of the catalog, [`super::catalog`]); `None`, the data store's case: at the root
    /// of the Firestore database. Not a URL setting.
    pub parent: Option<String>,
}

impl FirestoreConfig {
    /// Parses a `firestore://` URL. `FIRESTORE_EMULATOR_HOST` applies when the URL names neither an
    /// emulator nor an endpoint.
    pub fn parse(text: &str) -> Result<Self> {
        Self::parse_with_env(text, std::env::var(EMULATOR_ENV).ok())
    }

    fn parse_with_env(text: &str, emulator_env: Option<String>) -> Result<Self> {
        let bad = |problem: String| url_error(ADAPTER, problem);
        let rest = text.strip_prefix("firestore://").ok_or_else(|| bad("must start with firestore://".into()))?;
        let (project, query) = rest.split_once('?').unwrap_or((rest, ""));
        let project = decode(project.trim_end_matches('/'));
        let project = if project.is_empty() {
            None
        } else {
            check_project(&project).map_err(bad)?;
            Some(project)
        };
        let params = QueryParams::parse(
            ADAPTER,
            query,
            &[
                "database",
                "collection",
                "emulator",
                "credentials",
                "endpoint",
                "timeout_ms",
                "revs_limit",
                "settle_ms",
                "count_max_age_ms",
            ],
        )?;
        let database = params.text("database").unwrap_or(DEFAULT_DATABASE);
        check_database(database).map_err(bad)?;
        let collection = params.text("collection").unwrap_or(DEFAULT_COLLECTION);
        check_collection(collection).map_err(bad)?;
        let emulator = params.text("emulator").map(check_host_port).transpose().map_err(bad)?;
        let credentials = match params.text("credentials") {
            Some("") => return Err(bad("credentials= needs a service-account key file path".into())),
            credentials => credentials.map(str::to_owned),
        };
        let endpoint = params.url("endpoint")?;
        let endpoint_given = endpoint.is_some();
        let mut config = FirestoreConfig {
            project,
            database: database.to_owned(),
            collection: collection.to_owned(),
            emulator,
            credentials,
            endpoint: endpoint.map_or_else(|| PRODUCTION_ENDPOINT.into(), |e| e.trim_end_matches('/').to_owned()),
            timeout: params
                .whole("timeout_ms", 0..=u64::MAX)?
                .map_or(DEFAULT_TIMEOUT, |ms| Duration::from_millis(ms.max(1))),
            revs_limit: params.revs_limit(MAX_REVS_LIMIT)?,
            settle: params.whole("settle_ms", 0..=u64::MAX)?.map_or(DEFAULT_SETTLE, Duration::from_millis),
            count_max_age: params
                .whole("count_max_age_ms", 0..=u64::from(u32::MAX))?
                .map_or(DEFAULT_COUNT_MAX_AGE, Duration::from_millis),
            parent: None,
        };
        if config.emulator.is_none() && !endpoint_given {
            if let Some(host) = emulator_env.filter(|h| !h.is_empty()) {
                config.emulator =
                    Some(check_host_port(&host).map_err(|e| bad(format!("{EMULATOR_ENV}={host:?}: {e}")))?);
            }
        }
        if let Some(host) = &config.emulator {
            if endpoint_given {
                return Err(bad("give either emulator= or endpoint=, not both".into()));
            }
            config.endpoint = format!("http://{host}");
        }
        Ok(config)
    }

    /// Whether requests go to an emulator (no credentials).
    pub fn is_emulator(&self) -> bool {
        self.emulator.is_some()
    }

    /// The URL with nothing secret in it (a key file's path is not secret).
    pub fn redacted(&self) -> String {
        let mut out = format!("firestore://{}", self.project.as_deref().unwrap_or(""));
        let mut params = Vec::new();
        if self.database != DEFAULT_DATABASE {
            params.push(format!("database={}", self.database));
        }
        if self.collection != DEFAULT_COLLECTION {
            params.push(format!("collection={}", self.collection));
        }
        if let Some(parent) = &self.parent {
            params.push(format!("parent={parent}"));
        }
        if let Some(host) = &self.emulator {
            params.push(format!("emulator={host}"));
        } else if self.endpoint != PRODUCTION_ENDPOINT {
            params.push(format!("endpoint={}", self.endpoint));
        }
        if let Some(file) = &self.credentials {
            params.push(format!("credentials={file}"));
        }
        if self.revs_limit != crate::backend::DEFAULT_REVS_LIMIT {
            params.push(format!("revs_limit={}", self.revs_limit));
        }
        if !params.is_empty() {
            out.push('?');
            out.push_str(&params.join("&"));
        }
        out
    }
}

/// Google Cloud project ids: 6–30 of lowercase letters, digits and hyphens, starting with a
/// letter. Emulators accept anything, so only characters that would break a resource path are
/// refused outright.
fn check_project(project: &str) -> std::result::Result<(), String> {
    if project.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
        Ok(())
    } else {
        Err(format!("{project:?} is not a valid project id (letters, digits and hyphens)"))
    }
}

/// `(default)`, or 4–63 of lowercase letters, digits and hyphens.
fn check_database(database: &str) -> std::result::Result<(), String> {
    let named = (4..=63).contains(&database.len())
        && database.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if database == DEFAULT_DATABASE || named {
        Ok(())
    } else {
        Err(format!("{database:?} is not a valid database id ((default), or 4-63 of a-z 0-9 -)"))
    }
}

/// Collection ids: no `/`, not `.`/`..`, not `__…__`, at most 1,500 bytes.
fn check_collection(collection: &str) -> std::result::Result<(), String> {
    let reserved = collection.len() >= 4 && collection.starts_with("__") && collection.ends_with("__");
    if collection.is_empty()
        || collection.len() > 1500
        || collection.contains('/')
        || collection == "."
        || collection == ".."
        || reserved
    {
        Err(format!("{collection:?} is not a valid collection id"))
    } else {
        Ok(())
    }
}

fn check_host_port(value: &str) -> std::result::Result<String, String> {
    let host = value.strip_prefix("http://").unwrap_or(value).trim_end_matches('/');
    match host.rsplit_once(':') {
        Some((name, port)) if !name.is_empty() && port.parse::<u16>().is_ok() => Ok(host.to_owned()),
        _ => Err(format!("emulator address {value:?} is not HOST:PORT")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_forms() {
        let c = FirestoreConfig::parse_with_env("firestore://my-project", None).unwrap();
        assert_eq!(c.project.as_deref(), Some("my-project"));
        assert_eq!(c.database, DEFAULT_DATABASE);
        assert_eq!(c.collection, DEFAULT_COLLECTION);
        assert_eq!(c.endpoint, PRODUCTION_ENDPOINT);
        assert!(!c.is_emulator());
        assert_eq!(c.redacted(), "firestore://my-project");

        let c = FirestoreConfig::parse_with_env(
            "firestore://p1?database=agents-eu&collection=docs&emulator=127.0.0.1:8080",
            None,
        )
        .unwrap();
        assert_eq!(c.database, "agents-eu");
        assert_eq!(c.collection, "docs");
        assert_eq!(c.endpoint, "http://127.0.0.1:8080");
        assert_eq!(c.redacted(), "firestore://p1?database=agents-eu&collection=docs&emulator=127.0.0.1:8080");

        let c = FirestoreConfig::parse_with_env("firestore://?credentials=%2Fetc%2Fkey.json", None).unwrap();
        assert_eq!(c.project, None);
        assert_eq!(c.credentials.as_deref(), Some("/etc/key.json"));
        assert_eq!((c.revs_limit, c.settle, c.count_max_age), (1000, DEFAULT_SETTLE, DEFAULT_COUNT_MAX_AGE));
        let c = FirestoreConfig::parse_with_env("firestore://p?count_max_age_ms=0", None).unwrap();
        assert_eq!(c.count_max_age, Duration::ZERO);

        let c = FirestoreConfig::parse_with_env("firestore://p?revs_limit=3&settle_ms=250", None).unwrap();
        assert_eq!((c.revs_limit, c.settle), (3, Duration::from_millis(250)));
        assert_eq!(c.redacted(), "firestore://p?revs_limit=3");
    }

    #[test]
    fn the_emulator_variable_applies_unless_the_url_says_otherwise() {
        let env = Some("localhost:9000".to_owned());
        let c = FirestoreConfig::parse_with_env("firestore://p", env.clone()).unwrap();
        assert_eq!(c.endpoint, "http://localhost:9000");
        let c = FirestoreConfig::parse_with_env("firestore://p?endpoint=http://127.0.0.1:1", env.clone()).unwrap();
        assert!(!c.is_emulator());
        assert_eq!(c.endpoint, "http://127.0.0.1:1");
        assert!(FirestoreConfig::parse_with_env("firestore://p", Some("nonsense".into())).is_err());
    }

    #[test]
    fn refuses_bad_urls() {
        for bad in [
            "firestore:/p",
            "fs://p",
            "firestore://bad/project",
            "firestore://p?database=X",
            "firestore://p?collection=a/b",
            "firestore://p?collection=__x__",
            "firestore://p?emulator=nohost",
            "firestore://p?emulator=h:1&endpoint=http://x",
            "firestore://p?endpoint=not a url",
            "firestore://p?timeout_ms=soon",
            "firestore://p?revs_limit=0",
            "firestore://p?revs_limit=2001",
            "firestore://p?settle_ms=-1",
            "firestore://p?x=1",
        ] {
            assert!(FirestoreConfig::parse_with_env(bad, None).is_err(), "{bad}");
        }
    }
}
