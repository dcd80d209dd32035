//! `workers admin keys finish`: a declined finish replays as CARD_DECLINED, a succeeded finish
//! records only a charge proven the ride's and stages one receipt, and the ride, the charge and
//! the lock are checked first.

use api_server::{
    grpc::REPLAYED_HEADER,
    testing::{GOOD_CARD, TestApp, TestUser, assert_status, header, replayed, ride_request},
};
use contract::{BackgroundJob, Outcome, PAYMENT_ACCEPTED, ReceiptJob, RideView};
use diesel::QueryDsl;
use diesel_async::RunQueryDsl;
use schema::RecoveryPoint;
use tonic::Code;
use workers::admin::{AdminError, FinishOutcome, Mode};

use super::{
    abandoned_at, assert_refused, attention_rows, finish, finish_request, key_at, record_attention,
    show,
};

/// A PaymentIntent made straight at the provider for `key_id`'s ride, with the metadata, customer
/// and amount the api-server would give it; `changes` replace any of those (a look-alike).
async fn charge_for(
    app: &TestApp,
    user: &TestUser,
    key_id: i64,
    changes: &[(&str, &str)],
) -> String {
    let ride = app
        .rides()
        .await
        .into_iter()
        .find(|ride| ride.idempotency_key_id == Some(key_id))
        .unwrap();
    let mut conn = app.pool.get().await.unwrap();
    let customer: String = schema::schema::users::table
        .find(user.id)
        .select(schema::schema::users::stripe_customer_id)
        .first(&mut conn)
        .await
        .unwrap();
    let mut form: std::collections::BTreeMap<String, String> = [
        ("amount", ride.amount.to_string()),
        ("currency", ride.currency.clone()),
        ("customer", customer),
        ("payment_method", "pm_card_visa".to_owned()),
        ("confirm", "true".to_owned()),
        ("metadata[ride_id]", ride.id.to_string()),
        ("metadata[user_id]", user.id.to_string()),
        ("metadata[idempotency_key_id]", key_id.to_string()),
        (
            "metadata[deployment_id]",
            app.config.stripe.deployment_id.as_str().to_owned(),
        ),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value))
    .collect();
    for (name, value) in changes {
        form.insert((*name).to_owned(), (*value).to_owned());
    }
    let pi: serde_json::Value = reqwest::Client::new()
        .post(format!("{}/v1/payment_intents", app.stripe.base_url()))
        .bearer_auth("sk_test_harness")
        .form(&form)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    pi["id"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn finish_declined_is_replayed_as_card_declined() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (key, key_id) = abandoned_at(&app, &user, RecoveryPoint::RideCreated).await;
    let attention_id = record_attention(&app, &user, &key, key_id).await;
    let request = finish_request(key_id, FinishOutcome::Declined);

    let dry = finish(&app, &request, Mode::DryRun).await.unwrap();
    assert!(
        dry.changes
            .iter()
            .any(|c| c.table == "keys_needing_attention" && c.row == Some(attention_id))
    );
    let row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(row.recovery_point, RecoveryPoint::RideCreated, "dry run");
    assert!(row.locked_at.is_some());
    assert!(attention_rows(&app).await[0].resolved_at.is_none());

    let applied = finish(&app, &request, Mode::Apply).await.unwrap();
    assert_eq!(applied.mode, Mode::Apply);
    let row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(row.recovery_point, RecoveryPoint::Finished);
    assert_eq!((row.locked_at, row.lock_token), (None, None));
    let expected = Outcome::CardDeclined {
        message: "Your card was declined.".into(),
        decline_code: None,
    }
    .to_stored();
    assert_eq!(row.response_code, Some(expected.code));
    assert_eq!(row.response_body, Some(expected.body.to_value()));
    assert!(attention_rows(&app).await[0].resolved_at.is_some());
    assert!(
        app.staged_jobs().await.is_empty(),
        "no receipt for a decline"
    );

    // The client's replay: the stored decline, marked as replayed, and no charge attempted.
    let calls = app.stripe.create_calls();
    let status = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap_err();
    assert_status(&status, Code::FailedPrecondition, "CARD_DECLINED");
    assert_eq!(status.message(), "Your card was declined.");
    assert_eq!(header(status.metadata(), REPLAYED_HEADER), "true");
    assert_eq!(app.stripe.create_calls(), calls);
}

#[tokio::test(flavor = "multi_thread")]
async fn finish_succeeded_with_a_found_charge_replays_ok_and_stages_one_receipt() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (key, key_id) = abandoned_at(&app, &user, RecoveryPoint::RideCreated).await;
    let found = charge_for(&app, &user, key_id, &[]).await;
    let charge_id = found.as_str();
    let calls = app.stripe.create_calls();

    // The ride has no charge recorded: the operator must say which PaymentIntent paid for it.
    assert_refused(
        finish(
            &app,
            &finish_request(key_id, FinishOutcome::Succeeded),
            Mode::DryRun,
        )
        .await,
        &format!("rocket-rides-dev-{key_id}"),
    );
    let mut request = finish_request(key_id, FinishOutcome::Succeeded);
    request.charge_id = Some(charge_id.to_owned());

    let dry = finish(&app, &request, Mode::DryRun).await.unwrap();
    let tables: Vec<_> = dry.changes.iter().map(|c| (c.action, c.table)).collect();
    assert!(tables.contains(&("update", "rides")));
    assert!(tables.contains(&("insert", "staged_jobs")));
    assert!(app.staged_jobs().await.is_empty(), "dry run");
    assert_eq!(app.rides().await[0].stripe_charge_id, None, "dry run");

    finish(&app, &request, Mode::Apply).await.unwrap();
    let ride = app.rides().await.remove(0);
    assert_eq!(ride.stripe_charge_id.as_deref(), Some(charge_id));
    let jobs = app.staged_jobs().await;
    assert_eq!(jobs.len(), 1, "exactly one receipt job");
    assert_eq!(jobs[0].job_name, ReceiptJob::JOB_NAME);
    assert_eq!(
        jobs[0].job_args,
        serde_json::json!({
            "ride_id": ride.id, "user_id": ride.user_id, "amount": ride.amount,
            "currency": ride.currency, "charge_id": charge_id, "created_at": ride.created_at,
        })
    );
    // Staged by `BackgroundJob::staged`, as the api-server stages it: the admin command's trace
    // context (empty when it runs outside any trace), never a hand-written value.
    assert!(
        jobs[0].trace_context.is_object(),
        "{}",
        jobs[0].trace_context
    );
    let row = app.key_row(&user, &key).await.unwrap();
    let expected = Outcome::RideCreated {
        ride: RideView::from(ride.clone()),
        message: PAYMENT_ACCEPTED.to_owned(),
    }
    .to_stored();
    assert_eq!(row.recovery_point, RecoveryPoint::Finished);
    assert_eq!(row.response_code, Some(expected.code));
    assert_eq!(row.response_body, Some(expected.body.to_value()));

    // The client's replay returns the ride with the operator's charge; nothing is charged.
    let response = app.create_ride(&user, &key, ride_request()).await.unwrap();
    assert!(replayed(&response));
    let replayed_ride = response.into_inner().ride.unwrap();
    assert_eq!(replayed_ride.id, ride.id);
    assert_eq!(replayed_ride.charge_id, charge_id);
    assert_eq!(app.stripe.create_calls(), calls);

    // Finishing it again is refused and stages nothing more.
    assert_refused(
        finish(&app, &request, Mode::Apply).await,
        "already finished",
    );
    assert_eq!(app.staged_jobs().await.len(), 1);
}

/// `key finish --charge-id` records a PaymentIntent only if the ownership rule proves it the
/// ride's charge, it succeeded and nothing of it was refunded; anything else writes nothing.
#[tokio::test(flavor = "multi_thread")]
async fn finish_succeeded_records_only_a_charge_proven_the_rides() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (_, key_id) = abandoned_at(&app, &user, RecoveryPoint::RideCreated).await;
    let other_user = app.create_user(GOOD_CARD).await;
    let (_, other_key) = abandoned_at(&app, &other_user, RecoveryPoint::RideCreated).await;
    let ride_id = app
        .rides()
        .await
        .into_iter()
        .find(|r| r.idempotency_key_id == Some(key_id))
        .unwrap()
        .id;
    let cases =
        charges_not_proven_the_rides(&app, (&user, key_id), (&other_user, other_key), ride_id)
            .await;
    for (charge_id, why) in &cases {
        for mode in [Mode::DryRun, Mode::Apply] {
            let mut request = finish_request(key_id, FinishOutcome::Succeeded);
            request.charge_id = Some(charge_id.clone());
            assert_refused(finish(&app, &request, mode).await, why);
        }
    }
    let charge_of_the_ride = async || {
        let rides = app.rides().await;
        rides
            .into_iter()
            .find(|r| r.id == ride_id)
            .unwrap()
            .stripe_charge_id
    };
    assert_eq!(charge_of_the_ride().await, None, "nothing written");
    assert!(app.staged_jobs().await.is_empty(), "no receipt");
    let row = show(&app, key_id).await.key.unwrap();
    assert_eq!(row.recovery_point, RecoveryPoint::RideCreated);

    // The ride's own charge is recorded.
    let ours = charge_for(&app, &user, key_id, &[]).await;
    let mut request = finish_request(key_id, FinishOutcome::Succeeded);
    request.charge_id = Some(ours.clone());
    finish(&app, &request, Mode::Apply).await.unwrap();
    assert_eq!(charge_of_the_ride().await, Some(ours));
}

/// Charges `finish --outcome succeeded` must refuse to record for the user's key, each with the
/// reason it must give: another customer, deployment, amount or ride, the other user's charge,
/// one not succeeded, one refunded, and one that does not exist.
async fn charges_not_proven_the_rides(
    app: &TestApp,
    (user, key_id): (&TestUser, i64),
    (other_user, other_key): (&TestUser, i64),
    ride_id: i64,
) -> [(String, &'static str); 8] {
    let refunded = charge_for(app, user, key_id, &[]).await;
    let refund = reqwest::Client::new()
        .post(format!("{}/v1/refunds", app.stripe.base_url()))
        .bearer_auth("sk_test_harness")
        .form(&[("payment_intent", refunded.as_str())])
        .send()
        .await
        .unwrap();
    assert!(refund.status().is_success());
    let other_ride = (ride_id + 1).to_string();
    [
        (
            charge_for(app, user, key_id, &[("customer", "cus_another_product")]).await,
            "customer_mismatch",
        ),
        (
            charge_for(app, user, key_id, &[("metadata[deployment_id]", "staging")]).await,
            "marker_mismatch",
        ),
        (
            charge_for(app, user, key_id, &[("amount", "1")]).await,
            "amount_mismatch",
        ),
        (
            charge_for(
                app,
                user,
                key_id,
                &[("metadata[ride_id]", other_ride.as_str())],
            )
            .await,
            "ride_mismatch",
        ),
        // The other rider's charge, named for this key.
        (
            charge_for(app, other_user, other_key, &[]).await,
            "not provably",
        ),
        (
            charge_for(app, user, key_id, &[("confirm", "false")]).await,
            "has not succeeded",
        ),
        (refunded, "was refunded"),
        ("pi_NeverMadeAnywhere0001".to_owned(), "does not exist"),
    ]
}

#[tokio::test(flavor = "multi_thread")]
async fn finish_checks_the_ride_the_charge_and_the_lock() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;

    // No ride yet: nothing can have been paid for.
    let (_, started) = abandoned_at(&app, &user, RecoveryPoint::Started).await;
    let mut request = finish_request(started, FinishOutcome::Succeeded);
    request.charge_id = Some("pi_Anything0001".into());
    assert_refused(finish(&app, &request, Mode::Apply).await, "has no ride");

    // A recorded charge cannot be declined, nor replaced; it is used as it is.
    let (charged_key, charged) = key_at(&app, &user, RecoveryPoint::ChargeCreated).await;
    let mut decline = finish_request(charged.key_id, FinishOutcome::Declined);
    decline.force = true;
    assert_refused(
        finish(&app, &decline, Mode::Apply).await,
        "cannot be finished as declined",
    );
    let recorded = app.rides().await[0].stripe_charge_id.clone().unwrap();
    let mut replace = finish_request(charged.key_id, FinishOutcome::Succeeded);
    replace.charge_id = Some("pi_SomethingElse0001".into());
    replace.force = true;
    assert_refused(
        finish(&app, &replace, Mode::Apply).await,
        "refusing to replace",
    );
    // Its lock is live: refused without --force, finished with it.
    let plain = finish_request(charged.key_id, FinishOutcome::Succeeded);
    assert_refused(
        finish(&app, &plain, Mode::Apply).await,
        "may still be running",
    );
    let mut forced = plain.clone();
    forced.force = true;
    let report = finish(&app, &forced, Mode::Apply).await.unwrap();
    assert_eq!(report.warnings.len(), 1);
    let row = app.key_row(&user, &charged_key).await.unwrap();
    assert_eq!(row.recovery_point, RecoveryPoint::Finished);
    assert_eq!(app.staged_jobs().await.len(), 1);
    assert_eq!(
        app.rides().await[0].stripe_charge_id,
        Some(recorded.clone())
    );

    // A charge already recorded on another ride is refused.
    let (_, other) = abandoned_at(&app, &user, RecoveryPoint::RideCreated).await;
    let mut duplicate = finish_request(other, FinishOutcome::Succeeded);
    duplicate.charge_id = Some(recorded);
    assert_refused(
        finish(&app, &duplicate, Mode::Apply).await,
        "already recorded on ride",
    );
    // Malformed arguments never reach the database.
    let mut malformed = finish_request(other, FinishOutcome::Succeeded);
    malformed.charge_id = Some("ch_legacy".into());
    assert!(matches!(
        finish(&app, &malformed, Mode::Apply).await,
        Err(AdminError::Invalid(_))
    ));
}
