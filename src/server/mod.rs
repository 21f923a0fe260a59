//! What both protocol faces share as servers: binding a listener with the loopback rule
//! ([`bind`]), the accept loop with its connection limits, lingering close and body-read timeout
//! ([`conn`]), the server-wide byte budgets of request bodies ([`budget`], measured by
//! [`tree_size`]), catching a panicking handler ([`panic`]) and the shutdown signal with its drain
//! ([`shutdown`]), which the long-running CLI commands stop on too.
//!
//! The faces themselves (`http`, the REST API; `couchdb_api`, the CouchDB API) build their
//! routers on top and never import each other; nothing here imports either face.

pub mod bind;
pub mod budget;
pub mod conn;
pub mod panic;
pub mod shutdown;
pub mod tree_size;

pub use bind::{bind, Exposure};
pub use budget::ByteBudget;
pub use conn::{serve, ConnectionLimits};
pub use panic::catch_panics;
pub use shutdown::{drain_after_signal, shutdown_signal, Draining};
