//! Connecting to RabbitMQ. lapin's own automatic recovery is left off: each worker reconnects
//! explicitly, because only the worker knows what an interrupted operation means (the enqueuer
//! must not delete unconfirmed jobs; the receipt worker relies on the broker requeueing unacked
//! deliveries).
//!
//! Every connection to the broker goes through [`connect`]: `amqp://` is plaintext, `amqps://` is
//! TLS (rustls on ring) verified against the public web PKI or, with RabbitMQ's `cacertfile` URI
//! query parameter (`amqps://host/%2f?cacertfile=/etc/rides/amqp-ca.pem`), against that PEM file
//! as well, for a broker with a private CA.
//!
//! `AMQP_URL` may name every node of a RabbitMQ cluster, comma-separated (commas inside a URL are
//! percent-encoded, so the list is unambiguous). Each connection tries the nodes in turn, starting
//! one past the node the previous connection used, so a worker whose node died reconnects to a
//! live one instead of retrying the dead one first. Queues are quorum queues replicated on every
//! node, so any node serves them; publisher confirms still gate every delete.

use std::{
    sync::atomic::{AtomicUsize, Ordering},
    time::Duration,
};

use lapin::{
    Channel, Connection, ConnectionProperties, DefaultConnectionBuilder, tcp::OwnedTLSConfig,
    uri::AMQPUri,
};
use tokio_util::sync::CancellationToken;

use crate::{backoff::Backoff, topology::Topology, worker_loop};

/// An open connection with one channel on which the topology is declared.
pub struct AmqpSession {
    pub connection: Connection,
    pub channel: Channel,
}

impl AmqpSession {
    pub async fn open(url: &str, topology: &Topology) -> lapin::Result<AmqpSession> {
        let connection = connect(url).await?;
        let channel = connection.create_channel().await?;
        topology.declare(&channel).await?;
        Ok(AmqpSession {
            connection,
            channel,
        })
    }

    pub fn is_usable(&self) -> bool {
        self.connection.status().connected() && self.channel.status().connected()
    }

    /// Closes politely; errors are irrelevant because the session is being dropped.
    pub async fn close(self) {
        let _ = self.channel.close(200, "bye".into()).await;
        let _ = self.connection.close(200, "bye".into()).await;
    }
}

/// How long one node may take to accept a connection before the next is tried: a node whose
/// machine vanished would otherwise hold the worker for the kernel's TCP timeout (minutes).
const NODE_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The node the next connection tries first (an index into the URL list).
static NEXT_NODE: AtomicUsize = AtomicUsize::new(0);

/// Opens a connection to one of the comma-separated nodes of `urls` (see the module's
/// documentation for the order and for TLS). The error is the last node's.
pub async fn connect(urls: &str) -> lapin::Result<Connection> {
    let nodes = nodes(urls);
    let first = NEXT_NODE.load(Ordering::Relaxed);
    let mut last_error = None;
    for offset in 0..nodes.len() {
        let index = (first + offset) % nodes.len();
        let attempt = tokio::time::timeout(NODE_CONNECT_TIMEOUT, connect_node(nodes[index]));
        let error = match attempt.await {
            Ok(Ok(connection)) => {
                NEXT_NODE.store(index + 1, Ordering::Relaxed);
                return Ok(connection);
            }
            Ok(Err(error)) => error,
            Err(_elapsed) => lapin::Error::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the node did not accept the connection in time",
            )),
        };
        if nodes.len() > 1 {
            // The node's position, not its URL: the URL carries the broker password.
            tracing::warn!(node = index, %error, "cannot reach this RabbitMQ node, trying the next");
        }
        last_error = Some(error);
    }
    Err(last_error.unwrap_or_else(|| {
        lapin::Error::from(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "AMQP_URL names no broker",
        ))
    }))
}

/// The node URLs of a comma-separated `AMQP_URL`, blanks ignored.
fn nodes(urls: &str) -> Vec<&str> {
    urls.split(',')
        .map(str::trim)
        .filter(|url| !url.is_empty())
        .collect()
}

async fn connect_node(url: &str) -> lapin::Result<Connection> {
    let uri = parse_uri(url)?;
    DefaultConnectionBuilder::new()?
        .with_uri(uri)
        .with_properties(ConnectionProperties::default())
        .with_tls_config(tls_config(url)?)
        .connect()
        .await
}

/// `url` parsed. The parser's own error repeats the whole URL, password included, and ends up in
/// the workers' logs: this one names the URL with its credentials redacted.
/// Without the `//`, lapin's parser reads `amqp:/user:secret@host` as a vhost on localhost, and
/// the broker's refusal repeats that vhost, password included.
fn parse_uri(url: &str) -> std::io::Result<AMQPUri> {
    let invalid = || {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "AMQP_URL {} is not an amqp://host or amqps://host URL",
                crate::redact::url(url)
            ),
        )
    };
    if !(url.starts_with("amqp://") || url.starts_with("amqps://")) {
        return Err(invalid());
    }
    url.parse().map_err(|_| invalid())
}

/// The `cacertfile` of `url`'s query, read. lapin ignores query parameters it does not know.
fn tls_config(url: &str) -> std::io::Result<OwnedTLSConfig> {
    let query = url.split_once('?').map_or("", |(_, query)| query);
    let pairs: Vec<(String, String)> =
        serde_urlencoded::from_str(query).map_err(std::io::Error::other)?;
    let cert_chain = match pairs.iter().find(|(name, _)| name == "cacertfile") {
        None => None,
        // A CA that would never be used is a configuration mistake that reads like TLS.
        Some(_) if !url.starts_with("amqps://") => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "cacertfile needs TLS (an amqps:// URL)",
            ));
        }
        Some((_, path)) => Some(std::fs::read_to_string(path).map_err(|error| {
            std::io::Error::new(
                error.kind(),
                format!("cannot read cacertfile {path}: {error}"),
            )
        })?),
    };
    Ok(OwnedTLSConfig {
        identity: None,
        cert_chain,
    })
}

/// Opens a session, retrying with back-off until it succeeds or shutdown is requested.
pub async fn connect_with_backoff(
    url: &str,
    topology: &Topology,
    shutdown_token: &CancellationToken,
) -> Option<AmqpSession> {
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
    loop {
        match AmqpSession::open(url, topology).await {
            Ok(session) => return Some(session),
            Err(error) => {
                let delay = backoff.next_delay();
                tracing::warn!(%error, ?delay, "cannot reach RabbitMQ, retrying");
                if !worker_loop::sleep(shutdown_token, delay).await {
                    return None;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{connect, nodes, tls_config};

    #[tokio::test]
    async fn a_malformed_url_is_not_repeated_with_its_password() {
        for url in [
            "amqps:user:s3cr3t-pw@broker",
            "amqp:/user:s3cr3t-pw@broker:5672/%2f",
            "amqps://user:s3cr3t-pw@broker:notaport/%2f",
        ] {
            let error = connect(url).await.unwrap_err().to_string();
            assert!(!error.contains("s3cr3t-pw"), "{error}");
        }
    }

    #[test]
    fn splits_a_cluster_into_its_nodes() {
        assert_eq!(nodes("amqp://a:5672/%2f"), vec!["amqp://a:5672/%2f"]);
        assert_eq!(
            nodes(" amqp://u:p%2Cq@a:5672/%2f , amqp://b:5673/%2f,,"),
            vec!["amqp://u:p%2Cq@a:5672/%2f", "amqp://b:5673/%2f"]
        );
        assert!(nodes(" , ").is_empty());
    }

    #[test]
    fn reads_the_ca_named_in_the_url() {
        assert_eq!(tls_config("amqps://broker/%2f").unwrap().cert_chain, None);
        let plaintext = tls_config("amqp://broker/%2f?cacertfile=/etc/ca.pem").unwrap_err();
        assert_eq!(plaintext.kind(), std::io::ErrorKind::InvalidInput);
        let dir = std::env::temp_dir().join(format!("amqp-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = dir.join("ca.pem");
        std::fs::write(&ca, "-----BEGIN CERTIFICATE-----\n").unwrap();
        let url = format!(
            "amqps://u:p@broker:5671/%2f?heartbeat=30&cacertfile={}",
            ca.display()
        );
        assert_eq!(
            tls_config(&url).unwrap().cert_chain.as_deref(),
            Some("-----BEGIN CERTIFICATE-----\n")
        );
        let error = tls_config("amqps://broker/%2f?cacertfile=/nonexistent/ca.pem").unwrap_err();
        assert!(error.to_string().contains("/nonexistent/ca.pem"), "{error}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
