//! JSON nesting depth: the one limit a document (and a view key or value) is held to on write,
//! and the reading of stored JSON, which must never trip over serde_json's own limit.
//!
//! serde_json refuses text nested 128 levels or deeper (its recursion limit). Stored records wrap
//! a document in levels of their own: the database engine's revision tree adds 4
//! (`{"revtree":{"l":[{"b":…}]}}`), a data-store document's other leaves 3, a view row 1 and a map
//! function's answer 3. So a document accepted at the limit would not read back if stored JSON
//! were parsed with serde_json's default: every read of stored JSON goes through
//! [`parse_stored`] instead, which allows [`MAX_STORED_DEPTH`] (room for any wrapping of a
//! document at [`MAX_DOCUMENT_DEPTH`], and for documents an older release accepted), and every
//! write is held to [`MAX_DOCUMENT_DEPTH`] ([`check_document_depth`]). The depth is measured by a
//! scan of the text before any recursive parse, so no text can exhaust the stack.

use serde::de::{DeserializeOwned, Error as _};
use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// The deepest nesting a document may have, its own object counting as level 1 (`{"a":{}}` is 2
/// deep). CouchDB 3.4.3 keeps documents nested this deep.
pub const MAX_DOCUMENT_DEPTH: usize = 128;

/// The deepest request body read: a document at [`MAX_DOCUMENT_DEPTH`] inside the 2 levels of
/// `_bulk_docs`' `{"docs":[…]}`. Deeper bodies are refused as they are parsed.
pub const MAX_REQUEST_DEPTH: usize = MAX_DOCUMENT_DEPTH + 2;

/// The deepest stored JSON read back: a document at [`MAX_DOCUMENT_DEPTH`] with any record's
/// wrapping around it, with room to spare. Deeper text was never written by this service and is
/// reported as unreadable rather than parsed.
pub const MAX_STORED_DEPTH: usize = 2 * MAX_DOCUMENT_DEPTH;

/// The nesting depth of a value (a scalar is 0, `{}` and `[]` are 1), measured without recursion.
pub fn value_depth(value: &Value) -> usize {
    // A scalar is depth 0 without the walk's stack (most of a document's members are scalars,
    // and each one's stack was an allocation; issue 38).
    if !matches!(value, Value::Array(_) | Value::Object(_)) {
        return 0;
    }
    let mut deepest = 0;
    let mut pending: Vec<(&Value, usize)> = vec![(value, 1)];
    while let Some((value, level)) = pending.pop() {
        match value {
            Value::Array(items) => {
                deepest = deepest.max(level);
                pending.extend(items.iter().map(|item| (item, level + 1)));
            }
            Value::Object(fields) => {
                deepest = deepest.max(level);
                pending.extend(fields.values().map(|item| (item, level + 1)));
            }
            Value::Null | Value::Bool(_) | Value::Number(_) | Value::String(_) => {}
        }
    }
    deepest
}

/// The nesting depth of a document body (its own object is level 1).
pub fn body_depth(body: &Map<String, Value>) -> usize {
    1 + body.values().map(value_depth).max().unwrap_or(0)
}

/// The deepest nesting of brackets and braces in JSON text, outside strings: what parsing it
/// would recurse to. Text that is not JSON gets a depth too; its parse fails anyway.
pub fn text_depth(text: &[u8]) -> usize {
    let (mut level, mut deepest) = (0usize, 0usize);
    let mut in_string = false;
    let mut escaped = false;
    for &byte in text {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'[' | b'{' => {
                level += 1;
                deepest = deepest.max(level);
            }
            b']' | b'}' => level = level.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

/// Parses JSON text nested at most `max_depth` levels, however close to serde_json's own limit
/// that is; deeper text is an error naming both depths, found before any recursive parse.
pub fn parse_within<T: DeserializeOwned>(text: &[u8], max_depth: usize) -> serde_json::Result<T> {
    let depth = text_depth(text);
    if depth > max_depth {
        return Err(serde_json::Error::custom(format!(
            "the JSON is nested {depth} levels deep; at most {max_depth} are read (JSON nesting depth)"
        )));
    }
    let mut deserializer = serde_json::Deserializer::from_slice(text);
    // The scan above bounds the recursion instead.
    deserializer.disable_recursion_limit();
    let value = T::deserialize(&mut deserializer)?;
    deserializer.end()?;
    Ok(value)
}

/// Parses stored JSON: anything this service stores, at any depth it accepts.
pub fn parse_stored<T: DeserializeOwned>(text: &[u8]) -> serde_json::Result<T> {
    parse_within(text, MAX_STORED_DEPTH)
}

/// `what` (a document, a view key…) nests no deeper than [`MAX_DOCUMENT_DEPTH`]; else invalid
/// input naming the limit.
pub fn check_depth(what: &str, depth: usize) -> Result<()> {
    if depth > MAX_DOCUMENT_DEPTH {
        return Err(Error::invalid(
            what,
            format!("is nested {depth} levels deep; at most {MAX_DOCUMENT_DEPTH} are allowed (JSON nesting depth)"),
        ));
    }
    Ok(())
}

/// A document body nests no deeper than [`MAX_DOCUMENT_DEPTH`].
pub fn check_document_depth(body: &Map<String, Value>) -> Result<()> {
    check_depth("document", body_depth(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `{"n":{"n":…{}}}` nested `depth` levels.
    fn nested_text(depth: usize) -> String {
        format!("{}{}", "{\"n\":".repeat(depth - 1) + "{", "}".repeat(depth))
    }

    #[test]
    fn depths_are_counted_from_the_outer_container() {
        for (text, depth) in [("1", 0), ("{}", 1), ("[[]]", 2), (r#"{"a":[1,{"b":"[[[["}]}"#, 3), (r#"["\"]"]"#, 1)] {
            assert_eq!(text_depth(text.as_bytes()), depth, "{text}");
            let value: Value = serde_json::from_str(text).unwrap();
            assert_eq!(value_depth(&value), depth, "{text}");
        }
        let body: Map<String, Value> = serde_json::from_str(&nested_text(5)).unwrap();
        assert_eq!(body_depth(&body), 5);
        assert_eq!(body_depth(&Map::new()), 1);
    }

    #[test]
    fn stored_json_reads_back_past_serde_jsons_own_limit() {
        let deep = nested_text(MAX_DOCUMENT_DEPTH + 4);
        assert!(serde_json::from_str::<Value>(&deep).is_err(), "serde_json's default refuses it");
        let value: Value = parse_stored(deep.as_bytes()).unwrap();
        assert_eq!(value_depth(&value), MAX_DOCUMENT_DEPTH + 4);
        let too_deep = nested_text(MAX_STORED_DEPTH + 1);
        let err = parse_stored::<Value>(too_deep.as_bytes()).unwrap_err();
        assert!(err.to_string().contains("JSON nesting depth"), "{err}");
    }

    #[test]
    fn documents_are_held_to_the_limit() {
        let at: Map<String, Value> = parse_stored(nested_text(MAX_DOCUMENT_DEPTH).as_bytes()).unwrap();
        check_document_depth(&at).unwrap();
        let past: Map<String, Value> = parse_stored(nested_text(MAX_DOCUMENT_DEPTH + 1).as_bytes()).unwrap();
        let err = check_document_depth(&past).unwrap_err();
        assert!(err.message().contains("at most 128"), "{}", err.message());
    }
}
