//! The session secret kept in the backend, so every instance over one backend accepts the
//! others' cookies and sealed feed positions ([`super::session`], [`super::position_seal`]).
//!
//! Used when `couchdb_session_secret` is unset (a configured one wins): at startup the secret is
//! read from a local document of the data-store database under a reserved name
//! ([`SESSION_SECRET_LOCAL_NAME`], `:db:…`, which is never listed or served to a client). The
//! first instance to find none creates it (32 random bytes, hex) with `MustNotExist`; one that
//! loses that race reads the winner's.

use std::sync::{Arc, Weak};
use std::time::Duration;

use serde_json::{Map, Value};

use super::auth::CouchAuth;
use crate::backend::{DocumentBackend, Precondition};
use crate::error::{Error, ErrorKind, Result};

/// The backend local document holding the shared secret (reserved: `:db:` is the engine's).
pub const SESSION_SECRET_LOCAL_NAME: &str = ":db:session-secret";
/// How often, at most, an instance re-reads the stored secrets: a rotation reaches every instance
/// within this many seconds (docs/bounds.md).
pub const SESSION_SECRET_REFRESH_SECS: u64 = 30;
/// The field of that document holding the secret, in hex.
const CURRENT_FIELD: &str = "current";
/// The field holding the secret before the last rotation, in hex; its sessions stay valid.
const PREVIOUS_FIELD: &str = "previous";
/// Bytes of a secret this server draws.
const SECRET_BYTES: usize = 32;
/// Reads and writes tried before giving up: a write races only with another instance's, so the
/// next read finds the winner's.
const WRITE_TRIES: usize = 3;

/// The secrets kept in the backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredSecrets {
    /// Signs new sessions.
    pub current: Vec<u8>,
    /// The one before the last rotation, still accepted.
    pub previous: Option<Vec<u8>>,
}

/// The secrets stored in `backend`, created there first if there are none.
pub async fn load_or_create(backend: &dyn DocumentBackend) -> Result<StoredSecrets> {
    for _ in 0..WRITE_TRIES {
        if let Some(stored) = backend.get_local(SESSION_SECRET_LOCAL_NAME).await? {
            return parse_secrets(&stored.body);
        }
        let created = StoredSecrets { current: random_secret()?, previous: None };
        match backend.put_local(SESSION_SECRET_LOCAL_NAME, &secrets_body(&created), Precondition::MustNotExist).await {
            Ok(_) => return Ok(created),
            // Another instance created it first: theirs is read on the next round.
            Err(err) if err.is_conflict() => continue,
            Err(err) => return Err(err),
        }
    }
    Err(Error::conflict("the shared session secret kept being replaced while it was read; try again"))
}

/// Draws a new current secret and keeps the one it replaces as the previous (`agentstore
/// rotate-session-secret`); the secrets now stored.
pub async fn rotate(backend: &dyn DocumentBackend) -> Result<StoredSecrets> {
    for _ in 0..WRITE_TRIES {
        let stored = backend.get_local(SESSION_SECRET_LOCAL_NAME).await?;
        let (previous, precondition) = match &stored {
            Some(doc) => (Some(parse_secrets(&doc.body)?.current), Precondition::MatchRevision(doc.rev.clone())),
            None => (None, Precondition::MustNotExist),
        };
        let rotated = StoredSecrets { current: random_secret()?, previous };
        match backend.put_local(SESSION_SECRET_LOCAL_NAME, &secrets_body(&rotated), precondition).await {
            Ok(_) => return Ok(rotated),
            Err(err) if err.is_conflict() => continue,
            Err(err) => return Err(err),
        }
    }
    Err(Error::conflict("the shared session secret kept changing while it was rotated; try again"))
}

/// Re-reads the stored secrets every [`SESSION_SECRET_REFRESH_SECS`] into `auth`, until `auth` or
/// `backend` is dropped (held weakly, so this task keeps neither open). A failed read keeps the
/// secrets in force and is logged.
pub fn keep_refreshed(auth: &Arc<CouchAuth>, backend: &Arc<dyn DocumentBackend>) {
    let auth: Weak<CouchAuth> = Arc::downgrade(auth);
    let backend: Weak<dyn DocumentBackend> = Arc::downgrade(backend);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(SESSION_SECRET_REFRESH_SECS)).await;
            let (Some(auth), Some(backend)) = (auth.upgrade(), backend.upgrade()) else { return };
            match load_or_create(backend.as_ref()).await {
                Ok(secrets) => auth.use_session_secrets(secrets.current, secrets.previous),
                Err(err) => tracing::warn!(error = %err, "could not re-read the shared session secret"),
            }
        }
    });
}

/// The stored document's body.
fn secrets_body(secrets: &StoredSecrets) -> Map<String, Value> {
    let mut body = Map::new();
    body.insert(CURRENT_FIELD.into(), Value::from(hex::encode(&secrets.current)));
    if let Some(previous) = &secrets.previous {
        body.insert(PREVIOUS_FIELD.into(), Value::from(hex::encode(previous)));
    }
    body
}

/// The secrets a stored document holds.
fn parse_secrets(body: &Map<String, Value>) -> Result<StoredSecrets> {
    let field = |name: &str| body.get(name).and_then(Value::as_str).and_then(|text| hex::decode(text).ok());
    let current = field(CURRENT_FIELD).filter(|secret| !secret.is_empty()).ok_or_else(|| {
        Error::new(
            ErrorKind::Internal,
            format!("the backend's local document {SESSION_SECRET_LOCAL_NAME:?} holds no hex `{CURRENT_FIELD}`"),
        )
    })?;
    Ok(StoredSecrets { current, previous: field(PREVIOUS_FIELD).filter(|secret| !secret.is_empty()) })
}

/// A fresh random secret.
fn random_secret() -> Result<Vec<u8>> {
    let mut secret = vec![0u8; SECRET_BYTES];
    getrandom::fill(&mut secret)
        .map_err(|e| Error::new(ErrorKind::Internal, format!("no random session secret can be made: {e}")))?;
    Ok(secret)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_first_load_creates_and_later_loads_read_it() {
        let dir = tempfile::tempdir().unwrap();
        let backend = crate::backend::embedded::EmbeddedBackend::open(&dir.path().join("s.redb")).await.unwrap();
        let first = load_or_create(&backend).await.unwrap();
        assert_eq!(first.current.len(), SECRET_BYTES);
        assert_eq!(first.previous, None);
        assert_eq!(load_or_create(&backend).await.unwrap(), first);
        assert!(crate::database::layout::reserved_local_name(SESSION_SECRET_LOCAL_NAME));
    }

    #[tokio::test]
    async fn a_rotation_keeps_the_replaced_secret_as_previous() {
        let dir = tempfile::tempdir().unwrap();
        let backend = crate::backend::embedded::EmbeddedBackend::open(&dir.path().join("s.redb")).await.unwrap();
        let first = load_or_create(&backend).await.unwrap();
        let rotated = rotate(&backend).await.unwrap();
        assert_ne!(rotated.current, first.current);
        assert_eq!(rotated.previous.as_ref(), Some(&first.current));
        assert_eq!(load_or_create(&backend).await.unwrap(), rotated);
        // A session signed before the rotation is still accepted; new ones are signed anew.
        let key = super::super::session::SessionKey::new(first.current.clone(), 600);
        let old_cookie = key.sign("alice", "hash", 100);
        key.replace_secrets(rotated.current, rotated.previous);
        let claim = super::super::session::SessionKey::parse(&old_cookie).unwrap();
        assert!(matches!(key.check(&claim, "hash", 101), super::super::session::CookieCheck::Valid { .. }));
        assert_ne!(key.sign("alice", "hash", 100), old_cookie);
        // Two rotations later it is not.
        key.replace_secrets(random_secret().unwrap(), Some(random_secret().unwrap()));
        assert_eq!(key.check(&claim, "hash", 101), super::super::session::CookieCheck::BadSignature);
    }
}
