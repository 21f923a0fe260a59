//! A CouchDB database on any backend: every database besides the data-store database keeps
//! CouchDB's document rules and every leaf of each document's revision tree, stored inside the
//! documents of an ordinary [`crate::backend::DocumentBackend`] opened on the database's own
//! namespace ([`crate::backend::catalog`]).
//!
//! - [`rev_tree`]: the revision tree and CouchDB's rules on it (pure).
//! - [`engine`]: one database: how a tree is stored in the backend and changed atomically.
//! - [`document`]: CouchDB's rules for a client's document (ids, special fields, size).
//! - [`Databases`] (here): the open databases of the server, over the backend's catalog.

pub mod document;
pub mod engine;
pub mod rev_tree;
pub mod seq;

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::Mutex;

pub use engine::{Database, DocState, Write, Written};

use crate::backend::catalog::{Catalog, DbName};
use crate::error::{Error, ErrorKind, Result};

/// The server's databases besides the data-store one, opened once each and shared by requests.
pub struct Databases {
    /// `None` where the backend keeps no databases besides the data-store one.
    catalog: Option<Arc<dyn Catalog>>,
    open: Mutex<HashMap<DbName, Arc<Database>>>,
}

impl Databases {
    pub fn new(catalog: Option<Arc<dyn Catalog>>) -> Self {
        Databases { catalog, open: Mutex::new(HashMap::new()) }
    }

    pub fn describe(&self) -> String {
        self.catalog.as_ref().map_or_else(|| "no other databases".to_owned(), |c| c.describe())
    }

    fn catalog(&self) -> Result<&Arc<dyn Catalog>> {
        self.catalog.as_ref().ok_or_else(|| {
            Error::new(
                ErrorKind::Misconfigured,
                "this backend keeps no databases besides the data-store database (yet): see docs/databases.md",
            )
        })
    }

    /// Creates a database; `Conflict` when it exists (CouchDB's 412 `file_exists`).
    pub async fn create(&self, name: &DbName) -> Result<Arc<Database>> {
        let mut open = self.open.lock().await;
        let backend = self.catalog()?.create(name).await?;
        let database = Arc::new(Database::new(name.to_string(), backend));
        open.insert(name.clone(), Arc::clone(&database));
        Ok(database)
    }

    /// The database, or `None` when it does not exist.
    pub async fn open(&self, name: &DbName) -> Result<Option<Arc<Database>>> {
        let mut open = self.open.lock().await;
        if let Some(database) = open.get(name) {
            return Ok(Some(Arc::clone(database)));
        }
        let Some(catalog) = &self.catalog else { return Ok(None) };
        let Some(backend) = catalog.open(name).await? else { return Ok(None) };
        let database = Arc::new(Database::new(name.to_string(), backend));
        open.insert(name.clone(), Arc::clone(&database));
        Ok(Some(database))
    }

    /// Deletes a database and everything in it; `false` when there was none. Requests still
    /// holding it fail with `NotFound` from now on.
    pub async fn delete(&self, name: &DbName) -> Result<bool> {
        let mut open = self.open.lock().await;
        if let Some(database) = open.remove(name) {
            database.mark_dropped();
        }
        match &self.catalog {
            Some(catalog) => catalog.delete(name).await,
            None => Ok(false),
        }
    }

    pub async fn list(&self) -> Result<Vec<DbName>> {
        match &self.catalog {
            Some(catalog) => catalog.list().await,
            None => Ok(Vec::new()),
        }
    }
}

/// CouchDB's answer to a request on a database that does not exist.
pub fn no_such_database() -> Error {
    Error::new(ErrorKind::NotFound, "Database does not exist.")
}
