//! The client's address behind a load balancer: `couchdb_trusted_proxies` and `X-Forwarded-For`.
//!
//! The address a request counts under (the lockout of [`super::auth`], its suspect lane, the
//! per-address feed bounds of [`super::changes`]) is its TCP peer, unless that peer is a trusted
//! proxy: then it is the right-most address of `X-Forwarded-For` that is not itself trusted. Each
//! proxy appends the address it was connected from, so everything right of the client's entry
//! was written by proxies this server trusts and everything left of it by the client, who can
//! write anything there; walking from the right and stopping at the first untrusted hop is the
//! one reading a client cannot steer. From an untrusted peer the header is ignored entirely.
//!
//! [`super::auth::identify_request`] resolves it once per request and puts it back in the
//! request's `ConnectInfo`, so every handler after it sees the client, not the balancer.

use std::net::{IpAddr, SocketAddr};

use axum::http::HeaderMap;
use ipnet::IpNet;

/// The header a proxy appends the address it was connected from to (the de facto standard one;
/// HAProxy's `option forwardfor`, nginx's `$proxy_add_x_forwarded_for`).
const X_FORWARDED_FOR: &str = "x-forwarded-for";

/// The proxies whose `X-Forwarded-For` is believed (`couchdb_trusted_proxies`).
#[derive(Debug, Clone, Default)]
pub struct TrustedProxies {
    networks: Vec<IpNet>,
}

impl TrustedProxies {
    pub fn new(networks: Vec<IpNet>) -> Self {
        TrustedProxies { networks }
    }

    fn trusts(&self, address: IpAddr) -> bool {
        // An IPv4 client reaching an IPv6 socket shows as `::ffff:a.b.c.d`: the same host.
        let address = canonical(address);
        self.networks.iter().any(|network| network.contains(&address))
    }

    /// The client of a request from `peer` carrying `headers`: `peer` itself unless it is
    /// trusted; else the right-most forwarded address that is not trusted. When every forwarded
    /// address is trusted, the left-most of them (the farthest hop known); an entry that is no
    /// address stops the walk at the trusted hop right of it, which is the one that relayed it.
    pub fn client_of(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        if !self.trusts(peer) {
            return peer;
        }
        let mut nearest_trusted = peer;
        for entry in forwarded_entries_right_to_left(headers) {
            let Some(address) = parse_forwarded_address(entry) else { return nearest_trusted };
            if !self.trusts(address) {
                return address;
            }
            nearest_trusted = address;
        }
        nearest_trusted
    }
}

/// The entries of every `X-Forwarded-For` header of the request, last first: several header
/// lines are one list in the order they came (RFC 9110 §5.3). A line that is not text is skipped.
fn forwarded_entries_right_to_left(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    let lines: Vec<&str> = headers.get_all(X_FORWARDED_FOR).iter().filter_map(|value| value.to_str().ok()).collect();
    lines.into_iter().rev().flat_map(|line| line.rsplit(',')).map(str::trim).filter(|entry| !entry.is_empty())
}

/// One forwarded entry as an address: `192.0.2.1`, `2001:db8::1`, or either with a port
/// (`192.0.2.1:4711`, `[2001:db8::1]:4711`) or in brackets (`[2001:db8::1]`), as proxies write it.
fn parse_forwarded_address(entry: &str) -> Option<IpAddr> {
    if let Ok(address) = entry.parse::<IpAddr>() {
        return Some(canonical(address));
    }
    if let Ok(socket) = entry.parse::<SocketAddr>() {
        return Some(canonical(socket.ip()));
    }
    let bracketed = entry.strip_prefix('[')?.strip_suffix(']')?;
    bracketed.parse::<IpAddr>().ok().map(canonical)
}

/// An IPv4-mapped IPv6 address as the IPv4 address it is; any other unchanged.
fn canonical(address: IpAddr) -> IpAddr {
    match address {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(address, IpAddr::V4),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn proxies(networks: &[&str]) -> TrustedProxies {
        TrustedProxies::new(networks.iter().map(|n| n.parse().unwrap()).collect())
    }

    fn forwarded(lines: &[&str]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for line in lines {
            headers.append(X_FORWARDED_FOR, HeaderValue::from_str(line).unwrap());
        }
        headers
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn an_untrusted_peer_is_the_client_whatever_it_forwards() {
        let none = TrustedProxies::default();
        assert_eq!(none.client_of(ip("192.0.2.9"), &forwarded(&["203.0.113.1"])), ip("192.0.2.9"));
        let some = proxies(&["10.0.0.0/8"]);
        assert_eq!(some.client_of(ip("192.0.2.9"), &forwarded(&["203.0.113.1"])), ip("192.0.2.9"));
    }

    #[test]
    fn behind_trusted_proxies_the_right_most_untrusted_address_is_the_client() {
        let trusted = proxies(&["10.0.0.0/8", "192.0.2.7/32"]);
        let balancer = ip("10.1.2.3");
        assert_eq!(trusted.client_of(balancer, &forwarded(&["203.0.113.1"])), ip("203.0.113.1"));
        // What the client wrote itself (left of its own entry) is never read.
        assert_eq!(trusted.client_of(balancer, &forwarded(&["198.51.100.1, 203.0.113.1"])), ip("203.0.113.1"));
        // A chain of trusted proxies is walked through.
        let chain = forwarded(&["198.51.100.1, 203.0.113.1, 192.0.2.7, 10.9.9.9"]);
        assert_eq!(trusted.client_of(balancer, &chain), ip("203.0.113.1"));
        // Several header lines are one list, in order.
        let lines = forwarded(&["198.51.100.1", "203.0.113.1", "192.0.2.7"]);
        assert_eq!(trusted.client_of(balancer, &lines), ip("203.0.113.1"));
        // Ports, brackets, IPv6 and IPv4-mapped addresses.
        assert_eq!(trusted.client_of(balancer, &forwarded(&["203.0.113.1:4711"])), ip("203.0.113.1"));
        assert_eq!(trusted.client_of(balancer, &forwarded(&["[2001:db8::1]:4711"])), ip("2001:db8::1"));
        assert_eq!(trusted.client_of(balancer, &forwarded(&["[2001:db8::1]"])), ip("2001:db8::1"));
        assert_eq!(trusted.client_of(balancer, &forwarded(&["::ffff:10.0.0.5, 203.0.113.1"])), ip("203.0.113.1"));
        assert_eq!(trusted.client_of(ip("::ffff:10.1.2.3"), &forwarded(&["203.0.113.1"])), ip("203.0.113.1"));
    }

    #[test]
    fn without_an_untrusted_entry_the_farthest_trusted_hop_is_the_client() {
        let trusted = proxies(&["10.0.0.0/8"]);
        let balancer = ip("10.1.2.3");
        assert_eq!(trusted.client_of(balancer, &HeaderMap::new()), balancer);
        assert_eq!(trusted.client_of(balancer, &forwarded(&["10.4.4.4, 10.5.5.5"])), ip("10.4.4.4"));
        // Garbage relayed by a trusted hop stops the walk at that hop.
        assert_eq!(trusted.client_of(balancer, &forwarded(&["203.0.113.1, unknown, 10.5.5.5"])), ip("10.5.5.5"));
        assert_eq!(trusted.client_of(balancer, &forwarded(&["203.0.113.1, unknown"])), balancer);
        assert_eq!(trusted.client_of(balancer, &forwarded(&[" , ,203.0.113.1 , "])), ip("203.0.113.1"));
    }
}
