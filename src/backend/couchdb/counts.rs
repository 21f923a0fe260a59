//! Document counts remembered between requests, so a CouchDB API `_all_docs` page costs one
//! request to CouchDB rather than three.
//!
//! The CouchDB face answers every `_all_docs` with `total_rows`, which it takes from
//! [`DocumentBackend::exact_count`](crate::backend::DocumentBackend::exact_count) minus
//! [`DocumentBackend::design_document_count`](crate::backend::DocumentBackend::design_document_count).
//! Asked of CouchDB each time, that is a `GET /db` and a `_design/` range probe before the page
//! itself. But every `_all_docs` answer CouchDB gives already carries the database's `total_rows`
//! (its `doc_count`: live documents, design documents included), and design documents are
//! rarely written. So the adapter remembers:
//!
//! - the total from the last `GET /db` or `_all_docs` answer, and
//! - the number of design documents from the last probe,
//!
//! each for at most `count_max_age_ms` (a backend URL parameter, default
//! [`DEFAULT_MAX_AGE`]; `0` turns remembering off). A write made through this process forgets
//! the total (and a design-document write, an index creation or a purge the design count too),
//! so this process's own writes show in the next count at once; writes made by other CouchDB
//! clients show within the max age. A read that a write of this process overlapped is not
//! remembered (a generation counter), so a count older than a write never outlives it.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a remembered count is served by default.
pub const DEFAULT_MAX_AGE: Duration = Duration::from_secs(1);

/// One remembered number and when it was read.
#[derive(Clone, Copy)]
struct Remembered {
    value: u64,
    read_at: Instant,
}

#[derive(Default)]
struct State {
    /// Bumped by every write of this process; a read remembers its answer only if no write
    /// finished while it was under way.
    generation: u64,
    total: Option<Remembered>,
    design: Option<Remembered>,
}

/// The remembered counts of one database.
pub(super) struct CountCache {
    max_age: Duration,
    state: Mutex<State>,
}

/// Taken before a read whose answer may be remembered.
#[derive(Clone, Copy)]
pub(super) struct ReadTicket(u64);

impl CountCache {
    pub fn new(max_age: Duration) -> Self {
        CountCache { max_age, state: Mutex::new(State::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Before a read: what [`CountCache::remember_total`] and [`CountCache::remember_design`]
    /// check to know no write of this process finished meanwhile.
    pub fn ticket(&self) -> ReadTicket {
        ReadTicket(self.lock().generation)
    }

    fn fresh(&self, remembered: Option<Remembered>) -> Option<u64> {
        remembered.filter(|r| r.read_at.elapsed() < self.max_age).map(|r| r.value)
    }

    /// The database's `doc_count` (design documents included), if read recently enough.
    pub fn total(&self) -> Option<u64> {
        self.fresh(self.lock().total)
    }

    /// The number of design documents, if probed recently enough.
    pub fn design(&self) -> Option<u64> {
        self.fresh(self.lock().design)
    }

    pub fn remember_total(&self, ticket: ReadTicket, value: u64) {
        let mut state = self.lock();
        if !self.max_age.is_zero() && state.generation == ticket.0 {
            state.total = Some(Remembered { value, read_at: Instant::now() });
        }
    }

    pub fn remember_design(&self, ticket: ReadTicket, value: u64) {
        let mut state = self.lock();
        if !self.max_age.is_zero() && state.generation == ticket.0 {
            state.design = Some(Remembered { value, read_at: Instant::now() });
        }
    }

    /// After a data write of this process (whatever its outcome): the total is read again.
    pub fn wrote_documents(&self) {
        let mut state = self.lock();
        state.generation += 1;
        state.total = None;
    }

    /// After a write that may have changed the design documents: both counts are read again.
    pub fn wrote_design(&self) {
        let mut state = self.lock();
        state.generation += 1;
        state.total = None;
        state.design = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_is_served_until_a_write_or_its_age_runs_out() {
        let cache = CountCache::new(Duration::from_secs(60));
        let ticket = cache.ticket();
        cache.remember_total(ticket, 7);
        cache.remember_design(ticket, 2);
        assert_eq!((cache.total(), cache.design()), (Some(7), Some(2)));
        cache.wrote_documents();
        assert_eq!((cache.total(), cache.design()), (None, Some(2)));
        cache.wrote_design();
        assert_eq!(cache.design(), None);

        let short = CountCache::new(Duration::from_millis(1));
        short.remember_total(short.ticket(), 7);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(short.total(), None);
    }

    #[test]
    fn a_read_overlapped_by_a_write_is_not_remembered() {
        let cache = CountCache::new(Duration::from_secs(60));
        let ticket = cache.ticket();
        cache.wrote_documents();
        cache.remember_total(ticket, 7);
        assert_eq!(cache.total(), None);
    }

    #[test]
    fn a_zero_max_age_remembers_nothing() {
        let cache = CountCache::new(Duration::ZERO);
        cache.remember_total(cache.ticket(), 7);
        assert_eq!(cache.total(), None);
    }
}
