//! A view query: CouchDB's parameters parsed and checked as CouchDB 3.4 checks them
//! (`couch_mrview_http:parse_param`, `couch_mrview_util:validate_args`), and the key ranges they
//! select, as row-key bounds of the index ([`super::index_store::RowRange`]).

use std::ops::Bound;

use serde_json::Value;

use super::index_store::RowRange;
use super::sort_key::{self, AFTER_ALL};
use super::ViewError;
use crate::model::depth::{parse_within, text_depth, MAX_DOCUMENT_DEPTH};

/// How a query wants the index brought up to date first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Update {
    /// Catch up with every write acknowledged before the query (the default).
    True,
    /// Answer from the index as it is.
    False,
    /// Answer as it is, then catch up in the background.
    Lazy,
}

/// How rows are grouped for a reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Grouping {
    /// One reduction of every row in range (key `null`).
    All,
    /// One per distinct key.
    Exact,
    /// One per first `n` elements of array keys (other keys are their own group).
    Level(u64),
}

/// A view query's parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct ViewQuery {
    pub start_key: Option<Value>,
    pub end_key: Option<Value>,
    pub keys: Option<Vec<Value>>,
    pub start_docid: Option<String>,
    pub end_docid: Option<String>,
    pub inclusive_end: bool,
    pub descending: bool,
    pub limit: Option<u64>,
    pub skip: u64,
    pub group: Option<bool>,
    pub group_level: Option<u64>,
    pub reduce: Option<bool>,
    pub include_docs: bool,
    pub conflicts: Option<bool>,
    pub attachments: bool,
    pub att_encoding_info: bool,
    pub update: Update,
    pub update_seq: bool,
    pub sorted: bool,
}

impl Default for ViewQuery {
    fn default() -> Self {
        ViewQuery {
            start_key: None,
            end_key: None,
            keys: None,
            start_docid: None,
            end_docid: None,
            inclusive_end: true,
            descending: false,
            limit: None,
            skip: 0,
            group: None,
            group_level: None,
            reduce: None,
            include_docs: false,
            conflicts: None,
            attachments: false,
            att_encoding_info: false,
            update: Update::True,
            update_seq: false,
            sorted: true,
        }
    }
}

/// What a checked query does.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    /// Rows of the map, in the ranges given (one per key of `keys`, else one).
    Map { ranges: Vec<RowRange> },
    /// Reductions of the rows in the ranges, grouped.
    Reduce { ranges: Vec<RowRange>, grouping: Grouping },
}

fn parse_error(reason: impl Into<String>) -> ViewError {
    ViewError::QueryParse(reason.into())
}

fn parse_bool(value: &str) -> Result<bool, ViewError> {
    match value.to_ascii_lowercase().as_str() {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(parse_error(format!("Invalid boolean parameter: \"{value}\""))),
    }
}

fn parse_count(value: &str) -> Result<u64, ViewError> {
    match value.parse::<i64>() {
        Ok(n) if n >= 0 => Ok(n as u64),
        Ok(_) => Err(parse_error(format!("Invalid value for positive integer: \"{value}\""))),
        Err(_) => Err(parse_error(format!("Invalid value for integer: \"{value}\""))),
    }
}

fn parse_json(name: &str, value: &str) -> Result<Value, ViewError> {
    let depth = text_depth(value.as_bytes());
    if depth > MAX_DOCUMENT_DEPTH {
        return Err(ViewError::BadRequest(format!(
            "`{name}` is nested {depth} levels deep; at most {MAX_DOCUMENT_DEPTH} are allowed (JSON nesting depth)"
        )));
    }
    parse_within(value.as_bytes(), MAX_DOCUMENT_DEPTH)
        .map_err(|_| ViewError::BadRequest(format!("invalid JSON in `{name}`: {value}")))
}

impl ViewQuery {
    /// Reads the query string's parameters (values already percent-decoded). Unknown
    /// parameters are ignored, as CouchDB ignores them.
    pub fn parse<'a>(params: impl IntoIterator<Item = (&'a str, &'a str)>) -> Result<ViewQuery, ViewError> {
        let mut query = ViewQuery::default();
        for (name, value) in params {
            match name {
                "reduce" => query.reduce = Some(parse_bool(value)?),
                "key" => {
                    let key = parse_json(name, value)?;
                    query.start_key = Some(key.clone());
                    query.end_key = Some(key);
                }
                "keys" => query.set_keys(parse_json(name, value)?)?,
                "startkey" | "start_key" => query.start_key = Some(parse_json(name, value)?),
                "endkey" | "end_key" => query.end_key = Some(parse_json(name, value)?),
                "startkey_docid" | "start_key_doc_id" => query.start_docid = Some(value.to_owned()),
                "endkey_docid" | "end_key_doc_id" => query.end_docid = Some(value.to_owned()),
                "limit" => query.limit = Some(parse_count(value)?),
                "skip" => query.skip = parse_count(value)?,
                "descending" => query.descending = parse_bool(value)?,
                "group" => query.group = Some(parse_bool(value)?),
                "group_level" => query.group_level = Some(parse_count(value)?),
                "inclusive_end" => query.inclusive_end = parse_bool(value)?,
                "include_docs" => query.include_docs = parse_bool(value)?,
                "conflicts" => query.conflicts = Some(parse_bool(value)?),
                "attachments" => query.attachments = parse_bool(value)?,
                "att_encoding_info" => query.att_encoding_info = parse_bool(value)?,
                "update_seq" => query.update_seq = parse_bool(value)?,
                "sorted" => query.sorted = parse_bool(value)?,
                "update" => {
                    query.update = match value {
                        "true" => Update::True,
                        "false" => Update::False,
                        "lazy" => Update::Lazy,
                        _ => return Err(parse_error("Invalid value for `update`.")),
                    }
                }
                "stale" => {
                    query.update = match value {
                        "ok" => Update::False,
                        "update_after" => Update::Lazy,
                        _ => return Err(parse_error("Invalid value for `stale`.")),
                    }
                }
                "stable" => {
                    parse_bool(value).map_err(|_| parse_error("Invalid value for `stable`."))?;
                }
                _ => {}
            }
        }
        Ok(query)
    }

    /// Takes the parameters of a POST body (`{"keys": [...], ...}`): JSON values, already decoded.
    pub fn merge_body(&mut self, body: &serde_json::Map<String, Value>) -> Result<(), ViewError> {
        for (name, value) in body {
            let text = match value {
                Value::String(text) => text.clone(),
                other => other.to_string(),
            };
            match name.as_str() {
                "keys" => self.set_keys(value.clone())?,
                "key" => {
                    self.start_key = Some(value.clone());
                    self.end_key = Some(value.clone());
                }
                "startkey" | "start_key" => self.start_key = Some(value.clone()),
                "endkey" | "end_key" => self.end_key = Some(value.clone()),
                _ => {
                    let parsed = ViewQuery::parse([(name.as_str(), text.as_str())])?;
                    self.take_scalars(&parsed, name);
                }
            }
        }
        Ok(())
    }

    fn take_scalars(&mut self, parsed: &ViewQuery, name: &str) {
        match name {
            "reduce" => self.reduce = parsed.reduce,
            "startkey_docid" | "start_key_doc_id" => self.start_docid = parsed.start_docid.clone(),
            "endkey_docid" | "end_key_doc_id" => self.end_docid = parsed.end_docid.clone(),
            "limit" => self.limit = parsed.limit,
            "skip" => self.skip = parsed.skip,
            "descending" => self.descending = parsed.descending,
            "group" => self.group = parsed.group,
            "group_level" => self.group_level = parsed.group_level,
            "inclusive_end" => self.inclusive_end = parsed.inclusive_end,
            "include_docs" => self.include_docs = parsed.include_docs,
            "conflicts" => self.conflicts = parsed.conflicts,
            "attachments" => self.attachments = parsed.attachments,
            "att_encoding_info" => self.att_encoding_info = parsed.att_encoding_info,
            "update_seq" => self.update_seq = parsed.update_seq,
            "sorted" => self.sorted = parsed.sorted,
            "update" | "stale" => self.update = parsed.update,
            _ => {}
        }
    }

    fn set_keys(&mut self, keys: Value) -> Result<(), ViewError> {
        match keys {
            // CouchDB reads a single key as `key`.
            Value::Array(mut keys) if keys.len() == 1 => {
                let key = keys.remove(0);
                self.start_key = Some(key.clone());
                self.end_key = Some(key);
            }
            Value::Array(keys) => self.keys = Some(keys),
            _ => return Err(parse_error("`keys` must be an array of strings.")),
        }
        Ok(())
    }

    /// Checks the query against the view (`has_reduce`) and says what it does, in the order
    /// `couch_mrview_util:validate_args` checks, so a query with several faults gets CouchDB's
    /// first reason. A reduce view queried with `reduce=false` is a map view to these checks, as
    /// CouchDB sets its `view_type`: grouping it is refused as on a map-only view.
    pub fn plan(&self, has_reduce: bool) -> Result<Plan, ViewError> {
        let grouping = match (self.group, self.group_level) {
            (Some(false), Some(level)) if level > 0 => {
                return Err(parse_error("Can't specify group=false and group_level>0 at the same time"))
            }
            (_, Some(level)) if level > 0 => Some(Grouping::Level(level)),
            (Some(true), None) => Some(Grouping::Exact),
            _ => None,
        };
        let reduce = match (self.reduce, has_reduce) {
            (Some(true), false) => return Err(parse_error("Reduce is invalid for map-only views.")),
            (Some(wanted), true) => wanted,
            (None, has) => has,
            (Some(false), false) => false,
        };
        if reduce && grouping != Some(Grouping::Exact) && self.keys.is_some() {
            return Err(parse_error("Multi-key fetches for reduce views must use `group=true`"));
        }
        // `keys: []` goes with a range (CouchDB's `{[], _, _}`); other keys go alone.
        if self.keys.as_ref().is_some_and(|keys| !keys.is_empty())
            && (self.start_key.is_some() || self.end_key.is_some())
        {
            return Err(parse_error("`keys` is incompatible with `key`, `start_key` and `end_key`"));
        }
        if !reduce && grouping.is_some() {
            return Err(parse_error("Invalid use of grouping on a map view."));
        }
        if reduce && self.include_docs {
            return Err(parse_error("`include_docs` is invalid for reduce"));
        }
        if reduce && self.conflicts.is_some() {
            return Err(parse_error("`conflicts` is invalid for reduce views."));
        }
        self.check_range()?;
        let ranges = match &self.keys {
            Some(keys) => keys.iter().map(|key| self.range(Some(key), Some(key))).collect(),
            None => vec![self.range(self.start_key.as_ref(), self.end_key.as_ref())],
        };
        Ok(if reduce {
            Plan::Reduce { ranges, grouping: grouping.unwrap_or(Grouping::All) }
        } else {
            Plan::Map { ranges }
        })
    }

    /// CouchDB's `check_range`: a start past the end (in the query's direction) is an error.
    fn check_range(&self) -> Result<(), ViewError> {
        let (Some(start), Some(end)) = (&self.start_key, &self.end_key) else {
            return Ok(());
        };
        if start == end {
            return Ok(());
        }
        let with_id = |key: &Value, id: Option<&String>, default_high: bool| {
            let mut bytes = sort_key::encode(key);
            match id {
                Some(id) => sort_key::escape_into(id.as_bytes(), &mut bytes),
                None if default_high => bytes.push(AFTER_ALL),
                None => {}
            }
            bytes
        };
        let (start_high, end_high) = if self.descending { (true, false) } else { (false, true) };
        let start = with_id(start, self.start_docid.as_ref(), start_high);
        let end = with_id(end, self.end_docid.as_ref(), end_high);
        match (self.descending, start < end) {
            (false, false) => Err(parse_error(
                "No rows can match your key range, reverse your start_key and end_key or set descending=true",
            )),
            (true, true) => Err(parse_error(
                "No rows can match your key range, reverse your start_key and end_key or set descending=false",
            )),
            _ => Ok(()),
        }
    }

    /// The row-key bounds of the rows from `start` to `end` (in the query's direction).
    fn range(&self, start: Option<&Value>, end: Option<&Value>) -> RowRange {
        // Every row of a document: its id's escaped bytes, then a 4-byte emit number.
        let past_id = |bytes: &mut Vec<u8>| bytes.extend_from_slice(&[AFTER_ALL; 5]);
        let keyed = |key: &Value, id: Option<&String>| {
            let mut bytes = sort_key::encode(key);
            if let Some(id) = id {
                sort_key::escape_into(id.as_bytes(), &mut bytes);
            }
            bytes
        };
        // The first row at or after (`key`, `id`), as a lower bound.
        let lower_from = |key: &Value, id: Option<&String>| Bound::Included(keyed(key, id));
        // Every row up to and including (`key`, `id`), as an upper bound.
        let upper_through = |key: &Value, id: Option<&String>| {
            let mut bytes = keyed(key, id);
            match id {
                Some(_) => past_id(&mut bytes),
                None => bytes.push(AFTER_ALL),
            }
            Bound::Excluded(bytes)
        };
        // Every row before (`key`, `id`), as an upper bound.
        let upper_before = |key: &Value, id: Option<&String>| Bound::Excluded(keyed(key, id));
        // Every row after (`key`, `id`), as a lower bound.
        let lower_after = |key: &Value, id: Option<&String>| {
            let mut bytes = keyed(key, id);
            match id {
                Some(_) => past_id(&mut bytes),
                None => bytes.push(AFTER_ALL),
            }
            Bound::Excluded(bytes)
        };
        let (start_id, end_id) = (self.start_docid.as_ref(), self.end_docid.as_ref());
        if !self.descending {
            let low = start.map_or(Bound::Unbounded, |key| lower_from(key, start_id));
            let high = match end {
                None => Bound::Unbounded,
                Some(key) if self.inclusive_end => upper_through(key, end_id),
                Some(key) => upper_before(key, end_id),
            };
            RowRange { low, high }
        } else {
            let high = start.map_or(Bound::Unbounded, |key| upper_through(key, start_id));
            let low = match end {
                None => Bound::Unbounded,
                Some(key) if self.inclusive_end => lower_from(key, end_id),
                Some(key) => lower_after(key, end_id),
            };
            RowRange { low, high }
        }
    }
}

/// The group key of a row's key under `grouping`.
pub fn group_key(key: &Value, grouping: Grouping) -> Value {
    match (grouping, key) {
        (Grouping::All, _) => Value::Null,
        (Grouping::Exact, _) => key.clone(),
        (Grouping::Level(level), Value::Array(items)) => {
            Value::Array(items.iter().take(usize::try_from(level).unwrap_or(usize::MAX)).cloned().collect())
        }
        (Grouping::Level(_), other) => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parsed(pairs: &[(&str, &str)]) -> Result<ViewQuery, ViewError> {
        ViewQuery::parse(pairs.iter().copied())
    }

    fn reason(result: Result<Plan, ViewError>) -> String {
        match result {
            Err(ViewError::QueryParse(reason)) => reason,
            other => panic!("expected a query_parse_error, got {other:?}"),
        }
    }

    #[test]
    fn parameters_parse_as_couchdb_reads_them() {
        let query = parsed(&[("key", "\"a\""), ("limit", "5"), ("descending", "TRUE"), ("stale", "ok")]).unwrap();
        assert_eq!(query.start_key, Some(json!("a")));
        assert_eq!(query.end_key, Some(json!("a")));
        assert_eq!(query.limit, Some(5));
        assert!(query.descending);
        assert_eq!(query.update, Update::False);
        assert_eq!(parsed(&[("keys", "[1]")]).unwrap().start_key, Some(json!(1)));
        assert_eq!(parsed(&[("keys", "[1,2]")]).unwrap().keys, Some(vec![json!(1), json!(2)]));
        assert!(matches!(parsed(&[("limit", "-1")]), Err(ViewError::QueryParse(_))));
        assert!(matches!(parsed(&[("limit", "x")]), Err(ViewError::QueryParse(_))));
        assert!(matches!(parsed(&[("group", "yes")]), Err(ViewError::QueryParse(_))));
        assert!(matches!(parsed(&[("key", "{bad")]), Err(ViewError::BadRequest(_))));
        assert!(matches!(parsed(&[("update", "soon")]), Err(ViewError::QueryParse(_))));
    }

    #[test]
    fn plans_are_checked_as_couchdb_checks_them() {
        let plan = |pairs: &[(&str, &str)], has_reduce: bool| parsed(pairs).unwrap().plan(has_reduce);
        assert_eq!(reason(plan(&[("reduce", "true")], false)), "Reduce is invalid for map-only views.");
        assert_eq!(reason(plan(&[("group", "true")], false)), "Invalid use of grouping on a map view.");
        assert_eq!(reason(plan(&[("include_docs", "true")], true)), "`include_docs` is invalid for reduce");
        assert!(matches!(plan(&[("include_docs", "true"), ("reduce", "false")], true), Ok(Plan::Map { .. })));
        assert_eq!(
            reason(plan(&[("keys", "[1,2]")], true)),
            "Multi-key fetches for reduce views must use `group=true`"
        );
        assert!(matches!(
            plan(&[("keys", "[1,2]"), ("group", "true")], true),
            Ok(Plan::Reduce { grouping: Grouping::Exact, ref ranges }) if ranges.len() == 2
        ));
        assert_eq!(
            reason(plan(&[("group", "false"), ("group_level", "2")], true)),
            "Can't specify group=false and group_level>0 at the same time"
        );
        assert!(reason(plan(&[("startkey", "2"), ("endkey", "1")], false)).contains("descending=true"));
        assert!(reason(plan(&[("startkey", "1"), ("endkey", "2"), ("descending", "true")], false))
            .contains("descending=false"));
        assert!(plan(&[("startkey", "1"), ("endkey", "1")], false).is_ok());
        assert!(matches!(plan(&[("group_level", "1")], true), Ok(Plan::Reduce { grouping: Grouping::Level(1), .. })));
    }

    #[test]
    fn group_keys_truncate_arrays() {
        assert_eq!(group_key(&json!([1, 2, 3]), Grouping::Level(2)), json!([1, 2]));
        assert_eq!(group_key(&json!("a"), Grouping::Level(2)), json!("a"));
        assert_eq!(group_key(&json!([1, 2]), Grouping::All), json!(null));
        assert_eq!(group_key(&json!([1, 2]), Grouping::Exact), json!([1, 2]));
    }
}
