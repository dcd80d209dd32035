//! The reconciler against the real api-server, PostgreSQL and fake-stripe over HTTP: a clean
//! ledger yields nothing, each mismatch kind is found and recorded once, pending charges wait for
//! their key, a second pass at the same time skips, a refund is made once however often it is
//! asked for and only of a charge proven ours, another product's look-alikes are counted and left
//! alone, and a refunded key is final.

use std::time::Duration;

use api_server::testing::{GOOD_CARD, TestApp, TestUser, assert_status, new_key, ride_request};
use diesel::{ExpressionMethods, QueryDsl, SelectableHelper};
use diesel_async::RunQueryDsl;
use fake_stripe::FaultMode;
use schema::{
    FindingKind,
    models::ReconciliationFinding,
    schema::{reconciler_watermarks, reconciliation_findings},
};
use serde_json::Value;
use workers::{
    admin::{AdminError, Mode, findings},
    config::ReconcilerConfig,
    reconciler::{
        ReconcileSummary, Reconciler,
        refund::{RefundRequester, refund_finding},
    },
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
    let status = app
        .create_ride(user, key, ride_request())
        .await
        .unwrap_err();
    assert_status(
        &status,
        tonic::Code::FailedPrecondition,
        api_server::grpc::reason::PAYMENT_REFUNDED,
    );
}

fn kinds(findings: &[ReconciliationFinding]) -> Vec<FindingKind> {
    findings.iter().map(|finding| finding.kind).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_clean_ledger_yields_no_finding() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    for _ in 0..3 {
        charged_ride(&app, &user).await;
    }
    let declined = app.create_user(api_server::testing::DECLINED_CARD).await;
    assert!(
        app.create_ride(&declined, &new_key(), ride_request())
            .await
            .is_err()
    );
    // Someone else's charge on the same account: not ours to reconcile.
    charge_directly(&app, &[("metadata[order]", "42")]).await;

    let summary = pass(&app, false).await;
    assert_eq!(summary.intents, 5, "{summary:?}");
    assert_eq!(summary.rides, 3);
    assert_eq!(summary.matched, 3);
    assert_eq!(summary.foreign, 1);
    assert_eq!((summary.findings, summary.pending), (0, 0));
    assert!(summary.caught_up);
    assert!(findings_of(&app).await.is_empty());

    let again = pass(&app, false).await;
    assert_eq!(again.findings, 0);
    assert!(again.window_from < summary.window_until, "windows overlap");
    assert!(
        again.window_until > summary.window_until,
        "the watermark moved on"
    );
}

/// A window compared one-second slice at a time (`RECONCILER_SLICE_SECS`) says what it says in
/// one piece: rides spread over several seconds, every one matched, nothing a finding.
#[tokio::test(flavor = "multi_thread")]
async fn a_window_compared_in_slices_matches_every_ride_and_finds_nothing() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    for _ in 0..6 {
        charged_ride(&app, &user).await;
        tokio::time::sleep(Duration::from_millis(450)).await;
    }
    let config = ReconcilerConfig {
        initial_lookback: Duration::from_secs(30),
        slice: Duration::from_secs(1),
        ..config(&app)
    };
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let summary = Reconciler::new(app.pool.clone(), config)
        .unwrap()
        .run_once(false)
        .await
        .unwrap();
    assert_eq!((summary.intents, summary.rides), (6, 6), "{summary:?}");
    // A ride whose charge is listed in the next slice is matched by both.
    assert!(summary.matched >= 6, "{summary:?}");
    assert_eq!((summary.findings, summary.pending), (0, 0), "{summary:?}");
    assert!(findings_of(&app).await.is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_charge_of_an_abandoned_key_is_pending_while_the_key_is_live_then_unrecorded() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    // Charge-then-drop: the provider charged, the api-server never heard; the key stays at
    // ride_created for the completer.
    app.stripe.inject_faults(FaultMode::ChargeThenDrop, 1);
    assert!(
        app.create_ride(&user, &new_key(), ride_request())
            .await
            .is_err()
    );
    let summary = pass(&app, false).await;
    assert_eq!((summary.pending, summary.findings), (1, 0), "{summary:?}");

    // The completer gives up on the key: nothing will record that charge any more.
    sql(
        &app,
        "UPDATE idempotency_keys SET completer_gave_up_at = now()",
    )
    .await;
    let summary = pass(&app, false).await;
    assert_eq!((summary.pending, summary.findings), (0, 1), "{summary:?}");
    let found = findings_of(&app).await;
    assert_eq!(kinds(&found), [FindingKind::UnrecordedCharge]);
    let rides = app.rides().await;
    let finding = &found[0];
    assert_eq!(finding.ride_id, Some(rides[0].id));
    assert_eq!(finding.user_id, Some(user.id));
    assert_eq!(
        finding.payment_intent_id,
        app.stripe.payment_intents()[0].id
    );
    assert_eq!(finding.provider_status.as_deref(), Some("succeeded"));
    assert_eq!(
        (finding.provider_amount, finding.ride_amount),
        (Some(2000), Some(2000))
    );
    assert!(finding.resolved_at.is_none());

    // Seen again: the same one finding, recorded once.
    let summary = pass(&app, false).await;
    assert_eq!((summary.findings, summary.new_findings), (1, 0));
    let again = findings_of(&app).await;
    assert_eq!(again.len(), 1, "recorded once");
    assert!(again[0].last_seen_at > again[0].first_seen_at);

    // Reaped: the charge carries our marker but can no longer be proven ours. A person is told
    // (`unknown_ride`, never refunded by the tools); the unrecorded_charge finding stays open.
    sql(&app, "DELETE FROM idempotency_keys").await;
    let summary = pass(&app, false).await;
    assert_eq!(
        (summary.findings, summary.new_findings),
        (1, 1),
        "{summary:?}"
    );
    let found = findings_of(&app).await;
    assert_eq!(
        kinds(&found),
        [FindingKind::UnrecordedCharge, FindingKind::UnknownRide]
    );
    assert!(!found[1].kind.is_refundable());
}

#[tokio::test(flavor = "multi_thread")]
async fn another_products_look_alikes_are_counted_never_findings_nor_refunded() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (ride_id, _) = charged_ride(&app, &user).await;
    let key_id = app.rides().await[0].idempotency_key_id.unwrap();
    // The three, seen live: a `user_id`; a `ride_id` naming one of our rides with another
    // customer and amount; an `idempotency_key_id` of ours.
    let ride = ride_id.to_string();
    let key = key_id.to_string();
    let user_id = user.id.to_string();
    charge_directly(&app, &[("metadata[user_id]", &user_id)]).await;
    charge_directly(&app, &[("metadata[ride_id]", &ride), ("amount", "4500")]).await;
    charge_directly(&app, &[("metadata[idempotency_key_id]", &key)]).await;

    let summary = pass(&app, true).await;
    assert_eq!((summary.findings, summary.refunded), (0, 0), "{summary:?}");
    assert_eq!(summary.matched, 1);
    assert_eq!(summary.foreign, 3);
    assert_eq!(summary.look_alikes.values().sum::<u64>(), 3);
    assert!(findings_of(&app).await.is_empty());
    assert!(app.stripe.refunds().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_charge_with_our_marker_that_is_not_provably_ours_is_an_unknown_ride() {
    let app = TestApp::spawn().await;
    let pi = charge_directly(
        &app,
        &[
            ("metadata[deployment_id]", "dev"),
            ("metadata[ride_id]", "987654"),
            ("metadata[idempotency_key_id]", "555"),
        ],
    )
    .await;
    // Another environment's marker is not ours at all.
    charge_directly(
        &app,
        &[
            ("metadata[deployment_id]", "staging"),
            ("metadata[idempotency_key_id]", "555"),
        ],
    )
    .await;
    let summary = pass(&app, true).await;
    assert_eq!((summary.findings, summary.foreign), (1, 1), "{summary:?}");
    let found = findings_of(&app).await;
    assert_eq!(kinds(&found), [FindingKind::UnknownRide]);
    assert_eq!(found[0].payment_intent_id, pi["id"].as_str().unwrap());
    assert_eq!(
        (found[0].ride_id, found[0].idempotency_key_id),
        (Some(987_654), Some(555))
    );
    assert_eq!(summary.refunded, 0, "never refunded in bulk");
    let stripe = provider::StripeClient::new(&config(&app).stripe).unwrap();
    let refused = refund_finding(&app.pool, &stripe, found[0].id, Mode::Apply, &operator()).await;
    assert!(
        matches!(refused, Err(AdminError::Refused(_))),
        "{refused:?}"
    );
    assert!(app.stripe.refunds().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_ride_recording_a_charge_the_provider_lacks_is_a_missing_charge() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    sql(
        &app,
        &format!(
            "INSERT INTO rides (user_id, origin_lat, origin_lon, target_lat, target_lon, amount, \
             currency, stripe_charge_id) VALUES ({}, 1, 2, 3, 4, 2000, 'usd', 'pi_never_made')",
            user.id
        ),
    )
    .await;
    let summary = pass(&app, false).await;
    assert_eq!((summary.rides, summary.findings), (1, 1), "{summary:?}");
    let found = findings_of(&app).await;
    assert_eq!(kinds(&found), [FindingKind::MissingCharge]);
    assert_eq!(found[0].payment_intent_id, "pi_never_made");
    assert_eq!(found[0].provider_status, None);
    assert_eq!(found[0].ride_amount, Some(2000));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_ride_recording_an_unconfirmed_intent_is_a_charge_not_succeeded() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let pi = charge_directly(&app, &[("confirm", "false")]).await;
    let id = pi["id"].as_str().unwrap();
    assert_eq!(pi["status"], "requires_confirmation");
    sql(
        &app,
        &format!(
            "INSERT INTO rides (user_id, origin_lat, origin_lon, target_lat, target_lon, amount, \
             currency, stripe_charge_id) VALUES ({}, 1, 2, 3, 4, 2000, 'usd', '{id}')",
            user.id
        ),
    )
    .await;
    pass(&app, false).await;
    let found = findings_of(&app).await;
    assert_eq!(kinds(&found), [FindingKind::ChargeNotSucceeded]);
    assert_eq!(
        found[0].provider_status.as_deref(),
        Some("requires_confirmation")
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_ride_whose_amount_differs_from_its_charge_is_an_amount_mismatch() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (ride_id, charge_id) = charged_ride(&app, &user).await;
    charged_ride(&app, &user).await;
    sql(
        &app,
        &format!("UPDATE rides SET amount = 2500 WHERE id = {ride_id}"),
    )
    .await;
    let summary = pass(&app, false).await;
    assert_eq!((summary.matched, summary.findings), (1, 1), "{summary:?}");
    let found = findings_of(&app).await;
    assert_eq!(kinds(&found), [FindingKind::AmountMismatch]);
    assert_eq!(found[0].payment_intent_id, charge_id);
    assert_eq!(
        (found[0].provider_amount, found[0].ride_amount),
        (Some(2000), Some(2500))
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_ride_whose_currency_differs_from_its_charge_is_a_currency_mismatch() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (ride_id, _) = charged_ride(&app, &user).await;
    sql(
        &app,
        &format!("UPDATE rides SET currency = 'eur' WHERE id = {ride_id}"),
    )
    .await;
    pass(&app, false).await;
    let found = findings_of(&app).await;
    assert_eq!(kinds(&found), [FindingKind::CurrencyMismatch]);
    assert_eq!(
        (
            found[0].provider_currency.as_deref(),
            found[0].ride_currency.as_deref()
        ),
        (Some("usd"), Some("eur"))
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refund_is_made_once_however_often_the_reconciler_runs_and_never_by_default() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    unrecorded_charge(&app, &user).await;
    let summary = pass(&app, false).await;
    assert_eq!((summary.findings, summary.refunded), (1, 0));
    assert!(
        app.stripe.refunds().is_empty(),
        "no refund without --refund"
    );
    let finding_id = findings_of(&app).await[0].id;

    // Dry run: the plan, nothing at the provider.
    let stripe = provider::StripeClient::new(&config(&app).stripe).unwrap();
    let plan = refund_finding(&app.pool, &stripe, finding_id, Mode::DryRun, &operator())
        .await
        .unwrap();
    assert_eq!(
        plan.changes.len(),
        3,
        "the refund, the key finished, the finding"
    );
    assert!(app.stripe.refunds().is_empty());

    // Two refunding passes at once, then more, then the admin command.
    let (one, other) = (reconciler(&app), reconciler(&app));
    let (first, second) = tokio::join!(one.run_once(true), other.run_once(true));
    let refunded = first.unwrap().refunded + second.unwrap().refunded;
    assert_eq!(
        refunded, 1,
        "one of the two refunded, the other found it resolved"
    );
    for _ in 0..3 {
        let summary = pass(&app, true).await;
        assert_eq!(summary.refunded, 0, "{summary:?}");
    }
    let again = refund_finding(&app.pool, &stripe, finding_id, Mode::Apply, &operator()).await;
    assert!(matches!(again, Err(AdminError::Refused(_))), "{again:?}");

    let refunds = app.stripe.refunds();
    assert_eq!(refunds.len(), 1, "exactly one refund at the provider");
    assert_eq!(refunds[0].amount, 2000);
    let finding = &findings_of(&app).await[0];
    assert_eq!(finding.refund_id.as_deref(), Some(refunds[0].id.as_str()));
    assert!(finding.resolved_at.is_some());
    assert!(
        finding
            .resolution
            .as_deref()
            .unwrap()
            .contains(&refunds[0].id)
    );
}

/// A full refund of `payment_intent` made straight at the provider under `idempotency_key`.
async fn refund_directly(
    app: &TestApp,
    payment_intent: &str,
    idempotency_key: &str,
    extra: &[(&str, &str)],
) {
    let mut form = vec![("payment_intent", payment_intent)];
    form.extend_from_slice(extra);
    let response = reqwest::Client::new()
        .post(format!("{}/v1/refunds", app.stripe.base_url()))
        .bearer_auth("sk_test_harness")
        .header("Idempotency-Key", idempotency_key)
        .form(&form)
        .send()
        .await
        .unwrap();
    assert!(
        response.status().is_success(),
        "{}",
        response.text().await.unwrap()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_already_refunded_charge_is_recorded_only_if_the_refund_names_the_finding() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (_, ours) = unrecorded_charge(&app, &user).await;
    let (_, theirs) = unrecorded_charge(&app, &user).await;
    pass(&app, false).await;
    let found = findings_of(&app).await;
    assert_eq!(found.len(), 2);
    let finding_of = |intent: &str| {
        found
            .iter()
            .find(|finding| finding.payment_intent_id == intent)
            .unwrap()
            .clone()
    };
    let (our_finding, their_finding) = (finding_of(&ours), finding_of(&theirs));
    // Our earlier refund, whose recording was lost and whose key the provider has since forgotten
    // (another key stands for the forgotten one), and a refund someone else made by hand.
    let our_id = our_finding.id.to_string();
    refund_directly(
        &app,
        &our_finding.payment_intent_id,
        "a-key-the-provider-forgot",
        &[("metadata[finding_id]", &our_id)],
    )
    .await;
    refund_directly(
        &app,
        &their_finding.payment_intent_id,
        "dashboard-refund",
        &[],
    )
    .await;

    let stripe = provider::StripeClient::new(&config(&app).stripe).unwrap();
    refund_finding(&app.pool, &stripe, our_finding.id, Mode::Apply, &operator())
        .await
        .unwrap();
    let refused = refund_finding(
        &app.pool,
        &stripe,
        their_finding.id,
        Mode::Apply,
        &operator(),
    )
    .await;
    assert!(
        matches!(&refused, Err(AdminError::Provider(error)) if error.code() == Some("charge_already_refunded")),
        "{refused:?}"
    );

    assert_eq!(app.stripe.refunds().len(), 2, "no refund was made twice");
    let after = findings_of(&app).await;
    let ours_after = after.iter().find(|f| f.id == our_finding.id).unwrap();
    let refund_id = &app
        .stripe
        .refunds()
        .into_iter()
        .find(|refund| refund.payment_intent == our_finding.payment_intent_id)
        .unwrap()
        .id;
    assert_eq!(ours_after.refund_id.as_deref(), Some(refund_id.as_str()));
    assert!(ours_after.resolved_at.is_some());
    let theirs_after = after.iter().find(|f| f.id == their_finding.id).unwrap();
    assert_eq!(theirs_after.refund_id, None);
    assert!(theirs_after.resolved_at.is_none(), "left open for a person");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refund_is_refused_for_a_recorded_ride_or_a_live_key() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (ride_id, _) = charged_ride(&app, &user).await;
    sql(
        &app,
        &format!("UPDATE rides SET amount = 1 WHERE id = {ride_id}"),
    )
    .await;
    app.stripe.inject_faults(FaultMode::ChargeThenDrop, 1);
    assert!(
        app.create_ride(&user, &new_key(), ride_request())
            .await
            .is_err()
    );
    sql(&app, "UPDATE idempotency_keys SET completer_gave_up_at = now() WHERE recovery_point <> 'finished'").await;
    pass(&app, false).await;
    let found = findings_of(&app).await;
    let mut found_kinds = kinds(&found);
    found_kinds.sort_by_key(|kind| kind.as_str());
    assert_eq!(
        found_kinds,
        [FindingKind::AmountMismatch, FindingKind::UnrecordedCharge]
    );
    let stripe = provider::StripeClient::new(&config(&app).stripe).unwrap();
    let mismatch = found
        .iter()
        .find(|finding| finding.kind == FindingKind::AmountMismatch)
        .unwrap();
    let refused = refund_finding(&app.pool, &stripe, mismatch.id, Mode::Apply, &operator()).await;
    assert!(
        matches!(refused, Err(AdminError::Refused(_))),
        "a ride stands for that charge"
    );

    // An operator hands the key back to the completer: it is live again, so no refund.
    sql(
        &app,
        "UPDATE idempotency_keys SET completer_gave_up_at = NULL",
    )
    .await;
    let unrecorded = found
        .iter()
        .find(|finding| finding.kind == FindingKind::UnrecordedCharge)
        .unwrap();
    let refused = refund_finding(&app.pool, &stripe, unrecorded.id, Mode::Apply, &operator()).await;
    assert!(
        matches!(refused, Err(AdminError::Refused(_))),
        "{refused:?}"
    );
    assert!(app.stripe.refunds().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_pass_while_one_holds_the_watermark_skips() {
    let app = TestApp::spawn().await;
    charge_directly(
        &app,
        &[
            ("metadata[deployment_id]", "dev"),
            ("metadata[idempotency_key_id]", "1"),
        ],
    )
    .await;
    let first = pass(&app, false).await;
    assert!(!first.skipped);
    let mut holder = app.db.connect().await;
    holder
        .build_transaction()
        .run(async |conn| {
            let _: Vec<String> = reconciler_watermarks::table
                .select(reconciler_watermarks::name)
                .for_update()
                .load(conn)
                .await?;
            let summary = reconciler(&app).run_once(false).await.unwrap();
            assert!(summary.skipped, "{summary:?}");
            assert_eq!(summary.window_until, None);
            Ok::<(), diesel::result::Error>(())
        })
        .await
        .unwrap();
    let after = pass(&app, false).await;
    assert!(!after.skipped);
    assert_eq!(findings_of(&app).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn findings_are_listed_shown_and_resolved_by_the_admin_commands() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    unrecorded_charge(&app, &user).await;
    pass(&app, false).await;
    let list = findings::list(&app.pool, false, 10).await.unwrap();
    assert_eq!(list.total, 1);
    let id = list.findings[0].id;
    assert!(list.render().contains("unrecorded_charge"));
    let shown = findings::show(&app.pool, id).await.unwrap();
    assert!(shown.refundable);
    assert!(shown.render().contains("findings refund"));

    let plan = findings::resolve(
        &app.pool,
        id,
        "refunded by hand in the dashboard",
        Mode::DryRun,
    )
    .await
    .unwrap();
    assert!(plan.render().contains("DRY RUN"));
    assert!(
        findings::show(&app.pool, id)
            .await
            .unwrap()
            .finding
            .resolved_at
            .is_none()
    );
    findings::resolve(
        &app.pool,
        id,
        "refunded by hand in the dashboard",
        Mode::Apply,
    )
    .await
    .unwrap();
    let resolved = findings::show(&app.pool, id).await.unwrap().finding;
    assert_eq!(
        resolved.resolution.as_deref(),
        Some("refunded by hand in the dashboard")
    );
    assert!(
        findings::resolve(&app.pool, id, "again", Mode::Apply)
            .await
            .is_err()
    );

    // Seen again by a later pass: stays resolved, not recorded twice, not refunded.
    let summary = pass(&app, true).await;
    assert_eq!(
        (summary.findings, summary.new_findings, summary.refunded),
        (1, 0, 0)
    );
    assert_eq!(findings::list(&app.pool, false, 10).await.unwrap().total, 0);
    assert_eq!(findings::list(&app.pool, true, 10).await.unwrap().total, 1);
    assert!(app.stripe.refunds().is_empty());
    let mut conn = app.pool.get().await.unwrap();
    let open: i64 = reconciliation_findings::table
        .filter(reconciliation_findings::resolved_at.is_null())
        .count()
        .get_result(&mut conn)
        .await
        .unwrap();
    assert_eq!(open, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refunded_key_is_final_and_a_retry_never_records_the_refunded_charge() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (key, pi) = unrecorded_charge(&app, &user).await;
    let summary = pass(&app, true).await;
    assert_eq!((summary.findings, summary.refunded), (1, 1), "{summary:?}");
    let refunds = app.stripe.refunds();
    assert_eq!(refunds.len(), 1);
    assert_eq!(refunds[0].payment_intent, pi);

    // The key was finished in the refund's transaction, with the refunded outcome.
    let row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(row.recovery_point, schema::RecoveryPoint::Finished);
    assert_eq!(
        row.response_body.as_ref().unwrap()["outcome"],
        "payment_refunded"
    );
    assert_eq!(
        row.response_body.as_ref().unwrap()["refund_id"],
        refunds[0].id
    );

    // The rider's retry with the same key: the provider would hand the same (now refunded)
    // PaymentIntent back; the key replays PAYMENT_REFUNDED instead, every time.
    for _ in 0..2 {
        assert_retry_replays_payment_refunded(&app, &user, &key).await;
    }
    assert!(app.rides().await[0].stripe_charge_id.is_none(), "not paid");
    assert!(app.staged_jobs().await.is_empty(), "no receipt");
    assert_eq!(app.stripe.create_calls(), 1, "never charged again");

    // Later passes see the charge again: recorded once, resolved, never refunded twice.
    let summary = pass(&app, true).await;
    assert_eq!(
        (summary.new_findings, summary.refunded),
        (0, 0),
        "{summary:?}"
    );
    assert_eq!(app.stripe.refunds().len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refunded_charge_a_ride_still_counts_as_paid_is_reported() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (ride_id, charge_id) = charged_ride(&app, &user).await;
    charged_ride(&app, &user).await;
    refund_directly(&app, &charge_id, "dashboard-refund", &[("amount", "500")]).await;
    let summary = pass(&app, true).await;
    assert_eq!((summary.matched, summary.findings), (1, 1), "{summary:?}");
    assert_eq!(summary.refunded, 0);
    let found = findings_of(&app).await;
    assert_eq!(kinds(&found), [FindingKind::RefundedCharge]);
    assert_eq!(found[0].payment_intent_id, charge_id);
    assert_eq!(found[0].ride_id, Some(ride_id));
    assert_eq!(app.stripe.refunds().len(), 1, "nothing more refunded");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_finding_an_older_rule_recorded_is_refunded_only_if_proven_ours_now() {
    let app = TestApp::spawn().await;
    // An older reconciler trusted any of our metadata keys: its open finding names another
    // product's charge.
    let theirs = charge_directly(&app, &[("metadata[ride_id]", "424242")]).await;
    sql(
        &app,
        &format!(
            "INSERT INTO reconciliation_findings (kind, payment_intent_id, ride_id, \
             provider_amount, provider_currency, provider_status) \
             VALUES ('unrecorded_charge', '{}', 424242, 2000, 'usd', 'succeeded')",
            theirs["id"].as_str().unwrap()
        ),
    )
    .await;
    let id = findings_of(&app).await[0].id;
    let stripe = provider::StripeClient::new(&config(&app).stripe).unwrap();
    for mode in [Mode::DryRun, Mode::Apply] {
        let refused = refund_finding(&app.pool, &stripe, id, mode, &operator()).await;
        assert!(
            matches!(&refused, Err(AdminError::Refused(why)) if why.contains("not provably ours")),
            "{refused:?}"
        );
    }
    let summary = reconciler(&app).run_once(true).await.unwrap();
    assert_eq!((summary.refunded, summary.refunds_failed), (0, 1));
    assert!(app.stripe.refunds().is_empty());
    assert!(findings_of(&app).await[0].resolved_at.is_none());
}

#[derive(Debug, PartialEq, diesel::QueryableByName)]
struct AuditRow {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    finding_id: i64,
    #[diesel(sql_type = diesel::sql_types::Text)]
    payment_intent_id: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    refund_id: String,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    amount: i64,
    #[diesel(sql_type = diesel::sql_types::Text)]
    reason: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    requested_by: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    deployment_id: String,
}

async fn audits(app: &TestApp) -> Vec<AuditRow> {
    let mut conn = app.pool.get().await.unwrap();
    diesel::sql_query(
        "SELECT finding_id, payment_intent_id, refund_id, amount, reason, requested_by, \
         deployment_id FROM refund_audits ORDER BY id",
    )
    .load(&mut conn)
    .await
    .unwrap()
}

/// Every refund's recording fails after the provider has made the refund, as a lost commit would.
async fn lose_refund_recordings(app: &TestApp) {
    sql(
        app,
        "CREATE FUNCTION lose_the_audit() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN RAISE EXCEPTION 'the recording was lost'; END $$",
    )
    .await;
    sql(
        app,
        "CREATE TRIGGER lose_the_audit BEFORE INSERT ON refund_audits \
         FOR EACH ROW EXECUTE FUNCTION lose_the_audit()",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_retry_after_a_refund_whose_recording_was_lost_never_records_the_refunded_charge() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (key, pi) = unrecorded_charge(&app, &user).await;
    pass(&app, false).await;
    lose_refund_recordings(&app).await;
    let summary = reconciler(&app).run_once(true).await.unwrap();
    assert_eq!(summary.refunds_failed, 1, "{summary:?}");
    let refunds = app.stripe.refunds();
    assert_eq!(refunds.len(), 1);
    assert_eq!(refunds[0].payment_intent, pi);
    // The key's tombstone was in the lost commit: it is still resumable.
    let row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(row.recovery_point, schema::RecoveryPoint::RideCreated);

    // The rider's retry resumes it; the provider replays the refunded PaymentIntent, which is
    // not recorded as the ride's payment: the key is finished as refunded instead.
    for _ in 0..2 {
        assert_retry_replays_payment_refunded(&app, &user, &key).await;
    }
    let row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(row.recovery_point, schema::RecoveryPoint::Finished);
    assert_eq!(
        row.response_body.as_ref().unwrap()["refund_id"],
        refunds[0].id
    );
    assert!(app.rides().await[0].stripe_charge_id.is_none(), "not paid");
    assert!(app.staged_jobs().await.is_empty(), "no receipt");
    assert_eq!(app.stripe.payment_intents().len(), 1, "never charged again");
    assert_eq!(app.stripe.refunds().len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refund_whose_recording_failed_still_counts_against_the_pass_caps() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    for _ in 0..3 {
        unrecorded_charge(&app, &user).await;
    }
    pass(&app, false).await;
    assert_eq!(findings_of(&app).await.len(), 3);
    lose_refund_recordings(&app).await;
    let mut capped = config(&app);
    capped.refund_max_findings = 1;
    let summary = Reconciler::new(app.pool.clone(), capped)
        .unwrap()
        .run_once(true)
        .await
        .unwrap();
    assert_eq!(app.stripe.refunds().len(), 1, "{summary:?}");
    assert_eq!(
        (
            summary.refunded,
            summary.refunds_failed,
            summary.refunds_deferred
        ),
        (0, 1, 2),
        "{summary:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn refunds_stop_at_the_pass_caps_and_the_rest_wait_for_an_operator_or_the_next_pass() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    for _ in 0..4 {
        unrecorded_charge(&app, &user).await;
    }
    pass(&app, false).await;
    assert_eq!(findings_of(&app).await.len(), 4);
    // Two findings per pass, and 5000 in total: the third 2000 would pass the amount cap too.
    let capped = |max_findings: u32, max_amount: i64| {
        let mut config = config(&app);
        config.refund_max_findings = max_findings;
        config.refund_max_amount = max_amount;
        Reconciler::new(app.pool.clone(), config).unwrap()
    };
    let summary = capped(2, 100_000).run_once(true).await.unwrap();
    assert_eq!(
        (summary.refunded, summary.refunds_deferred),
        (2, 2),
        "{summary:?}"
    );
    assert_eq!(app.stripe.refunds().len(), 2);
    let summary = capped(10, 3000).run_once(true).await.unwrap();
    assert_eq!(
        (summary.refunded, summary.refunds_deferred),
        (1, 1),
        "{summary:?}"
    );
    assert_eq!(app.stripe.refunds().len(), 3);

    // The last one, approved by a person: not subject to the pass's caps.
    let open = findings::list(&app.pool, false, 10).await.unwrap();
    assert_eq!(open.total, 1);
    let stripe = provider::StripeClient::new(&config(&app).stripe).unwrap();
    refund_finding(
        &app.pool,
        &stripe,
        open.findings[0].id,
        Mode::Apply,
        &operator(),
    )
    .await
    .unwrap();
    assert_eq!(app.stripe.refunds().len(), 4);

    // Every refund audited, once, with who asked.
    let audits = audits(&app).await;
    assert_eq!(audits.len(), 4);
    let by: Vec<&str> = audits.iter().map(|a| a.requested_by.as_str()).collect();
    assert_eq!(
        by,
        [
            "reconciler --refund",
            "reconciler --refund",
            "reconciler --refund",
            "operator:alice"
        ]
    );
    for (audit, refund) in audits.iter().zip(app.stripe.refunds()) {
        assert_eq!(audit.refund_id, refund.id);
        assert_eq!(audit.payment_intent_id, refund.payment_intent);
        assert_eq!(audit.amount, refund.amount);
        assert_eq!(audit.deployment_id, "dev");
        assert!(
            audit.reason.starts_with("unrecorded_charge: "),
            "{}",
            audit.reason
        );
        let finding = findings_of(&app)
            .await
            .into_iter()
            .find(|f| f.id == audit.finding_id)
            .unwrap();
        assert_eq!(finding.refund_id.as_deref(), Some(refund.id.as_str()));
    }
    assert!(RefundRequester::operator(" ").is_err());
    assert!(RefundRequester::operator(&"x".repeat(101)).is_err());
}

#[tokio::test(flavor = "multi_thread")]
async fn an_over_long_refund_id_is_recorded_cut_to_fit_with_a_finding_of_its_own() {
    let stripe = fake_stripe::Config {
        refund_id_len: 300,
        ..fake_stripe::Config::default()
    };
    let app = TestApp::spawn_with(stripe, &[]).await;
    let user = app.create_user(GOOD_CARD).await;
    let (key, pi) = unrecorded_charge(&app, &user).await;
    let summary = pass(&app, true).await;
    assert_eq!(
        (summary.refunded, summary.refunds_failed),
        (1, 0),
        "the pass records the refund instead of failing on it: {summary:?}"
    );
    let refunds = app.stripe.refunds();
    assert_eq!(refunds.len(), 1);
    let full = &refunds[0].id;
    assert_eq!(full.chars().count(), 303);

    let found = findings_of(&app).await;
    assert_eq!(
        kinds(&found),
        [FindingKind::UnrecordedCharge, FindingKind::OversizedValue]
    );
    let cut = found[0].refund_id.clone().unwrap();
    assert!(cut.chars().count() <= 255, "{cut}");
    assert!(cut.ends_with("…(303 chars)"), "{cut}");
    assert!(full.starts_with(cut.trim_end_matches("…(303 chars)")));
    assert!(found[0].resolved_at.is_some());
    assert_eq!(found[1].payment_intent_id, pi);
    assert!(found[1].resolved_at.is_none(), "for a person to look up");

    // Audited, and the key is final: a retry never records the refunded charge.
    let audit = audits(&app).await;
    assert_eq!(audit.len(), 1);
    assert_eq!(audit[0].refund_id, cut);
    assert_retry_replays_payment_refunded(&app, &user, &key).await;
    assert!(app.rides().await[0].stripe_charge_id.is_none());

    // Later passes neither refund again nor fail.
    let summary = pass(&app, true).await;
    assert_eq!((summary.refunded, summary.refunds_failed), (0, 0));
    assert_eq!(app.stripe.refunds().len(), 1);
}

/// A rider's retry that holds the key's lock while the refund is made (the completer gave the key
/// up, so the refund goes ahead): the refund clears the lock, and the attempt's next phase records
/// nothing, though the provider hands it the refunded PaymentIntent back.
#[tokio::test(flavor = "multi_thread")]
async fn an_attempt_holding_the_key_when_its_charge_is_refunded_records_nothing() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (key, _) = unrecorded_charge(&app, &user).await;
    let params = api_server::rides::RideParams::new(
        Some(37.7749),
        Some(-122.4194),
        Some(37.3382),
        Some(-121.8863),
    )
    .unwrap();
    let mut lease = app.claim(&user, &key, &params).await;
    assert_eq!(lease.recovery_point, schema::RecoveryPoint::RideCreated);
    let summary = pass(&app, true).await;
    assert_eq!(summary.refunded, 1, "{summary:?}");

    let request = app.rides_request(&user, params).await;
    let step = app.rides.step(&mut lease, &request).await;
    assert!(
        matches!(step, Err(api_server::rides::CreateRideError::LockLost)),
        "{step:?}"
    );
    assert!(app.rides().await[0].stripe_charge_id.is_none(), "not paid");
    assert!(app.staged_jobs().await.is_empty(), "no receipt");
    let row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(
        row.response_body.as_ref().unwrap()["outcome"],
        "payment_refunded"
    );
}

/// The refund caps count the finding's amount: a PaymentIntent whose amount is not the finding's
/// any more is not refunded.
#[tokio::test(flavor = "multi_thread")]
async fn a_charge_whose_amount_is_no_longer_the_findings_is_not_refunded() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    unrecorded_charge(&app, &user).await;
    pass(&app, false).await;
    let finding = findings_of(&app).await.remove(0);
    sql(
        &app,
        &format!(
            "UPDATE reconciliation_findings SET provider_amount = 500 WHERE id = {}",
            finding.id
        ),
    )
    .await;
    let stripe = provider::StripeClient::new(&config(&app).stripe).unwrap();
    let refused = refund_finding(&app.pool, &stripe, finding.id, Mode::Apply, &operator()).await;
    match refused {
        Err(AdminError::Refused(message)) => assert!(message.contains("is of 2000"), "{message}"),
        other => panic!("{other:?}"),
    }
    let summary = pass(&app, true).await;
    assert_eq!((summary.refunded, summary.refunds_failed), (0, 1));
    assert!(app.stripe.refunds().is_empty());
    assert!(audits(&app).await.is_empty());
}
