//! The CouchDB backend: drop-in persistence for existing `agent_data_store` deployments.
//!
//! Documents are stored exactly as the existing system stores them (same database, `_id`s and
//! fields; `_rev` is the revision). Listings use `_find` on the Mango index `idx-user-namespace`,
//! which is ensured at startup and before the first write to each namespace, and page with
//! `bookmark` until a page comes back shorter than the limit (CouchDB answers at most 25 documents
//! when no limit is given, so a limit is always sent). A design document of the earlier schema
//! revision (`_design/data_store`) is never touched and never returned as data.
//!
//! - [`config`]: the `couchdb+http(s)://` URL.
//! - [`client`]: the raw HTTP calls (reqwest; keep-alive pool, TLS, basic auth, timeouts, retries
//!   with backoff and jitter for idempotent reads).
//! - [`error`]: CouchDB statuses and bodies → the crate's error kinds.
//! - [`backend`]: the `DocumentBackend` implementation.
//! - [`counts`]: document counts remembered briefly, so `_all_docs` costs one request.
//!
//! CouchDB's document model is the one the trait describes, so each part maps onto its native
//! feature (see `docs/couchdb-document-model.md`):
//! - [`history`]: revisions and ancestry (`?revs=true`), tombstones found through `_all_docs`.
//! - [`feed`]: the change feed (`_changes`) and its current position (`update_seq`).
//! - [`id_order`]: documents in id order (`_all_docs`), design documents left out.
//! - [`purge`]: erasure by prefix (`_changes` with a `_selector` filter, then `_purge`).
//! - [`local`]: `_local/` documents.
//! - [`replicated`]: replicated writes (`_bulk_docs` with `new_edits: false`).
//! - [`live`]: keeps a tombstone's revision from reviving or re-deleting a document.

mod backend;
mod client;
mod codec;
pub mod config;
mod counts;
mod design;
mod error;
mod feed;
mod history;
mod id_order;
mod live;
mod local;
mod purge;
mod replicated;

pub use backend::{CouchDbBackend, INDEX_NAME};
pub use client::READ_RETRY;
pub use config::CouchConfig;
