//! Contract cases for replicated writes (`DocumentBackend::put_replicated`, CouchDB's
//! `new_edits: false`) on every backend: which incoming revisions are written, which change
//! nothing, which branch wins, what the change feed and `revisions()` show afterwards, and that
//! malformed revisions are refused without a trace. Like `cases.rs`, they use only the trait.

use std::collections::BTreeMap;

use agentstore::backend::{
    DocumentBackend, IdRange, Precondition, ReplicatedOutcome, ReplicatedRevision, Revision, RevisionInfo,
};
use agentstore::ErrorKind;
use serde_json::{json, Map, Value};

use crate::document_model::{body, follow_until, generation, id_of, revisions};
use crate::harness::Ctx;

use ReplicatedOutcome::{AlreadyKnown, Applied, KeptCurrent};

/// A made-up revision `N-<the hex digit 31 times><N's last hex digit>`: revisions of one
/// generation order as their digits do (CouchDB's tie-break between branches), and no two
/// generations share an id (as real revision ids never do; pouchdb-server mixes up a tree whose
/// parent and child have the same id).
pub(crate) fn rev(generation: u64, digit: char) -> String {
    format!("{generation}-{}{:x}", digit.to_string().repeat(31), generation % 16)
}

pub(crate) fn live(ancestry: &[String], value: Value) -> ReplicatedRevision {
    ReplicatedRevision {
        rev: Revision(ancestry[0].clone()),
        ancestry: ancestry.to_vec(),
        deleted: false,
        body: body("u", "ns", "k", value),
        precondition: Precondition::None,
    }
}

pub(crate) fn deleted(ancestry: &[String]) -> ReplicatedRevision {
    ReplicatedRevision {
        rev: Revision(ancestry[0].clone()),
        ancestry: ancestry.to_vec(),
        deleted: true,
        body: Map::new(),
        precondition: Precondition::None,
    }
}

fn full_ancestry(info: &RevisionInfo) -> Vec<String> {
    info.ancestry.revisions().map(|r| r.0).collect()
}

/// The stored state: the revisions and the live document's value (`None` when deleted).
async fn state(b: &dyn DocumentBackend, id: &str) -> (RevisionInfo, Option<Value>) {
    let info = revisions(b, id).await;
    let doc = b.get(id).await.expect("get");
    if let Some(doc) = &doc {
        assert_eq!(doc.rev, info.rev, "get and revisions agree on the current revision");
    }
    (info, doc.map(|d| d.body["value"].clone()))
}

/// A feed position after every write made so far: a backend with a settle window may show a write
/// committed within the window before `change_position` after it, so the window passes first.
async fn position_after_earlier_writes(b: &dyn DocumentBackend) -> String {
    tokio::time::sleep(b.change_feed_delay()).await;
    b.change_position().await.unwrap()
}

pub async fn replicated_revisions_are_stored_as_they_come(ctx: Ctx) {
    let b = ctx.backend.as_ref();
    let id = id_of("u", "ns", "k");
    let ancestry = [rev(3, 'c'), rev(2, 'b'), rev(1, 'a')];
    assert_eq!(b.put_replicated(&id, &live(&ancestry, json!("three"))).await.unwrap(), Applied, "a new id");
    let (info, value) = state(b, &id).await;
    assert_eq!((info.rev.as_str(), info.deleted, value), (ancestry[0].as_str(), false, Some(json!("three"))));
    assert_eq!(full_ancestry(&info), ancestry, "revisions() shows the replicated ancestry");
    let doc = b.get(&id).await.unwrap().unwrap();
    assert_eq!(doc.body, body("u", "ns", "k", json!("three")), "the body is stored as sent");

    // The current revision again, or one of its ancestors: nothing changes.
    for known in [live(&ancestry, json!("again")), live(&ancestry[1..], json!("older")), live(&ancestry[2..], json!(1))]
    {
        assert_eq!(b.put_replicated(&id, &known).await.unwrap(), AlreadyKnown, "{}", known.rev);
        assert_eq!(state(b, &id).await, (info.clone(), Some(json!("three"))), "{} changed nothing", known.rev);
    }

    // A tombstone of an id never written is stored as a tombstone: invisible, but known.
    let gone = id_of("u", "ns", "gone");
    let tombstone = [rev(2, 'e'), rev(1, 'd')];
    assert_eq!(b.put_replicated(&gone, &deleted(&tombstone)).await.unwrap(), Applied);
    assert_eq!(b.get(&gone).await.unwrap(), None, "a replicated tombstone is not readable");
    let info = revisions(b, &gone).await;
    assert_eq!(
        (info.rev.as_str(), info.deleted, full_ancestry(&info)),
        (tombstone[0].as_str(), true, tombstone.to_vec())
    );
    assert_eq!(b.put_replicated(&gone, &deleted(&tombstone)).await.unwrap(), AlreadyKnown);
}

pub async fn replicated_descendants_fast_forward(ctx: Ctx) {
    let b = ctx.backend.as_ref();
    let id = id_of("u", "ns", "k");
    let first = b.put(&id, &body("u", "ns", "k", json!(1)), Precondition::MustNotExist).await.unwrap();
    let second = b.put(&id, &body("u", "ns", "k", json!(2)), Precondition::MatchRevision(first.clone())).await.unwrap();
    // Descends from the current revision, with ids only the other replica knows on top of it.
    let ancestry = [rev(4, '4'), rev(3, '3'), second.0.clone(), first.0.clone()];
    assert_eq!(b.put_replicated(&id, &live(&ancestry, json!(4))).await.unwrap(), Applied);
    let (info, value) = state(b, &id).await;
    assert_eq!((full_ancestry(&info), value), (ancestry.to_vec(), Some(json!(4))));

    // A replicated deletion on top: a tombstone at its revision, invisible to reads.
    let tombstone = [rev(5, '5'), ancestry[0].clone(), ancestry[1].clone()];
    assert_eq!(b.put_replicated(&id, &deleted(&tombstone)).await.unwrap(), Applied);
    let (info, value) = state(b, &id).await;
    assert_eq!((info.rev.as_str(), info.deleted, value), (tombstone[0].as_str(), true, None));
    assert_eq!(full_ancestry(&info)[..3], tombstone, "the tombstone's ancestry starts with the replicated one");
    assert_eq!(b.delete(&id, &info.rev).await.unwrap_err().kind(), ErrorKind::NotFound);

    // A normal re-create continues the replicated generation, on top of the tombstone.
    let recreated = b.put(&id, &body("u", "ns", "k", json!(6)), Precondition::MustNotExist).await.unwrap();
    assert_eq!(generation(&recreated), 6);
    let info = revisions(b, &id).await;
    assert_eq!(full_ancestry(&info)[..2], [recreated.0.clone(), tombstone[0].clone()]);
    // And a replicated revision that extends the re-created one fast-forwards again.
    let next = [rev(7, '7'), recreated.0.clone(), tombstone[0].clone()];
    assert_eq!(b.put_replicated(&id, &live(&next, json!(7))).await.unwrap(), Applied);
    assert_eq!(state(b, &id).await.1, Some(json!(7)));
}

pub async fn divergent_branches_keep_couchdbs_winner(ctx: Ctx) {
    let b = ctx.backend.as_ref();
    let id = id_of("u", "ns", "k");
    let root = rev(1, 'a');
    let current = [rev(2, 'b'), root.clone()];
    assert_eq!(b.put_replicated(&id, &live(&current, json!("b"))).await.unwrap(), Applied);

    // Same generation: the greater revision id wins.
    let smaller = [rev(2, '9'), root.clone()];
    assert_eq!(b.put_replicated(&id, &live(&smaller, json!("9"))).await.unwrap(), KeptCurrent);
    let (info, value) = state(b, &id).await;
    assert_eq!((full_ancestry(&info), value), (current.to_vec(), Some(json!("b"))), "the current branch stays");
    let greater = [rev(2, 'c'), root.clone()];
    assert_eq!(b.put_replicated(&id, &live(&greater, json!("c"))).await.unwrap(), Applied);
    let (info, value) = state(b, &id).await;
    assert_eq!((full_ancestry(&info), value), (greater.to_vec(), Some(json!("c"))), "the incoming branch replaces it");
    // The branch that lost is not kept: sending it again loses again, changing nothing.
    assert_eq!(b.put_replicated(&id, &live(&current, json!("b"))).await.unwrap(), KeptCurrent);

    // A live branch beats a deleted one, whatever the generations.
    let deep_tombstone = [rev(9, 'f'), rev(8, 'f')];
    assert_eq!(b.put_replicated(&id, &deleted(&deep_tombstone)).await.unwrap(), KeptCurrent);
    assert_eq!(state(b, &id).await.1, Some(json!("c")));

    // Then the higher generation wins, even with a smaller id.
    let longer = [rev(3, '0'), rev(2, '0'), root.clone()];
    assert_eq!(b.put_replicated(&id, &live(&longer, json!("0"))).await.unwrap(), Applied);
    let (info, value) = state(b, &id).await;
    assert_eq!((full_ancestry(&info), value), (longer.to_vec(), Some(json!("0"))));

    // Deleted here: any live revision from elsewhere wins over the tombstone.
    let tombstone = b.delete(&id, &info.rev).await.unwrap();
    assert_eq!(generation(&tombstone), 4);
    let fresh = [rev(1, '1')];
    assert_eq!(b.put_replicated(&id, &live(&fresh, json!("1"))).await.unwrap(), Applied);
    let (info, value) = state(b, &id).await;
    assert_eq!((info.rev.as_str(), info.deleted, value), (fresh[0].as_str(), false, Some(json!("1"))));

    // Between tombstones, the same order: the higher generation, then the greater id.
    let other = id_of("u", "ns", "other");
    let b_tomb = [rev(2, 'b'), root.clone()];
    assert_eq!(b.put_replicated(&other, &deleted(&b_tomb)).await.unwrap(), Applied);
    assert_eq!(b.put_replicated(&other, &deleted(&[rev(2, '0'), root.clone()])).await.unwrap(), KeptCurrent);
    let c_tomb = [rev(2, 'c'), root.clone()];
    assert_eq!(b.put_replicated(&other, &deleted(&c_tomb)).await.unwrap(), Applied);
    assert_eq!(full_ancestry(&revisions(b, &other).await), c_tomb);
    let deeper = [rev(3, '0'), rev(2, '0'), root.clone()];
    assert_eq!(b.put_replicated(&other, &deleted(&deeper)).await.unwrap(), Applied);
    let info = revisions(b, &other).await;
    assert_eq!((full_ancestry(&info), info.deleted), (deeper.to_vec(), true));
    assert_eq!(b.get(&other).await.unwrap(), None);
}

pub async fn the_feed_shows_applied_writes_once_and_no_noops(ctx: Ctx) {
    let b = ctx.backend.as_ref();
    let (a, c, d) = (id_of("u", "ns", "a"), id_of("u", "ns", "c"), id_of("u", "ns", "d"));
    let start = b.change_position().await.unwrap();
    let a1 = [rev(1, 'a')];
    assert_eq!(b.put_replicated(&a, &live(&a1, json!(1))).await.unwrap(), Applied);
    b.put(&c, &body("u", "ns", "c", json!(1)), Precondition::MustNotExist).await.unwrap();
    let a2 = [rev(2, 'a'), rev(1, 'a')];
    assert_eq!(b.put_replicated(&a, &live(&a2, json!(2))).await.unwrap(), Applied);
    let mut view = BTreeMap::new();
    let mut order = Vec::new();
    let a2_rev = Revision(a2[0].clone());
    let seen = follow_until(b, Some(start), &mut view, &mut order, |v| {
        v.get(&a).is_some_and(|(rev, _)| *rev == a2_rev) && v.contains_key(&c)
    })
    .await
    .expect("a position");
    assert_eq!(order, [c.clone(), a.clone()], "an applied write moves its document to the end of the feed");
    assert_eq!(view[&a], (a2_rev.clone(), false));

    // No-ops leave the feed alone: only the applied write after them shows.
    let noop_start = position_after_earlier_writes(b).await;
    assert_eq!(b.put_replicated(&a, &live(&a2, json!(2))).await.unwrap(), AlreadyKnown);
    assert_eq!(b.put_replicated(&a, &live(&[rev(2, '1'), rev(1, 'a')], json!(0))).await.unwrap(), KeptCurrent);
    assert_eq!(b.put_replicated(&d, &deleted(&[rev(1, 'd')])).await.unwrap(), Applied);
    let mut after = BTreeMap::new();
    let mut after_order = Vec::new();
    follow_until(b, Some(noop_start), &mut after, &mut after_order, |v| v.contains_key(&d)).await;
    assert_eq!(after_order, vec![d.clone()], "only the applied write is in the feed after the no-ops");
    assert_eq!(after[&d], (Revision(rev(1, 'd')), true), "a replicated tombstone is in the feed as deleted");
    // From the token of the first read, `a` may come once more as the repeat of a change that
    // read took from the unsettled tail (docs/document-model.md), and then only at the revision
    // already seen; that the no-ops did not move it is shown above, from `noop_start`.
    let mut rest = BTreeMap::new();
    follow_until(b, Some(seen), &mut rest, &mut Vec::new(), |v| v.contains_key(&d)).await;
    assert!(
        rest.get(&a).is_none_or(|state| *state == (a2_rev.clone(), false)),
        "the no-ops on {a} changed what the feed shows of it: {:?}",
        rest.get(&a)
    );
}

pub async fn malformed_replicated_revisions_change_nothing(ctx: Ctx) {
    let b = ctx.backend.as_ref();
    let id = id_of("u", "ns", "k");
    let stored = [rev(2, 'b'), rev(1, 'a')];
    assert_eq!(b.put_replicated(&id, &live(&stored, json!("kept"))).await.unwrap(), Applied);
    let before = state(b, &id).await;
    let start = position_after_earlier_writes(b).await;
    let descendant = |ancestry: Vec<String>| ReplicatedRevision {
        rev: Revision(ancestry[0].clone()),
        ..live(&ancestry, json!("refused"))
    };
    let upper = format!("3-{}", "C".repeat(32));
    let refused: Vec<(&str, ReplicatedRevision, &str)> = vec![
        ("upper-case hex", descendant(vec![upper, stored[0].clone(), stored[1].clone()]), "_rev"),
        ("generation 0", descendant(vec![format!("0-{}", "c".repeat(32))]), "_rev"),
        ("short id", descendant(vec![format!("3-{}", "c".repeat(31)), stored[0].clone()]), "_rev"),
        ("no generation", descendant(vec!["c".repeat(32)]), "_rev"),
        (
            "ancestry not starting with the revision",
            ReplicatedRevision { rev: Revision(rev(3, 'c')), ..live(&stored, json!("refused")) },
            "_revisions",
        ),
        ("a generation skipped", descendant(vec![rev(4, 'c'), stored[0].clone(), stored[1].clone()]), "_revisions"),
        ("a malformed ancestor", descendant(vec![rev(3, 'c'), "2-xyz".into(), stored[1].clone()]), "_revisions"),
    ];
    for (what, incoming, field) in refused {
        let err = b.put_replicated(&id, &incoming).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{what}: {err}");
        assert!(err.to_string().contains(field), "{what}: {err} does not name {field}");
        assert_eq!(state(b, &id).await, before, "{what} changed nothing");
    }
    let err = b.put_replicated("_local/replicated", &live(&[rev(1, 'a')], json!(1))).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "_local/replicated: {err}");
    assert!(err.to_string().contains("_id"), "_local/replicated: {err} does not name _id");
    assert_eq!(b.get_local("replicated").await.unwrap(), None, "no local document was written");
    // A valid write after them is the only change in the feed.
    let marker = id_of("u", "ns", "marker");
    b.put(&marker, &body("u", "ns", "marker", json!(1)), Precondition::MustNotExist).await.unwrap();
    let mut view = BTreeMap::new();
    let mut order = Vec::new();
    follow_until(b, Some(start), &mut view, &mut order, |v| v.contains_key(&marker)).await;
    assert_eq!(order, [marker], "refused revisions left the feed alone");
}

/// A deletion that carries fields keeps them in its tombstone, as CouchDB does (it answers them
/// to `?rev=`, `open_revs`, `_bulk_get` and `_changes?include_docs`): exactly as sent, numbers
/// and text included. A plain delete keeps none; a live or unknown document has no tombstone; and
/// the kept fields never make the tombstone visible to the data-store listings.
pub async fn a_deletions_fields_are_kept_in_its_tombstone(ctx: Ctx) {
    let store = ctx.store().await;
    let b = ctx.backend.as_ref();
    let id = id_of("u", "ns", "k");
    let (first, second) = (rev(1, 'a'), rev(2, 'b'));
    assert_eq!(b.put_replicated(&id, &live(std::slice::from_ref(&first), json!(1))).await.unwrap(), Applied);
    assert_eq!(b.get_deleted(&id).await.unwrap(), None, "a live document has no tombstone");
    let fields: Map<String, Value> = json!({
        "userId": "u", "namespace": "ns", "key": "k",
        "value": {"price": 1.5, "count": 12345, "text": "é – 🚀", "none": null},
        "reason": "gone"
    })
    .as_object()
    .cloned()
    .unwrap();
    let deletion = ReplicatedRevision { body: fields.clone(), ..deleted(&[second.clone(), first]) };
    assert_eq!(b.put_replicated(&id, &deletion).await.unwrap(), Applied);
    assert_eq!(b.get(&id).await.unwrap(), None);
    let tombstone = b.get_deleted(&id).await.unwrap().expect("the tombstone");
    assert_eq!((tombstone.id.as_str(), tombstone.rev.as_str()), (id.as_str(), second.as_str()));
    assert_eq!(
        serde_json::to_string(&tombstone.body).unwrap(),
        serde_json::to_string(&fields).unwrap(),
        "the deletion's fields, exactly as sent"
    );
    assert!(store.list_keys("u", "ns").await.unwrap().is_empty(), "the tombstone is not listed");
    assert!(store.list_namespaces("u").await.unwrap().is_empty(), "nor its namespace");
    let listed = b.all_docs(&IdRange::all(), 10, None).await.unwrap().items;
    assert!(listed.is_empty(), "nor in id order: {listed:?}");

    // Where a tombstone is one record (DynamoDB, Firestore) its fields take at most 350,000 bytes
    // compressed: past it the deletion is refused naming the bound, and nothing changes.
    let other = id_of("u", "ns", "big");
    let (big_first, big_second) = (rev(1, 'd'), rev(2, 'e'));
    assert_eq!(b.put_replicated(&other, &live(std::slice::from_ref(&big_first), json!(0))).await.unwrap(), Applied);
    let mut noise = String::with_capacity(900_000);
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    while noise.len() < 900_000 {
        // Text gzip cannot shrink much: pseudo-random letters.
        state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        noise.push(char::from(b'a' + (state >> 59) as u8 % 26));
    }
    let mut big = body("u", "ns", "big", json!(noise));
    big.insert("reason".into(), json!("too big for one record"));
    let big_deletion = ReplicatedRevision { body: big.clone(), ..deleted(&[big_second.clone(), big_first.clone()]) };
    let one_record = ["dynamodb", "firestore"].contains(&ctx.backend_name);
    match b.put_replicated(&other, &big_deletion).await {
        Ok(outcome) => {
            assert!(!one_record, "{} took a tombstone past its bound", ctx.backend_name);
            assert_eq!(outcome, Applied, "{}", ctx.backend_name);
            let kept = b.get_deleted(&other).await.unwrap().expect("the big tombstone");
            assert_eq!(kept.body, big, "a store that takes it keeps it whole");
        }
        Err(err) => {
            assert_eq!(err.kind(), ErrorKind::TooLarge, "{err}");
            assert!(err.message().contains("350000"), "names the bound: {}", err.message());
            assert!(one_record, "{}: {err}", ctx.backend_name);
            assert_eq!(revisions(b, &other).await.rev.as_str(), big_first, "nothing changed");
        }
    }

    // A plain delete keeps no fields.
    let plain = id_of("u", "ns", "plain");
    let live_rev = b.put(&plain, &body("u", "ns", "plain", json!(2)), Precondition::MustNotExist).await.unwrap();
    let gone = b.delete(&plain, &live_rev).await.unwrap();
    let tombstone = b.get_deleted(&plain).await.unwrap().expect("the plain tombstone");
    assert_eq!((tombstone.rev, tombstone.body), (gone, Map::new()));

    // Re-created over its tombstone, the document has none; an unknown id never had one.
    let third = rev(3, 'c');
    assert_eq!(b.put_replicated(&id, &live(&[third, second], json!(3))).await.unwrap(), Applied);
    assert_eq!(b.get_deleted(&id).await.unwrap(), None, "live again");
    assert_eq!(b.get_deleted(&id_of("u", "ns", "never")).await.unwrap(), None);
}
