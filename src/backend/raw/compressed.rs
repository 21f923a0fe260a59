//! The `json+gzip` body format: a body the store cannot hold natively, as gzip-compressed JSON
//! split into pieces of at most one item's size. Shared by the DynamoDB and Firestore codecs, which
//! each say where the pieces go (the main item's `_body`, then chunk items or chunk documents).

use std::io::{Read, Write};

use serde_json::{Map, Value};

use crate::error::{Error, ErrorKind, Result};

/// The `_format` value of a body stored this way.
pub const FORMAT_JSON_GZIP: &str = "json+gzip";

/// A body compressed for storage.
pub struct Compressed {
    /// The size of the body's compact JSON, for messages.
    pub json_bytes: usize,
    /// The gzip stream of that JSON.
    pub bytes: Vec<u8>,
}

impl Compressed {
    /// The stream in pieces of at most `chunk_bytes`: the first (empty for an empty stream) goes in
    /// the main item, the rest in chunks, in order.
    pub fn split(&self, chunk_bytes: usize) -> (Vec<u8>, Vec<Vec<u8>>) {
        let mut pieces = self.bytes.chunks(chunk_bytes).map(<[u8]>::to_vec);
        let first = pieces.next().unwrap_or_default();
        (first, pieces.collect())
    }
}

/// Serialises and compresses the body of document `id`.
pub fn compress(id: &str, body: &Map<String, Value>) -> Result<Compressed> {
    let json = serde_json::to_vec(body)
        .map_err(|e| Error::new(ErrorKind::Internal, format!("cannot serialise document {id:?}")).with_source(e))?;
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder
        .write_all(&json)
        .and_then(|()| encoder.finish())
        .map(|bytes| Compressed { json_bytes: json.len(), bytes })
        .map_err(|e| Error::new(ErrorKind::Internal, format!("cannot compress document {id:?}")).with_source(e))
}

/// The most a deletion's fields take, compressed, in a tombstone of a store that keeps them in
/// the tombstone's own record (DynamoDB, Firestore: tombstones are not chunked).
pub const MAX_TOMBSTONE_BODY_BYTES: usize = 350_000;

/// The fields a deletion of `id` carried, compressed for its tombstone; `None` when it carried
/// none. Past [`MAX_TOMBSTONE_BODY_BYTES`] compressed, `TooLarge` naming the bound and `store`.
pub fn compress_deletion(id: &str, body: &Map<String, Value>, store: &str) -> Result<Option<Vec<u8>>> {
    if body.is_empty() {
        return Ok(None);
    }
    let compressed = compress(id, body)?;
    if compressed.bytes.len() > MAX_TOMBSTONE_BODY_BYTES {
        return Err(Error::new(
            ErrorKind::TooLarge,
            format!(
                "the deletion of {id:?} carries {} bytes of fields ({} compressed); a {store} tombstone keeps at \
                 most {MAX_TOMBSTONE_BODY_BYTES} compressed",
                compressed.json_bytes,
                compressed.bytes.len()
            ),
        ));
    }
    Ok(Some(compressed.bytes))
}

/// The body whose stream starts with `first` and continues in `extra_chunks`, in order;
/// `corrupt` turns a problem ("has a _body that …") into the adapter's error for this document.
pub fn decompress(
    mut first: Vec<u8>,
    extra_chunks: &[Vec<u8>],
    corrupt: impl Fn(&str) -> Error,
) -> Result<Map<String, Value>> {
    for chunk in extra_chunks {
        first.extend_from_slice(chunk);
    }
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(first.as_slice())
        .read_to_end(&mut json)
        .map_err(|e| corrupt(&format!("has a _body that does not decompress: {e}")))?;
    crate::model::depth::parse_stored(&json)
        .map_err(|e| corrupt(&format!("has a _body that is not a JSON object: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn split_pieces_decompress_to_the_body() {
        let body = json!({"userId": "u", "value": "x".repeat(10_000)}).as_object().unwrap().clone();
        let compressed = compress("u:n:aw==", &body).unwrap();
        let (first, rest) = compressed.split(16);
        assert!(first.len() == 16 && !rest.is_empty());
        let corrupt = |problem: &str| Error::new(ErrorKind::Corrupt, problem.to_owned());
        assert_eq!(decompress(first.clone(), &rest, corrupt).unwrap(), body);
        // A missing piece is corruption, not a panic.
        let err = decompress(first, &rest[1..], corrupt).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt);
    }
}
