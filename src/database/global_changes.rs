//! Writing the databases' events into `_global_changes`, the database `_db_updates` reads, as
//! CouchDB 3.4.3's `global_changes` application does: each event is the document
//! `{event}:{database name}` (`created:orders`, `updated:orders`, `deleted:orders`), given a new
//! revision every time the event happens again, so the database's change feed lists each
//! database's latest event of each kind once, in the order they were written.
//!
//! The events are kept in memory by [`super::activity::Activity`] as they happen and written
//! here every flush interval (`couchdb_db_updates_flush_ms`, CouchDB's `max_write_delay`, 500 ms
//! by default), each distinct event once however often it happened: a write to a database costs
//! no backend call of its own; a flush costs a read and a write per distinct event. Because the
//! events are documents of a database in the backend, every instance over the same backend
//! writes to one feed and every instance's `_db_updates` reads all of them: an event made
//! through another instance shows at most one flush interval later than one made here (plus
//! the feed's polling interval, `couchdb_api::changes`).
//!
//! On the CouchDB backend the databases are the CouchDB server's own, and so is
//! `_global_changes`: the events are written there as plain documents (a write passed to a
//! database counts as its `updated` event, `couchdb_api::db`). Apache CouchDB writes the same
//! documents itself from every write it takes; the two writers meet as two instances do (one
//! conflicts and drops its write: the event shows either way). A server that keeps no events
//! itself (pouchdb-server) gets this server's.
//!
//! Nothing is written while `_global_changes` does not exist (an operator creates it, as on
//! CouchDB, where `_db_updates` answers 404 until then); the events of that time are dropped.
//! Two instances writing the same event at once conflict on its document: the one that loses
//! drops its write, since the winner's revision already shows the event after it happened.

use std::sync::{Arc, Weak};
use std::time::Duration;

use serde_json::Map;

use super::activity::GLOBAL_CHANGES_DB;
use super::{Databases, Write};
use crate::backend::catalog::DbName;
use crate::backend::{DocumentBackend, Precondition};
use crate::error::{ErrorKind, Result};

/// CouchDB's `[global_changes] max_write_delay`: how long events wait before they are written.
pub const DEFAULT_FLUSH_INTERVAL: Duration = Duration::from_millis(500);

/// Writes the events kept since the last flush; how many event documents were written. Kept
/// events are dropped when `_global_changes` does not exist.
pub async fn flush(databases: &Databases) -> Result<usize> {
    let activity = Arc::clone(databases.activity());
    let events = activity.take_pending();
    if events.is_empty() {
        return Ok(0);
    }
    let name = DbName::parse(GLOBAL_CHANGES_DB)?;
    let Some(database) = databases.open(&name).await? else { return Ok(0) };
    let mut written = 0;
    for id in &events {
        let wrote = if database.backend().forwards_requests() {
            write_native(database.backend().as_ref(), id).await
        } else {
            let parent = database.read(id).await?.and_then(|state| state.tree.winner().map(|leaf| leaf.rev()));
            database.write(id, &Write::Edit { parent, deleted: false, body: Map::new() }).await.map(drop)
        };
        match wrote {
            Ok(()) => written += 1,
            // Another instance (or the CouchDB behind) wrote the event after this one read it:
            // it shows already.
            Err(err) if err.kind() == ErrorKind::Conflict => {}
            Err(err) => return Err(err),
        }
    }
    activity.wrote_events(written);
    Ok(written)
}

/// An event written to a native `_global_changes` (the CouchDB backend's own database) as
/// CouchDB's `global_changes` writes one: an empty document, a new revision of the last.
async fn write_native(backend: &dyn DocumentBackend, id: &str) -> Result<()> {
    let precondition = match backend.get(id).await? {
        Some(stored) => Precondition::MatchRevision(stored.rev),
        None => Precondition::MustNotExist,
    };
    backend.put(id, &Map::new(), precondition).await.map(drop)
}

/// Flushes every `interval` for as long as `databases` is in use elsewhere (the task ends once
/// only it holds them). A failed flush is logged; its events are lost, as CouchDB loses a
/// failed flush's.
pub fn keep_flushing(databases: &Arc<Databases>, interval: Duration) {
    let databases: Weak<Databases> = Arc::downgrade(databases);
    let interval = interval.max(Duration::from_millis(1));
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let Some(databases) = databases.upgrade() else { return };
            if let Err(err) = flush(&databases).await {
                tracing::warn!(error = %err, "cannot write database events to _global_changes");
            }
        }
    });
}
