//! Whether a Docker engine is reachable, for the testcontainers tests: they run when one is and
//! are reported as ignored, with the reason printed, when none is.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long `docker info` may take before the engine counts as unreachable.
const DOCKER_PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// Describes the reachable Docker engine, or says why there is none.
pub fn engine() -> Result<String, String> {
    let endpoint = match std::env::var("DOCKER_HOST") {
        Ok(host) if !host.trim().is_empty() => format!("DOCKER_HOST={host}"),
        _ if Path::new("/var/run/docker.sock").exists() => "/var/run/docker.sock".to_owned(),
        _ => return Err("DOCKER_HOST is not set and /var/run/docker.sock does not exist".into()),
    };
    let mut command = Command::new("docker");
    command.args(["info", "--format", "{{.ServerVersion}}"]);
    let (success, stdout, stderr) = run_with_timeout(command, DOCKER_PROBE_TIMEOUT)
        .map_err(|e| format!("{endpoint}, but `docker info` could not be run: {e}"))?;
    let version = stdout.trim();
    if success && !version.is_empty() {
        Ok(format!("Docker engine {version} via {endpoint}"))
    } else {
        let detail = stderr.lines().chain(stdout.lines()).find(|l| !l.trim().is_empty()).unwrap_or("no output");
        Err(format!("{endpoint}, but `docker info` failed: {}", detail.trim()))
    }
}

/// Runs `command`, killing it after `timeout`; its success, stdout and stderr.
fn run_with_timeout(mut command: Command, timeout: Duration) -> Result<(bool, String, String), String> {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let (done_tx, done_rx) = mpsc::channel();
    for (stream, is_stdout) in [
        (child.stdout.take().map(|s| Box::new(s) as Box<dyn Read + Send>), true),
        (child.stderr.take().map(|s| Box::new(s) as Box<dyn Read + Send>), false),
    ] {
        let done_tx = done_tx.clone();
        std::thread::spawn(move || {
            let mut text = String::new();
            if let Some(mut stream) = stream {
                let _ = stream.read_to_string(&mut text);
            }
            let _ = done_tx.send((is_stdout, text));
        });
    }
    drop(done_tx);
    let deadline = Instant::now() + timeout;
    let (mut stdout, mut stderr) = (String::new(), String::new());
    for _ in 0..2 {
        let left = deadline.saturating_duration_since(Instant::now());
        match done_rx.recv_timeout(left) {
            Ok((true, text)) => stdout = text,
            Ok((false, text)) => stderr = text,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("no answer within {timeout:?}"));
            }
        }
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    Ok((status.success(), stdout, stderr))
}
