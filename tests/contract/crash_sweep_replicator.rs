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
use agentstore::database::Databases;
use agentstore::migrate::deployment::side::Side;
use agentstore::replicator::job::{self, JobBounds, JobContext, JobStats, Outcome};
use agentstore::replicator::spec::{self, Replication};
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
async fn compare(catalog: &Arc<dyn Catalog>, source: &DbName, target: &DbName) -> Vec<String> {
    let side = Side::Local { databases: Arc::new(Databases::new(Some(Arc::clone(catalog)), 4)), name: "local".into() };
    let (source, target) = (source.as_str(), target.as_str());
    let (theirs, ours) = match (leaves(&side, source, &side, source).await, leaves(&side, target, &side, source).await)
    {
        (Ok(theirs), Ok(ours)) => (theirs, ours),
        (Err(err), _) | (_, Err(err)) => return vec![format!("reading the leaves failed: {err}")],
    };
    let mut violations = Vec::new();
    if theirs.len() < DOCUMENTS + 1 {
        violations.push(format!("the source lists {} leaves, the set-up wrote {}", theirs.len(), DOCUMENTS + 1));
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
        Ok(Outcome::Completed(_)) => violations.extend(compare(catalog, &source, &target).await),
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
