//! What a key answers: a new key's ride, charge and staged receipt, the replay of a finished key,
//! and a decline that is final and replayed without calling the provider again.

use api_server::{grpc::reason, testing::*};
use schema::RecoveryPoint;
use tonic::Code;
use tonic_types::StatusExt;

#[tokio::test(flavor = "multi_thread")]
async fn a_new_key_creates_charges_and_stages_a_receipt() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();

    let response = app.create_ride(&user, &key, ride_request()).await.unwrap();

    assert!(!replayed(&response));
    let key_row = app.key_row(&user, &key).await.unwrap();
    let ttl = chrono::Duration::hours(72);
    assert_eq!(
        expires_at(response.metadata()).timestamp_millis(),
        (key_row.created_at + ttl).timestamp_millis()
    );
    let body = response.into_inner();
    assert_eq!(
        body.message,
        "Payment accepted. Your pilot is on their way!"
    );
    let ride = body.ride.unwrap();
    assert_eq!(ride.origin_lat, 37.7749);
    assert_eq!(ride.target_lon, -121.8863);
    assert_eq!((ride.amount, ride.currency.as_str()), (2000, "usd"));
    assert!(ride.created_at.is_some());

    // The provider holds exactly one succeeded PaymentIntent, and it is the one on the ride.
    let intents = app.stripe.payment_intents();
    assert_eq!(intents.len(), 1);
    assert_eq!(intents[0].status, "succeeded");
    assert_eq!(intents[0].id, ride.charge_id);
    assert_eq!(intents[0].amount, 2000);
    assert_eq!(
        intents[0].metadata.get("ride_id"),
        Some(&ride.id.to_string())
    );

    assert_eq!(key_row.recovery_point, RecoveryPoint::Finished);
    assert_eq!(key_row.response_code, Some(0));
    assert!(key_row.locked_at.is_none() && key_row.lock_token.is_none());

    let rides = app.rides().await;
    assert_eq!(rides.len(), 1);
    assert_eq!(rides[0].id, ride.id);
    assert_eq!(
        rides[0].stripe_charge_id.as_deref(),
        Some(ride.charge_id.as_str())
    );
    assert_eq!(rides[0].idempotency_key_id, Some(key_row.id));

    let audits = app.audit_records().await;
    assert_eq!(audits.len(), 1);
    assert_eq!(audits[0].action, "ride.created");
    assert_eq!(audits[0].resource_id, ride.id);
    assert_eq!(audits[0].origin_ip.addr().to_string(), "127.0.0.1");

    let jobs = app.staged_jobs().await;
    assert_eq!(jobs.len(), 1);
    assert_eq!(jobs[0].job_name, "send_ride_receipt");
    assert_eq!(jobs[0].job_args["ride_id"], ride.id);
    assert_eq!(jobs[0].job_args["user_id"], user.id);
    assert_eq!(jobs[0].job_args["amount"], 2000);
    assert_eq!(jobs[0].job_args["currency"], "usd");
    assert_eq!(jobs[0].job_args["charge_id"], ride.charge_id.as_str());
    assert_eq!(
        jobs[0].job_args["created_at"].as_str().map(|at| at
            .parse::<chrono::DateTime<chrono::Utc>>()
            .unwrap()
            .timestamp()),
        Some(ride.created_at.unwrap().seconds)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_finished_key_replays_its_success_without_charging_again() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();

    let first = app.create_ride(&user, &key, ride_request()).await.unwrap();
    let second = app.create_ride(&user, &key, ride_request()).await.unwrap();

    assert!(!replayed(&first));
    assert!(replayed(&second));
    assert_eq!(expires_at(first.metadata()), expires_at(second.metadata()));
    assert_eq!(first.into_inner(), second.into_inner());
    assert_eq!(app.stripe.create_calls(), 1);
    assert_eq!(app.rides().await.len(), 1);
    assert_eq!(app.staged_jobs().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_decline_is_final_and_replayed_identically_without_calling_the_provider() {
    let app = TestApp::spawn().await;
    let user = app.create_user(DECLINED_CARD).await;
    let key = new_key();

    let first = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap_err();
    let second = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap_err();

    assert_status(&first, Code::FailedPrecondition, reason::CARD_DECLINED);
    assert_eq!(first.message(), "Your card was declined.");
    assert_eq!(header(first.metadata(), "idempotent-replayed"), "false");
    assert_eq!(header(second.metadata(), "idempotent-replayed"), "true");
    assert_eq!(
        (second.code(), second.message(), second.details()),
        (first.code(), first.message(), first.details()),
        "a replay must be the same answer, byte for byte"
    );
    let info = first.get_error_details().error_info().cloned().unwrap();
    assert_eq!(
        info.metadata.get("decline_code").map(String::as_str),
        Some("generic_decline")
    );

    assert_eq!(
        app.stripe.create_calls(),
        1,
        "a declined card is never retried"
    );
    assert_eq!(app.stripe.succeeded_charges(), 0);
    let key_row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(key_row.recovery_point, RecoveryPoint::Finished);
    assert_eq!(key_row.response_code, Some(Code::FailedPrecondition as i32));
    // The ride was created before the charge was attempted; it stays, uncharged.
    let rides = app.rides().await;
    assert_eq!(rides.len(), 1);
    assert!(rides[0].stripe_charge_id.is_none());
    assert!(
        app.staged_jobs().await.is_empty(),
        "no receipt for a declined card"
    );
}
