//! `_changes`: `since` and `limit`, the feed kinds, writes shown at once, and a continuous feed
//! listing each write once.

use super::*;

/// A `since` the backend does not recognise is answered before the response starts, with
/// CouchDB's 400 (the reason is `fabric_view_changes:validate_start_seq`'s in CouchDB 3.4.3's
/// source); it used to get no HTTP response at all. `limit=-1` is CouchDB 3.4.3's 200 with every
/// row (its feed collector stops only when the count it decrements reaches 0).
pub(super) async fn changes_since_and_limit(e: Endpoint) -> TestResult {
    let docs: Vec<Value> = (0..3).map(|i| doc("user_1", "since", &format!("k{i}"), json!(i))).collect();
    e.post(&format!("/{DB}/_bulk_docs"), json!({ "docs": docs })).await?.expect(201, "seed")?;
    let malformed = json!({ "error": "bad_request", "reason": "Malformed sequence supplied in 'since' parameter." });
    for since in ["abc", "-1", "1e3", "99999999999999999999"] {
        // pouchdb-server, standing in for CouchDB in CI, reads a 20-digit number as a position
        // (a real CouchDB 3.4.3 refuses it, as every backend here does: its sequences are opaque
        // tokens, checked with curl); what the backend recognises is the backend's to decide, so
        // on pouchdb-server that one pair is a whole 200.
        if on_pouchdb_server(&e) && since.len() == 20 {
            let path = format!("/{DB}/_changes?since={since}");
            e.get(&path).await?.expect(200, &path)?;
            continue;
        }
        for feed in ["normal", "longpoll", "continuous"] {
            let path = format!("/{DB}/_changes?feed={feed}&since={since}&timeout=500");
            let answer = e.get(&path).await?.expect(400, &path)?;
            check(answer.body == malformed, || format!("{path}: {}", answer.body))?;
        }
    }
    // A feed with a settle window shows writes once it has passed: read until all three are there.
    let mut rows = 0;
    for _ in 0..40 {
        let all = e.get(&format!("/{DB}/_changes?since=0&limit=-1")).await?.expect(200, "limit=-1")?;
        rows = all.body["results"].as_array().map_or(0, Vec::len);
        if rows == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    check(rows == 3, || format!("limit=-1 gave {rows} rows, not all 3"))
}

pub(super) async fn changes_feeds(e: Endpoint) -> TestResult {
    let docs: Vec<Value> = (0..6).map(|i| doc("user_1", "feed", &format!("k{i}"), json!(i))).collect();
    e.post(&format!("/{DB}/_bulk_docs"), json!({ "docs": docs })).await?.expect(201, "seed")?;
    // Acknowledged writes are in the next read, settle window or not (issue 22).
    let all = e.get(&format!("/{DB}/_changes?since=0&include_docs=true")).await?.expect(200, "_changes")?;
    same_fields(&all.body, &couchdb_body("050-changes-include-docs"), "_changes", &[])?;
    let results = all.body["results"].as_array().cloned().unwrap_or_default();
    check(results.len() == 6 && all.body["pending"] == 0, || format!("since=0: {}", all.body))?;
    check(results.iter().all(|r| r["doc"]["_id"] == r["id"] && r["changes"][0]["rev"] == r["doc"]["_rev"]), || {
        "include_docs rows".into()
    })?;
    // Paging with limit, as couchbackup does, until pending is 0.
    let (mut since, mut paged, mut rounds) = ("0".to_owned(), 0, 0);
    loop {
        rounds += 1;
        let page = e
            .post(&format!("/{DB}/_changes?feed=normal&since={since}&limit=4&seq_interval=500"), json!({}))
            .await?
            .expect(200, "page")?;
        paged += page.body["results"].as_array().map(Vec::len).unwrap_or(0);
        since = page.body["last_seq"].as_str().map(str::to_owned).ok_or("last_seq is a string")?;
        if page.body["pending"] == 0 || rounds > 10 {
            break;
        }
    }
    check(paged == 6, || format!("paged {paged} changes"))?;
    let now = e.get(&format!("/{DB}/_changes?since=now")).await?.expect(200, "since=now")?;
    check(now.body["results"] == json!([]), || format!("since=now: {}", now.body))?;
    let since = now.body["last_seq"].as_str().unwrap_or("now").to_owned();
    let waiting = {
        let client = e.client.clone();
        let url = e.url(&format!("/{DB}/_changes?feed=longpoll&since={since}&timeout=20000"));
        tokio::spawn(async move { Answer::read(client.get(url).send().await?).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let late = doc("user_1", "feed", "late", json!("x"));
    e.put(&path_of(late["_id"].as_str().unwrap_or_default()), late.clone())
        .await?
        .expect(201, "write while waiting")?;
    let woke = waiting.await.map_err(|e| e.to_string())??.expect(200, "longpoll")?;
    check(woke.body["results"].as_array().is_some_and(|r| r.iter().any(|row| row["id"] == late["_id"])), || {
        format!("longpoll: {}", woke.body)
    })?;
    let filtered = e
        .post(&format!("/{DB}/_changes?filter=_doc_ids"), json!({"doc_ids": [late["_id"]]}))
        .await?
        .expect(200, "_doc_ids")?;
    check(filtered.body["results"].as_array().is_some_and(|r| r.len() == 1), || {
        format!("_doc_ids: {}", filtered.body)
    })?;
    let continuous = e.client.get(e.url(&format!("/{DB}/_changes?feed=continuous&since=0&timeout=300"))).send().await?;
    let text = continuous.text().await?;
    let lines: Vec<Value> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("continuous line: {e}: {text}"))?;
    check(lines.len() == 8 && lines.last().is_some_and(|l| l["last_seq"].is_string()), || format!("continuous: {text}"))
}

/// Issue 22: `_bulk_docs` of 60, then at once `_changes` (no wait): CouchDB shows a write in
/// `_changes` as soon as it is acknowledged, so all 60 are there, at the revisions `_bulk_docs`
/// answered, from `since=0`, from a `since` taken before the writes, and paged with `limit` as
/// couchbackup and the replicators read; `pending` is 0 only once all are reported. On DynamoDB
/// (settle window 5 s) the feed used to answer no rows with `pending: 0`.
pub(super) async fn changes_show_writes_at_once(e: Endpoint) -> TestResult {
    let before = e.get(&format!("/{DB}/_changes?since=now")).await?.expect(200, "since=now")?;
    let before = before.body["last_seq"].as_str().ok_or("last_seq is a string")?.to_owned();
    let docs: Vec<Value> = (0..60).map(|i| doc("user_now", "burst", &format!("k{i:02}"), json!(i))).collect();
    let written = e.post(&format!("/{DB}/_bulk_docs"), json!({ "docs": docs })).await?.expect(201, "_bulk_docs")?;
    let revs: std::collections::BTreeMap<String, String> = written
        .body
        .as_array()
        .ok_or("_bulk_docs answers an array")?
        .iter()
        .map(|row| {
            (row["id"].as_str().unwrap_or_default().to_owned(), row["rev"].as_str().unwrap_or_default().to_owned())
        })
        .collect();
    check(revs.len() == 60 && revs.values().all(|rev| rev.starts_with("1-")), || {
        format!("_bulk_docs: {}", written.body)
    })?;
    let reported = |results: &[Value], seen: &mut std::collections::BTreeMap<String, String>| {
        for row in results {
            let (Some(id), Some(rev)) = (row["id"].as_str(), row["changes"][0]["rev"].as_str()) else { continue };
            seen.insert(id.to_owned(), rev.to_owned());
        }
    };
    let missing = |seen: &std::collections::BTreeMap<String, String>| {
        revs.iter().filter(|(id, rev)| seen.get(*id) != Some(*rev)).count()
    };
    for since in ["0", before.as_str()] {
        let feed = e.get(&format!("/{DB}/_changes?since={since}")).await?.expect(200, "_changes")?;
        let mut seen = std::collections::BTreeMap::new();
        reported(feed.body["results"].as_array().map(Vec::as_slice).unwrap_or_default(), &mut seen);
        check(missing(&seen) == 0 && feed.body["pending"] == 0, || {
            format!("since={since}: {} of 60 writes missing, pending {}", missing(&seen), feed.body["pending"])
        })?;
    }
    // Paged with `limit`: `pending` says 0 only once all 60 have been reported.
    let (mut since, mut seen) = (before.clone(), std::collections::BTreeMap::new());
    for round in 0.. {
        let page = e.get(&format!("/{DB}/_changes?since={since}&limit=25")).await?.expect(200, "a page")?;
        reported(page.body["results"].as_array().map(Vec::as_slice).unwrap_or_default(), &mut seen);
        since = page.body["last_seq"].as_str().ok_or("last_seq is a string")?.to_owned();
        if page.body["pending"] == 0 {
            check(missing(&seen) == 0, || format!("pending 0 with {} of 60 writes unreported", missing(&seen)))?;
            break;
        }
        check(round < 20, || format!("no end of the feed after {round} pages of 25"))?;
    }
    Ok(())
}

/// Issue 22: one continuous `_changes` answer lists each write once, even while the writes settle
/// during it. On DynamoDB a write shows at once in the unsettled tail and comes again, in the
/// settled part of a later read, once its settle window (5 s by default) has passed; the answer
/// drops that repeat. So there the feed stays open past the window; elsewhere briefly.
pub(super) async fn continuous_changes_list_each_write_once(e: Endpoint) -> TestResult {
    let docs: Vec<Value> = (0..5).map(|i| doc("user_once", "feed", &format!("k{i}"), json!(i))).collect();
    e.post(&format!("/{DB}/_bulk_docs"), json!({ "docs": docs })).await?.expect(201, "seed")?;
    let timeout_ms = if e.backend == "dynamodb" { 7_000 } else { 500 };
    let url = e.url(&format!("/{DB}/_changes?feed=continuous&since=0&timeout={timeout_ms}"));
    let text = e.client.get(url).send().await?.text().await?;
    let lines: Vec<Value> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .map_err(|err| format!("continuous line: {err}: {text}"))?;
    let mine: Vec<&str> =
        lines.iter().filter_map(|line| line["id"].as_str()).filter(|id| id.starts_with("user_once:")).collect();
    let distinct: std::collections::BTreeSet<&str> = mine.iter().copied().collect();
    check(mine.len() == 5 && distinct.len() == 5, || format!("rows of the five writes: {mine:?}"))?;
    check(lines.last().is_some_and(|l| l["last_seq"].is_string()), || format!("the closing line: {text}"))
}
