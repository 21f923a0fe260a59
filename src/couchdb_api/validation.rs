//! Design functions' failures as the CouchDB API answers them. `validate_doc_update` itself is a
//! rule of the database ([`crate::database::validation`]): the database router hands it who
//! writes (the request's login, as a [`crate::database::validation::Writer`]), and
//! [`super::error`] answers its failures.
//!
//! [`function_failure`] is what the `_changes` filters ([`super::changes`]) make of a failed
//! call: the crate's error carrying CouchDB's answer to it.

use crate::error::{Error, ErrorKind};
use crate::js::JsError;

use super::error::{Answered, CouchError};

/// A design function's failure (`what` names the call) as the crate's error, carrying CouchDB's
/// answer to it: `os_process_error` for the time and memory bounds, `compilation_error`, the
/// thrown error's name, 429 when every worker is busy.
pub(crate) fn function_failure(what: &str, err: JsError) -> Error {
    let answer = CouchError::from(crate::views::javascript::view_error(err));
    let kind = if answer.status.is_client_error() { ErrorKind::InvalidInput } else { ErrorKind::Internal };
    Error::new(kind, format!("{what}: {}", answer.reason)).with_source(Answered(answer))
}
