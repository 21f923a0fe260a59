//! Bulk-write throughput: fresh documents through `DocumentBackend::bulk_write` in batches of
//! [`BULK_BATCH`] from [`BULK_CALLERS`] concurrent callers, in documents per second, once with
//! `Precondition::None` and once with `Precondition::MustNotExist`, each into a namespace of its
//! own. Bodies are built before the clock starts. Afterwards (not timed) the bench counts what its
//! store holds by its own means ([`BulkBench::count`], the authority: a shortfall is an error) and
//! the facade lists the namespace, shown next to it.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentstore::backend::{BulkWrite, DocumentBackend, Precondition};
use agentstore::model::Limits;
use hdrhistogram::Histogram;
use serde_json::{json, Value};

use super::describe;
use super::load::{histogram, quantile_ms, Bench, Labels};
use super::workload::body;

/// A bench with a bulk phase.
pub trait BulkBench: Bench {
    /// The calls the adapter makes for `bulk_write` under `precondition` (`BatchWriteItem x25`).
    fn bulk_calls(precondition: &Precondition) -> &'static str;

    /// How many documents of `namespace` the store holds, counted without the facade's listing.
    fn count(&self, namespace: &str) -> impl std::future::Future<Output = Result<usize, String>> + Send;
}

/// Documents per `bulk_write` call.
pub const BULK_BATCH: usize = 100;
/// Concurrent `bulk_write` callers.
pub const BULK_CALLERS: usize = 4;

pub struct BulkResult {
    pub label: &'static str,
    /// `None` or `MustNotExist`.
    pub precondition: &'static str,
    /// The calls the adapter makes for it (`BatchWriteItem x25`).
    pub calls: &'static str,
    pub docs: usize,
    pub batches: usize,
    pub errors: u64,
    pub first_error: Option<String>,
    pub elapsed: Duration,
    /// Latency of one `bulk_write` call, in microseconds.
    pub latency: Histogram<u64>,
    /// Documents the bench's authoritative count finds in the namespace afterwards.
    pub verified: usize,
    /// Keys `DataStore::list_keys` returns for the namespace afterwards.
    pub listed: usize,
}

impl BulkResult {
    pub fn docs_per_s(&self) -> f64 {
        let written = self.docs as u64 - self.errors.min(self.docs as u64);
        if self.elapsed.is_zero() {
            0.0
        } else {
            written as f64 / self.elapsed.as_secs_f64()
        }
    }

    /// Records the counts taken afterwards: `verified` by the authority, `listed` by the facade. A
    /// verified count other than what was written is an error, unless one is already recorded.
    pub fn verify(&mut self, namespace: &str, container: &str, verified: usize, listed: usize) {
        self.verified = verified;
        self.listed = listed;
        if verified != self.docs && self.first_error.is_none() {
            self.errors += self.docs.abs_diff(verified) as u64;
            self.first_error =
                Some(format!("{namespace}: the {container} holds {verified} documents after writing {}", self.docs));
        }
    }

    pub fn to_json(&self, labels: &Labels) -> Value {
        json!({
            "operation": self.label,
            "precondition": self.precondition,
            labels.calls_key: self.calls,
            "documents": self.docs,
            "batch_size": BULK_BATCH,
            "batches": self.batches,
            "concurrent_callers": BULK_CALLERS,
            "errors": self.errors,
            "elapsed_s": self.elapsed.as_secs_f64(),
            "docs_per_s": self.docs_per_s(),
            "batch_p50_ms": quantile_ms(&self.latency, 0.50),
            "batch_p99_ms": quantile_ms(&self.latency, 0.99),
            format!("documents_in_{}_after", labels.container): self.verified,
            "facade_list_keys_after": self.listed,
            "first_error": self.first_error,
        })
    }

    /// The line saying the phase is done.
    pub fn print_done(&self) {
        println!(
            "  {:<10} done in {:.2} s: {} fresh documents, Precondition::{}, batches of {BULK_BATCH}, \
             {BULK_CALLERS} concurrent callers",
            self.label,
            self.elapsed.as_secs_f64(),
            self.docs,
            self.precondition
        );
    }
}

/// The name `bulk_phase` gives a precondition.
fn precondition_name(precondition: &Precondition) -> &'static str {
    match precondition {
        Precondition::None => "None",
        Precondition::MustNotExist => "MustNotExist",
        Precondition::NeverWritten => "NeverWritten",
        Precondition::MatchRevision(_) => "MatchRevision",
    }
}

/// `docs` fresh documents (`doc-000000`, …) in `namespace`, through `bulk_write` under
/// `precondition` in batches of [`BULK_BATCH`] from [`BULK_CALLERS`] concurrent tasks. `calls`
/// says what the adapter makes of them. Not verified yet: see [`BulkResult::verify`].
async fn bulk_phase(
    backend: &Arc<dyn DocumentBackend>,
    precondition: Precondition,
    calls: &'static str,
    namespace: &str,
    docs: usize,
    source: &str,
) -> Result<BulkResult, String> {
    let limits = Limits::default();
    let precondition_label = precondition_name(&precondition);
    let mut queue = VecDeque::new();
    let mut batch = Vec::with_capacity(BULK_BATCH);
    for i in 0..docs {
        let (id, body) = body(namespace, &format!("doc-{i:06}"), i as u64, source, &limits)?;
        batch.push(BulkWrite { id, body, precondition: precondition.clone() });
        if batch.len() == BULK_BATCH {
            queue.push_back(std::mem::take(&mut batch));
        }
    }
    if !batch.is_empty() {
        queue.push_back(batch);
    }
    let batches = queue.len();
    let queue = Arc::new(Mutex::new(queue));
    let first_error = Arc::new(Mutex::new(None::<String>));
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(BULK_CALLERS);
    for _ in 0..BULK_CALLERS {
        let (backend, queue, first_error) = (Arc::clone(backend), Arc::clone(&queue), Arc::clone(&first_error));
        tasks.push(tokio::spawn(async move {
            let mut latency = histogram();
            let mut errors = 0u64;
            let note = |message: String| {
                first_error.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(message);
            };
            loop {
                let Some(batch) = queue.lock().unwrap_or_else(|e| e.into_inner()).pop_front() else { break };
                let size = batch.len() as u64;
                let began = Instant::now();
                match backend.bulk_write(batch).await {
                    Ok(results) => {
                        latency.saturating_record((began.elapsed().as_micros() as u64).max(1));
                        for result in results {
                            if let Err(e) = result {
                                errors += 1;
                                note(describe(&e));
                            }
                        }
                    }
                    Err(e) => {
                        errors += size;
                        note(describe(&e));
                    }
                }
            }
            (errors, latency)
        }));
    }
    let mut result = BulkResult {
        label: "bulk_write",
        precondition: precondition_label,
        calls,
        docs,
        batches,
        errors: 0,
        first_error: None,
        elapsed: Duration::ZERO,
        latency: histogram(),
        verified: 0,
        listed: 0,
    };
    for task in tasks {
        let (errors, latency) = task.await.expect("bulk caller panicked");
        result.errors += errors;
        result.latency.add(&latency).expect("same histogram bounds");
    }
    result.elapsed = started.elapsed();
    result.first_error = first_error.lock().unwrap_or_else(|e| e.into_inner()).take();
    Ok(result)
}

/// Both bulk phases, `Precondition::None` then `Precondition::MustNotExist`, of `docs` documents
/// each, verified; says when each is done.
pub async fn run_bulk<B: BulkBench>(
    bench: &B,
    backend: &Arc<dyn DocumentBackend>,
    docs: usize,
    labels: &Labels,
) -> Result<Vec<BulkResult>, String> {
    let mut results = Vec::new();
    for (precondition, namespace) in
        [(Precondition::None, "bulk-none"), (Precondition::MustNotExist, "bulk-must-not-exist")]
    {
        let calls = B::bulk_calls(&precondition);
        let mut result = bulk_phase(backend, precondition, calls, namespace, docs, B::SOURCE).await?;
        let verified = bench.count(namespace).await?;
        let listed = bench.facades().list_keys(namespace).await?.len();
        result.verify(namespace, labels.container, verified, listed);
        result.print_done();
        results.push(result);
    }
    Ok(results)
}

/// Prints every bulk phase that lost documents; true when none did.
pub fn report_failures(name: &str, bulk: &[BulkResult]) -> bool {
    let mut passed = true;
    for b in bulk.iter().filter(|b| b.errors > 0) {
        passed = false;
        eprintln!(
            "{name}: bulk_write Precondition::{}: {} of {} documents failed; first: {}",
            b.precondition,
            b.errors,
            b.docs,
            b.first_error.as_deref().unwrap_or("?")
        );
    }
    passed
}
