//! Input validation and the size limits the service enforces.
//!
//! The limits keep every composite ID storable on every backend: the longest ID we can build is
//! 128 + 1 + 256 + 1 + 1024 (base64 of a 768-byte key) = 1,410 bytes, under Firestore's 1,500-byte
//! document-name limit and DynamoDB's 2,048-byte partition-key limit.

use serde_json::Value;

use crate::error::{Error, ErrorKind, Result};

/// Longest user id, in UTF-8 bytes.
pub const MAX_USER_ID_BYTES: usize = 128;
/// Longest namespace, in UTF-8 bytes.
pub const MAX_NAMESPACE_BYTES: usize = 256;
/// Longest key, in UTF-8 bytes.
pub const MAX_KEY_BYTES: usize = 768;
/// Longest agent name, in UTF-8 bytes.
pub const MAX_AGENT_BYTES: usize = 256;
/// Default maximum size of a value: 1 MiB of compact JSON, the spec's recommended maximum.
pub const DEFAULT_MAX_VALUE_BYTES: usize = 1024 * 1024;

/// The configurable limits (only the value size is configurable; the name limits are fixed
/// because the backends' ID limits are).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_value_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_value_bytes: DEFAULT_MAX_VALUE_BYTES }
    }
}

impl Limits {
    /// `user_id`: non-empty, at most 128 bytes, no `:` (it would make two users' IDs collide), no
    /// control characters, and not starting with `_` (CouchDB reserves IDs that start with `_`).
    pub fn check_user_id(&self, user_id: &str) -> Result<()> {
        check_name("user_id", user_id, MAX_USER_ID_BYTES)?;
        if user_id.contains(':') {
            return Err(Error::invalid("user_id", "must not contain ':' (it separates the parts of a document id)"));
        }
        if user_id.starts_with('_') {
            return Err(Error::invalid(
                "user_id",
                "must not start with '_' (CouchDB reserves document ids that start with '_')",
            ));
        }
        Ok(())
    }

    /// `namespace`: non-empty, at most 256 bytes, no control characters; `:` is allowed.
    pub fn check_namespace(&self, namespace: &str) -> Result<()> {
        check_name("namespace", namespace, MAX_NAMESPACE_BYTES)
    }

    /// `key`: non-empty, at most 768 bytes, any UTF-8 text.
    pub fn check_key(&self, key: &str) -> Result<()> {
        if key.is_empty() {
            return Err(Error::invalid("key", "must not be empty"));
        }
        if key.len() > MAX_KEY_BYTES {
            return Err(Error::invalid(
                "key",
                format!("is {} bytes long; the limit is {MAX_KEY_BYTES} bytes", key.len()),
            ));
        }
        Ok(())
    }

    /// Agent names are stored in `createdByAgent` / `lastAccessedByAgent`.
    pub fn check_agent(&self, agent: &str) -> Result<()> {
        check_name("agent", agent, MAX_AGENT_BYTES)
    }

    /// The value's size is its compact JSON serialisation, counted without building it.
    pub fn check_value(&self, value: &Value) -> Result<()> {
        self.check_json_size("value", json_size(value))
    }

    /// `field` (`value` or `metadata`) measured `size` bytes of compact JSON.
    pub fn check_json_size(&self, field: &str, size: usize) -> Result<()> {
        if size > self.max_value_bytes {
            return Err(Error::new(
                ErrorKind::TooLarge,
                format!("{field} is {size} bytes of JSON; the maximum is {} bytes", self.max_value_bytes),
            ));
        }
        Ok(())
    }

    /// Metadata must be a JSON object (it is merged key by key).
    pub fn check_metadata(&self, metadata: &Value) -> Result<()> {
        if !metadata.is_object() {
            return Err(Error::invalid("metadata", "must be a JSON object"));
        }
        self.check_json_size("metadata", json_size(metadata))
    }
}

fn check_name(field: &str, text: &str, max_bytes: usize) -> Result<()> {
    if text.is_empty() {
        return Err(Error::invalid(field, "must not be empty"));
    }
    if text.len() > max_bytes {
        return Err(Error::invalid(field, format!("is {} bytes long; the limit is {max_bytes} bytes", text.len())));
    }
    if let Some(c) = text.chars().find(|c| c.is_control()) {
        return Err(Error::invalid(field, format!("must not contain control characters (found U+{:04X})", c as u32)));
    }
    Ok(())
}

/// Number of bytes of the compact JSON serialisation of `value` (a `Value`, or a body `Map`),
/// counted without building it.
pub fn json_size<T: serde::Serialize + ?Sized>(value: &T) -> usize {
    struct Counter(usize);
    impl std::io::Write for Counter {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut counter = Counter(0);
    // Serialising JSON data into a sink that never fails cannot fail.
    let _ = serde_json::to_writer(&mut counter, value);
    counter.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn message(result: Result<()>) -> String {
        let err = result.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
        err.to_string()
    }

    #[test]
    fn user_id_rules() {
        let l = Limits::default();
        assert!(l.check_user_id("user_google_123456789").is_ok());
        assert!(l.check_user_id("ünï-user@example.com").is_ok());
        assert!(message(l.check_user_id("")).contains("user_id"));
        assert!(message(l.check_user_id("a:b")).contains("':'"));
        assert!(message(l.check_user_id("a\u{0}b")).contains("U+0000"));
        assert!(message(l.check_user_id("a\nb")).contains("control"));
        assert!(message(l.check_user_id("_users")).contains("'_'"));
        assert!(l.check_user_id(&"u".repeat(MAX_USER_ID_BYTES)).is_ok());
        assert!(message(l.check_user_id(&"u".repeat(MAX_USER_ID_BYTES + 1))).contains("limit"));
    }

    #[test]
    fn namespace_rules() {
        let l = Limits::default();
        assert!(l.check_namespace("files:my-repo").is_ok());
        assert!(l.check_namespace(":").is_ok());
        assert!(message(l.check_namespace("")).contains("namespace"));
        assert!(message(l.check_namespace("a\tb")).contains("control"));
        assert!(message(l.check_namespace(&"n".repeat(MAX_NAMESPACE_BYTES + 1))).contains("limit"));
    }

    #[test]
    fn key_rules() {
        let l = Limits::default();
        for key in ["src/main.py", "a:b", "?#%", " ", "\u{0}\u{1f}", "日本語 🚀"] {
            assert!(l.check_key(key).is_ok(), "{key:?}");
        }
        assert!(message(l.check_key("")).contains("key"));
        assert!(l.check_key(&"k".repeat(MAX_KEY_BYTES)).is_ok());
        assert!(message(l.check_key(&"k".repeat(MAX_KEY_BYTES + 1))).contains("768"));
    }

    #[test]
    fn value_size_is_compact_json_bytes() {
        let l = Limits { max_value_bytes: 10 };
        assert_eq!(json_size(&json!("12345678")), 10);
        assert!(l.check_value(&json!("12345678")).is_ok());
        let err = l.check_value(&json!("123456789")).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::TooLarge);
        assert!(err.to_string().contains("11 bytes"));
    }

    #[test]
    fn metadata_must_be_an_object() {
        let l = Limits::default();
        assert!(l.check_metadata(&json!({"a": 1})).is_ok());
        for bad in [json!([1]), json!("x"), json!(null), json!(3)] {
            assert!(message(l.check_metadata(&bad)).contains("metadata"));
        }
    }
}
