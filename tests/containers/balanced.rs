//! `deploy/compose.yml` over dynalite: three instances of the locally built service behind the
//! HAProxy image `scripts/containers images` builds from `deploy/haproxy/`. A write through the
//! balancer reads back the same from every instance, and `docker stop` of one instance while
//! requests keep coming (its drain: not ready at once, still serving) costs no request an error.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::compose::{compose_file, free_port};
use crate::harness::{check, docker, Group, TrialFn};

const COMPOSE_FILE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/compose.yml");
const READY_DEADLINE: Duration = Duration::from_secs(90);
/// The header `deploy/haproxy/haproxy.cfg` names the answering instance in.
const INSTANCE_HEADER: &str = "x-agentstore-instance";

pub fn groups() -> Vec<Group> {
    let trials: Vec<(&'static str, TrialFn)> =
        vec![("three_instances_over_dynalite_answer_as_one", |image| Box::pin(three_instances(image)))];
    vec![Group { name: "balanced", role: crate::service::service_image_role(), shared: None, trials }]
}

/// An image named by `setting` (default `default`), which `scripts/containers images` builds.
fn local_image(setting: &str, default: &str) -> Result<String, String> {
    let image = std::env::var(setting).ok().filter(|v| !v.trim().is_empty()).unwrap_or_else(|| default.to_owned());
    docker(&["image", "inspect", "--format", "{{.Id}}", &image], Duration::from_secs(30))
        .map_err(|e| format!("{image} is not in the engine's store ({e}): `scripts/containers images` builds it"))?;
    Ok(image)
}

async fn three_instances(image: String) -> Result<(), String> {
    let dynalite = local_image("AGENTSTORE_TEST_DYNALITE_IMAGE", "agentstore-test/dynalite:4.0.0")?;
    let haproxy = local_image("AGENTSTORE_TEST_HAPROXY_IMAGE", "agentstore-test/haproxy:local")?;
    let rest_port = free_port()?;
    let deployment = Deployment {
        project: format!("agentstore-balanced-{}", std::process::id()),
        env: vec![
            ("AGENTSTORE_IMAGE".into(), image),
            ("DYNALITE_IMAGE".into(), dynalite),
            ("HAPROXY_IMAGE".into(), haproxy),
            ("BALANCER_COUCHDB_PORT".into(), free_port()?),
            ("BALANCER_REST_PORT".into(), rest_port.clone()),
            ("BALANCER_STATS_PORT".into(), free_port()?),
        ],
    };
    let result = async {
        deployment.compose(&["up", "--detach", "--no-build"])?;
        let balancer = Balancer::new(&rest_port)?;
        balancer.wait_for_every_instance().await.map_err(|e| {
            let logs = deployment.compose(&["logs", "--tail", "40"]).unwrap_or_default();
            format!("{e}\n{logs}")
        })?;
        balancer.one_write_reads_the_same_everywhere().await?;
        let stopped = deployment.clone();
        balancer
            .stopping_one_instance_fails_no_request(move || stopped.compose(&["stop", "dynamodb-agentstore-2"]))
            .await
    }
    .await;
    let down = deployment.compose(&["down", "--volumes", "--timeout", "45"]);
    result?;
    down.map(|_| ())
}

/// The compose project of one trial: its name and the variables the file reads.
#[derive(Clone)]
struct Deployment {
    project: String,
    env: Vec<(String, String)>,
}

impl Deployment {
    /// Runs compose with `args` on deploy/compose.yml, profile `dynamodb`.
    fn compose(&self, args: &[&str]) -> Result<String, String> {
        let all = [&["--project-name", self.project.as_str(), "--profile", "dynamodb"][..], args].concat();
        let env: Vec<(&str, &str)> = self.env.iter().map(|(name, value)| (name.as_str(), value.as_str())).collect();
        compose_file(COMPOSE_FILE, &all, &env)
    }
}

/// The REST API through HAProxy.
struct Balancer {
    url: String,
    client: reqwest::Client,
}

impl Balancer {
    fn new(port: &str) -> Result<Self, String> {
        let client = reqwest::Client::builder().timeout(Duration::from_secs(20)).build().map_err(|e| e.to_string())?;
        Ok(Balancer { url: format!("http://127.0.0.1:{port}"), client })
    }

    /// A GET through the balancer: its status, the instance that answered, its body.
    async fn get(&self, path: &str) -> Result<(u16, String, Value), String> {
        let response = self.client.get(format!("{}{path}", self.url)).send().await.map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let instance =
            response.headers().get(INSTANCE_HEADER).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
        let body = response.json().await.unwrap_or(Value::Null);
        Ok((status, instance, body))
    }

    async fn put(&self, path: &str, body: &Value) -> Result<u16, String> {
        let response =
            self.client.put(format!("{}{path}", self.url)).json(body).send().await.map_err(|e| e.to_string())?;
        Ok(response.status().as_u16())
    }

    /// Until `/readyz` through the balancer has answered 200 from each of the three instances.
    async fn wait_for_every_instance(&self) -> Result<(), String> {
        let started = Instant::now();
        let mut ready = std::collections::BTreeSet::new();
        let mut last = String::new();
        while ready.len() < 3 {
            if started.elapsed() > READY_DEADLINE {
                return Err(format!("ready after {READY_DEADLINE:?}: {ready:?} only; last answer {last}"));
            }
            match self.get("/readyz").await {
                Ok((200, instance, _)) => {
                    ready.insert(instance);
                }
                Ok((status, instance, body)) => last = format!("{status} from {instance:?}: {body}"),
                Err(e) => last = e,
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(())
    }

    /// A write through one instance, then six reads through the balancer: every instance answers
    /// (round-robin), each with the written value.
    async fn one_write_reads_the_same_everywhere(&self) -> Result<(), String> {
        let document = "/v1/users/alice/namespaces/balanced/keys/k1";
        let status = self.put(document, &json!({ "value": "through the balancer" })).await?;
        check(status == 200, || format!("PUT through the balancer: {status}"))?;
        let mut answered = std::collections::BTreeSet::new();
        for _ in 0..6 {
            let (status, instance, body) = self.get(document).await?;
            check(status == 200 && body["value"] == "through the balancer", || {
                format!("read through {instance:?}: {status} {body}")
            })?;
            answered.insert(instance);
        }
        check(answered.len() == 3, || format!("six reads answered by {answered:?}, not by three instances"))
    }

    /// Writes and reads keep coming while `stop` (`docker stop` of one instance: SIGTERM, the
    /// drain, the exit) runs; none gets an error, and every write is read back afterwards.
    async fn stopping_one_instance_fails_no_request(
        &self,
        stop: impl FnOnce() -> Result<String, String> + Send + 'static,
    ) -> Result<(), String> {
        let stopping = tokio::task::spawn_blocking(stop);
        let mut failures = Vec::new();
        let mut written = Vec::new();
        let mut answered = std::collections::BTreeSet::new();
        let mut i = 0;
        while !stopping.is_finished() {
            i += 1;
            let document = format!("/v1/users/alice/namespaces/balanced/keys/during-{i}");
            match self.put(&document, &json!({ "value": i })).await {
                Ok(200) => written.push((document.clone(), i)),
                other => failures.push(format!("PUT {document}: {other:?}")),
            }
            match self.get(&document).await {
                Ok((200, instance, _)) => {
                    answered.insert(instance);
                }
                other => failures.push(format!("GET {document}: {other:?}")),
            }
        }
        stopping.await.map_err(|e| e.to_string())??;
        check(failures.is_empty(), || {
            format!("{} requests failed while an instance stopped: {failures:?}", failures.len())
        })?;
        check(i > 10, || format!("only {i} rounds of requests while the instance stopped"))?;
        for (document, value) in &written {
            let (status, instance, body) = self.get(document).await?;
            check(status == 200 && body["value"] == json!(value), || {
                format!("{document} after the stop, through {instance:?}: {status} {body}")
            })?;
            check(instance != "agentstore-2", || format!("{document} answered by the stopped instance"))?;
        }
        eprintln!("balanced: {i} rounds while agentstore-2 stopped, answered by {answered:?}");
        Ok(())
    }
}
