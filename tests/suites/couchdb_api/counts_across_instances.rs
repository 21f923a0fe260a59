//! Document counts over several instances (issue 36): a create, a delete and a `_purge` made
//! through one CouchDB face show in the other's very next `GET /{db}` (`doc_count`,
//! `doc_del_count`, `update_seq`'s `N`), `_all_docs` `total_rows` and `_changes` `last_seq`, though
//! the other had just read them (a remembered count is served only after a check that nothing
//! changed since: `src/backend/raw/count_cache.rs`).
//!
//! Expected answers: CouchDB 3.4.3 counts at once (checked with curl: `doc_count` 2, then 1 after
//! a `_purge`). `N` follows this server's ranking (docs/couchdb-api.md, "Sequences": the feed's
//! length plus the entries purges took out), so B's `N` must be what A answers itself; CouchDB's
//! own `N` goes up with a purge, ours stays (never down).
//!
//! Not on the embedded store's databases (one process opens a database file: see
//! `several_instances.rs`); the data-store database counts nothing exactly (`ItemCount`), so it is
//! not checked.

use super::several_instances::{databases_shared, Face};
use super::*;

/// What a face shows of a database's counts.
#[derive(Debug, PartialEq)]
struct Counts {
    doc_count: Value,
    doc_del_count: Value,
    /// `update_seq`'s `N`.
    update_n: u64,
    total_rows: Value,
    /// `_changes`' `last_seq`'s `N`.
    last_n: u64,
}

/// A sequence's `N` (pouchdb-server, the CouchDB backend's stand-in, answers a bare number).
fn leading_n(seq: &Value) -> u64 {
    let text = seq.as_str().unwrap_or_default();
    seq.as_u64().or_else(|| text.split('-').next().and_then(|n| n.parse().ok())).unwrap_or(u64::MAX)
}

async fn counts_on(face: Face<'_>, db: &str) -> Result<Counts, Failed> {
    let info = face.get(&format!("/{db}")).await?.expect(200, &face.says("GET the database"))?;
    let listed = face.get(&format!("/{db}/_all_docs")).await?.expect(200, &face.says("_all_docs"))?;
    let feed = face.get(&format!("/{db}/_changes")).await?.expect(200, &face.says("_changes"))?;
    Ok(Counts {
        doc_count: info.body["doc_count"].clone(),
        doc_del_count: info.body["doc_del_count"].clone(),
        update_n: leading_n(&info.body["update_seq"]),
        total_rows: listed.body["total_rows"].clone(),
        last_n: leading_n(&feed.body["last_seq"]),
    })
}

/// B's counts right after A's change `what` are A's, with `live` documents and `deleted`
/// tombstones.
async fn b_agrees(a: Face<'_>, b: Face<'_>, db: &str, what: &str, live: u64, deleted: u64) -> TestResult {
    let on_b = counts_on(b, db).await?;
    let on_a = counts_on(a, db).await?;
    check(on_b == on_a, || format!("after {what} through A: B shows {on_b:?}, A {on_a:?}"))?;
    // pouchdb-server answers no `doc_del_count`.
    let deleted_ok = on_b.doc_del_count == json!(deleted) || on_b.doc_del_count.is_null();
    check(on_b.doc_count == json!(live) && on_b.total_rows == json!(live) && deleted_ok, || {
        format!("after {what} through A: {on_b:?}, wanted {live} live and {deleted} deleted")
    })
}

/// B warms its counts, then A creates, deletes and purges: B's next answers show each at once.
pub(super) async fn counts_follow_another_instance_at_once(e: Endpoint) -> TestResult {
    if !databases_shared(&e) {
        return Ok(());
    }
    let beside = e.beside_configured().await?;
    let (a, b) = (Face::of_endpoint(&e), Face::of_beside(&beside, "B"));
    let db = fresh_db_named(&e, "instances", "counts").await?;
    for key in ["one", "two"] {
        a.put(&format!("/{db}/{key}"), json!({ "v": key })).await?.expect(201, &a.says("PUT"))?;
    }
    b_agrees(a, b, &db, "two creates", 2, 0).await?;
    let before = counts_on(b, &db).await?;

    let three = a.put(&format!("/{db}/three"), json!({ "v": 3 })).await?.expect(201, &a.says("PUT three"))?;
    b_agrees(a, b, &db, "a create", 3, 0).await?;
    let created = counts_on(b, &db).await?;
    check(created.update_n > before.update_n, || format!("N did not move with a create: {before:?} {created:?}"))?;

    a.call(Method::DELETE, &format!("/{db}/three?rev={}", three.rev()?), None)
        .await?
        .expect(200, &a.says("DELETE three"))?;
    b_agrees(a, b, &db, "a delete", 2, 1).await?;
    // A design document counts in `doc_count` and `total_rows` as in CouchDB's (3.4.3, checked
    // with curl).
    a.put(&format!("/{db}/_design/d"), json!({ "views": {} })).await?.expect(201, &a.says("PUT _design/d"))?;
    b_agrees(a, b, &db, "a design document", 3, 1).await?;

    if let Some(why) = &e._ctx.no_purge {
        println!("purge not checked on {}: {why}", e.backend);
        return Ok(());
    }
    let two = b.get(&format!("/{db}/two")).await?.expect(200, &b.says("GET two"))?.body["_rev"].clone();
    a.post(&format!("/{db}/_purge"), json!({ "two": [two] })).await?.expect(201, &a.says("_purge"))?;
    b_agrees(a, b, &db, "a purge", 2, 1).await?;
    let purged = counts_on(b, &db).await?;
    check(purged.update_n >= created.update_n, || format!("N went back with a purge: {created:?} {purged:?}"))
}
