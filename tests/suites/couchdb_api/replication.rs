//! What a replication peer needs: `_revs_diff`, `new_edits=false` writes (a fast-forward, the
//! higher branch winning, a foreign document refused per document), `_bulk_get` with `revs` and
//! `latest`, and `_ensure_full_commit`.

use super::*;

pub(super) async fn replication_peer(e: Endpoint) -> TestResult {
    let original = doc("user_r", "rep", "a", json!("one"));
    let id = original["_id"].as_str().unwrap_or_default().to_owned();
    let created = e.put(&path_of(&id), original.clone()).await?.expect(201, "create")?;
    let rev1 = created.rev()?;
    let hex = |c: char| std::iter::repeat_n(c, 32).collect::<String>();
    let diff = e
        .post(&format!("/{DB}/_revs_diff"), json!({ id.clone(): [rev1, format!("2-{}", hex('a'))] }))
        .await?
        .expect(200, "_revs_diff")?;
    // CouchDB adds the leaves below the highest missing generation as `possible_ancestors`
    // (`couch_db:possible_ancestors/2`): here the document's one leaf, generation 1.
    let expected = json!({ id.clone(): { "missing": [format!("2-{}", hex('a'))], "possible_ancestors": [rev1] } });
    check(diff.body == expected, || format!("_revs_diff: {}", diff.body))?;
    // Fast-forward: a revision whose history holds the current one.
    let rev1_hash = rev1.split_once('-').map(|(_, h)| h.to_owned()).unwrap_or_default();
    let mut forward = original.clone();
    forward["_rev"] = json!(format!("2-{}", hex('a')));
    forward["_revisions"] = json!({"start": 2, "ids": [hex('a'), rev1_hash]});
    forward["value"] = json!("two");
    let answer = e
        .post(&format!("/{DB}/_bulk_docs"), json!({"docs": [forward.clone()], "new_edits": false}))
        .await?
        .expect(201, "new_edits=false")?;
    check(answer.body == json!([]), || format!("new_edits=false lists errors only: {}", answer.body))?;
    let current = e.get(&path_of(&id)).await?.expect(200, "after fast-forward")?;
    check(current.body["_rev"] == forward["_rev"] && current.body["value"] == "two", || {
        format!("fast-forward: {}", current.body)
    })?;
    // A replicator asks for the revision it saw in the feed with latest=true: a document changed
    // since answers with its newer revision, as CouchDB answers with the branch's leaf.
    let stale = json!({"docs": [{"id": id, "rev": rev1}]});
    let latest =
        e.post(&format!("/{DB}/_bulk_get?revs=true&latest=true"), stale.clone()).await?.expect(200, "latest=true")?;
    check(latest.body["results"][0]["docs"][0]["ok"]["_rev"] == forward["_rev"], || {
        format!("latest=true: {}", latest.body)
    })?;
    let exact = e.post(&format!("/{DB}/_bulk_get?revs=true"), stale).await?.expect(200, "an old revision")?;
    check(exact.body["results"][0]["docs"][0]["error"]["error"] == "not_found", || {
        format!("old revision: {}", exact.body)
    })?;
    // Known again: nothing changes.
    e.post(&format!("/{DB}/_bulk_docs"), json!({"docs": [forward.clone()], "new_edits": false}))
        .await?
        .expect(201, "again")?;
    // A divergent branch with a lower revision id loses; a higher one wins.
    let mut loser = original.clone();
    loser["_rev"] = json!(format!("2-{}", hex('0')));
    loser["_revisions"] =
        json!({"start": 2, "ids": [hex('0'), rev1.split_once('-').map(|(_, h)| h).unwrap_or_default()]});
    loser["value"] = json!("loser");
    let mut winner = loser.clone();
    winner["_rev"] = json!(format!("2-{}", hex('f')));
    winner["_revisions"]["ids"][0] = json!(hex('f'));
    winner["value"] = json!("winner");
    e.post(&format!("/{DB}/_bulk_docs"), json!({"docs": [loser], "new_edits": false})).await?.expect(201, "loser")?;
    let kept = e.get(&path_of(&id)).await?.expect(200, "after loser")?;
    check(kept.body["value"] == "two", || format!("the lower branch must lose: {}", kept.body))?;
    e.post(&format!("/{DB}/_bulk_docs"), json!({"docs": [winner], "new_edits": false})).await?.expect(201, "winner")?;
    let won = e.get(&path_of(&id)).await?.expect(200, "after winner")?;
    check(won.body["value"] == "winner", || format!("the higher branch must win: {}", won.body))?;
    // A foreign document is a per-document forbidden, which replicators skip.
    let foreign = json!({"_id": "not-a-data-doc", "_rev": format!("1-{}", hex('b')), "x": 1});
    let refused = e
        .post(&format!("/{DB}/_bulk_docs"), json!({"docs": [foreign], "new_edits": false}))
        .await?
        .expect(201, "foreign")?;
    check(refused.body[0]["error"] == "forbidden", || format!("foreign: {}", refused.body))?;
    let commit = e.post(&format!("/{DB}/_ensure_full_commit"), json!({})).await?.expect(201, "_ensure_full_commit")?;
    check(commit.body["instance_start_time"] == "0", || format!("{}", commit.body))
}

/// The data-store database keeps conflicts as CouchDB does: a replicated branch that loses is
/// kept with its body (`?conflicts`, `?rev=`, `?open_revs=all`, `_revs_diff`, `_bulk_get`,
/// `_changes?style=all_docs`), deleting it resolves the conflict, deleting the winner makes the
/// best live conflict the winner, and the local documents that hold the branches are no client's.
pub(super) async fn data_store_conflicts(e: Endpoint) -> TestResult {
    let original = doc("user_c", "conf", "a", json!("one"));
    let id = original["_id"].as_str().unwrap_or_default().to_owned();
    let rev1 = e.put(&path_of(&id), original.clone()).await?.expect(201, "create")?.rev()?;
    let root = rev1.split_once('-').map(|(_, hash)| hash.to_owned()).unwrap_or_default();
    let hex = |c: char| std::iter::repeat_n(c, 32).collect::<String>();
    let branch = |c: char, value: &str| {
        let mut doc = original.clone();
        doc["_rev"] = json!(format!("2-{}", hex(c)));
        doc["_revisions"] = json!({"start": 2, "ids": [hex(c), root.clone()]});
        doc["value"] = json!(value);
        doc
    };
    let docs = json!([branch('c', "middle"), branch('f', "winner"), branch('0', "lowest")]);
    e.post(&format!("/{DB}/_bulk_docs"), json!({"docs": docs, "new_edits": false}))
        .await?
        .expect(201, "three branches")?;
    let (winner, middle, lowest) = (format!("2-{}", hex('f')), format!("2-{}", hex('c')), format!("2-{}", hex('0')));
    let read = e.get(&format!("{}?conflicts=true", path_of(&id))).await?.expect(200, "conflicts=true")?;
    check(read.body["_rev"] == json!(winner) && read.body["_conflicts"] == json!([middle, lowest]), || {
        format!("the winner with its conflicts: {}", read.body)
    })?;
    let loser = e.get(&format!("{}?rev={lowest}", path_of(&id))).await?.expect(200, "a losing leaf")?;
    check(loser.body["value"] == "lowest", || format!("a losing leaf keeps its body: {}", loser.body))?;
    let leaves = e.get(&format!("{}?open_revs=all", path_of(&id))).await?.expect(200, "open_revs=all")?;
    check(leaves.body.as_array().map(Vec::len) == Some(3), || format!("open_revs=all: {}", leaves.body))?;
    let diff = e
        .post(&format!("/{DB}/_revs_diff"), json!({ id.clone(): [lowest, format!("3-{}", hex('9'))] }))
        .await?
        .expect(200, "_revs_diff")?;
    check(diff.body[&id]["missing"] == json!([format!("3-{}", hex('9'))]), || format!("_revs_diff: {}", diff.body))?;
    let fetched = e
        .post(&format!("/{DB}/_bulk_get"), json!({"docs": [{"id": id, "rev": middle}]}))
        .await?
        .expect(200, "_bulk_get of a conflict")?;
    check(fetched.body["results"][0]["docs"][0]["ok"]["value"] == "middle", || format!("{}", fetched.body))?;
    let feed = e
        .get(&format!("/{DB}/_changes?style=all_docs&filter=_doc_ids&doc_ids=[\"{id}\"]"))
        .await?
        .expect(200, "_changes?style=all_docs")?;
    check(feed.body["results"][0]["changes"].as_array().map(Vec::len) == Some(3), || {
        format!("every leaf in the feed: {}", feed.body)
    })?;
    let listed = e
        .get(&format!("/{DB}/_all_docs?include_docs=true&conflicts=true&startkey=\"{id}\"&endkey=\"{id}\""))
        .await?
        .expect(200, "_all_docs?conflicts=true")?;
    check(listed.body["rows"][0]["doc"]["_conflicts"] == json!([middle, lowest]), || {
        format!("_all_docs with conflicts: {}", listed.body)
    })?;
    // Resolving: deleting a losing leaf leaves the others.
    e.delete(&format!("{}?rev={lowest}", path_of(&id))).await?.expect(200, "delete a conflict")?;
    let after = e.get(&format!("{}?conflicts=true&deleted_conflicts=true", path_of(&id))).await?.expect(200, "read")?;
    check(
        after.body["_rev"] == json!(winner)
            && after.body["_conflicts"] == json!([middle])
            && after.body["_deleted_conflicts"].as_array().map(Vec::len) == Some(1),
        || format!("one conflict resolved: {}", after.body),
    )?;
    // Deleting the winner makes the live conflict the winner, as in CouchDB.
    e.delete(&format!("{}?rev={winner}", path_of(&id))).await?.expect(200, "delete the winner")?;
    let promoted = e.get(&path_of(&id)).await?.expect(200, "the conflict won")?;
    check(promoted.body["_rev"] == json!(middle) && promoted.body["value"] == "middle", || {
        format!("promoted: {}", promoted.body)
    })?;
    let reserved = e.put(&format!("/{DB}/_local/:leaves:{id}"), json!({"x": 1})).await?;
    check(reserved.status == 403, || format!("a reserved local name: {} {}", reserved.status, reserved.body))
}
