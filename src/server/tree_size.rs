//! The memory a JSON body's parsed tree will take, measured before the tree exists.
//!
//! A parsed `serde_json::Value` costs many times its text here (under `arbitrary_precision` every
//! number is a heap string; under `preserve_order` every object an `IndexMap`): about 50× for an
//! array of one-digit numbers. So the byte budgets of both faces take their share for a body from
//! a streaming pass ([`CompactSize`]) that measures each value's compact size and estimates its
//! tree's memory without allocating for the content.
//!
//! The CouchDB face, which only needs the estimate, first tries a byte scan of its own
//! ([`measure_body`]): one loop over the text that finds the nesting depth and the same estimate
//! [`CompactSize`] gives, at a fraction of the cost of a serde pass (no visitor calls, no
//! re-serialisation of each string and number to count its size). It gives up on anything it is
//! not sure of (a syntax error, a lone surrogate, the number marker as a key, an estimate over the
//! budget), and then the serde pass decides, so every body gets the estimate, the error and the
//! 4xx it got before. Its depth check also stands for the parse's (which skips its own scan).

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

/// A body whose parse tree was estimated and whose nesting was found within the depth asked for.
pub(crate) struct MeasuredBody<'a> {
    text: &'a [u8],
    /// The estimated bytes of its parsed tree ([`estimate_tree_bytes`]'s figure).
    pub tree_bytes: usize,
}

impl MeasuredBody<'_> {
    /// The parsed body. Its nesting was bounded by the measure, so the parse needs neither
    /// serde_json's recursion limit nor a depth scan of its own.
    pub(crate) fn parse<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        let mut de = serde_json::Deserializer::from_slice(self.text);
        de.disable_recursion_limit();
        let value = T::deserialize(&mut de)?;
        de.end()?;
        Ok(value)
    }
}

/// Measures `bytes` as [`estimate_tree_bytes`] does (the same figure, the same errors), by the
/// byte scan where it is sure of the answer and at most `budget`, by the serde pass otherwise. A
/// figure above `budget` always comes from the serde pass, so a body that is not JSON is refused
/// as such, never as too large.
pub(crate) fn measure_body(
    bytes: &[u8],
    max_depth: usize,
    budget: usize,
) -> Result<MeasuredBody<'_>, serde_json::Error> {
    let tree_bytes = match scan_tree_bytes(bytes, max_depth) {
        Some(tree_bytes) if tree_bytes <= budget => tree_bytes,
        _ => estimate_tree_bytes(bytes, max_depth)?,
    };
    Ok(MeasuredBody { text: bytes, tree_bytes })
}

/// [`CompactSize`]'s estimate of the tree `text` parses to, in one loop over the bytes; `None`
/// when the text is not plainly JSON nested at most `max_depth` deep, or holds what this scan
/// leaves to the serde pass (a lone surrogate escape, an object key that could be the number
/// marker). On JSON that serde_json reads, a figure is exactly [`estimate_tree_bytes`]'s (unit
/// `the_scan_agrees_with_the_serde_pass`). On other text a figure may be given (invalid UTF-8 in
/// a string is not looked for), and the parse that follows refuses the text; the depth found is
/// still the deepest the parse can reach, since the two agree on every byte before the parse's
/// error.
fn scan_tree_bytes(text: &[u8], max_depth: usize) -> Option<usize> {
    let mut scan = Scan { text, at: 0 };
    // Whether each open container is an object (else an array), innermost last.
    let mut open: Vec<bool> = Vec::new();
    let mut cost = 0usize;
    let mut want_value = true;
    loop {
        if want_value {
            scan.skip_whitespace();
            let leaf = match scan.next()? {
                container @ (b'{' | b'[') => {
                    if open.len() == max_depth {
                        return None;
                    }
                    let object = container == b'{';
                    cost = cost.saturating_add(NODE_BYTES);
                    scan.skip_whitespace();
                    if scan.peek() == Some(if object { b'}' } else { b']' }) {
                        scan.at += 1;
                        want_value = false;
                    } else {
                        open.push(object);
                        if object {
                            cost = cost.saturating_add(scan.entry_key()?);
                        }
                    }
                    continue;
                }
                b'"' => text_heap(scan.string_len()?),
                b't' => scan.literal(b"rue").map(|()| 0)?,
                b'f' => scan.literal(b"alse").map(|()| 0)?,
                b'n' => scan.literal(b"ull").map(|()| 0)?,
                first @ (b'-' | b'0'..=b'9') => text_heap(scan.number_len(first)?),
                _ => return None,
            };
            cost = cost.saturating_add(NODE_BYTES.saturating_add(leaf));
            want_value = false;
            continue;
        }
        scan.skip_whitespace();
        let Some(&object) = open.last() else {
            return (scan.at == text.len()).then_some(cost);
        };
        match (scan.next()?, object) {
            (b',', true) => {
                scan.skip_whitespace();
                cost = cost.saturating_add(scan.entry_key()?);
                want_value = true;
            }
            (b',', false) => want_value = true,
            (b'}', true) | (b']', false) => {
                open.pop();
            }
            _ => return None,
        }
    }
}

/// A cursor over the text [`scan_tree_bytes`] reads.
struct Scan<'a> {
    text: &'a [u8],
    at: usize,
}

impl Scan<'_> {
    fn peek(&self) -> Option<u8> {
        self.text.get(self.at).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let byte = self.peek()?;
        self.at += 1;
        Some(byte)
    }

    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.peek() {
            self.at += 1;
        }
    }

    fn literal(&mut self, rest: &[u8]) -> Option<()> {
        let end = self.at.checked_add(rest.len())?;
        (self.text.get(self.at..end)? == rest).then(|| self.at = end)
    }

    /// An object entry's key (its opening quote next, whitespace skipped) through the colon after
    /// it: what the entry costs besides its value. `None` for a key that is or could be the number
    /// marker (`CompactSize` reads such an object as a number).
    fn entry_key(&mut self) -> Option<usize> {
        if self.next()? != b'"' {
            return None;
        }
        let start = self.at;
        let len = self.string_len()?;
        let raw = &self.text[start..self.at - 1];
        if len == NUMBER_TOKEN.len() && (raw.len() != len || raw == NUMBER_TOKEN.as_bytes()) {
            return None;
        }
        self.skip_whitespace();
        if self.next()? != b':' {
            return None;
        }
        Some(ENTRY_BYTES.saturating_add(text_heap(len)))
    }

    /// A string's length unescaped (its opening quote read), reading through its closing quote.
    fn string_len(&mut self) -> Option<usize> {
        let mut len = 0usize;
        loop {
            match self.next()? {
                b'"' => return Some(len),
                b'\\' => len += self.escape_len()?,
                0..=0x1f => return None,
                _ => len += 1,
            }
        }
    }

    /// The bytes one escape (its backslash read) stands for in UTF-8.
    fn escape_len(&mut self) -> Option<usize> {
        match self.next()? {
            b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => Some(1),
            b'u' => match self.hex4()? {
                0xD800..=0xDBFF => {
                    // A leading surrogate: only a trailing one after it makes a character.
                    (self.literal(b"\\u").is_some() && matches!(self.hex4()?, 0xDC00..=0xDFFF)).then_some(4)
                }
                0xDC00..=0xDFFF => None,
                0..=0x7F => Some(1),
                0x80..=0x7FF => Some(2),
                _ => Some(3),
            },
            _ => None,
        }
    }

    fn hex4(&mut self) -> Option<u32> {
        let mut value = 0;
        for _ in 0..4 {
            value = value * 16 + char::from(self.next()?).to_digit(16)?;
        }
        Some(value)
    }

    /// A number's length as serde_json keeps its text (its first byte read): as written, but for
    /// an exponent without a sign, which gains a `+`.
    fn number_len(&mut self, first: u8) -> Option<usize> {
        let start = self.at - 1;
        let leading = if first == b'-' { self.next()? } else { first };
        match leading {
            b'0' => {}
            b'1'..=b'9' => {
                self.digits();
            }
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.at += 1;
            if self.digits() == 0 {
                return None;
            }
        }
        let mut added = 0;
        if let Some(b'e' | b'E') = self.peek() {
            self.at += 1;
            match self.peek() {
                Some(b'+' | b'-') => self.at += 1,
                _ => added = 1,
            }
            if self.digits() == 0 {
                return None;
            }
        }
        Some(self.at - start + added)
    }

    /// Skips ASCII digits; how many.
    fn digits(&mut self) -> usize {
        let start = self.at;
        while let Some(b'0'..=b'9') = self.peek() {
            self.at += 1;
        }
        self.at - start
    }
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

    /// Bodies of every kind of value, escape, number form and spacing the scan reads itself.
    const SCANNED: &[&str] = &[
        "{}",
        "[]",
        " \t\r\n{ } ",
        "null",
        "true",
        "false",
        "0",
        "-0",
        "7",
        "-42",
        "18446744073709551615",
        "18446744073709551616",
        "-9223372036854775809",
        "1.5",
        "-0.25",
        "1e5",
        "1E5",
        "1e+5",
        "1E-5",
        "-2.5e10",
        "123456789012345678901234567890.123456789e-300",
        "1e400",
        "\"\"",
        "\"plain text of some length, past one allocation's rounding\"",
        r#""escapes \" \\ \/ \b \f \n \r \t""#,
        r#""\u0041 \u00e9 \u20ac \ud83d\ude00 \u0000""#,
        "\"multi-byte: é € 😀\"",
        r#"{"docs":[{"_id":"b0000010000","type":"t0","n":0},{"_id":"b0000010001","type":"t1","n":1}]}"#,
        r#"{ "a" : [ 1 , 2.0 , -3e-2 , "x" , null , true , false , { } , [ ] ] , "b" : { "c" : { "d" : [ [ [ ] ] ] } } }"#,
        r#"{"key \u00e9\n":"v","":0,"\u0041":{"\ud83d\ude00":[]}}"#,
        r#"{"$serde_json::private::Numbe":1,"$serde_json::private::Numberx":2}"#,
    ];

    /// Strings and numbers of every length across a few of the allocator's 16-byte steps, so
    /// that a length off by one (an escape, an exponent's sign) changes the estimate.
    fn across_allocation_steps() -> Vec<String> {
        let mut bodies = Vec::new();
        for pad in 0..40 {
            let (letters, digits) = ("x".repeat(pad), "7".repeat(pad));
            for escape in [r"\u00e9", r"\u20ac", r"\ud83d\ude00", r"\n", r"\u0041", "é"] {
                bodies.push(format!("\"{letters}{escape}\""));
                bodies.push(format!("{{\"{letters}{escape}\":0}}"));
            }
            for number in
                [format!("1{digits}"), format!("-1{digits}"), format!("1{digits}e5"), format!("1.5{digits}E-5")]
            {
                bodies.push(number);
            }
        }
        bodies
    }

    /// On JSON serde_json reads, the byte scan gives exactly the serde pass's estimate (the
    /// figure the budgets take and the 413 compares): each body alone, and all of them in one
    /// array and one object.
    #[test]
    fn the_scan_agrees_with_the_serde_pass() {
        let mut left_to_serde = 0;
        for body in across_allocation_steps() {
            let expected = estimate_tree_bytes(body.as_bytes(), 8).unwrap_or_else(|e| panic!("{body}: {e}"));
            match scan_tree_bytes(body.as_bytes(), 8) {
                Some(figure) => assert_eq!(figure, expected, "{body}"),
                // An escaped key as long as the number marker: the serde pass reads it.
                None => left_to_serde += 1,
            }
            assert_eq!(measure_body(body.as_bytes(), 8, usize::MAX).unwrap().tree_bytes, expected, "{body}");
        }
        assert!(left_to_serde <= 5, "{left_to_serde} bodies left to the serde pass");
        let array = format!("[{}]", SCANNED.join(","));
        let object = format!(
            "{{{}}}",
            SCANNED.iter().enumerate().map(|(at, body)| format!("\"k{at}\":{body}")).collect::<Vec<_>>().join(",")
        );
        for body in SCANNED.iter().copied().chain([array.as_str(), object.as_str()]) {
            let expected = estimate_tree_bytes(body.as_bytes(), 8).unwrap_or_else(|e| panic!("{body}: {e}"));
            assert_eq!(scan_tree_bytes(body.as_bytes(), 8), Some(expected), "{body}");
            assert_eq!(measure_body(body.as_bytes(), 8, usize::MAX).unwrap().tree_bytes, expected, "{body}");
        }
    }

    /// What the scan leaves to the serde pass: text that is not JSON (whose error the serde pass
    /// gives, as before), nesting past the depth, lone surrogates, keys that are or may be the
    /// number marker.
    #[test]
    fn the_scan_leaves_what_it_is_unsure_of_to_the_serde_pass() {
        let not_json = [
            "",
            " ",
            "{",
            "[1,]",
            "[1 2]",
            "{\"a\"}",
            "{\"a\" 1}",
            "{\"a\":1,}",
            "{1:2}",
            "01",
            "1.",
            "1e",
            "-",
            ".5",
            "+1",
            "tru",
            "nul",
            "[1]]",
            "{} x",
            "\"a",
            "\"\\x\"",
            "\"\\u12G4\"",
            "\"tab\there\"",
            "[\"\\ud800\"]",
            "\"\\udc00\"",
            "\"\\ud800\\u0041\"",
        ];
        for body in not_json {
            assert_eq!(scan_tree_bytes(body.as_bytes(), 8), None, "{body:?}");
            assert!(measure_body(body.as_bytes(), 8, usize::MAX).is_err(), "{body:?}");
        }
        let marker = r#"{"$serde_json::private::Number":"12.5e3"}"#;
        let escaped_key = r#"{"\u0024serde_json::private::Number":"12"}"#;
        for body in [marker, escaped_key] {
            assert_eq!(scan_tree_bytes(body.as_bytes(), 8), None, "{body}");
            let expected = estimate_tree_bytes(body.as_bytes(), 8).unwrap();
            assert_eq!(measure_body(body.as_bytes(), 8, usize::MAX).unwrap().tree_bytes, expected);
        }
        let nested = |depth: usize| format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        assert!(scan_tree_bytes(nested(200).as_bytes(), 200).is_some());
        assert_eq!(scan_tree_bytes(nested(201).as_bytes(), 200), None);
        let deep = measure_body(nested(201).as_bytes(), 200, usize::MAX).err().map(|e| e.to_string());
        assert!(deep.is_some_and(|e| e.contains("201 levels")), "the serde pass's depth error");
    }

    /// A figure over the budget comes from the serde pass: text that is not JSON is refused as
    /// such even when the scan's figure for it is large.
    #[test]
    fn a_figure_over_the_budget_is_the_serde_passes() {
        let numbers = format!("[{}1]", "1,".repeat(1_000));
        let exact = estimate_tree_bytes(numbers.as_bytes(), 8).unwrap();
        assert_eq!(measure_body(numbers.as_bytes(), 8, 10).unwrap().tree_bytes, exact);
        // Invalid UTF-8 in a string: the scan does not look for it, the serde pass refuses it.
        let mut invalid = format!("[{}\"", "1,".repeat(1_000)).into_bytes();
        invalid.extend_from_slice(&[0xff, b'"', b']']);
        assert!(scan_tree_bytes(&invalid, 8).is_some_and(|figure| figure > 10));
        assert!(measure_body(&invalid, 8, 10).is_err());
        assert!(measure_body(&invalid, 8, usize::MAX).is_ok_and(|measured| measured.parse::<Value>().is_err()));
    }
}
