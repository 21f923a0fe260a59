//! What a database's readers parsed from its design documents (a view request's `DesignViews`),
//! kept with the database until the document's record changes: a view query read the design
//! document, built it as JSON and parsed it again at every request (11% of a `key` query's
//! instructions, issue 38).
//!
//! A value is kept under the design document's id with the backend revision of the record it
//! was parsed from (the compare-and-swap token every write of the record changes, whoever
//! writes it: this process or another over a shared backend), and is handed out only to a read
//! of the same record revision. So a write of the document, its deletion, a purge or a
//! replicated branch that changes its winner all make the next read parse again; nothing is
//! kept for a document without a live record of the engine's layout (a deleted one, or one on
//! the data-store layouts, whose states carry no record revision), and the values go with the
//! database (a database deleted and created again starts with none).

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use super::DocState;
use crate::backend::Revision;

/// Design documents whose parsed values one database keeps; past it the kept values are dropped
/// and parsed again as they are read (a database rarely has more design documents than this).
pub const MAX_PARSED_DESIGNS: usize = 64;

/// One value per design document id, of whatever type its reader parses ([`Self::get`]).
#[derive(Default)]
pub struct ParsedDesigns {
    kept: Mutex<HashMap<String, Kept>>,
}

/// A value and the record revision it was parsed from.
type Kept = (Revision, Arc<dyn Any + Send + Sync>);

impl ParsedDesigns {
    /// The value kept for `id` parsed from the record `state` was read from, if any (and of
    /// type `T`).
    pub fn get<T: Any + Send + Sync>(&self, id: &str, state: &DocState) -> Option<Arc<T>> {
        let record_rev = record_rev(state)?;
        let kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        let (rev, value) = kept.get(id)?;
        if rev != record_rev {
            return None;
        }
        Arc::clone(value).downcast::<T>().ok()
    }

    /// Keeps `value`, parsed from the record `state` was read from (nothing is kept for a state
    /// without a live record).
    pub fn keep<T: Any + Send + Sync>(&self, id: &str, state: &DocState, value: Arc<T>) {
        let Some(record_rev) = record_rev(state) else { return };
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        if kept.len() >= MAX_PARSED_DESIGNS && !kept.contains_key(id) {
            kept.clear();
        }
        kept.insert(id.to_owned(), (record_rev.clone(), value));
    }
}

fn record_rev(state: &DocState) -> Option<&Revision> {
    state.token.record()?.record_rev.as_ref()
}

#[cfg(test)]
mod tests {
    use serde_json::Map;

    use super::*;
    use crate::backend::embedded::EmbeddedBackend;
    use crate::backend::DocumentBackend;
    use crate::database::engine::{Database, Write};

    /// A kept value is handed out for the record it was parsed from only: every write of the
    /// document (an edit, a deletion) makes the next read parse again, and a deleted document
    /// keeps nothing.
    #[tokio::test]
    async fn a_parsed_value_lasts_until_the_next_write_of_its_document() {
        let dir = tempfile::tempdir().unwrap();
        let backend: Arc<dyn DocumentBackend> =
            Arc::new(EmbeddedBackend::open(&dir.path().join("d.redb")).await.unwrap());
        let db = Database::new("d".into(), backend);
        let id = "_design/d";
        let edit = |parent: Option<String>, deleted: bool| Write::Edit { parent, deleted, body: Map::new() };
        db.write(id, &edit(None, false)).await.unwrap();
        let first = db.read(id).await.unwrap().expect("written");
        assert!(db.parsed_designs().get::<u32>(id, &first).is_none(), "nothing kept yet");
        db.parsed_designs().keep(id, &first, Arc::new(1u32));
        let again = db.read(id).await.unwrap().expect("written");
        assert_eq!(db.parsed_designs().get::<u32>(id, &again).as_deref(), Some(&1), "the same record");
        assert!(db.parsed_designs().get::<String>(id, &again).is_none(), "another type is not handed out");

        db.write(id, &edit(first.winner_rev(), false)).await.unwrap();
        let edited = db.read(id).await.unwrap().expect("written");
        assert!(db.parsed_designs().get::<u32>(id, &edited).is_none(), "parsed again after a write");
        db.parsed_designs().keep(id, &edited, Arc::new(2u32));
        db.write(id, &edit(edited.winner_rev(), true)).await.unwrap();
        let deleted = db.read(id).await.unwrap().expect("its tree is kept");
        assert!(db.parsed_designs().get::<u32>(id, &deleted).is_none(), "nothing for a deleted document");
        db.parsed_designs().keep(id, &deleted, Arc::new(3u32));
        assert!(db.parsed_designs().get::<u32>(id, &deleted).is_none(), "nor kept for one");
    }
}
