//! `_purge` of a document's last leaf on a database besides the data-store one (issue 35): it
//! erases that one id and nothing of any other, ids that start with it included (their
//! documents, tombstones and feed entries stay), and the feed does not move back: a position a
//! replicator checkpointed before the purge still reads every later write, `update_seq` does
//! not decrease, and the feed's `last_seq` after the purge is at its end. The expected answers
//! are Apache CouchDB 3.4.3's (checked against one by hand: there `_changes` `last_seq` may show a
//! smaller count after such a purge, so the count is compared on the embedded store only, whose
//! count is its exact position). On the CouchDB backend the databases are CouchDB's own, and the
//! server behind it here is pouchdb-server, which has no `_purge`: nothing to check there.

use libtest_mimic::Failed;
use serde_json::{json, Value};

use super::{fresh_db_named, Answer, Endpoint};
use crate::common::{check, TestResult};

/// The ids of a `_changes` answer's rows, each with whether it is a deletion.
fn changed(answer: &Answer) -> Vec<(String, bool)> {
    let rows = answer.body["results"].as_array().cloned().unwrap_or_default();
    rows.iter().map(|row| (row["id"].as_str().unwrap_or_default().to_owned(), row["deleted"] == true)).collect()
}

/// The `N` of a shown position `N-opaque` (how far the feed is, by CouchDB 3's form).
fn position_count(seq: &Value) -> Result<u64, Failed> {
    let text = seq.as_str().ok_or_else(|| format!("a position that is not a string: {seq}"))?;
    let digits: String = text.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().map_err(|_| format!("a position without its count: {text}").into())
}

async fn changes_since(e: &Endpoint, db: &str, since: Option<&Value>) -> Result<Answer, Failed> {
    let query = match since.and_then(Value::as_str) {
        Some(seq) => {
            format!("?since={}", percent_encoding::utf8_percent_encode(seq, percent_encoding::NON_ALPHANUMERIC))
        }
        None => String::new(),
    };
    e.get(&format!("/{db}/_changes{query}")).await?.expect(200, "_changes")
}

async fn update_seq(e: &Endpoint, db: &str) -> Result<u64, Failed> {
    let info = e.get(&format!("/{db}")).await?.expect(200, "GET /db")?;
    position_count(&info.body["update_seq"])
}

/// Creates `id` and answers its revision.
async fn create(e: &Endpoint, db: &str, id: &str, body: Value) -> Result<String, Failed> {
    e.put(&format!("/{db}/{id}"), body).await?.expect(201, &format!("PUT {id}"))?.rev()
}

/// Purges `id`'s revision `rev`, which must be all CouchDB's answer names.
async fn purge(e: &Endpoint, db: &str, id: &str, rev: &str) -> TestResult {
    let purged = e.post(&format!("/{db}/_purge"), json!({ id: [rev] })).await?.expect(201, &format!("purge {id}"))?;
    let wanted = json!({ "purge_seq": null, "purged": { id: [rev] } });
    check(purged.body == wanted, || format!("purge {id}: {} (CouchDB answers {wanted})", purged.body))
}

/// `abcd` created and deleted, `abc` created, `abc`'s only leaf purged: the deletion of `abcd`
/// stays in the feed, and the feed does not go back.
pub(super) async fn purge_keeps_other_ids_history(e: Endpoint) -> TestResult {
    if e.backend == "couchdb" {
        return Ok(());
    }
    let db = fresh_db_named(&e, "purge", "history").await?;
    let abcd = create(&e, &db, "abcd", json!({})).await?;
    e.delete(&format!("/{db}/abcd?rev={abcd}")).await?.expect(200, "DELETE abcd")?;
    let abc = create(&e, &db, "abc", json!({})).await?;
    let before = changes_since(&e, &db, None).await?;
    let (checkpoint, update_seq_before) = (before.body["last_seq"].clone(), update_seq(&e, &db).await?);

    purge(&e, &db, "abc", &abc).await?;
    let after = changes_since(&e, &db, None).await?;
    check(changed(&after) == [("abcd".to_owned(), true)], || {
        format!("after purging abc, the feed must still list abcd's deletion (only): {}", after.body)
    })?;
    // `N` never goes back: the embedded store's is its exact position, other backends' the
    // position's rank in the feed counting the entries purges took out (`database::seq`). That
    // the position itself does not go back is checked below: a checkpoint reads on.
    let update_seq_after = update_seq(&e, &db).await?;
    check(update_seq_after >= update_seq_before, || {
        format!("update_seq went back from {update_seq_before} to {update_seq_after} with the purge")
    })?;
    let (was, is) = (position_count(&checkpoint)?, position_count(&after.body["last_seq"])?);
    check(is >= was, || format!("_changes last_seq went back from {was} to {is} with the purge"))?;
    let at_end = changes_since(&e, &db, Some(&after.body["last_seq"])).await?;
    check(changed(&at_end).is_empty(), || {
        format!("the feed's last_seq after the purge is not its end: {}", at_end.body)
    })?;
    let e404 = e.get(&format!("/{db}/abc")).await?.expect(404, "GET abc after its purge")?;
    check(e404.body == json!({"error": "not_found", "reason": "missing"}), || format!("GET abc: {}", e404.body))?;
    let deleted = e.get(&format!("/{db}/abcd")).await?.expect(404, "GET abcd")?;
    check(deleted.body == json!({"error": "not_found", "reason": "deleted"}), || {
        format!("GET abcd: {}", deleted.body)
    })?;

    // A replicator's checkpoint from before the purge reads the next write, and only it.
    create(&e, &db, "later", json!({})).await?;
    for (what, since) in [("before the purge", &checkpoint), ("after the purge", &after.body["last_seq"])] {
        let next = changes_since(&e, &db, Some(since)).await?;
        check(changed(&next) == [("later".to_owned(), false)], || {
            format!("from the last_seq {what} ({since}), the feed must show the later write only: {}", next.body)
        })?;
    }
    Ok(())
}

/// Purging `xyz` while `xyz1` (live) and `xyz2` (deleted) exist: 201, and both stay as they were
/// in the document, `_changes` and `_all_docs`.
pub(super) async fn purge_leaves_ids_starting_with_it(e: Endpoint) -> TestResult {
    if e.backend == "couchdb" {
        return Ok(());
    }
    let db = fresh_db_named(&e, "purge", "prefix").await?;
    let xyz1 = create(&e, &db, "xyz1", json!({"v": 1})).await?;
    let xyz2 = create(&e, &db, "xyz2", json!({})).await?;
    e.delete(&format!("/{db}/xyz2?rev={xyz2}")).await?.expect(200, "DELETE xyz2")?;
    let xyz = create(&e, &db, "xyz", json!({})).await?;

    purge(&e, &db, "xyz", &xyz).await?;
    e.get(&format!("/{db}/xyz")).await?.expect(404, "GET xyz after its purge")?;
    let kept = e.get(&format!("/{db}/xyz1")).await?.expect(200, "GET xyz1")?;
    let wanted = json!({"_id": "xyz1", "_rev": xyz1, "v": 1});
    check(kept.body == wanted, || format!("xyz1 after purging xyz: {} (wanted {wanted})", kept.body))?;
    let feed = changes_since(&e, &db, None).await?;
    // In id order: a sharded CouchDB database lists its shards' changes in no global order.
    let mut rows = changed(&feed);
    rows.sort();
    let wanted = [("xyz1".to_owned(), false), ("xyz2".to_owned(), true)];
    check(rows == wanted, || format!("the feed after purging xyz: {}", feed.body))?;
    let listed = e.get(&format!("/{db}/_all_docs")).await?.expect(200, "_all_docs")?;
    let wanted = json!({"total_rows": 1, "offset": 0, "rows": [{"id": "xyz1", "key": "xyz1", "value": {"rev": xyz1}}]});
    check(listed.body == wanted, || format!("_all_docs after purging xyz: {} (wanted {wanted})", listed.body))
}
