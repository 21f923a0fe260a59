//! A document's revision tree and CouchDB's rules on it: edits, replicated merges, the winner,
//! conflicts, `_revs_info`, `_revs_diff`, purge and stemming. Pure data, no I/O: the tree is a
//! serde value stored inside a document record by the database engine.
//!
//! The tree is kept as its leaves, each with its path back to the root of its tree (CouchDB's
//! `_revisions` form, ids newest first). In memory, paths of leaves that share ancestors repeat
//! them; the stored form ([`stored`]) keeps each revision once. Every
//! stored path runs up to the oldest revision its tree remembers, so the leaves describe the whole
//! tree; replicated merges rebuild the tree from them (`Forest`) and follow
//! `couch_key_tree:merge/2` on it. As in CouchDB, a revision that stops being a leaf keeps its
//! body (an [`InnerBody`]) until compaction ([`RevTree::drop_inner_bodies`]), stemming, purge or
//! the engine's bounds drop it; the ancestors a replicated path brings never had one.
//!
//! Revision ids are compared as CouchDB compares them: as bytes, except that an id of 32
//! hexadecimal characters is the text of an MD5 and CouchDB holds (and orders) it as its 16
//! decoded bytes (`couch_doc:parse_revid/2`).

use std::cmp::Ordering;
use std::collections::HashSet;
use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

pub use stored::{StoredBody, StoredLeaves, StoredTree};

/// The body of a revision that is no longer a leaf (CouchDB keeps it until compaction), with its
/// deletion flag.
#[derive(Debug, Clone, PartialEq)]
pub struct InnerBody {
    pub generation: u64,
    pub id: String,
    pub deleted: bool,
    pub body: Map<String, Value>,
}

impl InnerBody {
    /// What the body costs in [`RevTree::held_bytes`].
    fn held_bytes(&self) -> usize {
        crate::model::validate::json_size(&self.body).saturating_add(self.id.len()).saturating_add(LEAF_OVERHEAD_BYTES)
    }
}

mod stored;

/// The default largest revision tree of one document, in [`RevTree::held_bytes`]
/// (`couchdb_max_tree_bytes`, one bound for every database): four documents of CouchDB's largest
/// size with their histories.
pub const DEFAULT_MAX_TREE_BYTES: usize = 32 << 20;

/// `N-id` parsed: CouchDB's rule (N a positive integer without leading zeros, id non-empty).
///
/// CouchDB also refuses an id of 32 characters that are not all hexadecimal (it decodes such ids
/// as MD5s: `couch_doc:parse_revid/2`), so this does too.
pub fn parse_rev(rev: &str) -> Option<(u64, &str)> {
    let (generation, id) = rev.split_once('-')?;
    let generation = parse_generation(generation)?;
    valid_rev_id(id).then_some((generation, id))
}

fn parse_generation(text: &str) -> Option<u64> {
    let digits_only = !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit());
    if !digits_only || text.starts_with('0') {
        return None;
    }
    text.parse().ok()
}

/// Whether CouchDB accepts `id` after `N-`: hexadecimal when 32 bytes long. An empty id is
/// accepted, as `couch_doc:parse_rev` accepts `1-` (PouchDB's test 7829 writes one).
fn valid_rev_id(id: &str) -> bool {
    id.len() != 32 || id.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Whether `id` is 32 hexadecimal digits (an md5 as CouchDB writes revision ids).
fn is_md5_text(id: &str) -> bool {
    id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The 16 bytes an id of 32 hexadecimal characters stands for, as CouchDB holds it.
fn md5_bytes(id: &str) -> Option<[u8; 16]> {
    let text = id.as_bytes();
    if text.len() != 32 {
        return None;
    }
    let mut bytes = [0u8; 16];
    for (byte, pair) in bytes.iter_mut().zip(text.chunks_exact(2)) {
        let high = char::from(pair[0]).to_digit(16)?;
        let low = char::from(pair[1]).to_digit(16)?;
        *byte = u8::try_from(high * 16 + low).ok()?;
    }
    Some(bytes)
}

/// CouchDB's order of revision ids of one generation (Erlang's order of the binaries it keeps).
fn id_order(a: &str, b: &str) -> Ordering {
    // Two 32-digit hex ids (every revision CouchDB and PouchDB make): their bytes compare as
    // their digits do, case aside; no decoding needed on this, the common, path.
    if is_md5_text(a) && is_md5_text(b) {
        return a.bytes().map(|c| c.to_ascii_lowercase()).cmp(b.bytes().map(|c| c.to_ascii_lowercase()));
    }
    match (md5_bytes(a), md5_bytes(b)) {
        (Some(a), Some(b)) => a.cmp(&b),
        (Some(a), None) => a.as_slice().cmp(b.as_bytes()),
        (None, Some(b)) => a.as_bytes().cmp(b.as_slice()),
        (None, None) => a.as_bytes().cmp(b.as_bytes()),
    }
}

/// One path of a revision tree: generation `start` of its newest revision and the revision ids
/// newest first, generations consecutive (`ids[i]` is generation `start - i`).
///
/// Its serde form is the compact stored one (`s`, `i`); [`RevPath::to_revisions`] gives
/// CouchDB's `_revisions` JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RevPath {
    #[serde(rename = "s")]
    pub start: u64,
    #[serde(rename = "i")]
    pub ids: Vec<String>,
}

impl RevPath {
    /// `"start-ids[0]"`, the newest revision of the path. Written into one string sized for it
    /// (every row of a listing or a feed spells one; `format!` was a measurable part of them).
    pub fn leaf_rev(&self) -> String {
        let id = self.ids.first().map_or("", String::as_str);
        let mut generation = itoa::Buffer::new();
        let generation = generation.format(self.start);
        let mut rev = String::with_capacity(generation.len() + 1 + id.len());
        rev.push_str(generation);
        rev.push('-');
        rev.push_str(id);
        rev
    }

    /// Whether both paths end in the same revision (their [`RevPath::leaf_rev`]s are equal: the
    /// generation is digits before the first `-`, so the text is equal exactly when both parts
    /// are), compared without writing either.
    pub fn same_leaf_rev(&self, other: &RevPath) -> bool {
        self.start == other.start
            && self.ids.first().map_or("", String::as_str) == other.ids.first().map_or("", String::as_str)
    }

    /// Whether the path holds revision `rev` (`N-id`), compared without writing the path's
    /// revisions out ([`RevPath::revs`]).
    pub fn holds(&self, rev: &str) -> bool {
        parse_rev(rev).is_some_and(|(generation, id)| self.position(generation, id).is_some())
    }

    /// Every `N-id` of the path, newest first, each written as [`RevPath::leaf_rev`] writes one
    /// (`format!` was most of a data-store record write's head, issue 38).
    pub fn revs(&self) -> Vec<String> {
        let mut generation_text = itoa::Buffer::new();
        self.generations()
            .map(|(generation, id)| {
                let generation = generation_text.format(generation);
                let mut rev = String::with_capacity(generation.len() + 1 + id.len());
                rev.push_str(generation);
                rev.push('-');
                rev.push_str(id);
                rev
            })
            .collect()
    }

    /// CouchDB's `_revisions` (`{"start": N, "ids": [..]}`) parsed; `None` when malformed: not an
    /// object, `start` not a non-negative integer, `ids` not a non-empty array of revision ids,
    /// or more ids than generations (`start < ids.len()`).
    pub fn from_revisions(value: &Value) -> Option<RevPath> {
        let object = value.as_object()?;
        let start = object.get("start")?.as_u64()?;
        let ids = object.get("ids")?.as_array()?;
        let count = u64::try_from(ids.len()).ok()?;
        if ids.is_empty() || start < count {
            return None;
        }
        let ids = ids
            .iter()
            .map(|id| id.as_str().filter(|id| valid_rev_id(id)).map(str::to_owned))
            .collect::<Option<Vec<_>>>()?;
        Some(RevPath { start, ids })
    }

    /// CouchDB's `_revisions` JSON of this path.
    pub fn to_revisions(&self) -> Value {
        serde_json::json!({ "start": self.start, "ids": self.ids })
    }

    /// (generation, id) newest first; stops at generation 1 however many ids a malformed path
    /// holds.
    fn generations(&self) -> impl Iterator<Item = (u64, &str)> + '_ {
        self.ids.iter().zip((1..=self.start).rev()).map(|(id, generation)| (generation, id.as_str()))
    }

    /// The index in `ids` of revision `generation`-`id`, if the path holds it.
    fn position(&self, generation: u64, id: &str) -> Option<usize> {
        if generation == 0 || generation > self.start {
            return None;
        }
        let index = usize::try_from(self.start - generation).ok()?;
        (self.ids.get(index)? == id).then_some(index)
    }

    /// Drops ids a malformed path holds beyond generation 1.
    fn drop_impossible_ids(&mut self) {
        let possible = usize::try_from(self.start).unwrap_or(usize::MAX);
        self.ids.truncate(possible);
    }
}

/// A leaf of a revision tree: its path, whether it is a deletion, and its body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Leaf {
    #[serde(rename = "p")]
    pub path: RevPath,
    #[serde(rename = "d", default, skip_serializing_if = "is_false")]
    pub deleted: bool,
    #[serde(rename = "b", default, skip_serializing_if = "Map::is_empty")]
    pub body: Map<String, Value>,
}

fn is_false(value: &bool) -> bool {
    !*value
}

impl Leaf {
    /// The leaf's revision, `N-id`.
    pub fn rev(&self) -> String {
        self.path.leaf_rev()
    }

    fn id(&self) -> &str {
        self.path.ids.first().map_or("", String::as_str)
    }

    fn is(&self, generation: u64, id: &str) -> bool {
        self.path.start == generation && self.id() == id
    }
}

/// What a leaf costs in [`RevTree::held_bytes`] besides its body and ids (its generation,
/// deletion flag and framing).
const LEAF_OVERHEAD_BYTES: usize = 32;

/// CouchDB's order of leaves, the winner first (`couch_doc:to_doc_info_path/1`: descending by
/// not-deleted, then generation, then revision id).
fn winner_order(a: &Leaf, b: &Leaf) -> Ordering {
    a.deleted.cmp(&b.deleted).then(b.path.start.cmp(&a.path.start)).then_with(|| id_order(b.id(), a.id()))
}

/// A document's revision tree, kept as its leaves (see the module's documentation). Stored in
/// the form of [`stored`]: each revision once.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(try_from = "StoredTree")]
pub struct RevTree {
    leaves: Vec<Leaf>,
    /// Kept bodies of revisions on the leaves' paths that are not leaves, by generation then id.
    inner: Vec<InnerBody>,
}

impl Serialize for RevTree {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        stored::StoredRevisions { leaves: &self.leaves, inner: &self.inner }.serialize(serializer)
    }
}

impl<B: stored::StoredBody> TryFrom<StoredTree<B>> for RevTree {
    type Error = String;

    fn try_from(stored: StoredTree<B>) -> Result<Self, String> {
        let (leaves, inner) = stored.into_parts()?;
        let mut tree = RevTree { leaves, inner };
        tree.normalise();
        Ok(tree)
    }
}

/// A revision tree read without its bodies: every leaf's path and deletion flag as stored, each
/// body (and kept inner body) empty, skipped unparsed. For readers that show revisions only (a
/// `_changes` row: a page decoded every body whole, issue 38); never saved, since its bodies are
/// not the document's.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(try_from = "StoredTree<serde::de::IgnoredAny>")]
pub struct RevTreeOutline(pub RevTree);

impl From<RevTreeOutline> for RevTree {
    fn from(outline: RevTreeOutline) -> RevTree {
        outline.0
    }
}

impl TryFrom<StoredTree<serde::de::IgnoredAny>> for RevTreeOutline {
    type Error = String;

    fn try_from(stored: StoredTree<serde::de::IgnoredAny>) -> Result<Self, String> {
        RevTree::try_from(stored).map(RevTreeOutline)
    }
}

/// A stored tree's winning leaf with its body as the stored JSON text, unparsed, and the
/// revisions of the other leaves: what a map function is shown of a document
/// (`crate::database::document::winner_json`), read without building the tree's bodies as
/// values (a view build parsed each body, copied it into the document and wrote that as JSON
/// again, a fifth of a build's instructions: issue 38). Leaves are ordered as [`RevTree`]
/// orders them once read ([`RevTree::winner`], [`RevTree::conflicts`]), so the same leaf wins.
#[derive(Debug, Default, Deserialize)]
#[serde(try_from = "StoredTree<stored::RawBody>")]
pub struct WinnerText {
    /// The winning leaf's revision, `N-id`; `None` when the tree has no leaf.
    pub rev: Option<String>,
    pub deleted: bool,
    /// The winner's body as stored (`None`: stored empty).
    pub body: Option<Box<serde_json::value::RawValue>>,
    /// `_conflicts`: the other live leaves, in [`RevTree::conflicts`]'s order.
    pub conflicts: Vec<String>,
    /// `_deleted_conflicts`: the other deleted leaves, in [`RevTree::deleted_conflicts`]'s order.
    pub deleted_conflicts: Vec<String>,
}

impl TryFrom<StoredTree<stored::RawBody>> for WinnerText {
    type Error = String;

    fn try_from(stored: StoredTree<stored::RawBody>) -> Result<Self, String> {
        let mut leaves = stored.into_leaves_and_bodies()?;
        // As `RevTree::normalise` and `RevTree::leaves` order them (both stable sorts).
        for (leaf, _) in &mut leaves {
            leaf.path.drop_impossible_ids();
        }
        leaves.retain(|(leaf, _)| !leaf.path.ids.is_empty());
        leaves.sort_by(|(a, _), (b, _)| winner_order(a, b));
        let mut leaves = leaves.into_iter();
        let Some((winner, body)) = leaves.next() else {
            return Ok(WinnerText::default());
        };
        let (mut conflicts, mut deleted_conflicts) = (Vec::new(), Vec::new());
        for (leaf, _) in leaves {
            match leaf.deleted {
                true => deleted_conflicts.push(leaf.rev()),
                false => conflicts.push(leaf.rev()),
            }
        }
        Ok(WinnerText { rev: Some(winner.rev()), deleted: winner.deleted, body: body.0, conflicts, deleted_conflicts })
    }
}

/// What a replicated revision did to the tree (`couch_key_tree:merge/2`'s answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MergeOutcome {
    /// The revision was already in the tree (`internal_node`). Nothing changes but, as in
    /// CouchDB, older ancestors the incoming path carried and the tree had forgotten are
    /// remembered again (within the revision limit).
    AlreadyKnown,
    /// An existing leaf was extended (`new_leaf`); also the answer for the first revision of an
    /// empty tree, as in CouchDB.
    Extended,
    /// A new leaf beside the existing ones (`new_branch`): a conflict, branching off a shared
    /// ancestor or on a separate root when it shares none.
    NewBranch,
}

/// Why an edit (`new_edits=true`) was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EditError {
    /// CouchDB's `409 conflict`: the parent is not a leaf, or no parent was given for a live
    /// document, or a parent was given for a deleted one.
    Conflict,
}

impl fmt::Display for EditError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EditError::Conflict => f.write_str("Document update conflict."),
        }
    }
}

impl std::error::Error for EditError {}

/// A revision's status in `_revs_info`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RevStatus {
    Available,
    Deleted,
    Missing,
}

impl RevStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            RevStatus::Available => "available",
            RevStatus::Deleted => "deleted",
            RevStatus::Missing => "missing",
        }
    }
}

impl RevTree {
    /// Whether the tree has no leaves (no document).
    pub fn is_empty(&self) -> bool {
        self.leaves.is_empty()
    }

    /// Whether the document is deleted: every leaf is a deletion (CouchDB's
    /// `couch_doc:is_deleted/1`; true for an empty tree too).
    pub fn is_deleted(&self) -> bool {
        self.leaves.iter().all(|leaf| leaf.deleted)
    }

    /// Leaves in CouchDB's order: the winner first, then the rest in the same order (not deleted
    /// before deleted, then higher generation first, then higher revision id first).
    pub fn leaves(&self) -> Vec<&Leaf> {
        let mut leaves: Vec<&Leaf> = self.leaves.iter().collect();
        leaves.sort_by(|a, b| winner_order(a, b));
        leaves
    }

    /// The winning leaf, what a plain `GET` returns.
    pub fn winner(&self) -> Option<&Leaf> {
        self.leaves.iter().min_by(|a, b| winner_order(a, b))
    }

    /// The leaf whose revision is `rev`.
    pub fn leaf(&self, rev: &str) -> Option<&Leaf> {
        let (generation, id) = parse_rev(rev)?;
        self.leaves.iter().find(|leaf| leaf.is(generation, id))
    }

    /// Whether rev is anywhere in the tree (a leaf or a remembered ancestor).
    pub fn contains(&self, rev: &str) -> bool {
        parse_rev(rev)
            .is_some_and(|(generation, id)| self.leaves.iter().any(|leaf| leaf.path.position(generation, id).is_some()))
    }

    /// The path from `rev` (leaf or ancestor) back as far as remembered.
    pub fn path_to(&self, rev: &str) -> Option<RevPath> {
        let (generation, id) = parse_rev(rev)?;
        self.leaves().into_iter().find_map(|leaf| {
            let index = leaf.path.position(generation, id)?;
            // Not past generation 1, should a stored path hold more ids than generations.
            let count = usize::try_from(generation).unwrap_or(usize::MAX);
            let ids = leaf.path.ids.get(index..)?.iter().take(count).cloned().collect();
            Some(RevPath { start: generation, ids })
        })
    }

    /// An edit (`new_edits=true`) with `parent` the rev the client sent (None = no `_rev`), as
    /// CouchDB decides it (`couch_db:prep_and_validate_updates` and
    /// `couch_db_updater:merge_rev_tree/4`):
    /// - no leaves: allowed without a parent (generation 1); a parent is a conflict;
    /// - a live document (some leaf not deleted): the parent must be a leaf, deleted or not, and
    ///   the new revision replaces it; no parent is a conflict;
    /// - a deleted document (every leaf deleted): only a recreation without a parent is allowed,
    ///   extending the deleted winner's path; a parent, even the tombstone's own revision, is a
    ///   conflict (COUCHDB-292), and so is deleting it again.
    ///
    /// The tree is then stemmed to `revs_limit`. Returns the new rev `N-new_id`. In CouchDB a
    /// recreation's id is computed from the deleted winner's rev, not from none.
    pub fn edit(
        &mut self,
        parent: Option<&str>,
        new_id: &str,
        deleted: bool,
        body: Map<String, Value>,
        revs_limit: usize,
    ) -> Result<String, EditError> {
        let path = match self.edit_base(parent, deleted)? {
            None => RevPath { start: 1, ids: vec![new_id.to_owned()] },
            Some(index) => {
                let start = self.leaves[index].path.start.checked_add(1).ok_or(EditError::Conflict)?;
                let replaced = self.leaves.remove(index);
                self.inner.push(InnerBody {
                    generation: replaced.path.start,
                    id: replaced.id().to_owned(),
                    deleted: replaced.deleted,
                    body: replaced.body,
                });
                let mut ids = Vec::with_capacity(replaced.path.ids.len() + 1);
                ids.push(new_id.to_owned());
                ids.extend(replaced.path.ids);
                RevPath { start, ids }
            }
        };
        let rev = path.leaf_rev();
        self.leaves.push(Leaf { path, deleted, body });
        self.stem(revs_limit);
        Ok(rev)
    }

    /// Whether [`RevTree::edit`] would refuse an edit naming `parent` as a conflict. CouchDB
    /// checks this before a design document's `validate_doc_update` runs
    /// (`couch_db:prep_and_validate_update`), so such an edit is 409 whatever validation says.
    pub fn edit_conflicts(&self, parent: Option<&str>, deleted: bool) -> bool {
        self.edit_base(parent, deleted).is_err()
    }

    /// The index of the leaf an edit extends (`None`: a new first revision), or its conflict:
    /// the rules of [`RevTree::edit`].
    fn edit_base(&self, parent: Option<&str>, deleted: bool) -> Result<Option<usize>, EditError> {
        match parent {
            None if self.leaves.is_empty() => Ok(None),
            None if self.is_deleted() && !deleted => Ok(Some(self.winner_index().ok_or(EditError::Conflict)?)),
            None => Err(EditError::Conflict),
            Some(_) if self.is_deleted() => Err(EditError::Conflict),
            Some(parent) => {
                let (generation, id) = parse_rev(parent).ok_or(EditError::Conflict)?;
                let index = self.leaves.iter().position(|leaf| leaf.is(generation, id));
                Ok(Some(index.ok_or(EditError::Conflict)?))
            }
        }
    }

    /// A replicated revision (`new_edits=false`): its path as sent, merged as CouchDB's key tree
    /// merge does (`couch_key_tree:merge/2`), then stemmed to `revs_limit`. A path without ids
    /// changes nothing (`AlreadyKnown`).
    pub fn merge(&mut self, path: RevPath, deleted: bool, body: Map<String, Value>, revs_limit: usize) -> MergeOutcome {
        self.merge_all(vec![(path, deleted, body)], revs_limit).pop().unwrap_or(MergeOutcome::AlreadyKnown)
    }

    /// Several replicated revisions merged in order, as [`RevTree::merge`] merges one, with the
    /// tree rebuilt once for all of them (a replicator may send hundreds of branches of one
    /// document in one request); one outcome each.
    pub fn merge_all(
        &mut self,
        paths: Vec<(RevPath, bool, Map<String, Value>)>,
        revs_limit: usize,
    ) -> Vec<MergeOutcome> {
        let mut forest = Forest::from_parts(std::mem::take(&mut self.leaves), std::mem::take(&mut self.inner));
        let mut outcomes = Vec::with_capacity(paths.len());
        for (mut path, deleted, body) in paths {
            path.drop_impossible_ids();
            if path.ids.is_empty() {
                outcomes.push(MergeOutcome::AlreadyKnown);
                continue;
            }
            outcomes.push(forest.merge(path, LeafValue { deleted, body }));
        }
        (self.leaves, self.inner) = forest.into_parts();
        self.stem(revs_limit);
        outcomes
    }

    /// Non-deleted leaves other than the winner, CouchDB's `_conflicts` order.
    pub fn conflicts(&self) -> Vec<String> {
        self.leaves().into_iter().skip(1).filter(|leaf| !leaf.deleted).map(Leaf::rev).collect()
    }

    /// Deleted leaves other than the winner (`_deleted_conflicts`).
    pub fn deleted_conflicts(&self) -> Vec<String> {
        self.leaves().into_iter().skip(1).filter(|leaf| leaf.deleted).map(Leaf::rev).collect()
    }

    /// `_revs_info` of the winner's path (`couch_db:doc_meta_info/3`): each revision whose body
    /// is kept `available` (or `deleted` if it is a deletion), the others `missing` (compacted
    /// away, stemmed, or brought by a replicated path without one).
    pub fn revs_info(&self) -> Vec<(String, RevStatus)> {
        let Some(winner) = self.winner() else {
            return Vec::new();
        };
        let status = |deleted: bool| if deleted { RevStatus::Deleted } else { RevStatus::Available };
        winner
            .path
            .generations()
            .enumerate()
            .map(|(index, (generation, id))| {
                let kept =
                    if index == 0 { Some(winner.deleted) } else { self.inner_body(generation, id).map(|b| b.deleted) };
                (format!("{generation}-{id}"), kept.map_or(RevStatus::Missing, status))
            })
            .collect()
    }

    /// The revision `rev` as a client may read it: a leaf, or an inner revision whose body is
    /// kept, with its path back as far as remembered (`GET ?rev=`, `open_revs`, an attachment of
    /// an earlier revision). `None` when the tree has no body for it.
    pub fn revision(&self, rev: &str) -> Option<std::borrow::Cow<'_, Leaf>> {
        if let Some(leaf) = self.leaf(rev) {
            return Some(std::borrow::Cow::Borrowed(leaf));
        }
        let (generation, id) = parse_rev(rev)?;
        let inner = self.inner_body(generation, id)?;
        let path = self.path_to(rev)?;
        Some(std::borrow::Cow::Owned(Leaf { path, deleted: inner.deleted, body: inner.body.clone() }))
    }

    /// Every body the tree keeps: the leaves', then the inner revisions'.
    pub fn bodies(&self) -> impl Iterator<Item = &Map<String, Value>> + '_ {
        self.leaves.iter().map(|leaf| &leaf.body).chain(self.inner.iter().map(|inner| &inner.body))
    }

    /// The inner revisions' kept bodies, oldest first.
    pub fn inner_bodies(&self) -> &[InnerBody] {
        &self.inner
    }

    /// Compaction (`_compact`, `couch_bt_engine_compactor`): every inner revision's body goes;
    /// whether there was any.
    pub fn drop_inner_bodies(&mut self) -> bool {
        let had = !self.inner.is_empty();
        self.inner.clear();
        had
    }

    /// Drops the oldest inner bodies until at most `max_count` are kept and they hold at most
    /// `max_bytes` ([`InnerBody`]'s share of [`RevTree::held_bytes`]). Whether any went.
    pub fn limit_inner_bodies(&mut self, max_count: usize, max_bytes: usize) -> bool {
        let mut held = self.inner_held_bytes();
        let mut dropped = 0;
        while dropped < self.inner.len() && (self.inner.len() - dropped > max_count || held > max_bytes) {
            held = held.saturating_sub(self.inner[dropped].held_bytes());
            dropped += 1;
        }
        self.inner.drain(..dropped);
        dropped > 0
    }

    /// The inner bodies' share of [`RevTree::held_bytes`].
    pub fn inner_held_bytes(&self) -> usize {
        self.inner.iter().map(InnerBody::held_bytes).fold(0, usize::saturating_add)
    }

    /// The kept body of the inner revision `generation`-`id`.
    fn inner_body(&self, generation: u64, id: &str) -> Option<&InnerBody> {
        let at = self.inner.binary_search_by(|inner| inner_order(inner, generation, id)).ok()?;
        self.inner.get(at)
    }

    /// `_revs_diff` for one document: which of `revs` the tree lacks, and CouchDB's
    /// `possible_ancestors` for them (`couch_db:possible_ancestors/2`): the leaves, in the
    /// winner's order, whose generation is lower than the highest generation among the missing
    /// revs. As `couch_key_tree:find_missing/2` answers, the missing revs come sorted (generation,
    /// then id) when the document exists and as given when it does not; repeats are answered
    /// once. A rev that does not parse is missing (generation 0 for the sort).
    pub fn missing(&self, revs: &[String]) -> (Vec<String>, Vec<String>) {
        let mut seen = HashSet::new();
        let mut missing: Vec<&String> =
            revs.iter().filter(|rev| seen.insert(rev.as_str()) && !self.contains(rev)).collect();
        if self.leaves.is_empty() {
            return (missing.into_iter().cloned().collect(), Vec::new());
        }
        missing.sort_by(|a, b| {
            let ((a_generation, a_id), (b_generation, b_id)) = (missing_key(a), missing_key(b));
            a_generation.cmp(&b_generation).then_with(|| id_order(a_id, b_id))
        });
        let highest = missing.iter().map(|rev| missing_key(rev).0).max();
        let possible_ancestors = match highest {
            None => Vec::new(),
            Some(highest) => {
                self.leaves().into_iter().filter(|leaf| leaf.path.start < highest).map(Leaf::rev).collect()
            }
        };
        (missing.into_iter().cloned().collect(), possible_ancestors)
    }

    /// `_purge`: removes these leaves (only leaves; other revs are ignored, as in
    /// `couch_key_tree:remove_leafs/2`); returns the revs removed, in the order asked. Ancestors
    /// only the removed leaves had go with them.
    pub fn purge(&mut self, revs: &[String]) -> Vec<String> {
        let mut removed = Vec::new();
        for rev in revs {
            let Some((generation, id)) = parse_rev(rev) else {
                continue;
            };
            if let Some(index) = self.leaves.iter().position(|leaf| leaf.is(generation, id)) {
                self.leaves.remove(index);
                removed.push(rev.clone());
            }
        }
        self.normalise();
        removed
    }

    /// Cuts every path to at most `limit` ids (CouchDB's stemming, `_revs_limit`), as
    /// `couch_key_tree:stem/2` cuts the tree: a revision is kept while it is within `limit`
    /// revisions of some leaf, so a leaf's path still runs through ancestors another leaf keeps.
    /// A branch whose own ancestors all fall away keeps its leaf, on a root of its own. Leaves are
    /// never dropped: a limit of 0 is taken as 1 (CouchDB refuses a limit below 1).
    pub fn stem(&mut self, limit: usize) {
        let limit = limit.max(1);
        if self.leaves.iter().all(|leaf| leaf.path.ids.len() <= limit) {
            // Nothing to cut (the usual case): no need to collect the kept revisions.
            self.normalise();
            return;
        }
        let kept_lengths: Vec<usize> = {
            let kept: HashSet<(u64, &str)> =
                self.leaves.iter().flat_map(|leaf| leaf.path.generations().take(limit)).collect();
            self.leaves
                .iter()
                .map(|leaf| leaf.path.generations().take_while(|revision| kept.contains(revision)).count())
                .collect()
        };
        for (leaf, length) in self.leaves.iter_mut().zip(kept_lengths) {
            leaf.path.ids.truncate(length);
        }
        self.normalise();
    }

    /// About the bytes a read of the tree holds: every leaf's body as compact JSON and the
    /// revision ids of its whole path (a read expands each leaf's path, shared ancestors
    /// repeated), each id counted as its JSON text. What `couchdb_max_tree_bytes` bounds.
    pub fn held_bytes(&self) -> usize {
        let inner = self.inner_held_bytes();
        self.leaves
            .iter()
            .map(|leaf| {
                let ids: usize = leaf.path.ids.iter().map(|id| id.len() + 3).sum();
                crate::model::validate::json_size(&leaf.body).saturating_add(ids).saturating_add(LEAF_OVERHEAD_BYTES)
            })
            .fold(0, usize::saturating_add)
            .saturating_add(inner)
    }

    fn winner_index(&self) -> Option<usize> {
        (0..self.leaves.len()).min_by(|&a, &b| winner_order(&self.leaves[a], &self.leaves[b]))
    }

    /// Keeps the stored form canonical: malformed paths trimmed, leaves without a revision
    /// dropped, leaves in the winner's order (so equal trees serialise alike); inner bodies only
    /// of revisions still on a path that are not leaves (stemmed or purged ones go), once each,
    /// oldest first.
    fn normalise(&mut self) {
        for leaf in &mut self.leaves {
            leaf.path.drop_impossible_ids();
        }
        self.leaves.retain(|leaf| !leaf.path.ids.is_empty());
        self.leaves.sort_by(winner_order);
        if self.inner.is_empty() {
            return;
        }
        self.inner.sort_by(|a, b| inner_order(a, b.generation, &b.id));
        self.inner.dedup_by(|a, b| a.generation == b.generation && a.id == b.id);
        let leaves = &self.leaves;
        self.inner.retain(|inner| {
            let (generation, id) = (inner.generation, inner.id.as_str());
            let on_a_path = leaves.iter().any(|leaf| leaf.path.position(generation, id).is_some_and(|at| at > 0));
            on_a_path && !leaves.iter().any(|leaf| leaf.is(generation, id))
        });
    }
}

/// The order of kept inner bodies: by generation, then id as CouchDB orders them.
fn inner_order(inner: &InnerBody, generation: u64, id: &str) -> Ordering {
    inner.generation.cmp(&generation).then_with(|| id_order(&inner.id, id))
}

/// Where a rev `_revs_diff` asks for sorts: its generation and id, 0 and the text if it does not
/// parse.
fn missing_key(rev: &str) -> (u64, &str) {
    parse_rev(rev).unwrap_or((0, rev))
}

/// A leaf's data while the tree is rebuilt as nodes.
struct LeafValue {
    deleted: bool,
    body: Map<String, Value>,
}

/// One revision of a [`Forest`].
struct Node {
    id: String,
    generation: u64,
    parent: Option<usize>,
    /// In CouchDB's order of ids (`couch_key_tree` keeps siblings sorted).
    children: Vec<usize>,
    value: Option<LeafValue>,
}

/// The revision tree as nodes (an arena, so deep paths need no recursion), for CouchDB's merge.
/// Each root is a tree of the forest; stemming and merges of unrelated histories give several.
#[derive(Default)]
struct Forest {
    nodes: Vec<Node>,
    roots: Vec<usize>,
}

impl Forest {
    /// The forest the leaves describe: each leaf's path merged in turn, as CouchDB's
    /// `repair_tree` rebuilds a tree from its paths; then the kept inner bodies on their nodes.
    fn from_parts(leaves: Vec<Leaf>, inner: Vec<InnerBody>) -> Forest {
        let mut forest = Forest::default();
        for mut leaf in leaves {
            leaf.path.drop_impossible_ids();
            if !leaf.path.ids.is_empty() {
                forest.merge(leaf.path, LeafValue { deleted: leaf.deleted, body: leaf.body });
            }
        }
        if !inner.is_empty() {
            let mut nodes: std::collections::HashMap<(u64, &str), usize> = std::collections::HashMap::new();
            for (index, node) in forest.nodes.iter().enumerate() {
                nodes.entry((node.generation, node.id.as_str())).or_insert(index);
            }
            let placed: Vec<(usize, LeafValue)> = inner
                .into_iter()
                .filter_map(|inner| {
                    let node = *nodes.get(&(inner.generation, inner.id.as_str()))?;
                    Some((node, LeafValue { deleted: inner.deleted, body: inner.body }))
                })
                .collect();
            for (node, value) in placed {
                forest.nodes[node].value.get_or_insert(value);
            }
        }
        forest
    }

    /// `couch_key_tree:merge/2` of one path (ids newest first, at least one, none below
    /// generation 1): the first tree sharing a revision with it at the depth where both start
    /// takes it in; otherwise it becomes a tree of its own.
    fn merge(&mut self, path: RevPath, value: LeafValue) -> MergeOutcome {
        let was_empty = self.roots.is_empty();
        let count = u64::try_from(path.ids.len()).unwrap_or(u64::MAX);
        let oldest = path.start.saturating_sub(count).saturating_add(1);
        let mut ids = path.ids;
        ids.reverse();
        let mut value = Some(value);
        // The roots stay in CouchDB's order between merges (a new root is inserted in place, a
        // root that grows a new top is moved into place), so no merge sorts them all again.
        for slot in 0..self.roots.len() {
            let root = self.roots[slot];
            let root_generation = self.nodes[root].generation;
            if oldest <= root_generation {
                // The incoming path starts above this tree's root: they merge when the path holds
                // the root; the path's older revisions become the tree's new top.
                let Ok(skip) = usize::try_from(root_generation - oldest) else {
                    continue;
                };
                if ids.get(skip) != Some(&self.nodes[root].id) {
                    continue;
                }
                let outcome = self.extend(root, &ids[skip + 1..], &mut value);
                if skip > 0 {
                    let top = self.chain(None, oldest, &ids[..skip], None);
                    let bottom = self.last_of_chain(top);
                    self.nodes[bottom].children.push(root);
                    self.nodes[root].parent = Some(bottom);
                    self.roots.remove(slot);
                    self.insert_root(top);
                }
                return outcome;
            }
            if let Some(found) = self.find(root, oldest, &ids[0]) {
                return self.extend(found, &ids[1..], &mut value);
            }
        }
        let root = self.chain(None, oldest, &ids, value.take());
        self.insert_root(root);
        if was_empty {
            MergeOutcome::Extended
        } else {
            MergeOutcome::NewBranch
        }
    }

    /// `couch_key_tree`'s `merge_extend`: walks `rest` (oldest first) down from `node`, which
    /// holds the revision just before it.
    fn extend(&mut self, node: usize, rest: &[String], value: &mut Option<LeafValue>) -> MergeOutcome {
        let mut current = node;
        for (index, id) in rest.iter().enumerate() {
            let generation = self.nodes[current].generation.saturating_add(1);
            if self.nodes[current].children.is_empty() {
                let child = self.chain(Some(current), generation, &rest[index..], value.take());
                self.nodes[current].children.push(child);
                return MergeOutcome::Extended;
            }
            let same = self.nodes[current].children.iter().copied().find(|&child| self.nodes[child].id == *id);
            match same {
                Some(child) => current = child,
                None => {
                    let child = self.chain(Some(current), generation, &rest[index..], value.take());
                    let siblings = &self.nodes[current].children;
                    let at =
                        siblings.partition_point(|&sibling| id_order(&self.nodes[sibling].id, id) == Ordering::Less);
                    self.nodes[current].children.insert(at, child);
                    return MergeOutcome::NewBranch;
                }
            }
        }
        // The path ends on a revision the tree has; CouchDB keeps the value it had
        // (`value_pref`), so a known leaf keeps its body.
        if self.nodes[current].value.is_none() {
            self.nodes[current].value = value.take();
        }
        MergeOutcome::AlreadyKnown
    }

    /// The first node (in CouchDB's order) of the tree under `root` at `generation` with `id`.
    fn find(&self, root: usize, generation: u64, id: &str) -> Option<usize> {
        let mut stack = vec![root];
        while let Some(index) = stack.pop() {
            let node = &self.nodes[index];
            if node.generation >= generation {
                if node.generation == generation && node.id == id {
                    return Some(index);
                }
                continue;
            }
            // Pushed in reverse so that the first child is searched first.
            stack.extend(node.children.iter().rev());
        }
        None
    }

    /// New nodes for `ids` (oldest first, starting at `generation`) under `parent`, the last one
    /// holding `value`; returns the first.
    fn chain(&mut self, parent: Option<usize>, generation: u64, ids: &[String], value: Option<LeafValue>) -> usize {
        let first = self.nodes.len();
        let mut value = value;
        for (offset, id) in ids.iter().enumerate() {
            let index = self.nodes.len();
            let parent = if offset == 0 { parent } else { Some(index - 1) };
            let last = offset + 1 == ids.len();
            let offset = u64::try_from(offset).unwrap_or(u64::MAX);
            self.nodes.push(Node {
                id: id.clone(),
                generation: generation.saturating_add(offset),
                parent,
                children: if last { Vec::new() } else { vec![index + 1] },
                value: if last { value.take() } else { None },
            });
        }
        first
    }

    fn last_of_chain(&self, first: usize) -> usize {
        let mut node = first;
        while let Some(&child) = self.nodes[node].children.first() {
            node = child;
        }
        node
    }

    /// Adds a tree in its place in CouchDB's order of trees: by the root's generation, then its
    /// id.
    fn insert_root(&mut self, root: usize) {
        let nodes = &self.nodes;
        let order = |a: usize, b: usize| {
            nodes[a].generation.cmp(&nodes[b].generation).then_with(|| id_order(&nodes[a].id, &nodes[b].id))
        };
        let place = self.roots.partition_point(|&existing| order(existing, root) != Ordering::Greater);
        self.roots.insert(place, root);
    }

    /// Every leaf with its whole path back to its tree's root, and the bodies inner nodes keep
    /// (an extended leaf's, as CouchDB keeps the old leaf's value in its tree).
    fn into_parts(mut self) -> (Vec<Leaf>, Vec<InnerBody>) {
        let inner: Vec<InnerBody> = self
            .nodes
            .iter_mut()
            .filter(|node| !node.children.is_empty())
            .filter_map(|node| {
                let value = node.value.take()?;
                Some(InnerBody {
                    generation: node.generation,
                    id: node.id.clone(),
                    deleted: value.deleted,
                    body: value.body,
                })
            })
            .collect();
        let leaf_nodes: Vec<usize> =
            (0..self.nodes.len()).filter(|&node| self.nodes[node].children.is_empty()).collect();
        let mut leaves = Vec::with_capacity(leaf_nodes.len());
        for node in leaf_nodes {
            let mut ids = Vec::new();
            let mut current = Some(node);
            while let Some(index) = current {
                ids.push(self.nodes[index].id.clone());
                current = self.nodes[index].parent;
            }
            // A leaf always carries a value (merges end on one); an empty live body is the total
            // answer should one ever lack it.
            let value = self.nodes[node].value.take();
            let (deleted, body) = value.map_or((false, Map::new()), |value| (value.deleted, value.body));
            leaves.push(Leaf { path: RevPath { start: self.nodes[node].generation, ids }, deleted, body });
        }
        (leaves, inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const LIMIT: usize = 1000;

    fn body(n: i64) -> Map<String, Value> {
        let mut body = Map::new();
        body.insert("n".to_owned(), json!(n));
        body
    }

    fn path(start: u64, ids: &[&str]) -> RevPath {
        RevPath { start, ids: ids.iter().map(|id| (*id).to_owned()).collect() }
    }

    fn revs(leaves: Vec<&Leaf>) -> Vec<String> {
        leaves.into_iter().map(Leaf::rev).collect()
    }

    fn strings(revs: &[&str]) -> Vec<String> {
        revs.iter().map(|rev| (*rev).to_owned()).collect()
    }

    /// 1-a -> 2-b, then 2-c replicated beside 2-b: a conflict under 1-a.
    fn conflicted() -> RevTree {
        let mut tree = RevTree::default();
        tree.edit(None, "a", false, body(1), LIMIT).unwrap();
        tree.edit(Some("1-a"), "b", false, body(2), LIMIT).unwrap();
        assert_eq!(tree.merge(path(2, &["c", "a"]), false, body(3), LIMIT), MergeOutcome::NewBranch);
        tree
    }

    // couch_doc:parse_rev/1: `N-id` split at the first `-`; the id may hold further dashes. An id
    // of 32 bytes must be hexadecimal (couch_doc:parse_revid/2 decodes it). The brief's stricter
    // rule on N: positive, no leading zeros.
    #[test]
    fn revisions_parse_as_couchdb_reads_them() {
        assert_eq!(parse_rev("1-a"), Some((1, "a")));
        assert_eq!(parse_rev("12-x-y"), Some((12, "x-y")));
        assert_eq!(parse_rev("3-0123456789abcdef0123456789ABCDEF"), Some((3, "0123456789abcdef0123456789ABCDEF")));
        // `1-` is an empty id, which couch_doc:parse_rev accepts (PouchDB's test 7829).
        assert_eq!(parse_rev("1-"), Some((1, "")));
        for bad in ["", "1", "-a", "0-a", "01-a", "a-b", "+1-a", "1 -a", "3-0123456789abcdef0123456789abcdeg"] {
            assert_eq!(parse_rev(bad), None, "{bad:?}");
        }
        assert_eq!(parse_rev("99999999999999999999999-a"), None);
    }

    // couch_doc:transfer_fields/3 on `_revisions`: start an integer, ids an array of revision ids;
    // CouchDB's to_path/1 needs start >= length(ids) for generations to stay positive.
    #[test]
    fn revisions_objects_parse_and_render() {
        let parsed = RevPath::from_revisions(&json!({"start": 3, "ids": ["c", "b", "a"]})).unwrap();
        assert_eq!(parsed, path(3, &["c", "b", "a"]));
        assert_eq!(parsed.to_revisions(), json!({"start": 3, "ids": ["c", "b", "a"]}));
        assert_eq!(parsed.leaf_rev(), "3-c");
        assert_eq!(parsed.revs(), strings(&["3-c", "2-b", "1-a"]));
        assert_eq!(RevPath::from_revisions(&json!({"start": 5, "ids": ["e", "d"]})), Some(path(5, &["e", "d"])));
        for bad in [
            json!({"start": 1, "ids": ["b", "a"]}),
            json!({"start": 2, "ids": []}),
            json!({"start": 2, "ids": ["b", 1]}),
            json!({"start": "2", "ids": ["b"]}),
            json!({"start": 2.0, "ids": ["b"]}),
            json!({"start": -2, "ids": ["b"]}),
            json!({"ids": ["b"]}),
            json!({"start": 2}),
            json!(["b"]),
        ] {
            assert_eq!(RevPath::from_revisions(&bad), None, "{bad}");
        }
    }

    // couch_db:prep_and_validate_updates/6 on a missing document: revs {0, []} is accepted and
    // new_revs/3 makes it generation 1; any _rev is a conflict.
    #[test]
    fn the_first_edit_is_generation_one_and_a_parent_for_nothing_conflicts() {
        let mut tree = RevTree::default();
        assert!(tree.is_empty());
        assert_eq!(tree.edit(Some("1-a"), "b", false, body(1), LIMIT), Err(EditError::Conflict));
        assert_eq!(tree.edit(None, "a", false, body(1), LIMIT), Ok("1-a".to_owned()));
        let winner = tree.winner().unwrap();
        assert_eq!(winner.path, path(1, &["a"]));
        assert_eq!(winner.body, body(1));
        assert!(!winner.deleted && !tree.is_empty());
    }

    // couch_db:prep_and_validate_update/5: the _rev must be a leaf ({Start, PrevRev} in the
    // leaves' dict), else conflict; no _rev on a live document is a conflict.
    #[test]
    fn an_update_extends_its_leaf_and_a_stale_or_missing_parent_conflicts() {
        let mut tree = RevTree::default();
        tree.edit(None, "a", false, body(1), LIMIT).unwrap();
        assert_eq!(tree.edit(Some("1-a"), "b", false, body(2), LIMIT), Ok("2-b".to_owned()));
        assert_eq!(tree.leaves().len(), 1);
        assert_eq!(tree.winner().unwrap().path, path(2, &["b", "a"]));
        assert_eq!(tree.winner().unwrap().body, body(2));
        let before = tree.clone();
        assert_eq!(tree.edit(Some("1-a"), "c", false, body(3), LIMIT), Err(EditError::Conflict));
        assert_eq!(tree.edit(Some("2-x"), "c", false, body(3), LIMIT), Err(EditError::Conflict));
        assert_eq!(tree.edit(Some("not a rev"), "c", false, body(3), LIMIT), Err(EditError::Conflict));
        assert_eq!(tree.edit(None, "c", false, body(3), LIMIT), Err(EditError::Conflict));
        assert_eq!(tree, before);
    }

    // couch_db_updater:merge_rev_tree/4 for a deleted document: a new document without _rev
    // (depth 1, not deleted) is rebased on the deleted winner; recreate_doc_test.exs
    // (COUCHDB-292): a _rev of the tombstone, or any other, is a conflict.
    #[test]
    fn a_deleted_document_is_recreated_on_its_tombstone_and_only_without_a_parent() {
        let mut tree = RevTree::default();
        tree.edit(None, "a", false, body(1), LIMIT).unwrap();
        assert_eq!(tree.edit(Some("1-a"), "b", true, Map::new(), LIMIT), Ok("2-b".to_owned()));
        assert!(tree.is_deleted());
        assert!(tree.winner().unwrap().deleted);
        assert_eq!(tree.edit(Some("2-b"), "c", false, body(3), LIMIT), Err(EditError::Conflict));
        assert_eq!(tree.edit(Some("1-x"), "c", false, body(3), LIMIT), Err(EditError::Conflict));
        assert_eq!(tree.edit(None, "c", true, Map::new(), LIMIT), Err(EditError::Conflict));
        assert_eq!(tree.edit(None, "c", false, body(3), LIMIT), Ok("3-c".to_owned()));
        let winner = tree.winner().unwrap();
        assert_eq!(winner.path, path(3, &["c", "b", "a"]));
        assert!(!winner.deleted && !tree.is_deleted());
        assert_eq!(tree.leaves().len(), 1);
    }

    // couch_key_tree:get_full_key_paths/2 (used for `?rev=`, `revs=true` and find_missing/2): a
    // revision is found whether it is a leaf or an ancestor, with its path back to the root.
    #[test]
    fn leaves_and_ancestors_are_found_with_their_paths() {
        let tree = conflicted();
        assert!(tree.contains("1-a") && tree.contains("2-b") && tree.contains("2-c"));
        assert!(!tree.contains("3-c") && !tree.contains("1-b") && !tree.contains("a"));
        assert_eq!(tree.path_to("1-a"), Some(path(1, &["a"])));
        assert_eq!(tree.path_to("2-b"), Some(path(2, &["b", "a"])));
        assert_eq!(tree.path_to("2-z"), None);
        assert!(tree.leaf("1-a").is_none());
        assert_eq!(tree.leaf("2-b").unwrap().body, body(2));
    }

    // couch_key_tree:merge/2: a path ending on a revision the tree has is internal_node and the
    // existing value wins (value_pref/2); couch_db_updater ignores the merge for replication.
    #[test]
    fn merging_a_known_revision_changes_nothing() {
        let mut tree = conflicted();
        let before = tree.clone();
        assert_eq!(tree.merge(path(2, &["b", "a"]), true, body(9), LIMIT), MergeOutcome::AlreadyKnown);
        assert_eq!(tree.merge(path(1, &["a"]), false, body(9), LIMIT), MergeOutcome::AlreadyKnown);
        assert_eq!(tree, before);
    }

    // couch_key_tree merge_extend/2: a path running past a leaf extends it (new_leaf); the merged
    // tree still remembers the ancestors the incoming path did not carry.
    #[test]
    fn a_path_through_a_leaf_extends_it_keeping_older_ancestors() {
        let mut tree = RevTree::default();
        tree.edit(None, "a", false, body(1), LIMIT).unwrap();
        tree.edit(Some("1-a"), "b", false, body(2), LIMIT).unwrap();
        assert_eq!(tree.merge(path(4, &["d", "c", "b"]), false, body(4), LIMIT), MergeOutcome::Extended);
        assert_eq!(revs(tree.leaves()), strings(&["4-d"]));
        assert_eq!(tree.winner().unwrap().path, path(4, &["d", "c", "b", "a"]));
        assert_eq!(tree.winner().unwrap().body, body(4));
        assert!(tree.contains("3-c") && tree.contains("1-a"));
        assert!(tree.leaf("2-b").is_none());
    }

    // couch_key_tree merge_extend/2: a path leaving the tree at an internal node adds a branch
    // (new_branch) whose leaf's path runs up through the tree's remembered ancestors.
    #[test]
    fn a_path_sharing_an_ancestor_adds_a_branch() {
        let mut tree = RevTree::default();
        tree.edit(None, "a", false, body(1), LIMIT).unwrap();
        tree.edit(Some("1-a"), "b", false, body(2), LIMIT).unwrap();
        tree.edit(Some("2-b"), "c", false, body(3), LIMIT).unwrap();
        assert_eq!(tree.merge(path(3, &["x", "b"]), false, body(4), LIMIT), MergeOutcome::NewBranch);
        assert_eq!(tree.leaf("3-x").unwrap().path, path(3, &["x", "b", "a"]));
        assert_eq!(tree.leaf("3-c").unwrap().path, path(3, &["c", "b", "a"]));
        assert_eq!(tree.leaves().len(), 2);
    }

    // couch_key_tree:merge_tree/3: a path sharing no revision with any tree is kept as a tree of
    // its own (new_branch), a conflict; into an empty tree it is new_leaf.
    #[test]
    fn a_path_sharing_nothing_is_a_separate_root() {
        let mut tree = RevTree::default();
        assert_eq!(tree.merge(path(2, &["b", "a"]), false, body(1), LIMIT), MergeOutcome::Extended);
        assert_eq!(tree.merge(path(3, &["z", "y", "x"]), false, body(2), LIMIT), MergeOutcome::NewBranch);
        assert_eq!(revs(tree.leaves()), strings(&["3-z", "2-b"]));
        assert_eq!(tree.leaf("3-z").unwrap().path, path(3, &["z", "y", "x"]));
        assert_eq!(tree.conflicts(), strings(&["2-b"]));
        // A path starting below the root joins the tree holding its first revision.
        assert_eq!(tree.merge(path(4, &["w", "z"]), false, body(3), LIMIT), MergeOutcome::Extended);
        assert_eq!(tree.leaf("4-w").unwrap().path, path(4, &["w", "z", "y", "x"]));
    }

    // couch_key_tree merge_at/3 with the insert path starting higher (Pos > 0): it merges where
    // it meets the tree's root, and the tree's depth becomes the path's (min(Depth, IDepth)), so a
    // stemmed tree remembers the older ancestors again, even for a known revision.
    #[test]
    fn a_longer_history_is_grafted_above_a_stemmed_root() {
        let mut tree = RevTree::default();
        tree.merge(path(4, &["d", "c"]), false, body(4), LIMIT);
        assert_eq!(tree.merge(path(4, &["d", "c", "b", "a"]), false, body(9), LIMIT), MergeOutcome::AlreadyKnown);
        let winner = tree.winner().unwrap();
        assert_eq!(winner.path, path(4, &["d", "c", "b", "a"]));
        assert_eq!(winner.body, body(4));
        // A path meeting a stemmed root only below it shares no revision there: separate root.
        let mut stemmed = RevTree::default();
        stemmed.merge(path(4, &["d", "c"]), false, body(4), LIMIT);
        assert_eq!(stemmed.merge(path(2, &["b", "a"]), false, body(2), LIMIT), MergeOutcome::NewBranch);
        assert_eq!(revs(stemmed.leaves()), strings(&["4-d", "2-b"]));
    }

    // couch_db_updater:merge_rev_tree/4 (replicated): a deletion extending a live leaf is a
    // new_leaf like any other; the document is deleted when every leaf is (couch_doc:is_deleted/1).
    #[test]
    fn a_replicated_deletion_extends_a_live_leaf() {
        let mut tree = RevTree::default();
        tree.edit(None, "a", false, body(1), LIMIT).unwrap();
        assert_eq!(tree.merge(path(2, &["b", "a"]), true, Map::new(), LIMIT), MergeOutcome::Extended);
        assert!(tree.is_deleted());
        assert_eq!(revs(tree.leaves()), strings(&["2-b"]));
        assert!(tree.winner().unwrap().deleted);
    }

    // couch_doc:to_doc_info_path/1: leaves sorted descending by {not Deleted, {Pos, RevId}}: a
    // live leaf beats a deleted one of any generation, then the higher generation, then the
    // higher id compared as Erlang binaries.
    #[test]
    fn the_winner_is_live_then_deepest_then_highest_id() {
        let mut tree = RevTree::default();
        tree.merge(path(1, &["a"]), false, body(1), LIMIT);
        tree.merge(path(2, &["b", "a"]), false, body(2), LIMIT);
        tree.merge(path(2, &["c", "a"]), false, body(3), LIMIT);
        tree.merge(path(3, &["d", "c", "a"]), true, Map::new(), LIMIT);
        tree.merge(path(2, &["B", "a"]), false, body(4), LIMIT);
        // 2-c's only child is deleted, so 2-c is no longer a leaf; 2-b beats 2-B ('b' > 'B').
        assert_eq!(revs(tree.leaves()), strings(&["2-b", "2-B", "3-d"]));
        assert_eq!(tree.winner().unwrap().body, body(2));
        tree.merge(path(3, &["e", "b", "a"]), false, body(5), LIMIT);
        assert_eq!(tree.winner().unwrap().rev(), "3-e");
        assert_eq!(revs(tree.leaves()), strings(&["3-e", "2-B", "3-d"]));
    }

    // couch_doc:parse_revid/2 keeps a 32-hex id as its 16 decoded bytes, so against a short id it
    // compares by those bytes: 0x9f... sorts after "b" (0x62) although "9f..." < "b" as text.
    #[test]
    fn an_md5_id_is_compared_by_its_bytes() {
        let md5 = "9f000000000000000000000000000000";
        let mut tree = RevTree::default();
        tree.merge(path(1, &["a"]), false, body(1), LIMIT);
        tree.merge(path(2, &["b", "a"]), false, body(2), LIMIT);
        tree.merge(path(2, &[md5, "a"]), false, body(3), LIMIT);
        assert_eq!(tree.winner().unwrap().rev(), format!("2-{md5}"));
        let low = "10000000000000000000000000000000";
        let mut other = RevTree::default();
        other.merge(path(1, &["a"]), false, body(1), LIMIT);
        other.merge(path(2, &["b", "a"]), false, body(2), LIMIT);
        other.merge(path(2, &[low, "a"]), false, body(3), LIMIT);
        assert_eq!(other.winner().unwrap().rev(), "2-b");
        assert_eq!(id_order("ab000000000000000000000000000000", "AB000000000000000000000000000000"), Ordering::Equal);
    }

    // couch_db:doc_meta_info/3: _conflicts are the non-deleted leaves after the winner,
    // _deleted_conflicts the deleted ones, both in the doc_info order.
    #[test]
    fn conflicts_and_deleted_conflicts_list_the_losers() {
        let mut tree = conflicted();
        tree.merge(path(2, &["d", "a"]), false, body(4), LIMIT);
        tree.merge(path(3, &["x", "b", "a"]), true, Map::new(), LIMIT);
        tree.merge(path(2, &["e", "a"]), true, Map::new(), LIMIT);
        assert_eq!(revs(tree.leaves()), strings(&["2-d", "2-c", "3-x", "2-e"]));
        assert_eq!(tree.conflicts(), strings(&["2-c"]));
        assert_eq!(tree.deleted_conflicts(), strings(&["3-x", "2-e"]));
        let mut none = RevTree::default();
        none.edit(None, "a", false, body(1), LIMIT).unwrap();
        assert!(none.conflicts().is_empty() && none.deleted_conflicts().is_empty());
    }

    // CouchDB's conflict resolution (docs: "Replication and conflict model"): deleting the losing
    // leaf with its _rev extends it with a tombstone (new_leaf, the document stays live), and the
    // winner stays the winner.
    #[test]
    fn deleting_a_losing_leaf_resolves_the_conflict() {
        let mut tree = conflicted();
        assert_eq!(tree.winner().unwrap().rev(), "2-c");
        assert_eq!(tree.conflicts(), strings(&["2-b"]));
        assert_eq!(tree.edit(Some("2-b"), "z", true, Map::new(), LIMIT), Ok("3-z".to_owned()));
        assert_eq!(tree.winner().unwrap().rev(), "2-c");
        assert!(tree.conflicts().is_empty());
        assert_eq!(tree.deleted_conflicts(), strings(&["3-z"]));
        assert!(!tree.is_deleted());
        assert_eq!(tree.leaf("3-z").unwrap().path, path(3, &["z", "b", "a"]));
    }

    // couch_db:doc_meta_info/3 revs_info: the winner's path, each node `available`/`deleted` by
    // its leaf record, `missing` when its body is gone (compaction drops non-leaf bodies).
    #[test]
    fn revs_info_reports_the_winners_path() {
        let mut tree = conflicted();
        assert_eq!(
            tree.revs_info(),
            vec![("2-c".to_owned(), RevStatus::Available), ("1-a".to_owned(), RevStatus::Available)]
        );
        assert!(tree.drop_inner_bodies());
        assert_eq!(
            tree.revs_info(),
            vec![("2-c".to_owned(), RevStatus::Available), ("1-a".to_owned(), RevStatus::Missing)]
        );
        let mut deleted = RevTree::default();
        deleted.edit(None, "a", false, body(1), LIMIT).unwrap();
        deleted.edit(Some("1-a"), "b", true, Map::new(), LIMIT).unwrap();
        let info = deleted.revs_info();
        assert_eq!(info[0], ("2-b".to_owned(), RevStatus::Deleted));
        assert_eq!(info.iter().map(|(_, status)| status.as_str()).collect::<Vec<_>>(), ["deleted", "available"]);
        // A re-creation keeps the deletion it extends as a deleted inner revision.
        deleted.edit(None, "c", false, body(3), LIMIT).unwrap();
        let statuses: Vec<_> = deleted.revs_info().into_iter().map(|(_, status)| status.as_str()).collect();
        assert_eq!(statuses, ["available", "deleted", "available"]);
        assert!(RevTree::default().revs_info().is_empty());
    }

    // couch_db:get_missing_revs/2 with couch_key_tree:find_missing/2 (any node counts, leaf or
    // ancestor) and possible_ancestors/2 (leaves whose generation is below the highest missing
    // one); a document that does not exist misses every rev and has no possible ancestors.
    #[test]
    fn missing_revs_and_possible_ancestors() {
        let mut tree = conflicted();
        tree.edit(Some("2-c"), "d", false, body(4), LIMIT).unwrap();
        let asked = strings(&["4-q", "1-a", "2-b", "2-zz", "3-d", "4-q", "bad"]);
        let (missing, possible) = tree.missing(&asked);
        assert_eq!(missing, strings(&["bad", "2-zz", "4-q"]));
        assert_eq!(possible, strings(&["3-d", "2-b"]));
        let (missing, possible) = tree.missing(&strings(&["3-e", "2-y"]));
        assert_eq!(missing, strings(&["2-y", "3-e"]));
        assert_eq!(possible, strings(&["2-b"]));
        assert_eq!(tree.missing(&strings(&["1-a", "3-d"])), (Vec::new(), Vec::new()));
        let (missing, possible) = RevTree::default().missing(&strings(&["3-c", "1-a"]));
        assert_eq!((missing, possible), (strings(&["3-c", "1-a"]), Vec::new()));
    }

    // couch_key_tree:remove_leafs/2 (couch_db_updater:purge_docs/2): only leaves are removed,
    // other revs are ignored; the remaining leaves decide the winner; removing every leaf leaves
    // nothing (the document is gone).
    #[test]
    fn purging_the_winning_leaf_makes_another_the_winner() {
        let mut tree = conflicted();
        assert_eq!(tree.winner().unwrap().rev(), "2-c");
        assert_eq!(tree.purge(&strings(&["1-a", "9-z", "2-c", "2-c"])), strings(&["2-c"]));
        assert_eq!(tree.winner().unwrap().rev(), "2-b");
        assert_eq!(tree.winner().unwrap().body, body(2));
        assert!(!tree.contains("2-c") && tree.contains("1-a"));
        assert_eq!(tree.purge(&strings(&["2-b"])), strings(&["2-b"]));
        assert!(tree.is_empty() && !tree.contains("1-a"));
    }

    // couch_key_tree:stem/2: every path keeps at most `limit` revisions from its leaf.
    #[test]
    fn stemming_cuts_each_path_to_the_limit() {
        let mut tree = RevTree::default();
        tree.edit(None, "a", false, body(1), 3).unwrap();
        for (parent, id) in [("1-a", "b"), ("2-b", "c"), ("3-c", "d"), ("4-d", "e")] {
            tree.edit(Some(parent), id, false, body(1), 3).unwrap();
        }
        assert_eq!(tree.winner().unwrap().path, path(5, &["e", "d", "c"]));
        assert!(!tree.contains("2-b"));
        tree.stem(1);
        assert_eq!(tree.winner().unwrap().path, path(5, &["e"]));
        tree.stem(0);
        assert_eq!(tree.winner().unwrap().path, path(5, &["e"]));
        // A replicated path is stemmed after the merge too.
        let mut replicated = RevTree::default();
        replicated.merge(path(4, &["d", "c", "b", "a"]), false, body(1), 2);
        assert_eq!(replicated.winner().unwrap().path, path(4, &["d", "c"]));
    }

    // couch_key_tree stem_tree/4: a revision stays while it is within `limit` of some leaf, so
    // a short branch keeps the shared ancestors a long branch would lose, and the long branch's
    // path still runs through them; a branch whose own ancestors all fall away keeps its leaf on
    // a root of its own (its LimitPos reaches 0: its children become new trees).
    #[test]
    fn stemming_keeps_shared_ancestors_and_every_leaf() {
        let mut tree = RevTree::default();
        tree.merge(path(3, &["c", "b", "a"]), false, body(1), LIMIT);
        tree.merge(path(6, &["f", "e", "d", "c", "b", "a"]), false, body(2), LIMIT);
        tree.merge(path(4, &["x", "c", "b", "a"]), false, body(3), LIMIT);
        tree.stem(3);
        // 4-x keeps 3-c and 2-b, 6-f keeps 5-e and 4-d, and 6-f's path runs on through 3-c, 2-b.
        assert_eq!(tree.leaf("4-x").unwrap().path, path(4, &["x", "c", "b"]));
        assert_eq!(tree.leaf("6-f").unwrap().path, path(6, &["f", "e", "d", "c", "b"]));
        assert!(!tree.contains("1-a"));
        tree.stem(2);
        assert_eq!(tree.leaf("4-x").unwrap().path, path(4, &["x", "c"]));
        assert_eq!(tree.leaf("6-f").unwrap().path, path(6, &["f", "e"]));
        assert_eq!(tree.leaves().len(), 2);
        // A branch of one revision off an ancestor that falls away stays as its own root.
        let mut branch = RevTree::default();
        branch.merge(path(5, &["e", "d", "c", "b", "a"]), false, body(1), LIMIT);
        branch.merge(path(2, &["y", "a"]), false, body(2), LIMIT);
        branch.stem(1);
        assert_eq!(revs(branch.leaves()), strings(&["5-e", "2-y"]));
        assert_eq!(branch.leaf("2-y").unwrap().path, path(2, &["y"]));
        assert_eq!(branch.conflicts(), strings(&["2-y"]));
    }

    // The tree is stored per document: a compact serde form (short names, no `false`, no empty
    // body, each revision once) that reads back equal; the previous release's form (each leaf
    // with its whole path) reads as the same tree.
    #[test]
    fn the_tree_round_trips_through_its_compact_serde_form() {
        let mut tree = conflicted();
        tree.edit(Some("2-b"), "z", true, Map::new(), LIMIT).unwrap();
        let text = serde_json::to_string(&tree).unwrap();
        assert_eq!(
            text,
            r#"{"r":[{"i":"a","g":1},{"i":"c","p":0},{"i":"b","p":0},{"i":"z","p":2}],"l":[{"r":1,"b":{"n":3}},{"r":3,"d":true}],"n":[{"r":0,"b":{"n":1}},{"r":2,"b":{"n":2}}]}"#
        );
        let back: RevTree = serde_json::from_str(&text).unwrap();
        assert_eq!(back, tree);
        // The previous release kept no inner bodies.
        tree.drop_inner_bodies();
        let previous = r#"{"l":[{"p":{"s":2,"i":["c","a"]},"b":{"n":3}},{"p":{"s":3,"i":["z","b","a"]},"d":true}]}"#;
        assert_eq!(serde_json::from_str::<RevTree>(previous).unwrap(), tree);
        assert_eq!(serde_json::to_string(&RevTree::default()).unwrap(), "{}");
        assert_eq!(serde_json::from_str::<RevTree>("{}").unwrap(), RevTree::default());
        for corrupt in
            [r#"{"r":[{"i":"a","p":0}],"l":[{"r":0}]}"#, r#"{"r":[{"i":"a","g":1}],"l":[{"r":1}]}"#, r#"{"l":[{}]}"#]
        {
            assert!(serde_json::from_str::<RevTree>(corrupt).is_err(), "{corrupt}");
        }
    }

    // CouchDB keeps a revision's body when it stops being a leaf (an edit, or a replicated path
    // extending it) until compaction; the ancestors a replicated path brings have none; stemming
    // and purge drop the bodies of the revisions they forget.
    #[test]
    fn inner_bodies_are_kept_until_dropped() {
        let mut tree = RevTree::default();
        tree.edit(None, "a", false, body(1), LIMIT).unwrap();
        tree.edit(Some("1-a"), "b", false, body(2), LIMIT).unwrap();
        tree.edit(Some("2-b"), "c", true, Map::new(), LIMIT).unwrap();
        assert_eq!(tree.revision("1-a").unwrap().body, body(1));
        let second = tree.revision("2-b").unwrap();
        assert_eq!((second.path.clone(), second.deleted, second.body.clone()), (path(2, &["b", "a"]), false, body(2)));
        assert!(tree.revision("3-c").unwrap().deleted);
        assert_eq!(tree.merge(path(5, &["e", "d", "c", "b", "a"]), false, body(5), LIMIT), MergeOutcome::Extended);
        assert!(tree.revision("3-c").is_some_and(|kept| kept.deleted), "the extended leaf keeps its value");
        assert!(tree.revision("4-d").is_none(), "a replicated ancestor has no body");
        assert_eq!(revs(tree.leaves()), strings(&["5-e"]));
        let through_merge: RevTree = serde_json::from_str(&serde_json::to_string(&tree).unwrap()).unwrap();
        assert_eq!(through_merge, tree);
        tree.stem(4);
        assert!(tree.revision("1-a").is_none() && tree.revision("2-b").is_some());
        assert_eq!(tree.inner_bodies().len(), 2);
        assert!(tree.drop_inner_bodies());
        assert!(tree.revision("2-b").is_none() && !tree.drop_inner_bodies());
        let mut purged = conflicted();
        purged.purge(&strings(&["2-b", "2-c"]));
        assert!(purged.is_empty() && purged.inner_bodies().is_empty());
    }

    // The engine's bounds on kept inner bodies drop the oldest first; they count in held_bytes.
    #[test]
    fn limiting_inner_bodies_drops_the_oldest() {
        let mut tree = RevTree::default();
        tree.edit(None, "a", false, body(1), LIMIT).unwrap();
        for (parent, id) in [("1-a", "b"), ("2-b", "c"), ("3-c", "d")] {
            tree.edit(Some(parent), id, false, body(1), LIMIT).unwrap();
        }
        let with_three = tree.held_bytes();
        assert_eq!(tree.inner_bodies().len(), 3);
        assert!(!tree.limit_inner_bodies(3, usize::MAX));
        assert!(tree.limit_inner_bodies(2, usize::MAX));
        assert!(tree.revision("1-a").is_none() && tree.revision("2-b").is_some());
        assert!(tree.held_bytes() < with_three);
        let one = tree.inner_bodies()[1].held_bytes();
        assert!(tree.limit_inner_bodies(usize::MAX, one));
        assert_eq!(tree.inner_bodies().iter().map(|kept| kept.generation).collect::<Vec<_>>(), [3]);
        assert!(tree.limit_inner_bodies(0, usize::MAX) && tree.inner_bodies().is_empty());
    }

    // Issue 34: a comb (a long history and a branch off each of its revisions) stores each
    // revision once, so its stored size follows the revisions sent, not branches × depth.
    #[test]
    fn a_comb_of_branches_stores_each_revision_once() {
        let depth = 300;
        let spine: Vec<String> = (1..=depth).rev().map(|n| format!("{n:032x}")).collect();
        let mut tree = RevTree::default();
        tree.merge(RevPath { start: depth, ids: spine.clone() }, false, Map::new(), LIMIT);
        for (index, parent) in spine.iter().enumerate().skip(1) {
            let generation = depth - u64::try_from(index).unwrap();
            let branch = RevPath { start: generation + 1, ids: vec![format!("b{index}"), parent.clone()] };
            tree.merge(branch, false, Map::new(), LIMIT);
        }
        assert_eq!(tree.leaves().len(), 300);
        let stored = serde_json::to_string(&tree).unwrap();
        // About 50 bytes a revision (600 of them); whole paths would be about 1.6 MB.
        assert!(stored.len() < 600 * 60, "{} bytes stored", stored.len());
        assert_eq!(serde_json::from_str::<RevTree>(&stored).unwrap(), tree);
    }

    // Every function is total: a stored tree with malformed paths (no ids, more ids than
    // generations) and odd input give answers, not panics.
    #[test]
    fn malformed_trees_and_input_do_not_panic() {
        let stored = r#"{"l":[{"p":{"s":0,"i":[]}},{"p":{"s":2,"i":["b","a","extra"]}},{"p":{"s":1,"i":[]}}]}"#;
        let mut tree: RevTree = serde_json::from_str(stored).unwrap();
        assert!(tree.winner().is_some());
        assert_eq!(tree.path_to("2-b"), Some(path(2, &["b", "a"])));
        let _ = (tree.leaves(), tree.conflicts(), tree.deleted_conflicts(), tree.revs_info());
        let _ = tree.missing(&strings(&["", "-", "0-0"]));
        assert_eq!(tree.merge(path(0, &["x"]), false, Map::new(), LIMIT), MergeOutcome::AlreadyKnown);
        assert_eq!(tree.merge(path(1, &[]), false, Map::new(), LIMIT), MergeOutcome::AlreadyKnown);
        assert_eq!(tree.merge(path(1, &["q", "r"]), false, Map::new(), LIMIT), MergeOutcome::NewBranch);
        assert_eq!(tree.leaf("1-q").unwrap().path, path(1, &["q"]));
        tree.stem(1);
        assert_eq!(revs(tree.leaves()), strings(&["2-b", "1-q"]));
        let mut huge = RevTree::default();
        huge.merge(path(u64::MAX, &["z"]), false, Map::new(), LIMIT);
        assert_eq!(
            huge.edit(Some(&format!("{}-z", u64::MAX)), "y", false, Map::new(), LIMIT),
            Err(EditError::Conflict)
        );
    }

    // Deep histories are handled without recursion (the forest is an arena).
    #[test]
    fn a_long_history_merges() {
        let ids: Vec<String> = (0..20_000).map(|n| format!("r{n}")).collect();
        let mut tree = RevTree::default();
        let outcome = tree.merge(RevPath { start: 20_000, ids: ids.clone() }, false, body(1), usize::MAX);
        assert_eq!(outcome, MergeOutcome::Extended);
        let mut longer = vec!["top".to_owned()];
        longer.extend(ids);
        let outcome = tree.merge(RevPath { start: 20_001, ids: longer }, false, body(2), usize::MAX);
        assert_eq!(outcome, MergeOutcome::Extended);
        assert_eq!(tree.winner().unwrap().path.ids.len(), 20_001);
        assert_eq!(tree.revs_info().len(), 20_001);
    }
}
