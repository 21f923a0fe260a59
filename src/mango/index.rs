//! The Mango index catalog: `GET/POST /{db}/_index`, `DELETE /{db}/_index/{ddoc}/json/{name}`,
//! `POST /{db}/_explain`, and the choice of index a `_find` would make.
//!
//! The catalog decides what CouchDB decides from its indexes, so clients see the same
//! behaviour: which index serves a query, whether a `sort` is allowed (an index must cover it,
//! fixture 038), whether the "no matching index" warning is given, and what `_explain` reports.
//!
//! On the data-store database, `idx-user-namespace` (fields `userId`, `namespace`) is always
//! present, under the design document id a CouchDB 3.4.3 gave it (fixture 010), and served by
//! the backend's own `userId`/`namespace` index. Indexes created with `POST _index` are kept in
//! the local document `_local/agentstore-mango-indexes`, so they survive restarts, are never
//! replicated, and cost no listing of design documents; where this process builds indexes (the
//! embedded store, DynamoDB, Firestore) each is built as a view group from its definition
//! ([`IndexDef::data_store_design`]) and `_find` reads it ([`super::index_source`]); over the
//! CouchDB backend they stay definitions and `_find` pages the backend.

use http::StatusCode;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use super::range::{field_ranges, index_prefix, FieldRange};
use super::request::{parse_request, parse_sort};
use super::selector::{join_field, parse_field, Selector};
use super::{erlang_term, MangoError};
use crate::backend::{DocumentBackend, Precondition};
use crate::views::design::DesignViews;

/// The local document holding the created indexes' definitions.
pub const CATALOG_DOCUMENT: &str = "agentstore-mango-indexes";
/// The built-in index's name, fields and design document (as CouchDB 3.4.3 named it).
pub const STANDARD_INDEX_NAME: &str = "idx-user-namespace";
pub const STANDARD_INDEX_DDOC: &str = "_design/6b616e35af647bddcf8e10c3787b8f7ef20b3545";
const STANDARD_INDEX_FIELDS: [&str; 2] = ["userId", "namespace"];
/// How often a catalog update is retried when another writer changed the catalog meanwhile.
const CATALOG_WRITE_ATTEMPTS: usize = 5;

/// One JSON index definition.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexDef {
    /// `_design/…`
    pub ddoc: String,
    pub name: String,
    /// Field names (dotted paths) and their direction, `asc` or `desc`.
    pub fields: Vec<(String, String)>,
    /// A `partial_filter_selector`, kept and listed; a partial index is never chosen
    /// automatically (as in CouchDB), so it only matters through `use_index`.
    pub partial_filter_selector: Option<Value>,
}

impl IndexDef {
    fn standard() -> Self {
        IndexDef {
            ddoc: STANDARD_INDEX_DDOC.into(),
            name: STANDARD_INDEX_NAME.into(),
            fields: STANDARD_INDEX_FIELDS.iter().map(|f| ((*f).to_owned(), "asc".to_owned())).collect(),
            partial_filter_selector: None,
        }
    }

    /// Whether this is the data-store database's built-in `idx-user-namespace`, which the
    /// backend's own `userId`/`namespace` index serves.
    pub fn is_standard(&self) -> bool {
        self.ddoc == STANDARD_INDEX_DDOC && self.name == STANDARD_INDEX_NAME
    }

    /// The design document a created index of the data-store database is built as: one
    /// `language: "query"` view named after the index, as CouchDB would store it (without
    /// `options.def`, which changes no row). It is never stored: the catalog document is the
    /// index's record, and this is rebuilt from it for the view index ([`crate::views`]). Its
    /// group's signature covers the name, the fields and the partial filter, so creating or
    /// deleting one index never rebuilds another.
    pub fn data_store_design(&self) -> Result<DesignViews, MangoError> {
        let doc = json!({
            "_id": self.ddoc,
            "language": "query",
            "views": { self.name.as_str(): { "map": super::database::index_map(self)?, "reduce": "_count" } },
        });
        DesignViews::parse(&doc)
            .map_err(|invalid| MangoError::new(StatusCode::INTERNAL_SERVER_ERROR, "invalid_design_doc", invalid.0))
    }

    pub fn field_names(&self) -> Vec<String> {
        self.fields.iter().map(|(f, _)| f.clone()).collect()
    }

    /// The index as `GET _index` lists it.
    pub fn to_json(&self) -> Value {
        let fields: Vec<Value> = self.fields.iter().map(|(f, d)| json!({ f.as_str(): d })).collect();
        let mut def = json!({ "fields": fields });
        if let Some(partial) = &self.partial_filter_selector {
            def["partial_filter_selector"] = partial.clone();
        }
        json!({ "ddoc": self.ddoc, "name": self.name, "type": "json", "partitioned": false, "def": def })
    }

    fn stored(&self) -> Value {
        let mut out = self.to_json();
        if let Value::Object(map) = &mut out {
            map.remove("partitioned");
            map.remove("type");
        }
        out
    }

    fn from_stored(value: &Value) -> Option<Self> {
        let fields = value["def"]["fields"]
            .as_array()?
            .iter()
            .map(|f| f.as_object()?.iter().next().map(|(k, d)| Some((k.clone(), d.as_str()?.to_owned())))?)
            .collect::<Option<Vec<_>>>()?;
        Some(IndexDef {
            ddoc: value["ddoc"].as_str()?.to_owned(),
            name: value["name"].as_str()?.to_owned(),
            fields,
            partial_filter_selector: value["def"].get("partial_filter_selector").cloned(),
        })
    }
}

/// `_all_docs` as CouchDB lists its special index.
fn all_docs_json() -> Value {
    json!({ "ddoc": null, "name": "_all_docs", "type": "special", "def": { "fields": [{ "_id": "asc" }] } })
}

/// The indexes a database has: the built-in one first, then those created, in creation order.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexCatalog {
    pub indexes: Vec<IndexDef>,
    /// The catalog document's revision, for the next update (`None`: not written yet).
    revision: Option<crate::backend::Revision>,
}

impl Default for IndexCatalog {
    fn default() -> Self {
        IndexCatalog { indexes: vec![IndexDef::standard()], revision: None }
    }
}

impl IndexCatalog {
    /// The catalog of a database other than the data-store one: the JSON indexes its query
    /// design documents define, and no built-in index.
    pub fn of_design_documents(indexes: Vec<IndexDef>) -> IndexCatalog {
        IndexCatalog { indexes, revision: None }
    }

    /// The catalog as a partitioned query sees it: no JSON index (none here is partitioned), only
    /// `_all_docs`. For choosing an index only, never saved.
    pub fn without_json_indexes(&self) -> IndexCatalog {
        IndexCatalog { indexes: Vec::new(), revision: None }
    }

    /// The catalog, as remembered for a few seconds ([`super::index_cache`]) or read.
    pub async fn load(backend: &dyn DocumentBackend) -> Result<Self, MangoError> {
        let ticket = match super::index_cache::lookup(backend) {
            Ok(remembered) => return Ok(remembered),
            Err(ticket) => ticket,
        };
        let catalog = Self::load_stored(backend).await?;
        super::index_cache::remember(ticket, &catalog);
        Ok(catalog)
    }

    /// Reads the catalog from the backend's local document.
    async fn load_stored(backend: &dyn DocumentBackend) -> Result<Self, MangoError> {
        let mut catalog = IndexCatalog::default();
        if let Some(stored) = backend.get_local(CATALOG_DOCUMENT).await? {
            catalog.revision = Some(stored.rev);
            let created = stored.body.get("indexes").and_then(Value::as_array).cloned().unwrap_or_default();
            catalog.indexes.extend(created.iter().filter_map(IndexDef::from_stored));
        }
        Ok(catalog)
    }

    async fn save(&self, backend: &dyn DocumentBackend) -> Result<(), MangoError> {
        let created: Vec<Value> = self.indexes.iter().skip(1).map(IndexDef::stored).collect();
        let mut body = Map::new();
        body.insert("indexes".into(), Value::Array(created));
        let precondition = match &self.revision {
            Some(rev) => Precondition::MatchRevision(rev.clone()),
            None => Precondition::MustNotExist,
        };
        let saved = backend.put_local(CATALOG_DOCUMENT, &body, precondition).await;
        super::index_cache::forget(backend);
        saved?;
        Ok(())
    }

    /// Applies `change` to the stored catalog, retrying when a concurrent update won.
    async fn update<T>(
        backend: &dyn DocumentBackend,
        mut change: impl FnMut(&mut IndexCatalog) -> Result<(T, bool), MangoError>,
    ) -> Result<T, MangoError> {
        for _ in 0..CATALOG_WRITE_ATTEMPTS {
            let mut catalog = IndexCatalog::load_stored(backend).await?;
            let (answer, changed) = change(&mut catalog)?;
            if !changed {
                return Ok(answer);
            }
            match catalog.save(backend).await {
                Ok(()) => return Ok(answer),
                Err(e) if e.is_conflict() => continue,
                Err(e) => return Err(e),
            }
        }
        Err(MangoError::new(StatusCode::CONFLICT, "conflict", "the index catalog kept changing; try again"))
    }

    /// The `GET _index` body: `_all_docs`, then the indexes by design document id and name (raw
    /// bytes), as CouchDB's `lists:sort` of its index records orders them.
    pub fn to_json(&self) -> Value {
        let mut sorted: Vec<&IndexDef> = self.indexes.iter().collect();
        sorted.sort_by(|a, b| (a.ddoc.as_bytes(), a.name.as_bytes()).cmp(&(b.ddoc.as_bytes(), b.name.as_bytes())));
        let mut listed = vec![all_docs_json()];
        listed.extend(sorted.into_iter().map(IndexDef::to_json));
        json!({ "total_rows": listed.len(), "indexes": listed })
    }
}

/// The view group signatures of the data-store database's created JSON indexes: what its
/// `_view_cleanup` keeps beside its design documents' groups.
pub async fn data_store_signatures(backend: &dyn DocumentBackend) -> Result<Vec<String>, MangoError> {
    let catalog = IndexCatalog::load_stored(backend).await?;
    Ok(catalog
        .indexes
        .iter()
        .filter(|index| !index.is_standard())
        .filter_map(|index| index.data_store_design().ok())
        .map(|design| design.signature)
        .collect())
}

/// `GET /{db}/_index`.
pub async fn list_indexes(backend: &dyn DocumentBackend) -> Result<Value, MangoError> {
    Ok(IndexCatalog::load(backend).await?.to_json())
}

/// `POST /{db}/_index`: `{"result": "created"|"exists", "id", "name"}`.
///
/// Without `ddoc`, the design document is named after a hash of the definition and the `name`
/// given (CouchDB's `mango_idx:gen_name` hashes the options, name included), so the same request
/// finds the same index (`exists`) while an existing name with another definition, or living in
/// another design document, gets a design document of its own (issue 22 §2c item 11).
pub async fn create_index(backend: &dyn DocumentBackend, request: &Value) -> Result<Value, MangoError> {
    let (parsed, legacy_ddoc) = parse_index_request(request)?;
    IndexCatalog::update(backend, |catalog| {
        let mut wanted = parsed.clone();
        // Before this server hashed the name in, a named index without `ddoc` was put in the
        // design document of its definition alone: the same request still finds it there.
        if let Some(legacy) = &legacy_ddoc {
            let earlier = IndexDef { ddoc: legacy.clone(), ..wanted.clone() };
            if catalog.indexes.contains(&earlier) {
                wanted = earlier;
            }
        }
        let answer = |result: &str| json!({ "result": result, "id": wanted.ddoc, "name": wanted.name });
        match catalog.indexes.iter().position(|i| i.ddoc == wanted.ddoc && i.name == wanted.name) {
            Some(at) if catalog.indexes[at] == wanted => Ok((answer("exists"), false)),
            Some(0) => Err(builtin_is_fixed()),
            Some(at) => {
                catalog.indexes[at] = wanted.clone();
                Ok((answer("created"), true))
            }
            None => {
                catalog.indexes.push(wanted.clone());
                Ok((answer("created"), true))
            }
        }
    })
    .await
}

/// `DELETE /{db}/_index/{ddoc}/json/{name}` (`ddoc` with or without `_design/`): `{"ok": true}`.
pub async fn delete_index(backend: &dyn DocumentBackend, ddoc: &str, name: &str) -> Result<Value, MangoError> {
    let ddoc = design_id(ddoc);
    IndexCatalog::update(backend, |catalog| {
        match catalog.indexes.iter().position(|i| i.ddoc == ddoc && i.name == name) {
            Some(0) => Err(builtin_is_fixed()),
            Some(at) => {
                catalog.indexes.remove(at);
                Ok((json!({ "ok": true }), true))
            }
            None => Err(MangoError::new(StatusCode::NOT_FOUND, "not_found", "Index not found")),
        }
    })
    .await
}

fn builtin_is_fixed() -> MangoError {
    MangoError::new(
        StatusCode::FORBIDDEN,
        "forbidden",
        format!("{STANDARD_INDEX_NAME} is built into this server and cannot be changed or deleted"),
    )
}

pub fn design_id(ddoc: &str) -> String {
    if ddoc.starts_with("_design/") {
        ddoc.to_owned()
    } else {
        format!("_design/{ddoc}")
    }
}

/// Validates a `POST _index` body as CouchDB does (`mango_opts:validate_idx_create`): the
/// definition, and for a named index without `ddoc` the design document an earlier version of
/// this server gave it.
pub fn parse_index_request(request: &Value) -> Result<(IndexDef, Option<String>), MangoError> {
    let Value::Object(body) = request else {
        return Err(MangoError::bad_request("bad_request", "Request body must be a JSON object"));
    };
    for key in body.keys() {
        if !["index", "type", "name", "ddoc", "w", "partitioned"].contains(&key.as_str()) {
            return Err(MangoError::bad_request("invalid_key", format!("Invalid key {key} for this request.")));
        }
    }
    let Some(index) = body.get("index") else {
        return Err(MangoError::bad_request("missing_required_key", "Missing required key: index"));
    };
    let kind = optional_string(body, "type")?.unwrap_or("json");
    if kind == "text" || kind == "nouveau" {
        // CouchDB without its search service (`mango_idx:get_idx_type`): this server has none.
        return Err(MangoError::new(StatusCode::SERVICE_UNAVAILABLE, "required index service unavailable", kind));
    }
    if kind != "json" {
        return Err(MangoError::bad_request("invalid_index", format!("Invalid type for index: {kind}")));
    }
    let Value::Object(index) = index else {
        return Err(MangoError::bad_request(
            "invalid_index",
            format!("JSON indexes must be an object, not: {}", erlang_term(index)),
        ));
    };
    let fields = parse_index_fields(index.get("fields"))?;
    let partial_filter_selector = index.get("partial_filter_selector").cloned();
    if let Some(partial) = &partial_filter_selector {
        let Value::Object(selector) = partial else {
            return Err(MangoError::bad_request(
                "invalid_selector_json",
                format!("Selector must be a JSON object, not: {}", erlang_term(partial)),
            ));
        };
        super::selector::parse(selector)?;
    }
    // CouchDB names an unnamed index and its design document after a hash of the request's
    // options; so does this server (with its own hash, so the ids differ from CouchDB's but are
    // just as stable). An unnamed index's hash is the definition's alone, as it always was.
    let definition_hash = |name: Option<&str>| {
        let mut hashed = json!({ "fields": fields_json(&fields), "partial": partial_filter_selector });
        if let Some(name) = name {
            hashed["name"] = Value::String(name.to_owned());
        }
        hex::encode(Sha256::digest(serde_json::to_vec(&hashed).unwrap_or_default()))[..40].to_owned()
    };
    let given_name = optional_string(body, "name")?;
    let given_ddoc = optional_string(body, "ddoc")?;
    let auto = definition_hash(given_name);
    let name = given_name.map_or_else(|| auto.clone(), str::to_owned);
    let standard = IndexDef::standard();
    let ddoc = if given_ddoc.is_none()
        && given_name == Some(STANDARD_INDEX_NAME)
        && fields == standard.fields
        && partial_filter_selector.is_none()
    {
        // The built-in index's own options: the design document CouchDB's hash of them gives
        // (fixtures 010 and 011).
        standard.ddoc
    } else {
        design_id(given_ddoc.unwrap_or(&auto))
    };
    let legacy_ddoc = match (given_name, given_ddoc) {
        (Some(_), None) => Some(design_id(&definition_hash(None))),
        _ => None,
    };
    Ok((IndexDef { ddoc, name, fields, partial_filter_selector }, legacy_ddoc))
}

fn fields_json(fields: &[(String, String)]) -> Vec<Value> {
    fields.iter().map(|(f, d)| json!({ f.as_str(): d })).collect()
}

fn optional_string<'a>(body: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>, MangoError> {
    match body.get(key) {
        None => Ok(None),
        Some(Value::String(s)) if s.is_empty() => {
            Err(MangoError::bad_request("invalid_empty_string", "Index name or ddoc cannot be empty string"))
        }
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => {
            Err(MangoError::bad_request("invalid_string", format!("Invalid string: {}", erlang_term(other))))
        }
    }
}

/// An index's `fields`: names or `{name: "asc"|"desc"}`, one direction for all. An empty list is
/// a valid index, as in CouchDB (issue 22 §2c item 11); a missing one is CouchDB's
/// `missing_required_key` (mango_idx_view.erl's options).
fn parse_index_fields(fields: Option<&Value>) -> Result<Vec<(String, String)>, MangoError> {
    let Some(list) = fields else {
        return Err(MangoError::bad_request("missing_required_key", "Missing required key: fields"));
    };
    let parsed = parse_sort(list)?;
    Ok(parsed.fields.into_iter().map(|(path, _)| (join_field(&path), parsed.direction.clone())).collect())
}

/// Whether a request runs (`_find`) or is only planned (`_explain`): with no usable index
/// CouchDB refuses the first (`no_usable_index`) and plans the second with `index: null`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueryKind {
    Find,
    Explain,
}

/// The index CouchDB would answer a query with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ChosenIndex<'a> {
    Json(&'a IndexDef),
    /// The special `_all_docs` index (a full scan, with CouchDB's warning).
    AllDocs,
    /// No index can serve the query (only for `_explain`).
    NoneUsable,
}

/// Which index CouchDB would answer a query with, and the warnings that choice gives.
#[derive(Debug, Clone)]
pub struct IndexChoice<'a> {
    pub index: ChosenIndex<'a>,
    /// The chosen index's first column has an empty range: CouchDB reads nothing and answers
    /// `{"docs": []}` (`mango_cursor_view:execute` with `[empty]` ranges).
    pub reads_nothing: bool,
    /// `use_index` named an index that was not usable (CouchDB's warning text).
    pub warnings: Vec<String>,
}

impl IndexCatalog {
    /// CouchDB's choice among the indexes for `selector` and `sort` (field names), honouring
    /// `use_index` (`[ddoc]` or `[ddoc, name]`), as `mango_idx:get_usable_indexes`,
    /// `mango_cursor:create` and `mango_cursor_view:choose_best_index` (3.4.3) make it: the
    /// candidates are the indexes without a partial filter plus those `use_index` names; a JSON
    /// index that can serve the query is preferred to `_all_docs`; none at all is
    /// `no_usable_index` for `_find`.
    pub fn choose(
        &self,
        selector: &Selector,
        sort: &[String],
        use_index: &[String],
        allow_fallback: bool,
        kind: QueryKind,
    ) -> Result<IndexChoice<'_>, MangoError> {
        let named = |i: &IndexDef| match use_index.first() {
            None => false,
            Some(ddoc) => i.ddoc == design_id(ddoc) && use_index.get(1).is_none_or(|n| *n == i.name),
        };
        let usable: Vec<&IndexDef> = self
            .indexes
            .iter()
            .filter(|i| (i.partial_filter_selector.is_none() || named(i)) && is_usable(i, selector, sort))
            .collect();
        let all_docs = all_docs_usable(selector, sort);
        let usable_count = usable.len() + usize::from(all_docs);
        if usable_count == 0 && kind == QueryKind::Find {
            return Err(MangoError::bad_request(
                "no_usable_index",
                "No index exists for this sort, try indexing by the sort fields.",
            ));
        }
        let ranges = field_ranges(selector);
        let reads_nothing = |index: ChosenIndex<'_>| match index {
            ChosenIndex::Json(index) => {
                index_prefix(&index.field_names(), &ranges).first().is_some_and(|(_, has_values)| !has_values)
            }
            ChosenIndex::AllDocs => ranges.iter().any(|(field, has_values)| field == "_id" && !has_values),
            ChosenIndex::NoneUsable => false,
        };
        let requested: Vec<&IndexDef> = usable.iter().copied().filter(|i| named(i)).collect();
        if !requested.is_empty() {
            let index = best_json_index(&requested, &ranges).map_or(ChosenIndex::NoneUsable, ChosenIndex::Json);
            return Ok(IndexChoice { index, reads_nothing: reads_nothing(index), warnings: Vec::new() });
        }
        if !(allow_fallback || (use_index.is_empty() && usable_count > 1)) {
            let reason = match use_index {
                [] => "You must specify an index with the `use_index` parameter.".to_owned(),
                [ddoc] => format!(
                    "_design/{} specified by `use_index` could not be found or it is not suitable.",
                    ddoc.trim_start_matches("_design/")
                ),
                [ddoc, name, ..] => format!(
                    "_design/{}, {name} specified by `use_index` could not be found or it is not suitable.",
                    ddoc.trim_start_matches("_design/")
                ),
            };
            return Err(MangoError::bad_request("invalid_index", reason));
        }
        let index = match best_json_index(&usable, &ranges) {
            Some(index) => ChosenIndex::Json(index),
            None if all_docs => ChosenIndex::AllDocs,
            None => ChosenIndex::NoneUsable,
        };
        let mut warnings = Vec::new();
        if index != ChosenIndex::NoneUsable {
            let shown = |ddoc: &str| ddoc.trim_start_matches("_design/").to_owned();
            match use_index {
                [] => {}
                [ddoc] => warnings.push(format!(
                    "_design/{} was not used because it does not contain a valid index for this query.",
                    shown(ddoc)
                )),
                [ddoc, name, ..] => warnings.push(format!(
                    "_design/{}, {name} was not used because it is not a valid index for this query.",
                    shown(ddoc)
                )),
            }
        }
        Ok(IndexChoice { index, reads_nothing: reads_nothing(index), warnings })
    }
}

/// CouchDB's `mango_cursor_view:choose_best_index` among usable JSON indexes: the smallest gap
/// between the selector's field ranges and the leading columns the index has of them, then
/// fewer columns, then the smaller (design document, name).
fn best_json_index<'a>(usable: &[&'a IndexDef], ranges: &[FieldRange]) -> Option<&'a IndexDef> {
    let gap = |index: &IndexDef| ranges.len().saturating_sub(index_prefix(&index.field_names(), ranges).len());
    usable.iter().copied().min_by(|a, b| {
        gap(a)
            .cmp(&gap(b))
            .then_with(|| a.fields.len().cmp(&b.fields.len()))
            .then_with(|| (a.ddoc.as_bytes(), a.name.as_bytes()).cmp(&(b.ddoc.as_bytes(), b.name.as_bytes())))
    })
}

/// CouchDB's `mango_idx_special:is_usable` for `_all_docs`: any query without a sort; a sort on
/// `_id` only when the selector has an indexable condition on `_id`.
fn all_docs_usable(selector: &Selector, sort: &[String]) -> bool {
    sort.is_empty() || (sort == ["_id"] && selector.indexable_fields().iter().any(|f| f == "_id"))
}

/// Why CouchDB's `_explain` calls an index unusable: its first reason.
fn unusable_reason(index: &IndexDef, selector: &Selector, sort: &[String]) -> &'static str {
    if has_required_fields(index, selector, sort) {
        "sort_order_mismatch"
    } else {
        "field_mismatch"
    }
}

/// CouchDB's `mango_idx_view:is_usable`: every column the sort does not supply is required by
/// the selector, and the sort can be read off the index's order.
fn is_usable(index: &IndexDef, selector: &Selector, sort: &[String]) -> bool {
    has_required_fields(index, selector, sort) && can_use_sort(&index.field_names(), sort, selector)
}

fn has_required_fields(index: &IndexDef, selector: &Selector, sort: &[String]) -> bool {
    let required: Vec<Vec<String>> = index
        .field_names()
        .iter()
        .filter(|c| !sort.contains(c) && *c != "_id" && *c != "_rev")
        .filter_map(|c| parse_field(c).ok())
        .collect();
    selector.has_required_fields(&required)
}

fn can_use_sort(columns: &[String], sort: &[String], selector: &Selector) -> bool {
    match (columns.split_first(), sort.first()) {
        (_, None) => true,
        (None, Some(_)) => false,
        (Some((first, _)), Some(lead)) if first == lead => columns.starts_with(sort),
        (Some((first, rest)), Some(_)) => {
            let path = parse_field(first).unwrap_or_default();
            let path: Vec<&str> = path.iter().map(String::as_str).collect();
            selector.required_equal(&path).is_some() && can_use_sort(rest, sort, selector)
        }
    }
}

/// `POST /{db}/_explain`: what `_find` would do with this request, in CouchDB's shape (fixture
/// 040). `mrargs` shows the key range CouchDB would read from the chosen index, which is what
/// this server reads from a created index where it builds them (for the built-in index, and
/// over the CouchDB backend, it reads the backend instead: docs/couchdb-api.md).
///
/// A per-user login is shown the plan of its own request: `_find` runs that plan and reads it
/// through the login's confinement ([`super::find`]), which does not change the plan.
pub async fn explain(backend: &dyn DocumentBackend, request: &Value, db_name: &str) -> Result<Value, MangoError> {
    let catalog = IndexCatalog::load(backend).await?;
    explain_with(catalog, request, db_name)
}

/// [`explain`] over a catalog already loaded (any database's).
pub fn explain_with(mut catalog: IndexCatalog, request: &Value, db_name: &str) -> Result<Value, MangoError> {
    let parsed = parse_request(request)?;
    let selector = parsed.selector.clone();
    if !parsed.partition.is_empty() {
        catalog = catalog.without_json_indexes();
    }
    let sort_names = parsed.sort_field_names();
    let choice =
        catalog.choose(&selector, &sort_names, &parsed.use_index, parsed.allow_fallback, QueryKind::Explain)?;
    let fields: Vec<Value> = parsed.fields.iter().map(|(_, name)| Value::String(name.clone())).collect();
    let sort: Map<String, Value> =
        parsed.sort.fields.iter().map(|(p, _)| (join_field(p), Value::String(parsed.sort.direction.clone()))).collect();
    let opts = json!({
        "use_index": parsed.use_index, "bookmark": parsed.bookmark.clone().unwrap_or_else(|| "nil".into()),
        "limit": parsed.limit, "skip": parsed.skip, "sort": sort, "fields": fields,
        "partition": parsed.partition, "r": parsed.r, "conflicts": parsed.conflicts, "stale": parsed.stale, "update": parsed.update,
        "stable": parsed.stable, "execution_stats": parsed.execution_stats, "allow_fallback": parsed.allow_fallback,
    });
    // A selector that is only an empty `$or`/`$and` (`maybe_noop_range`), or an empty range on the
    // chosen index, reads nothing.
    let reads_nothing = parsed.selector.is_empty_combination() || choice.reads_nothing;
    let (index_json, candidates, mrargs) = match choice.index {
        ChosenIndex::Json(index) => {
            let mut candidates = vec![json!({ "index": all_docs_json(), "analysis": {
                "usable": true, "reasons": [{ "name": "unfavored_type" }], "ranking": 1, "covering": null } })];
            candidates.extend(catalog.indexes.iter().filter(|i| i.ddoc != index.ddoc || i.name != index.name).map(
                |other| {
                    let usable = is_usable(other, &selector, &sort_names);
                    let reason = if usable { "less_overlap" } else { unusable_reason(other, &selector, &sort_names) };
                    json!({ "index": other.to_json(), "analysis": {
                    "usable": usable, "reasons": [{ "name": reason }], "ranking": 2, "covering": false } })
                },
            ));
            let mut mrargs = index_range(index, &selector, parsed.sort.direction == "desc");
            if reads_nothing {
                mrargs["start_key"] = Value::Null;
                mrargs["end_key"] = Value::Null;
            }
            (index.to_json(), candidates, Some(mrargs))
        }
        ChosenIndex::AllDocs => {
            let candidates = catalog
                .indexes
                .iter()
                .map(|other| {
                    let reason = unusable_reason(other, &selector, &sort_names);
                    json!({ "index": other.to_json(), "analysis": {
                    "usable": false, "reasons": [{ "name": reason }], "ranking": 2, "covering": false } })
                })
                .collect();
            let end_key = if reads_nothing { Value::Null } else { Value::String("<MAX>".into()) };
            let partition =
                if parsed.partition.is_empty() { Value::Null } else { Value::String(parsed.partition.clone()) };
            let mrargs = json!({ "include_docs": true, "view_type": "map", "reduce": false, "partition": partition,
                "start_key": null, "end_key": end_key, "direction": "fwd", "stable": false, "update": true,
                "conflicts": "undefined" });
            (all_docs_json(), candidates, Some(mrargs))
        }
        ChosenIndex::NoneUsable => {
            // CouchDB's `_explain` of a query no index serves: `index: null`, every index listed
            // as unusable with its first reason, and no `mrargs` (issue 22 §2c item 10).
            let all_docs_reason = if selector.indexable_fields().iter().any(|f| f == "_id") {
                "sort_order_mismatch"
            } else {
                "field_mismatch"
            };
            let mut candidates = vec![json!({ "index": all_docs_json(), "analysis": {
                "usable": false, "reasons": [{ "name": all_docs_reason }], "ranking": 2, "covering": null } })];
            candidates.extend(catalog.indexes.iter().map(|other| {
                let reason = unusable_reason(other, &selector, &sort_names);
                json!({ "index": other.to_json(), "analysis": {
                "usable": false, "reasons": [{ "name": reason }], "ranking": 2, "covering": false } })
            }));
            (Value::Null, candidates, None)
        }
    };
    let (indexable, unindexable) = selector_hints(&selector);
    let mut answer = json!({
        "dbname": db_name, "index": index_json, "partitioned": false, "selector": selector.to_json(), "opts": opts,
        "limit": parsed.limit, "skip": parsed.skip, "fields": fields, "index_candidates": candidates,
        "selector_hints": [{ "type": "json", "indexable_fields": indexable, "unindexable_fields": unindexable }],
    });
    if let Some(mrargs) = mrargs {
        answer["mrargs"] = mrargs;
        answer["covering"] = Value::Bool(false);
    }
    Ok(answer)
}

/// The key range CouchDB would read from a JSON index ([`super::range::key_range`]), as its
/// `_explain` shows it (`<MAX>` for the value above every other).
fn index_range(index: &IndexDef, selector: &Selector, descending: bool) -> Value {
    let (start, end) = super::range::key_range(&index.field_names(), selector, &Value::String("<MAX>".into()));
    let (start_key, end_key) = if descending { (end, start) } else { (start, end) };
    json!({ "include_docs": true, "view_type": "map", "reduce": false, "partition": null,
        "start_key": start_key, "end_key": end_key, "direction": if descending { "rev" } else { "fwd" },
        "stable": false, "update": true, "conflicts": "undefined" })
}

/// `_explain`'s `selector_hints` (mango_cursor.erl `extract_selector_hints`): the fields a JSON
/// index could serve (`indexable_fields`, seen through `$and` only) and the selector's other
/// fields, sorted.
fn selector_hints(selector: &Selector) -> (Vec<String>, Vec<String>) {
    let indexable = selector.indexable_fields();
    let mut other = selector.field_names();
    other.retain(|f| !indexable.contains(f));
    (indexable, other)
}
