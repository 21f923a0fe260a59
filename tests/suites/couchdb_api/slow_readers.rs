//! Clients that open streamed answers and stop reading (issue 34): each such answer must hold
//! neither a blocking thread nor a read transaction while it waits on its client, so requests on
//! other databases keep answering. The trial runs on a runtime whose blocking pool is
//! [`SLOW_READER_POOL`] threads, fewer than the unread answers it opens, so an answer that kept
//! a thread would leave none for anyone else.

use std::time::Duration;

use tokio::io::AsyncWriteExt;

use super::*;

/// Blocking threads of the trial's runtime.
pub(super) const SLOW_READER_POOL: usize = 6;

/// Unread answers opened at once: more than the pool.
const UNREAD_ANSWERS: usize = 3 * SLOW_READER_POOL;

/// A view answer of about 24 MB: far more than the socket buffers, the server's write buffer and
/// the rows in flight between the index and the answer hold, so its producer must wait.
const DOCS: usize = 12;
const ROWS_PER_DOC: usize = 2000;
const VALUE_BYTES: usize = 1000;

/// Opens `path` on a raw connection with a tiny receive buffer and never reads the answer.
pub(super) async fn open_unread(root: &str, path: &str) -> Result<tokio::net::TcpStream, Failed> {
    let addr: std::net::SocketAddr =
        root.trim_start_matches("http://").parse().map_err(|e| format!("address of {root}: {e}"))?;
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.set_recv_buffer_size(4096)?;
    let mut stream = socket.connect(addr).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: application/json\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    Ok(stream)
}

pub(super) async fn slow_readers_hold_no_threads(e: Endpoint) -> TestResult {
    if e.backend == "couchdb" {
        // The CouchDB backend's databases are passed to CouchDB, which streams its own answers.
        return Ok(());
    }
    let big = fresh_db_named(&e, "slow", "big").await?;
    let map = format!(
        "function (doc) {{ if (doc.fill) {{ for (var i = 0; i < {ROWS_PER_DOC}; i++) {{ emit([doc._id, i], doc.fill); }} }} }}"
    );
    e.put(&format!("/{big}/_design/d"), json!({ "views": { "rows": { "map": map } } }))
        .await?
        .expect(201, "design document")?;
    let fill = "x".repeat(VALUE_BYTES);
    let docs: Vec<Value> = (0..DOCS).map(|i| json!({ "_id": format!("d{i:02}"), "fill": fill })).collect();
    e.post(&format!("/{big}/_bulk_docs"), json!({ "docs": docs })).await?.expect(201, "_bulk_docs")?;
    // The index is built once, read to its end.
    let built = e.get(&format!("/{big}/_design/d/_view/rows?limit=1")).await?.expect(200, "first query")?;
    check(built.body["total_rows"] == json!(DOCS * ROWS_PER_DOC), || format!("index: {}", built.body["total_rows"]))?;

    let other = fresh_db_named(&e, "slow", "other").await?;
    e.put(&format!("/{other}/doc"), json!({ "n": 1 })).await?.expect(201, "PUT on the other database")?;
    e.put(
        &format!("/{other}/_design/d"),
        json!({ "views": { "n": { "map": "function (doc) { emit(doc.n, null); }" } } }),
    )
    .await?
    .expect(201, "the other database's design document")?;

    let mut unread = Vec::with_capacity(UNREAD_ANSWERS);
    for _ in 0..UNREAD_ANSWERS {
        unread.push(open_unread(&e.root, &format!("/{big}/_design/d/_view/rows?update=false")).await?);
    }
    // Time for every answer to fill its buffers and wait on its client.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let others = async {
        e.get(&format!("/{other}/doc")).await?.expect(200, "GET on the other database")?;
        e.put(&format!("/{other}/doc2"), json!({ "n": 2 })).await?.expect(201, "PUT on the other database")?;
        let view = e.get(&format!("/{other}/_design/d/_view/n")).await?.expect(200, "view on the other database")?;
        check(view.body["total_rows"] == json!(2), || format!("other view: {}", view.body))?;
        e.get("/_up").await?.expect(200, "/_up")?;
        Ok::<_, Failed>(())
    };
    match tokio::time::timeout(Duration::from_secs(60), others).await {
        Ok(answered) => answered?,
        Err(_) => {
            return Err(format!(
                "with {UNREAD_ANSWERS} view answers unread, requests on another database got no answer in 60 s"
            )
            .into())
        }
    }
    drop(unread);
    Ok(())
}

/// Documents of [`PAGED_DOC_BYTES`]: more than a listing's first page with documents (64 rows)
/// and, together, several times the bytes a page aims at (256 KiB), so the pages after the first
/// are sized from it.
const PAGED_DOCS: usize = 150;
const PAGED_DOC_BYTES: usize = 8000;

/// Listings whose pages are sized by their rows' bytes (`_all_docs`, `_changes`, with documents)
/// list every document once and in order, with `skip` and `limit` across pages, on every
/// backend's tokens.
pub(super) async fn listings_paged_by_bytes(e: Endpoint) -> TestResult {
    let db = fresh_db_named(&e, "paged", "bytes").await?;
    let fill = "p".repeat(PAGED_DOC_BYTES);
    let docs: Vec<Value> = (0..PAGED_DOCS).map(|i| json!({ "_id": format!("d{i:03}"), "fill": fill })).collect();
    e.post(&format!("/{db}/_bulk_docs"), json!({ "docs": docs })).await?.expect(201, "_bulk_docs")?;
    let ids = |rows: &Value, doc_of: &dyn Fn(&Value) -> Value| -> Result<Vec<String>, Failed> {
        let rows = rows.as_array().ok_or("rows are not an array")?;
        let mut ids = Vec::with_capacity(rows.len());
        for row in rows {
            let doc = doc_of(row);
            check(doc["fill"] == json!(fill), || format!("{}: its document is not whole", row["id"]))?;
            ids.push(doc["_id"].as_str().unwrap_or_default().to_owned());
        }
        Ok(ids)
    };
    let expected = |from: usize, to: usize| (from..to).map(|i| format!("d{i:03}")).collect::<Vec<_>>();
    let listed = e.get(&format!("/{db}/_all_docs?include_docs=true")).await?.expect(200, "_all_docs")?;
    let seen = ids(&listed.body["rows"], &|row| row["doc"].clone())?;
    check(seen == expected(0, PAGED_DOCS), || format!("_all_docs listed {seen:?}"))?;
    let part = e.get(&format!("/{db}/_all_docs?include_docs=true&skip=70&limit=75")).await?.expect(200, "skip")?;
    let seen = ids(&part.body["rows"], &|row| row["doc"].clone())?;
    check(seen == expected(70, 145), || format!("skip=70&limit=75 listed {seen:?}"))?;
    let changes = e.get(&format!("/{db}/_changes?include_docs=true")).await?.expect(200, "_changes")?;
    let mut seen = ids(&changes.body["results"], &|row| row["doc"].clone())?;
    seen.sort();
    check(seen == expected(0, PAGED_DOCS), || format!("_changes listed {seen:?}"))?;
    Ok(())
}
