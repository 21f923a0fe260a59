//! The data-store database's created JSON indexes as view groups (embedded store): `_find` reads
//! the chosen index's key range instead of paging the backend, in the index's order, filtered
//! for a per-user login; a partial index holds only its documents; and `purge_user` leaves no row
//! of the purged user in the index file.
//!
//! Mango reads the data-store database as any [`ViewSource`]: its engine [`Database`], as the
//! CouchDB API serves it.

use std::ops::ControlFlow;
use std::sync::Arc;

use serde_json::{json, Map, Value};

use super::index::IndexCatalog;
use super::{create_index, find, find_on_data_store, DataStoreViews};
use crate::backend::embedded::EmbeddedBackend;
use crate::backend::{DocumentBackend, Precondition};
use crate::database::data_store_rules::Confinement;
use crate::database::Database;
use crate::store::{DataStore, StoreOptions};
use crate::views::index_store::RowRange;
use crate::views::service::Views;
use crate::views::ViewSource;

const DB: &str = "agent_data_store";

struct Fixture {
    _dir: tempfile::TempDir,
    backend: Arc<dyn DocumentBackend>,
    views: Arc<Views>,
    /// The data-store database as the CouchDB API serves it: its views read the incarnation
    /// fresh at every use, so the facade's `purge_user` reaches them.
    source: Database,
}

async fn fixture() -> Fixture {
    let dir = tempfile::tempdir().expect("temp dir");
    let embedded = EmbeddedBackend::open(&dir.path().join("store.redb")).await.expect("open embedded store");
    embedded.ensure_standard_indexes().await.expect("indexes");
    let backend: Arc<dyn DocumentBackend> = Arc::new(embedded);
    let views = Arc::new(Views::new(
        dir.path().join("views.redb"),
        Arc::new(super::index_map::WithMangoIndexes(super::index_map::NoJavaScript)),
    ));
    let source = Database::data_store(DB.into(), Arc::clone(&backend)).expect("the data-store database");
    Fixture { _dir: dir, backend, views, source }
}

/// A data-store document of `user` in namespace `ns` with this `value`.
fn doc(user: &str, key: &str, value: Value) -> Value {
    let id = format!("{user}:ns:{}", crate::model::id::encode_key(key));
    json!({ "_id": id, "userId": user, "namespace": "ns", "key": key, "value": value })
}

async fn put(backend: &dyn DocumentBackend, doc: &Value) {
    let mut body: Map<String, Value> = doc.as_object().expect("object").clone();
    let id = body.remove("_id").and_then(|v| v.as_str().map(str::to_owned)).expect("_id");
    backend.ensure_namespace_indexed("ns").await.expect("namespace index");
    backend.put(&id, &body, Precondition::MustNotExist).await.expect("put");
}

/// Three users with values 0..40 each (user_2's every fifth a string, outside numeric ranges).
async fn seeded() -> (Fixture, Vec<Value>) {
    let f = fixture().await;
    let mut docs = Vec::new();
    for user in ["user_0", "user_1", "user_2"] {
        for i in 0..40u64 {
            let value = if user == "user_2" && i % 5 == 0 { json!(format!("s{i}")) } else { json!(i) };
            let doc = doc(user, &format!("k{i:02}"), value);
            put(f.backend.as_ref(), &doc).await;
            docs.push(doc);
        }
    }
    (f, docs)
}

impl Fixture {
    fn indexed(&self) -> DataStoreViews<'_> {
        DataStoreViews { views: self.views.as_ref(), source: &self.source }
    }

    async fn find(&self, request: &Value, only_user: Option<&str>) -> Value {
        let catalog = IndexCatalog::load(self.backend.as_ref()).await.expect("catalog");
        let confinement = only_user.map_or(Confinement::Everything, |user| Confinement::User(user.into()));
        find_on_data_store(self.backend.as_ref(), Some(self.indexed()), request, &confinement, &catalog)
            .await
            .unwrap_or_else(|e| panic!("{request}: {e}"))
    }
}

fn ids(answer: &Value) -> Vec<String> {
    answer["docs"].as_array().expect("docs").iter().map(|d| d["_id"].as_str().expect("_id").to_owned()).collect()
}

/// The ids of `docs` that `keep`, ordered by (value, id) as the index orders them.
fn in_index_order(docs: &[Value], keep: impl Fn(&Value) -> bool) -> Vec<String> {
    let mut kept: Vec<(u64, String)> = docs
        .iter()
        .filter(|d| keep(d))
        .map(|d| (d["value"].as_u64().expect("a number"), d["_id"].as_str().expect("_id").to_owned()))
        .collect();
    kept.sort();
    kept.into_iter().map(|(_, id)| id).collect()
}

fn value_in(doc: &Value, low: u64, high: u64) -> bool {
    doc["value"].as_u64().is_some_and(|v| (low..high).contains(&v))
}

#[tokio::test]
async fn a_created_index_is_read_over_its_key_range_instead_of_the_backend() {
    let (f, docs) = seeded().await;
    create_index(f.backend.as_ref(), &json!({"index": {"fields": ["value"]}, "name": "by-value"})).await.unwrap();
    let request = json!({"selector": {"value": {"$gte": 10, "$lt": 15}}, "execution_stats": true, "limit": 100});

    let answer = f.find(&request, None).await;
    assert!(answer.get("warning").is_none(), "the index serves it: {answer}");
    assert_eq!(ids(&answer), in_index_order(&docs, |d| value_in(d, 10, 15)), "key order, then id");
    // Only the rows of the key range [10, 15] were read (the end is inclusive, as CouchDB reads
    // it, and the selector drops the 15s): 16, user_2's 10 and 15 being strings.
    assert_eq!(answer["execution_stats"]["total_docs_examined"], json!(16));
    // The backend alone answers the same documents by reading every one of them.
    let catalog = IndexCatalog::load(f.backend.as_ref()).await.unwrap();
    let paged = find(f.backend.as_ref(), &request, &Confinement::Everything, &catalog).await.unwrap();
    let (mut by_index, mut by_backend) = (ids(&answer), ids(&paged));
    by_index.sort();
    by_backend.sort();
    assert_eq!(by_index, by_backend);
    assert_eq!(paged["execution_stats"]["total_docs_examined"], json!(120));
}

#[tokio::test]
async fn a_user_login_reads_the_shared_index_and_sees_only_its_own_documents() {
    let (f, docs) = seeded().await;
    create_index(f.backend.as_ref(), &json!({"index": {"fields": ["value"]}, "name": "by-value"})).await.unwrap();
    for user in ["user_0", "user_1", "user_2"] {
        let answer = f.find(&json!({"selector": {"value": {"$gte": 5, "$lt": 25}}, "limit": 100}), Some(user)).await;
        assert!(answer.get("warning").is_none(), "the index serves {user}: {answer}");
        let expected = in_index_order(&docs, |d| d["userId"] == user && value_in(d, 5, 25));
        assert!(!expected.is_empty());
        assert_eq!(ids(&answer), expected, "{user} sees its own documents only");
    }
    // A user whose selector names another user finds nothing.
    let other = f.find(&json!({"selector": {"userId": "user_1", "value": {"$gte": 0}}}), Some("user_0")).await;
    assert_eq!(ids(&other), Vec::<String>::new());
}

#[tokio::test]
async fn a_sorted_query_pages_the_index_in_descending_order_and_follows_writes() {
    let (f, mut docs) = seeded().await;
    create_index(f.backend.as_ref(), &json!({"index": {"fields": ["value"]}, "ddoc": "v", "name": "v"})).await.unwrap();
    let query = json!({"selector": {"value": {"$gte": 0, "$lte": 100}}, "sort": [{"value": "desc"}], "limit": 7});
    let page_all = |query: Value| {
        let f = &f;
        async move {
            let (mut seen, mut bookmark) = (Vec::new(), None::<Value>);
            for _ in 0..100 {
                let mut page = query.clone();
                if let Some(bookmark) = &bookmark {
                    page["bookmark"] = bookmark.clone();
                }
                let answer = f.find(&page, None).await;
                let got = ids(&answer);
                let short = got.len() < 7;
                seen.extend(got);
                if short {
                    break;
                }
                bookmark = Some(answer["bookmark"].clone());
            }
            seen
        }
    };
    let mut expected = in_index_order(&docs, |d| value_in(d, 0, 101));
    expected.reverse();
    assert_eq!(page_all(query.clone()).await, expected, "the index's order, descending, across pages");

    // A new document, an edit out of the range and a deletion are in the next query.
    let added = doc("user_3", "new", json!(7));
    put(f.backend.as_ref(), &added).await;
    docs.push(added);
    let edited_id = docs[3]["_id"].as_str().unwrap().to_owned();
    let current = f.backend.get(&edited_id).await.unwrap().unwrap();
    let mut body = current.body.clone();
    body.insert("value".into(), json!("no longer a number"));
    f.backend.put(&edited_id, &body, Precondition::MatchRevision(current.rev)).await.unwrap();
    docs[3]["value"] = json!("no longer a number");
    let deleted_id = docs[4]["_id"].as_str().unwrap().to_owned();
    let current = f.backend.get(&deleted_id).await.unwrap().unwrap();
    f.backend.delete(&deleted_id, &current.rev).await.unwrap();
    docs.remove(4);
    let mut expected = in_index_order(&docs, |d| value_in(d, 0, 101));
    expected.reverse();
    assert_eq!(page_all(query).await, expected);
}

#[tokio::test]
async fn a_partial_index_holds_only_its_documents() {
    let (f, docs) = seeded().await;
    let partial = json!({"index": {"fields": ["value"], "partial_filter_selector": {"userId": "user_1"}},
        "ddoc": "partial", "name": "user-1"});
    create_index(f.backend.as_ref(), &partial).await.unwrap();
    let answer = f.find(&json!({"selector": {"value": {"$gte": 0}}, "use_index": "partial", "limit": 100}), None).await;
    assert!(answer.get("warning").is_none(), "the partial index serves it: {answer}");
    assert_eq!(ids(&answer), in_index_order(&docs, |d| d["userId"] == "user_1"));
}

#[tokio::test]
async fn purging_a_user_leaves_none_of_its_rows_in_the_index_file() {
    let (f, docs) = seeded().await;
    let store = DataStore::open(Arc::clone(&f.backend), StoreOptions::default()).await.expect("facade");
    create_index(f.backend.as_ref(), &json!({"index": {"fields": ["value"]}, "name": "by-value"})).await.unwrap();
    let request = json!({"selector": {"value": {"$gte": 0}}, "limit": 1000, "update": true});
    let before = f.find(&request, None).await;
    assert!(ids(&before).iter().any(|id| id.starts_with("user_1:")));
    let old_prefix = f.source.group_prefix().await.unwrap();

    assert_eq!(store.purge_user("user_1").await.unwrap(), 40);
    // `update: false` reads the index as it is: the purge ended it, so a new, empty one.
    let stale = f.find(&json!({"selector": {"value": {"$gte": 0}}, "update": false, "limit": 1000}), None).await;
    assert_eq!(ids(&stale), Vec::<String>::new());
    let after = f.find(&request, None).await;
    // Strings collate after numbers, so `$gte: 0` keeps user_2's string values too.
    let mut remaining: Vec<String> =
        docs.iter().filter(|d| d["userId"] != "user_1").map(|d| d["_id"].as_str().unwrap().to_owned()).collect();
    let mut got = ids(&after);
    remaining.sort();
    got.sort();
    assert_eq!(got, remaining, "every other user's documents, none of the purged user's");

    let new_prefix = f.source.group_prefix().await.unwrap();
    assert_ne!(new_prefix, old_prefix, "the purge ended the incarnation");
    let indexer = f.views.indexer().await.unwrap();
    let groups = indexer.store().group_names(&format!("{DB}\u{0}")).unwrap();
    assert!(!groups.is_empty() && groups.iter().all(|g| g.starts_with(&new_prefix)), "old groups dropped: {groups:?}");
    // `_find` reads each row's document, so a purged document would not be returned even from
    // a stale row: the rows themselves are what must be gone.
    let mut row_ids = Vec::new();
    for group in &groups {
        let number = indexer.store().read_group(group).unwrap().expect("group").number;
        indexer
            .store()
            .scan(number, 0, &RowRange::all(), false, |row| {
                row_ids.push(row.id);
                ControlFlow::Continue(())
            })
            .unwrap();
    }
    row_ids.sort();
    assert_eq!(row_ids, remaining, "the index holds the other users' rows only");
}
