//! The replicator (issue 37) between real servers by URL, with real `agentstore serve`
//! processes: a `_replicator` document on one `serve` copies a database of another `serve` (the
//! source, seeded with conflicts, deleted leaves, attachments and a design document) to
//! pouchdb-server (`create_target`); the `serve` running it is killed (`kill -9`) part way and
//! started again over its store: the job resumes from its checkpoint (it reads fewer changes from
//! the source's feed than the source holds documents), completes, and the two copies are equal
//! leaf for leaf.

use super::*;

/// Plain documents seeded beside [`seed`]'s, so the copy takes long enough to be cut.
const PLAIN_DOCS: usize = 3000;

/// The documents `db` holds at `server` (`doc_count`), 0 while it does not exist.
async fn doc_count(server: &str, db: &str) -> Result<u64, String> {
    let (status, info) = call(reqwest::Method::GET, &format!("{server}/{db}"), None).await?;
    Ok(if status == 200 { info["doc_count"].as_u64().unwrap_or(0) } else { 0 })
}

pub(super) async fn resumes_after_kill_9_from_agentstore_to_pouchdb_server() -> TestResult {
    let pouch = second_server()?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let source_dir = dir.path().join("source");
    std::fs::create_dir_all(&source_dir).map_err(|e| e.to_string())?;
    let source = start_face(&source_dir)?;
    let db = format!("{}_rep", prefix());
    seed(&source.url, &db, 40).await?;
    let plain: Vec<Value> = (0..PLAIN_DOCS).map(|i| json!({"_id": format!("plain{i:05}"), "n": i})).collect();
    for chunk in plain.chunks(500) {
        ok(reqwest::Method::POST, &format!("{}/{db}/_bulk_docs", source.url), Some(json!({ "docs": chunk }))).await?;
    }
    let total = doc_count(&source.url, &db).await?;
    // Checkpoints every 100 ms, and a lease a killed instance holds for 2 s only.
    let config = dir.path().join("agentstore.toml");
    std::fs::write(&config, "couchdb_replication_checkpoint_ms = 100\ncouchdb_replication_lease_secs = 2\n")
        .map_err(|e| e.to_string())?;
    let store = format!("embedded:{}", dir.path().join("runner.redb").display());
    let args = ["--config", &config.display().to_string()];
    let runner = start_face_over(dir.path(), &store, &args)?;
    let doc =
        json!({"source": format!("{}/{db}", source.url), "target": format!("{pouch}/{db}"), "create_target": true});
    let doc_url = format!("{}/_replicator/resume", runner.url);
    ok(reqwest::Method::PUT, &doc_url, Some(doc)).await?;
    let started = Instant::now();
    let copied_at_kill = loop {
        let copied = doc_count(&pouch, &db).await?;
        if copied >= 600 {
            break copied;
        }
        check(started.elapsed() < Duration::from_secs(60), || format!("only {copied} documents copied in a minute"))?;
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    drop(runner);
    check(copied_at_kill < total, || format!("the copy ended ({copied_at_kill} of {total}) before the kill"))?;
    let checkpoints = ok(reqwest::Method::GET, &format!("{}/{db}/_local_docs", source.url), None).await?;
    check(
        checkpoints["rows"].as_array().is_some_and(|rows| rows.iter().any(|r| r["id"] != "_local/peer-checkpoint")),
        || format!("no checkpoint at the source before the kill: {checkpoints}"),
    )?;
    let runner = start_face_over(dir.path(), &store, &args)?;
    let doc_url = format!("{}/_replicator/resume", runner.url);
    let started = Instant::now();
    let done = loop {
        let doc = ok(reqwest::Method::GET, &doc_url, None).await?;
        if doc["_replication_state"] == "completed" {
            break doc;
        }
        check(started.elapsed() < Duration::from_secs(120), || format!("not completed after the restart: {doc}"))?;
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // The source's checkpoint: the restarted session started at the sequence the killed one
    // recorded (not from the start), and read from the feed fewer leaves than the source holds
    // documents (every leaf, deleted ones included, had it started over). The counts go on
    // from the history's, as CouchDB's do, so this session's are the difference.
    let rows = ok(reqwest::Method::GET, &format!("{}/{db}/_local_docs?include_docs=true", source.url), None).await?;
    let checkpoint = rows["rows"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|row| &row["doc"])
        .find(|doc| doc["replication_id_version"] == 4)
        .cloned()
        .ok_or_else(|| format!("no checkpoint at the source: {rows}"))?;
    let history = checkpoint["history"].as_array().cloned().unwrap_or_default();
    check(history.len() >= 2, || format!("one session in the checkpoint's history: {checkpoint}"))?;
    let (after, before) = (&history[0], &history[1]);
    check(after["start_last_seq"] == before["recorded_seq"] && after["start_last_seq"] != 0, || {
        format!("the restarted session did not start where the killed one recorded: {checkpoint}")
    })?;
    let checked = |entry: &Value| entry["missing_checked"].as_u64().unwrap_or(0);
    let checked_after = checked(after).saturating_sub(checked(before));
    check(checked_after < total, || {
        format!("the restarted job read {checked_after} leaves from the feed, more than the {total} documents")
    })?;
    check(done["_replication_stats"]["revisions_checked"] == after["missing_checked"], || {
        format!("the document's statistics are the checkpoint's: {done} / {after}")
    })?;
    println!(
        "replicator: {copied_at_kill} of {total} documents copied at the kill; {checked_after} read after the restart"
    );
    drop(runner);
    // `_security` is not replicated (as in CouchDB); copied so that the snapshots compare.
    let security = ok(reqwest::Method::GET, &format!("{}/{db}/_security", source.url), None).await?;
    ok(reqwest::Method::PUT, &format!("{pouch}/{db}/_security"), Some(security)).await?;
    same_database(&source.url, &pouch, &db).await
}
