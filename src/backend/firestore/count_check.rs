//! The check that a remembered count of the feed's entries still holds
//! ([`crate::backend::raw::count_cache`]; docs/firestore-layout.md, "Remembered counts"): the
//! documents whose `_changedAt` is at or after a window start, with their commit times, and the
//! purge trace (`{collection}_meta/purges`), a counter every erasure's commit increments.
//!
//! A count is a COUNT aggregation at a read time R; its fingerprint is read at the same R, over
//! the window from R less the settle window. Every write committed after R has a commit time after
//! R and, under the feed's settle assumption, a `_changedAt` at or after R less the settle, so it
//! puts a document with a new commit time in the window: the fingerprint changes. An erasure
//! removes a document instead, and increments the trace in the same commit.

use chrono::SecondsFormat;
use reqwest::Method;
use serde_json::{json, Value};

use super::backend::FirestoreBackend;
use super::core::{field_filter, select, text, Call};
use super::feed::timestamp;
use super::layout;
use crate::backend::raw::count_cache::{Check, Fingerprint, FINGERPRINT_ENTRIES_MAX};
use crate::error::Result;

/// The purge trace's document in the meta collection, beside the layout marker.
const PURGE_TRACE_DOCUMENT: &str = "purges";
/// The purge trace's counter field.
const PURGE_COUNT: &str = "purges";

impl FirestoreBackend {
    /// The count of the feed's entries (every document of the collection) at a read time, with
    /// the check read at the same read time.
    pub(super) async fn feed_count_with_check(&self) -> Result<(u64, Option<Check>)> {
        let (all, read_time) = self.count(None, None).await?;
        let Some(read_at) = read_time.as_deref().and_then(timestamp) else { return Ok((all, None)) };
        let settle = chrono::Duration::from_std(self.config.settle).unwrap_or(chrono::Duration::zero());
        let window = (read_at - settle).to_rfc3339_opts(SecondsFormat::Nanos, true);
        let fingerprint = self.fingerprint_at(&window, read_time.as_deref()).await?;
        Ok((all, fingerprint.map(|fingerprint| Check { window, fingerprint })))
    }

    /// The fingerprint of the window from `window` now.
    pub(super) async fn count_fingerprint(&self, window: String) -> Result<Option<Fingerprint>> {
        self.fingerprint_at(&window, None).await
    }

    /// One `runQuery` of the documents changed at or after `window` (names only, with their
    /// commit times), at most one past [`FINGERPRINT_ENTRIES_MAX`], and the purge trace, at once,
    /// both at `read_time` when given.
    async fn fingerprint_at(&self, window: &str, read_time: Option<&str>) -> Result<Option<Fingerprint>> {
        let query = json!({
            "select": select(&["__name__"]),
            "from": [{ "collectionId": self.client.collection() }],
            "where": field_filter(layout::CHANGED_AT, "GREATER_THAN_OR_EQUAL", json!({ "timestampValue": window })),
            "orderBy": [{ "field": { "fieldPath": layout::CHANGED_AT }, "direction": "ASCENDING" }],
            "limit": FINGERPRINT_ENTRIES_MAX + 1,
        });
        let doing = "read the change feed's latest entries";
        let (answer, purges) =
            futures::try_join!(self.run_raw_query(&query, read_time, doing), self.purge_trace(read_time))?;
        let entries = answer
            .documents
            .iter()
            .map(|document| (text(document, "/name").to_owned(), text(document, "/updateTime").to_owned()))
            .collect();
        Ok(Fingerprint::of(entries, purges))
    }

    fn purge_trace_name(&self) -> String {
        self.client.name_in(&self.client.meta_collection(), PURGE_TRACE_DOCUMENT)
    }

    /// How many erasure commits the collection has seen (0 before the first), at `read_time`.
    async fn purge_trace(&self, read_time: Option<&str>) -> Result<u64> {
        let mut body = json!({ "documents": [self.purge_trace_name()] });
        if let Some(time) = read_time {
            body["readTime"] = json!(time);
        }
        let doing = "read the purge trace";
        let reply =
            self.client.call(Method::POST, &self.client.method_url("batchGet"), Some(&body), Call::Read, doing).await?;
        let count = reply
            .as_array()
            .into_iter()
            .flatten()
            .find_map(|entry| entry.pointer(&format!("/found/fields/{PURGE_COUNT}/integerValue")))
            .and_then(Value::as_str)
            .and_then(|n| n.parse().ok());
        Ok(count.unwrap_or(0))
    }

    /// The write that increments the purge trace, to commit with an erasure's deletions.
    pub(super) fn purge_trace_write(&self) -> Value {
        json!({ "transform": {
            "document": self.purge_trace_name(),
            "fieldTransforms": [{ "fieldPath": PURGE_COUNT, "increment": { "integerValue": "1" } }]
        } })
    }
}
