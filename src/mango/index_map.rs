//! The map of a Mango `json` index: a design document with `language: "query"`, whose views'
//! `map` is `{"fields": {field: direction, …}, "partial_filter_selector": {…}}`, mapped in Rust
//! as CouchDB's `mango_native_proc` maps it (no JavaScript).
//!
//! A document is indexed when it matches the view's `partial_filter_selector` (if any), is not a
//! design document, and has every indexed field: it emits one row, key = the fields' values in
//! the index's order, value = `null`. A document missing a field emits nothing, which is why a
//! JSON index can only serve a query that requires each of its fields.

use serde_json::{Map, Value};

use std::sync::Arc;

use async_trait::async_trait;

use super::eval::{field_value, matches};
use super::selector::{self, parse_field, Selector};
use crate::js::DocText;
use crate::views::design::{DesignViews, Language};
use crate::views::run::JsReducer;
use crate::views::service::ViewEngine;
use crate::views::updater::Mapper;
use crate::views::ViewError;

/// One view of a query design document, ready to map documents.
#[derive(Debug, Clone)]
pub struct JsonIndexMap {
    /// The indexed fields' paths, in the index's order.
    columns: Vec<Vec<String>>,
    /// `None`: every document is a candidate.
    partial_filter: Option<Selector>,
}

impl JsonIndexMap {
    /// Reads a view's `map` object; `None` when it is not a usable index definition (CouchDB
    /// logs such a view and leaves it out of its indexes; here it emits nothing).
    pub fn parse(map: &Value) -> Option<JsonIndexMap> {
        let fields = map.get("fields")?;
        let names: Vec<String> = match fields {
            Value::Object(fields) => fields.keys().cloned().collect(),
            // The list form (`["a", {"b": "asc"}]`) a definition is written with.
            Value::Array(items) => items
                .iter()
                .map(|item| match item {
                    Value::String(name) => Some(name.clone()),
                    Value::Object(one) if one.len() == 1 => one.keys().next().cloned(),
                    _ => None,
                })
                .collect::<Option<_>>()?,
            _ => return None,
        };
        let columns = names.iter().map(|name| parse_field(name).ok()).collect::<Option<Vec<_>>>()?;
        let partial_filter = match map.get("partial_filter_selector").or_else(|| map.get("selector")) {
            None | Some(Value::Null) => None,
            Some(Value::Object(selector)) if selector.is_empty() => None,
            Some(Value::Object(selector)) => Some(selector::parse(selector).ok()?),
            Some(_) => return None,
        };
        Some(JsonIndexMap { columns, partial_filter })
    }

    /// The row `doc` emits: its key, or `None` when it is not indexed.
    pub fn key(&self, doc: &Map<String, Value>) -> Option<Value> {
        let is_design = doc.get("_id").and_then(Value::as_str).is_some_and(|id| id.starts_with("_design/"));
        if is_design || self.partial_filter.as_ref().is_some_and(|filter| !matches(filter, doc)) {
            return None;
        }
        let values = self.columns.iter().map(|path| field_value(doc, path).cloned()).collect::<Option<Vec<_>>>()?;
        Some(Value::Array(values))
    }
}

/// The rows of each document for each view of `design` (a query design document), in the
/// shape [`super::updater::Mapper::map`] returns.
pub fn map_documents(design: &DesignViews, docs: &[Arc<DocText>]) -> Vec<Vec<Vec<(Value, Value)>>> {
    let maps: Vec<Option<JsonIndexMap>> = design.views.iter().map(|view| JsonIndexMap::parse(&view.map)).collect();
    docs.iter()
        .map(|doc| {
            maps.iter()
                .map(|map| match (map, doc.value().as_object()) {
                    (Some(map), Some(object)) => {
                        map.key(object).map(|key| vec![(key, Value::Null)]).unwrap_or_default()
                    }
                    _ => Vec::new(),
                })
                .collect()
        })
        .collect()
}

/// The functions of this server's design documents: query design documents (Mango indexes)
/// mapped here in Rust, every other one by the JavaScript engine `E`. The views module runs
/// whatever engine it is given; Mango's part is plugged in here, so views never depend on Mango.
pub struct WithMangoIndexes<E>(pub E);

#[async_trait]
impl<E: ViewEngine> Mapper for WithMangoIndexes<E> {
    async fn map(
        &self,
        design: &DesignViews,
        docs: Vec<Arc<DocText>>,
    ) -> Result<Vec<Vec<Vec<(Value, Value)>>>, ViewError> {
        match design.language {
            Language::Query => Ok(map_documents(design, &docs)),
            Language::JavaScript => self.0.map(design, docs).await,
        }
    }

    /// Query design documents are mapped inline, one call at a time.
    fn parallel_calls(&self, design: &DesignViews) -> usize {
        match design.language {
            Language::Query => 1,
            Language::JavaScript => self.0.parallel_calls(design),
        }
    }
}

#[async_trait]
impl<E: ViewEngine> JsReducer for WithMangoIndexes<E> {
    async fn reduce(&self, design: &DesignViews, view: &str, rows: Vec<(Value, Value)>) -> Result<Value, ViewError> {
        self.0.reduce(design, view, rows).await
    }

    async fn rereduce(&self, design: &DesignViews, view: &str, values: Vec<Value>) -> Result<Value, ViewError> {
        self.0.rereduce(design, view, values).await
    }
}

/// For tests: an engine that fails every call, so a test passing proves the JSON indexes were
/// mapped here and never reached JavaScript.
#[cfg(test)]
pub(crate) struct NoJavaScript;

#[cfg(test)]
fn no_javascript() -> ViewError {
    ViewError::Function { error: "no_javascript".into(), reason: "this test runs no JavaScript".into() }
}

#[cfg(test)]
#[async_trait]
impl Mapper for NoJavaScript {
    async fn map(&self, _: &DesignViews, _: Vec<Arc<DocText>>) -> Result<Vec<Vec<Vec<(Value, Value)>>>, ViewError> {
        Err(no_javascript())
    }
}

#[cfg(test)]
#[async_trait]
impl JsReducer for NoJavaScript {
    async fn reduce(&self, _: &DesignViews, _: &str, _: Vec<(Value, Value)>) -> Result<Value, ViewError> {
        Err(no_javascript())
    }
    async fn rereduce(&self, _: &DesignViews, _: &str, _: Vec<Value>) -> Result<Value, ViewError> {
        Err(no_javascript())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::sync::Arc;

    fn design(views: Value) -> DesignViews {
        DesignViews::parse(&json!({"_id": "_design/i", "language": "query", "views": views})).unwrap()
    }

    #[test]
    fn documents_with_every_field_emit_their_values_in_index_order() {
        let design = design(json!({"by_ab": {"map": {"fields": {"b": "asc", "a.x": "asc"}}, "reduce": "_count"}}));
        let docs: Vec<Arc<DocText>> = vec![
            Arc::new(json!({"_id": "1", "a": {"x": 1}, "b": "two"}).into()),
            Arc::new(json!({"_id": "2", "b": "only b"}).into()),
            Arc::new(json!({"_id": "3", "a": {"x": null}, "b": [1]}).into()),
            Arc::new(json!({"_id": "_design/d", "a": {"x": 1}, "b": 2}).into()),
        ];
        let rows = map_documents(&design, &docs);
        assert_eq!(rows[0], vec![vec![(json!(["two", 1]), Value::Null)]]);
        assert_eq!(rows[1], vec![Vec::<(Value, Value)>::new()], "a missing field emits nothing");
        assert_eq!(rows[2], vec![vec![(json!([[1], null]), Value::Null)]], "null is a value");
        assert_eq!(rows[3], vec![Vec::<(Value, Value)>::new()], "design documents are never indexed");
    }

    #[test]
    fn a_partial_filter_selector_decides_which_documents_are_indexed() {
        let design = design(json!({"p": {"map": {"fields": {"n": "asc"},
            "partial_filter_selector": {"type": {"$ne": "draft"}}}, "reduce": "_count"}}));
        let docs: Vec<Arc<DocText>> = vec![
            Arc::new(json!({"_id": "1", "n": 1, "type": "post"}).into()),
            Arc::new(json!({"_id": "2", "n": 2, "type": "draft"}).into()),
        ];
        let rows = map_documents(&design, &docs);
        assert_eq!(rows[0][0].len(), 1);
        assert!(rows[1][0].is_empty());
    }
}
