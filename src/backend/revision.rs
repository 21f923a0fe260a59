//! CouchDB-form revisions and their ancestry, shared by the adapters that mint their own
//! (embedded, DynamoDB, Firestore; CouchDB keeps its own).
//!
//! A revision is `N-<32 lowercase hex>`: `N` the document's generation (1 on create, +1 on every
//! update or delete, continuing across a delete and re-create as CouchDB does) and 128 bits from
//! the operating system's random generator. Random rather than derived from the content or the id:
//! two writers racing from the same revision must never mint the same one (a retried write
//! recognises its own success by its revision), and a revision must reveal nothing about other
//! documents or the store's write volume.
//!
//! The ancestry is the last `revs_limit` revision ids of a document, newest first, kept as the
//! generation of the newest and the 16-byte tokens: generations are consecutive, so the tokens are
//! all that is needed to spell CouchDB's `_revisions` (`{start, ids}`).

use crate::backend::{Precondition, Revision};
use crate::error::{Error, ErrorKind, Result};

/// CouchDB's default `_revs_limit`: how many revision ids of a document are remembered.
pub const DEFAULT_REVS_LIMIT: usize = 1000;

/// Bytes of the random part of a revision.
pub const TOKEN_BYTES: usize = 16;

/// A revision this crate minted (or one of the same form read from CouchDB): generation and token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RevisionId {
    pub generation: u64,
    pub token: [u8; TOKEN_BYTES],
}

impl RevisionId {
    /// The first revision of a new document, or the next one after `previous` (the current
    /// revision or the tombstone's).
    pub fn next_after(previous_generation: Option<u64>) -> Result<Self> {
        Ok(Self::following(previous_generation, random_token()?))
    }

    /// [`RevisionId::next_after`] with a token drawn beforehand ([`random_tokens`]).
    pub fn following(previous_generation: Option<u64>, token: [u8; TOKEN_BYTES]) -> Self {
        RevisionId { generation: previous_generation.map_or(1, |g| g.saturating_add(1)), token }
    }

    /// Parses `N-<32 hex>`; `None` for any other text (a revision of an older layout, or input).
    pub fn parse(rev: &str) -> Option<Self> {
        let (generation, hex_part) = rev.split_once('-')?;
        if generation.is_empty() || generation.starts_with('0') || !generation.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        if hex_part.len() != 2 * TOKEN_BYTES || !hex_part.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return None;
        }
        let mut token = [0u8; TOKEN_BYTES];
        hex::decode_to_slice(hex_part, &mut token).ok()?;
        Some(RevisionId { generation: generation.parse().ok()?, token })
    }

    /// The revision's text, `N-<32 hex>`. Written into one string sized for it: every feed
    /// row and every record read spells a revision, and `format!` with `hex::encode` (a `String`
    /// built a character at a time, then copied) was a tenth of a `_changes` page (issue 38).
    pub fn to_revision(self) -> Revision {
        let mut digits = [0u8; 2 * TOKEN_BYTES];
        // The lengths match (two digits a byte), so this cannot fail.
        let _ = hex::encode_to_slice(self.token, &mut digits);
        let mut generation = itoa::Buffer::new();
        let generation = generation.format(self.generation);
        let mut text = String::with_capacity(generation.len() + 1 + digits.len());
        text.push_str(generation);
        text.push('-');
        text.push_str(hex_str(&digits));
        Revision(text)
    }
}

/// A revision token's 32 lowercase hex digits as a `String`, written into one buffer sized for
/// it (`hex::encode_to_slice`; `hex::encode` builds its `String` a character at a time); any
/// other length through `hex::encode`.
fn token_text(token: &[u8]) -> String {
    let mut digits = [0u8; 2 * TOKEN_BYTES];
    match hex::encode_to_slice(token, &mut digits) {
        Ok(()) => hex_str(&digits).to_owned(),
        Err(_) => hex::encode(token),
    }
}

/// Hex digits as text (they are ASCII, so the check cannot fail).
fn hex_str(digits: &[u8]) -> &str {
    std::str::from_utf8(digits).unwrap_or_default()
}

/// The generation of any revision text of the form `N-…` (CouchDB's, and the older layouts'
/// `N-<16 hex>`); `None` when it has none (the embedded store's old plain counters).
pub fn generation_of(rev: &Revision) -> Option<u64> {
    let (generation, rest) = rev.as_str().split_once('-')?;
    // The part after `-` is hex in every such form; a Firestore update time (`2026-11-23T…`) also
    // has a `-` and must not read as generation 2026.
    if rest.is_empty() || generation.starts_with('0') || !rest.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    generation.parse().ok()
}

/// A local document's revision `0-N`: N counts its writes since it was created (CouchDB's form).
pub fn local_revision(n: u64) -> Revision {
    Revision(format!("0-{n}"))
}

/// N of a local revision `0-N` (N ≥ 1); `None` for any other text.
pub fn local_number(rev: &Revision) -> Option<u64> {
    let n = rev.as_str().strip_prefix("0-")?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    n.parse().ok().filter(|n| *n > 0)
}

/// The revision a write of the local document `id` gets, when `precondition` holds against its
/// `current` revision (`None`: there is none); a conflict otherwise.
pub fn next_local_revision(id: &str, precondition: &Precondition, current: Option<&Revision>) -> Result<Revision> {
    match (precondition, current) {
        // A deleted local document is gone: never written and absent are one state.
        (Precondition::MustNotExist | Precondition::NeverWritten, Some(_)) => {
            Err(Error::conflict(format!("document {id:?} already exists")))
        }
        (Precondition::MatchRevision(expected), None) => {
            Err(Error::conflict(format!("document {id:?} does not exist, so it is not at revision {expected}")))
        }
        (Precondition::MatchRevision(expected), Some(found)) if found != expected => {
            Err(Error::conflict(format!("document {id:?} is at revision {found}, not {expected}")))
        }
        _ => Ok(local_revision(current.and_then(local_number).unwrap_or(0) + 1)),
    }
}

/// 128 bits from the operating system's random generator.
pub fn random_token() -> Result<[u8; TOKEN_BYTES]> {
    let mut token = [0u8; TOKEN_BYTES];
    fill_random(&mut token)?;
    Ok(token)
}

/// `count` tokens of 128 random bits, drawn from the operating system in one call (each call is
/// a system call: a bulk write of 1,000 documents made 1,000 of them one at a time).
pub fn random_tokens(count: usize) -> Result<Vec<[u8; TOKEN_BYTES]>> {
    let mut bytes = vec![0u8; count.saturating_mul(TOKEN_BYTES)];
    fill_random(&mut bytes)?;
    Ok(bytes.chunks_exact(TOKEN_BYTES).map(|chunk| chunk.try_into().unwrap_or([0; TOKEN_BYTES])).collect())
}

fn fill_random(bytes: &mut [u8]) -> Result<()> {
    getrandom::fill(bytes)
        .map_err(|e| Error::new(ErrorKind::Internal, format!("the operating system's random generator failed: {e}")))
}

/// A document's remembered revision ids, newest first: CouchDB's `_revisions`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ancestry {
    /// The generation of the newest revision (CouchDB's `start`).
    pub start: u64,
    /// The revision ids' parts after `N-`, newest first (CouchDB's `ids`); `ids[i]` is generation
    /// `start - i`.
    pub ids: Vec<String>,
}

impl Ancestry {
    /// The full revisions, newest first.
    pub fn revisions(&self) -> impl Iterator<Item = Revision> + '_ {
        self.ids.iter().enumerate().map(|(i, id)| Revision(format!("{}-{id}", self.start - i as u64)))
    }
}

/// An ancestry packed as bytes for storage: the tokens, newest first, 16 bytes each (the
/// generation is the current revision's). Compact, and cheap to extend: a new revision is its
/// token prepended and the list cut to `revs_limit`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PackedAncestry(pub Vec<u8>);

impl PackedAncestry {
    /// The ancestry of a new revision `rev` whose parent's ancestry is `parent` (empty for a new
    /// document), at most `revs_limit` entries.
    pub fn extend(parent: Option<&PackedAncestry>, rev: &RevisionId, revs_limit: usize) -> PackedAncestry {
        let keep = revs_limit.max(1);
        let mut bytes = Vec::with_capacity(TOKEN_BYTES * keep.min(1 + parent.map_or(0, |p| p.len())));
        bytes.extend_from_slice(&rev.token);
        if let Some(parent) = parent {
            let room = (keep - 1) * TOKEN_BYTES;
            bytes.extend_from_slice(&parent.0[..parent.0.len().min(room)]);
        }
        PackedAncestry(bytes)
    }

    /// How many revision ids it holds.
    pub fn len(&self) -> usize {
        self.0.len() / TOKEN_BYTES
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether the stored bytes are whole tokens.
    pub fn is_well_formed(&self) -> bool {
        self.0.len().is_multiple_of(TOKEN_BYTES)
    }

    /// CouchDB's `_revisions` for a document whose current generation is `start`.
    pub fn unpack(&self, start: u64) -> Ancestry {
        Ancestry { start, ids: self.0.chunks_exact(TOKEN_BYTES).map(token_text).collect() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn revisions_have_couchdbs_form_and_count_generations() {
        let first = RevisionId::next_after(None).unwrap();
        let second = RevisionId::next_after(Some(first.generation)).unwrap();
        assert_eq!((first.generation, second.generation), (1, 2));
        assert_ne!(first.token, second.token);
        let text = second.to_revision();
        assert_eq!(RevisionId::parse(text.as_str()), Some(second));
        for bad in ["", "1", "1-", "01-00000000000000000000000000000000", "1-ABCDEF00000000000000000000000000", "x-0"] {
            assert_eq!(RevisionId::parse(bad), None, "{bad:?}");
        }
        assert_eq!(generation_of(&Revision("12-abc".into())), Some(12));
        assert_eq!(generation_of(&Revision("41".into())), None);
        assert_eq!(generation_of(&Revision("2026-11-23T05:00:00.123456Z".into())), None);
    }

    #[test]
    fn local_revisions_count_writes() {
        let (one, two) = (local_revision(1), local_revision(2));
        assert_eq!(next_local_revision("_local/x", &Precondition::MustNotExist, None).unwrap(), one);
        assert_eq!(
            next_local_revision("_local/x", &Precondition::MatchRevision(one.clone()), Some(&one)).unwrap(),
            two
        );
        assert_eq!(next_local_revision("_local/x", &Precondition::None, Some(&two)).unwrap(), local_revision(3));
        for (precondition, current) in [
            (Precondition::MustNotExist, Some(&one)),
            (Precondition::MatchRevision(one.clone()), None),
            (Precondition::MatchRevision(one.clone()), Some(&two)),
        ] {
            let refused = next_local_revision("_local/x", &precondition, current).unwrap_err();
            assert_eq!(refused.kind(), ErrorKind::Conflict, "{precondition:?} against {current:?}");
        }
        for bad in ["0-", "0-0", "1-1", "0-x", "0-+1"] {
            assert_eq!(local_number(&Revision(bad.into())), None, "{bad:?}");
        }
    }

    #[test]
    fn ancestry_is_newest_first_and_cut_to_the_limit() {
        let mut revs = vec![RevisionId::next_after(None).unwrap()];
        let mut packed = PackedAncestry::extend(None, &revs[0], 3);
        for _ in 0..4 {
            let next = RevisionId::next_after(Some(revs.last().unwrap().generation)).unwrap();
            packed = PackedAncestry::extend(Some(&packed), &next, 3);
            revs.push(next);
        }
        let ancestry = packed.unpack(5);
        assert_eq!(ancestry.start, 5);
        let expected: Vec<Revision> = revs.iter().rev().take(3).map(|r| r.to_revision()).collect();
        assert_eq!(ancestry.revisions().collect::<Vec<_>>(), expected);
    }
}
