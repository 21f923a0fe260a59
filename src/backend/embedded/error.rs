//! Maps redb's errors into the crate's error kinds, keeping the redb error as the source.

use crate::error::{Error, ErrorKind};

/// Converts any redb error (they all convert into `redb::Error`) with a note of what we were doing.
pub(super) fn map_redb<E: Into<redb::Error>>(doing: &'static str) -> impl FnOnce(E) -> Error {
    move |err| {
        let err: redb::Error = err.into();
        let kind = match &err {
            redb::Error::DatabaseAlreadyOpen => ErrorKind::Misconfigured,
            redb::Error::ValueTooLarge(_) => ErrorKind::TooLarge,
            redb::Error::Corrupted(_) => ErrorKind::Corrupt,
            redb::Error::UpgradeRequired(_) => ErrorKind::Misconfigured,
            _ => ErrorKind::Internal,
        };
        let message = match &err {
            redb::Error::DatabaseAlreadyOpen => {
                format!("{doing}: the file is already open in another process (the embedded store allows one process at a time)")
            }
            _ => format!("embedded store: {doing}"),
        };
        Error::new(kind, message).with_source(err)
    }
}

/// A blocking task that panicked or was cancelled.
pub(super) fn join_error(err: tokio::task::JoinError) -> Error {
    Error::new(ErrorKind::Internal, "embedded store: a storage task failed").with_source(err)
}
