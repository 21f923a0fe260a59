//! Contract cases for CouchDB's document model on every backend: revisions and their ancestry,
//! tombstones, the change feed (with writers in several processes), id order, erasure and local
//! documents. Like `cases.rs`, they use only the facade and the `DocumentBackend` trait.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentstore::backend::{
    BulkWrite, ChangesPage, DocumentBackend, EraseOptions, IdRange, LayoutState, Precondition, Revision, RevisionInfo,
};
use agentstore::ErrorKind;
use serde_json::{json, Value};

use crate::harness::Ctx;

/// How long a follower may take to see a write. Backends without one sequence authority hold
/// changes back for a settle window; every test server here uses a short one.
const FEED_DEADLINE: Duration = Duration::from_secs(60);

pub(crate) fn id_of(user: &str, namespace: &str, key: &str) -> String {
    agentstore::model::DocumentId::new(user, namespace, key, &Default::default()).expect("valid id").as_str().to_owned()
}

pub(crate) use crate::common::body;

/// `N-<32 lowercase hex>` (or CouchDB's local `0-N`): N.
pub(crate) fn generation(rev: &Revision) -> u64 {
    let (generation, hex) = rev.as_str().split_once('-').unwrap_or_else(|| panic!("{rev}: no '-'"));
    assert!(
        hex.len() == 32 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')),
        "{rev}: the part after '-' is not 32 lowercase hex digits"
    );
    generation.parse().unwrap_or_else(|_| panic!("{rev}: generation is not a number"))
}

pub(crate) async fn revisions(backend: &dyn DocumentBackend, id: &str) -> RevisionInfo {
    backend.revisions(id).await.expect("revisions").unwrap_or_else(|| panic!("{id}: no revisions"))
}

/// Follows the feed from `since` until `done` says the view is complete or the deadline passes;
/// the view maps each id to its latest change. Checks every page's promises on the way.
pub(crate) async fn follow_until(
    backend: &dyn DocumentBackend,
    since: Option<String>,
    view: &mut BTreeMap<String, (Revision, bool)>,
    order: &mut Vec<String>,
    done: impl Fn(&BTreeMap<String, (Revision, bool)>) -> bool,
) -> Option<String> {
    let started = Instant::now();
    let mut since = since;
    loop {
        let ChangesPage { changes, last_seq, .. } = backend.changes(since.as_deref(), 7).await.expect("changes");
        assert!(changes.len() <= 7, "a page of {} changes for a limit of 7", changes.len());
        let mut in_page = std::collections::HashSet::new();
        for change in &changes {
            assert!(in_page.insert(change.id.clone()), "{} twice in one page", change.id);
            assert!(!change.id.starts_with("_local/"), "a local document in the feed");
            order.retain(|id| id != &change.id);
            order.push(change.id.clone());
            view.insert(change.id.clone(), (change.rev.clone(), change.deleted));
        }
        let empty = changes.is_empty();
        since = Some(last_seq);
        if done(view) {
            return since;
        }
        assert!(started.elapsed() < FEED_DEADLINE, "the feed did not deliver every change within {FEED_DEADLINE:?}");
        if empty {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

// ---- revisions, ancestry, tombstones ----

pub async fn revisions_have_couchdb_form_ancestry_and_tombstones(ctx: Ctx) {
    let b = ctx.backend.as_ref();
    let id = id_of("u", "ns", "k");
    let mut history = vec![b.put(&id, &body("u", "ns", "k", json!(0)), Precondition::MustNotExist).await.unwrap()];
    for n in 1..4 {
        let previous = Precondition::MatchRevision(history.last().unwrap().clone());
        history.push(b.put(&id, &body("u", "ns", "k", json!(n)), previous).await.unwrap());
    }
    let generations: Vec<u64> = history.iter().map(generation).collect();
    assert_eq!(generations, [1, 2, 3, 4]);
    let info = revisions(b, &id).await;
    assert_eq!((&info.rev, info.deleted), (history.last().unwrap(), false));
    let newest_first: Vec<Revision> = history.iter().rev().cloned().collect();
    assert_eq!(info.ancestry.revisions().collect::<Vec<_>>(), newest_first, "ancestry, newest first");

    // A delete leaves a tombstone with the next generation.
    let deleted = b.delete(&id, history.last().unwrap()).await.unwrap();
    let tombstone = revisions(b, &id).await;
    assert!(tombstone.deleted);
    assert_eq!(tombstone.rev, deleted, "delete returns the tombstone's revision");
    assert_eq!(generation(&tombstone.rev), 5);
    assert_eq!(tombstone.ancestry.revisions().nth(1).as_ref(), history.last(), "the tombstone's parent");
    assert_eq!(b.delete(&id, &tombstone.rev).await.unwrap_err().kind(), ErrorKind::NotFound);
    let stale = Precondition::MatchRevision(tombstone.rev.clone());
    assert_eq!(b.put(&id, &body("u", "ns", "k", json!(9)), stale).await.unwrap_err().kind(), ErrorKind::Conflict);

    // Re-creating continues from the tombstone's generation, and its revision is new.
    let recreated = b.put(&id, &body("u", "ns", "k", json!(6)), Precondition::MustNotExist).await.unwrap();
    assert_eq!(generation(&recreated), 6);
    let info = revisions(b, &id).await;
    assert!(!info.deleted);
    assert_eq!(info.ancestry.revisions().take(2).collect::<Vec<_>>(), [recreated.clone(), tombstone.rev.clone()]);
    let every_rev: std::collections::HashSet<&Revision> = history.iter().chain([&tombstone.rev, &recreated]).collect();
    assert_eq!(every_rev.len(), 6, "no revision is reused");

    // Unconditional writes (migration's overwrite) continue generations too, in bulk as alone.
    let overwritten = b.put(&id, &body("u", "ns", "k", json!(7)), Precondition::None).await.unwrap();
    assert_eq!(generation(&overwritten), 7);
    let bulk = b
        .bulk_write(vec![BulkWrite {
            id: id.clone(),
            body: body("u", "ns", "k", json!(8)),
            precondition: Precondition::None,
        }])
        .await
        .unwrap();
    assert_eq!(generation(bulk[0].as_ref().unwrap()), 8);
    assert_eq!(b.get(&id).await.unwrap().unwrap().rev, *bulk[0].as_ref().unwrap());
    assert_eq!(b.revisions(&id_of("u", "ns", "never")).await.unwrap(), None);
}

pub async fn bulk_write_applies_writes_to_one_id_in_order(ctx: Ctx) {
    // CouchDB's `_bulk_docs` applies writes to one id one after another; so must every backend,
    // even where it writes a batch's documents concurrently.
    let b = &ctx.backend;
    let keys: Vec<String> = (0..8).map(|n| format!("k{n}")).collect();
    let mut writes = Vec::new();
    for (round, precondition) in
        [Precondition::None, Precondition::MustNotExist, Precondition::None].into_iter().enumerate()
    {
        for key in &keys {
            writes.push(BulkWrite {
                id: id_of("u", "ns", key),
                body: body("u", "ns", key, json!(round)),
                precondition: precondition.clone(),
            });
        }
    }
    let results = b.bulk_write(writes).await.unwrap();
    for (n, key) in keys.iter().enumerate() {
        let first = results[n].as_ref().expect("the first write creates");
        assert_eq!(
            results[keys.len() + n].as_ref().unwrap_err().kind(),
            ErrorKind::Conflict,
            "{key}: create after create"
        );
        let last = results[2 * keys.len() + n].as_ref().expect("the last write overwrites");
        assert_eq!((generation(first), generation(last)), (1, 2), "{key}");
        let stored = b.get(&id_of("u", "ns", key)).await.unwrap().unwrap();
        assert_eq!((stored.body["value"].clone(), &stored.rev), (json!(2), last));
    }
}

pub async fn tombstones_are_invisible_to_every_listing(ctx: Ctx) {
    let store = ctx.store().await;
    let b = ctx.backend.as_ref();
    for key in ["a", "b", "c"] {
        store.set("u", "ns", key, json!(key), None, None).await.unwrap();
    }
    store.set("u", "only-deleted", "x", json!(1), None, None).await.unwrap();
    // Counts include design documents (CouchDB's index), so compare with the count before.
    let counted_before = b.exact_count().await.unwrap();
    assert!(store.delete("u", "ns", "b").await.unwrap());
    assert!(store.delete("u", "only-deleted", "x").await.unwrap());
    let deleted = id_of("u", "ns", "b");
    assert!(revisions(b, &deleted).await.deleted, "the delete left a tombstone");

    assert_eq!(b.get(&deleted).await.unwrap(), None);
    assert_eq!(b.get_many(std::slice::from_ref(&deleted)).await.unwrap(), vec![None]);
    assert_eq!(store.list_keys("u", "ns").await.unwrap(), ["a", "c"]);
    assert_eq!(store.list_namespaces("u").await.unwrap(), ["ns"]);
    assert_eq!(store.get_all("u", "ns").await.unwrap().keys().collect::<Vec<_>>(), ["a", "c"]);
    assert!(!store.exists("u", "ns", "b").await.unwrap());
    let scanned = scan_ids(b).await;
    assert_eq!(scanned, [id_of("u", "ns", "a"), id_of("u", "ns", "c")]);
    let listed: Vec<String> =
        b.all_docs(&IdRange::all(), 100, None).await.unwrap().items.into_iter().map(|d| d.id).collect();
    assert_eq!(listed, scanned, "all_docs lists the live documents only");
    if let (Some(count), Some(before)) = (b.exact_count().await.unwrap(), counted_before) {
        assert_eq!(count, before - 2, "tombstones are not counted");
    }
    // A delete through the facade of what is already deleted finds nothing.
    assert!(!store.delete("u", "ns", "b").await.unwrap());
}

async fn scan_ids(b: &dyn DocumentBackend) -> Vec<String> {
    let mut ids = Vec::new();
    let mut token = None;
    loop {
        let page = b.scan(2, token.as_deref()).await.expect("scan");
        ids.extend(page.items.into_iter().map(|d| d.id));
        match page.next {
            Some(next) => token = Some(next),
            None => break,
        }
    }
    ids.sort();
    ids
}

pub async fn erasure_leaves_no_trace_of_the_user(ctx: Ctx) {
    let store = ctx.store().await;
    let b = ctx.backend.as_ref();
    for key in ["a", "b", "c", "d"] {
        store.set("gone", "ns", key, json!(1), None, None).await.unwrap();
        store.set("gone", "other-ns", key, json!(1), None, None).await.unwrap();
        store.set("stays", "ns", key, json!(1), None, None).await.unwrap();
    }
    // Earlier deletes left tombstones under the user's ids.
    store.delete("gone", "ns", "a").await.unwrap();
    store.delete_namespace("gone", "other-ns").await.unwrap();
    store.delete("stays", "ns", "a").await.unwrap();
    if erasure_refused_untouched(&ctx, &store, "gone").await {
        assert_eq!(store.list_keys("gone", "ns").await.unwrap(), ["b", "c", "d"], "a refused erasure changes nothing");
        return;
    }
    assert_eq!(store.purge_user("gone").await.unwrap(), 3, "the live documents erased");
    for ns in ["ns", "other-ns"] {
        for key in ["a", "b", "c", "d"] {
            let id = id_of("gone", ns, key);
            assert_eq!(b.revisions(&id).await.unwrap(), None, "{id}: a trace is left");
        }
    }
    let mut view = BTreeMap::new();
    let expected = 4; // the other user's three documents and one tombstone
    follow_until(b, None, &mut view, &mut Vec::new(), |view| view.len() >= expected).await;
    assert!(view.keys().all(|id| id.starts_with("stays:")), "the feed still names an erased id: {view:?}");
    assert_eq!(view.len(), expected);
    assert!(revisions(b, &id_of("stays", "ns", "a")).await.deleted, "another user's tombstone is kept");
    assert_eq!(store.list_keys("stays", "ns").await.unwrap(), ["b", "c", "d"]);
}

/// An erasure that keeps finding the user's documents (here one whose body names the user under
/// another user's id, which no write path accepts but a store can hold) ends with an error after
/// a bounded number of passes instead of running forever.
pub async fn erasure_that_keeps_finding_documents_ends(ctx: Ctx) {
    let store = ctx.store().await;
    let b = ctx.backend.as_ref();
    let foreign = id_of("other", "ns", "k");
    b.put(&foreign, &body("gone", "ns", "k", json!(1)), Precondition::MustNotExist).await.unwrap();
    // No id starts with `gone:`, so even a server that cannot erase (`Ctx::no_purge`) is never
    // asked to: the answer is the same everywhere.
    let err = store.purge_user("gone").await.expect_err("the document under another id stays listed");
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    assert!(err.message().contains("erasure passes"), "{err}");
    assert!(b.get(&foreign).await.unwrap().is_some(), "another user's id is not erased");
}

/// `erase_id` removes one id, live or a tombstone, with its feed entry and (on DynamoDB and
/// Firestore) its body's chunks, and nothing of any id that starts with it: a live one, a
/// tombstone, one shaped like DynamoDB's chunk ids. A follower's position from before the erasure
/// still reads the next write.
pub async fn erasure_of_one_id_keeps_ids_that_start_with_it(ctx: Ctx) {
    let b = ctx.backend.as_ref();
    let one = id_of("ex", "ns", "one");
    // 1.2 MB of noise: chunk items on DynamoDB, a chunk document on Firestore.
    let big = json!({ "noise": crate::common::corpus::noise(1_200_000, 35) });
    b.put(&one, &body("ex", "ns", "one", big), Precondition::MustNotExist).await.unwrap();
    let live = format!("{one}1");
    let live_rev = b.put(&live, &body("ex", "ns", "one1", json!(1)), Precondition::MustNotExist).await.unwrap();
    let chunk_like = format!("{one}#chunk#1-x#1");
    b.put(&chunk_like, &body("ex", "ns", "chunk-like", json!(2)), Precondition::MustNotExist).await.unwrap();
    let gone = format!("{one}2");
    let gone_rev = b.put(&gone, &body("ex", "ns", "one2", json!(3)), Precondition::MustNotExist).await.unwrap();
    b.delete(&gone, &gone_rev).await.unwrap();
    let tombstone = revisions(b, &gone).await.rev;
    let kept = |view: &BTreeMap<String, (Revision, bool)>| view.len() >= 4;
    let before = follow_until(b, None, &mut BTreeMap::new(), &mut Vec::new(), kept).await;
    if let Some(why) = &ctx.no_purge {
        let refused =
            b.erase_id(&one, &EraseOptions::default()).await.expect_err("erasure without _purge must be refused");
        assert_eq!(refused.kind(), ErrorKind::Misconfigured, "{why}: {refused}");
        assert!(b.get(&one).await.unwrap().is_some(), "a refused erasure changes nothing");
        return;
    }

    assert!(b.erase_id(&one, &EraseOptions::default()).await.unwrap(), "the document was there");
    assert_eq!(b.revisions(&one).await.unwrap(), None, "a trace of the erased id is left");
    assert!(!b.erase_id(&one, &EraseOptions::default()).await.unwrap(), "nothing left to erase");
    assert_eq!(b.get(&live).await.unwrap().map(|doc| doc.rev), Some(live_rev.clone()), "a live id under it");
    assert_eq!(b.get(&chunk_like).await.unwrap().map(|doc| doc.body["value"].clone()), Some(json!(2)));
    assert_eq!(revisions(b, &gone).await.rev, tombstone, "a tombstone under it is kept");
    let mut feed = BTreeMap::new();
    follow_until(b, None, &mut feed, &mut Vec::new(), |view| view.len() >= 3).await;
    let expected = BTreeMap::from([
        (live.clone(), (live_rev, false)),
        (chunk_like.clone(), (revisions(b, &chunk_like).await.rev, false)),
        (gone.clone(), (tombstone, true)),
    ]);
    assert_eq!(feed, expected, "the feed keeps every other id, and only them");

    // The erased id can be written again from nothing, and a follower from before the erasure
    // reads that write next. An erased id counts as never written where the backend can check
    // that (`checks_never_written`); the CouchDB backend answers every such write with a conflict
    // (a real CouchDB, whose `_purge` works, reaches this: pouchdb-server's erasure is refused
    // above), so there it is a plain create.
    let create = if b.checks_never_written() { Precondition::NeverWritten } else { Precondition::MustNotExist };
    let again = b.put(&one, &body("ex", "ns", "one", json!(4)), create).await.expect("a new id");
    let mut next = BTreeMap::new();
    follow_until(b, before, &mut next, &mut Vec::new(), |view| view.contains_key(&one)).await;
    assert_eq!(next[&one], (again, false), "the write after the erasure");
}

/// `erase_id` with a revision (`EraseOptions::if_revision`) erases only while the document is at
/// it, live or a tombstone: a stale revision (another process wrote since) answers `Conflict`
/// and leaves the document, its revision and its feed entry as they were; nothing stored under
/// the id is a conflict too; the current revision erases.
pub async fn erasure_on_a_stale_revision_is_a_conflict(ctx: Ctx) {
    let b = ctx.backend.as_ref();
    let live = id_of("cas", "ns", "live");
    let first = b.put(&live, &body("cas", "ns", "live", json!(1)), Precondition::MustNotExist).await.unwrap();
    let second =
        b.put(&live, &body("cas", "ns", "live", json!(2)), Precondition::MatchRevision(first.clone())).await.unwrap();
    let refused = b.erase_id(&live, &EraseOptions::if_revision(first)).await.expect_err("a stale revision");
    assert_eq!(refused.kind(), ErrorKind::Conflict, "{refused}");
    let kept = b.get(&live).await.unwrap().expect("the document is kept");
    assert_eq!((kept.rev, kept.body["value"].clone()), (second.clone(), json!(2)), "as the later write left it");

    let gone = id_of("cas", "ns", "gone");
    let created = b.put(&gone, &body("cas", "ns", "gone", json!(3)), Precondition::MustNotExist).await.unwrap();
    b.delete(&gone, &created).await.unwrap();
    let tombstone = revisions(b, &gone).await.rev;
    let refused = b.erase_id(&gone, &EraseOptions::if_revision(created)).await.expect_err("the live revision");
    assert_eq!(refused.kind(), ErrorKind::Conflict, "a tombstone's revision is another: {refused}");
    assert_eq!(revisions(b, &gone).await.rev, tombstone, "the tombstone is kept");
    let never = id_of("cas", "ns", "never");
    let refused = b.erase_id(&never, &EraseOptions::if_revision(second.clone())).await.expect_err("nothing stored");
    assert_eq!(refused.kind(), ErrorKind::Conflict, "{refused}");

    let mut feed = BTreeMap::new();
    follow_until(b, None, &mut feed, &mut Vec::new(), |view| view.len() >= 2).await;
    let expected = BTreeMap::from([(live.clone(), (second.clone(), false)), (gone.clone(), (tombstone.clone(), true))]);
    assert_eq!(feed, expected, "a refused erasure leaves the feed as it was");

    if let Some(why) = &ctx.no_purge {
        let refused = b.erase_id(&live, &EraseOptions::if_revision(second)).await.expect_err("no _purge");
        assert_eq!(refused.kind(), ErrorKind::Misconfigured, "{why}: {refused}");
        return;
    }
    assert!(b.erase_id(&live, &EraseOptions::if_revision(second)).await.unwrap(), "at its revision: erased");
    assert!(b.erase_id(&gone, &EraseOptions::if_revision(tombstone)).await.unwrap(), "a tombstone at its revision");
    assert_eq!(b.revisions(&live).await.unwrap(), None, "no trace of the erased document");
    assert_eq!(b.revisions(&gone).await.unwrap(), None, "no trace of the erased tombstone");
}

/// On a test server that cannot erase without trace (`Ctx::no_purge`), checks that erasure is
/// refused with an error that says why, and returns `true` (the caller then checks nothing
/// changed). Everywhere else `false`: the caller checks the erasure itself.
pub async fn erasure_refused_untouched(ctx: &Ctx, store: &agentstore::store::DataStore, user: &str) -> bool {
    let Some(why) = &ctx.no_purge else { return false };
    let refused = store.purge_user(user).await.expect_err("erasure without _purge must be refused");
    assert_eq!(refused.kind(), ErrorKind::Misconfigured, "{refused}");
    assert!(refused.to_string().contains("_purge"), "the refusal says why: {refused}");
    println!("{}: erasure refused as it must be: {why}", ctx.backend_name);
    true
}

// ---- the change feed ----

pub async fn change_feed_is_ordered_complete_and_resumable(ctx: Ctx) {
    let b = ctx.backend.as_ref();
    assert_eq!(b.layout().await.unwrap(), LayoutState::Current, "a new store has the current layout");
    let [a, bb, c] = ["a", "b", "c"].map(|k| id_of("u", "ns", k));
    let rev_a = b.put(&a, &body("u", "ns", "a", json!(1)), Precondition::MustNotExist).await.unwrap();
    let rev_b = b.put(&bb, &body("u", "ns", "b", json!(1)), Precondition::MustNotExist).await.unwrap();
    b.put(&c, &body("u", "ns", "c", json!(1)), Precondition::MustNotExist).await.unwrap();
    let mut view = BTreeMap::new();
    let mut order = Vec::new();
    let middle = follow_until(b, None, &mut view, &mut order, |v| v.len() == 3).await;
    assert_eq!(order, [a.clone(), bb.clone(), c.clone()], "feed order is write order");

    let rev_a2 = b.put(&a, &body("u", "ns", "a", json!(2)), Precondition::MatchRevision(rev_a)).await.unwrap();
    b.delete(&bb, &rev_b).await.unwrap();
    let tombstone_b = revisions(b, &bb).await.rev;
    // From the middle: exactly the two later changes, in order, at their latest revisions.
    let mut later = BTreeMap::new();
    let mut later_order = Vec::new();
    follow_until(b, middle, &mut later, &mut later_order, |v| v.len() >= 2).await;
    assert_eq!(later_order, [a.clone(), bb.clone()]);
    assert_eq!(later[&a], (rev_a2.clone(), false));
    assert_eq!(later[&bb], (tombstone_b.clone(), true), "a delete is flagged");

    // From the start: every document once, at its latest revision, tombstone included.
    let mut all = BTreeMap::new();
    let mut all_order = Vec::new();
    follow_until(b, None, &mut all, &mut all_order, |v| v.len() == 3 && v[&a].0 == rev_a2).await;
    assert_eq!(all_order, [c.clone(), a.clone(), bb.clone()]);
    assert_eq!(all[&bb], (tombstone_b, true));

    // `change_position` is "now": only what is written after it.
    let now = b.change_position().await.unwrap();
    let d = id_of("u", "ns", "d");
    b.put(&d, &body("u", "ns", "d", json!(1)), Precondition::MustNotExist).await.unwrap();
    let mut after_now = BTreeMap::new();
    let mut after_now_order = Vec::new();
    follow_until(b, Some(now), &mut after_now, &mut after_now_order, |v| v.contains_key(&d)).await;
    assert_eq!(after_now_order, [d]);
    assert_eq!(b.changes(Some("not a token"), 5).await.unwrap_err().kind(), ErrorKind::InvalidInput);
}

/// A feed read from any position it handed out, the `seq` of one row in the middle of a page
/// included, reaches the present: read until `pending` says the end, it reports every write
/// acknowledged (a settle window, `change_feed_delay`, before the read) after that position.
/// CouchDB's replicators resume from the last row's `seq` and stop at the first empty answer, so
/// a backend that ended such a read at what it saw when the page was first read would leave
/// later writes out of that replication.
pub async fn a_read_from_a_row_seq_reaches_the_present(ctx: Ctx) {
    let b = ctx.backend.as_ref();
    let ids = ["a", "b", "c"].map(|k| id_of("u", "rows", k));
    for (key, id) in ["a", "b", "c"].iter().zip(&ids) {
        b.put(id, &body("u", "rows", key, json!(1)), Precondition::MustNotExist).await.unwrap();
    }
    tokio::time::sleep(b.change_feed_delay()).await;
    let first = b.changes(None, 1).await.expect("changes");
    let row_seq = match first.changes.as_slice() {
        [row] => row.seq.clone(),
        rows => panic!("a page of {} rows for a limit of 1", rows.len()),
    };
    let later = id_of("u", "rows", "later");
    b.put(&later, &body("u", "rows", "later", json!(1)), Precondition::MustNotExist).await.unwrap();
    tokio::time::sleep(b.change_feed_delay()).await;

    let mut seen = Vec::new();
    let mut since = row_seq;
    for _ in 0..100 {
        let page = b.changes(Some(&since), 1).await.expect("changes from a row's seq");
        seen.extend(page.changes.into_iter().map(|change| change.id));
        since = page.last_seq;
        if page.pending == Some(0) {
            break;
        }
    }
    assert!(
        seen.contains(&later),
        "a read from a row's seq ended without the write made after that row was read (saw {seen:?})"
    );
    for id in &ids[1..] {
        assert!(seen.contains(id), "{id}, after the row, is missing (saw {seen:?})");
    }
}

/// Reads the feed from `since` until a page says it is the end (`pending: Some(0)`), checking at
/// that page that every state in `expected` has been reported: a backend must never say the end
/// while a write acknowledged before the read is missing. The view and the last `last_seq`.
async fn read_to_the_end(
    backend: &dyn DocumentBackend,
    since: Option<String>,
    expected: &BTreeMap<String, (Revision, bool)>,
    what: &str,
) -> (BTreeMap<String, (Revision, bool)>, String) {
    let mut view = BTreeMap::new();
    let mut since = since;
    for _ in 0..500 {
        let page = backend.changes(since.as_deref(), 7).await.expect("changes");
        assert!(page.unsettled <= page.changes.len(), "{what}: more unsettled changes than changes");
        for change in page.changes {
            view.insert(change.id, (change.rev, change.deleted));
        }
        since = Some(page.last_seq.clone());
        if page.pending == Some(0) {
            let missing: Vec<&String> =
                expected.iter().filter(|(id, state)| view.get(*id) != Some(*state)).map(|(id, _)| id).collect();
            assert!(
                missing.is_empty(),
                "{what}: the feed said pending 0 while {} of {} acknowledged writes were unreported: {missing:?}",
                missing.len(),
                expected.len()
            );
            return (view, page.last_seq);
        }
    }
    panic!("{what}: the feed did not reach its end in 500 pages");
}

/// Issue 22: a write acknowledged before a feed read begins is in that read, on every backend
/// (CouchDB shows a write in `_changes` as soon as it is acknowledged; a backend with a settle
/// window used to hold it back for the window while answering `pending: 0`). No sleep between
/// the writes and the reads. Then, from the `last_seq` such a read returned, nothing is lost:
/// later writes show at once, and once the settle window has passed a read from it still
/// reaches every document's final state (a change may come twice, never not at all).
pub async fn acknowledged_writes_are_in_the_next_read(ctx: Ctx) {
    let b = ctx.backend.as_ref();
    let start = b.change_position().await.expect("change_position");
    const N: usize = 30;
    let key = |n: usize| format!("k{n}");
    let writes = (0..N)
        .map(|n| BulkWrite {
            id: id_of("u", "now", &key(n)),
            body: body("u", "now", &key(n), json!(n)),
            precondition: Precondition::MustNotExist,
        })
        .collect();
    let mut truth = BTreeMap::new();
    for (n, rev) in b.bulk_write(writes).await.expect("bulk write").into_iter().enumerate() {
        truth.insert(id_of("u", "now", &key(n)), (rev.expect("created"), false));
    }
    let (updated, deleted) = (id_of("u", "now", &key(0)), id_of("u", "now", &key(1)));
    let rev = b
        .put(
            &updated,
            &body("u", "now", &key(0), json!("again")),
            Precondition::MatchRevision(truth[&updated].0.clone()),
        )
        .await
        .expect("update");
    truth.insert(updated.clone(), (rev, false));
    let tombstone = b.delete(&deleted, &truth[&deleted].0).await.expect("delete");
    truth.insert(deleted.clone(), (tombstone, true));

    let (_, after_first) = read_to_the_end(b, Some(start.clone()), &truth, "from a position before the writes").await;
    read_to_the_end(b, None, &truth, "from the start of the feed").await;

    // Later writes show at once from the `last_seq` just returned.
    let mut later = BTreeMap::new();
    for n in N..N + 5 {
        let id = id_of("u", "now", &key(n));
        let rev = b.put(&id, &body("u", "now", &key(n), json!(n)), Precondition::MustNotExist).await.expect("create");
        later.insert(id, (rev, false));
    }
    let rev = b
        .put(
            &updated,
            &body("u", "now", &key(0), json!("thrice")),
            Precondition::MatchRevision(truth[&updated].0.clone()),
        )
        .await
        .expect("update");
    later.insert(updated.clone(), (rev, false));
    truth.extend(later.clone());
    read_to_the_end(b, Some(after_first.clone()), &later, "from the last_seq of the first read").await;

    // Once the window has passed, the same tokens still lead to every final state.
    tokio::time::sleep(b.change_feed_delay()).await;
    read_to_the_end(b, Some(after_first), &later, "from the first last_seq, after the settle window").await;
    read_to_the_end(b, Some(start), &truth, "from before the writes, after the settle window").await;
}

/// One read of the feed from `since` to its end (`pending: Some(0)`) in pages of `limit`: the ids
/// in the order reported, the last `last_seq` and how many of the changes were unsettled.
async fn one_read_to_the_end(
    backend: &dyn DocumentBackend,
    since: Option<&str>,
    limit: usize,
) -> (Vec<String>, String, usize) {
    let (mut ids, mut unsettled) = (Vec::new(), 0);
    let mut since = since.map(str::to_owned);
    for _ in 0..100 {
        let page = backend.changes(since.as_deref(), limit).await.expect("changes");
        ids.extend(page.changes.into_iter().map(|change| change.id));
        unsettled += page.unsettled;
        if page.pending == Some(0) {
            return (ids, page.last_seq, unsettled);
        }
        since = Some(page.last_seq);
    }
    panic!("the feed did not reach its end in 100 pages");
}

/// Two reads of the feed to its end with no write between them answer the same `last_seq`, from
/// the start and from a token: CouchDB's names the last change, so it stays while nothing
/// changes (PouchDB's tests compare two reads, and a replicator handed a new one by its last,
/// empty read writes its checkpoint again). The clock moves between the reads, as it does
/// between a replicator's. And a write made after that is in the next read from either token.
pub async fn last_seq_stays_while_nothing_is_written(ctx: Ctx) {
    let b = ctx.backend.as_ref();
    let pause = || tokio::time::sleep(Duration::from_millis(5));

    let (none, empty_first, _) = one_read_to_the_end(b, None, 10).await;
    pause().await;
    let (_, empty_again, _) = one_read_to_the_end(b, None, 10).await;
    assert!(none.is_empty(), "an empty store's feed reported {none:?}");
    assert_eq!(empty_first, empty_again, "two reads of an empty feed from the start");

    let ids = ["a", "b", "c"].map(|k| id_of("u", "stable", k));
    for (key, id) in ["a", "b", "c"].iter().zip(&ids) {
        b.put(id, &body("u", "stable", key, json!(1)), Precondition::MustNotExist).await.unwrap();
    }
    // At once: a backend with a settle window reports these writes in its unsettled tail, and a
    // write may settle between the two reads (then the token says so, and may differ).
    let (seen, recent_first, unsettled_first) = one_read_to_the_end(b, None, 10).await;
    pause().await;
    let (_, recent_again, unsettled_again) = one_read_to_the_end(b, None, 10).await;
    assert_eq!(seen, ids, "the feed from the start right after the writes");
    if unsettled_first == unsettled_again {
        assert_eq!(recent_first, recent_again, "two reads from the start right after the writes");
    }

    // Once every write has settled, the answer is the same however far the clock moves.
    tokio::time::sleep(b.change_feed_delay()).await;
    let started = Instant::now();
    loop {
        let (seen, _, unsettled) = one_read_to_the_end(b, None, 10).await;
        if unsettled == 0 && seen == ids {
            break;
        }
        assert!(started.elapsed() < FEED_DEADLINE, "the writes did not settle within {FEED_DEADLINE:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (seen, settled_first, _) = one_read_to_the_end(b, None, 10).await;
    pause().await;
    let (seen_again, settled_again, _) = one_read_to_the_end(b, None, 10).await;
    assert_eq!((&seen, &seen_again), (&ids.to_vec(), &ids.to_vec()), "the settled feed from the start");
    assert_eq!(settled_first, settled_again, "two reads from the start once the writes settled");
    // So do the rows' `seq`s (CouchDB's descending `_changes` answers its last row's as `last_seq`).
    let row_seqs = || async {
        let page = b.changes(None, 10).await.expect("changes");
        page.changes.into_iter().map(|change| change.seq).collect::<Vec<String>>()
    };
    let first_rows = row_seqs().await;
    pause().await;
    assert_eq!(first_rows, row_seqs().await, "the rows' seqs of two reads from the start");
    let from_token = Some(settled_first.as_str());
    let (nothing, token_first, _) = one_read_to_the_end(b, from_token, 1).await;
    pause().await;
    let (nothing_again, token_again, _) = one_read_to_the_end(b, from_token, 1).await;
    assert!(nothing.is_empty() && nothing_again.is_empty(), "new changes with no write: {nothing:?} {nothing_again:?}");
    assert_eq!(token_first, token_again, "two reads from the last_seq of a read to the end");

    // The stable tokens still lead to what is written next.
    let later = id_of("u", "stable", "later");
    b.put(&later, &body("u", "stable", "later", json!(1)), Precondition::MustNotExist).await.unwrap();
    for (since, what) in [
        (&token_again, "the settled last_seq"),
        (&recent_again, "the last_seq right after the writes"),
        (&first_rows[0], "the first row's seq"),
    ] {
        let (seen, _, _) = one_read_to_the_end(b, Some(since), 1).await;
        assert!(seen.contains(&later), "a read from {what} ended without the later write (saw {seen:?})");
    }
}

/// Writers in several processes create, update and delete documents (several users and
/// namespaces, ids shared between processes so their writes conflict) while this process follows
/// the feed; afterwards the follower's view equals every document's final state. On the embedded
/// store, which one process opens at a time, the writers are separate facades in this process.
pub async fn a_follower_never_misses_a_committed_write(ctx: Ctx) {
    let mut follower_view = BTreeMap::new();
    let mut order = Vec::new();
    let start = ctx.backend.change_position().await.expect("change_position");
    let mut writers = match &ctx.url {
        Some(url) => crate::writer::spawn_processes(url, WRITERS),
        None => {
            let mut tasks = Vec::new();
            for writer in 0..WRITERS {
                let store = Arc::new(ctx.store().await);
                tasks.push(tokio::spawn(async move { crate::writer::write_mix(&store, writer).await }));
            }
            crate::writer::Writers::Tasks(tasks)
        }
    };
    // Follow while they write, until they are done.
    let backend = Arc::clone(&ctx.backend);
    let mut since = Some(start);
    while !writers.finished() {
        let page = backend.changes(since.as_deref(), 50).await.expect("changes while writers run");
        for change in page.changes {
            follower_view.insert(change.id.clone(), (change.rev, change.deleted));
            order.push(change.id);
        }
        since = Some(page.last_seq);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    writers.wait().await;
    // The truth, read after every writer stopped.
    let ids = crate::writer::all_ids(WRITERS);
    let mut truth = BTreeMap::new();
    for id in &ids {
        if let Some(info) = backend.revisions(id).await.expect("revisions") {
            truth.insert(id.clone(), (info.rev, info.deleted));
        }
    }
    assert!(truth.len() > ids.len() / 2, "the writers wrote most ids ({} of {})", truth.len(), ids.len());
    let expected = truth.clone();
    follow_until(backend.as_ref(), since, &mut follower_view, &mut order, move |view| {
        expected.iter().all(|(id, state)| view.get(id) == Some(state))
    })
    .await;
    let unexpected: Vec<&String> = follower_view.keys().filter(|id| !truth.contains_key(*id)).collect();
    assert!(unexpected.is_empty(), "the feed named ids never written: {unexpected:?}");
}

const WRITERS: usize = 3;

// ---- id order ----

/// Ids that stress raw collation: `:` (0x3A) before `_` (0x5F) before lowercase, uppercase before
/// lowercase, prefixes of each other, and multi-byte UTF-8 after ASCII.
fn collation_ids() -> Vec<String> {
    let mut ids = Vec::new();
    for (user, namespace) in [
        ("a", "ns"),
        ("A", "ns"),
        ("ab", "ns"),
        ("a_", "ns"),
        ("a", "ns:deeper"),
        ("a", "n"),
        ("Z", "x"),
        ("é", "ns"),
        ("日本", "ns"),
        ("e", "ns"),
        ("z", "ü"),
    ] {
        for key in ["k", "k2", "K", "é"] {
            ids.push(id_of(user, namespace, key));
        }
    }
    ids
}

async fn all_docs_ids(b: &dyn DocumentBackend, range: &IdRange, page: usize) -> Vec<String> {
    let mut ids = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let result = b.all_docs(range, page, token.as_deref()).await.expect("all_docs");
        assert!(result.items.len() <= page, "a page over its limit");
        ids.extend(result.items.into_iter().map(|d| d.id));
        match result.next {
            Some(next) => token = Some(next),
            None => return ids,
        }
    }
}

pub async fn all_docs_pages_in_raw_id_order_both_ways(ctx: Ctx) {
    let b = ctx.backend.as_ref();
    let mut ids = collation_ids();
    let writes = ids
        .iter()
        .map(|id| {
            let doc = agentstore::model::DocumentId::parse(id).unwrap();
            BulkWrite {
                id: id.clone(),
                body: body(doc.user_id(), doc.namespace(), doc.key(), json!(id)),
                precondition: Precondition::MustNotExist,
            }
        })
        .collect();
    for result in b.bulk_write(writes).await.unwrap() {
        result.expect("bulk write");
    }
    // A deleted document is not listed.
    let deleted = ids.pop().unwrap();
    let rev = b.get(&deleted).await.unwrap().unwrap().rev;
    b.delete(&deleted, &rev).await.unwrap();
    let mut ascending = ids.clone();
    ascending.sort_by(|x, y| x.as_bytes().cmp(y.as_bytes()));
    let descending: Vec<String> = ascending.iter().rev().cloned().collect();

    for page in [1, 3, 100] {
        assert_eq!(all_docs_ids(b, &IdRange::all(), page).await, ascending, "ascending, pages of {page}");
        let down = IdRange { descending: true, ..IdRange::all() };
        assert_eq!(all_docs_ids(b, &down, page).await, descending, "descending, pages of {page}");
    }
    // Ranges: bounds that are ids and bounds that fall between ids, both ends, both directions.
    let (low, high) = (ascending[5].clone(), ascending[30].clone());
    let between = format!("{}\u{0}", ascending[12]);
    for (start, end) in [(Some(low.clone()), Some(high.clone())), (Some(between.clone()), None), (None, Some(low))] {
        for inclusive_end in [true, false] {
            let up = IdRange {
                start: start.clone(),
                end: end.clone(),
                inclusive_end,
                descending: false,
                include_design: false,
            };
            let expected: Vec<String> = ascending
                .iter()
                .filter(|id| start.as_ref().is_none_or(|s| id.as_bytes() >= s.as_bytes()))
                .filter(|id| match &end {
                    None => true,
                    Some(e) if inclusive_end => id.as_bytes() <= e.as_bytes(),
                    Some(e) => id.as_bytes() < e.as_bytes(),
                })
                .cloned()
                .collect();
            assert_eq!(all_docs_ids(b, &up, 4).await, expected, "{up:?}");
            // The same range read downwards swaps the ends.
            let down = IdRange {
                start: end.clone(),
                end: start.clone(),
                inclusive_end,
                descending: true,
                include_design: false,
            };
            let expected_down: Vec<String> = ascending
                .iter()
                .rev()
                .filter(|id| end.as_ref().is_none_or(|s| id.as_bytes() <= s.as_bytes()))
                .filter(|id| match &start {
                    None => true,
                    Some(e) if inclusive_end => id.as_bytes() >= e.as_bytes(),
                    Some(e) => id.as_bytes() > e.as_bytes(),
                })
                .cloned()
                .collect();
            assert_eq!(all_docs_ids(b, &down, 4).await, expected_down, "{down:?}");
        }
    }
    // A range whose start is past its end is empty, not an error.
    let empty = IdRange {
        start: Some(high),
        end: Some(ascending[0].clone()),
        inclusive_end: true,
        descending: false,
        include_design: false,
    };
    assert!(all_docs_ids(b, &empty, 10).await.is_empty());
    let docs = b.all_docs(&IdRange::all(), 2, None).await.unwrap().items;
    assert_eq!(docs[0].body["value"], json!(docs[0].id), "all_docs returns the documents' bodies");
    // The same pages as text (what `_all_docs?include_docs=true` passes on): page by page the
    // same documents, revisions and tokens, each text the document's JSON.
    for range in [IdRange::all(), IdRange { descending: true, ..IdRange::all() }] {
        let mut token: Option<String> = None;
        loop {
            let values = b.all_docs(&range, 7, token.as_deref()).await.expect("all_docs");
            let texts = b.all_docs_text(&range, 7, token.as_deref()).await.expect("all_docs_text");
            assert_eq!(texts.next, values.next, "{range:?}: the same page token");
            assert_eq!(texts.items.len(), values.items.len(), "{range:?}: the same page length");
            for (text, value) in texts.items.iter().zip(&values.items) {
                assert_eq!((&text.id, &text.rev), (&value.id, &value.rev), "{range:?}");
                let parsed: serde_json::Value = serde_json::from_str(text.json.get()).expect("the text is JSON");
                assert_eq!(parsed, value.to_json(), "{range:?}: the text of {}", value.id);
            }
            token = values.next;
            if token.is_none() {
                break;
            }
        }
    }
}

// ---- local documents ----

async fn design_documents(b: &dyn DocumentBackend) -> u64 {
    b.design_document_count().await.expect("design_document_count").unwrap_or(0)
}

pub async fn local_documents_are_kept_apart(ctx: Ctx) {
    let b = ctx.backend.as_ref();
    let checkpoint = |n: u64| match json!({ "history": [{ "session_id": "s", "last_seq": n }] }) {
        Value::Object(map) => map,
        _ => unreachable!(),
    };
    let start = b.change_position().await.unwrap();
    let first = b.put_local("repl-1", &checkpoint(1), Precondition::MustNotExist).await.unwrap();
    assert_eq!(first.as_str(), "0-1");
    let second = b.put_local("repl-1", &checkpoint(2), Precondition::MatchRevision(first.clone())).await.unwrap();
    assert_eq!(second.as_str(), "0-2");
    let stale = Precondition::MatchRevision(first.clone());
    assert_eq!(b.put_local("repl-1", &checkpoint(3), stale).await.unwrap_err().kind(), ErrorKind::Conflict);
    assert_eq!(
        b.put_local("repl-1", &checkpoint(3), Precondition::MustNotExist).await.unwrap_err().kind(),
        ErrorKind::Conflict
    );
    let read = b.get_local("repl-1").await.unwrap().expect("the local document");
    assert_eq!((read.id.as_str(), &read.rev, &read.body), ("_local/repl-1", &second, &checkpoint(2)));
    assert_eq!(b.get_local("missing").await.unwrap(), None);

    // Nowhere else: not scanned, listed, counted or fed.
    b.put(&id_of("u", "ns", "k"), &body("u", "ns", "k", json!(1)), Precondition::MustNotExist).await.unwrap();
    assert_eq!(scan_ids(b).await, [id_of("u", "ns", "k")]);
    assert_eq!(all_docs_ids(b, &IdRange::all(), 10).await, [id_of("u", "ns", "k")]);
    if let Some(count) = b.exact_count().await.unwrap() {
        assert_eq!(count, 1 + design_documents(b).await, "local documents are not counted");
    }
    let mut view = BTreeMap::new();
    follow_until(b, Some(start), &mut view, &mut Vec::new(), |v| !v.is_empty()).await;
    assert_eq!(view.keys().collect::<Vec<_>>(), [&id_of("u", "ns", "k")]);

    assert_eq!(b.delete_local("repl-1", &first).await.unwrap_err().kind(), ErrorKind::Conflict);
    b.delete_local("repl-1", &second).await.unwrap();
    assert_eq!(b.get_local("repl-1").await.unwrap(), None);
    assert_eq!(b.delete_local("repl-1", &second).await.unwrap_err().kind(), ErrorKind::NotFound);
    let again = b.put_local("repl-1", &checkpoint(1), Precondition::MustNotExist).await.unwrap();
    assert_eq!(again.as_str(), "0-1", "a deleted local document starts again");
}

// ---- creates that fail over tombstones, batched local reads ----

/// `NeverWritten` creates where nothing was ever written and fails over a live document and over
/// a tombstone alike (where `MustNotExist` re-creates), in `put` and in `bulk_write`, leaving
/// what it met untouched; an erased id counts as never written. A backend that cannot check it
/// (`checks_never_written` false) answers every such write with a conflict and writes nothing.
pub async fn never_written_creates_fail_over_tombstones(ctx: Ctx) {
    let b = ctx.backend.as_ref();
    let (fresh, live, gone) = (id_of("nw", "ns", "fresh"), id_of("nw", "ns", "live"), id_of("nw", "ns", "gone"));
    let value = |key: &str| body("nw", "ns", key, json!(1));
    let live_rev = b.put(&live, &value("live"), Precondition::MustNotExist).await.unwrap();
    let gone_rev = b.put(&gone, &value("gone"), Precondition::MustNotExist).await.unwrap();
    let tombstone = b.delete(&gone, &gone_rev).await.unwrap();
    let never_written = |id: &String, key: &str| BulkWrite {
        id: id.clone(),
        body: value(key),
        precondition: Precondition::NeverWritten,
    };
    let results = b
        .bulk_write(vec![never_written(&fresh, "fresh"), never_written(&live, "live"), never_written(&gone, "gone")])
        .await
        .unwrap();
    let kinds: Vec<Option<ErrorKind>> = results.iter().map(|r| r.as_ref().err().map(|e| e.kind())).collect();
    let (gone_now, live_now) = (revisions(b, &gone).await, revisions(b, &live).await);
    assert_eq!((gone_now.rev, gone_now.deleted), (tombstone.clone(), true), "the tombstone is untouched");
    assert_eq!((live_now.rev, live_now.deleted), (live_rev.clone(), false), "the live document is untouched");
    if !b.checks_never_written() {
        assert_eq!(kinds, [Some(ErrorKind::Conflict); 3], "{results:?}");
        assert_eq!(b.revisions(&fresh).await.unwrap(), None, "nothing written");
        let err = b.put(&fresh, &value("fresh"), Precondition::NeverWritten).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
        assert_eq!(b.revisions(&fresh).await.unwrap(), None, "nothing written");
        return;
    }
    assert_eq!(kinds, [None, Some(ErrorKind::Conflict), Some(ErrorKind::Conflict)], "{results:?}");
    let created = results[0].as_ref().unwrap();
    assert_eq!(generation(created), 1);
    assert_eq!(b.get(&fresh).await.unwrap().map(|doc| doc.rev), Some(created.clone()));
    for id in [&fresh, &live, &gone] {
        let err = b.put(id, &value("again"), Precondition::NeverWritten).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Conflict, "{id}: {err}");
    }
    assert_eq!(revisions(b, &gone).await.rev, tombstone, "the tombstone is untouched");
    let single = id_of("nw", "ns", "single");
    assert_eq!(generation(&b.put(&single, &value("single"), Precondition::NeverWritten).await.unwrap()), 1);
    let back = b.put(&gone, &value("gone"), Precondition::MustNotExist).await.expect("MustNotExist re-creates");
    assert!(generation(&back) > generation(&tombstone));
    if ctx.no_purge.is_none() {
        b.erase_prefix(&gone).await.unwrap();
        assert_eq!(b.revisions(&gone).await.unwrap(), None);
        b.put(&gone, &value("gone"), Precondition::NeverWritten).await.expect("an erased id was never written");
    }
}

/// `get_many_local` answers each name as `get_local` does, in order: missing names, a name
/// asked twice, and more names than one batch read takes.
pub async fn get_many_local_answers_every_name_in_order(ctx: Ctx) {
    let b = ctx.backend.as_ref();
    let names: Vec<String> = (0..130).map(|n| format!("tree:many-{n:03}")).collect();
    for (n, name) in names.iter().enumerate().filter(|(n, _)| n % 3 == 0) {
        let body = match json!({ "n": n, "text": "é\u{1F600}" }) {
            Value::Object(map) => map,
            _ => unreachable!(),
        };
        b.put_local(name, &body, Precondition::MustNotExist).await.unwrap();
    }
    let mut asked = names.clone();
    asked.push(names[3].clone());
    asked.push("tree:never".into());
    let many = b.get_many_local(&asked).await.unwrap();
    assert_eq!(many.len(), asked.len());
    for (name, found) in asked.iter().zip(&many) {
        assert_eq!(found, &b.get_local(name).await.unwrap(), "{name}");
    }
    assert_eq!(many.iter().filter(|found| found.is_some()).count(), 44 + 1);
    assert_eq!(b.get_many_local(&[]).await.unwrap(), Vec::new());
}
