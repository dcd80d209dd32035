//! `workers admin …` against real PostgreSQL (TestApp: the api-server over gRPC, fake-stripe)
//! and real RabbitMQ (a private topology per test). The library functions the CLI dispatches to
//! are called directly; one test runs the compiled binary end to end.

use std::{process::Output, time::Duration};

use api_server::{
    grpc::REPLAYED_HEADER,
    idempotency::Lease,
    rides::{CreateRideError, RideParams},
    testing::{
        DECLINED_CARD, GOOD_CARD, TestApp, TestUser, assert_status, header, new_key, replayed,
        ride_request,
    },
};
use contract::{BackgroundJob, Outcome, PAYMENT_ACCEPTED, ReceiptJob, RideView};
use diesel::{QueryDsl, SelectableHelper};
use diesel_async::RunQueryDsl;
use schema::{
    RecoveryPoint,
    models::{KeyNeedingAttention, NewKeyNeedingAttention, NewStagedJob},
    schema::{keys_needing_attention, staged_jobs},
};
use tonic::Code;
use workers::{
    admin::{
        AdminError, AdminSettings, FinishOutcome, Mode, attention, backlog, dead_letters,
        keys::{self, FinishRequest, KeySelector},
    },
    topology::Topology,
};

use crate::common::{self, TestBroker};

fn settings(topology: Topology) -> AdminSettings {
    AdminSettings {
        lock_rule: contract::key::LockRule::new(
            Duration::from_secs(90),
            Duration::from_secs(86_400),
        ),
        key_ttl: Duration::from_secs(72 * 3600),
        topology,
    }
}

fn db_settings() -> AdminSettings {
    settings(Topology::from_prefix("admin-tests-no-broker", 5))
}

/// The parameters of `ride_request()`, so that a gRPC retry with it replays the key.
fn params() -> RideParams {
    RideParams::new(
        Some(37.7749),
        Some(-122.4194),
        Some(37.3382),
        Some(-121.8863),
    )
    .unwrap()
}

/// A key whose attempt stopped at `point`, still holding its (live) lock: at `ride_created` as
/// this server's attempts stop, at `started` or `charge_created` as only an older server left keys
/// (`TestApp::leave_as_an_older_server`).
async fn key_at(app: &TestApp, user: &TestUser, point: RecoveryPoint) -> (String, Lease) {
    let key = new_key();
    let mut lease = app.claim(user, &key, &params()).await;
    if point != RecoveryPoint::RideCreated {
        let request = app.rides_request(user, params()).await;
        app.leave_as_an_older_server(&mut lease, &request, point)
            .await;
    }
    (key, lease)
}

/// A key abandoned at `point`: its attempt died long ago, the lock has expired.
async fn abandoned_at(app: &TestApp, user: &TestUser, point: RecoveryPoint) -> (String, i64) {
    let (key, lease) = key_at(app, user, point).await;
    app.expire_lock(lease.key_id).await;
    (key, lease.key_id)
}

async fn record_attention(app: &TestApp, user: &TestUser, key: &str, key_id: i64) -> i64 {
    let mut conn = app.pool.get().await.unwrap();
    let request_params = params().signature().params;
    diesel::insert_into(keys_needing_attention::table)
        .values(NewKeyNeedingAttention {
            reason: "completer_gave_up",
            idempotency_key_id: key_id,
            user_id: user.id,
            idempotency_key: key,
            recovery_point: RecoveryPoint::RideCreated,
            request_params: &request_params,
            last_error: Some("UNAVAILABLE: payment provider unavailable"),
        })
        .returning(keys_needing_attention::id)
        .get_result(&mut conn)
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

async fn attention_rows(app: &TestApp) -> Vec<KeyNeedingAttention> {
    let mut conn = app.pool.get().await.unwrap();
    keys_needing_attention::table
        .order(keys_needing_attention::id)
        .select(KeyNeedingAttention::as_select())
        .load(&mut conn)
        .await
        .unwrap()
}

async fn show(app: &TestApp, key_id: i64) -> keys::KeyReport {
    keys::show(&app.pool, &db_settings(), &KeySelector::Id(key_id))
        .await
        .unwrap()
}

/// The provider's client `key finish` checks a `--charge-id` with.
fn stripe(app: &TestApp) -> provider::StripeClient {
    provider::StripeClient::new(&provider::StripeConfig {
        api_base: app.stripe.base_url(),
        secret_key: provider::Secret::new("sk_test_harness"),
        timeout: Duration::from_secs(5),
        idempotency_window: Duration::from_secs(86_400),
        deployment_id: app.config.stripe.deployment_id.clone(),
    })
    .unwrap()
}

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

async fn finish(
    app: &TestApp,
    request: &FinishRequest,
    mode: Mode,
) -> Result<workers::admin::ChangeReport, AdminError> {
    keys::finish(&app.pool, &db_settings(), &stripe(app), request, mode).await
}

fn finish_request(key_id: i64, outcome: FinishOutcome) -> FinishRequest {
    FinishRequest {
        key_id,
        outcome,
        charge_id: None,
        message: None,
        force: false,
    }
}

fn assert_refused<T: std::fmt::Debug>(result: Result<T, AdminError>, needle: &str) {
    match result {
        Err(AdminError::Refused(message)) => {
            assert!(message.contains(needle), "{needle:?} not in {message:?}")
        }
        other => panic!("expected a refusal mentioning {needle:?}, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn show_reports_a_key_at_every_state() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;

    // started, locked by a live attempt.
    let (started_key, started) = key_at(&app, &user, RecoveryPoint::Started).await;
    let report = show(&app, started.key_id).await;
    let key = report.key.as_ref().unwrap();
    assert_eq!(key.recovery_point, RecoveryPoint::Started);
    assert_eq!(key.idempotency_key, started_key);
    assert_eq!(key.user_id, user.id);
    assert_eq!(
        key.expires_at.unwrap(),
        key.created_at + chrono::Duration::hours(72)
    );
    assert_eq!((key.lock.state, key.lock.live), ("held", true));
    assert_eq!(
        key.lock.holder, "alive",
        "the claiming server's session stands"
    );
    assert!(key.stored_outcome.is_none());
    assert_eq!(
        key.provider_idempotency_key, None,
        "no ride, so no charge yet"
    );
    assert!(report.ride.is_none());
    // Neither the lock token nor the rider's address is ever printed, in either form.
    let json = serde_json::to_string(&report).unwrap();
    let text = report.render();
    for printed in [&json, &text] {
        assert!(!printed.contains(&started.token.to_string()), "{printed}");
        assert!(printed.contains("r***@example.com"), "{printed}");
        assert!(
            !printed.contains("rider-"),
            "the address is redacted: {printed}"
        );
    }
    assert!(text.contains("LIVE"), "{text}");
    assert!(text.contains("holder alive"), "{text}");
    // The same key by user and key string.
    let by_string = keys::show(
        &app.pool,
        &db_settings(),
        &KeySelector::UserKey {
            user_id: user.id,
            key: started_key.clone(),
        },
    )
    .await
    .unwrap();
    assert_eq!(by_string.key.unwrap().id, started.key_id);

    // ride_created, abandoned (expired lock), handed to a human.
    let (abandoned_key, abandoned) = abandoned_at(&app, &user, RecoveryPoint::RideCreated).await;
    let attention_id = record_attention(&app, &user, &abandoned_key, abandoned).await;
    let report = show(&app, abandoned).await;
    let key = report.key.as_ref().unwrap();
    assert_eq!(key.recovery_point, RecoveryPoint::RideCreated);
    assert_eq!((key.lock.state, key.lock.live), ("held", false));
    let ride = report.ride.as_ref().unwrap();
    assert_eq!(ride.charge_id, None);
    assert_eq!(ride.receipt.staged_jobs, 0);
    assert_eq!(report.attention.len(), 1);
    assert_eq!(report.attention[0].id, attention_id);
    assert_eq!(
        report.attention[0].key_recovery_point_now,
        Some(RecoveryPoint::RideCreated)
    );
    assert!(report.render().contains("expired"));

    // charge_created, unlocked.
    let (_, charged) = key_at(&app, &user, RecoveryPoint::ChargeCreated).await;
    api_server::idempotency::release(&app.pool, Default::default(), &charged)
        .await
        .unwrap();
    let report = show(&app, charged.key_id).await;
    let key = report.key.as_ref().unwrap();
    assert_eq!(key.recovery_point, RecoveryPoint::ChargeCreated);
    assert_eq!((key.lock.state, key.lock.live), ("none", false));
    assert!(report.ride.as_ref().unwrap().charge_id.is_some());

    // finished: a paid ride, and a declined card.
    let paid_key = new_key();
    let paid = app
        .create_ride(&user, &paid_key, ride_request())
        .await
        .unwrap()
        .into_inner()
        .ride
        .unwrap();
    let paid_id = app.key_row(&user, &paid_key).await.unwrap().id;
    let report = show(&app, paid_id).await;
    let stored = report.key.as_ref().unwrap().stored_outcome.clone().unwrap();
    assert_eq!(stored.response_code, 0);
    match stored.outcome.unwrap() {
        Outcome::RideCreated { ride, message } => {
            assert_eq!(ride.id, paid.id);
            assert_eq!(ride.charge_id.as_deref(), Some(paid.charge_id.as_str()));
            assert_eq!(message, PAYMENT_ACCEPTED);
        }
        other => panic!("unexpected outcome {other:?}"),
    }
    let ride = report.ride.unwrap();
    assert_eq!(ride.id, paid.id);
    assert_eq!(ride.receipt.staged_jobs, 1, "the receipt is staged");

    let decliner = app.create_user(DECLINED_CARD).await;
    let declined_key = new_key();
    app.create_ride(&decliner, &declined_key, ride_request())
        .await
        .unwrap_err();
    let declined_id = app.key_row(&decliner, &declined_key).await.unwrap().id;
    let stored = show(&app, declined_id)
        .await
        .key
        .unwrap()
        .stored_outcome
        .unwrap();
    assert_eq!(stored.response_code, Code::FailedPrecondition as i32);
    assert!(matches!(stored.outcome, Some(Outcome::CardDeclined { .. })));

    // A reaped key is still shown through its attention row; an unknown one is not found.
    sql(
        &app,
        "UPDATE keys_needing_attention SET idempotency_key_id = 999999",
    )
    .await;
    let reaped = show(&app, 999_999).await;
    assert!(reaped.key.is_none());
    assert_eq!(reaped.attention.len(), 1);
    assert_eq!(reaped.attention[0].key_recovery_point_now, None);
    assert!(matches!(
        keys::show(&app.pool, &db_settings(), &KeySelector::Id(123_456_789)).await,
        Err(AdminError::NotFound(_))
    ));
}

#[tokio::test(flavor = "multi_thread")]
async fn unlock_is_a_dry_run_until_yes_and_the_key_then_resumes() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (key, key_id) = abandoned_at(&app, &user, RecoveryPoint::RideCreated).await;
    let before = app.key_row(&user, &key).await.unwrap();
    assert!(before.locked_at.is_some());

    let dry = keys::unlock(&app.pool, &db_settings(), key_id, false, Mode::DryRun)
        .await
        .unwrap();
    assert_eq!(dry.mode, Mode::DryRun);
    let columns: Vec<_> = dry.changes.iter().map(|c| c.column.unwrap()).collect();
    assert_eq!(columns, ["locked_at", "lock_token"]);
    assert!(dry.warnings.is_empty(), "an expired lock needs no force");
    let after_dry = app.key_row(&user, &key).await.unwrap();
    assert_eq!(
        after_dry.locked_at, before.locked_at,
        "a dry run changes nothing"
    );
    assert_eq!(after_dry.lock_token, before.lock_token);

    let applied = keys::unlock(&app.pool, &db_settings(), key_id, false, Mode::Apply)
        .await
        .unwrap();
    assert_eq!(applied.mode, Mode::Apply);
    let unlocked = app.key_row(&user, &key).await.unwrap();
    assert_eq!((unlocked.locked_at, unlocked.lock_token), (None, None));
    assert_eq!(unlocked.recovery_point, RecoveryPoint::RideCreated);

    // Unlocking again is refused: there is nothing to unlock.
    assert_refused(
        keys::unlock(&app.pool, &db_settings(), key_id, false, Mode::Apply).await,
        "not locked",
    );
    // The client's retry resumes the key at once and the ride is charged exactly once.
    let response = app.create_ride(&user, &key, ride_request()).await.unwrap();
    assert!(!replayed(&response));
    assert_eq!(app.stripe.succeeded_charges(), 1);
    assert_eq!(
        app.key_row(&user, &key).await.unwrap().recovery_point,
        RecoveryPoint::Finished
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn unlock_refuses_a_live_lock_unless_forced_and_fences_out_its_holder() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (key, mut lease) = key_at(&app, &user, RecoveryPoint::RideCreated).await;

    for mode in [Mode::DryRun, Mode::Apply] {
        assert_refused(
            keys::unlock(&app.pool, &db_settings(), lease.key_id, false, mode).await,
            "may still be running",
        );
    }
    let row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(row.lock_token, Some(lease.token), "refused: still locked");

    let forced = keys::unlock(&app.pool, &db_settings(), lease.key_id, true, Mode::Apply)
        .await
        .unwrap();
    assert_eq!(forced.warnings.len(), 1);
    assert!(forced.warnings[0].contains("--force"));
    assert_eq!(app.key_row(&user, &key).await.unwrap().locked_at, None);
    // The old holder's next phase commits nothing (its charge, made before the fence, is the
    // provider's replay for whoever resumes the key).
    assert_the_old_holder_commits_nothing(&app, &user, &mut lease).await;
}

/// Runs the phase of `lease`, whose lock an operator took away, and checks that it is fenced out:
/// no charge recorded, no receipt staged.
async fn assert_the_old_holder_commits_nothing(app: &TestApp, user: &TestUser, lease: &mut Lease) {
    let request = app.rides_request(user, params()).await;
    let step = app.rides.step(lease, &request).await;
    assert!(matches!(step, Err(CreateRideError::LockLost)), "{step:?}");
    let rides = app.rides().await;
    assert!(rides.iter().all(|r| r.stripe_charge_id.is_none()));
    assert!(app.staged_jobs().await.is_empty());
}

/// `key finish --force` takes the live lock over with its own token and finishes the key with the
/// api-server's `FinishKey` statement: the old holder is fenced out exactly as after an unlock.
#[tokio::test(flavor = "multi_thread")]
async fn a_forced_finish_fences_out_the_live_holder() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (key, mut lease) = key_at(&app, &user, RecoveryPoint::RideCreated).await;

    let request = FinishRequest {
        force: true,
        ..finish_request(lease.key_id, FinishOutcome::Declined)
    };
    let applied = finish(&app, &request, Mode::Apply).await.unwrap();
    assert_eq!(applied.warnings.len(), 1);
    let row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(row.recovery_point, RecoveryPoint::Finished);
    assert_eq!((row.locked_at, row.lock_token), (None, None));
    // The old holder's next phase commits nothing: no charge recorded on a key finished as
    // declined (a charge it made before the fence is the reconciler's to find).
    assert_the_old_holder_commits_nothing(&app, &user, &mut lease).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_finished_key_is_neither_unlocked_nor_finished_again() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    app.create_ride(&user, &key, ride_request()).await.unwrap();
    let before = app.key_row(&user, &key).await.unwrap();

    for mode in [Mode::DryRun, Mode::Apply] {
        assert_refused(
            keys::unlock(&app.pool, &db_settings(), before.id, true, mode).await,
            "is finished",
        );
        for outcome in [FinishOutcome::Succeeded, FinishOutcome::Declined] {
            let mut request = finish_request(before.id, outcome);
            request.force = true;
            assert_refused(finish(&app, &request, mode).await, "already finished");
        }
    }
    let after = app.key_row(&user, &key).await.unwrap();
    assert_eq!(after.response_body, before.response_body);
    assert_eq!(app.staged_jobs().await.len(), 1);
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
    assert_eq!(row.response_body, Some(expected.body));
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
    assert_eq!(row.response_body, Some(expected.body));

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
    let refunded = charge_for(&app, &user, key_id, &[]).await;
    let refund = reqwest::Client::new()
        .post(format!("{}/v1/refunds", app.stripe.base_url()))
        .bearer_auth("sk_test_harness")
        .form(&[("payment_intent", refunded.as_str())])
        .send()
        .await
        .unwrap();
    assert!(refund.status().is_success());
    let other_ride = (ride_id + 1).to_string();
    let cases = [
        (
            charge_for(&app, &user, key_id, &[("customer", "cus_another_product")]).await,
            "customer_mismatch",
        ),
        (
            charge_for(
                &app,
                &user,
                key_id,
                &[("metadata[deployment_id]", "staging")],
            )
            .await,
            "marker_mismatch",
        ),
        (
            charge_for(&app, &user, key_id, &[("amount", "1")]).await,
            "amount_mismatch",
        ),
        (
            charge_for(
                &app,
                &user,
                key_id,
                &[("metadata[ride_id]", other_ride.as_str())],
            )
            .await,
            "ride_mismatch",
        ),
        // The other rider's charge, named for this key.
        (
            charge_for(&app, &other_user, other_key, &[]).await,
            "not provably",
        ),
        (
            charge_for(&app, &user, key_id, &[("confirm", "false")]).await,
            "has not succeeded",
        ),
        (refunded, "was refunded"),
        ("pi_NeverMadeAnywhere0001".to_owned(), "does not exist"),
    ];
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

#[tokio::test(flavor = "multi_thread")]
async fn needing_attention_lists_oldest_first_and_resolves_one() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (key_a, a) = abandoned_at(&app, &user, RecoveryPoint::RideCreated).await;
    let (key_b, b) = abandoned_at(&app, &user, RecoveryPoint::Started).await;
    let newer = record_attention(&app, &user, &key_a, a).await;
    let older = record_attention(&app, &user, &key_b, b).await;
    let resolved = record_attention(&app, &user, &key_b, b).await;
    sql(
        &app,
        &format!(
            "UPDATE keys_needing_attention SET recorded_at = now() - interval '2 hours' \
             WHERE id = {older}"
        ),
    )
    .await;
    sql(
        &app,
        &format!("UPDATE keys_needing_attention SET resolved_at = now() WHERE id = {resolved}"),
    )
    .await;

    let open = attention::list(&app.pool, false, 100).await.unwrap();
    let ids: Vec<i64> = open.rows.iter().map(|row| row.id).collect();
    assert_eq!(ids, [older, newer], "unresolved only, oldest first");
    assert_eq!(open.total, 2);
    assert_eq!(
        open.rows[0].idempotency_key, key_b,
        "keys are shown in full"
    );
    let everything = attention::list(&app.pool, true, 100).await.unwrap();
    assert_eq!(everything.total, 3);
    let limited = attention::list(&app.pool, true, 1).await.unwrap();
    assert_eq!((limited.total, limited.rows.len()), (3, 1));

    let dry = attention::resolve(&app.pool, older, Some("refunded by hand"), Mode::DryRun)
        .await
        .unwrap();
    assert_eq!(dry.changes.len(), 1);
    assert!(dry.warnings[0].contains("still exists unfinished"));
    assert!(
        dry.notes
            .iter()
            .any(|note| note.contains("refunded by hand"))
    );
    assert_eq!(
        attention::list(&app.pool, false, 100).await.unwrap().total,
        2
    );

    attention::resolve(&app.pool, older, Some("refunded by hand"), Mode::Apply)
        .await
        .unwrap();
    let open = attention::list(&app.pool, false, 100).await.unwrap();
    assert_eq!(
        open.rows.iter().map(|row| row.id).collect::<Vec<_>>(),
        [newer]
    );
    let row = attention_rows(&app)
        .await
        .into_iter()
        .find(|row| row.id == older)
        .unwrap();
    assert!(row.resolved_at.is_some());
    assert_refused(
        attention::resolve(&app.pool, older, None, Mode::Apply).await,
        "already resolved",
    );
    assert!(matches!(
        attention::resolve(&app.pool, 987_654, None, Mode::Apply).await,
        Err(AdminError::NotFound(_))
    ));
}

/// Stages receipt jobs for rides 1..=count, publishes them, and lets the receipt worker
/// dead-letter them (unknown ride, so call it before any ride exists): `count` real dead letters,
/// with `x-death`. Returns the job ids (= message ids).
async fn dead_letter(app: &TestApp, broker: &TestBroker, count: usize) -> Vec<String> {
    let ids = common::stage_jobs(&app.pool, count).await;
    let summary = common::enqueuer(&app.pool, broker, 100)
        .run_once()
        .await
        .unwrap();
    assert_eq!(summary.published, count as u64);
    let sink = common::mail_sink().await;
    let worker = common::receipt_worker(&app.pool, broker, &sink);
    let summary = worker.run_once(&broker.session.channel).await.unwrap();
    assert_eq!(summary.dead_lettered, count as u64);
    assert_eq!(
        broker
            .wait_for_depth(&broker.topology.dead_letter_queue, count as u32)
            .await,
        count as u32
    );
    ids.into_iter().map(|id| id.to_string()).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn dead_letters_list_leaves_them_in_place() {
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    let ids = dead_letter(&app, &broker, 3).await;
    let url = common::amqp_url();

    let first = dead_letters::list(&url, &broker.topology, 20)
        .await
        .unwrap();
    assert_eq!(first.queue.messages, 3);
    assert_eq!(first.shown, 3);
    let mut listed: Vec<String> = first
        .messages
        .iter()
        .map(|message| message.message_id.clone().unwrap())
        .collect();
    listed.sort();
    let mut expected = ids.clone();
    expected.sort();
    assert_eq!(listed, expected);
    for message in &first.messages {
        let death = message.death.as_ref().unwrap();
        assert_eq!(death.reason.as_deref(), Some("rejected"));
        assert_eq!(death.count, Some(1));
        assert_eq!(
            death.queue.as_deref(),
            Some(broker.topology.receipts_queue.as_str())
        );
        assert_eq!(message.job_name.as_deref(), Some(ReceiptJob::JOB_NAME));
        assert!(
            message.summary.starts_with("receipt v1: ride "),
            "{}",
            message.summary
        );
    }

    // Still there, every one of them, and listing again shows the same.
    assert_eq!(
        broker
            .wait_for_depth(&broker.topology.dead_letter_queue, 3)
            .await,
        3
    );
    let again = dead_letters::list(&url, &broker.topology, 2).await.unwrap();
    assert_eq!((again.queue.messages, again.shown), (3, 2));
    assert_eq!(
        broker
            .wait_for_depth(&broker.topology.dead_letter_queue, 3)
            .await,
        3
    );
    assert_eq!(broker.depth(&broker.topology.receipts_queue).await, 0);
    let text = first.render();
    assert!(text.contains("rejected x1"), "{text}");
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn dead_letters_requeue_moves_them_back_to_the_receipts_queue() {
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    let ids = dead_letter(&app, &broker, 3).await;
    let url = common::amqp_url();

    let dry = dead_letters::requeue(&url, &broker.topology, None, Mode::DryRun)
        .await
        .unwrap();
    assert_eq!((dry.moved, dry.dead_letter_depth_before), (3, 3));
    assert_eq!(
        broker
            .wait_for_depth(&broker.topology.dead_letter_queue, 3)
            .await,
        3,
        "a dry run moves nothing"
    );
    assert_eq!(broker.depth(&broker.topology.receipts_queue).await, 0);

    let one = dead_letters::requeue(&url, &broker.topology, Some(1), Mode::Apply)
        .await
        .unwrap();
    assert_eq!(one.moved, 1);
    assert!(one.stopped.is_none());
    let rest = dead_letters::requeue(&url, &broker.topology, None, Mode::Apply)
        .await
        .unwrap();
    assert_eq!(rest.moved, 2);
    assert_eq!(rest.dead_letter_depth_after, 0);
    assert_eq!(broker.depth(&broker.topology.dead_letter_queue).await, 0);
    assert_eq!(
        broker
            .wait_for_depth(&broker.topology.receipts_queue, 3)
            .await,
        3
    );

    let taken = broker.take_all(&broker.topology.receipts_queue).await;
    let mut moved: Vec<String> = taken.iter().map(|m| m.message_id.clone()).collect();
    moved.sort();
    let mut expected = ids.clone();
    expected.sort();
    assert_eq!(moved, expected, "the same messages, by message_id");
    for message in &taken {
        let headers = message.properties.headers().as_ref().unwrap();
        assert!(
            !headers.contains_key("x-death"),
            "dead-letter history dropped"
        );
        assert!(!headers.contains_key("x-first-death-reason"));
        assert!(
            headers.contains_key("x-job-name"),
            "application headers kept"
        );
        assert_eq!(*message.properties.delivery_mode(), Some(2));
        assert_eq!(
            message.properties.content_type().as_ref().unwrap().as_str(),
            "application/json"
        );
        let receipt = contract::message::ReceiptMessage::decode(&message.body).unwrap();
        assert!((1..=3).contains(&receipt.ride_id));
    }
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn backlog_counts_staged_jobs_queues_and_open_attention() {
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    let user = app.create_user(GOOD_CARD).await;
    common::stage_jobs(&app.pool, 3).await;
    {
        let mut conn = app.pool.get().await.unwrap();
        let args = serde_json::json!({});
        diesel::insert_into(staged_jobs::table)
            .values(NewStagedJob {
                job_name: "audit_export",
                job_args: &args,
                trace_context: &args,
            })
            .execute(&mut conn)
            .await
            .unwrap();
    }
    sql(
        &app,
        "UPDATE staged_jobs SET created_at = now() - interval '1 hour' \
         WHERE job_name = 'audit_export'",
    )
    .await;
    let (key, key_id) = abandoned_at(&app, &user, RecoveryPoint::RideCreated).await;
    record_attention(&app, &user, &key, key_id).await;
    broker.publish_raw("m-1", b"{}").await;
    broker.publish_raw("m-2", b"{}").await;

    let report = backlog::backlog(&app.pool, &common::amqp_url(), &broker.topology)
        .await
        .unwrap();
    let staged: Vec<(&str, i64)> = report
        .staged_jobs
        .iter()
        .map(|s| (s.job_name.as_str(), s.count))
        .collect();
    assert_eq!(staged, [("audit_export", 1), (ReceiptJob::JOB_NAME, 3)]);
    let age = report.now - report.staged_jobs[0].oldest_created_at;
    assert!(age >= chrono::Duration::minutes(59), "{age:?}");
    assert_eq!(report.keys_needing_attention, 1);
    let depths: Vec<(&str, u32)> = report
        .queues
        .iter()
        .map(|q| (q.queue.as_str(), q.messages))
        .collect();
    assert_eq!(
        depths,
        [
            (broker.topology.receipts_queue.as_str(), 2),
            (broker.topology.dead_letter_queue.as_str(), 0)
        ]
    );
    assert!(report.queues_error.is_none());

    // Wrong prefix (or broker trouble): the database half is still reported.
    let wrong = Topology::from_prefix("admin-tests-missing", 5);
    let report = backlog::backlog(&app.pool, &common::amqp_url(), &wrong)
        .await
        .unwrap();
    assert_eq!(report.staged_jobs.len(), 2);
    assert!(report.queues.is_empty());
    assert!(
        report
            .queues_error
            .unwrap()
            .contains("admin-tests-missing.receipts")
    );
    broker.cleanup().await;
}

/// Runs the compiled `workers` binary with the test's database and broker.
async fn workers_cli(app: &TestApp, broker: &TestBroker, args: &[&str]) -> Output {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_workers"));
    command
        .args(args)
        .env("DATABASE_URL", app.db.url())
        .env("AMQP_URL", common::amqp_url())
        .env("AMQP_TOPOLOGY_PREFIX", &broker.topology.exchange)
        .env("RUST_LOG", "info")
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("IDEMPOTENCY_LOCK_TIMEOUT_SECS");
    tokio::task::spawn_blocking(move || command.output().unwrap())
        .await
        .unwrap()
}

fn stdout(output: &Output) -> String {
    String::from_utf8(output.stdout.clone()).unwrap()
}

fn stderr(output: &Output) -> String {
    String::from_utf8(output.stderr.clone()).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_binary_dry_runs_by_default_and_applies_with_yes() {
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    let user = app.create_user(GOOD_CARD).await;
    let (key, key_id) = abandoned_at(&app, &user, RecoveryPoint::RideCreated).await;
    let id = key_id.to_string();
    let token = app.key_row(&user, &key).await.unwrap().lock_token.unwrap();

    // show, as text and as JSON; never the token.
    let shown = workers_cli(&app, &broker, &["admin", "key", "show", "--key-id", &id]).await;
    assert!(shown.status.success(), "{}", stderr(&shown));
    assert!(
        stdout(&shown).contains("ride_created"),
        "{}",
        stdout(&shown)
    );
    assert!(
        stdout(&shown).contains(&key),
        "operators see the key in full"
    );
    assert!(!stderr(&shown).contains(&key), "but it is never logged");
    let shown = workers_cli(
        &app,
        &broker,
        &["admin", "--json", "key", "show", "--key-id", &id],
    )
    .await;
    let json: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(json["key"]["lock"]["state"], "held");
    assert_eq!(json["key"]["lock"]["live"], false);
    assert!(!stdout(&shown).contains(&token.to_string()));

    // The default is a dry run: it prints the plan and changes nothing.
    let dry = workers_cli(&app, &broker, &["admin", "key", "unlock", "--key-id", &id]).await;
    assert!(dry.status.success(), "{}", stderr(&dry));
    assert!(stdout(&dry).contains("DRY RUN"), "{}", stdout(&dry));
    assert!(stdout(&dry).contains("locked_at"), "{}", stdout(&dry));
    assert_eq!(
        app.key_row(&user, &key).await.unwrap().lock_token,
        Some(token),
        "the dry run changed nothing"
    );

    // --yes applies.
    let applied = workers_cli(
        &app,
        &broker,
        &["admin", "key", "unlock", "--key-id", &id, "--yes", "--json"],
    )
    .await;
    assert!(applied.status.success(), "{}", stderr(&applied));
    let json: serde_json::Value = serde_json::from_slice(&applied.stdout).unwrap();
    assert_eq!(json["mode"], "apply");
    assert_eq!(json["changes"].as_array().unwrap().len(), 2);
    let row = app.key_row(&user, &key).await.unwrap();
    assert_eq!((row.locked_at, row.lock_token), (None, None));

    // A refused precondition exits non-zero and says why, on stderr and in --json.
    let refused = workers_cli(
        &app,
        &broker,
        &["admin", "key", "unlock", "--key-id", &id, "--yes"],
    )
    .await;
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("not locked"),
        "{}",
        stderr(&refused)
    );
    let refused = workers_cli(
        &app,
        &broker,
        &["admin", "key", "unlock", "--key-id", &id, "--yes", "--json"],
    )
    .await;
    assert!(!refused.status.success());
    let json: serde_json::Value = serde_json::from_slice(&refused.stdout).unwrap();
    assert_eq!(json["error"], "refused");

    // finish, end to end, then the replay.
    let finish = [
        "admin",
        "key",
        "finish",
        "--key-id",
        &id,
        "--outcome",
        "declined",
    ];
    let dry = workers_cli(&app, &broker, &finish).await;
    assert!(dry.status.success(), "{}", stderr(&dry));
    assert_eq!(
        app.key_row(&user, &key).await.unwrap().recovery_point,
        RecoveryPoint::RideCreated
    );
    let applied = workers_cli(&app, &broker, &[&finish[..], &["--yes"]].concat()).await;
    assert!(applied.status.success(), "{}", stderr(&applied));
    assert!(stdout(&applied).contains("APPLIED"));
    let status = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap_err();
    assert_status(&status, Code::FailedPrecondition, "CARD_DECLINED");

    // backlog reads the broker named by AMQP_TOPOLOGY_PREFIX.
    let backlog = workers_cli(&app, &broker, &["admin", "backlog", "--json"]).await;
    assert!(backlog.status.success(), "{}", stderr(&backlog));
    let json: serde_json::Value = serde_json::from_slice(&backlog.stdout).unwrap();
    assert_eq!(json["queues"][0]["queue"], broker.topology.receipts_queue);
    broker.cleanup().await;
}

/// The upgrade step from a server before run 24 of docs/history/performance.md: every key such a
/// server left at `started` is retired (it held nothing, so a retry starts afresh and is charged
/// once), every key left at `charge_created` is finished as charged with its receipt staged (a
/// retry replays the ride, no second charge), a key whose lock is live is left and fails the
/// command until it expires, a dry run changes nothing, and this server's own keys are untouched.
#[tokio::test(flavor = "multi_thread")]
async fn upgrade_retires_started_keys_and_finishes_charge_created_ones() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (started_key, started) = abandoned_at(&app, &user, RecoveryPoint::Started).await;
    let (charged_key, charged) = abandoned_at(&app, &user, RecoveryPoint::ChargeCreated).await;
    let (live_key, live) = key_at(&app, &user, RecoveryPoint::ChargeCreated).await;
    let (current_key, _) = abandoned_at(&app, &user, RecoveryPoint::RideCreated).await;
    assert_eq!(app.stripe.succeeded_charges(), 2);
    let upgrade = |mode| {
        let app = &app;
        async move {
            keys::upgrade(&app.pool, &db_settings(), &stripe(app), mode)
                .await
                .unwrap()
        }
    };

    let dry = upgrade(Mode::DryRun).await;
    assert_eq!(dry.keys.len(), 3, "{dry:?}");
    assert!(dry.failure().is_some(), "the live key is left");
    assert_eq!(app.key_count().await, 4, "a dry run deletes nothing");
    assert!(app.staged_jobs().await.is_empty(), "and stages nothing");

    let applied = upgrade(Mode::Apply).await;
    let actions: Vec<(i64, &str)> = applied
        .keys
        .iter()
        .map(|key| {
            let action = match &key.outcome {
                keys::UpgradeOutcome::Retired { .. } => "retired",
                keys::UpgradeOutcome::Finished { .. } => "finished",
                keys::UpgradeOutcome::Left { reason } => {
                    assert!(reason.contains("may still be running"), "{reason}");
                    "left"
                }
            };
            (key.key_id, action)
        })
        .collect();
    assert_eq!(
        actions,
        [
            (started, "retired"),
            (charged, "finished"),
            (live.key_id, "left")
        ]
    );
    let failure = applied.failure().expect("a key was left");
    assert!(failure.contains("1 key(s) left"), "{failure}");
    assert!(applied.render().contains("LEFT"), "{}", applied.render());
    assert!(app.key_row(&user, &started_key).await.is_none());
    let row = app.key_row(&user, &charged_key).await.unwrap();
    assert_eq!(row.recovery_point, RecoveryPoint::Finished);
    assert_eq!(row.locked_at, None);
    assert_eq!(
        app.staged_jobs().await.len(),
        1,
        "the finished key's receipt"
    );
    assert_eq!(
        app.key_row(&user, &current_key)
            .await
            .unwrap()
            .recovery_point,
        RecoveryPoint::RideCreated,
        "this server's own keys are not the step's"
    );

    // Once the live lock has expired, the step leaves nothing.
    app.expire_lock(live.key_id).await;
    let last = upgrade(Mode::Apply).await;
    assert_eq!(last.keys.len(), 1);
    assert!(last.failure().is_none());
    assert!(upgrade(Mode::Apply).await.keys.is_empty());

    // Every client retry now answers: the finished keys replay their ride, the retired key runs
    // afresh; the provider holds one charge per ride.
    for key in [&charged_key, &live_key] {
        let replay = app.create_ride(&user, key, ride_request()).await.unwrap();
        assert!(replayed(&replay));
    }
    let fresh = app
        .create_ride(&user, &started_key, ride_request())
        .await
        .unwrap();
    assert!(!replayed(&fresh));
    assert_eq!(app.stripe.succeeded_charges(), 3);
    assert_eq!(app.staged_jobs().await.len(), 3);
}
