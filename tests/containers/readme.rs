//! The "Running in a container" block of docs/operations.md (the README's until issue 23; the
//! group keeps its name `readme`), run as it is written: the lines a user pastes,
//! with the image the suite built for `agentstore`, and a container name, volume and host port of
//! the trial's own (so it neither needs nor touches a user's `agentstore` container or port
//! 8080). `docker build` is skipped: the image is already built from the same Dockerfile.

use std::process::Command;
use std::time::Duration;

use crate::harness::{check, docker, run_with_timeout, Group, TrialFn};

const DOC: &str = include_str!("../../docs/operations.md");
const SECTION: &str = "## Running in a container";
const BLOCK_TIMEOUT: Duration = Duration::from_secs(180);

pub fn groups() -> Vec<Group> {
    let trials: Vec<(&'static str, TrialFn)> =
        vec![("readme_block_runs_as_written", |image| Box::pin(readme_block_runs(image)))];
    vec![Group { name: "readme", role: crate::service::service_image_role(), shared: None, trials }]
}

/// The first ```sh block after the section's heading.
fn readme_block() -> Result<&'static str, String> {
    let section = DOC.find(SECTION).ok_or_else(|| format!("docs/operations.md has no {SECTION:?} section"))?;
    let rest = &DOC[section..];
    let start = rest.find("```sh\n").ok_or("the section has no ```sh block")? + "```sh\n".len();
    let end = rest[start..].find("```").ok_or("the ```sh block does not end")?;
    Ok(&rest[start..start + end])
}

/// Wrappers around `docker` and `curl` that put the trial's names in place of the documented ones.
const PRELUDE: &str = r#"set -euo pipefail
real_docker="$(command -v docker)"
real_curl="$(command -v curl)"
docker() {
  if [ "$1" = build ]; then echo "readme: skipped \`docker $*\` (the suite built $TEST_IMAGE)"; return 0; fi
  local args=() previous="" command="$1"
  for arg in "$@"; do
    case "$arg" in
      agentstore)
        if [ "$previous" = --name ] || [ "$command" = stop ]; then arg="$TEST_CONTAINER"; else arg="$TEST_IMAGE"; fi ;;
      agentstore-data) arg="$TEST_VOLUME" ;;
      agentstore-data:*) arg="$TEST_VOLUME:${arg#agentstore-data:}" ;;
      127.0.0.1:8080:8080) arg="127.0.0.1:$TEST_PORT:8080" ;;
    esac
    args+=("$arg")
    previous="$arg"
  done
  "$real_docker" "${args[@]}"
}
curl() {
  local args=()
  for arg in "$@"; do args+=("${arg/127.0.0.1:8080/127.0.0.1:$TEST_PORT}"); done
  "$real_curl" --max-time 10 "${args[@]}"
}
"#;

async fn readme_block_runs(image: String) -> Result<(), String> {
    let block = readme_block()?;
    check(block.contains("docker run") && block.contains("docker stop"), || format!("unexpected block:\n{block}"))?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port()
        .to_string();
    let suffix = format!("{}-{port}", std::process::id());
    let (container, volume) = (format!("agentstore-readme-{suffix}"), format!("agentstore-readme-{suffix}"));
    let mut command = Command::new("bash");
    command
        .arg("-c")
        .arg(format!("{PRELUDE}\n{block}"))
        .env("TEST_IMAGE", &image)
        .env("TEST_CONTAINER", &container)
        .env("TEST_VOLUME", &volume)
        .env("TEST_PORT", &port);
    let outcome = run_with_timeout(command, BLOCK_TIMEOUT);
    let stopped = docker(&["inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", &container], BLOCK_TIMEOUT);
    let _ = docker(&["rm", "-f", &container], BLOCK_TIMEOUT);
    let _ = docker(&["volume", "rm", "-f", &volume], BLOCK_TIMEOUT);
    let (success, stdout, stderr) = outcome?;
    check(success, || format!("the documented block failed:\n{stdout}{stderr}"))?;
    check(stdout.contains("\"status\":\"ready\""), || format!("no /readyz answer in the output:\n{stdout}"))?;
    let stopped = stopped?;
    check(stopped.trim() == "exited 0", || format!("after the block's docker stop the container is {stopped}"))
}
