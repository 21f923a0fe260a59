//! Sharing `update=true` catch-ups of one view group between the queries waiting for them.
//!
//! A query that wants the index current ([`ViewIndexer::catch_up`]) needs a read of the change
//! feed that began after the query arrived: every write acknowledged before the query is in the
//! feed by then (docs/change-feed.md). Concurrent queries of one group used to wait for each
//! other's catch-up and then each read the feed again, one after the other: sixteen clients
//! meant sixteen feed reads in a row, each a round trip to DynamoDB or Firestore. Here the
//! catch-ups of a group run one at a time, and a query that waited for one which *began after it
//! arrived* takes that one's result instead of reading the feed itself. So concurrent queries
//! share a read, and every answer still reflects every write acknowledged before its query, made
//! through this instance or any other over the same backend: nothing is served from a time-bound
//! memo.
//!
//! Order is kept with tickets from one counter: a query takes one as it arrives, a catch-up one
//! just before it reads the feed. A result is taken only by a query whose ticket is lower than
//! the catch-up's.
//!
//! Not done, and why: skipping the feed read while the last catch-up is younger than some bound
//! (a `couchdb_view_fresh_ms`). Writes through other `serve` instances over the same table reach
//! this one only through the feed, so any bound above zero lets a view miss a write acknowledged
//! before the query (docs/views.md, "Keeping an index current"); with the bound at zero, its only
//! safe default, it would do nothing.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use super::design::DesignViews;
use super::source::ViewSource;
use super::updater::{ReadyGroup, ViewIndexer};
use super::ViewError;

tokio::task_local! {
    /// Set while a catch-up runs for the queries sharing it: the inner call does the work.
    static SHARED_CATCH_UP: ();
}

/// Arrivals and catch-up starts, in one order.
static TICKETS: AtomicU64 = AtomicU64::new(1);

/// One group's catch-ups: run one at a time (the lock), the last one's start ticket and result.
#[derive(Default)]
struct Flight {
    last: tokio::sync::Mutex<Option<(u64, ReadyGroup)>>,
    /// Catch-ups that read the feed (for the tests).
    #[cfg(test)]
    led: AtomicU64,
}

/// A group by indexer (its address: one per process, more in tests), database and signature.
type FlightKey = (usize, String, String);

/// Every group's flight. One entry per group queried, until its database is deleted
/// ([`forget_database`]): a group name and its state, small beside the group's rows.
fn flights() -> &'static Mutex<HashMap<FlightKey, Arc<Flight>>> {
    static FLIGHTS: OnceLock<Mutex<HashMap<FlightKey, Arc<Flight>>>> = OnceLock::new();
    FLIGHTS.get_or_init(Mutex::default)
}

fn flight_of(indexer: &ViewIndexer, source: &dyn ViewSource, design: &DesignViews) -> Arc<Flight> {
    let key = (indexer as *const ViewIndexer as usize, source.name().to_owned(), design.signature.clone());
    let mut flights = flights().lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    Arc::clone(flights.entry(key).or_default())
}

/// Drops the flights of `indexer`'s groups over the deleted database `database`.
pub(super) fn forget_database(indexer: &ViewIndexer, database: &str) {
    let address = indexer as *const ViewIndexer as usize;
    let mut flights = flights().lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    flights.retain(|(of, name, _), _| !(*of == address && name == database));
}

/// Flights kept for `indexer`'s groups over `database` (for the tests).
#[cfg(test)]
pub(super) fn flights_of(indexer: &ViewIndexer, database: &str) -> usize {
    let address = indexer as *const ViewIndexer as usize;
    let flights = flights().lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    flights.keys().filter(|(of, name, _)| *of == address && name == database).count()
}

/// What [`shared_catch_up`] returns: boxed, because the catch-up it runs calls it again (and a
/// future's type cannot contain itself).
pub type SharedCatchUp<'a> = Pin<Box<dyn Future<Output = Option<Result<ReadyGroup, ViewError>>> + Send + 'a>>;

/// [`ViewIndexer::catch_up`] shared with the queries waiting for it: `None` when called from
/// within a shared catch-up (the caller does the work then), else the group brought up to the
/// end of the feed as read after this call began, by this call or by one that began after it.
pub fn shared_catch_up<'a>(
    indexer: &'a ViewIndexer,
    source: &'a dyn ViewSource,
    design: &'a DesignViews,
) -> SharedCatchUp<'a> {
    Box::pin(async move {
        if SHARED_CATCH_UP.try_with(|_| ()).is_ok() {
            return None;
        }
        let arrived = TICKETS.fetch_add(1, Ordering::SeqCst);
        let flight = flight_of(indexer, source, design);
        let mut last = flight.last.lock().await;
        if let Some((started, group)) = last.as_ref() {
            if *started > arrived {
                return Some(Ok(group.clone()));
            }
        }
        let started = TICKETS.fetch_add(1, Ordering::SeqCst);
        #[cfg(test)]
        flight.led.fetch_add(1, Ordering::SeqCst);
        let result = SHARED_CATCH_UP.scope((), indexer.catch_up(source, design)).await;
        match &result {
            Ok(group) => *last = Some((started, group.clone())),
            // A failed catch-up is not shared: each waiting query tries its own.
            Err(_) => *last = None,
        }
        Some(result)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::catalog::{DbName, EmbeddedCatalog};
    use crate::backend::embedded::EmbeddedOptions;
    use crate::database::{Databases, Write};
    use crate::views::index_store::IndexStore;
    use crate::views::updater::Mapper;
    use async_trait::async_trait;
    use serde_json::{json, Value};

    /// Emits `(doc.type, null)`, each batch only once `gate` lets it through.
    struct GatedMapper {
        gate: tokio::sync::Semaphore,
    }

    #[async_trait]
    impl Mapper for GatedMapper {
        async fn map(
            &self,
            _: &DesignViews,
            docs: Vec<Arc<crate::js::DocText>>,
        ) -> Result<Vec<Vec<Vec<(Value, Value)>>>, ViewError> {
            let permit = self.gate.acquire().await.map_err(|_| ViewError::Busy)?;
            permit.forget();
            Ok(docs.iter().map(|doc| vec![vec![(doc.value()["type"].clone(), Value::Null)]]).collect())
        }
    }

    fn edit(value: Value) -> Write {
        Write::Edit { parent: None, deleted: false, body: value.as_object().cloned().unwrap_or_default() }
    }

    #[tokio::test]
    async fn waiting_queries_share_a_catch_up_that_began_after_them_and_only_that() {
        let dir = tempfile::tempdir().unwrap();
        let catalog = Arc::new(EmbeddedCatalog::new(&dir.path().join("store.redb"), EmbeddedOptions::default()));
        let databases = Databases::new(Some(catalog), 4);
        let db = databases.create(&DbName::parse("app").unwrap()).await.unwrap();
        let store = Arc::new(IndexStore::open(&dir.path().join("views.redb")).unwrap());
        let mapper = Arc::new(GatedMapper { gate: tokio::sync::Semaphore::new(0) });
        let indexer = ViewIndexer::new(store, mapper.clone());
        let design = DesignViews::parse(&json!({"_id": "_design/d", "views": {"v": {"map": "…"}}})).unwrap();
        db.write("a", &edit(json!({"type": "first"}))).await.unwrap();
        let flight = flight_of(&indexer, db.as_ref(), &design);

        // The first query's catch-up stops in the mapper; four more arrive while it runs, then
        // the gate opens. join_all polls them in order, so all five have arrived before it does.
        let queries = (0..5).map(|_| indexer.catch_up(db.as_ref(), &design));
        let open = async {
            mapper.gate.add_permits(100);
            Ok(None)
        };
        let mut all: Vec<futures::future::BoxFuture<'_, Result<Option<ReadyGroup>, ViewError>>> =
            queries.map(|query| Box::pin(async move { query.await.map(Some) }) as _).collect();
        all.push(Box::pin(open));
        let answers = futures::future::join_all(all).await;
        let groups: Vec<ReadyGroup> = answers.into_iter().filter_map(|answer| answer.unwrap()).collect();
        assert_eq!(groups.len(), 5);
        for group in &groups {
            assert_eq!(group.state.row_counts, vec![1], "every query sees the write made before it");
        }
        // The first read the feed; the second had arrived before the first began, so it read the
        // feed again; the other three took the second's.
        assert_eq!(flight.led.load(Ordering::SeqCst), 2);

        // A query after a write reads the feed again and sees it.
        db.write("b", &edit(json!({"type": "second"}))).await.unwrap();
        let group = indexer.catch_up(db.as_ref(), &design).await.unwrap();
        assert_eq!(group.state.row_counts, vec![2]);
        assert_eq!(flight.led.load(Ordering::SeqCst), 3);
    }
}
