//! Requests pass through: CouchDB runs views, shows, lists and update functions itself, so a
//! request below `_design/` is sent to the database as it came and the answer streamed back; a
//! database of the catalog ([`super::catalog`]) is native CouchDB, so every request on it (any
//! path below the database, the database itself included) goes the same way. Only the headers a
//! request depends on go either way; our own credentials replace the client's (the CouchDB API has
//! already decided who may make it).
//!
//! Bodies stream both ways: an attachment upload is passed on as it arrives
//! ([`crate::backend::DesignBody::Streamed`]) and an answer's body as CouchDB sends it, so neither
//! is held whole. No total timeout bounds them (a 1 GiB attachment takes minutes): the answer
//! must begin within the backend URL's `timeout_secs` of the request body's end, and each piece
//! of its body within as long of the one before. A view or Mango query
//! ([`may_build_an_index`]) waits `query_timeout_secs` for its answer to begin instead: CouchDB
//! answers it only once the index is built.

use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt, TryStreamExt};
use reqwest::header::{self, HeaderName};

use super::backend::CouchDbBackend;
use super::core::SERVICE;
use crate::backend::raw::http::{transport_error, Idempotency};
use crate::backend::{DesignRequest, DesignResponse};
use crate::error::{Error, ErrorKind, Result};

/// The answer's headers a client of a passed request reads: the body's type, length, range and
/// encoding (an attachment CouchDB keeps compressed is sent as it is kept), its validators, and
/// what a write or an update function reports.
/// Named as `HeaderName`s, so that looking one up in CouchDB's answer hashes a name already made
/// rather than parsing the text of the name first, ten times per passed request.
const ANSWER_HEADERS: [HeaderName; 10] = [
    header::CONTENT_TYPE,
    header::CONTENT_LENGTH,
    header::CONTENT_RANGE,
    header::ACCEPT_RANGES,
    header::CONTENT_ENCODING,
    HeaderName::from_static("content-md5"),
    header::ETAG,
    header::LOCATION,
    HeaderName::from_static("x-couch-id"),
    HeaderName::from_static("x-couch-update-newrev"),
];

impl CouchDbBackend {
    pub(super) async fn pass_design_request(&self, request: DesignRequest) -> Result<DesignResponse> {
        let doing = format!("run {} /{}", request.method, request.path);
        let path_and_query = match &request.query {
            Some(query) => format!("{}?{query}", request.path),
            None => request.path.clone(),
        };
        let answer_within = if may_build_an_index(&request.path) {
            self.client.query_timeout()
        } else {
            self.client.pass_through_timeout()
        };
        let response = self
            .client
            .pass_through(request.method, &path_and_query, &request.headers, request.body, answer_within, &doing)
            .await?;
        let status = response.status().as_u16();
        let headers = ANSWER_HEADERS
            .iter()
            .filter_map(|name| {
                let value = response.headers().get(name)?.to_str().ok()?;
                Some((name.as_str().to_owned(), value.to_owned()))
            })
            .collect();
        // The body arrives after the status: a break now is a transport failure of a read that
        // has begun, whatever the method.
        // Shared, not copied, by the body's error mapping and by each piece's wait.
        let doing: Arc<str> = Arc::from(doing);
        let body = response.bytes_stream().map_err({
            let doing = Arc::clone(&doing);
            move |e| transport_error(SERVICE, e, Idempotency::Idempotent, &doing)
        });
        let body = each_within(body, self.client.pass_through_timeout(), doing);
        Ok(DesignResponse { status, headers, body: Box::pin(body) })
    }
}

/// Whether CouchDB may build an index before answering a request on `path` (below the database,
/// percent-encoded): a view (`_design/{ddoc}/_view/{view}`, its `/queries`), a list function
/// over a view (`_design/{ddoc}/_list/…`), a Mango query (`_find`, `_explain`) or index
/// creation (`_index`; pouchdb-server builds the index then).
pub(super) fn may_build_an_index(path: &str) -> bool {
    let segments: Vec<&str> = path.split('/').collect();
    matches!(
        segments.as_slice(),
        ["_design", ddoc, "_view" | "_list", _, ..] if !ddoc.is_empty()
    ) || matches!(segments.as_slice(), ["_find" | "_explain" | "_index", ..])
}

/// `pieces`, ending with an error when the next piece does not come within `timeout` of the
/// last (a backend that stalls mid-answer would otherwise hold the client's connection).
fn each_within<S>(pieces: S, timeout: Duration, doing: Arc<str>) -> impl Stream<Item = Result<bytes::Bytes>> + Send
where
    S: Stream<Item = Result<bytes::Bytes>> + Send + 'static,
{
    futures::stream::unfold((Box::pin(pieces), false), move |(mut pieces, ended)| {
        let doing = Arc::clone(&doing);
        async move {
            if ended {
                return None;
            }
            match tokio::time::timeout(timeout, pieces.next()).await {
                Ok(Some(piece)) => Some((piece, (pieces, false))),
                Ok(None) => None,
                Err(_) => {
                    let stalled = Error::new(
                        ErrorKind::Unavailable,
                        format!(
                            "{SERVICE} stopped sending its answer for {} s while trying to {doing}",
                            timeout.as_secs()
                        ),
                    );
                    Some((Err(stalled), (pieces, true)))
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::may_build_an_index;

    #[test]
    fn views_and_mango_queries_wait_for_index_builds() {
        for path in [
            "_design/bench/_view/v",
            "_design/bench/_view/v/queries",
            "_design/d%2Fx/_list/l/v",
            "_find",
            "_explain",
            "_index",
        ] {
            assert!(may_build_an_index(path), "{path}");
        }
        for path in [
            "",
            "_all_docs",
            "_changes",
            "doc",
            "doc/_view/v",
            "_design/bench",
            "_design/bench/att",
            "_design//_view/v",
        ] {
            assert!(!may_build_an_index(path), "{path}");
        }
    }
}
