//! Who is on the other end of a call, for the penalties: a client address, or a service
//! identified by its client certificate.
//!
//! Behind a proxy or a mesh every caller arrives from the proxy's address, so keying by the TCP
//! peer would make one attacker's refusals shut out everyone behind it. Trusted proxies may
//! therefore name the client they relay, each in the one way its kind can vouch for:
//!
//! - peers in `GRPC_TRUSTED_PROXIES` (layer 4) in a PROXY protocol header at the start of the
//!   connection (`proxy_protocol`). The bytes after it are the client's own, `x-forwarded-for`
//!   included, so that header is never read from them;
//! - peers in `GRPC_TRUSTED_HTTP_PROXIES` (layer 7, which terminate HTTP/2 and rewrite the
//!   headers) per call in `x-forwarded-for`.
//!
//! A PROXY header, when one named the client, is the only truth for its connection. Everyone
//! else is keyed by their own address, and what they send in `x-forwarded-for` is ignored.

use std::{
    net::{IpAddr, SocketAddr},
    str::FromStr,
};

use ipnet::IpNet;
use sha2::{Digest, Sha256};
use tonic::metadata::MetadataMap;

/// The metadata a trusted proxy names its client in.
pub const FORWARDED_FOR: &str = "x-forwarded-for";

/// What the listener knows of a connection, handed to every call on it (tonic's connect info).
#[derive(Clone, Debug, Default)]
pub struct PeerInfo {
    /// The TCP peer.
    pub remote: Option<SocketAddr>,
    /// The client a trusted proxy named in a PROXY protocol header.
    pub proxied: Option<SocketAddr>,
    /// SHA-256 of the client certificate, when mutual TLS authenticated one.
    pub certificate: Option<[u8; 32]>,
}

/// Streams the listener serves, and what they say of their peer.
pub trait PeerSource {
    fn peer_info(&self) -> PeerInfo;
}

impl PeerSource for tokio::net::TcpStream {
    fn peer_info(&self) -> PeerInfo {
        PeerInfo {
            remote: self.peer_addr().ok(),
            ..PeerInfo::default()
        }
    }
}

impl PeerSource for tokio_rustls::server::TlsStream<tokio::net::TcpStream> {
    fn peer_info(&self) -> PeerInfo {
        let (tcp, session) = self.get_ref();
        PeerInfo {
            remote: tcp.peer_addr().ok(),
            proxied: None,
            certificate: session
                .peer_certificates()
                .and_then(|chain| chain.first())
                .map(|leaf| Sha256::digest(leaf.as_ref()).into()),
        }
    }
}

/// A list of networks, as `GRPC_TRUSTED_PROXIES` and `GRPC_TRUSTED_HTTP_PROXIES` give them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Networks(Vec<IpNet>);

impl FromStr for Networks {
    type Err = String;

    /// A comma-separated list of CIDR networks or single addresses; empty is none.
    fn from_str(list: &str) -> Result<Networks, String> {
        list.split(',')
            .map(str::trim)
            .filter(|item| !item.is_empty())
            .map(|item| {
                item.parse::<IpNet>()
                    .or_else(|_| item.parse::<IpAddr>().map(IpNet::from))
                    .map_err(|_| format!("{item:?} is not a CIDR network or an IP address"))
            })
            .collect::<Result<_, _>>()
            .map(Networks)
    }
}

impl Networks {
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        self.0.iter().any(|net| net.contains(&ip))
    }
}

/// The peers that may name their client, and how.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrustedProxies {
    /// `GRPC_TRUSTED_PROXIES`: layer-4 proxies, by a PROXY protocol header.
    pub proxy_protocol: Networks,
    /// `GRPC_TRUSTED_HTTP_PROXIES`: HTTP proxies, by `x-forwarded-for`.
    pub http: Networks,
}

impl TrustedProxies {
    /// Whether `ip` may open its connections with a PROXY protocol header.
    pub fn speaks_proxy_protocol(&self, ip: IpAddr) -> bool {
        self.proxy_protocol.contains(ip)
    }

    /// Whether `ip` relays other clients' calls, by either means.
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.proxy_protocol.contains(ip) || self.http.contains(ip)
    }
}

/// An IPv4 client seen through an IPv6 socket is the IPv4 client.
fn canonical(ip: IpAddr) -> IpAddr {
    ip.to_canonical()
}

/// Whom a call's refusals count against.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PeerKey {
    /// A client address: its own, or the one a trusted proxy named.
    Address(IpAddr),
    /// A service that presented a client certificate (mutual TLS), by its certificate's digest:
    /// authenticated by the handshake, so never shut out.
    Service([u8; 32]),
    /// A trusted proxy that named no client: its calls are never counted, or one client could
    /// shut out everyone behind it.
    UnnamedBehindProxy,
}

impl PeerInfo {
    /// The address whose shut-out closes this connection: none for a trusted proxy that named no
    /// client (it carries everyone's calls), nor for a certificate-authenticated service.
    pub fn connection_address(&self, trusted: &TrustedProxies) -> Option<IpAddr> {
        if self.certificate.is_some() {
            return None;
        }
        let remote = canonical(self.remote?.ip());
        match (trusted.contains(remote), self.proxied) {
            (false, _) => Some(remote),
            (true, Some(client)) => Some(canonical(client.ip())),
            (true, None) => None,
        }
    }

    /// Whom one call's refusals count against.
    pub fn key(&self, trusted: &TrustedProxies, metadata: &MetadataMap) -> Option<PeerKey> {
        if let Some(certificate) = self.certificate {
            return Some(PeerKey::Service(certificate));
        }
        let remote = canonical(self.remote?.ip());
        if !trusted.contains(remote) {
            return Some(PeerKey::Address(remote));
        }
        // The PROXY header's client is the only truth: the metadata after it is the client's.
        let named = match self.proxied {
            Some(client) => Some(canonical(client.ip())),
            None if trusted.http.contains(remote) => forwarded_client(metadata, &trusted.http),
            None => None,
        };
        Some(named.map_or(PeerKey::UnnamedBehindProxy, PeerKey::Address))
    }

    /// The client address recorded with a ride, given the call's [`PeerInfo::key`]: the relayed
    /// client's when a trusted proxy named one, else the TCP peer's.
    pub fn client_ip(&self, key: Option<PeerKey>) -> Option<IpAddr> {
        match key {
            Some(PeerKey::Address(ip)) => Some(ip),
            _ => self.remote.map(|remote| canonical(remote.ip())),
        }
    }
}

/// The client a chain of trusted proxies names in `x-forwarded-for`: each proxy appends the
/// address it received the call from, so reading from the right, the first address that is not a
/// trusted proxy is the client. Anything left of it was written by the client and is not read.
fn forwarded_client(metadata: &MetadataMap, trusted: &Networks) -> Option<IpAddr> {
    let hops: Vec<&str> = metadata
        .get_all(FORWARDED_FOR)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(str::trim)
        .collect();
    for hop in hops.into_iter().rev() {
        let ip = canonical(hop.parse::<IpAddr>().ok()?);
        if !trusted.contains(ip) {
            return Some(ip);
        }
    }
    None
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn info(remote: &str) -> PeerInfo {
        PeerInfo {
            remote: Some(remote.parse().unwrap()),
            ..PeerInfo::default()
        }
    }

    fn forwarded(value: &str) -> MetadataMap {
        let mut metadata = MetadataMap::new();
        metadata.insert(FORWARDED_FOR, value.parse().unwrap());
        metadata
    }

    /// Layer-4 proxies in `proxy_protocol`, HTTP proxies in `http`.
    fn trusting(proxy_protocol: &str, http: &str) -> TrustedProxies {
        TrustedProxies {
            proxy_protocol: proxy_protocol.parse().unwrap(),
            http: http.parse().unwrap(),
        }
    }

    #[test]
    fn parses_the_setting() {
        let trusted: Networks = "10.0.0.0/8, 192.168.1.7,::1".parse().unwrap();
        assert!(trusted.contains("10.1.2.3".parse().unwrap()));
        assert!(trusted.contains("192.168.1.7".parse().unwrap()));
        assert!(trusted.contains("::ffff:10.0.0.1".parse().unwrap()));
        assert!(!trusted.contains("192.168.1.8".parse().unwrap()));
        assert_eq!("".parse::<Networks>().unwrap(), Networks::default());
        assert!("10.0.0.0/33".parse::<Networks>().is_err());
        assert!("proxy.local".parse::<Networks>().is_err());
    }

    #[test]
    fn an_untrusted_peer_is_keyed_by_its_own_address_whatever_it_forwards() {
        let trusted = trusting("10.0.0.0/8", "10.0.0.0/8");
        let key = info("192.0.2.1:5000").key(&trusted, &forwarded("198.51.100.9"));
        assert_eq!(key, Some(PeerKey::Address("192.0.2.1".parse().unwrap())));
    }

    #[test]
    fn a_trusted_http_proxy_names_its_client() {
        let trusted = trusting("", "10.0.0.0/8");
        let proxy = info("10.0.0.5:5000");
        // The client's own claim (left) is not read; the first untrusted hop from the right is.
        let metadata = forwarded("203.0.113.66, 198.51.100.9, 10.0.0.7");
        assert_eq!(
            proxy.key(&trusted, &metadata),
            Some(PeerKey::Address("198.51.100.9".parse().unwrap()))
        );
        assert_eq!(
            proxy.client_ip(proxy.key(&trusted, &metadata)),
            Some("198.51.100.9".parse().unwrap())
        );
        // Naming nobody, the ride records the proxy's own address.
        assert_eq!(
            proxy.client_ip(proxy.key(&trusted, &MetadataMap::new())),
            Some("10.0.0.5".parse().unwrap())
        );
        // Naming nobody, the proxy is not counted and its connection never closed for it.
        assert_eq!(
            proxy.key(&trusted, &MetadataMap::new()),
            Some(PeerKey::UnnamedBehindProxy)
        );
        assert_eq!(proxy.connection_address(&trusted), None);
        // A garbled hop stops the walk: nobody is named.
        assert_eq!(
            proxy.key(&trusted, &forwarded("198.51.100.9, garbage")),
            Some(PeerKey::UnnamedBehindProxy)
        );
    }

    #[test]
    fn a_proxy_protocol_client_is_the_truth_whatever_it_forwards() {
        // The layer-4 proxy relays the client's bytes, x-forwarded-for included, after its header.
        let trusted = trusting("10.0.0.0/8", "");
        let relayed = PeerInfo {
            proxied: Some("198.51.100.10:1234".parse().unwrap()),
            ..info("10.0.0.5:5000")
        };
        let victim = Some(PeerKey::Address("198.51.100.10".parse().unwrap()));
        assert_eq!(relayed.key(&trusted, &forwarded("203.0.113.66")), victim);
        assert_eq!(relayed.key(&trusted, &MetadataMap::new()), victim);
        assert_eq!(
            relayed.client_ip(relayed.key(&trusted, &forwarded("203.0.113.66"))),
            Some("198.51.100.10".parse().unwrap())
        );
        assert_eq!(
            relayed.connection_address(&trusted),
            Some("198.51.100.10".parse().unwrap())
        );
        // A layer-4 proxy whose header named nobody: still not read from x-forwarded-for.
        let unnamed = info("10.0.0.5:5000");
        assert_eq!(
            unnamed.key(&trusted, &forwarded("203.0.113.66")),
            Some(PeerKey::UnnamedBehindProxy)
        );
        // Also an HTTP proxy, the header still wins over x-forwarded-for.
        let both = trusting("10.0.0.0/8", "10.0.0.0/8");
        assert_eq!(relayed.key(&both, &forwarded("203.0.113.66")), victim);
    }

    #[test]
    fn a_client_certificate_is_the_key() {
        let service = PeerInfo {
            certificate: Some([7; 32]),
            ..info("192.0.2.1:5000")
        };
        let trusted = TrustedProxies::default();
        assert_eq!(
            service.key(&trusted, &MetadataMap::new()),
            Some(PeerKey::Service([7; 32]))
        );
        assert_eq!(service.connection_address(&trusted), None);
    }
}
