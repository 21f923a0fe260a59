//! Bringing a view group up to date: reading the database's change feed from the group's
//! checkpoint ([`ViewSource`], any database: the data-store one or another), mapping what
//! changed, and writing the rows with the new checkpoint.
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
use serde_json::Value;

use super::design::DesignViews;
use super::index_store::{GroupState, IndexStore, MappedDoc};
use super::source::{SourceDoc, ViewSource};
use super::ViewError;

/// Documents read from the feed and mapped per step.
pub const FEED_PAGE: usize = 128;

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
    /// Each database's group prefix (name and incarnation) as this process last saw it.
    prefixes: Mutex<HashMap<String, String>>,
}

/// A group ready to be read: its name in the store and its state.
#[derive(Debug, Clone)]
pub struct ReadyGroup {
    pub name: String,
    pub state: GroupState,
}

impl ViewIndexer {
    pub fn new(store: Arc<IndexStore>, mapper: Arc<dyn Mapper>) -> Self {
        ViewIndexer { store, mapper, updating: Mutex::new(HashMap::new()), prefixes: Mutex::new(HashMap::new()) }
    }

    pub fn store(&self) -> &Arc<IndexStore> {
        &self.store
    }

    /// The prefix of `source`'s groups ([`ViewSource::group_prefix`]). When it is not the one this
    /// process saw last (the first use, or the incarnation ended: a purge, or the database deleted
    /// and created again), every group of the database kept under another incarnation is dropped
    /// from the file: nothing reads those again, and a purge's rows must not stay on disk.
    async fn prefix_of(&self, source: &dyn ViewSource) -> Result<String, ViewError> {
        let prefix = source.group_prefix().await?;
        let database = format!("{}\u{0}", source.name());
        let changed = {
            let mut seen = self.prefixes.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            seen.insert(database.clone(), prefix.clone()).as_deref() != Some(prefix.as_str())
        };
        if changed {
            let store = Arc::clone(&self.store);
            let kept = prefix.clone();
            let dropped = blocking(move || {
                let mut dropped = 0usize;
                for name in store.group_names(&database)? {
                    if !name.starts_with(&kept) && store.drop_group(&name)? {
                        dropped += 1;
                    }
                }
                Ok(dropped)
            })
            .await?;
            if dropped > 0 {
                tracing::info!(database = %source.name(), dropped, "dropped the view groups of an ended incarnation");
            }
        }
        Ok(prefix)
    }

    /// The group of `design` over `source` as it is, creating it empty if it does not exist.
    pub async fn current(&self, source: &dyn ViewSource, design: &DesignViews) -> Result<ReadyGroup, ViewError> {
        let name = format!("{}{}", self.prefix_of(source).await?, design.signature);
        let store = Arc::clone(&self.store);
        let views = design.views.len();
        let (name, state) = blocking(move || store.group(&name, views).map(|state| (name, state))).await?;
        Ok(ReadyGroup { name, state })
    }

    /// The group of `design` over `source`, brought up to the end of the feed as of now.
    pub async fn catch_up(&self, source: &dyn ViewSource, design: &DesignViews) -> Result<ReadyGroup, ViewError> {
        // Queries waiting together share a feed read that began after each of them arrived.
        if let Some(shared) = super::freshness::shared_catch_up(self, source, design).await {
            return shared;
        }
        let mut group = self.current(source, design).await?;
        let lock = self.lock_of(&group.name);
        let _updating = lock.lock().await;
        // Another update may have run while this one waited: start from the recorded state.
        let store = Arc::clone(&self.store);
        let name = group.name.clone();
        if let Some(state) = blocking(move || store.read_group(&name)).await? {
            group.state = state;
        }
        loop {
            let page = source.feed_page(group.state.checkpoint.as_deref(), FEED_PAGE).await?;
            if page.docs.is_empty() {
                if group.state.checkpoint.as_deref() != Some(page.last_seq.as_str()) {
                    group.state = self.apply(&group.name, Vec::new(), page.last_seq).await?;
                }
                break;
            }
            let mapped = self.map_page(design, page.docs).await?;
            group.state = self.apply(&group.name, mapped, page.last_seq).await?;
            if page.complete {
                break;
            }
        }
        Ok(group)
    }

    async fn map_page(&self, design: &DesignViews, docs: Vec<SourceDoc>) -> Result<Vec<MappedDoc>, ViewError> {
        let mut mapped = Vec::with_capacity(docs.len());
        let mut inputs = Vec::new();
        let mut input_ids = Vec::new();
        for SourceDoc { id, doc } in docs {
            match doc.filter(|_| is_mapped(&id, design)) {
                Some(doc) => {
                    input_ids.push(id);
                    inputs.push(Arc::new(doc));
                }
                // Deleted, never indexed, or not for this group: its rows (if any) go.
                None => mapped.push(MappedDoc { id, rows: Vec::new() }),
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

    /// Drops every group of `source` that no design document in `keep` (signatures) uses:
    /// CouchDB's `_view_cleanup`. Returns how many were dropped.
    pub async fn clean_up(&self, source: &dyn ViewSource, keep: &[String]) -> Result<usize, ViewError> {
        let prefix = self.prefix_of(source).await?;
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

/// Whether a (live) document is mapped by `design`'s group: never a local document, a design
/// document only with `options.include_design`.
fn is_mapped(id: &str, design: &DesignViews) -> bool {
    !id.starts_with("_local/") && (!id.starts_with("_design/") || design.include_design)
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
        let group = indexer.catch_up(db.as_ref(), &design).await.unwrap();
        let keys: Vec<Value> = rows(&indexer, &group, by_type).into_iter().map(|(k, _)| k).collect();
        assert_eq!(keys, [json!("a"), json!("b"), json!("c")], "design documents are not mapped");
        assert_eq!(mapper.mapped.load(Ordering::SeqCst), 3);

        // Nothing changed: nothing is mapped again.
        indexer.catch_up(db.as_ref(), &design).await.unwrap();
        assert_eq!(mapper.mapped.load(Ordering::SeqCst), 3);

        // An update, a delete, and a conflicting branch: only those are mapped.
        db.write("doc0", &edit(Some(revs[0].clone()), json!({"type": "z"}))).await.unwrap();
        db.write("doc1", &Write::Edit { parent: Some(revs[1].clone()), deleted: true, body: Default::default() })
            .await
            .unwrap();
        let branch = crate::database::rev_tree::RevPath::from_revisions(&json!({"start": 1, "ids": ["ffff"]})).unwrap();
        db.write("doc2", &Write::Replicated { path: branch, deleted: false, body: Default::default() }).await.unwrap();
        let stale = indexer.current(db.as_ref(), &design).await.unwrap();
        assert_eq!(rows(&indexer, &stale, by_type).len(), 3, "update=false reads the index as it was");
        let group = indexer.catch_up(db.as_ref(), &design).await.unwrap();
        assert_eq!(mapper.mapped.load(Ordering::SeqCst), 5, "the deleted document is not mapped");
        let by_type_rows = rows(&indexer, &group, by_type);
        assert_eq!(by_type_rows.iter().map(|(_, id)| id.as_str()).collect::<Vec<_>>(), ["doc2", "doc0"]);
        let conflicts = rows(&indexer, &group, conflicted);
        assert_eq!(conflicts.len(), 1, "the map function sees _conflicts");
        assert_eq!(conflicts[0].1, "doc2");
        assert_eq!(group.state.row_counts, vec![2, 1]);
    }
    /// A purge that erases a document erases its feed entry too; the purge ends the database's
    /// incarnation, so the next catch-up builds a new group without the document, and the old
    /// group (with its rows) leaves the index file.
    #[tokio::test]
    async fn a_purged_document_leaves_no_row_and_no_old_group() {
        let dir = tempfile::tempdir().unwrap();
        let catalog = Arc::new(EmbeddedCatalog::new(&dir.path().join("store.redb"), EmbeddedOptions::default()));
        let databases = Databases::new(Some(catalog), 4);
        let db = databases.create(&DbName::parse("app").unwrap()).await.unwrap();
        let store = Arc::new(IndexStore::open(&dir.path().join("views.redb")).unwrap());
        let indexer = ViewIndexer::new(store, Arc::new(TypeMapper { mapped: AtomicUsize::new(0) }));
        let design = DesignViews::parse(&json!({"_id": "_design/d", "views": {
            "by_type": {"map": "…"}, "conflicted": {"map": "…"}}}))
        .unwrap();
        let by_type = design.view("by_type").unwrap().0;
        let kept = match db.write("kept", &edit(None, json!({"type": "k"}))).await.unwrap() {
            crate::database::Written::Edited(rev) => rev,
            other => panic!("unexpected {other:?}"),
        };
        let purged = match db.write("secret", &edit(None, json!({"type": "s"}))).await.unwrap() {
            crate::database::Written::Edited(rev) => rev,
            other => panic!("unexpected {other:?}"),
        };
        let before = indexer.catch_up(db.as_ref(), &design).await.unwrap();
        assert_eq!(rows(&indexer, &before, by_type).len(), 2);

        assert_eq!(db.purge("secret", &[purged]).await.unwrap().len(), 1);
        let after = indexer.catch_up(db.as_ref(), &design).await.unwrap();
        let ids: Vec<String> = rows(&indexer, &after, by_type).into_iter().map(|(_, id)| id).collect();
        assert_eq!(ids, ["kept"], "the purged document's row is gone");
        assert_ne!(after.name, before.name, "a new incarnation's group");
        assert_eq!(indexer.store().read_group(&before.name).unwrap(), None, "the old group left the file");
        assert!(!kept.is_empty());
    }
}
