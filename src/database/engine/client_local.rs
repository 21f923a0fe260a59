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
//! would show is kept in the body, in [`LOCAL_REV_MEMBER`], and shown as the revision; a local
//! document written before it was kept shows the backend's number.
//!
//! The member's name does not start with `_`: Apache CouchDB 3.4.3 refuses a body member starting
//! with `_` it does not know (400 `doc_validation`, "Bad special document member"), so on the
//! CouchDB backend every local document write (replication checkpoints) failed while the number
//! was kept in `_agentstore_local_rev` (pouchdb-server accepts such members). So that a client's
//! member can never be taken for it, every name starting with [`KEPT_MEMBER_PREFIX`] is this
//! module's: a client's member starting with it is kept with the prefix doubled and shown with
//! one taken off. A local document written under the old member (on pouchdb-server or on the other
//! backends) still reads: its number is read from `_agentstore_local_rev`, and its members,
//! written before the escaping, are shown as kept.

use serde_json::{Map, Value};

use super::{Database, MAX_TRIES};
use crate::backend::{IdRange, Page, Precondition, Revision, StoredDocument};
use crate::database::layout::reserved_local_name;
use crate::error::{Error, ErrorKind, Result};

/// The start of every member name this module keeps in a client's local document's body (module
/// doc): a client's member starting with it is kept with it doubled.
const KEPT_MEMBER_PREFIX: &str = "agentstore.";

/// The body member holding a client's local document's revision number; it starts with
/// [`KEPT_MEMBER_PREFIX`] and is not itself an escaped client member (it does not start with the
/// prefix twice).
const LOCAL_REV_MEMBER: &str = "agentstore.local_rev";

/// The member earlier versions kept the number in, refused by a real CouchDB: read, never written.
const OLD_LOCAL_REV_MEMBER: &str = "_agentstore_local_rev";

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
        let mut kept = escaped(body);
        kept.insert(LOCAL_REV_MEMBER.to_owned(), Value::from(number));
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

/// A client's body as kept: each member starting with [`KEPT_MEMBER_PREFIX`] renamed with the
/// prefix doubled, so none can be taken for one of this module's.
fn escaped(body: &Map<String, Value>) -> Map<String, Value> {
    body.iter()
        .map(|(name, value)| {
            let kept =
                if name.starts_with(KEPT_MEMBER_PREFIX) { format!("{KEPT_MEMBER_PREFIX}{name}") } else { name.clone() };
            (kept, value.clone())
        })
        .collect()
}

/// A stored client local document as clients see it: the kept number as its revision, the
/// member taken out of the body, and a client's escaped members under their own names again.
/// A document written under the old member was written before escaping: its members are shown
/// as kept.
fn shown(mut doc: StoredDocument) -> StoredDocument {
    let kept_number = doc.body.remove(LOCAL_REV_MEMBER);
    let old_number = doc.body.remove(OLD_LOCAL_REV_MEMBER);
    if kept_number.is_some() {
        doc.body = std::mem::take(&mut doc.body)
            .into_iter()
            .map(|(name, value)| match name.strip_prefix(KEPT_MEMBER_PREFIX) {
                Some(client_name) => (client_name.to_owned(), value),
                None => (name, value),
            })
            .collect();
    }
    if let Some(number) = kept_number.or(old_number).as_ref().and_then(Value::as_u64) {
        doc.rev = Revision(format!("0-{number}"));
    }
    doc
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn stored(body: Value) -> StoredDocument {
        let Value::Object(body) = body else { panic!("not an object") };
        StoredDocument { id: "_local/x".into(), rev: Revision("7-backend".into()), body }
    }

    #[test]
    fn kept_members_never_start_with_an_underscore_and_clients_members_come_back() {
        let Value::Object(client) = json!({"a": 1, "agentstore.local_rev": "mine", "agentstore.agentstore.x": 2})
        else {
            panic!("not an object")
        };
        let mut kept = escaped(&client);
        kept.insert(LOCAL_REV_MEMBER.to_owned(), Value::from(4));
        assert!(kept.keys().all(|name| !name.starts_with('_')));
        let doc = shown(stored(Value::Object(kept)));
        assert_eq!(doc.rev.as_str(), "0-4");
        assert_eq!(Value::Object(doc.body), Value::Object(client));
    }

    #[test]
    fn a_document_kept_under_the_old_member_still_reads() {
        let doc = shown(stored(json!({"_agentstore_local_rev": 3, "agentstore.x": 1, "b": 2})));
        assert_eq!(doc.rev.as_str(), "0-3");
        assert_eq!(Value::Object(doc.body), json!({"agentstore.x": 1, "b": 2}));
    }
}
