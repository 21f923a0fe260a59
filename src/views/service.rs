//! The views of one `serve` process: its index file, opened on first use, and the engine that
//! runs design documents' functions.
//!
//! The file is opened lazily so a process that never answers a view never takes it: redb locks
//! its file, so two processes on one machine must be given two index files
//! (`couchdb_view_index_dir`), and only a process that uses views needs one.

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
    engine: Arc<dyn ViewEngine>,
    bounds: BuildBounds,
    indexer: tokio::sync::OnceCell<Arc<ViewIndexer>>,
}

impl Views {
    /// Views kept in the index file at `path`, their functions run by `engine`.
    pub fn new(path: PathBuf, engine: Arc<dyn ViewEngine>) -> Self {
        Views { path, engine, bounds: BuildBounds::default(), indexer: tokio::sync::OnceCell::new() }
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
                let path = self.path.clone();
                let store = tokio::task::spawn_blocking(move || IndexStore::open(&path))
                    .await
                    .map_err(|err| {
                        ViewError::Storage(Error::new(ErrorKind::Internal, format!("open view index: {err}")))
                    })?
                    .map_err(|err| {
                        ViewError::Storage(Error::new(
                            err.kind(),
                            format!(
                                "{err} (each serving process needs an index file of its own: couchdb_view_index_dir)"
                            ),
                        ))
                    })?;
                let mapper: Arc<dyn Mapper> = Arc::new(EngineMapper(Arc::clone(&self.engine)));
                Ok(Arc::new(ViewIndexer::new(Arc::new(store), mapper).with_bounds(self.bounds)))
            })
            .await
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
        docs: Vec<Arc<serde_json::Value>>,
    ) -> Result<Vec<Vec<Vec<(serde_json::Value, serde_json::Value)>>>, ViewError> {
        self.0.map(design, docs).await
    }
}
