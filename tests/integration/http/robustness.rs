//! Odd inputs never cause a server error, awkward keys and namespaces round-trip, and binding
//! beyond loopback needs tokens or consent.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_inputs_never_cause_a_server_error() {
    let server = Server::start().await;
    let path = doc_path("u", "ns", "k");
    let nest = |depth: usize| format!("{}{}", "[".repeat(depth), "]".repeat(depth));

    // Bodies.
    let mut bodies: Vec<Vec<u8>> = [
        "",
        " ",
        "null",
        "[]",
        "{}",
        "\"\"",
        "0",
        "{\"value\":1e999999}",
        "{\"value\":-0.0e-999}",
        "{\"value\":123456789012345678901234567890}",
        "{\"value\":1,\"value\":2}",
        "{\"value\":\"\\u0000\"}",
        "{\"value\":\"\\udc00\\ud800\"}",
        "{\"value\":1,\"metadata\":{\"\":null}}",
        "{\"value\":{\"\":{\"\":[]}}}",
        "{\"value\":1,\"metadata\":{\"a\":1,\"a\":2}}",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    bodies.push(nest(10_000).into_bytes());
    bodies.push("[".repeat(10_000).into_bytes());
    bodies.push("{\"a\":".repeat(10_000).into_bytes());
    bodies.push(format!("{{\"value\":{}}}", nest(10_000)).into_bytes());
    bodies.push(b"\xff\xfe\xfd".to_vec());
    bodies.push(b"{\"value\":\"\xff\"}".to_vec());
    bodies.push(b"{\"value\":\"\xed\xa0\x80\"}".to_vec());
    bodies.push(b"{\"value\":1}\0".to_vec());
    for depth in 120..=130 {
        bodies.push(format!("{{\"value\":{}}}", nest(depth)).into_bytes());
        bodies.push(format!("{{\"value\":1,\"metadata\":{{\"m\":{}}}}}", nest(depth)).into_bytes());
    }
    for body in bodies {
        let shown = String::from_utf8_lossy(&body).chars().take(60).collect::<String>();
        let put = server.req(Method::PUT, &path).header("content-type", "application/json").body(body);
        let reply = server.send(put).await;
        assert!(reply.status.is_client_error() || reply.status.is_success(), "{shown}: {}", reply.describe());
        if reply.status.is_client_error() {
            assert!(reply.json()["error"].is_string(), "{shown}: {}", reply.describe());
        } else {
            // What was stored can be read back.
            let read = server.get(&path).await;
            assert_eq!(read.status, StatusCode::OK, "{shown}: {}", read.describe());
            assert_eq!(read.json()["value"], reply.json()["value"], "{shown}");
        }
    }
    let listing = server.get(&namespace_path("u", "ns")).await;
    assert_eq!(listing.status, StatusCode::OK, "{}", listing.describe());

    // Path segments that do not decode to valid names.
    // Not UTF-8 once decoded: always refused.
    let invalid = ["%FF", "%C0%80", "%ED%A0%80", "%F4%90%80%80", "%E2%82", "a%80b"];
    // Odd but decodable: a control character is refused in a user id or namespace, fine in a key;
    // malformed escapes are taken literally.
    let odd = ["%", "%zz", "%%", "a%2", "%00", "%0A", "%7F", "%2F%2F", "%3F%23"];
    let mut checked = 0;
    for (method, template) in ROUTES.iter().filter(|(_, t)| t.contains('{')) {
        let method = Method::from_bytes(method.as_bytes()).expect("valid method");
        for bad in invalid.iter().chain(&odd) {
            for param in ["{user}", "{namespace}", "{key}"] {
                if !template.contains(param) {
                    continue;
                }
                let url = template
                    .replace(param, bad)
                    .replace("{user}", "u")
                    .replace("{namespace}", "ns")
                    .replace("{key}", "k");
                let request = server.req(method.clone(), &url).json(&json!({ "value": 1 }));
                let reply = server.send(request).await;
                if invalid.contains(bad) {
                    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{method} {url}: {}", reply.describe());
                } else {
                    assert!(reply.status.as_u16() < 500, "{method} {url}: {}", reply.describe());
                }
                if reply.status.is_client_error() && method != Method::HEAD {
                    assert!(reply.json()["error"].is_string(), "{method} {url}: {}", reply.describe());
                }
                checked += 1;
            }
        }
    }
    assert!(checked > 100, "{checked}");

    // Odd headers.
    let odd = HeaderValue::from_bytes(b"\x80\xff").unwrap();
    for name in ["authorization", "if-match", "if-none-match", "x-agent-id", "content-type", "x-request-id", "accept"] {
        for method in [Method::PUT, Method::GET, Method::HEAD, Method::DELETE] {
            let request = server.req(method.clone(), &path).json(&json!({ "value": 1 })).header(name, odd.clone());
            let reply = server.send(request).await;
            assert!(reply.status.as_u16() < 500, "{method} with {name}: {}", reply.describe());
        }
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn awkward_keys_and_namespaces_round_trip() {
    let server = Server::start().await;
    let user = "ünï user+x@example.com";
    let keys = [
        "src/main.py",
        "/leading/and/trailing/",
        "a//b",
        "key:with:colons",
        "what?",
        "#hash",
        "100%",
        "%41",
        "%2F",
        "with space",
        " ",
        "plus+sign",
        "日本語 🚀",
        "ünïcödé",
        "\u{0}\u{1f}",
        "tab\there",
        "a\\b",
        "&=;,",
        "\"quoted\"",
        "...",
        ".hidden",
        "x/./y",
        "x/../y",
        "~tilde",
    ];
    let namespaces = ["files:my repo/ü", "?#%+ :", "名前空間", "default"];
    for ns in namespaces {
        for (i, key) in keys.iter().enumerate() {
            let doc = server.put_doc(user, ns, key, &json!({ "value": i, "metadata": { "key": key } })).await;
            assert_eq!(doc["key"], json!(key));
            assert_eq!(doc["namespace"], json!(ns));
            assert_eq!(doc["userId"], json!(user));
            assert_eq!(doc["_id"], json!(format!("{user}:{ns}:{}", encode_key(key))));
            let read = server.get(&doc_path(user, ns, key)).await.document();
            assert_eq!((&read["key"], &read["value"]), (&json!(key), &json!(i)), "{ns:?} {key:?}");
            assert_eq!(server.call(Method::HEAD, &doc_path(user, ns, key)).await.status, StatusCode::OK);
        }
        let listed = server.get(&keys_path(user, ns)).await.expect_json(StatusCode::OK);
        let listed: BTreeSet<String> = serde_json::from_value(listed).expect("string array");
        assert_eq!(listed, keys.iter().map(|k| k.to_string()).collect(), "{ns:?}");
        let all = server.get(&namespace_path(user, ns)).await.expect_json(StatusCode::OK);
        let all: BTreeMap<String, Value> = serde_json::from_value(all).expect("object");
        let expected: BTreeMap<String, Value> =
            keys.iter().enumerate().map(|(i, k)| (k.to_string(), json!(i))).collect();
        assert_eq!(all, expected, "{ns:?}");
    }
    let listed = server.get(&namespaces_path(user)).await.expect_json(StatusCode::OK);
    let mut expected: Vec<&str> = namespaces.to_vec();
    expected.sort_unstable();
    assert_eq!(listed, json!(expected));
    // Deleting one awkward key deletes only it.
    let deleted = server.call(Method::DELETE, &doc_path(user, "?#%+ :", "%2F")).await;
    assert_eq!(deleted.expect_json(StatusCode::OK), json!({ "ok": true, "deleted": 1 }));
    assert_eq!(server.get(&doc_path(user, "?#%+ :", "/")).await.status, StatusCode::NOT_FOUND);
    assert_eq!(server.call(Method::HEAD, &doc_path(user, "?#%+ :", "%41")).await.status, StatusCode::OK);
    let deleted = server.call(Method::DELETE, &namespace_path(user, "?#%+ :")).await.expect_json(StatusCode::OK);
    assert_eq!(deleted, json!({ "ok": true, "deleted": keys.len() - 1 }));
    let purged = server.call(Method::DELETE, &user_path(user)).await.expect_json(StatusCode::OK);
    assert_eq!(purged, json!({ "ok": true, "deleted": keys.len() * 3 }));
    server.stop().await;
}

// ---- binding ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binding_beyond_loopback_needs_tokens_or_consent() {
    let dir = tempfile::tempdir().expect("temp dir");
    let open_settings = settings(&dir);
    let url = open_settings.backend.parse().expect("backend url");
    let backend = agentstore::backend::open(&url).await.expect("open store");
    let open = App::build(Arc::clone(&backend), &open_settings).await.expect("app");
    assert!(open.is_open());
    let err = bind("0.0.0.0:0", &open, false).await.expect_err("refused without tokens or consent");
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert!(err.to_string().contains("--allow-unauthenticated"), "{err}");
    let listener = bind("0.0.0.0:0", &open, true).await.expect("binds with --allow-unauthenticated");
    assert!(listener.local_addr().unwrap().ip().is_unspecified());
    drop(listener);
    let loopback = bind("127.0.0.1:0", &open, false).await.expect("loopback needs no consent");
    assert!(loopback.local_addr().unwrap().ip().is_loopback());
    drop(loopback);

    let mut guarded_settings = open_settings.clone();
    guarded_settings.tokens = token_settings();
    let guarded = App::build(backend, &guarded_settings).await.expect("app");
    assert!(!guarded.is_open());
    let listener = bind("0.0.0.0:0", &guarded, false).await.expect("binds with tokens configured");
    assert!(listener.local_addr().unwrap().ip().is_unspecified());
}
