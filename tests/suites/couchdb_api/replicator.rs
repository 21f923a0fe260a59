//! The replicator (issue 37): `_replicator` documents and `POST /_replicate` run by this server
//! between its own databases (local endpoints), their state written back, `_scheduler/docs`,
//! `_scheduler/jobs` and `_active_tasks` with the fields a real CouchDB 3.4.3 shows
//! (`fixtures/couchdb-3.4.3/110`–`119`), filters (`doc_ids`, a selector, a design filter with
//! `query_params`), continuous replication of writes made while it runs, and one instance per
//! job with two servers over one store. Replications by URL to pouchdb-server and from another
//! `agentstore serve`, and a job resumed after `kill -9`, are `migrate_databases::replicator`'s.
//!
//! On the CouchDB backend the databases, `_replicator` included, are the server's own and so is
//! its replicator: these trials check only that this server runs none there.

use base64::Engine as _;

use super::*;

/// How long a replication may take to show its effect.
const PATIENCE: Duration = Duration::from_secs(30);

/// Polls `probe` every 200 ms until it answers `Some`, up to [`PATIENCE`].
async fn eventually<T, F, Fut>(what: &str, mut probe: F) -> Result<T, Failed>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>, Failed>>,
{
    let started = std::time::Instant::now();
    loop {
        if let Some(found) = probe().await? {
            return Ok(found);
        }
        if started.elapsed() > PATIENCE {
            return Err(format!("{what}: not seen within {PATIENCE:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The ids of a database's live documents.
async fn ids_of(e: &Endpoint, db: &str) -> Result<Vec<String>, Failed> {
    let answer = e.get(&format!("/{db}/_all_docs")).await?.expect(200, "_all_docs")?;
    Ok(answer.body["rows"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["id"].as_str().map(str::to_owned))
        .collect())
}

/// Whether this trial's backend keeps CouchDB's own databases (no replicator runs here); if so,
/// checks `POST /_replicate` says so.
async fn replicator_is_couchdb_s(e: &Endpoint) -> Result<bool, Failed> {
    if e.backend != "couchdb" {
        return Ok(false);
    }
    let answer = e.post("/_replicate", json!({"source": "a", "target": "b"})).await?;
    check(answer.status == StatusCode::SERVICE_UNAVAILABLE, || {
        format!("_replicate on CouchDB's databases: {}", answer.status)
    })?;
    Ok(true)
}

async fn seed_docs(e: &Endpoint, db: &str, docs: &[Value]) -> TestResult {
    e.post(&format!("/{db}/_bulk_docs"), json!({ "docs": docs })).await?.expect(201, "_bulk_docs")?;
    Ok(())
}

/// A one-shot `_replicator` document between two local databases: the target gets every
/// document (a conflict's both leaves, a small attachment and one past 256 KiB, streamed), the document is written back `completed`
/// with CouchDB's fields, `_scheduler/docs` shows it as CouchDB shows a completed document, and
/// the checkpoint is on both ends in CouchDB's form.
pub async fn replicator_one_shot_as_couchdb(e: Endpoint) -> TestResult {
    if replicator_is_couchdb_s(&e).await? {
        return Ok(());
    }
    let source = fresh_db_named(&e, "rep", "src").await?;
    let target = fresh_db_named(&e, "rep", "dst").await?;
    seed_docs(
        &e,
        &source,
        &[
            json!({"_id": "a", "n": 1}),
            json!({"_id": "b", "n": 2, "_attachments": {"t.txt": {"content_type": "text/plain", "data": "aGVsbG8="}}}),
        ],
    )
    .await?;
    // Past 256 KiB: streamed from the source database to the target one (their names differ).
    let large: Vec<u8> = (0..300 * 1024).map(|i| (i % 251) as u8).collect();
    let encoded = base64::engine::general_purpose::STANDARD.encode(&large);
    let streamed =
        json!({"_id": "c", "_attachments": {"big.bin": {"content_type": "application/octet-stream", "data": encoded}}});
    seed_docs(&e, &source, &[streamed]).await?;
    let branch = json!({"docs": [{"_id": "a", "_rev": "2-ffff", "_revisions": {"start": 2, "ids": ["ffff", "0000"]}, "side": true}], "new_edits": false});
    e.post(&format!("/{source}/_bulk_docs"), branch).await?.expect(201, "a branch")?;
    let doc_id = format!("one-shot-{source}");
    e.put(&format!("/_replicator/{doc_id}"), json!({"source": source, "target": target}))
        .await?
        .expect(201, "PUT _replicator doc")?;
    let written = eventually("the document's completed state", || async {
        let doc = e.get(&format!("/_replicator/{doc_id}")).await?.expect(200, "GET _replicator doc")?.body;
        Ok((doc["_replication_state"] == "completed").then_some(doc))
    })
    .await?;
    same_fields(&written, &couchdb_body("112-replicator-doc-completed"), "the completed document", &["owner"])?;
    same_fields(
        &written["_replication_stats"],
        &couchdb_body("112-replicator-doc-completed")["_replication_stats"],
        "_replication_stats",
        &[],
    )?;
    check(written["_replication_stats"]["docs_written"] == 4, || format!("four leaves written: {written}"))?;
    check(ids_of(&e, &target).await? == ["a", "b", "c"], || "the target's documents".into())?;
    let big = e.client.get(e.url(&format!("/{target}/c/big.bin"))).send().await?.bytes().await?;
    check(big.as_ref() == large.as_slice(), || format!("the streamed attachment: {} bytes", big.len()))?;
    let a = e.get(&format!("/{target}/a?conflicts=true")).await?.expect(200, "a")?.body;
    check(a["_conflicts"].as_array().map_or(0, Vec::len) == 1, || format!("the conflict travels: {a}"))?;
    let bytes = e.client.get(e.url(&format!("/{target}/b/t.txt"))).send().await?.text().await?;
    check(bytes == "hello", || format!("the attachment travels: {bytes:?}"))?;
    let shown = e.get(&format!("/_scheduler/docs/_replicator/{doc_id}")).await?.expect(200, "_scheduler doc")?.body;
    let completed = &couchdb_body("110-scheduler-docs")["docs"][1];
    same_fields(&shown, completed, "a completed _scheduler doc", &[])?;
    check(shown["state"] == "completed" && shown["info"]["docs_written"] == 4, || format!("_scheduler doc: {shown}"))?;
    let listed = e.get("/_scheduler/docs").await?.expect(200, "_scheduler/docs")?.body;
    check(listed["docs"].as_array().is_some_and(|docs| docs.iter().any(|d| d["doc_id"] == doc_id.as_str())), || {
        format!("{listed}")
    })?;
    let locals = e.get(&format!("/{source}/_local_docs?include_docs=true")).await?.expect(200, "_local_docs")?.body;
    let checkpoint = &locals["rows"][0]["doc"];
    for field in ["session_id", "source_last_seq", "replication_id_version", "history"] {
        check(!checkpoint[field].is_null(), || format!("the source's checkpoint lacks {field}: {locals}"))?;
    }
    check(checkpoint["replication_id_version"] == 4, || format!("{checkpoint}"))?;
    let name = checkpoint["_id"].as_str().unwrap_or_default();
    let on_target = e.get(&format!("/{target}/{name}")).await?.expect(200, "the target's checkpoint")?.body;
    check(on_target["session_id"] == checkpoint["session_id"], || format!("{on_target} vs {checkpoint}"))?;
    same_error(&e.get("/_scheduler/docs/_replicator/no-such-doc").await?, "117-scheduler-doc-unknown")
}

/// A continuous replication follows writes made while it runs; `doc_ids`, a selector and a
/// design filter (with `query_params`) keep only their documents; `_active_tasks`,
/// `_scheduler/jobs` and `_scheduler/docs` show the running jobs with CouchDB's fields; deleting
/// a document stops its job.
pub async fn replicator_continuous_and_filtered(e: Endpoint) -> TestResult {
    if replicator_is_couchdb_s(&e).await? {
        return Ok(());
    }
    let source = fresh_db_named(&e, "rep", "src").await?;
    let filter = json!({"_id": "_design/f", "filters": {"by_kind": "function(doc, req) { return doc.kind === req.query.kind; }"}});
    seed_docs(&e, &source, &[json!({"_id": "x1", "kind": "x"}), json!({"_id": "y1", "kind": "y"}), filter]).await?;
    let mut targets = Vec::new();
    for (tag, options) in [
        ("all", json!({})),
        ("ids", json!({"doc_ids": ["x1", "x2"]})),
        ("sel", json!({"selector": {"kind": "y"}})),
        ("fun", json!({"filter": "f/by_kind", "query_params": {"kind": "x"}})),
    ] {
        let target = fresh_db_named(&e, "rep", tag).await?;
        let mut doc = json!({"source": source, "target": target, "continuous": true});
        doc.as_object_mut().into_iter().for_each(|d| d.extend(options.as_object().cloned().unwrap_or_default()));
        e.put(&format!("/_replicator/{tag}-{target}"), doc).await?.expect(201, "PUT _replicator doc")?;
        targets.push((tag, target));
    }
    // Written while the jobs run.
    seed_docs(
        &e,
        &source,
        &[json!({"_id": "x2", "kind": "x"}), json!({"_id": "y2", "kind": "y"}), json!({"_id": "z", "kind": "z"})],
    )
    .await?;
    let wanted: [(&str, &[&str]); 4] = [
        ("all", &["_design/f", "x1", "x2", "y1", "y2", "z"]),
        ("ids", &["x1", "x2"]),
        ("sel", &["y1", "y2"]),
        ("fun", &["x1", "x2"]),
    ];
    for ((tag, target), (_, ids)) in targets.iter().zip(wanted) {
        eventually(&format!("{tag}: {ids:?} at the target"), || async {
            Ok((ids_of(&e, target).await? == ids).then_some(()))
        })
        .await?;
    }
    let tasks = e.get("/_active_tasks").await?.expect(200, "_active_tasks")?.body;
    let tasks = tasks.as_array().cloned().unwrap_or_default();
    check(tasks.len() == 4, || format!("four running replications: {tasks:?}"))?;
    let couch_task = &couchdb_body("111-active-tasks")[0];
    for task in &tasks {
        same_fields(task, couch_task, "an _active_tasks row", &[])?;
        check(task["type"] == "replication" && task["continuous"] == true, || format!("{task}"))?;
    }
    let keys: Vec<&String> = tasks[0].as_object().map(|t| t.keys().collect()).unwrap_or_default();
    check(keys[..3] == ["node", "pid", "process_status"], || format!("CouchDB's member order: {keys:?}"))?;
    let jobs = e.get("/_scheduler/jobs").await?.expect(200, "_scheduler/jobs")?.body;
    same_fields(&jobs, &couchdb_body("114-scheduler-jobs"), "_scheduler/jobs", &[])?;
    check(jobs["total_rows"] == 4, || format!("{jobs}"))?;
    same_fields(&jobs["jobs"][0], &couchdb_body("114-scheduler-jobs")["jobs"][0], "a job", &[])?;
    let docs = e.get("/_scheduler/docs").await?.expect(200, "_scheduler/docs")?.body;
    let running = &couchdb_body("110-scheduler-docs")["docs"][0];
    let ours: Vec<&Value> = docs["docs"].as_array().into_iter().flatten().filter(|d| d["state"] == "running").collect();
    check(ours.len() == 4, || format!("four running documents: {docs}"))?;
    for doc in ours {
        same_fields(doc, running, "a running _scheduler doc", &[])?;
    }
    // Deleting a document stops its job.
    let (tag, target) = &targets[0];
    let doc_path = format!("/_replicator/{tag}-{target}");
    let rev = e.get(&doc_path).await?.expect(200, "the doc")?.body["_rev"].as_str().unwrap_or_default().to_owned();
    e.delete(&format!("{doc_path}?rev={rev}")).await?.expect(200, "DELETE the doc")?;
    eventually("three jobs after a deletion", || async {
        let tasks = e.get("/_active_tasks").await?.expect(200, "_active_tasks")?.body;
        Ok((tasks.as_array().map_or(0, Vec::len) == 3).then_some(()))
    })
    .await?;
    seed_docs(&e, &source, &[json!({"_id": "late"})]).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    check(!ids_of(&e, target).await?.contains(&"late".to_owned()), || "a stopped job copied a later write".into())
}

/// `POST /_replicate`: a one-shot replication answers its history with CouchDB's fields, and the
/// same again answers `no_changes` over its checkpoint; a continuous one answers 202 with its id
/// and is cancelled by it; cancelling what does not run is CouchDB's 404; a missing source is
/// CouchDB's 500 `db_not_found`, and a document of one `crashing` with its error; a `_replicator`
/// document that does not parse is refused with the parser's reason.
pub async fn replicate_endpoint_as_couchdb(e: Endpoint) -> TestResult {
    if replicator_is_couchdb_s(&e).await? {
        return Ok(());
    }
    let source = fresh_db_named(&e, "rep", "src").await?;
    let target = fresh_db_named(&e, "rep", "dst").await?;
    seed_docs(&e, &source, &[json!({"_id": "a"}), json!({"_id": "b"})]).await?;
    let body = json!({"source": source, "target": target});
    let first = e.post("/_replicate", body.clone()).await?.expect(200, "POST /_replicate")?.body;
    same_fields(&first, &couchdb_body("115-replicate-one-shot"), "a one-shot answer", &["no_changes"])?;
    same_fields(&first["history"][0], &couchdb_body("115-replicate-one-shot")["history"][0], "its history", &[])?;
    check(first["history"][0]["docs_written"] == 2, || format!("{first}"))?;
    let again = e.post("/_replicate", body).await?.expect(200, "POST /_replicate again")?.body;
    check(again["no_changes"] == true && again["session_id"] == first["session_id"], || {
        format!("{again} after {first}")
    })?;
    let continuous = json!({"source": source, "target": target, "continuous": true});
    let started = e.post("/_replicate", continuous.clone()).await?.expect(202, "a continuous one")?.body;
    let id = started["_local_id"].as_str().unwrap_or_default().to_owned();
    check(id.ends_with("+continuous"), || format!("{started}"))?;
    let mut cancel = continuous;
    cancel["cancel"] = json!(true);
    let cancelled = e.post("/_replicate", cancel.clone()).await?.expect(200, "cancel")?.body;
    check(cancelled == json!({"ok": true, "_local_id": id}), || format!("{cancelled}"))?;
    same_error(&e.post("/_replicate", cancel).await?, "116-replicate-cancel-unknown")?;
    let missing = e.post("/_replicate", json!({"source": "rep-no-such-db", "target": target})).await?;
    let couch_missing = fixture("119-replicate-missing-source");
    check(missing.status.as_u16() as u64 == couch_missing["response"]["status"], || format!("{}", missing.status))?;
    check(
        missing.body["error"] == "db_not_found" && missing.body["reason"] == "could not open rep-no-such-db",
        || format!("a missing source: {}", missing.body),
    )?;
    // A document whose source is missing: `crashing`, with CouchDB's error.
    let doc_id = format!("missing-{target}");
    e.put(&format!("/_replicator/{doc_id}"), json!({"source": "rep-no-such-db", "target": target}))
        .await?
        .expect(201, "PUT")?;
    let crashing = eventually("a crashing document", || async {
        let answer = e.get(&format!("/_scheduler/docs/_replicator/{doc_id}")).await?;
        Ok((answer.status == StatusCode::OK && answer.body["state"] == "crashing").then_some(answer.body))
    })
    .await?;
    same_fields(&crashing, &couchdb_body("118-scheduler-doc-crashing"), "a crashing _scheduler doc", &[])?;
    check(
        crashing["info"]["error"] == "db_not_found: could not open rep-no-such-db" && crashing["error_count"] == 1,
        || format!("{crashing}"),
    )?;
    let refused = e.put("/_replicator/bad", json!({"source": source, "target": target, "continuous": "yes"})).await?;
    check(refused.status == StatusCode::FORBIDDEN && refused.body["error"] == "forbidden", || {
        format!("{}", refused.body)
    })?;
    check(refused.body["reason"] == "parameter `continuous` must be a boolean", || format!("{}", refused.body))
}

/// Two servers over one store follow the same `_replicator`: each continuous job runs on exactly
/// one of them (its lease), and both copy nothing twice.
pub async fn replicator_one_instance_per_job(e: Endpoint) -> TestResult {
    if replicator_is_couchdb_s(&e).await? || !super::several_instances::databases_shared(&e) {
        return Ok(());
    }
    let other = e.beside().await?;
    let source = fresh_db_named(&e, "rep", "src").await?;
    seed_docs(&e, &source, &[json!({"_id": "a"})]).await?;
    let mut targets = Vec::new();
    for i in 0..3 {
        let target = fresh_db_named(&e, "rep", &format!("t{i}")).await?;
        e.put(&format!("/_replicator/lease-{target}"), json!({"source": source, "target": target, "continuous": true}))
            .await?
            .expect(201, "PUT _replicator doc")?;
        targets.push(target);
    }
    for target in &targets {
        eventually("the document at each target", || async { Ok((ids_of(&e, target).await? == ["a"]).then_some(())) })
            .await?;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (here, there) = (running_from(&e.root, &source).await?, running_from(&other.root, &source).await?);
    check(here + there == 3, || format!("each job runs once: {here} here, {there} on the other instance"))
}

/// How many replications from `source` a server's `_active_tasks` lists.
async fn running_from(root: &str, source: &str) -> Result<usize, Failed> {
    let tasks: Value = reqwest::Client::new()
        .get(format!("{root}/_active_tasks"))
        .header("Accept", "application/json")
        .send()
        .await?
        .json()
        .await?;
    Ok(tasks.as_array().into_iter().flatten().filter(|t| t["source"] == source).count())
}

/// With logins: a server admin's `_replicator` document is stored with its `owner`, as CouchDB
/// 3.4.3 stores it (fixture 112); another login may not write to the admin-only database, and
/// a `_replicate` with a local endpoint is a server admin's (CouchDB's reason).
pub async fn replicator_owner_and_logins(e: Endpoint) -> TestResult {
    if replicator_is_couchdb_s_as(&e, Some(("admin", super::roles::PASSWORD))).await? {
        return Ok(());
    }
    let as_login = |name: &'static str| {
        let (client, root) = (e.client.clone(), e.root.clone());
        move |method: Method, path: String, body: Option<Value>| {
            let mut request = client.request(method, format!("{root}{path}")).header("Accept", "application/json");
            request = request.basic_auth(name, Some(super::roles::PASSWORD));
            if let Some(body) = body {
                request = request.json(&body);
            }
            async move { Answer::read(request.send().await?).await }
        }
    };
    let (admin, carol) = (as_login("admin"), as_login("carol"));
    admin(Method::PUT, "/rep-owner-src".into(), None).await?.expect(201, "PUT source")?;
    let doc = json!({"source": "rep-owner-src", "target": "rep-owner-dst", "create_target": true});
    admin(Method::PUT, "/_replicator/owned".into(), Some(doc.clone())).await?.expect(201, "PUT as admin")?;
    let stored = admin(Method::GET, "/_replicator/owned".into(), None).await?.expect(200, "GET")?.body;
    check(stored["owner"] == couchdb_body("112-replicator-doc-completed")["owner"], || format!("owner: {stored}"))?;
    let refused = carol(Method::PUT, "/_replicator/carols".into(), Some(doc.clone())).await?;
    check(refused.status == StatusCode::FORBIDDEN, || {
        format!("another login's write: {} {}", refused.status, refused.body)
    })?;
    let local = carol(Method::POST, "/_replicate".into(), Some(doc)).await?;
    check(local.status == StatusCode::FORBIDDEN && local.body["reason"] == "local_endpoints_not_supported", || {
        format!("a login's local _replicate: {} {}", local.status, local.body)
    })
}

/// [`replicator_is_couchdb_s`] with a login.
async fn replicator_is_couchdb_s_as(e: &Endpoint, login: Option<(&str, &str)>) -> Result<bool, Failed> {
    if e.backend != "couchdb" {
        return Ok(false);
    }
    let mut request = e.client.post(e.url("/_replicate")).json(&json!({"source": "a", "target": "b"}));
    if let Some((name, password)) = login {
        request = request.basic_auth(name, Some(password));
    }
    let status = request.send().await?.status();
    check(status == StatusCode::SERVICE_UNAVAILABLE, || format!("_replicate on CouchDB's databases: {status}"))?;
    Ok(true)
}
