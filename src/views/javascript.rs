//! The JavaScript engine ([`crate::js`]) as the views' [`Mapper`] and [`JsReducer`], and its
//! errors in CouchDB's terms.

use std::sync::Arc;

use async_trait::async_trait;
use serde_json::Value;

use super::design::DesignViews;
use super::run::JsReducer;
use super::updater::Mapper;
use super::ViewError;
use crate::js::{DesignCode, DocText, JsEngine, JsError, ViewRows};

/// Views' functions run in a [`JsEngine`].
pub struct JavaScriptViews {
    engine: JsEngine,
}

impl JavaScriptViews {
    pub fn new(engine: JsEngine) -> Self {
        JavaScriptViews { engine }
    }
}

/// The design document as the engine runs it, in its database's realm; refused when its
/// database is not known, since a realm shared between databases would share their globals.
fn code(design: &DesignViews) -> Result<DesignCode, ViewError> {
    let Some(database) = &design.database else {
        return Err(view_error(JsError::Internal(format!(
            "{}: the design document's database is not known",
            design.id
        ))));
    };
    Ok(DesignCode::new(database.clone(), design.id.clone(), design.rev.clone(), Arc::clone(&design.doc)))
}

/// A failed call as CouchDB reports it: compilation errors as `compilation_error`, the time,
/// memory and stack bounds as `os_process_error` (CouchDB's name when it kills a query
/// process), naming the setting that bounds them.
pub fn view_error(err: JsError) -> ViewError {
    let function = |error: &str, reason: String| ViewError::Function { error: error.to_owned(), reason };
    match err {
        JsError::Timeout { .. } => function("os_process_error", format!("{err} (couchdb_js_timeout_ms)")),
        JsError::OutOfMemory { .. } => function("os_process_error", format!("{err} (couchdb_js_memory_bytes)")),
        JsError::StackOverflow => function("os_process_error", err.to_string()),
        JsError::Compile { .. } => function("compilation_error", err.to_string()),
        JsError::Missing { function: name } => ViewError::NotFound(format!("missing function {name}")),
        JsError::Thrown { error, message } => function(&error, message),
        JsError::Busy => ViewError::Busy,
        JsError::Internal(message) => {
            ViewError::Storage(crate::error::Error::new(crate::error::ErrorKind::Internal, message))
        }
    }
}

#[async_trait]
impl Mapper for JavaScriptViews {
    async fn map(
        &self,
        design: &DesignViews,
        docs: Vec<Arc<DocText>>,
    ) -> Result<Vec<Vec<Vec<(Value, Value)>>>, ViewError> {
        let outcomes = self.engine.map_texts(&code(design)?, &design.view_names(), docs).await.map_err(view_error)?;
        Ok(outcomes
            .into_iter()
            .map(|outcome| {
                outcome
                    .views
                    .into_iter()
                    .map(|rows| match rows {
                        ViewRows::Emitted(rows) => rows,
                        ViewRows::Threw(_) => Vec::new(),
                    })
                    .collect()
            })
            .collect())
    }

    /// One call per worker thread: each runs on a runtime of its own.
    fn parallel_calls(&self, _design: &DesignViews) -> usize {
        self.engine.limits().workers
    }
}

#[async_trait]
impl JsReducer for JavaScriptViews {
    async fn reduce(&self, design: &DesignViews, view: &str, rows: Vec<(Value, Value)>) -> Result<Value, ViewError> {
        self.engine.reduce(&code(design)?, view, rows).await.map_err(view_error)
    }

    async fn rereduce(&self, design: &DesignViews, view: &str, values: Vec<Value>) -> Result<Value, ViewError> {
        self.engine.rereduce(&code(design)?, view, values).await.map_err(view_error)
    }
}
