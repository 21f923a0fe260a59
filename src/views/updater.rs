//! Bringing a view group up to date: reading the database's change feed from the group's
//! checkpoint, mapping what changed, and writing the rows with the new checkpoint.
//!
//! One update of a group runs at a time in this process (a lock per group); a query that wants
//! the index current waits for the running update, then runs its own catch-up, which finds
//! nothing or little left. An update reads the feed until a page reports its end *as that read
//! saw it*: every write acknowledged before the update began is in the feed by then (the feed's
//! guarantee, docs/change-feed.md), so a view read after a write reflects it.
//!
//! Memory is bounded by the page size: [`FEED_PAGE`] documents are read and mapped at a time,
//! each within the database's `max_document_bytes`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use serde_json::{Map, Value};

use super::design::DesignViews;
use super::index_store::{GroupState, IndexStore, MappedDoc};
use super::ViewError;
use crate::backend::Precondition;
use crate::database::document::{leaf_json, DocOptions};
use crate::database::{Database, DocState};

/// Documents read from the feed and mapped per step.
pub const FEED_PAGE: usize = 128;

/// The backend's own local document holding the database's incarnation: a random id made when
/// a view is first built over it. A database deleted and created again under the same name has
/// a new one, so no index of the old database is ever read for the new one. Not a client's
/// local document (those are kept under another prefix), so no client can change it.
const INCARNATION_DOC: &str = "views-incarnation";

/// Runs map functions (JavaScript, or Mango's field maps).
#[async_trait]
pub trait Mapper: Send + Sync {
    /// For each document, for each view of `design` (in its order), the rows it emitted; a
    /// document a map function threw for has no rows in that view (CouchDB skips it and logs).
    async fn map(
        &self,
        design: &DesignViews,
        docs: Vec<Arc<Value>>,
    ) -> Result<Vec<Vec<Vec<(Value, Value)>>>, ViewError>;
}

/// The view groups of this process: where their rows are, who maps, and who is updating what.
pub struct ViewIndexer {
    store: Arc<IndexStore>,
    mapper: Arc<dyn Mapper>,
    updating: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// A group ready to be read: its name in the store and its state.
#[derive(Debug, Clone)]
pub struct ReadyGroup {
    pub name: String,
    pub state: GroupState,
}

impl ViewIndexer {
    pub fn new(store: Arc<IndexStore>, mapper: Arc<dyn Mapper>) -> Self {
        ViewIndexer { store, mapper, updating: Mutex::new(HashMap::new()) }
    }

    pub fn store(&self) -> &Arc<IndexStore> {
        &self.store
    }

    /// The group of `design` over `db` as it is, creating it empty if it does not exist.
    pub async fn current(&self, db: &Database, design: &DesignViews) -> Result<ReadyGroup, ViewError> {
        let name = group_name(db, design).await?;
        let store = Arc::clone(&self.store);
        let views = design.views.len();
        let (name, state) = blocking(move || store.group(&name, views).map(|state| (name, state))).await?;
        Ok(ReadyGroup { name, state })
    }

    /// The group of `design` over `db`, brought up to the end of the feed as of now.
    pub async fn catch_up(&self, db: &Database, design: &DesignViews) -> Result<ReadyGroup, ViewError> {
        // Queries waiting together share a feed read that began after each of them arrived.
        if let Some(shared) = super::freshness::shared_catch_up(self, db, design).await {
            return shared;
        }
        let mut group = self.current(db, design).await?;
        let lock = self.lock_of(&group.name);
        let _updating = lock.lock().await;
        // Another update may have run while this one waited: start from the recorded state.
        let store = Arc::clone(&self.store);
        let name = group.name.clone();
        if let Some(state) = blocking(move || store.read_group(&name)).await? {
            group.state = state;
        }
        loop {
            let page =
                db.backend().changes(group.state.checkpoint.as_deref(), FEED_PAGE).await.map_err(ViewError::Storage)?;
            if page.changes.is_empty() {
                if group.state.checkpoint.as_deref() != Some(page.last_seq.as_str()) {
                    group.state = self.apply(&group.name, Vec::new(), page.last_seq).await?;
                }
                break;
            }
            let states = db.read_changes(&page.changes).await.map_err(ViewError::Storage)?;
            let mapped = self.map_page(design, &page.changes, states).await?;
            group.state = self.apply(&group.name, mapped, page.last_seq).await?;
            if page.pending == Some(0) {
                break;
            }
        }
        Ok(group)
    }

    async fn map_page(
        &self,
        design: &DesignViews,
        changes: &[crate::backend::Change],
        states: Vec<Option<DocState>>,
    ) -> Result<Vec<MappedDoc>, ViewError> {
        let mut mapped = Vec::with_capacity(changes.len());
        let mut inputs = Vec::new();
        let mut input_ids = Vec::new();
        for (change, state) in changes.iter().zip(states) {
            match state.as_ref().and_then(|state| map_input(&change.id, state, design)) {
                Some(doc) => {
                    input_ids.push(change.id.clone());
                    inputs.push(Arc::new(doc));
                }
                // Deleted, never indexed, or not for this group: its rows (if any) go.
                None => mapped.push(MappedDoc { id: change.id.clone(), rows: Vec::new() }),
            }
        }
        if !inputs.is_empty() {
            let outcomes = self.mapper.map(design, inputs).await?;
            for (id, rows) in input_ids.into_iter().zip(outcomes) {
                mapped.push(MappedDoc { id, rows });
            }
        }
        Ok(mapped)
    }

    async fn apply(&self, name: &str, mapped: Vec<MappedDoc>, checkpoint: String) -> Result<GroupState, ViewError> {
        let store = Arc::clone(&self.store);
        let name = name.to_owned();
        blocking(move || store.apply(&name, &mapped, &checkpoint)).await
    }

    fn lock_of(&self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut updating = self.updating.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        Arc::clone(updating.entry(name.to_owned()).or_default())
    }

    /// Drops every group of `db` that no design document in `keep` (signatures) uses: CouchDB's
    /// `_view_cleanup`. Returns how many were dropped.
    pub async fn clean_up(&self, db: &Database, keep: &[String]) -> Result<usize, ViewError> {
        let prefix = format!("{}\u{0}{}\u{0}", db.name(), incarnation(db).await?);
        let store = Arc::clone(&self.store);
        let keep: Vec<String> = keep.iter().map(|signature| format!("{prefix}{signature}")).collect();
        blocking(move || {
            let mut dropped = 0;
            for name in store.group_names(&prefix)? {
                if !keep.contains(&name) && store.drop_group(&name)? {
                    dropped += 1;
                }
            }
            Ok(dropped)
        })
        .await
    }
}

/// The document a map function sees: the winning revision with `_id`, `_rev` and `_conflicts`
/// (CouchDB passes conflicts, so a view can find conflicted documents); `None` when it is not
/// mapped (deleted, local, or a design document the group does not include).
fn map_input(id: &str, state: &DocState, design: &DesignViews) -> Option<Value> {
    if state.deleted() || id.starts_with("_local/") || (id.starts_with("_design/") && !design.include_design) {
        return None;
    }
    let winner = state.tree.winner()?;
    Some(leaf_json(id, &state.tree, winner, DocOptions { conflicts: true, ..DocOptions::default() }))
}

/// The group's name in the store: database, incarnation, signature.
async fn group_name(db: &Database, design: &DesignViews) -> Result<String, ViewError> {
    Ok(format!("{}\u{0}{}\u{0}{}", db.name(), incarnation(db).await?, design.signature))
}

/// The database's incarnation ([`INCARNATION_DOC`]), made on first use.
async fn incarnation(db: &Database) -> Result<String, ViewError> {
    if let Some(known) = db.views_incarnation() {
        return Ok(known);
    }
    let backend = db.backend();
    let read = |doc: Option<crate::backend::StoredDocument>| {
        doc.and_then(|doc| doc.body.get("id").and_then(Value::as_str).map(str::to_owned))
    };
    let id = match read(backend.get_local(INCARNATION_DOC).await.map_err(ViewError::Storage)?) {
        Some(id) => id,
        None => {
            let mut random = [0u8; 16];
            getrandom::fill(&mut random).map_err(|err| {
                ViewError::Storage(crate::error::Error::new(
                    crate::error::ErrorKind::Internal,
                    format!("no random id: {err}"),
                ))
            })?;
            let mut body = Map::new();
            body.insert("id".into(), Value::from(random.iter().map(|b| format!("{b:02x}")).collect::<String>()));
            match backend.put_local(INCARNATION_DOC, &body, Precondition::MustNotExist).await {
                Ok(_) => body.get("id").and_then(Value::as_str).unwrap_or_default().to_owned(),
                // Another process made it first: read theirs.
                Err(err) if err.kind() == crate::error::ErrorKind::Conflict => {
                    read(backend.get_local(INCARNATION_DOC).await.map_err(ViewError::Storage)?)
                        .ok_or_else(|| ViewError::Storage(err))?
                }
                Err(err) => return Err(ViewError::Storage(err)),
            }
        }
    };
    Ok(db.remember_views_incarnation(id))
}

/// Runs store work on a blocking thread.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> crate::error::Result<T> + Send + 'static,
) -> Result<T, ViewError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|err| {
            ViewError::Storage(crate::error::Error::new(
                crate::error::ErrorKind::Internal,
                format!("view index task: {err}"),
            ))
        })?
        .map_err(ViewError::Storage)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::catalog::{DbName, EmbeddedCatalog};
    use crate::backend::embedded::EmbeddedOptions;
    use crate::database::{Databases, Write};
    use crate::views::index_store::RowRange;
    use serde_json::json;
    use std::ops::ControlFlow;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Emits `(doc.type, doc._rev)` in the first view and, for documents with conflicts,
    /// `(doc._conflicts, null)` in the second; counts the documents it is given.
    struct TypeMapper {
        mapped: AtomicUsize,
    }

    #[async_trait]
    impl Mapper for TypeMapper {
        async fn map(
            &self,
            _: &DesignViews,
            docs: Vec<Arc<Value>>,
        ) -> Result<Vec<Vec<Vec<(Value, Value)>>>, ViewError> {
            self.mapped.fetch_add(docs.len(), Ordering::SeqCst);
            Ok(docs
                .iter()
                .map(|doc| {
                    let by_type = vec![(doc["type"].clone(), doc["_rev"].clone())];
                    let conflicts = doc.get("_conflicts").map(|c| vec![(c.clone(), Value::Null)]).unwrap_or_default();
                    vec![by_type, conflicts]
                })
                .collect())
        }
    }

    fn edit(parent: Option<String>, value: Value) -> Write {
        Write::Edit { parent, deleted: false, body: value.as_object().cloned().unwrap_or_default() }
    }

    fn rows(indexer: &ViewIndexer, group: &ReadyGroup, view: usize) -> Vec<(Value, String)> {
        let mut out = Vec::new();
        indexer
            .store()
            .scan(group.state.number, view, &RowRange::all(), false, |row| {
                out.push((row.key, row.id));
                ControlFlow::Continue(())
            })
            .unwrap();
        out
    }

    #[tokio::test]
    async fn groups_follow_writes_deletes_and_conflicts_incrementally() {
        let dir = tempfile::tempdir().unwrap();
        let catalog = Arc::new(EmbeddedCatalog::new(&dir.path().join("store.redb"), EmbeddedOptions::default()));
        let databases = Databases::new(Some(catalog), 4);
        let db = databases.create(&DbName::parse("app").unwrap()).await.unwrap();
        let store = Arc::new(IndexStore::open(&dir.path().join("views.redb")).unwrap());
        let mapper = Arc::new(TypeMapper { mapped: AtomicUsize::new(0) });
        let indexer = ViewIndexer::new(store, mapper.clone());
        let design = DesignViews::parse(&json!({"_id": "_design/d", "views": {
            "by_type": {"map": "…"}, "conflicted": {"map": "…"}}}))
        .unwrap();
        let (by_type, conflicted) = (design.view("by_type").unwrap().0, design.view("conflicted").unwrap().0);

        let mut revs = Vec::new();
        for (i, kind) in ["b", "a", "c"].iter().enumerate() {
            match db.write(&format!("doc{i}"), &edit(None, json!({"type": kind}))).await.unwrap() {
                crate::database::Written::Edited(rev) => revs.push(rev),
                other => panic!("unexpected {other:?}"),
            }
        }
        db.write("_design/d", &edit(None, json!({"type": "design"}))).await.unwrap();
        let group = indexer.catch_up(&db, &design).await.unwrap();
        let keys: Vec<Value> = rows(&indexer, &group, by_type).into_iter().map(|(k, _)| k).collect();
        assert_eq!(keys, [json!("a"), json!("b"), json!("c")], "design documents are not mapped");
        assert_eq!(mapper.mapped.load(Ordering::SeqCst), 3);

        // Nothing changed: nothing is mapped again.
        indexer.catch_up(&db, &design).await.unwrap();
        assert_eq!(mapper.mapped.load(Ordering::SeqCst), 3);

        // An update, a delete, and a conflicting branch: only those are mapped.
        db.write("doc0", &edit(Some(revs[0].clone()), json!({"type": "z"}))).await.unwrap();
        db.write("doc1", &Write::Edit { parent: Some(revs[1].clone()), deleted: true, body: Default::default() })
            .await
            .unwrap();
        let branch = crate::database::rev_tree::RevPath::from_revisions(&json!({"start": 1, "ids": ["ffff"]})).unwrap();
        db.write("doc2", &Write::Replicated { path: branch, deleted: false, body: Default::default() }).await.unwrap();
        let stale = indexer.current(&db, &design).await.unwrap();
        assert_eq!(rows(&indexer, &stale, by_type).len(), 3, "update=false reads the index as it was");
        let group = indexer.catch_up(&db, &design).await.unwrap();
        assert_eq!(mapper.mapped.load(Ordering::SeqCst), 5, "the deleted document is not mapped");
        let by_type_rows = rows(&indexer, &group, by_type);
        assert_eq!(by_type_rows.iter().map(|(_, id)| id.as_str()).collect::<Vec<_>>(), ["doc2", "doc0"]);
        let conflicts = rows(&indexer, &group, conflicted);
        assert_eq!(conflicts.len(), 1, "the map function sees _conflicts");
        assert_eq!(conflicts[0].1, "doc2");
        assert_eq!(group.state.row_counts, vec![2, 1]);
    }
}
