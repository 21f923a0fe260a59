//! `_changes` polled, a document purged, `_changes` polled again at once, then `GET /{db}` (issue
//! 35): the `N` of `last_seq` and `update_seq` never goes back, though the purge took the
//! document's entry out of the feed. On DynamoDB and Firestore the polls are served the count of
//! entries purges took out (`db:erased`) from memory while the feed's length stays; a purge in
//! this process must be seen at once. The CouchDB backend's databases are the server's own, and
//! the one behind it here (pouchdb-server) has no `_purge`: nothing to check there.

use serde_json::{json, Value};

use super::{fresh_db_named, Endpoint};
use crate::common::{check, TestResult};

/// The `N` of a shown sequence `N-opaque`.
fn n_of(seq: &Value) -> u64 {
    let text = seq.as_str().unwrap_or_default();
    text.split_once('-').and_then(|(n, _)| n.parse().ok()).unwrap_or(0)
}

pub(super) async fn purge_between_polls_never_moves_n_back(e: Endpoint) -> TestResult {
    if e.backend == "couchdb" {
        return Ok(());
    }
    let db = fresh_db_named(&e, "purge", "polls").await?;
    let mut revs = Vec::new();
    for id in ["a", "b", "c"] {
        revs.push(e.put(&format!("/{db}/{id}"), json!({})).await?.expect(201, "PUT")?.rev()?);
    }
    let poll = || async { e.get(&format!("/{db}/_changes")).await?.expect(200, "_changes") };
    let mut last = 0;
    for round in 0..3 {
        let n = n_of(&poll().await?.body["last_seq"]);
        check(n == 3 && n >= last, || format!("poll {round} before the purge: last_seq N {n}, wanted 3"))?;
        last = n;
    }
    let purged = e.post(&format!("/{db}/_purge"), json!({ "b": [revs[1]] })).await?.expect(201, "_purge")?;
    check(purged.body["purged"]["b"] == json!([revs[1]]), || format!("_purge: {}", purged.body))?;
    for round in 0..3 {
        let answer = poll().await?;
        let n = n_of(&answer.body["last_seq"]);
        check(n >= last, || format!("poll {round} after the purge: last_seq N {n} below {last}: {}", answer.body))?;
        last = n;
        let info = e.get(&format!("/{db}")).await?.expect(200, "GET /db")?;
        let update_seq = n_of(&info.body["update_seq"]);
        check(update_seq >= last, || format!("update_seq N {update_seq} below last_seq's {last}"))?;
    }
    Ok(())
}
