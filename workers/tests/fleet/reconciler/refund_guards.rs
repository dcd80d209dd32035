//! What keeps a refund safe when something goes wrong around it: a lost or failed recording,
//! the pass caps, an over-long refund id, an attempt still holding the key, and an amount that
//! is no longer the finding's. Each refund is audited; the audit rows are read here.

use api_server::testing::{GOOD_CARD, TestApp};
use diesel_async::RunQueryDsl;
use schema::FindingKind;
use workers::{
    admin::{AdminError, Mode, findings},
    reconciler::{
        Reconciler,
        refund::{RefundRequester, refund_finding},
    },
};

use super::{
    assert_retry_answers, assert_retry_replays_payment_refunded, config, findings_of, kinds,
    operator, pass, reconciler, sql, unrecorded_charge,
};

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
async fn a_retry_that_cannot_read_whether_its_charge_was_refunded_writes_nothing_and_may_retry() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (key, _) = unrecorded_charge(&app, &user).await;
    pass(&app, false).await;
    lose_refund_recordings(&app).await;
    reconciler(&app).run_once(true).await.unwrap();
    assert_eq!(app.stripe.refunds().len(), 1);

    // The provider replays the refunded charge, then fails the read of its refunds.
    app.stripe.fail_retrieves(1);
    assert_retry_answers(
        &app,
        &user,
        &key,
        tonic::Code::Unavailable,
        api_server::grpc::reason::PAYMENT_PROVIDER_UNAVAILABLE,
    )
    .await;
    let row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(row.recovery_point, schema::RecoveryPoint::RideCreated);
    assert!(row.locked_at.is_none(), "released for the retry");
    assert!(app.rides().await[0].stripe_charge_id.is_none(), "not paid");
    assert!(app.staged_jobs().await.is_empty(), "no receipt");

    assert_retry_replays_payment_refunded(&app, &user, &key).await;
    assert_eq!(app.stripe.payment_intents().len(), 1, "never charged again");
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
