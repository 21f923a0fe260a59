//! A design document's views as the index builds them: each view's map and reduce, the options
//! that change what is indexed, and the group's signature.
//!
//! All views of one design document are one *group*, indexed together in one pass over the
//! change feed (as CouchDB does). The signature is a SHA-256 over everything that changes the
//! rows (language, options, every view's map and reduce, `views.lib`), so editing any of it
//! starts a new index, while saving the design document unchanged, or changing its other fields
//! (`validate_doc_update`, `filters`, attachments), keeps the index.

use std::sync::Arc;

use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use super::builtin_reduce::Builtin;

/// The language of a design document's functions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Language {
    JavaScript,
    /// Mango's `json` indexes: a map over named fields, run in Rust.
    Query,
}

/// A view's reduce function.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReduceFn {
    Builtin(Builtin),
    JavaScript(String),
}

/// One view of a design document.
#[derive(Debug, Clone, PartialEq)]
pub struct ViewSpec {
    pub name: String,
    /// The map function's source (JavaScript), or the Mango index definition (`Query`).
    pub map: Value,
    pub reduce: Option<ReduceFn>,
}

/// The views of a design document.
#[derive(Debug, Clone)]
pub struct DesignViews {
    pub id: String,
    pub rev: String,
    pub language: Language,
    /// Every view, sorted by name: a view's number in the index is its place here.
    pub views: Vec<ViewSpec>,
    /// `options.include_design`: design documents are mapped too.
    pub include_design: bool,
    /// `options.local_seq`: documents are mapped with `_local_seq`.
    pub local_seq: bool,
    pub signature: String,
    /// The whole design document, for the JavaScript engine (`require` reads its modules).
    pub doc: Arc<Value>,
    /// The database the design document is in ([`DesignViews::in_database`]): its functions
    /// run in a realm of that database's own. `None` until set; the JavaScript engine refuses
    /// to run a design document whose database it does not know.
    pub database: Option<String>,
}

/// Why a design document's views cannot be built: CouchDB's `invalid_design_doc` reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidDesign(pub String);

impl DesignViews {
    /// Reads the views of the design document `doc` (its `_id` and `_rev` included).
    pub fn parse(doc: &Value) -> Result<DesignViews, InvalidDesign> {
        let invalid = |reason: String| InvalidDesign(reason);
        let object = doc.as_object().ok_or_else(|| invalid("a design document must be an object".into()))?;
        let id = object.get("_id").and_then(Value::as_str).unwrap_or_default().to_owned();
        let rev = object.get("_rev").and_then(Value::as_str).unwrap_or_default().to_owned();
        let language = match object.get("language") {
            None | Some(Value::Null) => Language::JavaScript,
            Some(Value::String(name)) if name == "javascript" => Language::JavaScript,
            Some(Value::String(name)) if name == "query" => Language::Query,
            Some(Value::String(name)) => return Err(invalid(format!("unsupported language `{name}`"))),
            Some(_) => return Err(invalid("`language` must be a string".into())),
        };
        let empty = Map::new();
        let views_field = match object.get("views") {
            None | Some(Value::Null) => &empty,
            Some(Value::Object(views)) => views,
            Some(_) => return Err(invalid("`views` is not an object".into())),
        };
        let mut views = Vec::new();
        for (name, view) in views_field {
            if name == "lib" && language == Language::JavaScript {
                continue;
            }
            views.push(parse_view(name, view, language)?);
        }
        views.sort_by(|a, b| a.name.cmp(&b.name));
        let options = object.get("options").and_then(Value::as_object);
        let flag = |name: &str| options.and_then(|o| o.get(name)).and_then(Value::as_bool).unwrap_or(false);
        let include_design = flag("include_design");
        let local_seq = flag("local_seq");
        let lib = views_field.get("lib").cloned().unwrap_or(Value::Null);
        let signature = signature(language, &views, include_design, local_seq, &lib);
        Ok(DesignViews {
            id,
            rev,
            language,
            views,
            include_design,
            local_seq,
            signature,
            doc: Arc::new(doc.clone()),
            database: None,
        })
    }

    /// The same design document, known to be in the database `name`.
    pub fn in_database(mut self, name: &str) -> Self {
        self.database = Some(name.to_owned());
        self
    }

    /// The view named `name` and its number, if the design document has it.
    pub fn view(&self, name: &str) -> Option<(usize, &ViewSpec)> {
        self.views.iter().enumerate().find(|(_, view)| view.name == name)
    }

    pub fn view_names(&self) -> Vec<String> {
        self.views.iter().map(|view| view.name.clone()).collect()
    }
}

fn parse_view(name: &str, view: &Value, language: Language) -> Result<ViewSpec, InvalidDesign> {
    let invalid = |reason: String| InvalidDesign(reason);
    let view = view.as_object().ok_or_else(|| invalid(format!("View {name} must be an object")))?;
    let map = match (view.get("map"), language) {
        (Some(Value::String(source)), Language::JavaScript) => Value::String(source.clone()),
        (Some(map @ Value::Object(_)), Language::Query) => map.clone(),
        (Some(_), Language::JavaScript) => return Err(invalid(format!("`map` in {name} must be a string"))),
        (Some(_), Language::Query) => return Err(invalid(format!("`map` in {name} must be an object"))),
        (None, _) => return Err(invalid(format!("View {name} must have a map function"))),
    };
    let reduce = match view.get("reduce") {
        None | Some(Value::Null) => None,
        Some(Value::String(source)) => match Builtin::parse(source) {
            Some(Ok(builtin)) => Some(ReduceFn::Builtin(builtin)),
            Some(Err(reason)) => return Err(invalid(reason)),
            None if language == Language::Query => {
                return Err(invalid(format!("`reduce` in {name} must be a built-in")))
            }
            None => Some(ReduceFn::JavaScript(source.clone())),
        },
        Some(_) => return Err(invalid(format!("`reduce` in {name} must be a string"))),
    };
    Ok(ViewSpec { name: name.to_owned(), map, reduce })
}

fn signature(language: Language, views: &[ViewSpec], include_design: bool, local_seq: bool, lib: &Value) -> String {
    let views: Vec<Value> = views
        .iter()
        .map(|view| {
            let reduce = match &view.reduce {
                None => Value::Null,
                Some(ReduceFn::Builtin(builtin)) => json!(format!("{builtin:?}")),
                Some(ReduceFn::JavaScript(source)) => json!(source),
            };
            json!([view.name, view.map, reduce])
        })
        .collect();
    let described = json!([language == Language::Query, include_design, local_seq, views, lib]);
    let digest = Sha256::digest(described.to_string().as_bytes());
    digest.iter().map(|byte| format!("{byte:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_parse_sorted_with_their_reduces() {
        let ddoc = json!({
            "_id": "_design/app", "_rev": "1-a",
            "views": {
                "by_type": {"map": "function(doc){ emit(doc.type, 1); }", "reduce": "_count"},
                "all": {"map": "function(doc){ emit(doc._id); }"},
                "total": {"map": "function(doc){ emit(null, doc.n); }", "reduce": "function(k, v, re) { return sum(v); }"},
                "lib": {"util": "exports.x = 1;"}
            }
        });
        let design = DesignViews::parse(&ddoc).unwrap();
        assert_eq!(design.view_names(), ["all", "by_type", "total"]);
        assert_eq!(design.views[1].reduce, Some(ReduceFn::Builtin(Builtin::Count)));
        assert!(matches!(design.views[2].reduce, Some(ReduceFn::JavaScript(_))));
        assert_eq!(design.view("total").map(|(n, _)| n), Some(2));
    }

    #[test]
    fn the_signature_follows_what_changes_the_rows() {
        let base = json!({"_id": "_design/a", "_rev": "1-a", "views": {"v": {"map": "function(d){emit(1)}"}}});
        let same_rows = json!({"_id": "_design/a", "_rev": "2-b", "views": {"v": {"map": "function(d){emit(1)}"}},
            "validate_doc_update": "function(){}"});
        let other_map = json!({"_id": "_design/a", "_rev": "3-c", "views": {"v": {"map": "function(d){emit(2)}"}}});
        let with_lib = json!({"_id": "_design/a", "_rev": "4-d", "views": {"v": {"map": "function(d){emit(1)}"}, "lib": {"m": "x"}}});
        let signature = |doc: &Value| DesignViews::parse(doc).unwrap().signature;
        assert_eq!(signature(&base), signature(&same_rows));
        assert_ne!(signature(&base), signature(&other_map));
        assert_ne!(signature(&base), signature(&with_lib));
    }

    #[test]
    fn invalid_views_are_refused() {
        let refused = |views: Value| DesignViews::parse(&json!({"_id": "_design/x", "views": views})).unwrap_err();
        refused(json!({"v": {"reduce": "_sum"}}));
        refused(json!({"v": {"map": 1}}));
        refused(json!({"v": {"map": "function(d){}", "reduce": "_median"}}));
        refused(json!([1]));
        assert!(DesignViews::parse(&json!({"_id": "_design/x", "language": "python"})).is_err());
    }
}
