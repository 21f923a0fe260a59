//! Binding a face's listener, with the loopback rule: a face that answers without credentials
//! listens beyond loopback only when the operator says so (`--allow-unauthenticated`).

use std::net::SocketAddr;

use tokio::net::TcpListener;

use crate::error::{Error, ErrorKind, Result};

/// What the loopback rule needs to know about the face being bound.
pub struct Exposure {
    /// The setting the address comes from (named in errors): `listen`, `couchdb_listen`.
    pub setting: &'static str,
    /// Whether the face answers requests without credentials.
    pub open: bool,
    /// The operator allows an open face beyond loopback.
    pub allow_unauthenticated: bool,
    /// Why an open face refuses a non-loopback address, for the error (names the address).
    pub refusal: String,
}

/// Resolves `listen` and binds it, refusing non-loopback addresses for an open face unless the
/// operator allows it.
pub async fn bind(listen: &str, exposure: Exposure) -> Result<TcpListener> {
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host(listen)
        .await
        .map_err(|e| Error::invalid(exposure.setting, format!("cannot resolve {listen:?}")).with_source(e))?
        .collect();
    if exposure.open && !exposure.allow_unauthenticated && addrs.iter().any(|a| !a.ip().is_loopback()) {
        return Err(Error::invalid(exposure.setting, exposure.refusal));
    }
    TcpListener::bind(addrs.as_slice())
        .await
        .map_err(|e| Error::new(ErrorKind::Misconfigured, format!("cannot listen on {listen}")).with_source(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exposure(open: bool, allow_unauthenticated: bool) -> Exposure {
        Exposure { setting: "couchdb_listen", open, allow_unauthenticated, refusal: "anyone would be admin".into() }
    }

    /// An open face refuses a non-loopback address unless allowed, before binding anything, and
    /// names the face's setting with the face's own reason.
    #[tokio::test]
    async fn an_open_face_stays_on_loopback() {
        let err = bind("0.0.0.0:0", exposure(true, false)).await.expect_err("refused beyond loopback");
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
        assert_eq!(err.to_string(), "invalid couchdb_listen: anyone would be admin");
        let listener = bind("127.0.0.1:0", exposure(true, false)).await.expect("loopback is always allowed");
        assert!(listener.local_addr().unwrap().ip().is_loopback());
    }
}
