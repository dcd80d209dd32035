//! The money campaign (with `--money`): refunds only of our own charges, no ride
//! paid after its refund, every refund audited, no receipt for an unrecorded charge, under the
//! campaign's usual crashes and faults. Three things run beside the clients:
//!
//! - [`crate::other_product`]: another product on the account, making look-alike charges;
//! - the reconciler **with refunds on** (`workers reconciler --once --refund`, at its default
//!   caps) every [`REFUND_PASS_EVERY`], the way an installation would run it;
//! - the money riders: each makes keys whose charge ends up made at the provider but not recorded,
//!   on a key the completer gave up (the case refunds are for), then retries the key, as a rider
//!   whose app comes back would. For each key: the provider fails the rider's charges
//!   (`error_500` aimed at its customer) until the real completer gives the key up
//!   (`COMPLETER_MAX_ATTEMPTS` is 4 in this mode); then one charge goes through with its answer
//!   lost (`charge_then_drop`); then every other key waits for the reconciler's refund before
//!   its retry (which must answer `PAYMENT_REFUNDED`), the others retry at once, racing the
//!   refund (a retry that records the charge first makes the refund refuse). After a refund the
//!   rider stages a forged receipt job for the ride, naming the refunded charge: the receipt
//!   worker must dead-letter it.
//!
//! [`crate::money_checks`] reads the evidence and judges it.

use std::{
    sync::{Arc, atomic::AtomicBool},
    time::{Duration, Instant},
};

use diesel::{QueryableByName, sql_types::BigInt};
use diesel_async::RunQueryDsl;
use rand::{SeedableRng, rngs::StdRng};
use rides_client::{Credential, RidesClient};
use serde_json::Value;
use tokio::task::JoinHandle;

use crate::{
    args::Args,
    clients::{Window, grpc_endpoint},
    counters::Counters,
    faults::sleep_unless_stopped,
    maintenance::run_once_with,
    money_rider::Rider,
    other_product::OtherProduct,
    reconciliation::reconciler_env,
    setup::{Plan, Wiring},
};

/// How often the refunding reconciler runs while traffic does.
const REFUND_PASS_EVERY: Duration = Duration::from_secs(3);
/// The completer's attempts before it gives a key up, in this mode (20 otherwise): the riders'
/// keys must be given up within the traffic window.
pub(crate) const COMPLETER_MAX_ATTEMPTS: &str = "4";

/// What one money rider's key went through.
#[derive(Clone, Debug)]
pub(crate) struct MoneyKey {
    pub(crate) key: String,
    pub(crate) user_id: i64,
    pub(crate) given_up: bool,
    /// Whether the rider waited for the refund before retrying (and saw it made).
    pub(crate) refunded_before_retry: bool,
    /// A forged receipt job was staged for the key's ride after its refund.
    pub(crate) forged_receipt: bool,
    /// Each answer, in order (`ok`, or the label of an error).
    pub(crate) answers: Vec<String>,
}

/// The running money campaign.
pub(crate) struct Money {
    stop: Arc<AtomicBool>,
    riders: Vec<JoinHandle<Vec<MoneyKey>>>,
    refunds: JoinHandle<()>,
    other: OtherProduct,
    /// The other product's charges, and the refunding passes' summaries, by label.
    pub(crate) counts: Arc<Counters>,
}

impl Money {
    pub(crate) async fn start(
        args: &Args,
        plan: &Plan,
        wiring: &Wiring,
        http: &reqwest::Client,
        window: Window,
    ) -> anyhow::Result<Option<Money>> {
        if !args.money {
            return Ok(None);
        }
        let counts = Arc::new(Counters::default());
        let stop = Arc::new(AtomicBool::new(false));
        let pool = schema::build_pool(
            &wiring.database_url,
            2,
            Duration::from_secs(5),
            schema::PlanCache::Auto,
        );
        let channel = grpc_endpoint(args, &wiring.grpc_addr)?.connect_lazy();
        let mut riders = Vec::new();
        for i in 0..args.money_riders {
            let customer = format!("cus_proof_money_{}_{i}", plan.run_id);
            let (user, token) = api_server::auth::create_user(
                &pool,
                &format!("proof-money-{}-{i}@proof.rocketrides.test", plan.run_id),
                &customer,
                "pm_card_visa",
            )
            .await?;
            let rider = Rider {
                n: i,
                run_id: plan.run_id.clone(),
                user_id: user.id,
                customer,
                client: RidesClient::with_targets(
                    channel.clone(),
                    Vec::new(),
                    Credential::user(token.as_str()),
                ),
                pool: pool.clone(),
                http: http.clone(),
                stripe_base: wiring.stripe_base.clone(),
                rng: StdRng::seed_from_u64(plan.seed.wrapping_add(2900 + u64::from(i))),
            };
            riders.push(tokio::spawn(rider.run(window)));
        }
        let refunds = refunding_passes(plan, wiring, &stop, &counts);
        let other = OtherProduct::start(
            plan,
            wiring,
            http,
            Duration::from_millis(args.other_product_every_ms),
            &counts,
        );
        Ok(Some(Money {
            stop,
            riders,
            refunds,
            other,
            counts,
        }))
    }

    /// After traffic, while the completer and the api-servers still run: the riders finish their
    /// keys, the other product and the periodic passes stop, then refunding passes run until no
    /// refundable finding is open (bounded). The rider keys, for the money invariants, and the
    /// counts of the passes and the other product.
    pub(crate) async fn finish(
        self,
        plan: &Plan,
        wiring: &Wiring,
    ) -> anyhow::Result<(Vec<MoneyKey>, Arc<Counters>)> {
        let mut keys = Vec::new();
        for rider in self.riders {
            keys.extend(rider.await?);
        }
        self.other.stop().await;
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = self.refunds.await;
        let pool = schema::build_pool(
            &wiring.database_url,
            1,
            Duration::from_secs(5),
            schema::PlanCache::Auto,
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline && open_refundable(&pool).await != Some(0) {
            refunding_pass(plan, wiring, &self.counts).await;
        }
        for key in &keys {
            println!(
                "proof: money key {}: given up {}, refunded before the retry {}, answers {:?}",
                key.key, key.given_up, key.refunded_before_retry, key.answers
            );
        }
        println!(
            "proof: money: {} rider keys; open refundable findings left {:?}",
            keys.len(),
            open_refundable(&pool).await
        );
        Ok((keys, self.counts))
    }
}

/// The refunding reconciler every [`REFUND_PASS_EVERY`] until `stop`.
fn refunding_passes(
    plan: &Plan,
    wiring: &Wiring,
    stop: &Arc<AtomicBool>,
    counts: &Arc<Counters>,
) -> JoinHandle<()> {
    let (plan_bin, log) = (
        plan.bin_dir.join("workers"),
        plan.log_dir.join("reconciler-refund.log"),
    );
    let env = reconciler_env(wiring);
    let (stop, counts) = (Arc::clone(stop), Arc::clone(counts));
    tokio::spawn(async move {
        while sleep_unless_stopped(&stop, REFUND_PASS_EVERY).await {
            one_pass(&plan_bin, &env, &log, &counts).await;
        }
    })
}

async fn refunding_pass(plan: &Plan, wiring: &Wiring, counts: &Counters) {
    tokio::time::sleep(Duration::from_millis(1100)).await;
    one_pass(
        &plan.bin_dir.join("workers"),
        &reconciler_env(wiring),
        &plan.log_dir.join("reconciler-refund.log"),
        counts,
    )
    .await;
}

/// One `workers reconciler --once --refund`; its summary's numbers (and `look_alikes` by
/// reason) added to `counts` as `refund_passes.<field>`.
async fn one_pass(
    bin: &std::path::Path,
    env: &[(String, String)],
    log: &std::path::Path,
    counts: &Counters,
) {
    match run_once_with(bin, &["reconciler", "--once", "--refund"], env, log).await {
        Ok(summary) => {
            counts.add("refund_passes.passes", 1);
            for (name, value) in summary.as_object().into_iter().flatten() {
                match value {
                    Value::Number(n) => {
                        counts.add(format!("refund_passes.{name}"), n.as_u64().unwrap_or(0))
                    }
                    Value::Object(by) => {
                        for (reason, n) in by {
                            counts.add(
                                format!("refund_passes.{name}.{reason}"),
                                n.as_u64().unwrap_or(0),
                            );
                        }
                    }
                    _ => {}
                }
            }
        }
        Err(_) => counts.add("refund_passes.failed", 1),
    }
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// Open `unrecorded_charge` findings a refund would not refuse for being recorded since (a
/// rider's retry that recorded the charge first).
async fn open_refundable(pool: &schema::Pool) -> Option<i64> {
    let mut conn = pool.get().await.ok()?;
    diesel::sql_query(
        "SELECT count(*) AS n FROM reconciliation_findings f \
         WHERE f.resolved_at IS NULL AND f.kind = 'unrecorded_charge' \
         AND NOT EXISTS (SELECT 1 FROM rides r WHERE r.stripe_charge_id = f.payment_intent_id)",
    )
    .get_result::<Count>(&mut conn)
    .await
    .ok()
    .map(|count| count.n)
}
