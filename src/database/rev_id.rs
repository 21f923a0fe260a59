//! New revision ids as CouchDB 3.4 computes them: the MD5 of the edit written in Erlang's
//! external term format (`couch_doc:new_revid/1`), so the same edit of the same revision gets
//! the same id here as on a real CouchDB, on every backend and in every database.
//!
//! That matters beyond looks: two peers (or a client retrying after a lost answer) that make the
//! same edit make the same revision, so replicating one into the other adds no conflict, as
//! PouchDB and CouchDB expect.
//!
//! CouchDB hashes `term_to_binary([Deleted, OldStart, OldRev, Body, Atts], [{minor_version, 1}])`:
//! - `Deleted` the atom `true`/`false`; `OldStart` the parent's generation (0 for a first
//!   revision); `OldRev` the parent's id as a binary (its 16 bytes when it is 32 hex digits), or
//!   the integer 0 for a first revision;
//! - `Body` the document as jiffy decodes it, `{[{Key, Value}, …]}` in the client's member order,
//!   without the special members CouchDB takes out of the body (it keeps `_replication_*`); an
//!   array of integers 0..=255 only is an Erlang string (`STRING_EXT`, its bytes), as OTP writes
//!   any such list;
//! - `Atts` one `{Name, Type, MD5}` per attachment, in the reverse of the document's order.
//!   An attachment without an MD5 makes CouchDB fall back to a random id; so do we.
//!
//! The encoder writes only the few term kinds JSON decodes to, as bytes into one buffer hashed at
//! the end: the bytes are pinned by real CouchDB 3.4.3 answers (fixtures 013, 019, 041 and a body
//! of integers of every size in the tests below), and a general-purpose term encoder would first
//! build a copy of every document body as terms, on every write, and leave the atom encoding
//! (which changes the hash) to its own choice.

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use md5::{Digest, Md5};
use serde_json::{Map, Number, Value};

use super::doc_attachments::ATTACHMENTS;

/// Erlang external term format tags, as OTP writes them with `minor_version` 1.
mod tag {
    pub const VERSION: u8 = 131;
    pub const NEW_FLOAT: u8 = 70;
    pub const SMALL_INTEGER: u8 = 97;
    pub const INTEGER: u8 = 98;
    pub const ATOM: u8 = 100;
    pub const SMALL_TUPLE: u8 = 104;
    pub const NIL: u8 = 106;
    pub const STRING: u8 = 107;
    pub const LIST: u8 = 108;
    pub const BINARY: u8 = 109;
    pub const SMALL_BIG: u8 = 110;
    pub const LARGE_BIG: u8 = 111;
}

/// The id (32 lowercase hex digits) of the revision an edit makes; `None` when CouchDB would
/// pick a random one (an attachment without an MD5 digest).
///
/// `parent` is the revision the edit extends (`N-id`): the one the client named; `None` for a
/// first revision. The re-creation of a deleted document is [`recreation_rev_id`].
pub fn edit_rev_id(parent: Option<&str>, deleted: bool, body: &Map<String, Value>) -> Option<String> {
    let attachments = attachment_terms(body)?;
    Some(hash_edit(parent, deleted, body, &AttachmentTerms::Digested(attachments)))
}

/// The id of the revision that re-creates a deleted document, extending its deleted winner
/// `deleted_winner` (`N-id`).
///
/// CouchDB computes it late, in `couch_db_updater:merge_rev_tree`, when the attachments are
/// already their on-disk tuples, from which `couch_att:fetch` reads no name, type or MD5: each
/// attachment is hashed as `{undefined, undefined, undefined}`, whatever its bytes.
pub fn recreation_rev_id(deleted_winner: &str, body: &Map<String, Value>) -> String {
    let count = body.get(ATTACHMENTS).and_then(Value::as_object).map_or(0, Map::len);
    hash_edit(Some(deleted_winner), false, body, &AttachmentTerms::Undigested(count))
}

/// The `Atts` of a hashed edit.
enum AttachmentTerms {
    /// Each attachment's `(name, content type, MD5)`, in document order.
    Digested(Vec<(String, String, Vec<u8>)>),
    /// So many attachments read as on-disk tuples (`{undefined, undefined, undefined}` each).
    Undigested(usize),
}

/// The MD5 of `[Deleted, OldStart, OldRev, Body, Atts]`, in hex.
fn hash_edit(parent: Option<&str>, deleted: bool, body: &Map<String, Value>, attachments: &AttachmentTerms) -> String {
    let mut term = TermWriter::new();
    term.list_header(5);
    term.atom(if deleted { "true" } else { "false" });
    match parent.and_then(|rev| rev.split_once('-')) {
        Some((generation, id)) => {
            term.integer_text(generation);
            term.binary(&rev_id_bytes(id));
        }
        None => {
            term.small_integer(0);
            term.small_integer(0);
        }
    }
    term.object(body.iter().filter(|(key, _)| hashed_member(key)));
    match attachments {
        AttachmentTerms::Digested(attachments) => {
            term.list_header(attachments.len());
            for (name, content_type, md5) in attachments.iter().rev() {
                term.tuple_header(3);
                term.binary(name.as_bytes());
                term.binary(content_type.as_bytes());
                term.binary(md5);
            }
        }
        AttachmentTerms::Undigested(count) => {
            term.list_header(*count);
            for _ in 0..*count {
                term.tuple_header(3);
                for _ in 0..3 {
                    term.atom("undefined");
                }
            }
        }
    }
    term.nil();
    term.nil();
    lower_hex(&term.finish())
}

/// `bytes` as lowercase hex digits, written into one string of its final size (`hex::encode`
/// collected it a character at a time).
fn lower_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut text = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        text.push(char::from(DIGITS[usize::from(byte >> 4)]));
        text.push(char::from(DIGITS[usize::from(byte & 0x0f)]));
    }
    text
}

/// Whether a member of a stored body is in CouchDB's `Body`: every member but the special ones,
/// of which only the replicator's `_replication_*` stay in the body (`_attachments` is `Atts`).
fn hashed_member(key: &str) -> bool {
    !key.starts_with('_') || key.starts_with("_replication_")
}

/// A revision id as CouchDB keeps it: 32 hex digits as their 16 bytes, anything else as is.
fn rev_id_bytes(id: &str) -> Vec<u8> {
    match hex::decode(id) {
        Ok(bytes) if id.len() == 32 => bytes,
        _ => id.as_bytes().to_vec(),
    }
}

/// Each attachment's `(name, content type, MD5)` in document order; `None` when one has no MD5.
fn attachment_terms(body: &Map<String, Value>) -> Option<Vec<(String, String, Vec<u8>)>> {
    let Some(Value::Object(attachments)) = body.get(ATTACHMENTS) else {
        return Some(Vec::new());
    };
    attachments
        .iter()
        .map(|(name, fields)| {
            let md5 = fields.get("digest")?.as_str()?.strip_prefix("md5-")?;
            let md5 = BASE64.decode(md5).ok()?;
            let content_type = fields.get("content_type").and_then(Value::as_str).unwrap_or_default();
            Some((name.clone(), content_type.to_owned(), md5))
        })
        .collect()
}

/// Writes terms into a buffer, hashed whole at the end: the hasher fed each term's few bytes
/// as it was written cost more in its calls than in its rounds (the bench's data-store
/// document, 13 members, was about 150 updates; issue 38).
struct TermWriter {
    encoded: Vec<u8>,
}

/// The buffer's first size: a document of a few hundred bytes of JSON encodes within it.
const TERM_BUFFER_BYTES: usize = 1024;

impl TermWriter {
    fn new() -> Self {
        let mut encoded = Vec::with_capacity(TERM_BUFFER_BYTES);
        encoded.push(tag::VERSION);
        TermWriter { encoded }
    }

    fn finish(self) -> [u8; 16] {
        Md5::digest(&self.encoded).into()
    }

    fn byte(&mut self, byte: u8) {
        self.encoded.push(byte);
    }

    fn length(&mut self, length: usize) {
        self.encoded.extend_from_slice(&u32::try_from(length).unwrap_or(u32::MAX).to_be_bytes());
    }

    fn atom(&mut self, name: &str) {
        self.byte(tag::ATOM);
        self.encoded.extend_from_slice(&u16::try_from(name.len()).unwrap_or(u16::MAX).to_be_bytes());
        self.encoded.extend_from_slice(name.as_bytes());
    }

    fn binary(&mut self, bytes: &[u8]) {
        self.byte(tag::BINARY);
        self.length(bytes.len());
        self.encoded.extend_from_slice(bytes);
    }

    fn small_integer(&mut self, value: u8) {
        self.byte(tag::SMALL_INTEGER);
        self.byte(value);
    }

    fn tuple_header(&mut self, arity: u8) {
        self.byte(tag::SMALL_TUPLE);
        self.byte(arity);
    }

    /// A proper list's header; an empty list is only [`Self::nil`].
    fn list_header(&mut self, length: usize) {
        if length > 0 {
            self.byte(tag::LIST);
            self.length(length);
        }
    }

    /// `STRING_EXT`: a list of integers 0..=255, shorter than 65,536, as its bytes.
    fn string(&mut self, bytes: &[u8]) {
        self.byte(tag::STRING);
        self.encoded.extend_from_slice(&u16::try_from(bytes.len()).unwrap_or(u16::MAX).to_be_bytes());
        self.encoded.extend_from_slice(bytes);
    }

    fn nil(&mut self) {
        self.byte(tag::NIL);
    }

    /// `{[{Key, Value}, …]}`, jiffy's object.
    fn object<'a>(&mut self, members: impl Iterator<Item = (&'a String, &'a Value)> + Clone) {
        let count = members.clone().count();
        self.tuple_header(1);
        self.list_header(count);
        for (key, value) in members {
            self.tuple_header(2);
            self.binary(key.as_bytes());
            self.value(value);
        }
        self.nil();
    }

    fn value(&mut self, value: &Value) {
        match value {
            Value::Null => self.atom("null"),
            Value::Bool(flag) => self.atom(if *flag { "true" } else { "false" }),
            Value::Number(number) => self.number(number),
            Value::String(text) => self.binary(text.as_bytes()),
            Value::Array(items) => match byte_string(items) {
                // Erlang writes a list of small integers as bytes (`STRING_EXT`), not as a list.
                Some(bytes) => self.string(&bytes),
                None => {
                    self.list_header(items.len());
                    for item in items {
                        self.value(item);
                    }
                    self.nil();
                }
            },
            Value::Object(members) => self.object(members.iter()),
        }
    }

    /// A JSON number as jiffy decodes it: a fraction or an exponent makes a float, anything
    /// else an integer of any size.
    fn number(&mut self, number: &Number) {
        // An integer within 64 bits, as its text would parse (`as_i64` reads the same text, and
        // is `None` for a fraction or an exponent): no text written out for it.
        if let Some(value) = number.as_i64() {
            self.integer(value);
            return;
        }
        let text = number.to_string();
        if text.contains(['.', 'e', 'E']) {
            let float = text.parse::<f64>().unwrap_or(f64::NAN);
            self.byte(tag::NEW_FLOAT);
            self.encoded.extend_from_slice(&float.to_be_bytes());
        } else {
            self.integer_text(&text);
        }
    }

    /// An integer written in decimal, in the smallest form Erlang gives it.
    fn integer_text(&mut self, text: &str) {
        match text.parse::<i64>() {
            Ok(value) => self.integer(value),
            Err(_) => self.big_integer(text),
        }
    }

    /// An integer within 64 bits, in the smallest form Erlang gives it.
    fn integer(&mut self, value: i64) {
        match (u8::try_from(value), i32::try_from(value)) {
            (Ok(small), _) => self.small_integer(small),
            (_, Ok(value)) => {
                self.byte(tag::INTEGER);
                self.encoded.extend_from_slice(&value.to_be_bytes());
            }
            _ => self.big_integer(&value.to_string()),
        }
    }

    /// `SMALL_BIG_EXT`/`LARGE_BIG_EXT`: sign byte and the magnitude's bytes, least significant
    /// first.
    fn big_integer(&mut self, text: &str) {
        let (negative, digits) = match text.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        let magnitude = decimal_to_le_bytes(digits);
        if magnitude.len() <= 255 {
            self.byte(tag::SMALL_BIG);
            self.byte(magnitude.len() as u8);
        } else {
            self.byte(tag::LARGE_BIG);
            self.length(magnitude.len());
        }
        self.byte(u8::from(negative));
        self.encoded.extend_from_slice(&magnitude);
    }
}

/// The bytes of a JSON array that Erlang's external term format writes as a `STRING_EXT`: a
/// non-empty list shorter than 65,536 whose every element is an integer 0..=255 as jiffy decodes
/// it (no fraction, no exponent: `1.0` is a float); `None` for any other array.
fn byte_string(items: &[Value]) -> Option<Vec<u8>> {
    if items.is_empty() || items.len() > usize::from(u16::MAX) {
        return None;
    }
    items
        .iter()
        .map(|item| match item {
            Value::Number(number) => {
                let text = number.to_string();
                let integer = !text.contains(['.', 'e', 'E']);
                integer.then(|| text.parse::<i64>().ok().and_then(|value| u8::try_from(value).ok())).flatten()
            }
            _ => None,
        })
        .collect()
}

/// The base-256 digits (least significant first) of a non-negative decimal.
fn decimal_to_le_bytes(digits: &str) -> Vec<u8> {
    let mut bytes: Vec<u8> = Vec::new();
    for digit in digits.bytes().filter(u8::is_ascii_digit) {
        let mut carry = u32::from(digit - b'0');
        for byte in bytes.iter_mut() {
            let next = u32::from(*byte) * 10 + carry;
            *byte = (next & 0xff) as u8;
            carry = next >> 8;
        }
        while carry > 0 {
            bytes.push((carry & 0xff) as u8);
            carry >>= 8;
        }
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fixture(name: &str) -> Value {
        let path = format!("{}/fixtures/couchdb-3.4.3/{name}.json", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("{path}: {err}"));
        serde_json::from_str(&text).unwrap_or_else(|err| panic!("{path}: {err}"))
    }

    /// A recorded PUT: the revision a real CouchDB 3.4.3 answered is the one computed here.
    fn check_recorded_put(name: &str) {
        let recorded = fixture(name);
        let body = recorded["request"]["body"].as_object().cloned().unwrap_or_default();
        let parent = body.get("_rev").and_then(Value::as_str);
        let answered = recorded["response"]["body"]["rev"].as_str().unwrap_or_default();
        let (_, answered_id) = answered.split_once('-').unwrap_or_default();
        assert_eq!(edit_rev_id(parent, false, &body).as_deref(), Some(answered_id), "fixture {name}");
    }

    #[test]
    fn first_revisions_are_couchdbs() {
        check_recorded_put("013-doc-put-create");
        check_recorded_put("041-legacy-design-doc-put");
    }

    #[test]
    fn an_update_is_hashed_with_its_parent_as_couchdb_does() {
        check_recorded_put("019-doc-put-update");
    }

    #[test]
    fn the_same_edit_gives_the_same_id_and_any_difference_another() {
        let body = json!({"a": 1, "b": [1.5, "x", null, true, {"c": -7}], "big": 123456789012345678901234567890u128})
            .as_object()
            .cloned()
            .unwrap_or_default();
        let id = edit_rev_id(Some("1-abc"), false, &body);
        assert_eq!(id, edit_rev_id(Some("1-abc"), false, &body));
        assert_ne!(id, edit_rev_id(Some("1-abd"), false, &body));
        assert_ne!(id, edit_rev_id(Some("1-abc"), true, &body));
        assert_ne!(id, edit_rev_id(None, false, &body));
        let mut reordered = Map::new();
        for (key, value) in body.iter().rev() {
            reordered.insert(key.clone(), value.clone());
        }
        assert_ne!(id, edit_rev_id(Some("1-abc"), false, &reordered), "member order is part of the body");
    }

    /// Expected ids computed apart from this encoder, by Erlang/OTP itself:
    /// `erlang:md5(term_to_binary([false, 0, 0, Body, []], [{minor_version, 1}]))` with `Body`
    /// the jiffy form of each document.
    #[test]
    fn lists_of_small_integers_are_hashed_as_erlang_strings() {
        let first = |body: Value| edit_rev_id(None, false, body.as_object().unwrap_or(&Map::new()));
        assert_eq!(first(json!({"a": [1, 2, 3], "z": [0]})).as_deref(), Some("02a6620dd4160feb85213d951d769338"));
        // Not strings: an integer past 255, a float, nested lists, negative integers.
        assert_eq!(
            first(json!({"b": [1, 256], "c": [1.0], "n": [[1, 2], [300], -1, [-1]]})).as_deref(),
            Some("73be7cfab652188031c5e65b65cbb0de")
        );
    }

    /// Integers on each side of every form's bounds (small, 32-bit, 64-bit and past it), floats
    /// and `-0`: the id a real CouchDB 3.4.3 answered for this body (`PUT /ds4_revids/ints`,
    /// 2026-12-01), so the 64-bit shortcut and the text path write what OTP writes.
    #[test]
    fn integers_of_every_size_are_hashed_as_couchdb_does() {
        let text = r#"{"i":[2147483647,2147483648,-2147483648,-2147483649,9007199254740993,-9223372036854775808,9223372036854775807,18446744073709551615],"s":255,"t":256,"n":-1,"z":-0,"f":[1.0,1e2,-0.5],"seq":123456,"m":{"seq":7}}"#;
        let sent: Map<String, Value> = serde_json::from_str(text).unwrap_or_default();
        assert_eq!(edit_rev_id(None, false, &sent).as_deref(), Some("32cda54b936f3d5b47d745f330f18da5"));
    }

    #[test]
    fn integers_take_erlangs_smallest_form() {
        assert_eq!(decimal_to_le_bytes("0"), Vec::<u8>::new());
        assert_eq!(decimal_to_le_bytes("256"), vec![0, 1]);
        assert_eq!(decimal_to_le_bytes("4294967296"), vec![0, 0, 0, 0, 1]);
    }

    #[test]
    fn an_attachment_without_md5_leaves_the_id_to_chance() {
        let body = json!({"_attachments": {"a.txt": {"content_type": "text/plain", "digest": "sha-xyz"}}});
        assert_eq!(edit_rev_id(None, false, body.as_object().unwrap_or(&Map::new())), None);
        let body = json!({"_attachments": {"a.txt": {"content_type": "text/plain", "digest": "md5-XrY7u+Ae7tCTyyK7j1rNww=="}}});
        assert!(edit_rev_id(None, false, body.as_object().unwrap_or(&Map::new())).is_some());
    }
}
