//! The bytes of one record of the `docs` and `tombstones` tables, in every layout a release of
//! this crate has written.
//!
//! | layout | first byte | then |
//! |---|---|---|
//! | counter (oldest) | `0` | the rest of a big-endian u64 file-wide counter, then the JSON body |
//! | revision | `1` | generation (u64 BE), 16 random bytes, JSON body |
//! | feed (this release) | `2` | generation (u64 BE), 16 random bytes, feed position (u64 BE), JSON body (empty for a tombstone) |
//!
//! A counter record's first byte is 0 for any counter below 2^56, so the layouts cannot be
//! confused. Records of the two older layouts have no feed position: `agentstore upgrade` rewrites
//! them into the current one.

use serde_json::{Map, Value};

use crate::backend::revision::{RevisionId, TOKEN_BYTES};
use crate::backend::Revision;
use crate::error::{Error, ErrorKind, Result};

/// A body as compact JSON, refused as invalid input when it cannot be encoded.
pub(super) fn encode_json(id: &str, body: &Map<String, Value>) -> Result<Vec<u8>> {
    serde_json::to_vec(body).map_err(|e| {
        Error::new(ErrorKind::InvalidInput, format!("document {id:?} cannot be encoded as JSON")).with_source(e)
    })
}

const TAG_REVISION: u8 = 1;
const TAG_FEED: u8 = 2;
const COUNTER_HEADER: usize = 8;
const REVISION_HEADER: usize = 1 + 8 + TOKEN_BYTES;
const FEED_HEADER: usize = REVISION_HEADER + 8;

/// A document's revision as its record keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StoredRevision {
    /// The oldest layout's file-wide counter: no generation of the document's own.
    Counter(u64),
    /// `N-<32 hex>`.
    Minted(RevisionId),
}

impl StoredRevision {
    pub(super) fn to_revision(self) -> Revision {
        match self {
            StoredRevision::Counter(counter) => Revision(counter.to_string()),
            StoredRevision::Minted(rev) => rev.to_revision(),
        }
    }

    /// The generation the next revision continues from. A counter is no generation of the
    /// document's own (continuing from it would publish the file's write volume), so a document
    /// that has one counts as generation 1.
    pub(super) fn generation(self) -> u64 {
        match self {
            StoredRevision::Counter(_) => 1,
            StoredRevision::Minted(rev) => rev.generation,
        }
    }

    pub(super) fn matches(self, expected: &Revision) -> bool {
        match self {
            StoredRevision::Counter(counter) => expected.as_str() == counter.to_string(),
            StoredRevision::Minted(rev) => rev.to_revision() == *expected,
        }
    }
}

/// A decoded record header and where its JSON starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Header {
    pub rev: StoredRevision,
    /// The record's position in the change feed; `None` for records of older layouts.
    pub seq: Option<u64>,
}

/// A record in this release's layout.
pub(super) fn encode(rev: &RevisionId, seq: u64, json: &[u8]) -> Vec<u8> {
    let mut record = Vec::with_capacity(FEED_HEADER + json.len());
    record.push(TAG_FEED);
    record.extend_from_slice(&rev.generation.to_be_bytes());
    record.extend_from_slice(&rev.token);
    record.extend_from_slice(&seq.to_be_bytes());
    record.extend_from_slice(json);
    record
}

/// A record as the previous layouts wrote it (to build old files for upgrade tests).
pub(super) fn encode_previous(rev: &StoredRevision, json: &[u8]) -> Vec<u8> {
    let mut record = Vec::new();
    match rev {
        StoredRevision::Minted(rev) => {
            record.push(TAG_REVISION);
            record.extend_from_slice(&rev.generation.to_be_bytes());
            record.extend_from_slice(&rev.token);
        }
        StoredRevision::Counter(counter) => record.extend_from_slice(&counter.to_be_bytes()),
    }
    record.extend_from_slice(json);
    record
}

/// The header of a record, and the JSON after it.
pub(super) fn split<'a>(id: &str, record: &'a [u8]) -> Result<(Header, &'a [u8])> {
    let corrupt = |why: String| Error::new(ErrorKind::Corrupt, format!("embedded store: record {id:?} {why}"));
    let bytes_at = |at: usize| -> Result<[u8; 8]> {
        record.get(at..at + 8).and_then(|b| b.try_into().ok()).ok_or_else(|| corrupt("is truncated".into()))
    };
    let minted = || -> Result<RevisionId> {
        let token = record.get(9..9 + TOKEN_BYTES).and_then(|b| b.try_into().ok());
        let token = token.ok_or_else(|| corrupt("is truncated".into()))?;
        Ok(RevisionId { generation: u64::from_be_bytes(bytes_at(1)?), token })
    };
    match record.first() {
        Some(&TAG_FEED) => {
            let header = Header {
                rev: StoredRevision::Minted(minted()?),
                seq: Some(u64::from_be_bytes(bytes_at(REVISION_HEADER)?)),
            };
            Ok((header, &record[FEED_HEADER..]))
        }
        Some(&TAG_REVISION) => {
            let rev = StoredRevision::Minted(minted()?);
            Ok((Header { rev, seq: None }, &record[REVISION_HEADER.min(record.len())..]))
        }
        Some(0) => {
            let rev = StoredRevision::Counter(u64::from_be_bytes(bytes_at(0)?));
            Ok((Header { rev, seq: None }, &record[COUNTER_HEADER..]))
        }
        Some(tag) => Err(corrupt(format!("has an unknown layout (first byte {tag})"))),
        None => Err(corrupt("is empty".into())),
    }
}

/// The header and body of a live document's record.
pub(super) fn decode(id: &str, record: &[u8]) -> Result<(Header, Map<String, Value>)> {
    let (header, json) = split(id, record)?;
    let body = crate::model::depth::parse_stored(json).map_err(|e| {
        Error::new(ErrorKind::Corrupt, format!("embedded store: record {id:?} is not a JSON object: {e}"))
    })?;
    Ok((header, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_layout_reads_back() {
        let rev = RevisionId::next_after(Some(4)).unwrap();
        let records = [
            (encode(&rev, 77, b"{}"), StoredRevision::Minted(rev), Some(77)),
            (encode_previous(&StoredRevision::Minted(rev), b"{}"), StoredRevision::Minted(rev), None),
            (encode_previous(&StoredRevision::Counter(41), b"{}"), StoredRevision::Counter(41), None),
        ];
        for (bytes, expected_rev, expected_seq) in &records {
            let (header, json) = split("x", bytes).unwrap();
            assert_eq!((header.rev, header.seq, json), (*expected_rev, *expected_seq, &b"{}"[..]));
        }
        let tombstone = encode(&rev, 78, b"");
        assert_eq!(split("x", &tombstone).unwrap().1, b"");
    }

    #[test]
    fn records_of_unknown_layout_are_corrupt_not_misread() {
        for record in [&[][..], &[7, b'{', b'}'][..], &[TAG_REVISION, 0, 0][..], &[0, 0, 0][..], &[TAG_FEED, 0][..]] {
            let err = split("x", record).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Corrupt, "{record:?}");
        }
    }
}
