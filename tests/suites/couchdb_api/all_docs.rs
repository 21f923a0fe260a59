//! `_all_docs`: listing, paging by keys, from the empty id, and a backend failure never answered as
//! a short 200.

use super::*;

pub(super) async fn all_docs(e: Endpoint) -> TestResult {
    let mut docs = Vec::new();
    for user in ["user_456", "user_123", "user_789"] {
        for i in 0..5 {
            docs.push(doc(user, "notes", &format!("other-{i}"), json!(i)));
        }
    }
    e.post(&format!("/{DB}/_bulk_docs"), json!({ "docs": docs })).await?.expect(201, "seed")?;
    let prefix = e
        .get(&format!(
            "/{DB}/_all_docs?startkey=%22user_456%3A%22&endkey=%22user_456%3A%EF%BF%B0%22&include_docs=false"
        ))
        .await?
        .expect(200, "_all_docs prefix")?;
    same_fields(&prefix.body, &couchdb_body("046-all-docs-id-prefix"), "_all_docs", &[])?;
    let ids: Vec<&str> = prefix.body["rows"]
        .as_array()
        .map(|r| r.iter().filter_map(|row| row["id"].as_str()).collect())
        .unwrap_or_default();
    let mut sorted = ids.clone();
    sorted.sort();
    check(ids.len() == 5 && ids == sorted && ids.iter().all(|id| id.starts_with("user_456:")), || {
        format!("prefix rows: {ids:?}")
    })?;
    check(
        prefix.body["rows"][0]["value"]["rev"].is_string()
            && prefix.body["rows"][0]["key"] == prefix.body["rows"][0]["id"],
        || "row shape".into(),
    )?;
    // Paging as couchbackup's shallow mode does: start_key = last id + \u0000, in the body.
    let mut seen = Vec::new();
    let mut start: Option<String> = None;
    loop {
        let mut body = json!({"limit": 4, "include_docs": true});
        if let Some(start) = &start {
            body["start_key"] = json!(format!("{start}\u{0}"));
        }
        let page = e.post(&format!("/{DB}/_all_docs"), body).await?.expect(200, "_all_docs page")?;
        let rows = page.body["rows"].as_array().cloned().unwrap_or_default();
        for row in &rows {
            check(row["doc"]["_id"] == row["id"], || format!("include_docs: {row}"))?;
            seen.push(row["id"].as_str().unwrap_or_default().to_owned());
        }
        if rows.len() < 4 {
            break;
        }
        start = seen.last().cloned();
    }
    check(seen.len() == 15, || format!("paging saw {} of 15", seen.len()))?;
    let keys = json!({"keys": [seen[0], "user_123:default:bm9wZQ=="]});
    let by_keys = e.post(&format!("/{DB}/_all_docs?include_docs=true"), keys).await?.expect(200, "_all_docs keys")?;
    let couch = couchdb_body("047-all-docs-keys");
    check(by_keys.body["rows"][1] == couch["rows"][1], || {
        format!("missing key row: {} (CouchDB: {})", by_keys.body["rows"][1], couch["rows"][1])
    })?;
    check(by_keys.body["offset"].is_null(), || "offset with keys is null, as CouchDB's".into())?;
    let descending =
        e.get(&format!("/{DB}/_all_docs?descending=true&limit=2&skip=1")).await?.expect(200, "descending")?;
    let last_two: Vec<&str> = descending.body["rows"]
        .as_array()
        .map(|r| r.iter().filter_map(|row| row["id"].as_str()).collect())
        .unwrap_or_default();
    let mut expected: Vec<&str> = seen.iter().map(String::as_str).collect();
    expected.reverse();
    check(last_two == expected[1..3], || format!("descending with skip: {last_two:?}"))
}

/// `_all_docs` with `keys` picks its rows as CouchDB's `fabric_view_all_docs.erl` does:
/// reversed when `descending`, then `skip`, then `limit`; `update_seq` is `null` (issue 22
/// items 2c.5 and 2c.13: `POST ?limit=1 {"keys":[a,b,c]}` gave 3 rows here, 1 on CouchDB).
pub(super) async fn all_docs_keys_paging(e: Endpoint) -> TestResult {
    let docs: Vec<Value> = ["a", "b", "c"].iter().map(|k| doc("user_1", "ns", k, json!(k))).collect();
    let ids: Vec<Value> = docs.iter().map(|d| d["_id"].clone()).collect();
    e.post(&format!("/{DB}/_bulk_docs"), json!({ "docs": docs })).await?.expect(201, "seed")?;
    let row_ids = |answer: &Answer| -> Vec<Value> {
        answer.body["rows"].as_array().map(|rows| rows.iter().map(|r| r["key"].clone()).collect()).unwrap_or_default()
    };
    let keys = json!({ "keys": ids });
    for (query, expected) in [
        ("?limit=1", vec![ids[0].clone()]),
        ("?skip=1", vec![ids[1].clone(), ids[2].clone()]),
        ("?skip=1&limit=1", vec![ids[1].clone()]),
        ("?skip=5", vec![]),
        ("?descending=true&limit=2", vec![ids[2].clone(), ids[1].clone()]),
    ] {
        let answer = e.post(&format!("/{DB}/_all_docs{query}"), keys.clone()).await?.expect(200, query)?;
        check(row_ids(&answer) == expected, || format!("keys {query}: {}", answer.body))?;
    }
    let in_body = json!({ "keys": ids, "limit": 2, "skip": 1, "update_seq": true });
    let answer = e.post(&format!("/{DB}/_all_docs"), in_body).await?.expect(200, "keys with update_seq")?;
    check(row_ids(&answer) == vec![ids[1].clone(), ids[2].clone()], || format!("body params: {}", answer.body))?;
    check(answer.body.get("update_seq") == Some(&Value::Null), || format!("update_seq: {}", answer.body))
}

/// Issue 22, 2c item 3: `_all_docs?startkey=""` and `key=""`. On DynamoDB the answer stopped
/// after `"rows":[` (DynamoDB refuses an empty string in a key condition, and the error came
/// after the head was sent). CouchDB's `_all_docs` orders ids by raw collation, so every id sorts
/// at or after `""`: `startkey=""` lists every document from offset 0, like no `startkey`; and
/// CouchDB refuses an empty `_id` (`illegal_docid`, "Document id must not be empty"), so
/// `key=""`, `endkey=""` and a descending range from `""` list none.
pub(super) async fn all_docs_from_the_empty_id(e: Endpoint) -> TestResult {
    let docs: Vec<Value> = (0..3).map(|i| doc("user_empty", "keys", &format!("k{i}"), json!(i))).collect();
    e.post(&format!("/{DB}/_bulk_docs"), json!({ "docs": docs })).await?.expect(201, "seed")?;
    let ids = |answer: &Answer| -> Vec<String> {
        answer.body["rows"]
            .as_array()
            .map(|rows| rows.iter().filter_map(|row| row["id"].as_str().map(str::to_owned)).collect())
            .unwrap_or_default()
    };
    let everything = e.get(&format!("/{DB}/_all_docs")).await?.expect(200, "_all_docs")?;
    check(ids(&everything).len() == 3, || format!("_all_docs: {}", everything.body))?;
    for query in ["startkey=%22%22", "start_key=%22%22", "startkey=%22%22&inclusive_end=false"] {
        // `Answer::read` fails on a truncated body, and on one that is not JSON.
        let answer = e.get(&format!("/{DB}/_all_docs?{query}")).await?.expect(200, query)?;
        let same_total = answer.body["total_rows"] == everything.body["total_rows"];
        check(ids(&answer) == ids(&everything) && answer.body["offset"] == 0 && same_total, || {
            format!("{query}: {}", answer.body)
        })?;
    }
    let posted = e.post(&format!("/{DB}/_all_docs"), json!({"start_key": ""})).await?.expect(200, "POST start_key")?;
    check(ids(&posted) == ids(&everything), || format!("POST start_key \"\": {}", posted.body))?;
    for query in ["key=%22%22", "endkey=%22%22", "startkey=%22%22&descending=true", "key=%22%22&include_docs=true"] {
        let answer = e.get(&format!("/{DB}/_all_docs?{query}")).await?.expect(200, query)?;
        let same_total = answer.body["total_rows"] == everything.body["total_rows"];
        check(answer.body["rows"] == json!([]) && same_total, || format!("{query}: {}", answer.body))?;
    }
    let key = e.get(&format!("/{DB}/_all_docs?key=%22%22")).await?.expect(200, "key")?;
    check(key.body["offset"] == 0, || {
        format!("key=\"\": offset {} (CouchDB: 0, no id sorts before \"\")", key.body["offset"])
    })
}

/// The store of `e`'s backend with its id listing failing: on the first page (`fail_first`), or
/// on every page after a first one that says more follow.
struct FailingIdOrder {
    inner: Arc<dyn agentstore::backend::DocumentBackend>,
    fail_first: bool,
}

#[async_trait::async_trait]
impl agentstore::backend::raw::layer::Layered for FailingIdOrder {
    fn inner(&self) -> &dyn agentstore::backend::DocumentBackend {
        self.inner.as_ref()
    }

    async fn all_docs(
        &self,
        range: &agentstore::backend::IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> agentstore::Result<agentstore::backend::Page<agentstore::backend::StoredDocument>> {
        if self.fail_first || page_token.is_some() {
            return Err(agentstore::Error::new(
                agentstore::ErrorKind::Unavailable,
                "the id index is unavailable (test)",
            ));
        }
        let mut page = self.inner.all_docs(range, limit, None).await?;
        page.next = Some("more".into());
        Ok(page)
    }
}

/// Issue 22, 2c item 3, the mechanism: a backend error while `_all_docs` is answered must never
/// reach the client as a complete-looking 200. An error on the first page (DynamoDB's refusal of
/// `startkey=""` was one) is an error status with a JSON body; one on a later page, after rows were
/// sent, ends the chunked body without its last chunk, which the HTTP client reports as an error.
pub(super) async fn all_docs_backend_failure(e: Endpoint) -> TestResult {
    let docs: Vec<Value> = (0..3).map(|i| doc("user_fail", "keys", &format!("k{i}"), json!(i))).collect();
    e.post(&format!("/{DB}/_bulk_docs"), json!({ "docs": docs })).await?.expect(201, "seed")?;
    for fail_first in [true, false] {
        let backend: Arc<dyn agentstore::backend::DocumentBackend> =
            Arc::new(FailingIdOrder { inner: Arc::clone(&e._ctx.backend), fail_first });
        let store = Arc::new(DataStore::open(backend, StoreOptions::default()).await?);
        // A configuration file as `Endpoint::start` writes one without logins.
        let config_dir = tempfile::tempdir()?;
        let config_file = config_dir.path().join("agentstore.toml");
        // Its own view index directory: the store's default file is this endpoint's.
        let views = config_dir.path().join("views").display().to_string();
        std::fs::write(&config_file, format!("couchdb_view_index_dir = {views:?}\n"))?;
        let settings =
            Settings::load(Some(&config_file), &Overrides::default()).map_err(|e| Failed::from(e.to_string()))?;
        let app = CouchApp::build(store, &settings).await?;
        let listener = bind("127.0.0.1:0", &app, false).await?;
        let root = format!("http://{}", listener.local_addr()?);
        let (_stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = app
                .serve(listener, &settings, async move {
                    let _ = stopped.await;
                })
                .await;
        });
        let url = format!("{root}/{DB}/_all_docs?startkey=%22%22");
        if fail_first {
            let response = e.client.get(url).send().await?;
            let status = response.status();
            let text = response.text().await.map_err(|err| format!("first page failing: unreadable body: {err}"))?;
            let parsed: Value =
                serde_json::from_str(&text).map_err(|err| format!("first page failing: {err}: {text}"))?;
            check(status.is_server_error() && parsed["error"].is_string(), || {
                format!("first page failing: {status} {text} (an error status with CouchDB's error body)")
            })?;
        } else {
            // The second page is read before the status is sent (a listing of one page is sent
            // whole), so its failure is an error status; a failure further on breaks the stream.
            // Either way the client sees an error, never a 200 body it could take for the whole
            // answer.
            let outcome = match e.client.get(url).send().await {
                Ok(response) if response.status().is_server_error() => Err(format!("status {}", response.status())),
                Ok(response) => {
                    response.text().await.map(|text| format!("a complete body: {text}")).map_err(|e| e.to_string())
                }
                Err(err) => Err(err.to_string()),
            };
            check(outcome.is_err(), || format!("a later page failing: {outcome:?}"))?;
        }
    }
    Ok(())
}
