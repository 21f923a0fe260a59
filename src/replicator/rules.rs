//! The `_replicator` database's write guard, CouchDB 3.4.3's `couch_replicator_docs:
//! before_doc_update` as a check: a document another login owns (`owner`) is a server admin's to
//! change ("Can't update replication documents from other users."), and a document that does
//! not parse as a replication is refused with the parser's reason (403 `forbidden`), unless it is
//! deleted or in state `failed`. Design and local documents are not checked; the replicator's
//! own writes are a server admin's.
//!
//! The `owner` a client's document is given (the writer's name, as CouchDB sets it) is
//! `crate::database::replicator_owner`'s, in the engine, before this guard sees the write. A
//! local endpoint (a bare database name, which CouchDB 3.x
//! refuses) is a server admin's only: a job runs its local reads and writes with a server
//! admin's rights.

use async_trait::async_trait;
use serde_json::Value;

use super::spec::{self, Endpoint};
use crate::database::write_guard::{ProposedWrite, WriteGuard};
use crate::database::Database;
use crate::error::{Error, ErrorKind, Result};

/// The guard of the `_replicator` database.
pub struct ReplicatorRules;

#[async_trait]
impl WriteGuard for ReplicatorRules {
    async fn applies(&self, _db: &Database) -> Result<bool> {
        Ok(true)
    }

    async fn check(&self, _db: &Database, writes: &[ProposedWrite]) -> Result<Vec<Option<Error>>> {
        let writer = crate::database::validation::current_writer();
        let admin = writer.roles.iter().any(|role| role == "_admin");
        Ok(writes
            .iter()
            .map(|write| {
                check_doc(&write.new_doc, write.old_doc.as_ref(), writer.name.as_deref(), admin)
                    .err()
                    .map(|reason| Error::new(ErrorKind::Forbidden, reason))
            })
            .collect())
    }

    fn design_changed(&self, _db: &Database) {}
}

/// One proposed document: `Err` with CouchDB's reason.
fn check_doc(
    new_doc: &Value,
    old_doc: Option<&Value>,
    writer: Option<&str>,
    admin: bool,
) -> std::result::Result<(), String> {
    let owner = old_doc.and_then(|old| old.get("owner")).or_else(|| new_doc.get("owner"));
    match owner {
        None | Some(Value::Null) => {}
        Some(owner) if owner.as_str().is_some() && owner.as_str() == writer => {}
        Some(_) if admin => {}
        Some(_) => return Err("Can't update replication documents from other users.".into()),
    }
    if new_doc.get("_deleted") == Some(&Value::Bool(true))
        || new_doc.get("_replication_state").and_then(Value::as_str) == Some("failed")
    {
        return Ok(());
    }
    let Value::Object(body) = new_doc else { return Err("a replication document is an object".into()) };
    let replication = spec::parse(body)?;
    let local = [&replication.source, &replication.target].iter().any(|end| matches!(end, Endpoint::Local(_)));
    if local && !admin {
        return Err("local_endpoints_not_supported".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn owners_parsing_and_local_endpoints() {
        let doc = json!({"source": "http://h/a", "target": "http://h/b", "owner": "bob"});
        assert!(check_doc(&doc, None, Some("bob"), false).is_ok());
        assert_eq!(
            check_doc(&doc, Some(&doc), Some("carol"), false).unwrap_err(),
            "Can't update replication documents from other users."
        );
        assert!(check_doc(&doc, Some(&doc), None, true).is_ok(), "an admin changes any");
        assert_eq!(
            check_doc(&json!({"target": "http://h/b"}), None, None, true).unwrap_err(),
            "Missing replicator database"
        );
        assert!(check_doc(&json!({"_deleted": true}), None, None, false).is_ok());
        assert!(check_doc(&json!({"_replication_state": "failed"}), None, None, false).is_ok());
        let local = json!({"source": "a", "target": "b"});
        assert_eq!(check_doc(&local, None, Some("bob"), false).unwrap_err(), "local_endpoints_not_supported");
        assert!(check_doc(&local, None, None, true).is_ok());
    }
}
