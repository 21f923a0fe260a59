//! `GET/POST /{db}/_all_docs` and `GET /{db}/_design_docs` of a database: documents whose winning
//! revision is live, in id order (raw collation), or the documents `keys` names (deleted ones
//! as `value.deleted`). Parameters are read as for the data-store database
//! ([`crate::couchdb_api::all_docs`]); rows are streamed one backend page at a time. Also
//! `GET/POST /{db}/_local_docs`: the clients' local documents, answered as the data-store
//! database's are ([`crate::couchdb_api::local_docs`]); the engine's own locals (revision trees
//! of deleted documents, settings) are never listed.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use futures::stream::StreamExt;
use serde_json::{json, Value};

use super::attachments::{inline_into, inline_wanted, Inline};
use super::info::live_document_count;
use super::{leaf_json, DocOptions, OpenDb};
use crate::backend::IdRange;
use crate::couchdb_api::error::CouchError;
use crate::couchdb_api::listing::{
    keys_page, paged_rows, parse_request, post_fields, query_fields, streamed_listing, AllDocsRequest, PageSizer,
};
use crate::couchdb_api::local_docs::ListingRequest;
use crate::couchdb_api::{json, Answer, CouchState};
use crate::database::data_store_rules::Confinement;
use crate::database::layout::{write_json_string, AnswerableWinner, LayoutToken, Served};
use crate::database::{Database, DocState};

/// `GET /{db}/_all_docs`.
pub async fn get_all_docs(
    State(state): State<CouchState>,
    opened: OpenDb,
    Query(params): Query<HashMap<String, String>>,
) -> Answer {
    let request = parse_request(&query_fields(&params)?)?;
    let inline = inline_wanted(&params)?;
    answer(&state, opened, request, inline, Listing::AllDocs).await
}

/// `POST /{db}/_all_docs`.
pub async fn post_all_docs(
    State(state): State<CouchState>,
    opened: OpenDb,
    Query(params): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> Answer {
    let fields = post_fields(&state, &params, &headers, body).await?;
    let request = parse_request(&fields)?;
    // `attachments`, `atts_since` and `att_encoding_info` may come in the body too, as CouchDB
    // reads them (the Cloudant SDK, and so couchbackup's shallow mode, sends them there).
    let inline_params: HashMap<String, String> = ["attachments", "atts_since", "att_encoding_info"]
        .into_iter()
        .filter_map(|name| {
            fields.get(name).map(|value| {
                let text = value.as_str().map(str::to_owned).unwrap_or_else(|| value.to_string());
                (name.to_owned(), text)
            })
        })
        .collect();
    let inline = inline_wanted(&inline_params)?;
    answer(&state, opened, request, inline, Listing::AllDocs).await
}

/// `GET/POST /{db}/_local_docs`.
pub async fn local_docs(opened: OpenDb, ListingRequest(request): ListingRequest) -> Answer {
    local_docs_answer(opened.db, &opened.confinement, request).await
}

/// The local documents the login may see: a per-user login's own, stored under `{user}:`
/// ([`Confinement::local_name`]) and shown under the names it gave them.
async fn local_docs_answer(db: Arc<Database>, confinement: &Confinement, request: AllDocsRequest) -> Answer {
    let prefix = confinement.local_name("");
    let listing = (Arc::clone(&db), prefix.clone());
    let fetch = move |names: IdRange, want: usize, token: Option<String>| {
        let (db, prefix) = listing.clone();
        async move {
            let page = db.local_docs(&names.under_prefix(&prefix), want, token.as_deref()).await?;
            Ok(crate::backend::shown_without_prefix(page, &prefix))
        }
    };
    let get = move |name: String| {
        let (db, prefix) = (Arc::clone(&db), prefix.clone());
        async move {
            let stored = db.get_local(&format!("{prefix}{name}")).await?;
            Ok(stored.map(|doc| crate::backend::StoredDocument { id: format!("_local/{name}"), ..doc }))
        }
    };
    crate::couchdb_api::local_docs::answer(request, fetch, get).await
}

/// `GET /{db}/_design_docs`: `_all_docs` over the design documents' ids.
pub async fn get_design_docs(
    State(state): State<CouchState>,
    opened: OpenDb,
    Query(params): Query<HashMap<String, String>>,
) -> Answer {
    let mut request = parse_request(&query_fields(&params)?)?;
    let (low, high) = ("_design/".to_owned(), "_design0".to_owned());
    let range = &mut request.range;
    if range.descending {
        range.start = Some(range.start.take().map_or(high.clone(), |s| s.min(high.clone())));
        range.end = Some(range.end.take().map_or(low.clone(), |e| e.max(low.clone())));
    } else {
        range.start = Some(range.start.take().map_or(low.clone(), |s| s.max(low.clone())));
        if range.end.as_ref().is_none_or(|e| *e >= high) {
            range.end = Some(high);
            range.inclusive_end = false;
        }
    }
    answer(&state, opened, request, None, Listing::DesignDocs).await
}

/// Which listing a request is: `_all_docs`, or `_design_docs` (CouchDB 3.4.3's `design`
/// namespace: `couch_mrview:get_total_rows` counts the design documents alone, and
/// `fabric_view_all_docs:filter_keys_by_namespace` drops `keys` that are not design ids).
#[derive(Clone, Copy, PartialEq)]
enum Listing {
    AllDocs,
    DesignDocs,
}

/// Design documents read per page when they are counted.
const DESIGN_COUNT_PAGE: usize = 1000;

/// `total_rows` of a listing: the database's live documents, or its live design documents
/// (counted a page at a time: databases hold few of them).
async fn total_rows(db: &Database, listing: Listing) -> crate::Result<u64> {
    if listing == Listing::AllDocs {
        return db.while_open(live_document_count(db.backend().as_ref())).await;
    }
    let range = IdRange::design_documents();
    let (mut count, mut token) = (0u64, None::<String>);
    loop {
        let page = db.all_docs(&range, DESIGN_COUNT_PAGE, token.as_deref()).await?;
        count += page.items.len() as u64;
        match page.next {
            Some(next) => token = Some(next),
            None => return Ok(count),
        }
    }
}

/// The row of a live document; `doc` is its document already shown with attachments inline
/// (`include_docs=true&attachments=true`), else it is shown here with stubs.
fn row(id: &str, state: &DocState, request: &AllDocsRequest, doc: Option<&Value>) -> Option<Value> {
    let winner = state.tree.winner()?;
    let mut row = json!({ "id": id, "key": id, "value": { "rev": winner.path.leaf_rev() } });
    if request.include_docs {
        row["doc"] = match doc {
            Some(doc) => doc.clone(),
            None => shown_doc(id, state, request)?,
        };
    }
    Some(row)
}

/// The winner of a live document as a row shows it.
fn shown_doc(id: &str, state: &DocState, request: &AllDocsRequest) -> Option<Value> {
    let winner = state.tree.winner()?;
    let options = DocOptions { conflicts: request.conflicts, ..DocOptions::default() };
    Some(leaf_json(id, &state.tree, winner, options))
}

/// The winner shown with its attachments' bytes, when the request asks for them.
async fn inlined_doc(
    db: &Database,
    id: &str,
    state: &DocState,
    request: &AllDocsRequest,
    inline: Option<&Inline>,
) -> crate::couchdb_api::error::CouchResult<Option<Value>> {
    let (Some(inline), true) = (inline, request.include_docs) else { return Ok(None) };
    let (Some(winner), Some(mut doc)) = (state.tree.winner(), shown_doc(id, state, request)) else { return Ok(None) };
    inline_into(db, winner, &mut doc, inline).await?;
    Ok(Some(doc))
}

async fn answer(
    state: &CouchState,
    opened: OpenDb,
    mut request: AllDocsRequest,
    inline: Option<Inline>,
    listing: Listing,
) -> Answer {
    let OpenDb { db, confinement, .. } = opened;
    let confinement = &confinement;
    // Design documents are documents of a database, listed as CouchDB lists them; but not in
    // the data-store database's `_all_docs` where its backend runs them itself (the CouchDB
    // backend: its own index's design document is the backend's, and the data-store listings
    // never showed them). Its `_design_docs` lists them all, as that backend lists them.
    let runs_own_designs = state.is_data_store(&db) && db.backend().forwards_requests();
    request.range.include_design = listing == Listing::DesignDocs || !runs_own_designs;
    // A per-user login is shown 0: the database's count moves with every user's writes
    // (docs/couchdb-api.md, "Counts").
    let total_rows = match confinement.only_user() {
        Some(_) => 0,
        None => total_rows(&db, listing).await?,
    };
    if let Some(keys) = &request.keys {
        let mut keys = keys_page(keys, &request);
        if listing == Listing::DesignDocs {
            keys.retain(|key| key.starts_with("_design/"));
        }
        // Another user's documents are not found, as if they did not exist.
        let visible: Vec<String> = keys.iter().filter(|key| confinement.admits_id(key)).cloned().collect();
        let mut states = db.read_many(&visible).await?.into_iter();
        let states: Vec<Option<DocState>> =
            keys.iter().map(|key| if confinement.admits_id(key) { states.next().flatten() } else { None }).collect();
        let mut rows = Vec::with_capacity(keys.len());
        for (key, state) in keys.iter().zip(states) {
            rows.push(match state {
                Some(state) if !state.deleted() => {
                    let doc = inlined_doc(&db, key, &state, &request, inline.as_ref()).await?;
                    row(key, &state, &request, doc.as_ref()).unwrap_or(Value::Null)
                }
                Some(state) => {
                    let mut row =
                        json!({ "id": key, "key": key, "value": { "rev": state.winner_rev(), "deleted": true } });
                    if request.include_docs {
                        row["doc"] = Value::Null;
                    }
                    row
                }
                None => json!({ "key": key, "error": "not_found" }),
            });
        }
        let mut body = json!({ "total_rows": total_rows, "offset": null, "rows": rows });
        if request.update_seq {
            body["update_seq"] = Value::Null;
        }
        return Ok(json(StatusCode::OK, body));
    }
    let update_seq = if request.update_seq { Some(update_seq(state, &db, confinement).await?) } else { None };
    let from_the_beginning = match listing {
        Listing::AllDocs => {
            request.range.start.as_deref().is_none_or(|start| start.is_empty() && !request.range.descending)
        }
        // The range starts at the design documents' own first (or last) id unless the client
        // started it further in: CouchDB's offset is counted within them.
        Listing::DesignDocs => {
            let first = if request.range.descending { "_design0" } else { "_design/" };
            request.range.start.as_deref() == Some(first)
        }
    };
    let offset =
        if from_the_beginning && confinement.only_user().is_none() { Value::from(request.skip) } else { Value::Null };
    request.range = confinement.clip(request.range);
    let mut head = format!("{{\"total_rows\":{total_rows},\"offset\":{offset},");
    if let Some(seq) = update_seq {
        head.push_str(&format!("\"update_seq\":{},", Value::from(seq)));
    }
    head.push_str("\"rows\":[");
    let range = request.range.clone();
    let mut rows = Box::pin(range_rows(db, range, request, inline));
    let first = rows.next().await.transpose()?;
    Ok(streamed_listing(head, first, rows))
}

/// `update_seq` of a listing. The data-store database's feed shows the store's own positions
/// (`super::super::changes`): a listing's are that feed's, sealed for a per-user login as that
/// feed seals them, so a listing's `update_seq` is a `since` it takes.
async fn update_seq(state: &CouchState, db: &Database, confinement: &Confinement) -> crate::Result<String> {
    if !state.is_data_store(db) {
        return db.while_open(crate::database::seq::current(db.backend().as_ref(), db.erased_doc())).await;
    }
    let principal = match confinement.only_user() {
        Some(user) => crate::couchdb_api::Principal::User(user.to_owned()),
        None => crate::couchdb_api::Principal::Admin,
    };
    state.auth.sessions.positions().shown(&principal, &db.backend().change_position().await?)
}

/// A document of a range (its state, or the text of a data-store record served as stored) with
/// its document shown inline, if asked, and (on a page's first) the page's shares of the inline
/// budget.
type RangeItem = (String, Served<LayoutToken>, Option<Value>, Option<super::inline::PartShares>);

/// The rows of a range, one backend page at a time ([`paged_rows`]).
fn range_rows(
    db: Arc<Database>,
    range: IdRange,
    request: AllDocsRequest,
    inline: Option<Inline>,
) -> impl futures::Stream<Item = crate::Result<Bytes>> {
    let (skip, limit) = (request.skip, request.limit);
    let sizer = PageSizer::for_listing_of(request.include_docs, db.listed_row_bytes());
    // Documents shown as stored where nothing in them changes: with no option on the shown
    // document and no attachment inline (issue 38: `Database::all_docs_served`).
    let as_stored = request.include_docs && !request.conflicts && inline.is_none();
    let request = Arc::new(request);
    let inline = Arc::new(inline);
    let fetching = Arc::clone(&request);
    let fetch = move |want: usize, token: Option<String>| {
        let db = Arc::clone(&db);
        let range = range.clone();
        let (request, inline) = (Arc::clone(&fetching), Arc::clone(&inline));
        async move {
            if as_stored {
                if let Some(page) = db.all_docs_served(&range, want, token.as_deref()).await? {
                    let items = page.items.into_iter().map(|(id, served)| (id, served, None, None)).collect();
                    return Ok(crate::backend::Page { items, next: page.next });
                }
            }
            let page = match request.conflicts && request.include_docs {
                true => db.all_docs_whole(&range, want, token.as_deref()).await?,
                false => db.all_docs(&range, want, token.as_deref()).await?,
            };
            // Attachments inline are read here, a page at a time: rendering is not async. The
            // page's shares of the inline budget are held with its first item until it is
            // rendered (a page may be built after the request's handler returned).
            let (items, shares) = super::inline::with_own_shares(async {
                let mut items = Vec::with_capacity(page.items.len());
                for (id, state) in page.items {
                    let doc = inlined_doc(&db, &id, &state, &request, inline.as_ref().as_ref())
                        .await
                        .map_err(CouchError::carried)?;
                    items.push((id, Served::State(state), doc, None));
                }
                Ok::<_, crate::Error>(items)
            })
            .await;
            let mut items = items?;
            if let Some(first) = items.first_mut() {
                first.3 = Some(shares);
            }
            Ok(crate::backend::Page { items, next: page.next })
        }
    };
    let render = move |(id, served, doc, _shares): &RangeItem| match served {
        Served::Alone(winner) => Ok(Some(stored_row(id, winner))),
        Served::State(state) => Ok(row(id, state, &request, doc.as_ref()).map(|row| row.to_string())),
    };
    paged_rows(fetch, render, skip, limit, sizer)
}

/// The row of a live document with its document, written from its record's text: what [`row`]
/// writes for it (`id`, `key`, `value` with the revision, then `doc`), without parsing the body.
fn stored_row(id: &str, winner: &AnswerableWinner) -> String {
    let mut text = String::with_capacity(winner.json.len() + 3 * id.len() + 96);
    let quoted_id = serde_json::to_string(id).unwrap_or_default();
    text.push_str("{\"id\":");
    text.push_str(&quoted_id);
    text.push_str(",\"key\":");
    text.push_str(&quoted_id);
    text.push_str(",\"value\":{\"rev\":");
    write_json_string(winner.rev.as_str(), &mut text);
    text.push_str("},\"doc\":");
    winner.write_document(id, &mut text);
    text.push('}');
    text
}
