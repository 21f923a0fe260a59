//! Live migration end to end (issue 13): `migrate --follow` copying a store while a writer keeps
//! creating, updating and deleting documents in it, between every ordered pair of the selected
//! backends; the same with the migration killed (SIGKILL) at random moments of its copy and follow
//! phases and resumed; a CouchDB source written by plain HTTP as the existing system writes it;
//! and a target document changed behind the migration's back under each `--on-conflict` policy.
//!
//! Every trial ends the same way: the writers stop, `migrate --follow --until-caught-up` reaches
//! the end, `agentstore verify` reports the stores identical, and this suite compares both stores
//! itself, document by document (numbers by exact decimal value).
//!
//! `AGENTSTORE_TEST_BACKENDS` selects backends as for the contract suite; a selected backend whose
//! server cannot be reached fails its trials.
//!
//! This module holds the trial list, the two sides of a migration, the documents, the writer (in
//! process or as this binary started again) and running the real binary; each topic file opens
//! with what it covers.

mod conflict;
mod crash;
mod pairs;
mod plain_http;
mod sigterm;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentstore::backend::embedded::EmbeddedBackend;
use agentstore::backend::{BulkWrite, DocumentBackend, Precondition};
use agentstore::error::ErrorKind;
use agentstore::migrate::{self, Endpoint, FollowMode, Job, JobKind, Options};
use agentstore::model::id::encode_key;
use agentstore::store::DataStore;
use libtest_mimic::{Arguments, Failed, Trial};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::common::harness::{self, BackendHarness, Ctx};
use crate::common::json::{exact_eq, first_difference, survives_f64};
use crate::common::{agentstore, block_on, check, object, TestResult};

pub use writer_process::run_if_writer;

/// Makes this test binary a writer process: a JSON [`WriterSpec`].
const WRITER_ENV: &str = "AGENTSTORE_LIVE_MIGRATE_WRITER";
const USERS: [&str; 3] = ["alice", "bob", "carol_3"];
const NAMESPACES: [&str; 3] = ["default", "files:my-repo", "cache:github"];
/// Documents per (user, namespace) seeded before a pair trial starts.
const PAIR_KEYS: usize = 25;
/// Documents per (user, namespace) seeded before a crash trial: 3 × 3 × 334 ≈ 3,000.
const CRASH_KEYS: usize = 334;
/// How long the writer runs while the migration follows.
const WRITE_FOR: Duration = Duration::from_secs(3);
/// Corpus values larger than this are seeded but not rewritten by the writers (they would make
/// every writer step a megabyte write).
const WRITER_VALUE_MAX_BYTES: usize = 16 * 1024;

type FreshFn = fn() -> harness::BoxFuture<Result<Ctx, String>>;

/// The suite's trials, named `live_migrate::…`; `None`, after printing why, when the backend
/// selection is invalid.
pub fn trials(args: &Arguments) -> Option<Vec<Trial>> {
    let (backends, selected) = harness::announce("live migration suite", args.list)?;
    let is_selected = |name: &str| selected.contains(&name);
    let mut trials = Vec::new();
    for source in &backends {
        for target in &backends {
            let (from, to) = (Backend::of(source), Backend::of(target));
            trials.push(
                Trial::test(format!("live_migrate::pair::{}_to_{}", from.name, to.name), move || {
                    block_on(pairs::live_pair(from, to))
                })
                .with_ignored_flag(!(is_selected(source.name) && is_selected(target.name))),
            );
        }
    }
    for (source, target) in
        [("couchdb", "embedded"), ("dynamodb", "firestore"), ("firestore", "couchdb"), ("embedded", "dynamodb")]
    {
        let (from, to) = (Backend::named(&backends, source), Backend::named(&backends, target));
        trials.push(
            Trial::test(format!("live_migrate::crash::{source}_to_{target}"), move || {
                block_on(crash::crash_and_resume(from, to))
            })
            .with_ignored_flag(!(is_selected(source) && is_selected(target))),
        );
    }
    let couchdb = Backend::named(&backends, "couchdb");
    trials.push(
        Trial::test("live_migrate::couchdb::plain_http_writer", move || {
            block_on(plain_http::plain_http_writer(couchdb))
        })
        .with_ignored_flag(!(is_selected("couchdb") && is_selected("embedded"))),
    );
    let embedded = Backend::named(&backends, "embedded");
    for target in &backends {
        let to = Backend::of(target);
        trials.push(
            Trial::test(
                format!("live_migrate::conflict::target_changed_independently::embedded_to_{}", to.name),
                move || block_on(conflict::target_changed_independently(embedded, to)),
            )
            .with_ignored_flag(!(is_selected("embedded") && is_selected(target.name))),
        );
    }
    trials.push(
        Trial::test("live_migrate::embedded::sigterm_during_the_copy_stops_after_a_batch", || {
            block_on(sigterm::sigterm_during_the_copy_stops_after_a_batch())
        })
        .with_ignored_flag(!is_selected("embedded")),
    );
    Some(trials)
}

/// A backend of the harness, by name and how to get a fresh one.
#[derive(Clone, Copy)]
struct Backend {
    name: &'static str,
    fresh: FreshFn,
}

impl Backend {
    fn of(harness: &BackendHarness) -> Self {
        Backend { name: harness.name, fresh: harness.fresh }
    }

    fn named(backends: &[BackendHarness], name: &str) -> Self {
        Backend::of(backends.iter().find(|b| b.name == name).expect("backend is in the harness"))
    }
}

/// One side of a migration. An embedded store is a file the test opens only while no migration
/// process has it open (redb locks it); a server-backed store stays open in the test and is also
/// opened by the processes through its URL.
enum Side {
    Embedded { path: PathBuf },
    Remote { ctx: Ctx, url: String },
}

impl Side {
    /// A fresh, empty store of `backend`; an embedded one is `{role}.redb` in `dir`.
    async fn fresh(backend: Backend, dir: &Path, role: &str) -> Result<Side, Failed> {
        if backend.name == "embedded" {
            return Ok(Side::Embedded { path: dir.join(format!("{role}.redb")) });
        }
        let ctx = (backend.fresh)().await.map_err(|e| Failed::from(format!("{} unavailable: {e}", backend.name)))?;
        let base = ctx.url.clone().ok_or("a server-backed store has a URL")?;
        // Short settle times keep the follow phase's waits short (the emulators commit at once).
        let url = match backend.name {
            "dynamodb" => format!("{base}&settle_ms=1000&write_timeout_ms=500"),
            "firestore" => format!("{base}&settle_ms=1000"),
            _ => base,
        };
        Ok(Side::Remote { ctx, url })
    }

    fn url(&self) -> String {
        match self {
            Side::Embedded { path } => format!("embedded:{}", path.display()),
            Side::Remote { url, .. } => url.clone(),
        }
    }

    /// Opens the store in this process; drop what it returns before a migration process runs
    /// against an embedded store.
    async fn open(&self) -> Result<Arc<dyn DocumentBackend>, Failed> {
        match self {
            Side::Embedded { path } => Ok(Arc::new(EmbeddedBackend::open(path).await?)),
            Side::Remote { url, .. } => Ok(agentstore::backend::open(&url.parse()?).await?),
        }
    }

    /// Whether this store keeps numbers beyond double precision exactly.
    fn exact_numbers(&self) -> bool {
        match self {
            Side::Embedded { .. } => true,
            Side::Remote { ctx, .. } => ctx.inexact_numbers.is_none(),
        }
    }

    fn describe(&self) -> String {
        match self {
            Side::Embedded { path } => format!("embedded file {}", path.display()),
            Side::Remote { ctx, .. } => ctx.backend.describe(),
        }
    }
}

fn doc_id(user: &str, namespace: &str, key: &str) -> String {
    format!("{user}:{namespace}:{}", encode_key(key))
}

/// A well-formed document in the spec's shape, as seeded before a migration starts.
fn spec_body(user: &str, namespace: &str, key: &str, value: Value, n: usize) -> Map<String, Value> {
    object(json!({
        "userId": user, "namespace": namespace, "key": key, "value": value,
        "metadata": {"n": n, "tags": ["seed"]},
        "createdByAgent": "seeder", "lastAccessedByAgent": format!("agent-{}", n % 3),
        "accessCount": n % 7,
        "createdAt": format!("2026-02-0{}T10:00:00Z", 1 + n % 5),
        "updatedAt": format!("2026-02-0{}T11:{:02}:00Z", 1 + n % 5, n % 60),
    }))
}

/// The corpus values a store pair can hold exactly: all of them, or (when a side stores JS
/// doubles) those that survive a double.
fn corpus_values(exact_numbers: bool) -> Vec<(String, Value)> {
    crate::common::corpus::cases()
        .into_iter()
        .filter(|case| exact_numbers || survives_f64(&case.value))
        .map(|case| (case.name, case.value))
        .collect()
}

/// `keys` documents per (user, namespace), then the corpus as user `corpus`, namespace `values`.
fn seed_documents(keys: usize, exact_numbers: bool) -> Vec<(String, Map<String, Value>)> {
    let mut docs = Vec::new();
    for user in USERS {
        for namespace in NAMESPACES {
            for i in 0..keys {
                let key = format!("key-{i}");
                let value = json!({"i": i, "user": user, "list": [i, "x", null], "deep": {"f": 0.5}});
                docs.push((doc_id(user, namespace, &key), spec_body(user, namespace, &key, value, docs.len())));
            }
        }
    }
    for (name, value) in corpus_values(exact_numbers) {
        docs.push((doc_id("corpus", "values", &name), spec_body("corpus", "values", &name, value, docs.len())));
    }
    docs
}

async fn seed(backend: &dyn DocumentBackend, docs: &[(String, Map<String, Value>)]) -> TestResult {
    for chunk in docs.chunks(50) {
        let writes = chunk
            .iter()
            .map(|(id, body)| BulkWrite {
                id: id.clone(),
                body: body.clone(),
                precondition: Precondition::MustNotExist,
            })
            .collect();
        for ((id, _), result) in chunk.iter().zip(backend.bulk_write(writes).await?) {
            result.map_err(|e| format!("seeding {id}: {e}"))?;
        }
    }
    Ok(())
}

/// Every live document of a store, by id.
async fn all_documents(backend: &dyn DocumentBackend) -> Result<BTreeMap<String, Map<String, Value>>, Failed> {
    let mut token = None;
    let mut documents = BTreeMap::new();
    loop {
        let page = backend.scan(200, token.as_deref()).await?;
        documents.extend(page.items.into_iter().map(|doc| (doc.id, doc.body)));
        match page.next {
            Some(next) => token = Some(next),
            None => return Ok(documents),
        }
    }
}

/// The suite's own verdict, independent of `verify`: the target holds exactly the source's live
/// documents with exactly their bodies, and none of the ids the writers left deleted.
async fn check_same_documents(source: &Side, target: &Side, writes: &WriterSummary) -> TestResult {
    let (source_docs, target_docs) = {
        let (source, target) = (source.open().await?, target.open().await?);
        (all_documents(source.as_ref()).await?, all_documents(target.as_ref()).await?)
    };
    let mut problems = Vec::new();
    for (id, body) in &source_docs {
        match target_docs.get(id) {
            None => problems.push(format!("{id} is missing at the target")),
            Some(stored) => {
                let (expected, stored) = (Value::Object(body.clone()), Value::Object(stored.clone()));
                if !exact_eq(&expected, &stored) {
                    problems.push(format!("{id}: {}", first_difference(&expected, &stored).unwrap_or_default()));
                }
            }
        }
    }
    for id in target_docs.keys().filter(|id| !source_docs.contains_key(*id)) {
        let deleted = if writes.deleted_ids.contains(id) { " (deleted at the source)" } else { "" };
        problems.push(format!("{id} is at the target but not at the source{deleted}"));
    }
    for id in &writes.deleted_ids {
        if source_docs.contains_key(id) {
            problems.push(format!("{id}: the writer's last write deleted it, but the source has it"));
        }
    }
    let shown: Vec<&String> = problems.iter().take(10).collect();
    check(problems.is_empty(), || format!("{} differences, first: {shown:#?}", problems.len()))?;
    println!(
        "  same {} documents at both sides; the writers made {}",
        source_docs.len(),
        serde_json::to_string(&WriterSummary { deleted_ids: BTreeSet::new(), ..writes.clone() })?
    );
    Ok(())
}

/// What a writer did; a trial checks it really mixed every kind of write.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct WriterSummary {
    creates: u64,
    updates: u64,
    recreates: u64,
    deletes: u64,
    metadata_changes: u64,
    corpus_values: u64,
    /// Writes the server did not answer in time (the test servers share two cores with the
    /// migrations): their outcome is unknown to the writer, which goes on with the next write.
    unanswered: u64,
    /// The first few of those errors, to show what the server said.
    unanswered_errors: Vec<String>,
    /// Ids whose last write by this writer was a delete.
    deleted_ids: BTreeSet<String>,
}

impl WriterSummary {
    fn check_mixed(&self) -> TestResult {
        check(self.creates > 0 && self.updates > 0 && self.deletes > 0 && self.recreates > 0, || {
            format!("the writer did not mix creates, updates, deletes and re-creates: {self:?}")
        })?;
        check(self.metadata_changes > 0 && self.corpus_values > 0, || {
            format!("the writer changed no metadata or wrote no corpus value: {self:?}")
        })
    }

    fn absorb(&mut self, other: WriterSummary) {
        self.creates += other.creates;
        self.updates += other.updates;
        self.recreates += other.recreates;
        self.deletes += other.deletes;
        self.metadata_changes += other.metadata_changes;
        self.corpus_values += other.corpus_values;
        self.unanswered += other.unanswered;
        self.unanswered_errors.extend(other.unanswered_errors);
        self.deleted_ids = other.deleted_ids;
    }
}

/// A seeded xorshift generator; seeds are printed so a failure can be replayed.
struct Random(u64);

impl Random {
    fn new(seed: u64) -> Self {
        Random(seed | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn time_seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(7)
}

/// Writes through the facade, one random write at a time: sets (creating, updating or re-creating
/// a document, sometimes with a corpus value, sometimes merging new metadata) and deletes, over the
/// seeded ids, new ids and the corpus documents.
struct LiveWriter {
    random: Random,
    step: u64,
    corpus: Vec<(String, Value)>,
    keys: usize,
    summary: WriterSummary,
    /// The document of the latest step.
    last: (String, String, String),
}

impl LiveWriter {
    fn new(seed: u64, keys: usize, exact_numbers: bool) -> Self {
        let corpus = corpus_values(exact_numbers)
            .into_iter()
            .filter(|(_, value)| value.to_string().len() <= WRITER_VALUE_MAX_BYTES)
            .collect();
        LiveWriter {
            random: Random::new(seed),
            step: 0,
            corpus,
            keys,
            summary: WriterSummary::default(),
            last: Default::default(),
        }
    }

    /// Which document to write: one deleted earlier (to re-create it) a fifth of the time, else a
    /// corpus document or a (user, namespace, key) with keys a little beyond the seeded ones.
    fn pick(&mut self) -> (String, String, String) {
        if self.random.below(5) == 0 && !self.summary.deleted_ids.is_empty() {
            let at = self.random.below(self.summary.deleted_ids.len());
            let id = self.summary.deleted_ids.iter().nth(at).cloned().unwrap_or_default();
            let mut parts = id.splitn(2, ':');
            let user = parts.next().unwrap_or_default().to_owned();
            let rest = parts.next().unwrap_or_default();
            let (namespace, encoded) = rest.rsplit_once(':').unwrap_or_default();
            let key = agentstore::model::id::decode_key(encoded).unwrap_or_default();
            return (user, namespace.to_owned(), key);
        }
        if self.random.below(6) == 0 {
            let at = self.random.below(self.corpus.len());
            return ("corpus".into(), "values".into(), self.corpus[at].0.clone());
        }
        let user = USERS[self.random.below(USERS.len())];
        let namespace = NAMESPACES[self.random.below(NAMESPACES.len())];
        let key = format!("key-{}", self.random.below(self.keys + self.keys / 4 + 2));
        (user.to_owned(), namespace.to_owned(), key)
    }

    async fn step(&mut self, store: &DataStore, tag: &str) -> agentstore::Result<()> {
        self.step += 1;
        let (user, namespace, key) = self.pick();
        self.last = (user.clone(), namespace.clone(), key.clone());
        let id = doc_id(&user, &namespace, &key);
        if self.random.below(10) < 3 && !self.summary.deleted_ids.contains(&id) {
            if store.delete(&user, &namespace, &key).await? {
                self.summary.deletes += 1;
                self.summary.deleted_ids.insert(id);
            }
            return Ok(());
        }
        let value = if self.random.below(3) == 0 {
            self.summary.corpus_values += 1;
            self.corpus[self.random.below(self.corpus.len())].1.clone()
        } else {
            json!({"writer": tag, "step": self.step, "text": "é 日本 🚀", "n": [1.5, -0.0, 1e300]})
        };
        let metadata = (self.random.below(3) == 0).then(|| json!({"by": tag, "step": self.step}));
        self.summary.metadata_changes += u64::from(metadata.is_some());
        let stored = store.set(&user, &namespace, &key, value, metadata, Some(tag)).await?;
        if self.summary.deleted_ids.remove(&id) {
            self.summary.recreates += 1;
        } else if stored.body.get("createdAt") == stored.body.get("updatedAt") {
            self.summary.creates += 1;
        } else {
            self.summary.updates += 1;
        }
        Ok(())
    }

    /// Writes until `stop` says so, a few milliseconds apart.
    ///
    /// A write the server did not answer in time (unavailable, outcome unknown) is counted and
    /// its document forgotten from `deleted_ids`, since the writer no longer knows its state;
    /// the comparison of source and target does not depend on it. More than a tenth of the writes
    /// unanswered (beyond a few) is a failure: then the writer tested nothing.
    async fn run(&mut self, store: &DataStore, tag: &str, stop: impl Fn() -> bool) -> agentstore::Result<()> {
        while !stop() {
            if let Err(err) = self.step(store, tag).await {
                if !matches!(err.kind(), ErrorKind::Unavailable | ErrorKind::OutcomeUnknown) {
                    return Err(err);
                }
                self.summary.unanswered += 1;
                if self.summary.unanswered_errors.len() < 3 {
                    self.summary.unanswered_errors.push(err.to_string());
                }
                if self.summary.unanswered > 5 && self.summary.unanswered * 10 > self.step {
                    return Err(err);
                }
                let (user, namespace, key) = self.last.clone();
                self.summary.deleted_ids.remove(&doc_id(&user, &namespace, &key));
            }
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
        Ok(())
    }
}

/// The writer as a separate process: this test binary started again with [`WRITER_ENV`] set. It
/// writes until its stop file exists, then prints its [`WriterSummary`] as one JSON line.
mod writer_process {
    use super::*;

    #[derive(Serialize, Deserialize)]
    pub struct WriterSpec {
        pub url: String,
        pub stop_file: PathBuf,
        pub seed: u64,
        pub keys: usize,
        pub exact_numbers: bool,
    }

    /// Runs as a writer process when the environment says so; `true` when it did.
    pub fn run_if_writer() -> bool {
        let Ok(spec) = std::env::var(WRITER_ENV) else { return false };
        let spec: WriterSpec = serde_json::from_str(&spec).expect("writer spec is JSON");
        let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
        let summary = runtime.block_on(async move {
            let backend =
                agentstore::backend::open(&spec.url.parse().expect("backend URL")).await.expect("open backend");
            let store = DataStore::open(backend, Default::default()).await.expect("open store");
            let mut writer = LiveWriter::new(spec.seed, spec.keys, spec.exact_numbers);
            let stop_file = spec.stop_file.clone();
            if let Err(err) = writer.run(&store, "writer-process", || stop_file.exists()).await {
                eprintln!("the writer failed: {err}");
                std::process::exit(1);
            }
            writer.summary
        });
        println!("{}", serde_json::to_string(&summary).expect("summary"));
        true
    }

    /// Where the writer process's stderr goes.
    const WRITER_LOG: &str = "writer-process.log";

    pub struct WriterProcess {
        child: Child,
        stop_file: PathBuf,
        log: PathBuf,
    }

    /// Starts a writer process against `source`.
    /// `exact_numbers`: whether both sides keep numbers beyond double precision (a JS-double target
    /// would store the writer's big integers altered, which the migration rightly sees as a conflict).
    pub fn start(
        source: &Side,
        dir: &Path,
        seed: u64,
        keys: usize,
        exact_numbers: bool,
    ) -> Result<WriterProcess, Failed> {
        let stop_file = dir.join("writer.stop");
        let spec = WriterSpec { url: source.url(), stop_file: stop_file.clone(), seed, keys, exact_numbers };
        let child = Command::new(std::env::current_exe()?)
            .env(WRITER_ENV, serde_json::to_string(&spec)?)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(dir.join(WRITER_LOG))?)
            .spawn()?;
        Ok(WriterProcess { child, stop_file, log: dir.join(WRITER_LOG) })
    }

    impl WriterProcess {
        /// Tells the writer to stop, waits for it and returns what it did.
        pub fn stop(self) -> Result<WriterSummary, Failed> {
            std::fs::write(&self.stop_file, b"stop")?;
            let output = self.child.wait_with_output()?;
            check(output.status.success(), || {
                let stderr = std::fs::read_to_string(&self.log).unwrap_or_default();
                format!("the writer process failed ({}): {}", output.status, stderr.trim())
            })?;
            let text = String::from_utf8_lossy(&output.stdout);
            let line = text.lines().last().ok_or("the writer printed no summary")?;
            Ok(serde_json::from_str(line)?)
        }
    }
}

fn stdout_json(output: &Output) -> Result<Value, Failed> {
    serde_json::from_slice(&output.stdout).map_err(|e| {
        format!(
            "stdout is not JSON ({e}): {}; stderr: {}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
        .into()
    })
}

/// `migrate --follow` from `source` to `target` with its checkpoint in `dir`, plus `extra`.
fn follow_args(source: &Side, target: &Side, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = ["migrate", "--from", &source.url(), "--to", &target.url(), "--follow"]
        .into_iter()
        .map(str::to_owned)
        .collect();
    args.extend(["--checkpoint", "cp.json", "--batch-size", "50", "--progress", "log"].map(str::to_owned));
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    args
}

/// Starts `migrate --follow`; its progress log goes to `{log}.log` in `dir`.
fn start_follow(dir: &Path, source: &Side, target: &Side, log: &str) -> Result<Child, Failed> {
    Ok(agentstore(dir)
        .args(follow_args(source, target, &[]))
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.join(format!("{log}.log")))?)
        .spawn()?)
}

/// Runs the migration to the end (`--until-caught-up`) and checks it ends caught up, exit 0.
fn run_until_caught_up(dir: &Path, source: &Side, target: &Side, extra: &[&str]) -> Result<Value, Failed> {
    let mut args = vec!["--until-caught-up"];
    args.extend(extra);
    let output = agentstore(dir).args(follow_args(source, target, &args)).output()?;
    let report = stdout_json(&output)?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    check(output.status.code() == Some(0), || {
        format!("--until-caught-up: exit {:?}: {report}; {stderr}", output.status.code())
    })?;
    check_caught_up(&report)?;
    Ok(report)
}

/// A caught-up report: no lag left, the read-back passed.
fn check_caught_up(report: &Value) -> TestResult {
    check(report["status"] == "caught_up", || format!("the migration did not end caught up: {report}"))?;
    check(report["follow"]["lag_changes"] == 0, || format!("caught up with a lag: {}", report["follow"]))?;
    check(report["verification"]["passed"] == true, || format!("read-back: {}", report["verification"]))
}

/// `agentstore verify` must call the stores identical (exit 0).
fn verify_identical(dir: &Path, source: &Side, target: &Side) -> TestResult {
    let output = agentstore(dir)
        .args(["verify", "--from", &source.url(), "--to", &target.url(), "--progress", "none"])
        .output()?;
    let verdict = stdout_json(&output)?;
    check(output.status.code() == Some(0) && verdict["identical"] == true, || {
        format!("verify: exit {:?}: {verdict}", output.status.code())
    })
}

/// Asks a migration process to stop (SIGTERM) and returns its output.
fn terminate(child: Child) -> Result<Output, Failed> {
    let status = Command::new("kill").args(["-TERM", &child.id().to_string()]).status()?;
    check(status.success(), || "kill -TERM failed".into())?;
    Ok(child.wait_with_output()?)
}

/// A migration stopped by SIGTERM in its follow phase: exit 0, status "stopped".
fn expect_stopped(dir: &Path, output: Output) -> TestResult {
    let stdout = String::from_utf8_lossy(&output.stdout);
    check(output.status.code() == Some(0), || {
        format!("SIGTERM in the follow phase: {}, stdout {stdout}; {}", output.status, log_tail(dir))
    })?;
    let report = stdout_json(&output)?;
    check(report["status"] == "stopped", || format!("SIGTERM in the follow phase: report {report}"))
}

/// The checkpoint's JSON, if there is one yet.
fn read_checkpoint(dir: &Path) -> Result<Option<Value>, Failed> {
    match std::fs::read(dir.join("cp.json")) {
        Ok(bytes) => Ok(Some(serde_json::from_slice(&bytes)?)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The follow phase's saved change position, once the copy phase is over.
fn follow_position(checkpoint: &Value) -> Option<String> {
    let copy_done = checkpoint["finished"] == true || checkpoint["position"] == "End";
    let position = checkpoint["follow"]["position"].as_str().filter(|p| !p.is_empty());
    position.filter(|_| copy_done).map(str::to_owned)
}

/// Waits until the migration in `dir` has finished its copy phase.
fn wait_for_follow_phase(dir: &Path, child: &mut Child) -> Result<String, Failed> {
    let started = Instant::now();
    loop {
        if let Some(position) = read_checkpoint(dir)?.as_ref().and_then(follow_position) {
            return Ok(position);
        }
        if let Some(status) = child.try_wait()? {
            return Err(format!("the migration ended ({status}) before its follow phase: {}", log_tail(dir)).into());
        }
        check(started.elapsed() < Duration::from_secs(120), || {
            format!("no follow position in the checkpoint after 2 minutes: {}", log_tail(dir))
        })?;
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// How many documents the checkpoint says the copy has read.
fn copied(dir: &Path) -> Result<u64, Failed> {
    Ok(read_checkpoint(dir)?.map_or(0, |checkpoint| checkpoint["ledger"]["counts"]["read"].as_u64().unwrap_or(0)))
}

/// Waits until the migration in `dir` has checkpointed at least one more batch of its copy.
fn wait_for_copy_progress(dir: &Path, child: &mut Child) -> TestResult {
    let before = copied(dir)?;
    let started = Instant::now();
    while copied(dir)? <= before {
        if let Some(status) = child.try_wait()? {
            return Err(format!("the migration ended ({status}) while copying: {}", log_tail(dir)).into());
        }
        check(started.elapsed() < Duration::from_secs(60), || {
            format!("the copy made no progress in a minute: {}", log_tail(dir))
        })?;
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

/// For the ids a conflict message names: the document at the source and at the target, the
/// fingerprint of the target's content and the fingerprints the run's journal holds, so a
/// conflict after a kill can be told from a journal that missed one of the migration's writes.
async fn conflict_evidence(dir: &Path, source: &Side, target: &Side, logs: &str) -> String {
    let Ok(pattern) = regex::Regex::new(r#""([^"\s]+:[^"\s]*:[A-Za-z0-9_=-]*)""#) else { return String::new() };
    let ids: BTreeSet<String> = pattern.captures_iter(logs).map(|c| c[1].to_owned()).collect();
    if ids.is_empty() {
        return String::new();
    }
    let mut evidence = String::from("\n--- the documents the conflict names:");
    let journal =
        agentstore::migrate::journal::Journal::open(&agentstore::migrate::journal::path_for(&dir.join("cp.json")));
    let mut sides = Vec::new();
    for (side, name) in [(source, "source"), (target, "target")] {
        sides.push((name, side.open().await.map_err(|e| format!("{e:?}"))));
    }
    for id in ids {
        for (name, backend) in &sides {
            let doc = match backend {
                Ok(backend) => backend.get(&id).await.map_err(|e| e.to_string()),
                Err(e) => Err(e.clone()),
            };
            let doc = doc.map(|d| {
                d.map(|d| {
                    let hash = agentstore::migrate::canonical::content_hash(&d.id, &d.body);
                    format!(
                        "rev {} fingerprint {} body {}",
                        d.rev.as_str(),
                        hex::encode(&hash[..16]),
                        Value::Object(d.body)
                    )
                })
            });
            evidence.push_str(&format!("\n{id} at the {name}: {doc:?}"));
        }
        if let Ok(journal) = &journal {
            let prints = journal
                .lookup(vec![id.clone()])
                .await
                .map(|p| p.into_iter().flatten().flatten().map(hex::encode).collect::<Vec<_>>());
            evidence.push_str(&format!("\n{id} in the journal: {prints:?}"));
        }
    }
    evidence
}

fn log_tail(dir: &Path) -> String {
    let mut tails = String::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "log") {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let start = text.len().saturating_sub(1500);
            let start = (start..text.len()).find(|i| text.is_char_boundary(*i)).unwrap_or(text.len());
            tails.push_str(&format!("\n--- {}:\n{}", path.display(), &text[start..]));
        }
    }
    tails
}

/// Every document read lands in exactly one outcome.
fn counts_add_up(counts: &Value, outcomes: &[&str]) -> TestResult {
    let sum: u64 = outcomes.iter().map(|k| counts[k].as_u64().unwrap_or(0)).sum();
    check(counts["read"].as_u64() == Some(sum), || format!("read != sum of {outcomes:?}: {counts}"))?;
    check(counts["failed"] == 0 && counts["refused"] == 0 && counts["conflicts"] == 0, || {
        format!("documents failed, were refused or conflicted: {counts}")
    })
}

const COPY_OUTCOMES: [&str; 11] = [
    "written",
    "already_present",
    "overwritten",
    "conflicts_skipped",
    "conflicts",
    "refused",
    "failed",
    "foreign",
    "malformed",
    "filtered_out",
    "unreadable",
];

/// The report's copy and follow counts each add up.
fn check_report_counts(report: &Value) -> TestResult {
    counts_add_up(&report["counts"], &COPY_OUTCOMES)?;
    let mut follow = COPY_OUTCOMES.to_vec();
    follow.push("deleted");
    counts_add_up(&report["follow"]["counts"], &follow)
}
