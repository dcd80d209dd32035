//! A second product on the same provider account, as in production: while traffic runs it makes
//! succeeded PaymentIntents at fake-stripe whose metadata looks like ours, each built from one of
//! our rides as it is in the database by then. The reconciler (refunding, during the traffic, and
//! once at the end) must count them and leave them alone, and the charge search must never
//! record one; the money invariants ([`crate::money`]) check that none was refunded, recorded or
//! receipted.
//!
//! Each carries `metadata[proof_product]` = [`TAG`] so that the campaign (and only the campaign:
//! the service never reads that key) tells them from ours; the provider faults of the campaign
//! hit these calls too, so an id may never be known, but the tag is in the ledger.

use std::{
    sync::{Arc, atomic::AtomicBool},
    time::Duration,
};

use diesel::{
    QueryableByName,
    sql_types::{BigInt, Text},
};
use diesel_async::RunQueryDsl;
use rand::{Rng, SeedableRng, rngs::StdRng};
use tokio::task::JoinHandle;

use crate::{
    counters::Counters,
    faults::sleep_unless_stopped,
    setup::{Plan, STRIPE_KEY, Wiring},
};

/// `metadata[proof_product]` of the other product's PaymentIntents.
pub(crate) const TAG: &str = "other";

/// How each look-alike differs from a charge of ours (`metadata[proof_variant]`).
pub(crate) const VARIANTS: [&str; 6] = [
    // Only a `user_id` of one of our riders: the key everyone uses.
    "user_id_only",
    // `ride_id` of one of our rides, another customer and amount.
    "ride_id_other_customer",
    // `idempotency_key_id` of one of our keys, nothing else.
    "key_id_only",
    // Our metadata, customer and amount to the letter, from another deployment.
    "other_deployment",
    // Our metadata and this deployment's marker, another customer (a forged or mistaken marker:
    // an `unknown_ride` finding for a person, never refunded).
    "our_marker_other_customer",
    // Our metadata without any marker, customer and amount to the letter (as a charge from
    // before deployment ids would look, for a ride that has one).
    "unmarked_copy",
];

/// One of our rides, as a look-alike copies it.
#[derive(QueryableByName)]
struct RideFacts {
    #[diesel(sql_type = BigInt)]
    ride_id: i64,
    #[diesel(sql_type = BigInt)]
    user_id: i64,
    #[diesel(sql_type = BigInt)]
    key_id: i64,
    #[diesel(sql_type = BigInt)]
    amount: i64,
    #[diesel(sql_type = Text)]
    currency: String,
    #[diesel(sql_type = Text)]
    customer: String,
}

/// The look-alike of `variant` for `ride`: the form of its `POST /v1/payment_intents`.
fn form(variant: &str, ride: &RideFacts, deployment_id: &str, n: u64) -> Vec<(String, String)> {
    let other_customer = format!("cus_other_product_{n}");
    let (ride_id, user_id, key_id) = (
        ride.ride_id.to_string(),
        ride.user_id.to_string(),
        ride.key_id.to_string(),
    );
    let ours = [
        ("ride_id", ride_id.as_str()),
        ("user_id", user_id.as_str()),
        ("idempotency_key_id", key_id.as_str()),
    ];
    let (customer, amount, metadata): (&str, i64, Vec<(&str, &str)>) = match variant {
        "user_id_only" => (
            other_customer.as_str(),
            1500,
            vec![("user_id", user_id.as_str())],
        ),
        "ride_id_other_customer" => (
            other_customer.as_str(),
            ride.amount + 100,
            vec![("ride_id", ride_id.as_str())],
        ),
        "key_id_only" => (
            other_customer.as_str(),
            ride.amount,
            vec![("idempotency_key_id", key_id.as_str())],
        ),
        "other_deployment" => (
            ride.customer.as_str(),
            ride.amount,
            [&ours[..], &[("deployment_id", "proof-other-env")]].concat(),
        ),
        "our_marker_other_customer" => (
            other_customer.as_str(),
            ride.amount,
            [&ours[..], &[("deployment_id", deployment_id)]].concat(),
        ),
        _ => (ride.customer.as_str(), ride.amount, ours.to_vec()),
    };
    let mut form: Vec<(String, String)> = [
        ("amount", amount.to_string()),
        ("currency", ride.currency.clone()),
        ("customer", customer.to_owned()),
        ("payment_method", "pm_card_visa".to_owned()),
        ("confirm", "true".to_owned()),
        ("metadata[proof_product]", TAG.to_owned()),
        ("metadata[proof_variant]", variant.to_owned()),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value))
    .collect();
    form.extend(
        metadata
            .into_iter()
            .map(|(name, value)| (format!("metadata[{name}]"), value.to_owned())),
    );
    form
}

/// The other product's task, until [`OtherProduct::stop`].
pub(crate) struct OtherProduct {
    stop: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl OtherProduct {
    /// Every `every` on average, one look-alike of a random ride of ours (variants in turn);
    /// counted in `counts` as `created/<variant>` or `failed/<variant>`.
    pub(crate) fn start(
        plan: &Plan,
        wiring: &Wiring,
        http: &reqwest::Client,
        every: Duration,
        counts: &Arc<Counters>,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let mut rng = StdRng::seed_from_u64(plan.seed.wrapping_add(29));
        let pool = schema::build_pool(
            &wiring.database_url,
            1,
            Duration::from_secs(5),
            schema::PlanCache::Auto,
        );
        let url = format!("{}/v1/payment_intents", wiring.stripe_base);
        let deployment_id = deployment_id(wiring);
        let (http, counts, stop_task) = (http.clone(), Arc::clone(counts), Arc::clone(&stop));
        let task = tokio::spawn(async move {
            let mut n = 0_u64;
            while sleep_unless_stopped(&stop_task, every.mul_f64(rng.random_range(0.5..1.5))).await
            {
                let Some(ride) = random_ride(&pool).await else {
                    continue;
                };
                let variant = VARIANTS[(n % VARIANTS.len() as u64) as usize];
                n += 1;
                let sent = http
                    .post(&url)
                    .bearer_auth(STRIPE_KEY)
                    .form(&form(variant, &ride, &deployment_id, n))
                    .send()
                    .await;
                let made = sent.is_ok_and(|response| response.status().is_success());
                let outcome = if made { "created" } else { "failed" };
                counts.add(format!("{outcome}/{variant}"), 1);
            }
        });
        OtherProduct { stop, task }
    }

    pub(crate) async fn stop(self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = self.task.await;
    }
}

/// The deployment id the campaign's processes run under (`dev` unless the environment names
/// one).
pub(crate) fn deployment_id(wiring: &Wiring) -> String {
    wiring
        .env
        .iter()
        .find(|(name, _)| name == "DEPLOYMENT_ID")
        .map_or_else(|| "dev".to_owned(), |(_, value)| value.clone())
}

/// A random ride of ours with a key, whatever its state; `None` before the first or while the
/// database is down.
async fn random_ride(pool: &schema::Pool) -> Option<RideFacts> {
    let mut conn = pool.get().await.ok()?;
    diesel::sql_query(
        "SELECT * FROM (SELECT r.id AS ride_id, r.user_id, r.idempotency_key_id AS key_id, \
         r.amount, r.currency, u.stripe_customer_id AS customer \
         FROM rides r JOIN users u ON u.id = r.user_id \
         WHERE r.idempotency_key_id IS NOT NULL ORDER BY r.id DESC LIMIT 200) recent \
         ORDER BY random() LIMIT 1",
    )
    .get_result(&mut conn)
    .await
    .ok()
}
