//! Documents through the REST API: the lifecycle the spec describes, listings and bulk deletes,
//! every route served, and the OpenAPI document naming exactly the routes and the server's limits.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn document_lifecycle_follows_the_spec() {
    let server = Server::start().await;
    let (user, ns, key) = ("user_123", "files:my-repo", "src/main.py");
    let path = doc_path(user, ns, key);

    let created = server
        .send(
            server
                .req(Method::PUT, &path)
                .header("X-Agent-Id", "agent-a")
                .json(&json!({ "value": { "x": 1 }, "metadata": { "a": 1, "b": 1 } })),
        )
        .await
        .document();
    assert_eq!(created["_id"], json!(format!("{user}:{ns}:{}", encode_key(key))));
    assert_eq!(created["_id"], json!("user_123:files:my-repo:c3JjL21haW4ucHk="));
    assert_eq!(created["userId"], json!(user));
    assert_eq!(created["namespace"], json!(ns));
    assert_eq!(created["key"], json!(key));
    assert_eq!(created["value"], json!({ "x": 1 }));
    assert_eq!(created["metadata"], json!({ "a": 1, "b": 1 }));
    assert_eq!(created["createdByAgent"], json!("agent-a"));
    assert_eq!(created["lastAccessedByAgent"], json!("agent-a"));
    assert_eq!(created["accessCount"], json!(1));
    for field in ["createdAt", "updatedAt", "lastAccessedAt"] {
        let at = created[field].as_str().unwrap_or_else(|| panic!("{field} missing: {created}"));
        assert!(is_timestamp(at), "{field} = {at:?}");
    }
    assert_eq!(created["createdAt"], created["updatedAt"]);

    // Update: value replaced, metadata merged shallowly, creator kept, accessor updated.
    let updated = server
        .send(
            server
                .req(Method::PUT, &path)
                .header("X-Agent-Id", "agent-b")
                .json(&json!({ "value": "new", "metadata": { "b": { "nested": true }, "c": 3 } })),
        )
        .await
        .document();
    assert_ne!(updated["_rev"], created["_rev"]);
    assert_eq!(updated["value"], json!("new"));
    assert_eq!(updated["metadata"], json!({ "a": 1, "b": { "nested": true }, "c": 3 }));
    assert_eq!(updated["createdByAgent"], json!("agent-a"));
    assert_eq!(updated["lastAccessedByAgent"], json!("agent-b"));
    assert_eq!(updated["accessCount"], json!(2));
    assert_eq!(updated["createdAt"], created["createdAt"]);
    assert!(updated["updatedAt"].as_str() >= created["updatedAt"].as_str());

    // An update without metadata keeps the stored metadata.
    let kept = server.put(&path, &json!({ "value": [1, 2, 3] })).await.document();
    assert_eq!(kept["metadata"], updated["metadata"]);
    assert_eq!(kept["accessCount"], json!(3));
    assert_eq!(kept["lastAccessedByAgent"], json!("agent-b"), "no X-Agent-Id leaves the last agent");

    // HEAD: existence and ETag, no body, not an access.
    for _ in 0..3 {
        let head = server.call(Method::HEAD, &path).await;
        assert_eq!(head.status, StatusCode::OK, "{}", head.describe());
        assert!(head.body.is_empty());
        assert_eq!(head.header("etag"), Some(format!("\"{}\"", kept["_rev"].as_str().unwrap()).as_str()));
    }

    // GET: counts as one access, by the agent of the header.
    let read = server.send(server.req(Method::GET, &path).header("X-Agent-Id", "agent-c")).await.document();
    assert_eq!(read["accessCount"], json!(4), "HEAD must not count as an access; GET must");
    assert_eq!(read["lastAccessedByAgent"], json!("agent-c"));
    assert_eq!(read["createdByAgent"], json!("agent-a"));
    assert_eq!(read["value"], json!([1, 2, 3]));
    assert_eq!(read["metadata"], updated["metadata"]);
    assert_ne!(read["_rev"], kept["_rev"], "a counted read is a write");
    let head = server.call(Method::HEAD, &path).await;
    assert_eq!(head.header("etag"), read.get("_rev").and_then(Value::as_str).map(|r| format!("\"{r}\"")).as_deref());
    let again = server.get(&path).await.document();
    assert_eq!(again["accessCount"], json!(5));

    // Conditional writes that hold.
    let etag = format!("\"{}\"", again["_rev"].as_str().unwrap());
    let matched =
        server.send(server.req(Method::PUT, &path).header("If-Match", &etag).json(&json!({ "value": 7 }))).await;
    assert_eq!(matched.document()["value"], json!(7));
    let weak = format!("W/\"{}\"", matched.json()["_rev"].as_str().unwrap());
    let matched =
        server.send(server.req(Method::PUT, &path).header("If-Match", &weak).json(&json!({ "value": 8 }))).await;
    assert_eq!(matched.document()["value"], json!(8));
    let star = server.send(server.req(Method::PUT, &path).header("If-Match", "*").json(&json!({ "value": 9 }))).await;
    assert_eq!(star.document()["value"], json!(9));
    let fresh_path = doc_path(user, ns, "fresh");
    let fresh = server
        .send(server.req(Method::PUT, &fresh_path).header("If-None-Match", "*").json(&json!({ "value": null })))
        .await
        .document();
    assert_eq!(fresh["value"], Value::Null);
    assert_eq!(fresh["accessCount"], json!(1));
    assert!(fresh.get("createdByAgent").is_none(), "no agent, no createdByAgent: {fresh}");
    assert!(fresh.get("metadata").is_none() || fresh["metadata"] == json!({}), "{fresh}");

    // DELETE, conditionally, then it is gone.
    let current = format!("\"{}\"", star.json()["_rev"].as_str().unwrap());
    let deleted = server.send(server.req(Method::DELETE, &path).header("If-Match", &current)).await;
    assert_eq!(deleted.expect_json(StatusCode::OK), json!({ "ok": true, "deleted": 1 }));
    server.get(&path).await.expect_error(StatusCode::NOT_FOUND, "not_found");
    let head = server.call(Method::HEAD, &path).await;
    assert_eq!(head.status, StatusCode::NOT_FOUND);
    assert!(head.body.is_empty());
    let deleted = server.call(Method::DELETE, &fresh_path).await;
    assert_eq!(deleted.expect_json(StatusCode::OK), json!({ "ok": true, "deleted": 1 }));
    server.call(Method::DELETE, &fresh_path).await.expect_error(StatusCode::NOT_FOUND, "not_found");

    // Recreated after deletion: a new document.
    let recreated = server.put_doc(user, ns, key, &json!({ "value": 1 })).await;
    assert_eq!(recreated["accessCount"], json!(1));
    assert!(recreated.get("createdByAgent").is_none());
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listings_and_bulk_deletes() {
    let server = Server::start().await;
    server.put_doc("u1", "ns-a", "k1", &json!({ "value": 1 })).await;
    server.put_doc("u1", "ns-a", "k2", &json!({ "value": { "two": 2 } })).await;
    server.put_doc("u1", "ns-b", "k1", &json!({ "value": "b1" })).await;
    server.put_doc("u1", "ns-b:sub", "k1", &json!({ "value": "sub" })).await;
    server.put_doc("u2", "ns-a", "other", &json!({ "value": "u2" })).await;

    let keys = server.get(&keys_path("u1", "ns-a")).await.expect_json(StatusCode::OK);
    let keys: BTreeSet<String> = serde_json::from_value(keys).expect("keys are a string array");
    assert_eq!(keys, BTreeSet::from(["k1".to_owned(), "k2".to_owned()]));

    let all = server.get(&namespace_path("u1", "ns-a")).await.expect_json(StatusCode::OK);
    assert_eq!(all, json!({ "k1": 1, "k2": { "two": 2 } }));
    // get_all does not count accesses.
    let doc = server.call(Method::HEAD, &doc_path("u1", "ns-a", "k1")).await;
    assert_eq!(doc.status, StatusCode::OK);
    let doc = server.get(&doc_path("u1", "ns-a", "k1")).await.document();
    assert_eq!(doc["accessCount"], json!(2), "only the PUT and this GET count");

    let namespaces = server.get(&namespaces_path("u1")).await.expect_json(StatusCode::OK);
    assert_eq!(namespaces, json!(["ns-a", "ns-b", "ns-b:sub"]), "distinct and sorted");
    assert_eq!(server.get(&namespaces_path("u2")).await.expect_json(StatusCode::OK), json!(["ns-a"]));

    // Empty results.
    assert_eq!(server.get(&namespaces_path("nobody")).await.expect_json(StatusCode::OK), json!([]));
    assert_eq!(server.get(&keys_path("u1", "empty")).await.expect_json(StatusCode::OK), json!([]));
    assert_eq!(server.get(&namespace_path("u1", "empty")).await.expect_json(StatusCode::OK), json!({}));

    // Deleting a namespace leaves the others (including ns-b:sub when ns-b goes).
    let deleted = server.call(Method::DELETE, &namespace_path("u1", "ns-b")).await.expect_json(StatusCode::OK);
    assert_eq!(deleted, json!({ "ok": true, "deleted": 1 }));
    assert_eq!(server.get(&namespaces_path("u1")).await.expect_json(StatusCode::OK), json!(["ns-a", "ns-b:sub"]));
    let deleted = server.call(Method::DELETE, &namespace_path("u1", "ns-b")).await.expect_json(StatusCode::OK);
    assert_eq!(deleted, json!({ "ok": true, "deleted": 0 }));

    // Purging a user deletes all of theirs and nobody else's.
    let purged = server.call(Method::DELETE, &user_path("u1")).await.expect_json(StatusCode::OK);
    assert_eq!(purged, json!({ "ok": true, "deleted": 3 }));
    assert_eq!(server.get(&namespaces_path("u1")).await.expect_json(StatusCode::OK), json!([]));
    assert_eq!(server.get(&namespace_path("u2", "ns-a")).await.expect_json(StatusCode::OK), json!({ "other": "u2" }));
    let purged = server.call(Method::DELETE, &user_path("u1")).await.expect_json(StatusCode::OK);
    assert_eq!(purged, json!({ "ok": true, "deleted": 0 }));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_is_served() {
    let server = Server::start().await;
    for (method, template) in ROUTES {
        let method = Method::from_bytes(method.as_bytes()).expect("valid method");
        // Every route runs against the same existing document.
        server.put_doc("u", "ns", "k", &json!({ "value": { "v": 1 }, "metadata": { "m": 1 } })).await;
        let reply = server.send(route_request(&server, &method, template, "u")).await;
        assert_eq!(reply.status, StatusCode::OK, "{method} {template}: {}", reply.describe());
        let check = |expected: Value| assert_eq!(reply.json(), expected, "{method} {template}");
        match (method.as_str(), *template) {
            ("HEAD", _) => assert!(reply.body.is_empty()),
            ("GET", DOC_ROUTE) => assert_eq!(reply.document()["value"], json!({ "v": 1 })),
            ("PUT", DOC_ROUTE) => {
                let doc = reply.document();
                assert_eq!((&doc["value"], &doc["metadata"]), (&json!(1), &json!({ "m": 1 })));
            }
            ("DELETE", _) => check(json!({ "ok": true, "deleted": 1 })),
            ("GET", "/v1/users/{user}/namespaces") => check(json!(["ns"])),
            ("GET", "/v1/users/{user}/namespaces/{namespace}") => check(json!({ "k": { "v": 1 } })),
            ("GET", "/v1/users/{user}/namespaces/{namespace}/keys") => check(json!(["k"])),
            ("GET", CHANGES_ROUTE) => {
                let feed = reply.json();
                let ids: Vec<&Value> = feed["results"].as_array().expect("results").iter().map(|r| &r["id"]).collect();
                assert_eq!(ids, [&json!("u:ns:aw==")], "{}", reply.describe());
            }
            ("GET", "/healthz") => check(json!({ "status": "ok" })),
            ("GET", "/readyz") => check(json!({ "status": "ready" })),
            ("GET", "/metrics") => {
                assert!(reply.header("content-type").unwrap_or_default().starts_with("text/plain"));
                assert!(reply.text().contains("agentstore_http_requests_total"), "{}", reply.describe());
            }
            ("GET", "/openapi.json") => {
                assert!(reply.header("content-type").unwrap_or_default().starts_with("application/json"));
                assert!(reply.json().is_object());
            }
            other => panic!("no check for route {other:?}: add one"),
        }
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openapi_documents_exactly_the_routes() {
    let server = Server::start().await;
    let spec = server.get("/openapi.json").await.expect_json(StatusCode::OK);
    let embedded: Value = serde_json::from_str(agentstore::http::OPENAPI_JSON).expect("OPENAPI_JSON is JSON");
    assert_eq!(spec, embedded, "/openapi.json serves OPENAPI_JSON");
    let version = spec["openapi"].as_str().unwrap_or_default();
    assert!(version.starts_with("3."), "`openapi` must be 3.x, found {:?}", spec["openapi"]);
    const METHODS: &[&str] = &["get", "put", "post", "delete", "options", "head", "patch", "trace"];
    let mut documented = BTreeSet::new();
    for (path, item) in spec["paths"].as_object().expect("`paths` is an object") {
        for method in item.as_object().expect("a path item is an object").keys() {
            if METHODS.contains(&method.as_str()) {
                documented.insert((method.to_uppercase(), path.clone()));
            }
        }
    }
    let expected: BTreeSet<(String, String)> = ROUTES.iter().map(|(m, p)| (m.to_string(), p.to_string())).collect();
    let missing: Vec<_> = expected.difference(&documented).collect();
    let extra: Vec<_> = documented.difference(&expected).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "openapi.json: undocumented routes {missing:?}; not served {extra:?}"
    );
    server.stop().await;
}

/// The limits /openapi.json states are the server's: each name's maxLength is its byte limit (a
/// character count never stricter than the byte limit), and every /v1 operation lists the
/// answers any request there can get, each with the request id.
#[test]
fn openapi_states_the_server_limits_and_answers() {
    use agentstore::model::validate::{MAX_AGENT_BYTES, MAX_KEY_BYTES, MAX_NAMESPACE_BYTES, MAX_USER_ID_BYTES};
    let spec: Value = serde_json::from_str(agentstore::http::OPENAPI_JSON).expect("OPENAPI_JSON is JSON");
    let components = &spec["components"];
    for (parameter, limit) in [
        ("User", MAX_USER_ID_BYTES),
        ("Namespace", MAX_NAMESPACE_BYTES),
        ("Key", MAX_KEY_BYTES),
        ("AgentId", MAX_AGENT_BYTES),
    ] {
        let schema = &components["parameters"][parameter]["schema"];
        assert_eq!(schema["maxLength"], json!(limit), "{parameter}: {schema}");
        assert_eq!(schema["minLength"], json!(1), "{parameter}: {schema}");
        let description = components["parameters"][parameter]["description"].as_str().unwrap_or_default();
        assert!(description.contains(&format!("{limit} bytes")), "{parameter}: {description}");
    }
    let request_id = json!({ "$ref": "#/components/headers/XRequestId" });
    for (name, response) in components["responses"].as_object().expect("components.responses") {
        assert_eq!(response["headers"]["X-Request-Id"], request_id, "{name}");
    }
    for (method, path) in ROUTES {
        let operation = &spec["paths"][path][method.to_lowercase()];
        let responses = operation["responses"].as_object().unwrap_or_else(|| panic!("{method} {path}"));
        for (status, response) in responses {
            let headers = match response.get("$ref").and_then(Value::as_str) {
                Some(target) => &components["responses"][target.rsplit('/').next().unwrap_or_default()]["headers"],
                None => &response["headers"],
            };
            assert_eq!(headers["X-Request-Id"], request_id, "{method} {path} {status}");
        }
        let expected: &[&str] = if path.starts_with("/v1/") {
            &["200", "400", "401", "403", "500", "502", "503", "504"]
        } else {
            &["200", "500", "504"]
        };
        for status in expected {
            assert!(responses.contains_key(*status), "{method} {path} does not list {status}");
        }
    }
}
