//! A database's JSON index catalog (its query design documents, [`DatabaseIndexes`]) remembered
//! between `_find`s, and trusted by a query only when the feed read of that query's own index
//! catch-up confirms it.
//!
//! Why: listing a database's design documents is one `_all_docs` read of the design range, which
//! over DynamoDB is a query of each of the 16 shards of the id index plus a `BatchGetItem`, on
//! every `_find` (docs/benchmarks.md, "DynamoDB and Firestore: queries and migrations"). A view
//! query reads its one design document by id instead.
//!
//! Why it stays exact with many instances over one backend (issue 36): nothing is served because
//! it is recent. A remembered catalog carries the feed positions it is *known complete up to*:
//! every design document written at or before such a position is in it. A `_find` chooses its
//! index from the remembered catalog, then brings that index up to date, which reads the feed
//! from the group's checkpoint `from` to a new checkpoint ([`FeedRead`]), a read that began after
//! the query arrived, so every write acknowledged before the query (through this instance or any
//! other) is at or before the new checkpoint. When `from` is a position the catalog is complete up
//! to and no design document changed in that read, the catalog is complete up to the new
//! checkpoint too, and the query's choice stands. Otherwise (a design document changed, the group
//! was brought up to date by something that did not confirm, a new group, a query without an
//! index or one read with `update=false`) the query's answer is thrown away unread
//! ([`super::database`] gives it an empty source), the catalog is listed again *after* that
//! catch-up (so it is complete up to the checkpoint the catch-up reached) and the query runs on
//! it as it always did.
//!
//! Catalogs are kept per database (its backend's `describe()` and name); a new one replaces the
//! old under a new generation, so a query only confirms the catalog it chose from. At most
//! [`MAX_DATABASES`] databases are remembered (the table is emptied when full: forgetting costs a
//! listing), and each catalog keeps its last [`MAX_POSITIONS`] confirmed positions (one per group
//! in use, so queries on a few different indexes of one database all confirm).

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use super::database::DatabaseIndexes;
use crate::database::Database;
use crate::views::updater::FeedRead;

/// How many databases' catalogs are remembered at most.
const MAX_DATABASES: usize = 256;
/// How many confirmed feed positions one catalog keeps (the oldest goes first).
const MAX_POSITIONS: usize = 8;

/// A remembered catalog, as a query holds it.
#[derive(Clone)]
pub struct Remembered {
    /// Which catalog of the database this is: only its own confirmations count.
    pub generation: u64,
    pub indexes: Arc<DatabaseIndexes>,
}

struct Entry {
    generation: u64,
    indexes: Arc<DatabaseIndexes>,
    /// Feed positions (group checkpoints) up to which the catalog is known complete.
    complete_up_to: Vec<String>,
}

#[derive(Default)]
struct Table {
    generations: u64,
    entries: HashMap<String, Entry>,
}

static TABLE: LazyLock<Mutex<Table>> = LazyLock::new(Mutex::default);

fn table() -> MutexGuard<'static, Table> {
    TABLE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn key_of(db: &Database) -> String {
    format!("{}\u{0}{}", db.backend().describe(), db.name())
}

/// The catalog remembered for `db`, if any (to be confirmed by the query that uses it).
pub fn remembered(db: &Database) -> Option<Remembered> {
    let table = table();
    let entry = table.entries.get(&key_of(db))?;
    Some(Remembered { generation: entry.generation, indexes: Arc::clone(&entry.indexes) })
}

/// Remembers `indexes`, listed after a catch-up reached the feed position `reached` (`None`: no
/// catch-up came before the listing; the catalog is then known complete up to no position yet).
pub fn remember(db: &Database, indexes: DatabaseIndexes, reached: Option<&str>) -> Remembered {
    let mut table = table();
    table.generations += 1;
    let generation = table.generations;
    let key = key_of(db);
    if table.entries.len() >= MAX_DATABASES && !table.entries.contains_key(&key) {
        table.entries.clear();
    }
    let indexes = Arc::new(indexes);
    let complete_up_to = reached.map(str::to_owned).into_iter().collect();
    table.entries.insert(key, Entry { generation, indexes: Arc::clone(&indexes), complete_up_to });
    Remembered { generation, indexes }
}

/// Whether the catalog of `generation` is complete up to `reached`, the checkpoint a catch-up
/// that read `read` brought its group to: known already, or known at the read's start with no
/// design document changed in it (then `reached` is remembered as known).
pub fn confirm(db: &Database, generation: u64, read: &FeedRead, reached: Option<&str>) -> bool {
    let Some(reached) = reached else { return false };
    let mut table = table();
    let Some(entry) = table.entries.get_mut(&key_of(db)) else { return false };
    if entry.generation != generation {
        return false;
    }
    if entry.complete_up_to.iter().any(|known| known == reached) {
        return true;
    }
    let from_known = read.from.as_deref().is_some_and(|from| entry.complete_up_to.iter().any(|known| known == from));
    if read.design_changed || !from_known {
        return false;
    }
    if entry.complete_up_to.len() >= MAX_POSITIONS {
        entry.complete_up_to.remove(0);
    }
    entry.complete_up_to.push(reached.to_owned());
    true
}

/// Forgets `db`'s catalog (after this process changed its indexes: the next `_find` lists them).
pub fn forget(db: &Database) {
    table().entries.remove(&key_of(db));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::catalog::{DbName, EmbeddedCatalog};
    use crate::backend::embedded::EmbeddedOptions;
    use crate::database::Databases;

    fn read(from: Option<&str>, design_changed: bool) -> FeedRead {
        FeedRead { from: from.map(str::to_owned), design_changed }
    }

    #[tokio::test]
    async fn a_catalog_is_confirmed_only_along_reads_from_a_known_position_without_design_changes() {
        let dir = tempfile::tempdir().unwrap();
        let catalog = Arc::new(EmbeddedCatalog::new(&dir.path().join("store.redb"), EmbeddedOptions::default()));
        let databases = Databases::new(Some(catalog), 4);
        let db = databases.create(&DbName::parse("watched").unwrap()).await.unwrap();
        let empty = || DatabaseIndexes::load(&db);

        let first = remember(&db, empty().await.unwrap(), None);
        assert!(!confirm(&db, first.generation, &read(None, false), Some("p1")), "known up to nothing");
        let second = remember(&db, empty().await.unwrap(), Some("p1"));
        assert!(!confirm(&db, first.generation, &read(Some("p1"), false), Some("p2")), "an older generation");
        assert!(!confirm(&db, second.generation, &read(Some("p1"), true), Some("p2")), "a design change");
        assert!(!confirm(&db, second.generation, &read(Some("p0"), false), Some("p2")), "from an unknown position");
        assert!(!confirm(&db, second.generation, &read(Some("p1"), false), None), "no position reached");
        assert!(confirm(&db, second.generation, &read(Some("p1"), false), Some("p2")));
        // Known up to p2 now: a read that ends there confirms, whatever it saw (someone confirmed
        // the stretch before it), and reads go on from there.
        assert!(confirm(&db, second.generation, &read(Some("p0"), true), Some("p2")));
        assert!(confirm(&db, second.generation, &read(Some("p2"), false), Some("p3")));
        forget(&db);
        assert!(remembered(&db).is_none());
        assert!(!confirm(&db, second.generation, &read(Some("p3"), false), Some("p4")));
    }
}
