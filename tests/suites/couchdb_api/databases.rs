//! Databases besides the data-store one (issue 24): creating, listing and deleting them, documents
//! of any shape with their whole revision trees, bad input, and deleting a database while writers
//! and a `_changes` feed use it. Expected answers are CouchDB 3.x's, as its documentation and
//! source (`couch_doc`, `couch_key_tree`, `chttpd_db`) give them; each check says which.

use futures::StreamExt;

use super::*;

/// On the CouchDB backend a database stays CouchDB's own and every request on it is forwarded:
/// its answers are the backend server's (CouchDB in production; pouchdb-server here, whose
/// answers differ from CouchDB's in places), so the checks of CouchDB's exact answers apply
/// where the database is kept by agentstore.
fn kept_here(e: &Endpoint) -> bool {
    e.backend != "couchdb"
}

fn leaf_revs(answer: &Value) -> Vec<String> {
    answer
        .as_array()
        .map(|leaves| leaves.iter().filter_map(|l| l["ok"]["_rev"].as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

pub(super) async fn databases_lifecycle(e: Endpoint) -> TestResult {
    with_databases_dropped(&e, &["zz-a", "zz-b"], databases_lifecycle_steps(&e)).await
}

async fn databases_lifecycle_steps(e: &Endpoint) -> TestResult {
    // On the CouchDB backend the server is shared with other trials, whose databases are listed
    // too: the listing checks look at this trial's names (`zz-…`, after every other) only.
    e.call(Method::PUT, "/zz-b", None).await?.expect(201, "PUT /zz-b")?;
    let created = e.call(Method::PUT, "/zz-a", None).await?.expect(201, "PUT /zz-a")?;
    check(created.body == json!({"ok": true}), || format!("PUT /zz-a: {}", created.body))?;
    // 412 file_exists for an existing one, as for the data-store database (transcript 004).
    let again = e.call(Method::PUT, "/zz-a", None).await?;
    same_error(&again, "004-db-create-again")?;
    // CouchDB's name rule: a lowercase letter first, then [a-z0-9_$()+/-].
    for bad in ["/Alpha", "/1abc", "/a%20b", "/caf%C3%A9"] {
        let answer = e.call(Method::PUT, bad, None).await?.expect(400, bad)?;
        check(answer.body["error"] == "illegal_database_name", || format!("PUT {bad}: {}", answer.body))?;
    }
    let all = e.get("/_all_dbs").await?.expect(200, "_all_dbs")?;
    let names: Vec<&str> = all.body.as_array().into_iter().flatten().filter_map(Value::as_str).collect();
    let mine: Vec<&str> = names.iter().copied().filter(|n| *n == DB || n.starts_with("zz-")).collect();
    check(mine == ["agent_data_store", "zz-a", "zz-b"], || format!("_all_dbs, in byte order: {}", all.body))?;
    let page = e.get("/_all_dbs?descending=true&limit=2&startkey=%22zz-z%22&endkey=%22zz-%22").await?;
    let page = page.expect(200, "_all_dbs page")?;
    check(page.body == json!(["zz-b", "zz-a"]), || format!("_all_dbs descending: {}", page.body))?;
    let from = e.get("/_all_dbs?startkey=%22zz-b%22").await?.expect(200, "_all_dbs from zz-b")?;
    check(from.body == json!(["zz-b"]), || format!("_all_dbs from zz-b: {}", from.body))?;
    let info = e.get("/zz-a").await?.expect(200, "GET /zz-a")?;
    if kept_here(e) {
        same_fields(&info.body, &couchdb_body("005-db-info"), "GET /zz-a", &[])?;
    }
    check(info.body["db_name"] == "zz-a" && info.body["doc_count"] == 0, || format!("GET /zz-a: {}", info.body))?;
    let infos = e.post("/_dbs_info", json!({"keys": ["zz-a", "nope"]})).await?.expect(200, "_dbs_info")?;
    // At most 100 names per request (CouchDB's `max_db_number_for_dbs_info_req`): 400 naming it.
    let names: Vec<String> = (0..101).map(|n| format!("db{n}")).collect();
    let too_many = e.post("/_dbs_info", json!({ "keys": names })).await?.expect(400, "_dbs_info of 101")?;
    check(too_many.body["reason"].as_str().is_some_and(|r| r.contains("100")), || format!("{}", too_many.body))?;
    check(infos.body[0]["info"]["db_name"] == "zz-a" && infos.body[1]["error"] == "not_found", || {
        format!("_dbs_info: {}", infos.body)
    })?;
    // A document in one database is invisible in another and in the data-store database.
    e.put("/zz-a/shared-id", json!({"in": "zz-a"})).await?.expect(201, "PUT in zz-a")?;
    e.get("/zz-b/shared-id").await?.expect(404, "GET the id in zz-b")?;
    e.delete("/zz-a").await?.expect(200, "DELETE /zz-a")?;
    let missing = e.get("/zz-a").await?;
    same_error(&missing, "006-db-missing")?;
    e.delete("/zz-a").await?.expect(404, "DELETE /zz-a again")?;
    // Created again: nothing of the deleted database is left.
    e.call(Method::PUT, "/zz-a", None).await?.expect(201, "PUT /zz-a again")?;
    e.get("/zz-a/shared-id").await?.expect(404, "the old document is gone")?;
    let fresh = e.get("/zz-a").await?.expect(200, "GET /zz-a again")?;
    check(fresh.body["doc_count"] == 0, || format!("re-created: {}", fresh.body))?;
    e.get("/zz-b").await?.expect(200, "the other database is untouched")?;
    e.delete(&format!("/{DB}")).await?.expect(403, "the data-store database is not deleted")?;
    // CouchDB's `pending` is exact (replicators sum it per batch: PouchDB's test #5710); the
    // embedded store counts it exactly (up to 10,000 waiting changes), the other backends give a
    // lower bound.
    if e.backend == "embedded" {
        let docs: Vec<Value> = (0..10).map(|n| json!({"_id": format!("p{n}")})).collect();
        e.post("/zz-b/_bulk_docs", json!({"docs": docs})).await?.expect(201, "ten documents")?;
        let page = e.get("/zz-b/_changes?limit=4").await?.expect(200, "a page of four")?;
        check(page.body["pending"] == 6, || format!("pending after 4 of 10: {}", page.body))?;
    }
    Ok(())
}

pub(super) async fn any_document_and_its_conflicts(e: Endpoint) -> TestResult {
    with_databases_dropped(&e, &["docs", "designs"], any_document_and_its_conflicts_steps(&e)).await
}

async fn any_document_and_its_conflicts_steps(e: &Endpoint) -> TestResult {
    e.call(Method::PUT, "/docs", None).await?.expect(201, "PUT /docs")?;
    let shape = json!({"list": [1, "two", null, {"x": [true]}], "ünïcode key": {"": 1.5}, "n": -0.0001});
    let first = e.put("/docs/any", shape.clone()).await?.expect(201, "PUT any")?.rev()?;
    let read = e.get("/docs/any").await?.expect(200, "GET any")?;
    for (name, value) in shape.as_object().into_iter().flatten() {
        check(read.body[name] == *value, || format!("field {name}: {}", read.body))?;
    }
    // CouchDB's built-in `_design` filter lists design documents' changes only.
    e.call(Method::PUT, "/designs", None).await?.expect(201, "PUT /designs")?;
    e.put("/designs/plain", json!({})).await?.expect(201, "PUT a document")?;
    e.put("/designs/_design/app", json!({"views": {}})).await?.expect(201, "PUT a design document")?;
    // (On the CouchDB backend the database is the server's own, and pouchdb-server 4.2.0 has no
    // `_design` filter: its 404 passes through.)
    if kept_here(e) {
        let designs = e.get("/designs/_changes?filter=_design").await?.expect(200, "_changes?filter=_design")?;
        let rows = designs.body["results"].as_array().into_iter().flatten();
        let ids: Vec<&str> = rows.filter_map(|r| r["id"].as_str()).collect();
        check(ids == ["_design/app"], || format!("filter=_design: {}", designs.body))?;
    }
    // A stale revision is 409 conflict (CouchDB's update rule).
    let second = e.put("/docs/any", json!({"_rev": first, "v": 2})).await?.expect(201, "update")?.rev()?;
    let stale = e.put("/docs/any", json!({"_rev": first, "v": 3})).await?.expect(409, "a stale update")?;
    if kept_here(e) {
        same_error(&stale, "015-doc-put-conflict-stale-rev")?;
    }
    // A replicated branch from the first revision: a conflict, both leaves kept with bodies.
    let (_, first_id) = first.split_once('-').unwrap_or_default();
    let branch = json!({"docs": [{"_id": "any", "_rev": "2-ffffffffffffffffffffffffffffffff", "side": "replicated",
        "_revisions": {"start": 2, "ids": ["ffffffffffffffffffffffffffffffff", first_id]}}], "new_edits": false});
    let grafted = e.post("/docs/_bulk_docs", branch).await?.expect(201, "graft")?;
    check(grafted.body == json!([]), || format!("new_edits=false answers failures only: {}", grafted.body))?;
    // The winner: same generation, the greater revision id (couch_key_tree's rule).
    let winner = e.get("/docs/any?conflicts=true").await?.expect(200, "GET conflicts")?;
    check(winner.body["_rev"] == "2-ffffffffffffffffffffffffffffffff", || format!("winner: {}", winner.body))?;
    check(winner.body["_conflicts"] == json!([second]), || format!("_conflicts: {}", winner.body))?;
    let all = e.get("/docs/any?open_revs=all").await?.expect(200, "open_revs=all")?;
    let mut leaves = leaf_revs(&all.body);
    leaves.sort();
    let mut expected = vec![second.clone(), "2-ffffffffffffffffffffffffffffffff".to_owned()];
    expected.sort();
    check(leaves == expected, || format!("open_revs=all: {}", all.body))?;
    let loser = e.get(&format!("/docs/any?rev={second}&revs=true")).await?.expect(200, "GET the losing leaf")?;
    check(loser.body["v"] == 2 && loser.body["_revisions"]["start"] == 2, || format!("loser: {}", loser.body))?;
    // An inner revision's body is kept until compaction, as in CouchDB (issue 35).
    if kept_here(e) {
        let inner = e.get(&format!("/docs/any?rev={first}")).await?.expect(200, "an inner revision")?;
        check(inner.body["_rev"] == first.as_str(), || format!("the inner revision: {}", inner.body))?;
        let info = e.get("/docs/any?revs_info=true").await?.expect(200, "revs_info")?;
        check(info.body["_revs_info"][1] == json!({"rev": first, "status": "available"}), || {
            format!("revs_info: {}", info.body)
        })?;
        e.post("/docs/_compact", json!({})).await?.expect(202, "_compact")?;
        e.get(&format!("/docs/any?rev={first}")).await?.expect(404, "an inner revision after _compact")?;
        let info = e.get("/docs/any?revs_info=true").await?.expect(200, "revs_info")?;
        check(info.body["_revs_info"][1] == json!({"rev": first, "status": "missing"}), || {
            format!("revs_info after _compact: {}", info.body)
        })?;
    }
    let listed = e.get("/docs/_all_docs?include_docs=true&conflicts=true").await?.expect(200, "_all_docs")?;
    check(listed.body["rows"][0]["doc"]["_conflicts"] == json!([second]), || format!("_all_docs: {}", listed.body))?;
    let changes = e.get("/docs/_changes?style=all_docs").await?.expect(200, "_changes all_docs")?;
    let revs = changes.body["results"][0]["changes"].as_array().map_or(0, Vec::len);
    check(revs == 2, || format!("style=all_docs lists both leaves: {}", changes.body))?;
    let diff = e.post("/docs/_revs_diff", json!({"any": ["3-abc", second]})).await?.expect(200, "_revs_diff")?;
    check(diff.body["any"]["missing"] == json!(["3-abc"]), || format!("_revs_diff: {}", diff.body))?;
    // pouchdb-server leaves `possible_ancestors` out; CouchDB gives the leaves below 3.
    if kept_here(e) {
        check(diff.body["any"]["possible_ancestors"].as_array().is_some_and(|a| a.len() == 2), || {
            format!("possible_ancestors: {}", diff.body)
        })?;
    }
    // Deleting the losing leaf resolves the conflict.
    e.delete(&format!("/docs/any?rev={second}")).await?.expect(200, "delete the loser")?;
    let resolved = e.get("/docs/any?conflicts=true&deleted_conflicts=true").await?.expect(200, "resolved")?;
    check(resolved.body.get("_conflicts").is_none(), || format!("resolved: {}", resolved.body))?;
    // pouchdb-server does not answer `deleted_conflicts`; CouchDB lists the deleted leaf.
    if kept_here(e) {
        check(resolved.body["_deleted_conflicts"].as_array().is_some_and(|d| d.len() == 1), || {
            format!("_deleted_conflicts: {}", resolved.body)
        })?;
    }
    // Deleting the winner: 404 deleted; written again without a revision, generation 4.
    let gone = e.delete("/docs/any?rev=2-ffffffffffffffffffffffffffffffff").await?.expect(200, "delete")?.rev()?;
    let deleted = e.get("/docs/any").await?.expect(404, "GET deleted")?;
    // CouchDB's reason is `deleted`; pouchdb-server says `missing`.
    check(!kept_here(e) || deleted.body["reason"] == "deleted", || format!("GET deleted: {}", deleted.body))?;
    let back = e.put("/docs/any", json!({"back": true})).await?.expect(201, "write it again")?.rev()?;
    check(gone.starts_with("3-") && back.starts_with("4-"), || format!("generations: {gone} then {back}"))?;
    Ok(())
}

pub(super) async fn bad_input_on_databases(e: Endpoint) -> TestResult {
    with_databases_dropped(&e, &["bad"], bad_input_on_databases_steps(&e)).await
}

async fn bad_input_on_databases_steps(e: &Endpoint) -> TestResult {
    e.call(Method::PUT, "/bad", None).await?.expect(201, "PUT /bad")?;
    if !kept_here(e) {
        println!("bad input on the CouchDB backend is the backend server's to refuse (forwarded as sent)");
        return Ok(());
    }
    // couch_doc:transfer_fields refuses unknown special members.
    let special = e.put("/bad/d", json!({"_foo": 1})).await?.expect(400, "_foo")?;
    check(special.body == json!({"error": "doc_validation", "reason": "Bad special document member: _foo"}), || {
        format!("_foo: {}", special.body)
    })?;
    let reserved = e.post("/bad", json!({"_id": "_reserved"})).await?.expect(400, "_reserved")?;
    check(reserved.body["error"] == "illegal_docid", || format!("_reserved: {}", reserved.body))?;
    let rev = e.put("/bad/d", json!({"_rev": "not-a-rev"})).await?.expect(400, "bad _rev")?;
    check(rev.body["error"] == "bad_request", || format!("bad _rev: {}", rev.body))?;
    let revisions = json!({"docs": [{"_id": "d", "_rev": "2-b", "_revisions": {"start": 1, "ids": ["b", "a"]}}], "new_edits": false});
    e.post("/bad/_bulk_docs", revisions).await?.expect(400, "malformed _revisions")?;
    let bulk = json!({"docs": [{"_id": "fine"}, {"_id": "_bad"}]});
    e.post("/bad/_bulk_docs", bulk).await?.expect(400, "one illegal id fails the whole request")?;
    e.get("/bad/fine").await?.expect(404, "nothing of a refused request is written")?;
    // CouchDB's max_document_size, 8,000,000 bytes by default: 413 document_too_large.
    let big = json!({"blob": "x".repeat(8_000_001)});
    let too_large = e.put("/bad/big", big).await?.expect(413, "a document over 8 MB")?;
    check(too_large.body["error"] == "document_too_large", || format!("413: {}", too_large.body))?;
    let info = e.get("/bad").await?.expect(200, "GET /bad")?;
    check(info.body["doc_count"] == 0, || format!("nothing was written: {}", info.body))
}

pub(super) async fn deleting_a_database_under_writers_and_a_feed(e: Endpoint) -> TestResult {
    if !kept_here(&e) {
        println!("on the CouchDB backend a deleted database's feed is the backend server's to end");
        return Ok(());
    }
    e.call(Method::PUT, "/busy", None).await?.expect(201, "PUT /busy")?;
    e.call(Method::PUT, "/bystander", None).await?.expect(201, "PUT /bystander")?;
    e.put("/bystander/kept", json!({"v": 1})).await?.expect(201, "PUT in the bystander")?;
    let feed = e
        .client
        .get(e.url("/busy/_changes?feed=continuous&heartbeat=1000&timeout=20000"))
        .send()
        .await
        .map_err(|err| Failed::from(format!("open the feed: {err}")))?;
    let mut feed = feed.bytes_stream();
    let writer = {
        let client = e.client.clone();
        let url = e.url("/busy");
        tokio::spawn(async move {
            let mut statuses = Vec::new();
            for n in 0..200 {
                let answer = client.post(&url).json(&json!({"n": n})).send().await;
                let status = answer.map(|a| a.status().as_u16()).unwrap_or(0);
                statuses.push(status);
                if status == 404 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            statuses
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    e.delete("/busy").await?.expect(200, "DELETE /busy while it is used")?;
    let statuses = writer.await.map_err(|err| Failed::from(format!("writer: {err}")))?;
    check(statuses.iter().all(|s| *s == 201 || *s == 404), || format!("writers saw only 201 then 404: {statuses:?}"))?;
    check(statuses.last() == Some(&404), || format!("the writer ended on 404: {statuses:?}"))?;
    // The feed ends with CouchDB's ordinary closing (no error row).
    let mut text = String::new();
    let ended = tokio::time::timeout(Duration::from_secs(15), async {
        while let Some(chunk) = feed.next().await {
            match chunk {
                Ok(bytes) => text.push_str(&String::from_utf8_lossy(&bytes)),
                Err(_) => break,
            }
        }
    })
    .await;
    check(ended.is_ok(), || format!("the feed did not end after the delete: {text}"))?;
    let last = text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or_default().to_owned();
    check(super::missing_database::closes_a_deleted_feed(&last), || {
        format!("the feed's last line is CouchDB's closing: {last:?}")
    })?;
    e.get("/busy").await?.expect(404, "gone")?;
    e.call(Method::PUT, "/busy", None).await?.expect(201, "created again")?;
    let again = e.get("/busy").await?.expect(200, "GET again")?;
    check(again.body["doc_count"] == 0, || format!("nothing of the deleted database remains: {}", again.body))?;
    e.get("/bystander/kept").await?.expect(200, "other databases untouched")?;
    Ok(())
}

pub(super) async fn server_probes(e: Endpoint) -> TestResult {
    let tasks = e.get("/_active_tasks").await?.expect(200, "_active_tasks")?;
    check(tasks.body == json!([]), || format!("_active_tasks: {}", tasks.body))?;
    let members = e.get("/_membership").await?.expect(200, "_membership")?;
    check(members.body["all_nodes"].as_array().is_some_and(|n| n.len() == 1), || format!("{}", members.body))?;
    let jobs = e.get("/_scheduler/jobs").await?.expect(200, "_scheduler/jobs")?;
    check(jobs.body["jobs"] == json!([]), || format!("_scheduler/jobs: {}", jobs.body))?;
    e.get("/_node/_local").await?.expect(200, "_node/_local")?;
    if !kept_here(&e) {
        return Ok(());
    }
    e.call(Method::PUT, "/events", None).await?.expect(201, "PUT /events")?;
    e.put("/events/a", json!({})).await?.expect(201, "PUT a")?;
    let stream = e
        .client
        .get(e.url("/events/_changes?feed=eventsource&timeout=100"))
        .send()
        .await
        .map_err(|err| Failed::from(format!("eventsource: {err}")))?;
    let content_type = stream.headers().get("content-type").and_then(|v| v.to_str().ok()).map(str::to_owned);
    check(content_type.as_deref() == Some("text/event-stream"), || {
        format!("eventsource content type: {content_type:?}")
    })?;
    let text = stream.text().await.map_err(|err| Failed::from(format!("eventsource body: {err}")))?;
    check(text.starts_with("data: {") && text.contains("\nid: "), || format!("eventsource: {text:?}"))
}
