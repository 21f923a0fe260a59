//! `GET/POST /{db}/_changes`: a database's change feed in CouchDB's shape, one implementation
//! ([`database_changes`]) for every database, the data-store one included on every backend (over
//! its engine database, `CouchState::data_store_database`), reached through the database router
//! (`super::db`).
//!
//! - `feed=normal` streams every change after `since` (up to `limit`), page by page (pages sized
//!   by their rows' bytes, as listings' are: [`super::listing::PageSizer`]), then
//!   `last_seq` and `pending`; `longpoll` does the same but, with nothing to report, waits until a
//!   change arrives or `timeout` passes; `continuous` writes one line per change as they come,
//!   ending at `timeout` (unless `heartbeat` keeps it open) with a `last_seq` line.
//! - `since` is `0`, `now` or a token from an earlier `last_seq`/`seq`. Tokens are opaque
//!   strings; `pending` is always given, so replicators that cannot compare them know when they
//!   are done. Databases show them `N-token`, `N` the position's rank in the feed, and their
//!   `pending` is the feed's length less the rank ([`crate::database::seq`]). The data-store
//!   database shows the store's own tokens ([`SeqForm::StoreTokens`]: why there), sealed for a
//!   per-user login ([`super::position_seal`]); at the end of its feed `last_seq` is never before
//!   the latest purge's position ([`seq::at_least_purge_floor`]).
//! - What the login may see is a parameter ([`Confinement`]): a per-user login on the data-store
//!   database is answered rows of its own ids only, and its `pending` counts only them
//!   ([`CONFINED_PENDING_READ_LIMIT`]).
//! - `filter=_doc_ids` (`doc_ids` in the query or body), `filter=_selector` (a Mango selector in
//!   the body), `_design`, `_view` and `DDOC/NAME` narrow the rows. `style=all_docs` lists every
//!   leaf of a document's revision tree; `descending=true` reads the whole feed (bounded).
//! - While waiting, the request ends at once when the server shuts down or the client goes away
//!   (the connection task drops the stream). `heartbeat` writes a newline while idle.
//! - Client-chosen waits are bounded ([`FeedBounds`]): `timeout` and `heartbeat` are clamped to
//!   `couchdb_changes_timeout_ms` (CouchDB's `changes_timeout`, which CouchDB clamps both to as
//!   well), a heartbeat is at least `couchdb_changes_min_heartbeat_ms`, and a continuous feed kept
//!   open by heartbeats ends after `couchdb_changes_max_feed_secs`. Heartbeats run on their own
//!   timer: the backend is polled on the back-off schedule whatever the heartbeat, so a small one
//!   costs newlines, not reads. One login holds at most `couchdb_max_feeds_per_login` long-lived
//!   feeds at once (429 past it).
//! - The first page is read before the response starts, so a `since` the backend does not
//!   recognise is CouchDB's 400 rather than a cut-off stream.
//! - `GET /_db_updates` (`super::db_updates`) is `_global_changes`' feed read here too
//!   ([`db_updates_feed`]): rows made from the feed's entries alone and shown as database events,
//!   closed without `pending`, with every bound above.
//! - A database deleted under its feed: before the response starts, CouchDB's 404 (the reads run
//!   while the database is open, [`while_open`], so a table gone under them is the deletion's,
//!   not the backend's error); once it has started, the feed ends at its next step with its
//!   ordinary closing, as CouchDB's does ([`deleted_database_tail`]).

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Extension, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::IntoResponse;
use futures::stream;
use serde::Serialize;
use serde_json::{json, Map, Value};
use tokio::sync::watch;
use tokio::time::Instant;

use super::auth::Identity;
use super::error::{CouchError, CouchResult};
use super::listing::{PageSizer, FIRST_PAGE_WITH_DOCS};
use super::position_seal::PositionSeal;
use super::request::{bool_param, json_param};
use super::{Answer, CouchState};
use crate::backend::{Change, DocumentBackend};
use crate::config::Settings;
use crate::database::data_store_rules::Confinement;
use crate::database::seq::{self, Ranks};
use crate::database::Database;
use crate::error::ErrorKind;
use crate::feed::{read_page, resolve_since, DeliveredTail, FeedPage, PollBackoff, DEFAULT_PAGE};

/// The longest pause between two polls of an idle feed.
const POLL_CEILING: Duration = Duration::from_secs(1);

/// CouchDB's answer to a `since` it cannot read (`fabric_view_changes:validate_start_seq` in
/// CouchDB 3.4.3's source).
pub const MALFORMED_SINCE: &str = "Malformed sequence supplied in 'since' parameter.";

/// The bounds on client-chosen waits and on how many long-lived feeds one login holds.
pub struct FeedBounds {
    /// The longest `timeout`, the default one, and the longest heartbeat interval.
    max_timeout: Duration,
    min_heartbeat: Duration,
    /// How long a continuous feed kept open by heartbeats may live.
    max_life: Duration,
    max_per_login: usize,
    /// The longest database feed `descending=true` reads (`couchdb_max_descending_changes`).
    max_descending: usize,
    /// Long-lived feeds held at once, by login (or peer address when anonymous).
    holders: Arc<Mutex<HashMap<String, usize>>>,
}

/// One long-lived feed's place in its login's count; given back when the stream is dropped.
pub struct FeedSlot {
    holders: Arc<Mutex<HashMap<String, usize>>>,
    key: String,
}

impl Drop for FeedSlot {
    fn drop(&mut self) {
        let mut holders = self.holders.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(count) = holders.get_mut(&self.key) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                holders.remove(&self.key);
            }
        }
    }
}

impl FeedBounds {
    pub fn from_settings(settings: &Settings) -> Self {
        FeedBounds {
            max_timeout: Duration::from_millis(settings.couchdb_changes_timeout_ms),
            min_heartbeat: Duration::from_millis(settings.couchdb_changes_min_heartbeat_ms),
            max_life: Duration::from_secs(settings.couchdb_changes_max_feed_secs),
            max_per_login: settings.couchdb_max_feeds_per_login,
            max_descending: settings.couchdb_max_descending_changes,
            holders: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// A place for one more long-lived feed of `key`, or CouchDB-style 429 naming the setting.
    fn take_slot(&self, key: String) -> CouchResult<FeedSlot> {
        let mut holders = self.holders.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let count = holders.entry(key.clone()).or_insert(0);
        if *count >= self.max_per_login {
            return Err(CouchError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_requests",
                format!(
                    "this login already holds {} long-lived _changes feeds (longpoll or continuous); the limit is \
                     couchdb_max_feeds_per_login = {}",
                    *count, self.max_per_login
                ),
            ));
        }
        *count += 1;
        Ok(FeedSlot { holders: Arc::clone(&self.holders), key })
    }

    #[cfg(test)]
    fn for_tests() -> Self {
        FeedBounds {
            max_timeout: Duration::from_secs(60),
            min_heartbeat: Duration::from_secs(1),
            max_life: Duration::from_secs(3600),
            max_per_login: 2,
            max_descending: 100_000,
            holders: Arc::new(Mutex::new(HashMap::new())),
        }
    }
}

/// Whose long-lived feeds a request counts against: the login name, or the peer address for
/// anonymous requests (the API open, every request acting as admin).
fn feed_owner(identity: Option<&Identity>, peer: Option<SocketAddr>) -> String {
    match (identity.and_then(|identity| identity.name.as_deref()), peer) {
        (Some(name), _) => format!("login:{name}"),
        (None, Some(peer)) => format!("peer:{}", peer.ip()),
        (None, None) => "anonymous".to_owned(),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Feed {
    Normal,
    Longpoll,
    Continuous,
}

/// A predicate over a change's document (the `_selector` filter).
pub(crate) type DocumentPredicate = Box<dyn Fn(&Value) -> bool + Send + Sync>;

/// Which changes a request wants.
enum Filter {
    All,
    DocIds(HashSet<String>),
    /// CouchDB's built-in `_design`: design documents' changes only.
    Design,
    Selector(DocumentPredicate),
    /// `filter=DDOC/NAME` (a design document's `filters.NAME`) or `filter=_view&view=DDOC/NAME`
    /// (documents the view's map function emits for), as asked: resolved against the database's
    /// design document into [`Filter::JavaScript`] before the feed starts.
    Named {
        ddoc: String,
        name: String,
        view: bool,
    },
    JavaScript(Arc<JsFilter>),
}

/// A design document's filter function, ready to run over each page's documents.
pub(crate) struct JsFilter {
    engine: crate::js::JsEngine,
    code: crate::js::DesignCode,
    name: String,
    /// `_view`: the view's map function decides (emits anything or not).
    view: bool,
    /// CouchDB's request object (`req`): the query, the login's `userCtx`, the `secObj`.
    req: Value,
}

impl JsFilter {
    /// Which of `docs` pass.
    async fn passes(&self, docs: Vec<Arc<Value>>) -> crate::Result<Vec<bool>> {
        let answer = if self.view {
            self.engine.filter_view(&self.code, &self.name, docs).await
        } else {
            self.engine.filter(&self.code, &self.name, docs, &self.req).await
        };
        answer.map_err(|err| super::validation::function_failure(&format!("filter {}", self.name), err))
    }
}

/// The checked request.
struct ChangesRequest {
    feed: Feed,
    since: Option<String>,
    /// `None`: no limit (also what a negative `limit` means, as in CouchDB 3.4.3).
    limit: Option<u64>,
    include_docs: bool,
    timeout: Duration,
    heartbeat: Option<Duration>,
    filter: Filter,
    /// `style=all_docs`: every leaf of a document's revision tree in `changes`, not only the
    /// winner (the data-store database keeps one leaf, so it is the same there).
    all_leaves: bool,
    /// `conflicts=true`: documents carry `_conflicts` (with `include_docs`).
    conflicts: bool,
    /// `attachments=true` / `atts_since` (with `include_docs`, on databases besides the data-store
    /// one): attachments with their bytes instead of stubs.
    inline: Option<super::db::Inline>,
    /// `feed=eventsource`: a continuous feed framed as server-sent events (`data:` and `id:`
    /// lines per row, heartbeats as `event: heartbeat`), as CouchDB frames it.
    eventsource: bool,
    /// `descending=true`: newest change first (the feed is read whole for it, up to
    /// `couchdb_max_descending_changes`).
    descending: bool,
    /// The ids the login may see (a per-user login on the data-store database: its own); rows of
    /// other ids are never answered nor counted in `pending`.
    confinement: Confinement,
    /// `_db_updates` ([`db_updates_feed`]): the feed is `_global_changes`', shown as database
    /// events rather than document changes.
    db_updates: bool,
}

/// Who asks for a feed: what it may see, who it is (for a design filter's `userCtx`), and whose
/// feed count its long-lived feeds go to.
pub(crate) struct FeedAsker {
    pub confinement: Confinement,
    pub identity: Option<Identity>,
    pub peer: Option<SocketAddr>,
}

impl FeedAsker {
    /// The asker of a request, from what its handler extracted.
    pub(crate) fn of(
        confinement: Confinement,
        identity: Option<Extension<Identity>>,
        peer: Option<Extension<ConnectInfo<SocketAddr>>>,
    ) -> Self {
        FeedAsker { confinement, identity: identity.map(|e| e.0), peer: peer.map(|e| e.0 .0) }
    }

    /// Whose long-lived feeds this request counts against.
    fn owner(&self) -> String {
        feed_owner(self.identity.as_ref(), self.peer)
    }
}

/// How a feed shows its positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SeqForm {
    /// `N-token`, `N` the rank ([`crate::database::seq`]): every database but the data-store one.
    Ranked,
    /// The backend's own tokens, sealed for a per-user login ([`super::position_seal`]): the
    /// data-store database, whose `update_seq` (`GET /{db}`) and clients' stored checkpoints are
    /// these tokens, and whose Firestore tokens hold a `-` that `N-token` could not tell apart.
    StoreTokens,
}

/// `GET/POST /{db}/_changes` of any database: the one feed. `db` is the database (the data-store
/// one included: `CouchState::data_store_database`); `asker.confinement` what the login may see there
/// (`Everything` but for a per-user login on the data-store database). The data-store database
/// shows the backend's own positions ([`SeqForm::StoreTokens`]), sealed for a per-user login,
/// whose `since` is unsealed (one that does not unseal reads as `0`); the others `N-token`.
pub(crate) async fn database_changes(
    state: &CouchState,
    db: Arc<Database>,
    asker: FeedAsker,
    params: &HashMap<String, String>,
    body: Option<Map<String, Value>>,
) -> Answer {
    let form = if db.name() == &*state.db { SeqForm::StoreTokens } else { SeqForm::Ranked };
    let mut request = parse_request(params, body.as_ref(), &state.feeds)?;
    if form == SeqForm::StoreTokens {
        request.since = state.auth.sessions.positions().given_by(&asker.confinement, request.since.take());
    }
    request.confinement = asker.confinement.clone();
    match form {
        SeqForm::StoreTokens => resolve_data_store_filter(state, Some(&db), &asker, params, &mut request).await?,
        SeqForm::Ranked => resolve_filter(state, &db, asker.identity.as_ref(), params, &mut request).await?,
    }
    respond(state, asker.owner(), request, db, form).await
}

/// Resolves `filter=DDOC/NAME` and `filter=_view` on the data-store database against the design
/// documents this server keeps for it (admins only, as every design document there). Over a
/// backend that runs its own design documents (CouchDB) the feed is read here but the design
/// document is the database's, so such a filter is refused (400). `db` is the engine's data-store
/// database (`None` on that backend).
async fn resolve_data_store_filter(
    state: &CouchState,
    db: Option<&Database>,
    asker: &FeedAsker,
    params: &HashMap<String, String>,
    request: &mut ChangesRequest,
) -> CouchResult<()> {
    let Filter::Named { ddoc, .. } = &request.filter else { return Ok(()) };
    let Some(db) = db.filter(|_| !state.store.backend().forwards_requests()) else {
        return Err(CouchError::bad_request(
            "design-document filters are not run on the data-store database's feed over this backend; use _doc_ids, _selector or _design",
        ));
    };
    asker.confinement.check_design()?;
    let doc = live_design_doc(db, ddoc).await?;
    // The data-store database has no `_security` object: CouchDB's default, an empty one.
    install_named_filter(state, &state.db, doc, json!({}), asker.identity.as_ref(), params, request)
}

/// Resolves `filter=DDOC/NAME` and `filter=_view` against the database's design document (404
/// as CouchDB when it or the function is missing).
async fn resolve_filter(
    state: &CouchState,
    db: &Database,
    identity: Option<&Identity>,
    params: &HashMap<String, String>,
    request: &mut ChangesRequest,
) -> CouchResult<()> {
    let Filter::Named { ddoc, .. } = &request.filter else { return Ok(()) };
    let doc = live_design_doc(db, ddoc).await?;
    let sec_obj = super::db::security_of(db).await?;
    install_named_filter(state, db.name(), doc, sec_obj, identity, params, request)
}

/// The design document `_design/{ddoc}`'s winner as CouchDB shows it (404 as CouchDB when it is
/// missing or deleted).
async fn live_design_doc(db: &Database, ddoc: &str) -> CouchResult<Value> {
    let id = format!("_design/{ddoc}");
    let stored = db.read(&id).await?.ok_or_else(|| CouchError::not_found("missing"))?;
    let winner = stored.tree.winner().filter(|leaf| !leaf.deleted).ok_or_else(|| CouchError::not_found("deleted"))?;
    Ok(super::db::leaf_json(&id, &stored.tree, winner, super::db::DocOptions::default()))
}

/// Makes a named filter of `request` the JavaScript filter of the design document `doc` (its
/// winning revision as CouchDB shows it), with CouchDB's `req` for the function.
fn install_named_filter(
    state: &CouchState,
    db_name: &str,
    doc: Value,
    sec_obj: Value,
    identity: Option<&Identity>,
    params: &HashMap<String, String>,
    request: &mut ChangesRequest,
) -> CouchResult<()> {
    let Filter::Named { name, view, .. } = &request.filter else { return Ok(()) };
    let found =
        if *view { doc["views"][name.as_str()]["map"].is_string() } else { doc["filters"][name.as_str()].is_string() };
    if !found {
        return Err(CouchError::not_found(format!("missing json key: {name}")));
    }
    let who = identity.map(Identity::user_ctx);
    let req = json!({
        "method": "GET",
        "query": params,
        "userCtx": {
            "db": db_name,
            "name": who.as_ref().and_then(|who| who.name),
            "roles": who.as_ref().map(|who| who.roles.to_vec()).unwrap_or_default(),
        },
        "secObj": sec_obj,
        "info": {"db_name": db_name},
        "headers": {},
        "body": "undefined",
    });
    let id = doc["_id"].as_str().unwrap_or_default().to_owned();
    let rev = doc["_rev"].as_str().unwrap_or_default().to_owned();
    let code = crate::js::DesignCode::new(db_name, id, rev, Arc::new(doc));
    let filter = JsFilter { engine: state.js.clone(), code, name: name.clone(), view: *view, req };
    request.filter = Filter::JavaScript(Arc::new(filter));
    Ok(())
}

/// `GET /{db}/_changes` of a database opened by the database router.
pub(crate) async fn get_database_changes(
    State(state): State<CouchState>,
    opened: super::db::OpenDb,
    identity: Option<Extension<Identity>>,
    peer: Option<Extension<ConnectInfo<SocketAddr>>>,
    Query(params): Query<HashMap<String, String>>,
) -> Answer {
    let asker = FeedAsker::of(opened.confinement, identity, peer);
    database_changes(&state, opened.db, asker, &params, None).await
}

/// `POST /{db}/_changes` of a database opened by the database router.
pub(crate) async fn post_database_changes(
    State(state): State<CouchState>,
    opened: super::db::OpenDb,
    identity: Option<Extension<Identity>>,
    peer: Option<Extension<ConnectInfo<SocketAddr>>>,
    Query(params): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    let asker = FeedAsker::of(opened.confinement, identity, peer);
    let body = read_body(&state, &headers, body).await?;
    database_changes(&state, opened.db, asker, &params, body).await
}

async fn read_body(state: &CouchState, headers: &HeaderMap, body: Body) -> CouchResult<Option<Map<String, Value>>> {
    match state.bodies.read_json(headers, body).await? {
        None => Ok(None),
        Some(body) => match body.value {
            Value::Object(map) => Ok(Some(map)),
            _ => Err(CouchError::bad_request("Request body must be a JSON object")),
        },
    }
}

fn parse_request(
    params: &HashMap<String, String>,
    body: Option<&Map<String, Value>>,
    bounds: &FeedBounds,
) -> CouchResult<ChangesRequest> {
    let param = |name: &str| params.get(name).map(String::as_str);
    let feed = match param("feed") {
        None | Some("normal") => Feed::Normal,
        Some("longpoll") => Feed::Longpoll,
        Some("continuous") | Some("eventsource") => Feed::Continuous,
        Some(other) => {
            return Err(CouchError::bad_request(format!(
                "Supported `feed` types: normal, continuous, longpoll, eventsource (not {other:?})"
            )))
        }
    };
    let eventsource = param("feed") == Some("eventsource");
    let descending = bool_param("descending", param("descending"), false)?;
    // CouchDB clamps both to its `changes_timeout` (`couch_changes:get_changes_timeout`); a
    // heartbeat is also raised to the minimum, so a tiny one cannot make a busy feed.
    let heartbeat = match param("heartbeat") {
        None | Some("false") => None,
        Some("true") => Some(bounds.max_timeout),
        Some(ms) => {
            Some(Duration::from_millis(whole_number("heartbeat", ms)?).clamp(bounds.min_heartbeat, bounds.max_timeout))
        }
    };
    let timeout = match param("timeout") {
        None => bounds.max_timeout,
        Some(ms) => Duration::from_millis(whole_number("timeout", ms)?).min(bounds.max_timeout),
    };
    let filter = match param("filter") {
        None => Filter::All,
        Some("_doc_ids") => Filter::DocIds(doc_ids(param("doc_ids"), body)?),
        Some("_selector") => Filter::Selector(selector(body)?),
        Some("_design") => Filter::Design,
        Some("_view") => {
            let Some((ddoc, name)) = param("view").and_then(|view| view.split_once('/')) else {
                return Err(CouchError::bad_request("`view` filter parameter is not provided."));
            };
            Filter::Named { ddoc: ddoc.to_owned(), name: name.to_owned(), view: true }
        }
        Some(other) => match other.split_once('/') {
            Some((ddoc, name)) if !ddoc.is_empty() && !name.is_empty() => {
                Filter::Named { ddoc: ddoc.to_owned(), name: name.to_owned(), view: false }
            }
            _ => {
                return Err(CouchError::bad_request(format!(
                    "filter {other:?} is not one of _doc_ids, _selector, _design, _view or DDOC/NAME"
                )))
            }
        },
    };
    let since = match param("since") {
        Some(text) => Some(text.to_owned()),
        None => {
            body.and_then(|b| b.get("since")).map(|v| v.as_str().map(str::to_owned).unwrap_or_else(|| v.to_string()))
        }
    };
    Ok(ChangesRequest {
        feed,
        since,
        limit: changes_limit(param("limit"))?,
        include_docs: bool_param("include_docs", param("include_docs"), false)?,
        timeout,
        heartbeat,
        filter,
        all_leaves: param("style") == Some("all_docs"),
        descending,
        eventsource,
        conflicts: bool_param("conflicts", param("conflicts"), false)?,
        inline: super::db::inline_wanted(params)?,
        confinement: Confinement::Everything,
        db_updates: false,
    })
}

/// A non-negative whole number of milliseconds; a larger one than `u64` holds is clamped later
/// anyway, so it reads as the largest.
fn whole_number(name: &str, text: &str) -> CouchResult<u64> {
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        return Ok(text.parse::<u64>().unwrap_or(u64::MAX));
    }
    Err(CouchError::bad_request(format!("Invalid value for {name}: {text:?}; must be a non-negative integer")))
}

/// `limit`: CouchDB 3.4.3 reads it as any integer, and its feed stops only when the count it
/// decrements reaches 0 (`fabric_view_changes`), so a negative limit is no limit.
fn changes_limit(value: Option<&str>) -> CouchResult<Option<u64>> {
    let Some(text) = value else { return Ok(None) };
    let digits = text.strip_prefix('-').unwrap_or(text);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(CouchError::bad_request(format!("Invalid value for limit: {text:?}; must be an integer")));
    }
    if text.starts_with('-') {
        return Ok(None);
    }
    Ok(Some(text.parse::<u64>().unwrap_or(u64::MAX)))
}

fn doc_ids(query: Option<&str>, body: Option<&Map<String, Value>>) -> CouchResult<HashSet<String>> {
    let ids = match (query, body.and_then(|b| b.get("doc_ids"))) {
        (_, Some(ids)) => ids.clone(),
        (Some(text), None) => json_param("doc_ids", Some(text))?.unwrap_or(Value::Null),
        (None, None) => return Err(CouchError::bad_request("filter=_doc_ids needs a `doc_ids` array")),
    };
    match ids {
        Value::Array(ids) => ids
            .into_iter()
            .map(|id| {
                id.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| CouchError::bad_request("`doc_ids` must be an array of strings"))
            })
            .collect(),
        _ => Err(CouchError::bad_request("`doc_ids` must be an array of strings")),
    }
}

/// The `_selector` filter: a Mango selector ([`crate::mango`]) over each changed document.
fn selector(body: Option<&Map<String, Value>>) -> CouchResult<DocumentPredicate> {
    let Some(selector) = body.and_then(|b| b.get("selector")) else {
        return Err(CouchError::bad_request("filter=_selector needs a `selector` object in the body"));
    };
    let Value::Object(selector) = selector else {
        return Err(CouchError::bad_request("Selector error: expected a JSON object"));
    };
    let parsed = crate::mango::selector::parse(selector)?;
    Ok(Box::new(move |doc: &Value| doc.as_object().is_some_and(|doc| crate::mango::eval::matches(&parsed, doc))))
}

/// Where the stream is.
struct Cursor {
    backend: Arc<dyn DocumentBackend>,
    /// The database whose feed this is: rows come from each document's revision tree.
    database: Arc<Database>,
    /// How positions are shown.
    form: SeqForm,
    /// Seals the positions shown to a per-user login.
    positions: PositionSeal,
    request: Arc<ChangesRequest>,
    since: Option<String>,
    last_seq: String,
    pending: u64,
    /// On a database whose backend counts its feed: the rank (`N`) of `last_seq`, and at the
    /// end the shown `N` and `pending` (`crate::database::seq`).
    ranks: Option<Ranks>,
    closing_ranks: Option<(u64, u64)>,
    rows_sent: u64,
    phase: Phase,
    /// When a waiting feed ends.
    deadline: Instant,
    backoff: PollBackoff,
    /// The page read before the response started; the stream's first step uses it.
    first_page: Option<FeedPage>,
    /// When an idle feed polls the backend next (`None`: at once).
    next_poll: Option<Instant>,
    /// When the next heartbeat newline is due (on its own schedule, never a poll).
    next_heartbeat: Option<Instant>,
    stopping: watch::Receiver<bool>,
    /// The unsettled changes this answer sent, not to be sent again when they settle.
    delivered: DeliveredTail,
    /// This feed's place in its login's count of long-lived feeds.
    _slot: Option<FeedSlot>,
    /// How many changes the next page reads, from the size of the rows so far.
    sizer: PageSizer,
}

/// Why an idle feed woke up.
enum Wake {
    Poll,
    Heartbeat,
    Finished,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Reading,
    Finished,
}

async fn respond(
    state: &CouchState,
    owner: String,
    request: ChangesRequest,
    database: Arc<Database>,
    form: SeqForm,
) -> CouchResult<axum::response::Response> {
    let positions = state.auth.sessions.positions();
    if request.descending {
        return descending_answer(&database, &request, state.feeds.max_descending, form, &positions).await;
    }
    let long_lived = request.feed != Feed::Normal;
    let slot = if long_lived { Some(state.feeds.take_slot(owner)?) } else { None };
    let backend = database.backend().clone();
    let malformed = |err: crate::Error| match err.kind() {
        ErrorKind::InvalidInput => CouchError::bad_request(MALFORMED_SINCE),
        _ => CouchError::from(err),
    };
    // A database shows positions as `N-token` (`crate::database::seq`); the backend reads the token.
    let asked = match (form, request.since.as_deref()) {
        (SeqForm::Ranked, Some(text)) => Some(crate::database::seq::read(text)),
        (_, asked) => asked,
    };
    let since = database.while_open(resolve_since(backend.as_ref(), asked)).await.map_err(malformed)?;
    // Where the backend counts its feed, `N` is a rank counted from the client's `since`.
    let ranks = match form {
        SeqForm::Ranked => database
            .while_open(seq::counted_length(backend.as_ref(), database.erased_doc()))
            .await?
            .map(|length| Ranks::from_since(request.since.as_deref(), length)),
        SeqForm::StoreTokens => None,
    };
    // The first page is read here, before the status line: a `since` the backend does not know
    // is a 400 now, not a stream that breaks off.
    // Pages are sized by the bytes of their rows, as listings' are (a client that stops reading
    // holds a page): documents make the first page small and the next ones follow their size.
    let sizer = PageSizer::new(if request.include_docs { FIRST_PAGE_WITH_DOCS } else { DEFAULT_PAGE }, DEFAULT_PAGE);
    let first_size = request.limit.map_or(sizer.rows(), |l| l.clamp(1, sizer.rows() as u64) as usize);
    let first_page =
        database.while_open(read_page(backend.as_ref(), since.as_deref(), first_size)).await.map_err(malformed)?;
    let last_seq = match &since {
        Some(position) => position.clone(),
        None => "0".to_owned(),
    };
    let now = Instant::now();
    // A continuous feed with a heartbeat does not end at its timeout (as in CouchDB), but it does
    // end at the longest feed life.
    let lifetime = match (request.feed, request.heartbeat) {
        (Feed::Continuous, Some(_)) => state.feeds.max_life,
        _ => request.timeout,
    };
    let mut cursor = Cursor {
        backend,
        database,
        form,
        positions: positions.clone(),
        deadline: now + lifetime,
        next_heartbeat: request.heartbeat.filter(|_| long_lived).map(|beat| now + beat),
        request: Arc::new(request),
        since,
        last_seq,
        pending: 0,
        ranks,
        closing_ranks: None,
        rows_sent: 0,
        phase: Phase::Reading,
        backoff: PollBackoff::new(POLL_CEILING),
        first_page: Some(first_page),
        next_poll: None,
        stopping: state.stopping.clone(),
        _slot: slot,
        delivered: DeliveredTail::default(),
        sizer,
    };
    let eventsource = cursor.request.eventsource;
    // The first page's rows are made here too, before the status line: a design function that
    // fails on them (a filter past `couchdb_js_timeout_ms`) is answered with its own status, as
    // CouchDB answers an error that comes before its response has started.
    let opening = if cursor.request.feed == Feed::Continuous { "" } else { "{\"results\":[" };
    let first = format!("{opening}{}", step(&mut cursor).await?);
    // Deleted before anything was sent: CouchDB's 404 for a missing database, not a feed.
    cursor.database.check_open()?;
    let body = stream::try_unfold((Some(first), cursor), |(first, mut cursor)| async move {
        if let Some(first) = first {
            return Ok(Some((Bytes::from(first), (None, cursor))));
        }
        let chunk = match cursor.phase {
            Phase::Finished => return Ok::<_, crate::Error>(None),
            Phase::Reading => match step(&mut cursor).await {
                Ok(chunk) => chunk,
                // A design function failed once the answer had begun: the feed ends with its
                // error, after the rows sent so far (CouchDB cuts the connection there).
                Err(err) => match answered(&err) {
                    Some(answer) => {
                        cursor.phase = Phase::Finished;
                        error_tail(&cursor, cursor.pending, &answer.error, &answer.reason)?
                    }
                    None => return Err(err),
                },
            },
        };
        Ok(Some((Bytes::from(chunk), (None, cursor))))
    });
    let mut response = Body::from_stream(body).into_response();
    let content_type = if eventsource { "text/event-stream" } else { "application/json" };
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    Ok(response)
}

/// One step of the stream: a page of rows, a heartbeat, or the end.
async fn step(cursor: &mut Cursor) -> crate::Result<String> {
    let request = Arc::clone(&cursor.request);
    let remaining = request.limit.map(|l| l.saturating_sub(cursor.rows_sent));
    if remaining == Some(0) {
        return finish(cursor).await;
    }
    if let Some(due) = cursor.next_poll {
        match wait_until(cursor, due).await {
            Wake::Poll => cursor.next_poll = None,
            // A heartbeat keeps proxies and clients from timing the connection out while idle.
            Wake::Heartbeat if request.eventsource => return Ok("event: heartbeat\ndata: \n\n".to_owned()),
            Wake::Heartbeat => return Ok("\n".to_owned()),
            Wake::Finished => return finish(cursor).await,
        }
    }
    let mut page = match cursor.first_page.take() {
        Some(page) => page,
        // Deleted while the feed waited: it ends now, as CouchDB's does.
        None if cursor.database.check_open().is_err() => {
            return deleted_database_tail(cursor);
        }
        None => {
            let largest = cursor.sizer.rows();
            let page_size = remaining.map(|r| r.min(largest as u64) as usize).unwrap_or(largest);
            match read_page(cursor.backend.as_ref(), cursor.since.as_deref(), page_size).await {
                Ok(page) => page,
                // A read that fails because the database was deleted (its table or file gone)
                // ends the feed naming that, not with a broken stream.
                Err(_) if cursor.database.check_open().is_err() => {
                    return deleted_database_tail(cursor);
                }
                Err(err) => return Err(err),
            }
        }
    };
    cursor.delivered.drop_repeats(&mut page);
    let before = (
        cursor.since.replace(page.last_seq.clone()),
        std::mem::replace(&mut cursor.last_seq, page.last_seq.clone()),
        std::mem::replace(&mut cursor.pending, page.pending),
    );
    let rows = match rows_of(cursor, &page.changes).await {
        Ok(rows) => {
            if let Some(ranks) = &mut cursor.ranks {
                ranks.advance(page.changes.len());
            }
            rows
        }
        // The database was deleted while the feed ran: it ends with CouchDB's error for a
        // missing database as its last line (the status has long been sent).
        Err(err) if err.kind() == ErrorKind::NotFound => {
            return deleted_database_tail(cursor);
        }
        // None of the page's rows were sent: a `last_seq` shown after this names the position
        // before it, so a client that resumes from it misses nothing.
        Err(err) => {
            (cursor.since, cursor.last_seq, cursor.pending) = before;
            return Err(err);
        }
    };
    let rows = written_rows(rows, &request)?;
    let mut chunk = String::new();
    for row in &rows {
        match request.feed {
            Feed::Continuous if request.eventsource => {
                let WrittenRow { text, seq } = row;
                // `_db_updates` writes the position as JSON (quoted), `_changes` bare (CouchDB
                // 3.4.3's `global_changes_httpd` and `chttpd_db` each do so).
                let id = if request.db_updates { seq.as_str() } else { seq.trim_matches('"') };
                chunk.push_str(&format!("data: {text}\nid: {id}\n\n"));
            }
            Feed::Continuous => {
                chunk.push_str(&row.text);
                chunk.push('\n');
            }
            _ => {
                if cursor.rows_sent > 0 {
                    chunk.push(',');
                }
                chunk.push('\n');
                chunk.push_str(&row.text);
            }
        }
        cursor.rows_sent += 1;
    }
    if !rows.is_empty() {
        cursor.backoff.reset();
    }
    // Per change read, not per row sent: a filter's reads cost no memory once the page is done.
    cursor.sizer.saw(page.changes.len(), chunk.len());
    let at_end = page.pending == 0;
    let finished = match request.feed {
        Feed::Normal => at_end,
        Feed::Longpoll => at_end && cursor.rows_sent > 0,
        Feed::Continuous => false,
    };
    // A long-lived feed ends at shutdown after the page it has sent, even while writes keep
    // coming (it would otherwise never reach a quiet end and be cut without its `last_seq`).
    let stopping = request.feed != Feed::Normal && *cursor.stopping.borrow();
    if finished || stopping {
        chunk.push_str(&finish(cursor).await?);
        return Ok(chunk);
    }
    if !at_end || !chunk.is_empty() {
        return Ok(chunk);
    }
    // At the end with nothing new: the next step waits for the next poll on the back-off
    // schedule (writing heartbeats meanwhile), or ends.
    if *cursor.stopping.borrow() || Instant::now() >= cursor.deadline {
        return finish(cursor).await;
    }
    cursor.next_poll = Some(Instant::now() + cursor.backoff.idle());
    Ok(String::new())
}

/// Waits until the next poll is `due`, a heartbeat is, the feed's deadline passes or the server
/// stops, whichever comes first.
async fn wait_until(cursor: &mut Cursor, due: Instant) -> Wake {
    if *cursor.stopping.borrow() {
        return Wake::Finished;
    }
    let wake_at = cursor.next_heartbeat.map_or(due, |beat| beat.min(due)).min(cursor.deadline);
    tokio::select! {
        () = tokio::time::sleep_until(wake_at) => {}
        _ = cursor.stopping.changed() => return Wake::Finished,
    }
    let now = Instant::now();
    if now >= cursor.deadline {
        return Wake::Finished;
    }
    if let (Some(beat), Some(interval)) = (cursor.next_heartbeat, cursor.request.heartbeat) {
        if beat <= now {
            cursor.next_heartbeat = Some(now + interval);
            return Wake::Heartbeat;
        }
    }
    Wake::Poll
}

/// The closing text, and the stream marked finished.
async fn finish(cursor: &mut Cursor) -> crate::Result<String> {
    cursor.phase = Phase::Finished;
    // A per-user login is told how many of its own changes are left, never everyone's.
    if cursor.pending > 0 && cursor.request.confinement.only_user().is_some() {
        cursor.pending =
            confined_pending(cursor.backend.as_ref(), cursor.since.as_deref(), &cursor.request.confinement).await?;
    }
    // At the end of the data-store database's feed (positions the store's own, no rank to carry
    // `N`), `last_seq` never goes back with a purge of the feed's last entry.
    if let (SeqForm::StoreTokens, 0) = (cursor.form, cursor.pending) {
        let last_seq = cursor.last_seq.clone();
        let erased_doc = cursor.database.erased_doc();
        cursor.last_seq = seq::at_least_purge_floor(cursor.backend.as_ref(), erased_doc, last_seq).await?;
    }
    if let Some(ranks) = &cursor.ranks {
        // The feed's length now closes the answer; a count that fails (the database deleted
        // meanwhile) leaves the rank read so far and the read's own `pending`.
        let length = seq::counted_length(cursor.backend.as_ref(), cursor.database.erased_doc()).await.ok().flatten();
        cursor.closing_ranks = Some(length.map_or((ranks.at, cursor.pending), |n| ranks.closing(n, cursor.pending)));
    }
    closing(cursor)
}

/// The end of a feed whose database was deleted under it: CouchDB 3.4.3 ends such a feed at
/// once with its ordinary closing (`last_seq` where the feed was, `pending` 0; nothing for
/// eventsource), no error row; the feed's length is not counted, the database being gone.
fn deleted_database_tail(cursor: &mut Cursor) -> crate::Result<String> {
    cursor.phase = Phase::Finished;
    cursor.pending = 0;
    cursor.closing_ranks = cursor.ranks.map(|ranks| (ranks.at, 0));
    closing(cursor)
}

/// The end of a feed that stopped on an error after its answer began: the error as the last
/// line (continuous, eventsource) or as members after the rows, so the client reads why it
/// ended, and from which `last_seq` to resume.
fn error_tail(cursor: &Cursor, pending: u64, error: &str, reason: &str) -> crate::Result<String> {
    let answer = json!({ "error": error, "reason": reason });
    Ok(match cursor.request.feed {
        Feed::Continuous if cursor.request.eventsource => format!("event: error\ndata: {answer}\n\n"),
        Feed::Continuous => format!("{answer}\n"),
        _ => format!(
            "\n],\"last_seq\":{},\"pending\":{},\"error\":{},\"reason\":{}}}\n",
            Value::from(shown_seq(cursor, &cursor.last_seq, cursor.ranks.map(|r| r.at))?),
            pending,
            Value::from(error),
            Value::from(reason)
        ),
    })
}

/// CouchDB's answer to `err` when it is a design function's failure
/// ([`super::validation::function_failure`]).
fn answered(err: &crate::Error) -> Option<CouchError> {
    let source = std::error::Error::source(err)?;
    source.downcast_ref::<super::error::Answered>().map(|answered| answered.0.clone())
}

fn closing(cursor: &Cursor) -> crate::Result<String> {
    let (rank, pending) = match cursor.closing_ranks {
        Some((rank, pending)) => (Some(rank), pending),
        None => (None, cursor.pending),
    };
    let last_seq = shown_seq(cursor, &cursor.last_seq, rank)?;
    if cursor.request.db_updates {
        return Ok(db_updates_closing(&cursor.request, &last_seq));
    }
    let tail = json!({ "last_seq": last_seq, "pending": pending });
    Ok(match cursor.request.feed {
        Feed::Continuous if cursor.request.eventsource => String::new(),
        Feed::Continuous => format!("{tail}\n"),
        _ => format!("\n],\"last_seq\":{},\"pending\":{pending}}}\n", Value::from(last_seq)),
    })
}

/// A feed position as the feed's database shows it (`N-token` for databases besides the
/// data-store one, `N` its `rank` where the feed is counted; the data-store database's positions
/// stay the backend's tokens, sealed for a per-user login).
fn shown_seq(cursor: &Cursor, token: &str, rank: Option<u64>) -> crate::Result<String> {
    match rank {
        _ if cursor.form == SeqForm::StoreTokens || token == "0" => {
            cursor.positions.shown_to(&cursor.request.confinement, token)
        }
        Some(rank) => Ok(seq::show_ranked(rank, token)),
        None => Ok(seq::show(token)),
    }
}

/// One row of a database's feed, written as JSON straight from this (members in CouchDB's
/// order: `seq`, `id`, `changes`, then `deleted` and `doc` when there): building each row as a
/// `serde_json::Value` and then writing that was a fifth of a `_changes` page (issue 38).
#[derive(Debug, Serialize)]
struct ChangeRow {
    seq: String,
    id: String,
    changes: Vec<ChangedRev>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    deleted: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    doc: Option<Value>,
}

/// One revision a row names (`{"rev": …}`).
#[derive(Debug, Serialize)]
struct ChangedRev {
    rev: String,
}

/// A row as an answer writes it: its JSON text, and its `seq` as JSON (an eventsource line's
/// `id`).
struct WrittenRow {
    text: String,
    seq: String,
}

/// The rows of a page as the request writes them (`_db_updates`' rows as database events, except
/// in eventsource form).
fn written_rows(rows: Vec<ChangeRow>, request: &ChangesRequest) -> crate::Result<Vec<WrittenRow>> {
    let unwritable = |err: serde_json::Error| crate::Error::new(ErrorKind::Internal, format!("a feed row: {err}"));
    if request.db_updates && !request.eventsource {
        let events = db_update_rows(rows);
        return Ok(events
            .into_iter()
            .map(|event| WrittenRow {
                seq: event.get("seq").map(Value::to_string).unwrap_or_default(),
                text: event.to_string(),
            })
            .collect());
    }
    rows.into_iter()
        .map(|row| {
            let seq =
                if request.eventsource { serde_json::to_string(&row.seq).map_err(unwritable)? } else { String::new() };
            Ok(WrittenRow { text: serde_json::to_string(&row).map_err(unwritable)?, seq })
        })
        .collect()
}

/// The rows of one page that the request may see and wants.
async fn rows_of(cursor: &Cursor, changes: &[Change]) -> crate::Result<Vec<ChangeRow>> {
    let database = &cursor.database;
    let shown = match cursor.form {
        SeqForm::Ranked => seq::shown_all(cursor.ranks.as_ref(), changes.iter().map(|c| c.seq.as_str())),
        SeqForm::StoreTokens => {
            // Only the login's own changes are sealed (a seal costs a random salt and a key).
            let confinement = &cursor.request.confinement;
            let own: Vec<Change> = changes.iter().filter(|c| confinement.admits_id(&c.id)).cloned().collect();
            let shown = own
                .iter()
                .map(|c| cursor.positions.shown_to(confinement, &c.seq))
                .collect::<crate::Result<Vec<_>>>()?;
            return database_rows(database, &cursor.request, &own, &shown).await;
        }
    };
    database_rows(database, &cursor.request, changes, &shown).await
}

/// `descending=true` on a database: the whole feed read (each document once, at its latest
/// change), newest first, cut to `limit`; `last_seq` is the oldest row's, and `pending` how many
/// older changes were left out (CouchDB 3.4.3's answer). Where the backend counts its feed,
/// each change's `N` is its rank in the feed read.
async fn descending_answer(
    database: &Database,
    request: &ChangesRequest,
    max_changes: usize,
    form: SeqForm,
    positions: &PositionSeal,
) -> CouchResult<axum::response::Response> {
    if request.feed != Feed::Normal {
        return Err(CouchError::bad_request("descending=true is only supported with feed=normal"));
    }
    let backend = database.backend();
    let mut since: Option<String> = None;
    let mut changes: Vec<Change> = Vec::new();
    loop {
        let page = database.while_open(read_page(backend.as_ref(), since.as_deref(), DEFAULT_PAGE)).await?;
        changes.extend(page.changes);
        if changes.len() > max_changes {
            return Err(CouchError::bad_request(format!(
                "descending=true reads the whole feed, and this one holds more than {max_changes} changes \
                 (couchdb_max_descending_changes)"
            )));
        }
        since = Some(page.last_seq);
        if page.pending == 0 {
            break;
        }
    }
    // A document changed twice during the reads is listed at its later change only; a login
    // confined to its own ids neither sees nor counts the others.
    let mut seen = HashSet::new();
    let newest_first: Vec<Change> = changes
        .into_iter()
        .rev()
        .filter(|c| request.confinement.admits_id(&c.id) && seen.insert(c.id.clone()))
        .collect();
    // Ranked after the entries purges took out, as every other answer counts them.
    let erased_before = match form {
        SeqForm::Ranked => {
            database.while_open(seq::counted(backend.as_ref(), database.erased_doc())).await?.map(|(_, erased)| erased)
        }
        SeqForm::StoreTokens => None,
    };
    let show_at = |rank: u64, token: &str| match (form, erased_before) {
        (SeqForm::StoreTokens, _) => positions.shown_to(&request.confinement, token),
        (SeqForm::Ranked, Some(erased)) => Ok(seq::show_ranked(rank + erased, token)),
        (SeqForm::Ranked, None) => Ok(seq::show(token)),
    };
    let shown: Vec<String> = newest_first
        .iter()
        .zip((1..=newest_first.len() as u64).rev())
        .map(|(change, rank)| show_at(rank, &change.seq))
        .collect::<crate::Result<_>>()?;
    let (rows, last_change) = limited_rows(database, request, &newest_first, &shown).await?;
    let (last_seq, pending) = match last_change {
        Some(index) => (shown[index].clone(), (newest_first.len() - index - 1) as u64),
        None => {
            let end = since.unwrap_or_else(|| "0".into());
            (show_at(newest_first.len() as u64, &end)?, 0)
        }
    };
    if request.db_updates {
        return Ok(super::json(StatusCode::OK, json!({ "results": db_update_rows(rows), "last_seq": last_seq })));
    }
    Ok(super::json(StatusCode::OK, json!({ "results": rows, "last_seq": last_seq, "pending": pending })))
}

/// The rows of `changes` (newest first; `shown`, their `seq`s as shown) up to `limit`, counted
/// after the filter as CouchDB counts them (`filter=_design&limit=2` is the two newest
/// design-document changes, however many other changes are newer), read a page at a time; and
/// the index of the last change looked at.
async fn limited_rows(
    database: &Database,
    request: &ChangesRequest,
    changes: &[Change],
    shown: &[String],
) -> crate::Result<(Vec<ChangeRow>, Option<usize>)> {
    let limit = request.limit.map_or(usize::MAX, |limit| usize::try_from(limit).unwrap_or(usize::MAX));
    let mut rows = Vec::new();
    let mut last_change = if limit == 0 { None } else { changes.len().checked_sub(1) };
    for (number, (page, page_seqs)) in changes.chunks(DEFAULT_PAGE).zip(shown.chunks(DEFAULT_PAGE)).enumerate() {
        if rows.len() >= limit {
            break;
        }
        let page_rows = database_rows(database, request, page, page_seqs).await?;
        let wanted = limit - rows.len();
        if page_rows.len() >= wanted {
            rows.extend(page_rows.into_iter().take(wanted));
            // The last row's change: its `seq` is the one the row shows.
            let last_shown = rows.last().map(|row| row.id.as_str());
            last_change =
                page.iter().position(|c| Some(c.id.as_str()) == last_shown).map(|at| number * DEFAULT_PAGE + at);
            break;
        }
        rows.extend(page_rows);
    }
    Ok((rows, last_change))
}

/// The rows of one page of a database's feed: each document's winning revision (every leaf
/// with `style=all_docs`), from its revision tree as it is now. Attachments shown inline hold
/// their shares of the inline budget while the page is built (or, within the request's
/// handler, until its answer is sent).
/// `shown` holds each change's `seq` as the rows show it.
async fn database_rows(
    database: &Database,
    request: &ChangesRequest,
    changes: &[Change],
    shown: &[String],
) -> crate::Result<Vec<ChangeRow>> {
    if request.db_updates {
        return Ok(event_rows(changes, shown));
    }
    let (rows, _shares) = super::db::with_own_shares(page_rows(database, request, changes, shown)).await;
    rows
}

/// `_global_changes`' rows for `_db_updates`, made from the feed's entries without reading the
/// event documents (all a row needs is the id and position). Event documents are never deleted;
/// a deletion there is no event.
fn event_rows(changes: &[Change], shown: &[String]) -> Vec<ChangeRow> {
    changes
        .iter()
        .zip(shown)
        .filter(|(change, _)| !change.deleted)
        .map(|(change, seq)| ChangeRow {
            seq: seq.clone(),
            id: change.id.clone(),
            changes: vec![ChangedRev { rev: change.rev.as_str().to_owned() }],
            deleted: false,
            doc: None,
        })
        .collect()
}

async fn page_rows(
    database: &Database,
    request: &ChangesRequest,
    changes: &[Change],
    shown: &[String],
) -> crate::Result<Vec<ChangeRow>> {
    database.check_open()?;
    let (wanted, wanted_seqs): (Vec<&Change>, Vec<&String>) = changes
        .iter()
        .zip(shown)
        .filter(|(c, _)| request.confinement.admits_id(&c.id))
        .filter(|(c, _)| match &request.filter {
            Filter::DocIds(ids) => ids.contains(&c.id),
            Filter::Design => c.id.starts_with("_design/"),
            _ => true,
        })
        .unzip();
    let ids: Vec<String> = wanted.iter().map(|c| c.id.clone()).collect();
    // A row that shows neither the document nor passes it to a filter names revisions only: the
    // trees are read without their bodies (decoding every body was a third of a page, issue 38).
    let revisions_only =
        !request.include_docs && matches!(request.filter, Filter::All | Filter::DocIds(_) | Filter::Design);
    let states = match revisions_only {
        true => database.read_many_outlines(&ids).await?,
        false => database.read_many(&ids).await?,
    };
    let passed = match &request.filter {
        Filter::JavaScript(filter) => Some(filter_page(filter, &wanted, &states, request.conflicts).await?),
        _ => None,
    };
    let mut rows = Vec::with_capacity(wanted.len());
    for (index, ((change, state), shown_seq)) in wanted.into_iter().zip(states).zip(wanted_seqs).enumerate() {
        if passed.as_ref().is_some_and(|passed| !passed.get(index).copied().unwrap_or(false)) {
            continue;
        }
        // Purged since the feed read: nothing left to report.
        let Some(state) = state else { continue };
        let Some(winner) = state.tree.winner() else { continue };
        // The document is shown only for `include_docs` or a selector: a plain row names its
        // revisions, and building the body it does not show was most of a row's cost.
        let doc = match request.include_docs || matches!(request.filter, Filter::Selector(_)) {
            true => {
                let options = super::db::DocOptions { conflicts: request.conflicts, ..Default::default() };
                let mut doc = super::db::leaf_json(&change.id, &state.tree, winner, options);
                if let (true, Some(inline)) = (request.include_docs, &request.inline) {
                    super::db::inline_into(database, winner, &mut doc, inline).await.map_err(CouchError::carried)?;
                }
                Some(doc)
            }
            false => None,
        };
        if let (Filter::Selector(matches), Some(doc)) = (&request.filter, &doc) {
            if !matches(doc) {
                continue;
            }
        }
        let changes = if request.all_leaves {
            state.tree.leaves().into_iter().map(|leaf| ChangedRev { rev: leaf.path.leaf_rev() }).collect()
        } else {
            vec![ChangedRev { rev: winner.path.leaf_rev() }]
        };
        rows.push(ChangeRow {
            seq: shown_seq.clone(),
            id: change.id.clone(),
            changes,
            deleted: winner.deleted,
            doc: doc.filter(|_| request.include_docs),
        });
    }
    Ok(rows)
}

/// Which changes of a page pass a design document's filter: each document as the function sees
/// it (the winner, `_deleted` when deleted, `_conflicts` when the feed asks for them, as CouchDB
/// opens the documents for it: `couch_changes:open_revs`), one engine call for the page.
async fn filter_page(
    filter: &JsFilter,
    changes: &[&Change],
    states: &[Option<crate::database::DocState>],
    conflicts: bool,
) -> crate::Result<Vec<bool>> {
    let mut docs = Vec::with_capacity(changes.len());
    let mut at = Vec::with_capacity(changes.len());
    for (index, (change, state)) in changes.iter().zip(states).enumerate() {
        let Some(winner) = state.as_ref().and_then(|state| state.tree.winner().map(|winner| (state, winner))) else {
            continue;
        };
        let (state, winner) = winner;
        let options = super::db::DocOptions { conflicts, ..Default::default() };
        docs.push(Arc::new(super::db::leaf_json(&change.id, &state.tree, winner, options)));
        at.push(index);
    }
    let mut passed = vec![false; changes.len()];
    if docs.is_empty() {
        return Ok(passed);
    }
    for (index, ok) in at.into_iter().zip(filter.passes(docs).await?) {
        passed[index] = ok;
    }
    Ok(passed)
}

/// The most feed entries read past a per-user login's `last_seq` to count its own changes left
/// (`pending`): past them, the count so far, and at least 1, since more is left.
pub const CONFINED_PENDING_READ_LIMIT: usize = 10 * DEFAULT_PAGE;

/// How many changes after `since` are of ids `confinement` admits, read a page at a time up to
/// [`CONFINED_PENDING_READ_LIMIT`] entries.
async fn confined_pending(
    backend: &dyn DocumentBackend,
    since: Option<&str>,
    confinement: &Confinement,
) -> crate::Result<u64> {
    let mut since = since.map(str::to_owned);
    let (mut read, mut own) = (0usize, 0u64);
    loop {
        let page = read_page(backend, since.as_deref(), DEFAULT_PAGE).await?;
        read += page.changes.len();
        own += page.changes.iter().filter(|c| confinement.admits_id(&c.id)).count() as u64;
        if page.pending == 0 || page.changes.is_empty() {
            return Ok(own);
        }
        if read >= CONFINED_PENDING_READ_LIMIT {
            return Ok(own.max(1));
        }
        since = Some(page.last_seq);
    }
}

/// `GET /_db_updates` over `_global_changes` (`db`): its feed, read as every database's, with
/// the rows shown as database events ([`db_update_rows`]) and closed without `pending`, as
/// CouchDB 3.4.3's `global_changes_httpd` answers. `params` are the ones `_db_updates` takes,
/// already checked (`super::db_updates`). Long-lived feeds count against the asker's feeds, as
/// `_changes` ones do.
pub(crate) async fn db_updates_feed(
    state: &CouchState,
    db: Arc<Database>,
    asker: FeedAsker,
    params: &HashMap<String, String>,
) -> Answer {
    let mut request = parse_request(params, None, &state.feeds)?;
    request.db_updates = true;
    respond(state, asker.owner(), request, db, SeqForm::Ranked).await
}

/// `_global_changes`' rows as `_db_updates` shows them: a row of the document `{type}:{name}` is
/// `{"db_name": name, "type": type, "seq": …}`; a document named otherwise is no event and is
/// left out (CouchDB's `default_transform_change` skips it too).
fn db_update_rows(rows: Vec<ChangeRow>) -> Vec<Value> {
    rows.into_iter()
        .filter_map(|row| {
            let (event, name) = row.id.split_once(':')?;
            Some(json!({ "db_name": name, "type": event, "seq": row.seq }))
        })
        .collect()
}

/// The end of a `_db_updates` answer: `last_seq` alone (no `pending`); nothing for eventsource.
fn db_updates_closing(request: &ChangesRequest, last_seq: &str) -> String {
    match request.feed {
        Feed::Continuous if request.eventsource => String::new(),
        Feed::Continuous => format!("{}\n", json!({ "last_seq": last_seq })),
        _ => format!("\n],\n\"last_seq\":{}}}\n", Value::from(last_seq)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn parse(pairs: &[(&str, &str)]) -> CouchResult<ChangesRequest> {
        parse_request(&params(pairs), None, &FeedBounds::for_tests())
    }

    #[test]
    fn parameters_are_checked_and_name_the_problem() {
        assert!(parse(&[("feed", "websocket")]).err().unwrap().reason.contains("feed"));
        let events = parse(&[("feed", "eventsource")]).unwrap();
        assert!(events.eventsource && events.feed == Feed::Continuous);
        assert!(parse(&[("descending", "true")]).unwrap().descending);
        assert!(matches!(parse(&[("filter", "app/by_user")]).unwrap().filter, Filter::Named { view: false, .. }));
        assert!(matches!(
            parse(&[("filter", "_view"), ("view", "app/v")]).unwrap().filter,
            Filter::Named { view: true, .. }
        ));
        assert!(parse(&[("filter", "_view")]).is_err());
        assert!(parse(&[("filter", "nonsense")]).is_err());
        let ids = parse(&[("filter", "_doc_ids"), ("doc_ids", "[\"a\"]")]).unwrap();
        assert!(matches!(ids.filter, Filter::DocIds(ref set) if set.contains("a")));
        let continuous = parse(&[("feed", "continuous"), ("heartbeat", "5000")]).unwrap();
        assert_eq!((continuous.feed, continuous.heartbeat), (Feed::Continuous, Some(Duration::from_millis(5000))));
        for bad in [("timeout", "-1"), ("timeout", "soon"), ("heartbeat", "1.5"), ("limit", "x"), ("limit", "-")] {
            assert_eq!(parse(&[bad]).err().map(|e| e.status), Some(StatusCode::BAD_REQUEST), "{bad:?}");
        }
    }

    /// CouchDB clamps `timeout` and `heartbeat` to its `changes_timeout` (60 s by default;
    /// `couch_changes:get_changes_timeout`); a heartbeat below the minimum is raised to it.
    #[test]
    fn client_chosen_waits_are_clamped() {
        let huge = u64::MAX.to_string();
        let twenty_digits = "99999999999999999999";
        for timeout in [huge.as_str(), twenty_digits, "600000"] {
            assert_eq!(parse(&[("feed", "longpoll"), ("timeout", timeout)]).unwrap().timeout, Duration::from_secs(60));
        }
        assert_eq!(parse(&[("timeout", "1500")]).unwrap().timeout, Duration::from_millis(1500));
        assert_eq!(parse(&[]).unwrap().timeout, Duration::from_secs(60), "the default is the bound");
        let beat = |ms: &str| parse(&[("feed", "continuous"), ("heartbeat", ms)]).unwrap().heartbeat;
        assert_eq!(beat("1"), Some(Duration::from_secs(1)));
        assert_eq!(beat("0"), Some(Duration::from_secs(1)));
        assert_eq!(beat(&huge), Some(Duration::from_secs(60)));
        assert_eq!(beat("true"), Some(Duration::from_secs(60)));
        assert_eq!(beat("false"), None);
    }

    /// CouchDB 3.4.3 answers `limit=-1` with 200 and every row: its feed stops only when the
    /// count it decrements reaches 0 (`fabric_view_changes` collector, `limit = 0` clauses).
    #[test]
    fn a_negative_limit_is_no_limit() {
        assert_eq!(parse(&[("limit", "-1")]).unwrap().limit, None);
        assert_eq!(parse(&[("limit", "-25")]).unwrap().limit, None);
        assert_eq!(parse(&[("limit", "3")]).unwrap().limit, Some(3));
    }

    #[test]
    fn feeds_per_login_are_counted_and_given_back() {
        let bounds = FeedBounds::for_tests();
        let first = bounds.take_slot("login:a".into()).unwrap();
        let _second = bounds.take_slot("login:a".into()).unwrap();
        let refused = bounds.take_slot("login:a".into()).err().unwrap();
        assert_eq!((refused.status, refused.error.as_str()), (StatusCode::TOO_MANY_REQUESTS, "too_many_requests"));
        assert!(refused.reason.contains("couchdb_max_feeds_per_login"), "{}", refused.reason);
        let _other = bounds.take_slot("login:b".into()).unwrap();
        drop(first);
        let _again = bounds.take_slot("login:a".into()).unwrap();
    }
}
