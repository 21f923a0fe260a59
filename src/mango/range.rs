//! The key ranges CouchDB derives from a selector to read an index (`mango_idx_view:field_ranges`
//! in 3.4.3): for each indexable field, its conditions under `$and` narrowed to one interval in
//! CouchDB's collation. They decide what they decide in CouchDB: the key range a view-backed JSON
//! index is read over ([`key_range`]), which index is chosen (how many of the selector's ranged fields an index's leading
//! columns cover) and whether a query reads nothing at all (an empty range on the chosen index's
//! first column, where CouchDB answers `{"docs": []}` without a scan).

use std::cmp::Ordering;

use serde_json::Value;

use super::selector::{join_field, Cond, Selector};
use crate::views::collation::compare;

/// One end of a range: below or above every value (CouchDB's `mango_json:min()`/`max()`), or a
/// value.
#[derive(Debug, Clone, PartialEq)]
enum Bound {
    Min,
    Max,
    Value(Value),
}

/// The comparison an end of a range makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Gt,
    Gte,
    Lt,
    Lte,
    Eq,
}

/// A field's interval: `low_op low` and `high_op high`.
#[derive(Debug, Clone, PartialEq)]
struct Interval {
    low_op: Op,
    low: Bound,
    high_op: Op,
    high: Bound,
}

/// A field and whether some value satisfies its conditions (`false`: CouchDB's `empty` range).
pub type FieldRange = (String, bool);

/// CouchDB's `field_ranges`: each of the selector's indexable fields (sorted) with whether its
/// interval has values; the first field whose interval is empty is returned alone.
pub fn field_ranges(selector: &Selector) -> Vec<FieldRange> {
    let mut ranges = Vec::new();
    for field in selector.indexable_fields() {
        if range(selector, &field, full()).is_none() {
            return vec![(field, false)];
        }
        ranges.push((field, true));
    }
    ranges
}

/// CouchDB's `composite_prefix`: the ranges of an index's leading columns that have one.
pub fn index_prefix<'a>(columns: &[String], ranges: &'a [FieldRange]) -> Vec<&'a FieldRange> {
    columns.iter().map_while(|column| ranges.iter().find(|(field, _)| field == column)).collect()
}

/// The key range an index with these columns is read over for `selector`: the first key and the
/// last (inclusive; the last ends with `max`, a value above every other). Columns fixed by `$eq`
/// lead both ends; the first column that is not adds its low end to the start and its high end
/// to the end, as CouchDB's `start_key`/`end_key` do, and later columns are left open (the whole
/// selector is applied to every document read, so a wider range only costs reads).
pub fn key_range(columns: &[String], selector: &Selector, max: &Value) -> (Vec<Value>, Vec<Value>) {
    let indexable = selector.indexable_fields();
    let (mut start, mut end) = (Vec::new(), Vec::new());
    for column in columns {
        if !indexable.contains(column) {
            break;
        }
        let Some(interval) = range(selector, column, full()) else { break };
        match (&interval.low, &interval.high) {
            (Bound::Value(low), Bound::Value(high)) if interval.low_op == Op::Eq && interval.high_op == Op::Eq => {
                start.push(low.clone());
                end.push(high.clone());
                continue;
            }
            (low, high) => {
                if let Bound::Value(low) = low {
                    start.push(low.clone());
                }
                if let Bound::Value(high) = high {
                    end.push(high.clone());
                }
                break;
            }
        }
    }
    end.push(max.clone());
    (start, end)
}

fn full() -> Interval {
    Interval { low_op: Op::Gt, low: Bound::Min, high_op: Op::Lt, high: Bound::Max }
}

/// `range/6`: the interval of `field` under the selector, seen through `$and` only.
fn range(selector: &Selector, field: &str, current: Interval) -> Option<Interval> {
    match selector {
        Selector::And(arms) => arms.iter().try_fold(current, |interval, arm| range(arm, field, interval)),
        Selector::Field { path, cond } if join_field(path) == field => narrow(cond, current),
        _ => Some(current),
    }
}

/// Where a value falls against an interval's ends.
enum Position {
    BelowLow,
    AtLow,
    Between,
    AtHigh,
    AboveHigh,
}

fn compare_bound(value: &Value, bound: &Bound) -> Ordering {
    match bound {
        Bound::Min => Ordering::Greater,
        Bound::Max => Ordering::Less,
        Bound::Value(b) => compare(value, b),
    }
}

fn position(interval: &Interval, value: &Value) -> Position {
    match compare_bound(value, &interval.low) {
        Ordering::Less => Position::BelowLow,
        Ordering::Equal => Position::AtLow,
        Ordering::Greater => match compare_bound(value, &interval.high) {
            Ordering::Less => Position::Between,
            Ordering::Equal => Position::AtHigh,
            Ordering::Greater => Position::AboveHigh,
        },
    }
}

/// `range/5`: the interval narrowed by one condition (`None`: empty), case for case as CouchDB's.
fn narrow(cond: &Cond, interval: Interval) -> Option<Interval> {
    use Position::*;
    let exactly = |arg: &Value| Interval {
        low_op: Op::Eq,
        low: Bound::Value(arg.clone()),
        high_op: Op::Eq,
        high: Bound::Value(arg.clone()),
    };
    let closed_low = |op: Op| op == Op::Gte || op == Op::Eq;
    let closed_high = |op: Op| op == Op::Lte || op == Op::Eq;
    match cond {
        Cond::BeginsWith(prefix) => {
            let low = narrow(&Cond::Gte(Value::String(prefix.clone())), interval)?;
            // U+FFFF sorts after every character in CouchDB's collation.
            narrow(&Cond::Lte(Value::String(format!("{prefix}\u{FFFF}"))), low)
        }
        Cond::Lt(arg) => match position(&interval, arg) {
            BelowLow | AtLow => None,
            Between | AtHigh => Some(Interval { high_op: Op::Lt, high: Bound::Value(arg.clone()), ..interval }),
            AboveHigh => Some(interval),
        },
        Cond::Lte(arg) => match position(&interval, arg) {
            BelowLow => None,
            AtLow if closed_low(interval.low_op) => Some(exactly(arg)),
            AtLow => None,
            Between => Some(Interval { high_op: Op::Lte, high: Bound::Value(arg.clone()), ..interval }),
            AtHigh | AboveHigh => Some(interval),
        },
        Cond::Eq(arg) => match position(&interval, arg) {
            BelowLow | AboveHigh => None,
            AtLow if closed_low(interval.low_op) => Some(exactly(arg)),
            AtLow => None,
            Between => Some(exactly(arg)),
            AtHigh if closed_high(interval.high_op) => Some(exactly(arg)),
            AtHigh => None,
        },
        Cond::Gte(arg) => match position(&interval, arg) {
            BelowLow | AtLow => Some(interval),
            Between => Some(Interval { low_op: Op::Gte, low: Bound::Value(arg.clone()), ..interval }),
            AtHigh if closed_high(interval.high_op) => Some(exactly(arg)),
            AtHigh | AboveHigh => None,
        },
        Cond::Gt(arg) => match position(&interval, arg) {
            BelowLow => Some(interval),
            AtLow | Between => Some(Interval { low_op: Op::Gt, low: Bound::Value(arg.clone()), ..interval }),
            AtHigh | AboveHigh => None,
        },
        // Any other condition is applied afterwards as a filter.
        _ => Some(interval),
    }
}

#[cfg(test)]
mod tests {
    use super::super::selector::parse;
    use super::*;
    use serde_json::json;

    fn ranges(selector: Value) -> Vec<(String, bool)> {
        let selector = parse(selector.as_object().unwrap()).unwrap();
        field_ranges(&selector)
    }

    #[test]
    fn key_ranges_lead_with_equalities_then_one_interval() {
        let selector = |v: Value| parse(v.as_object().unwrap()).unwrap();
        let columns = |names: &[&str]| names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>();
        let max = json!("<MAX>");
        let (start, end) =
            key_range(&columns(&["a", "b", "c"]), &selector(json!({"a": 1, "b": {"$gt": 2, "$lte": 9}, "c": 3})), &max);
        assert_eq!((start, end), (vec![json!(1), json!(2)], vec![json!(1), json!(9), max.clone()]));
        let (start, end) = key_range(&columns(&["a"]), &selector(json!({"a": {"$lt": 5}})), &max);
        assert_eq!((start, end), (vec![], vec![json!(5), max.clone()]));
        // A column the selector does not range leaves the rest open.
        let (start, end) = key_range(&columns(&["x", "a"]), &selector(json!({"a": 1})), &max);
        assert_eq!((start, end), (vec![], vec![max]));
    }

    #[test]
    fn contradictions_are_empty_as_couchdb_computes_them() {
        // mango_idx_view.erl (3.4.3) `range/5`.
        assert_eq!(ranges(json!({"a": {"$gt": 5, "$lt": 3}})), [("a".to_owned(), false)]);
        assert_eq!(ranges(json!({"a": {"$gte": 5, "$lte": 5}})), [("a".to_owned(), true)]);
        assert_eq!(ranges(json!({"a": {"$gt": 5, "$lte": 5}})), [("a".to_owned(), false)]);
        assert_eq!(ranges(json!({"a": 1, "b": {"$lt": 1, "$gt": 2}})), [("b".to_owned(), false)]);
        assert_eq!(ranges(json!({"a": {"$beginsWith": "b", "$lt": "b"}})), [("a".to_owned(), false)]);
        assert_eq!(ranges(json!({"a": {"$beginsWith": "b", "$lte": "bz"}})), [("a".to_owned(), true)]);
        // In collation "a" < "B", so `_id` > "B" and < "a" is empty although bytes would allow it.
        assert_eq!(ranges(json!({"_id": {"$gt": "B", "$lt": "a"}})), [("_id".to_owned(), false)]);
        // Fields under `$or` are not ranged; `$exists` is, without narrowing.
        assert_eq!(ranges(json!({"$or": [{"a": 1}], "c": {"$exists": true}})), [("c".to_owned(), true)]);
    }
}
