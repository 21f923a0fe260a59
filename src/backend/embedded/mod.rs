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
//! - `docs`: `_id` → 8-byte big-endian revision + the body as compact JSON.
//! - `by_user_namespace`: `(userId, namespace, _id)` → `()`, the secondary index that makes a
//!   listing cost in proportion to its result. It is updated in the same transaction as `docs`.
//! - `meta`: `seq`, the last revision number handed out. Revisions come from this one counter, so
//!   a revision is never reused, even after a document is deleted and created again.

mod backend;
mod error;

pub use backend::EmbeddedBackend;
