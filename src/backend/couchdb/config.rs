//! The CouchDB backend URL:
//! `couchdb+http://USER:PASS@HOST:PORT/DATABASE?create=true&timeout_secs=30&query_timeout_secs=600&revs_limit=1000&count_max_age_ms=1000`
//! (or `couchdb+https://`). `query_timeout_secs` is how long a passed view or Mango query waits
//! for its answer to begin (CouchDB builds the index first; [`QUERY_TIMEOUT`]). `count_max_age_ms` bounds how stale a remembered document count may
//! be (see [`super::counts`]; `0` asks CouchDB every time). The database defaults to `agent_data_store`; it is created at startup
//! only with `create=true`. Credentials may instead come from the `couchdb_user` /
//! `couchdb_password` settings (`AGENTSTORE_COUCHDB_USER` / `AGENTSTORE_COUCHDB_PASSWORD`), which
//! keeps the password out of the URL.

use std::fmt;
use std::time::Duration;

use url::Url;

use crate::backend::url::query::{decode, url_error, QueryParams};
use crate::error::Result;

/// How errors name this adapter's URL.
const ADAPTER: &str = "CouchDB";

/// The default `query_timeout_secs`: CouchDB answers the first query of a view (or of a Mango
/// index) only once the index is built, which takes minutes on a large database (pouchdb-server
/// needed 66 s for 100,000 documents, docs/views-bench.md); CouchDB itself keeps such a request
/// open as long as the build takes. Ten minutes, so a stalled backend still frees the request.
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(600);

/// The default database, as the spec names the collection.
pub const DEFAULT_DATABASE: &str = crate::model::COLLECTION;

/// Where and how to reach CouchDB.
#[derive(Clone, PartialEq, Eq)]
pub struct CouchConfig {
    /// The server's base URL (`http://host:5984/`), without credentials.
    pub server: Url,
    pub database: String,
    pub user: Option<String>,
    pub password: Option<String>,
    /// Create the database at startup if it does not exist.
    pub create: bool,
    /// Timeout of one HTTP request.
    pub timeout: Duration,
    /// How long a passed request that may build an index first (a view, `_find`) waits for its
    /// answer to begin (`query_timeout_secs`, [`QUERY_TIMEOUT`] by default, never below
    /// `timeout`).
    pub query_timeout: Duration,
    /// How many revision ids `revisions` reports at most. CouchDB keeps its own `_revs_limit`
    /// per database (1000 unless changed) and this never changes it: the answer is the shorter
    /// of the two.
    pub revs_limit: usize,
    /// How long a document count read from CouchDB is served again (`count_max_age_ms`; see
    /// [`super::counts`]).
    pub count_max_age: Duration,
}

impl CouchConfig {
    /// Parses a `couchdb+http://` or `couchdb+https://` URL.
    pub fn parse(text: &str) -> Result<Self> {
        let bad = |problem: String| url_error(ADAPTER, problem);
        let rest = text
            .strip_prefix("couchdb+")
            .ok_or_else(|| bad("must start with couchdb+http:// or couchdb+https://".into()))?;
        let url = Url::parse(rest).map_err(|e| bad(format!("{e}")))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(bad("the scheme must be couchdb+http or couchdb+https".into()));
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(bad("no host".into()));
        }
        let user = (!url.username().is_empty()).then(|| decode(url.username()));
        let password = url.password().map(decode);
        let segments: Vec<String> =
            url.path_segments().map(|s| s.filter(|p| !p.is_empty()).map(decode).collect()).unwrap_or_default();
        let database = match segments.as_slice() {
            [] => DEFAULT_DATABASE.to_owned(),
            [db] => db.clone(),
            _ => return Err(bad("the path must be just the database name".into())),
        };
        check_database_name(&database).map_err(bad)?;
        let params = QueryParams::parse(
            ADAPTER,
            url.query().unwrap_or(""),
            &["create", "timeout_secs", "query_timeout_secs", "revs_limit", "count_max_age_ms"],
        )?;
        let create = params.flag("create")?.unwrap_or(false);
        let timeout = Duration::from_secs(params.whole("timeout_secs", 0..=u64::MAX)?.unwrap_or(30).max(1));
        let query_timeout =
            params.whole("query_timeout_secs", 0..=u64::MAX)?.map_or(QUERY_TIMEOUT, Duration::from_secs).max(timeout);
        let revs_limit = params.revs_limit(usize::MAX)?;
        let count_max_age = params
            .whole("count_max_age_ms", 0..=u64::MAX)?
            .map_or(super::counts::DEFAULT_MAX_AGE, Duration::from_millis);
        let mut server = url.clone();
        server.set_path("/");
        server.set_query(None);
        let _ = server.set_username("");
        let _ = server.set_password(None);
        Ok(CouchConfig { server, database, user, password, create, timeout, query_timeout, revs_limit, count_max_age })
    }

    /// The URL with the password hidden.
    pub fn redacted(&self) -> String {
        let user = match (&self.user, &self.password) {
            (Some(user), Some(_)) => format!("{user}:***@"),
            (Some(user), None) => format!("{user}@"),
            _ => String::new(),
        };
        let host = self.server.host_str().unwrap_or("");
        let port = self.server.port().map(|p| format!(":{p}")).unwrap_or_default();
        format!("couchdb+{}://{user}{host}{port}/{}", self.server.scheme(), self.database)
    }
}

impl fmt::Debug for CouchConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

/// CouchDB's rule: a lowercase letter, then lowercase letters, digits and `_$()+-/`.
fn check_database_name(name: &str) -> std::result::Result<(), String> {
    let mut chars = name.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_lowercase());
    if first_ok && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "_$()+-/".contains(c)) {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a valid CouchDB database name (a lowercase letter, then lowercase letters, digits or _$()+-/)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_forms() {
        let c = CouchConfig::parse("couchdb+http://admin:p%40ss@127.0.0.1:5984/my_db?create=true").unwrap();
        assert_eq!(c.server.as_str(), "http://127.0.0.1:5984/");
        assert_eq!(c.database, "my_db");
        assert_eq!(c.user.as_deref(), Some("admin"));
        assert_eq!(c.password.as_deref(), Some("p@ss"));
        assert!(c.create);
        assert_eq!(c.revs_limit, crate::backend::DEFAULT_REVS_LIMIT);
        assert_eq!(CouchConfig::parse("couchdb+http://h/db?revs_limit=3").unwrap().revs_limit, 3);
        assert_eq!(c.count_max_age, super::super::counts::DEFAULT_MAX_AGE);
        assert_eq!((c.timeout, c.query_timeout), (Duration::from_secs(30), QUERY_TIMEOUT));
        let waits = CouchConfig::parse("couchdb+http://h/db?timeout_secs=5&query_timeout_secs=7200").unwrap();
        assert_eq!((waits.timeout, waits.query_timeout), (Duration::from_secs(5), Duration::from_secs(7200)));
        // Never shorter than any other request's wait.
        let short = CouchConfig::parse("couchdb+http://h/db?timeout_secs=50&query_timeout_secs=1").unwrap();
        assert_eq!(short.query_timeout, Duration::from_secs(50));
        let fresh = CouchConfig::parse("couchdb+http://h/db?count_max_age_ms=0").unwrap();
        assert_eq!(fresh.count_max_age, Duration::ZERO);
        assert_eq!(c.redacted(), "couchdb+http://admin:***@127.0.0.1:5984/my_db");
        assert!(!format!("{c:?}").contains("p@ss"));
        let c = CouchConfig::parse("couchdb+https://db.example.com").unwrap();
        assert_eq!(c.database, DEFAULT_DATABASE);
        assert_eq!(c.server.as_str(), "https://db.example.com/");
        assert!(!c.create);
        assert_eq!(c.user, None);
    }

    #[test]
    fn refuses_bad_urls() {
        for bad in [
            "couchdb+ftp://h/db",
            "couchdb+http://",
            "couchdb+http://h/Upper",
            "couchdb+http://h/a/b",
            "couchdb+http://h/db?create=maybe",
            "couchdb+http://h/db?nope=1",
            "couchdb+http://h/1db",
            "couchdb+http://h/db?revs_limit=0",
            "couchdb+http://h/db?revs_limit=many",
            "couchdb+http://h/db?count_max_age_ms=-1",
            "couchdb+http://h/db?query_timeout_secs=soon",
        ] {
            let err = CouchConfig::parse(bad).unwrap_err();
            assert!(err.to_string().contains("CouchDB URL"), "{bad}: {err}");
        }
    }
}
