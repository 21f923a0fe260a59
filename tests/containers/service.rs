//! The service's own image (`AGENTSTORE_TEST_IMAGE`, default `agentstore-test/agentstore:local`,
//! which `scripts/containers service` builds from ./Dockerfile with the prebuilt binary): what a
//! team running it with Docker relies on.
//!
//! Each trial starts its own containers with the docker CLI (the way a user runs the image),
//! publishing the service's port on 127.0.0.1 only, and removes them, and their volumes, after.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::harness::{check, docker, Group, ImageRole, Origin, TrialFn};

/// The port the service listens on in its image.
const PORT: &str = "8080";
/// How long a docker CLI call may take.
const DOCKER_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the service may take from its start to a 200 from `/readyz`.
const READY_DEADLINE: Duration = Duration::from_secs(60);
/// The grace period `docker stop` gives before SIGKILL; compose's file gives 35 s.
const GRACE_SECONDS: u64 = 30;

pub fn groups() -> Vec<Group> {
    let trials: Vec<(&'static str, TrialFn)> = vec![
        ("runs_as_a_non_root_user", |image| Box::pin(runs_as_non_root(image))),
        ("healthz_and_readyz_answer", |image| Box::pin(health_and_readiness(image))),
        ("data_survives_a_restart_on_its_volume", |image| Box::pin(data_survives_restart(image))),
        ("sigterm_stops_it_gracefully_within_the_grace_period", |image| Box::pin(sigterm_is_graceful(image))),
        ("refuses_to_serve_unauthenticated_unless_configured", |image| Box::pin(refuses_unauthenticated(image))),
        ("trusts_the_system_ca_certificates", |image| Box::pin(has_ca_certificates(image))),
        ("dockerfile_prebuilt_stage_builds_without_a_binary_on_the_legacy_builder", |_| {
            Box::pin(prebuilt_stage_is_harmless())
        }),
    ];
    vec![Group { name: "service_image", role: service_image_role(), shared: None, trials }]
}

/// The service's image, as the recipe and compose groups use it too.
pub fn service_image_role() -> ImageRole {
    ImageRole {
        setting: "AGENTSTORE_TEST_IMAGE",
        default: "agentstore-test/agentstore:local",
        origin: Origin::Local("service"),
    }
}

// ---------------------------------------------------------------------------------------------
// Containers by the docker CLI.
// ---------------------------------------------------------------------------------------------

/// A container started by a trial, removed (with its anonymous volumes) when dropped.
struct Container {
    id: String,
}

impl Container {
    /// `docker run -d` with the service's port published on 127.0.0.1, `args` before the image.
    fn run(image: &str, args: &[&str]) -> Result<Container, String> {
        let publish = format!("127.0.0.1::{PORT}");
        let mut all = vec!["run", "-d", "-p", publish.as_str()];
        all.extend_from_slice(args);
        all.push(image);
        let id = docker(&all, DOCKER_TIMEOUT)?.trim().to_owned();
        check(!id.is_empty(), || format!("docker run {image} printed no container id"))?;
        Ok(Container { id })
    }

    /// `http://127.0.0.1:PORT`, where the service's port is published now (a restart may move it).
    fn url(&self) -> Result<String, String> {
        let mapping = docker(&["port", &self.id, &format!("{PORT}/tcp")], DOCKER_TIMEOUT)?;
        let address = mapping
            .lines()
            .map(str::trim)
            .find(|line| line.starts_with("127.0.0.1:"))
            .ok_or_else(|| format!("the service's port is not published on 127.0.0.1: {mapping:?}"))?;
        Ok(format!("http://{address}"))
    }

    /// Waits until `/readyz` answers 200; the base URL.
    async fn ready(&self) -> Result<String, String> {
        let started = Instant::now();
        let client = http()?;
        let mut last = String::from("no answer yet");
        while started.elapsed() < READY_DEADLINE {
            if let Ok(url) = self.url() {
                match client.get(format!("{url}/readyz")).send().await {
                    Ok(response) if response.status().is_success() => return Ok(url),
                    Ok(response) => last = format!("HTTP {}", response.status()),
                    Err(e) => last = e.to_string(),
                }
            }
            if self.state()?.starts_with("exited") {
                return Err(format!("the container exited: {}", self.logs()));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(format!("/readyz did not answer 200 within {READY_DEADLINE:?}: {last}; logs: {}", self.logs()))
    }

    /// `running`, or `exited CODE`.
    fn state(&self) -> Result<String, String> {
        Ok(docker(&["inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", &self.id], DOCKER_TIMEOUT)?
            .trim()
            .to_owned())
    }

    /// The container's output so far (the service logs to stderr).
    fn logs(&self) -> String {
        let mut command = std::process::Command::new("docker");
        command.args(["logs", &self.id]);
        match crate::harness::run_with_timeout(command, DOCKER_TIMEOUT) {
            Ok((_, stdout, stderr)) => format!("{stdout}{stderr}"),
            Err(e) => format!("(docker logs failed: {e})"),
        }
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = docker(&["rm", "-f", "-v", &self.id], DOCKER_TIMEOUT);
    }
}

/// A named volume, removed when dropped.
struct Volume(String);

impl Volume {
    fn create() -> Result<Volume, String> {
        static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("agentstore-test-{}-{n}", std::process::id());
        docker(&["volume", "create", &name], DOCKER_TIMEOUT)?;
        Ok(Volume(name))
    }
}

impl Drop for Volume {
    fn drop(&mut self) {
        let _ = docker(&["volume", "rm", "-f", &self.0], DOCKER_TIMEOUT);
    }
}

fn http() -> Result<reqwest::Client, String> {
    reqwest::Client::builder().timeout(Duration::from_secs(10)).build().map_err(|e| e.to_string())
}

const UNAUTHENTICATED: &[&str] = &["-e", "AGENTSTORE_ALLOW_UNAUTHENTICATED=true"];

/// PUTs `value` as alice's `notes/k1` and checks the answer.
async fn put_value(url: &str, value: &Value, token: Option<&str>) -> Result<(), String> {
    let mut request =
        http()?.put(format!("{url}/v1/users/alice/namespaces/notes/keys/k1")).json(&json!({"value": value}));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.map_err(|e| format!("PUT: {e}"))?;
    let status = response.status();
    check(status.is_success(), || format!("PUT answered {status}"))
}

/// GETs alice's `notes/k1`: its status and, when found, its value.
async fn get_value(url: &str, token: Option<&str>) -> Result<(u16, Option<Value>), String> {
    let mut request = http()?.get(format!("{url}/v1/users/alice/namespaces/notes/keys/k1"));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.map_err(|e| format!("GET: {e}"))?;
    let status = response.status().as_u16();
    if status != 200 {
        return Ok((status, None));
    }
    let body: Value = response.json().await.map_err(|e| format!("GET body: {e}"))?;
    Ok((status, body.get("value").cloned()))
}

// ---------------------------------------------------------------------------------------------
// The trials.
// ---------------------------------------------------------------------------------------------

/// The image names a non-root user, and the server (PID 1) runs as it.
async fn runs_as_non_root(image: String) -> Result<(), String> {
    let user = docker(&["image", "inspect", "--format", "{{.Config.User}}", &image], DOCKER_TIMEOUT)?;
    check(!matches!(user.trim(), "" | "root" | "0"), || format!("the image's user is {:?}", user.trim()))?;
    let container = Container::run(&image, UNAUTHENTICATED)?;
    container.ready().await?;
    let status = docker(&["exec", &container.id, "cat", "/proc/1/status"], DOCKER_TIMEOUT)?;
    let uid = status.lines().find_map(|l| l.strip_prefix("Uid:")).map(|l| l.split_whitespace().collect::<Vec<_>>());
    let uid = uid.ok_or_else(|| format!("no Uid line in /proc/1/status: {status}"))?;
    check(uid.iter().all(|id| *id != "0"), || format!("the server runs with uids {uid:?}"))
}

/// `/healthz` and `/readyz` answer 200 on the published port.
async fn health_and_readiness(image: String) -> Result<(), String> {
    let container = Container::run(&image, UNAUTHENTICATED)?;
    let url = container.ready().await?;
    let client = http()?;
    for path in ["/healthz", "/readyz"] {
        let response = client.get(format!("{url}{path}")).send().await.map_err(|e| format!("GET {path}: {e}"))?;
        let status = response.status();
        let body: Value = response.json().await.map_err(|e| format!("GET {path} body: {e}"))?;
        check(status.as_u16() == 200, || format!("GET {path}: {status} {body}"))?;
    }
    Ok(())
}

/// A document written before `docker restart` reads back after it, and in a new container on the
/// same volume (what an upgrade does).
async fn data_survives_restart(image: String) -> Result<(), String> {
    let volume = Volume::create()?;
    let mount = format!("{}:/var/lib/agentstore", volume.0);
    let mut args = vec!["-v", mount.as_str()];
    args.extend_from_slice(UNAUTHENTICATED);
    let value = json!({"text": "kept", "n": 12345678901234567890u64, "nested": [1.5, null, "é"]});
    {
        let container = Container::run(&image, &args)?;
        let url = container.ready().await?;
        put_value(&url, &value, None).await?;
        docker(
            &["restart", "--time", &GRACE_SECONDS.to_string(), &container.id],
            Duration::from_secs(GRACE_SECONDS + 30),
        )?;
        let url = container.ready().await?;
        let (status, read) = get_value(&url, None).await?;
        check(read.as_ref() == Some(&value), || format!("after docker restart: {status} {read:?}"))?;
    }
    let container = Container::run(&image, &args)?;
    let url = container.ready().await?;
    let (status, read) = get_value(&url, None).await?;
    check(read.as_ref() == Some(&value), || format!("in a new container on the volume: {status} {read:?}"))
}

/// `docker stop` sends SIGTERM: the service shuts down by itself (exit status 0, not the 137 of
/// the SIGKILL at the end of the grace period) and says so in its log.
async fn sigterm_is_graceful(image: String) -> Result<(), String> {
    let container = Container::run(&image, UNAUTHENTICATED)?;
    let url = container.ready().await?;
    put_value(&url, &json!("before the stop"), None).await?;
    let started = Instant::now();
    docker(&["stop", "--time", &GRACE_SECONDS.to_string(), &container.id], Duration::from_secs(GRACE_SECONDS + 30))?;
    let took = started.elapsed();
    let state = container.state()?;
    let logs = container.logs();
    check(state == "exited 0", || format!("after docker stop: {state} (took {took:?}); logs: {logs}"))?;
    check(took < Duration::from_secs(GRACE_SECONDS), || {
        format!("the stop took {took:?}, the grace period is {GRACE_SECONDS} s")
    })?;
    check(logs.contains("shutting down") && logs.contains("stopped"), || {
        format!("no graceful shutdown in the log: {logs}")
    })
}

/// With neither tokens nor AGENTSTORE_ALLOW_UNAUTHENTICATED the container exits with a message
/// saying why; with tokens it serves and requires them.
async fn refuses_unauthenticated(image: String) -> Result<(), String> {
    let container = Container::run(&image, &[])?;
    let started = Instant::now();
    let state = loop {
        let state = container.state()?;
        if state.starts_with("exited") || started.elapsed() > READY_DEADLINE {
            break state;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let logs = container.logs();
    check(state.starts_with("exited") && state != "exited 0", || format!("without tokens: {state}; logs: {logs}"))?;
    check(logs.contains("refusing to listen") && logs.contains("no tokens configured"), || {
        format!("without tokens the container exited ({state}) without saying why: {logs}")
    })?;

    let token = "container-test-token";
    let tokens = format!("AGENTSTORE_TOKENS=alice:{}", hex::encode(Sha256::digest(token.as_bytes())));
    let container = Container::run(&image, &["-e", tokens.as_str()])?;
    let url = container.ready().await?;
    let (status, _) = get_value(&url, None).await?;
    check(status == 401, || format!("without a token: {status}, expected 401"))?;
    put_value(&url, &json!("with a token"), Some(token)).await?;
    let (status, read) = get_value(&url, Some(token)).await?;
    check(read == Some(json!("with a token")), || format!("with the token: {status} {read:?}"))
}

/// The HTTPS backends verify their servers against the system's CA certificates.
async fn has_ca_certificates(image: String) -> Result<(), String> {
    docker(
        &["run", "--rm", "--entrypoint", "/bin/sh", &image, "-c", "test -s /etc/ssl/certs/ca-certificates.crt"],
        DOCKER_TIMEOUT,
    )
    .map(|_| ())
    .map_err(|e| format!("/etc/ssl/certs/ca-certificates.crt is missing or empty in {image}: {e}"))
}

/// A builder that runs every stage (the legacy builder; docker-compose 1.x builds with it) must
/// get through the `prebuilt` stage when there is no ./prebuilt, as in a user's checkout, where
/// the binary is compiled. The stage comes first, so `--target prebuilt` runs it alone.
async fn prebuilt_stage_is_harmless() -> Result<(), String> {
    let context = tempfile::tempdir().map_err(|e| e.to_string())?;
    let dockerfile = concat!(env!("CARGO_MANIFEST_DIR"), "/Dockerfile");
    std::fs::copy(dockerfile, context.path().join("Dockerfile")).map_err(|e| e.to_string())?;
    let tag = format!("agentstore-test/prebuilt-stage:{}", std::process::id());
    let mut command = std::process::Command::new("docker");
    command
        .env("DOCKER_BUILDKIT", "0")
        .args(["build", "--quiet", "--target", "prebuilt", "-t", &tag])
        .arg(context.path());
    let (success, stdout, stderr) = crate::harness::run_with_timeout(command, DOCKER_TIMEOUT)?;
    let _ = docker(&["image", "rm", "-f", &tag], DOCKER_TIMEOUT);
    check(success, || format!("the legacy builder failed in the prebuilt stage: {stderr}{stdout}"))
}
