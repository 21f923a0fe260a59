//! Server-wide byte budgets: a semaphore counting bytes, which both faces use to bound the memory
//! of request bodies being read and parsed at once (the REST face in `http::body`, the CouchDB
//! face in `couchdb_api::request`). A request beyond a budget waits for earlier ones to finish.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The budget is counted in permits of this many bytes (a semaphore counts in `u32`).
const PERMIT_BYTES: usize = 1024;

/// Bytes counted by one semaphore, in permits of [`PERMIT_BYTES`]; one request may take all of it.
pub struct ByteBudget {
    permits: Arc<Semaphore>,
    total_permits: u32,
    /// The bytes it was made of.
    total_bytes: usize,
}

/// A budget can no longer be taken: the server is stopping (each face answers its own 503).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stopping;

impl ByteBudget {
    /// A budget of `bytes` (at least one permit).
    pub fn new(bytes: usize) -> Self {
        let total_permits = permits(bytes);
        ByteBudget { permits: Arc::new(Semaphore::new(total_permits as usize)), total_permits, total_bytes: bytes }
    }

    /// The bytes the budget was made of.
    pub fn total_bytes(&self) -> usize {
        self.total_bytes
    }

    /// Waits for `bytes` of the budget (all of it, if `bytes` is more); the share is given back
    /// when the permit is dropped.
    pub async fn take(&self, bytes: usize) -> Result<OwnedSemaphorePermit, Stopping> {
        let wanted = permits(bytes).min(self.total_permits);
        Arc::clone(&self.permits).acquire_many_owned(wanted).await.map_err(|_| Stopping)
    }

    /// Bytes of the budget not taken now (in whole permits).
    pub fn available_bytes(&self) -> usize {
        self.permits.available_permits().saturating_mul(PERMIT_BYTES)
    }
}

/// Permits for `bytes`, rounded up, at least one.
fn permits(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(PERMIT_BYTES).max(1)).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request wanting more than the whole budget gets all of it (it waits for the others,
    /// never forever), and every share comes back when dropped.
    #[tokio::test]
    async fn shares_are_capped_at_the_budget_and_given_back() {
        let budget = ByteBudget::new(10 * PERMIT_BYTES);
        assert_eq!(budget.available_bytes(), 10 * PERMIT_BYTES);
        let small = budget.take(1).await.unwrap();
        assert_eq!(budget.available_bytes(), 9 * PERMIT_BYTES, "one byte takes a whole permit");
        drop(small);
        let everything = budget.take(100 * PERMIT_BYTES).await.unwrap();
        assert_eq!(budget.available_bytes(), 0);
        drop(everything);
        assert_eq!(budget.available_bytes(), 10 * PERMIT_BYTES);
    }
}
