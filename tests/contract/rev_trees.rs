//! A CouchDB database's documents on every backend ([`agentstore::database::Database`] over the
//! fresh backend): every leaf of a revision tree kept with its body, CouchDB's winner, deletion
//! and re-creation, the feed moving on every change to a tree, concurrent writers losing
//! nothing, purge, and design documents listed; a replicator's page written in a few batched
//! calls, and its creates never written over a tombstone another writer left meanwhile.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use agentstore::backend::raw::layer::Layered;
use agentstore::backend::{BulkWrite, DocumentBackend, IdRange, Precondition, Revision, StoredDocument};
use agentstore::database::rev_tree::RevPath;
use agentstore::database::{Database, Write, Written};
use agentstore::ErrorKind;
use futures::future::join_all;
use serde_json::{json, Map, Value};

use crate::common::corpus;
use crate::common::json::{first_difference, has_non_double_fraction, survives_f64};
use crate::harness::Ctx;

fn db(ctx: &Ctx) -> Arc<Database> {
    Arc::new(Database::new("contract".into(), Arc::clone(&ctx.backend)))
}

fn body(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        other => panic!("expected an object, got {other}"),
    }
}

fn edit(parent: Option<&str>, value: Value) -> Write {
    Write::Edit { parent: parent.map(str::to_owned), deleted: false, body: body(value) }
}

fn replicated(start: u64, ids: &[&str], deleted: bool, value: Value) -> Write {
    let path = RevPath { start, ids: ids.iter().map(|id| id.to_string()).collect() };
    Write::Replicated { path, deleted, body: body(value) }
}

async fn edited(db: &Database, id: &str, write: Write) -> String {
    match db.write(id, &write).await.expect("write") {
        Written::Edited(rev) => rev,
        other => panic!("an edit answered {other:?}"),
    }
}

fn leaf_revs(db_state: &agentstore::database::DocState) -> Vec<String> {
    db_state.tree.leaves().into_iter().map(|leaf| leaf.path.leaf_rev()).collect()
}

/// Edits make a linear history; an edit from a stale or missing revision is a conflict
/// (CouchDB's 409), and the winner is what a read returns.
pub async fn edits_make_a_history_and_stale_edits_conflict(ctx: Ctx) {
    let db = db(&ctx);
    let first = edited(&db, "doc", edit(None, json!({"v": 1}))).await;
    assert!(first.starts_with("1-"), "{first}");
    let second = edited(&db, "doc", edit(Some(&first), json!({"v": 2}))).await;
    assert!(second.starts_with("2-"), "{second}");
    for stale in [Some(first.as_str()), None] {
        let err = db.write("doc", &edit(stale, json!({"v": 3}))).await.expect_err("stale edit");
        assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    }
    let state = db.read("doc").await.expect("read").expect("exists");
    let winner = state.tree.winner().expect("winner");
    assert_eq!((winner.path.leaf_rev(), winner.body.get("v")), (second.clone(), Some(&json!(2))));
    assert_eq!(winner.path.revs(), vec![second, first], "the winner's path names both revisions");
}

/// Replicated branches are all kept with their bodies; CouchDB's winner (higher generation,
/// then higher id) is the same whatever order they arrive in; deleting the losing leaf resolves
/// the conflict.
pub async fn replicated_branches_are_kept_and_conflicts_resolve_by_deletion(ctx: Ctx) {
    let db = db(&ctx);
    db.write("a", &replicated(1, &["x"], false, json!({"at": 1}))).await.expect("root");
    db.write("a", &replicated(2, &["b", "x"], false, json!({"branch": "b"}))).await.expect("branch b");
    db.write("a", &replicated(2, &["c", "x"], false, json!({"branch": "c"}))).await.expect("branch c");
    let again = db.write("a", &replicated(2, &["c", "x"], false, json!({"branch": "c"}))).await.expect("again");
    assert_eq!(again, Written::Merged(agentstore::database::rev_tree::MergeOutcome::AlreadyKnown));
    let state = db.read("a").await.expect("read").expect("exists");
    assert_eq!(leaf_revs(&state), vec!["2-c".to_owned(), "2-b".to_owned()], "winner first: 2-c beats 2-b");
    assert_eq!(state.tree.conflicts(), vec!["2-b".to_owned()]);
    assert_eq!(state.tree.leaf("2-b").map(|leaf| leaf.body.clone()), Some(body(json!({"branch": "b"}))));
    // The other order on a second document gives the same winner.
    db.write("b", &replicated(2, &["c", "x"], false, json!({"branch": "c"}))).await.expect("c first");
    db.write("b", &replicated(2, &["b", "x"], false, json!({"branch": "b"}))).await.expect("b second");
    let other = db.read("b").await.expect("read").expect("exists");
    assert_eq!(other.winner_rev().as_deref(), Some("2-c"));
    // Deleting the losing leaf leaves one live leaf.
    let deletion = Write::Edit { parent: Some("2-b".into()), deleted: true, body: Map::new() };
    edited(&db, "a", deletion).await;
    let resolved = db.read("a").await.expect("read").expect("exists");
    assert!(resolved.tree.conflicts().is_empty(), "{:?}", resolved.tree.conflicts());
    assert_eq!(resolved.winner_rev().as_deref(), Some("2-c"));
    assert_eq!(resolved.tree.deleted_conflicts().len(), 1);
}

/// A deleted document keeps its tree (a deleted leaf's body too); listings leave it out, the
/// feed reports it deleted, and writing it again continues its history.
pub async fn deleted_documents_keep_their_tree_and_come_back(ctx: Ctx) {
    let db = db(&ctx);
    let first = edited(&db, "gone", edit(None, json!({"v": 1}))).await;
    let deletion = Write::Edit { parent: Some(first.clone()), deleted: true, body: body(json!({"why": "done"})) };
    let deleted_rev = edited(&db, "gone", deletion).await;
    let state = db.read("gone").await.expect("read").expect("a tombstone is still read");
    assert!(state.deleted());
    let winner = state.tree.winner().expect("winner");
    assert_eq!((winner.path.leaf_rev(), winner.body.get("why")), (deleted_rev.clone(), Some(&json!("done"))));
    let listed = db.all_docs(&IdRange::all(), 10, None).await.expect("all_docs");
    assert!(listed.items.iter().all(|(id, _)| id != "gone"), "a deleted document is not listed");
    let changes = ctx.backend.changes(None, 100).await.expect("changes");
    let change = changes.changes.iter().find(|c| c.id == "gone").expect("in the feed");
    assert!(change.deleted);
    // Written again without a revision: generation 3, on top of the deletion.
    let back = edited(&db, "gone", edit(None, json!({"v": 3}))).await;
    assert!(back.starts_with("3-"), "{back}");
    let state = db.read("gone").await.expect("read").expect("exists");
    assert!(!state.deleted());
    assert_eq!(state.tree.winner().expect("winner").path.revs(), vec![back, deleted_rev, first]);
}

/// Every change to a tree moves the document in the feed, also one that leaves it deleted (a
/// replicator downstream must see the new leaf).
pub async fn every_tree_change_moves_the_document_in_the_feed(ctx: Ctx) {
    let db = db(&ctx);
    db.write("d", &replicated(1, &["a"], true, json!({}))).await.expect("arrives deleted");
    let after_first = ctx.backend.change_position().await.expect("position");
    db.write("d", &replicated(1, &["b"], true, json!({}))).await.expect("another deleted leaf");
    let later = ctx.backend.changes(Some(&after_first), 100).await.expect("changes");
    assert!(later.changes.iter().any(|c| c.id == "d" && c.deleted), "{:?}", later.changes);
    let state = db.read("d").await.expect("read").expect("exists");
    assert_eq!(state.tree.leaves().len(), 2);
    assert!(state.deleted());
}

/// Writers racing on one document lose nothing: every replicated branch ends up a leaf.
pub async fn concurrent_writers_of_one_tree_lose_nothing(ctx: Ctx) {
    let db = db(&ctx);
    db.write("hot", &replicated(1, &["root"], false, json!({}))).await.expect("root");
    let writers = (0..12).map(|n| {
        let db = Arc::clone(&db);
        async move {
            let id = format!("w{n:02}");
            db.write("hot", &replicated(2, &[id.as_str(), "root"], false, json!({"n": n}))).await
        }
    });
    for result in join_all(writers).await {
        result.expect("each write lands");
    }
    let state = db.read("hot").await.expect("read").expect("exists");
    let leaves: BTreeSet<String> = leaf_revs(&state).into_iter().collect();
    let expected: BTreeSet<String> = (0..12).map(|n| format!("2-w{n:02}")).collect();
    assert_eq!(leaves, expected);
}

/// Writers racing on a deleted document, and writers deleting every leaf of a document at once,
/// lose nothing either: the tombstone's tree and the last deletions are serialized like live
/// writes.
pub async fn concurrent_writers_of_deleted_trees_lose_nothing(ctx: Ctx) {
    let db = db(&ctx);
    db.write("gone", &replicated(1, &["root"], true, json!({}))).await.expect("arrives deleted");
    let writers = (0..12).map(|n| {
        let db = Arc::clone(&db);
        async move {
            let id = format!("d{n:02}");
            db.write("gone", &replicated(2, &[id.as_str(), "root"], true, json!({"n": n}))).await
        }
    });
    for result in join_all(writers).await {
        result.expect("each deleted branch lands");
    }
    let state = db.read("gone").await.expect("read").expect("exists");
    assert!(state.deleted());
    let leaves: BTreeSet<String> = leaf_revs(&state).into_iter().collect();
    assert_eq!(leaves, (0..12).map(|n| format!("2-d{n:02}")).collect::<BTreeSet<_>>());

    for n in 0..12 {
        db.write("many", &replicated(1, &[&format!("l{n:02}")], false, json!({"n": n}))).await.expect("leaf");
    }
    let deleters = (0..12).map(|n| {
        let db = Arc::clone(&db);
        async move {
            let deletion = Write::Edit { parent: Some(format!("1-l{n:02}")), deleted: true, body: Map::new() };
            db.write("many", &deletion).await
        }
    });
    let mut deletions = BTreeSet::new();
    for result in join_all(deleters).await {
        match result.expect("each deletion lands") {
            Written::Edited(rev) => deletions.insert(rev),
            other => panic!("a deletion answered {other:?}"),
        };
    }
    let state = db.read("many").await.expect("read").expect("exists");
    assert!(state.deleted(), "every leaf deleted");
    assert_eq!(leaf_revs(&state).into_iter().collect::<BTreeSet<_>>(), deletions);
    let listed = db.all_docs(&IdRange::all(), 10, None).await.expect("all_docs");
    assert!(listed.items.iter().all(|(id, _)| id != "many" && id != "gone"));
}

/// Purging a leaf removes it for good; purging the last leaf removes the document.
pub async fn purge_removes_leaves_and_documents(ctx: Ctx) {
    let db = db(&ctx);
    if let Some(why) = &ctx.no_purge {
        println!("purge of whole documents not checked on {}: {why}", ctx.backend_name);
    }
    db.write("p", &replicated(1, &["a"], false, json!({"a": 1}))).await.expect("a");
    db.write("p", &replicated(1, &["b"], false, json!({"b": 1}))).await.expect("b");
    let purged = db.purge("p", &["1-b".to_owned(), "9-zz".to_owned()]).await.expect("purge");
    assert_eq!(purged, vec!["1-b".to_owned()]);
    let state = db.read("p").await.expect("read").expect("exists");
    assert_eq!(leaf_revs(&state), vec!["1-a".to_owned()]);
    if ctx.no_purge.is_none() {
        db.purge("p", &["1-a".to_owned()]).await.expect("purge the last leaf");
        assert!(db.read("p").await.expect("read").is_none(), "nothing of the document is left");
    }
}

/// Design documents are documents of a database: listed by `all_docs` with `include_design`.
pub async fn design_documents_are_listed(ctx: Ctx) {
    let db = db(&ctx);
    edited(&db, "_design/app", edit(None, json!({"views": {}}))).await;
    edited(&db, "plain", edit(None, json!({}))).await;
    let range = IdRange { include_design: true, ..IdRange::all() };
    let listed = db.all_docs(&range, 10, None).await.expect("all_docs");
    let ids: Vec<&str> = listed.items.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids, vec!["_design/app", "plain"]);
}

/// A backend that counts the calls a database makes to it, by name.
struct CountingCalls {
    inner: Arc<dyn DocumentBackend>,
    calls: Mutex<BTreeMap<&'static str, usize>>,
}

impl CountingCalls {
    fn count(&self, call: &'static str) {
        *self.calls.lock().unwrap_or_else(|e| e.into_inner()).entry(call).or_default() += 1;
    }

    fn taken(&self) -> BTreeMap<&'static str, usize> {
        std::mem::take(&mut *self.calls.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

#[async_trait::async_trait]
impl Layered for CountingCalls {
    fn inner(&self) -> &dyn DocumentBackend {
        self.inner.as_ref()
    }

    async fn get(&self, id: &str) -> agentstore::Result<Option<StoredDocument>> {
        self.count("get");
        self.inner.get(id).await
    }

    async fn get_many(&self, ids: &[String]) -> agentstore::Result<Vec<Option<StoredDocument>>> {
        self.count("get_many");
        self.inner.get_many(ids).await
    }

    async fn get_local(&self, name: &str) -> agentstore::Result<Option<StoredDocument>> {
        self.count("get_local");
        self.inner.get_local(name).await
    }

    async fn get_many_local(&self, names: &[String]) -> agentstore::Result<Vec<Option<StoredDocument>>> {
        self.count("get_many_local");
        self.inner.get_many_local(names).await
    }

    async fn get_deleted(&self, id: &str) -> agentstore::Result<Option<StoredDocument>> {
        self.count("get_deleted");
        self.inner.get_deleted(id).await
    }

    async fn put(
        &self,
        id: &str,
        body: &Map<String, Value>,
        precondition: Precondition,
    ) -> agentstore::Result<Revision> {
        self.count("put");
        self.inner.put(id, body, precondition).await
    }

    async fn put_local(
        &self,
        name: &str,
        body: &Map<String, Value>,
        precondition: Precondition,
    ) -> agentstore::Result<Revision> {
        self.count("put_local");
        self.inner.put_local(name, body, precondition).await
    }

    async fn delete(&self, id: &str, rev: &Revision) -> agentstore::Result<Revision> {
        self.count("delete");
        self.inner.delete(id, rev).await
    }

    async fn bulk_write(&self, writes: Vec<BulkWrite>) -> agentstore::Result<Vec<agentstore::Result<Revision>>> {
        self.count("bulk_write");
        self.inner.bulk_write(writes).await
    }
}

/// A replicator's page (`Database::write_many`) of new documents, re-creations over tombstones
/// and a live document's new leaf costs two batched reads and one bulk write, plus a local tree
/// written for each re-creation (and, on a backend that cannot check `NeverWritten`, for each
/// new document too), and on a backend other processes share the database's settings read once:
/// never a read per document. Every document is stored as sent.
pub async fn a_page_of_new_documents_is_written_in_a_few_batched_calls(ctx: Ctx) {
    let layer = Arc::new(CountingCalls { inner: Arc::clone(&ctx.backend), calls: Mutex::default() });
    let db = Database::new("contract".into(), layer.clone());
    for n in 0..2 {
        let id = format!("back-{n}");
        db.write(&id, &replicated(1, &["a"], false, json!({}))).await.expect("created");
        db.write(&id, &replicated(2, &["d", "a"], true, json!({}))).await.expect("deleted");
    }
    db.write("live", &replicated(1, &["a"], false, json!({}))).await.expect("created");
    let mut page: Vec<(String, Vec<Write>)> = (0..20)
        .map(|n| {
            let first = replicated(2, &["b", "a"], false, json!({"n": n}));
            (format!("new-{n:02}"), vec![first, replicated(2, &["c", "a"], false, json!({"other": n}))])
        })
        .collect();
    for id in ["back-0", "back-1", "live"] {
        page.push((id.to_owned(), vec![replicated(2, &["e", "a"], false, json!({"again": id}))]));
    }
    layer.taken();
    let answers = db.write_many(&page).await.expect("write_many");
    for ((id, _), answer) in page.iter().zip(&answers) {
        let answer = answer.as_ref().unwrap_or_else(|e| panic!("{id}: {e}"));
        assert!(answer.iter().all(|a| matches!(a, Ok(Written::Merged(_)))), "{id}: {answer:?}");
    }
    let local_trees = if ctx.backend.checks_never_written() { 2 } else { 22 };
    let mut expected: BTreeMap<&str, usize> =
        [("bulk_write", 1), ("get_many", 1), ("get_many_local", 1), ("put_local", local_trees)].into();
    if ctx.backend.shared_with_other_processes() {
        // `_revs_limit`, read once per page where another instance may have changed it.
        expected.insert("get_local", 1);
    }
    assert_eq!(layer.taken(), expected);
    for n in 0..20 {
        let state = db.read(&format!("new-{n:02}")).await.expect("read").expect("written");
        assert_eq!(leaf_revs(&state).into_iter().collect::<BTreeSet<_>>(), ["2-b", "2-c"].map(String::from).into());
        assert!(!state.deleted());
    }
    for id in ["back-0", "back-1"] {
        let state = db.read(id).await.expect("read").expect("written");
        assert_eq!(leaf_revs(&state).into_iter().collect::<BTreeSet<_>>(), ["2-d", "2-e"].map(String::from).into());
        assert!(!state.deleted(), "{id} is back");
    }
    let listed = db.all_docs(&IdRange::all(), 100, None).await.expect("all_docs");
    assert_eq!(listed.items.len(), 23, "every document of the page is listed live");
}

/// A backend on which another writer creates `target` and deletes it again just before the
/// next bulk write lands, leaving a tombstone where a page read nothing.
struct TombstoneMeanwhile {
    inner: Arc<dyn DocumentBackend>,
    target: &'static str,
    armed: AtomicBool,
}

#[async_trait::async_trait]
impl Layered for TombstoneMeanwhile {
    fn inner(&self) -> &dyn DocumentBackend {
        self.inner.as_ref()
    }

    async fn bulk_write(&self, writes: Vec<BulkWrite>) -> agentstore::Result<Vec<agentstore::Result<Revision>>> {
        if self.armed.swap(false, Ordering::SeqCst) {
            let other = Database::new("contract".into(), Arc::clone(&self.inner));
            other.write(self.target, &replicated(1, &["o1"], false, json!({"by": "other"}))).await?;
            other.write(self.target, &replicated(2, &["o2", "o1"], true, json!({}))).await?;
        }
        self.inner.bulk_write(writes).await
    }
}

/// A page's create of an id it read as never written, over which another writer left a
/// tombstone meanwhile, does not write over it: both writers' leaves are kept.
pub async fn a_tombstone_left_during_a_page_is_not_written_over(ctx: Ctx) {
    let layer = Arc::new(TombstoneMeanwhile { inner: Arc::clone(&ctx.backend), target: "raced", armed: true.into() });
    let db = Database::new("contract".into(), layer.clone());
    let page = vec![
        ("raced".to_owned(), vec![replicated(1, &["m1"], false, json!({"by": "me"}))]),
        ("calm".to_owned(), vec![replicated(1, &["c1"], false, json!({}))]),
    ];
    let answers = db.write_many(&page).await.expect("write_many");
    assert!(answers.iter().all(|a| a.as_ref().is_ok_and(|a| a.iter().all(Result::is_ok))), "{answers:?}");
    assert!(!layer.armed.load(Ordering::SeqCst), "the other writer wrote");
    let state = db.read("raced").await.expect("read").expect("written");
    let mut leaves: Vec<(String, bool)> = state.tree.leaves().iter().map(|l| (l.path.leaf_rev(), l.deleted)).collect();
    leaves.sort();
    assert_eq!(leaves, [("1-m1".to_owned(), false), ("2-o2".to_owned(), true)]);
    assert!(!state.deleted());
    let listed = db.all_docs(&IdRange::all(), 10, None).await.expect("all_docs");
    let ids: Vec<&str> = listed.items.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids, ["calm", "raced"]);
}

/// Every value of the round-trip corpus, in documents the engine writes (each record's JSON
/// written straight from its tree): created and edited one at a time, and created and edited in
/// pages (`write_many`), reads back exactly. The CouchDB adapter refuses numbers CouchDB would
/// change, and a JavaScript server keeps only doubles: those values are not written there.
pub async fn the_value_corpus_round_trips_in_documents(ctx: Ctx) {
    let db = db(&ctx);
    let kept = |value: &Value| {
        !(ctx.backend_name == "couchdb" && has_non_double_fraction(value))
            && (ctx.inexact_numbers.is_none() || survives_f64(value))
    };
    let cases: Vec<corpus::Case> = corpus::cases().into_iter().filter(|case| kept(&case.value)).collect();
    assert!(cases.len() >= 20, "{} cases kept", cases.len());
    let mut page_creations = Vec::new();
    for case in &cases {
        let id = format!("one-{}", case.name);
        let first = edited(&db, &id, edit(None, json!({"value": case.value}))).await;
        edited(&db, &id, edit(Some(&first), json!({"value": case.value, "edited": true}))).await;
        page_creations.push((format!("page-{}", case.name), vec![edit(None, json!({"value": case.value}))]));
    }
    let answers = db.write_many(&page_creations).await.expect("a page of creations");
    let mut page_edits = Vec::new();
    for ((id, _), answer) in page_creations.iter().zip(answers) {
        let rev = match answer.expect("written").pop().expect("answered").expect("created") {
            Written::Edited(rev) => rev,
            other => panic!("{id}: a creation answered {other:?}"),
        };
        page_edits.push((id.clone(), vec![edit(Some(&rev), json!({"value": case_value(&db, id).await}))]));
    }
    for answer in db.write_many(&page_edits).await.expect("a page of edits") {
        assert!(answer.expect("written").iter().all(Result::is_ok), "every edit of the page written");
    }
    for case in &cases {
        for id in [format!("one-{}", case.name), format!("page-{}", case.name)] {
            let state = db.read(&id).await.expect("read").expect("written");
            assert_eq!(state.tree.winner().expect("a winner").path.start, 2, "{id}: edited");
            if let Some(diff) = first_difference(&case.value, &case_value(&db, &id).await) {
                panic!("{id}: reads back differently: {diff}");
            }
        }
    }
}

/// The `value` of the winner of `id`.
async fn case_value(db: &Database, id: &str) -> Value {
    let state = db.read(id).await.expect("read").expect("written");
    state.tree.winner().expect("a winner").body["value"].clone()
}
