//! The reconciler against the real api-server, PostgreSQL and fake-stripe over HTTP: a clean
//! ledger yields nothing, each mismatch kind is found and recorded once, pending charges wait for
//! their key, a second pass at the same time skips, a refund is made once however often it is
//! asked for and only of a charge proven ours, another product's look-alikes are counted and left
//! alone, and a refunded key is final.

mod passes;
mod refund_guards;
mod refunds;

use std::time::Duration;

use api_server::testing::{TestApp, TestUser, assert_status, new_key, ride_request};
use diesel::{QueryDsl, SelectableHelper};
use diesel_async::RunQueryDsl;
use fake_stripe::FaultMode;
use schema::{FindingKind, models::ReconciliationFinding, schema::reconciliation_findings};
use serde_json::Value;
use workers::{
    config::ReconcilerConfig,
    reconciler::{ReconcileSummary, Reconciler, refund::RefundRequester},
};

fn config(app: &TestApp) -> ReconcilerConfig {
    ReconcilerConfig {
        stripe: provider::StripeConfig {
            api_base: app.stripe.base_url(),
            secret_key: provider::Secret::new("sk_test_harness"),
            timeout: Duration::from_secs(5),
            idempotency_window: Duration::from_secs(86_400),
            deployment_id: app.config.stripe.deployment_id.clone(),
        },
        settle_delay: Duration::ZERO,
        overlap: Duration::from_secs(3600),
        initial_lookback: Duration::from_secs(3600),
        max_window: Duration::from_secs(86_400),
        slice: Duration::from_secs(60),
        interval: Duration::from_secs(1),
        refund_max_findings: 5,
        refund_max_amount: 10_000,
    }
}

fn operator() -> RefundRequester {
    RefundRequester::operator("alice").unwrap()
}

fn reconciler(app: &TestApp) -> Reconciler {
    Reconciler::new(app.pool.clone(), config(app)).unwrap()
}

/// A window ends at a whole second (the provider's `created` is in seconds): let the current one
/// end, so that what the test just wrote is inside the next window.
async fn pass(app: &TestApp, refund: bool) -> ReconcileSummary {
    tokio::time::sleep(Duration::from_millis(1100)).await;
    reconciler(app).run_once(refund).await.unwrap()
}

async fn findings_of(app: &TestApp) -> Vec<ReconciliationFinding> {
    let mut conn = app.pool.get().await.unwrap();
    reconciliation_findings::table
        .select(ReconciliationFinding::as_select())
        .order(reconciliation_findings::id)
        .load(&mut conn)
        .await
        .unwrap()
}

async fn sql(app: &TestApp, statement: &str) {
    let mut conn = app.pool.get().await.unwrap();
    diesel::sql_query(statement)
        .execute(&mut conn)
        .await
        .unwrap();
}

/// A ride charged and recorded through the real CreateRide; returns (ride id, charge id).
async fn charged_ride(app: &TestApp, user: &TestUser) -> (i64, String) {
    let ride = app
        .create_ride(user, &new_key(), ride_request())
        .await
        .unwrap()
        .into_inner()
        .ride
        .unwrap();
    (ride.id, ride.charge_id)
}

/// A PaymentIntent made straight at the provider, as any caller with the key could.
async fn charge_directly(app: &TestApp, extra: &[(&str, &str)]) -> Value {
    let mut form = vec![
        ("amount", "2000"),
        ("currency", "usd"),
        ("customer", "cus_direct"),
        ("payment_method", "pm_card_visa"),
        ("confirm", "true"),
    ];
    form.extend_from_slice(extra);
    let response = reqwest::Client::new()
        .post(format!("{}/v1/payment_intents", app.stripe.base_url()))
        .bearer_auth("sk_test_harness")
        .form(&form)
        .send()
        .await
        .unwrap();
    response.json().await.unwrap()
}

/// A charge of ours that no ride records: made for a fresh key whose response was lost
/// (`charge_then_drop`), on a key the completer then gave up. Returns (key, PaymentIntent id).
async fn unrecorded_charge(app: &TestApp, user: &TestUser) -> (String, String) {
    let key = new_key();
    app.stripe.inject_faults(FaultMode::ChargeThenDrop, 1);
    assert!(app.create_ride(user, &key, ride_request()).await.is_err());
    sql(
        app,
        "UPDATE idempotency_keys SET completer_gave_up_at = now() \
         WHERE recovery_point <> 'finished' AND completer_gave_up_at IS NULL",
    )
    .await;
    let pi = app.stripe.payment_intents().pop().unwrap().id;
    (key, pi)
}

/// The rider's retry of a refunded key: PAYMENT_REFUNDED, never the refunded charge.
async fn assert_retry_replays_payment_refunded(app: &TestApp, user: &TestUser, key: &str) {
    assert_retry_answers(
        app,
        user,
        key,
        tonic::Code::FailedPrecondition,
        api_server::grpc::reason::PAYMENT_REFUNDED,
    )
    .await;
}

/// The rider's retry of `key` fails with `code` and `reason`.
async fn assert_retry_answers(
    app: &TestApp,
    user: &TestUser,
    key: &str,
    code: tonic::Code,
    reason: &str,
) {
    let status = app
        .create_ride(user, key, ride_request())
        .await
        .unwrap_err();
    assert_status(&status, code, reason);
}

fn kinds(findings: &[ReconciliationFinding]) -> Vec<FindingKind> {
    findings.iter().map(|finding| finding.kind).collect()
}
