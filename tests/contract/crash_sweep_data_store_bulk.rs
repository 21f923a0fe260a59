//! The crash-point sweep of a `_bulk_docs` on the data-store database (issue 38 follow-up;
//! docs/design/crash-points.md, "The data-store layout", the `_bulk_docs` row): one request
//! through the engine's data-store database ([`Database::write_many`], what the CouchDB face's
//! `_bulk_docs` calls) mixing every kind of save it groups:
//! - two creations and a plain edit and a deletion, each one write of the record: together in
//!   the one batched record write (`put_replicated_leaves`; one transaction on the embedded
//!   store, one `put_replicated` per document elsewhere);
//! - an edit of a losing leaf (its child wins over the old winner, which goes among the other
//!   leaves): a save that changes the side document, made alone in its three steps after the
//!   batched write.
//!
//! The request runs over the crash layer (`crash.rs`) cut at its `k`-th backend call, for every
//! `k` until it runs uncut, both ways (the process stopped; the answer of call `k` lost). After
//! each cut, over the backend without the layer, every document is checked as
//! `crash_sweep_data_store.rs` checks one ([`check`]): as before the request or as after it (as
//! after it when its answer in the request was a success), the record and the tree's winner
//! agree, the facade finds it exactly when its winner is live, a document whose tree changed is
//! in the change feed after the position read before the request, `_all_docs` lists it exactly
//! when live, and the feed's position did not go back.
//!
//! What a cut leaves is compared with a reference run of the same request, uncut, on other ids.
//! A client's edit is named by a hash of its parent and body (`database::rev_id`; in front of
//! pouchdb-server, the CouchDB backend's test server, of its id too), and a data-store body holds
//! its key: each run's request makes revisions of other names. So the trees are compared with the
//! revisions the request made named by their generation alone ([`by_generation`]; each document
//! gets one), bodies and the set-up's revisions as they are.
//!
//! On the CouchDB backend, which keeps the trees itself, the data-store database is the engine's
//! over the native layout ([`Database::native_data_store`]): the creations go in one
//! `_bulk_docs` and every other edit is CouchDB's own write; the same request is swept through
//! it with the same checks.

use std::collections::BTreeMap;
use std::sync::Arc;

use agentstore::backend::DocumentBackend;
use agentstore::database::{Database, Write};
use agentstore::model::DocumentId;
use agentstore::Result;
use serde_json::{json, Map, Value};

use crate::common::body;
use crate::crash::{CrashLayer, Cut};
use crate::crash_sweep_data_store::{
    check, facade, report, revision, settled_position, tree_snapshot, Expected, SweepOutcome, TreeSnapshot, NAMESPACE,
    USER,
};
use crate::document_model::id_of;
use crate::harness::Ctx;
use crate::replication::rev;

/// More backend calls than the swept request makes: a sweep that gets here never ends.
const MAX_CRASH_POINTS: usize = 100;

/// The documents of the request, by the save each one's write is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Role {
    /// A new document (`MustNotExist`): in the batched record write.
    FirstCreation,
    /// Another new document, in the same batched write.
    SecondCreation,
    /// An edit of the winner of a document without conflicts: in the batched write.
    PlainEdit,
    /// An edit of a conflicted document's losing leaf: its side document changes, so it is
    /// saved alone after the batched write.
    EditLosingLeaf,
    /// The deletion of a document without conflicts: in the batched write.
    Deletion,
}

/// The roles in the order the request names their documents.
const ROLES: [Role; 5] =
    [Role::FirstCreation, Role::SecondCreation, Role::PlainEdit, Role::EditLosingLeaf, Role::Deletion];

impl Role {
    /// The name of this role's document, in its key.
    fn name(self) -> &'static str {
        match self {
            Role::FirstCreation => "first-creation",
            Role::SecondCreation => "second-creation",
            Role::PlainEdit => "plain-edit",
            Role::EditLosingLeaf => "edit-losing-leaf",
            Role::Deletion => "deletion",
        }
    }

    /// The key of this role's document in the run named `run`.
    fn key(self, run: &str) -> String {
        format!("bulk-{run}-{}", self.name())
    }

    /// The write of this role's document in the run named `run` (a client's `_bulk_docs`,
    /// `new_edits: true`).
    fn write(self, run: &str) -> Write {
        let key = self.key(run);
        let seed = |value: Value| body(USER, NAMESPACE, &key, value);
        match self {
            Role::FirstCreation => Write::Edit { parent: None, deleted: false, body: seed(json!("first")) },
            Role::SecondCreation => Write::Edit { parent: None, deleted: false, body: seed(json!("second")) },
            Role::PlainEdit => Write::Edit { parent: Some(rev(2, 'c')), deleted: false, body: seed(json!("edited")) },
            Role::EditLosingLeaf => {
                Write::Edit { parent: Some(rev(2, 'b')), deleted: false, body: seed(json!("loser edited")) }
            }
            Role::Deletion => Write::Edit { parent: Some(rev(2, 'c')), deleted: true, body: Map::new() },
        }
    }
}

/// Writes what each document of the run starts from: nothing for a creation; a root and a
/// winner extending it for the plain edit and the deletion; and beside that winner a losing
/// leaf for the edit of the losing leaf.
async fn set_up(backend: &Arc<dyn DocumentBackend>, run: &str) {
    let store = facade(Arc::clone(backend)).await.expect("the facade");
    for role in [Role::PlainEdit, Role::EditLosingLeaf, Role::Deletion] {
        let key = role.key(run);
        let id = DocumentId::parse(&id_of(USER, NAMESPACE, &key)).expect("an id");
        let root = rev(1, 'a');
        store.put_replicated(&id, &revision(&key, std::slice::from_ref(&root), false, json!(0))).await.expect("root");
        let winner = revision(&key, &[rev(2, 'c'), root.clone()], false, json!("winner"));
        store.put_replicated(&id, &winner).await.expect("2-c");
        if role == Role::EditLosingLeaf {
            let loser = revision(&key, &[rev(2, 'b'), root], false, json!("loser"));
            store.put_replicated(&id, &loser).await.expect("2-b");
        }
    }
}

/// The engine's data-store database over `backend` (over the native layout where the backend
/// keeps the trees itself).
fn database(backend: Arc<dyn DocumentBackend>) -> Result<Database> {
    let name = agentstore::model::COLLECTION.to_owned();
    if backend.keeps_branches() {
        Database::native_data_store(name, backend)
    } else {
        Database::data_store(name, backend)
    }
}

/// The request, through the engine's data-store database over `backend`: which documents it
/// acknowledged (every write of the document answered with success).
async fn run(backend: Arc<dyn DocumentBackend>, name: &str) -> Result<BTreeMap<Role, bool>> {
    let documents: Vec<(String, Vec<Write>)> =
        ROLES.iter().map(|role| (id_of(USER, NAMESPACE, &role.key(name)), vec![role.write(name)])).collect();
    let answers = database(backend)?.write_many(&documents).await?;
    Ok(ROLES
        .iter()
        .zip(answers)
        .map(|(role, answer)| (*role, answer.is_ok_and(|writes| writes.iter().all(Result::is_ok))))
        .collect())
}

/// `snapshot` with the revisions the request made named by their generation alone, the set-up's
/// (which the sweep names) kept: what runs on other ids compare (module doc).
fn by_generation(snapshot: TreeSnapshot) -> TreeSnapshot {
    let set_up = [rev(1, 'a'), rev(2, 'b'), rev(2, 'c')];
    let named = |revision: &str| match set_up.iter().any(|known| known == revision) {
        true => revision.to_owned(),
        false => {
            format!("{}-made by the request", revision.split_once('-').map_or(revision, |(generation, _)| generation))
        }
    };
    let winner = named(&snapshot.winner);
    let leaves = snapshot.leaves.into_iter().map(|(revision, leaf)| (named(&revision), leaf)).collect();
    TreeSnapshot { winner, leaves }
}

/// The states before and after the request of every document, from an uncut run.
async fn reference(backend: &Arc<dyn DocumentBackend>) -> BTreeMap<Role, Expected> {
    let name = "reference";
    set_up(backend, name).await;
    let mut before = BTreeMap::new();
    for role in ROLES {
        let snapshot = tree_snapshot(backend.as_ref(), &id_of(USER, NAMESPACE, &role.key(name))).await;
        before.insert(role, snapshot.map(by_generation));
    }
    let acknowledged = run(Arc::clone(backend), name).await.unwrap_or_else(|err| panic!("_bulk_docs uncut: {err}"));
    assert!(acknowledged.values().all(|ok| *ok), "_bulk_docs uncut: not every document acknowledged: {acknowledged:?}");
    let mut expected = BTreeMap::new();
    for (role, before) in before {
        let after = tree_snapshot(backend.as_ref(), &id_of(USER, NAMESPACE, &role.key(name))).await.map(by_generation);
        assert_ne!(before, after, "{role:?}: the request changes the tree");
        expected.insert(role, Expected { before, after, comparable: by_generation });
    }
    expected
}

/// How the sweep went, one kind of cut: crash points, the steps of the uncut run, violations.
async fn sweep(backend: &Arc<dyn DocumentBackend>, cut: Cut, expected: &BTreeMap<Role, Expected>) -> SweepOutcome {
    let mut violations = Vec::new();
    for k in 0..MAX_CRASH_POINTS {
        let name = format!("{cut:?}-{k}");
        set_up(backend, &name).await;
        let position_before = settled_position(backend.as_ref()).await;
        let layer = Arc::new(CrashLayer::new(Arc::clone(backend), k, cut));
        let answer = run(layer.clone(), &name).await;
        layer.end();
        let acknowledged = match answer {
            Ok(acknowledged) => acknowledged,
            // Cut short as a whole: no document acknowledged.
            Err(_) if layer.cut_made() => BTreeMap::new(),
            Err(err) => panic!("_bulk_docs failed uncut after {} calls: {err}", layer.calls()),
        };
        if !layer.cut_made() && !acknowledged.values().all(|ok| *ok) {
            panic!("_bulk_docs uncut did not acknowledge every document: {acknowledged:?}");
        }
        for role in ROLES {
            let acknowledged = acknowledged.get(&role).copied().unwrap_or(false);
            let found = check(backend, &role.key(&name), &expected[&role], acknowledged, &position_before).await;
            violations.extend(found.into_iter().map(|v| format!("{cut:?} at call {k}: {role:?}: {v}")));
        }
        if !layer.cut_made() {
            return (k, layer.called(), violations);
        }
    }
    panic!("_bulk_docs was still cut after {MAX_CRASH_POINTS} calls")
}

pub async fn crash_sweep_data_store_bulk_docs(ctx: Ctx) {
    let expected = reference(&ctx.backend).await;
    let mut sweeps = Vec::new();
    for cut in [Cut::Stop, Cut::LoseAnswer] {
        sweeps.push((cut, sweep(&ctx.backend, cut, &expected).await));
    }
    report(ctx.backend_name, "BulkDocs", sweeps);
}
