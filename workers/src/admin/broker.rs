//! The admin commands' view of the broker: a connection of their own and queue depths.

use lapin::{Channel, Connection};
use serde::Serialize;

use super::*;

/// Opens an AMQP connection without declaring anything: an operator's command must not create
/// or alter topology in production (a declaration with different arguments would even be
/// refused). Queues are checked with passive declarations instead.
pub(crate) async fn connect_broker(amqp_url: &str) -> Result<Connection, AdminError> {
    Ok(crate::amqp::connect(amqp_url).await?)
}

/// The message and consumer counts of a queue (a passive declare, on a channel of its own: a
/// failed passive declare closes its channel). A missing queue is an error.
pub(crate) async fn queue_depth(
    connection: &Connection,
    queue: &str,
) -> Result<QueueDepth, AdminError> {
    let channel = connection.create_channel().await?;
    let declared = channel
        .queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..lapin::options::QueueDeclareOptions::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await;
    let declared = match declared {
        Ok(declared) => {
            close_channel(&channel).await;
            declared
        }
        Err(error) => {
            return Err(AdminError::BrokerState(format!(
                "queue {queue:?} cannot be inspected (does it exist? is AMQP_TOPOLOGY_PREFIX \
                 right?): {error}"
            )));
        }
    };
    Ok(QueueDepth {
        queue: queue.to_owned(),
        messages: declared.message_count(),
        consumers: declared.consumer_count(),
    })
}

/// Closes a channel and waits for the broker's answer, so that closing the connection next does
/// not race it. Errors are irrelevant: the channel is done with.
pub(crate) async fn close_channel(channel: &Channel) {
    if channel.status().connected() {
        let _ = channel.close(200, "bye".into()).await;
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct QueueDepth {
    pub queue: String,
    pub messages: u32,
    pub consumers: u32,
}
