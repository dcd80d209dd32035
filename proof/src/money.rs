//! The money campaign (issue 29, with `--money`): refunds only of our own charges, no ride
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

use diesel::{
    QueryableByName,
    sql_types::{BigInt, Bool, Text},
};
use diesel_async::RunQueryDsl;
use proto::v1::CreateRideRequest;
use rand::{Rng, SeedableRng, rngs::StdRng};
use rides_client::{Credential, RetryPolicy, RidesClient};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

use crate::{
    args::Args,
    clients::{Answer, Seen, Window, classify, grpc_endpoint},
    counters::Counters,
    faults::sleep_unless_stopped,
    maintenance::run_once_with,
    other_product::OtherProduct,
    reconciliation::reconciler_env,
    setup::{Plan, Wiring},
};

/// How often the refunding reconciler runs while traffic does.
const REFUND_PASS_EVERY: Duration = Duration::from_secs(3);
/// A rider starts a key only while this much traffic is left: about what one takes.
const KEY_TIME: Duration = Duration::from_secs(20);
/// How long after the traffic a rider may still wait for its last key's give-up or refund. The
/// completer's passes run one key after another under the campaign's faults: a pass stalled on a
/// provider timeout, or killed with its keys leased (`COMPLETER_LEASE_SECS`, 30 s), can hold a
/// rider's key back for half a minute (run 28e00bb2: no key given up within 10 s of the end).
const OVERRUN: Duration = Duration::from_secs(40);
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
    /// refundable finding is open (bounded). The rider keys, for the money invariants.
    pub(crate) async fn finish(
        self,
        plan: &Plan,
        wiring: &Wiring,
    ) -> anyhow::Result<Vec<MoneyKey>> {
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
        Ok(keys)
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

/// One money rider: its user, its client (one attempt per call: the rider decides when to
/// retry) and its provider customer, at which its faults are aimed.
struct Rider {
    n: u32,
    run_id: String,
    user_id: i64,
    customer: String,
    client: RidesClient,
    pool: schema::Pool,
    http: reqwest::Client,
    stripe_base: String,
    rng: StdRng,
}

#[derive(QueryableByName)]
struct KeyState {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = Bool)]
    gave_up: bool,
    #[diesel(sql_type = Bool)]
    refunded: bool,
}

impl Rider {
    /// Keys one after the other, each started while at least [`KEY_TIME`] of traffic is left;
    /// no wait lasts past [`OVERRUN`] after the traffic, so that the mode costs the run little.
    async fn run(mut self, window: Window) -> Vec<MoneyKey> {
        // Riders start apart, so that one api-server's crash does not cut all their calls at once.
        tokio::time::sleep(Duration::from_secs(3) * self.n).await;
        let mut keys = Vec::new();
        let mut i = 0_u32;
        let last_wait = window.end + OVERRUN;
        while Instant::now() + KEY_TIME < window.end {
            // At least 20 characters, as every idempotency key.
            let key = format!("proof-{}-money{}-{i:05}", self.run_id, self.n);
            keys.push(self.one_key(key, i.is_multiple_of(2), last_wait).await);
            i += 1;
        }
        keys
    }

    async fn one_key(
        &mut self,
        key: String,
        wait_for_refund: bool,
        last_wait: Instant,
    ) -> MoneyKey {
        let params = CreateRideRequest {
            origin_lat: Some(self.rng.random_range(-80.0..80.0)),
            origin_lon: Some(self.rng.random_range(-170.0..170.0)),
            target_lat: Some(self.rng.random_range(-80.0..80.0)),
            target_lon: Some(self.rng.random_range(-170.0..170.0)),
        };
        let mut record = MoneyKey {
            key: key.clone(),
            user_id: self.user_id,
            given_up: false,
            refunded_before_retry: false,
            forged_receipt: false,
            answers: Vec::new(),
        };
        self.aim("error_500", 100).await;
        record.answers.push(self.call(&key, params).await);
        // A call cut off before its claim committed (an api-server killed at a crash point, with
        // this call in flight) left no key for the completer to give up: the rider's app tries
        // again, as it would.
        for _ in 0..10 {
            if self.key_state(&key).await.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            record.answers.push(self.call(&key, params).await);
        }
        let given_up = self
            .wait_for(&key, Duration::from_secs(70), last_wait, |state| {
                state.gave_up
            })
            .await;
        record.given_up = given_up.is_some();
        if !record.given_up {
            record.answers.push(self.diagnosis(&key).await);
        }
        // The charge whose answer is lost. A call cut off before it reached the provider (its
        // api-server killed at a crash point) charged nothing and left the fault pending: the
        // rider's app tries again, until the provider holds one more of its charges.
        let charges_before = self.charges().await;
        self.aim("charge_then_drop", 1).await;
        for _ in 0..5 {
            let answer = self.call(&key, params).await;
            let finished = answer == "ok";
            record.answers.push(answer);
            if finished || charges_before.is_none() || self.charges().await != charges_before {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        self.aim("charge_then_drop", 0).await;
        if wait_for_refund {
            let refunded = self
                .wait_for(&key, Duration::from_secs(25), last_wait, |state| {
                    state.refunded
                })
                .await;
            if let Some(state) = refunded {
                record.refunded_before_retry = true;
                record.forged_receipt = self.forge_receipt(state.id).await;
            }
        }
        // The retry a rider makes; cut off by a crash (a transport failure, no reason), its app
        // tries again, so that what the key answers is seen.
        for _ in 0..5 {
            let answer = self.call(&key, params).await;
            let cut_off = answer.ends_with("/-");
            record.answers.push(answer);
            if !cut_off {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        record
    }

    /// How many PaymentIntents the provider holds for this rider's customer (`None` if it
    /// cannot say).
    async fn charges(&self) -> Option<usize> {
        let path = format!("/v1/payment_intents?customer={}&limit=100", self.customer);
        let body: Value = self
            .http
            .get(format!("{}{path}", self.stripe_base))
            .bearer_auth(crate::setup::STRIPE_KEY)
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        Some(body["data"].as_array()?.len())
    }

    /// Aims `count` provider faults of `mode` at this rider's charges (0 clears them).
    async fn aim(&self, mode: &str, count: u32) {
        let _ = self
            .http
            .post(format!("{}/_faults", self.stripe_base))
            .json(&json!({"mode": mode, "count": count, "customer": self.customer}))
            .send()
            .await;
    }

    async fn call(&self, key: &str, params: CreateRideRequest) -> String {
        let result = self
            .client
            .clone()
            .with_policy(RetryPolicy::single_attempt(Duration::from_secs(10)))
            .create_ride_with_key(key, params)
            .await;
        match classify(result) {
            Answer::Final(Seen::Ok { .. }) => "ok".to_owned(),
            Answer::Final(seen) => seen.detail(),
            Answer::Retry(label) => label,
        }
    }

    /// The key's state once `done` holds (polled), or `None` after `limit` (or at `last`).
    async fn wait_for(
        &self,
        key: &str,
        limit: Duration,
        last: Instant,
        done: impl Fn(&KeyState) -> bool,
    ) -> Option<KeyState> {
        let deadline = (Instant::now() + limit).min(last);
        while Instant::now() < deadline {
            if let Some(state) = self.key_state(key).await
                && done(&state)
            {
                return Some(state);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        None
    }

    async fn key_state(&self, key: &str) -> Option<KeyState> {
        let mut conn = self.pool.get().await.ok()?;
        diesel::sql_query(
            "SELECT k.id, k.completer_gave_up_at IS NOT NULL AS gave_up, \
             EXISTS (SELECT 1 FROM refund_audits a JOIN reconciliation_findings f \
                     ON f.id = a.finding_id WHERE f.idempotency_key_id = k.id) AS refunded \
             FROM idempotency_keys k WHERE k.user_id = $1 AND k.idempotency_key = $2",
        )
        .bind::<BigInt, _>(self.user_id)
        .bind::<Text, _>(key)
        .get_result(&mut conn)
        .await
        .ok()
    }

    /// Why a key was not given up in time: its completer state, for the run's output.
    async fn diagnosis(&self, key: &str) -> String {
        #[derive(QueryableByName)]
        struct State {
            #[diesel(sql_type = Text)]
            state: String,
        }
        let Ok(mut conn) = self.pool.get().await else {
            return "not given up (no connection to say why)".to_owned();
        };
        diesel::sql_query(
            "SELECT format('not given up: %s, %s completer attempts, next attempt %s, \
             locked %s, last run %s, now %s', recovery_point, completer_attempts, \
             coalesce(completer_next_attempt_at::text, '-'), coalesce(locked_at::text, '-'), \
             last_run_at, now()) AS state \
             FROM idempotency_keys WHERE user_id = $1 AND idempotency_key = $2",
        )
        .bind::<BigInt, _>(self.user_id)
        .bind::<Text, _>(key)
        .get_result::<State>(&mut conn)
        .await
        .map_or_else(|error| format!("not given up ({error})"), |row| row.state)
    }

    /// A receipt job for the refunded key's ride, naming the refunded charge, as a bug or a
    /// stray message could stage it: the receipt worker must dead-letter it, never mail it.
    async fn forge_receipt(&self, key_id: i64) -> bool {
        let Ok(mut conn) = self.pool.get().await else {
            return false;
        };
        diesel::sql_query(
            "INSERT INTO staged_jobs (job_name, job_args) \
             SELECT 'send_ride_receipt', jsonb_build_object('ride_id', r.id, 'user_id', r.user_id, \
                    'amount', r.amount, 'currency', r.currency, 'charge_id', a.payment_intent_id, \
                    'created_at', r.created_at) \
             FROM rides r JOIN reconciliation_findings f ON f.idempotency_key_id = r.idempotency_key_id \
             JOIN refund_audits a ON a.finding_id = f.id \
             WHERE r.idempotency_key_id = $1 AND r.stripe_charge_id IS NULL LIMIT 1",
        )
        .bind::<BigInt, _>(key_id)
        .execute(&mut conn)
        .await
        .is_ok_and(|rows| rows == 1)
    }
}
