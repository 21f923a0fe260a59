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
    pub changes: Vec<Change>,
    /// Where the next page starts.
    pub last_seq: String,
    /// How many changes are known to wait after this page: exact when the backend counts them,
    /// otherwise a lower bound (0 when the page is the end of the feed as far as this read saw).
    pub pending: u64,
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
    let beyond = changes.len().saturating_sub(limit) as u64;
    let waiting_after_page = page.pending.unwrap_or(0);
    if beyond == 0 {
        return Ok(FeedPage { changes, last_seq: page.last_seq, pending: waiting_after_page });
    }
    changes.truncate(limit);
    let last_seq = changes.last().map(|c| c.seq.clone()).unwrap_or(page.last_seq);
    Ok(FeedPage { changes, last_seq, pending: waiting_after_page + beyond })
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

/// Writes NDJSON lines to stdout. A reader that went away (`| head`) ends the output quietly.
struct Lines {
    out: std::io::BufWriter<std::io::Stdout>,
    closed: bool,
}

impl Lines {
    fn new() -> Self {
        Lines { out: std::io::BufWriter::new(std::io::stdout()), closed: false }
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

/// Runs `agentstore changes` on `backend`: prints the changes, then the position line.
pub async fn run(backend: Arc<dyn DocumentBackend>, args: ChangesArgs) -> Result<()> {
    // Handlers first, so an interrupt while the first page is read is still a clean stop.
    let stop = crate::http::shutdown_signal();
    tokio::pin!(stop);
    let mut position = resolve_since(backend.as_ref(), args.since.as_deref()).await?;
    let mut remaining = args.limit;
    let mut lines = Lines::new();
    let mut backoff = PollBackoff::new(FOLLOW_CEILING);
    while remaining != Some(0) && !lines.closed {
        let want = remaining.map_or(DEFAULT_PAGE, |left| usize::try_from(left).unwrap_or(usize::MAX).min(DEFAULT_PAGE));
        let page = tokio::select! {
            () = &mut stop => break,
            page = read_page(backend.as_ref(), position.as_deref(), want) => page?,
        };
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
        if printed > 0 {
            backoff.reset();
            continue;
        }
        if !args.follow {
            break;
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

    #[test]
    fn backoff_doubles_to_its_ceiling_and_resets() {
        let mut backoff = PollBackoff::new(Duration::from_millis(300));
        let pauses: Vec<u128> = (0..5).map(|_| backoff.idle().as_millis()).collect();
        assert_eq!(pauses, [50, 100, 200, 300, 300]);
        backoff.reset();
        assert_eq!(backoff.idle(), Duration::from_millis(50));
    }
}
