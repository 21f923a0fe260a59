//! A database deleted while requests use it (issue 35): a live `_changes` with `filter=_view`,
//! writers posting documents and `_bulk_docs`, and view queries building the index, all running
//! when `DELETE /{db}` comes. CouchDB answers a missing database 404 `not_found` "Database does
//! not exist." on every route (checked against CouchDB 3.4.3 with curl: GET, PUT and DELETE of a
//! document, `_changes` with and without a filter, `_bulk_docs`, a view, DELETE and POST of the
//! database), never a 5xx, and never a 201 whose rows say the database is missing (PouchDB's
//! `db.post` turns such a row into an error with status 500). Creating it again is 201, then 412
//! `file_exists`. A live feed ends at the deletion with its ordinary closing, no error row (also
//! checked with curl), even when a database of the same name is created again at once.

use futures::StreamExt;

use super::*;

/// CouchDB's answer for a database that does not exist.
fn missing_database() -> Value {
    json!({"error": "not_found", "reason": "Database does not exist."})
}

/// One request a racing loop sends, and what it answered.
struct Sent {
    what: &'static str,
    status: u16,
    body: Value,
}

/// Sends `request` until the database is reported missing (or 400 times), keeping every answer.
async fn until_missing(
    client: reqwest::Client,
    what: &'static str,
    request: impl Fn(&reqwest::Client, u32) -> reqwest::RequestBuilder,
) -> Vec<Sent> {
    let mut sent = Vec::new();
    for n in 0..400 {
        let (status, body) = match request(&client, n).send().await {
            Ok(answer) => {
                let status = answer.status().as_u16();
                let text = answer.text().await.unwrap_or_default();
                (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
            }
            Err(err) => (0, Value::String(err.to_string())),
        };
        let gone = status == 404;
        sent.push(Sent { what, status, body });
        if gone {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    sent
}

/// Every answer a racing loop got is a success or CouchDB's missing-database 404, a `_bulk_docs`
/// success holds no row saying the database is missing, and the loop ended on the 404.
fn raced_answers_are_couchdbs(sent: &[Sent]) -> TestResult {
    for answer in sent {
        let missing_row = answer.body.as_array().is_some_and(|rows| rows.iter().any(|row| row.get("error").is_some()));
        let fine = match answer.status {
            200 | 201 => !missing_row,
            404 => answer.body == missing_database(),
            _ => false,
        };
        check(fine, || format!("{}: {} {}", answer.what, answer.status, answer.body))?;
    }
    let last = sent.last().map(|answer| answer.status);
    check(last == Some(404), || format!("{}: never saw the database missing ({last:?})", sent[0].what))
}

pub(super) async fn a_deleted_database_is_404_everywhere(e: Endpoint) -> TestResult {
    if e.backend == "couchdb" {
        println!("on the CouchDB backend a database is the backend server's, its answers forwarded");
        return Ok(());
    }
    let db = fresh_db_named(&e, "gone", "raced").await?;
    let design = json!({"views": {"by_n": {"map": "function (doc) { if (doc.n !== undefined) emit(doc.n, null); }"}}});
    e.put(&format!("/{db}/_design/app"), design).await?.expect(201, "design document")?;
    e.post(&format!("/{db}"), json!({"n": -1})).await?.expect(201, "first document")?;
    let feed = e
        .client
        .get(e.url(&format!("/{db}/_changes?feed=continuous&filter=_view&view=app/by_n&heartbeat=500&timeout=20000")))
        .send()
        .await
        .map_err(|err| Failed::from(format!("open the feed: {err}")))?;
    check(feed.status().as_u16() == 200, || format!("the filtered feed opens: {}", feed.status()))?;
    let mut feed = feed.bytes_stream();
    let url = e.url(&format!("/{db}"));
    let loops = [
        tokio::spawn(until_missing(e.client.clone(), "POST /db", {
            let url = url.clone();
            move |client, n| client.post(&url).json(&json!({ "n": n }))
        })),
        tokio::spawn(until_missing(e.client.clone(), "_bulk_docs", {
            let url = format!("{url}/_bulk_docs");
            move |client, n| {
                let docs: Vec<Value> = (0..10).map(|k| json!({ "n": n * 10 + k })).collect();
                client.post(&url).json(&json!({ "docs": docs }))
            }
        })),
        tokio::spawn(until_missing(e.client.clone(), "view query", {
            let url = format!("{url}/_design/app/_view/by_n?limit=1");
            move |client, _| client.get(&url)
        })),
    ];
    tokio::time::sleep(Duration::from_millis(300)).await;
    e.delete(&format!("/{db}")).await?.expect(200, "DELETE the database while it is used")?;
    for racing in loops {
        let sent = racing.await.map_err(|err| Failed::from(format!("a racing loop: {err}")))?;
        raced_answers_are_couchdbs(&sent)?;
    }
    let mut text = String::new();
    let ended = tokio::time::timeout(Duration::from_secs(15), async {
        while let Some(Ok(bytes)) = feed.next().await {
            text.push_str(&String::from_utf8_lossy(&bytes));
        }
    })
    .await;
    check(ended.is_ok(), || format!("the filtered feed did not end after the delete: {text}"))?;
    let last = text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or_default().to_owned();
    check(closes_a_deleted_feed(&last), || format!("the feed's last line is CouchDB's closing: {last:?}"))?;
    every_route_answers_missing(&e, &db).await?;
    e.call(Method::PUT, &format!("/{db}"), None).await?.expect(201, "created again")?;
    let twice = e.call(Method::PUT, &format!("/{db}"), None).await?.expect(412, "created twice")?;
    check(twice.body["error"] == "file_exists", || format!("PUT of an existing database: {}", twice.body))?;
    e.delete(&format!("/{db}")).await?.expect(200, "DELETE again")?;
    Ok(())
}

/// Whether `line` is how CouchDB 3.4.3 ends a continuous feed whose database was deleted under
/// it (checked with curl): its ordinary closing, `last_seq` where the feed was and `pending` 0,
/// no error row.
pub(super) fn closes_a_deleted_feed(line: &str) -> bool {
    let closing = serde_json::from_str::<Value>(line).unwrap_or_default();
    closing.get("last_seq").is_some() && closing["pending"] == 0 && closing.get("error").is_none()
}

/// After the delete every request on the database is CouchDB's 404, exactly.
async fn every_route_answers_missing(e: &Endpoint, db: &str) -> TestResult {
    let requests: [(Method, String, Option<Value>); 9] = [
        (Method::GET, format!("/{db}"), None),
        (Method::PUT, format!("/{db}/doc"), Some(json!({"n": 1}))),
        (Method::DELETE, format!("/{db}/doc?rev=1-0123456789abcdef0123456789abcdef"), None),
        (Method::GET, format!("/{db}/_changes"), None),
        (Method::GET, format!("/{db}/_changes?feed=longpoll&filter=_view&view=app/by_n"), None),
        (Method::POST, format!("/{db}/_bulk_docs"), Some(json!({"docs": [{"n": 1}]}))),
        (Method::GET, format!("/{db}/_design/app/_view/by_n"), None),
        (Method::POST, format!("/{db}"), Some(json!({"n": 1}))),
        (Method::DELETE, format!("/{db}"), None),
    ];
    for (method, path, body) in requests {
        let what = format!("{method} {path} after the delete");
        let answer = e.call(method, &path, body).await?.expect(404, &what)?;
        check(answer.body == missing_database(), || format!("{what}: {}", answer.body))?;
    }
    Ok(())
}

/// Plain `_changes` readers racing a deletion at once.
const RACING_READERS: usize = 4;

/// Reads a feed's body to its end, or to `within`: its text, and whether the body ended cleanly
/// (`None`: it was still open; `Some(false)`: the connection broke off mid-body).
async fn feed_text(answer: reqwest::Response, within: Duration) -> (String, Option<bool>) {
    let mut body = answer.bytes_stream();
    let mut text = String::new();
    let ended = tokio::time::timeout(within, async {
        while let Some(chunk) = body.next().await {
            match chunk {
                Ok(bytes) => text.push_str(&String::from_utf8_lossy(&bytes)),
                Err(_) => return false,
            }
        }
        true
    })
    .await;
    (text, ended.ok())
}

/// Live feeds on a database deleted and at once created again (PouchDB's tests drop and re-make
/// the same names while a live replication still polls them), and plain `_changes` reads racing
/// the deletion. CouchDB 3.4.3 (checked with curl) ends a longpoll or continuous feed the moment
/// its database is deleted, with its ordinary closing (`{"results":[],"last_seq":…,"pending":0}`
/// for longpoll, a `{"last_seq":…,"pending":0}` line for continuous), and answers a read that
/// comes after the deletion 404 `not_found`; nothing is ever a 5xx, whatever the new database of
/// the same name holds.
pub(super) async fn a_feed_under_a_deletion_ends_never_500(e: Endpoint) -> TestResult {
    if e.backend == "couchdb" {
        println!("on the CouchDB backend a database is the backend server's, its answers forwarded");
        return Ok(());
    }
    let db = fresh_db_named(&e, "gone", "feeds").await?;
    e.post(&format!("/{db}"), json!({"n": 0})).await?.expect(201, "first document")?;
    let open = |query: &'static str| {
        let url = e.url(&format!("/{db}/_changes?{query}"));
        let client = e.client.clone();
        async move {
            let answer = client.get(&url).send().await.map_err(|err| Failed::from(format!("{query}: {err}")))?;
            check(answer.status().as_u16() == 200, || format!("{query} opens: {}", answer.status()))?;
            Ok::<_, Failed>(answer)
        }
    };
    let longpoll = open("feed=longpoll&since=now&timeout=30000").await?;
    let continuous = open("feed=continuous&since=now&timeout=30000").await?;
    // A few readers at once, so that some read is under way when the table goes.
    let reads: Vec<_> = (0..RACING_READERS)
        .map(|_| {
            tokio::spawn(until_missing(e.client.clone(), "GET _changes", {
                let url = e.url(&format!("/{db}/_changes?since=0&style=all_docs"));
                move |client, _| client.get(&url)
            }))
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    e.delete(&format!("/{db}")).await?.expect(200, "DELETE the database under its feeds")?;
    e.call(Method::PUT, &format!("/{db}"), None).await?.expect(201, "created again at once")?;
    let mut wrong = Vec::new();
    for racing in reads {
        let sent = racing.await.map_err(|err| Failed::from(format!("the racing reads: {err}")))?;
        wrong.extend(sent.into_iter().filter(|answer| match answer.status {
            200 => answer.body.get("results").is_none() || answer.body.get("error").is_some(),
            404 => answer.body != missing_database(),
            _ => true,
        }));
    }
    check(wrong.is_empty(), || {
        let wrong: Vec<String> = wrong.iter().map(|a| format!("{}: {} {}", a.what, a.status, a.body)).collect();
        format!("reads racing the deletion answered {} times not as CouchDB:\n{}", wrong.len(), wrong.join("\n"))
    })?;
    let within = Duration::from_secs(10);
    let ((longpoll, longpoll_ended), (continuous, continuous_ended)) =
        tokio::join!(feed_text(longpoll, within), feed_text(continuous, within));
    for (what, text, ended) in [("longpoll", &longpoll, longpoll_ended), ("continuous", &continuous, continuous_ended)]
    {
        check(ended == Some(true), || format!("the {what} feed ends at the deletion, whole ({ended:?}): {text:?}"))?;
    }
    let closing: Value =
        serde_json::from_str(longpoll.trim()).map_err(|err| format!("longpoll {longpoll:?}: {err}"))?;
    check(closing["results"] == json!([]) && closing["pending"] == 0 && closing.get("error").is_none(), || {
        format!("the longpoll feed closes as CouchDB's: {closing}")
    })?;
    let last = continuous.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or_default();
    check(closes_a_deleted_feed(last), || format!("the continuous feed's last line is CouchDB's closing: {last:?}"))?;
    e.delete(&format!("/{db}")).await?.expect(200, "DELETE the new database")?;
    Ok(())
}
