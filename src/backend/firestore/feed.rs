//! The change feed's positions (see `docs/firestore-layout.md`, "Change feed").
//!
//! Every write sets `_changedAt` to the server's request time, which Firestore may assign a
//! little before the commit time (`updateTime`): up to the settle window `W`. A feed token says
//! that every write committed at or before its `floor` (a read time) has been reported. The next
//! sweep reads, at one snapshot `R`, the documents with `_changedAt > floor - W` in
//! (`_changedAt`, `__name__`) order, skips those whose `updateTime <= floor` (reported already),
//! and when it reaches the end the new floor is `R`. A sweep longer than one page keeps its
//! snapshot and a cursor in the token, so every page of it reads the same committed state.

use chrono::{DateTime, SecondsFormat, Utc};

use crate::error::{Error, Result};

/// A position in the feed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FeedToken {
    /// Every write committed at or before this read time has been reported; `None`: nothing yet.
    pub floor: Option<String>,
    /// A sweep under way.
    pub sweep: Option<Sweep>,
}

/// A sweep of the feed that took more than one page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sweep {
    /// The read time every page of the sweep reads at.
    pub snapshot: String,
    /// The last position returned: `_changedAt` and the Firestore document id.
    pub changed_at: String,
    pub document_id: String,
}

const SEPARATOR: char = '~';

impl FeedToken {
    pub fn after_sweep(read_time: &str) -> FeedToken {
        FeedToken { floor: Some(read_time.to_owned()), sweep: None }
    }

    pub fn parse(text: &str) -> Result<FeedToken> {
        let bad = || Error::invalid("since", format!("{text:?} is not a position of this Firestore change feed"));
        let mut parts = text.splitn(4, SEPARATOR);
        let floor = parts.next().filter(|f| !f.is_empty()).map(str::to_owned);
        if let Some(floor) = &floor {
            timestamp(floor).ok_or_else(bad)?;
        }
        let sweep = match (parts.next(), parts.next(), parts.next()) {
            (None, None, None) => None,
            (Some(snapshot), Some(changed_at), Some(document_id)) if !document_id.is_empty() => {
                timestamp(snapshot).ok_or_else(bad)?;
                timestamp(changed_at).ok_or_else(bad)?;
                Some(Sweep {
                    snapshot: snapshot.to_owned(),
                    changed_at: changed_at.to_owned(),
                    document_id: document_id.to_owned(),
                })
            }
            _ => return Err(bad()),
        };
        Ok(FeedToken { floor, sweep })
    }

    pub fn render(&self) -> String {
        let floor = self.floor.as_deref().unwrap_or("");
        match &self.sweep {
            None => floor.to_owned(),
            Some(s) => {
                format!("{floor}{SEPARATOR}{}{SEPARATOR}{}{SEPARATOR}{}", s.snapshot, s.changed_at, s.document_id)
            }
        }
    }

    /// The lowest `_changedAt` a sweep from this token must read: the floor less the settle window.
    pub fn lowest_changed_at(&self, settle: chrono::Duration) -> Option<String> {
        let floor = timestamp(self.floor.as_deref()?)?;
        Some((floor - settle).to_rfc3339_opts(SecondsFormat::Nanos, true))
    }

    /// Whether a document committed at `update_time` was already reported before this token.
    pub fn reported(&self, update_time: &str) -> bool {
        match (self.floor.as_deref().and_then(timestamp), timestamp(update_time)) {
            (Some(floor), Some(committed)) => committed <= floor,
            _ => false,
        }
    }
}

pub fn timestamp(text: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(text).ok().map(|t| t.with_timezone(&Utc))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_refuse_garbage() {
        let tokens = [
            FeedToken::default(),
            FeedToken::after_sweep("2026-01-01T00:00:01.5Z"),
            FeedToken {
                floor: None,
                sweep: Some(Sweep {
                    snapshot: "2026-01-01T00:00:02Z".into(),
                    changed_at: "2026-01-01T00:00:01.001Z".into(),
                    document_id: "u:a~b:k".into(),
                }),
            },
        ];
        for token in tokens {
            assert_eq!(FeedToken::parse(&token.render()).unwrap(), token);
        }
        for bad in ["yesterday", "2026-01-01T00:00:00Z~x", "~2026-01-01T00:00:00Z~2026-01-01T00:00:00Z~"] {
            assert!(FeedToken::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_window_reaches_back_and_reported_writes_are_skipped() {
        let token = FeedToken::after_sweep("2026-01-01T00:00:10Z");
        assert_eq!(token.lowest_changed_at(chrono::Duration::seconds(5)).unwrap(), "2026-01-01T00:00:05.000000000Z");
        assert!(token.reported("2026-01-01T00:00:09.999999Z"));
        assert!(token.reported("2026-01-01T00:00:10Z"));
        assert!(!token.reported("2026-01-01T00:00:10.000001Z"));
        assert!(!FeedToken::default().reported("2026-01-01T00:00:10Z"));
    }
}
