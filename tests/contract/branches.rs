//! Contract cases for the data-store database's conflicts (the engine's data-store layout,
//! `agentstore::database::layout::data_store`: `put_branch`, `revision_tree`, `erase_branches`) on every backend: losing branches are kept with their
//! bodies whatever order they arrive in, the record every other call reads is the winner,
//! deleting the winner promotes a live conflict, deleting a conflict resolves it, a facade delete
//! removes the key whatever conflicts it had, and an erasure leaves no branch behind.

use std::collections::BTreeSet;

use agentstore::backend::rev_tree::RevTree;
use agentstore::backend::{DocumentBackend, Precondition, ReplicatedOutcome, ReplicatedRevision, Revision};
use agentstore::database::layout::data_store;
use serde_json::{json, Value};

use crate::document_model::{body, id_of};
use crate::harness::Ctx;
use crate::replication::{deleted, live, rev};

use ReplicatedOutcome::{AlreadyKnown, Applied, KeptCurrent};

/// The tree bound every write here is held to: the default of `couchdb_max_tree_bytes`.
const TREE_BOUND: usize = agentstore::backend::rev_tree::DEFAULT_MAX_TREE_BYTES;

async fn tree(b: &dyn DocumentBackend, id: &str) -> RevTree {
    data_store::revision_tree(b, id).await.expect("revision_tree").expect("a tree")
}

/// (winner, live conflicts, deleted conflicts) of a tree.
fn shape(tree: &RevTree) -> (String, Vec<String>, Vec<String>) {
    (tree.winner().expect("winner").rev(), tree.conflicts(), tree.deleted_conflicts())
}

fn value_of(tree: &RevTree, rev: &str) -> Value {
    tree.leaf(rev).expect("leaf").body["value"].clone()
}

/// Three branches of one root, sent in two different orders to two ids: both end with the same
/// winner (CouchDB's rule) and the same conflicts, each leaf with its own body, and the record
/// that `get`, `revisions` and listings read is the winner.
pub async fn losing_branches_are_kept_with_their_bodies(ctx: Ctx) {
    let b = ctx.backend.as_ref();
    let root = rev(1, 'a');
    let branches = [
        live(&[rev(2, 'c'), root.clone()], json!("c")),
        live(&[rev(2, 'e'), root.clone()], json!("e")),
        live(&[rev(3, 'b'), rev(2, 'b'), root.clone()], json!("b")),
    ];
    let forward = id_of("u", "ns", "forward");
    let backward = id_of("u", "ns", "backward");
    for id in [&forward, &backward] {
        assert_eq!(
            data_store::put_branch(b, id, &live(std::slice::from_ref(&root), json!("root")), TREE_BOUND).await.unwrap(),
            Applied
        );
    }
    let mut outcomes = Vec::new();
    for branch in &branches {
        outcomes.push(data_store::put_branch(b, &forward, branch, TREE_BOUND).await.unwrap());
    }
    assert_eq!(outcomes, vec![Applied, Applied, Applied], "each one wins over the one before");
    for branch in branches.iter().rev() {
        data_store::put_branch(b, &backward, branch, TREE_BOUND).await.unwrap();
    }
    for id in [&forward, &backward] {
        let tree = tree(b, id).await;
        assert_eq!(shape(&tree), (rev(3, 'b'), vec![rev(2, 'e'), rev(2, 'c')], vec![]), "{id}");
        assert_eq!((value_of(&tree, &rev(2, 'c')), value_of(&tree, &rev(2, 'e'))), (json!("c"), json!("e")));
        let record = b.get(id).await.unwrap().expect("the winner is the record");
        assert_eq!((record.rev.as_str(), &record.body["value"]), (rev(3, 'b').as_str(), &json!("b")));
        assert_eq!(b.revisions(id).await.unwrap().expect("revisions").rev.as_str(), rev(3, 'b'));
        for branch in &branches {
            assert_eq!(
                data_store::put_branch(b, id, branch, TREE_BOUND).await.unwrap(),
                AlreadyKnown,
                "{id}: sent again"
            );
        }
    }
}

/// Deleting the winner while a live conflict exists makes the conflict the winner (live beats
/// deleted); deleting the last conflict leaves one live leaf and the deleted ones.
pub async fn deleting_the_winner_promotes_a_conflict_and_deleting_it_resolves(ctx: Ctx) {
    let b = ctx.backend.as_ref();
    let id = id_of("u", "ns", "k");
    let root = rev(1, 'a');
    data_store::put_branch(b, &id, &live(std::slice::from_ref(&root), json!(0)), TREE_BOUND).await.unwrap();
    data_store::put_branch(b, &id, &live(&[rev(2, 'c'), root.clone()], json!("winner")), TREE_BOUND).await.unwrap();
    data_store::put_branch(b, &id, &live(&[rev(2, 'b'), root.clone()], json!("loser")), TREE_BOUND).await.unwrap();
    assert_eq!(shape(&tree(b, &id).await), (rev(2, 'c'), vec![rev(2, 'b')], vec![]));

    let outcome =
        data_store::put_branch(b, &id, &deleted(&[rev(3, 'd'), rev(2, 'c'), root.clone()]), TREE_BOUND).await.unwrap();
    assert_eq!(outcome, KeptCurrent, "the deletion is a leaf, but not the winner");
    assert_eq!(shape(&tree(b, &id).await), (rev(2, 'b'), vec![], vec![rev(3, 'd')]));
    let record = b.get(&id).await.unwrap().expect("the promoted conflict is the record");
    assert_eq!((record.rev.as_str(), &record.body["value"]), (rev(2, 'b').as_str(), &json!("loser")));

    data_store::put_branch(b, &id, &deleted(&[rev(3, 'e'), rev(2, 'b'), root]), TREE_BOUND).await.unwrap();
    let tree = tree(b, &id).await;
    assert_eq!(shape(&tree), (rev(3, 'e'), vec![], vec![rev(3, 'd')]));
    assert!(b.get(&id).await.unwrap().is_none(), "every leaf deleted: the document is deleted");
    assert!(b.revisions(&id).await.unwrap().expect("tombstone").deleted);
}

/// A replicated write with a precondition applies only on the state it names: the compare-and-swap
/// `put_branch`'s default builds on.
pub async fn replicated_writes_meet_their_precondition(ctx: Ctx) {
    let b = ctx.backend.as_ref();
    let id = id_of("u", "ns", "k");
    let first = live(&[rev(1, 'a')], json!(1));
    b.put_replicated(&id, &first).await.unwrap();
    let again = ReplicatedRevision { precondition: Precondition::MustNotExist, ..live(&[rev(1, 'f')], json!(2)) };
    assert_eq!(b.put_replicated(&id, &again).await.unwrap(), KeptCurrent, "something is stored");
    let stale = ReplicatedRevision {
        precondition: Precondition::MatchRevision(Revision(rev(1, '0'))),
        ..live(&[rev(2, 'b'), rev(1, 'a')], json!(3))
    };
    assert_eq!(b.put_replicated(&id, &stale).await.unwrap(), KeptCurrent, "another revision is stored");
    assert_eq!(b.get(&id).await.unwrap().expect("doc").body["value"], json!(1), "nothing written");
    let current = ReplicatedRevision { precondition: Precondition::MatchRevision(Revision(rev(1, 'a'))), ..stale };
    assert_eq!(b.put_replicated(&id, &current).await.unwrap(), Applied);
    assert_eq!(b.get(&id).await.unwrap().expect("doc").body["value"], json!(3));
}

/// The facade reads the winner, updates it keeping the conflicts, and its delete removes the key
/// with every conflict (a data-store delete means the key is gone).
pub async fn the_facade_reads_the_winner_and_deletes_every_leaf(ctx: Ctx) {
    let b = ctx.backend.as_ref();
    let store = ctx.store().await;
    store.set("u", "ns", "k", json!("mine"), None, None).await.unwrap();
    let id = id_of("u", "ns", "k");
    let mine = b.revisions(&id).await.unwrap().expect("revisions");
    let ancestry: Vec<String> = mine.ancestry.revisions().map(|r| r.0).collect();
    // A branch from elsewhere on the same parent that loses, and one that wins.
    let mut theirs = ancestry.clone();
    theirs[0] = format!("{}-{}", mine.ancestry.start, "0".repeat(32));
    store
        .put_replicated(&agentstore::model::DocumentId::parse(&id).unwrap(), &live(&theirs, json!("theirs")))
        .await
        .unwrap();
    let read = store.get("u", "ns", "k", None).await.unwrap().expect("the winner");
    assert_eq!(read.body["value"], json!("mine"));
    store.set("u", "ns", "k", json!("mine again"), None, None).await.unwrap();
    let after = tree(b, &id).await;
    assert_eq!(after.conflicts(), vec![theirs[0].clone()], "an update keeps the conflict");
    assert_eq!(value_of(&after, &theirs[0]), json!("theirs"));

    assert!(store.delete("u", "ns", "k").await.unwrap());
    assert!(store.get("u", "ns", "k", None).await.unwrap().is_none(), "the key is gone, no conflict promoted");
    let gone = tree(b, &id).await;
    assert!(gone.leaves().iter().all(|leaf| leaf.deleted), "{gone:?}");
    assert!(store.list_keys("u", "ns").await.unwrap().is_empty());
}

/// A new losing leaf moves the document in the change feed (a replica downstream must learn of
/// it), and the record stays the winner, body and ancestry unchanged.
pub async fn a_new_conflict_moves_the_document_in_the_feed(ctx: Ctx) {
    let b = ctx.backend.as_ref();
    let id = id_of("u", "ns", "k");
    let root = rev(1, 'a');
    data_store::put_branch(b, &id, &live(std::slice::from_ref(&root), json!(0)), TREE_BOUND).await.unwrap();
    data_store::put_branch(b, &id, &live(&[rev(2, 'c'), root.clone()], json!("winner")), TREE_BOUND).await.unwrap();
    let before = b.revisions(&id).await.unwrap().expect("revisions");
    let position = b.change_position().await.expect("position");
    assert_eq!(
        data_store::put_branch(b, &id, &live(&[rev(2, 'b'), root], json!("loser")), TREE_BOUND).await.unwrap(),
        KeptCurrent
    );
    let (mut view, mut order) = (std::collections::BTreeMap::new(), Vec::new());
    crate::document_model::follow_until(b, Some(position), &mut view, &mut order, |seen| seen.contains_key(&id)).await;
    assert_eq!(view.get(&id).map(|(rev, _)| rev.as_str().to_owned()), Some(rev(2, 'c')), "{order:?}");
    assert_eq!(b.revisions(&id).await.unwrap().expect("revisions"), before, "the record is as it was");
    assert_eq!(b.get(&id).await.unwrap().expect("doc").body["value"], json!("winner"));
}

/// An erasure of a user removes their documents' conflicts too.
pub async fn erasure_removes_every_branch(ctx: Ctx) {
    let b = ctx.backend.as_ref();
    let id = id_of("u", "ns", "k");
    data_store::put_branch(b, &id, &live(&[rev(1, 'a')], json!("a")), TREE_BOUND).await.unwrap();
    data_store::put_branch(b, &id, &live(&[rev(1, 'b')], json!("b")), TREE_BOUND).await.unwrap();
    let other = id_of("v", "ns", "k");
    let of_v = |ancestry: &[String], value: Value| ReplicatedRevision {
        body: body("v", "ns", "k", value),
        ..live(ancestry, json!(null))
    };
    data_store::put_branch(b, &other, &of_v(&[rev(1, 'a')], json!("a")), TREE_BOUND).await.unwrap();
    data_store::put_branch(b, &other, &of_v(&[rev(1, 'b')], json!("b")), TREE_BOUND).await.unwrap();
    if let Some(why) = &ctx.no_purge {
        println!("erasure of branches not checked on {}: {why}", ctx.backend_name);
        return;
    }
    let store = ctx.store().await;
    store.purge_user("u").await.unwrap();
    assert!(data_store::revision_tree(b, &id).await.unwrap().is_none(), "nothing of u's document is left");
    let kept: BTreeSet<String> = tree(b, &other).await.leaves().into_iter().map(|leaf| leaf.rev()).collect();
    assert_eq!(kept, [rev(1, 'a'), rev(1, 'b')].into_iter().collect(), "another user's branches stay");
    // Written again after the erasure, the id starts a new tree.
    data_store::put_branch(b, &id, &live(&[rev(1, 'c')], json!("c")), TREE_BOUND).await.unwrap();
    assert_eq!(shape(&tree(b, &id).await), (rev(1, 'c'), vec![], vec![]));
}
