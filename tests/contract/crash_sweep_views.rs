//! The crash-point sweep's view check (issue 35 §3; docs/design/crash-points.md, "Views"): a
//! view index kept in an index file that outlives the crash, caught up before the operation and
//! again after the restart, must answer exactly what an index built from scratch over the
//! database as it is then answers. An index cannot tell a purged document from an unchanged one
//! (its feed entry is erased with it), so only the purge's ending of the database's view
//! incarnation (`Database::erase`, `src/database/engine/purge_views.rs`) removes its rows; this
//! check is what sees a crash that skipped it.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use agentstore::backend::raw::layer::Layered;
use agentstore::backend::DocumentBackend;
use agentstore::database::{Database, Write, Written};
use agentstore::js::DocText;
use agentstore::store::StoreOptions;
use agentstore::views::design::DesignViews;
use agentstore::views::index_store::{IndexStore, RowRange};
use agentstore::views::updater::{Mapper, ViewIndexer};
use agentstore::views::{ViewError, ViewSource};
use agentstore::{DataStore, ErrorKind};
use serde_json::{json, Map, Value};

use crate::crash::{CrashLayer, Cut};
use crate::harness::Ctx;

/// Emits each document under its id, with the whole document as CouchDB passes it to a map
/// function (winner, `_rev`, `_conflicts`) as the value: any difference in what the index holds
/// shows in the rows.
struct WholeDocMapper;

#[async_trait::async_trait]
impl Mapper for WholeDocMapper {
    async fn map(&self, _: &DesignViews, docs: Vec<Arc<DocText>>) -> Result<Vec<Vec<Vec<(Value, Value)>>>, ViewError> {
        Ok(docs.iter().map(|doc| vec![vec![(doc.value()["_id"].clone(), doc.value().clone())]]).collect())
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
    pub async fn catch_up(&self, source: &dyn ViewSource) {
        self.rows_of(&self.kept, source).await.expect("the view index caught up before the operation");
    }

    /// After the restart: the kept index caught up by the new process, compared with an index
    /// built from scratch. The violations found.
    pub async fn compare_with_rebuild(&self, source: &dyn ViewSource) -> Vec<String> {
        let kept = match self.rows_of(&self.kept, source).await {
            Ok(rows) => rows,
            Err(err) => return vec![format!("the kept view index does not catch up: {err}")],
        };
        let fresh_dir = tempfile::tempdir_in(self.dir.path()).expect("a directory for the rebuild");
        let fresh = Arc::new(IndexStore::open(&fresh_dir.path().join("rebuilt.redb")).expect("the rebuild's file"));
        let rebuilt = self.rows_of(&fresh, source).await.expect("the view built from scratch");
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

    /// Every row of the view, caught up over `source` by a new indexer (a process's) over
    /// `store`.
    async fn rows_of(&self, store: &Arc<IndexStore>, source: &dyn ViewSource) -> Result<Vec<Row>, ViewError> {
        let indexer = ViewIndexer::new(Arc::clone(store), Arc::new(WholeDocMapper));
        let group = indexer.catch_up(source, &self.design).await?;
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

/// Most backend calls of the swept `purge_user`.
const MAX_PURGE_CALLS: usize = 100;

/// The crash-point sweep of the data-store database's `purge_user` against its views: its
/// erasure takes the purged documents' feed entries, so only ending the data-store database's
/// view incarnation removes their rows; a view index kept across a cut at any call must answer
/// what one built from scratch answers (docs/design/crash-points.md, "Views").
pub async fn crash_sweep_purge_user_views(ctx: Ctx) {
    if ctx.backend_name == "couchdb" {
        println!("couchdb: not applicable: CouchDB indexes its own documents and updates them after a purge");
        return;
    }
    // The data-store database as the CouchDB API serves it (its views read the incarnation at
    // every use).
    let source =
        Database::data_store("agent_data_store".into(), Arc::clone(&ctx.backend)).expect("the data-store database");
    let store = ctx.store().await;
    store.set("kept", "ns", "k", json!({"kept": true}), None, None).await.expect("a kept document");
    let mut violations = Vec::new();
    for cut in [Cut::Stop, Cut::LoseAnswer] {
        let views = ViewCheck::new();
        let mut steps = Vec::new();
        for k in 0..MAX_PURGE_CALLS {
            let user = format!("purged{k}{}", if cut == Cut::Stop { "s" } else { "l" });
            for key in ["a", "b"] {
                store.set(&user, "ns", key, json!({"key": key}), None, None).await.expect("a document to purge");
            }
            views.catch_up(&source).await;
            // `DataStore::open` makes two calls (the standard indexes, the read of the mark of
            // design documents moved into records, set by the first open): the cut falls after them.
            let layer = Arc::new(CrashLayer::new(Arc::clone(&ctx.backend), k + 2, cut));
            let crashing = DataStore::open(Arc::clone(&layer) as Arc<dyn DocumentBackend>, StoreOptions::default())
                .await
                .expect("the store over the layer");
            let answer = crashing.purge_user(&user).await;
            layer.end();
            let found = views.compare_with_rebuild(&source).await;
            violations.extend(found.into_iter().map(|v| format!("{cut:?} at call {k}: {v}")));
            // The purge retried, as after an error: it must finish and end the incarnation.
            match store.purge_user(&user).await {
                Ok(_) => {}
                Err(err) if err.kind() == ErrorKind::NotFound => {}
                Err(err) => panic!("purging {user} again: {err}"),
            }
            if !layer.cut_made() {
                answer.expect("purge_user uncut");
                steps = layer.called();
                break;
            }
        }
        println!("crash sweep: {} purge_user views {cut:?}; steps: {}", ctx.backend_name, steps.join(" "));
    }
    assert!(
        violations.is_empty(),
        "crash sweep: {} purge_user: violations:\n  {}",
        ctx.backend_name,
        violations.join("\n  ")
    );
}

/// The name of the database the engine's purge sweep runs on (views name their groups after it).
const PURGED_DATABASE: &str = "crash-sweep-purge";

/// A backend on which, just before the purge's erasure (its first `erase_id`), another process
/// catches the kept view index up: a view queried between the purge's first step and its
/// erasure, whose index holds the document about to be purged.
struct ViewQueriedBeforeErasure {
    inner: Arc<dyn DocumentBackend>,
    views: Arc<ViewCheck>,
    armed: AtomicBool,
}

#[async_trait::async_trait]
impl Layered for ViewQueriedBeforeErasure {
    fn inner(&self) -> &dyn DocumentBackend {
        self.inner.as_ref()
    }

    async fn erase_id(&self, id: &str, options: &agentstore::backend::EraseOptions) -> agentstore::Result<bool> {
        if self.armed.swap(false, Ordering::SeqCst) {
            self.views.catch_up(&Database::new(PURGED_DATABASE.into(), Arc::clone(&self.inner))).await;
        }
        self.inner.erase_id(id, options).await
    }
}

/// The crash-point sweep of the engine's purge of a document's last leaf with a view queried
/// by another process between its first step and its erasure (docs/design/crash-points.md,
/// "Views"): after a cut at any call, a view index kept across it must answer what one built
/// from scratch answers.
pub async fn crash_sweep_purge_views_queried_meanwhile(ctx: Ctx) {
    if ctx.backend_name == "couchdb" {
        println!("couchdb: not applicable: the engine is not used there (CouchDB keeps its own trees)");
        return;
    }
    let process = || Database::new(PURGED_DATABASE.into(), Arc::clone(&ctx.backend));
    let created = |id: String| async move {
        let write = Write::Edit { parent: None, deleted: false, body: Map::from_iter([("v".into(), json!(1))]) };
        match process().write(&id, &write).await.expect("a document to purge") {
            Written::Edited(rev) => rev,
            other => panic!("an edit answered {other:?}"),
        }
    };
    created("kept".into()).await;
    let mut violations = Vec::new();
    for cut in [Cut::Stop, Cut::LoseAnswer] {
        let views = Arc::new(ViewCheck::new());
        let mut steps = Vec::new();
        for k in 0..MAX_PURGE_CALLS {
            let id = format!("purged{k}{}", if cut == Cut::Stop { "s" } else { "l" });
            let rev = created(id.clone()).await;
            views.catch_up(&process()).await;
            let querying = Arc::new(ViewQueriedBeforeErasure {
                inner: Arc::clone(&ctx.backend),
                views: Arc::clone(&views),
                armed: AtomicBool::new(true),
            });
            let layer = Arc::new(CrashLayer::new(querying, k, cut));
            let answer = Database::new(PURGED_DATABASE.into(), Arc::clone(&layer) as Arc<dyn DocumentBackend>)
                .purge(&id, std::slice::from_ref(&rev))
                .await;
            layer.end();
            let found = views.compare_with_rebuild(&process()).await;
            violations.extend(found.into_iter().map(|v| format!("{cut:?} at call {k}: {v}")));
            // The purge retried, as after an error.
            process().purge(&id, std::slice::from_ref(&rev)).await.expect("the purge retried");
            if !layer.cut_made() {
                answer.expect("the purge uncut");
                steps = layer.called();
                break;
            }
        }
        println!(
            "crash sweep: {} purge with a view queried meanwhile {cut:?}; steps: {}",
            ctx.backend_name,
            steps.join(" ")
        );
    }
    assert!(
        violations.is_empty(),
        "crash sweep: {} purge with a view queried meanwhile: violations:\n  {}",
        ctx.backend_name,
        violations.join("\n  ")
    );
}
