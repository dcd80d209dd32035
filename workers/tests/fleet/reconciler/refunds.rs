//! Refunds: made once however often asked for and never by default, an earlier refund recorded
//! only if it names the finding, refused for a recorded ride or a live key, final for the key,
//! and a finding an older rule recorded refunded only if proven ours now.

use api_server::testing::{GOOD_CARD, TestApp, new_key, ride_request};
use fake_stripe::FaultMode;
use schema::FindingKind;
use workers::{
    admin::{AdminError, Mode},
    reconciler::refund::refund_finding,
};

use super::{
    assert_retry_replays_payment_refunded, charge_directly, charged_ride, config, findings_of,
    kinds, operator, pass, reconciler, sql, unrecorded_charge,
};

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
