//! The cross-instance consistency trial (issue 36): writers on two instances over one backend at
//! once, on the same documents and on their own, with PUT and `_bulk_docs`; conflicts replicated
//! into different instances as a replicator makes them (`_revs_diff`, then `_bulk_docs` with
//! `new_edits: false`); then both instances agree on every document's leaves (`open_revs=all`,
//! `conflicts=true`), on `_changes`, `_all_docs`, a view's rows and a `_find` answer, and no
//! acknowledged write is lost (every 201's revision is a leaf or an ancestor of one).
//!
//! Expected answers are CouchDB's rules: an edit naming the current revision is 201 and any
//! other 409 (so interactive edits never fork: a document's generation is its count of 201s);
//! replicated revisions are kept as sent, the winner the highest leaf.

use std::collections::{BTreeMap, BTreeSet};

use super::several_instances::{bulk_written, id_of, trial_databases, Face};
use super::*;

/// Documents both instances edit, and how many edits each instance tries on each.
const SHARED: usize = 3;
const ROUNDS: usize = 3;
/// Documents each instance creates on its own.
const OWN: usize = 3;

/// What one writer got: the revisions acknowledged (201, or a `_bulk_docs` row with `ok`) and
/// how many edits were refused as conflicts (409, or a row with `conflict`).
#[derive(Default)]
struct Tally {
    acknowledged: Vec<(String, String)>,
    conflicts: usize,
}

fn doc_path(db: &str, id: &str) -> String {
    format!("/{db}/{}", percent_encoding::utf8_percent_encode(id, percent_encoding::NON_ALPHANUMERIC))
}

/// Shared document `n`, with `value` as its body's value.
fn shared(n: usize, value: usize) -> Value {
    doc("u", "consistency", &format!("shared{n}"), json!(value))
}

/// `ROUNDS` edits of shared document `n` through `face`, each from the revision it reads then,
/// alternately by PUT and by `_bulk_docs`.
async fn edit_rounds(face: Face<'_>, db: &str, n: usize, salt: usize) -> Result<Tally, Failed> {
    let mut tally = Tally::default();
    let id = id_of(&shared(n, 0));
    let path = doc_path(db, &id);
    for round in 0..ROUNDS {
        let current = face.get(&path).await?;
        let mut body = shared(n, salt * 100 + round);
        match current.status.as_u16() {
            200 => body["_rev"] = current.body["_rev"].clone(),
            404 => {}
            other => return Err(format!("{}: {other} {}", face.says("GET a shared document"), current.body).into()),
        }
        let (status, rev) = if round % 2 == 0 {
            let answer = face.put(&path, body).await?;
            (answer.status.as_u16(), answer.body["rev"].as_str().map(str::to_owned))
        } else {
            let answer = face.post(&format!("/{db}/_bulk_docs"), json!({ "docs": [body] })).await?;
            let row = &answer.body[0];
            let status = match (answer.status.as_u16(), row["error"].as_str()) {
                (201, None) => 201,
                (201, Some("conflict")) => 409,
                (status, _) => return Err(format!("{}: {status} {}", face.says("_bulk_docs"), answer.body).into()),
            };
            (status, row["rev"].as_str().map(str::to_owned))
        };
        match (status, rev) {
            (201, Some(rev)) => tally.acknowledged.push((id.clone(), rev)),
            (409, _) => tally.conflicts += 1,
            (status, rev) => return Err(format!("{}: {status} {rev:?}", face.says("an edit")).into()),
        }
    }
    Ok(tally)
}

/// Documents only `face` creates, with `_bulk_docs`, every one acknowledged.
async fn own_documents(face: Face<'_>, db: &str) -> Result<Tally, Failed> {
    let docs: Vec<Value> =
        (0..OWN).map(|n| doc("u", "consistency", &format!("{}-{n}", face.name), json!(1000 + n))).collect();
    let revs = bulk_written(face, db, docs.clone()).await?;
    Ok(Tally { acknowledged: docs.iter().map(id_of).zip(revs).collect(), conflicts: 0 })
}

fn hex_of(c: char) -> String {
    std::iter::repeat_n(c, 32).collect()
}

/// A replicator's copy of one branch of document `id` into `face`: `_revs_diff` first, then the
/// revisions it says are missing with `new_edits: false`.
async fn replicated_branch(face: Face<'_>, db: &str, id: &str, leaf: char) -> Result<String, Failed> {
    let rev = format!("2-{}", hex_of(leaf));
    let diff = face.post(&format!("/{db}/_revs_diff"), json!({ id: [rev.clone()] })).await?;
    let diff = diff.expect(200, &face.says("_revs_diff"))?;
    check(diff.body[id]["missing"] == json!([rev.clone()]), || format!("{}: {}", face.says("_revs_diff"), diff.body))?;
    let mut body = doc("u", "consistency", "replicated", json!(2));
    body["_rev"] = json!(rev.clone());
    body["_revisions"] = json!({ "start": 2, "ids": [hex_of(leaf), hex_of('1')] });
    let sent = json!({ "docs": [body], "new_edits": false });
    face.post(&format!("/{db}/_bulk_docs"), sent).await?.expect(201, &face.says("new_edits=false"))?;
    Ok(rev)
}

/// Everything one instance shows of the database: per document its leaves and its winner with
/// its conflicts, the feed's ids and winning revisions, `_all_docs`, the view's rows and the
/// `_find` answer.
#[derive(Debug, PartialEq)]
struct Seen {
    leaves: BTreeMap<String, BTreeSet<String>>,
    winners: BTreeMap<String, Value>,
    feed: BTreeMap<String, Value>,
    all_docs: Value,
    view: Value,
    found: Value,
}

async fn seen_on(face: Face<'_>, db: &str, ids: &BTreeSet<String>) -> Result<Seen, Failed> {
    let mut leaves = BTreeMap::new();
    let mut winners = BTreeMap::new();
    for id in ids {
        let path = doc_path(db, id);
        let open = face.get(&format!("{path}?open_revs=all")).await?.expect(200, &face.says("open_revs=all"))?;
        let revs = open.body.as_array().into_iter().flatten().filter_map(|leaf| leaf["ok"]["_rev"].as_str());
        leaves.insert(id.clone(), revs.map(str::to_owned).collect());
        let winner = face.get(&format!("{path}?conflicts=true")).await?.expect(200, &face.says("conflicts=true"))?;
        winners.insert(id.clone(), json!([winner.body["_rev"], winner.body["_conflicts"]]));
    }
    let changes = face.get(&format!("/{db}/_changes")).await?.expect(200, &face.says("_changes"))?;
    let feed = changes.body["results"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|row| (row["id"].as_str().unwrap_or_default().to_owned(), row["changes"][0]["rev"].clone()))
        .collect();
    let all_docs = face.get(&format!("/{db}/_all_docs")).await?.expect(200, &face.says("_all_docs"))?;
    let view = face.get(&format!("/{db}/_design/c/_view/by_value")).await?.expect(200, &face.says("the view"))?;
    let find = json!({ "selector": { "namespace": "consistency" }, "fields": ["_id", "_rev", "value"] });
    let found = face.post(&format!("/{db}/_find"), find).await?.expect(200, &face.says("_find"))?;
    Ok(Seen {
        leaves,
        winners,
        feed,
        all_docs: all_docs.body["rows"].clone(),
        view: view.body["rows"].clone(),
        found: found.body["docs"].clone(),
    })
}

/// Every revision in the histories of `id`'s leaves, as `face` shows them.
async fn history_of(face: Face<'_>, db: &str, id: &str) -> Result<BTreeSet<String>, Failed> {
    let path = format!("{}?open_revs=all&revs=true", doc_path(db, id));
    let open = face.get(&path).await?.expect(200, &face.says("open_revs=all&revs=true"))?;
    let mut known = BTreeSet::new();
    for leaf in open.body.as_array().into_iter().flatten() {
        let revisions = &leaf["ok"]["_revisions"];
        let start = revisions["start"].as_u64().unwrap_or(0);
        for (depth, hash) in revisions["ids"].as_array().into_iter().flatten().enumerate() {
            known.insert(format!("{}-{}", start.saturating_sub(depth as u64), hash.as_str().unwrap_or_default()));
        }
    }
    Ok(known)
}

/// Writers and replicators on A and B at once, then both agree and nothing acknowledged is lost:
/// on the data-store database and, where instances share them, on a database of its own.
pub(super) async fn instances_agree_after_concurrent_writers(e: Endpoint) -> TestResult {
    let beside = e.beside_configured().await?;
    let (a, b) = (Face::of_endpoint(&e), Face::of_beside(&beside, "B"));
    for db in trial_databases(&e, "agree").await? {
        writers_then_agreement(a, b, &db).await?;
    }
    Ok(())
}

async fn writers_then_agreement(a: Face<'_>, b: Face<'_>, db: &str) -> TestResult {
    let design = json!({ "views": { "by_value": { "map": "function (doc) { emit(doc.value, doc.key); }" } } });
    a.put(&format!("/{db}/_design/c"), design).await?.expect(201, &a.says("the design document"))?;
    let base = doc("u", "consistency", "replicated", json!(1));
    let mut first = base.clone();
    first["_rev"] = json!(format!("1-{}", hex_of('1')));
    let seeded = json!({ "docs": [first], "new_edits": false });
    a.post(&format!("/{db}/_bulk_docs"), seeded).await?.expect(201, &a.says("the replicated seed"))?;

    let replicated_id = id_of(&base);
    let mut editors = Vec::new();
    for n in 0..SHARED {
        editors.push(edit_rounds(a, db, n, 1));
        editors.push(edit_rounds(b, db, n, 2));
    }
    let (edits, own_a, own_b, branch_a, branch_b) = tokio::join!(
        futures::future::join_all(editors),
        own_documents(a, db),
        own_documents(b, db),
        replicated_branch(a, db, &replicated_id, 'a'),
        replicated_branch(b, db, &replicated_id, 'b'),
    );
    let mut tallies = vec![own_a?, own_b?];
    for tally in edits {
        tallies.push(tally?);
    }
    let (branch_a, branch_b) = (branch_a?, branch_b?);

    let mut ids: BTreeSet<String> =
        tallies.iter().flat_map(|t| t.acknowledged.iter().map(|(id, _)| id.clone())).collect();
    ids.insert(replicated_id.clone());
    let (on_a, on_b) = (seen_on(a, db, &ids).await?, seen_on(b, db, &ids).await?);
    check(on_a == on_b, || format!("{db}: A and B disagree:\nA {on_a:?}\nB {on_b:?}"))?;
    let replicated = on_a.leaves.get(&replicated_id).cloned().unwrap_or_default();
    check(replicated == BTreeSet::from([branch_a, branch_b]), || {
        format!("{db}: the replicated document's leaves: {replicated:?}")
    })?;
    edits_kept(a, db, &tallies, &on_a).await
}

/// Every acknowledged revision is in a leaf's history; a document edited interactively only has
/// one leaf whose generation is its count of 201s (no edit lost, none forked).
async fn edits_kept(a: Face<'_>, db: &str, tallies: &[Tally], seen: &Seen) -> TestResult {
    let mut acknowledged: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (id, rev) in tallies.iter().flat_map(|t| t.acknowledged.iter()) {
        acknowledged.entry(id.as_str()).or_default().push(rev.as_str());
    }
    let conflicts: usize = tallies.iter().map(|t| t.conflicts).sum();
    let edits: usize = acknowledged.values().map(Vec::len).sum();
    println!("{edits} writes acknowledged, {conflicts} refused as conflicts");
    for (id, revs) in &acknowledged {
        let history = history_of(a, db, id).await?;
        let lost: Vec<&&str> = revs.iter().filter(|rev| !history.contains(**rev)).collect();
        check(lost.is_empty(), || format!("{id}: acknowledged revisions lost: {lost:?} (history {history:?})"))?;
        let leaves = seen.leaves.get(*id).cloned().unwrap_or_default();
        let generation = leaves.iter().next().and_then(|rev| rev.split('-').next()?.parse::<usize>().ok());
        check(leaves.len() == 1 && generation == Some(revs.len()), || {
            format!("{id}: leaves {leaves:?} after {} acknowledged edits", revs.len())
        })?;
    }
    check(acknowledged.len() == 2 * OWN + SHARED, || format!("documents written: {}", acknowledged.len()))?;
    Ok(())
}
