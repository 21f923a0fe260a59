//! Mango, CouchDB's query language: `POST /{db}/_find`, `_explain` and `_index`, answered over
//! the data-store database's [`crate::backend::DocumentBackend`] and over every other database
//! ([`database`]).
//!
//! - [`selector`]: a selector's JSON parsed and normalized into an AST, as CouchDB normalizes it.
//! - CouchDB's JSON collation (type order, numbers by value, strings by the Unicode Collation
//!   Algorithm) is shared with the views: [`crate::views::collation`].
//! - [`eval`]: whether a document matches a selector.
//! - [`find`]: the `_find` request, its validation, paging, bookmarks, sort and projection, one
//!   engine over a [`find::FindSource`] per kind of database.
//! - [`database`]: Mango on the other databases: JSON indexes as `language: "query"` design
//!   documents, built as views, read by `_find`.
//! - [`index_source`]: a JSON index's view group read as a `_find` source, on any database this
//!   process builds indexes for (the data-store database's created indexes too).
//! - [`index`]: the index catalog behind `_index`, and `_explain`.
//! - [`range`]: the key ranges CouchDB derives from a selector, which steer its index choice.
//! - [`index_cache`]: the catalog remembered for a few seconds between queries.
//!
//! Errors are [`MangoError`], the `{status, error, reason}` shape of the CouchDB API's error, so
//! the HTTP layer converts one into the other field for field.

pub mod database;
pub mod eval;
pub mod find;
pub mod index;
mod index_cache;
pub mod index_map;
pub mod index_source;
pub mod range;
pub mod request;
pub mod selector;

#[cfg(test)]
mod backend_tests;
#[cfg(test)]
mod data_store_tests;

use axum::http::StatusCode;
use serde_json::Value;

pub use find::{find, find_on_data_store, find_with_limits, DataStoreViews, FindLimits};
pub use index::{create_index, delete_index, explain, list_indexes, IndexCatalog};

/// A Mango request's failure as CouchDB reports it: HTTP status, `error` and `reason`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MangoError {
    pub status: StatusCode,
    pub error: String,
    pub reason: String,
}

impl MangoError {
    pub fn new(status: StatusCode, error: impl Into<String>, reason: impl Into<String>) -> Self {
        MangoError { status, error: error.into(), reason: reason.into() }
    }

    /// A 400 with CouchDB's `error` code for the problem.
    pub fn bad_request(error: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, error, reason)
    }

    /// CouchDB's `bad_arg` for an operator given an argument of the wrong kind.
    pub fn bad_arg(operator: &str, argument: &Value) -> Self {
        Self::bad_request("bad_arg", format!("Bad argument for operator {operator}: {}", erlang_term(argument)))
    }

    /// The response body CouchDB sends for this error.
    pub fn to_json(&self) -> Value {
        serde_json::json!({ "error": self.error, "reason": self.reason })
    }
}

impl std::fmt::Display for MangoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.status.as_u16(), self.error, self.reason)
    }
}

impl std::error::Error for MangoError {}

impl From<crate::error::Error> for MangoError {
    /// A backend failure while answering a query, answered as every CouchDB API route answers it
    /// (a 5xx keeps its details in the log).
    fn from(error: crate::error::Error) -> Self {
        let couch = super::error::CouchError::from(error);
        MangoError::new(couch.status, couch.error, couch.reason)
    }
}

impl From<super::error::CouchError> for MangoError {
    /// A failure of the layers a Mango request uses (the view index, document reads), in the
    /// same shape.
    fn from(error: super::error::CouchError) -> Self {
        MangoError::new(error.status, error.error, error.reason)
    }
}

impl From<MangoError> for super::error::CouchError {
    fn from(error: MangoError) -> Self {
        super::error::CouchError::new(error.status, error.error, error.reason)
    }
}

/// A JSON value as CouchDB's error messages print the Erlang term it decodes to (`~w`): strings as
/// binaries `<<"…">>`, objects as `{[{Key,Value}]}`, `null`/`true`/`false` as atoms. Clients only
/// show these texts, but matching them keeps error bodies identical to CouchDB's.
pub fn erlang_term(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => format!("<<{}>>", Value::String(s.clone())),
        Value::Array(items) => format!("[{}]", items.iter().map(erlang_term).collect::<Vec<_>>().join(",")),
        Value::Object(map) => format!(
            "{{[{}]}}",
            map.iter()
                .map(|(k, v)| format!("{{{},{}}}", erlang_term(&Value::String(k.clone())), erlang_term(v)))
                .collect::<Vec<_>>()
                .join(",")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn erlang_terms_print_as_couchdb_prints_them() {
        assert_eq!(erlang_term(&json!("abc")), "<<\"abc\">>");
        assert_eq!(erlang_term(&json!([1, null, true])), "[1,null,true]");
        assert_eq!(erlang_term(&json!({"a": 1})), "{[{<<\"a\">>,1}]}");
    }
}
