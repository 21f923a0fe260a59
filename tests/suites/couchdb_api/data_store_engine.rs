//! The data-store database served by the engine through the databases' handlers (issue 35 §2):
//! a per-user login confined to its own documents on every read path, an admin's replication
//! answered as CouchDB 3.4.3 answers it, the REST API reading what the CouchDB face wrote, and
//! two servers over one store editing one document from the same revision: one 201, one 409.

use super::logins::PASSWORD;
use super::*;

/// A request as `user` (Basic, [`PASSWORD`]).
fn as_user(e: &Endpoint, user: &str, method: Method, path: &str) -> reqwest::RequestBuilder {
    e.client.request(method, e.url(path)).basic_auth(user, Some(PASSWORD))
}

/// A per-user login reads, lists, `_bulk_get`s, `_revs_diff`s and `_missing_revs`es none of
/// another user's documents, writes none, and its local documents are its own.
pub(super) async fn per_user_confined_on_every_read(e: Endpoint) -> TestResult {
    let alices = doc("alice", "ns", "mine", json!(1));
    let bobs = doc("bob", "ns", "his", json!(2));
    let seeded = as_user(&e, "admin", Method::POST, &format!("/{DB}/_bulk_docs"))
        .json(&json!({ "docs": [alices.clone(), bobs.clone()] }))
        .send()
        .await?;
    let seeded = Answer::read(seeded).await?.expect(201, "admin seeds")?;
    let bob_rev = seeded.body[1]["rev"].as_str().unwrap_or_default().to_owned();
    let (alice_id, bob_id) = (alices["_id"].as_str().unwrap_or_default(), bobs["_id"].as_str().unwrap_or_default());

    let read = Answer::read(as_user(&e, "alice", Method::GET, &path_of(bob_id)).send().await?).await?;
    check(read.status == StatusCode::FORBIDDEN && read.body["error"] == "forbidden", || {
        format!("alice GETs bob's: {} {}", read.status, read.body)
    })?;
    let leaves = as_user(&e, "alice", Method::GET, &format!("{}?open_revs=all", path_of(bob_id)))
        .header("accept", "application/json")
        .send()
        .await?;
    check(leaves.status() == StatusCode::FORBIDDEN, || format!("alice's open_revs=all of bob's: {}", leaves.status()))?;

    let bulk_get = as_user(&e, "alice", Method::POST, &format!("/{DB}/_bulk_get"))
        .json(&json!({ "docs": [{ "id": bob_id }, { "id": alice_id }] }))
        .send()
        .await?;
    let bulk_get = Answer::read(bulk_get).await?.expect(200, "alice _bulk_get")?;
    check(
        bulk_get.body["results"][0]["docs"][0]["error"]["error"] == "forbidden"
            && bulk_get.body["results"][0]["docs"][0].get("ok").is_none()
            && bulk_get.body["results"][1]["docs"][0]["ok"]["_id"] == alice_id,
        || format!("alice's _bulk_get: {}", bulk_get.body),
    )?;

    let asked = json!({ bob_id: [bob_rev.clone(), format!("9-{}", "a".repeat(32))], alice_id: [format!("9-{}", "a".repeat(32))] });
    for (endpoint, field) in [("_revs_diff", None), ("_missing_revs", Some("missing_revs"))] {
        let answer = as_user(&e, "alice", Method::POST, &format!("/{DB}/{endpoint}")).json(&asked).send().await?;
        let answer = Answer::read(answer).await?.expect(200, endpoint)?;
        let listed = field.map_or(&answer.body, |field| &answer.body[field]);
        check(listed.get(bob_id).is_none() && listed.get(alice_id).is_some(), || {
            format!("alice's {endpoint} names only her own: {}", answer.body)
        })?;
    }

    let mut takeover = bobs.clone();
    takeover["_rev"] = json!(bob_rev);
    let written = as_user(&e, "alice", Method::POST, &format!("/{DB}/_bulk_docs"))
        .json(&json!({ "docs": [takeover] }))
        .send()
        .await?;
    let written = Answer::read(written).await?.expect(201, "alice _bulk_docs bob's")?;
    check(written.body[0]["error"] == "forbidden", || format!("alice writes bob's in bulk: {}", written.body))?;

    let keys = as_user(&e, "alice", Method::POST, &format!("/{DB}/_all_docs"))
        .json(&json!({ "keys": [bob_id, alice_id] }))
        .send()
        .await?;
    let keys = Answer::read(keys).await?.expect(200, "alice _all_docs keys")?;
    check(keys.body["rows"][0]["error"] == "not_found" && keys.body["rows"][1]["id"] == alice_id, || {
        format!("alice's _all_docs keys: {}", keys.body)
    })?;

    for user in ["alice", "bob"] {
        let put = as_user(&e, user, Method::PUT, &format!("/{DB}/_local/checkpoint"))
            .json(&json!({ "owner": user }))
            .send()
            .await?;
        Answer::read(put).await?.expect(201, "a checkpoint")?;
    }
    let own = Answer::read(as_user(&e, "alice", Method::GET, &format!("/{DB}/_local/checkpoint")).send().await?)
        .await?
        .expect(200, "alice's checkpoint")?;
    check(own.body["owner"] == "alice" && own.body["_id"] == "_local/checkpoint", || {
        format!("alice reads her own checkpoint under its name: {}", own.body)
    })?;
    let listed = Answer::read(as_user(&e, "alice", Method::GET, &format!("/{DB}/_local_docs")).send().await?).await?;
    if e.backend == "couchdb" && listed.status == StatusCode::NOT_IMPLEMENTED {
        // pouchdb-server, the suite's CouchDB, has no local-document listing to pass on.
        println!("couchdb: _local_docs refused by the backend: {}", listed.body);
    } else {
        let listed = listed.expect(200, "alice _local_docs")?;
        check(
            listed.body["rows"].as_array().is_some_and(|rows| rows.len() == 1 && rows[0]["id"] == "_local/checkpoint"),
            || format!("alice lists her own checkpoint only: {}", listed.body),
        )?;
    }
    let stored =
        Answer::read(as_user(&e, "admin", Method::GET, &format!("/{DB}/_local/alice:checkpoint")).send().await?)
            .await?
            .expect(200, "alice's checkpoint as the admin sees it")?;
    check(stored.body["owner"] == "alice", || format!("stored under alice: {}", stored.body))
}

/// An admin's replication of the data-store database (PouchDB's: `_bulk_docs` with
/// `new_edits: false` making a conflict, then `_revs_diff` and `open_revs=all`) answers as a
/// CouchDB 3.4.3 answered the same requests.
pub(super) async fn admin_replication_as_couchdb(e: Endpoint) -> TestResult {
    let first = doc("user_r", "ns", "replicated", json!(1));
    let id = first["_id"].as_str().unwrap_or_default().to_owned();
    let rev1 = e.put(&path_of(&id), first.clone()).await?.expect(201, "the first revision")?.rev()?;
    let root = rev1.split_once('-').map(|(_, hash)| hash.to_owned()).unwrap_or_default();
    let (a, b) = ("a".repeat(32), "b".repeat(32));
    let branch = |hash: &str, value: i64| {
        let mut doc = doc("user_r", "ns", "replicated", json!(value));
        doc["_rev"] = json!(format!("2-{hash}"));
        doc["_revisions"] = json!({ "start": 2, "ids": [hash, root.clone()] });
        doc
    };
    let written = e
        .post(&format!("/{DB}/_bulk_docs"), json!({ "new_edits": false, "docs": [branch(&a, 2), branch(&b, 3)] }))
        .await?;
    let written = written.expect(201, "two replicated branches")?;
    check(written.body == json!([]), || format!("new_edits=false answers the failures only: {}", written.body))?;

    let (c, d) = (format!("2-{}", "c".repeat(32)), format!("3-{}", "d".repeat(32)));
    let asked = json!({ id.clone(): [format!("2-{a}"), format!("2-{b}"), c.clone(), d.clone(), rev1.clone()] });
    let diff = e.post(&format!("/{DB}/_revs_diff"), asked).await?.expect(200, "_revs_diff")?;
    let expected =
        json!({ id.clone(): { "missing": [c, d], "possible_ancestors": [format!("2-{b}"), format!("2-{a}")] } });
    check(diff.body == expected, || format!("_revs_diff: {} (CouchDB: {expected})", diff.body))?;

    let leaves = e
        .client
        .get(e.url(&format!("{}?open_revs=all", path_of(&id))))
        .header("accept", "application/json")
        .send()
        .await?;
    let leaves = Answer::read(leaves).await?.expect(200, "open_revs=all")?;
    let shown = |hash: &str, value: i64| {
        json!({ "ok": { "_id": id, "_rev": format!("2-{hash}"), "userId": "user_r", "namespace": "ns",
                        "key": "replicated", "value": value } })
    };
    let expected = json!([shown(&a, 2), shown(&b, 3)]);
    check(leaves.body == expected, || format!("open_revs=all: {} (CouchDB: {expected})", leaves.body))?;
    let winner = e.get(&format!("{}?conflicts=true", path_of(&id))).await?.expect(200, "conflicts=true")?;
    check(winner.body["_rev"] == format!("2-{b}") && winner.body["_conflicts"] == json!([format!("2-{a}")]), || {
        format!("the winner and its conflict: {}", winner.body)
    })
}

/// What the CouchDB face writes to the data-store database, the REST API (the facade) reads:
/// a created document, its edit, a replicated conflict's winner and a deletion.
pub(super) async fn rest_reads_what_couchdb_wrote(e: Endpoint) -> TestResult {
    let store = DataStore::open(Arc::clone(&e._ctx.backend), StoreOptions::default()).await?;
    let created = doc("user_w", "ns", "shared", json!({"n": 1}));
    let id = created["_id"].as_str().unwrap_or_default().to_owned();
    e.put(&path_of(&id), created.clone()).await?.expect(201, "created")?;
    // A REST read counts an access: a revision of its own, which the CouchDB face reads next.
    let read = store.get("user_w", "ns", "shared", None).await.map_err(|e| format!("get: {e}"))?;
    check(read.as_ref().is_some_and(|d| d.body["value"] == json!({"n": 1})), || {
        format!("the REST face reads the created document: {read:?}")
    })?;
    let mut edited = e.get(&path_of(&id)).await?.expect(200, "the accessed document")?.body;
    edited["value"] = json!({"n": 2});
    e.put(&path_of(&id), edited).await?.expect(201, "edited")?;
    let read = store.get("user_w", "ns", "shared", None).await.map_err(|e| format!("get: {e}"))?;
    check(read.as_ref().is_some_and(|d| d.body["value"] == json!({"n": 2})), || {
        format!("the REST face reads the edit: {read:?}")
    })?;
    let rev = e.get(&path_of(&id)).await?.expect(200, "the accessed edit")?.body["_rev"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let (generation, hash) = rev.split_once('-').unwrap_or_default();
    let next = generation.parse::<u64>().unwrap_or_default() + 1;
    let mut branch = doc("user_w", "ns", "shared", json!({"n": 3}));
    let z = "f".repeat(32);
    branch["_rev"] = json!(format!("{next}-{z}"));
    branch["_revisions"] = json!({ "start": next, "ids": [z, hash] });
    e.post(&format!("/{DB}/_bulk_docs"), json!({ "new_edits": false, "docs": [branch] }))
        .await?
        .expect(201, "a replicated revision")?;
    let read = store.get("user_w", "ns", "shared", None).await.map_err(|e| format!("get: {e}"))?;
    check(read.as_ref().is_some_and(|d| d.body["value"] == json!({"n": 3})), || {
        format!("the REST face reads the replicated winner: {read:?}")
    })?;
    let current = e.get(&path_of(&id)).await?.expect(200, "the winner")?;
    let winner_rev = current.body["_rev"].as_str().unwrap_or_default().to_owned();
    e.delete(&format!("{}?rev={winner_rev}", path_of(&id))).await?.expect(200, "deleted")?;
    let read = store.get("user_w", "ns", "shared", None).await.map_err(|e| format!("get: {e}"))?;
    check(read.is_none(), || format!("the REST face no longer reads the deleted document: {read:?}"))
}

/// Two servers over one store (two processes, as far as the engine knows: each its own write
/// queues) edit one data-store document from the same `_rev` at once: exactly one 201 and one
/// 409, and the document has one leaf, never two acknowledged siblings. On the CouchDB backend
/// the backend itself decides (its layout writes an edit as CouchDB's own, checked against the
/// parent); elsewhere the layout's compare-and-swap does.
pub(super) async fn concurrent_edits_one_wins(e: Endpoint) -> TestResult {
    let other = e.beside().await?;
    let first = doc("user_x", "ns", "contended", json!(0));
    let id = first["_id"].as_str().unwrap_or_default().to_owned();
    e.put(&path_of(&id), first.clone()).await?.expect(201, "created")?;
    for round in 1..=5 {
        let current = e.get(&path_of(&id)).await?.expect(200, "current")?.body["_rev"].clone();
        let edit = |value: i64| {
            let mut body = first.clone();
            body["_rev"] = json!(current);
            body["value"] = json!(value);
            body
        };
        let path = path_of(&id);
        let (one, two) = tokio::join!(e.put(&path, edit(round * 10 + 1)), other.put(&path, edit(round * 10 + 2)));
        let mut statuses = [one?.status.as_u16(), two?.status.as_u16()];
        statuses.sort_unstable();
        check(statuses == [201, 409], || format!("round {round}: two edits of {current} answered {statuses:?}"))?;
        let leaves = e
            .client
            .get(e.url(&format!("{}?open_revs=all", path_of(&id))))
            .header("accept", "application/json")
            .send()
            .await?;
        let leaves = Answer::read(leaves).await?.expect(200, "open_revs=all")?;
        check(leaves.body.as_array().map(Vec::len) == Some(1), || format!("round {round}: leaves {}", leaves.body))?;
    }
    Ok(())
}

/// An edit naming a deleted leaf of a live document (a conflict deleted, then edited again) is
/// taken, as CouchDB 3.4.3 takes it: 201, the new revision the deleted leaf's child, the winner
/// (a higher generation), the other live branch its conflict.
pub(super) async fn edit_of_a_deleted_leaf(e: Endpoint) -> TestResult {
    let first = doc("user_d", "ns", "revived", json!(1));
    let id = first["_id"].as_str().unwrap_or_default().to_owned();
    let rev1 = e.put(&path_of(&id), first.clone()).await?.expect(201, "the first revision")?.rev()?;
    let root = rev1.split_once('-').map(|(_, hash)| hash.to_owned()).unwrap_or_default();
    let (a, b) = ("a".repeat(32), "b".repeat(32));
    let branch = |hash: &str, value: i64| {
        let mut doc = doc("user_d", "ns", "revived", json!(value));
        doc["_rev"] = json!(format!("2-{hash}"));
        doc["_revisions"] = json!({ "start": 2, "ids": [hash, root.clone()] });
        doc
    };
    e.post(&format!("/{DB}/_bulk_docs"), json!({ "new_edits": false, "docs": [branch(&a, 2), branch(&b, 3)] }))
        .await?
        .expect(201, "two replicated branches")?;
    let deleted = e.delete(&format!("{}?rev=2-{a}", path_of(&id))).await?.expect(200, "the losing branch deleted")?;
    let mut revived = first.clone();
    revived["_rev"] = json!(deleted.rev()?);
    revived["value"] = json!(9);
    let edited = e.put(&path_of(&id), revived).await?.expect(201, "an edit of the deleted leaf")?.rev()?;
    check(edited.starts_with("4-"), || format!("the deleted leaf's child: {edited}"))?;
    let winner = e.get(&format!("{}?conflicts=true", path_of(&id))).await?.expect(200, "conflicts=true")?;
    check(winner.body["_rev"] == edited && winner.body["_conflicts"] == json!([format!("2-{b}")]), || {
        format!("the edit wins, 2-{b} its conflict: {}", winner.body)
    })
}
