//! Failed logins counted in the backend, so every instance over one backend locks a (name, peer)
//! pair at the same count ([`super::auth`]'s lockout keeps its in-process table as a cache in
//! front of this).
//!
//! Each pair that failed is one local document of the data-store database, under the reserved
//! prefix [`LOCKOUT_LOCAL_PREFIX`] (`:db:…`, never listed or served to a client, as the session
//! secret of [`super::shared_secret`]): `{"failures": n, "started_ms": t}`, the count and the
//! wall-clock time of the first failure of the current period. The name is a SHA-256 of the pair,
//! not the pair: no login name or client address is written to the backend in clear, and the
//! name is the same short hex on every backend. (Not a keyed hash: every instance must find the
//! same name, so the key would live in the backend beside the documents or in every instance's
//! configuration, and a reader of the backend could then test guesses just the same.)
//!
//! A failure is added with the backend's conditional write (`MustNotExist` for a pair's first,
//! `MatchRevision` after), re-read and retried on a conflict at most [`WRITE_TRIES`] times, so two
//! instances' failures never overwrite each other. Documents whose period is over are deleted when
//! read, and every instance sweeps the prefix once a period (docs/bounds.md).

use std::net::IpAddr;
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::backend::{DocumentBackend, IdRange, Precondition, StoredDocument};
use crate::error::{Error, Result};

/// The start of every shared failure count's local-document name (under the engine's reserved
/// `:db:`, [`crate::database::layout::reserved_local_name`]).
pub const LOCKOUT_LOCAL_PREFIX: &str = ":db:lockout:";
/// Conditional writes of one failure tried before it is counted in this process only: a write
/// loses only to another instance's failure of the same pair, and the next read sees it.
const WRITE_TRIES: usize = 5;
/// Documents a sweep reads per backend page.
const SWEEP_PAGE: usize = 200;
/// The field holding the failures of the current period.
const FAILURES_FIELD: &str = "failures";
/// The field holding when the current period started, in milliseconds since the Unix epoch.
const STARTED_FIELD: &str = "started_ms";

/// A pair's failures as every instance sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedCount {
    pub failures: u32,
    /// How long ago the period started.
    pub age: Duration,
}

/// The failure counts kept in a backend, for one lockout period.
pub struct SharedFailures {
    backend: Arc<dyn DocumentBackend>,
    period: Duration,
}

impl std::fmt::Debug for SharedFailures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedFailures")
            .field("backend", &self.backend.describe())
            .field("period", &self.period)
            .finish()
    }
}

impl SharedFailures {
    pub fn new(backend: Arc<dyn DocumentBackend>, period: Duration) -> Self {
        SharedFailures { backend, period }
    }

    /// The pair's failures in its current period; a document whose period is over is deleted
    /// (if no instance counted into it meanwhile) and counts as none.
    pub async fn count(&self, peer: IpAddr, name: &str) -> Result<Option<SharedCount>> {
        let local_name = local_name(peer, name);
        let Some(stored) = self.backend.get_local(&local_name).await? else { return Ok(None) };
        let now = unix_millis();
        match self.current(&stored, now) {
            Some(count) => Ok(Some(count)),
            None => {
                self.forget(&local_name, &stored).await;
                Ok(None)
            }
        }
    }

    /// Adds one failure of the pair; the pair's count with it.
    pub async fn record(&self, peer: IpAddr, name: &str) -> Result<SharedCount> {
        let local_name = local_name(peer, name);
        for _ in 0..WRITE_TRIES {
            let stored = self.backend.get_local(&local_name).await?;
            let now = unix_millis();
            let (count, precondition) = match &stored {
                Some(doc) => {
                    let counted =
                        self.current(doc, now).map_or(SharedCount { failures: 1, age: Duration::ZERO }, |count| {
                            SharedCount { failures: count.failures.saturating_add(1), age: count.age }
                        });
                    (counted, Precondition::MatchRevision(doc.rev.clone()))
                }
                None => (SharedCount { failures: 1, age: Duration::ZERO }, Precondition::MustNotExist),
            };
            let started = now.saturating_sub(millis(count.age));
            match self.backend.put_local(&local_name, &count_body(count.failures, started), precondition).await {
                Ok(_) => return Ok(count),
                // Another instance counted a failure of this pair first: count on top of it.
                Err(err) if err.is_conflict() => continue,
                Err(err) => return Err(err),
            }
        }
        Err(Error::conflict(format!(
            "a failed login's shared count kept changing under {WRITE_TRIES} writes; counted in this process only"
        )))
    }

    /// Deletes every count whose period is over; how many were deleted. Counts another instance
    /// changed meanwhile are left to it.
    pub async fn sweep(&self) -> Result<usize> {
        let range = IdRange {
            start: Some(LOCKOUT_LOCAL_PREFIX.to_owned()),
            end: Some(prefix_end(LOCKOUT_LOCAL_PREFIX)),
            inclusive_end: false,
            ..IdRange::all()
        };
        let mut deleted = 0;
        let mut token: Option<String> = None;
        loop {
            let page = self.backend.local_docs(&range, SWEEP_PAGE, token.as_deref()).await?;
            let now = unix_millis();
            for doc in &page.items {
                let name = doc.id.strip_prefix(crate::backend::LOCAL_PREFIX).unwrap_or(&doc.id);
                if name.starts_with(LOCKOUT_LOCAL_PREFIX) && self.current(doc, now).is_none() {
                    self.forget(name, doc).await;
                    deleted += 1;
                }
            }
            match page.next {
                Some(next) => token = Some(next),
                None => return Ok(deleted),
            }
        }
    }

    /// The count a stored document holds, if its period is still running at `now` (a document
    /// that is not a count is over: it goes).
    fn current(&self, stored: &StoredDocument, now: u64) -> Option<SharedCount> {
        let failures = stored.body.get(FAILURES_FIELD).and_then(Value::as_u64)?;
        let started = stored.body.get(STARTED_FIELD).and_then(Value::as_u64)?;
        // A start ahead of this clock (another host's clock runs ahead) counts from now.
        let age = Duration::from_millis(now.saturating_sub(started));
        (age < self.period).then(|| SharedCount { failures: u32::try_from(failures).unwrap_or(u32::MAX), age })
    }

    /// Deletes a count whose period is over, unless it changed since it was read; a failure only
    /// leaves it for the next read or sweep.
    async fn forget(&self, local_name: &str, stored: &StoredDocument) {
        if let Err(err) = self.backend.delete_local(local_name, &stored.rev).await {
            if !err.is_conflict() && err.kind() != crate::error::ErrorKind::NotFound {
                tracing::warn!(error = %err, "could not delete a failed-login count whose period is over");
            }
        }
    }
}

/// Sweeps `failures` once a period until it is dropped (held weakly, so this task keeps nothing
/// open). A failed sweep is logged; the next one tries again.
pub fn keep_swept(failures: &Arc<SharedFailures>) {
    let every = failures.period;
    let failures: Weak<SharedFailures> = Arc::downgrade(failures);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            let Some(failures) = failures.upgrade() else { return };
            if let Err(err) = failures.sweep().await {
                tracing::warn!(error = %err, "could not sweep the failed-login counts whose period is over");
            }
        }
    });
}

/// The local-document name of a pair's count: the prefix and a SHA-256 of the address and the
/// name (each length-prefixed, so no two pairs share their bytes).
fn local_name(peer: IpAddr, name: &str) -> String {
    let address = peer.to_string();
    let mut hash = Sha256::new();
    for part in [address.as_bytes(), name.as_bytes()] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part);
    }
    format!("{LOCKOUT_LOCAL_PREFIX}{}", hex::encode(hash.finalize()))
}

/// The first name after every name starting with `prefix` (which ends in an ASCII character).
fn prefix_end(prefix: &str) -> String {
    let mut end = prefix.to_owned();
    if let Some(last) = end.pop() {
        end.push(char::from_u32(u32::from(last) + 1).unwrap_or(char::MAX));
    }
    end
}

fn count_body(failures: u32, started_ms: u64) -> Map<String, Value> {
    let mut body = Map::new();
    body.insert(FAILURES_FIELD.into(), Value::from(failures));
    body.insert(STARTED_FIELD.into(), Value::from(started_ms));
    body
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

fn unix_millis() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, millis)
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn embedded() -> (tempfile::TempDir, Arc<dyn DocumentBackend>) {
        let dir = tempfile::tempdir().unwrap();
        let backend = crate::backend::embedded::EmbeddedBackend::open(&dir.path().join("s.redb")).await.unwrap();
        (dir, Arc::new(backend))
    }

    fn peer(last: u8) -> IpAddr {
        IpAddr::from([192, 0, 2, last])
    }

    #[tokio::test]
    async fn two_instances_add_to_one_count_per_pair() {
        let (_dir, backend) = embedded().await;
        let a = SharedFailures::new(Arc::clone(&backend), Duration::from_secs(300));
        let b = SharedFailures::new(Arc::clone(&backend), Duration::from_secs(300));
        assert_eq!(a.count(peer(1), "alice").await.unwrap(), None);
        // Concurrent failures of one pair on both instances: none is lost.
        let (one, two) = tokio::join!(a.record(peer(1), "alice"), b.record(peer(1), "alice"));
        let mut seen = [one.unwrap().failures, two.unwrap().failures];
        seen.sort_unstable();
        assert_eq!(seen, [1, 2]);
        b.record(peer(1), "alice").await.unwrap();
        assert_eq!(a.count(peer(1), "alice").await.unwrap().map(|c| c.failures), Some(3));
        // Other pairs are apart; names and addresses never appear in clear.
        assert_eq!(a.count(peer(2), "alice").await.unwrap(), None);
        assert_eq!(a.count(peer(1), "bob").await.unwrap(), None);
        let name = local_name(peer(1), "alice");
        assert!(crate::database::layout::reserved_local_name(&name));
        assert!(!name.contains("alice") && !name.contains("192.0.2"), "{name}");
    }

    #[tokio::test]
    async fn counts_whose_period_is_over_are_deleted() {
        let (_dir, backend) = embedded().await;
        let brief = SharedFailures::new(Arc::clone(&backend), Duration::from_millis(50));
        brief.record(peer(1), "alice").await.unwrap();
        brief.record(peer(2), "alice").await.unwrap();
        brief.record(peer(3), "alice").await.unwrap();
        tokio::time::sleep(Duration::from_millis(80)).await;
        // Read after its period: none, and gone from the backend.
        assert_eq!(brief.count(peer(1), "alice").await.unwrap(), None);
        assert!(backend.get_local(&local_name(peer(1), "alice")).await.unwrap().is_none());
        // A new failure starts a new period at one.
        brief.record(peer(2), "alice").await.unwrap();
        assert_eq!(brief.count(peer(2), "alice").await.unwrap().map(|c| c.failures), Some(1));
        // The sweep deletes the rest (the running count stays); a client's own local documents
        // are not touched.
        backend.put_local("client-checkpoint", &Map::new(), Precondition::None).await.unwrap();
        assert_eq!(brief.sweep().await.unwrap(), 1);
        assert!(backend.get_local(&local_name(peer(3), "alice")).await.unwrap().is_none());
        assert!(backend.get_local(&local_name(peer(2), "alice")).await.unwrap().is_some());
        assert!(backend.get_local("client-checkpoint").await.unwrap().is_some());
    }
}
