//! The rules of a replicated write (CouchDB's `new_edits: false`), shared by every adapter: which
//! incoming revisions are well formed, and what a well-formed one does to the stored state.
//!
//! A replicator sends revisions made elsewhere with their ancestry. CouchDB keeps every branch of
//! a document's revision tree and shows the winner; a backend record holds one revision, so these
//! rules decide which revision the record holds: the one CouchDB would show. Replicas that exchange
//! the same revisions then agree on every document, whatever order the revisions arrive in (see
//! docs/document-model.md); the other branches are kept beside the record ([`super::branches`]).

use std::cmp::Ordering;

use crate::backend::revision::{generation_of, PackedAncestry, RevisionId};
use crate::backend::{Precondition, ReplicatedOutcome, ReplicatedRevision, Revision, RevisionInfo, LOCAL_PREFIX};
use crate::error::{Error, Result};

/// An incoming revision that passed [`check`]: its revision and the whole ancestry it came with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckedRevision {
    pub rev: RevisionId,
    /// The incoming ancestry's tokens, newest first (generations are consecutive, so the
    /// generation of `rev` is all that is needed besides).
    ancestry: PackedAncestry,
}

impl CheckedRevision {
    /// The ancestry to store: the incoming one cut to `revs_limit` entries.
    pub fn stored_ancestry(&self, revs_limit: usize) -> PackedAncestry {
        let keep = revs_limit.max(1) * crate::backend::revision::TOKEN_BYTES;
        PackedAncestry(self.ancestry.0[..self.ancestry.0.len().min(keep)].to_vec())
    }
}

/// Checks an incoming revision for `id`: the id must be a data document's, the revision
/// `N-<32 lowercase hex>` with N ≥ 1, and the ancestry must start with the revision and go down
/// one generation per entry. The error names the problem.
pub fn check(id: &str, incoming: &ReplicatedRevision) -> Result<CheckedRevision> {
    if id.is_empty() {
        return Err(Error::invalid("_id", "a replicated document needs an id"));
    }
    // Design documents are replicated as CouchDB replicates them: the data-store database keeps
    // them as records of its layout, written as every record is (`crate::database::layout`).
    if id.starts_with(LOCAL_PREFIX) {
        return Err(Error::invalid("_id", format!("{id:?} is a local document, which is not replicated in")));
    }
    let rev = RevisionId::parse(incoming.rev.as_str()).ok_or_else(|| {
        Error::invalid("_rev", format!("{:?} is not N-<32 lowercase hex digits> with N at least 1", incoming.rev.0))
    })?;
    if incoming.ancestry.first().map(String::as_str) != Some(incoming.rev.as_str()) {
        return Err(Error::invalid("_revisions", format!("the ancestry does not start with {}", incoming.rev)));
    }
    let mut tokens = Vec::with_capacity(incoming.ancestry.len() * crate::backend::revision::TOKEN_BYTES);
    for (steps, text) in incoming.ancestry.iter().enumerate() {
        let expected = rev.generation.saturating_sub(steps as u64);
        match RevisionId::parse(text) {
            Some(parent) if parent.generation == expected => tokens.extend_from_slice(&parent.token),
            Some(_) => {
                return Err(Error::invalid(
                    "_revisions",
                    format!("entry {steps} ({text}) is not of generation {expected}: the ancestry must go down by one"),
                ))
            }
            None => {
                return Err(Error::invalid(
                    "_revisions",
                    format!("entry {steps} ({text:?}) is not N-<32 lowercase hex>"),
                ))
            }
        }
    }
    Ok(CheckedRevision { rev, ancestry: PackedAncestry(tokens) })
}

/// What a (checked) incoming revision does to the stored state (`None`: the id was never written
/// or was erased). `Applied` means the caller writes it; the others write nothing. An incoming
/// revision whose precondition the stored state does not meet is `KeptCurrent`; the stored
/// revision itself with a precondition naming it is `Applied` (a rewrite in place).
pub fn judge(incoming: &ReplicatedRevision, stored: Option<&RevisionInfo>) -> ReplicatedOutcome {
    let holds = match (&incoming.precondition, stored) {
        (Precondition::None, _) | (Precondition::MustNotExist | Precondition::NeverWritten, None) => true,
        (Precondition::MatchRevision(expected), Some(current)) => &current.rev == expected,
        // `stored` is a tombstone's too: never written means nothing at all.
        (Precondition::MustNotExist | Precondition::NeverWritten, Some(_)) | (Precondition::MatchRevision(_), None) => {
            false
        }
    };
    if !holds {
        return ReplicatedOutcome::KeptCurrent;
    }
    let Some(current) = stored else { return ReplicatedOutcome::Applied };
    if incoming.precondition == Precondition::MatchRevision(incoming.rev.clone()) && current.rev == incoming.rev {
        // The stored revision written again, on purpose: a caller that keeps other branches
        // beside the record moves the document in the change feed so (a new losing leaf).
        return ReplicatedOutcome::Applied;
    }
    if current.rev == incoming.rev || current.ancestry.revisions().any(|known| known == incoming.rev) {
        return ReplicatedOutcome::AlreadyKnown;
    }
    if incoming.ancestry.iter().any(|ancestor| ancestor.as_str() == current.rev.as_str()) {
        // It descends from the current revision: a fast-forward.
        return ReplicatedOutcome::Applied;
    }
    let incoming_branch = Branch::of(&incoming.rev, incoming.deleted, None);
    let current_branch = Branch::of(&current.rev, current.deleted, Some(current.ancestry.start));
    match incoming_branch.cmp(&current_branch) {
        Ordering::Greater => ReplicatedOutcome::Applied,
        _ => ReplicatedOutcome::KeptCurrent,
    }
}

/// A branch's leaf in the order CouchDB picks its winner by: a live leaf beats a deleted one, then
/// the higher generation, then the greater revision id (byte order of its hex part).
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Branch<'a> {
    live: bool,
    generation: u64,
    id: &'a str,
}

impl<'a> Branch<'a> {
    /// `fallback_generation` counts for a stored revision of an older layout without one.
    fn of(rev: &'a Revision, deleted: bool, fallback_generation: Option<u64>) -> Self {
        let generation = generation_of(rev).or(fallback_generation).unwrap_or(1);
        let id = match generation_of(rev) {
            Some(_) => rev.as_str().split_once('-').map_or(rev.as_str(), |(_, id)| id),
            None => rev.as_str(),
        };
        Branch { live: !deleted, generation, id }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::Map;

    use super::*;
    use crate::backend::Ancestry;
    use crate::error::ErrorKind;

    fn rev(generation: u64, fill: char) -> String {
        format!("{generation}-{}", fill.to_string().repeat(32))
    }

    fn incoming(ancestry: &[String], deleted: bool) -> ReplicatedRevision {
        ReplicatedRevision {
            rev: Revision(ancestry[0].clone()),
            ancestry: ancestry.to_vec(),
            deleted,
            body: Map::new(),
            precondition: Precondition::None,
        }
    }

    fn stored(ancestry: &[String], deleted: bool) -> RevisionInfo {
        let (start, _) = ancestry[0].split_once('-').unwrap();
        let ids = ancestry.iter().map(|r| r.split_once('-').unwrap().1.to_owned()).collect();
        RevisionInfo {
            rev: Revision(ancestry[0].clone()),
            deleted,
            ancestry: Ancestry { start: start.parse().unwrap(), ids },
        }
    }

    #[test]
    fn the_rules_pick_couchdbs_winner() {
        use ReplicatedOutcome::*;
        let current = stored(&[rev(2, 'b'), rev(1, 'a')], false);
        let cases = [
            // (incoming ancestry, incoming deleted, expected)
            (vec![rev(2, 'b'), rev(1, 'a')], false, AlreadyKnown),
            (vec![rev(1, 'a')], false, AlreadyKnown),
            (vec![rev(3, 'c'), rev(2, 'b')], false, Applied),
            (vec![rev(3, 'c'), rev(2, 'b')], true, Applied),
            // Divergent: higher generation wins, then the greater id, and live beats deleted.
            (vec![rev(3, '0'), rev(2, 'f'), rev(1, 'a')], false, Applied),
            (vec![rev(2, 'c'), rev(1, 'a')], false, Applied),
            (vec![rev(2, '9'), rev(1, 'a')], false, KeptCurrent),
            (vec![rev(9, 'f')], true, KeptCurrent),
            (vec![rev(1, 'f')], false, KeptCurrent),
        ];
        for (ancestry, deleted, expected) in cases {
            assert_eq!(
                judge(&incoming(&ancestry, deleted), Some(&current)),
                expected,
                "{ancestry:?} deleted={deleted}"
            );
        }
        let tombstone = stored(&[rev(5, 'e')], true);
        assert_eq!(judge(&incoming(&[rev(1, '1')], false), Some(&tombstone)), Applied, "live beats a tombstone");
        assert_eq!(judge(&incoming(&[rev(6, '1')], true), Some(&tombstone)), Applied, "higher generation");
        assert_eq!(judge(&incoming(&[rev(5, 'd')], true), Some(&tombstone)), KeptCurrent, "smaller id");
        assert_eq!(judge(&incoming(&[rev(1, '1')], false), None), Applied, "nothing stored");
    }

    #[test]
    fn a_precondition_is_met_before_the_winner_rule() {
        use ReplicatedOutcome::*;
        let current = stored(&[rev(2, 'b'), rev(1, 'a')], false);
        let with = |ancestry: &[String], precondition: Precondition| ReplicatedRevision {
            precondition,
            ..incoming(ancestry, false)
        };
        let descendant = [rev(3, 'c'), rev(2, 'b')];
        let on = |r: String| Precondition::MatchRevision(Revision(r));
        assert_eq!(judge(&with(&descendant, on(rev(2, 'b'))), Some(&current)), Applied);
        assert_eq!(judge(&with(&descendant, on(rev(2, 'f'))), Some(&current)), KeptCurrent, "another revision");
        assert_eq!(judge(&with(&descendant, Precondition::MustNotExist), Some(&current)), KeptCurrent);
        assert_eq!(judge(&with(&descendant, Precondition::MustNotExist), None), Applied);
        assert_eq!(judge(&with(&descendant, on(rev(2, 'b'))), None), KeptCurrent, "nothing stored");
        // The stored revision itself, named by its precondition: written again in place.
        let same = [rev(2, 'b'), rev(1, 'a')];
        assert_eq!(judge(&with(&same, on(rev(2, 'b'))), Some(&current)), Applied);
        assert_eq!(judge(&with(&same, Precondition::None), Some(&current)), AlreadyKnown);
    }

    #[test]
    fn malformed_revisions_are_refused_naming_the_problem() {
        let good = incoming(&[rev(2, 'b'), rev(1, 'a')], false);
        let checked = check("u:n:k", &good).unwrap();
        assert_eq!(checked.rev.to_revision(), good.rev);
        assert_eq!(checked.stored_ancestry(1).unpack(2).revisions().collect::<Vec<_>>(), vec![good.rev.clone()]);
        assert_eq!(checked.stored_ancestry(5).len(), 2);
        // A design document is a record like any other (the data-store layout writes its
        // revisions as replicated ones); a local document never is.
        assert!(check("_design/x", &good).is_ok());
        let refused = [
            ("u:n:k", incoming(&[format!("2-{}", "B".repeat(32))], false), "_rev"),
            ("u:n:k", incoming(&[format!("0-{}", "a".repeat(32))], false), "_rev"),
            ("u:n:k", incoming(&[format!("1-{}", "a".repeat(31))], false), "_rev"),
            ("u:n:k", incoming(&[rev(3, 'c'), rev(1, 'a')], false), "_revisions"),
            ("u:n:k", incoming(&[rev(2, 'c'), "1-x".into()], false), "_revisions"),
            ("u:n:k", ReplicatedRevision { ancestry: vec![rev(1, 'a')], ..good.clone() }, "_revisions"),
            ("u:n:k", ReplicatedRevision { ancestry: vec![], ..good.clone() }, "_revisions"),
            ("_local/x", good.clone(), "_id"),
            ("", good.clone(), "_id"),
        ];
        for (id, revision, field) in refused {
            let err = check(id, &revision).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidInput, "{id} {revision:?}");
            assert!(err.message().contains(field), "{}: does not name {field}", err.message());
        }
    }
}
