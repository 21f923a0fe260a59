//! A Mango selector parsed into an AST, normalized the way CouchDB 3.4 normalizes it
//! (`mango_selector:normalize`), so evaluation and `_explain` see what CouchDB would see:
//!
//! - several keys in one object are an implicit `$and`; a bare value is an implicit `$eq`;
//! - nested objects are nested fields, and `a.b` is the same path (a `\.` keeps a literal dot);
//! - `$and`/`$or`/`$not`/`$nor` under a field apply to that field;
//! - negations are pushed down (`$not $lt` becomes `$gte`, `$nor` an `$and` of negations …);
//!   a negated operator that has no opposite stays a `$not` of that operator.
//!
//! Invalid selectors give CouchDB's errors (`invalid_operator`, `bad_arg`, `not_supported`,
//! `invalid_selector`, `invalid_field_name`) with its reason texts.
//!
//! `$regex` matches as CouchDB's does (`re:compile(Pattern)` with no options, then `re:run` on the
//! string's UTF-8 bytes): PCRE without its unicode flag works on bytes, so `.` is one byte, `\w`,
//! `\d`, `\s` and `(?i)` know only ASCII. [`ByteRegex`] reproduces that with the `regex` crate's
//! byte matcher, Unicode off. It keeps linear-time matching (a selector is untrusted input, and
//! Erlang's PCRE can backtrack exponentially), so look-around and back-references are refused
//! with `bad_arg`, where CouchDB accepts them; see docs/couchdb-api.md.

use regex::bytes::{Regex, RegexBuilder};
use serde_json::{Map, Value};

use super::MangoError;

/// A normalized selector.
#[derive(Debug, Clone)]
pub enum Selector {
    /// `{}`: every document.
    MatchAll,
    And(Vec<Selector>),
    /// Any of the arms; an empty `$or` matches everything, as in CouchDB.
    Or(Vec<Selector>),
    /// Left in place only inside `$elemMatch`/`$allMatch`/`$keyMapMatch`, which CouchDB does not
    /// normalize.
    Not(Box<Selector>),
    /// Only inside `$elemMatch`/`$allMatch`/`$keyMapMatch`: none of the arms.
    Nor(Vec<Selector>),
    /// A condition on the value at `path` (an empty path is the value itself, as inside
    /// `$elemMatch`).
    Field {
        path: Vec<String>,
        cond: Cond,
    },
}

/// A condition operator and its argument.
#[derive(Debug, Clone)]
pub enum Cond {
    Eq(Value),
    Ne(Value),
    Lt(Value),
    Lte(Value),
    Gt(Value),
    Gte(Value),
    Exists(bool),
    Type(String),
    In(Vec<Value>),
    Nin(Vec<Value>),
    Size(u64),
    Mod {
        divisor: i64,
        remainder: i64,
    },
    Regex(Box<ByteRegex>),
    All(Vec<Value>),
    ElemMatch(Box<Selector>),
    AllMatch(Box<Selector>),
    KeyMapMatch(Box<Selector>),
    BeginsWith(String),
    /// A negated operator without an opposite (`$not` of `$regex`, `$size`, …).
    Not(Box<Cond>),
}

/// A `$regex` pattern compiled to match as CouchDB's PCRE matches without the unicode flag.
#[derive(Debug, Clone)]
pub struct ByteRegex {
    /// The pattern as the selector gave it (what `_explain` prints).
    pub pattern: String,
    compiled: Regex,
}

impl ByteRegex {
    /// Compiles `pattern`; `None` when it is not a pattern this server can run.
    pub fn new(pattern: &str) -> Option<Self> {
        let compiled = RegexBuilder::new(&byte_pattern(pattern)).unicode(false).build().ok()?;
        Some(ByteRegex { pattern: pattern.to_owned(), compiled })
    }

    /// Whether the pattern matches somewhere in the string's UTF-8 bytes.
    pub fn is_match(&self, subject: &str) -> bool {
        self.compiled.is_match(subject.as_bytes())
    }
}

/// The pattern with every non-ASCII character written as its UTF-8 bytes (`\xHH` each), which is
/// how PCRE without the unicode flag reads it: `é` is two literal bytes, `[é]` a class of two
/// bytes, and a quantifier after `é` repeats its last byte. A backslash before a non-ASCII
/// character escapes its first byte, a literal either way, so it is dropped.
fn byte_pattern(pattern: &str) -> String {
    let mut out = String::with_capacity(pattern.len());
    let mut escaped = false;
    for c in pattern.chars() {
        if c.is_ascii() {
            if escaped {
                out.push('\\');
            }
            escaped = !escaped && c == '\\';
            if !escaped {
                out.push(c);
            }
            continue;
        }
        escaped = false;
        let mut bytes = [0u8; 4];
        for byte in c.encode_utf8(&mut bytes).bytes() {
            out.push_str(&format!("\\x{byte:02X}"));
        }
    }
    if escaped {
        // A trailing backslash: left for the compiler to refuse, as PCRE does.
        out.push('\\');
    }
    out
}

/// Operators CouchDB names but does not support.
const UNSUPPORTED: [&str; 6] = ["$where", "$geoWithin", "$geoIntersects", "$near", "$nearSphere", "$text"];

/// Parses and normalizes a selector. `selector` must be a JSON object (the caller reports
/// CouchDB's `invalid_selector_json` otherwise).
pub fn parse(selector: &Map<String, Value>) -> Result<Selector, MangoError> {
    if selector.is_empty() {
        return Ok(Selector::MatchAll);
    }
    let parsed = parse_object(selector, &[])?;
    if let Selector::Field { path, .. } = &parsed {
        if path.is_empty() {
            return Err(MangoError::bad_request("invalid_selector", "One or more conditions is missing a field name."));
        }
    }
    Ok(normalize_negations(parsed))
}

/// Splits a field name into its path: `a.b` is `["a", "b"]`, `a\.b` is `["a.b"]`. An empty
/// segment is CouchDB's `invalid_field_name`.
pub fn parse_field(field: &str) -> Result<Vec<String>, MangoError> {
    let invalid = || MangoError::bad_request("invalid_field_name", format!("Invalid field name: {field}"));
    let mut path = Vec::new();
    let mut current = String::new();
    let mut chars = field.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'.') => {
                current.push('.');
                chars.next();
            }
            // CouchDB drops every other backslash too.
            '\\' => {}
            '.' => {
                if current.is_empty() {
                    return Err(invalid());
                }
                path.push(std::mem::take(&mut current));
            }
            c => current.push(c),
        }
    }
    if current.is_empty() {
        return Err(invalid());
    }
    path.push(current);
    Ok(path)
}

/// The field name of a path, dots escaped (the inverse of [`parse_field`]).
pub fn join_field(path: &[String]) -> String {
    path.iter().map(|p| p.replace('.', "\\.")).collect::<Vec<_>>().join(".")
}

/// One object of a selector at `path`: several keys are an implicit `$and`.
fn parse_object(object: &Map<String, Value>, path: &[String]) -> Result<Selector, MangoError> {
    if object.len() == 1 {
        let (key, value) = object.iter().next().expect("one entry");
        return parse_entry(key, value, path);
    }
    let arms = object.iter().map(|(key, value)| parse_entry(key, value, path)).collect::<Result<_, _>>()?;
    Ok(Selector::And(arms))
}

/// A value under a field: an object is parsed further, anything else is an implicit `$eq`.
fn parse_value(value: &Value, path: &[String]) -> Result<Selector, MangoError> {
    match value {
        Value::Object(object) if !object.is_empty() => parse_object(object, path),
        other => Ok(field(path, Cond::Eq(other.clone()))),
    }
}

fn field(path: &[String], cond: Cond) -> Selector {
    Selector::Field { path: path.to_vec(), cond }
}

/// One `key: value` pair: a combination operator, a condition operator, or a field name.
fn parse_entry(key: &str, value: &Value, path: &[String]) -> Result<Selector, MangoError> {
    let Some(operator) = key.strip_prefix('$').map(|_| key) else {
        let mut nested = path.to_vec();
        nested.extend(parse_field(key)?);
        return parse_value(value, &nested);
    };
    match operator {
        "$and" | "$or" | "$nor" => {
            let Value::Array(args) = value else { return Err(MangoError::bad_arg(operator, value)) };
            let arms = args.iter().map(|arg| parse_value(arg, path)).collect::<Result<Vec<_>, _>>()?;
            Ok(match operator {
                "$and" => Selector::And(arms),
                "$or" => Selector::Or(arms),
                _ => Selector::Nor(arms),
            })
        }
        "$not" => match value {
            Value::Object(_) => Ok(Selector::Not(Box::new(parse_value(value, path)?))),
            _ => Err(MangoError::bad_arg(operator, value)),
        },
        "$elemMatch" | "$allMatch" | "$keyMapMatch" => {
            let Value::Object(inner) = value else { return Err(MangoError::bad_arg(operator, value)) };
            // The argument is a selector of its own, over each element (or key), and CouchDB leaves
            // its negations as written. An empty one is a bare value to CouchDB's `norm_ops`:
            // elements equal to `{}`.
            let inner = Box::new(if inner.is_empty() {
                Selector::Field { path: Vec::new(), cond: Cond::Eq(Value::Object(Map::new())) }
            } else {
                parse_object(inner, &[])?
            });
            Ok(field(
                path,
                match operator {
                    "$elemMatch" => Cond::ElemMatch(inner),
                    "$allMatch" => Cond::AllMatch(inner),
                    _ => Cond::KeyMapMatch(inner),
                },
            ))
        }
        // CouchDB turns `$text` into a `$default` field, which may only stand at the top level:
        // under a field it is `bad_field` (mango_selector.erl `norm_fields`, issue 22 §2c item 13).
        // At the top level it needs a text index, which this server does not have.
        "$text" if !path.is_empty() && (value.is_string() || value.is_number() || value.is_boolean()) => {
            let normalized = serde_json::json!({ "$default": { "$text": value } });
            Err(MangoError::bad_request(
                "bad_field",
                format!("Invalid field normalization on selector: {}", super::erlang_term(&normalized)),
            ))
        }
        _ => Ok(field(path, parse_condition(operator, value)?)),
    }
}

/// A condition operator with its argument checked as CouchDB checks it.
fn parse_condition(operator: &str, value: &Value) -> Result<Cond, MangoError> {
    let bad = || MangoError::bad_arg(operator, value);
    Ok(match operator {
        "$eq" => Cond::Eq(value.clone()),
        "$ne" => Cond::Ne(value.clone()),
        "$lt" => Cond::Lt(value.clone()),
        "$lte" => Cond::Lte(value.clone()),
        "$gt" => Cond::Gt(value.clone()),
        "$gte" => Cond::Gte(value.clone()),
        "$exists" => Cond::Exists(value.as_bool().ok_or_else(bad)?),
        "$type" => Cond::Type(value.as_str().ok_or_else(bad)?.to_owned()),
        "$in" => Cond::In(value.as_array().ok_or_else(bad)?.clone()),
        "$nin" => Cond::Nin(value.as_array().ok_or_else(bad)?.clone()),
        "$all" => Cond::All(value.as_array().ok_or_else(bad)?.clone()),
        "$size" => Cond::Size(value.as_u64().ok_or_else(bad)?),
        "$mod" => match value.as_array().map(Vec::as_slice) {
            // A zero divisor would crash CouchDB's evaluation (a 500); it is refused here instead.
            Some([d, r]) => match (d.as_i64(), r.as_i64()) {
                (Some(divisor), Some(remainder)) if divisor != 0 => Cond::Mod { divisor, remainder },
                _ => return Err(bad()),
            },
            _ => return Err(bad()),
        },
        // CouchDB's `norm_ops` has no `bad_arg` case for a `$regex` or `$beginsWith` that is not a
        // string: it falls through to `invalid_operator` (issue 22 §2c item 13).
        "$regex" | "$beginsWith" if !value.is_string() => {
            return Err(MangoError::bad_request("invalid_operator", format!("Invalid operator: {operator}")))
        }
        "$regex" => {
            let pattern = value.as_str().ok_or_else(bad)?;
            Cond::Regex(Box::new(ByteRegex::new(pattern).ok_or_else(bad)?))
        }
        "$beginsWith" => Cond::BeginsWith(value.as_str().ok_or_else(bad)?.to_owned()),
        "$text" if !(value.is_string() || value.is_number() || value.is_boolean()) => return Err(bad()),
        op if UNSUPPORTED.contains(&op) => {
            return Err(MangoError::bad_request("not_supported", format!("Unsupported operator: {op}")))
        }
        op => return Err(MangoError::bad_request("invalid_operator", format!("Invalid operator: {op}"))),
    })
}

/// CouchDB's `norm_negations`: removes `$not` and `$nor` outside element matches.
fn normalize_negations(selector: Selector) -> Selector {
    match selector {
        Selector::Not(inner) => negate(*inner),
        Selector::Nor(arms) => Selector::And(arms.into_iter().map(negate).collect()),
        Selector::And(arms) => Selector::And(arms.into_iter().map(normalize_negations).collect()),
        Selector::Or(arms) => Selector::Or(arms.into_iter().map(normalize_negations).collect()),
        other => other,
    }
}

/// CouchDB's `negate`: the selector's opposite, pushed down to the conditions.
fn negate(selector: Selector) -> Selector {
    match selector {
        Selector::Not(inner) => normalize_negations(*inner),
        Selector::Nor(arms) => Selector::Or(arms.into_iter().map(normalize_negations).collect()),
        Selector::And(arms) => Selector::Or(arms.into_iter().map(negate).collect()),
        Selector::Or(arms) => Selector::And(arms.into_iter().map(negate).collect()),
        // `{"$not": {}}` matches nothing (an empty `$or` would match everything).
        Selector::MatchAll => Selector::Not(Box::new(Selector::MatchAll)),
        Selector::Field { path, cond } => Selector::Field { path, cond: negate_condition(cond) },
    }
}

fn negate_condition(cond: Cond) -> Cond {
    match cond {
        Cond::Lt(v) => Cond::Gte(v),
        Cond::Lte(v) => Cond::Gt(v),
        Cond::Eq(v) => Cond::Ne(v),
        Cond::Ne(v) => Cond::Eq(v),
        Cond::Gte(v) => Cond::Lt(v),
        Cond::Gt(v) => Cond::Lte(v),
        Cond::In(v) => Cond::Nin(v),
        Cond::Nin(v) => Cond::In(v),
        Cond::Exists(b) => Cond::Exists(!b),
        other => Cond::Not(Box::new(other)),
    }
}

impl Selector {
    /// The selector as CouchDB's `_explain` prints a normalized one.
    pub fn to_json(&self) -> Value {
        let list = |arms: &[Selector]| Value::Array(arms.iter().map(Selector::to_json).collect());
        match self {
            Selector::MatchAll => Value::Object(Map::new()),
            Selector::And(arms) => serde_json::json!({ "$and": list(arms) }),
            Selector::Or(arms) => serde_json::json!({ "$or": list(arms) }),
            Selector::Nor(arms) => serde_json::json!({ "$nor": list(arms) }),
            Selector::Not(inner) => serde_json::json!({ "$not": inner.to_json() }),
            Selector::Field { path, cond } => {
                let mut out = Map::new();
                out.insert(join_field(path), cond.to_json());
                Value::Object(out)
            }
        }
    }

    /// Whether the whole selector is an empty `$or` or `$and` (also written under a field, which
    /// normalizes to the same): CouchDB's `_find` returns no documents for it without looking,
    /// although the selector itself matches every document (as in a `_changes` filter).
    pub fn is_empty_combination(&self) -> bool {
        matches!(self, Selector::Or(arms) | Selector::And(arms) if arms.is_empty())
    }

    /// The value this selector requires `path` to equal whenever it matches, if any: an `$eq`
    /// on the path at the top level or in a top-level `$and` (what can narrow a scan).
    pub fn required_equal(&self, path: &[&str]) -> Option<&Value> {
        match self {
            Selector::Field { path: p, cond: Cond::Eq(value) }
                if p.iter().map(String::as_str).eq(path.iter().copied()) =>
            {
                Some(value)
            }
            Selector::And(arms) => arms.iter().find_map(|arm| arm.required_equal(path)),
            _ => None,
        }
    }

    /// CouchDB's `mango_selector:has_required_fields`: whether every matching document must have
    /// each of `required` (paths). A condition other than `$exists: false` on a field covers it,
    /// at the top level or in an `$and`; an `$or` covers what all its arms cover, so an empty
    /// `$or` covers everything.
    pub fn has_required_fields(&self, required: &[Vec<String>]) -> bool {
        fields_left_uncovered(std::slice::from_ref(self), required.to_vec()).is_empty()
    }

    /// CouchDB's `mango_idx_view:indexable_fields`: the fields with a condition an index range can
    /// serve (`$eq`, `$lt`, `$lte`, `$gt`, `$gte`, `$beginsWith`, `$exists`), seen through `$and`
    /// only; sorted.
    pub fn indexable_fields(&self) -> Vec<String> {
        let mut out = match self {
            Selector::And(arms) => arms.iter().flat_map(Selector::indexable_fields).collect(),
            Selector::Field {
                path,
                cond:
                    Cond::Eq(_)
                    | Cond::Lt(_)
                    | Cond::Lte(_)
                    | Cond::Gt(_)
                    | Cond::Gte(_)
                    | Cond::BeginsWith(_)
                    | Cond::Exists(_),
            } => vec![join_field(path)],
            _ => Vec::new(),
        };
        out.sort();
        out.dedup();
        out
    }

    /// The field names the selector's top level conditions (for `_explain`'s hints), sorted.
    pub fn field_names(&self) -> Vec<String> {
        fn collect(selector: &Selector, out: &mut Vec<String>) {
            match selector {
                Selector::Field { path, .. } => out.push(join_field(path)),
                Selector::And(arms) | Selector::Or(arms) | Selector::Nor(arms) => {
                    arms.iter().for_each(|arm| collect(arm, out))
                }
                Selector::Not(inner) => collect(inner, out),
                Selector::MatchAll => {}
            }
        }
        let mut out = Vec::new();
        collect(self, &mut out);
        out.sort();
        out.dedup();
        out
    }
}

/// `has_required_fields_int` over a list of selectors: the required paths none of them covers.
fn fields_left_uncovered(list: &[Selector], mut required: Vec<Vec<String>>) -> Vec<Vec<String>> {
    for selector in list {
        if required.is_empty() {
            break;
        }
        match selector {
            Selector::And(arms) => required = fields_left_uncovered(arms, required),
            Selector::Or(arms) => {
                let mut left: Vec<Vec<String>> = arms
                    .iter()
                    .flat_map(|arm| fields_left_uncovered(std::slice::from_ref(arm), required.clone()))
                    .collect();
                left.sort();
                left.dedup();
                required = left;
            }
            Selector::Field { path, cond } if !matches!(cond, Cond::Exists(false)) => {
                required.retain(|r| r != path);
            }
            _ => {}
        }
    }
    required
}

impl Cond {
    fn to_json(&self) -> Value {
        let (op, arg) = match self {
            Cond::Eq(v) => ("$eq", v.clone()),
            Cond::Ne(v) => ("$ne", v.clone()),
            Cond::Lt(v) => ("$lt", v.clone()),
            Cond::Lte(v) => ("$lte", v.clone()),
            Cond::Gt(v) => ("$gt", v.clone()),
            Cond::Gte(v) => ("$gte", v.clone()),
            Cond::Exists(b) => ("$exists", Value::Bool(*b)),
            Cond::Type(t) => ("$type", Value::String(t.clone())),
            Cond::In(v) => ("$in", Value::Array(v.clone())),
            Cond::Nin(v) => ("$nin", Value::Array(v.clone())),
            Cond::All(v) => ("$all", Value::Array(v.clone())),
            Cond::Size(n) => ("$size", Value::from(*n)),
            Cond::Mod { divisor, remainder } => ("$mod", serde_json::json!([divisor, remainder])),
            Cond::Regex(r) => ("$regex", Value::String(r.pattern.clone())),
            Cond::ElemMatch(s) => ("$elemMatch", s.to_json()),
            Cond::AllMatch(s) => ("$allMatch", s.to_json()),
            Cond::KeyMapMatch(s) => ("$keyMapMatch", s.to_json()),
            Cond::BeginsWith(p) => ("$beginsWith", Value::String(p.clone())),
            Cond::Not(c) => ("$not", c.to_json()),
        };
        let mut out = Map::new();
        out.insert(op.to_owned(), arg);
        Value::Object(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn normalized(selector: Value) -> Value {
        parse(selector.as_object().unwrap()).unwrap().to_json()
    }

    fn error(selector: Value) -> (u16, String, String) {
        let e = parse(selector.as_object().unwrap()).unwrap_err().refusal();
        (e.status.as_u16(), e.error, e.reason)
    }

    #[test]
    fn implicit_and_and_eq_as_in_explain_fixture() {
        // The shape of fixture 040's normalized selector.
        assert_eq!(
            normalized(json!({"userId": "user_123", "namespace": "notes"})),
            json!({"$and": [{"userId": {"$eq": "user_123"}}, {"namespace": {"$eq": "notes"}}]})
        );
    }

    #[test]
    fn nested_objects_and_dotted_paths_are_the_same_field() {
        assert_eq!(normalized(json!({"a": {"b": {"$gt": 1}}})), json!({"a.b": {"$gt": 1}}));
        assert_eq!(normalized(json!({"a.b": {"$gt": 1}})), json!({"a.b": {"$gt": 1}}));
        assert_eq!(parse_field("a\\.b.c").unwrap(), vec!["a.b".to_string(), "c".to_string()]);
        assert_eq!(error(json!({"a..b": 1})).1, "invalid_field_name");
    }

    #[test]
    fn operators_under_a_field_apply_to_it() {
        assert_eq!(
            normalized(json!({"a": {"$or": [{"$lt": 1}, {"$gt": 5}]}})),
            json!({"$or": [{"a": {"$lt": 1}}, {"a": {"$gt": 5}}]})
        );
        assert_eq!(
            normalized(json!({"a": {"$gt": 1, "$lt": 5}})),
            json!({"$and": [{"a": {"$gt": 1}}, {"a": {"$lt": 5}}]})
        );
    }

    #[test]
    fn negations_are_pushed_down() {
        assert_eq!(normalized(json!({"a": {"$not": {"$lt": 3}}})), json!({"a": {"$gte": 3}}));
        assert_eq!(
            normalized(json!({"$nor": [{"a": 1}, {"b": {"$in": [1]}}]})),
            json!({"$and": [{"a": {"$ne": 1}}, {"b": {"$nin": [1]}}]})
        );
        assert_eq!(
            normalized(json!({"$not": {"$and": [{"a": {"$exists": true}}, {"b": {"$regex": "x"}}]}})),
            json!({"$or": [{"a": {"$exists": false}}, {"b": {"$not": {"$regex": "x"}}}]})
        );
    }

    #[test]
    fn invalid_operator_matches_fixture_036() {
        assert_eq!(
            error(json!({"userId": {"$bogus": 1}})),
            (400, "invalid_operator".into(), "Invalid operator: $bogus".into())
        );
    }

    #[test]
    fn bad_arguments_give_couchdb_reasons() {
        assert_eq!(error(json!({"a": {"$in": 5}})), (400, "bad_arg".into(), "Bad argument for operator $in: 5".into()));
        assert_eq!(error(json!({"a": {"$exists": "yes"}})).2, "Bad argument for operator $exists: <<\"yes\">>");
        assert_eq!(error(json!({"$and": {"a": 1}})).2, "Bad argument for operator $and: {[{<<\"a\">>,1}]}");
        assert_eq!(error(json!({"a": {"$size": -1}})).1, "bad_arg");
        assert_eq!(error(json!({"a": {"$mod": [0, 1]}})).1, "bad_arg");
        assert_eq!(error(json!({"a": {"$regex": "("}})).1, "bad_arg");
        // mango_selector.erl (3.4.3) `norm_ops`: no `bad_arg` clause for these.
        assert_eq!(
            error(json!({"a": {"$regex": 5}})),
            (400, "invalid_operator".into(), "Invalid operator: $regex".into())
        );
        assert_eq!(
            error(json!({"a": {"$beginsWith": ["x"]}})),
            (400, "invalid_operator".into(), "Invalid operator: $beginsWith".into())
        );
        // Documented differences: PCRE accepts these, this server's linear-time matcher does not.
        assert_eq!(error(json!({"a": {"$regex": "(?<=x)y"}})).1, "bad_arg");
        assert_eq!(error(json!({"a": {"$regex": "(a)\\1"}})).1, "bad_arg");
        assert_eq!(error(json!({"a": {"$regex": "\\p{L}"}})).1, "bad_arg");
        assert_eq!(
            error(json!({"a": {"$where": "x"}})),
            (400, "not_supported".into(), "Unsupported operator: $where".into())
        );
    }

    #[test]
    fn text_under_a_field_is_bad_field_as_in_couchdb() {
        // mango_selector.erl (3.4.3): `$text` normalizes to `{"$default": {"$text": …}}`, and
        // `norm_fields` refuses a `$default` below the top level with `bad_field`.
        assert_eq!(
            error(json!({"a": {"$text": "x"}})),
            (
                400,
                "bad_field".into(),
                "Invalid field normalization on selector: {[{<<\"$default\">>,{[{<<\"$text\">>,<<\"x\">>}]}}]}".into()
            )
        );
        assert_eq!(error(json!({"a": {"$text": ["x"]}})).1, "bad_arg");
    }

    #[test]
    fn a_top_level_condition_needs_a_field() {
        assert_eq!(
            error(json!({"$gt": 1})),
            (400, "invalid_selector".into(), "One or more conditions is missing a field name.".into())
        );
    }

    #[test]
    fn required_equalities_and_fields() {
        let s = parse(json!({"userId": "u", "n": {"$gt": 1}}).as_object().unwrap()).unwrap();
        assert_eq!(s.required_equal(&["userId"]), Some(&json!("u")));
        assert_eq!(s.required_equal(&["n"]), None);
        assert!(s.has_required_fields(&[vec!["n".to_string()]]));
        let s = parse(json!({"$or": [{"a": 1}, {"b": 1}]}).as_object().unwrap()).unwrap();
        assert!(!s.has_required_fields(&[vec!["a".to_string()]]));
        assert_eq!(s.required_equal(&["a"]), None);
    }

    #[test]
    fn required_fields_follow_couchdb_has_required_fields() {
        // From mango_selector.erl (3.4.3): an `$or` leaves what any arm leaves, so an empty one
        // leaves nothing; only `$exists: false` does not cover its field (a negated regex does).
        let required = |selector: Value, fields: &[&str]| {
            let s = parse(selector.as_object().unwrap()).unwrap();
            s.has_required_fields(&fields.iter().map(|f| parse_field(f).unwrap()).collect::<Vec<_>>())
        };
        assert!(required(json!({"$or": []}), &["userId", "namespace"]));
        assert!(required(json!({"a": {"$not": {"$regex": "x"}}}), &["a"]));
        assert!(!required(json!({"a": {"$exists": false}}), &["a"]));
        assert!(required(json!({"$or": [{"a": 1, "b": 1}, {"a": 2}]}), &["a"]));
        assert!(!required(json!({"$or": [{"a": 1, "b": 1}, {"a": 2}]}), &["a", "b"]));
        assert!(!required(json!({}), &["a"]));
        assert!(required(json!({}), &[]));
    }
}
