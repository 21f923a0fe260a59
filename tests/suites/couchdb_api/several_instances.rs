//! Several CouchDB faces over one backend answer as one CouchDB (issue 36): a database deleted
//! and created again through one is missing, then new, on the other at once (the open-database
//! cache asks the backend); a purge and a re-creation through one reach the other's views and
//! Mango indexes; a `last_seq` of one continues on the other, and the other's `longpoll` and
//! `continuous` feeds wake up for a write made through the first within the polling bound; a
//! `_local` checkpoint written through one is read on the other at once.
//!
//! Not on the embedded store's databases: a database's redb file is opened by one process, so
//! several instances over an embedded store are not a deployment (the data-store database's trials
//! still run there, both faces over one backend handle).

use super::*;

/// CouchDB's answer for a database that does not exist (CouchDB 3.4.3, checked with curl: GET of
/// the database and of a document in it alike).
fn missing_database() -> Value {
    json!({"error": "not_found", "reason": "Database does not exist."})
}

/// One server's address and client, the trial's own endpoint or one beside it.
#[derive(Clone, Copy)]
pub(super) struct Face<'a> {
    pub(super) name: &'static str,
    root: &'a str,
    client: &'a reqwest::Client,
}

impl<'a> Face<'a> {
    pub(super) fn of_endpoint(e: &'a Endpoint) -> Self {
        Face { name: "A", root: &e.root, client: &e.client }
    }

    pub(super) fn of_beside(b: &'a Beside, name: &'static str) -> Self {
        Face { name, root: &b.root, client: &b.client }
    }

    pub(super) fn request(&self, method: Method, path: &str) -> reqwest::RequestBuilder {
        self.client.request(method, format!("{}{path}", self.root)).header("Accept", "application/json")
    }

    pub(super) async fn call(&self, method: Method, path: &str, body: Option<Value>) -> Result<Answer, Failed> {
        let mut request = self.request(method, path);
        if let Some(body) = body {
            request = request.json(&body);
        }
        Answer::read(request.send().await?).await
    }

    pub(super) async fn get(&self, path: &str) -> Result<Answer, Failed> {
        self.call(Method::GET, path, None).await
    }

    pub(super) async fn put(&self, path: &str, body: Value) -> Result<Answer, Failed> {
        self.call(Method::PUT, path, Some(body)).await
    }

    pub(super) async fn post(&self, path: &str, body: Value) -> Result<Answer, Failed> {
        self.call(Method::POST, path, Some(body)).await
    }

    /// `what` on this face, for messages.
    pub(super) fn says(&self, what: &str) -> String {
        format!("{what} on {}", self.name)
    }
}

/// Whether the trial's backend keeps databases several instances can share (all but the embedded
/// store, whose database files one process opens).
pub(super) fn databases_shared(e: &Endpoint) -> bool {
    if e.backend == "embedded" {
        println!("the embedded store's database files are opened by one process: no second instance shares them");
        return false;
    }
    true
}

/// The ids of a listing's rows (`_all_docs`, `_changes`, a view).
pub(super) fn row_ids(body: &Value, list: &str) -> Vec<String> {
    body[list].as_array().into_iter().flatten().filter_map(|row| row["id"].as_str().map(str::to_owned)).collect()
}

/// A holds a database open; B deletes it: A answers 404 for it and its documents at once. B
/// creates it again and writes: A never shows the old database's documents, shows the new one's,
/// and A's write lands in the new database (read back through B).
pub(super) async fn deleted_and_created_again_on_another_instance(e: Endpoint) -> TestResult {
    if !databases_shared(&e) {
        return Ok(());
    }
    let beside = e.beside_configured().await?;
    let (a, b) = (Face::of_endpoint(&e), Face::of_beside(&beside, "B"));
    let db = fresh_db_named(&e, "instances", "recreated").await?;
    a.put(&format!("/{db}/old"), json!({"v": "old"})).await?.expect(201, &a.says("PUT old"))?;
    a.get(&format!("/{db}/old")).await?.expect(200, &a.says("GET old"))?;
    a.get(&format!("/{db}")).await?.expect(200, &a.says("GET the database"))?;
    b.call(Method::DELETE, &format!("/{db}"), None).await?.expect(200, &b.says("DELETE the database"))?;
    for path in [format!("/{db}"), format!("/{db}/old"), format!("/{db}/_all_docs")] {
        let answer = a.get(&path).await?.expect(404, &a.says(&format!("GET {path} after B deleted it")))?;
        check(answer.body == missing_database(), || format!("GET {path} on A: {}", answer.body))?;
    }
    b.call(Method::PUT, &format!("/{db}"), None).await?.expect(201, &b.says("PUT the database again"))?;
    b.put(&format!("/{db}/new"), json!({"v": "new"})).await?.expect(201, &b.says("PUT new"))?;
    let old = a.get(&format!("/{db}/old")).await?.expect(404, &a.says("GET old in the new database"))?;
    check(old.body["reason"] == json!("missing"), || format!("old on A: {}", old.body))?;
    a.get(&format!("/{db}/new")).await?.expect(200, &a.says("GET new"))?;
    a.put(&format!("/{db}/from-a"), json!({"v": "a"})).await?.expect(201, &a.says("PUT from-a"))?;
    b.get(&format!("/{db}/from-a")).await?.expect(200, &b.says("GET from-a"))?;
    for face in [a, b] {
        let listed = face.get(&format!("/{db}/_all_docs")).await?.expect(200, &face.says("_all_docs"))?;
        let ids = row_ids(&listed.body, "rows");
        check(ids == ["from-a", "new"], || format!("{}: {ids:?}", face.says("_all_docs")))?;
        let info = face.get(&format!("/{db}")).await?.expect(200, &face.says("GET the database"))?;
        check(info.body["doc_count"] == json!(2), || format!("{}: {}", face.says("the database's info"), info.body))?;
    }
    Ok(())
}

/// The databases a trial runs on: the data-store database on every backend, and a database of
/// its own where several instances can share one ([`databases_shared`]).
pub(super) async fn trial_databases(e: &Endpoint, tag: &str) -> Result<Vec<String>, Failed> {
    let mut databases = vec![DB.to_owned()];
    if databases_shared(e) {
        databases.push(fresh_db_named(e, "instances", tag).await?);
    }
    Ok(databases)
}

/// Document `n` of a trial, a valid data-store document (so it is one on every database).
pub(super) fn numbered(namespace: &str, n: usize) -> Value {
    doc("u", namespace, &format!("k{n}"), json!(n))
}

pub(super) fn id_of(document: &Value) -> String {
    document["_id"].as_str().unwrap_or_default().to_owned()
}

/// `docs` written through `face` with `_bulk_docs`; their revisions, in order.
pub(super) async fn bulk_written(face: Face<'_>, db: &str, docs: Vec<Value>) -> Result<Vec<String>, Failed> {
    let answer = face.post(&format!("/{db}/_bulk_docs"), json!({ "docs": docs })).await?;
    let answer = answer.expect(201, &face.says("_bulk_docs"))?;
    let revs: Vec<String> =
        answer.body.as_array().into_iter().flatten().filter_map(|row| row["rev"].as_str().map(str::to_owned)).collect();
    check(revs.len() == docs.len(), || format!("{}: {}", face.says("_bulk_docs"), answer.body))?;
    Ok(revs)
}

/// The view `_design/v/_view/by_value` and the `_find` served by the JSON index on `value`.
const VIEW: &str = "_design/v/_view/by_value";

async fn view_and_index_made(face: Face<'_>, db: &str) -> TestResult {
    let design = json!({ "views": { "by_value": { "map": "function (doc) { emit(doc.value, null); }" } } });
    face.put(&format!("/{db}/_design/v"), design).await?.expect(201, &face.says("the design document"))?;
    let index = json!({ "index": { "fields": ["value"] }, "name": "by-value", "ddoc": "by-value", "type": "json" });
    face.post(&format!("/{db}/_index"), index).await?.expect(200, &face.says("POST _index"))?;
    Ok(())
}

/// The ids the view lists and the ids the index's `_find` answers, on `face`.
async fn view_and_find_ids(face: Face<'_>, db: &str) -> Result<(Vec<String>, Vec<String>), Failed> {
    let view = face.get(&format!("/{db}/{VIEW}")).await?.expect(200, &face.says("the view"))?;
    let find = json!({ "selector": { "value": { "$gte": 0 } }, "use_index": "by-value", "sort": [{ "value": "asc" }] });
    let found = face.post(&format!("/{db}/_find"), find).await?.expect(200, &face.says("_find"))?;
    let found_ids =
        found.body["docs"].as_array().into_iter().flatten().filter_map(|d| d["_id"].as_str().map(str::to_owned));
    Ok((row_ids(&view.body, "rows"), found_ids.collect()))
}

/// Both faces list exactly `ids` in their view and their `_find`.
async fn both_list(faces: [Face<'_>; 2], db: &str, ids: &[String], when: &str) -> TestResult {
    for face in faces {
        let (view, found) = view_and_find_ids(face, db).await?;
        check(view == ids && found == ids, || {
            format!("{} {when}: view {view:?}, _find {found:?}, wanted {ids:?}", face.says(db))
        })?;
    }
    Ok(())
}

/// Both instances build the view and the JSON index; a purge through A reaches B's (and A's)
/// view and `_find` at once. A database deleted and created again through A: B's view and
/// `_find` answer from the new database only.
pub(super) async fn purge_and_re_creation_reach_every_instance(e: Endpoint) -> TestResult {
    let beside = e.beside_configured().await?;
    let (a, b) = (Face::of_endpoint(&e), Face::of_beside(&beside, "B"));
    for db in trial_databases(&e, "purged").await? {
        view_and_index_made(a, &db).await?;
        let docs: Vec<Value> = (0..3).map(|n| numbered("purged", n)).collect();
        let revs = bulk_written(a, &db, docs.clone()).await?;
        let ids: Vec<String> = docs.iter().map(id_of).collect();
        both_list([a, b], &db, &ids, "before the purge").await?;
        if let Some(why) = &e._ctx.no_purge {
            println!("purge not checked on {}: {why}", e.backend);
        } else {
            let purge = json!({ ids[1].clone(): [revs[1].clone()] });
            a.post(&format!("/{db}/_purge"), purge).await?.expect(201, &a.says("_purge"))?;
            let kept = [ids[0].clone(), ids[2].clone()];
            both_list([b, a], &db, &kept, "after A's purge").await?;
        }
        if db == DB {
            continue;
        }
        a.call(Method::DELETE, &format!("/{db}"), None).await?.expect(200, &a.says("DELETE the database"))?;
        a.call(Method::PUT, &format!("/{db}"), None).await?.expect(201, &a.says("PUT the database again"))?;
        view_and_index_made(a, &db).await?;
        let fresh = numbered("purged", 7);
        bulk_written(a, &db, vec![fresh.clone()]).await?;
        both_list([b, a], &db, &[id_of(&fresh)], "after the database was created again").await?;
    }
    Ok(())
}

/// How long a feed on one instance may take to show a write made through another: an idle feed
/// polls the backend at least once a second (`POLL_CEILING` of `src/couchdb_api/changes.rs`),
/// plus the trial's own slack for a loaded machine.
const FEED_WAKE_BOUND: Duration = Duration::from_secs(4);

/// A `last_seq` of A given to B as `since` continues exactly; B's `longpoll` and `continuous`
/// feeds wake up for a write made through A within [`FEED_WAKE_BOUND`]; a `_local` checkpoint
/// written through A reads on B at once, as do its update and deletion.
pub(super) async fn feeds_and_checkpoints_across_instances(e: Endpoint) -> TestResult {
    let beside = e.beside_configured().await?;
    let (a, b) = (Face::of_endpoint(&e), Face::of_beside(&beside, "B"));
    for db in trial_databases(&e, "feeds").await? {
        let first: Vec<Value> = (0..3).map(|n| numbered("feeds", n)).collect();
        bulk_written(a, &db, first).await?;
        let on_a = a.get(&format!("/{db}/_changes")).await?.expect(200, &a.says("_changes"))?;
        let since = on_a.body["last_seq"].clone();
        let more: Vec<Value> = (3..5).map(|n| numbered("feeds", n)).collect();
        bulk_written(a, &db, more.clone()).await?;
        let since_text = since.as_str().map_or_else(|| since.to_string(), str::to_owned);
        let query = percent_encoding::utf8_percent_encode(&since_text, percent_encoding::NON_ALPHANUMERIC);
        let on_b = b.get(&format!("/{db}/_changes?since={query}")).await?.expect(200, &b.says("_changes since"))?;
        // As sets: Apache CouchDB numbers one `_bulk_docs`' documents in an order of its own.
        let mut wanted: Vec<String> = more.iter().map(id_of).collect();
        wanted.sort();
        let mut seen = row_ids(&on_b.body, "results");
        seen.sort();
        check(seen == wanted, || {
            format!("{} since A's {since}: {}, wanted {wanted:?}", b.says("_changes"), on_b.body)
        })?;
        let whole_a = a.get(&format!("/{db}/_changes")).await?.expect(200, &a.says("_changes"))?;
        let whole_b = b.get(&format!("/{db}/_changes")).await?.expect(200, &b.says("_changes"))?;
        check(whole_a.body["results"] == whole_b.body["results"], || {
            format!("the whole feed: A {} B {}", whole_a.body, whole_b.body)
        })?;
        longpoll_wakes(a, b, &db, &whole_b.body["last_seq"]).await?;
        continuous_wakes(a, b, &db).await?;
        checkpoint_read_at_once(a, b, &db).await?;
    }
    Ok(())
}

/// B's `longpoll` from `since` answers with a write A makes while it waits.
async fn longpoll_wakes(a: Face<'_>, b: Face<'_>, db: &str, since: &Value) -> TestResult {
    let since = since.as_str().map_or_else(|| since.to_string(), str::to_owned);
    let query = percent_encoding::utf8_percent_encode(&since, percent_encoding::NON_ALPHANUMERIC);
    let waiting = b.request(Method::GET, &format!("/{db}/_changes?feed=longpoll&timeout=20000&since={query}")).send();
    let waiting = tokio::spawn(waiting);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let written = numbered("feeds", 10);
    let started = std::time::Instant::now();
    bulk_written(a, db, vec![written.clone()]).await?;
    let answer = tokio::time::timeout(FEED_WAKE_BOUND, waiting)
        .await
        .map_err(|_| format!("B's longpoll did not wake within {FEED_WAKE_BOUND:?} of A's write"))?
        .map_err(|err| err.to_string())??;
    let answer = Answer::read(answer).await?.expect(200, &b.says("longpoll"))?;
    check(row_ids(&answer.body, "results") == [id_of(&written)], || {
        format!("{} after {:?}: {}", b.says("longpoll"), started.elapsed(), answer.body)
    })
}

/// B's `continuous` feed from `now` shows a write A makes while it runs.
async fn continuous_wakes(a: Face<'_>, b: Face<'_>, db: &str) -> TestResult {
    use futures::StreamExt;
    let feed = b.request(Method::GET, &format!("/{db}/_changes?feed=continuous&since=now&timeout=20000&heartbeat=500"));
    let mut body = feed.send().await?.bytes_stream();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let written = numbered("feeds", 11);
    bulk_written(a, db, vec![written.clone()]).await?;
    let wanted = id_of(&written);
    let mut seen = String::new();
    let shown = tokio::time::timeout(FEED_WAKE_BOUND, async {
        while let Some(chunk) = body.next().await {
            seen.push_str(&String::from_utf8_lossy(&chunk?));
            let lines = seen.lines().filter_map(|line| serde_json::from_str::<Value>(line).ok());
            if lines.into_iter().any(|row| row["id"] == json!(wanted)) {
                return Ok(true);
            }
        }
        Ok::<bool, reqwest::Error>(false)
    })
    .await;
    check(matches!(shown, Ok(Ok(true))), || {
        format!("B's continuous feed did not show A's write within {FEED_WAKE_BOUND:?}: {seen:?}")
    })
}

/// A replicator's checkpoint written, updated and deleted through A reads so on B at once.
async fn checkpoint_read_at_once(a: Face<'_>, b: Face<'_>, db: &str) -> TestResult {
    let path = format!("/{db}/_local/checkpoint-instances");
    let rev = a.put(&path, json!({ "last_seq": "1" })).await?.expect(201, &a.says("PUT the checkpoint"))?.rev()?;
    let read = b.get(&path).await?.expect(200, &b.says("GET the checkpoint"))?;
    check(read.body["last_seq"] == json!("1") && read.body["_rev"] == json!(rev), || {
        format!("{}: {}", b.says("the checkpoint"), read.body)
    })?;
    let rev = a.put(&path, json!({ "_rev": rev, "last_seq": "2" })).await?.expect(201, &a.says("update it"))?.rev()?;
    let read = b.get(&path).await?.expect(200, &b.says("GET the checkpoint again"))?;
    check(read.body["last_seq"] == json!("2") && read.body["_rev"] == json!(rev), || {
        format!("{} after its update: {}", b.says("the checkpoint"), read.body)
    })?;
    a.call(Method::DELETE, &format!("{path}?rev={rev}"), None).await?.expect(200, &a.says("DELETE the checkpoint"))?;
    b.get(&path).await?.expect(404, &b.says("GET the deleted checkpoint")).map(drop)
}

/// Rounds of [`created_on_one_instance_is_there_on_the_other_at_once`], each with a new name.
const CREATION_ROUNDS: usize = 20;

/// A database created through A is there on B the moment A's PUT answered 201: B's `GET /{db}`
/// answers 200 and its `PUT /{db}/{doc}` 201, round after round with new names (on DynamoDB, B
/// confirms the database by a consistent read of the table's layout marker, which A wrote before
/// answering, not by DescribeTable, which may not know a table just created). Each database is
/// deleted through B, after which A answers 404 at once (the marker is marked dropped before the
/// table is deleted).
pub(super) async fn created_on_one_instance_is_there_on_the_other_at_once(e: Endpoint) -> TestResult {
    if !databases_shared(&e) {
        return Ok(());
    }
    let beside = e.beside_configured().await?;
    let (a, b) = (Face::of_endpoint(&e), Face::of_beside(&beside, "B"));
    for round in 0..CREATION_ROUNDS {
        let db = fresh_db_named(&e, "instances", "at-once").await?;
        let said = |what: &str| b.says(&format!("{what} in round {round}, just after A created {db}"));
        b.get(&format!("/{db}")).await?.expect(200, &said("GET the database"))?;
        b.put(&format!("/{db}/doc"), json!({"round": round})).await?.expect(201, &said("PUT a document"))?;
        b.call(Method::DELETE, &format!("/{db}"), None).await?.expect(200, &said("DELETE the database"))?;
        let gone = a.get(&format!("/{db}")).await?.expect(404, &a.says(&format!("GET {db} after B deleted it")))?;
        check(gone.body == missing_database(), || format!("GET {db} on A: {}", gone.body))?;
    }
    Ok(())
}

/// A `_revs_limit` set through B is what A's very next write stems to, and what A answers at
/// once (the first finding: A answered `1000` for good after B set `3`).
pub(super) async fn revs_limit_set_on_one_instance_holds_at_once_on_the_other(e: Endpoint) -> TestResult {
    if !databases_shared(&e) {
        return Ok(());
    }
    if on_pouchdb_server(&e) {
        println!("not checked on pouchdb-server 4.2.0: it has no `_revs_limit` route (Apache CouchDB applies its own)");
        return Ok(());
    }
    let beside = e.beside_configured().await?;
    let (a, b) = (Face::of_endpoint(&e), Face::of_beside(&beside, "B"));
    let db = fresh_db_named(&e, "instances", "revs-limit").await?;
    let created = a.put(&format!("/{db}/x"), json!({"n": 0})).await?.expect(201, &a.says("PUT x"))?;
    let mut rev = created.body["rev"].as_str().ok_or("PUT x answered no rev")?.to_owned();
    let before = a.get(&format!("/{db}/_revs_limit")).await?.expect(200, &a.says("GET _revs_limit"))?;
    check(before.body == json!(1000), || format!("A's _revs_limit before: {}", before.body))?;
    b.call(Method::PUT, &format!("/{db}/_revs_limit"), Some(json!(2)))
        .await?
        .expect(200, &b.says("PUT _revs_limit 2"))?;
    let after = a.get(&format!("/{db}/_revs_limit")).await?.expect(200, &a.says("GET _revs_limit after B set it"))?;
    check(after.body == json!(2), || format!("A's _revs_limit just after B set 2: {}", after.body))?;
    for n in 1..=4 {
        let updated = a
            .put(&format!("/{db}/x"), json!({"_rev": rev, "n": n}))
            .await?
            .expect(201, &a.says(&format!("update {n} of x")))?;
        rev = updated.body["rev"].as_str().ok_or("an update answered no rev")?.to_owned();
    }
    let read = b.get(&format!("/{db}/x?revs=true")).await?.expect(200, &b.says("GET x?revs=true"))?;
    let kept = read.body["_revisions"]["ids"].as_array().map_or(0, Vec::len);
    check(kept == 2, || format!("A's writes kept {kept} revisions after B set _revs_limit 2: {}", read.body))
}
