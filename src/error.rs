//! The one error type of the crate.
//!
//! Every backend maps its failures into an [`ErrorKind`] so the facade, the CLI and the HTTP layer
//! can decide what to do (retry a conflict, answer 404, back off when unavailable) without knowing
//! which backend is underneath. The backend's own error is kept as the `source` so nothing is lost
//! when the error is logged.

use std::fmt;

/// What went wrong, independent of the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The document (or database/table) does not exist.
    NotFound,
    /// A precondition failed: the document exists when it must not, or its revision moved.
    Conflict,
    /// The caller's input is invalid; the message names the field.
    InvalidInput,
    /// A value or document is over a size limit.
    TooLarge,
    /// The backend refused our credentials or permissions.
    Unauthorized,
    /// The backend cannot be reached or is overloaded; trying again later may work.
    Unavailable,
    /// The backend is reachable but not set up as required (missing table, index, lock held…).
    Misconfigured,
    /// Data read from the backend does not have the shape the spec requires.
    Corrupt,
    /// The request's deadline passed before the next attempt was sent, so nothing of this call was
    /// applied: trying again later may work. (A write already sent is never abandoned for a
    /// deadline: its outcome is awaited and reported instead.)
    DeadlineExceeded,
    /// A write was sent and no definite answer came back (the connection broke or timed out after
    /// sending, or a gateway timed out): it may or may not have been applied.
    OutcomeUnknown,
    /// A database's validation function refused the write (CouchDB's 403 `forbidden`); the
    /// message is the function's.
    Forbidden,
    /// A database's validation function refused the write until the client logs in (CouchDB's
    /// 401 `unauthorized`); the message is the function's.
    LoginRequired,
    /// Anything else: a bug or an unexpected backend answer.
    Internal,
}

impl ErrorKind {
    /// A short, stable, machine-readable name (used in CLI output and HTTP error bodies).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::NotFound => "not_found",
            ErrorKind::Conflict => "conflict",
            ErrorKind::InvalidInput => "bad_request",
            ErrorKind::TooLarge => "too_large",
            ErrorKind::Unauthorized => "unauthorized",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Misconfigured => "misconfigured",
            ErrorKind::Corrupt => "corrupt_document",
            ErrorKind::DeadlineExceeded => "deadline_exceeded",
            ErrorKind::OutcomeUnknown => "outcome_unknown",
            ErrorKind::Forbidden => "forbidden",
            ErrorKind::LoginRequired => "unauthorized",
            ErrorKind::Internal => "internal",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

type Source = Box<dyn std::error::Error + Send + Sync + 'static>;

/// An error with a kind, a human-readable message and, when it came from elsewhere, its source.
///
/// `retries_exhausted` is set by the one layer that owns retries for an operation (the shared HTTP
/// layer of the REST adapters, the DynamoDB SDK's retry configuration) when it gives up, so layers
/// further out do not retry the same failure again and multiply the time it takes to report it.
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    message: String,
    source: Option<Source>,
    retries_exhausted: bool,
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error { kind, message: message.into(), source: None, retries_exhausted: false }
    }

    /// Marks the error as final: its retry owner already retried it as long as it was allowed to.
    pub fn with_retries_exhausted(mut self) -> Self {
        self.retries_exhausted = true;
        self
    }

    /// A copy to report one failure against each of many items: same kind, the whole chain as
    /// its message, and the retries-exhausted mark kept.
    pub fn copy_for_each(&self) -> Self {
        Error { kind: self.kind, message: self.to_string(), source: None, retries_exhausted: self.retries_exhausted() }
    }

    /// Whether a retry owner already gave up on this error, here or in an error it wraps (errors
    /// are often re-wrapped with context, which must not lose the mark).
    pub fn retries_exhausted(&self) -> bool {
        let mut current: Option<&(dyn std::error::Error + 'static)> = Some(self);
        while let Some(error) = current {
            if error.downcast_ref::<Error>().is_some_and(|e| e.retries_exhausted) {
                return true;
            }
            current = error.source();
        }
        false
    }

    /// Whether trying the same call again later may succeed and no retry owner has given up on it
    /// yet: an outer loop may retry exactly these.
    pub fn is_retryable(&self) -> bool {
        matches!(self.kind, ErrorKind::Unavailable | ErrorKind::DeadlineExceeded) && !self.retries_exhausted()
    }

    /// Attaches the underlying error, kept for logs and `Error::source`.
    pub fn with_source(mut self, source: impl Into<Source>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// An invalid-input error about one named field.
    pub fn invalid(field: &str, problem: impl fmt::Display) -> Self {
        Error::new(ErrorKind::InvalidInput, format!("invalid {field}: {problem}"))
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::NotFound, message)
    }

    pub fn conflict(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::Conflict, message)
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    pub fn is_conflict(&self) -> bool {
        self.kind == ErrorKind::Conflict
    }

    pub fn is_not_found(&self) -> bool {
        self.kind == ErrorKind::NotFound
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.message)?;
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|s| s as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exhausted_mark_survives_wrapping() {
        let inner = Error::new(ErrorKind::Unavailable, "backend down").with_retries_exhausted();
        assert!(!inner.is_retryable());
        let wrapped = Error::new(inner.kind(), "source couchdb://x").with_source(inner);
        assert!(wrapped.retries_exhausted());
        assert!(!wrapped.is_retryable());
        assert!(Error::new(ErrorKind::Unavailable, "busy").is_retryable());
        assert!(!Error::new(ErrorKind::OutcomeUnknown, "sent, no answer").is_retryable());
    }
}
