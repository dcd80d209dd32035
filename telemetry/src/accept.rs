//! Accepting TCP connections safely, shared by every listener in the workspace (the api-server's
//! gRPC port and each process's `/metrics`): an accept loop that backs off instead of spinning
//! when the process is out of file descriptors, and caps on open connections in all and per peer
//! IP address, counted by a guard that each connection holds until it closes.

use std::{
    collections::HashMap,
    io,
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use tokio::net::{TcpListener, TcpStream};

/// The first pause after an accept error that is not the peer's; doubled up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(5);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

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
}

impl Refused {
    /// The value of the `reason` attribute on refused-connection metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Refused::Total => "max_connections",
            Refused::PerIp => "max_connections_per_ip",
        }
    }
}

impl ConnectionLimits {
    /// `max_per_ip` of `usize::MAX` leaves only the total cap.
    pub fn new(max_total: usize, max_per_ip: usize) -> ConnectionLimits {
        ConnectionLimits {
            inner: Arc::new(Limits {
                max_total,
                max_per_ip,
                open: Mutex::new(Open::default()),
            }),
        }
    }

    /// Counts a new connection from `peer`, or refuses it if a cap is reached. The connection
    /// counts until the returned permit is dropped.
    pub fn admit(&self, peer: IpAddr) -> Result<ConnectionPermit, Refused> {
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

    #[test]
    fn caps_connections_per_peer_and_in_all_and_gives_places_back() {
        let limits = ConnectionLimits::new(3, 2);
        let a1 = limits.admit(A).unwrap();
        let _a2 = limits.admit(A).unwrap();
        assert_eq!(limits.admit(A).unwrap_err(), Refused::PerIp);
        let _b1 = limits.admit(B).unwrap();
        assert_eq!(limits.admit(B).unwrap_err(), Refused::Total);
        assert_eq!(limits.open(), 3);
        drop(a1);
        assert_eq!(limits.open(), 2);
        let _a3 = limits.admit(A).unwrap();
        assert_eq!(limits.admit(A).unwrap_err(), Refused::Total);
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
