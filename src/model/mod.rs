//! The data model of `agent_data_store`: document IDs, field names, input validation and
//! timestamps, exactly as the schema spec defines them. Nothing here touches a backend.

pub mod document;
pub mod id;
pub mod number;
pub mod timestamp;
pub mod validate;

pub use document::fields;
pub use id::DocumentId;
pub use validate::Limits;
