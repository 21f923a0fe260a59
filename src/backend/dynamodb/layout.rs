//! The document model's part of the table layout (docs/dynamodb-layout.md): the attributes that
//! carry revisions, ancestry, tombstones and feed positions, the two sharded indexes (the change
//! feed and id order), the layout marker, and upgrading a table written by the previous release.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, CreateGlobalSecondaryIndexAction, GlobalSecondaryIndex,
    GlobalSecondaryIndexUpdate, IndexStatus, KeySchemaElement, KeyType, Projection, ProjectionType,
    ProvisionedThroughput, ScalarAttributeType, TableDescription,
};
use sha2::{Digest, Sha256};

use super::backend::DynamoDbBackend;
use super::codec::{self, Item};
use super::error::map_sdk;
use crate::backend::{LayoutState, UpgradePage, LOCAL_PREFIX};
use crate::error::{Error, ErrorKind, Result};
use aws_sdk_dynamodb::error::ProvideErrorMetadata;

/// The packed revision ancestry (16 bytes a revision, newest first).
pub const ANCESTRY: &str = "_anc";
/// `true` on a tombstone.
pub const DELETED: &str = "_deleted";
/// The document's shard: hash key of both document-model indexes.
pub const SHARD: &str = "_shard";
/// The feed position of the document's latest write.
pub const SEQ: &str = "_seq";
/// The kind of a bookkeeping item (the layout marker); scans and reads skip such items.
pub const META: &str = "_meta";
/// The JSON text of a local document's body.
pub const LOCAL_BODY: &str = "_json";
/// The layout marker's version and shard count.
const VERSION: &str = "version";
const SHARDS: &str = "shards";

/// The change feed's index: hash `_shard`, range `_seq`.
pub const FEED_INDEX: &str = "agentstore-feed";
/// The id-order index: hash `_shard`, range `_id`.
pub const ID_INDEX: &str = "agentstore-ids";
/// How many shards the indexes are split into. Part of the layout: every process of a table must
/// agree, so it is recorded in the layout marker.
pub const SHARD_COUNT: u32 = 16;
/// The layout this release writes.
pub const LAYOUT_VERSION: u32 = 2;
/// The layout marker's id: `_agentstore/` is no data-store id (those are `user:namespace:key`)
/// and no local document's (`_local/`).
pub const MARKER_ID: &str = "_agentstore/layout";

/// The shard of an id: the first 4 bytes of its SHA-256, modulo [`SHARD_COUNT`]. Part of the
/// layout (a reader finds an id's entries only in its shard), so it never changes.
pub fn shard_of(id: &str) -> u32 {
    let digest = Sha256::digest(id.as_bytes());
    u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]) % SHARD_COUNT
}

/// Milliseconds since the epoch by this machine's clock.
pub fn now_millis() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// A fresh feed position: 13 zero-padded milliseconds of the writer's clock, then 8 hex digits of
/// a counter of this process and 8 random ones. Within one process positions only grow (the
/// milliseconds never go below the last ones stamped, and the counter orders stamps of the same
/// millisecond), so one writer's writes are fed in the order it made them; between processes,
/// positions of the same millisecond differ (random digits) and their order is arbitrary but
/// fixed.
pub fn new_position() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static LAST_MILLIS: AtomicU64 = AtomicU64::new(0);
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let now = now_millis();
    let millis = LAST_MILLIS.fetch_max(now, Ordering::SeqCst).max(now);
    let count = COUNTER.fetch_add(1, Ordering::SeqCst) as u32;
    let random = &crate::backend::random_token()[..8];
    format!("{millis:013}{count:08x}{random}")
}

/// The largest millisecond count a position holds (13 digits): the bound made from it sorts
/// after every position.
pub const MAX_POSITION_MILLIS: u64 = 9_999_999_999_999;

/// The feed position that sorts after every position stamped at or before `millis`.
pub fn position_after_millis(millis: u64) -> String {
    format!("{millis:013}g")
}

/// Checks a `since` token: a position [`new_position`] or [`position_after_millis`] made.
pub fn check_position(token: &str) -> Result<()> {
    let (millis, rest) = token.split_at_checked(13).unwrap_or(("", ""));
    let millis_ok = millis.len() == 13 && millis.bytes().all(|b| b.is_ascii_digit());
    let rest_ok = rest == "g" || (rest.len() == 16 && rest.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')));
    if millis_ok && rest_ok {
        Ok(())
    } else {
        Err(Error::invalid("since", format!("{token:?} is not a change feed position of this DynamoDB backend")))
    }
}

/// Whether an item is no document of the data store: a chunk, a local document or bookkeeping.
pub fn is_hidden(item: &Item) -> bool {
    codec::is_chunk(item)
        || item.contains_key(META)
        || codec::string_attribute(item, codec::ID).is_some_and(|id| id.starts_with(LOCAL_PREFIX))
}

pub fn is_tombstone(item: &Item) -> bool {
    matches!(item.get(DELETED), Some(AttributeValue::Bool(true)))
}

/// The feed attributes a write stamps on an item: its shard and a fresh position.
pub fn stamp(item: &mut Item, id: &str) {
    item.insert(SHARD.into(), AttributeValue::N(shard_of(id).to_string()));
    item.insert(SEQ.into(), AttributeValue::S(new_position()));
}

fn build_error(what: &str) -> impl Fn(aws_sdk_dynamodb::error::BuildError) -> Error + '_ {
    move |e| Error::new(ErrorKind::Internal, format!("build {what}")).with_source(e)
}

/// The attribute definitions the document-model indexes add to a table's.
pub fn index_attributes() -> Result<Vec<AttributeDefinition>> {
    [(SHARD, ScalarAttributeType::N), (SEQ, ScalarAttributeType::S)]
        .into_iter()
        .map(|(name, kind)| {
            AttributeDefinition::builder()
                .attribute_name(name)
                .attribute_type(kind)
                .build()
                .map_err(build_error("attribute definition"))
        })
        .collect()
}

/// The two index definitions: (name, hash key, range key, projected attributes).
fn index_shapes() -> [(&'static str, &'static str, &'static str, [&'static str; 2]); 2] {
    [
        // A change needs the revision and whether it is a deletion; nothing else.
        (FEED_INDEX, SHARD, SEQ, [codec::REV, DELETED]),
        // An id listing skips tombstones and chunk items without reading them.
        (ID_INDEX, SHARD, codec::ID, [DELETED, codec::CHUNK_OF]),
    ]
}

fn key(name: &str, kind: KeyType) -> Result<KeySchemaElement> {
    KeySchemaElement::builder().attribute_name(name).key_type(kind).build().map_err(build_error("key schema"))
}

fn projection(attributes: [&str; 2]) -> Projection {
    Projection::builder()
        .projection_type(ProjectionType::Include)
        .set_non_key_attributes(Some(attributes.iter().map(|a| (*a).to_owned()).collect()))
        .build()
}

/// The document-model indexes, for CreateTable.
pub fn new_indexes() -> Result<Vec<GlobalSecondaryIndex>> {
    index_shapes()
        .into_iter()
        .map(|(name, hash, range, projected)| {
            GlobalSecondaryIndex::builder()
                .index_name(name)
                .key_schema(key(hash, KeyType::Hash)?)
                .key_schema(key(range, KeyType::Range)?)
                .projection(projection(projected))
                .build()
                .map_err(build_error("index definition"))
        })
        .collect()
}

/// Which document-model indexes a table description lacks (ACTIVE or being built counts as there).
pub fn missing_indexes(table: &TableDescription) -> Vec<&'static str> {
    [FEED_INDEX, ID_INDEX]
        .into_iter()
        .filter(|name| !table.global_secondary_indexes().iter().any(|g| g.index_name() == Some(*name)))
        .collect()
}

/// Whether every document-model index of the table is ACTIVE.
pub fn indexes_active(table: &TableDescription) -> bool {
    missing_indexes(table).is_empty()
        && table
            .global_secondary_indexes()
            .iter()
            .filter(|g| matches!(g.index_name(), Some(FEED_INDEX | ID_INDEX)))
            .all(|g| g.index_status() == Some(&IndexStatus::Active))
}

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

    /// Records the layout marker (this release's version and the shard count).
    pub(super) async fn write_marker(&self) -> Result<()> {
        let item = HashMap::from([
            (codec::ID.to_owned(), AttributeValue::S(MARKER_ID.into())),
            (META.to_owned(), AttributeValue::S("layout".into())),
            (VERSION.to_owned(), AttributeValue::N(LAYOUT_VERSION.to_string())),
            (SHARDS.to_owned(), AttributeValue::N(SHARD_COUNT.to_string())),
        ]);
        self.client()
            .put_item()
            .table_name(self.table())
            .set_item(Some(item))
            .send()
            .await
            .map_err(|e| map_sdk(e, "write the layout marker"))?;
        Ok(())
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
    /// new layout itself, wins), each chunk item its shard (so erasure finds it by id).
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
            request = request.set_exclusive_start_key(Some(super::backend::decode_token(token)?));
        }
        let output = request.send().await.map_err(|e| map_sdk(e, "scan the table for the upgrade"))?;
        let mut step = UpgradePage::default();
        for item in output.items() {
            step.examined += 1;
            if self.upgrade_item(item).await? {
                step.upgraded += 1;
            }
        }
        step.next = output.last_evaluated_key().map(super::backend::encode_token).transpose()?;
        Ok(step)
    }

    /// Stamps one item if it lacks the new layout; whether it did.
    async fn upgrade_item(&self, item: &Item) -> Result<bool> {
        let Some(id) = codec::string_attribute(item, codec::ID) else { return Ok(false) };
        let local_or_meta = item.contains_key(META) || id.starts_with(LOCAL_PREFIX);
        if local_or_meta || item.contains_key(SHARD) {
            return Ok(false);
        }
        let mut update = self
            .client()
            .update_item()
            .table_name(self.table())
            .set_key(Some(Self::key(id)))
            .expression_attribute_names("#shard", SHARD)
            .expression_attribute_values(":shard", AttributeValue::N(shard_of(id).to_string()));
        update = if codec::is_chunk(item) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_process_stamps_growing_positions() {
        let stamped: Vec<String> = (0..2000).map(|_| new_position()).collect();
        assert!(stamped.windows(2).all(|w| w[0] < w[1]), "positions of one process went back");
    }

    #[test]
    fn positions_sort_by_time_and_bounds_sort_after_their_millisecond() {
        let position = new_position();
        check_position(&position).unwrap();
        let millis: u64 = position[..13].parse().unwrap();
        assert!(position.as_str() < position_after_millis(millis).as_str());
        assert!(position_after_millis(millis - 1).as_str() < position.as_str());
        check_position(&position_after_millis(millis)).unwrap();
        for bad in ["", "g", "123", "0000000000000G", "000000000000x0123456789abcdef", &format!("{position}0")] {
            assert!(check_position(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn shards_spread_ids_evenly() {
        let mut counts = [0u32; SHARD_COUNT as usize];
        for n in 0..1600 {
            counts[shard_of(&format!("user:ns:{n}")) as usize] += 1;
        }
        assert!(counts.iter().all(|&c| c > 60), "{counts:?}");
    }
}
