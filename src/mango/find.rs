//! `POST /{db}/_find`: the request (validated in [`super::request`] as CouchDB 3.4.3 validates
//! it), the index chosen as CouchDB chooses it ([`IndexCatalog::choose`]), and the answer paged,
//! filtered with the whole selector, sorted and projected. One engine for every database: where
//! the candidate documents come from is a [`FindSource`], opened by the database's
//! [`FindSources`] once the index is chosen.
//!
//! - The data-store database ([`find_on_data_store`]): a chosen JSON index created with
//!   `POST _index` is a view group built over its feed and read over its key range, as on the
//!   other databases ([`super::index_source`]), where this process builds indexes (the embedded
//!   store, DynamoDB, Firestore). Otherwise (the built-in `idx-user-namespace`, no JSON index, or
//!   the CouchDB backend) its source is the backend: a selector that fixes `userId` with `$eq`
//!   reads the backend's `userId`/`namespace` index ([`DocumentBackend::query`]), narrowed to the
//!   namespace when that is fixed too; anything else pages the documents in id order
//!   ([`DocumentBackend::all_docs`]), a per-user login's own id range only.
//!
//! A per-user login's query is the client's own (its selector is not rewritten): every source is
//! read through the login's [`Confinement`], the one statement of what it may see
//! ([`Confined`]: candidates outside it are never seen, as if absent).
//! - Other databases ([`super::database`]): a chosen JSON index is a view read over its key
//!   range, in the index's order; without one, `_all_docs`.
//!
//! Either way the source is read [`SCAN_PAGE`] documents at a time, so memory stays bounded by a
//! page plus the answer, never the store.
//!
//! Bookmarks are opaque (base64url JSON) and resume exactly where the previous page stopped: the
//! position the source gave after the last document returned (for the backend: its page token,
//! how far into that page the answer went, and the last id returned; for an index: the last
//! row's key and id). A client looping on `bookmark` until a short page sees each match once and
//! terminates.
//!
//! A `sort` that the source does not serve (the data-store database's backend) needs every
//! match before the first page can be cut, so sorting keeps each match's sort key and id (not
//! the document) and refuses, with a 400 naming the cap, a query matching more than
//! [`SORT_CAP`] documents; the page's documents are then read by id. An answer is built in
//! memory, so one holding more than [`MAX_ANSWER_BYTES`] of documents is refused the same way
//! (ask for a smaller `limit` and follow the bookmark).

use std::cmp::Ordering;
use std::time::Instant;

use async_trait::async_trait;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use super::eval::matches;
use super::index::{ChosenIndex, IndexCatalog, IndexDef, QueryKind};
use super::index_source::{self, RowDocs};
use super::request::{invalid_bookmark, parse_request, FindRequest, Sort, NO_BOOKMARK};
use super::MangoError;
use crate::backend::{DocumentBackend, IdRange, Page, Projection, Query, StoredDocument};
use crate::database::data_store_rules::Confinement;
use crate::model::fields;
use crate::model::validate::json_size;
use crate::views::collation::{compare, compare_raw};
use crate::views::service::Views;
use crate::views::ViewSource;

/// The most matching documents a sorted query may have: their sort keys are held in memory.
pub const SORT_CAP: usize = 10_000;
/// The most bytes of documents one `_find` answer may hold (the answer is built in memory).
pub const MAX_ANSWER_BYTES: usize = 64 * 1024 * 1024;
/// How many documents one backend read returns.
pub const SCAN_PAGE: usize = 200;
/// CouchDB's `[mango] index_scan_warning_threshold`: more documents examined per result than
/// this earns a warning.
const INDEX_SCAN_WARNING_THRESHOLD: f64 = 10.0;
const NO_INDEX_WARNING: &str = "No matching index found, create an index to optimize query time.";
const SCAN_RATIO_WARNING: &str = "The number of documents examined is high in proportion to the number of results returned. Consider adding a more specific index to improve this.";

/// The error CouchDB's `_all_docs` gives a `partition` on a database that is not partitioned
/// (`couch_mrview_util:validate_all_docs_args`), which is where a partitioned `_find` ends up.
fn partition_not_supported() -> MangoError {
    MangoError::bad_request("query_parse_error", "`partition` parameter is not supported on this db")
}

/// One document a source read: its id, the document as the selector sees it (`_id`, `_rev`, then
/// the body), and where a scan resumes to continue after it.
pub struct Candidate {
    pub id: String,
    pub doc: Map<String, Value>,
    pub after: Value,
}

/// A page of candidates, and where the next page starts (`None`: the scan is over).
pub struct CandidatePage {
    pub items: Vec<Candidate>,
    pub next: Option<Value>,
}

/// Where a query's candidate documents come from: the one thing that differs between the
/// data-store database (its backend, paged and filtered) and the other databases (a view-backed
/// JSON index's key range, or `_all_docs`). The engine in this file does the rest.
#[async_trait]
pub trait FindSource: Send + Sync {
    /// A short tag naming the scan in a bookmark, so a bookmark is not replayed on another.
    fn tag(&self) -> String;
    /// Whether candidates come in the query's `sort` order (an index that serves the sort), so
    /// the engine pages them as they come instead of sorting every match in memory.
    fn serves_sort(&self) -> bool;
    /// Candidates from `from` (a position an earlier [`Candidate::after`] or
    /// [`CandidatePage::next`] gave; `None`: the start). Design and local documents are never
    /// candidates. `wanted` is how many more matches the query needs: a source may read fewer
    /// than [`SCAN_PAGE`] rows then (any number is correct; it only saves reads).
    async fn read(&self, from: Option<&Value>, wanted: usize) -> Result<CandidatePage, MangoError>;
    /// The documents with these ids, as candidates are shown, in order; missing ones left out.
    async fn fetch(&self, ids: &[String]) -> Result<Vec<Map<String, Value>>, MangoError>;
}

/// Opens the source for a query once its index is chosen (`None`: no JSON index, `_all_docs`).
#[async_trait]
pub trait FindSources: Send + Sync {
    async fn open(
        &self,
        request: &FindRequest,
        index: Option<&IndexDef>,
    ) -> Result<Box<dyn FindSource + '_>, MangoError>;
}

/// Where this process builds the data-store database's created JSON indexes: its index file
/// and the data-store database as a view source (its feed). Absent over the CouchDB backend.
#[derive(Clone, Copy)]
pub struct DataStoreViews<'a> {
    pub views: &'a Views,
    pub source: &'a dyn ViewSource,
}

/// The data-store database's sources. A chosen created JSON index is read as a view group when
/// `views` is there. Otherwise the backend: a selector that fixes `userId` with `$eq` reads the
/// backend's `userId`/`namespace` index (also what the built-in `idx-user-namespace` stands
/// for); anything else pages every document.
struct BackendSources<'a> {
    backend: &'a dyn DocumentBackend,
    views: Option<DataStoreViews<'a>>,
    /// The login's: a scan of every document reads its id range only.
    confinement: &'a Confinement,
}

#[async_trait]
impl FindSources for BackendSources<'_> {
    async fn open(
        &self,
        request: &FindRequest,
        index: Option<&IndexDef>,
    ) -> Result<Box<dyn FindSource + '_>, MangoError> {
        if let (Some(index), Some(indexed)) = (index.filter(|index| !index.is_standard()), self.views) {
            let design = index.data_store_design()?;
            let docs = Box::new(BackendDocs { backend: self.backend });
            let source = index_source::open(indexed.views, indexed.source, &design, index, request, docs).await?;
            return Ok(Box::new(source));
        }
        let text = |field: &str| request.selector.required_equal(&[field]).and_then(Value::as_str).map(str::to_owned);
        let scan = match text(fields::USER_ID) {
            Some(user_id) => BackendScan::ByUser { user_id, namespace: text(fields::NAMESPACE) },
            None => BackendScan::AllDocs(self.confinement.clip(IdRange::all())),
        };
        Ok(Box::new(BackendSource { backend: self.backend, scan }))
    }
}

/// A source read through a login's [`Confinement`]: a candidate (or fetched document) outside
/// it is left out before anything looks at it, as if it did not exist.
struct Confined<'a> {
    source: Box<dyn FindSource + 'a>,
    confinement: &'a Confinement,
}

#[async_trait]
impl FindSource for Confined<'_> {
    fn tag(&self) -> String {
        self.source.tag()
    }

    fn serves_sort(&self) -> bool {
        self.source.serves_sort()
    }

    async fn read(&self, from: Option<&Value>, wanted: usize) -> Result<CandidatePage, MangoError> {
        let mut page = self.source.read(from, wanted).await?;
        page.items.retain(|item| self.confinement.admits_id(&item.id));
        Ok(page)
    }

    async fn fetch(&self, ids: &[String]) -> Result<Vec<Map<String, Value>>, MangoError> {
        let mut docs = self.source.fetch(ids).await?;
        docs.retain(|doc| doc.get("_id").and_then(Value::as_str).is_some_and(|id| self.confinement.admits_id(id)));
        Ok(docs)
    }
}

/// What a backend source pages.
#[derive(Debug, Clone, PartialEq)]
enum BackendScan {
    /// The backend's `userId` (+ `namespace`) index.
    ByUser { user_id: String, namespace: Option<String> },
    /// Every document in this id range (all of them, or a per-user login's), in id order.
    AllDocs(IdRange),
}

struct BackendSource<'a> {
    backend: &'a dyn DocumentBackend,
    scan: BackendScan,
}

/// A position in a backend scan: re-read the backend page fetched with `token`, continue after
/// `offset` items (after the item `last_id` if it moved).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct BackendPosition {
    #[serde(rename = "t")]
    token: Option<String>,
    #[serde(rename = "o")]
    offset: usize,
    #[serde(rename = "l")]
    last_id: Option<String>,
}

impl BackendSource<'_> {
    async fn backend_page(&self, token: Option<&str>) -> Result<Page<StoredDocument>, MangoError> {
        Ok(match &self.scan {
            BackendScan::ByUser { user_id, namespace } => {
                let query =
                    Query { user_id: user_id.clone(), namespace: namespace.clone(), projection: Projection::All };
                let mut page = self.backend.query(&query, SCAN_PAGE, token).await?;
                // A design document holding the identity fields matches too; it is no user's.
                page.items.retain(|doc| !doc.id.starts_with("_design/"));
                page
            }
            BackendScan::AllDocs(range) => self.backend.all_docs(range, SCAN_PAGE, token).await?,
        })
    }
}

#[async_trait]
impl FindSource for BackendSource<'_> {
    fn tag(&self) -> String {
        match &self.scan {
            BackendScan::ByUser { user_id, namespace } => {
                format!("user:{user_id}:{}", namespace.as_deref().unwrap_or("*"))
            }
            BackendScan::AllDocs(_) => "all".into(),
        }
    }

    fn serves_sort(&self) -> bool {
        false
    }

    async fn read(&self, from: Option<&Value>, _wanted: usize) -> Result<CandidatePage, MangoError> {
        let position = match from {
            None => BackendPosition { token: None, offset: 0, last_id: None },
            Some(value) => serde_json::from_value(value.clone())
                .map_err(|_| invalid_bookmark(&Value::String("(a position of another scan)".into())))?,
        };
        let page = self.backend_page(position.token.as_deref()).await?;
        let first = resume_index(
            &page.items,
            position.offset,
            position.last_id.as_deref(),
            matches!(self.scan, BackendScan::AllDocs(_)),
        );
        let mut items = Vec::new();
        for (at, doc) in page.items.iter().enumerate().skip(first) {
            let Some(object) = candidate(doc) else { continue };
            let after =
                BackendPosition { token: position.token.clone(), offset: at + 1, last_id: Some(doc.id.clone()) };
            items.push(Candidate { id: doc.id.clone(), doc: object, after: position_json(&after) });
        }
        let next =
            page.next.map(|token| position_json(&BackendPosition { token: Some(token), offset: 0, last_id: None }));
        Ok(CandidatePage { items, next })
    }

    async fn fetch(&self, ids: &[String]) -> Result<Vec<Map<String, Value>>, MangoError> {
        let mut docs = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(SCAN_PAGE) {
            docs.extend(self.backend.get_many(chunk).await?.iter().flatten().filter_map(candidate));
        }
        Ok(docs)
    }
}

/// The data-store database's documents, as an index's rows name them.
struct BackendDocs<'a> {
    backend: &'a dyn DocumentBackend,
}

#[async_trait]
impl RowDocs for BackendDocs<'_> {
    async fn read(&self, ids: &[String]) -> Result<Vec<Option<Map<String, Value>>>, MangoError> {
        let mut docs = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(SCAN_PAGE) {
            docs.extend(self.backend.get_many(chunk).await?.iter().map(|doc| doc.as_ref().and_then(candidate)));
        }
        Ok(docs)
    }
}

fn position_json(position: &BackendPosition) -> Value {
    serde_json::to_value(position).unwrap_or(Value::Null)
}

/// Where the next page of a query starts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "k")]
enum Bookmark {
    /// In the source's order: continue from `position` (`None`: the start); `done` when the scan
    /// reached the end.
    #[serde(rename = "s")]
    Scan {
        #[serde(rename = "src")]
        source: String,
        #[serde(rename = "p")]
        position: Option<Value>,
        #[serde(rename = "d")]
        done: bool,
    },
    /// Sorted in memory, before the first match (a page of `limit: 0`, or no match yet).
    #[serde(rename = "b")]
    SortedStart,
    /// Sorted in memory: continue after the match with these sort keys and id.
    #[serde(rename = "o")]
    Sorted {
        #[serde(rename = "key")]
        keys: Vec<Value>,
        id: String,
    },
}

impl Bookmark {
    fn encode(&self) -> String {
        URL_SAFE_NO_PAD.encode(serde_json::to_vec(self).unwrap_or_default())
    }

    fn decode(text: &str) -> Result<Self, MangoError> {
        URL_SAFE_NO_PAD
            .decode(text)
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .ok_or_else(|| invalid_bookmark(&Value::String(text.to_owned())))
    }
}

/// What a run over the source found.
struct Outcome {
    docs: Vec<Value>,
    bookmark: String,
    /// Candidates read: each is an index row (or stored record) and its document, so CouchDB's
    /// `total_keys_examined` and `total_docs_examined` are both this.
    examined: u64,
}

/// Runs a `_find` request over the backend alone (every index a definition):
/// `{"docs", "bookmark", "warning"?, "execution_stats"?}`, of the documents `confinement` admits.
pub async fn find(
    backend: &dyn DocumentBackend,
    request: &Value,
    confinement: &Confinement,
    indexes: &IndexCatalog,
) -> Result<Value, MangoError> {
    find_with_limits(backend, request, confinement, indexes, FindLimits::default()).await
}

/// Bounds on what one `_find` holds in memory; a query that would pass one is a 400 naming it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FindLimits {
    /// The most matches a sorted query may have ([`SORT_CAP`]).
    pub sort_cap: usize,
    /// The most bytes of documents in one answer ([`MAX_ANSWER_BYTES`]).
    pub answer_bytes: usize,
}

impl Default for FindLimits {
    fn default() -> Self {
        FindLimits { sort_cap: SORT_CAP, answer_bytes: MAX_ANSWER_BYTES }
    }
}

/// [`find`] with other memory bounds.
pub async fn find_with_limits(
    backend: &dyn DocumentBackend,
    request: &Value,
    confinement: &Confinement,
    indexes: &IndexCatalog,
    limits: FindLimits,
) -> Result<Value, MangoError> {
    find_in(&BackendSources { backend, views: None, confinement }, request, confinement, indexes, limits).await
}

/// Runs a `_find` request on the data-store database: its created JSON indexes read as view
/// groups when `views` is given (the backends this process builds indexes for), the backend
/// paged and filtered otherwise.
pub async fn find_on_data_store(
    backend: &dyn DocumentBackend,
    views: Option<DataStoreViews<'_>>,
    request: &Value,
    confinement: &Confinement,
    indexes: &IndexCatalog,
) -> Result<Value, MangoError> {
    let sources = BackendSources { backend, views, confinement };
    find_in(&sources, request, confinement, indexes, FindLimits::default()).await
}

/// Runs a `_find` request over `sources` with the database's `indexes`: the index chosen as
/// CouchDB chooses it, then the source it opens read through `confinement`, filtered, paged and
/// projected.
pub async fn find_in(
    sources: &dyn FindSources,
    request: &Value,
    confinement: &Confinement,
    indexes: &IndexCatalog,
    limits: FindLimits,
) -> Result<Value, MangoError> {
    let started = Instant::now();
    let parsed = parse_request(request)?;
    let matches_nothing = parsed.selector.is_empty_combination();
    // A partitioned query may use only partitioned indexes, and this database has none
    // (mango_idx.erl `filter_partition_indexes`).
    let unpartitioned;
    let indexes = if parsed.partition.is_empty() {
        indexes
    } else {
        unpartitioned = indexes.without_json_indexes();
        &unpartitioned
    };
    let choice = indexes.choose(
        &parsed.selector,
        &parsed.sort_field_names(),
        &parsed.use_index,
        parsed.allow_fallback,
        QueryKind::Find,
    )?;
    if matches_nothing || choice.reads_nothing {
        // CouchDB (`mango_cursor:maybe_noop_range`) runs no scan for a selector that is only an
        // empty `$or`/`$and` (issue 22 §2c item 1), nor when the chosen index's first column has
        // an empty range, and answers the bare `{"docs": []}`: no bookmark, no warning, no
        // statistics.
        return Ok(json!({ "docs": [] }));
    }
    if !parsed.partition.is_empty() {
        return Err(partition_not_supported());
    }
    let index = match choice.index {
        ChosenIndex::Json(index) => Some(index),
        ChosenIndex::AllDocs | ChosenIndex::NoneUsable => None,
    };
    let source = Confined { source: sources.open(&parsed, index).await?, confinement };
    let source: &dyn FindSource = &source;
    let bookmark = parsed.bookmark.as_deref().map(Bookmark::decode).transpose()?;
    let mut outcome = if parsed.sort.fields.is_empty() || source.serves_sort() {
        run_in_order(source, &parsed, bookmark, limits).await?
    } else {
        run_sorted(source, &parsed, bookmark, limits).await?
    };
    if parsed.bookmark.is_none() && outcome.docs.is_empty() {
        // CouchDB's bookmark is the last row's key, or the request's own bookmark when no row was
        // returned: `nil` on a first page (issue 22 §2c item 13). Sent back, it starts again.
        outcome.bookmark = NO_BOOKMARK.into();
    }

    let mut warnings = choice.warnings;
    if index.is_none() {
        warnings.push(NO_INDEX_WARNING.into());
    }
    let returned = outcome.docs.len() as u64;
    let examined = outcome.examined;
    let ratio = if returned == 0 { examined as f64 } else { examined as f64 / returned as f64 };
    if ratio > INDEX_SCAN_WARNING_THRESHOLD {
        warnings.push(SCAN_RATIO_WARNING.into());
    }
    let mut answer = Map::new();
    answer.insert("docs".into(), Value::Array(outcome.docs));
    answer.insert("bookmark".into(), Value::String(outcome.bookmark));
    if !warnings.is_empty() {
        answer.insert("warning".into(), Value::String(warnings.join("\n")));
    }
    if parsed.execution_stats {
        answer.insert(
            "execution_stats".into(),
            json!({
                "total_keys_examined": outcome.examined,
                "total_docs_examined": outcome.examined,
                "total_quorum_docs_examined": 0,
                "results_returned": returned,
                "execution_time_ms": started.elapsed().as_secs_f64() * 1000.0,
            }),
        );
    }
    Ok(Value::Object(answer))
}

/// The document as the selector sees it: `_id`, `_rev`, then the body. `None` for documents a
/// query never returns (design documents).
fn candidate(doc: &StoredDocument) -> Option<Map<String, Value>> {
    if doc.id.starts_with("_design/") || doc.id.starts_with(crate::backend::LOCAL_PREFIX) {
        return None;
    }
    match doc.to_json() {
        Value::Object(map) => Some(map),
        _ => None,
    }
}

/// Where in the first page to resume: after `last_id` if it is still where the bookmark left it
/// or has moved within the page. If it is gone (deleted meanwhile): in an id-ordered source, at
/// the first id after it; otherwise one item earlier than before, where the item that followed
/// it now stands.
fn resume_index(items: &[StoredDocument], offset: usize, last_id: Option<&str>, id_ordered: bool) -> usize {
    let Some(last_id) = last_id else { return offset.min(items.len()) };
    if offset > 0 && items.get(offset - 1).is_some_and(|d| d.id == last_id) {
        return offset;
    }
    if let Some(at) = items.iter().position(|d| d.id == last_id) {
        return at + 1;
    }
    if id_ordered {
        return items.partition_point(|d| d.id.as_bytes() <= last_id.as_bytes());
    }
    offset.saturating_sub(1).min(items.len())
}

/// A query answered in the source's order (no sort, or an index that serves it): pages of
/// candidates filtered, skipped and cut at `limit`.
async fn run_in_order(
    source: &dyn FindSource,
    request: &FindRequest,
    bookmark: Option<Bookmark>,
    limits: FindLimits,
) -> Result<Outcome, MangoError> {
    let tag = source.tag();
    let mut from = match bookmark {
        None => None,
        Some(Bookmark::Scan { source: scanned, position, done }) if scanned == tag => {
            if done || request.limit == 0 {
                let again = Bookmark::Scan { source: scanned, position, done };
                return Ok(Outcome { docs: Vec::new(), bookmark: again.encode(), examined: 0 });
            }
            position
        }
        Some(_) => return Err(invalid_bookmark(&Value::String(request.bookmark.clone().unwrap_or_default()))),
    };
    if request.limit == 0 {
        let start = Bookmark::Scan { source: tag, position: from, done: false };
        return Ok(Outcome { docs: Vec::new(), bookmark: start.encode(), examined: 0 });
    }
    let mut docs = AnswerDocs::new(limits.answer_bytes);
    let (mut examined, mut skipped) = (0u64, 0u64);
    loop {
        let wanted = saturating(request.limit.saturating_add(request.skip).saturating_sub(docs.len() as u64 + skipped));
        let page = source.read(from.as_ref(), wanted).await?;
        for item in page.items {
            examined += 1;
            if !matches(&request.selector, &item.doc) {
                continue;
            }
            if skipped < request.skip {
                skipped += 1;
                continue;
            }
            docs.push(project(item.doc, &request.fields))?;
            if docs.len() as u64 == request.limit {
                let next = Bookmark::Scan { source: tag, position: Some(item.after), done: false };
                return Ok(Outcome { docs: docs.docs, bookmark: next.encode(), examined });
            }
        }
        match page.next {
            Some(next) => from = Some(next),
            None => break,
        }
    }
    let end = Bookmark::Scan { source: tag, position: from, done: true };
    Ok(Outcome { docs: docs.docs, bookmark: end.encode(), examined })
}

/// A query sorted in memory: every match's sort key and id (at most [`SORT_CAP`]), sorted, the
/// page cut after the bookmark, then the page's documents read by id.
async fn run_sorted(
    source: &dyn FindSource,
    request: &FindRequest,
    bookmark: Option<Bookmark>,
    limits: FindLimits,
) -> Result<Outcome, MangoError> {
    let after = match bookmark {
        None | Some(Bookmark::SortedStart) => None,
        Some(Bookmark::Sorted { keys, id }) if keys.len() == request.sort.fields.len() => Some((keys, id)),
        Some(_) => return Err(invalid_bookmark(&Value::String(request.bookmark.clone().unwrap_or_default()))),
    };
    let descending = request.sort.direction == "desc";
    // Equal sort keys fall back to the document id's raw bytes, as a CouchDB view orders rows
    // with equal keys (issue 22 §2c item 4).
    let order = |a: &(Vec<Value>, String), b: &(Vec<Value>, String)| {
        let ascending = compare_keys(&request.sort, &a.0, &b.0).then_with(|| a.1.as_bytes().cmp(b.1.as_bytes()));
        if descending {
            ascending.reverse()
        } else {
            ascending
        }
    };
    let (mut matched, examined) = collect_sort_keys(source, request, limits.sort_cap).await?;
    matched.sort_by(order);
    let start = match &after {
        Some(position) => matched.partition_point(|entry| order(entry, position) != Ordering::Greater),
        None => 0,
    };
    let page: Vec<(Vec<Value>, String)> =
        matched.into_iter().skip(start).skip(saturating(request.skip)).take(saturating(request.limit)).collect();
    let ids: Vec<String> = page.iter().map(|(_, id)| id.clone()).collect();
    let mut docs = AnswerDocs::new(limits.answer_bytes);
    // A document changed since its key was read is checked again and left out if it no longer
    // matches (the page is then short by it, as a concurrent write can make any page).
    for object in source.fetch(&ids).await? {
        if matches(&request.selector, &object) {
            docs.push(project(object, &request.fields))?;
        }
    }
    let docs = docs.docs;
    let bookmark = match page.last() {
        Some((keys, id)) => Bookmark::Sorted { keys: keys.clone(), id: id.clone() },
        None => match after {
            Some((keys, id)) => Bookmark::Sorted { keys, id },
            None => Bookmark::SortedStart,
        },
    };
    Ok(Outcome { docs, bookmark: bookmark.encode(), examined })
}

/// An answer's documents, with their size counted against the answer's byte budget.
struct AnswerDocs {
    docs: Vec<Value>,
    bytes: usize,
    budget: usize,
}

impl AnswerDocs {
    fn new(budget: usize) -> Self {
        AnswerDocs { docs: Vec::new(), bytes: 0, budget }
    }

    fn len(&self) -> usize {
        self.docs.len()
    }

    fn push(&mut self, doc: Value) -> Result<(), MangoError> {
        self.bytes = self.bytes.saturating_add(json_size(&doc));
        if self.bytes > self.budget {
            return Err(MangoError::bad_request(
                "answer_too_large",
                format!(
                    "this query's answer would exceed {} bytes, the most this server sends in one _find response; \
                     ask for a smaller `limit` and continue with `bookmark`",
                    self.budget
                ),
            ));
        }
        self.docs.push(doc);
        Ok(())
    }
}

fn saturating(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// Compares two sort keys field by field: `_id` by bytes (CouchDB sorts it with `_all_docs`, in
/// raw order), every other field in CouchDB's collation.
fn compare_keys(sort: &Sort, a: &[Value], b: &[Value]) -> Ordering {
    sort.fields
        .iter()
        .zip(a.iter().zip(b))
        .map(
            |((path, _), (x, y))| {
                if path.len() == 1 && path[0] == fields::ID {
                    compare_raw(x, y)
                } else {
                    compare(x, y)
                }
            },
        )
        .find(|o| *o != Ordering::Equal)
        .unwrap_or(Ordering::Equal)
}

/// Every match's sort key and id, and how many documents were examined; documents missing a
/// sort field are left out, as a CouchDB index leaves them out.
async fn collect_sort_keys(
    source: &dyn FindSource,
    request: &FindRequest,
    sort_cap: usize,
) -> Result<(Vec<(Vec<Value>, String)>, u64), MangoError> {
    let (mut matched, mut examined, mut from) = (Vec::new(), 0u64, None::<Value>);
    loop {
        let page = source.read(from.as_ref(), SCAN_PAGE).await?;
        for item in &page.items {
            examined += 1;
            if !matches(&request.selector, &item.doc) {
                continue;
            }
            let keys: Option<Vec<Value>> =
                request.sort.fields.iter().map(|(path, _)| value_at(&item.doc, path).cloned()).collect();
            let Some(keys) = keys else { continue };
            if matched.len() == sort_cap {
                return Err(MangoError::bad_request(
                    "too_many_matches_to_sort",
                    format!(
                        "this server sorts at most {sort_cap} matching documents and this query matches more; \
                         narrow the selector, or page without `sort` using `bookmark`"
                    ),
                ));
            }
            matched.push((keys, item.id.clone()));
        }
        match page.next {
            Some(next) => from = Some(next),
            None => return Ok((matched, examined)),
        }
    }
}

/// The value at a path (objects by key, arrays by index), if present.
fn value_at<'a>(object: &'a Map<String, Value>, path: &[String]) -> Option<&'a Value> {
    let (first, rest) = path.split_first()?;
    let mut current = object.get(first)?;
    for segment in rest {
        current = match current {
            Value::Object(map) => map.get(segment)?,
            Value::Array(items) => items.get(segment.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    Some(current)
}

/// `fields`: only the listed paths, nested as in the document (CouchDB's `mango_fields:extract`).
fn project(object: Map<String, Value>, fields: &[(Vec<String>, String)]) -> Value {
    if fields.is_empty() {
        return Value::Object(object);
    }
    let mut out = Map::new();
    for (path, _) in fields {
        let Some(value) = value_at(&object, path) else { continue };
        let (last, parents) = path.split_last().expect("parse_field never returns an empty path");
        let mut target = &mut out;
        for segment in parents {
            let slot = target.entry(segment.clone()).or_insert_with(|| Value::Object(Map::new()));
            if !slot.is_object() {
                *slot = Value::Object(Map::new());
            }
            target = slot.as_object_mut().expect("made an object above");
        }
        target.insert(last.clone(), value.clone());
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::super::request::parse_fields;
    use super::*;

    #[test]
    fn projection_keeps_nested_paths() {
        let doc = json!({"_id": "x", "a": {"b": 1, "c": 2}, "k": "v", "l": [10, 20]});
        let fields = parse_fields(Some(&json!(["a.b", "k", "missing", "l.1"]))).unwrap();
        assert_eq!(
            project(doc.as_object().unwrap().clone(), &fields),
            json!({"a": {"b": 1}, "k": "v", "l": {"1": 20}})
        );
    }

    #[test]
    fn bookmarks_round_trip_and_reject_garbage() {
        let position = BackendPosition { token: Some("t".into()), offset: 3, last_id: Some("id".into()) };
        let b = Bookmark::Scan { source: "all".into(), position: Some(position_json(&position)), done: false };
        assert_eq!(Bookmark::decode(&b.encode()).unwrap(), b);
        let e = Bookmark::decode("not-a-bookmark").unwrap_err().refusal();
        // Fixture 035.
        assert_eq!(
            (e.status.as_u16(), e.error.as_str(), e.reason.as_str()),
            (400, "invalid_bookmark", "Invalid bookmark value: \"not-a-bookmark\"")
        );
    }
}
