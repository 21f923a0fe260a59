//! The crash-point sweep of a migration's pages (issue 35 §3; docs/design/crash-points.md,
//! "Migration"): the sink cut at its `k`-th storage call, for every `k` until the copy runs
//! uncut, both ways (the process stopped; the answer of call `k` lost and the run going on).
//! After each cut the same migration is run again over the sink without the layer (the restart:
//! it resumes from its checkpoint file, which a crash leaves as it was after the last page it
//! recorded), and must end with an exact copy: its own read-back passes, and a `verify` of the
//! two sides finds no difference, so nothing the source holds is missing.
//!
//! Two copies are swept: `migrate` (the data-store documents, `bulk_write` create-only pages)
//! and `migrate --db` (a database with revision trees: a conflict, a deleted document and an
//! attachment, moved as the replication protocol moves them). The source is an embedded store in
//! a temporary directory; the sink is the backend under test (a database of its catalog, made
//! for each run). The checkpoints are files, not a backend: the sweep leaves them alone.

use std::future::Future;
use std::path::Path;
use std::sync::Arc;

use agentstore::backend::catalog::{open_catalog, Catalog, DbName, EmbeddedCatalog};
use agentstore::backend::embedded::EmbeddedBackend;
use agentstore::backend::{BackendUrl, BulkWrite, DocumentBackend, Precondition};
use agentstore::database::Databases;
use agentstore::migrate::deployment::side::Side;
use agentstore::migrate::deployment::{self, MoveOptions, Selection};
use agentstore::migrate::verify::{verify, VerifyOptions};
use agentstore::migrate::{self, Endpoint, Job, JobKind, Options};
use agentstore::model::id::encode_key;
use serde_json::{json, Map, Value};

use crate::crash::{CrashLayer, CrashPoint, CrashingCatalog, Cut};
use crate::crash_sweep::{object, seed_copy_source};
use crate::harness::Ctx;

/// More sink calls than a swept copy makes.
const MAX_CRASH_POINTS: usize = 200;
/// Data-store documents at the source, and per page: three pages, the last one short.
const DOCUMENTS: usize = 5;
const PAGE: usize = 2;
/// Documents of the moved database (an attachment, a conflict, a deletion): two pages.
const DATABASE_DOCUMENTS: usize = 3;

/// Which copy is swept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Copy {
    /// `migrate`: the data-store documents.
    DataStore,
    /// `migrate --db`: one database with its revision trees.
    Database,
}

/// How the sweep of one copy went, one kind of cut.
#[derive(Default)]
pub struct Tally {
    pub crash_points: usize,
    pub steps: Vec<&'static str>,
    pub violations: Vec<String>,
}

/// Sweeps `what` on `backend` with both kinds of cut, prints each tally and fails with every
/// violation found.
pub async fn sweep_both_cuts<Sweep, Swept>(backend: &str, what: &str, mut sweep: Sweep)
where
    Sweep: FnMut(Cut) -> Swept,
    Swept: Future<Output = Tally>,
{
    let mut failures = Vec::new();
    for cut in [Cut::Stop, Cut::LoseAnswer] {
        let tally = sweep(cut).await;
        println!(
            "crash sweep: {backend} {what} {cut:?}: {} crash points, {} violations; steps: {}",
            tally.crash_points,
            tally.violations.len(),
            tally.steps.join(" ")
        );
        failures.extend(tally.violations);
    }
    assert!(failures.is_empty(), "crash sweep: {backend} {what}: violations:\n  {}", failures.join("\n  "));
}

fn data_store_body(n: usize) -> (String, Map<String, Value>) {
    let key = format!("key-{n}");
    let id = format!("sweeper:pages:{}", encode_key(&key));
    let body = object(json!({
        "userId": "sweeper", "namespace": "pages", "key": key, "value": {"n": n, "list": [n, "x", null]},
        "metadata": {"n": n}, "createdByAgent": "sweep", "lastAccessedByAgent": "sweep", "accessCount": n,
        "createdAt": "2026-02-01T10:00:00Z", "updatedAt": format!("2026-02-01T11:{n:02}:00Z"),
    }));
    (id, body)
}

/// The data-store source: an embedded store in `dir` with [`DOCUMENTS`] documents.
async fn data_store_source(dir: &Path) -> Arc<dyn DocumentBackend> {
    let source = EmbeddedBackend::open(&dir.join("source.redb")).await.expect("the source store");
    let writes = (0..DOCUMENTS)
        .map(|n| {
            let (id, body) = data_store_body(n);
            BulkWrite { id, body, precondition: Precondition::MustNotExist }
        })
        .collect();
    for written in source.bulk_write(writes).await.expect("seeding the source") {
        written.expect("a seeded document");
    }
    Arc::new(source)
}

/// The source database `name` of a deployment move: an embedded catalog in `dir` holding
/// documents with a conflict, a deleted one and an attachment.
async fn database_source(dir: &Path, name: &DbName) -> Arc<Databases> {
    let catalog: Arc<dyn Catalog> = Arc::new(EmbeddedCatalog::new(&dir.join("source.redb"), Default::default()));
    let databases = Arc::new(Databases::new(Some(catalog), 4));
    let db = databases.create(name).await.expect("the source database");
    seed_copy_source(&db, DATABASE_DOCUMENTS, "moved bytes").await;
    databases
}

/// Runs `copy` until it ends, or (a stopped process) until the layer cuts a call: what a
/// stopped process does after that never reaches storage, and its retries would only wait.
async fn until_cut<T>(point: &CrashPoint, cut: Cut, copy: impl Future<Output = T>) -> Option<T> {
    if cut == Cut::LoseAnswer {
        return Some(copy.await);
    }
    tokio::select! {
        answer = copy => Some(answer),
        () = point.cut_reached() => None,
    }
}

fn data_store_job(
    source: &Arc<dyn DocumentBackend>,
    sink: Arc<dyn DocumentBackend>,
    dir: &Path,
    read_back: bool,
) -> Job {
    Job {
        kind: JobKind::Migrate,
        source: Endpoint::Backend { backend: Arc::clone(source), name: "sweep-source".into() },
        target: Endpoint::Backend { backend: sink, name: "sweep-sink".into() },
        options: Options {
            batch_size: PAGE,
            concurrency: 1,
            checkpoint: Some(dir.join("checkpoint.json")),
            verify: read_back,
            ..Options::default()
        },
    }
}

/// One crash point of `migrate`: the copy cut, resumed, and compared. The violations found, and
/// whether the cut was made.
async fn data_store_point(
    catalog: &Arc<dyn Catalog>,
    source: &Arc<dyn DocumentBackend>,
    k: usize,
    cut: Cut,
    steps: &mut Vec<&'static str>,
) -> (Vec<String>, bool) {
    let dir = tempfile::tempdir().expect("a directory");
    let name =
        DbName::parse(&format!("sweep-migrate-{}-{cut:?}-{k}", std::process::id()).to_lowercase()).expect("a name");
    let sink = catalog.create(&name).await.expect("the sink");
    let point = CrashPoint::new(k, cut);
    let layered: Arc<dyn DocumentBackend> = Arc::new(CrashLayer::at(Arc::clone(&sink), Arc::clone(&point)));
    let answer = until_cut(&point, cut, migrate::run(data_store_job(source, layered, dir.path(), false))).await;
    point.end();
    let cut_made = point.cut_made();
    if !cut_made {
        *steps = point.called();
        if let Some(Err(err)) = &answer {
            panic!("migrate failed uncut after {} calls: {err}", point.calls());
        }
    }
    let mut violations = Vec::new();
    match migrate::run(data_store_job(source, Arc::clone(&sink), dir.path(), true)).await {
        Ok(report) => {
            if !report.verification.as_ref().is_some_and(|v| v.passed) {
                violations.push(format!("the resumed migration's read-back: {:?}", report.verification));
            }
        }
        Err(err) => violations.push(format!("the resumed migration failed: {err}")),
    }
    let compared = verify(
        &Endpoint::backend(Arc::clone(source)),
        &Endpoint::backend(Arc::clone(&sink)),
        &VerifyOptions::default(),
    )
    .await;
    match compared {
        Ok(report) if report.identical && report.matching == DOCUMENTS as u64 => {}
        Ok(report) => violations.push(format!("verify after the resumed migration: {}", report.message)),
        Err(err) => violations.push(format!("verify failed: {err}")),
    }
    Catalog::delete(catalog.as_ref(), &name).await.expect("dropping the sink");
    (violations, cut_made)
}

/// One crash point of `migrate --db`.
async fn database_point(
    catalog: &Arc<dyn Catalog>,
    k: usize,
    cut: Cut,
    steps: &mut Vec<&'static str>,
) -> (Vec<String>, bool) {
    let dir = tempfile::tempdir().expect("a directory");
    let name = DbName::parse(&format!("sweep-move-{}-{cut:?}-{k}", std::process::id()).to_lowercase()).expect("a name");
    let source = Side::local(database_source(dir.path(), &name).await, "sweep-source");
    let point = CrashPoint::new(k, cut);
    let crashing: Arc<dyn Catalog> = Arc::new(CrashingCatalog::new(Arc::clone(catalog), Arc::clone(&point)));
    let side = |catalog: Arc<dyn Catalog>| Side::local(Arc::new(Databases::new(Some(catalog), 4)), "sweep-sink");
    let options = |read_back: bool| MoveOptions {
        selection: Selection { include: vec![name.as_str().to_owned()], exclude: Vec::new() },
        batch_size: PAGE,
        databases_at_once: 1,
        checkpoint: Some(dir.path().join("checkpoints")),
        verify: read_back,
        ..MoveOptions::default()
    };
    let never = || Box::pin(std::future::pending::<()>());
    let answer = until_cut(&point, cut, deployment::run(source.clone(), side(crashing), options(false), never())).await;
    point.end();
    let cut_made = point.cut_made();
    if !cut_made {
        *steps = point.called();
        if let Some(Err(err)) = &answer {
            panic!("migrate --db failed uncut after {} calls: {err}", point.calls());
        }
    }
    let mut violations = Vec::new();
    match deployment::run(source, side(Arc::clone(catalog)), options(true), never()).await {
        Ok(report) => match &report.verification {
            Some(read_back) if read_back.passed && read_back.leaves > 0 => {}
            other => violations.push(format!("the resumed move's read-back: {other:?}")),
        },
        Err(err) => violations.push(format!("the resumed move failed: {err}")),
    }
    if Catalog::delete(catalog.as_ref(), &name).await.is_err() {
        violations.push("the moved database cannot be deleted".into());
    }
    (violations, cut_made)
}

async fn sweep(catalog: &Arc<dyn Catalog>, copy: Copy, cut: Cut) -> Tally {
    let mut tally = Tally::default();
    // The data-store source is only read: one for every crash point.
    let dir = tempfile::tempdir().expect("a directory");
    let source = data_store_source(dir.path()).await;
    for k in 0..MAX_CRASH_POINTS {
        let (violations, cut_made) = match copy {
            Copy::DataStore => data_store_point(catalog, &source, k, cut, &mut tally.steps).await,
            Copy::Database => database_point(catalog, k, cut, &mut tally.steps).await,
        };
        tally.violations.extend(violations.into_iter().map(|v| format!("{cut:?} at call {k}: {v}")));
        if !cut_made {
            return tally;
        }
        tally.crash_points += 1;
    }
    panic!("{copy:?} was still cut after {MAX_CRASH_POINTS} calls")
}

async fn sweep_copy(ctx: Ctx, copy: Copy) {
    if ctx.backend_name == "couchdb" {
        println!("couchdb: not applicable: a CouchDB sink keeps its own pages (the engine's sweep covers the others)");
        return;
    }
    let url: BackendUrl = ctx.backend_url.parse().expect("the harness's backend URL parses");
    let catalog = open_catalog(&url).await.expect("the sink's catalog");
    let what = format!("migrate {copy:?}");
    sweep_both_cuts(ctx.backend_name, &what, |cut| sweep(&catalog, copy, cut)).await;
}

pub async fn crash_sweep_migrate_page(ctx: Ctx) {
    sweep_copy(ctx, Copy::DataStore).await
}

pub async fn crash_sweep_migrate_database_page(ctx: Ctx) {
    sweep_copy(ctx, Copy::Database).await
}
