//! JSON equality where numbers compare by exact decimal value (`1e-07` equals `1E-7` equals
//! `0.0000001`), as the corpus requires, and objects compare regardless of key order.

use serde_json::{Number, Value};

/// A number as (negative, significant digits without leading/trailing zeros, exponent).
fn canonical(number: &Number) -> (bool, String, i64) {
    let text = number.to_string();
    let (negative, unsigned) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text.as_str()),
    };
    let (mantissa, mut exponent) = match unsigned.find(['e', 'E']) {
        Some(at) => (&unsigned[..at], unsigned[at + 1..].trim_start_matches('+').parse::<i64>().expect("exponent")),
        None => (unsigned, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    exponent -= frac.len() as i64;
    let digits = format!("{int}{frac}");
    let digits = digits.trim_start_matches('0');
    let trimmed = digits.trim_end_matches('0');
    exponent += (digits.len() - trimmed.len()) as i64;
    if trimmed.is_empty() {
        return (false, "0".into(), 0);
    }
    (negative, trimmed.to_owned(), exponent)
}

/// Whether two JSON values are equal, numbers by exact decimal value.
pub fn exact_eq(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => canonical(x) == canonical(y),
        (Value::Array(x), Value::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(a, b)| exact_eq(a, b)),
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| exact_eq(v, w)))
        }
        _ => a == b,
    }
}

/// A short description of where two values first differ, for assertion messages.
pub fn first_difference(a: &Value, b: &Value) -> Option<String> {
    fn walk(path: &str, a: &Value, b: &Value) -> Option<String> {
        match (a, b) {
            (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
                x.iter().zip(y).enumerate().find_map(|(i, (a, b))| walk(&format!("{path}[{i}]"), a, b))
            }
            (Value::Object(x), Value::Object(y)) if x.len() == y.len() => x.iter().find_map(|(k, v)| match y.get(k) {
                Some(w) => walk(&format!("{path}.{k:?}"), v, w),
                None => Some(format!("{path}: key {k:?} missing")),
            }),
            _ if exact_eq(a, b) => None,
            _ => {
                let show = |v: &Value| {
                    let text = v.to_string();
                    if text.len() > 120 {
                        format!("{}… ({} bytes)", text.chars().take(120).collect::<String>(), text.len())
                    } else {
                        text
                    }
                };
                Some(format!("{path}: {} != {}", show(a), show(b)))
            }
        }
    }
    walk("$", a, b)
}

/// Whether `value` holds a number with a fraction or an exponent that an IEEE double does not
/// hold exactly: what the CouchDB adapter refuses, since CouchDB keeps such numbers as doubles
/// (integers it keeps exactly at any size).
pub fn has_non_double_fraction(value: &Value) -> bool {
    match value {
        Value::Number(n) => {
            let text = n.to_string();
            text.contains(['.', 'e', 'E']) && !survives_f64(value)
        }
        Value::Array(items) => items.iter().any(has_non_double_fraction),
        Value::Object(map) => map.values().any(has_non_double_fraction),
        _ => false,
    }
}

/// Whether every number in `value` survives a trip through an IEEE double (what a JavaScript
/// server stores).
pub fn survives_f64(value: &Value) -> bool {
    match value {
        Value::Number(n) => {
            let text = n.to_string();
            text.parse::<f64>().ok().and_then(Number::from_f64).is_some_and(|back| canonical(&back) == canonical(n))
        }
        Value::Array(items) => items.iter().all(survives_f64),
        Value::Object(map) => map.values().all(survives_f64),
        _ => true,
    }
}
