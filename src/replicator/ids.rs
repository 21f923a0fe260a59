//! Replication ids as CouchDB 3.4.3's `couch_replicator_ids` computes them (version 4): the MD5,
//! in hex, of the Erlang term `[ServerUUID, Source, Target | Filter]` as `term_to_binary` writes
//! it ([`super::term`]), where an endpoint is `{remote, User, Host, Port, Path, Headers,
//! undefined}` (the user of its Basic credentials, never the password; the port `default` for 80,
//! 443 and 5984; the URL's path; the headers other than `Authorization`); the filter part is
//! `[Code, QueryParams]` for a design filter (its code as the source holds it, spaces trimmed
//! when on one line), `[DocIds]` or `[Selector]`; then `+continuous` and `+create_target` are
//! appended to the base id. The checkpoint documents are `_local/{base id}`.
//!
//! Two differences, documented in docs/couchdb-api.md: a local database (no URL; CouchDB 3.x has
//! none) is `{local, Name}`, as CouchDB 2.x wrote local endpoints; and a selector is taken with
//! its members sorted but not rewritten by Mango's normalisation, so a selector replication's id
//! is not CouchDB's.
//!
//! The server UUID is this server's (`GET /`'s `uuid`, `couchdb_server_uuid` when set): the same
//! replication computed here and on another CouchDB has another id unless both servers have the
//! same UUID, which is how a deployment moved from CouchDB keeps its checkpoints
//! (docs/couchdb-api.md, "`_replicator` and the scheduler").

use md5::Digest as _;
use serde_json::{Map, Value};

use super::spec::{Endpoint, RemoteEndpoint, Replication, ReplicationFilter};
use super::term::Term;

/// The version of the id's recipe, written into checkpoints as `replication_id_version`.
pub const REPLICATION_ID_VERSION: u64 = 4;

/// A replication's id: the base (the checkpoints' name) and its option suffix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicationId {
    pub base: String,
    pub extension: String,
}

impl ReplicationId {
    /// `base` followed by its extension, as `_scheduler` and the document show it.
    pub fn full(&self) -> String {
        format!("{}{}", self.base, self.extension)
    }

    /// The name of the checkpoint documents (`_local/{base}`, without `_local/`).
    pub fn checkpoint_name(&self) -> &str {
        &self.base
    }
}

/// The id of `replication` on the server of `server_uuid`; `filter_code` is the design filter's
/// function as the source holds it (ignored for other filters).
pub fn replication_id(server_uuid: &str, replication: &Replication, filter_code: Option<&str>) -> ReplicationId {
    let mut parts =
        vec![Term::binary(server_uuid), endpoint_term(&replication.source), endpoint_term(&replication.target)];
    match &replication.filter {
        ReplicationFilter::All => {}
        ReplicationFilter::Design { query_params, .. } => {
            parts.push(Term::binary(&trimmed_code(filter_code.unwrap_or_default())));
            parts.push(Term::ejson(&Value::Object(query_params.clone())));
        }
        ReplicationFilter::DocIds(ids) => parts.push(Term::List(ids.iter().map(|id| Term::binary(id)).collect())),
        ReplicationFilter::Selector(selector) => parts.push(Term::ejson(&sorted(&Value::Object(selector.clone())))),
    }
    if replication.winning_revs_only {
        parts.push(Term::binary("winning_revs_only"));
    }
    let base = hex::encode(md5::Md5::digest(Term::List(parts).encode()));
    let mut extension = String::new();
    if replication.continuous {
        extension.push_str("+continuous");
    }
    if replication.create_target {
        extension.push_str("+create_target");
    }
    ReplicationId { base, extension }
}

fn endpoint_term(endpoint: &Endpoint) -> Term {
    match endpoint {
        Endpoint::Local(name) => Term::Tuple(vec![Term::Atom("local"), Term::binary(name)]),
        Endpoint::Remote(remote) => remote_term(remote),
    }
}

fn remote_term(remote: &RemoteEndpoint) -> Term {
    let url = &remote.url;
    let user = match &remote.user {
        Some(user) => Term::string(user),
        None => Term::Atom("undefined"),
    };
    let port = match (url.scheme(), url.port_or_known_default()) {
        ("http", Some(80 | 5984)) | ("https", Some(443)) | (_, None) => Term::Atom("default"),
        (_, Some(port)) => Term::Integer(i128::from(port)),
    };
    // ibrowse's path: everything after the authority, the query included.
    let path = match url.query() {
        Some(query) => format!("{}?{query}", url.path()),
        None => url.path().to_owned(),
    };
    let headers = Term::List(
        remote.headers.iter().map(|(name, value)| Term::Tuple(vec![Term::string(name), Term::string(value)])).collect(),
    );
    Term::Tuple(vec![
        Term::Atom("remote"),
        user,
        Term::string(url.host_str().unwrap_or_default()),
        port,
        Term::string(&path),
        headers,
        Term::Atom("undefined"),
    ])
}

/// A filter's code as CouchDB reads it for the id: spaces around it trimmed when it is one line
/// (its pattern's `.` stops at a line break, so code over several lines is left as it is).
fn trimmed_code(code: &str) -> String {
    if code.contains('\n') {
        code.to_owned()
    } else {
        code.trim_matches(' ').to_owned()
    }
}

/// A JSON value with every object's members sorted by name (CouchDB's `ejsort`).
fn sorted(value: &Value) -> Value {
    match value {
        Value::Object(members) => {
            let mut pairs: Vec<(&String, &Value)> = members.iter().collect();
            pairs.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            Value::Object(pairs.into_iter().map(|(k, v)| (k.clone(), sorted(v))).collect::<Map<_, _>>())
        }
        Value::Array(items) => Value::Array(items.iter().map(sorted).collect()),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn replication(body: Value) -> Replication {
        super::super::spec::parse(body.as_object().unwrap()).unwrap()
    }

    /// What changes the id and what does not, as CouchDB's recipe says: the password and the
    /// credentials' place do not; the user, the port (but for the default ones), the filter and
    /// `winning_revs_only` do; `continuous` and `create_target` only add their suffix.
    #[test]
    fn what_the_id_is_made_of() {
        let uuid = "0123456789abcdef0123456789abcdef";
        let id = |body: Value| replication_id(uuid, &replication(body), None);
        let plain = id(json!({"source": "http://a:x@h:5984/s", "target": "http://h/t"}));
        assert_eq!(plain.base.len(), 32);
        assert_eq!(plain.extension, "");
        assert_eq!(
            plain,
            id(json!({"source": "http://a:y@h/s/", "target": "http://h:80/t"})),
            "password, default ports"
        );
        assert_eq!(
            plain,
            id(
                json!({"source": {"url": "http://h/s", "auth": {"basic": {"username": "a", "password": "z"}}}, "target": "http://h/t"})
            )
        );
        assert_ne!(plain, id(json!({"source": "http://b:x@h/s", "target": "http://h/t"})), "the user");
        assert_ne!(plain, id(json!({"source": "http://a:x@h:5985/s", "target": "http://h/t"})), "a port");
        let continuous =
            id(json!({"source": "http://a:x@h/s", "target": "http://h/t", "continuous": true, "create_target": true}));
        assert_eq!(
            (continuous.base.as_str(), continuous.extension.as_str()),
            (plain.base.as_str(), "+continuous+create_target")
        );
        assert_ne!(plain, id(json!({"source": "http://a:x@h/s", "target": "http://h/t", "doc_ids": ["d"]})));
        assert_ne!(
            plain.base,
            replication_id("another", &replication(json!({"source": "http://a:x@h/s", "target": "http://h/t"})), None)
                .base
        );
        assert_eq!(trimmed_code("  function(doc) {}  "), "function(doc) {}");
    }

    /// Ids a real CouchDB 3.4.3 (uuid `5d1f0c2e…`) gave `_replicator` documents: a plain one with
    /// credentials in the URLs (the id of its `_local` checkpoint), one with `auth.basic`,
    /// `doc_ids`, `continuous` and `create_target` (its `_scheduler/docs` id, in
    /// fixtures/couchdb-3.4.3/110-scheduler-docs.json), a design filter's and a selector's (read
    /// from its `_scheduler/docs`).
    #[test]
    fn the_same_ids_as_couchdb() {
        let uuid = "5d1f0c2e9a7b4b0f8e3c6a1d2b4f6e80";
        let plain = replication(json!({
            "source": "http://admin:password@127.0.0.1:15984/r37src",
            "target": "http://admin:password@127.0.0.1:15984/r37dst",
        }));
        assert_eq!(replication_id(uuid, &plain, None).full(), "3d43bf0153042afd4ce4f4700d9d7222");
        let by_ids = replication(json!({
            "source": {"url": "http://127.0.0.1:15984/r37src", "auth": {"basic": {"username": "admin", "password": "password"}}},
            "target": "http://admin:password@127.0.0.1:15984/r37dst",
            "doc_ids": ["a", "b"], "continuous": true, "create_target": true,
        }));
        assert_eq!(
            replication_id(uuid, &by_ids, None).full(),
            "77804736c3f674ba1b42f38ae1e298d1+continuous+create_target"
        );
        // A design filter: its code as the source holds it, and `query_params` with a float.
        let by_filter = replication(json!({
            "source": "http://admin:password@127.0.0.1:15984/r37src",
            "target": "http://admin:password@127.0.0.1:15984/r37dst",
            "filter": "f/by_kind", "query_params": {"kind": "x", "n": 1.5}, "continuous": true,
        }));
        let code = "function(doc, req) { return doc.kind === req.query.kind; }";
        assert_eq!(replication_id(uuid, &by_filter, Some(code)).full(), "d14018340c19a480eb70e0caf381e375+continuous");
        // A selector: CouchDB's id is over Mango's normalised selector, not computed here.
        let by_selector = replication(json!({
            "source": "http://admin:password@127.0.0.1:15984/r37src",
            "target": "http://admin:password@127.0.0.1:15984/r37dst",
            "selector": {"kind": "x"}, "continuous": true,
        }));
        assert_ne!(replication_id(uuid, &by_selector, None).full(), "d25e82103cf58f20fa63e3252418f613+continuous");
    }
}
