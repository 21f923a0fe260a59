//! agentstore: agents' key/value documents (`agent_data_store`) on CouchDB, DynamoDB, Firestore
//! or an embedded file, behind one interface.
//!
//! - [`model`]: document IDs, fields, validation, timestamps — the spec, with no I/O.
//! - [`backend`]: the [`backend::DocumentBackend`] trait and its adapters.
//! - [`store`]: [`store::DataStore`], the facade with the data-store semantics (metadata merge,
//!   access tracking, listings), written once for every backend.
//! - [`migrate`]: `migrate`, `verify`, `export`, `import` between any two backends, and moving a
//!   whole deployment's databases ([`migrate::deployment`], over [`replication_client`] for servers).
//! - [`feed`] and [`upgrade`]: reading the change feed (`changes`, `GET /v1/changes`) and
//!   bringing a store to this release's layout (`upgrade`).
//! - [`http`]: the REST API over the facade (`agentstore serve`).
//! - [`couchdb_api`]: CouchDB's HTTP API over the facade, for existing CouchDB clients.
//! - [`console`]: the console at `/_utils` on the CouchDB API's listener, its files built in.
//! - [`mango`]: Mango, CouchDB's query language (`_find`, `_index`), below the CouchDB API.
//! - [`js`]: the JavaScript engine for design documents (map, reduce, validation, filters).
//! - [`server`]: what both faces share as servers: listener and loopback rule, accept loop and
//!   connection limits, body budgets, panics, the shutdown signal.
//! - [`config`] and [`cli`]: settings and the `agentstore` command.

pub mod backend;
pub mod cli;
pub mod config;
pub mod console;
pub mod couchdb_api;
pub mod database;
pub mod error;
pub mod feed;
pub mod http;
pub mod js;
pub mod mango;
pub mod migrate;
pub mod model;
pub mod replication_client;
pub mod replicator;
pub mod server;
pub mod store;
#[cfg(feature = "testing")]
pub mod testing;
pub mod upgrade;
pub mod views;

pub use error::{Error, ErrorKind, Result};
pub use store::DataStore;

// The documentation's links are checked by a unit test (src/doc_links.rs), so CI runs it.
#[cfg(test)]
mod doc_links;
