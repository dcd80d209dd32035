//! What a pass finds: nothing on a clean ledger or one compared in slices, a pending charge that
//! becomes unrecorded, another product's look-alikes left alone, an unknown ride, each mismatch
//! kind, a second pass that skips, and the admin commands that list, show and resolve findings.

use std::time::Duration;

use api_server::testing::{GOOD_CARD, TestApp, new_key, ride_request};
use diesel::{ExpressionMethods, QueryDsl};
use diesel_async::RunQueryDsl;
use fake_stripe::FaultMode;
use schema::{
    FindingKind,
    schema::{reconciler_watermarks, reconciliation_findings},
};
use workers::{
    admin::{AdminError, Mode, findings},
    config::ReconcilerConfig,
    reconciler::{Reconciler, refund::refund_finding},
};

use super::{
    charge_directly, charged_ride, config, findings_of, kinds, operator, pass, reconciler, sql,
    unrecorded_charge,
};

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
