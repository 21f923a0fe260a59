//! What operators read: metrics by route and by backend operation, and request ids set, echoed
//! and replaced when unusable.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_requests_by_route_and_backend_calls_by_operation() {
    let server = Server::start().await;
    for i in 0..3 {
        server.put_doc("u", "ns", &format!("k{i}"), &json!({ "value": i })).await;
    }
    server.get(&doc_path("u", "ns", "missing")).await.expect_error(StatusCode::NOT_FOUND, "not_found");
    let reply = server.get("/metrics").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(reply.header("content-type").unwrap_or_default().starts_with("text/plain"));
    let text = reply.text();
    let series = |name: &str, labels: &[&str]| -> Vec<String> {
        text.lines()
            .filter(|line| line.starts_with(&format!("{name}{{")) && labels.iter().all(|l| line.contains(l)))
            .map(str::to_owned)
            .collect()
    };
    let route = format!("route=\"{DOC_ROUTE}\"");
    let puts = series("agentstore_http_requests_total", &[route.as_str(), "method=\"PUT\"", "status=\"200\""]);
    assert_eq!(puts.len(), 1, "{text}");
    assert!(puts[0].ends_with(" 3"), "three PUTs counted: {}", puts[0]);
    let missing = series("agentstore_http_requests_total", &[route.as_str(), "method=\"GET\"", "status=\"404\""]);
    assert_eq!(missing.len(), 1, "{text}");
    assert!(missing[0].ends_with(" 1"), "{}", missing[0]);
    assert!(!text.contains("route=\"/v1/users/u/"), "paths must not become labels: {text}");
    let backend_puts =
        series("agentstore_backend_call_duration_seconds_count", &["operation=\"put\"", "outcome=\"ok\""]);
    assert_eq!(backend_puts.len(), 1, "{text}");
    assert!(backend_puts[0].ends_with(" 3"), "{}", backend_puts[0]);
    assert!(!series("agentstore_backend_call_duration_seconds_bucket", &["operation=\"put\""]).is_empty());
    assert!(!series("agentstore_http_request_duration_seconds_bucket", &[route.as_str()]).is_empty());
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_are_set_and_echoed() {
    let server = Server::start().await;
    let mut seen = BTreeSet::new();
    for path in ["/healthz", "/nope", &doc_path("u", "ns", "missing")] {
        let reply = server.get(path).await;
        let id = reply.header("x-request-id").unwrap_or_else(|| panic!("no X-Request-Id: {}", reply.describe()));
        assert_eq!(id.len(), 36, "a UUID: {id}");
        assert!(seen.insert(id.to_owned()), "request ids are unique");
    }
    for path in ["/healthz", "/nope"] {
        let reply = server.send(server.req(Method::GET, path).header("X-Request-Id", "my-trace-42")).await;
        assert_eq!(reply.header("x-request-id"), Some("my-trace-42"), "{}", reply.describe());
    }
    let put = server
        .send(
            server
                .req(Method::PUT, &doc_path("u", "ns", "k"))
                .header("X-Request-Id", "put-1")
                .json(&json!({ "value": 1 })),
        )
        .await;
    assert_eq!(put.status, StatusCode::OK);
    assert_eq!(put.header("x-request-id"), Some("put-1"));
    server.stop().await;
}

/// Found by the fuzzer (scripts/fuzz): an empty `X-Request-Id` was echoed as an empty id, which
/// identifies no request in the log or in a 5xx reason. Unusable ids are now replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unusable_request_ids_are_replaced_by_fresh_ones() {
    let server = Server::start().await;
    let longest = "r".repeat(200);
    let reply = server.send(server.req(Method::GET, "/healthz").header("X-Request-Id", longest.as_str())).await;
    assert_eq!(reply.header("x-request-id"), Some(longest.as_str()), "200 visible ASCII characters are kept");
    let too_long = "r".repeat(201);
    let unusable: [&[u8]; 5] = [b"", b"a b", b"tab\there", b"caf\xc3\xa9", too_long.as_bytes()];
    for sent in unusable {
        let value = HeaderValue::from_bytes(sent).expect("a valid header value");
        for path in ["/healthz", "/nope", &doc_path("u", "ns", "missing")] {
            let reply = server.send(server.req(Method::GET, path).header("X-Request-Id", value.clone())).await;
            let id =
                reply.headers.get("x-request-id").unwrap_or_else(|| panic!("no X-Request-Id: {}", reply.describe()));
            assert_ne!(id.as_bytes(), sent, "{:?} echoed: {}", String::from_utf8_lossy(sent), reply.describe());
            let id = id.to_str().expect("the fresh id is text");
            assert_eq!(id.len(), 36, "a fresh UUID, not {id:?}: {}", reply.describe());
        }
    }
    server.stop().await;
}
