//! For the engine's tests: a backend layer that records, in order, the calls a document write
//! makes to the backend it wraps; with `fail_puts`, every `put` fails before writing (as a
//! process killed between a save's local tree and its record leaves it) and `NeverWritten` is not
//! checked, so a save from nothing writes its local tree first. With a pause
//! ([`CountingBackend::pause_bulk_writes`]) each `bulk_write` waits before writing and the most
//! of them in flight at once is kept, for tests of how many writes a caller overlaps. Marked
//! shared ([`CountingBackend::claim_shared`]), it says other processes write its backend too, so
//! that the engine reads its settings as it does on DynamoDB or Firestore.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Map, Value};

use crate::backend::{BulkWrite, DocumentBackend, Precondition, Revision, StoredDocument};
use crate::error::{Error, ErrorKind, Result};

pub(crate) struct CountingBackend {
    inner: Arc<dyn DocumentBackend>,
    calls: Mutex<Vec<&'static str>>,
    fail_puts: bool,
    /// How long each `bulk_write` waits before writing (none by default).
    bulk_pause: Mutex<Option<Duration>>,
    bulk_in_flight: AtomicUsize,
    most_bulk_in_flight: AtomicUsize,
    /// Claims other processes share the backend, whatever the inner one says.
    shared: AtomicBool,
    /// Takes small attachments with their manifests in one call
    /// ([`CountingBackend::take_small_attachments_at_once`]).
    small_at_once: AtomicBool,
}

impl CountingBackend {
    pub(crate) fn over(inner: Arc<dyn DocumentBackend>, fail_puts: bool) -> Arc<Self> {
        Arc::new(CountingBackend {
            inner,
            calls: Mutex::new(Vec::new()),
            fail_puts,
            bulk_pause: Mutex::new(None),
            bulk_in_flight: AtomicUsize::new(0),
            most_bulk_in_flight: AtomicUsize::new(0),
            shared: AtomicBool::new(false),
            small_at_once: AtomicBool::new(false),
        })
    }

    /// Makes every later `bulk_write` wait `pause` before writing.
    #[cfg(test)]
    pub(crate) fn pause_bulk_writes(&self, pause: Duration) {
        *self.bulk_pause.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(pause);
    }

    /// From now on says other processes share the backend
    /// ([`DocumentBackend::shared_with_other_processes`]): the engine then reads the database's
    /// settings where it would over DynamoDB or Firestore, instead of keeping them.
    #[cfg(test)]
    pub(crate) fn claim_shared(&self) {
        self.shared.store(true, Ordering::SeqCst);
    }

    /// From now on takes small attachments with their manifests in one call
    /// (`put_small_attachments`, counted once), as Firestore does in one commit; here each
    /// chunk and then its manifest are written to the inner backend uncounted, one after the
    /// other (not atomic: for tests that count calls, not for crash tests).
    #[cfg(test)]
    pub(crate) fn take_small_attachments_at_once(&self) {
        self.small_at_once.store(true, Ordering::SeqCst);
    }

    /// The most `bulk_write` calls that were in flight at once.
    #[cfg(test)]
    pub(crate) fn most_bulk_writes_at_once(&self) -> usize {
        self.most_bulk_in_flight.load(Ordering::SeqCst)
    }

    /// The calls since the last time they were taken, in order.
    pub(crate) fn taken(&self) -> Vec<&'static str> {
        std::mem::take(&mut *self.calls.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    /// The calls since the last time they were taken, counted by name.
    pub(crate) fn taken_counts(&self) -> BTreeMap<&'static str, usize> {
        let mut counts = BTreeMap::new();
        for call in self.taken() {
            *counts.entry(call).or_default() += 1;
        }
        counts
    }

    fn called(&self, name: &'static str) {
        self.calls.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(name);
    }
}

#[async_trait::async_trait]
impl crate::backend::raw::layer::Layered for CountingBackend {
    fn inner(&self) -> &dyn DocumentBackend {
        self.inner.as_ref()
    }

    fn checks_never_written(&self) -> bool {
        !self.fail_puts && self.inner.checks_never_written()
    }

    fn shared_with_other_processes(&self) -> bool {
        self.shared.load(Ordering::SeqCst) || self.inner.shared_with_other_processes()
    }

    async fn get(&self, id: &str) -> Result<Option<StoredDocument>> {
        self.called("get");
        self.inner.get(id).await
    }

    async fn get_many(&self, ids: &[String]) -> Result<Vec<Option<StoredDocument>>> {
        self.called("get_many");
        self.inner.get_many(ids).await
    }

    async fn get_local(&self, name: &str) -> Result<Option<StoredDocument>> {
        self.called("get_local");
        self.inner.get_local(name).await
    }

    async fn get_many_local(&self, names: &[String]) -> Result<Vec<Option<StoredDocument>>> {
        self.called("get_many_local");
        self.inner.get_many_local(names).await
    }

    async fn get_deleted(&self, id: &str) -> Result<Option<StoredDocument>> {
        self.called("get_deleted");
        self.inner.get_deleted(id).await
    }

    async fn put(&self, id: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision> {
        self.called("put");
        if self.fail_puts {
            return Err(Error::new(ErrorKind::Unavailable, "killed before the record"));
        }
        self.inner.put(id, body, precondition).await
    }

    async fn put_local(&self, name: &str, body: &Map<String, Value>, precondition: Precondition) -> Result<Revision> {
        self.called("put_local");
        self.inner.put_local(name, body, precondition).await
    }

    async fn delete(&self, id: &str, rev: &Revision) -> Result<Revision> {
        self.called("delete");
        self.inner.delete(id, rev).await
    }

    async fn put_small_attachments(&self, attachments: &[crate::backend::SmallAttachment]) -> Result<bool> {
        if !self.small_at_once.load(Ordering::SeqCst) {
            return self.inner.put_small_attachments(attachments).await;
        }
        self.called("put_small_attachments");
        for attachment in attachments {
            if !attachment.bytes.is_empty() {
                self.inner.put_attachment_chunk(&attachment.blob, 0, attachment.bytes.clone()).await?;
            }
            self.inner.put_local(&attachment.manifest, &attachment.manifest_body, Precondition::MustNotExist).await?;
        }
        Ok(true)
    }

    async fn put_attachment_chunk(&self, blob: &str, index: u64, bytes: bytes::Bytes) -> Result<()> {
        self.called("put_attachment_chunk");
        self.inner.put_attachment_chunk(blob, index, bytes).await
    }

    async fn bulk_write(&self, writes: Vec<BulkWrite>) -> Result<Vec<Result<Revision>>> {
        self.called("bulk_write");
        let pause = *self.bulk_pause.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = self.bulk_in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_bulk_in_flight.fetch_max(now, Ordering::SeqCst);
        if let Some(pause) = pause {
            tokio::time::sleep(pause).await;
        }
        let written = self.inner.bulk_write(writes).await;
        self.bulk_in_flight.fetch_sub(1, Ordering::SeqCst);
        written
    }
}
