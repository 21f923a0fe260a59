//! The stored form of a revision tree's leaves: each revision written once, whatever the number
//! of leaves whose paths pass through it, so a stored tree grows with the revisions it holds, not
//! with leaves × path length (issue 34: a comb of a thousand branches off a thousand-revision
//! history stored each branch's whole path, a million ids).
//!
//! ```text
//! {"r": [{"i": "a", "g": 1}, {"i": "b", "p": 0}, {"i": "c", "p": 0}],
//!  "l": [{"r": 1, "b": {...}}, {"r": 2, "d": true}]}
//! ```
//!
//! `r` lists the revisions, each after its parent: `i` its id, `p` its parent's index, or, on a
//! revision whose parent is not remembered, `g` its generation. Each leaf names its revision
//! (`r`) and carries its deletion flag and body as before. A leaf is read back with exactly the
//! path it was written with. `n`, when present, lists the kept bodies of inner revisions (revisions
//! that are no longer leaves, kept until compaction), each naming its revision as a leaf does;
//! a release that does not know `n` reads the tree without them. The previous release wrote every leaf with its whole path
//! (`{"p": {"s": N, "i": [...]}}` in place of `r`); such records are still read, and are written
//! in this form by their next write.

use std::collections::HashMap;

use serde::ser::SerializeStruct;
use serde::{Deserialize, Serialize, Serializer};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::{is_false, InnerBody, Leaf, RevPath};

/// One revision as stored, borrowed from the leaves being written.
#[derive(Serialize)]
struct RevisionOut<'a> {
    #[serde(rename = "i")]
    id: &'a str,
    #[serde(rename = "p", skip_serializing_if = "Option::is_none")]
    parent: Option<usize>,
    #[serde(rename = "g", skip_serializing_if = "Option::is_none")]
    generation: Option<u64>,
}

/// One leaf as stored, borrowed.
#[derive(Serialize)]
struct LeafOut<'a> {
    #[serde(rename = "r")]
    revision: usize,
    #[serde(rename = "d", skip_serializing_if = "is_false")]
    deleted: bool,
    #[serde(rename = "b", skip_serializing_if = "Map::is_empty")]
    body: &'a Map<String, Value>,
}

/// Leaves serialised in the stored form (the data-store database's side leaves).
pub struct StoredLeaves<'a>(pub &'a [Leaf]);

impl Serialize for StoredLeaves<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        StoredRevisions { leaves: self.0, inner: &[] }.serialize(serializer)
    }
}

/// A tree's leaves and kept inner bodies serialised in the stored form.
pub(super) struct StoredRevisions<'a> {
    pub leaves: &'a [Leaf],
    pub inner: &'a [InnerBody],
}

impl Serialize for StoredRevisions<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let (revisions, leaves, inner) = shared_revisions(self.leaves, self.inner);
        let fields =
            usize::from(!revisions.is_empty()) + usize::from(!leaves.is_empty()) + usize::from(!inner.is_empty());
        let mut out = serializer.serialize_struct("RevTree", fields)?;
        if !revisions.is_empty() {
            out.serialize_field("r", &revisions)?;
        }
        if !leaves.is_empty() {
            out.serialize_field("l", &leaves)?;
        }
        if !inner.is_empty() {
            out.serialize_field("n", &inner)?;
        }
        out.end()
    }
}

/// Every leaf's path walked from its oldest revision, each revision kept once: a revision is
/// the same one when its parent (or, with none, its generation) and its id are. Each kept inner
/// body names the first revision of its generation and id (inner bodies not on a path are left
/// out).
type Shared<'a> = (Vec<RevisionOut<'a>>, Vec<LeafOut<'a>>, Vec<LeafOut<'a>>);

fn shared_revisions<'a>(leaves: &'a [Leaf], inner: &'a [InnerBody]) -> Shared<'a> {
    let mut revisions: Vec<RevisionOut<'_>> = Vec::new();
    let mut known: HashMap<(Option<usize>, u64, &str), usize> = HashMap::new();
    let mut by_revision: HashMap<(u64, &str), usize> = HashMap::new();
    let mut out = Vec::with_capacity(leaves.len());
    for leaf in leaves {
        let path = &leaf.path;
        let count = u64::try_from(path.ids.len()).unwrap_or(u64::MAX);
        let oldest = path.start.saturating_sub(count).saturating_add(1);
        let mut parent: Option<usize> = None;
        for (offset, id) in path.ids.iter().rev().enumerate() {
            let generation = oldest.saturating_add(u64::try_from(offset).unwrap_or(u64::MAX));
            // Roots are told apart by generation; below a parent the generation follows from it.
            let key = (parent, if parent.is_none() { generation } else { 0 }, id.as_str());
            let index = *known.entry(key).or_insert_with(|| {
                revisions.push(RevisionOut {
                    id: id.as_str(),
                    parent,
                    generation: parent.is_none().then_some(generation),
                });
                revisions.len() - 1
            });
            if !inner.is_empty() {
                by_revision.entry((generation, id.as_str())).or_insert(index);
            }
            parent = Some(index);
        }
        // A path without ids (malformed; normalising drops it) has no revision to name.
        if let Some(revision) = parent {
            out.push(LeafOut { revision, deleted: leaf.deleted, body: &leaf.body });
        }
    }
    let inner_out = inner
        .iter()
        .filter_map(|kept| {
            let revision = *by_revision.get(&(kept.generation, kept.id.as_str()))?;
            Some(LeafOut { revision, deleted: kept.deleted, body: &kept.body })
        })
        .collect();
    (revisions, out, inner_out)
}

/// One revision as read.
#[derive(Deserialize)]
struct RevisionIn {
    #[serde(rename = "i")]
    id: String,
    #[serde(rename = "p", default)]
    parent: Option<usize>,
    #[serde(rename = "g", default)]
    generation: Option<u64>,
}

/// What a stored leaf's body is read as: the body, or nothing (skipped unparsed, for a reader
/// that shows revisions only: [`super::RevTreeOutline`]).
pub trait StoredBody: Default {
    fn into_body(self) -> Map<String, Value>;
}

impl StoredBody for Map<String, Value> {
    fn into_body(self) -> Map<String, Value> {
        self
    }
}

impl StoredBody for serde::de::IgnoredAny {
    fn into_body(self) -> Map<String, Value> {
        Map::new()
    }
}

/// One leaf as read: naming its revision, or (written by the previous release) with its path.
#[derive(Deserialize)]
struct LeafIn<B> {
    #[serde(rename = "r", default)]
    revision: Option<usize>,
    #[serde(rename = "p", default)]
    path: Option<RevPath>,
    #[serde(rename = "d", default)]
    deleted: bool,
    #[serde(rename = "b", default)]
    body: B,
}

/// A tree's or side document's leaves as read, either form; the bodies as `B` reads them.
#[derive(Deserialize)]
pub struct StoredTree<B = Map<String, Value>> {
    #[serde(rename = "r", default)]
    revisions: Vec<RevisionIn>,
    #[serde(rename = "l", default)]
    leaves: Vec<LeafIn<B>>,
    #[serde(rename = "n", default)]
    inner: Vec<LeafIn<B>>,
}

impl<B: StoredBody> StoredTree<B> {
    /// The leaves, each with its whole path; an error names what is inconsistent (a parent not
    /// before its child, a leaf naming no revision).
    pub fn into_leaves(self) -> Result<Vec<Leaf>, String> {
        let leaves = self.into_leaves_and_bodies()?;
        Ok(leaves.into_iter().map(|(leaf, body)| Leaf { body: body.into_body(), ..leaf }).collect())
    }

    /// The leaves ([`StoredTree::into_leaves`]) and the kept inner bodies.
    pub(super) fn into_parts(mut self) -> Result<(Vec<Leaf>, Vec<InnerBody>), String> {
        let stored_inner = std::mem::take(&mut self.inner);
        let mut inner = Vec::with_capacity(stored_inner.len());
        if !stored_inner.is_empty() {
            let generations = generations(&self.revisions)?;
            for kept in stored_inner {
                let revision = kept.revision.ok_or_else(|| "an inner body names no revision".to_owned())?;
                let (Some(generation), Some(stored)) = (generations.get(revision), self.revisions.get(revision)) else {
                    return Err(format!("an inner body names revision {revision}, not stored"));
                };
                inner.push(InnerBody {
                    generation: *generation,
                    id: stored.id.clone(),
                    deleted: kept.deleted,
                    body: kept.body.into_body(),
                });
            }
        }
        Ok((self.into_leaves()?, inner))
    }
}

impl<B> StoredTree<B> {
    /// The leaves, each with its whole path and an empty body, beside each one's body as `B`
    /// read it, in stored order.
    pub(super) fn into_leaves_and_bodies(self) -> Result<Vec<(Leaf, B)>, String> {
        let generations = generations(&self.revisions)?;
        let mut leaves = Vec::with_capacity(self.leaves.len());
        for leaf in self.leaves {
            let path = match (leaf.revision, leaf.path) {
                (Some(revision), _) => path_of(&self.revisions, &generations, revision)?,
                (None, Some(path)) => path,
                (None, None) => return Err("a leaf names no revision".to_owned()),
            };
            leaves.push((Leaf { path, deleted: leaf.deleted, body: Map::new() }, leaf.body));
        }
        Ok(leaves)
    }
}

/// A stored body kept as its JSON text, unparsed ([`super::WinnerText`]): `None` when the leaf
/// has none stored (an empty body, or a deletion).
#[derive(Default)]
pub struct RawBody(pub Option<Box<RawValue>>);

impl<'de> Deserialize<'de> for RawBody {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Box::<RawValue>::deserialize(deserializer).map(|text| RawBody(Some(text)))
    }
}

/// Each revision's generation: a root's is stored, a child's is its parent's plus one.
fn generations(revisions: &[RevisionIn]) -> Result<Vec<u64>, String> {
    let mut generations: Vec<u64> = Vec::with_capacity(revisions.len());
    for (index, revision) in revisions.iter().enumerate() {
        let generation = match (revision.parent, revision.generation) {
            (Some(parent), _) if parent < index => generations[parent].saturating_add(1),
            (Some(parent), _) => return Err(format!("revision {index} names a later parent, {parent}")),
            (None, Some(generation)) => generation,
            (None, None) => return Err(format!("revision {index} has neither a parent nor a generation")),
        };
        generations.push(generation);
    }
    Ok(generations)
}

/// The path from `revision` back to its root, newest first.
fn path_of(revisions: &[RevisionIn], generations: &[u64], revision: usize) -> Result<RevPath, String> {
    let start = *generations.get(revision).ok_or_else(|| format!("a leaf names revision {revision}, not stored"))?;
    let mut ids = Vec::new();
    let mut current = Some(revision);
    // Parents come before their children (checked by `generations`), so this walk ends.
    while let Some(index) = current {
        ids.push(revisions[index].id.clone());
        current = revisions[index].parent;
    }
    Ok(RevPath { start, ids })
}
