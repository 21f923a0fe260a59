//! The console at `/_utils` (issue 39) in a real browser: `console::walkthrough::BACKEND` starts
//! `agentstore serve` on a fresh store (the embedded file, and DynamoDB on dynalite as the server
//! backend) and runs `tests/console/walkthrough.py`, which drives Debian's chromium through
//! chromium-driver (Selenium, headless): log in, create a database, add and edit a document (a
//! 409 shown), upload, download and delete an attachment, resolve a conflict, add and run a view,
//! a Mango index, `_explain` and a query paged by bookmark, `_security` and `_revs_limit`, the
//! listings, the service, replication and data-store pages, a narrow window, deleting the
//! database, logging out, a login that is not an admin; on DynamoDB a `migrate` run from the
//! command line into the served backend seen finished on the service page, and a `migrate
//! --follow` seen running, then interrupted after the walkthrough sends it SIGTERM; each step
//! checked in the page and through the API. The embedded trial writes its screenshots into
//! `target/console-screenshots/`, or where `AGENTSTORE_CONSOLE_SCREENSHOTS` says:
//! `AGENTSTORE_CONSOLE_SCREENSHOTS=docs/console` refreshes those of `docs/console.md` (a test run
//! leaves the tracked files alone otherwise).
//!
//! Selection, printed before the run: `AGENTSTORE_TEST_BACKENDS` as for the other suites;
//! `AGENTSTORE_TEST_CONSOLE=0` deselects the suite (NOT RUN, with that reason). Otherwise a
//! missing browser (`/usr/bin/chromium`, `/usr/bin/chromedriver`: Debian's `chromium` and
//! `chromium-driver`) or Selenium venv (`tests/console/install-python`) FAILS the trials.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Failed, Trial};

use crate::common::harness::{self, BoxFuture, Ctx};
use crate::common::{agentstore_at, TestResult, AGENTSTORE};

/// The backends the walkthrough runs on: the embedded store and one server backend.
const BACKENDS: [&str; 2] = ["embedded", "dynamodb"];
/// The one whose run writes the screenshots ([`screenshots_dir`]).
const SCREENSHOT_BACKEND: &str = "embedded";
/// Where the screenshots go: `AGENTSTORE_CONSOLE_SCREENSHOTS` (relative to the repository), else
/// `target/console-screenshots`.
fn screenshots_dir() -> PathBuf {
    match std::env::var_os("AGENTSTORE_CONSOLE_SCREENSHOTS") {
        Some(dir) => repo_root().join(dir),
        None => repo_root().join("target/console-screenshots"),
    }
}
const ADMIN: &str = "admin";
const PASSWORD: &str = "console-admin-pw";
/// A login of one data-store user (`walker`), not an admin: what the console shows it.
const READER: &str = "walker-login";
const READER_PASSWORD: &str = "console-reader-pw";
const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
/// How long the server may take to answer `/_up`, and the whole walkthrough to run.
const START_TIMEOUT: Duration = Duration::from_secs(60);
const WALK_TIMEOUT: Duration = Duration::from_secs(300);

type FreshFn = fn() -> BoxFuture<Result<Ctx, String>>;

/// The suite's trials, named `console::walkthrough::BACKEND`; `None`, after printing why, when
/// the backend selection is invalid.
pub fn trials(args: &Arguments) -> Option<Vec<Trial>> {
    let backends = harness::all();
    let selected = match harness::selected(&backends) {
        Ok(selected) => selected,
        Err(message) => {
            eprintln!("console suite: {message}");
            return None;
        }
    };
    let deselected = std::env::var("AGENTSTORE_TEST_CONSOLE").is_ok_and(|v| v == "0");
    if !args.list {
        announce(&backends, &selected, deselected);
    }
    let trials = backends
        .iter()
        .filter(|b| BACKENDS.contains(&b.name))
        .map(|backend| {
            let (name, fresh) = (backend.name, backend.fresh);
            Trial::test(format!("console::walkthrough::{name}"), move || walkthrough(name, fresh))
                .with_ignored_flag(deselected || !selected.contains(&name))
        })
        .collect();
    Some(trials)
}

fn announce(backends: &[harness::BackendHarness], selected: &[&str], deselected: bool) {
    println!("console suite (/_utils in headless chromium through Selenium):");
    if deselected {
        println!("  NOT RUN: deselected by AGENTSTORE_TEST_CONSOLE=0");
        return;
    }
    for program in [CHROMIUM, CHROMEDRIVER] {
        if !Path::new(program).exists() {
            println!("  {program} MISSING: the trials FAIL (apt-get install chromium chromium-driver)");
        }
    }
    if !python().exists() {
        println!("  {} MISSING: the trials FAIL (run tests/console/install-python)", python().display());
    }
    for backend in backends {
        if !BACKENDS.contains(&backend.name) {
            println!("  {:<10} NOT RUN: the walkthrough runs on the embedded store and DynamoDB", backend.name);
        } else if selected.contains(&backend.name) {
            println!("  {:<10} RUN against {}", backend.name, (backend.describe)());
        } else {
            println!("  {:<10} DESELECTED by AGENTSTORE_TEST_BACKENDS", backend.name);
        }
    }
}

fn walkthrough(backend: &'static str, fresh: FreshFn) -> TestResult {
    for program in [CHROMIUM, CHROMEDRIVER] {
        if !Path::new(program).exists() {
            return Err(format!("{program} is missing: apt-get install chromium chromium-driver").into());
        }
    }
    if !python().exists() {
        return Err(format!("{} is missing: run tests/console/install-python", python().display()).into());
    }
    let server = Server::start(backend, fresh)?;
    // On a server backend a `migrate` from the command line, into the backend the service
    // serves, runs first: the service page must show its record. (The embedded store admits one
    // process: no other can write into it while the service runs.)
    let migrated = match &server.backend_url {
        Some(url) => Some(migrate_into(url, &server)?),
        None => None,
    };
    // And one that keeps following its source: the page must show it running, then, once the
    // walkthrough has sent it SIGTERM (by the pid its record shows), interrupted.
    let _following = match &server.backend_url {
        Some(url) => Some(Following::start(url)?),
        None => None,
    };
    let mut command = Command::new(python());
    command
        .arg(repo_root().join("tests/console/walkthrough.py"))
        .args(["--couchdb", &server.couchdb, "--rest", &server.rest, "--admin", ADMIN, "--password", PASSWORD])
        .args(["--reader", READER, "--reader-password", READER_PASSWORD])
        .args(["--backend", backend, "--chromium", CHROMIUM, "--chromedriver", CHROMEDRIVER]);
    if let Some(count) = migrated {
        command.args(["--migrated", &count.to_string(), "--following"]);
        command.arg("--migration-screenshot").arg(screenshots_dir().join("migration.png"));
    }
    if backend == SCREENSHOT_BACKEND {
        command.arg("--screenshots").arg(screenshots_dir());
    }
    let (status, output) = run_with_timeout(command, WALK_TIMEOUT)?;
    if status != Some(0) {
        return Err(format!(
            "the walkthrough on {backend} failed ({}):\n{output}\nthe server's log:\n{}",
            status.map_or("timed out".to_owned(), |c| format!("exit {c}")),
            server.log_tail()
        )
        .into());
    }
    Ok(())
}

/// `agentstore serve` on a fresh store, both listeners on loopback, the REST one answering the
/// console's origin (`cors_origins`), an admin login and a data-store user's login, stopped when
/// dropped.
struct Server {
    child: Child,
    /// The backend's URL, when other processes may open it (not the embedded store).
    backend_url: Option<String>,
    couchdb: String,
    rest: String,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Server {
    fn start(backend: &str, fresh: FreshFn) -> Result<Server, Failed> {
        let dir = tempfile::tempdir()?;
        let backend_url = if backend == "embedded" {
            format!("embedded:{}", dir.path().join("store.redb").display())
        } else {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let ctx = runtime.block_on(fresh()).map_err(|e| format!("{backend} unavailable: {e}"))?;
            ctx.url.clone().ok_or("a server-backed store has a URL")?
        };
        // The console's origin must be known before the server starts (it is in the config), so
        // its port is chosen here: a port the system just gave out and this process let go.
        let couchdb_port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let couchdb = format!("http://127.0.0.1:{couchdb_port}");
        let hash = agentstore::couchdb_api::auth::hash_password(PASSWORD)?;
        let reader_hash = agentstore::couchdb_api::auth::hash_password(READER_PASSWORD)?;
        let config = dir.path().join("agentstore.toml");
        std::fs::write(
            &config,
            format!(
                "cors_origins = [\"{couchdb}\"]\n\n[[couchdb_users]]\nname = \"{ADMIN}\"\npassword_hash = \"{hash}\"\nadmin = true\n\n\
                 [[couchdb_users]]\nname = \"{READER}\"\npassword_hash = \"{reader_hash}\"\nuser = \"walker\"\n"
            ),
        )?;
        let log = dir.path().join("server.log");
        let child = agentstore_at(Path::new(AGENTSTORE))
            .args(["--backend", &backend_url, "--config"])
            .arg(&config)
            .args(["serve", "--listen", "127.0.0.1:0", "--couchdb-listen", &format!("127.0.0.1:{couchdb_port}")])
            // dynalite accepts any credentials.
            .envs([("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"), ("AWS_REGION", "us-east-1")])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .map_err(|e| format!("cannot start {AGENTSTORE}: {e}"))?;
        let backend_url = (backend != "embedded").then_some(backend_url);
        let mut server = Server { child, backend_url, couchdb, rest: String::new(), log, _dir: dir };
        server.wait_until_up()?;
        Ok(server)
    }

    /// Reads the REST listener's address from the log (`--listen 127.0.0.1:0`), then polls the
    /// CouchDB listener's `/_up` until 200.
    fn wait_until_up(&mut self) -> TestResult {
        const REST_LINE: &str = "agentstore: serving http://";
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if self.rest.is_empty() {
                let text = std::fs::read_to_string(&self.log).unwrap_or_default();
                if let Some(rest) = text.lines().find_map(|line| line.split_once(REST_LINE).map(|(_, rest)| rest)) {
                    let address = rest.split_whitespace().next().unwrap_or_default();
                    self.rest = format!("http://{address}");
                }
            }
            if !self.rest.is_empty() && status_of(&self.couchdb, "/_up") == Some(200) {
                return Ok(());
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("the server exited ({status}); its log:\n{}", self.log_tail()).into());
            }
            if Instant::now() > deadline {
                return Err(
                    format!("the server did not come up in {START_TIMEOUT:?}; its log:\n{}", self.log_tail()).into()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How many documents [`migrate_into`] moves.
const MIGRATED_DOCUMENTS: usize = 3;

/// `agentstore migrate` from a new embedded store holding [`MIGRATED_DOCUMENTS`] documents
/// (written with `agentstore set`) into `target`, to its end; answers how many it moved.
fn migrate_into(target: &str, server: &Server) -> Result<usize, Failed> {
    let dir = tempfile::tempdir()?;
    let source = format!("embedded:{}", dir.path().join("source.redb").display());
    let run = |args: &[&str]| -> TestResult {
        let output = agentstore_at(Path::new(AGENTSTORE))
            .args(args)
            .envs([("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"), ("AWS_REGION", "us-east-1")])
            .output()?;
        if !output.status.success() {
            return Err(format!(
                "agentstore {args:?} failed: {}\nthe server's log:\n{}",
                String::from_utf8_lossy(&output.stderr),
                server.log_tail()
            )
            .into());
        }
        Ok(())
    };
    for i in 0..MIGRATED_DOCUMENTS {
        run(&["--backend", &source, "set", "mover", "moved", &format!("key-{i}"), &format!("{{\"n\": {i}}}")])?;
    }
    let checkpoint = dir.path().join("migrate.checkpoint");
    let checkpoint = checkpoint.to_string_lossy();
    run(&["migrate", "--from", &source, "--to", target, "--checkpoint", &checkpoint, "--progress", "log"])?;
    Ok(MIGRATED_DOCUMENTS)
}

/// `agentstore migrate --follow` from a new embedded store holding one document into `target`,
/// left running (killed when dropped, if the walkthrough did not stop it).
struct Following {
    child: Child,
    _dir: tempfile::TempDir,
}

impl Following {
    fn start(target: &str) -> Result<Following, Failed> {
        let dir = tempfile::tempdir()?;
        let source = format!("embedded:{}", dir.path().join("followed.redb").display());
        let status = agentstore_at(Path::new(AGENTSTORE))
            .args(["--backend", &source, "set", "follower", "followed", "only", "1"])
            .stdout(Stdio::null())
            .status()?;
        if !status.success() {
            return Err("agentstore set into the followed source failed".into());
        }
        let checkpoint = dir.path().join("follow.checkpoint");
        let child = agentstore_at(Path::new(AGENTSTORE))
            .args(["migrate", "--from", &source, "--to", target, "--follow", "--progress", "none", "--checkpoint"])
            .arg(&checkpoint)
            .envs([("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"), ("AWS_REGION", "us-east-1")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        Ok(Following { child, _dir: dir })
    }
}

impl Drop for Following {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The status of a plain `GET path` on `base` (`http://host:port`), if anything answered.
fn status_of(base: &str, path: &str) -> Option<u16> {
    let host_port = base.trim_start_matches("http://");
    let mut stream = TcpStream::connect(host_port).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: {host_port}\r\nConnection: close\r\n\r\n").ok()?;
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).ok()?;
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

/// Runs `command` with its output captured, killing it after `timeout`: its exit code (`None`
/// when killed) and what it printed.
fn run_with_timeout(mut command: Command, timeout: Duration) -> Result<(Option<i32>, String), Failed> {
    let output_file = tempfile::NamedTempFile::new()?;
    let mut child = command
        .stdout(output_file.reopen()?)
        .stderr(output_file.reopen()?)
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", python().display()))?;
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    Ok((status, std::fs::read_to_string(output_file.path()).unwrap_or_default()))
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The Python of the console test's venv (`tests/console/install-python` makes it).
fn python() -> PathBuf {
    repo_root().join("target/console-venv/bin/python")
}
