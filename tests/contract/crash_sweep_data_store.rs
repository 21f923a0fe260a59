//! The crash-point sweep of the data-store database's multi-step writes (issue 35 §1, the crash
//! windows of its tree layout; docs/design/crash-points.md, "The data-store layout"): each
//! replicated write that changes a document's other leaves (a new conflict, the promotion of a
//! leaf, an edit of a losing leaf, the deletion that resolves a conflict) is run through the
//! facade (a purge of a conflicted document's winner through the engine's data-store database) ([`DataStore::put_replicated`], what the CouchDB face's writes of the data-store
//! database call) over the crash layer (`crash.rs`) cut at its `k`-th backend call, for every `k`
//! until it runs uncut, both ways (the process stopped; the answer of call `k` lost).
//!
//! After each cut, over the backend without the layer ("restart"), the repair's trigger is made
//! (a read of the document's tree, as a replicator's `_revs_diff` of the leaf it sent does) and
//! the checks are:
//! - the tree is as before the write or as after it (as after it when it was acknowledged);
//! - the two faces agree: the record (what the REST API and the facade read) is the tree's
//!   winner, live or deleted alike, and the facade's `get` finds the document exactly when the
//!   winner is live;
//! - a document whose tree changed is in the change feed after the position read before the
//!   write (a replica that had read up to there learns every new leaf), and it is in
//!   `_all_docs` exactly when its winner is live;
//! - the feed's position did not go back;
//! - a document without a tree is one a creation would have made, cut before its answer, and no
//!   face finds it.
//!
//! The same checks serve the sweep of a data-store `_bulk_docs` (`crash_sweep_data_store_bulk.rs`).
//!
//! What a cut leaves is compared with a reference run of the same write, uncut, on another id:
//! the revisions are the same whatever the id.
//!
//! On the CouchDB backend, which keeps the trees itself, the data-store database is the engine's
//! over the native layout (`src/database/layout/native.rs`): each write is swept through it
//! (`Database::native_data_store`, `Write::Replicated`, what the CouchDB face's writes call
//! there), with the same checks. The purge of a conflicted document's winner is deselected there,
//! its reason printed: the native layout reaches the backend's `_purge` only through the erasure
//! of a document's last leaf.

use std::collections::BTreeMap;
use std::sync::Arc;

use agentstore::backend::{DocumentBackend, IdRange, Precondition, ReplicatedRevision, Revision};
use agentstore::database::layout::data_store;
use agentstore::database::rev_tree::RevPath;
use agentstore::database::{Database, Write};
use agentstore::store::{DataStore, StoreOptions};
use agentstore::Result;
use serde_json::{json, Map, Value};

use crate::common::body;
use crate::crash::{CrashLayer, Cut};
use crate::crash_sweep::{feed_ids, position_number};
use crate::document_model::id_of;
use crate::harness::Ctx;
use crate::replication::rev;

/// More backend calls than any swept write makes: a sweep that gets here never ends.
const MAX_CRASH_POINTS: usize = 100;

pub(crate) const USER: &str = "u";
pub(crate) const NAMESPACE: &str = "crash";

/// The writes swept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Operation {
    /// A replicated revision that loses to the winner: a new conflict.
    ReplicatedConflict,
    /// The winner of a conflicted document deleted: the other leaf is promoted.
    Promotion,
    /// A child of the losing leaf (a client's edit of a conflict): it becomes the winner.
    EditLosingLeaf,
    /// The losing leaf deleted: the conflict resolved.
    ResolveConflict,
    /// The winner of a conflicted document purged (`_purge` through the engine's data-store
    /// database): the losing leaf becomes the winner, the record erased and written anew.
    PurgeWinner,
}

/// One document as the checks compare it: its winner and every leaf with its body.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TreeSnapshot {
    pub(crate) winner: String,
    pub(crate) leaves: BTreeMap<String, (bool, Map<String, Value>)>,
}

/// A revision of the document `key` with `ancestry` (the revision first).
pub(crate) fn revision(key: &str, ancestry: &[String], deleted: bool, value: Value) -> ReplicatedRevision {
    ReplicatedRevision {
        rev: Revision(ancestry[0].clone()),
        ancestry: ancestry.to_vec(),
        deleted,
        body: if deleted { Map::new() } else { body(USER, NAMESPACE, key, value) },
        precondition: Precondition::None,
    }
}

pub(crate) async fn facade(backend: Arc<dyn DocumentBackend>) -> Result<DataStore> {
    DataStore::open(backend, StoreOptions { track_reads: false, ..StoreOptions::default() }).await
}

/// Writes the document `key` the operation starts from: a root, a winner extending it, and
/// (but for a new conflict) a losing leaf beside the winner.
async fn set_up(operation: Operation, store: &DataStore, key: &str) {
    let id = agentstore::model::DocumentId::parse(&id_of(USER, NAMESPACE, key)).expect("an id");
    let root = rev(1, 'a');
    store.put_replicated(&id, &revision(key, std::slice::from_ref(&root), false, json!(0))).await.expect("root");
    store.put_replicated(&id, &revision(key, &[rev(2, 'c'), root.clone()], false, json!("winner"))).await.expect("2-c");
    if operation != Operation::ReplicatedConflict {
        store.put_replicated(&id, &revision(key, &[rev(2, 'b'), root], false, json!("loser"))).await.expect("2-b");
    }
}

/// The write the operation makes.
fn incoming(operation: Operation, key: &str) -> ReplicatedRevision {
    let root = rev(1, 'a');
    match operation {
        Operation::ReplicatedConflict => revision(key, &[rev(2, 'b'), root], false, json!("loser")),
        Operation::Promotion => revision(key, &[rev(3, 'd'), rev(2, 'c'), root], true, Value::Null),
        Operation::EditLosingLeaf => revision(key, &[rev(3, 'e'), rev(2, 'b'), root], false, json!("edited")),
        Operation::ResolveConflict => revision(key, &[rev(3, 'f'), rev(2, 'b'), root], true, Value::Null),
        Operation::PurgeWinner => unreachable!("a purge writes no revision"),
    }
}

/// The write, through a facade over `backend` (through the engine's data-store database over
/// the native layout where the backend keeps the trees itself).
async fn run(operation: Operation, backend: Arc<dyn DocumentBackend>, key: &str) -> Result<()> {
    if backend.keeps_branches() {
        return run_native(operation, backend, key).await;
    }
    let store = facade(backend).await?;
    let id = agentstore::model::DocumentId::parse(&id_of(USER, NAMESPACE, key))?;
    if operation == Operation::PurgeWinner {
        // The CouchDB face's `_purge` of the data-store database: the engine's database over it.
        let database = Database::data_store(agentstore::model::COLLECTION.to_owned(), Arc::clone(store.backend()))?;
        return database.purge(id.as_str(), &[rev(2, 'c')]).await.map(drop);
    }
    store.put_replicated(&id, &incoming(operation, key)).await.map(drop)
}

/// The write through the engine's data-store database over the native layout.
async fn run_native(operation: Operation, backend: Arc<dyn DocumentBackend>, key: &str) -> Result<()> {
    let database = Database::native_data_store(agentstore::model::COLLECTION.to_owned(), backend)?;
    let id = id_of(USER, NAMESPACE, key);
    let revision = incoming(operation, key);
    let ids = revision.ancestry.iter().map(|rev| rev.split_once('-').map_or("", |(_, hash)| hash).to_owned());
    let generation = revision.rev.as_str().split_once('-').and_then(|(n, _)| n.parse().ok()).unwrap_or(0);
    let path = RevPath { start: generation, ids: ids.collect() };
    database.write(&id, &Write::Replicated { path, deleted: revision.deleted, body: revision.body }).await.map(drop)
}

/// The tree of `id` as the CouchDB face reads it (the read that triggers the repair).
pub(crate) async fn tree_snapshot(backend: &dyn DocumentBackend, id: &str) -> Option<TreeSnapshot> {
    let tree = data_store::revision_tree(backend, id).await.expect("revision_tree")?;
    // Without the key, which names the run: runs compare.
    let without_key = |body: &Map<String, Value>| {
        let mut body = body.clone();
        body.remove("key");
        body
    };
    let leaves = tree.leaves().into_iter().map(|leaf| (leaf.rev(), (leaf.deleted, without_key(&leaf.body)))).collect();
    Some(TreeSnapshot { winner: tree.winner().map(|leaf| leaf.rev()).unwrap_or_default(), leaves })
}

/// Every id in the change feed after `since`, once the backend's settle window has passed.
async fn fed_after(backend: &dyn DocumentBackend, since: &str) -> Vec<String> {
    tokio::time::sleep(backend.change_feed_delay()).await;
    let mut ids = Vec::new();
    let mut since = since.to_owned();
    for _ in 0..1000 {
        let page = backend.changes(Some(&since), 500).await.expect("changes");
        let empty = page.changes.is_empty();
        ids.extend(page.changes.into_iter().map(|change| change.id));
        if empty || page.pending == Some(0) {
            return ids;
        }
        since = page.last_seq;
    }
    panic!("the change feed did not end")
}

/// The states before and after the write, from the reference run.
pub(crate) struct Expected {
    pub(crate) before: Option<TreeSnapshot>,
    pub(crate) after: Option<TreeSnapshot>,
    /// What a tree read after a cut is compared as (`before` and `after` are already): itself
    /// here, where the sweep names every revision; the tree with the write's revisions named by
    /// their generation where a client's edit names them from a body holding the run's key
    /// (`crash_sweep_data_store_bulk.rs`).
    pub(crate) comparable: fn(TreeSnapshot) -> TreeSnapshot,
}

/// The checks after a cut (module doc): the violations found.
pub(crate) async fn check(
    backend: &Arc<dyn DocumentBackend>,
    key: &str,
    expected: &Expected,
    acknowledged: bool,
    position_before: &str,
) -> Vec<String> {
    let id = id_of(USER, NAMESPACE, key);
    let b = backend.as_ref();
    let mut violations = Vec::new();
    let Some(tree) = tree_snapshot(b, &id).await else {
        return check_absent(b, key, expected, acknowledged).await;
    };
    let now = Some((expected.comparable)(tree.clone()));
    if acknowledged && now != expected.after {
        violations.push(format!("{key}: acknowledged, but the tree reads {now:?}, not {:?}", expected.after));
    } else if now != expected.before && now != expected.after {
        violations
            .push(format!("{key}: half applied: {now:?}; before {:?}; after {:?}", expected.before, expected.after));
    }
    let winner_live = tree.leaves.get(&tree.winner).is_some_and(|(deleted, _)| !deleted);
    match b.revisions(&id).await.expect("revisions") {
        Some(record) if record.rev.as_str() == tree.winner && record.deleted != winner_live => {}
        Some(record) => violations.push(format!(
            "{key}: the faces disagree: the record is {} (deleted {}), the tree's winner {} (live {winner_live})",
            record.rev, record.deleted, tree.winner
        )),
        None => violations.push(format!("{key}: no record")),
    }
    let store = facade(Arc::clone(backend)).await.expect("the facade");
    let read = store.get(USER, NAMESPACE, key, None).await.expect("the facade's get");
    if read.is_some() != winner_live {
        violations
            .push(format!("{key}: the facade reads {:?}, the tree's winner is live {winner_live}", read.is_some()));
    }
    if now != expected.before && !fed_after(b, position_before).await.contains(&id) {
        violations.push(format!("{key}: its tree changed, but it is not in the change feed after {position_before}"));
    }
    if !feed_ids(b).await.contains(&id) {
        violations.push(format!("{key}: not in the change feed"));
    }
    let range = IdRange { start: Some(id.clone()), end: Some(id.clone()), ..IdRange::all() };
    let listed = b.all_docs(&range, 10, None).await.expect("all_docs").items.iter().any(|doc| doc.id == id);
    if listed != winner_live {
        violations.push(format!("{key}: listed in _all_docs {listed}, but its winner is live {winner_live}"));
    }
    let position_after = b.change_position().await.expect("change_position");
    if position_number(&position_after) < position_number(position_before) {
        violations.push(format!("the feed went back from {position_before} to {position_after}"));
    }
    violations
}

/// The checks of a document without a tree: right only for a creation cut before it was
/// acknowledged (nothing before the write, nothing after the cut), and then no face may find it.
async fn check_absent(
    backend: &dyn DocumentBackend,
    key: &str,
    expected: &Expected,
    acknowledged: bool,
) -> Vec<String> {
    if acknowledged || expected.before.is_some() {
        return vec![format!("{key}: no tree (acknowledged {acknowledged}; before {:?})", expected.before)];
    }
    let id = id_of(USER, NAMESPACE, key);
    let mut violations = Vec::new();
    if let Some(record) = backend.revisions(&id).await.expect("revisions") {
        violations.push(format!("{key}: no tree, but a record {} (deleted {})", record.rev, record.deleted));
    }
    let range = IdRange { start: Some(id.clone()), end: Some(id.clone()), ..IdRange::all() };
    if backend.all_docs(&range, 10, None).await.expect("all_docs").items.iter().any(|doc| doc.id == id) {
        violations.push(format!("{key}: no tree, but listed in _all_docs"));
    }
    violations
}

/// The position of the feed after everything written so far has settled.
pub(crate) async fn settled_position(backend: &dyn DocumentBackend) -> String {
    tokio::time::sleep(backend.change_feed_delay()).await;
    backend.change_position().await.expect("change_position")
}

/// How the sweep of one write went, one kind of cut: crash points, the steps of the uncut run,
/// violations.
async fn sweep(
    backend: &Arc<dyn DocumentBackend>,
    operation: Operation,
    cut: Cut,
    expected: &Expected,
) -> SweepOutcome {
    let plain = facade(Arc::clone(backend)).await.expect("the facade");
    let mut violations = Vec::new();
    for k in 0..MAX_CRASH_POINTS {
        let key = format!("{operation:?}-{cut:?}-{k}");
        set_up(operation, &plain, &key).await;
        let position_before = settled_position(backend.as_ref()).await;
        let layer = Arc::new(CrashLayer::new(Arc::clone(backend), k, cut));
        let answer = run(operation, layer.clone(), &key).await;
        layer.end();
        if !layer.cut_made() {
            if let Err(err) = &answer {
                panic!("{operation:?} failed uncut after {} calls: {err}", layer.calls());
            }
        }
        let found = check(backend, &key, expected, answer.is_ok(), &position_before).await;
        violations.extend(found.into_iter().map(|v| format!("{cut:?} at call {k}: {v}")));
        if !layer.cut_made() {
            return (k, layer.called(), violations);
        }
    }
    panic!("{operation:?} was still cut after {MAX_CRASH_POINTS} calls")
}

async fn reference(backend: &Arc<dyn DocumentBackend>, operation: Operation) -> Expected {
    let key = format!("{operation:?}-reference");
    let id = id_of(USER, NAMESPACE, &key);
    set_up(operation, &facade(Arc::clone(backend)).await.expect("the facade"), &key).await;
    let before = tree_snapshot(backend.as_ref(), &id).await;
    run(operation, Arc::clone(backend), &key).await.unwrap_or_else(|err| panic!("{operation:?} uncut: {err}"));
    let after = tree_snapshot(backend.as_ref(), &id).await;
    assert_ne!(before, after, "{operation:?} changes the tree");
    Expected { before, after, comparable: std::convert::identity }
}

async fn sweep_operation(ctx: Ctx, operation: Operation) {
    if ctx.backend.keeps_branches() && operation == Operation::PurgeWinner {
        println!(
            "native layout: crash_sweep_data_store_purge_winner: deselected: the native layout reaches the backend's \
             _purge only through the erasure of a document's last leaf"
        );
        return;
    }
    let expected = reference(&ctx.backend, operation).await;
    let mut sweeps = Vec::new();
    for cut in [Cut::Stop, Cut::LoseAnswer] {
        sweeps.push((cut, sweep(&ctx.backend, operation, cut, &expected).await));
    }
    report(ctx.backend_name, &format!("{operation:?}"), sweeps);
}

/// What one cut's sweep found: crash points, the uncut run's backend calls, violations.
pub(crate) type SweepOutcome = (usize, Vec<&'static str>, Vec<String>);

/// Prints each cut's sweep of `operation` on `backend` and fails with every violation found.
pub(crate) fn report(backend: &str, operation: &str, sweeps: Vec<(Cut, SweepOutcome)>) {
    let mut failures = Vec::new();
    for (cut, (crash_points, steps, violations)) in sweeps {
        println!(
            "crash sweep (data store): {backend} {operation} {cut:?}: {crash_points} crash points, {} violations; steps: {}",
            violations.len(),
            steps.join(" ")
        );
        failures.extend(violations);
    }
    assert!(
        failures.is_empty(),
        "crash sweep (data store): {backend} {operation}: violations:\n  {}",
        failures.join("\n  ")
    );
}

pub async fn crash_sweep_data_store_conflict(ctx: Ctx) {
    sweep_operation(ctx, Operation::ReplicatedConflict).await
}

pub async fn crash_sweep_data_store_promotion(ctx: Ctx) {
    sweep_operation(ctx, Operation::Promotion).await
}

pub async fn crash_sweep_data_store_edit_losing_leaf(ctx: Ctx) {
    sweep_operation(ctx, Operation::EditLosingLeaf).await
}

pub async fn crash_sweep_data_store_resolve_conflict(ctx: Ctx) {
    sweep_operation(ctx, Operation::ResolveConflict).await
}

pub async fn crash_sweep_data_store_purge_winner(ctx: Ctx) {
    sweep_operation(ctx, Operation::PurgeWinner).await
}
