//! The frame of the container tests: which engine they run on, which image each group runs
//! against (a setting, defaulting to the official image or to one scripts/containers builds), and
//! whether that group runs, and why not.
//!
//! A group of trials shares one image. Before any trial runs, each group is decided once:
//! - RUN against the image on the engine: the image is in the engine's store (or an official
//!   image could be pulled);
//! - NOT RUN, with the reason, and its trials reported `ignored`: the container tests were
//!   deselected (`AGENTSTORE_TEST_CONTAINERS=0`), no engine answers, or an official image is not
//!   on the machine and cannot be pulled (no registry is reachable on the CI machines);
//! - FAILS: an image scripts/containers builds is missing although an engine answers, which
//!   would otherwise be a suite skipped because its set-up broke.
//!
//! Asking for ignored trials (`--ignored` / `--include-ignored`) fails them with their reason, so
//! a run never looks as if it tested a container when it did not.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use libtest_mimic::{Failed, Trial};
use testcontainers::core::{IntoContainerPort, WaitFor};
use testcontainers::runners::AsyncRunner;
use testcontainers::{ContainerAsync, GenericImage, ImageExt};

/// How long `docker info` may take before the engine counts as unreachable.
const ENGINE_PROBE_TIMEOUT: Duration = Duration::from_secs(20);
/// How long pulling an official image may take before it counts as not pullable.
const PULL_TIMEOUT: Duration = Duration::from_secs(300);
/// Where scripts/containers says why it could not make an engine answer.
const ENGINE_UNAVAILABLE_FILE: &str = "target/containers/engine-unavailable";

/// Where an image comes from.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Published on a registry: pulled when missing, NOT RUN when that fails.
    Official,
    /// Built on this machine by `scripts/containers SUBCOMMAND`: missing is a failure.
    Local(&'static str),
}

/// An image a group runs against: `setting` names it, `default` when unset.
pub struct ImageRole {
    pub setting: &'static str,
    pub default: &'static str,
    pub origin: Origin,
}

impl ImageRole {
    pub fn image(&self) -> String {
        std::env::var(self.setting).ok().filter(|v| !v.trim().is_empty()).unwrap_or_else(|| self.default.to_owned())
    }
}

/// Whether a group runs.
#[derive(Clone)]
pub enum Decision {
    Run,
    NotRun(String),
    Fails(String),
}

/// The engine, or why there is none.
pub fn engine() -> Result<String, String> {
    if std::env::var("AGENTSTORE_TEST_CONTAINERS").is_ok_and(|v| v == "0") {
        return Err("deselected by AGENTSTORE_TEST_CONTAINERS=0".into());
    }
    let endpoint = match std::env::var("DOCKER_HOST") {
        Ok(host) if !host.trim().is_empty() => format!("DOCKER_HOST={host}"),
        _ if Path::new("/var/run/docker.sock").exists() => "/var/run/docker.sock".to_owned(),
        _ => {
            return Err(with_setup_reason(
                "no Docker engine: DOCKER_HOST is not set and /var/run/docker.sock does not exist",
            ))
        }
    };
    match docker(&["info", "--format", "{{.ServerVersion}}"], ENGINE_PROBE_TIMEOUT) {
        Ok(version) if !version.trim().is_empty() => Ok(format!("Docker engine {} via {endpoint}", version.trim())),
        Ok(_) => Err(with_setup_reason(&format!("no Docker engine: {endpoint}, but `docker info` printed no version"))),
        Err(e) => Err(with_setup_reason(&format!("no Docker engine: {endpoint}, but {e}"))),
    }
}

/// `reason`, plus what scripts/containers found when it tried to start an engine.
fn with_setup_reason(reason: &str) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    match std::fs::read_to_string(root.join(ENGINE_UNAVAILABLE_FILE)) {
        Ok(why) if !why.trim().is_empty() => format!("{reason} (scripts/containers: {})", why.trim()),
        _ => reason.to_owned(),
    }
}

/// Decides whether a group with `image` from `origin` runs on `engine`.
pub fn decide(engine: &Result<String, String>, image: &str, origin: Origin) -> Decision {
    if let Err(reason) = engine {
        return Decision::NotRun(reason.clone());
    }
    if docker(&["image", "inspect", "--format", "{{.Id}}", image], ENGINE_PROBE_TIMEOUT).is_ok() {
        return Decision::Run;
    }
    match origin {
        Origin::Local(step) => Decision::Fails(format!(
            "{image} is not in the engine's store: `scripts/containers {step}` builds it (scripts/test runs it)"
        )),
        Origin::Official => match docker(&["pull", "--quiet", image], PULL_TIMEOUT) {
            Ok(_) => Decision::Run,
            Err(e) => Decision::NotRun(format!("{image} is not on this machine and cannot be pulled here ({e})")),
        },
    }
}

/// A trial's body: gets the group's target (the shared container's address, or the image).
pub type TrialFn = fn(String) -> BoxFuture<'static, Result<(), String>>;
/// Starts a group's shared container from the image: the container (kept for removal whatever
/// happens next) and its address.
pub type StartFn = fn(String) -> BoxFuture<'static, Result<(ContainerAsync<GenericImage>, String), String>>;
/// Waits until the server at the address answers.
pub type ReadyFn = fn(String) -> BoxFuture<'static, Result<(), String>>;

/// A group of trials on one image.
pub struct Group {
    pub name: &'static str,
    pub role: ImageRole,
    /// `Some`: one container shared by the trials, which get its address; `None`: each trial
    /// gets the image and starts what it needs.
    pub shared: Option<(StartFn, ReadyFn)>,
    pub trials: Vec<(&'static str, TrialFn)>,
}

/// The groups as libtest trials, each decided and reported on stdout; the shared containers are
/// removed by [`Cleanup::remove_all`] after the run.
/// `decide`: false when only listing the trials (nothing is asked of the engine).
pub fn trials(
    groups: Vec<Group>,
    engine: &Result<String, String>,
    runtime: &Arc<tokio::runtime::Runtime>,
    decide_groups: bool,
) -> (Vec<Trial>, Cleanup) {
    let cleanup = Cleanup::default();
    let mut trials = Vec::new();
    // Several groups run against the service's image: it is looked up (or pulled) once.
    let mut decided: std::collections::HashMap<String, Decision> = std::collections::HashMap::new();
    for group in groups {
        let image = group.role.image();
        if !decide_groups {
            trials
                .extend(group.trials.iter().map(|(name, _)| Trial::test(format!("{}::{name}", group.name), || Ok(()))));
            continue;
        }
        let decision =
            decided.entry(image.clone()).or_insert_with(|| decide(engine, &image, group.role.origin)).clone();
        match &decision {
            Decision::Run => {
                let engine = engine.as_deref().unwrap_or_default();
                println!("containers: {} RUN against {image} on {engine}", group.name)
            }
            Decision::NotRun(reason) => println!("containers: {} NOT RUN: {reason}", group.name),
            Decision::Fails(reason) => println!("containers: {} FAILS: {reason}", group.name),
        }
        let shared = group.shared.map(|(start, ready)| {
            let shared = Arc::new(SharedContainer {
                image: image.clone(),
                start,
                ready,
                address: Default::default(),
                container: Mutex::new(None),
            });
            cleanup.0.lock().unwrap_or_else(|e| e.into_inner()).push(Arc::clone(&shared));
            shared
        });
        for (name, run) in group.trials {
            let (decision, image, shared, runtime) =
                (decision.clone(), image.clone(), shared.clone(), Arc::clone(runtime));
            let ignored = matches!(decision, Decision::NotRun(_));
            let trial = Trial::test(format!("{}::{name}", group.name), move || {
                match decision {
                    Decision::NotRun(reason) => return Err(Failed::from(format!("NOT RUN: {reason}"))),
                    Decision::Fails(reason) => return Err(Failed::from(reason)),
                    Decision::Run => {}
                }
                runtime.block_on(async move {
                    let target = match shared {
                        Some(shared) => shared.address().await.map_err(Failed::from)?,
                        None => image,
                    };
                    run(target).await.map_err(Failed::from)
                })
            });
            trials.push(trial.with_ignored_flag(ignored));
        }
    }
    (trials, cleanup)
}

/// The shared containers started during the run.
#[derive(Default)]
pub struct Cleanup(Mutex<Vec<Arc<SharedContainer>>>);

impl Cleanup {
    /// Removes every shared container that was started.
    pub fn remove_all(&self, runtime: &tokio::runtime::Runtime) {
        for shared in self.0.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            let Some(container) = shared.container.lock().unwrap_or_else(|e| e.into_inner()).take() else { continue };
            let id = container.id().to_owned();
            if let Err(e) = runtime.block_on(container.rm()) {
                eprintln!("containers: could not remove the {} container {id}: {e}", shared.image);
            }
        }
    }
}

/// A group's container, started by the first trial that needs it.
pub struct SharedContainer {
    image: String,
    start: StartFn,
    ready: ReadyFn,
    address: tokio::sync::OnceCell<Result<String, String>>,
    container: Mutex<Option<ContainerAsync<GenericImage>>>,
}

impl SharedContainer {
    /// The running container's address, starting it on first use.
    async fn address(&self) -> Result<String, String> {
        self.address
            .get_or_init(|| async {
                let (container, address) = (self.start)(self.image.clone()).await?;
                *self.container.lock().unwrap_or_else(|e| e.into_inner()) = Some(container);
                (self.ready)(address.clone()).await?;
                Ok(address)
            })
            .await
            .clone()
    }
}

/// `name` and `tag` of an image reference (`registry/repo:tag`; `latest` when it has none).
pub fn name_and_tag(image: &str) -> (String, String) {
    let (name, tag) = agentstore::testing::split_image(image);
    (name.to_owned(), tag.to_owned())
}

/// What a group's container needs besides its image: the port to publish, what to wait for
/// before readiness is polled, and any command and environment.
pub struct Launch {
    pub port: u16,
    pub wait: WaitFor,
    pub cmd: Vec<String>,
    pub env: Vec<(&'static str, &'static str)>,
}

/// How long a container may take to start (its image is already on the machine).
const CONTAINER_STARTUP_TIMEOUT: Duration = Duration::from_secs(120);

/// Starts `image` as `launch` says; the container and `127.0.0.1:PORT`, where its port is
/// published (the engine publishes on the host's loopback; the bridge network's addresses are
/// never used).
pub async fn launch(image: &str, launch: Launch) -> Result<(ContainerAsync<GenericImage>, String), String> {
    let (name, tag) = name_and_tag(image);
    let mut request = GenericImage::new(name, tag)
        .with_exposed_port(launch.port.tcp())
        .with_wait_for(launch.wait)
        .with_startup_timeout(CONTAINER_STARTUP_TIMEOUT);
    if !launch.cmd.is_empty() {
        request = request.with_cmd(launch.cmd);
    }
    for (name, value) in launch.env {
        request = request.with_env_var(name, value);
    }
    let container = request.start().await.map_err(|e| format!("cannot start {image}: {e}"))?;
    let host_port = container
        .get_host_port_ipv4(launch.port.tcp())
        .await
        .map_err(|e| format!("{image}: no published port for {}: {e}", launch.port))?;
    Ok((container, format!("127.0.0.1:{host_port}")))
}

/// `Err(message())` unless `condition`.
pub fn check(condition: bool, message: impl FnOnce() -> String) -> Result<(), String> {
    if condition {
        Ok(())
    } else {
        Err(message())
    }
}

/// Runs `docker ARGS`, killing it after `timeout`; its stdout, or what went wrong (the first
/// line of its stderr).
pub fn docker(args: &[&str], timeout: Duration) -> Result<String, String> {
    let mut command = Command::new("docker");
    command.args(args);
    let (success, stdout, stderr) = run_with_timeout(command, timeout)
        .map_err(|e| format!("`docker {}` could not be run: {e}", args.first().unwrap_or(&"")))?;
    if success {
        Ok(stdout)
    } else {
        let detail = stderr.lines().chain(stdout.lines()).find(|l| !l.trim().is_empty()).unwrap_or("no output");
        Err(format!("`docker {}` failed: {}", args.first().unwrap_or(&""), detail.trim()))
    }
}

/// Runs `command`, killing it after `timeout`; its success, stdout and stderr.
pub fn run_with_timeout(mut command: Command, timeout: Duration) -> Result<(bool, String, String), String> {
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
