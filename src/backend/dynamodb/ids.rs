//! Documents in id order over the sharded id index (docs/dynamodb-layout.md), merged across
//! shards like the feed ([`crate::backend::raw::sharded`]), local documents in name order over
//! the same index's local shards, erasure by id prefix or of one id, and the exact counts of a
//! database table (live documents, feed entries).

use std::collections::HashMap;

use async_trait::async_trait;
use aws_sdk_dynamodb::operation::query::builders::QueryFluentBuilder;
use aws_sdk_dynamodb::operation::query::QueryOutput;
use aws_sdk_dynamodb::types::{AttributeValue, DeleteRequest, ReturnValue, Select, WriteRequest};
use futures::{StreamExt, TryStreamExt};
use serde_json::Value;

use super::backend::DynamoDbBackend;
use super::codec::{self, Item};
use super::error::map_sdk;
use super::layout::{self, limit_of, shard_value, DELETED, FEED_INDEX, ID_INDEX, SHARD, SHARD_COUNT};
use crate::backend::raw::count_cache::Counted;
use crate::backend::raw::sharded::{Chunk, ShardReader, ShardedMerge};
use crate::backend::{
    DocumentBackend, EraseOptions, IdRange, LayoutState, Page, Revision, StoredDocument, LOCAL_PREFIX,
};
use crate::error::{Error, ErrorKind, Result};

/// Local documents read at once by `local_docs` (one consistent `GetItem` each).
const LOCAL_READS: usize = 16;

/// Ids that `all_docs` never lists besides tombstones: local and design documents.
const DESIGN_PREFIX: &str = "_design/";

/// One entry of the id index.
struct IdEntry {
    id: String,
    /// A tombstone or a chunk item: never listed.
    hidden: bool,
}

/// Reads the id index over a range, in its direction, after an id already returned.
struct IdReader<'a> {
    backend: &'a DynamoDbBackend,
    range: &'a IdRange,
    after: Option<String>,
    /// Added to the merge's shard numbers: 0 for documents, [`layout::LOCAL_SHARD_BASE`] for
    /// local documents.
    shard_base: u32,
}

#[async_trait]
impl ShardReader for IdReader<'_> {
    type Entry = IdEntry;
    type Key = String;
    type Cursor = Item;

    fn key(entry: &IdEntry) -> String {
        entry.id.clone()
    }

    async fn read(&self, shard: u32, cursor: Option<Item>, limit: usize) -> Result<Chunk<IdEntry, Item>> {
        let mut request = self
            .backend
            .client()
            .query()
            .table_name(self.backend.table())
            .index_name(ID_INDEX)
            .scan_index_forward(!self.range.descending)
            .expression_attribute_names("#shard", SHARD)
            .expression_attribute_values(":shard", shard_value(self.shard_base + shard))
            .limit(limit_of(limit))
            .set_exclusive_start_key(cursor);
        // The near end bounds the query; the far end is checked on the entries read.
        let (strict, inclusive) = if self.range.descending { ("<", "<=") } else { (">", ">=") };
        let near = match (&self.after, &self.range.start) {
            (Some(after), _) => Some((strict, after)),
            // DynamoDB refuses an empty string in a key condition (a ValidationException), and
            // every id sorts at or after "": an empty start is no bound (a descending range from
            // "" holds no id and never gets here, see `all_docs_page`).
            (None, Some(start)) if start.is_empty() => None,
            (None, Some(start)) => Some((inclusive, start)),
            (None, None) => None,
        };
        request = match near {
            Some((op, bound)) => request
                .key_condition_expression(format!("#shard = :shard AND #id {op} :near"))
                .expression_attribute_names("#id", codec::ID)
                .expression_attribute_values(":near", AttributeValue::S(bound.clone())),
            None => request.key_condition_expression("#shard = :shard"),
        };
        let output = request.send().await.map_err(|e| map_sdk(e, "read the id index"))?;
        let mut entries = Vec::with_capacity(output.items().len());
        for item in output.items() {
            let id = codec::string_attribute(item, codec::ID).unwrap_or_default().to_owned();
            if !self.range.contains(&id) {
                // Past the far end: this shard is done.
                return Ok(Chunk { entries, cursor: None });
            }
            entries.push(IdEntry { hidden: layout::is_tombstone(item) || codec::is_chunk(item), id });
        }
        Ok(Chunk { entries, cursor: output.last_evaluated_key })
    }
}

/// An `all_docs` page token: the last id returned.
fn encode_after(id: &str) -> String {
    Value::String(id.to_owned()).to_string()
}

fn decode_after(token: &str) -> Result<String> {
    match serde_json::from_str::<Value>(token) {
        // An empty id is never returned, so never a token (and would reach a key condition).
        Ok(Value::String(id)) if !id.is_empty() => Ok(id),
        _ => Err(Error::invalid("page token", "was not produced by this backend")),
    }
}

impl DynamoDbBackend {
    /// `all_docs(range, limit, token)`: ids merged across shards, then their bodies by one
    /// consistent batch read.
    pub(super) async fn all_docs_page(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> Result<Page<StoredDocument>> {
        self.require_layout("all_docs").await?;
        let after = page_token.map(decode_after).transpose()?;
        // No id is empty (CouchDB refuses an empty `_id`, and DynamoDB an empty key), so a
        // descending range starting at "" holds none; reading it would put "" in a key condition.
        let descending_from_empty = range.descending && range.start.as_deref() == Some("");
        if descending_from_empty {
            return Ok(Page { items: Vec::new(), next: None });
        }
        let listed = |entry: &IdEntry| {
            !entry.hidden
                && !entry.id.starts_with(LOCAL_PREFIX)
                && (range.include_design || !entry.id.starts_with(DESIGN_PREFIX))
        };
        let (ids, next) = self.merged_ids(range, after, 0, limit, listed).await?;
        // Bodies by consistent reads; an id deleted since the index read drops out.
        let items = self.get_many(&ids).await?.into_iter().flatten().collect();
        Ok(Page { items, next })
    }

    /// Up to `limit` ids in `range` after `after` that `listed` keeps, merged in order from the
    /// id index's shards `shard_base..shard_base + SHARD_COUNT`, and the token of the next page
    /// when more follow.
    async fn merged_ids(
        &self,
        range: &IdRange,
        after: Option<String>,
        shard_base: u32,
        limit: usize,
        listed: impl Fn(&IdEntry) -> bool,
    ) -> Result<(Vec<String>, Option<String>)> {
        let limit = limit.max(1);
        let reader = IdReader { backend: self, range, after, shard_base };
        let chunk = ShardedMerge::<IdReader>::chunk_for(limit, SHARD_COUNT);
        let mut merge = ShardedMerge::new(reader, SHARD_COUNT, chunk, range.descending);
        let mut ids = Vec::with_capacity(limit);
        while let Some(entry) = merge.next().await? {
            if listed(&entry) {
                if ids.len() == limit {
                    let next = ids.last().map(|id: &String| encode_after(id));
                    return Ok((ids, next));
                }
                ids.push(entry.id);
            }
        }
        Ok((ids, None))
    }

    /// `local_docs(range, limit, token)`: the local shards of the id index merged like
    /// `all_docs`' (a page of `L` reads about `L + 16 × chunk` index entries, in about 16 + 16
    /// small Queries, whatever the table's size), then each listed one by a consistent `GetItem`
    /// ([`LOCAL_READS`] at once): one deleted since the index read drops out. The index is
    /// eventually consistent, so a local document written a moment ago may be missing from a
    /// page. Local documents written before local shards existed are in no index until their
    /// next write (or `agentstore upgrade`, which stamps them).
    pub(super) async fn local_docs_page(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> Result<Page<StoredDocument>> {
        self.require_layout("_local_docs").await?;
        let after = page_token.map(decode_after).transpose()?;
        // The index holds ids: the names' range as `_local/{name}`, closed at the prefix's ends,
        // so no bound reaches a key condition as "".
        let id_range = range.under_prefix(LOCAL_PREFIX);
        if id_range.holds_nothing() {
            return Ok(Page { items: Vec::new(), next: None });
        }
        let listed = |entry: &IdEntry| !entry.hidden && entry.id.starts_with(LOCAL_PREFIX);
        let (ids, next) = self.merged_ids(&id_range, after, layout::LOCAL_SHARD_BASE, limit, listed).await?;
        // A plain loop, not an iterator adapter: a closure here trips rustc's higher-ranked
        // `Send` check on the boxed future.
        let mut reads = Vec::with_capacity(ids.len());
        for id in &ids {
            reads.push(self.read_local(&id[LOCAL_PREFIX.len()..]));
        }
        let items: Vec<Option<StoredDocument>> =
            futures::stream::iter(reads).buffered(LOCAL_READS).try_collect().await?;
        Ok(Page { items: items.into_iter().flatten().collect(), next })
    }

    /// One page of the id index in `shard`: the items whose ids start with `prefix`, from
    /// `cursor`, at most `limit` when given (erasure and attachment chunks find their ids so).
    pub(super) async fn query_id_prefix(
        &self,
        shard: u32,
        prefix: &str,
        limit: Option<i32>,
        cursor: Option<Item>,
        doing: &str,
    ) -> Result<QueryOutput> {
        self.client()
            .query()
            .table_name(self.table())
            .index_name(ID_INDEX)
            .key_condition_expression("#shard = :shard AND begins_with(#id, :prefix)")
            .expression_attribute_names("#shard", SHARD)
            .expression_attribute_names("#id", codec::ID)
            .expression_attribute_values(":shard", shard_value(shard))
            .expression_attribute_values(":prefix", AttributeValue::S(prefix.to_owned()))
            .set_limit(limit)
            .set_exclusive_start_key(cursor)
            .send()
            .await
            .map_err(|e| map_sdk(e, doing))
    }

    /// `erase_prefix(prefix)`: every item whose id starts with `prefix` (documents, tombstones,
    /// chunk items) found through the id index, shard by shard, deleted outright.
    pub(super) async fn erase_ids_with_prefix(&self, prefix: &str) -> Result<u64> {
        if prefix.is_empty() {
            return Err(Error::invalid("prefix", "must not be empty: erasing every document is not an erasure"));
        }
        self.erase_under(prefix, |_| true).await
    }

    /// `erase_id(id)`: the document's own item (live or a tombstone: its revision, ancestry and
    /// feed entry are on it), then its chunk items, found under the chunk prefix and kept to
    /// those whose `_chunkOf` is `id` (a document may have an id that starts like a chunk's).
    /// The item goes first: a crash between leaves chunks nothing reads, never a document whose
    /// chunks are gone. With `options.if_revision`, the item's deletion carries a condition on
    /// its `_rev` ([`revision_condition`]): DynamoDB checks it in the deletion, so a write that
    /// landed since makes it a `Conflict` and nothing is erased.
    pub(super) async fn erase_one_id(&self, id: &str, options: &EraseOptions) -> Result<bool> {
        let mut request = self
            .client()
            .delete_item()
            .table_name(self.table())
            .set_key(Some(Self::key(id)))
            .return_values(ReturnValue::AllOld);
        if let Some(expected) = &options.if_revision {
            let (condition, values) = revision_condition(expected);
            request = request.condition_expression(condition).expression_attribute_names("#rev", codec::REV);
            for (name, value) in values {
                request = request.expression_attribute_values(name, value);
            }
        }
        let removed = request.send().await;
        self.count_cache().wrote();
        let removed = removed.map_err(|e| match (map_sdk(e, "erase a document"), &options.if_revision) {
            (err, Some(expected)) if err.is_conflict() => {
                Error::conflict(format!("document {id:?} is no longer at revision {expected}: not erased"))
                    .with_source(err)
            }
            (err, _) => err,
        })?;
        let own_chunk = |item: &Item| codec::string_attribute(item, codec::CHUNK_OF) == Some(id);
        self.erase_under(&codec::chunk_prefix(id), own_chunk).await?;
        Ok(removed.attributes.is_some())
    }

    /// Deletes every item under `prefix` that `keep` selects, through the id index (or a scan on
    /// a table not yet upgraded); how many were documents.
    async fn erase_under(&self, prefix: &str, keep: impl Fn(&Item) -> bool) -> Result<u64> {
        if self.layout_state().await? != LayoutState::Current {
            return self.erase_by_scan(prefix, &keep).await;
        }
        let mut erased = 0;
        for shard in 0..SHARD_COUNT {
            let mut cursor: Option<Item> = None;
            loop {
                let output = self.query_id_prefix(shard, prefix, None, cursor.take(), "find ids to erase").await?;
                erased += self.erase_selected(output.items(), &keep).await?;
                cursor = output.last_evaluated_key;
                if cursor.is_none() {
                    break;
                }
            }
        }
        Ok(erased)
    }

    /// Erasure on a table not yet upgraded: its older items are in no id index, so a consistent
    /// scan of the whole table finds them (cost proportional to the table, not the prefix), so
    /// that erasing a user keeps working before the upgrade.
    async fn erase_by_scan(&self, prefix: &str, keep: &impl Fn(&Item) -> bool) -> Result<u64> {
        tracing::warn!(table = %self.table(), "erasing by a full table scan: run `agentstore upgrade` to erase by index");
        let mut erased = 0;
        let mut cursor: Option<Item> = None;
        loop {
            let output = self
                .client()
                .scan()
                .table_name(self.table())
                .consistent_read(true)
                .filter_expression("begins_with(#id, :prefix)")
                .projection_expression("#id, #chunk")
                .expression_attribute_names("#id", codec::ID)
                .expression_attribute_names("#chunk", codec::CHUNK_OF)
                .expression_attribute_values(":prefix", AttributeValue::S(prefix.to_owned()))
                .set_exclusive_start_key(cursor.take())
                .send()
                .await
                .map_err(|e| map_sdk(e, "scan the table for ids to erase"))?;
            erased += self.erase_selected(output.items(), keep).await?;
            cursor = output.last_evaluated_key;
            if cursor.is_none() {
                return Ok(erased);
            }
        }
    }

    /// Deletes the items `keep` selects outright, 25 a BatchWriteItem; how many were documents
    /// (not chunks).
    async fn erase_selected(&self, items: &[Item], keep: &impl Fn(&Item) -> bool) -> Result<u64> {
        let items: Vec<&Item> = items.iter().filter(|item| keep(item)).collect();
        let ids: Vec<String> =
            items.iter().filter_map(|item| codec::string_attribute(item, codec::ID)).map(str::to_owned).collect();
        let documents = items.iter().filter(|item| !codec::is_chunk(item)).count() as u64;
        for batch in ids.chunks(super::backend::BATCH_WRITE_MAX) {
            let requests = batch
                .iter()
                .map(|id| {
                    let key = HashMap::from([(codec::ID.to_owned(), AttributeValue::S(id.clone()))]);
                    DeleteRequest::builder()
                        .set_key(Some(key))
                        .build()
                        .map(|delete| WriteRequest::builder().delete_request(delete).build())
                        .map_err(|e| Error::new(ErrorKind::Internal, "build delete request").with_source(e))
                })
                .collect::<Result<Vec<_>>>()?;
            let left = self.batch_write_with_retries(requests).await;
            self.count_cache().wrote();
            let left = left?;
            if !left.is_empty() {
                return Err(Error::new(
                    ErrorKind::Unavailable,
                    format!("DynamoDB left {} deletions of an erasure unprocessed; run the erasure again", left.len()),
                )
                .with_retries_exhausted());
            }
        }
        Ok(documents)
    }
}

/// Shards counted at once (the exact counts of a database table).
const COUNT_CONCURRENCY: usize = 8;

/// The exact counts of a database table, each shard's partition of an index counted with
/// `Select=COUNT` (`raw::count_cache` remembers them; docs/databases.md, "Document counts").
///
/// The id index (`agentstore-ids`, docs/dynamodb-layout.md) holds one entry per item that carries
/// a shard: every document's main item (live or tombstone) and every body chunk item; local
/// documents and the layout marker carry none of the shards counted. A live document is an entry
/// that is neither a chunk (`_chunkOf`) nor a tombstone (`_deleted` = true); both are projected
/// into the index, so the count reads index entries only (tens of bytes each). The feed index
/// (`agentstore-feed`) holds one entry per document, live or tombstone (chunks and local
/// documents have no `_seq`): counted whole, it is the length of the change feed.
impl DynamoDbBackend {
    /// The exact count behind `exact_count` for a database table; `None` for the data-store
    /// table and for a table without this release's layout (its older items are in no id index).
    pub(super) async fn live_document_count(&self) -> Result<Option<u64>> {
        if !self.counts_exactly() || self.layout_state().await? != LayoutState::Current {
            return Ok(None);
        }
        let count = self.count_with_check(self.count_shards(|shard| self.count_shard(shard)));
        let check = |window| self.count_fingerprint(window);
        self.count_cache().get_or_count(Counted::LiveDocuments, count, check).await.map(Some)
    }

    /// The count behind `feed_length` for a database table: the feed index's entries; `None`
    /// as for [`Self::live_document_count`].
    pub(super) async fn feed_entry_count(&self) -> Result<Option<u64>> {
        if !self.counts_exactly() || self.layout_state().await? != LayoutState::Current {
            return Ok(None);
        }
        let count = self.count_with_check(self.count_shards(|shard| self.count_feed_shard(shard)));
        let check = |window| self.count_fingerprint(window);
        self.count_cache().get_or_count(Counted::FeedEntries, count, check).await.map(Some)
    }

    /// The sum of `count_one` over every shard, [`COUNT_CONCURRENCY`] shards at once.
    async fn count_shards<'a, F, C>(&'a self, count_one: C) -> Result<u64>
    where
        C: Fn(u32) -> F,
        F: std::future::Future<Output = Result<u64>> + 'a,
    {
        futures::stream::iter(0..SHARD_COUNT)
            .map(count_one)
            .buffer_unordered(COUNT_CONCURRENCY)
            .try_fold(0u64, |total, n| async move { Ok(total + n) })
            .await
    }

    /// Entries in one shard of the feed index: `Select=COUNT` pages of at most 1 MB of entries.
    async fn count_feed_shard(&self, shard: u32) -> Result<u64> {
        let query = self
            .client()
            .query()
            .table_name(self.table())
            .index_name(FEED_INDEX)
            .key_condition_expression("#shard = :shard")
            .expression_attribute_names("#shard", SHARD)
            .expression_attribute_values(":shard", shard_value(shard));
        count_pages(query, "count the entries of the change feed index").await
    }

    /// Live documents in one shard of the id index: `Select=COUNT` pages, each at most 1 MB of
    /// index entries read, filtered to entries that are neither chunks nor tombstones.
    async fn count_shard(&self, shard: u32) -> Result<u64> {
        let query = self
            .client()
            .query()
            .table_name(self.table())
            .index_name(ID_INDEX)
            .key_condition_expression("#shard = :shard")
            // `NOT (x = true)` also holds where `_deleted` is absent (a comparison with a
            // missing attribute is false): the entries `layout::is_tombstone` says are live.
            .filter_expression("attribute_not_exists(#chunk) AND NOT (#deleted = :true)")
            .expression_attribute_names("#shard", SHARD)
            .expression_attribute_names("#chunk", codec::CHUNK_OF)
            .expression_attribute_names("#deleted", DELETED)
            .expression_attribute_values(":shard", shard_value(shard))
            .expression_attribute_values(":true", AttributeValue::Bool(true));
        count_pages(query, "count the documents of the id index").await
    }
}

/// The entries `query` matches, summed over its `Select=COUNT` pages (DynamoDB ends a page after
/// 1 MB of entries read, so one shard can take several); `what` names the count in an error.
async fn count_pages(query: QueryFluentBuilder, what: &str) -> Result<u64> {
    let mut total = 0u64;
    let mut cursor: Option<Item> = None;
    loop {
        let output = query
            .clone()
            .select(Select::Count)
            .set_exclusive_start_key(cursor.take())
            .send()
            .await
            .map_err(|e| map_sdk(e, what))?;
        total += u64::try_from(output.count()).unwrap_or(0);
        cursor = output.last_evaluated_key;
        if cursor.is_none() {
            return Ok(total);
        }
    }
}

/// The condition of a deletion that must find the item's `_rev` (`#rev`) at `expected`, and the
/// values it names: an item of an older layout may hold its revision as a number, so a revision
/// that reads as one matches either form.
fn revision_condition(expected: &Revision) -> (&'static str, Vec<(&'static str, AttributeValue)>) {
    let text = AttributeValue::S(expected.0.clone());
    if !expected.0.is_empty() && expected.0.bytes().all(|b| b.is_ascii_digit()) {
        let number = AttributeValue::N(expected.0.clone());
        ("#rev = :rev OR #rev = :revnumber", vec![(":rev", text), (":revnumber", number)])
    } else {
        ("#rev = :rev", vec![(":rev", text)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_erasure_condition_matches_either_stored_form_of_a_numeric_revision() {
        let (condition, values) = revision_condition(&Revision("2-abc".into()));
        assert_eq!(condition, "#rev = :rev");
        assert_eq!(values, vec![(":rev", AttributeValue::S("2-abc".into()))]);
        let (condition, values) = revision_condition(&Revision("17".into()));
        assert_eq!(condition, "#rev = :rev OR #rev = :revnumber");
        assert_eq!(values[1], (":revnumber", AttributeValue::N("17".into())));
    }
}
