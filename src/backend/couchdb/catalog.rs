//! The CouchDB catalog: a database is the database of the same name on the backend's server, its
//! data native CouchDB (docs/databases.md says why). Its backend forwards every request
//! ([`crate::backend::DocumentBackend::forwards_requests`]).
//!
//! The data-store database is not a database of the catalog (it is the configured backend
//! itself), and neither are CouchDB's system databases (`_users`, `_replicator`,
//! `_global_changes`: names no [`DbName`] has).

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use reqwest::{Method, StatusCode};
use serde_json::Value;
use tokio::sync::Mutex;

use super::backend::CouchDbBackend;
use super::config::CouchConfig;
use super::core::CouchClient;
use super::error::from_status;
use crate::backend::catalog::{Catalog, DbName};
use crate::backend::DocumentBackend;
use crate::error::{Error, Result};

pub struct CouchCatalog {
    /// The data-store database's configuration; a database's is this one with its own name.
    base: CouchConfig,
    /// A client of the server (made for the data-store database; only its server-level URLs are
    /// used here), one connection pool for creating, looking for, dropping and listing.
    server: CouchClient,
    /// Backends opened so far (each keeps a connection pool), reused while the database exists.
    open: Mutex<HashMap<DbName, Arc<CouchDbBackend>>>,
}

impl CouchCatalog {
    pub fn new(base: &CouchConfig) -> Result<Self> {
        Ok(CouchCatalog { base: base.clone(), server: CouchClient::new(base)?, open: Mutex::new(HashMap::new()) })
    }

    fn config_of(&self, name: &DbName) -> CouchConfig {
        CouchConfig { database: name.as_str().to_owned(), create: false, ..self.base.clone() }
    }

    fn is_data_store(&self, name: &DbName) -> bool {
        name.as_str() == self.base.database
    }

    /// The cached backend of `name`, or a new one.
    async fn backend_of(&self, name: &DbName) -> Result<Arc<CouchDbBackend>> {
        let mut open = self.open.lock().await;
        if let Some(backend) = open.get(name) {
            return Ok(Arc::clone(backend));
        }
        let backend = Arc::new(CouchDbBackend::unchecked(&self.config_of(name))?);
        open.insert(name.clone(), Arc::clone(&backend));
        Ok(backend)
    }
}

#[async_trait]
impl Catalog for CouchCatalog {
    fn describe(&self) -> String {
        format!("CouchDB databases on {}", self.base.server)
    }

    async fn create(&self, name: &DbName) -> Result<Arc<dyn DocumentBackend>> {
        let exists = || Error::conflict("The database could not be created, the file already exists.");
        if self.is_data_store(name) {
            return Err(exists());
        }
        let url = self.server.server_url(&[name.as_str()]);
        let reply = self.server.send(Method::PUT, &url, &[], None, &format!("create database {name}")).await?;
        match reply.status {
            StatusCode::CREATED | StatusCode::ACCEPTED => Ok(self.backend_of(name).await?),
            StatusCode::PRECONDITION_FAILED => Err(exists()),
            status => Err(from_status(status, &reply.body, &format!("create database {name}"))),
        }
    }

    async fn open(&self, name: &DbName) -> Result<Option<Arc<dyn DocumentBackend>>> {
        if self.is_data_store(name) {
            return Ok(None);
        }
        // Asked every time: the database may have been dropped or created on the server directly.
        let url = self.server.server_url(&[name.as_str()]);
        let reply = self.server.read(Method::HEAD, &url, &[], None, &format!("look for database {name}")).await?;
        match reply.status {
            StatusCode::OK => Ok(Some(self.backend_of(name).await?)),
            StatusCode::NOT_FOUND => {
                self.open.lock().await.remove(name);
                Ok(None)
            }
            status => Err(from_status(status, &reply.body, &format!("look for database {name}"))),
        }
    }

    async fn delete(&self, name: &DbName) -> Result<bool> {
        if self.is_data_store(name) {
            return Ok(false);
        }
        self.open.lock().await.remove(name);
        let url = self.server.server_url(&[name.as_str()]);
        // pouchdb-server answers a DELETE of a missing database with success (Apache CouchDB
        // with 404): a HEAD first tells "did not exist" on both.
        let look = self.server.read(Method::HEAD, &url, &[], None, &format!("look for database {name}")).await?;
        if look.status == StatusCode::NOT_FOUND {
            return Ok(false);
        }
        let reply = self.server.send(Method::DELETE, &url, &[], None, &format!("delete database {name}")).await?;
        match reply.status {
            StatusCode::OK | StatusCode::ACCEPTED => Ok(true),
            StatusCode::NOT_FOUND => Ok(false),
            status => Err(from_status(status, &reply.body, &format!("delete database {name}"))),
        }
    }

    async fn list(&self) -> Result<Vec<DbName>> {
        // One request: `_all_dbs` answers every name at once (CouchDB can page it, pouchdb-server
        // cannot).
        let url = self.server.server_url(&["_all_dbs"]);
        let reply = self.server.read(Method::GET, &url, &[], None, "list the databases").await?;
        if !reply.status.is_success() {
            return Err(from_status(reply.status, &reply.body, "list the databases"));
        }
        let mut names: Vec<DbName> = reply
            .body
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .filter(|name| *name != self.base.database)
            .filter_map(|name| DbName::parse(name).ok())
            .collect();
        names.sort();
        Ok(names)
    }
}
