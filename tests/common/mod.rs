//! Helpers shared by the integration tests: the round-trip value corpus and JSON comparison by
//! exact decimal value.

#![allow(dead_code)]

pub mod container;
pub mod corpus;
pub mod docker;
pub mod json;
pub mod servers;
