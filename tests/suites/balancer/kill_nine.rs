//! Losing an instance under load: [`WRITERS`] writers, a continuous `_changes` reader and a
//! PouchDB live pull run through the balancer; one instance is SIGKILLed mid-run; the run goes on
//! and stops. Then:
//! - every acknowledged write (201/202 with a rev) is the winning revision of its document or an
//!   ancestor of it: lost must be 0;
//! - the feed reader and the live pull end up at every document's final revision (both may
//!   reconnect);
//! - every 5xx a client saw came from HAProxy (not an instance), is a 502, 503 or 504, came
//!   within [`KILL_WINDOW`] of the kill, and its request was retried to success.
//!
//! The writers retry as an ordinary client does: a connection error or a 502/503/504 is sent
//! again, up to [`ATTEMPTS`] times, [`RETRY_AFTER`] apart; a 409 on a retried write means an
//! earlier attempt was applied though its answer was lost, which the writer confirms by reading
//! the document back (counted as "applied, unacknowledged"). Any other answer fails the trial.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libtest_mimic::Failed;
use serde_json::{json, Value};

use super::*;
use crate::common::balancer::{instance_index, BALANCER_ERROR_REASON, SERVED_BY};

/// Concurrent writers through the balancer.
const WRITERS: usize = 4;
/// How long the load runs before the kill, and after it.
const BEFORE_KILL: Duration = Duration::from_secs(4);
const AFTER_KILL: Duration = Duration::from_secs(5);
/// How often a writer sends one write, and how long apart.
const ATTEMPTS: usize = 6;
const RETRY_AFTER: Duration = Duration::from_millis(250);
/// How long the feed reader may take to reach every final revision after the writers stop.
const CATCH_UP: Duration = Duration::from_secs(30);
/// A 5xx from the balancer is the kill's when it comes this soon after it: the requests in flight
/// on the killed instance, and those sent to it before HAProxy's checks (`inter 1s fall 2`) mark
/// it DOWN and its connection attempts are redispatched.
const KILL_WINDOW: Duration = Duration::from_secs(5);
/// Statuses an ordinary client retries.
const RETRIED_STATUSES: [u16; 3] = [502, 503, 504];

/// A 5xx answer, or a failed connection, a client saw.
struct Fault {
    at: Instant,
    /// `None` for a connection error.
    status: Option<u16>,
    /// Whether HAProxy answered it rather than an instance ([`BALANCER_ERROR_REASON`]).
    from_balancer: bool,
    what: String,
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let source = if self.from_balancer { "from HAProxy" } else { "from an instance" };
        match self.status {
            Some(status) => write!(f, "{status} {source}: {}", self.what),
            None => write!(f, "connection error: {}", self.what),
        }
    }
}

/// What the clients saw, shared between them.
#[derive(Default)]
struct Tally {
    /// `(id, rev)` of every acknowledged write.
    acknowledged: Vec<(String, String)>,
    /// Writes applied though their answer was lost (confirmed by reading back after a 409).
    applied_unacknowledged: usize,
    faults: Vec<Fault>,
    failures: Vec<String>,
}

type Shared = Arc<Mutex<Tally>>;

fn lock(tally: &Shared) -> std::sync::MutexGuard<'_, Tally> {
    tally.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The trial: load, kill, load, stop, then the checks above; prints the counts.
pub(super) async fn kill_9_under_load(deployment: &mut Deployment, backend: &str) -> TestResult {
    let base = deployment.url();
    let client = reqwest::Client::builder().timeout(Duration::from_secs(30)).build()?;
    let tally: Shared = Arc::default();
    let live_sync =
        spawn_node_script("pouchdb-live-sync.js", &[("COUCH_URL", with_admin(&base)), ("COUCH_DB", DB.to_owned())])?;
    let feed = Arc::new(Mutex::new(FeedSeen::default()));
    let stop_feed = Arc::new(AtomicBool::new(false));
    let reader = tokio::spawn(read_feed(
        client.clone(),
        base.clone(),
        Arc::clone(&stop_feed),
        Arc::clone(&feed),
        Arc::clone(&tally),
    ));
    let stop_writers = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..WRITERS)
        .map(|n| {
            tokio::spawn(write_until_stopped(
                client.clone(),
                base.clone(),
                n,
                Arc::clone(&stop_writers),
                Arc::clone(&tally),
            ))
        })
        .collect();
    tokio::time::sleep(BEFORE_KILL).await;
    // The instance serving the continuous feed: the kill cuts a long-lived request, not only
    // short writes (the live pull's long poll may be on it or not).
    let victim = feed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).served_by;
    let victim = victim.ok_or("the continuous feed has not started before the kill")?;
    let killed_at = Instant::now();
    deployment.kill(victim)?;
    tokio::time::sleep(AFTER_KILL).await;
    stop_writers.store(true, Ordering::Relaxed);
    for writer in writers {
        writer.await?;
    }
    let finals = final_revisions(&client, &base, &tally).await?;
    let feed_caught_up = wait_for_feed(&feed, &finals).await;
    stop_feed.store(true, Ordering::Relaxed);
    reader.await?;
    let expected = serde_json::to_vec(&finals.iter().map(|(id, doc)| (id, &doc.rev)).collect::<BTreeMap<_, _>>())?;
    let live_sync =
        tokio::task::spawn_blocking(move || finish_node_script(live_sync, "pouchdb-live-sync.js", Some(&expected)))
            .await?;
    println!("balancer::kill_9_under_load::{backend}: killed instance {victim}");
    report(deployment, backend, killed_at, &tally, &finals, &feed, feed_caught_up, live_sync)
}

/// Prints the counts, then fails on any write lost, any fault not the kill's, any client that did
/// not catch up.
#[allow(clippy::too_many_arguments)]
fn report(
    deployment: &Deployment,
    backend: &str,
    killed_at: Instant,
    tally: &Shared,
    finals: &HashMap<String, Winner>,
    feed: &Arc<Mutex<FeedSeen>>,
    feed_caught_up: Result<(), String>,
    live_sync: Result<String, Failed>,
) -> TestResult {
    let tally = lock(tally);
    let feed = feed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let lost: Vec<&(String, String)> =
        tally.acknowledged.iter().filter(|(id, rev)| !finals.get(id).is_some_and(|doc| doc.holds(rev))).collect();
    let mut by_status = BTreeMap::<String, usize>::new();
    for fault in &tally.faults {
        let status = fault.status.map_or("connection error".to_owned(), |s| s.to_string());
        *by_status.entry(status).or_default() += 1;
    }
    println!(
        "balancer::kill_9_under_load::{backend}: {} writes acknowledged on {} documents, {} lost, {} applied \
         unacknowledged; faults seen by clients {by_status:?}; the feed reader reconnected {} times; {}",
        tally.acknowledged.len(),
        finals.len(),
        lost.len(),
        tally.applied_unacknowledged,
        feed.reconnects,
        live_sync
            .as_ref()
            .map(|out| out.trim().to_owned())
            .unwrap_or_else(|e| format!("live sync FAILED: {}", e.message().unwrap_or_default())),
    );
    for fault in &tally.faults {
        println!("  {:>5} ms after the kill: {fault}", fault.at.saturating_duration_since(killed_at).as_millis());
    }
    let by_balancer = balancer_5xx(deployment);
    println!("  every client's 5xx in HAProxy's log (PouchDB's too), by status: {by_balancer:?}");
    check(tally.failures.is_empty(), || format!("writes that failed: {:?}", tally.failures))?;
    check(lost.is_empty(), || format!("acknowledged writes lost: {lost:?}"))?;
    check(!tally.acknowledged.is_empty(), || "no write was acknowledged".to_owned())?;
    let not_the_kills: Vec<&Fault> =
        tally.faults.iter().filter(|fault| !caused_by_the_kill(fault, killed_at)).collect();
    check(not_the_kills.is_empty(), || {
        let listed: Vec<String> = not_the_kills.iter().map(|fault| fault.to_string()).collect();
        format!("faults a retry after the kill does not explain: {listed:?}")
    })?;
    let not_retriable: Vec<&u16> = by_balancer.keys().filter(|status| !RETRIED_STATUSES.contains(status)).collect();
    check(not_retriable.is_empty(), || format!("clients got 5xx no retry avoids: {by_balancer:?}"))?;
    feed_caught_up?;
    live_sync.map(|_| ())
}

/// Whether `fault` is one the kill explains: HAProxy's 502/503/504 or a cut connection, soon
/// after the kill.
fn caused_by_the_kill(fault: &Fault, killed_at: Instant) -> bool {
    let soon_after = fault.at >= killed_at && fault.at <= killed_at + KILL_WINDOW;
    let retriable = match fault.status {
        Some(status) => fault.from_balancer && RETRIED_STATUSES.contains(&status),
        None => true,
    };
    soon_after && retriable
}

/// HAProxy's log lines for 5xx answers (their termination state says why, e.g. `SH--`: the
/// server closed before its answer's headers).
/// Prints them, and answers how many 5xx HAProxy's log shows by status.
fn balancer_5xx(deployment: &Deployment) -> BTreeMap<u16, usize> {
    let log = std::fs::read_to_string(deployment.balancer_log()).unwrap_or_default();
    // A request that ended normally is logged with the termination state `----`.
    for line in log.lines().filter(|line| !line.contains(" ---- ")).take(20) {
        println!("  haproxy: {line}");
    }
    let mut by_status = BTreeMap::new();
    for line in log.lines() {
        // `option httplog`: the status follows the timers `TR/Tw/Tc/Tr/Ta`.
        let fields: Vec<&str> = line.split_whitespace().collect();
        let timers = fields
            .iter()
            .position(|field| field.split('/').count() == 5 && field.split('/').all(|n| n.parse::<i64>().is_ok()));
        let status = timers.and_then(|at| fields.get(at + 1)).and_then(|s| s.parse::<u16>().ok());
        if let Some(status) = status.filter(|status| *status >= 500) {
            *by_status.entry(status).or_default() += 1;
        }
    }
    by_status
}

// ---- the writers ----

/// Writer `n`: creates documents of its own user and updates every third step one it created,
/// until `stop`.
async fn write_until_stopped(client: reqwest::Client, base: String, n: usize, stop: Arc<AtomicBool>, tally: Shared) {
    let user = format!("writer{n}");
    let mut mine: Vec<(Value, String)> = Vec::new();
    let mut step = 0usize;
    while !stop.load(Ordering::Relaxed) {
        step += 1;
        let updated = (step.is_multiple_of(3) && !mine.is_empty()).then(|| (step / 3) % mine.len());
        let mut body = match updated {
            Some(index) => {
                let (doc, rev) = &mine[index];
                let mut doc = doc.clone();
                doc["_rev"] = json!(rev);
                doc
            }
            None => match document(&user, &format!("k{step}"), Value::Null) {
                Ok(doc) => doc,
                Err(e) => {
                    lock(&tally).failures.push(format!("{e:?}"));
                    return;
                }
            },
        };
        // The step tells this write from every other: how a retry recognises its own write.
        body["value"] = json!({ "writer": n, "step": step });
        match write(&client, &base, &body, &tally).await {
            Ok(rev) => {
                body.as_object_mut().map(|doc| doc.remove("_rev"));
                match updated {
                    Some(index) => mine[index] = (body, rev),
                    None => mine.push((body, rev)),
                }
            }
            Err(e) => {
                lock(&tally).failures.push(e);
                return;
            }
        }
    }
}

/// One `PUT` of `body`, retried as the module says; the revision it made.
async fn write(client: &reqwest::Client, base: &str, body: &Value, tally: &Shared) -> Result<String, String> {
    let id = body["_id"].as_str().unwrap_or_default().to_owned();
    let url = format!("{base}{}", document_path(&id));
    let mut retried = false;
    for attempt in 0..ATTEMPTS {
        if attempt > 0 {
            tokio::time::sleep(RETRY_AFTER).await;
        }
        let sent = client.put(&url).basic_auth(ADMIN, Some(PASSWORD)).json(body).send().await;
        let Some((status, text)) = answered(sent, &format!("PUT {id}"), tally).await else {
            retried = true;
            continue;
        };
        match status {
            201 | 202 => {
                let answer: Value = serde_json::from_str(&text).map_err(|e| format!("PUT {id}: {e}: {text}"))?;
                let rev = answer["rev"].as_str().ok_or(format!("PUT {id} answered {status} with no rev: {text}"))?;
                lock(tally).acknowledged.push((id, rev.to_owned()));
                return Ok(rev.to_owned());
            }
            status if RETRIED_STATUSES.contains(&status) => retried = true,
            409 if retried => return applied_earlier(client, &url, body, tally).await,
            _ => return Err(format!("PUT {id} answered {status}: {text:.300}")),
        }
    }
    Err(format!("PUT {id}: no answer but a retried fault in {ATTEMPTS} attempts"))
}

/// The status and body of an answer; `None`, after recording the fault, for a connection error
/// or any 5xx (the caller retries those it may).
async fn answered(sent: reqwest::Result<reqwest::Response>, what: &str, tally: &Shared) -> Option<(u16, String)> {
    let fault = |status: Option<u16>, text: &str| Fault {
        at: Instant::now(),
        status,
        from_balancer: text.contains(BALANCER_ERROR_REASON),
        what: format!("{what}: {}", text.lines().next().unwrap_or_default().chars().take(200).collect::<String>()),
    };
    let response = match sent {
        Ok(response) => response,
        Err(e) => {
            lock(tally).faults.push(fault(None, &error_chain(&e)));
            return None;
        }
    };
    let status = response.status().as_u16();
    match response.text().await {
        Ok(text) if status >= 500 => {
            lock(tally).faults.push(fault(Some(status), &text));
            RETRIED_STATUSES.contains(&status).then_some((status, text))
        }
        Ok(text) => Some((status, text)),
        Err(e) => {
            lock(tally).faults.push(fault(None, &error_chain(&e)));
            None
        }
    }
}

/// An error and its sources, `: `-separated (reqwest's own message names only the request).
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// After a 409 on a retried write: the document's revision when it holds this very write (an
/// earlier attempt was applied though its answer was lost).
async fn applied_earlier(client: &reqwest::Client, url: &str, body: &Value, tally: &Shared) -> Result<String, String> {
    for attempt in 0..ATTEMPTS {
        if attempt > 0 {
            tokio::time::sleep(RETRY_AFTER).await;
        }
        let sent = client.get(url).basic_auth(ADMIN, Some(PASSWORD)).send().await;
        let Some((status, text)) = answered(sent, &format!("GET {url}"), tally).await else { continue };
        if status != 200 {
            return Err(format!("GET {url} after a 409 answered {status}: {text:.300}"));
        }
        let stored: Value = serde_json::from_str(&text).map_err(|e| format!("GET {url}: {e}"))?;
        if stored["value"] != body["value"] {
            return Err(format!("409 on a retried PUT {url}, and the document holds another write: {text:.300}"));
        }
        lock(tally).applied_unacknowledged += 1;
        return stored["_rev"].as_str().map(str::to_owned).ok_or(format!("GET {url}: no _rev"));
    }
    Err(format!("GET {url}: no answer in {ATTEMPTS} attempts"))
}

// ---- the final state ----

/// A document's winning revision and its history.
struct Winner {
    rev: String,
    /// `_revisions`: the generation of `rev` and the hashes from it back.
    start: u64,
    ids: Vec<String>,
}

impl Winner {
    /// Whether `rev` is this revision or one of its ancestors.
    fn holds(&self, rev: &str) -> bool {
        let Some((generation, hash)) = rev.split_once('-') else { return false };
        let Ok(generation) = generation.parse::<u64>() else { return false };
        generation <= self.start
            && usize::try_from(self.start - generation).is_ok_and(|back| self.ids.get(back).is_some_and(|h| h == hash))
    }
}

/// Every acknowledged document's winning revision with its history, read through the balancer
/// (`_bulk_get?revs=true`, a hundred at a time).
async fn final_revisions(
    client: &reqwest::Client,
    base: &str,
    tally: &Shared,
) -> Result<HashMap<String, Winner>, Failed> {
    let mut ids: Vec<String> = lock(tally).acknowledged.iter().map(|(id, _)| id.clone()).collect();
    ids.sort();
    ids.dedup();
    let mut finals = HashMap::new();
    for chunk in ids.chunks(100) {
        let docs: Vec<Value> = chunk.iter().map(|id| json!({ "id": id })).collect();
        let response = client
            .post(format!("{base}/{DB}/_bulk_get?revs=true"))
            .basic_auth(ADMIN, Some(PASSWORD))
            .json(&json!({ "docs": docs }))
            .send()
            .await?;
        let status = response.status();
        let answer: Value = response.json().await?;
        check(status.as_u16() == 200, || format!("_bulk_get answered {status}: {answer}"))?;
        for result in answer["results"].as_array().into_iter().flatten() {
            let doc = &result["docs"][0]["ok"];
            let id = result["id"].as_str().unwrap_or_default().to_owned();
            let winner = Winner {
                rev: doc["_rev"].as_str().ok_or_else(|| format!("_bulk_get: no {id}: {result}"))?.to_owned(),
                start: doc["_revisions"]["start"].as_u64().unwrap_or_default(),
                ids: doc["_revisions"]["ids"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|h| h.as_str().map(str::to_owned))
                    .collect(),
            };
            finals.insert(id, winner);
        }
    }
    Ok(finals)
}

// ---- the continuous feed ----

/// What the continuous `_changes` reader saw.
#[derive(Default)]
struct FeedSeen {
    /// The last revision listed for each document.
    revs: HashMap<String, String>,
    /// Where to resume: the last `seq` (or `last_seq`) read.
    since: Option<String>,
    reconnects: usize,
    /// The instance serving the feed now (HAProxy's [`SERVED_BY`] header).
    served_by: Option<usize>,
}

/// Reads `_changes?feed=continuous` through the balancer until `stop`, resuming from the last
/// sequence read whenever the feed ends or breaks.
async fn read_feed(
    client: reqwest::Client,
    base: String,
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<FeedSeen>>,
    tally: Shared,
) {
    let seen_lock = || seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    while !stop.load(Ordering::Relaxed) {
        let since = seen_lock().since.clone().unwrap_or_else(|| "0".to_owned());
        let since = percent_encoding::utf8_percent_encode(&since, percent_encoding::NON_ALPHANUMERIC);
        let url = format!("{base}/{DB}/_changes?feed=continuous&heartbeat=1000&since={since}");
        // No client timeout here: the feed is meant to stay open.
        let sent = client.get(&url).basic_auth(ADMIN, Some(PASSWORD)).timeout(Duration::from_secs(3600)).send().await;
        match sent {
            Ok(response) if response.status().as_u16() == 200 => {
                let served_by = response.headers().get(SERVED_BY).and_then(|v| v.to_str().ok());
                seen_lock().served_by = served_by.and_then(instance_index);
                follow(response, &stop, &seen).await
            }
            other => {
                answered(other, "GET _changes?feed=continuous", &tally).await;
            }
        }
        if stop.load(Ordering::Relaxed) {
            break;
        }
        seen_lock().reconnects += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Reads one continuous feed's lines into `seen` until it ends, breaks or `stop`.
async fn follow(mut response: reqwest::Response, stop: &AtomicBool, seen: &Mutex<FeedSeen>) {
    let mut pending = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        // Heartbeats come every second; waking up every two checks `stop` even if none does.
        let chunk = match tokio::time::timeout(Duration::from_secs(2), response.chunk()).await {
            Err(_) => continue,
            Ok(Ok(Some(chunk))) => chunk,
            Ok(_) => return,
        };
        pending.extend_from_slice(&chunk);
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let Ok(row) = serde_json::from_slice::<Value>(&line) else { continue };
            let mut seen = seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let sequence = row.get("seq").or_else(|| row.get("last_seq"));
            if let Some(sequence) = sequence {
                seen.since = Some(sequence.as_str().map_or_else(|| sequence.to_string(), str::to_owned));
            }
            if let (Some(id), Some(rev)) = (row["id"].as_str(), row["changes"][0]["rev"].as_str()) {
                seen.revs.insert(id.to_owned(), rev.to_owned());
            }
        }
    }
}

/// Waits until the feed reader has listed every document at its final revision.
async fn wait_for_feed(seen: &Mutex<FeedSeen>, finals: &HashMap<String, Winner>) -> Result<(), String> {
    let deadline = Instant::now() + CATCH_UP;
    loop {
        let behind: Vec<String> = {
            let seen = seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            finals.iter().filter(|(id, doc)| seen.revs.get(*id) != Some(&doc.rev)).map(|(id, _)| id.clone()).collect()
        };
        if behind.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the continuous feed reader is behind on {} of {} documents after {CATCH_UP:?}, e.g. {:?}",
                behind.len(),
                finals.len(),
                &behind[..behind.len().min(5)]
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
