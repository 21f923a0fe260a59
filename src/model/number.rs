//! The service's number model: a JSON number is kept by its **exact decimal value**.
//!
//! Backends may rewrite a number's text (`1e-07` comes back as `1E-7` from DynamoDB, `1.0E-7`
//! from Firestore, `100.0` for `1E2` from CouchDB) without changing its value; what must never
//! change is the value, so comparisons go through [`decimal`]. A backend that cannot hold some
//! value exactly refuses the write instead of storing another number: see [`as_exact_double`]
//! (used by the CouchDB adapter, which stores every non-integer as an IEEE double) and
//! `docs/numbers.md` for what each backend stores.

use std::fmt;

use serde_json::Value;

/// A number's exact decimal value as (negative, significant digits without leading or trailing
/// zeros, power of ten of the last digit); zero is `(false, "0", 0)`. `None` for text that is not
/// a JSON number.
pub fn decimal(text: &str) -> Option<(bool, String, i64)> {
    let (negative, unsigned) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, mut exponent) = match unsigned.find(['e', 'E']) {
        Some(at) => (&unsigned[..at], unsigned[at + 1..].trim_start_matches('+').parse::<i64>().ok()?),
        None => (unsigned, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if int.is_empty() || !int.bytes().chain(frac.bytes()).all(|b| b.is_ascii_digit()) {
        return None;
    }
    exponent = exponent.checked_sub(i64::try_from(frac.len()).ok()?)?;
    let digits = format!("{int}{frac}");
    let significant = digits.trim_start_matches('0');
    let trimmed = significant.trim_end_matches('0');
    if trimmed.is_empty() {
        return Some((false, "0".into(), 0));
    }
    exponent = exponent.checked_add(i64::try_from(significant.len() - trimmed.len()).ok()?)?;
    Some((negative, trimmed.to_owned(), exponent))
}

/// Whether two number texts have the same exact decimal value.
pub fn same_decimal_value(a: &str, b: &str) -> bool {
    match (decimal(a), decimal(b)) {
        (Some(x), Some(y)) => x == y,
        _ => false,
    }
}

/// Why a number text cannot be stored as an IEEE double without changing its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DoubleLoss {
    /// Beyond the largest finite double (±1.7976931348623157e308).
    OutOfRange,
    /// The nearest double is a different number; `stored_as` is that double's shortest text.
    Rounded { stored_as: String },
}

impl fmt::Display for DoubleLoss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DoubleLoss::OutOfRange => f.write_str("it is beyond the range of a 64-bit floating-point number"),
            DoubleLoss::Rounded { stored_as } => {
                write!(f, "the nearest 64-bit floating-point number is {stored_as}, a different value")
            }
        }
    }
}

/// Whether a number text has a fraction or an exponent (`1.5`, `1e3`), as opposed to an integer
/// (`-42`). JSON parsers such as CouchDB's keep integers exact at any size and turn the others
/// into doubles.
pub fn is_integer_text(text: &str) -> bool {
    !text.contains(['.', 'e', 'E'])
}

/// The double a number text denotes, when that double has exactly the text's decimal value as
/// its shortest representation, which is what a store of doubles writes back. `0.1` and `1E2`
/// qualify (they read back as `0.1` and `100.0`); `0.10000000000000000555` does not (it reads
/// back as `0.1`), nor does `1e400` (no finite double).
pub fn as_exact_double(text: &str) -> Result<f64, DoubleLoss> {
    let double: f64 = text.parse().map_err(|_| DoubleLoss::OutOfRange)?;
    if !double.is_finite() {
        return Err(DoubleLoss::OutOfRange);
    }
    // `{:e}` prints the shortest digits that read back as the same double.
    let shortest = format!("{double:e}");
    if same_decimal_value(&shortest, text) {
        Ok(double)
    } else {
        Err(DoubleLoss::Rounded { stored_as: shortest })
    }
}

/// Whether a number text is beyond what a 64-bit double holds: not an integer (a JSON parser
/// such as CouchDB's keeps integers exactly at any size), and its nearest double is infinite
/// (`1e400`, `-1e309`, `1.7976931348623159e308`). Tiny numbers (`1e-400`) round to zero, not
/// beyond.
pub fn is_beyond_doubles(text: &str) -> bool {
    !is_integer_text(text) && !text.parse::<f64>().is_ok_and(f64::is_finite)
}

/// The first number in `value` that [`is_beyond_doubles`], as its text; searched without
/// recursion, each number looked at in the text the tree holds (not written out: this runs on
/// every write of most databases, over every number of the request).
pub fn first_beyond_doubles(value: &Value) -> Option<String> {
    let mut pending = vec![value];
    while let Some(value) = pending.pop() {
        match value {
            Value::Number(number) if is_beyond_doubles(number.as_str()) => return Some(number.to_string()),
            Value::Array(items) => pending.extend(items.iter()),
            Value::Object(fields) => pending.extend(fields.values()),
            Value::Null | Value::Bool(_) | Value::Number(_) | Value::String(_) => {}
        }
    }
    None
}

/// Calls `visit` on every number in `value` with its path (`value.items[3].price`, rooted at
/// `root`), stopping at the first error. Numbers are visited mutably so a backend can rewrite a
/// number's text to a form of the same value that it parses reliably.
pub fn try_for_each_number<E>(
    value: &mut Value,
    root: &str,
    visit: &mut impl FnMut(&mut serde_json::Number, &dyn Fn() -> String) -> Result<(), E>,
) -> Result<(), E> {
    // The path is only built when it is needed (for an error), from this chain of steps.
    enum Step<'a> {
        Root(&'a str),
        Field(&'a Step<'a>, &'a str),
        Index(&'a Step<'a>, usize),
    }
    fn render(step: &Step<'_>) -> String {
        match step {
            Step::Root(name) => (*name).to_owned(),
            Step::Field(parent, name) => {
                let parent = render(parent);
                let plain = !name.is_empty() && name.chars().all(|c| c.is_alphanumeric() || c == '_' || c == '-');
                if plain {
                    format!("{parent}.{name}")
                } else {
                    format!("{parent}[{}]", Value::String((*name).to_owned()))
                }
            }
            Step::Index(parent, index) => format!("{}[{index}]", render(parent)),
        }
    }
    fn walk<E>(
        value: &mut Value,
        at: &Step<'_>,
        visit: &mut impl FnMut(&mut serde_json::Number, &dyn Fn() -> String) -> Result<(), E>,
    ) -> Result<(), E> {
        match value {
            Value::Number(number) => visit(number, &|| render(at)),
            Value::Array(items) => {
                items.iter_mut().enumerate().try_for_each(|(index, item)| walk(item, &Step::Index(at, index), visit))
            }
            Value::Object(fields) => {
                fields.iter_mut().try_for_each(|(name, item)| walk(item, &Step::Field(at, name), visit))
            }
            Value::Null | Value::Bool(_) | Value::String(_) => Ok(()),
        }
    }
    walk(value, &Step::Root(root), visit)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rows of `fixtures/couchdb-numbers-3.4.3.json` CouchDB refused are exactly the texts
    /// beyond doubles.
    #[test]
    fn numbers_beyond_doubles_are_those_couchdb_refuses() {
        let recorded: Value =
            serde_json::from_str(include_str!("../../fixtures/couchdb-numbers-3.4.3.json")).expect("the recording");
        for row in recorded["rows"].as_array().expect("rows") {
            let sent = row["sent"].as_str().expect("sent");
            let refused = row["put_status"] == 400;
            assert_eq!(is_beyond_doubles(sent), refused, "{sent}");
        }
        let doc: Value = serde_json::from_str(r#"{"a":[1,{"b":-1e400}],"c":1e-400}"#).unwrap();
        let found = first_beyond_doubles(&doc).expect("found");
        assert!(same_decimal_value(&found, "-1e400"), "{found}");
        assert_eq!(first_beyond_doubles(&serde_json::json!({"big": 1e300})), None);
    }

    #[test]
    fn equal_values_in_different_texts() {
        for (a, b) in
            [("1e-07", "1E-7"), ("1.0E-7", "0.0000001"), ("100", "1e2"), ("-0", "0"), ("0.0", "0e5"), ("1.50", "1.5")]
        {
            assert!(same_decimal_value(a, b), "{a} {b}");
        }
        for (a, b) in [("1", "-1"), ("1e2", "1e3"), ("0.1", "0.10000000000000001"), ("1", "x")] {
            assert!(!same_decimal_value(a, b), "{a} {b}");
        }
        assert_eq!(decimal("12.3400e1"), Some((false, "1234".into(), -1)));
        assert_eq!(decimal("1e"), None);
    }

    #[test]
    fn exact_doubles_are_the_shortest_texts_of_a_double() {
        for text in
            ["0.1", "3.14", "1E2", "1e+2", "1.50", "-0.0", "1e-07", "5e-324", "1.7976931348623157e+308", "1e-310"]
        {
            assert!(as_exact_double(text).is_ok(), "{text}");
        }
        assert_eq!(
            as_exact_double("3.141592653589793238462643383279"),
            Err(DoubleLoss::Rounded { stored_as: "3.141592653589793e0".into() })
        );
        assert_eq!(
            as_exact_double("9007199254740993.0"),
            Err(DoubleLoss::Rounded { stored_as: "9.007199254740992e15".into() })
        );
        assert_eq!(as_exact_double("1e-400"), Err(DoubleLoss::Rounded { stored_as: "0e0".into() }));
        assert_eq!(as_exact_double("3e-324"), Err(DoubleLoss::Rounded { stored_as: "5e-324".into() }));
        assert_eq!(as_exact_double("1e309"), Err(DoubleLoss::OutOfRange));
        assert_eq!(as_exact_double("-1.7976931348623159e+308"), Err(DoubleLoss::OutOfRange));
        assert!(is_integer_text("-12345678901234567890123456789"));
        assert!(!is_integer_text("1e2") && !is_integer_text("1.0"));
    }

    #[test]
    fn numbers_are_visited_with_their_paths() {
        let mut value: Value = serde_json::from_str(r#"{"a": [1, {"b c": 2.5}], "d": {"e": 3}}"#).unwrap();
        let mut seen = Vec::new();
        try_for_each_number::<()>(&mut value, "value", &mut |number, path| {
            seen.push(format!("{}={number}", path()));
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, ["value.a[0]=1", "value.a[1][\"b c\"]=2.5", "value.d.e=3"]);
    }
}
