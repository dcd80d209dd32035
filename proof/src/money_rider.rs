//! One money rider of the money campaign ([`crate::money`]): per key, a charge made at the
//! provider but not recorded on a key the completer gave up, a refund waited for (or raced), a
//! forged receipt job after it, and the rider's retry; every answer recorded. Like a rider's app,
//! it repeats a call cut off by a crash (a transport failure) rather than take it for an answer.

use std::time::{Duration, Instant};

use diesel::{
    QueryableByName,
    sql_types::{BigInt, Bool, Text},
};
use diesel_async::RunQueryDsl;
use proto::v1::CreateRideRequest;
use rand::{Rng, rngs::StdRng};
use rides_client::{RetryPolicy, RidesClient};
use serde_json::{Value, json};

use crate::clients::{Answer, Seen, Window, classify};

use crate::money::MoneyKey;

/// A rider starts a key only while this much traffic is left: about what one takes.
const KEY_TIME: Duration = Duration::from_secs(20);
/// How long after the traffic a rider may still wait for its last key's give-up or refund. The
/// completer's passes run one key after another under the campaign's faults: a pass stalled on a
/// provider timeout, or killed with its keys leased (`COMPLETER_LEASE_SECS`, 30 s), can hold a
/// rider's key back for half a minute, so a shorter overrun ends before the last give-up.
const OVERRUN: Duration = Duration::from_secs(40);
/// How long a rider's last retry of a key goes on while its answers are not final: past a
/// stalled api-server's 10 s attempt and a restarted one's start.
const RETRY_TIME: Duration = Duration::from_secs(30);

/// One money rider: its user, its client (one attempt per call: the rider decides when to
/// retry) and its provider customer, at which its faults are aimed.
pub(crate) struct Rider {
    pub(crate) n: u32,
    pub(crate) run_id: String,
    pub(crate) user_id: i64,
    pub(crate) customer: String,
    pub(crate) client: RidesClient,
    pub(crate) pool: schema::Pool,
    pub(crate) http: reqwest::Client,
    pub(crate) stripe_base: String,
    pub(crate) rng: StdRng,
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
    pub(crate) async fn run(mut self, window: Window) -> Vec<MoneyKey> {
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
        // The retry a rider makes. An answer that is not final (a crash's cut-off, a provider
        // fault, a stalled server's timeout) makes its app try again, as the client's own policy
        // would, so that what the key answers is seen. One refunding pass refunds the riders'
        // keys together, so one such moment can meet every rider's retry at once.
        let deadline = Instant::now() + RETRY_TIME;
        loop {
            let (answer, final_answer) = self.attempt(&key, params).await;
            record.answers.push(answer);
            if final_answer || Instant::now() >= deadline {
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
        self.attempt(key, params).await.0
    }

    /// One attempt: what it answered, and whether that is the key's final answer (a ride, a
    /// decline, a refund, or an error no retry changes).
    async fn attempt(&self, key: &str, params: CreateRideRequest) -> (String, bool) {
        let result = self
            .client
            .clone()
            .with_policy(RetryPolicy::single_attempt(Duration::from_secs(10)))
            .create_ride_with_key(key, params)
            .await;
        match classify(result) {
            Answer::Final(Seen::Ok { .. }) => ("ok".to_owned(), true),
            Answer::Final(seen) => (seen.detail(), true),
            Answer::Retry(label) => (label, false),
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
