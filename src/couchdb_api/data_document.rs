//! Documents written through the CouchDB API must be data-store documents.
//!
//! A client's JSON document is taken apart here before it reaches the facade: CouchDB's special
//! members are taken out (`_rev`, `_deleted`, `_revisions`), dropped (`_conflicts`, …) or refused
//! (`doc_validation`), and what is left is checked by the data-store rules below HTTP
//! ([`crate::database::data_store_rules`]: the `_id` made of the `userId`, `namespace` and `key`
//! fields, derived from them when a `POST` names none; the login's confinement; the fields' types;
//! attachments refused), whose refusals are `forbidden`, as a CouchDB `validate_doc_update`
//! function answers them (replicators skip such documents). Malformed requests are
//! `bad_request` (or CouchDB's own error name).

use serde_json::{Map, Value};

use super::access::Principal;
use super::error::{CouchError, CouchResult};
use crate::backend::{Revision, LOCAL_PREFIX};
pub use crate::database::data_store_rules::DESIGN_PREFIX;
use crate::database::data_store_rules::{self as rules, DataWrite};
use crate::model::document::fields;
use crate::model::{DocumentId, Limits};

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
    // CouchDB's id rule, as every database applies it.
    crate::database::document::check_id(id).map_err(super::db::refused)?;
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
    if let Some(id) = &id_text {
        id_kind(id)?;
    }
    let write = DataWrite { id: id_text.as_deref(), deleted, body: &body };
    let id = rules::check_write(write, &principal.confinement(), limits)?;
    Ok(IncomingDocument { id, rev, deleted, revisions, body })
}

/// Removes the special members CouchDB ignores on write and refuses the ones this server
/// cannot keep: attachments (a data-store rule, checked first as before) and unknown `_` members.
fn strip_special_members(body: &mut Map<String, Value>) -> CouchResult<()> {
    for ignored in ["_conflicts", "_deleted_conflicts", "_local_seq", "_revs_info"] {
        body.remove(ignored);
    }
    rules::refuse_attachments(body)?;
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

    /// The rules' refusals, made below HTTP, reach the client as before: 403 `forbidden` with the
    /// rule's reason, in the same order (attachments, then unknown members, then the id).
    #[test]
    fn the_rules_refusals_keep_their_status_name_and_reason() {
        let answer = |doc: Value, principal: &Principal| {
            let err = parse(doc, None, principal, &Limits::default()).unwrap_err();
            (err.status.as_u16(), err.error, err.reason)
        };
        let forbidden = |reason: &str| (403, "forbidden".to_owned(), reason.to_owned());
        assert_eq!(
            answer(doc(), &Principal::User("someone".into())),
            forbidden("this login may only access documents of user \"someone\"")
        );
        let mut attached = doc();
        attached["_attachments"] = json!({ "a.txt": { "data": "aGk=" } });
        attached["_foo"] = json!(1);
        attached["key"] = json!("other");
        assert_eq!(
            answer(attached.clone(), &Principal::Admin),
            forbidden("attachments are not supported: agentstore keeps JSON documents only")
        );
        attached.as_object_mut().unwrap().remove("_attachments");
        assert_eq!(answer(attached, &Principal::Admin).1, "doc_validation");
        let mut fieldless = json!({ "value": 1 });
        assert_eq!(
            answer(fieldless.clone(), &Principal::Admin),
            forbidden("a document without _id needs string fields userId, namespace and key to derive it from")
        );
        fieldless["_id"] = json!("_design/x");
        assert_eq!(answer(fieldless, &Principal::Admin), forbidden("\"_design/x\" is not a data-store document id"));
        let mut mismatched = doc();
        mismatched["key"] = json!("other");
        assert_eq!(
            answer(mismatched, &Principal::Admin),
            forbidden(
                "not a data-store document: _id \"user_123:default:Z3JlZXRpbmc=\" is not the id of its userId, \
                 namespace and key (\"user_123:default:b3RoZXI=\")"
            )
        );
        let empty = parse(json!({ "_id": "" }), None, &Principal::Admin, &Limits::default()).unwrap_err();
        assert_eq!((empty.status.as_u16(), empty.error.as_str()), (400, "illegal_docid"));
    }

    #[test]
    fn revisions_must_have_couchdbs_form() {
        assert!(parse_rev("1-abc").is_ok());
        assert!(parse_rev("abc").is_err());
        assert!(parse_rev("-abc").is_err());
        assert!(parse_rev("1-").is_err());
    }
}
