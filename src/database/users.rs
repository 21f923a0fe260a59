//! The `_users` database's own rules, as CouchDB 3.4.3 keeps them in its engine
//! (`couch_users_db`) and in the validation of its `_design/_auth` document: a password written
//! in clear is hashed before the document is stored ([`hash_passwords`]), a user document's
//! shape and who may change what ([`UsersRules`], a write guard), and a stored hash checked
//! against a login's password ([`StoredCredentials`]).
//!
//! Hashing happens here, below every write path (`PUT`, `POST`, `_bulk_docs`, attachments), on a
//! client's edit only: a revision replicated in (`new_edits: false`, `migrate --db _users`) keeps
//! the hash it carries, so users moved from a real CouchDB log in with the passwords they had.
//! The hash is CouchDB's default: PBKDF2 with HMAC-SHA256, [`PBKDF2_ITERATIONS`] iterations, a
//! random 32-hex-digit salt used as text, the 32-byte key written as hex. Each hash takes about
//! a quarter of a second of one core, so at most [`hash_slots`] run at once, off the runtime.

use std::sync::{Arc, OnceLock};

use async_trait::async_trait;
use serde_json::{Map, Value};

use super::engine::{Database, Write};
use super::write_guard::{ProposedWrite, WriteGuard};
use crate::error::{Error, ErrorKind, Result};

/// The database's name (CouchDB's `[chttpd_auth] authentication_db`).
pub const USERS_DB: &str = "_users";
/// The prefix of a user document's id; the rest is the user's name.
pub const USER_ID_PREFIX: &str = "org.couchdb.user:";
/// CouchDB 3.4.3's `[chttpd_auth] iterations` default, used for every password hashed here.
pub const PBKDF2_ITERATIONS: u32 = 600_000;
/// The most PBKDF2 iterations a stored document may ask a login check to run (ten times
/// CouchDB's default): a document claiming more (10^9 would hold a core for minutes) fails the
/// login as a wrong password does, and the reason is logged (docs/bounds.md).
pub const MAX_LOGIN_ITERATIONS: u64 = 6_000_000;
/// The bytes of a derived key CouchDB writes: the PRF's output length, 32 for SHA-256.
const SHA256_KEY_BYTES: usize = 32;
/// The bytes of a derived key under SHA-1 (older CouchDB versions' PRF).
const SHA1_KEY_BYTES: usize = 20;

/// The fields CouchDB removes from a document whose password it hashes, before adding its own.
const PASSWORD_FIELDS: [&str; 8] =
    ["derived_key", "iterations", "password", "password_scheme", "password_sha", "preserve_salt", "pbkdf2_prf", "salt"];

/// CouchDB's `_security` of a new `_users` database (its `default_security = admin_only`):
/// members and admins are server admins only.
pub fn admin_only_security() -> Value {
    serde_json::json!({ "members": { "roles": ["_admin"] }, "admins": { "roles": ["_admin"] } })
}

/// Whether `name` is the users database.
pub fn is_users_db(name: &str) -> bool {
    name == USERS_DB
}

/// How many passwords are hashed at once (the cores, as the login checks' pool).
fn hash_slots() -> &'static Arc<tokio::sync::Semaphore> {
    static SLOTS: OnceLock<Arc<tokio::sync::Semaphore>> = OnceLock::new();
    SLOTS.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        Arc::new(tokio::sync::Semaphore::new(cores))
    })
}

/// `writes` with every client edit's clear `password` replaced by CouchDB's hash fields; `None`
/// when none carries one (nothing to copy). A `null` password is kept as CouchDB keeps it; any
/// other value that is not a string is CouchDB's 403.
pub async fn hash_passwords(writes: &[Write]) -> Result<Option<Vec<Write>>> {
    let carries_password =
        |write: &Write| matches!(write, Write::Edit { body, .. } if body.get("password").is_some_and(|p| !p.is_null()));
    if !writes.iter().any(carries_password) {
        return Ok(None);
    }
    let mut hashed = Vec::with_capacity(writes.len());
    for write in writes {
        match write {
            Write::Edit { parent, deleted, body } if carries_password(write) => {
                let body = hashed_body(body).await?;
                hashed.push(Write::Edit { parent: parent.clone(), deleted: *deleted, body });
            }
            other => hashed.push(other.clone()),
        }
    }
    Ok(Some(hashed))
}

/// `body` as CouchDB's `save_doc` leaves it: the hash fields first, then the body without its
/// password fields. `preserve_salt: true` keeps the salt the body carries.
async fn hashed_body(body: &Map<String, Value>) -> Result<Map<String, Value>> {
    let password = match body.get("password") {
        Some(Value::String(password)) => password.clone(),
        other => {
            let shown = other.map_or_else(String::new, Value::to_string);
            return Err(Error::new(ErrorKind::Forbidden, format!("Password value of '{shown}' is invalid.")));
        }
    };
    let kept_salt = match (body.get("preserve_salt"), body.get("salt")) {
        (Some(Value::Bool(true)), Some(Value::String(salt))) => Some(salt.clone()),
        _ => None,
    };
    let salt = match kept_salt {
        Some(salt) => salt,
        None => random_salt()?,
    };
    let derived_key = derive_off_runtime(password, salt.clone()).await?;
    let mut hashed = Map::with_capacity(body.len() + 5);
    hashed.insert("password_scheme".into(), Value::from("pbkdf2"));
    hashed.insert("pbkdf2_prf".into(), Value::from("sha256"));
    hashed.insert("salt".into(), Value::from(salt));
    hashed.insert("iterations".into(), Value::from(PBKDF2_ITERATIONS));
    hashed.insert("derived_key".into(), Value::from(derived_key));
    for (name, value) in body {
        if !PASSWORD_FIELDS.contains(&name.as_str()) {
            hashed.insert(name.clone(), value.clone());
        }
    }
    Ok(hashed)
}

/// A salt as CouchDB makes one (`couch_uuids:random()`): 16 random bytes as 32 hex digits.
fn random_salt() -> Result<String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| Error::new(ErrorKind::Internal, format!("no random salt: {e}")))?;
    Ok(hex::encode(bytes))
}

/// The PBKDF2-SHA256 key of `password`, on a blocking thread, a few at a time.
async fn derive_off_runtime(password: String, salt: String) -> Result<String> {
    let _slot = hash_slots()
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| Error::new(ErrorKind::Internal, "password hashing closed"))?;
    tokio::task::spawn_blocking(move || {
        hex::encode(pbkdf2_key(Prf::Sha256, password.as_bytes(), salt.as_bytes(), PBKDF2_ITERATIONS))
    })
    .await
    .map_err(|e| Error::new(ErrorKind::Internal, format!("password hashing failed: {e}")))
}

/// The pseudo-random function of a stored PBKDF2 hash (`pbkdf2_prf`; SHA-1 when absent, as
/// CouchDB reads documents written before 3.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prf {
    Sha1,
    Sha256,
}

fn pbkdf2_key(prf: Prf, password: &[u8], salt: &[u8], iterations: u32) -> Vec<u8> {
    match prf {
        Prf::Sha256 => {
            let mut key = vec![0u8; SHA256_KEY_BYTES];
            pbkdf2::pbkdf2_hmac::<sha2::Sha256>(password, salt, iterations, &mut key);
            key
        }
        Prf::Sha1 => {
            let mut key = vec![0u8; SHA1_KEY_BYTES];
            pbkdf2::pbkdf2_hmac::<sha1::Sha1>(password, salt, iterations, &mut key);
            key
        }
    }
}

/// A password hash as a user document stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoredCredentials {
    /// `password_scheme: "pbkdf2"`: `derived_key` is PBKDF2(prf, password, salt, iterations) in hex.
    Pbkdf2 { prf: Prf, iterations: u64, salt: String, derived_key: String },
    /// `password_scheme: "simple"` (or none, with `password_sha`): `password_sha` is the hex
    /// SHA-1 of the password followed by the salt. CouchDB 3.4.3 still checks it at login.
    Simple { salt: String, password_sha: String },
}

/// Why a stored hash cannot be checked: the login fails as a wrong password would.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unusable {
    /// The document carries no password hash CouchDB would read.
    NoHash,
    /// More iterations than [`MAX_LOGIN_ITERATIONS`].
    TooManyIterations(u64),
}

impl StoredCredentials {
    /// The hash of a user document's body, as CouchDB's login reads it.
    pub fn of(body: &Map<String, Value>) -> std::result::Result<Self, Unusable> {
        let text = |name: &str| body.get(name).and_then(Value::as_str).map(str::to_owned);
        let scheme = text("password_scheme").unwrap_or_else(|| "simple".to_owned());
        match scheme.as_str() {
            "pbkdf2" => {
                let prf = match text("pbkdf2_prf").as_deref() {
                    None | Some("sha") => Prf::Sha1,
                    Some("sha256") => Prf::Sha256,
                    Some(_) => return Err(Unusable::NoHash),
                };
                let iterations = body.get("iterations").and_then(Value::as_u64).ok_or(Unusable::NoHash)?;
                if iterations > MAX_LOGIN_ITERATIONS {
                    return Err(Unusable::TooManyIterations(iterations));
                }
                let (Some(salt), Some(derived_key)) = (text("salt"), text("derived_key")) else {
                    return Err(Unusable::NoHash);
                };
                Ok(StoredCredentials::Pbkdf2 { prf, iterations, salt, derived_key })
            }
            "simple" => match (text("salt"), text("password_sha")) {
                (Some(salt), Some(password_sha)) => Ok(StoredCredentials::Simple { salt, password_sha }),
                _ => Err(Unusable::NoHash),
            },
            _ => Err(Unusable::NoHash),
        }
    }

    /// The salt a session cookie of this user is bound to (CouchDB's `AuthSession` HMAC takes
    /// the user's salt): a new password gets a new salt, so the old cookies stop working.
    pub fn salt(&self) -> &str {
        match self {
            StoredCredentials::Pbkdf2 { salt, .. } | StoredCredentials::Simple { salt, .. } => salt,
        }
    }

    /// Whether `password` is the one hashed (constant-time comparison). CPU-bound: run it off
    /// the runtime.
    pub fn matches(&self, password: &str) -> bool {
        use sha1::Digest;
        let (computed, expected) = match self {
            StoredCredentials::Pbkdf2 { prf, iterations, salt, derived_key } => {
                let Ok(iterations) = u32::try_from(*iterations) else { return false };
                (hex::encode(pbkdf2_key(*prf, password.as_bytes(), salt.as_bytes(), iterations)), derived_key)
            }
            StoredCredentials::Simple { salt, password_sha } => {
                let mut sha = sha1::Sha1::new();
                sha.update(password.as_bytes());
                sha.update(salt.as_bytes());
                (hex::encode(sha.finalize()), password_sha)
            }
        };
        constant_time_eq(computed.as_bytes(), expected.to_ascii_lowercase().as_bytes())
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Why a user document is refused: CouchDB's reason.
type Reason = std::borrow::Cow<'static, str>;

/// The rules of CouchDB's `_design/_auth` validation function, as a write guard of the `_users`
/// database, with its messages (403 `forbidden`).
pub struct UsersRules;

#[async_trait]
impl WriteGuard for UsersRules {
    async fn applies(&self, _db: &Database) -> Result<bool> {
        Ok(true)
    }

    async fn check(&self, db: &Database, writes: &[ProposedWrite]) -> Result<Vec<Option<Error>>> {
        let writer = super::validation::current_writer();
        let security = db.settings().await?.security;
        let admin = is_server_or_database_admin(writer.name.as_deref(), &writer.roles, &security);
        Ok(writes
            .iter()
            .map(|write| {
                check_user_doc(&write.new_doc, write.old_doc.as_ref(), writer.name.as_deref(), &writer.roles, admin)
                    .err()
                    .map(|reason| Error::new(ErrorKind::Forbidden, reason))
            })
            .collect())
    }

    fn design_changed(&self, _db: &Database) {}
}

/// A server admin, or a database admin of `security` by name or role.
fn is_server_or_database_admin(name: Option<&str>, roles: &[String], security: &Value) -> bool {
    let admins = &security["admins"];
    let listed = |field: &str, wanted: &str| {
        admins[field].as_array().is_some_and(|list| list.iter().any(|entry| entry.as_str() == Some(wanted)))
    };
    roles.iter().any(|role| role == "_admin" || listed("roles", role)) || name.is_some_and(|name| listed("names", name))
}

/// The validation of one proposed user document: `Err` with CouchDB's reason.
fn check_user_doc(
    new_doc: &Value,
    old_doc: Option<&Value>,
    writer: Option<&str>,
    writer_roles: &[String],
    admin: bool,
) -> std::result::Result<(), Reason> {
    if new_doc["_deleted"] == Value::Bool(true) {
        let own = old_doc.is_some_and(|old| old["name"].as_str().is_some() && old["name"].as_str() == writer);
        return if writer_roles.iter().any(|role| role == "_admin") || own {
            Ok(())
        } else {
            Err(Reason::from("Only admins may delete other user docs."))
        };
    }
    if new_doc["type"].as_str() != Some("user") {
        return Err(Reason::from("doc.type must be user"));
    }
    let name = match &new_doc["name"] {
        Value::String(name) if !name.is_empty() => name.as_str(),
        _ => return Err(Reason::from("doc.name is required")),
    };
    let roles = match &new_doc["roles"] {
        Value::Null => return Err(Reason::from("doc.roles must exist")),
        Value::Array(roles) => roles,
        _ => return Err(Reason::from("doc.roles must be an array")),
    };
    if roles.iter().any(|role| !role.is_string()) {
        return Err(Reason::from("doc.roles can only contain strings"));
    }
    if new_doc["_id"].as_str() != Some(&format!("{USER_ID_PREFIX}{name}")) {
        return Err(Reason::from("Doc ID must be of the form org.couchdb.user:name"));
    }
    if old_doc.is_some_and(|old| old["name"].as_str() != Some(name)) {
        return Err(Reason::from("Usernames can not be changed."));
    }
    check_hash_fields(new_doc)?;
    if !admin {
        check_own_roles(new_doc, old_doc, roles, writer, name)?;
    }
    let role_texts = roles.iter().filter_map(Value::as_str);
    if role_texts.clone().any(|role| role != "_metrics" && role.starts_with('_')) {
        return Err(Reason::from("No system roles (starting with underscore) in users db."));
    }
    if name.starts_with('_') {
        return Err(Reason::from("Username may not start with underscore."));
    }
    if name.contains(':') {
        return Err(Reason::from("Character `:` is not allowed in usernames."));
    }
    Ok(())
}

/// The stored hash fields' shape.
fn check_hash_fields(new_doc: &Value) -> std::result::Result<(), Reason> {
    let truthy = |value: &Value| !matches!(value, Value::Null | Value::Bool(false)) && value != "" && value != 0;
    if truthy(&new_doc["password_sha"]) && !truthy(&new_doc["salt"]) {
        return Err(Reason::from(
            "Users with password_sha must have a salt.See /_utils/script/couch.js for example code.",
        ));
    }
    match &new_doc["password_scheme"] {
        scheme if !truthy(scheme) => Ok(()),
        Value::String(scheme) if scheme == "simple" => Ok(()),
        Value::String(scheme) if scheme == "pbkdf2" => {
            if !new_doc["iterations"].is_number() {
                Err(Reason::from("iterations must be a number."))
            } else if !new_doc["derived_key"].is_string() {
                Err(Reason::from("derived_key must be a string."))
            } else {
                Ok(())
            }
        }
        other => Err(Reason::from(format!(
            "Password scheme `{}` not supported.",
            other.as_str().map_or_else(|| other.to_string(), str::to_owned)
        ))),
    }
}

/// A non-admin edits only its own document and never its roles; it creates one without roles.
fn check_own_roles(
    new_doc: &Value,
    old_doc: Option<&Value>,
    roles: &[Value],
    writer: Option<&str>,
    name: &str,
) -> std::result::Result<(), Reason> {
    let Some(old_doc) = old_doc else {
        return if roles.is_empty() { Ok(()) } else { Err(Reason::from("Only _admin may set roles")) };
    };
    if writer != Some(name) {
        return Err(Reason::from("You may only update your own user document."));
    }
    let sorted = |roles: Option<&Vec<Value>>| {
        let mut texts: Vec<String> = roles.into_iter().flatten().map(Value::to_string).collect();
        texts.sort();
        texts
    };
    if sorted(old_doc["roles"].as_array()) != sorted(new_doc["roles"].as_array()) {
        return Err(Reason::from("Only _admin may edit roles"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A user document the real CouchDB 3.4.3 wrote (`PUT /_users/org.couchdb.user:u37bob` with
    /// `"password": "secret37"`), as `GET` answered it.
    fn couchdb_written() -> Map<String, Value> {
        let text = include_str!("../../fixtures/couchdb-3.4.3/055-users-doc-hashed-by-couchdb.json");
        let fixture: Value = serde_json::from_str(text).unwrap();
        fixture["response"]["body"].as_object().unwrap().clone()
    }

    #[test]
    fn a_hash_made_by_couchdb_checks_its_password_only() {
        let stored = StoredCredentials::of(&couchdb_written()).unwrap();
        assert!(matches!(stored, StoredCredentials::Pbkdf2 { prf: Prf::Sha256, iterations: 600_000, .. }));
        assert!(stored.matches("secret37"));
        assert!(!stored.matches("secret38"));
    }

    #[tokio::test]
    async fn a_password_is_hashed_as_couchdb_hashes_it() {
        let body = json!({ "name": "u", "type": "user", "roles": [], "password": "secret37", "salt": "x" });
        let write = Write::Edit { parent: None, deleted: false, body: body.as_object().unwrap().clone() };
        let hashed = hash_passwords(&[write]).await.unwrap().unwrap();
        let Write::Edit { body, .. } = &hashed[0] else { panic!("an edit") };
        let names: Vec<&str> = body.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            ["password_scheme", "pbkdf2_prf", "salt", "iterations", "derived_key", "name", "type", "roles"],
            "CouchDB's fields, in its order, and no password"
        );
        assert_eq!(body["salt"].as_str().unwrap().len(), 32);
        assert_ne!(body["salt"], "x", "a new salt unless preserve_salt");
        assert_eq!(body["derived_key"].as_str().unwrap().len(), 64);
        assert!(StoredCredentials::of(body).unwrap().matches("secret37"));
    }

    #[test]
    fn the_same_key_as_couchdb_for_its_salt() {
        let stored = couchdb_written();
        let key = pbkdf2_key(Prf::Sha256, b"secret37", stored["salt"].as_str().unwrap().as_bytes(), 600_000);
        assert_eq!(hex::encode(key), stored["derived_key"].as_str().unwrap());
    }

    #[test]
    fn too_many_iterations_is_unusable_and_sha1_and_simple_are_read() {
        let mut body = couchdb_written();
        body.insert("iterations".into(), json!(1_000_000_000u64));
        assert_eq!(StoredCredentials::of(&body), Err(Unusable::TooManyIterations(1_000_000_000)));
        // SHA-1 PBKDF2 (CouchDB before 3.4), 10 iterations: computed by Python's hashlib.
        let sha1 = json!({ "password_scheme": "pbkdf2", "iterations": 10, "salt": "abc",
            "derived_key": hex::encode(pbkdf2_key(Prf::Sha1, b"pw", b"abc", 10)) });
        assert!(StoredCredentials::of(sha1.as_object().unwrap()).unwrap().matches("pw"));
        let simple = json!({ "salt": "s", "password_sha": "e5a9fb1e1d6a1b8e4ad0f3ac6a3bd8b1f0ab0e7e" });
        assert!(matches!(StoredCredentials::of(simple.as_object().unwrap()), Ok(StoredCredentials::Simple { .. })));
    }

    fn reason(new: &Value, old: Option<&Value>, writer: Option<&str>, roles: &[String], admin: bool) -> Option<String> {
        check_user_doc(new, old, writer, roles, admin).err().map(|reason| reason.into_owned())
    }

    #[test]
    fn the_auth_rules_answer_couchdbs_reasons() {
        let doc = |extra: Value| {
            let mut doc = json!({ "_id": "org.couchdb.user:bob", "name": "bob", "type": "user", "roles": [] });
            doc.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            doc
        };
        let roles = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        assert_eq!(reason(&doc(json!({})), None, None, &[], false), None);
        assert_eq!(
            reason(&doc(json!({"roles": ["x"]})), None, None, &[], false),
            Some("Only _admin may set roles".to_owned())
        );
        let old = doc(json!({}));
        assert_eq!(
            reason(&doc(json!({"roles": ["x"]})), Some(&old), Some("bob"), &roles(&[]), false),
            Some("Only _admin may edit roles".to_owned())
        );
        assert_eq!(
            reason(&doc(json!({})), Some(&old), Some("carol"), &[], false),
            Some("You may only update your own user document.".to_owned())
        );
        assert_eq!(reason(&doc(json!({"roles": ["x"]})), Some(&old), None, &roles(&["_admin"]), true), None);
        assert_eq!(reason(&doc(json!({"type": "x"})), None, None, &[], true), Some("doc.type must be user".to_owned()));
        assert_eq!(
            reason(&doc(json!({"_id": "org.couchdb.user:x"})), None, None, &[], true),
            Some("Doc ID must be of the form org.couchdb.user:name".to_owned())
        );
        assert_eq!(
            reason(&doc(json!({"roles": ["_admin"]})), None, None, &[], true),
            Some("No system roles (starting with underscore) in users db.".to_owned())
        );
    }
}
