//! Attachments streamed through, on every backend and through the CouchDB backend's forwarding
//! (issue 25): byte ranges (206 with the right bytes, 416, `If-Range`), an 80 MiB attachment
//! round trip through the CouchDB backend compared by SHA-256 (past the 64 MiB a body used to be
//! read whole within), the attachment bound on forwarded uploads (413, declared or streamed),
//! and uploads whose client disconnects mid-body, standalone and `multipart/related`, leaving
//! nothing a reader can see and (where this server keeps the bytes) no chunk behind.
//!
//! On the CouchDB backend every request on a database is forwarded, to pouchdb-server here: it
//! ignores `Range` and answers the whole bytes, which the forwarding cuts to the range as CouchDB
//! would answer it itself (a real CouchDB answers 206 itself, and that is passed on as it came).

use futures::StreamExt;
use sha2::Digest as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

/// Attachments of at most 1 MiB: the 413 of a forwarded upload past it is checked.
pub(super) const BOUNDED_CONFIG: &str = "couchdb_max_attachment_bytes = 1048576\n";

fn forwarded(e: &Endpoint) -> bool {
    e.backend == "couchdb"
}

/// A fresh CouchDB backend like the harness's, whose requests may wait 10 minutes for CouchDB
/// (`timeout_secs=600`; the databases of its catalog inherit it): pouchdb-server, the CouchDB
/// here, stores a large attachment long after it has received it, and trials share it, so its
/// answer to a write can come later than the default 30 s while it works on another trial's
/// tens of megabytes.
fn patient_couchdb() -> harness::BoxFuture<Result<harness::Ctx, String>> {
    Box::pin(async {
        let couchdb = harness::all().into_iter().find(|backend| backend.name == "couchdb");
        let mut ctx = (couchdb.ok_or("no couchdb harness")?.fresh)().await?;
        let url = format!("{}&timeout_secs=600", ctx.backend_url);
        let config = agentstore::backend::couchdb::CouchConfig::parse(&url).map_err(|e| e.to_string())?;
        let backend = agentstore::backend::couchdb::CouchDbBackend::open(&config).await.map_err(|e| e.to_string())?;
        ctx.backend = Arc::new(backend);
        ctx.url = Some(url.clone());
        ctx.backend_url = url;
        Ok(ctx)
    })
}

/// `e`, or on the CouchDB backend an endpoint over [`patient_couchdb`] in its place.
async fn patient(e: Endpoint) -> Result<Endpoint, Failed> {
    if !forwarded(&e) {
        return Ok(e);
    }
    drop(e);
    Endpoint::start(patient_couchdb, "couchdb", None).await
}

async fn fresh_db(e: &Endpoint, tag: &str) -> Result<String, Failed> {
    fresh_db_named(e, "fwd", tag).await
}

/// Deterministic bytes that do not repeat chunk by chunk (xorshift, seeded).
fn pseudo_random(seed: u64, length: usize) -> Vec<u8> {
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15 ^ seed;
    let mut bytes = Vec::with_capacity(length + 8);
    while bytes.len() < length {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        bytes.extend_from_slice(&state.to_le_bytes());
    }
    bytes.truncate(length);
    bytes
}

/// An answer with raw bytes.
struct Raw {
    status: StatusCode,
    headers: reqwest::header::HeaderMap,
    body: Vec<u8>,
}

impl Raw {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

async fn raw(
    e: &Endpoint,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: reqwest::Body,
) -> Result<Raw, Failed> {
    let mut request = e.client.request(method, e.url(path)).body(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await?;
    let (status, headers) = (response.status(), response.headers().clone());
    let body = response.bytes().await?.to_vec();
    Ok(Raw { status, headers, body })
}

/// `Range` on a stored attachment: 206 with the bytes asked, `Content-Range` and
/// `Content-Length` of the part; a suffix range; an open-ended one; 416 past the end; a range of
/// several parts answered whole here (Apache CouchDB 3.4.3 answers it `multipart/byteranges`,
/// which the CouchDB backend passes on: [`several_parts_sent`]). Through the forwarding, `If-Range` too:
/// the `ETag` of the attachment gets the part, another validator the whole bytes.
pub(super) async fn forwarded_ranges(e: Endpoint) -> TestResult {
    let db = fresh_db(&e, "range").await?;
    let bytes = pseudo_random(1, 100_000);
    let path = format!("/{db}/doc/data.bin");
    let put =
        raw(&e, Method::PUT, &path, &[("content-type", "application/octet-stream")], bytes.clone().into()).await?;
    check(put.status == StatusCode::CREATED, || format!("PUT: {} {}", put.status, String::from_utf8_lossy(&put.body)))?;
    let cases: [(&str, usize, usize); 4] = [
        ("bytes=1000-1999", 1000, 2000),
        ("bytes=-100", 99_900, 100_000),
        ("bytes=99990-", 99_990, 100_000),
        ("bytes=0-0", 0, 1),
    ];
    for (range, start, end) in cases {
        let part = raw(&e, Method::GET, &path, &[("range", range)], reqwest::Body::from(Vec::new())).await?;
        check(part.status == StatusCode::PARTIAL_CONTENT, || format!("{range}: status {}", part.status))?;
        let shown = format!("bytes {start}-{}/100000", end - 1);
        check(part.header("content-range") == Some(shown.as_str()), || {
            format!("{range}: Content-Range {:?}, wanted {shown}", part.header("content-range"))
        })?;
        check(part.body == bytes[start..end], || {
            format!("{range}: {} bytes, not bytes {start}..{end}", part.body.len())
        })?;
        let length = (end - start).to_string();
        check(part.header("content-length") == Some(length.as_str()), || {
            format!("{range}: Content-Length {:?}", part.header("content-length"))
        })?;
    }
    let head = raw(&e, Method::HEAD, &path, &[], Vec::new().into()).await?;
    check(head.status == StatusCode::OK && head.header("content-length") == Some("100000"), || {
        format!("HEAD: status {}, Content-Length {:?}", head.status, head.header("content-length"))
    })?;
    let past = raw(&e, Method::GET, &path, &[("range", "bytes=100000-")], Vec::new().into()).await?;
    check(past.status == StatusCode::RANGE_NOT_SATISFIABLE, || format!("past the end: status {}", past.status))?;
    let several = raw(&e, Method::GET, &path, &[("range", "bytes=0-1,5-6")], Vec::new().into()).await?;
    check(
        several.status == StatusCode::OK && several.body == bytes || several_parts_sent(&e, &several, &bytes),
        || format!("several ranges: status {}, {} bytes", several.status, several.body.len()),
    )?;
    if forwarded(&e) {
        // The forwarding's own cut honours If-Range; the local attachment path is another's.
        let whole = raw(&e, Method::GET, &path, &[], Vec::new().into()).await?;
        let etag = whole.header("etag").ok_or("no ETag on the attachment")?.to_owned();
        let matching =
            raw(&e, Method::GET, &path, &[("range", "bytes=10-19"), ("if-range", &etag)], Vec::new().into()).await?;
        check(matching.status == StatusCode::PARTIAL_CONTENT && matching.body == bytes[10..20], || {
            format!("If-Range {etag}: status {}, {} bytes", matching.status, matching.body.len())
        })?;
        let other =
            raw(&e, Method::GET, &path, &[("range", "bytes=10-19"), ("if-range", "\"other\"")], Vec::new().into())
                .await?;
        // Apache CouchDB 3.4.3 cuts a range itself and does not read `If-Range` (206 with the
        // part whatever the validator, checked with curl): its answer is passed on as it is.
        let whole_wanted = on_pouchdb_server(&e);
        let answered = if whole_wanted {
            other.status == StatusCode::OK && other.body == bytes
        } else {
            other.status == StatusCode::PARTIAL_CONTENT && other.body == bytes[10..20]
        };
        check(answered, || {
            format!("If-Range of another version: status {}, {} bytes", other.status, other.body.len())
        })?;
    }
    Ok(())
}

/// Whether `answer` to `Range: bytes=0-1,5-6` is Apache CouchDB 3.4.3's, passed on by the
/// CouchDB backend: 206 `multipart/byteranges`, one part per range with its `Content-Range`
/// (`chttpd_db`'s `send_ranges_multipart`, fewer than 10 ranges; checked with curl).
/// pouchdb-server answers the whole bytes, as the other backends do.
fn several_parts_sent(e: &Endpoint, answer: &Raw, bytes: &[u8]) -> bool {
    let multipart = answer.header("content-type").is_some_and(|t| t.starts_with("multipart/byteranges"));
    let body = &answer.body;
    let holds = |needle: &[u8]| body.windows(needle.len()).any(|window| window == needle);
    let part = |start: usize, end: usize| {
        let mut text = format!("Content-Range: bytes {start}-{end}/{}\r\n\r\n", bytes.len()).into_bytes();
        text.extend_from_slice(&bytes[start..=end]);
        holds(&text)
    };
    forwarded(e) && answer.status == StatusCode::PARTIAL_CONTENT && multipart && part(0, 1) && part(5, 6)
}

/// 80 MiB through the CouchDB backend and back, streamed both ways: the bytes read back have the
/// SHA-256 of the bytes sent. The forwarding used to read a body whole within 64 MiB (413).
pub(super) async fn forwarded_80_mib_round_trip(e: Endpoint) -> TestResult {
    if !forwarded(&e) {
        // The other backends' large round trip is `attachments_64_mib_round_trip`.
        return Ok(());
    }
    const LENGTH: usize = 80 << 20;
    let e = patient(e).await?;
    let db = fresh_db(&e, "big").await?;
    let bytes = pseudo_random(2, LENGTH);
    let sent = hex::encode(sha2::Sha256::digest(&bytes));
    let path = format!("/{db}/big/data.bin");
    let put = raw(&e, Method::PUT, &path, &[("content-type", "application/octet-stream")], bytes.into()).await?;
    check(put.status == StatusCode::CREATED, || {
        format!("PUT 80 MiB: {} {}", put.status, String::from_utf8_lossy(&put.body))
    })?;
    let response = e.client.get(e.url(&path)).send().await?;
    check(response.status() == StatusCode::OK, || format!("GET 80 MiB: {}", response.status()))?;
    let mut hasher = sha2::Sha256::new();
    let mut length = 0usize;
    let mut body = response.bytes_stream();
    while let Some(chunk) = body.next().await {
        let chunk = chunk?;
        length += chunk.len();
        hasher.update(&chunk);
    }
    let received = hex::encode(hasher.finalize());
    check(length == LENGTH && received == sent, || {
        format!("80 MiB round trip: {length} bytes, sha256 {received} vs {sent}")
    })?;
    let doc = e.get(&format!("/{db}/big")).await?.expect(200, "GET big")?;
    check(doc.body["_attachments"]["data.bin"]["length"] == LENGTH, || format!("80 MiB stub: {}", doc.body))?;
    Ok(())
}

/// With `couchdb_max_attachment_bytes` at 1 MiB, a forwarded upload one byte past it is 413
/// naming the setting, whether its `Content-Length` says so (refused before it is passed on) or
/// it comes chunked (cut mid-body); nothing is stored; exactly 1 MiB is stored.
pub(super) async fn forwarded_attachment_bound(e: Endpoint) -> TestResult {
    if !forwarded(&e) {
        // The bound where the bytes are kept here: `attachments_in_documents`.
        return Ok(());
    }
    let db = fresh_db(&e, "bound").await?;
    let over = pseudo_random(3, (1 << 20) + 1);
    let declared = raw(&e, Method::PUT, &format!("/{db}/declared/a.bin"), &[], over.clone().into()).await?;
    let chunked = chunked_put(&e, &format!("/{db}/chunked/a.bin"), &over).await?;
    for (what, answer) in [("declared", &declared), ("chunked", &chunked)] {
        check(answer.status == StatusCode::PAYLOAD_TOO_LARGE, || format!("{what}: status {}", answer.status))?;
        let body: Value = serde_json::from_slice(&answer.body).unwrap_or_default();
        check(body["reason"].as_str().is_some_and(|reason| reason.contains("couchdb_max_attachment_bytes")), || {
            format!("{what}: {body}")
        })?;
        nothing_shows(&e, &format!("/{db}/{what}"), None, &format!("{what}: nothing stored")).await?;
    }
    let at_bound = raw(&e, Method::PUT, &format!("/{db}/exact/a.bin"), &[], over[..1 << 20].to_vec().into()).await?;
    check(at_bound.status == StatusCode::CREATED, || format!("exactly 1 MiB: status {}", at_bound.status))?;
    Ok(())
}

/// `PUT` of `body` sent chunked over a connection of its own (a client may go on sending after
/// an early answer: this one sends everything, then reads the answer).
async fn chunked_put(e: &Endpoint, path: &str, body: &[u8]) -> Result<Raw, Failed> {
    let address = e.root.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    let head = format!(
        "PUT {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/octet-stream\r\n\
         Transfer-Encoding: chunked\r\n\r\n"
    );
    let mut request = head.into_bytes();
    for piece in body.chunks(64 << 10) {
        request.extend(format!("{:x}\r\n", piece.len()).bytes());
        request.extend_from_slice(piece);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"0\r\n\r\n");
    // Written while the answer is read: the server may answer before it has read everything.
    let (mut reader, mut writer) = stream.split();
    let (written, answer) = tokio::join!(writer.write_all(&request), async {
        let mut answer = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(30), reader.read_to_end(&mut answer)).await;
        read.map(|_| answer)
    });
    let answer = answer.map_err(|_| "no answer to the chunked PUT within 30 s")?;
    let text = String::from_utf8_lossy(&answer).into_owned();
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return Err(format!("chunked PUT: no answer ({written:?}): {text:?}").into());
    };
    let status = head.get(9..12).and_then(|code| code.parse::<u16>().ok()).unwrap_or(0);
    let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
    let body = if chunked { dechunked(body) } else { body.to_owned() };
    Ok(Raw {
        status: StatusCode::from_u16(status).map_err(|err| err.to_string())?,
        headers: reqwest::header::HeaderMap::new(),
        body: body.into_bytes(),
    })
}

/// The body of a chunked answer.
fn dechunked(mut rest: &str) -> String {
    let mut body = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else { break };
        if size == 0 || after.len() < size {
            break;
        }
        body.push_str(&after[..size]);
        rest = after[size..].trim_start_matches("\r\n");
    }
    body
}

/// Nothing of an interrupted upload shows in the document as it reads now (`kept`: the
/// revision it had before, `None` when there was none). pouchdb-server, the CouchDB backend here,
/// stores an *empty* attachment for an upload whose connection breaks (express-pouchdb's
/// `putAttachment` ignores the error of reading the body and stores what it read: nothing);
/// CouchDB stores nothing. So there an empty attachment is allowed, never any byte of the upload.
async fn nothing_shows(e: &Endpoint, path: &str, kept: Option<&str>, what: &str) -> TestResult {
    let now = e.get(path).await?;
    let unchanged = match kept {
        None => now.status == StatusCode::NOT_FOUND,
        Some(rev) => now.status == StatusCode::OK && now.body["_rev"] == json!(rev),
    };
    let empty_on_pouchdb_server = forwarded(e)
        && now.status == StatusCode::OK
        && now.body["_attachments"]["a.bin"]["length"] == json!(0)
        && now.body["_attachments"].as_object().is_some_and(|atts| atts.len() == 1);
    check(unchanged || empty_on_pouchdb_server, || format!("{what}: {} {}", now.status, now.body))
}

/// The attachment blobs a database keeps here (none on the CouchDB backend, which keeps its own).
async fn blob_count(e: &Endpoint, db: &str) -> Result<usize, Failed> {
    let name = agentstore::backend::catalog::DbName::parse(db).map_err(|err| err.to_string())?;
    let database = e.databases.open(&name).await?.ok_or("the database is not open")?;
    if database.backend().attachment_chunk_bytes() == 0 {
        return Ok(0);
    }
    let mut count = 0;
    let mut token: Option<String> = None;
    loop {
        let page = database.backend().attachment_blobs(100, token.as_deref()).await?;
        count += page.items.len();
        token = page.next;
        if token.is_none() {
            return Ok(count);
        }
    }
}

/// The chunk size of a database's attachment store (0 on the CouchDB backend).
async fn chunk_bytes(e: &Endpoint, db: &str) -> Result<usize, Failed> {
    let name = agentstore::backend::catalog::DbName::parse(db).map_err(|err| err.to_string())?;
    let database = e.databases.open(&name).await?.ok_or("the database is not open")?;
    Ok(database.backend().attachment_chunk_bytes())
}

/// Sends `head` and `first` bytes of a body of `declared` bytes, waits until the server has
/// stored some of them (a chunk, where they are kept here), then goes away.
async fn upload_then_vanish(e: &Endpoint, db: &str, head: &str, first: &[u8]) -> TestResult {
    let address = e.root.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(first).await?;
    stream.flush().await?;
    if chunk_bytes(e, db).await? > 0 {
        let mut waited = 0;
        while blob_count(e, db).await? == 0 {
            if waited >= 300 {
                let mut answered = vec![0u8; 4096];
                let read = tokio::time::timeout(Duration::from_secs(1), stream.read(&mut answered)).await;
                let n = read.ok().and_then(Result::ok).unwrap_or(0);
                return Err(format!(
                    "the upload never stored a chunk; the server sent {:?}",
                    String::from_utf8_lossy(&answered[..n])
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            waited += 1;
        }
    } else {
        // Forwarded: time for the bytes to reach the backend.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    drop(stream);
    Ok(())
}

/// After a client went away: no chunk left behind (within 30 s: an upload dropped mid-way
/// deletes its chunks from a task of its own).
async fn no_chunk_left(e: &Endpoint, db: &str, what: &str) -> TestResult {
    for _ in 0..300 {
        if blob_count(e, db).await? == 0 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!("{what}: chunks of the interrupted upload are still stored").into())
}

/// A client that disconnects mid-upload, on every backend: a standalone `PUT` of a new
/// attachment, one of a new revision of an existing document, and a `multipart/related`
/// `PUT ?new_edits=false` as the replicator sends it. Afterwards no reader sees anything of
/// them (the document is missing or unchanged), and no chunk is left where the bytes are kept
/// here; the server goes on serving.
pub(super) async fn interrupted_uploads_leave_nothing(e: Endpoint) -> TestResult {
    let e = patient(e).await?;
    let db = fresh_db(&e, "cut").await?;
    let chunk = chunk_bytes(&e, &db).await?;
    // A chunk and a half sent of three declared, or 1.5 MiB of 3 MiB where nothing is chunked here.
    let sent = if chunk > 0 { chunk + chunk / 2 } else { 3 << 19 };
    let declared = 2 * sent;
    let first = pseudo_random(4, sent);

    let head = format!(
        "PUT /{db}/new/a.bin HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n\
         Content-Length: {declared}\r\n\r\n"
    );
    upload_then_vanish(&e, &db, &head, &first).await?;
    no_chunk_left(&e, &db, "standalone PUT").await?;
    nothing_shows(&e, &format!("/{db}/new"), None, "the document of an interrupted upload").await?;

    let kept = e.put(&format!("/{db}/kept"), json!({"n": 1})).await?.expect(201, "PUT kept")?.rev()?;
    let head = format!(
        "PUT /{db}/kept/a.bin?rev={kept} HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n\
         Content-Length: {declared}\r\n\r\n"
    );
    upload_then_vanish(&e, &db, &head, &first).await?;
    no_chunk_left(&e, &db, "standalone PUT on an existing document").await?;
    nothing_shows(&e, &format!("/{db}/kept"), Some(&kept), "a document an interrupted upload was to change").await?;

    if forwarded(&e) {
        // pouchdb-server, the CouchDB backend here, exits on a multipart upload whose connection
        // breaks (multiparty's "Request aborted" error has no handler there), which would take
        // the server every trial shares with it; CouchDB discards such an upload.
        let whole = raw(&e, Method::PUT, &format!("/{db}/after/a.bin"), &[], first.clone().into()).await?;
        check(whole.status == StatusCode::CREATED, || {
            format!("an upload after the interrupted ones: {}", whole.status)
        })?;
        return Ok(());
    }
    let id = "c".repeat(32);
    let json_part = json!({
        "_id": "mp", "_rev": format!("1-{id}"), "_revisions": {"start": 1, "ids": [id]},
        "_attachments": {"big.bin": {"content_type": "application/octet-stream", "length": declared, "follows": true}},
    })
    .to_string();
    let opening = format!(
        "--abc\r\nContent-Type: application/json\r\n\r\n{json_part}\r\n\
         --abc\r\nContent-Disposition: attachment; filename=\"big.bin\"\r\n\r\n"
    );
    let closing = "\r\n--abc--";
    let length = opening.len() + declared + closing.len();
    let head = format!(
        "PUT /{db}/mp?new_edits=false HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/related; boundary=\"abc\"\r\n\
         Content-Length: {length}\r\n\r\n{opening}"
    );
    upload_then_vanish(&e, &db, &head, &first).await?;
    no_chunk_left(&e, &db, "multipart/related PUT").await?;
    e.get(&format!("/{db}/mp")).await?.expect(404, "the document of an interrupted multipart upload")?;
    e.get(&format!("/{db}/mp?rev=1-{}", "c".repeat(32))).await?.expect(404, "its revision")?;

    // The server serves on, and an upload that ends is stored.
    let whole = raw(&e, Method::PUT, &format!("/{db}/after/a.bin"), &[], first.clone().into()).await?;
    check(whole.status == StatusCode::CREATED, || format!("an upload after the interrupted ones: {}", whole.status))?;
    Ok(())
}
