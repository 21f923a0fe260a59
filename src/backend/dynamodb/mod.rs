//! The DynamoDB backend: the spec's table (partition key `_id`) and GSI (`userId` + `namespace`),
//! through the official AWS SDK, with lossless values (see `docs/dynamodb-layout.md`).
//!
//!
//! Files, as in every adapter:
//! - [`config`]: the `dynamodb://` URL.
//! - `core`: none of its own; the raw calls are the AWS SDK's `Client`.
//! - [`backend`]: the `DocumentBackend` implementation, the table's creation and the reads.
//! - [`error`]: SDK errors → the crate's error kinds.
//! - [`codec`]: JSON bodies ↔ items: native attributes where exact, compressed and chunked JSON
//!   ([`crate::backend::raw::compressed`]) where not.
//! - [`write`]: writes that continue generations and ancestry, tombstones, replicated writes.
//! - [`feed`]: the change feed over the sharded feed index.
//! - [`ids`]: documents in id order over the sharded id index, erasure by prefix or of one id,
//!   and a database table's exact counts over the indexes.
//! - [`local`]: `_local/` documents.
//! - [`layout`]: the document model's attributes and indexes.
//! - [`upgrade`]: the layout marker, creating the indexes, and the upgrade of the previous
//!   release's items.
//! - [`catalog`]: the databases besides the data store's, a table each.
//! - [`attachments`]: attachment chunks, an item each, under id-index shards of their own.
//! - [`count_check`]: the check that a remembered count still holds (the feed's latest entries,
//!   the purge trace every erasure bumps).

pub mod attachments;
mod backend;
pub mod catalog;
pub mod codec;
pub mod config;
mod count_check;
mod error;
mod feed;
mod ids;
pub mod layout;
mod local;
mod upgrade;
mod write;

pub use backend::DynamoDbBackend;
pub use catalog::DynamoCatalog;
pub use config::DynamoConfig;
