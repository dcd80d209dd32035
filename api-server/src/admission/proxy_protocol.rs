//! The PROXY protocol (HAProxy's, versions 1 and 2) header a trusted proxy may send before
//! anything else on a connection, naming the client it is relaying. Only read from peers in
//! `GRPC_TRUSTED_PROXIES`; anyone else's bytes go straight to TLS or HTTP/2, so nobody can
//! claim another address by sending such a header.

use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use tokio::{io::AsyncReadExt, net::TcpStream};

const V2_SIGNATURE: &[u8; 12] = b"\r\n\r\n\0\r\nQUIT\n";
const V1_PREFIX: &[u8; 6] = b"PROXY ";
/// Longest v1 line, CRLF included (the specification's own bound).
const V1_MAX: usize = 107;
/// A v2 header this long is not a proxy's: addresses and a few TLVs take a few hundred bytes.
const V2_MAX: usize = 16 + 1024;

/// What the first bytes of a connection say.
#[derive(Debug, PartialEq, Eq)]
pub enum Header {
    /// Not a PROXY header: TLS or HTTP/2 starts here.
    Absent,
    /// More bytes are needed to tell.
    Incomplete,
    /// A header of `len` bytes naming the client (`None`: the proxy's own health check, `LOCAL`
    /// or `UNKNOWN`, or an address family other than IP).
    Present {
        len: usize,
        client: Option<SocketAddr>,
    },
}

/// Parses what a connection has sent so far.
pub fn parse(bytes: &[u8]) -> io::Result<Header> {
    for signature in [&V1_PREFIX[..], &V2_SIGNATURE[..]] {
        let n = bytes.len().min(signature.len());
        if bytes[..n] == signature[..n] {
            if bytes.len() < signature.len() {
                return Ok(Header::Incomplete);
            }
            return if signature.len() == V1_PREFIX.len() {
                parse_v1(bytes)
            } else {
                parse_v2(bytes)
            };
        }
    }
    Ok(Header::Absent)
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("bad PROXY header: {what}"),
    )
}

fn parse_v1(bytes: &[u8]) -> io::Result<Header> {
    let Some(end) = bytes.windows(2).position(|pair| pair == b"\r\n") else {
        return if bytes.len() >= V1_MAX {
            Err(invalid("v1 line too long"))
        } else {
            Ok(Header::Incomplete)
        };
    };
    let line = std::str::from_utf8(&bytes[..end]).map_err(|_| invalid("v1 not ASCII"))?;
    let fields: Vec<&str> = line.split(' ').collect();
    let client = match fields.as_slice() {
        ["PROXY", "UNKNOWN", ..] => None,
        [
            "PROXY",
            "TCP4" | "TCP6",
            source,
            _destination,
            port,
            _destination_port,
        ] => {
            let ip: IpAddr = source.parse().map_err(|_| invalid("v1 source address"))?;
            let port: u16 = port.parse().map_err(|_| invalid("v1 source port"))?;
            Some(SocketAddr::new(ip, port))
        }
        _ => return Err(invalid("v1 fields")),
    };
    Ok(Header::Present {
        len: end + 2,
        client,
    })
}

fn parse_v2(bytes: &[u8]) -> io::Result<Header> {
    if bytes.len() < 16 {
        return Ok(Header::Incomplete);
    }
    let version_command = bytes[12];
    if version_command >> 4 != 2 {
        return Err(invalid("v2 version"));
    }
    let len = 16 + usize::from(u16::from_be_bytes([bytes[14], bytes[15]]));
    if len > V2_MAX {
        return Err(invalid("v2 header too long"));
    }
    if bytes.len() < len {
        return Ok(Header::Incomplete);
    }
    let body = &bytes[16..len];
    let local = version_command & 0x0F == 0;
    let client = match (local, bytes[13] >> 4) {
        (true, _) => None,
        (false, 1) if body.len() >= 12 => {
            let ip = Ipv4Addr::new(body[0], body[1], body[2], body[3]);
            Some(SocketAddr::new(
                ip.into(),
                u16::from_be_bytes([body[8], body[9]]),
            ))
        }
        (false, 2) if body.len() >= 36 => {
            let mut octets = [0; 16];
            octets.copy_from_slice(&body[..16]);
            let port = u16::from_be_bytes([body[32], body[33]]);
            Some(SocketAddr::new(Ipv6Addr::from(octets).into(), port))
        }
        (false, 1 | 2) => return Err(invalid("v2 address block too short")),
        // AF_UNSPEC or AF_UNIX: no IP client to key by.
        (false, _) => None,
    };
    Ok(Header::Present { len, client })
}

/// Reads a PROXY header off the start of `tcp` if there is one, leaving everything after it
/// unread; `Ok(None)` when there is none or it names no IP client.
pub async fn read(tcp: &mut TcpStream) -> io::Result<Option<SocketAddr>> {
    let mut peeked = vec![0; V2_MAX];
    loop {
        let n = tcp.peek(&mut peeked).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        match parse(&peeked[..n])? {
            Header::Absent => return Ok(None),
            Header::Present { len, client } => {
                let mut consumed = vec![0; len];
                tcp.read_exact(&mut consumed).await?;
                return Ok(client);
            }
            Header::Incomplete if n == peeked.len() => return Err(invalid("header too long")),
            // A peek does not clear read readiness, so waiting on it would spin: a trusted
            // proxy sends its header in one write, and a split one is rare.
            Header::Incomplete => tokio::time::sleep(std::time::Duration::from_millis(2)).await,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn reads_v1_headers() {
        let header = b"PROXY TCP4 192.0.2.7 10.0.0.1 56324 50051\r\nPRI * HTTP/2.0";
        assert_eq!(
            parse(header).unwrap(),
            Header::Present {
                len: 43,
                client: Some("192.0.2.7:56324".parse().unwrap())
            }
        );
        assert_eq!(
            parse(b"PROXY UNKNOWN\r\n").unwrap(),
            Header::Present {
                len: 15,
                client: None
            }
        );
        assert_eq!(parse(b"PROXY TCP4 1.2").unwrap(), Header::Incomplete);
        assert_eq!(parse(b"PRO").unwrap(), Header::Incomplete);
        assert!(parse(b"PROXY TCP4 nonsense\r\n").is_err());
        assert!(parse(&[b"PROXY ".as_slice(), &[b'1'; 200]].concat()).is_err());
    }

    #[test]
    fn reads_v2_headers() {
        let mut header = V2_SIGNATURE.to_vec();
        header.extend([0x21, 0x11, 0, 12]);
        header.extend([192, 0, 2, 7, 10, 0, 0, 1]);
        header.extend(56324_u16.to_be_bytes());
        header.extend(50051_u16.to_be_bytes());
        let mut with_more = header.clone();
        with_more.extend(b"PRI * HTTP/2.0");
        assert_eq!(
            parse(&with_more).unwrap(),
            Header::Present {
                len: 28,
                client: Some("192.0.2.7:56324".parse().unwrap())
            }
        );
        assert_eq!(parse(&header[..20]).unwrap(), Header::Incomplete);
        // LOCAL: the proxy's own connection.
        let mut local = V2_SIGNATURE.to_vec();
        local.extend([0x20, 0x00, 0, 0]);
        assert_eq!(
            parse(&local).unwrap(),
            Header::Present {
                len: 16,
                client: None
            }
        );
        let mut bad_version = V2_SIGNATURE.to_vec();
        bad_version.extend([0x11, 0x11, 0, 0]);
        assert!(parse(&bad_version).is_err());
    }

    #[test]
    fn tls_and_http2_are_not_proxy_headers() {
        assert_eq!(parse(b"PRI * HTTP/2.0\r\n").unwrap(), Header::Absent);
        assert_eq!(parse(&[0x16, 0x03, 0x01, 0x02]).unwrap(), Header::Absent);
    }
}
