//! The write transaction: [`Tables`], every table of one redb write transaction and the feed
//! counter it advances, with the writes that run in it (a document, a deletion, a replicated
//! revision, an erasure, an upgrade step), and the writes encoded before it begins.

use redb::{ReadableTable, Table, WriteTransaction};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::codec::{self, Header, StoredRevision};
use super::core::{
    index_key, next_feed_position, revision_info_in, IdKey, IndexKey, ANCESTRY, BY_USER_NAMESPACE, DOCS, FEED, LOCAL,
    META, META_FEED_NEXT, TOMBSTONES,
};
use super::error::map_redb;
use crate::backend::replicated::{self, CheckedRevision};
use crate::backend::revision::{PackedAncestry, RevisionId, TOKEN_BYTES};
use crate::backend::{Precondition, ReplicatedLeaf, ReplicatedOutcome, ReplicatedRevision, Revision};
use crate::error::{Error, ErrorKind, Result};

/// A write with its body already encoded, and the random part of the revision it will mint,
/// drawn before the transaction (a system call the group's other writers need not wait for).
pub(super) struct EncodedWrite {
    id: String,
    json: Vec<u8>,
    index_key: Option<IndexKey>,
    precondition: Precondition,
    token: [u8; TOKEN_BYTES],
}

impl EncodedWrite {
    pub(super) fn new(
        id: &str,
        body: &Map<String, Value>,
        precondition: Precondition,
        token: [u8; TOKEN_BYTES],
    ) -> Result<Self> {
        let json = codec::encode_json(id, body)?;
        Ok(EncodedWrite { id: id.to_owned(), json, index_key: index_key(body), precondition, token })
    }

    /// A write whose body the caller gave as the compact JSON text of an object: stored as it
    /// is, its index key read from the text's top-level fields without building the body.
    pub(super) fn from_text(
        id: &str,
        json: &RawValue,
        precondition: Precondition,
        token: [u8; TOKEN_BYTES],
    ) -> Result<Self> {
        let text = json.get().as_bytes();
        let index_key = if may_name_an_index_field(text) {
            let fields: IndexFields = crate::model::depth::parse_stored(text).map_err(|e| {
                Error::new(ErrorKind::InvalidInput, format!("document {id:?} is not a JSON object: {e}"))
            })?;
            fields.index_key()
        } else if text.iter().find(|byte| !byte.is_ascii_whitespace()) == Some(&b'{') {
            None
        } else {
            return Err(Error::new(ErrorKind::InvalidInput, format!("document {id:?} is not a JSON object")));
        };
        Ok(EncodedWrite { id: id.to_owned(), json: text.to_vec(), index_key, precondition, token })
    }
}

/// Whether `text` (valid JSON: a [`RawValue`]) may have a member named `userId`: it holds that
/// name as written, or some `\u` escape, which could spell it. The engine's records
/// (`{"revtree":…}`) have none, and skipping the parse that would find none saves a pass over
/// every record a `_bulk_docs` writes (5% of one of 100 documents).
fn may_name_an_index_field(text: &[u8]) -> bool {
    memchr::memmem::find(text, b"\"userId\"").is_some() || memchr::memmem::find(text, b"\\u").is_some()
}

/// The top-level fields of a body that [`index_key`] reads, taken from its text; every other
/// field is skipped unparsed. Each is kept only when it is a string, as `index_key` keeps it.
#[derive(serde::Deserialize)]
struct IndexFields {
    #[serde(rename = "userId", default)]
    user: Option<Value>,
    #[serde(rename = "namespace", default)]
    namespace: Option<Value>,
}

impl IndexFields {
    fn index_key(self) -> Option<IndexKey> {
        match (self.user, self.namespace) {
            (Some(Value::String(user)), Some(Value::String(namespace))) => Some((user, namespace)),
            _ => None,
        }
    }
}

/// A replicated write, checked and with its body encoded, outside the write transaction.
pub(super) struct ReplicatedWrite {
    id: String,
    /// The incoming revision without its body (what the rules look at).
    incoming: ReplicatedRevision,
    checked: CheckedRevision,
    /// The encoded body: a live document's, or the fields a deletion carried (empty for none).
    json: Vec<u8>,
    index_key: Option<IndexKey>,
}

impl ReplicatedWrite {
    pub(super) fn new(id: &str, incoming: &ReplicatedRevision) -> Result<Self> {
        Self::of_leaf(&ReplicatedLeaf { id, head: incoming, body: &incoming.body })
    }

    /// The write of a revision whose body is borrowed (encoded from where it is, not copied).
    pub(super) fn of_leaf(leaf: &ReplicatedLeaf<'_>) -> Result<Self> {
        let (id, incoming, body) = (leaf.id, leaf.head, leaf.body);
        let checked = replicated::check(id, incoming)?;
        let json = if incoming.deleted && body.is_empty() { Vec::new() } else { codec::encode_json(id, body)? };
        let index_key = if incoming.deleted { None } else { index_key(body) };
        let incoming = ReplicatedRevision {
            rev: incoming.rev.clone(),
            ancestry: incoming.ancestry.clone(),
            deleted: incoming.deleted,
            body: Map::new(),

            precondition: incoming.precondition.clone(),
        };
        Ok(ReplicatedWrite { id: id.to_owned(), incoming, checked, json, index_key })
    }
}

/// What is stored under an id: a live document (with its index key) or a tombstone.
pub(super) enum Existing {
    Live(Header, Option<IndexKey>),
    Deleted(Header),
}

impl Existing {
    pub(super) fn header(&self) -> Header {
        match self {
            Existing::Live(header, _) | Existing::Deleted(header) => *header,
        }
    }
}

/// The tables of one write transaction, and the feed counter it advances.
pub(super) struct Tables<'t> {
    pub(super) docs: Table<'t, IdKey, &'static [u8]>,
    pub(super) tombstones: Table<'t, IdKey, &'static [u8]>,
    pub(super) index: Table<'t, (&'static str, &'static str, &'static str), ()>,
    pub(super) feed: Table<'t, u64, &'static str>,
    pub(super) ancestry: Table<'t, IdKey, &'static [u8]>,
    pub(super) local: Table<'t, IdKey, &'static [u8]>,
    pub(super) attachment_chunks: Table<'t, (&'static str, u64), &'static [u8]>,
    pub(super) meta: Table<'t, &'static str, u64>,
    pub(super) next_seq: u64,
    /// Whether feed entries were removed without a later one added (an erasure): the floor must
    /// then be recorded.
    pub(super) feed_shrunk: bool,
    pub(super) revs_limit: usize,
}

impl<'t> Tables<'t> {
    pub(super) fn open(txn: &'t WriteTransaction, revs_limit: usize) -> Result<Self> {
        let meta = txn.open_table(META).map_err(map_redb("open meta table"))?;
        let feed = txn.open_table(FEED).map_err(map_redb("open feed table"))?;
        let next_seq = next_feed_position(&feed, &meta)?;
        Ok(Tables {
            docs: txn.open_table(DOCS).map_err(map_redb("open docs table"))?,
            tombstones: txn.open_table(TOMBSTONES).map_err(map_redb("open tombstones table"))?,
            index: txn.open_table(BY_USER_NAMESPACE).map_err(map_redb("open index table"))?,
            feed,
            ancestry: txn.open_table(ANCESTRY).map_err(map_redb("open ancestry table"))?,
            local: txn.open_table(LOCAL).map_err(map_redb("open local table"))?,
            attachment_chunks: txn
                .open_table(super::core::ATTACHMENT_CHUNKS)
                .map_err(map_redb("open attachment table"))?,
            meta,
            next_seq,
            feed_shrunk: false,
            revs_limit,
        })
    }

    /// Records the feed's floor when this transaction removed feed entries (before it commits).
    pub(super) fn finish(&mut self) -> Result<()> {
        if self.feed_shrunk {
            self.meta.insert(META_FEED_NEXT, self.next_seq).map_err(map_redb("write feed floor"))?;
        }
        Ok(())
    }

    pub(super) fn existing(&self, id: &str) -> Result<Option<Existing>> {
        if let Some(guard) = self.docs.get(id).map_err(map_redb("read document"))? {
            let (header, body) = codec::decode(id, guard.value())?;
            return Ok(Some(Existing::Live(header, index_key(&body))));
        }
        match self.tombstones.get(id).map_err(map_redb("read tombstone"))? {
            Some(guard) => Ok(Some(Existing::Deleted(codec::split(id, guard.value())?.0))),
            None => Ok(None),
        }
    }

    /// Mints the revision that follows `previous` (with the random `token` drawn for it), extends
    /// the ancestry and moves the document to the end of the feed; returns the new revision and
    /// feed position.
    pub(super) fn advance(
        &mut self,
        id: &str,
        previous: Option<Header>,
        token: [u8; TOKEN_BYTES],
    ) -> Result<(RevisionId, u64)> {
        let rev = RevisionId::following(previous.map(|h| h.rev.generation()), token);
        let parent = match self.ancestry.get(id).map_err(map_redb("read ancestry"))? {
            Some(guard) => Some(PackedAncestry(guard.value().to_vec())),
            None => match previous.map(|h| h.rev) {
                Some(StoredRevision::Minted(old)) => Some(PackedAncestry(old.token.to_vec())),
                _ => None,
            },
        };
        let packed = PackedAncestry::extend(parent.as_ref(), &rev, self.revs_limit);
        let seq = self.record_version(id, &packed, previous.and_then(|h| h.seq))?;
        Ok((rev, seq))
    }

    /// Stores `packed` as the ancestry of `id` and moves it from its feed position `old_seq` to
    /// the end of the feed; returns the new position.
    pub(super) fn record_version(&mut self, id: &str, packed: &PackedAncestry, old_seq: Option<u64>) -> Result<u64> {
        self.ancestry.insert(id, packed.0.as_slice()).map_err(map_redb("write ancestry"))?;
        if let Some(old) = old_seq {
            self.feed.remove(old).map_err(map_redb("update feed"))?;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.feed.insert(seq, id).map_err(map_redb("update feed"))?;
        Ok(seq)
    }

    /// Removes the stored record of `id` (live document with its index entry, or tombstone).
    pub(super) fn remove_record(&mut self, id: &str, existing: &Existing) -> Result<()> {
        match existing {
            Existing::Live(_, key) => {
                self.docs.remove(id).map_err(map_redb("remove document"))?;
                self.unindex(id, key.as_ref())
            }
            Existing::Deleted(_) => {
                self.tombstones.remove(id).map_err(map_redb("remove tombstone"))?;
                Ok(())
            }
        }
    }

    /// Stores a revision made elsewhere if the rules of [`replicated::judge`] say so.
    pub(super) fn write_replicated(&mut self, write: &ReplicatedWrite) -> Result<ReplicatedOutcome> {
        let id = write.id.as_str();
        let existing = self.existing(id)?;
        let stored = match &existing {
            Some(existing) => {
                let deleted = matches!(existing, Existing::Deleted(_));
                Some(revision_info_in(&self.ancestry, id, existing.header(), deleted)?)
            }
            None => None,
        };
        let outcome = replicated::judge(&write.incoming, stored.as_ref());
        if outcome != ReplicatedOutcome::Applied {
            return Ok(outcome);
        }
        if let Some(existing) = &existing {
            self.remove_record(id, existing)?;
        }
        let packed = write.checked.stored_ancestry(self.revs_limit);
        let seq = self.record_version(id, &packed, existing.as_ref().and_then(|e| e.header().seq))?;
        let rev = &write.checked.rev;
        if write.incoming.deleted {
            self.tombstones
                .insert(id, codec::encode(rev, seq, &write.json).as_slice())
                .map_err(map_redb("write tombstone"))?;
        } else {
            self.docs
                .insert(id, codec::encode(rev, seq, &write.json).as_slice())
                .map_err(map_redb("write document"))?;
            if let Some((user, ns)) = &write.index_key {
                self.index.insert((user.as_str(), ns.as_str(), id), ()).map_err(map_redb("update index"))?;
            }
        }
        Ok(ReplicatedOutcome::Applied)
    }

    pub(super) fn unindex(&mut self, id: &str, key: Option<&IndexKey>) -> Result<()> {
        if let Some((user, ns)) = key {
            self.index.remove((user.as_str(), ns.as_str(), id)).map_err(map_redb("update index"))?;
        }
        Ok(())
    }

    /// Checks the precondition and writes one document.
    pub(super) fn write_one(&mut self, write: &EncodedWrite) -> Result<Revision> {
        let existing = self.existing(&write.id)?;
        if write.precondition == Precondition::NeverWritten && existing.is_some() {
            let id = &write.id;
            return Err(Error::conflict(format!("document {id:?} was written before (it is live or deleted)")));
        }
        let live = match &existing {
            Some(Existing::Live(header, _)) => Some(header.rev),
            _ => None,
        };
        check_precondition(&write.id, &write.precondition, live)?;
        if let Some(Existing::Live(_, key)) = &existing {
            self.unindex(&write.id, key.as_ref())?;
        }
        if let Some(Existing::Deleted(_)) = &existing {
            self.tombstones.remove(write.id.as_str()).map_err(map_redb("remove tombstone"))?;
        }
        let (rev, seq) = self.advance(&write.id, existing.as_ref().map(Existing::header), write.token)?;
        let stored = codec::encode(&rev, seq, &write.json);
        self.docs.insert(write.id.as_str(), stored.as_slice()).map_err(map_redb("write document"))?;
        if let Some((user, ns)) = &write.index_key {
            self.index.insert((user.as_str(), ns.as_str(), write.id.as_str()), ()).map_err(map_redb("update index"))?;
        }
        Ok(rev.to_revision())
    }

    /// Replaces a live document at `expected` by its tombstone (its revision minted with `token`).
    pub(super) fn delete_one(&mut self, id: &str, expected: &Revision, token: [u8; TOKEN_BYTES]) -> Result<Revision> {
        let Some(Existing::Live(header, key)) = self.existing(id)? else {
            return Err(Error::not_found(format!("document {id:?} does not exist")));
        };
        if !header.rev.matches(expected) {
            let rev = header.rev.to_revision();
            return Err(Error::conflict(format!("document {id:?} is at revision {rev}, not {expected}")));
        }
        self.docs.remove(id).map_err(map_redb("delete document"))?;
        self.unindex(id, key.as_ref())?;
        let (rev, seq) = self.advance(id, Some(header), token)?;
        self.tombstones.insert(id, codec::encode(&rev, seq, b"").as_slice()).map_err(map_redb("write tombstone"))?;
        Ok(rev.to_revision())
    }

    /// Removes every trace of `id`, only while its stored revision (live or a tombstone) is
    /// `if_revision` when one is given (`Conflict` otherwise, nothing removed); whether there was
    /// any. Checked in this transaction, so no write lands between the check and the erasure.
    pub(super) fn erase(&mut self, id: &str, if_revision: Option<&Revision>) -> Result<bool> {
        let existing = self.existing(id)?;
        if let Some(expected) = if_revision {
            match &existing {
                Some(existing) if existing.header().rev.matches(expected) => {}
                Some(existing) => {
                    let rev = existing.header().rev.to_revision();
                    return Err(Error::conflict(format!(
                        "document {id:?} is at revision {rev}, not {expected}: not erased"
                    )));
                }
                None => return Err(Error::conflict(format!("document {id:?} does not exist: not erased"))),
            }
        }
        let Some(existing) = existing else { return Ok(false) };
        self.remove_record(id, &existing)?;
        if let Some(seq) = existing.header().seq {
            self.feed.remove(seq).map_err(map_redb("update feed"))?;
            self.feed_shrunk = true;
        }
        self.ancestry.remove(id).map_err(map_redb("erase ancestry"))?;
        Ok(true)
    }

    /// Gives a record of an older layout its feed position (and a minted revision when it had
    /// only a file-wide counter); whether it needed it.
    pub(super) fn upgrade_one(&mut self, id: &str) -> Result<bool> {
        let (header, json) = {
            let Some(guard) = self.docs.get(id).map_err(map_redb("read document"))? else { return Ok(false) };
            let (header, json) = codec::split(id, guard.value())?;
            (header, json.to_vec())
        };
        if header.seq.is_some() {
            return Ok(false);
        }
        let rev = match header.rev {
            StoredRevision::Minted(rev) => rev,
            StoredRevision::Counter(_) => RevisionId::next_after(None)?,
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        self.feed.insert(seq, id).map_err(map_redb("update feed"))?;
        self.ancestry.insert(id, rev.token.as_slice()).map_err(map_redb("write ancestry"))?;
        self.docs.insert(id, codec::encode(&rev, seq, &json).as_slice()).map_err(map_redb("upgrade document"))?;
        Ok(true)
    }
}

/// Whether a write's precondition holds against the live revision (`None`: no live document,
/// whether never written or deleted).
pub(super) fn check_precondition(id: &str, precondition: &Precondition, live: Option<StoredRevision>) -> Result<()> {
    match (precondition, live) {
        // A tombstone in the way of `NeverWritten` is `write_one`'s to see: here is the live one.
        (Precondition::MustNotExist | Precondition::NeverWritten, Some(_)) => {
            Err(Error::conflict(format!("document {id:?} already exists")))
        }
        (Precondition::MatchRevision(_), None) => Err(Error::conflict(format!("document {id:?} does not exist"))),
        (Precondition::MatchRevision(expected), Some(rev)) if !rev.matches(expected) => {
            let rev = rev.to_revision();
            Err(Error::conflict(format!("document {id:?} is at revision {rev}, not {expected}")))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::value::RawValue;

    use super::*;

    fn index_key_of(text: &str) -> Result<Option<IndexKey>> {
        let raw = RawValue::from_string(text.to_owned()).expect("JSON");
        EncodedWrite::from_text("d", &raw, Precondition::None, [0; TOKEN_BYTES]).map(|write| write.index_key)
    }

    /// A text's index key is found whether the parse is skipped or not: a record without the
    /// member has none, the member as written or spelled with escapes gives one, and a text that
    /// is not an object is refused either way.
    #[test]
    fn a_texts_index_key_with_or_without_its_parse() {
        let key = Some(("u".to_owned(), "n".to_owned()));
        assert_eq!(index_key_of(r#"{"revtree":{"l":[{"b":{"x":"userId"}}]}}"#).unwrap(), None);
        assert_eq!(index_key_of(r#"{"userId":"u","namespace":"n"}"#).unwrap(), key);
        assert_eq!(index_key_of(r#"{"\u0075serId":"u","namespace":"n"}"#).unwrap(), key);
        assert_eq!(index_key_of(r#"{"userId":1,"namespace":"n"}"#).unwrap(), None);
        assert_eq!(index_key_of(r#"{"a":{"userId":"u","namespace":"n"}}"#).unwrap(), None);
        for not_an_object in ["[1]", r#""userId""#, "7"] {
            assert_eq!(index_key_of(not_an_object).unwrap_err().kind(), ErrorKind::InvalidInput, "{not_an_object}");
        }
    }
}
