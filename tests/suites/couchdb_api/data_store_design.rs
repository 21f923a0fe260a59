//! The data-store database's design documents as the engine keeps every database's: records
//! `_design/{name}` (in `_changes`, `_all_docs` and `doc_count` for an admin, never a data
//! document of the facade), and a previous release's local document `:design:{name}` moved into
//! such a record with its revisions (`agentstore upgrade`, and the facade when it opens the
//! store), its view answering as a design document written here does. Skipped over the CouchDB
//! backend, which runs its own design documents.

use std::sync::Arc;

use agentstore::backend::rev_tree::RevTree;
use agentstore::backend::{DocumentBackend, Precondition};
use agentstore::store::{DataStore, StoreOptions};
use libtest_mimic::Failed;
use serde_json::{json, Map, Value};

use super::{doc, path_of, Endpoint, DB};
use crate::common::{check, TestResult};

/// The map function both design documents hold.
const BY_NS: &str = "function(doc) { if (doc.namespace) emit([doc.namespace, doc.key], doc.value); }";

/// A previous release's local document keeping `_design/{name}`: its tree of two revisions,
/// written as that release wrote it. Answers the tree's current revision.
async fn old_layout_design(backend: &Arc<dyn DocumentBackend>, name: &str) -> Result<String, Failed> {
    let mut body = Map::new();
    body.insert("views".into(), json!({"by_ns": {"map": BY_NS}}));
    let mut tree = RevTree::default();
    let first =
        tree.edit(None, "a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1", false, body.clone(), 1000).map_err(|e| format!("{e:?}"))?;
    let second =
        tree.edit(Some(&first), "b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2", false, body, 1000).map_err(|e| format!("{e:?}"))?;
    put_old_layout(backend, name, &tree).await?;
    Ok(second)
}

async fn put_old_layout(backend: &Arc<dyn DocumentBackend>, name: &str, tree: &RevTree) -> TestResult {
    let mut kept = Map::new();
    kept.insert("tree".into(), serde_json::to_value(tree)?);
    backend.put_local(&format!(":design:{name}"), &kept, Precondition::None).await?;
    Ok(())
}

pub(super) async fn data_store_design_documents_are_records(e: Endpoint) -> TestResult {
    if e.backend == "couchdb" {
        println!("data_store_design_documents_are_records: skipped on the CouchDB backend (its own design documents)");
        return Ok(());
    }
    let backend = Arc::clone(&e._ctx.backend);
    let data =
        [doc("user_1", "x", "a", json!(1)), doc("user_1", "y", "b", json!(2)), doc("user_2", "x", "c", json!(3))];
    for one in &data {
        e.put(&path_of(one["_id"].as_str().unwrap_or_default()), one.clone())
            .await?
            .expect(201, "PUT a data document")?;
    }

    // An index built before the move: the move ends its incarnation, so the groups built over the
    // previous release's source are built again.
    e.put(&format!("/{DB}/_design/new"), json!({"views": {"by_ns": {"map": BY_NS}}}))
        .await?
        .expect(201, "PUT a design document")?;
    let before = e.get(&format!("/{DB}/_design/new/_view/by_ns")).await?.expect(200, "the view before the move")?;
    let incarnation = |kept: Option<agentstore::backend::StoredDocument>| kept.map(|doc| doc.body["id"].clone());
    let built_over = incarnation(backend.get_local(":views:incarnation").await?);
    check(built_over.is_some(), || "no incarnation kept for the index".to_owned())?;

    // A design document the previous release kept, moved as `upgrade` moves it: its revision
    // and its ancestry stay; run again (a crash between the record and the removal of the
    // local document repeats the move) changes nothing.
    let current = old_layout_design(&backend, "old").await?;
    let moved = agentstore::store::move_data_store_design_documents(&backend).await?;
    check(moved == 1, || format!("moved {moved} design documents, wanted 1"))?;
    check(backend.get_local(":design:old").await?.is_none(), || "the local document is left behind".to_owned())?;
    let read = e
        .get(&format!("/{DB}/_design/old?revs=true&conflicts=true"))
        .await?
        .expect(200, "GET the moved design document")?;
    check(read.body["_rev"] == json!(current), || format!("the moved revision: {}", read.body))?;
    check(
        read.body["_revisions"]
            == json!({"start": 2, "ids": ["b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2", "a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1"]})
            && read.body.get("_conflicts").is_none(),
        || format!("the moved ancestry: {}", read.body),
    )?;
    old_layout_design(&backend, "old").await?;
    let again = agentstore::store::move_data_store_design_documents(&backend).await?;
    let reread = e.get(&format!("/{DB}/_design/old?conflicts=true")).await?.expect(200, "GET after a repeated move")?;
    check(again == 1 && reread.body["_rev"] == json!(current) && reread.body.get("_conflicts").is_none(), || {
        format!("a repeated move changes nothing: moved {again}, {}", reread.body)
    })?;

    // Its view answers as the view of a design document written here, each from an index of
    // the new incarnation, as before the move.
    let old_view = e.get(&format!("/{DB}/_design/old/_view/by_ns")).await?.expect(200, "the moved view")?;
    let new_view = e.get(&format!("/{DB}/_design/new/_view/by_ns")).await?.expect(200, "the new view")?;
    check(
        old_view.body["rows"].as_array().map(Vec::len) == Some(3)
            && old_view.body["rows"] == new_view.body["rows"]
            && new_view.body["rows"] == before.body["rows"],
        || format!("moved {}, new {}, before the move {}", old_view.body, new_view.body, before.body),
    )?;
    let rebuilt_over = incarnation(backend.get_local(":views:incarnation").await?);
    check(rebuilt_over.is_some() && rebuilt_over != built_over, || {
        format!("the index over the old source is rebuilt in a new incarnation: {built_over:?} then {rebuilt_over:?}")
    })?;
    // An edit of the moved design document follows its revision.
    let mut edited = reread.body.clone();
    edited["language"] = json!("javascript");
    e.put(&format!("/{DB}/_design/old"), edited).await?.expect(201, "edit the moved design document")?;

    // Records: in an admin's `_changes`, `_all_docs` once each, counted in `doc_count`.
    let feed = e.get(&format!("/{DB}/_changes")).await?.expect(200, "_changes")?;
    let fed: Vec<&str> =
        feed.body["results"].as_array().into_iter().flatten().filter_map(|row| row["id"].as_str()).collect();
    check(fed.contains(&"_design/old") && fed.contains(&"_design/new"), || format!("_changes: {}", feed.body))?;
    let listed = e.get(&format!("/{DB}/_all_docs")).await?.expect(200, "_all_docs")?;
    let ids: Vec<&str> =
        listed.body["rows"].as_array().into_iter().flatten().filter_map(|row| row["id"].as_str()).collect();
    let designs = ids.iter().filter(|id| id.starts_with("_design/")).count();
    check(designs == 2 && ids.len() == 5, || format!("_all_docs: {}", listed.body))?;
    // DynamoDB's counts are approximate.
    if e.backend != "dynamodb" {
        check(listed.body["total_rows"] == json!(5), || format!("total_rows: {}", listed.body))?;
        let info = e.get(&format!("/{DB}")).await?.expect(200, "GET the database")?;
        check(info.body["doc_count"] == json!(5), || format!("doc_count: {}", info.body))?;
    }

    // The facade never shows a design document as a data document, not even one holding a data
    // document's identity fields.
    let fielded = json!({"userId": "user_1", "namespace": "z", "key": "k", "value": 9});
    e.put(&format!("/{DB}/_design/fielded"), fielded).await?.expect(201, "PUT a design document with data fields")?;
    let found = e
        .post(&format!("/{DB}/_find"), json!({"selector": {"userId": "user_1", "namespace": "z"}}))
        .await?
        .expect(200, "_find by the identity fields")?;
    check(found.body["docs"] == json!([]), || format!("_find shows no design document: {}", found.body))?;
    let store = DataStore::open(Arc::clone(&backend), StoreOptions::default()).await?;
    let namespaces = store.list_namespaces("user_1").await?;
    check(namespaces == ["x", "y"], || format!("namespaces of user_1: {namespaces:?}"))?;
    check(store.list_keys("user_1", "x").await? == ["a"], || "keys of user_1/x".to_owned())?;
    check(store.get_all("user_2", "x").await?.len() == 1, || "entries of user_2/x".to_owned())?;
    check(store.get_all("user_1", "z").await?.is_empty(), || "entries of user_1/z".to_owned())?;
    check(store.list_keys("user_1", "z").await?.is_empty(), || "keys of user_1/z".to_owned())?;
    Ok(())
}

/// A `validate_doc_update` in a design document of the data-store database runs on every write
/// after the data-store rules, as on every other database (the guard chain `DataStoreRules`,
/// then `validate_doc_update`): its `forbidden` is CouchDB's 403 for a single write and a row of
/// `_bulk_docs`, with its `userCtx`; a write the data-store rules refuse is refused by them first.
/// Removing the design document lifts its rule.
pub(super) async fn data_store_validate_doc_update(e: Endpoint) -> TestResult {
    if e.backend == "couchdb" {
        println!("data_store_validate_doc_update: skipped on the CouchDB backend (its own design documents)");
        return Ok(());
    }
    let guard = json!({"validate_doc_update": "function(newDoc, oldDoc, userCtx) { \
        var who = userCtx.roles.indexOf('_admin') >= 0 ? 'an admin' : 'a user'; \
        if (newDoc.value === 'bad') throw({forbidden: 'no bad values from ' + who}); }"});
    let written =
        e.put(&format!("/{DB}/_design/guard"), guard).await?.expect(201, "PUT a validating design document")?;
    let good = doc("user_1", "ns", "good", json!("fine"));
    e.put(&path_of(good["_id"].as_str().unwrap_or_default()), good.clone()).await?.expect(201, "a valid write")?;
    let bad = doc("user_1", "ns", "bad", json!("bad"));
    let refused = e.put(&path_of(bad["_id"].as_str().unwrap_or_default()), bad.clone()).await?.expect(403, "bad")?;
    let from_the_function =
        |body: &Value| body["reason"].as_str().is_some_and(|r| r.starts_with("no bad values from "));
    check(refused.body["error"] == "forbidden" && from_the_function(&refused.body), || {
        format!("validate_doc_update's refusal: {}", refused.body)
    })?;
    let docs = json!({"docs": [bad.clone(), doc("user_1", "ns", "ok", json!(1))]});
    let bulk = e.post(&format!("/{DB}/_bulk_docs"), docs).await?.expect(201, "_bulk_docs")?;
    check(
        bulk.body[0]["error"] == "forbidden" && from_the_function(&bulk.body[0]) && bulk.body[1]["ok"] == json!(true),
        || format!("_bulk_docs rows: {}", bulk.body),
    )?;
    // The data-store rules come first: a mismatched id is theirs to refuse.
    let mut mismatched = doc("user_1", "ns", "other", json!("bad"));
    mismatched["key"] = json!("not-other");
    let first =
        e.put(&path_of(mismatched["_id"].as_str().unwrap_or_default()), mismatched).await?.expect(403, "ids")?;
    check(first.body["reason"].as_str().is_some_and(|reason| reason.contains("userId")), || {
        format!("the data-store rules first: {}", first.body)
    })?;
    let rev = written.rev()?;
    e.delete(&format!("/{DB}/_design/guard?rev={rev}")).await?.expect(200, "DELETE the design document")?;
    e.put(&path_of(bad["_id"].as_str().unwrap_or_default()), bad).await?.expect(201, "no rule once it is deleted")?;
    Ok(())
}

/// A replicator's write of a design document (`new_edits=false`) is an admin's on the
/// data-store database as on CouchDB: by `PUT ?new_edits=false` and by `_bulk_docs`, the
/// revision kept as sent.
pub(super) async fn data_store_replicated_design_documents(e: Endpoint) -> TestResult {
    if e.backend == "couchdb" {
        println!("data_store_replicated_design_documents: skipped on the CouchDB backend (its own design documents)");
        return Ok(());
    }
    let rev = "1-0123456789abcdef0123456789abcdef";
    let body = json!({"_id": "_design/put", "_rev": rev, "views": {"v": {"map": BY_NS}}});
    let put = e.put(&format!("/{DB}/_design/put?new_edits=false"), body).await?.expect(201, "PUT ?new_edits=false")?;
    check(put.body["rev"] == rev, || format!("PUT ?new_edits=false: {}", put.body))?;
    let bulk = json!({"new_edits": false, "docs": [{"_id": "_design/bulk", "_rev": rev, "views": {}}]});
    let bulked = e.post(&format!("/{DB}/_bulk_docs"), bulk).await?.expect(201, "_bulk_docs new_edits=false")?;
    check(bulked.body == json!([]), || format!("_bulk_docs new_edits=false: {}", bulked.body))?;
    for id in ["_design/put", "_design/bulk"] {
        let read = e.get(&format!("/{DB}/{id}")).await?.expect(200, "GET the replicated design document")?;
        check(read.body["_rev"] == rev, || format!("{id}: {}", read.body))?;
    }
    let view = e.get(&format!("/{DB}/_design/put/_view/v")).await?.expect(200, "its view")?;
    check(view.body["rows"].is_array(), || format!("the replicated design document's view: {}", view.body))
}
