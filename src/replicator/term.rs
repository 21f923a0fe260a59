//! The few shapes of Erlang's external term format (`term_to_binary(T, [{minor_version, 1}])`,
//! CouchDB's `?term_to_bin`) a replication id is the MD5 of ([`super::ids`]): atoms, binaries,
//! byte strings, integers, floats, lists and tuples, and CouchDB's EJSON form of a JSON value
//! (objects as `{[{Key, Value}]}`, strings as binaries, `true`/`false`/`null` as atoms).
//!
//! Written here rather than taken from a crate: no Rust crate of the format is in the tree or in
//! the registries' lists this project draws from, and the subset is a page of code. The tags and
//! their layouts are the format's published ones (`erts/doc/guides/erl_ext_dist.md`); with
//! `minor_version` 1 an atom is `ATOM_EXT` (Latin-1, a 16-bit length) and a float `NEW_FLOAT_EXT`.

use serde_json::Value;

const VERSION: u8 = 131;
const NEW_FLOAT_EXT: u8 = 70;
const SMALL_INTEGER_EXT: u8 = 97;
const INTEGER_EXT: u8 = 98;
const ATOM_EXT: u8 = 100;
const SMALL_TUPLE_EXT: u8 = 104;
const LARGE_TUPLE_EXT: u8 = 105;
const NIL_EXT: u8 = 106;
const STRING_EXT: u8 = 107;
const LIST_EXT: u8 = 108;
const BINARY_EXT: u8 = 109;
const SMALL_BIG_EXT: u8 = 110;
const LARGE_BIG_EXT: u8 = 111;

/// An Erlang term of the shapes a replication id is made of.
#[derive(Debug, Clone, PartialEq)]
pub enum Term {
    Atom(&'static str),
    Binary(Vec<u8>),
    /// A list of bytes (`"abc"` in Erlang: what `binary_to_list` and ibrowse's URL parts are).
    Bytes(Vec<u8>),
    Integer(i128),
    Float(f64),
    List(Vec<Term>),
    Tuple(Vec<Term>),
}

impl Term {
    pub fn binary(text: &str) -> Term {
        Term::Binary(text.as_bytes().to_vec())
    }

    pub fn string(text: &str) -> Term {
        Term::Bytes(text.as_bytes().to_vec())
    }

    /// A JSON value as CouchDB's JSON decoder (jiffy) hands it over: EJSON.
    pub fn ejson(value: &Value) -> Term {
        match value {
            Value::Null => Term::Atom("null"),
            Value::Bool(true) => Term::Atom("true"),
            Value::Bool(false) => Term::Atom("false"),
            Value::String(text) => Term::binary(text),
            Value::Number(number) => number_term(number),
            Value::Array(items) => Term::List(items.iter().map(Term::ejson).collect()),
            Value::Object(members) => Term::Tuple(vec![Term::List(
                members.iter().map(|(key, value)| Term::Tuple(vec![Term::binary(key), Term::ejson(value)])).collect(),
            )]),
        }
    }

    /// `term_to_binary(Term, [{minor_version, 1}])`.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![VERSION];
        self.write(&mut out);
        out
    }

    fn write(&self, out: &mut Vec<u8>) {
        match self {
            Term::Atom(name) => {
                out.push(ATOM_EXT);
                out.extend_from_slice(&(name.len() as u16).to_be_bytes());
                out.extend_from_slice(name.as_bytes());
            }
            Term::Binary(bytes) => {
                out.push(BINARY_EXT);
                out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
                out.extend_from_slice(bytes);
            }
            Term::Bytes(bytes) if bytes.is_empty() => out.push(NIL_EXT),
            Term::Bytes(bytes) if bytes.len() <= usize::from(u16::MAX) => {
                out.push(STRING_EXT);
                out.extend_from_slice(&(bytes.len() as u16).to_be_bytes());
                out.extend_from_slice(bytes);
            }
            // Longer byte lists are ordinary lists of small integers.
            Term::Bytes(bytes) => Term::List(bytes.iter().map(|b| Term::Integer(i128::from(*b))).collect()).write(out),
            Term::Integer(n) => write_integer(*n, out),
            Term::Float(f) => {
                out.push(NEW_FLOAT_EXT);
                out.extend_from_slice(&f.to_bits().to_be_bytes());
            }
            Term::List(items) if items.is_empty() => out.push(NIL_EXT),
            Term::List(items) => {
                out.push(LIST_EXT);
                out.extend_from_slice(&(items.len() as u32).to_be_bytes());
                for item in items {
                    item.write(out);
                }
                out.push(NIL_EXT);
            }
            Term::Tuple(items) => {
                if items.len() <= usize::from(u8::MAX) {
                    out.push(SMALL_TUPLE_EXT);
                    out.push(items.len() as u8);
                } else {
                    out.push(LARGE_TUPLE_EXT);
                    out.extend_from_slice(&(items.len() as u32).to_be_bytes());
                }
                for item in items {
                    item.write(out);
                }
            }
        }
    }
}

/// A JSON number as jiffy decodes it: an integer when written without a fraction or exponent,
/// else a float.
fn number_term(number: &serde_json::Number) -> Term {
    let text = number.to_string();
    if !text.contains(['.', 'e', 'E']) {
        if let Ok(n) = text.parse::<i128>() {
            return Term::Integer(n);
        }
    }
    Term::Float(text.parse::<f64>().unwrap_or(0.0))
}

fn write_integer(n: i128, out: &mut Vec<u8>) {
    if (0..=255).contains(&n) {
        out.push(SMALL_INTEGER_EXT);
        out.push(n as u8);
    } else if i32::try_from(n).is_ok() {
        out.push(INTEGER_EXT);
        out.extend_from_slice(&(n as i32).to_be_bytes());
    } else {
        let mut magnitude = n.unsigned_abs();
        let mut digits = Vec::new();
        while magnitude > 0 {
            digits.push((magnitude & 0xff) as u8);
            magnitude >>= 8;
        }
        if digits.len() <= usize::from(u8::MAX) {
            out.push(SMALL_BIG_EXT);
            out.push(digits.len() as u8);
        } else {
            out.push(LARGE_BIG_EXT);
            out.extend_from_slice(&(digits.len() as u32).to_be_bytes());
        }
        out.push(u8::from(n < 0));
        out.extend_from_slice(&digits);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Byte sequences as Erlang/OTP's `term_to_binary(T, [{minor_version, 1}])` writes them
    /// (worked from the format's specification, one per tag used).
    #[test]
    fn each_shape_as_the_format_lays_it_out() {
        assert_eq!(Term::Atom("undefined").encode()[..4], [131, 100, 0, 9]);
        assert_eq!(Term::binary("ab").encode(), [131, 109, 0, 0, 0, 2, b'a', b'b']);
        assert_eq!(Term::string("ab").encode(), [131, 107, 0, 2, b'a', b'b']);
        assert_eq!(Term::string("").encode(), [131, 106]);
        assert_eq!(Term::Integer(7).encode(), [131, 97, 7]);
        assert_eq!(Term::Integer(15984).encode(), [131, 98, 0, 0, 0x3e, 0x70]);
        assert_eq!(Term::Integer(-1).encode(), [131, 98, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(Term::Integer(1 << 40).encode(), [131, 110, 6, 0, 0, 0, 0, 0, 0, 1]);
        assert_eq!(Term::Float(1.5).encode(), [131, 70, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0]);
        assert_eq!(Term::List(vec![Term::Integer(1)]).encode(), [131, 108, 0, 0, 0, 1, 97, 1, 106]);
        assert_eq!(Term::Tuple(vec![Term::Integer(1), Term::Integer(2)]).encode(), [131, 104, 2, 97, 1, 97, 2]);
        let object = Term::ejson(&serde_json::json!({"a": true}));
        assert_eq!(
            object.encode(),
            [131, 104, 1, 108, 0, 0, 0, 1, 104, 2, 109, 0, 0, 0, 1, b'a', 100, 0, 4, b't', b'r', b'u', b'e', 106]
        );
    }
}
