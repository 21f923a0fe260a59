//! The rules a migration applies to every document it reads: which documents are data-store
//! documents at all, how malformed ones are repaired, and how timestamps are normalised.
//!
//! Everything here is a pure function of one document, so `migrate` and `verify` apply exactly
//! the same rules and a normalised field is never reported as a difference. The rules are listed,
//! with their names as they appear in reports, in `docs/migration.md`.

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::model::timestamp::{self, read_timestamp};
use crate::model::{fields, DocumentId};

/// What the migration does with access tracking (`accessCount`, `lastAccessedAt`,
/// `lastAccessedByAgent`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum AccessTracking {
    /// Copy the fields as they are.
    #[default]
    Keep,
    /// Start counting afresh at the target: `accessCount` 0, no last-access fields.
    Reset,
}

/// Why a document is not a data-store document and is left where it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForeignKind {
    DesignDocument,
    LocalDocument,
    NotCompositeId,
}

impl ForeignKind {
    /// The name reports count it under.
    pub fn as_str(self) -> &'static str {
        match self {
            ForeignKind::DesignDocument => "design_document",
            ForeignKind::LocalDocument => "local_document",
            ForeignKind::NotCompositeId => "not_a_composite_id",
        }
    }
}

/// A rule that changed a document, or a problem found and left as it was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    /// The rule's name, e.g. `key_from_id` or `timestamp_unparseable`.
    pub rule: &'static str,
    pub detail: String,
}

/// A document ready to be written.
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared {
    pub id: DocumentId,
    pub body: Map<String, Value>,
    /// Changes made by repair and normalisation rules.
    pub repairs: Vec<Note>,
    /// Problems reported but left in place (the field is copied unchanged).
    pub warnings: Vec<Note>,
}

/// What becomes of one document read from the source.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// A data-store document, repaired and normalised, to be copied.
    Copy(Prepared),
    /// Not a data-store document: counted, never copied.
    Foreign(ForeignKind),
    /// A data-store document whose fields contradict each other: reported, not copied, because
    /// any repair would be a guess (e.g. `userId` naming another user than the `_id` does).
    Malformed(String),
}

/// What kind of foreign document `id` names, or `None` for a data-store document's id.
pub fn foreign_kind(id: &str) -> Option<ForeignKind> {
    if id.starts_with("_design/") {
        Some(ForeignKind::DesignDocument)
    } else if id.starts_with("_local/") {
        Some(ForeignKind::LocalDocument)
    } else if DocumentId::parse(id).is_err() {
        Some(ForeignKind::NotCompositeId)
    } else {
        None
    }
}

/// Applies every rule to one document (its `_id` and the body without `_id`/`_rev`).
pub fn prepare(id: &str, mut body: Map<String, Value>, access_tracking: AccessTracking) -> Verdict {
    if let Some(kind) = foreign_kind(id) {
        return Verdict::Foreign(kind);
    }
    let Ok(parsed) = DocumentId::parse(id) else {
        return Verdict::Foreign(ForeignKind::NotCompositeId);
    };
    let mut repairs = Vec::new();
    let mut warnings = Vec::new();

    for (field, from_id, rule) in [
        (fields::USER_ID, parsed.user_id(), "user_id_from_id"),
        (fields::NAMESPACE, parsed.namespace(), "namespace_from_id"),
        (fields::KEY, parsed.key(), "key_from_id"),
    ] {
        match body.get(field) {
            None | Some(Value::Null) => {
                body.insert(field.into(), from_id.into());
                repairs.push(Note { rule, detail: format!("{field} was missing; taken from the _id") });
            }
            Some(Value::String(text)) if text.is_empty() => {
                body.insert(field.into(), from_id.into());
                repairs.push(Note { rule, detail: format!("{field} was empty; taken from the _id") });
            }
            Some(Value::String(text)) if text == from_id => {}
            Some(other) => {
                return Verdict::Malformed(format!("field {field} is {other} but the _id says {from_id:?}"));
            }
        }
    }

    if !body.contains_key(fields::VALUE) {
        warnings.push(Note { rule: "value_missing", detail: "the document has no value field".into() });
    }
    if body.get(fields::METADATA).is_some_and(|m| !m.is_object() && !m.is_null()) {
        warnings.push(Note { rule: "metadata_not_object", detail: "metadata is not a JSON object".into() });
    }

    for field in [fields::CREATED_AT, fields::UPDATED_AT, fields::LAST_ACCESSED_AT] {
        normalise_timestamp_field(&mut body, field, &mut repairs, &mut warnings);
    }
    fill_required_timestamps(&mut body, &mut repairs, &mut warnings);

    match access_tracking {
        AccessTracking::Keep => {
            let count = body.get(fields::ACCESS_COUNT);
            if count.is_some_and(|c| !c.is_null() && c.as_u64().is_none()) {
                warnings.push(Note {
                    rule: "access_count_invalid",
                    detail: "accessCount is not a non-negative integer".into(),
                });
            }
        }
        AccessTracking::Reset => {
            body.insert(fields::ACCESS_COUNT.into(), 0u64.into());
            body.remove(fields::LAST_ACCESSED_AT);
            body.remove(fields::LAST_ACCESSED_BY_AGENT);
        }
    }
    Verdict::Copy(Prepared { id: parsed, body, repairs, warnings })
}

/// Rewrites one timestamp field in the normal form when any rule can read it; an unreadable one
/// is kept as it is and reported.
fn normalise_timestamp_field(
    body: &mut Map<String, Value>,
    field: &'static str,
    repairs: &mut Vec<Note>,
    warnings: &mut Vec<Note>,
) {
    let Some(stored) = body.get(field) else { return };
    if stored.is_null() {
        return;
    }
    match read_timestamp(stored) {
        Some((at, rule)) => {
            let normal = format_timestamp(at);
            if stored.as_str() != Some(normal.as_str()) {
                repairs.push(Note { rule, detail: format!("{field} {stored} became {normal:?}") });
                body.insert(field.into(), normal.into());
            }
        }
        None => warnings.push(Note {
            rule: "timestamp_unparseable",
            detail: format!("{field} {stored} is not a timestamp any rule reads; copied unchanged"),
        }),
    }
}

/// `createdAt` and `updatedAt` are required: a missing one is taken from the other, or from
/// `lastAccessedAt` when both are missing.
fn fill_required_timestamps(body: &mut Map<String, Value>, repairs: &mut Vec<Note>, warnings: &mut Vec<Note>) {
    let present = |body: &Map<String, Value>, field: &str| body.get(field).is_some_and(|v| !v.is_null());
    for (field, sources) in [
        (fields::CREATED_AT, [fields::UPDATED_AT, fields::LAST_ACCESSED_AT]),
        (fields::UPDATED_AT, [fields::CREATED_AT, fields::LAST_ACCESSED_AT]),
    ] {
        if present(body, field) {
            continue;
        }
        let source = sources
            .into_iter()
            .find(|s| body.get(*s).and_then(Value::as_str).and_then(timestamp::parse_exact).is_some());
        match source {
            Some(source) => {
                let copied = body[source].clone();
                body.insert(field.into(), copied);
                repairs.push(Note {
                    rule: "timestamp_filled",
                    detail: format!("{field} was missing; copied from {source}"),
                });
            }
            None => warnings.push(Note {
                rule: "timestamp_missing",
                detail: format!("{field} is missing and no other timestamp can stand in for it"),
            }),
        }
    }
}

/// The normal form: RFC 3339 in UTC with `Z`, seconds always, fractional digits only when the
/// instant has them (3, 6 or 9 digits). `2026-02-05T10:00:00Z` stays as it is, and no instant is
/// rounded, so normalising loses nothing.
pub fn format_timestamp(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::AutoSi, true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            other => panic!("not an object: {other}"),
        }
    }

    fn copied(verdict: Verdict) -> Prepared {
        match verdict {
            Verdict::Copy(prepared) => prepared,
            other => panic!("expected a copy, got {other:?}"),
        }
    }

    fn rules(notes: &[Note]) -> Vec<&'static str> {
        notes.iter().map(|n| n.rule).collect()
    }

    const ID: &str = "user_123:files:my-repo:c3JjL21haW4ucHk=";

    #[test]
    fn a_spec_document_passes_unchanged() {
        let original = body(json!({
            "userId": "user_123", "namespace": "files:my-repo", "key": "src/main.py", "value": {"lines": 2},
            "accessCount": 15, "createdAt": "2026-02-05T09:00:00Z", "updatedAt": "2026-02-05T09:00:00Z",
            "lastAccessedAt": "2026-02-05T14:30:00Z", "someOtherSystemsField": [1]
        }));
        let prepared = copied(prepare(ID, original.clone(), AccessTracking::Keep));
        assert_eq!(prepared.body, original);
        assert!(prepared.repairs.is_empty() && prepared.warnings.is_empty());
    }

    #[test]
    fn identity_fields_are_recovered_from_the_id() {
        let prepared = copied(prepare(
            ID,
            body(json!({"namespace": "", "userId": null, "value": 1, "createdAt": "2026-02-05T09:00:00Z",
                        "updatedAt": "2026-02-05T09:00:00Z"})),
            AccessTracking::Keep,
        ));
        assert_eq!(prepared.body["userId"], json!("user_123"));
        assert_eq!(prepared.body["namespace"], json!("files:my-repo"));
        assert_eq!(prepared.body["key"], json!("src/main.py"));
        assert_eq!(rules(&prepared.repairs), ["user_id_from_id", "namespace_from_id", "key_from_id"]);
    }

    #[test]
    fn contradicting_identity_is_malformed_not_guessed() {
        for bad in [json!({"userId": "someone_else"}), json!({"key": "other.py"}), json!({"namespace": 7})] {
            let verdict = prepare(ID, body(bad.clone()), AccessTracking::Keep);
            assert!(matches!(verdict, Verdict::Malformed(_)), "{bad}: {verdict:?}");
        }
    }

    #[test]
    fn foreign_documents_are_recognised() {
        let empty = Map::new;
        assert_eq!(
            prepare("_design/data_store", empty(), AccessTracking::Keep),
            Verdict::Foreign(ForeignKind::DesignDocument)
        );
        assert_eq!(prepare("_local/x", empty(), AccessTracking::Keep), Verdict::Foreign(ForeignKind::LocalDocument));
        for id in ["plain-id", "u:ns:!!!", "u::YQ=="] {
            assert_eq!(prepare(id, empty(), AccessTracking::Keep), Verdict::Foreign(ForeignKind::NotCompositeId));
        }
    }

    #[test]
    fn timestamps_are_normalised_without_losing_precision() {
        let cases = [
            (json!("2026-02-05T10:00:00Z"), "2026-02-05T10:00:00Z", None),
            (json!("2026-02-05T11:30:00+01:30"), "2026-02-05T10:00:00Z", Some("timestamp_normalised")),
            (json!("2026-02-05T10:00:00.000Z"), "2026-02-05T10:00:00Z", Some("timestamp_normalised")),
            (json!("2026-02-05T10:00:00.120z"), "2026-02-05T10:00:00.120Z", Some("timestamp_normalised")),
            (json!("2026-02-05T10:00:00.123456"), "2026-02-05T10:00:00.123456Z", Some("timestamp_naive_as_utc")),
            (json!("2026-02-05 10:00:00"), "2026-02-05T10:00:00Z", Some("timestamp_naive_as_utc")),
            (json!("2026-02-05 12:00:00+02:00"), "2026-02-05T10:00:00Z", Some("timestamp_normalised")),
            (json!("2026-02-05"), "2026-02-05T00:00:00Z", Some("timestamp_date_as_midnight_utc")),
            (json!(1770285600), "2026-02-05T10:00:00Z", Some("timestamp_from_unix_time")),
            (json!(1770285600500u64), "2026-02-05T10:00:00.500Z", Some("timestamp_from_unix_time")),
        ];
        for (stored, expected, rule) in cases {
            let prepared = copied(prepare(
                "u:ns:YQ==",
                body(json!({"value": 1, "createdAt": stored.clone(), "updatedAt": "2026-02-05T10:00:00Z"})),
                AccessTracking::Keep,
            ));
            assert_eq!(prepared.body["createdAt"], json!(expected), "{stored}");
            assert_eq!(prepared.repairs.iter().find(|n| n.rule.starts_with("timestamp")).map(|n| n.rule), rule);
        }
    }

    #[test]
    fn unreadable_timestamps_are_kept_and_reported() {
        let prepared = copied(prepare(
            "u:ns:YQ==",
            body(json!({"value": 1, "createdAt": "last tuesday", "updatedAt": true})),
            AccessTracking::Keep,
        ));
        assert_eq!(prepared.body["createdAt"], json!("last tuesday"));
        assert_eq!(prepared.body["updatedAt"], json!(true));
        assert_eq!(rules(&prepared.warnings), ["timestamp_unparseable", "timestamp_unparseable"]);
    }

    #[test]
    fn missing_required_timestamps_are_filled_from_the_others() {
        let prepared = copied(prepare(
            "u:ns:YQ==",
            body(json!({"value": 1, "updatedAt": "2026-02-05T10:00:00+00:00"})),
            AccessTracking::Keep,
        ));
        assert_eq!(prepared.body["createdAt"], json!("2026-02-05T10:00:00Z"));
        let prepared = copied(prepare(
            "u:ns:YQ==",
            body(json!({"value": 1, "lastAccessedAt": "2026-02-06T00:00:00Z"})),
            AccessTracking::Keep,
        ));
        assert_eq!(prepared.body["createdAt"], json!("2026-02-06T00:00:00Z"));
        assert_eq!(prepared.body["updatedAt"], json!("2026-02-06T00:00:00Z"));
        let prepared = copied(prepare("u:ns:YQ==", body(json!({"value": 1})), AccessTracking::Keep));
        assert_eq!(rules(&prepared.warnings), ["timestamp_missing", "timestamp_missing"]);
        assert!(!prepared.body.contains_key("createdAt"));
    }

    #[test]
    fn access_tracking_reset_starts_afresh() {
        let prepared = copied(prepare(
            "u:ns:YQ==",
            body(json!({"value": 1, "accessCount": 9, "lastAccessedAt": "2026-02-06T00:00:00Z",
                        "lastAccessedByAgent": "a", "createdByAgent": "b", "createdAt": "2026-02-05T10:00:00Z",
                        "updatedAt": "2026-02-05T10:00:00Z"})),
            AccessTracking::Reset,
        ));
        assert_eq!(prepared.body["accessCount"], json!(0));
        assert!(!prepared.body.contains_key("lastAccessedAt"));
        assert!(!prepared.body.contains_key("lastAccessedByAgent"));
        assert_eq!(prepared.body["createdByAgent"], json!("b"));
    }

    #[test]
    fn odd_fields_are_copied_and_reported() {
        let prepared = copied(prepare(
            "u:ns:YQ==",
            body(json!({"metadata": [1], "accessCount": -3, "createdAt": "2026-02-05T10:00:00Z",
                        "updatedAt": "2026-02-05T10:00:00Z"})),
            AccessTracking::Keep,
        ));
        assert_eq!(rules(&prepared.warnings), ["value_missing", "metadata_not_object", "access_count_invalid"]);
        assert_eq!(prepared.body["accessCount"], json!(-3));
        assert_eq!(prepared.body["metadata"], json!([1]));
    }
}
