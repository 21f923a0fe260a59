//! The CouchDB backend: drop-in persistence for existing `agent_data_store` deployments.
//!
//! Documents are stored exactly as the existing system stores them (same database, `_id`s and
//! fields; `_rev` is the revision). Listings use `_find` on the Mango index `idx-user-namespace`,
//! which is ensured at startup and before the first write to each namespace, and page with
//! `bookmark` until a page comes back shorter than the limit (CouchDB answers at most 25 documents
//! when no limit is given, so a limit is always sent). A design document of the earlier schema
//! revision (`_design/data_store`) is never touched and never returned as data.
//!
//! Files, as in every adapter:
//! - [`config`]: the `couchdb+http(s)://` URL.
//! - [`core`]: the raw HTTP calls (reqwest; keep-alive pool, TLS, basic auth, timeouts, retries
//!   with backoff and jitter for idempotent reads).
//! - [`backend`]: the `DocumentBackend` implementation; plain puts, deletes and reads.
//! - [`error`]: CouchDB statuses and bodies → the crate's error kinds.
//! - [`codec`]: bodies on their way to CouchDB, held to the service's number model.
//! - [`write`]: replicated writes (`_bulk_docs` with `new_edits: false`).
//! - [`feed`]: the change feed (`_changes`) and its current position (`update_seq`).
//! - [`ids`]: documents in id order (`_all_docs`, design documents left out), erasure by prefix
//!   (`_changes` with a `_selector` filter, then `_purge`) or of one id (its leaves, then `_purge`).
//! - [`local`]: `_local/` documents.
//! - [`history`]: revisions and ancestry (`?revs=true`), tombstones found through `_all_docs`.
//! - [`counts`]: document counts remembered briefly, so `_all_docs` costs one request.
//! - [`design`]: design documents, passed through to CouchDB.
//! - [`live`]: keeps a tombstone's revision from reviving or re-deleting a document.
//! - [`catalog`]: the databases besides the data store's, native databases of the server.
//!
//! CouchDB's document model is the one the trait describes, so each part maps onto its native
//! feature (see `docs/couchdb-document-model.md`).

mod backend;
pub mod catalog;
mod codec;
pub mod config;
mod core;
mod counts;
mod design;
mod error;
mod feed;
mod history;
mod ids;
mod live;
mod local;
mod write;

pub use self::core::READ_RETRY;
pub use backend::{CouchDbBackend, INDEX_NAME};
pub use catalog::CouchCatalog;
pub use config::CouchConfig;
