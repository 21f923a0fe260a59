//! CouchDB's built-in reduce functions, run in Rust: `_count`, `_sum`, `_stats` and
//! `_approx_count_distinct`.
//!
//! Each is a [`Reducer`]: `reduce` folds map rows (`[key, id]`, value) and `rereduce` folds
//! earlier reductions, so a query can combine partial results (of index blocks, of groups) the
//! way CouchDB combines its B-tree nodes' reductions. Their answers follow CouchDB 3.4:
//! - `_count`: the number of rows.
//! - `_sum`: numbers add; arrays of numbers add position by position (a shorter array counts as
//!   zeros past its end); objects add member by member, nested; any other value is an error.
//! - `_stats`: `{sum, count, min, max, sumsqr}` of numbers, or one such object per position of
//!   arrays of numbers (every array the same length); a value that is already a stats object is
//!   taken as one. Any other value is an error.
//! - `_approx_count_distinct`: how many distinct keys, estimated with HyperLogLog; exact while the
//!   distinct keys are few ([`EXACT_UP_TO`]).
//!
//! Integers stay integers while their sums fit in 64 bits (CouchDB's Erlang integers are
//! unbounded; past that this sums in doubles); every other number is a double, as CouchDB's.

use std::collections::BTreeSet;
use std::hash::{Hash, Hasher};

use serde_json::{json, Map, Number, Value};

use super::sort_key;

/// A built-in reduce function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Builtin {
    Count,
    Sum,
    Stats,
    ApproxCountDistinct,
}

/// What a built-in reduce function refused: CouchDB's `builtin_reduce_error`.
#[derive(Debug, Clone, PartialEq)]
pub struct ReduceError {
    pub reason: String,
    /// The value that could not be reduced.
    pub caused_by: Value,
}

/// A reduce function: `reduce` folds map rows (`[key, id]`, value) into a partial result,
/// `rereduce` folds partial results, `finish` turns the last one into what a client is shown.
pub trait Reducer {
    fn reduce(&self, rows: &[(Value, Value)]) -> Result<Value, ReduceError>;
    fn rereduce(&self, reductions: &[Value]) -> Result<Value, ReduceError>;
    fn finish(&self, reduction: Value) -> Value {
        reduction
    }
}

impl Builtin {
    /// The built-in a design document names (`_sum`, …), or `None` when `source` is not one.
    /// CouchDB takes any text starting with the name (`_sum(…)` is `_sum`).
    pub fn parse(source: &str) -> Option<Result<Builtin, String>> {
        let name = source.trim();
        if !name.starts_with('_') {
            return None;
        }
        let found = [
            ("_approx_count_distinct", Builtin::ApproxCountDistinct),
            ("_count", Builtin::Count),
            ("_stats", Builtin::Stats),
            ("_sum", Builtin::Sum),
        ]
        .into_iter()
        .find(|(prefix, _)| name.starts_with(prefix));
        Some(found.map(|(_, builtin)| builtin).ok_or_else(|| format!("Unknown builtin reduce function: {name}")))
    }
}

impl Reducer for Builtin {
    fn reduce(&self, rows: &[(Value, Value)]) -> Result<Value, ReduceError> {
        match self {
            Builtin::Count => Ok(json!(rows.len())),
            Builtin::Sum => {
                rows.iter().try_for_each(|(_, value)| check_summable(value))?;
                fold(rows.iter().map(|(_, value)| value), sum_two)
            }
            Builtin::Stats => {
                let stats: Result<Vec<Value>, ReduceError> = rows.iter().map(|(_, value)| stats_of(value)).collect();
                fold(stats?.iter(), merge_stats)
            }
            Builtin::ApproxCountDistinct => {
                let mut sketch = Sketch::default();
                for (key, _) in rows {
                    // The row's key is `[key, id]`: only the emitted key counts.
                    let emitted = key.as_array().and_then(|pair| pair.first()).unwrap_or(key);
                    sketch.add(emitted);
                }
                Ok(sketch.to_value())
            }
        }
    }

    fn rereduce(&self, reductions: &[Value]) -> Result<Value, ReduceError> {
        match self {
            Builtin::Count | Builtin::Sum => fold(reductions.iter(), sum_two),
            Builtin::Stats => fold(reductions.iter(), merge_stats),
            Builtin::ApproxCountDistinct => {
                let mut sketch = Sketch::default();
                for reduction in reductions {
                    sketch.merge(&Sketch::from_value(reduction));
                }
                Ok(sketch.to_value())
            }
        }
    }

    fn finish(&self, reduction: Value) -> Value {
        match self {
            Builtin::ApproxCountDistinct => json!(Sketch::from_value(&reduction).estimate()),
            _ => reduction,
        }
    }
}

/// Folds values pairwise; no values at all reduce to `0`, as CouchDB's empty `_sum` and `_count`.
fn fold<'a>(
    mut values: impl Iterator<Item = &'a Value>,
    step: fn(&Value, &Value) -> Result<Value, ReduceError>,
) -> Result<Value, ReduceError> {
    let Some(first) = values.next() else {
        return Ok(json!(0));
    };
    let mut total = first.clone();
    for value in values {
        total = step(&total, value)?;
    }
    Ok(total)
}

const SUM_REASON: &str = "The _sum function requires that map values be numbers, arrays of numbers, or objects. \
Objects cannot be mixed with other data structures. Objects can be arbitrarily nested, provided that the values \
for all fields are themselves numbers, arrays of numbers, or objects.";

const STATS_REASON: &str = "The _stats function requires that map values be numbers or arrays of numbers, \
not '{value}'";

fn sum_error(value: &Value) -> ReduceError {
    ReduceError { reason: SUM_REASON.to_owned(), caused_by: value.clone() }
}

fn check_summable(value: &Value) -> Result<(), ReduceError> {
    match value {
        Value::Number(_) => Ok(()),
        Value::Array(items) if items.iter().all(Value::is_number) => Ok(()),
        Value::Object(members) => members.values().try_for_each(check_summable),
        other => Err(sum_error(other)),
    }
}

fn sum_two(a: &Value, b: &Value) -> Result<Value, ReduceError> {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => Ok(Value::Number(add_numbers(x, y))),
        (Value::Array(x), Value::Array(y)) => Ok(Value::Array(add_arrays(x, y))),
        (Value::Number(_), Value::Array(y)) => Ok(Value::Array(add_arrays(std::slice::from_ref(a), y))),
        (Value::Array(x), Value::Number(_)) => Ok(Value::Array(add_arrays(x, std::slice::from_ref(b)))),
        (Value::Object(x), Value::Object(y)) => {
            let mut total: Map<String, Value> = x.clone();
            for (name, value) in y {
                let summed = match total.get(name) {
                    Some(existing) => sum_two(existing, value)?,
                    None => value.clone(),
                };
                total.insert(name.clone(), summed);
            }
            Ok(Value::Object(total))
        }
        (Value::Object(_), other) | (other, Value::Object(_)) => Err(sum_error(other)),
        (other, _) => Err(sum_error(other)),
    }
}

fn add_arrays(x: &[Value], y: &[Value]) -> Vec<Value> {
    let zero = Number::from(0);
    (0..x.len().max(y.len()))
        .map(|i| {
            let a = x.get(i).and_then(Value::as_number).unwrap_or(&zero);
            let b = y.get(i).and_then(Value::as_number).unwrap_or(&zero);
            Value::Number(add_numbers(a, b))
        })
        .collect()
}

/// Adds two numbers: integers exactly while they fit, otherwise as doubles.
pub fn add_numbers(a: &Number, b: &Number) -> Number {
    if let (Some(x), Some(y)) = (a.as_i64(), b.as_i64()) {
        if let Some(total) = x.checked_add(y) {
            return Number::from(total);
        }
    }
    double(sort_key::number_as_double(a) + sort_key::number_as_double(b))
}

/// A double as a JSON number (a sum of doubles stays one: `1.5 + 1.5` is `3.0`, as CouchDB prints
/// it).
fn double(value: f64) -> Number {
    Number::from_f64(value).unwrap_or_else(|| Number::from(0))
}

/// The stats object of one map value.
fn stats_of(value: &Value) -> Result<Value, ReduceError> {
    match value {
        Value::Number(n) => Ok(stats_of_number(n)),
        Value::Array(items) => {
            let per_position: Result<Vec<Value>, ReduceError> = items
                .iter()
                .map(|item| match item {
                    Value::Number(n) => Ok(stats_of_number(n)),
                    other => Err(stats_error(other)),
                })
                .collect();
            Ok(Value::Array(per_position?))
        }
        Value::Object(members) if is_stats_object(members) => Ok(value.clone()),
        other => Err(stats_error(other)),
    }
}

fn stats_error(value: &Value) -> ReduceError {
    ReduceError { reason: STATS_REASON.replace("{value}", &value.to_string()), caused_by: value.clone() }
}

fn is_stats_object(members: &Map<String, Value>) -> bool {
    ["sum", "count", "min", "max", "sumsqr"].iter().all(|field| members.get(*field).is_some_and(Value::is_number))
}

fn stats_of_number(n: &Number) -> Value {
    let square = match n.as_i64().and_then(|i| i.checked_mul(i)) {
        Some(exact) => Number::from(exact),
        None => double(sort_key::number_as_double(n).powi(2)),
    };
    json!({"sum": n, "count": 1, "min": n, "max": n, "sumsqr": square})
}

fn merge_stats(a: &Value, b: &Value) -> Result<Value, ReduceError> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) if is_stats_object(x) && is_stats_object(y) => {
            Ok(merge_stats_objects(x, y))
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            let merged: Result<Vec<Value>, ReduceError> = x.iter().zip(y).map(|(p, q)| merge_stats(p, q)).collect();
            Ok(Value::Array(merged?))
        }
        (Value::Array(_), other) | (other, Value::Array(_)) | (_, other) => Err(ReduceError {
            reason: "The _stats function requires that map values be numbers or arrays of numbers of the same length"
                .to_owned(),
            caused_by: other.clone(),
        }),
    }
}

fn merge_stats_objects(x: &Map<String, Value>, y: &Map<String, Value>) -> Value {
    let field = |map: &Map<String, Value>, name: &str| {
        map.get(name).and_then(Value::as_number).cloned().unwrap_or(Number::from(0))
    };
    let pick = |name: &str, want: std::cmp::Ordering| {
        let (p, q) = (field(x, name), field(y, name));
        if super::collation::compare_numbers(&q, &p) == want {
            q
        } else {
            p
        }
    };
    json!({
        "sum": add_numbers(&field(x, "sum"), &field(y, "sum")),
        "count": add_numbers(&field(x, "count"), &field(y, "count")),
        "min": pick("min", std::cmp::Ordering::Less),
        "max": pick("max", std::cmp::Ordering::Greater),
        "sumsqr": add_numbers(&field(x, "sumsqr"), &field(y, "sumsqr")),
    })
}

/// Distinct keys counted exactly up to this many, estimated past it.
pub const EXACT_UP_TO: usize = 1024;
/// HyperLogLog precision: 2^11 registers, about 2.3 % standard error.
const PRECISION: u32 = 11;

/// The distinct keys seen: their hashes while few, HyperLogLog registers past that.
#[derive(Default)]
struct Sketch {
    exact: BTreeSet<u64>,
    registers: Option<Vec<u8>>,
}

impl Sketch {
    fn add(&mut self, key: &Value) {
        // Keys that collate equal count once: hash the collation's sort key.
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        sort_key::encode(key).hash(&mut hasher);
        self.add_hash(hasher.finish());
    }

    fn add_hash(&mut self, hash: u64) {
        match &mut self.registers {
            Some(registers) => observe(registers, hash),
            None => {
                self.exact.insert(hash);
                if self.exact.len() > EXACT_UP_TO {
                    let mut registers = vec![0u8; 1 << PRECISION];
                    for hash in std::mem::take(&mut self.exact) {
                        observe(&mut registers, hash);
                    }
                    self.registers = Some(registers);
                }
            }
        }
    }

    fn merge(&mut self, other: &Sketch) {
        for hash in &other.exact {
            self.add_hash(*hash);
        }
        if let Some(theirs) = &other.registers {
            let mine = self.registers.get_or_insert_with(|| {
                let mut registers = vec![0u8; 1 << PRECISION];
                for hash in &self.exact {
                    observe(&mut registers, *hash);
                }
                registers
            });
            self.exact.clear();
            for (m, t) in mine.iter_mut().zip(theirs) {
                *m = (*m).max(*t);
            }
        }
    }

    fn estimate(&self) -> u64 {
        let Some(registers) = &self.registers else {
            return self.exact.len() as u64;
        };
        let m = registers.len() as f64;
        let harmonic: f64 = registers.iter().map(|&r| 2f64.powi(-(r as i32))).sum();
        let raw = 0.7213 / (1.0 + 1.079 / m) * m * m / harmonic;
        let zeros = registers.iter().filter(|&&r| r == 0).count();
        if raw <= 2.5 * m && zeros > 0 {
            (m * (m / zeros as f64).ln()).round() as u64
        } else {
            raw.round() as u64
        }
    }

    /// A partial result a later rereduce can merge: the hashes while few, else the registers.
    fn to_value(&self) -> Value {
        match &self.registers {
            None => json!({ "hashes": self.exact.iter().collect::<Vec<_>>() }),
            Some(registers) => json!({ "registers": registers }),
        }
    }

    fn from_value(value: &Value) -> Sketch {
        let numbers = |field: &str| -> Vec<u64> {
            value
                .get(field)
                .and_then(Value::as_array)
                .map(|items| items.iter().filter_map(Value::as_u64).collect())
                .unwrap_or_default()
        };
        match value.get("registers") {
            Some(_) => Sketch {
                exact: BTreeSet::new(),
                registers: Some(numbers("registers").into_iter().map(|r| r.min(64) as u8).collect()),
            },
            None => Sketch { exact: numbers("hashes").into_iter().collect(), registers: None },
        }
    }
}

fn observe(registers: &mut [u8], hash: u64) {
    let index = (hash >> (64 - PRECISION)) as usize;
    let rest = hash << PRECISION;
    let rank = (rest.leading_zeros().min(64 - PRECISION) + 1) as u8;
    registers[index] = registers[index].max(rank);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(values: &[Value]) -> Vec<(Value, Value)> {
        values.iter().enumerate().map(|(i, v)| (json!([i, format!("doc{i}")]), v.clone())).collect()
    }

    #[test]
    fn names_parse_as_couchdb_reads_them() {
        assert_eq!(Builtin::parse("_sum"), Some(Ok(Builtin::Sum)));
        assert_eq!(Builtin::parse(" _count "), Some(Ok(Builtin::Count)));
        assert_eq!(Builtin::parse("_stats"), Some(Ok(Builtin::Stats)));
        assert_eq!(Builtin::parse("_approx_count_distinct"), Some(Ok(Builtin::ApproxCountDistinct)));
        assert!(matches!(Builtin::parse("_median"), Some(Err(_))));
        assert_eq!(Builtin::parse("function(k, v) { return sum(v); }"), None);
    }

    #[test]
    fn count_and_sum() {
        assert_eq!(Builtin::Count.reduce(&rows(&[json!("a"), json!(null)])).unwrap(), json!(2));
        assert_eq!(Builtin::Count.rereduce(&[json!(2), json!(5)]).unwrap(), json!(7));
        assert_eq!(Builtin::Sum.reduce(&rows(&[json!(1), json!(2), json!(3)])).unwrap(), json!(6));
        assert_eq!(Builtin::Sum.reduce(&rows(&[json!(0.5), json!(2)])).unwrap(), json!(2.5));
        assert_eq!(Builtin::Sum.reduce(&rows(&[])).unwrap(), json!(0));
        assert_eq!(Builtin::Sum.reduce(&rows(&[json!([1, 2]), json!([10, 20, 30])])).unwrap(), json!([11, 22, 30]));
        assert_eq!(
            Builtin::Sum.reduce(&rows(&[json!({"a": 1, "b": {"c": 2}}), json!({"a": 3, "d": [1]})])).unwrap(),
            json!({"a": 4, "b": {"c": 2}, "d": [1]})
        );
        assert_eq!(Builtin::Sum.rereduce(&[json!(3), json!(4)]).unwrap(), json!(7));
    }

    #[test]
    fn sum_refuses_what_couchdb_refuses() {
        let error = Builtin::Sum.reduce(&rows(&[json!(1), json!("baz")])).unwrap_err();
        assert_eq!(error.caused_by, json!("baz"));
        assert!(Builtin::Sum.reduce(&rows(&[json!({"a": 1}), json!(2)])).is_err());
        assert!(Builtin::Sum.reduce(&rows(&[json!([1, "x"])])).is_err());
    }

    #[test]
    fn stats_of_numbers_and_arrays() {
        assert_eq!(
            Builtin::Stats.reduce(&rows(&[json!(1), json!(1)])).unwrap(),
            json!({"sum": 2, "count": 2, "min": 1, "max": 1, "sumsqr": 2})
        );
        assert_eq!(
            Builtin::Stats.reduce(&rows(&[json!([1, 2, 3]), json!([4, 5, 6]), json!([7, 8, 9])])).unwrap(),
            json!([
                {"sum": 12, "count": 3, "min": 1, "max": 7, "sumsqr": 66},
                {"sum": 15, "count": 3, "min": 2, "max": 8, "sumsqr": 93},
                {"sum": 18, "count": 3, "min": 3, "max": 9, "sumsqr": 126}
            ])
        );
        let partial = Builtin::Stats.reduce(&rows(&[json!(-2), json!(5)])).unwrap();
        let other = Builtin::Stats.reduce(&rows(&[json!(0.5)])).unwrap();
        assert_eq!(
            Builtin::Stats.rereduce(&[partial, other]).unwrap(),
            json!({"sum": 3.5, "count": 3, "min": -2, "max": 5, "sumsqr": 29.25})
        );
    }

    #[test]
    fn stats_refuses_strings_mixes_and_uneven_arrays() {
        assert!(Builtin::Stats.reduce(&rows(&[json!("lala")])).is_err());
        assert!(Builtin::Stats.reduce(&rows(&[json!([1, 2, 3]), json!(4)])).is_err());
        assert!(Builtin::Stats.reduce(&rows(&[json!([1, 2, 3]), json!([1, 2])])).is_err());
    }

    #[test]
    fn distinct_keys_are_exact_while_few_and_close_past_that() {
        let few = rows(&[json!(1), json!(2), json!(3)]);
        let keys: Vec<(Value, Value)> = few.iter().map(|(_, v)| (json!([v, "id"]), json!(null))).collect();
        let doubled: Vec<(Value, Value)> = keys.iter().chain(keys.iter()).cloned().collect();
        let distinct = Builtin::ApproxCountDistinct;
        assert_eq!(distinct.finish(distinct.reduce(&doubled).unwrap()), json!(3));
        let halves: Vec<Value> = [&keys[..2], &keys[1..]].iter().map(|part| distinct.reduce(part).unwrap()).collect();
        assert_eq!(distinct.finish(distinct.rereduce(&halves).unwrap()), json!(3));
        let many: Vec<(Value, Value)> = (0..20_000).map(|i| (json!([i % 10_000, "id"]), json!(null))).collect();
        let (first, second) = many.split_at(7_000);
        let parts = [distinct.reduce(first).unwrap(), distinct.reduce(second).unwrap()];
        let estimate = distinct.finish(distinct.rereduce(&parts).unwrap()).as_f64().unwrap();
        assert!((estimate - 10_000.0).abs() < 10_000.0 * 0.08, "estimate {estimate}");
    }
}
