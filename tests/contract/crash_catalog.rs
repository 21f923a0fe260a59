//! Crash points of creating and deleting a database (issue 35 §3; docs/design/crash-points.md,
//! "Creating and deleting a database"): the catalog's own calls cut at every `k` with the
//! database's first write and its deletion (`CrashingCatalog`, both kinds of cut), and a create
//! cut inside Firestore's catalog (its two markers), a state the layer cannot reach, made by hand.
//! After each cut, a new process (a new catalog) must find the database either absent (it does
//! not list, does not open, and can be created) or whole (it lists, opens, and serves its feed
//! and `_all_docs`), never the documents of a deleted incarnation; and a database created again
//! after a deletion starts empty.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use agentstore::backend::catalog::{open_catalog, Catalog, DbName};
use agentstore::backend::{BackendUrl, IdRange};
use agentstore::database::{Databases, Write};
use serde_json::{json, Value};

use crate::crash::{CrashPoint, CrashingCatalog, Cut};
use crate::crash_sweep::object;
use crate::harness::Ctx;

/// More catalog and storage calls than one run makes.
const MAX_CRASH_POINTS: usize = 100;

static RUNS: AtomicUsize = AtomicUsize::new(0);

fn unique_name(what: &str) -> DbName {
    let n = RUNS.fetch_add(1, Ordering::Relaxed);
    DbName::parse(&format!("sweep-{what}-{}-{n}", std::process::id())).expect("a database name")
}

async fn catalog_of(ctx: &Ctx) -> Arc<dyn Catalog> {
    let url: BackendUrl = ctx.backend_url.parse().expect("the harness's backend URL parses");
    open_catalog(&url).await.expect("the catalog")
}

fn edit(value: Value) -> Write {
    Write::Edit { parent: None, deleted: false, body: object(value) }
}

/// The run cut at each crash point: create, write one document, delete, create again, write
/// another. Every step's answer is kept: an acknowledged step must hold after the restart.
async fn run(databases: &Databases, name: &DbName) -> Vec<&'static str> {
    let mut acknowledged = Vec::new();
    let Ok(db) = databases.create(name).await else { return acknowledged };
    acknowledged.push("created");
    if db.write("before", &edit(json!({"incarnation": 1}))).await.is_err() {
        return acknowledged;
    }
    acknowledged.push("written");
    if databases.delete(name).await.is_err() {
        return acknowledged;
    }
    acknowledged.push("deleted");
    let Ok(again) = databases.create(name).await else { return acknowledged };
    acknowledged.push("created again");
    if again.write("after", &edit(json!({"incarnation": 2}))).await.is_ok() {
        acknowledged.push("written again");
    }
    acknowledged
}

/// What a new process finds of `name`: the violations.
async fn check(catalog: &Arc<dyn Catalog>, name: &DbName, acknowledged: &[&str]) -> Vec<String> {
    let databases = Databases::new(Some(Arc::clone(catalog)), 4);
    let mut violations = Vec::new();
    let listed = databases.list().await.expect("list").contains(name);
    let opened = databases.open(name).await.expect("open");
    let Some(db) = opened else {
        if listed {
            violations.push("listed, but does not open".into());
        }
        // Absent is right before an acknowledged create, and after an acknowledged write (its
        // deletion, cut, may have been applied) or deletion.
        if acknowledged.last().is_some_and(|step| !["written", "deleted"].contains(step)) {
            violations.push(format!("absent after {acknowledged:?} were acknowledged"));
        }
        // Absent: it can be created, and starts empty.
        match databases.create(name).await {
            Ok(db) => violations.extend(ids_of(&db).await.err()),
            Err(err) => violations.push(format!("absent, but cannot be created: {err}")),
        }
        return violations;
    };
    if !listed {
        violations.push("opens, but is not listed".into());
    }
    let ids = match ids_of(&db).await {
        Ok(ids) => ids,
        Err(err) => return vec![err],
    };
    let expected: &[&[&str]] = match acknowledged.last() {
        Some(&"written again") => &[&["after"]],
        Some(&"created again") | Some(&"deleted") => &[&[], &["after"]],
        Some(&"written") => &[&["before"]],
        // The deletion may have been applied with its answer lost, and a create after it too.
        _ => &[&[], &["before"], &["after"]],
    };
    if !expected.iter().any(|ids_expected| ids == *ids_expected) {
        violations.push(format!("holds {ids:?} after {acknowledged:?}; expected one of {expected:?}"));
    }
    violations
}

/// The ids the database's feed and `_all_docs` hold, which must agree (an error when either
/// fails or they differ).
async fn ids_of(db: &agentstore::database::Database) -> Result<Vec<String>, String> {
    let feed = db.backend().changes(None, 100).await.map_err(|err| format!("the feed fails: {err}"))?;
    let fed: Vec<String> = feed.changes.into_iter().map(|change| change.id).collect();
    let listed = db.all_docs(&IdRange::all(), 100, None).await.map_err(|err| format!("_all_docs fails: {err}"))?;
    let listed: Vec<String> = listed.items.into_iter().map(|(id, _)| id).collect();
    if fed != listed {
        return Err(format!("the feed holds {fed:?}, _all_docs {listed:?}"));
    }
    Ok(listed)
}

/// The sweep over the catalog's calls and the database's, both kinds of cut.
pub async fn crash_sweep_create_and_delete_database(ctx: Ctx) {
    if ctx.backend_name == "couchdb" {
        println!("couchdb: not applicable: the databases are CouchDB's own");
        return;
    }
    let catalog = catalog_of(&ctx).await;
    let mut violations = Vec::new();
    for cut in [Cut::Stop, Cut::LoseAnswer] {
        let mut steps = Vec::new();
        let mut crash_points = 0;
        for k in 0..MAX_CRASH_POINTS {
            let name = unique_name("catalog");
            let point = CrashPoint::new(k, cut);
            let crashing =
                Databases::new(Some(Arc::new(CrashingCatalog::new(Arc::clone(&catalog), Arc::clone(&point)))), 4);
            let acknowledged = run(&crashing, &name).await;
            point.end();
            let found = check(&catalog, &name, &acknowledged).await;
            violations.extend(found.into_iter().map(|v| format!("{cut:?} at call {k}: {v}")));
            let _ = Catalog::delete(catalog.as_ref(), &name).await;
            if !point.cut_made() {
                steps = point.called();
                break;
            }
            crash_points += 1;
            assert!(k + 1 < MAX_CRASH_POINTS, "still cut after {MAX_CRASH_POINTS} calls");
        }
        println!(
            "crash sweep: {} create and delete a database {cut:?}: {crash_points} crash points; steps: {}",
            ctx.backend_name,
            steps.join(" ")
        );
    }
    assert!(violations.is_empty(), "crash sweep: {}: violations:\n  {}", ctx.backend_name, violations.join("\n  "));
}

/// Firestore's `create` writes the database's marker, then its layout marker: cut between the
/// two, the database lists and takes writes; its feed and `_all_docs` must serve them too.
pub async fn crash_cut_inside_a_firestore_create_leaves_a_serving_database(ctx: Ctx) {
    if ctx.backend_name != "firestore" {
        println!(
            "{}: not applicable: the embedded store creates the file whole (temporary name, rename), DynamoDB's \
             create writes the layout marker last, whole, and takes over a table left without it",
            ctx.backend_name
        );
        return;
    }
    let catalog = catalog_of(&ctx).await;
    let name = unique_name("firestore-layout");
    catalog.create(&name).await.expect("create");
    remove_layout_marker(&ctx.backend_url, &name).await;

    // A new process: opens the database, writes, and reads its feed and `_all_docs`.
    let restarted = catalog_of(&ctx).await;
    let databases = Databases::new(Some(Arc::clone(&restarted)), 4);
    assert!(databases.list().await.expect("list").contains(&name), "the database lists");
    let db = databases.open(&name).await.expect("open").expect("the database opens");
    db.write("doc", &edit(json!({"v": 1}))).await.expect("a write");
    let ids = ids_of(&db).await;
    Catalog::delete(restarted.as_ref(), &name).await.expect("delete");
    assert_eq!(ids, Ok(vec!["doc".to_owned()]), "a database whose create was cut serves its documents");
}

/// Deletes the layout marker of `name`'s instance through the emulator's REST API: the state a
/// create cut after the database's marker leaves (docs/firestore-layout.md, the catalog's paths).
async fn remove_layout_marker(backend_url: &str, name: &DbName) {
    let url = url::Url::parse(backend_url).expect("the Firestore URL");
    let param = |key: &str| url.query_pairs().find(|(k, _)| k == key).map(|(_, v)| v.into_owned());
    let emulator = param("emulator").expect("the emulator's address");
    let collection = param("collection").expect("the collection");
    let project = url.host_str().expect("the project");
    let documents = format!("http://{emulator}/v1/projects/{project}/databases/(default)/documents");
    let marker = format!("{documents}/{collection}_databases/{}", name.encoded());
    let client = reqwest::Client::new();
    let read: Value = client
        .get(&marker)
        .bearer_auth("owner")
        .send()
        .await
        .expect("read the marker")
        .json()
        .await
        .expect("the marker as JSON");
    let instance = read.pointer("/fields/instance/stringValue").and_then(Value::as_str).expect("the instance");
    let layout = format!("{marker}/instances/{instance}/db_documents_meta/layout");
    let answer = client.delete(&layout).bearer_auth("owner").send().await.expect("delete the layout marker");
    assert!(answer.status().is_success(), "deleting {layout}: {}", answer.status());
}

/// DynamoDB's catalog calls cut inside: a deletion cut after it marked the database's layout
/// marker dropped (DeleteTable never sent), and a creation cut after CreateTable (the marker
/// never written). Made by hand on the table, states `CrashingCatalog` cannot reach. A new
/// process finds neither database (not listed, not opened), and creating each again gives an
/// empty database: the dropped table is deleted first, the table without a marker taken over.
pub async fn crash_cut_inside_a_dynamodb_create_or_delete_leaves_no_database(ctx: Ctx) {
    if ctx.backend_name != "dynamodb" {
        println!("{}: not applicable: the states are DynamoDB's catalog's own", ctx.backend_name);
        return;
    }
    let catalog = catalog_of(&ctx).await;
    let dropped = unique_name("dynamodb-dropped");
    let unmarked = unique_name("dynamodb-unmarked");
    // Only the dropped one holds a document: nothing is written to a database before its marker.
    let databases = Databases::new(Some(Arc::clone(&catalog)), 4);
    let db = databases.create(&dropped).await.expect("create");
    db.write("old", &edit(json!({"v": 1}))).await.expect("a write");
    databases.create(&unmarked).await.expect("create");
    let config = agentstore::backend::dynamodb::DynamoConfig::parse(&ctx.backend_url).expect("the DynamoDB URL");
    let data_store = agentstore::backend::dynamodb::DynamoDbBackend::open(&config).await.expect("the data-store table");
    let client = data_store.client();
    let marker_key =
        aws_sdk_dynamodb::types::AttributeValue::S(agentstore::backend::dynamodb::layout::MARKER_ID.into());
    let table_of = |name: &DbName| format!("{}.db.{}", config.table, name.encoded());
    client
        .update_item()
        .table_name(table_of(&dropped))
        .key("_id", marker_key.clone())
        .update_expression("SET dropped = :dropped")
        .expression_attribute_values(":dropped", aws_sdk_dynamodb::types::AttributeValue::Bool(true))
        .send()
        .await
        .expect("mark the marker dropped");
    client.delete_item().table_name(table_of(&unmarked)).key("_id", marker_key).send().await.expect("drop the marker");

    let restarted = catalog_of(&ctx).await;
    let databases = Databases::new(Some(Arc::clone(&restarted)), 4);
    let listed = databases.list().await.expect("list");
    for name in [&dropped, &unmarked] {
        assert!(!listed.contains(name), "{name} is listed");
        assert!(databases.open(name).await.expect("open").is_none(), "{name} opens");
        let again = databases.create(name).await.expect("created again");
        assert_eq!(ids_of(&again).await, Ok(Vec::new()), "{name} created again starts empty");
        assert!(databases.list().await.expect("list").contains(name), "{name} created again is listed");
        Catalog::delete(restarted.as_ref(), name).await.expect("delete");
    }
}
