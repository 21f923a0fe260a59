//! The DynamoDB adapter's document model on dynalite (started by `tests/common/servers.rs`):
//! revisions and ancestry, tombstones, the change feed and its follower, id order, erasure with
//! chunk items, local documents, and tables written by the previous release (opened as they are,
//! and upgraded in place, interrupted and resumed).
//!
//! The tables use a short settle window (`settle_ms`) so the feed shows a write soon; the tests
//! wait that long before reading the feed.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use agentstore::backend::dynamodb::layout::{self, FEED_INDEX};
use agentstore::backend::dynamodb::{DynamoConfig, DynamoDbBackend};
use agentstore::backend::revision::RevisionId;
use agentstore::backend::{
    BulkWrite, DocumentBackend, IdRange, LayoutState, Precondition, Projection, Query, Revision,
};
use agentstore::ErrorKind;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, GlobalSecondaryIndex, KeySchemaElement, KeyType,
    Projection as IndexProjection, ProjectionType, ScalarAttributeType,
};
use serde_json::{json, Map, Value};

use crate::common::counting_proxy::CountingProxy;
use crate::common::{self, servers};

const SETTLE_MS: u64 = 1500;
const WRITE_TIMEOUT_MS: u64 = 1200;

fn table_name(purpose: &str) -> String {
    format!("layout_{purpose}_{}", &agentstore_token()[..10])
}

fn agentstore_token() -> String {
    let rev = RevisionId::next_after(None).expect("random");
    rev.to_revision().0[2..].to_owned()
}

/// A backend on a fresh table (or the named one), with the short settle window and `extra`
/// parameters.
async fn open(table: &str, create: bool, extra: &str) -> DynamoDbBackend {
    let server = servers::dynamodb().expect("dynalite");
    let mut url = server.table_url(table);
    if !create {
        url = url.replace("&create=true", "");
    }
    url.push_str(&format!("&settle_ms={SETTLE_MS}&write_timeout_ms={WRITE_TIMEOUT_MS}{extra}"));
    DynamoDbBackend::open(&DynamoConfig::parse(&url).expect("url")).await.expect("open")
}

/// Waits until everything written so far is inside the feed's settled range.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(SETTLE_MS + 200)).await;
}

/// A body in namespace `ns` whose value is `{"n": n}`.
fn body(user: &str, key: &str, n: i64) -> Map<String, Value> {
    common::body(user, "ns", key, json!({ "n": n }))
}

fn generation(rev: &Revision) -> u64 {
    RevisionId::parse(rev.as_str()).unwrap_or_else(|| panic!("{rev} is not N-<32 hex>")).generation
}

async fn all_changes(
    backend: &DynamoDbBackend,
    since: Option<String>,
    limit: usize,
) -> (Vec<agentstore::backend::Change>, String) {
    let mut since = since;
    let mut out = Vec::new();
    loop {
        let page = backend.changes(since.as_deref(), limit).await.expect("changes");
        let done = page.changes.len() < limit;
        out.extend(page.changes);
        since = Some(page.last_seq);
        if done {
            return (out, since.unwrap_or_default());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revisions_ancestry_and_tombstones() {
    let backend = open(&table_name("revs"), true, "&revs_limit=3").await;
    assert_eq!(backend.layout().await.unwrap(), LayoutState::Current, "a table this release created");
    let id = "u1:ns:a2V5";
    let r1 = backend.put(id, &body("u1", "key", 1), Precondition::MustNotExist).await.unwrap();
    let r2 = backend.put(id, &body("u1", "key", 2), Precondition::MatchRevision(r1.clone())).await.unwrap();
    assert_eq!((generation(&r1), generation(&r2)), (1, 2));
    let info = backend.revisions(id).await.unwrap().unwrap();
    assert_eq!(info.ancestry.revisions().collect::<Vec<_>>(), vec![r2.clone(), r1.clone()]);
    assert!(!info.deleted);
    // The body has no trace of the layout's attributes.
    let doc = backend.get(id).await.unwrap().unwrap();
    assert_eq!(Value::Object(doc.body), Value::Object(body("u1", "key", 2)));

    backend.delete(id, &r2).await.unwrap();
    let tomb = backend.revisions(id).await.unwrap().unwrap();
    assert!(tomb.deleted);
    assert_eq!(generation(&tomb.rev), 3);
    assert_eq!(tomb.ancestry.revisions().collect::<Vec<_>>(), vec![tomb.rev.clone(), r2.clone(), r1.clone()]);
    assert!(backend.get(id).await.unwrap().is_none());
    assert_eq!(backend.get_many(&[id.to_owned()]).await.unwrap(), vec![None]);
    assert!(backend.scan(100, None).await.unwrap().items.is_empty(), "scan lists a tombstone");
    let listed = backend
        .query(&Query { user_id: "u1".into(), namespace: None, projection: Projection::All }, 10, None)
        .await
        .unwrap();
    assert!(listed.items.is_empty(), "the userId index lists a tombstone");
    assert_eq!(backend.delete(id, &tomb.rev).await.unwrap_err().kind(), ErrorKind::NotFound);
    let update_tomb = backend.put(id, &body("u1", "key", 3), Precondition::MatchRevision(tomb.rev.clone())).await;
    assert_eq!(update_tomb.unwrap_err().kind(), ErrorKind::Conflict);

    // Re-creating continues from the tombstone; ancestry cut to revs_limit=3.
    let r4 = backend.put(id, &body("u1", "key", 4), Precondition::MustNotExist).await.unwrap();
    assert_eq!(generation(&r4), 4);
    let info = backend.revisions(id).await.unwrap().unwrap();
    assert_eq!(info.ancestry.revisions().collect::<Vec<_>>(), vec![r4.clone(), tomb.rev.clone(), r2.clone()]);

    // Unconditional writes, one at a time and in bulk, continue the generation too.
    let r5 = backend.put(id, &body("u1", "key", 5), Precondition::None).await.unwrap();
    assert_eq!(generation(&r5), 5);
    let other = "u1:ns:b3RoZXI=";
    let bulk = vec![
        BulkWrite { id: id.into(), body: body("u1", "key", 6), precondition: Precondition::None },
        BulkWrite { id: other.into(), body: body("u1", "other", 1), precondition: Precondition::None },
        BulkWrite { id: other.into(), body: body("u1", "other", 2), precondition: Precondition::MustNotExist },
    ];
    let results = backend.bulk_write(bulk).await.unwrap();
    assert_eq!(generation(results[0].as_ref().unwrap()), 6);
    assert_eq!(generation(results[1].as_ref().unwrap()), 1);
    assert_eq!(results[2].as_ref().unwrap_err().kind(), ErrorKind::Conflict);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn change_feed_and_id_order() {
    let backend = open(&table_name("feed"), true, "").await;
    let ids = ["b", "a", "a:b", "a:b:c", "A", "Z", "_u", "\u{e9}t\u{e9}", "\u{fc}:1", "\u{10000}x", "a%", "ab", "a "];
    let mut revs = HashMap::new();
    for (n, id) in ids.iter().enumerate() {
        revs.insert(*id, backend.put(id, &body("u1", id, n as i64), Precondition::MustNotExist).await.unwrap());
    }
    backend.put_local("checkpoint", &body("u1", "local", 0), Precondition::MustNotExist).await.unwrap();
    backend.delete("Z", &revs["Z"]).await.unwrap();
    settle().await;

    // Every live document and tombstone once, in feed order, at its latest revision.
    let (changes, last) = all_changes(&backend, None, 4).await;
    let seen: Vec<&str> = changes.iter().map(|c| c.id.as_str()).collect();
    let mut expected: Vec<&str> = ids.to_vec();
    expected.sort();
    let mut sorted_seen = seen.clone();
    sorted_seen.sort();
    assert_eq!(sorted_seen, expected, "each document once, no local document");
    assert!(changes.windows(2).all(|w| w[0].seq < w[1].seq), "feed order");
    let z = changes.iter().find(|c| c.id == "Z").unwrap();
    assert!(z.deleted);
    assert_eq!(backend.revisions("Z").await.unwrap().unwrap().rev, z.rev);

    // A `since` in the middle, and change_position: only later writes.
    let middle = changes[5].seq.clone();
    let after_middle: Vec<String> =
        all_changes(&backend, Some(middle), 100).await.0.into_iter().map(|c| c.id).collect();
    assert_eq!(after_middle, seen[6..].iter().map(|s| s.to_string()).collect::<Vec<_>>());
    let position = backend.change_position().await.unwrap();
    let r = backend.put("a", &body("u1", "a", 99), Precondition::MatchRevision(revs["a"].clone())).await.unwrap();
    settle().await;
    let (later, _) = all_changes(&backend, Some(position), 100).await;
    assert_eq!(later.iter().map(|c| (c.id.as_str(), c.rev.clone())).collect::<Vec<_>>(), vec![("a", r.clone())]);
    let (from_last, _) = all_changes(&backend, Some(last), 100).await;
    assert_eq!(from_last.iter().map(|c| c.id.as_str()).collect::<Vec<_>>(), vec!["a"]);

    // all_docs: raw byte order both ways, paged, tombstones and local documents left out.
    let live: Vec<&str> = ids.iter().copied().filter(|id| *id != "Z").collect();
    for descending in [false, true] {
        for (start, end, inclusive_end) in
            [(None, None, true), (Some("a"), Some("a:b:c"), false), (Some("a"), Some("b"), true)]
        {
            let (start, end) = if descending { (end, start) } else { (start, end) };
            let range = IdRange {
                start: start.map(str::to_owned),
                end: end.map(str::to_owned),
                inclusive_end,
                descending,
                include_design: false,
            };
            let mut want: Vec<&str> = live.iter().copied().filter(|id| range.contains(id)).collect();
            want.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
            if descending {
                want.reverse();
            }
            let mut got = Vec::new();
            let mut token = None;
            loop {
                let page = backend.all_docs(&range, 3, token.as_deref()).await.unwrap();
                assert!(page.items.len() <= 3);
                got.extend(page.items.into_iter().map(|d| d.id));
                token = page.next;
                if token.is_none() {
                    break;
                }
            }
            assert_eq!(got, want, "{range:?}");
        }
    }
}

/// What a read of the feed costs when it finds nothing new, counted at a proxy in front of
/// dynalite: while the token has delivered a tail past the settle bound, the settled range and
/// the tail are a query of every shard each; once that tail has settled (every idle reader, every
/// index catch-up before a query), both are one query of every shard, and the read still finds a
/// write made after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_that_finds_nothing_new_queries_each_shard_once() {
    let server = servers::dynamodb().expect("dynalite");
    let proxy = CountingProxy::start(&server.endpoint).await.expect("start the counting proxy");
    let url = server.table_url(&table_name("idle")).replace(&server.endpoint, &proxy.url)
        + &format!("&settle_ms={SETTLE_MS}&write_timeout_ms={WRITE_TIMEOUT_MS}");
    let backend = DynamoDbBackend::open(&DynamoConfig::parse(&url).expect("url")).await.expect("open");
    let shards = layout::SHARD_COUNT as usize;
    backend.put("a", &body("u1", "a", 1), Precondition::MustNotExist).await.unwrap();
    let first = backend.changes(None, 100).await.unwrap();
    assert_eq!(first.changes.iter().map(|c| c.id.as_str()).collect::<Vec<_>>(), ["a"], "the write, in the tail");

    proxy.take();
    let again = backend.changes(Some(&first.last_seq), 100).await.unwrap();
    assert!(again.changes.is_empty(), "{:?}", again.changes);
    let with_tail = proxy.take().len();
    assert_eq!(with_tail, 2 * shards, "the settled range and the tail after the delivered write");

    settle().await;
    let settled = backend.changes(Some(&again.last_seq), 100).await.unwrap();
    assert!(settled.changes.is_empty(), "{:?}", settled.changes);
    proxy.take();
    let idle = backend.changes(Some(&settled.last_seq), 100).await.unwrap();
    assert!(idle.changes.is_empty(), "{:?}", idle.changes);
    assert_eq!(idle.last_seq, settled.last_seq, "nothing written, the same position");
    assert_eq!(proxy.take().len(), shards, "one query of each shard");

    let rev = backend.put("b", &body("u1", "b", 2), Precondition::MustNotExist).await.unwrap();
    let next = backend.changes(Some(&idle.last_seq), 100).await.unwrap();
    assert_eq!(next.changes.iter().map(|c| (c.id.as_str(), c.rev.clone())).collect::<Vec<_>>(), [("b", rev)]);
    assert_eq!(next.pending, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn erasure_removes_documents_tombstones_and_chunks() {
    let backend = open(&table_name("erase"), true, "").await;
    let big =
        json!({"userId": "u1", "namespace": "ns", "key": "big", "value": crate::common::corpus::noise(1_200_000, 11)});
    let big = big.as_object().cloned().unwrap();
    let r = backend.put("u1:ns:Ymln", &big, Precondition::MustNotExist).await.unwrap();
    // An update leaves the first revision's chunks as garbage only if its cleanup failed; write
    // twice so both paths have run.
    backend.put("u1:ns:Ymln", &big, Precondition::MatchRevision(r)).await.unwrap();
    backend.put("u1:ns:YQ==", &body("u1", "a", 1), Precondition::MustNotExist).await.unwrap();
    let gone = backend.put("u1:ns:Yg==", &body("u1", "b", 1), Precondition::MustNotExist).await.unwrap();
    backend.delete("u1:ns:Yg==", &gone).await.unwrap();
    backend.put("u10:ns:YQ==", &body("u10", "a", 1), Precondition::MustNotExist).await.unwrap();

    assert_eq!(backend.erase_prefix("u1:").await.unwrap(), 3);
    for id in ["u1:ns:Ymln", "u1:ns:YQ==", "u1:ns:Yg=="] {
        assert_eq!(backend.revisions(id).await.unwrap(), None, "{id}");
    }
    // No item of any kind (chunks included) keeps an erased id.
    let raw = backend.client().scan().table_name(backend_table(&backend)).consistent_read(true).send().await.unwrap();
    let left: Vec<String> = raw
        .items()
        .iter()
        .filter_map(|i| match i.get("_id") {
            Some(AttributeValue::S(id)) if id.starts_with("u1:") => Some(id.clone()),
            _ => None,
        })
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    settle().await;
    let (changes, _) = all_changes(&backend, None, 100).await;
    assert_eq!(changes.iter().map(|c| c.id.as_str()).collect::<Vec<_>>(), vec!["u10:ns:YQ=="]);
}

fn backend_table(backend: &DynamoDbBackend) -> String {
    backend.describe().trim_start_matches("dynamodb://").split('?').next().unwrap_or_default().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_documents() {
    let backend = open(&table_name("local"), true, "").await;
    let r1 = backend.put_local("cp", &body("u1", "cp", 1), Precondition::MustNotExist).await.unwrap();
    assert_eq!(r1.as_str(), "0-1");
    let again = backend.put_local("cp", &body("u1", "cp", 1), Precondition::MustNotExist).await;
    assert_eq!(again.unwrap_err().kind(), ErrorKind::Conflict);
    let r2 = backend.put_local("cp", &body("u1", "cp", 2), Precondition::MatchRevision(r1.clone())).await.unwrap();
    assert_eq!(r2.as_str(), "0-2");
    let stale = backend.put_local("cp", &body("u1", "cp", 3), Precondition::MatchRevision(r1.clone())).await;
    assert_eq!(stale.unwrap_err().kind(), ErrorKind::Conflict);
    let doc = backend.get_local("cp").await.unwrap().unwrap();
    assert_eq!((doc.id.as_str(), doc.rev.clone()), ("_local/cp", r2.clone()));
    assert_eq!(Value::Object(doc.body), Value::Object(body("u1", "cp", 2)));
    // Never listed, scanned, fed or read as a document, though its body has a userId.
    let query = Query { user_id: "u1".into(), namespace: None, projection: Projection::All };
    assert!(backend.query(&query, 10, None).await.unwrap().items.is_empty());
    assert!(backend.scan(10, None).await.unwrap().items.is_empty());
    assert!(backend.all_docs(&IdRange::all(), 10, None).await.unwrap().items.is_empty());
    assert!(backend.get("_local/cp").await.unwrap().is_none());
    assert_eq!(backend.delete_local("cp", &r1).await.unwrap_err().kind(), ErrorKind::Conflict);
    backend.delete_local("cp", &r2).await.unwrap();
    assert!(backend.get_local("cp").await.unwrap().is_none());
    assert_eq!(backend.delete_local("cp", &r2).await.unwrap_err().kind(), ErrorKind::NotFound);
    let fresh = backend.put_local("cp", &body("u1", "cp", 4), Precondition::None).await.unwrap();
    assert_eq!(fresh.as_str(), "0-1");
    settle().await;
    assert!(all_changes(&backend, None, 10).await.0.is_empty());
}

/// Every local document listed: (id, revision).
async fn listed_locals(backend: &DynamoDbBackend) -> Vec<(String, String)> {
    let page = backend.local_docs(&IdRange::all(), 10, None).await.expect("local_docs");
    page.items.into_iter().map(|doc| (doc.id, doc.rev.0)).collect()
}

/// A local document written before local documents had a shard (no `_shard`: in no index) is
/// not listed until the upgrade stamps it, or its next write does; a current one is listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_documents_of_an_earlier_release_are_listed_after_the_upgrade() {
    let backend = open(&table_name("oldlocal"), true, "").await;
    let table = backend_table(&backend);
    for name in ["old-a", "old-b"] {
        let item = HashMap::from([
            ("_id".to_owned(), AttributeValue::S(format!("_local/{name}"))),
            ("_rev".to_owned(), AttributeValue::S("0-3".into())),
            ("_json".to_owned(), AttributeValue::S(json!({ "name": name }).to_string())),
        ]);
        backend.client().put_item().table_name(&table).set_item(Some(item)).send().await.expect("an old local");
    }
    backend.put_local("new", &body("u1", "cp", 1), Precondition::MustNotExist).await.unwrap();
    assert_eq!(
        listed_locals(&backend).await,
        [("_local/new".to_owned(), "0-1".to_owned())],
        "old ones are in no index"
    );
    // Its next write lists one; the upgrade stamps the other, keeping its revision and body.
    backend.put_local("old-b", &Map::new(), Precondition::MatchRevision(Revision("0-3".into()))).await.unwrap();
    let (mut upgraded, mut token) = (0, None);
    loop {
        let step = backend.upgrade_page(token.as_deref(), 2).await.unwrap();
        upgraded += step.upgraded;
        token = step.next;
        if token.is_none() {
            break;
        }
    }
    assert_eq!(upgraded, 1, "only the local document without a shard");
    let expected: Vec<(String, String)> = [("old-a", "0-3"), ("old-b", "0-4"), ("new", "0-1")]
        .iter()
        .map(|(n, r)| (format!("_local/{n}"), r.to_string()))
        .collect();
    let mut sorted = expected.clone();
    sorted.sort();
    assert_eq!(listed_locals(&backend).await, sorted);
    let old = backend.get_local("old-a").await.unwrap().expect("still there");
    assert_eq!(Value::Object(old.body), json!({ "name": "old-a" }));
    // Still no document anywhere else.
    assert!(backend.all_docs(&IdRange::all(), 10, None).await.unwrap().items.is_empty());
    assert!(backend.scan(10, None).await.unwrap().items.is_empty());
}

// ---------------------------------------------------------------------------------------------
// Tables written by the previous release.
// ---------------------------------------------------------------------------------------------

fn key(name: &str, kind: KeyType) -> KeySchemaElement {
    KeySchemaElement::builder().attribute_name(name).key_type(kind).build().unwrap()
}

fn string_attribute(name: &str) -> AttributeDefinition {
    AttributeDefinition::builder().attribute_name(name).attribute_type(ScalarAttributeType::S).build().unwrap()
}

/// Creates a table as the previous release did (the userId + namespace index only), or with the
/// document model's indexes added by an operator (`with_new_indexes`), and writes old items.
async fn old_table(name: &str, with_new_indexes: bool, documents: usize) -> Vec<(String, String)> {
    let creator = open(&table_name("creator"), true, "").await;
    let client = creator.client().clone();
    let user_index = GlobalSecondaryIndex::builder()
        .index_name("idx-user-namespace")
        .key_schema(key("userId", KeyType::Hash))
        .key_schema(key("namespace", KeyType::Range))
        .projection(IndexProjection::builder().projection_type(ProjectionType::All).build())
        .build()
        .unwrap();
    let mut request = client
        .create_table()
        .table_name(name)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(string_attribute("_id"))
        .attribute_definitions(string_attribute("userId"))
        .attribute_definitions(string_attribute("namespace"))
        .key_schema(key("_id", KeyType::Hash))
        .global_secondary_indexes(user_index);
    if with_new_indexes {
        for definition in layout::index_attributes().unwrap() {
            request = request.attribute_definitions(definition);
        }
        for index in layout::new_indexes().unwrap() {
            request = request.global_secondary_indexes(index);
        }
    }
    request.send().await.expect("create the old table");
    for _ in 0..100 {
        let described = client.describe_table().table_name(name).send().await.unwrap();
        if described.table().and_then(|t| t.table_status()) == Some(&aws_sdk_dynamodb::types::TableStatus::Active) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut written = Vec::new();
    for n in 0..documents {
        let id = format!("old:ns:{n:03}");
        let rev = format!("{}-{:016x}", n % 4 + 1, 0xabc0 + n);
        let item = HashMap::from([
            ("_id".to_owned(), AttributeValue::S(id.clone())),
            ("_rev".to_owned(), AttributeValue::S(rev.clone())),
            ("userId".to_owned(), AttributeValue::S("old".into())),
            ("namespace".to_owned(), AttributeValue::S("ns".into())),
            ("key".to_owned(), AttributeValue::S(format!("k{n}"))),
            ("value".to_owned(), AttributeValue::N(n.to_string())),
        ]);
        client.put_item().table_name(name).set_item(Some(item)).send().await.unwrap();
        written.push((id, rev));
    }
    written
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_table_keeps_working_and_names_the_upgrade() {
    let name = table_name("old");
    let written = old_table(&name, false, 5).await;
    let backend = open(&name, false, "").await;
    let (id, rev) = &written[2];
    let doc = backend.get(id).await.unwrap().unwrap();
    assert_eq!(&doc.rev.0, rev);
    assert_eq!(doc.body["value"], json!(2));
    let query = Query { user_id: "old".into(), namespace: Some("ns".into()), projection: Projection::All };
    assert_eq!(backend.query(&query, 10, None).await.unwrap().items.len(), 5);
    assert_eq!(backend.scan(10, None).await.unwrap().items.len(), 5);
    let info = backend.revisions(id).await.unwrap().unwrap();
    assert_eq!(info.ancestry.revisions().collect::<Vec<_>>(), vec![Revision(rev.clone())]);

    match backend.layout().await.unwrap() {
        LayoutState::NeedsUpgrade(why) => assert!(why.contains(FEED_INDEX), "{why}"),
        other => panic!("an old table reported {other:?}"),
    }
    for outcome in [
        backend.changes(None, 10).await.map(|_| ()),
        backend.change_position().await.map(|_| ()),
        backend.all_docs(&IdRange::all(), 10, None).await.map(|_| ()),
    ] {
        let err = outcome.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Misconfigured);
        assert!(err.to_string().contains("agentstore upgrade"), "{err}");
    }

    // New writes continue the old generation in the new form.
    let next =
        backend.put(id, &body("old", "k2", 20), Precondition::MatchRevision(Revision(rev.clone()))).await.unwrap();
    assert_eq!(generation(&next), 3 + 1);
    let (other, other_rev) = &written[0];
    backend.delete(other, &Revision(other_rev.clone())).await.unwrap();
    assert_eq!(generation(&backend.revisions(other).await.unwrap().unwrap().rev), 2);
    assert_eq!(backend.scan(10, None).await.unwrap().items.len(), 4);

    // Erasure keeps working before the upgrade (by a full scan): documents and the tombstone.
    let stays = "other:ns:000";
    backend.put(stays, &body("other", "k", 1), Precondition::MustNotExist).await.unwrap();
    assert_eq!(backend.erase_prefix("old:").await.unwrap(), 5);
    for (id, _) in &written {
        assert_eq!(backend.revisions(id).await.unwrap(), None, "{id}");
    }
    assert!(backend.get(stays).await.unwrap().is_some());

    // dynalite 4.0.0 cannot add an index to an existing table: the upgrade says so.
    let err = backend.upgrade_page(None, 10).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");
    assert!(err.to_string().contains("dynalite"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_in_place_interrupted_and_resumed() {
    let name = table_name("upgrade");
    let written = old_table(&name, true, 15).await;
    let backend = open(&name, false, "").await;
    assert!(matches!(backend.layout().await.unwrap(), LayoutState::NeedsUpgrade(_)));
    assert!(backend.changes(None, 10).await.is_err());

    // The service writes: a new write on an old table has the new layout already.
    let (id, rev) = &written[14];
    backend.put(id, &body("old", "k14", 140), Precondition::MatchRevision(Revision(rev.clone()))).await.unwrap();
    // A first run stops after two steps (as if killed).
    let first = backend.upgrade_page(None, 4).await.unwrap();
    let second = backend.upgrade_page(first.next.as_deref(), 4).await.unwrap();
    assert_eq!((first.examined, second.examined), (4, 4));
    let upgraded_first = first.upgraded + second.upgraded;
    assert!((7..=8).contains(&upgraded_first), "{upgraded_first}");
    // The rerun starts over and upgrades only what is left.
    let (mut examined, mut upgraded, mut token) = (0, 0, None);
    loop {
        let step = backend.upgrade_page(token.as_deref(), 4).await.unwrap();
        examined += step.examined;
        upgraded += step.upgraded;
        token = step.next;
        if token.is_none() {
            break;
        }
    }
    assert_eq!(examined, 15);
    assert_eq!(upgraded_first + upgraded, 14, "each old document upgraded exactly once, the rewritten one never");
    assert!(matches!(backend.layout().await.unwrap(), LayoutState::NeedsUpgrade(_)), "marker before finish");
    backend.finish_upgrade().await.unwrap();
    assert_eq!(backend.layout().await.unwrap(), LayoutState::Current);
    // Idempotent: nothing left to do.
    let again = backend.upgrade_page(None, 100).await.unwrap();
    assert_eq!((again.examined, again.upgraded), (16, 0), "15 documents and the marker");

    settle().await;
    let (changes, _) = all_changes(&backend, None, 6).await;
    let mut fed: Vec<String> = changes.into_iter().map(|c| c.id).collect();
    fed.sort();
    let ids: Vec<String> = written.iter().map(|(id, _)| id.clone()).collect();
    assert_eq!(fed, ids);
    let listed: Vec<String> =
        backend.all_docs(&IdRange::all(), 100, None).await.unwrap().items.into_iter().map(|d| d.id).collect();
    assert_eq!(listed, ids);
    let (id, rev) = &written[3];
    assert_eq!(backend.revisions(id).await.unwrap().unwrap().rev.0, *rev);
    // Another process opening the upgraded table sees it current.
    assert_eq!(open(&name, false, "").await.layout().await.unwrap(), LayoutState::Current);
}

// ---------------------------------------------------------------------------------------------
// A follower while several writers write.
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_sees_the_final_state_of_every_document() {
    let name = table_name("follow");
    let backend = Arc::new(open(&name, true, "").await);
    let start = backend.change_position().await.unwrap();
    let writers = (0..4u64).map(|w| {
        let name = name.clone();
        tokio::spawn(async move {
            // Each writer its own client, as separate processes would be.
            let backend = open(&name, false, "").await;
            for n in 0..40u64 {
                let id = format!("f:ns:{}", (n * 7 + w * 3) % 20);
                let current = backend.get(&id).await.unwrap();
                let outcome = match (&current, n % 5) {
                    (Some(doc), 4) => backend.delete(&id, &doc.rev).await.map(drop),
                    (Some(doc), _) => backend
                        .put(&id, &body("f", &id, n as i64), Precondition::MatchRevision(doc.rev.clone()))
                        .await
                        .map(|_| ()),
                    (None, _) => {
                        backend.put(&id, &body("f", &id, n as i64), Precondition::MustNotExist).await.map(|_| ())
                    }
                };
                match outcome {
                    Ok(()) => {}
                    Err(e) if matches!(e.kind(), ErrorKind::Conflict | ErrorKind::NotFound) => {}
                    Err(e) => panic!("writer {w}: {e}"),
                }
            }
        })
    });
    let (done_tx, done_rx) = tokio::sync::watch::channel(None::<std::time::Instant>);
    let follower = {
        let backend = backend.clone();
        tokio::spawn(async move {
            let mut seen: HashMap<String, (Revision, bool)> = HashMap::new();
            let mut since = start;
            loop {
                let read_at = std::time::Instant::now();
                let page = backend.changes(Some(&since), 7).await.unwrap();
                let caught_up = page.changes.len() < 7;
                for change in page.changes {
                    seen.insert(change.id, (change.rev, change.deleted));
                }
                since = page.last_seq;
                // Done once a read that began a settle window after the last write has caught up.
                let writers_done = *done_rx.borrow();
                if caught_up && writers_done.is_some_and(|at| read_at > at + Duration::from_millis(SETTLE_MS + 200)) {
                    return seen;
                }
                if caught_up {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        })
    };
    for writer in writers {
        writer.await.unwrap();
    }
    done_tx.send(Some(std::time::Instant::now())).unwrap();
    let seen = follower.await.unwrap();
    for n in 0..20 {
        let id = format!("f:ns:{n}");
        let truth = backend.revisions(&id).await.unwrap().map(|info| (info.rev, info.deleted));
        assert_eq!(seen.get(&id).cloned(), truth, "{id}");
    }
}

/// A database of the catalog is a table of its own beside the data-store table: the document
/// model's indexes without the user/namespace GSI (only the data store answers listings), every
/// item in it (documents, tombstones, local documents, the layout marker), and gone with it.
#[tokio::test]
async fn a_database_is_a_table_without_the_listing_index_and_a_drop_deletes_it() {
    let data_store = table_name("catalog");
    let store = open(&data_store, true, "").await;
    let server = servers::dynamodb().expect("dynalite");
    let url: agentstore::backend::BackendUrl = server.table_url(&data_store).parse().expect("url");
    let catalog = agentstore::backend::catalog::open_catalog(&url).await.expect("catalog");
    let name = agentstore::backend::catalog::DbName::parse("a/b").expect("name");
    let db = catalog.create(&name).await.expect("create");
    let table = format!("{data_store}.db.a.2fb");

    let described = store.client().describe_table().table_name(&table).send().await.expect("describe");
    let mut indexes: Vec<String> = described
        .table()
        .map(|t| t.global_secondary_indexes().iter().filter_map(|g| g.index_name().map(str::to_owned)).collect())
        .unwrap_or_default();
    indexes.sort();
    let mut expected = vec![FEED_INDEX.to_owned(), layout::ID_INDEX.to_owned()];
    expected.sort();
    assert_eq!(indexes, expected, "the document model's indexes, not the user/namespace one");
    assert_eq!(db.layout().await.expect("layout"), LayoutState::Current);
    let refused = db
        .query(&Query { user_id: "u".into(), namespace: Some("ns".into()), projection: Projection::All }, 10, None)
        .await
        .err()
        .map(|e| e.kind());
    assert_eq!(refused, Some(ErrorKind::Misconfigured), "listings are the data store's");

    let rev = db.put("u:ns:k", &body("u", "k", 1), Precondition::MustNotExist).await.expect("put");
    db.delete("u:ns:k", &rev).await.expect("a tombstone");
    db.put_local("cp", &Map::new(), Precondition::None).await.expect("local");
    let items = store.client().scan().table_name(&table).send().await.expect("scan").count();
    assert!(items >= 3, "tombstone, local document and marker are items of the database's table: {items}");
    assert!(store.get("u:ns:k").await.expect("get").is_none(), "nothing in the data-store table");

    assert!(agentstore::backend::catalog::Catalog::delete(&*catalog, &name).await.expect("drop"));
    let gone = store.client().describe_table().table_name(&table).send().await;
    let table_left = gone.ok().and_then(|d| d.table().and_then(|t| t.table_status().cloned()));
    assert!(
        matches!(table_left, None | Some(aws_sdk_dynamodb::types::TableStatus::Deleting)),
        "the table is deleted: {table_left:?}"
    );
}

/// A database table counts its live documents exactly (the CouchDB face's `doc_count`): each
/// write, delete, re-creation, bulk write, replicated tombstone and erasure of this process
/// shows in the very next count, though counts are remembered for a second; chunk items,
/// tombstones, local documents and the layout marker are not counted. Another handle on the same
/// table that remembers nothing (`count_max_age_ms=0`) counts the same at once. The data-store
/// table keeps no exact count (docs/databases.md says why).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_counts_its_live_documents_exactly_at_once() {
    let data_store = table_name("count");
    let store = open(&data_store, true, "").await;
    assert_eq!(store.exact_count().await.expect("count"), None, "the data-store table counts nothing exactly");
    let server = servers::dynamodb().expect("dynalite");
    let catalog_at = |extra: &str| -> agentstore::backend::BackendUrl {
        format!("{}{extra}", server.table_url(&data_store)).parse().expect("url")
    };
    let catalog = agentstore::backend::catalog::open_catalog(&catalog_at("")).await.expect("catalog");
    let name = agentstore::backend::catalog::DbName::parse("counted").expect("name");
    let db = catalog.create(&name).await.expect("create");
    let uncached_catalog =
        agentstore::backend::catalog::open_catalog(&catalog_at("&count_max_age_ms=0")).await.expect("catalog");
    let other = uncached_catalog.open(&name).await.expect("open").expect("the database exists");
    let counts = || async { (db.exact_count().await.expect("count"), other.exact_count().await.expect("count")) };
    assert_eq!(counts().await, (Some(0), Some(0)), "a new database");

    let mut revs = HashMap::new();
    for key in ["a", "b", "c"] {
        let rev = db.put(&format!("u:ns:{key}"), &body("u", key, 1), Precondition::MustNotExist).await.expect("put");
        revs.insert(key, rev);
    }
    // A body large enough to be stored in chunk items, and a design document.
    let big =
        json!({"userId": "u", "namespace": "ns", "key": "big", "value": crate::common::corpus::noise(800_000, 5)});
    db.put("u:ns:big", big.as_object().expect("object"), Precondition::MustNotExist).await.expect("big");
    db.put("_design/d", &Map::new(), Precondition::MustNotExist).await.expect("design document");
    db.put_local("checkpoint", &Map::new(), Precondition::None).await.expect("local");
    assert_eq!(counts().await, (Some(5), Some(5)), "3 small, 1 chunked, 1 design; no local document or chunk");

    let updated = db.put("u:ns:a", &body("u", "a", 2), Precondition::MatchRevision(revs["a"].clone())).await;
    revs.insert("a", updated.expect("update"));
    assert_eq!(counts().await, (Some(5), Some(5)), "an update adds nothing");
    db.delete("u:ns:b", &revs["b"]).await.expect("delete");
    assert_eq!(counts().await, (Some(4), Some(4)), "a tombstone is not counted");
    db.put("u:ns:b", &body("u", "b", 3), Precondition::MustNotExist).await.expect("re-create over the tombstone");
    assert_eq!(counts().await, (Some(5), Some(5)), "a re-created document counts again");

    let bulk: Vec<BulkWrite> = (0..30)
        .map(|n| BulkWrite {
            id: format!("u:ns:bulk{n}"),
            body: body("u", &format!("bulk{n}"), n),
            precondition: Precondition::MustNotExist,
        })
        .collect();
    assert!(db.bulk_write(bulk).await.expect("bulk").iter().all(Result::is_ok));
    assert_eq!(counts().await, (Some(35), Some(35)), "a bulk write");

    // A replicated tombstone on a live document, made elsewhere.
    let current = db.revisions("u:ns:c").await.expect("revisions").expect("c exists");
    let next = RevisionId::next_after(Some(generation(&current.rev))).expect("revision").to_revision();
    let ancestry = vec![next.as_str().to_owned(), current.rev.as_str().to_owned()];
    let replicated = agentstore::backend::ReplicatedRevision {
        rev: next,
        ancestry,
        deleted: true,
        body: Map::new(),
        precondition: agentstore::backend::Precondition::None,
    };
    db.put_replicated("u:ns:c", &replicated).await.expect("replicated delete");
    assert_eq!(counts().await, (Some(34), Some(34)), "a replicated tombstone");

    assert_eq!(db.erase_prefix("u:ns:bulk").await.expect("erase"), 30);
    assert_eq!(counts().await, (Some(4), Some(4)), "an erasure");

    assert!(agentstore::backend::catalog::Catalog::delete(&*catalog, &name).await.expect("drop"));
}
