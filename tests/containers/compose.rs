//! `docker-compose.yml`: valid with every profile, and its embedded service starts from the
//! locally built image (`AGENTSTORE_IMAGE`) on a free loopback port (`AGENTSTORE_PORT`), serves,
//! and is taken down with its volume.
//!
//! The compose command is Docker's plugin (`docker compose`) where it is installed, else the
//! standalone `docker-compose` (Debian's 1.29 on the CI machines).

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::harness::{check, run_with_timeout, Group, TrialFn};

const COMPOSE_TIMEOUT: Duration = Duration::from_secs(120);
const READY_DEADLINE: Duration = Duration::from_secs(60);

pub fn groups() -> Vec<Group> {
    let trials: Vec<(&'static str, TrialFn)> = vec![
        ("config_is_valid_with_every_profile", |image| Box::pin(config_is_valid(image))),
        ("embedded_service_serves_from_the_local_image", |image| Box::pin(embedded_service(image))),
    ];
    vec![Group { name: "compose", role: crate::service::service_image_role(), shared: None, trials }]
}

/// `docker compose` or `docker-compose`, whichever answers `version` (asked once per run).
fn compose_command() -> Result<&'static [&'static str], String> {
    static COMMAND: std::sync::OnceLock<Result<&'static [&'static str], String>> = std::sync::OnceLock::new();
    COMMAND
        .get_or_init(|| {
            const CANDIDATES: [&[&str]; 2] = [&["docker", "compose"], &["docker-compose"]];
            CANDIDATES
                .into_iter()
                .find(|candidate| {
                    let mut command = Command::new(candidate[0]);
                    command.args(&candidate[1..]).arg("version");
                    matches!(run_with_timeout(command, Duration::from_secs(30)), Ok((true, _, _)))
                })
                .ok_or_else(|| {
                    "neither `docker compose` nor `docker-compose` answers (Debian: apt-get install docker-compose)"
                        .to_owned()
                })
        })
        .clone()
}

/// Runs compose with `args` on the repository's file, with `env`; its stdout.
fn compose(args: &[&str], env: &[(&str, &str)]) -> Result<String, String> {
    compose_file(concat!(env!("CARGO_MANIFEST_DIR"), "/docker-compose.yml"), args, env)
}

/// Runs compose with `args` on the compose file `file`, with `env`; its stdout.
pub fn compose_file(file: &str, args: &[&str], env: &[(&str, &str)]) -> Result<String, String> {
    let program = compose_command()?;
    let mut command = Command::new(program[0]);
    command.args(&program[1..]).arg("--file").arg(file).args(args);
    for (name, value) in env {
        command.env(name, value);
    }
    let (success, stdout, stderr) = run_with_timeout(command, COMPOSE_TIMEOUT)?;
    check(success, || format!("{} {}: {stderr}{stdout}", program.join(" "), args.join(" ")))?;
    Ok(stdout)
}

async fn config_is_valid(image: String) -> Result<(), String> {
    let env = [("AGENTSTORE_IMAGE", image.as_str())];
    compose(&["config", "--quiet"], &env)?;
    let all = ["--profile", "couchdb", "--profile", "dynamodb", "--profile", "firestore"];
    compose(&[&all[..], &["config", "--quiet"]].concat(), &env)?;
    let services = compose(&[&all[..], &["config", "--services"]].concat(), &env)?;
    for service in [
        "agentstore",
        "couchdb",
        "agentstore-couchdb",
        "dynamodb-local",
        "agentstore-dynamodb",
        "firestore",
        "agentstore-firestore",
    ] {
        check(services.lines().any(|l| l.trim() == service), || format!("no service {service} in: {services}"))?;
    }
    // Every published port is on the host's loopback: `- HOST_IP:PUBLISHED:TARGET/tcp` (compose
    // 1.x) or `host_ip:` beside `published:` (compose 2.x).
    let config = compose(&[&all[..], &["config"]].concat(), &env)?;
    let short = regex::Regex::new(r"^\s*- (?:([0-9.]+):)?\d+:\d+(?:/(?:tcp|udp))?$").map_err(|e| e.to_string())?;
    let mut mappings = 0;
    let mut beyond_loopback = Vec::new();
    for line in config.lines() {
        if let Some(captures) = short.captures(line) {
            mappings += 1;
            if captures.get(1).map(|ip| ip.as_str()) != Some("127.0.0.1") {
                beyond_loopback.push(line.trim().to_owned());
            }
        }
    }
    let long_published = config.lines().filter(|l| l.trim_start().starts_with("published:")).count();
    let long_loopback = config.lines().filter(|l| l.trim() == "host_ip: 127.0.0.1").count();
    mappings += long_published;
    if long_loopback < long_published {
        beyond_loopback.push(format!("{} of {long_published} long-syntax ports", long_published - long_loopback));
    }
    check(mappings >= 7, || format!("found {mappings} published ports in the config, expected 7:\n{config}"))?;
    check(beyond_loopback.is_empty(), || format!("published beyond loopback: {beyond_loopback:?}"))
}

async fn embedded_service(image: String) -> Result<(), String> {
    let port = free_port()?;
    let project = format!("agentstore-test-{}", std::process::id());
    let env = [("AGENTSTORE_IMAGE", image.as_str()), ("AGENTSTORE_PORT", port.as_str())];
    let result = async {
        compose(&["--project-name", &project, "up", "--detach", "--no-build", "agentstore"], &env)?;
        let url = format!("http://127.0.0.1:{port}");
        let client = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().map_err(|e| e.to_string())?;
        let started = Instant::now();
        loop {
            match client.get(format!("{url}/readyz")).send().await {
                Ok(r) if r.status().is_success() => break,
                _ if started.elapsed() > READY_DEADLINE => {
                    let logs = compose(&["--project-name", &project, "logs", "agentstore"], &env).unwrap_or_default();
                    return Err(format!("the compose service did not answer /readyz at {url}: {logs}"));
                }
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        let document = format!("{url}/v1/users/alice/namespaces/compose/keys/k1");
        let put =
            client.put(&document).json(&json!({"value": "from compose"})).send().await.map_err(|e| e.to_string())?;
        check(put.status().is_success(), || format!("PUT: {}", put.status()))?;
        let read: Value =
            client.get(&document).send().await.map_err(|e| e.to_string())?.json().await.map_err(|e| e.to_string())?;
        check(read["value"] == "from compose", || format!("read back {read}"))
    }
    .await;
    let down = compose(&["--project-name", &project, "down", "--volumes", "--timeout", "30"], &env);
    result?;
    down.map(|_| ())
}

/// A port free on 127.0.0.1 now.
pub fn free_port() -> Result<String, String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(listener.local_addr().map_err(|e| e.to_string())?.port().to_string())
}
