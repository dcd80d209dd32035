//! The lock rule against real holders: a lock is taken over at its timeout, or at once when its
//! young key's holder is gone, and a live holder's key is left alone.

use std::time::Duration;

use api_server::testing::{GOOD_CARD, TestApp, new_key};
use diesel_async::RunQueryDsl;
use schema::RecoveryPoint;
use workers::completer::Completer;

use super::{config, params, point};

/// The completer and the reaper pick keys with `contract::lock_is_free_sql!`; the api-server's
/// claim and `workers admin` decide with `contract::key::lock_is_live`. The two must be exact
/// negations, at the cut-off itself too (once they disagreed there: the SQL kept a lock the
/// Rust rule had let go).
#[tokio::test(flavor = "multi_thread")]
async fn the_lock_rule_takes_a_lock_over_at_the_timeout_or_at_once_when_its_young_keys_holder_is_gone()
 {
    use contract::key::{LockRule, LockState};
    #[derive(diesel::QueryableByName)]
    struct Judged {
        #[diesel(sql_type = diesel::sql_types::Text)]
        state: String,
    }
    let db = schema::testing::TestDatabase::new().await;
    let mut conn = db.connect().await;
    let rule = LockRule::new(Duration::from_secs(90), Duration::from_secs(86_400));
    let (timeout, takeover) = rule.secs();
    // A lock `offset` µs from the timeout's cut-off, named by `holder`, on a key `age` s old.
    let mut judge = async |offset_micros: i64, holder: Option<i64>, age_secs: f64| {
        let judged: Judged = diesel::sql_query(concat!(
            "SELECT ",
            contract::lock_state_sql!("$1", "$2"),
            " AS state FROM (SELECT now() - make_interval(secs => $1) \
             + $3 * interval '1 microsecond' AS locked_at, $4::int8 AS lock_holder, \
             now() - make_interval(secs => $5) AS created_at) AS k"
        ))
        .bind::<diesel::sql_types::Double, _>(timeout)
        .bind::<diesel::sql_types::Double, _>(takeover)
        .bind::<diesel::sql_types::BigInt, _>(offset_micros)
        .bind::<diesel::sql_types::Nullable<diesel::sql_types::BigInt>, _>(holder)
        .bind::<diesel::sql_types::Double, _>(age_secs)
        .get_result(&mut conn)
        .await
        .unwrap();
        LockState::parse(&judged.state)
    };
    // By the timeout alone: at exactly the cut-off a lock is taken over.
    for offset in [-1_000_000_i64, -1, 0] {
        assert_eq!(
            judge(offset, None, 1.0).await,
            LockState::Expired,
            "{offset} µs"
        );
    }
    for offset in [1_i64, 1_000_000] {
        assert_eq!(
            judge(offset, None, 1.0).await,
            LockState::Live,
            "{offset} µs"
        );
    }
    // A holder whose session stands keeps its lock; once the session ends, a young key's lock
    // is taken over at once, an old key's (beyond the provider key margin) only at the timeout.
    let holder = 4_242_424_242_i64;
    let mut session = db.connect().await;
    diesel::sql_query("SELECT pg_advisory_lock($1)")
        .bind::<diesel::sql_types::BigInt, _>(holder)
        .execute(&mut session)
        .await
        .unwrap();
    assert_eq!(judge(1_000_000, Some(holder), 1.0).await, LockState::Live);
    drop(session);
    let mut gone = LockState::Live;
    for _ in 0..100 {
        gone = judge(1_000_000, Some(holder), 1.0).await;
        if gone != LockState::Live {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(gone, LockState::HolderGone);
    assert_eq!(
        judge(1_000_000, Some(holder), takeover + 1.0).await,
        LockState::Live,
        "a key beyond the provider key margin waits for the timeout"
    );
    assert_eq!(
        judge(0, Some(holder), takeover + 1.0).await,
        LockState::Expired
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn takes_over_a_key_whose_holder_is_gone_at_once_and_leaves_a_live_holders_key() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    // Two fresh keys locked mid-request (younger than COMPLETER_MIN_AGE_SECS, just run), one
    // by a holder whose liveness session then ends (a killed api-server), one by a holder
    // whose session stands.
    let (gone_key, live_key) = (new_key(), new_key());
    let gone = app.claim(&user, &gone_key, &params()).await;
    let live = app.claim(&user, &live_key, &params()).await;
    let mut gone_session = app.db.connect().await;
    let mut live_session = app.db.connect().await;
    for (conn, holder, key_id) in [
        (&mut gone_session, 7_000_000_001_i64, gone.key_id),
        (&mut live_session, 7_000_000_002_i64, live.key_id),
    ] {
        diesel::sql_query("SELECT pg_advisory_lock($1)")
            .bind::<diesel::sql_types::BigInt, _>(holder)
            .execute(&mut *conn)
            .await
            .unwrap();
        diesel::sql_query("UPDATE idempotency_keys SET lock_holder = $1 WHERE id = $2")
            .bind::<diesel::sql_types::BigInt, _>(holder)
            .bind::<diesel::sql_types::BigInt, _>(key_id)
            .execute(&mut app.pool.get().await.unwrap())
            .await
            .unwrap();
    }
    drop(gone_session);

    let completer = Completer::new(app.pool.clone(), config(&app)).unwrap();
    let mut summary = completer.run_once().await.unwrap();
    for _ in 0..100 {
        // The server notices a closed session at once; give it a moment all the same.
        if summary.claimed > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        summary = completer.run_once().await.unwrap();
    }
    assert_eq!(
        summary.claimed, 1,
        "only the dead holder's key: {summary:?}"
    );
    assert_eq!(summary.completed, 1, "{summary:?}");
    assert_eq!(point(&app, &user, &gone_key).await, RecoveryPoint::Finished);
    assert_eq!(
        point(&app, &user, &live_key).await,
        RecoveryPoint::RideCreated
    );
    assert_eq!(app.stripe.succeeded_charges(), 1);
    drop(live_session);
}
