//! Tests of the test helpers themselves: the corpus builder and the exact JSON comparison.

use crate::common::json::{exact_eq, first_difference};
use serde_json::{json, Value};

fn num(text: &str) -> Value {
    serde_json::from_str(text).unwrap()
}

#[test]
fn numbers_compare_by_decimal_value() {
    assert!(exact_eq(&num("1e-07"), &num("1E-7")));
    assert!(exact_eq(&num("1e-07"), &num("0.0000001")));
    assert!(exact_eq(&num("100"), &num("1e2")));
    assert!(exact_eq(&num("-0"), &num("0")));
    assert!(exact_eq(&num("3.140"), &num("3.14")));
    assert!(!exact_eq(&num("9007199254740993"), &num("9007199254740992")));
    assert!(!exact_eq(&num("-1"), &num("1")));
    assert!(!exact_eq(&num("42"), &json!("42")));
}

#[test]
fn objects_ignore_order_arrays_do_not() {
    assert!(exact_eq(&json!({"a": 1, "b": 2}), &json!({"b": 2, "a": 1})));
    assert!(!exact_eq(&json!([1, 2]), &json!([2, 1])));
    assert!(!exact_eq(&json!({"a": 1}), &json!({"a": 1, "b": 2})));
    let diff = first_difference(&json!({"a": [1, 2]}), &json!({"a": [1, 3]})).unwrap();
    assert!(diff.contains("$.\"a\"[1]"), "{diff}");
}

#[test]
fn every_corpus_case_builds_and_fits_the_default_limit() {
    let cases = crate::common::corpus::cases();
    assert!(cases.len() >= 37);
    for case in &cases {
        let size = serde_json::to_vec(&case.value).unwrap().len();
        assert!(size <= 1_048_576, "{} is {size} bytes", case.name);
    }
    let size_of = |name: &str| serde_json::to_vec(&cases.iter().find(|c| c.name == name).unwrap().value).unwrap().len();
    assert!(size_of("object-1000KiB-random") > 1_000_000);
    assert!(size_of("string-900KiB-random") > 900_000);
    let deep = &cases.iter().find(|c| c.name == "depth-33").unwrap().value;
    let mut depth = 0;
    let mut at = deep;
    while let Some(inner) = at.get("d") {
        depth += 1;
        at = inner;
    }
    assert_eq!((depth, at), (33, &json!("bottom")));
}
