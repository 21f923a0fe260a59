//! A deployment as production runs one: N `agentstore serve` processes over one backend, each with
//! its own REST and CouchDB listeners and its own view index directory, behind a real HAProxy
//! (round-robin, no stickiness, health checks `GET /readyz` on each instance's REST port). Used by
//! the balancer suite (`tests/suites/balancer/`) and the deployment benchmark (through
//! `#[path]`), so it needs nothing but std: processes, TCP probes and HAProxy's stats socket.
//!
//! Every process it starts is killed when the [`Deployment`] is dropped, and by a watchdog shell
//! when the test process dies without dropping it (a panic that aborts, a SIGKILL).
//!
//! Ports: each instance binds port 0 and the address it got is read from its log, so two
//! processes can never race for one; HAProxy's port is drawn free just before it starts.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// HAProxy, as Debian's `haproxy` package installs it; `AGENTSTORE_TEST_HAPROXY` overrides.
pub const HAPROXY: &str = "/usr/sbin/haproxy";
/// How long an instance may take from its start to a 200 from `/readyz`.
const INSTANCE_START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long HAProxy may take to report every server UP after its first checks.
const BALANCER_START_TIMEOUT: Duration = Duration::from_secs(30);
/// The name of HAProxy's backend section in the written haproxy.cfg.
const BACKEND_SECTION: &str = "agentstore";
/// Log lines `serve` prints when its listeners are bound (src/cli.rs).
const REST_LISTENING: &str = "agentstore: serving http://";
const COUCH_LISTENING: &str = "agentstore: serving the CouchDB API on http://";

/// What to run: which binary over which backend, how many instances, where their files go.
pub struct DeploymentSpec {
    /// The agentstore binary to run (`serve`).
    pub binary: PathBuf,
    /// E.g. `dynamodb://TABLE?endpoint=http://127.0.0.1:P&create=true`.
    pub backend_url: String,
    /// Extra environment (`AWS_ACCESS_KEY_ID=test`, ...).
    pub env: Vec<(String, String)>,
    /// Extra settings appended to each instance's config file (after its own
    /// `couchdb_view_index_dir`, so `[[table]]`s are fine here).
    pub config_toml: String,
    /// How many instances the balancer starts with.
    pub instances: usize,
    /// Logs, configs, haproxy.cfg, each instance's view index directory.
    pub work_dir: PathBuf,
}

/// One running `serve` process.
struct Instance {
    child: Child,
    /// `127.0.0.1:PORT` of its REST API (`/readyz`).
    rest: String,
    /// `127.0.0.1:PORT` of its CouchDB API.
    couch: String,
    log: PathBuf,
}

/// The running deployment; everything it started is killed when it is dropped.
pub struct Deployment {
    spec: DeploymentSpec,
    /// The balancer's servers, by index (a killed one stays, dead, at its index).
    instances: Vec<Instance>,
    /// Instances started later with [`Deployment::start_instance`] (not in the balancer).
    extra: Vec<Instance>,
    haproxy: Option<Child>,
    balancer_port: u16,
    started: usize,
}

impl Deployment {
    /// Starts `spec.instances` instances, waits for each one's `/readyz`, then HAProxy in front of
    /// them; returns when HAProxy's own health checks report every server UP.
    pub fn start(spec: DeploymentSpec) -> Result<Deployment, String> {
        std::fs::create_dir_all(&spec.work_dir).map_err(|e| format!("{}: {e}", spec.work_dir.display()))?;
        let mut deployment =
            Deployment { spec, instances: Vec::new(), extra: Vec::new(), haproxy: None, balancer_port: 0, started: 0 };
        deployment.start_watchdog()?;
        for _ in 0..deployment.spec.instances {
            let instance = deployment.spawn_instance()?;
            deployment.instances.push(instance);
        }
        for index in 0..deployment.instances.len() {
            let instance = &mut deployment.instances[index];
            wait_until_ready(instance)?;
        }
        deployment.start_haproxy()?;
        deployment.wait_until_all_up()?;
        Ok(deployment)
    }

    /// The balancer's CouchDB face, `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.balancer_port)
    }

    /// Each balanced instance's CouchDB face, directly (`http://127.0.0.1:PORT`), by index.
    pub fn instance_urls(&self) -> Vec<String> {
        self.instances.iter().map(|instance| format!("http://{}", instance.couch)).collect()
    }

    /// Each balanced instance's log file, by index.
    pub fn instance_logs(&self) -> Vec<PathBuf> {
        self.instances.iter().map(|instance| instance.log.clone()).collect()
    }

    /// HAProxy's log (one line per request, with its status and termination state).
    pub fn balancer_log(&self) -> PathBuf {
        self.spec.work_dir.join("haproxy.log")
    }

    /// SIGKILL to instance `index`: no grace, in-flight requests are cut.
    pub fn kill(&mut self, index: usize) -> Result<(), String> {
        let instance = self.instances.get_mut(index).ok_or_else(|| format!("no instance {index}"))?;
        instance.child.kill().map_err(|e| format!("kill instance {index}: {e}"))?;
        instance.child.wait().map(|_| ()).map_err(|e| format!("reap instance {index}: {e}"))
    }

    /// One more instance over the same backend (not in the balancer): its CouchDB face URL,
    /// returned once its `/readyz` answers 200.
    pub fn start_instance(&mut self) -> Result<String, String> {
        let mut instance = self.spawn_instance()?;
        wait_until_ready(&mut instance)?;
        let url = format!("http://{}", instance.couch);
        self.extra.push(instance);
        Ok(url)
    }

    /// Starts one `serve` process with its own config file and view index directory; its
    /// addresses are read from its log by [`wait_until_ready`].
    fn spawn_instance(&mut self) -> Result<Instance, String> {
        let number = self.started;
        self.started += 1;
        let dir = self.spec.work_dir.join(format!("instance-{number}"));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let config = dir.join("agentstore.toml");
        // The view index directory first: it is a top-level key, and after a `[[table]]` header it
        // would be one of that table's.
        let views = dir.join("views");
        let text = format!("couchdb_view_index_dir = {:?}\n{}\n", views.display().to_string(), self.spec.config_toml);
        std::fs::write(&config, text).map_err(|e| format!("{}: {e}", config.display()))?;
        let log = dir.join("server.log");
        let log_file = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let mut command = Command::new(&self.spec.binary);
        // None of the caller's settings: the instance runs on what the spec says.
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("AGENTSTORE_") {
                command.env_remove(&name);
            }
        }
        command.env_remove("RUST_LOG");
        command.envs(self.spec.env.iter().map(|(name, value)| (name, value)));
        let child = command
            .args(["--backend", &self.spec.backend_url, "--config"])
            .arg(&config)
            .args(["serve", "--listen", "127.0.0.1:0", "--couchdb-listen", "127.0.0.1:0"])
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.spec.binary.display()))?;
        self.record_pid(child.id())?;
        Ok(Instance { child, rest: String::new(), couch: String::new(), log })
    }

    /// Writes haproxy.cfg for the balanced instances and starts HAProxy in the foreground.
    fn start_haproxy(&mut self) -> Result<(), String> {
        self.balancer_port = free_port()?;
        let config = self.spec.work_dir.join("haproxy.cfg");
        std::fs::write(&config, self.haproxy_config()).map_err(|e| format!("{}: {e}", config.display()))?;
        let binary = haproxy_binary();
        let check = Command::new(&binary)
            .arg("-c")
            .arg("-f")
            .arg(&config)
            .output()
            .map_err(|e| format!("cannot run {}: {e} (install Debian's haproxy package)", binary.display()))?;
        if !check.status.success() {
            return Err(format!(
                "haproxy rejects {}: {}",
                config.display(),
                String::from_utf8_lossy(&check.stderr).trim()
            ));
        }
        let log = self.balancer_log();
        let log_file = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let child = Command::new(&binary)
            .arg("-db")
            .arg("-f")
            .arg(&config)
            .current_dir(&self.spec.work_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", binary.display()))?;
        self.record_pid(child.id())?;
        self.haproxy = Some(child);
        Ok(())
    }

    /// The balancer's configuration: the shape deploy/haproxy/haproxy.cfg ships, with this
    /// deployment's ports, a stats socket to read server states from, and requests logged to
    /// stderr (haproxy.log).
    fn haproxy_config(&self) -> String {
        let servers: String = self
            .instances
            .iter()
            .enumerate()
            .map(|(index, instance)| {
                let rest_port = instance.rest.rsplit(':').next().unwrap_or_default();
                format!("    server instance{index} {} check port {rest_port}\n", instance.couch)
            })
            .collect();
        format!(
            "global\n\
             \x20   log stderr format raw local0\n\
             \x20   stats socket {socket} mode 600 level admin\n\
             \x20   maxconn 4096\n\
             \n\
             defaults\n\
             \x20   mode http\n\
             \x20   log global\n\
             \x20   option httplog\n\
             \x20   option redispatch\n\
             \x20   retries 2\n\
             \x20   timeout connect 2s\n\
             \x20   timeout client 5m\n\
             \x20   timeout server 5m\n\
             \x20   # continuous _changes feeds and live replications stay open for as long as they run\n\
             \x20   timeout tunnel 1h\n\
             \x20   # CouchDB clients read every answer as JSON: PouchDB's HTTP adapter dies on an HTML error page\n\
             {errors}\
             \n\
             frontend couchdb\n\
             \x20   bind 127.0.0.1:{port}\n\
             \x20   default_backend {BACKEND_SECTION}\n\
             \n\
             backend {BACKEND_SECTION}\n\
             \x20   balance roundrobin\n\
             \x20   option httpchk GET /readyz\n\
             \x20   http-check expect status 200\n\
             \x20   default-server inter 1s fall 2 rise 1\n\
             \x20   # which instance answered, for the logs and the tests\n\
             \x20   http-response set-header {SERVED_BY} %s\n\
             {servers}",
            errors = balancer_errors(),
            socket = self.stats_socket().display(),
            port = self.balancer_port,
        )
    }

    fn stats_socket(&self) -> PathBuf {
        self.spec.work_dir.join("haproxy.sock")
    }

    /// Polls HAProxy's stats until every server of the backend is UP after a passing check.
    fn wait_until_all_up(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + BALANCER_START_TIMEOUT;
        loop {
            if let Some(child) = self.haproxy.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    return Err(format!("haproxy exited ({status}): {}", tail(&self.balancer_log(), 20)));
                }
            }
            let last = match self.server_states() {
                Ok(states) if states.len() == self.instances.len() && states.iter().all(|(_, up)| *up) => return Ok(()),
                Ok(states) => format!("{states:?}"),
                Err(e) => e,
            };
            if Instant::now() > deadline {
                return Err(format!(
                    "haproxy did not report every server UP within {BALANCER_START_TIMEOUT:?}: {last}"
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Each balanced server's name and whether HAProxy has it UP after a passing layer-7 check.
    pub fn server_states(&self) -> Result<Vec<(String, bool)>, String> {
        Ok(self
            .server_stats()?
            .into_iter()
            .map(|server| {
                let up = server.get("status") == Some("UP") && server.get("check_status") == Some("L7OK");
                (server.name, up)
            })
            .collect())
    }

    /// How many requests (HAProxy's `scur`: streams, a continuous feed among them) each balanced
    /// instance has in progress, by index.
    pub fn sessions(&self) -> Result<Vec<u64>, String> {
        let stats = self.server_stats()?;
        Ok((0..self.instances.len())
            .map(|index| {
                let name = format!("instance{index}");
                let server = stats.iter().find(|server| server.name == name);
                server.and_then(|server| server.get("scur")).and_then(|n| n.parse().ok()).unwrap_or(0)
            })
            .collect())
    }

    /// HAProxy's `show stat` rows of the balanced servers.
    fn server_stats(&self) -> Result<Vec<ServerStat>, String> {
        let socket = self.stats_socket();
        let mut stream = UnixStream::connect(&socket).map_err(|e| format!("{}: {e}", socket.display()))?;
        stream.set_read_timeout(Some(Duration::from_secs(2))).map_err(|e| e.to_string())?;
        stream.write_all(b"show stat\n").map_err(|e| format!("haproxy stats socket: {e}"))?;
        let mut csv = String::new();
        stream.read_to_string(&mut csv).map_err(|e| format!("haproxy stats socket: {e}"))?;
        let mut lines = csv.lines();
        let header: Vec<String> =
            lines.next().unwrap_or_default().trim_start_matches("# ").split(',').map(str::to_owned).collect();
        let column = |name: &str| header.iter().position(|h| h == name).ok_or(format!("no {name} column: {csv}"));
        let (proxy, server) = (column("pxname")?, column("svname")?);
        Ok(lines
            .map(|line| line.split(',').map(str::to_owned).collect::<Vec<_>>())
            .filter(|fields| fields.get(proxy).is_some_and(|name| name == BACKEND_SECTION))
            .filter_map(|fields| {
                let name = fields.get(server).filter(|name| *name != "BACKEND")?.clone();
                Some(ServerStat { name, header: header.clone(), fields })
            })
            .collect())
    }

    /// A shell that SIGKILLs every process listed in `pids` once this test process is gone.
    fn start_watchdog(&self) -> Result<(), String> {
        let pids = self.spec.work_dir.join("pids");
        std::fs::write(&pids, "").map_err(|e| format!("{}: {e}", pids.display()))?;
        let script = format!(
            "while kill -0 {parent} 2>/dev/null; do sleep 0.5; done; kill -9 $(cat '{pids}') 2>/dev/null",
            parent = std::process::id(),
            pids = pids.display()
        );
        Command::new("sh")
            .arg("-c")
            .arg(script)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map(|_| ())
            .map_err(|e| format!("cannot start the watchdog shell: {e}"))
    }

    fn record_pid(&self, pid: u32) -> Result<(), String> {
        let pids = self.spec.work_dir.join("pids");
        let mut file =
            std::fs::OpenOptions::new().append(true).open(&pids).map_err(|e| format!("{}: {e}", pids.display()))?;
        writeln!(file, "{pid}").map_err(|e| format!("{}: {e}", pids.display()))
    }
}

impl Drop for Deployment {
    fn drop(&mut self) {
        let children = self.instances.iter_mut().chain(self.extra.iter_mut()).map(|instance| &mut instance.child);
        for child in children.chain(self.haproxy.as_mut()) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The response header naming the instance that answered (`instance0`, …; see
/// [`instance_index`]).
pub const SERVED_BY: &str = "X-Served-By";

/// The index of the instance a [`SERVED_BY`] header names.
pub fn instance_index(served_by: &str) -> Option<usize> {
    served_by.strip_prefix("instance")?.parse().ok()
}

/// The `reason` of every error HAProxy answers itself, so a test can tell them from an instance's.
pub const BALANCER_ERROR_REASON: &str = "the load balancer got no answer from an instance";

/// `http-error` lines answering HAProxy's own 502, 503 and 504 in CouchDB's JSON error shape.
fn balancer_errors() -> String {
    [(502, "bad_gateway"), (503, "service_unavailable"), (504, "gateway_timeout")]
        .iter()
        .map(|(status, error)| {
            format!(
                "    http-error status {status} content-type application/json \
                 string '{{\"error\":\"{error}\",\"reason\":\"{BALANCER_ERROR_REASON}\"}}'\n"
            )
        })
        .collect()
}

/// One server's row of HAProxy's `show stat`.
struct ServerStat {
    name: String,
    header: Vec<String>,
    fields: Vec<String>,
}

impl ServerStat {
    fn get(&self, column: &str) -> Option<&str> {
        let index = self.header.iter().position(|h| h == column)?;
        self.fields.get(index).map(String::as_str)
    }
}

/// HAProxy's path: `AGENTSTORE_TEST_HAPROXY`, else [`HAPROXY`].
pub fn haproxy_binary() -> PathBuf {
    std::env::var_os("AGENTSTORE_TEST_HAPROXY").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(HAPROXY))
}

/// Reads the instance's addresses from its log, then polls `GET /readyz` until 200; fails with
/// the log if the process exits or does not get ready in time.
fn wait_until_ready(instance: &mut Instance) -> Result<(), String> {
    let deadline = Instant::now() + INSTANCE_START_TIMEOUT;
    loop {
        if instance.rest.is_empty() || instance.couch.is_empty() {
            let text = std::fs::read_to_string(&instance.log).unwrap_or_default();
            instance.rest = address_after(&text, REST_LISTENING).unwrap_or_default();
            instance.couch = address_after(&text, COUCH_LISTENING).unwrap_or_default();
        }
        if !instance.rest.is_empty()
            && !instance.couch.is_empty()
            && http_status(&instance.rest, "/readyz") == Some(200)
        {
            return Ok(());
        }
        if let Ok(Some(status)) = instance.child.try_wait() {
            return Err(format!("an instance exited ({status}); its log:\n{}", tail(&instance.log, 20)));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "an instance did not answer GET /readyz with 200 within {INSTANCE_START_TIMEOUT:?}; its log:\n{}",
                tail(&instance.log, 20)
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `HOST:PORT` after `marker` on a line of `log`.
fn address_after(log: &str, marker: &str) -> Option<String> {
    let rest = log.lines().find_map(|line| line.split_once(marker).map(|(_, rest)| rest))?;
    let address = rest.split(['/', ' ']).next()?;
    (!address.is_empty()).then(|| address.to_owned())
}

/// The status of a plain `GET path`, if anything answered.
fn http_status(host_port: &str, path: &str) -> Option<u16> {
    let mut stream = TcpStream::connect(host_port).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: {host_port}\r\nConnection: close\r\n\r\n").ok()?;
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).ok()?;
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

fn free_port() -> Result<u16, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("no free port: {e}"))?;
    listener.local_addr().map(|a| a.port()).map_err(|e| e.to_string())
}

/// The last `lines` lines of a log file.
fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
