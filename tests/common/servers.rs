//! Real servers for the backend tests: one per test process, started on first use.
//!
//! `AGENTSTORE_TEST_COUCHDB_URL` (e.g. `http://admin:password@127.0.0.1:5984`),
//! `AGENTSTORE_TEST_DYNAMODB_ENDPOINT` (e.g. `http://127.0.0.1:8000`) and
//! `AGENTSTORE_TEST_FIRESTORE_EMULATOR` (e.g. `127.0.0.1:8080`) point the tests at running
//! servers. Without them, `pouchdb-server` (in memory) and `dynalite` from `node_modules`
//! (installed by `npm ci`, see `.ci/run`) and Google's Firestore emulator (a jar from the
//! google-cloud-cli-firestore-emulator package, `FIRESTORE_EMULATOR_JAR` overrides its path) are
//! started on free ports, under a watchdog shell that stops them when the test process exits. A
//! missing server is an error, never a skip.

use std::io::BufReader;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// A CouchDB-protocol server the tests can use.
#[derive(Debug, Clone)]
pub struct CouchServer {
    /// `http://admin:password@127.0.0.1:PORT` (no database).
    pub url: String,
    /// What answered `GET /`: `pouchdb-server 4.2.0` or `Apache CouchDB 3.4.3`.
    pub product: String,
    /// Whether the server keeps numbers exactly (Apache CouchDB does; pouchdb-server stores JS
    /// doubles).
    pub exact_numbers: bool,
}

impl CouchServer {
    /// The backend URL of a database on this server, created if missing.
    pub fn database_url(&self, database: &str) -> String {
        format!("couchdb+{}/{database}?create=true", self.url)
    }
}

static COUCH: OnceLock<Result<CouchServer, String>> = OnceLock::new();
static DYNAMO: OnceLock<Result<DynamoServer, String>> = OnceLock::new();
static FIRESTORE: OnceLock<Result<FirestoreServer, String>> = OnceLock::new();

/// Where Debian's google-cloud-cli-firestore-emulator package puts the emulator.
pub const FIRESTORE_EMULATOR_JAR: &str =
    "/usr/lib/google-cloud-sdk/platform/cloud-firestore-emulator/cloud-firestore-emulator.jar";

/// A Firestore emulator the tests can use.
#[derive(Debug, Clone)]
pub struct FirestoreServer {
    /// `127.0.0.1:PORT`.
    pub host_port: String,
    /// `Cloud Firestore emulator (local process)` or what `AGENTSTORE_TEST_FIRESTORE_EMULATOR` names.
    pub product: String,
}

impl FirestoreServer {
    /// The backend URL of a collection on this emulator (collections need no creating).
    pub fn collection_url(&self, collection: &str) -> String {
        format!("firestore://agentstore-test?emulator={}&collection={collection}", self.host_port)
    }
}

/// The Firestore emulator for this process.
pub fn firestore() -> Result<FirestoreServer, String> {
    FIRESTORE.get_or_init(start_firestore).clone()
}

fn start_firestore() -> Result<FirestoreServer, String> {
    if let Ok(host_port) = std::env::var("AGENTSTORE_TEST_FIRESTORE_EMULATOR") {
        return Ok(FirestoreServer { product: format!("Firestore emulator at {host_port}"), host_port });
    }
    let jar = std::env::var("FIRESTORE_EMULATOR_JAR").unwrap_or_else(|_| FIRESTORE_EMULATOR_JAR.to_owned());
    if !std::path::Path::new(&jar).exists() {
        return Err(format!(
            "the Firestore emulator is not installed at {jar}: install Debian's google-cloud-cli-firestore-emulator \
             package (it is not on npm or PyPI), set FIRESTORE_EMULATOR_JAR to the jar, set \
             AGENTSTORE_TEST_FIRESTORE_EMULATOR to a running emulator's HOST:PORT, or deselect firestore with \
             AGENTSTORE_TEST_BACKENDS"
        ));
    }
    let port = free_port()?;
    let dir = std::env::temp_dir().join(format!("agentstore-firestore-{}-{port}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    spawn_watched(
        &dir,
        &format!(
            "exec java -Duser.language=en -Xmx6g -cp '{jar}' \
             com.google.cloud.datastore.emulator.firestore.CloudFirestore start --host=127.0.0.1 --port={port}"
        ),
    )?;
    let host_port = format!("127.0.0.1:{port}");
    wait_for(&host_port, Duration::from_secs(60), |r| r.starts_with("HTTP/1.1 200"))
        .map_err(|e| format!("the Firestore emulator did not start ({e}); its log is in {}", dir.display()))?;
    Ok(FirestoreServer { host_port, product: "Cloud Firestore emulator (local process)".into() })
}

/// A DynamoDB-protocol server the tests can use.
#[derive(Debug, Clone)]
pub struct DynamoServer {
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    /// `dynalite 4.0.0 (local process)` or what `AGENTSTORE_TEST_DYNAMODB_ENDPOINT` names.
    pub product: String,
}

impl DynamoServer {
    /// The backend URL of a table on this server, created if missing.
    pub fn table_url(&self, table: &str) -> String {
        format!("dynamodb://{table}?region=us-east-1&endpoint={}&create=true", self.endpoint)
    }
}

/// The DynamoDB server for this process. Local servers accept any credentials, so dummy ones are
/// put in the environment when none are set.
pub fn dynamodb() -> Result<DynamoServer, String> {
    DYNAMO.get_or_init(start_dynamodb).clone()
}

fn start_dynamodb() -> Result<DynamoServer, String> {
    for (name, value) in [("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"), ("AWS_REGION", "us-east-1")]
    {
        if std::env::var_os(name).is_none() {
            std::env::set_var(name, value);
        }
    }
    if let Ok(endpoint) = std::env::var("AGENTSTORE_TEST_DYNAMODB_ENDPOINT") {
        return Ok(DynamoServer { product: format!("DynamoDB-compatible server at {endpoint}"), endpoint });
    }
    let binary = repo_root().join("node_modules/.bin/dynalite");
    if !binary.exists() {
        return Err(format!(
            "dynalite is not installed at {}: run `npm ci` in the repository (as .ci/run does), set \
             AGENTSTORE_TEST_DYNAMODB_ENDPOINT to a DynamoDB-compatible server, or deselect dynamodb with \
             AGENTSTORE_TEST_BACKENDS",
            binary.display()
        ));
    }
    let port = free_port()?;
    let dir = std::env::temp_dir().join(format!("agentstore-dynalite-{}-{port}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    spawn_watched(
        &dir,
        &format!(
            "exec '{}' --host 127.0.0.1 --port {port} --createTableMs 0 --deleteTableMs 0 --updateTableMs 0",
            binary.display()
        ),
    )?;
    let host_port = format!("127.0.0.1:{port}");
    wait_for(&host_port, Duration::from_secs(30), |response| response.starts_with("HTTP/1.1"))
        .map_err(|e| format!("dynalite did not start ({e}); its log is in {}", dir.display()))?;
    Ok(DynamoServer { endpoint: format!("http://{host_port}"), product: "dynalite 4.0.0 (local process)".into() })
}

/// The CouchDB server for this process.
pub fn couchdb() -> Result<CouchServer, String> {
    COUCH.get_or_init(start_couchdb).clone()
}

fn start_couchdb() -> Result<CouchServer, String> {
    let url = match std::env::var("AGENTSTORE_TEST_COUCHDB_URL") {
        Ok(url) => url.trim_end_matches('/').to_owned(),
        Err(_) => start_pouchdb_server()?,
    };
    identify(&url)
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn free_port() -> Result<u16, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("no free port: {e}"))?;
    listener.local_addr().map(|a| a.port()).map_err(|e| e.to_string())
}

/// Runs `command` in `dir` under a watchdog that kills it when this process is gone.
fn spawn_watched(dir: &std::path::Path, command: &str) -> Result<(), String> {
    let script = format!(
        "{command} >server.log 2>&1 & child=$!\n\
         trap 'kill $child 2>/dev/null' EXIT INT TERM\n\
         while kill -0 {parent} 2>/dev/null && kill -0 $child 2>/dev/null; do sleep 0.5; done",
        parent = std::process::id()
    );
    Command::new("sh")
        .arg("-c")
        .arg(script)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map(|_| ())
        .map_err(|e| format!("cannot start the watchdog shell: {e}"))
}

fn start_pouchdb_server() -> Result<String, String> {
    let binary = repo_root().join("node_modules/.bin/pouchdb-server");
    if !binary.exists() {
        return Err(format!(
            "pouchdb-server is not installed at {}: run `npm ci` in the repository (as .ci/run does), set \
             AGENTSTORE_TEST_COUCHDB_URL to a CouchDB server, or deselect couchdb with AGENTSTORE_TEST_BACKENDS",
            binary.display()
        ));
    }
    let port = free_port()?;
    // pouchdb-server writes config.json and log.txt into its working directory.
    let dir = std::env::temp_dir().join(format!("agentstore-pouchdb-{}-{port}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    std::fs::write(dir.join("config.json"), r#"{"admins":{"admin":"password"}}"#).map_err(|e| e.to_string())?;
    spawn_watched(&dir, &format!("exec '{}' --in-memory --host 127.0.0.1 --port {port}", binary.display()))?;
    let url = format!("http://admin:password@127.0.0.1:{port}");
    wait_for(&format!("127.0.0.1:{port}"), Duration::from_secs(30), |r| {
        r.starts_with("HTTP/1.1 200") || r.starts_with("HTTP/1.0 200")
    })
    .map_err(|e| format!("pouchdb-server did not start ({e}); its log is in {}", dir.display()))?;
    Ok(url)
}

/// Polls `GET /` until the response satisfies `ready`.
fn wait_for(host_port: &str, deadline: Duration, ready: fn(&str) -> bool) -> Result<(), String> {
    let started = Instant::now();
    loop {
        if let Ok(response) = http_get(host_port, "/") {
            if ready(&response) {
                return Ok(());
            }
        }
        if started.elapsed() > deadline {
            return Err(format!("no answer on {host_port} after {deadline:?}"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A minimal blocking HTTP GET with basic auth admin:password, enough to probe a server.
fn http_get(host_port: &str, path: &str) -> Result<String, String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(host_port).map_err(|e| e.to_string())?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).map_err(|e| e.to_string())?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {host_port}\r\nAuthorization: Basic YWRtaW46cGFzc3dvcmQ=\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut response = Vec::new();
    // The Firestore emulator keeps the connection open despite `Connection: close`: what arrived
    // before the read timeout is the answer.
    if let Err(e) = BufReader::new(stream).read_to_end(&mut response) {
        if response.is_empty() {
            return Err(e.to_string());
        }
    }
    Ok(String::from_utf8_lossy(&response).into_owned())
}

/// Asks the server what it is.
/// The CouchDB-protocol server at `url` (`http://USER:PASSWORD@HOST:PORT`), named from its `GET /`.
pub fn identify(url: &str) -> Result<CouchServer, String> {
    let host_port = url.rsplit('@').next().unwrap_or(url).trim_start_matches("http://").to_owned();
    let response = http_get(&host_port, "/").map_err(|e| format!("CouchDB server {host_port} unreachable: {e}"))?;
    let body = response.split("\r\n\r\n").nth(1).unwrap_or("");
    let body = body.lines().find(|l| l.trim_start().starts_with('{')).unwrap_or(body);
    let welcome: serde_json::Value =
        serde_json::from_str(body).map_err(|e| format!("{host_port} is not a CouchDB server ({e}): {body}"))?;
    let version = welcome["version"].as_str().unwrap_or("?");
    let (product, exact_numbers) = if welcome.get("express-pouchdb").is_some() {
        (format!("pouchdb-server {version}"), false)
    } else {
        (format!("Apache CouchDB {version}"), true)
    };
    Ok(CouchServer { url: url.to_owned(), product, exact_numbers })
}
