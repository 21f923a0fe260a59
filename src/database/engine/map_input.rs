//! What a map function is shown of each changed document, as JSON text
//! ([`Database::read_map_inputs`]): the winning leaf with `_id`, `_rev`, `_conflicts` and
//! `_deleted_conflicts` (CouchDB 3.4.3 shows both lists; before session 20 this server showed
//! `_conflicts` only), written
//! straight from the record's stored text where the layout and the backend keep whole trees as
//! text (the engine's layout over the embedded store: [`winner_json`]), read whole and written
//! from its value ([`leaf_json`]) everywhere else and for every document the text cannot be
//! written for. Both give the same text for a document.
//!
//! Why: a view build parsed every body into a `Value`, copied it into the document and wrote
//! that as JSON again for the realm, a fifth of a build's instructions (issue 38).

use super::Database;
use crate::database::document::{leaf_json, winner_json, MAP_INPUT};
use crate::error::Result;

impl Database {
    /// One answer per id, in order: the document as a map function receives it (JSON text), or
    /// `None` for a deleted document or one that is not there. A record read from its text and
    /// not written from it (a deleted winner, which may be a deletion cut short; a body with
    /// `_`-members) and an id without a live record (its tree in a local document) are read
    /// whole with [`Database::read_many`], which finishes a cut deletion as before.
    pub async fn read_map_inputs(&self, ids: &[String]) -> Result<Vec<Option<String>>> {
        if ids.iter().any(String::is_empty) {
            return self.read_map_inputs_whole(ids).await;
        }
        let Some(winners) = self.while_open(self.layout.winner_texts(ids)).await? else {
            return self.read_map_inputs_whole(ids).await;
        };
        let mut inputs = Vec::with_capacity(ids.len());
        let mut unwritten = Vec::new();
        for (at, (id, winner)) in ids.iter().zip(&winners).enumerate() {
            let text = winner.as_ref().and_then(|winner| winner_json(id, winner));
            if text.is_none() {
                unwritten.push(at);
            }
            inputs.push(text);
        }
        self.record_reads(ids.len() - unwritten.len());
        if !unwritten.is_empty() {
            let whole_ids: Vec<String> = unwritten.iter().map(|&at| ids[at].clone()).collect();
            let whole = self.read_map_inputs_whole(&whole_ids).await?;
            for (at, text) in unwritten.into_iter().zip(whole) {
                inputs[at] = text;
            }
        }
        Ok(inputs)
    }

    /// [`Database::read_map_inputs`] from whole states: each live winner's document value
    /// ([`leaf_json`] with [`MAP_INPUT`]) written as JSON.
    async fn read_map_inputs_whole(&self, ids: &[String]) -> Result<Vec<Option<String>>> {
        let states = self.read_many(ids).await?;
        let inputs = ids.iter().zip(states).map(|(id, state)| {
            let state = state.filter(|state| !state.deleted())?;
            let winner = state.tree.winner()?;
            let doc = leaf_json(id, &state.tree, winner, MAP_INPUT);
            Some(doc.to_string())
        });
        Ok(inputs.collect())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::{json, Map, Value};

    use super::*;
    use crate::backend::embedded::EmbeddedBackend;
    use crate::backend::rev_tree::RevPath;
    use crate::backend::DocumentBackend;
    use crate::database::{Write, Written};

    fn body(value: Value) -> Map<String, Value> {
        value.as_object().cloned().unwrap_or_default()
    }

    /// Over the embedded store, the inputs read from the records' text are the ones read from
    /// whole states, for live documents (plain, with conflicts), deleted ones, one deleted with a
    /// live conflict left, one with `_` in a value and a missing id; and the plain ones are
    /// written from the text (the layout answers, and `winner_json` writes them).
    #[tokio::test]
    async fn inputs_from_the_records_text_are_the_whole_reads_inputs() {
        let dir = tempfile::tempdir().expect("a directory");
        let backend: Arc<dyn DocumentBackend> =
            Arc::new(EmbeddedBackend::open(&dir.path().join("d.redb")).await.expect("opens"));
        let database = Database::new("d".into(), backend);
        let edit = |parent: Option<&str>, deleted: bool, value: Value| Write::Edit {
            parent: parent.map(str::to_owned),
            deleted,
            body: body(value),
        };
        let branch = |start: u64, ids: &[&str], deleted: bool, value: Value| Write::Replicated {
            path: RevPath { start, ids: ids.iter().map(|id| (*id).to_owned()).collect() },
            deleted,
            body: body(value),
        };
        database.write("plain", &edit(None, false, json!({"z": 1, "a": [1.50, "é"], "n": null}))).await.expect("w");
        database.write("empty", &edit(None, false, json!({}))).await.expect("w");
        for write in [
            branch(2, &["b2", "a1"], false, json!({"v": 1})),
            branch(2, &["c2", "a1"], false, json!({"v": 2})),
            branch(2, &["0a", "a1"], false, json!({"v": 3})),
            branch(2, &["e2", "a1"], true, json!({})),
        ] {
            database.write("conflicted", &write).await.expect("w");
        }
        let Written::Edited(rev) = database.write("gone", &edit(None, false, json!({"v": 1}))).await.expect("w") else {
            panic!("an edit answers its revision")
        };
        database.write("gone", &edit(Some(&rev), true, json!({}))).await.expect("w");
        database.write("half", &branch(1, &["a1"], false, json!({"v": 1}))).await.expect("w");
        database.write("half", &branch(1, &["b1"], false, json!({"v": 2}))).await.expect("w");
        database.write("half", &branch(2, &["c2", "b1"], true, json!({}))).await.expect("w");
        database.write("underscore", &edit(None, false, json!({"k": "_v"}))).await.expect("w");
        let ids: Vec<String> =
            ["plain", "empty", "conflicted", "gone", "half", "underscore", "never"].map(str::to_owned).to_vec();

        let fast = database.read_map_inputs(&ids).await.expect("reads");
        let whole = database.read_map_inputs_whole(&ids).await.expect("reads");
        assert_eq!(fast, whole);
        assert_eq!(fast[3], None, "deleted");
        assert_eq!(fast[6], None, "never written");
        // As CouchDB 3.4.3 shows them (seen on it: `_conflicts`, then `_deleted_conflicts`).
        let conflicted: Value = serde_json::from_str(fast[2].as_deref().expect("live")).expect("JSON");
        assert_eq!((conflicted["_rev"].as_str(), &conflicted["_conflicts"]), (Some("2-c2"), &json!(["2-b2", "2-0a"])));
        assert_eq!(conflicted["_deleted_conflicts"], json!(["2-e2"]));
        let half: Value = serde_json::from_str(fast[4].as_deref().expect("live")).expect("JSON");
        assert_eq!((half["_rev"].as_str(), half.get("_conflicts")), (Some("1-a1"), None));
        assert_eq!(half["_deleted_conflicts"], json!(["2-c2"]));

        let winners = database.layout.winner_texts(&ids).await.expect("reads").expect("the embedded store keeps text");
        let written: Vec<bool> =
            ids.iter().zip(&winners).map(|(id, w)| w.as_ref().and_then(|w| winner_json(id, w)).is_some()).collect();
        assert_eq!(written, [true, true, true, false, true, false, false]);
    }
}
