//! Exact decimal values of JSON numbers. Backends may rewrite a number's text (`1e-07` comes back
//! as `1E-7` from DynamoDB, `1.0E-7` from Firestore) without changing its value; what must never
//! change is the value, so comparisons go through [`decimal`].

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
