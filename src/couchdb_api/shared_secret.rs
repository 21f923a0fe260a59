//! The session secret kept in the backend, so every instance over one backend accepts the
//! others' cookies and sealed feed positions ([`super::session`], [`super::position_seal`]).
//!
//! Used when `couchdb_session_secret` is unset (a configured one wins): at startup the secret is
//! read from a local document of the data-store database under a reserved name
//! ([`SESSION_SECRET_LOCAL_NAME`], `:db:…`, which is never listed or served to a client). The
//! first instance to find none creates it (32 random bytes, hex) with `MustNotExist`; one that
//! loses that race reads the winner's.

use serde_json::{Map, Value};

use crate::backend::{DocumentBackend, Precondition};
use crate::error::{Error, ErrorKind, Result};

/// The backend local document holding the shared secret (reserved: `:db:` is the engine's).
pub const SESSION_SECRET_LOCAL_NAME: &str = ":db:session-secret";
/// The field of that document holding the secret, in hex.
const CURRENT_FIELD: &str = "current";
/// Bytes of a secret this server draws.
const SECRET_BYTES: usize = 32;
/// Reads and creates tried before giving up: a creation races only with another's, so the second
/// read finds the winner's unless the document is deleted in between.
const LOAD_TRIES: usize = 3;

/// The secret stored in `backend`, created there first if there is none.
pub async fn load_or_create(backend: &dyn DocumentBackend) -> Result<Vec<u8>> {
    for _ in 0..LOAD_TRIES {
        if let Some(stored) = backend.get_local(SESSION_SECRET_LOCAL_NAME).await? {
            return parse_secret(&stored.body);
        }
        let secret = random_secret()?;
        let mut body = Map::new();
        body.insert(CURRENT_FIELD.into(), Value::from(hex::encode(&secret)));
        match backend.put_local(SESSION_SECRET_LOCAL_NAME, &body, Precondition::MustNotExist).await {
            Ok(_) => return Ok(secret),
            // Another instance created it first: theirs is read on the next round.
            Err(err) if err.is_conflict() => continue,
            Err(err) => return Err(err),
        }
    }
    Err(Error::conflict("the shared session secret kept being replaced while it was read; try again"))
}

/// The secret a stored document holds.
fn parse_secret(body: &Map<String, Value>) -> Result<Vec<u8>> {
    body.get(CURRENT_FIELD)
        .and_then(Value::as_str)
        .and_then(|text| hex::decode(text).ok())
        .filter(|secret| !secret.is_empty())
        .ok_or_else(|| {
            Error::new(
                ErrorKind::Internal,
                format!("the backend's local document {SESSION_SECRET_LOCAL_NAME:?} holds no hex `{CURRENT_FIELD}`"),
            )
        })
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
        assert_eq!(first.len(), SECRET_BYTES);
        assert_eq!(load_or_create(&backend).await.unwrap(), first);
        assert!(crate::database::layout::reserved_local_name(SESSION_SECRET_LOCAL_NAME));
    }
}
