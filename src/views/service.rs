//! The views of one `serve` process: its index file and the engine that runs design documents'
//! functions.
//!
//! `serve` claims its index file at startup ([`super::index_file`]: a slot no other process
//! holds) and hands it here ([`Views::claimed`]); [`Views::new`] opens a named file on first use
//! instead (tests, and the CouchDB backend, whose views CouchDB keeps).

use std::path::PathBuf;
use std::sync::Arc;

use super::index_store::IndexStore;
use super::run::JsReducer;
use super::updater::{BuildBounds, Mapper, ViewIndexer};
use super::ViewError;
use crate::error::{Error, ErrorKind};

/// What runs a design document's functions: map functions and JavaScript reduces.
pub trait ViewEngine: Mapper + JsReducer {}

impl<T: Mapper + JsReducer> ViewEngine for T {}

/// This process's views.
pub struct Views {
    path: PathBuf,
    /// The index file claimed at startup, if it was; else it is opened on first use.
    claimed: Option<Arc<IndexStore>>,
    engine: Arc<dyn ViewEngine>,
    bounds: BuildBounds,
    indexer: tokio::sync::OnceCell<Arc<ViewIndexer>>,
}

impl Views {
    /// Views kept in the index file at `path`, their functions run by `engine`.
    pub fn new(path: PathBuf, engine: Arc<dyn ViewEngine>) -> Self {
        Views { path, claimed: None, engine, bounds: BuildBounds::default(), indexer: tokio::sync::OnceCell::new() }
    }

    /// Views kept in the index file `index` this process claimed ([`super::index_file::claim`]).
    pub fn claimed(index: super::index_file::ClaimedIndex, engine: Arc<dyn ViewEngine>) -> Self {
        Views { claimed: Some(Arc::new(index.store)), ..Views::new(index.path, engine) }
    }

    /// These views built within `bounds` (the settings `couchdb_view_*`).
    pub fn with_bounds(self, bounds: BuildBounds) -> Self {
        Views { bounds, ..self }
    }

    /// Where the index file is.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// The indexer, its file opened on the first call.
    pub async fn indexer(&self) -> Result<&Arc<ViewIndexer>, ViewError> {
        self.indexer
            .get_or_try_init(|| async {
                let store = match &self.claimed {
                    Some(store) => Arc::clone(store),
                    None => Arc::new(self.open_named_file().await?),
                };
                let mapper: Arc<dyn Mapper> = Arc::new(EngineMapper(Arc::clone(&self.engine)));
                Ok(Arc::new(ViewIndexer::new(store, mapper).with_bounds(self.bounds)))
            })
            .await
    }

    /// Opens the file this was built with ([`Views::new`]).
    async fn open_named_file(&self) -> Result<IndexStore, ViewError> {
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || IndexStore::open(&path))
            .await
            .map_err(|err| ViewError::Storage(Error::new(ErrorKind::Internal, format!("open view index: {err}"))))?
            .map_err(|err| {
                ViewError::Storage(Error::new(
                    err.kind(),
                    format!("{err} (each serving process needs an index file of its own: couchdb_view_index_dir)"),
                ))
            })
    }

    /// Forgets the deleted database `database` ([`ViewIndexer::forget_database`]); nothing to do
    /// while no view has been asked for (the index file is not open).
    pub async fn forget_database(&self, database: &str) -> Result<usize, ViewError> {
        match self.indexer.get() {
            Some(indexer) => indexer.forget_database(database).await,
            None => Ok(0),
        }
    }

    /// The engine's reduce side.
    pub fn reducer(&self) -> &dyn JsReducer {
        self.engine.as_ref()
    }
}

/// The engine seen as a [`Mapper`] only.
struct EngineMapper(Arc<dyn ViewEngine>);

#[async_trait::async_trait]
impl Mapper for EngineMapper {
    async fn map(
        &self,
        design: &super::design::DesignViews,
        docs: Vec<Arc<crate::js::DocText>>,
    ) -> Result<Vec<Vec<Vec<(serde_json::Value, serde_json::Value)>>>, ViewError> {
        self.0.map(design, docs).await
    }

    fn parallel_calls(&self, design: &super::design::DesignViews) -> usize {
        self.0.parallel_calls(design)
    }
}
