//! Sealed feed positions for per-user logins on the data-store database.
//!
//! The store's positions (`update_seq`, `last_seq`, each `_changes` row's `seq`) are its own
//! ordered tokens, shared by every user: two of them compared tell a per-user login that another
//! user wrote in between. Such a login is shown each position sealed instead: encrypted and
//! authenticated (AES-256-GCM, from `ring`, already built for rustls) under a key of its own made
//! from a fresh random salt, bound to the login's user, padded to a fixed length, as base64url. Two seals of one position
//! differ and none can be ordered. A `since` such a login sends is unsealed; one that does not
//! unseal (another key or user, altered, a plain position) is read as `0`, so its feed starts
//! over, which replication survives (it compares revisions) at the cost of re-reading.
//!
//! The key is derived with HKDF-SHA256 from the session secret ([`super::session::SessionKey`]):
//! instances sharing the secret (`couchdb_session_secret`, or when unset the one kept in the
//! backend, [`super::shared_secret`]) share tokens. Seal and unseal happen only where answers are built and
//! parameters read; inside, positions stay the store's.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::hkdf::{Prk, Salt, HKDF_SHA256};

use super::access::Principal;
use crate::database::data_store_rules::Confinement;
use crate::error::{Error, ErrorKind, Result};
use crate::feed::SINCE_NOW;

/// Random bytes opening each token, from which the token's own key is derived. Each token gets a
/// key of its own (and the all-zero nonce), so the number of tokens a key seals is not bounded
/// by AES-GCM's limit on random 96-bit nonces: 128 random bits make a repeat negligible.
const TOKEN_SALT_BYTES: usize = 16;
/// AES-GCM's tag, closing each token.
const TAG_BYTES: usize = 16;
/// A position is padded (with NUL bytes, which no position holds) to a multiple of this before
/// it is sealed, so a token's length does not tell how far the store has gone (the embedded
/// store's positions are counters, which grow a digit now and then); every backend's positions
/// fit in one block.
const PAD_BLOCK_BYTES: usize = 64;
/// What the HKDF extraction is salted with, naming this use of the session secret.
const EXTRACT_SALT: &[u8] = b"agentstore couchdb feed positions";

/// The key feed positions are sealed under.
#[derive(Clone)]
pub struct PositionSeal {
    root: Prk,
    /// The root of the secret before the last rotation, whose tokens still unseal.
    previous: Option<Prk>,
}

impl std::fmt::Debug for PositionSeal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PositionSeal").finish_non_exhaustive()
    }
}

impl PositionSeal {
    /// The seal derived from the session secret.
    pub fn from_secret(secret: &[u8]) -> Self {
        PositionSeal::from_secrets(secret, None)
    }

    /// The seal derived from the current secret, which also unseals tokens of `previous`.
    pub fn from_secrets(current: &[u8], previous: Option<&[u8]>) -> Self {
        let extract = |secret: &[u8]| Salt::new(HKDF_SHA256, EXTRACT_SALT).extract(secret);
        PositionSeal { root: extract(current), previous: previous.map(extract) }
    }

    /// `position` as `principal` is shown it: sealed for a per-user login, as it is otherwise.
    pub fn shown(&self, principal: &Principal, position: &str) -> Result<String> {
        self.shown_to(&principal.confinement(), position)
    }

    /// `position` as a login confined to `confinement` is shown it: sealed for a per-user
    /// login, as it is for one that sees everything.
    pub fn shown_to(&self, confinement: &Confinement, position: &str) -> Result<String> {
        match confinement.only_user() {
            Some(user) => self.seal(user, position),
            None => Ok(position.to_owned()),
        }
    }

    /// The `since` a request gave, as the store reads it. For a per-user login the literal forms
    /// (empty, `0`, `now`) stand; a token is unsealed, and one that does not unseal is `0`.
    pub fn given(&self, principal: &Principal, since: Option<String>) -> Option<String> {
        self.given_by(&principal.confinement(), since)
    }

    /// [`PositionSeal::given`] for a login confined to `confinement`.
    pub fn given_by(&self, confinement: &Confinement, since: Option<String>) -> Option<String> {
        let Some(user) = confinement.only_user() else { return since };
        match since.as_deref() {
            None | Some("") | Some("0") | Some(SINCE_NOW) => since,
            Some(token) => Some(self.unseal(user, token).unwrap_or_else(|| "0".to_owned())),
        }
    }

    /// The position encrypted for `user`: salt, ciphertext and tag, base64url.
    fn seal(&self, user: &str, position: &str) -> Result<String> {
        let mut salt = [0u8; TOKEN_SALT_BYTES];
        getrandom::fill(&mut salt)
            .map_err(|e| Error::new(ErrorKind::Internal, format!("no random salt for a feed position: {e}")))?;
        let key = self.token_key(&salt).ok_or_else(|| Error::new(ErrorKind::Internal, "feed position key"))?;
        let mut body = position.as_bytes().to_vec();
        body.resize(position.len().div_ceil(PAD_BLOCK_BYTES).max(1) * PAD_BLOCK_BYTES, 0);
        key.seal_in_place_append_tag(zero_nonce(), Aad::from(user.as_bytes()), &mut body)
            .map_err(|_| Error::new(ErrorKind::Internal, "a feed position could not be sealed"))?;
        Ok(URL_SAFE_NO_PAD.encode([salt.as_slice(), &body].concat()))
    }

    /// The position a token of `user` holds, sealed under the current secret or the previous
    /// one; `None` when it is not one.
    fn unseal(&self, user: &str, token: &str) -> Option<String> {
        let bytes = URL_SAFE_NO_PAD.decode(token).ok()?;
        if bytes.len() < TOKEN_SALT_BYTES + TAG_BYTES {
            return None;
        }
        std::iter::once(&self.root).chain(&self.previous).find_map(|root| unseal_under(root, user, &bytes))
    }

    /// The key of the token opening with `salt`.
    fn token_key(&self, salt: &[u8]) -> Option<LessSafeKey> {
        token_key_under(&self.root, salt)
    }
}

/// The position a token's `bytes` hold when sealed for `user` under `root`.
fn unseal_under(root: &Prk, user: &str, bytes: &[u8]) -> Option<String> {
    let (salt, body) = bytes.split_at(TOKEN_SALT_BYTES);
    let key = token_key_under(root, salt)?;
    let mut body = body.to_vec();
    let position = key.open_in_place(zero_nonce(), Aad::from(user.as_bytes()), &mut body).ok()?;
    let unpadded = position.iter().rposition(|&byte| byte != 0).map_or(0, |last| last + 1);
    String::from_utf8(position[..unpadded].to_vec()).ok()
}

/// The key under `root` of the token opening with `salt`.
fn token_key_under(root: &Prk, salt: &[u8]) -> Option<LessSafeKey> {
    let info = [salt];
    let material = root.expand(&info, &AES_256_GCM).ok()?;
    Some(LessSafeKey::new(UnboundKey::from(material)))
}

/// Each token's key seals once, so its nonce may be fixed.
fn zero_nonce() -> Nonce {
    Nonce::assume_unique_for_key([0u8; NONCE_LEN])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alice() -> Principal {
        Principal::User("alice".into())
    }

    #[test]
    fn a_sealed_position_unseals_and_two_seals_differ() {
        let seal = PositionSeal::from_secret(&[3; 32]);
        let first = seal.shown(&alice(), "17-abc").unwrap();
        let second = seal.shown(&alice(), "17-abc").unwrap();
        assert_ne!(first, second);
        assert!(!first.contains("17-abc"));
        // Positions of different lengths make tokens of one length.
        assert_eq!(seal.shown(&alice(), "9").unwrap().len(), seal.shown(&alice(), "1000000").unwrap().len());
        assert_eq!(seal.given(&alice(), Some(first)).as_deref(), Some("17-abc"));
        // Instances sharing the secret share tokens.
        let shared = PositionSeal::from_secret(&[3; 32]);
        assert_eq!(shared.given(&alice(), Some(second.clone())).as_deref(), Some("17-abc"));
        // After a rotation, tokens sealed under the previous secret still unseal.
        let rotated = PositionSeal::from_secrets(&[5; 32], Some(&[3; 32]));
        assert_eq!(rotated.given(&alice(), Some(second)).as_deref(), Some("17-abc"));
    }

    #[test]
    fn a_token_that_does_not_unseal_is_the_start_of_the_feed() {
        let seal = PositionSeal::from_secret(&[3; 32]);
        let token = seal.shown(&alice(), "17-abc").unwrap();
        let bob = Principal::User("bob".into());
        assert_eq!(seal.given(&bob, Some(token.clone())).as_deref(), Some("0"));
        assert_eq!(PositionSeal::from_secret(&[4; 32]).given(&alice(), Some(token.clone())).as_deref(), Some("0"));
        let mut altered = token.into_bytes();
        altered[20] = if altered[20] == b'A' { b'B' } else { b'A' };
        let altered = String::from_utf8(altered).unwrap();
        assert_eq!(seal.given(&alice(), Some(altered)).as_deref(), Some("0"));
        for garbage in ["17-abc", "!!", "AAAA", "%"] {
            assert_eq!(seal.given(&alice(), Some(garbage.into())).as_deref(), Some("0"), "{garbage}");
        }
    }

    #[test]
    fn literal_forms_and_admins_pass_through() {
        let seal = PositionSeal::from_secret(&[3; 32]);
        for literal in ["", "0", "now"] {
            assert_eq!(seal.given(&alice(), Some(literal.into())).as_deref(), Some(literal));
        }
        assert_eq!(seal.given(&alice(), None), None);
        assert_eq!(seal.given(&Principal::Admin, Some("17-abc".into())).as_deref(), Some("17-abc"));
        assert_eq!(seal.shown(&Principal::Admin, "17-abc").unwrap(), "17-abc");
    }
}
