//! A claim's read alone (`Rides::begin`, for a key its caller says it resent) writes nothing,
//! whatever it finds, even in a batch with claims that write: it runs in the caller's request,
//! where a hang-up may cut it short, so a key it wrote would be left locked by a token nobody
//! holds.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use api_server::{
    auth::{Caller, token_digest},
    grpc::reason,
    idempotency::IdempotencyKey,
    rides::{Begun, RideParams},
    testing::*,
};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use futures_util::future::join_all;
use proto::v1::CreateRideResponse;
use schema::RecoveryPoint;
use tonic::{Code, Response, Status};

#[tokio::test(flavor = "multi_thread")]
async fn a_read_that_finds_no_key_writes_nothing_beside_claims_that_write() {
    const EACH: usize = 16;
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let caller = Caller::Token(token_digest(&user.token));
    let params = RideParams::try_from(ride_request()).unwrap();
    let origin = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let keys: Vec<IdempotencyKey> = (0..EACH)
        .map(|_| IdempotencyKey::parse(&new_key()).unwrap())
        .collect();
    let reads = keys
        .iter()
        .map(|key| app.rides.begin(caller, key, true, params, origin));
    let written_keys: Vec<String> = (0..EACH).map(|_| new_key()).collect();
    let writes = written_keys
        .iter()
        .map(|key| app.create_ride(&user, key, ride_request()));

    let (read, written) = tokio::join!(join_all(reads), join_all(writes));

    for begun in read {
        assert!(
            matches!(begun, Begun::Attempt(_)),
            "a key not found needs an attempt that writes: {begun:?}"
        );
    }
    for created in written {
        created.unwrap();
    }
    assert_eq!(
        app.key_count().await,
        EACH as i64,
        "the writing claims' keys only"
    );
    assert_eq!(app.rides().await.len(), EACH);
    let sent = app.claim_statements_sent();
    assert!(sent.reads >= 1, "{sent:?}");
}

/// A resent key whose read fails (the database connection lost mid-statement: here the backend
/// the read waits on is terminated, and so is its redo's) is answered UNAVAILABLE, which a caller
/// retries, and leaves the key as the read found it: unfinished, unlocked, uncharged. The retry
/// once the database answers again finishes the key with one charge.
#[tokio::test(flavor = "multi_thread")]
async fn a_resent_key_whose_read_fails_is_answered_unavailable_and_left_as_it_was() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    app.fail_at_the_provider(&user, &key).await;
    let sent_before = app.claim_statements_sent();

    let mut locker = app.db.lock_table("idempotency_keys").await;
    let failed = while_terminating_key_readers(&app, resend(&app, &user, &key)).await;
    diesel::sql_query("COMMIT")
        .execute(&mut locker)
        .await
        .unwrap();

    let status = failed.unwrap_err();
    assert_status(&status, Code::Unavailable, reason::DATABASE_UNAVAILABLE);
    let sent = app.claim_statements_sent();
    assert_eq!(sent.writes, sent_before.writes, "{sent:?}");
    assert!(
        sent.reads > sent_before.reads,
        "the read was sent: {sent:?}"
    );
    let row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(row.recovery_point, RecoveryPoint::RideCreated);
    assert_eq!((row.locked_at, row.lock_token), (None, None), "{row:?}");
    assert_eq!(app.stripe.succeeded_charges(), 0);

    let resumed = resend(&app, &user, &key).await.unwrap();
    assert!(!replayed(&resumed), "the retry finished the key");
    assert_eq!(app.stripe.succeeded_charges(), 1);
    assert_eq!(app.rides().await.len(), 1);
    let row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(row.recovery_point, RecoveryPoint::Finished);
}

/// `key` sent again over gRPC, saying it is resent, as `rides_client::RidesClient::resume_ride`
/// does (that client would retry the UNAVAILABLE itself).
async fn resend(
    app: &TestApp,
    user: &TestUser,
    key: &str,
) -> Result<Response<CreateRideResponse>, Status> {
    let mut request = authed(&user.token, Some(key), ride_request());
    request.metadata_mut().insert(
        proto::metadata::IDEMPOTENCY_KEY_RESENT,
        "true".parse().unwrap(),
    );
    app.client().await.create_ride(request).await
}

/// Awaits `call`, meanwhile terminating every backend of the test's database that waits on a
/// lock (only the claim statements touch the locked table), as a failover ends the connections
/// of the old primary.
async fn while_terminating_key_readers<T>(app: &TestApp, call: impl Future<Output = T>) -> T {
    let mut admin = AsyncPgConnection::establish(app.db.url()).await.unwrap();
    let mut call = std::pin::pin!(call);
    loop {
        tokio::select! {
            answer = &mut call => return answer,
            () = tokio::time::sleep(Duration::from_millis(50)) => {
                diesel::sql_query(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE datname = current_database() AND wait_event_type = 'Lock'",
                )
                .execute(&mut admin)
                .await
                .unwrap();
            }
        }
    }
}
