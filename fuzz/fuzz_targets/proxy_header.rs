//! The PROXY protocol header a trusted proxy sends first (`admission::proxy_protocol::parse`), on
//! any bytes: a trusted proxy relays whatever its client's connection starts with only after its
//! own header, but a broken or hostile proxy may send anything.
//!
//! Properties: no input panics; a header found is no longer than the input, a v1 line at most
//! 107 bytes ending in CRLF, a v2 header at most 16 + 1024 bytes; the header alone parses to the
//! same answer as the header followed by anything; `Incomplete` only for an input that is a
//! prefix of a v1 or v2 header and shorter than their bound; a v1 client is exactly the source
//! field of its line.
#![no_main]

use api_server::admission::proxy_protocol::{Header, parse};
use libfuzzer_sys::fuzz_target;

const V1_PREFIX: &[u8] = b"PROXY ";
const V2_SIGNATURE: &[u8] = b"\r\n\r\n\0\r\nQUIT\n";

fuzz_target!(|data: &[u8]| {
    let Ok(header) = parse(data) else {
        return;
    };
    match header {
        Header::Absent => {
            let n = data.len().min(V1_PREFIX.len());
            assert_ne!(&data[..n], &V1_PREFIX[..n]);
            let n = data.len().min(V2_SIGNATURE.len());
            assert_ne!(&data[..n], &V2_SIGNATURE[..n]);
        }
        Header::Incomplete => assert!(data.len() < 16 + 1024, "{} bytes", data.len()),
        Header::Present { len, client } => {
            assert!(len <= data.len());
            let own = &data[..len];
            if own.starts_with(V1_PREFIX) {
                assert!(len <= 107, "v1 line of {len} bytes");
                assert!(own.ends_with(b"\r\n"));
                if let Some(client) = client {
                    let line = std::str::from_utf8(own).unwrap();
                    let source = line.split(' ').nth(2).unwrap();
                    assert_eq!(source.parse::<std::net::IpAddr>().unwrap(), client.ip());
                }
            } else {
                assert!(own.starts_with(V2_SIGNATURE));
                assert!(len <= 16 + 1024);
            }
            assert_eq!(parse(own).unwrap(), Header::Present { len, client });
        }
    }
});
