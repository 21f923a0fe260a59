//! The Mango index catalog remembered between requests, so a `_find` does not first read
//! `_local/agentstore-mango-indexes` from the backend (a round trip to CouchDB, DynamoDB or
//! Firestore on every query).
//!
//! The catalog changes only when an index is created or deleted, which is rare. A catalog read
//! from the backend is served again for [`MAX_AGE`]; a catalog write made through this process
//! (`POST _index`, `DELETE _index/…`) forgets it at once, so this process's own index changes
//! show in its next `_find`. An index created or deleted by another agentstore process sharing
//! the store (or by writing the local document directly) shows here within [`MAX_AGE`]. A read
//! that such a write of this process overlapped is not remembered (a generation counter), so a
//! catalog older than the write never outlives it.
//!
//! Catalogs are kept per store, keyed by the backend's `describe()` (the store's URL or path),
//! so two backends over one store in one process (a test double wrapping a backend, say) share
//! one entry; at most [`MAX_STORES`] stores are remembered, and the table is emptied when full
//! (forgetting only costs a read).

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

use super::index::IndexCatalog;
use crate::backend::DocumentBackend;

/// How long a catalog read from the backend is served again.
pub const MAX_AGE: Duration = Duration::from_secs(5);
/// How many stores' catalogs are remembered at most.
const MAX_STORES: usize = 64;

#[derive(Default)]
struct Catalogs {
    /// Bumped by every catalog write of this process, whichever the store (writes are rare, and
    /// one counter survives the table being emptied).
    generation: u64,
    /// Per store (`describe()`), its catalog and when it was read.
    stores: HashMap<String, (IndexCatalog, Instant)>,
}

/// A process-wide table because the catalog is loaded with nothing but the backend in hand.
static CATALOGS: LazyLock<Mutex<Catalogs>> = LazyLock::new(Mutex::default);

/// Taken before a catalog read; [`remember`] keeps the read only if no write came in between.
pub struct ReadTicket {
    store: String,
    generation: u64,
}

fn table() -> std::sync::MutexGuard<'static, Catalogs> {
    CATALOGS.lock().unwrap_or_else(|e| e.into_inner())
}

/// The remembered catalog of `backend`'s store if it is fresh, and the ticket for remembering a
/// new read otherwise.
pub fn lookup(backend: &dyn DocumentBackend) -> Result<IndexCatalog, ReadTicket> {
    let store = backend.describe();
    let table = table();
    match table.stores.get(&store) {
        Some((catalog, read_at)) if read_at.elapsed() < MAX_AGE => Ok(catalog.clone()),
        _ => Err(ReadTicket { store, generation: table.generation }),
    }
}

/// Remembers a catalog just read, unless a catalog write of this process happened since the
/// ticket was taken.
pub fn remember(ticket: ReadTicket, catalog: &IndexCatalog) {
    let mut table = table();
    if table.generation != ticket.generation {
        return;
    }
    if table.stores.len() >= MAX_STORES && !table.stores.contains_key(&ticket.store) {
        table.stores.clear();
    }
    table.stores.insert(ticket.store, (catalog.clone(), Instant::now()));
}

/// After this process wrote `backend`'s catalog (whatever the outcome): the next load reads it.
pub fn forget(backend: &dyn DocumentBackend) {
    let mut table = table();
    table.generation += 1;
    table.stores.remove(&backend.describe());
}
