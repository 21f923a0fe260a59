//! Prometheus metrics: request counts and latencies per route and status, and backend call
//! latencies per operation (through [`MeteredBackend`], a decorator around any backend).

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use prometheus::{Encoder, HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry, TextEncoder};
use serde_json::{Map, Value};

use crate::backend::rev_tree::RevTree;
use crate::backend::{
    BulkWrite, BulkWriteText, ChangesPage, DesignRequest, DesignResponse, DocumentBackend, DocumentText, EraseOptions,
    IdRange, LayoutState, Page, Precondition, Query, RecordWithLocal, ReplicatedLeaf, ReplicatedOutcome,
    ReplicatedRevision, Revision, RevisionInfo, StoredDocument, StoredText, UpgradePage,
};
use crate::error::Result;

const LATENCY_BUCKETS: &[f64] = &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// One registry per server, so servers in one process (tests) do not mix their numbers.
pub struct Metrics {
    registry: Registry,
    requests: IntCounterVec,
    request_seconds: HistogramVec,
    backend_seconds: HistogramVec,
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new_custom(Some("agentstore".into()), None).expect("valid registry prefix");
        let requests = IntCounterVec::new(
            Opts::new("http_requests_total", "HTTP requests answered"),
            &["route", "method", "status"],
        )
        .expect("valid metric");
        let request_seconds = HistogramVec::new(
            HistogramOpts::new("http_request_duration_seconds", "HTTP request latency")
                .buckets(LATENCY_BUCKETS.to_vec()),
            &["route", "method", "status"],
        )
        .expect("valid metric");
        let backend_seconds = HistogramVec::new(
            HistogramOpts::new("backend_call_duration_seconds", "Backend call latency by operation and outcome")
                .buckets(LATENCY_BUCKETS.to_vec()),
            &["operation", "outcome"],
        )
        .expect("valid metric");
        registry.register(Box::new(requests.clone())).expect("metric registered once");
        registry.register(Box::new(request_seconds.clone())).expect("metric registered once");
        registry.register(Box::new(backend_seconds.clone())).expect("metric registered once");
        Metrics { registry, requests, request_seconds, backend_seconds }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        // Encoding gathered metrics into a Vec cannot fail.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8_lossy(&out).into_owned()
    }

    fn observe_backend<T>(&self, operation: &str, started: Instant, result: &Result<T>) {
        let outcome = match result {
            Ok(_) => "ok",
            Err(e) => e.kind().as_str(),
        };
        self.backend_seconds.with_label_values(&[operation, outcome]).observe(started.elapsed().as_secs_f64());
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// Middleware: counts and times every request under its route template (bounded cardinality).
pub async fn track_requests(State(metrics): State<Arc<Metrics>>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    let route =
        request.extensions().get::<MatchedPath>().map(|p| p.as_str().to_owned()).unwrap_or_else(|| "unmatched".into());
    let method = request.method().as_str().to_owned();
    let response = next.run(request).await;
    let status = response.status().as_u16().to_string();
    let labels = [route.as_str(), method.as_str(), status.as_str()];
    metrics.requests.with_label_values(&labels).inc();
    metrics.request_seconds.with_label_values(&labels).observe(started.elapsed().as_secs_f64());
    response
}

/// A backend whose every call is timed into [`Metrics`].
pub struct MeteredBackend {
    inner: Arc<dyn DocumentBackend>,
    metrics: Arc<Metrics>,
}

impl MeteredBackend {
    pub fn new(inner: Arc<dyn DocumentBackend>, metrics: Arc<Metrics>) -> Self {
        MeteredBackend { inner, metrics }
    }
}

macro_rules! timed {
    ($self:ident, $op:literal, $call:expr) => {{
        let started = Instant::now();
        let result = $call.await;
        $self.metrics.observe_backend($op, started, &result);
        result
    }};
}

#[async_trait]
impl DocumentBackend for MeteredBackend {
    fn describe(&self) -> String {
        self.inner.describe()
    }

    async fn get(&self, id: &str) -> Result<Option<StoredDocument>> {
        timed!(self, "get", self.inner.get(id))
    }

    async fn put(&self, id: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision> {
        timed!(self, "put", self.inner.put(id, body, precondition))
    }

    async fn delete(&self, id: &str, rev: &Revision) -> Result<Revision> {
        timed!(self, "delete", self.inner.delete(id, rev))
    }

    async fn put_replicated(&self, id: &str, incoming: &ReplicatedRevision) -> Result<ReplicatedOutcome> {
        timed!(self, "put_replicated", self.inner.put_replicated(id, incoming))
    }

    async fn put_replicated_leaves(&self, leaves: &[ReplicatedLeaf<'_>]) -> Result<Vec<Result<ReplicatedOutcome>>> {
        timed!(self, "put_replicated_leaves", self.inner.put_replicated_leaves(leaves))
    }

    async fn put_branch(
        &self,
        id: &str,
        incoming: &ReplicatedRevision,
        max_tree_bytes: usize,
    ) -> Result<ReplicatedOutcome> {
        timed!(self, "put_branch", self.inner.put_branch(id, incoming, max_tree_bytes))
    }

    async fn revision_tree(&self, id: &str) -> Result<Option<RevTree>> {
        timed!(self, "revision_tree", self.inner.revision_tree(id))
    }

    async fn revision_trees(&self, ids: &[String]) -> Result<Vec<Option<RevTree>>> {
        timed!(self, "revision_trees", self.inner.revision_trees(ids))
    }

    async fn erase_branches(&self, prefix: &str) -> Result<()> {
        timed!(self, "erase_branches", self.inner.erase_branches(prefix))
    }

    async fn has_branches(&self, id: &str) -> Result<bool> {
        timed!(self, "has_branches", self.inner.has_branches(id))
    }

    async fn query(&self, query: &Query, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        timed!(self, "query", self.inner.query(query, limit, page_token))
    }

    async fn ensure_standard_indexes(&self) -> Result<()> {
        timed!(self, "ensure_standard_indexes", self.inner.ensure_standard_indexes())
    }

    async fn ensure_namespace_indexed(&self, namespace: &str) -> Result<()> {
        timed!(self, "ensure_namespace_indexed", self.inner.ensure_namespace_indexed(namespace))
    }

    async fn bulk_write(&self, writes: Vec<BulkWrite>) -> Result<Vec<Result<Revision>>> {
        timed!(self, "bulk_write", self.inner.bulk_write(writes))
    }

    // Timed as the writes they are (`put`, `bulk_write`): the text is only how the body travels.
    async fn put_text(
        &self,
        id: &str,
        json: &serde_json::value::RawValue,
        precondition: Precondition,
    ) -> Result<Revision> {
        timed!(self, "put", self.inner.put_text(id, json, precondition))
    }

    async fn bulk_write_text(&self, writes: Vec<BulkWriteText>) -> Result<Vec<Result<Revision>>> {
        timed!(self, "bulk_write", self.inner.bulk_write_text(writes))
    }

    async fn scan(&self, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        timed!(self, "scan", self.inner.scan(limit, page_token))
    }

    async fn health(&self) -> Result<()> {
        timed!(self, "health", self.inner.health())
    }

    async fn approximate_count(&self) -> Result<Option<u64>> {
        timed!(self, "approximate_count", self.inner.approximate_count())
    }

    async fn exact_count(&self) -> Result<Option<u64>> {
        timed!(self, "exact_count", self.inner.exact_count())
    }

    async fn feed_length(&self) -> Result<Option<u64>> {
        timed!(self, "feed_length", self.inner.feed_length())
    }

    async fn design_document_count(&self) -> Result<Option<u64>> {
        timed!(self, "design_document_count", self.inner.design_document_count())
    }

    async fn get_many(&self, ids: &[String]) -> Result<Vec<Option<StoredDocument>>> {
        timed!(self, "get_many", self.inner.get_many(ids))
    }

    async fn get_many_local(&self, names: &[String]) -> Result<Vec<Option<StoredDocument>>> {
        timed!(self, "get_many_local", self.inner.get_many_local(names))
    }

    async fn revisions_many(&self, ids: &[String]) -> Result<Vec<Option<RevisionInfo>>> {
        timed!(self, "revisions_many", self.inner.revisions_many(ids))
    }

    fn checks_never_written(&self) -> bool {
        self.inner.checks_never_written()
    }

    fn shared_with_other_processes(&self) -> bool {
        self.inner.shared_with_other_processes()
    }

    async fn all_docs_text(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> Result<Page<DocumentText>> {
        timed!(self, "all_docs", self.inner.all_docs_text(range, limit, page_token))
    }

    async fn get_many_text(&self, ids: &[String]) -> Result<Option<Vec<Option<StoredText>>>> {
        timed!(self, "get_many", self.inner.get_many_text(ids))
    }

    async fn record_with_local(&self, id: &str, local_name: &str) -> Result<Option<RecordWithLocal>> {
        timed!(self, "get", self.inner.record_with_local(id, local_name))
    }

    async fn all_docs_stored_text(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> Result<Option<Page<StoredText>>> {
        timed!(self, "all_docs", self.inner.all_docs_stored_text(range, limit, page_token))
    }

    async fn design_request(&self, request: DesignRequest) -> Result<Option<DesignResponse>> {
        timed!(self, "design_request", self.inner.design_request(request))
    }

    fn url(&self) -> Option<crate::backend::BackendUrl> {
        self.inner.url()
    }

    fn forwards_requests(&self) -> bool {
        self.inner.forwards_requests()
    }

    fn keeps_branches(&self) -> bool {
        self.inner.keeps_branches()
    }

    async fn revisions(&self, id: &str) -> Result<Option<RevisionInfo>> {
        timed!(self, "revisions", self.inner.revisions(id))
    }

    async fn get_deleted(&self, id: &str) -> Result<Option<StoredDocument>> {
        timed!(self, "get_deleted", self.inner.get_deleted(id))
    }

    async fn changes(&self, since: Option<&str>, limit: usize) -> Result<ChangesPage> {
        timed!(self, "changes", self.inner.changes(since, limit))
    }

    async fn changes_to_end(&self, since: Option<&str>, limit: usize) -> Result<ChangesPage> {
        timed!(self, "changes", self.inner.changes_to_end(since, limit))
    }

    async fn change_position(&self) -> Result<String> {
        timed!(self, "change_position", self.inner.change_position())
    }

    fn change_feed_delay(&self) -> std::time::Duration {
        self.inner.change_feed_delay()
    }

    fn position_order(&self, a: &str, b: &str) -> Option<std::cmp::Ordering> {
        self.inner.position_order(a, b)
    }

    async fn all_docs(&self, range: &IdRange, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        timed!(self, "all_docs", self.inner.all_docs(range, limit, page_token))
    }

    async fn erase_prefix(&self, prefix: &str) -> Result<u64> {
        timed!(self, "erase_prefix", self.inner.erase_prefix(prefix))
    }

    async fn erase_id(&self, id: &str, options: &EraseOptions) -> Result<bool> {
        timed!(self, "erase_id", self.inner.erase_id(id, options))
    }

    async fn get_local(&self, name: &str) -> Result<Option<StoredDocument>> {
        timed!(self, "get_local", self.inner.get_local(name))
    }

    async fn put_local(&self, name: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision> {
        timed!(self, "put_local", self.inner.put_local(name, body, precondition))
    }

    async fn delete_local(&self, name: &str, rev: &Revision) -> Result<()> {
        timed!(self, "delete_local", self.inner.delete_local(name, rev))
    }

    async fn local_docs(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> Result<Page<StoredDocument>> {
        timed!(self, "local_docs", self.inner.local_docs(range, limit, page_token))
    }

    async fn layout(&self) -> Result<LayoutState> {
        timed!(self, "layout", self.inner.layout())
    }

    async fn upgrade_page(&self, page_token: Option<&str>, limit: usize) -> Result<UpgradePage> {
        timed!(self, "upgrade_page", self.inner.upgrade_page(page_token, limit))
    }

    async fn finish_upgrade(&self) -> Result<()> {
        timed!(self, "finish_upgrade", self.inner.finish_upgrade())
    }

    fn attachment_chunk_bytes(&self) -> usize {
        self.inner.attachment_chunk_bytes()
    }

    async fn put_attachment_chunk(&self, blob: &str, index: u64, bytes: bytes::Bytes) -> Result<()> {
        timed!(self, "put_attachment_chunk", self.inner.put_attachment_chunk(blob, index, bytes))
    }

    async fn put_small_attachments(&self, attachments: &[crate::backend::SmallAttachment]) -> Result<bool> {
        timed!(self, "put_small_attachments", self.inner.put_small_attachments(attachments))
    }

    async fn get_attachment_chunk(&self, blob: &str, index: u64) -> Result<Option<bytes::Bytes>> {
        timed!(self, "get_attachment_chunk", self.inner.get_attachment_chunk(blob, index))
    }

    async fn delete_attachment_blob(&self, blob: &str) -> Result<u64> {
        timed!(self, "delete_attachment_blob", self.inner.delete_attachment_blob(blob))
    }

    async fn attachment_blobs(&self, limit: usize, page_token: Option<&str>) -> Result<Page<String>> {
        timed!(self, "attachment_blobs", self.inner.attachment_blobs(limit, page_token))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::error::{Error, ErrorKind};

    /// A backend that overrides every method the trait gives a default body, and the methods a
    /// decorator could be tempted to answer itself, and records which of its own implementations
    /// ran. Its other required methods are never called here.
    #[derive(Default)]
    struct Recording {
        called: Mutex<Vec<&'static str>>,
    }

    impl Recording {
        fn record(&self, method: &'static str) {
            self.called.lock().unwrap().push(method);
        }
    }

    fn unused<T>() -> Result<T> {
        Err(Error::new(ErrorKind::Internal, "not called by this test"))
    }

    #[async_trait]
    impl DocumentBackend for Recording {
        fn describe(&self) -> String {
            "recording".into()
        }
        async fn get(&self, _: &str) -> Result<Option<StoredDocument>> {
            unused()
        }
        async fn put(&self, _: &str, _: &Map<String, Value>, _: Precondition) -> Result<Revision> {
            unused()
        }
        async fn delete(&self, _: &str, _: &Revision) -> Result<Revision> {
            unused()
        }
        async fn put_replicated(&self, _: &str, _: &ReplicatedRevision) -> Result<ReplicatedOutcome> {
            self.record("put_replicated");
            Ok(ReplicatedOutcome::KeptCurrent)
        }
        async fn put_replicated_leaves(&self, _: &[ReplicatedLeaf<'_>]) -> Result<Vec<Result<ReplicatedOutcome>>> {
            self.record("put_replicated_leaves");
            Ok(vec![Ok(ReplicatedOutcome::Applied)])
        }
        async fn query(&self, _: &Query, _: usize, _: Option<&str>) -> Result<Page<StoredDocument>> {
            unused()
        }
        async fn ensure_standard_indexes(&self) -> Result<()> {
            unused()
        }
        async fn ensure_namespace_indexed(&self, _: &str) -> Result<()> {
            unused()
        }
        async fn bulk_write(&self, _: Vec<BulkWrite>) -> Result<Vec<Result<Revision>>> {
            unused()
        }
        async fn scan(&self, _: usize, _: Option<&str>) -> Result<Page<StoredDocument>> {
            unused()
        }
        async fn health(&self) -> Result<()> {
            unused()
        }
        async fn revisions(&self, _: &str) -> Result<Option<RevisionInfo>> {
            unused()
        }
        async fn get_deleted(&self, _: &str) -> Result<Option<StoredDocument>> {
            unused()
        }
        async fn changes(&self, _: Option<&str>, _: usize) -> Result<ChangesPage> {
            unused()
        }
        async fn change_position(&self) -> Result<String> {
            unused()
        }
        fn change_feed_delay(&self) -> std::time::Duration {
            std::time::Duration::ZERO
        }
        async fn all_docs(&self, _: &IdRange, _: usize, _: Option<&str>) -> Result<Page<StoredDocument>> {
            unused()
        }
        async fn erase_prefix(&self, _: &str) -> Result<u64> {
            unused()
        }
        async fn erase_id(&self, _: &str, _: &EraseOptions) -> Result<bool> {
            unused()
        }
        async fn get_local(&self, _: &str) -> Result<Option<StoredDocument>> {
            unused()
        }
        async fn put_local(&self, _: &str, _: &Map<String, Value>, _: Precondition) -> Result<Revision> {
            unused()
        }
        async fn delete_local(&self, _: &str, _: &Revision) -> Result<()> {
            unused()
        }
        async fn local_docs(&self, range: &IdRange, _: usize, _: Option<&str>) -> Result<Page<StoredDocument>> {
            self.record("local_docs");
            let id = format!("_local/{}", range.start.clone().unwrap_or_default());
            let doc = StoredDocument { id, rev: Revision("0-1".into()), body: Map::new() };
            Ok(Page { items: vec![doc], next: Some("after".into()) })
        }
        async fn layout(&self) -> Result<LayoutState> {
            unused()
        }
        async fn upgrade_page(&self, _: Option<&str>, _: usize) -> Result<UpgradePage> {
            unused()
        }
        async fn finish_upgrade(&self) -> Result<()> {
            unused()
        }
        // Every default-bodied method of the trait, overridden. A new one belongs here too.
        async fn approximate_count(&self) -> Result<Option<u64>> {
            self.record("approximate_count");
            Ok(Some(7))
        }
        async fn exact_count(&self) -> Result<Option<u64>> {
            self.record("exact_count");
            Ok(Some(5))
        }
        async fn feed_length(&self) -> Result<Option<u64>> {
            self.record("feed_length");
            Ok(Some(6))
        }
        async fn design_document_count(&self) -> Result<Option<u64>> {
            self.record("design_document_count");
            Ok(Some(3))
        }
        async fn get_many(&self, ids: &[String]) -> Result<Vec<Option<StoredDocument>>> {
            self.record("get_many");
            Ok(vec![None; ids.len()])
        }
        async fn get_many_local(&self, names: &[String]) -> Result<Vec<Option<StoredDocument>>> {
            self.record("get_many_local");
            Ok(vec![None; names.len()])
        }
        async fn revisions_many(&self, ids: &[String]) -> Result<Vec<Option<RevisionInfo>>> {
            self.record("revisions_many");
            Ok(vec![None; ids.len()])
        }
        fn checks_never_written(&self) -> bool {
            self.record("checks_never_written");
            true
        }
        async fn all_docs_text(&self, _: &IdRange, _: usize, _: Option<&str>) -> Result<Page<DocumentText>> {
            self.record("all_docs_text");
            Ok(Page { items: Vec::new(), next: None })
        }
        async fn get_many_text(&self, ids: &[String]) -> Result<Option<Vec<Option<StoredText>>>> {
            self.record("get_many_text");
            Ok(Some(vec![None; ids.len()]))
        }
        async fn record_with_local(&self, _: &str, _: &str) -> Result<Option<RecordWithLocal>> {
            self.record("record_with_local");
            Ok(Some(RecordWithLocal { record: None, local: None }))
        }
        async fn all_docs_stored_text(
            &self,
            _: &IdRange,
            _: usize,
            _: Option<&str>,
        ) -> Result<Option<Page<StoredText>>> {
            self.record("all_docs_stored_text");
            Ok(Some(Page { items: Vec::new(), next: None }))
        }
        async fn design_request(&self, _: DesignRequest) -> Result<Option<DesignResponse>> {
            self.record("design_request");
            Ok(Some(DesignResponse { status: 200, headers: Vec::new(), body: Box::pin(futures::stream::empty()) }))
        }
        fn url(&self) -> Option<crate::backend::BackendUrl> {
            self.record("url");
            None
        }
        fn forwards_requests(&self) -> bool {
            self.record("forwards_requests");
            true
        }
        fn keeps_branches(&self) -> bool {
            self.record("keeps_branches");
            true
        }
        async fn revision_tree(&self, _: &str) -> Result<Option<RevTree>> {
            self.record("revision_tree");
            Ok(Some(RevTree::default()))
        }
        async fn revision_trees(&self, ids: &[String]) -> Result<Vec<Option<RevTree>>> {
            self.record("revision_trees");
            Ok(ids.iter().map(|_| Some(RevTree::default())).collect())
        }
        async fn put_branch(&self, _: &str, _: &ReplicatedRevision, _: usize) -> Result<ReplicatedOutcome> {
            self.record("put_branch");
            Ok(ReplicatedOutcome::AlreadyKnown)
        }
        async fn erase_branches(&self, _: &str) -> Result<()> {
            self.record("erase_branches");
            Ok(())
        }
        async fn has_branches(&self, _: &str) -> Result<bool> {
            self.record("has_branches");
            Ok(true)
        }
        fn attachment_chunk_bytes(&self) -> usize {
            self.record("attachment_chunk_bytes");
            11
        }
        async fn put_attachment_chunk(&self, _: &str, _: u64, _: bytes::Bytes) -> Result<()> {
            self.record("put_attachment_chunk");
            Ok(())
        }
        async fn get_attachment_chunk(&self, _: &str, _: u64) -> Result<Option<bytes::Bytes>> {
            self.record("get_attachment_chunk");
            Ok(Some(bytes::Bytes::from_static(b"chunk")))
        }
        async fn delete_attachment_blob(&self, _: &str) -> Result<u64> {
            self.record("delete_attachment_blob");
            Ok(2)
        }
        async fn attachment_blobs(&self, _: usize, _: Option<&str>) -> Result<Page<String>> {
            self.record("attachment_blobs");
            Ok(Page { items: vec!["blob".into()], next: None })
        }
    }

    /// The decorator must reach the adapter's own implementation of each default-bodied method:
    /// before, `get_many` fell back to the trait's one-`get`-per-id default and `get` here fails.
    #[tokio::test]
    async fn the_metrics_decorator_forwards_every_default_bodied_method() {
        let inner = Arc::new(Recording::default());
        let metered = MeteredBackend::new(Arc::clone(&inner) as Arc<dyn DocumentBackend>, Arc::new(Metrics::new()));
        assert_eq!(metered.approximate_count().await.unwrap(), Some(7));
        assert_eq!(metered.exact_count().await.unwrap(), Some(5));
        assert_eq!(metered.feed_length().await.unwrap(), Some(6));
        assert_eq!(metered.design_document_count().await.unwrap(), Some(3));
        assert_eq!(metered.get_many(&["a".into(), "b".into()]).await.unwrap(), vec![None, None]);
        assert_eq!(metered.get_many_local(&["a".into()]).await.unwrap(), vec![None]);
        assert_eq!(metered.revisions_many(&["a".into()]).await.unwrap(), vec![None]);
        assert!(metered.checks_never_written());
        let incoming = ReplicatedRevision {
            rev: Revision(format!("1-{}", "a".repeat(32))),
            ancestry: vec![format!("1-{}", "a".repeat(32))],
            deleted: false,
            body: Map::new(),
            precondition: Precondition::None,
        };
        assert_eq!(metered.put_replicated("u:n:k", &incoming).await.unwrap(), ReplicatedOutcome::KeptCurrent);
        let leaf = ReplicatedLeaf { id: "u:n:k", head: &incoming, body: &incoming.body };
        let outcomes = metered.put_replicated_leaves(&[leaf]).await.unwrap();
        assert_eq!(outcomes.into_iter().map(Result::unwrap).collect::<Vec<_>>(), [ReplicatedOutcome::Applied]);
        assert_eq!(metered.put_branch("u:n:k", &incoming, usize::MAX).await.unwrap(), ReplicatedOutcome::AlreadyKnown);
        assert_eq!(metered.revision_tree("u:n:k").await.unwrap(), Some(RevTree::default()));
        assert_eq!(metered.revision_trees(&["u:n:k".into()]).await.unwrap(), vec![Some(RevTree::default())]);
        metered.erase_branches("u:").await.unwrap();
        assert!(metered.has_branches("u:n:k").await.unwrap());
        let everything =
            IdRange { start: None, end: None, inclusive_end: true, descending: false, include_design: false };
        assert!(metered.all_docs_text(&everything, 1, None).await.unwrap().items.is_empty());
        assert_eq!(metered.get_many_text(&["u:n:k".into()]).await.unwrap(), Some(vec![None]));
        assert_eq!(
            metered.record_with_local("u:n:k", "side").await.unwrap(),
            Some(RecordWithLocal { record: None, local: None })
        );
        assert!(metered.all_docs_stored_text(&everything, 1, None).await.unwrap().is_some_and(|p| p.items.is_empty()));
        let design = DesignRequest {
            method: reqwest::Method::GET,
            path: "_design/d".into(),
            query: None,
            headers: Vec::new(),
            body: crate::backend::DesignBody::empty(),
        };
        assert_eq!(metered.design_request(design).await.unwrap().map(|answer| answer.status), Some(200));
        assert!(metered.url().is_none());
        assert!(metered.forwards_requests());
        assert!(metered.keeps_branches());
        // A required method, but one a decorator could answer from another listing.
        let range = IdRange { start: Some("cp".into()), ..IdRange::all() };
        let listed = metered.local_docs(&range, 1, None).await.unwrap();
        assert_eq!((listed.items[0].id.as_str(), listed.next.as_deref()), ("_local/cp", Some("after")));
        assert_eq!(metered.attachment_chunk_bytes(), 11);
        metered.put_attachment_chunk("b", 0, bytes::Bytes::from_static(b"x")).await.unwrap();
        assert_eq!(metered.get_attachment_chunk("b", 0).await.unwrap().as_deref(), Some(&b"chunk"[..]));
        assert_eq!(metered.delete_attachment_blob("b").await.unwrap(), 2);
        assert_eq!(metered.attachment_blobs(10, None).await.unwrap().items, ["blob"]);
        assert_eq!(
            *inner.called.lock().unwrap(),
            [
                "approximate_count",
                "exact_count",
                "feed_length",
                "design_document_count",
                "get_many",
                "get_many_local",
                "revisions_many",
                "checks_never_written",
                "put_replicated",
                "put_replicated_leaves",
                "put_branch",
                "revision_tree",
                "revision_trees",
                "erase_branches",
                "has_branches",
                "all_docs_text",
                "get_many_text",
                "record_with_local",
                "all_docs_stored_text",
                "design_request",
                "url",
                "forwards_requests",
                "keeps_branches",
                "local_docs",
                "attachment_chunk_bytes",
                "put_attachment_chunk",
                "get_attachment_chunk",
                "delete_attachment_blob",
                "attachment_blobs"
            ]
        );
    }
}
