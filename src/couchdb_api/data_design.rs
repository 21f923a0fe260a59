//! What the data-store router (the CouchDB backend's data-store database, served by
//! `document.rs`, `all_docs.rs`, `local_docs.rs` until a tree layout over that backend's native
//! branches makes it an engine database) still needs to know of the data-store database's design
//! documents and own local documents.
//!
//! On the embedded store, DynamoDB and Firestore the data-store database's design documents,
//! views, `_view_cleanup`, `_design_docs` and Mango are the engine's, served by
//! `super::db` as on every database (docs/views.md, "The data-store database"): its design
//! documents are records of its [`crate::database::Database`], its views read that database's
//! feed and its view incarnation at every use (so the facade's `purge_user`, in any process,
//! reaches them), and `validate_doc_update` runs after the data-store rules through its write
//! guard. The previous release kept each design document as a local document
//! `:design:{name}`; [`crate::store::move_data_store_design_documents`] moved them into records.

use crate::backend::{DocumentBackend, IdRange, StoredDocument};

/// Design documents read per page when all of them are listed.
const LIST_PAGE: usize = 100;

/// Whether a local document name is kept by this database for itself (conflicts, design
/// documents, the views' incarnation): never a client's.
pub fn is_reserved_local(name: &str) -> bool {
    crate::database::layout::reserved_local_name(name)
}

/// The live design documents, in id order, as `_all_docs` lists them: id, the winner's revision
/// and the document (their records). Over the CouchDB backend the data-store router's listing
/// does not call it (that backend lists its own).
pub(crate) async fn live_design_docs(backend: &dyn DocumentBackend) -> crate::Result<Vec<StoredDocument>> {
    let range = IdRange::design_documents();
    let mut found = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let page = backend.all_docs(&range, LIST_PAGE, token.as_deref()).await?;
        found.extend(page.items.into_iter().filter(|doc| doc.id.starts_with("_design/")));
        match page.next {
            Some(next) => token = Some(next),
            None => return Ok(found),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_databases_own_local_names_are_reserved() {
        for reserved in [":leaves:a:b:c", ":design:data_store", ":views:incarnation"] {
            assert!(is_reserved_local(reserved), "{reserved}");
        }
        for client in ["checkpoint", "user_123:checkpoint", "design:x", "_design/x"] {
            assert!(!is_reserved_local(client), "{client}");
        }
    }
}
