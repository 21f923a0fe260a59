//! The body of `POST /{db}/_find` and `_explain`, validated as CouchDB 3.4.3's
//! `mango_opts:validate_find` validates it (options in CouchDB's order, so the first problem
//! reported is the one CouchDB reports), and the selector a per-user login's query runs with.
//! Both [`super::find`] and [`super::index`] (for `_explain` and index `sort`s) read requests
//! through here; this file imports neither.

use serde_json::Value;

use super::selector::{self, parse_field, Selector};
use super::{erlang_term, MangoError};

/// CouchDB's default `limit` (`[mango] default_limit`).
pub const DEFAULT_LIMIT: u64 = 25;
/// The bookmark CouchDB gives a first page without rows.
pub const NO_BOOKMARK: &str = "nil";

/// A validated `sort`: the fields (path and name) and the one direction they share.
#[derive(Debug, Clone, Default)]
pub struct Sort {
    pub fields: Vec<(Vec<String>, String)>,
    pub direction: String,
}

/// A validated `_find` (or `_explain`) body.
#[derive(Debug, Clone)]
pub struct FindRequest {
    pub selector: Selector,
    pub use_index: Vec<String>,
    /// As given (`None` for absent, null or empty).
    pub bookmark: Option<String>,
    pub limit: u64,
    pub skip: u64,
    pub sort: Sort,
    /// Paths to project and their names as given; empty is every field.
    pub fields: Vec<(Vec<String>, String)>,
    pub r: u64,
    pub conflicts: bool,
    pub stale: bool,
    pub update: bool,
    pub stable: bool,
    pub execution_stats: bool,
    pub allow_fallback: bool,
    /// `partition` (empty for none): this database is not partitioned, so a query naming one is
    /// refused when it runs, as CouchDB refuses it.
    pub partition: String,
}

impl FindRequest {
    pub fn sort_field_names(&self) -> Vec<String> {
        self.sort.fields.iter().map(|(p, _)| selector::join_field(p)).collect()
    }
}

/// The keys `_find` accepts, in the order CouchDB validates them.
const FIND_KEYS: [&str; 15] = [
    "selector",
    "use_index",
    "bookmark",
    "limit",
    "skip",
    "sort",
    "fields",
    "partition",
    "r",
    "conflicts",
    "stale",
    "update",
    "stable",
    "execution_stats",
    "allow_fallback",
];

/// Validates a `_find` body (CouchDB's `mango_opts:validate_find`), options in CouchDB's order so
/// the first problem reported is the one CouchDB reports.
pub fn parse_request(body: &Value) -> Result<FindRequest, MangoError> {
    let Value::Object(body) = body else {
        return Err(MangoError::bad_request("bad_request", "Request body must be a JSON object"));
    };
    let selector = match body.get("selector") {
        None => return Err(MangoError::bad_request("missing_required_key", "Missing required key: selector")),
        Some(Value::Object(selector)) => selector::parse(selector)?,
        Some(other) => {
            return Err(MangoError::bad_request(
                "invalid_selector_json",
                format!("Selector must be a JSON object, not: {}", erlang_term(other)),
            ))
        }
    };
    let request = FindRequest {
        selector,
        use_index: parse_use_index(body.get("use_index"))?,
        bookmark: match body.get("bookmark") {
            None | Some(Value::Null) => None,
            // CouchDB sends `nil` as the bookmark of an empty first page; taken back, it is the
            // start (CouchDB itself would refuse it as undecodable).
            Some(Value::String(s)) if s.is_empty() || s == NO_BOOKMARK => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(other) => return Err(invalid_bookmark(other)),
        },
        limit: non_negative(body.get("limit"), DEFAULT_LIMIT)?,
        skip: non_negative(body.get("skip"), 0)?,
        sort: body.get("sort").map(parse_sort).transpose()?.unwrap_or_default(),
        fields: parse_fields(body.get("fields"))?,
        partition: parse_partition(body.get("partition"))?,
        r: positive(body.get("r"), 1)?,
        conflicts: boolean(body.get("conflicts"), false)?,
        stale: parse_stale(body.get("stale"))?,
        update: boolean(body.get("update"), true)?,
        stable: boolean(body.get("stable"), false)?,
        execution_stats: boolean(body.get("execution_stats"), false)?,
        allow_fallback: boolean(body.get("allow_fallback"), true)?,
    };
    if let Some(unknown) = body.keys().find(|k| !FIND_KEYS.contains(&k.as_str())) {
        return Err(MangoError::bad_request("invalid_key", format!("Invalid key {unknown} for this request.")));
    }
    Ok(request)
}

pub(super) fn invalid_bookmark(given: &Value) -> MangoError {
    MangoError::bad_request("invalid_bookmark", format!("Invalid bookmark value: {given}"))
}

fn non_negative(value: Option<&Value>, default: u64) -> Result<u64, MangoError> {
    match value {
        None => Ok(default),
        Some(v) => v.as_u64().ok_or_else(|| {
            MangoError::bad_request(
                "invalid_non_neg_integer",
                format!("{} is not an integer greater than or equal to zero", erlang_term(v)),
            )
        }),
    }
}

fn positive(value: Option<&Value>, default: u64) -> Result<u64, MangoError> {
    match value {
        None => Ok(default),
        Some(v) => v.as_u64().filter(|n| *n > 0).ok_or_else(|| {
            MangoError::bad_request(
                "invalid_pos_integer",
                format!("{} is not an integer greater than zero", erlang_term(v)),
            )
        }),
    }
}

fn boolean(value: Option<&Value>, default: bool) -> Result<bool, MangoError> {
    match value {
        None => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => {
            Err(MangoError::bad_request("invalid_boolean", format!("Invalid boolean value: {}", erlang_term(v))))
        }
    }
}

/// `partition`: a string, checked as CouchDB's `couch_partition:validate_partition` checks it.
fn parse_partition(value: Option<&Value>) -> Result<String, MangoError> {
    let illegal = |reason: &str| MangoError::bad_request("illegal_partition", reason);
    match value {
        None => Ok(String::new()),
        Some(Value::String(p)) if p.is_empty() => Ok(String::new()),
        Some(Value::String(p)) if p.starts_with('_') => Err(illegal("Partition must not start with an underscore")),
        Some(Value::String(p)) if p.contains(':') => Err(illegal("Partition must not contain a colon")),
        Some(Value::String(p)) => Ok(p.clone()),
        Some(_) => Err(illegal("Partition must be a string")),
    }
}

/// `stale`: `"ok"`, `false` or `"false"` (accepted and ignored: reads are never stale here).
fn parse_stale(value: Option<&Value>) -> Result<bool, MangoError> {
    match value {
        None | Some(Value::Bool(false)) => Ok(false),
        Some(Value::String(s)) if s == "false" => Ok(false),
        Some(Value::String(s)) if s == "ok" => Ok(true),
        Some(v) => {
            Err(MangoError::bad_request("invalid_value", format!("Invalid value for stale: {}", erlang_term(v))))
        }
    }
}

/// `use_index`: `"ddoc"`, `"ddoc/name"`, `"_design/ddoc/name"`, `[ddoc]` or `[ddoc, name]`.
fn parse_use_index(value: Option<&Value>) -> Result<Vec<String>, MangoError> {
    let invalid =
        |v: &Value| MangoError::bad_request("invalid_index_name", format!("Invalid index name: {}", erlang_term(v)));
    match value {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(name)) => {
            let parts: Vec<&str> = name.split('/').collect();
            match parts.as_slice() {
                [ddoc] | ["_design", ddoc] => Ok(vec![(*ddoc).to_owned()]),
                [ddoc, view] | ["_design", ddoc, view] => Ok(vec![(*ddoc).to_owned(), (*view).to_owned()]),
                _ => Err(invalid(value.unwrap_or(&Value::Null))),
            }
        }
        Some(Value::Array(parts)) if parts.len() <= 2 && parts.iter().all(Value::is_string) => {
            Ok(parts.iter().filter_map(|p| p.as_str().map(str::to_owned)).collect())
        }
        Some(other) => Err(invalid(other)),
    }
}

/// `sort` (CouchDB's `mango_sort:new`): names or `{name: "asc"|"desc"}`, one direction for all.
pub fn parse_sort(value: &Value) -> Result<Sort, MangoError> {
    let Value::Array(specs) = value else {
        return Err(MangoError::bad_request(
            "invalid_sort_json",
            format!("Sort must be an array of sort specs, not: {}", erlang_term(value)),
        ));
    };
    let invalid_field =
        |v: &Value| MangoError::bad_request("invalid_sort_field", format!("Invalid sort field: {}", erlang_term(v)));
    let mut sort = Sort { fields: Vec::new(), direction: "asc".into() };
    let mut directions = Vec::new();
    for spec in specs {
        let (name, direction) = match spec {
            Value::String(name) if !name.is_empty() => (name.clone(), "asc".to_owned()),
            // Any other direction is CouchDB's `invalid_sort_field` naming the whole spec:
            // mango_sort.erl's `invalid_sort_dir` clause cannot match a decoded JSON object
            // (issue 22 §2c item 13).
            Value::Object(map) if map.len() == 1 => match map.iter().next() {
                Some((name, Value::String(d))) if d == "asc" || d == "desc" => (name.clone(), d.clone()),
                _ => return Err(invalid_field(spec)),
            },
            other => return Err(invalid_field(other)),
        };
        sort.fields.push((parse_field(&name)?, name));
        directions.push(direction);
    }
    directions.dedup();
    match directions.as_slice() {
        [] => {}
        [one] => sort.direction = one.clone(),
        _ => {
            return Err(MangoError::bad_request(
                "unsupported_mixed_sort",
                "Sorts currently only support a single direction for all fields.",
            ))
        }
    }
    Ok(sort)
}

/// `fields`: an array of field names (dotted paths).
pub(super) fn parse_fields(value: Option<&Value>) -> Result<Vec<(Vec<String>, String)>, MangoError> {
    match value {
        None => Ok(Vec::new()),
        Some(Value::Array(names)) => names
            .iter()
            .map(|name| match name {
                Value::String(s) => Ok((parse_field(s)?, s.clone())),
                other => Err(MangoError::bad_request(
                    "invalid_field",
                    format!("Invalid JSON for field spec: {}", erlang_term(other)),
                )),
            })
            .collect(),
        Some(other) => Err(MangoError::bad_request(
            "invalid_fields",
            format!("Fields must be an array of strings, not: {}", erlang_term(other)),
        )),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn error_of(body: Value) -> (u16, String, String) {
        let e = parse_request(&body).unwrap_err().refusal();
        (e.status.as_u16(), e.error, e.reason)
    }

    #[test]
    fn validation_errors_match_couchdb() {
        assert_eq!(
            error_of(json!({"fields": ["key"]})),
            (400, "missing_required_key".into(), "Missing required key: selector".into())
        );
        assert_eq!(error_of(json!({"selector": [1]})).2, "Selector must be a JSON object, not: [1]");
        assert_eq!(
            error_of(json!({"selector": {}, "limit": -1})).2,
            "-1 is not an integer greater than or equal to zero"
        );
        assert_eq!(error_of(json!({"selector": {}, "limit": "5"})).1, "invalid_non_neg_integer");
        assert_eq!(error_of(json!({"selector": {}, "r": 0})).2, "0 is not an integer greater than zero");
        assert_eq!(error_of(json!({"selector": {}, "conflicts": 1})).2, "Invalid boolean value: 1");
        assert_eq!(error_of(json!({"selector": {}, "nope": 1})).2, "Invalid key nope for this request.");
        assert_eq!(
            error_of(json!({"selector": {}, "fields": "key"})).2,
            "Fields must be an array of strings, not: <<\"key\">>"
        );
        assert_eq!(error_of(json!({"selector": {}, "bookmark": 5})).2, "Invalid bookmark value: 5");
        assert_eq!(
            error_of(json!({"selector": {}, "sort": [{"a": "asc"}, {"b": "desc"}]})).1,
            "unsupported_mixed_sort"
        );
        // mango_sort.erl (3.4.3): a `{field: direction}` object whose direction is not "asc" or
        // "desc" falls through to `invalid_sort_field` (issue 22 §2c item 13).
        assert_eq!(
            error_of(json!({"selector": {}, "sort": [{"a": "up"}]})),
            (400, "invalid_sort_field".into(), "Invalid sort field: {[{<<\"a\">>,<<\"up\">>}]}".into())
        );
        assert_eq!(error_of(json!({"selector": {}, "sort": "a"})).1, "invalid_sort_json");
    }

    #[test]
    fn accepted_options_and_defaults() {
        let r =
            parse_request(&json!({"selector": {"a": 1}, "r": 1, "conflicts": false, "update": true, "stable": false,
            "stale": "ok", "execution_stats": true, "use_index": "_design/x/y", "skip": 2, "bookmark": null}))
            .unwrap();
        assert_eq!(r.limit, DEFAULT_LIMIT);
        assert_eq!(r.use_index, vec!["x".to_string(), "y".to_string()]);
        assert_eq!(r.skip, 2);
        assert!(r.bookmark.is_none());
    }
}
