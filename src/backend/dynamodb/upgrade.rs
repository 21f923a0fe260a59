//! Bringing a table to this release's layout (docs/dynamodb-layout.md): reading the layout
//! marker, creating the missing sharded indexes and waiting for them, stamping the items of the
//! previous release with feed positions and ancestry, and writing the marker.

use std::collections::HashMap;
use std::time::Duration;

use aws_sdk_dynamodb::error::ProvideErrorMetadata;
use aws_sdk_dynamodb::types::{
    AttributeValue, BillingMode, CreateGlobalSecondaryIndexAction, GlobalSecondaryIndexUpdate, KeyType,
    ProvisionedThroughput,
};

use super::backend::{decode_token, encode_token, DynamoDbBackend};
use super::codec::{self, Item};
use super::error::map_sdk;
use super::layout::*;
use crate::backend::{LayoutState, UpgradePage, LOCAL_PREFIX};
use crate::error::{Error, ErrorKind, Result};

/// How long an upgrade waits for DynamoDB to build an added index over the existing items.
const INDEX_BUILD_WAIT: Duration = Duration::from_secs(30 * 60);

impl DynamoDbBackend {
    /// Whether the table has this release's layout: both indexes and the marker.
    pub(super) async fn layout_state(&self) -> Result<LayoutState> {
        if self.layout_known_current() {
            return Ok(LayoutState::Current);
        }
        let table = self.describe().await?;
        let missing = missing_indexes(&table);
        if !missing.is_empty() {
            return Ok(LayoutState::NeedsUpgrade(format!("the table has no index {}", missing.join(" or "))));
        }
        let marker = self
            .consistent_get(MARKER_ID)
            .send()
            .await
            .map_err(|e| map_sdk(e, "read the layout marker"))?
            .item
            .and_then(|item| match item.get(VERSION) {
                Some(AttributeValue::N(n)) => n.parse::<u32>().ok(),
                _ => None,
            });
        match marker {
            Some(version) if version >= LAYOUT_VERSION => {
                self.remember_layout_current();
                Ok(LayoutState::Current)
            }
            _ => Ok(LayoutState::NeedsUpgrade(
                "its documents have not all been given revision ancestry and feed positions".into(),
            )),
        }
    }

    /// The error for `feature` on a table without this release's layout; `Ok` when it has it.
    pub(super) async fn require_layout(&self, feature: &str) -> Result<()> {
        match self.layout_state().await? {
            LayoutState::Current => Ok(()),
            LayoutState::NeedsUpgrade(why) => Err(crate::backend::needs_upgrade(&self.describe_store(), feature, &why)),
        }
    }

    /// Records the layout marker (this release's version and the shard count). An update, not a
    /// put: a database table's creation id and deletion mark on the marker (`catalog.rs`) stay.
    pub(super) async fn write_marker(&self) -> Result<()> {
        self.client()
            .update_item()
            .table_name(self.table())
            .set_key(Some(Self::key(MARKER_ID)))
            .update_expression("SET #meta = :meta, #version = :version, #shards = :shards")
            .expression_attribute_names("#meta", META)
            .expression_attribute_names("#version", VERSION)
            .expression_attribute_names("#shards", SHARDS)
            .expression_attribute_values(":meta", AttributeValue::S("layout".into()))
            .expression_attribute_values(":version", AttributeValue::N(LAYOUT_VERSION.to_string()))
            .expression_attribute_values(":shards", AttributeValue::N(SHARD_COUNT.to_string()))
            .send()
            .await
            .map_err(|e| map_sdk(e, "write the layout marker"))?;
        Ok(())
    }

    /// The layout marker of a new database table, whole: this release's layout and the database's
    /// creation id (`catalog.rs`), written in one conditional put so that no reader sees the one
    /// without the other.
    pub(super) fn new_database_marker(creation: &str) -> Item {
        HashMap::from([
            (codec::ID.to_owned(), AttributeValue::S(MARKER_ID.into())),
            (META.to_owned(), AttributeValue::S("layout".into())),
            (VERSION.to_owned(), AttributeValue::N(LAYOUT_VERSION.to_string())),
            (SHARDS.to_owned(), AttributeValue::N(SHARD_COUNT.to_string())),
            (CREATION.to_owned(), AttributeValue::S(creation.to_owned())),
        ])
    }

    /// Adds the missing document-model indexes (one UpdateTable each: DynamoDB builds one new
    /// index at a time) and waits until they are ACTIVE. A server that accepts the request but
    /// adds no index (dynalite 4.0.0 ignores `Create`) is reported, not waited on.
    pub(super) async fn create_missing_indexes(&self) -> Result<()> {
        let table = self.describe().await?;
        // A provisioned table's new index needs its own capacity (an on-demand one must have none):
        // the table's is copied.
        let throughput = table
            .provisioned_throughput()
            .filter(|_| {
                table.billing_mode_summary().and_then(|b| b.billing_mode()) != Some(&BillingMode::PayPerRequest)
            })
            .and_then(|t| {
                ProvisionedThroughput::builder()
                    .read_capacity_units(t.read_capacity_units().unwrap_or(1).max(1))
                    .write_capacity_units(t.write_capacity_units().unwrap_or(1).max(1))
                    .build()
                    .ok()
            });
        for name in missing_indexes(&table) {
            let Some((_, hash, range, projected)) = index_shapes().into_iter().find(|(n, ..)| *n == name) else {
                continue;
            };
            let create = CreateGlobalSecondaryIndexAction::builder()
                .index_name(name)
                .key_schema(key(hash, KeyType::Hash)?)
                .key_schema(key(range, KeyType::Range)?)
                .projection(projection(projected))
                .set_provisioned_throughput(throughput.clone())
                .build()
                .map_err(build_error("index creation"))?;
            let result = self
                .client()
                .update_table()
                .table_name(self.table())
                .set_attribute_definitions(Some(index_attributes()?))
                .global_secondary_index_updates(GlobalSecondaryIndexUpdate::builder().create(create).build())
                .send()
                .await;
            match result {
                // Another upgrade is adding it at the same moment: wait for it like for ours.
                Err(e) if e.as_service_error().is_some_and(|s| s.is_resource_in_use_exception()) => {}
                Err(e) => {
                    let said = e.as_service_error().and_then(|s| s.message()).unwrap_or_default().to_owned();
                    let err = map_sdk(e, &format!("add the index {name}"));
                    if err.kind() != ErrorKind::InvalidInput {
                        return Err(err);
                    }
                    return Err(Error::new(
                        ErrorKind::Misconfigured,
                        format!(
                            "DynamoDB refused to add the index {name} to table {:?} ({said}); dynalite 4.0.0, for one, \
                             cannot add an index to an existing table: create a table with create=true and migrate \
                             into it instead",
                            self.table()
                        ),
                    )
                    .with_source(err));
                }
                Ok(_) => tracing::info!(table = %self.table(), index = name, "adding a DynamoDB index"),
            }
            if missing_indexes(&self.describe().await?).contains(&name) {
                return Err(Error::new(
                    ErrorKind::Misconfigured,
                    format!(
                        "DynamoDB accepted adding the index {name} to table {:?} but does not list it (dynalite \
                         cannot add an index to an existing table); create the table anew with create=true and \
                         migrate into it",
                        self.table()
                    ),
                ));
            }
        }
        self.wait_for_indexes(INDEX_BUILD_WAIT).await
    }

    async fn wait_for_indexes(&self, limit: Duration) -> Result<()> {
        let deadline = std::time::Instant::now() + limit;
        while !indexes_active(&self.describe().await?) {
            if std::time::Instant::now() > deadline {
                return Err(Error::new(
                    ErrorKind::Unavailable,
                    format!(
                        "DynamoDB did not finish building the indexes of table {:?} in time; rerun the upgrade",
                        self.table()
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        Ok(())
    }

    /// One step of the upgrade: a consistent scan page, each old main item given its shard and a
    /// feed position (conditional on the revision read, so a concurrent write, which writes the
    /// new layout itself, wins), each chunk item its shard (so erasure finds it by id), each old
    /// local document its local shard (so `local_docs` finds it), conditional on its revision.
    pub(super) async fn upgrade_step(&self, page_token: Option<&str>, limit: usize) -> Result<UpgradePage> {
        if page_token.is_none() {
            self.create_missing_indexes().await?;
        }
        let mut request = self
            .client()
            .scan()
            .table_name(self.table())
            .consistent_read(true)
            .limit(i32::try_from(limit.max(1)).unwrap_or(i32::MAX));
        if let Some(token) = page_token {
            request = request.set_exclusive_start_key(Some(decode_token(token)?));
        }
        let output = request.send().await.map_err(|e| map_sdk(e, "scan the table for the upgrade"))?;
        let mut step = UpgradePage::default();
        for item in output.items() {
            step.examined += 1;
            if self.upgrade_item(item).await? {
                step.upgraded += 1;
            }
        }
        step.next = output.last_evaluated_key().map(encode_token).transpose()?;
        Ok(step)
    }

    /// Stamps one item if it lacks the new layout; whether it did.
    async fn upgrade_item(&self, item: &Item) -> Result<bool> {
        let Some(id) = codec::string_attribute(item, codec::ID) else { return Ok(false) };
        let local = id.starts_with(LOCAL_PREFIX);
        if item.contains_key(META) || item.contains_key(SHARD) {
            return Ok(false);
        }
        let shard = if local { local_shard_of(id) } else { shard_of(id) };
        let mut update = self
            .client()
            .update_item()
            .table_name(self.table())
            .set_key(Some(Self::key(id)))
            .expression_attribute_names("#shard", SHARD)
            .expression_attribute_values(":shard", AttributeValue::N(shard.to_string()));
        update = if local {
            // A local document written before local shards existed: its shard puts it in the id
            // index for `local_docs` (no position: local documents are never fed).
            let Some(rev) = item.get(codec::REV) else { return Ok(false) };
            update
                .update_expression("SET #shard = :shard")
                .condition_expression("#rev = :rev")
                .expression_attribute_names("#rev", codec::REV)
                .expression_attribute_values(":rev", rev.clone())
        } else if codec::is_chunk(item) {
            update
                .update_expression("SET #shard = :shard")
                .condition_expression("attribute_exists(#id)")
                .expression_attribute_names("#id", codec::ID)
        } else {
            let Some(rev) = item.get(codec::REV) else { return Ok(false) };
            update
                .update_expression("SET #shard = :shard, #seq = :seq")
                .condition_expression("#rev = :rev")
                .expression_attribute_names("#seq", SEQ)
                .expression_attribute_names("#rev", codec::REV)
                .expression_attribute_values(":seq", AttributeValue::S(new_position()))
                .expression_attribute_values(":rev", rev.clone())
        };
        match update.send().await {
            Ok(_) => Ok(true),
            Err(err) => {
                let err = map_sdk(err, &format!("upgrade the item {id:?}"));
                // Changed or removed since the scan read it: its writer wrote the new layout.
                if err.is_conflict() {
                    Ok(false)
                } else {
                    Err(err)
                }
            }
        }
    }

    /// Records the layout, after checking the indexes are there and ACTIVE.
    pub(super) async fn finish_layout_upgrade(&self) -> Result<()> {
        let table = self.describe().await?;
        let missing = missing_indexes(&table);
        if !missing.is_empty() {
            return Err(Error::new(
                ErrorKind::Misconfigured,
                format!("the table still has no index {}: run the upgrade from the start", missing.join(" or ")),
            ));
        }
        self.wait_for_indexes(INDEX_BUILD_WAIT).await?;
        self.write_marker().await?;
        self.remember_layout_current();
        Ok(())
    }
}
