//! Whole databases through a file (`export`/`import --all-databases`/`--db`) end to end, with
//! the real binary: the source of `migrate_databases` (several databases with conflicts, deleted
//! leaves, deleted documents, attachments of every byte value, design documents, `_security` and
//! a local document, on the harness's CouchDB-protocol server) exported, imported into each
//! selected backend and compared with the source by `verify --all-databases`; imported twice
//! (nothing written the second time); exported again from the backend (gzip) and imported into a
//! second pouchdb-server, compared leaf for leaf and byte for byte over HTTP by
//! `migrate_databases`' own reads. Truncated, altered and over-long files refused before anything
//! is written; an existing `--out` refused; `kill -9` in the import, then the same command, gives
//! a target equal to the source, and `kill -9` in the export leaves no file.
//!
//! Needs the `couchdb` backend selected (it is the source); each backend trial needs its backend.

use std::path::Path;
use std::time::Duration;

use libtest_mimic::{Arguments, Trial};
use serde_json::Value;

use crate::common::{agentstore, block_on, check, harness, TestResult};
use crate::migrate_databases::{
    backend_url, call, prefix, run, same_database, second_server, seed, seed_three, source_server, spawn, wait, FreshFn,
};

pub fn trials(args: &Arguments) -> Option<Vec<Trial>> {
    let (backends, selected) = harness::announce("export_import suite", args.list)?;
    let couch = selected.contains(&"couchdb");
    let mut trials = Vec::new();
    for backend in backends.iter().filter(|b| b.name != "couchdb") {
        let (fresh, name) = (backend.fresh, backend.name);
        trials.push(
            Trial::test(format!("export_import::round_trip::couchdb_file_{name}_file_pouchdb"), move || {
                block_on(round_trip(name, fresh))
            })
            .with_ignored_flag(!(couch && selected.contains(&name))),
        );
    }
    trials.push(
        Trial::test("export_import::refusals::truncated_altered_long_lines_and_existing_out", || block_on(refusals()))
            .with_ignored_flag(!couch),
    );
    trials.push(
        Trial::test("export_import::crash::kill_9_in_import_and_in_export", || block_on(kill_9_in_import_and_export()))
            .with_ignored_flag(!(couch && selected.contains(&"embedded"))),
    );
    Some(trials)
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

fn export_args(from: &str, pattern: &str, out: &Path, extra: &[&str]) -> Vec<String> {
    let mut args = strings(&["export", "--from", from, "--db", pattern, "--progress", "none"]);
    args.extend(["--out".to_owned(), out.display().to_string()]);
    args.extend(strings(extra));
    args
}

fn import_args(to: &str, input: &Path, extra: &[&str]) -> Vec<String> {
    let mut args = strings(&["import", "--to", to, "--all-databases", "--progress", "none"]);
    args.extend(["--in".to_owned(), input.display().to_string()]);
    args.extend(strings(extra));
    args
}

/// Runs the binary expecting a refusal: its exit status and stderr (no report on stdout).
fn run_refused(dir: &Path, args: &[String]) -> Result<(i32, String), String> {
    let output = agentstore(dir).args(args).output().map_err(|e| format!("cannot run agentstore: {e}"))?;
    if !output.stdout.is_empty() {
        return Err(format!("a refusal printed a report: {}", String::from_utf8_lossy(&output.stdout)));
    }
    Ok((output.status.code().unwrap_or(-1), String::from_utf8_lossy(&output.stderr).into_owned()))
}

/// A finished export's report: complete, `databases` of them, and its leaf count.
fn check_exported(report: &Value, code: i32, databases: usize) -> Result<u64, String> {
    if code != 0 || report["status"] != "complete" {
        return Err(format!("export exited {code}: {report}"));
    }
    let listed = report["databases"].as_array().map_or(0, Vec::len);
    if listed != databases {
        return Err(format!("{listed} databases exported, {databases} expected"));
    }
    Ok(report["leaves"].as_u64().unwrap_or(0))
}

/// A finished import's report: complete, nothing refused, every leaf of the file read, and
/// `written` of them written.
fn check_imported(report: &Value, code: i32, leaves: u64, written: Option<u64>) -> TestResult {
    check(code == 0 && report["status"] == "complete", || format!("import exited {code}: {report}"))?;
    let totals = &report["totals"];
    check(totals["failed"] == 0, || format!("refused leaves: {report}"))?;
    check(totals["leaves_read"] == leaves, || format!("{} leaves read, {leaves} in the file", totals["leaves_read"]))?;
    let (sent, present) =
        (totals["leaves_written"].as_u64().unwrap_or(0), totals["already_present"].as_u64().unwrap_or(0));
    check(sent + present == leaves, || format!("{sent} written + {present} present != {leaves}"))?;
    if let Some(written) = written {
        check(sent == written, || format!("{sent} leaves written, {written} expected: {report}"))?;
    }
    Ok(())
}

/// `verify --all-databases` of the selection between the two ends passes.
fn verified(dir: &Path, from: &str, to: &str, pattern: &str) -> TestResult {
    let (code, report) = run(dir, &strings(&["verify", "--from", from, "--to", to, "--db", pattern]))?;
    check(code == 0 && report["passed"] == true, || format!("verify exited {code}: {report}"))?;
    check(report["leaves"].as_u64().unwrap_or(0) > 100, || format!("verify compared few leaves: {report}"))
}

async fn round_trip(name: &'static str, fresh: FreshFn) -> TestResult {
    let (source, back) = (source_server()?, second_server()?);
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let (target, _ctx) = backend_url(fresh, dir.path(), name).await?;
    let (dbs, pattern) = seed_three(&source).await?;
    let file = dir.path().join("source.ndjson");
    let (code, report) = run(dir.path(), &export_args(&source, &pattern, &file, &["--batch-size", "7"]))?;
    let leaves = check_exported(&report, code, 3)?;
    check(leaves > 100, || format!("only {leaves} leaves exported"))?;
    check(report["attachments"].as_u64().unwrap_or(0) >= 30, || format!("few attachments: {report}"))?;
    let (code, report) = run(dir.path(), &import_args(&target, &file, &["--batch-size", "7"]))?;
    check_imported(&report, code, leaves, Some(leaves))?;
    verified(dir.path(), &source, &target, &pattern)?;
    // Twice: every leaf found present, nothing written, still equal.
    let (code, report) = run(dir.path(), &import_args(&target, &file, &[]))?;
    check_imported(&report, code, leaves, Some(0))?;
    verified(dir.path(), &source, &target, &pattern)?;
    // From the backend to a gzip file, and into a second CouchDB-protocol server.
    let gzip = dir.path().join("backend.ndjson.gz");
    let (code, report) = run(dir.path(), &export_args(&target, &pattern, &gzip, &[]))?;
    check(report["gzip"] == true, || format!("not gzip: {report}"))?;
    check(check_exported(&report, code, 3)? == leaves, || format!("the backend's export differs in leaves: {report}"))?;
    let (code, report) = run(dir.path(), &import_args(&back, &gzip, &[]))?;
    check_imported(&report, code, leaves, Some(leaves))?;
    for db in &dbs {
        same_database(&source, &back, db).await?;
        let (status, _) = call(reqwest::Method::GET, &format!("{back}/{db}/_local/peer-checkpoint"), None).await?;
        check(status == 404, || format!("{db}: the local document was exported ({status})"))?;
    }
    verified(dir.path(), &source, &back, &pattern)
}

async fn refusals() -> TestResult {
    let (source, back) = (source_server()?, second_server()?);
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let prefix = prefix();
    let dbs: Vec<String> = ["a", "b"].iter().map(|s| format!("{prefix}_{s}")).collect();
    for db in &dbs {
        seed(&source, db, 30).await?;
    }
    let pattern = format!("{prefix}_*");
    let file = dir.path().join("whole.ndjson");
    let (code, report) = run(dir.path(), &export_args(&source, &pattern, &file, &[]))?;
    check_exported(&report, code, 2)?;
    let text = std::fs::read(&file).map_err(|e| e.to_string())?;
    // An existing --out is refused and left as it was; --restart replaces it.
    let (code, stderr) = run_refused(dir.path(), &export_args(&source, &pattern, &file, &[]))?;
    check(code == 2 && stderr.contains("exists"), || format!("exit {code}: {stderr}"))?;
    check(std::fs::read(&file).map_err(|e| e.to_string())? == text, || "the refused export changed the file".into())?;
    let (code, report) = run(dir.path(), &export_args(&source, &pattern, &file, &["--restart"]))?;
    check_exported(&report, code, 2)?;
    let text = std::fs::read(&file).map_err(|e| e.to_string())?;
    let lines: Vec<&[u8]> = text.split_inclusive(|b| *b == b'\n').collect();
    check(lines.len() > 10, || format!("the export has {} lines", lines.len()))?;
    let cut = |keep: usize, less: usize| -> Vec<u8> {
        let mut bytes = lines[..keep].concat();
        bytes.truncate(bytes.len() - less);
        bytes
    };
    let altered = String::from_utf8_lossy(&text).replacen("document 3 of", "document 9 of", 1).into_bytes();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("cut inside the last line", cut(lines.len(), 5), "cut short"),
        ("the end line lost", cut(lines.len() - 1, 0), "truncated"),
        ("cut inside the first database", cut(5, 0), "truncated"),
        ("cut inside a leaf line", cut(6, 40), "cut short"),
        ("a leaf changed", altered, "SHA-256"),
    ];
    for (what, bytes, expected) in cases {
        let broken = dir.path().join("broken.ndjson");
        std::fs::write(&broken, &bytes).map_err(|e| e.to_string())?;
        let (code, stderr) = run_refused(dir.path(), &import_args(&back, &broken, &[]))?;
        check(code == 2 && stderr.contains(expected) && stderr.contains("nothing was imported"), || {
            format!("{what}: exit {code}, expected a refusal naming {expected:?}: {stderr}")
        })?;
    }
    // A line limit below the file's lines is named.
    let (code, stderr) = run_refused(dir.path(), &import_args(&back, &file, &["--max-line-bytes", "300"]))?;
    check(code == 2 && stderr.contains("line limit of 300 bytes"), || format!("exit {code}: {stderr}"))?;
    let (code, stderr) = run_refused(
        dir.path(),
        &export_args(&source, &pattern, &dir.path().join("small.ndjson"), &["--max-line-bytes", "300"]),
    )?;
    check(code == 2 && stderr.contains("line limit of 300 bytes"), || format!("export: exit {code}: {stderr}"))?;
    check(!dir.path().join("small.ndjson").exists(), || "a refused export left its file".into())?;
    // Nothing of any refused import reached the target.
    for db in &dbs {
        let (status, _) = call(reqwest::Method::GET, &format!("{back}/{db}"), None).await?;
        check(status == 404, || format!("{db} exists at the target after refused imports ({status})"))?;
    }
    Ok(())
}

async fn kill_9_in_import_and_export() -> TestResult {
    let source = source_server()?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let target = format!("embedded:{}", dir.path().join("target.redb").display());
    let prefix = prefix();
    let dbs: Vec<String> = ["a", "b", "c", "d"].iter().map(|s| format!("{prefix}_{s}")).collect();
    for db in &dbs {
        seed(&source, db, 150).await?;
    }
    let pattern = format!("{prefix}_*");
    // An export killed leaves no file at --out.
    let out = dir.path().join("killed.ndjson");
    let mut child = spawn(dir.path(), &export_args(&source, &pattern, &out, &["--batch-size", "2"]))?;
    match wait(&mut child, Duration::from_millis(400)).await? {
        Some(code) => println!("the export ended ({code}) before it could be killed"),
        None => {
            child.kill().map_err(|e| e.to_string())?; // SIGKILL
            let _ = child.wait();
            check(!out.exists(), || "a killed export left a file at --out".into())?;
        }
    }
    let file = dir.path().join("source.ndjson");
    let (code, report) = run(dir.path(), &export_args(&source, &pattern, &file, &[]))?;
    let leaves = check_exported(&report, code, 4)?;
    // The import, killed at pseudo-random moments once its checkpoint exists (the seed is
    // printed for a rerun), so each next run goes on from a checkpoint.
    let seed_value =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
    println!("kill_9 seed {seed_value}");
    let mut state = seed_value | 1;
    let mut kills = 0;
    let checkpoint = dir.path().join("import-checkpoint.json");
    let import = import_args(&target, &file, &["--batch-size", "5", "--checkpoint", &checkpoint.display().to_string()]);
    let mut killed_last = false;
    for _ in 0..4 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let mut child = spawn(dir.path(), &import)?;
        let started = std::time::Instant::now();
        while !checkpoint.exists() && child.try_wait().map_err(|e| e.to_string())?.is_none() {
            check(started.elapsed() < Duration::from_secs(60), || "the import wrote no checkpoint".into())?;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        match wait(&mut child, Duration::from_millis(state % 300)).await? {
            Some(code) => {
                check(code == 0, || format!("the import exited {code}"))?;
                killed_last = false;
                break;
            }
            None => {
                child.kill().map_err(|e| e.to_string())?; // SIGKILL
                let _ = child.wait();
                kills += 1;
                killed_last = true;
            }
        }
    }
    println!("import killed {kills} times");
    // A kill can land after the import finished and removed its checkpoint: then there is
    // nothing to resume.
    let left_checkpoint = killed_last && checkpoint.exists();
    let (code, report) = run(dir.path(), &import)?;
    check_imported(&report, code, leaves, None)?;
    check(report["resumed"] == left_checkpoint, || {
        format!("resumed should be {left_checkpoint} (a checkpoint left by kill -9): {report}")
    })?;
    verified(dir.path(), &source, &target, &pattern)?;
    // And again from the start: nothing left to write.
    let (code, report) = run(dir.path(), &import)?;
    check(report["resumed"] == false, || format!("a finished import left its checkpoint: {report}"))?;
    check_imported(&report, code, leaves, Some(0))
}
