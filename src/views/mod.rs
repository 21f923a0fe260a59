//! CouchDB views over every backend: design documents' map/reduce indexes, built incrementally
//! from a database's change feed and kept in an index file of the serving instance
//! (docs/views.md).
//!
//! - [`collation`]: CouchDB's JSON collation (shared with Mango).
//! - [`sort_key`]: byte strings that sort in that collation, the index's row keys.
//! - [`index_store`]: the index file: rows, back-index and each group's feed position.
//! - [`builtin_reduce`]: `_count`, `_sum`, `_stats`, `_approx_count_distinct`.

pub mod builtin_reduce;
pub mod collation;
pub mod index_store;
pub mod sort_key;
