//! A CouchDB database on any backend: every database besides the data-store database keeps
//! CouchDB's document rules and every leaf of each document's revision tree, stored inside the
//! documents of an ordinary [`crate::backend::DocumentBackend`] opened on the database's own
//! namespace ([`crate::backend::catalog`]).
//!
//! - [`rev_tree`]: the revision tree and CouchDB's rules on it (pure).
//! - [`engine`]: one database: how a tree is stored in the backend and changed atomically.
//! - [`rev_id`]: new revision ids, computed from the edit as CouchDB computes them.
//! - [`document`]: CouchDB's rules for a client's document (ids, special fields, size).
//! - [`attachments`]: attachment bytes, chunked into the backend and addressed by SHA-256.
//! - [`doc_attachments`]: `_attachments` in documents: stubs, inline data, carried stubs.
//! - [`Databases`] (here): the open databases of the server, over the backend's catalog.

pub mod attachments;
pub mod doc_attachments;
pub mod document;
pub mod engine;
pub mod rev_id;
pub use crate::backend::rev_tree;
pub mod seq;
pub mod write_guard;

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::Mutex;

pub use engine::{Database, DocState, Write, Written};

use crate::backend::catalog::{Catalog, DbName};
use crate::backend::BackendUrl;
use crate::error::{Error, ErrorKind, Result};

/// The server's databases besides the data-store one, opened once each and shared by requests.
pub struct Databases {
    /// Where the catalog comes from: opened on first use (`None`: the backend keeps no databases
    /// besides the data-store one).
    source: Option<BackendUrl>,
    catalog: tokio::sync::OnceCell<Arc<dyn Catalog>>,
    /// Open databases and when each was last asked for.
    open: Mutex<HashMap<DbName, OpenDatabase>>,
    /// How many stay open at once (`couchdb_max_open_databases`).
    max_open: usize,
    /// Largest document body (`couchdb_max_document_bytes`), given to each database opened.
    max_document_bytes: usize,
    /// Largest revision tree of one document (`couchdb_max_tree_bytes`), given to each database
    /// opened.
    max_tree_bytes: usize,
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
    /// What checks writes against the databases' validation functions, if anything.
    write_guard: Option<Arc<dyn write_guard::WriteGuard>>,
}

struct OpenDatabase {
    database: Arc<Database>,
    last_used: std::time::Instant,
}

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
            open: Mutex::new(HashMap::new()),
            max_open: max_open.max(1),
            max_document_bytes: engine::DEFAULT_MAX_DOCUMENT_BYTES,
            max_tree_bytes: engine::DEFAULT_MAX_TREE_BYTES,
            max_attachment_bytes: u64::MAX,
            attachment_grace: attachments::DEFAULT_GRACE,
            max_gzip_ratio: engine::DEFAULT_MAX_GZIP_RATIO,
            inline_budget: Arc::new(crate::server::budget::ByteBudget::new(engine::DEFAULT_MAX_INFLIGHT_INLINE_BYTES)),
            write_guard: None,
        }
    }

    /// The databases kept beside the backend `url` names (its catalog opened on first use, so a
    /// server whose clients never use another database never connects for them).
    pub fn from_url(url: Option<BackendUrl>, max_open: usize) -> Self {
        Databases {
            source: url,
            catalog: tokio::sync::OnceCell::new(),
            open: Mutex::new(HashMap::new()),
            max_open: max_open.max(1),
            max_document_bytes: engine::DEFAULT_MAX_DOCUMENT_BYTES,
            max_tree_bytes: engine::DEFAULT_MAX_TREE_BYTES,
            max_attachment_bytes: u64::MAX,
            attachment_grace: attachments::DEFAULT_GRACE,
            max_gzip_ratio: engine::DEFAULT_MAX_GZIP_RATIO,
            inline_budget: Arc::new(crate::server::budget::ByteBudget::new(engine::DEFAULT_MAX_INFLIGHT_INLINE_BYTES)),
            write_guard: None,
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
    /// (`couchdb_max_inflight_inline_bytes`).
    pub fn with_inline_budget(self, bytes: usize) -> Self {
        Databases { inline_budget: Arc::new(crate::server::budget::ByteBudget::new(bytes.max(1))), ..self }
    }

    /// Every database checks its writes with `guard` (CouchDB's `validate_doc_update`).
    pub fn with_write_guard(self, guard: Arc<dyn write_guard::WriteGuard>) -> Self {
        Databases { write_guard: Some(guard), ..self }
    }

    /// A database of these settings over its namespace's backend.
    fn database(&self, name: &DbName, backend: Arc<dyn crate::backend::DocumentBackend>) -> Arc<Database> {
        Arc::new(
            Database::new(name.to_string(), backend)
                .with_max_document_bytes(self.max_document_bytes)
                .with_max_tree_bytes(self.max_tree_bytes)
                .with_max_gzip_ratio(self.max_gzip_ratio)
                .with_inline_budget(Arc::clone(&self.inline_budget))
                .with_attachment_bounds(self.max_attachment_bytes, self.attachment_grace)
                .with_write_guard(self.write_guard.clone()),
        )
    }

    /// The catalog, opened now if it was not; `None` where the backend keeps no others.
    async fn opened_catalog(&self) -> Result<Option<&Arc<dyn Catalog>>> {
        if let Some(catalog) = self.catalog.get() {
            return Ok(Some(catalog));
        }
        let Some(url) = &self.source else { return Ok(None) };
        Ok(Some(self.catalog.get_or_try_init(|| crate::backend::catalog::open_catalog(url)).await?))
    }

    /// Keeps one more open database within the bound: while too many are open, the least
    /// recently used one that no request holds is closed (its catalog handle let go). Databases
    /// in use are never closed, so the bound may be passed while that many are busy.
    async fn keep(&self, open: &mut HashMap<DbName, OpenDatabase>, name: &DbName, database: &Arc<Database>) {
        open.insert(
            name.clone(),
            OpenDatabase { database: Arc::clone(database), last_used: std::time::Instant::now() },
        );
        while open.len() > self.max_open {
            let idle = open
                .iter()
                .filter(|(_, entry)| Arc::strong_count(&entry.database) == 1)
                .min_by_key(|(_, entry)| entry.last_used)
                .map(|(name, _)| name.clone());
            let Some(idle) = idle else { break };
            open.remove(&idle);
            if let Some(catalog) = self.catalog.get() {
                catalog.forget(&idle).await;
            }
        }
    }

    async fn catalog(&self) -> Result<&Arc<dyn Catalog>> {
        self.opened_catalog().await?.ok_or_else(|| {
            Error::new(ErrorKind::Misconfigured, "this backend keeps no databases besides the data-store database")
        })
    }

    /// Creates a database; `Conflict` when it exists (CouchDB's 412 `file_exists`).
    pub async fn create(&self, name: &DbName) -> Result<Arc<Database>> {
        let mut open = self.open.lock().await;
        let backend = self.catalog().await?.create(name).await?;
        let database = self.database(name, backend);
        self.keep(&mut open, name, &database).await;
        Ok(database)
    }

    /// The database, or `None` when it does not exist.
    pub async fn open(&self, name: &DbName) -> Result<Option<Arc<Database>>> {
        let mut open = self.open.lock().await;
        if let Some(entry) = open.get_mut(name) {
            entry.last_used = std::time::Instant::now();
            return Ok(Some(Arc::clone(&entry.database)));
        }
        let Some(catalog) = self.opened_catalog().await? else { return Ok(None) };
        let Some(backend) = catalog.open(name).await? else { return Ok(None) };
        let database = self.database(name, backend);
        self.keep(&mut open, name, &database).await;
        Ok(Some(database))
    }

    /// Deletes a database and everything in it; `false` when there was none. Requests still
    /// holding it fail with `NotFound` from now on.
    pub async fn delete(&self, name: &DbName) -> Result<bool> {
        let mut open = self.open.lock().await;
        if let Some(entry) = open.remove(name) {
            entry.database.mark_dropped();
        }
        match self.opened_catalog().await? {
            Some(catalog) => catalog.delete(name).await,
            None => Ok(false),
        }
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
            let open = databases.open.lock().await;
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
