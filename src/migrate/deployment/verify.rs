//! Comparing two ends database by database, leaf by leaf: every leaf of every source document
//! (deleted ones too) must be at the target with the same `_deleted`, the same ancestry
//! (`_revisions`), the same body, and the same attachments (name, content type, `revpos`, length
//! and digest: CouchDB's `md5-` digest of the bytes); the target must hold no leaf the source
//! lacks; and `_security` (and `_revs_limit`, where both sides know it) must be equal.
//!
//! **Compressed attachments.** Apache CouchDB keeps attachments of its `compressible_types`
//! (`text/*`, JSON, …) gzipped and gives the MD5 of the *compressed* bytes as their digest
//! (`encoding: gzip` in a stub read with `att_encoding_info=true`), while it serves the bytes
//! themselves. Any other end computes the digest of the bytes, so two copies of the same bytes
//! show different digests. Such an attachment (`encoding` at either end) is compared by the
//! digest of its bytes, read from both ends a chunk at a time, instead of the digests shown.

use std::collections::{HashMap, HashSet};

use serde::Serialize;
use serde_json::{Map, Value};

use super::board::Board;
use super::side::Side;
use crate::database::attachments::couchdb_digest_of;
use crate::error::Result;
use crate::migrate::follow::StopFlag;
use crate::migrate::progress::ProgressMode;
use crate::migrate::run_record::RunRecord;

/// The comparison of one database.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DbVerify {
    pub name: String,
    /// The database does not exist at the target.
    pub missing_database: bool,
    /// Source leaves compared.
    pub leaves: u64,
    /// Source leaves the target does not have.
    pub missing_at_target: u64,
    /// Target leaves the source does not have.
    pub extra_at_target: u64,
    /// Leaves both have that differ (body, deletion, ancestry or attachments).
    pub different: u64,
    /// Documents each side's change feed lists (a document the target holds but does not list
    /// would never reach the target's own replicators).
    pub source_documents: u64,
    pub target_documents: u64,
    pub security_equal: bool,
    pub revs_limit_equal: bool,
    /// The first documents (`id rev: what`) that differ.
    pub examples: Vec<String>,
    /// Stopped before the comparison ended.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub interrupted: bool,
}

impl DbVerify {
    fn passed(&self) -> bool {
        !self.missing_database
            && self.missing_at_target == 0
            && self.extra_at_target == 0
            && self.different == 0
            && self.source_documents == self.target_documents
            && self.security_equal
            && self.revs_limit_equal
    }
}

/// The comparison of every database.
#[derive(Debug, Clone, Default, Serialize)]
pub struct VerifyReport {
    pub passed: bool,
    /// Stopped before every database was compared (a run started through the service,
    /// cancelled): `passed` then says nothing.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub interrupted: bool,
    pub databases: Vec<DbVerify>,
    pub leaves: u64,
}

/// Compares the databases `names` of `source` and `target`.
pub async fn verify(
    source: &Side,
    target: &Side,
    names: &[String],
    batch: usize,
    max_ids: usize,
) -> Result<VerifyReport> {
    let board = Board::new("verify", "comparing", ProgressMode::None, None);
    compare_all(source, target, names, (batch, max_ids), &board, None).await
}

/// [`verify`], showing its progress as `progress` says and keeping `record` written with it
/// ([`super::board`]) and, when it ends, how it ended (`finished` whatever it found: what it
/// found is in the report).
pub async fn verify_recorded(
    source: &Side,
    target: &Side,
    names: &[String],
    options: VerifyRun,
) -> Result<VerifyReport> {
    let board = Board::new("verify", "comparing", options.progress, options.record);
    let ticker = board.ticker();
    let sizes = (options.batch, options.max_ids);
    let outcome = compare_all(source, target, names, sizes, &board, options.stop.as_ref()).await;
    if let Some(ticker) = ticker {
        ticker.abort();
    }
    let (state, error) = match &outcome {
        Ok(report) if report.interrupted => ("interrupted", None),
        Ok(report) => {
            board.note("passed", Value::Bool(report.passed));
            ("finished", None)
        }
        Err(err) => ("failed", Some(err.to_string())),
    };
    board.close(state, error.as_deref()).await;
    outcome
}

/// How a recorded comparison runs.
pub struct VerifyRun {
    /// Changes per feed page.
    pub batch: usize,
    /// Differences named per database.
    pub max_ids: usize,
    pub progress: ProgressMode,
    pub record: Option<RunRecord>,
    /// Stops the comparison before its next page when raised.
    pub stop: Option<StopFlag>,
}

/// Compares every database of `names`, `(batch, max_ids)` as [`VerifyRun`] says, until done or
/// `stop` is raised.
async fn compare_all(
    source: &Side,
    target: &Side,
    names: &[String],
    (batch, max_ids): (usize, usize),
    board: &Board,
    stop: Option<&StopFlag>,
) -> Result<VerifyReport> {
    let mut report = VerifyReport { passed: true, ..VerifyReport::default() };
    board.start_pass(names.len());
    let ends = Ends { source, target, board, stop };
    for name in names {
        if stop.is_some_and(StopFlag::is_raised) {
            report.interrupted = true;
            break;
        }
        board.start_db(name, source.estimate(name).await.ok().flatten().unwrap_or(0));
        let db = verify_database(&ends, name, batch.max(1), max_ids).await?;
        board.end_db(name);
        report.interrupted |= db.interrupted;
        report.passed &= db.passed();
        report.leaves += db.leaves;
        report.databases.push(db);
    }
    report.passed &= !report.interrupted;
    Ok(report)
}

/// What every database's comparison shares.
struct Ends<'a> {
    source: &'a Side,
    target: &'a Side,
    board: &'a Board,
    stop: Option<&'a StopFlag>,
}

async fn verify_database(ends: &Ends<'_>, db: &str, batch: usize, max_ids: usize) -> Result<DbVerify> {
    let Ends { source, target, board, stop } = *ends;
    let mut result = DbVerify { name: db.to_owned(), ..DbVerify::default() };
    if !target.exists(db).await? {
        result.missing_database = true;
        return Ok(result);
    }
    let (from, to) = (source.settings(db).await?, target.settings(db).await?);
    result.security_equal = from.security == to.security;
    result.revs_limit_equal = match (from.revs_limit, to.revs_limit) {
        (Some(a), Some(b)) => a == b,
        _ => true,
    };
    let note = |result: &mut DbVerify, text: String| {
        if result.examples.len() < max_ids {
            result.examples.push(text);
        }
    };
    // Documents each feed lists, counted once each (a feed with a settle window, DynamoDB's, may
    // list a recent change twice across pages).
    let (mut source_ids, mut target_ids) = (HashSet::new(), HashSet::new());
    // Every source leaf, at the target and equal.
    let mut since = Value::Null;
    loop {
        let page = source.changes(db, &since, batch).await?;
        source_ids.extend(page.docs.iter().map(|d| d.id.clone()));
        let wanted: Vec<(String, Vec<String>)> = page.docs.iter().map(|d| (d.id.clone(), d.leaves.clone())).collect();
        let theirs = target.read_leaves(db, &wanted, false).await?;
        let mut at_target: HashMap<(String, String), Map<String, Value>> = HashMap::with_capacity(theirs.len());
        for leaf in theirs {
            at_target.insert(key(&leaf), leaf);
        }
        let differing_before = result.missing_at_target + result.different;
        for leaf in source.read_leaves(db, &wanted, false).await? {
            result.leaves += 1;
            let (id, rev) = key(&leaf);
            match at_target.get(&(id.clone(), rev.clone())) {
                None => {
                    result.missing_at_target += 1;
                    note(&mut result, format!("{id} {rev}: missing at the target"));
                }
                Some(theirs) => {
                    let compared = Compared::of(&leaf, theirs);
                    let what = match compared.difference {
                        Some(what) => Some(what),
                        None => differing_bytes(source, target, db, &id, &rev, &compared.by_bytes).await?,
                    };
                    if let Some(what) = what {
                        result.different += 1;
                        note(&mut result, format!("{id} {rev}: {what}"));
                    }
                }
            }
        }
        let differing = result.missing_at_target + result.different - differing_before;
        let docs = page.docs.len() as u64;
        board.advance(db, docs, docs.saturating_sub(differing), differing.min(docs));
        since = page.last_seq;
        if page.at_end {
            break;
        }
        if stop.is_some_and(StopFlag::is_raised) {
            result.interrupted = true;
            return Ok(result);
        }
    }
    // No target leaf the source lacks.
    let mut since = Value::Null;
    loop {
        let page = target.changes(db, &since, batch).await?;
        target_ids.extend(page.docs.iter().map(|d| d.id.clone()));
        let wanted: Vec<(String, Vec<String>)> = page.docs.iter().map(|d| (d.id.clone(), d.leaves.clone())).collect();
        for (id, revs) in source.missing(db, &wanted).await? {
            result.extra_at_target += revs.len() as u64;
            note(&mut result, format!("{id} {}: at the target only", revs.join(",")));
        }
        since = page.last_seq;
        if page.at_end {
            break;
        }
    }
    result.source_documents = source_ids.len() as u64;
    result.target_documents = target_ids.len() as u64;
    Ok(result)
}

fn key(leaf: &Map<String, Value>) -> (String, String) {
    let text = |field: &str| leaf.get(field).and_then(Value::as_str).unwrap_or_default().to_owned();
    (text("_id"), text("_rev"))
}

/// Two copies of a leaf compared by what they show.
struct Compared {
    /// What differs, if anything.
    difference: Option<String>,
    /// Attachments whose digests say nothing (compressed at an end): to compare by their bytes.
    by_bytes: Vec<String>,
}

impl Compared {
    fn of(ours: &Map<String, Value>, theirs: &Map<String, Value>) -> Compared {
        let by_bytes = compressed_attachments(ours, theirs);
        let (a, b) = (comparable(ours, &by_bytes), comparable(theirs, &by_bytes));
        if a == b {
            return Compared { difference: None, by_bytes };
        }
        let mut fields: Vec<&String> = a.keys().chain(b.keys()).collect();
        fields.sort();
        fields.dedup();
        let differing: Vec<String> =
            fields.into_iter().filter(|field| a.get(*field) != b.get(*field)).map(|f| f.to_string()).collect();
        Compared { difference: Some(format!("differs in {}", differing.join(", "))), by_bytes }
    }
}

/// What differs between two copies of a leaf by what they show, if anything (attachments kept
/// compressed compare without their digests: [`differing_bytes`] compares those).
#[cfg(test)]
fn difference(ours: &Map<String, Value>, theirs: &Map<String, Value>) -> Option<String> {
    Compared::of(ours, theirs).difference
}

/// The attachments either copy shows as kept compressed (`encoding`).
fn compressed_attachments(ours: &Map<String, Value>, theirs: &Map<String, Value>) -> Vec<String> {
    let mut names = Vec::new();
    for leaf in [ours, theirs] {
        let Some(Value::Object(attachments)) = leaf.get("_attachments") else { continue };
        for (name, attachment) in attachments {
            if attachment.get("encoding").is_some() && !names.contains(name) {
                names.push(name.clone());
            }
        }
    }
    names
}

/// Reads each named attachment of the leaf from both ends, a chunk at a time, and compares the
/// digests of the bytes; what differs, if anything.
async fn differing_bytes(
    source: &Side,
    target: &Side,
    db: &str,
    id: &str,
    rev: &str,
    names: &[String],
) -> Result<Option<String>> {
    for name in names {
        let ours = couchdb_digest_of(source.attachment(db, id, rev, name).await?).await?;
        let theirs = couchdb_digest_of(target.attachment(db, id, rev, name).await?).await?;
        if ours != theirs {
            return Ok(Some(format!(
                "attachment {name} holds other bytes ({ours} at the source, {theirs} at the target)"
            )));
        }
    }
    Ok(None)
}

/// A leaf as compared: every field but `_attachments`, which is reduced to what identifies each
/// attachment's bytes and metadata (stubs and inline attachments compare alike; the digest is
/// left out for the attachments of `by_bytes`). `_deleted: false` is the same as no `_deleted`.
fn comparable(leaf: &Map<String, Value>, by_bytes: &[String]) -> Map<String, Value> {
    let mut shown = Map::with_capacity(leaf.len());
    for (name, value) in leaf {
        match (name.as_str(), value) {
            ("_attachments", Value::Object(attachments)) => {
                let reduced: Map<String, Value> = attachments
                    .iter()
                    .map(|(name, attachment)| {
                        let mut fields = Map::new();
                        for field in ["content_type", "revpos", "digest", "length"] {
                            if field == "digest" && by_bytes.contains(name) {
                                continue;
                            }
                            if let Some(value) = attachment.get(field) {
                                fields.insert(field.into(), value.clone());
                            }
                        }
                        if !fields.contains_key("length") {
                            if let Some(bytes) = crate::replication_client::attachment_bytes(attachment) {
                                fields.insert("length".into(), Value::from(bytes.len() as u64));
                            }
                        }
                        (name.clone(), Value::Object(fields))
                    })
                    .collect();
                shown.insert(name.clone(), Value::Object(reduced));
            }
            ("_deleted", Value::Bool(false)) => {}
            _ => {
                shown.insert(name.clone(), value.clone());
            }
        }
    }
    shown
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn object(value: Value) -> Map<String, Value> {
        value.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn leaves_compare_by_content_and_attachment_identity() {
        let stub = object(json!({"_id": "a", "_rev": "2-x", "v": 1, "_revisions": {"start": 2, "ids": ["x", "w"]},
            "_attachments": {"f": {"content_type": "text/plain", "revpos": 2, "digest": "md5-AAA", "length": 3, "stub": true}}}));
        let inline = object(json!({"_id": "a", "_rev": "2-x", "v": 1, "_revisions": {"start": 2, "ids": ["x", "w"]},
            "_attachments": {"f": {"content_type": "text/plain", "revpos": 2, "digest": "md5-AAA", "data": "YWJj"}}}));
        assert_eq!(difference(&stub, &inline), None);
        let mut other = stub.clone();
        other.insert("_revisions".into(), json!({"start": 2, "ids": ["x"]}));
        assert_eq!(difference(&stub, &other).as_deref(), Some("differs in _revisions"));
        let mut deleted = stub.clone();
        deleted.insert("_deleted".into(), json!(true));
        assert!(difference(&stub, &deleted).is_some());
    }

    #[test]
    fn compressed_attachments_are_compared_by_their_bytes_not_their_digests() {
        // As Apache CouchDB shows a text attachment it keeps gzipped, and as any other end
        // shows the same bytes.
        let couchdb = object(json!({"_id": "a", "_rev": "1-x", "_revisions": {"start": 1, "ids": ["x"]},
            "_attachments": {"t.txt": {"content_type": "text/plain", "revpos": 1, "digest": "md5-GZIPPED",
                "length": 3, "stub": true, "encoding": "gzip", "encoded_length": 23}}}));
        let other = object(json!({"_id": "a", "_rev": "1-x", "_revisions": {"start": 1, "ids": ["x"]},
            "_attachments": {"t.txt": {"content_type": "text/plain", "revpos": 1, "digest": "md5-PLAIN",
                "length": 3, "stub": true}}}));
        let compared = Compared::of(&couchdb, &other);
        assert_eq!(compared.difference, None);
        assert_eq!(compared.by_bytes, vec!["t.txt".to_owned()]);
        // Everything else is still compared.
        let mut longer = other.clone();
        longer["_attachments"]["t.txt"]["length"] = json!(4);
        assert_eq!(Compared::of(&couchdb, &longer).difference.as_deref(), Some("differs in _attachments"));
        // Without `encoding` at either end, digests are compared as shown.
        let mut plain = couchdb.clone();
        if let Some(Value::Object(fields)) = plain["_attachments"].get_mut("t.txt") {
            fields.remove("encoding");
        }
        let compared = Compared::of(&plain, &other);
        assert!(compared.difference.is_some() && compared.by_bytes.is_empty());
    }

    #[tokio::test]
    async fn a_digest_of_streamed_bytes_is_couchdbs_digest() {
        let chunks = vec![Ok(bytes::Bytes::from_static(b"ab")), Ok(bytes::Bytes::from_static(b"c"))];
        let streamed = couchdb_digest_of(futures::stream::iter(chunks)).await.map_err(|e| e.to_string());
        assert_eq!(streamed, Ok(crate::database::attachments::couchdb_digest(b"abc")));
    }
}
