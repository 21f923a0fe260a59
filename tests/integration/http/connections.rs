//! Connection handling: slow headers and idle keep-alive connections cut off, connections beyond
//! the cap waiting for a slot, and bodies refused early still answered.

use super::*;

/// Whether the server closed the connection within `within` (EOF or reset), reading and
/// discarding anything it sends first.
async fn closed_within(stream: &mut tokio::net::TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_are_cut_off_after_the_header_timeout() {
    let server = Server::start_with(|s| {
        s.header_read_timeout_secs = 1;
        s.idle_timeout_secs = 60;
    })
    .await;
    let mut stream = tokio::net::TcpStream::connect(addr_of(&server)).await.expect("connect");
    let started = Instant::now();
    // One header byte every 200 ms: the connection is never idle, but the head never completes.
    let trickle = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    for byte in trickle {
        if stream.write_all(&[*byte]).await.is_err() {
            break;
        }
        let mut probe = [0u8; 1];
        match tokio::time::timeout(Duration::from_millis(200), stream.read(&mut probe)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            _ => {}
        }
    }
    let elapsed = started.elapsed();
    assert!(elapsed < Duration::from_secs(4), "the trickling client kept its connection for {elapsed:?}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keep_alive_connections_are_closed_after_the_idle_timeout() {
    let server = Server::start_with(|s| {
        s.header_read_timeout_secs = 60;
        s.idle_timeout_secs = 1;
    })
    .await;
    let mut stream = tokio::net::TcpStream::connect(addr_of(&server)).await.expect("connect");
    stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await.expect("send");
    let head = read_head(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
    let started = Instant::now();
    assert!(
        closed_within(&mut stream, Duration::from_secs(5)).await,
        "idle keep-alive connection still open after 5 s"
    );
    assert!(started.elapsed() >= Duration::from_millis(900), "closed too early: {:?}", started.elapsed());
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_wait_for_a_free_slot() {
    let server = Server::start_with(|s| s.max_connections = 2).await;
    let addr = addr_of(&server);
    let first = tokio::net::TcpStream::connect(addr).await.expect("connect 1");
    let _second = tokio::net::TcpStream::connect(addr).await.expect("connect 2");
    // The third connects (the kernel's backlog) but is not served while two are open.
    let mut third = tokio::net::TcpStream::connect(addr).await.expect("connect 3");
    third.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await.expect("send");
    let mut byte = [0u8; 1];
    let early = tokio::time::timeout(Duration::from_millis(800), third.read(&mut byte)).await;
    assert!(early.is_err(), "served beyond the connection cap: {early:?}");
    drop(first);
    let head =
        tokio::time::timeout(Duration::from_secs(5), read_head(&mut third)).await.expect("served once a slot was free");
    assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
    server.stop().await;
}

/// Sends `head` and a `size`-byte JSON body in full (as simple clients do, without waiting for an
/// early answer), then reads the status line. A reset or broken pipe is a failure.
async fn send_whole(addr: SocketAddr, head: &str, size: usize) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let body = format!("{{\"value\": \"{}\"}}", "b".repeat(size.saturating_sub(13)));
    let request = format!("{head}Host: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n", body.len());
    let mut bytes = request.into_bytes();
    bytes.extend_from_slice(body.as_bytes());
    stream.write_all(&bytes).await.unwrap_or_else(|e| panic!("sending the body: {e}"));
    let mut response = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut response)).await;
    match read {
        Ok(Ok(_)) => {}
        Ok(Err(e)) if !response.is_empty() => panic!("read after {} bytes: {e}", response.len()),
        Ok(Err(e)) => panic!("reading the answer: {e}"),
        Err(_) if !response.is_empty() => {}
        Err(_) => panic!("no answer within 20 s"),
    }
    String::from_utf8_lossy(&response).lines().next().unwrap_or_default().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_refused_early_still_get_their_answer() {
    let server = Server::start_with(|s| {
        s.tokens = token_settings();
        s.max_body_bytes = Some(200_000);
    })
    .await;
    let addr = addr_of(&server);
    let put = |user: &str, token: Option<&str>| {
        let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
        format!("PUT {} HTTP/1.1\r\nConnection: close\r\n{auth}", doc_path(user, "ns", "k"))
    };
    let cases = [
        ("401", put("alice", None), 1_000_000),
        ("403", put("alice", Some(BOB)), 1_000_000),
        ("413", put("alice", Some(ALICE)), 1_000_000),
        // A route that never reads a body.
        (
            "404",
            format!("DELETE {} HTTP/1.1\r\nAuthorization: Bearer {ALICE}\r\n", doc_path("alice", "ns", "k")),
            1_000_000,
        ),
    ];
    for (status, head, size) in cases {
        for attempt in 0..20 {
            let line = send_whole(addr, &head, size).await;
            assert!(line.starts_with(&format!("HTTP/1.1 {status} ")), "attempt {attempt} for {status}: {line:?}");
        }
    }
    server.stop().await;
}
