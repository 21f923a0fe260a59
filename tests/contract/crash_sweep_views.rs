//! The crash-point sweep's view check (issue 35 §3; docs/design/crash-points.md, "Views"): a
//! view index kept in an index file that outlives the crash, caught up before the operation and
//! again after the restart, must answer exactly what an index built from scratch over the
//! database as it is then answers. An index cannot tell a purged document from an unchanged one
//! (its feed entry is erased with it), so only the purge's ending of the database's view
//! incarnation (`Database::end_views_incarnation`) removes its rows; this check is what sees a
//! crash that skipped it.

use std::ops::ControlFlow;
use std::sync::Arc;

use agentstore::backend::DocumentBackend;
use agentstore::database::Database;
use agentstore::views::design::DesignViews;
use agentstore::views::index_store::{IndexStore, RowRange};
use agentstore::views::updater::{Mapper, ViewIndexer};
use agentstore::views::ViewError;
use serde_json::{json, Value};

/// Emits each document under its id, with the whole document as CouchDB passes it to a map
/// function (winner, `_rev`, `_conflicts`) as the value: any difference in what the index holds
/// shows in the rows.
struct WholeDocMapper;

#[async_trait::async_trait]
impl Mapper for WholeDocMapper {
    async fn map(&self, _: &DesignViews, docs: Vec<Arc<Value>>) -> Result<Vec<Vec<Vec<(Value, Value)>>>, ViewError> {
        Ok(docs.iter().map(|doc| vec![vec![(doc["_id"].clone(), Value::clone(doc))]]).collect())
    }
}

/// One row as compared: key, document id, value.
type Row = (Value, String, Value);

/// An index file kept across the crash points of one sweep (a `serve` process's view index,
/// which survives the process), and the design document it indexes.
pub struct ViewCheck {
    dir: tempfile::TempDir,
    kept: Arc<IndexStore>,
    design: DesignViews,
}

impl ViewCheck {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("a directory for the view index");
        let kept = Arc::new(IndexStore::open(&dir.path().join("kept.redb")).expect("the index file"));
        let design = DesignViews::parse(&json!({"_id": "_design/sweep", "views": {"docs": {"map": "…"}}}))
            .expect("the design document");
        ViewCheck { dir, kept, design }
    }

    /// Brings the kept index up to date through a process of its own (before the operation:
    /// what the process that crashes had built).
    pub async fn catch_up(&self, db: &Database) {
        self.rows_of(&self.kept, db).await.expect("the view index caught up before the operation");
    }

    /// After the restart: the kept index caught up by the new process, compared with an index
    /// built from scratch. The violations found.
    pub async fn compare_with_rebuild(&self, backend: &Arc<dyn DocumentBackend>) -> Vec<String> {
        let db = Database::new(crate::crash_sweep::DATABASE_NAME.into(), Arc::clone(backend));
        let kept = match self.rows_of(&self.kept, &db).await {
            Ok(rows) => rows,
            Err(err) => return vec![format!("the kept view index does not catch up: {err}")],
        };
        let fresh_dir = tempfile::tempdir_in(self.dir.path()).expect("a directory for the rebuild");
        let fresh = Arc::new(IndexStore::open(&fresh_dir.path().join("rebuilt.redb")).expect("the rebuild's file"));
        let rebuilt = self.rows_of(&fresh, &db).await.expect("the view built from scratch");
        if kept == rebuilt {
            return Vec::new();
        }
        let ids =
            |rows: &[Row]| rows.iter().map(|(_, id, value)| format!("{id} {}", value["_rev"])).collect::<Vec<_>>();
        vec![format!(
            "the view answers {:?} after the restart; built from scratch it answers {:?}",
            ids(&kept),
            ids(&rebuilt)
        )]
    }

    /// Every row of the view, caught up over `db` by a new indexer (a process's) over `store`.
    async fn rows_of(&self, store: &Arc<IndexStore>, db: &Database) -> Result<Vec<Row>, ViewError> {
        let indexer = ViewIndexer::new(Arc::clone(store), Arc::new(WholeDocMapper));
        let group = indexer.catch_up(db, &self.design).await?;
        let mut rows = Vec::new();
        store
            .scan(group.state.number, 0, &RowRange::all(), false, |row| {
                rows.push((row.key, row.id, row.value));
                ControlFlow::Continue(())
            })
            .map_err(ViewError::Storage)?;
        Ok(rows)
    }
}
