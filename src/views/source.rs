//! Where a view group's documents come from: [`ViewSource`], a database's change feed read one
//! page at a time, each changed document as CouchDB shows it to a map function, and the name an
//! index of that database is kept under.
//!
//! [`Database`] implements it, whatever its layout (the data-store database is one too); its
//! incarnation is read at every use, since a purge, or the facade's `purge_user`, ends it from any
//! process. The updater ([`super::updater`]) and anything else kept from a feed (Mango's JSON
//! indexes) read only this trait.

use async_trait::async_trait;
use serde_json::{Map, Value};

use super::ViewError;
use crate::backend::{DocumentBackend, Precondition, StoredDocument};
use crate::database::Database;
use crate::js::DocText;

/// One page of a database's change feed, with each changed document read.
#[derive(Debug, Clone, Default)]
pub struct SourcePage {
    /// Each changed document once, in feed order.
    pub docs: Vec<SourceDoc>,
    /// Where the next page starts (CouchDB's `last_seq`): every change up to it is in `docs` or
    /// an earlier page.
    pub last_seq: String,
    /// Whether this page reaches the end of the feed as this read saw it (the backend's
    /// `pending == Some(0)`): every write acknowledged before the read is then in it or before.
    pub complete: bool,
}

/// One changed document of a [`SourcePage`].
#[derive(Debug, Clone)]
pub struct SourceDoc {
    pub id: String,
    /// The winning revision as CouchDB passes it to a map function, as JSON text
    /// ([`Database::read_map_inputs`]): `_id`, `_rev`, the body, and `_conflicts` when it has any;
    /// `None` when the document is deleted (or gone since the feed was read: its deletion comes
    /// later in the feed).
    pub doc: Option<DocText>,
}

/// A database whose change feed indexes (views, Mango's JSON indexes) are built from.
#[async_trait]
pub trait ViewSource: Send + Sync {
    /// The database's name, as groups and logs name it.
    fn name(&self) -> &str;

    /// The database's incarnation: a random id made the first time an index is built over it and
    /// kept in the database itself, so that a database deleted and created again under the same
    /// name never reads an index of the one before.
    async fn incarnation(&self) -> Result<String, ViewError>;

    /// The changes after `since` (`None`: from the start), at most `limit` documents.
    async fn feed_page(&self, since: Option<&str>, limit: usize) -> Result<SourcePage, ViewError>;

    /// The prefix of every group's name over this database: name and incarnation.
    async fn group_prefix(&self) -> Result<String, ViewError> {
        Ok(format!("{}\u{0}{}\u{0}", self.name(), self.incarnation().await?))
    }
}

#[async_trait]
impl ViewSource for Database {
    fn name(&self) -> &str {
        Database::name(self)
    }

    /// Read at every use, never remembered: a purge (or the facade's `purge_user` on the
    /// data-store database) in this process or another ends the incarnation, and the next index
    /// use must build new groups rather than read ones holding the purged documents' rows. One
    /// point read of a local document per use (docs/views.md, "Purges").
    async fn incarnation(&self) -> Result<String, ViewError> {
        if let Some(kept) = self.kept_views_incarnation().await.map_err(ViewError::Storage)? {
            return Ok(kept);
        }
        kept_incarnation(self.backend().as_ref(), self.views_incarnation_doc()).await
    }

    async fn feed_page(&self, since: Option<&str>, limit: usize) -> Result<SourcePage, ViewError> {
        // Whether the page reaches the end is all an index asks of `pending`.
        let page = self.backend().changes_to_end(since, limit).await.map_err(ViewError::Storage)?;
        // Nothing changed (every query of a current index): no read of no documents.
        let inputs = match page.changes.is_empty() {
            true => Vec::new(),
            false => {
                let ids: Vec<String> = page.changes.iter().map(|change| change.id.clone()).collect();
                self.read_map_inputs(&ids).await.map_err(ViewError::Storage)?
            }
        };
        let docs = page
            .changes
            .into_iter()
            .zip(inputs)
            .map(|(change, input)| SourceDoc { id: change.id, doc: input.map(DocText::from_json_text) })
            .collect();
        Ok(SourcePage { docs, last_seq: page.last_seq, complete: page.pending == Some(0) })
    }
}

/// The incarnation kept in the local document `name` of `backend`, made (a random id) when
/// there is none yet; when another process makes it first, theirs is read.
pub async fn kept_incarnation(backend: &dyn DocumentBackend, name: &str) -> Result<String, ViewError> {
    let read =
        |doc: Option<StoredDocument>| doc.and_then(|doc| doc.body.get("id").and_then(Value::as_str).map(str::to_owned));
    if let Some(id) = read(backend.get_local(name).await.map_err(ViewError::Storage)?) {
        return Ok(id);
    }
    let mut random = [0u8; 16];
    getrandom::fill(&mut random).map_err(|err| {
        ViewError::Storage(crate::error::Error::new(crate::error::ErrorKind::Internal, format!("no random id: {err}")))
    })?;
    let id: String = random.iter().map(|b| format!("{b:02x}")).collect();
    let mut body = Map::new();
    body.insert("id".into(), Value::from(id.clone()));
    match backend.put_local(name, &body, Precondition::MustNotExist).await {
        Ok(_) => Ok(id),
        // Another process made it first: read theirs.
        Err(err) if err.kind() == crate::error::ErrorKind::Conflict => {
            read(backend.get_local(name).await.map_err(ViewError::Storage)?).ok_or(ViewError::Storage(err))
        }
        Err(err) => Err(ViewError::Storage(err)),
    }
}
