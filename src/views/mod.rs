//! CouchDB views over every backend: design documents' map/reduce indexes, built incrementally
//! from a database's change feed and kept in an index file of the serving instance
//! (docs/views.md).
//!
//! - [`collation`]: CouchDB's JSON collation (shared with Mango).
//! - [`sort_key`]: byte strings that sort in that collation, the index's row keys.
//! - [`index_store`]: the index file: rows, back-index and each group's feed position.
//! - [`builtin_reduce`]: `_count`, `_sum`, `_stats`, `_approx_count_distinct`.
//! - [`design`]: a design document's views, and the signature that names their index.
//! - [`source`]: [`ViewSource`], where a group's documents come from: a database's change feed
//!   and its documents as a map function sees them (every database, the data-store one too).
//! - [`updater`]: catching a view group up with the change feed.
//! - [`freshness`]: concurrent catch-ups of one group sharing a feed read.
//! - [`query`]: a query's parameters, checked, and the key ranges they select.
//! - [`reduce_cache`]: reduce answers kept until their group's rows change.
//! - [`run`]: answering a query from the index (rows, or grouped reductions).
//! - [`javascript`]: the JavaScript engine ([`crate::js`]) as the views' mapper and reducer.
//! - [`index_file`]: which index file this process claims at startup (a slot no other holds).
//! - [`service`]: this process's views: the index file and the engine.

pub mod builtin_reduce;
pub mod collation;
pub mod design;
pub mod freshness;
pub mod index_file;
pub mod index_store;
pub mod javascript;
pub mod query;
pub mod reduce_cache;
pub mod run;
pub mod service;
pub mod sort_key;
pub mod source;
pub mod updater;

use builtin_reduce::ReduceError;
pub use source::{SourceDoc, SourcePage, ViewSource};

/// Why a view could not be read, in CouchDB's terms (the HTTP layer maps each to its answer).
#[derive(Debug)]
pub enum ViewError {
    /// `query_parse_error` (400): a parameter CouchDB refuses.
    QueryParse(String),
    /// `bad_request` (400): a parameter that is not JSON where JSON is expected.
    BadRequest(String),
    /// `not_found` (404), with CouchDB's reason (`missing`, `missing_named_view`, …).
    NotFound(String),
    /// `invalid_design_doc` (400): the design document's views cannot be built.
    InvalidDesign(String),
    /// `builtin_reduce_error`: a built-in reduce refused a value.
    Reduce(ReduceError),
    /// A JavaScript function failed as a whole (compilation, time, memory): CouchDB's error name
    /// and reason.
    Function { error: String, reason: String },
    /// Every JavaScript worker is busy and its queue full (`couchdb_js_workers`): try again.
    Busy,
    /// Bringing the index up to date would take the database's index past
    /// `couchdb_view_max_index_bytes` (the reason says so); `update=false` still answers.
    IndexFull(String),
    /// The store or the index file failed.
    Storage(crate::error::Error),
}

impl std::fmt::Display for ViewError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ViewError::QueryParse(reason)
            | ViewError::BadRequest(reason)
            | ViewError::NotFound(reason)
            | ViewError::IndexFull(reason) => f.write_str(reason),
            ViewError::InvalidDesign(reason) => write!(f, "invalid design document: {reason}"),
            ViewError::Reduce(error) => write!(f, "{}", error.reason),
            ViewError::Function { error, reason } => write!(f, "{error}: {reason}"),
            ViewError::Busy => f.write_str("every JavaScript worker is busy"),
            ViewError::Storage(error) => write!(f, "{error}"),
        }
    }
}
