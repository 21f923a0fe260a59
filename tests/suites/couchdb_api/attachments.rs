//! Attachments on databases besides the data-store one (issue 25): inline in documents (stubs,
//! `attachments=true` byte for byte, `revpos` across updates, stubs carried, 412 `missing_stub`,
//! `atts_since`, `_bulk_docs`/`_bulk_get`/`_all_docs`/`open_revs`, replicated revisions),
//! standalone `GET/HEAD/PUT/DELETE /{db}/{doc}/{att}` (unicode and slash names, empty
//! attachments, ranges, `If-None-Match`), identical bytes stored once and freed by compaction,
//! a 64 MiB round trip compared by SHA-256, multipart uploads and answers (`multipart/mixed`
//! `open_revs`, `multipart/related` `attachments=true`, read back by `multer`), and gzip-encoded
//! attachment parts (decoded, digests checked, a gzip bomb stopped at the bound).
//!
//! Expected answers are CouchDB 3.x's as its documentation and source give them (`couch_att`'s
//! JSON of stubs and inline data, `chttpd_db`'s attachment handler); digests are MD5s computed
//! apart from the server (`printf hello | openssl md5 -binary | base64`). On the CouchDB backend
//! the databases are native and every request is forwarded (pouchdb-server here, whose answers
//! differ from CouchDB's in places): there, the round trips are checked, not the exact fields.

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use futures::StreamExt;
use sha2::Digest as _;

use super::*;

/// Attachments of at most 1 MiB: the 413 past it is checked.
pub(super) const BOUNDED_CONFIG: &str = "couchdb_max_attachment_bytes = 1048576\n";
/// Unreferenced bytes freed at the next collection (no grace period): compaction is checked.
pub(super) const FREE_AT_ONCE_CONFIG: &str = "couchdb_attachment_grace_secs = 0\n";

/// `printf hello | openssl md5 -binary | base64`.
const HELLO_DIGEST: &str = "md5-XUFAKrxLKna5cZ2REBfFkg==";
/// `printf '' | openssl md5 -binary | base64`.
const EMPTY_DIGEST: &str = "md5-1B2M2Y8AsgTpgAmY7PhCfg==";
/// The digest Apache CouchDB 3.4.3 gives an empty `text/plain` attachment: the MD5 of the gzip
/// stream it keeps the (compressible) attachment as.
const EMPTY_GZIPPED_DIGEST: &str = "md5-cCkGbCesb17xjWYNV0GXmg==";

fn kept_here(e: &Endpoint) -> bool {
    e.backend != "couchdb"
}

async fn fresh_db(e: &Endpoint, tag: &str) -> Result<String, Failed> {
    fresh_db_named(e, "att", tag).await
}

fn encode(path: &str) -> String {
    percent_encoding::utf8_percent_encode(path, percent_encoding::NON_ALPHANUMERIC).to_string()
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

async fn raw(e: &Endpoint, method: Method, path: &str, headers: &[(&str, &str)], body: Vec<u8>) -> Result<Raw, Failed> {
    let mut request = e.client.request(method, e.url(path)).body(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await?;
    let (status, headers) = (response.status(), response.headers().clone());
    let body = response.bytes().await?.to_vec();
    Ok(Raw { status, headers, body })
}

fn md5_base64(bytes: &[u8]) -> String {
    use md5::Digest as _;
    BASE64.encode(md5::Md5::digest(bytes))
}

/// The attachments of a document as a read shows them, without this server's fields.
fn no_internal_fields(body: &Value, what: &str) -> TestResult {
    check(!body.to_string().contains("agentstore_"), || format!("{what} shows a field of this server's: {body}"))
}

pub(super) async fn attachments_in_documents(e: Endpoint) -> TestResult {
    let db = fresh_db(&e, "docs").await?;
    let hello = BASE64.encode(b"hello");
    let first = e
        .put(
            &format!("/{db}/doc"),
            json!({"v": 1, "_attachments": {"hello.txt": {"content_type": "text/plain", "data": hello}}}),
        )
        .await?
        .expect(201, "PUT with an inline attachment")?;
    let rev1 = first.rev()?;
    let read = e.get(&format!("/{db}/doc")).await?.expect(200, "GET")?;
    if kept_here(&e) {
        // couch_att:to_json of a stub: content_type, revpos, digest, length, stub.
        let stub =
            json!({"content_type": "text/plain", "revpos": 1, "digest": HELLO_DIGEST, "length": 5, "stub": true});
        check(read.body["_attachments"]["hello.txt"] == stub, || format!("stub: {}", read.body))?;
        let order: Vec<&String> =
            read.body["_attachments"]["hello.txt"].as_object().map(|m| m.keys().collect()).unwrap_or_default();
        check(order == ["content_type", "revpos", "digest", "length", "stub"], || {
            format!("stub fields in CouchDB's order: {}", read.body)
        })?;
        no_internal_fields(&read.body, "GET")?;
    }
    let inline = e.get(&format!("/{db}/doc?attachments=true")).await?.expect(200, "GET attachments=true")?;
    check(inline.body["_attachments"]["hello.txt"]["data"] == hello, || format!("inline data: {}", inline.body))?;
    if kept_here(&e) {
        // Inline: content_type, revpos, digest, data; no length, no stub.
        let expected = json!({"content_type": "text/plain", "revpos": 1, "digest": HELLO_DIGEST, "data": hello});
        check(inline.body["_attachments"]["hello.txt"] == expected, || format!("inline: {}", inline.body))?;
    }

    // An update carrying the stub and adding an attachment: revpos 1 stays, the new one is 2.
    let bytes: Vec<u8> = vec![0, 1, 2, 255, 254, 10, 13];
    // CouchDB carries a bare `{"stub": true}` by name; pouchdb-server (behind the CouchDB
    // backend here) finds a stub by its digest, so there the stub is sent whole.
    let stub = if kept_here(&e) {
        json!({"stub": true})
    } else {
        json!({"stub": true, "content_type": "text/plain", "digest": HELLO_DIGEST, "length": 5, "revpos": 1})
    };
    let second = e
        .put(
            &format!("/{db}/doc"),
            json!({"_rev": rev1, "v": 2, "_attachments": {
                "hello.txt": stub,
                "b.bin": {"content_type": "application/octet-stream", "data": BASE64.encode(&bytes)}
            }}),
        )
        .await?
        .expect(201, "PUT carrying a stub")?;
    let rev2 = second.rev()?;
    let read = e.get(&format!("/{db}/doc")).await?.expect(200, "GET rev 2")?;
    check(read.body["_attachments"]["hello.txt"]["revpos"] == 1, || format!("carried revpos: {}", read.body))?;
    check(read.body["_attachments"]["b.bin"]["revpos"] == 2, || format!("new revpos: {}", read.body))?;
    check(read.body["_attachments"]["b.bin"]["length"] == bytes.len(), || format!("length: {}", read.body))?;
    let all = e.get(&format!("/{db}/doc?attachments=true")).await?.expect(200, "GET rev 2 attachments=true")?;
    let b = all.body["_attachments"]["b.bin"]["data"].as_str().map(|d| BASE64.decode(d));
    check(matches!(&b, Some(Ok(decoded)) if *decoded == bytes), || format!("binary bytes exact: {}", all.body))?;

    // atts_since: only attachments newer than the newest named revision on the leaf's path
    // (pouchdb-server, behind the CouchDB backend here, ignores it).
    if kept_here(&e) {
        let since = e.get(&format!("/{db}/doc?atts_since={}", encode(&json!([rev1]).to_string()))).await?;
        let since = since.expect(200, "atts_since=[rev1]")?;
        check(
            since.body["_attachments"]["hello.txt"]["stub"] == true
                && since.body["_attachments"]["hello.txt"].get("data").is_none()
                && since.body["_attachments"]["b.bin"]["data"].is_string(),
            || format!("atts_since=[rev1]: {}", since.body),
        )?;
        let since = e.get(&format!("/{db}/doc?atts_since={}", encode(&json!([rev2]).to_string()))).await?;
        let since = since.expect(200, "atts_since=[rev2]")?;
        check(since.body["_attachments"]["b.bin"]["stub"] == true, || format!("atts_since=[rev2]: {}", since.body))?;
    }

    // A stub the parent does not have: 412 missing_stub (couch_doc:merge_stubs).
    let missing = e
        .put(&format!("/{db}/doc"), json!({"_rev": rev2, "_attachments": {"nope.txt": {"stub": true}}}))
        .await?
        .expect(412, "a stub of nothing")?;
    check(missing.body["error"] == "missing_stub", || format!("missing stub: {}", missing.body))?;
    if kept_here(&e) {
        check(missing.body["reason"] == "Invalid attachment stub in doc for nope.txt", || {
            format!("missing stub reason: {}", missing.body)
        })?;
        // This server's field naming the bytes is not taken from a client: a stub naming the
        // bytes of hello.txt by their hash, on a new document, is a stub of nothing.
        let sha = hex::encode(sha2::Sha256::digest(b"hello"));
        let forged = e
            .put(
                &format!("/{db}/forged"),
                json!({"_attachments": {"x": {"stub": true, "digest": HELLO_DIGEST, "length": 5, "agentstore_sha256": sha}}}),
            )
            .await?
            .expect(412, "a stub naming bytes by hash")?;
        check(forged.body["error"] == "missing_stub", || format!("forged stub: {}", forged.body))?;
        // A stub of the right name but another digest is missing too.
        let other = e
            .put(
                &format!("/{db}/doc"),
                json!({"_rev": rev2, "_attachments": {"hello.txt": {"stub": true, "digest": EMPTY_DIGEST}}}),
            )
            .await?
            .expect(412, "a stub of another digest")?;
        check(other.body["error"] == "missing_stub", || format!("other digest: {}", other.body))?;
        // An edit of a revision that is no leaf is a conflict before its stubs are looked at.
        e.put(&format!("/{db}/doc"), json!({"_rev": rev1, "_attachments": {"nope.txt": {"stub": true}}}))
            .await?
            .expect(409, "a stale revision with a stub of nothing")?;
    }

    // An update that names no attachment drops them (CouchDB keeps only what the update sends).
    let third = e.put(&format!("/{db}/doc"), json!({"_rev": rev2, "v": 3})).await?.expect(201, "PUT without")?;
    let read = e.get(&format!("/{db}/doc")).await?.expect(200, "GET rev 3")?;
    check(read.body.get("_attachments").is_none(), || format!("attachments dropped: {}", read.body))?;
    third.rev()?;

    // `_bulk_docs` with inline data, `_bulk_get` and `open_revs` with attachments=true.
    let bulk = e
        .post(
            &format!("/{db}/_bulk_docs"),
            json!({"docs": [{"_id": "bd", "_attachments": {"a.txt": {"content_type": "text/plain", "data": hello}}}]}),
        )
        .await?
        .expect(201, "_bulk_docs with inline data")?;
    check(bulk.body[0]["ok"] == true, || format!("_bulk_docs: {}", bulk.body))?;
    let got = e
        .post(&format!("/{db}/_bulk_get?attachments=true"), json!({"docs": [{"id": "bd"}]}))
        .await?
        .expect(200, "_bulk_get attachments=true")?;
    let doc = &got.body["results"][0]["docs"][0]["ok"];
    check(doc["_attachments"]["a.txt"]["data"] == hello, || format!("_bulk_get: {}", got.body))?;
    let open = e.get(&format!("/{db}/bd?open_revs=all&attachments=true")).await?.expect(200, "open_revs=all")?;
    check(open.body[0]["ok"]["_attachments"]["a.txt"]["data"] == hello, || format!("open_revs: {}", open.body))?;
    let listed = e
        .get(&format!("/{db}/_all_docs?include_docs=true&attachments=true&key=%22bd%22"))
        .await?
        .expect(200, "_all_docs attachments=true")?;
    check(listed.body["rows"][0]["doc"]["_attachments"]["a.txt"]["data"] == hello, || {
        format!("_all_docs: {}", listed.body)
    })?;
    let feed = e
        .get(&format!("/{db}/_changes?include_docs=true&attachments=true&filter=_doc_ids&doc_ids=[%22bd%22]"))
        .await?
        .expect(200, "_changes attachments=true")?;
    check(feed.body["results"][0]["doc"]["_attachments"]["a.txt"]["data"] == hello, || {
        format!("_changes: {}", feed.body)
    })?;
    let stubs = e.get(&format!("/{db}/_all_docs?include_docs=true&key=%22bd%22")).await?.expect(200, "_all_docs")?;
    check(stubs.body["rows"][0]["doc"]["_attachments"]["a.txt"]["stub"] == true, || {
        format!("_all_docs stubs: {}", stubs.body)
    })?;

    // Replicated revisions (new_edits=false): inline data keeps its revpos; a later revision's
    // stub is carried from its ancestor.
    e.post(
        &format!("/{db}/_bulk_docs"),
        json!({"new_edits": false, "docs": [{"_id": "rep", "_rev": "1-aaa",
            "_attachments": {"r.txt": {"content_type": "text/plain", "revpos": 1, "data": hello}}}]}),
    )
    .await?
    .expect(201, "_bulk_docs new_edits=false with data")?;
    let carried = e
        .post(
            &format!("/{db}/_bulk_docs"),
            json!({"new_edits": false, "docs": [{"_id": "rep", "_rev": "2-bbb",
                "_revisions": {"start": 2, "ids": ["bbb", "aaa"]},
                "_attachments": {"r.txt": {"content_type": "text/plain", "revpos": 1, "digest": HELLO_DIGEST, "stub": true}}}]}),
        )
        .await?
        .expect(201, "_bulk_docs new_edits=false with a stub")?;
    check(carried.body == json!([]), || format!("replicated stub: {}", carried.body))?;
    let rep = e.get(&format!("/{db}/rep?attachments=true")).await?.expect(200, "GET rep")?;
    check(rep.body["_rev"] == "2-bbb" && rep.body["_attachments"]["r.txt"]["data"] == hello, || {
        format!("replicated: {}", rep.body)
    })?;
    check(rep.body["_attachments"]["r.txt"]["revpos"] == 1, || format!("replicated revpos: {}", rep.body))?;

    if kept_here(&e) {
        // Past couchdb_max_attachment_bytes (1 MiB here): 413 attachment_too_large naming it.
        let big = BASE64.encode(vec![7u8; (1 << 20) + 1]);
        let refused = e
            .put(&format!("/{db}/big"), json!({"_attachments": {"big.bin": {"content_type": "x/y", "data": big}}}))
            .await?
            .expect(413, "an attachment past the bound")?;
        check(refused.body == json!({"error": "attachment_too_large", "reason": "big.bin"}), || {
            format!("413: {}", refused.body)
        })?;
        // Data that is not base64: 400.
        let bad = e
            .put(&format!("/{db}/bad"), json!({"_attachments": {"x": {"content_type": "x/y", "data": "not base64!"}}}))
            .await?
            .expect(400, "data that is not base64")?;
        check(bad.body["error"] == "bad_request", || format!("bad data: {}", bad.body))?;
    }
    Ok(())
}

pub(super) async fn attachments_standalone(e: Endpoint) -> TestResult {
    let db = fresh_db(&e, "alone").await?;
    let unicode = "résumé ✓.txt";
    let unicode_path = format!("/{db}/doc/{}", encode(unicode));
    // PUT on a document that does not exist creates it at generation 1.
    let put = raw(&e, Method::PUT, &unicode_path, &[("content-type", "text/plain")], b"bonjour".to_vec()).await?;
    check(put.status == StatusCode::CREATED, || format!("PUT unicode: {} {:?}", put.status, put.body))?;
    let rev1: Value = serde_json::from_slice(&put.body)?;
    let rev1 = rev1["rev"].as_str().unwrap_or_default().to_owned();
    check(rev1.starts_with("1-"), || format!("a new document's revision: {rev1}"))?;
    let got = raw(&e, Method::GET, &unicode_path, &[], Vec::new()).await?;
    check(got.status == StatusCode::OK && got.body == b"bonjour", || {
        format!("GET unicode: {} {:?}", got.status, got.body)
    })?;
    check(got.header("content-type").is_some_and(|t| t.starts_with("text/plain")), || {
        format!("Content-Type: {:?}", got.header("content-type"))
    })?;
    let md5 = md5_base64(b"bonjour");
    if kept_here(&e) {
        check(got.header("etag") == Some(&format!("\"{md5}\"")), || format!("ETag: {:?}", got.header("etag")))?;
        check(got.header("content-md5") == Some(md5.as_str()), || {
            format!("Content-MD5: {:?}", got.header("content-md5"))
        })?;
        let head = raw(&e, Method::HEAD, &unicode_path, &[], Vec::new()).await?;
        check(head.status == StatusCode::OK && head.body.is_empty(), || format!("HEAD: {}", head.status))?;
        check(head.header("content-length") == Some("7"), || {
            format!("HEAD length: {:?}", head.header("content-length"))
        })?;
        let cached =
            raw(&e, Method::GET, &unicode_path, &[("if-none-match", &format!("\"{md5}\""))], Vec::new()).await?;
        check(cached.status == StatusCode::NOT_MODIFIED && cached.body.is_empty(), || {
            format!("If-None-Match: {}", cached.status)
        })?;
    }

    // A name with slashes, by path segments and as one encoded segment.
    let bytes: Vec<u8> = (0u8..=255).collect();
    let slash = format!("/{db}/doc/dir/sub/file.bin?rev={rev1}");
    let put = raw(&e, Method::PUT, &slash, &[("content-type", "application/x-thing")], bytes.clone()).await?;
    check(put.status == StatusCode::CREATED, || format!("PUT slash name: {} {:?}", put.status, put.body))?;
    let rev2: Value = serde_json::from_slice(&put.body)?;
    let rev2 = rev2["rev"].as_str().unwrap_or_default().to_owned();
    for path in [format!("/{db}/doc/dir/sub/file.bin"), format!("/{db}/doc/{}", encode("dir/sub/file.bin"))] {
        let got = raw(&e, Method::GET, &path, &[], Vec::new()).await?;
        check(got.status == StatusCode::OK && got.body == bytes, || format!("GET {path}: {}", got.status))?;
    }
    let doc = e.get(&format!("/{db}/doc")).await?.expect(200, "GET doc")?;
    check(doc.body["_attachments"][unicode]["revpos"] == 1, || format!("unicode stub: {}", doc.body))?;
    check(doc.body["_attachments"]["dir/sub/file.bin"]["revpos"] == 2, || format!("slash stub: {}", doc.body))?;
    check(doc.body["_attachments"]["dir/sub/file.bin"]["length"] == 256, || format!("slash length: {}", doc.body))?;

    // An empty attachment.
    let empty_path = format!("/{db}/doc/empty");
    let put = raw(&e, Method::PUT, &format!("{empty_path}?rev={rev2}"), &[("content-type", "text/plain")], Vec::new())
        .await?;
    check(put.status == StatusCode::CREATED, || format!("PUT empty: {} {:?}", put.status, put.body))?;
    let rev3: Value = serde_json::from_slice(&put.body)?;
    let rev3 = rev3["rev"].as_str().unwrap_or_default().to_owned();
    let got = raw(&e, Method::GET, &empty_path, &[], Vec::new()).await?;
    check(got.status == StatusCode::OK && got.body.is_empty(), || format!("GET empty: {} {:?}", got.status, got.body))?;
    let doc = e.get(&format!("/{db}/doc")).await?.expect(200, "GET doc")?;
    check(doc.body["_attachments"]["empty"]["length"] == 0, || format!("empty stub: {}", doc.body))?;
    // On the CouchDB backend the database is the server's own, and so is the digest: Apache CouchDB
    // 3.4.3 keeps a `text/*` attachment gzipped (`[attachments] compressible_types`) and answers
    // the gzipped bytes' MD5 (checked with curl); pouchdb-server answers the bytes' own.
    let digests = if kept_here(&e) { vec![EMPTY_DIGEST] } else { vec![EMPTY_DIGEST, EMPTY_GZIPPED_DIGEST] };
    let digest = &doc.body["_attachments"]["empty"]["digest"];
    check(digests.iter().any(|wanted| digest == wanted), || format!("empty digest: {}", doc.body))?;

    if kept_here(&e) {
        // Ranges: 206 with Content-Range; past the end 416 (chttpd's range handling).
        let file = format!("/{db}/doc/dir/sub/file.bin");
        let part = raw(&e, Method::GET, &file, &[("range", "bytes=2-5")], Vec::new()).await?;
        check(part.status == StatusCode::PARTIAL_CONTENT && part.body == bytes[2..=5], || {
            format!("Range 2-5: {} {:?}", part.status, part.body)
        })?;
        check(part.header("content-range") == Some("bytes 2-5/256"), || {
            format!("Content-Range: {:?}", part.header("content-range"))
        })?;
        let tail = raw(&e, Method::GET, &file, &[("range", "bytes=-3")], Vec::new()).await?;
        check(tail.status == StatusCode::PARTIAL_CONTENT && tail.body == bytes[253..], || {
            format!("Range -3: {} {:?}", tail.status, tail.body)
        })?;
        let past = raw(&e, Method::GET, &file, &[("range", "bytes=256-300")], Vec::new()).await?;
        check(past.status == StatusCode::RANGE_NOT_SATISFIABLE, || format!("Range past the end: {}", past.status))?;
        let empty_range = raw(&e, Method::GET, &empty_path, &[("range", "bytes=0-0")], Vec::new()).await?;
        check(empty_range.status == StatusCode::RANGE_NOT_SATISFIABLE, || {
            format!("Range of an empty attachment: {}", empty_range.status)
        })?;
        // A write needs the current revision, as any write.
        let stale = raw(&e, Method::PUT, &format!("{empty_path}?rev={rev1}"), &[], b"x".to_vec()).await?;
        check(stale.status == StatusCode::CONFLICT, || format!("PUT on a stale rev: {}", stale.status))?;
        let none = raw(&e, Method::PUT, &empty_path, &[], b"x".to_vec()).await?;
        check(none.status == StatusCode::CONFLICT, || format!("PUT without rev: {}", none.status))?;
        let no_rev = e.delete(&unicode_path).await?;
        check(no_rev.status == StatusCode::CONFLICT, || format!("DELETE without rev: {}", no_rev.status))?;
    }

    // DELETE makes a revision without it; reading it then is 404.
    let deleted = e.delete(&format!("{unicode_path}?rev={rev3}")).await?.expect(200, "DELETE attachment")?;
    let rev4 = deleted.rev()?;
    check(rev4.starts_with("4-"), || format!("DELETE's revision: {rev4}"))?;
    let gone = e.get(&unicode_path).await?.expect(404, "GET a deleted attachment")?;
    check(gone.body["error"] == "not_found", || format!("deleted attachment: {}", gone.body))?;
    let doc = e.get(&format!("/{db}/doc")).await?.expect(200, "GET doc")?;
    check(doc.body["_attachments"].get(unicode).is_none(), || format!("after DELETE: {}", doc.body))?;
    check(doc.body["_attachments"]["empty"]["stub"] == true, || format!("others stay: {}", doc.body))?;
    // A design document's attachment (`_design/{name}/{att}`, a name not starting with `_`).
    let logo = format!("/{db}/_design/app/logo.png");
    let put = raw(&e, Method::PUT, &logo, &[("content-type", "image/png")], vec![137, 80, 78, 71]).await?;
    check(put.status == StatusCode::CREATED, || format!("PUT a design attachment: {} {:?}", put.status, put.body))?;
    let got = raw(&e, Method::GET, &logo, &[], Vec::new()).await?;
    check(got.status == StatusCode::OK && got.body == [137, 80, 78, 71], || format!("GET {logo}: {}", got.status))?;
    let missing = e.get(&format!("/{db}/nodoc/x")).await?.expect(404, "GET an attachment of no document")?;
    check(missing.body["error"] == "not_found", || format!("no document: {}", missing.body))?;
    Ok(())
}

/// The blobs (content-addressed bytes) a database's storage holds.
pub(super) async fn blob_count(e: &Endpoint, db: &str) -> Result<usize, Failed> {
    let name = agentstore::backend::catalog::DbName::parse(db).map_err(|err| err.to_string())?;
    let database = e.databases.open(&name).await?.ok_or("the database is not open")?;
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

pub(super) async fn attachments_stored_once_and_freed(e: Endpoint) -> TestResult {
    if !kept_here(&e) {
        // CouchDB keeps the attachments of its native databases itself.
        return Ok(());
    }
    let db = fresh_db(&e, "gc").await?;
    let same = BASE64.encode(b"the same bytes in two documents");
    let mut revs = Vec::new();
    for id in ["one", "two"] {
        let doc = json!({"_attachments": {"f": {"content_type": "text/plain", "data": same}}});
        revs.push(e.put(&format!("/{db}/{id}"), doc).await?.expect(201, "PUT with data")?.rev()?);
    }
    let other = raw(&e, Method::PUT, &format!("/{db}/three/g"), &[], b"other bytes".to_vec()).await?;
    check(other.status == StatusCode::CREATED, || format!("PUT three/g: {}", other.status))?;
    let three_rev: Value = serde_json::from_slice(&other.body)?;
    let three_rev = three_rev["rev"].as_str().unwrap_or_default().to_owned();
    check(blob_count(&e, &db).await? == 2, || "identical bytes in two documents are stored once".to_owned())?;

    // One of the two references goes: compaction keeps the bytes the other holds.
    e.delete(&format!("/{db}/one/f?rev={}", revs[0])).await?.expect(200, "DELETE one/f")?;
    e.post(&format!("/{db}/_compact"), json!({})).await?.expect(202, "_compact")?;
    check(blob_count(&e, &db).await? == 2, || "bytes still referenced are kept".to_owned())?;
    let two = raw(&e, Method::GET, &format!("/{db}/two/f"), &[], Vec::new()).await?;
    check(two.body == b"the same bytes in two documents", || format!("two/f after compaction: {:?}", two.body))?;

    // The last references go (a deleted document, a removed attachment): compaction frees both.
    e.delete(&format!("/{db}/two?rev={}", revs[1])).await?.expect(200, "DELETE two")?;
    e.delete(&format!("/{db}/three/g?rev={three_rev}")).await?.expect(200, "DELETE three/g")?;
    e.post(&format!("/{db}/_compact"), json!({})).await?.expect(202, "_compact")?;
    check(blob_count(&e, &db).await? == 0, || "unreferenced bytes are freed by compaction".to_owned())?;
    Ok(())
}

/// Deterministic bytes that do not repeat chunk by chunk (xorshift).
fn pseudo_random(length: usize) -> Vec<u8> {
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut bytes = Vec::with_capacity(length);
    while bytes.len() < length {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        bytes.extend_from_slice(&state.to_le_bytes());
    }
    bytes.truncate(length);
    bytes
}

pub(super) async fn attachments_64_mib_round_trip(e: Endpoint) -> TestResult {
    if !kept_here(&e) {
        return Ok(());
    }
    let db = fresh_db(&e, "big").await?;
    let bytes = pseudo_random(64 << 20);
    let sent = hex::encode(sha2::Sha256::digest(&bytes));
    let put =
        raw(&e, Method::PUT, &format!("/{db}/big/data.bin"), &[("content-type", "application/octet-stream")], bytes)
            .await?;
    check(put.status == StatusCode::CREATED, || format!("PUT 64 MiB: {} {:?}", put.status, put.body))?;
    let response = e.client.get(e.url(&format!("/{db}/big/data.bin"))).send().await?;
    check(response.status() == StatusCode::OK, || format!("GET 64 MiB: {}", response.status()))?;
    let mut hasher = sha2::Sha256::new();
    let mut length = 0usize;
    let mut body = response.bytes_stream();
    while let Some(chunk) = body.next().await {
        let chunk = chunk?;
        length += chunk.len();
        hasher.update(&chunk);
    }
    let received = hex::encode(hasher.finalize());
    check(length == 64 << 20 && received == sent, || {
        format!("64 MiB round trip: {length} bytes, sha256 {received} vs {sent}")
    })?;
    let doc = e.get(&format!("/{db}/big")).await?.expect(200, "GET big")?;
    check(doc.body["_attachments"]["data.bin"]["length"] == 64 << 20, || format!("64 MiB stub: {}", doc.body))?;
    Ok(())
}

/// `PUT /{db}/{doc}?new_edits=false` with a `multipart/related` body, as CouchDB's replicator
/// sends a document with attachments: the JSON part with `follows: true` entries, then each
/// attachment's bytes. The bytes read back exactly with their digests; an attachment sent in an
/// encoding this server does not read is refused (415) and nothing is written.
pub(super) async fn attachments_multipart_upload(e: Endpoint) -> TestResult {
    let db = fresh_db(&e, "multipart").await?;
    let binary: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    let text = b"hello from a replicator".to_vec();
    let rev = format!("1-{}", "c".repeat(32));
    let doc = json!({
        "_id": "mp", "_rev": rev, "_revisions": {"start": 1, "ids": ["c".repeat(32)]}, "kind": "multipart",
        "_attachments": {
            "bytes.bin": {"content_type": "application/octet-stream", "length": binary.len(), "follows": true, "revpos": 1},
            "note.txt": {"content_type": "text/plain", "length": text.len(), "follows": true, "revpos": 1},
        }
    });
    let boundary = "abc123boundary";
    let mut body = format!("--{boundary}\r\nContent-Type: application/json\r\n\r\n{doc}\r\n").into_bytes();
    for (name, bytes) in [("bytes.bin", &binary), ("note.txt", &text)] {
        body.extend(format!("--{boundary}\r\nContent-Disposition: attachment; filename=\"{name}\"\r\n\r\n").bytes());
        body.extend_from_slice(bytes);
        body.extend_from_slice(b"\r\n");
    }
    body.extend(format!("--{boundary}--").bytes());
    let content_type = format!("multipart/related; boundary=\"{boundary}\"");
    let put =
        raw(&e, Method::PUT, &format!("/{db}/mp?new_edits=false"), &[("Content-Type", &content_type)], body).await?;
    check(put.status == StatusCode::CREATED, || {
        format!("multipart PUT: {} {}", put.status, String::from_utf8_lossy(&put.body))
    })?;
    for (name, bytes) in [("bytes.bin", &binary), ("note.txt", &text)] {
        let got = raw(&e, Method::GET, &format!("/{db}/mp/{name}"), &[], Vec::new()).await?;
        check(got.status == StatusCode::OK && &got.body == bytes, || {
            format!("{name}: {} {} bytes", got.status, got.body.len())
        })?;
    }
    let read = e.get(&format!("/{db}/mp")).await?.expect(200, "the document")?;
    let stub = &read.body["_attachments"]["bytes.bin"];
    check(
        stub["digest"] == json!(format!("md5-{}", md5_base64(&binary)))
            && stub["length"] == binary.len()
            && stub["stub"] == true,
        || format!("stub: {}", read.body),
    )?;
    no_internal_fields(&read.body, "a multipart document")?;
    if !kept_here(&e) {
        // The CouchDB backend's databases are CouchDB's own: it takes encoded attachments.
        return Ok(());
    }

    // An encoding this server does not read (gzip is, `attachments_gzip_parts`): 415, nothing
    // written.
    let encoded = json!({
        "_id": "gz", "_rev": rev, "_revisions": {"start": 1, "ids": ["c".repeat(32)]},
        "_attachments": {"a.txt": {"content_type": "text/plain", "length": 5, "encoding": "br", "encoded_length": 3, "follows": true}}
    });
    let mut body = format!("--{boundary}\r\nContent-Type: application/json\r\n\r\n{encoded}\r\n").into_bytes();
    body.extend(
        format!("--{boundary}\r\nContent-Disposition: attachment; filename=\"a.txt\"\r\n\r\nxyz\r\n--{boundary}--")
            .bytes(),
    );
    let refused =
        raw(&e, Method::PUT, &format!("/{db}/gz?new_edits=false"), &[("Content-Type", &content_type)], body).await?;
    check(refused.status == StatusCode::UNSUPPORTED_MEDIA_TYPE, || {
        format!("an encoded attachment: {} {}", refused.status, String::from_utf8_lossy(&refused.body))
    })?;
    let gone = raw(&e, Method::GET, &format!("/{db}/gz"), &[], Vec::new()).await?;
    check(gone.status == StatusCode::NOT_FOUND, || format!("nothing written: {}", gone.status))
}

/// One part of a multipart answer, read back by `multer` (a parser independent of the server's).
struct Part {
    headers: reqwest::header::HeaderMap,
    file_name: Option<String>,
    bytes: Vec<u8>,
}

/// The boundary of a `multipart/…; boundary="B"` (or unquoted) content type.
fn boundary_of(content_type: &str) -> Result<String, Failed> {
    let (_, parameter) =
        content_type.split_once("boundary=").ok_or_else(|| format!("no boundary in {content_type:?}"))?;
    let boundary = parameter.split(';').next().unwrap_or_default().trim();
    Ok(boundary.trim_matches('"').to_owned())
}

/// The parts of a multipart body whose content type is `content_type`.
async fn parts_of(content_type: &str, body: Vec<u8>) -> Result<Vec<Part>, Failed> {
    let boundary = boundary_of(content_type)?;
    let source = futures::stream::once(async move { Ok::<_, std::convert::Infallible>(bytes::Bytes::from(body)) });
    let mut multipart = multer::Multipart::new(source, boundary);
    let mut parts = Vec::new();
    while let Some(field) = multipart.next_field().await.map_err(|err| format!("multipart: {err}"))? {
        let headers = field.headers().clone();
        let file_name = field.file_name().map(str::to_owned);
        let bytes = field.bytes().await.map_err(|err| format!("multipart part: {err}"))?.to_vec();
        parts.push(Part { headers, file_name, bytes });
    }
    Ok(parts)
}

fn content_type_of(headers: &reqwest::header::HeaderMap) -> &str {
    headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default()
}

/// A document as a `multipart/related` body sends it: its JSON, and per attachment that follows
/// (name → bytes), checked against its entry (`follows`, `length`, `digest` computed here).
async fn related_document(content_type: &str, body: Vec<u8>) -> Result<(Value, Vec<(String, Vec<u8>)>), Failed> {
    let parts = parts_of(content_type, body).await?;
    let (first, rest) = parts.split_first().ok_or("a multipart/related body without parts")?;
    check(content_type_of(&first.headers) == "application/json", || {
        format!("the first part is {:?}", content_type_of(&first.headers))
    })?;
    let doc: Value = serde_json::from_slice(&first.bytes)?;
    let mut attachments = Vec::new();
    for part in rest {
        let name = part.file_name.clone().ok_or("an attachment part without a file name")?;
        let entry = &doc["_attachments"][&name];
        check(entry["follows"] == true && entry.get("stub").is_none() && entry.get("data").is_none(), || {
            format!("entry of {name}: {entry}")
        })?;
        check(entry["length"] == part.bytes.len(), || format!("length of {name}: {entry} vs {}", part.bytes.len()))?;
        check(entry["digest"] == json!(format!("md5-{}", md5_base64(&part.bytes))), || {
            format!("digest of {name}: {entry}")
        })?;
        check(
            part.headers.get("content-length").and_then(|v| v.to_str().ok()) == Some(&part.bytes.len().to_string()),
            || format!("Content-Length of {name}: {:?}", part.headers.get("content-length")),
        )?;
        check(part.headers.get("content-encoding").is_none(), || format!("{name} is sent encoded"))?;
        attachments.push((name, part.bytes.clone()));
    }
    // Every entry that says `follows` has its part.
    let follows =
        doc["_attachments"].as_object().map_or(0, |atts| atts.values().filter(|a| a["follows"] == true).count());
    check(follows == attachments.len(), || format!("{follows} entries follow, {} parts came", attachments.len()))?;
    Ok((doc, attachments))
}

/// `GET /{db}/{doc}?open_revs=…` with `Accept: multipart/mixed` (what CouchDB's replicator reads:
/// every attachment's bytes but those `atts_since` leaves as stubs, without `attachments=true`),
/// and `?attachments=true` with `Accept: multipart/related`, both parsed by `multer` and compared
/// byte for byte and by digest with what was written; `Accept: application/json` still JSON.
pub(super) async fn attachments_multipart_answers(e: Endpoint) -> TestResult {
    if !kept_here(&e) {
        // The CouchDB backend's databases are CouchDB's own (pouchdb-server here, which answers
        // these reads as JSON): nothing of this server's answers them.
        return Ok(());
    }
    let db = fresh_db(&e, "mpanswers").await?;
    let binary = pseudo_random(300_000);
    let text = b"a text attachment\r\n--not a boundary\r\n\r\n".to_vec();
    let unicode = "dir/ünï cødé.txt";
    let first = e
        .put(
            &format!("/{db}/doc"),
            json!({"v": 1, "_attachments": {
                "data.bin": {"content_type": "application/octet-stream", "data": BASE64.encode(&binary)},
                unicode: {"content_type": "text/plain", "data": BASE64.encode(&text)},
                "empty.txt": {"content_type": "text/plain", "data": ""},
            }}),
        )
        .await?
        .expect(201, "PUT with attachments")?;
    let rev1 = first.rev()?;
    let added = b"added at revision 2".to_vec();
    let second = e
        .put(
            &format!("/{db}/doc"),
            json!({"_rev": rev1, "v": 2, "_attachments": {
                "data.bin": {"stub": true}, unicode: {"stub": true}, "empty.txt": {"stub": true},
                "added.txt": {"content_type": "text/plain", "data": BASE64.encode(&added)},
            }}),
        )
        .await?
        .expect(201, "PUT adding an attachment")?;
    let rev2 = second.rev()?;
    // A conflicting branch without attachments, from a replicator; it loses (same generation,
    // the smaller revision id), so the winner keeps the attachments.
    let branch = format!("2-{}", "0".repeat(32));
    let rev1_id = rev1.split_once('-').map(|(_, id)| id.to_owned()).unwrap_or_default();
    e.post(
        &format!("/{db}/_bulk_docs"),
        json!({"new_edits": false, "docs": [{"_id": "doc", "_rev": branch, "v": "branch",
            "_revisions": {"start": 2, "ids": ["0".repeat(32), rev1_id]}}]}),
    )
    .await?
    .expect(201, "a conflicting branch")?;
    let everything: Vec<(&str, &[u8])> =
        vec![("data.bin", &binary), (unicode, &text), ("empty.txt", b""), ("added.txt", &added)];
    let mixed = [("accept", "multipart/mixed")];

    // open_revs=[rev2, branch, a missing one]: what CouchDB's replicator asks, no `attachments`.
    let missing = format!("3-{}", "f".repeat(32));
    let wanted = encode(&json!([rev2, branch, missing]).to_string());
    let got = raw(&e, Method::GET, &format!("/{db}/doc?revs=true&open_revs={wanted}"), &mixed, Vec::new()).await?;
    let content_type = got.header("content-type").unwrap_or_default().to_owned();
    check(got.status == StatusCode::OK && content_type.starts_with("multipart/mixed; boundary=\""), || {
        format!("open_revs multipart: {} {content_type:?} {}", got.status, String::from_utf8_lossy(&got.body))
    })?;
    let parts = parts_of(&content_type, got.body).await?;
    check(parts.len() == 3, || format!("{} parts, not 3", parts.len()))?;
    let leaf_type = content_type_of(&parts[0].headers).to_owned();
    check(leaf_type.starts_with("multipart/related; boundary=\""), || format!("rev 2's part: {leaf_type:?}"))?;
    let (doc, sent) = related_document(&leaf_type, parts[0].bytes.clone()).await?;
    check(doc["_rev"] == rev2 && doc["v"] == 2 && doc["_revisions"]["start"] == 2, || format!("rev 2: {doc}"))?;
    let mut sent_sorted = sent.clone();
    sent_sorted.sort();
    let mut expected: Vec<(String, Vec<u8>)> =
        everything.iter().map(|(name, bytes)| (name.to_string(), bytes.to_vec())).collect();
    expected.sort();
    check(sent_sorted == expected, || {
        format!("the attachments sent: {:?}", sent.iter().map(|(n, b)| (n, b.len())).collect::<Vec<_>>())
    })?;
    check(doc["_attachments"]["added.txt"]["revpos"] == 2 && doc["_attachments"]["data.bin"]["revpos"] == 1, || {
        format!("revpos: {doc}")
    })?;
    no_internal_fields(&doc, "an open_revs part")?;
    // CouchDB's replicator matches these two types exactly.
    check(content_type_of(&parts[1].headers) == "application/json", || {
        format!("a leaf without attachments: {:?}", content_type_of(&parts[1].headers))
    })?;
    let plain: Value = serde_json::from_slice(&parts[1].bytes)?;
    check(plain["_rev"] == branch && plain["v"] == "branch", || format!("the branch: {plain}"))?;
    check(content_type_of(&parts[2].headers) == "application/json; error=\"true\"", || {
        format!("a missing revision: {:?}", content_type_of(&parts[2].headers))
    })?;
    let gone: Value = serde_json::from_slice(&parts[2].bytes)?;
    check(gone == json!({"missing": missing}), || format!("missing: {gone}"))?;

    // atts_since=[rev1]: only the attachment newer than rev 1 follows; latest=true from rev 1.
    let since = encode(&json!([rev1]).to_string());
    let path = format!("/{db}/doc?open_revs={}&latest=true&atts_since={since}", encode(&json!([rev1]).to_string()));
    let got = raw(&e, Method::GET, &path, &mixed, Vec::new()).await?;
    let content_type = got.header("content-type").unwrap_or_default().to_owned();
    let parts = parts_of(&content_type, got.body).await?;
    check(parts.len() == 2, || format!("latest from rev 1: {} parts (both leaves)", parts.len()))?;
    let mut seen_rev2 = false;
    for part in &parts {
        let part_type = content_type_of(&part.headers).to_owned();
        if part_type.starts_with("multipart/related") {
            let (doc, sent) = related_document(&part_type, part.bytes.clone()).await?;
            check(doc["_rev"] == rev2, || format!("latest leaf: {doc}"))?;
            check(sent == vec![("added.txt".to_owned(), added.clone())], || {
                format!("atts_since=[rev1] sent {:?}", sent.iter().map(|(n, _)| n).collect::<Vec<_>>())
            })?;
            check(doc["_attachments"]["data.bin"]["stub"] == true, || format!("older ones stay stubs: {doc}"))?;
            seen_rev2 = true;
        }
    }
    check(seen_rev2, || "the leaf of rev 1's branch with attachments".to_owned())?;

    // open_revs=all without Accept: multipart/mixed, as PouchDB asks: JSON as before.
    let json_answer = e.get(&format!("/{db}/doc?open_revs=all")).await?.expect(200, "open_revs as JSON")?;
    check(json_answer.body.as_array().is_some_and(|leaves| leaves.len() == 2), || {
        format!("open_revs JSON: {}", json_answer.body)
    })?;

    // attachments=true with Accept: multipart/related.
    let related = [("accept", "multipart/related")];
    let got = raw(&e, Method::GET, &format!("/{db}/doc?attachments=true"), &related, Vec::new()).await?;
    let content_type = got.header("content-type").unwrap_or_default().to_owned();
    check(got.status == StatusCode::OK && content_type.starts_with("multipart/related; boundary=\""), || {
        format!("attachments=true multipart: {} {content_type:?}", got.status)
    })?;
    check(got.header("content-length") == Some(&got.body.len().to_string()), || {
        format!("Content-Length {:?} of {} bytes", got.header("content-length"), got.body.len())
    })?;
    check(got.header("etag") == Some(&format!("\"{rev2}\"")), || format!("ETag: {:?}", got.header("etag")))?;
    let (doc, mut sent) = related_document(&content_type, got.body).await?;
    sent.sort();
    check(doc["_rev"] == rev2 && sent == expected, || format!("attachments=true multipart: {doc}"))?;
    // atts_since naming rev 2: nothing to send, so plain JSON with stubs, as CouchDB answers.
    let since = encode(&json!([rev2]).to_string());
    let got = raw(&e, Method::GET, &format!("/{db}/doc?atts_since={since}"), &related, Vec::new()).await?;
    check(got.header("content-type") == Some("application/json"), || {
        format!("nothing to send: {:?}", got.header("content-type"))
    })?;
    let stubs: Value = serde_json::from_slice(&got.body)?;
    check(stubs["_attachments"]["added.txt"]["stub"] == true, || format!("stubs: {stubs}"))?;
    // The same read accepting JSON: inline data, as before.
    let inline = e.get(&format!("/{db}/doc?attachments=true")).await?.expect(200, "attachments=true as JSON")?;
    check(inline.body["_attachments"]["added.txt"]["data"] == BASE64.encode(&added), || {
        format!("inline: {}", inline.body)
    })?;
    // `_bulk_get` for a client accepting multipart/mixed and not JSON (CouchDB's rule): every
    // attachment follows its leaf but those the entry's `atts_since` leaves as stubs.
    let asked = json!({"docs": [
        {"id": "doc", "rev": rev2}, {"id": "doc", "rev": missing}, {"id": "nodoc"},
        {"id": "doc", "rev": rev2, "atts_since": [rev2]},
    ]});
    let request = serde_json::to_vec(&asked)?;
    let got = raw(
        &e,
        Method::POST,
        &format!("/{db}/_bulk_get?revs=true"),
        &[("accept", "multipart/mixed"), ("content-type", "application/json")],
        request.clone(),
    )
    .await?;
    let content_type = got.header("content-type").unwrap_or_default().to_owned();
    check(got.status == StatusCode::OK && content_type.starts_with("multipart/mixed; boundary=\"--"), || {
        format!("_bulk_get multipart: {} {content_type:?} {}", got.status, String::from_utf8_lossy(&got.body))
    })?;
    let parts = parts_of(&content_type, got.body).await?;
    check(parts.len() == 4, || format!("_bulk_get: {} parts, not 4", parts.len()))?;
    let header = |part: &Part, name: &str| part.headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    check(
        header(&parts[0], "x-doc-id").as_deref() == Some("doc") && header(&parts[0], "x-rev-id") == Some(rev2.clone()),
        || format!("_bulk_get part headers: {:?}", parts[0].headers),
    )?;
    let (doc, mut sent) = related_document(content_type_of(&parts[0].headers), parts[0].bytes.clone()).await?;
    sent.sort();
    check(doc["_rev"] == rev2 && doc["_revisions"]["start"] == 2 && sent == expected, || {
        format!("_bulk_get's document: {doc}")
    })?;
    let errors: Vec<Value> =
        parts[1..3].iter().map(|part| serde_json::from_slice(&part.bytes)).collect::<Result<_, _>>()?;
    check(
        parts[1..3].iter().all(|part| content_type_of(&part.headers) == "application/json; error=\"true\"")
            && errors[0] == json!({"rev": missing, "error": "not_found", "reason": "missing"})
            && errors[1] == json!({"id": "nodoc", "rev": "undefined", "error": "not_found", "reason": "missing"}),
        || format!("_bulk_get errors: {errors:?}"),
    )?;
    check(content_type_of(&parts[3].headers) == "application/json", || {
        format!("nothing to send: {:?}", content_type_of(&parts[3].headers))
    })?;
    let stubs: Value = serde_json::from_slice(&parts[3].bytes)?;
    check(stubs["_attachments"]["added.txt"]["stub"] == true, || format!("_bulk_get atts_since: {stubs}"))?;
    // A client accepting JSON too gets JSON, as from CouchDB.
    let got = raw(
        &e,
        Method::POST,
        &format!("/{db}/_bulk_get"),
        &[("accept", "multipart/mixed, application/json"), ("content-type", "application/json")],
        request,
    )
    .await?;
    check(got.header("content-type").is_some_and(|t| t.starts_with("application/json")), || {
        format!("_bulk_get accepting JSON too: {:?}", got.header("content-type"))
    })?;

    // Without attachments=true, a document is JSON whatever the client accepts.
    let got = raw(&e, Method::GET, &format!("/{db}/doc"), &related, Vec::new()).await?;
    check(got.header("content-type") == Some("application/json"), || {
        format!("without attachments=true: {:?}", got.header("content-type"))
    })?;
    Ok(())
}

fn gzip(bytes: &[u8]) -> Result<Vec<u8>, Failed> {
    use std::io::Write as _;
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(bytes)?;
    Ok(encoder.finish()?)
}

/// A `multipart/related` replicated revision of document `id` with one attachment `name` whose
/// entry is `entry` (plus `follows`), its part's bytes `part`.
async fn put_related(e: &Endpoint, db: &str, id: &str, name: &str, entry: Value, part: &[u8]) -> Result<Raw, Failed> {
    let rev_id = "d".repeat(32);
    let mut entry = entry;
    entry["follows"] = json!(true);
    let doc = json!({"_id": id, "_rev": format!("1-{rev_id}"), "_revisions": {"start": 1, "ids": [rev_id]},
        "_attachments": {name: entry}});
    let boundary = "e0f1a2b3c4d5";
    let mut body = format!("--{boundary}\r\nContent-Type: application/json\r\n\r\n{doc}\r\n").into_bytes();
    body.extend(
        format!(
            "--{boundary}\r\nContent-Disposition: attachment; filename=\"{name}\"\r\nContent-Encoding: gzip\r\n\r\n"
        )
        .bytes(),
    );
    body.extend_from_slice(part);
    body.extend(format!("\r\n--{boundary}--").bytes());
    let content_type = format!("multipart/related; boundary=\"{boundary}\"");
    raw(e, Method::PUT, &format!("/{db}/{id}?new_edits=false"), &[("content-type", &content_type)], body).await
}

/// Attachment parts sent `encoding: gzip` (what CouchDB's replicator sends for an attachment its
/// source keeps compressed, with the digest of the compressed bytes): decoded and stored decoded,
/// read back byte for byte with the digest of the decoded bytes; a digest that does not match
/// the bytes sent, bytes that are not gzip, and another encoding are refused and nothing is
/// written; a gzip bomb stops at `couchdb_max_attachment_bytes` (1 MiB here) with 413, nothing
/// stored or referenced.
pub(super) async fn attachments_gzip_parts(e: Endpoint) -> TestResult {
    if !kept_here(&e) {
        // The CouchDB backend's databases are CouchDB's own: it keeps encoded attachments itself.
        return Ok(());
    }
    let db = fresh_db(&e, "gzip").await?;
    let text: Vec<u8> = (0..20_000).flat_map(|i| format!("line {i} of a compressible text\n").into_bytes()).collect();
    let encoded = gzip(&text)?;
    check(encoded.len() * 4 < text.len(), || format!("{} bytes compress to {}", text.len(), encoded.len()))?;
    let sent_digest = format!("md5-{}", md5_base64(&encoded));
    let entry = json!({"content_type": "text/plain", "revpos": 1, "digest": sent_digest, "length": text.len(),
        "encoding": "gzip", "encoded_length": encoded.len()});
    let put = put_related(&e, &db, "gz", "a.txt", entry.clone(), &encoded).await?;
    check(put.status == StatusCode::CREATED, || {
        format!("a gzip part: {} {}", put.status, String::from_utf8_lossy(&put.body))
    })?;
    let got = raw(&e, Method::GET, &format!("/{db}/gz/a.txt"), &[], Vec::new()).await?;
    check(got.status == StatusCode::OK && got.body == text, || {
        format!("decoded bytes: {} {} bytes of {}", got.status, got.body.len(), text.len())
    })?;
    check(got.header("content-encoding").is_none(), || "served decoded, not encoded".to_owned())?;
    let doc = e.get(&format!("/{db}/gz?att_encoding_info=true")).await?.expect(200, "the document")?;
    // Kept decoded, so shown as CouchDB shows an attachment it keeps unencoded: no `encoding`,
    // no `encoded_length`, the decoded length and the digest of the decoded bytes.
    let stub = json!({"content_type": "text/plain", "revpos": 1, "digest": format!("md5-{}", md5_base64(&text)),
        "length": text.len(), "stub": true});
    check(doc.body["_attachments"]["a.txt"] == stub, || format!("stub: {}", doc.body))?;

    // The digest must be that of the bytes sent (the encoded ones), as CouchDB checks it.
    let mut wrong = entry.clone();
    wrong["digest"] = json!(format!("md5-{}", md5_base64(&text)));
    let refused = put_related(&e, &db, "gz-digest", "a.txt", wrong, &encoded).await?;
    check(refused.status == StatusCode::BAD_REQUEST, || format!("a wrong digest: {}", refused.status))?;
    let body: Value = serde_json::from_slice(&refused.body)?;
    check(body["error"] == "content_md5_mismatch", || format!("a wrong digest: {body}"))?;
    // Unencoded bytes: the part's own `Content-Encoding: gzip` (put_related sends it) changes
    // nothing, the entry decides, as in CouchDB; their digest is checked too.
    let plain = b"plain bytes, whatever the part's headers say".to_vec();
    let identity =
        json!({"content_type": "text/plain", "length": plain.len(), "digest": format!("md5-{}", md5_base64(&plain))});
    let put = put_related(&e, &db, "plain", "p.txt", identity.clone(), &plain).await?;
    check(put.status == StatusCode::CREATED, || format!("an unencoded part: {}", put.status))?;
    let got = raw(&e, Method::GET, &format!("/{db}/plain/p.txt"), &[], Vec::new()).await?;
    check(got.body == plain, || format!("unencoded bytes kept as sent: {:?}", String::from_utf8_lossy(&got.body)))?;
    let mut wrong = identity;
    wrong["digest"] = json!(HELLO_DIGEST);
    let refused = put_related(&e, &db, "plain-digest", "p.txt", wrong, &plain).await?;
    check(refused.status == StatusCode::BAD_REQUEST, || format!("an unencoded wrong digest: {}", refused.status))?;
    // Bytes that are not gzip, or cut short of the gzip trailer.
    let not_gzip = b"plainly not gzip".to_vec();
    let mut bad = entry.clone();
    bad["encoded_length"] = json!(not_gzip.len());
    if let Some(fields) = bad.as_object_mut() {
        fields.remove("digest");
    }
    let refused = put_related(&e, &db, "gz-bad", "a.txt", bad.clone(), &not_gzip).await?;
    check(refused.status == StatusCode::BAD_REQUEST, || format!("bytes that are not gzip: {}", refused.status))?;
    let cut = &encoded[..encoded.len() - 4];
    bad["encoded_length"] = json!(cut.len());
    let refused = put_related(&e, &db, "gz-cut", "a.txt", bad.clone(), cut).await?;
    check(refused.status == StatusCode::BAD_REQUEST, || format!("gzip cut short: {}", refused.status))?;
    // Another encoding.
    let mut other = bad.clone();
    other["encoding"] = json!("br");
    other["encoded_length"] = json!(not_gzip.len());
    let refused = put_related(&e, &db, "gz-br", "a.txt", other, &not_gzip).await?;
    check(refused.status == StatusCode::UNSUPPORTED_MEDIA_TYPE, || format!("encoding br: {}", refused.status))?;
    for id in ["gz-digest", "plain-digest", "gz-bad", "gz-cut", "gz-br"] {
        let gone = raw(&e, Method::GET, &format!("/{db}/{id}"), &[], Vec::new()).await?;
        check(gone.status == StatusCode::NOT_FOUND, || format!("{id} written: {}", gone.status))?;
    }

    // A gzip bomb: 16 MiB of zeros in about 16 KiB, its length understated. Decoding stops past
    // the bound: 413 naming the attachment, nothing stored, nothing referenced. (Small enough to
    // arrive whole before the answer: the server answers without reading the rest of a body, and
    // a client still sending it may see the connection reset instead of the 413.)
    let bomb = gzip(&vec![0u8; 16 << 20])?;
    check(bomb.len() < (32 << 10), || format!("the bomb is {} bytes", bomb.len()))?;
    let before = blob_count(&e, &db).await?;
    let bomb_entry = json!({"content_type": "application/octet-stream", "revpos": 1, "length": 100,
        "encoding": "gzip", "encoded_length": bomb.len()});
    let refused = put_related(&e, &db, "bomb", "zeros.bin", bomb_entry, &bomb).await?;
    check(refused.status == StatusCode::PAYLOAD_TOO_LARGE, || {
        format!("a gzip bomb: {} {}", refused.status, String::from_utf8_lossy(&refused.body))
    })?;
    let body: Value = serde_json::from_slice(&refused.body)?;
    check(body == json!({"error": "attachment_too_large", "reason": "zeros.bin"}), || format!("the bomb: {body}"))?;
    let gone = raw(&e, Method::GET, &format!("/{db}/bomb"), &[], Vec::new()).await?;
    check(gone.status == StatusCode::NOT_FOUND, || format!("the bomb's document: {}", gone.status))?;
    check(blob_count(&e, &db).await? == before, || "the bomb's bytes are not kept".to_owned())?;
    // Its length stated: refused before a byte is decoded.
    let stated = json!({"content_type": "application/octet-stream", "length": 16 << 20, "encoding": "gzip",
        "encoded_length": bomb.len()});
    let refused = put_related(&e, &db, "bomb", "zeros.bin", stated, &bomb).await?;
    check(refused.status == StatusCode::PAYLOAD_TOO_LARGE, || format!("a stated bomb: {}", refused.status))?;

    // Inline data with `encoding: gzip`: CouchDB ignores `encoding` on inline data and keeps the
    // bytes as sent (couch_att's inline_from_json), and so does this server.
    let small = gzip(b"hello")?;
    e.put(
        &format!("/{db}/inline"),
        json!({"_attachments": {"x.gz": {"content_type": "text/plain", "encoding": "gzip", "data": BASE64.encode(&small)}}}),
    )
    .await?
    .expect(201, "inline data saying gzip")?;
    let got = raw(&e, Method::GET, &format!("/{db}/inline/x.gz"), &[], Vec::new()).await?;
    check(got.body == small, || format!("inline data kept as sent: {} bytes", got.body.len()))?;
    Ok(())
}

/// Issue 34: a gzip part is stored decoded, so by default its decoding is bounded by
/// `couchdb_max_gzip_ratio` (100 times its compressed bytes, plus a MiB), with no
/// `couchdb_max_attachment_bytes` set: a bomb (16 MiB of zeros in about 16 KiB) is 413 naming
/// the setting, nothing stored; text of an ordinary ratio is kept.
pub(super) async fn attachments_gzip_ratio_bound(e: Endpoint) -> TestResult {
    if !kept_here(&e) {
        // The CouchDB backend's databases are CouchDB's own: it keeps encoded attachments itself.
        return Ok(());
    }
    let db = fresh_db(&e, "gzratio").await?;
    let bomb = gzip(&vec![0u8; 16 << 20])?;
    let before = blob_count(&e, &db).await?;
    let entry = json!({"content_type": "application/octet-stream", "length": 16 << 20, "encoding": "gzip",
        "encoded_length": bomb.len()});
    let refused = put_related(&e, &db, "bomb", "zeros.bin", entry, &bomb).await?;
    let body: Value = serde_json::from_slice(&refused.body).unwrap_or_default();
    check(
        refused.status == StatusCode::PAYLOAD_TOO_LARGE
            && body["error"] == "attachment_too_large"
            && body["reason"].as_str().is_some_and(|reason| reason.contains("couchdb_max_gzip_ratio")),
        || format!("a gzip bomb with no attachment bound: {} {body}", refused.status),
    )?;
    let gone = raw(&e, Method::GET, &format!("/{db}/bomb"), &[], Vec::new()).await?;
    check(gone.status == StatusCode::NOT_FOUND, || format!("the bomb's document: {}", gone.status))?;
    check(blob_count(&e, &db).await? == before, || "the bomb's bytes are not kept".to_owned())?;

    let text: Vec<u8> = (0..100_000).flat_map(|i| format!("line {i} of a compressible text\n").into_bytes()).collect();
    let encoded = gzip(&text)?;
    let entry = json!({"content_type": "text/plain", "length": text.len(), "encoding": "gzip",
        "encoded_length": encoded.len()});
    let put = put_related(&e, &db, "text", "a.txt", entry, &encoded).await?;
    check(put.status == StatusCode::CREATED, || {
        format!("{} bytes of text in {} of gzip: {}", text.len(), encoded.len(), put.status)
    })?;
    let got = raw(&e, Method::GET, &format!("/{db}/text/a.txt"), &[], Vec::new()).await?;
    check(got.body == text, || format!("text read back: {} bytes of {}", got.body.len(), text.len()))
}

/// A budget of inline attachment bytes small enough for a trial: 1 MiB.
pub(super) const INLINE_BUDGET_CONFIG: &str = "couchdb_max_inflight_inline_bytes = 1048576\n";

/// Issue 34: attachments answered inline (base64 in JSON, held whole) take their length from the
/// server-wide `couchdb_max_inflight_inline_bytes` until the answer is sent: an answer that would
/// pass it alone is 413 naming the setting (`GET ?attachments=true`, `open_revs`, `_all_docs`,
/// a `_bulk_get` row), answers within it wait for each other and all succeed, and the streamed
/// reads (multipart, standalone) take no share.
pub(super) async fn attachments_inline_budget(e: Endpoint) -> TestResult {
    if !kept_here(&e) {
        // The CouchDB backend's databases are CouchDB's own: it answers their reads itself.
        return Ok(());
    }
    let db = fresh_db(&e, "inline").await?;
    let small: Vec<u8> = (0..256 << 10).map(|i: u32| (i % 251) as u8).collect();
    let big: Vec<u8> = (0..3 << 19).map(|i: u32| (i % 241) as u8).collect();
    for (id, bytes) in [("small", &small), ("big", &big)] {
        let put = raw(
            &e,
            Method::PUT,
            &format!("/{db}/{id}/a.bin"),
            &[("content-type", "application/octet-stream")],
            bytes.clone(),
        )
        .await?;
        check(put.status == StatusCode::CREATED, || format!("PUT {id}: {}", put.status))?;
    }
    let json_accept = [("accept", "application/json")];
    let names_setting = |body: &Value| {
        body["error"] == "too_large"
            && body["reason"].as_str().is_some_and(|reason| reason.contains("couchdb_max_inflight_inline_bytes"))
    };

    // 1.5 MiB inline passes the 1 MiB budget alone: refused, however it is asked for.
    for path in [
        format!("/{db}/big?attachments=true"),
        format!("/{db}/big?open_revs=all&attachments=true"),
        format!("/{db}/_all_docs?include_docs=true&attachments=true"),
    ] {
        let refused = raw(&e, Method::GET, &path, &json_accept, Vec::new()).await?;
        let body: Value = serde_json::from_slice(&refused.body).unwrap_or_default();
        check(refused.status == StatusCode::PAYLOAD_TOO_LARGE && names_setting(&body), || {
            let shown: String = body.to_string().chars().take(300).collect();
            format!("GET {path}: {} {shown}", refused.status)
        })?;
    }
    let bulk = e.post(&format!("/{db}/_bulk_get?attachments=true"), json!({"docs": [{"id": "big"}]})).await?;
    let row = &bulk.expect(200, "_bulk_get of big")?.body["results"][0]["docs"][0]["error"];
    check(names_setting(row), || format!("_bulk_get of big: {row}"))?;
    // The same document named 8 times: 2 MiB of one answer, past the budget from the 5th on.
    let eight: Vec<Value> = (0..8).map(|_| json!({"id": "small"})).collect();
    let bulk = e.post(&format!("/{db}/_bulk_get?attachments=true"), json!({"docs": eight})).await?;
    let bulk = bulk.expect(200, "_bulk_get of small 8 times")?;
    let results = bulk.body["results"].as_array().cloned().unwrap_or_default();
    let refused = results.iter().filter(|result| names_setting(&result["docs"][0]["error"])).count();
    let served =
        results.iter().filter(|result| result["docs"][0]["ok"]["_attachments"]["a.bin"]["data"].is_string()).count();
    check(refused == 4 && served == 4, || format!("_bulk_get of small 8 times: {served} served, {refused} refused"))?;

    // Within the budget: eight concurrent readers of 256 KiB (2 MiB together) take turns, and
    // every one is answered in full; the shares come back after each answer.
    let small_inline = format!("/{db}/small?attachments=true");
    let readers = (0..8).map(|_| raw(&e, Method::GET, &small_inline, &json_accept, Vec::new()));
    for read in futures::future::join_all(readers).await {
        let read = read?;
        let body: Value = serde_json::from_slice(&read.body).unwrap_or_default();
        let data = body["_attachments"]["a.bin"]["data"].as_str().unwrap_or_default();
        check(read.status == StatusCode::OK && BASE64.decode(data).ok().as_deref() == Some(&small[..]), || {
            format!("a concurrent inline read: {} {} bytes", read.status, read.body.len())
        })?;
    }

    // Streamed reads take no share: the big attachment as multipart and on its own.
    let related =
        raw(&e, Method::GET, &format!("/{db}/big?attachments=true"), &[("accept", "multipart/related")], Vec::new())
            .await?;
    check(related.status == StatusCode::OK && related.body.len() > big.len(), || {
        format!("big as multipart: {} {} bytes", related.status, related.body.len())
    })?;
    let alone = raw(&e, Method::GET, &format!("/{db}/big/a.bin"), &[], Vec::new()).await?;
    check(alone.status == StatusCode::OK && alone.body == big, || format!("big on its own: {}", alone.status))
}

/// A budget of 16 MiB of inline attachment bytes and a wait for a share of 0.5 s.
pub(super) const INLINE_WAIT_CONFIG: &str =
    "couchdb_max_inflight_inline_bytes = 16777216\ncouchdb_inline_wait_ms = 500\n";

/// Issue 34: how long a read waits for its share of `couchdb_max_inflight_inline_bytes` is the
/// setting `couchdb_inline_wait_ms`. A client that opens an answer with 12 MiB inline and does
/// not read it holds its share; a second such read waits the setting's 0.5 s, then gets 429
/// naming both settings; once the first client goes, the read is answered.
pub(super) async fn attachments_inline_wait_is_a_setting(e: Endpoint) -> TestResult {
    if !kept_here(&e) {
        // The CouchDB backend's databases are CouchDB's own: it answers their reads itself.
        return Ok(());
    }
    let db = fresh_db(&e, "inline-wait").await?;
    let bytes: Vec<u8> = (0..12 << 20).map(|i: u32| (i % 251) as u8).collect();
    let put = raw(
        &e,
        Method::PUT,
        &format!("/{db}/held/a.bin"),
        &[("content-type", "application/octet-stream")],
        bytes.clone(),
    )
    .await?;
    check(put.status == StatusCode::CREATED, || format!("PUT held: {}", put.status))?;
    let path = format!("/{db}/held?attachments=true");

    // The first reader takes its share when its answer is built, before the head is sent: once
    // the head arrives the share is held, until the body has been sent: 16 MiB of base64, far
    // more than a 4 KiB receive buffer and the server's socket buffer (4 MiB at most) take.
    let mut unread = super::slow_readers::open_unread(&e.root, &path).await?;
    let mut head = vec![0u8; 1024];
    let read = tokio::time::timeout(Duration::from_secs(30), tokio::io::AsyncReadExt::read(&mut unread, &mut head))
        .await
        .map_err(|_| "the unread answer's head never came")??;
    check(head[..read].starts_with(b"HTTP/1.1 200"), || {
        format!("the unread answer: {}", String::from_utf8_lossy(&head[..read]))
    })?;

    let json_accept = [("accept", "application/json")];
    let started = std::time::Instant::now();
    let waited = raw(&e, Method::GET, &path, &json_accept, Vec::new()).await?;
    let elapsed = started.elapsed();
    let body: Value = serde_json::from_slice(&waited.body).unwrap_or_default();
    check(
        waited.status == StatusCode::TOO_MANY_REQUESTS
            && body["error"] == "too_many_requests"
            && body["reason"].as_str().is_some_and(|reason| {
                reason.contains("couchdb_inline_wait_ms") && reason.contains("couchdb_max_inflight_inline_bytes")
            }),
        || {
            let shown: String = body.to_string().chars().take(300).collect();
            format!("a read while the budget is held: {} {shown}", waited.status)
        },
    )?;
    check(elapsed >= Duration::from_millis(500) && elapsed < Duration::from_secs(10), || {
        format!("the 429 came after {elapsed:?}, wanted the setting's 0.5 s")
    })?;

    // The first client goes: its share comes back and the read is answered.
    drop(unread);
    let mut last = String::new();
    for _ in 0..40 {
        let read = raw(&e, Method::GET, &path, &json_accept, Vec::new()).await?;
        if read.status == StatusCode::OK {
            let body: Value = serde_json::from_slice(&read.body).unwrap_or_default();
            let data = body["_attachments"]["a.bin"]["data"].as_str().unwrap_or_default();
            return check(BASE64.decode(data).ok().as_deref() == Some(&bytes[..]), || {
                "the attachment read back".into()
            });
        }
        last = format!("{}", read.status);
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Err(format!("the read after the first client went: {last}").into())
}
