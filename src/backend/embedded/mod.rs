//! The embedded backend, the default: one crash-safe file, no server.
//!
//! Built on [redb](https://docs.rs/redb): a pure-Rust, ACID, copy-on-write B-tree store in a
//! single file. We chose it over SQLite (a C dependency and a SQL layer we would not use), sled
//! (unmaintained beta) and RocksDB (a heavy C++ build, many files) because it gives exactly what
//! this backend needs — serialisable write transactions, MVCC readers that never block, fsync'd
//! commits that survive a crash, ordered range scans over composite keys, and an exclusive file
//! lock — in a small crate that builds in seconds.
//!
//! Layout (see [`core`] and [`codec`]):
//! - `docs`: `_id` → the live document's record: revision (generation as a big-endian u64, 16
//!   random bytes; it reads `N-<32 hex>`), change-feed position, and the body as compact JSON.
//!   Records written by older releases (no feed position; the oldest with an 8-byte file-wide
//!   counter as revision) are still read and updated; `agentstore upgrade` rewrites them.
//! - `tombstones`: `_id` → the record of a deleted document (revision and feed position, no body).
//!   Kept apart from `docs` so reads, listings, scans and counts never see them.
//! - `by_user_namespace`: `(userId, namespace, _id)` → `()`, the secondary index that makes a
//!   listing cost in proportion to its result.
//! - `feed`: position → `_id`, one entry per document at its latest write, so reading the change
//!   feed from a position costs in proportion to the page.
//! - `ancestry`: `_id` → the last `revs_limit` revision tokens, newest first (16 bytes each).
//! - `local`: `_local/` documents (replication checkpoints), revision `0-N`, apart from the rest.
//! - `meta`: the next feed position and the layout version.
//! - `attachment_chunks`: `(blob, index)` → the raw bytes of one chunk of an attachment,
//!   invisible to everything but the attachment calls ([`attachments`]).
//!
//! The tables keyed by an id or a local name store redb's `&str` keys but compare them as bytes
//! ([`core::IdKey`]: the same file, the same order, no UTF-8 check at every comparison).
//!
//! Every table is updated in the same write transaction, so they never disagree after a crash.
//! Concurrent writes share transactions ([`group_commit`]): one fsync'd commit for every write
//! waiting when it begins, each answered once its commit is durable.
//! A revision is never reused, even after a document is deleted and created again: 128 random
//! bits make a repeat as unlikely as a UUID collision.
//!
//! Files, as in every adapter:
//! - `config`: none of its own; the `embedded:` URL is read in `backend/url.rs` into
//!   [`EmbeddedOptions`].
//! - [`core`]: the tables of the file, creating them, and the read transactions.
//! - [`backend`]: the `DocumentBackend` implementation, calling into the files below.
//! - [`error`]: redb's and tokio's errors → the crate's error kinds.
//! - [`codec`]: the bytes of a record (revision, feed position, JSON body) in every layout.
//! - [`write`]: the write transaction and the writes that run in it.
//! - [`feed`]: the change feed and its current position.
//! - [`ids`]: documents in id order, erasure by prefix.
//! - [`local`]: `_local/` documents.
//! - [`group_commit`]: concurrent writes sharing one fsync'd transaction.
//! - [`attachments`]: attachment chunks.

mod attachments;
mod backend;
mod codec;
mod core;
mod error;
mod feed;
mod group_commit;
mod ids;
mod local;
mod write;

pub use self::core::write_previous_release_file;
pub use backend::{EmbeddedBackend, EmbeddedOptions};
