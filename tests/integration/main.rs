//! The integration tests with libtest's own harness, in one binary: each former test file is a
//! module, so `cargo test --test integration -- http::` runs one of them. The libtest-mimic suites
//! that list what ran against which backend are `tests/suites/` (migration, the CouchDB API and
//! its clients), `tests/contract/` (every backend's behaviour) and `tests/containers/` (Docker).
//!
//! Everything here shares one process: a test changes no process-wide state another test reads
//! (the environment variables set here are the dummy AWS credentials local servers accept, set
//! before any client is built), and every server binds an ephemeral loopback port.

#[path = "../common/mod.rs"]
mod common;

/// The `agentstore` binary end to end.
mod cli;
/// A database written by the existing system, served by the facade.
mod couchdb_dropin;
/// CouchDB 3.4.3 transcripts replayed against the CouchDB adapter.
mod couchdb_replay;
/// Backend requests per CouchDB API request over the CouchDB backend.
mod couchdb_round_trips;
/// The DynamoDB adapter's document model on dynalite.
mod dynamodb_layout;
/// The DynamoDB adapter against a mock DynamoDB.
mod dynamodb_mock;
/// What the embedded backend does beyond the contract.
mod embedded;
/// Faults classified and reported within their bound.
mod faults;
/// What the Firestore adapter stores, read back raw from the emulator.
mod firestore;
/// The Firestore adapter against a mock Firestore.
mod firestore_mock;
/// The test helpers themselves.
mod helpers;
/// The REST API end to end.
mod http;
