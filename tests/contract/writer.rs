//! The writers of the follower case: a fixed mix of creates, updates and deletes over ids shared
//! between writers, run either as child processes (this test binary started again with
//! `AGENTSTORE_CONTRACT_WRITER` set) or as tasks in this process.

use std::process::{Child, Command, Stdio};

use agentstore::store::DataStore;
use serde_json::json;

/// The environment variable that makes this binary a writer: `{writer number} {backend URL}`.
pub const WRITER_ENV: &str = "AGENTSTORE_CONTRACT_WRITER";

const USERS: [&str; 2] = ["alice", "bob"];
const NAMESPACES: [&str; 2] = ["notes", "ns:with:colons"];
const KEYS: usize = 6;
const ROUNDS: usize = 30;

/// Every id the writers touch.
pub fn all_ids(_writers: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for user in USERS {
        for namespace in NAMESPACES {
            for key in 0..KEYS {
                let id = agentstore::model::DocumentId::new(user, namespace, &format!("k{key}"), &Default::default());
                ids.push(id.expect("valid id").as_str().to_owned());
            }
        }
    }
    ids
}

/// One writer's work: each round touches one id of each (user, namespace), chosen so that writers
/// overlap; every third touch of an id deletes it, the others set it (creating it again after a
/// delete). Values come from the round-trip corpus's kinds of values.
pub async fn write_mix(store: &DataStore, writer: usize) -> Result<(), agentstore::Error> {
    for round in 0..ROUNDS {
        for user in USERS {
            for namespace in NAMESPACES {
                let key = format!("k{}", (round * 7 + writer * 3) % KEYS);
                if (round + writer) % 3 == 2 {
                    store.delete(user, namespace, &key).await?;
                } else {
                    let value = json!({ "writer": writer, "round": round, "text": "é 日本", "n": 1.5e300 });
                    store.set(user, namespace, &key, value, Some(json!({ format!("w{writer}"): round })), None).await?;
                }
            }
        }
    }
    Ok(())
}

/// Runs as a writer process when the environment says so; `true` when it did.
pub fn run_if_writer() -> bool {
    let Ok(spec) = std::env::var(WRITER_ENV) else { return false };
    let (writer, url) = spec.split_once(' ').expect("writer spec: NUMBER URL");
    let writer: usize = writer.parse().expect("writer number");
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    runtime.block_on(async move {
        let backend = agentstore::backend::open(&url.parse().expect("backend URL")).await.expect("open backend");
        let store = DataStore::open(backend, Default::default()).await.expect("open store");
        write_mix(&store, writer).await.expect("writer failed");
    });
    true
}

pub enum Writers {
    Processes(Vec<Child>),
    Tasks(Vec<tokio::task::JoinHandle<Result<(), agentstore::Error>>>),
}

/// Starts `count` writer processes against `url`.
pub fn spawn_processes(url: &str, count: usize) -> Writers {
    let exe = std::env::current_exe().expect("this test binary");
    let children = (0..count)
        .map(|writer| {
            Command::new(&exe)
                .env(WRITER_ENV, format!("{writer} {url}"))
                .stdin(Stdio::null())
                .spawn()
                .expect("start a writer process")
        })
        .collect();
    Writers::Processes(children)
}

impl Writers {
    /// Whether every writer has stopped.
    pub fn finished(&mut self) -> bool {
        match self {
            Writers::Processes(children) => children.iter_mut().all(|child| !matches!(child.try_wait(), Ok(None))),
            Writers::Tasks(tasks) => tasks.iter().all(|task| task.is_finished()),
        }
    }

    /// Waits for every writer and fails the test if one failed.
    pub async fn wait(self) {
        match self {
            Writers::Processes(children) => {
                for mut child in children {
                    let status = tokio::task::spawn_blocking(move || child.wait()).await.expect("join").expect("wait");
                    assert!(status.success(), "a writer process failed: {status}");
                }
            }
            Writers::Tasks(tasks) => {
                for task in tasks {
                    task.await.expect("writer task").expect("a writer failed");
                }
            }
        }
    }
}
