//! Document bodies on their way to CouchDB, held to the service's number model
//! ([`crate::model::number`]): a write CouchDB would store with a different number is refused,
//! never acknowledged.
//!
//! CouchDB 3.x decodes request bodies with jiffy. Integers (no fraction, no exponent) are kept
//! exactly at any size. Every other number becomes a 64-bit double, and CouchDB writes it back as
//! that double's shortest text, so a number survives only when it *is* such a shortest text
//! (`0.1`, `1E2` → `100.0`); `3.141592653589793238462643383279` would silently become
//! `3.141592653589793`, and numbers beyond the double range are refused by CouchDB with a
//! misleading `invalid UTF-8 JSON`. Both are refused here, naming the field.
//!
//! jiffy has one more trap. A number written as `<integer>e<exponent>` that its C parser cannot
//! take (a result below the normal double range, or a text longer than its buffer) is computed in
//! Erlang as `mantissa * math:pow(10, exponent)`, which rounds twice: `5e-324` becomes `0.0`
//! while `4.9406564584124654e-324`, the same double written with a fraction, is read correctly
//! (`fixtures/couchdb-3.4.3/numbers.json`). Where that computation would give another double,
//! the number is sent as its 17 significant digits with a fraction, which CouchDB parses exactly.
//!
//! pouchdb-server, which speaks CouchDB's API, keeps *every* number as a JavaScript double,
//! integers included: `12345678901234567890` comes back as `12345678901234567000`. On it
//! ([`NumberModel::JsDoubles`]) integers are held to the same rule as other numbers.

use serde_json::{Map, Number, Value};

use crate::backend::Revision;
use crate::error::{Error, Result};
use crate::model::fields;
use crate::model::number::{as_exact_double, is_integer_text};

/// How the server stores numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NumberModel {
    /// Apache CouchDB (jiffy): integers exactly, everything else as doubles.
    Jiffy,
    /// pouchdb-server: everything as JavaScript doubles.
    JsDoubles,
}

/// The body CouchDB stores: `_id`, `_rev` when updating, then our fields, with every number in a
/// form the server stores exactly. Fails with an invalid-input error naming the first number it
/// cannot store exactly.
pub(super) fn to_couch_doc(
    id: &str,
    body: &Map<String, Value>,
    rev: Option<&Revision>,
    numbers: NumberModel,
) -> Result<Value> {
    let mut doc = Map::with_capacity(body.len() + 2);
    doc.insert(fields::ID.into(), id.into());
    if let Some(rev) = rev {
        doc.insert(fields::REV.into(), rev.as_str().into());
    }
    for (name, value) in body.iter().filter(|(k, _)| *k != fields::ID && *k != fields::REV) {
        let mut value = value.clone();
        crate::model::number::try_for_each_number(&mut value, name, &mut |number, path| {
            encode_number(number, numbers).map_err(|problem| Error::invalid(&path(), problem))
        })?;
        doc.insert(name.clone(), value);
    }
    Ok(Value::Object(doc))
}

/// Leaves `number` as it is, rewrites it to a text of the same value that jiffy parses exactly,
/// or says why CouchDB cannot store it.
fn encode_number(number: &mut Number, numbers: NumberModel) -> std::result::Result<(), String> {
    let text = number.to_string();
    if is_integer_text(&text) {
        return match numbers {
            NumberModel::Jiffy => Ok(()),
            NumberModel::JsDoubles => as_exact_double(&text).map(|_| ()).map_err(|loss| {
                format!(
                    "the number {text} cannot be stored exactly by this server (pouchdb-server), which keeps every \
                     number as a 64-bit floating-point number: {loss}. Send it as a string"
                )
            }),
        };
    }
    let double = as_exact_double(&text).map_err(|loss| {
        format!(
            "the number {text} cannot be stored exactly by CouchDB, which keeps numbers with a fraction or an \
             exponent as 64-bit floating-point numbers: {loss}. Send it with at most 17 significant digits, or as a \
             string"
        )
    })?;
    if exponent_fallback_misreads(&text, double) {
        let exact = format!("{double:.16e}");
        *number = exact.parse().map_err(|_| format!("cannot re-encode the number {text}"))?;
    }
    Ok(())
}

/// Whether jiffy's Erlang fallback for `<integer>e<exponent>` texts (`mantissa * 10^exponent`
/// in doubles) would produce something other than `double`, the correctly rounded value.
/// Texts with a fraction never take that path.
fn exponent_fallback_misreads(text: &str, double: f64) -> bool {
    if text.contains('.') {
        return false;
    }
    let Some((mantissa, exponent)) = text.split_once(['e', 'E']) else {
        return false;
    };
    let (Ok(mantissa), Ok(exponent)) = (mantissa.parse::<f64>(), exponent.trim_start_matches('+').parse::<i32>())
    else {
        return true;
    };
    let computed = mantissa * 10f64.powf(f64::from(exponent));
    computed != double
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(text: &str) -> std::result::Result<String, String> {
        let mut number: Number = text.parse().map_err(|e| format!("{e}"))?;
        encode_number(&mut number, NumberModel::Jiffy)?;
        Ok(number.to_string())
    }

    #[test]
    fn on_pouchdb_server_integers_beyond_doubles_are_refused() {
        let encoded_js = |text: &str| {
            let mut number: Number = text.parse().map_err(|e| format!("{e}"))?;
            encode_number(&mut number, NumberModel::JsDoubles).map(|()| number.to_string())
        };
        for text in ["9007199254740993", "12345678901234567890", "-99999999999999999999999999999999999999"] {
            let refused = encoded_js(text).unwrap_err();
            assert!(refused.contains(text) && refused.contains("pouchdb-server"), "{refused}");
        }
        for text in ["0", "-17", "9007199254740992", "100000000000000000000", "0.1"] {
            assert_eq!(encoded_js(text).as_deref(), Ok(text));
        }
    }

    #[test]
    fn integers_of_any_size_pass_unchanged() {
        for text in ["0", "-0", "9007199254740993", "-99999999999999999999999999999999999999"] {
            assert_eq!(encoded(text).as_deref(), Ok(text));
        }
    }

    #[test]
    fn shortest_doubles_pass_and_the_subnormal_trap_is_avoided() {
        for text in ["0.1", "1E2", "1e+2", "1e-07", "1e308", "1e-310", "1e-320", "1.50"] {
            // Unchanged from what serde_json holds (it spells exponents `e+2` itself).
            let held: Number = text.parse().unwrap();
            assert_eq!(encoded(text), Ok(held.to_string()), "{text}");
        }
        assert_eq!(encoded("5e-324").as_deref(), Ok("4.9406564584124654e-324"));
    }

    #[test]
    fn numbers_a_double_would_change_are_refused_with_the_path() {
        for text in ["3.141592653589793238462643383279", "9007199254740993.0", "1e400", "1e-400", "3e-324"] {
            assert!(encoded(text).is_err(), "{text}");
        }
        let body: Map<String, Value> =
            serde_json::from_str(r#"{"value": {"pi": [3.141592653589793238462643383279]}}"#).unwrap();
        let err = to_couch_doc("u:n:a2V5", &body, None, NumberModel::Jiffy).unwrap_err();
        assert_eq!(err.kind(), crate::error::ErrorKind::InvalidInput);
        assert!(err.to_string().starts_with("invalid value.pi[0]: the number 3.14159265358979323846"), "{err}");
    }
}
