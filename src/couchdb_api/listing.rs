//! What every listing of a database shares: `_all_docs`' parameters ([`AllDocsRequest`], from
//! the query string, JSON-encoded keys as nano and PouchDB send them, or from a POST body, where
//! the Cloudant SDKs send everything), `keys` picked as CouchDB picks them ([`keys_page`]), and
//! rows streamed a backend page at a time ([`paged_rows`]), each page sized from the rows before
//! it to about [`PAGE_TARGET_BYTES`] ([`PageSizer`]), so a listing without `limit` over a large
//! database holds one page at a time. `_all_docs` and `_design_docs` (`super::db`'s `all_docs`),
//! `_local_docs` ([`super::local_docs`]), views and `_changes` use them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::IntoResponse;
use futures::stream::{self, StreamExt};
use serde_json::{Map, Value};

use super::db::MAX_BULK_DOCS;
use super::error::{CouchError, CouchResult};
use super::request::{bool_param, integer_param, json_param};
use super::CouchState;
use crate::backend::IdRange;

/// The most rows asked of the backend per page while streaming a range.
const PAGE: usize = 500;

/// Rendered bytes each page of a streamed listing aims at, from the size of the rows read so
/// far ([`PageSizer`]): what a connection whose client stops reading holds of the listing besides
/// hyper's buffer (`max_connection_buffer_bytes`), whatever the documents' size.
pub(crate) const PAGE_TARGET_BYTES: usize = 256 * 1024;

/// Rows the first page of a listing with documents (`include_docs`) asks for, before any row's
/// size is known. A listing without documents starts at its largest page: its rows (an id and a
/// revision) are small enough that [`PAGE`] of them stay well within [`PAGE_TARGET_BYTES`].
pub(crate) const FIRST_PAGE_WITH_DOCS: usize = 64;

/// The parameters, from the query string or the body, checked.
pub(crate) struct AllDocsRequest {
    pub keys: Option<Vec<String>>,
    pub range: IdRange,
    pub limit: Option<u64>,
    pub skip: u64,
    pub include_docs: bool,
    pub update_seq: bool,
    /// `conflicts=true`: documents carry `_conflicts` (with `include_docs`).
    pub conflicts: bool,
}

/// The fields of a `GET` request's query string, as JSON values.
pub(crate) fn query_fields(params: &HashMap<String, String>) -> CouchResult<Map<String, Value>> {
    let mut fields = Map::new();
    for (name, text) in params {
        let value = match name.as_str() {
            // CouchDB takes `startkey_docid`/`endkey_docid` raw (python-couchdb sends them so).
            "startkey_docid" | "endkey_docid" => Value::from(text.as_str()),
            "key" | "keys" | "startkey" | "start_key" | "endkey" | "end_key" => {
                json_param(name, Some(text))?.unwrap_or(Value::Null)
            }
            "limit" | "skip" => Value::from(integer_param(name, Some(text))?.unwrap_or(0)),
            _ => match text.as_str() {
                "true" => Value::Bool(true),
                "false" => Value::Bool(false),
                other => Value::from(other),
            },
        };
        fields.insert(name.clone(), value);
    }
    Ok(fields)
}

/// The fields of a `POST` request: its query string, then its body's members over them.
pub(crate) async fn post_fields(
    state: &CouchState,
    params: &HashMap<String, String>,
    headers: &HeaderMap,
    body: Body,
) -> CouchResult<Map<String, Value>> {
    let mut fields = Map::new();
    for (name, text) in params {
        let value = match name.as_str() {
            "limit" | "skip" => Value::from(integer_param(name, Some(text))?.unwrap_or(0)),
            "include_docs" | "descending" | "inclusive_end" | "update_seq" | "conflicts" => {
                Value::Bool(bool_param(name, Some(text), false)?)
            }
            _ => json_param(name, Some(text)).ok().flatten().unwrap_or_else(|| Value::from(text.as_str())),
        };
        fields.insert(name.clone(), value);
    }
    if let Some(body) = state.bodies.read_json(headers, body).await? {
        match body.value {
            Value::Object(map) => fields.extend(map),
            _ => return Err(CouchError::bad_request("Request body must be a JSON object")),
        }
    }
    Ok(fields)
}

pub(crate) fn parse_request(fields: &Map<String, Value>) -> CouchResult<AllDocsRequest> {
    let string_key = |names: &[&str]| -> CouchResult<Option<String>> {
        for name in names {
            match fields.get(*name) {
                None | Some(Value::Null) => {}
                Some(Value::String(text)) => return Ok(Some(text.clone())),
                Some(_) => {
                    return Err(CouchError::bad_request(format!("{name} must be a document id (a JSON string)")))
                }
            }
        }
        Ok(None)
    };
    let flag = |name: &str, default: bool| -> CouchResult<bool> {
        match fields.get(name) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(flag)) => Ok(*flag),
            Some(_) => Err(CouchError::bad_request(format!("{name} must be true or false"))),
        }
    };
    let number = |name: &str| -> CouchResult<Option<u64>> {
        match fields.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => value
                .as_u64()
                .map(Some)
                .ok_or_else(|| CouchError::bad_request(format!("{name} must be a non-negative integer"))),
        }
    };
    let keys = match fields.get("keys") {
        None | Some(Value::Null) => None,
        Some(Value::Array(keys)) if keys.len() <= MAX_BULK_DOCS => Some(
            keys.iter()
                .map(|k| {
                    k.as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| CouchError::bad_request("keys must be document ids (strings)"))
                })
                .collect::<CouchResult<Vec<_>>>()?,
        ),
        Some(Value::Array(_)) => {
            return Err(CouchError::bad_request(format!("keys may name at most {MAX_BULK_DOCS} documents")))
        }
        Some(_) => return Err(CouchError::bad_request("`keys` must be an array")),
    };
    let given = |name: &str| fields.get(name).is_some_and(|value| !value.is_null());
    if keys.is_some() && ["key", "startkey", "start_key", "endkey", "end_key"].iter().any(|name| given(name)) {
        // couch_mrview_util's check, answered before any row is read.
        return Err(CouchError::new(
            axum::http::StatusCode::BAD_REQUEST,
            "query_parse_error",
            "`keys` is incompatible with `key`, `start_key` and `end_key`",
        ));
    }
    let descending = flag("descending", false)?;
    let key = string_key(&["key"])?;
    let (start, end) = match key {
        Some(key) => (Some(key.clone()), Some(key)),
        None => (string_key(&["startkey", "start_key"])?, string_key(&["endkey", "end_key"])?),
    };
    Ok(AllDocsRequest {
        keys,
        range: IdRange { start, end, inclusive_end: flag("inclusive_end", true)?, descending, include_design: false },
        limit: number("limit")?,
        skip: number("skip")?.unwrap_or(0),
        include_docs: flag("include_docs", false)?,
        update_seq: flag("update_seq", false)?,
        conflicts: flag("conflicts", false)?,
    })
}

/// The keys a `keys` request answers, as CouchDB picks them (`fabric_view_all_docs.erl`): in
/// reverse order when `descending`, then `skip` of them dropped, then at most `limit` kept.
pub(crate) fn keys_page(keys: &[String], request: &AllDocsRequest) -> Vec<String> {
    let skip = usize::try_from(request.skip).unwrap_or(usize::MAX);
    let limit = request.limit.map_or(usize::MAX, |limit| usize::try_from(limit).unwrap_or(usize::MAX));
    let ordered: Box<dyn Iterator<Item = &String>> =
        if request.range.descending { Box::new(keys.iter().rev()) } else { Box::new(keys.iter()) };
    ordered.skip(skip).take(limit).cloned().collect()
}

/// A listing's answer streamed: `head` (the JSON up to and including `"rows":[`), the first
/// page's rows (read before the status is sent, so a failure there is an error status), the
/// rest as they are read, then the closing `]}`.
pub(crate) fn streamed_listing(
    head: String,
    first: Option<Bytes>,
    rest: impl futures::Stream<Item = crate::Result<Bytes>> + Send + 'static,
) -> axum::response::Response {
    let body = stream::once(async move { Ok::<_, crate::Error>(Bytes::from(head)) })
        .chain(stream::iter(first.map(Ok)))
        .chain(rest)
        .chain(stream::once(async { Ok(Bytes::from_static(b"\n]}\n")) }));
    let mut response = Body::from_stream(body).into_response();
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// How many rows each page of a listing asks for. The first page's size is a guess; each next
/// page asks for as many rows of the previous page's average rendered size as fit in
/// [`PAGE_TARGET_BYTES`], at least one and at most `largest`. Small rows reach `largest` after
/// one page (few backend round trips); rows of 100 KB make pages of two. The target is aimed
/// at, not enforced: rows far larger than the previous page's make one page larger than it.
#[derive(Debug, Clone)]
pub(crate) struct PageSizer {
    next: usize,
    largest: usize,
    /// Where the average row size seen is kept for the next listing of the same database
    /// ([`PageSizer::for_listing_of`]).
    remembered: Option<Arc<AtomicUsize>>,
}

impl PageSizer {
    /// A sizer whose first page asks for `first` rows and no page for more than `largest`.
    pub(crate) fn new(first: usize, largest: usize) -> Self {
        let largest = largest.max(1);
        PageSizer { next: first.clamp(1, largest), largest, remembered: None }
    }

    /// The sizer of an `_all_docs`-like listing: its first page [`FIRST_PAGE_WITH_DOCS`] rows when
    /// the rows carry documents, [`PAGE`] otherwise.
    pub(crate) fn for_listing(with_docs: bool) -> Self {
        PageSizer::new(if with_docs { FIRST_PAGE_WITH_DOCS } else { PAGE }, PAGE)
    }

    /// [`PageSizer::for_listing`] of a database whose last listing's average row size is kept in
    /// `remembered` (0: none yet): with documents, the first page is sized from that average as
    /// every later page is from the page before ([`PageSizer::saw`]), and what this listing sees
    /// is kept there for the next. A listing of 100 documents of a few hundred bytes is then one
    /// backend request, not 64 rows and then the rest (issue 38).
    pub(crate) fn for_listing_of(with_docs: bool, remembered: &Arc<AtomicUsize>) -> Self {
        let mut sizer = PageSizer::for_listing(with_docs);
        let average = remembered.load(Ordering::Relaxed);
        if with_docs && average > 0 {
            sizer.next = (PAGE_TARGET_BYTES / average).clamp(1, sizer.largest);
        }
        sizer.remembered = Some(Arc::clone(remembered));
        sizer
    }

    /// Rows the next page asks for.
    pub(crate) fn rows(&self) -> usize {
        self.next
    }

    /// Takes in what a page rendered: `rows` rows of `bytes` in all. A page that rendered no
    /// row (all hidden) tells nothing and leaves the size as it was.
    pub(crate) fn saw(&mut self, rows: usize, bytes: usize) {
        if rows == 0 {
            return;
        }
        let average = bytes.div_ceil(rows).max(1);
        self.next = (PAGE_TARGET_BYTES / average).clamp(1, self.largest);
        if let Some(remembered) = &self.remembered {
            remembered.store(average, Ordering::Relaxed);
        }
    }
}

/// A listing's rows as JSON text chunks (`,` between rows), one page at a time: `fetch(want,
/// token)` reads a page, `render` writes an item's row (`None`: the item is not shown and does not
/// count), after `skip` shown rows and up to `limit` of them. Each page asks for no more items
/// than the rows still wanted, and no more than `sizer` gives for the rows seen so far.
pub(crate) fn paged_rows<T, F, Fut, R>(
    fetch: F,
    render: R,
    skip: u64,
    limit: Option<u64>,
    sizer: PageSizer,
) -> impl futures::Stream<Item = crate::Result<Bytes>>
where
    F: Fn(usize, Option<String>) -> Fut + Clone,
    Fut: std::future::Future<Output = crate::Result<crate::backend::Page<T>>>,
    R: Fn(&T) -> crate::Result<Option<String>> + Clone,
{
    struct Cursor {
        token: Option<String>,
        started: bool,
        done: bool,
        to_skip: u64,
        remaining: u64,
        first_row: bool,
        sizer: PageSizer,
    }
    let cursor = Cursor {
        token: None,
        started: false,
        done: false,
        to_skip: skip,
        remaining: limit.unwrap_or(u64::MAX),
        first_row: true,
        sizer,
    };
    stream::try_unfold(cursor, move |mut cursor| {
        let fetch = fetch.clone();
        let render = render.clone();
        async move {
            if cursor.done || cursor.remaining == 0 || (cursor.started && cursor.token.is_none()) {
                return Ok(None);
            }
            let wanted = cursor.remaining.saturating_add(cursor.to_skip);
            let want = usize::try_from(wanted).unwrap_or(usize::MAX).min(cursor.sizer.rows());
            let page = fetch(want.max(1), cursor.token.take()).await?;
            cursor.started = true;
            cursor.token = page.next;
            let mut chunk = String::new();
            let (mut rendered_rows, mut rendered_bytes) = (0, 0);
            for item in &page.items {
                let Some(row) = render(item)? else { continue };
                rendered_rows += 1;
                rendered_bytes += row.len();
                if cursor.to_skip > 0 {
                    cursor.to_skip -= 1;
                    continue;
                }
                if cursor.remaining == 0 {
                    cursor.done = true;
                    break;
                }
                cursor.remaining -= 1;
                if !cursor.first_row {
                    chunk.push(',');
                }
                cursor.first_row = false;
                chunk.push('\n');
                chunk.push_str(&row);
            }
            cursor.sizer.saw(rendered_rows, rendered_bytes);
            Ok(Some((Bytes::from(chunk), cursor)))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Page;

    /// The rows each page asks for while `paged_rows` lists `count` items rendered as rows of
    /// `row_bytes` bytes each, `limit` of them at most, with a listing's sizer.
    async fn page_sizes(count: usize, row_bytes: usize, limit: Option<u64>, with_docs: bool) -> Vec<usize> {
        let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let asks = std::sync::Arc::clone(&asked);
        let fetch = move |want: usize, token: Option<String>| {
            asks.lock().unwrap().push(want);
            let from: usize = token.as_deref().and_then(|t| t.parse().ok()).unwrap_or(0);
            let until = (from + want).min(count);
            let next = (until < count).then(|| until.to_string());
            async move { Ok(Page { items: (from..until).collect::<Vec<usize>>(), next }) }
        };
        let render = move |_: &usize| Ok(Some("x".repeat(row_bytes)));
        let sizer = PageSizer::for_listing(with_docs);
        let chunks: Vec<Bytes> = paged_rows(fetch, render, 0, limit, sizer).map(|chunk| chunk.unwrap()).collect().await;
        let rows: usize = chunks.iter().map(|chunk| chunk.iter().filter(|byte| **byte == b'\n').count()).sum();
        assert_eq!(rows, limit.map_or(count, |limit| count.min(limit as usize)), "every row is listed once");
        let asked = asked.lock().unwrap().clone();
        asked
    }

    #[tokio::test]
    async fn pages_are_sized_by_the_bytes_of_their_rows() {
        // Documents of 100 KB: after the first page, pages of two rows (256 KiB at most).
        let large = page_sizes(100, 100_000, None, true).await;
        assert_eq!(large[0], FIRST_PAGE_WITH_DOCS);
        assert!(large[1..].iter().all(|&rows| rows * 100_000 <= PAGE_TARGET_BYTES), "{large:?}");
        // Documents of 50 bytes: the second page is the largest, so a listing of 564 rows costs
        // two backend reads.
        assert_eq!(page_sizes(564, 50, None, true).await, [FIRST_PAGE_WITH_DOCS, PAGE]);
        // Rows without documents start at the largest page: one read for up to 500 rows.
        assert_eq!(page_sizes(500, 90, None, false).await, [PAGE]);
        // A limit below the first page is asked for as it is.
        assert_eq!(page_sizes(100, 50, Some(20), true).await, [20]);
        // Documents past the target: one row a page after the first.
        let huge = page_sizes(70, 1_000_000, None, true).await;
        assert_eq!(huge, [FIRST_PAGE_WITH_DOCS, 1, 1, 1, 1, 1, 1]);
        // Rows of mixed sizes follow the previous page's average.
        let mut sizer = PageSizer::for_listing(true);
        sizer.saw(64, 64 * 2_100);
        assert_eq!(sizer.rows(), PAGE_TARGET_BYTES / 2_100);
        // A database's next listing starts from the row size its last one saw.
        let remembered = Arc::new(AtomicUsize::new(0));
        let mut first = PageSizer::for_listing_of(true, &remembered);
        assert_eq!(first.rows(), FIRST_PAGE_WITH_DOCS, "nothing seen yet");
        first.saw(64, 64 * 400);
        assert_eq!(PageSizer::for_listing_of(true, &remembered).rows(), PAGE, "small rows: the largest page at once");
        first.saw(10, 10 * 100_000);
        assert_eq!(PageSizer::for_listing_of(true, &remembered).rows(), PAGE_TARGET_BYTES / 100_000);
        assert_eq!(PageSizer::for_listing_of(false, &remembered).rows(), PAGE, "rows without documents");
        sizer.saw(0, 0);
        assert_eq!(sizer.rows(), PAGE_TARGET_BYTES / 2_100, "a page of hidden rows changes nothing");
    }

    #[test]
    fn parameters_are_read_from_json_fields() {
        let fields: Map<String, Value> =
            serde_json::from_str(r#"{"start_key":"a","endkey":"b","limit":2,"include_docs":true,"descending":true}"#)
                .unwrap();
        let request = parse_request(&fields).unwrap();
        assert_eq!(request.range.start.as_deref(), Some("a"));
        assert!(request.range.descending && request.include_docs);
        assert_eq!(request.limit, Some(2));
        let bad: Map<String, Value> = serde_json::from_str(r#"{"startkey":1}"#).unwrap();
        assert!(parse_request(&bad).is_err());
    }
}
