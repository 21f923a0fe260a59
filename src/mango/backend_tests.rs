//! `_find`, `_index` and `_explain` against the embedded backend: the CouchDB 3.4.3 transcripts
//! replayed over the same documents, and paging, sorting and per-user filtering over a few
//! hundred generated documents.

use std::collections::HashSet;
use std::path::PathBuf;

use serde_json::{json, Map, Value};

use super::index::{IndexCatalog, STANDARD_INDEX_DDOC};
use super::{create_index, delete_index, explain, find, find_with_limits, list_indexes, FindLimits};
use crate::backend::embedded::EmbeddedBackend;
use crate::backend::{DocumentBackend, Precondition};
use crate::database::data_store_rules::Confinement;

fn fixture(name: &str) -> Value {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures").join("couchdb-3.4.3");
    let file = std::fs::read_dir(&dir)
        .expect("fixtures dir")
        .filter_map(|e| e.ok())
        .find(|e| e.file_name().to_string_lossy().starts_with(name))
        .unwrap_or_else(|| panic!("fixture {name}"));
    serde_json::from_str(&std::fs::read_to_string(file.path()).expect("read fixture")).expect("fixture JSON")
}

async fn open() -> (tempfile::TempDir, EmbeddedBackend) {
    let dir = tempfile::tempdir().expect("temp dir");
    let backend = EmbeddedBackend::open(&dir.path().join("store.redb")).await.expect("open embedded store");
    backend.ensure_standard_indexes().await.expect("indexes");
    (dir, backend)
}

async fn put(backend: &EmbeddedBackend, doc: &Value) {
    let mut body: Map<String, Value> = doc.as_object().expect("object").clone();
    let id = body.remove("_id").and_then(|v| v.as_str().map(str::to_owned)).expect("_id");
    if let Some(ns) = body.get("namespace").and_then(Value::as_str) {
        backend.ensure_namespace_indexed(ns).await.expect("namespace index");
    }
    backend.put(&id, &body, Precondition::MustNotExist).await.expect("put");
}

/// The store the transcripts were recorded against: fixture 024's documents and 025's new one.
async fn fixture_store() -> (tempfile::TempDir, EmbeddedBackend) {
    let (dir, backend) = open().await;
    for doc in fixture("024")["request"]["body"]["docs"].as_array().expect("docs") {
        put(&backend, doc).await;
    }
    put(&backend, &fixture("025")["request"]["body"]["docs"][1]).await;
    (dir, backend)
}

async fn run(backend: &EmbeddedBackend, request: &Value) -> Result<Value, super::MangoError> {
    let catalog = IndexCatalog::load(backend).await.expect("catalog");
    find(backend, request, &Confinement::Everything, &catalog).await
}

fn without_revs(docs: &Value) -> Value {
    let mut docs = docs.clone();
    for doc in docs.as_array_mut().expect("docs array") {
        if let Some(doc) = doc.as_object_mut() {
            doc.remove("_rev");
        }
    }
    docs
}

/// Replays a `_find` transcript: the same documents, in the same order, and the same warning.
async fn replay(backend: &EmbeddedBackend, name: &str, request_override: Option<Value>) -> Value {
    let transcript = fixture(name);
    let request = request_override.unwrap_or_else(|| transcript["request"]["body"].clone());
    let answer = run(backend, &request).await.unwrap_or_else(|e| panic!("{name}: {e}"));
    let expected = &transcript["response"]["body"];
    // Revisions are each backend's own; everything else is CouchDB's.
    assert_eq!(without_revs(&answer["docs"]), without_revs(&expected["docs"]), "{name}: docs");
    assert!(answer["bookmark"].is_string(), "{name}: bookmark");
    answer
}

#[tokio::test]
async fn transcripts_026_to_033_return_couchdb_documents() {
    let (_dir, backend) = fixture_store().await;
    let first = replay(&backend, "026", None).await;
    assert!(first.get("warning").is_none(), "the built-in index serves userId + namespace");
    // 027-030: pages of 12 with the bookmark this server returned, until an empty page.
    let mut bookmark = Value::Null;
    for name in ["027", "028", "029", "030"] {
        let mut request = fixture(name)["request"]["body"].clone();
        request.as_object_mut().unwrap().remove("bookmark");
        if !bookmark.is_null() {
            request["bookmark"] = bookmark.clone();
        }
        let answer = replay(&backend, name, Some(request)).await;
        bookmark = answer["bookmark"].clone();
    }
    let namespaces = replay(&backend, "031", None).await;
    assert_eq!(namespaces["warning"], fixture("031")["response"]["body"]["warning"]);
    replay(&backend, "032", None).await;
    replay(&backend, "033", None).await;
}

#[tokio::test]
async fn transcript_034_execution_stats_shape() {
    let (_dir, backend) = fixture_store().await;
    let answer = replay(&backend, "034", None).await;
    let stats = answer["execution_stats"].as_object().expect("execution_stats");
    let expected = fixture("034")["response"]["body"]["execution_stats"].as_object().unwrap().clone();
    assert_eq!(stats.keys().collect::<Vec<_>>(), expected.keys().collect::<Vec<_>>());
    assert_eq!(stats["results_returned"], json!(5));
}

#[tokio::test]
async fn transcripts_035_to_038_errors() {
    let (_dir, backend) = fixture_store().await;
    for name in ["035", "036", "037", "038"] {
        let transcript = fixture(name);
        let error = run(&backend, &transcript["request"]["body"]).await.expect_err(name).refusal();
        assert_eq!(error.status.as_u16() as u64, transcript["response"]["status"].as_u64().unwrap(), "{name}");
        assert_eq!(error.to_json(), transcript["response"]["body"], "{name}");
    }
}

#[tokio::test]
async fn transcripts_039_and_045_full_scan_warning_and_no_design_docs() {
    let (_dir, backend) = fixture_store().await;
    let answer = replay(&backend, "039", None).await;
    assert_eq!(answer["warning"], fixture("039")["response"]["body"]["warning"]);
    // A design document that would match the selector is never returned (fixture 045).
    let mut body = Map::new();
    body.insert("userId".into(), json!("user_456"));
    body.insert("namespace".into(), json!("notes"));
    backend.put("_design/legacy", &body, Precondition::MustNotExist).await.expect("put design doc");
    let answer = replay(&backend, "045", None).await;
    let warning = answer["warning"].as_str().expect("warning");
    assert!(warning.starts_with("No matching index found"), "{warning}");
    let all =
        run(&backend, &json!({"selector": {"namespace": "notes"}, "fields": ["_id"], "limit": 1000})).await.unwrap();
    assert!(all["docs"].as_array().unwrap().iter().all(|d| !d["_id"].as_str().unwrap().starts_with("_design/")));
}

#[tokio::test]
async fn index_listing_creation_and_deletion_follow_transcripts_010_to_012() {
    let (_dir, backend) = open().await;
    assert_eq!(list_indexes(&backend).await.unwrap(), fixture("012")["response"]["body"]);
    // Legacy JavaScript design documents are not Mango indexes (fixture 044).
    assert_eq!(list_indexes(&backend).await.unwrap(), fixture("044")["response"]["body"]);
    // The built-in index exists already, so creating it again is fixture 011's answer.
    let again = create_index(&backend, &fixture("011")["request"]["body"]).await.unwrap();
    assert_eq!(again, fixture("011")["response"]["body"]);

    let created =
        create_index(&backend, &json!({"index": {"fields": ["n"]}, "name": "by-n", "type": "json"})).await.unwrap();
    assert_eq!(created["result"], "created");
    let ddoc = created["id"].as_str().unwrap().to_owned();
    assert!(ddoc.starts_with("_design/") && ddoc != STANDARD_INDEX_DDOC);
    let exists = create_index(&backend, &json!({"index": {"fields": ["n"]}, "name": "by-n"})).await.unwrap();
    assert_eq!(exists["result"], "exists");
    let listed = list_indexes(&backend).await.unwrap();
    assert_eq!(listed["total_rows"], 3);
    assert_eq!(listed["indexes"][2]["def"]["fields"], json!([{"n": "asc"}]));
    // Kept in a local document: a fresh load sees it.
    assert_eq!(IndexCatalog::load(&backend).await.unwrap().indexes.len(), 2);

    assert_eq!(delete_index(&backend, &ddoc, "by-n").await.unwrap(), json!({"ok": true}));
    assert_eq!(delete_index(&backend, &ddoc, "by-n").await.unwrap_err().refusal().status.as_u16(), 404);
    assert_eq!(
        delete_index(&backend, STANDARD_INDEX_DDOC, "idx-user-namespace").await.unwrap_err().refusal().status.as_u16(),
        403
    );
    assert_eq!(list_indexes(&backend).await.unwrap(), fixture("012")["response"]["body"]);

    let missing = create_index(&backend, &json!({"name": "x"})).await.unwrap_err().refusal();
    assert_eq!(
        (missing.error.as_str(), missing.reason.as_str()),
        ("missing_required_key", "Missing required key: index")
    );
}

#[tokio::test]
async fn explain_matches_transcript_040() {
    let (_dir, backend) = fixture_store().await;
    let transcript = fixture("040");
    let answer = explain(&backend, &transcript["request"]["body"], crate::model::COLLECTION).await.unwrap();
    let expected = &transcript["response"]["body"];
    for key in [
        "dbname",
        "index",
        "partitioned",
        "selector",
        "opts",
        "limit",
        "skip",
        "fields",
        "index_candidates",
        "selector_hints",
        "mrargs",
        "covering",
    ] {
        assert_eq!(answer[key], expected[key], "{key}");
    }
}

/// A few hundred documents over three users and four namespaces, with a number `n`.
async fn generated_store() -> (tempfile::TempDir, EmbeddedBackend, Vec<Value>) {
    let (dir, backend) = open().await;
    let mut docs = Vec::new();
    for i in 0..360u32 {
        let user = format!("user_{}", i % 3);
        let namespace = format!("ns{}", i % 4);
        let key = format!("k{i:04}");
        let mut doc = json!({
            "_id": format!("{user}:{namespace}:{}", crate::model::id::encode_key(&key)),
            "userId": user, "namespace": namespace, "key": key, "n": (i * 7919) % 1000,
            "tags": if i % 5 == 0 { json!(["five"]) } else { json!([]) },
        });
        if i % 10 == 0 {
            doc.as_object_mut().unwrap().remove("n");
        }
        put(&backend, &doc).await;
        docs.push(doc);
    }
    (dir, backend, docs)
}

/// Follows bookmarks until a short page, as aiocouch does; returns the ids in order.
async fn page_through(backend: &EmbeddedBackend, mut request: Value, only_user: Option<&str>) -> Vec<String> {
    let catalog = IndexCatalog::load(backend).await.unwrap();
    let limit = request["limit"].as_u64().unwrap() as usize;
    let mut ids = Vec::new();
    for _ in 0..1000 {
        let answer = find(
            backend,
            &request,
            &only_user.map_or(Confinement::Everything, |user| Confinement::User(user.into())),
            &catalog,
        )
        .await
        .expect("find");
        let docs = answer["docs"].as_array().unwrap();
        ids.extend(docs.iter().map(|d| d["_id"].as_str().unwrap().to_owned()));
        if docs.len() < limit {
            return ids;
        }
        request["bookmark"] = answer["bookmark"].clone();
    }
    panic!("bookmark paging did not terminate");
}

fn expected_ids(docs: &[Value], keep: impl Fn(&Value) -> bool) -> HashSet<String> {
    docs.iter().filter(|d| keep(d)).map(|d| d["_id"].as_str().unwrap().to_owned()).collect()
}

fn exactly_once(ids: &[String]) -> HashSet<String> {
    let set: HashSet<String> = ids.iter().cloned().collect();
    assert_eq!(set.len(), ids.len(), "a document was returned twice");
    set
}

#[tokio::test]
async fn bookmark_paging_terminates_and_sees_every_match_once() {
    let (_dir, backend, docs) = generated_store().await;
    // Through the userId index (more matches than a backend page), through a full scan, and with
    // a page size that divides the matches exactly.
    let cases = [
        (json!({"selector": {"userId": "user_1"}, "fields": ["_id"], "limit": 7}), "user_1", None),
        (json!({"selector": {"n": {"$gte": 500}}, "fields": ["_id"], "limit": 9}), "", None),
        (
            json!({"selector": {"userId": "user_2", "namespace": "ns2"}, "fields": ["_id"], "limit": 10}),
            "user_2",
            Some("ns2"),
        ),
    ];
    for (request, user, namespace) in cases {
        let ids = page_through(&backend, request.clone(), None).await;
        let expected = expected_ids(&docs, |d| {
            let by_user = user.is_empty() || d["userId"] == user;
            let by_ns = namespace.is_none_or(|ns| d["namespace"] == ns);
            let by_n = !user.is_empty() || d["n"].as_u64().is_some_and(|n| n >= 500);
            by_user && by_ns && by_n
        });
        assert!(!expected.is_empty());
        assert_eq!(exactly_once(&ids), expected, "{request}");
    }
}

#[tokio::test]
async fn skip_limit_and_bookmark_at_the_end() {
    let (_dir, backend, _docs) = generated_store().await;
    let all =
        run(&backend, &json!({"selector": {"userId": "user_0"}, "fields": ["_id"], "limit": 1000})).await.unwrap();
    let all = all["docs"].as_array().unwrap().clone();
    assert_eq!(all.len(), 120);
    let skipped = run(&backend, &json!({"selector": {"userId": "user_0"}, "fields": ["_id"], "skip": 5, "limit": 3}))
        .await
        .unwrap();
    assert_eq!(skipped["docs"].as_array().unwrap()[..], all[5..8]);
    let last = run(&backend, &json!({"selector": {"userId": "user_0"}, "limit": 1000})).await.unwrap();
    let after = run(&backend, &json!({"selector": {"userId": "user_0"}, "limit": 1000, "bookmark": last["bookmark"]}))
        .await
        .unwrap();
    assert_eq!(after["docs"], json!([]), "the bookmark after the last page gives an empty page");
    assert_eq!(after["bookmark"], last["bookmark"]);
    let default = run(&backend, &json!({"selector": {"userId": "user_0"}})).await.unwrap();
    assert_eq!(default["docs"].as_array().unwrap().len(), 25);
}

#[tokio::test]
async fn sorted_queries_need_an_index_and_page_in_collation_order() {
    let (_dir, backend, docs) = generated_store().await;
    let sorted = json!({"selector": {"userId": "user_1", "n": {"$gt": 100}}, "sort": [{"n": "desc"}], "fields": ["_id", "n"], "limit": 11});
    let refused = run(&backend, &sorted).await.unwrap_err().refusal();
    assert_eq!(refused.error, "no_usable_index");
    create_index(&backend, &json!({"index": {"fields": ["n"]}})).await.unwrap();

    let ids = page_through(&backend, sorted.clone(), None).await;
    let mut expected: Vec<(u64, String)> = docs
        .iter()
        .filter(|d| d["userId"] == "user_1" && d["n"].as_u64().is_some_and(|n| n > 100))
        .map(|d| (d["n"].as_u64().unwrap(), d["_id"].as_str().unwrap().to_owned()))
        .collect();
    expected.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| b.1.as_bytes().cmp(a.1.as_bytes())));
    assert_eq!(ids, expected.into_iter().map(|(_, id)| id).collect::<Vec<_>>());

    // The built-in index sorts by namespace once userId is fixed (CouchDB's constant-prefix rule).
    let by_ns = run(
        &backend,
        &json!({"selector": {"userId": "user_2"}, "sort": ["namespace"], "fields": ["namespace"], "limit": 1000}),
    )
    .await
    .unwrap();
    let namespaces: Vec<&str> =
        by_ns["docs"].as_array().unwrap().iter().map(|d| d["namespace"].as_str().unwrap()).collect();
    assert!(namespaces.windows(2).all(|w| w[0] <= w[1]));
    assert_eq!(namespaces.len(), 120);

    // A `limit: 0` page's bookmark starts from the beginning, in either direction.
    for direction in ["asc", "desc"] {
        let mut request = json!({"selector": {"userId": "user_1", "n": {"$gt": 100}}, "sort": [{"n": direction}], "fields": ["_id"], "limit": 0});
        let empty = run(&backend, &request).await.unwrap();
        assert_eq!(empty["docs"], json!([]));
        request["limit"] = json!(1000);
        let from_start = run(&backend, &request).await.unwrap();
        request["bookmark"] = empty["bookmark"].clone();
        assert_eq!(run(&backend, &request).await.unwrap()["docs"], from_start["docs"], "{direction}");
    }

    let limits = FindLimits { sort_cap: 20, ..FindLimits::default() };
    let capped = find_with_limits(
        &backend,
        &sorted,
        &Confinement::Everything,
        &IndexCatalog::load(&backend).await.unwrap(),
        limits,
    )
    .await
    .unwrap_err()
    .refusal();
    assert_eq!(capped.status.as_u16(), 400);
    assert!(capped.reason.contains("at most 20"), "{}", capped.reason);
}

#[tokio::test]
async fn a_user_login_sees_only_its_documents() {
    let (_dir, backend, docs) = generated_store().await;
    let request =
        json!({"selector": {"tags": {"$elemMatch": {"$eq": "five"}}}, "fields": ["_id", "userId"], "limit": 4});
    let ids = page_through(&backend, request, Some("user_2")).await;
    let expected = expected_ids(&docs, |d| d["userId"] == "user_2" && d["tags"] == json!(["five"]));
    assert_eq!(exactly_once(&ids), expected);
    // Asking for another user's documents gives nothing.
    let catalog = IndexCatalog::load(&backend).await.unwrap();
    let other =
        find(&backend, &json!({"selector": {"userId": "user_0"}}), &Confinement::User("user_2".into()), &catalog)
            .await
            .unwrap();
    assert_eq!(other["docs"], json!([]));
}

#[tokio::test]
async fn paging_survives_the_last_returned_document_being_deleted() {
    let (_dir, backend, docs) = generated_store().await;
    let catalog = IndexCatalog::load(&backend).await.unwrap();
    // Through the userId index and through a full scan.
    for (selector, keep) in [
        (json!({"userId": "user_0"}), Box::new(|d: &Value| d["userId"] == "user_0") as Box<dyn Fn(&Value) -> bool>),
        (json!({"key": {"$gte": "k0"}}), Box::new(|_: &Value| true)),
    ] {
        let mut request = json!({"selector": selector, "fields": ["_id", "_rev"], "limit": 13});
        let (mut seen, mut deleted) = (Vec::new(), HashSet::new());
        loop {
            let answer = find(&backend, &request, &Confinement::Everything, &catalog).await.unwrap();
            let page = answer["docs"].as_array().unwrap().clone();
            seen.extend(page.iter().map(|d| d["_id"].as_str().unwrap().to_owned()));
            if page.len() < 13 {
                break;
            }
            // Delete the last document returned before asking for the next page.
            let last = page.last().unwrap();
            let rev = crate::backend::Revision(last["_rev"].as_str().unwrap().to_owned());
            backend.delete(last["_id"].as_str().unwrap(), &rev).await.unwrap();
            deleted.insert(last["_id"].as_str().unwrap().to_owned());
            request["bookmark"] = answer["bookmark"].clone();
        }
        let expected = expected_ids(&docs, |d| keep(d) && !deleted.contains(d["_id"].as_str().unwrap()));
        let seen = exactly_once(&seen);
        assert!(
            expected.is_subset(&seen),
            "missing after deletions: {:?}",
            expected.difference(&seen).collect::<Vec<_>>()
        );
        // Put the deleted documents back for the next case.
        for doc in docs.iter().filter(|d| deleted.contains(d["_id"].as_str().unwrap())) {
            let mut body = doc.as_object().unwrap().clone();
            body.remove("_id");
            backend.put(doc["_id"].as_str().unwrap(), &body, Precondition::None).await.unwrap();
        }
    }
}

#[tokio::test]
async fn sorting_uses_unicode_collation_for_fields_and_bytes_for_ids() {
    let (_dir, backend) = open().await;
    for key in ["b", "A", "é", "a", "B", "f", "e"] {
        let id = format!("user_9:ns:{}", crate::model::id::encode_key(key));
        put(&backend, &json!({"_id": id, "userId": "user_9", "namespace": "ns", "key": key})).await;
    }
    create_index(&backend, &json!({"index": {"fields": ["key"]}})).await.unwrap();
    let by_key =
        run(&backend, &json!({"selector": {"key": {"$gt": null}}, "sort": ["key"], "fields": ["key"]})).await.unwrap();
    let keys: Vec<&str> = by_key["docs"].as_array().unwrap().iter().map(|d| d["key"].as_str().unwrap()).collect();
    assert_eq!(keys, ["a", "A", "b", "B", "e", "é", "f"]);

    // CouchDB sorts on `_id` only with an `_id` condition in the selector (`_all_docs` is then
    // usable); see `find_sort_rules_follow_couchdb_index_selection`.
    let by_id = run(
        &backend,
        &json!({"selector": {"userId": "user_9", "_id": {"$gt": null}}, "sort": [{"_id": "desc"}], "fields": ["_id"]}),
    )
    .await
    .unwrap();
    let ids: Vec<String> =
        by_id["docs"].as_array().unwrap().iter().map(|d| d["_id"].as_str().unwrap().to_owned()).collect();
    let mut expected = ids.clone();
    expected.sort_by(|a, b| b.as_bytes().cmp(a.as_bytes()));
    assert_eq!(ids, expected);
    assert_eq!(ids.len(), 7);
}

#[tokio::test]
async fn use_index_warns_or_refuses_when_the_index_does_not_serve_the_query() {
    let (_dir, backend) = fixture_store().await;
    let used = run(&backend, &json!({"selector": {"userId": "user_123", "namespace": "notes"}, "use_index": "idx-user-namespace", "limit": 1})).await;
    // `use_index` names a design document; the built-in one is found by its id.
    let by_ddoc = run(
        &backend,
        &json!({"selector": {"userId": "user_123", "namespace": "notes"},
        "use_index": ["6b616e35af647bddcf8e10c3787b8f7ef20b3545", "idx-user-namespace"], "limit": 1}),
    )
    .await
    .unwrap();
    assert!(by_ddoc.get("warning").is_none(), "{by_ddoc}");
    let warned = used.unwrap();
    assert_eq!(
        warned["warning"],
        "_design/idx-user-namespace was not used because it does not contain a valid index for this query."
    );
    let refused = run(&backend, &json!({"selector": {"key": "x"}, "use_index": ["6b616e35af647bddcf8e10c3787b8f7ef20b3545"], "allow_fallback": false})).await.unwrap_err().refusal();
    assert_eq!(
        (refused.error.as_str(), refused.reason.as_str()),
        ("invalid_index", "_design/6b616e35af647bddcf8e10c3787b8f7ef20b3545 specified by `use_index` could not be found or it is not suitable.")
    );
}

#[tokio::test]
async fn an_answer_over_the_byte_budget_is_refused_not_built() {
    let (_dir, backend, _docs) = generated_store().await;
    let catalog = IndexCatalog::load(&backend).await.unwrap();
    let limits = FindLimits { answer_bytes: 4096, ..FindLimits::default() };
    let everything = json!({"selector": {"userId": "user_1"}, "limit": 1_000_000});
    let refused = find_with_limits(&backend, &everything, &Confinement::Everything, &catalog, limits)
        .await
        .unwrap_err()
        .refusal();
    assert_eq!((refused.status.as_u16(), refused.error.as_str()), (400, "answer_too_large"));
    assert!(refused.reason.contains("4096 bytes"), "{}", refused.reason);
    // Smaller pages of the same query fit, and so does a sorted page.
    let paged = find_with_limits(
        &backend,
        &json!({"selector": {"userId": "user_1"}, "limit": 10}),
        &Confinement::Everything,
        &catalog,
        limits,
    )
    .await
    .unwrap();
    assert_eq!(paged["docs"].as_array().unwrap().len(), 10);
    let sorted = json!({"selector": {"userId": "user_1"}, "sort": ["namespace"], "limit": 1_000_000});
    assert_eq!(
        find_with_limits(&backend, &sorted, &Confinement::Everything, &catalog, limits)
            .await
            .unwrap_err()
            .refusal()
            .error,
        "answer_too_large"
    );
}

#[tokio::test]
async fn equal_sort_keys_are_ordered_by_raw_id_bytes() {
    // Issue 22 §2c item 4, measured on a real CouchDB 3.4.3: ids `Zed, alice, zoë, Ünï` with equal
    // sort values come back as `[Zed, alice, zoë, Ünï]` (a view orders equal keys by raw id).
    let (_dir, backend) = open().await;
    for id in ["zoë", "Ünï", "alice", "Zed"] {
        put(&backend, &json!({"_id": id, "n": 1})).await;
    }
    create_index(&backend, &json!({"index": {"fields": ["n"]}})).await.unwrap();
    let ids = |answer: &Value| -> Vec<String> {
        answer["docs"].as_array().unwrap().iter().map(|d| d["_id"].as_str().unwrap().to_owned()).collect()
    };
    let request = json!({"selector": {"n": 1}, "sort": ["n"], "fields": ["_id"]});
    assert_eq!(ids(&run(&backend, &request).await.unwrap()), ["Zed", "alice", "zoë", "Ünï"]);
    let request = json!({"selector": {"n": 1}, "sort": [{"n": "desc"}], "fields": ["_id"]});
    assert_eq!(ids(&run(&backend, &request).await.unwrap()), ["Ünï", "zoë", "alice", "Zed"]);
    // Page boundaries follow the same order.
    let first =
        run(&backend, &json!({"selector": {"n": 1}, "sort": ["n"], "fields": ["_id"], "limit": 2})).await.unwrap();
    assert_eq!(ids(&first), ["Zed", "alice"]);
    let second = run(
        &backend,
        &json!({"selector": {"n": 1}, "sort": ["n"], "fields": ["_id"], "limit": 2, "bookmark": first["bookmark"]}),
    )
    .await
    .unwrap();
    assert_eq!(ids(&second), ["zoë", "Ünï"]);
}

#[tokio::test]
async fn an_empty_or_or_and_finds_nothing_as_couchdb() {
    // Issue 22 §2c item 1: CouchDB 3.4.3 returns no documents for `{"$or": []}`;
    // mango_cursor.erl's `maybe_noop_range` answers a selector that is only an empty
    // `$or`/`$and`/`$all`/`$in` without a scan, and the answer is the bare `{"docs": []}`.
    let (_dir, backend) = fixture_store().await;
    for selector in [json!({"$or": []}), json!({"$and": []}), json!({"key": {"$or": []}})] {
        let answer = run(&backend, &json!({"selector": selector, "execution_stats": true})).await.unwrap();
        assert_eq!(answer, json!({"docs": []}), "{selector}");
    }
    // Beside other conditions an empty `$or` is true (mango_selector:match), as CouchDB's comment
    // on `maybe_noop_range` says.
    let with_other = run(&backend, &json!({"selector": {"userId": "user_123", "$or": []}})).await.unwrap();
    let plain = run(&backend, &json!({"selector": {"userId": "user_123"}})).await.unwrap();
    assert_eq!(with_other["docs"], plain["docs"]);
    assert!(!plain["docs"].as_array().unwrap().is_empty());
    // A per-user login asking for `{"$or": []}` gets nothing too.
    let catalog = IndexCatalog::load(&backend).await.unwrap();
    let own = find(&backend, &json!({"selector": {"$or": []}}), &Confinement::User("user_123".into()), &catalog)
        .await
        .unwrap();
    assert_eq!(own, json!({"docs": []}));
}

#[tokio::test]
async fn an_empty_first_page_has_the_bookmark_nil() {
    // Issue 22 §2c item 13 (a real CouchDB 3.4.3 answers `"bookmark": "nil"`), and
    // mango_json_bookmark.erl: with no row returned the bookmark is the request's own, `nil`.
    let (_dir, backend) = fixture_store().await;
    let none = run(&backend, &json!({"selector": {"userId": "nobody"}})).await.unwrap();
    assert_eq!(none["docs"], json!([]));
    assert_eq!(none["bookmark"], "nil");
    let zero = run(&backend, &json!({"selector": {"userId": "user_123"}, "limit": 0})).await.unwrap();
    assert_eq!(zero["bookmark"], "nil");
    // Sent back, `nil` is the start.
    let again =
        run(&backend, &json!({"selector": {"userId": "user_123"}, "limit": 1, "bookmark": "nil"})).await.unwrap();
    let first = run(&backend, &json!({"selector": {"userId": "user_123"}, "limit": 1})).await.unwrap();
    assert_eq!(again["docs"], first["docs"]);
    assert_ne!(first["bookmark"], "nil");
}

#[tokio::test]
async fn find_sort_rules_follow_couchdb_index_selection() {
    // Issue 22 §2c item 10, measured on a real CouchDB 3.4.3, and mango_idx_special.erl /
    // mango_idx_view.erl / mango_selector.erl (3.4.3): `_all_docs` serves a sort on `_id` only
    // when the selector has an indexable `_id` condition; an empty `$or` covers every field an
    // index requires.
    let (_dir, backend) = fixture_store().await;
    let refused =
        run(&backend, &json!({"selector": {"userId": "user_123"}, "sort": ["_id"]})).await.unwrap_err().refusal();
    assert_eq!((refused.status.as_u16(), refused.error.as_str()), (400, "no_usable_index"));
    let with_id = run(&backend, &json!({"selector": {"userId": "user_123", "_id": {"$gt": null}}, "sort": ["_id"]}))
        .await
        .unwrap();
    assert!(!with_id["docs"].as_array().unwrap().is_empty());
    // `{"$or": []}` with a sort the built-in index has: served (and empty).
    let empty_or = run(&backend, &json!({"selector": {"$or": []}, "sort": ["userId"]})).await.unwrap();
    assert_eq!(empty_or, json!({"docs": []}));
    let empty_or_by_id = run(&backend, &json!({"selector": {"$or": []}, "sort": ["_id"]})).await.unwrap_err().refusal();
    assert_eq!(empty_or_by_id.error, "no_usable_index");
    // `_explain` of a sort no index serves: 200 with `index: null` and no `mrargs`.
    let plan = explain(&backend, &json!({"selector": {"userId": "user_123"}, "sort": ["key"]}), "db").await.unwrap();
    assert_eq!(plan["index"], Value::Null);
    assert!(plan.get("mrargs").is_none(), "{plan}");
    assert!(plan["index_candidates"].as_array().unwrap().iter().all(|c| c["analysis"]["usable"] == false), "{plan}");
    // `allow_fallback: false` without `use_index` and a single usable index is CouchDB's
    // `invalid_index` (mango_cursor.erl `create`).
    let lone = run(&backend, &json!({"selector": {"key": "x"}, "allow_fallback": false})).await.unwrap_err().refusal();
    assert_eq!(
        (lone.error.as_str(), lone.reason.as_str()),
        ("invalid_index", "You must specify an index with the `use_index` parameter.")
    );
}

#[tokio::test]
async fn index_creation_follows_couchdb_naming() {
    // Issue 22 §2c item 11, measured on a real CouchDB 3.4.3, and mango_idx.erl (`gen_name`
    // hashes the request's options, the name among them, into the design document id).
    let (_dir, backend) = open().await;
    let first =
        create_index(&backend, &json!({"index": {"fields": ["n"]}, "name": "by-n", "ddoc": "mine"})).await.unwrap();
    assert_eq!((first["result"].as_str(), first["id"].as_str()), (Some("created"), Some("_design/mine")));
    // The same name without `ddoc`: a second index, in a design document of its own.
    let second = create_index(&backend, &json!({"index": {"fields": ["n"]}, "name": "by-n"})).await.unwrap();
    assert_eq!(second["result"], "created", "{second}");
    assert_ne!(second["id"], "_design/mine");
    // Repeating a request finds what it created.
    let again = create_index(&backend, &json!({"index": {"fields": ["n"]}, "name": "by-n"})).await.unwrap();
    assert_eq!((again["result"].clone(), again["id"].clone()), (json!("exists"), second["id"].clone()));
    // The same definition under another name: another design document too.
    let other = create_index(&backend, &json!({"index": {"fields": ["n"]}, "name": "by-n-2"})).await.unwrap();
    assert_eq!(other["result"], "created");
    assert_ne!(other["id"], second["id"]);
    // `fields: []` is an index (CouchDB creates it); a missing `fields` is CouchDB's
    // `missing_required_key`.
    let empty = create_index(&backend, &json!({"index": {"fields": []}})).await.unwrap();
    assert_eq!(empty["result"], "created");
    let missing = create_index(&backend, &json!({"index": {}})).await.unwrap_err().refusal();
    assert_eq!(
        (missing.error.as_str(), missing.reason.as_str()),
        ("missing_required_key", "Missing required key: fields")
    );
    // An index with no columns serves every unsorted query in CouchDB (mango_idx_view
    // `is_usable`, fewest columns first): no "no matching index" warning, no sort.
    let found = run(&backend, &json!({"selector": {"key": "x"}})).await.unwrap();
    assert!(found.get("warning").is_none(), "{found}");

    // `GET _index` lists by design document id (mango_httpd.erl sorts the index records).
    let listed = list_indexes(&backend).await.unwrap();
    let ddocs: Vec<&str> =
        listed["indexes"].as_array().unwrap().iter().skip(1).map(|i| i["ddoc"].as_str().unwrap()).collect();
    let mut sorted = ddocs.clone();
    sorted.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    assert_eq!(ddocs, sorted);
    assert_eq!(listed["indexes"][0]["name"], "_all_docs");
    assert_eq!(listed["total_rows"], 6);
}

#[tokio::test]
async fn explain_selector_hints_see_through_and_only() {
    // mango_cursor.erl `extract_selector_hints` with mango_idx_view.erl `indexable_fields`
    // (3.4.3): fields under `$or` are not indexable; `$exists` is, whatever its argument.
    let (_dir, backend) = fixture_store().await;
    let plan = explain(&backend, &json!({"selector": {"$or": [{"a": 1}, {"b": 1}], "c": {"$exists": false}}}), "db")
        .await
        .unwrap();
    assert_eq!(
        plan["selector_hints"],
        json!([{"type": "json", "indexable_fields": ["c"], "unindexable_fields": ["a", "b"]}])
    );
}

#[tokio::test]
async fn an_empty_range_on_the_chosen_index_reads_nothing() {
    // mango_idx_view.erl `range/5` and mango_cursor_view.erl `execute` (3.4.3): when the chosen
    // index's first column has an empty range (computed in collation, also for `_id`), CouchDB
    // reads nothing and answers `{"docs": []}`.
    let (_dir, backend) = open().await;
    for id in ["C", "b"] {
        put(&backend, &json!({"_id": id, "n": 4})).await;
    }
    // By bytes "B" < "C" < "a", so the scan's filter would return C; in collation "a" < "B".
    let by_id = run(&backend, &json!({"selector": {"_id": {"$gt": "B", "$lt": "a"}}})).await.unwrap();
    assert_eq!(by_id, json!({"docs": []}));
    create_index(&backend, &json!({"index": {"fields": ["n"]}})).await.unwrap();
    let contradiction = run(&backend, &json!({"selector": {"n": {"$gt": 5, "$lt": 3}}})).await.unwrap();
    assert_eq!(contradiction, json!({"docs": []}));
    let plan = explain(&backend, &json!({"selector": {"n": {"$gt": 5, "$lt": 3}}}), "db").await.unwrap();
    assert_eq!((plan["mrargs"]["start_key"].clone(), plan["mrargs"]["end_key"].clone()), (Value::Null, Value::Null));
    // A satisfiable range runs as before.
    let found = run(&backend, &json!({"selector": {"n": {"$gt": 3, "$lt": 5}}, "fields": ["_id"]})).await.unwrap();
    assert_eq!(found["docs"].as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn a_partition_is_refused_as_couchdb_refuses_it_on_an_unpartitioned_database() {
    // CouchDB 3.4.3 source: mango_opts.erl validates `partition` with
    // `couch_partition:validate_partition` (`illegal_partition`); mango_idx.erl keeps only
    // partitioned indexes (none here) so a sort is `no_usable_index`; otherwise `_all_docs` runs
    // and `couch_mrview_util:validate_all_docs_args` answers `query_parse_error`.
    let (_dir, backend) = fixture_store().await;
    let refused =
        run(&backend, &json!({"selector": {"userId": "user_123"}, "partition": "p1"})).await.unwrap_err().refusal();
    assert_eq!(
        (refused.status.as_u16(), refused.error.as_str(), refused.reason.as_str()),
        (400, "query_parse_error", "`partition` parameter is not supported on this db")
    );
    let sorted = json!({"selector": {"userId": "user_123"}, "sort": ["namespace"], "partition": "p1"});
    assert_eq!(run(&backend, &sorted).await.unwrap_err().refusal().error, "no_usable_index");
    for (partition, reason) in [
        (json!("_p"), "Partition must not start with an underscore"),
        (json!("a:b"), "Partition must not contain a colon"),
        (json!(5), "Partition must be a string"),
    ] {
        let e = run(&backend, &json!({"selector": {}, "partition": partition})).await.unwrap_err().refusal();
        assert_eq!((e.error.as_str(), e.reason.as_str()), ("illegal_partition", reason));
    }
    assert_eq!(run(&backend, &json!({"selector": {"$or": []}, "partition": "p1"})).await.unwrap(), json!({"docs": []}));
    // `_explain` does not run the query: `_all_docs`, with the partition in its options.
    let plan = explain(&backend, &json!({"selector": {"userId": "user_123"}, "partition": "p1"}), "db").await.unwrap();
    assert_eq!((plan["index"]["name"].clone(), plan["opts"]["partition"].clone()), (json!("_all_docs"), json!("p1")));
}
