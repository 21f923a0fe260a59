//! Bounds the REST API and the CouchDB API share (the same connection code serves both): stalled
//! bodies and logins, a gzip bomb, failed logins locking a name, heartbeats, clamped longpoll
//! timeouts and long-lived feeds per login.

use super::*;

/// The CouchDB API in this process over a fresh embedded store, serving until dropped.
struct CouchServer {
    addr: SocketAddr,
    _stop: oneshot::Sender<()>,
    _dir: TempDir,
}

/// The CouchDB API with these tests' settings, `tweak` applied.
async fn couch_server(tweak: impl FnOnce(&mut Settings)) -> CouchServer {
    couch_server_over(|backend| backend, tweak).await
}

/// The same over `wrap` of the embedded store.
async fn couch_server_over(
    wrap: impl FnOnce(Arc<dyn DocumentBackend>) -> Arc<dyn DocumentBackend>,
    tweak: impl FnOnce(&mut Settings),
) -> CouchServer {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut settings = settings(&dir);
    tweak(&mut settings);
    let url = settings.backend.parse().expect("backend url");
    let backend = wrap(agentstore::backend::open(&url).await.expect("open embedded store"));
    let store =
        Arc::new(agentstore::store::DataStore::open(backend, settings.store_options()).await.expect("store opens"));
    let app = agentstore::couchdb_api::CouchApp::build(store, &settings).await.expect("couch app builds");
    let listener = agentstore::couchdb_api::bind("127.0.0.1:0", &app, false).await.expect("bind loopback");
    let addr = listener.local_addr().expect("local address");
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = app
            .serve(listener, &settings, async move {
                let _ = stopped.await;
            })
            .await;
    });
    CouchServer { addr, _stop: stop, _dir: dir }
}

/// How a stalling client sends its body.
#[derive(Debug, Clone, Copy)]
enum Stall {
    /// Declares 1,000 bytes, sends 10, then nothing.
    Stops,
    /// Declares 1,000 bytes and sends one every 300 ms.
    Trickles,
    /// A chunked body whose last chunk never comes.
    NeverEnds,
}

/// Opens a connection and sends `method path` with a body that stalls as `stall` says, with
/// `headers` (each ending in CRLF). Answers the connection, still open, and the trickling task.
async fn start_stalled(
    addr: SocketAddr,
    method_path: &str,
    headers: &str,
    stall: Stall,
) -> (tokio::net::TcpStream, Option<JoinHandle<()>>) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let framing = match stall {
        Stall::Stops | Stall::Trickles => "Content-Length: 1000\r\n",
        Stall::NeverEnds => "Transfer-Encoding: chunked\r\n",
    };
    let head = format!("{method_path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}{framing}\r\n");
    stream.write_all(head.as_bytes()).await.expect("send head");
    let first: &[u8] = match stall {
        Stall::Stops | Stall::Trickles => b"{\"docs\": [",
        Stall::NeverEnds => b"a\r\n{\"docs\": [\r\n",
    };
    stream.write_all(first).await.expect("send the first body bytes");
    if !matches!(stall, Stall::Trickles) {
        return (stream, None);
    }
    // The writes go through a duplicate of the socket, so the reader keeps the stream itself.
    let std = stream.into_std().expect("std stream");
    let writer = std.try_clone().expect("clone the socket");
    let stream = tokio::net::TcpStream::from_std(std).expect("tokio stream");
    let mut writer = tokio::net::TcpStream::from_std(writer).expect("tokio writer");
    let trickle = tokio::spawn(async move {
        for _ in 0..900 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            if writer.write_all(b" ").await.is_err() {
                return;
            }
        }
    });
    (stream, Some(trickle))
}

/// Everything the server sends until it closes the connection (at most 30 s).
async fn read_until_closed(stream: &mut tokio::net::TcpStream) -> String {
    let mut response = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
            Ok(Ok(n)) => response.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&response).into_owned()
}

/// The answer must be a 408 whose JSON body names the bound.
fn assert_body_timeout(response: &str, what: &str) {
    assert!(response.starts_with("HTTP/1.1 408 "), "{what}: {response:?}");
    let body = response.split("\r\n\r\n").nth(1).unwrap_or_default();
    let body: Value =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("{what}: body not JSON ({e}): {response:?}"));
    assert_eq!(body["error"], json!("request_timeout"), "{what}: {body}");
    assert!(body["reason"].as_str().is_some_and(|r| r.contains("body_read_timeout_secs")), "{what}: {body}");
}

/// A body that stops, trickles, or never ends is cut at `body_read_timeout_secs` with a 408 on
/// both faces. On REST the hard request cut (here at 2 s) used to answer such a client 504.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_bodies_are_408_on_both_faces() {
    let rest = Server::start_with(|s| {
        s.body_read_timeout_secs = 1;
        s.request_timeout_secs = 1;
    })
    .await;
    let couch = couch_server(|s| s.body_read_timeout_secs = 1).await;
    let rest_put = format!("PUT {}", doc_path("u", "ns", "k"));
    let targets = [
        ("REST PUT", addr_of(&rest), rest_put.as_str()),
        ("CouchDB _bulk_docs", couch.addr, "POST /agent_data_store/_bulk_docs"),
        ("CouchDB POST /_session", couch.addr, "POST /_session"),
    ];
    for (face, addr, method_path) in targets {
        for stall in [Stall::Stops, Stall::Trickles, Stall::NeverEnds] {
            let (mut stream, trickle) = start_stalled(addr, method_path, "", stall).await;
            let response = read_until_closed(&mut stream).await;
            if let Some(trickle) = trickle {
                trickle.abort();
            }
            assert_body_timeout(&response, &format!("{face}, body {stall:?}"));
        }
    }
    rest.stop().await;
}

/// The attack of issue 22: anonymous `POST /_session` bodies that stall held every connection
/// slot, so `/_up` and every login waited for as long as the attacker liked. Now each stalled
/// login is answered 408 at the body timeout, its slot frees, and `/_up` is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_logins_no_longer_starve_up() {
    const SLOTS: usize = 4;
    let couch = couch_server(|s| {
        s.body_read_timeout_secs = 1;
        s.max_connections = SLOTS;
        s.idle_timeout_secs = 600;
    })
    .await;
    let mut stalled = Vec::new();
    for i in 0..SLOTS {
        let stall = if i % 2 == 0 { Stall::Stops } else { Stall::NeverEnds };
        stalled.push(start_stalled(couch.addr, "POST /_session", "", stall).await.0);
    }
    // Beyond the cap: waits in the listen backlog for a slot.
    let mut up = tokio::net::TcpStream::connect(couch.addr).await.expect("connect");
    up.write_all(b"GET /_up HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.expect("send");
    for (i, stream) in stalled.iter_mut().enumerate() {
        assert_body_timeout(&read_until_closed(stream).await, &format!("stalled login {i}"));
    }
    let answer = read_until_closed(&mut up).await;
    assert!(answer.starts_with("HTTP/1.1 200 "), "/_up after the stalled logins: {answer:?}");
    assert!(answer.contains("\"status\":\"ok\""), "{answer}");
}

/// An Argon2id hash with the smallest parameters, so tests do not wait on the KDF.
fn cheap_hash(password: &str) -> String {
    use argon2::password_hash::{PasswordHasher, SaltString};
    let params = argon2::Params::new(8, 1, 1, None).expect("params");
    let argon2 = argon2::Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, params);
    let salt = SaltString::encode_b64(b"sixteen byte sal").expect("salt");
    argon2.hash_password(password.as_bytes(), &salt).expect("hash").to_string()
}

/// Logins `admin` (password `admin-pw`) and `alice` (password `alice-pw`, user `alice`).
fn couch_logins(settings: &mut Settings) {
    use agentstore::config::{CouchUserSetting, CouchUsersSetting};
    settings.couchdb_users = CouchUsersSetting::List(vec![
        CouchUserSetting {
            name: "admin".into(),
            password_hash: cheap_hash("admin-pw"),
            user: None,
            admin: true,
            roles: Vec::new(),
        },
        CouchUserSetting {
            name: "alice".into(),
            password_hash: cheap_hash("alice-pw"),
            user: Some("alice".into()),
            admin: false,
            roles: Vec::new(),
        },
    ]);
}

fn basic_header(name: &str, password: &str) -> String {
    use base64::Engine;
    format!(
        "Authorization: Basic {}\r\n",
        base64::engine::general_purpose::STANDARD.encode(format!("{name}:{password}"))
    )
}

/// One whole request over a fresh connection (`Connection: close`); answers the status code and
/// the JSON body (`Null` when it is not JSON).
async fn couch_call(addr: SocketAddr, method_path: &str, headers: &str, body: &[u8]) -> (u16, Value) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "{method_path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n{headers}\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.expect("send head");
    stream.write_all(body).await.expect("send body");
    let response = read_until_closed(&mut stream).await;
    let status = response.get(9..12).and_then(|code| code.parse().ok()).unwrap_or(0);
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or_default();
    let body =
        if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(body) } else { body.to_owned() };
    (status, serde_json::from_str(&body).unwrap_or(Value::Null))
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    encoder.write_all(bytes).expect("compress");
    encoder.finish().expect("compress")
}

/// Issue 22: a 95 KiB gzip `_find` from a per-user login inflated to 64 MiB and took the process
/// to 4.3 GB. Now `_find` bodies are held to `couchdb_max_query_bytes` after decompression (here
/// a 16 MiB selector in 16 KiB of gzip), with 413 naming the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gzip_bomb_find_is_413_by_its_inflated_size() {
    let couch = couch_server(couch_logins).await;
    let selector = format!("{{\"selector\": {{\"userId\": \"{}\"}}}}", "a".repeat(16 << 20));
    let bomb = gzip(selector.as_bytes());
    assert!(bomb.len() < 96 << 10, "the bomb is {} bytes", bomb.len());
    let headers = format!("{}Content-Encoding: gzip\r\n", basic_header("alice", "alice-pw"));
    let (status, body) = couch_call(couch.addr, "POST /agent_data_store/_find", &headers, &bomb).await;
    assert_eq!(status, 413, "{body}");
    assert_eq!(body["error"], json!("too_large"), "{body}");
    assert!(body["reason"].as_str().is_some_and(|r| r.contains("couchdb_max_query_bytes")), "{body}");
    // A small gzip `_find` is still answered.
    let small = gzip(br#"{"selector": {"userId": "alice"}}"#);
    let (status, body) = couch_call(couch.addr, "POST /agent_data_store/_find", &headers, &small).await;
    assert_eq!(status, 200, "{body}");
}

/// CouchDB 3.4.3's lockout (`chttpd_auth_lockout`, threshold 5): five wrong passwords are 401,
/// then the name from that address is 403 with CouchDB's reason (`couch_httpd_auth.erl`), even with
/// the right password and through `POST /_session`; another login from the same address works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_logins_lock_the_name_from_that_address() {
    let couch = couch_server(couch_logins).await;
    let wrong = basic_header("alice", "guess");
    for attempt in 0..5 {
        let (status, body) = couch_call(couch.addr, "GET /agent_data_store", &wrong, b"").await;
        assert_eq!(status, 401, "attempt {attempt}: {body}");
    }
    let locked = json!({
        "error": "forbidden",
        "reason": "Account is temporarily locked due to multiple authentication failures"
    });
    for headers in [wrong.clone(), basic_header("alice", "alice-pw")] {
        let (status, body) = couch_call(couch.addr, "GET /agent_data_store", &headers, b"").await;
        assert_eq!((status, &body), (403, &locked), "{headers}");
    }
    let login = br#"{"name": "alice", "password": "alice-pw"}"#;
    let (status, body) = couch_call(couch.addr, "POST /_session", "", login).await;
    assert_eq!((status, &body), (403, &locked));
    let (status, body) = couch_call(couch.addr, "GET /agent_data_store", &basic_header("admin", "admin-pw"), b"").await;
    assert_eq!(status, 200, "{body}");
}

/// Counts the backend's change-feed reads.
struct CountingFeedReads {
    inner: Arc<dyn DocumentBackend>,
    reads: Arc<std::sync::atomic::AtomicUsize>,
}

#[async_trait]
impl Layered for CountingFeedReads {
    fn inner(&self) -> &dyn DocumentBackend {
        self.inner.as_ref()
    }

    async fn changes(&self, since: Option<&str>, limit: usize) -> agentstore::Result<ChangesPage> {
        self.reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.changes(since, limit).await
    }
}

/// Issue 22: `heartbeat=1` re-read the feed every millisecond and a heartbeat kept a continuous
/// feed open for ever. Now the heartbeat is raised to `couchdb_changes_min_heartbeat_ms` (here
/// 100 ms), written on its own timer while the backend is polled on the back-off schedule, and
/// the feed ends at `couchdb_changes_max_feed_secs` (here 2 s) with its `last_seq` line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_costs_newlines_not_reads_and_a_feed_ends() {
    let reads = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = Arc::clone(&reads);
    let couch = couch_server_over(
        move |inner| Arc::new(CountingFeedReads { inner, reads: counter }),
        |s| {
            s.couchdb_changes_min_heartbeat_ms = 100;
            s.couchdb_changes_max_feed_secs = 2;
        },
    )
    .await;
    let (status, body) = {
        let mut stream = tokio::net::TcpStream::connect(couch.addr).await.expect("connect");
        let request = "GET /agent_data_store/_changes?feed=continuous&heartbeat=1&since=now HTTP/1.1\r\nHost: x\r\n\
                       Connection: close\r\n\r\n";
        stream.write_all(request.as_bytes()).await.expect("send");
        let response = read_until_closed(&mut stream).await;
        (
            response.get(9..12).unwrap_or_default().to_owned(),
            response.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned(),
        )
    };
    assert_eq!(status, "200");
    let body = dechunk(&body);
    let lines: Vec<&str> = body.split('\n').collect();
    let heartbeats = lines.iter().filter(|line| line.is_empty()).count();
    let last: Value = serde_json::from_str(lines.iter().rev().find(|l| !l.is_empty()).expect("a last line"))
        .expect("the last line is JSON");
    assert!(last.get("last_seq").is_some(), "the feed ends with its last_seq line: {last}");
    // 2 s at 100 ms: about 20 heartbeats (not 2,000 at 1 ms).
    assert!((5..=40).contains(&heartbeats), "{heartbeats} heartbeats");
    // Polls back off to one a second: a handful in 2 s, not one per heartbeat.
    let polls = reads.load(std::sync::atomic::Ordering::Relaxed);
    assert!(polls <= 15, "{polls} feed reads for {heartbeats} heartbeats");
}

/// The body of a chunked response, its chunks joined.
fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else { break };
        if size == 0 || after.len() < size {
            break;
        }
        out.push_str(&after[..size]);
        rest = after[size..].strip_prefix("\r\n").unwrap_or(&after[size..]);
    }
    out
}

/// `timeout=u64::MAX` on a longpoll used to wait that long; it is clamped to
/// `couchdb_changes_timeout_ms` (CouchDB clamps it to its `changes_timeout` the same way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_longpoll_timeout_is_clamped() {
    let couch = couch_server(|s| s.couchdb_changes_timeout_ms = 1000).await;
    let path = format!("GET /agent_data_store/_changes?feed=longpoll&since=now&timeout={}", u64::MAX);
    let (status, body) = couch_call(couch.addr, &path, "", b"").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["results"], json!([]), "{body}");
}

/// One login holds at most `couchdb_max_feeds_per_login` long-lived feeds; the next is 429
/// naming the setting, while another login still gets its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_lived_feeds_per_login_are_bounded() {
    const MAX: usize = 3;
    let couch = couch_server(|s| {
        couch_logins(s);
        s.couchdb_max_feeds_per_login = MAX;
    })
    .await;
    let feed = |who: &str, password: &str, kind: &str| {
        let auth = basic_header(who, password);
        format!(
            "GET /agent_data_store/_changes?feed={kind}&since=now&timeout=60000 HTTP/1.1\r\nHost: x\r\n{auth}\
             Connection: close\r\n\r\n"
        )
    };
    let mut held = Vec::new();
    for i in 0..MAX {
        let mut stream = tokio::net::TcpStream::connect(couch.addr).await.expect("connect");
        let kind = if i % 2 == 0 { "longpoll" } else { "continuous" };
        stream.write_all(feed("alice", "alice-pw", kind).as_bytes()).await.expect("send");
        let head = read_head(&mut stream).await;
        assert!(head.starts_with("HTTP/1.1 200 "), "feed {i}: {head}");
        held.push(stream);
    }
    let (status, body) = couch_call(
        couch.addr,
        "GET /agent_data_store/_changes?feed=longpoll&since=now",
        &basic_header("alice", "alice-pw"),
        b"",
    )
    .await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"], json!("too_many_requests"), "{body}");
    assert!(body["reason"].as_str().is_some_and(|r| r.contains("couchdb_max_feeds_per_login")), "{body}");
    // A normal feed is not long-lived, and another login has its own count.
    let (status, body) =
        couch_call(couch.addr, "GET /agent_data_store/_changes", &basic_header("alice", "alice-pw"), b"").await;
    assert_eq!(status, 200, "{body}");
    let mut other = tokio::net::TcpStream::connect(couch.addr).await.expect("connect");
    other.write_all(feed("admin", "admin-pw", "longpoll").as_bytes()).await.expect("send");
    assert!(read_head(&mut other).await.starts_with("HTTP/1.1 200 "));
    drop(held);
}

/// The bounds of databases besides the data-store one are settings, and each refusal names its
/// setting: a document over `couchdb_max_document_bytes` is 413, `_dbs_info` past
/// `couchdb_max_dbs_info_keys` names is 400, and `_changes?descending=true` of a feed longer than
/// `couchdb_max_descending_changes` is 400; at the bounds the requests are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_bounds_are_settings() {
    let couch = couch_server(|s| {
        s.couchdb_max_document_bytes = 100;
        s.couchdb_max_dbs_info_keys = 2;
        s.couchdb_max_descending_changes = 3;
    })
    .await;
    let call = |path: &'static str, body: Value| async move {
        couch_call(couch.addr, path, "", body.to_string().as_bytes()).await
    };
    assert_eq!(call("PUT /bounded", Value::Null).await.0, 201);
    let (status, body) = call("PUT /bounded/small", json!({"v": "x".repeat(50)})).await;
    assert_eq!(status, 201, "a document within the bound: {body}");
    let (status, body) = call("PUT /bounded/big", json!({"v": "x".repeat(101)})).await;
    assert_eq!(status, 413, "a document over the bound: {body}");
    assert_eq!(body["error"], json!("document_too_large"), "{body}");
    let (status, body) = call("POST /_dbs_info", json!({"keys": ["bounded", "other"]})).await;
    assert_eq!(status, 200, "as many names as the bound: {body}");
    let (status, body) = call("POST /_dbs_info", json!({"keys": ["a", "b", "c"]})).await;
    assert_eq!(status, 400, "one name past the bound: {body}");
    assert!(body["reason"].as_str().is_some_and(|r| r.contains("couchdb_max_dbs_info_keys")), "{body}");
    assert_eq!(call("PUT /bounded/b", json!({})).await.0, 201);
    assert_eq!(call("PUT /bounded/c", json!({})).await.0, 201);
    let (status, body) = call("GET /bounded/_changes?descending=true", Value::Null).await;
    assert_eq!(status, 200, "a feed of as many changes as the bound: {body}");
    assert_eq!(body["results"][0]["id"], json!("c"), "newest first: {body}");
    assert_eq!(call("PUT /bounded/d", json!({})).await.0, 201);
    let (status, body) = call("GET /bounded/_changes?descending=true", Value::Null).await;
    assert_eq!(status, 400, "a feed longer than the bound: {body}");
    assert!(body["reason"].as_str().is_some_and(|r| r.contains("couchdb_max_descending_changes")), "{body}");
}
