//! The DynamoDB backend: the spec's table (partition key `_id`) and GSI (`userId` + `namespace`),
//! through the official AWS SDK, with lossless values (see `docs/dynamodb-layout.md`).
//!
//! - [`config`]: the `dynamodb://` URL.
//! - [`codec`]: JSON bodies ↔ items: native attributes where exact, compressed and chunked JSON
//!   where not.
//! - [`error`]: SDK errors → the crate's error kinds.
//! - [`backend`]: the `DocumentBackend` implementation.

mod backend;
pub mod codec;
pub mod config;
mod error;

pub use backend::DynamoDbBackend;
pub use config::DynamoConfig;
