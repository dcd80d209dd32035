//! The gRPC listener's accept pipeline, in front of tonic: everything a peer can hold open before
//! it has sent a single call is bounded here.
//!
//! 1. Accept, backing off when the process is out of descriptors (`telemetry::accept`).
//! 2. Refuse a peer shut out for its refused calls (`crate::penalty`); admit under the caps on
//!    open connections, in all and per peer IP, and only while the descriptors reserved for the
//!    process's own sockets stay free. A connection refused is closed at once and counted in
//!    `rides.grpc.connections.refused`.
//! 3. TCP keepalive and no-delay on the socket.
//! 4. In a task of its own, so a slow peer holds up nobody else: a PROXY protocol header if the
//!    peer is a trusted proxy (`admission::proxy_protocol`), the TLS handshake (if any) and the
//!    24-byte HTTP/2 connection preface, all within `GRPC_PREFACE_TIMEOUT_MS`, else closed.
//! 5. Handed to tonic as a [`Conn`], which replays the preface, closes the connection once the
//!    peer has opened no stream and sent no data for `GRPC_IDLE_TIMEOUT_MS`, at its maximum age
//!    and grace, or as soon as its peer is shut out, and gives its place under the caps back
//!    when it closes. Every call on it sees the connection's [`PeerInfo`] (tonic's connect
//!    info).
//!
//! HTTP/2 itself (stream cap, keepalive pings, connection age, reset-flood protection) is set on
//! tonic's builder in `server`.

use std::{
    convert::Infallible,
    future::Future,
    io,
    net::IpAddr,
    os::fd::AsRawFd,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use socket2::{SockRef, TcpKeepalive};
use telemetry::{
    accept::{ConnectionLimits, ConnectionPermit, accept},
    attr,
};
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::mpsc,
    time::{Instant, Sleep},
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;

use crate::{
    admission::{
        peer::{PeerInfo, PeerSource, TrustedProxies},
        proxy_protocol,
    },
    config::TransportConfig,
    metrics::metrics,
    penalty::Penalties,
};

/// What every HTTP/2 client sends first (RFC 9113, section 3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Connections accepted but not yet taken by tonic; tonic takes them as fast as they come.
const READY_QUEUE: usize = 64;

/// Accepts on `listener` until the returned stream is dropped (tonic drops it when it stops
/// accepting, which closes the listening socket). `handshake` turns a TCP connection into the
/// stream HTTP/2 runs over: itself in plaintext, a TLS session otherwise.
pub fn incoming<IO, H, F>(
    listener: TcpListener,
    transport: TransportConfig,
    penalties: Arc<Penalties>,
    trusted_proxies: TrustedProxies,
    handshake: H,
) -> ReceiverStream<Result<Conn<IO>, Infallible>>
where
    IO: AsyncRead + AsyncWrite + PeerSource + Unpin + Send + 'static,
    H: Fn(TcpStream) -> F + Send + Sync + 'static,
    F: Future<Output = io::Result<IO>> + Send + 'static,
{
    let handshake = Arc::new(handshake);
    let trusted_proxies = Arc::new(trusted_proxies);
    let (ready, taken) = mpsc::channel(READY_QUEUE);
    let limits = ConnectionLimits::new(
        transport.max_connections,
        transport.max_connections_per_ip,
        transport.reserved_descriptors,
    );
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = tokio::select! {
                () = ready.closed() => return,
                accepted = accept(&listener) => accepted,
            };
            if penalties.is_shut_out(peer.ip()) {
                refuse("shut_out");
                continue;
            }
            let permit = match limits.admit(peer.ip(), tcp.as_raw_fd()) {
                Ok(permit) => permit,
                Err(refused) => {
                    refuse(refused.as_str());
                    tracing::debug!(%peer, reason = refused.as_str(), "connection refused");
                    continue;
                }
            };
            configure(&tcp, transport.tcp_keepalive);
            let from_proxy = trusted_proxies.speaks_proxy_protocol(peer.ip());
            let handshake = Arc::clone(&handshake);
            let trusted_proxies = Arc::clone(&trusted_proxies);
            let ready = ready.clone();
            let penalties = Arc::clone(&penalties);
            tokio::spawn(async move {
                let opening = open(tcp, from_proxy, handshake.as_ref());
                let opened = tokio::time::timeout(transport.preface_timeout, opening).await;
                match opened {
                    Ok(Ok((io, proxied))) => {
                        let info = PeerInfo {
                            proxied,
                            ..io.peer_info()
                        };
                        let shut_out_by = info.connection_address(&trusted_proxies);
                        if shut_out_by.is_some_and(|ip| penalties.is_shut_out(ip)) {
                            refuse("shut_out");
                            return;
                        }
                        let conn = Conn::new(io, permit, &transport, info, shut_out_by, penalties);
                        let _ = ready.send(Ok(conn)).await;
                    }
                    Ok(Err(error)) => {
                        refuse("handshake_failed");
                        tracing::debug!(%peer, %error, "connection closed before HTTP/2");
                    }
                    Err(_) => {
                        refuse("preface_timeout");
                        tracing::debug!(%peer, "no HTTP/2 preface in time: connection closed");
                    }
                }
            });
        }
    });
    ReceiverStream::new(taken)
}

/// A connection's opening: the PROXY header from a trusted proxy (`from_proxy`), the handshake
/// (TLS, or none), then the HTTP/2 preface, read and checked here, so that a peer that is not an
/// HTTP/2 client is closed before it costs hyper a connection. Returns the stream and the client
/// address the proxy named, if any.
async fn open<IO, H, F>(
    mut tcp: TcpStream,
    from_proxy: bool,
    handshake: &H,
) -> io::Result<(IO, Option<std::net::SocketAddr>)>
where
    IO: AsyncRead + Unpin,
    H: Fn(TcpStream) -> F,
    F: Future<Output = io::Result<IO>>,
{
    let proxied = match from_proxy {
        true => proxy_protocol::read(&mut tcp).await?,
        false => None,
    };
    let mut io = handshake(tcp).await?;
    let mut preface = [0_u8; PREFACE.len()];
    io.read_exact(&mut preface).await?;
    if &preface != PREFACE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not an HTTP/2 connection preface",
        ));
    }
    Ok((io, proxied))
}

fn refuse(reason: &'static str) {
    metrics()
        .connections_refused
        .add(1, &[attr("reason", reason)]);
}

fn configure(tcp: &TcpStream, keepalive: Duration) {
    // Best effort: a socket that refuses an option still works.
    let _ = tcp.set_nodelay(true);
    let _ = SockRef::from(tcp).set_tcp_keepalive(
        &TcpKeepalive::new()
            .with_time(keepalive)
            .with_interval(keepalive),
    );
}

/// One admitted connection, as tonic sees it.
pub struct Conn<IO> {
    io: IO,
    /// The preface read during the handshake, replayed to hyper first.
    preface: &'static [u8],
    frames: FrameWatch,
    idle: Pin<Box<Sleep>>,
    idle_timeout: Duration,
    /// Connection age plus its grace. tonic is given only the age, at which it sends GOAWAY and
    /// lets calls finish: given a grace too, it would send no GOAWAY at all and cut the
    /// connection at age + grace (tonic 0.14's `connection_timeout_future`). The grace is kept
    /// here instead, as the hard end of a connection whose peer never finishes its calls.
    end_of_grace: Pin<Box<Sleep>>,
    /// What calls on this connection are told of their peer.
    info: PeerInfo,
    /// The address whose shut-out closes this connection (none for a trusted proxy that named
    /// no client, or a certificate-authenticated service), and the record of shut-outs.
    shut_out_by: Option<IpAddr>,
    penalties: Arc<Penalties>,
    _permit: ConnectionPermit,
}

impl<IO> Conn<IO> {
    fn new(
        io: IO,
        permit: ConnectionPermit,
        transport: &TransportConfig,
        info: PeerInfo,
        shut_out_by: Option<IpAddr>,
        penalties: Arc<Penalties>,
    ) -> Conn<IO> {
        let lifetime = transport.max_connection_age + transport.max_connection_age_grace;
        Conn {
            io,
            preface: PREFACE,
            frames: FrameWatch::default(),
            idle: Box::pin(tokio::time::sleep(transport.idle_timeout)),
            idle_timeout: transport.idle_timeout,
            end_of_grace: Box::pin(tokio::time::sleep(lifetime)),
            info,
            shut_out_by,
            penalties,
            _permit: permit,
        }
    }
}

impl<IO> Connected for Conn<IO> {
    // Read with `request.extensions().get::<PeerInfo>()`; tonic's own `remote_addr` and
    // `peer_certs` do not see it.
    type ConnectInfo = PeerInfo;

    fn connect_info(&self) -> PeerInfo {
        self.info.clone()
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Conn<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if !this.preface.is_empty() {
            let n = this.preface.len().min(buf.remaining());
            buf.put_slice(&this.preface[..n]);
            this.preface = &this.preface[n..];
            return Poll::Ready(Ok(()));
        }
        // hyper always has a read pending, so the timers' wake-ups reach this poll.
        if this.idle.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "connection idle for too long",
            )));
        }
        // A flood keeps this connection reading, so a peer shut out is cut off at once. No call
        // of it is in flight: every admitted call vouches for its peer (`crate::penalty`).
        if this
            .shut_out_by
            .is_some_and(|peer| this.penalties.is_shut_out(peer))
        {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "peer shut out for its refused calls",
            )));
        }
        if this.end_of_grace.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "connection past its maximum age and grace",
            )));
        }
        let before = buf.filled().len();
        let read = Pin::new(&mut this.io).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = read
            && this.frames.feed(&buf.filled()[before..])
        {
            let deadline = Instant::now() + this.idle_timeout;
            this.idle.as_mut().reset(deadline);
        }
        read
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Conn<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Follows the HTTP/2 frame headers in what the peer sends, to tell use from mere presence:
/// HEADERS, CONTINUATION and DATA frames are calls; PING, SETTINGS and WINDOW_UPDATE frames are
/// not (a client answering keepalive pings is alive, not busy).
#[derive(Debug, Default)]
struct FrameWatch {
    header: [u8; 9],
    have: usize,
    /// Payload bytes of the current frame still to pass.
    skip: usize,
}

impl FrameWatch {
    /// Whether `bytes` start a HEADERS, CONTINUATION or DATA frame.
    fn feed(&mut self, mut bytes: &[u8]) -> bool {
        let mut calls = false;
        while !bytes.is_empty() {
            if self.skip > 0 {
                let n = self.skip.min(bytes.len());
                self.skip -= n;
                bytes = &bytes[n..];
                continue;
            }
            let n = (self.header.len() - self.have).min(bytes.len());
            self.header[self.have..self.have + n].copy_from_slice(&bytes[..n]);
            self.have += n;
            bytes = &bytes[n..];
            if self.have == self.header.len() {
                let [l0, l1, l2, kind, ..] = self.header;
                self.skip = usize::from(l0) << 16 | usize::from(l1) << 8 | usize::from(l2);
                calls |= matches!(kind, 0x0 | 0x1 | 0x9);
                self.have = 0;
            }
        }
        calls
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, payload: usize) -> Vec<u8> {
        let len = u32::try_from(payload).unwrap_or(0).to_be_bytes();
        let mut frame = vec![len[1], len[2], len[3], kind, 0, 0, 0, 0, 1];
        frame.resize(9 + payload, 0xAB);
        frame
    }

    #[test]
    fn calls_are_told_from_pings_across_any_split() {
        let ping = frame(0x6, 8);
        let window_update = frame(0x8, 4);
        let headers = frame(0x1, 30);
        // Payload bytes that look like a HEADERS frame header must not count.
        let mut settings = frame(0x4, 18);
        settings[9..18].copy_from_slice(&frame(0x1, 0));
        let quiet: Vec<u8> = [ping.clone(), settings, window_update].concat();
        for split in 1..quiet.len() {
            let mut watch = FrameWatch::default();
            assert!(!watch.feed(&quiet[..split]));
            assert!(!watch.feed(&quiet[split..]));
        }
        let busy: Vec<u8> = [ping, headers].concat();
        for split in 1..busy.len() {
            let mut watch = FrameWatch::default();
            let first = watch.feed(&busy[..split]);
            let second = watch.feed(&busy[split..]);
            assert!(first || second, "split at {split}");
        }
    }
}
