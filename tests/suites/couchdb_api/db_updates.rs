//! `GET /_db_updates` (issue 37) on every backend, against what CouchDB 3.4.3 answered
//! (`fixtures/couchdb-3.4.3/070`–`083`): 404 before `_global_changes` exists, CouchDB's refusals
//! exactly (non-admin, no credentials, `POST`, bad `limit`, `feed`, `since`), and the feeds'
//! shapes (the answer's and the rows' fields, no `pending`, continuous lines, eventsource blocks,
//! descending order); a longpoll woken by a database created meanwhile; a continuous feed's
//! heartbeats while idle and its row for a later creation; and an event made through a second
//! instance over the same backend showing on the first.
//!
//! Event positions and the other databases' events differ from CouchDB's (the CouchDB backend's
//! server is shared by runs and trials), so rows are looked for by this trial's database names
//! and compared by their fields and types; errors are compared exactly.

use std::time::{Duration, Instant};

use super::logins::as_login;
use super::several_instances::{databases_shared, Face};
use super::*;

/// How long events wait before they are written (`couchdb_db_updates_flush_ms`).
const FLUSH_MS: u64 = 50;

/// Longest an event may take to show on a feed read again and again: the flush, then the write,
/// on a loaded test machine. The documented bound is the flush interval plus a feed's poll.
const SHOWS_WITHIN: Duration = Duration::from_secs(5);

pub(super) fn config() -> Result<String, Failed> {
    Ok(format!("couchdb_db_updates_flush_ms = {FLUSH_MS}\n{}", super::logins::logins_config()?))
}

async fn admin(e: &Endpoint, method: Method, path: &str) -> Result<Answer, Failed> {
    as_login(e, "admin", method, path, None).await
}

/// Makes `_global_changes` exist. On a fresh store `_db_updates` is CouchDB's 404 until then
/// (070); the CouchDB backend's server is shared by runs, where it may exist already.
async fn with_global_changes(e: &Endpoint) -> TestResult {
    let before = admin(e, Method::GET, "/_db_updates").await?;
    if before.status.as_u16() == 404 {
        same_error(&before, "070-db-updates-no-global-changes")?;
    } else {
        check(e.backend == "couchdb" && before.status.as_u16() == 200, || {
            format!(
                "_db_updates on a fresh {} store before _global_changes: {} {}",
                e.backend, before.status, before.body
            )
        })?;
    }
    let created = admin(e, Method::PUT, "/_global_changes").await?;
    check(matches!(created.status.as_u16(), 201 | 412), || {
        format!("PUT /_global_changes: {} {}", created.status, created.body)
    })
}

/// A database of its own for one trial, created by the admin: `dbupdates-{tag}-{random}` (the
/// CouchDB backend's server is shared by trials and runs).
async fn fresh_db(e: &Endpoint, prefix: &str, tag: &str) -> Result<String, Failed> {
    let mut random = [0u8; 6];
    getrandom::fill(&mut random).map_err(|err| err.to_string())?;
    let name = format!("{prefix}-{tag}-{}", hex::encode(random));
    admin(e, Method::PUT, &format!("/{name}")).await?.expect(201, "PUT a database")?;
    Ok(name)
}

async fn dropped_as_admin(e: &Endpoint, db: &str) -> TestResult {
    let answer = admin(e, Method::DELETE, &format!("/{db}")).await?;
    check(matches!(answer.status.as_u16(), 200 | 202 | 404), || {
        format!("DELETE /{db}: {} {}", answer.status, answer.body)
    })
}

/// `(db_name, type)` of a feed's rows.
fn events(rows: &Value) -> Vec<(String, String)> {
    rows.as_array()
        .into_iter()
        .flatten()
        .map(|row| {
            (
                row["db_name"].as_str().unwrap_or_default().to_owned(),
                row["type"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

fn missing<'a>(rows: &Value, wanted: &'a [(String, &'a str)]) -> Vec<&'a (String, &'a str)> {
    let seen = events(rows);
    wanted.iter().filter(|(db, kind)| !seen.iter().any(|(d, k)| d == db && k == kind)).collect()
}

fn encoded(text: &str) -> String {
    percent_encoding::utf8_percent_encode(text, percent_encoding::NON_ALPHANUMERIC).to_string()
}

/// Reads `face`'s normal feed after `since` until every `wanted` event is among its rows: the
/// answer, and how long it took.
async fn until_shown(face: Face<'_>, since: &str, wanted: &[(String, &str)]) -> Result<(Answer, Duration), Failed> {
    let started = Instant::now();
    loop {
        let path = format!("/_db_updates?since={}", encoded(since));
        let answer = Answer::read(
            face.request(Method::GET, &path).basic_auth("admin", Some(super::logins::PASSWORD)).send().await?,
        )
        .await?
        .expect(200, &face.says("GET /_db_updates"))?;
        let left = missing(&answer.body["results"], wanted);
        if left.is_empty() {
            return Ok((answer, started.elapsed()));
        }
        if started.elapsed() > SHOWS_WITHIN {
            return Err(format!("{}: {left:?} not shown within {SHOWS_WITHIN:?}: {}", face.name, answer.body).into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The field names of an object.
fn fields(value: &Value) -> std::collections::BTreeSet<String> {
    value.as_object().map(|m| m.keys().cloned().collect()).unwrap_or_default()
}

/// A feed's position now (`since=now`), as an answer with CouchDB's fields shows it (073).
async fn position_now(e: &Endpoint) -> Result<String, Failed> {
    let now = admin(e, Method::GET, "/_db_updates?since=now").await?.expect(200, "since=now")?;
    let recorded = couchdb_body("073-db-updates-since-now");
    check(fields(&now.body) == fields(&recorded), || {
        format!("since=now answered {} where CouchDB {recorded}", now.body)
    })?;
    // On the CouchDB backend the server, and its `_global_changes`, is shared by the trials
    // running at once: an event of theirs may land between `now` and the read.
    check(e.backend == "couchdb" || now.body["results"] == json!([]), || format!("since=now lists {}", now.body))?;
    now.body["last_seq"].as_str().map(str::to_owned).ok_or_else(|| format!("no last_seq in {}", now.body).into())
}

/// The refusals, the normal, limited, descending, continuous, eventsource and longpoll feeds.
pub(super) async fn db_updates_as_couchdb(e: Endpoint) -> TestResult {
    with_global_changes(&e).await?;
    same_error(&as_login(&e, "alice", Method::GET, "/_db_updates", None).await?, "081-db-updates-non-admin")?;
    same_error(&e.get("/_db_updates").await?, "082-db-updates-no-credentials")?;
    same_error(&as_login(&e, "admin", Method::POST, "/_db_updates", Some(json!({}))).await?, "083-db-updates-post")?;
    same_error(&admin(&e, Method::GET, "/_db_updates?limit=x").await?, "078-db-updates-bad-limit")?;
    same_error(&admin(&e, Method::GET, "/_db_updates?feed=bogus").await?, "079-db-updates-bad-feed")?;
    same_error(&admin(&e, Method::GET, "/_db_updates?since=garbage").await?, "080-db-updates-bad-since")?;

    let since = position_now(&e).await?;
    let kept = fresh_db(&e, "dbupdates", "kept").await?;
    as_login(&e, "admin", Method::PUT, &format!("/{kept}/doc1"), Some(json!({"a": 1})))
        .await?
        .expect(201, "PUT a document")?;
    let dropped = fresh_db(&e, "dbupdates", "dropped").await?;
    admin(&e, Method::DELETE, &format!("/{dropped}")).await?.expect(200, "DELETE a database")?;
    let wanted = [
        (kept.clone(), "created"),
        (kept.clone(), "updated"),
        (dropped.clone(), "created"),
        (dropped.clone(), "deleted"),
    ];
    let (normal, took) = until_shown(Face::of_endpoint(&e), &since, &wanted).await?;
    println!("{}: four events shown on the feed {took:?} after the last write", e.backend);

    // The answer's fields and each row's are CouchDB's exactly (no `pending`); values are strings.
    let recorded = couchdb_body("071-db-updates-normal");
    check(fields(&normal.body) == fields(&recorded), || format!("fields of {} vs CouchDB's {recorded}", normal.body))?;
    let row_fields = fields(&recorded["results"][0]);
    for row in normal.body["results"].as_array().into_iter().flatten() {
        check(fields(row) == row_fields && row_fields.iter().all(|f| row[f].is_string()), || {
            format!("row {row} where CouchDB's rows are {}", recorded["results"][0])
        })?;
    }
    let order = events(&normal.body["results"]);
    let at = |db: &str, kind: &str| order.iter().position(|(d, k)| d == db && k == kind);
    // Events of one flush are written in key order (`created:` before `deleted:`). Apache CouchDB
    // writes its own set in any order, so over it the order is not this server's to promise.
    let ordered = e.backend != "couchdb" || on_pouchdb_server(&e);
    check(!ordered || at(&dropped, "created") < at(&dropped, "deleted"), || {
        format!("a creation after its deletion: {order:?}")
    })?;
    check(
        normal.body["last_seq"]
            == normal.body["results"].as_array().and_then(|r| r.last()).map_or(Value::Null, |r| r["seq"].clone()),
        || format!("last_seq is not the last row's seq: {}", normal.body),
    )?;

    // limit=1: one row (072).
    let one = admin(&e, Method::GET, &format!("/_db_updates?limit=1&since={}", encoded(&since)))
        .await?
        .expect(200, "limit=1")?;
    check(one.body["results"].as_array().map(Vec::len) == Some(1), || format!("limit=1 answered {}", one.body))?;
    check(fields(&one.body) == fields(&couchdb_body("072-db-updates-limit")), || format!("limit=1: {}", one.body))?;

    // descending=true: newest first, `last_seq` the last row's (077).
    let newest_first = admin(&e, Method::GET, "/_db_updates?descending=true").await?.expect(200, "descending=true")?;
    let reversed = events(&newest_first.body["results"]);
    let at_reversed = |db: &str, kind: &str| reversed.iter().position(|(d, k)| d == db && k == kind);
    check(!ordered || at_reversed(&dropped, "deleted") < at_reversed(&dropped, "created"), || {
        format!("descending lists the creation first: {reversed:?}")
    })?;
    check(fields(&newest_first.body) == fields(&couchdb_body("077-db-updates-descending")), || {
        format!("descending: {}", newest_first.body)
    })?;

    continuous_and_eventsource(&e, &since, &wanted).await?;

    // A longpoll with nothing new answers at its timeout with no rows (074). Nothing new: on
    // DynamoDB `since=now` lists the last settle window's writes once more when they settle
    // (docs/document-model.md), so this trial's own events may come again, and on the shared
    // CouchDB server another trial's database may have made an event meanwhile.
    let now = position_now(&e).await?;
    let started = Instant::now();
    let idle = admin(&e, Method::GET, &format!("/_db_updates?feed=longpoll&timeout=300&since={}", encoded(&now)))
        .await?
        .expect(200, "idle longpoll")?;
    check(fields(&idle.body) == fields(&couchdb_body("074-db-updates-longpoll-timeout")), || {
        format!("idle longpoll: {}", idle.body)
    })?;
    let again = events(&idle.body["results"]);
    let only_earlier = again.iter().all(|(db, kind)| wanted.iter().any(|(d, k)| d == db && k == kind));
    let waited = idle.body["results"] == json!([]) && started.elapsed() >= Duration::from_millis(300);
    check(e.backend == "couchdb" || waited || (e.backend == "dynamodb" && only_earlier), || {
        format!("idle longpoll answered {} after {:?}", idle.body, started.elapsed())
    })?;
    dropped_as_admin(&e, &kept).await
}

/// `feed=continuous` lines and `feed=eventsource` blocks (075, 076).
async fn continuous_and_eventsource(e: &Endpoint, since: &str, wanted: &[(String, &str)]) -> TestResult {
    let path = format!("/_db_updates?feed=continuous&timeout=300&since={}", encoded(since));
    let text =
        e.client.get(e.url(&path)).basic_auth("admin", Some(super::logins::PASSWORD)).send().await?.text().await?;
    let lines: Vec<Value> =
        text.lines().filter(|l| !l.trim().is_empty()).map(serde_json::from_str).collect::<Result<_, _>>()?;
    let recorded = fixture("075-db-updates-continuous")["response"]["body"].as_str().unwrap_or_default().to_owned();
    let recorded: Vec<Value> =
        recorded.lines().filter(|l| !l.trim().is_empty()).map(serde_json::from_str).collect::<Result<_, _>>()?;
    let (Some(last), Some(couchdb_last)) = (lines.last(), recorded.last()) else {
        return Err(format!("continuous feed without lines: {text:?}").into());
    };
    check(fields(last) == fields(couchdb_last), || {
        format!("continuous ends with {last} where CouchDB {couchdb_last}")
    })?;
    let rows = Value::from(lines[..lines.len() - 1].to_vec());
    check(missing(&rows, wanted).is_empty(), || format!("continuous rows {rows} lack {wanted:?}"))?;
    for row in rows.as_array().into_iter().flatten() {
        check(fields(row) == fields(&recorded[0]), || format!("continuous row {row} vs CouchDB's {}", recorded[0]))?;
    }

    let path = format!("/_db_updates?feed=eventsource&timeout=300&limit=2&since={}", encoded(since));
    let sent = e.client.get(e.url(&path)).basic_auth("admin", Some(super::logins::PASSWORD)).send().await?;
    // The headers CouchDB sends an event stream with (076): its type, and not to be cached.
    let recorded_headers = fixture("076-db-updates-eventsource")["response"]["headers"].clone();
    for name in ["Content-Type", "Cache-Control"] {
        let ours = sent.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        check(ours.as_deref() == recorded_headers[name].as_str(), || {
            format!("eventsource {name}: {ours:?} where CouchDB sent {}", recorded_headers[name])
        })?;
    }
    let text = sent.text().await?;
    let recorded = fixture("076-db-updates-eventsource")["response"]["body"].as_str().unwrap_or_default().to_owned();
    let blocks = |text: &str| -> Result<Vec<(Value, Value)>, Failed> {
        text.split("\n\n")
            .filter(|block| !block.trim().is_empty())
            .map(|block| {
                let data = block.lines().find_map(|l| l.strip_prefix("data: ")).ok_or("a block without data")?;
                let id = block.lines().find_map(|l| l.strip_prefix("id: ")).ok_or("a block without id")?;
                Ok((serde_json::from_str(data)?, serde_json::from_str(id)?))
            })
            .collect()
    };
    let (ours, couchdb) = (blocks(&text)?, blocks(&recorded)?);
    check(ours.len() == 2, || format!("eventsource limit=2 sent {text:?}"))?;
    for (data, id) in &ours {
        // CouchDB 3.4.3 sends `_global_changes`' own rows there, the position again as a JSON
        // string on the `id:` line.
        check(fields(data) == fields(&couchdb[0].0) && id.is_string() && *id == data["seq"], || {
            format!("eventsource block {data} / {id} vs CouchDB's {} / {}", couchdb[0].0, couchdb[0].1)
        })?;
    }
    Ok(())
}

/// A longpoll started before a database is created answers with its `created` event. On the
/// CouchDB backend the server is shared by the trials running at once, whose events end a
/// longpoll too: there the next longpoll goes on from its `last_seq` until the event shows.
pub(super) async fn db_updates_longpoll_woken_by_a_create(e: Endpoint) -> TestResult {
    with_global_changes(&e).await?;
    let mut since = position_now(&e).await?;
    let longpoll = |since: &str| {
        let path = format!("/_db_updates?feed=longpoll&timeout=10000&since={}", encoded(since));
        let waiting = e.client.get(e.url(&path)).basic_auth("admin", Some(super::logins::PASSWORD)).send();
        tokio::spawn(async move { Answer::read(waiting.await?).await })
    };
    let mut waiting = longpoll(&since);
    tokio::time::sleep(Duration::from_millis(300)).await;
    check(e.backend == "couchdb" || !waiting.is_finished(), || {
        "the longpoll answered before anything happened".to_owned()
    })?;
    let created_at = Instant::now();
    let db = fresh_db(&e, "dbupdates", "woken").await?;
    let wanted = [(db.clone(), "created")];
    loop {
        let answer = waiting.await.map_err(|err| err.to_string())??.expect(200, "the longpoll")?;
        let took = created_at.elapsed();
        if missing(&answer.body["results"], &wanted).is_empty() {
            println!("{}: longpoll woken {took:?} after the creation", e.backend);
            break;
        }
        check(e.backend == "couchdb" && took < SHOWS_WITHIN, || {
            format!("the longpoll answered {} after {took:?} without {db}'s creation", answer.body)
        })?;
        since = answer.body["last_seq"].as_str().unwrap_or_default().to_owned();
        waiting = longpoll(&since);
    }
    check(created_at.elapsed() < SHOWS_WITHIN, || {
        format!("the longpoll answered {:?} after the creation", created_at.elapsed())
    })?;
    dropped_as_admin(&e, &db).await
}

/// A continuous feed with a heartbeat writes newlines while idle, then the row of a database
/// created later.
pub(super) async fn db_updates_continuous_heartbeat(e: Endpoint) -> TestResult {
    with_global_changes(&e).await?;
    let since = position_now(&e).await?;
    // The smallest heartbeat taken is `couchdb_changes_min_heartbeat_ms`, 1 s by default.
    let path = format!("/_db_updates?feed=continuous&heartbeat=1000&since={}", encoded(&since));
    let mut feed = e.client.get(e.url(&path)).basic_auth("admin", Some(super::logins::PASSWORD)).send().await?;
    check(feed.status().as_u16() == 200, || format!("continuous feed: {}", feed.status()))?;
    let mut text = String::new();
    let idle_until = Instant::now() + Duration::from_millis(3_200);
    while Instant::now() < idle_until {
        match tokio::time::timeout_at(idle_until.into(), feed.chunk()).await {
            Ok(Ok(Some(bytes))) => text.push_str(&String::from_utf8_lossy(&bytes)),
            Ok(Ok(None)) => return Err(format!("the feed ended while idle: {text:?}").into()),
            Ok(Err(err)) => return Err(err.into()),
            Err(_) => break,
        }
    }
    let heartbeats = text.matches('\n').count() - text.lines().filter(|l| !l.trim().is_empty()).count();
    check(heartbeats >= 2, || format!("{heartbeats} heartbeats in 3.2 s of a 1 s heartbeat: {text:?}"))?;
    let db = fresh_db(&e, "dbupdates", "beat").await?;
    let shown_by = Instant::now() + SHOWS_WITHIN;
    loop {
        let row_shown = text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .any(|row| row["db_name"] == json!(db) && row["type"] == json!("created"));
        if row_shown {
            break;
        }
        match tokio::time::timeout_at(shown_by.into(), feed.chunk()).await {
            Ok(Ok(Some(bytes))) => text.push_str(&String::from_utf8_lossy(&bytes)),
            other => return Err(format!("no row for {db}'s creation ({other:?}): {text:?}").into()),
        }
    }
    drop(feed);
    dropped_as_admin(&e, &db).await
}

/// A database created and written through a second instance shows on the first one's feed.
pub(super) async fn db_updates_across_instances(e: Endpoint) -> TestResult {
    if !databases_shared(&e) {
        return Ok(());
    }
    with_global_changes(&e).await?;
    let beside = e.beside_configured().await?;
    let (a, b) = (Face::of_endpoint(&e), Face::of_beside(&beside, "B"));
    let since = position_now(&e).await?;
    let mut random = [0u8; 6];
    getrandom::fill(&mut random).map_err(|err| err.to_string())?;
    let db = format!("dbupdates-beside-{}", hex::encode(random));
    let as_admin = |face: Face<'_>, method: Method, path: String| {
        face.request(method, &path).basic_auth("admin", Some(super::logins::PASSWORD))
    };
    Answer::read(as_admin(b, Method::PUT, format!("/{db}")).send().await?).await?.expect(201, "PUT on B")?;
    let written = as_admin(b, Method::PUT, format!("/{db}/doc")).json(&json!({"on": "B"}));
    Answer::read(written.send().await?).await?.expect(201, "a document written on B")?;
    let (_, took) = until_shown(a, &since, &[(db.clone(), "created"), (db.clone(), "updated")]).await?;
    println!("{}: B's events shown on A's feed {took:?} after B's write", e.backend);
    dropped_as_admin(&e, &db).await
}
