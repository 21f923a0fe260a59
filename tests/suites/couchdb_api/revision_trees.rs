//! What one document's revision tree may cost on a database besides the data-store one
//! (issue 34): a replicator's branches, each sent with its parent only, are stored with each
//! revision once (the stored record grows with what was sent, not branches × history length),
//! and a tree whose reads would hold more than `couchdb_max_tree_bytes` is refused with 413
//! naming the setting. The data-store database's trees are held to the same setting. On the
//! CouchDB backend the databases are CouchDB's own: nothing to check.

use libtest_mimic::Failed;
use serde_json::{json, Value};

use super::{fresh_db_named, Endpoint, DB};
use crate::common::{check, TestResult};

/// A bound small enough for a trial: 4 MiB of a tree as reads hold it.
pub(super) const TREE_BOUND_CONFIG: &str = "couchdb_max_tree_bytes = 4194304\n";

/// Revisions in the comb's history.
const HISTORY: u64 = 1000;

/// The id of the comb's revision of generation `generation`.
fn spine_id(generation: u64) -> String {
    format!("{generation:032x}")
}

/// A branch of one revision off the history's revision of generation `parent`, sent as a
/// replicator sends it: the new revision and its parent only.
fn branch(parent: u64, tag: u64) -> Value {
    let id = format!("b{tag:031x}");
    json!({
        "_id": "comb",
        "_rev": format!("{}-{id}", parent + 1),
        "_revisions": {"start": parent + 1, "ids": [id, spine_id(parent)]},
        "branch": tag,
    })
}

/// The bytes the document's stored record holds (its JSON).
async fn stored_bytes(e: &Endpoint, db: &str, id: &str) -> Result<usize, Failed> {
    let name = agentstore::backend::catalog::DbName::parse(db).map_err(|err| err.to_string())?;
    let database = e.databases.open(&name).await?.ok_or("the database is not open")?;
    let record = database.backend().get(id).await?.ok_or("no record")?;
    Ok(serde_json::to_vec(&record.body)?.len())
}

pub(super) async fn revision_tree_cost_follows_what_was_sent(e: Endpoint) -> TestResult {
    if e.backend == "couchdb" {
        return Ok(());
    }
    let db = fresh_db_named(&e, "trees", "comb").await?;
    let history: Vec<String> = (1..=HISTORY).rev().map(spine_id).collect();
    let first = json!({"_id": "comb", "_rev": format!("{HISTORY}-{}", history[0]), "_revisions": {"start": HISTORY, "ids": history}});
    let written = e.post(&format!("/{db}/_bulk_docs"), json!({"docs": [first], "new_edits": false})).await?;
    let written = written.expect(201, "the history")?;
    check(written.body == json!([]), || format!("the history: {}", written.body))?;

    // 60 branches off the newest revisions: about 8 KB sent, each stored leaf's path about
    // 1,000 revisions long (about 2 MB if each leaf kept its own).
    let branches: Vec<Value> = (1..=60).map(|tag| branch(HISTORY - tag, tag)).collect();
    let sent = serde_json::to_vec(&branches)?.len();
    let written = e.post(&format!("/{db}/_bulk_docs"), json!({"docs": branches, "new_edits": false})).await?;
    let written = written.expect(201, "60 branches")?;
    check(written.body == json!([]), || format!("60 branches: {}", written.body))?;
    let stored = stored_bytes(&e, &db, "comb").await?;
    // Each revision once: about 1,060 revisions of about 45 bytes, whatever the branches.
    check(stored < 100_000, || format!("1,060 revisions ({sent} bytes of branches sent) stored in {stored} bytes"))?;
    let leaves = e.get(&format!("/{db}/comb?open_revs=all")).await?.expect(200, "every leaf")?;
    let count = leaves.body.as_array().map_or(0, Vec::len);
    check(count == 61, || format!("{count} leaves read back, wanted 61"))?;
    let second = branch(HISTORY - 2, 2);
    let rev = second["_rev"].as_str().unwrap_or_default();
    let revs = e.get(&format!("/{db}/comb?open_revs=[\"{rev}\"]&revs=true")).await?;
    let revs = revs.expect(200, "a branch with its path")?;
    let path = &revs.body[0]["ok"]["_revisions"];
    check(path["start"] == 999 && path["ids"].as_array().map_or(0, Vec::len) == 999, || {
        format!("the branch {rev} reads back with its whole path: {path}")
    })?;

    // 100 more branches would make every read hold about 5.6 MB: refused, naming the bound.
    let more: Vec<Value> = (61..=160).map(|tag| branch(HISTORY - tag, tag)).collect();
    let refused = e.post(&format!("/{db}/_bulk_docs"), json!({"docs": more, "new_edits": false})).await?;
    let refused = refused.expect(201, "100 branches more")?;
    let rows = refused.body.as_array().cloned().unwrap_or_default();
    check(
        !rows.is_empty()
            && rows.iter().all(|row| {
                row["error"] == "document_too_large"
                    && row["reason"].as_str().is_some_and(|reason| reason.contains("couchdb_max_tree_bytes"))
            }),
        || format!("past the bound: {}", refused.body),
    )?;
    let after = e.get(&format!("/{db}/comb?open_revs=all")).await?.expect(200, "every leaf")?;
    let count = after.body.as_array().map_or(0, Vec::len);
    check(count == 61, || format!("{count} leaves after the refusal, wanted 61 (nothing written)"))?;

    // The document stays writable within the bound: an edit of its winner, a deletion of a branch.
    let winner = e.get(&format!("/{db}/comb")).await?.expect(200, "the winner")?;
    let rev = winner.body["_rev"].as_str().unwrap_or_default().to_owned();
    e.put(&format!("/{db}/comb"), json!({"_rev": rev, "edited": true})).await?.expect(201, "an edit")?;
    Ok(())
}

/// A tree bound of 64 KiB: eight branches of 8 KiB values reach it.
pub(super) const SMALL_TREE_BOUND_CONFIG: &str = "couchdb_max_tree_bytes = 65536\n";

/// The data-store database's trees are held to `couchdb_max_tree_bytes` as every other
/// database's are (issue 34): with it at 64 KiB, a replicator's twelve branches of 8 KiB values
/// would pass it, and the ones refused are rows (413's `document_too_large`) naming the setting,
/// nothing of them written.
pub(super) async fn data_store_tree_bound_is_the_setting(e: Endpoint) -> TestResult {
    if e.backend == "couchdb" {
        // CouchDB keeps the data-store database's trees itself.
        return Ok(());
    }
    let original = super::doc("user_t", "trees", "wide", json!("root"));
    let id = original["_id"].as_str().unwrap_or_default().to_owned();
    let rev1 = e.put(&super::path_of(&id), original.clone()).await?.expect(201, "create")?.rev()?;
    let root = rev1.split_once('-').map(|(_, hash)| hash.to_owned()).unwrap_or_default();
    let fill = "x".repeat(8 << 10);
    let branches: Vec<Value> = (0..12u32)
        .map(|n| {
            let hash = format!("{n:032x}");
            let mut branch = original.clone();
            branch["_rev"] = json!(format!("2-{hash}"));
            branch["_revisions"] = json!({"start": 2, "ids": [hash, root.clone()]});
            branch["value"] = json!(format!("{n} {fill}"));
            branch
        })
        .collect();
    let written = e.post(&format!("/{DB}/_bulk_docs"), json!({"docs": branches, "new_edits": false})).await?;
    let rows = written.expect(201, "12 branches of 8 KiB")?.body.as_array().cloned().unwrap_or_default();
    let names_setting = |row: &Value| {
        row["error"] == "document_too_large"
            && row["reason"].as_str().is_some_and(|reason| reason.contains("couchdb_max_tree_bytes"))
    };
    // Whether the branches kept before the bound are written is the engine's: it weighs one
    // document's branches of a request together, so all may be refused.
    check(!rows.is_empty() && rows.iter().all(names_setting), || {
        let shown: String = Value::Array(rows.clone()).to_string().chars().take(600).collect();
        format!("past 64 KiB of tree some branches are refused, naming the setting: {shown}")
    })?;
    let leaves = e.get(&format!("{}?open_revs=all", super::path_of(&id))).await?.expect(200, "every leaf")?;
    let kept = leaves.body.as_array().map_or(0, Vec::len);
    // The first revision stays the one leaf when every branch was refused.
    check(kept == (12 - rows.len()).max(1), || {
        format!("{kept} leaves kept, {} refused of 12 (nothing refused written)", rows.len())
    })
}
