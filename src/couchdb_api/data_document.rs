//! Documents written through the CouchDB API must be data-store documents.
//!
//! A client's JSON document is checked here before it reaches the facade: its `_id` must be the
//! composite id of its `userId`, `namespace` and `key` fields (derived from them when a `POST`
//! names no `_id`), a per-user login may write only its own user's documents, and CouchDB's
//! special members are taken apart (`_rev`, `_deleted`, `_revisions`) or refused (attachments).
//! The data-store fields must have the spec's types (`model::document::check_field_types`);
//! every other field is kept as sent. Violations of the data-store rules are `forbidden`, as a
//! CouchDB `validate_doc_update` function answers them (replicators skip such documents);
//! malformed requests are `bad_request`.

use serde_json::{Map, Value};

use super::access::Principal;
use super::error::{CouchError, CouchResult};
use crate::backend::{Revision, LOCAL_PREFIX};
use crate::model::document::{self, fields};
use crate::model::{DocumentId, Limits};

/// The prefix of design documents' ids.
pub const DESIGN_PREFIX: &str = "_design/";

/// A client document taken apart.
#[derive(Debug)]
pub struct IncomingDocument {
    pub id: DocumentId,
    /// The `_rev` the client sent (the revision it updates).
    pub rev: Option<String>,
    pub deleted: bool,
    /// `_revisions` as sent (`{start, ids}`), for `new_edits: false`.
    pub revisions: Option<Value>,
    /// Every field except the special ones.
    pub body: Map<String, Value>,
}

/// What kind of document an id names.
#[derive(Debug, PartialEq, Eq)]
pub enum IdKind<'a> {
    Data,
    Local(&'a str),
    Design,
}

/// Classifies an id, refusing ids CouchDB refuses (`_` prefixes other than the reserved ones).
pub fn id_kind(id: &str) -> CouchResult<IdKind<'_>> {
    if let Some(name) = id.strip_prefix(LOCAL_PREFIX) {
        return Ok(IdKind::Local(name));
    }
    if id.starts_with(DESIGN_PREFIX) {
        return Ok(IdKind::Design);
    }
    if id.is_empty() {
        return Err(CouchError::new(
            axum::http::StatusCode::BAD_REQUEST,
            "illegal_docid",
            "Document id must not be empty",
        ));
    }
    if id.starts_with('_') {
        return Err(CouchError::new(
            axum::http::StatusCode::BAD_REQUEST,
            "illegal_docid",
            "Only reserved document ids may start with underscore.",
        ));
    }
    Ok(IdKind::Data)
}

/// Takes a client's document apart and checks it. `path_id` is the id from the URL (PUT), if
/// any; without one and without `_id`, the id is derived from the identity fields.
pub fn parse(
    doc: Value,
    path_id: Option<&str>,
    principal: &Principal,
    limits: &Limits,
) -> CouchResult<IncomingDocument> {
    let Value::Object(mut body) = doc else {
        return Err(CouchError::bad_request("Document must be a JSON object"));
    };
    let sent_id = match body.remove(fields::ID) {
        None => None,
        Some(Value::String(id)) => Some(id),
        Some(_) => {
            return Err(CouchError::new(
                axum::http::StatusCode::BAD_REQUEST,
                "illegal_docid",
                "Document id must be a string",
            ))
        }
    };
    if let (Some(sent), Some(path)) = (&sent_id, path_id) {
        if sent != path {
            return Err(CouchError::bad_request("Document id must match"));
        }
    }
    let rev = match body.remove(fields::REV) {
        None | Some(Value::Null) => None,
        Some(Value::String(rev)) => Some(rev),
        Some(_) => return Err(CouchError::bad_request("Invalid rev format")),
    };
    let deleted = match body.remove("_deleted") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) => true,
        Some(_) => {
            return Err(CouchError::new(
                axum::http::StatusCode::BAD_REQUEST,
                "doc_validation",
                // `couch_doc:transfer_fields` takes `_deleted` only as a boolean.
                "Bad special document member: _deleted",
            ));
        }
    };
    let revisions = body.remove("_revisions");
    strip_special_members(&mut body)?;
    let id_text = path_id.map(str::to_owned).or(sent_id);
    let id = data_id(id_text.as_deref(), &body, deleted, limits)?;
    principal.check_id(id.as_str())?;
    // A field of the wrong type would be stored, and the data-store operations on the REST face
    // would then find the document unreadable (`corrupt_document`): refused here, naming the
    // field, as a `validate_doc_update` function refuses a document (403 `forbidden`; replicators
    // skip such a document and go on). A deletion's fields are not kept (docs/couchdb-api.md), so
    // they are not checked: a replicated deletion is never refused for them.
    if !deleted {
        document::check_field_types(&body).map_err(|e| not_data_store(&e.to_string()))?;
    }
    Ok(IncomingDocument { id, rev, deleted, revisions, body })
}

/// Removes the special members CouchDB ignores on write and refuses the ones this server
/// cannot keep.
fn strip_special_members(body: &mut Map<String, Value>) -> CouchResult<()> {
    for ignored in ["_conflicts", "_deleted_conflicts", "_local_seq", "_revs_info"] {
        body.remove(ignored);
    }
    if body.get("_attachments").is_some_and(|a| a.as_object().is_some_and(|m| !m.is_empty())) {
        return Err(CouchError::forbidden("attachments are not supported: agentstore keeps JSON documents only"));
    }
    body.remove("_attachments");
    if let Some(name) = body.keys().find(|k| k.starts_with('_')) {
        return Err(CouchError::new(
            axum::http::StatusCode::BAD_REQUEST,
            "doc_validation",
            format!("Bad special document member: {name}"),
        ));
    }
    Ok(())
}

/// The document's id: the one given, which must be the one the identity fields make, or one
/// derived from those fields. A deletion carries no fields; its id alone must follow the scheme.
fn data_id(given: Option<&str>, body: &Map<String, Value>, deleted: bool, limits: &Limits) -> CouchResult<DocumentId> {
    let Some(id) = given else {
        return expected_id(body, limits)?.ok_or_else(|| {
            CouchError::forbidden(
                "a document without _id needs string fields userId, namespace and key to derive it from",
            )
        });
    };
    match id_kind(id)? {
        IdKind::Data => {}
        IdKind::Local(_) | IdKind::Design => {
            return Err(CouchError::forbidden(format!("{id:?} is not a data-store document id")))
        }
    }
    if deleted {
        return DocumentId::parse(id).map_err(|e| not_data_store(&e.to_string()));
    }
    match expected_id(body, limits)? {
        None => {
            Err(not_data_store("a document needs string fields userId, namespace and key, of which its _id is made"))
        }
        Some(derived) if derived.as_str() == id => Ok(derived),
        Some(derived) => Err(not_data_store(&format!(
            "_id {id:?} is not the id of its userId, namespace and key ({:?})",
            derived.as_str()
        ))),
    }
}

/// The composite id the identity fields make, `None` when one of them is missing.
fn expected_id(body: &Map<String, Value>, limits: &Limits) -> CouchResult<Option<DocumentId>> {
    let field = |name: &str| match body.get(name) {
        None => Ok(None),
        Some(Value::String(text)) => Ok(Some(text.clone())),
        Some(_) => Err(not_data_store(&format!("field {name} must be a string"))),
    };
    match (field(fields::USER_ID)?, field(fields::NAMESPACE)?, field(fields::KEY)?) {
        (Some(user), Some(namespace), Some(key)) => {
            DocumentId::new(&user, &namespace, &key, limits).map(Some).map_err(|e| not_data_store(&e.to_string()))
        }
        _ => Ok(None),
    }
}

fn not_data_store(why: &str) -> CouchError {
    CouchError::forbidden(format!("not a data-store document: {why}"))
}

/// A revision as clients send it: `N-<hex>`.
pub fn parse_rev(text: &str) -> CouchResult<Revision> {
    let valid = text.split_once('-').is_some_and(|(generation, hash)| {
        !generation.is_empty() && generation.bytes().all(|b| b.is_ascii_digit()) && !hash.is_empty()
    });
    if valid {
        Ok(Revision(text.to_owned()))
    } else {
        Err(CouchError::bad_request(format!("Invalid rev format: {text:?}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn doc() -> Value {
        json!({"_id": "user_123:default:Z3JlZXRpbmc=", "userId": "user_123", "namespace": "default",
               "key": "greeting", "value": "Hello", "extra": 1})
    }

    #[test]
    fn a_data_store_document_is_accepted_with_its_unknown_fields() {
        let parsed = parse(doc(), None, &Principal::Admin, &Limits::default()).unwrap();
        assert_eq!(parsed.id.as_str(), "user_123:default:Z3JlZXRpbmc=");
        assert_eq!(parsed.body["extra"], json!(1));
        assert!(!parsed.body.contains_key("_id"));
    }

    #[test]
    fn the_id_is_derived_when_none_is_sent() {
        let mut without_id = doc();
        without_id.as_object_mut().unwrap().remove("_id");
        let parsed = parse(without_id, None, &Principal::Admin, &Limits::default()).unwrap();
        assert_eq!(parsed.id.as_str(), "user_123:default:Z3JlZXRpbmc=");
    }

    #[test]
    fn an_id_that_is_not_made_of_the_fields_is_forbidden() {
        let mut wrong = doc();
        wrong["key"] = json!("other");
        let err = parse(wrong, None, &Principal::Admin, &Limits::default()).unwrap_err();
        assert_eq!((err.status.as_u16(), err.error.as_str()), (403, "forbidden"));
        assert!(err.reason.contains("not the id of its userId"), "{}", err.reason);
    }

    #[test]
    fn another_users_document_is_forbidden_to_a_user_login() {
        let err = parse(doc(), None, &Principal::User("someone".into()), &Limits::default()).unwrap_err();
        assert_eq!(err.status.as_u16(), 403);
        assert!(parse(doc(), None, &Principal::User("user_123".into()), &Limits::default()).is_ok());
    }

    #[test]
    fn reserved_ids_and_members_are_refused_as_couchdb_does() {
        assert_eq!(id_kind("_notallowed").unwrap_err().error, "illegal_docid");
        let mut bad_member = doc();
        bad_member["_foo"] = json!(1);
        assert_eq!(parse(bad_member, None, &Principal::Admin, &Limits::default()).unwrap_err().error, "doc_validation");
        let mut mismatched = doc();
        mismatched["_id"] = json!("user_123:default:b3RoZXI=");
        let err = parse(mismatched, Some("user_123:default:Z3JlZXRpbmc="), &Principal::Admin, &Limits::default())
            .unwrap_err();
        assert_eq!(err.reason, "Document id must match");
    }

    #[test]
    fn data_store_fields_of_the_wrong_type_are_forbidden_naming_them_except_in_a_deletion() {
        let mut wrong = doc();
        wrong["accessCount"] = json!("lots");
        let err = parse(wrong.clone(), None, &Principal::Admin, &Limits::default()).unwrap_err();
        assert_eq!((err.status.as_u16(), err.error.as_str()), (403, "forbidden"));
        assert!(err.reason.contains("accessCount"), "{}", err.reason);
        // A deletion's fields are dropped, never read: a replicated deletion is not refused.
        wrong["_deleted"] = json!(true);
        assert!(parse(wrong, None, &Principal::Admin, &Limits::default()).is_ok());
    }

    #[test]
    fn revisions_must_have_couchdbs_form() {
        assert!(parse_rev("1-abc").is_ok());
        assert!(parse_rev("abc").is_err());
        assert!(parse_rev("-abc").is_err());
        assert!(parse_rev("1-").is_err());
    }
}
