//! The long-lived consumer: `basic.consume` with the prefetch, batches of what has arrived, each in
//! its own task, and a reconnect when the connection is lost.

use std::{sync::Arc, time::Duration};

use futures_util::{FutureExt, StreamExt};
use lapin::{
    message::Delivery,
    options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions},
    types::FieldTable,
};
use tokio::{sync::Semaphore, task::JoinSet, time::Instant};
use tokio_util::sync::CancellationToken;

use super::{ConsumeError, JobConsumer, JobHandler, Tally};
use crate::amqp::{self, AmqpSession};

/// How long a settle may wait for lapin, and how long the in-flight deliveries of a consumer
/// whose connection is gone may take to finish, before the consumer gives up on them and
/// reconnects. Without these bounds a consumer was seen to hang for good after a broker node's
/// reset (no receipt mailed for the last 12 minutes of an HA run).
pub(super) const SETTLE_TIMEOUT: Duration = Duration::from_secs(10);

/// How often a waiting consumer looks at its connection's state.
const LIVENESS_CHECK: Duration = Duration::from_millis(500);

/// The outcomes of one batch's task.
type BatchResults<O> = Vec<Result<O, ConsumeError>>;

/// Resolves once `session` is no longer usable.
async fn connection_lost(session: &AmqpSession) {
    let mut tick = tokio::time::interval(LIVENESS_CHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if !session.is_usable() {
            return;
        }
    }
}

/// What ended the wait for the next delivery.
enum Next {
    Delivery(Box<Delivery>),
    Stop(Result<(), ConsumeError>),
}

impl<H: JobHandler> JobConsumer<H> {
    /// Consumes until `shutdown` is cancelled, reconnecting with back-off when the connection is
    /// lost (unacked deliveries return to the queue with the connection). On shutdown the
    /// consumer is cancelled first, then in-flight deliveries finish and are settled.
    pub async fn run(self: Arc<Self>, amqp_url: &str, shutdown: CancellationToken) -> H::Summary {
        let mut total = H::Summary::default();
        while !shutdown.is_cancelled() {
            let Some(session) =
                amqp::connect_with_backoff(amqp_url, &self.topology, &shutdown).await
            else {
                break;
            };
            match Arc::clone(&self).consume(&session, &shutdown).await {
                Ok(summary) => total.add(&summary),
                Err(error) => {
                    tracing::warn!(%error, queue = self.queue, "consumer stopped, reconnecting");
                }
            }
            // A polite close on a dead connection may never be answered either.
            let _ = tokio::time::timeout(SETTLE_TIMEOUT, session.close()).await;
        }
        total
    }

    async fn consume(
        self: Arc<Self>,
        session: &AmqpSession,
        shutdown: &CancellationToken,
    ) -> Result<H::Summary, ConsumeError> {
        let channel = &session.channel;
        channel
            .basic_qos(self.settings.prefetch, BasicQosOptions::default())
            .await?;
        let mut consumer = channel
            .basic_consume(
                self.queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let in_flight = Arc::new(Semaphore::new(usize::from(self.settings.prefetch.max(1))));
        let mut tasks: JoinSet<BatchResults<H::Outcome>> = JoinSet::new();
        let mut summary = H::Summary::default();
        let mut result = Ok(());
        let mut forming = Forming::default();
        let mut draining = false;
        loop {
            if forming.ready(self.batch_size(), tasks.is_empty()) {
                let deliveries = forming.take();
                if !self
                    .dispatch(deliveries, &in_flight, &mut tasks, session, shutdown)
                    .await
                {
                    result = result.and(Err(ConsumeError::ConnectionLost));
                    break;
                }
                continue;
            }
            // A batch is counted (its summary and the outcome metric) as soon as its task ends,
            // not when the next delivery happens to arrive: a drained queue must not hide the
            // last batches' outcomes from the metrics until shutdown. Every branch is
            // cancel-safe: the forming batch is the loop's, and the wait for a delivery only
            // awaits the stream's `next`.
            let due = forming.due;
            tokio::select! {
                Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                    record(&mut summary, done, &mut result);
                }
                // Its wait is over: the next turn hands it on.
                () = tokio::time::sleep_until(due.unwrap_or_else(Instant::now)), if due.is_some() => {}
                next = self.next_delivery(&mut consumer, session, shutdown) => match next {
                    Next::Delivery(delivery) => {
                        forming.push(*delivery, self.settings.batch_wait);
                        self.take_ready(&mut consumer, &mut forming);
                    }
                    Next::Stop(stopped) => {
                        // On shutdown the deliveries already taken are run and settled, with
                        // those the broker sent before the cancel (below); on a lost connection
                        // they return to the queue with it.
                        draining = stopped.is_ok();
                        result = result.and(stopped);
                        break;
                    }
                },
            }
        }
        // Stop receiving first (on shutdown, running what was received), then let in-flight
        // deliveries finish and be settled.
        let leftover = draining.then_some(forming);
        self.stop_receiving(
            &mut consumer,
            leftover,
            &in_flight,
            &mut tasks,
            session,
            shutdown,
        )
        .await;
        let finished = async {
            while let Some(done) = tasks.join_next().await {
                record(&mut summary, done, &mut result);
            }
        };
        // Each task's own steps are bounded (the handler's, and every settle); this bound is for
        // what is not. Detached, not aborted: a task cut mid-transaction is a crash the handler
        // must survive anyway, but one left to finish is cleaner.
        if tokio::time::timeout(SETTLE_TIMEOUT * 3, finished)
            .await
            .is_err()
        {
            tracing::warn!(
                unfinished = tasks.len(),
                "in-flight jobs did not finish; left to finish on their own, their deliveries \
                 return to the queue with the connection"
            );
            tasks.detach_all();
        }
        result.map(|()| summary)
    }

    /// Cancels the consumer. On shutdown (`leftover`: the forming batch) it then runs that batch
    /// and, once the broker has confirmed the cancel, every delivery it sent before: they precede
    /// the cancel-ok on the channel, so the stream already holds them (at most the prefetch), and
    /// left there they would stay unacked until the channel closes.
    async fn stop_receiving(
        self: &Arc<Self>,
        consumer: &mut lapin::Consumer,
        leftover: Option<Forming>,
        in_flight: &Arc<Semaphore>,
        tasks: &mut JoinSet<BatchResults<H::Outcome>>,
        session: &AmqpSession,
        shutdown: &CancellationToken,
    ) {
        let cancel = session
            .channel
            .basic_cancel(consumer.tag(), BasicCancelOptions::default());
        let cancelled = matches!(
            tokio::time::timeout(SETTLE_TIMEOUT, cancel).await,
            Ok(Ok(()))
        );
        let Some(mut forming) = leftover else { return };
        loop {
            if cancelled {
                self.take_ready(consumer, &mut forming);
            }
            if forming.is_empty()
                || !self
                    .dispatch(forming.take(), in_flight, tasks, session, shutdown)
                    .await
            {
                return;
            }
        }
    }

    /// Hands a batch to a task of its own once its deliveries' permits are free; `false` if the
    /// connection was lost while waiting (every permit may be held by a delivery whose settle
    /// hangs on a dead connection).
    async fn dispatch(
        self: &Arc<Self>,
        deliveries: Vec<Delivery>,
        in_flight: &Arc<Semaphore>,
        tasks: &mut JoinSet<BatchResults<H::Outcome>>,
        session: &AmqpSession,
        shutdown: &CancellationToken,
    ) -> bool {
        let wanted = u32::try_from(deliveries.len()).unwrap_or(u32::MAX);
        let permit = tokio::select! {
            permit = Arc::clone(in_flight).acquire_many_owned(wanted) => match permit {
                Ok(permit) => permit,
                Err(_) => return false,
            },
            () = connection_lost(session) => return false,
        };
        let worker = Arc::clone(self);
        let shutdown = shutdown.clone();
        tasks.spawn(async move {
            let settled = worker.process(deliveries, &shutdown).await;
            drop(permit);
            settled
        });
        true
    }

    /// Waits for the next delivery.
    async fn next_delivery(
        &self,
        consumer: &mut lapin::Consumer,
        session: &AmqpSession,
        shutdown: &CancellationToken,
    ) -> Next {
        let next = tokio::select! {
            () = shutdown.cancelled() => return Next::Stop(Ok(())),
            () = connection_lost(session) => return Next::Stop(Err(ConsumeError::ConnectionLost)),
            next = consumer.next() => next,
        };
        match next {
            Some(Ok(delivery)) => Next::Delivery(Box::new(delivery)),
            Some(Err(error)) => Next::Stop(Err(error.into())),
            None => Next::Stop(Ok(())),
        }
    }

    /// Adds to the forming batch what the broker has already sent, up to the batch size.
    fn take_ready(&self, consumer: &mut lapin::Consumer, forming: &mut Forming) {
        while forming.len() < self.batch_size() {
            match consumer.next().now_or_never() {
                Some(Some(Ok(delivery))) => forming.deliveries.push(delivery),
                // The connection is failing: the next wait ends the consumer, once this batch
                // is handed on.
                Some(Some(Err(error))) => {
                    tracing::warn!(%error, queue = self.queue, "the consumer's stream failed");
                    break;
                }
                Some(None) | None => break,
            }
        }
    }
}

/// The batch being gathered. It goes to the handler when it is full, when no other batch is in
/// flight (an idle queue is not held back), or `batch_wait` after its first delivery. While other
/// batches run, deliveries arrive one at a time: handed on at once, each would be a batch of one
/// or two, and the handler's statements per batch would be paid per delivery.
#[derive(Default)]
struct Forming {
    deliveries: Vec<Delivery>,
    /// When the batch goes even if not full: `batch_wait` after its first delivery; `None`
    /// while it is empty.
    due: Option<Instant>,
}

impl Forming {
    fn push(&mut self, delivery: Delivery, batch_wait: Duration) {
        if self.deliveries.is_empty() {
            self.due = Some(Instant::now() + batch_wait);
        }
        self.deliveries.push(delivery);
    }

    fn len(&self) -> usize {
        self.deliveries.len()
    }

    fn is_empty(&self) -> bool {
        self.deliveries.is_empty()
    }

    fn ready(&self, batch_size: usize, idle: bool) -> bool {
        let waited = self.due.is_some_and(|due| Instant::now() >= due);
        !self.is_empty() && (idle || waited || self.len() >= batch_size)
    }

    fn take(&mut self) -> Vec<Delivery> {
        self.due = None;
        std::mem::take(&mut self.deliveries)
    }
}

fn record<O, S: Tally<O>>(
    summary: &mut S,
    done: Result<BatchResults<O>, tokio::task::JoinError>,
    result: &mut Result<(), ConsumeError>,
) {
    let settled = match done {
        Ok(settled) => settled,
        Err(error) => {
            tracing::error!(%error, "a job batch's task failed");
            return;
        }
    };
    for one in settled {
        match one {
            Ok(outcome) => summary.count(&outcome),
            Err(error) => {
                // Settling failed: the connection is gone and the broker requeues the delivery.
                tracing::warn!(%error, "could not settle a delivery");
                if result.is_ok() {
                    *result = Err(error);
                }
            }
        }
    }
}
