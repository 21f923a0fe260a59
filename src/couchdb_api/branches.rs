//! The data-store database's conflicts where a listing of the data-store views' shows them
//! (`super::data_design`, `conflicts=true` with `include_docs`): the trees of the listed
//! documents that have branches ([`trees_of`]). Reads and writes of single documents and their leaves are the engine's
//! on every backend (`super::db`).

use crate::backend::rev_tree::RevTree;
use crate::database::layout::data_store;

/// How many trees a listing reads at once.
const TREE_READS: usize = 16;

/// The trees of many documents, one per id, in order (`None`: nothing stored, or the winner
/// alone).
pub(crate) async fn trees_of(
    backend: &dyn crate::backend::DocumentBackend,
    ids: &[String],
) -> crate::Result<Vec<Option<RevTree>>> {
    use futures::{StreamExt, TryStreamExt};
    // A plain loop, not an iterator adapter: a closure here trips rustc's higher-ranked `Send`
    // check on the boxed futures.
    let mut reads = Vec::with_capacity(ids.len());
    for id in ids {
        reads.push(tree_if_branched(backend, id));
    }
    futures::stream::iter(reads).buffered(TREE_READS).try_collect().await
}

/// The tree of `id` when it has leaves besides its winner, else `None`: a listing (every
/// replication reads `_changes?style=all_docs`) pays one cheap check per row, and the whole
/// tree only for documents with branches.
async fn tree_if_branched(backend: &dyn crate::backend::DocumentBackend, id: &str) -> crate::Result<Option<RevTree>> {
    if !data_store::has_branches(backend, id).await? {
        return Ok(None);
    }
    data_store::revision_tree(backend, id).await
}
