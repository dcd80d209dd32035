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

/// A v1 line (`PROXY TCP4|TCP6 <source> <destination> <source port> <destination port>\r\n`, or
/// `PROXY UNKNOWN …\r\n`), at most 107 bytes with its CRLF, printable ASCII, single spaces.
fn parse_v1(bytes: &[u8]) -> io::Result<Header> {
    let within = &bytes[..bytes.len().min(V1_MAX)];
    let Some(end) = within.windows(2).position(|pair| pair == b"\r\n") else {
        return if bytes.len() >= V1_MAX {
            Err(invalid("v1 line too long"))
        } else {
            Ok(Header::Incomplete)
        };
    };
    let line = &bytes[..end];
    if !line.iter().all(|byte| (0x20..0x7f).contains(byte)) {
        return Err(invalid("v1 not printable ASCII"));
    }
    let line = std::str::from_utf8(line).map_err(|_| invalid("v1 not ASCII"))?;
    let fields: Vec<&str> = line.split(' ').collect();
    let client = match fields.as_slice() {
        // The specification: the rest of an UNKNOWN line is ignored.
        ["PROXY", "UNKNOWN", ..] => None,
        [
            "PROXY",
            family @ ("TCP4" | "TCP6"),
            source,
            destination,
            port,
            destination_port,
        ] => {
            let source = v1_address(family, source)?;
            v1_address(family, destination)?;
            v1_port(destination_port)?;
            Some(SocketAddr::new(source, v1_port(port)?))
        }
        _ => return Err(invalid("v1 fields")),
    };
    Ok(Header::Present {
        len: end + 2,
        client,
    })
}

/// An address of the line's family: dotted quad for TCP4, IPv6 text for TCP6.
fn v1_address(family: &str, text: &str) -> io::Result<IpAddr> {
    let ip = match family {
        "TCP4" => text.parse::<Ipv4Addr>().map(IpAddr::from),
        _ => text.parse::<Ipv6Addr>().map(IpAddr::from),
    };
    ip.map_err(|_| invalid("v1 address not of its family"))
}

/// A port: 1 to 5 decimal digits, no sign and no leading zero, at most 65535.
fn v1_port(text: &str) -> io::Result<u16> {
    let digits = !text.is_empty() && text.len() <= 5 && text.bytes().all(|b| b.is_ascii_digit());
    if !digits || (text.len() > 1 && text.starts_with('0')) {
        return Err(invalid("v1 port"));
    }
    text.parse().map_err(|_| invalid("v1 port"))
}

/// The v2 command nibble: LOCAL (the proxy's own connection) or PROXY.
const V2_LOCAL: u8 = 0x0;
const V2_PROXY: u8 = 0x1;
/// The v2 address families and the one transport a TCP server can be relayed.
const AF_UNSPEC: u8 = 0x0;
const AF_INET: u8 = 0x1;
const AF_INET6: u8 = 0x2;
const AF_UNIX: u8 = 0x3;
const STREAM: u8 = 0x1;

fn parse_v2(bytes: &[u8]) -> io::Result<Header> {
    if bytes.len() < 16 {
        return Ok(Header::Incomplete);
    }
    let (version, command) = (bytes[12] >> 4, bytes[12] & 0x0F);
    if version != 2 {
        return Err(invalid("v2 version"));
    }
    if command != V2_LOCAL && command != V2_PROXY {
        return Err(invalid("v2 command"));
    }
    let (family, transport) = (bytes[13] >> 4, bytes[13] & 0x0F);
    if family > AF_UNIX || transport > 0x2 {
        return Err(invalid("v2 address family or transport"));
    }
    let len = 16 + usize::from(u16::from_be_bytes([bytes[14], bytes[15]]));
    if len > V2_MAX {
        return Err(invalid("v2 header too long"));
    }
    if bytes.len() < len {
        return Ok(Header::Incomplete);
    }
    let body = &bytes[16..len];
    // LOCAL: the specification has the receiver ignore the address block, whatever it says.
    if command == V2_LOCAL {
        return Ok(Header::Present { len, client: None });
    }
    let client = match (family, transport) {
        (AF_UNSPEC, _) => None,
        (AF_INET | AF_INET6 | AF_UNIX, t) if t != STREAM => {
            return Err(invalid("v2 transport is not a stream"));
        }
        (AF_INET, _) if body.len() >= 12 => {
            let ip = Ipv4Addr::new(body[0], body[1], body[2], body[3]);
            Some(SocketAddr::new(
                ip.into(),
                u16::from_be_bytes([body[8], body[9]]),
            ))
        }
        (AF_INET6, _) if body.len() >= 36 => {
            let mut octets = [0; 16];
            octets.copy_from_slice(&body[..16]);
            let port = u16::from_be_bytes([body[32], body[33]]);
            Some(SocketAddr::new(Ipv6Addr::from(octets).into(), port))
        }
        // A UNIX socket's two paths: no IP client to key by.
        (AF_UNIX, _) if body.len() >= 216 => None,
        _ => return Err(invalid("v2 address block too short")),
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

    fn v2(version_command: u8, family_transport: u8, body: &[u8]) -> Vec<u8> {
        let mut header = V2_SIGNATURE.to_vec();
        header.extend([version_command, family_transport]);
        header.extend(u16::try_from(body.len()).unwrap().to_be_bytes());
        header.extend(body);
        header
    }

    #[test]
    fn v2_commands_and_transports_other_than_the_specifications_are_refused() {
        let inet = [192, 0, 2, 7, 10, 0, 0, 1, 0xdc, 0x04, 0xc3, 0x53];
        assert!(parse(&v2(0x21, 0x11, &inet)).is_ok());
        // Commands 0x2-0xF are not PROXY.
        for command in 0x22..=0x2F {
            assert!(parse(&v2(command, 0x11, &inet)).is_err(), "{command:#x}");
        }
        // UDP (DGRAM) or an unspecified transport is not a TCP client; 0x3-0xF are no transport.
        for family_transport in [0x10, 0x12, 0x13, 0x1F, 0x20, 0x22, 0x40, 0xF1] {
            assert!(
                parse(&v2(0x21, family_transport, &[0; 36])).is_err(),
                "{family_transport:#x}"
            );
        }
        // A UNIX socket names no IP client, once its whole address block is there.
        assert!(parse(&v2(0x21, 0x31, &[0; 12])).is_err());
        assert_eq!(
            parse(&v2(0x21, 0x31, &[0; 216])).unwrap(),
            Header::Present {
                len: 232,
                client: None
            }
        );
        // LOCAL ignores whatever address block follows.
        assert!(parse(&v2(0x20, 0x12, &inet)).is_ok());
    }

    #[test]
    fn v1_lines_are_read_strictly() {
        // 107 bytes with the CRLF is the longest line; a longer one is refused even with its CRLF.
        let longest = format!("PROXY UNKNOWN {}\r\n", "x".repeat(107 - 16));
        assert_eq!(longest.len(), 107);
        assert!(parse(longest.as_bytes()).is_ok());
        let longer = format!("PROXY UNKNOWN {}\r\n", "x".repeat(108 - 16));
        assert!(parse(longer.as_bytes()).is_err());
        for bad in [
            "PROXY TCP4 2001:db8::1 10.0.0.1 1 2\r\n",
            "PROXY TCP6 192.0.2.7 2001:db8::2 1 2\r\n",
            "PROXY TCP4 192.0.2.7 nonsense 1 2\r\n",
            "PROXY TCP4 192.0.2.7 10.0.0.1 +1 2\r\n",
            "PROXY TCP4 192.0.2.7 10.0.0.1 01 2\r\n",
            "PROXY TCP4 192.0.2.7 10.0.0.1 1 65536\r\n",
            "PROXY TCP4 192.0.2.7  10.0.0.1 1 2\r\n",
            "PROXY TCP4 192.0.2.7 10.0.0.1 1 2 3\r\n",
            "PROXY TCP4 192.0.2.7\t10.0.0.1 1 2\r\n",
            "PROXY TCP5 192.0.2.7 10.0.0.1 1 2\r\n",
        ] {
            assert!(parse(bad.as_bytes()).is_err(), "{bad:?}");
        }
        assert_eq!(
            parse(b"PROXY TCP6 2001:db8::1 2001:db8::2 0 65535\r\n").unwrap(),
            Header::Present {
                len: 44,
                client: Some("[2001:db8::1]:0".parse().unwrap())
            }
        );
    }

    #[test]
    fn tls_and_http2_are_not_proxy_headers() {
        assert_eq!(parse(b"PRI * HTTP/2.0\r\n").unwrap(), Header::Absent);
        assert_eq!(parse(&[0x16, 0x03, 0x01, 0x02]).unwrap(), Header::Absent);
    }
}
