//! `--ha`'s faults on the high-availability topology: primary kills and planned switchovers of
//! PostgreSQL, and broker node kills, each logged on the timeline under the labels here.

use std::{
    sync::{Arc, atomic::AtomicBool},
    time::{Duration, Instant, SystemTime},
};

use rand::{Rng, rngs::StdRng};

use crate::{
    args::Args,
    counters::{Counters, FaultEvent, Tallies, Timeline},
    ha_samples,
    services::Services,
    setup::Plan,
};

use super::{FaultTask, rare_fault_delay, sleep_unless_stopped};

/// The timeline's labels of `--ha`'s faults (`outages::FaultClass` sorts them by these).
pub(crate) const PRIMARY_KILL: &str = "failover/postgresql primary SIGKILL";
pub(crate) const SWITCHOVER: &str = "failover/postgresql planned switchover";
/// Followed by the node's number.
pub(crate) const BROKER_KILL: &str = "sigkill/rabbitmq node";

/// Starts `--ha`'s faults: primary failovers and switchovers of PostgreSQL, and broker node
/// kills. Returns the PostgreSQL and RabbitMQ tasks.
pub(super) fn start(
    args: &Args,
    plan: &Plan,
    services: &Arc<Services>,
    tallies: &Tallies,
    stop: &Arc<AtomicBool>,
    rng: impl Fn(u64) -> StdRng,
) -> (FaultTask, FaultTask) {
    let ha = HaFaults {
        services: Arc::clone(services),
        faults: Arc::clone(&tallies.faults),
        timeline: Arc::clone(&tallies.timeline),
        stop: Arc::clone(stop),
        traffic: plan.duration,
    };
    (
        tokio::spawn(ha.clone().fail_over(
            rng(6),
            args.pg_restart_every_secs,
            args.switchover_ratio,
        )),
        tokio::spawn(ha.kill_brokers(rng(7), args.rabbit_restart_every_secs)),
    )
}

/// `--ha`'s faults on the high-availability topology, one at a time per kind, each only once the
/// last has healed (a primary with a synchronous standby, three brokers), and each logged on
/// the timeline so that the report can say what the clients saw around it.
#[derive(Clone)]
struct HaFaults {
    services: Arc<Services>,
    faults: Arc<Counters>,
    timeline: Arc<Timeline>,
    stop: Arc<AtomicBool>,
    traffic: Duration,
}

impl HaFaults {
    /// PostgreSQL: SIGKILL of the primary's postmaster (Patroni promotes the synchronous standby
    /// and re-joins the old primary with pg_rewind), or a planned switchover.
    async fn fail_over(
        self,
        mut rng: StdRng,
        mean: f64,
        switchover_ratio: f64,
    ) -> anyhow::Result<()> {
        let Some(ha) = &self.services.ha else {
            return Ok(());
        };
        tokio::spawn(ha_samples::primary_sessions(
            ha.admin_url.clone(),
            Arc::clone(&self.timeline),
            Arc::clone(&self.stop),
        ));
        tokio::spawn(ha_samples::own_clock(
            Arc::clone(&self.timeline),
            Arc::clone(&self.stop),
        ));
        let mut first = true;
        while self.wait_next(&mut rng, &mut first, mean).await {
            let at = Instant::now();
            let label = if rng.random_bool(switchover_ratio.clamp(0.0, 1.0)) {
                ha.switchover().await?;
                SWITCHOVER
            } else {
                ha.kill_primary().await?;
                PRIMARY_KILL
            };
            self.faults.add(label, 1);
            ha.wait_healthy().await?;
            self.log(label.to_owned(), at);
        }
        Ok(())
    }

    /// RabbitMQ: SIGKILL of one node of three, started again after a few seconds.
    async fn kill_brokers(self, mut rng: StdRng, mean: f64) -> anyhow::Result<()> {
        let Some(ha) = &self.services.ha else {
            return Ok(());
        };
        let mut first = true;
        while self.wait_next(&mut rng, &mut first, mean).await {
            let node: u8 = rng.random_range(1..=3);
            let at = Instant::now();
            ha.kill_broker(node).await?;
            self.faults
                .add("sigkill/rabbitmq node (of a cluster of 3)", 1);
            tokio::time::sleep(Duration::from_millis(rng.random_range(1000..5000))).await;
            ha.start_broker(node).await?;
            ha.wait_healthy().await?;
            self.log(format!("{BROKER_KILL} {node}"), at);
        }
        Ok(())
    }

    /// Sleeps until the next fault is due; false once traffic stops.
    async fn wait_next(&self, rng: &mut StdRng, first: &mut bool, mean: f64) -> bool {
        sleep_unless_stopped(&self.stop, rare_fault_delay(rng, first, self.traffic, mean)).await
    }

    fn log(&self, label: String, at: Instant) {
        self.timeline.fault(FaultEvent {
            label,
            at,
            at_wall: SystemTime::now() - at.elapsed(),
            healed: Instant::now(),
        });
    }
}
