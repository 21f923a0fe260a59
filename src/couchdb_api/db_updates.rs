//! `GET /_db_updates`: every database's events (`created`, `updated`, `deleted`), as CouchDB
//! 3.4.3's `global_changes` application answers it, for server admins only.
//!
//! The events are the documents of `_global_changes` (`{type}:{name}`), written there by every
//! instance over the backend ([`crate::database::global_changes`], which says what a write costs
//! and how late another instance's events show); this endpoint reads that database's change feed
//! with the `_changes` machinery ([`super::changes::db_updates_feed`]), so `feed=normal`,
//! `longpoll`, `continuous` and `eventsource`, `since` (`now` too), `limit`, `descending`,
//! `timeout` and `heartbeat` behave as on `_changes`, with its bounds (`couchdb_changes_*`,
//! `couchdb_max_feeds_per_login`, `couchdb_max_descending_changes`). What differs from `_changes`
//! is CouchDB's: only those parameters are read (others are ignored), numbers must be
//! non-negative integers (400 `invalid_integer`), rows are `{"db_name","type","seq"}` (the
//! eventsource feed's rows stay `_global_changes`' own rows, as CouchDB 3.4.3 sends them), and
//! the answer carries no `pending`. Without `_global_changes`, CouchDB's 404 for a missing
//! database.

use std::collections::HashMap;
use std::net::SocketAddr;

use axum::extract::{ConnectInfo, Extension, Query, State};

use super::auth::Identity;
use super::changes::{db_updates_feed, FeedAsker};
use super::error::{CouchError, CouchResult};
use super::root::server_admin_only;
use super::{Answer, CouchState};
use crate::backend::catalog::DbName;
use crate::database::activity::GLOBAL_CHANGES_DB;
use crate::database::data_store_rules::Confinement;

/// CouchDB's answer to a `feed` it does not serve (`global_changes_httpd`).
const UNSUPPORTED_FEED: &str = "Supported `feed` types: normal, continuous, longpoll, eventsource";

/// `GET /_db_updates`.
pub async fn db_updates(
    State(state): State<CouchState>,
    Extension(identity): Extension<Identity>,
    peer: Option<Extension<ConnectInfo<SocketAddr>>>,
    Query(query): Query<Vec<(String, String)>>,
) -> Answer {
    server_admin_only(&identity)?;
    let params = db_updates_params(query)?;
    let name = DbName::parse(GLOBAL_CHANGES_DB)?;
    let database = state.databases.open(&name).await?.ok_or_else(CouchError::no_database)?;
    let asker = FeedAsker::of(Confinement::Everything, Some(Extension(identity)), peer);
    db_updates_feed(&state, database, asker, &params).await
}

/// The parameters `_db_updates` takes, checked as CouchDB checks them, in the form the
/// `_changes` feed reads; any other is ignored. A parameter given twice counts as its last.
fn db_updates_params(query: Vec<(String, String)>) -> CouchResult<HashMap<String, String>> {
    let mut params = HashMap::new();
    for (key, value) in query {
        match key.as_str() {
            "feed" | "since" => {
                params.insert(key, value);
            }
            "descending" => {
                // Only `true` asks for it; any other value is the default.
                if value == "true" {
                    params.insert(key, value);
                } else {
                    params.remove(&key);
                }
            }
            "heartbeat" if value == "true" => {
                params.insert(key, value);
            }
            "heartbeat" if value == "false" => {
                params.remove(&key);
            }
            "limit" | "heartbeat" | "timeout" => {
                non_negative_integer(&value)?;
                params.insert(key, value);
            }
            _ => {}
        }
    }
    match params.get("feed").map(String::as_str) {
        None | Some("normal" | "longpoll" | "continuous" | "eventsource") => Ok(params),
        Some(_) => Err(CouchError::bad_request(UNSUPPORTED_FEED)),
    }
}

/// A non-negative integer, or CouchDB's 400 `invalid_integer`.
fn non_negative_integer(text: &str) -> CouchResult<()> {
    let digits = text.strip_prefix('+').unwrap_or(text);
    if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
        return Ok(());
    }
    Err(CouchError::bad_request("invalid_integer"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(pairs: &[(&str, &str)]) -> CouchResult<HashMap<String, String>> {
        db_updates_params(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
    }

    #[test]
    fn only_couchdb_s_parameters_are_kept() {
        let kept = params(&[("feed", "longpoll"), ("filter", "x"), ("include_docs", "true"), ("limit", "2")]).unwrap();
        let mut names: Vec<&str> = kept.keys().map(String::as_str).collect();
        names.sort_unstable();
        assert_eq!(names, ["feed", "limit"]);
        assert!(!params(&[("descending", "yes")]).unwrap().contains_key("descending"));
        assert!(!params(&[("heartbeat", "false")]).unwrap().contains_key("heartbeat"));
        assert_eq!(params(&[("heartbeat", "true")]).unwrap()["heartbeat"], "true");
        assert_eq!(params(&[("limit", "1"), ("limit", "3")]).unwrap()["limit"], "3");
    }

    #[test]
    fn numbers_and_feeds_are_refused_as_couchdb_refuses_them() {
        for (key, value) in [("limit", "x"), ("limit", "-1"), ("timeout", ""), ("heartbeat", "1.5")] {
            let err = params(&[(key, value)]).unwrap_err();
            assert_eq!(
                (err.status.as_u16(), err.error.as_str(), err.reason.as_str()),
                (400, "bad_request", "invalid_integer")
            );
        }
        let err = params(&[("feed", "bogus")]).unwrap_err();
        assert_eq!(err.reason, UNSUPPORTED_FEED);
    }
}
