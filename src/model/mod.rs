//! The data model of `agent_data_store`: document IDs, field names, input validation, nesting depth and
//! timestamps, exactly as the schema spec defines them. Nothing here touches a backend.

pub mod depth;
pub mod document;
pub mod id;
pub mod number;
pub mod timestamp;
pub mod validate;

/// The spec's collection: the default name of the table, database or collection every backend
/// stores documents in, and of the database the CouchDB API serves.
pub const COLLECTION: &str = "agent_data_store";

pub use document::fields;
pub use id::DocumentId;
pub use validate::Limits;
