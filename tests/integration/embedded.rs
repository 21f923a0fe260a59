//! Behaviour of the embedded (redb) backend that a backend-generic contract does not cover: the
//! one-process file lock, durability across reopening, directory creation, revisions that are
//! never reused, and paging of `query` and `scan`.

use std::collections::{BTreeSet, HashSet};
use std::path::Path;
use std::time::Duration;

use agentstore::backend::embedded::EmbeddedBackend;
use agentstore::backend::{BulkWrite, DocumentBackend, Precondition, Projection, Query, Revision, StoredDocument};
use agentstore::model::id::encode_key;
use agentstore::ErrorKind;
use serde_json::{json, Map, Value};

use crate::common::body;

fn doc_id(user: &str, namespace: &str, key: &str) -> String {
    format!("{user}:{namespace}:{}", encode_key(key))
}

async fn open(path: &Path) -> EmbeddedBackend {
    tokio::time::timeout(Duration::from_secs(10), EmbeddedBackend::open(path))
        .await
        .expect("opening the store hung")
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

/// Creates one document; returns its id and revision.
async fn create(backend: &EmbeddedBackend, user: &str, namespace: &str, key: &str, value: Value) -> (String, Revision) {
    let id = doc_id(user, namespace, key);
    let rev = backend
        .put(&id, &body(user, namespace, key, value), Precondition::MustNotExist)
        .await
        .unwrap_or_else(|e| panic!("create {id}: {e}"));
    (id, rev)
}

/// Writes many new documents in one bulk request; every write must succeed.
async fn create_many(backend: &EmbeddedBackend, docs: &[(String, String, String)]) {
    let writes = docs
        .iter()
        .map(|(user, namespace, key)| BulkWrite {
            id: doc_id(user, namespace, key),
            body: body(user, namespace, key, json!(key)),
            precondition: Precondition::MustNotExist,
        })
        .collect();
    let results = backend.bulk_write(writes).await.expect("bulk write");
    assert_eq!(results.len(), docs.len());
    for (result, doc) in results.into_iter().zip(docs) {
        result.unwrap_or_else(|e| panic!("bulk write of {doc:?}: {e}"));
    }
}

fn query(user: &str, namespace: Option<&str>) -> Query {
    Query { user_id: user.to_owned(), namespace: namespace.map(str::to_owned), projection: Projection::All }
}

/// Follows page tokens from `start` to the end; returns every page.
async fn query_pages(
    backend: &EmbeddedBackend,
    q: &Query,
    limit: usize,
    start: Option<String>,
) -> Vec<(Vec<StoredDocument>, Option<String>)> {
    let mut pages = Vec::new();
    let mut token = start;
    loop {
        let page = backend
            .query(q, limit, token.as_deref())
            .await
            .unwrap_or_else(|e| panic!("query {q:?} limit {limit} after {token:?}: {e}"));
        assert!(page.items.len() <= limit, "a page of {} items for limit {limit}", page.items.len());
        let next = page.next.clone();
        pages.push((page.items, page.next));
        match next {
            None => return pages,
            Some(next) => {
                assert_ne!(token.as_deref(), Some(next.as_str()), "token did not move");
                assert!(pages.len() <= 10_000, "paging does not end");
                token = Some(next);
            }
        }
    }
}

fn ids(docs: &[StoredDocument]) -> Vec<String> {
    docs.iter().map(|d| d.id.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_file_twice_in_one_process_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.redb");
    let first = open(&path).await;

    let second = tokio::time::timeout(Duration::from_secs(5), EmbeddedBackend::open(&path))
        .await
        .expect("a second open waited instead of failing");
    let err = match second {
        Ok(_) => panic!("the same file opened twice"),
        Err(err) => err,
    };
    assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");
    assert!(err.to_string().contains("already open"), "{err}");
    assert!(err.to_string().contains("store.redb"), "{err}");

    // The refused open did not disturb the first.
    create(&first, "u", "ns", "k", json!(1)).await;
    assert!(first.get(&doc_id("u", "ns", "k")).await.unwrap().is_some());

    // Once the first is closed, the file opens again.
    drop(first);
    let reopened = open(&path).await;
    assert!(reopened.get(&doc_id("u", "ns", "k")).await.unwrap().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_survives_closing_and_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.redb");
    let (kept_id, kept_rev, gone_id, updated_id, updated_rev) = {
        let backend = open(&path).await;
        let (kept_id, kept_rev) = create(&backend, "u", "ns", "kept", json!({"n": 1.5})).await;
        let (gone_id, gone_rev) = create(&backend, "u", "ns", "gone", json!(2)).await;
        backend.delete(&gone_id, &gone_rev).await.unwrap();
        let (updated_id, first_rev) = create(&backend, "u", "other", "updated", json!(3)).await;
        let updated_rev = backend
            .put(&updated_id, &body("u", "other", "updated", json!("new")), Precondition::MatchRevision(first_rev))
            .await
            .unwrap();
        (kept_id, kept_rev, gone_id, updated_id, updated_rev)
    };

    let backend = open(&path).await;
    let kept = backend.get(&kept_id).await.unwrap().expect("kept document");
    assert_eq!(kept.rev, kept_rev);
    assert_eq!(kept.body, body("u", "ns", "kept", json!({"n": 1.5})));
    assert!(backend.get(&gone_id).await.unwrap().is_none());
    let updated = backend.get(&updated_id).await.unwrap().expect("updated");
    assert_eq!(updated.rev, updated_rev);
    assert_eq!(updated.body["value"], json!("new"));

    // The index came back too.
    let page = backend.query(&query("u", None), 100, None).await.unwrap();
    let mut found = ids(&page.items);
    found.sort();
    let mut expected = vec![kept_id.clone(), updated_id.clone()];
    expected.sort();
    assert_eq!(found, expected);
    assert_eq!(page.next, None);
    let page = backend.scan(100, None).await.unwrap();
    assert_eq!(page.items.len(), 2);
    // The count progress estimates use is exact here: two documents, the deleted one not counted.
    assert_eq!(backend.approximate_count().await.unwrap(), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parent_directories_are_created() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a").join("b").join("c").join("store.redb");
    assert!(!dir.path().join("a").exists());
    let backend = open(&path).await;
    assert!(path.is_file(), "{} was not created", path.display());
    let (id, _) = create(&backend, "u", "ns", "k", json!("v")).await;
    assert_eq!(backend.get(&id).await.unwrap().unwrap().body["value"], json!("v"));
    assert!(backend.describe().contains("store.redb"));
    backend.health().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revisions_are_never_reused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.redb");
    let id = doc_id("u", "ns", "k");
    let mut seen: HashSet<String> = HashSet::new();
    let mut remember = |rev: &Revision| {
        assert!(seen.insert(rev.0.clone()), "revision {rev} handed out twice");
    };

    let stale = {
        let backend = open(&path).await;
        let (_, first) = create(&backend, "u", "ns", "k", json!(1)).await;
        remember(&first);
        backend.delete(&id, &first).await.unwrap();
        let (_, second) = create(&backend, "u", "ns", "k", json!(2)).await;
        remember(&second);
        assert_ne!(first, second);
        // The revision from before the delete no longer matches anything.
        let err = backend
            .put(&id, &body("u", "ns", "k", json!("stale")), Precondition::MatchRevision(first.clone()))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
        let err = backend.delete(&id, &first).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
        let (_, other) = create(&backend, "u", "ns", "other", json!(0)).await;
        remember(&other);
        backend.delete(&id, &second).await.unwrap();
        second
    };

    // The counter survives reopening: a recreated document gets a fresh revision still.
    let backend = open(&path).await;
    let (_, third) = create(&backend, "u", "ns", "k", json!(3)).await;
    remember(&third);
    let err =
        backend.put(&id, &body("u", "ns", "k", json!("stale")), Precondition::MatchRevision(stale)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    let fourth = backend.put(&id, &body("u", "ns", "k", json!(4)), Precondition::MatchRevision(third)).await.unwrap();
    remember(&fourth);
    let overwritten = backend.put(&id, &body("u", "ns", "k", json!(5)), Precondition::None).await.unwrap();
    remember(&overwritten);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_finds_a_users_few_documents_among_many() {
    let dir = tempfile::tempdir().unwrap();
    let backend = open(&dir.path().join("store.redb")).await;

    // 5,000 other users, including ones whose ids start with the target's ("user_2500"…).
    let others: Vec<(String, String, String)> = (0..5000)
        .map(|i| {
            let namespace = if i % 2 == 0 { "default" } else { "files:x" };
            (format!("user_{i:04}"), namespace.to_owned(), format!("k{i}"))
        })
        .collect();
    create_many(&backend, &others).await;
    let target = "user_250";
    let mine = [(target, "default", "a"), (target, "default", "b"), (target, "files:x", "c")];
    for (user, namespace, key) in mine {
        create(&backend, user, namespace, key, json!(key)).await;
    }

    let page = backend.query(&query(target, None), 1000, None).await.unwrap();
    let found: BTreeSet<String> = ids(&page.items).into_iter().collect();
    let expected: BTreeSet<String> = mine.iter().map(|(user, namespace, key)| doc_id(user, namespace, key)).collect();
    assert_eq!(found, expected);
    assert_eq!(page.items.len(), 3, "duplicates in {:?}", ids(&page.items));
    assert_eq!(page.next, None);
    for doc in &page.items {
        assert_eq!(doc.body["userId"], json!(target));
        assert_eq!(doc.body["value"], doc.body["key"]);
    }

    let page = backend.query(&query(target, Some("default")), 1000, None).await.unwrap();
    let mut found = ids(&page.items);
    found.sort();
    assert_eq!(found, [doc_id(target, "default", "a"), doc_id(target, "default", "b")]);
    assert_eq!(page.next, None);

    let page = backend.query(&query(target, Some("files:x")), 1000, None).await.unwrap();
    assert_eq!(ids(&page.items), [doc_id(target, "files:x", "c")]);

    // A limit of exactly the result size gives one page with no token.
    let page = backend.query(&query(target, None), 3, None).await.unwrap();
    assert_eq!(page.items.len(), 3);
    assert_eq!(page.next, None);

    // Projection keeps only the asked-for fields.
    let projected = Query { projection: Projection::Fields(vec!["key"]), ..query(target, None) };
    let page = backend.query(&projected, 1000, None).await.unwrap();
    assert_eq!(page.items.len(), 3);
    for doc in &page.items {
        assert_eq!(doc.body.keys().collect::<Vec<_>>(), ["key"], "{:?}", doc.body);
    }

    // Nothing for users or namespaces that have nothing.
    for q in [
        query("user_25", None),
        query("user_2500x", None),
        query(target, Some("defaul")),
        query(target, Some("files:x2")),
        query("nobody", Some("default")),
    ] {
        let page = backend.query(&q, 1000, None).await.unwrap();
        assert!(page.items.is_empty(), "{q:?}: {:?}", ids(&page.items));
        assert_eq!(page.next, None);
    }
    // A neighbour still has exactly its one document.
    let page = backend.query(&query("user_2500", None), 1000, None).await.unwrap();
    assert_eq!(ids(&page.items), [doc_id("user_2500", "default", "k2500")]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_page_tokens_resume_without_duplicates_or_omissions() {
    let dir = tempfile::tempdir().unwrap();
    let backend = open(&dir.path().join("store.redb")).await;
    let target = "pager";
    let mine: Vec<(String, String, String)> = [("a", 3), ("b", 2), ("b:c", 1), ("c", 2)]
        .iter()
        .flat_map(|&(namespace, n)| (0..n).map(move |i| (target.to_owned(), namespace.to_owned(), format!("key-{i}"))))
        .collect();
    // Neighbours on both sides, in the same namespaces.
    let neighbours: Vec<(String, String, String)> = ["page", "pagep", "pagerx", "pages"]
        .iter()
        .flat_map(|user| ["a", "b", "c"].iter().map(move |ns| (user.to_string(), ns.to_string(), "key-0".to_owned())))
        .collect();
    create_many(&backend, &neighbours).await;
    create_many(&backend, &mine).await;

    let expected = |namespace: Option<&str>| -> BTreeSet<String> {
        mine.iter().filter(|(_, ns, _)| namespace.is_none_or(|n| n == ns)).map(|(u, ns, k)| doc_id(u, ns, k)).collect()
    };

    for namespace in [None, Some("a"), Some("b"), Some("b:c"), Some("c")] {
        let q = query(target, namespace);
        let want = expected(namespace);
        for limit in [1, 2, 3, 7, 8, 100] {
            let pages = query_pages(&backend, &q, limit, None).await;
            let all: Vec<String> = pages.iter().flat_map(|(items, _)| ids(items)).collect();
            let distinct: BTreeSet<String> = all.iter().cloned().collect();
            assert_eq!(distinct.len(), all.len(), "{namespace:?} limit {limit}: duplicates in {all:?}");
            assert_eq!(distinct, want, "{namespace:?} limit {limit}");
            assert_eq!(
                pages.len(),
                want.len().div_ceil(limit).max(1),
                "{namespace:?} limit {limit}: pages {:?}",
                pages.iter().map(|(items, _)| ids(items)).collect::<Vec<_>>()
            );

            // Every token resumes, on its own, with exactly the documents not yet returned.
            let mut returned = 0;
            for (items, next) in &pages {
                returned += items.len();
                let Some(token) = next else { continue };
                let rest: Vec<String> = query_pages(&backend, &q, limit, Some(token.clone()))
                    .await
                    .iter()
                    .flat_map(|(items, _)| ids(items))
                    .collect();
                assert_eq!(rest, all[returned..], "{namespace:?} limit {limit}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_token_survives_changes_between_pages() {
    let dir = tempfile::tempdir().unwrap();
    let backend = open(&dir.path().join("store.redb")).await;
    let mut revs = Vec::new();
    for key in ["k0", "k1", "k2", "k3"] {
        revs.push(create(&backend, "u", "ns", key, json!(key)).await);
    }
    let q = query("u", Some("ns"));
    let first = backend.query(&q, 2, None).await.unwrap();
    let first_ids = ids(&first.items);
    assert_eq!(first_ids.len(), 2);
    let token = first.next.expect("a second page");

    // Delete the last document returned and rewrite one not yet returned.
    let last = first.items.last().unwrap();
    backend.delete(&last.id, &last.rev).await.unwrap();
    let rest_ids: Vec<String> = revs.iter().map(|(id, _)| id.clone()).filter(|id| !first_ids.contains(id)).collect();
    let (rewrite, rewrite_rev) = revs.iter().find(|(id, _)| *id == rest_ids[0]).unwrap();
    backend
        .put(rewrite, &body("u", "ns", "rewritten", json!("new")), Precondition::MatchRevision(rewrite_rev.clone()))
        .await
        .unwrap();

    let rest: BTreeSet<String> =
        query_pages(&backend, &q, 2, Some(token)).await.iter().flat_map(|(items, _)| ids(items)).collect();
    assert_eq!(rest, rest_ids.into_iter().collect());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_page_token_is_invalid_input() {
    let dir = tempfile::tempdir().unwrap();
    let backend = open(&dir.path().join("store.redb")).await;
    create(&backend, "u", "ns", "k", json!(1)).await;
    let err = backend.query(&query("u", None), 10, Some("not a token")).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scan_pages_through_every_document_in_id_order() {
    let dir = tempfile::tempdir().unwrap();
    let backend = open(&dir.path().join("store.redb")).await;
    let docs: Vec<(String, String, String)> =
        (0..50).map(|i| (format!("user{}", i % 4), format!("ns{}", i % 3), format!("key {i}"))).collect();
    create_many(&backend, &docs).await;
    let mut sorted: Vec<String> = docs.iter().map(|(u, ns, k)| doc_id(u, ns, k)).collect();
    sorted.sort();

    let mut pages = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let page = backend.scan(7, token.as_deref()).await.unwrap();
        assert!(page.items.len() <= 7);
        pages.push((ids(&page.items), page.next.clone()));
        match page.next {
            None => break,
            Some(next) => {
                assert!(pages.len() <= 50, "scan does not end");
                token = Some(next);
            }
        }
    }
    let all: Vec<String> = pages.iter().flat_map(|(items, _)| items.clone()).collect();
    assert_eq!(all, sorted, "not every document once, in id order");
    assert_eq!(pages.len(), 8, "{pages:?}");

    // Every token, used again later, resumes right after the page it ended.
    let mut returned = 0;
    for (items, next) in &pages {
        returned += items.len();
        let Some(token) = next else { continue };
        let mut rest = Vec::new();
        let mut token = Some(token.clone());
        while let Some(current) = token {
            let page = backend.scan(7, Some(&current)).await.unwrap();
            rest.extend(ids(&page.items));
            token = page.next;
        }
        assert_eq!(rest, sorted[returned..]);
    }

    // The bodies come back whole.
    let page = backend.scan(50, None).await.unwrap();
    assert_eq!(page.items.len(), 50);
    assert_eq!(page.next, None);
    for doc in page.items {
        let parsed = agentstore::model::DocumentId::parse(&doc.id).unwrap();
        assert_eq!(doc.body, body(parsed.user_id(), parsed.namespace(), parsed.key(), json!(parsed.key())));
    }
}

/// A replicated revision replaces the stored one in the `(userId, namespace)` index too (a body
/// may move to another namespace), a replicated tombstone leaves it, and the stored ancestry is
/// cut to the store's `revs_limit`.
#[tokio::test]
async fn replicated_writes_keep_the_index_and_cut_the_ancestry() {
    use agentstore::backend::embedded::EmbeddedOptions;
    use agentstore::backend::{ReplicatedOutcome, ReplicatedRevision};
    let dir = tempfile::tempdir().unwrap();
    let backend = EmbeddedBackend::open_with(
        &dir.path().join("store.redb"),
        EmbeddedOptions { revs_limit: 2, ..Default::default() },
    )
    .await
    .unwrap();
    let (id, first) = create(&backend, "u", "old", "k", json!(1)).await;
    let ancestry: Vec<String> =
        (2..=4).rev().map(|g| format!("{g}-{}", format!("{g:x}").repeat(32))).chain([first.0.clone()]).collect();
    let incoming = ReplicatedRevision {
        rev: Revision(ancestry[0].clone()),
        ancestry: ancestry.clone(),
        deleted: false,
        body: body("u", "new", "k", json!(4)),

        precondition: agentstore::backend::Precondition::None,
    };
    assert_eq!(backend.put_replicated(&id, &incoming).await.unwrap(), ReplicatedOutcome::Applied);
    let query =
        |namespace: &str| Query { user_id: "u".into(), namespace: Some(namespace.into()), projection: Projection::All };
    assert!(backend.query(&query("old"), 10, None).await.unwrap().items.is_empty(), "left the old namespace");
    let found = backend.query(&query("new"), 10, None).await.unwrap().items;
    assert_eq!(found.iter().map(|d| &d.rev).collect::<Vec<_>>(), [&incoming.rev], "indexed under the new one");
    let info = backend.revisions(&id).await.unwrap().unwrap();
    let kept: Vec<String> = info.ancestry.revisions().map(|r| r.0).collect();
    assert_eq!(kept, ancestry[..2], "the replicated ancestry, cut to revs_limit=2");

    let tombstone = ReplicatedRevision {
        rev: Revision(format!("5-{}", "5".repeat(32))),
        ancestry: vec![format!("5-{}", "5".repeat(32)), ancestry[0].clone()],
        deleted: true,
        body: Map::new(),

        precondition: agentstore::backend::Precondition::None,
    };
    assert_eq!(backend.put_replicated(&id, &tombstone).await.unwrap(), ReplicatedOutcome::Applied);
    assert!(backend.query(&query("new"), 10, None).await.unwrap().items.is_empty(), "a tombstone is not indexed");
    assert!(backend.revisions(&id).await.unwrap().unwrap().deleted);
}
