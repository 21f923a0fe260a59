//! Numbers: big numbers keep every digit both ways, and the 36 number texts CouchDB 3.4.3 stored
//! (`fixtures/couchdb-numbers-3.4.3.json`) replayed: a number CouchDB would alter is refused,
//! never acknowledged.

use super::*;

const INT38: &str = "12345678901234567890123456789012345678";
const U64_MAX: &str = "18446744073709551615";
const BEYOND_DOUBLE: &str = "9007199254740993";
const SMALL: &str = "1e-07";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn big_numbers_keep_every_digit_both_ways() {
    let server = MockServer::start().await;
    let (backend, store) = open_store(&server, StoreOptions::default()).await;
    let id = document_id("user_123", "numbers", "big");
    // Written out by hand, as a real CouchDB stores and returns them (it keeps 38-digit integers
    // exactly); never parsed into serde_json before it is served.
    let raw = format!(
        r#"{{"_id":"{id}","_rev":"1-0123456789abcdef0123456789abcdef","userId":"user_123","namespace":"numbers","key":"big","value":{{"int38":{INT38},"u64max":{U64_MAX},"beyond_double":{BEYOND_DOUBLE},"small":{SMALL},"list":[{INT38},-{INT38},{SMALL}]}},"accessCount":1,"createdAt":"2026-02-05T10:00:00Z","updatedAt":"2026-02-05T10:00:00Z"}}"#
    );
    Mock::given(method("GET"))
        .and(DecodedPath::new(&format!("/{DB}/{id}")))
        .respond_with(ResponseTemplate::new(200).set_body_raw(raw.into_bytes(), "application/json"))
        .mount(&server)
        .await;
    let created = transcript(13);
    Mock::given(method("PUT")).and(AnyDocumentPath).respond_with(created.response()).mount(&server).await;
    let missing = transcript(20);
    Mock::given(method("GET")).and(AnyDocumentPath).respond_with(missing.response()).mount(&server).await;

    let doc = backend.get(&id).await.unwrap().expect("the document");
    let value = &doc.body["value"];
    assert_eq!(value["int38"].to_string(), INT38);
    assert_eq!(value["u64max"].to_string(), U64_MAX);
    assert_eq!(value["beyond_double"].to_string(), BEYOND_DOUBLE);
    assert_eq!(value["small"].to_string(), SMALL);
    assert_eq!(value["list"].to_string(), format!("[{INT38},-{INT38},{SMALL}]"));

    // Written back unchanged, the same digits go out.
    backend.put(&id, &doc.body, Precondition::MatchRevision(doc.rev.clone())).await.unwrap();
    // And through the facade, from a value parsed from text (as the HTTP layer parses it).
    let parsed: Value =
        serde_json::from_str(&format!(r#"{{"n":{INT38},"m":{U64_MAX},"d":{BEYOND_DOUBLE},"s":{SMALL}}}"#))
            .expect("a JSON value");
    store.set("user_123", "numbers", "fresh", parsed, None, None).await.unwrap();

    let requests = received(&server).await;
    let puts: Vec<String> = requests
        .iter()
        .filter(|r| r.method.as_str() == "PUT")
        .map(|r| String::from_utf8(r.body.clone()).expect("UTF-8 body"))
        .collect();
    assert_eq!(puts.len(), 2, "{puts:#?}");
    let expected = format!(
        r#""value":{{"int38":{INT38},"u64max":{U64_MAX},"beyond_double":{BEYOND_DOUBLE},"small":{SMALL},"list":[{INT38},-{INT38},{SMALL}]}}"#
    );
    assert!(puts[0].contains(&expected), "{}", puts[0]);
    let expected = format!(r#""value":{{"n":{INT38},"m":{U64_MAX},"d":{BEYOND_DOUBLE},"s":{SMALL}}}"#);
    assert!(puts[1].contains(&expected), "{}", puts[1]);
    assert_all_authorized(&requests);
}

/// One row of `fixtures/couchdb-numbers-3.4.3.json`: a document `{"v": <sent>}` was PUT to a real
/// CouchDB 3.4.3 and read back.
#[derive(Debug, Clone)]
struct NumberRow {
    sent: String,
    put_status: u16,
    put_response: Value,
    /// The number's text in the GET response; `None` when the PUT failed.
    stored_as: Option<String>,
}

fn number_rows() -> Vec<NumberRow> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures").join("couchdb-numbers-3.4.3.json");
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("numbers fixture"))
        .expect("numbers fixture is JSON");
    fixture["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .map(|row| NumberRow {
            sent: row["sent"].as_str().expect("sent").to_owned(),
            put_status: row["put_status"].as_u64().expect("put_status") as u16,
            put_response: row["put_response"].clone(),
            stored_as: row["stored_as"].as_str().map(str::to_owned),
        })
        .collect()
}

/// A stand-in CouchDB for documents whose `value.v` is one number: it stores (or refuses) that
/// number exactly as the recorded CouchDB 3.4.3 did for the same text. A number text the
/// recording does not cover is answered 500 and remembered, so the test fails: the adapter may
/// only send number texts whose fate on a real CouchDB is known.
struct RecordedNumbers {
    rows: HashMap<String, NumberRow>,
    docs: Mutex<HashMap<String, Value>>,
    unrecorded: Mutex<Vec<String>>,
}

impl RecordedNumbers {
    /// The recorded row for a number text, allowing only other spellings of the exponent marker
    /// (`E`/`e`, `+`/none), which the recording shows CouchDB treats alike (`1E2` and `1e+2` were
    /// both stored as `100.0`), and which serde_json itself changes (`1E2` is held as `1e+2`).
    fn row_for(&self, sent: &str) -> Option<&NumberRow> {
        let spelling = |text: &str| text.replace('E', "e").replace("e+", "e");
        self.rows.get(sent).or_else(|| self.rows.values().find(|row| spelling(&row.sent) == spelling(sent)))
    }
}

impl Respond for RecordedNumbers {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let path = percent_decoded(request.url.path());
        let id = path.strip_prefix(&format!("/{DB}/")).unwrap_or_default().to_owned();
        let json = |status: u16, body: Value| ResponseTemplate::new(status).set_body_json(body);
        match request.method.as_str() {
            "GET" => match self.docs.lock().unwrap().get(&id) {
                Some(doc) => json(200, doc.clone()),
                None => json(404, json!({"error": "not_found", "reason": "missing"})),
            },
            "PUT" => {
                let mut doc: Value = serde_json::from_slice(&request.body).expect("the adapter sends JSON");
                let sent = doc["value"]["v"].to_string();
                let Some(row) = self.row_for(&sent) else {
                    self.unrecorded.lock().unwrap().push(sent);
                    return json(500, json!({"error": "unrecorded_number", "reason": "not in the recording"}));
                };
                let Some(stored_as) = &row.stored_as else {
                    return json(row.put_status, row.put_response.clone());
                };
                doc["value"]["v"] = serde_json::from_str(stored_as).expect("a recorded number");
                doc["_rev"] = json!("1-00000000000000000000000000000001");
                self.docs.lock().unwrap().insert(id.clone(), doc);
                json(201, json!({"ok": true, "id": id, "rev": "1-00000000000000000000000000000001"}))
            }
            other => panic!("unexpected {other} {path}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn numbers_couchdb_would_alter_are_refused_never_acknowledged() {
    let server = MockServer::start().await;
    let (_backend, store) = open_store(&server, StoreOptions::default()).await;
    let rows = number_rows();
    assert_eq!(rows.len(), 36, "the recording has 36 number texts");
    let recorded = Arc::new(RecordedNumbers {
        rows: rows.iter().map(|row| (row.sent.clone(), row.clone())).collect(),
        docs: Mutex::default(),
        unrecorded: Mutex::default(),
    });
    Mock::given(AnyDocumentPath).respond_with(SharedResponder(Arc::clone(&recorded))).mount(&server).await;

    let mut accepted = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        let value: Value = serde_json::from_str(&format!("{{\"v\": {}}}", row.sent)).expect("a JSON number");
        let key = format!("n{i}");
        // What the recorded CouchDB keeps when sent this very text: the same value, or not.
        let couchdb_keeps_it = row.stored_as.as_deref().is_some_and(|stored| {
            exact_eq(&serde_json::from_str(stored).unwrap(), &serde_json::from_str(&row.sent).unwrap())
        });
        match store.set("user_123", "numbers", &key, value.clone(), None, None).await {
            Ok(written) => {
                let read = store.peek("user_123", "numbers", &key).await.unwrap().expect("stored");
                assert!(
                    exact_eq(&read.body["value"], &value) && exact_eq(&written.body["value"], &value),
                    "{}: acknowledged as {}, reads back as {}",
                    row.sent,
                    written.body["value"],
                    read.body["value"]
                );
                accepted.push(row.sent.clone());
            }
            Err(err) => {
                assert!(!couchdb_keeps_it, "{}: refused, though CouchDB stores it exactly: {err}", row.sent);
                assert_eq!(err.kind(), ErrorKind::InvalidInput, "{}: {err}", row.sent);
                assert!(err.to_string().starts_with("invalid value.v: the number"), "{}: {err}", row.sent);
                assert!(recorded.docs.lock().unwrap().get(&document_id("user_123", "numbers", &key)).is_none());
            }
        }
        if couchdb_keeps_it {
            assert!(accepted.contains(&row.sent), "{} is stored exactly by CouchDB and must be accepted", row.sent);
        }
    }
    assert_eq!(*recorded.unrecorded.lock().unwrap(), Vec::<String>::new(), "number texts CouchDB was never tried with");
    // The one number CouchDB misreads as written but reads exactly in another form.
    assert!(accepted.contains(&"5e-324".to_owned()), "accepted: {accepted:?}");
    let requests = received(&server).await;
    let sent_for_min_subnormal = requests
        .iter()
        .filter(|r| r.method.as_str() == "PUT")
        .map(|r| String::from_utf8_lossy(&r.body).into_owned())
        .find(|body| body.contains("4.9406564584124654e-324") && !body.contains("\"5e-324\""));
    assert!(sent_for_min_subnormal.is_some(), "5e-324 is sent as 4.9406564584124654e-324");
    assert_eq!(accepted.len(), 36 - 13, "accepted: {accepted:?}");
    // Nothing was written for a refused number: one PUT per accepted number, no more.
    assert_eq!(requests.iter().filter(|r| r.method.as_str() == "PUT").count(), accepted.len());
}

/// Lets one [`RecordedNumbers`] answer while the test still reads its state.
struct SharedResponder(Arc<RecordedNumbers>);

impl Respond for SharedResponder {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        self.0.respond(request)
    }
}
