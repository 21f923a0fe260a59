//! The DynamoDB adapter against a wiremock server speaking DynamoDB's JSON protocol, for what a
//! real (or local) server cannot show on demand: throttling, 5xx answers, UnprocessedItems,
//! conditional failures and lost races, a missing table or index, refused credentials, the exact
//! request the adapter sends for a projection on the reserved word `key`, and the document
//! model's requests (each write attempt stamped afresh, reads before writes, index creation).
//!
//! Every call is `POST /` with `X-Amz-Target: DynamoDB_20120810.<Operation>`; errors are HTTP 400
//! (500 for internal errors) with `{"__type": "...#Code", "message": "..."}`.
//!
//! The adapter is opened exactly as in production (`DynamoDbBackend::open`, standard retry mode,
//! `SDK_ATTEMPTS` attempts, real backoff), so the scenarios that exhaust every retry take seconds; they run
//! concurrently inside one test to keep the whole file fast.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, Once};

use agentstore::backend::dynamodb::layout;
use agentstore::backend::dynamodb::{DynamoConfig, DynamoDbBackend};
use agentstore::backend::{BulkWrite, DocumentBackend, Precondition, Projection, Query, Revision};
use agentstore::{ErrorKind, Result};
use serde_json::{json, Map, Value};
use wiremock::matchers::{header, method, path};
use wiremock::{Mock, MockServer, Request, Respond, ResponseTemplate};

use crate::common::request_json;

const TABLE: &str = "agent_data_store";
const INDEX: &str = "idx-user-namespace";
const TARGET: &str = "x-amz-target";
const AWS_JSON: &str = "application/x-amz-json-1.0";
/// What `DynamoDbBackend::open` configures: the SDK's standard retry, the one owner of retries.
const SDK_ATTEMPTS: usize = agentstore::backend::dynamodb::config::SDK_ATTEMPTS as usize;
/// The adapter's rounds of resending UnprocessedItems, after the first BatchWriteItem.
const UNPROCESSED_RETRIES: usize = 8;

// ---------------------------------------------------------------------------------------------
// Helpers.
// ---------------------------------------------------------------------------------------------

/// Dummy credentials in the environment, set once before any client is built.
fn credentials() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        std::env::set_var("AWS_ACCESS_KEY_ID", "AKIDMOCKMOCKMOCK");
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "mock-secret-key");
        std::env::set_var("AWS_EC2_METADATA_DISABLED", "true");
    });
}

fn target(operation: &str) -> String {
    format!("DynamoDB_20120810.{operation}")
}

/// A mock for one operation (any body).
fn operation(name: &str) -> wiremock::MockBuilder {
    Mock::given(method("POST")).and(path("/")).and(header(TARGET, target(name).as_str()))
}

/// A DynamoDB JSON answer.
fn answer(status: u16, body: Value) -> ResponseTemplate {
    ResponseTemplate::new(status).set_body_raw(body.to_string().into_bytes(), AWS_JSON)
}

/// A DynamoDB error answer with this code.
fn error(status: u16, code: &str, message: &str) -> ResponseTemplate {
    answer(status, json!({"__type": format!("com.amazonaws.dynamodb.v20120810#{code}"), "message": message}))
}

fn table_description(indexes: Value) -> Value {
    json!({"Table": {
        "TableName": TABLE,
        "TableStatus": "ACTIVE",
        "KeySchema": [{"AttributeName": "_id", "KeyType": "HASH"}],
        "AttributeDefinitions": [
            {"AttributeName": "_id", "AttributeType": "S"},
            {"AttributeName": "userId", "AttributeType": "S"},
            {"AttributeName": "namespace", "AttributeType": "S"}
        ],
        "BillingModeSummary": {"BillingMode": "PAY_PER_REQUEST"},
        "GlobalSecondaryIndexes": indexes
    }})
}

fn standard_index() -> Value {
    json!([{
        "IndexName": INDEX,
        "KeySchema": [
            {"AttributeName": "userId", "KeyType": "HASH"},
            {"AttributeName": "namespace", "KeyType": "RANGE"}
        ],
        "Projection": {"ProjectionType": "ALL"},
        "IndexStatus": "ACTIVE"
    }])
}

/// A mock server whose table and index are there and ACTIVE (the previous release's layout),
/// holding no item unless a test mounts reads of its own (the fallbacks answer "nothing").
async fn server_with_table() -> MockServer {
    credentials();
    let server = MockServer::start().await;
    operation("DescribeTable").respond_with(answer(200, table_description(standard_index()))).mount(&server).await;
    mount_empty_reads(&server).await;
    server
}

/// GetItem and BatchGetItem finding nothing, and UpdateItem (the purge trace an erasure bumps)
/// succeeding, below any mock a test mounts itself.
async fn mount_empty_reads(server: &MockServer) {
    operation("GetItem").respond_with(answer(200, json!({}))).with_priority(10).mount(server).await;
    operation("UpdateItem").respond_with(answer(200, json!({}))).with_priority(10).mount(server).await;
    operation("BatchGetItem")
        .respond_with(answer(200, json!({"Responses": {TABLE: []}, "UnprocessedKeys": {}})))
        .with_priority(10)
        .mount(server)
        .await;
}

/// The document model's two indexes, as DescribeTable lists them.
fn model_indexes() -> Vec<Value> {
    [(layout::FEED_INDEX, "_seq"), (layout::ID_INDEX, "_id")]
        .into_iter()
        .map(|(name, range)| {
            json!({
                "IndexName": name,
                "KeySchema": [
                    {"AttributeName": "_shard", "KeyType": "HASH"},
                    {"AttributeName": range, "KeyType": "RANGE"}
                ],
                "Projection": {"ProjectionType": "INCLUDE", "NonKeyAttributes": ["_rev", "_deleted"]},
                "IndexStatus": "ACTIVE"
            })
        })
        .collect()
}

/// A mock server whose table has this release's layout (every index, the layout marker), with
/// `ids` in the id index.
async fn server_with_current_layout(ids: &[String]) -> MockServer {
    server_with_current_layout_querying(IdIndex { ids: ids.to_vec() }).await
}

/// The same, with `query` answering every Query.
async fn server_with_current_layout_querying(query: impl wiremock::Respond + 'static) -> MockServer {
    credentials();
    let server = MockServer::start().await;
    let mut indexes = standard_index().as_array().cloned().unwrap_or_default();
    indexes.extend(model_indexes());
    operation("DescribeTable").respond_with(answer(200, table_description(Value::Array(indexes)))).mount(&server).await;
    operation("GetItem")
        .and(wiremock::matchers::body_partial_json(json!({"Key": {"_id": {"S": layout::MARKER_ID}}})))
        .respond_with(answer(
            200,
            json!({"Item": {"_id": {"S": layout::MARKER_ID}, "_meta": {"S": "layout"}, "version": {"N": "2"}}}),
        ))
        .mount(&server)
        .await;
    operation("Query").respond_with(query).mount(&server).await;
    mount_empty_reads(&server).await;
    server
}

/// Answers id-index queries: the ids of the shard asked for, in one page.
struct IdIndex {
    ids: Vec<String>,
}

impl Respond for IdIndex {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let body = request_json(request);
        let shard: u32 =
            body["ExpressionAttributeValues"][":shard"]["N"].as_str().and_then(|n| n.parse().ok()).unwrap_or(99);
        let mut items: Vec<Value> = self
            .ids
            .iter()
            .filter(|id| layout::shard_of(id) == shard)
            .map(|id| json!({"_id": {"S": id}, "_shard": {"N": shard.to_string()}}))
            .collect();
        items.sort_by(|a, b| a["_id"]["S"].as_str().cmp(&b["_id"]["S"].as_str()));
        answer(200, json!({"Items": items, "Count": items.len()}))
    }
}

async fn open(server: &MockServer) -> Result<DynamoDbBackend> {
    credentials();
    let config = DynamoConfig::parse(&format!("dynamodb://{TABLE}?region=us-east-1&endpoint={}", server.uri()))?;
    DynamoDbBackend::open(&config).await
}

/// The requests the server received for one operation, in order.
async fn received(server: &MockServer, name: &str) -> Vec<Request> {
    let wanted = target(name);
    server
        .received_requests()
        .await
        .expect("request recording is on")
        .into_iter()
        .filter(|r| r.headers.get(TARGET).and_then(|v| v.to_str().ok()) == Some(wanted.as_str()))
        .collect()
}

/// A stored item as GetItem returns it.
fn stored_item(id: &str) -> Value {
    json!({
        "_id": {"S": id},
        "_rev": {"S": "1-00000000000000aa"},
        "userId": {"S": "user_1"},
        "namespace": {"S": "default"},
        "key": {"S": "greeting"},
        "value": {"M": {"text": {"S": "hello"}, "n": {"N": "42"}}},
        "accessCount": {"N": "3"}
    })
}

fn small_body(key: &str) -> Map<String, Value> {
    json!({"userId": "user_1", "namespace": "bulk", "key": key, "value": {"n": 1}, "accessCount": 0})
        .as_object()
        .cloned()
        .expect("object")
}

fn query(projection: Projection) -> Query {
    Query { user_id: "user_1".into(), namespace: Some("default".into()), projection }
}

/// Asserts an outcome is an error of `kind` whose message contains every one of `words`.
fn expect_error<T: std::fmt::Debug>(
    outcome: Result<T>,
    kind: ErrorKind,
    words: &[&str],
    what: &str,
) -> std::result::Result<(), String> {
    match outcome {
        Ok(value) => Err(format!("{what}: expected a {kind} error, got Ok({value:?})")),
        Err(err) if err.kind() != kind => Err(format!("{what}: expected {kind}, got {}: {err}", err.kind())),
        Err(err) => match words.iter().find(|w| !err.message().to_lowercase().contains(&w.to_lowercase())) {
            Some(missing) => Err(format!("{what}: message {:?} does not mention {missing:?}", err.message())),
            None => Ok(()),
        },
    }
}

// ---------------------------------------------------------------------------------------------
// BatchWriteItem with UnprocessedItems.
// ---------------------------------------------------------------------------------------------

/// Answers BatchWriteItem, leaving chosen ids unprocessed: once (the first time each is seen) or
/// on every request.
struct BatchWriter {
    unprocessed: HashSet<String>,
    always: bool,
    seen: Mutex<HashMap<String, usize>>,
}

impl BatchWriter {
    fn new(unprocessed: &[&str], always: bool) -> Self {
        BatchWriter {
            unprocessed: unprocessed.iter().map(|s| s.to_string()).collect(),
            always,
            seen: Mutex::new(HashMap::new()),
        }
    }
}

impl Respond for BatchWriter {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let Ok(body) = serde_json::from_slice::<Value>(&request.body) else {
            return error(400, "SerializationException", "body is not JSON");
        };
        let Some(writes) = body["RequestItems"][TABLE].as_array() else {
            return error(400, "ValidationException", "no RequestItems for the table");
        };
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let mut left = Vec::new();
        for write in writes {
            let id = write_id(write);
            let count = seen.entry(id.clone()).or_insert(0);
            *count += 1;
            if self.unprocessed.contains(&id) && (self.always || *count == 1) {
                left.push(write.clone());
            }
        }
        if left.is_empty() {
            answer(200, json!({"UnprocessedItems": {}}))
        } else {
            answer(200, json!({"UnprocessedItems": {TABLE: left}}))
        }
    }
}

/// The `_id` a BatchWriteItem entry writes or deletes.
fn write_id(write: &Value) -> String {
    let put = &write["PutRequest"]["Item"]["_id"]["S"];
    let delete = &write["DeleteRequest"]["Key"]["_id"]["S"];
    put.as_str().or(delete.as_str()).unwrap_or("?").to_owned()
}

/// The `_id`s of one received BatchWriteItem body, in order.
fn batch_ids(request: &Request) -> Vec<String> {
    request_json(request)["RequestItems"][TABLE]
        .as_array()
        .map(|writes| writes.iter().map(write_id).collect())
        .unwrap_or_default()
}

/// How many times each id was sent in these BatchWriteItem requests.
fn times_sent(requests: &[Request]) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for id in requests.iter().flat_map(batch_ids) {
        *counts.entry(id).or_insert(0) += 1;
    }
    counts
}

fn unconditional_writes(ids: &[String]) -> Vec<BulkWrite> {
    ids.iter().map(|id| BulkWrite { id: id.clone(), body: small_body(id), precondition: Precondition::None }).collect()
}

fn sorted(mut ids: Vec<String>) -> Vec<String> {
    ids.sort();
    ids
}

/// An erasure deletes through BatchWriteItem: deletions left unprocessed are resent, each once
/// more, until done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn erasure_resends_unprocessed_deletions() {
    let ids: Vec<String> = (0..30).map(|i| format!("bulk-{i:02}")).collect();
    let server = server_with_current_layout(&ids).await;
    let once = ["bulk-03", "bulk-17", "bulk-27"];
    operation("BatchWriteItem").respond_with(BatchWriter::new(&once, false)).mount(&server).await;
    let backend = open(&server).await.expect("open");

    assert_eq!(backend.erase_prefix("bulk-").await.expect("erase"), 30);
    let sent = times_sent(&received(&server, "BatchWriteItem").await);
    for id in &ids {
        let expected = if once.contains(&id.as_str()) { 2 } else { 1 };
        assert_eq!(sent.get(id), Some(&expected), "{id} deleted {:?} times", sent.get(id));
    }
    // Every query asked its shard for the prefix only.
    for query in received(&server, "Query").await {
        let body = request_json(&query);
        assert_eq!(body["IndexName"], layout::ID_INDEX);
        assert_eq!(body["ExpressionAttributeValues"][":prefix"], json!({"S": "bulk-"}));
    }
}

/// An erasure bumps the purge trace both before its first deletion and after its last: a crash
/// between the deletions and the bump after would otherwise leave other instances' remembered
/// counts passing their check (issue 36).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn erasure_bumps_the_purge_trace_before_and_after_its_deletions() {
    let ids: Vec<String> = (0..5).map(|i| format!("bulk-{i:02}")).collect();
    let server = server_with_current_layout(&ids).await;
    operation("BatchWriteItem").respond_with(BatchWriter::new(&[], false)).mount(&server).await;
    let backend = open(&server).await.expect("open");

    assert_eq!(backend.erase_prefix("bulk-").await.expect("erase"), 5);
    let order: Vec<String> = server
        .received_requests()
        .await
        .expect("request recording is on")
        .iter()
        .filter_map(|r| r.headers.get(TARGET).and_then(|v| v.to_str().ok()).map(str::to_owned))
        .filter(|t| t == &target("UpdateItem") || t == &target("BatchWriteItem"))
        .collect();
    let first_delete = order.iter().position(|t| t == &target("BatchWriteItem")).expect("a deletion");
    let last_delete = order.iter().rposition(|t| t == &target("BatchWriteItem")).expect("a deletion");
    assert!(order[..first_delete].contains(&target("UpdateItem")), "no bump before the deletions: {order:?}");
    assert!(order[last_delete..].contains(&target("UpdateItem")), "no bump after the deletions: {order:?}");
}

/// Deletions DynamoDB never processes fail the erasure as `Unavailable` (rerunning it finishes).
async fn persistently_unprocessed_items() -> std::result::Result<(), String> {
    let ids: Vec<String> = (0..10).map(|i| format!("bulk-{i:02}")).collect();
    let server = server_with_current_layout(&ids).await;
    let stuck = ["bulk-02"];
    operation("BatchWriteItem").respond_with(BatchWriter::new(&stuck, true)).mount(&server).await;
    let backend = open(&server).await.map_err(|e| format!("open: {e}"))?;
    let outcome = backend.erase_prefix("bulk-").await;
    expect_error(outcome, ErrorKind::Unavailable, &["unprocessed"], "erasure")?;
    let sent = times_sent(&received(&server, "BatchWriteItem").await);
    match sent.get("bulk-02") {
        Some(&n) if n == 1 + UNPROCESSED_RETRIES => Ok(()),
        other => Err(format!("the stuck deletion was sent {other:?} times, expected {}", 1 + UNPROCESSED_RETRIES)),
    }
}

// ---------------------------------------------------------------------------------------------
// BatchGetItem with UnprocessedKeys.
// ---------------------------------------------------------------------------------------------

/// Answers BatchGetItem from a set of stored ids, leaving chosen ids unprocessed: the first time
/// each is asked for, or every time.
struct BatchReader {
    stored: HashSet<String>,
    unprocessed: HashSet<String>,
    always: bool,
    seen: Mutex<HashMap<String, usize>>,
}

impl Respond for BatchReader {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let Ok(body) = serde_json::from_slice::<Value>(&request.body) else {
            return error(400, "SerializationException", "body is not JSON");
        };
        let Some(keys) = body["RequestItems"][TABLE]["Keys"].as_array() else {
            return error(400, "ValidationException", "no RequestItems for the table");
        };
        if keys.len() > 100 {
            return error(400, "ValidationException", "Too many items requested for the BatchGetItem call");
        }
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let (mut items, mut left) = (Vec::new(), Vec::new());
        for key in keys {
            let id = key["_id"]["S"].as_str().unwrap_or_default().to_owned();
            let count = seen.entry(id.clone()).or_insert(0);
            *count += 1;
            if self.unprocessed.contains(&id) && (self.always || *count == 1) {
                left.push(key.clone());
            } else if self.stored.contains(&id) {
                let mut item = stored_item(&id);
                item["key"] = json!({"S": id});
                items.push(item);
            }
        }
        let unprocessed = if left.is_empty() { json!({}) } else { json!({TABLE: {"Keys": left}}) };
        answer(200, json!({"Responses": {TABLE: items}, "UnprocessedKeys": unprocessed}))
    }
}

/// The `_id`s of one received BatchGetItem body, and whether it asked for consistent reads.
fn batch_get_ids(request: &Request) -> (Vec<String>, bool) {
    let body = request_json(request);
    let wanted = &body["RequestItems"][TABLE];
    let ids = wanted["Keys"]
        .as_array()
        .map(|keys| keys.iter().map(|k| k["_id"]["S"].as_str().unwrap_or("?").to_owned()).collect())
        .unwrap_or_default();
    (ids, wanted["ConsistentRead"] == json!(true))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_many_reads_in_batches_and_asks_again_for_unprocessed_keys() {
    let server = server_with_table().await;
    let stored: Vec<String> = (0..150).map(|i| format!("doc-{i:03}")).collect();
    let once = ["doc-004", "doc-120", "doc-149"];
    let reader = BatchReader {
        stored: stored.iter().filter(|id| *id != "doc-010").cloned().collect(),
        unprocessed: once.iter().map(|s| s.to_string()).collect(),
        always: false,
        seen: Mutex::new(HashMap::new()),
    };
    operation("BatchGetItem").respond_with(reader).mount(&server).await;
    let backend = open(&server).await.expect("open");

    // Reversed, with a missing id and a duplicate.
    let mut ids: Vec<String> = stored.iter().rev().cloned().collect();
    ids.push("doc-004".into());
    let answers = backend.get_many(&ids).await.expect("get_many");
    assert_eq!(answers.len(), ids.len());
    for (id, answer) in ids.iter().zip(&answers) {
        match answer {
            None => assert_eq!(id, "doc-010", "only the id that is not stored is missing"),
            Some(doc) => {
                assert_eq!(&doc.id, id, "answers in the order asked");
                assert_eq!(doc.body["key"], json!(id));
            }
        }
    }
    let requests: Vec<(Vec<String>, bool)> =
        received(&server, "BatchGetItem").await.iter().map(batch_get_ids).collect();
    assert!(requests.iter().all(|(_, consistent)| *consistent), "every BatchGetItem reads consistently");
    assert!(received(&server, "GetItem").await.is_empty(), "no single reads");
    // Two calls of 100 and 50 distinct ids (in either order, they run at once), then the keys left
    // unprocessed, asked again.
    let mut first: Vec<usize> = requests[..2].iter().map(|(ids, _)| ids.len()).collect();
    first.sort();
    assert_eq!(first, [50, 100]);
    let mut again: Vec<String> = requests[2..].iter().flat_map(|(ids, _)| ids.clone()).collect();
    again.sort();
    assert_eq!(again, once, "only the unprocessed keys are asked again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_many_fails_when_keys_stay_unprocessed() {
    let server = server_with_table().await;
    let reader = BatchReader {
        stored: ["a", "b"].iter().map(|s| s.to_string()).collect(),
        unprocessed: ["b".to_string()].into(),
        always: true,
        seen: Mutex::new(HashMap::new()),
    };
    operation("BatchGetItem").respond_with(reader).mount(&server).await;
    let backend = open(&server).await.expect("open");
    let outcome = backend.get_many(&["a".into(), "b".into()]).await;
    expect_error(outcome, ErrorKind::Unavailable, &["unprocessed"], "keys never processed").unwrap();
    let requests = received(&server, "BatchGetItem").await;
    assert_eq!(requests.len(), 1 + UNPROCESSED_RETRIES, "the first call and every retry");
    for request in &requests[1..] {
        assert_eq!(batch_get_ids(request).0, ["b"]);
    }
}

// ---------------------------------------------------------------------------------------------
// Throttling and 5xx: the SDK's standard retry.
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_succeeds_after_two_throttled_attempts() {
    let server = server_with_table().await;
    operation("GetItem")
        .respond_with(error(
            400,
            "ProvisionedThroughputExceededException",
            "The level of configured provisioned throughput for the table was exceeded.",
        ))
        .up_to_n_times(2)
        .mount(&server)
        .await;
    operation("GetItem")
        .respond_with(answer(200, json!({"Item": stored_item("user_1:default:Z3JlZXRpbmc=")})))
        .mount(&server)
        .await;
    let backend = open(&server).await.expect("open");

    let doc = backend.get("user_1:default:Z3JlZXRpbmc=").await.expect("get after throttling").expect("found");
    assert_eq!(doc.id, "user_1:default:Z3JlZXRpbmc=");
    assert_eq!(doc.rev, Revision("1-00000000000000aa".into()));
    assert_eq!(doc.body["value"], json!({"n": 42, "text": "hello"}));
    assert_eq!(doc.body["accessCount"], json!(3));
    let attempts = received(&server, "GetItem").await;
    assert_eq!(attempts.len(), 3, "two throttled attempts and the one that worked");
    for attempt in &attempts {
        let body = request_json(attempt);
        assert_eq!(body["TableName"], TABLE);
        assert_eq!(body["ConsistentRead"], true, "get reads strongly consistent");
        assert_eq!(body["Key"], json!({"_id": {"S": "user_1:default:Z3JlZXRpbmc="}}));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_succeeds_after_two_throttling_exceptions() {
    let server = server_with_table().await;
    operation("Query")
        .respond_with(error(400, "ThrottlingException", "Rate exceeded"))
        .up_to_n_times(2)
        .mount(&server)
        .await;
    operation("Query")
        .respond_with(answer(
            200,
            json!({"Items": [stored_item("user_1:default:Z3JlZXRpbmc=")], "Count": 1, "ScannedCount": 1}),
        ))
        .mount(&server)
        .await;
    let backend = open(&server).await.expect("open");

    let page = backend.query(&query(Projection::All), 10, None).await.expect("query after throttling");
    assert_eq!(page.items.len(), 1);
    assert_eq!(page.items[0].body["key"], "greeting");
    assert_eq!(page.next, None, "no LastEvaluatedKey, no next page");
    assert_eq!(received(&server, "Query").await.len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_is_retried_after_an_internal_server_error() {
    let server = server_with_table().await;
    operation("PutItem")
        .respond_with(error(500, "InternalServerError", "Internal server error"))
        .up_to_n_times(1)
        .mount(&server)
        .await;
    operation("PutItem").respond_with(answer(200, json!({}))).mount(&server).await;
    let backend = open(&server).await.expect("open");

    let rev = backend.put("user_1:bulk:aw==", &small_body("k"), Precondition::MustNotExist).await.expect("put");
    let attempts = received(&server, "PutItem").await;
    assert_eq!(attempts.len(), 2);
    // The retry is the same write (same item, revision and condition) with a fresh feed position:
    // a resent request must not carry the position of an attempt that began earlier.
    let (mut first, mut second) = (request_json(&attempts[0]), request_json(&attempts[1]));
    let positions = [first["Item"]["_seq"]["S"].take(), second["Item"]["_seq"]["S"].take()];
    assert!(positions[0].is_string() && positions[1].is_string(), "{positions:?}");
    assert!(positions[0].as_str() < positions[1].as_str(), "{positions:?}");
    assert_eq!(first, second);
    assert_eq!(second["Item"]["_rev"]["S"], rev.as_str());
    assert_eq!(second["Item"]["_shard"]["N"], layout::shard_of("user_1:bulk:aw==").to_string());
}

/// GetItem always throttled: `SDK_ATTEMPTS` attempts, then `Unavailable` mentioning throttling.
async fn get_always_throttled() -> std::result::Result<(), String> {
    let server = server_with_table().await;
    operation("GetItem")
        .respond_with(error(
            400,
            "ProvisionedThroughputExceededException",
            "The level of configured provisioned throughput for the table was exceeded.",
        ))
        .mount(&server)
        .await;
    let backend = open(&server).await.map_err(|e| format!("open: {e}"))?;
    let outcome = backend.get("user_1:default:Z3JlZXRpbmc=").await;
    expect_error(outcome, ErrorKind::Unavailable, &["throttling", "ProvisionedThroughputExceededException"], "get")?;
    let attempts = received(&server, "GetItem").await.len();
    (attempts == SDK_ATTEMPTS).then_some(()).ok_or(format!("GetItem attempts: {attempts}, expected {SDK_ATTEMPTS}"))
}

/// Query always answered ThrottlingException: `SDK_ATTEMPTS` attempts, then `Unavailable`.
async fn query_always_throttled() -> std::result::Result<(), String> {
    let server = server_with_table().await;
    operation("Query").respond_with(error(400, "ThrottlingException", "Rate exceeded")).mount(&server).await;
    let backend = open(&server).await.map_err(|e| format!("open: {e}"))?;
    let outcome = backend.query(&query(Projection::All), 10, None).await;
    expect_error(outcome, ErrorKind::Unavailable, &["throttling", "ThrottlingException"], "query")?;
    let attempts = received(&server, "Query").await.len();
    (attempts == SDK_ATTEMPTS).then_some(()).ok_or(format!("Query attempts: {attempts}, expected {SDK_ATTEMPTS}"))
}

/// PutItem always answered 500: `SDK_ATTEMPTS` attempts, then `Unavailable`.
async fn put_always_failing() -> std::result::Result<(), String> {
    let server = server_with_table().await;
    operation("PutItem").respond_with(error(500, "InternalServerError", "Internal server error")).mount(&server).await;
    let backend = open(&server).await.map_err(|e| format!("open: {e}"))?;
    let outcome = backend.put("user_1:bulk:aw==", &small_body("k"), Precondition::None).await;
    expect_error(outcome, ErrorKind::Unavailable, &["InternalServerError"], "put")?;
    let attempts = received(&server, "PutItem").await.len();
    (attempts == SDK_ATTEMPTS).then_some(()).ok_or(format!("PutItem attempts: {attempts}, expected {SDK_ATTEMPTS}"))
}

/// A DynamoDB that fails every write: `SDK_ATTEMPTS` attempts a document and nothing more, every
/// document reported `Unavailable` and marked exhausted, within the operation timeout.
async fn bulk_write_to_a_failing_dynamodb() -> std::result::Result<(), String> {
    let server = server_with_table().await;
    operation("PutItem").respond_with(error(500, "InternalServerError", "down")).mount(&server).await;
    let backend = open(&server).await.map_err(|e| format!("open: {e}"))?;
    let ids: Vec<String> = (0..3).map(|i| format!("bulk-{i:02}")).collect();
    let started = std::time::Instant::now();
    let results =
        backend.bulk_write(unconditional_writes(&ids)).await.map_err(|e| format!("bulk_write as a whole: {e}"))?;
    let took = started.elapsed();
    for result in results {
        match result {
            Err(e) if e.kind() == ErrorKind::Unavailable && e.retries_exhausted() => {}
            other => return Err(format!("expected an exhausted Unavailable, got {other:?}")),
        }
    }
    let attempts = received(&server, "PutItem").await.len();
    if attempts != ids.len() * SDK_ATTEMPTS {
        return Err(format!("PutItem attempts: {attempts}, expected {} a document", SDK_ATTEMPTS));
    }
    let bound = agentstore::backend::dynamodb::config::OPERATION_TIMEOUT + std::time::Duration::from_secs(10);
    (took < bound).then_some(()).ok_or(format!("reported after {took:?}"))
}

/// The scenarios that exhaust every retry wait through the real backoff (seconds each), so they
/// run concurrently here rather than one after another.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn persistent_failures_exhaust_the_retries_and_report_unavailable() {
    let (get, query, put, bulk, down) = tokio::join!(
        get_always_throttled(),
        query_always_throttled(),
        put_always_failing(),
        persistently_unprocessed_items(),
        bulk_write_to_a_failing_dynamodb()
    );
    let failures: Vec<String> = [
        ("GetItem throttled", get),
        ("Query throttled", query),
        ("PutItem 500", put),
        ("BatchWriteItem unprocessed", bulk),
        ("PutItem 500 in bulk", down),
    ]
    .into_iter()
    .filter_map(|(name, outcome)| outcome.err().map(|e| format!("{name}: {e}")))
    .collect();
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// Error mapping without retries.
// ---------------------------------------------------------------------------------------------

/// PutItem that applies its first attempt but answers 500 (a reply lost in transit), then fails
/// the resend's condition against that very write; GetItem reports the stored revision.
struct LostReply {
    stored_rev: std::sync::Arc<Mutex<String>>,
    applied: std::sync::Arc<Mutex<bool>>,
}

impl Respond for LostReply {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let mut applied = self.applied.lock().unwrap();
        if !*applied {
            *applied = true;
            *self.stored_rev.lock().unwrap() =
                request_json(request)["Item"]["_rev"]["S"].as_str().unwrap_or("?").to_owned();
            return error(500, "InternalServerError", "Internal server error");
        }
        error(400, "ConditionalCheckFailedException", "The conditional request failed")
    }
}

struct ReportsRevision {
    stored_rev: std::sync::Arc<Mutex<String>>,
}

impl Respond for ReportsRevision {
    fn respond(&self, _: &Request) -> ResponseTemplate {
        let rev = self.stored_rev.lock().unwrap().clone();
        answer(200, json!({"Item": {"_id": {"S": "user_1:bulk:aw=="}, "_rev": {"S": rev}}}))
    }
}

/// A write whose first attempt landed but whose answer was lost is resent and fails its
/// condition against itself: that is the write's own success, not a conflict (a conflict would
/// make the facade apply the change a second time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_write_that_had_landed_is_its_own_success() {
    let server = server_with_table().await;
    let stored_rev = std::sync::Arc::new(Mutex::new("1-00000000000000aa".to_owned()));
    let applied = std::sync::Arc::new(Mutex::new(false));
    operation("PutItem")
        .respond_with(LostReply { stored_rev: stored_rev.clone(), applied: applied.clone() })
        .mount(&server)
        .await;
    operation("GetItem").respond_with(ReportsRevision { stored_rev: stored_rev.clone() }).mount(&server).await;
    operation("UpdateItem").respond_with(answer(200, json!({}))).mount(&server).await;
    let backend = open(&server).await.expect("open");

    let previous = Revision("1-00000000000000aa".into());
    let rev = backend
        .put("user_1:bulk:aw==", &small_body("k"), Precondition::MatchRevision(previous))
        .await
        .expect("the write landed on its first attempt");
    assert_eq!(rev.as_str(), stored_rev.lock().unwrap().as_str());
    let puts = received(&server, "PutItem").await;
    assert_eq!(puts.len(), 2, "the write was resent once");
    // The landed attempt may have been applied late, after a follower passed its position: the
    // document is given a fresh one, on our revision only.
    let restamps = received(&server, "UpdateItem").await;
    assert_eq!(restamps.len(), 1);
    let restamp = request_json(&restamps[0]);
    assert_eq!(restamp["ConditionExpression"], "#rev = :rev");
    assert_eq!(restamp["ExpressionAttributeValues"][":rev"], json!({"S": rev.as_str()}));
    let first_position = request_json(&puts[0])["Item"]["_seq"]["S"].as_str().unwrap_or_default().to_owned();
    let fresh = restamp["ExpressionAttributeValues"][":seq"]["S"].as_str().unwrap_or_default().to_owned();
    assert!(fresh > first_position, "{fresh} is not after {first_position}");

    // A real conflict (the stored revision is someone else's) is still a conflict.
    *stored_rev.lock().unwrap() = "9-someone-else".into();
    let other = backend
        .put("user_1:bulk:aw==", &small_body("k"), Precondition::MatchRevision(Revision("9-someone-else".into())))
        .await;
    expect_error(other, ErrorKind::Conflict, &["changed by another writer"], "update").unwrap();
    assert_eq!(received(&server, "UpdateItem").await.len(), 1, "no fresh position for a conflict");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conditional_check_failure_is_a_conflict() {
    let server = server_with_table().await;
    operation("PutItem")
        .respond_with(error(400, "ConditionalCheckFailedException", "The conditional request failed"))
        .mount(&server)
        .await;
    // Nothing stored when the create reads; then another writer's document at revision 1-…aa.
    operation("GetItem").respond_with(answer(200, json!({}))).up_to_n_times(2).mount(&server).await;
    operation("GetItem")
        .respond_with(answer(200, json!({"Item": stored_item("user_1:bulk:aw==")})))
        .mount(&server)
        .await;
    let backend = open(&server).await.expect("open");

    let created = backend.put("user_1:bulk:aw==", &small_body("k"), Precondition::MustNotExist).await;
    expect_error(created, ErrorKind::Conflict, &["user_1:bulk:aw=="], "create").unwrap();
    let updated = backend
        .put("user_1:bulk:aw==", &small_body("k"), Precondition::MatchRevision(Revision("1-00000000000000aa".into())))
        .await;
    expect_error(updated, ErrorKind::Conflict, &["changed by another writer"], "update").unwrap();

    let attempts = received(&server, "PutItem").await;
    assert_eq!(attempts.len(), 2, "a failed condition is not retried");
    let create = request_json(&attempts[0]);
    assert_eq!(create["ConditionExpression"], "attribute_not_exists(#id)");
    assert_eq!(create["ExpressionAttributeNames"], json!({"#id": "_id"}));
    let update = request_json(&attempts[1]);
    assert_eq!(update["ConditionExpression"], "#rev = :rev");
    assert_eq!(update["ExpressionAttributeNames"], json!({"#rev": "_rev"}));
    assert_eq!(update["ExpressionAttributeValues"], json!({":rev": {"S": "1-00000000000000aa"}}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_table_is_misconfigured_and_names_create_true() {
    credentials();
    let server = MockServer::start().await;
    operation("DescribeTable")
        .respond_with(error(
            400,
            "ResourceNotFoundException",
            "Requested resource not found: Table: agent_data_store not found",
        ))
        .mount(&server)
        .await;
    let outcome = open(&server).await.map(|_| ());
    expect_error(outcome, ErrorKind::Misconfigured, &[TABLE, "create=true"], "open").unwrap();
    assert_eq!(received(&server, "DescribeTable").await.len(), 1, "not retried");
    assert!(received(&server, "CreateTable").await.is_empty(), "no table is created without create=true");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_index_is_misconfigured_and_named() {
    credentials();
    for (case, indexes) in [
        ("no index at all", json!([])),
        (
            "another index",
            json!([{"IndexName": "byUser", "KeySchema": [{"AttributeName": "userId", "KeyType": "HASH"}], "Projection": {"ProjectionType": "ALL"}, "IndexStatus": "ACTIVE"}]),
        ),
        (
            "the name with other keys",
            json!([{"IndexName": INDEX, "KeySchema": [{"AttributeName": "userId", "KeyType": "HASH"}], "Projection": {"ProjectionType": "ALL"}, "IndexStatus": "ACTIVE"}]),
        ),
    ] {
        let server = MockServer::start().await;
        let mut description = table_description(indexes);
        if case == "no index at all" {
            description["Table"].as_object_mut().expect("object").remove("GlobalSecondaryIndexes");
        }
        operation("DescribeTable").respond_with(answer(200, description)).mount(&server).await;
        let outcome = open(&server).await.map(|_| ());
        expect_error(outcome, ErrorKind::Misconfigured, &[INDEX, TABLE], case).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_credentials_are_unauthorized() {
    // At open.
    credentials();
    let server = MockServer::start().await;
    operation("DescribeTable")
        .respond_with(error(
            400,
            "UnrecognizedClientException",
            "The security token included in the request is invalid.",
        ))
        .mount(&server)
        .await;
    let outcome = open(&server).await.map(|_| ());
    expect_error(outcome, ErrorKind::Unauthorized, &["credentials", "UnrecognizedClientException"], "open").unwrap();
    assert_eq!(received(&server, "DescribeTable").await.len(), 1, "not retried");

    // On a later call.
    let server = server_with_table().await;
    operation("GetItem")
        .respond_with(error(
            400,
            "UnrecognizedClientException",
            "The security token included in the request is invalid.",
        ))
        .mount(&server)
        .await;
    let backend = open(&server).await.expect("open");
    let outcome = backend.get("user_1:default:Z3JlZXRpbmc=").await;
    expect_error(outcome, ErrorKind::Unauthorized, &["credentials"], "get").unwrap();
    assert_eq!(received(&server, "GetItem").await.len(), 1, "not retried");
}

// ---------------------------------------------------------------------------------------------
// Requests.
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn projecting_the_reserved_word_key_uses_attribute_names() {
    let server = server_with_table().await;
    operation("Query")
        .respond_with(answer(
            200,
            json!({"Items": [{"_id": {"S": "user_1:default:Z3JlZXRpbmc="}, "_rev": {"S": "1-00000000000000aa"}, "key": {"S": "greeting"}}],
                   "Count": 1, "ScannedCount": 1}),
        ))
        .mount(&server)
        .await;
    let backend = open(&server).await.expect("open");

    let page = backend.query(&query(Projection::Fields(vec!["key"])), 10, None).await.expect("query");
    assert_eq!(page.items.len(), 1);
    assert_eq!(page.items[0].id, "user_1:default:Z3JlZXRpbmc=");
    assert_eq!(page.items[0].rev, Revision("1-00000000000000aa".into()));
    assert_eq!(Value::Object(page.items[0].body.clone()), json!({"key": "greeting"}));

    let requests = received(&server, "Query").await;
    assert_eq!(requests.len(), 1);
    let body = request_json(&requests[0]);
    assert_eq!(body["TableName"], TABLE);
    assert_eq!(body["IndexName"], INDEX);
    assert_eq!(body["Limit"], 10);
    let projection = body["ProjectionExpression"].as_str().expect("a ProjectionExpression");
    let names = body["ExpressionAttributeNames"].as_object().expect("ExpressionAttributeNames");
    let mut projected = Vec::new();
    for token in projection.split(',').map(str::trim) {
        assert!(token.starts_with('#'), "bare attribute {token:?} in ProjectionExpression {projection:?}");
        let name = names.get(token).and_then(Value::as_str);
        projected.push(name.unwrap_or_else(|| panic!("{token} is not in ExpressionAttributeNames {names:?}")));
    }
    projected.sort_unstable();
    assert_eq!(projected, ["_id", "_rev", "key"], "ProjectionExpression {projection:?} with names {names:?}");
    // The key condition uses names and values too.
    let condition = body["KeyConditionExpression"].as_str().expect("KeyConditionExpression");
    assert!(!condition.contains("userId") && !condition.contains("namespace"), "{condition}");
    assert_eq!(body["ExpressionAttributeValues"], json!({":u": {"S": "user_1"}, ":n": {"S": "default"}}));
}

/// `bulk_write` reads what its documents replace in one consistent BatchGetItem, then writes each
/// conditionally on what it found (BatchWriteItem carries no condition), continuing generations:
/// unconditional (migration) writes too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_writes_read_in_one_batch_and_write_conditionally() {
    let server = server_with_table().await;
    let reader = BatchReader {
        stored: HashSet::from(["bulk-03".to_owned()]),
        unprocessed: HashSet::new(),
        always: false,
        seen: Mutex::new(HashMap::new()),
    };
    operation("BatchGetItem").respond_with(reader).mount(&server).await;
    operation("PutItem").respond_with(answer(200, json!({}))).mount(&server).await;
    let backend = open(&server).await.expect("open");

    let ids: Vec<String> = (0..30).map(|i| format!("bulk-{i:02}")).collect();
    let results = backend.bulk_write(unconditional_writes(&ids)).await.expect("bulk_write as a whole");
    let batch_reads = received(&server, "BatchGetItem").await;
    assert_eq!(batch_reads.len(), 1);
    let (asked, consistent) = batch_get_ids(&batch_reads[0]);
    assert_eq!(sorted(asked), ids);
    assert!(consistent);
    assert!(received(&server, "GetItem").await.is_empty(), "no read one document at a time");
    assert!(received(&server, "BatchWriteItem").await.is_empty());
    let puts: HashMap<String, Value> = received(&server, "PutItem")
        .await
        .iter()
        .map(|r| (request_json(r)["Item"]["_id"]["S"].as_str().unwrap_or("?").to_owned(), request_json(r)))
        .collect();
    assert_eq!(puts.len(), 30);
    for (id, result) in ids.iter().zip(&results) {
        let rev = result.as_ref().unwrap_or_else(|e| panic!("{id}: {e}"));
        let put = &puts[id];
        assert_eq!(put["Item"]["_rev"]["S"], rev.as_str());
        if id == "bulk-03" {
            // Stored at 1-…aa: the overwrite is generation 2, conditional on it.
            assert!(rev.as_str().starts_with("2-"), "{rev}");
            assert_eq!(put["ConditionExpression"], "#rev = :rev");
            assert_eq!(put["ExpressionAttributeValues"][":rev"], json!({"S": "1-00000000000000aa"}));
        } else {
            assert!(rev.as_str().starts_with("1-"), "{rev}");
            assert_eq!(put["ConditionExpression"], "attribute_not_exists(#id)");
        }
    }
}

/// An unconditional write that loses a race to another writer reads again and writes after it,
/// continuing that writer's generation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unconditional_write_that_loses_a_race_reads_again() {
    let server = server_with_table().await;
    let mut theirs = stored_item("user_1:bulk:aw==");
    theirs["_rev"] = json!({"S": "3-00000000000000bb"});
    // Read before the write: 2-…; after the lost race (and for every later read): theirs, 3-….
    let mut before = stored_item("user_1:bulk:aw==");
    before["_rev"] = json!({"S": "2-00000000000000aa"});
    operation("GetItem").respond_with(answer(200, json!({"Item": before}))).up_to_n_times(1).mount(&server).await;
    operation("GetItem").respond_with(answer(200, json!({"Item": theirs}))).mount(&server).await;
    operation("PutItem")
        .respond_with(error(400, "ConditionalCheckFailedException", "The conditional request failed"))
        .up_to_n_times(1)
        .mount(&server)
        .await;
    operation("PutItem").respond_with(answer(200, json!({}))).mount(&server).await;
    let backend = open(&server).await.expect("open");

    let rev = backend.put("user_1:bulk:aw==", &small_body("k"), Precondition::None).await.expect("put");
    assert!(rev.as_str().starts_with("4-"), "{rev}");
    let puts = received(&server, "PutItem").await;
    assert_eq!(puts.len(), 2);
    assert_eq!(request_json(&puts[0])["ExpressionAttributeValues"][":rev"], json!({"S": "2-00000000000000aa"}));
    assert_eq!(request_json(&puts[1])["ExpressionAttributeValues"][":rev"], json!({"S": "3-00000000000000bb"}));
}

/// A table whose index list grows as UpdateTable creates indexes (each ACTIVE at once).
struct GrowingTable {
    created: std::sync::Arc<Mutex<Vec<Value>>>,
}

impl Respond for GrowingTable {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let target = request.headers.get(TARGET).and_then(|v| v.to_str().ok()).unwrap_or_default();
        let mut created = self.created.lock().unwrap();
        if target == self::target("UpdateTable") {
            for update in request_json(request)["GlobalSecondaryIndexUpdates"].as_array().into_iter().flatten() {
                let mut index = update["Create"].clone();
                index["IndexStatus"] = json!("ACTIVE");
                created.push(index);
            }
        }
        let mut indexes = standard_index().as_array().cloned().unwrap_or_default();
        indexes.extend(created.iter().cloned());
        answer(200, table_description(Value::Array(indexes)))
    }
}

/// The first upgrade step adds each missing index with its own UpdateTable (no capacity on an
/// on-demand table), then stamps old items conditionally: a document on the revision it was read
/// at, a chunk item only if it still exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_adds_the_indexes_and_stamps_items_conditionally() {
    credentials();
    let server = MockServer::start().await;
    let table = GrowingTable { created: std::sync::Arc::new(Mutex::new(Vec::new())) };
    let created = table.created.clone();
    Mock::given(method("POST"))
        .and(path("/"))
        .and(wiremock::matchers::header_regex(TARGET, "DescribeTable|UpdateTable"))
        .respond_with(table)
        .mount(&server)
        .await;
    mount_empty_reads(&server).await;
    let old = stored_item("user_1:default:aw==");
    let chunk = json!({"_id": {"S": "user_1:default:Yg==#chunk#1-00000000000000cc#1"}, "_chunkOf": {"S": "user_1:default:Yg=="}, "_body": {"B": "AAAA"}});
    operation("Scan").respond_with(answer(200, json!({"Items": [old, chunk], "Count": 2}))).mount(&server).await;
    operation("UpdateItem").respond_with(answer(200, json!({}))).mount(&server).await;
    let backend = open(&server).await.expect("open");
    assert!(matches!(backend.layout().await.expect("layout"), agentstore::backend::LayoutState::NeedsUpgrade(_)));

    let step = backend.upgrade_page(None, 10).await.expect("upgrade step");
    assert_eq!((step.examined, step.upgraded, step.next), (2, 2, None));
    let updates = received(&server, "UpdateTable").await;
    let names: Vec<Value> = updates
        .iter()
        .map(|u| {
            let body = request_json(u);
            let creates = body["GlobalSecondaryIndexUpdates"].as_array().cloned().unwrap_or_default();
            assert_eq!(creates.len(), 1, "one index a request");
            assert!(creates[0]["Create"].get("ProvisionedThroughput").is_none(), "on-demand: no capacity");
            creates[0]["Create"]["IndexName"].clone()
        })
        .collect();
    assert_eq!(names, [json!(layout::FEED_INDEX), json!(layout::ID_INDEX)]);
    assert_eq!(created.lock().unwrap()[0]["KeySchema"][1], json!({"AttributeName": "_seq", "KeyType": "RANGE"}));

    let stamps: Vec<Value> = received(&server, "UpdateItem").await.iter().map(request_json).collect();
    let document = stamps.iter().find(|s| s["Key"]["_id"]["S"] == "user_1:default:aw==").expect("document stamped");
    assert_eq!(document["ConditionExpression"], "#rev = :rev");
    assert_eq!(document["ExpressionAttributeValues"][":rev"], json!({"S": "1-00000000000000aa"}));
    assert_eq!(
        document["ExpressionAttributeValues"][":shard"]["N"],
        layout::shard_of("user_1:default:aw==").to_string()
    );
    assert!(document["UpdateExpression"].as_str().is_some_and(|e| e.contains("#seq")));
    let chunk = stamps.iter().find(|s| s["Key"]["_id"]["S"] != "user_1:default:aw==").expect("chunk stamped");
    assert_eq!(chunk["ConditionExpression"], "attribute_exists(#id)");
}

/// Answers id-index queries as [`IdIndex`] does, but refuses, as DynamoDB does (and dynalite does
/// not), a query whose key condition compares with an empty string: `ValidationException`, "One
/// or more parameter values are not valid. The AttributeValue for a key attribute cannot contain
/// an empty string value."
struct RefusingEmptyKeyValues(IdIndex);

impl Respond for RefusingEmptyKeyValues {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let body = request_json(request);
        let values = body["ExpressionAttributeValues"].as_object().cloned().unwrap_or_default();
        if values.values().any(|value| value == &json!({"S": ""})) {
            return error(
                400,
                "ValidationException",
                "One or more parameter values are not valid. The AttributeValue for a key attribute cannot contain \
                 an empty string value.",
            );
        }
        self.0.respond(request)
    }
}

/// Issue 22, 2c item 3: `_all_docs?startkey=""` (and `key=""`) on DynamoDB put `""` in the id
/// index's key condition, which DynamoDB refuses; the CouchDB API had already sent its head, so
/// the client saw a 200 cut short. Every id sorts at or after `""` and none is empty, so those
/// ranges need no such condition: ascending from `""` reads every shard from its start, and a
/// descending range from `""` (or `key=""`) reads nothing to find nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_docs_from_the_empty_id_sends_no_empty_key_value() {
    let ids: Vec<String> = (0..20).map(|i| format!("u:ns:k{i:02}")).collect();
    let server = server_with_current_layout_querying(RefusingEmptyKeyValues(IdIndex { ids })).await;
    let backend = open(&server).await.expect("open");

    let range = |start: &str, end: Option<&str>, descending: bool| agentstore::backend::IdRange {
        start: Some(start.to_owned()),
        end: end.map(str::to_owned),
        inclusive_end: true,
        descending,
        include_design: false,
    };
    for (what, range) in [
        ("startkey=\"\"", range("", None, false)),
        ("key=\"\"", range("", Some(""), false)),
        ("startkey=\"\"&descending=true", range("", None, true)),
    ] {
        let before = received(&server, "Query").await.len();
        backend.all_docs(&range, 50, None).await.unwrap_or_else(|e| panic!("{what}: {e}"));
        let asked: Vec<Value> = received(&server, "Query").await[before..].iter().map(request_json).collect();
        for query in &asked {
            assert_eq!(query["IndexName"], layout::ID_INDEX, "{what}");
        }
        // The ascending ones read every shard (then stop at the range's end); the descending one
        // has nothing to read.
        let shards = if range.descending { 0 } else { layout::SHARD_COUNT as usize };
        assert_eq!(asked.len(), shards, "{what}: {asked:?}");
    }
}

/// Every request on a database confirms it with the catalog (`couchdb_database_recheck_ms` 0);
/// on DynamoDB that is one consistent GetItem of the table's layout marker, whose creation id
/// tells the database from one deleted and created again under its name, never DescribeTable
/// (a control-plane call AWS throttles per account). A marker of an earlier release without a
/// creation id is given one once, conditionally, and read back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opening_a_database_reads_its_marker_and_never_describes_the_table() {
    use agentstore::backend::catalog::{Catalog, DbName};
    use agentstore::backend::dynamodb::DynamoCatalog;
    credentials();
    let server = MockServer::start().await;
    let mut indexes = standard_index().as_array().cloned().unwrap_or_default();
    indexes.extend(model_indexes());
    operation("DescribeTable").respond_with(answer(200, table_description(Value::Array(indexes)))).mount(&server).await;
    let marker = json!({"_id": {"S": layout::MARKER_ID}, "_meta": {"S": "layout"}, "version": {"N": "2"}});
    let mut stamped = marker.clone();
    stamped["creation"] = json!({"S": "1-abc"});
    let marker_of = |table: &str| {
        operation("GetItem")
            .and(wiremock::matchers::body_partial_json(json!({"TableName": table, "ConsistentRead": true})))
            .and(wiremock::matchers::body_partial_json(json!({"Key": {"_id": {"S": layout::MARKER_ID}}})))
    };
    marker_of(&format!("{TABLE}.db.stamped")).respond_with(answer(200, json!({"Item": stamped}))).mount(&server).await;
    // The earlier release's marker: read without a creation id once, then with the one written.
    marker_of(&format!("{TABLE}.db.earlier"))
        .respond_with(answer(200, json!({"Item": marker})))
        .up_to_n_times(1)
        .with_priority(1)
        .mount(&server)
        .await;
    marker_of(&format!("{TABLE}.db.earlier")).respond_with(answer(200, json!({"Item": stamped}))).mount(&server).await;
    operation("UpdateItem").respond_with(answer(200, json!({}))).mount(&server).await;
    let config =
        DynamoConfig::parse(&format!("dynamodb://{TABLE}?region=us-east-1&endpoint={}", server.uri())).expect("URL");
    let catalog = DynamoCatalog::new(&config).await.expect("catalog");
    let requests = 5;
    for name in ["stamped", "earlier"] {
        let name = DbName::parse(name).expect("name");
        let first = catalog.open(&name).await.expect("open").expect("the database is there");
        for _ in 1..requests {
            let again = catalog.open(&name).await.expect("open").expect("still there");
            assert!(std::sync::Arc::ptr_eq(&first, &again), "{name}: the same creation keeps its handle");
        }
    }
    assert_eq!(received(&server, "DescribeTable").await.len(), 0, "no DescribeTable on any open");
    assert_eq!(
        received(&server, "GetItem").await.len(),
        2 * requests + 1,
        "one marker read per open, and the read-back"
    );
    let updates = received(&server, "UpdateItem").await;
    assert_eq!(updates.len(), 1, "the earlier release's marker is given a creation id once");
    let update = request_json(&updates[0]);
    assert_eq!(update["ConditionExpression"], json!("attribute_exists(#id) AND attribute_not_exists(#field)"));
    assert_eq!(
        update["ExpressionAttributeNames"]["#field"],
        json!("creation"),
        "the field set once is the creation id"
    );
}

/// DescribeTable answers of a table deleted and created again by another instance between two
/// looks: there, then gone, then there again (with a new table id).
struct DeletedAndCreatedAgain {
    looks: std::sync::atomic::AtomicUsize,
}

impl Respond for DeletedAndCreatedAgain {
    fn respond(&self, _: &Request) -> ResponseTemplate {
        let look = self.looks.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut indexes = standard_index().as_array().cloned().unwrap_or_default();
        indexes.extend(model_indexes());
        let mut described = table_description(Value::Array(indexes));
        described["Table"]["TableId"] = json!(if look == 0 { "first" } else { "second" });
        match look {
            1 => error(400, "ResourceNotFoundException", "Requested resource not found"),
            _ => answer(200, described),
        }
    }
}

/// The flake of `couchdb_api::a_feed_under_a_deletion_ends_never_500` on DynamoDB: an open
/// racing another request's delete and re-create of the same database. Checked by DescribeTable
/// (the release before), the open saw the old table, then no table while it readied its handle,
/// then the new one, and answered an error (500) that the request's missing-database check
/// could not turn into a 404, the name holding a database again. Read from the marker, the open
/// answers the database the marker names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_racing_a_delete_and_create_again_answers_a_database() {
    use agentstore::backend::catalog::{Catalog, DbName};
    use agentstore::backend::dynamodb::DynamoCatalog;
    credentials();
    let server = MockServer::start().await;
    operation("DescribeTable")
        .respond_with(DeletedAndCreatedAgain { looks: std::sync::atomic::AtomicUsize::new(0) })
        .mount(&server)
        .await;
    operation("GetItem")
        .and(wiremock::matchers::body_partial_json(json!({"Key": {"_id": {"S": layout::MARKER_ID}}})))
        .respond_with(answer(
            200,
            json!({"Item": {"_id": {"S": layout::MARKER_ID}, "_meta": {"S": "layout"}, "version": {"N": "2"},
                "creation": {"S": "2-again"}}}),
        ))
        .mount(&server)
        .await;
    operation("PutItem").respond_with(answer(200, json!({}))).mount(&server).await;
    operation("UpdateItem").respond_with(answer(200, json!({}))).mount(&server).await;
    let config =
        DynamoConfig::parse(&format!("dynamodb://{TABLE}?region=us-east-1&endpoint={}", server.uri())).expect("URL");
    let catalog = DynamoCatalog::new(&config).await.expect("catalog");
    let opened = catalog.open(&DbName::parse("raced").expect("name")).await;
    assert!(matches!(opened, Ok(Some(_))), "the database created again: {:?}", opened.map(|o| o.is_some()));
}
