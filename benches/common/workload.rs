//! The workload of the adapter benches: 1 user × 10 namespaces × 100 keys seeded with the
//! facade's document bodies, the ~100-byte values `set` writes, the fixed permutation that keeps
//! concurrent clients on different documents, and the five measured operations.

use agentstore::model::document::{new_body, Access};
use agentstore::model::{id::encode_key, timestamp, DocumentId, Limits};
use serde_json::{json, Map, Value};

use super::describe;

pub const USER: &str = "bench-user";
pub const NAMESPACES: usize = 10;
pub const KEYS_PER_NAMESPACE: usize = 100;
pub const TOTAL_KEYS: usize = NAMESPACES * KEYS_PER_NAMESPACE;
pub const AGENT: &str = "bench-agent";

/// A measured operation: the facade's call and the raw calls it stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pair {
    Get,
    GetTracked,
    Set,
    ListKeys,
    GetAll,
}

impl Pair {
    pub fn name(self) -> &'static str {
        match self {
            Pair::Get => "get",
            Pair::GetTracked => "get+track",
            Pair::Set => "set",
            Pair::ListKeys => "list_keys",
            Pair::GetAll => "get_all",
        }
    }

    pub fn json_name(self) -> &'static str {
        match self {
            Pair::Get => "get_untracked",
            Pair::GetTracked => "get_tracked",
            Pair::Set => "set_update",
            Pair::ListKeys => "list_keys",
            Pair::GetAll => "get_all",
        }
    }
}

/// The `i`-th seeded document: (namespace, key).
pub fn document(i: usize) -> (String, String) {
    let i = i % TOTAL_KEYS;
    (format!("ns-{}", i / KEYS_PER_NAMESPACE), format!("key-{:03}", i % KEYS_PER_NAMESPACE))
}

/// The `seq`-th operation's document: a fixed permutation of the key space, so concurrent clients
/// touch different documents.
pub fn spread(seq: u64) -> usize {
    // 7919 is prime and coprime with 1000, so this visits every key once per 1000 operations.
    ((seq % TOTAL_KEYS as u64) * 7919 % TOTAL_KEYS as u64) as usize
}

/// A value of about 100 bytes of compact JSON.
pub fn value(seq: u64) -> Value {
    json!({ "text": "the quick brown fox jumps over the lazy dog", "seq": seq, "tags": ["bench", "overhead"], "ok": true })
}

/// The metadata `set` merges; `source` is the bench's name.
pub fn metadata(source: &str, seq: u64) -> Value {
    json!({ "source": source, "seq": seq })
}

/// What one operation works on, built before its clock starts.
pub struct Input {
    pub namespace: String,
    pub key: String,
    /// The document id (`user:namespace:base64url(key)`), for the raw side.
    pub id: String,
    pub value: Value,
    pub metadata: Value,
}

impl Input {
    /// The `seq`-th operation of `pair`: a spread document, or for listings one of the namespaces in
    /// turn; `set` gets a fresh value and metadata from `source`.
    pub fn new(pair: Pair, seq: u64, source: &str) -> Input {
        let (namespace, key) = match pair {
            Pair::ListKeys | Pair::GetAll => (format!("ns-{}", seq % NAMESPACES as u64), String::new()),
            _ => document(spread(seq)),
        };
        let id = format!("{USER}:{namespace}:{}", encode_key(&key));
        let (value, metadata) = match pair {
            Pair::Set => (value(seq), metadata(source, seq)),
            _ => (Value::Null, Value::Null),
        };
        Input { namespace, key, id, value, metadata }
    }
}

/// A listing must find the whole namespace.
pub fn check_listing(pair: Pair, namespace: &str, found: usize) -> Result<(), String> {
    if found == KEYS_PER_NAMESPACE {
        Ok(())
    } else {
        Err(format!("{} of {namespace} found {found} documents, expected {KEYS_PER_NAMESPACE}", pair.name()))
    }
}

/// A document body as the facade writes it on creation: (id, body).
pub fn body(
    namespace: &str,
    key: &str,
    seq: u64,
    source: &str,
    limits: &Limits,
) -> Result<(String, Map<String, Value>), String> {
    let id = DocumentId::new(USER, namespace, key, limits).map_err(|e| describe(&e))?;
    let Value::Object(metadata) = metadata(source, seq) else { unreachable!("metadata is an object") };
    let access = Access { agent: Some(AGENT), at: timestamp::now() };
    let body = new_body(&id, value(seq), Some(metadata), &access);
    Ok((id.as_str().to_owned(), body))
}
