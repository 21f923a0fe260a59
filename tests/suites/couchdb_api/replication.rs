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
    check(diff.body == json!({ id.clone(): { "missing": [format!("2-{}", hex('a'))] } }), || {
        format!("_revs_diff: {}", diff.body)
    })?;
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
