//! `_local/` documents (replication checkpoints): the `local` table, keyed by name, revision
//! `0-N`; listed in name order by a range of that table.

use redb::{Database, ReadTransaction, ReadableDatabase, ReadableTable};
use serde_json::{Map, Value};

use super::core::LOCAL;
use super::error::map_redb;
use super::ids::page_bounds;
use super::write::Tables;
use crate::backend::revision::{local_number, local_revision, next_local_revision};
use crate::backend::{IdRange, Page, Precondition, Revision, StoredDocument, LOCAL_PREFIX};
use crate::error::{Error, ErrorKind, Result};

/// A local document's record: its revision number, then the JSON body.
pub(super) fn encode_local(n: u64, json: &[u8]) -> Vec<u8> {
    let mut record = Vec::with_capacity(8 + json.len());
    record.extend_from_slice(&n.to_be_bytes());
    record.extend_from_slice(json);
    record
}

pub(super) fn decode_local(name: &str, record: &[u8]) -> Result<(u64, Map<String, Value>)> {
    let corrupt = || Error::new(ErrorKind::Corrupt, format!("embedded store: local document {name:?} is damaged"));
    let (n, json) = record.split_at_checked(8).ok_or_else(corrupt)?;
    let n = u64::from_be_bytes(n.try_into().map_err(|_| corrupt())?);
    Ok((n, crate::model::depth::parse_stored(json).map_err(|_| corrupt())?))
}

/// The local document `name`.
pub(super) fn get(db: &Database, name: &str) -> Result<Option<StoredDocument>> {
    let txn = db.begin_read().map_err(map_redb("begin read"))?;
    get_in(&txn, name)
}

/// The local document `name`, read in the transaction `txn`.
pub(super) fn get_in(txn: &ReadTransaction, name: &str) -> Result<Option<StoredDocument>> {
    let local = txn.open_table(LOCAL).map_err(map_redb("open local table"))?;
    let Some(guard) = local.get(name).map_err(map_redb("read local document"))? else {
        return Ok(None);
    };
    let (n, body) = decode_local(name, guard.value())?;
    Ok(Some(StoredDocument { id: format!("{LOCAL_PREFIX}{name}"), rev: local_revision(n), body }))
}

/// The local documents `names`, in one read transaction (one consistent snapshot).
pub(super) fn get_many(db: &Database, names: &[String]) -> Result<Vec<Option<StoredDocument>>> {
    let txn = db.begin_read().map_err(map_redb("begin read"))?;
    let local = txn.open_table(LOCAL).map_err(map_redb("open local table"))?;
    let mut found = Vec::with_capacity(names.len());
    for name in names {
        let doc = match local.get(name.as_str()).map_err(map_redb("read local document"))? {
            Some(guard) => {
                let (n, body) = decode_local(name, guard.value())?;
                Some(StoredDocument { id: format!("{LOCAL_PREFIX}{name}"), rev: local_revision(n), body })
            }
            None => None,
        };
        found.push(doc);
    }
    Ok(found)
}

/// One page of local documents whose names lie in `range`, after the name `after`: one range read
/// of the `local` table, so its cost is the page's.
pub(super) fn list(
    db: &Database,
    range: &IdRange,
    after: Option<String>,
    limit: usize,
) -> Result<Page<StoredDocument>> {
    let txn = db.begin_read().map_err(map_redb("begin read"))?;
    let local = txn.open_table(LOCAL).map_err(map_redb("open local table"))?;
    let Some(bounds) = page_bounds(range, after.as_deref()) else {
        return Ok(Page { items: Vec::new(), next: None });
    };
    let entries = local.range::<&str>(bounds).map_err(map_redb("read local documents"))?;
    let entries: Box<dyn Iterator<Item = _>> =
        if range.descending { Box::new(entries.rev()) } else { Box::new(entries) };
    let mut items = Vec::with_capacity(limit.min(1024));
    for entry in entries {
        let (name, record) = entry.map_err(map_redb("read local documents"))?;
        if items.len() == limit {
            let next = items.last().map(|doc: &StoredDocument| doc.id[LOCAL_PREFIX.len()..].to_owned());
            return Ok(Page { items, next });
        }
        let (n, body) = decode_local(name.value(), record.value())?;
        items.push(StoredDocument { id: format!("{LOCAL_PREFIX}{}", name.value()), rev: local_revision(n), body });
    }
    Ok(Page { items, next: None })
}

/// Writes the local document `name` (its body encoded as `json`) if `precondition` holds.
pub(super) fn put(tables: &mut Tables<'_>, name: &str, json: &[u8], precondition: &Precondition) -> Result<Revision> {
    let current = match tables.local.get(name).map_err(map_redb("read local document"))? {
        Some(guard) => Some(decode_local(name, guard.value())?.0),
        None => None,
    };
    let id = format!("{LOCAL_PREFIX}{name}");
    let rev = next_local_revision(&id, precondition, current.map(local_revision).as_ref())?;
    let n = local_number(&rev).unwrap_or(1);
    tables.local.insert(name, encode_local(n, json).as_slice()).map_err(map_redb("write local"))?;
    Ok(rev)
}

/// Deletes the local document `name` if it is at `expected`.
pub(super) fn delete(tables: &mut Tables<'_>, name: &str, expected: &Revision) -> Result<()> {
    let current = match tables.local.get(name).map_err(map_redb("read local document"))? {
        Some(guard) => decode_local(name, guard.value())?.0,
        None => return Err(Error::not_found(format!("document \"{LOCAL_PREFIX}{name}\" does not exist"))),
    };
    if local_revision(current) != *expected {
        return Err(Error::conflict(format!(
            "document \"{LOCAL_PREFIX}{name}\" is at revision 0-{current}, not {expected}"
        )));
    }
    tables.local.remove(name).map_err(map_redb("delete local document"))?;
    Ok(())
}
