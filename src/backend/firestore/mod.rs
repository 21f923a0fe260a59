//! The Firestore backend: the spec's collection `agent_data_store` keyed by the composite id,
//! queried through the composite index `userId` + `namespace`, over the REST API v1, with
//! lossless values (see `docs/firestore-layout.md`).
//!
//! - [`config`]: the `firestore://` URL.
//! - [`codec`]: composite ids ↔ document ids, JSON bodies ↔ Firestore fields: native values where
//!   exact, compressed and chunked JSON where not.
//! - [`client`]: the HTTP calls, credentials and retries.
//! - [`error`]: Firestore's answers → the crate's error kinds.
//! - [`model`]: the document model's fields: stored revisions, ancestry, tombstones, feed time.
//! - [`feed`]: the change feed's positions.
//! - [`backend`]: the `DocumentBackend` implementation.

mod backend;
mod client;
pub mod codec;
pub mod config;
mod error;
mod feed;
mod listing;
mod model;

pub use backend::FirestoreBackend;
pub use client::RETRY;
pub use config::FirestoreConfig;
