//! Documents in id order (`scan`, `all_docs`, design documents left out) and erasure by id
//! prefix.

use std::ops::Bound;

use redb::{Database, ReadableDatabase, ReadableTable};

use super::codec;
use super::core::{stored, DOCS};
use super::error::map_redb;
use super::write::Tables;
use crate::backend::{IdRange, Page, StoredDocument};
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
pub(super) fn id_ordered_page(
    docs: &impl ReadableTable<&'static str, &'static [u8]>,
    bounds: (Bound<&str>, Bound<&str>),
    descending: bool,
    include_design: bool,
    limit: usize,
) -> Result<Page<StoredDocument>> {
    let entries = docs.range::<&str>(bounds).map_err(map_redb("read documents"))?;
    let entries: Box<dyn Iterator<Item = _>> = if descending { Box::new(entries.rev()) } else { Box::new(entries) };
    let mut items = Vec::with_capacity(limit.min(1024));
    for entry in entries {
        let (id, stored_record) = entry.map_err(map_redb("read documents"))?;
        if !include_design && id.value().starts_with("_design/") {
            continue;
        }
        if items.len() == limit {
            let next = items.last().map(|d: &StoredDocument| d.id.clone());
            return Ok(Page { items, next });
        }
        let (header, body) = codec::decode(id.value(), stored_record.value())?;
        items.push(stored(id.value(), header, body));
    }
    Ok(Page { items, next: None })
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
pub(super) fn all_docs(
    db: &Database,
    range: &IdRange,
    after: Option<String>,
    limit: usize,
) -> Result<Page<StoredDocument>> {
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
