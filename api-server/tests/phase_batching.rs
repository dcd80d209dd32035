//! CreateRide's write phase after the claim (the charge's record, `rides/ride_created.rs`) sent
//! together for several requests decides exactly what the one-request statement decides: each key
//! is finished, or its fence fails and nothing of it is written, while the rest of its batch
//! commits; and a batch that fails is redone request by request.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use api_server::{
    idempotency::{BatchCounts, Lease},
    rides::{CreateRideError, RideParams, RideRequest},
    testing::*,
};
use contract::Outcome;
use diesel::sql_types::BigInt;
use diesel_async::RunQueryDsl;
use schema::{RecoveryPoint, models::Ride};
use tonic::Code;

fn ride_params() -> RideParams {
    RideParams::try_from(ride_request()).unwrap()
}

/// One connection for the server's pool and one batch in flight per phase, so that a test that
/// holds the connection makes every phase it starts meanwhile queue for the same batch.
async fn spawn_one_connection() -> TestApp {
    TestApp::spawn_with(
        fake_stripe::Config::default(),
        &[
            ("DATABASE_POOL_SIZE", "1"),
            ("PHASE_BATCHES_IN_FLIGHT", "1"),
            ("DATABASE_POOL_TIMEOUT_MS", "30000"),
        ],
    )
    .await
}

/// Runs the phase for every lease at once, each given its key's ride as its claim would, while the server's only connection is held: the first phase to be ready takes a
/// batch of its own and waits for the connection, and the others (given a second to make their
/// charges) queue behind it and share the second statement.
async fn step_together(
    app: &TestApp,
    leases: &mut [Lease],
    request: &RideRequest,
) -> Vec<Result<Outcome, CreateRideError>> {
    step_together_beside(app, leases, request, async {}).await
}

/// [`step_together`], running `beside` alongside the phases.
async fn step_together_beside(
    app: &TestApp,
    leases: &mut [Lease],
    request: &RideRequest,
    beside: impl Future<Output = ()>,
) -> Vec<Result<Outcome, CreateRideError>> {
    let rides = app.rides().await;
    let current: Vec<Option<Ride>> = leases
        .iter()
        .map(|lease| {
            rides
                .iter()
                .find(|ride| ride.idempotency_key_id == Some(lease.key_id))
                .cloned()
        })
        .collect();
    let held = app.rides.pool().get_owned().await.unwrap();
    let steps = leases
        .iter_mut()
        .zip(current)
        .map(|(lease, ride)| app.rides.step_with(lease, request, ride));
    let (results, (), ()) = futures_util::future::join3(
        futures_util::future::join_all(steps),
        async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            drop(held);
        },
        beside,
    )
    .await;
    results
}

fn added(after: BatchCounts, before: BatchCounts) -> BatchCounts {
    BatchCounts {
        statements: after.statements - before.statements,
        items: after.items - before.items,
    }
}

/// Leases on `count` fresh keys of `user`, each claimed (at `ride_created`, with its ride) by an
/// attempt about to charge.
async fn claimed_keys(
    app: &TestApp,
    user: &TestUser,
    request: &RideRequest,
    count: usize,
) -> (Vec<String>, Vec<Lease>) {
    let mut claimed = (Vec::new(), Vec::new());
    for _ in 0..count {
        let key = new_key();
        claimed.1.push(app.claim(user, &key, &request.params).await);
        claimed.0.push(key);
    }
    claimed
}

#[tokio::test(flavor = "multi_thread")]
async fn a_key_taken_over_inside_a_batch_writes_nothing_while_the_rest_of_the_batch_commits() {
    let app = spawn_one_connection().await;
    let user = app.create_user(GOOD_CARD).await;
    let request = app.rides_request(&user, ride_params()).await;
    let (keys, mut leases) = claimed_keys(&app, &user, &request, 5).await;
    // Another attempt takes over the key of the third lease.
    app.expire_lock(leases[2].key_id).await;
    let takeover = app.claim(&user, &keys[2], &request.params).await;
    let rides_before = app.rides().await;
    let counts_before = app.rides.phase_batch_counts();

    let results = step_together(&app, &mut leases, &request).await;

    // The first record to be ready takes a batch while the connection is held, and the rest
    // share the next (how many join the first depends on when each one's charge returns).
    let counts = added(app.rides.phase_batch_counts(), counts_before);
    assert!(
        counts.items == 5 && counts.statements <= 2,
        "every record was decided by a shared statement: {counts:?}"
    );
    for (index, result) in results.iter().enumerate() {
        if index == 2 {
            assert!(
                matches!(result, Err(CreateRideError::LockLost)),
                "{result:?}"
            );
        } else {
            assert!(result.is_ok(), "lease {index}: {result:?}");
        }
    }
    let rides = app.rides().await;
    for (index, key) in keys.iter().enumerate() {
        let row = app.key_row(&user, key).await.unwrap();
        let ride = rides
            .iter()
            .find(|ride| ride.idempotency_key_id == Some(row.id));
        if index == 2 {
            assert_eq!(row.recovery_point, RecoveryPoint::RideCreated, "not moved");
            assert_eq!(row.lock_token, Some(takeover.token));
            let ride_before = rides_before
                .iter()
                .find(|ride| ride.idempotency_key_id == Some(row.id));
            assert_eq!(ride, ride_before, "its charge was not recorded");
        } else {
            // The charge's record finishes the key: it never stops at `charge_created`.
            assert_eq!(row.recovery_point, RecoveryPoint::Finished, "key {index}");
            assert!(ride.unwrap().stripe_charge_id.is_some(), "key {index}");
        }
    }
    assert_eq!(
        app.staged_jobs().await.len(),
        4,
        "one receipt per finished key"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_that_fails_is_redone_alone_and_only_the_request_at_fault_fails() {
    use diesel_async::SimpleAsyncConnection;

    let app = spawn_one_connection().await;
    let user = app.create_user(GOOD_CARD).await;
    let request = app.rides_request(&user, ride_params()).await;
    let (keys, mut leases) = claimed_keys(&app, &user, &request, 4).await;
    // Recording the second key's charge fails in the database (a trigger refuses its ride's
    // update), which fails the whole statement it is in.
    let refused_ride = app
        .rides()
        .await
        .into_iter()
        .find(|ride| ride.idempotency_key_id == Some(leases[1].key_id))
        .unwrap()
        .id;
    let mut conn = app.db.connect().await;
    conn.batch_execute(&format!(
        "CREATE FUNCTION refuse_one_ride() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
         IF NEW.id = {refused_ride} THEN RAISE EXCEPTION 'refused by the test'; END IF; \
         RETURN NEW; END $$; \
         CREATE TRIGGER refuse_one_ride BEFORE UPDATE ON rides \
         FOR EACH ROW EXECUTE FUNCTION refuse_one_ride();"
    ))
    .await
    .unwrap();
    let counts_before = app.rides.phase_batch_counts();

    let results = step_together(&app, &mut leases, &request).await;

    assert!(
        matches!(results[1], Err(CreateRideError::Internal(_))),
        "{:?}",
        results[1]
    );
    let row = app.key_row(&user, &keys[1]).await.unwrap();
    assert_eq!(row.recovery_point, RecoveryPoint::RideCreated);
    for index in [0, 2, 3] {
        assert!(results[index].is_ok(), "{index}: {:?}", results[index]);
        let row = app.key_row(&user, &keys[index]).await.unwrap();
        assert_eq!(row.recovery_point, RecoveryPoint::Finished);
    }
    // Which requests share a batch depends on when each one's charge returns; whatever the
    // split, the batch that carried the refused ride decided nothing (its requests were redone
    // alone, which the counts leave out), and a batch without it decided its own. All four may
    // have shared the failed batch (CI saw it: no statement counted at all).
    let counts = added(app.rides.phase_batch_counts(), counts_before);
    assert!(
        counts.items < 4 && (counts.statements == 0) == (counts.items == 0),
        "the failed batch decided nothing: {counts:?}"
    );
    let rides = app.rides().await;
    assert_eq!(rides.len(), 4, "one ride per key, none twice");
    assert_eq!(
        rides
            .iter()
            .filter(|r| r.stripe_charge_id.is_some())
            .count(),
        3
    );
    assert_eq!(app.staged_jobs().await.len(), 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_requests_share_phase_statements_and_each_key_is_charged_once() {
    let app = TestApp::spawn_with(
        fake_stripe::Config {
            latency: Duration::from_millis(20),
            ..Default::default()
        },
        &[
            ("PHASE_BATCHES_IN_FLIGHT", "1"),
            ("CLAIM_BATCHES_IN_FLIGHT", "1"),
        ],
    )
    .await;
    let user = app.create_user(GOOD_CARD).await;
    let channel = app.channel().await;
    let keys: Vec<String> = (0..24).map(|_| new_key()).collect();
    // Every key twice at once: one attempt runs it, the other replays it or finds it in use.
    let attempts: Vec<_> = keys
        .iter()
        .chain(&keys)
        .map(|key| {
            let mut client =
                proto::v1::ride_service_client::RideServiceClient::new(channel.clone());
            let request = authed(&user.token, Some(key), ride_request());
            tokio::spawn(async move { client.create_ride(request).await })
        })
        .collect();
    let mut succeeded = 0;
    for result in futures_util::future::join_all(attempts).await {
        match result.unwrap() {
            Ok(_) => succeeded += 1,
            Err(status) => assert_status(
                &status,
                Code::Aborted,
                api_server::grpc::reason::IDEMPOTENCY_KEY_IN_USE,
            ),
        }
    }
    assert!(succeeded >= keys.len(), "every key succeeded at least once");
    let counts = app.rides.phase_batch_counts();
    // The claim of a fresh key writes its ride (phase `started`), and the charge's record
    // finishes it (`charge_created` in the same statement): one phase statement remains.
    assert_eq!(
        counts.items,
        keys.len() as u64,
        "one phase statement per key after the claim"
    );
    assert!(
        counts.statements < counts.items,
        "phases shared statements: {counts:?}"
    );
    assert_eq!(app.rides().await.len(), keys.len());
    assert_eq!(app.audit_records().await.len(), keys.len());
    assert_eq!(app.stripe.succeeded_charges(), keys.len());
    assert_eq!(app.staged_jobs().await.len(), keys.len());
    for key in &keys {
        let row = app.key_row(&user, key).await.unwrap();
        assert_eq!(row.recovery_point, RecoveryPoint::Finished);
        let replay = app.create_ride(&user, key, ride_request()).await.unwrap();
        assert!(replayed(&replay));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn with_phase_batching_off_every_phase_runs_alone_with_the_same_outcome() {
    let app =
        TestApp::spawn_with(fake_stripe::Config::default(), &[("PHASE_BATCH_SIZE", "1")]).await;
    let user = app.create_user(GOOD_CARD).await;
    let request = app.rides_request(&user, ride_params()).await;
    let (_, mut leases) = claimed_keys(&app, &user, &request, 2).await;
    for lease in &mut leases {
        app.rides.step(lease, &request).await.unwrap();
    }
    // A lease that lost its key is fenced off by the one-request statement too.
    let key = new_key();
    let mut lost = app.claim(&user, &key, &request.params).await;
    app.expire_lock(lost.key_id).await;
    app.claim(&user, &key, &request.params).await;
    assert!(matches!(
        app.rides.step(&mut lost, &request).await,
        Err(CreateRideError::LockLost)
    ));

    assert_eq!(
        app.rides.phase_batch_counts(),
        BatchCounts {
            statements: 0,
            items: 0
        }
    );
    assert_eq!(
        app.rides().await.len(),
        3,
        "the lost lease's claim made a ride too"
    );
    assert_eq!(app.staged_jobs().await.len(), leases.len());
    assert_eq!(
        app.stripe.succeeded_charges(),
        3,
        "the lost lease charged, and recorded nothing"
    );
    let recorded = app.rides().await;
    assert_eq!(
        recorded
            .iter()
            .filter(|r| r.stripe_charge_id.is_some())
            .count(),
        leases.len()
    );
}

/// A batch whose connection dies mid-statement may or may not have committed. Recording a charge
/// (which finishes the key) is safe to redo: a batch that committed finished and unlocked its
/// keys, so a redo fails every fence. So those requests redo their record alone and succeed, each
/// key charged and recorded once.
#[tokio::test(flavor = "multi_thread")]
async fn a_connection_lost_mid_batch_redoes_the_charge_record_alone() {
    use diesel_async::SimpleAsyncConnection;

    let app = spawn_one_connection().await;
    let user = app.create_user(GOOD_CARD).await;
    let request = app.rides_request(&user, ride_params()).await;
    let (keys, mut leases) = claimed_keys(&app, &user, &request, 3).await;
    // The second key's row is locked by another transaction, so the batch that carries the
    // second and third records waits inside its statement until its backend is terminated.
    let mut locker = app.db.connect().await;
    locker.batch_execute("BEGIN").await.unwrap();
    diesel::sql_query("SELECT id FROM idempotency_keys WHERE id = $1 FOR UPDATE")
        .bind::<BigInt, _>(leases[1].key_id)
        .execute(&mut locker)
        .await
        .unwrap();
    let terminate = async {
        let mut watcher = app.db.connect().await;
        #[derive(diesel::QueryableByName)]
        struct Terminated {
            #[diesel(sql_type = diesel::sql_types::Bool)]
            done: bool,
        }
        for _ in 0..1000 {
            let terminated: Vec<Terminated> = diesel::sql_query(
                "SELECT pg_terminate_backend(pid) AS done FROM pg_stat_activity \
                 WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .load(&mut watcher)
            .await
            .unwrap();
            if terminated.iter().any(|t| t.done) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        locker.batch_execute("ROLLBACK").await.unwrap();
    };

    let results = step_together_beside(&app, &mut leases, &request, terminate).await;

    for (index, key) in keys.iter().enumerate() {
        assert!(
            results[index].is_ok(),
            "lease {index}: {:?}",
            results[index]
        );
        let row = app.key_row(&user, key).await.unwrap();
        assert_eq!(row.recovery_point, RecoveryPoint::Finished);
    }
    let rides = app.rides().await;
    assert_eq!(rides.len(), 3, "one ride per key");
    assert!(rides.iter().all(|ride| ride.stripe_charge_id.is_some()));
    assert_eq!(app.stripe.succeeded_charges(), 3, "each key charged once");
    assert_eq!(app.staged_jobs().await.len(), 3, "one receipt per key");
}

/// Every phase's fence names the key's user as well as its id and token (the statements carry
/// `user_id`, as a sharded database needs them to): a lease whose token is right but whose user
/// is another's moves nothing, alone or inside a batch, and the batch's other keys move on.
#[tokio::test(flavor = "multi_thread")]
async fn a_lease_naming_another_users_key_is_fenced_off_alone_and_in_a_batch() {
    let batched = spawn_one_connection().await;
    let alone =
        TestApp::spawn_with(fake_stripe::Config::default(), &[("PHASE_BATCH_SIZE", "1")]).await;
    for app in [&batched, &alone] {
        let user = app.create_user(GOOD_CARD).await;
        let stranger = app.create_user(GOOD_CARD).await;
        let request = app.rides_request(&user, ride_params()).await;
        {
            let point = RecoveryPoint::RideCreated;
            let (keys, mut leases) = claimed_keys(app, &user, &request, 3).await;
            let token = leases[1].token;
            leases[1].user_id = stranger.id;
            let rides_before = app.rides().await;
            let jobs_before = app.staged_jobs().await.len();

            let results = step_together(app, &mut leases, &request).await;

            for (index, result) in results.iter().enumerate() {
                if index == 1 {
                    assert!(
                        matches!(result, Err(CreateRideError::LockLost)),
                        "at {point}: {result:?}"
                    );
                } else {
                    assert!(result.is_ok(), "at {point}, lease {index}: {result:?}");
                }
            }
            let row = app.key_row(&user, &keys[1]).await.unwrap();
            assert_eq!(row.recovery_point, point, "the key did not move");
            assert_eq!(
                row.lock_token,
                Some(token),
                "and is still locked by its token"
            );
            let ride_of = |rides: &[Ride]| {
                rides
                    .iter()
                    .find(|ride| ride.idempotency_key_id == Some(row.id))
                    .cloned()
            };
            assert_eq!(
                ride_of(&app.rides().await),
                ride_of(&rides_before),
                "at {point}: its ride was neither made nor charged"
            );
            assert_eq!(
                app.staged_jobs().await.len() - jobs_before,
                2,
                "at {point}: no receipt for the fenced-off key"
            );
        }
    }
}
