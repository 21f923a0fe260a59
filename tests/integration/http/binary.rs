//! The built `agentstore serve` binary: peak memory of large puts bounded, SIGTERM finishing
//! in-flight requests before a clean exit, and the drain between the two (not ready, still
//! serving, long-lived feeds ended with their `last_seq`).

use super::*;

/// The child process, killed if the test fails before it exits.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// `agentstore serve` over a fresh embedded store in `dir`, on an ephemeral loopback port, with
/// no `AGENTSTORE_*` settings from the environment but `env`'s. Returns the child, its address, and its
/// stderr lines (drained on a thread, so the server never blocks on a full pipe).
async fn spawn_serve(
    dir: &TempDir,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (Child, SocketAddr, tokio::sync::mpsc::UnboundedReceiver<String>, Vec<String>) {
    use std::io::BufRead;
    use std::process::Stdio;

    let mut command = crate::common::agentstore(dir.path());
    command
        .args(["serve", "--listen", "127.0.0.1:0", "--backend"])
        .arg(format!("embedded:{}", dir.path().join("s.redb").display()))
        .args(extra)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = Child(command.spawn().expect("spawn agentstore serve"));
    let stderr = child.0.stderr.take().expect("stderr pipe");
    let (lines_tx, mut lines) = tokio::sync::mpsc::unbounded_channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut log = Vec::new();
    let addr: SocketAddr = loop {
        let line = tokio::time::timeout_at(deadline, lines.recv())
            .await
            .unwrap_or_else(|_| panic!("no 'serving' line within 20 s: {log:#?}"))
            .unwrap_or_else(|| panic!("stderr closed before 'serving': {log:#?}"));
        if let Some(rest) = line.strip_prefix("agentstore: serving http://") {
            let addr = rest.split(' ').next().unwrap_or_default();
            break addr.parse().unwrap_or_else(|e| panic!("address in {line:?}: {e}"));
        }
        log.push(line);
    };
    (child, addr, lines, log)
}

/// The peak resident memory of process `pid` so far (VmHWM), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read /proc/PID/status");
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("a VmHWM line");
    let kib: u64 = line.split_whitespace().nth(1).and_then(|n| n.parse().ok()).expect("VmHWM in kB");
    kib * 1024
}

/// A PUT body over raw TCP; returns the status line.
async fn put_raw(addr: SocketAddr, key: &str, body: &[u8]) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "PUT {} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        doc_path("u", "ns", key),
        body.len()
    );
    stream.write_all(head.as_bytes()).await.expect("send head");
    stream.write_all(body).await.expect("send body");
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(120), stream.read_to_end(&mut response))
        .await
        .expect("answer within 120 s")
        .expect("read answer");
    String::from_utf8_lossy(&response).lines().next().unwrap_or_default().to_owned()
}

/// Bodies of the default 4.26 MB body limit whose parsed trees are many times their text:
/// one-digit numbers (a heap string each under `arbitrary_precision`) and one-entry objects (an
/// `IndexMap` each under `preserve_order`). `items` × the item's text, padded with spaces to
/// `total` bytes.
fn hostile_body(item: &str, items: usize, total: usize) -> Vec<u8> {
    let mut body = String::with_capacity(total);
    body.push_str("{\"value\": [");
    for i in 0..items {
        if i > 0 {
            body.push(',');
        }
        body.push_str(item);
    }
    body.push_str("]}");
    let pad = total.saturating_sub(body.len());
    body.insert_str(body.len() - 1, &" ".repeat(pad));
    body.into_bytes()
}

/// Issue 11, item 3: one 4.26 MB body raised the peak RSS from 11 MB to 232 MB, 16 at once to
/// 586 MB. The bounds asserted here are documented in docs/rest-api.md (Connections and memory).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peak_memory_of_large_puts_is_bounded() {
    const MIB: u64 = 1 << 20;
    let dir = tempfile::tempdir().expect("temp dir");
    let (child, addr, _lines, _log) = spawn_serve(&dir, &[], &[]).await;
    let pid = child.0.id();
    assert!(put_raw(addr, "warm", br#"{"value": 1}"#).await.starts_with("HTTP/1.1 200 "));
    let base = peak_rss(pid);
    let limit = 4 * 1024 * 1024 + 64 * 1024;

    // Over the value limit: refused before any tree is built.
    let over = hostile_body("1", 2_000_000, limit);
    let line = put_raw(addr, "over", &over).await;
    assert!(line.starts_with("HTTP/1.1 413 "), "{line}");
    let after_one = peak_rss(pid);
    eprintln!("peak RSS: {} MiB at start, {} MiB after one refused body", base / MIB, after_one / MIB);
    assert!(after_one - base <= 64 * MIB, "one refused body: peak {} MiB -> {} MiB", base / MIB, after_one / MIB);

    // 16 at once, half of them the largest value accepted in the costliest shapes.
    let bodies = [
        hostile_body("1", 500_000, limit),
        hostile_body("{\"a\":1}", 131_000, limit),
        hostile_body("{}", 349_000, limit),
        over,
    ];
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let body = bodies[i % bodies.len()].clone();
            tokio::spawn(async move { (i, put_raw(addr, &format!("k{i}"), &body).await) })
        })
        .collect();
    for task in tasks {
        let (i, line) = task.await.expect("task");
        let expected = if i % bodies.len() == 3 { "HTTP/1.1 413 " } else { "HTTP/1.1 200 " };
        assert!(line.starts_with(expected), "body {i}: {line}");
    }
    let after_many = peak_rss(pid);
    eprintln!("peak RSS: {} MiB after 16 concurrent bodies", after_many / MIB);
    assert!(
        after_many - base <= 400 * MIB,
        "16 concurrent bodies: peak {} MiB -> {} MiB",
        base / MIB,
        after_many / MIB
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_in_flight_requests_then_exits_cleanly() {
    use std::process::Command;

    let dir = tempfile::tempdir().expect("temp dir");
    // No drain delay: the listener closes at the signal.
    let (mut child, addr, mut lines, log) = spawn_serve(&dir, &[], &[("AGENTSTORE_SHUTDOWN_DRAIN_SECS", "0")]).await;
    assert!(addr.ip().is_loopback() && addr.port() != 0, "{addr}");

    // A PUT of ~1 MiB, held in flight: the server has read the head and its handler is waiting for
    // the body (the `100 Continue` comes when the handler first reads the body).
    let value = "v".repeat(1_000_000);
    let body = serde_json::to_vec(&json!({ "value": value })).unwrap();
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "PUT /v1/users/u/namespaces/ns/keys/big HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nExpect: 100-continue\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.expect("send head");
    let interim = tokio::time::timeout(Duration::from_secs(10), read_head(&mut stream)).await.expect("100 Continue");
    assert!(interim.starts_with("HTTP/1.1 100 "), "{interim}");

    let pid = child.0.id().to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status().expect("run kill");
    assert!(killed.success());

    // The server stops accepting: new connections are refused while the PUT is still open.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match tokio::net::TcpStream::connect(addr).await {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => break,
            // Accepted into the backlog (or reset as the listener closed): poll again.
            Ok(_) | Err(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(20)).await,
            Ok(_) => panic!("still accepting connections 10 s after SIGTERM"),
            Err(e) => panic!("unexpected connect error 10 s after SIGTERM: {e}"),
        }
    }
    assert_eq!(child.0.try_wait().expect("try_wait"), None, "exited with a request in flight");

    // The in-flight request completes.
    stream.write_all(&body).await.expect("send body");
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut response))
        .await
        .expect("response within 20 s")
        .expect("read response");
    let split = response.windows(4).position(|w| w == b"\r\n\r\n").expect("a response head");
    let status_line = String::from_utf8_lossy(&response[..split]).lines().next().unwrap_or_default().to_owned();
    assert!(status_line.starts_with("HTTP/1.1 200 "), "{status_line}");
    let doc: Value = serde_json::from_slice(&response[split + 4..]).expect("a JSON document");
    assert_eq!(doc["key"], json!("big"));
    assert_eq!(doc["value"].as_str().map(str::len), Some(1_000_000));

    // Then the process exits with status 0.
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(status) = child.0.try_wait().expect("try_wait") {
            break status;
        }
        assert!(Instant::now() < deadline, "still running 15 s after SIGTERM");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut rest = Vec::new();
    while let Ok(line) = lines.try_recv() {
        rest.push(line);
    }
    assert_eq!(status.code(), Some(0), "exit status {status}; stderr: {log:#?} {rest:#?}");
    let err = tokio::net::TcpStream::connect(addr).await.expect_err("nothing listens after exit");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused);
}

/// Lines of a streamed answer (a continuous `_changes` feed), heartbeats' empty lines skipped.
struct Lines {
    body: std::pin::Pin<Box<dyn futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>,
    buffer: Vec<u8>,
}

impl Lines {
    fn new(response: reqwest::Response) -> Self {
        Lines { body: Box::pin(response.bytes_stream()), buffer: Vec::new() }
    }

    /// The next non-empty line, `None` at the end of the answer; panics past `within`.
    async fn next(&mut self, within: Duration) -> Option<String> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(end) = self.buffer.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buffer.drain(..=end).collect();
                let line = String::from_utf8_lossy(&line).trim().to_owned();
                if line.is_empty() {
                    continue;
                }
                return Some(line);
            }
            match tokio::time::timeout_at(deadline, self.body.next()).await {
                Err(_) => panic!("no line within {within:?}; buffered {:?}", String::from_utf8_lossy(&self.buffer)),
                Ok(None) => return None,
                Ok(Some(chunk)) => self.buffer.extend_from_slice(&chunk.expect("read the feed")),
            }
        }
    }
}

/// Issue 36, rolling restarts behind a balancer: at SIGTERM `/readyz` turns 503 (and the CouchDB
/// API's `/_up` 404 `nolb`, CouchDB's answer in `maintenance_mode = nolb`) at once, while for
/// `shutdown_drain_secs` new connections are still accepted and their requests served (with
/// `Connection: close`) and a continuous `_changes` feed keeps delivering; when the drain ends
/// the feed closes with its `last_seq` line (where a client resumes on another instance) and the
/// process exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_not_ready_while_serving_then_ends_feeds_with_last_seq() {
    const DRAIN: Duration = Duration::from_secs(3);
    let dir = tempfile::tempdir().expect("temp dir");
    let (mut child, addr, mut lines, log) =
        spawn_serve(&dir, &["--couchdb-listen", "127.0.0.1:0"], &[("AGENTSTORE_SHUTDOWN_DRAIN_SECS", "3")]).await;
    let couch = couchdb_address(&mut lines, &log).await;
    let client = reqwest::Client::new();
    let rest = |path: &str| format!("http://{addr}{path}");
    let put = |key: &str| client.put(rest(&doc_path("u", "ns", key))).json(&json!({ "value": key })).send();
    assert_eq!(client.get(rest("/readyz")).send().await.expect("readyz").status(), StatusCode::OK);
    assert_eq!(put("before").await.expect("put").status(), StatusCode::OK);

    // A continuous feed, open and caught up, when the signal comes.
    let feed = client
        .get(format!("http://{couch}/agent_data_store/_changes?feed=continuous&since=0"))
        .send()
        .await
        .expect("open the feed");
    assert_eq!(feed.status(), StatusCode::OK);
    let mut feed = Lines::new(feed);
    let first = feed.next(Duration::from_secs(10)).await.expect("the first change");
    assert!(first.contains("\"id\""), "{first}");

    let signalled = Instant::now();
    let pid = child.0.id().to_string();
    let killed = std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("run kill");
    assert!(killed.success());
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Not ready at once, on both faces, each asked on a new connection.
    let ready = client.get(rest("/readyz")).send().await.expect("readyz during the drain");
    assert_eq!(ready.status(), StatusCode::SERVICE_UNAVAILABLE);
    let up = client.get(format!("http://{couch}/_up")).send().await.expect("_up during the drain");
    assert_eq!(up.status(), StatusCode::NOT_FOUND);
    assert_eq!(up.json::<Value>().await.expect("_up JSON"), json!({ "status": "nolb" }));
    // A request the balancer still routes here is served, and asks the client to reconnect.
    let during = put("during").await.expect("a write during the drain");
    assert_eq!(during.status(), StatusCode::OK);
    assert_eq!(during.headers().get("connection").map(|v| v.as_bytes()), Some(&b"close"[..]));
    // The feed is still live: it delivers that write.
    let delivered = feed.next(Duration::from_secs(5)).await.expect("the change made during the drain");
    assert!(delivered.contains("\"id\"") && !delivered.contains("last_seq"), "{delivered}");
    assert!(signalled.elapsed() < DRAIN, "the checks above took the whole drain ({:?})", signalled.elapsed());

    // When the drain ends, the feed closes with its last_seq, then the answer ends.
    let last = feed.next(DRAIN + Duration::from_secs(10)).await.expect("a closing line");
    assert!(signalled.elapsed() >= DRAIN, "the feed ended {:?} after SIGTERM, inside the drain", signalled.elapsed());
    let last: Value = serde_json::from_str(&last).expect("the closing line is JSON");
    assert!(last["last_seq"].is_string(), "closing line {last}");
    assert_eq!(feed.next(Duration::from_secs(10)).await, None, "more after the closing line");

    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(status) = child.0.try_wait().expect("try_wait") {
            break status;
        }
        assert!(Instant::now() < deadline, "still running 15 s after the drain");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(status.code(), Some(0), "exit status {status}");
}

/// The CouchDB API's address, from the line `serve` prints after the REST API's.
async fn couchdb_address(lines: &mut tokio::sync::mpsc::UnboundedReceiver<String>, log: &[String]) -> SocketAddr {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let line = tokio::time::timeout_at(deadline, lines.recv())
            .await
            .unwrap_or_else(|_| panic!("no CouchDB 'serving' line within 20 s: {log:#?}"))
            .unwrap_or_else(|| panic!("stderr closed before the CouchDB 'serving' line: {log:#?}"));
        if let Some(rest) = line.strip_prefix("agentstore: serving the CouchDB API on http://") {
            let addr = rest.split('/').next().unwrap_or_default();
            return addr.parse().unwrap_or_else(|e| panic!("address in {line:?}: {e}"));
        }
    }
}

/// A continuous feed still sending a long backlog when the drain ends stops after the page it is
/// sending, with `last_seq` and a `pending` count, rather than streaming on until its end (with
/// writes from other instances coming in, it might never reach it and be cut without `last_seq`
/// at the end of the grace period). The client reads nothing until after the drain, on a small
/// receive buffer, so the server is held mid-backlog when it stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_a_busy_continuous_feed_after_its_page() {
    // 10 MB of rows with their documents: more than the socket buffers between the two hold.
    const DOCS: usize = 5000;
    let padding = "p".repeat(2000);
    let dir = tempfile::tempdir().expect("temp dir");
    let (mut child, _addr, mut lines, log) =
        spawn_serve(&dir, &["--couchdb-listen", "127.0.0.1:0"], &[("AGENTSTORE_SHUTDOWN_DRAIN_SECS", "1")]).await;
    let couch = couchdb_address(&mut lines, &log).await;
    let client = reqwest::Client::new();
    let created = client.put(format!("http://{couch}/busyfeed")).send().await.expect("create the database");
    assert_eq!(created.status(), StatusCode::CREATED);
    let docs: Vec<Value> =
        (0..DOCS).map(|i| json!({ "_id": format!("doc-{i:05}"), "n": i, "padding": padding })).collect();
    let bulk = client
        .post(format!("http://{couch}/busyfeed/_bulk_docs"))
        .json(&json!({ "docs": docs }))
        .send()
        .await
        .expect("_bulk_docs");
    assert_eq!(bulk.status(), StatusCode::CREATED);

    let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
    socket.set_recv_buffer_size(4096).expect("a small receive buffer");
    let mut stream = socket.connect(couch).await.expect("connect");
    let head =
        format!("GET /busyfeed/_changes?feed=continuous&include_docs=true&since=0 HTTP/1.1\r\nHost: {couch}\r\n\r\n");
    stream.write_all(head.as_bytes()).await.expect("send the request");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pid = child.0.id().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("run kill").success());
    // Past the drain: the server stops while the feed waits on this reader.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut response))
        .await
        .expect("the feed ends within 20 s")
        .expect("read the feed");
    let text = String::from_utf8_lossy(&response);
    let split = text.find("\r\n\r\n").expect("a response head");
    assert!(text.starts_with("HTTP/1.1 200 "), "{}", &text[..split]);
    let body = dechunk(&response[split + 4..]);
    let rows: Vec<Value> =
        body.lines().filter(|l| !l.trim().is_empty()).map(|l| serde_json::from_str(l).expect("a JSON line")).collect();
    let last = rows.last().expect("a closing line");
    assert!(last["last_seq"].is_string(), "closing line {last}");
    let sent = rows.len() - 1;
    assert!(sent < DOCS, "the feed sent its whole backlog ({sent} rows) after the stop");
    assert_eq!(last["pending"].as_u64(), Some((DOCS - sent) as u64), "closing line {last} after {sent} rows");
    let status = child.0.wait().expect("wait for the exit");
    assert_eq!(status.code(), Some(0), "exit status {status}");
}

/// The body of a chunked answer (the chunks' sizes and framing removed).
fn dechunk(mut bytes: &[u8]) -> String {
    let mut body = Vec::new();
    while let Some(end) = bytes.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(String::from_utf8_lossy(&bytes[..end]).trim(), 16).expect("a chunk size");
        if size == 0 {
            break;
        }
        body.extend_from_slice(&bytes[end + 2..end + 2 + size]);
        bytes = &bytes[end + 2 + size + 2..];
    }
    String::from_utf8(body).expect("a UTF-8 body")
}

/// An upload still arriving when the shutdown grace period ends is answered 503 naming
/// `shutdown_grace_secs` (send it again, to another instance), not dropped unanswered, and the
/// process then exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_still_arriving_when_the_grace_period_ends_is_answered_503() {
    const TOTAL: usize = 2 << 20;
    const PIECE: usize = 32 << 10;
    let dir = tempfile::tempdir().expect("temp dir");
    let settings = [("AGENTSTORE_SHUTDOWN_DRAIN_SECS", "0"), ("AGENTSTORE_SHUTDOWN_GRACE_SECS", "1")];
    let (mut child, addr, _lines, _log) = spawn_serve(&dir, &[], &settings).await;
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut reader, mut writer) = stream.into_split();
    let head = format!(
        "PUT {} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {TOTAL}\r\n\r\n",
        doc_path("u", "ns", "upload")
    );
    writer.write_all(head.as_bytes()).await.expect("send the head");
    // 320 KiB/s, well above body_min_bytes_per_sec: 6.4 s for the whole body.
    let sending = tokio::spawn(async move {
        let piece = vec![b' '; PIECE];
        for _ in 0..TOTAL / PIECE {
            if writer.write_all(&piece).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pid = child.0.id().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("run kill").success());

    let mut response = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), reader.read_to_end(&mut response)).await;
    sending.abort();
    let text = String::from_utf8_lossy(&response);
    assert!(text.starts_with("HTTP/1.1 503 "), "answer: {text:?}");
    assert!(text.contains("shutdown_grace_secs"), "answer: {text:?}");
    let status = child.0.wait().expect("wait for the exit");
    assert_eq!(status.code(), Some(0), "exit status {status}");
}
