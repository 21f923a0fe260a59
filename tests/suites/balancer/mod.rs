//! Three `agentstore serve` instances behind a real HAProxy (issue 36), started by the test
//! through `tests/common/balancer.rs`, on DynamoDB (dynalite) and on the Firestore emulator:
//! - `balancer::kill_9_under_load::BACKEND`: writers, a continuous `_changes` reader and a PouchDB
//!   live sync run through the balancer while one instance is SIGKILLed (`kill_nine.rs`);
//! - `balancer::pouchdb_both_ways::BACKEND`: PouchDB replicates in both directions through the
//!   balancer and both sides come back identical (`tests/clients/pouchdb-replicate.js`).
//!
//! Selection, printed before the run: `AGENTSTORE_TEST_BACKENDS` as for the other suites (the
//! embedded store admits one process, and the CouchDB backend is not what these deployments
//! run, so both are NOT RUN here); `AGENTSTORE_TEST_BALANCER=0` deselects the whole suite (NOT
//! RUN, with that reason). Otherwise a missing HAProxy (`/usr/sbin/haproxy`, Debian's package;
//! `AGENTSTORE_TEST_HAPROXY` overrides) or Node package FAILS the trials.

mod kill_nine;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::{json, Value};

use crate::common::balancer::{haproxy_binary, Deployment, DeploymentSpec};
use crate::common::harness::{self, BoxFuture, Ctx};
use crate::common::{block_on, check, TestResult, AGENTSTORE};

/// The database every instance serves (the default `couchdb_db`).
const DB: &str = "agent_data_store";
/// How many instances the balancer starts with.
const INSTANCES: usize = 3;
/// The admin login the instances are configured with.
const ADMIN: &str = "admin";
const PASSWORD: &str = "balancer-admin-pw";
/// The backends a deployment of several instances runs on.
const BACKENDS: [&str; 2] = ["dynamodb", "firestore"];
/// How long a Node client script may run.
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(120);

type FreshFn = fn() -> BoxFuture<Result<Ctx, String>>;

/// The suite's trials, named `balancer::…`; `None`, after printing why, when the backend
/// selection is invalid.
pub fn trials(args: &Arguments) -> Option<Vec<Trial>> {
    let backends = harness::all();
    let selected = match harness::selected(&backends) {
        Ok(selected) => selected,
        Err(message) => {
            eprintln!("balancer suite: {message}");
            return None;
        }
    };
    let deselected = std::env::var("AGENTSTORE_TEST_BALANCER").is_ok_and(|v| v == "0");
    if !args.list {
        announce(&backends, &selected, deselected);
    }
    let mut trials = Vec::new();
    for backend in backends.iter().filter(|b| BACKENDS.contains(&b.name)) {
        let (name, fresh) = (backend.name, backend.fresh);
        let ignored = deselected || !selected.contains(&name);
        trials.push(
            Trial::test(format!("balancer::kill_9_under_load::{name}"), move || {
                let (mut deployment, _work) = deploy(name, fresh)?;
                block_on(kill_nine::kill_9_under_load(&mut deployment, name))
            })
            .with_ignored_flag(ignored),
        );
        trials.push(
            Trial::test(format!("balancer::pouchdb_both_ways::{name}"), move || {
                let (mut deployment, _work) = deploy(name, fresh)?;
                pouchdb_both_ways(&mut deployment)
            })
            .with_ignored_flag(ignored),
        );
    }
    Some(trials)
}

fn announce(backends: &[harness::BackendHarness], selected: &[&str], deselected: bool) {
    println!("balancer suite ({INSTANCES} instances behind HAProxy, round-robin, health checks on /readyz):");
    if deselected {
        println!("  NOT RUN: deselected by AGENTSTORE_TEST_BALANCER=0");
        return;
    }
    let haproxy = haproxy_binary();
    if haproxy.exists() {
        println!("  HAProxy    {}", haproxy.display());
    } else {
        println!("  HAProxy    MISSING at {}: the trials FAIL (install Debian's haproxy package)", haproxy.display());
    }
    for backend in backends {
        if !BACKENDS.contains(&backend.name) {
            println!("  {:<10} NOT RUN: a multi-instance deployment runs on DynamoDB or Firestore", backend.name);
        } else if selected.contains(&backend.name) {
            println!("  {:<10} RUN against {}", backend.name, (backend.describe)());
        } else {
            println!("  {:<10} DESELECTED by AGENTSTORE_TEST_BACKENDS", backend.name);
        }
    }
}

/// Three instances over a fresh store of `backend` behind HAProxy, with an admin login; the
/// temporary directory holding their files lives as long as the caller keeps it.
fn deploy(backend: &str, fresh: FreshFn) -> Result<(Deployment, tempfile::TempDir), Failed> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let ctx = runtime.block_on(fresh()).map_err(|e| format!("{backend} unavailable: {e}"))?;
    let backend_url = ctx.url.clone().ok_or("a server-backed store has a URL")?;
    let hash = agentstore::couchdb_api::auth::hash_password(PASSWORD)?;
    let work = tempfile::tempdir()?;
    let spec = DeploymentSpec {
        binary: PathBuf::from(AGENTSTORE),
        backend_url,
        // Local servers accept any credentials.
        env: [("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"), ("AWS_REGION", "us-east-1")]
            .into_iter()
            .map(|(name, value)| (name.to_owned(), value.to_owned()))
            .collect(),
        config_toml: format!("[[couchdb_users]]\nname = \"{ADMIN}\"\npassword_hash = \"{hash}\"\nadmin = true\n"),
        instances: INSTANCES,
        work_dir: work.path().to_owned(),
    };
    let deployment = Deployment::start(spec).map_err(|e| format!("the deployment on {backend} did not start: {e}"))?;
    Ok((deployment, work))
}

/// `root` with the admin's credentials, as the Node scripts take it.
fn with_admin(root: &str) -> String {
    root.replacen("http://", &format!("http://{ADMIN}:{PASSWORD}@"), 1)
}

/// PouchDB replicates into and out of the deployment through the balancer (pulls, pushes, a
/// conflict, convergence), and both sides are compared document by document, revisions included;
/// then an instance started afterwards lists the same documents as the balancer.
fn pouchdb_both_ways(deployment: &mut Deployment) -> TestResult {
    let output = run_node_script(
        "pouchdb-replicate.js",
        &[
            ("COUCH_URL", with_admin(&deployment.url())),
            ("COUCH_DB", DB.to_owned()),
            ("COUCH_USER_ID", "balancer_smoke".to_owned()),
            ("COUCH_TARGET", "agentstore".to_owned()),
        ],
        None,
    )?;
    check(output.contains("all steps passed"), || format!("pouchdb-replicate.js through the balancer:\n{output}"))?;
    let late = deployment.start_instance()?;
    block_on(async {
        let client = reqwest::Client::new();
        let list = |root: String| {
            let request = client.get(format!("{root}/{DB}/_all_docs")).basic_auth(ADMIN, Some(PASSWORD));
            async move { Ok::<Value, Failed>(request.send().await?.error_for_status()?.json().await?) }
        };
        let (balanced, direct) = (list(deployment.url()).await?, list(late).await?);
        check(
            balanced["rows"].as_array().is_some_and(|rows| !rows.is_empty()) && balanced["rows"] == direct["rows"],
            || format!("the balancer lists {balanced}; an instance started afterwards lists {direct}"),
        )
    })
}

/// Runs `tests/clients/SCRIPT` with Node and `env`, `stdin` written to it if any (else it reads
/// nothing), killing it after [`SCRIPT_TIMEOUT`]; its stdout, or an error with both outputs.
fn run_node_script(script: &str, env: &[(&str, String)], stdin: Option<&[u8]>) -> Result<String, Failed> {
    let child = spawn_node_script(script, env)?;
    finish_node_script(child, script, stdin)
}

/// Starts `tests/clients/SCRIPT` with Node and `env`, its stdin a pipe.
fn spawn_node_script(script: &str, env: &[(&str, String)]) -> Result<std::process::Child, Failed> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    if !root.join("node_modules/pouchdb-core").exists() {
        return Err("PouchDB is not installed: run `npm ci` in the repository (as .ci/run does)".into());
    }
    let mut command = Command::new("node");
    command
        .arg(root.join("tests/clients").join(script))
        .current_dir(root)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (name, value) in env {
        command.env(name, value);
    }
    Ok(command.spawn().map_err(|e| format!("cannot run node {script}: {e}"))?)
}

/// Writes `stdin` (if any) to a started script, closes it, and waits for the script to exit
/// within [`SCRIPT_TIMEOUT`]; its stdout, or an error with both outputs.
fn finish_node_script(mut child: std::process::Child, script: &str, stdin: Option<&[u8]>) -> Result<String, Failed> {
    use std::io::{Read, Write};
    // A script that already ended cannot take its input: what it printed says why.
    let mut stdin_error = None;
    if let Some(mut pipe) = child.stdin.take() {
        if let Some(bytes) = stdin {
            stdin_error = pipe.write_all(bytes).err().map(|e| format!("(its stdin: {e})"));
        }
    }
    let (mut stdout, mut stderr) = (child.stdout.take(), child.stderr.take());
    let readers = std::thread::spawn(move || {
        let (mut out, mut err) = (String::new(), String::new());
        if let Some(pipe) = stdout.as_mut() {
            let _ = pipe.read_to_string(&mut out);
        }
        if let Some(pipe) = stderr.as_mut() {
            let _ = pipe.read_to_string(&mut err);
        }
        (out, err)
    });
    let deadline = std::time::Instant::now() + SCRIPT_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let (out, err) = readers.join().map_err(|_| format!("{script}: the output reader panicked"))?;
    match status {
        Some(status) if status.success() => Ok(out),
        Some(status) => {
            let stdin_error = stdin_error.unwrap_or_default();
            Err(format!("node {script} failed ({status}) {stdin_error}:\n{out}\n{err}").into())
        }
        None => Err(format!("node {script} did not finish within {SCRIPT_TIMEOUT:?}:\n{out}\n{err}").into()),
    }
}

/// A data-store document (the endpoint stores nothing else) for `key` of `user`.
fn document(user: &str, key: &str, value: Value) -> Result<Value, Failed> {
    let namespace = "balanced";
    let id = agentstore::model::DocumentId::new(user, namespace, key, &Default::default())
        .map_err(|e| format!("document id for {key}: {e}"))?;
    Ok(json!({ "_id": id.as_str(), "userId": user, "namespace": namespace, "key": key, "value": value }))
}

/// `/{DB}/{id}` with the id percent-encoded.
fn document_path(id: &str) -> String {
    format!("/{DB}/{}", percent_encoding::utf8_percent_encode(id, percent_encoding::NON_ALPHANUMERIC))
}
