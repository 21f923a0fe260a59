//! The Mango index catalog: `GET/POST /{db}/_index`, `DELETE /{db}/_index/{ddoc}/json/{name}`,
//! `POST /{db}/_explain`, and the choice of index a `_find` would make.
//!
//! No backend builds CouchDB views, so an "index" here is a definition only: the service answers
//! every query by paging the backend (its `userId`/`namespace` index, or all documents) and
//! filtering. The catalog still decides what CouchDB decides from its indexes, so clients see
//! the same behaviour: whether a `sort` is allowed (an index must cover it, fixture 038), whether
//! the "no matching index" warning is given, and what `_explain` reports.
//!
//! `idx-user-namespace` (fields `userId`, `namespace`) is always present, under the design
//! document id a CouchDB 3.4.3 gave it (fixture 010). Indexes created with `POST _index` are kept
//! in the local document `_local/agentstore-mango-indexes`, so they survive restarts, are never
//! replicated, and cost no listing of design documents.

use axum::http::StatusCode;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use super::selector::{join_field, parse_field, Cond, Selector};
use super::{erlang_term, MangoError};
use crate::backend::{DocumentBackend, Precondition};

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

    fn field_names(&self) -> Vec<String> {
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
                Err(e) if e.status == StatusCode::CONFLICT => continue,
                Err(e) => return Err(e),
            }
        }
        Err(MangoError::new(StatusCode::CONFLICT, "conflict", "the index catalog kept changing; try again"))
    }

    /// The `GET _index` body.
    pub fn to_json(&self) -> Value {
        let mut listed = vec![all_docs_json()];
        listed.extend(self.indexes.iter().map(IndexDef::to_json));
        json!({ "total_rows": listed.len(), "indexes": listed })
    }
}

/// `GET /{db}/_index`.
pub async fn list_indexes(backend: &dyn DocumentBackend) -> Result<Value, MangoError> {
    Ok(IndexCatalog::load(backend).await?.to_json())
}

/// `POST /{db}/_index`: `{"result": "created"|"exists", "id", "name"}`.
pub async fn create_index(backend: &dyn DocumentBackend, request: &Value) -> Result<Value, MangoError> {
    let (parsed, ddoc_given) = parse_index_request(request)?;
    IndexCatalog::update(backend, |catalog| {
        // CouchDB derives an unnamed design document from the definition, so the same definition
        // lands in the same design document: here, the one already holding it.
        let mut wanted = parsed.clone();
        if !ddoc_given {
            let same_definition = |i: &&IndexDef| {
                i.fields == wanted.fields && i.partial_filter_selector == wanted.partial_filter_selector
            };
            if let Some(existing) = catalog.indexes.iter().find(same_definition) {
                wanted.ddoc = existing.ddoc.clone();
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

fn design_id(ddoc: &str) -> String {
    if ddoc.starts_with("_design/") {
        ddoc.to_owned()
    } else {
        format!("_design/{ddoc}")
    }
}

/// Validates a `POST _index` body as CouchDB does (`mango_opts:validate_idx_create`): the
/// definition, and whether the request named its design document.
fn parse_index_request(request: &Value) -> Result<(IndexDef, bool), MangoError> {
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
    // CouchDB names an unnamed index after a hash of its definition; so does this server (with its
    // own hash, so the ids differ from CouchDB's but are just as stable).
    let digest = hex::encode(Sha256::digest(
        serde_json::to_vec(&json!({ "fields": fields_json(&fields), "partial": partial_filter_selector }))
            .unwrap_or_default(),
    ));
    let auto = &digest[..40];
    let name = optional_string(body, "name")?.unwrap_or(auto).to_owned();
    let given_ddoc = optional_string(body, "ddoc")?;
    let ddoc = design_id(given_ddoc.unwrap_or(auto));
    Ok((IndexDef { ddoc, name, fields, partial_filter_selector }, given_ddoc.is_some()))
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

/// An index's `fields`: names or `{name: "asc"|"desc"}`, one direction for all.
fn parse_index_fields(fields: Option<&Value>) -> Result<Vec<(String, String)>, MangoError> {
    let missing = || MangoError::bad_request("invalid_index", "Index is missing its definition.");
    let list = fields.and_then(Value::as_array).filter(|l| !l.is_empty()).ok_or_else(missing)?;
    let parsed = super::find::parse_sort(&Value::Array(list.clone()))?;
    Ok(parsed.fields.into_iter().map(|(path, _)| (join_field(&path), parsed.direction.clone())).collect())
}

/// Which index CouchDB would answer a query with, and the warnings that choice gives.
#[derive(Debug, Clone)]
pub struct IndexChoice<'a> {
    /// `None`: the special `_all_docs` index (a full scan, with CouchDB's warning).
    pub index: Option<&'a IndexDef>,
    /// `use_index` named an index that was not usable (CouchDB's warning text).
    pub warnings: Vec<String>,
}

impl IndexCatalog {
    /// CouchDB's choice among the indexes for `selector` and `sort` (field names), honouring
    /// `use_index` (`[ddoc]` or `[ddoc, name]`): no usable index for a sort is `no_usable_index`.
    pub fn choose(
        &self,
        selector: &Selector,
        sort: &[String],
        use_index: &[String],
        allow_fallback: bool,
    ) -> Result<IndexChoice<'_>, MangoError> {
        let usable: Vec<&IndexDef> = self
            .indexes
            .iter()
            .filter(|i| i.partial_filter_selector.is_none() && is_usable(i, selector, sort))
            .collect();
        let all_docs_usable = sort.is_empty() || sort == ["_id"];
        let mut warnings = Vec::new();
        if !use_index.is_empty() {
            let ddoc = design_id(&use_index[0]);
            let named = |i: &&IndexDef| i.ddoc == ddoc && use_index.get(1).is_none_or(|n| *n == i.name);
            let requested = self.indexes.iter().filter(named).find(|i| is_usable(i, selector, sort));
            if let Some(index) = requested {
                return Ok(IndexChoice { index: Some(index), warnings });
            }
            let shown = ddoc.trim_start_matches("_design/");
            let text = match use_index.get(1) {
                None => format!("_design/{shown} specified by `use_index` could not be found or it is not suitable."),
                Some(name) => format!(
                    "_design/{shown}, {name} specified by `use_index` could not be found or it is not suitable."
                ),
            };
            if !allow_fallback {
                return Err(MangoError::bad_request("invalid_index", text));
            }
            warnings.push(match use_index.get(1) {
                None => {
                    format!("_design/{shown} was not used because it does not contain a valid index for this query.")
                }
                Some(name) => {
                    format!("_design/{shown}, {name} was not used because it is not a valid index for this query.")
                }
            });
        }
        let best = usable
            .into_iter()
            .max_by(|a, b| rank(a, selector).cmp(&rank(b, selector)).then_with(|| b.name.cmp(&a.name)));
        match best {
            Some(index) => Ok(IndexChoice { index: Some(index), warnings }),
            None if all_docs_usable => Ok(IndexChoice { index: None, warnings }),
            None => Err(MangoError::bad_request(
                "no_usable_index",
                "No index exists for this sort, try indexing by the sort fields.",
            )),
        }
    }
}

/// CouchDB's preference among usable JSON indexes: more of the selector's fields covered, then
/// fewer columns.
fn rank(index: &IndexDef, selector: &Selector) -> (usize, std::cmp::Reverse<usize>) {
    let used = selector.field_names();
    let overlap = index.fields.iter().filter(|(f, _)| used.contains(f)).count();
    (overlap, std::cmp::Reverse(index.fields.len()))
}

/// CouchDB's `mango_idx_view:is_usable`: every column the sort does not supply is required by
/// the selector, and the sort can be read off the index's order.
fn is_usable(index: &IndexDef, selector: &Selector, sort: &[String]) -> bool {
    let columns = index.field_names();
    let required = columns.iter().filter(|c| !sort.contains(c) && *c != "_id" && *c != "_rev");
    let has_required = required.into_iter().all(|c| parse_field(c).is_ok_and(|path| selector.requires_field(&path)));
    has_required && can_use_sort(&columns, sort, selector)
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
/// 040). `mrargs` shows the key range CouchDB would read from the chosen index; this server
/// reads the backend instead (see docs/couchdb-api.md).
pub async fn explain(
    backend: &dyn DocumentBackend,
    request: &Value,
    db_name: &str,
    only_user: Option<&str>,
) -> Result<Value, MangoError> {
    let parsed = super::find::parse_request(request)?;
    let selector = super::find::restrict_to_user(parsed.selector.clone(), only_user);
    let catalog = IndexCatalog::load(backend).await?;
    let sort_names = parsed.sort_field_names();
    let choice = catalog.choose(&selector, &sort_names, &parsed.use_index, parsed.allow_fallback)?;
    let fields: Vec<Value> = parsed.fields.iter().map(|(_, name)| Value::String(name.clone())).collect();
    let sort: Map<String, Value> =
        parsed.sort.fields.iter().map(|(p, _)| (join_field(p), Value::String(parsed.sort.direction.clone()))).collect();
    let opts = json!({
        "use_index": parsed.use_index, "bookmark": parsed.bookmark.clone().unwrap_or_else(|| "nil".into()),
        "limit": parsed.limit, "skip": parsed.skip, "sort": sort, "fields": fields,
        "partition": "", "r": parsed.r, "conflicts": parsed.conflicts, "stale": parsed.stale, "update": parsed.update,
        "stable": parsed.stable, "execution_stats": parsed.execution_stats, "allow_fallback": parsed.allow_fallback,
    });
    let (index_json, candidates, mrargs) = match choice.index {
        Some(index) => {
            let mut candidates = vec![json!({ "index": all_docs_json(), "analysis": {
                "usable": true, "reasons": [{ "name": "unfavored_type" }], "ranking": 1, "covering": null } })];
            candidates.extend(catalog.indexes.iter().filter(|i| i.ddoc != index.ddoc || i.name != index.name).map(
                |other| {
                    let usable = is_usable(other, &selector, &sort_names);
                    let reason = if usable { "less_overlap" } else { "field_mismatch" };
                    json!({ "index": other.to_json(), "analysis": {
                    "usable": usable, "reasons": [{ "name": reason }], "ranking": 2, "covering": false } })
                },
            ));
            (index.to_json(), candidates, index_range(index, &selector, parsed.sort.direction == "desc"))
        }
        None => {
            let candidates = catalog
                .indexes
                .iter()
                .map(|other| {
                    json!({ "index": other.to_json(), "analysis": {
                    "usable": false, "reasons": [{ "name": "field_mismatch" }], "ranking": 2, "covering": false } })
                })
                .collect();
            let mrargs = json!({ "include_docs": true, "view_type": "map", "reduce": false, "partition": null,
                "start_key": null, "end_key": "<MAX>", "direction": "fwd", "stable": false, "update": true,
                "conflicts": "undefined" });
            (all_docs_json(), candidates, mrargs)
        }
    };
    let (indexable, unindexable) = selector_hints(&selector);
    Ok(json!({
        "dbname": db_name, "index": index_json, "partitioned": false, "selector": selector.to_json(), "opts": opts,
        "limit": parsed.limit, "skip": parsed.skip, "fields": fields, "index_candidates": candidates,
        "selector_hints": [{ "type": "json", "indexable_fields": indexable, "unindexable_fields": unindexable }],
        "mrargs": mrargs, "covering": false,
    }))
}

/// The key range CouchDB would read from a JSON index: the leading columns the selector fixes
/// with `$eq`, up to `<MAX>`.
fn index_range(index: &IndexDef, selector: &Selector, descending: bool) -> Value {
    let mut start = Vec::new();
    for (field, _) in &index.fields {
        let path = parse_field(field).unwrap_or_default();
        let path: Vec<&str> = path.iter().map(String::as_str).collect();
        match selector.required_equal(&path) {
            Some(value) => start.push(value.clone()),
            None => break,
        }
    }
    let mut end = start.clone();
    end.push(Value::String("<MAX>".into()));
    let (start_key, end_key) = if descending { (end, start) } else { (start, end) };
    json!({ "include_docs": true, "view_type": "map", "reduce": false, "partition": null,
        "start_key": start_key, "end_key": end_key, "direction": if descending { "rev" } else { "fwd" },
        "stable": false, "update": true, "conflicts": "undefined" })
}

/// The selector's fields a JSON index could serve (range and equality conditions) and the rest.
fn selector_hints(selector: &Selector) -> (Vec<String>, Vec<String>) {
    fn walk(selector: &Selector, indexable: &mut Vec<String>, other: &mut Vec<String>) {
        match selector {
            Selector::Field { path, cond } => {
                let rangeable = matches!(
                    cond,
                    Cond::Eq(_)
                        | Cond::Lt(_)
                        | Cond::Lte(_)
                        | Cond::Gt(_)
                        | Cond::Gte(_)
                        | Cond::BeginsWith(_)
                        | Cond::Exists(true)
                );
                if rangeable { indexable } else { other }.push(join_field(path));
            }
            Selector::And(arms) | Selector::Or(arms) | Selector::Nor(arms) => {
                arms.iter().for_each(|a| walk(a, indexable, other))
            }
            Selector::Not(inner) => walk(inner, other, &mut Vec::new()),
            Selector::MatchAll => {}
        }
    }
    let (mut indexable, mut other) = (Vec::new(), Vec::new());
    walk(selector, &mut indexable, &mut other);
    for list in [&mut indexable, &mut other] {
        list.sort();
        list.dedup();
    }
    other.retain(|f| !indexable.contains(f));
    (indexable, other)
}
