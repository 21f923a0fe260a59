//! Requests pass through: CouchDB runs views, shows, lists and update functions itself, so a
//! request below `_design/` is sent to the database as it came and the answer streamed back; a
//! database of the catalog ([`super::catalog`]) is native CouchDB, so every request on it (any
//! path below the database, the database itself included) goes the same way. Only the headers a
//! request depends on go either way; our own credentials replace the client's (the CouchDB API has
//! already decided who may make it).

use futures::TryStreamExt;

use super::backend::CouchDbBackend;
use super::core::SERVICE;
use crate::backend::raw::http::{transport_error, Idempotency};
use crate::backend::{DesignRequest, DesignResponse};
use crate::error::Result;

/// The answer's headers a client of a design request reads.
const ANSWER_HEADERS: [&str; 2] = ["content-type", "etag"];

impl CouchDbBackend {
    pub(super) async fn pass_design_request(&self, request: DesignRequest) -> Result<DesignResponse> {
        let doing = format!("run {} /{}", request.method, request.path);
        let path_and_query = match &request.query {
            Some(query) => format!("{}?{query}", request.path),
            None => request.path.clone(),
        };
        let response =
            self.client.pass_through(request.method, &path_and_query, &request.headers, request.body, &doing).await?;
        let status = response.status().as_u16();
        let headers = ANSWER_HEADERS
            .iter()
            .filter_map(|name| {
                let value = response.headers().get(*name)?.to_str().ok()?;
                Some(((*name).to_owned(), value.to_owned()))
            })
            .collect();
        // The body arrives after the status: a break now is a transport failure of a read that
        // has begun, whatever the method.
        let body =
            response.bytes_stream().map_err(move |e| transport_error(SERVICE, e, Idempotency::Idempotent, &doing));
        Ok(DesignResponse { status, headers, body: Box::pin(body) })
    }
}
