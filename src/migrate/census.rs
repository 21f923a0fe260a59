//! Counting what a backend's full scan never returns, so a migration's report can say what stayed
//! behind: CouchDB's scan skips design documents (the earlier schema revision's
//! `_design/data_store`, Mango index definitions). The adapter counts them
//! ([`crate::backend::DocumentBackend::design_document_count`]); other backends keep none.

use super::Endpoint;
use crate::error::{Error, Result};

/// How many design documents the source holds, when it is a backend that has them.
pub async fn design_documents(source: &Endpoint) -> Result<Option<u64>> {
    match source {
        Endpoint::Backend { backend, name } => backend
            .design_document_count()
            .await
            .map_err(|e| Error::new(e.kind(), format!("count design documents in source {name}")).with_source(e)),
        Endpoint::File(_) => Ok(None),
    }
}
