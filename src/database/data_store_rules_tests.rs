//! The data-store rules, one test per rule, with expected answers from the data-store spec
//! (`../shared/seeds/data-store-schema.current.txt`: the id scheme and its examples, the field
//! table) and docs/couchdb-api.md ("Documents are data-store documents", per-user logins); then
//! the rules as a data-store database's write guard.

use std::sync::Arc;

use serde_json::{json, Value};

use super::*;
use crate::backend::embedded::EmbeddedBackend;
use crate::database::validation::{as_writer, DesignValidation, Writer};
use crate::database::write_guard::ChainedGuards;
use crate::database::Write;

/// The spec's example entry: `_id` "user_123:default:bXkta2V5" is base64url("my-key").
fn spec_entry() -> Map<String, Value> {
    json!({
        "userId": "user_123", "namespace": "default", "key": "my-key",
        "value": { "result": "analysis complete", "score": 95, "items": ["a", "b", "c"] },
        "metadata": { "version": "1.0", "source": "analyzer-agent" },
        "createdByAgent": "data-processor", "lastAccessedByAgent": "report-generator", "accessCount": 5,
        "createdAt": "2026-02-01T10:30:00Z", "updatedAt": "2026-02-05T14:22:00Z",
        "lastAccessedAt": "2026-02-05T14:22:00Z"
    })
    .as_object()
    .cloned()
    .unwrap_or_default()
}

const SPEC_ID: &str = "user_123:default:bXkta2V5";

fn admin() -> Confinement {
    Confinement::Everything
}

fn user(name: &str) -> Confinement {
    Confinement::User(name.to_owned())
}

fn checked(id: Option<&str>, deleted: bool, body: &Map<String, Value>, who: &Confinement) -> Result<DocumentId> {
    check_write(DataWrite { id, deleted, body, shown: false }, who, &Limits::default())
}

fn refusal(result: Result<DocumentId>) -> (ErrorKind, String) {
    match result {
        Ok(id) => panic!("accepted as {id}"),
        Err(err) => (err.kind(), err.message().to_owned()),
    }
}

#[test]
fn the_spec_entry_is_accepted_under_its_composite_id_with_unknown_fields_kept() {
    let mut entry = spec_entry();
    entry.insert("extra".into(), json!(1));
    assert_eq!(checked(Some(SPEC_ID), false, &entry, &admin()).unwrap().as_str(), SPEC_ID);
    // The spec's second example: a namespace with a colon, a key with a slash and a dot.
    let mut files = spec_entry();
    files.insert("userId".into(), json!("user_google_123456789"));
    files.insert("namespace".into(), json!("files:my-repo"));
    files.insert("key".into(), json!("src/main.py"));
    let id = "user_google_123456789:files:my-repo:c3JjL21haW4ucHk=";
    assert_eq!(checked(Some(id), false, &files, &admin()).unwrap().as_str(), id);
}

#[test]
fn a_write_without_an_id_gets_the_id_of_its_identity_fields() {
    assert_eq!(derived_id(&spec_entry(), &Limits::default()).unwrap().as_str(), SPEC_ID);
    assert_eq!(checked(None, false, &spec_entry(), &admin()).unwrap().as_str(), SPEC_ID);
    let mut keyless = spec_entry();
    keyless.remove("key");
    let (kind, reason) = refusal(derived_id(&keyless, &Limits::default()));
    assert_eq!(kind, ErrorKind::Forbidden);
    assert!(reason.contains("needs string fields userId, namespace and key"), "{reason}");
}

#[test]
fn an_id_not_made_of_the_identity_fields_is_forbidden() {
    let mut other_key = spec_entry();
    other_key.insert("key".into(), json!("other"));
    let (kind, reason) = refusal(checked(Some(SPEC_ID), false, &other_key, &admin()));
    assert_eq!(kind, ErrorKind::Forbidden);
    assert!(reason.starts_with("not a data-store document: _id"), "{reason}");
    // Without the identity fields there is nothing to make the id of.
    let (kind, _) = refusal(checked(Some(SPEC_ID), false, &Map::new(), &admin()));
    assert_eq!(kind, ErrorKind::Forbidden);
    // An identity field that is not a string.
    let mut numeric = spec_entry();
    numeric.insert("namespace".into(), json!(7));
    let (_, reason) = refusal(checked(Some(SPEC_ID), false, &numeric, &admin()));
    assert!(reason.contains("namespace must be a string"), "{reason}");
    // Local and design ids are not data-store ids.
    for id in ["_local/x", "_design/x"] {
        let (kind, reason) = refusal(checked(Some(id), false, &spec_entry(), &admin()));
        assert_eq!(kind, ErrorKind::Forbidden);
        assert!(reason.contains("is not a data-store document id"), "{reason}");
    }
}

#[test]
fn fields_of_the_wrong_type_are_forbidden_naming_them() {
    for (field, wrong) in [
        ("accessCount", json!("lots")),
        ("accessCount", json!(-1)),
        ("metadata", json!("text")),
        ("createdByAgent", json!(3)),
        ("updatedAt", json!("yesterday")),
    ] {
        let mut entry = spec_entry();
        entry.insert(field.into(), wrong.clone());
        let (kind, reason) = refusal(checked(Some(SPEC_ID), false, &entry, &admin()));
        assert_eq!(kind, ErrorKind::Forbidden, "{field}: {wrong}");
        assert!(reason.contains(field), "{field}: {reason}");
    }
    // `null` counts as absent for the optional fields.
    let mut nulls = spec_entry();
    for field in ["metadata", "createdByAgent", "accessCount", "lastAccessedAt"] {
        nulls.insert(field.into(), Value::Null);
    }
    assert!(checked(Some(SPEC_ID), false, &nulls, &admin()).is_ok());
}

#[test]
fn a_deletion_needs_only_an_id_that_follows_the_scheme() {
    // A tombstone carries no fields; one replicated with odd fields is not refused for them.
    assert!(checked(Some(SPEC_ID), true, &Map::new(), &admin()).is_ok());
    let mut odd = Map::new();
    odd.insert("accessCount".into(), json!("lots"));
    assert!(checked(Some(SPEC_ID), true, &odd, &admin()).is_ok());
    let (kind, _) = refusal(checked(Some("no-colons"), true, &Map::new(), &admin()));
    assert_eq!(kind, ErrorKind::Forbidden);
    // A deletion of another user's document is still outside a per-user login.
    let (kind, reason) = refusal(checked(Some(SPEC_ID), true, &Map::new(), &user("user_456")));
    assert_eq!(kind, ErrorKind::Forbidden);
    assert!(reason.contains("user_456"), "{reason}");
}

#[test]
fn attachments_and_other_underscore_members_are_not_kept() {
    let mut with_attachment = spec_entry();
    with_attachment.insert("_attachments".into(), json!({ "a.txt": { "stub": true } }));
    let (kind, reason) = refusal(checked(Some(SPEC_ID), false, &with_attachment, &admin()));
    assert_eq!(kind, ErrorKind::Forbidden);
    assert!(reason.starts_with("attachments are not supported"), "{reason}");
    // Even in a deletion, and before any other rule.
    let (_, reason) = refusal(checked(Some("_design/x"), true, &with_attachment, &admin()));
    assert!(reason.starts_with("attachments are not supported"), "{reason}");
    let mut none_attached = spec_entry();
    none_attached.insert("_attachments".into(), json!({}));
    assert!(checked(Some(SPEC_ID), false, &none_attached, &admin()).is_ok());
    let mut replication_state = spec_entry();
    replication_state.insert("_replication_state".into(), json!("completed"));
    let (kind, reason) = refusal(checked(Some(SPEC_ID), false, &replication_state, &admin()));
    assert_eq!(kind, ErrorKind::Forbidden);
    assert!(reason.contains("_replication_state"), "{reason}");
}

#[test]
fn a_per_user_login_writes_only_ids_of_its_user() {
    assert!(checked(Some(SPEC_ID), false, &spec_entry(), &user("user_123")).is_ok());
    assert!(checked(None, false, &spec_entry(), &user("user_123")).is_ok());
    let (kind, reason) = refusal(checked(Some(SPEC_ID), false, &spec_entry(), &user("user_456")));
    assert_eq!(
        (kind, reason.as_str()),
        (ErrorKind::Forbidden, "this login may only access documents of user \"user_456\"")
    );
    // The id is checked against the fields before the login: a mismatch names the id.
    let mut other_key = spec_entry();
    other_key.insert("key".into(), json!("other"));
    let (_, reason) = refusal(checked(Some(SPEC_ID), false, &other_key, &user("user_456")));
    assert!(reason.starts_with("not a data-store document"), "{reason}");
}

#[test]
fn a_user_is_admitted_to_ids_that_start_with_its_user_and_a_colon() {
    let alice = user("alice");
    assert!(alice.admits_id("alice:ns:a2V5"));
    assert!(alice.admits_id("alice:files:my-repo:a2V5"));
    for other in ["alicia:ns:a2V5", "alice", "alice;ns:a2V5", "bob:ns:a2V5", "_design/app", ""] {
        assert!(!alice.admits_id(other), "{other}");
        assert_eq!(alice.check_id(other).unwrap_err().kind(), ErrorKind::Forbidden);
    }
    assert!(admin().admits_id("bob:ns:a2V5") && admin().admits_id("_design/app"));
    assert_eq!(alice.check_design().unwrap_err().message(), DESIGN_ADMINS_ONLY);
    assert!(admin().check_design().is_ok());
    assert_eq!((alice.only_user(), admin().only_user()), (Some("alice"), None));
}

#[test]
fn a_user_keeps_local_documents_under_its_own_prefix() {
    let alice = user("alice");
    assert_eq!(alice.local_name("checkpoint"), "alice:checkpoint");
    assert_eq!(admin().local_name("checkpoint"), "checkpoint");
    assert!(alice.admits_local(&alice.local_name("checkpoint")));
    assert!(alice.admits_local("_local/alice:checkpoint"));
    assert!(!alice.admits_local("bob:checkpoint"));
    assert!(!alice.admits_local("alicia:checkpoint"));
    assert!(!alice.admits_local("checkpoint"));
    assert!(admin().admits_local("bob:checkpoint"));
}

#[test]
fn a_users_listing_is_clipped_to_its_ids_in_both_directions() {
    let alice = user("alice");
    let all = alice.clip(IdRange::all());
    assert_eq!((all.start.as_deref(), all.end.as_deref(), all.inclusive_end), (Some("alice:"), Some("alice;"), false));
    let descending = alice.clip(IdRange { descending: true, ..IdRange::all() });
    assert_eq!(
        (descending.start.as_deref(), descending.end.as_deref(), descending.inclusive_end),
        (Some("alice;"), Some("alice:"), true)
    );
    let inside = IdRange { start: Some("alice:b".into()), end: Some("alice:c".into()), ..IdRange::all() };
    assert_eq!(alice.clip(inside.clone()), inside);
    let partly = IdRange { start: Some("a".into()), end: Some("alice:c".into()), ..IdRange::all() };
    assert_eq!(alice.clip(partly).start.as_deref(), Some("alice:"));
    assert_eq!(admin().clip(IdRange::all()), IdRange::all());
}

// The rules as a data-store database's write guard.

fn edit(body: Map<String, Value>) -> Write {
    Write::Edit { parent: None, deleted: false, body }
}

fn writer(confinement: Option<Confinement>) -> Writer {
    Writer { data_store: confinement, ..Writer::anonymous() }
}

/// A database in the engine's own record layout given the data-store rules (the rules do not
/// depend on the layout), and `more` guards after them.
async fn ruled(dir: &tempfile::TempDir, more: Vec<Arc<dyn WriteGuard>>) -> Database {
    let backend = Arc::new(EmbeddedBackend::open(&dir.path().join("rules.redb")).await.unwrap());
    let mut guards: Vec<Arc<dyn WriteGuard>> = vec![Arc::new(DataStoreRules::new(Limits::default()))];
    guards.extend(more);
    let guard: Arc<dyn WriteGuard> = Arc::new(ChainedGuards::new(guards));
    Database::new("agent_data_store".into(), backend).with_write_guard(Some(guard))
}

#[tokio::test]
async fn the_engine_refuses_what_the_rules_refuse_and_stores_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let db = ruled(&dir, Vec::new()).await;
    let alice = Some(user("user_123"));

    let mut other_key = spec_entry();
    other_key.insert("key".into(), json!("other"));
    let mismatched = as_writer(writer(Some(admin())), db.write(SPEC_ID, &edit(other_key))).await.unwrap_err();
    assert_eq!(mismatched.kind(), ErrorKind::Forbidden, "{mismatched}");

    let theirs = as_writer(writer(Some(user("user_456"))), db.write(SPEC_ID, &edit(spec_entry()))).await.unwrap_err();
    assert_eq!(theirs.message(), "this login may only access documents of user \"user_456\"");

    let outside = db.write(SPEC_ID, &edit(spec_entry())).await.unwrap_err();
    assert_eq!(outside.kind(), ErrorKind::Forbidden, "a write with no writer fails closed");
    let roles_only = as_writer(writer(None), db.write(SPEC_ID, &edit(spec_entry()))).await.unwrap_err();
    assert_eq!(roles_only.kind(), ErrorKind::Forbidden);
    assert!(db.read(SPEC_ID).await.unwrap().is_none(), "nothing refused was stored");

    as_writer(writer(alice.clone()), db.write(SPEC_ID, &edit(spec_entry()))).await.unwrap();
    let stored = db.read(SPEC_ID).await.unwrap().unwrap();
    let winner = stored.tree.winner().unwrap();
    assert_eq!(winner.body["value"]["score"], json!(95));

    // A deletion by its owner, without fields.
    let rev = winner.path.leaf_rev();
    let delete = Write::Edit { parent: Some(rev), deleted: true, body: Map::new() };
    as_writer(writer(alice.clone()), db.write(SPEC_ID, &delete)).await.unwrap();
    assert!(db.read(SPEC_ID).await.unwrap().unwrap().tree.winner().unwrap().deleted);
}

#[tokio::test]
async fn design_documents_are_an_admins_and_validation_runs_after_the_rules() {
    let dir = tempfile::tempdir().unwrap();
    let engine = crate::js::JsEngine::new(crate::js::JsLimits::default()).unwrap();
    let db = ruled(&dir, vec![Arc::new(DesignValidation::new(engine))]).await;
    let validate = "function (newDoc) { if (newDoc.value === 'no') throw({forbidden: 'the function says no'}); }";
    let design = json!({ "validate_doc_update": validate }).as_object().cloned().unwrap_or_default();

    let by_user =
        as_writer(writer(Some(user("user_123"))), db.write("_design/v", &edit(design.clone()))).await.unwrap_err();
    assert_eq!(by_user.message(), DESIGN_ADMINS_ONLY);
    assert_eq!(db.write("_design/v", &edit(design.clone())).await.unwrap_err().kind(), ErrorKind::Forbidden);
    as_writer(writer(Some(admin())), db.write("_design/v", &edit(design))).await.unwrap();

    let mut refused_by_function = spec_entry();
    refused_by_function.insert("value".into(), json!("no"));
    let alice = writer(Some(user("user_123")));
    let err = as_writer(alice.clone(), db.write(SPEC_ID, &edit(refused_by_function))).await.unwrap_err();
    assert_eq!((err.kind(), err.message()), (ErrorKind::Forbidden, "the function says no"));
    // Refused by the rules first: the function's verdict is not the one given.
    let mut both = spec_entry();
    both.insert("value".into(), json!("no"));
    both.insert("key".into(), json!("other"));
    let err = as_writer(alice.clone(), db.write(SPEC_ID, &edit(both))).await.unwrap_err();
    assert!(err.message().starts_with("not a data-store document"), "{err}");
    as_writer(alice, db.write(SPEC_ID, &edit(spec_entry()))).await.unwrap();
}
