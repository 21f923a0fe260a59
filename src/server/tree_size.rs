//! The memory a JSON body's parsed tree will take, measured before the tree exists.
//!
//! A parsed `serde_json::Value` costs many times its text here (under `arbitrary_precision` every
//! number is a heap string; under `preserve_order` every object an `IndexMap`): about 50× for an
//! array of one-digit numbers. So the byte budgets of both faces take their share for a body from
//! a streaming pass ([`CompactSize`]) that measures each value's compact size and estimates its
//! tree's memory without allocating for the content.

use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use crate::model::validate::json_size;

/// The key under which serde_json's `arbitrary_precision` hands a number to a visitor: as a
/// one-entry map from this key to the number's text.
pub(crate) const NUMBER_TOKEN: &str = "$serde_json::private::Number";

/// The estimated memory of the tree `serde_json` would build from `bytes`, measured by a streaming
/// pass that allocates nothing for the content. Errors
/// are the JSON syntax errors parsing would meet, and nesting deeper than `max_depth`, so a body
/// that fails here is refused before any tree exists. Both faces' bodies are measured by it.
pub(crate) fn estimate_tree_bytes(bytes: &[u8], max_depth: usize) -> Result<usize, serde_json::Error> {
    let depth = crate::model::depth::text_depth(bytes);
    if depth > max_depth {
        return Err(serde::de::Error::custom(format!(
            "the body is nested {depth} levels deep; at most {max_depth} are read (JSON nesting depth)"
        )));
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    // The depth was bounded above (serde_json's own limit is below what a document may nest).
    de.disable_recursion_limit();
    let measure = CompactSize.deserialize(&mut de)?;
    de.end()?;
    Ok(measure.cost)
}

/// One JSON value's compact size, and the estimated memory of its parsed tree.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Measure {
    /// Bytes of the compact serialisation.
    pub size: usize,
    /// Estimated bytes of the parsed tree.
    pub cost: usize,
}

impl Measure {
    fn leaf(size: usize, heap: usize) -> Self {
        Measure { size, cost: NODE_BYTES.saturating_add(heap) }
    }
}

/// What one node of a parsed tree costs besides its own heap data: its `Value` slot, doubled
/// because a growing array may hold up to twice the slots it fills.
const NODE_BYTES: usize = 2 * std::mem::size_of::<Value>();
/// What one object entry costs besides its key's text and its value: the `IndexMap` entry (hash
/// and key `String`) and its index slot.
const ENTRY_BYTES: usize = 8 + std::mem::size_of::<String>() + 16;

/// Heap bytes of one allocation holding `len` bytes of text, with the allocator's rounding and
/// header (the smallest chunk is 32 bytes).
fn text_heap(len: usize) -> usize {
    len.saturating_add(8).next_multiple_of(16).max(32)
}

/// Measures one JSON value's compact serialisation as [`json_size`] would count it on the parsed
/// tree, without building the tree.
pub(crate) struct CompactSize;

impl<'de> DeserializeSeed<'de> for CompactSize {
    type Value = Measure;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Measure, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for CompactSize {
    type Value = Measure;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, value: bool) -> Result<Measure, E> {
        Ok(Measure::leaf(if value { 4 } else { 5 }, 0))
    }

    fn visit_unit<E>(self) -> Result<Measure, E> {
        Ok(Measure::leaf(4, 0))
    }

    fn visit_i64<E>(self, value: i64) -> Result<Measure, E> {
        let size = json_size(&value);
        Ok(Measure::leaf(size, text_heap(size)))
    }

    fn visit_u64<E>(self, value: u64) -> Result<Measure, E> {
        let size = json_size(&value);
        Ok(Measure::leaf(size, text_heap(size)))
    }

    fn visit_f64<E>(self, value: f64) -> Result<Measure, E> {
        let size = json_size(&value);
        Ok(Measure::leaf(size, text_heap(size)))
    }

    fn visit_str<E>(self, text: &str) -> Result<Measure, E> {
        Ok(Measure::leaf(json_size(text), text_heap(text.len())))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Measure, A::Error> {
        let (mut total, mut count) = (Measure::leaf(2, 0), 0usize);
        while let Some(item) = seq.next_element_seed(CompactSize)? {
            total.size = total.size.saturating_add(item.size);
            total.cost = total.cost.saturating_add(item.cost);
            count += 1;
        }
        total.size = total.size.saturating_add(count.saturating_sub(1));
        Ok(total)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Measure, A::Error> {
        let (mut total, mut count) = (Measure::leaf(2, 0), 0usize);
        while let Some(key) = map.next_key_seed(KeySize)? {
            let Some((key_size, key_len)) = key else {
                // A number under `arbitrary_precision`: its text, as the tree will hold it.
                let text: String = map.next_value()?;
                let number: serde_json::Number = text.parse().map_err(serde::de::Error::custom)?;
                let size = json_size(&number);
                return Ok(Measure::leaf(size, text_heap(size)));
            };
            let value = map.next_value_seed(CompactSize)?;
            total.size = total.size.saturating_add(key_size + 1).saturating_add(value.size);
            total.cost = total.cost.saturating_add(ENTRY_BYTES + text_heap(key_len)).saturating_add(value.cost);
            count += 1;
        }
        total.size = total.size.saturating_add(count.saturating_sub(1));
        Ok(total)
    }
}

/// An object key's compact size and text length, or `None` for the number marker.
struct KeySize;

impl<'de> DeserializeSeed<'de> for KeySize {
    type Value = Option<(usize, usize)>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeySize {
    type Value = Option<(usize, usize)>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_str<E>(self, key: &str) -> Result<Self::Value, E> {
        Ok((key != NUMBER_TOKEN).then(|| (json_size(key), key.len())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The estimate of a whole document grows with its tree, not its text: one-digit numbers cost
    /// far more parsed than written; errors are the parser's.
    #[test]
    fn whole_documents_are_estimated_without_parsing() {
        let numbers = format!("[{}1]", "1,".repeat(10_000));
        let text = format!("\"{}\"", "x".repeat(20_000));
        let (numbers_cost, text_cost) =
            (estimate_tree_bytes(numbers.as_bytes(), 8).unwrap(), estimate_tree_bytes(text.as_bytes(), 8).unwrap());
        assert!(numbers_cost > 10 * numbers.len(), "{numbers_cost} for {} bytes", numbers.len());
        assert!(text_cost < 2 * text.len(), "{text_cost} for {} bytes", text.len());
        assert!(estimate_tree_bytes(b"{\"a\": [1, }", 8).is_err());
        assert!(estimate_tree_bytes(b"{} x", 8).is_err());
        let nested = |depth: usize| format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        assert!(estimate_tree_bytes(nested(200).as_bytes(), 200).is_ok(), "past serde_json's own limit");
        assert!(estimate_tree_bytes(nested(201).as_bytes(), 200).is_err());
    }
}
