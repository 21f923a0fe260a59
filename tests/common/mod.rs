//! Helpers shared by the integration tests: the round-trip value corpus and JSON comparison by
//! exact decimal value.

#![allow(dead_code)]

pub mod corpus;
pub mod json;
pub mod servers;
