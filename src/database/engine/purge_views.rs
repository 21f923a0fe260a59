//! A purge against the view indexes kept from the database's feed. A purge of a document's last
//! leaf erases its feed entry, so no index update would ever remove its rows: the purge ends the
//! database's view incarnation ([`Database::views_incarnation_doc`]) and every index built under the old
//! one is dropped at its next use (docs/views.md, "Purges").
//!
//! The purge is recorded there before its erasure, where every process reads it: the first step
//! replaces the incarnation with a new one that names the documents being purged (`purging`);
//! the last step, after the erasure, replaces it again without the document (or ends it when no
//! other purge is named). An index built in between is built under the marked incarnation, and
//! the erasure may come after it read the document; if the process stops before its last step,
//! the next process that opens an index over the database finds the mark, sees the named document
//! gone, and ends the incarnation itself ([`Database::kept_views_incarnation`]). A named document
//! that still exists is a purge under way or one stopped before its erasure: its rows are right.
//! docs/design/crash-points.md, "Views", has every step.

use serde_json::{Map, Value};

use super::{Database, MAX_TRIES};
use crate::backend::revision::random_token;
use crate::backend::{Precondition, StoredDocument};
use crate::error::{Error, ErrorKind, Result};

/// The field of the incarnation's local document naming the documents whose purge is recorded
/// and not finished.
const PURGING_FIELD: &str = "purging";
/// The most purges one incarnation names at once (purges under way together, and purges
/// stopped before their erasure whose documents still exist); past it the oldest are no longer
/// named, and a crash of theirs between erasure and last step would keep rows until the next
/// purge ends the incarnation.
pub const MAX_PURGES_NAMED: usize = 256;

/// The documents the kept incarnation names as being purged.
fn purging(kept: Option<&StoredDocument>) -> Vec<String> {
    let named = kept.and_then(|doc| doc.body.get(PURGING_FIELD)).and_then(Value::as_array);
    named.into_iter().flatten().filter_map(Value::as_str).map(str::to_owned).collect()
}

impl Database {
    /// The first step of a purge of `id`'s last leaf: the incarnation ended, replaced by one
    /// naming `id` among the documents being purged.
    pub(super) async fn begin_purge_for_views(&self, id: &str) -> Result<()> {
        self.replace_views_incarnation(|named| {
            named.retain(|other| other != id);
            named.push(id.to_owned());
            let excess = named.len().saturating_sub(MAX_PURGES_NAMED);
            named.drain(..excess);
        })
        .await
    }

    /// The last step of a purge of `id`'s last leaf, after the erasure: the incarnation ended
    /// again (an index built since the first step may hold the document's rows), no longer naming
    /// `id`.
    pub(super) async fn end_purge_for_views(&self, id: &str) -> Result<()> {
        self.replace_views_incarnation(|named| named.retain(|other| other != id)).await
    }

    /// The database's view incarnation as it is kept now, read at every call (never remembered:
    /// a purge or `purge_user` in another process ends it, and the next index use must see that).
    /// A purge named by the kept incarnation whose document is gone was stopped between its
    /// erasure and its last step; the incarnation is ended for it here first. One read of the
    /// incarnation's local document, and one document per purge named, only when one is. `None`
    /// when no incarnation is kept (the caller makes one) or one was just ended.
    pub async fn kept_views_incarnation(&self) -> Result<Option<String>> {
        let kept = self.while_open(self.backend.get_local(self.views_incarnation_doc())).await?;
        let mut gone = Vec::new();
        for id in purging(kept.as_ref()) {
            if self.read(&id).await?.is_none() {
                gone.push(id);
            }
        }
        if gone.is_empty() {
            return Ok(kept.and_then(|doc| doc.body.get("id").and_then(Value::as_str).map(str::to_owned)));
        }
        self.replace_views_incarnation(|named| named.retain(|id| !gone.contains(id))).await?;
        Ok(None)
    }

    /// Ends the kept incarnation, against other writers of it: replaced by a new one naming the
    /// purges `change` leaves named, or deleted when it leaves none (the next index makes one).
    async fn replace_views_incarnation(&self, change: impl Fn(&mut Vec<String>)) -> Result<()> {
        for _ in 0..MAX_TRIES {
            let kept = self.backend.get_local(self.views_incarnation_doc()).await?;
            let mut named = purging(kept.as_ref());
            change(&mut named);
            let written = match (&kept, named.is_empty()) {
                (None, true) => Ok(()),
                (Some(kept), true) => self.backend.delete_local(self.views_incarnation_doc(), &kept.rev).await,
                (kept, false) => {
                    let precondition = match kept {
                        Some(kept) => Precondition::MatchRevision(kept.rev.clone()),
                        None => Precondition::MustNotExist,
                    };
                    let mut body = Map::new();
                    body.insert("id".into(), Value::from(hex::encode(random_token()?)));
                    body.insert(PURGING_FIELD.into(), Value::from(named));
                    self.backend.put_local(self.views_incarnation_doc(), &body, precondition).await.map(drop)
                }
            };
            match written {
                Ok(()) => return Ok(()),
                // Replaced meanwhile: end that one.
                Err(err) if matches!(err.kind(), ErrorKind::Conflict | ErrorKind::NotFound) => continue,
                Err(err) => return Err(err),
            }
        }
        Err(Error::conflict("the database's view incarnation kept changing under this purge; try again"))
    }
}
