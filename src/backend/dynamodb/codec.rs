//! JSON bodies ↔ DynamoDB items, losslessly (see docs/dynamodb-layout.md).
//!
//! A body is stored as native attributes when DynamoDB can hold every part of it exactly;
//! otherwise as gzip-compressed JSON text in `_body`, split over chunk items when even the
//! compressed text is over one item. `userId`, `namespace` and `key` are always native so the GSI
//! and projections work for every document.

use std::collections::HashMap;

use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::AttributeValue;
use base64::Engine as _;
use serde_json::{Map, Number, Value};

use crate::backend::raw::compressed;
pub use crate::backend::raw::compressed::FORMAT_JSON_GZIP;
use crate::error::{Error, ErrorKind, Result};
use crate::model::fields;

pub const ID: &str = "_id";
pub const REV: &str = "_rev";
pub const BODY: &str = "_body";
pub const FORMAT: &str = "_format";
pub const CHUNKS: &str = "_chunks";
pub const CHUNK_OF: &str = "_chunkOf";

/// Bodies whose JSON is larger than this are not stored natively (margin under DynamoDB's 400 KB
/// item limit, whose size rules differ from JSON's).
pub const NATIVE_LIMIT_BYTES: usize = 350_000;
/// Compressed bytes per item.
pub const CHUNK_BYTES: usize = 350_000;
/// Deepest nesting stored natively: DynamoDB allows 32 levels; the margin covers the item itself.
const MAX_NATIVE_DEPTH: usize = 30;

pub type Item = HashMap<String, AttributeValue>;

/// A body encoded for storage: the main item and, for large bodies, extra chunks.
pub struct Encoded {
    pub item: Item,
    pub extra_chunks: Vec<Vec<u8>>,
}

/// The id of chunk `n` (1-based) of revision `rev` of `id`. Base64url (the last part of every
/// valid id) has no `#`, so this never equals a document id of the data store.
pub fn chunk_id(id: &str, rev: &str, n: usize) -> String {
    format!("{}{rev}#{n}", chunk_prefix(id))
}

/// The prefix every chunk id of `id` starts with (and which other documents' ids may share).
pub fn chunk_prefix(id: &str) -> String {
    format!("{id}#chunk#")
}

pub fn encode(id: &str, rev: &str, body: &Map<String, Value>) -> Result<Encoded> {
    let mut item = Item::new();
    item.insert(ID.into(), AttributeValue::S(id.into()));
    item.insert(REV.into(), AttributeValue::S(rev.into()));
    if native_safe(body) {
        for (name, value) in body {
            item.insert(name.clone(), to_attribute(value));
        }
        return Ok(Encoded { item, extra_chunks: Vec::new() });
    }
    for name in [fields::USER_ID, fields::NAMESPACE, fields::KEY] {
        if let Some(Value::String(text)) = body.get(name) {
            item.insert(name.into(), AttributeValue::S(text.clone()));
        }
    }
    let (first, extra_chunks) = compressed::compress(id, body)?.split(CHUNK_BYTES);
    item.insert(FORMAT.into(), AttributeValue::S(FORMAT_JSON_GZIP.into()));
    item.insert(BODY.into(), AttributeValue::B(Blob::new(first)));
    if !extra_chunks.is_empty() {
        item.insert(CHUNKS.into(), AttributeValue::N(extra_chunks.len().to_string()));
    }
    Ok(Encoded { item, extra_chunks })
}

/// How many extra chunk items this item's body continues in.
pub fn extra_chunk_count(item: &Item) -> usize {
    match item.get(CHUNKS) {
        Some(AttributeValue::N(n)) => n.parse().unwrap_or(0),
        _ => 0,
    }
}

pub fn is_chunk(item: &Item) -> bool {
    item.contains_key(CHUNK_OF)
}

pub fn string_attribute<'a>(item: &'a Item, name: &str) -> Option<&'a str> {
    match item.get(name) {
        Some(AttributeValue::S(text)) => Some(text),
        _ => None,
    }
}

/// The body of a main item; `extra_chunks` are the `_body`s of its chunk items, in order.
pub fn decode(item: &Item, extra_chunks: &[Vec<u8>]) -> Result<Map<String, Value>> {
    let id = string_attribute(item, ID).unwrap_or("?");
    match string_attribute(item, FORMAT) {
        None => {
            let mut body = Map::new();
            // Attributes starting with `_` are the layout's (revision, ancestry, feed position...):
            // a native body never has such a field (see `native_safe`).
            let mut names: Vec<&String> = item.keys().filter(|n| !n.starts_with('_')).collect();
            // A stable, spec-like order: DynamoDB items carry no field order.
            names.sort_by_key(|name| (crate::model::document::field_rank(name), name.as_str()));
            for name in names {
                body.insert(name.clone(), from_attribute(&item[name]));
            }
            Ok(body)
        }
        Some(FORMAT_JSON_GZIP) => {
            let first = match item.get(BODY) {
                Some(AttributeValue::B(blob)) => blob.as_ref().to_vec(),
                _ => return Err(corrupt(id, "has _format but no binary _body")),
            };
            compressed::decompress(first, extra_chunks, |problem| corrupt(id, problem))
        }
        Some(other) => Err(corrupt(id, &format!("has unknown _format {other:?}"))),
    }
}

fn corrupt(id: &str, problem: &str) -> Error {
    Error::new(ErrorKind::Corrupt, format!("DynamoDB item {id:?} {problem}"))
}

/// Whether DynamoDB can hold every part of `body` natively and exactly. Exactly includes the
/// order of every object's members (CouchDB keeps it, and views collate objects member by
/// member): DynamoDB's maps have none, so a body is native only when each object's members are
/// already in the order [`decode`] gives them back (the spec's field order at the top, names in
/// byte order below); any other body is kept as its JSON text.
pub fn native_safe(body: &Map<String, Value>) -> bool {
    if crate::model::validate::json_size(body) > NATIVE_LIMIT_BYTES {
        return false;
    }
    let rank = |name: &String| (crate::model::document::field_rank(name), name.clone());
    if !body.keys().zip(body.keys().skip(1)).all(|(a, b)| rank(a) < rank(b)) {
        return false;
    }
    body.iter().all(|(name, value)| {
        !name.is_empty()
            && !name.starts_with('_')
            && match name.as_str() {
                // GSI key attributes must be strings when present.
                fields::USER_ID | fields::NAMESPACE => value.is_string(),
                _ => true,
            }
            && value_safe(value, 0)
    })
}

fn value_safe(value: &Value, depth: usize) -> bool {
    match value {
        Value::Number(n) => number_safe(n),
        Value::Array(items) => depth < MAX_NATIVE_DEPTH && items.iter().all(|v| value_safe(v, depth + 1)),
        Value::Object(map) => {
            depth < MAX_NATIVE_DEPTH
                && map.keys().zip(map.keys().skip(1)).all(|(a, b)| a < b)
                && map.iter().all(|(k, v)| !k.is_empty() && value_safe(v, depth + 1))
        }
        Value::Null | Value::Bool(_) | Value::String(_) => true,
    }
}

/// DynamoDB numbers: at most 38 significant digits, magnitude 1E-130 to below 1E+126.
fn number_safe(number: &Number) -> bool {
    let text = number.to_string();
    let unsigned = text.trim_start_matches('-');
    let (mantissa, exponent) = match unsigned.find(['e', 'E']) {
        Some(at) => match unsigned[at + 1..].trim_start_matches('+').parse::<i64>() {
            Ok(e) => (&unsigned[..at], e),
            Err(_) => return false,
        },
        None => (unsigned, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = format!("{int}{frac}");
    let significant = digits.trim_start_matches('0');
    if significant.is_empty() {
        return true; // zero
    }
    let leading_zeros = digits.len() - significant.len();
    let trimmed = significant.trim_end_matches('0');
    // Scientific exponent of the first significant digit.
    let scientific = exponent + int.len() as i64 - 1 - leading_zeros as i64;
    trimmed.len() <= 38 && (-130..=125).contains(&scientific)
}

pub fn to_attribute(value: &Value) -> AttributeValue {
    match value {
        Value::Null => AttributeValue::Null(true),
        Value::Bool(b) => AttributeValue::Bool(*b),
        Value::Number(n) => AttributeValue::N(n.to_string()),
        Value::String(s) => AttributeValue::S(s.clone()),
        Value::Array(items) => AttributeValue::L(items.iter().map(to_attribute).collect()),
        Value::Object(map) => AttributeValue::M(map.iter().map(|(k, v)| (k.clone(), to_attribute(v))).collect()),
    }
}

/// Native attributes back to JSON. Types this service never writes (sets, binary) are mapped to
/// the nearest JSON: sets to arrays, binary to base64 text.
pub fn from_attribute(value: &AttributeValue) -> Value {
    let number = |text: &str| serde_json::from_str::<Value>(text).unwrap_or_else(|_| Value::String(text.to_owned()));
    match value {
        AttributeValue::Null(_) => Value::Null,
        AttributeValue::Bool(b) => Value::Bool(*b),
        AttributeValue::N(text) => number(text),
        AttributeValue::S(text) => Value::String(text.clone()),
        AttributeValue::L(items) => Value::Array(items.iter().map(from_attribute).collect()),
        AttributeValue::M(map) => {
            let mut entries: Vec<(&String, &AttributeValue)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            Value::Object(entries.into_iter().map(|(k, v)| (k.clone(), from_attribute(v))).collect())
        }
        AttributeValue::Ss(items) => Value::Array(items.iter().map(|s| Value::String(s.clone())).collect()),
        AttributeValue::Ns(items) => Value::Array(items.iter().map(|n| number(n)).collect()),
        AttributeValue::B(blob) => Value::String(base64::engine::general_purpose::STANDARD.encode(blob.as_ref())),
        AttributeValue::Bs(items) => Value::Array(
            items.iter().map(|b| Value::String(base64::engine::general_purpose::STANDARD.encode(b.as_ref()))).collect(),
        ),
        _ => Value::Null,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn n(text: &str) -> Number {
        match serde_json::from_str::<Value>(text).unwrap() {
            Value::Number(n) => n,
            _ => unreachable!(),
        }
    }

    #[test]
    fn dynamodb_number_limits() {
        for ok in [
            "0",
            "-0",
            "42",
            "3.14",
            "1e-07",
            "9223372036854775807",
            "12345678901234567890123456789012345678",
            "1e-130",
            "9.9e125",
            "0.00012",
            "1200e-2",
        ] {
            assert!(number_safe(&n(ok)), "{ok}");
        }
        for bad in ["123456789012345678901234567890123456789", "1e-131", "1e126", "1.7976931348623157e+308", "5e-324"] {
            assert!(!number_safe(&n(bad)), "{bad}");
        }
    }

    #[test]
    fn unsafe_bodies_fall_back_to_the_blob() {
        let safe = json!({"userId": "u", "value": {"a": [1, "x", null, true, {"b": ""}]}});
        assert!(native_safe(safe.as_object().unwrap()));
        for body in [
            json!({"value": {"": 1}}),
            json!({"value": 1e300}),
            json!({"_foreign": 1}),
            json!({"userId": 5}),
            json!({"value": "x".repeat(NATIVE_LIMIT_BYTES)}),
        ] {
            assert!(!native_safe(body.as_object().unwrap()), "{body}");
        }
        let mut deep = json!("leaf");
        for _ in 0..33 {
            deep = json!({ "d": deep });
        }
        assert!(!native_safe(json!({"value": deep}).as_object().unwrap()));
    }

    #[test]
    fn round_trips_both_ways() {
        for body in [
            json!({"userId": "u", "namespace": "n", "key": "k", "value": {"a": [1, 2.5, null]}, "accessCount": 3}),
            json!({"userId": "u", "namespace": "n", "key": "k", "value": {"": [[]], "big": 1e300}}),
        ] {
            let body = body.as_object().unwrap().clone();
            let encoded = encode("u:n:aw==", "1-x", &body).unwrap();
            assert!(encoded.extra_chunks.is_empty());
            assert_eq!(string_attribute(&encoded.item, fields::USER_ID), Some("u"));
            let decoded = decode(&encoded.item, &[]).unwrap();
            assert_eq!(Value::Object(decoded), Value::Object(body));
        }
    }

    /// Member order reads back as written, natively or not (`Map`'s `==` ignores order: the
    /// texts are compared).
    #[test]
    fn member_order_reads_back_as_written() {
        for (body, native) in [
            (json!({"userId": "u", "value": {"a": 1, "b": {"c": 2, "d": 3}}}), true),
            (json!({"userId": "u", "value": {"b": 2, "a": 1}}), false),
            (json!({"value": 1, "userId": "u"}), false),
            (json!({"zeta": 1, "alpha": 2}), false),
        ] {
            let body = body.as_object().unwrap().clone();
            assert_eq!(native_safe(&body), native, "{body:?}");
            let encoded = encode("u:n:aw==", "1-x", &body).unwrap();
            let decoded = decode(&encoded.item, &[]).unwrap();
            assert_eq!(serde_json::to_string(&decoded).unwrap(), serde_json::to_string(&body).unwrap());
        }
    }

    #[test]
    fn large_incompressible_bodies_are_chunked() {
        let mut state = 7u64;
        let noise: String = (0..1_500_000)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                char::from(b'!' + ((state >> 33) % 90) as u8)
            })
            .collect();
        let body = json!({"userId": "u", "namespace": "n", "key": "k", "value": noise}).as_object().unwrap().clone();
        let encoded = encode("u:n:aw==", "1-x", &body).unwrap();
        assert!(!encoded.extra_chunks.is_empty());
        assert_eq!(extra_chunk_count(&encoded.item), encoded.extra_chunks.len());
        let decoded = decode(&encoded.item, &encoded.extra_chunks).unwrap();
        assert_eq!(decoded, body);
    }
}
