//! The migration killed with SIGKILL at random moments of its copy and follow phases and resumed,
//! while the writer goes on between the kills.

use super::*;

/// Kills needed in each phase.
const KILLS_PER_PHASE: usize = 3;

pub(super) async fn crash_and_resume(from: Backend, to: Backend) -> TestResult {
    let dir = tempfile::tempdir()?;
    let dir = dir.path();
    let source = Side::fresh(from, dir, "source").await?;
    let target = Side::fresh(to, dir, "target").await?;
    let exact = source.exact_numbers() && target.exact_numbers();
    let docs = seed_documents(CRASH_KEYS, exact);
    {
        let backend = source.open().await?;
        seed(backend.as_ref(), &docs).await?;
    }
    let seed_value = time_seed();
    println!("{} -> {}: {} documents, kill seed {seed_value}", source.describe(), target.describe(), docs.len());
    let mut random = Random::new(seed_value);
    let mut writes = WriterSummary::default();
    // An embedded source is locked by the migration process while it runs, so its writer writes
    // between the killed runs instead of during them; a server's writer runs throughout.
    let background = match source {
        Side::Remote { .. } => Some(writer_process::start(&source, dir, seed_value, CRASH_KEYS, exact)?),
        Side::Embedded { .. } => None,
    };
    let mut between = LiveWriter::new(seed_value, CRASH_KEYS, exact);
    let (mut copy_kills, mut follow_kills, mut positions) = (0, 0, BTreeSet::new());
    let started = Instant::now();
    for attempt in 0..4 * KILLS_PER_PHASE {
        if follow_kills >= KILLS_PER_PHASE {
            break;
        }
        if background.is_none() {
            let store = DataStore::open(source.open().await?, Default::default()).await?;
            let until = Instant::now() + Duration::from_millis(300);
            between.run(&store, "writer-between-runs", || Instant::now() >= until).await?;
        }
        let mut child = start_follow(dir, &source, &target, &format!("run-{attempt}"))?;
        if copy_kills < KILLS_PER_PHASE && read_checkpoint(dir)?.as_ref().and_then(follow_position).is_none() {
            // While it copies: once this run has moved the copy on by a batch (a fixed delay can
            // outlast a fast copy), within a few milliseconds.
            wait_for_copy_progress(dir, &mut child)?;
            tokio::time::sleep(Duration::from_millis(random.below(20) as u64)).await;
        } else {
            // Once it follows, after it has had time to apply some changes.
            wait_for_follow_phase(dir, &mut child)?;
            tokio::time::sleep(Duration::from_millis(200 + random.below(1500) as u64)).await;
        }
        if let Some(status) = child.try_wait()? {
            let output = child.wait_with_output()?;
            let logs = log_tail(dir);
            let evidence = conflict_evidence(dir, &source, &target, &logs).await;
            return Err(format!(
                "migrate --follow ended by itself ({status}) after {copy_kills} copy-phase and {follow_kills} \
                 follow-phase kills: {}{logs}{evidence}",
                String::from_utf8_lossy(&output.stdout),
            )
            .into());
        }
        child.kill()?; // SIGKILL
        child.wait()?;
        match read_checkpoint(dir)?.as_ref().and_then(follow_position) {
            None => copy_kills += 1,
            Some(position) => {
                follow_kills += 1;
                positions.insert(position);
            }
        }
    }
    println!(
        "  killed {copy_kills} times in the copy phase, {follow_kills} in the follow phase ({} follow positions saved) in {:.1}s",
        positions.len(),
        started.elapsed().as_secs_f64()
    );
    match background {
        Some(writer) => writes.absorb(writer.stop()?),
        None => writes.absorb(between.summary),
    }
    check(copy_kills >= KILLS_PER_PHASE && follow_kills >= KILLS_PER_PHASE, || {
        format!("killed {copy_kills} times copying and {follow_kills} following; {KILLS_PER_PHASE} each wanted")
    })?;
    writes.check_mixed()?;
    let report = run_until_caught_up(dir, &source, &target, &[])?;
    check_report_counts(&report)?;
    let checkpoint = read_checkpoint(dir)?.ok_or("no checkpoint after the final run")?;
    check(follow_position(&checkpoint).is_some(), || format!("the checkpoint holds no follow position: {checkpoint}"))?;
    verify_identical(dir, &source, &target)?;
    check_same_documents(&source, &target, &writes).await
}
