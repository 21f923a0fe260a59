//! The change feed (`/v1/changes`): CouchDB's shape, admin tokens only, bad parameters named,
//! longpoll answering, ending and waiting at most half the request timeout, and a store of the
//! previous release told to upgrade.

use super::*;

/// `GET /v1/changes` with a query, as the admin.
async fn feed(server: &Server, query: &str) -> Reply {
    server.send(server.req(Method::GET, &format!("{CHANGES_ROUTE}?{query}")).bearer_auth(ADMIN)).await
}

/// A feed answer, checked against CouchDB's `_changes` shape: every result is
/// `{seq, id, changes: [{rev}]}` plus `deleted: true` for a deletion (never `deleted: false`).
/// Returns `(id, rev, deleted)` per result, `last_seq` and `pending`.
fn feed_rows(reply: &Reply) -> (Vec<(String, String, bool)>, String, u64) {
    let body = reply.expect_json(StatusCode::OK);
    let fields: BTreeSet<&str> = body.as_object().expect("an object").keys().map(String::as_str).collect();
    assert_eq!(fields, BTreeSet::from(["results", "last_seq", "pending"]), "{}", reply.describe());
    let rows = body["results"]
        .as_array()
        .expect("results is an array")
        .iter()
        .map(|row| {
            let object = row.as_object().expect("a result is an object");
            let fields: BTreeSet<&str> = object.keys().map(String::as_str).collect();
            let deleted = match row.get("deleted") {
                None => false,
                Some(flag) => {
                    assert_eq!(flag, &json!(true), "deleted appears only when true: {row}");
                    true
                }
            };
            let mut expected = BTreeSet::from(["seq", "id", "changes"]);
            if deleted {
                expected.insert("deleted");
            }
            assert_eq!(fields, expected, "{row}");
            assert!(row["seq"].is_string(), "{row}");
            let revs = row["changes"].as_array().expect("changes is an array");
            assert_eq!(revs.len(), 1, "{row}");
            let rev = revs[0]["rev"].as_str().expect("a rev").to_owned();
            (row["id"].as_str().expect("an id").to_owned(), rev, deleted)
        })
        .collect();
    let last_seq = body["last_seq"].as_str().expect("last_seq is a string").to_owned();
    (rows, last_seq, body["pending"].as_u64().expect("pending is a count"))
}

/// Writes a, b, c; deletes b; updates a. Returns what the feed must then say, in feed order
/// (each document at its last write): c, b (deleted), a.
async fn seed_feed(server: &Server) -> Vec<(String, String, bool)> {
    let put = |key: &'static str, value: i64| {
        let request =
            server.req(Method::PUT, &doc_path("alice", "ns", key)).bearer_auth(ADMIN).json(&json!({ "value": value }));
        async move { server.send(request).await.document() }
    };
    put("a", 1).await;
    let b = put("b", 1).await;
    let c = put("c", 1).await;
    let deleted = server.send(server.req(Method::DELETE, &doc_path("alice", "ns", "b")).bearer_auth(ADMIN)).await;
    assert_eq!(deleted.status, StatusCode::OK, "{}", deleted.describe());
    let a = put("a", 2).await;
    let text = |doc: &Value, field: &str| doc[field].as_str().expect("text").to_owned();
    let b_after_delete = server.store_revision(&text(&b, "_id")).await;
    vec![
        (text(&c, "_id"), text(&c, "_rev"), false),
        (text(&b, "_id"), b_after_delete, true),
        (text(&a, "_id"), text(&a, "_rev"), false),
    ]
}

impl Server {
    /// PUTs a document with the admin token and asserts it was stored.
    async fn put_as_admin(&self, user: &str, namespace: &str, key: &str, body: &Value) -> Value {
        self.send(self.req(Method::PUT, &doc_path(user, namespace, key)).bearer_auth(ADMIN).json(body)).await.document()
    }

    /// The revision the store holds for `id` (a tombstone's too), asked of the backend, not
    /// through the feed.
    async fn store_revision(&self, id: &str) -> String {
        let info = self.backend.revisions(id).await.expect("revisions");
        info.unwrap_or_else(|| panic!("no revisions of {id}")).rev.0
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_change_feed_answers_in_couchdbs_shape() {
    let server = server_with_tokens().await;
    let expected = seed_feed(&server).await;

    let (rows, last_seq, pending) = feed_rows(&feed(&server, "").await);
    assert_eq!(rows, expected);
    assert_eq!(pending, 0);
    // `since=0` is the start too, as in CouchDB.
    assert_eq!(feed_rows(&feed(&server, "since=0").await).0, expected);

    // Paging one change at a time through `since` finds the same, with `pending` counting down.
    let mut paged = Vec::new();
    let mut since = String::from("0");
    loop {
        let (rows, next, pending) = feed_rows(&feed(&server, &format!("limit=1&since={}", seg(&since))).await);
        if rows.is_empty() {
            assert_eq!(pending, 0);
            break;
        }
        assert_eq!(rows.len(), 1);
        paged.extend(rows);
        let left = expected.len() - paged.len();
        assert!(pending <= left as u64 && (left == 0 || pending >= 1), "pending {pending} with {left} left");
        since = next;
    }
    assert_eq!(paged, expected);

    // Nothing after the end; a later write shows up after it, alone.
    assert_eq!(feed_rows(&feed(&server, &format!("since={}", seg(&last_seq))).await).0, []);
    let d = server.put_as_admin("bob", "ns", "d", &json!({ "value": 1 })).await;
    let (rows, _, _) = feed_rows(&feed(&server, &format!("since={}", seg(&last_seq))).await);
    assert_eq!(rows, [(d["_id"].as_str().unwrap().to_owned(), d["_rev"].as_str().unwrap().to_owned(), false)]);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_change_feed_is_for_admin_tokens_only() {
    let server = server_with_tokens().await;
    let url = CHANGES_ROUTE;
    let reason = server
        .send(server.req(Method::GET, url).bearer_auth(ALICE))
        .await
        .expect_error(StatusCode::FORBIDDEN, "forbidden");
    assert!(reason.contains("admin"), "{reason}");
    // Refused before its parameters are looked at.
    let bad = server.send(server.req(Method::GET, &format!("{url}?limit=0")).bearer_auth(BOB)).await;
    bad.expect_error(StatusCode::FORBIDDEN, "forbidden");
    for credential in [None, Some("Bearer wrong-secret"), Some("Basic YWxpY2U6c2VjcmV0")] {
        let mut request = server.req(Method::GET, url);
        if let Some(credential) = credential {
            request = request.header("Authorization", credential);
        }
        let reply = server.send(request).await;
        reply.expect_error(StatusCode::UNAUTHORIZED, "unauthorized");
        assert_eq!(reply.header("www-authenticate"), Some("Bearer realm=\"agentstore\""));
    }
    assert_eq!(feed(&server, "").await.status, StatusCode::OK);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_change_feed_parameters_are_400_naming_them() {
    let server = server_with_tokens().await;
    for (query, parameter) in [
        ("limit=0", "limit"),
        ("limit=-1", "limit"),
        ("limit=ten", "limit"),
        ("limit=10001", "limit"),
        ("limit=1&limit=2", "limit"),
        ("feed=continuous", "feed"),
        ("feed=", "feed"),
        ("feed=longpoll&timeout=-5", "timeout"),
        ("feed=longpoll&timeout=1.5", "timeout"),
        ("timeout=soon", "timeout"),
        ("since=not-a-position-of-this-store", "since"),
    ] {
        let reason = feed(&server, query).await.expect_error(StatusCode::BAD_REQUEST, "bad_request");
        assert!(reason.contains(parameter), "{query}: {reason}");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn longpoll_answers_as_soon_as_a_change_arrives() {
    let server = Arc::new(server_with_tokens().await);
    server.put_as_admin("alice", "ns", "before", &json!({ "value": 1 })).await;
    // `since=now`: only what comes after.
    let (rows, now, _) = feed_rows(&feed(&server, "since=now").await);
    assert_eq!(rows, []);

    // Nothing new: the longpoll waits out its timeout and answers empty, at the same position.
    let started = Instant::now();
    let (rows, position, pending) =
        feed_rows(&feed(&server, &format!("feed=longpoll&timeout=300&since={}", seg(&now))).await);
    assert!(started.elapsed() >= Duration::from_millis(300), "answered after {:?}", started.elapsed());
    assert_eq!((rows, pending), (vec![], 0));

    let waiting = tokio::spawn({
        let server = Arc::clone(&server);
        async move {
            let started = Instant::now();
            let reply = feed(&server, &format!("feed=longpoll&timeout=15000&since={}", seg(&position))).await;
            (reply, started.elapsed())
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiting.is_finished(), "a longpoll with nothing new answered at once");
    let doc = server.put_as_admin("alice", "ns", "after", &json!({ "value": 2 })).await;
    let (reply, waited) = waiting.await.expect("longpoll task");
    let (rows, _, _) = feed_rows(&reply);
    assert_eq!(rows, [(doc["_id"].as_str().unwrap().to_owned(), doc["_rev"].as_str().unwrap().to_owned(), false)]);
    assert!(waited < Duration::from_secs(10), "the change arrived after 0.5 s; the answer came after {waited:?}");
    Arc::into_inner(server).expect("one owner").stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_longpoll_ends_when_its_client_disconnects() {
    // One connection at a time: the next client is served only once the longpoll's connection,
    // and so its wait, is over.
    let server = Server::start_with(|s| s.max_connections = 1).await;
    let addr = addr_of(&server);
    let mut waiting = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let request = format!("GET {CHANGES_ROUTE}?feed=longpoll&timeout=25000&since=now HTTP/1.1\r\nHost: x\r\n\r\n");
    waiting.write_all(request.as_bytes()).await.expect("send");
    let mut byte = [0u8; 1];
    let early = tokio::time::timeout(Duration::from_millis(500), waiting.read(&mut byte)).await;
    assert!(early.is_err(), "the longpoll answered with nothing new: {early:?}");
    drop(waiting);
    let mut next = tokio::net::TcpStream::connect(addr).await.expect("connect");
    next.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await.expect("send");
    let head = tokio::time::timeout(Duration::from_secs(5), read_head(&mut next))
        .await
        .expect("the disconnected longpoll kept its connection slot");
    assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_longpoll_ends_when_the_server_shuts_down() {
    let server = Server::start_with(|s| s.shutdown_grace_secs = 5).await;
    let client = server.client.clone();
    let url = format!("{}{CHANGES_ROUTE}?feed=longpoll&timeout=25000&since=now", server.base);
    let waiting = tokio::spawn(async move {
        let built = client.get(url).build().expect("request");
        send_with(&client, built, "longpoll".into()).await
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiting.is_finished(), "a longpoll with nothing new answered at once");
    let stopping = Instant::now();
    server.stop().await;
    // Within the grace period, with an answer: a wait cut by the grace period would be a dropped
    // connection instead.
    let reply = waiting.await.expect("longpoll task");
    let (rows, _, _) = feed_rows(&reply);
    assert_eq!(rows, []);
    assert!(stopping.elapsed() < Duration::from_secs(4), "stopping took {:?}", stopping.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_longpoll_waits_at_most_half_the_request_timeout() {
    let server = Server::start_with(|s| s.request_timeout_secs = 2).await;
    let started = Instant::now();
    let (rows, _, _) = feed_rows(&feed(&server, "feed=longpoll&timeout=25000&since=now").await);
    let waited = started.elapsed();
    assert_eq!(rows, []);
    assert!(waited >= Duration::from_millis(900) && waited < Duration::from_millis(1900), "waited {waited:?}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_of_the_previous_release_is_told_to_upgrade() {
    let dir = tempfile::tempdir().expect("temp dir");
    let settings = settings(&dir);
    let key = "k";
    let id = format!("u:ns:{}", encode_key(key));
    let body = json!({ "userId": "u", "namespace": "ns", "key": key, "value": 7 });
    let store = dir.path().join("s.redb");
    agentstore::backend::embedded::write_previous_release_file(&store, &[(id, body.as_object().unwrap().clone())])
        .expect("old store");
    let backend = agentstore::backend::open(&settings.backend.parse().expect("url")).await.expect("open");
    let server = Server::on_backend(backend, &settings, dir).await;
    let reason = feed(&server, "").await.expect_error(StatusCode::INTERNAL_SERVER_ERROR, "misconfigured");
    assert!(reason.contains("agentstore upgrade") && reason.contains("request id"), "{reason}");
    // Everything else works as before.
    let doc = server.get(&doc_path("u", "ns", key)).await.document();
    assert_eq!(doc["value"], json!(7));
    server.stop().await;
}
