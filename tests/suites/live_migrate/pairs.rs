//! Every ordered pair of the selected backends: `migrate --follow` copies a store while a writer
//! keeps writing to it, then catches up, and both stores are compared. An embedded source is
//! opened by one process at a time, so there the writer is a task and the migration a library job
//! of this process; otherwise both are processes.

use super::*;

pub(super) async fn live_pair(from: Backend, to: Backend) -> TestResult {
    let dir = tempfile::tempdir()?;
    let source = Side::fresh(from, dir.path(), "source").await?;
    let target = Side::fresh(to, dir.path(), "target").await?;
    let exact = source.exact_numbers() && target.exact_numbers();
    let docs = seed_documents(PAIR_KEYS, exact);
    let seed_value = time_seed();
    println!(
        "{} -> {}: {} documents seeded ({}), writer seed {seed_value}",
        source.describe(),
        target.describe(),
        docs.len(),
        if exact { "the whole corpus" } else { "corpus values beyond double precision left out" }
    );
    {
        let backend = source.open().await?;
        seed(backend.as_ref(), &docs).await?;
    }
    let (writes, report) = match source {
        Side::Embedded { .. } => follow_in_process(dir.path(), &source, &target, seed_value, exact).await?,
        Side::Remote { .. } => {
            let writes = follow_with_processes(dir.path(), &source, &target, seed_value).await?;
            match run_until_caught_up(dir.path(), &source, &target, &[]) {
                Ok(report) => (writes, report),
                // Say which documents differ and how, as this suite sees them.
                Err(failed) => {
                    let own = check_same_documents(&source, &target, &writes).await.err();
                    return Err(format!("{failed:?}\nthis suite's comparison: {own:?}").into());
                }
            }
        }
    };
    writes.check_mixed()?;
    check_report_counts(&report)?;
    verify_identical(dir.path(), &source, &target)?;
    check_same_documents(&source, &target, &writes).await
}

/// A server-backed source: a writer process writes through the facade while `migrate --follow`
/// (the binary) copies and follows; SIGTERM stops the migration after the writer has stopped.
async fn follow_with_processes(dir: &Path, source: &Side, target: &Side, seed: u64) -> Result<WriterSummary, Failed> {
    let writer = writer_process::start(source, dir, seed, PAIR_KEYS, source.exact_numbers() && target.exact_numbers())?;
    let mut migration = start_follow(dir, source, target, "follow")?;
    tokio::time::sleep(WRITE_FOR).await;
    let writes = writer.stop()?;
    wait_for_follow_phase(dir, &mut migration)?;
    expect_stopped(dir, terminate(migration)?)?;
    Ok(writes)
}

/// An embedded source: its redb file is locked by the process that opens it, so no second process
/// can write it while a migration process follows it. The writer is a task of this process and the
/// migration runs here through the library, both on the one open store, to the end
/// (`FollowMode::UntilCaughtUp`); the caught-up report is returned as the binary prints it.
async fn follow_in_process(
    dir: &Path,
    source: &Side,
    target: &Side,
    seed: u64,
    exact: bool,
) -> Result<(WriterSummary, Value), Failed> {
    let source_backend = source.open().await?;
    let target_backend = target.open().await?;
    let stop_writing = Arc::new(AtomicBool::new(false));
    let writer = {
        let store = DataStore::open(Arc::clone(&source_backend), Default::default()).await?;
        let stop = Arc::clone(&stop_writing);
        tokio::spawn(async move {
            let mut writer = LiveWriter::new(seed, PAIR_KEYS, exact);
            writer.run(&store, "writer-task", || stop.load(Ordering::Relaxed)).await.map(|()| writer.summary)
        })
    };
    let (stop_migration, stopped) = tokio::sync::oneshot::channel::<()>();
    let job = library_job(dir, &source_backend, &target_backend, FollowMode::Forever);
    let migration = tokio::spawn(migrate::run_until(
        job,
        Box::pin(async move {
            let _ = stopped.await;
        }),
    ));
    tokio::time::sleep(WRITE_FOR).await;
    stop_writing.store(true, Ordering::Relaxed);
    let writes = writer.await??;
    let started = Instant::now();
    while read_checkpoint(dir)?.as_ref().and_then(follow_position).is_none() {
        check(started.elapsed() < Duration::from_secs(120) && !migration.is_finished(), || {
            "the in-process migration did not reach its follow phase".into()
        })?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = stop_migration.send(());
    let report = migration.await??;
    check(report.status == migrate::report::Status::Stopped && report.exit_code() == 0, || {
        format!("stopped follow: {:?}, exit {}", report.status, report.exit_code())
    })?;
    let caught_up = migrate::run(library_job(dir, &source_backend, &target_backend, FollowMode::UntilCaughtUp)).await?;
    check(caught_up.exit_code() == 0, || format!("until caught up: exit {}", caught_up.exit_code()))?;
    let caught_up = serde_json::to_value(&caught_up)?;
    check_caught_up(&caught_up)?;
    // Every handle on the embedded files is dropped here, so the binary can open them next.
    Ok((writes, caught_up))
}

fn library_job(
    dir: &Path,
    source: &Arc<dyn DocumentBackend>,
    target: &Arc<dyn DocumentBackend>,
    follow: FollowMode,
) -> Job {
    Job {
        kind: JobKind::Migrate,
        source: Endpoint::backend(Arc::clone(source)),
        target: Endpoint::backend(Arc::clone(target)),
        options: Options { follow, checkpoint: Some(dir.join("cp.json")), batch_size: 50, ..Options::default() },
    }
}
