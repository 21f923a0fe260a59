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
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    message: String,
    source: Option<Source>,
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error { kind, message: message.into(), source: None }
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
