//! The data-store database's `_changes` is the one feed every database has (issue 35 §2): a
//! per-user login sees only its own ids, sealed, and `pending` counts only its rows; an admin's
//! `style=all_docs` lists every leaf of a conflicted document, winner first, as CouchDB 3.4.3
//! answers (checked with curl: a document and a replicated `1-fff…` branch answer
//! `[{"rev":"1-fff…"},{"rev":"1-232…"}]`); a long-lived feed wakes on a write made through the
//! facade (the REST API's path), not only on one through the CouchDB face.

use std::collections::BTreeSet;

use agentstore::store::{DataStore, StoreOptions};

use super::logins::as_login;
use super::*;

fn row_ids(answer: &Answer) -> Vec<String> {
    answer.body["results"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["id"].as_str().map(str::to_owned))
        .collect()
}

fn row_seqs(answer: &Answer) -> Vec<Value> {
    answer.body["results"].as_array().into_iter().flatten().map(|r| r["seq"].clone()).collect()
}

/// A per-user login's feed on the data-store database: only its ids (others' interleaved with
/// them), every position sealed, `pending` its own rows left, `doc_ids` of another user's
/// documents answered as ids that do not exist, and its sealed `since` resuming exactly.
pub(super) async fn data_store_feed_confined_to_the_login(endpoint: Endpoint) -> TestResult {
    let e = &endpoint;
    let mine: Vec<Value> = (0..3).map(|i| doc("alice", "ns", &format!("k{i}"), json!(i))).collect();
    let others: Vec<Value> = (0..3).map(|i| doc("bob", "ns", &format!("k{i}"), json!(i))).collect();
    // Interleaved writes: bob's rows sit between alice's in the feed.
    for (a, b) in mine.iter().zip(&others) {
        as_login(e, "admin", Method::POST, &format!("/{DB}/_bulk_docs"), Some(json!({ "docs": [a, b] })))
            .await?
            .expect(201, "admin writes")?;
    }
    let my_ids: Vec<String> = mine.iter().filter_map(|d| d["_id"].as_str().map(str::to_owned)).collect();
    let bobs: Vec<String> = others.iter().filter_map(|d| d["_id"].as_str().map(str::to_owned)).collect();
    let admin_feed = as_login(e, "admin", Method::GET, &format!("/{DB}/_changes"), None).await?.expect(200, "admin")?;
    check(row_ids(&admin_feed).len() == 6, || format!("the admin sees every row: {}", admin_feed.body))?;

    let first =
        as_login(e, "alice", Method::GET, &format!("/{DB}/_changes?limit=1"), None).await?.expect(200, "limit=1")?;
    check(row_ids(&first) == my_ids[..1], || format!("alice's first row: {}", first.body))?;
    check(first.body["pending"] == json!(2), || format!("pending counts alice's two rows left only: {}", first.body))?;
    let plain: Vec<Value> = row_seqs(&admin_feed).into_iter().chain([admin_feed.body["last_seq"].clone()]).collect();
    for shown in row_seqs(&first).iter().chain([&first.body["last_seq"]]) {
        check(shown.is_string() && !plain.contains(shown), || format!("alice is shown a store position: {shown}"))?;
    }
    // Her sealed `last_seq` resumes after her first row.
    let since = first.body["last_seq"].as_str().unwrap_or_default().to_owned();
    let rest = as_login(e, "alice", Method::GET, &format!("/{DB}/_changes?since={since}"), None)
        .await?
        .expect(200, "since a sealed position")?;
    check(row_ids(&rest) == my_ids[1..] && rest.body["pending"] == json!(0), || format!("resumed: {}", rest.body))?;
    let whole = as_login(e, "alice", Method::GET, &format!("/{DB}/_changes?feed=longpoll"), None)
        .await?
        .expect(200, "longpoll")?;
    check(row_ids(&whole) == my_ids, || format!("alice's longpoll feed: {}", whole.body))?;

    // Another user's ids in `doc_ids` are answered as ids that do not exist: no row.
    let asked = json!({ "doc_ids": [bobs[0], my_ids[2], "alice:none:bm9uZQ"] });
    let by_ids = as_login(e, "alice", Method::POST, &format!("/{DB}/_changes?filter=_doc_ids"), Some(asked))
        .await?
        .expect(200, "doc_ids")?;
    check(row_ids(&by_ids) == my_ids[2..], || format!("doc_ids with bob's id: {}", by_ids.body))?;
    // Newest first, only hers (the one feed of every database, on every backend), `pending` her
    // older row.
    let newest = as_login(e, "alice", Method::GET, &format!("/{DB}/_changes?descending=true&limit=2"), None)
        .await?
        .expect(200, "descending")?;
    let mut want = my_ids[1..].to_vec();
    want.reverse();
    check(row_ids(&newest) == want && newest.body["pending"] == json!(1), || {
        format!("alice's descending feed: {}", newest.body)
    })?;
    // An admin's plain store position from an earlier answer still resumes (clients keep them).
    let admin_since = row_seqs(&admin_feed).get(1).and_then(Value::as_str).unwrap_or_default().to_owned();
    let resumed = as_login(e, "admin", Method::POST, &format!("/{DB}/_changes?since={admin_since}"), Some(json!({})))
        .await?
        .expect(200, "admin since")?;
    check(row_ids(&resumed) == row_ids(&admin_feed)[2..], || format!("admin resumed: {}", resumed.body))
}

/// `style=all_docs` on the data-store database lists both leaves of a conflicted document, the
/// winner first, as CouchDB does; without it, only the winner.
pub(super) async fn data_store_feed_shows_every_leaf(e: Endpoint) -> TestResult {
    let written = doc("carol", "ns", "k", json!(1));
    let id = written["_id"].as_str().unwrap_or_default().to_owned();
    let first = e.put(&path_of(&id), written.clone()).await?.expect(201, "PUT")?.rev()?;
    let mut branch = written.clone();
    branch["_rev"] = json!("1-ffffffffffffffffffffffffffffffff");
    e.post(&format!("/{DB}/_bulk_docs"), json!({ "docs": [branch], "new_edits": false }))
        .await?
        .expect(201, "replicated branch")?;
    let every = e.get(&format!("/{DB}/_changes?style=all_docs")).await?.expect(200, "style=all_docs")?;
    let row = every.body["results"].as_array().and_then(|rows| rows.iter().find(|r| r["id"] == json!(id))).cloned();
    let want = json!([{ "rev": "1-ffffffffffffffffffffffffffffffff" }, { "rev": first }]);
    check(row.as_ref().is_some_and(|row| row["changes"] == want), || format!("style=all_docs: {}", every.body))?;
    let winner = e.get(&format!("/{DB}/_changes")).await?.expect(200, "main_only")?;
    let row = winner.body["results"].as_array().and_then(|rows| rows.iter().find(|r| r["id"] == json!(id))).cloned();
    check(row.is_some_and(|row| row["changes"] == json!([want[0]])), || format!("main_only: {}", winner.body))
}

/// A longpoll and a continuous feed on the data-store database, waiting at the end of the feed,
/// wake on a write made through the facade (as the REST API writes), and show it.
pub(super) async fn data_store_feed_wakes_on_facade_writes(e: Endpoint) -> TestResult {
    let facade = DataStore::open(Arc::clone(&e._ctx.backend), StoreOptions::default()).await?;
    facade.set("dave", "ns", "before", json!(0), None, None).await?;
    let at_end = e.get(&format!("/{DB}/_changes")).await?.expect(200, "the feed")?;
    let since = at_end.body["last_seq"].as_str().unwrap_or_default().to_owned();
    let longpoll = e.client.get(e.url(&format!("/{DB}/_changes?feed=longpoll&since={since}&timeout=20000"))).send();
    let continuous = e.client.get(e.url(&format!("/{DB}/_changes?feed=continuous&since={since}&timeout=3000"))).send();
    let writer = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        facade.set("dave", "ns", "after", json!(1), None, None).await
    };
    let started = std::time::Instant::now();
    let (longpoll, continuous, written) = tokio::join!(longpoll, continuous, writer);
    let written = written?;
    let longpoll = Answer::read(longpoll?).await?.expect(200, "longpoll")?;
    check(row_ids(&longpoll) == [written.id.to_string()] && started.elapsed() < Duration::from_secs(15), || {
        format!("longpoll after a facade write ({:?}): {}", started.elapsed(), longpoll.body)
    })?;
    let lines = continuous?.text().await?;
    let ids: BTreeSet<String> = lines
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter_map(|row| row["id"].as_str().map(str::to_owned))
        .collect();
    check(ids == BTreeSet::from([written.id.to_string()]), || format!("continuous after a facade write: {lines}"))
}
