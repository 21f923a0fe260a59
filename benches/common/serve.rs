//! A spawned `agentstore serve` process for the HTTP benches (`serve_load`, `hot_key`,
//! `couchdb_api_bench`, `databases_bench`).

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// How long the server may take to print its address.
const STARTUP_DEADLINE: Duration = Duration::from_secs(30);
/// How long the server may take to exit after SIGTERM before it is killed.
const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(10);

/// The spawned `agentstore serve`; killed (SIGKILL) on drop if [`Server::stop`] did not run.
pub struct Server {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// The CouchDB API's database URL, `http://127.0.0.1:PORT/DB`, when started with
    /// [`Server::start_with_couchdb`].
    pub couchdb: Option<String>,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
}

impl Server {
    /// Starts `binary serve` on a free loopback port over `backend` (a backend URL), with no
    /// `AGENTSTORE_*` settings from the environment, and waits until it prints its address.
    pub fn start(binary: &str, backend: &str, workdir: &Path) -> Result<Server, String> {
        Self::spawn(binary, backend, workdir, false, &[])
    }

    /// As [`Server::start`], also answering CouchDB's API on another free loopback port
    /// (`--couchdb-listen 127.0.0.1:0`); waits until both addresses are printed.
    pub fn start_with_couchdb(binary: &str, backend: &str, workdir: &Path) -> Result<Server, String> {
        Self::spawn(binary, backend, workdir, true, &[])
    }

    /// As [`Server::start_with_couchdb`], with the `AGENTSTORE_*` settings of `environment`
    /// (`AGENTSTORE_COUCHDB_USERS`, say) set for the server.
    pub fn start_with_couchdb_env(
        binary: &str,
        backend: &str,
        workdir: &Path,
        environment: &[(String, String)],
    ) -> Result<Server, String> {
        Self::spawn(binary, backend, workdir, true, environment)
    }

    fn spawn(
        binary: &str,
        backend: &str,
        workdir: &Path,
        couchdb: bool,
        environment: &[(String, String)],
    ) -> Result<Server, String> {
        let mut cmd = Command::new(binary);
        cmd.arg("serve").arg("--listen").arg("127.0.0.1:0");
        if couchdb {
            cmd.arg("--couchdb-listen").arg("127.0.0.1:0");
        }
        cmd.arg("--backend")
            .arg(backend)
            .current_dir(workdir)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("AGENTSTORE_") {
                cmd.env_remove(&name);
            }
        }
        cmd.envs(environment.iter().map(|(name, value)| (name, value)));
        let mut child = cmd.spawn().map_err(|e| format!("cannot start {binary}: {e}"))?;
        let stderr = child.stderr.take().expect("stderr is piped");
        let stderr_tail = Arc::new(Mutex::new(VecDeque::new()));
        let (ready_tx, ready_rx) = mpsc::channel::<String>();
        let (couchdb_tx, couchdb_rx) = mpsc::channel::<String>();
        let tail = Arc::clone(&stderr_tail);
        // Drains stderr for the server's whole life (a full pipe would block its logging), keeping
        // the last lines for diagnosis and handing over the addresses once they are printed.
        std::thread::spawn(move || {
            let mut ready_tx = Some(ready_tx);
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(tx) = &ready_tx {
                    if let Some(rest) = line.strip_prefix("agentstore: serving http://") {
                        if let Some((addr, _)) = rest.split_once(" on ") {
                            let _ = tx.send(addr.to_owned());
                            ready_tx = None;
                        }
                    }
                }
                if let Some(url) = line.strip_prefix("agentstore: serving the CouchDB API on ") {
                    let _ = couchdb_tx.send(url.trim().to_owned());
                }
                let mut tail = tail.lock().unwrap();
                if tail.len() == 20 {
                    tail.pop_front();
                }
                tail.push_back(line);
            }
        });
        let mut server = Server { child, base: String::new(), couchdb: None, stderr_tail };
        let started = Instant::now();
        let addresses = ready_rx.recv_timeout(STARTUP_DEADLINE).and_then(|addr| {
            let couchdb = match couchdb {
                true => Some(couchdb_rx.recv_timeout(STARTUP_DEADLINE.saturating_sub(started.elapsed()))?),
                false => None,
            };
            Ok((addr, couchdb))
        });
        match addresses {
            Ok((addr, couchdb)) => {
                server.base = format!("http://{addr}");
                server.couchdb = couchdb;
                Ok(server)
            }
            Err(_) => {
                // Let the reader thread catch up on what the server printed before it died.
                std::thread::sleep(Duration::from_millis(200));
                let status = server.child.try_wait().ok().flatten();
                Err(format!(
                    "the server did not print its address(es) within {STARTUP_DEADLINE:?} (exit status: {status:?}); \
                     its stderr:\n{}",
                    server.tail()
                ))
            }
        }
    }

    /// The server's process id, for reading its memory from `/proc`.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The last lines the server wrote to stderr (at most 20), indented, for a failure's report.
    pub fn tail(&self) -> String {
        self.stderr_tail.lock().unwrap().iter().map(|l| format!("  {l}\n")).collect()
    }

    /// SIGTERM, then waits for the exit; SIGKILL past the deadline.
    pub fn stop(mut self) -> Result<(), String> {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status();
        if !matches!(sent, Ok(s) if s.success()) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            return Err(format!("`kill -TERM {pid}` failed ({sent:?}); killed the server"));
        }
        let deadline = Instant::now() + SHUTDOWN_DEADLINE;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) if status.success() => return Ok(()),
                Ok(Some(status)) => {
                    return Err(format!("the server exited with {status} after SIGTERM; its stderr:\n{}", self.tail()))
                }
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                Ok(None) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return Err(format!("the server did not exit within {SHUTDOWN_DEADLINE:?} of SIGTERM; killed it"));
                }
                Err(e) => return Err(format!("waiting for the server: {e}")),
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
