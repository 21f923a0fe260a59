//! PUT bodies: read within the body limit and a server-wide budget, checked by a streaming pass
//! over the raw bytes, and only then parsed into a JSON tree.
//!
//! Why: a parsed `serde_json::Value` costs many times its text here (under `arbitrary_precision`
//! every number is a heap string; under `preserve_order` every object an `IndexMap`): about 50×
//! for an array of one-digit numbers. So the streaming pass measures the compact size of `value`
//! and `metadata`, and the body's shape, without allocating for its content; a tree is built only
//! for a body whose parts are within the limits, and the same pass estimates what that tree will
//! cost (the measure is `crate::server::tree_size`'s). The budgets ([`BodyBudget`], of
//! `crate::server::ByteBudget`s) bound the raw body bytes being read and the estimated tree
//! memory being parsed and stored at once across the server, so the total under concurrent large
//! requests is bounded too: requests beyond them wait for earlier ones to finish.

use std::fmt;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, StatusCode};
use futures::StreamExt;
use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};
use tokio::sync::OwnedSemaphorePermit;

use super::error::ApiError;
use crate::model::Limits;
use crate::server::tree_size::{CompactSize, NUMBER_TOKEN};
use crate::server::ByteBudget;

/// How many trees of a value's size a write holds at its peak: the parsed body (moved, never
/// copied, into the stored document) and the stored document it replaces, which the facade reads
/// first and which can be as large.
const TREE_COPIES: usize = 2;

/// The server-wide budgets for PUT bodies, and the limits a body must meet. Two budgets, taken
/// in order (raw bytes, then parsed trees) and each released only by a request holding both or
/// the first alone, so waiting for the second never blocks the requests that hold it.
pub struct BodyBudget {
    raw: ByteBudget,
    trees: ByteBudget,
    body_limit: usize,
    limits: Limits,
}

/// A parsed PUT body. Holds its share of the budgets until dropped (after the response is built).
pub struct PutBody {
    pub value: Value,
    pub metadata: Option<Value>,
    _shares: (OwnedSemaphorePermit, OwnedSemaphorePermit),
}

impl BodyBudget {
    /// `raw_bytes` of bodies being read and `tree_bytes` of parsed bodies (estimated), server-wide.
    pub fn new(raw_bytes: usize, tree_bytes: usize, body_limit: usize, limits: Limits) -> Self {
        BodyBudget { raw: ByteBudget::new(raw_bytes), trees: ByteBudget::new(tree_bytes), body_limit, limits }
    }

    /// Reads, checks and parses a PUT body: `{"value": …, "metadata": {…}}`.
    pub async fn read_put_body(&self, headers: &HeaderMap, body: Body) -> Result<PutBody, ApiError> {
        require_json(headers)?;
        let declared = declared_length(headers)?;
        if let Some(length) = declared.filter(|&length| length > self.body_limit) {
            return Err(body_too_large(length, self.body_limit));
        }
        // A body of unknown length (chunked) may be as large as the limit.
        let raw_share = self.raw.take(declared.unwrap_or(self.body_limit)).await?;
        let bytes = read_limited(body, declared, self.body_limit).await?;
        let outline = outline(&bytes)?;
        for (field, size) in [("value", outline.value), ("metadata", outline.metadata)] {
            if let Some(size) = size {
                self.limits.check_json_size(field, size).map_err(ApiError::from)?;
            }
        }
        let tree_share = self.trees.take(outline.tree_bytes.saturating_mul(TREE_COPIES)).await?;
        let mut fields: Map<String, Value> =
            serde_json::from_slice(&bytes).map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
        drop(bytes);
        let value = fields.remove("value").ok_or_else(|| unprocessable("the body has no `value` field".into()))?;
        Ok(PutBody { value, metadata: fields.remove("metadata"), _shares: (raw_share, tree_share) })
    }
}

fn unprocessable(reason: String) -> ApiError {
    ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "bad_body", reason)
}

fn body_too_large(length: usize, limit: usize) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "too_large",
        format!("the request body is {length} bytes; the limit is {limit} bytes"),
    )
}

fn require_json(headers: &HeaderMap) -> Result<(), ApiError> {
    let is_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .map(|mime| {
            let mime = mime.trim().to_ascii_lowercase();
            mime == "application/json" || mime.ends_with("+json")
        })
        .unwrap_or(false);
    if is_json {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "bad_content_type",
            "the body must be JSON with Content-Type: application/json",
        ))
    }
}

fn declared_length(headers: &HeaderMap) -> Result<Option<usize>, ApiError> {
    headers
        .get(header::CONTENT_LENGTH)
        .map(|v| {
            v.to_str()
                .ok()
                .and_then(|text| text.trim().parse::<u64>().ok())
                .map(|length| usize::try_from(length).unwrap_or(usize::MAX))
                .ok_or_else(|| ApiError::bad_request("invalid Content-Length header"))
        })
        .transpose()
}

/// The body's bytes, refused with 413 as soon as they pass `limit`.
async fn read_limited(body: Body, declared: Option<usize>, limit: usize) -> Result<Bytes, ApiError> {
    let mut stream = body.into_data_stream();
    let mut bytes = Vec::with_capacity(declared.unwrap_or(0).min(limit));
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ApiError::bad_request(format!("cannot read the request body: {e}")))?;
        if bytes.len() + chunk.len() > limit {
            return Err(body_too_large(bytes.len() + chunk.len(), limit));
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(bytes))
}

/// What the streaming pass learns: the compact JSON size of `value` and `metadata`, if present,
/// and an estimate of the memory the parsed tree of the whole body will take.
#[derive(Debug, Default, PartialEq, Eq)]
struct Outline {
    value: Option<usize>,
    metadata: Option<usize>,
    tree_bytes: usize,
}

/// The streaming pass: the body must be one JSON object with a `value` and optionally a
/// `metadata` field, each at most once, and nothing else.
fn outline(bytes: &[u8]) -> Result<Outline, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let shape = de.deserialize_any(OutlineVisitor).and_then(|shape| de.end().map(|()| shape));
    match shape.map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))? {
        Shape::NotObject => {
            Err(unprocessable("the body must be a JSON object {\"value\": …, \"metadata\": {…}}".into()))
        }
        Shape::Unknown(field) => {
            Err(unprocessable(format!("unknown body field {field:?}; only `value` and `metadata` are accepted")))
        }
        Shape::Duplicate(field) => Err(unprocessable(format!("the body has more than one `{field}` field"))),
        Shape::Object(outline) if outline.value.is_none() => Err(unprocessable("the body has no `value` field".into())),
        Shape::Object(outline) => Ok(outline),
    }
}

enum Shape {
    Object(Outline),
    NotObject,
    Unknown(String),
    Duplicate(&'static str),
}

struct OutlineVisitor;

impl<'de> Visitor<'de> for OutlineVisitor {
    type Value = Shape;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Shape, A::Error> {
        let mut outline = Outline::default();
        let mut tree_bytes = 0usize;
        let mut problem = None;
        while let Some(key) = map.next_key::<String>()? {
            let slot = match key.as_str() {
                NUMBER_TOKEN => {
                    map.next_value::<IgnoredAny>()?;
                    return Ok(Shape::NotObject);
                }
                "value" => Some((&mut outline.value, "value")),
                "metadata" => Some((&mut outline.metadata, "metadata")),
                _ => None,
            };
            match slot {
                Some((slot, name)) => {
                    let measure = map.next_value_seed(CompactSize)?;
                    tree_bytes = tree_bytes.saturating_add(measure.cost);
                    if slot.replace(measure.size).is_some() {
                        problem.get_or_insert(Shape::Duplicate(name));
                    }
                }
                None => {
                    map.next_value::<IgnoredAny>()?;
                    problem.get_or_insert(Shape::Unknown(key));
                }
            }
        }
        outline.tree_bytes = tree_bytes;
        Ok(problem.unwrap_or(Shape::Object(outline)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Shape, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Shape::NotObject)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Shape, E> {
        Ok(Shape::NotObject)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Shape, E> {
        Ok(Shape::NotObject)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Shape, E> {
        Ok(Shape::NotObject)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Shape, E> {
        Ok(Shape::NotObject)
    }

    fn visit_str<E>(self, _: &str) -> Result<Shape, E> {
        Ok(Shape::NotObject)
    }

    fn visit_unit<E>(self) -> Result<Shape, E> {
        Ok(Shape::NotObject)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::validate::json_size;

    /// The streaming pass agrees with the size of the parsed tree, on every shape of JSON.
    #[test]
    fn compact_sizes_match_the_parsed_tree() {
        let value = r#" { "a" : [ 1 , -2.50 , 1E5 , 3.141592653589793238462643383279 , true , false , null ] ,
            "b\"\n\u00e9\/" : { } , "c" : [ ] , "d" : "x\u0001y" , "e" : { "f" : { "g" : [ [ ] , { } ] } } ,
            "n" : 123456789012345678901234567890 } "#;
        for text in [value, "1", "-0", "\"\"", "[]", "{}", "null", "[1E400]", "\"\\ud83d\\ude00\""] {
            let body = format!(r#"{{"value": {text}, "metadata": {{"m": {text}}}}}"#);
            let outline = outline(body.as_bytes()).unwrap();
            let tree: Value = serde_json::from_str(text).unwrap();
            assert_eq!(outline.value, Some(json_size(&tree)), "{text}");
            assert_eq!(outline.metadata, Some(json_size(&serde_json::json!({ "m": tree }))), "{text}");
        }
    }

    #[test]
    fn shapes_are_checked_before_parsing() {
        let reason = |body: &str| outline(body.as_bytes()).unwrap_err();
        for (body, status, mention) in [
            ("[1]", StatusCode::UNPROCESSABLE_ENTITY, "object"),
            ("1", StatusCode::UNPROCESSABLE_ENTITY, "object"),
            ("\"x\"", StatusCode::UNPROCESSABLE_ENTITY, "object"),
            ("{}", StatusCode::UNPROCESSABLE_ENTITY, "value"),
            (r#"{"value": 1, "x": 2}"#, StatusCode::UNPROCESSABLE_ENTITY, "\"x\""),
            (r#"{"value": 1, "value": 2}"#, StatusCode::UNPROCESSABLE_ENTITY, "more than one"),
            (r#"{"value": 1} x"#, StatusCode::BAD_REQUEST, "JSON"),
            (r#"{"value": [1, }"#, StatusCode::BAD_REQUEST, "JSON"),
        ] {
            let err = reason(body);
            assert_eq!(err.status, status, "{body}: {err:?}");
            assert!(err.reason.contains(mention), "{body}: {err:?}");
        }
        let deep = format!(r#"{{"value": {}{}}}"#, "[".repeat(200), "]".repeat(200));
        assert_eq!(reason(&deep).status, StatusCode::BAD_REQUEST);
    }
}
