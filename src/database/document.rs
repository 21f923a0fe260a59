//! CouchDB's rules for a document a client sends to a database: its id, its special fields
//! (`_rev`, `_deleted`, `_revisions`, ...), and what is stored as its body.
//!
//! As CouchDB 3.x reads a document (`couch_doc:transfer_fields`): `_id`, `_rev`, `_deleted` and
//! `_revisions` are taken out; `_attachments` stays in the body; `_conflicts`,
//! `_deleted_conflicts`, `_revs_info` and `_local_seq` (fields of CouchDB's own answers, which
//! clients send back) are dropped; any other field starting with `_` is refused with
//! `doc_validation` (also in a local document: [`check_local`]). And how a stored leaf is shown as
//! a document again ([`leaf_json`]; [`winner_json`] for a map function's input, written from the
//! stored text).

use serde_json::{Map, Value};

use super::rev_tree::{parse_rev, Leaf, RevPath, RevTree, WinnerText};

/// Why CouchDB refuses a document: its error name and reason (always a 400 unless said).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub error: &'static str,
    pub reason: String,
}

impl Refusal {
    fn new(error: &'static str, reason: impl Into<String>) -> Self {
        Refusal { error, reason: reason.into() }
    }
}

/// A client's document, its special fields taken out.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientDoc {
    pub id: Option<String>,
    pub rev: Option<String>,
    pub deleted: bool,
    /// `_revisions`, when sent (a replicator's ancestry).
    pub revisions: Option<RevPath>,
    /// Every other field (with `_attachments`), as stored.
    pub body: Map<String, Value>,
}

/// Fields of CouchDB's answers that a client may send back and CouchDB ignores.
const IGNORED: [&str; 4] = ["_conflicts", "_deleted_conflicts", "_revs_info", "_local_seq"];
/// The replicator's fields of `_replicator` documents, which CouchDB keeps in any document.
const REPLICATION_FIELDS: [&str; 5] = [
    "_replication_id",
    "_replication_state",
    "_replication_state_time",
    "_replication_state_reason",
    "_replication_stats",
];

/// Reads a client's document under CouchDB's rules.
pub fn parse(doc: Map<String, Value>) -> Result<ClientDoc, Refusal> {
    check(&doc)?;
    let mut parsed = ClientDoc { id: None, rev: None, deleted: false, revisions: None, body: doc };
    let (mut id, mut rev, mut deleted, mut revisions) = (None, None, false, None);
    // The special members taken out of the document in place, the others kept in their order:
    // the document was rebuilt member by member, each inserted (and hashed) again (issue 38: a
    // fifth of a data-store document's parse).
    parsed.body.retain(|name, value| {
        match (name.as_str(), value) {
            ("_id", Value::String(text)) => id = Some(std::mem::take(text)),
            ("_rev", Value::String(text)) => rev = Some(std::mem::take(text)),
            ("_deleted", Value::Bool(flag)) => deleted = *flag,
            ("_revisions", value) => revisions = RevPath::from_revisions(value),
            (other, _) if IGNORED.contains(&other) => {}
            // `_attachments`, the replicator's fields and the document's own: `check` refused
            // every other special member, and the special members above of any other type.
            _ => return true,
        }
        false
    });
    parsed.id = id;
    parsed.rev = rev;
    parsed.deleted = deleted;
    parsed.revisions = revisions;
    // With both, `_revisions` names the revisions (couch_doc:transfer_fields lets it replace what
    // `_rev` set); CouchDB does not check that they agree, and replicators rely on it.
    Ok(parsed)
}

/// What [`parse`] refuses, checked in place, the first refusal in member order: a whole
/// `_bulk_docs` is checked before any of it is written, without a copy of every document.
pub fn check(doc: &Map<String, Value>) -> Result<(), Refusal> {
    for (name, value) in doc {
        match name.as_str() {
            "_id" if !value.is_string() => {
                return Err(Refusal::new("bad_request", "Document id must be a string"));
            }
            "_rev" if value.as_str().is_none_or(|rev| parse_rev(rev).is_none()) => {
                return Err(Refusal::new("bad_request", "Invalid rev format"));
            }
            // `couch_doc:transfer_fields` takes `_deleted` only as a boolean; any other value
            // falls to its unknown-member clause.
            "_deleted" if !value.is_boolean() => return Err(bad_special_member("_deleted")),
            "_revisions" if RevPath::from_revisions(value).is_none() => {
                return Err(Refusal::new(
                    "doc_validation",
                    "_revisions must be {start, ids} with start >= the number of ids",
                ))
            }
            "_id" | "_rev" | "_deleted" | "_revisions" | "_attachments" => {}
            other if REPLICATION_FIELDS.contains(&other) || IGNORED.contains(&other) => {}
            other if other.starts_with('_') => return Err(bad_special_member(other)),
            _ => {}
        }
    }
    if let Some(Value::String(id)) = doc.get("_id") {
        check_id(id)?;
    }
    Ok(())
}

/// CouchDB's refusal of a special member it does not know (or of `_deleted` not a boolean).
fn bad_special_member(name: &str) -> Refusal {
    Refusal::new("doc_validation", format!("Bad special document member: {name}"))
}

/// Checks the special members of a local document (`_local/{name}`) as CouchDB reads any
/// document sent to it (`couch_doc:from_json_obj_validate`, for local documents too): an unknown
/// member starting with `_`, or a `_deleted` that is not a boolean, is 400 `doc_validation`.
/// Its `_rev` is not checked: local documents' revisions are `0-N` and not compared.
pub fn check_local(doc: &Map<String, Value>) -> Result<(), Refusal> {
    let known = |name: &str| {
        ["_id", "_rev", "_revisions", "_attachments"].contains(&name)
            || IGNORED.contains(&name)
            || REPLICATION_FIELDS.contains(&name)
    };
    for (name, value) in doc {
        let refused = match name.as_str() {
            "_deleted" => !value.is_boolean(),
            other => other.starts_with('_') && !known(other),
        };
        if refused {
            return Err(bad_special_member(name));
        }
    }
    Ok(())
}

/// CouchDB's id rule (`couch_doc:validate_docid`): not empty, valid UTF-8 (a Rust string
/// already is), and starting with `_` only for design documents. Local documents have routes of
/// their own and are refused here.
pub fn check_id(id: &str) -> Result<(), Refusal> {
    if id.is_empty() {
        return Err(Refusal::new("illegal_docid", "Document id must not be empty"));
    }
    if id.starts_with('_') && !id.starts_with("_design/") {
        return Err(Refusal::new("illegal_docid", "Only reserved document ids may start with underscore."));
    }
    if id == "_design/" {
        return Err(Refusal::new("illegal_docid", "Illegal document id `_design/`"));
    }
    Ok(())
}

/// The revision path of a replicated document: its `_revisions`, or only its `_rev` when sent
/// without (CouchDB then knows no ancestors).
pub fn replicated_path(doc: &ClientDoc) -> Result<RevPath, Refusal> {
    if let Some(path) = &doc.revisions {
        return Ok(path.clone());
    }
    match doc.rev.as_deref().and_then(parse_rev) {
        Some((start, id)) => Ok(RevPath { start, ids: vec![id.to_owned()] }),
        None => Err(Refusal::new("bad_request", "a document written with new_edits=false needs a _rev")),
    }
}

/// What a document read adds to the document (CouchDB's query options).
#[derive(Debug, Clone, Copy, Default)]
pub struct DocOptions {
    pub revs: bool,
    pub revs_info: bool,
    pub conflicts: bool,
    pub deleted_conflicts: bool,
}

/// A leaf as CouchDB answers it: `_id`, `_rev`, the body, `_deleted` for a deleted leaf, then
/// what `options` ask for (`_revs_info`, `_conflicts`, `_deleted_conflicts` only for the
/// winner, as CouchDB gives them).
pub fn leaf_json(id: &str, tree: &RevTree, leaf: &Leaf, options: DocOptions) -> Value {
    let mut doc = Map::with_capacity(leaf.body.len() + 4);
    doc.insert("_id".into(), Value::from(id));
    doc.insert("_rev".into(), Value::from(leaf.path.leaf_rev()));
    for (name, value) in &leaf.body {
        let shown = match (name.as_str(), value) {
            // Stubs as CouchDB shows them, never the field naming where the bytes are.
            (super::doc_attachments::ATTACHMENTS, Value::Object(attachments)) => Value::Object(
                attachments.iter().map(|(name, att)| (name.clone(), super::doc_attachments::shown_stub(att))).collect(),
            ),
            _ => value.clone(),
        };
        doc.insert(name.clone(), shown);
    }
    if leaf.deleted {
        doc.insert("_deleted".into(), Value::Bool(true));
    }
    if options.revs {
        doc.insert("_revisions".into(), leaf.path.to_revisions());
    }
    let is_winner = tree.winner().is_some_and(|winner| winner.path.same_leaf_rev(&leaf.path));
    if is_winner {
        if options.revs_info {
            let info: Vec<Value> = tree
                .revs_info()
                .into_iter()
                .map(|(rev, status)| serde_json::json!({ "rev": rev, "status": status.as_str() }))
                .collect();
            doc.insert("_revs_info".into(), Value::Array(info));
        }
        if options.conflicts {
            let conflicts = tree.conflicts();
            if !conflicts.is_empty() {
                doc.insert("_conflicts".into(), Value::from(conflicts));
            }
        }
        if options.deleted_conflicts {
            let deleted = tree.deleted_conflicts();
            if !deleted.is_empty() {
                doc.insert("_deleted_conflicts".into(), Value::from(deleted));
            }
        }
    }
    Value::Object(doc)
}

/// What of a document's tree a map function is shown besides its winner: CouchDB 3.4.3's
/// `couch_index_updater` opens each changed document with `conflicts` and `deleted_conflicts`
/// for the map call, so both lists come with it when not empty.
pub const MAP_INPUT: DocOptions =
    DocOptions { revs: false, revs_info: false, conflicts: true, deleted_conflicts: true };

/// Appends a document's text up to its last member, the object left open: `{"_id":…,"_rev":…`
/// and then `members`, a stored body's members as JSON text without its braces (empty: none).
/// What every answer written from a record's stored text starts with.
pub fn open_document_text(id: &str, rev: &str, members: &str, out: &mut String) {
    // A str is always a valid JSON string: writing it cannot fail.
    out.push_str("{\"_id\":");
    out.push_str(&serde_json::to_string(id).unwrap_or_default());
    out.push_str(",\"_rev\":");
    out.push_str(&serde_json::to_string(rev).unwrap_or_default());
    if !members.is_empty() {
        out.push(',');
        out.push_str(members);
    }
}

/// The winning leaf as a map function is shown it, [`leaf_json`]'s document with [`MAP_INPUT`],
/// written as JSON text straight from the body's stored text: `_id`, `_rev`, the body's members
/// as stored, then `_conflicts` and `_deleted_conflicts` when there are any. The same text [`leaf_json`]'s value
/// writes, since the stored text is serde_json's own compact writing of the body, members in
/// their order. `None` where it would not be: a deleted winner or none, a body not stored as an
/// object, or a body naming anything that starts with `_` (an `_attachments` member is shown as
/// stubs, not as stored; a string value starting with `_` only costs the whole read), which the
/// caller reads whole instead.
pub fn winner_json(id: &str, winner: &WinnerText) -> Option<String> {
    let rev = winner.rev.as_deref().filter(|_| !winner.deleted)?;
    let members = match &winner.body {
        None => "",
        Some(body) => {
            let text = body.get();
            if text.contains("\"_") {
                return None;
            }
            text.strip_prefix('{')?.strip_suffix('}')?
        }
    };
    let conflicts_bytes: usize =
        winner.conflicts.iter().chain(&winner.deleted_conflicts).map(|rev| rev.len() + 3).sum();
    let mut out = String::with_capacity(id.len() + rev.len() + members.len() + conflicts_bytes + 40);
    open_document_text(id, rev, members, &mut out);
    if !winner.conflicts.is_empty() {
        out.push_str(",\"_conflicts\":");
        out.push_str(&serde_json::to_string(&winner.conflicts).ok()?);
    }
    if !winner.deleted_conflicts.is_empty() {
        out.push_str(",\"_deleted_conflicts\":");
        out.push_str(&serde_json::to_string(&winner.deleted_conflicts).ok()?);
    }
    out.push('}');
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn object(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            _ => Map::new(),
        }
    }

    #[test]
    fn special_fields_are_taken_out_ignored_or_refused() {
        let doc = parse(object(json!({
            "_id": "a", "_rev": "1-x", "_deleted": true, "_conflicts": ["2-y"], "_attachments": {}, "v": 1
        })))
        .unwrap();
        assert_eq!((doc.id.as_deref(), doc.rev.as_deref(), doc.deleted), (Some("a"), Some("1-x"), true));
        assert_eq!(doc.body, object(json!({"_attachments": {}, "v": 1})));
        // couch_doc:transfer_fields: an unknown special member is a doc_validation error.
        assert_eq!(parse(object(json!({"_foo": 1}))).unwrap_err().error, "doc_validation");
        assert_eq!(
            parse(object(json!({"_deleted": "yes"}))).unwrap_err().reason,
            "Bad special document member: _deleted"
        );
        assert_eq!(parse(object(json!({"_rev": "x"}))).unwrap_err().reason, "Invalid rev format");
        assert_eq!(parse(object(json!({"_id": 1}))).unwrap_err().error, "bad_request");
    }

    #[test]
    fn local_documents_are_refused_unknown_special_members() {
        assert!(check_local(&object(json!({"_id": "_local/x", "_rev": "0-3", "_deleted": false, "v": 1}))).is_ok());
        let refusal = check_local(&object(json!({"v": 1, "_zing": 2}))).unwrap_err();
        assert_eq!((refusal.error, refusal.reason.as_str()), ("doc_validation", "Bad special document member: _zing"));
        assert_eq!(check_local(&object(json!({"_deleted": 1}))).unwrap_err().error, "doc_validation");
    }

    #[test]
    fn ids_follow_couchdb_rule() {
        assert!(check_id("a").is_ok() && check_id("_design/x").is_ok() && check_id("a/b é").is_ok());
        for bad in ["", "_x", "_local_", "_design/"] {
            assert_eq!(check_id(bad).unwrap_err().error, "illegal_docid", "{bad}");
        }
    }

    #[test]
    fn a_replicated_path_comes_from_revisions_or_rev() {
        let doc = parse(object(json!({"_rev": "3-c", "_revisions": {"start": 3, "ids": ["c", "b"]}}))).unwrap();
        assert_eq!(replicated_path(&doc).unwrap(), RevPath { start: 3, ids: vec!["c".into(), "b".into()] });
        let bare = parse(object(json!({"_rev": "2-b"}))).unwrap();
        assert_eq!(replicated_path(&bare).unwrap(), RevPath { start: 2, ids: vec!["b".into()] });
        let both = parse(object(json!({"_rev": "3-x", "_revisions": {"start": 3, "ids": ["c"]}}))).unwrap();
        assert_eq!(replicated_path(&both).unwrap(), RevPath { start: 3, ids: vec!["c".into()] }, "_revisions wins");
    }
}
