//! What a crash left half done on a database besides the data-store one (issue 35 §1/§3;
//! docs/design/crash-points.md), repaired over HTTP by the requests that meet it, with no write
//! of the document. The states are made as the crash leaves them, through the database's own
//! backend: a create cut after its local tree `tree:{id}` and before its record (it reads back
//! but is missing from `_changes` and `_all_docs`), and a deletion cut after its record write and
//! before its tombstone (deleted, but counted live in `doc_count`).
//!
//! Expected answers are CouchDB 3.4.3's for the document as acknowledged: a `_revs_diff` or
//! `_missing_revs` of a revision the database has names nothing missing, `_bulk_get` and
//! `open_revs` answer the leaf, and a database holding one live and one deleted document shows
//! `doc_count` 1. The CouchDB backend keeps its own trees: nothing to check.

use std::sync::Arc;

use agentstore::backend::{DocumentBackend, Precondition};
use agentstore::database::rev_tree::RevTree;
use libtest_mimic::Failed;
use serde_json::{json, Map, Value};

use super::{fresh_db_named, Endpoint};
use crate::common::{check, TestResult};

/// The database `db`'s backend, as the server opened it.
async fn backend_of(e: &Endpoint, db: &str) -> Result<Arc<dyn DocumentBackend>, Failed> {
    let name = agentstore::backend::catalog::DbName::parse(db).map_err(|err| err.to_string())?;
    let database = e.databases.open(&name).await?.ok_or("the database is not open")?;
    Ok(Arc::clone(database.backend()))
}

/// The ids `_changes` lists, and those `_all_docs` lists.
async fn listed(e: &Endpoint, db: &str) -> Result<(Vec<String>, Vec<String>), Failed> {
    let ids = |rows: &Value| -> Vec<String> {
        rows.as_array().into_iter().flatten().filter_map(|row| row["id"].as_str().map(str::to_owned)).collect()
    };
    let changes = e.get(&format!("/{db}/_changes")).await?.expect(200, "_changes")?;
    let all_docs = e.get(&format!("/{db}/_all_docs")).await?.expect(200, "_all_docs")?;
    Ok((ids(&changes.body["results"]), ids(&all_docs.body["rows"])))
}

/// How a replicator asks about one leaf; each must answer it known.
async fn ask(e: &Endpoint, db: &str, how: &str, id: &str, rev: &str) -> TestResult {
    match how {
        "_revs_diff" => {
            let answer = e.post(&format!("/{db}/_revs_diff"), json!({ id: [rev] })).await?.expect(200, how)?;
            check(answer.body == json!({}), || format!("{how} of {id} {rev}: {}", answer.body))
        }
        "_missing_revs" => {
            let answer = e.post(&format!("/{db}/_missing_revs"), json!({ id: [rev] })).await?.expect(200, how)?;
            check(answer.body == json!({"missing_revs": {}}), || format!("{how} of {id} {rev}: {}", answer.body))
        }
        "_bulk_get" => {
            let asked = json!({"docs": [{"id": id, "rev": rev}]});
            let answer = e.post(&format!("/{db}/_bulk_get"), asked).await?.expect(200, how)?;
            let doc = &answer.body["results"][0]["docs"][0]["ok"];
            check(doc["_rev"] == rev, || format!("{how} of {id} {rev}: {}", answer.body))
        }
        _ => {
            let path = format!("/{db}/{id}?open_revs=[\"{rev}\"]");
            let answer = e.get(&path).await?.expect(200, "open_revs")?;
            check(answer.body[0]["ok"]["_rev"] == rev, || format!("open_revs of {id} {rev}: {}", answer.body))
        }
    }
}

/// A create cut between its local tree and its record, for each of the reads a replicator
/// decides what to send by: that read alone puts the document in `_changes` and `_all_docs`.
pub(super) async fn replicator_reads_repair_a_cut_create(e: Endpoint) -> TestResult {
    if e.backend == "couchdb" {
        return Ok(());
    }
    let db = fresh_db_named(&e, "repair", "reads").await?;
    let rev = e.put(&format!("/{db}/source"), json!({"v": 1})).await?.expect(201, "PUT source")?.rev()?;
    let backend = backend_of(&e, &db).await?;
    let record = backend.get("source").await?.ok_or("source has no record")?;
    for how in ["_revs_diff", "_missing_revs", "_bulk_get", "open_revs"] {
        let id = format!("cut-{}", how.trim_start_matches('_'));
        // The create's first write, and no more: the tree of `source` is the tree of a create of
        // the same body (revision ids do not depend on the document id).
        backend.put_local(&format!("tree:{id}"), &record.body, Precondition::MustNotExist).await?;
        e.get(&format!("/{db}/{id}")).await?.expect(200, &format!("GET {id}, half written"))?;
        let (feed, all_docs) = listed(&e, &db).await?;
        check(!feed.contains(&id) && !all_docs.contains(&id), || format!("{id} listed before any repair"))?;
        ask(&e, &db, how, &id, &rev).await?;
        let (feed, all_docs) = listed(&e, &db).await?;
        check(feed.contains(&id), || format!("after {how} of its leaf, {id} is not in _changes: {feed:?}"))?;
        check(all_docs.contains(&id), || format!("after {how} of its leaf, {id} is not in _all_docs: {all_docs:?}"))?;
    }
    Ok(())
}

/// `doc_count` of `db`, at once: a remembered count is served only after a check that nothing
/// changed since (`src/backend/raw/count_cache.rs`).
async fn doc_count(e: &Endpoint, db: &str) -> Result<Value, Failed> {
    let info = e.get(&format!("/{db}")).await?.expect(200, "GET /db")?;
    Ok(info.body["doc_count"].clone())
}

/// A deletion cut after its record write, before its tombstone, for each listing that meets the
/// record: the listing finishes the deletion, so `doc_count` no longer counts it.
pub(super) async fn listings_finish_a_cut_deletion(e: Endpoint) -> TestResult {
    if e.backend == "couchdb" {
        return Ok(());
    }
    for listing in ["_all_docs", "_changes"] {
        let db = fresh_db_named(&e, "repair", "deletion").await?;
        e.put(&format!("/{db}/kept"), json!({"v": 1})).await?.expect(201, "PUT kept")?;
        let rev = e.put(&format!("/{db}/cut"), json!({"v": 1})).await?.expect(201, "PUT cut")?.rev()?;
        let backend = backend_of(&e, &db).await?;
        let record = backend.get("cut").await?.ok_or("cut has no record")?;
        // The deletion's first write, and no more: the record holding the tree with its deleted
        // winner.
        let mut tree: RevTree = serde_json::from_value(record.body["revtree"].clone())?;
        tree.edit(Some(&rev), "d1", true, Map::new(), 1000).map_err(|_| "the deletion does not apply")?;
        let mut body = Map::new();
        body.insert("revtree".into(), serde_json::to_value(&tree)?);
        backend.put("cut", &body, Precondition::MatchRevision(record.rev)).await?;
        e.get(&format!("/{db}/cut")).await?.expect(404, "GET cut, deleted")?;
        e.get(&format!("/{db}/{listing}")).await?.expect(200, listing)?;
        let doc_count = doc_count(&e, &db).await?;
        check(doc_count == 1, || format!("after {listing}: doc_count {doc_count} (CouchDB: 1)"))?;
    }
    Ok(())
}
