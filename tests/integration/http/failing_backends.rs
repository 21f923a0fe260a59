//! Backends that fail or are slow: 503 with Retry-After when unavailable, 504 past the request
//! timeout, 409 when writes keep conflicting, and writes at, queued past or conflicting past
//! the deadline.

use super::*;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// Every call but the startup index check fails as `Unavailable`.
    Unavailable,
    /// Every document exists, and every write to it conflicts.
    Contended,
    /// As `Contended`, but every read takes 3 s.
    Slow,
}

/// A backend that fails on purpose, to reach the 409 and 503 answers.
struct FaultyBackend(Fault);

impl FaultyBackend {
    fn fail<T>(&self) -> agentstore::Result<T> {
        Err(match self.0 {
            Fault::Unavailable => Error::new(ErrorKind::Unavailable, "backend down for the test"),
            Fault::Contended | Fault::Slow => Error::conflict("another writer got there first (test)"),
        })
    }
}

#[async_trait]
impl DocumentBackend for FaultyBackend {
    fn describe(&self) -> String {
        "faulty test backend".into()
    }

    async fn get(&self, id: &str) -> agentstore::Result<Option<StoredDocument>> {
        if self.0 == Fault::Unavailable {
            return self.fail();
        }
        if self.0 == Fault::Slow {
            tokio::time::sleep(Duration::from_secs(3)).await;
        }
        let parsed = DocumentId::parse(id)?;
        let mut body = Map::new();
        body.insert("userId".into(), parsed.user_id().into());
        body.insert("namespace".into(), parsed.namespace().into());
        body.insert("key".into(), parsed.key().into());
        body.insert("value".into(), json!(0));
        body.insert("accessCount".into(), json!(1));
        Ok(Some(StoredDocument { id: id.to_owned(), rev: Revision("1".into()), body }))
    }

    async fn put(&self, _: &str, _: &Map<String, Value>, _: Precondition) -> agentstore::Result<Revision> {
        self.fail()
    }

    async fn delete(&self, _: &str, _: &Revision) -> agentstore::Result<Revision> {
        self.fail()
    }

    async fn put_replicated(&self, _: &str, _: &ReplicatedRevision) -> agentstore::Result<ReplicatedOutcome> {
        self.fail()
    }

    async fn query(&self, _: &Query, _: usize, _: Option<&str>) -> agentstore::Result<Page<StoredDocument>> {
        match self.0 {
            Fault::Unavailable => self.fail(),
            Fault::Contended | Fault::Slow => Ok(Page { items: Vec::new(), next: None }),
        }
    }

    async fn ensure_standard_indexes(&self) -> agentstore::Result<()> {
        Ok(())
    }

    async fn ensure_namespace_indexed(&self, _: &str) -> agentstore::Result<()> {
        match self.0 {
            Fault::Unavailable => self.fail(),
            Fault::Contended | Fault::Slow => Ok(()),
        }
    }

    async fn bulk_write(&self, _: Vec<BulkWrite>) -> agentstore::Result<Vec<agentstore::Result<Revision>>> {
        self.fail()
    }

    async fn scan(&self, _: usize, _: Option<&str>) -> agentstore::Result<Page<StoredDocument>> {
        self.fail()
    }

    async fn health(&self) -> agentstore::Result<()> {
        match self.0 {
            Fault::Unavailable => self.fail(),
            Fault::Contended | Fault::Slow => Ok(()),
        }
    }

    // The document model fails like every other call.
    async fn revisions(&self, _: &str) -> agentstore::Result<Option<RevisionInfo>> {
        self.fail()
    }

    async fn get_deleted(&self, _: &str) -> agentstore::Result<Option<StoredDocument>> {
        self.fail()
    }

    async fn changes(&self, _: Option<&str>, _: usize) -> agentstore::Result<ChangesPage> {
        self.fail()
    }

    async fn change_position(&self) -> agentstore::Result<String> {
        self.fail()
    }

    fn change_feed_delay(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }

    async fn all_docs(&self, _: &IdRange, _: usize, _: Option<&str>) -> agentstore::Result<Page<StoredDocument>> {
        self.fail()
    }

    async fn erase_prefix(&self, _: &str) -> agentstore::Result<u64> {
        self.fail()
    }

    async fn erase_id(&self, _: &str, _: &agentstore::backend::EraseOptions) -> agentstore::Result<bool> {
        self.fail()
    }

    async fn get_local(&self, _: &str) -> agentstore::Result<Option<StoredDocument>> {
        self.fail()
    }

    async fn put_local(&self, _: &str, _: &Map<String, Value>, _: Precondition) -> agentstore::Result<Revision> {
        self.fail()
    }

    async fn delete_local(&self, _: &str, _: &Revision) -> agentstore::Result<()> {
        self.fail()
    }

    async fn local_docs(&self, _: &IdRange, _: usize, _: Option<&str>) -> agentstore::Result<Page<StoredDocument>> {
        self.fail()
    }

    async fn layout(&self) -> agentstore::Result<LayoutState> {
        self.fail()
    }

    async fn upgrade_page(&self, _: Option<&str>, _: usize) -> agentstore::Result<UpgradePage> {
        self.fail()
    }

    async fn finish_upgrade(&self) -> agentstore::Result<()> {
        self.fail()
    }
}

async fn faulty_server(fault: Fault) -> Server {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut settings = settings(&dir);
    settings.max_conflict_retries = 2;
    settings.request_timeout_secs = 1;
    Server::on_backend(Arc::new(FaultyBackend(fault)), &settings, dir).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unavailable_backends_are_503_with_retry_after() {
    let server = faulty_server(Fault::Unavailable).await;
    let ready = server.get("/readyz").await;
    assert_eq!(ready.header("retry-after"), Some("1"));
    let reason = ready.expect_error(StatusCode::SERVICE_UNAVAILABLE, "unavailable");
    assert_generic_reason(&ready, &reason);
    // Liveness does not depend on the backend.
    assert_eq!(server.get("/healthz").await.expect_json(StatusCode::OK), json!({ "status": "ok" }));
    for (method, template) in v1_routes() {
        let reply = server.send(route_request(&server, &method, template, "u")).await;
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "{method} {template}: {}", reply.describe());
        assert_eq!(reply.header("retry-after"), Some("1"), "{method} {template}");
        if method != Method::HEAD {
            let reason = reply.expect_error(StatusCode::SERVICE_UNAVAILABLE, "unavailable");
            assert_generic_reason(&reply, &reason);
        }
    }
    let metrics = server.get("/metrics").await.text();
    assert!(metrics.contains("outcome=\"unavailable\""), "{metrics}");
    server.stop().await;
}

/// A 5xx reason tells nothing of the backend (the test backend's message stays in the log) and
/// carries the request id the response echoes.
fn assert_generic_reason(reply: &Reply, reason: &str) {
    assert!(!reason.contains("test"), "internal detail in {}", reply.describe());
    let id = reply.header("x-request-id").unwrap_or_else(|| panic!("no request id: {}", reply.describe()));
    assert!(reason.contains(&format!("request id {id}")), "{}", reply.describe());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_past_the_timeout_are_504_json() {
    let server = faulty_server(Fault::Slow).await;
    let path = doc_path("u", "ns", "k");
    let started = Instant::now();
    let reply = server.get(&path).await;
    let reason = reply.expect_error(StatusCode::GATEWAY_TIMEOUT, "timeout");
    assert_generic_reason(&reply, &reason);
    assert!(started.elapsed() < Duration::from_millis(2500), "answered after {:?}", started.elapsed());
    // Every other error the framework could produce is JSON too: 404 fallback, 405.
    server.get("/nowhere").await.expect_error(StatusCode::NOT_FOUND, "not_found");
    server.call(Method::POST, &path).await.expect_error(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_that_keep_conflicting_are_409() {
    let server = faulty_server(Fault::Contended).await;
    let path = doc_path("u", "ns", "k");
    let reason = server.put(&path, &json!({ "value": 1 })).await.expect_error(StatusCode::CONFLICT, "conflict");
    assert!(reason.contains("retries"), "{reason}");
    server.get(&path).await.expect_error(StatusCode::CONFLICT, "conflict");
    server.call(Method::DELETE, &path).await.expect_error(StatusCode::CONFLICT, "conflict");
    // Under the caller's own precondition a conflict is the caller's: 412, tried once.
    let put = server.req(Method::PUT, &path).header("If-Match", "\"1\"").json(&json!({ "value": 1 }));
    server.send(put).await.expect_error(StatusCode::PRECONDITION_FAILED, "precondition_failed");
    let delete = server.req(Method::DELETE, &path).header("If-Match", "*");
    server.send(delete).await.expect_error(StatusCode::PRECONDITION_FAILED, "precondition_failed");
    // HEAD only reads.
    assert_eq!(server.call(Method::HEAD, &path).await.status, StatusCode::OK);
    server.stop().await;
}

// ---- deadlines ----

/// A real (embedded) store whose writes take `put_delay`: long enough to be in flight when a
/// request's deadline passes.
struct SlowWrites {
    inner: Arc<dyn DocumentBackend>,
    put_delay: Duration,
}

#[async_trait]
impl Layered for SlowWrites {
    fn inner(&self) -> &dyn DocumentBackend {
        self.inner.as_ref()
    }

    fn describe(&self) -> String {
        format!("{} with slow writes", self.inner.describe())
    }

    async fn put(
        &self,
        id: &str,
        body: &Map<String, Value>,
        precondition: Precondition,
    ) -> agentstore::Result<Revision> {
        tokio::time::sleep(self.put_delay).await;
        self.inner.put(id, body, precondition).await
    }
}

/// A server with a 1 s request timeout over an embedded store whose writes take 1.5 s.
async fn slow_write_server() -> Server {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut settings = settings(&dir);
    settings.request_timeout_secs = 1;
    let url = settings.backend.parse().expect("backend url");
    let inner = agentstore::backend::open(&url).await.expect("open embedded store");
    let backend = Arc::new(SlowWrites { inner, put_delay: Duration::from_millis(1500) });
    Server::on_backend(backend, &settings, dir).await
}

/// A write still in flight when the request's time is up is awaited and its outcome answered:
/// before, the request was cut with an empty 408 while the write went on to be applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_in_flight_at_the_deadline_reports_its_outcome() {
    let server = slow_write_server().await;
    let path = doc_path("u", "ns", "slow");
    let stored = server.put(&path, &json!({ "value": 7, "metadata": { "a": 1 } })).await.document();
    assert_eq!(stored["value"], json!(7));
    let again = server.get(&path).await.document();
    assert_eq!(again["metadata"], json!({ "a": 1 }));
    server.stop().await;
}

/// A write still waiting for its turn on a hot key when the deadline passes is answered 503 with
/// Retry-After, and was not applied, so retrying it cannot count twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_queued_past_the_deadline_is_503_and_not_applied() {
    let server = Arc::new(slow_write_server().await);
    let path = doc_path("u", "ns", "hot");
    let first = {
        let (server, path) = (Arc::clone(&server), path.clone());
        tokio::spawn(async move { server.put(&path, &json!({ "value": 1, "metadata": { "first": 1 } })).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let second = server.put(&path, &json!({ "value": 2, "metadata": { "second": 2 } })).await;
    second.expect_error(StatusCode::SERVICE_UNAVAILABLE, "deadline_exceeded");
    assert!(second.header("retry-after").is_some(), "{}", second.describe());
    first.await.expect("first writer").document();
    let stored = server.get(&path).await.document();
    assert_eq!(stored["metadata"], json!({ "first": 1 }), "the refused write left no trace");
    assert_eq!(stored["value"], json!(1));
    Arc::into_inner(server).expect("only owner").stop().await;
}

/// Conflicts that outlast the request's time end in 503 "not applied, retry", not in a 409 after
/// 100 retries long after the client gave up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_conflicting_past_the_deadline_are_503() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut settings = settings(&dir);
    settings.request_timeout_secs = 1;
    let server = Server::on_backend(Arc::new(FaultyBackend(Fault::Contended)), &settings, dir).await;
    let reply = server.put(&doc_path("u", "ns", "k"), &json!({ "value": 1 })).await;
    reply.expect_error(StatusCode::SERVICE_UNAVAILABLE, "deadline_exceeded");
    server.stop().await;
}
