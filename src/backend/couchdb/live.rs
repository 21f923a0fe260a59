//! Keeping a tombstone's revision from reviving or re-deleting a document.
//!
//! CouchDB accepts any leaf revision as the parent of an update, tombstones included: a `PUT`
//! naming a tombstone's revision brings the document back, and a `DELETE` naming it writes a
//! second tombstone. The trait wants a conflict and a not-found there. Whether a revision is a
//! deletion never changes, so one look (`HEAD /db/id`: 404 when the document is deleted or
//! missing) before the write is enough, whatever other writers do in between.
//!
//! That look would cost every conditional write a round trip, so the backend remembers the
//! revisions it has itself seen live (returned by `get`, or written by `put`): a revision seen
//! live is not a deletion, so a write naming one needs no look. The facade always updates and
//! deletes with the revision its `get` just returned, so only revisions learned elsewhere (the
//! change feed, `revisions`, another process) are looked up. The memory holds at most
//! [`REMEMBERED`] pairs and is emptied when full (forgetting only costs a look).

use std::collections::HashSet;
use std::sync::Mutex;

use crate::backend::Revision;

/// How many (id, revision) pairs are remembered at most.
const REMEMBERED: usize = 4096;

#[derive(Default)]
pub(super) struct LiveRevisions {
    seen: Mutex<HashSet<(String, String)>>,
}

impl LiveRevisions {
    pub fn remember(&self, id: &str, rev: &Revision) {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen.len() >= REMEMBERED {
            seen.clear();
        }
        seen.insert((id.to_owned(), rev.as_str().to_owned()));
    }

    pub fn known(&self, id: &str, rev: &Revision) -> bool {
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.contains(&(id.to_owned(), rev.as_str().to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_pairs_and_stays_bounded() {
        let live = LiveRevisions::default();
        let rev = Revision("1-a".into());
        live.remember("x", &rev);
        assert!(live.known("x", &rev));
        assert!(!live.known("y", &rev));
        assert!(!live.known("x", &Revision("2-b".into())));
        for n in 0..REMEMBERED + 10 {
            live.remember(&format!("id{n}"), &rev);
        }
        assert!(live.seen.lock().unwrap().len() <= REMEMBERED);
    }
}
