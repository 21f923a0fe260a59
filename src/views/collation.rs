//! CouchDB's JSON collation (`couch_ejson_compare`), used by `$lt`/`$gt`/`$eq`/… and `sort`:
//! `null < false < true < numbers < strings < arrays < objects`; numbers by exact value; strings
//! by the Unicode Collation Algorithm with the root locale's default (tertiary) strength, as
//! CouchDB's ICU collator (`ucol_open("")`) compares them; arrays element by element, shorter
//! first; objects by their members in order, key then value, fewer members first.
//!
//! Strings are compared with ICU4X's `icu_collator` and its compiled CLDR root data: the Unicode
//! project's own implementation of the same algorithm and data CouchDB's ICU4C uses, so no data
//! files to ship and no C library to link. Differences from a given CouchDB build can come only
//! from the Unicode/CLDR version each was built with (new characters and rare tailoring fixes).
//!
//! Numbers keep their text (serde_json's `arbitrary_precision`), so they compare by exact decimal
//! value: `1`, `1.0` and `10e-1` are equal, and integers beyond 2^53 keep their order (CouchDB
//! compares such integers exactly too, but rounds non-integers to doubles).
//!
//! [`compare_raw`] is the other order CouchDB uses, for `_id` conditions: Erlang's term order.

use std::cmp::Ordering;
use std::sync::OnceLock;

use icu_collator::options::CollatorOptions;
use icu_collator::{Collator, CollatorBorrowed};
use serde_json::{Map, Number, Value};

use crate::model::number::decimal;

/// The root-locale collator, built once (construction reads the compiled data tables).
fn collator() -> &'static CollatorBorrowed<'static> {
    static COLLATOR: OnceLock<CollatorBorrowed<'static>> = OnceLock::new();
    COLLATOR.get_or_init(|| {
        Collator::try_new(Default::default(), CollatorOptions::default())
            .expect("the root collation is part of icu_collator's compiled data")
    })
}

/// Compares two strings as CouchDB's views and Mango do.
pub fn compare_strings(a: &str, b: &str) -> Ordering {
    if a == b {
        return Ordering::Equal;
    }
    collator().compare(a, b)
}

/// Appends the string's ICU sort key (root locale, tertiary strength) to `out`: comparing two
/// sort keys byte by byte orders them as [`compare_strings`] does. It holds no zero byte.
pub fn write_string_sort_key(text: &str, out: &mut Vec<u8>) {
    let Ok(()) = collator().write_sort_key_to(text, out);
}

/// Compares two JSON values in CouchDB's collation.
pub fn compare(a: &Value, b: &Value) -> Ordering {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => compare_numbers(x, y),
        (Value::String(x), Value::String(y)) => compare_strings(x, y),
        (Value::Array(x), Value::Array(y)) => compare_lists(x, y, compare),
        (Value::Object(x), Value::Object(y)) => compare_objects(x, y),
        _ => type_rank(a).cmp(&type_rank(b)),
    }
}

/// The order of JSON types in CouchDB's collation.
fn type_rank(value: &Value) -> u8 {
    match value {
        Value::Null => 0,
        Value::Bool(false) => 1,
        Value::Bool(true) => 2,
        Value::Number(_) => 3,
        Value::String(_) => 4,
        Value::Array(_) => 5,
        Value::Object(_) => 6,
    }
}

fn compare_lists(a: &[Value], b: &[Value], element: fn(&Value, &Value) -> Ordering) -> Ordering {
    for (x, y) in a.iter().zip(b) {
        match element(x, y) {
            Ordering::Equal => continue,
            other => return other,
        }
    }
    a.len().cmp(&b.len())
}

fn compare_objects(a: &Map<String, Value>, b: &Map<String, Value>) -> Ordering {
    for ((ka, va), (kb, vb)) in a.iter().zip(b) {
        match compare_strings(ka, kb).then_with(|| compare(va, vb)) {
            Ordering::Equal => continue,
            other => return other,
        }
    }
    a.len().cmp(&b.len())
}

/// Compares two numbers by their exact decimal value.
pub fn compare_numbers(a: &Number, b: &Number) -> Ordering {
    let (a, b) = (a.to_string(), b.to_string());
    match (decimal(&a), decimal(&b)) {
        (Some(x), Some(y)) => compare_decimals(&x, &y),
        // serde_json only holds valid JSON numbers; keep a total order regardless.
        _ => a.cmp(&b),
    }
}

/// Orders `(negative, significant digits, exponent of the last digit)` triples by value.
fn compare_decimals(a: &(bool, String, i64), b: &(bool, String, i64)) -> Ordering {
    let zero = |d: &(bool, String, i64)| d.1 == "0";
    let sign = |d: &(bool, String, i64)| {
        if zero(d) {
            0
        } else if d.0 {
            -1
        } else {
            1
        }
    };
    match sign(a).cmp(&sign(b)) {
        Ordering::Equal if sign(a) == 0 => Ordering::Equal,
        Ordering::Equal => {
            let magnitude = compare_magnitudes(a, b);
            if a.0 {
                magnitude.reverse()
            } else {
                magnitude
            }
        }
        other => other,
    }
}

/// Compares the absolute values of two non-zero decimals.
fn compare_magnitudes(a: &(bool, String, i64), b: &(bool, String, i64)) -> Ordering {
    // The power of ten of the leading digit decides first.
    let lead = |d: &(bool, String, i64)| d.2.saturating_add(d.1.len() as i64);
    lead(a).cmp(&lead(b)).then_with(|| {
        // Same magnitude: compare digit strings left-aligned, missing digits being zeros.
        let width = a.1.len().max(b.1.len());
        let pad = |s: &str| format!("{s:0<width$}");
        pad(&a.1).cmp(&pad(&b.1))
    })
}

/// Erlang's term order over decoded JSON, which CouchDB uses for conditions on `_id`: numbers <
/// atoms (`false < null < true`) < objects < arrays < strings (by bytes).
pub fn compare_raw(a: &Value, b: &Value) -> Ordering {
    fn rank(value: &Value) -> u8 {
        match value {
            Value::Number(_) => 0,
            Value::Bool(false) => 1,
            Value::Null => 2,
            Value::Bool(true) => 3,
            Value::Object(_) => 4,
            Value::Array(_) => 5,
            Value::String(_) => 6,
        }
    }
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => compare_numbers(x, y),
        (Value::String(x), Value::String(y)) => x.as_bytes().cmp(y.as_bytes()),
        (Value::Array(x), Value::Array(y)) => compare_lists(x, y, compare_raw),
        (Value::Object(x), Value::Object(y)) => {
            for ((ka, va), (kb, vb)) in x.iter().zip(y) {
                match ka.as_bytes().cmp(kb.as_bytes()).then_with(|| compare_raw(va, vb)) {
                    Ordering::Equal => continue,
                    other => return other,
                }
            }
            x.len().cmp(&y.len())
        }
        _ => rank(a).cmp(&rank(b)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn num(text: &str) -> Value {
        serde_json::from_str(text).unwrap()
    }

    #[test]
    fn types_sort_in_couchdb_order() {
        let ordered = [
            json!(null),
            json!(false),
            json!(true),
            json!(-5),
            json!(3),
            json!(""),
            json!("a"),
            json!([]),
            json!([1]),
            json!({}),
            json!({"a": 1}),
        ];
        for (i, a) in ordered.iter().enumerate() {
            for (j, b) in ordered.iter().enumerate() {
                assert_eq!(compare(a, b), i.cmp(&j), "{a} vs {b}");
            }
        }
    }

    #[test]
    fn numbers_compare_by_exact_value() {
        assert_eq!(compare(&num("1"), &num("1.0")), Ordering::Equal);
        assert_eq!(compare(&num("10e-1"), &num("1")), Ordering::Equal);
        assert_eq!(compare(&num("0"), &num("-0.0")), Ordering::Equal);
        assert_eq!(compare(&num("9007199254740993"), &num("9007199254740992")), Ordering::Greater);
        assert_eq!(compare(&num("-2"), &num("-10")), Ordering::Greater);
        assert_eq!(compare(&num("0.5"), &num("0.25")), Ordering::Greater);
        assert_eq!(compare(&num("1e400"), &num("2e399")), Ordering::Greater);
        assert_eq!(compare(&num("-0.001"), &num("0")), Ordering::Less);
        assert_eq!(compare(&num("12"), &num("1.3e1")), Ordering::Less);
    }

    #[test]
    fn strings_use_unicode_collation_not_bytes() {
        // ICU root: case and accents are secondary/tertiary differences, so "a" < "B" < "c"
        // (bytes would put "B" first), lowercase before uppercase, "é" between "e" and "f".
        assert_eq!(compare_strings("a", "B"), Ordering::Less);
        assert_eq!(compare_strings("B", "c"), Ordering::Less);
        assert_eq!(compare_strings("a", "A"), Ordering::Less);
        assert_eq!(compare_strings("e", "é"), Ordering::Less);
        assert_eq!(compare_strings("é", "f"), Ordering::Less);
        assert_eq!(compare_strings("note-002", "note-010"), Ordering::Less);
        // CouchDB's documented view collation example: "a" < "aa" < "b".
        assert_eq!(compare_strings("aa", "b"), Ordering::Less);
    }

    #[test]
    fn arrays_and_objects_compare_member_by_member() {
        assert_eq!(compare(&json!([1, 2]), &json!([1, 2, 0])), Ordering::Less);
        assert_eq!(compare(&json!([2]), &json!([1, 9])), Ordering::Greater);
        assert_eq!(compare(&json!({"a": 2}), &json!({"b": 1})), Ordering::Less);
        assert_eq!(compare(&json!({"a": 1}), &json!({"a": 1, "b": 0})), Ordering::Less);
    }

    #[test]
    fn raw_order_is_erlang_term_order() {
        assert_eq!(compare_raw(&json!("B"), &json!("a")), Ordering::Less);
        assert_eq!(compare_raw(&json!(1), &json!(false)), Ordering::Less);
        assert_eq!(compare_raw(&json!(false), &json!(null)), Ordering::Less);
        assert_eq!(compare_raw(&json!([1]), &json!("")), Ordering::Less);
    }
}
