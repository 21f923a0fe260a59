//! The embedded backend, the default: one crash-safe file, no server.
//!
//! Built on [redb](https://docs.rs/redb): a pure-Rust, ACID, copy-on-write B-tree store in a
//! single file. We chose it over SQLite (a C dependency and a SQL layer we would not use), sled
//! (unmaintained beta) and RocksDB (a heavy C++ build, many files) because it gives exactly what
//! this backend needs — serialisable write transactions, MVCC readers that never block, fsync'd
//! commits that survive a crash, ordered range scans over composite keys, and an exclusive file
//! lock — in a small crate that builds in seconds.
//!
//! Layout (see [`backend`]):
//! - `docs`: `_id` → the revision (a tag byte, the document's generation as a big-endian u64, 16
//!   random bytes) + the body as compact JSON. Revisions read `N-<32 hex digits>`; records written
//!   by older releases (an 8-byte file-wide counter instead) are still read and updated.
//! - `by_user_namespace`: `(userId, namespace, _id)` → `()`, the secondary index that makes a
//!   listing cost in proportion to its result. It is updated in the same transaction as `docs`.
//!
//! A revision is never reused, even after a document is deleted and created again: 128 random
//! bits make a repeat as unlikely as a UUID collision. Older releases kept a `meta` table with a
//! file-wide counter; files that have it keep it, unread.

mod backend;
mod error;

pub use backend::EmbeddedBackend;
