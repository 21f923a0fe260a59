//! The service in a container for other projects' integration tests, started with testcontainers
//! (feature `testing`).
//!
//! ```no_run
//! # async fn example() -> Result<(), agentstore::testing::StartError> {
//! use agentstore::testing::AgentStoreContainer;
//!
//! // $AGENTSTORE_IMAGE, else the image `docker build -t agentstore .` makes; embedded store, no tokens.
//! let server = AgentStoreContainer::new().start().await?;
//! let url = format!("{}/v1/users/alice/namespaces/notes/keys/k1", server.url());
//! // ... PUT {"value": ...} to `url` with any HTTP client ...
//! server.stop().await;
//! # Ok(()) }
//! ```
//!
//! The container is ready when `GET /readyz` answers 200: the store is open and the backend
//! reachable, so the first request of a test never races the start. The service refuses to serve
//! without bearer tokens on a non-loopback address, which a container's is: with no tokens given
//! the container is started with `AGENTSTORE_ALLOW_UNAUTHENTICATED=true` (the port is the test's
//! own), and with [`AgentStoreContainer::with_token`] it requires them as in production.
//!
//! Readiness is polled with the `reqwest` client this crate already uses rather than with
//! testcontainers' own HTTP wait strategy, which would bring a second major version of reqwest.

use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use testcontainers::core::{IntoContainerPort, WaitFor};
use testcontainers::runners::AsyncRunner;
use testcontainers::{ContainerAsync, GenericImage, ImageExt};

/// The port the service listens on inside its image.
pub const SERVICE_PORT: u16 = 8080;
/// How long the container may take from its start to a 200 from `/readyz`.
const READY_DEADLINE: Duration = Duration::from_secs(60);

/// Why the container did not start, or did not become ready.
#[derive(Debug)]
pub struct StartError(String);

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for StartError {}

/// What to start: the image, bearer tokens, and any other `AGENTSTORE_*` setting.
#[derive(Debug, Clone)]
pub struct AgentStoreContainer {
    name: String,
    tag: String,
    /// `(user id or "*", SHA-256 of the token)`, as the `tokens` setting takes them.
    token_hashes: Vec<(String, String)>,
    env: Vec<(String, String)>,
}

/// The host the published port is reached on, when testcontainers' guess is wrong: the variable
/// testcontainers for Java, Go and Node read. testcontainers-rs guesses the bridge network's
/// gateway whenever `/.dockerenv` exists, which is right inside a container using the host's
/// engine but wrong on a machine that merely has that file and publishes ports on its loopback.
pub const HOST_OVERRIDE_VARIABLE: &str = "TESTCONTAINERS_HOST_OVERRIDE";

/// The variable naming the image (`NAME:TAG`), as in the Python and Node recipes: a CI job can
/// build the image under its own name.
pub const IMAGE_VARIABLE: &str = "AGENTSTORE_IMAGE";

impl Default for AgentStoreContainer {
    fn default() -> Self {
        let image = std::env::var(IMAGE_VARIABLE).ok().filter(|v| !v.trim().is_empty());
        let (name, tag) = match image.as_deref().map(split_image) {
            Some((name, tag)) => (name.to_owned(), tag.to_owned()),
            None => ("agentstore".to_owned(), "latest".to_owned()),
        };
        AgentStoreContainer { name, tag, token_hashes: Vec::new(), env: Vec::new() }
    }
}

/// `registry/repository:tag` as its name and tag (`latest` when it names none).
pub fn split_image(image: &str) -> (&str, &str) {
    let after_slash = image.rfind('/').map_or(0, |i| i + 1);
    match image[after_slash..].rfind(':') {
        Some(colon) => (&image[..after_slash + colon], &image[after_slash + colon + 1..]),
        None => (image, "latest"),
    }
}

impl AgentStoreContainer {
    /// The image `$AGENTSTORE_IMAGE`, else `agentstore:latest` (what `docker build -t agentstore .`
    /// makes), on its default embedded store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Another image than [`AgentStoreContainer::new`] chose.
    pub fn with_image(mut self, name: impl Into<String>, tag: impl Into<String>) -> Self {
        self.name = name.into();
        self.tag = tag.into();
        self
    }

    /// Requires bearer tokens: `token` is accepted for `user` (`"*"`: every user, admin). Only
    /// its SHA-256 reaches the container.
    pub fn with_token(mut self, user: impl Into<String>, token: &str) -> Self {
        self.token_hashes.push((user.into(), hex::encode(Sha256::digest(token.as_bytes()))));
        self
    }

    /// Any other setting, e.g. `("AGENTSTORE_BACKEND", "couchdb+http://...")`.
    pub fn with_env(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((name.into(), value.into()));
        self
    }

    /// Starts the container and waits until `/readyz` answers 200.
    pub async fn start(self) -> Result<RunningAgentStore, StartError> {
        let image = format!("{}:{}", self.name, self.tag);
        let mut request = GenericImage::new(self.name, self.tag)
            .with_exposed_port(SERVICE_PORT.tcp())
            .with_wait_for(WaitFor::message_on_stderr("agentstore: serving"))
            .with_startup_timeout(READY_DEADLINE);
        if self.token_hashes.is_empty() {
            request = request.with_env_var("AGENTSTORE_ALLOW_UNAUTHENTICATED", "true");
        } else {
            let tokens: Vec<String> = self.token_hashes.iter().map(|(user, hash)| format!("{user}:{hash}")).collect();
            request = request.with_env_var("AGENTSTORE_TOKENS", tokens.join(","));
        }
        for (name, value) in self.env {
            request = request.with_env_var(name, value);
        }
        let container = request.start().await.map_err(|e| StartError(format!("cannot start {image}: {e}")))?;
        let port = container
            .get_host_port_ipv4(SERVICE_PORT.tcp())
            .await
            .map_err(|e| StartError(format!("{image}: no published port for {SERVICE_PORT}: {e}")))?;
        let host = match std::env::var(HOST_OVERRIDE_VARIABLE).ok().filter(|v| !v.trim().is_empty()) {
            Some(host) => host,
            None => container.get_host().await.map_err(|e| StartError(format!("{image}: no host: {e}")))?.to_string(),
        };
        // "localhost" may resolve to ::1 first, where the port may not be published.
        let host = if host == "localhost" { "127.0.0.1".to_owned() } else { host };
        let running = RunningAgentStore { container, url: format!("http://{host}:{port}") };
        running.wait_until_ready(&image).await?;
        Ok(running)
    }
}

/// A started container; removed when dropped (or by [`RunningAgentStore::stop`]).
pub struct RunningAgentStore {
    container: ContainerAsync<GenericImage>,
    url: String,
}

impl RunningAgentStore {
    /// The service's base URL on the host, e.g. `http://127.0.0.1:49153`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The container, for logs, exec or its id.
    pub fn container(&self) -> &ContainerAsync<GenericImage> {
        &self.container
    }

    /// Stops and removes the container (dropping it does the same without waiting).
    pub async fn stop(self) {
        if let Err(e) = self.container.rm().await {
            tracing::warn!(error = %e, "could not remove the agentstore test container");
        }
    }

    async fn wait_until_ready(&self, image: &str) -> Result<(), StartError> {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| StartError(format!("cannot build an HTTP client: {e}")))?;
        let readyz = format!("{}/readyz", self.url);
        let started = Instant::now();
        let mut last = String::from("no answer yet");
        while started.elapsed() < READY_DEADLINE {
            match client.get(&readyz).send().await {
                Ok(response) if response.status().is_success() => return Ok(()),
                Ok(response) => last = format!("HTTP {}", response.status()),
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(StartError(format!("{image} at {readyz} was not ready within {READY_DEADLINE:?}: {last}")))
    }
}

#[cfg(test)]
mod tests {
    use super::split_image;

    #[test]
    fn image_references_split_into_name_and_tag() {
        assert_eq!(split_image("agentstore"), ("agentstore", "latest"));
        assert_eq!(split_image("agentstore-test/agentstore:local"), ("agentstore-test/agentstore", "local"));
        assert_eq!(
            split_image("registry.example:5000/team/agentstore:1.2"),
            ("registry.example:5000/team/agentstore", "1.2")
        );
        assert_eq!(split_image("registry.example:5000/agentstore"), ("registry.example:5000/agentstore", "latest"));
    }
}
