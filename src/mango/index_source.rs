//! A JSON index read as a `_find` source, on any database whose indexes this process builds: the
//! index's view group ([`crate::views`], mapped in Rust by [`super::index_map`]) brought
//! up to date over the database's feed (any [`ViewSource`]: another database, or the data-store
//! database), then read over the key range the selector gives, in key order (reversed for a
//! `desc` sort), each row's document read through [`RowDocs`].
//!
//! Where documents are read is the one thing that differs between the kinds of database, so it
//! is a trait: the other databases read winners from their revision trees
//! ([`super::database`]), the data-store database reads its backend ([`super::find`]).

use std::ops::ControlFlow;
use std::sync::Arc;

use async_trait::async_trait;
use http::StatusCode;
use serde_json::{json, Map, Value};

use super::find::{Candidate, CandidatePage, FindSource, SCAN_PAGE};
use super::index::IndexDef;
use super::request::FindRequest;
use super::MangoError;
use crate::views::design::DesignViews;
use crate::views::index_store::{IndexStore, RowRange};
use crate::views::query::{Plan, ViewQuery};
use crate::views::service::Views;
use crate::views::updater::FeedRead;
use crate::views::ViewSource;

/// The fewest index rows one read of a JSON index takes.
const MIN_VIEW_PAGE: usize = 25;

/// Reads the documents an index's rows name.
#[async_trait]
pub trait RowDocs: Send + Sync {
    /// The documents with these ids as a selector sees them (`_id`, `_rev`, the body), in the
    /// order asked; `None` for one that is deleted or missing (a row read before its deletion
    /// reached the index), and for design and local documents, which `_find` never returns.
    async fn read(&self, ids: &[String]) -> Result<Vec<Option<Map<String, Value>>>, MangoError>;
}

/// The index `index` of `design` (its group) over `source`, opened for `request`: brought up to
/// date first unless the request reads it as it is (`update: false`, `stale: "ok"`), as
/// CouchDB does, so a query sees every write acknowledged before it.
pub async fn open<'a>(
    views: &Views,
    source: &dyn ViewSource,
    design: &DesignViews,
    index: &IndexDef,
    request: &FindRequest,
    docs: Box<dyn RowDocs + 'a>,
) -> Result<IndexSource<'a>, MangoError> {
    let (view, _) = design.view(&index.name).ok_or_else(|| {
        MangoError::new(StatusCode::INTERNAL_SERVER_ERROR, "unknown_error", "an index without its view")
    })?;
    let indexer = views.indexer().await.map_err(MangoError::View)?;
    let group = if request.update && !request.stale {
        indexer.catch_up(source, design).await
    } else {
        indexer.current(source, design).await
    }
    .map_err(MangoError::View)?;
    let (start, end) = super::range::key_range(&index.field_names(), &request.selector, &max_key());
    Ok(IndexSource {
        docs,
        feed_read: group.feed_read.clone().map(|read| (group.name.clone(), read, group.state.checkpoint.clone())),
        store: Arc::clone(indexer.store()),
        group: group.state.number,
        view,
        tag: format!("view:{}:{}", index.ddoc, index.name),
        start,
        end,
        descending: request.sort.direction == "desc",
    })
}

/// A key above every key a JSON index holds (CouchDB's `?MAX_JSON_OBJ`): objects sort after
/// every other type, and this key after any other object's first key.
fn max_key() -> Value {
    json!({ "\u{10FFFF}": null })
}

/// A JSON index's rows over the query's key range, each row's document read through `docs`.
pub struct IndexSource<'a> {
    docs: Box<dyn RowDocs + 'a>,
    /// The group's name, what its catch-up read of the feed, and the checkpoint it reached
    /// (`None` when the index was read as it is).
    feed_read: Option<(String, FeedRead, Option<String>)>,
    store: Arc<IndexStore>,
    group: u64,
    view: usize,
    tag: String,
    start: Vec<Value>,
    end: Vec<Value>,
    descending: bool,
}

impl IndexSource<'_> {
    /// What bringing the index up to date read of the feed (`None`: it was read as it is), with
    /// the group's name and the checkpoint it reached.
    pub fn feed_read(&self) -> Option<(&str, &FeedRead, Option<&str>)> {
        self.feed_read.as_ref().map(|(name, read, reached)| (name.as_str(), read, reached.as_deref()))
    }

    /// The row range from `after` (a row's key and id: continue past it) or the range's start.
    fn range(&self, after: Option<(&Value, &str)>) -> Option<RowRange> {
        let (low, high) = (Value::Array(self.start.clone()), Value::Array(self.end.clone()));
        let mut query = ViewQuery { descending: self.descending, ..ViewQuery::default() };
        let (first, last) = if self.descending { (high, low) } else { (low, high) };
        match after {
            Some((key, id)) => {
                query.start_key = Some(key.clone());
                query.start_docid = Some(id.to_owned());
            }
            None => query.start_key = Some(first),
        }
        query.end_key = Some(last);
        match query.plan(false) {
            Ok(Plan::Map { mut ranges }) if ranges.len() == 1 => ranges.pop(),
            // A start past the end: nothing left to read.
            _ => None,
        }
    }
}

#[async_trait]
impl FindSource for IndexSource<'_> {
    fn tag(&self) -> String {
        self.tag.clone()
    }

    fn serves_sort(&self) -> bool {
        // A chosen index can serve the sort (`mango_idx_view:is_usable` checked it): its columns
        // before the sort's are fixed by `$eq`, so its order is the sort's.
        true
    }

    async fn read(&self, from: Option<&Value>, wanted: usize) -> Result<CandidatePage, MangoError> {
        let after = match from {
            None => None,
            Some(position) => match (position.get("key"), position.get("id").and_then(Value::as_str)) {
                (Some(key), Some(id)) => Some((key.clone(), id.to_owned())),
                _ => return Err(super::request::invalid_bookmark(&Value::String("(another scan's position)".into()))),
            },
        };
        let Some(range) = self.range(after.as_ref().map(|(key, id)| (key, id.as_str()))) else {
            return Ok(CandidatePage { items: Vec::new(), next: None });
        };
        let (store, group, view, descending) = (Arc::clone(&self.store), self.group, self.view, self.descending);
        // Small pages for a small `limit`, but not so small that a selective filter costs many
        // round trips.
        let wanted = wanted.clamp(MIN_VIEW_PAGE, SCAN_PAGE) + usize::from(after.is_some());
        let rows = tokio::task::spawn_blocking(move || {
            let mut rows = Vec::new();
            store
                .scan(group, view, &range, descending, |row| {
                    rows.push(row);
                    if rows.len() >= wanted {
                        ControlFlow::Break(())
                    } else {
                        ControlFlow::Continue(())
                    }
                })
                .map(|()| rows)
        })
        .await
        .map_err(|err| MangoError::new(StatusCode::INTERNAL_SERVER_ERROR, "unknown_error", err.to_string()))??;
        let full = rows.len() >= wanted;
        let mut rows = rows;
        // The range starts at the row the position names: it was answered already.
        if let Some((key, id)) = &after {
            if rows.first().is_some_and(|row| row.id == *id && row.key == *key) {
                rows.remove(0);
            }
        }
        let next = match (full, rows.last()) {
            (true, Some(last)) => Some(json!({ "key": last.key, "id": last.id })),
            _ => None,
        };
        let ids: Vec<String> = rows.iter().map(|row| row.id.clone()).collect();
        let docs = self.docs.read(&ids).await?;
        let mut items = Vec::with_capacity(rows.len());
        for (row, doc) in rows.iter().zip(docs) {
            // A document deleted since the index was read is no longer a match.
            let Some(doc) = doc else { continue };
            items.push(Candidate { id: row.id.clone(), doc, after: json!({ "key": row.key, "id": row.id }) });
        }
        Ok(CandidatePage { items, next })
    }

    async fn fetch(&self, ids: &[String]) -> Result<Vec<Map<String, Value>>, MangoError> {
        let mut docs = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(SCAN_PAGE) {
            docs.extend(self.docs.read(chunk).await?.into_iter().flatten());
        }
        Ok(docs)
    }
}
