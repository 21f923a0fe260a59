//! The stored document's fields and the rules that create and update them.
//!
//! A document body is kept as a JSON object (`serde_json::Map`, insertion-ordered) rather than a
//! struct, so fields written by other systems survive every rewrite untouched and new documents
//! come out with the spec's field order. Only the fields the spec names are ever changed here.

use serde_json::{Map, Value};

use crate::error::{Error, ErrorKind, Result};
use crate::model::id::DocumentId;

/// Field names of `agent_data_store` documents, exactly as the spec spells them.
pub mod fields {
    pub const ID: &str = "_id";
    pub const REV: &str = "_rev";
    pub const USER_ID: &str = "userId";
    pub const NAMESPACE: &str = "namespace";
    pub const KEY: &str = "key";
    pub const VALUE: &str = "value";
    pub const METADATA: &str = "metadata";
    pub const CREATED_BY_AGENT: &str = "createdByAgent";
    pub const LAST_ACCESSED_BY_AGENT: &str = "lastAccessedByAgent";
    pub const ACCESS_COUNT: &str = "accessCount";
    pub const CREATED_AT: &str = "createdAt";
    pub const UPDATED_AT: &str = "updatedAt";
    pub const LAST_ACCESSED_AT: &str = "lastAccessedAt";
}

/// Where a field goes in the spec's field order (unknown fields last), for backends that keep no
/// field order of their own.
pub fn field_rank(name: &str) -> usize {
    use fields::*;
    [
        USER_ID,
        NAMESPACE,
        KEY,
        VALUE,
        METADATA,
        CREATED_BY_AGENT,
        LAST_ACCESSED_BY_AGENT,
        ACCESS_COUNT,
        CREATED_AT,
        UPDATED_AT,
        LAST_ACCESSED_AT,
    ]
    .iter()
    .position(|f| *f == name)
    .unwrap_or(usize::MAX)
}

/// Who is touching a document, and when (one timestamp per operation, so `updatedAt` and
/// `lastAccessedAt` written together are equal).
#[derive(Debug, Clone)]
pub struct Access<'a> {
    pub agent: Option<&'a str>,
    pub at: String,
}

/// The body of a new document for `set`, in the spec's field order. Creation counts as the
/// first access.
pub fn new_body(
    id: &DocumentId,
    value: Value,
    metadata: Option<Map<String, Value>>,
    access: &Access,
) -> Map<String, Value> {
    let mut body = Map::new();
    body.insert(fields::USER_ID.into(), id.user_id().into());
    body.insert(fields::NAMESPACE.into(), id.namespace().into());
    body.insert(fields::KEY.into(), id.key().into());
    body.insert(fields::VALUE.into(), value);
    if let Some(metadata) = metadata {
        body.insert(fields::METADATA.into(), Value::Object(metadata));
    }
    if let Some(agent) = access.agent {
        body.insert(fields::CREATED_BY_AGENT.into(), agent.into());
        body.insert(fields::LAST_ACCESSED_BY_AGENT.into(), agent.into());
    }
    body.insert(fields::ACCESS_COUNT.into(), 1u64.into());
    body.insert(fields::CREATED_AT.into(), access.at.clone().into());
    body.insert(fields::UPDATED_AT.into(), access.at.clone().into());
    body.insert(fields::LAST_ACCESSED_AT.into(), access.at.clone().into());
    body
}

/// Applies `set` to an existing document: the value is replaced, metadata merged shallowly (new
/// keys added, existing keys overwritten), the update counted as an access. Identity fields that
/// another writer left out are filled in from the id; every other field is kept.
pub fn apply_update(
    id: &DocumentId,
    body: &mut Map<String, Value>,
    value: Value,
    metadata: Option<Map<String, Value>>,
    access: &Access,
) -> Result<()> {
    for (field, expected) in
        [(fields::USER_ID, id.user_id()), (fields::NAMESPACE, id.namespace()), (fields::KEY, id.key())]
    {
        body.entry(field).or_insert_with(|| expected.into());
    }
    body.insert(fields::VALUE.into(), value);
    if let Some(update) = metadata {
        match body.get_mut(fields::METADATA) {
            Some(Value::Object(existing)) => existing.extend(update),
            None | Some(Value::Null) => {
                body.insert(fields::METADATA.into(), Value::Object(update));
            }
            Some(_) => {
                return Err(corrupt(
                    id.as_str(),
                    fields::METADATA,
                    "is stored but is not a JSON object, so it cannot be merged",
                ));
            }
        }
    }
    body.entry(fields::CREATED_AT).or_insert_with(|| access.at.clone().into());
    body.insert(fields::UPDATED_AT.into(), access.at.clone().into());
    record_access(id.as_str(), body, access)
}

/// Counts one access: `accessCount` + 1, `lastAccessedAt`, and `lastAccessedByAgent` when an
/// agent is named. A missing `accessCount` counts as 0.
pub fn record_access(id: &str, body: &mut Map<String, Value>, access: &Access) -> Result<()> {
    let count = access_count(id, body)?;
    body.insert(fields::ACCESS_COUNT.into(), (count + 1).into());
    body.insert(fields::LAST_ACCESSED_AT.into(), access.at.clone().into());
    if let Some(agent) = access.agent {
        body.insert(fields::LAST_ACCESSED_BY_AGENT.into(), agent.into());
    }
    Ok(())
}

/// The stored `accessCount` (0 when absent or null).
pub fn access_count(id: &str, body: &Map<String, Value>) -> Result<u64> {
    match body.get(fields::ACCESS_COUNT) {
        None | Some(Value::Null) => Ok(0),
        Some(Value::Number(n)) => {
            n.as_u64().ok_or_else(|| corrupt(id, fields::ACCESS_COUNT, "is not a non-negative integer"))
        }
        Some(_) => Err(corrupt(id, fields::ACCESS_COUNT, "is not a number")),
    }
}

/// The document's key: the `key` field, or, for documents another writer stored without one,
/// the key decoded from the id.
pub fn key_of(id: &str, body: &Map<String, Value>) -> Result<String> {
    match body.get(fields::KEY) {
        Some(Value::String(key)) => Ok(key.clone()),
        _ => DocumentId::parse(id).map(|parsed| parsed.key().to_owned()),
    }
}

/// The document's namespace, from the `namespace` field or the id.
pub fn namespace_of(id: &str, body: &Map<String, Value>) -> Result<String> {
    match body.get(fields::NAMESPACE) {
        Some(Value::String(ns)) => Ok(ns.clone()),
        _ => DocumentId::parse(id).map(|parsed| parsed.namespace().to_owned()),
    }
}

/// A data-store field whose value is not of the spec's type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldTypeError {
    pub field: &'static str,
    /// What the spec requires of it, as a sentence fragment (`must be a string`).
    pub requirement: &'static str,
}

impl std::fmt::Display for FieldTypeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "field {} {}", self.field, self.requirement)
    }
}

/// Checks that every data-store field present has the type the spec gives it, so the
/// data-store operations can always read what a document protocol (the CouchDB API) wrote:
/// `userId`, `namespace`, `key` strings; `metadata` an object; `createdByAgent` and
/// `lastAccessedByAgent` strings; `accessCount` a non-negative integer; `createdAt`,
/// `updatedAt` and `lastAccessedAt` ISO 8601 timestamp strings (in any form the migration's
/// timestamp rules read, since earlier writers used several). `null` counts as absent for the
/// optional fields, as the data-store operations read it. `value` may be any JSON.
pub fn check_field_types(body: &Map<String, Value>) -> std::result::Result<(), FieldTypeError> {
    DataFields::of(body).check_types()
}

/// The data-store fields a body holds (each `None` when absent), found in one pass over its
/// members ([`DataFields::collect`]): a write's checks read each of them, and looking each up by
/// name hashed it every time (22 lookups per document on the data-store write path, issue 38).
#[derive(Debug, Default, Clone, Copy)]
pub struct DataFields<'a> {
    pub user_id: Option<&'a Value>,
    pub namespace: Option<&'a Value>,
    pub key: Option<&'a Value>,
    pub value: Option<&'a Value>,
    pub metadata: Option<&'a Value>,
    pub created_by_agent: Option<&'a Value>,
    pub last_accessed_by_agent: Option<&'a Value>,
    pub access_count: Option<&'a Value>,
    pub created_at: Option<&'a Value>,
    pub updated_at: Option<&'a Value>,
    pub last_accessed_at: Option<&'a Value>,
}

impl<'a> DataFields<'a> {
    /// The fields of `body`.
    pub fn of(body: &'a Map<String, Value>) -> Self {
        let mut found = DataFields::default();
        for (name, value) in body {
            found.collect(name, value);
        }
        found
    }

    /// Takes the member `name` when it is a data-store field; `false` when it is not one.
    pub fn collect(&mut self, name: &str, value: &'a Value) -> bool {
        use fields::*;
        let slot = match name {
            USER_ID => &mut self.user_id,
            NAMESPACE => &mut self.namespace,
            KEY => &mut self.key,
            VALUE => &mut self.value,
            METADATA => &mut self.metadata,
            CREATED_BY_AGENT => &mut self.created_by_agent,
            LAST_ACCESSED_BY_AGENT => &mut self.last_accessed_by_agent,
            ACCESS_COUNT => &mut self.access_count,
            CREATED_AT => &mut self.created_at,
            UPDATED_AT => &mut self.updated_at,
            LAST_ACCESSED_AT => &mut self.last_accessed_at,
            _ => return false,
        };
        *slot = Some(value);
        true
    }

    /// [`check_field_types`] on the fields found.
    pub fn check_types(&self) -> std::result::Result<(), FieldTypeError> {
        use fields::*;
        let wrong = |field, requirement| Err(FieldTypeError { field, requirement });
        for (field, found) in [(USER_ID, self.user_id), (NAMESPACE, self.namespace), (KEY, self.key)] {
            if found.is_some_and(|v| !v.is_string()) {
                return wrong(field, "must be a string");
            }
        }
        if self.metadata.is_some_and(|v| !v.is_object() && !v.is_null()) {
            return wrong(METADATA, "must be a JSON object");
        }
        for (field, found) in
            [(CREATED_BY_AGENT, self.created_by_agent), (LAST_ACCESSED_BY_AGENT, self.last_accessed_by_agent)]
        {
            if found.is_some_and(|v| !v.is_string() && !v.is_null()) {
                return wrong(field, "must be a string");
            }
        }
        if self.access_count.is_some_and(|v| !v.is_null() && v.as_u64().is_none()) {
            return wrong(ACCESS_COUNT, "must be a non-negative integer");
        }
        for (field, found) in
            [(CREATED_AT, self.created_at), (UPDATED_AT, self.updated_at), (LAST_ACCESSED_AT, self.last_accessed_at)]
        {
            let readable = |v: &Value| v.is_string() && super::timestamp::read_timestamp(v).is_some();
            if found.is_some_and(|v| !v.is_null() && !readable(v)) {
                return wrong(field, "must be an ISO 8601 timestamp string");
            }
        }
        Ok(())
    }
}

fn corrupt(id: &str, field: &str, problem: &str) -> Error {
    Error::new(ErrorKind::Corrupt, format!("document {id:?}: field {field} {problem}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Limits;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn new_body_has_the_spec_fields_in_order() {
        let id = DocumentId::new("user_123", "default", "greeting", &Limits::default()).unwrap();
        let access = Access { agent: Some("hello-agent"), at: "2026-02-05T10:00:00Z".into() };
        let body = new_body(&id, json!("Hello, World!"), None, &access);
        let names: Vec<&str> = body.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "userId",
                "namespace",
                "key",
                "value",
                "createdByAgent",
                "lastAccessedByAgent",
                "accessCount",
                "createdAt",
                "updatedAt",
                "lastAccessedAt"
            ]
        );
        assert_eq!(body["accessCount"], json!(1));
    }

    #[test]
    fn metadata_merges_as_the_spec_example() {
        let id = DocumentId::new("u", "ns", "k", &Limits::default()).unwrap();
        let access = Access { agent: None, at: "2026-02-06T00:00:00Z".into() };
        let mut body = obj(json!({
            "userId": "u", "namespace": "ns", "key": "k", "value": 1,
            "metadata": {"version": "1.0", "author": "alice"},
            "accessCount": 4, "createdAt": "2026-02-01T00:00:00Z", "updatedAt": "2026-02-01T00:00:00Z",
            "foreignField": {"kept": true}
        }));
        apply_update(&id, &mut body, json!(2), Some(obj(json!({"version": "2.0", "reviewer": "bob"}))), &access)
            .unwrap();
        assert_eq!(body["metadata"], json!({"version": "2.0", "author": "alice", "reviewer": "bob"}));
        assert_eq!(body["value"], json!(2));
        assert_eq!(body["accessCount"], json!(5));
        assert_eq!(body["createdAt"], json!("2026-02-01T00:00:00Z"));
        assert_eq!(body["updatedAt"], json!("2026-02-06T00:00:00Z"));
        assert_eq!(body["foreignField"], json!({"kept": true}));
        assert!(!body.contains_key("lastAccessedByAgent"));
    }

    #[test]
    fn corrupt_fields_are_reported_not_overwritten() {
        let access = Access { agent: None, at: "2026-02-06T00:00:00Z".into() };
        let mut body = obj(json!({"accessCount": "five"}));
        assert_eq!(record_access("x", &mut body, &access).unwrap_err().kind(), ErrorKind::Corrupt);
        let mut body = obj(json!({"accessCount": -1}));
        assert_eq!(record_access("x", &mut body, &access).unwrap_err().kind(), ErrorKind::Corrupt);
        let id = DocumentId::new("u", "ns", "k", &Limits::default()).unwrap();
        let mut body = obj(json!({"metadata": [1]}));
        let err = apply_update(&id, &mut body, json!(1), Some(Map::new()), &access).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt);
    }

    #[test]
    fn field_types_follow_the_spec() {
        let good = obj(json!({
            "userId": "u", "namespace": "n", "key": "k", "value": [1], "metadata": {"a": 1},
            "createdByAgent": "a", "lastAccessedByAgent": null, "accessCount": 3,
            "createdAt": "2026-02-05T10:00:00Z", "updatedAt": "2026-02-05T10:00:00.123456",
            "lastAccessedAt": null, "extra": {"anything": true}
        }));
        assert_eq!(check_field_types(&good), Ok(()));
        for (field, bad) in [
            ("userId", json!(1)),
            ("namespace", json!(null)),
            ("key", json!(["k"])),
            ("metadata", json!("m")),
            ("metadata", json!([1])),
            ("createdByAgent", json!(7)),
            ("lastAccessedByAgent", json!({})),
            ("accessCount", json!("lots")),
            ("accessCount", json!(-1)),
            ("accessCount", json!(1.5)),
            ("createdAt", json!(1_770_000_000)),
            ("updatedAt", json!("yesterday")),
            ("lastAccessedAt", json!(true)),
        ] {
            let mut body = good.clone();
            body.insert(field.into(), bad.clone());
            let err = check_field_types(&body).unwrap_err();
            assert_eq!(err.field, field, "{field} = {bad}");
        }
    }

    #[test]
    fn key_and_namespace_fall_back_to_the_id() {
        let body = Map::new();
        assert_eq!(key_of("u:files:repo:c3JjL21haW4ucHk=", &body).unwrap(), "src/main.py");
        assert_eq!(namespace_of("u:files:repo:c3JjL21haW4ucHk=", &body).unwrap(), "files:repo");
    }
}
