//! [`DynamoDbBackend`]: the `DocumentBackend` over DynamoDB through the official AWS SDK.
//!
//! Every write is conditional on the `_rev` attribute it read (`attribute_not_exists(_id)` to
//! create, equality to update or delete), so the facade's optimistic concurrency holds; the
//! document model's writes are in [`super::write`], its feed in [`super::feed`], id order and
//! erasure in [`super::ids`], local documents in [`super::local`], the layout in
//! [`super::layout`] and its upgrade in [`super::upgrade`].
//! Listings query the GSI, whose reads are eventually consistent in DynamoDB: a write is not
//! always visible to the very next listing. Direct reads (`get`, `scan`) are strongly consistent.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use aws_config::{BehaviorVersion, Region};
use aws_sdk_dynamodb::types::AttributeValue;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, GlobalSecondaryIndex, IndexStatus, KeySchemaElement, KeyType, KeysAndAttributes,
    Projection as DynamoProjection, ProjectionType, ScalarAttributeType, TableDescription, TableStatus, WriteRequest,
};
use aws_sdk_dynamodb::Client;
use backon::{BackoffBuilder, ExponentialBuilder};
use futures::StreamExt;
use serde_json::{Map, Value};

use super::codec::{self, Item};
use super::config::DynamoConfig;
use super::error::{map_sdk, map_sdk_write};
use super::layout;
use crate::backend::raw::count_cache::CountCache;
use crate::backend::{
    BulkWrite, ChangesPage, DocumentBackend, EraseOptions, IdRange, LayoutState, Page, Precondition, Projection, Query,
    ReplicatedOutcome, ReplicatedRevision, Revision, RevisionInfo, StoredDocument, UpgradePage,
};
use crate::error::{Error, ErrorKind, Result};
use crate::model::fields;

/// BatchWriteItem's limit.
pub(super) const BATCH_WRITE_MAX: usize = 25;
/// BatchGetItem's limit, and such calls of one batch read in flight at once.
pub(super) const BATCH_GET_MAX: usize = 100;
const BATCH_GET_CONCURRENCY: usize = 4;
/// Conditional writes of a bulk request run this many at a time.
const CONDITIONAL_WRITE_CONCURRENCY: usize = 16;
/// Rounds of retrying UnprocessedItems before reporting them as unavailable.
const UNPROCESSED_RETRIES: usize = 8;

pub struct DynamoDbBackend {
    client: Client,
    config: DynamoConfig,
    /// Set once the table was seen with this release's layout (a layout never goes back).
    layout_current: AtomicBool,
    /// The last exact document count, for a moment ([`super::count`]).
    counts: CountCache,
}

impl DynamoDbBackend {
    /// Connects with the standard AWS configuration chain and checks (or creates) the table.
    pub async fn open(config: &DynamoConfig) -> Result<Self> {
        let backend = DynamoDbBackend::new(Self::connect(config).await?, config);
        backend.check_table().await?;
        Ok(backend)
    }

    /// An SDK client from the standard AWS configuration chain, with this adapter's retries and
    /// timeouts. No request is made.
    pub(super) async fn connect(config: &DynamoConfig) -> Result<Client> {
        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .retry_config(super::config::sdk_retry_config())
            .timeout_config(super::config::sdk_timeout_config());
        if let Some(region) = &config.region {
            loader = loader.region(Region::new(region.clone()));
        }
        if let Some(endpoint) = &config.endpoint {
            loader = loader.endpoint_url(endpoint);
        }
        let sdk = loader.load().await;
        if sdk.region().is_none() {
            return Err(Error::new(
                ErrorKind::Misconfigured,
                "DynamoDB needs a region: add ?region=… to the backend URL or set AWS_REGION",
            ));
        }
        Ok(Client::new(&sdk))
    }

    /// Client over an already-built SDK configuration (tests point this at mock servers).
    pub async fn with_sdk_config(sdk: &aws_config::SdkConfig, config: &DynamoConfig) -> Result<Self> {
        let backend = DynamoDbBackend::new(Client::new(sdk), config);
        backend.check_table().await?;
        Ok(backend)
    }

    pub(super) fn new(client: Client, config: &DynamoConfig) -> Self {
        DynamoDbBackend {
            client,
            config: config.clone(),
            layout_current: AtomicBool::new(false),
            counts: CountCache::new(config.count_max_age),
        }
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    pub(super) fn table(&self) -> &str {
        &self.config.table
    }

    pub(super) fn revs_limit(&self) -> usize {
        self.config.revs_limit
    }

    pub(super) fn settle(&self) -> Duration {
        self.config.settle
    }

    pub(super) fn write_timeout(&self) -> Duration {
        self.config.write_timeout
    }

    /// Whether `exact_count` counts this table: a database table's, not the data-store table's
    /// (docs/databases.md, "Document counts", says why).
    pub(super) fn counts_exactly(&self) -> bool {
        !self.config.user_index
    }

    pub(super) fn count_cache(&self) -> &CountCache {
        &self.counts
    }

    pub(super) fn describe_store(&self) -> String {
        self.config.redacted()
    }

    pub(super) fn layout_known_current(&self) -> bool {
        self.layout_current.load(Ordering::Relaxed)
    }

    pub(super) fn remember_layout_current(&self) {
        self.layout_current.store(true, Ordering::Relaxed);
    }

    /// The table's current description.
    pub(super) async fn describe(&self) -> Result<TableDescription> {
        let output = self
            .client
            .describe_table()
            .table_name(&self.config.table)
            .send()
            .await
            .map_err(|e| map_sdk(e, &format!("describe table {:?}", self.config.table)))?;
        output.table.ok_or_else(|| {
            Error::new(ErrorKind::Internal, format!("DynamoDB described table {:?} as nothing", self.config.table))
        })
    }

    /// The table must exist with `_id` as its hash key and the GSI on `userId` + `namespace`,
    /// both ACTIVE. Created (on-demand) only when configured to.
    pub(super) async fn check_table(&self) -> Result<()> {
        let table = &self.config.table;
        let described = match self.client.describe_table().table_name(table).send().await {
            Ok(output) => output.table,
            Err(err) => {
                let err = map_sdk(err, &format!("describe table {table:?}"));
                if err.kind() != ErrorKind::Misconfigured {
                    return Err(err);
                }
                if !self.config.create {
                    return Err(Error::new(
                        ErrorKind::Misconfigured,
                        format!(
                            "DynamoDB table {table:?} does not exist; create it, or add create=true to the backend URL"
                        ),
                    ));
                }
                let created = self.create_table().await?;
                self.wait_until_active().await?;
                if created {
                    // A table this release created has its layout from the start.
                    self.write_marker().await?;
                }
                return Ok(());
            }
        };
        let Some(description) = described else {
            return Err(Error::new(ErrorKind::Internal, format!("DynamoDB described table {table:?} as nothing")));
        };
        let hash_key = description
            .key_schema()
            .iter()
            .find(|k| k.key_type() == &KeyType::Hash)
            .map(|k| k.attribute_name().to_owned());
        if hash_key.as_deref() != Some(codec::ID) {
            return Err(Error::new(
                ErrorKind::Misconfigured,
                format!("DynamoDB table {table:?} has hash key {hash_key:?}; the data store needs \"_id\""),
            ));
        }
        let has_index = !self.config.user_index
            || description.global_secondary_indexes().iter().any(|gsi| {
                gsi.index_name() == Some(self.config.index.as_str()) && {
                    let keys: Vec<(&str, &KeyType)> =
                        gsi.key_schema().iter().map(|k| (k.attribute_name(), k.key_type())).collect();
                    keys.contains(&(fields::USER_ID, &KeyType::Hash))
                        && keys.contains(&(fields::NAMESPACE, &KeyType::Range))
                }
            });
        if !has_index {
            return Err(Error::new(
                ErrorKind::Misconfigured,
                format!(
                    "DynamoDB table {table:?} has no global secondary index {:?} on userId (hash) + namespace (range); \
                     listings would need full table scans, so the backend refuses to start without it",
                    self.config.index
                ),
            ));
        }
        self.wait_until_active().await
    }

    /// Creates the table with every index; `false` when another process was creating it.
    pub(super) async fn create_table(&self) -> Result<bool> {
        let attribute = |name: &str| {
            AttributeDefinition::builder()
                .attribute_name(name)
                .attribute_type(ScalarAttributeType::S)
                .build()
                .map_err(|e| Error::new(ErrorKind::Internal, "build attribute definition").with_source(e))
        };
        let key = |name: &str, kind: KeyType| {
            KeySchemaElement::builder()
                .attribute_name(name)
                .key_type(kind)
                .build()
                .map_err(|e| Error::new(ErrorKind::Internal, "build key schema").with_source(e))
        };
        let index = GlobalSecondaryIndex::builder()
            .index_name(&self.config.index)
            .key_schema(key(fields::USER_ID, KeyType::Hash)?)
            .key_schema(key(fields::NAMESPACE, KeyType::Range)?)
            .projection(DynamoProjection::builder().projection_type(ProjectionType::All).build())
            .build()
            .map_err(|e| Error::new(ErrorKind::Internal, "build index definition").with_source(e))?;
        let mut attributes = vec![attribute(codec::ID)?, attribute(fields::USER_ID)?, attribute(fields::NAMESPACE)?];
        attributes.extend(layout::index_attributes()?);
        let mut indexes = Vec::new();
        if self.config.user_index {
            indexes.push(index);
        } else {
            // DynamoDB refuses attribute definitions no key uses.
            attributes.retain(|a| ![fields::USER_ID, fields::NAMESPACE].contains(&a.attribute_name()));
        }
        indexes.extend(layout::new_indexes()?);
        let result = self
            .client
            .create_table()
            .table_name(&self.config.table)
            .billing_mode(BillingMode::PayPerRequest)
            .set_attribute_definitions(Some(attributes))
            .key_schema(key(codec::ID, KeyType::Hash)?)
            .set_global_secondary_indexes(Some(indexes))
            .send()
            .await;
        match result {
            // Another process is creating it at the same moment: wait for it like for our own.
            Err(e) if e.as_service_error().is_some_and(|s| s.is_resource_in_use_exception()) => {
                tracing::info!(table = %self.config.table, "DynamoDB table is being created by another process");
                Ok(false)
            }
            Err(e) => Err(map_sdk(e, &format!("create table {:?}", self.config.table))),
            Ok(_) => {
                tracing::info!(table = %self.config.table, index = %self.config.index, "created DynamoDB table");
                Ok(true)
            }
        }
    }

    async fn wait_until_active(&self) -> Result<()> {
        self.wait_until_active_within(Duration::from_secs(120)).await
    }

    /// Waits until the table (and its user/namespace index, when it has one) is ACTIVE; an
    /// `Unavailable` error after `limit`.
    pub(super) async fn wait_until_active_within(&self, limit: Duration) -> Result<()> {
        let deadline = std::time::Instant::now() + limit;
        loop {
            let table = self.describe().await?;
            let ready = table.table_status() == Some(&TableStatus::Active)
                && table
                    .global_secondary_indexes()
                    .iter()
                    .filter(|g| g.index_name() == Some(self.config.index.as_str()))
                    .all(|g| g.index_status() == Some(&IndexStatus::Active));
            if ready {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                return Err(Error::new(
                    ErrorKind::Unavailable,
                    format!(
                        "DynamoDB table {:?} or its index did not become ACTIVE within {} s",
                        self.config.table,
                        limit.as_secs()
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    pub(super) fn key(id: &str) -> HashMap<String, AttributeValue> {
        HashMap::from([(codec::ID.to_owned(), AttributeValue::S(id.to_owned()))])
    }

    /// Reads the extra chunks of a main item's body; `None` when one is gone, which means the item
    /// read was an old revision (a GSI query can return one) whose chunks were already replaced.
    async fn read_chunks(&self, id: &str, rev: &str, count: usize) -> Result<Option<Vec<Vec<u8>>>> {
        let mut chunks = Vec::with_capacity(count);
        for n in 1..=count {
            let output = self
                .consistent_get(&codec::chunk_id(id, rev, n))
                .send()
                .await
                .map_err(|e| map_sdk(e, "read a document chunk"))?;
            match output.item().and_then(|item| item.get(codec::BODY)) {
                Some(AttributeValue::B(blob)) => chunks.push(blob.as_ref().to_vec()),
                _ => return Ok(None),
            }
        }
        Ok(Some(chunks))
    }

    /// A main item from a possibly stale read (GSI query, scan page) as a stored document; when
    /// the item has moved on since, the current one is read consistently (`None`: deleted since).
    async fn to_current_document(&self, item: &Item) -> Result<Option<StoredDocument>> {
        match self.to_document(item).await? {
            Some(doc) => Ok(Some(doc)),
            None => {
                let id = codec::string_attribute(item, codec::ID).unwrap_or_default().to_owned();
                self.get(&id).await
            }
        }
    }

    /// A main item as a stored document, reading chunks when its body continues in them; `None`
    /// when its chunks are gone (the item is an old revision).
    async fn to_document(&self, item: &Item) -> Result<Option<StoredDocument>> {
        let id = codec::string_attribute(item, codec::ID)
            .ok_or_else(|| Error::new(ErrorKind::Corrupt, "DynamoDB item without a string _id"))?
            .to_owned();
        let rev = match item.get(codec::REV) {
            Some(AttributeValue::S(rev)) => rev.clone(),
            Some(AttributeValue::N(rev)) => rev.clone(),
            _ => String::from("0"),
        };
        let chunks = match codec::extra_chunk_count(item) {
            0 => Vec::new(),
            count => match self.read_chunks(&id, &rev, count).await? {
                Some(chunks) => chunks,
                None => return Ok(None),
            },
        };
        let body = codec::decode(item, &chunks)?;
        Ok(Some(StoredDocument { id, rev: Revision(rev), body }))
    }

    pub(super) async fn delete_chunks(&self, id: &str, rev: &str, count: usize) {
        for n in 1..=count {
            let chunk = codec::chunk_id(id, rev, n);
            if let Err(err) =
                self.client.delete_item().table_name(&self.config.table).set_key(Some(Self::key(&chunk))).send().await
            {
                // Unreferenced chunks are garbage, never read; a failed cleanup loses nothing.
                tracing::warn!(chunk = %chunk, error = %map_sdk(err, "delete an old chunk"), "left an old chunk behind");
            }
        }
    }

    pub(super) async fn write_chunks(&self, id: &str, rev: &str, chunks: &[Vec<u8>]) -> Result<()> {
        for (i, chunk) in chunks.iter().enumerate() {
            let chunk_id = codec::chunk_id(id, rev, i + 1);
            let item = HashMap::from([
                // In the id index under the document's prefix, so an erasure finds every chunk.
                (layout::SHARD.to_owned(), AttributeValue::N(layout::shard_of(&chunk_id).to_string())),
                (codec::ID.to_owned(), AttributeValue::S(chunk_id)),
                (codec::CHUNK_OF.to_owned(), AttributeValue::S(id.to_owned())),
                (codec::BODY.to_owned(), AttributeValue::B(aws_sdk_dynamodb::primitives::Blob::new(chunk.clone()))),
            ]);
            self.client
                .put_item()
                .table_name(&self.config.table)
                .set_item(Some(item))
                .send()
                .await
                .map_err(|e| map_sdk_write(e, "write a document chunk"))?;
        }
        Ok(())
    }
}

impl DynamoDbBackend {
    /// A strongly consistent GetItem of `id`, to send as it is or narrowed by a projection.
    pub(super) fn consistent_get(
        &self,
        id: &str,
    ) -> aws_sdk_dynamodb::operation::get_item::builders::GetItemFluentBuilder {
        self.client.get_item().table_name(&self.config.table).set_key(Some(Self::key(id))).consistent_read(true)
    }

    /// Whether the stored document `id` is at revision `rev` (a consistent read of `_rev` only).
    /// A failed read answers `false`: the caller then reports what it already knew.
    pub(super) async fn holds_revision(&self, id: &str, rev: &str) -> bool {
        let read = self
            .consistent_get(id)
            .projection_expression("#rev")
            .expression_attribute_names("#rev", codec::REV)
            .send()
            .await;
        match read {
            Ok(output) => output.item.as_ref().and_then(|item| codec::string_attribute(item, codec::REV)) == Some(rev),
            Err(err) => {
                tracing::warn!(id, error = %map_sdk(err, "read a revision"), "cannot tell whether a resent write had landed");
                false
            }
        }
    }

    /// `bulk_write` of writes to distinct ids.
    async fn write_distinct_ids(&self, writes: Vec<BulkWrite>) -> Result<Vec<Result<Revision>>> {
        // Every write, unconditional ones too, writes conditionally on the revision it replaces
        // (BatchWriteItem carries no condition), several at a time; what they replace is read
        // first in consistent batches. A `NeverWritten` create replaces nothing or fails: it is
        // not read, its condition `attribute_not_exists` is the whole check.
        let ids: Vec<String> =
            writes.iter().filter(|w| w.precondition != Precondition::NeverWritten).map(|w| w.id.clone()).collect();
        let known = if ids.is_empty() { HashMap::new() } else { self.read_current_many(&ids).await? };
        let known = &known;
        Ok(futures::stream::iter(writes)
            .map(|write| async move {
                let current = match write.precondition {
                    Precondition::NeverWritten => Some(None),
                    _ => Some(known.get(&write.id).cloned()),
                };
                self.put_document(&write.id, &write.body, write.precondition, current).await
            })
            .buffered(CONDITIONAL_WRITE_CONCURRENCY)
            .collect()
            .await)
    }
}

pub(super) fn encode_token(key: &HashMap<String, AttributeValue>) -> Result<String> {
    let map: Map<String, Value> = key
        .iter()
        .map(|(name, value)| match value {
            AttributeValue::S(text) => Ok((name.clone(), Value::String(text.clone()))),
            _ => Err(Error::new(ErrorKind::Internal, "DynamoDB returned a non-string key in LastEvaluatedKey")),
        })
        .collect::<Result<_>>()?;
    serde_json::to_string(&map).map_err(|e| Error::new(ErrorKind::Internal, "encode page token").with_source(e))
}

pub(super) fn decode_token(token: &str) -> Result<HashMap<String, AttributeValue>> {
    let map: Map<String, Value> =
        serde_json::from_str(token).map_err(|_| Error::invalid("page token", "was not produced by this backend"))?;
    map.into_iter()
        .map(|(name, value)| match value {
            Value::String(text) => Ok((name, AttributeValue::S(text))),
            _ => Err(Error::invalid("page token", "was not produced by this backend")),
        })
        .collect()
}

#[async_trait]
impl DocumentBackend for DynamoDbBackend {
    fn describe(&self) -> String {
        self.config.redacted()
    }

    fn url(&self) -> Option<crate::backend::BackendUrl> {
        Some(crate::backend::BackendUrl::DynamoDb(self.config.clone()))
    }

    async fn get(&self, id: &str) -> Result<Option<StoredDocument>> {
        let output = self.consistent_get(id).send().await.map_err(|e| map_sdk(e, "read a document"))?;
        match output.item {
            Some(item) if !layout::is_hidden(&item) && !layout::is_tombstone(&item) => match self
                .to_document(&item)
                .await?
            {
                Some(doc) => Ok(Some(doc)),
                // A consistent read of the current revision must find its chunks.
                None => Err(Error::new(ErrorKind::Corrupt, format!("DynamoDB document {id:?} is missing body chunks"))),
            },
            _ => Ok(None),
        }
    }

    async fn get_deleted(&self, id: &str) -> Result<Option<StoredDocument>> {
        let output = self.consistent_get(id).send().await.map_err(|e| map_sdk(e, "read a tombstone"))?;
        match output.item {
            Some(item) if !layout::is_hidden(&item) && layout::is_tombstone(&item) => {
                let rev = codec::string_attribute(&item, codec::REV).unwrap_or("").to_owned();
                let body = layout::deleted_body(id, &item)?;
                Ok(Some(StoredDocument { id: id.to_owned(), rev: Revision(rev), body }))
            }
            _ => Ok(None),
        }
    }

    async fn get_many(&self, ids: &[String]) -> Result<Vec<Option<StoredDocument>>> {
        crate::backend::batched_get_many(ids, BATCH_GET_MAX, BATCH_GET_CONCURRENCY, |ids| self.read_keys(ids)).await
    }

    async fn put(&self, id: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision> {
        // A `NeverWritten` create replaces nothing or fails on its condition: nothing to read.
        let known = (precondition == Precondition::NeverWritten).then_some(None);
        self.put_document(id, body, precondition, known).await
    }

    async fn delete(&self, id: &str, rev: &Revision) -> Result<Revision> {
        self.delete_document(id, rev).await
    }

    async fn put_replicated(&self, id: &str, incoming: &ReplicatedRevision) -> Result<ReplicatedOutcome> {
        self.put_replicated_document(id, incoming).await
    }

    async fn query(&self, query: &Query, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        if !self.config.user_index {
            return Err(Error::new(
                ErrorKind::Misconfigured,
                format!(
                    "DynamoDB table {:?} is a database table without the user/namespace index; only the data-store \
                     table answers listings",
                    self.config.table
                ),
            ));
        }
        let mut request = self
            .client
            .query()
            .table_name(&self.config.table)
            .index_name(&self.config.index)
            .limit(i32::try_from(limit.max(1)).unwrap_or(i32::MAX))
            .expression_attribute_names("#u", fields::USER_ID)
            .expression_attribute_values(":u", AttributeValue::S(query.user_id.clone()));
        request = match &query.namespace {
            Some(namespace) => request
                .key_condition_expression("#u = :u AND #n = :n")
                .expression_attribute_names("#n", fields::NAMESPACE)
                .expression_attribute_values(":n", AttributeValue::S(namespace.clone())),
            None => request.key_condition_expression("#u = :u"),
        };
        // Project only when every wanted field is one kept native on every item.
        let native_fields = [fields::USER_ID, fields::NAMESPACE, fields::KEY];
        let projected = match &query.projection {
            Projection::Fields(wanted) if wanted.iter().all(|f| native_fields.contains(f)) => Some(wanted.clone()),
            _ => None,
        };
        if let Some(wanted) = &projected {
            let mut names = vec![("#pid", codec::ID), ("#prev", codec::REV)];
            let aliases = ["#p0", "#p1", "#p2"];
            for (alias, field) in aliases.iter().zip(wanted.iter()) {
                names.push((alias, field));
            }
            request = request.projection_expression(names.iter().map(|(a, _)| *a).collect::<Vec<_>>().join(", "));
            for (alias, field) in names {
                request = request.expression_attribute_names(alias, field);
            }
        }
        if let Some(token) = page_token {
            request = request.set_exclusive_start_key(Some(decode_token(token)?));
        }
        let output = request.send().await.map_err(|e| map_sdk(e, "query the user/namespace index"))?;
        let mut items = Vec::with_capacity(output.items().len());
        for item in output.items() {
            let mut doc = match &projected {
                Some(_) => StoredDocument {
                    id: codec::string_attribute(item, codec::ID).unwrap_or_default().to_owned(),
                    rev: Revision(codec::string_attribute(item, codec::REV).unwrap_or_default().to_owned()),
                    body: codec::decode(item, &[])?,
                },
                None => match self.to_current_document(item).await? {
                    Some(doc) => doc,
                    None => continue,
                },
            };
            if let Projection::Fields(wanted) = &query.projection {
                doc.body.retain(|name, _| wanted.contains(&name.as_str()));
            }
            items.push(doc);
        }
        let next = output.last_evaluated_key().map(encode_token).transpose()?;
        Ok(Page { items, next })
    }

    async fn ensure_standard_indexes(&self) -> Result<()> {
        // The GSI is checked (or created) when the backend opens; nothing to do per startup.
        Ok(())
    }

    async fn ensure_namespace_indexed(&self, _namespace: &str) -> Result<()> {
        // One GSI serves every namespace.
        Ok(())
    }

    async fn bulk_write(&self, writes: Vec<BulkWrite>) -> Result<Vec<Result<Revision>>> {
        crate::backend::bulk_write_in_id_rounds(writes, |round| self.write_distinct_ids(round)).await
    }

    async fn scan(&self, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        let mut request = self
            .client
            .scan()
            .table_name(&self.config.table)
            .consistent_read(true)
            .limit(i32::try_from(limit.max(1)).unwrap_or(i32::MAX));
        if let Some(token) = page_token {
            request = request.set_exclusive_start_key(Some(decode_token(token)?));
        }
        let output = request.send().await.map_err(|e| map_sdk(e, "scan the table"))?;
        let mut items = Vec::new();
        for item in output.items().iter().filter(|item| !layout::is_hidden(item) && !layout::is_tombstone(item)) {
            if let Some(doc) = self.to_current_document(item).await? {
                items.push(doc);
            }
        }
        let next = output.last_evaluated_key().map(encode_token).transpose()?;
        Ok(Page { items, next })
    }

    async fn health(&self) -> Result<()> {
        self.describe().await.map(|_| ())
    }

    async fn approximate_count(&self) -> Result<Option<u64>> {
        // DynamoDB refreshes ItemCount about every six hours, and it counts chunk and bookkeeping
        // items and tombstones too.
        Ok(self.describe().await?.item_count().and_then(|n| u64::try_from(n).ok()))
    }

    /// A database table's live documents (design documents included), counted over the id
    /// index with `Select=COUNT` queries (`ids.rs`): no body is read, but every entry of
    /// the index is, so a count costs about one read unit per 8 KB of index (tens of bytes an
    /// entry: some 60 read units per 10,000 documents) and one query per shard and MB. A count is
    /// served again, for at most `count_max_age_ms` (default 60 s) and never after a write of
    /// this process, only when its check holds (`count_check.rs`: 16 small queries and a
    /// `GetItem`, some 9 read units whatever the table's size). The index trails the table by DynamoDB's index propagation (usually well under a
    /// second; immediate on dynalite), as `all_docs` does. The data-store table answers `None`:
    /// it is every user's data, and its `doc_count` stays `ItemCount` (docs/databases.md).
    async fn exact_count(&self) -> Result<Option<u64>> {
        self.live_document_count().await
    }

    async fn feed_length(&self) -> Result<Option<u64>> {
        self.feed_entry_count().await
    }

    async fn revisions(&self, id: &str) -> Result<Option<RevisionInfo>> {
        self.revision_info(id).await
    }

    async fn changes(&self, since: Option<&str>, limit: usize) -> Result<ChangesPage> {
        self.changes_page(since, limit).await
    }

    async fn change_position(&self) -> Result<String> {
        self.require_layout("the change feed").await?;
        Ok(self.position_now())
    }

    fn change_feed_delay(&self) -> std::time::Duration {
        self.config.settle
    }

    fn position_order(&self, a: &str, b: &str) -> Option<std::cmp::Ordering> {
        self.feed_position_order(a, b)
    }

    async fn all_docs(&self, range: &IdRange, limit: usize, page_token: Option<&str>) -> Result<Page<StoredDocument>> {
        self.all_docs_page(range, limit, page_token).await
    }

    async fn erase_prefix(&self, prefix: &str) -> Result<u64> {
        self.traced(self.erase_ids_with_prefix(prefix)).await
    }

    async fn erase_id(&self, id: &str, options: &EraseOptions) -> Result<bool> {
        self.traced(self.erase_one_id(id, options)).await
    }

    async fn get_local(&self, name: &str) -> Result<Option<StoredDocument>> {
        self.read_local(name).await
    }

    async fn get_many_local(&self, names: &[String]) -> Result<Vec<Option<StoredDocument>>> {
        crate::backend::batched_get_many(names, BATCH_GET_MAX, BATCH_GET_CONCURRENCY, |names| {
            self.read_local_keys(names)
        })
        .await
    }

    fn checks_never_written(&self) -> bool {
        // A create's condition is `attribute_not_exists`, which a tombstone item fails.
        true
    }

    async fn put_local(&self, name: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision> {
        self.write_local(name, body, precondition).await
    }

    async fn delete_local(&self, name: &str, rev: &Revision) -> Result<()> {
        self.remove_local(name, rev).await
    }

    async fn local_docs(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> Result<Page<StoredDocument>> {
        self.local_docs_page(range, limit, page_token).await
    }

    async fn layout(&self) -> Result<LayoutState> {
        self.layout_state().await
    }

    async fn upgrade_page(&self, page_token: Option<&str>, limit: usize) -> Result<UpgradePage> {
        self.upgrade_step(page_token, limit).await
    }

    async fn finish_upgrade(&self) -> Result<()> {
        self.finish_layout_upgrade().await
    }

    fn attachment_chunk_bytes(&self) -> usize {
        self.attachment_chunk_size()
    }

    async fn put_attachment_chunk(&self, blob: &str, index: u64, bytes: bytes::Bytes) -> Result<()> {
        self.put_chunk(blob, index, bytes).await
    }

    async fn get_attachment_chunk(&self, blob: &str, index: u64) -> Result<Option<bytes::Bytes>> {
        self.get_chunk(blob, index).await
    }

    async fn delete_attachment_blob(&self, blob: &str) -> Result<u64> {
        self.delete_blob(blob).await
    }

    async fn attachment_blobs(&self, limit: usize, page_token: Option<&str>) -> Result<Page<String>> {
        self.list_blobs(limit, page_token).await
    }
}

impl DynamoDbBackend {
    /// BatchWriteItem, retrying UnprocessedItems with backoff and jitter; returns what is still
    /// unprocessed after the retries.
    pub(super) async fn batch_write_with_retries(&self, requests: Vec<WriteRequest>) -> Result<Vec<WriteRequest>> {
        let mut pending = requests;
        let mut backoff = ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(50))
            .with_max_delay(Duration::from_secs(2))
            .with_jitter()
            .with_max_times(UNPROCESSED_RETRIES)
            .build();
        loop {
            let table = self.config.table.clone();
            let batch = pending.clone();
            // The SDK owns retrying a failed request; these rounds only resend what DynamoDB
            // accepted the request for but left unprocessed.
            let output = self
                .client
                .batch_write_item()
                .request_items(table, batch)
                .send()
                .await
                .map_err(|e| map_sdk(e, "write documents in bulk"))?;
            pending = output.unprocessed_items().and_then(|m| m.get(&self.config.table)).cloned().unwrap_or_default();
            if pending.is_empty() {
                return Ok(pending);
            }
            match backoff.next() {
                Some(delay) => {
                    tracing::debug!(unprocessed = pending.len(), ?delay, "DynamoDB left items unprocessed; retrying");
                    tokio::time::sleep(delay).await;
                }
                None => return Ok(pending),
            }
        }
    }

    /// The current documents of `ids` (distinct, at most [`BATCH_GET_MAX`]): one strongly
    /// consistent BatchGetItem for the main items, then each large body's chunks as `get` reads
    /// them. A main item whose chunks were replaced between the two reads is read again by `get`.
    async fn read_keys(&self, ids: Vec<String>) -> Result<Vec<(String, StoredDocument)>> {
        let mut found = Vec::with_capacity(ids.len());
        for item in self.batch_get_with_retries(&ids).await? {
            if layout::is_hidden(&item) || layout::is_tombstone(&item) {
                continue;
            }
            let doc = match self.to_document(&item).await? {
                Some(doc) => Some(doc),
                None => self.get(codec::string_attribute(&item, codec::ID).unwrap_or_default()).await?,
            };
            if let Some(doc) = doc {
                found.push((doc.id.clone(), doc));
            }
        }
        Ok(found)
    }

    /// BatchGetItem with consistent reads, retrying UnprocessedKeys (DynamoDB leaves some when
    /// throttled or past 16 MB of answer) with backoff and jitter; the items found, in no order.
    /// Keys still unprocessed after the retries fail the read: a batch read has no partial answer.
    pub(super) async fn batch_get_with_retries(&self, ids: &[String]) -> Result<Vec<Item>> {
        let consistent = |keys| {
            KeysAndAttributes::builder()
                .set_keys(Some(keys))
                .consistent_read(true)
                .build()
                .map_err(|e| Error::new(ErrorKind::Internal, "build batch read request").with_source(e))
        };
        let mut pending = consistent(ids.iter().map(|id| Self::key(id)).collect())?;
        let mut backoff = ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(50))
            .with_max_delay(Duration::from_secs(2))
            .with_jitter()
            .with_max_times(UNPROCESSED_RETRIES)
            .build();
        let mut items = Vec::with_capacity(ids.len());
        loop {
            // The SDK is the one owner of retries for the request itself (docs/faults.md); this
            // loop only asks again for keys DynamoDB left unprocessed.
            let mut output = self
                .client
                .batch_get_item()
                .request_items(self.config.table.clone(), pending.clone())
                .send()
                .await
                .map_err(|e| map_sdk(e, "read documents in a batch"))?;
            if let Some(mut responses) = output.responses.take() {
                items.extend(responses.remove(&self.config.table).unwrap_or_default());
            }
            match output.unprocessed_keys.take().and_then(|mut left| left.remove(&self.config.table)) {
                // Asked again as consistent reads whatever the answer says of them.
                Some(left) if !left.keys().is_empty() => pending = consistent(left.keys)?,
                _ => return Ok(items),
            }
            match backoff.next() {
                Some(delay) => {
                    tracing::debug!(
                        unprocessed = pending.keys().len(),
                        ?delay,
                        "DynamoDB left keys unprocessed; retrying"
                    );
                    tokio::time::sleep(delay).await;
                }
                None => {
                    return Err(Error::new(
                        ErrorKind::Unavailable,
                        format!(
                            "DynamoDB left {} of {} keys unprocessed after {UNPROCESSED_RETRIES} retries",
                            pending.keys().len(),
                            ids.len()
                        ),
                    ))
                }
            }
        }
    }
}
