//! The crash-point sweep of a replication job (docs/design/crash-points.md, "a replication job's
//! page"): a one-shot `_replicator` job between two databases of the backend under test, cut at
//! its `k`-th storage call for every `k` until it runs uncut, both ways (the process stopped; the
//! answer of call `k` lost and the job going on). After each cut the same replication runs again
//! uncut, as the scheduler's next start of the job would, from whatever checkpoint the cut left;
//! the target must then hold every leaf of the source, byte for byte (bodies, ancestry, deletion,
//! attachments inline), and nothing else.
//!
//! What a wrong order of steps would show: a checkpoint recorded before its page's leaves were
//! written lets the second run start past them, and the comparison finds them missing; a leaf
//! half written (tree saved, body not) is found different or missing.
//!
//! The job's pages are two changes each and every page records its checkpoint (an interval of
//! zero), so the sweep crosses several pages and checkpoints. Source and target are databases of
//! one catalog, as two local databases of one server are; every call to either counts.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentstore::backend::catalog::{open_catalog, Catalog, DbName};
use agentstore::backend::BackendUrl;
use agentstore::database::{Database, Databases, Write};
use agentstore::migrate::deployment::side::Side;
use agentstore::replicator::job::{self, JobBounds, JobContext, JobStats, Outcome};
use agentstore::replicator::scheduler::SchedulerBounds;
use agentstore::replicator::spec::{self, Replication};
use agentstore::replicator::{Replicator, REPLICATOR_DB};
use serde_json::{json, Map, Value};
use tokio::sync::watch;

use crate::crash::{CrashPoint, CrashingCatalog, Cut};
use crate::crash_sweep::{object, seed_copy_source};
use crate::crash_sweep_migrate::{sweep_both_cuts, Tally};
use crate::harness::Ctx;

/// More calls than one uncut job makes.
const MAX_CRASH_POINTS: usize = 300;
/// Documents at the source: an attachment, a conflict, a deletion, and plain ones.
const DOCUMENTS: usize = 5;
/// Changes per page.
const PAGE: usize = 2;

fn database_name(role: &str, cut: Cut, k: usize) -> DbName {
    let text = format!("sweep-repl-{role}-{}-{cut:?}-{k}", std::process::id()).to_lowercase();
    DbName::parse(&text).expect("a database name")
}

/// The source database: documents with an attachment, a conflict and a deletion, written over
/// the catalog without the layer.
async fn seed_source(catalog: &Arc<dyn Catalog>, name: &DbName) {
    let databases = Databases::new(Some(Arc::clone(catalog)), 4);
    let db = databases.create(name).await.expect("the source database");
    seed_copy_source(&db, DOCUMENTS, "replicated bytes").await;
}

fn replication(source: &DbName, target: &DbName) -> Replication {
    let body = object(json!({"source": source.as_str(), "target": target.as_str(), "create_target": true}));
    spec::parse(&body).expect("a replication")
}

fn context(catalog: Arc<dyn Catalog>) -> JobContext {
    JobContext {
        databases: Arc::new(Databases::new(Some(catalog), 4)),
        server_uuid: Arc::from("crash-sweep-server"),
        js: None,
        bounds: JobBounds { batch_size: PAGE, checkpoint_interval: Duration::ZERO, ..JobBounds::default() },
    }
}

async fn run_job(context: &JobContext, replication: &Replication) -> agentstore::Result<Outcome> {
    let id = context.replication_id(replication).await?;
    let stats = Arc::new(Mutex::new(JobStats::default()));
    let (_keep, stop) = watch::channel(false);
    job::run(context, replication, &id, &stats, stop).await
}

/// Runs `work` until it ends, or (a stopped process) until the layer cuts a call.
async fn until_cut<T>(point: &CrashPoint, cut: Cut, work: impl Future<Output = T>) -> Option<T> {
    if cut == Cut::LoseAnswer {
        return Some(work.await);
    }
    tokio::select! {
        answer = work => Some(answer),
        () = point.cut_reached() => None,
    }
}

/// Every leaf of `source`'s feed, with attachments inline, as `read_leaves` gives it.
async fn leaves(side: &Side, db: &str, ids_from: &Side, from_db: &str) -> agentstore::Result<Vec<Map<String, Value>>> {
    let mut since = Value::Null;
    let mut all = Vec::new();
    loop {
        let page = ids_from.changes(from_db, &since, 100).await?;
        let wanted: Vec<(String, Vec<String>)> = page.docs.iter().map(|d| (d.id.clone(), d.leaves.clone())).collect();
        all.extend(side.read_leaves(db, &wanted, true).await?);
        since = page.last_seq.clone();
        if page.at_end || page.docs.is_empty() {
            break;
        }
    }
    all.sort_by(|a, b| (a["_id"].as_str(), a["_rev"].as_str()).cmp(&(b["_id"].as_str(), b["_rev"].as_str())));
    Ok(all)
}

/// The target compared with the source, leaf for leaf, both ways.
async fn compare(catalog: &Arc<dyn Catalog>, source: &DbName, target: &DbName, leaves_written: usize) -> Vec<String> {
    let side = Side::local(Arc::new(Databases::new(Some(Arc::clone(catalog)), 4)), "local");
    let (source, target) = (source.as_str(), target.as_str());
    let (theirs, ours) = match (leaves(&side, source, &side, source).await, leaves(&side, target, &side, source).await)
    {
        (Ok(theirs), Ok(ours)) => (theirs, ours),
        (Err(err), _) | (_, Err(err)) => return vec![format!("reading the leaves failed: {err}")],
    };
    let mut violations = Vec::new();
    if theirs.len() != leaves_written {
        violations.push(format!("the source lists {} leaves, the set-up wrote {leaves_written}", theirs.len()));
    }
    if theirs != ours {
        violations.push(format!("the target's leaves differ: source {theirs:?}, target {ours:?}"));
    }
    match (leaves(&side, target, &side, target).await, leaves(&side, source, &side, source).await) {
        (Ok(listed), Ok(expected)) if listed == expected => {}
        (Ok(listed), Ok(_)) => violations.push(format!("the target's own feed lists other leaves: {listed:?}")),
        (Err(err), _) | (_, Err(err)) => violations.push(format!("reading the target's feed failed: {err}")),
    }
    violations
}

/// One crash point: the job cut, run again, compared. The violations found, and whether the
/// cut was made.
async fn point(catalog: &Arc<dyn Catalog>, k: usize, cut: Cut, steps: &mut Vec<&'static str>) -> (Vec<String>, bool) {
    let (source, target) = (database_name("from", cut, k), database_name("to", cut, k));
    seed_source(catalog, &source).await;
    let wanted = replication(&source, &target);
    let crash = CrashPoint::new(k, cut);
    let crashing: Arc<dyn Catalog> = Arc::new(CrashingCatalog::new(Arc::clone(catalog), Arc::clone(&crash)));
    let answer = until_cut(&crash, cut, run_job(&context(crashing), &wanted)).await;
    crash.end();
    let cut_made = crash.cut_made();
    if !cut_made {
        *steps = crash.called();
        match &answer {
            Some(Ok(Outcome::Completed(_))) => {}
            other => panic!("the replication job ended uncut after {} calls with {other:?}", crash.calls()),
        }
    }
    let mut violations = Vec::new();
    match run_job(&context(Arc::clone(catalog)), &wanted).await {
        Ok(Outcome::Completed(_)) => violations.extend(compare(catalog, &source, &target, DOCUMENTS + 1).await),
        Ok(other) => violations.push(format!("the job run again ended {other:?}")),
        Err(err) => violations.push(format!("the job run again failed: {err}")),
    }
    for name in [&source, &target] {
        if Catalog::delete(catalog.as_ref(), name).await.is_err() {
            violations.push(format!("{} cannot be deleted", name.as_str()));
        }
    }
    (violations, cut_made)
}

async fn sweep(catalog: &Arc<dyn Catalog>, cut: Cut) -> Tally {
    let mut tally = Tally::default();
    for k in 0..MAX_CRASH_POINTS {
        let (violations, cut_made) = point(catalog, k, cut, &mut tally.steps).await;
        tally.violations.extend(violations.into_iter().map(|v| format!("{cut:?} at call {k}: {v}")));
        if !cut_made {
            return tally;
        }
        tally.crash_points += 1;
    }
    panic!("the replication job was still cut after {MAX_CRASH_POINTS} calls")
}

pub async fn crash_sweep_replication_job(ctx: Ctx) {
    if ctx.backend_name == "couchdb" {
        println!(
            "couchdb: not applicable: a CouchDB backend's databases are the server's own (their attachments too), so \
             a replication between two of them is written by that server's `new_edits: false`, each document whole or \
             not at all; the migrate sweep skips it for the same reason"
        );
        return;
    }
    let url: BackendUrl = ctx.backend_url.parse().expect("the harness's backend URL parses");
    let catalog = open_catalog(&url).await.expect("the catalog");
    sweep_both_cuts(ctx.backend_name, "replication job", |cut| sweep(&catalog, cut)).await;
}

// ---- the scheduler: lease, run, state written back ----

/// Documents of the scheduler sweep's source (one, with an attachment: the job's pages are swept
/// above; this sweep is about the lease and the state around a run).
const SCHEDULED_DOCUMENTS: usize = 1;
/// The scheduler's scan and backoff in the sweep (a second and five in a server).
const SCAN: Duration = Duration::from_millis(20);
/// A killed instance's lease expires this soon, so the restart takes the job over at once.
const LEASE_TTL: Duration = Duration::from_millis(100);
/// How long a scheduler may take to write `completed` (far more than a run takes).
const COMPLETION_WAIT: Duration = Duration::from_secs(30);

/// A scheduler over `catalog`'s databases, started; the sender stops it.
fn scheduler(catalog: Arc<dyn Catalog>) -> (Replicator, watch::Sender<bool>) {
    let bounds = SchedulerBounds { scan_interval: SCAN, first_backoff: SCAN, ..SchedulerBounds::new(4, LEASE_TTL) };
    let replicator = Replicator::new(context(catalog), bounds).expect("a replicator");
    let (stop, stopping) = watch::channel(false);
    replicator.start(stopping);
    (replicator, stop)
}

/// The `_replicator` document's `_replication_state`, read over the catalog without the layer.
async fn replication_state(replicator_db: &Database, doc_id: &str) -> Option<String> {
    let state = replicator_db.read(doc_id).await.ok()??;
    let winner = state.tree.winner()?;
    winner.body.get("_replication_state").and_then(Value::as_str).map(str::to_owned)
}

/// Waits until the document says `completed` (`true`), or the wait ends (`false`); with a
/// crash point, also until a stopped process's cut is made (`false`).
async fn completed_within(replicator_db: &Database, doc_id: &str, stopped_at: Option<&CrashPoint>) -> bool {
    let deadline = tokio::time::Instant::now() + COMPLETION_WAIT;
    while tokio::time::Instant::now() < deadline {
        if replication_state(replicator_db, doc_id).await.as_deref() == Some("completed") {
            return true;
        }
        if stopped_at.is_some_and(CrashPoint::cut_made) {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    false
}

/// One crash point of the scheduler: a one-shot `_replicator` document run by a scheduler cut
/// at its `k`-th call; for a lost answer the process goes on and must still write `completed`;
/// then a new scheduler (the restart) must find the document `completed`, or run it to
/// `completed`, and the target must equal the source.
async fn scheduler_point(
    catalog: &Arc<dyn Catalog>,
    replicator_db: &Database,
    k: usize,
    cut: Cut,
    steps: &mut Vec<&'static str>,
) -> (Vec<String>, bool) {
    let (source, target) = (database_name("sfrom", cut, k), database_name("sto", cut, k));
    let databases = Databases::new(Some(Arc::clone(catalog)), 4);
    let db = databases.create(&source).await.expect("the source database");
    seed_copy_source(&db, SCHEDULED_DOCUMENTS, "scheduled bytes").await;
    let doc_id = format!("sweep-{cut:?}-{k}").to_lowercase();
    let crash = CrashPoint::new(k, cut);
    let crashing: Arc<dyn Catalog> = Arc::new(CrashingCatalog::new(Arc::clone(catalog), Arc::clone(&crash)));
    let (first, stop_first) = scheduler(crashing);
    let body = object(json!({"source": source.as_str(), "target": target.as_str(), "create_target": true}));
    replicator_db.write(&doc_id, &Write::Edit { parent: None, deleted: false, body }).await.expect("the document");
    let stopped_at = (cut == Cut::Stop).then_some(&*crash);
    let completed_first = completed_within(replicator_db, &doc_id, stopped_at).await;
    let cut_made = crash.cut_made();
    crash.end();
    let _ = stop_first.send(true);
    drop(first);
    let mut violations = Vec::new();
    if cut == Cut::LoseAnswer && !completed_first {
        violations
            .push(format!("the process went on but the document never said `completed` ({} calls)", crash.calls()));
    }
    if !cut_made {
        *steps = crash.called();
        assert!(completed_first, "the scheduler never completed the job uncut after {} calls", crash.calls());
    }
    let (restarted, stop_restarted) = scheduler(Arc::clone(catalog));
    if !completed_within(replicator_db, &doc_id, None).await {
        violations.push("after the restart the document never said `completed`".to_owned());
    }
    let _ = stop_restarted.send(true);
    drop(restarted);
    violations.extend(compare(catalog, &source, &target, SCHEDULED_DOCUMENTS).await);
    for name in [&source, &target] {
        if Catalog::delete(catalog.as_ref(), name).await.is_err() {
            violations.push(format!("{} cannot be deleted", name.as_str()));
        }
    }
    (violations, cut_made)
}

async fn scheduler_sweep(catalog: &Arc<dyn Catalog>, replicator_db: &Database, cut: Cut) -> Tally {
    let mut tally = Tally::default();
    for k in 0..MAX_CRASH_POINTS {
        let (violations, cut_made) = scheduler_point(catalog, replicator_db, k, cut, &mut tally.steps).await;
        tally.violations.extend(violations.into_iter().map(|v| format!("{cut:?} at call {k}: {v}")));
        if !cut_made {
            return tally;
        }
        tally.crash_points += 1;
    }
    panic!("the scheduler was still cut after {MAX_CRASH_POINTS} calls")
}

pub async fn crash_sweep_replicator_scheduler(ctx: Ctx) {
    if ctx.backend_name == "couchdb" {
        println!("couchdb: not applicable, as `crash_sweep_replication_job`");
        return;
    }
    let url: BackendUrl = ctx.backend_url.parse().expect("the harness's backend URL parses");
    let catalog = open_catalog(&url).await.expect("the catalog");
    let databases = Databases::new(Some(Arc::clone(&catalog)), 4);
    let name = DbName::parse(REPLICATOR_DB).expect("the replicator database's name");
    let replicator_db = match databases.open(&name).await.expect("opening _replicator") {
        Some(db) => db,
        None => databases.create(&name).await.expect("creating _replicator"),
    };
    sweep_both_cuts(ctx.backend_name, "replicator scheduler", |cut| scheduler_sweep(&catalog, &replicator_db, cut))
        .await;
}
