//! Composite document IDs: `{user_id}:{namespace}:{base64url(key)}`.
//!
//! The key is encoded with URL-safe base64 *with* `=` padding (what Python's
//! `base64.urlsafe_b64encode` produces), so the IDs we write are byte-for-byte the IDs the existing
//! system writes. Parsing relies on two facts: a user id never contains `:` (validation refuses
//! it) and the base64url alphabet has no `:`, so the first `:` ends the user id and the last `:`
//! starts the key, whatever colons the namespace holds.

use base64::engine::general_purpose::URL_SAFE;
use base64::Engine as _;

use crate::error::{Error, ErrorKind, Result};
use crate::model::validate::Limits;

/// A validated composite ID together with the parts it was built from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DocumentId {
    id: String,
    user_id: String,
    namespace: String,
    key: String,
}

impl DocumentId {
    /// Validates the three parts and builds the ID.
    pub fn new(user_id: &str, namespace: &str, key: &str, limits: &Limits) -> Result<Self> {
        limits.check_user_id(user_id)?;
        limits.check_namespace(namespace)?;
        limits.check_key(key)?;
        // Written into one string of its size, not through `format!` (every data-store write
        // makes its id again to compare it with the one named; issue 38).
        let encoded = encode_key(key);
        let mut id = String::with_capacity(user_id.len() + namespace.len() + encoded.len() + 2);
        for part in [user_id, ":", namespace, ":", &encoded] {
            id.push_str(part);
        }
        Ok(DocumentId { id, user_id: user_id.to_owned(), namespace: namespace.to_owned(), key: key.to_owned() })
    }

    /// Splits a stored `_id` back into its parts. Accepts IDs written by other systems as long as
    /// they follow the scheme; the key part must be valid base64url of UTF-8 text.
    pub fn parse(id: &str) -> Result<Self> {
        let corrupt = |why: &str| Error::new(ErrorKind::Corrupt, format!("document id {id:?} {why}"));
        let (user_id, rest) = id.split_once(':').ok_or_else(|| corrupt("has no ':' separators"))?;
        let (namespace, key_b64) = rest.rsplit_once(':').ok_or_else(|| corrupt("has no namespace part"))?;
        if user_id.is_empty() || namespace.is_empty() || key_b64.is_empty() {
            return Err(corrupt("has an empty user, namespace or key part"));
        }
        let key = decode_key(key_b64).ok_or_else(|| corrupt("has a key part that is not base64url of UTF-8 text"))?;
        Ok(DocumentId { id: id.to_owned(), user_id: user_id.to_owned(), namespace: namespace.to_owned(), key })
    }

    pub fn as_str(&self) -> &str {
        &self.id
    }

    pub fn user_id(&self) -> &str {
        &self.user_id
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    pub fn key(&self) -> &str {
        &self.key
    }
}

impl std::fmt::Display for DocumentId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.id)
    }
}

/// URL-safe base64 with padding of the key's UTF-8 bytes.
pub fn encode_key(key: &str) -> String {
    URL_SAFE.encode(key.as_bytes())
}

/// The inverse of [`encode_key`]. Unpadded input is accepted too, since other writers may strip
/// the padding; anything that is not base64url of UTF-8 gives `None`.
pub fn decode_key(encoded: &str) -> Option<String> {
    let trimmed = encoded.trim_end_matches('=');
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(trimmed).ok()?;
    String::from_utf8(bytes).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(user: &str, ns: &str, key: &str) -> String {
        DocumentId::new(user, ns, key, &Limits::default()).unwrap().as_str().to_owned()
    }

    #[test]
    fn spec_examples_produce_their_ids() {
        // The example documents of data-store-schema.current.txt.
        assert_eq!(id("user_123", "default", "greeting"), "user_123:default:Z3JlZXRpbmc=");
        assert_eq!(id("user_123", "files:my-repo", "src/main.py"), "user_123:files:my-repo:c3JjL21haW4ucHk=");
        assert_eq!(id("user_123", "cache:github", "repos"), "user_123:cache:github:cmVwb3M=");
        assert_eq!(id("user_123", "default", "my-key"), "user_123:default:bXkta2V5");
        assert_eq!(
            id("user_google_123456789", "files:my-repo", "src/main.py"),
            "user_google_123456789:files:my-repo:c3JjL21haW4ucHk="
        );
    }

    #[test]
    fn encoding_is_url_safe_with_padding() {
        // 0xfb 0xff encodes to "+/8=" in standard base64; URL-safe must give "-_8=".
        let key = String::from_utf8(vec![0xef, 0xbf, 0xbf]).unwrap(); // U+FFFF
        assert_eq!(encode_key(&key), "77-_");
        assert_eq!(encode_key("a"), "YQ==");
        assert_eq!(encode_key("ab"), "YWI=");
        assert!(!encode_key("ü?>/~").contains(['+', '/']));
    }

    #[test]
    fn parse_round_trips_and_handles_colons_in_namespace() {
        for (user, ns, key) in [
            ("u", "default", "k"),
            ("user_123", "files:my-repo", "src/main.py"),
            ("u", "a:b:c:", "key:with:colons"),
            ("u", ":", "日本語 🚀"),
        ] {
            let built = DocumentId::new(user, ns, key, &Limits::default()).unwrap();
            let parsed = DocumentId::parse(built.as_str()).unwrap();
            assert_eq!(parsed, built);
        }
    }

    #[test]
    fn parse_accepts_unpadded_keys_and_rejects_garbage() {
        assert_eq!(DocumentId::parse("u:ns:YQ").unwrap().key(), "a");
        assert_eq!(DocumentId::parse("u:ns:YQ==").unwrap().key(), "a");
        for bad in ["nocolon", "u:only", "u::YQ==", ":ns:YQ==", "u:ns:", "u:ns:!!!", "u:ns:_w=="] {
            let err = DocumentId::parse(bad).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Corrupt, "{bad}");
        }
    }

    #[test]
    fn distinct_inputs_never_share_an_id() {
        // The collision the ':' rule in user ids prevents: ("a:b", "c") vs ("a", "b:c").
        assert!(DocumentId::new("a:b", "c", "k", &Limits::default()).is_err());
        assert_eq!(id("a", "b:c", "k"), "a:b:c:aw==");
    }
}
