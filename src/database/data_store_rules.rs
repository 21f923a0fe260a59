//! The data-store database's rules on its documents, below HTTP: what a write may hold and who may
//! write or read what. Each rule is written here once; the CouchDB API's data-store handlers call
//! these functions, and a data-store [`super::Database`] is given [`DataStoreRules`] as its
//! [`WriteGuard`], so the engine applies the same rules to every write it makes.
//!
//! - **A data document** ([`check_write`]): its `_id` is the composite id
//!   `{userId}:{namespace}:{base64url(key)}` of its identity fields ([`crate::model::DocumentId`]),
//!   derived from them when a `POST` names none ([`derived_id`]); the data-store fields have the
//!   spec's types ([`crate::model::document::check_field_types`]) and `value` and `metadata` the
//!   data-store size limit (a 413); attachments and members starting
//!   with `_` are not kept. A deletion carries no fields: only its id must follow the scheme. A
//!   replicated write (`new_edits: false`) is checked as an edit is. Every refusal but a size is
//!   [`ErrorKind::Forbidden`] (CouchDB's 403 `forbidden`, as a `validate_doc_update` function
//!   answers: replicators skip such a document and go on).
//! - **Confinement** ([`Confinement`]): an admin login sees and writes everything; a per-user
//!   login only the ids of its user (`{user}:…`: a user id never contains `:`, so the id alone says
//!   whose a document is, and listings are clipped to an id range without reading documents), only
//!   local documents stored under `{user}:` (its replication checkpoints, which no other user can
//!   read or reset), and no design document.
//!
//! Who writes comes from the request: [`super::validation::as_writer`] with a
//! [`super::validation::Writer`] whose `data_store` is the login's confinement (the CouchDB API
//! sets it for each database request). The guard fails closed: a write with no confinement (made
//! outside a request, from a task spawned off one, or by a login without a data-store user) is
//! refused. Nothing legitimate writes that way: the REST face and the command line write the
//! data-store database through the facade (`src/store.rs`), never through the engine, so every
//! write the engine makes on it comes from the CouchDB face with its login.

use async_trait::async_trait;
use serde_json::{Map, Value};

use super::engine::{DocState, Write};
use super::validation::current_writer;
use super::write_guard::{ProposedWrite, WriteGuard};
use super::Database;
use crate::backend::{IdRange, LOCAL_PREFIX};
use crate::error::{Error, ErrorKind, Result};
use crate::model::document::{fields, DataFields};
use crate::model::{DocumentId, Limits};

/// The prefix of design documents' ids.
pub const DESIGN_PREFIX: &str = "_design/";

/// The refusal of a design document to a per-user login: a view reads every user's documents.
pub const DESIGN_ADMINS_ONLY: &str = "design documents are open to admins only: a view reads every user's documents";

/// What a login may see and write on the data-store database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Confinement {
    /// Everything (an admin login, CouchDB's `_admin` role).
    Everything,
    /// Only the documents and local documents of this data-store user id.
    User(String),
}

impl Confinement {
    /// The user a per-user login is confined to; `None` when it sees everything.
    pub fn only_user(&self) -> Option<&str> {
        match self {
            Confinement::Everything => None,
            Confinement::User(user) => Some(user),
        }
    }

    /// Whether the document `id` is one this login may read and write: for a per-user login, an
    /// id starting with its user and a `:` (so never a design document).
    pub fn admits_id(&self, id: &str) -> bool {
        match self {
            Confinement::Everything => true,
            Confinement::User(user) => id.strip_prefix(user.as_str()).is_some_and(|rest| rest.starts_with(':')),
        }
    }

    /// The refusal of a document outside the login's user.
    pub fn check_id(&self, id: &str) -> Result<()> {
        if self.admits_id(id) {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::Forbidden,
            format!("this login may only access documents of user {:?}", self.only_user().unwrap_or_default()),
        ))
    }

    /// The refusal of design documents (and what reads through them: views, named `_changes`
    /// filters) to a per-user login.
    pub fn check_design(&self) -> Result<()> {
        match self {
            Confinement::Everything => Ok(()),
            Confinement::User(_) => Err(Error::new(ErrorKind::Forbidden, DESIGN_ADMINS_ONLY)),
        }
    }

    /// The refusal of what acts on the whole database (`what`: purging, compacting, changing its
    /// settings) to a per-user login: the data-store database is every user's, and such a login
    /// is confined to its own user's documents.
    pub fn check_database_wide(&self, what: &str) -> Result<()> {
        match self {
            Confinement::Everything => Ok(()),
            Confinement::User(user) => Err(Error::new(
                ErrorKind::Forbidden,
                format!(
                    "a per-user login (user {user:?}) may not {what}: the data-store database is shared by every \
                     user; an admin login may"
                ),
            )),
        }
    }

    /// The name the local document `_local/{name}` of this login is stored under: a per-user
    /// login's under `{user}:`, so one user never reads or resets another's checkpoints.
    pub fn local_name(&self, name: &str) -> String {
        match self {
            Confinement::Everything => name.to_owned(),
            Confinement::User(user) => format!("{user}:{name}"),
        }
    }

    /// Whether the local document stored under `stored_name` (without `_local/`) is one this
    /// login may read and write.
    pub fn admits_local(&self, stored_name: &str) -> bool {
        let stored_name = stored_name.strip_prefix(LOCAL_PREFIX).unwrap_or(stored_name);
        match self {
            Confinement::Everything => true,
            Confinement::User(user) => {
                stored_name.strip_prefix(user.as_str()).is_some_and(|rest| rest.starts_with(':'))
            }
        }
    }

    /// The ids a per-user login's listings are confined to: `[user:, user;)`, since `;` is the
    /// byte after `:`. `None` when every id is listed.
    pub fn id_bounds(&self) -> Option<(String, String)> {
        self.only_user().map(|user| (format!("{user}:"), format!("{user};")))
    }

    /// `range` cut to the ids this login may list, in either direction.
    pub fn clip(&self, mut range: IdRange) -> IdRange {
        let Some((low, high)) = self.id_bounds() else { return range };
        if range.descending {
            if range.start.as_ref().is_none_or(|start| *start > high) {
                range.start = Some(high);
            }
            if range.end.as_ref().is_none_or(|end| *end < low) {
                range.end = Some(low);
                range.inclusive_end = true;
            }
        } else {
            if range.start.as_ref().is_none_or(|start| *start < low) {
                range.start = Some(low);
            }
            if range.end.as_ref().is_none_or(|end| *end > high) {
                range.end = Some(high);
                range.inclusive_end = false;
            }
        }
        range
    }
}

/// One proposed write of a data document, its special members (`_id`, `_rev`, `_deleted`,
/// `_revisions`) taken out.
#[derive(Debug, Clone, Copy)]
pub struct DataWrite<'a> {
    /// The id the write names (`None`: a `POST` without `_id`, whose id is derived).
    pub id: Option<&'a str>,
    /// Whether it is a deletion (its fields are not kept, so not checked).
    pub deleted: bool,
    /// Every other member, `_attachments` included when sent.
    pub body: &'a Map<String, Value>,
    /// Whether `body` is the document as the engine shows it to a write guard, still holding
    /// the special members above ([`SHOWN_MEMBERS`]), which are then not taken for its fields.
    pub shown: bool,
}

/// The special members a document shown to a write guard carries besides its fields.
const SHOWN_MEMBERS: [&str; 4] = ["_id", "_rev", "_revisions", "_deleted"];

/// Checks one proposed write of a data document by a login confined to `confinement`, and gives
/// the document's id. In this order: attachments, other `_` members, the id against the identity
/// fields (or derived from them), the login's confinement, the fields' types.
pub fn check_write(write: DataWrite<'_>, confinement: &Confinement, limits: &Limits) -> Result<DocumentId> {
    let members = Members::of(&write);
    if let Some(attachments) = members.attachments {
        refuse_attachments_value(attachments)?;
    }
    if let Some(name) = members.not_kept {
        return Err(not_data_store(&format!("member {name} is not kept")));
    }
    let id = match write.id {
        None => derived_from(&members.fields, limits)?,
        Some(id) => given_id(id, &members.fields, write.deleted, limits)?,
    };
    confinement.check_id(id.as_str())?;
    // A field of the wrong type would be stored, and the data-store operations on the REST face
    // would then find the document unreadable (`corrupt_document`). A deletion's fields are not
    // kept (docs/couchdb-api.md), so they are not checked: a replicated deletion is never refused
    // for them.
    if !write.deleted {
        members.fields.check_types().map_err(|e| not_data_store(&e.to_string()))?;
        check_sizes(&members.fields, limits)?;
    }
    Ok(id)
}

/// What [`check_write`] reads of a write's body, found in one pass over its members: the
/// data-store fields, `_attachments`, and the first other special member that is not kept.
struct Members<'a> {
    fields: DataFields<'a>,
    attachments: Option<&'a Value>,
    not_kept: Option<&'a str>,
}

impl<'a> Members<'a> {
    fn of(write: &DataWrite<'a>) -> Self {
        let mut members = Members { fields: DataFields::default(), attachments: None, not_kept: None };
        for (name, value) in write.body {
            if !name.starts_with('_') {
                members.fields.collect(name, value);
            } else if name == ATTACHMENTS {
                members.attachments = Some(value);
            } else if members.not_kept.is_none() && !(write.shown && SHOWN_MEMBERS.contains(&name.as_str())) {
                members.not_kept = Some(name);
            }
        }
        members
    }
}

/// `value` and `metadata` within the data-store size limit (`TooLarge`: a 413, as the REST face
/// answers them), so that the data-store operations can read and update what was written.
fn check_sizes(fields: &DataFields<'_>, limits: &Limits) -> Result<()> {
    if let Some(value) = fields.value {
        limits.check_value(value)?;
    }
    if let Some(metadata) = fields.metadata.filter(|metadata| metadata.is_object()) {
        limits.check_metadata(metadata)?;
    }
    Ok(())
}

const ATTACHMENTS: &str = "_attachments";

/// Refuses attachments: the data-store database keeps JSON documents only. An empty
/// `_attachments` object holds none and is let through.
pub fn refuse_attachments(body: &Map<String, Value>) -> Result<()> {
    match body.get(ATTACHMENTS) {
        Some(attachments) => refuse_attachments_value(attachments),
        None => Ok(()),
    }
}

/// [`refuse_attachments`] on the value of `_attachments`.
fn refuse_attachments_value(attachments: &Value) -> Result<()> {
    if attachments.as_object().is_some_and(|m| !m.is_empty()) {
        return Err(Error::new(
            ErrorKind::Forbidden,
            "attachments are not supported: agentstore keeps JSON documents only",
        ));
    }
    Ok(())
}

/// The id a write without `_id` gets: the composite id of its `userId`, `namespace` and `key`.
pub fn derived_id(body: &Map<String, Value>, limits: &Limits) -> Result<DocumentId> {
    derived_from(&DataFields::of(body), limits)
}

/// [`derived_id`] from the fields found.
fn derived_from(fields: &DataFields<'_>, limits: &Limits) -> Result<DocumentId> {
    identity_id(fields, limits)?.ok_or_else(|| {
        Error::new(
            ErrorKind::Forbidden,
            "a document without _id needs string fields userId, namespace and key to derive it from",
        )
    })
}

/// The id a write names, which must be a data-store id made of the identity fields; a
/// deletion's id alone must follow the scheme.
fn given_id(id: &str, fields: &DataFields<'_>, deleted: bool, limits: &Limits) -> Result<DocumentId> {
    if id.starts_with(LOCAL_PREFIX) || id.starts_with(DESIGN_PREFIX) {
        return Err(Error::new(ErrorKind::Forbidden, format!("{id:?} is not a data-store document id")));
    }
    if deleted {
        return DocumentId::parse(id).map_err(|e| not_data_store(&e.to_string()));
    }
    match identity_id(fields, limits)? {
        None => {
            Err(not_data_store("a document needs string fields userId, namespace and key, of which its _id is made"))
        }
        Some(made) if made.as_str() == id => Ok(made),
        Some(made) => Err(not_data_store(&format!(
            "_id {id:?} is not the id of its userId, namespace and key ({:?})",
            made.as_str()
        ))),
    }
}

/// The composite id the identity fields make, `None` when one of them is missing.
fn identity_id(fields: &DataFields<'_>, limits: &Limits) -> Result<Option<DocumentId>> {
    let user = identity_field(fields::USER_ID, fields.user_id)?;
    let namespace = identity_field(fields::NAMESPACE, fields.namespace)?;
    let key = identity_field(fields::KEY, fields.key)?;
    match (user, namespace, key) {
        (Some(user), Some(namespace), Some(key)) => {
            DocumentId::new(user, namespace, key, limits).map(Some).map_err(|e| not_data_store(&e.to_string()))
        }
        _ => Ok(None),
    }
}

/// An identity field's text, `None` when absent; refused when it is not a string.
fn identity_field<'a>(name: &str, found: Option<&'a Value>) -> Result<Option<&'a str>> {
    match found {
        None => Ok(None),
        Some(Value::String(text)) => Ok(Some(text.as_str())),
        Some(_) => Err(not_data_store(&format!("field {name} must be a string"))),
    }
}

fn not_data_store(why: &str) -> Error {
    Error::new(ErrorKind::Forbidden, format!("not a data-store document: {why}"))
}

/// The refusal of a write whose writer has no data-store confinement.
fn no_data_store_login() -> Error {
    Error::new(
        ErrorKind::Forbidden,
        "a write to the data-store database needs a login with a data-store user; none was given (a write \
         outside a CouchDB API request, or a login with roles only)",
    )
}

/// The data-store database's rules as the engine's write guard: every data document written is
/// checked with [`check_write`] against the writer's confinement; design documents may be
/// written by a login that sees everything only.
pub struct DataStoreRules {
    limits: Limits,
}

impl DataStoreRules {
    /// The rules with the data-store limits on user ids, namespaces and keys.
    pub fn new(limits: Limits) -> Self {
        DataStoreRules { limits }
    }

    /// The verdict on one proposed write (the document as the engine shows it: `_id`, `_rev`,
    /// `_deleted`, attachments as stubs).
    fn verdict(&self, write: &ProposedWrite, confinement: Option<&Confinement>) -> Option<Error> {
        let confinement = match confinement {
            Some(confinement) => confinement,
            None => return Some(no_data_store_login()),
        };
        let Some(doc) = write.new_doc.as_object() else {
            return Some(not_data_store("a document must be a JSON object"));
        };
        // The special members are left out by name, not by copying the document without them
        // (a copy of every document was a fifteenth of a data-store `_bulk_docs`, issue 38).
        let id = match doc.get("_id") {
            Some(Value::String(id)) => Some(id.as_str()),
            _ => None,
        };
        let deleted = doc.get("_deleted") == Some(&Value::Bool(true));
        let write = DataWrite { id, deleted, body: doc, shown: true };
        check_write(write, confinement, &self.limits).err()
    }
}

#[async_trait]
impl WriteGuard for DataStoreRules {
    /// Every write is checked.
    async fn applies(&self, _db: &Database) -> Result<bool> {
        Ok(true)
    }

    async fn check(&self, _db: &Database, writes: &[ProposedWrite]) -> Result<Vec<Option<Error>>> {
        let confinement = current_writer().data_store;
        Ok(writes.iter().map(|write| self.verdict(write, confinement.as_ref())).collect())
    }

    /// The bodies as written, not copies with the special members shown: the verdict reads the
    /// same id, deletion flag and fields ([`DataWrite::shown`] still lets a body's own special
    /// members through, as they would be in the shown copy).
    async fn check_writes(
        &self,
        _db: &Database,
        id: &str,
        _state: Option<&DocState>,
        writes: &[Write],
    ) -> Result<Vec<Option<Error>>> {
        let confinement = current_writer().data_store;
        Ok(writes
            .iter()
            .map(|write| {
                let Some(confinement) = confinement.as_ref() else { return Some(no_data_store_login()) };
                let (deleted, body) = match write {
                    Write::Edit { deleted, body, .. } | Write::Replicated { deleted, body, .. } => (*deleted, body),
                };
                let write = DataWrite { id: Some(id), deleted, body, shown: true };
                check_write(write, confinement, &self.limits).err()
            })
            .collect())
    }

    fn checks_writes_themselves(&self) -> bool {
        true
    }

    async fn check_design(&self, _db: &Database, writes: &[ProposedWrite]) -> Result<Vec<Option<Error>>> {
        let refusal = match current_writer().data_store {
            Some(confinement) => confinement.check_design().err(),
            None => Some(no_data_store_login()),
        };
        Ok(writes.iter().map(|_| refusal.as_ref().map(Error::copy_for_each)).collect())
    }

    fn design_changed(&self, _db: &Database) {}
}

#[cfg(test)]
#[path = "data_store_rules_tests.rs"]
mod tests;
