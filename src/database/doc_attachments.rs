//! `_attachments` in the documents of a database besides the data-store one: what a leaf's body
//! keeps for each attachment, how a client's attachments become that (inline `data` stored,
//! `follows` parts taken from a multipart body, `stub`s carried from the parent revision), and how
//! a leaf's attachments are shown (stubs, or inline `data`).
//!
//! ## What a leaf keeps
//! Each attachment of a leaf's body is a stub as CouchDB shows it, `{content_type, revpos,
//! digest, length, stub: true}`, plus [`SHA256_FIELD`]: the SHA-256 that addresses its bytes in
//! the database's [`AttachmentStore`]. That field is this server's own: it is taken out of every
//! attachment a client sends (a client cannot point a document at bytes by naming their hash)
//! and out of every answer ([`shown_stub`]).
//!
//! ## A write
//! 1. [`prepare`] (before the write, async): every attachment with `data` (base64) or `follows`
//!    has its bytes stored and becomes a stub marked [`NEW_FIELD`]; a `stub: true` stays as the
//!    client sent it.
//! 2. [`resolve`] (inside the engine's write, against the revision tree it read): a new
//!    attachment gets `revpos`, the generation of the revision being written (1 for the
//!    re-creation of a deleted document, as in CouchDB; a replicated one keeps the `revpos` it
//!    came with); a client's stub is replaced by the parent leaf's
//!    attachment of that name (412 `missing_stub` when it has none, or one of another digest).
//!
//! Attachments a write does not name are not in the new revision, as in CouchDB.

use std::collections::{HashMap, HashSet};

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use bytes::Bytes;
use serde_json::{Map, Value};

use super::attachments::{AttachmentStore, StoredBlob};
use crate::error::{Error, ErrorKind, Result};

/// The field of a kept attachment naming its bytes' SHA-256. Not CouchDB's, never shown, and
/// taken out of what clients send.
pub const SHA256_FIELD: &str = "agentstore_sha256";
/// Marks an attachment whose bytes this write stored: [`resolve`] gives it its `revpos`.
const NEW_FIELD: &str = "agentstore_new";
/// The `_attachments` member of a body.
pub const ATTACHMENTS: &str = "_attachments";
/// CouchDB's content type for an attachment sent without one.
pub const DEFAULT_CONTENT_TYPE: &str = "application/octet-stream";

/// A client's stub names an attachment the parent revision does not have: CouchDB's 412
/// `missing_stub`, carried as the source of the write's error.
#[derive(Debug)]
pub struct MissingStub {
    pub reason: String,
}

impl std::fmt::Display for MissingStub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

impl std::error::Error for MissingStub {}

/// An attachment past `couchdb_max_attachment_bytes`: CouchDB's 413 `attachment_too_large`
/// naming it, carried as the source of the error.
#[derive(Debug)]
pub struct AttachmentTooLarge {
    pub name: String,
}

impl std::fmt::Display for AttachmentTooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "attachment {} is larger than couchdb_max_attachment_bytes", self.name)
    }
}

impl std::error::Error for AttachmentTooLarge {}

/// The error of a write whose stub names nothing the parent has.
pub fn missing_stub(id: &str, name: &str) -> Error {
    let reason = format!("Invalid attachment stub in {id} for {name}");
    Error::new(ErrorKind::InvalidInput, reason.clone()).with_source(MissingStub { reason })
}

/// The error of an attachment past the bound.
pub fn too_large(name: &str) -> Error {
    Error::new(ErrorKind::TooLarge, format!("attachment {name} is larger than couchdb_max_attachment_bytes"))
        .with_source(AttachmentTooLarge { name: name.to_owned() })
}

/// Whether a body has attachments.
pub fn has_attachments(body: &Map<String, Value>) -> bool {
    body.get(ATTACHMENTS).and_then(Value::as_object).is_some_and(|atts| !atts.is_empty())
}

/// Stores the bytes of a client's attachments (`data`, or `follows` with `followed` holding the
/// part of that name, already stored by the multipart reader) and leaves each as a stub marked
/// new; `stub: true` entries stay for [`resolve`]. Every entry loses [`SHA256_FIELD`] and
/// [`NEW_FIELD`] first: only this function and [`resolve`] set them.
///
/// The hook for multipart bodies (`src/couchdb_api/multipart.rs`): store each part with
/// [`AttachmentStore::write`] as it streams, then call this with the map name → stored bytes.
pub async fn prepare(
    store: &AttachmentStore,
    max_bytes: u64,
    body: &mut Map<String, Value>,
    followed: &HashMap<String, StoredBlob>,
) -> Result<()> {
    let Some(attachments) = body.get_mut(ATTACHMENTS) else { return Ok(()) };
    let Value::Object(attachments) = attachments else {
        return Err(Error::new(ErrorKind::InvalidInput, "_attachments must be a JSON object"));
    };
    for (name, attachment) in attachments.iter_mut() {
        if name.starts_with('_') {
            return Err(Error::new(ErrorKind::InvalidInput, "Attachment name '_' prefix is reserved."));
        }
        let Value::Object(fields) = attachment else {
            return Err(Error::new(ErrorKind::InvalidInput, format!("attachment {name} must be a JSON object")));
        };
        fields.remove(SHA256_FIELD);
        fields.remove(NEW_FIELD);
        if fields.get("stub") == Some(&Value::Bool(true)) {
            continue;
        }
        let stored = if fields.get("follows") == Some(&Value::Bool(true)) {
            followed.get(name).cloned().ok_or_else(|| {
                Error::new(ErrorKind::InvalidInput, format!("attachment {name} follows, but no part of that name came"))
            })?
        } else {
            let Some(Value::String(data)) = fields.get("data") else {
                return Err(Error::new(
                    ErrorKind::InvalidInput,
                    format!("attachment {name} needs `data`, `stub: true` or `follows: true`"),
                ));
            };
            let bytes = BASE64
                .decode(data.as_bytes())
                .map_err(|_| Error::new(ErrorKind::InvalidInput, format!("Invalid attachment data for {name}")))?;
            if bytes.len() as u64 > max_bytes {
                return Err(too_large(name));
            }
            let stream = futures::stream::once(async move { Ok(Bytes::from(bytes)) });
            store.write(stream, max_bytes).await.map_err(|err| match err.kind() {
                ErrorKind::TooLarge => too_large(name),
                _ => err,
            })?
        };
        let content_type = fields.get("content_type").and_then(Value::as_str).unwrap_or(DEFAULT_CONTENT_TYPE);
        *attachment = kept_stub(content_type, fields.get("revpos").and_then(Value::as_u64), &stored, true);
    }
    Ok(())
}

/// A kept attachment: what CouchDB shows, with the SHA-256 (and the new mark while unwritten).
pub fn kept_stub(content_type: &str, revpos: Option<u64>, stored: &StoredBlob, new: bool) -> Value {
    let mut stub = Map::new();
    stub.insert("content_type".into(), Value::from(content_type));
    if let Some(revpos) = revpos {
        stub.insert("revpos".into(), Value::from(revpos));
    }
    stub.insert("digest".into(), Value::from(stored.digest.clone()));
    stub.insert("length".into(), Value::from(stored.length));
    stub.insert("stub".into(), Value::Bool(true));
    stub.insert(SHA256_FIELD.into(), Value::from(stored.sha256.clone()));
    if new {
        stub.insert(NEW_FIELD.into(), Value::Bool(true));
    }
    Value::Object(stub)
}

/// Finishes the attachments of a body about to become revision `generation` of document `id`,
/// whose parent leaf's body is `parent` ([`prepare`] ran on it): new ones get `revpos`
/// (`generation`, or for a `replicated` revision the `revpos` it came with); kept ones stay; a
/// client's stub becomes the parent's attachment of that name (the same digest when the stub
/// gives one), or the write fails with [`missing_stub`].
pub fn resolve(
    id: &str,
    body: &mut Map<String, Value>,
    parent: Option<&Map<String, Value>>,
    generation: u64,
    replicated: bool,
) -> Result<()> {
    let Some(Value::Object(attachments)) = body.get_mut(ATTACHMENTS) else { return Ok(()) };
    let parents = parent.and_then(|parent| parent.get(ATTACHMENTS)).and_then(Value::as_object);
    for (name, attachment) in attachments.iter_mut() {
        let Value::Object(fields) = attachment else { continue };
        if fields.remove(NEW_FIELD).is_some() {
            if !replicated || !fields.get("revpos").is_some_and(Value::is_u64) {
                fields.insert("revpos".into(), Value::from(generation));
            }
            continue;
        }
        if fields.contains_key(SHA256_FIELD) {
            continue;
        }
        if fields.get("stub") != Some(&Value::Bool(true)) {
            // Written before attachments were kept apart (inline data in the body): as it is.
            continue;
        }
        let wanted_digest = fields.get("digest").and_then(Value::as_str);
        let carried =
            parents.and_then(|parents| parents.get(name)).filter(|kept| kept.get(SHA256_FIELD).is_some()).filter(
                |kept| wanted_digest.is_none_or(|digest| kept.get("digest").and_then(Value::as_str) == Some(digest)),
            );
        match carried {
            Some(kept) => *attachment = kept.clone(),
            None => return Err(missing_stub(id, name)),
        }
    }
    Ok(())
}

/// The SHA-256 of every attachment a body keeps, added to `into`.
pub fn referenced(body: &Map<String, Value>, into: &mut HashSet<String>) {
    let Some(Value::Object(attachments)) = body.get(ATTACHMENTS) else { return };
    for attachment in attachments.values() {
        if let Some(sha256) = attachment.get(SHA256_FIELD).and_then(Value::as_str) {
            into.insert(sha256.to_owned());
        }
    }
}

/// A kept attachment as a leaf was read: its fields, and where its bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptAttachment {
    pub content_type: String,
    pub revpos: u64,
    pub digest: String,
    pub length: u64,
    pub sha256: String,
}

/// The attachment `name` of a body, when it is kept here (has its bytes' SHA-256).
pub fn kept(body: &Map<String, Value>, name: &str) -> Option<KeptAttachment> {
    let fields = body.get(ATTACHMENTS)?.get(name)?;
    Some(KeptAttachment {
        content_type: fields.get("content_type").and_then(Value::as_str).unwrap_or(DEFAULT_CONTENT_TYPE).to_owned(),
        revpos: fields.get("revpos").and_then(Value::as_u64).unwrap_or(0),
        digest: fields.get("digest").and_then(Value::as_str)?.to_owned(),
        length: fields.get("length").and_then(Value::as_u64)?,
        sha256: fields.get(SHA256_FIELD).and_then(Value::as_str)?.to_owned(),
    })
}

/// An attachment as CouchDB shows a stub: `content_type`, `revpos`, `digest`, `length`,
/// `stub: true` in that order, never this server's fields. One not kept here (written before
/// attachments were) is shown as it is.
pub fn shown_stub(attachment: &Value) -> Value {
    let Some(fields) = attachment.as_object() else { return attachment.clone() };
    if !fields.contains_key(SHA256_FIELD) {
        let mut shown = fields.clone();
        shown.remove(NEW_FIELD);
        return Value::Object(shown);
    }
    let mut shown = Map::new();
    for name in ["content_type", "revpos", "digest", "length"] {
        if let Some(value) = fields.get(name) {
            shown.insert(name.into(), value.clone());
        }
    }
    shown.insert("stub".into(), Value::Bool(true));
    Value::Object(shown)
}

/// An attachment with its bytes inline, as CouchDB shows one with `attachments=true`:
/// `content_type`, `revpos`, `digest`, `data` (base64), no `length`, no `stub`.
pub fn shown_inline(kept: &KeptAttachment, bytes: &[u8]) -> Value {
    let mut shown = Map::new();
    shown.insert("content_type".into(), Value::from(kept.content_type.clone()));
    shown.insert("revpos".into(), Value::from(kept.revpos));
    shown.insert("digest".into(), Value::from(kept.digest.clone()));
    shown.insert("data".into(), Value::from(BASE64.encode(bytes)));
    Value::Object(shown)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn object(value: Value) -> Map<String, Value> {
        value.as_object().cloned().unwrap_or_default()
    }

    const SHA: &str = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824";

    /// A stub is carried from the parent; one the parent lacks (by name or by digest) is
    /// CouchDB's missing_stub; new attachments get the revision's generation as `revpos`.
    #[test]
    fn stubs_are_carried_or_missing() {
        let parent = object(json!({"_attachments": {"a.txt": {
            "content_type": "text/plain", "revpos": 1, "digest": "md5-x", "length": 5, "stub": true,
            SHA256_FIELD: SHA
        }}}));
        let mut body = object(json!({"_attachments": {
            "a.txt": {"stub": true},
            "b.txt": {"content_type": "text/plain", "digest": "md5-y", "length": 1, "stub": true,
                      SHA256_FIELD: SHA, NEW_FIELD: true}
        }}));
        resolve("doc", &mut body, Some(&parent), 2, false).unwrap();
        assert_eq!(body["_attachments"]["a.txt"], parent["_attachments"]["a.txt"]);
        assert_eq!(body["_attachments"]["b.txt"]["revpos"], json!(2));
        assert!(body["_attachments"]["b.txt"].get(NEW_FIELD).is_none());

        let mut unknown = object(json!({"_attachments": {"c.txt": {"stub": true}}}));
        let err = resolve("doc", &mut unknown, Some(&parent), 2, false).unwrap_err();
        let source = std::error::Error::source(&err).and_then(|s| s.downcast_ref::<MissingStub>());
        assert_eq!(source.map(|s| s.reason.as_str()), Some("Invalid attachment stub in doc for c.txt"));
        let mut other_digest = object(json!({"_attachments": {"a.txt": {"stub": true, "digest": "md5-z"}}}));
        assert!(resolve("doc", &mut other_digest, Some(&parent), 2, false).is_err());
        let mut no_parent = object(json!({"_attachments": {"a.txt": {"stub": true}}}));
        assert!(resolve("doc", &mut no_parent, None, 1, false).is_err());
    }

    /// What clients see never holds this server's fields, in CouchDB's order.
    #[test]
    fn shown_stubs_hide_the_hash() {
        let kept = json!({"stub": true, "length": 5, SHA256_FIELD: SHA, "digest": "md5-x",
                          "content_type": "text/plain", "revpos": 3});
        let shown = shown_stub(&kept);
        assert_eq!(
            shown.to_string(),
            r#"{"content_type":"text/plain","revpos":3,"digest":"md5-x","length":5,"stub":true}"#
        );
        let mut refs = HashSet::new();
        referenced(&object(json!({"_attachments": {"a": kept}})), &mut refs);
        assert_eq!(refs, HashSet::from([SHA.to_owned()]));
    }
}
