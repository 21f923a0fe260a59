//! A database's information (`GET /{db}`, `_dbs_info`) in CouchDB 3's shape, and the data-store
//! database's as each login is shown it: an admin everything; a per-user login `doc_count` 0
//! (the count moves with every user's writes, and counting its own documents would read them
//! all: docs/couchdb-api.md, "Counts") and its `update_seq` sealed ([`super::super::position_seal`]).

use serde_json::{json, Value};

use crate::couchdb_api::CouchState;

/// The data-store database's information as a login confined to `confinement` is shown it
/// (`GET /{db}`): everything for an admin ([`data_store_info`]); for a
/// per-user login `doc_count` 0 and `update_seq` sealed.
pub(crate) async fn data_store_info_seen_by(
    state: &CouchState,
    confinement: &crate::database::data_store_rules::Confinement,
) -> crate::Result<Value> {
    if confinement.only_user().is_none() {
        return data_store_info(state).await;
    }
    let update_seq = state.store.backend().change_position().await?;
    let update_seq = state.auth.sessions.positions().shown_to(confinement, &update_seq)?;
    Ok(db_info_json(&state.db, 0, &update_seq))
}

/// The data-store database's information (`GET /{db}`, `_dbs_info`).
pub(crate) async fn data_store_info(state: &CouchState) -> crate::Result<Value> {
    let backend = state.store.backend();
    // The design documents are records of the data-store database, counted with the others as
    // CouchDB counts them (fixture 051: 41 documents and 2 design documents are `doc_count` 43).
    let doc_count = live_document_count(backend.as_ref()).await?;
    let update_seq = backend.change_position().await?;
    Ok(db_info_json(&state.db, doc_count, &update_seq))
}

/// A database's information in CouchDB 3's shape (`GET /{db}`): the fields every client reads,
/// the sizes and counts this server does not keep as 0.
pub(crate) fn db_info_json(name: &str, doc_count: u64, update_seq: &str) -> Value {
    json!({
        "db_name": name,
        "purge_seq": "0",
        "update_seq": update_seq,
        "sizes": { "file": 0, "external": 0, "active": 0 },
        "props": {},
        "doc_del_count": 0,
        "doc_count": doc_count,
        "disk_format_version": 8,
        "compact_running": false,
        "cluster": { "q": 1, "n": 1, "w": 1, "r": 1 },
        "instance_start_time": "0"
    })
}

/// How many data documents the store holds: exact where the backend counts without reading
/// (its design documents left out, as `_all_docs` leaves them out), else the backend's estimate
/// (DynamoDB's item count, some hours stale), else 0. Clients read it as a number
/// (`doc_count`, `total_rows`), and couchrestore demands 0 of an empty target.
pub async fn live_document_count(backend: &dyn crate::backend::DocumentBackend) -> crate::Result<u64> {
    let count = match backend.exact_count().await? {
        Some(count) => count.saturating_sub(backend.design_document_count().await?.unwrap_or(0)),
        None => backend.approximate_count().await?.unwrap_or(0),
    };
    Ok(count)
}
