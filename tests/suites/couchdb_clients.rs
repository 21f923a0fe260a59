//! Real CouchDB clients against `agentstore serve --couchdb-listen` on every backend (issue 14):
//! each script in `tests/clients/` drives one pinned client (nano, PouchDB and its replication,
//! couchbackup/couchrestore, ibmcloudant, pycouchdb, aiocouch, python-couchdb, the seed's curl
//! commands, per-user isolation through Basic and `_session`) through an ordinary workflow,
//! checks every answer itself and exits non-zero on the first failure. Each script is a trial
//! named `CLIENT::BACKEND`.
//!
//! One endpoint per backend, started on first use and shared by that backend's trials (each
//! script writes its own data-store userId, so they do not see each other's documents); the
//! couchbackup trials restore into a second endpoint of their own on a fresh, empty store. The
//! endpoint is configured with users hashed by `agentstore hash-password`: an admin and two
//! per-user logins.
//!
//! Every backend runs with its default settings: a write is in `_changes` as soon as it is
//! acknowledged, on DynamoDB and Firestore too (their settle window holds back only where a
//! `last_seq` may lead, docs/document-model.md), so no script waits before reading the feed
//! (issue 22). A later read from a `last_seq` may list a change again; the scripts accept a
//! repeat at the revision already seen (`newChangesOnly` in common.js, `check_new_changes_only`
//! in clientlib.py), never a missing one.
//!
//! Selection, all printed before the run:
//! - `AGENTSTORE_TEST_BACKENDS` as for the contract suite; a selected backend whose server
//!   cannot be reached fails its trials.
//! - `AGENTSTORE_TEST_CLIENTS=0` deselects the whole suite (NOT RUN). Otherwise a client that is
//!   not installed FAILS its trials: `npm ci` installs the Node ones (package.json) and
//!   `tests/clients/install-python` the Python ones into `target/clients-venv`.
//! - `AGENTSTORE_CLIENTS_TARGET=pouchdb-server` runs the same scripts against the CouchDB server
//!   of the contract suite instead (pouchdb-server, or `AGENTSTORE_TEST_COUCHDB_URL`), once, as
//!   backend `pouchdb-server`; scripts print what that server does differently from CouchDB, and
//!   what it cannot run at all is NOT RUN, with the reason.
//! - `AGENTSTORE_CLIENTS_USERS=0` configures the endpoint with no users (anonymous requests act
//!   as admin on loopback); the per-user trials are then NOT RUN.
//! - `AGENTSTORE_BIN` runs another `agentstore` binary than the one cargo built.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Failed, Trial};

use crate::common::{agentstore_at, harness, servers};

/// The database the endpoint serves (the seed's name).
const DATABASE: &str = "agent_data_store";
/// How long one client script may run before it is killed and fails.
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(300);
/// How long an endpoint may take to answer `GET /_up`.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// The Node packages the scripts load (package.json pins them).
const NODE_PACKAGES: [&str; 7] = [
    "nano",
    "pouchdb-core",
    "pouchdb-adapter-http",
    "pouchdb-adapter-memory",
    "pouchdb-replication",
    "pouchdb-find",
    "@cloudant/couchbackup",
];
/// The data-store userIds the two per-user logins are configured with.
const ALICE_USER_ID: &str = "client_isolation_alice";
const BOB_USER_ID: &str = "client_isolation_bob";

/// How a script is run.
#[derive(Clone, Copy)]
enum Runner {
    Node,
    Python,
    Shell,
}

/// One client script and what it needs.
#[derive(Clone, Copy)]
struct Client {
    /// The trial's name before `::BACKEND`.
    name: &'static str,
    runner: Runner,
    /// The script in tests/clients/ and its arguments.
    script: &'static str,
    args: &'static [&'static str],
    /// Restores into a second, empty endpoint.
    needs_empty: bool,
    /// Logs in as the per-user logins, which only the endpoint has.
    per_user: bool,
    /// Why it cannot run against pouchdb-server, when it cannot.
    not_on_pouchdb_server: Option<&'static str>,
    /// Why it cannot run on the endpoint's CouchDB backend when that backend's server is
    /// pouchdb-server (it needs the server behind the endpoint to answer as CouchDB does).
    not_over_pouchdb_server: Option<&'static str>,
}

const BACKUP_UNSUPPORTED: &str =
    "pouchdb-server's GET /db has no doc_del_count, so couchrestore refuses every target as \
     not empty";
/// Why couchbackup cannot back up or restore a database of the CouchDB backend over pouchdb-server
/// (the data-store database is the endpoint's own, so the other couchbackup trials run there).
const BACKUP_OVER_POUCHDB_SERVER: &str =
    "the endpoint forwards the CouchDB backend's databases' requests to the server \
     behind it: pouchdb-server 4.2.0 never answers POST /{db}/_bulk_get with {\"docs\":[]}, which couchbackup's \
     full mode sends first (Apache CouchDB answers {\"results\":[]}), and its GET /{db} has no doc_del_count, so \
     couchrestore refuses the target as not empty";
const CLIENTS: [Client; 19] = [
    Client::node("nano", "nano.js", &[]),
    Client::node("nano_databases", "nano-databases.js", &[]),
    Client::node("pouchdb_conflicts", "pouchdb-conflicts.js", &[]),
    Client::node("pouchdb_datastore_conflicts", "pouchdb-datastore-conflicts.js", &[]),
    Client::node("pouchdb_attachments", "pouchdb-attachments.js", &[]),
    Client::python("python_couchdb_databases", "python_couchdb_databases.py"),
    Client::node("pouchdb", "pouchdb.js", &[]),
    Client::node("pouchdb_replicate", "pouchdb-replicate.js", &[]),
    Client {
        needs_empty: true,
        not_on_pouchdb_server: Some(
            "pouchdb-server's _changes has no `pending`, so couchbackup's full mode (the Cloudant changes follower) \
             never ends; and couchrestore refuses its targets (GET /db has no doc_del_count)",
        ),
        ..Client::node("couchbackup_full", "couchbackup.js", &["full"])
    },
    Client {
        needs_empty: true,
        not_on_pouchdb_server: Some(BACKUP_UNSUPPORTED),
        ..Client::node("couchbackup_shallow", "couchbackup.js", &["shallow"])
    },
    Client {
        needs_empty: true,
        not_on_pouchdb_server: Some(BACKUP_UNSUPPORTED),
        not_over_pouchdb_server: Some(BACKUP_OVER_POUCHDB_SERVER),
        ..Client::node("couchbackup_attachments_full", "couchbackup-attachments.js", &["full"])
    },
    Client {
        needs_empty: true,
        not_on_pouchdb_server: Some(BACKUP_UNSUPPORTED),
        not_over_pouchdb_server: Some(BACKUP_OVER_POUCHDB_SERVER),
        ..Client::node("couchbackup_attachments_shallow", "couchbackup-attachments.js", &["shallow"])
    },
    Client::python("ibmcloudant", "ibmcloudant_client.py"),
    Client::python("pycouchdb", "pycouchdb_client.py"),
    Client::python("aiocouch", "aiocouch_client.py"),
    Client::python("python_couchdb", "python_couchdb_client.py"),
    Client { runner: Runner::Shell, ..Client::node("seed_curl", "seed-curl.sh", &[]) },
    Client { per_user: true, ..Client::node("isolation_basic", "isolation.js", &["basic"]) },
    Client { per_user: true, ..Client::node("isolation_session", "isolation.js", &["session"]) },
];

impl Client {
    const fn node(name: &'static str, script: &'static str, args: &'static [&'static str]) -> Self {
        Client {
            name,
            runner: Runner::Node,
            script,
            args,
            needs_empty: false,
            per_user: false,
            not_on_pouchdb_server: None,
            not_over_pouchdb_server: None,
        }
    }

    const fn python(name: &'static str, script: &'static str) -> Self {
        Client { runner: Runner::Python, ..Client::node(name, script, &[]) }
    }

    /// The data-store userId this script writes: its own, so scripts can share an endpoint.
    fn user_id(&self) -> String {
        format!("client_{}", self.name)
    }
}

/// The suite's trials, named `couchdb_clients::CLIENT::BACKEND`; `None`, after printing why, when
/// `AGENTSTORE_CLIENTS_TARGET` is invalid. The endpoints they start run until
/// [`stop_started_processes`].
pub fn trials(args: &Arguments) -> Option<Vec<Trial>> {
    let deselected = std::env::var("AGENTSTORE_TEST_CLIENTS").is_ok_and(|v| v == "0");
    let target = match Target::from_env() {
        Ok(target) => target,
        Err(message) => {
            eprintln!("couchdb clients suite: {message}");
            return None;
        }
    };
    let trials = if deselected {
        if !args.list {
            println!("couchdb clients suite: NOT RUN (deselected by AGENTSTORE_TEST_CLIENTS=0)");
        }
        Vec::new()
    } else {
        match target {
            Target::Endpoint => endpoint_trials(args),
            Target::CouchServer => couch_server_trials(args),
        }
    };
    Some(trials)
}

/// What the scripts run against.
#[derive(Clone, Copy, PartialEq)]
enum Target {
    /// `agentstore serve --couchdb-listen` on each selected backend.
    Endpoint,
    /// The contract suite's CouchDB server (pouchdb-server unless AGENTSTORE_TEST_COUCHDB_URL).
    CouchServer,
}

impl Target {
    fn from_env() -> Result<Target, String> {
        match std::env::var("AGENTSTORE_CLIENTS_TARGET").as_deref() {
            Err(_) | Ok("agentstore") => Ok(Target::Endpoint),
            Ok("pouchdb-server") => Ok(Target::CouchServer),
            Ok(other) => Err(format!("AGENTSTORE_CLIENTS_TARGET={other:?}: expected agentstore or pouchdb-server")),
        }
    }
}

// ---- trials ----

fn endpoint_trials(args: &Arguments) -> Vec<Trial> {
    let Some((backends, selected)) = harness::announce("couchdb clients suite", args.list) else {
        return vec![Trial::test("couchdb_clients::selection", || Err("AGENTSTORE_TEST_BACKENDS is invalid".into()))];
    };
    let without_users = without_users();
    let not_run = move |client: &Client| {
        (client.per_user && without_users)
            .then_some("deselected by AGENTSTORE_CLIENTS_USERS=0 (the endpoint has no users: anonymous acts as admin)")
    };
    // Whether the CouchDB backend's server is pouchdb-server (the server is already started by
    // `announce` when the backend is selected; a listing starts nothing).
    let over_pouchdb_server = !args.list
        && selected.contains(&"couchdb")
        && servers::couchdb().is_ok_and(|server| server.product.starts_with("pouchdb-server"));
    let not_run_on = move |client: &Client, backend: &str| {
        not_run(client).or(client.not_over_pouchdb_server.filter(|_| backend == "couchdb" && over_pouchdb_server))
    };
    if !args.list {
        println!("  endpoint: {} serve --couchdb-listen, one per backend", binary().display());
        announce_clients(not_run);
        for client in CLIENTS {
            if let Some(reason) = not_run_on(&client, "couchdb").filter(|_| not_run(&client).is_none()) {
                println!("  {}::couchdb NOT RUN: {reason}", client.name);
            }
        }
    }
    let mut trials = Vec::new();
    for (index, backend) in backends.iter().enumerate() {
        let (name, fresh) = (backend.name, backend.fresh);
        for client in CLIENTS {
            let trial = Trial::test(format!("couchdb_clients::{}::{name}", client.name), move || {
                let endpoint = shared_endpoint(index, name, fresh)?;
                run_client(client, &endpoint, name, fresh)
            });
            trials.push(trial.with_ignored_flag(!selected.contains(&name) || not_run_on(&client, name).is_some()));
        }
    }
    trials
}

fn couch_server_trials(args: &Arguments) -> Vec<Trial> {
    let server = servers::couchdb();
    let is_pouchdb = server.as_ref().is_ok_and(|s| s.product.starts_with("pouchdb-server"));
    let not_run = move |client: &Client| -> Option<&'static str> {
        if client.per_user {
            return Some("it has no per-user logins mapped to data-store userIds (the endpoint's own)");
        }
        client.not_on_pouchdb_server.filter(|_| is_pouchdb)
    };
    if !args.list {
        match &server {
            Ok(s) => println!(
                "couchdb clients suite: RUN against {} at {} (AGENTSTORE_CLIENTS_TARGET=pouchdb-server)",
                s.product,
                s.url.rsplit('@').next().unwrap_or("?")
            ),
            Err(e) => println!("couchdb clients suite: the CouchDB server is UNAVAILABLE: {e}"),
        }
        announce_clients(not_run);
    }
    CLIENTS
        .into_iter()
        .map(|client| {
            let reason = not_run(&client);
            Trial::test(format!("couchdb_clients::{}::pouchdb-server", client.name), move || {
                let endpoint = couch_server_endpoint()?;
                run_client(client, &endpoint, "pouchdb-server", no_fresh_store)
            })
            .with_ignored_flag(reason.is_some())
        })
        .collect()
}

/// The CouchDB server target makes empty databases itself, never a fresh backend.
fn no_fresh_store() -> harness::BoxFuture<Result<harness::Ctx, String>> {
    Box::pin(async { Err("the CouchDB server target has no backend stores".to_owned()) })
}

/// Prints which clients run, and why the others do not.
fn announce_clients(not_run: impl Fn(&Client) -> Option<&'static str>) {
    println!("couchdb clients:");
    for client in CLIENTS {
        let status = match installed(client.runner) {
            Err(e) => format!("NOT INSTALLED, its trials FAIL: {e}"),
            Ok(()) => match not_run(&client) {
                Some(reason) => format!("NOT RUN: {reason}"),
                None => "RUN".to_owned(),
            },
        };
        println!("  {:<20} {} {}: {status}", client.name, client.script, client.args.join(" "));
    }
}

/// Whether what runs `runner`'s scripts is installed.
fn installed(runner: Runner) -> Result<(), String> {
    let root = repo_root();
    match runner {
        Runner::Node => {
            let missing: Vec<&str> =
                NODE_PACKAGES.iter().copied().filter(|p| !root.join("node_modules").join(p).exists()).collect();
            if missing.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "node_modules lacks {}: run `npm ci --ignore-scripts` (as .ci/run does)",
                    missing.join(", ")
                ))
            }
        }
        Runner::Python => {
            let python = python();
            if python.exists() {
                Ok(())
            } else {
                Err(format!("{} is missing: run tests/clients/install-python (scripts/test does)", python.display()))
            }
        }
        Runner::Shell => Ok(()),
    }
}

// ---- running a script ----

/// Runs `client`'s script against `endpoint`; fails with the end of its output.
fn run_client(client: Client, endpoint: &Endpoint, backend: &'static str, fresh: FreshFn) -> Result<(), Failed> {
    installed(client.runner)?;
    let mut command = match client.runner {
        Runner::Node => Command::new("node"),
        Runner::Python => Command::new(python()),
        Runner::Shell => Command::new("bash"),
    };
    command.arg(client.script).args(client.args).current_dir(repo_root().join("tests/clients"));
    command
        .env("COUCH_URL", endpoint.url_as(&endpoint.admin))
        .env("COUCH_DB", &endpoint.database)
        .env("COUCH_USER_ID", client.user_id())
        .env("COUCH_TARGET", &endpoint.target_name);
    if let (Some(alice), Some(bob)) = (&endpoint.alice, &endpoint.bob) {
        command
            .env("COUCH_URL_ALICE", endpoint.url_as(alice))
            .env("COUCH_URL_BOB", endpoint.url_as(bob))
            .env("COUCH_ALICE_USER_ID", ALICE_USER_ID)
            .env("COUCH_BOB_USER_ID", BOB_USER_ID);
    }
    // The empty endpoint lives as long as the script runs.
    let _empty = if client.needs_empty {
        let empty = empty_endpoint(endpoint, backend, fresh, client.name)?;
        command.env("COUCH_URL_EMPTY", empty.url_as(&empty.admin)).env("COUCH_DB_EMPTY", &empty.database);
        Some(empty)
    } else {
        None
    };
    let output = run_with_timeout(command, SCRIPT_TIMEOUT)?;
    for line in output.text.lines().filter(|l| l.starts_with("pouchdb-server differs")) {
        println!("  {}::{backend}: {line}", client.name);
    }
    if output.success {
        Ok(())
    } else {
        Err(format!(
            "{} {} failed ({}); its output ends:\n{}",
            client.script,
            client.args.join(" "),
            output.status,
            tail(&output.text, 40)
        )
        .into())
    }
}

struct ScriptOutput {
    success: bool,
    status: String,
    /// stdout then stderr.
    text: String,
}

/// Runs `command` with its output in temp files, killing it after `timeout`.
fn run_with_timeout(mut command: Command, timeout: Duration) -> Result<ScriptOutput, Failed> {
    let dir = tempfile::tempdir()?;
    let (out, err) = (dir.path().join("stdout"), dir.path().join("stderr"));
    command.stdin(Stdio::null()).stdout(std::fs::File::create(&out)?).stderr(std::fs::File::create(&err)?);
    let mut child = command.spawn().map_err(|e| format!("cannot start {command:?}: {e}"))?;
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status.to_string();
        }
        if started.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            break format!("killed after {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let success = status == "exit status: 0";
    let text = format!("{}{}", std::fs::read_to_string(&out)?, std::fs::read_to_string(&err)?);
    Ok(ScriptOutput { success, status, text })
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

// ---- endpoints ----

type FreshFn = fn() -> harness::BoxFuture<Result<harness::Ctx, String>>;

/// A login: name and password.
#[derive(Clone)]
struct Login {
    name: String,
    password: String,
}

/// A CouchDB-protocol server the scripts talk to.
#[derive(Clone)]
struct Endpoint {
    /// `127.0.0.1:PORT`.
    host_port: String,
    database: String,
    admin: Login,
    /// The per-user logins, which only our endpoint has.
    alice: Option<Login>,
    bob: Option<Login>,
    /// COUCH_TARGET for the scripts: `agentstore`, `pouchdb-server` or `couchdb`.
    target_name: String,
}

impl Endpoint {
    /// The server root with `login`'s credentials (none for an anonymous login).
    fn url_as(&self, login: &Login) -> String {
        if login.name.is_empty() {
            return format!("http://{}", self.host_port);
        }
        let encode = |s: &str| percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string();
        format!("http://{}:{}@{}", encode(&login.name), encode(&login.password), self.host_port)
    }
}

/// An endpoint process this suite started, stopped when the suite ends (or when dropped).
struct StartedEndpoint {
    endpoint: Endpoint,
    child: Option<Child>,
    _store: Option<tempfile::TempDir>,
}

impl std::ops::Deref for StartedEndpoint {
    type Target = Endpoint;
    fn deref(&self) -> &Endpoint {
        &self.endpoint
    }
}

impl Drop for StartedEndpoint {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The shared endpoints, one per backend (by the backend's index in the harness), kept until
/// the suite ends.
static SHARED: [OnceLock<Result<Endpoint, String>>; 4] = [const { OnceLock::new() }; 4];
static STARTED: Mutex<Vec<StartedEndpoint>> = Mutex::new(Vec::new());

/// Stops the endpoints the trials started (called once the run has ended).
pub fn stop_started_processes() {
    if let Ok(mut started) = STARTED.lock() {
        started.clear();
    }
}

fn shared_endpoint(index: usize, backend: &'static str, fresh: FreshFn) -> Result<Endpoint, Failed> {
    let slot = SHARED.get(index).ok_or("more backends than endpoint slots")?;
    let endpoint = slot.get_or_init(|| {
        let started = start_endpoint(backend, fresh, "shared")?;
        let endpoint = started.endpoint.clone();
        STARTED.lock().map_err(|_| "the endpoint list is poisoned")?.push(started);
        Ok(endpoint)
    });
    endpoint.clone().map_err(|e| format!("the {backend} endpoint did not start: {e}").into())
}

/// A second endpoint on a fresh, empty store of the same backend (or a fresh database on the
/// CouchDB server), for a restore.
fn empty_endpoint(
    shared: &Endpoint,
    backend: &'static str,
    fresh: FreshFn,
    purpose: &str,
) -> Result<StartedEndpoint, Failed> {
    if shared.target_name != "agentstore" {
        let database = format!("{DATABASE}_{}_{purpose}_empty", std::process::id());
        return Ok(StartedEndpoint { endpoint: Endpoint { database, ..shared.clone() }, child: None, _store: None });
    }
    Ok(start_endpoint(backend, fresh, purpose)?)
}

/// Passwords made for this process; their hashes are what the endpoint is configured with.
struct Users {
    admin: Login,
    alice: Login,
    bob: Login,
    config: String,
}

static USERS: OnceLock<Result<Users, String>> = OnceLock::new();

/// Whether AGENTSTORE_CLIENTS_USERS=0 asks for an endpoint with no users.
fn without_users() -> bool {
    std::env::var("AGENTSTORE_CLIENTS_USERS").is_ok_and(|v| v == "0")
}

fn users() -> Result<&'static Users, String> {
    USERS.get_or_init(make_users).as_ref().map_err(Clone::clone)
}

fn make_users() -> Result<Users, String> {
    if without_users() {
        let anonymous = Login { name: String::new(), password: String::new() };
        return Ok(Users {
            admin: anonymous.clone(),
            alice: anonymous.clone(),
            bob: anonymous,
            config: format!("couchdb_db = \"{DATABASE}\"\n"),
        });
    }
    let login =
        |name: &str| Login { name: name.to_owned(), password: format!("{name}-pw-{}-{}", std::process::id(), nanos()) };
    let (admin, alice, bob) = (login("admin"), login("alice"), login("bob"));
    let mut config = format!("couchdb_db = \"{DATABASE}\"\n");
    for (user, role) in [
        (&admin, "admin = true".to_owned()),
        (&alice, format!("user = \"{ALICE_USER_ID}\"")),
        (&bob, format!("user = \"{BOB_USER_ID}\"")),
    ] {
        let hash = hash_password(&user.password)?;
        config
            .push_str(&format!("\n[[couchdb_users]]\nname = \"{}\"\npassword_hash = \"{hash}\"\n{role}\n", user.name));
    }
    Ok(Users { admin, alice, bob, config })
}

fn nanos() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
}

/// `agentstore hash-password`, the password on stdin.
fn hash_password(password: &str) -> Result<String, String> {
    let mut child = agentstore_at(&binary())
        .arg("hash-password")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {} hash-password: {e}", binary().display()))?;
    child
        .stdin
        .take()
        .ok_or("no stdin")?
        .write_all(password.as_bytes())
        .map_err(|e| format!("hash-password stdin: {e}"))?;
    let output = child.wait_with_output().map_err(|e| format!("hash-password: {e}"))?;
    if !output.status.success() {
        return Err(format!("`agentstore hash-password` failed: {}", String::from_utf8_lossy(&output.stderr).trim()));
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// Starts `agentstore serve --couchdb-listen` on a fresh store of `backend`.
fn start_endpoint(backend: &'static str, fresh: FreshFn, purpose: &str) -> Result<StartedEndpoint, String> {
    let users = users()?;
    let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
    let backend_url = if backend == "embedded" {
        format!("embedded:{}", dir.path().join("store.redb").display())
    } else {
        fresh_backend_url(fresh)?
    };
    let config = dir.path().join("agentstore.toml");
    std::fs::write(&config, &users.config).map_err(|e| format!("{}: {e}", config.display()))?;
    let log = dir.path().join("server.log");
    let child = agentstore_at(&binary())
        .args(["--backend", &backend_url, "--config"])
        .arg(&config)
        .args(["serve", "--listen", "127.0.0.1:0", "--couchdb-listen", "127.0.0.1:0"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).map_err(|e| e.to_string())?)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", binary().display()))?;
    let mut started = StartedEndpoint {
        endpoint: Endpoint {
            host_port: String::new(),
            database: DATABASE.to_owned(),
            admin: users.admin.clone(),
            alice: (!without_users()).then(|| users.alice.clone()),
            bob: (!without_users()).then(|| users.bob.clone()),
            target_name: "agentstore".to_owned(),
        },
        child: Some(child),
        _store: None,
    };
    wait_until_up(&mut started, &log).map_err(|e| format!("{purpose} endpoint on {backend}: {e}"))?;
    started._store = Some(dir);
    Ok(started)
}

/// A fresh store of a server-backed backend, by URL (the endpoint process opens it).
fn fresh_backend_url(fresh: FreshFn) -> Result<String, String> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let ctx = runtime.block_on(fresh())?;
    ctx.url.clone().ok_or_else(|| "a server-backed store has a URL".to_owned())
}

/// Reads the CouchDB listener's address from the server's log (it binds port 0: no other
/// process can hold the port), then polls `GET /_up` until 200; fails with the log if the server
/// exits or does not answer.
fn wait_until_up(started: &mut StartedEndpoint, log: &Path) -> Result<(), String> {
    const LISTENING: &str = "serving the CouchDB API on http://";
    let deadline = Instant::now() + START_TIMEOUT;
    let log_tail = || tail(&std::fs::read_to_string(log).unwrap_or_default(), 20);
    loop {
        if started.host_port.is_empty() {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            if let Some(rest) = text.lines().find_map(|line| line.split_once(LISTENING).map(|(_, rest)| rest)) {
                started.endpoint.host_port = rest.split('/').next().unwrap_or_default().to_owned();
            }
        }
        if !started.host_port.is_empty() && http_status(&started.host_port, "/_up") == Some(200) {
            return Ok(());
        }
        if let Some(child) = started.child.as_mut() {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!("the server exited ({status}); its log:\n{}", log_tail()));
            }
        }
        if Instant::now() > deadline {
            return Err(format!(
                "no `{LISTENING}ADDR` line, or GET /_up did not answer 200, within {START_TIMEOUT:?}; the log:\n{}",
                log_tail()
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The status of a plain `GET path` (no credentials: `/_up` needs none), if anything answered.
fn http_status(host_port: &str, path: &str) -> Option<u16> {
    let mut stream = TcpStream::connect(host_port).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: {host_port}\r\nConnection: close\r\n\r\n").ok()?;
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).ok()?;
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

/// The contract suite's CouchDB server as an endpoint, with a database of this run's own.
fn couch_server_endpoint() -> Result<Endpoint, Failed> {
    static ENDPOINT: OnceLock<Result<Endpoint, String>> = OnceLock::new();
    let endpoint = ENDPOINT.get_or_init(|| {
        let server = servers::couchdb()?;
        let parsed = url::Url::parse(&server.url).map_err(|e| format!("{}: {e}", server.url))?;
        let decode = |s: &str| percent_encoding::percent_decode_str(s).decode_utf8_lossy().into_owned();
        let endpoint = Endpoint {
            host_port: format!("{}:{}", parsed.host_str().unwrap_or("127.0.0.1"), parsed.port().unwrap_or(5984)),
            database: format!("{DATABASE}_clients_{}", std::process::id()),
            admin: Login { name: decode(parsed.username()), password: decode(parsed.password().unwrap_or("")) },
            alice: None,
            bob: None,
            target_name: if server.product.starts_with("pouchdb-server") { "pouchdb-server" } else { "couchdb" }
                .to_owned(),
        };
        // The database the scripts share, created as the seed's service creates it.
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
        let url = format!("http://{}/{}", endpoint.host_port, endpoint.database);
        let created = runtime.block_on(async {
            reqwest::Client::new()
                .put(&url)
                .basic_auth(&endpoint.admin.name, Some(&endpoint.admin.password))
                .send()
                .await
                .map(|r| r.status())
        });
        match created {
            Ok(status) if status.as_u16() == 201 => Ok(endpoint),
            Ok(status) => Err(format!("PUT {url} answered {status}")),
            Err(e) => Err(format!("PUT {url}: {e}")),
        }
    });
    endpoint.clone().map_err(|e| format!("the CouchDB server is unavailable: {e}").into())
}

// ---- paths ----

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The `agentstore` binary: `AGENTSTORE_BIN`, or the one cargo built for this test.
fn binary() -> PathBuf {
    std::env::var_os("AGENTSTORE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_agentstore")))
}

/// The Python of the clients' venv (tests/clients/install-python makes it).
fn python() -> PathBuf {
    repo_root().join("target/clients-venv/bin/python")
}
