//! HTTP/2 written by hand, for the abuse campaign: a well-behaved client library (h2, tonic)
//! respects the server's `MAX_CONCURRENT_STREAMS`, answers its pings and never floods resets,
//! so it cannot play the attacker whose effect the campaign measures. This writes the frames of
//! RFC 9113 directly, with header blocks encoded as HPACK literals (RFC 7541 §6.2.2, never
//! indexed, no Huffman), and reads the server's frames back to count what it refused.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt};

/// The client connection preface (RFC 9113 §3.4).
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

pub const DATA: u8 = 0x0;
pub const HEADERS: u8 = 0x1;
pub const RST_STREAM: u8 = 0x3;
pub const SETTINGS: u8 = 0x4;
pub const PING: u8 = 0x6;
pub const GOAWAY: u8 = 0x7;
pub const WINDOW_UPDATE: u8 = 0x8;

pub const END_STREAM: u8 = 0x1;
pub const ACK: u8 = 0x1;
pub const END_HEADERS: u8 = 0x4;

/// Error codes (RFC 9113 §7) the campaign reports by name.
pub const CANCEL: u32 = 0x8;

/// The largest frame payload read back: the default `SETTINGS_MAX_FRAME_SIZE`, which the campaign
/// never raises.
const MAX_FRAME: usize = 16_384;

/// Appends one frame to `out`.
pub fn frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    let len = u32::try_from(payload.len())
        .unwrap_or(u32::MAX)
        .min(0xFF_FFFF);
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&(stream & 0x7FFF_FFFF).to_be_bytes());
    out.extend_from_slice(payload);
}

/// A SETTINGS frame with the given (identifier, value) pairs.
pub fn settings(out: &mut Vec<u8>, values: &[(u16, u32)]) {
    let payload: Vec<u8> = values
        .iter()
        .flat_map(|(id, value)| id.to_be_bytes().into_iter().chain(value.to_be_bytes()))
        .collect();
    frame(out, SETTINGS, 0, 0, &payload);
}

pub fn rst_stream(out: &mut Vec<u8>, stream: u32, code: u32) {
    frame(out, RST_STREAM, 0, stream, &code.to_be_bytes());
}

pub fn window_update(out: &mut Vec<u8>, stream: u32, increment: u32) {
    frame(out, WINDOW_UPDATE, 0, stream, &increment.to_be_bytes());
}

/// A HEADERS frame carrying a whole header block.
pub fn headers(out: &mut Vec<u8>, stream: u32, block: &[u8], end_stream: bool) {
    let flags = END_HEADERS | if end_stream { END_STREAM } else { 0 };
    frame(out, HEADERS, flags, stream, block);
}

/// The header block of a gRPC call to `path`, with `extra` headers (e.g. `authorization`).
pub fn grpc_request_block(path: &str, extra: &[(&str, &str)]) -> Vec<u8> {
    let mut block = Vec::new();
    let fixed = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "abuse.local"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ];
    for (name, value) in fixed.iter().chain(extra) {
        literal(&mut block, name, value);
    }
    block
}

/// A literal header field without indexing, with a literal name (RFC 7541 §6.2.2).
fn literal(out: &mut Vec<u8>, name: &str, value: &str) {
    out.push(0x00);
    string(out, name.as_bytes());
    string(out, value.as_bytes());
}

/// A string literal without Huffman coding (RFC 7541 §5.2).
fn string(out: &mut Vec<u8>, bytes: &[u8]) {
    integer(out, 7, 0x00, bytes.len());
    out.extend_from_slice(bytes);
}

/// An integer with an N-bit prefix (RFC 7541 §5.1); `flags` are the first byte's high bits.
fn integer(out: &mut Vec<u8>, prefix_bits: u32, flags: u8, value: usize) {
    let max = (1usize << prefix_bits) - 1;
    if value < max {
        out.push(flags | value as u8);
        return;
    }
    out.push(flags | max as u8);
    let mut rest = value - max;
    while rest >= 128 {
        out.push((rest % 128) as u8 | 0x80);
        rest /= 128;
    }
    out.push(rest as u8);
}

/// One frame read from the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: u8,
    pub flags: u8,
    pub stream: u32,
    pub payload: Vec<u8>,
}

impl Frame {
    /// The error code of a RST_STREAM or GOAWAY frame.
    pub fn error_code(&self) -> Option<u32> {
        let at = match self.kind {
            RST_STREAM => 0,
            GOAWAY => 4,
            _ => return None,
        };
        let bytes: [u8; 4] = self.payload.get(at..at + 4)?.try_into().ok()?;
        Some(u32::from_be_bytes(bytes))
    }
}

/// Reads the next frame; `None` at a clean end of stream.
pub async fn read_frame(reader: &mut (impl AsyncRead + Unpin)) -> io::Result<Option<Frame>> {
    let mut header = [0u8; 9];
    match reader.read_exact(&mut header).await {
        Ok(_) => {}
        Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(error) => return Err(error),
    }
    let len = usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds the default maximum frame size"),
        ));
    }
    let mut payload = vec![0u8; len];
    reader.read_exact(&mut payload).await?;
    Ok(Some(Frame {
        kind: header[3],
        flags: header[4],
        stream: u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & 0x7FFF_FFFF,
        payload,
    }))
}

/// The name of an HTTP/2 error code, for reports.
pub fn error_name(code: u32) -> &'static str {
    match code {
        0x0 => "NO_ERROR",
        0x1 => "PROTOCOL_ERROR",
        0x2 => "INTERNAL_ERROR",
        0x3 => "FLOW_CONTROL_ERROR",
        0x4 => "SETTINGS_TIMEOUT",
        0x5 => "STREAM_CLOSED",
        0x6 => "FRAME_SIZE_ERROR",
        0x7 => "REFUSED_STREAM",
        0x8 => "CANCEL",
        0x9 => "COMPRESSION_ERROR",
        0xa => "CONNECT_ERROR",
        0xb => "ENHANCE_YOUR_CALM",
        0xc => "INADEQUATE_SECURITY",
        0xd => "HTTP_1_1_REQUIRED",
        _ => "UNKNOWN",
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn encoded(prefix_bits: u32, value: usize) -> Vec<u8> {
        let mut out = Vec::new();
        integer(&mut out, prefix_bits, 0, value);
        out
    }

    #[test]
    fn integers_match_rfc_7541_appendix_c1() {
        assert_eq!(encoded(5, 10), [0x0a]);
        assert_eq!(encoded(5, 1337), [0x1f, 0x9a, 0x0a]);
        assert_eq!(encoded(8, 42), [0x2a]);
        // The boundary: a value equal to the prefix's maximum takes a second byte of 0.
        assert_eq!(encoded(7, 127), [0x7f, 0x00]);
    }

    #[test]
    fn a_literal_field_is_laid_out_as_rfc_7541_section_6_2_2() {
        let mut out = Vec::new();
        literal(&mut out, "custom-key", "custom-header");
        let mut expected = vec![0x00, 0x0a];
        expected.extend_from_slice(b"custom-key");
        expected.push(0x0d);
        expected.extend_from_slice(b"custom-header");
        assert_eq!(out, expected);
    }

    #[tokio::test]
    async fn frames_round_trip_through_the_reader() {
        let mut wire = Vec::new();
        rst_stream(&mut wire, 3, CANCEL);
        headers(&mut wire, 5, &grpc_request_block("/a.B/C", &[]), true);
        let mut reader = wire.as_slice();
        let rst = read_frame(&mut reader).await.unwrap().unwrap();
        assert_eq!(
            (rst.kind, rst.stream, rst.error_code()),
            (RST_STREAM, 3, Some(CANCEL))
        );
        let headers = read_frame(&mut reader).await.unwrap().unwrap();
        assert_eq!(
            (headers.kind, headers.flags, headers.stream),
            (HEADERS, END_HEADERS | END_STREAM, 5)
        );
        assert_eq!(read_frame(&mut reader).await.unwrap(), None);
    }

    #[tokio::test]
    async fn an_oversized_frame_is_an_error_not_an_allocation() {
        let mut wire = vec![0xff, 0xff, 0xff, DATA, 0, 0, 0, 0, 1];
        wire.extend_from_slice(&[0; 16]);
        let error = read_frame(&mut wire.as_slice()).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::InvalidData);
    }
}
