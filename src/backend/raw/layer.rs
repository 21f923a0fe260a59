//! Layers: backends that wrap another backend and change some of its behaviour (metrics, fault
//! injection, test doubles), forwarding everything else.
//!
//! A layer implements [`Layered`]: it names its inner backend and overrides only the methods it
//! changes; every other method forwards to the inner backend's own implementation. The blanket
//! implementation below makes every layer a [`DocumentBackend`]. Forwarding by default means a new
//! trait method reaches every adapter through every layer, instead of a layer silently answering
//! with the trait's default body where the adapter has a better one. The exceptions are the
//! writes of bodies given as text (`put_text`, `bulk_write_text`): they go through the layer's own
//! `put` and `bulk_write`, so a layer that watches or refuses writes sees those too.

use async_trait::async_trait;
use serde_json::{Map, Value};

use crate::backend::rev_tree::RevTree;
use crate::backend::{
    BulkWrite, BulkWriteText, ChangesPage, DesignRequest, DesignResponse, DocumentBackend, DocumentText, EraseOptions,
    IdRange, LayoutState, Page, Precondition, Query, ReplicatedLeaf, ReplicatedOutcome, ReplicatedRevision, Revision,
    RevisionInfo, StoredDocument, UpgradePage,
};
use crate::error::Result;

/// A backend wrapped around another one. Every method forwards to [`Layered::inner`] unless the
/// layer overrides it.
#[async_trait]
pub trait Layered: Send + Sync + 'static {
    /// The backend this layer wraps.
    fn inner(&self) -> &dyn DocumentBackend;

    fn describe(&self) -> String {
        self.inner().describe()
    }

    async fn get(&self, id: &str) -> Result<Option<StoredDocument>> {
        self.inner().get(id).await
    }

    async fn put(&self, id: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision> {
        self.inner().put(id, body, precondition).await
    }

    async fn delete(&self, id: &str, rev: &Revision) -> Result<Revision> {
        self.inner().delete(id, rev).await
    }

    async fn put_replicated(&self, id: &str, incoming: &ReplicatedRevision) -> Result<ReplicatedOutcome> {
        self.inner().put_replicated(id, incoming).await
    }

    async fn put_replicated_leaves(&self, leaves: &[ReplicatedLeaf<'_>]) -> Result<Vec<Result<ReplicatedOutcome>>> {
        self.inner().put_replicated_leaves(leaves).await
    }

    async fn put_branch(
        &self,
        id: &str,
        incoming: &ReplicatedRevision,
        max_tree_bytes: usize,
    ) -> Result<ReplicatedOutcome> {
        self.inner().put_branch(id, incoming, max_tree_bytes).await
    }

    async fn revision_tree(&self, id: &str) -> Result<Option<RevTree>> {
        self.inner().revision_tree(id).await
    }

    async fn revision_trees(&self, ids: &[String]) -> Result<Vec<Option<RevTree>>> {
        self.inner().revision_trees(ids).await
    }

    async fn erase_branches(&self, prefix: &str) -> Result<()> {
        self.inner().erase_branches(prefix).await
    }

    async fn has_branches(&self, id: &str) -> Result<bool> {
        self.inner().has_branches(id).await
    }

    async fn query(&self, query: &Query, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        self.inner().query(query, limit, page_token).await
    }

    async fn ensure_standard_indexes(&self) -> Result<()> {
        self.inner().ensure_standard_indexes().await
    }

    async fn ensure_namespace_indexed(&self, namespace: &str) -> Result<()> {
        self.inner().ensure_namespace_indexed(namespace).await
    }

    async fn bulk_write(&self, writes: Vec<BulkWrite>) -> Result<Vec<Result<Revision>>> {
        self.inner().bulk_write(writes).await
    }

    /// Unlike the other methods, not forwarded to the inner backend by default: the text is
    /// parsed and written through this layer's own [`Layered::put`], so a layer that watches or
    /// refuses writes (the test doubles, fault injection) keeps seeing every record written as
    /// text. A layer that changes no write forwards it itself to keep the inner backend's way.
    async fn put_text(
        &self,
        id: &str,
        json: &serde_json::value::RawValue,
        precondition: Precondition,
    ) -> Result<Revision> {
        let body = crate::backend::body_of_text(id, json)?;
        Layered::put(self, id, &body, precondition).await
    }

    /// Written through this layer's own [`Layered::bulk_write`], as [`Layered::put_text`] is.
    async fn bulk_write_text(&self, writes: Vec<BulkWriteText>) -> Result<Vec<Result<Revision>>> {
        let writes = writes.into_iter().map(BulkWriteText::into_values).collect::<Result<Vec<_>>>()?;
        Layered::bulk_write(self, writes).await
    }

    async fn scan(&self, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        self.inner().scan(limit, page_token).await
    }

    async fn health(&self) -> Result<()> {
        self.inner().health().await
    }

    async fn revisions(&self, id: &str) -> Result<Option<RevisionInfo>> {
        self.inner().revisions(id).await
    }

    async fn get_deleted(&self, id: &str) -> Result<Option<StoredDocument>> {
        self.inner().get_deleted(id).await
    }

    async fn changes(&self, since: Option<&str>, limit: usize) -> Result<ChangesPage> {
        self.inner().changes(since, limit).await
    }

    async fn changes_to_end(&self, since: Option<&str>, limit: usize) -> Result<ChangesPage> {
        self.inner().changes_to_end(since, limit).await
    }

    async fn change_position(&self) -> Result<String> {
        self.inner().change_position().await
    }

    fn change_feed_delay(&self) -> std::time::Duration {
        self.inner().change_feed_delay()
    }

    fn position_order(&self, a: &str, b: &str) -> Option<std::cmp::Ordering> {
        self.inner().position_order(a, b)
    }

    async fn all_docs(&self, range: &IdRange, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        self.inner().all_docs(range, limit, page_token).await
    }

    async fn erase_prefix(&self, prefix: &str) -> Result<u64> {
        self.inner().erase_prefix(prefix).await
    }

    async fn erase_id(&self, id: &str, options: &EraseOptions) -> Result<bool> {
        self.inner().erase_id(id, options).await
    }

    async fn get_local(&self, name: &str) -> Result<Option<StoredDocument>> {
        self.inner().get_local(name).await
    }

    async fn put_local(&self, name: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision> {
        self.inner().put_local(name, body, precondition).await
    }

    async fn delete_local(&self, name: &str, rev: &Revision) -> Result<()> {
        self.inner().delete_local(name, rev).await
    }

    async fn local_docs(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> Result<Page<StoredDocument>> {
        self.inner().local_docs(range, limit, page_token).await
    }

    async fn layout(&self) -> Result<LayoutState> {
        self.inner().layout().await
    }

    async fn upgrade_page(&self, page_token: Option<&str>, limit: usize) -> Result<UpgradePage> {
        self.inner().upgrade_page(page_token, limit).await
    }

    async fn finish_upgrade(&self) -> Result<()> {
        self.inner().finish_upgrade().await
    }

    async fn approximate_count(&self) -> Result<Option<u64>> {
        self.inner().approximate_count().await
    }

    async fn exact_count(&self) -> Result<Option<u64>> {
        self.inner().exact_count().await
    }

    async fn feed_length(&self) -> Result<Option<u64>> {
        self.inner().feed_length().await
    }

    async fn design_document_count(&self) -> Result<Option<u64>> {
        self.inner().design_document_count().await
    }

    async fn get_many(&self, ids: &[String]) -> Result<Vec<Option<StoredDocument>>> {
        self.inner().get_many(ids).await
    }

    async fn get_many_local(&self, names: &[String]) -> Result<Vec<Option<StoredDocument>>> {
        self.inner().get_many_local(names).await
    }

    async fn revisions_many(&self, ids: &[String]) -> Result<Vec<Option<RevisionInfo>>> {
        self.inner().revisions_many(ids).await
    }

    fn checks_never_written(&self) -> bool {
        self.inner().checks_never_written()
    }

    fn shared_with_other_processes(&self) -> bool {
        self.inner().shared_with_other_processes()
    }

    async fn all_docs_text(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> Result<Page<DocumentText>> {
        self.inner().all_docs_text(range, limit, page_token).await
    }

    fn url(&self) -> Option<crate::backend::BackendUrl> {
        self.inner().url()
    }

    async fn design_request(&self, request: DesignRequest) -> Result<Option<DesignResponse>> {
        self.inner().design_request(request).await
    }

    fn forwards_requests(&self) -> bool {
        self.inner().forwards_requests()
    }

    fn keeps_branches(&self) -> bool {
        self.inner().keeps_branches()
    }

    fn attachment_chunk_bytes(&self) -> usize {
        self.inner().attachment_chunk_bytes()
    }

    async fn put_attachment_chunk(&self, blob: &str, index: u64, bytes: bytes::Bytes) -> Result<()> {
        self.inner().put_attachment_chunk(blob, index, bytes).await
    }

    async fn put_small_attachments(&self, attachments: &[crate::backend::SmallAttachment]) -> Result<bool> {
        self.inner().put_small_attachments(attachments).await
    }

    async fn get_attachment_chunk(&self, blob: &str, index: u64) -> Result<Option<bytes::Bytes>> {
        self.inner().get_attachment_chunk(blob, index).await
    }

    async fn delete_attachment_blob(&self, blob: &str) -> Result<u64> {
        self.inner().delete_attachment_blob(blob).await
    }

    async fn attachment_blobs(&self, limit: usize, page_token: Option<&str>) -> Result<Page<String>> {
        self.inner().attachment_blobs(limit, page_token).await
    }
}

#[async_trait]
impl<L: Layered> DocumentBackend for L {
    fn describe(&self) -> String {
        Layered::describe(self)
    }

    async fn get(&self, id: &str) -> Result<Option<StoredDocument>> {
        Layered::get(self, id).await
    }

    async fn put(&self, id: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision> {
        Layered::put(self, id, body, precondition).await
    }

    async fn delete(&self, id: &str, rev: &Revision) -> Result<Revision> {
        Layered::delete(self, id, rev).await
    }

    async fn put_replicated(&self, id: &str, incoming: &ReplicatedRevision) -> Result<ReplicatedOutcome> {
        Layered::put_replicated(self, id, incoming).await
    }

    async fn put_replicated_leaves(&self, leaves: &[ReplicatedLeaf<'_>]) -> Result<Vec<Result<ReplicatedOutcome>>> {
        Layered::put_replicated_leaves(self, leaves).await
    }

    async fn put_branch(
        &self,
        id: &str,
        incoming: &ReplicatedRevision,
        max_tree_bytes: usize,
    ) -> Result<ReplicatedOutcome> {
        Layered::put_branch(self, id, incoming, max_tree_bytes).await
    }

    async fn revision_tree(&self, id: &str) -> Result<Option<RevTree>> {
        Layered::revision_tree(self, id).await
    }

    async fn revision_trees(&self, ids: &[String]) -> Result<Vec<Option<RevTree>>> {
        Layered::revision_trees(self, ids).await
    }

    async fn erase_branches(&self, prefix: &str) -> Result<()> {
        Layered::erase_branches(self, prefix).await
    }

    async fn has_branches(&self, id: &str) -> Result<bool> {
        Layered::has_branches(self, id).await
    }

    async fn query(&self, query: &Query, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        Layered::query(self, query, limit, page_token).await
    }

    async fn ensure_standard_indexes(&self) -> Result<()> {
        Layered::ensure_standard_indexes(self).await
    }

    async fn ensure_namespace_indexed(&self, namespace: &str) -> Result<()> {
        Layered::ensure_namespace_indexed(self, namespace).await
    }

    async fn bulk_write(&self, writes: Vec<BulkWrite>) -> Result<Vec<Result<Revision>>> {
        Layered::bulk_write(self, writes).await
    }

    async fn put_text(
        &self,
        id: &str,
        json: &serde_json::value::RawValue,
        precondition: Precondition,
    ) -> Result<Revision> {
        Layered::put_text(self, id, json, precondition).await
    }

    async fn bulk_write_text(&self, writes: Vec<BulkWriteText>) -> Result<Vec<Result<Revision>>> {
        Layered::bulk_write_text(self, writes).await
    }

    async fn scan(&self, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        Layered::scan(self, limit, page_token).await
    }

    async fn health(&self) -> Result<()> {
        Layered::health(self).await
    }

    async fn revisions(&self, id: &str) -> Result<Option<RevisionInfo>> {
        Layered::revisions(self, id).await
    }

    async fn get_deleted(&self, id: &str) -> Result<Option<StoredDocument>> {
        Layered::get_deleted(self, id).await
    }

    async fn changes(&self, since: Option<&str>, limit: usize) -> Result<ChangesPage> {
        Layered::changes(self, since, limit).await
    }

    async fn changes_to_end(&self, since: Option<&str>, limit: usize) -> Result<ChangesPage> {
        Layered::changes_to_end(self, since, limit).await
    }

    async fn change_position(&self) -> Result<String> {
        Layered::change_position(self).await
    }

    fn change_feed_delay(&self) -> std::time::Duration {
        Layered::change_feed_delay(self)
    }

    fn position_order(&self, a: &str, b: &str) -> Option<std::cmp::Ordering> {
        Layered::position_order(self, a, b)
    }

    async fn all_docs(&self, range: &IdRange, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        Layered::all_docs(self, range, limit, page_token).await
    }

    async fn erase_prefix(&self, prefix: &str) -> Result<u64> {
        Layered::erase_prefix(self, prefix).await
    }

    async fn erase_id(&self, id: &str, options: &EraseOptions) -> Result<bool> {
        Layered::erase_id(self, id, options).await
    }

    async fn get_local(&self, name: &str) -> Result<Option<StoredDocument>> {
        Layered::get_local(self, name).await
    }

    async fn put_local(&self, name: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision> {
        Layered::put_local(self, name, body, precondition).await
    }

    async fn delete_local(&self, name: &str, rev: &Revision) -> Result<()> {
        Layered::delete_local(self, name, rev).await
    }

    async fn local_docs(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> Result<Page<StoredDocument>> {
        Layered::local_docs(self, range, limit, page_token).await
    }

    async fn layout(&self) -> Result<LayoutState> {
        Layered::layout(self).await
    }

    async fn upgrade_page(&self, page_token: Option<&str>, limit: usize) -> Result<UpgradePage> {
        Layered::upgrade_page(self, page_token, limit).await
    }

    async fn finish_upgrade(&self) -> Result<()> {
        Layered::finish_upgrade(self).await
    }

    async fn approximate_count(&self) -> Result<Option<u64>> {
        Layered::approximate_count(self).await
    }

    async fn exact_count(&self) -> Result<Option<u64>> {
        Layered::exact_count(self).await
    }

    async fn feed_length(&self) -> Result<Option<u64>> {
        Layered::feed_length(self).await
    }

    async fn design_document_count(&self) -> Result<Option<u64>> {
        Layered::design_document_count(self).await
    }

    async fn get_many(&self, ids: &[String]) -> Result<Vec<Option<StoredDocument>>> {
        Layered::get_many(self, ids).await
    }

    async fn get_many_local(&self, names: &[String]) -> Result<Vec<Option<StoredDocument>>> {
        Layered::get_many_local(self, names).await
    }

    async fn revisions_many(&self, ids: &[String]) -> Result<Vec<Option<RevisionInfo>>> {
        Layered::revisions_many(self, ids).await
    }

    fn checks_never_written(&self) -> bool {
        Layered::checks_never_written(self)
    }

    fn shared_with_other_processes(&self) -> bool {
        Layered::shared_with_other_processes(self)
    }

    async fn all_docs_text(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> Result<Page<DocumentText>> {
        Layered::all_docs_text(self, range, limit, page_token).await
    }

    fn url(&self) -> Option<crate::backend::BackendUrl> {
        Layered::url(self)
    }

    async fn design_request(&self, request: DesignRequest) -> Result<Option<DesignResponse>> {
        Layered::design_request(self, request).await
    }

    fn forwards_requests(&self) -> bool {
        Layered::forwards_requests(self)
    }

    fn keeps_branches(&self) -> bool {
        Layered::keeps_branches(self)
    }

    fn attachment_chunk_bytes(&self) -> usize {
        Layered::attachment_chunk_bytes(self)
    }

    async fn put_attachment_chunk(&self, blob: &str, index: u64, bytes: bytes::Bytes) -> Result<()> {
        Layered::put_attachment_chunk(self, blob, index, bytes).await
    }

    async fn put_small_attachments(&self, attachments: &[crate::backend::SmallAttachment]) -> Result<bool> {
        Layered::put_small_attachments(self, attachments).await
    }

    async fn get_attachment_chunk(&self, blob: &str, index: u64) -> Result<Option<bytes::Bytes>> {
        Layered::get_attachment_chunk(self, blob, index).await
    }

    async fn delete_attachment_blob(&self, blob: &str) -> Result<u64> {
        Layered::delete_attachment_blob(self, blob).await
    }

    async fn attachment_blobs(&self, limit: usize, page_token: Option<&str>) -> Result<Page<String>> {
        Layered::attachment_blobs(self, limit, page_token).await
    }
}
