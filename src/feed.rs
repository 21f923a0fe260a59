//! Reading the change feed ([`DocumentBackend::changes`]) for its consumers: `agentstore changes`
//! and `GET /v1/changes` on `serve`.
//!
//! Both read in bounded pages: a page asks the backend for one change more than it returns, so it
//! can tell whether more are waiting even when the backend cannot count them, and continues from
//! the last change it returned. Both poll for new changes with [`PollBackoff`] when following.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use serde::Serialize;

use crate::backend::{Change, DocumentBackend};
use crate::error::{Error, ErrorKind, Result};

/// Most changes one page (one backend call) returns.
pub const MAX_PAGE: usize = 10_000;
/// Changes per page when the caller does not say.
pub const DEFAULT_PAGE: usize = 1_000;

/// The `since` value that means "after everything committed so far" (CouchDB's `since=now`).
pub const SINCE_NOW: &str = "now";

/// Where to start reading: the start of the feed, or after a position.
pub type Position = Option<String>;

/// Reads the `since` a caller gave: absent, empty or `0` is the start of the feed (CouchDB's
/// convention), `now` the backend's current position, anything else a token the backend gave.
pub async fn resolve_since(backend: &dyn DocumentBackend, since: Option<&str>) -> Result<Position> {
    match since {
        None | Some("") | Some("0") => Ok(None),
        Some(SINCE_NOW) => backend.change_position().await.map(Some),
        Some(token) => Ok(Some(token.to_owned())),
    }
}

/// One page of the feed as the consumers show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeedPage {
    /// The settled changes, then the unsettled tail (see [`crate::backend::ChangesPage`]).
    pub changes: Vec<Change>,
    /// Where the next page starts.
    pub last_seq: String,
    /// How many changes are known to wait after this page: exact when the backend counts them,
    /// otherwise a lower bound; 0 only when the page is the end of the feed as far as this read
    /// saw, the unsettled tail included (1 when the backend cannot tell: read again).
    pub pending: u64,
    /// How many of `changes`, at its end, are the unsettled tail: a reader from `last_seq` may be
    /// handed them again, once, when they settle (on DynamoDB only those past the most its token
    /// remembers, `REMEMBERED_TAIL`). `last_seq` says the whole page was taken, tail included: a
    /// reader that leaves the tail must not continue from it.
    pub unsettled: usize,
}

impl FeedPage {
    /// The settled changes only, before the unsettled tail.
    pub fn settled(&self) -> &[Change] {
        &self.changes[..self.changes.len() - self.unsettled.min(self.changes.len())]
    }
}

/// At most `limit` changes after `since` (1 ≤ `limit` ≤ [`MAX_PAGE`]). A `since` the backend
/// does not recognise is an `InvalidInput` error naming `since`.
pub async fn read_page(backend: &dyn DocumentBackend, since: Option<&str>, limit: usize) -> Result<FeedPage> {
    let limit = limit.clamp(1, MAX_PAGE);
    let page = backend.changes(since, limit + 1).await.map_err(|err| match err.kind() {
        // `since` is the only input: the message must name it, whatever words the backend used.
        ErrorKind::InvalidInput if !err.message().contains("since") => {
            Error::invalid("since", "is not a position of this store's change feed").with_source(err)
        }
        _ => err,
    })?;
    let mut changes = page.changes;
    let unsettled = page.unsettled.min(changes.len());
    let beyond = changes.len().saturating_sub(limit);
    // A backend that cannot tell whether more follow has not reached the end: at least one more
    // read is needed to know.
    let waiting_after_page = page.pending.unwrap_or(1);
    if beyond == 0 {
        return Ok(FeedPage { changes, last_seq: page.last_seq, pending: waiting_after_page, unsettled });
    }
    changes.truncate(limit);
    // The change held back is the last one, so it leaves the tail first.
    let unsettled = unsettled.saturating_sub(beyond);
    let last_seq = changes.last().map(|c| c.seq.clone()).unwrap_or(page.last_seq);
    Ok(FeedPage { changes, last_seq, pending: waiting_after_page + beyond as u64, unsettled })
}

/// For one answer that reads the feed more than once (a continuous or longpoll `_changes`,
/// `changes --follow`): the unsettled changes it has delivered, so that each is not delivered a
/// second time when it settles. Across answers a change may come twice (a new answer knows
/// nothing of the last one's); within one, once per revision.
#[derive(Debug, Default)]
pub struct DeliveredTail {
    /// Id → the revision delivered unsettled and not yet seen settled.
    revisions: std::collections::HashMap<String, crate::backend::Revision>,
}

impl DeliveredTail {
    /// The most remembered at once: past it the memory is cleared, which costs only repeats.
    const MAX_REMEMBERED: usize = 100_000;

    /// Drops from `page` the changes this answer has delivered already at the same revision, and
    /// remembers the tail it delivers now.
    pub fn drop_repeats(&mut self, page: &mut FeedPage) {
        let settled = page.changes.len() - page.unsettled.min(page.changes.len());
        let mut kept = Vec::with_capacity(page.changes.len());
        let mut kept_unsettled = 0;
        for (n, change) in std::mem::take(&mut page.changes).into_iter().enumerate() {
            if n < settled {
                // Settled now: whatever happens, the id's tail entry is no longer needed.
                if self.revisions.remove(&change.id).is_some_and(|rev| rev == change.rev) {
                    continue;
                }
            } else {
                if self.revisions.get(&change.id) == Some(&change.rev) {
                    continue;
                }
                if self.revisions.len() >= Self::MAX_REMEMBERED {
                    self.revisions.clear();
                }
                self.revisions.insert(change.id.clone(), change.rev.clone());
                kept_unsettled += 1;
            }
            kept.push(change);
        }
        page.changes = kept;
        page.unsettled = kept_unsettled;
    }
}

/// The pause between polls of a feed that has nothing new: 50 ms, doubling up to a ceiling, back
/// to 50 ms as soon as something arrives.
#[derive(Debug, Clone)]
pub struct PollBackoff {
    next: Duration,
    ceiling: Duration,
}

impl PollBackoff {
    const FIRST: Duration = Duration::from_millis(50);

    pub fn new(ceiling: Duration) -> Self {
        PollBackoff { next: Self::FIRST.min(ceiling), ceiling }
    }

    /// The pause before the next poll of an idle feed.
    pub fn idle(&mut self) -> Duration {
        let pause = self.next;
        self.next = (self.next * 2).min(self.ceiling);
        pause
    }

    /// Something arrived: the next idle pause starts short again.
    pub fn reset(&mut self) {
        self.next = Self::FIRST.min(self.ceiling);
    }
}

// ---- `agentstore changes` ----

/// `agentstore changes`.
#[derive(Debug, Clone, Args)]
pub struct ChangesArgs {
    /// Start after this position: a `seq` or `last_seq` printed before, `now` (only changes made
    /// from now on), or `0` (the start, the default)
    #[arg(long, value_name = "TOKEN")]
    pub since: Option<String>,
    /// Print at most this many changes in all
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub limit: Option<u64>,
    /// At the end of the feed, wait for new changes (polling, up to 1 s apart) until SIGINT or
    /// SIGTERM, then print the position line and exit 0
    #[arg(long)]
    pub follow: bool,
}

/// The longest pause between polls of `changes --follow`.
const FOLLOW_CEILING: Duration = Duration::from_secs(1);

/// One output line per change.
#[derive(Serialize)]
struct ChangeLine<'a> {
    seq: &'a str,
    id: &'a str,
    rev: &'a str,
    deleted: bool,
}

/// The last output line: where to continue.
#[derive(Serialize)]
struct PositionLine<'a> {
    last_seq: &'a str,
}

/// Writes NDJSON lines. A reader that went away (`| head`) ends the output quietly.
struct Lines<W: Write> {
    out: std::io::BufWriter<W>,
    closed: bool,
}

impl<W: Write> Lines<W> {
    fn new(out: W) -> Self {
        Lines { out: std::io::BufWriter::new(out), closed: false }
    }

    fn write<T: Serialize>(&mut self, line: &T) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        let result = serde_json::to_writer(&mut self.out, line)
            .map_err(std::io::Error::from)
            .and_then(|()| self.out.write_all(b"\n"));
        self.settle(result)
    }

    fn flush(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        let result = self.out.flush();
        self.settle(result)
    }

    fn settle(&mut self, result: std::io::Result<()>) -> Result<()> {
        match result {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                self.closed = true;
                Ok(())
            }
            other => {
                other.map_err(|e| Error::new(ErrorKind::Internal, "cannot write to standard output").with_source(e))
            }
        }
    }
}

/// Runs `agentstore changes` on `backend`: prints the changes on stdout, then the position line;
/// with `--follow`, until SIGINT or SIGTERM.
pub async fn run(backend: Arc<dyn DocumentBackend>, args: ChangesArgs) -> Result<()> {
    // Handlers first, so an interrupt while the first page is read is still a clean stop.
    let stop = crate::server::shutdown_signal();
    write_changes(backend, args, std::io::stdout(), stop).await
}

/// `changes` writing to `out`, following (with `--follow`) until `stop` resolves.
pub async fn write_changes(
    backend: Arc<dyn DocumentBackend>,
    args: ChangesArgs,
    out: impl Write,
    stop: impl std::future::Future<Output = ()>,
) -> Result<()> {
    tokio::pin!(stop);
    let mut position = resolve_since(backend.as_ref(), args.since.as_deref()).await?;
    let mut remaining = args.limit;
    let mut lines = Lines::new(out);
    let mut backoff = PollBackoff::new(FOLLOW_CEILING);
    let mut delivered = DeliveredTail::default();
    while remaining != Some(0) && !lines.closed {
        let want = remaining.map_or(DEFAULT_PAGE, |left| usize::try_from(left).unwrap_or(usize::MAX).min(DEFAULT_PAGE));
        let mut page = tokio::select! {
            () = &mut stop => break,
            page = read_page(backend.as_ref(), position.as_deref(), want) => page?,
        };
        delivered.drop_repeats(&mut page);
        for change in &page.changes {
            lines.write(&ChangeLine {
                seq: &change.seq,
                id: &change.id,
                rev: change.rev.as_str(),
                deleted: change.deleted,
            })?;
        }
        lines.flush()?;
        let printed = page.changes.len() as u64;
        remaining = remaining.map(|left| left.saturating_sub(printed));
        position = Some(page.last_seq);
        if page.pending > 0 {
            backoff.reset();
            continue;
        }
        if !args.follow {
            break;
        }
        if printed > 0 {
            backoff.reset();
            continue;
        }
        tokio::select! {
            () = &mut stop => break,
            () = tokio::time::sleep(backoff.idle()) => {}
        }
    }
    let last_seq = match position {
        Some(position) => position,
        // Nothing was read (an interrupt before the first page): the start is where to continue.
        None => "0".to_owned(),
    };
    lines.write(&PositionLine { last_seq: &last_seq })?;
    lines.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer whose bytes the test can read while the command runs.
    #[derive(Clone, Default)]
    struct Shared(Arc<std::sync::Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(data);
            Ok(data.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Shared {
        fn lines(&self) -> Vec<serde_json::Value> {
            let text = String::from_utf8(self.0.lock().expect("lock").clone()).expect("UTF-8");
            text.lines().map(|line| serde_json::from_str(line).expect("a JSON line")).collect()
        }
    }

    /// Waits until `out` holds `n` lines.
    async fn until_lines(out: &Shared, n: usize) -> Vec<serde_json::Value> {
        for _ in 0..500 {
            let lines = out.lines();
            if lines.len() >= n {
                return lines;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("fewer than {n} lines after 5 s: {:?}", out.lines());
    }

    #[tokio::test]
    async fn follow_prints_changes_made_while_it_waits_then_the_position() {
        use crate::backend::Precondition;
        let dir = tempfile::tempdir().expect("temp dir");
        let store: Arc<dyn DocumentBackend> =
            Arc::new(crate::backend::embedded::EmbeddedBackend::open(&dir.path().join("s.redb")).await.expect("open"));
        let body = serde_json::json!({ "value": 1 }).as_object().expect("object").clone();
        store.put("a", &body, Precondition::MustNotExist).await.expect("put a");
        let out = Shared::default();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let args = ChangesArgs { since: None, limit: None, follow: true };
        let following = tokio::spawn(write_changes(Arc::clone(&store), args, out.clone(), async move {
            let _ = stopped.await;
        }));
        assert_eq!(until_lines(&out, 1).await[0]["id"], "a");
        // Long enough for the backoff to grow to its ceiling.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let rev = store.put("b", &body, Precondition::MustNotExist).await.expect("put b");
        let lines = until_lines(&out, 2).await;
        assert_eq!((&lines[1]["id"], &lines[1]["rev"]), (&serde_json::json!("b"), &serde_json::json!(rev.0)));
        store.delete("a", &store.get("a").await.expect("get").expect("a").rev).await.expect("delete a");
        let lines = until_lines(&out, 3).await;
        assert_eq!((&lines[2]["id"], &lines[2]["deleted"]), (&serde_json::json!("a"), &serde_json::json!(true)));
        assert!(!following.is_finished(), "--follow ended by itself");
        stop.send(()).expect("still following");
        following.await.expect("task").expect("changes");
        let lines = out.lines();
        assert_eq!(lines.len(), 4, "{lines:?}");
        assert_eq!(lines[3], serde_json::json!({ "last_seq": lines[2]["seq"] }));
    }

    fn change(id: &str, rev: &str) -> Change {
        Change { seq: format!("{id}@{rev}"), id: id.into(), rev: crate::backend::Revision(rev.into()), deleted: false }
    }

    fn page(changes: Vec<Change>, unsettled: usize) -> FeedPage {
        FeedPage { changes, last_seq: "s".into(), pending: 0, unsettled }
    }

    fn ids(page: &FeedPage) -> Vec<&str> {
        page.changes.iter().map(|c| c.id.as_str()).collect()
    }

    #[test]
    fn within_one_answer_a_tail_change_is_not_delivered_again_when_it_settles() {
        let mut delivered = DeliveredTail::default();
        let mut first = page(vec![change("a", "1"), change("b", "1"), change("c", "1")], 2);
        delivered.drop_repeats(&mut first);
        assert_eq!((ids(&first), first.unsettled), (vec!["a", "b", "c"], 2));
        // b settled at the revision delivered: dropped; c settled at a newer one: delivered; d new.
        let mut second = page(vec![change("b", "1"), change("c", "2"), change("d", "1")], 1);
        delivered.drop_repeats(&mut second);
        assert_eq!((ids(&second), second.unsettled), (vec!["c", "d"], 1));
        assert_eq!(second.settled().len(), 1);
        // e settled and new: delivered; d shown in the tail again at the same revision: dropped.
        let mut third = page(vec![change("e", "1"), change("d", "1")], 1);
        delivered.drop_repeats(&mut third);
        assert_eq!((ids(&third), third.unsettled), (vec!["e"], 0));
    }

    #[test]
    fn a_page_cut_to_its_limit_loses_its_last_changes_from_the_tail_first() {
        struct Fixed(Vec<Change>, usize);
        #[async_trait::async_trait]
        impl crate::backend::raw::layer::Layered for Fixed {
            fn inner(&self) -> &dyn DocumentBackend {
                unreachable!("only changes is called")
            }
            async fn changes(&self, _: Option<&str>, _: usize) -> Result<crate::backend::ChangesPage> {
                Ok(crate::backend::ChangesPage {
                    changes: self.0.clone(),
                    last_seq: "end".into(),
                    pending: Some(0),
                    unsettled: self.1,
                })
            }
        }
        let runtime = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        let three = vec![change("a", "1"), change("b", "1"), change("c", "1")];
        let cut = runtime.block_on(read_page(&Fixed(three.clone(), 2), None, 2)).expect("page");
        assert_eq!((ids(&cut), cut.unsettled, cut.pending, cut.last_seq.as_str()), (vec!["a", "b"], 1, 1, "b@1"));
        let settled_cut = runtime.block_on(read_page(&Fixed(three.clone(), 1), None, 1)).expect("page");
        assert_eq!((ids(&settled_cut), settled_cut.unsettled, settled_cut.pending), (vec!["a"], 0, 2));
        let whole = runtime.block_on(read_page(&Fixed(three, 2), None, 3)).expect("page");
        assert_eq!((whole.unsettled, whole.pending, whole.last_seq.as_str()), (2, 0, "end"));
    }

    #[test]
    fn backoff_doubles_to_its_ceiling_and_resets() {
        let mut backoff = PollBackoff::new(Duration::from_millis(300));
        let pauses: Vec<u128> = (0..5).map(|_| backoff.idle().as_millis()).collect();
        assert_eq!(pauses, [50, 100, 200, 300, 300]);
        backoff.reset();
        assert_eq!(backoff.idle(), Duration::from_millis(50));
    }
}
