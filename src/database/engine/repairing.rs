//! The engine's reads that repair: a save a crash cut short (`RepairableLayout::unfinished`) is
//! finished by the read that finds it, through the one crash-repair rule of
//! [`crate::database::layout`] ([`read_repairing`], [`read_many_repairing`], [`finished`]), not
//! only by the document's next write.
//!
//! Used where waiting for the next write would leave the document out of the feed for good: the
//! reads a replicator decides what to send by (`_revs_diff`, `_missing_revs`, `_bulk_get`,
//! `open_revs`: a replicator whose write was cut asks about the leaf it sent, finds it known and
//! never sends it again), and the reads that meet a deletion cut before its tombstone
//! (`_all_docs`, `Database::read_many` under the change feed, views and `keys=`: such a record
//! costs no read to recognize, and until it is finished the backend counts the document live in
//! `doc_count`). docs/design/crash-points.md has every crash point and its repair.

use async_trait::async_trait;

use super::{Database, DocState};
use crate::backend::rev_tree::RevTree;
use crate::database::layout::{finished, read_many_repairing, read_repairing, LayoutToken, RepairableLayout};
use crate::error::Result;

/// The engine's layout as a repairing read saves through it: each save counts as a write under
/// way (a deletion of the database waits for it), takes its turn with this process's writers of
/// the document when it is free, and touches the manifests of the attachment bytes the tree references first,
/// as every save of the engine does (`Database::keep_references`).
struct Finishing<'a>(&'a Database);

#[async_trait]
impl RepairableLayout for Finishing<'_> {
    type Token = LayoutToken;

    async fn read(&self, id: &str) -> Result<Option<DocState>> {
        self.0.read(id).await
    }

    async fn read_many(&self, ids: &[String]) -> Result<Vec<Option<DocState>>> {
        self.0.read_states(ids).await
    }

    async fn save(&self, id: &str, before: Option<&DocState>, tree: &RevTree) -> Result<()> {
        let _under_way = self.0.start_write()?;
        // Its turn when no writer of this process holds it, never waited for: a read may run
        // under a write's turn (the write guard lists the design documents while a write of one
        // of them holds its turn), and the save is a compare-and-swap, right without the turn.
        let _turn = self.0.write_lock(id).try_lock_owned().ok();
        self.0.keep_references(before, tree).await?;
        self.0.save(id, before, tree).await
    }

    async fn unfinished(&self, id: &str, state: &DocState) -> Result<bool> {
        self.0.layout.unfinished(id, state).await
    }
}

impl Database {
    /// The document's state as [`Database::read`] answers it, a save a crash cut short finished
    /// first (bounded; the state as read when finishing fails).
    pub async fn read_repairing(&self, id: &str) -> Result<Option<DocState>> {
        if id.is_empty() {
            return Ok(None);
        }
        self.while_open(read_repairing(&Finishing(self), id)).await
    }

    /// The states of many documents as [`Database::read_many`] answers them, each save a crash
    /// cut short among them finished first.
    pub async fn read_many_repairing(&self, ids: &[String]) -> Result<Vec<Option<DocState>>> {
        self.while_open(read_many_repairing(&Finishing(self), ids)).await
    }

    /// Finishes the deletions a listing met cut before their tombstone: live records whose
    /// winner is deleted (no read needed to tell them). The listing answers as it read them
    /// either way.
    pub(super) async fn finish_cut_deletions<'s>(&self, states: impl Iterator<Item = (&'s str, &'s DocState)>) {
        for (id, state) in states {
            if cut_deletion(state) {
                finished(&Finishing(self), id, Some(state.clone())).await;
            }
        }
    }
}

/// Whether `state` is a deletion cut before its tombstone: a live record of the engine's layout
/// holding a deleted winner.
pub(super) fn cut_deletion(state: &DocState) -> bool {
    let live_record = state.token.record().is_some_and(|token| token.record_rev.is_some());
    live_record && state.deleted()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::Map;

    use super::*;
    use crate::backend::embedded::EmbeddedBackend;
    use crate::backend::{DocumentBackend, IdRange, Page, Precondition};
    use crate::database::engine::counting::CountingBackend;
    use crate::database::engine::{Write, Written};
    use crate::database::layout::record::record_of;
    use crate::database::rev_tree::RevPath;
    use crate::database::write_guard::{ProposedWrite, WriteGuard};
    use crate::error::Error;

    /// A guard that lists every document before each write, as the validation guard lists the
    /// design documents: a read under the write's turn.
    struct ListsEveryDocument;

    #[async_trait]
    impl WriteGuard for ListsEveryDocument {
        async fn applies(&self, db: &Database) -> Result<bool> {
            db.all_docs(&IdRange::all(), 100, None).await?;
            Ok(false)
        }

        async fn check(&self, _: &Database, writes: &[ProposedWrite]) -> Result<Vec<Option<Error>>> {
            Ok(writes.iter().map(|_| None).collect())
        }

        fn design_changed(&self, _: &Database) {}
    }

    /// Every read of the engine's layout gives the same trees whether the backend hands over its
    /// records' text (the embedded store) or parsed bodies (the same store behind a layer, which
    /// does not forward the text reads); the outlines `_changes` reads hold the same leaves
    /// without their bodies; and a cut deletion an outline read meets is finished from a whole
    /// read, its other branch's body kept.
    #[tokio::test]
    async fn text_and_outline_reads_agree_with_parsed_reads() {
        let dir = tempfile::tempdir().unwrap();
        let backend: Arc<dyn DocumentBackend> =
            Arc::new(EmbeddedBackend::open(&dir.path().join("d.redb")).await.unwrap());
        let text = Database::new("d".into(), Arc::clone(&backend));
        let parsed = Database::new("d".into(), CountingBackend::over(Arc::clone(&backend), false));
        let body = |n: u64| {
            let mut body = Map::new();
            body.insert("n".into(), n.into());
            body.insert("s".into(), "é\"\\x".into());
            body
        };
        let edit = |parent: Option<String>, deleted: bool, n: u64| Write::Edit { parent, deleted, body: body(n) };
        for id in ["a", "b", "c", "_design/d"] {
            text.write(id, &edit(None, false, 1)).await.unwrap();
        }
        // `b` with a conflicting branch whose body only a whole read holds; `c` deleted.
        let branch = RevPath { start: 1, ids: vec!["f".repeat(32)] };
        text.write("b", &Write::Replicated { path: branch, deleted: false, body: body(7) }).await.unwrap();
        let c = text.read("c").await.unwrap().and_then(|state| state.winner_rev());
        text.write("c", &edit(c, true, 0)).await.unwrap();
        let ids: Vec<String> = ["a", "b", "c", "_design/d", "none"].map(str::to_owned).to_vec();

        let whole = text.read_many(&ids).await.unwrap();
        let trees =
            |states: &[Option<DocState>]| states.iter().map(|s| s.as_ref().map(|s| s.tree.clone())).collect::<Vec<_>>();
        assert_eq!(trees(&whole), trees(&parsed.read_many(&ids).await.unwrap()));
        assert_eq!(whole[1].as_ref().map(|s| s.tree.leaves().len()), Some(2));
        assert!(whole[1].as_ref().unwrap().tree.leaves().iter().all(|leaf| !leaf.body.is_empty()), "bodies read");
        for id in ["a", "b"] {
            assert_eq!(text.read(id).await.unwrap().unwrap().tree, parsed.read(id).await.unwrap().unwrap().tree);
        }
        let outlines = text.read_many_outlines(&ids).await.unwrap();
        for (outline, whole) in outlines.iter().zip(&whole) {
            let shape = |state: &Option<DocState>| {
                state.as_ref().map(|s| s.tree.leaves().iter().map(|l| (l.path.clone(), l.deleted)).collect::<Vec<_>>())
            };
            assert_eq!(shape(outline), shape(whole));
            // A deleted document's tree (in its local tree, not a record) is read whole.
            let live = outline.iter().filter(|s| s.token.record().is_some_and(|t| t.record_rev.is_some()));
            let bodies = live.flat_map(|s| s.tree.leaves()).filter(|leaf| !leaf.body.is_empty()).count();
            assert_eq!(bodies, 0, "no bodies read");
        }
        let every = IdRange { include_design: true, ..IdRange::all() };
        let listed =
            |page: Page<(String, DocState)>| page.items.into_iter().map(|(id, s)| (id, s.tree)).collect::<Vec<_>>();
        let listed_text = listed(text.all_docs(&every, 10, None).await.unwrap());
        assert_eq!(listed_text, listed(parsed.all_docs(&every, 10, None).await.unwrap()));
        assert_eq!(listed_text.iter().map(|(id, _)| id.as_str()).collect::<Vec<_>>(), ["_design/d", "a", "b"]);

        // `a` deleted by its record write alone (cut before the tombstone): an outline read
        // finishes the deletion, from a whole read.
        let state = text.read("a").await.unwrap().expect("written");
        let mut tree = state.tree.clone();
        let deletion = tree.edit(state.winner_rev().as_deref(), "d2", true, Map::new(), 1000).unwrap();
        let rev = state.token.record().and_then(|token| token.record_rev.clone()).expect("a live record");
        backend.put("a", &record_of(&tree).unwrap(), Precondition::MatchRevision(rev)).await.unwrap();
        assert_eq!(backend.exact_count().await.unwrap(), Some(3), "counted live before the repair");
        text.read_many_outlines(&["a".to_owned()]).await.unwrap();
        assert!(backend.get("a").await.unwrap().is_none(), "the deletion was finished");
        assert_eq!(backend.exact_count().await.unwrap(), Some(2));
        let after = text.read("a").await.unwrap().expect("the tree is kept");
        assert!(after.deleted() && after.tree.contains(&deletion), "{:?}", after.tree.leaves());
    }

    /// A deletion cut before its tombstone, met by a listing under a write's turn on the same
    /// document: the listing finishes it without waiting for the turn (it would wait for ever),
    /// and the write then applies over the finished deletion.
    #[tokio::test]
    async fn a_listing_under_a_writes_turn_finishes_a_cut_deletion() {
        let dir = tempfile::tempdir().unwrap();
        let backend: Arc<dyn DocumentBackend> =
            Arc::new(EmbeddedBackend::open(&dir.path().join("d.redb")).await.unwrap());
        let db = Database::new("d".into(), Arc::clone(&backend)).with_write_guard(Some(Arc::new(ListsEveryDocument)));
        let edit = |parent: Option<String>, deleted: bool| Write::Edit { parent, deleted, body: Map::new() };
        let Written::Edited(first) = db.write("x", &edit(None, false)).await.unwrap() else { panic!("an edit") };
        // The deletion's record write, and no more.
        let state = db.read("x").await.unwrap().expect("written");
        let mut tree = state.tree.clone();
        let deleted = tree.edit(Some(&first), "d1", true, Map::new(), 1000).unwrap();
        let rev = state.token.record().and_then(|token| token.record_rev.clone()).expect("a live record");
        backend.put("x", &record_of(&tree).unwrap(), Precondition::MatchRevision(rev)).await.unwrap();
        assert_eq!(backend.exact_count().await.unwrap(), Some(1), "counted live before the repair");

        let recreated = tokio::time::timeout(std::time::Duration::from_secs(10), db.write("x", &edit(None, false)))
            .await
            .expect("the write does not wait on its own turn")
            .unwrap();
        assert!(matches!(recreated, Written::Edited(_)));
        let state = db.read("x").await.unwrap().expect("written");
        assert!(!state.deleted());
        assert!(state.tree.contains(&deleted), "the deletion was kept: {:?}", state.tree.leaves());
        assert_eq!(backend.exact_count().await.unwrap(), Some(1));
    }
}
