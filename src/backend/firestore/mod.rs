//! The Firestore backend: the spec's collection `agent_data_store` keyed by the composite id,
//! queried through the composite index `userId` + `namespace`, over the REST API v1, with
//! lossless values (see `docs/firestore-layout.md`).
//!
//!
//! Files, as in every adapter:
//! - [`config`]: the `firestore://` URL.
//! - [`core`]: the raw REST calls (credentials, retries) and the queries they carry.
//! - [`backend`]: the `DocumentBackend` implementation, and the reads it is made of.
//! - [`error`]: Firestore's answers → the crate's error kinds.
//! - [`codec`]: composite ids ↔ document ids, JSON bodies ↔ Firestore fields: native values where
//!   exact, compressed and chunked JSON ([`crate::backend::raw::compressed`]) where not.
//! - [`write`]: writes that continue generations and ancestry, tombstones, replicated writes.
//! - [`feed`]: the change feed (`_changedAt` sweeps) and its positions.
//! - [`ids`]: documents in id order, erasure by prefix or of one id.
//! - [`local`]: `_local/` documents.
//! - [`layout`]: the document model's fields: stored revisions, ancestry, tombstones, feed time.
//! - [`upgrade`]: the layout marker and the upgrade of documents of the previous release.
//! - [`catalog`]: the databases besides the data store's, each under its marker document.
//! - [`attachments`]: attachment chunks, a document each in a collection beside the data's.
//! - [`count_check`]: the check that a remembered count still holds (the feed's latest entries,
//!   the purge trace every erasure increments).

mod attachments;
mod backend;
pub mod catalog;
pub mod codec;
pub mod config;
mod core;
mod count_check;
mod error;
mod feed;
mod ids;
mod layout;
mod local;
mod upgrade;
mod write;

pub use self::core::RETRY;
pub use backend::FirestoreBackend;
pub use catalog::FirestoreCatalog;
pub use config::FirestoreConfig;
