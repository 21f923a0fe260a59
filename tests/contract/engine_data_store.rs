//! The engine serving the data-store database ([`Database::data_store`], issue 35 §2): the
//! engine's writes, reads, listing and purges over the data-store layout (the seed's records, the
//! other leaves in `:leaves:{id}`), on every backend whose records hold one revision each; on the
//! CouchDB backend, which keeps revision trees itself, over the native layout
//! ([`Database::native_data_store`]: the tree is CouchDB's own document) instead.
//!
//! What is checked:
//! - an edit chain (`Write::Edit`), a replicated conflict, the deletion of the winner (the other
//!   leaf promoted) leave the backend **exactly** as the data-store face's path leaves it (the
//!   facade's `put_replicated`, over `layout::data_store::put_branch`) for the same revisions: the
//!   record (revision and body), its ancestry, the side document's body, and what the facade
//!   reads; after each step the REST face's read (`DataStore::peek`) is the tree's winner;
//! - every leaf reads back by its revision (`read`'s tree), `all_docs` lists the document while its
//!   winner is live, the purge of a losing leaf and then of the last leaf leave nothing behind;
//! - a crash cut in the save of a new conflict (the crash layer, `crash.rs`, at every call) is
//!   repaired by the document's next `write`, one that changes nothing;
//! - the CouchDB backend, which keeps revision trees itself, is refused by the data-store
//!   layout's constructor and served by the native layout's.
//!
//! What cannot hold on the native layout is deselected there with its reason printed
//! ([`deselected`]): the purge of one leaf of several (the native layout reaches the backend's
//! `_purge` only through the erasure of a document's last leaf), and the unfinished mark (the
//! native layout has no side place, so no cut leaves one).

use std::sync::Arc;

use agentstore::backend::{DocumentBackend, IdRange, Precondition, ReplicatedRevision, Revision, StoredDocument};
use agentstore::database::layout::data_store::{side_name, UNFINISHED_FIELD};
use agentstore::database::rev_tree::RevPath;
use agentstore::database::{Database, Write, Written};
use agentstore::model::DocumentId;
use agentstore::store::{DataStore, StoreOptions};
use agentstore::ErrorKind;
use serde_json::{json, Map, Value};

use crate::common::body;
use crate::crash::{CrashLayer, Cut};
use crate::crash_sweep::{feed_ids, position_number};
use crate::document_model::id_of;
use crate::harness::Ctx;

const USER: &str = "u";
const NAMESPACE: &str = "engine";
/// A losing leaf beside a generation-2 winner: the lowest revision id of its generation.
const LOSER: &str = "2-00000000000000000000000000000001";
/// More backend calls than the swept write makes: a sweep that gets here never ends.
const MAX_CRASH_POINTS: usize = 100;

/// What the backend holds for one id, as every face reads it.
#[derive(Debug, Clone, PartialEq)]
struct Stored {
    /// The live record (what the REST API, the facade's listings and the feed read).
    record: Option<(String, Map<String, Value>)>,
    /// The record's revision, whether deleted, and its ancestry.
    revisions: Option<(String, bool, Vec<String>)>,
    /// The body of the local document holding the other leaves.
    side: Option<Map<String, Value>>,
    /// What the facade's read without access counting answers.
    facade: Option<StoredDocument>,
}

async fn stored(store: &DataStore, key: &str) -> Stored {
    let id = id_of(USER, NAMESPACE, key);
    let backend = store.backend();
    let record = backend.get(&id).await.expect("get").map(|doc| (doc.rev.0, doc.body));
    let revisions = backend.revisions(&id).await.expect("revisions").map(|info| {
        let ancestry = info.ancestry.revisions().map(|rev| rev.0).collect();
        (info.rev.0, info.deleted, ancestry)
    });
    let side = backend.get_local(&side_name(&id)).await.expect("get_local").map(|doc| doc.body);
    let facade = store.peek(USER, NAMESPACE, key).await.expect("peek");
    Stored { record, revisions, side, facade }
}

fn seed(key: &str, value: Value) -> Map<String, Value> {
    body(USER, NAMESPACE, key, value)
}

fn edit(parent: Option<&str>, deleted: bool, body: Map<String, Value>) -> Write {
    Write::Edit { parent: parent.map(str::to_owned), deleted, body }
}

/// A revision `N-id` with its ancestry as a path.
fn path_of(ancestry: &[String]) -> RevPath {
    let start = ancestry[0].split_once('-').and_then(|(n, _)| n.parse().ok()).expect("N-id");
    RevPath { start, ids: ancestry.iter().map(|rev| rev.split_once('-').expect("N-id").1.to_owned()).collect() }
}

fn replicated(ancestry: &[String], deleted: bool, body: Map<String, Value>) -> ReplicatedRevision {
    ReplicatedRevision {
        rev: Revision(ancestry[0].clone()),
        ancestry: ancestry.to_vec(),
        deleted,
        body,
        precondition: Precondition::None,
    }
}

async fn facade(backend: Arc<dyn DocumentBackend>) -> DataStore {
    DataStore::open(backend, StoreOptions { track_reads: false, ..StoreOptions::default() }).await.expect("facade")
}

/// The engine's data-store database over `backend`: the data-store layout, or, on a backend
/// that keeps revision trees itself (after checking that layout refuses it), the native layout.
fn engine(backend: Arc<dyn DocumentBackend>) -> Database {
    let keeps_branches = backend.keeps_branches();
    match Database::data_store("agent_data_store".into(), Arc::clone(&backend)) {
        Ok(database) => {
            assert!(!keeps_branches, "a backend keeping its own trees must be refused");
            database
        }
        Err(err) => {
            assert!(keeps_branches, "refused: {err}");
            assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");
            Database::native_data_store("agent_data_store".into(), backend).expect("the native layout")
        }
    }
}

/// Whether the engine's data-store database over `backend` has the native layout.
fn native(backend: &dyn DocumentBackend) -> bool {
    backend.keeps_branches()
}

/// Says, where the run's output shows it, which check of `case` is left out on the native
/// layout and why.
fn deselected(case: &str, check: &str, why: &str) {
    println!("native layout: {case}: deselected: {check}: {why}");
}

async fn edited(database: &Database, id: &str, write: Write) -> String {
    match database.write(id, &write).await.expect("the engine's write") {
        Written::Edited(rev) => rev,
        other => panic!("an edit answers its revision, not {other:?}"),
    }
}

/// The winner and every leaf with its body and deletion, as the engine reads the document.
async fn leaves(database: &Database, id: &str) -> (String, Vec<(String, bool, Map<String, Value>)>) {
    let state = database.read(id).await.expect("read").expect("a tree");
    let leaves = state.tree.leaves().into_iter().map(|leaf| (leaf.rev(), leaf.deleted, leaf.body.clone())).collect();
    (state.winner_rev().unwrap_or_default(), leaves)
}

async fn listed(database: &Database, id: &str) -> bool {
    let range = IdRange { start: Some(id.to_owned()), end: Some(id.to_owned()), ..IdRange::all() };
    let page = database.all_docs(&range, 10, None).await.expect("all_docs");
    page.items.iter().any(|(listed, _)| listed == id)
}

/// Edits, a replicated conflict and the winner's deletion through the engine, each step's stored
/// state compared with the data-store face's path writing the same revisions over the same id
/// (once the engine's document is purged: nothing of it left); `?rev` reads of every leaf, the
/// listing, and the purges of a losing leaf and of the last one.
pub async fn engine_data_store_writes_what_the_data_store_face_writes(ctx: Ctx) {
    let database = engine(Arc::clone(&ctx.backend));
    let store = facade(Arc::clone(&ctx.backend)).await;
    let key = "doc";
    let id = id_of(USER, NAMESPACE, key);
    let document_id = DocumentId::parse(&id).expect("an id");

    // The engine's writes, and what each leaves.
    let r1 = edited(&database, &id, edit(None, false, seed(key, json!(1)))).await;
    let after_create = stored(&store, key).await;
    let r2 = edited(&database, &id, edit(Some(&r1), false, seed(key, json!(2)))).await;
    let after_edit = stored(&store, key).await;
    let edited_state = database.read(&id).await.expect("read").expect("a tree");
    assert!(edited_state.tree.revision(&r1).is_none(), "no inner revision's body is kept on this database");
    let conflict = Write::Replicated {
        path: path_of(&[LOSER.to_owned(), r1.clone()]),
        deleted: false,
        body: seed(key, json!("loser")),
    };
    database.write(&id, &conflict).await.expect("the conflict");
    let after_conflict = stored(&store, key).await;
    let (winner, both) = leaves(&database, &id).await;
    assert_eq!(winner, r2, "the edit wins over the lower revision id");
    assert_eq!(both.len(), 2, "{both:?}");
    for (rev, deleted, body) in &both {
        let expected = if *rev == r2 { seed(key, json!(2)) } else { seed(key, json!("loser")) };
        assert!(!deleted, "{rev}");
        assert_eq!(body, &expected, "the leaf {rev} reads back by its revision");
    }
    assert_eq!(after_conflict.facade.as_ref().map(|doc| doc.rev.0.as_str()), Some(r2.as_str()));
    let r3 = edited(&database, &id, edit(Some(&r2), true, Map::new())).await;
    let after_deletion = stored(&store, key).await;
    let (winner, _) = leaves(&database, &id).await;
    assert_eq!(winner, LOSER, "the other leaf is promoted");
    let promoted = after_deletion.facade.clone().expect("the promoted leaf is live for the facade");
    assert_eq!((promoted.rev.0.as_str(), &promoted.body), (LOSER, &seed(key, json!("loser"))));
    assert!(listed(&database, &id).await, "listed with its promoted winner");

    // The purges: the deleted leaf, then the last one (on the native layout both at once).
    if let Some(why) = &ctx.no_purge {
        deselected("engine_data_store_writes_what_the_data_store_face_writes", "the purges and the face's path", why);
        return;
    }
    if native(ctx.backend.as_ref()) {
        deselected(
            "engine_data_store_writes_what_the_data_store_face_writes",
            "the purge of one leaf of several",
            "the native layout reaches the backend's _purge only through the erasure of a document's last leaf",
        );
        let mut purged = database.purge(&id, &[r3.clone(), LOSER.to_owned()]).await.expect("purge");
        purged.sort();
        let mut both = vec![r3.clone(), LOSER.to_owned()];
        both.sort();
        assert_eq!(purged, both);
    } else {
        assert_eq!(database.purge(&id, std::slice::from_ref(&r3)).await.expect("purge"), vec![r3.clone()]);
        let (winner, left) = leaves(&database, &id).await;
        assert_eq!((winner.as_str(), left.len()), (LOSER, 1), "{left:?}");
        let after_leaf_purge = stored(&store, key).await;
        assert_eq!(after_leaf_purge.side, None, "no other leaf kept");
        assert_eq!(after_leaf_purge.record, after_deletion.record, "the winner's record stays as it was");
        assert_eq!(database.purge(&id, &[LOSER.to_owned()]).await.expect("purge"), vec![LOSER.to_owned()]);
    }
    assert!(database.read(&id).await.expect("read").is_none(), "nothing left");
    assert!(!listed(&database, &id).await);
    let nothing = Stored { record: None, revisions: None, side: None, facade: None };
    assert_eq!(stored(&store, key).await, nothing);

    // The data-store face's path, the same revisions over the same id.
    let steps: [(ReplicatedRevision, &Stored, &str); 4] = [
        (replicated(std::slice::from_ref(&r1), false, seed(key, json!(1))), &after_create, "the creation"),
        (replicated(&[r2.clone(), r1.clone()], false, seed(key, json!(2))), &after_edit, "the edit"),
        (
            replicated(&[LOSER.to_owned(), r1.clone()], false, seed(key, json!("loser"))),
            &after_conflict,
            "the conflict",
        ),
        (replicated(&[r3, r2, r1], true, Map::new()), &after_deletion, "the winner's deletion"),
    ];
    for (revision, by_engine, step) in steps {
        store.put_replicated(&document_id, &revision).await.expect("the data-store face's write");
        assert_eq!(&stored(&store, key).await, by_engine, "after {step}: the engine wrote what the face writes");
    }
}

/// A client's local documents keep the names the data-store face gives them; the names the
/// database keeps for itself are refused, and never listed.
pub async fn engine_data_store_local_documents_keep_their_names(ctx: Ctx) {
    let database = engine(Arc::clone(&ctx.backend));
    let mut checkpoint = Map::new();
    checkpoint.insert("seq".into(), json!(7));
    let writes_client_locals = !native(ctx.backend.as_ref());
    if writes_client_locals {
        database.put_local("checkpoint", &checkpoint, 1).await.expect("put_local");
        let kept = ctx.backend.get_local("checkpoint").await.expect("get_local").expect("kept under its own name");
        assert_eq!(kept.body.get("seq"), Some(&json!(7)));
    } else {
        deselected(
            "engine_data_store_local_documents_keep_their_names",
            "a client's local document written and listed",
            "the engine keeps a client local document's revision number in the body field `_agentstore_local_rev`, \
             which CouchDB refuses (400 doc_validation: a `_` field it does not know)",
        );
    }
    for reserved in [":leaves:x", ":design:x", ":views:incarnation", ":db:settings"] {
        let refused = database.put_local(reserved, &checkpoint, 1).await.expect_err(reserved);
        assert_eq!(refused.kind(), ErrorKind::Forbidden, "{reserved}: {refused}");
    }
    database.update_settings(|settings| settings.revs_limit = 5).await.expect("settings");
    if let Some(why) = &ctx.no_local_listing {
        deselected("engine_data_store_local_documents_keep_their_names", "the listing", why);
        return;
    }
    let page = database.local_docs(&IdRange::all(), 100, None).await.expect("local_docs");
    let names: Vec<&str> = page.items.iter().map(|doc| doc.id.as_str()).collect();
    let expected: &[&str] = if writes_client_locals { &["_local/checkpoint"] } else { &[] };
    assert_eq!(names, expected, "the database's own local documents are not a client's");
}

/// A write carrying attachments is refused on the data-store database, nothing written.
pub async fn engine_data_store_refuses_attachments(ctx: Ctx) {
    let database = engine(Arc::clone(&ctx.backend));
    assert!(database.attachments_unsupported());
    let id = id_of(USER, NAMESPACE, "attached");
    let mut body = seed("attached", json!(1));
    body.insert("_attachments".into(), json!({"a.txt": {"content_type": "text/plain", "data": "aGk="}}));
    let refused = database.write(&id, &edit(None, false, body)).await.expect_err("refused");
    assert_eq!(refused.kind(), ErrorKind::Forbidden, "{refused}");
    assert!(refused.to_string().contains("attachments are not supported"), "{refused}");
    assert!(database.read(&id).await.expect("read").is_none());
}

/// The save of a new conflict cut at every backend call (the process stopped there): after the
/// restart, the document's next write through the engine (the same leaf again: nothing new)
/// finishes what the cut left, so that the tree is as before or after, the record is its winner,
/// the document is in the feed after the position read before the write, and no mark is left.
pub async fn engine_data_store_crash_in_a_conflict_is_repaired_by_the_next_write(ctx: Ctx) {
    let mut violations = Vec::new();
    let mut cuts_leaving_the_mark = 0;
    for k in 0..MAX_CRASH_POINTS {
        let key = format!("cut{k}");
        let id = id_of(USER, NAMESPACE, &key);
        let plain = engine(Arc::clone(&ctx.backend));
        let r1 = edited(&plain, &id, edit(None, false, seed(&key, json!(1)))).await;
        let r2 = edited(&plain, &id, edit(Some(&r1), false, seed(&key, json!(2)))).await;
        let conflict = Write::Replicated {
            path: path_of(&[LOSER.to_owned(), r1.clone()]),
            deleted: false,
            body: seed(&key, json!("loser")),
        };
        let position_before = ctx.backend.change_position().await.expect("change_position");
        let layer = Arc::new(CrashLayer::new(Arc::clone(&ctx.backend), k, Cut::Stop));
        let cut = engine(layer.clone());
        let acknowledged = cut.write(&id, &conflict).await.is_ok();
        layer.end();
        // The restart: a new engine over the backend, and the document's next write.
        let restarted = engine(Arc::clone(&ctx.backend));
        let side = ctx.backend.get_local(&side_name(&id)).await.expect("get_local");
        cuts_leaving_the_mark += usize::from(side.is_some_and(|doc| doc.body.contains_key(UNFINISHED_FIELD)));
        restarted.write(&id, &conflict).await.expect("the next write");
        violations.extend(check_after_cut(&restarted, &id, &r2, acknowledged, &position_before).await);
        if !layer.cut_made() {
            assert!(acknowledged, "uncut, the write is acknowledged");
            break;
        }
        assert!(k + 1 < MAX_CRASH_POINTS, "the write never ran uncut");
    }
    assert!(violations.is_empty(), "{} violations:\n{}", violations.len(), violations.join("\n"));
    if native(ctx.backend.as_ref()) {
        deselected(
            "engine_data_store_crash_in_a_conflict_is_repaired_by_the_next_write",
            "a cut leaves the unfinished mark",
            "the native layout has no side place: each leaf is one atomic write of the backend's",
        );
    } else {
        assert!(cuts_leaving_the_mark > 0, "some cut falls between the side document and the record");
    }
}

/// The checks after a cut and the next write (the conflict is written by then, whatever the cut).
async fn check_after_cut(database: &Database, id: &str, r2: &str, acknowledged: bool, since: &str) -> Vec<String> {
    let backend = database.backend().as_ref();
    let mut violations = Vec::new();
    let (winner, leaves) = leaves(database, id).await;
    let revs: Vec<&str> = leaves.iter().map(|(rev, _, _)| rev.as_str()).collect();
    if winner != r2 || leaves.len() != 2 || !revs.contains(&LOSER) {
        violations.push(format!("{id}: the tree holds {revs:?}, winner {winner} (acknowledged {acknowledged})"));
    }
    match backend.revisions(id).await.expect("revisions") {
        Some(info) if info.rev.0 == winner && !info.deleted => {}
        other => violations.push(format!("{id}: the record is {other:?}, the winner {winner}")),
    }
    if let Some(side) = backend.get_local(&side_name(id)).await.expect("get_local") {
        if side.body.contains_key(UNFINISHED_FIELD) {
            violations.push(format!("{id}: the next write left the unfinished mark"));
        }
    }
    tokio::time::sleep(backend.change_feed_delay()).await;
    let fed_after = backend.changes(Some(since), 500).await.expect("changes").changes;
    if !fed_after.iter().any(|change| change.id == id) {
        violations.push(format!("{id}: a new leaf, but not in the change feed after {since}"));
    }
    if !feed_ids(backend).await.contains(id) {
        violations.push(format!("{id}: not in the change feed"));
    }
    let position = backend.change_position().await.expect("change_position");
    if position_number(&position) < position_number(since) {
        violations.push(format!("the feed went back from {since} to {position}"));
    }
    violations
}

/// A backend counting its tree reads: one by one, and batched.
struct CountingTreeReads {
    inner: Arc<dyn DocumentBackend>,
    one_by_one: std::sync::atomic::AtomicUsize,
    batched: std::sync::atomic::AtomicUsize,
}

#[async_trait::async_trait]
impl agentstore::backend::raw::layer::Layered for CountingTreeReads {
    fn inner(&self) -> &dyn DocumentBackend {
        self.inner.as_ref()
    }

    async fn revision_tree(&self, id: &str) -> agentstore::Result<Option<agentstore::database::rev_tree::RevTree>> {
        self.one_by_one.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.revision_tree(id).await
    }

    async fn revision_trees(
        &self,
        ids: &[String],
    ) -> agentstore::Result<Vec<Option<agentstore::database::rev_tree::RevTree>>> {
        self.batched.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.revision_trees(ids).await
    }
}

/// On the native layout, a page of documents' trees (what a page of the change feed or a
/// `conflicts=true` listing reads) is one batched read of the backend's, not one per row, and
/// answers each tree as the document's own read does: every leaf of a conflicted document, a
/// deleted document's tree, nothing for an id never written.
pub async fn engine_data_store_a_page_of_trees_is_one_batched_read(ctx: Ctx) {
    if !native(ctx.backend.as_ref()) {
        println!("{}: not applicable: the data-store layout reads each tree in its records", ctx.backend_name);
        return;
    }
    let layer = Arc::new(CountingTreeReads {
        inner: Arc::clone(&ctx.backend),
        one_by_one: Default::default(),
        batched: Default::default(),
    });
    let database = engine(layer.clone());
    let mut ids = Vec::new();
    for n in 0..40 {
        let key = format!("page{n:02}");
        let id = id_of(USER, NAMESPACE, &key);
        let r1 = edited(&database, &id, edit(None, false, seed(&key, json!(n)))).await;
        if n % 4 == 1 {
            // An edit, and a losing leaf beside it.
            edited(&database, &id, edit(Some(&r1), false, seed(&key, json!("winner")))).await;
            let path = path_of(&[LOSER.to_owned(), r1.clone()]);
            database
                .write(&id, &Write::Replicated { path, deleted: false, body: seed(&key, json!("loser")) })
                .await
                .expect("a conflict");
        }
        if n % 4 == 2 {
            edited(&database, &id, edit(Some(&r1), true, Map::new())).await;
        }
        ids.push(id);
    }
    ids.push(id_of(USER, NAMESPACE, "never-written"));
    let one_by_one: Vec<_> = {
        let mut states = Vec::new();
        for id in &ids {
            states.push(database.read(id).await.expect("read").map(|state| state.tree));
        }
        states
    };
    layer.one_by_one.store(0, std::sync::atomic::Ordering::SeqCst);
    layer.batched.store(0, std::sync::atomic::Ordering::SeqCst);
    let page: Vec<_> = database
        .read_many(&ids)
        .await
        .expect("read_many")
        .into_iter()
        .map(|state| state.map(|state| state.tree))
        .collect();
    assert_eq!(page, one_by_one, "the batched read answers each tree as its own read does");
    assert!(page.iter().filter_map(Option::as_ref).any(|tree| tree.leaves().len() == 2), "a conflict is read whole");
    assert!(page.last().is_some_and(Option::is_none), "nothing for an id never written");
    let counted = (
        layer.batched.load(std::sync::atomic::Ordering::SeqCst),
        layer.one_by_one.load(std::sync::atomic::Ordering::SeqCst),
    );
    assert_eq!(counted, (1, 0), "one batched read for the page (batched, one by one)");
}
