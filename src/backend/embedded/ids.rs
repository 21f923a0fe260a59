//! Documents in id order (`scan`, `all_docs`, design documents left out), records as stored text
//! (`get_many_text`, and `all_docs` of [`StoredText`]: the bodies unparsed) and erasure by id
//! prefix.

use std::ops::Bound;

use redb::{Database, ReadableDatabase, ReadableTable};

use super::codec;
use super::core::{stored, DOCS};
use super::error::map_redb;
use super::write::Tables;
use crate::backend::{IdRange, Page, StoredDocument, StoredText};
use crate::error::Result;

/// Documents one erasure transaction removes at most, so a large erasure does not hold the write
/// lock for long.
pub(super) const ERASE_BATCH: usize = 1_000;

/// The id bounds of an `all_docs` page, ascending: (lower, upper).
pub(super) fn all_docs_bounds<'a>(range: &'a IdRange, after: Option<&'a str>) -> (Bound<&'a str>, Bound<&'a str>) {
    let end_bound = |id: &'a str| if range.inclusive_end { Bound::Included(id) } else { Bound::Excluded(id) };
    let (start, end) = (range.start.as_deref(), range.end.as_deref());
    let from = match (after, start) {
        (Some(after), _) => Bound::Excluded(after),
        (None, Some(start)) => Bound::Included(start),
        (None, None) => Bound::Unbounded,
    };
    let to = end.map_or(Bound::Unbounded, end_bound);
    if range.descending {
        (to, from)
    } else {
        (from, to)
    }
}

/// The bounds of a page of `range` after `after`, ascending; `None` when nothing lies between
/// them.
pub(super) fn page_bounds<'a>(range: &'a IdRange, after: Option<&'a str>) -> Option<(Bound<&'a str>, Bound<&'a str>)> {
    let (lower, upper) = all_docs_bounds(range, after);
    (!is_empty_range(&lower, &upper)).then_some((lower, upper))
}

/// Whether `(lower, upper)` is an empty range (redb panics on a range whose start is past its end).
pub(super) fn is_empty_range(lower: &Bound<&str>, upper: &Bound<&str>) -> bool {
    match (lower, upper) {
        (Bound::Included(l), Bound::Included(u)) => l > u,
        (Bound::Included(l) | Bound::Excluded(l), Bound::Excluded(u)) | (Bound::Excluded(l), Bound::Included(u)) => {
            l >= u
        }
        _ => false,
    }
}

/// One page of live documents in id order between `bounds` (design documents skipped unless
/// `include_design`), and the
/// id to continue after.
pub(super) fn id_ordered_page<T: Listed>(
    docs: &impl ReadableTable<super::core::IdKey, &'static [u8]>,
    bounds: (Bound<&str>, Bound<&str>),
    descending: bool,
    include_design: bool,
    limit: usize,
) -> Result<Page<T>> {
    let entries = docs.range::<&str>(bounds).map_err(map_redb("read documents"))?;
    let entries: Box<dyn Iterator<Item = _>> = if descending { Box::new(entries.rev()) } else { Box::new(entries) };
    let mut items = Vec::with_capacity(limit.min(1024));
    for entry in entries {
        let (id, stored_record) = entry.map_err(map_redb("read documents"))?;
        if !include_design && id.value().starts_with("_design/") {
            continue;
        }
        if items.len() == limit {
            let next = items.last().map(|d: &T| d.id().to_owned());
            return Ok(Page { items, next });
        }
        items.push(T::of_record(id.value(), stored_record.value())?);
    }
    Ok(Page { items, next: None })
}

/// [`super::core::get_many`] with each body as the JSON text stored, unparsed.
pub(super) fn get_many_text(db: &Database, ids: &[String]) -> Result<Vec<Option<StoredText>>> {
    let txn = db.begin_read().map_err(map_redb("begin read"))?;
    let docs = txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
    let mut found = Vec::with_capacity(ids.len());
    for id in ids {
        let doc = match docs.get(id.as_str()).map_err(map_redb("read document"))? {
            Some(guard) => Some(StoredText::of_record(id, guard.value())?),
            None => None,
        };
        found.push(doc);
    }
    Ok(found)
}

/// What a listing makes of each record: the document parsed, or its body's text as stored.
pub(super) trait Listed: Sized {
    fn of_record(id: &str, record: &[u8]) -> Result<Self>;
    fn id(&self) -> &str;
}

impl Listed for StoredDocument {
    fn of_record(id: &str, record: &[u8]) -> Result<Self> {
        let (header, body) = codec::decode(id, record)?;
        Ok(stored(id, header, body))
    }

    fn id(&self) -> &str {
        &self.id
    }
}

impl Listed for StoredText {
    fn of_record(id: &str, record: &[u8]) -> Result<Self> {
        let (header, json) = codec::split(id, record)?;
        Ok(StoredText { id: id.to_owned(), rev: header.rev.to_revision(), json: json.to_vec() })
    }

    fn id(&self) -> &str {
        &self.id
    }
}

/// One page of live documents in id order after the id `after`.
pub(super) fn scan(db: &Database, after: Option<String>, limit: usize) -> Result<Page<StoredDocument>> {
    let txn = db.begin_read().map_err(map_redb("begin read"))?;
    let docs = txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
    let lower = match &after {
        Some(id) => Bound::Excluded(id.as_str()),
        None => Bound::Unbounded,
    };
    id_ordered_page(&docs, (lower, Bound::Unbounded), false, false, limit)
}

/// One page of `all_docs` over `range`, after the id `after`.
pub(super) fn all_docs<T: Listed>(
    db: &Database,
    range: &IdRange,
    after: Option<String>,
    limit: usize,
) -> Result<Page<T>> {
    let txn = db.begin_read().map_err(map_redb("begin read"))?;
    let docs = txn.open_table(DOCS).map_err(map_redb("open docs table"))?;
    let Some(bounds) = page_bounds(range, after.as_deref()) else {
        return Ok(Page { items: Vec::new(), next: None });
    };
    id_ordered_page(&docs, bounds, range.descending, range.include_design, limit)
}

/// Erases up to [`ERASE_BATCH`] documents and tombstones whose ids start with `prefix`; how many.
pub(super) fn erase_batch(tables: &mut Tables<'_>, prefix: &str) -> Result<u64> {
    let mut ids = Vec::new();
    for table in [&tables.docs, &tables.tombstones] {
        for entry in table.range::<&str>(prefix..).map_err(map_redb("find documents"))? {
            let (id, _) = entry.map_err(map_redb("find documents"))?;
            if !id.value().starts_with(prefix) || ids.len() >= ERASE_BATCH {
                break;
            }
            ids.push(id.value().to_owned());
        }
    }
    let mut count = 0;
    for id in &ids {
        count += u64::from(tables.erase(id, None)?);
    }
    Ok(count)
}
