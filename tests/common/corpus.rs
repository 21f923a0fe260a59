//! The round-trip corpus of `fixtures/values/roundtrip.json`, with its generated cases built.
//!
//! Cases carrying a literal `value` are used as they are. Cases with a structured `generate`
//! spec are built as the file's `about` describes; the few whose `generate` is prose are built
//! here to match that prose (comments say how).

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use serde_json::{json, Map, Value};

pub struct Case {
    pub name: String,
    pub value: Value,
}

const CORPUS: &str = include_str!("../../fixtures/values/roundtrip.json");

/// Every case of the corpus, values built.
pub fn cases() -> Vec<Case> {
    let file: Value = serde_json::from_str(CORPUS).expect("roundtrip.json is JSON");
    file["cases"]
        .as_array()
        .expect("cases array")
        .iter()
        .map(|case| {
            let name = case["name"].as_str().expect("case name").to_owned();
            let value = match (case.get("value"), case.get("generate")) {
                (Some(value), _) => value.clone(),
                (None, Some(spec)) => generate(&name, spec),
                (None, None) => panic!("corpus case {name} has neither value nor generate"),
            };
            Case { name, value }
        })
        .collect()
}

fn generate(name: &str, spec: &Value) -> Value {
    match spec {
        Value::String(_) => prose_case(name),
        Value::Object(spec) => structured_case(name, spec),
        other => panic!("corpus case {name}: unexpected generate spec {other}"),
    }
}

fn number(text: &str) -> Value {
    serde_json::from_str(text).expect("number literal")
}

/// The cases whose `generate` is a sentence.
fn prose_case(name: &str) -> Value {
    match name {
        // "NUL and control characters inside strings": every C0 control, DEL and C1 NEL, in a
        // value string and in a field name.
        "control-chars" => {
            let all: String = (0u32..0x20).chain([0x7f, 0x85]).filter_map(char::from_u32).collect();
            json!({ "text": format!("a{all}z"), "nul\u{0}key": "\u{0}", "list": ["\u{0}", "\t\n\r", "\u{1b}[0m"] })
        }
        // "not representable as a double": 2^53 + 1.
        "int53-plus-one" => number("9007199254740993"),
        // "outside int64": u64::MAX.
        "uint64-max" => number("18446744073709551615"),
        // "outside 64-bit integers entirely": 38-digit integers, both signs.
        "38-digits" => {
            json!([number("12345678901234567890123456789012345678"), number("-99999999999999999999999999999999999999")])
        }
        // "some stores forbid an array directly inside an array".
        "nested-arrays" => json!([[1, 2], [[3], []], [[[[]]]], [["a", {"b": [[null]]}]]]),
        // "names that some stores reserve or forbid": empty, dunder, dots, slashes, `$`, ids.
        "odd-field-names" => json!({
            "": "empty",
            "__name__": 1,
            "__x__": 2,
            "_id": "not-the-id",
            "_rev": "not-the-rev",
            "$ref": 3,
            "$": 4,
            ".": 5,
            "..": 6,
            "a.b": 7,
            "a/b": 8,
            "`backtick`": 9,
            "key": 10,
            "value": 11,
            " ": 12,
            "#": 13,
            "[0]": 14,
            "ünï 🚀": 15,
            "nested": {"": {"__name__": {".": [{"": null}]}}}
        }),
        other => panic!("corpus case {other} has a prose generate spec this helper does not know"),
    }
}

fn structured_case(name: &str, spec: &Map<String, Value>) -> Value {
    let usize_of = |field: &str| spec[field].as_u64().unwrap_or_else(|| panic!("{name}: {field}")) as usize;
    if let Some(kind) = spec.get("nest") {
        let mut value = spec["leaf"].clone();
        for _ in 0..usize_of("depth") {
            value = match kind.as_str() {
                Some("object") => json!({ "d": value }),
                Some("array") => json!([value]),
                _ => panic!("{name}: nest must be object or array"),
            };
        }
        return value;
    }
    if spec.contains_key("object_keys") {
        return Value::Object((0..usize_of("object_keys")).map(|i| (format!("k{i}"), spec["value"].clone())).collect());
    }
    if spec.contains_key("array_len") {
        return Value::Array(vec![spec["value"].clone(); usize_of("array_len")]);
    }
    if let Some(unit) = spec.get("repeat") {
        return Value::String(unit.as_str().expect("repeat string").repeat(usize_of("times")));
    }
    if spec.contains_key("random_base64_bytes") {
        let mut rng = SplitMix64(spec["seed"].as_u64().expect("seed"));
        return Value::String(STANDARD.encode(rng.bytes(usize_of("random_base64_bytes"))));
    }
    if spec.contains_key("object_of_random_strings") {
        let mut rng = SplitMix64(spec["seed"].as_u64().expect("seed"));
        let each = usize_of("bytes_each");
        return Value::Object(
            (0..usize_of("object_of_random_strings"))
                .map(|i| (format!("f{i}"), Value::String(STANDARD.encode(rng.bytes(each)))))
                .collect(),
        );
    }
    panic!("corpus case {name}: unknown generate spec {spec:?}")
}

/// A small seeded PRNG (SplitMix64); the corpus allows any.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(n + 8);
        while out.len() < n {
            out.extend_from_slice(&self.next().to_le_bytes());
        }
        out.truncate(n);
        out
    }
}

/// `len` characters of xorshift noise from `state`: text gzip cannot shrink much, so a body of it
/// goes to chunks where a backend stores large bodies in chunks.
pub fn noise(len: usize, mut state: u64) -> String {
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            char::from(b'!' + (state % 90) as u8)
        })
        .collect()
}
