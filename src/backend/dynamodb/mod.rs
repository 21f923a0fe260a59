//! The DynamoDB backend: the spec's table (partition key `_id`) and GSI (`userId` + `namespace`),
//! through the official AWS SDK, with lossless values (see `docs/dynamodb-layout.md`).
//!
//! - [`config`]: the `dynamodb://` URL.
//! - [`codec`]: JSON bodies ↔ items: native attributes where exact, compressed and chunked JSON
//!   where not.
//! - [`error`]: SDK errors → the crate's error kinds.
//! - [`backend`]: the `DocumentBackend` implementation.
//! - [`model`]: writes that continue generations and ancestry, tombstones.
//! - [`feed`]: the change feed, id order and erasure over the sharded indexes.
//! - [`local`]: local documents.
//! - [`layout`]: the document model's attributes and indexes, and the upgrade.

mod backend;
pub mod codec;
pub mod config;
mod error;
mod feed;
pub mod layout;
mod local;
mod model;

pub use backend::DynamoDbBackend;
pub use config::DynamoConfig;
