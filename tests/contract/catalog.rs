//! The catalog cases: databases besides the data store's, on every backend (`open_catalog` of
//! the test's backend URL). Names carry a prefix unique to the test, since a CouchDB server's
//! databases are shared by every test using it; listings are compared on that prefix only.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use agentstore::backend::catalog::{open_catalog, Catalog, DbName};
use agentstore::backend::{BackendUrl, DesignRequest, DocumentBackend, IdRange, Precondition};
use agentstore::ErrorKind;
use futures::TryStreamExt;
use serde_json::{json, Map, Value};

use crate::harness::Ctx;

// `Catalog::delete` is called by its full path, as the trait method it is.

static PREFIX_COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A prefix no other test (of this process or another) uses.
fn unique_prefix() -> String {
    format!("cat{}x{}-", std::process::id(), PREFIX_COUNTER.fetch_add(1, Ordering::Relaxed))
}

async fn catalog_of(ctx: &Ctx) -> Arc<dyn Catalog> {
    let url: BackendUrl = ctx.backend_url.parse().expect("the harness's backend URL parses");
    open_catalog(&url).await.expect("open_catalog")
}

fn name(text: &str) -> DbName {
    DbName::parse(text).expect("a valid database name")
}

fn body(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        other => panic!("not an object: {other}"),
    }
}

/// The catalog's databases with this test's prefix, as listed.
async fn listed(catalog: &dyn Catalog, prefix: &str) -> Vec<String> {
    let names = catalog.list().await.expect("list");
    names.iter().map(DbName::as_str).filter(|n| n.starts_with(prefix)).map(str::to_owned).collect()
}

/// Drops what a test created, so a shared CouchDB server is left as it was.
async fn drop_all(catalog: &dyn Catalog, prefix: &str) {
    for left in listed(catalog, prefix).await {
        Catalog::delete(catalog, &name(&left)).await.expect("drop what the test created");
    }
}

pub async fn catalog_creates_lists_opens_and_drops(ctx: Ctx) {
    let catalog = catalog_of(&ctx).await;
    assert!(!catalog.describe().is_empty());
    let p = unique_prefix();
    // Created out of order; names needing encoding on every backend but CouchDB.
    let slash = match &ctx.slash_names_unlisted {
        Some(why) => {
            eprintln!("listing names with / not checked: {why}");
            ""
        }
        None => "/",
    };
    let texts = [format!("{p}b"), format!("{p}a$(x)+y-z{slash}w"), format!("{p}a"), format!("{p}a_b")];
    for text in &texts {
        let created = catalog.create(&name(text)).await.unwrap_or_else(|e| panic!("create {text}: {e}"));
        created.health().await.unwrap_or_else(|e| panic!("a created database answers: {e}"));
    }
    let mut expected: Vec<String> = texts.to_vec();
    expected.sort();
    assert_eq!(listed(&*catalog, &p).await, expected, "listed in byte order of the names, decoded");

    for text in &texts {
        assert!(catalog.open(&name(text)).await.expect("open").is_some(), "{text} opens");
    }
    assert!(catalog.open(&name(&format!("{p}missing"))).await.expect("open").is_none());

    let again = catalog.create(&name(&format!("{p}a"))).await.err().map(|e| e.kind());
    assert_eq!(again, Some(ErrorKind::Conflict), "creating an existing database is a conflict");

    let dropped = name(&format!("{p}a$(x)+y-z{slash}w"));
    assert!(Catalog::delete(&*catalog, &dropped).await.expect("drop"), "drop of an existing database");
    assert!(catalog.open(&dropped).await.expect("open").is_none(), "gone once dropped");
    assert!(!Catalog::delete(&*catalog, &dropped).await.expect("drop again"), "drop of a missing database");
    expected.retain(|n| n != dropped.as_str());
    assert_eq!(listed(&*catalog, &p).await, expected, "a dropped database is not listed");

    if ctx.backend_name == "dynamodb" {
        // The longest name a database may have (238 bytes) fits in DynamoDB's 255 characters
        // only when the data store's own table name is short: it is created and dropped, or
        // refused as invalid input, never another error.
        let long = name(&format!("{p}{}", "/".repeat(238 - p.len())));
        match catalog.create(&long).await {
            Ok(_) => assert!(Catalog::delete(&*catalog, &long).await.expect("drop"), "the long name drops"),
            Err(err) => assert_eq!(err.kind(), ErrorKind::InvalidInput, "a name too long for a table: {err}"),
        }
    }
    drop_all(&*catalog, &p).await;
    assert_eq!(listed(&*catalog, &p).await, Vec::<String>::new());
}

pub async fn catalog_databases_are_isolated(ctx: Ctx) {
    let catalog = catalog_of(&ctx).await;
    let p = unique_prefix();
    let first = catalog.create(&name(&format!("{p}first"))).await.expect("create first");
    let second = catalog.create(&name(&format!("{p}second"))).await.expect("create second");
    let data_store: &dyn DocumentBackend = &*ctx.backend;

    first.put("u:n:one", &body(json!({"in": "first"})), Precondition::MustNotExist).await.expect("put in first");
    first.put_local("checkpoint", &body(json!({"seq": 1})), Precondition::None).await.expect("local in first");
    data_store.put("u:n:ds", &body(json!({"in": "data store"})), Precondition::MustNotExist).await.expect("put");

    let read = first.get("u:n:one").await.expect("get").expect("first holds its document");
    assert_eq!(read.body.get("in"), Some(&json!("first")));
    assert!(first.get_local("checkpoint").await.expect("get_local").is_some());
    assert!(first.get("u:n:ds").await.expect("get").is_none(), "the data store's document is not in a database");

    for (what, other) in [("another database", &*second), ("the data-store database", data_store)] {
        assert!(other.get("u:n:one").await.expect("get").is_none(), "first's document is not in {what}");
        assert!(other.get_local("checkpoint").await.expect("get_local").is_none(), "nor its local document");
    }
    let ids: Vec<String> =
        second.all_docs(&IdRange::all(), 100, None).await.expect("all_docs").items.into_iter().map(|d| d.id).collect();
    assert_eq!(ids, Vec::<String>::new(), "the other database holds nothing");

    // The same id in two databases: two documents.
    second.put("u:n:one", &body(json!({"in": "second"})), Precondition::MustNotExist).await.expect("same id");
    let read = first.get("u:n:one").await.expect("get").expect("still there");
    assert_eq!(read.body.get("in"), Some(&json!("first")), "a write to another database changes nothing here");
    drop_all(&*catalog, &p).await;
}

pub async fn catalog_recreated_database_starts_empty(ctx: Ctx) {
    let catalog = catalog_of(&ctx).await;
    let p = unique_prefix();
    let db = name(&format!("{p}again/and$again"));
    let before = catalog.create(&db).await.expect("create");
    for n in 0..3 {
        before.put(&format!("u:n:{n}"), &body(json!({"n": n})), Precondition::MustNotExist).await.expect("put");
    }
    let rev = before.put("u:n:gone", &body(json!({})), Precondition::MustNotExist).await.expect("put");
    before.delete("u:n:gone", &rev).await.expect("delete leaves a tombstone");
    before.put_local("checkpoint", &body(json!({"seq": 3})), Precondition::None).await.expect("local");
    drop(before);

    assert!(Catalog::delete(&*catalog, &db).await.expect("drop"));
    let after = catalog.create(&db).await.expect("create again");
    for n in 0..3 {
        assert!(after.get(&format!("u:n:{n}")).await.expect("get").is_none(), "an old document is not back");
    }
    let all = after.all_docs(&IdRange::all(), 100, None).await.expect("all_docs");
    assert!(
        all.items.is_empty(),
        "the re-created database is empty: {:?}",
        all.items.iter().map(|d| &d.id).collect::<Vec<_>>()
    );
    assert!(after.get_local("checkpoint").await.expect("get_local").is_none(), "nor its local documents");
    assert!(after.revisions("u:n:gone").await.expect("revisions").is_none(), "nor its tombstones");
    // What the new database is given is its own.
    after
        .put("u:n:0", &body(json!({"n": "new"})), Precondition::MustNotExist)
        .await
        .expect("a new document, no conflict");
    let reopened = catalog.open(&db).await.expect("open").expect("exists");
    assert_eq!(reopened.get("u:n:0").await.expect("get").map(|d| d.body.get("n").cloned()), Some(Some(json!("new"))));
    assert!(Catalog::delete(&*catalog, &db).await.expect("drop what the test created"));
}

/// The body of a forwarded answer, as JSON.
async fn forwarded_json(
    backend: &dyn DocumentBackend,
    method: reqwest::Method,
    path: &str,
    body: &str,
) -> (u16, Value) {
    let request = DesignRequest {
        method,
        path: path.to_owned(),
        query: None,
        // A client's credentials, which must never reach the backend (ours go instead).
        headers: vec![
            ("content-type".into(), "application/json".into()),
            ("authorization".into(), "Basic d3Jvbmc6d3Jvbmc=".into()),
            ("cookie".into(), "AuthSession=not-ours".into()),
        ],
        body: agentstore::backend::DesignBody::Whole(bytes::Bytes::from(body.to_owned())),
    };
    let answer = backend.design_request(request).await.expect("forwarded").expect("a forwarding backend answers");
    let bytes: Vec<bytes::Bytes> = answer.body.try_collect().await.expect("the answer's body");
    let text: Vec<u8> = bytes.concat();
    (answer.status, serde_json::from_slice(&text).unwrap_or(Value::Null))
}

pub async fn catalog_databases_forward_requests_where_the_backend_does(ctx: Ctx) {
    let catalog = catalog_of(&ctx).await;
    let p = unique_prefix();
    let db = catalog.create(&name(&format!("{p}forwarded"))).await.expect("create");
    if !db.forwards_requests() {
        assert!(!ctx.backend.forwards_requests(), "the data store forwards when its databases do");
        let request = DesignRequest {
            method: reqwest::Method::GET,
            path: "_all_docs".into(),
            query: None,
            headers: Vec::new(),
            body: agentstore::backend::DesignBody::empty(),
        };
        assert!(
            db.design_request(request).await.expect("answered").is_none(),
            "a backend that does not forward says so"
        );
        drop_all(&*catalog, &p).await;
        return;
    }
    // The database itself, a document, `_all_docs`, `_bulk_docs`, `_local/`: any path below it.
    let (status, info) = forwarded_json(&*db, reqwest::Method::GET, "", "").await;
    assert_eq!((status, info.get("db_name")), (200, Some(&json!(format!("{p}forwarded")))), "{info}");
    let (status, put) = forwarded_json(&*db, reqwest::Method::PUT, "doc%2F1", r#"{"n":1}"#).await;
    assert_eq!((status, put.get("ok")), (201, Some(&json!(true))), "{put}");
    let (status, bulk) =
        forwarded_json(&*db, reqwest::Method::POST, "_bulk_docs", r#"{"docs":[{"_id":"doc2"}]}"#).await;
    assert_eq!(status, 201, "{bulk}");
    let (status, local) = forwarded_json(&*db, reqwest::Method::PUT, "_local/cp", r#"{"seq":1}"#).await;
    assert!(status == 201 || status == 200, "{status} {local}");
    let (status, all) = forwarded_json(&*db, reqwest::Method::GET, "_all_docs", "").await;
    let ids: Vec<&str> = all["rows"].as_array().into_iter().flatten().filter_map(|r| r["id"].as_str()).collect();
    assert_eq!((status, ids), (200, vec!["doc/1", "doc2"]), "{all}");
    let (status, doc) = forwarded_json(&*db, reqwest::Method::GET, "doc%2F1", "").await;
    assert_eq!((status, doc.get("n")), (200, Some(&json!(1))), "{doc}");
    // What was written through is the database's: the trait reads it too, and nothing else sees it.
    assert!(db.get("doc/1").await.expect("get").is_some());
    assert!(ctx.backend.get("doc/1").await.expect("get").is_none());
    drop_all(&*catalog, &p).await;
}
