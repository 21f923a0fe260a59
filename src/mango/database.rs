//! Mango on the databases other than the data-store one ([`crate::database::Database`], with
//! revision trees), as CouchDB 3.4.3 does it: a JSON index IS a design document with
//! `language: "query"`, one view per index (`map: {fields: {field: dir, …},
//! partial_filter_selector}`, `reduce: "_count"`, `options.def`), so it replicates and lists as
//! CouchDB's do, and it is built as a view group ([`crate::views`], mapped in Rust by
//! [`super::index_map`]) incrementally from the change feed.
//!
//! - [`DatabaseIndexes::load`]: the database's catalog, read from its query design documents
//!   (no built-in index here).
//! - [`create_index`] / [`delete_index`] / [`bulk_delete`]: `POST /{db}/_index`,
//!   `DELETE /{db}/_index/{ddoc}/json/{name}` and `POST /{db}/_index/_bulk_delete`, edits of
//!   those design documents.
//! - [`find`]: the engine of [`super::find`] over this database: a chosen JSON index is read over
//!   its key range ([`index_source`]), otherwise `_all_docs` ([`AllDocsSource`]).
//!   [`find_remembering`] (the route's) is the same with the catalog remembered between queries
//!   and confirmed by each query's own index catch-up ([`catalog_watch`]), so a `_find` does not
//!   list the design documents again while none changed.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use http::StatusCode;
use serde_json::{json, Map, Value};

use super::catalog_watch;
use super::find::{find_in, Candidate, CandidatePage, FindLimits, FindSource, FindSources, SCAN_PAGE};
use super::index::{design_id, parse_index_request, IndexCatalog, IndexDef};
use super::index_map::JsonIndexMap;
use super::index_source::{self, RowDocs};
use super::request::FindRequest;
use super::{erlang_term, MangoError};
use crate::backend::IdRange;
use crate::database::data_store_rules::Confinement;
use crate::database::document::{leaf_json, DocOptions};
use crate::database::{Database, DocState, Write, Written};
use crate::error::ErrorKind;
use crate::views::design::DesignViews;
use crate::views::service::Views;

/// Design documents read per page while listing a database's indexes.
const DESIGN_PAGE: usize = 100;

/// A database's JSON indexes and the design documents that define them.
pub struct DatabaseIndexes {
    pub catalog: IndexCatalog,
    designs: HashMap<String, DesignViews>,
}

impl DatabaseIndexes {
    /// Reads every query design document of `db` (CouchDB's `mango_idx:list`): each of its views
    /// that is a valid index definition is an index; others are left out, as CouchDB leaves
    /// them out.
    pub async fn load(db: &Database) -> Result<DatabaseIndexes, MangoError> {
        let mut indexes = Vec::new();
        let mut designs = HashMap::new();
        let range = IdRange::design_documents();
        let mut token: Option<String> = None;
        loop {
            let page = db.all_docs(&range, DESIGN_PAGE, token.as_deref()).await?;
            for (id, state) in &page.items {
                let Some(doc) = winner_json(id, state, DocOptions::default()) else { continue };
                if doc.get("language").and_then(Value::as_str) != Some("query") {
                    continue;
                }
                let Ok(design) = DesignViews::parse(&Value::Object(doc)) else { continue };
                indexes.extend(design.views.iter().filter_map(|view| index_of(id, &view.name, &view.map)));
                designs.insert(id.clone(), design);
            }
            match page.next {
                Some(next) => token = Some(next),
                None => break,
            }
        }
        Ok(DatabaseIndexes { catalog: IndexCatalog::of_design_documents(indexes), designs })
    }
}

/// The index a query design document's view defines, if its `map` is a valid definition.
fn index_of(ddoc: &str, name: &str, map: &Value) -> Option<IndexDef> {
    JsonIndexMap::parse(map)?;
    let fields = match map.get("fields")? {
        Value::Object(fields) => fields
            .iter()
            .map(|(field, direction)| Some((field.clone(), direction.as_str()?.to_owned())))
            .collect::<Option<Vec<_>>>()?,
        _ => return None,
    };
    let partial_filter_selector = match map.get("partial_filter_selector") {
        Some(Value::Object(selector)) if !selector.is_empty() => Some(Value::Object(selector.clone())),
        _ => None,
    };
    Some(IndexDef { ddoc: ddoc.to_owned(), name: name.to_owned(), fields, partial_filter_selector })
}

/// The live winner of a document as JSON, `None` when it is deleted.
fn winner_json(id: &str, state: &DocState, options: DocOptions) -> Option<Map<String, Value>> {
    let winner = state.tree.winner().filter(|leaf| !leaf.deleted)?;
    match leaf_json(id, &state.tree, winner, options) {
        Value::Object(doc) => Some(doc),
        _ => None,
    }
}

/// The view an index is stored as (`mango_idx_view:make_view`): its map is the definition with
/// the fields as an object and the partial filter (`{}` when none), its reduce `_count`, and
/// `options.def` the `index` object of the request.
fn index_view(index: &IndexDef, requested: &Value) -> Result<Value, MangoError> {
    Ok(json!({ "map": index_map(index)?, "reduce": "_count", "options": { "def": requested } }))
}

/// An index's `map` as its view holds it: `{"fields": {field: direction, …},
/// "partial_filter_selector": {…}}` (normalized, `{}` when none), what
/// [`super::index_map`] maps documents with.
pub(super) fn index_map(index: &IndexDef) -> Result<Value, MangoError> {
    let fields: Map<String, Value> =
        index.fields.iter().map(|(field, direction)| (field.clone(), Value::String(direction.clone()))).collect();
    let partial = match &index.partial_filter_selector {
        Some(Value::Object(selector)) => super::selector::parse(selector)?.to_json(),
        _ => json!({}),
    };
    Ok(json!({ "fields": fields, "partial_filter_selector": partial }))
}

/// `POST /{db}/_index`: the index added to (or replaced in) its design document, created with
/// `language: "query"` when missing: `{"result": "created"|"exists", "id", "name"}`.
pub async fn create_index(db: &Database, request: &Value) -> Result<Value, MangoError> {
    let (index, _) = parse_index_request(request)?;
    let view = index_view(&index, &request["index"])?;
    let state = db.read(&index.ddoc).await?;
    let existing = state.as_ref().and_then(|state| winner_json(&index.ddoc, state, DocOptions::default()));
    let parent = existing.as_ref().and_then(|doc| doc.get("_rev")).and_then(Value::as_str).map(str::to_owned);
    let mut body = match existing {
        // A deleted (or never written) design document starts again as a query one.
        None => Map::from_iter([("language".to_owned(), json!("query"))]),
        Some(mut doc) => {
            doc.shift_remove("_id");
            doc.shift_remove("_rev");
            doc.shift_remove("_conflicts");
            match doc.get("language") {
                Some(Value::String(language)) if language == "query" => doc,
                other => {
                    let shown = match other {
                        Some(value) => format!("{{<<\"language\">>,{}}}", erlang_term(value)),
                        None => "false".into(),
                    };
                    return Err(MangoError::bad_request(
                        "invalid_ddoc_lang",
                        format!("Existing design doc has an invalid language: {shown}"),
                    ));
                }
            }
        }
    };
    let before = body.clone();
    let views = body.entry("views").or_insert_with(|| Value::Object(Map::new()));
    if !views.is_object() {
        *views = Value::Object(Map::new());
    }
    if let Value::Object(views) = views {
        views.insert(index.name.clone(), view);
    }
    let answer = |result: &str| json!({ "result": result, "id": index.ddoc, "name": index.name });
    if parent.is_some() && body == before {
        return Ok(answer("exists"));
    }
    save_design(db, &index.ddoc, parent, false, body).await?;
    Ok(answer("created"))
}

/// `DELETE /{db}/_index/{ddoc}/{type}/{name}`: the index's view removed from its design
/// document, and the design document deleted when nothing but `language` is left.
pub async fn delete_index(db: &Database, ddoc: &str, kind: &str, name: &str) -> Result<Value, MangoError> {
    let ddoc = design_id(ddoc);
    let indexes = DatabaseIndexes::load(db).await?;
    let known = kind == "json" && indexes.catalog.indexes.iter().any(|index| index.ddoc == ddoc && index.name == name);
    let missing = || MangoError::new(StatusCode::NOT_FOUND, "not_found", "missing");
    if !known {
        return Err(missing());
    }
    let state = db.read(&ddoc).await?.ok_or_else(missing)?;
    let mut doc = winner_json(&ddoc, &state, DocOptions::default()).ok_or_else(missing)?;
    let parent = doc.get("_rev").and_then(Value::as_str).map(str::to_owned);
    doc.shift_remove("_id");
    doc.shift_remove("_rev");
    let emptied = match doc.get_mut("views") {
        Some(Value::Object(views)) => {
            views.shift_remove(name);
            views.is_empty()
        }
        _ => return Err(missing()),
    };
    if emptied {
        doc.shift_remove("views");
    }
    let only_language = doc.len() == 1 && doc.get("language") == Some(&json!("query"));
    if only_language {
        save_design(db, &ddoc, parent, true, Map::new()).await?;
    } else {
        save_design(db, &ddoc, parent, false, doc).await?;
    }
    Ok(json!({ "ok": true }))
}

/// `POST /{db}/_index/_bulk_delete` (`{"docids": [...], "w"?}`): for each design document, its
/// index deleted when it holds exactly one (CouchDB's `mango_idx:delete` with a filter on the
/// design document), else `not_found`: `{"success": [{"id", "ok"}], "fail": [{"id", "error"}]}`,
/// each list in CouchDB's order (the last design document first).
pub async fn bulk_delete(db: &Database, request: &Value) -> Result<Value, MangoError> {
    let Value::Object(body) = request else {
        return Err(MangoError::bad_request("bad_request", "Request body must be a JSON object"));
    };
    let Some(ids) = body.get("docids") else {
        return Err(MangoError::bad_request("missing_required_key", "Missing required key: docids"));
    };
    let Value::Array(ids) = ids else {
        return Err(MangoError::bad_request(
            "invalid_bulk_docs",
            format!("Bulk Delete requires an array of non-null docids. Docids: {}", erlang_term(ids)),
        ));
    };
    let ids = ids
        .iter()
        .map(|id| {
            id.as_str().map(str::to_owned).ok_or_else(|| {
                MangoError::bad_request("invalid_index_name", format!("Invalid index name: {}", erlang_term(id)))
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(w) = body.get("w") {
        if w.as_u64().is_none_or(|w| w == 0) {
            return Err(MangoError::bad_request(
                "invalid_pos_integer",
                format!("{} is not an integer greater than zero", erlang_term(w)),
            ));
        }
    }
    if let Some(unknown) = body.keys().find(|key| *key != "docids" && *key != "w") {
        return Err(MangoError::bad_request("invalid_key", format!("Invalid key {unknown} for this request.")));
    }
    let (mut success, mut fail) = (Vec::new(), Vec::new());
    for id in ids {
        let ddoc = design_id(&id);
        let indexes = DatabaseIndexes::load(db).await?;
        let mut of_ddoc = indexes.catalog.indexes.iter().filter(|index| index.ddoc == ddoc);
        let outcome = match (of_ddoc.next(), of_ddoc.next()) {
            (Some(only), None) => delete_index(db, &ddoc, "json", &only.name.clone()).await.map(|_| ()),
            _ => Err(MangoError::new(StatusCode::NOT_FOUND, "not_found", "missing")),
        };
        match outcome {
            Ok(()) => success.push(json!({ "id": ddoc, "ok": true })),
            Err(err) => fail.push(json!({ "id": ddoc, "error": failed_row_error(err)? })),
        }
    }
    success.reverse();
    fail.reverse();
    Ok(json!({ "success": success, "fail": fail }))
}

/// The `error` of a design document `_bulk_delete` could not change: Mango's own error name
/// (`not_found`, `error_saving_ddoc`), as CouchDB's `mango_idx:delete` answers it. A failure of
/// the store (or of a view index, none of which a deletion reads) fails the whole request, as in
/// CouchDB 3.4.3, where a failed write is thrown out of `fabric` rather than made a row: it is
/// then answered with CouchDB's `error` and `reason` for it, as every route answers a storage
/// failure (the deletions before it stay done, as there).
fn failed_row_error(err: MangoError) -> Result<String, MangoError> {
    match err {
        MangoError::Refused(refusal) => Ok(refusal.error),
        below @ (MangoError::Storage(_) | MangoError::View(_)) => Err(below),
    }
}

/// Writes a design document edit; a conflict is CouchDB's `error_saving_ddoc`.
async fn save_design(
    db: &Database,
    id: &str,
    parent: Option<String>,
    deleted: bool,
    body: Map<String, Value>,
) -> Result<(), MangoError> {
    let written = db.write(id, &Write::Edit { parent, deleted, body }).await;
    // The next `_find` lists the catalog (it would find the change in the feed anyway).
    catalog_watch::forget(db);
    match written {
        Ok(Written::Edited(_) | Written::Merged(_)) => Ok(()),
        Err(err) if err.kind() == ErrorKind::Conflict => Err(MangoError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "error_saving_ddoc",
            "Encountered a conflict while saving the design document.",
        )),
        Err(err) => Err(err.into()),
    }
}

/// `POST /{db}/_find` over `db`, its indexes read from `views`.
pub async fn find(
    db: &Arc<Database>,
    views: &Views,
    indexes: &DatabaseIndexes,
    request: &Value,
) -> Result<Value, MangoError> {
    let sources = DatabaseSources::new(db, views, &indexes.designs, Check::Nothing);
    find_in(&sources, request, &Confinement::Everything, &indexes.catalog, FindLimits::default()).await
}

/// `POST /{db}/_find` over `db` with the index catalog remembered from an earlier query when the
/// query's own index catch-up confirms it ([`catalog_watch`]); otherwise the catalog is listed
/// again (after that catch-up) and the query runs on it, as [`find`] does.
pub async fn find_remembering(db: &Arc<Database>, views: &Views, request: &Value) -> Result<Value, MangoError> {
    let mut reached = None;
    if let Some(remembered) = catalog_watch::remembered(db) {
        let sources =
            DatabaseSources::new(db, views, &remembered.indexes.designs, Check::Required(remembered.generation));
        let answer =
            find_in(&sources, request, &Confinement::Everything, &remembered.indexes.catalog, FindLimits::default())
                .await;
        match sources.checked() {
            Checked::Confirmed => return answer,
            Checked::Unconfirmed { reached: caught_up } => reached = caught_up,
            Checked::NotOpened => {}
        }
    }
    let indexes = DatabaseIndexes::load(db).await?;
    let remembered = catalog_watch::remember(db, indexes, reached.as_deref());
    let sources = DatabaseSources::new(db, views, &remembered.indexes.designs, Check::Advance(remembered.generation));
    find_in(&sources, request, &Confinement::Everything, &remembered.indexes.catalog, FindLimits::default()).await
}

/// Whether a query's catalog is checked against the feed read of its index catch-up.
#[derive(Debug, Clone, Copy)]
enum Check {
    /// No: the catalog was listed for this query.
    Nothing,
    /// The remembered catalog of this generation must be confirmed, or the query is not run (its
    /// source is empty, and its answer thrown away).
    Required(u64),
    /// The catalog of this generation was listed for this query; a confirmation only lets later
    /// queries trust it.
    Advance(u64),
}

/// What the check of a query's catalog found.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Checked {
    /// No source was opened (the query failed or answered before choosing one).
    NotOpened,
    Confirmed,
    /// Not confirmed; `reached` is the checkpoint the query's catch-up brought its group to, if
    /// it made one (a catalog listed from now on is complete up to it).
    Unconfirmed {
        reached: Option<String>,
    },
}

/// Opens the source a query reads once its index is chosen.
struct DatabaseSources<'a> {
    db: &'a Arc<Database>,
    views: &'a Views,
    designs: &'a HashMap<String, DesignViews>,
    check: Check,
    checked: std::sync::Mutex<Checked>,
}

impl<'a> DatabaseSources<'a> {
    fn new(db: &'a Arc<Database>, views: &'a Views, designs: &'a HashMap<String, DesignViews>, check: Check) -> Self {
        DatabaseSources { db, views, designs, check, checked: std::sync::Mutex::new(Checked::NotOpened) }
    }

    fn checked(&self) -> Checked {
        self.checked.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone()
    }

    /// Checks the catalog against what opening `source` read of the feed; whether the query may
    /// run on it.
    fn check_catalog(&self, source: Option<&index_source::IndexSource<'_>>) -> bool {
        let generation = match self.check {
            Check::Nothing => return true,
            Check::Required(generation) | Check::Advance(generation) => generation,
        };
        let (confirmed, reached) = match source.and_then(|source| source.feed_read()) {
            Some((_, read, reached)) => {
                (catalog_watch::confirm(self.db, generation, read, reached), reached.map(str::to_owned))
            }
            None => (false, None),
        };
        let checked = if confirmed { Checked::Confirmed } else { Checked::Unconfirmed { reached } };
        *self.checked.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = checked;
        confirmed || matches!(self.check, Check::Advance(_))
    }
}

#[async_trait]
impl FindSources for DatabaseSources<'_> {
    async fn open(
        &self,
        request: &FindRequest,
        index: Option<&IndexDef>,
    ) -> Result<Box<dyn FindSource + '_>, MangoError> {
        let options = DocOptions { conflicts: request.conflicts, ..DocOptions::default() };
        let descending = request.sort.direction == "desc";
        let Some(index) = index else {
            if !self.check_catalog(None) {
                return Ok(Box::new(Unconfirmed));
            }
            let sort = request.sort_field_names();
            let by_id = sort.is_empty() || sort == ["_id"];
            return Ok(Box::new(AllDocsSource {
                db: self.db,
                options,
                descending: by_id && descending,
                serves_sort: by_id,
            }));
        };
        let design = self.designs.get(&index.ddoc).ok_or_else(|| {
            MangoError::new(StatusCode::INTERNAL_SERVER_ERROR, "unknown_error", "an index without its design document")
        })?;
        let docs = Box::new(DatabaseDocs { db: self.db, options });
        let source = index_source::open(self.views, self.db.as_ref(), design, index, request, docs).await?;
        if !self.check_catalog(Some(&source)) {
            return Ok(Box::new(Unconfirmed));
        }
        Ok(Box::new(source))
    }
}

/// The source of a query whose remembered catalog was not confirmed: it reads nothing (the
/// query runs again on a catalog listed anew, and this answer is thrown away).
struct Unconfirmed;

#[async_trait]
impl FindSource for Unconfirmed {
    fn tag(&self) -> String {
        "unconfirmed".into()
    }

    fn serves_sort(&self) -> bool {
        true
    }

    async fn read(&self, _from: Option<&Value>, _wanted: usize) -> Result<CandidatePage, MangoError> {
        Ok(CandidatePage { items: Vec::new(), next: None })
    }

    async fn fetch(&self, _ids: &[String]) -> Result<Vec<Map<String, Value>>, MangoError> {
        Ok(Vec::new())
    }
}

/// The winners of this database's documents, as an index's rows name them.
struct DatabaseDocs<'a> {
    db: &'a Arc<Database>,
    options: DocOptions,
}

#[async_trait]
impl RowDocs for DatabaseDocs<'_> {
    async fn read(&self, ids: &[String]) -> Result<Vec<Option<Map<String, Value>>>, MangoError> {
        let states = self.db.read_many(ids).await?;
        Ok(ids
            .iter()
            .zip(states)
            .map(|(id, state)| {
                if id.starts_with("_design/") {
                    return None;
                }
                state.as_ref().and_then(|state| winner_json(id, state, self.options))
            })
            .collect())
    }
}

/// The database's documents in id order (`_all_docs`), design documents left out.
struct AllDocsSource<'a> {
    db: &'a Arc<Database>,
    options: DocOptions,
    descending: bool,
    serves_sort: bool,
}

#[async_trait]
impl FindSource for AllDocsSource<'_> {
    fn tag(&self) -> String {
        if self.descending { "all_docs:desc" } else { "all_docs" }.into()
    }

    fn serves_sort(&self) -> bool {
        self.serves_sort
    }

    async fn read(&self, from: Option<&Value>, _wanted: usize) -> Result<CandidatePage, MangoError> {
        // A position: the id the range starts at (`s`, left out when `x`), and the backend's
        // token for a later page of that range (`t`).
        let text = |name: &str| from.and_then(|p| p.get(name)).and_then(Value::as_str).map(str::to_owned);
        let (start, token) = (text("s"), text("t"));
        let exclusive = from.and_then(|p| p.get("x")).and_then(Value::as_bool).unwrap_or(false);
        let range = IdRange {
            start: start.clone(),
            end: None,
            inclusive_end: true,
            descending: self.descending,
            include_design: true,
        };
        let page = self.db.all_docs(&range, SCAN_PAGE, token.as_deref()).await?;
        let mut items = Vec::with_capacity(page.items.len());
        for (id, state) in &page.items {
            if id.starts_with("_design/") || (exclusive && start.as_deref() == Some(id.as_str())) {
                continue;
            }
            let Some(doc) = winner_json(id, state, self.options) else { continue };
            items.push(Candidate { id: id.clone(), doc, after: json!({ "s": id, "x": true }) });
        }
        let next = page.next.map(|next| json!({ "s": start, "t": next, "x": exclusive }));
        Ok(CandidatePage { items, next })
    }

    async fn fetch(&self, ids: &[String]) -> Result<Vec<Map<String, Value>>, MangoError> {
        fetch_docs(self.db, ids, self.options).await
    }
}

/// The live documents with these ids, in order (design documents never).
async fn fetch_docs(db: &Database, ids: &[String], options: DocOptions) -> Result<Vec<Map<String, Value>>, MangoError> {
    let mut docs = Vec::with_capacity(ids.len());
    for chunk in ids.chunks(SCAN_PAGE) {
        let states = db.read_many(chunk).await?;
        for (id, state) in chunk.iter().zip(states) {
            if id.starts_with("_design/") {
                continue;
            }
            if let Some(doc) = state.as_ref().and_then(|state| winner_json(id, state, options)) {
                docs.push(doc);
            }
        }
    }
    Ok(docs)
}

/// `POST /{db}/_explain` over `db`'s indexes.
pub fn explain(indexes: DatabaseIndexes, request: &Value, db_name: &str) -> Result<Value, MangoError> {
    super::index::explain_with(indexes.catalog, request, db_name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::catalog::{DbName, EmbeddedCatalog};
    use crate::backend::embedded::EmbeddedOptions;
    use crate::database::Databases;

    struct Fixture {
        _dir: tempfile::TempDir,
        db: Arc<Database>,
        views: Views,
    }

    async fn fixture() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let catalog = Arc::new(EmbeddedCatalog::new(&dir.path().join("store.redb"), EmbeddedOptions::default()));
        let databases = Databases::new(Some(catalog), 4);
        let db = databases.create(&DbName::parse("app").unwrap()).await.unwrap();
        let views = Views::new(
            dir.path().join("views.redb"),
            Arc::new(super::super::index_map::WithMangoIndexes(super::super::index_map::NoJavaScript)),
        );
        Fixture { _dir: dir, db, views }
    }

    async fn put(db: &Database, id: &str, body: Value) {
        let body = body.as_object().cloned().unwrap_or_default();
        db.write(id, &Write::Edit { parent: None, deleted: false, body }).await.unwrap();
    }

    async fn run(f: &Fixture, request: &Value) -> Value {
        let indexes = DatabaseIndexes::load(&f.db).await.unwrap();
        find(&f.db, &f.views, &indexes, request).await.unwrap()
    }

    /// Pages `request` with its bookmark until a short page; calls `between` after each page.
    async fn page_all(f: &Fixture, request: Value, page: u64) -> (Vec<Value>, Vec<Value>) {
        let (mut docs, mut answers, mut bookmark) = (Vec::new(), Vec::new(), None::<Value>);
        for _ in 0..100 {
            let mut asked = request.clone();
            asked["limit"] = json!(page);
            if let Some(bookmark) = &bookmark {
                asked["bookmark"] = bookmark.clone();
            }
            let answer = run(f, &asked).await;
            let got = answer["docs"].as_array().cloned().unwrap_or_default();
            let short = (got.len() as u64) < page;
            docs.extend(got);
            bookmark = Some(answer["bookmark"].clone());
            answers.push(answer);
            if short {
                break;
            }
        }
        (docs, answers)
    }

    #[tokio::test]
    async fn a_json_index_is_read_in_key_order_across_many_index_pages() {
        let f = fixture().await;
        for i in 0..130u64 {
            put(&f.db, &format!("d{i:03}"), json!({"n": i % 13, "odd": i % 2 == 1})).await;
        }
        let created =
            create_index(&f.db, &json!({"index": {"fields": ["n"]}, "ddoc": "n", "name": "n"})).await.unwrap();
        assert_eq!(created, json!({"result": "created", "id": "_design/n", "name": "n"}));
        // Half the rows fail the selector, so every page reads several index pages.
        let request = json!({"selector": {"n": {"$gte": 0}, "odd": true}, "sort": ["n"], "fields": ["_id", "n"]});
        let (docs, answers) = page_all(&f, request, 7).await;
        let mut expected: Vec<(u64, String)> =
            (0..130u64).filter(|i| i % 2 == 1).map(|i| (i % 13, format!("d{i:03}"))).collect();
        expected.sort();
        let got: Vec<(u64, String)> =
            docs.iter().map(|d| (d["n"].as_u64().unwrap(), d["_id"].as_str().unwrap().to_owned())).collect();
        assert_eq!(got, expected);
        assert!(answers.iter().all(|a| a.get("warning").is_none()), "the index serves the query");
    }

    #[tokio::test]
    async fn a_key_range_keeps_every_match_of_begins_with_and_closed_intervals() {
        let f = fixture().await;
        let names = ["ab", "abc", "abz", "abé", "ab😀", "ab\u{FFFD}", "aa", "b", "AB", "abA"];
        for (i, name) in names.iter().enumerate() {
            put(&f.db, &format!("d{i}"), json!({"name": name, "n": i})).await;
        }
        for (ddoc, fields) in [("nm", json!(["name"])), ("nmn", json!(["name", "n"]))] {
            let request = json!({"index": {"fields": fields}, "ddoc": ddoc, "name": ddoc});
            create_index(&f.db, &request).await.unwrap();
        }
        let found = |answer: Value| {
            let mut names: Vec<String> =
                answer["docs"].as_array().unwrap().iter().map(|d| d["name"].as_str().unwrap().to_owned()).collect();
            names.sort();
            names
        };
        let begins = run(&f, &json!({"selector": {"name": {"$beginsWith": "ab"}}})).await;
        assert!(begins.get("warning").is_none(), "the index serves it: {begins}");
        let mut expected: Vec<String> = names.iter().filter(|n| n.starts_with("ab")).map(|n| (*n).to_owned()).collect();
        expected.sort();
        assert_eq!(found(begins), expected);
        let closed = run(&f, &json!({"selector": {"name": "abc", "n": {"$gte": 1, "$lte": 1}}})).await;
        assert!(closed.get("warning").is_none(), "an index serves it: {closed}");
        assert_eq!(found(closed), ["abc"]);
        let between = run(&f, &json!({"selector": {"name": {"$gt": "aa", "$lt": "b"}}})).await;
        let mut expected: Vec<String> = names
            .iter()
            .filter(|n| crate::views::collation::compare_strings(n, "aa").is_gt())
            .filter(|n| crate::views::collation::compare_strings(n, "b").is_lt())
            .map(|n| (*n).to_owned())
            .collect();
        expected.sort();
        assert_eq!(found(between), expected);
    }

    #[tokio::test]
    async fn paging_over_an_index_survives_writes_between_pages() {
        let f = fixture().await;
        for i in 0..40u64 {
            put(&f.db, &format!("d{i:03}"), json!({"n": i})).await;
        }
        create_index(&f.db, &json!({"index": {"fields": ["n"]}, "ddoc": "n", "name": "n"})).await.unwrap();
        let first = run(&f, &json!({"selector": {"n": {"$gte": 0}}, "limit": 10, "fields": ["_id"]})).await;
        assert_eq!(first["docs"][9]["_id"], "d009");
        // The last document returned is deleted and one is added past the bookmark.
        let state = f.db.read("d009").await.unwrap().unwrap();
        let rev = state.winner_rev();
        f.db.write("d009", &Write::Edit { parent: rev, deleted: true, body: Map::new() }).await.unwrap();
        put(&f.db, "new", json!({"n": 10.5})).await;
        let request =
            json!({"selector": {"n": {"$gte": 0}}, "limit": 3, "fields": ["_id"], "bookmark": first["bookmark"]});
        let next = run(&f, &request).await;
        assert_eq!(next["docs"], json!([{"_id": "d010"}, {"_id": "new"}, {"_id": "d011"}]));
    }

    #[tokio::test]
    async fn without_an_index_every_document_is_paged_once_with_the_warning() {
        let f = fixture().await;
        for i in 0..450u64 {
            put(&f.db, &format!("d{i:03}"), json!({"k": i})).await;
        }
        put(&f.db, "_design/js", json!({"views": {}})).await;
        let (docs, answers) = page_all(&f, json!({"selector": {"k": {"$gte": 0}}, "fields": ["_id"]}), 100).await;
        let ids: Vec<&str> = docs.iter().filter_map(|d| d["_id"].as_str()).collect();
        let expected: Vec<String> = (0..450).map(|i| format!("d{i:03}")).collect();
        assert_eq!(ids, expected, "id order, each once, design documents left out");
        assert!(answers[0]["warning"].as_str().is_some_and(|w| w.starts_with("No matching index found")));
    }

    #[tokio::test]
    async fn indexes_are_query_design_documents_created_found_and_deleted_as_couchdb_does() {
        let f = fixture().await;
        put(&f.db, "a", json!({"x": {"y": 1}})).await;
        let request = json!({"index": {"fields": ["x.y"]}});
        let created = create_index(&f.db, &request).await.unwrap();
        assert_eq!(created["result"], "created");
        let ddoc = created["id"].as_str().unwrap().to_owned();
        assert_eq!(create_index(&f.db, &request).await.unwrap()["result"], "exists");
        let listed = DatabaseIndexes::load(&f.db).await.unwrap().catalog.to_json();
        assert_eq!(listed["total_rows"], 2);
        assert_eq!(listed["indexes"][1]["def"], json!({"fields": [{"x.y": "asc"}]}));
        let stored = winner_json(&ddoc, &f.db.read(&ddoc).await.unwrap().unwrap(), DocOptions::default()).unwrap();
        assert_eq!(stored["language"], "query");
        let name = created["name"].as_str().unwrap();
        assert_eq!(stored["views"][name]["reduce"], "_count");
        assert_eq!(stored["views"][name]["options"]["def"], request["index"]);

        // A second index in the same design document, then both deleted: the document goes.
        let second = json!({"index": {"fields": ["z"]}, "ddoc": ddoc, "name": "z"});
        assert_eq!(create_index(&f.db, &second).await.unwrap()["result"], "created");
        assert_eq!(delete_index(&f.db, &ddoc, "json", name).await.unwrap(), json!({"ok": true}));
        assert!(!f.db.read(&ddoc).await.unwrap().unwrap().deleted(), "the other index keeps it");
        let missing = delete_index(&f.db, &ddoc, "json", name).await.unwrap_err().refusal();
        assert_eq!((missing.status.as_u16(), missing.error.as_str()), (404, "not_found"));
        delete_index(&f.db, &ddoc, "json", "z").await.unwrap();
        assert!(f.db.read(&ddoc).await.unwrap().unwrap().deleted());
        // And made again on top of the deleted one.
        assert_eq!(create_index(&f.db, &request).await.unwrap()["result"], "created");

        // `_bulk_delete`: a design document with one index loses it; one without is `not_found`.
        let one = json!({"index": {"fields": ["w"]}, "ddoc": "one", "name": "w"});
        create_index(&f.db, &one).await.unwrap();
        let answer = bulk_delete(&f.db, &json!({"docids": ["one", "_design/none"]})).await.unwrap();
        assert_eq!(
            answer,
            json!({"success": [{"id": "_design/one", "ok": true}], "fail": [{"id": "_design/none", "error": "not_found"}]})
        );
        assert!(f.db.read("_design/one").await.unwrap().unwrap().deleted());
        let refused = bulk_delete(&f.db, &json!({"docids": "one"})).await.unwrap_err().refusal();
        assert_eq!(refused.error, "invalid_bulk_docs");

        put(&f.db, "_design/js", json!({"views": {"v": {"map": "function(d){}"}}})).await;
        let refused = create_index(&f.db, &json!({"index": {"fields": ["q"]}, "ddoc": "js", "name": "q"}))
            .await
            .unwrap_err()
            .refusal();
        assert_eq!((refused.status.as_u16(), refused.error.as_str()), (400, "invalid_ddoc_lang"));
        assert_eq!(refused.reason, "Existing design doc has an invalid language: false");
    }

    /// A backend whose document writes fail as an unavailable store while `failing` is set.
    struct Unavailable {
        inner: crate::backend::embedded::EmbeddedBackend,
        failing: std::sync::atomic::AtomicBool,
    }

    #[async_trait::async_trait]
    impl crate::backend::raw::layer::Layered for Unavailable {
        fn inner(&self) -> &dyn crate::backend::DocumentBackend {
            &self.inner
        }

        async fn put(
            &self,
            id: &str,
            body: &Map<String, Value>,
            precondition: crate::backend::Precondition,
        ) -> crate::Result<crate::backend::Revision> {
            if self.failing.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(crate::Error::new(ErrorKind::Unavailable, "the store is down"));
            }
            crate::backend::DocumentBackend::put(&self.inner, id, body, precondition).await
        }
    }

    /// CouchDB 3.4.3 makes a `_bulk_delete` row only of `not_found` (and of Mango's own errors);
    /// a write the store fails is thrown and answered as the whole request's error, never a row
    /// naming the store's kind of failure (`{"error": "unavailable"}` here before).
    #[tokio::test]
    async fn bulk_delete_fails_whole_when_the_store_does() {
        let dir = tempfile::tempdir().unwrap();
        let inner = crate::backend::embedded::EmbeddedBackend::open(&dir.path().join("d.redb")).await.unwrap();
        let backend = Arc::new(Unavailable { inner, failing: false.into() });
        let db = Database::new("app".into(), backend.clone());
        create_index(&db, &json!({"index": {"fields": ["w"]}, "ddoc": "one", "name": "w"})).await.unwrap();
        backend.failing.store(true, std::sync::atomic::Ordering::SeqCst);
        match bulk_delete(&db, &json!({"docids": ["one", "none"]})).await {
            Err(MangoError::Storage(err)) => assert_eq!(err.kind(), ErrorKind::Unavailable),
            other => panic!("the store's failure as a row or another error: {other:?}"),
        }
        backend.failing.store(false, std::sync::atomic::Ordering::SeqCst);
        let answer = bulk_delete(&db, &json!({"docids": ["one", "none"]})).await.unwrap();
        assert_eq!(answer["fail"], json!([{"id": "_design/none", "error": "not_found"}]));
    }

    /// Counts the `_all_docs` reads made through it (a listing of the design documents is one).
    struct CountingListings {
        inner: Arc<dyn crate::backend::DocumentBackend>,
        listings: std::sync::atomic::AtomicUsize,
    }

    #[async_trait]
    impl crate::backend::raw::layer::Layered for CountingListings {
        fn inner(&self) -> &dyn crate::backend::DocumentBackend {
            self.inner.as_ref()
        }

        async fn all_docs(
            &self,
            range: &IdRange,
            limit: usize,
            page_token: Option<&str>,
        ) -> crate::error::Result<crate::backend::Page<crate::backend::StoredDocument>> {
            self.listings.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            self.inner.all_docs(range, limit, page_token).await
        }
    }

    /// The catalog is listed while it cannot be confirmed, then no more while the queries' index
    /// catch-ups find no design document changed; a design document changed through another
    /// `Database` over the same backend (another instance) is in the next query's catalog.
    #[tokio::test]
    async fn a_remembered_catalog_serves_until_another_instance_changes_a_design_document() {
        let dir = tempfile::tempdir().unwrap();
        let embedded: Arc<dyn crate::backend::DocumentBackend> =
            Arc::new(crate::backend::embedded::EmbeddedBackend::open(&dir.path().join("store.redb")).await.unwrap());
        let counting = Arc::new(CountingListings { inner: embedded, listings: Default::default() });
        let listings = || counting.listings.load(std::sync::atomic::Ordering::SeqCst);
        let backend: Arc<dyn crate::backend::DocumentBackend> = counting.clone();
        let serving = Arc::new(Database::new("app".into(), Arc::clone(&backend)));
        let other = Database::new("app".into(), Arc::clone(&backend));
        let views = Views::new(
            dir.path().join("views.redb"),
            Arc::new(super::super::index_map::WithMangoIndexes(super::super::index_map::NoJavaScript)),
        );
        for i in 0..40u64 {
            put(&serving, &format!("d{i:03}"), json!({"n": i})).await;
        }
        create_index(&serving, &json!({"index": {"fields": ["n"]}, "ddoc": "by-n", "name": "n"})).await.unwrap();
        let query = json!({"selector": {"n": {"$gte": 10, "$lt": 14}}});
        let ids = |answer: &Value| -> Vec<String> {
            answer["docs"].as_array().unwrap().iter().map(|doc| doc["_id"].as_str().unwrap().to_owned()).collect()
        };
        let expected = ["d010", "d011", "d012", "d013"];
        for _ in 0..3 {
            let answer = find_remembering(&serving, &views, &query).await.unwrap();
            assert_eq!(ids(&answer), expected);
            assert!(answer.get("warning").is_none(), "{answer}");
        }
        let warm = listings();
        for n in 0..5u64 {
            // Writes of ordinary documents (through either instance) keep the catalog confirmed.
            put(&other, &format!("e{n}"), json!({"n": 100 + n})).await;
            let answer = find_remembering(&serving, &views, &query).await.unwrap();
            assert_eq!(ids(&answer), expected);
        }
        assert_eq!(listings(), warm, "no listing while no design document changed");

        // The other instance deletes the index's design document: the next query has no index.
        let state = other.read("_design/by-n").await.unwrap().unwrap();
        let rev =
            winner_json("_design/by-n", &state, DocOptions::default()).unwrap()["_rev"].as_str().unwrap().to_owned();
        other.write("_design/by-n", &Write::Edit { parent: Some(rev), deleted: true, body: Map::new() }).await.unwrap();
        let answer = find_remembering(&serving, &views, &query).await.unwrap();
        assert_eq!(ids(&answer), expected);
        let warning = answer["warning"].as_str().unwrap_or_default();
        assert!(warning.contains("No matching index found"), "the deleted index is not used: {answer}");
        assert!(listings() > warm);
    }
}
