//! Client errors by status: 400 for invalid requests, 401 without a token, tokens isolating
//! users, 404, 405, 412 on failed preconditions, 413 for oversized values and bodies, 415 and 422.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_requests_are_400() {
    let server = Server::start().await;
    // A user id with ':' on every /v1 route, and one starting with '_'.
    for (method, template) in v1_routes() {
        for user in ["a:b", "_users"] {
            let reply = server.send(route_request(&server, &method, template, user)).await;
            if method == Method::HEAD {
                assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.describe());
            } else {
                let reason = reply.expect_error(StatusCode::BAD_REQUEST, "bad_request");
                assert!(reason.contains("user_id"), "{}", reply.describe());
            }
        }
    }
    assert!(doc_path("a:b", "ns", "k").contains("a%3Ab"));

    let path = doc_path("u", "ns", "k");
    let raw = |body: &'static str| server.req(Method::PUT, &path).header("content-type", "application/json").body(body);
    for body in
        ["{\"value\": ", "{value: 1}", "{\"value\": 1,}", "{\"value\": 1} trailing", "", "{\"value\":\"\\ud800\"}"]
    {
        let reason = server.send(raw(body)).await.expect_error(StatusCode::BAD_REQUEST, "bad_request");
        assert!(reason.contains("JSON"), "{body:?}: {reason}");
    }
    // Metadata must be an object.
    for metadata in [json!(null), json!([1]), json!("m"), json!(1)] {
        let reply = server.put(&path, &json!({ "value": 1, "metadata": metadata })).await;
        assert!(reply.expect_error(StatusCode::BAD_REQUEST, "bad_request").contains("metadata"));
    }
    // Names over their limits or with control characters.
    for (user, ns, key, field) in [
        ("u", "ns", &*"k".repeat(769), "key"),
        ("u", &*"n".repeat(257), "k", "namespace"),
        (&*"u".repeat(129), "ns", "k", "user_id"),
        ("u", "a\tb", "k", "namespace"),
        ("u\u{0}", "ns", "k", "user_id"),
    ] {
        let reply = server.put(&doc_path(user, ns, key), &json!({ "value": 1 })).await;
        assert!(reply.expect_error(StatusCode::BAD_REQUEST, "bad_request").contains(field), "{}", reply.describe());
    }

    // Preconditions that do not parse, or that make no sense.
    server.put_doc("u", "ns", "k", &json!({ "value": 1 })).await;
    for (name, value) in [
        ("If-Match", "abc"),
        ("If-Match", "\"\""),
        ("If-Match", "\"a\", \"b\""),
        ("If-Match", "\"unterminated"),
        ("If-None-Match", "\"1\""),
    ] {
        for method in [Method::PUT, Method::DELETE] {
            let request = server.req(method.clone(), &path).header(name, value).json(&json!({ "value": 1 }));
            let reply = server.send(request).await;
            if method == Method::DELETE && name == "If-None-Match" {
                reply.expect_error(StatusCode::BAD_REQUEST, "bad_request");
                continue;
            }
            let reason = reply.expect_error(StatusCode::BAD_REQUEST, "bad_request");
            assert!(reason.contains(name), "{name}: {value}: {reason}");
        }
    }
    let both = server
        .req(Method::PUT, &path)
        .header("If-Match", "*")
        .header("If-None-Match", "*")
        .json(&json!({ "value": 1 }));
    server.send(both).await.expect_error(StatusCode::BAD_REQUEST, "bad_request");
    let on_delete = server.req(Method::DELETE, &path).header("If-None-Match", "*");
    server.send(on_delete).await.expect_error(StatusCode::BAD_REQUEST, "bad_request");
    // Headers that are not UTF-8 text, and agents that are not valid names.
    let latin1 = HeaderValue::from_bytes(b"caf\xe9").expect("obs-text header");
    let bad_if_match = server.req(Method::PUT, &path).header("If-Match", latin1.clone()).json(&json!({ "value": 1 }));
    server.send(bad_if_match).await.expect_error(StatusCode::BAD_REQUEST, "bad_request");
    for agent in [latin1, HeaderValue::from_static(""), HeaderValue::from_str(&"a".repeat(257)).unwrap()] {
        let put = server.req(Method::PUT, &path).header("X-Agent-Id", agent.clone()).json(&json!({ "value": 1 }));
        let reason = server.send(put).await.expect_error(StatusCode::BAD_REQUEST, "bad_request");
        assert!(reason.contains("agent"), "{reason}");
        let get = server.req(Method::GET, &path).header("X-Agent-Id", agent);
        server.send(get).await.expect_error(StatusCode::BAD_REQUEST, "bad_request");
    }
    // None of that touched the document.
    assert_eq!(server.get(&path).await.document()["accessCount"], json!(2));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_tokens_are_401_on_every_v1_route() {
    let server = server_with_tokens().await;
    let bad_credentials: [Option<&str>; 6] = [
        None,
        Some("Bearer wrong-secret"),
        Some("Bearer "),
        Some("Basic YWxpY2U6c2VjcmV0"),
        Some(ALICE),
        Some("Bearer alice-secret-but-longer"),
    ];
    for (method, template) in v1_routes() {
        for credential in bad_credentials {
            let mut request = route_request(&server, &method, template, "alice");
            if let Some(credential) = credential {
                request = request.header("Authorization", credential);
            }
            let reply = server.send(request).await;
            let what = format!("{method} {template} with {credential:?}");
            assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{what}: {}", reply.describe());
            assert_eq!(reply.header("www-authenticate"), Some("Bearer realm=\"agentstore\""), "{what}");
            if method != Method::HEAD {
                reply.expect_error(StatusCode::UNAUTHORIZED, "unauthorized");
            }
        }
    }
    // Nothing was written by any of those.
    let admin = server.req(Method::GET, &namespaces_path("alice")).bearer_auth(ADMIN);
    assert_eq!(server.send(admin).await.expect_json(StatusCode::OK), json!([]));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_isolate_users() {
    let server = server_with_tokens().await;
    let s = &server;
    let seed = move |user: &'static str, token: &'static str| {
        let request = s.req(Method::PUT, &doc_path(user, "ns", "k")).bearer_auth(token).json(&json!({ "value": user }));
        async move { s.send(request).await.document() }
    };

    // Alice reads and writes her own data on every route.
    for (method, template) in v1_routes() {
        seed("alice", ALICE).await;
        let reply = server.send(route_request(&server, &method, template, "alice").bearer_auth(ALICE)).await;
        assert_eq!(reply.status, StatusCode::OK, "alice on {method} {template}: {}", reply.describe());
    }

    // Alice gets 403 on every one of bob's routes, and bob's data is untouched.
    let bobs = seed("bob", BOB).await;
    for (method, template) in v1_routes() {
        for token in [ALICE, "alice-secret\t"] {
            let reply = server.send(route_request(&server, &method, template, "bob").bearer_auth(token)).await;
            assert_eq!(reply.status, StatusCode::FORBIDDEN, "alice on bob's {method} {template}: {}", reply.describe());
            if method != Method::HEAD {
                assert!(reply.expect_error(StatusCode::FORBIDDEN, "forbidden").contains("bob"));
            }
        }
        // Bob is forbidden alice's data too.
        let reply = server.send(route_request(&server, &method, template, "alice").bearer_auth(BOB)).await;
        assert_eq!(reply.status, StatusCode::FORBIDDEN, "bob on alice's {method} {template}");
    }
    let head = server.send(server.req(Method::HEAD, &doc_path("bob", "ns", "k")).bearer_auth(BOB)).await;
    assert_eq!(head.header("etag"), Some(format!("\"{}\"", bobs["_rev"].as_str().unwrap()).as_str()));
    let bobs_now = server.send(server.req(Method::GET, &doc_path("bob", "ns", "k")).bearer_auth(BOB)).await.document();
    assert_eq!(bobs_now["value"], json!("bob"));
    assert_eq!(bobs_now["accessCount"], json!(2), "alice's attempts neither wrote nor read bob's document");

    // The admin token works on every route for both users; lower-case `bearer` is accepted.
    for user in ["alice", "bob"] {
        for (method, template) in v1_routes() {
            seed(user, ADMIN).await;
            let request =
                route_request(&server, &method, template, user).header("Authorization", "bearer admin-secret");
            let reply = server.send(request).await;
            assert_eq!(reply.status, StatusCode::OK, "admin on {user}'s {method} {template}: {}", reply.describe());
        }
    }

    // Operational endpoints need no token.
    for path in ["/healthz", "/readyz", "/metrics", "/openapi.json"] {
        assert_eq!(server.get(path).await.status, StatusCode::OK, "{path}");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_documents_and_unknown_routes_are_404() {
    let server = Server::start().await;
    let path = doc_path("u", "ns", "missing");
    let reason = server.get(&path).await.expect_error(StatusCode::NOT_FOUND, "not_found");
    assert!(reason.contains("missing"), "{reason}");
    server.call(Method::DELETE, &path).await.expect_error(StatusCode::NOT_FOUND, "not_found");
    let head = server.call(Method::HEAD, &path).await;
    assert_eq!(head.status, StatusCode::NOT_FOUND);
    assert!(head.body.is_empty());
    for unknown in [
        "/",
        "/nope",
        "/v1",
        "/v1/users",
        "/v1/users/u/namespaces/ns/keys/k/extra",
        "/v1/users/u/things",
        "/v2/users/u/namespaces",
        "/healthz/x",
        "/openapi.yaml",
    ] {
        for method in [Method::GET, Method::PUT, Method::POST, Method::DELETE] {
            let reply = server.send(server.req(method.clone(), unknown).json(&json!({ "value": 1 }))).await;
            reply.expect_error(StatusCode::NOT_FOUND, "not_found");
        }
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_methods_are_405() {
    let server = Server::start().await;
    let served: BTreeSet<(String, &str)> = ROUTES.iter().map(|(m, p)| (m.to_string(), *p)).collect();
    let methods = [Method::GET, Method::PUT, Method::POST, Method::DELETE, Method::PATCH];
    let mut checked = 0;
    for template in served.iter().map(|(_, p)| *p).collect::<BTreeSet<_>>() {
        for method in &methods {
            if served.contains(&(method.to_string(), template)) {
                continue;
            }
            let reply = server.send(route_request(&server, method, template, "u").json(&json!({ "value": 1 }))).await;
            reply.expect_error(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed");
            checked += 1;
        }
    }
    assert!(checked >= 20, "{checked}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_preconditions_are_412() {
    let server = Server::start().await;
    let path = doc_path("u", "ns", "k");
    let first = server.put_doc("u", "ns", "k", &json!({ "value": 1 })).await;
    let stale = format!("\"{}\"", first["_rev"].as_str().unwrap());
    let second = server.put_doc("u", "ns", "k", &json!({ "value": 2 })).await;

    let put = server.req(Method::PUT, &path).header("If-Match", &stale).json(&json!({ "value": 3 }));
    server.send(put).await.expect_error(StatusCode::PRECONDITION_FAILED, "precondition_failed");
    let delete = server.req(Method::DELETE, &path).header("If-Match", &stale);
    server.send(delete).await.expect_error(StatusCode::PRECONDITION_FAILED, "precondition_failed");
    let create = server.req(Method::PUT, &path).header("If-None-Match", "*").json(&json!({ "value": 3 }));
    server.send(create).await.expect_error(StatusCode::PRECONDITION_FAILED, "precondition_failed");

    // If-Match on a document that does not exist.
    let missing = doc_path("u", "ns", "missing");
    for value in ["*", "\"1\""] {
        let put = server.req(Method::PUT, &missing).header("If-Match", value).json(&json!({ "value": 1 }));
        server.send(put).await.expect_error(StatusCode::PRECONDITION_FAILED, "precondition_failed");
        let delete = server.req(Method::DELETE, &missing).header("If-Match", value);
        server.send(delete).await.expect_error(StatusCode::PRECONDITION_FAILED, "precondition_failed");
    }
    server.get(&missing).await.expect_error(StatusCode::NOT_FOUND, "not_found");

    // Nothing changed: HEAD still shows the second revision.
    let head = server.call(Method::HEAD, &path).await;
    assert_eq!(head.header("etag"), Some(format!("\"{}\"", second["_rev"].as_str().unwrap()).as_str()));
    assert_eq!(server.get(&path).await.document()["value"], json!(2));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_values_and_bodies_are_413() {
    let server = Server::start_with(|s| {
        s.max_value_bytes = 1000;
        s.max_body_bytes = Some(3000);
    })
    .await;
    let path = doc_path("u", "ns", "k");
    // "x"×998 is 1,000 bytes of JSON: exactly at the limit.
    server.put(&path, &json!({ "value": "x".repeat(998) })).await.document();
    let reason = server
        .put(&path, &json!({ "value": "x".repeat(999) }))
        .await
        .expect_error(StatusCode::PAYLOAD_TOO_LARGE, "too_large");
    assert!(reason.contains("1001") || reason.contains("1,001"), "{reason}");
    let metadata = json!({ "value": 1, "metadata": { "m": "x".repeat(1500) } });
    server.put(&path, &metadata).await.expect_error(StatusCode::PAYLOAD_TOO_LARGE, "too_large");
    // A body over the body limit is refused whatever it holds. The bodies stay small enough for
    // the server to read them whole: a server that answers before reading a large body closes
    // with unread data, which resets the connection under the client (HTTP/1.1 has no remedy).
    for size in [3001, 6000] {
        let body = format!("{{\"value\": 1, \"pad\": \"{}\"}}", " ".repeat(size));
        let put = server.req(Method::PUT, &path).header("content-type", "application/json").body(body);
        server.send(put).await.expect_error(StatusCode::PAYLOAD_TOO_LARGE, "too_large");
    }
    // Whitespace is not counted against the value limit, only against the body limit.
    let spaced = format!("{{\"value\": \"{}\"{}}}", "y".repeat(998), " ".repeat(1500));
    let put = server.req(Method::PUT, &path).header("content-type", "application/json").body(spaced);
    assert_eq!(server.send(put).await.document()["value"], json!("y".repeat(998)));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_must_be_declared_json_415() {
    let server = Server::start().await;
    let path = doc_path("u", "ns", "k");
    let body = r#"{"value": 1}"#;
    let mut cases: Vec<Option<HeaderValue>> = vec![None];
    for ctype in
        ["text/plain", "application/x-www-form-urlencoded", "application/jsonx", "json", "", "multipart/form-data"]
    {
        cases.push(Some(HeaderValue::from_static(ctype)));
    }
    cases.push(Some(HeaderValue::from_bytes(b"application/json\xff").unwrap()));
    for ctype in cases {
        let mut put = server.req(Method::PUT, &path).body(body);
        if let Some(ctype) = &ctype {
            put = put.header("content-type", ctype.clone());
        }
        let reason = server.send(put).await.expect_error(StatusCode::UNSUPPORTED_MEDIA_TYPE, "bad_content_type");
        assert!(reason.contains("application/json"), "{ctype:?}: {reason}");
    }
    server.get(&path).await.expect_error(StatusCode::NOT_FOUND, "not_found");
    for ctype in
        ["application/json", "application/json; charset=utf-8", "Application/JSON", "application/merge-patch+json"]
    {
        let put = server.req(Method::PUT, &path).header("content-type", ctype).body(body);
        assert_eq!(server.send(put).await.document()["value"], json!(1), "{ctype}");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_of_the_wrong_shape_are_422() {
    let server = Server::start().await;
    let path = doc_path("u", "ns", "k");
    for (body, mention) in [
        (json!([1]), "object"),
        (json!(null), "object"),
        (json!("value"), "object"),
        (json!(1), "object"),
        (json!({}), "value"),
        (json!({ "metadata": { "a": 1 } }), "value"),
        (json!({ "value": 1, "extra": 2 }), "extra"),
        (json!({ "value": 1, "metadata": {}, "_id": "x" }), "_id"),
    ] {
        let reply = server.put(&path, &body).await;
        let reason = reply.expect_error(StatusCode::UNPROCESSABLE_ENTITY, "bad_body");
        assert!(reason.contains(mention), "{body}: {reason}");
    }
    server.get(&path).await.expect_error(StatusCode::NOT_FOUND, "not_found");
    server.stop().await;
}
