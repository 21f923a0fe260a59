//! A database's clients' local documents (`_local/{name}`, replication checkpoints), numbered as
//! CouchDB 3.4.3 numbers them (`couch_db_updater:increment_local_doc_revs`): a write is `0-N`
//! where N is one more than the number of the revision the writer named (`0-1` without one),
//! whatever revision the document holds (no conflicts: a stale revision is not refused); a
//! deletion is `0-0`.
//!
//! Where they are kept is the database's layout's ([`crate::database::layout::LocalNames`]): on
//! the engine's databases `doc:{name}`, on the data-store database `{name}` itself, as the
//! data-store face has always kept them, its own reserved names
//! ([`crate::database::layout::reserved_local_name`]) never shown.
//!
//! The backend numbers its local documents itself (one more per write), so the number CouchDB
//! would show is kept in the body, in [`LOCAL_REV_FIELD`], and shown as the revision; a local
//! document written before it was kept shows the backend's number.

use serde_json::{Map, Value};

use super::{Database, MAX_TRIES};
use crate::backend::{IdRange, Page, Precondition, Revision, StoredDocument};
use crate::database::layout::reserved_local_name;
use crate::error::{Error, ErrorKind, Result};

/// The body field holding a client's local document's revision number. Clients cannot write it:
/// it is replaced on every write (and CouchDB refuses `_`-fields it does not know in a body).
const LOCAL_REV_FIELD: &str = "_agentstore_local_rev";

impl Database {
    /// A client's local document (`_local/{name}`), its revision CouchDB's `0-N`.
    pub async fn get_local(&self, name: &str) -> Result<Option<StoredDocument>> {
        let stored = self.while_open(self.backend.get_local(&self.client_local_name(name)?)).await?;
        Ok(stored.map(|mut doc| {
            doc.id = format!("_local/{name}");
            shown(doc)
        }))
    }

    /// Writes a client's local document at revision `0-{number}`, whatever revision it holds.
    pub async fn put_local(&self, name: &str, body: &Map<String, Value>, number: u64) -> Result<Revision> {
        crate::model::depth::check_document_depth(body)?;
        let mut kept = body.clone();
        kept.insert(LOCAL_REV_FIELD.to_owned(), Value::from(number));
        let stored = self.client_local_name(name)?;
        self.while_open(self.backend.put_local(&stored, &kept, Precondition::None)).await?;
        Ok(Revision(format!("0-{number}")))
    }

    /// Deletes a client's local document whatever its revision; `false` when there was none.
    pub async fn delete_local(&self, name: &str) -> Result<bool> {
        let stored = self.client_local_name(name)?;
        for _ in 0..MAX_TRIES {
            let Some(current) = self.while_open(self.backend.get_local(&stored)).await? else { return Ok(false) };
            match self.while_open(self.backend.delete_local(&stored, &current.rev)).await {
                Ok(()) => return Ok(true),
                Err(err) if err.kind() == ErrorKind::NotFound => return Ok(false),
                // Another writer changed it between the read and the delete: read again.
                Err(err) if err.kind() == ErrorKind::Conflict => continue,
                Err(err) => return Err(err),
            }
        }
        Err(Error::new(
            ErrorKind::Conflict,
            format!("Document update conflict: {MAX_TRIES} attempts met other writers of _local/{name}; try again"),
        ))
    }

    /// One page of the clients' local documents whose names (without `_local/`) lie in `range`,
    /// in name order, each with its client id `_local/{name}` and CouchDB's revision; the
    /// engine's own locals (trees, settings) are never in it. Pass `next` back to continue.
    pub async fn local_docs(&self, range: &IdRange, limit: usize, token: Option<&str>) -> Result<Page<StoredDocument>> {
        let prefix = self.local_names().client_prefix;
        let names = range.under_prefix(prefix);
        let page = self.while_open(self.backend.local_docs(&names, limit, token)).await?;
        let page = crate::backend::shown_without_prefix(page, prefix);
        let clients = |doc: &StoredDocument| {
            !prefix.is_empty() || !doc.id.strip_prefix(crate::backend::LOCAL_PREFIX).is_some_and(reserved_local_name)
        };
        Ok(Page { items: page.items.into_iter().filter(clients).map(shown).collect(), next: page.next })
    }

    /// The backend's name of the client's local document `name`; a name the database keeps for
    /// itself is refused (403, as the data-store face refuses it): only the data-store
    /// database's names can be one, the engine's keeping clients' under a prefix of their own.
    fn client_local_name(&self, name: &str) -> Result<String> {
        let prefix = self.local_names().client_prefix;
        if prefix.is_empty() && reserved_local_name(name) {
            return Err(Error::new(
                ErrorKind::Forbidden,
                format!("the local document name {name:?} is reserved for this database's own records"),
            ));
        }
        Ok(format!("{prefix}{name}"))
    }
}

/// A stored client local document as clients see it: the kept number as its revision, the field
/// taken out of the body.
fn shown(mut doc: StoredDocument) -> StoredDocument {
    if let Some(number) = doc.body.remove(LOCAL_REV_FIELD).as_ref().and_then(Value::as_u64) {
        doc.rev = Revision(format!("0-{number}"));
    }
    doc
}
