//! Accepting TCP connections safely, shared by every listener in the workspace (the api-server's
//! gRPC port and each process's `/metrics`): an accept loop that backs off instead of spinning
//! when the process is out of file descriptors, caps on open connections in all and per peer
//! IP address, counted by a guard that each connection holds until it closes, and a reserve of
//! descriptors that inbound connections may never take.

use std::{
    collections::HashMap,
    io,
    net::{IpAddr, SocketAddr},
    os::fd::RawFd,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use tokio::net::{TcpListener, TcpStream};

/// The first pause after an accept error that is not the peer's; doubled up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(5);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// Descriptors a listener leaves free by default for the process's own sockets: the database
/// pool, the provider's and the broker's connections, telemetry exports, with room to spare.
pub const DEFAULT_RESERVED_DESCRIPTORS: u64 = 256;

/// Accepts the next connection. Errors that concern only the connection being accepted (the peer
/// reset it before it was taken) are skipped at once; any other error (EMFILE, ENFILE, ENOBUFS,
/// ENOMEM) is logged and retried after a pause that doubles while it lasts, because the listen
/// socket stays readable while the process cannot take the connection: retrying at once spins a
/// core and starves the connections already open. The pause also lets open connections close
/// and give descriptors back.
pub async fn accept(listener: &TcpListener) -> (TcpStream, SocketAddr) {
    let mut backoff = FIRST_BACKOFF;
    loop {
        match listener.accept().await {
            Ok(accepted) => return accepted,
            Err(error) if is_peer_error(&error) => continue,
            Err(error) => {
                tracing::warn!(%error, pause = ?backoff, "cannot accept a connection; pausing");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

fn is_peer_error(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
            | io::ErrorKind::WouldBlock
    )
}

/// Caps on open connections: in all, and from one peer IP address.
#[derive(Clone, Debug)]
pub struct ConnectionLimits {
    inner: Arc<Limits>,
}

#[derive(Debug)]
struct Limits {
    max_total: usize,
    max_per_ip: usize,
    reserved_descriptors: u64,
    open: Mutex<Open>,
}

#[derive(Debug, Default)]
struct Open {
    total: usize,
    per_ip: HashMap<IpAddr, usize>,
}

/// Why a connection was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// Too many connections in all.
    Total,
    /// Too many connections from this peer's address.
    PerIp,
    /// Taking the connection would eat into the descriptors kept for the process's own sockets.
    Descriptors,
}

impl Refused {
    /// The value of the `reason` attribute on refused-connection metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Refused::Total => "max_connections",
            Refused::PerIp => "max_connections_per_ip",
            Refused::Descriptors => "reserved_descriptors",
        }
    }
}

impl ConnectionLimits {
    /// `max_per_ip` of `usize::MAX` leaves only the total cap. `reserved_descriptors` are never
    /// taken by an inbound connection (see [`ConnectionLimits::admit`]).
    pub fn new(max_total: usize, max_per_ip: usize, reserved_descriptors: u64) -> ConnectionLimits {
        ConnectionLimits {
            inner: Arc::new(Limits {
                max_total,
                max_per_ip,
                reserved_descriptors,
                open: Mutex::new(Open::default()),
            }),
        }
    }

    /// Counts a new connection from `peer`, accepted on descriptor `fd`, or refuses it if a cap
    /// is reached. The connection counts until the returned permit is dropped.
    ///
    /// A server out of descriptors cannot open a database or provider socket, so every call it
    /// has admitted stalls until its deadline: the connections already served come first. The
    /// kernel gives an accepted socket the lowest free descriptor, so every number below `fd` is
    /// in use; when `fd` comes within the reserve of the soft limit (read on every accept: an
    /// operator may change it while the process runs), fewer than the reserve are left and the
    /// connection is refused.
    pub fn admit(&self, peer: IpAddr, fd: RawFd) -> Result<ConnectionPermit, Refused> {
        if !leaves_reserve(fd, self.inner.reserved_descriptors) {
            return Err(Refused::Descriptors);
        }
        // The counters stay consistent even if a holder panicked: each update is one statement.
        let mut open = self
            .inner
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if open.total >= self.inner.max_total {
            return Err(Refused::Total);
        }
        let from_peer = open.per_ip.entry(peer).or_insert(0);
        if *from_peer >= self.inner.max_per_ip {
            return Err(Refused::PerIp);
        }
        *from_peer += 1;
        open.total += 1;
        Ok(ConnectionPermit {
            limits: Arc::clone(&self.inner),
            peer,
        })
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.inner
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .total
    }
}

fn leaves_reserve(fd: RawFd, reserve: u64) -> bool {
    let Some(soft_limit) = rustix::process::getrlimit(rustix::process::Resource::Nofile).current
    else {
        return true;
    };
    u64::try_from(fd).is_ok_and(|fd| fd.saturating_add(1).saturating_add(reserve) <= soft_limit)
}

/// One admitted connection; dropping it gives its place back.
#[derive(Debug)]
pub struct ConnectionPermit {
    limits: Arc<Limits>,
    peer: IpAddr,
}

impl Drop for ConnectionPermit {
    fn drop(&mut self) {
        let mut open = self
            .limits
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        open.total = open.total.saturating_sub(1);
        if let Some(from_peer) = open.per_ip.get_mut(&self.peer) {
            *from_peer = from_peer.saturating_sub(1);
            if *from_peer == 0 {
                open.per_ip.remove(&self.peer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::net::Ipv4Addr;

    use super::*;

    const A: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
    const B: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2));

    /// A descriptor number far below any soft limit.
    const LOW_FD: RawFd = 10;

    #[test]
    fn caps_connections_per_peer_and_in_all_and_gives_places_back() {
        let limits = ConnectionLimits::new(3, 2, 0);
        let a1 = limits.admit(A, LOW_FD).unwrap();
        let _a2 = limits.admit(A, LOW_FD).unwrap();
        assert_eq!(limits.admit(A, LOW_FD).unwrap_err(), Refused::PerIp);
        let _b1 = limits.admit(B, LOW_FD).unwrap();
        assert_eq!(limits.admit(B, LOW_FD).unwrap_err(), Refused::Total);
        assert_eq!(limits.open(), 3);
        drop(a1);
        assert_eq!(limits.open(), 2);
        let _a3 = limits.admit(A, LOW_FD).unwrap();
        assert_eq!(limits.admit(A, LOW_FD).unwrap_err(), Refused::Total);
    }

    #[test]
    fn a_connection_within_the_reserve_of_the_descriptor_limit_is_refused_and_holds_no_place() {
        let soft_limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .and_then(|limit| RawFd::try_from(limit).ok())
            .unwrap();
        let limits = ConnectionLimits::new(10, 10, 100);
        assert_eq!(
            limits.admit(A, soft_limit - 100).unwrap_err(),
            Refused::Descriptors
        );
        assert_eq!(limits.open(), 0);
        // The highest number that still leaves exactly the reserve free.
        let _a = limits.admit(A, soft_limit - 101).unwrap();
        assert_eq!(limits.open(), 1);
    }

    #[test]
    fn only_the_peers_own_mistakes_are_skipped_without_a_pause() {
        assert!(is_peer_error(&io::Error::from(
            io::ErrorKind::ConnectionAborted
        )));
        // EMFILE: the process is out of descriptors.
        assert!(!is_peer_error(&io::Error::from_raw_os_error(24)));
    }
}
