//! Tree layouts: how a document's revision tree is laid out over a backend's records, behind
//! one interface ([`TreeLayout`]), and the one crash-repair rule the engine applies over every
//! layout ([`must_save`], [`read_repairing`]).
//!
//! "Layout" because that is all that differs between the databases here: CouchDB's rules on the
//! tree (`crate::backend::rev_tree`) and the engine's write cycle are the same; where the leaves
//! of the tree are kept, and in how many backend writes a save is made, is the layout's.
//!
//! - [`record`]: the engine's layout, every database but the data-store one: the whole tree in
//!   the document's record, a deleted document's tree in the local document `tree:{id}`.
//! - [`data_store`]: the data-store database's layout: the record is the seed's document
//!   holding the winning revision (what the REST API and the facade read), the other leaves in
//!   the local document `:leaves:{id}`.
//!
//! ## The crash-repair rule
//! A save that writes two places writes the side place first (the local document: the engine's
//! `tree:{id}`, the data store's `:leaves:{id}`), in a form that says the save is not finished,
//! and the record last: the record is what the change feed, `_all_docs` and the REST API read.
//! A state read that shows an unfinished save ([`TreeLayout::unfinished`]: the data-store
//! layout's mark, the engine layout's side tree without the record after it) is finished by the
//! engine by saving the tree read over itself, which each layout makes do the steps the crash
//! cut:
//! - on the document's next write, even one that changes nothing (a replicated revision the
//!   tree already holds): [`must_save`];
//! - on the next read that loads the side place where a replicator decides what to send
//!   ([`read_repairing`], [`read_many_repairing`]: the data-store layout's tree reads; the
//!   record layout's `_revs_diff`, `_missing_revs`, `_bulk_get` and `open_revs`), so that a
//!   replicator's `_revs_diff` of the leaf it sent before the crash, which finds it, repairs the
//!   document instead of leaving it out of the feed for good. Such a read answers even when the
//!   repair fails ([`finished`]).
//!
//! docs/design/crash-points.md lists each layout's multi-step writes, the crash point after
//! each step and this repair.

pub mod data_store;
pub mod record;
use async_trait::async_trait;
use futures::future::BoxFuture;

use crate::backend::rev_tree::RevTree;
use crate::error::{ErrorKind, Result};

/// A document's tree as a layout read it, with what the next save must match (`token`, opaque
/// to the engine: the revisions of the places the layout read).
#[derive(Debug, Clone)]
pub struct LaidOut<T> {
    pub tree: RevTree,
    pub token: T,
}

impl<T> LaidOut<T> {
    /// Whether the winning leaf is deleted (or there is none).
    pub fn deleted(&self) -> bool {
        self.tree.winner().is_none_or(|leaf| leaf.deleted)
    }

    /// The winning revision.
    pub fn winner_rev(&self) -> Option<String> {
        self.tree.winner().map(|leaf| leaf.path.leaf_rev())
    }
}

/// One document's state as a layout read it, `None` when nothing is stored for the id.
pub type MaybeLaidOut<T> = Option<LaidOut<T>>;

/// What a tree layout does for the engine.
#[async_trait]
pub trait TreeLayout: Send + Sync {
    /// What a save must match, read with the tree.
    type Token: Clone + Send + Sync + std::fmt::Debug;

    /// One document's state; `None` when nothing is stored for the id.
    async fn read(&self, id: &str) -> Result<Option<LaidOut<Self::Token>>>;

    /// Many documents' states, one per id, in order.
    async fn read_many(&self, ids: &[String]) -> Result<Vec<Option<LaidOut<Self::Token>>>>;

    /// Saves `tree` over `before` (`None`: nothing was stored) with the backend's preconditions:
    /// [`ErrorKind::Conflict`] when another writer got in first (the engine reads again and
    /// retries). Saving the tree read over itself finishes a save a crash cut short.
    async fn save(&self, id: &str, before: Option<&LaidOut<Self::Token>>, tree: &RevTree) -> Result<()>;

    /// Erases every trace of one id (its last leaf purged), of no other id.
    async fn erase(&self, id: &str, state: &LaidOut<Self::Token>) -> Result<()>;

    /// Whether `state` is what a save cut short by a crash leaves.
    async fn unfinished(&self, id: &str, state: &LaidOut<Self::Token>) -> Result<bool>;
}

/// How many times a read that found an unfinished save tries to finish it against other writers
/// before answering the tree as read.
pub const FINISH_ATTEMPTS: usize = 16;

/// The rule on writes: a write saves when it changed the tree, and also when it changed nothing
/// but the state it read is an unfinished save (else a document a crash left out of the feed
/// stays out for good: every later replicated write of its leaves changes nothing).
///
/// Boxed with its lifetimes named (as the trait's methods are): an `async fn` generic over the
/// layout and its token's references trips rustc's higher-ranked `Send` check in the handlers
/// that await it.
pub fn must_save<'a, L: TreeLayout + ?Sized>(
    layout: &'a L,
    id: &'a str,
    state: Option<&'a LaidOut<L::Token>>,
    changed: bool,
) -> BoxFuture<'a, Result<bool>> {
    Box::pin(async move {
        if changed {
            return Ok(true);
        }
        match state {
            Some(state) => layout.unfinished(id, state).await,
            None => Ok(false),
        }
    })
}

/// The rule on reads: the document's state, an unfinished save finished first (the tree read
/// over itself, against other writers). The read answers even when finishing fails: the tree
/// read holds every leaf already (the side place is written first), only the record lags.
/// Boxed as [`must_save`] is.
pub fn read_repairing<'a, L: TreeLayout + ?Sized>(
    layout: &'a L,
    id: &'a str,
) -> BoxFuture<'a, Result<Option<LaidOut<L::Token>>>> {
    Box::pin(async move {
        let state = layout.read(id).await?;
        Ok(finished(layout, id, state).await)
    })
}

/// Unfinished saves finished at once among many documents' reads.
const FINISHING_AT_ONCE: usize = 16;

/// The rule on reads of many documents ([`read_repairing`] for each, in one batched read): one
/// state per id, in order, each unfinished save among them finished first.
pub fn read_many_repairing<'a, L: TreeLayout + ?Sized>(
    layout: &'a L,
    ids: &'a [String],
) -> BoxFuture<'a, Result<Vec<MaybeLaidOut<L::Token>>>> {
    Box::pin(async move {
        let states = layout.read_many(ids).await?;
        let mut answered = Vec::with_capacity(states.len());
        let mut states = ids.iter().zip(states).peekable();
        while states.peek().is_some() {
            let finishing: Vec<_> =
                states.by_ref().take(FINISHING_AT_ONCE).map(|(id, state)| finished(layout, id, state)).collect();
            answered.extend(futures::future::join_all(finishing).await);
        }
        Ok(answered)
    })
}

/// `state`, as read, with the save it shows unfinished finished: the tree read saved over
/// itself, then read again, at most [`FINISH_ATTEMPTS`] times against other writers. Whatever
/// fails on the way answers the last state read (the leaves are all there; only the record
/// lags), so a read never fails for a repair it could not make.
pub fn finished<'a, L: TreeLayout + ?Sized>(
    layout: &'a L,
    id: &'a str,
    state: Option<LaidOut<L::Token>>,
) -> BoxFuture<'a, Option<LaidOut<L::Token>>> {
    Box::pin(finished_unboxed(layout, id, state))
}

async fn finished_unboxed<L: TreeLayout + ?Sized>(
    layout: &L,
    id: &str,
    mut state: Option<LaidOut<L::Token>>,
) -> Option<LaidOut<L::Token>> {
    let unanswered = |err: crate::error::Error| {
        tracing::warn!(id, error = %err, "finishing a save a crash cut short failed; answering the tree as read");
    };
    for _ in 0..FINISH_ATTEMPTS {
        let read = state.as_ref()?;
        match layout.unfinished(id, read).await {
            Ok(false) => return state,
            Ok(true) => {}
            Err(err) => {
                unanswered(err);
                return state;
            }
        }
        match layout.save(id, Some(read), &read.tree).await {
            Ok(()) => {}
            Err(err) if err.kind() == ErrorKind::Conflict => {}
            Err(err) => {
                unanswered(err);
                return state;
            }
        }
        match layout.read(id).await {
            Ok(again) => state = again,
            Err(err) => {
                unanswered(err);
                return state;
            }
        }
    }
    state
}
