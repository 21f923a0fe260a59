//! Byte strings that sort as CouchDB collates JSON, so an index keeps its rows in a plain ordered
//! table and answers a key range with one range scan.
//!
//! [`encode`] writes a self-delimiting encoding of a value: comparing two encodings byte by byte
//! gives [`crate::views::collation::compare`]'s order, and no encoding is a prefix of another's
//! different value, so a row key can be the key's encoding followed by the document id.
//!
//! - Each value starts with a tag in CouchDB's type order (`null < false < true < numbers <
//!   strings < arrays < objects`); arrays and objects end with [`END`], below every tag, so a
//!   shorter list sorts first.
//! - Numbers are IEEE-754 doubles made order-preserving (sign bit flipped, negatives inverted):
//!   CouchDB's view keys come from JavaScript, where every number is a double. Two integers beyond
//!   2^53 that round to the same double therefore tie here (the document id then orders them).
//! - Strings are their ICU sort key (the collator [`crate::views::collation`] compares with),
//!   with zero bytes escaped and a terminator, so a string is never a prefix of a longer one.
//!   Object member names are encoded as strings.
//!
//! Sort keys depend on the Unicode/CLDR data compiled into `icu_collator`; an index records
//! [`FORMAT`] and is rebuilt when it changes (a dependency update that changes the data must bump
//! it).

use serde_json::Value;

use super::collation::write_string_sort_key;

/// The encoding's version, kept with every index built with it.
pub const FORMAT: &str = "json-sort-key/1 icu_collator-2.4";

/// Ends an array or an object; sorts before every tag.
pub const END: u8 = 0x00;
const NULL: u8 = 0x10;
const FALSE: u8 = 0x20;
const TRUE: u8 = 0x30;
const NUMBER: u8 = 0x40;
const STRING: u8 = 0x50;
const ARRAY: u8 = 0x60;
const OBJECT: u8 = 0x70;

/// Sorts after every byte an encoding or an escaped id can continue with: a range's upper bound
/// that takes in every row whose key equals a given key.
pub const AFTER_ALL: u8 = 0xFF;

/// The encoding of `value` as a new byte string.
pub fn encode(value: &Value) -> Vec<u8> {
    let mut out = Vec::with_capacity(16);
    encode_into(value, &mut out);
    out
}

/// Appends the encoding of `value` to `out`.
pub fn encode_into(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Null => out.push(NULL),
        Value::Bool(false) => out.push(FALSE),
        Value::Bool(true) => out.push(TRUE),
        Value::Number(number) => {
            out.push(NUMBER);
            out.extend_from_slice(&ordered_double(number_as_double(number)));
        }
        Value::String(text) => encode_string(text, out),
        Value::Array(items) => {
            out.push(ARRAY);
            for item in items {
                encode_into(item, out);
            }
            out.push(END);
        }
        Value::Object(members) => {
            out.push(OBJECT);
            for (name, member) in members {
                encode_string(name, out);
                encode_into(member, out);
            }
            out.push(END);
        }
    }
}

fn encode_string(text: &str, out: &mut Vec<u8>) {
    out.push(STRING);
    let mut key = Vec::with_capacity(text.len() * 2 + 4);
    write_string_sort_key(text, &mut key);
    escape_into(&key, out);
}

/// Appends `bytes` with every zero byte written as `00 FF`, then the terminator `00 01`: the
/// result sorts as `bytes` do and never is a prefix of another escaped string's result.
pub fn escape_into(bytes: &[u8], out: &mut Vec<u8>) {
    for &byte in bytes {
        out.push(byte);
        if byte == 0 {
            out.push(0xFF);
        }
    }
    out.extend_from_slice(&[0x00, 0x01]);
}

/// The value of a JSON number as JavaScript would read it (`-0` is `0`).
pub fn number_as_double(number: &serde_json::Number) -> f64 {
    let value = number.as_f64().unwrap_or_else(|| number.to_string().parse::<f64>().unwrap_or(0.0));
    if value == 0.0 {
        0.0
    } else {
        value
    }
}

/// Big-endian bytes of `value` that compare as the numbers do (NaN cannot come from JSON).
fn ordered_double(value: f64) -> [u8; 8] {
    let bits = value.to_bits();
    let ordered = if bits >> 63 == 1 { !bits } else { bits | (1 << 63) };
    ordered.to_be_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::views::collation::compare;
    use serde_json::json;
    use std::cmp::Ordering;

    /// Values covering every type, nesting, and strings where bytes and collation disagree.
    fn corpus() -> Vec<Value> {
        let mut values = vec![
            json!(null),
            json!(false),
            json!(true),
            json!(-1e300),
            json!(-2),
            json!(-1.5),
            json!(0),
            json!(1),
            json!(1.25),
            json!(2),
            json!(10),
            json!(1e300),
            json!(""),
            json!("\u{0000}"),
            json!("\u{0000}a"),
            json!("a"),
            json!("A"),
            json!("aa"),
            json!("ab"),
            json!("B"),
            json!("b"),
            json!("é"),
            json!("e"),
            json!("f"),
            json!("~"),
            json!("日本"),
            json!("note-002"),
            json!("note-010"),
            json!([]),
            json!([null]),
            json!([1]),
            json!([1, 2]),
            json!([1, "a"]),
            json!([2]),
            json!(["a"]),
            json!([[]]),
            json!([{}]),
            json!({}),
            json!({"a": 1}),
            json!({"a": 1, "b": 0}),
            json!({"a": 2}),
            json!({"b": 1}),
            json!({"": null}),
            json!({"a": [1, {"x": "y"}]}),
        ];
        values.push(json!(values.clone()));
        values
    }

    #[test]
    fn encodings_sort_as_collation_compares() {
        let values = corpus();
        for a in &values {
            for b in &values {
                assert_eq!(encode(a).cmp(&encode(b)), compare(a, b), "{a} vs {b}");
            }
        }
    }

    #[test]
    fn an_encoding_is_never_a_prefix_of_a_different_value() {
        let values = corpus();
        for a in &values {
            for b in &values {
                let (ea, eb) = (encode(a), encode(b));
                if compare(a, b) != Ordering::Equal {
                    assert!(!eb.starts_with(&ea), "{a} is a prefix of {b}");
                }
            }
        }
    }

    #[test]
    fn an_id_after_the_key_breaks_ties_and_after_all_bounds_them() {
        let mut first = encode(&json!("k"));
        escape_into(b"doc-a", &mut first);
        let mut second = encode(&json!("k"));
        escape_into(b"doc-b", &mut second);
        let mut bound = encode(&json!("k"));
        bound.push(AFTER_ALL);
        assert!(first < second && second < bound);
        assert!(bound < encode(&json!("l")));
        assert!(encode(&json!("k")) < first);
    }

    #[test]
    fn numbers_read_as_javascript_reads_them() {
        assert_eq!(encode(&json!(-0.0)), encode(&json!(0)));
        assert_eq!(encode(&serde_json::from_str::<Value>("1.0").unwrap()), encode(&json!(1)));
    }
}
