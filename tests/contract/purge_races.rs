//! A purge racing a write from another process (issue 35; issue 36: many instances behind one
//! load balancer): the purge reads the document, decides what to erase, then erases it; a write
//! another process lands between the read and the erasure must survive. Each case runs the purge
//! through a [`Database`] over a layer that, at the purge's erasure (`erase_id`), first lets a
//! second `Database` over the same backend write the document: the engine's layout (a live
//! document, a deleted one) and the data-store layout (a document's last leaf, a conflicted
//! document's winner; on the CouchDB backend its native layout). The write extends the leaf the
//! purge names, so the purge, which reads again, finds no such leaf: it answers `purged: []` for
//! it, as CouchDB answers a purge naming a revision that is no longer a leaf.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use agentstore::backend::raw::layer::Layered;
use agentstore::backend::{DocumentBackend, EraseOptions};
use agentstore::database::rev_tree::RevPath;
use agentstore::database::{Database, DocState, Write, Written};
use serde_json::{json, Map, Value};

use crate::document_model::id_of;
use crate::harness::Ctx;

/// The write another process makes, once, inside the purge's erasure.
type Intruder = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// A backend that runs the armed intruder just before the first `erase_id` it forwards.
struct WriteBeforeErasure {
    inner: Arc<dyn DocumentBackend>,
    intruder: Mutex<Option<Intruder>>,
}

#[async_trait::async_trait]
impl Layered for WriteBeforeErasure {
    fn inner(&self) -> &dyn DocumentBackend {
        self.inner.as_ref()
    }

    async fn erase_id(&self, id: &str, options: &EraseOptions) -> agentstore::Result<bool> {
        let intruder = self.intruder.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(intruder) = intruder {
            intruder().await;
        }
        self.inner.erase_id(id, options).await
    }
}

/// Which database the two processes open over the backend.
#[derive(Clone, Copy)]
enum Kind {
    /// The engine's layout (every database but the data-store one).
    Engine,
    /// The data-store database (its native layout on a backend keeping trees itself).
    DataStore,
}

fn open(kind: Kind, backend: Arc<dyn DocumentBackend>) -> Arc<Database> {
    let name = "purge-races".to_owned();
    Arc::new(match kind {
        Kind::Engine => Database::new(name, backend),
        Kind::DataStore if backend.keeps_branches() => Database::native_data_store(name, backend).expect("native"),
        Kind::DataStore => Database::data_store(name, backend).expect("data-store database"),
    })
}

/// The purging process (over the layer, armed with `intruder`) and the writing one.
fn processes(ctx: &Ctx, kind: Kind) -> (Arc<Database>, Arc<Database>, Arc<WriteBeforeErasure>) {
    let layer = Arc::new(WriteBeforeErasure { inner: Arc::clone(&ctx.backend), intruder: Mutex::new(None) });
    let purging = open(kind, Arc::clone(&layer) as Arc<dyn DocumentBackend>);
    (purging, open(kind, Arc::clone(&ctx.backend)), layer)
}

fn arm(layer: &WriteBeforeErasure, writer: &Arc<Database>, id: &str, write: Write) {
    let (writer, id) = (Arc::clone(writer), id.to_owned());
    let intruder: Intruder = Box::new(move || {
        Box::pin(async move {
            writer.write(&id, &write).await.expect("the other process's write is acknowledged");
        })
    });
    *layer.intruder.lock().unwrap_or_else(|e| e.into_inner()) = Some(intruder);
}

fn body(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        other => panic!("expected an object, got {other}"),
    }
}

fn edit(parent: Option<&str>, deleted: bool, value: Value) -> Write {
    Write::Edit { parent: parent.map(str::to_owned), deleted, body: body(value) }
}

async fn edited(db: &Database, id: &str, write: Write) -> String {
    match db.write(id, &write).await.expect("write") {
        Written::Edited(rev) => rev,
        other => panic!("an edit answered {other:?}"),
    }
}

fn leaves(state: &DocState) -> Vec<String> {
    state.tree.leaves().into_iter().map(|leaf| leaf.path.leaf_rev()).collect()
}

/// Purges `named` with the intruder armed; checks the purge answered nothing and that the
/// other process's write reads back (as the winner, live or not as `deleted`).
async fn purge_meets_the_write(purging: &Database, writer: &Database, id: &str, named: &str, deleted: bool) {
    let purged = purging.purge(id, &[named.to_owned()]).await.expect("purge");
    assert!(purged.is_empty(), "{id}: the purge named a leaf that is no longer one, yet answered {purged:?}");
    let state = writer.read(id).await.expect("read").unwrap_or_else(|| panic!("{id}: the acknowledged write was lost"));
    let winner = state.tree.winner().expect("a winner");
    assert_eq!(winner.deleted, deleted, "{id}: the write is the winner");
    assert!(!leaves(&state).contains(&named.to_owned()) && !leaves(&state).is_empty(), "{id}: {:?}", leaves(&state));
}

/// Whether the case applies; prints why not where the test server cannot purge.
fn purges(ctx: &Ctx) -> bool {
    if let Some(why) = &ctx.no_purge {
        println!("{}: not checked: {why}", ctx.backend_name);
    }
    ctx.no_purge.is_none()
}

/// The engine's layout: an edit of a live document landing inside the purge of its only leaf
/// survives it; the purge purges once nothing races it.
pub async fn a_write_inside_a_purge_of_a_live_document_survives(ctx: Ctx) {
    if !purges(&ctx) {
        return;
    }
    let (purging, writer, layer) = processes(&ctx, Kind::Engine);
    let first = edited(&writer, "live", edit(None, false, json!({"v": 1}))).await;
    arm(&layer, &writer, "live", edit(Some(&first), false, json!({"v": 2})));
    purge_meets_the_write(&purging, &writer, "live", &first, false).await;
    let winner = writer.read("live").await.expect("read").expect("live").tree.winner().expect("winner").rev();
    assert_eq!(purging.purge("live", std::slice::from_ref(&winner)).await.expect("purge"), vec![winner]);
    assert!(writer.read("live").await.expect("read").is_none(), "purged");
}

/// The engine's layout: a re-creation of a deleted document landing inside the purge of its
/// deleted leaf (the erasure of its tombstone) survives it.
pub async fn a_write_inside_a_purge_of_a_deleted_document_survives(ctx: Ctx) {
    if !purges(&ctx) {
        return;
    }
    let (purging, writer, layer) = processes(&ctx, Kind::Engine);
    let created = edited(&writer, "gone", edit(None, false, json!({"v": 1}))).await;
    let deletion = edited(&writer, "gone", edit(Some(&created), true, json!({}))).await;
    arm(&layer, &writer, "gone", edit(None, false, json!({"v": "again"})));
    purge_meets_the_write(&purging, &writer, "gone", &deletion, false).await;
}

/// The data-store database: an edit landing inside the purge of a document's last leaf survives
/// it (on the CouchDB backend, through its native layout: CouchDB's `_purge` of the leaf read).
pub async fn a_write_inside_a_data_store_purge_survives(ctx: Ctx) {
    if !purges(&ctx) {
        return;
    }
    let (purging, writer, layer) = processes(&ctx, Kind::DataStore);
    let only = id_of("u", "purge", "only");
    let first = edited(&writer, &only, edit(None, false, json!({"userId": "u", "namespace": "purge", "v": 1}))).await;
    let next = json!({"userId": "u", "namespace": "purge", "v": 2});
    arm(&layer, &writer, &only, edit(Some(&first), false, next));
    purge_meets_the_write(&purging, &writer, &only, &first, false).await;
}

/// The data-store database: an edit landing inside the purge of a conflicted document's winner
/// (its record erased and the next winner written in its place) survives it.
pub async fn a_write_inside_a_data_store_winner_purge_survives(ctx: Ctx) {
    if !purges(&ctx) {
        return;
    }
    if ctx.backend.keeps_branches() {
        println!("{}: not applicable: CouchDB purges a winner itself (`native.rs`)", ctx.backend_name);
        return;
    }
    let (purging, writer, layer) = processes(&ctx, Kind::DataStore);
    let conflicted = id_of("u", "purge", "conflicted");
    let fields = |v: i64| json!({"userId": "u", "namespace": "purge", "v": v});
    let first = edited(&writer, &conflicted, edit(None, false, fields(1))).await;
    let winner = edited(&writer, &conflicted, edit(Some(&first), false, fields(2))).await;
    let parent = first.split_once('-').expect("N-hash").1.to_owned();
    // A losing leaf beside the winner (the lowest revision id of its generation), which does
    // not descend from it: the purge erases the record and writes this leaf in its place.
    let loser = RevPath { start: 2, ids: vec![format!("{:0>32}", 1), parent] };
    let kept = Write::Replicated { path: loser, deleted: false, body: body(fields(0)) };
    writer.write(&conflicted, &kept).await.expect("a losing leaf");
    arm(&layer, &writer, &conflicted, edit(Some(&winner), false, fields(3)));
    purge_meets_the_write(&purging, &writer, &conflicted, &winner, false).await;
    let state = writer.read(&conflicted).await.expect("read").expect("kept");
    assert_eq!(state.tree.leaves().len(), 2, "the edit and the losing leaf: {:?}", leaves(&state));
}
