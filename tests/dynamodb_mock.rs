//! The DynamoDB adapter against a wiremock server speaking DynamoDB's JSON protocol, for what a
//! real (or local) server cannot show on demand: throttling, 5xx answers, UnprocessedItems,
//! conditional failures, a missing table or index, refused credentials, and the exact request
//! the adapter sends for a projection on the reserved word `key`.
//!
//! Every call is `POST /` with `X-Amz-Target: DynamoDB_20120810.<Operation>`; errors are HTTP 400
//! (500 for internal errors) with `{"__type": "...#Code", "message": "..."}`.
//!
//! The adapter is opened exactly as in production (`DynamoDbBackend::open`, standard retry mode,
//! `SDK_ATTEMPTS` attempts, real backoff), so the scenarios that exhaust every retry take seconds; they run
//! concurrently inside one test to keep the whole file fast.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, Once};

use agentstore::backend::dynamodb::{DynamoConfig, DynamoDbBackend};
use agentstore::backend::{BulkWrite, DocumentBackend, Precondition, Projection, Query, Revision};
use agentstore::{ErrorKind, Result};
use serde_json::{json, Map, Value};
use wiremock::matchers::{header, method, path};
use wiremock::{Mock, MockServer, Request, Respond, ResponseTemplate};

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

/// A mock server whose table and index are there and ACTIVE.
async fn server_with_table() -> MockServer {
    credentials();
    let server = MockServer::start().await;
    operation("DescribeTable").respond_with(answer(200, table_description(standard_index()))).mount(&server).await;
    server
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

fn body_of(request: &Request) -> Value {
    serde_json::from_slice(&request.body).expect("the SDK sends JSON bodies")
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
            let id = write["PutRequest"]["Item"]["_id"]["S"].as_str().unwrap_or_default().to_owned();
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

/// The `_id`s of one received BatchWriteItem body, in order.
fn batch_ids(request: &Request) -> Vec<String> {
    body_of(request)["RequestItems"][TABLE]
        .as_array()
        .map(|writes| {
            writes.iter().map(|w| w["PutRequest"]["Item"]["_id"]["S"].as_str().unwrap_or("?").to_owned()).collect()
        })
        .unwrap_or_default()
}

/// The `_rev` each id was last sent with in BatchWriteItem bodies.
fn sent_revisions(requests: &[Request]) -> HashMap<String, String> {
    let mut revs = HashMap::new();
    for request in requests {
        for write in body_of(request)["RequestItems"][TABLE].as_array().into_iter().flatten() {
            let item = &write["PutRequest"]["Item"];
            if let (Some(id), Some(rev)) = (item["_id"]["S"].as_str(), item["_rev"]["S"].as_str()) {
                revs.insert(id.to_owned(), rev.to_owned());
            }
        }
    }
    revs
}

fn unconditional_writes(ids: &[String]) -> Vec<BulkWrite> {
    ids.iter().map(|id| BulkWrite { id: id.clone(), body: small_body(id), precondition: Precondition::None }).collect()
}

fn sorted(mut ids: Vec<String>) -> Vec<String> {
    ids.sort();
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unprocessed_items_are_resent_until_written() {
    let server = server_with_table().await;
    // Two of the first batch and one of the second come back unprocessed once.
    let once = ["bulk-03", "bulk-17", "bulk-27"];
    operation("BatchWriteItem").respond_with(BatchWriter::new(&once, false)).mount(&server).await;
    let backend = open(&server).await.expect("open");

    let ids: Vec<String> = (0..30).map(|i| format!("bulk-{i:02}")).collect();
    let results = backend.bulk_write(unconditional_writes(&ids)).await.expect("bulk_write as a whole");

    assert_eq!(results.len(), 30);
    let requests = received(&server, "BatchWriteItem").await;
    let batches: Vec<Vec<String>> = requests.iter().map(batch_ids).collect();
    let sizes: Vec<usize> = batches.iter().map(Vec::len).collect();
    // 25, then the first batch's two unprocessed items, then 5, then the second batch's one.
    assert_eq!(sizes, [25, 2, 5, 1], "BatchWriteItem request sizes");
    assert_eq!(sorted(batches[0].clone()), ids[..25].to_vec(), "first batch");
    assert_eq!(sorted(batches[1].clone()), ["bulk-03", "bulk-17"], "resent from the first batch");
    assert_eq!(sorted(batches[2].clone()), ids[25..].to_vec(), "second batch");
    assert_eq!(batches[3], ["bulk-27"], "resent from the second batch");
    // Each resent item is the same write (same revision) as the first time.
    let first_revs = sent_revisions(&requests[..1]);
    let resent_revs = sent_revisions(&requests[1..2]);
    for id in ["bulk-03", "bulk-17"] {
        assert_eq!(first_revs.get(id), resent_revs.get(id), "{id} was resent with another revision");
    }

    let revs = sent_revisions(&requests);
    for (id, result) in ids.iter().zip(&results) {
        match result {
            Ok(rev) => assert_eq!(Some(rev.as_str()), revs.get(id).map(String::as_str), "{id}: revision returned"),
            Err(e) => panic!("{id}: {e}"),
        }
    }
    // No write went through PutItem.
    assert!(received(&server, "PutItem").await.is_empty());
}

/// Items DynamoDB never processes end as `Unavailable`; the others of the same request are Ok.
async fn persistently_unprocessed_items() -> std::result::Result<(), String> {
    let server = server_with_table().await;
    let stuck = ["bulk-02", "bulk-07"];
    operation("BatchWriteItem").respond_with(BatchWriter::new(&stuck, true)).mount(&server).await;
    let backend = open(&server).await.map_err(|e| format!("open: {e}"))?;
    let ids: Vec<String> = (0..10).map(|i| format!("bulk-{i:02}")).collect();
    let results =
        backend.bulk_write(unconditional_writes(&ids)).await.map_err(|e| format!("bulk_write as a whole: {e}"))?;
    if results.len() != ids.len() {
        return Err(format!("{} results for {} writes", results.len(), ids.len()));
    }
    for (id, result) in ids.iter().zip(results) {
        if stuck.contains(&id.as_str()) {
            expect_error(result, ErrorKind::Unavailable, &["unprocessed"], &format!("unprocessed {id}"))?;
        } else if let Err(e) = result {
            return Err(format!("{id} was processed but reported {e}"));
        }
    }
    let requests = received(&server, "BatchWriteItem").await;
    let sizes: Vec<usize> = requests.iter().map(|r| batch_ids(r).len()).collect();
    let mut expected = vec![10];
    expected.extend([2; UNPROCESSED_RETRIES]);
    if sizes != expected {
        return Err(format!("BatchWriteItem request sizes {sizes:?}, expected {expected:?}"));
    }
    for request in &requests[1..] {
        let ids = sorted(batch_ids(request));
        if ids != stuck {
            return Err(format!("resent {ids:?}, expected only {stuck:?}"));
        }
    }
    Ok(())
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
    let body = body_of(request);
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
        let body = body_of(attempt);
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
    // The retry is the same write: same item, same revision, same condition.
    assert_eq!(body_of(&attempts[0]), body_of(&attempts[1]));
    assert_eq!(body_of(&attempts[1])["Item"]["_rev"]["S"], rev.as_str());
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

/// A DynamoDB that fails every BatchWriteItem: the SDK's attempts and nothing more (before, the
/// adapter's own loop of 3 ran around them, and the migration sink's 5 around that), every
/// document reported `Unavailable` and marked exhausted, within the operation timeout.
async fn bulk_write_to_a_failing_dynamodb() -> std::result::Result<(), String> {
    let server = server_with_table().await;
    operation("BatchWriteItem").respond_with(error(500, "InternalServerError", "down")).mount(&server).await;
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
    let attempts = received(&server, "BatchWriteItem").await.len();
    if attempts != SDK_ATTEMPTS {
        return Err(format!("BatchWriteItem attempts: {attempts}, expected {SDK_ATTEMPTS}"));
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
        ("BatchWriteItem 500", down),
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
/// the resend's condition against that very write; GetItem reports the revision it applied.
struct LostReply {
    applied_rev: std::sync::Arc<Mutex<Option<String>>>,
}

impl Respond for LostReply {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let mut applied = self.applied_rev.lock().unwrap();
        if applied.is_none() {
            *applied = body_of(request)["Item"]["_rev"]["S"].as_str().map(str::to_owned);
            return error(500, "InternalServerError", "Internal server error");
        }
        error(400, "ConditionalCheckFailedException", "The conditional request failed")
    }
}

struct ReportsRevision {
    applied_rev: std::sync::Arc<Mutex<Option<String>>>,
}

impl Respond for ReportsRevision {
    fn respond(&self, _: &Request) -> ResponseTemplate {
        let rev = self.applied_rev.lock().unwrap().clone().unwrap_or_default();
        answer(200, json!({"Item": {"_rev": {"S": rev}}}))
    }
}

/// A write whose first attempt landed but whose answer was lost is resent by the SDK and fails
/// its condition against itself: that is the write's own success, not a conflict (a conflict
/// would make the facade apply the change a second time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_write_that_had_landed_is_its_own_success() {
    let server = server_with_table().await;
    let applied_rev = std::sync::Arc::new(Mutex::new(None));
    operation("PutItem").respond_with(LostReply { applied_rev: applied_rev.clone() }).mount(&server).await;
    operation("GetItem").respond_with(ReportsRevision { applied_rev: applied_rev.clone() }).mount(&server).await;
    let backend = open(&server).await.expect("open");

    let previous = Revision("1-00000000000000aa".into());
    let rev = backend
        .put("user_1:bulk:aw==", &small_body("k"), Precondition::MatchRevision(previous))
        .await
        .expect("the write landed on its first attempt");
    assert_eq!(Some(rev.as_str().to_owned()), *applied_rev.lock().unwrap());
    assert_eq!(received(&server, "PutItem").await.len(), 2, "the SDK resent the write once");

    // A real conflict (the stored revision is someone else's) is still a conflict.
    *applied_rev.lock().unwrap() = Some("9-someone-else".into());
    let other = backend.put("user_1:bulk:aw==", &small_body("k"), Precondition::MustNotExist).await;
    expect_error(other, ErrorKind::Conflict, &["changed by another writer"], "create").unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conditional_check_failure_is_a_conflict() {
    let server = server_with_table().await;
    operation("PutItem")
        .respond_with(error(400, "ConditionalCheckFailedException", "The conditional request failed"))
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
    let create = body_of(&attempts[0]);
    assert_eq!(create["ConditionExpression"], "attribute_not_exists(#id)");
    assert_eq!(create["ExpressionAttributeNames"], json!({"#id": "_id"}));
    let update = body_of(&attempts[1]);
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
    let body = body_of(&requests[0]);
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

/// Refuses every batch that contains `poison`, with an error the SDK does not retry.
struct PoisonedBatch {
    poison: &'static str,
}

impl Respond for PoisonedBatch {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        if batch_ids(request).iter().any(|id| id == self.poison) {
            error(400, "ValidationException", "One or more parameter values were invalid")
        } else {
            answer(200, json!({"UnprocessedItems": {}}))
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_batch_fails_only_its_own_documents() {
    let server = server_with_table().await;
    operation("BatchWriteItem").respond_with(PoisonedBatch { poison: "bulk-27" }).mount(&server).await;
    let backend = open(&server).await.expect("open");

    let ids: Vec<String> = (0..30).map(|i| format!("bulk-{i:02}")).collect();
    let results = backend.bulk_write(unconditional_writes(&ids)).await.expect("bulk_write as a whole");

    assert_eq!(results.len(), 30);
    let sizes: Vec<usize> = received(&server, "BatchWriteItem").await.iter().map(|r| batch_ids(r).len()).collect();
    assert_eq!(sizes, [25, 5], "one request per batch, the failed one not retried");
    for (id, result) in ids.iter().zip(&results) {
        let in_failed_batch = ids[25..].contains(id);
        match result {
            Ok(_) => assert!(!in_failed_batch, "{id} was in the refused batch but reported written"),
            Err(e) => {
                assert!(in_failed_batch, "{id} was written but reported failed: {e}");
                assert_eq!(e.kind(), ErrorKind::InvalidInput, "{id}: {e}");
            }
        }
    }
}
