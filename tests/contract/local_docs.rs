//! Listing local documents (`DocumentBackend::local_docs`, CouchDB's `_local_docs`) on every
//! backend: name order in raw UTF-8 bytes both ways, ranges with inclusive and exclusive ends,
//! paging with the backend's tokens, bodies and `0-N` revisions, documents never listed, and
//! deleted local documents gone. Also a CouchDB database's listing ([`Database::local_docs`]):
//! its clients' local documents only, never the engine's own.

use std::sync::Arc;

use agentstore::backend::{DocumentBackend, IdRange, Precondition, StoredDocument};
use agentstore::database::{Database, Write};
use agentstore::ErrorKind;
use serde_json::{json, Map, Value};

use crate::harness::Ctx;

fn body(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        other => panic!("expected an object, got {other}"),
    }
}

fn range(start: Option<&str>, end: Option<&str>, inclusive_end: bool, descending: bool) -> IdRange {
    IdRange {
        start: start.map(str::to_owned),
        end: end.map(str::to_owned),
        inclusive_end,
        descending,
        include_design: false,
    }
}

/// Every page of a listing, each at most `limit` long, to the end.
async fn every_page(b: &dyn DocumentBackend, range: &IdRange, limit: usize) -> Vec<StoredDocument> {
    let (mut listed, mut token) = (Vec::new(), None::<String>);
    for _ in 0..100 {
        let page = b.local_docs(range, limit, token.as_deref()).await.expect("local_docs");
        assert!(page.items.len() <= limit, "a page of {} where {limit} were asked", page.items.len());
        listed.extend(page.items);
        token = page.next;
        if token.is_none() {
            return listed;
        }
    }
    panic!("local_docs kept paging");
}

async fn names(b: &dyn DocumentBackend, range: &IdRange, limit: usize) -> Vec<String> {
    every_page(b, range, limit).await.into_iter().map(|doc| doc.id).collect()
}

fn ids(names: &[&str]) -> Vec<String> {
    names.iter().map(|name| format!("_local/{name}")).collect()
}

/// On a test server without a listing (`Ctx::no_local_listing`), checks that the listing is
/// refused with an error naming `_local_docs`, and returns `true`.
async fn listing_refused(ctx: &Ctx) -> bool {
    let Some(why) = &ctx.no_local_listing else { return false };
    let refused = ctx.backend.local_docs(&IdRange::all(), 10, None).await.expect_err("a listing it cannot make");
    assert_eq!(refused.kind(), ErrorKind::Misconfigured, "{refused}");
    assert!(refused.to_string().contains("_local_docs"), "the refusal says why: {refused}");
    println!("{}: local listing refused as it must be: {why}", ctx.backend_name);
    true
}

pub async fn local_docs_list_names_in_order_by_range_and_page(ctx: Ctx) {
    let b = ctx.backend.as_ref();
    // Written out of order; "é" (bytes C3 A9) sorts after every ASCII name, "Z" before "a".
    let written = ["x:2", "b", "é", "a", "x;", "Z", "c", "x:1"];
    for (n, name) in written.iter().enumerate() {
        b.put_local(name, &body(json!({ "n": n })), Precondition::MustNotExist).await.expect("put_local");
    }
    let updated = b.put_local("c", &body(json!({ "n": "again" })), Precondition::None).await.expect("rewrite");
    assert_eq!(updated.as_str(), "0-2");
    // A document beside them is no local document.
    b.put(
        "u:ns:a2V5",
        &body(json!({ "userId": "u", "namespace": "ns", "key": "key", "value": 1 })),
        Precondition::None,
    )
    .await
    .expect("put");
    if listing_refused(&ctx).await {
        return;
    }
    let ascending = ["Z", "a", "b", "c", "x:1", "x:2", "x;", "é"];
    let descending: Vec<&str> = ascending.iter().rev().copied().collect();
    for limit in [1, 3, 100] {
        assert_eq!(names(b, &IdRange::all(), limit).await, ids(&ascending), "ascending, pages of {limit}");
        let all_down = range(None, None, true, true);
        assert_eq!(names(b, &all_down, limit).await, ids(&descending), "descending, pages of {limit}");
    }
    let listed = every_page(b, &range(Some("c"), Some("c"), true, false), 10).await;
    assert_eq!(listed.len(), 1);
    assert_eq!((listed[0].id.as_str(), listed[0].rev.as_str()), ("_local/c", "0-2"));
    assert_eq!(listed[0].body, body(json!({ "n": "again" })), "the listing carries the body");
    let first = every_page(b, &range(Some("x:2"), None, true, false), 1).await;
    assert_eq!((first[0].rev.as_str(), &first[0].body), ("0-1", &body(json!({ "n": 0 }))));

    // Ranges: both ends, in both directions, with inclusive and exclusive ends.
    let cases = [
        (range(Some("b"), Some("x:2"), true, false), vec!["b", "c", "x:1", "x:2"]),
        (range(Some("b"), Some("x:2"), false, false), vec!["b", "c", "x:1"]),
        (range(Some("bb"), Some("x:1"), true, false), vec!["c", "x:1"]),
        (range(Some("x:2"), Some("b"), true, true), vec!["x:2", "x:1", "c", "b"]),
        (range(Some("x:2"), Some("b"), false, true), vec!["x:2", "x:1", "c"]),
        (range(Some("x:"), Some("x;"), false, false), vec!["x:1", "x:2"]),
        (range(Some("x;"), Some("x:"), true, true), vec!["x;", "x:2", "x:1"]),
        (range(Some("d"), None, true, false), vec!["x:1", "x:2", "x;", "é"]),
        (range(None, Some("b"), true, false), vec!["Z", "a", "b"]),
        (range(Some("b"), None, true, true), vec!["b", "a", "Z"]),
        (range(Some(""), None, true, false), ascending.to_vec()),
        (range(Some("c"), Some("b"), true, false), vec![]),
        (range(Some("b"), Some("c"), true, true), vec![]),
        (range(Some("c"), Some("c"), false, false), vec![]),
        (range(Some("zz"), None, true, false), vec!["é"]),
        (range(Some("{"), Some("~"), true, false), vec![]),
    ];
    for (asked, expected) in &cases {
        for limit in [1, 2, 50] {
            assert_eq!(names(b, asked, limit).await, ids(expected), "{asked:?}, pages of {limit}");
        }
    }

    // Deleted local documents are gone from every listing.
    for name in ["c", "x:1", "Z"] {
        let current = b.get_local(name).await.expect("get_local").expect("there");
        b.delete_local(name, &current.rev).await.expect("delete_local");
    }
    let left = ["a", "b", "x:2", "x;", "é"];
    assert_eq!(names(b, &IdRange::all(), 2).await, ids(&left));
    assert_eq!(names(b, &range(Some("b"), Some("x:2"), true, false), 1).await, ids(&["b", "x:2"]));
    assert_eq!(names(b, &range(None, None, true, true), 2).await, ids(&["é", "x;", "x:2", "b", "a"]));
    // Re-created, it is listed again, starting over at 0-1.
    b.put_local("c", &body(json!({ "n": "new" })), Precondition::MustNotExist).await.expect("re-create");
    let again = every_page(b, &range(Some("c"), Some("c"), true, false), 5).await;
    assert_eq!(again.iter().map(|d| (d.id.as_str(), d.rev.as_str())).collect::<Vec<_>>(), [("_local/c", "0-1")]);
}

pub async fn local_docs_of_a_database_are_its_clients_only(ctx: Ctx) {
    let db = Arc::new(Database::new("contract".into(), Arc::clone(&ctx.backend)));
    // A deleted document leaves its revision tree in an engine local; settings are one too.
    let edit = |deleted: bool, parent: Option<String>| Write::Edit { parent, deleted, body: body(json!({})) };
    let written = db.write("gone", &edit(false, None)).await.expect("write");
    let rev = match written {
        agentstore::database::Written::Edited(rev) => rev,
        other => panic!("an edit answered {other:?}"),
    };
    db.write("gone", &edit(true, Some(rev))).await.expect("delete");
    db.update_settings(|settings| settings.revs_limit = 7).await.expect("settings");
    for name in ["cp-b", "cp-a", "tree:x"] {
        db.put_local(name, &body(json!({ "name": name })), 1).await.expect("client local");
    }
    if listing_refused(&ctx).await {
        return;
    }
    let clients = ids(&["cp-a", "cp-b", "tree:x"]);
    for limit in [1, 2, 10] {
        let (mut listed, mut token) = (Vec::new(), None::<String>);
        loop {
            let page = db.local_docs(&IdRange::all(), limit, token.as_deref()).await.expect("local_docs");
            listed.extend(page.items.into_iter().map(|doc| doc.id));
            token = page.next;
            if token.is_none() {
                break;
            }
        }
        assert_eq!(listed, clients, "only the clients' local documents, by their names, pages of {limit}");
    }
    let down = db.local_docs(&range(None, None, true, true), 10, None).await.expect("descending");
    let down: Vec<String> = down.items.into_iter().map(|doc| doc.id).collect();
    assert_eq!(down, clients.iter().rev().cloned().collect::<Vec<_>>());
    let one = db.local_docs(&range(Some("cp-b"), Some("cp-b"), true, false), 10, None).await.expect("one");
    assert_eq!(one.items.len(), 1);
    assert_eq!(one.items[0].body, body(json!({ "name": "cp-b" })));
    assert_eq!(db.get_local("cp-a").await.expect("get").map(|doc| doc.rev.0), Some("0-1".to_owned()));
    assert!(db.delete_local("cp-a").await.expect("delete"), "there was one to delete");
    let left = db.local_docs(&IdRange::all(), 10, None).await.expect("after the deletion");
    assert_eq!(left.items.into_iter().map(|doc| doc.id).collect::<Vec<_>>(), ids(&["cp-b", "tree:x"]));
}
