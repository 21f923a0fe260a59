//! The `owner` CouchDB 3.4.3 gives a `_replicator` document (`couch_replicator_docs:
//! before_doc_update_owner`): a client's edit without one, or with `null` by a server admin, is
//! stored with the writer's name. Done here, below every write path, as `_users`' hashing is
//! ([`super::users::hash_passwords`]); who may change another login's document is the
//! replicator's write guard's (`crate::replicator::rules`). A replicated revision is kept as it
//! came, as CouchDB keeps it. A writer without a name (the open API) adds none.

use serde_json::Value;

use super::engine::Write;

/// The replicator database's name (CouchDB's `_replicator`).
pub const REPLICATOR_DB: &str = "_replicator";

/// `writes` with `owner` set on each client edit that has none, by `writer`; `None` when nothing
/// changes.
pub fn with_owner(writes: &[Write], writer: Option<&str>, admin: bool) -> Option<Vec<Write>> {
    let writer = writer?;
    let wants_owner = |write: &Write| match write {
        Write::Edit { body, deleted: false, .. } => match body.get("owner") {
            None => true,
            Some(Value::Null) => admin,
            Some(_) => false,
        },
        _ => false,
    };
    if !writes.iter().any(wants_owner) {
        return None;
    }
    Some(
        writes
            .iter()
            .map(|write| match write {
                Write::Edit { parent, deleted, body } if wants_owner(write) => {
                    let mut body = body.clone();
                    body.insert("owner".into(), Value::from(writer));
                    Write::Edit { parent: parent.clone(), deleted: *deleted, body }
                }
                other => other.clone(),
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn edit(body: Value) -> Write {
        Write::Edit { parent: None, deleted: false, body: body.as_object().cloned().unwrap_or_default() }
    }

    #[test]
    fn a_clients_edit_gets_its_writer_as_owner() {
        let owned = with_owner(&[edit(json!({"source": "a"}))], Some("bob"), false).unwrap();
        let Write::Edit { body, .. } = &owned[0] else { panic!("an edit") };
        assert_eq!(body["owner"], "bob");
        assert!(with_owner(&[edit(json!({"owner": "carol"}))], Some("bob"), true).is_none(), "kept");
        assert!(with_owner(&[edit(json!({"owner": null}))], Some("bob"), false).is_none(), "a non-admin's null");
        assert!(with_owner(&[edit(json!({"owner": null}))], Some("admin"), true).is_some(), "an admin's null");
        assert!(with_owner(&[edit(json!({}))], None, true).is_none(), "no name, no owner");
    }
}
