//! The targets the HTTP benches measure side by side (`attachments_bench`, `views_bench`,
//! `versus_couchdb`): agentstore over each backend (the tests' local servers) and pouchdb-server as
//! users would run it instead, each in a server process of its own whose memory is read from
//! `/proc`; and a real Apache CouchDB already running, given by `BENCH_COUCHDB_URL`
//! (`http://admin:password@127.0.0.1:15984`), which is not started here and whose memory is not
//! read (its `pid` is 0). With `BENCH_COUCHDB_URL` set, the CouchDB backend's target is agentstore
//! in front of that same server instead of the tests' pouchdb-server.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::run_suffix;
use super::serve::Server;
use crate::servers;

const BIN: &str = env!("CARGO_BIN_EXE_agentstore");
/// The embedded store's file in an `embedded` target's directory ([`Running::stop_keeping_dir`]).
pub const EMBEDDED_STORE_FILE: &str = "bench.redb";
/// How long pouchdb-server may take to answer its first `GET /`.
const POUCHDB_STARTUP: Duration = Duration::from_secs(30);

/// What is measured.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Embedded,
    DynamoDb,
    Firestore,
    CouchDb,
    PouchLevelDb,
    PouchMemory,
    /// The Apache CouchDB at `BENCH_COUCHDB_URL`, measured directly.
    ApacheCouchDb,
}

/// The variable naming a real CouchDB to measure and to put agentstore's CouchDB backend in
/// front of: `http://USER:PASSWORD@HOST:PORT`, no database.
pub const COUCHDB_URL_VARIABLE: &str = "BENCH_COUCHDB_URL";

/// `BENCH_COUCHDB_URL` without a trailing slash, when set.
pub fn real_couchdb_url() -> Option<String> {
    std::env::var(COUCHDB_URL_VARIABLE)
        .ok()
        .map(|url| url.trim().trim_end_matches('/').to_owned())
        .filter(|url| !url.is_empty())
}

impl Kind {
    pub const ALL: [Kind; 7] = [
        Kind::ApacheCouchDb,
        Kind::Embedded,
        Kind::DynamoDb,
        Kind::Firestore,
        Kind::CouchDb,
        Kind::PouchLevelDb,
        Kind::PouchMemory,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Embedded => "embedded",
            Kind::DynamoDb => "dynamodb",
            Kind::Firestore => "firestore",
            Kind::CouchDb => "couchdb",
            Kind::PouchLevelDb => "pouchdb-leveldb",
            Kind::PouchMemory => "pouchdb-memory",
            Kind::ApacheCouchDb => "apache-couchdb",
        }
    }

    /// `BENCH_TARGETS`, in [`Kind::ALL`] order whatever order it names them in; by default every
    /// target but the real CouchDB, which only `versus_couchdb` measures by default (the other
    /// benches read their targets' memory from `/proc`, which a server they did not start has
    /// not here: named in `BENCH_TARGETS`, it fails their memory columns).
    pub fn from_env() -> Result<Vec<Kind>, String> {
        let names = std::env::var("BENCH_TARGETS").unwrap_or_default();
        if names.trim().is_empty() {
            return Ok(Kind::ALL.into_iter().filter(|kind| *kind != Kind::ApacheCouchDb).collect());
        }
        let mut wanted = Vec::new();
        for name in names.split(',').map(str::trim) {
            let kind = Kind::ALL.into_iter().find(|k| k.name() == name).ok_or_else(|| {
                let known: Vec<&str> = Kind::ALL.iter().map(|k| k.name()).collect();
                format!("BENCH_TARGETS names unknown target {name:?} (known: {})", known.join(", "))
            })?;
            wanted.push(kind);
        }
        Ok(Kind::ALL.into_iter().filter(|k| wanted.contains(k)).collect())
    }
}

/// A pouchdb-server process started here; killed when dropped.
pub struct PouchProcess {
    child: Child,
}

impl Drop for PouchProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The server process of a target, stopped by [`Running::stop`] (or when dropped).
pub enum Process {
    Agentstore(Server),
    Pouch(PouchProcess),
    /// A server this bench did not start (`BENCH_COUCHDB_URL`): left running.
    External,
}

/// A target being measured.
pub struct Running {
    /// For the table: `agentstore, embedded store`, `pouchdb-server 4.2.0, LevelDB`.
    pub label: String,
    /// `http://127.0.0.1:PORT`, no credentials.
    pub root: String,
    /// Basic credentials sent with every request.
    pub login: Option<(String, String)>,
    /// The process whose memory is read; 0 for a server this bench did not start.
    pub pid: u32,
    /// agentstore's data-store database (`agent_data_store`); `None` elsewhere.
    pub data_store: Option<String>,
    pub process: Process,
    /// The store's or pouchdb-server's directory, removed after the process stops.
    _dir: Option<tempfile::TempDir>,
}

/// How an agentstore target is started.
#[derive(Clone, Copy, Default)]
pub struct StartOptions {
    /// Configure one admin login (`admin`/`password`, [`ADMIN_LOGIN`]) and send it with every
    /// request, as clients of a real CouchDB do (Basic auth on both sides); without it the
    /// server has no logins and every request is admin.
    pub basic_login: bool,
}

/// The admin login of targets started with [`StartOptions::basic_login`], and pouchdb-server's.
pub const ADMIN_LOGIN: (&str, &str) = ("admin", "password");

impl Running {
    pub fn start(kind: Kind, bench: &str) -> Result<Running, String> {
        Self::start_with(kind, bench, StartOptions::default())
    }

    pub fn start_with(kind: Kind, bench: &str, options: StartOptions) -> Result<Running, String> {
        if kind == Kind::ApacheCouchDb {
            return real_couchdb();
        }
        let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
        let table = format!("{bench}_{}", run_suffix());
        let (backend, label) = match kind {
            Kind::Embedded => (
                format!("embedded:{}", dir.path().join(EMBEDDED_STORE_FILE).display()),
                "agentstore, embedded store".into(),
            ),
            Kind::DynamoDb => {
                let server = servers::dynamodb()?;
                (server.table_url(&table), format!("agentstore over DynamoDB ({})", server.product))
            }
            Kind::Firestore => {
                let server = servers::firestore()?;
                (server.collection_url(&table), format!("agentstore over Firestore ({})", server.product))
            }
            Kind::CouchDb => match real_couchdb_url() {
                Some(url) => {
                    let server = servers::identify(&url)?;
                    (server.database_url(&table), format!("agentstore over CouchDB ({})", server.product))
                }
                None => {
                    let server = servers::couchdb()?;
                    (server.database_url(&table), format!("agentstore over CouchDB ({}, in memory)", server.product))
                }
            },
            Kind::PouchLevelDb | Kind::PouchMemory => return start_pouchdb(dir, kind == Kind::PouchMemory),
            Kind::ApacheCouchDb => unreachable!("answered above"),
        };
        let mut environment = Vec::new();
        if options.basic_login {
            let hash = agentstore::couchdb_api::auth::hash_password(ADMIN_LOGIN.1)
                .map_err(|e| format!("hashing the bench's admin password: {e}"))?;
            environment.push(("AGENTSTORE_COUCHDB_USERS".to_owned(), format!("{}:*:{hash}", ADMIN_LOGIN.0)));
        }
        let server = Server::start_with_couchdb_env(BIN, &backend, dir.path(), &environment)?;
        let db_url = server.couchdb.clone().ok_or("the server printed no CouchDB API address")?;
        let (root, data_store) = db_url
            .rsplit_once('/')
            .map(|(root, db)| (root.to_owned(), db.to_owned()))
            .ok_or("no server root in the CouchDB URL")?;
        let pid = server.pid();
        let login = options.basic_login.then(|| (ADMIN_LOGIN.0.to_owned(), ADMIN_LOGIN.1.to_owned()));
        Ok(Running {
            label,
            root,
            login,
            pid,
            data_store: Some(data_store),
            process: Process::Agentstore(server),
            _dir: Some(dir),
        })
    }

    pub fn stop(self) -> Result<(), String> {
        match self.process {
            Process::Agentstore(server) => server.stop(),
            Process::Pouch(process) => {
                drop(process);
                Ok(())
            }
            Process::External => Ok(()),
        }
    }

    /// [`Running::stop`], handing back the target's directory instead of removing it: an
    /// `embedded` target's store ([`EMBEDDED_STORE_FILE`]) for a command that opens the file once
    /// the server has let go of it.
    pub fn stop_keeping_dir(mut self) -> Result<Option<tempfile::TempDir>, String> {
        let dir = self._dir.take();
        self.stop()?;
        Ok(dir)
    }

    pub fn request(&self, http: &reqwest::Client, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let request = http.request(method, format!("{}{path}", self.root));
        match &self.login {
            Some((user, password)) => request.basic_auth(user, Some(password)),
            None => request,
        }
    }
}

/// pouchdb-server from `node_modules`, in `dir` (where it keeps `config.json`, its log and, over
/// LevelDB, its databases), with an admin so that it needs credentials as CouchDB does.
fn start_pouchdb(dir: tempfile::TempDir, in_memory: bool) -> Result<Running, String> {
    let binary = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("node_modules/.bin/pouchdb-server");
    if !binary.exists() {
        return Err(format!("pouchdb-server is not installed at {}: run `npm ci` in the repository", binary.display()));
    }
    std::fs::write(dir.path().join("config.json"), r#"{"admins":{"admin":"password"}}"#)
        .map_err(|e| format!("writing pouchdb-server's config.json: {e}"))?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map_err(|e| format!("no free port: {e}"))?
        .port();
    let log = std::fs::File::create(dir.path().join("server.log")).map_err(|e| format!("pouchdb-server's log: {e}"))?;
    let log_err = log.try_clone().map_err(|e| format!("pouchdb-server's log: {e}"))?;
    let mut command = Command::new(&binary);
    command.args(["--host", "127.0.0.1", "--port", &port.to_string(), "--no-stdout-logs"]);
    if in_memory {
        command.arg("--in-memory");
    }
    // `.bin/pouchdb-server` is a script run by `env node`, which execs node: the child's pid is
    // node's, the process whose memory is read.
    let child = command
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", binary.display()))?;
    let process = PouchProcess { child };
    let root = format!("http://127.0.0.1:{port}");
    let version = wait_for_pouchdb(&root, dir.path())?;
    let mode = if in_memory { "--in-memory" } else { "LevelDB" };
    Ok(Running {
        label: format!("pouchdb-server {version}, {mode}"),
        root,
        login: Some(("admin".into(), "password".into())),
        pid: process.child.id(),
        data_store: None,
        process: Process::Pouch(process),
        _dir: Some(dir),
    })
}

/// The real CouchDB at `BENCH_COUCHDB_URL`, labelled from its `GET /` (`Apache CouchDB 3.4.3`),
/// with the credentials of its URL.
fn real_couchdb() -> Result<Running, String> {
    let url = real_couchdb_url().ok_or_else(|| {
        format!("the target apache-couchdb needs {COUCHDB_URL_VARIABLE}=http://USER:PASSWORD@HOST:PORT")
    })?;
    let parsed = reqwest::Url::parse(&url).map_err(|e| format!("{COUCHDB_URL_VARIABLE}={url:?}: {e}"))?;
    let host = parsed.host_str().ok_or_else(|| format!("{COUCHDB_URL_VARIABLE}={url:?} names no host"))?;
    let port = parsed.port_or_known_default().unwrap_or(80);
    let root = format!("{}://{host}:{port}", parsed.scheme());
    let login = match parsed.username() {
        "" => None,
        user => {
            let decode = |text: &str| percent_encoding::percent_decode_str(text).decode_utf8_lossy().into_owned();
            Some((decode(user), decode(parsed.password().unwrap_or_default())))
        }
    };
    let server = servers::identify(&url)?;
    if !server.product.starts_with("Apache CouchDB") {
        return Err(format!("{COUCHDB_URL_VARIABLE} answers as {}, not Apache CouchDB", server.product));
    }
    Ok(Running { label: server.product, root, login, pid: 0, data_store: None, process: Process::External, _dir: None })
}

/// Polls `GET /` until pouchdb-server answers; its version.
fn wait_for_pouchdb(root: &str, dir: &Path) -> Result<String, String> {
    let host_port = root.trim_start_matches("http://");
    let started = Instant::now();
    loop {
        if let Some(version) = welcome_version(host_port) {
            return Ok(version);
        }
        if started.elapsed() > POUCHDB_STARTUP {
            return Err(format!(
                "pouchdb-server did not answer on {root} within {POUCHDB_STARTUP:?}; its log is {}",
                dir.join("server.log").display()
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The `version` of a CouchDB-protocol server's `GET /` answer, if it gives one.
fn welcome_version(host_port: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(host_port).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(stream, "GET / HTTP/1.1\r\nHost: {host_port}\r\nConnection: close\r\n\r\n").ok()?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).ok()?;
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text.split_once("\r\n\r\n")?;
    if !head.starts_with("HTTP/1.1 200") {
        return None;
    }
    // A chunked answer has its chunk sizes on lines of their own.
    let json = body.lines().find(|line| line.trim_start().starts_with('{'))?;
    let welcome: Value = serde_json::from_str(json).ok()?;
    welcome["version"].as_str().map(str::to_owned)
}

// ---- memory ----

/// A field of `/proc/PID/status`, KiB.
pub fn status_kib(pid: u32, field: &str) -> Result<u64, String> {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':')?.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| format!("{path} has no {field}"))
}

/// Resets the process's peak resident memory (`VmHWM`) to its current one; whether it could.
pub fn reset_peak(pid: u32) -> bool {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok()
}

pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|text| text.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_owned())
}

pub fn mib(kib: u64) -> String {
    format!("{:.0}", kib as f64 / 1024.0)
}
