//! Connecting to RabbitMQ. lapin's own automatic recovery is left off: each worker reconnects
//! explicitly, because only the worker knows what an interrupted operation means (the enqueuer
//! must not delete unconfirmed jobs; the receipt worker relies on the broker requeueing unacked
//! deliveries).

use std::time::Duration;

use lapin::{Channel, Connection, ConnectionProperties};
use tokio_util::sync::CancellationToken;

use crate::{backoff::Backoff, shutdown, topology::Topology};

/// An open connection with one channel on which the topology is declared.
pub struct AmqpSession {
    pub connection: Connection,
    pub channel: Channel,
}

impl AmqpSession {
    pub async fn open(url: &str, topology: &Topology) -> lapin::Result<AmqpSession> {
        let connection = Connection::connect(url, ConnectionProperties::default()).await?;
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
                if !shutdown::sleep(shutdown_token, delay).await {
                    return None;
                }
            }
        }
    }
}
