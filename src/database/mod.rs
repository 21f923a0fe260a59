//! A CouchDB database on any backend: every database besides the data-store database keeps
//! CouchDB's document rules and every leaf of each document's revision tree, stored inside the
//! documents of an ordinary [`crate::backend::DocumentBackend`] opened on the database's own
//! namespace ([`crate::backend::catalog`]). The engine can serve the data-store database too,
//! over the seed's records at the backend's top level ([`Database::data_store`]).
//!
//! - [`rev_tree`]: the revision tree and CouchDB's rules on it (pure).
//! - [`engine`]: one database: how a tree is stored in the backend and changed atomically.
//! - [`layout`]: how a document's tree is laid out over the backend's records (the engine's, the
//!   data-store database's).
//! - [`rev_id`]: new revision ids, computed from the edit as CouchDB computes them.
//! - [`document`]: CouchDB's rules for a client's document (ids, special fields, size).
//! - [`attachments`]: attachment bytes, chunked into the backend and addressed by SHA-256.
//! - [`doc_attachments`]: `_attachments` in documents: stubs, inline data, carried stubs.
//! - [`write_guard`] and [`validation`]: the check before every write, and CouchDB's
//!   `validate_doc_update` run as that check.
//! - [`data_store_rules`]: the data-store database's rules on its documents (ids made of their
//!   fields, field types, per-user confinement), also run as that check.
//! - [`users`]: the `_users` database's rules (passwords hashed on write, user documents'
//!   validation, stored hashes checked at login), its guard chained before `validate_doc_update`.
//! - [`replicator_owner`]: the `owner` a `_replicator` document is given on a client's write.
//! - [`activity`]: what the databases did (documents read, databases changed) and their events
//!   waiting for [`global_changes`], which writes them to `_global_changes` for `_db_updates`.
//! - [`Databases`] (here): the open databases of the server, over the backend's catalog.

pub mod activity;
pub mod attachments;
pub mod data_store_rules;
pub mod doc_attachments;
pub mod document;
pub mod engine;
pub mod global_changes;
mod keyed_locks;
pub mod layout;
pub mod parsed_designs;
pub mod replicator_owner;
pub mod rev_id;
pub use crate::backend::rev_tree;
pub mod seq;
pub mod users;
pub mod validation;
pub mod write_guard;

use std::collections::HashMap;
use std::sync::Arc;

pub use engine::{Database, DocState, InnerBodyBounds, ReadBefore, Write, Written};

use crate::backend::catalog::{Catalog, DbName};
use crate::backend::BackendUrl;
use crate::error::{Error, ErrorKind, Result};

/// The server's databases besides the data-store one, opened once each and shared by requests;
/// each is confirmed with the catalog before it serves a request ([`Databases::open`]), since
/// another instance over the same backend may have deleted or re-created it.
pub struct Databases {
    /// Where the catalog comes from: opened on first use (`None`: the backend keeps no databases
    /// besides the data-store one).
    source: Option<BackendUrl>,
    catalog: tokio::sync::OnceCell<Arc<dyn Catalog>>,
    /// Open databases and when each was last asked for. Held only while the map is read or
    /// changed, never across a backend call.
    open: std::sync::Mutex<HashMap<DbName, OpenDatabase>>,
    /// One lock per name, held across the backend calls that create, open, close or delete that
    /// database ([`NameLocks`]): a slow catalog call (a DynamoDB `CreateTable`) holds up requests
    /// for its own name only.
    name_locks: NameLocks,
    /// How many stay open at once (`couchdb_max_open_databases`).
    max_open: usize,
    /// How long an open database is served after the catalog last confirmed it before it is
    /// confirmed again (`couchdb_database_recheck_ms`; zero: on every request).
    recheck: std::time::Duration,
    /// Largest document body (`couchdb_max_document_bytes`), given to each database opened.
    max_document_bytes: usize,
    /// Largest revision tree of one document (`couchdb_max_tree_bytes`), given to each database
    /// opened.
    max_tree_bytes: usize,
    /// How many inner revisions' bodies one document keeps until compaction
    /// (`couchdb_inner_bodies_max_revisions`, `couchdb_inner_bodies_max_bytes`).
    inner_bodies: engine::InnerBodyBounds,
    /// Largest attachment (`couchdb_max_attachment_bytes`) and how long unreferenced bytes stay
    /// (`couchdb_attachment_grace_secs`), given to each database opened.
    max_attachment_bytes: u64,
    attachment_grace: std::time::Duration,
    /// The most a gzip-encoded attachment part decodes to per compressed byte
    /// (`couchdb_max_gzip_ratio`), given to each database opened.
    max_gzip_ratio: u64,
    /// Attachment bytes shown inline being served at once (`couchdb_max_inflight_inline_bytes`),
    /// one budget shared by every database.
    inline_budget: Arc<crate::server::budget::ByteBudget>,
    /// How long a read waits for its share of it (`couchdb_inline_wait_ms`).
    inline_wait: std::time::Duration,
    /// What checks writes against the databases' validation functions, if anything.
    write_guard: Option<Arc<dyn write_guard::WriteGuard>>,
    /// Guards of single databases, asked before [`Self::write_guard`] (the `_replicator`
    /// database's rules, which live in `crate::replicator`).
    database_guards: HashMap<String, Arc<dyn write_guard::WriteGuard>>,
    /// Reads and changes of every database opened here, and their pending events
    /// ([`activity`]; written to `_global_changes` by [`global_changes`]).
    activity: Arc<activity::Activity>,
}

/// What the catalog says of a database this server holds open ([`Databases::confirmed`]).
enum Confirmation {
    /// It is the one held.
    Same,
    /// It no longer exists.
    Gone,
    /// It was deleted and created again (through another instance): the one held is let go.
    Replaced,
}

/// Whether two backend handles are one (their data, whatever the vtables the `dyn` pointers
/// carry).
fn same_handle(a: &Arc<dyn crate::backend::DocumentBackend>, b: &Arc<dyn crate::backend::DocumentBackend>) -> bool {
    std::ptr::eq(Arc::as_ptr(a).cast::<()>(), Arc::as_ptr(b).cast::<()>())
}

struct OpenDatabase {
    database: Arc<Database>,
    last_used: std::time::Instant,
    /// When the catalog last said this is the database of its name ([`Databases::confirmed`]).
    confirmed: std::time::Instant,
}

/// A lock per database name, made when a request first needs it and gone when no request holds
/// it ([`keyed_locks`]).
type NameLocks = keyed_locks::KeyedLocks<DbName>;

impl Databases {
    /// The databases of a catalog already open.
    pub fn new(catalog: Option<Arc<dyn Catalog>>, max_open: usize) -> Self {
        let opened = tokio::sync::OnceCell::new();
        if let Some(catalog) = catalog {
            let _ = opened.set(catalog);
        }
        Databases {
            source: None,
            catalog: opened,
            open: std::sync::Mutex::new(HashMap::new()),
            name_locks: NameLocks::default(),
            max_open: max_open.max(1),
            recheck: std::time::Duration::ZERO,
            max_document_bytes: engine::DEFAULT_MAX_DOCUMENT_BYTES,
            max_tree_bytes: engine::DEFAULT_MAX_TREE_BYTES,
            inner_bodies: engine::InnerBodyBounds::default(),
            max_attachment_bytes: u64::MAX,
            attachment_grace: attachments::DEFAULT_GRACE,
            max_gzip_ratio: engine::DEFAULT_MAX_GZIP_RATIO,
            inline_budget: Arc::new(crate::server::budget::ByteBudget::new(engine::DEFAULT_MAX_INFLIGHT_INLINE_BYTES)),
            inline_wait: engine::DEFAULT_INLINE_WAIT,
            write_guard: None,
            database_guards: HashMap::new(),
            activity: Arc::default(),
        }
    }

    /// The databases kept beside the backend `url` names (its catalog opened on first use, so a
    /// server whose clients never use another database never connects for them).
    pub fn from_url(url: Option<BackendUrl>, max_open: usize) -> Self {
        Databases {
            source: url,
            catalog: tokio::sync::OnceCell::new(),
            open: std::sync::Mutex::new(HashMap::new()),
            name_locks: NameLocks::default(),
            max_open: max_open.max(1),
            recheck: std::time::Duration::ZERO,
            max_document_bytes: engine::DEFAULT_MAX_DOCUMENT_BYTES,
            max_tree_bytes: engine::DEFAULT_MAX_TREE_BYTES,
            inner_bodies: engine::InnerBodyBounds::default(),
            max_attachment_bytes: u64::MAX,
            attachment_grace: attachments::DEFAULT_GRACE,
            max_gzip_ratio: engine::DEFAULT_MAX_GZIP_RATIO,
            inline_budget: Arc::new(crate::server::budget::ByteBudget::new(engine::DEFAULT_MAX_INFLIGHT_INLINE_BYTES)),
            inline_wait: engine::DEFAULT_INLINE_WAIT,
            write_guard: None,
            database_guards: HashMap::new(),
            activity: Arc::default(),
        }
    }

    /// The largest document body the databases take (`couchdb_max_document_bytes`).
    pub fn with_max_document_bytes(self, max_document_bytes: usize) -> Self {
        Databases { max_document_bytes: max_document_bytes.max(1), ..self }
    }

    /// The largest revision tree of one document the databases keep (`couchdb_max_tree_bytes`).
    pub fn with_max_tree_bytes(self, max_tree_bytes: usize) -> Self {
        Databases { max_tree_bytes: max_tree_bytes.max(1), ..self }
    }

    /// How many inner revisions' bodies one document keeps until compaction.
    pub fn with_inner_body_bounds(self, inner_bodies: engine::InnerBodyBounds) -> Self {
        Databases { inner_bodies, ..self }
    }

    /// The largest attachment the databases store (`couchdb_max_attachment_bytes`) and how long
    /// bytes no revision references are kept (`couchdb_attachment_grace_secs`).
    pub fn with_attachment_bounds(self, max_attachment_bytes: u64, grace: std::time::Duration) -> Self {
        Databases { max_attachment_bytes: max_attachment_bytes.max(1), attachment_grace: grace, ..self }
    }

    /// The most a gzip-encoded attachment part may decode to per compressed byte
    /// (`couchdb_max_gzip_ratio`).
    pub fn with_max_gzip_ratio(self, max_gzip_ratio: u64) -> Self {
        Databases { max_gzip_ratio: max_gzip_ratio.max(1), ..self }
    }

    /// The server-wide budget of attachment bytes shown inline at once
    /// (`couchdb_max_inflight_inline_bytes`) and how long a read waits for its share
    /// (`couchdb_inline_wait_ms`).
    pub fn with_inline_budget(self, bytes: usize, wait: std::time::Duration) -> Self {
        let inline_budget = Arc::new(crate::server::budget::ByteBudget::new(bytes.max(1)));
        Databases { inline_budget, inline_wait: wait, ..self }
    }

    /// How long an open database is served before the catalog is asked again whether it still
    /// exists and is the same (`couchdb_database_recheck_ms`; zero, the default: every request).
    pub fn with_recheck(self, recheck: std::time::Duration) -> Self {
        Databases { recheck, ..self }
    }

    /// Every database checks its writes with `guard` (CouchDB's `validate_doc_update`).
    pub fn with_write_guard(self, guard: Arc<dyn write_guard::WriteGuard>) -> Self {
        Databases { write_guard: Some(guard), ..self }
    }

    /// Database `name` checks its writes with `guard` first, then with the databases' own.
    pub fn with_database_guard(mut self, name: &str, guard: Arc<dyn write_guard::WriteGuard>) -> Self {
        self.database_guards.insert(name.to_owned(), guard);
        self
    }

    /// What the databases opened here did ([`activity`]).
    pub fn activity(&self) -> &Arc<activity::Activity> {
        &self.activity
    }

    /// How many databases are open now (the data-store database is not among them).
    pub fn open_count(&self) -> usize {
        self.open_map().len()
    }

    /// A database of these settings over its namespace's backend.
    fn database(&self, name: &DbName, backend: Arc<dyn crate::backend::DocumentBackend>) -> Arc<Database> {
        Arc::new(
            Database::new(name.to_string(), backend)
                .with_activity(Arc::clone(&self.activity))
                .with_max_document_bytes(self.max_document_bytes)
                .with_max_tree_bytes(self.max_tree_bytes)
                .with_inner_body_bounds(self.inner_bodies)
                .with_max_gzip_ratio(self.max_gzip_ratio)
                .with_inline_budget(Arc::clone(&self.inline_budget), self.inline_wait)
                .with_attachment_bounds(self.max_attachment_bytes, self.attachment_grace)
                .with_write_guard(self.guard_of(name)),
        )
    }

    /// The write guard of database `name`: the databases' own, after the `_users` rules there.
    /// Databases opened without a guard (`migrate --all-databases`, which copies stored revisions
    /// as a file copy would) get none on `_users` either.
    fn guard_of(&self, name: &DbName) -> Option<Arc<dyn write_guard::WriteGuard>> {
        let own = self.write_guard.clone()?;
        let rules: Arc<dyn write_guard::WriteGuard> = if users::is_users_db(name.as_str()) {
            Arc::new(users::UsersRules)
        } else if let Some(guard) = self.database_guards.get(name.as_str()) {
            Arc::clone(guard)
        } else {
            return Some(own);
        };
        Some(Arc::new(write_guard::ChainedGuards::new(vec![rules, own])))
    }

    /// Makes sure the `_users` database exists (CouchDB's single-node setup creates it too):
    /// created with CouchDB's admin-only `_security` when missing. Another instance creating it
    /// at the same moment is no failure. Nothing happens where the backend keeps no databases.
    pub async fn ensure_users_db(&self) -> Result<()> {
        self.ensure_system_db(users::USERS_DB).await
    }

    /// Makes sure the system database `name` (`_users`, `_replicator`) exists, as
    /// [`Self::ensure_users_db`] says; both are admin only when created, as CouchDB 3.4.3's
    /// `default_security = admin_only` leaves them.
    pub async fn ensure_system_db(&self, db_name: &str) -> Result<()> {
        if self.opened_catalog().await?.is_none() {
            return Ok(());
        }
        let name = DbName::parse(db_name)?;
        if self.open(&name).await?.is_some() {
            return Ok(());
        }
        let database = match self.create(&name).await {
            Ok(database) => database,
            Err(err) if err.kind() == ErrorKind::Conflict => return Ok(()),
            Err(err) => return Err(err),
        };
        if !database.backend().forwards_requests() {
            database.update_settings(|settings| settings.security = users::admin_only_security()).await?;
        }
        tracing::info!(database = db_name, "created a system database");
        Ok(())
    }

    /// The data-store database `name` over the facade's `backend`, opened once at startup with
    /// these databases' bounds; its writes are checked by its rules
    /// ([`data_store_rules::DataStoreRules`], with the data-store `limits`) and then by the
    /// databases' own guard (`validate_doc_update`). Inner revisions' bodies stay as
    /// [`Database::data_store`] sets them (its layout the backend's own trees on a backend
    /// keeping them itself: CouchDB).
    pub fn data_store(
        &self,
        name: &str,
        backend: Arc<dyn crate::backend::DocumentBackend>,
        limits: crate::model::Limits,
    ) -> Result<Arc<Database>> {
        let mut guards: Vec<Arc<dyn write_guard::WriteGuard>> =
            vec![Arc::new(data_store_rules::DataStoreRules::new(limits))];
        guards.extend(self.write_guard.clone());
        Ok(Arc::new(
            data_store_database(name, backend)?
                .with_max_document_bytes(self.max_document_bytes)
                .with_max_tree_bytes(self.max_tree_bytes)
                .with_max_gzip_ratio(self.max_gzip_ratio)
                .with_inline_budget(Arc::clone(&self.inline_budget), self.inline_wait)
                .with_attachment_bounds(self.max_attachment_bytes, self.attachment_grace)
                .with_activity(Arc::clone(&self.activity))
                .with_write_guard(Some(Arc::new(write_guard::ChainedGuards::new(guards)))),
        ))
    }

    /// The backend URL the catalog is opened from (`None`: the backend keeps no databases).
    pub fn source(&self) -> Option<&BackendUrl> {
        self.source.as_ref()
    }

    /// The catalog, opened now if it was not; `None` where the backend keeps no others.
    async fn opened_catalog(&self) -> Result<Option<&Arc<dyn Catalog>>> {
        if let Some(catalog) = self.catalog.get() {
            return Ok(Some(catalog));
        }
        let Some(url) = &self.source else { return Ok(None) };
        Ok(Some(self.catalog.get_or_try_init(|| crate::backend::catalog::open_catalog(url)).await?))
    }

    /// The open-database map, for a moment (never held across an await).
    fn open_map(&self) -> std::sync::MutexGuard<'_, HashMap<DbName, OpenDatabase>> {
        self.open.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The database if it is open, marked as used now, with whether the catalog confirmed it
    /// within the recheck period.
    fn already_open(&self, name: &DbName) -> Option<(Arc<Database>, bool)> {
        let mut open = self.open_map();
        let entry = open.get_mut(name)?;
        entry.last_used = std::time::Instant::now();
        Some((Arc::clone(&entry.database), entry.confirmed.elapsed() < self.recheck))
    }

    /// Keeps one more open database within the bound: while too many are open, the least
    /// recently used ones that no request holds are closed (their catalog handles let go).
    /// Databases in use are never closed, so the bound may be passed while that many are busy.
    async fn keep(&self, name: &DbName, database: &Arc<Database>) {
        let idle: Vec<DbName> = {
            let mut open = self.open_map();
            let now = std::time::Instant::now();
            open.insert(name.clone(), OpenDatabase { database: Arc::clone(database), last_used: now, confirmed: now });
            let mut idle: Vec<(&DbName, std::time::Instant)> = open
                .iter()
                .filter(|(_, entry)| Arc::strong_count(&entry.database) == 1)
                .map(|(name, entry)| (name, entry.last_used))
                .collect();
            idle.sort_by_key(|(_, last_used)| *last_used);
            let excess = open.len().saturating_sub(self.max_open);
            idle.into_iter().take(excess).map(|(name, _)| name.clone()).collect()
        };
        for name in idle {
            self.close_if_idle(&name).await;
        }
    }

    /// Closes `name` if no request holds it, under its name lock, so that no request opens it
    /// again while the catalog lets go of its handle (a redb file is opened once per process).
    /// A name whose lock is busy (a request opening or deleting it) is left alone.
    async fn close_if_idle(&self, name: &DbName) {
        let lock = self.name_locks.of(name);
        let Ok(_held) = lock.try_lock() else { return };
        let closed = {
            let mut open = self.open_map();
            let idle = open.get(name).is_some_and(|entry| Arc::strong_count(&entry.database) == 1);
            idle && open.remove(name).is_some()
        };
        if let (true, Some(catalog)) = (closed, self.catalog.get()) {
            catalog.forget(name).await;
        }
    }

    async fn catalog(&self) -> Result<&Arc<dyn Catalog>> {
        self.opened_catalog().await?.ok_or_else(|| {
            Error::new(ErrorKind::Misconfigured, "this backend keeps no databases besides the data-store database")
        })
    }

    /// Creates a database; `Conflict` when it exists (CouchDB's 412 `file_exists`).
    pub async fn create(&self, name: &DbName) -> Result<Arc<Database>> {
        let lock = self.name_locks.of(name);
        let _held = lock.lock().await;
        let backend = self.catalog().await?.create(name).await?;
        self.activity.event(activity::DbEvent::Created, name.as_str());
        let database = self.database(name, backend);
        self.keep(name, &database).await;
        Ok(database)
    }

    /// The database, or `None` when it does not exist. A database already open is confirmed with
    /// the catalog first, on every request: another instance over the same backend may have
    /// deleted it, or deleted and created it again, since this one opened it
    /// ([`Databases::confirmed`]).
    pub async fn open(&self, name: &DbName) -> Result<Option<Arc<Database>>> {
        if let Some((database, fresh)) = self.already_open(name) {
            if fresh {
                return Ok(Some(database));
            }
            match self.confirmed(name, &database).await? {
                Confirmation::Same => return Ok(Some(database)),
                Confirmation::Gone => return Ok(None),
                // Opened again below, the catalog's new handle in a new `Database`.
                Confirmation::Replaced => {}
            }
        }
        let lock = self.name_locks.of(name);
        let _held = lock.lock().await;
        // Opened by the request that held the lock before this one (just now: it asked the
        // catalog).
        if let Some((database, _)) = self.already_open(name) {
            return Ok(Some(database));
        }
        let Some(catalog) = self.opened_catalog().await? else { return Ok(None) };
        let Some(backend) = catalog.open(name).await? else { return Ok(None) };
        let database = self.database(name, backend);
        self.keep(name, &database).await;
        Ok(Some(database))
    }

    /// The database if this server holds it open, without confirming it with the catalog (no
    /// backend call), marked as used now. Only for a request passed whole to a backend that
    /// forwards requests (the CouchDB backend): that backend names the database in the request
    /// itself, so CouchDB's own answer says whether it exists now (404 for one deleted through
    /// another instance, which the caller then confirms with [`Databases::open`]; the new one's
    /// answer for one created again), and nothing this server
    /// keeps of such a database (its handle holds the server's URL and connection pool) outlives
    /// a deletion elsewhere. A database deleted through this server is no longer held.
    pub fn held_open(&self, name: &DbName) -> Option<Arc<Database>> {
        self.already_open(name).map(|(database, _)| database)
    }

    /// Whether the open `database` is still the one the catalog holds under `name`. The catalog
    /// asks the backend (the creation id on a DynamoDB table's layout marker, a Firestore
    /// database's instance, CouchDB's HEAD; the embedded store's files are one process's, so its
    /// catalog answers from memory) and hands back the handle it keeps while the same incarnation
    /// exists. One kept no more is let go here: requests still holding it fail `NotFound` from
    /// then on, as after a deletion through this instance, and nothing of its state (counts,
    /// settings) outlives it.
    async fn confirmed(&self, name: &DbName, database: &Arc<Database>) -> Result<Confirmation> {
        let Some(catalog) = self.opened_catalog().await? else { return Ok(Confirmation::Gone) };
        let current = catalog.open(name).await?;
        let same = current.as_ref().is_some_and(|backend| same_handle(backend, database.backend()));
        let removed = {
            let mut open = self.open_map();
            let held = open.get_mut(name).filter(|entry| Arc::ptr_eq(&entry.database, database));
            match held {
                Some(entry) if same => {
                    entry.confirmed = std::time::Instant::now();
                    false
                }
                Some(_) => open.remove(name).is_some(),
                None => false,
            }
        };
        if same {
            return Ok(Confirmation::Same);
        }
        if removed {
            database.mark_dropped();
        }
        Ok(if current.is_some() { Confirmation::Replaced } else { Confirmation::Gone })
    }

    /// Deletes a database and everything in it; `false` when there was none. Writes already
    /// under way on it finish first (at most [`engine::DRAIN_WAIT`]); requests still holding it
    /// fail with `NotFound` from then on.
    pub async fn delete(&self, name: &DbName) -> Result<bool> {
        let lock = self.name_locks.of(name);
        let _held = lock.lock().await;
        let removed = self.open_map().remove(name);
        if let Some(entry) = removed {
            entry.database.close(engine::DRAIN_WAIT).await;
        }
        let deleted = match self.opened_catalog().await? {
            Some(catalog) => catalog.delete(name).await?,
            None => false,
        };
        if deleted {
            self.activity.event(activity::DbEvent::Deleted, name.as_str());
        }
        Ok(deleted)
    }

    pub async fn list(&self) -> Result<Vec<DbName>> {
        match self.opened_catalog().await? {
            Some(catalog) => catalog.list().await,
            None => Ok(Vec::new()),
        }
    }
}

/// CouchDB's answer to a request on a database that does not exist.
pub fn no_such_database() -> Error {
    Error::new(ErrorKind::NotFound, "Database does not exist.")
}

/// The data-store database over `backend` in the layout its backend needs: the seed's records,
/// or the backend's own trees where it keeps them ([`Database::native_data_store`]).
fn data_store_database(name: &str, backend: Arc<dyn crate::backend::DocumentBackend>) -> Result<Database> {
    if backend.keeps_branches() {
        Database::native_data_store(name.to_owned(), backend)
    } else {
        Database::data_store(name.to_owned(), backend)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::catalog::EmbeddedCatalog;
    use crate::backend::embedded::EmbeddedOptions;

    fn body(value: serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
        value.as_object().cloned().unwrap_or_default()
    }

    /// Past `couchdb_max_open_databases` the least recently used idle database is closed, a
    /// database in use never is, and a closed one opens again with its documents.
    #[tokio::test]
    async fn open_databases_stay_within_the_bound() {
        let dir = tempfile::tempdir().unwrap();
        let catalog = Arc::new(EmbeddedCatalog::new(&dir.path().join("store.redb"), EmbeddedOptions::default()));
        let databases = Databases::new(Some(catalog), 2);
        let names: Vec<DbName> = ["a", "b", "c"].iter().map(|n| DbName::parse(n).unwrap()).collect();
        let held = databases.create(&names[0]).await.unwrap();
        let write = Write::Edit { parent: None, deleted: false, body: body(serde_json::json!({"v": 1})) };
        held.write("doc", &write).await.unwrap();
        drop(databases.create(&names[1]).await.unwrap());
        drop(databases.create(&names[2]).await.unwrap());
        {
            let open = databases.open_map();
            assert_eq!(open.len(), 2, "one idle database was closed");
            assert!(open.contains_key(&names[0]), "the database in use stays open");
            assert!(!open.contains_key(&names[1]), "the least recently used idle one was closed");
        }
        drop(held);
        let again = databases.open(&names[1]).await.unwrap().expect("a closed database opens again");
        assert!(again.read("doc").await.unwrap().is_none());
        let first = databases.open(&names[0]).await.unwrap().expect("open");
        assert!(first.read("doc").await.unwrap().is_some(), "documents survive closing and opening");
    }

    /// A catalog whose `create` and `open` of one name wait until released, as a DynamoDB
    /// `CreateTable` or `DescribeTable` that takes its time; every other name is the embedded
    /// catalog's at once.
    struct SlowForOneName {
        inner: EmbeddedCatalog,
        slow: DbName,
        entered: tokio::sync::Notify,
        released: tokio::sync::Notify,
    }

    impl SlowForOneName {
        async fn wait_if_slow(&self, name: &DbName) {
            if *name == self.slow {
                self.entered.notify_one();
                self.released.notified().await;
            }
        }
    }

    #[async_trait::async_trait]
    impl Catalog for SlowForOneName {
        fn describe(&self) -> String {
            self.inner.describe()
        }
        async fn create(&self, name: &DbName) -> Result<Arc<dyn crate::backend::DocumentBackend>> {
            self.wait_if_slow(name).await;
            self.inner.create(name).await
        }
        async fn open(&self, name: &DbName) -> Result<Option<Arc<dyn crate::backend::DocumentBackend>>> {
            self.wait_if_slow(name).await;
            self.inner.open(name).await
        }
        async fn delete(&self, name: &DbName) -> Result<bool> {
            self.inner.delete(name).await
        }
        async fn list(&self) -> Result<Vec<DbName>> {
            self.inner.list().await
        }
        async fn forget(&self, name: &DbName) {
            self.inner.forget(name).await
        }
    }

    /// While one database's creation waits on the backend, other databases open, are created and
    /// are found missing: the wait holds up its own name only.
    #[tokio::test]
    async fn a_slow_catalog_call_holds_up_its_own_name_only() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("store.redb");
        let name = |text: &str| DbName::parse(text).unwrap();
        // Created before the server's databases exist, so opening it asks the catalog.
        EmbeddedCatalog::new(&file, EmbeddedOptions::default()).create(&name("existing")).await.unwrap();
        let catalog = Arc::new(SlowForOneName {
            inner: EmbeddedCatalog::new(&file, EmbeddedOptions::default()),
            slow: name("slow"),
            entered: tokio::sync::Notify::new(),
            released: tokio::sync::Notify::new(),
        });
        let databases = Arc::new(Databases::new(Some(catalog.clone()), 8));
        let creating = {
            let databases = Arc::clone(&databases);
            tokio::spawn(async move { databases.create(&DbName::parse("slow").unwrap()).await.map(drop) })
        };
        catalog.entered.notified().await;
        let others = async {
            let existing = databases.open(&name("existing")).await.unwrap();
            assert!(existing.is_some(), "an existing database opens");
            databases.create(&name("fresh")).await.unwrap();
            assert!(databases.open(&name("missing")).await.unwrap().is_none(), "a missing one is missing");
        };
        tokio::time::timeout(std::time::Duration::from_secs(10), others)
            .await
            .expect("other databases answer while one creation waits on the backend");
        catalog.released.notify_one();
        creating.await.unwrap().unwrap();
        // Opening it confirms it with the catalog, whose calls for this name wait: let it pass.
        catalog.released.notify_one();
        assert!(databases.open(&name("slow")).await.unwrap().is_some(), "the slow one was created");
    }

    /// A catalog of one database whose current handle the test replaces or removes, as another
    /// instance deleting or re-creating it would; it counts the times it is asked.
    struct SwitchedByAnotherInstance {
        current: std::sync::Mutex<Option<Arc<dyn crate::backend::DocumentBackend>>>,
        asked: std::sync::atomic::AtomicUsize,
    }

    #[async_trait::async_trait]
    impl Catalog for SwitchedByAnotherInstance {
        fn describe(&self) -> String {
            "switched".into()
        }
        async fn create(&self, _: &DbName) -> Result<Arc<dyn crate::backend::DocumentBackend>> {
            Err(Error::conflict("exists"))
        }
        async fn open(&self, _: &DbName) -> Result<Option<Arc<dyn crate::backend::DocumentBackend>>> {
            self.asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(self.current.lock().unwrap().clone())
        }
        async fn delete(&self, _: &DbName) -> Result<bool> {
            Ok(false)
        }
        async fn list(&self) -> Result<Vec<DbName>> {
            Ok(Vec::new())
        }
    }

    /// An open database is confirmed with the catalog on every request by default: a handle
    /// the catalog replaced (re-created elsewhere) is let go for the new one, and one it no
    /// longer has (deleted elsewhere) is missing and fails requests holding it. With
    /// `couchdb_database_recheck_ms` the catalog is asked once per period.
    #[tokio::test]
    async fn open_databases_follow_the_catalog() {
        let dir = tempfile::tempdir().unwrap();
        let backend = |file: &str| {
            let path = dir.path().join(file);
            async move {
                Arc::new(crate::backend::embedded::EmbeddedBackend::open(&path).await.unwrap())
                    as Arc<dyn crate::backend::DocumentBackend>
            }
        };
        let catalog = Arc::new(SwitchedByAnotherInstance {
            current: std::sync::Mutex::new(Some(backend("first.redb").await)),
            asked: Default::default(),
        });
        let name = DbName::parse("d").unwrap();
        let databases = Databases::new(Some(catalog.clone()), 8);
        let first = databases.open(&name).await.unwrap().expect("open");
        let again = databases.open(&name).await.unwrap().expect("open");
        assert!(Arc::ptr_eq(&first, &again), "the same handle: one database");
        let second = backend("second.redb").await;
        *catalog.current.lock().unwrap() = Some(Arc::clone(&second));
        let replaced = databases.open(&name).await.unwrap().expect("re-created");
        assert!(same_handle(replaced.backend(), &second), "the new incarnation's handle");
        assert_eq!(first.check_open().unwrap_err().kind(), ErrorKind::NotFound, "the old one is let go");
        *catalog.current.lock().unwrap() = None;
        assert!(databases.open(&name).await.unwrap().is_none(), "deleted elsewhere: missing at once");
        assert_eq!(replaced.check_open().unwrap_err().kind(), ErrorKind::NotFound);

        *catalog.current.lock().unwrap() = Some(second);
        let rechecked = Databases::new(Some(catalog.clone()), 8).with_recheck(std::time::Duration::from_secs(60));
        rechecked.open(&name).await.unwrap().expect("open");
        let asked = catalog.asked.load(std::sync::atomic::Ordering::SeqCst);
        *catalog.current.lock().unwrap() = None;
        assert!(rechecked.open(&name).await.unwrap().is_some(), "served within the recheck period");
        assert_eq!(catalog.asked.load(std::sync::atomic::Ordering::SeqCst), asked, "without asking the catalog");
    }

    /// A backend whose table is removed while a request is on it (a DynamoDB `DeleteTable`
    /// under a writer): its calls fail once the gate opens, as the adapter's would.
    struct RemovedUnderRequest {
        inner: Arc<dyn crate::backend::DocumentBackend>,
        reading: tokio::sync::Notify,
        removed: tokio::sync::Notify,
    }

    #[async_trait::async_trait]
    impl crate::backend::raw::layer::Layered for RemovedUnderRequest {
        fn inner(&self) -> &dyn crate::backend::DocumentBackend {
            self.inner.as_ref()
        }

        async fn get(&self, _: &str) -> Result<Option<crate::backend::StoredDocument>> {
            self.read_under_removal().await
        }

        /// A creation's first read (the local tree a cut save would have left).
        async fn get_local(&self, _: &str) -> Result<Option<crate::backend::StoredDocument>> {
            self.read_under_removal().await
        }
    }

    impl RemovedUnderRequest {
        /// Says the request is reading, waits for the database's removal and fails as the
        /// backend would without its table.
        async fn read_under_removal(&self) -> Result<Option<crate::backend::StoredDocument>> {
            self.reading.notify_one();
            self.removed.notified().await;
            Err(Error::new(ErrorKind::Misconfigured, "DynamoDB could not read (ResourceNotFoundException)"))
        }
    }

    /// A request that was on a database when it was deleted ends with CouchDB's `not_found`,
    /// never with the backend's error about its missing table (a 500).
    #[tokio::test]
    async fn a_request_under_a_deletion_is_not_found() {
        let dir = tempfile::tempdir().unwrap();
        let inner: Arc<dyn crate::backend::DocumentBackend> =
            Arc::new(crate::backend::embedded::EmbeddedBackend::open(&dir.path().join("d.redb")).await.unwrap());
        let layer = Arc::new(RemovedUnderRequest {
            inner,
            reading: tokio::sync::Notify::new(),
            removed: tokio::sync::Notify::new(),
        });
        let database = Arc::new(Database::new("d".into(), layer.clone()));
        let write = Write::Edit { parent: None, deleted: false, body: body(serde_json::json!({"v": 1})) };
        let writer = {
            let database = Arc::clone(&database);
            tokio::spawn(async move { database.write("doc", &write).await })
        };
        layer.reading.notified().await;
        database.mark_dropped();
        layer.removed.notify_one();
        let err = writer.await.unwrap().expect_err("the write fails");
        assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
        assert_eq!(err.message(), "Database does not exist.");
    }

    /// A backend whose next `put` of a document fails, as a process killed between the two
    /// writes of a save would leave it.
    struct CrashBeforeRecord {
        inner: Arc<dyn crate::backend::DocumentBackend>,
        armed: std::sync::atomic::AtomicBool,
    }

    #[async_trait::async_trait]
    impl crate::backend::raw::layer::Layered for CrashBeforeRecord {
        fn inner(&self) -> &dyn crate::backend::DocumentBackend {
            self.inner.as_ref()
        }

        /// Not checked, so that a save from nothing writes its local tree before its record (as
        /// on a backend that cannot check it, and as every save from nothing did before issue
        /// 38, which files written then may still hold cut short).
        fn checks_never_written(&self) -> bool {
            false
        }

        async fn put(
            &self,
            id: &str,
            body: &serde_json::Map<String, serde_json::Value>,
            precondition: crate::backend::Precondition,
        ) -> Result<crate::backend::Revision> {
            if self.armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
                return Err(Error::new(ErrorKind::Unavailable, "killed"));
            }
            self.inner.put(id, body, precondition).await
        }
    }

    /// A save cut short after the tree was written but before the record is finished by the next
    /// replicated write of the same leaf (which changes nothing in the tree), so the document
    /// reaches the change feed; a replicator resuming after a crash relies on it.
    #[tokio::test]
    async fn a_save_cut_short_is_finished_by_a_replicated_write_of_a_known_leaf() {
        use crate::database::rev_tree::RevPath;
        let dir = tempfile::tempdir().unwrap();
        let inner: Arc<dyn crate::backend::DocumentBackend> =
            Arc::new(crate::backend::embedded::EmbeddedBackend::open(&dir.path().join("d.redb")).await.unwrap());
        let layer = Arc::new(CrashBeforeRecord { inner, armed: std::sync::atomic::AtomicBool::new(true) });
        let database = Database::new("d".into(), layer.clone());
        let write = Write::Replicated {
            path: RevPath { start: 1, ids: vec!["abc".into()] },
            deleted: false,
            body: body(serde_json::json!({"v": 1})),
        };
        assert!(database.write("doc", &write).await.is_err(), "the first save is cut short");
        let state = database.read("doc").await.unwrap();
        assert!(database.half_written("doc", state.as_ref()).await.unwrap());
        assert!(database.backend().changes(None, 10).await.unwrap().changes.is_empty(), "not in the feed yet");
        database.write("doc", &write).await.unwrap();
        let state = database.read("doc").await.unwrap();
        assert!(!database.half_written("doc", state.as_ref()).await.unwrap());
        let feed = database.backend().changes(None, 10).await.unwrap().changes;
        assert_eq!(feed.iter().map(|c| c.id.as_str()).collect::<Vec<_>>(), ["doc"], "in the feed once finished");
    }
}
