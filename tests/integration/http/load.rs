//! Concurrent writers and readers lose nothing, and listings stream thousands of keys.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_and_readers_lose_nothing() {
    let server = Server::start().await;
    let path = doc_path("u", "ns", "hot");
    let created = server.put_doc("u", "ns", "hot", &json!({ "value": 0, "metadata": { "initial": true } })).await;
    let initial = created["accessCount"].as_u64().unwrap();
    assert_eq!(initial, 1);

    let url = format!("{}{path}", server.base);
    let mut tasks = Vec::new();
    for i in 0..32 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            // One client (and so one connection) per task.
            let client = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(20)).build().unwrap();
            let request = if i % 2 == 0 {
                let metadata: Map<String, Value> = [(format!("m{}", i / 2), json!(i))].into_iter().collect();
                client
                    .put(&url)
                    .header("X-Agent-Id", format!("writer-{i}"))
                    .json(&json!({ "value": i, "metadata": metadata }))
            } else {
                client.get(&url).header("X-Agent-Id", format!("reader-{i}"))
            };
            let request = request.build().unwrap();
            send_with(&client, request, format!("client {i}")).await.document()
        }));
    }
    let mut counts = BTreeSet::new();
    for task in tasks {
        let doc = task.await.expect("client task");
        assert!(counts.insert(doc["accessCount"].as_u64().unwrap()), "every access got its own count: {doc}");
    }
    assert_eq!(counts, (initial + 1..=initial + 32).collect(), "each request saw a distinct count");

    let last = server.get(&path).await.document();
    assert_eq!(last["accessCount"].as_u64().unwrap(), initial + 32 + 1, "32 accesses and this GET");
    let metadata = last["metadata"].as_object().unwrap();
    assert_eq!(metadata.len(), 17, "{metadata:?}");
    assert_eq!(metadata["initial"], json!(true));
    for i in 0..16 {
        assert_eq!(metadata[&format!("m{i}")], json!(i * 2), "{metadata:?}");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listings_stream_thousands_of_keys() {
    const N: usize = 2_500;
    // Small pages, so each listing spans many backend pages.
    let server = Server::start_with(|s| s.page_size = 200).await;
    let started = Instant::now();
    let results: Vec<StatusCode> = futures::stream::iter(0..N)
        .map(|i| {
            let request =
                server.req(Method::PUT, &doc_path("u", "big", &format!("key-{i:05}"))).json(&json!({ "value": i }));
            let client = server.client.clone();
            async move { client.execute(request.build().unwrap()).await.expect("PUT").status() }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    assert!(results.iter().all(|s| *s == StatusCode::OK), "every PUT succeeded");
    eprintln!("{N} PUTs in {:?}", started.elapsed());
    server.put_doc("u", "other", "key-00000", &json!({ "value": "other" })).await;

    let reply = server.get(&keys_path("u", "big")).await;
    assert!(reply.header("content-length").is_none(), "a listing streams: {:?}", reply.headers);
    let keys: Vec<String> = serde_json::from_value(reply.expect_json(StatusCode::OK)).expect("string array");
    assert_eq!(keys.len(), N);
    let distinct: BTreeSet<String> = keys.into_iter().collect();
    assert_eq!(distinct, (0..N).map(|i| format!("key-{i:05}")).collect());

    let reply = server.get(&namespace_path("u", "big")).await;
    assert!(reply.header("content-length").is_none(), "a listing streams: {:?}", reply.headers);
    // Parse to a list of pairs by hand: duplicate keys must not hide in an object.
    let text = reply.text();
    let all: Map<String, Value> = serde_json::from_str(&text).expect("an object");
    assert_eq!(all.len(), N);
    assert_eq!(text.matches("\"key-").count(), N, "no key twice");
    for (key, value) in &all {
        let i: usize = key.strip_prefix("key-").and_then(|n| n.parse().ok()).expect("one of ours");
        assert_eq!(value, &json!(i));
    }
    server.stop().await;
}
