//! Tree layouts: how a document's revision tree is laid out over a backend's records.
//!
//! - [`data_store`]: the data-store database's layout: the record is the seed's document holding
//!   the winning revision (what the REST API and the facade read), the other leaves in the local
//!   document `:leaves:{id}`.
//!
//! The engine's own layout (every other database: the whole tree in the record, a deleted
//! document's tree in the local document `tree:{id}`) is [`super::engine`]'s.

pub mod data_store;
