//! The crash-point sweep of the database engine (issue 35 §3; docs/design/crash-points.md): each
//! multi-step operation of [`Database`] is run over the crash layer (`crash.rs`) cut at its
//! `k`-th backend call, for every `k` until it runs uncut, both ways (the process stopped; the
//! answer of call `k` lost). After each cut the database is opened again over the backend
//! without the layer ("restart"), a document a save left half written is finished by a
//! replicator's `_revs_diff` of its leaves (no write: the documented repair), and the invariants
//! are checked: `doc_count` counts what `_all_docs` lists,
//! every document the operation touches is as before it or as after it (as after it when it was
//! acknowledged), every document is in the change feed and every live one in `_all_docs`, the
//! feed's position did not go back, no `tree:` local contradicts the record (`half_written`),
//! after a collection pass with no grace period every attachment a kept body references reads
//! back byte-exact, and a view index kept across the crash answers what one built from scratch
//! answers (`crash_sweep_views.rs`).
//!
//! What a cut leaves is compared with a reference run of the same operation, uncut, on other
//! documents: revision ids are computed from the edits, not from the document id, so the same
//! operation makes the same trees.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use agentstore::backend::{DocumentBackend, IdRange};
use agentstore::database::attachments::{couchdb_digest, MANIFEST_PREFIX};
use agentstore::database::doc_attachments::{self, ATTACHMENTS};
use agentstore::database::rev_tree::RevPath;
use agentstore::database::{Database, Write, Written};
use agentstore::{Error, ErrorKind, Result};
use base64::Engine as _;
use futures::TryStreamExt;
use serde_json::{json, Map, Value};

use crate::crash::{CrashLayer, Cut};
use crate::crash_sweep_views::ViewCheck;
use crate::harness::Ctx;

/// Operations whose sweep finds a violation not fixed yet: each is reported by name on every
/// run, and its violations do not fail the case. Empty: every operation holds.
const KNOWN_FAILURES: &[&str] = &[];

/// More backend calls than any swept operation makes: a sweep that gets here never ends.
const MAX_CRASH_POINTS: usize = 200;

/// The operations swept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Operation {
    /// A client's edit of a live document (`PUT` with `_rev`).
    Edit,
    /// Deleting a live document: the record, then its local tree, then the tombstone.
    Delete,
    /// A replicated revision adding a conflicting branch (`new_edits: false`, `write_batch`).
    ReplicatedConflict,
    /// A replicator's page of two documents (`write_many`, `new_edits: false`).
    ReplicatedPage,
    /// Deleting the winner of a conflicted document, so the other leaf is promoted.
    Promotion,
    /// Purging the winning leaf of a conflicted document.
    PurgeLeaf,
    /// Purging the only leaf of a document, which erases it.
    PurgeDocument,
    /// Purging the deleted leaf of a deleted document (its tombstone, then its local tree).
    PurgeDeleted,
    /// A new attachment: the store's chunks, its manifest, then the document.
    AttachmentUpload,
    /// A collection of unreferenced attachment bytes, no grace period.
    Collection,
    /// `COPY`: the source's leaf body written as a new document.
    Copy,
    /// `_bulk_docs` over three documents (`write_many`): an edit, a create, a deletion.
    BulkDocs,
    /// Several writes to one document in one save (`write_batch`).
    BatchOfOneDocument,
    /// `_compact`: every tree rewritten without its inner bodies.
    Compact,
}

const OPERATIONS: &[Operation] = &[
    Operation::Edit,
    Operation::Delete,
    Operation::ReplicatedConflict,
    Operation::ReplicatedPage,
    Operation::Promotion,
    Operation::PurgeLeaf,
    Operation::PurgeDocument,
    Operation::PurgeDeleted,
    Operation::AttachmentUpload,
    Operation::Collection,
    Operation::Copy,
    Operation::BulkDocs,
    Operation::BatchOfOneDocument,
    Operation::Compact,
];

/// The bytes of the attachments the sweep writes.
const FIRST_BYTES: &str = "the first attachment's bytes";
const SECOND_BYTES: &str = "the bytes of an attachment uploaded by the operation";
const ORPHANED_BYTES: &str = "bytes whose only document was purged";
const LOOSE_BYTES: &str = "bytes uploaded and never referenced";

/// What the set-up wrote, for the operation: the documents it touches and the revisions it names.
struct Plan {
    ids: Vec<String>,
    /// `1-…` and `2-…` of the document `a`, and the winner of `a` after the set-up.
    first: String,
    second: String,
    winner: String,
    /// The leaf of `c`, when the set-up wrote one.
    other: Option<String>,
}

/// One document as the checks compare it: its winner, every leaf with its body, and how many
/// inner bodies it keeps.
#[derive(Debug, Clone, PartialEq)]
struct DocSnapshot {
    winner: String,
    leaves: BTreeMap<String, (bool, Map<String, Value>)>,
    inner_bodies: usize,
}

type Snapshots = BTreeMap<String, Option<DocSnapshot>>;

/// How the sweep of one operation went on one backend, one kind of cut.
#[derive(Default)]
struct Tally {
    crash_points: usize,
    repairs: usize,
    /// The backend calls of the uncut run, in order.
    steps: Vec<&'static str>,
    violations: Vec<String>,
}

pub fn object(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        other => panic!("expected an object, got {other}"),
    }
}

/// The name the swept database goes by (views name their groups after it).
const DATABASE_NAME: &str = "crash-sweep";

fn database(backend: Arc<dyn DocumentBackend>) -> Database {
    Database::new(DATABASE_NAME.into(), backend)
}

fn without_grace(db: Database) -> Database {
    let max = db.max_attachment_bytes();
    db.with_attachment_bounds(max, Duration::ZERO)
}

/// A body with the inline attachment `name` holding `bytes`, and stubs for `kept` names.
pub fn with_attachment(mut value: Map<String, Value>, name: &str, bytes: &str, kept: &[&str]) -> Map<String, Value> {
    let mut attachments = Map::new();
    for stub in kept {
        attachments.insert((*stub).to_owned(), json!({"stub": true}));
    }
    let data = base64::engine::general_purpose::STANDARD.encode(bytes);
    attachments.insert(name.to_owned(), json!({"content_type": "text/plain", "data": data}));
    value.insert(ATTACHMENTS.into(), Value::Object(attachments));
    value
}

/// Seeds `db` with `count` documents `doc{n}`: `doc0` with an attachment of `bytes`, `doc1` with
/// two leaves (a second revision, then a branch from the first beside it), `doc2` deleted, the
/// others plain; `count + 1` leaves in all from 2 documents on. The sources of the copy sweeps.
pub async fn seed_copy_source(db: &Database, count: usize, bytes: &str) {
    for n in 0..count {
        let id = format!("doc{n}");
        let first = edit(db, &id, None, false, object(json!({"n": n}))).await.expect("a source document");
        match n {
            0 => {
                let body = with_attachment(object(json!({"n": n, "v": 2})), "f.txt", bytes, &[]);
                edit(db, &id, Some(&first), false, body).await.expect("an attachment");
            }
            1 => {
                edit(db, &id, Some(&first), false, object(json!({"n": n, "v": 2}))).await.expect("an edit");
                let (_, first_id) = first.split_once('-').expect("a revision");
                let path = RevPath { start: 2, ids: vec!["b0b0".into(), first_id.to_owned()] };
                let branch = Write::Replicated { path, deleted: false, body: object(json!({"branch": true})) };
                db.write(&id, &branch).await.expect("a conflict");
            }
            2 => {
                edit(db, &id, Some(&first), true, Map::new()).await.expect("a deletion");
            }
            _ => {}
        }
    }
}

/// An edit as the document handlers make it: inline attachments stored first, then the write.
pub async fn edit(
    db: &Database,
    id: &str,
    parent: Option<&str>,
    deleted: bool,
    body: Map<String, Value>,
) -> Result<String> {
    let mut body = body;
    doc_attachments::prepare(db.attachments(), db.max_attachment_bytes(), &mut body, &HashMap::new()).await?;
    match db.write(id, &Write::Edit { parent: parent.map(str::to_owned), deleted, body }).await? {
        Written::Edited(rev) => Ok(rev),
        other => Err(Error::new(ErrorKind::Internal, format!("an edit answered {other:?}"))),
    }
}

fn branch(first: &str, id: &str, value: Value) -> Write {
    let (_, first_id) = first.split_once('-').unwrap_or(("1", first));
    let path = RevPath { start: 2, ids: vec![id.to_owned(), first_id.to_owned()] };
    Write::Replicated { path, deleted: false, body: object(value) }
}

fn acknowledged(answers: Vec<agentstore::database::engine::DocumentAnswers>) -> Result<()> {
    for answer in answers {
        for written in answer? {
            written?;
        }
    }
    Ok(())
}

/// Writes the state `operation` starts from on documents named `{prefix}…` (over the backend
/// without the layer).
async fn set_up(operation: Operation, db: &Database, prefix: &str) -> Plan {
    let a = format!("{prefix}a");
    let first = edit(db, &a, None, false, object(json!({"v": 1}))).await.expect("set-up: first");
    let second = edit(db, &a, Some(&first), false, with_attachment(object(json!({"v": 2})), "f.txt", FIRST_BYTES, &[]))
        .await
        .expect("set-up: second");
    let mut plan = Plan { ids: vec![a.clone()], first, second: second.clone(), winner: second, other: None };
    match operation {
        Operation::Promotion | Operation::PurgeLeaf => {
            db.write(&a, &branch(&plan.first, "b0b0", json!({"branch": "b"}))).await.expect("set-up: conflict");
            let state = db.read(&a).await.expect("read").expect("exists");
            plan.winner = state.winner_rev().expect("a winner");
        }
        Operation::ReplicatedPage | Operation::Copy => plan.ids.push(format!("{prefix}b")),
        Operation::PurgeDeleted => {
            plan.winner = edit(db, &a, Some(&plan.second), true, Map::new()).await.expect("set-up: deleted");
        }
        Operation::Collection => {
            let b = format!("{prefix}b");
            let rev = edit(db, &b, None, false, with_attachment(Map::new(), "g.txt", ORPHANED_BYTES, &[]))
                .await
                .expect("set-up: b");
            db.purge(&b, &[rev]).await.expect("set-up: purge b");
            let loose = futures::stream::once(async { Ok(bytes::Bytes::from_static(LOOSE_BYTES.as_bytes())) });
            db.attachments().write(loose, db.max_attachment_bytes()).await.expect("set-up: loose bytes");
        }
        Operation::BulkDocs => {
            let c = format!("{prefix}c");
            plan.other = Some(edit(db, &c, None, false, object(json!({"v": "c"}))).await.expect("set-up: c"));
            plan.ids.extend([format!("{prefix}b"), c]);
        }
        Operation::Compact => {
            let d = format!("{prefix}d");
            let one = edit(db, &d, None, false, object(json!({"v": 1}))).await.expect("set-up: d");
            let two = edit(db, &d, Some(&one), false, object(json!({"v": 2}))).await.expect("set-up: d 2");
            edit(db, &d, Some(&two), true, Map::new()).await.expect("set-up: d deleted");
            plan.ids.push(d);
        }
        _ => {}
    }
    plan
}

/// Runs `operation` on the documents of `plan` through `db`.
async fn run(operation: Operation, db: &Database, prefix: &str, plan: &Plan) -> Result<()> {
    let a = format!("{prefix}a");
    let stub_of_f = || object(json!({"f.txt": {"stub": true}}));
    match operation {
        Operation::Edit => {
            let mut body = object(json!({"v": 3}));
            body.insert(ATTACHMENTS.into(), Value::Object(stub_of_f()));
            edit(db, &a, Some(&plan.second), false, body).await.map(drop)
        }
        Operation::Delete | Operation::Promotion => edit(db, &a, Some(&plan.winner), true, Map::new()).await.map(drop),
        Operation::ReplicatedConflict => {
            db.write(&a, &branch(&plan.first, "b0b0", json!({"branch": "b"}))).await.map(drop)
        }
        Operation::ReplicatedPage => {
            let new = Write::Replicated {
                path: RevPath { start: 1, ids: vec!["c0c0".into()] },
                deleted: false,
                body: object(json!({"new": true})),
            };
            let page =
                vec![(a, vec![branch(&plan.first, "b0b0", json!({"branch": "b"}))]), (format!("{prefix}b"), vec![new])];
            acknowledged(db.write_many(&page).await?)
        }
        Operation::PurgeLeaf | Operation::PurgeDeleted => {
            db.purge(&a, std::slice::from_ref(&plan.winner)).await.map(drop)
        }
        Operation::PurgeDocument => db.purge(&a, std::slice::from_ref(&plan.second)).await.map(drop),
        Operation::AttachmentUpload => upload(db, &a, Some(&plan.second)).await,
        Operation::Collection => db.collect_attachment_garbage().await.map(drop),
        Operation::Copy => {
            let source = db.read(&a).await?.ok_or_else(|| Error::not_found("the source"))?;
            let leaf = source.tree.winner().ok_or_else(|| Error::not_found("the source's winner"))?;
            // As `copy_document` writes it: the leaf's body as it is kept, its attachments too.
            let copy = Write::Edit { parent: None, deleted: false, body: leaf.body.clone() };
            db.write(&format!("{prefix}b"), &copy).await.map(drop)
        }
        Operation::BulkDocs => {
            let mut edited = object(json!({"v": 3}));
            edited.insert(ATTACHMENTS.into(), Value::Object(stub_of_f()));
            let other = plan.other.clone();
            let writes = vec![
                (a, vec![Write::Edit { parent: Some(plan.second.clone()), deleted: false, body: edited }]),
                (
                    format!("{prefix}b"),
                    vec![Write::Edit { parent: None, deleted: false, body: object(json!({"v": "b"})) }],
                ),
                (format!("{prefix}c"), vec![Write::Edit { parent: other, deleted: true, body: Map::new() }]),
            ];
            acknowledged(db.write_many(&writes).await?)
        }
        Operation::BatchOfOneDocument => {
            let writes = [
                Write::Edit { parent: Some(plan.second.clone()), deleted: false, body: object(json!({"v": 3})) },
                branch(&plan.first, "b0b0", json!({"branch": "b"})),
            ];
            for answer in db.write_batch(&a, &writes).await? {
                answer?;
            }
            Ok(())
        }
        Operation::Compact => db.compact().await.map(drop),
    }
}

/// The attachment upload: `SECOND_BYTES` added to `id` next to its `f.txt`.
async fn upload(db: &Database, id: &str, parent: Option<&str>) -> Result<()> {
    let kept: &[&str] = if parent.is_some() { &["f.txt"] } else { &[] };
    let body = with_attachment(object(json!({"v": 3})), "g.txt", SECOND_BYTES, kept);
    edit(db, id, parent, false, body).await.map(drop)
}

async fn snapshot(db: &Database, id: &str) -> Option<DocSnapshot> {
    let state = db.read(id).await.expect("read")?;
    let leaves =
        state.tree.leaves().into_iter().map(|leaf| (leaf.path.leaf_rev(), (leaf.deleted, leaf.body.clone()))).collect();
    let winner = state.winner_rev().unwrap_or_default();
    Some(DocSnapshot { winner, leaves, inner_bodies: state.tree.inner_bodies().len() })
}

async fn snapshots(db: &Database, ids: &[String], prefix: &str) -> Snapshots {
    let mut all = Snapshots::new();
    for id in ids {
        // Keyed by the name without the run's prefix, so runs compare.
        all.insert(id.trim_start_matches(prefix).to_owned(), snapshot(db, id).await);
    }
    all
}

/// Every id in the change feed, read from the start.
pub(crate) async fn feed_ids(backend: &dyn DocumentBackend) -> BTreeSet<String> {
    let mut ids = BTreeSet::new();
    let mut since: Option<String> = None;
    for _ in 0..1000 {
        let page = backend.changes(since.as_deref(), 500).await.expect("changes");
        let empty = page.changes.is_empty();
        ids.extend(page.changes.into_iter().map(|change| change.id));
        if empty || page.pending == Some(0) {
            return ids;
        }
        since = Some(page.last_seq);
    }
    panic!("the change feed did not end")
}

/// The leading number of a feed position (exact on the embedded store, a time on the others).
pub(crate) fn position_number(position: &str) -> u128 {
    let digits: String = position.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().unwrap_or(0)
}

/// What the expected states are, from the reference run.
struct Expected {
    before: Snapshots,
    after: Snapshots,
}

/// What a cut is checked against: the reference run's states, the feed's position before the
/// operation, and the view index kept across the crash.
struct Baseline<'a> {
    expected: &'a Expected,
    position_before: &'a str,
    views: &'a ViewCheck,
}

/// The checks after a cut (module doc); the violations found, and how many repairs were made.
async fn check(
    backend: &Arc<dyn DocumentBackend>,
    operation: Operation,
    prefix: &str,
    plan: &Plan,
    baseline: &Baseline<'_>,
    acknowledged: bool,
) -> (Vec<String>, usize) {
    let Baseline { expected, position_before, views } = baseline;
    let db = database(Arc::clone(backend));
    let mut violations = Vec::new();
    let mut repairs = 0;
    for id in &plan.ids {
        let (repaired, found) = repaired_by_revs_diff(&db, id).await;
        repairs += usize::from(repaired);
        violations.extend(found);
    }
    let now = snapshots(&db, &plan.ids, prefix).await;
    for (name, state) in &now {
        let (before, after) = (&expected.before[name], &expected.after[name]);
        if acknowledged && state != after {
            violations.push(format!("{name}: acknowledged, but reads {state:?}, not {after:?}"));
        } else if state != before && state != after {
            violations.push(format!("{name}: half applied: {state:?}; before {before:?}; after {after:?}"));
        }
    }
    let feed = feed_ids(backend.as_ref()).await;
    // Read before `_all_docs`, which finishes a deletion it meets cut before its tombstone.
    let counted = backend.exact_count().await.expect("exact_count");
    let listed: BTreeSet<String> = db
        .all_docs(&IdRange::all(), 10_000, None)
        .await
        .expect("all_docs")
        .items
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    for (id, (name, state)) in plan.ids.iter().zip(&now) {
        let Some(state) = state else { continue };
        if !feed.contains(id) {
            violations.push(format!("{name}: not in the change feed"));
        }
        let live = state.leaves.get(&state.winner).is_some_and(|(deleted, _)| !deleted);
        if live != listed.contains(id) {
            violations.push(format!("{name}: live {live}, but listed in _all_docs {}", listed.contains(id)));
        }
    }
    if let Some(counted) = counted.filter(|counted| *counted != listed.len() as u64) {
        violations.push(format!("doc_count is {counted}, but _all_docs lists {} documents", listed.len()));
    }
    let position_after = backend.change_position().await.expect("change_position");
    if position_number(&position_after) < position_number(position_before) {
        violations.push(format!("the feed went back from {position_before} to {position_after}"));
    }
    if operation == Operation::AttachmentUpload && !acknowledged {
        // The client retries the upload it saw fail, as a new document: the same bytes must be
        // stored and read back whatever the cut left of them.
        let retry = format!("{prefix}retry");
        upload(&db, &retry, None).await.expect("the client's retry of the upload");
        violations.extend(attachments_read_back(backend, &retry).await);
    }
    violations.extend(views.compare_with_rebuild(&database(Arc::clone(backend))).await);
    without_grace(database(Arc::clone(backend))).collect_attachment_garbage().await.expect("collect");
    for id in &plan.ids {
        violations.extend(attachments_read_back(backend, id).await);
    }
    (violations, repairs)
}

/// The repair after a restart, as a replicator whose write was cut makes it: a `_revs_diff` of
/// the document's leaves alone, no write (`Database::read_many_repairing`, what the handler
/// reads). Whether the document was half written, and the violations: a leaf the answer calls
/// missing, a save still unfinished after it.
async fn repaired_by_revs_diff(db: &Database, id: &str) -> (bool, Vec<String>) {
    let state = db.read(id).await.expect("read");
    let half_written = db.half_written(id, state.as_ref()).await.expect("half_written");
    let Some(state) = state else { return (false, Vec::new()) };
    let leaves: Vec<String> = state.tree.leaves().into_iter().map(|leaf| leaf.path.leaf_rev()).collect();
    let asked = db.read_many_repairing(&[id.to_owned()]).await.expect("_revs_diff's read");
    let mut violations = Vec::new();
    let missing = match asked.into_iter().next().flatten() {
        Some(answered) => answered.tree.missing(&leaves).0,
        None => leaves,
    };
    if !missing.is_empty() {
        violations.push(format!("{id}: _revs_diff calls {missing:?} missing"));
    }
    let again = db.read(id).await.expect("read");
    if db.half_written(id, again.as_ref()).await.expect("half_written") {
        violations.push(format!("{id}: still half written after a _revs_diff of its leaves"));
    }
    (half_written, violations)
}

/// Every attachment a kept body of `id` references, read back and compared with its digest and
/// length.
async fn attachments_read_back(backend: &Arc<dyn DocumentBackend>, id: &str) -> Vec<String> {
    let db = database(Arc::clone(backend));
    let Some(state) = db.read(id).await.expect("read") else { return Vec::new() };
    let mut violations = Vec::new();
    for body in state.tree.bodies() {
        let names: Vec<String> =
            body.get(ATTACHMENTS).and_then(Value::as_object).into_iter().flat_map(|a| a.keys().cloned()).collect();
        for name in names {
            let Some(kept) = doc_attachments::kept(body, &name) else {
                violations.push(format!("{id}/{name}: not a kept attachment: {body:?}"));
                continue;
            };
            let read = match db.attachments().read(&kept.sha256, None).await {
                Ok(stream) => stream.map_ok(|bytes| bytes.to_vec()).try_concat().await,
                Err(err) => Err(err),
            };
            match read {
                Ok(bytes) if couchdb_digest(&bytes) == kept.digest && bytes.len() as u64 == kept.length => {}
                Ok(bytes) => violations.push(format!("{id}/{name}: read back {} other bytes", bytes.len())),
                Err(err) => violations.push(format!("{id}/{name}: its bytes do not read back: {err}")),
            }
        }
    }
    violations
}

/// Purges every document of the run, then collects without grace: no attachment bytes may be
/// left (an upload cut short leaves chunks, or a manifest, that the collector must free), and
/// the next run stores its bytes anew.
async fn clean_up(backend: &Arc<dyn DocumentBackend>, prefix: &str, plan: &Plan) -> Vec<String> {
    let db = database(Arc::clone(backend));
    for id in plan.ids.iter().cloned().chain([format!("{prefix}retry")]) {
        let Some(state) = db.read(&id).await.expect("read") else { continue };
        let leaves: Vec<String> = state.tree.leaves().into_iter().map(|leaf| leaf.path.leaf_rev()).collect();
        db.purge(&id, &leaves).await.expect("the clean-up's purge");
    }
    without_grace(database(Arc::clone(backend))).collect_attachment_garbage().await.expect("collect");
    let mut left = Vec::new();
    let blobs = backend.attachment_blobs(100, None).await.expect("attachment_blobs").items;
    if !blobs.is_empty() {
        left.push(format!("attachment chunks left after a collection without grace: {blobs:?}"));
    }
    let manifests = IdRange::all().under_prefix(MANIFEST_PREFIX);
    let manifests = backend.local_docs(&manifests, 100, None).await.expect("local_docs").items;
    if !manifests.is_empty() {
        let names: Vec<String> = manifests.into_iter().map(|doc| doc.id).collect();
        left.push(format!("manifests left after a collection without grace: {names:?}"));
    }
    left
}

/// The database the operation runs on, over the crash layer.
fn crashing_database(operation: Operation, layer: Arc<CrashLayer>) -> Database {
    let db = database(layer);
    // Only the collection pass runs without grace: a write's background collection must not
    // free the next set-up's fresh uploads.
    if operation == Operation::Collection {
        without_grace(db)
    } else {
        db
    }
}

/// The sweep of one operation, one kind of cut, on `backend`.
async fn sweep(backend: &Arc<dyn DocumentBackend>, operation: Operation, cut: Cut, expected: &Expected) -> Tally {
    let plain = database(Arc::clone(backend));
    let views = ViewCheck::new();
    let mut tally = Tally::default();
    for k in 0..MAX_CRASH_POINTS {
        let prefix = format!("{cut:?}{k}-");
        let plan = set_up(operation, &plain, &prefix).await;
        // The index the crashing process had built (a process of its own: the set-up's
        // database remembers an incarnation the last run's clean-up may have ended).
        views.catch_up(&database(Arc::clone(backend))).await;
        let position_before = backend.change_position().await.expect("change_position");
        let layer = Arc::new(CrashLayer::new(Arc::clone(backend), k, cut));
        let answer = run(operation, &crashing_database(operation, Arc::clone(&layer)), &prefix, &plan).await;
        layer.end();
        let cut_made = layer.cut_made();
        if !cut_made {
            if let Err(err) = &answer {
                panic!("{operation:?} failed uncut after {} calls: {err}", layer.calls());
            }
        }
        let baseline = Baseline { expected, position_before: &position_before, views: &views };
        let (mut violations, repairs) = check(backend, operation, &prefix, &plan, &baseline, answer.is_ok()).await;
        violations.extend(clean_up(backend, &prefix, &plan).await);
        tally.repairs += repairs;
        tally.violations.extend(violations.into_iter().map(|v| format!("{cut:?} at call {k}: {v}")));
        if !cut_made {
            tally.steps = layer.called();
            return tally;
        }
        tally.crash_points += 1;
    }
    panic!("{operation:?} was still cut after {MAX_CRASH_POINTS} calls")
}

/// The states before and after `operation`, from a run without the layer.
async fn reference(backend: &Arc<dyn DocumentBackend>, operation: Operation) -> Expected {
    let db = database(Arc::clone(backend));
    let prefix = "reference-";
    let plan = set_up(operation, &db, prefix).await;
    let before = snapshots(&db, &plan.ids, prefix).await;
    run(operation, &db, prefix, &plan).await.unwrap_or_else(|err| panic!("{operation:?} uncut: {err}"));
    let after = snapshots(&db, &plan.ids, prefix).await;
    let left = clean_up(backend, prefix, &plan).await;
    assert!(left.is_empty(), "{operation:?} uncut: {left:?}");
    Expected { before, after }
}

async fn sweep_operation(ctx: Ctx, operation: Operation) {
    if ctx.backend_name == "couchdb" {
        println!("couchdb: not applicable: the engine is not used there (CouchDB keeps its own trees)");
        return;
    }
    let expected = reference(&ctx.backend, operation).await;
    let name = format!("{operation:?}");
    let mut failures = Vec::new();
    for cut in [Cut::Stop, Cut::LoseAnswer] {
        let tally = sweep(&ctx.backend, operation, cut, &expected).await;
        println!(
            "crash sweep: {} {name} {cut:?}: {} crash points, {} repaired by a _revs_diff, {} violations; steps: {}",
            ctx.backend_name,
            tally.crash_points,
            tally.repairs,
            tally.violations.len(),
            tally.steps.join(" ")
        );
        failures.extend(tally.violations);
    }
    if failures.is_empty() {
        assert!(!KNOWN_FAILURES.contains(&name.as_str()), "{name} is listed as a known failure but holds now");
        return;
    }
    let listing = failures.join("\n  ");
    if KNOWN_FAILURES.contains(&name.as_str()) {
        println!("crash sweep: {} {name}: KNOWN FAILURE:\n  {listing}", ctx.backend_name);
        return;
    }
    panic!("crash sweep: {} {name}: violations:\n  {listing}", ctx.backend_name);
}

macro_rules! swept {
    ($($case:ident => $operation:ident),* $(,)?) => {
        $(pub async fn $case(ctx: Ctx) { sweep_operation(ctx, Operation::$operation).await })*
        /// Every operation has its case.
        const SWEPT: &[Operation] = &[$(Operation::$operation),*];
    };
}

swept! {
    crash_sweep_edit => Edit,
    crash_sweep_delete => Delete,
    crash_sweep_replicated_conflict => ReplicatedConflict,
    crash_sweep_replicated_page => ReplicatedPage,
    crash_sweep_promotion => Promotion,
    crash_sweep_purge_leaf => PurgeLeaf,
    crash_sweep_purge_document => PurgeDocument,
    crash_sweep_purge_deleted => PurgeDeleted,
    crash_sweep_attachment_upload => AttachmentUpload,
    crash_sweep_collection => Collection,
    crash_sweep_copy => Copy,
    crash_sweep_bulk_docs => BulkDocs,
    crash_sweep_batch_of_one_document => BatchOfOneDocument,
    crash_sweep_compact => Compact,
}

/// The list of operations and the cases agree (a new operation gets its case).
pub async fn crash_sweep_covers_every_operation(_ctx: Ctx) {
    assert_eq!(SWEPT, OPERATIONS);
}
