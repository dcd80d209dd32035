//! Money safety (docs/money-safety.md) over real gRPC, PostgreSQL and fake-stripe over HTTP: the
//! deployment id in every new key's provider idempotency key and charge metadata, a key from
//! before deployment ids keeping exactly its old provider key, the charge search's ownership rule,
//! a key of another deployment never charged, and a refunded key replaying `PAYMENT_REFUNDED`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use api_server::grpc::reason;
use api_server::testing::*;
use diesel::{ExpressionMethods, QueryDsl};
use diesel_async::RunQueryDsl;
use fake_stripe::FaultMode;
use schema::{
    RecoveryPoint,
    schema::{idempotency_keys, users},
};
use serde_json::Value;
use tonic::Code;

async fn sql(app: &TestApp, statement: &str) {
    let mut conn = app.pool.get().await.unwrap();
    diesel::sql_query(statement)
        .execute(&mut conn)
        .await
        .unwrap();
}

async fn customer_of(app: &TestApp, user: &TestUser) -> String {
    let mut conn = app.pool.get().await.unwrap();
    users::table
        .find(user.id)
        .select(users::stripe_customer_id)
        .first(&mut conn)
        .await
        .unwrap()
}

/// `POST /v1/payment_intents` straight at fake-stripe, as another server (or product) with the
/// account's key could send it.
async fn post_charge(
    app: &TestApp,
    idempotency_key: Option<&str>,
    form: &[(&str, String)],
) -> Value {
    let mut request = reqwest::Client::new()
        .post(format!("{}/v1/payment_intents", app.stripe.base_url()))
        .bearer_auth("sk_test_harness")
        .form(form);
    if let Some(key) = idempotency_key {
        request = request.header("Idempotency-Key", key);
    }
    let response = request.send().await.unwrap();
    assert!(response.status().is_success());
    response.json().await.unwrap()
}

/// What a server from before deployment ids sent for the charge of `ride_id`, field for field.
fn legacy_charge_form(
    customer: &str,
    ride_id: i64,
    user_id: i64,
    key_id: i64,
) -> Vec<(&'static str, String)> {
    vec![
        ("amount", "2000".into()),
        ("currency", "usd".into()),
        ("customer", customer.into()),
        ("payment_method", GOOD_CARD.into()),
        ("confirm", "true".into()),
        ("off_session", "true".into()),
        ("description", format!("Rocket Rides ride {ride_id}")),
        ("metadata[ride_id]", ride_id.to_string()),
        ("metadata[user_id]", user_id.to_string()),
        ("metadata[idempotency_key_id]", key_id.to_string()),
    ]
}

#[tokio::test(flavor = "multi_thread")]
async fn a_new_key_carries_the_deployment_id_in_its_provider_key_and_metadata() {
    let app =
        TestApp::spawn_with(fake_stripe::Config::default(), &[("DEPLOYMENT_ID", "eu-1")]).await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    let ride = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap()
        .into_inner()
        .ride
        .unwrap();
    let row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(app.rides().await[0].deployment_id.as_deref(), Some("eu-1"));
    let intent = app.stripe.payment_intents().pop().unwrap();
    assert_eq!(intent.id, ride.charge_id);
    assert_eq!(intent.metadata["deployment_id"], "eu-1");
    assert_eq!(intent.metadata["idempotency_key_id"], row.id.to_string());

    // The provider key is `rocket-rides-eu-1-{key id}`: the same request under it is replayed,
    // not charged again.
    let mut form = legacy_charge_form(&customer_of(&app, &user).await, ride.id, user.id, row.id);
    form.push(("metadata[deployment_id]", "eu-1".into()));
    let replayed = post_charge(&app, Some(&format!("rocket-rides-eu-1-{}", row.id)), &form).await;
    assert_eq!(replayed["id"], ride.charge_id);
    assert_eq!(app.stripe.succeeded_charges(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_key_from_before_deployment_ids_keeps_its_old_provider_key_on_retry() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    // A first attempt that never reached the provider leaves the key at ride_created, unlocked.
    app.fail_at_the_provider(&user, &key).await;
    let row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(row.recovery_point, RecoveryPoint::RideCreated);
    // Made a ride of an older server (the migration leaves such rows without a deployment id),
    // whose charge that older server did make under the old provider key, and never heard of.
    sql(&app, "UPDATE rides SET deployment_id = NULL").await;
    let ride_id = app.rides().await[0].id;
    let customer = customer_of(&app, &user).await;
    let earlier = post_charge(
        &app,
        Some(&format!("rocket-rides-{}", row.id)),
        &legacy_charge_form(&customer, ride_id, user.id, row.id),
    )
    .await;
    assert_eq!(app.stripe.succeeded_charges(), 1);

    // The upgraded server's retry presents exactly the old key and parameters: the provider
    // replays the earlier charge (another key would charge again; other parameters would be
    // refused as an idempotency error).
    let ride = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap()
        .into_inner()
        .ride
        .unwrap();
    assert_eq!(ride.charge_id, earlier["id"].as_str().unwrap());
    assert_eq!(app.stripe.succeeded_charges(), 1, "charged once in total");
    let intent = app.stripe.payment_intents().pop().unwrap();
    assert!(!intent.metadata.contains_key("deployment_id"));
    let row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(row.recovery_point, RecoveryPoint::Finished);
    assert_eq!(
        app.rides().await[0].deployment_id,
        None,
        "a ride keeps what it was born with"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_key_of_another_deployment_is_never_charged() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    app.fail_at_the_provider(&user, &key).await;
    // As if the database were restored from another deployment's backup.
    sql(&app, "UPDATE rides SET deployment_id = 'prod'").await;
    let status = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap_err();
    assert_status(&status, Code::Internal, reason::INTERNAL);
    assert_eq!(app.stripe.create_calls(), 1, "only the first, failed, call");
    assert_eq!(app.stripe.succeeded_charges(), 0);
    let row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(row.recovery_point, RecoveryPoint::RideCreated);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_charge_search_records_only_a_charge_proven_ours() {
    let app = TestApp::spawn_with_a_short_provider_key_window().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    app.fail_at_the_provider(&user, &key).await;
    let row = app.key_row(&user, &key).await.unwrap();
    let ride_id = app.rides().await[0].id;
    let customer = customer_of(&app, &user).await;
    // Another product on the account, and another environment, charged with metadata naming
    // this ride: another customer; our customer and key id but another deployment's marker; our
    // key id with another amount.
    let mut theirs = legacy_charge_form("cus_someone_else", ride_id, user.id, row.id);
    theirs.push(("metadata[deployment_id]", "dev".into()));
    let mut other_env = legacy_charge_form(&customer, ride_id, user.id, row.id);
    other_env.push(("metadata[deployment_id]", "staging".into()));
    let mut other_amount = legacy_charge_form(&customer, ride_id, user.id, row.id);
    other_amount[0].1 = "4500".into();
    other_amount.push(("metadata[deployment_id]", "dev".into()));
    for form in [theirs, other_env, other_amount] {
        post_charge(&app, None, &form).await;
    }
    tokio::time::sleep(Duration::from_millis(1200)).await;

    let ride = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap()
        .into_inner()
        .ride
        .unwrap();
    assert_eq!(
        app.stripe.succeeded_charges(),
        4,
        "none of the look-alikes was taken for this ride's charge: it was charged"
    );
    let charged = app
        .stripe
        .payment_intents()
        .into_iter()
        .find(|intent| intent.id == ride.charge_id)
        .unwrap();
    assert_eq!(charged.customer.as_deref(), Some(customer.as_str()));
    assert_eq!(charged.metadata["deployment_id"], "dev");
    assert_eq!(charged.amount, 2000);

    // Past the window again, a retry of a key whose ours was never recorded finds it.
    let key = new_key();
    app.stripe.inject_faults(FaultMode::ChargeThenDrop, 1);
    app.create_ride(&user, &key, ride_request())
        .await
        .unwrap_err();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let ride = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap()
        .into_inner()
        .ride
        .unwrap();
    assert_eq!(app.stripe.succeeded_charges(), 5, "found, not repeated");
    assert_eq!(
        app.stripe.payment_intents().pop().unwrap().id,
        ride.charge_id
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_deployment_id_is_validated_at_start_up() {
    let base = |extra: &[(&str, &str)]| {
        let vars: std::collections::HashMap<String, String> = [
            ("DATABASE_URL", "postgres://postgres@127.0.0.1/x"),
            ("INTERNAL_API_TOKEN", INTERNAL_API_TOKEN),
        ]
        .iter()
        .chain(extra)
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
        api_server::config::Config::from_lookup(|name| vars.get(name).cloned())
    };
    assert_eq!(
        base(&[]).unwrap().stripe.deployment_id.as_str(),
        provider::DEVELOPMENT_DEPLOYMENT_ID
    );
    assert!(base(&[("DEPLOYMENT_ID", "Prod_1")]).is_err());
    assert!(base(&[("STRIPE_API_BASE", "https://api.stripe.com")]).is_err());
    assert!(base(&[("STRIPE_SECRET_KEY", "sk_live_abc")]).is_err());
    let prod = base(&[
        ("STRIPE_API_BASE", "https://api.stripe.com"),
        ("STRIPE_SECRET_KEY", "sk_live_abc"),
        ("DEPLOYMENT_ID", "prod"),
    ])
    .unwrap();
    assert_eq!(prod.stripe.deployment_id.as_str(), "prod");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_key_finished_as_refunded_replays_payment_refunded() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    app.stripe.inject_faults(FaultMode::ChargeThenDrop, 1);
    app.create_ride(&user, &key, ride_request())
        .await
        .unwrap_err();
    let row = app.key_row(&user, &key).await.unwrap();
    // What the reconciler's refund stores on the key (workers' tests drive the refund itself).
    let outcome = contract::Outcome::PaymentRefunded {
        ride_id: Some(app.rides().await[0].id),
        payment_intent: app.stripe.payment_intents()[0].id.clone(),
        refund_id: "re_test".into(),
        message: contract::PAYMENT_REFUNDED.into(),
    };
    let stored = outcome.to_stored();
    let mut conn = app.pool.get().await.unwrap();
    diesel::update(idempotency_keys::table.find(row.id))
        .set((
            idempotency_keys::recovery_point.eq(RecoveryPoint::Finished),
            idempotency_keys::response_code.eq(stored.code),
            idempotency_keys::response_body.eq(&stored.body),
        ))
        .execute(&mut conn)
        .await
        .unwrap();
    for _ in 0..2 {
        let status = app
            .create_ride(&user, &key, ride_request())
            .await
            .unwrap_err();
        assert_status(&status, Code::FailedPrecondition, reason::PAYMENT_REFUNDED);
        assert_eq!(status.message(), contract::PAYMENT_REFUNDED);
        assert_eq!(
            header(status.metadata(), api_server::grpc::REPLAYED_HEADER),
            "true"
        );
    }
    assert!(app.rides().await[0].stripe_charge_id.is_none());
    assert!(app.staged_jobs().await.is_empty(), "no receipt");
    assert_eq!(app.stripe.create_calls(), 1, "never charged again");
}

/// During a rolling upgrade (or after a roll-back) an api-server from before deployment ids
/// would resume a ride created under one with the old provider key, and the provider would charge
/// it again. The database refuses such a server the key's lock (a serialization failure, which it
/// retries as a conflict) and writes nothing; a server of this version takes it; a ride of an
/// older server (no deployment id) stays open to both. The key then finishes, charged once.
#[tokio::test(flavor = "multi_thread")]
async fn a_server_from_before_deployment_ids_is_refused_the_lock_of_a_newer_rides_key() {
    use diesel::result::{DatabaseErrorKind, Error};
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    app.fail_at_the_provider(&user, &key).await;
    let row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(row.recovery_point, RecoveryPoint::RideCreated);
    let deployment = app.rides().await[0].deployment_id.clone().unwrap();
    let take = "UPDATE idempotency_keys SET locked_at = now(), lock_token = gen_random_uuid() \
                WHERE id = $1";
    let release = "UPDATE idempotency_keys SET locked_at = NULL, lock_token = NULL WHERE id = $1";
    let run = async |conn: &mut diesel_async::AsyncPgConnection, statement: &str| {
        diesel::sql_query(statement)
            .bind::<diesel::sql_types::BigInt, _>(row.id)
            .execute(conn)
            .await
    };

    let mut older = app.db.connect_as_an_older_process().await;
    let refused = run(&mut older, take).await.unwrap_err();
    assert!(
        matches!(
            refused,
            Error::DatabaseError(DatabaseErrorKind::SerializationFailure, _)
        ),
        "{refused:?}"
    );
    assert_eq!(app.key_row(&user, &key).await.unwrap().locked_at, None);

    let mut current = app.db.connect().await;
    assert_eq!(run(&mut current, take).await.unwrap(), 1);
    assert_eq!(run(&mut current, release).await.unwrap(), 1);

    sql(&app, "UPDATE rides SET deployment_id = NULL").await;
    assert_eq!(run(&mut older, take).await.unwrap(), 1, "an older ride");
    assert_eq!(run(&mut older, release).await.unwrap(), 1);
    sql(
        &app,
        &format!("UPDATE rides SET deployment_id = '{deployment}'"),
    )
    .await;

    app.create_ride(&user, &key, ride_request()).await.unwrap();
    assert_eq!(app.stripe.succeeded_charges(), 1);
}
