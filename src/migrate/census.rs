//! Counting what a backend's full scan never returns, so a migration's report can say what stayed
//! behind: CouchDB's scan skips design documents (the earlier schema revision's
//! `_design/data_store`, Mango index definitions), so they are counted here with one `_all_docs`
//! range request. Other backends keep no such documents.

use reqwest::StatusCode;
use serde_json::Value;

use crate::backend::BackendUrl;
use crate::error::{Error, ErrorKind, Result};

/// How many design documents the source holds, when it is a backend that has them.
pub async fn design_documents(url: &BackendUrl) -> Result<Option<u64>> {
    let BackendUrl::CouchDb(config) = url else {
        return Ok(None);
    };
    let database = percent_encoding::utf8_percent_encode(&config.database, percent_encoding::NON_ALPHANUMERIC);
    let endpoint = config
        .server
        .join(&format!("{database}/_all_docs"))
        .map_err(|e| Error::new(ErrorKind::Internal, "build the _all_docs URL").with_source(e))?;
    let client = reqwest::Client::builder()
        .timeout(config.timeout)
        .build()
        .map_err(|e| Error::new(ErrorKind::Internal, "build an HTTP client").with_source(e))?;
    // Design document ids sort between "_design/" and "_design0" ('0' follows '/').
    let mut request = client.get(endpoint).query(&[("startkey", "\"_design/\""), ("endkey", "\"_design0\"")]);
    if let Some(user) = &config.user {
        request = request.basic_auth(user, config.password.as_deref());
    }
    let failed = |e: reqwest::Error| {
        Error::new(ErrorKind::Unavailable, format!("count design documents in {}", config.redacted())).with_source(e)
    };
    let response = request.send().await.map_err(failed)?;
    let status = response.status();
    if status != StatusCode::OK {
        let kind = match status {
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => ErrorKind::Unauthorized,
            StatusCode::NOT_FOUND => ErrorKind::Misconfigured,
            _ => ErrorKind::Unavailable,
        };
        return Err(Error::new(kind, format!("count design documents in {}: HTTP {status}", config.redacted())));
    }
    let body: Value = response.json().await.map_err(failed)?;
    let rows = body.get("rows").and_then(Value::as_array).map_or(0, Vec::len);
    Ok(Some(rows as u64))
}
