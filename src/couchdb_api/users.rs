//! Logins of the `_users` database's documents ([`crate::database::users`] keeps their rules and
//! hashes): reading a user's document for [`super::auth`], one read per login check, so a
//! password changed through any instance is seen at the next request on every instance.
//!
//! On the backends whose databases this server keeps, the document is the engine's winner; on
//! the CouchDB backend `_users` is CouchDB's own database, read through the backend's request
//! pass-through. A document with conflicts is refused as CouchDB refuses it.

use std::sync::Arc;

use async_trait::async_trait;
use serde_json::{Map, Value};

use crate::backend::catalog::DbName;
use crate::database::users::{StoredCredentials, USERS_DB, USER_ID_PREFIX};
use crate::database::Databases;
use crate::error::{Error, ErrorKind, Result};

/// CouchDB's 401 for a user document with conflicts (`couch_auth_cache:validate_user_creds`).
pub const CONFLICTED_USER_DOC: &str =
    "User document conflicts must be resolved before the document is used for authentication purposes.";

/// The most bytes of a user document read from the CouchDB backend (a name, roles and a hash
/// in practice; CouchDB's own document bound applies when it was written).
const MAX_USER_DOC_BYTES: usize = 1 << 20;

/// A user's document as a login reads it.
#[derive(Debug, Clone)]
pub struct UserDoc {
    /// Its current revision: a verified password is remembered for this revision only.
    pub rev: String,
    pub body: Map<String, Value>,
    /// Whether it has conflicting leaves (CouchDB refuses the login then).
    pub conflicted: bool,
}

impl UserDoc {
    /// The roles a login of this document carries: its `roles` strings, without the system
    /// roles CouchDB's validation refuses (`_admin`…; `_metrics` kept), which a document
    /// replicated in may still carry.
    pub fn roles(&self) -> Vec<String> {
        let roles = self.body.get("roles").and_then(Value::as_array);
        roles
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .filter(|role| !role.starts_with('_') || *role == "_metrics")
            .map(str::to_owned)
            .collect()
    }

    /// Its password hash, or why it cannot be checked.
    pub fn credentials(&self) -> std::result::Result<StoredCredentials, crate::database::users::Unusable> {
        StoredCredentials::of(&self.body)
    }
}

/// Where user documents are read from.
#[async_trait]
pub trait UserDocs: Send + Sync + std::fmt::Debug {
    /// The live document of user `name`, `None` when there is none.
    async fn user_doc(&self, name: &str) -> Result<Option<UserDoc>>;
}

/// The `_users` database of the server's [`Databases`].
pub struct UsersDb {
    databases: Arc<Databases>,
}

impl std::fmt::Debug for UsersDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UsersDb")
    }
}

impl UsersDb {
    pub fn new(databases: Arc<Databases>) -> Self {
        UsersDb { databases }
    }
}

#[async_trait]
impl UserDocs for UsersDb {
    async fn user_doc(&self, name: &str) -> Result<Option<UserDoc>> {
        let Some(db) = self.databases.open(&DbName::parse(USERS_DB)?).await? else { return Ok(None) };
        let id = format!("{USER_ID_PREFIX}{name}");
        if db.backend().forwards_requests() {
            return read_forwarded(db.backend().as_ref(), &id).await;
        }
        let Some(state) = db.read(&id).await? else { return Ok(None) };
        let Some(winner) = state.tree.winner().filter(|leaf| !leaf.deleted) else { return Ok(None) };
        let conflicted = state.tree.leaves().iter().filter(|leaf| !leaf.deleted).count() > 1;
        Ok(Some(UserDoc { rev: winner.path.leaf_rev(), body: winner.body.clone(), conflicted }))
    }
}

/// The document `id` of CouchDB's own `_users` (with `conflicts=true`), through the backend.
async fn read_forwarded(backend: &dyn crate::backend::DocumentBackend, id: &str) -> Result<Option<UserDoc>> {
    let path: String = percent_encoding::utf8_percent_encode(id, percent_encoding::NON_ALPHANUMERIC).to_string();
    let asked = crate::backend::DesignRequest::get_json(path, Some("conflicts=true".to_owned()));
    let Some(answer) = backend.design_request(asked).await? else { return Ok(None) };
    let status = answer.status;
    let bytes = answer.body_within(MAX_USER_DOC_BYTES, &format!("the user document {id:?}")).await?;
    if status == 404 {
        return Ok(None);
    }
    if !(200..300).contains(&status) {
        return Err(Error::new(ErrorKind::Unavailable, format!("the backend answered GET _users/{id} with {status}")));
    }
    let mut body: Map<String, Value> = serde_json::from_slice(&bytes)
        .map_err(|e| Error::new(ErrorKind::Corrupt, format!("the user document {id:?} is not JSON: {e}")))?;
    let rev = body.get("_rev").and_then(Value::as_str).unwrap_or_default().to_owned();
    let conflicted = body.remove("_conflicts").is_some();
    Ok(Some(UserDoc { rev, body, conflicted }))
}
