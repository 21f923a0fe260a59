//! Whether a document matches a normalized selector, with CouchDB's semantics
//! (`mango_selector:match`): a missing field fails every condition except `$exists: false`; a
//! path through an array takes a numeric segment as an index; `_id` compares in Erlang's term
//! order (bytes for strings), every other field in CouchDB's collation.

use std::cmp::Ordering;

use serde_json::{Map, Value};

use super::selector::{Cond, Selector};
use crate::views::collation::{compare, compare_raw};

/// What a path leads to inside a document.
enum Lookup<'a> {
    Found(&'a Value),
    NotFound,
    /// A segment was applied to a scalar, or a non-index to an array.
    BadPath,
}

type Comparator = fn(&Value, &Value) -> Ordering;

/// Whether the document (its `_id`, `_rev` and body fields in one object) matches.
pub fn matches(selector: &Selector, document: &Map<String, Value>) -> bool {
    // Borrowing the map as a value would need a clone; wrap the lookups instead.
    matches_in(selector, Root::Object(document))
}

/// The value at `path` in a document, as a selector sees it (`None`: missing, or a path through
/// a scalar); what a JSON index reads for each of its columns (`mango_native_proc`).
pub fn field_value<'a>(document: &'a Map<String, Value>, path: &[String]) -> Option<&'a Value> {
    match lookup(Root::Object(document), path) {
        Lookup::Found(value) => Some(value),
        Lookup::NotFound | Lookup::BadPath => None,
    }
}

/// The value a selector is evaluated against: a whole document or an element inside one.
#[derive(Clone, Copy)]
enum Root<'a> {
    Object(&'a Map<String, Value>),
    Value(&'a Value),
}

fn matches_in(selector: &Selector, root: Root<'_>) -> bool {
    match selector {
        Selector::MatchAll => true,
        Selector::And(arms) => arms.iter().all(|arm| matches_in(arm, root)),
        Selector::Or(arms) => arms.is_empty() || arms.iter().any(|arm| matches_in(arm, root)),
        Selector::Nor(arms) => !arms.iter().any(|arm| matches_in(arm, root)),
        Selector::Not(inner) => !matches_in(inner, root),
        Selector::Field { path, cond } => {
            let comparator: Comparator = if path.len() == 1 && path[0] == "_id" { compare_raw } else { compare };
            match lookup(root, path) {
                Lookup::Found(value) => condition_holds(cond, value, comparator),
                Lookup::NotFound => matches!(cond, Cond::Exists(false)),
                Lookup::BadPath => false,
            }
        }
    }
}

/// The value at `path` (CouchDB's `mango_doc:get_field`).
fn lookup<'a>(root: Root<'a>, path: &[String]) -> Lookup<'a> {
    let (mut current, rest) = match root {
        Root::Value(value) => (value, path),
        Root::Object(map) => match path.split_first() {
            // The whole document as a value is only reachable with an empty path, which the
            // parser refuses at the top level.
            None => return Lookup::BadPath,
            Some((first, rest)) => match map.get(first) {
                Some(value) => (value, rest),
                None => return Lookup::NotFound,
            },
        },
    };
    for segment in rest {
        current = match current {
            Value::Object(map) => match map.get(segment) {
                Some(value) => value,
                None => return Lookup::NotFound,
            },
            Value::Array(items) => match segment.parse::<usize>().ok().and_then(|i| items.get(i)) {
                Some(value) => value,
                None => return Lookup::BadPath,
            },
            _ => return Lookup::BadPath,
        };
    }
    Lookup::Found(current)
}

/// Whether a condition holds for a present value.
fn condition_holds(cond: &Cond, value: &Value, cmp: Comparator) -> bool {
    let equal = |a: &Value, b: &Value| cmp(a, b) == Ordering::Equal;
    match cond {
        Cond::Eq(arg) => equal(value, arg),
        Cond::Ne(arg) => !equal(value, arg),
        Cond::Lt(arg) => cmp(value, arg) == Ordering::Less,
        Cond::Lte(arg) => cmp(value, arg) != Ordering::Greater,
        Cond::Gt(arg) => cmp(value, arg) == Ordering::Greater,
        Cond::Gte(arg) => cmp(value, arg) != Ordering::Less,
        Cond::Exists(should) => *should,
        Cond::Type(name) => type_name(value) == name,
        Cond::In(args) => is_in(args, value, &equal),
        Cond::Nin(args) => args.is_empty() || !is_in(args, value, &equal),
        Cond::Size(n) => value.as_array().is_some_and(|items| items.len() as u64 == *n),
        Cond::Mod { divisor, remainder } => {
            integer_of(value).is_some_and(|v| v % i128::from(*divisor) == i128::from(*remainder))
        }
        Cond::Regex(regex) => value.as_str().is_some_and(|s| regex.is_match(s)),
        Cond::BeginsWith(prefix) => value.as_str().is_some_and(|s| s.starts_with(prefix.as_str())),
        Cond::All(args) => all_of(args, value),
        Cond::ElemMatch(inner) => {
            value.as_array().is_some_and(|items| items.iter().any(|item| matches_in(inner, Root::Value(item))))
        }
        Cond::AllMatch(inner) => value
            .as_array()
            .is_some_and(|items| !items.is_empty() && items.iter().all(|item| matches_in(inner, Root::Value(item)))),
        Cond::KeyMapMatch(inner) => value
            .as_object()
            .is_some_and(|map| map.keys().any(|key| matches_in(inner, Root::Value(&Value::String(key.clone()))))),
        Cond::Not(inner) => !condition_holds(inner, value, cmp),
    }
}

/// `$in`: an array field matches when any element equals any argument.
fn is_in(args: &[Value], value: &Value, equal: &dyn Fn(&Value, &Value) -> bool) -> bool {
    match value {
        Value::Array(items) => args.iter().any(|arg| items.iter().any(|item| equal(item, arg))),
        _ => args.iter().any(|arg| equal(value, arg)),
    }
}

/// `$all`: the array holds every argument (exact equality, as Erlang's `lists:member`), or the
/// single argument is itself that array.
fn all_of(args: &[Value], value: &Value) -> bool {
    let Value::Array(items) = value else { return false };
    if args.is_empty() {
        return false;
    }
    let has_all = args.iter().all(|arg| items.contains(arg));
    let is_the_array = matches!(args, [Value::Array(only)] if only == items);
    has_all || is_the_array
}

/// The value as an integer, when its JSON text is one (`1.0` decodes to a float in CouchDB, so
/// it is not).
fn integer_of(value: &Value) -> Option<i128> {
    let Value::Number(n) = value else { return None };
    n.to_string().parse::<i128>().ok()
}

/// CouchDB's `$type` names.
fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

#[cfg(test)]
mod tests {
    use super::super::selector::parse;
    use super::*;
    use serde_json::json;

    fn check(selector: Value, document: Value) -> bool {
        let selector = parse(selector.as_object().unwrap()).unwrap();
        matches(&selector, document.as_object().unwrap())
    }

    fn doc() -> Value {
        json!({
            "_id": "user_1:notes:a2V5", "_rev": "1-abc", "userId": "user_1", "namespace": "notes",
            "key": "note-007", "n": 7, "f": 2.5, "tags": ["red", "blue"], "empty": [],
            "meta": {"size": 3, "a.b": "dotted", "list": [{"x": 1}, {"x": 5}]}, "nil": null, "yes": true
        })
    }

    #[test]
    fn eq_ne_and_implicit_forms() {
        assert!(check(json!({"userId": "user_1", "namespace": "notes"}), doc()));
        assert!(!check(json!({"userId": "user_2"}), doc()));
        assert!(check(json!({"n": {"$eq": 7.0}}), doc()));
        assert!(check(json!({"n": {"$ne": 8}}), doc()));
        assert!(!check(json!({"missing": {"$ne": 8}}), doc()), "a missing field fails $ne");
        assert!(check(json!({"tags": ["red", "blue"]}), doc()));
        assert!(check(json!({"nil": null}), doc()));
    }

    #[test]
    fn ordering_operators_use_collation() {
        assert!(check(json!({"n": {"$gt": 6, "$lte": 7}}), doc()));
        assert!(!check(json!({"n": {"$lt": 7}}), doc()));
        assert!(check(json!({"f": {"$gte": 2.5}}), doc()));
        assert!(check(json!({"key": {"$gt": "Note-006"}}), doc()), "case is a tertiary difference");
        assert!(check(json!({"n": {"$lt": "0"}}), doc()), "numbers sort before strings");
        assert!(check(json!({"yes": {"$gt": false}}), doc()));
    }

    #[test]
    fn id_conditions_compare_bytes() {
        // In UCA "t" sorts before "U"; by bytes "U" (0x55) is before "t" (0x74).
        assert!(check(json!({"_id": {"$gt": "U"}}), json!({"_id": "t"})));
        assert!(!check(json!({"key": {"$gt": "U"}}), json!({"key": "t"})));
        assert!(!check(json!({"_id": {"$lt": "U"}}), doc()));
    }

    #[test]
    fn exists_type_size_mod() {
        assert!(check(json!({"n": {"$exists": true}}), doc()));
        assert!(check(json!({"missing": {"$exists": false}}), doc()));
        assert!(!check(json!({"n": {"$exists": false}}), doc()));
        assert!(check(
            json!({"meta": {"$type": "object"}, "tags": {"$type": "array"}, "nil": {"$type": "null"}}),
            doc()
        ));
        assert!(!check(json!({"n": {"$type": "string"}}), doc()));
        assert!(check(json!({"tags": {"$size": 2}, "empty": {"$size": 0}}), doc()));
        assert!(check(json!({"n": {"$mod": [4, 3]}}), doc()));
        assert!(!check(json!({"f": {"$mod": [2, 0]}}), doc()), "$mod needs an integer");
        assert!(check(json!({"x": {"$mod": [4, -3]}}), json!({"x": -7})), "remainder keeps the dividend's sign");
    }

    #[test]
    fn in_nin_all() {
        assert!(check(json!({"n": {"$in": [1, 7]}}), doc()));
        assert!(check(json!({"tags": {"$in": ["blue", "green"]}}), doc()));
        assert!(!check(json!({"n": {"$in": []}}), doc()));
        assert!(check(json!({"n": {"$nin": [1, 2]}}), doc()));
        assert!(!check(json!({"tags": {"$nin": ["red"]}}), doc()));
        assert!(check(json!({"tags": {"$all": ["blue", "red"]}}), doc()));
        assert!(!check(json!({"tags": {"$all": ["blue", "green"]}}), doc()));
        assert!(check(json!({"tags": {"$all": [["red", "blue"]]}}), doc()));
        assert!(!check(json!({"tags": {"$all": []}}), doc()));
    }

    #[test]
    fn regex_and_begins_with() {
        assert!(check(json!({"key": {"$regex": "^note-0+7$"}}), doc()));
        assert!(!check(json!({"n": {"$regex": "7"}}), doc()), "$regex needs a string");
        assert!(check(json!({"key": {"$beginsWith": "note-"}}), doc()));
        assert!(!check(json!({"key": {"$beginsWith": "Note"}}), doc()));
        assert!(check(json!({"key": {"$not": {"$regex": "^x"}}}), doc()));
        assert!(!check(json!({"missing": {"$not": {"$regex": "^x"}}}), doc()), "a missing field fails a negated regex");
    }

    #[test]
    fn regex_matches_bytes_with_ascii_classes_as_couchdb() {
        // Expected answers: issue 22 §2c item 2, measured on a real CouchDB 3.4.3, whose
        // mango_selector.erl compiles the pattern with `re:compile(Regex)` (no unicode flag) and
        // runs it on the string's UTF-8 bytes.
        let text = |s: &str| json!({ "t": s });
        // `e` + U+0301 is three bytes; 日本語 is nine.
        assert!(check(json!({"t": {"$regex": "^.{3}$"}}), text("e\u{301}")));
        assert!(!check(json!({"t": {"$regex": "^.{3}$"}}), text("日本語")));
        assert!(check(json!({"t": {"$regex": "^.{9}$"}}), text("日本語")));
        // Case folding is ASCII only: É and é differ in a non-ASCII byte.
        assert!(!check(json!({"t": {"$regex": "(?i)^éclair$"}}), text("Éclair")));
        assert!(check(json!({"t": {"$regex": "(?i)^ÉCLAIR$"}}), text("Éclair")));
        assert!(check(json!({"t": {"$regex": "(?i)^éclair$"}}), text("éCLAIR")));
        // `\w` is ASCII letters, digits and `_`.
        assert!(check(json!({"t": {"$regex": "^\\w+$"}}), text("abc_123")));
        assert!(!check(json!({"t": {"$regex": "^\\w+$"}}), text("naïve")));
        // A class with a non-ASCII character is a class of its bytes; a quantifier after one
        // repeats its last byte.
        assert!(check(json!({"t": {"$regex": "^[é]{2}$"}}), text("é")));
        assert!(!check(json!({"t": {"$regex": "^é{2}$"}}), text("éé")));
    }

    #[test]
    fn element_and_key_matches() {
        assert!(check(json!({"tags": {"$elemMatch": {"$eq": "blue"}}}), doc()));
        assert!(check(json!({"meta.list": {"$elemMatch": {"x": {"$gt": 4}}}}), doc()));
        assert!(!check(json!({"meta.list": {"$allMatch": {"x": {"$gt": 4}}}}), doc()));
        assert!(check(json!({"meta.list": {"$allMatch": {"x": {"$gt": 0}}}}), doc()));
        assert!(!check(json!({"empty": {"$allMatch": {"$gt": 0}}}), doc()), "$allMatch needs a non-empty array");
        assert!(check(json!({"meta": {"$keyMapMatch": {"$eq": "size"}}}), doc()));
        assert!(!check(json!({"meta": {"$keyMapMatch": {"$eq": "nope"}}}), doc()));
        // mango_selector.erl (3.4.3) `norm_ops`: an empty argument is the bare value `{}`, so the
        // elements must equal `{}`.
        assert!(!check(json!({"tags": {"$elemMatch": {}}}), doc()));
        assert!(check(json!({"x": {"$elemMatch": {}}}), json!({"x": [1, {}]})));
        assert!(!check(json!({"x": {"$allMatch": {}}}), json!({"x": [1, {}]})));
    }

    #[test]
    fn paths_nested_dotted_escaped_and_indexed() {
        assert!(check(json!({"meta": {"size": 3}}), doc()));
        assert!(check(json!({"meta.size": 3}), doc()));
        assert!(check(json!({"meta.a\\.b": "dotted"}), doc()));
        assert!(check(json!({"tags.1": "blue"}), doc()));
        assert!(check(json!({"meta.list.1.x": 5}), doc()));
        assert!(!check(json!({"n.x": {"$exists": false}}), doc()), "a path through a scalar is a bad path");
    }

    #[test]
    fn combinations() {
        assert!(check(json!({"$or": [{"n": 1}, {"key": "note-007"}]}), doc()));
        assert!(check(json!({"$and": [{"n": 7}, {"f": 2.5}]}), doc()));
        assert!(!check(json!({"$nor": [{"n": 1}, {"key": "note-007"}]}), doc()));
        assert!(check(json!({"$not": {"n": 1}}), doc()));
        assert!(!check(json!({"$not": {"n": 7}}), doc()));
        assert!(check(json!({"$or": []}), doc()), "an empty $or matches, as in CouchDB");
        assert!(!check(json!({"$not": {}}), doc()));
        assert!(check(json!({}), doc()));
    }
}
