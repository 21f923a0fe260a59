//! The canonical content hash `migrate` and `verify` compare documents by.
//!
//! SHA-256 over the `_id` and a canonical serialisation of the body without `_rev` (revisions
//! are each backend's own): object keys sorted by their UTF-8 bytes at every depth, strings as
//! JSON strings, and numbers by their exact decimal value — sign, significant digits and a
//! power of ten — so `100`, `1E+2` and `100.0` hash alike (backends may rewrite a number's text;
//! DynamoDB does) while `9007199254740993` and `9007199254740992` do not. Nothing is rounded
//! through a double.

use std::io::Write;

use serde_json::{Map, Number, Value};
use sha2::{Digest, Sha256};

/// A document's content hash.
pub type ContentHash = [u8; 32];

/// The hash of a document: its id and its body (which holds neither `_id` nor `_rev`).
pub fn content_hash(id: &str, body: &Map<String, Value>) -> ContentHash {
    let mut hasher = HashWriter(Sha256::new());
    write_string(&mut hasher, id);
    hasher.0.update(b"\n");
    write_object(&mut hasher, body);
    hasher.0.finalize().into()
}

/// Feeds whatever is written into the hash.
struct HashWriter(Sha256);

impl Write for HashWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn write_string(out: &mut HashWriter, text: &str) {
    // Serialising a string into a sink that never fails cannot fail.
    let _ = serde_json::to_writer(&mut *out, text);
}

fn write_object(out: &mut HashWriter, map: &Map<String, Value>) {
    let mut entries: Vec<(&String, &Value)> = map.iter().collect();
    entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    out.0.update(b"{");
    for (i, (name, value)) in entries.into_iter().enumerate() {
        if i > 0 {
            out.0.update(b",");
        }
        write_string(out, name);
        out.0.update(b":");
        write_value(out, value);
    }
    out.0.update(b"}");
}

fn write_value(out: &mut HashWriter, value: &Value) {
    match value {
        Value::Null => out.0.update(b"null"),
        Value::Bool(true) => out.0.update(b"true"),
        Value::Bool(false) => out.0.update(b"false"),
        Value::Number(number) => out.0.update(canonical_number(number).as_bytes()),
        Value::String(text) => write_string(out, text),
        Value::Array(items) => {
            out.0.update(b"[");
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.0.update(b",");
                }
                write_value(out, item);
            }
            out.0.update(b"]");
        }
        Value::Object(map) => write_object(out, map),
    }
}

/// `[-]DIGITSeEXP` with no leading or trailing zeros in DIGITS (`0` for zero of either sign), from
/// [`crate::model::number::decimal`]. Number text it cannot read (an exponent beyond `i64`) is
/// kept as written.
pub fn canonical_number(number: &Number) -> String {
    let text = number.to_string();
    match crate::model::number::decimal(&text) {
        Some((_, digits, _)) if digits == "0" => "0".into(),
        Some((negative, digits, exponent)) => format!("{}{digits}e{exponent}", if negative { "-" } else { "" }),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn number(text: &str) -> Number {
        match serde_json::from_str(text) {
            Ok(Value::Number(n)) => n,
            other => panic!("{text}: {other:?}"),
        }
    }

    fn body(value: Value) -> Map<String, Value> {
        value.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn equal_decimal_values_share_a_form() {
        for group in [
            &["100", "1E+2", "1e2", "100.0", "0.1e3"][..],
            &["1e-07", "1E-7", "0.0000001"],
            &["0", "-0", "0.000", "0e10"],
            &["-12.50", "-1.25e1"],
        ] {
            let forms: Vec<String> = group.iter().map(|t| canonical_number(&number(t))).collect();
            assert!(forms.windows(2).all(|w| w[0] == w[1]), "{group:?} gave {forms:?}");
        }
        assert_ne!(canonical_number(&number("9007199254740993")), canonical_number(&number("9007199254740992")));
        assert_ne!(canonical_number(&number("-1")), canonical_number(&number("1")));
    }

    #[test]
    fn key_order_does_not_matter_but_content_does() {
        let a = body(json!({"b": 1, "a": {"y": [1, 2], "x": null}}));
        let b = body(json!({"a": {"x": null, "y": [1, 2]}, "b": 1.0}));
        assert_eq!(content_hash("id", &a), content_hash("id", &b));
        assert_ne!(content_hash("id", &a), content_hash("other", &a));
        for changed in [
            json!({"b": 1, "a": {"y": [2, 1], "x": null}}),
            json!({"b": "1", "a": {"y": [1, 2], "x": null}}),
            json!({"b": 1, "a": {"y": [1, 2]}}),
            json!({"b": 1, "a": {"y": [1, 2], "x": null}, "c": 0}),
        ] {
            assert_ne!(content_hash("id", &a), content_hash("id", &body(changed.clone())), "{changed}");
        }
    }

    #[test]
    fn strings_cannot_be_confused_with_structure() {
        let a = body(json!({"a": "1,\"b\":2"}));
        let b = body(json!({"a": "1", "b": 2}));
        assert_ne!(content_hash("id", &a), content_hash("id", &b));
    }
}
