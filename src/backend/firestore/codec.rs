//! JSON bodies ↔ Firestore documents, losslessly (see `docs/firestore-layout.md`).
//!
//! Document ids: a composite id becomes a Firestore document id by escaping `%` and `/` (the only
//! characters of a valid composite id Firestore refuses); an escaped id over Firestore's 1,500-byte
//! limit (or empty, `.`, `..`, `__…__`, which Firestore refuses as names) is replaced by `%H` + the
//! SHA-256 of the composite id. The original `_id` is always kept
//! in the document, so listings and scans never need to reverse the name.
//!
//! Bodies: stored as native Firestore values when Firestore holds every part exactly; otherwise
//! as gzip-compressed JSON in `_body`, continued in chunk documents when even compressed it is
//! over one document. `_id`, `userId`, `namespace` and `key` are always native so queries and
//! projections work for every document.

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use serde_json::{json, Map, Number, Value};
use sha2::{Digest, Sha256};

use crate::backend::raw::compressed;
pub use crate::backend::raw::compressed::FORMAT_JSON_GZIP;
use crate::error::{Error, ErrorKind, Result};
use crate::model::fields;

pub const ID: &str = "_id";
pub const FORMAT: &str = "_format";
pub const BODY: &str = "_body";
pub const CHUNKS: &str = "_chunks";
pub const CHUNK_SET: &str = "_chunkSet";
pub const REV: &str = "_rev";
pub const REVS: &str = "_revs";
pub const DELETED: &str = "_deleted";
pub const CHANGED_AT: &str = "_changedAt";
/// The fields this layout adds; never part of a body.
pub const MODEL_FIELDS: [&str; 4] = [REV, REVS, DELETED, CHANGED_AT];
/// The subcollection under a document that holds its extra chunks (`…/agentstore_chunks/{n}`).
pub const CHUNK_COLLECTION: &str = "agentstore_chunks";
/// Fields of a chunk document.
pub const CHUNK_SET_FIELD: &str = "set";
pub const CHUNK_DATA_FIELD: &str = "data";

/// Firestore's limit on a document id, in bytes.
pub const MAX_DOCUMENT_ID_BYTES: usize = 1500;
/// Documents whose Firestore size is larger than this are not stored natively (Firestore's limit
/// is 1,048,576 bytes including the name; the margin covers the name and our own fields).
pub const NATIVE_LIMIT_BYTES: usize = 1_000_000;
/// Compressed bytes in `_body` and in each chunk document.
pub const CHUNK_BYTES: usize = 900_000;
/// The most compressed bytes one document may take: every part of it goes in one `:commit`,
/// whose request Firestore limits to 10 MiB (base64 adds a third).
pub const MAX_COMPRESSED_BYTES: usize = 7_000_000;
/// Firestore allows 20 levels of nested maps and arrays; one level of margin.
const MAX_NATIVE_DEPTH: usize = 19;

/// The Firestore document id for a composite id.
pub fn document_id(id: &str) -> String {
    let mut escaped = String::with_capacity(id.len() + 8);
    for c in id.chars() {
        match c {
            '%' => escaped.push_str("%25"),
            '/' => escaped.push_str("%2F"),
            c => escaped.push(c),
        }
    }
    let reserved = escaped.starts_with("__") && escaped.ends_with("__");
    // The empty id is never written (no database takes it) but is read: a client may name `""`
    // in `keys`, `_bulk_get` or `_revs_diff`, and a name ending in `/` is not a document's.
    let refused = escaped.is_empty() || escaped == "." || escaped == "..";
    if escaped.len() > MAX_DOCUMENT_ID_BYTES || refused || reserved {
        // `%H` never starts an escaped id: `%` is always followed by `25` or `2F` there.
        return format!("%H{}", hex::encode(Sha256::digest(id.as_bytes())));
    }
    escaped
}

/// The composite id an escaped document id stands for; `None` for hashed ids (whose `_id` field
/// is the only record of the original).
pub fn composite_id(document_id: &str) -> Option<String> {
    if document_id.starts_with("%H") {
        return None;
    }
    let mut out = String::with_capacity(document_id.len());
    let mut rest = document_id;
    while let Some(at) = rest.find('%') {
        out.push_str(&rest[..at]);
        match rest.get(at..at + 3) {
            Some("%25") => out.push('%'),
            Some("%2F") => out.push('/'),
            _ => return None,
        }
        rest = &rest[at + 3..];
    }
    out.push_str(rest);
    Some(out)
}

/// A body encoded for storage: the main document's fields and, for large bodies, the extra
/// chunks (each for one chunk document).
pub struct Encoded {
    pub fields: Map<String, Value>,
    pub chunk_set: Option<String>,
    pub extra_chunks: Vec<Vec<u8>>,
}

pub fn encode(id: &str, body: &Map<String, Value>) -> Result<Encoded> {
    let mut out = Map::new();
    out.insert(ID.into(), string_value(id));
    if let Some(native) = native_fields(id, body) {
        out.extend(native);
        return Ok(Encoded { fields: out, chunk_set: None, extra_chunks: Vec::new() });
    }
    for name in [fields::USER_ID, fields::NAMESPACE, fields::KEY] {
        if let Some(Value::String(text)) = body.get(name) {
            out.insert(name.into(), string_value(text));
        }
    }
    let compressed = compressed::compress(id, body)?;
    if compressed.bytes.len() > MAX_COMPRESSED_BYTES {
        return Err(Error::new(
            ErrorKind::TooLarge,
            format!(
                "document {id:?} is {} bytes of JSON, {} compressed: over the {MAX_COMPRESSED_BYTES} bytes one \
                 Firestore commit can carry",
                compressed.json_bytes,
                compressed.bytes.len()
            ),
        ));
    }
    let (first, extra_chunks) = compressed.split(CHUNK_BYTES);
    out.insert(FORMAT.into(), string_value(FORMAT_JSON_GZIP));
    out.insert(BODY.into(), json!({ "bytesValue": BASE64.encode(first) }));
    let chunk_set = if extra_chunks.is_empty() {
        None
    } else {
        let set = crate::backend::random_token();
        out.insert(CHUNKS.into(), json!({ "integerValue": extra_chunks.len().to_string() }));
        out.insert(CHUNK_SET.into(), string_value(&set));
        Some(set)
    };
    Ok(Encoded { fields: out, chunk_set, extra_chunks })
}

/// How many chunk documents a stored document has (0 for none).
pub fn chunk_count(fields: &Map<String, Value>) -> usize {
    fields
        .get(CHUNKS)
        .and_then(|v| v.get("integerValue"))
        .and_then(Value::as_str)
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// The chunk set a stored document's chunk documents must carry.
pub fn chunk_set(fields: &Map<String, Value>) -> Option<&str> {
    fields.get(CHUNK_SET).and_then(|v| v.get("stringValue")).and_then(Value::as_str)
}

/// The `_id` a stored document carries.
pub fn stored_id(fields: &Map<String, Value>) -> Option<&str> {
    fields.get(ID).and_then(|v| v.get("stringValue")).and_then(Value::as_str)
}

/// The body of a stored document; `extra_chunks` are its chunk documents' bytes, in order.
pub fn decode(id: &str, stored: &Map<String, Value>, extra_chunks: &[Vec<u8>]) -> Result<Map<String, Value>> {
    let format = stored.get(FORMAT).and_then(|v| v.get("stringValue")).and_then(Value::as_str);
    match format {
        None => {
            // The id and the document model's fields are not part of the body.
            let mut names: Vec<&String> =
                stored.keys().filter(|n| *n != ID && !MODEL_FIELDS.contains(&n.as_str())).collect();
            // Firestore keeps no field order; use the spec's.
            names.sort_by_key(|name| (crate::model::document::field_rank(name), name.as_str()));
            let mut body = Map::with_capacity(names.len());
            for name in names {
                body.insert(name.clone(), from_value(&stored[name]).map_err(|p| corrupt(id, &p))?);
            }
            Ok(body)
        }
        Some(FORMAT_JSON_GZIP) => {
            let first = stored
                .get(BODY)
                .and_then(|v| v.get("bytesValue"))
                .and_then(Value::as_str)
                .ok_or_else(|| corrupt(id, "has _format but no bytes _body"))?;
            let first =
                BASE64.decode(first).map_err(|e| corrupt(id, &format!("has a _body that is not base64: {e}")))?;
            compressed::decompress(first, extra_chunks, |problem| corrupt(id, problem))
        }
        Some(other) => Err(corrupt(id, &format!("has unknown _format {other:?}"))),
    }
}

/// A chunk document's fields.
pub fn chunk_fields(set: &str, data: &[u8]) -> Map<String, Value> {
    let mut out = Map::new();
    out.insert(CHUNK_SET_FIELD.into(), string_value(set));
    out.insert(CHUNK_DATA_FIELD.into(), json!({ "bytesValue": BASE64.encode(data) }));
    out
}

/// A chunk document's bytes if it belongs to `set`.
pub fn chunk_data(fields: &Map<String, Value>, set: &str) -> Option<Vec<u8>> {
    let belongs = fields.get(CHUNK_SET_FIELD).and_then(|v| v.get("stringValue")).and_then(Value::as_str) == Some(set);
    let data = fields.get(CHUNK_DATA_FIELD).and_then(|v| v.get("bytesValue")).and_then(Value::as_str)?;
    if belongs {
        BASE64.decode(data).ok()
    } else {
        None
    }
}

fn corrupt(id: &str, problem: &str) -> Error {
    Error::new(ErrorKind::Corrupt, format!("Firestore document {id:?} {problem}"))
}

fn string_value(text: &str) -> Value {
    json!({ "stringValue": text })
}

/// The body as native Firestore fields, or `None` when Firestore cannot hold every part of it
/// exactly within its size limit.
pub fn native_fields(id: &str, body: &Map<String, Value>) -> Option<Map<String, Value>> {
    let names_ok = body.iter().all(|(name, value)| {
        field_name_ok(name)
            && !name.starts_with('_')
            && match name.as_str() {
                // Query fields must be strings when present.
                fields::USER_ID | fields::NAMESPACE => value.is_string(),
                _ => true,
            }
    });
    if !names_ok || document_size(id, body) > NATIVE_LIMIT_BYTES {
        return None;
    }
    body.iter().map(|(name, value)| Some((name.clone(), native_value(value, 1, false)?))).collect()
}

/// Field names Firestore refuses: empty, or `__…__`.
fn field_name_ok(name: &str) -> bool {
    let reserved = name.len() >= 4 && name.starts_with("__") && name.ends_with("__");
    !name.is_empty() && !reserved
}

/// A JSON value as a Firestore value, or `None` when Firestore cannot hold it exactly: a number
/// no int64 or double holds, an array directly inside an array, nesting past
/// [`MAX_NATIVE_DEPTH`], a refused field name.
fn native_value(value: &Value, depth: usize, in_array: bool) -> Option<Value> {
    Some(match value {
        Value::Null => json!({ "nullValue": null }),
        Value::Bool(b) => json!({ "booleanValue": b }),
        Value::Number(n) => native_number(n)?,
        Value::String(s) => string_value(s),
        // Firestore has no arrays directly inside arrays.
        Value::Array(_) if in_array || depth > MAX_NATIVE_DEPTH => return None,
        Value::Array(items) if items.is_empty() => json!({ "arrayValue": {} }),
        Value::Array(items) => {
            let values = items.iter().map(|v| native_value(v, depth + 1, true)).collect::<Option<Vec<_>>>()?;
            json!({ "arrayValue": { "values": values } })
        }
        Value::Object(_) if depth > MAX_NATIVE_DEPTH => return None,
        Value::Object(map) if map.is_empty() => json!({ "mapValue": {} }),
        Value::Object(map) => {
            let fields = map
                .iter()
                .map(|(k, v)| field_name_ok(k).then(|| Some((k.clone(), native_value(v, depth + 1, false)?)))?)
                .collect::<Option<Map<String, Value>>>()?;
            json!({ "mapValue": { "fields": fields } })
        }
    })
}

/// A number as Firestore holds it exactly: an int64, or a double whose value is the number's
/// exact decimal value. `None` when neither holds it.
fn native_number(number: &Number) -> Option<Value> {
    if let Some(i) = number.as_i64() {
        return Some(json!({ "integerValue": i.to_string() }));
    }
    let text = number.to_string();
    let double: f64 = text.parse().ok()?;
    let back = Number::from_f64(double)?;
    if crate::model::number::same_decimal_value(&text, &back.to_string()) {
        if let Some(i) = integral_i64(double) {
            // An integer written as `1e2` or `1.0`: int64 holds it, and JSON has no int/float split.
            return Some(json!({ "integerValue": i.to_string() }));
        }
        return Some(json!({ "doubleValue": back }));
    }
    None
}

fn integral_i64(double: f64) -> Option<i64> {
    // 2^63 is exactly representable, so the bounds are exact.
    let in_range =
        double.fract() == 0.0 && (-9_223_372_036_854_775_808.0..9_223_372_036_854_775_808.0).contains(&double);
    in_range.then_some(double as i64)
}

/// Firestore's document size rules: the name, each field name + 1, each value (strings and bytes
/// by length + 1, numbers 8, booleans and null 1, maps and arrays the sum of their parts), + 32.
fn document_size(id: &str, body: &Map<String, Value>) -> usize {
    fn value_size(value: &Value) -> usize {
        match value {
            Value::Null | Value::Bool(_) => 1,
            Value::Number(_) => 8,
            Value::String(s) => s.len() + 1,
            Value::Array(items) => items.iter().map(value_size).sum(),
            Value::Object(map) => map.iter().map(|(k, v)| k.len() + 1 + value_size(v)).sum(),
        }
    }
    let name = document_id(id).len() + 1 + 64;
    let id_field = ID.len() + 1 + id.len() + 1;
    name + id_field + body.iter().map(|(k, v)| k.len() + 1 + value_size(v)).sum::<usize>() + 32
}

/// A Firestore value → JSON. Types this service never writes (timestamps, bytes, references,
/// geo points) map to the nearest JSON: their text, base64, the path, `{latitude, longitude}`.
pub fn from_value(value: &Value) -> std::result::Result<Value, String> {
    let object = value.as_object().filter(|o| o.len() == 1).ok_or_else(|| format!("has a malformed value {value}"))?;
    let Some((kind, inner)) = object.iter().next() else {
        return Err(format!("has an empty value {value}"));
    };
    Ok(match kind.as_str() {
        "nullValue" => Value::Null,
        "booleanValue" => Value::Bool(inner.as_bool().ok_or("has a non-boolean booleanValue")?),
        "integerValue" => {
            let text = inner.as_str().map(str::to_owned).unwrap_or_else(|| inner.to_string());
            let i: i64 = text.parse().map_err(|_| format!("has an integerValue {text:?} that is not an int64"))?;
            Value::Number(i.into())
        }
        "doubleValue" => {
            let text = inner.as_str().map(str::to_owned).unwrap_or_else(|| inner.to_string());
            let double: f64 = text.parse().map_err(|_| format!("has a doubleValue {text:?} that is not a number"))?;
            Number::from_f64(double)
                .map(Value::Number)
                .ok_or_else(|| format!("has a doubleValue {text:?} that JSON cannot hold"))?
        }
        "stringValue" | "timestampValue" | "bytesValue" | "referenceValue" => {
            Value::String(inner.as_str().ok_or_else(|| format!("has a non-string {kind}"))?.to_owned())
        }
        "geoPointValue" => inner.clone(),
        "arrayValue" => match inner.get("values") {
            None => Value::Array(Vec::new()),
            Some(Value::Array(items)) => {
                Value::Array(items.iter().map(from_value).collect::<std::result::Result<_, _>>()?)
            }
            Some(_) => return Err("has an arrayValue whose values are not a list".into()),
        },
        "mapValue" => match inner.get("fields") {
            None => Value::Object(Map::new()),
            Some(Value::Object(fields)) => Value::Object(
                fields
                    .iter()
                    .map(|(k, v)| Ok((k.clone(), from_value(v)?)))
                    .collect::<std::result::Result<_, String>>()?,
            ),
            Some(_) => return Err("has a mapValue whose fields are not an object".into()),
        },
        other => return Err(format!("has a value of unknown type {other:?}")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn document_ids_escape_reversibly() {
        for id in ["u:ns:a2V5", "u:a/b:a2V5", "u:100%/x:a2V5", "u:%2F:a2V5", "u:ns/..:Lw=="] {
            let name = document_id(id);
            assert!(!name.contains('/'), "{name}");
            assert_eq!(composite_id(&name).as_deref(), Some(id));
        }
        assert_eq!(document_id("u:ns:a2V5"), "u:ns:a2V5");
        // Distinct ids never share a name.
        assert_ne!(document_id("u:a%2Fb:k"), document_id("u:a/b:k"));
        let long = format!("u:{}:k", "/".repeat(600));
        let name = document_id(&long);
        assert!(name.starts_with("%H") && name.len() == 66);
        assert_eq!(composite_id(&name), None);
        assert!(document_id("__x__").starts_with("%H"));
        assert!(document_id("").starts_with("%H"));
    }

    #[test]
    fn native_values_round_trip() {
        let body: Map<String, Value> = serde_json::from_str(
            r#"{"userId":"u","namespace":"n","key":"k","value":{"a":[1,2.5,"x",null,true,{"b":[]}],"c":{},
               "d":-0.0,"e":1e300,"f":9223372036854775807,"g":-9223372036854775808,"h":1e2},"accessCount":3}"#,
        )
        .unwrap();
        assert!(native_fields("u:n:aw==", &body).is_some());
        let encoded = encode("u:n:aw==", &body).unwrap();
        assert!(encoded.fields.get(FORMAT).is_none());
        let back = decode("u:n:aw==", &encoded.fields, &[]).unwrap();
        let value = &back["value"];
        assert_eq!(value["f"], json!(9223372036854775807i64));
        assert_eq!(value["h"], json!(100));
        assert_eq!(value["e"].as_f64(), Some(1e300));
        assert_eq!(back["accessCount"], json!(3));
        assert_eq!(back.keys().next().map(String::as_str), Some("userId"));
    }

    #[test]
    fn what_firestore_cannot_hold_is_encoded() {
        let cases = [
            r#"{"value":[[1]]}"#,
            r#"{"value":123456789012345678901234567890}"#,
            r#"{"value":0.1000000000000000000001}"#,
            r#"{"value":{"__x__":1}}"#,
            r#"{"value":{"":1}}"#,
            r#"{"_private":1}"#,
            r#"{"userId":5}"#,
        ];
        for case in cases {
            let body: Map<String, Value> = serde_json::from_str(case).unwrap();
            assert!(native_fields("u:n:aw==", &body).is_none(), "{case}");
            let encoded = encode("u:n:aw==", &body).unwrap();
            assert_eq!(encoded.fields[FORMAT], string_value(FORMAT_JSON_GZIP));
            let back = decode("u:n:aw==", &encoded.fields, &[]).unwrap();
            assert_eq!(serde_json::to_string(&back).unwrap(), serde_json::to_string(&body).unwrap(), "{case}");
        }
        let mut deep = json!(1);
        for _ in 0..25 {
            deep = json!({ "d": deep });
        }
        let body: Map<String, Value> = [("value".to_owned(), deep)].into_iter().collect();
        assert!(native_fields("u:n:aw==", &body).is_none());
    }

    #[test]
    fn large_bodies_are_chunked_and_reassembled() {
        // Incompressible text so the compressed body needs chunks.
        let mut state = 0x2545F4914F6CDD1Du64;
        let noise: String = (0..2_500_000)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                char::from(b'!' + (state % 90) as u8)
            })
            .collect();
        let body: Map<String, Value> =
            [("key".to_owned(), json!("k")), ("value".to_owned(), json!(noise))].into_iter().collect();
        let encoded = encode("u:n:aw==", &body).unwrap();
        assert!(!encoded.extra_chunks.is_empty());
        let (count, set) = (chunk_count(&encoded.fields), chunk_set(&encoded.fields).unwrap().to_owned());
        assert_eq!(count, encoded.extra_chunks.len());
        assert_eq!(encoded.chunk_set.as_deref(), Some(set.as_str()));
        assert_eq!(encoded.fields["key"], string_value("k"));
        let back = decode("u:n:aw==", &encoded.fields, &encoded.extra_chunks).unwrap();
        assert_eq!(back, body);
        let stored = chunk_fields(&set, &encoded.extra_chunks[0]);
        assert_eq!(chunk_data(&stored, &set).as_deref(), Some(encoded.extra_chunks[0].as_slice()));
        assert_eq!(chunk_data(&stored, "other"), None);
    }
}
