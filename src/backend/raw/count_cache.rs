//! Counts a backend makes over an index rather than by reading documents (DynamoDB's
//! `Select=COUNT`, Firestore's COUNT aggregation), remembered so that a client polling
//! `GET /{db}` or `_changes` does not have the whole index read every time, and served again only
//! after a cheap check that nothing changed since (docs/databases.md, "Document counts";
//! docs/couchdb-api.md, "Sequences" and "Several instances").
//!
//! Each kind of count ([`Counted`]) is remembered apart, with a [`Check`]: a window start and the
//! [`Fingerprint`] of what the backend read there before the count (the feed entries at or after
//! the window, and the backend's purge trace). To serve a remembered count, the backend reads the
//! fingerprint of the same window again; the count is served only when it is the same, so a write
//! of any process shows at the next request. Besides, a count is served at most for its max age
//! (the backend URL's `count_max_age_ms`; `0` counts every time), and never after a document
//! write of this process finished (the write generation), so this process's own writes never
//! wait on the index. A window holding more than [`FINGERPRINT_ENTRIES_MAX`] entries gives no
//! fingerprint: that count is not served again (a busy database is counted each time).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// The most feed entries a fingerprint covers: past it the count is not served again, since
/// reading the window would cost about what a count of a small database does.
pub const FINGERPRINT_ENTRIES_MAX: usize = 256;

/// A digest of the feed entries at or after a window start (each a document and its position,
/// or its commit time) and of the backend's purge trace. Any create, update or delete moves the
/// document's one entry to a new position inside the window, and any purge bumps the trace, so
/// an equal fingerprint means no change landed since it was first read (up to a SHA-256
/// collision). The entries are sorted before hashing: shards answer in any order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of `entries` (document, position) and the purge trace `purges`; `None`
    /// past [`FINGERPRINT_ENTRIES_MAX`] entries.
    pub fn of(mut entries: Vec<(String, String)>, purges: u64) -> Option<Fingerprint> {
        if entries.len() > FINGERPRINT_ENTRIES_MAX {
            return None;
        }
        entries.sort();
        let mut digest = Sha256::new();
        digest.update(purges.to_be_bytes());
        for (document, position) in &entries {
            // Lengths first, so that no two lists hash the same text.
            for part in [document, position] {
                digest.update((part.len() as u64).to_be_bytes());
                digest.update(part.as_bytes());
            }
        }
        Some(Fingerprint(digest.finalize().into()))
    }
}

/// What a remembered count is checked against: the window start its fingerprint was read from
/// (a backend's own form: a feed position, a timestamp) and that fingerprint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub window: String,
    pub fingerprint: Fingerprint,
}

/// A count, the write generation it was read at, when it began, and its check (`None`: it is
/// served only to callers that were waiting when it began).
#[derive(Clone)]
struct Remembered {
    generation: u64,
    value: u64,
    begun: Instant,
    check: Option<Check>,
}

/// What a count counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counted {
    /// Live documents (`exact_count`).
    LiveDocuments,
    /// Entries of the change feed: one per document, live or deleted (`feed_length`).
    FeedEntries,
}

impl Counted {
    fn slot(self) -> usize {
        match self {
            Counted::LiveDocuments => 0,
            Counted::FeedEntries => 1,
        }
    }
}

/// The remembered counts of one store, checked before each use, forgotten by every write of this
/// process.
pub struct CountCache {
    max_age: Duration,
    /// Bumped after every document write of this process (whatever its outcome): a count read
    /// while a write was under way was read at an older generation and is never served.
    generation: AtomicU64,
    remembered: Mutex<[Option<Remembered>; 2]>,
    /// Held while a count is read, so concurrent callers wait for that one and share its answer
    /// rather than each reading the whole index.
    counting: tokio::sync::Mutex<()>,
}

impl CountCache {
    pub fn new(max_age: Duration) -> Self {
        CountCache {
            max_age,
            generation: AtomicU64::new(0),
            remembered: Mutex::new([None, None]),
            counting: tokio::sync::Mutex::new(()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, [Option<Remembered>; 2]> {
        self.remembered.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The remembered count of `what` when no write of this process finished since it began and
    /// it is younger than the max age (not yet checked against the backend).
    fn current(&self, what: Counted) -> Option<Remembered> {
        let generation = self.generation.load(Ordering::SeqCst);
        self.lock()[what.slot()].clone().filter(|r| r.generation == generation && r.begun.elapsed() < self.max_age)
    }

    /// The count of `what`: the remembered one when it is current and the backend's fingerprint
    /// of its window (`fingerprint(window)`) is still the one read before it, else `count`'s
    /// (the count and its check), remembered. Callers at once wait for one count and share it
    /// rather than each reading the whole index.
    pub async fn get_or_count<C, V, VF>(&self, what: Counted, count: C, fingerprint: V) -> crate::Result<u64>
    where
        C: std::future::Future<Output = crate::Result<(u64, Option<Check>)>>,
        V: Fn(String) -> VF,
        VF: std::future::Future<Output = crate::Result<Option<Fingerprint>>>,
    {
        let arrived = Instant::now();
        if let Some(value) = self.validated(what, &fingerprint).await? {
            return Ok(value);
        }
        let _turn = self.counting.lock().await;
        // A count that began after this caller arrived holds every change acknowledged before it.
        if let Some(r) = self.current(what).filter(|r| r.begun >= arrived) {
            return Ok(r.value);
        }
        let generation = self.generation.load(Ordering::SeqCst);
        let begun = Instant::now();
        let (value, check) = count.await?;
        self.lock()[what.slot()] = Some(Remembered { generation, value, begun, check });
        Ok(value)
    }

    /// The remembered count of `what` if it is current and its check holds now.
    async fn validated<V, VF>(&self, what: Counted, fingerprint: &V) -> crate::Result<Option<u64>>
    where
        V: Fn(String) -> VF,
        VF: std::future::Future<Output = crate::Result<Option<Fingerprint>>>,
    {
        let Some(Remembered { value, check: Some(check), .. }) = self.current(what) else { return Ok(None) };
        let now = fingerprint(check.window).await?;
        Ok((now == Some(check.fingerprint)).then_some(value))
    }

    /// After a document write of this process: the next count is read anew.
    pub fn wrote(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A backend's counts and fingerprints as a test sets them, and how often each was read.
    struct Fake {
        value: AtomicU64,
        /// The entries in the window; their number past the limit gives no fingerprint.
        entries: Mutex<Vec<(String, String)>>,
        purges: AtomicU64,
        counts: AtomicUsize,
        checks: AtomicUsize,
    }

    impl Fake {
        fn new(value: u64) -> Fake {
            Fake {
                value: value.into(),
                entries: Mutex::new(vec![("a".into(), "1".into())]),
                purges: 0.into(),
                counts: 0.into(),
                checks: 0.into(),
            }
        }

        fn fingerprint(&self) -> Option<Fingerprint> {
            let entries = self.entries.lock().map(|e| e.clone()).unwrap_or_default();
            Fingerprint::of(entries, self.purges.load(Ordering::SeqCst))
        }

        async fn get(&self, cache: &CountCache, what: Counted) -> u64 {
            let count = async {
                self.counts.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(5)).await;
                let fingerprint = self.fingerprint();
                let check = fingerprint.map(|fingerprint| Check { window: "w".into(), fingerprint });
                Ok((self.value.load(Ordering::SeqCst), check))
            };
            let fingerprint = |window: String| async move {
                assert_eq!(window, "w", "the window is the one the count was read with");
                self.checks.fetch_add(1, Ordering::SeqCst);
                Ok(self.fingerprint())
            };
            cache.get_or_count(what, count, fingerprint).await.expect("count")
        }

        fn counted(&self) -> usize {
            self.counts.load(Ordering::SeqCst)
        }
    }

    #[tokio::test]
    async fn an_unchanged_fingerprint_serves_the_count_and_a_changed_one_counts_anew() {
        let cache = CountCache::new(Duration::from_secs(60));
        let fake = Fake::new(7);
        assert_eq!(fake.get(&cache, Counted::LiveDocuments).await, 7);
        assert_eq!(fake.get(&cache, Counted::LiveDocuments).await, 7);
        assert_eq!((fake.counted(), fake.checks.load(Ordering::SeqCst)), (1, 1), "checked, not counted");
        // Another process writes: its entry moves inside the window.
        fake.value.store(8, Ordering::SeqCst);
        fake.entries.lock().expect("entries").push(("b".into(), "2".into()));
        assert_eq!(fake.get(&cache, Counted::LiveDocuments).await, 8);
        assert_eq!(fake.counted(), 2);
        // Another process purges: the trace moves though the window's entries do not.
        fake.value.store(7, Ordering::SeqCst);
        fake.purges.store(1, Ordering::SeqCst);
        assert_eq!(fake.get(&cache, Counted::LiveDocuments).await, 7);
        assert_eq!(fake.get(&cache, Counted::LiveDocuments).await, 7);
        assert_eq!(fake.counted(), 3);
    }

    #[tokio::test]
    async fn callers_waiting_for_a_count_share_the_next_one() {
        let cache = CountCache::new(Duration::from_secs(60));
        let fake = Fake::new(7);
        // Over the limit: nothing is served again, so only sharing saves counts.
        *fake.entries.lock().expect("entries") =
            (0..=FINGERPRINT_ENTRIES_MAX).map(|n| (format!("d{n}"), n.to_string())).collect();
        let arriving_during_the_count = || async {
            tokio::time::sleep(Duration::from_millis(1)).await;
            fake.get(&cache, Counted::LiveDocuments).await
        };
        // The first counts; the two arriving during its count wait, and share the one that
        // begins after they arrived (the first's may miss a write acknowledged to them).
        let (first, second, third) = tokio::join!(
            fake.get(&cache, Counted::LiveDocuments),
            arriving_during_the_count(),
            arriving_during_the_count()
        );
        assert_eq!((first, second, third), (7, 7, 7));
        assert_eq!(fake.counted(), 2);
    }

    #[tokio::test]
    async fn a_window_past_the_limit_is_counted_every_time() {
        let cache = CountCache::new(Duration::from_secs(60));
        let fake = Fake::new(7);
        *fake.entries.lock().expect("entries") =
            (0..=FINGERPRINT_ENTRIES_MAX).map(|n| (format!("d{n}"), n.to_string())).collect();
        fake.get(&cache, Counted::FeedEntries).await;
        fake.get(&cache, Counted::FeedEntries).await;
        assert_eq!((fake.counted(), fake.checks.load(Ordering::SeqCst)), (2, 0));
    }

    #[tokio::test]
    async fn a_write_of_this_process_forgets_both_kinds_without_a_check() {
        let cache = CountCache::new(Duration::from_secs(60));
        let fake = Fake::new(7);
        fake.get(&cache, Counted::LiveDocuments).await;
        fake.get(&cache, Counted::FeedEntries).await;
        cache.wrote();
        fake.get(&cache, Counted::LiveDocuments).await;
        fake.get(&cache, Counted::FeedEntries).await;
        assert_eq!((fake.counted(), fake.checks.load(Ordering::SeqCst)), (4, 0));
        // Each kind is remembered apart.
        fake.get(&cache, Counted::FeedEntries).await;
        assert_eq!((fake.counted(), fake.checks.load(Ordering::SeqCst)), (4, 1));
    }

    #[tokio::test]
    async fn a_count_overlapped_by_a_write_is_never_served() {
        let cache = CountCache::new(Duration::from_secs(60));
        let fake = Fake::new(7);
        let count = async {
            cache.wrote();
            Ok((7, fake.fingerprint().map(|fingerprint| Check { window: "w".into(), fingerprint })))
        };
        cache.get_or_count(Counted::LiveDocuments, count, |_| async { Ok(fake.fingerprint()) }).await.expect("count");
        assert!(cache.current(Counted::LiveDocuments).is_none());
    }

    #[tokio::test]
    async fn the_max_age_bounds_a_checked_count_and_zero_counts_every_time() {
        let short = CountCache::new(Duration::from_millis(1));
        let fake = Fake::new(7);
        fake.get(&short, Counted::LiveDocuments).await;
        std::thread::sleep(Duration::from_millis(5));
        fake.get(&short, Counted::LiveDocuments).await;
        assert_eq!((fake.counted(), fake.checks.load(Ordering::SeqCst)), (2, 0));

        let zero = CountCache::new(Duration::ZERO);
        let fake = Fake::new(7);
        fake.get(&zero, Counted::LiveDocuments).await;
        fake.get(&zero, Counted::LiveDocuments).await;
        assert_eq!((fake.counted(), fake.checks.load(Ordering::SeqCst)), (2, 0));
    }

    #[test]
    fn a_fingerprint_ignores_order_but_not_parts() {
        let pair = |d: &str, p: &str| (d.to_owned(), p.to_owned());
        let one = Fingerprint::of(vec![pair("a", "1"), pair("b", "2")], 0);
        assert_eq!(one, Fingerprint::of(vec![pair("b", "2"), pair("a", "1")], 0));
        assert_ne!(one, Fingerprint::of(vec![pair("a", "1"), pair("b", "3")], 0));
        assert_ne!(one, Fingerprint::of(vec![pair("a", "1"), pair("b", "2")], 1));
        assert_ne!(Fingerprint::of(vec![pair("ab", "")], 0), Fingerprint::of(vec![pair("a", "b")], 0));
    }
}
