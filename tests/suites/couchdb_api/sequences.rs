//! A database's sequences `N-opaque` (issue 35): `N` counts the feed on every backend, as
//! PouchDB's checkpointer and replication events read it. After one document `last_seq` is `1-…`;
//! ten documents read with `limit=4` answer `pending` 6, then 2, then 0, each row's `N` its place
//! in the feed; `update_seq` of a database at rest is `doc_count + doc_del_count`; `since=now`,
//! `descending`, `longpoll`, `continuous`, `_all_docs?update_seq=true` number the same way; and a
//! position shown by an earlier release (its `N` the token's own digits, a time on DynamoDB and
//! Firestore) still reads from the same place. Every expected answer was checked against Apache
//! CouchDB 3.4.3 by hand (a database of creations only, where its `N`, a count of updates, is the
//! same count). On the CouchDB backend the databases are the server's own: nothing to check.

use libtest_mimic::Failed;
use serde_json::{json, Value};

use super::{fresh_db_named, Answer, Endpoint};
use crate::common::{check, TestResult};

/// The `N` of a shown sequence `N-opaque`.
fn n_of(seq: &Value) -> Result<u64, Failed> {
    let text = seq.as_str().ok_or_else(|| format!("a sequence that is not a string: {seq}"))?;
    let (n, _) = text.split_once('-').ok_or_else(|| format!("a sequence without `N-`: {text}"))?;
    n.parse().map_err(|_| format!("a sequence whose N is not a number: {text}").into())
}

/// The `N` of each row's `seq`, and each row's id.
fn rows_of(answer: &Value) -> Result<Vec<(u64, String)>, Failed> {
    let rows = answer["results"].as_array().cloned().unwrap_or_default();
    rows.iter().map(|row| Ok((n_of(&row["seq"])?, row["id"].as_str().unwrap_or_default().to_owned()))).collect()
}

fn encoded(seq: &Value) -> String {
    let text = seq.as_str().unwrap_or_default();
    percent_encoding::utf8_percent_encode(text, percent_encoding::NON_ALPHANUMERIC).to_string()
}

async fn changes(e: &Endpoint, db: &str, query: &str) -> Result<Answer, Failed> {
    e.get(&format!("/{db}/_changes?{query}")).await?.expect(200, &format!("_changes?{query}"))
}

/// One page read: each row's `N`, the `N` of `last_seq`, and `pending`, as expected.
fn check_page(page: &Answer, what: &str, rows: &[u64], last: u64, pending: u64) -> TestResult {
    let seen: Vec<u64> = rows_of(&page.body)?.into_iter().map(|(n, _)| n).collect();
    let (seen_last, seen_pending) = (n_of(&page.body["last_seq"])?, page.body["pending"].as_u64());
    check(seen == rows && seen_last == last && seen_pending == Some(pending), || {
        format!(
            "{what}: rows numbered {seen:?}, last_seq {seen_last}, pending {seen_pending:?}; CouchDB answers \
             {rows:?}, {last}, {pending}: {}",
            page.body
        )
    })
}

/// `update_seq` of `GET /{db}` against its counts.
async fn check_info(e: &Endpoint, db: &str, documents: u64) -> TestResult {
    let info = e.get(&format!("/{db}")).await?.expect(200, "GET /db")?;
    let counts = info.body["doc_count"].as_u64().unwrap_or(0) + info.body["doc_del_count"].as_u64().unwrap_or(0);
    let n = n_of(&info.body["update_seq"])?;
    check(n == documents && counts == documents, || {
        format!("GET /db at rest after {documents} documents: update_seq N {n}, doc_count + doc_del_count {counts}")
    })
}

pub(super) async fn sequences_count_the_feed(e: Endpoint) -> TestResult {
    if e.backend == "couchdb" {
        return Ok(());
    }
    let db = fresh_db_named(&e, "seq", "count").await?;
    e.put(&format!("/{db}/1"), json!({})).await?.expect(201, "PUT 1")?;
    check_page(&changes(&e, &db, "").await?, "after one document", &[1], 1, 0)?;
    check_info(&e, &db, 1).await?;

    let docs: Vec<Value> = (2..=10).map(|n| json!({ "_id": n.to_string() })).collect();
    e.post(&format!("/{db}/_bulk_docs"), json!({ "docs": docs })).await?.expect(201, "_bulk_docs")?;
    let first = changes(&e, &db, "limit=4").await?;
    check_page(&first, "limit=4 from 0", &[1, 2, 3, 4], 4, 6)?;
    let second = changes(&e, &db, &format!("limit=4&since={}", encoded(&first.body["last_seq"]))).await?;
    check_page(&second, "limit=4 from the first page's last_seq", &[5, 6, 7, 8], 8, 2)?;
    let third = changes(&e, &db, &format!("limit=4&since={}", encoded(&second.body["last_seq"]))).await?;
    check_page(&third, "limit=4 from the second page's last_seq", &[9, 10], 10, 0)?;
    check_info(&e, &db, 10).await?;
    let listed = e.get(&format!("/{db}/_all_docs?update_seq=true&limit=0")).await?.expect(200, "_all_docs")?;
    check(n_of(&listed.body["update_seq"])? == 10, || format!("_all_docs?update_seq=true: {}", listed.body))?;
    check_page(&changes(&e, &db, "since=now").await?, "since=now", &[], 10, 0)?;
    // Newest first: each row keeps its own N; `last_seq` is the oldest row's, `pending` the rest.
    check_page(&changes(&e, &db, "descending=true&limit=3").await?, "descending, limit=3", &[10, 9, 8], 8, 7)?;
    let longpoll = changes(&e, &db, &format!("feed=longpoll&since={}", encoded(&second.body["last_seq"]))).await?;
    check_page(&longpoll, "longpoll from the second page's last_seq", &[9, 10], 10, 0)?;
    continuous_rows_are_numbered(&e, &db).await?;
    earlier_releases_positions_read_from_the_same_place(&e, &db, &first.body["last_seq"], &second).await?;
    a_deletion_is_counted(&e, &db).await?;
    a_view_numbers_its_update_seq(&e).await
}

/// Three documents and a design document: the view's `update_seq` is `4-…` (CouchDB 3.4.3's).
async fn a_view_numbers_its_update_seq(e: &Endpoint) -> TestResult {
    let db = fresh_db_named(e, "seq", "view").await?;
    let design = json!({ "_id": "_design/d", "views": { "v": { "map": "function (doc) { emit(doc._id, 1); }" } } });
    let docs = json!({ "docs": [{ "_id": "a" }, { "_id": "b" }, { "_id": "c" }, design] });
    e.post(&format!("/{db}/_bulk_docs"), docs).await?.expect(201, "_bulk_docs")?;
    let view = e.get(&format!("/{db}/_design/d/_view/v?update_seq=true&limit=0")).await?.expect(200, "view")?;
    check(n_of(&view.body["update_seq"])? == 4, || format!("the view's update_seq: {}", view.body))
}

/// After one of the ten is deleted CouchDB 3.4.3 answers `doc_count` 9 and `doc_del_count` 1
/// (its `N`, a count of updates, is 11 then; here the feed's length, 10). The embedded store
/// does not count its tombstones (`doc_del_count` 0, docs/couchdb-api.md).
async fn a_deletion_is_counted(e: &Endpoint, db: &str) -> TestResult {
    if e.backend == "embedded" {
        return Ok(());
    }
    let doc = e.get(&format!("/{db}/10")).await?.expect(200, "GET 10")?;
    let rev = doc.body["_rev"].as_str().unwrap_or_default().to_owned();
    e.delete(&format!("/{db}/10?rev={rev}")).await?.expect(200, "DELETE 10")?;
    let info = e.get(&format!("/{db}")).await?.expect(200, "GET /db")?;
    let counts = (info.body["doc_count"].as_u64(), info.body["doc_del_count"].as_u64());
    check(counts == (Some(9), Some(1)), || {
        format!("GET /db after deleting one of ten: doc_count, doc_del_count {counts:?}, CouchDB answers 9, 1")
    })
}

/// A continuous feed from 0: its rows numbered 1 to 10, its `last_seq` line 10.
async fn continuous_rows_are_numbered(e: &Endpoint, db: &str) -> TestResult {
    let url = e.url(&format!("/{db}/_changes?feed=continuous&since=0&timeout=200"));
    let text = e.client.get(url).send().await?.text().await?;
    let lines: Vec<Value> = text
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .map_err(|err| format!("continuous line: {err}: {text}"))?;
    let numbers: Vec<u64> =
        lines.iter().filter(|l| l.get("seq").is_some()).map(|l| n_of(&l["seq"])).collect::<Result<_, _>>()?;
    let last = lines.last().map(|l| n_of(&l["last_seq"])).transpose()?;
    check(numbers == (1..=10).collect::<Vec<_>>() && last == Some(10), || format!("continuous: {text}"))
}

/// `since` as an earlier release showed it (`N` the token's own leading digits) reads on from the
/// same position as the sequence this release shows for it.
async fn earlier_releases_positions_read_from_the_same_place(
    e: &Endpoint,
    db: &str,
    shown: &Value,
    from_shown: &Answer,
) -> TestResult {
    let text = shown.as_str().unwrap_or_default();
    let token = text.split_once('-').map_or(text, |(_, token)| token);
    let digits: String = token.chars().take_while(char::is_ascii_digit).collect();
    let earlier = Value::from(format!("{}-{token}", if digits.is_empty() { "0" } else { digits.as_str() }));
    let read = changes(e, db, &format!("limit=4&since={}", encoded(&earlier))).await?;
    let ids = |answer: &Value| -> Result<Vec<String>, Failed> {
        Ok(rows_of(answer)?.into_iter().map(|(_, id)| id).collect())
    };
    let (got, wanted) = (ids(&read.body)?, ids(&from_shown.body)?);
    check(got == wanted, || format!("since={earlier} (an earlier release's form) read {got:?}, not {wanted:?}"))
}
