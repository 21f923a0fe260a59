//! Mango, CouchDB's query language (CouchDB's `mango` application): `_find`, `_explain` and
//! `_index`, answered over the data-store database's [`crate::backend::DocumentBackend`] and over
//! every other database ([`database`]). The HTTP routes that read the requests and send the
//! answers are `crate::couchdb_api`'s (`db/mango.rs`; `query.rs` for the CouchDB backend's
//! data-store database); nothing here knows HTTP
//! requests, and nothing here uses the HTTP layer.
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
//!   process builds indexes for (the data-store database's created indexes too). A database is
//!   read as a [`crate::views::ViewSource`] (its feed and incarnation), the trait the views'
//!   engine reads: the data-store database's engine `Database` is one.
//! - [`index`]: the index catalog behind `_index`, and `_explain`.
//! - [`range`]: the key ranges CouchDB derives from a selector, which steer its index choice.
//! - [`index_cache`]: the catalog remembered for a few seconds between queries.
//! - [`catalog_watch`]: another database's JSON index catalog remembered between `_find`s, trusted
//!   only when the query's own index catch-up shows no design document changed since it was read.
//!
//! Errors are [`MangoError`]: Mango's own refusals with the status, `error` and `reason` CouchDB's
//! `mango_error` gives them, decided here, and the failures of the layers below (the store, a
//! view index) carried as they are; the HTTP layer turns one into its answer
//! (`crate::couchdb_api::error`).

pub mod catalog_watch;
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

use http::StatusCode;
use serde_json::Value;

use crate::views::ViewError;

pub use find::{find, find_on_data_store, find_with_limits, DataStoreViews, FindLimits};
pub use index::{create_index, delete_index, explain, list_indexes, IndexCatalog};

/// Why a Mango request failed.
#[derive(Debug)]
pub enum MangoError {
    /// Mango refused the request (or failed in its own terms) as CouchDB reports it.
    Refused(Refusal),
    /// The store under the database failed; it is answered as every route answers it.
    Storage(crate::error::Error),
    /// A JSON index's view group could not be built or read; answered as the views answer it.
    View(ViewError),
}

/// A Mango refusal as CouchDB reports it (`mango_error:info/2`): HTTP status, `error` and `reason`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub status: StatusCode,
    pub error: String,
    pub reason: String,
}

impl Refusal {
    /// The response body CouchDB sends for this refusal.
    pub fn to_json(&self) -> Value {
        serde_json::json!({ "error": self.error, "reason": self.reason })
    }
}

impl MangoError {
    pub fn new(status: StatusCode, error: impl Into<String>, reason: impl Into<String>) -> Self {
        MangoError::Refused(Refusal { status, error: error.into(), reason: reason.into() })
    }

    /// A 400 with CouchDB's `error` code for the problem.
    pub fn bad_request(error: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, error, reason)
    }

    /// CouchDB's `bad_arg` for an operator given an argument of the wrong kind.
    pub fn bad_arg(operator: &str, argument: &Value) -> Self {
        Self::bad_request("bad_arg", format!("Bad argument for operator {operator}: {}", erlang_term(argument)))
    }

    /// Whether another writer got in first (a write's revision precondition failed).
    pub fn is_conflict(&self) -> bool {
        match self {
            MangoError::Refused(refusal) => refusal.status == StatusCode::CONFLICT,
            MangoError::Storage(error) => error.is_conflict(),
            MangoError::View(_) => false,
        }
    }

    /// The refusal this is; a test's way to read statuses and reasons (panics on a failure of a
    /// layer below).
    #[cfg(test)]
    pub(crate) fn refusal(self) -> Refusal {
        match self {
            MangoError::Refused(refusal) => refusal,
            other => panic!("a failure below Mango, not a refusal: {other}"),
        }
    }
}

impl std::fmt::Display for MangoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MangoError::Refused(Refusal { status, error, reason }) => {
                write!(f, "{} {error}: {reason}", status.as_u16())
            }
            MangoError::Storage(error) => write!(f, "{error}"),
            MangoError::View(error) => write!(f, "{error}"),
        }
    }
}

impl std::error::Error for MangoError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            MangoError::Storage(error) => Some(error),
            MangoError::Refused(_) | MangoError::View(_) => None,
        }
    }
}

impl From<crate::error::Error> for MangoError {
    /// A store failure while answering a query, carried as it is.
    fn from(error: crate::error::Error) -> Self {
        MangoError::Storage(error)
    }
}

impl From<ViewError> for MangoError {
    fn from(error: ViewError) -> Self {
        MangoError::View(error)
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
