//! What the backend groups share: the round-trip value corpus through the facade, and the keys
//! written and read back in pages by their listing trials.

use agentstore::store::DataStore;
use agentstore::ErrorKind;
use futures::TryStreamExt;
use serde_json::json;

use crate::common::json::{first_difference, survives_f64};

/// Writes every corpus value with `set` and reads it back with `get`; what came back changed
/// (compared by exact decimal value), as `name: what differs` lines. `exact`: whether the server
/// keeps numbers beyond double precision; when it does not, those values must be refused as
/// invalid input (never stored altered), and they are left out of the comparison.
pub async fn differences(store: &DataStore, exact: bool) -> Result<Vec<String>, String> {
    let mut failures = Vec::new();
    for case in &crate::common::corpus::cases() {
        let written = store.set("corpus", "values", &case.name, case.value.clone(), None, Some("container-test")).await;
        if !exact && !survives_f64(&case.value) {
            match written {
                Err(e) if e.kind() == ErrorKind::InvalidInput => {}
                Err(e) => failures.push(format!("{}: refused, but as {:?}: {e}", case.name, e.kind())),
                Ok(_) => failures.push(format!("{}: accepted by a server that stores JS doubles", case.name)),
            }
            continue;
        }
        let written = written.map_err(|e| format!("set {}: {e}", case.name))?;
        if let Some(diff) = first_difference(&case.value, &written.body["value"]) {
            failures.push(format!("{}: set returned {diff}", case.name));
        }
        let read = store
            .get("corpus", "values", &case.name, None)
            .await
            .map_err(|e| format!("get {}: {e}", case.name))?
            .ok_or_else(|| format!("get {}: not found after set", case.name))?;
        if let Some(diff) = first_difference(&case.value, &read.body["value"]) {
            failures.push(format!("{}: read back {diff}", case.name));
        }
    }
    Ok(failures)
}

/// The keys `key-00` … written for `user_p` in namespace `paging` (each holding its own name), and
/// `others` keys `other-N` of `user_q` in the same namespace, which listings must leave out.
pub async fn write_paging_keys(store: &DataStore, count: usize, others: usize) -> Result<Vec<String>, String> {
    let keys: Vec<String> = (0..count).map(|i| format!("key-{i:02}")).collect();
    for key in &keys {
        store.set("user_p", "paging", key, json!(key), None, None).await.map_err(|e| format!("set {key}: {e}"))?;
    }
    for i in 0..others {
        store.set("user_q", "paging", &format!("other-{i}"), json!(i), None, None).await.map_err(|e| e.to_string())?;
    }
    Ok(keys)
}

/// `user_p`'s `paging` keys through `list_keys_pages`, checked to come in pages of at most
/// `page_size` that add up to `total`, at least `total / page_size` of them.
pub async fn pages_checked(store: &DataStore, page_size: usize, total: usize) -> Result<Vec<Vec<String>>, String> {
    let pages: Vec<Vec<String>> = store
        .list_keys_pages("user_p", "paging")
        .map_err(|e| e.to_string())?
        .try_collect()
        .await
        .map_err(|e| format!("list_keys_pages: {e}"))?;
    let sizes: Vec<usize> = pages.iter().map(Vec::len).collect();
    let fits = sizes.iter().all(|n| *n <= page_size) && sizes.iter().sum::<usize>() == total;
    crate::harness::check(fits && sizes.len() >= total / page_size, || {
        format!("page sizes {sizes:?} (page_size {page_size}, {total} keys)")
    })?;
    Ok(pages)
}
