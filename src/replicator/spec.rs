//! A replication as a `_replicator` document or a `POST /_replicate` body describes it
//! (CouchDB 3.4.3's `couch_replicator_parse`): its two endpoints and its options, checked as
//! CouchDB checks them, with CouchDB's reasons for what it refuses.
//!
//! One difference: an endpoint may be a bare database name, one of this server's own databases,
//! read and written in-process (CouchDB 3.x refuses them, `local_endpoints_not_supported`).

use serde_json::{Map, Value};
use url::Url;

/// One end of a replication.
#[derive(Debug, Clone, PartialEq)]
pub enum Endpoint {
    /// A database of this server, by name.
    Local(String),
    /// A database of a CouchDB-protocol server.
    Remote(RemoteEndpoint),
}

/// A remote database as CouchDB keeps it after `normalize_basic_auth`: the URL without
/// credentials (ending in `/` unless it has a query), the Basic credentials from `auth.basic`,
/// the URL or an `Authorization` header (in that order), and the other headers asked for.
#[derive(Clone, PartialEq)]
pub struct RemoteEndpoint {
    pub url: Url,
    pub user: Option<String>,
    pub password: Option<String>,
    /// Headers other than `Authorization`, sorted by name.
    pub headers: Vec<(String, String)>,
}

impl std::fmt::Debug for RemoteEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteEndpoint").field("url", &self.url.as_str()).field("user", &self.user).finish()
    }
}

impl RemoteEndpoint {
    /// The server's root and the database's name (the URL's last path segment, decoded).
    pub fn server_and_db(&self) -> (Url, String) {
        let mut server = self.url.clone();
        let path = server.path().trim_end_matches('/').to_owned();
        let (parent, last) = path.rsplit_once('/').unwrap_or(("", path.as_str()));
        let db = percent_encoding::percent_decode_str(last).decode_utf8_lossy().into_owned();
        server.set_path(&format!("{parent}/"));
        server.set_query(None);
        (server, db)
    }
}

impl Endpoint {
    /// How `_scheduler` and `_active_tasks` show it: a URL without credentials, or the name.
    pub fn shown(&self) -> String {
        match self {
            Endpoint::Local(name) => name.clone(),
            Endpoint::Remote(remote) => remote.url.to_string(),
        }
    }
}

/// Which changes a replication takes: the replication client's own filter, run where the source's
/// feed is read (`doc_ids` sorted, without duplicates, percent-decoded, as CouchDB's
/// `convert_options` keeps them; a Mango `selector`; `filter: "ddoc/name"` with its
/// `query_params`).
pub use crate::replication_client::FeedFilter as ReplicationFilter;

/// A parsed replication.
#[derive(Debug, Clone, PartialEq)]
pub struct Replication {
    pub source: Endpoint,
    pub target: Endpoint,
    pub continuous: bool,
    pub create_target: bool,
    pub filter: ReplicationFilter,
    /// `since_seq`: where the source's feed is first read when no checkpoint says otherwise.
    pub since_seq: Option<Value>,
    /// `winning_revs_only` (part of the id as CouchDB makes it).
    pub winning_revs_only: bool,
    /// `user_ctx.name`, or the document's `owner`.
    pub user: Option<String>,
}

/// Why a replication document is refused: CouchDB's reason.
pub type Refusal = String;

/// Parses a replication document or `_replicate` body.
pub fn parse(body: &Map<String, Value>) -> Result<Replication, Refusal> {
    let flag = |name: &str| -> Result<bool, Refusal> {
        match body.get(name) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(value)) => Ok(*value),
            Some(_) => Err(format!("parameter `{name}` must be a boolean")),
        }
    };
    let continuous = flag("continuous")?;
    let create_target = flag("create_target")?;
    let winning_revs_only = flag("winning_revs_only")?;
    let filter = parse_filter(body)?;
    let source = parse_endpoint(body.get("source"))?;
    let target = parse_endpoint(body.get("target"))?;
    let user = body
        .get("user_ctx")
        .and_then(|ctx| ctx.get("name"))
        .and_then(Value::as_str)
        .or_else(|| body.get("owner").and_then(Value::as_str))
        .map(str::to_owned);
    Ok(Replication {
        source,
        target,
        continuous,
        create_target,
        filter,
        since_seq: body.get("since_seq").filter(|seq| !seq.is_null()).cloned(),
        winning_revs_only,
        user,
    })
}

fn parse_filter(body: &Map<String, Value>) -> Result<ReplicationFilter, Refusal> {
    let doc_ids = match body.get("doc_ids") {
        None | Some(Value::Null) => None,
        Some(Value::Array(ids)) => {
            let mut ids: Vec<String> = ids
                .iter()
                .map(|id| {
                    id.as_str()
                        .map(|id| percent_encoding::percent_decode_str(id).decode_utf8_lossy().into_owned())
                        .ok_or_else(|| "parameter `doc_ids` must be an array of strings".to_owned())
                })
                .collect::<Result<_, _>>()?;
            ids.sort();
            ids.dedup();
            Some(ids)
        }
        Some(_) => return Err("parameter `doc_ids` must be an array".into()),
    };
    let selector = match body.get("selector") {
        None => None,
        Some(Value::Object(selector)) => Some(selector.clone()),
        Some(_) => return Err("parameter `selector` must be a JSON object".into()),
    };
    let query_params = match body.get("query_params") {
        None => Map::new(),
        Some(Value::Object(params)) => params.clone(),
        Some(_) => return Err("parameter `query_params` must be an object".into()),
    };
    let filter = body.get("filter").filter(|f| !f.is_null());
    match (doc_ids, filter, selector) {
        (None, None, None) => Ok(ReplicationFilter::All),
        (Some(ids), None, None) => Ok(ReplicationFilter::DocIds(ids)),
        (None, None, Some(selector)) => {
            crate::mango::selector::parse(&selector).map_err(|err| err.to_string())?;
            Ok(ReplicationFilter::Selector(selector))
        }
        (None, Some(filter), None) => {
            let text = filter.as_str().ok_or("Invalid filter. Must match `ddocname/filtername`.")?;
            if text.starts_with('_') {
                return Err(format!("filter {text:?} is not supported by this server's replicator"));
            }
            match text.split_once('/') {
                Some((ddoc, name)) => {
                    Ok(ReplicationFilter::Design { ddoc: ddoc.to_owned(), name: name.to_owned(), query_params })
                }
                None => Err("Invalid filter. Must match `ddocname/filtername`.".into()),
            }
        }
        _ => Err("`doc_ids`,`filter`,`selector` are mutually exclusive".into()),
    }
}

fn parse_endpoint(value: Option<&Value>) -> Result<Endpoint, Refusal> {
    match value {
        None | Some(Value::Null) => Err("Missing replicator database".into()),
        Some(Value::String(text)) if text.starts_with("http://") || text.starts_with("https://") => {
            remote(text, &Map::new(), &Map::new())
        }
        Some(Value::String(text)) => {
            crate::backend::catalog::DbName::parse(text).map_err(|err| err.message().to_owned())?;
            Ok(Endpoint::Local(text.clone()))
        }
        Some(Value::Object(props)) => {
            let url = props.get("url").and_then(Value::as_str).ok_or("endpoint has an invalid url")?;
            let headers = match props.get("headers") {
                Some(Value::Object(headers)) => headers.clone(),
                _ => Map::new(),
            };
            let auth = match props.get("auth") {
                Some(Value::Object(auth)) => auth.clone(),
                _ => Map::new(),
            };
            remote(url, &headers, &auth)
        }
        Some(_) => Err("endpoint has an invalid url".into()),
    }
}

/// A remote endpoint with its credentials taken out of the URL, `auth.basic` or an
/// `Authorization: Basic` header, in CouchDB's order of preference.
fn remote(text: &str, headers: &Map<String, Value>, auth: &Map<String, Value>) -> Result<Endpoint, Refusal> {
    let mut url = Url::parse(text).map_err(|_| "endpoint has an invalid url".to_owned())?;
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
        return Err("endpoint has an invalid url".into());
    }
    let decode = |text: &str| percent_encoding::percent_decode_str(text).decode_utf8_lossy().into_owned();
    let url_creds = (!url.username().is_empty() && url.password().is_some())
        .then(|| (decode(url.username()), url.password().map(decode).unwrap_or_default()));
    let _ = url.set_username("");
    let _ = url.set_password(None);
    if url.query().is_none() && !url.path().ends_with('/') {
        let path = format!("{}/", url.path());
        url.set_path(&path);
    }
    let mut kept_headers = Vec::new();
    let mut header_creds = None;
    for (name, value) in headers {
        let Some(value) = value.as_str() else { continue };
        if name.eq_ignore_ascii_case("authorization") {
            header_creds = basic_credentials(value);
            if header_creds.is_some() {
                continue;
            }
        }
        kept_headers.push((name.clone(), value.to_owned()));
    }
    kept_headers.sort();
    kept_headers.dedup_by(|a, b| a.0 == b.0);
    let basic = auth.get("basic").and_then(|basic| {
        Some((basic.get("username")?.as_str()?.to_owned(), basic.get("password")?.as_str()?.to_owned()))
    });
    let (user, password) = match basic.or(url_creds).or(header_creds) {
        Some((user, password)) => (Some(user), Some(password)),
        None => (None, None),
    };
    Ok(Endpoint::Remote(RemoteEndpoint { url, user, password, headers: kept_headers }))
}

/// The user and password of an `Authorization: Basic …` value.
fn basic_credentials(value: &str) -> Option<(String, String)> {
    use base64::Engine as _;
    let (scheme, encoded) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD.decode(encoded.trim()).ok()?;
    let text = String::from_utf8(decoded).ok()?;
    let (user, password) = text.split_once(':')?;
    Some((user.to_owned(), password.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parsed(body: Value) -> Result<Replication, Refusal> {
        parse(body.as_object().unwrap())
    }

    #[test]
    fn endpoints_credentials_and_refusals() {
        let rep = parsed(json!({"source": "http://u:p%40@h:5984/a%2Fb", "target": "local"})).unwrap();
        let Endpoint::Remote(source) = &rep.source else { panic!("remote") };
        assert_eq!(source.url.as_str(), "http://h:5984/a%2Fb/");
        assert_eq!((source.user.as_deref(), source.password.as_deref()), (Some("u"), Some("p@")));
        assert_eq!(source.server_and_db().1, "a/b");
        assert_eq!(source.server_and_db().0.as_str(), "http://h:5984/");
        assert_eq!(rep.target, Endpoint::Local("local".into()));
        let auth = parsed(json!({"source": {"url": "http://x:y@h/d", "auth": {"basic": {"username": "a", "password": "b"}}}, "target": "t"}))
            .unwrap();
        let Endpoint::Remote(source) = &auth.source else { panic!("remote") };
        assert_eq!(source.user.as_deref(), Some("a"), "auth.basic wins over the URL");
        assert_eq!(parsed(json!({"target": "t"})).unwrap_err(), "Missing replicator database");
        assert_eq!(
            parsed(json!({"source": "a", "target": "t", "doc_ids": ["x"], "selector": {}})).unwrap_err(),
            "`doc_ids`,`filter`,`selector` are mutually exclusive"
        );
        assert_eq!(
            parsed(json!({"source": "a", "target": "t", "continuous": "yes"})).unwrap_err(),
            "parameter `continuous` must be a boolean"
        );
        let ids = parsed(json!({"source": "a", "target": "t", "doc_ids": ["b", "a%2F", "b"]})).unwrap();
        assert_eq!(ids.filter, ReplicationFilter::DocIds(vec!["a/".into(), "b".into()]));
    }
}
