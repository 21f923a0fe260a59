//! SIGTERM during the copy: the migration stops after a batch (exit 8) with its checkpoint part-way,
//! and the same command then finishes the copy and follows.

use super::*;

/// SIGTERM while the copy runs stops it after a batch, exit 8 (`interrupted`), with the checkpoint
/// part-way; the same command then finishes the copy and follows.
pub(super) async fn sigterm_during_the_copy_stops_after_a_batch() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (source, target) = (
        Side::Embedded { path: dir.path().join("source.redb") },
        Side::Embedded { path: dir.path().join("target.redb") },
    );
    let docs = seed_documents(CRASH_KEYS, true);
    seed(source.open().await?.as_ref(), &docs).await?;
    let mut child = agentstore(dir.path())
        .args(follow_args(&source, &target, &["--concurrency", "1"]))
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.path().join("copy.log"))?)
        .spawn()?;
    let started = Instant::now();
    // Wait for the copy to be under way: a scan position in the checkpoint.
    loop {
        let copying = read_checkpoint(dir.path())?.is_some_and(|cp| cp["position"]["kind"] == "scan");
        if copying {
            break;
        }
        if let Some(status) = child.try_wait()? {
            return Err(
                format!("the migration ended ({status}) before it was stopped: {}", log_tail(dir.path())).into()
            );
        }
        check(started.elapsed() < Duration::from_secs(60), || format!("no copy progress: {}", log_tail(dir.path())))?;
        std::thread::sleep(Duration::from_millis(5));
    }
    let output = terminate(child)?;
    check(output.status.code() == Some(8), || {
        format!("SIGTERM during the copy: {}; {}", output.status, log_tail(dir.path()))
    })?;
    let report = stdout_json(&output)?;
    check(report["status"] == "interrupted", || format!("SIGTERM during the copy: report {report}"))?;
    let checkpoint = read_checkpoint(dir.path())?.ok_or("no checkpoint")?;
    let copied = checkpoint["ledger"]["counts"]["read"].as_u64().unwrap_or(0);
    check(checkpoint["finished"] == false && copied < docs.len() as u64, || {
        format!("the copy was not stopped part-way: {checkpoint}")
    })?;
    check(report["counts"]["read"].as_u64() == Some(copied), || {
        format!("the report and the checkpoint disagree: {report} vs {checkpoint}")
    })?;
    let report = run_until_caught_up(dir.path(), &source, &target, &[])?;
    check(report["runs"] == 2 && report["resumed"] == true, || format!("not resumed: {report}"))?;
    check(report["counts"]["read"].as_u64() == Some(docs.len() as u64), || {
        format!("each source document is counted once over both runs: {report}")
    })?;
    verify_identical(dir.path(), &source, &target)
}
