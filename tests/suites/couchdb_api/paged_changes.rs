//! A reader that pages through a database's `_changes` with `limit` and `since=last_seq`, one
//! request per page, while writes land (issue 35): each change (id, revision) comes once, and
//! every write's last revision comes. CouchDB 3.4.3 answers a page from the position its `since`
//! names, so a reader continuing from each `last_seq` reads every change once; on DynamoDB a
//! change shown at once in the unsettled tail came again when it settled, in a later request.

use std::collections::{BTreeMap, BTreeSet};

use super::*;

/// Documents written while the reader pages, and how many of them are then updated once: 26
/// changes of 20 documents, within one settle window, under the 32 documents' tail changes a
/// DynamoDB token remembers (`REMEMBERED_TAIL`; past it a change may come once more, by design).
const WRITTEN: usize = 20;
const UPDATED: usize = 6;

pub(super) async fn paged_changes_list_each_change_once(e: Endpoint) -> TestResult {
    let db = fresh_db_named(&e, "paged", "once").await?;
    let writer = write_while_read(&e, &db);
    let reader = read_pages_until_quiet(&e, &db, std::time::Instant::now());
    let (written, read) = tokio::join!(writer, reader);
    let (written, (rows, mut since)) = (written?, read?);
    // Past the writes, and (DynamoDB) past the settle window: whatever the feed hands over again
    // when its tail settles comes now.
    let mut rows = rows;
    let quiet_for = if e.backend == "dynamodb" { Duration::from_millis(6_500) } else { Duration::from_millis(300) };
    let until = std::time::Instant::now() + quiet_for;
    for round in 0.. {
        let pending;
        (since, pending) = read_page(&e, &db, &since, &mut rows).await?;
        if pending == 0 && std::time::Instant::now() >= until {
            break;
        }
        check(round < 500, || format!("no end of the feed after {round} pages"))?;
        if pending == 0 {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let mut seen = BTreeSet::new();
    let repeated: Vec<&(String, String)> = rows.iter().filter(|row| !seen.insert(*row)).collect();
    check(repeated.is_empty(), || format!("changes listed twice across pages: {repeated:?} (of {} rows)", rows.len()))?;
    let last_of: BTreeMap<&str, &str> = rows.iter().map(|(id, rev)| (id.as_str(), rev.as_str())).collect();
    let missing: Vec<_> = written.iter().filter(|(id, rev)| last_of.get(id.as_str()) != Some(&rev.as_str())).collect();
    check(missing.is_empty(), || format!("writes whose last revision never came: {missing:?}"))?;
    if e.backend == "dynamodb" {
        a_token_carries_at_most_the_remembered_tail(&e, &db, &since).await?;
    }
    Ok(())
}

/// The most tail marks a DynamoDB token carries (`REMEMBERED_TAIL`, 32 of 24 hex digits each):
/// a `since` with 32 is read, one with 33 is CouchDB's malformed-`since` 400.
async fn a_token_carries_at_most_the_remembered_tail(e: &Endpoint, db: &str, since: &str) -> TestResult {
    const REMEMBERED_TAIL: usize = 32;
    const MARK: &str = "0123456789abcdef01234567";
    let (rank, token) = since.split_once('-').ok_or_else(|| format!("a last_seq without N-: {since}"))?;
    let settled = token.split('~').next().unwrap_or(token);
    let with_marks = |count: usize| {
        let since = format!("{rank}-{settled}~{settled}~{}", MARK.repeat(count));
        let encoded = percent_encoding::utf8_percent_encode(&since, percent_encoding::NON_ALPHANUMERIC).to_string();
        format!("/{db}/_changes?limit=3&since={encoded}")
    };
    e.get(&with_marks(REMEMBERED_TAIL)).await?.expect(200, "a since with as many marks as a token keeps")?;
    let refused = e.get(&with_marks(REMEMBERED_TAIL + 1)).await?.expect(400, "a since with one mark too many")?;
    let malformed = json!({ "error": "bad_request", "reason": "Malformed sequence supplied in 'since' parameter." });
    check(refused.body == malformed, || format!("a since with one mark too many: {}", refused.body))
}

/// Writes [`WRITTEN`] documents one by one, then updates the first [`UPDATED`]; answers each
/// document's last revision.
async fn write_while_read(e: &Endpoint, db: &str) -> Result<BTreeMap<String, String>, Failed> {
    let mut revs = BTreeMap::new();
    for n in 0..WRITTEN {
        let id = format!("d{n:02}");
        let rev = e.put(&format!("/{db}/{id}"), json!({ "n": n })).await?.expect(201, "PUT")?.rev()?;
        revs.insert(id, rev);
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    for n in 0..UPDATED {
        let id = format!("d{n:02}");
        let body = json!({ "n": n, "_rev": revs[&id] });
        let rev = e.put(&format!("/{db}/{id}"), body).await?.expect(201, "PUT update")?.rev()?;
        revs.insert(id, rev);
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    Ok(revs)
}

/// Pages through the feed from `0` while the writer runs (about as long as it writes).
async fn read_pages_until_quiet(
    e: &Endpoint,
    db: &str,
    started: std::time::Instant,
) -> Result<(Vec<(String, String)>, String), Failed> {
    let mut rows = Vec::new();
    let mut since = "0".to_owned();
    let writing = Duration::from_millis(40 * (WRITTEN + UPDATED) as u64);
    while started.elapsed() < writing {
        since = read_page(e, db, &since, &mut rows).await?.0;
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    Ok((rows, since))
}

/// One request: `limit=3` from `since`; its rows are added to `rows`, its `last_seq` and
/// `pending` answered.
async fn read_page(
    e: &Endpoint,
    db: &str,
    since: &str,
    rows: &mut Vec<(String, String)>,
) -> Result<(String, u64), Failed> {
    let encoded = percent_encoding::utf8_percent_encode(since, percent_encoding::NON_ALPHANUMERIC);
    let page = e.get(&format!("/{db}/_changes?limit=3&since={encoded}")).await?.expect(200, "a page")?;
    for row in page.body["results"].as_array().cloned().unwrap_or_default() {
        let (Some(id), Some(rev)) = (row["id"].as_str(), row["changes"][0]["rev"].as_str()) else {
            return Err(format!("a row without id or rev: {row}").into());
        };
        rows.push((id.to_owned(), rev.to_owned()));
    }
    // A string on CouchDB 3 and here; a number on pouchdb-server (the CouchDB backend's server in
    // the suites), whose databases are passed to it as they come.
    let last_seq = match &page.body["last_seq"] {
        serde_json::Value::String(text) => text.clone(),
        serde_json::Value::Number(number) => number.to_string(),
        _ => return Err(format!("no last_seq: {}", page.body).into()),
    };
    let results = page.body["results"].as_array().map_or(0, Vec::len);
    let pending = match page.body.get("pending") {
        Some(pending) => pending.as_u64().ok_or_else(|| format!("pending is not a count: {}", page.body))?,
        // pouchdb-server gives none: a full page may have more after it.
        None if e.backend == "couchdb" => u64::from(results == 3),
        None => return Err(format!("no pending: {}", page.body).into()),
    };
    Ok((last_seq, pending))
}
