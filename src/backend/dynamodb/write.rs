//! Writes of the document model on DynamoDB: every put and delete reads the item it replaces
//! (revision, tombstone flag, ancestry), mints the next `N-<32 hex>` revision from it, and writes
//! conditionally on the revision it read, so generations and ancestry continue even for
//! unconditional (`Precondition::None`) writes, which retry from a fresh read when they lose a
//! race. Each write attempt stamps a fresh feed position and is bounded by `write_timeout`: the
//! change feed's guarantee rests on that bound (docs/dynamodb-layout.md).

use std::collections::HashMap;
use std::time::Duration;

use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::{AttributeValue, ReturnValue};
use backon::{BackoffBuilder, ExponentialBuilder};
use serde_json::{Map, Value};

use super::backend::DynamoDbBackend;
use super::codec::{self, Item};
use super::error::{map_sdk, map_sdk_write};
use super::layout::{self, ANCESTRY, DELETED};
use crate::backend::replicated;
use crate::backend::revision::{generation_of, PackedAncestry, RevisionId};
use crate::backend::{Ancestry, Precondition, ReplicatedOutcome, ReplicatedRevision, Revision, RevisionInfo};
use crate::error::{Error, ErrorKind, Result};

/// How many times an unconditional write re-reads and tries again after losing a race.
const CONFLICT_ROUNDS: usize = 8;

/// What a write needs to know of the item it replaces.
#[derive(Clone)]
pub(super) struct Current {
    /// `_rev` exactly as stored (older layouts may hold other forms), for the write's condition.
    stored_rev: AttributeValue,
    pub rev: Revision,
    pub deleted: bool,
    /// `None` for an item written before ancestry was kept.
    ancestry: Option<PackedAncestry>,
}

impl Current {
    fn from_item(item: &Item) -> Option<Current> {
        if layout::is_hidden(item) {
            return None;
        }
        let stored_rev = item.get(codec::REV)?.clone();
        let rev = match &stored_rev {
            AttributeValue::S(text) | AttributeValue::N(text) => Revision(text.clone()),
            _ => return None,
        };
        let ancestry = match item.get(ANCESTRY) {
            Some(AttributeValue::B(bytes)) => Some(PackedAncestry(bytes.as_ref().to_vec())),
            _ => None,
        }
        .filter(PackedAncestry::is_well_formed);
        Some(Current { stored_rev, rev, deleted: layout::is_tombstone(item), ancestry })
    }

    fn generation(&self) -> u64 {
        // A revision without a generation counts as generation 1, so the next is 2.
        generation_of(&self.rev).unwrap_or(1)
    }

    /// The revision history as CouchDB's `_revisions`.
    pub fn revision_info(&self) -> RevisionInfo {
        let start = self.generation();
        let ancestry = match &self.ancestry {
            Some(packed) if !packed.is_empty() => packed.unpack(start),
            // Written before ancestry was kept: the current revision only.
            _ => Ancestry {
                start,
                ids: vec![self.rev.as_str().split_once('-').map_or(self.rev.as_str(), |(_, rest)| rest).to_owned()],
            },
        };
        RevisionInfo { rev: self.rev.clone(), deleted: self.deleted, ancestry }
    }
}

/// The pauses between the attempts of one write: `SDK_ATTEMPTS` attempts in all, as the SDK
/// would make (its own retries are off for writes, see `replace_item`).
fn write_backoff() -> backon::ExponentialBackoff {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(2))
        .with_jitter()
        .with_max_times(super::config::SDK_ATTEMPTS as usize - 1)
        .build()
}

/// The next revision after `current` and its ancestry.
fn next_revision(current: Option<&Current>, revs_limit: usize) -> Result<(RevisionId, PackedAncestry)> {
    let rev = RevisionId::next_after(current.map(Current::generation))?;
    let ancestry = PackedAncestry::extend(current.and_then(|c| c.ancestry.as_ref()), &rev, revs_limit);
    Ok((rev, ancestry))
}

/// A tombstone item at `rev`: the id, revision, flag and ancestry, nothing of the body.
fn tombstone_item(id: &str, rev: &Revision, ancestry: PackedAncestry) -> Item {
    HashMap::from([
        (codec::ID.to_owned(), AttributeValue::S(id.to_owned())),
        (codec::REV.to_owned(), AttributeValue::S(rev.0.clone())),
        (DELETED.to_owned(), AttributeValue::Bool(true)),
        (ANCESTRY.to_owned(), AttributeValue::B(Blob::new(ancestry.0))),
    ])
}

/// Whether a write under `precondition` may replace `current`.
fn check_precondition(id: &str, precondition: &Precondition, current: Option<&Current>) -> Result<()> {
    if *precondition == Precondition::NeverWritten && current.is_some() {
        return Err(Error::conflict(format!("document {id:?} was written before (it is live or deleted)")));
    }
    let live = current.filter(|c| !c.deleted);
    match (precondition, live) {
        (Precondition::MustNotExist, Some(_)) => Err(Error::conflict(format!("document {id:?} already exists"))),
        (Precondition::MatchRevision(expected), Some(c)) if &c.rev == expected => Ok(()),
        (Precondition::MatchRevision(expected), _) => {
            Err(Error::conflict(format!("document {id:?} is not at revision {expected}")))
        }
        _ => Ok(()),
    }
}

impl DynamoDbBackend {
    /// A consistent read of what a write replaces (`None`: no item, or a hidden one).
    pub(super) async fn read_current(&self, id: &str) -> Result<Option<Current>> {
        let output = self
            .consistent_get(id)
            .projection_expression("#id, #rev, #del, #anc, #meta, #chunk, #att")
            .expression_attribute_names("#id", codec::ID)
            .expression_attribute_names("#rev", codec::REV)
            .expression_attribute_names("#del", DELETED)
            .expression_attribute_names("#anc", ANCESTRY)
            .expression_attribute_names("#meta", layout::META)
            .expression_attribute_names("#chunk", codec::CHUNK_OF)
            // An attachment chunk's mark, so `Current::from_item` sees it hidden.
            .expression_attribute_names("#att", layout::ATTACHMENT_OF)
            .send()
            .await
            .map_err(|e| map_sdk(e, "read a document's revision"))?;
        Ok(output.item.as_ref().and_then(Current::from_item))
    }

    /// What many writes replace, by consistent batch reads (`bulk_write` reads them all first
    /// instead of one GetItem per document).
    pub(super) async fn read_current_many(&self, ids: &[String]) -> Result<HashMap<String, Current>> {
        let batches: Vec<Vec<String>> =
            crate::backend::distinct_ids(ids).chunks(super::backend::BATCH_GET_MAX).map(<[String]>::to_vec).collect();
        let mut found = HashMap::with_capacity(ids.len());
        for batch in batches {
            for item in self.batch_get_with_retries(&batch).await? {
                if let (Some(id), Some(current)) =
                    (codec::string_attribute(&item, codec::ID), Current::from_item(&item))
                {
                    found.insert(id.to_owned(), current);
                }
            }
        }
        Ok(found)
    }

    /// Writes `body` under `id` if `precondition` holds, continuing the stored generation and
    /// ancestry (a tombstone's too). `known` is what a batch read found there a moment ago
    /// (`Some(None)`: nothing); without it the write reads it first.
    pub(super) async fn put_document(
        &self,
        id: &str,
        body: &Map<String, Value>,
        precondition: Precondition,
        mut known: Option<Option<Current>>,
    ) -> Result<Revision> {
        let mut round = 0;
        loop {
            round += 1;
            let prefetched = known.is_some();
            let current = match known.take() {
                Some(current) => current,
                None => self.read_current(id).await?,
            };
            if let Err(err) = check_precondition(id, &precondition, current.as_ref()) {
                if prefetched {
                    // The batch read may be older than the caller's revision: read again.
                    continue;
                }
                return Err(err);
            }
            let (rev, ancestry) = next_revision(current.as_ref(), self.revs_limit())?;
            let rev = rev.to_revision();
            let encoded = codec::encode(id, rev.as_str(), body)?;
            let mut item = encoded.item;
            item.insert(ANCESTRY.into(), AttributeValue::B(Blob::new(ancestry.0)));
            self.write_chunks(id, rev.as_str(), &encoded.extra_chunks).await?;
            match self.replace_item(id, item, current.as_ref(), &rev).await {
                Ok(old) => {
                    self.delete_replaced_chunks(id, old.as_ref()).await;
                    return Ok(rev);
                }
                Err(err) => {
                    // After an unknown outcome the item may reference the chunks: keep them.
                    if err.kind() != ErrorKind::OutcomeUnknown {
                        self.delete_chunks(id, rev.as_str(), encoded.extra_chunks.len()).await;
                    }
                    if err.is_conflict() && precondition == Precondition::None && round < CONFLICT_ROUNDS {
                        continue;
                    }
                    return Err(err);
                }
            }
        }
    }

    /// Replaces a live document by a tombstone at the next generation, if it is at `rev`; the
    /// tombstone's revision.
    pub(super) async fn delete_document(&self, id: &str, rev: &Revision) -> Result<Revision> {
        let current = self.read_current(id).await?;
        let current = match current {
            Some(c) if !c.deleted => c,
            _ => return Err(Error::not_found(format!("document {id:?} does not exist"))),
        };
        if &current.rev != rev {
            return Err(Error::conflict(format!("document {id:?} is no longer at revision {rev}")));
        }
        let (next, ancestry) = next_revision(Some(&current), self.revs_limit())?;
        let next = next.to_revision();
        match self.replace_item(id, tombstone_item(id, &next, ancestry), Some(&current), &next).await {
            Ok(old) => {
                self.delete_replaced_chunks(id, old.as_ref()).await;
                Ok(next)
            }
            Err(err) if err.is_conflict() => match self.read_current(id).await? {
                Some(c) if !c.deleted => Err(err),
                _ => Err(Error::not_found(format!("document {id:?} does not exist"))),
            },
            Err(err) => Err(err),
        }
    }

    /// Stores a revision made elsewhere if the rules of [`replicated::judge`] say so against a
    /// consistent read, conditional on the item read; a lost race reads again and judges anew.
    pub(super) async fn put_replicated_document(
        &self,
        id: &str,
        incoming: &ReplicatedRevision,
    ) -> Result<ReplicatedOutcome> {
        let checked = replicated::check(id, incoming)?;
        let rev = &incoming.rev;
        for _ in 0..CONFLICT_ROUNDS {
            let current = self.read_current(id).await?;
            let outcome = replicated::judge(incoming, current.as_ref().map(Current::revision_info).as_ref());
            if outcome != ReplicatedOutcome::Applied {
                return Ok(outcome);
            }
            let ancestry = checked.stored_ancestry(self.revs_limit());
            let (item, extra_chunks) = if incoming.deleted {
                let mut item = tombstone_item(id, rev, ancestry);
                if let Some(body) = layout::deleted_body_attribute(id, &incoming.body)? {
                    item.insert(layout::DELETED_BODY.into(), body);
                }
                (item, 0)
            } else {
                let encoded = codec::encode(id, rev.as_str(), &incoming.body)?;
                let mut item = encoded.item;
                item.insert(ANCESTRY.into(), AttributeValue::B(Blob::new(ancestry.0)));
                self.write_chunks(id, rev.as_str(), &encoded.extra_chunks).await?;
                (item, encoded.extra_chunks.len())
            };
            // A rewrite in place (the same revision, see `replicated::judge`) wrote the same
            // chunks under the same ids as the item it replaces: none of them is garbage.
            let rewrite = current.as_ref().is_some_and(|c| &c.revision_info().rev == rev);
            match self.replace_item(id, item, current.as_ref(), rev).await {
                Ok(old) => {
                    if !rewrite {
                        self.delete_replaced_chunks(id, old.as_ref()).await;
                    }
                    return Ok(ReplicatedOutcome::Applied);
                }
                Err(err) => {
                    if err.kind() != ErrorKind::OutcomeUnknown && extra_chunks > 0 && !rewrite {
                        self.delete_chunks(id, rev.as_str(), extra_chunks).await;
                    }
                    if !err.is_conflict() {
                        return Err(err);
                    }
                }
            }
        }
        Err(Error::conflict(format!("document {id:?} kept changing while a replicated revision was written")))
    }

    /// The chunks of the revision a write replaced, removed once nothing references them.
    async fn delete_replaced_chunks(&self, id: &str, old: Option<&Item>) {
        if let Some(old) = old {
            let count = codec::extra_chunk_count(old);
            if count > 0 {
                let old_rev = codec::string_attribute(old, codec::REV).unwrap_or("").to_owned();
                self.delete_chunks(id, &old_rev, count).await;
            }
        }
    }

    /// PutItem of `item` (revision `rev`) conditional on the item being `current` still; returns
    /// the replaced item. Every document write goes through here, so this is where the
    /// remembered document count is forgotten: after the write, whatever its outcome (one that
    /// failed may still have been applied).
    async fn replace_item(
        &self,
        id: &str,
        item: Item,
        current: Option<&Current>,
        rev: &Revision,
    ) -> Result<Option<Item>> {
        let outcome = self.replace_item_attempts(id, item, current, rev).await;
        self.count_cache().wrote();
        outcome
    }

    /// [`Self::replace_item`]'s attempts. Each stamps a fresh feed position and is bounded by the
    /// write timeout, with the SDK's own retries off for it: a resent request would carry an old
    /// stamp. A conflict against our own earlier attempt (applied, but its answer lost) is our
    /// success.
    async fn replace_item_attempts(
        &self,
        id: &str,
        mut item: Item,
        current: Option<&Current>,
        rev: &Revision,
    ) -> Result<Option<Item>> {
        let mut backoff = write_backoff();
        let mut resent = false;
        loop {
            layout::stamp(&mut item, id);
            let mut request = self
                .client()
                .put_item()
                .table_name(self.table())
                .set_item(Some(item.clone()))
                .return_values(ReturnValue::AllOld);
            request = match current {
                None => request
                    .condition_expression("attribute_not_exists(#id)")
                    .expression_attribute_names("#id", codec::ID),
                Some(current) => request
                    .condition_expression("#rev = :rev")
                    .expression_attribute_names("#rev", codec::REV)
                    .expression_attribute_values(":rev", current.stored_rev.clone()),
            };
            let err = match request.customize().config_override(self.write_attempt_config()).send().await {
                Ok(output) => return Ok(output.attributes),
                Err(err) => map_sdk_write(err, &format!("write document {id:?}")),
            };
            if err.is_conflict() {
                if self.holds_revision(id, rev.as_str()).await {
                    tracing::warn!(id, rev = %rev, "a resent write met its own earlier attempt; it had been applied");
                    if resent {
                        // That attempt may have been applied after its timeout, with a position a
                        // follower has already passed: give the document a fresh one.
                        self.restamp(id, rev).await;
                    }
                    return Ok(None);
                }
                return Err(Error::conflict(format!("document {id:?} was changed by another writer")).with_source(err));
            }
            let transient = matches!(err.kind(), ErrorKind::Unavailable | ErrorKind::OutcomeUnknown);
            match backoff.next() {
                Some(delay) if transient => {
                    resent = true;
                    tokio::time::sleep(delay).await;
                }
                _ => return Err(err),
            }
        }
    }

    /// Gives the item at our revision `rev` a fresh feed position, each attempt bounded by the
    /// write timeout like a write's. A failed condition means a later write replaced ours, with a
    /// position of its own: nothing to do.
    async fn restamp(&self, id: &str, rev: &Revision) {
        let mut backoff = write_backoff();
        loop {
            let result = self
                .client()
                .update_item()
                .table_name(self.table())
                .set_key(Some(Self::key(id)))
                .update_expression("SET #seq = :seq")
                .condition_expression("#rev = :rev")
                .expression_attribute_names("#seq", layout::SEQ)
                .expression_attribute_names("#rev", codec::REV)
                .expression_attribute_values(":seq", AttributeValue::S(layout::new_position()))
                .expression_attribute_values(":rev", AttributeValue::S(rev.0.clone()))
                .customize()
                .config_override(self.write_attempt_config())
                .send()
                .await;
            let err = match result {
                Ok(_) => return,
                Err(err) => map_sdk_write(err, &format!("give document {id:?} a fresh feed position")),
            };
            match backoff.next() {
                Some(delay) if !err.is_conflict() => tokio::time::sleep(delay).await,
                _ => {
                    if !err.is_conflict() {
                        // The write stands; only a follower already past its old position could
                        // miss it (docs/dynamodb-layout.md, "what is not covered").
                        tracing::error!(id, rev = %rev, error = %err, "could not give a resent write a fresh feed position");
                    }
                    return;
                }
            }
        }
    }

    /// The SDK settings of one write attempt: no retries (the caller owns them, stamping each
    /// attempt afresh) and the write timeout as its bound.
    fn write_attempt_config(&self) -> aws_sdk_dynamodb::config::Builder {
        let timeout = self.write_timeout();
        aws_sdk_dynamodb::config::Builder::default()
            .retry_config(aws_config::retry::RetryConfig::disabled())
            .timeout_config(
                aws_config::timeout::TimeoutConfig::builder()
                    .connect_timeout(timeout)
                    .operation_attempt_timeout(timeout)
                    .operation_timeout(timeout)
                    .build(),
            )
    }

    /// `revisions(id)`: the current revision, tombstone flag and ancestry.
    pub(super) async fn revision_info(&self, id: &str) -> Result<Option<RevisionInfo>> {
        Ok(self.read_current(id).await?.map(|c| c.revision_info()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn current(rev: &str, deleted: bool) -> Current {
        Current { stored_rev: AttributeValue::S(rev.into()), rev: Revision(rev.into()), deleted, ancestry: None }
    }

    #[test]
    fn preconditions_treat_tombstones_as_absent() {
        let live = current("3-00112233445566778899aabbccddeeff", false);
        let tomb = current("4-00112233445566778899aabbccddeeff", true);
        let matching = Precondition::MatchRevision(live.rev.clone());
        assert!(check_precondition("a", &Precondition::MustNotExist, None).is_ok());
        assert!(check_precondition("a", &Precondition::MustNotExist, Some(&tomb)).is_ok());
        assert!(check_precondition("a", &Precondition::MustNotExist, Some(&live)).unwrap_err().is_conflict());
        assert!(check_precondition("a", &matching, Some(&live)).is_ok());
        assert!(check_precondition("a", &Precondition::MatchRevision(tomb.rev.clone()), Some(&tomb)).is_err());
        assert!(check_precondition("a", &matching, None).unwrap_err().is_conflict());
        assert!(check_precondition("a", &Precondition::None, Some(&tomb)).is_ok());
    }

    /// `NeverWritten` is refused over a tombstone too, where `MustNotExist` re-creates.
    #[test]
    fn never_written_is_refused_over_a_tombstone() {
        let live = current("3-00112233445566778899aabbccddeeff", false);
        let tomb = current("4-00112233445566778899aabbccddeeff", true);
        assert!(check_precondition("a", &Precondition::NeverWritten, None).is_ok());
        assert!(check_precondition("a", &Precondition::NeverWritten, Some(&tomb)).unwrap_err().is_conflict());
        assert!(check_precondition("a", &Precondition::NeverWritten, Some(&live)).unwrap_err().is_conflict());
    }

    #[test]
    fn old_revisions_continue_their_generation_and_keep_only_themselves_as_ancestry() {
        let old = current("7-0123456789abcdef", false);
        let info = old.revision_info();
        assert_eq!(info.ancestry.revisions().collect::<Vec<_>>(), vec![Revision("7-0123456789abcdef".into())]);
        let (next, ancestry) = next_revision(Some(&old), 1000).unwrap();
        assert_eq!(next.generation, 8);
        assert_eq!(ancestry.len(), 1);
        let counter = current("41", false);
        assert_eq!(next_revision(Some(&counter), 1000).unwrap().0.generation, 2);
    }
}
