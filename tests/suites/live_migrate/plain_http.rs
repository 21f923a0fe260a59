//! A CouchDB source written by plain HTTP as the existing system writes it, while the migration
//! follows.

use super::*;

/// The existing system's way of writing: plain CouchDB HTTP, documents in the spec's shape.
struct PlainHttpWriter {
    client: reqwest::Client,
    database: reqwest::Url,
    user: String,
    password: String,
    /// Live documents this writer knows, with their `_rev`.
    live: BTreeMap<String, (String, Map<String, Value>)>,
    random: Random,
    summary: WriterSummary,
}

fn now_iso() -> String {
    chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ").to_string()
}

impl PlainHttpWriter {
    /// From a backend URL `couchdb+http://user:password@host:port/db?...`.
    fn new(backend_url: &str, seed: u64) -> Result<Self, Failed> {
        let http = backend_url.trim_start_matches("couchdb+");
        let mut database = reqwest::Url::parse(http.split('?').next().unwrap_or(http))?;
        let (user, password) = (database.username().to_owned(), database.password().unwrap_or_default().to_owned());
        database.set_username("").map_err(|()| "url")?;
        database.set_password(None).map_err(|()| "url")?;
        Ok(PlainHttpWriter {
            client: reqwest::Client::new(),
            database,
            user,
            password,
            live: BTreeMap::new(),
            random: Random::new(seed),
            summary: WriterSummary::default(),
        })
    }

    fn document_url(&self, id: &str) -> Result<reqwest::Url, Failed> {
        let mut url = self.database.clone();
        url.path_segments_mut().map_err(|()| "database url")?.push(id);
        Ok(url)
    }

    async fn send(&self, request: reqwest::RequestBuilder, what: &str) -> Result<Value, Failed> {
        let response = request.basic_auth(&self.user, Some(&self.password)).send().await?;
        let status = response.status();
        let body: Value = response.json().await?;
        check(status.is_success(), || format!("{what}: {status} {body}"))?;
        Ok(body)
    }

    /// PUT the document with its `_id` and (when it exists) `_rev`, as the existing system does.
    async fn put(&mut self, id: &str, body: Map<String, Value>) -> TestResult {
        let mut sent = Map::new();
        sent.insert("_id".into(), json!(id));
        if let Some((rev, _)) = self.live.get(id) {
            sent.insert("_rev".into(), json!(rev));
        }
        sent.extend(body.clone());
        let answer = self.send(self.client.put(self.document_url(id)?).json(&sent), &format!("PUT {id}")).await?;
        let rev = answer["rev"].as_str().ok_or_else(|| format!("PUT {id}: no rev in {answer}"))?.to_owned();
        self.live.insert(id.to_owned(), (rev, body));
        Ok(())
    }

    async fn delete(&mut self, id: &str) -> TestResult {
        let Some((rev, _)) = self.live.remove(id) else { return Ok(()) };
        let mut url = self.document_url(id)?;
        url.query_pairs_mut().append_pair("rev", &rev);
        self.send(self.client.delete(url), &format!("DELETE {id}")).await?;
        self.summary.deletes += 1;
        self.summary.deleted_ids.insert(id.to_owned());
        Ok(())
    }

    /// One write: a new document, an update (value replaced, metadata merged, access counted,
    /// `updatedAt` moved on) or a delete.
    async fn step(&mut self, step: usize) -> TestResult {
        let (user, namespace) = (USERS[self.random.below(3)], NAMESPACES[self.random.below(3)]);
        let key = format!("legacy-{}", self.random.below(30));
        let id = doc_id(user, namespace, &key);
        let value = json!({"step": step, "items": ["a", "b", step], "score": 95});
        match self.live.get(&id).cloned() {
            Some(_) if self.random.below(10) < 3 => self.delete(&id).await,
            Some((_, mut body)) => {
                body.insert("value".into(), value);
                let metadata = body.entry("metadata").or_insert_with(|| json!({}));
                if let Value::Object(metadata) = metadata {
                    metadata.insert("version".into(), json!(format!("{step}.0")));
                }
                let count = body.get("accessCount").and_then(Value::as_u64).unwrap_or(0);
                body.insert("accessCount".into(), json!(count + 1));
                body.insert("lastAccessedByAgent".into(), json!("legacy-agent"));
                body.insert("updatedAt".into(), json!(now_iso()));
                body.insert("lastAccessedAt".into(), json!(now_iso()));
                self.summary.updates += 1;
                self.summary.metadata_changes += 1;
                self.put(&id, body).await
            }
            None => {
                let now = now_iso();
                let body = object(json!({
                    "userId": user, "namespace": namespace, "key": key, "value": value,
                    "metadata": {"version": "1.0", "source": "legacy-system"},
                    "createdByAgent": "legacy-agent", "lastAccessedByAgent": "legacy-agent", "accessCount": 0,
                    "createdAt": now, "updatedAt": now,
                }));
                if self.summary.deleted_ids.remove(&id) {
                    self.summary.recreates += 1;
                } else {
                    self.summary.creates += 1;
                }
                self.put(&id, body).await
            }
        }
    }
}

pub(super) async fn plain_http_writer(couchdb: Backend) -> TestResult {
    let dir = tempfile::tempdir()?;
    let dir = dir.path();
    let source = Side::fresh(couchdb, dir, "source").await?;
    let target = Side::Embedded { path: dir.join("target.redb") };
    let seed_value = time_seed();
    println!("plain HTTP writes to {} -> {}, seed {seed_value}", source.describe(), target.describe());
    let mut writer = PlainHttpWriter::new(&source.url(), seed_value)?;
    for step in 0..150 {
        writer.step(step).await?;
    }
    let mut migration = start_follow(dir, &source, &target, "follow")?;
    let until = Instant::now() + WRITE_FOR;
    let mut step = 150;
    while Instant::now() < until {
        writer.step(step).await?;
        step += 1;
    }
    wait_for_follow_phase(dir, &mut migration)?;
    // Some more writes while certainly following, then stop.
    for _ in 0..60 {
        writer.step(step).await?;
        step += 1;
    }
    expect_stopped(dir, terminate(migration)?)?;
    check(writer.summary.creates > 0 && writer.summary.updates > 0 && writer.summary.deletes > 0, || {
        format!("the plain HTTP writer did not mix its writes: {:?}", writer.summary)
    })?;
    let report = run_until_caught_up(dir, &source, &target, &[])?;
    check_report_counts(&report)?;
    verify_identical(dir, &source, &target)?;
    check_same_documents(&source, &target, &writer.summary).await?;
    // And the writer's own record of what is live agrees with the target.
    let target_docs = all_documents(target.open().await?.as_ref()).await?;
    for (id, (_, body)) in &writer.live {
        let stored = target_docs.get(id).ok_or_else(|| format!("{id} missing at the target"))?;
        check(exact_eq(&Value::Object(body.clone()), &Value::Object(stored.clone())), || format!("{id} differs"))?;
    }
    Ok(())
}
