//! `GET/POST /{db}/_local_docs`: local documents (replication checkpoints) listed as `_all_docs`
//! lists documents, for every database (the data-store one included): the handler is
//! `super::db`'s, reading the request with [`ListingRequest`] and answering through [`answer`].
//!
//! As CouchDB 3.4.3 answers it (`couch_mrview.erl`, `fabric_view_all_docs.erl`): rows
//! `{"id":"_local/x","key":"_local/x","value":{"rev":"0-N"}}` in raw id order, `total_rows` and
//! `offset` `null` (CouchDB does not count local documents), `update_seq` `null` when asked. The
//! parameters are `_all_docs`' ([`super::listing::parse_request`], with its `keys` bound).
//! `startkey`/`endkey` are compared with the full ids as raw bytes, as CouchDB compares them: a key
//! without the `_local/` prefix is no name but lies below every local id (`"_"`, `"A"`) or above
//! every one (`"a"`, `"_m"`). `keys` without the prefix are dropped, after `skip` and `limit`
//! picked the keys, as CouchDB drops them; a missing one is `{"key":…,"error":"not_found"}`.
//!
//! On the data-store database a per-user login lists only its own local documents (stored as
//! `{user}:{name}`, [`crate::database::data_store_rules::Confinement::local_name`]), shown
//! without the prefix; an admin lists all (the handler's `fetch` and `get` say which).

use std::collections::HashMap;
use std::future::Future;

use axum::extract::{FromRequest, Query, Request};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, StreamExt, TryStreamExt};
use serde_json::{json, Value};

use super::error::CouchError;
use super::listing::{
    keys_page, paged_rows, parse_request, post_fields, query_fields, streamed_listing, AllDocsRequest, PageSizer,
};
use super::{json, Answer, CouchState};
use crate::backend::{IdRange, Page, StoredDocument, LOCAL_PREFIX};
use crate::error::ErrorKind;

/// Local documents read at once for a `keys` request.
const KEY_READS: usize = 16;

/// `_all_docs`' parameters of a `_local_docs` request: from the query string, and for a `POST`
/// from its JSON body over them, read as `_all_docs` reads them. One extractor serves both
/// methods, so each database's handler is one function.
pub(crate) struct ListingRequest(pub AllDocsRequest);

impl FromRequest<CouchState> for ListingRequest {
    type Rejection = Response;

    async fn from_request(request: Request, state: &CouchState) -> Result<Self, Self::Rejection> {
        let (parts, body) = request.into_parts();
        let Query(params) =
            Query::<HashMap<String, String>>::try_from_uri(&parts.uri).map_err(IntoResponse::into_response)?;
        let fields = if parts.method == Method::POST {
            post_fields(state, &params, &parts.headers, body).await
        } else {
            query_fields(&params)
        };
        let request = fields.and_then(|fields| parse_request(&fields)).map_err(IntoResponse::into_response)?;
        Ok(ListingRequest(request))
    }
}

/// Where a client's `startkey`/`endkey` falls among local ids (`_local/{name}`), compared as raw
/// bytes.
enum KeyPlace {
    /// Before every local id.
    Below,
    /// Among them, at this name.
    Name(String),
    /// After every local id.
    Above,
}

fn place(key: &str) -> KeyPlace {
    match key.strip_prefix(LOCAL_PREFIX) {
        Some(name) => KeyPlace::Name(name.to_owned()),
        None if key < LOCAL_PREFIX => KeyPlace::Below,
        None => KeyPlace::Above,
    }
}

/// The range of names a client's range of ids holds (in its direction), or `None` when it holds
/// no local id at all.
pub(crate) fn name_range(ids: &IdRange) -> Option<IdRange> {
    let mut names = IdRange { start: None, end: None, ..ids.clone() };
    // The side of the local ids on which each end leaves the listing open.
    let (open_start, open_end) = if ids.descending { (true, false) } else { (false, true) };
    let bound = |key: &Option<String>, open_above: bool| -> Option<Option<String>> {
        match key.as_deref().map(place) {
            None => Some(None),
            Some(KeyPlace::Name(name)) => Some(Some(name)),
            Some(KeyPlace::Above) if open_above => Some(None),
            Some(KeyPlace::Below) if !open_above => Some(None),
            // The listing starts past its own end: nothing.
            Some(_) => None,
        }
    };
    names.start = bound(&ids.start, open_start)?;
    names.end = bound(&ids.end, open_end)?;
    Some(names)
}

fn row(doc: &StoredDocument, include_docs: bool) -> Value {
    let mut row = json!({ "id": doc.id, "key": doc.id, "value": { "rev": doc.rev.as_str() } });
    if include_docs {
        row["doc"] = doc.to_json();
    }
    row
}

/// A refusal of the backend to list local documents (a server without such a listing, a store
/// that needs `agentstore upgrade`) is this server's missing feature, not a fault: 501 with what
/// the log says.
fn listing_error(err: crate::Error) -> CouchError {
    if err.kind() != ErrorKind::Misconfigured {
        return err.into();
    }
    tracing::warn!(error = %err, "_local_docs refused by the storage backend");
    CouchError::new(
        StatusCode::NOT_IMPLEMENTED,
        "not_implemented",
        "_local_docs is not supported by agentstore over this storage backend (the server's log says why)",
    )
}

/// The answer to a `_local_docs` request: `fetch(names, want, token)` reads a page of the
/// database's local documents whose names lie in `names` (ids `_local/{name}` as the client
/// knows them), `get(name)` one of them.
pub(crate) async fn answer<F, Fut, G, GetFut>(request: AllDocsRequest, fetch: F, get: G) -> Answer
where
    F: Fn(IdRange, usize, Option<String>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = crate::Result<Page<StoredDocument>>> + Send + 'static,
    G: Fn(String) -> GetFut,
    GetFut: Future<Output = crate::Result<Option<StoredDocument>>>,
{
    let mut head = json!({ "total_rows": null, "offset": null });
    if request.update_seq {
        head["update_seq"] = Value::Null;
    }
    if let Some(keys) = &request.keys {
        let keys: Vec<String> =
            keys_page(keys, &request).into_iter().filter(|key| key.starts_with(LOCAL_PREFIX)).collect();
        // A plain loop, not an iterator adapter: a closure here trips rustc's higher-ranked
        // `Send` check on the handler's future.
        let mut lookups = Vec::with_capacity(keys.len());
        for key in &keys {
            let name = &key[LOCAL_PREFIX.len()..];
            // No local document has an empty name (`_local/` is no document's id).
            lookups.push((!name.is_empty()).then(|| get(name.to_owned())));
        }
        let found: Vec<Option<StoredDocument>> = stream::iter(lookups)
            .map(|lookup| async move {
                match lookup {
                    Some(lookup) => lookup.await,
                    None => Ok(None),
                }
            })
            .buffered(KEY_READS)
            .try_collect()
            .await
            .map_err(listing_error)?;
        let rows: Vec<Value> = keys
            .iter()
            .zip(found)
            .map(|(key, doc)| match doc {
                Some(doc) => row(&doc, request.include_docs),
                None => json!({ "key": key, "error": "not_found" }),
            })
            .collect();
        head["rows"] = Value::Array(rows);
        return Ok(json(StatusCode::OK, head));
    }
    let Some(names) = name_range(&request.range) else {
        head["rows"] = json!([]);
        return Ok(json(StatusCode::OK, head));
    };
    let include_docs = request.include_docs;
    let fetch_names = move |want: usize, token: Option<String>| fetch(names.clone(), want, token);
    let render = move |doc: &StoredDocument| Ok(Some(row(doc, include_docs).to_string()));
    let mut rows =
        Box::pin(paged_rows(fetch_names, render, request.skip, request.limit, PageSizer::for_listing(include_docs)));
    // The first page is read before the status is sent, so a refusal is an error status.
    let first = rows.next().await.transpose().map_err(listing_error)?;
    // The head's members, then the rows: the object's text without its closing brace.
    let opening = head.to_string();
    let opening = format!("{},\"rows\":[", opening.strip_suffix('}').unwrap_or(&opening));
    Ok(streamed_listing(opening, first, rows))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(start: Option<&str>, end: Option<&str>, descending: bool) -> IdRange {
        IdRange { start: start.map(str::to_owned), end: end.map(str::to_owned), descending, ..IdRange::all() }
    }

    fn ends(range: Option<IdRange>) -> Option<(Option<String>, Option<String>)> {
        range.map(|r| (r.start, r.end))
    }

    #[test]
    fn keys_compare_with_local_ids_as_raw_bytes() {
        let name = |n: &str| Some(n.to_owned());
        assert_eq!(ends(name_range(&ids(Some("_local/b"), Some("_local/d"), false))), Some((name("b"), name("d"))));
        // "_" and "A" sort before "_local/", "a" and "_m" after it.
        assert_eq!(ends(name_range(&ids(Some("A"), Some("a"), false))), Some((None, None)));
        assert_eq!(ends(name_range(&ids(Some("_"), Some("_m"), false))), Some((None, None)));
        assert_eq!(ends(name_range(&ids(Some("a"), None, false))), None, "ascending from above every local id");
        assert_eq!(ends(name_range(&ids(None, Some("A"), false))), None, "ascending up to below every one");
        assert_eq!(ends(name_range(&ids(Some("a"), Some("A"), true))), Some((None, None)));
        assert_eq!(ends(name_range(&ids(Some("A"), None, true))), None, "descending from below every one");
        assert_eq!(ends(name_range(&ids(None, Some("a"), true))), None, "descending down to above every one");
        assert_eq!(ends(name_range(&ids(Some("_local/x"), Some("_"), true))), Some((name("x"), None)));
        let exclusive = IdRange { inclusive_end: false, ..ids(None, Some("_local/c"), false) };
        assert_eq!(name_range(&exclusive).map(|r| (r.end, r.inclusive_end)), Some((name("c"), false)));
    }
}
