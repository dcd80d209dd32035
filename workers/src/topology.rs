//! The RabbitMQ topology, declared idempotently by every worker at start (declaring an existing
//! entity with the same arguments is a no-op; with different arguments the broker refuses, which
//! is why changes to queue arguments go through policies, see `docs/workers.md`).
//!
//! ```text
//! {prefix} (direct) ──ride.receipt──► {prefix}.receipts (quorum, delivery limit, DLX)
//!                                         │ rejected / over the delivery limit
//!                                         ▼
//!                               {prefix}.dead-letter (fanout) ──► {prefix}.dead-letter (quorum)
//! ```
//!
//! Every name derives from one prefix so that each test can own a private copy. Each job type of
//! the registry ([`crate::jobs::registry`], or the one given to [`Topology::with_jobs`]) gets its
//! queue, `{prefix}.{QUEUE}`, declared and bound with its routing key as the receipts queue above
//! is.

use lapin::{
    Channel, ExchangeKind,
    options::{
        ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
        QueueDeleteOptions,
    },
    types::{AMQPValue, FieldTable, LongString, ShortString},
};

use contract::{BackgroundJob, ReceiptJob};

use crate::jobs::{self, JobType, Registry};

/// Routing key of `contract::message::ReceiptMessage`.
pub const RECEIPT_ROUTING_KEY: &str = ReceiptJob::ROUTING_KEY;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    pub exchange: String,
    pub receipts_queue: String,
    pub dead_letter_exchange: String,
    pub dead_letter_queue: String,
    /// Deliveries of one message before the quorum queue dead-letters it.
    pub delivery_limit: u32,
    /// The job types whose queues this topology declares.
    pub jobs: Registry,
}

impl Topology {
    /// The fleet's topology: the queues of [`jobs::registry`].
    pub fn from_prefix(prefix: &str, delivery_limit: u32) -> Topology {
        Topology::with_jobs(prefix, delivery_limit, jobs::registry())
    }

    /// A topology declaring the queues of `jobs` (a test adds a job type of its own).
    pub fn with_jobs(prefix: &str, delivery_limit: u32, jobs: Registry) -> Topology {
        Topology {
            exchange: prefix.to_owned(),
            receipts_queue: job_queue(prefix, &JobType::of::<ReceiptJob>()),
            dead_letter_exchange: format!("{prefix}.dead-letter"),
            dead_letter_queue: format!("{prefix}.dead-letter"),
            delivery_limit,
            jobs,
        }
    }

    /// The queue a job type's messages land in.
    pub fn queue_of(&self, kind: &JobType) -> String {
        job_queue(&self.exchange, kind)
    }

    /// Declares exchanges, queues and bindings. Idempotent.
    pub async fn declare(&self, channel: &Channel) -> lapin::Result<()> {
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        channel
            .exchange_declare(
                self.exchange.as_str().into(),
                ExchangeKind::Direct,
                durable,
                FieldTable::default(),
            )
            .await?;
        // Fanout: whatever the original routing key, a dead letter lands in the one queue.
        channel
            .exchange_declare(
                self.dead_letter_exchange.as_str().into(),
                ExchangeKind::Fanout,
                durable,
                FieldTable::default(),
            )
            .await?;
        let queue_options = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        let mut dead_letter_args = FieldTable::default();
        dead_letter_args.insert(short("x-queue-type"), long("quorum"));
        channel
            .queue_declare(
                self.dead_letter_queue.as_str().into(),
                queue_options,
                dead_letter_args,
            )
            .await?;
        channel
            .queue_bind(
                self.dead_letter_queue.as_str().into(),
                self.dead_letter_exchange.as_str().into(),
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        for kind in self.jobs.iter() {
            let queue = job_queue(&self.exchange, kind);
            channel
                .queue_declare(
                    queue.as_str().into(),
                    queue_options,
                    self.job_queue_arguments(),
                )
                .await?;
            channel
                .queue_bind(
                    queue.as_str().into(),
                    self.exchange.as_str().into(),
                    kind.routing_key.into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
        }
        Ok(())
    }

    fn job_queue_arguments(&self) -> FieldTable {
        let mut args = FieldTable::default();
        // Replicated and durable: a broker node loss loses no receipt.
        args.insert(short("x-queue-type"), long("quorum"));
        // Bounded redelivery: a message that keeps failing ends in the dead-letter queue instead
        // of cycling forever.
        args.insert(
            short("x-delivery-limit"),
            AMQPValue::LongLongInt(i64::from(self.delivery_limit)),
        );
        args.insert(
            short("x-dead-letter-exchange"),
            long(&self.dead_letter_exchange),
        );
        // At-least-once dead-lettering: the message leaves this queue only once the dead-letter
        // queue has confirmed it (the default, at-most-once, may drop it). It requires
        // reject-publish overflow, which publishers see as a nack, and the enqueuer keeps
        // nacked jobs staged.
        args.insert(short("x-dead-letter-strategy"), long("at-least-once"));
        args.insert(short("x-overflow"), long("reject-publish"));
        args
    }

    /// Deletes everything [`Topology::declare`] created. For tests and teardown scripts.
    pub async fn delete(&self, channel: &Channel) -> lapin::Result<()> {
        let job_queues = self.jobs.iter().map(|kind| job_queue(&self.exchange, kind));
        for queue in job_queues.chain([self.dead_letter_queue.clone()]) {
            channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await?;
        }
        for exchange in [&self.exchange, &self.dead_letter_exchange] {
            channel
                .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
                .await?;
        }
        Ok(())
    }
}

/// A job type's queue under the topology's prefix (the exchange's name).
fn job_queue(prefix: &str, kind: &JobType) -> String {
    format!("{prefix}.{}", kind.queue_suffix)
}

fn short(value: &str) -> ShortString {
    value.into()
}

fn long(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value))
}
