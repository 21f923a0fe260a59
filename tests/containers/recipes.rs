//! The testcontainers recipes users copy into their integration tests (docs/testcontainers.md),
//! each run against the service's image as a user's test would: Rust through
//! `agentstore::testing`, Python with `testcontainers` from PyPI and Node with `testcontainers`
//! from npm (both pinned; their scripts check themselves and exit non-zero on a failure).
//!
//! testcontainers' Ryuk reaper image cannot be pulled on the CI machines, so the Python and Node
//! recipes run with `TESTCONTAINERS_RYUK_DISABLED=true`; they remove their containers themselves.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use agentstore::testing::AgentStoreContainer;
use serde_json::{json, Value};

use crate::harness::{check, run_with_timeout, Group, TrialFn};

/// How long one recipe script may run.
const RECIPE_TIMEOUT: Duration = Duration::from_secs(300);
/// Where scripts/containers installs the Python recipe's pinned requirements.
const PYTHON_VENV: &str = "target/containers-venv";

pub fn groups() -> Vec<Group> {
    let trials: Vec<(&'static str, TrialFn)> = vec![
        ("rust_agentstore_testing", |image| Box::pin(rust_recipe(image))),
        ("python_testcontainers", |image| Box::pin(python_recipe(image))),
        ("node_testcontainers", |image| Box::pin(node_recipe(image))),
        ("python_docs_example_runs_under_pytest", |image| Box::pin(python_docs_example(image))),
        ("node_docs_example_runs_under_node_test", |image| Box::pin(node_docs_example(image))),
    ];
    vec![Group { name: "recipes", role: crate::service::service_image_role(), shared: None, trials }]
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `agentstore::testing` as docs/testcontainers.md shows it (its lines are checked to be these),
/// with the image from `AGENTSTORE_IMAGE` (set by `main`): with a token it requires it; then a
/// default start serves a round trip without one.
async fn rust_recipe(_image: String) -> Result<(), String> {
    check_readme_rust_snippet()?;
    readme_rust_snippet().await.map_err(|e| e.to_string())?;
    let client = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().map_err(|e| e.to_string())?;
    let value = json!({"recipe": "rust", "n": [1, 2.5, "三", 12345678901234567890u64]});
    let server = AgentStoreContainer::new().start().await.map_err(|e| e.to_string())?;
    check(server.url().starts_with("http://127.0.0.1:"), || format!("the recipe's URL is {}", server.url()))?;
    let document = format!("{}/v1/users/bob/namespaces/notes/keys/k1", server.url());
    let put = client.put(&document).json(&json!({"value": value})).send().await.map_err(|e| format!("PUT: {e}"))?;
    check(put.status().is_success(), || format!("PUT without tokens configured: {}", put.status()))?;
    let read: Value =
        client.get(&document).send().await.map_err(|e| e.to_string())?.json().await.map_err(|e| e.to_string())?;
    check(read["value"] == value, || format!("read back {read}"))?;
    server.stop().await;
    Ok(())
}

/// The documented snippet (docs/testcontainers.md, "Rust"), then what it promises: the token is
/// required.
async fn readme_rust_snippet() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let server = AgentStoreContainer::new() // $AGENTSTORE_IMAGE, else agentstore:latest
        .with_token("alice", "alice-token") // optional; without tokens, no authentication
        .start()
        .await?; // returns once /readyz answers 200
    let url = format!("{}/v1/users/alice/namespaces/notes/keys/k1", server.url());
    let client = reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?;
    let anonymous = client.get(&url).send().await?.status();
    check(anonymous.as_u16() == 401, || format!("without the token: {anonymous}"))?;
    let put = client.put(&url).bearer_auth("alice-token").json(&json!({"value": "hi"})).send().await?.status();
    check(put.is_success(), || format!("PUT with the token: {put}"))?;
    let read: Value = client.get(&url).bearer_auth("alice-token").send().await?.json().await?;
    check(read["value"] == "hi", || format!("read back with the token: {read}"))?;
    server.stop().await;
    Ok(())
}

/// Every code line of the Rust testcontainers snippet (docs/testcontainers.md, "Rust"; the README's
/// until issue 23) is a line of this file.
fn check_readme_rust_snippet() -> Result<(), String> {
    let block = fenced_blocks(DOCS, "rust", "## Rust")?
        .into_iter()
        .next()
        .ok_or("docs/testcontainers.md's Rust section has no ```rust block")?;
    let missing: Vec<&str> = block
        .lines()
        .map(|line| line.split(" //").next().unwrap_or(line).trim())
        .filter(|line| !line.is_empty() && !line.starts_with("use "))
        .filter(|line| !THIS_FILE.lines().any(|own| own.split(" //").next().unwrap_or(own).trim() == *line))
        .collect();
    check(missing.is_empty(), || format!("documented lines not in the tested recipe: {missing:?}"))
}

const THIS_FILE: &str = include_str!("recipes.rs");
const DOCS: &str = include_str!("../../docs/testcontainers.md");

/// The fenced blocks of `language` after `heading` in `text` (to the next heading of the same
/// level or the end).
fn fenced_blocks<'a>(text: &'a str, language: &str, heading: &str) -> Result<Vec<&'a str>, String> {
    let start = text.find(heading).ok_or_else(|| format!("no {heading:?} heading"))? + heading.len();
    let level = heading.split(' ').next().unwrap_or("#");
    let section = &text[start..];
    let end = section.find(&format!("\n{level} ")).unwrap_or(section.len());
    let section = &section[..end];
    let fence = format!("```{language}\n");
    let mut blocks = Vec::new();
    let mut rest = section;
    while let Some(at) = rest.find(&fence) {
        let body = &rest[at + fence.len()..];
        let close = body.find("```").ok_or("an unclosed fence")?;
        blocks.push(&body[..close]);
        rest = &body[close + 3..];
    }
    Ok(blocks)
}

/// docs/testcontainers.md's Python helper and pytest example, run with pytest as a user's test.
async fn python_docs_example(image: String) -> Result<(), String> {
    let mut pytest = Command::new(python_venv()?);
    pytest.args(["-m", "pytest", "-q", "-p", "no:cacheprovider"]);
    run_docs_example("python", "## Python", "test_docs_example.py", pytest, &image)
}

/// docs/testcontainers.md's Node helper and node:test example, run with `node --test`.
async fn node_docs_example(image: String) -> Result<(), String> {
    node_modules()?;
    let mut node = Command::new("node");
    node.arg("--test");
    run_docs_example("js", "## Node", "docs-example.test.mjs", node, &image)
}

/// The two `language` blocks under `heading` (the helper, then the test using it), written to
/// `file` and run by `runner` against `image`.
fn run_docs_example(language: &str, heading: &str, file: &str, mut runner: Command, image: &str) -> Result<(), String> {
    let blocks = fenced_blocks(DOCS, language, heading)?;
    check(blocks.len() == 2, || {
        format!("expected the helper and the test example under {heading:?}, found {} blocks", blocks.len())
    })?;
    runner.arg(write_example(file, &blocks.concat())?);
    run_recipe(&format!("{language} docs example"), runner, image)
}

/// Writes an example under target/containers (inside the repository, so Node finds its
/// node_modules); its path.
fn write_example(name: &str, code: &str) -> Result<std::path::PathBuf, String> {
    let dir = root().join("target/containers/docs-examples");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let file = dir.join(name);
    std::fs::write(&file, code).map_err(|e| format!("{}: {e}", file.display()))?;
    Ok(file)
}

fn python_venv() -> Result<std::path::PathBuf, String> {
    let python = root().join(PYTHON_VENV).join("bin/python");
    check(python.exists(), || {
        format!(
            "{} is missing: `scripts/containers recipes` installs the Python recipe's requirements",
            python.display()
        )
    })?;
    Ok(python)
}

fn node_modules() -> Result<(), String> {
    check(root().join("node_modules/testcontainers").exists(), || {
        "node_modules/testcontainers is missing: run `npm ci` in the repository (scripts/test does)".to_owned()
    })
}

async fn python_recipe(image: String) -> Result<(), String> {
    let python = root().join(PYTHON_VENV).join("bin/python");
    check(python.exists(), || {
        format!(
            "{} is missing: `scripts/containers recipes` installs the Python recipe's requirements",
            python.display()
        )
    })?;
    let mut command = Command::new(python);
    command.arg(root().join("tests/containers/recipes/python/agentstore_container.py"));
    run_recipe("python", command, &image)
}

async fn node_recipe(image: String) -> Result<(), String> {
    node_modules()?;
    let mut command = Command::new("node");
    command.arg(root().join("tests/containers/recipes/node/agentstore-container.mjs"));
    run_recipe("node", command, &image)
}

/// Runs a recipe script against `image`; it must exit 0. Its output is printed either way.
fn run_recipe(language: &str, mut command: Command, image: &str) -> Result<(), String> {
    command
        .current_dir(root())
        .env("AGENTSTORE_IMAGE", image)
        .env("TESTCONTAINERS_RYUK_DISABLED", "true")
        // This machine has /.dockerenv, so both libraries think they run inside a container and
        // would reach the service through the bridge gateway; the port is published on loopback.
        .env("TESTCONTAINERS_CONNECTION_MODE", "docker_host")
        .env("TESTCONTAINERS_HOST_OVERRIDE", "localhost");
    let (success, stdout, stderr) =
        run_with_timeout(command, RECIPE_TIMEOUT).map_err(|e| format!("{language} recipe: {e}"))?;
    print!("{stdout}");
    check(success, || format!("the {language} recipe failed:\n{stdout}{stderr}"))
}
