//! The facade side of every pair: two `DataStore`s over the adapter under test, one with
//! `track_reads=false` (so `get` is exactly one read) and one with the default options (`get`
//! counts an access: read + conditional write; also used for `set`).

use std::sync::Arc;

use agentstore::backend::{BulkWrite, DocumentBackend, Precondition};
use agentstore::model::Limits;
use agentstore::store::{DataStore, StoreOptions};

use super::describe;
use super::workload::{
    body, document, metadata, value, Input, Pair, AGENT, KEYS_PER_NAMESPACE, NAMESPACES, TOTAL_KEYS, USER,
};

pub struct Facades {
    /// `track_reads=false`: `get` is exactly one read.
    pub untracked: DataStore,
    /// Default options: `get` counts an access; also used for `set`.
    pub tracked: DataStore,
}

impl Facades {
    /// Opens both facades over `backend`.
    pub async fn open(backend: &Arc<dyn DocumentBackend>) -> Result<Self, String> {
        let untracked = DataStore::open(Arc::clone(backend), StoreOptions { track_reads: false, ..Default::default() })
            .await
            .map_err(|e| format!("opening the facade: {}", describe(&e)))?;
        let tracked = DataStore::open(Arc::clone(backend), StoreOptions::default())
            .await
            .map_err(|e| format!("opening the facade: {}", describe(&e)))?;
        Ok(Facades { untracked, tracked })
    }

    /// The page size the facade asks the adapter for.
    pub fn page_size(&self) -> usize {
        self.untracked.options().page_size
    }

    /// One operation of `pair` through the facade: how many documents it read or wrote.
    pub async fn op(&self, pair: Pair, input: Input) -> Result<usize, String> {
        let Input { namespace, key, value, metadata, .. } = input;
        let fail = |e: agentstore::Error| format!("facade {} {namespace}/{key}: {}", pair.name(), describe(&e));
        match pair {
            Pair::Get | Pair::GetTracked => {
                let store = if pair == Pair::Get { &self.untracked } else { &self.tracked };
                match store.get(USER, &namespace, &key, Some(AGENT)).await.map_err(fail)? {
                    Some(_) => Ok(1),
                    None => Err(format!("facade {}: {namespace}/{key} is missing", pair.name())),
                }
            }
            Pair::Set => {
                self.tracked.set(USER, &namespace, &key, value, Some(metadata), Some(AGENT)).await.map_err(fail)?;
                Ok(1)
            }
            Pair::ListKeys => Ok(self.untracked.list_keys(USER, &namespace).await.map_err(fail)?.len()),
            Pair::GetAll => Ok(self.untracked.get_all(USER, &namespace).await.map_err(fail)?.len()),
        }
    }

    /// The keys of a namespace (sorted).
    pub async fn list_keys(&self, namespace: &str) -> Result<Vec<String>, String> {
        self.untracked.list_keys(USER, namespace).await.map_err(|e| describe(&e))
    }

    /// Seeds every document through the adapter's `bulk_write` under `precondition`, one call per
    /// namespace, with the bodies the facade writes (not timed). Then one warm-up `set` per
    /// namespace through the facade, so its once-per-namespace ensure-index call is never timed.
    pub async fn seed(
        &self,
        backend: &Arc<dyn DocumentBackend>,
        source: &str,
        precondition: Precondition,
    ) -> Result<(), String> {
        let limits = Limits::default();
        for ns in 0..NAMESPACES {
            let mut writes = Vec::with_capacity(KEYS_PER_NAMESPACE);
            for i in ns * KEYS_PER_NAMESPACE..(ns + 1) * KEYS_PER_NAMESPACE {
                let (namespace, key) = document(i);
                let (id, body) = body(&namespace, &key, i as u64, source, &limits)?;
                writes.push(BulkWrite { id, body, precondition: precondition.clone() });
            }
            let results = backend.bulk_write(writes).await.map_err(|e| format!("seeding ns-{ns}: {}", describe(&e)))?;
            if let Some(Err(e)) = results.into_iter().find(Result::is_err) {
                return Err(format!("seeding ns-{ns}: {}", describe(&e)));
            }
        }
        for ns in 0..NAMESPACES {
            let (namespace, key) = document(ns * KEYS_PER_NAMESPACE);
            self.tracked
                .set(USER, &namespace, &key, value(0), Some(metadata(source, 0)), Some(AGENT))
                .await
                .map_err(|e| format!("warm-up write to {namespace}/{key}: {}", describe(&e)))?;
        }
        Ok(())
    }

    /// Before anything is timed, both sides must list the same keys of the first namespace:
    /// `raw_keys` (sorted) is what the raw side's `raw_call` found.
    pub async fn check_same_listing(&self, raw_keys: Vec<String>, raw_call: &str) -> Result<(), String> {
        let (namespace, _) = document(0);
        let facade_keys = self.list_keys(&namespace).await?;
        if facade_keys != raw_keys || facade_keys.len() != KEYS_PER_NAMESPACE {
            return Err(format!(
                "{namespace}: the facade lists {} keys and raw {raw_call} {}; expected the same {KEYS_PER_NAMESPACE}",
                facade_keys.len(),
                raw_keys.len()
            ));
        }
        Ok(())
    }
}

/// The line saying the seeding is done; `how` names the adapter's bulk call.
pub fn print_seeded(how: &str, seconds: f64) {
    println!(
        "seeded {TOTAL_KEYS} documents (1 user x {NAMESPACES} namespaces x {KEYS_PER_NAMESPACE} keys) with {how}, \
         then one facade set per namespace, in {seconds:.2} s (not timed)"
    );
}
