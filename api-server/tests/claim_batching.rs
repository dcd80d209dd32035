//! Claims that share one statement (`idempotency::Claims`) decide exactly what
//! claims made one at a time decide: each claim gets its own answer, two claims of one new key
//! cannot both win, and nothing is written for an unknown token. Every claim carries its first
//! ride, which is inserted with its key only if the claim inserts the key.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use api_server::idempotency::Locking;
use contract::key::LockRule;
use schema::liveness::Liveness;
use std::{sync::Arc, time::Duration};

use api_server::{
    auth::{self, Caller},
    grpc::reason,
    idempotency::{
        self, Batcher, Batching, ClaimStatementsSent, Claims, Decision, IdempotencyKey,
        RequestSignature, Unlock,
    },
    rides::{FirstRide, RideClaim, RideParams},
    testing::*,
};
use proto::v1::CreateRideRequest;
use schema::RecoveryPoint;
use tonic::Code;
use uuid::Uuid;

/// No liveness session, the default lock timeout and provider key window.
fn locking() -> Locking {
    Locking {
        liveness: Liveness::absent(),
        rule: LockRule::new(Duration::from_secs(90), Duration::from_secs(86_400)),
    }
}

fn params(request: CreateRideRequest) -> RideParams {
    RideParams::try_from(request).unwrap()
}

/// A first ride for `params`, as CreateRide's claim carries it.
fn first_ride(params: RideParams) -> FirstRide {
    FirstRide {
        origin_lat: params.origin_lat,
        origin_lon: params.origin_lon,
        target_lat: params.target_lat,
        target_lon: params.target_lon,
        amount: 1234,
        currency: "usd".to_owned(),
        origin_ip: "192.0.2.7/32".parse().unwrap(),
        deployment_id: "test".to_owned(),
    }
}

/// Outcomes of one claim, reduced to what the test compares.
#[derive(Debug, PartialEq)]
enum Decided {
    NoSuchUser,
    Execute { user_id: i64 },
    InUse,
    Replay { code: i32 },
    Mismatch,
}

/// One claim of the batch: the caller's token, the key, the request, and what kind of answer it
/// must get ("replay", "mismatch", "new", "shared" or "unknown").
type Claim = (String, String, CreateRideRequest, &'static str);

#[tokio::test(flavor = "multi_thread")]
async fn claims_queued_together_share_a_statement_and_each_get_their_own_answer() {
    let sent = mixed_batch(|_| false).await;
    assert_eq!(sent.reads, 0, "no claim expected its key: {sent:?}");
}

/// The same batch with every claim but the unknown token's saying it resends its key: the
/// claims read first, and those that find no key (the new ones) are written in a statement of
/// their own; every claim decides what it decides without the hint.
#[tokio::test(flavor = "multi_thread")]
async fn resent_claims_read_first_and_decide_what_they_would_without_the_hint() {
    let sent = mixed_batch(|kind| kind != "unknown").await;
    assert!(sent.reads >= 1, "{sent:?}");
    assert!(sent.writes >= 1, "the new keys were inserted: {sent:?}");
}

/// Only replays and a mismatch, each saying it resends its key: decided without a write
/// statement.
#[tokio::test(flavor = "multi_thread")]
async fn resent_keys_that_exist_are_decided_without_a_write_statement() {
    let app = TestApp::spawn().await;
    let alice = app.create_user(GOOD_CARD).await;
    let key = new_key();
    app.create_ride(&alice, &key, ride_request()).await.unwrap();
    let batcher = Arc::new(Batcher::new(
        Claims::new(RideClaim),
        app.db.pool(1),
        Default::default(),
        Batching::default(),
    ));
    let other = CreateRideRequest {
        origin_lat: Some(1.0),
        ..ride_request()
    };
    for (request, wanted) in [
        (ride_request(), Decided::Replay { code: 0 }),
        (other, Decided::Mismatch),
    ] {
        let digest = auth::token_digest(&alice.token);
        let key = IdempotencyKey::parse(&key).unwrap();
        let (signature, first) = (params(request).signature(), first_ride(params(request)));
        let batcher = Arc::clone(&batcher);
        let decided = claim_one(batcher, digest, key, signature, first, true).await;
        assert_eq!(decided, wanted);
    }
    let sent = batcher.statement().sent();
    assert_eq!((sent.reads, sent.writes), (2, 0), "{sent:?}");
}

/// The mixed batch below, each claim saying it resends its key if `resent(kind)`, queued behind a
/// held connection so that the claims share statements; checks every answer and write, and
/// returns what the claims sent.
async fn mixed_batch(resent: impl Fn(&str) -> bool) -> ClaimStatementsSent {
    let app = TestApp::spawn().await;
    let alice = app.create_user(GOOD_CARD).await;
    let bob = app.create_user(GOOD_CARD).await;
    // Finished keys to replay, made the ordinary way.
    let finished: Vec<String> = (0..3).map(|_| new_key()).collect();
    for key in &finished {
        app.create_ride(&alice, key, ride_request()).await.unwrap();
    }
    let rides_before = app.rides().await.len();
    let keys_before = app.key_count().await;
    let shared_new_key = new_key();
    let claims = mixed_claims(&alice, &bob, &finished, &shared_new_key);

    // One batch at a time, on a pool of one connection that the test holds: the first claim's
    // batch waits for that connection while every other claim is submitted (all in the first
    // poll of `join_all`, before anything can complete), so the rest share the second statement.
    let batcher_pool = app.db.pool(1);
    let held = batcher_pool.get_owned().await.unwrap();
    let batcher = Arc::new(Batcher::new(
        Claims::new(RideClaim),
        batcher_pool,
        Default::default(),
        Batching {
            max_size: 64,
            in_flight: 1,
        },
    ));
    let runs = claims.iter().map(|(token, key, request, kind)| {
        let digest = auth::token_digest(token);
        let key = IdempotencyKey::parse(key).unwrap();
        let signature = params(*request).signature();
        let first_ride = first_ride(params(*request));
        let resent = resent(kind);
        claim_one(
            Arc::clone(&batcher),
            digest,
            key,
            signature,
            first_ride,
            resent,
        )
    });
    let mut all = std::pin::pin!(futures_util::future::join_all(runs));
    assert!(
        futures_util::poll!(&mut all).is_pending(),
        "nothing is decided while the batch waits for the connection"
    );
    drop(held);
    let decided = all.await;

    // The runner takes whatever is queued when it wakes: every claim at once, or the first alone
    // and the rest together. Either way the claim that lost its new key to the other claim of it
    // in the same statement gets no row back and looks again, in a statement of its own.
    let counts = batcher.counts();
    assert_eq!(counts.items, claims.len() as u64 + 1, "{counts:?}");
    assert!(
        (2..=3).contains(&counts.statements),
        "the claims shared statements: {counts:?}"
    );
    assert_each_answer(&claims, decided, bob.id);
    // Eight new keys for bob (six, the shared one, alice's key string), and nothing for the
    // unknown token, the replays or the mismatch, though their claims carried first rides too.
    assert_eq!(app.key_count().await, keys_before + 8);
    let shared_row = app.key_row(&bob, &shared_new_key).await.unwrap();
    assert_eq!(shared_row.recovery_point, RecoveryPoint::RideCreated);
    assert!(shared_row.lock_token.is_some());
    assert_new_keys_have_their_rides(&app, &bob, &claims, rides_before).await;
    batcher.statement().sent()
}

/// Replays of alice's finished keys, one mismatch, six new keys for bob, one new key twice,
/// alice's key string for bob, and an unknown token.
fn mixed_claims(
    alice: &TestUser,
    bob: &TestUser,
    finished: &[String],
    shared_new_key: &str,
) -> Vec<Claim> {
    let other_params = CreateRideRequest {
        origin_lat: Some(1.0),
        ..ride_request()
    };
    let mut claims: Vec<Claim> = Vec::new();
    for key in finished {
        claims.push((alice.token.clone(), key.clone(), ride_request(), "replay"));
    }
    claims.push((
        alice.token.clone(),
        finished[0].clone(),
        other_params,
        "mismatch",
    ));
    // Six new keys.
    for _ in 0..6 {
        claims.push((bob.token.clone(), new_key(), ride_request(), "new"));
    }
    // The same new key twice in one batch: one claim inserts it, the other finds it locked.
    for _ in 0..2 {
        claims.push((
            bob.token.clone(),
            shared_new_key.to_owned(),
            ride_request(),
            "shared",
        ));
    }
    // Alice's key string, but for bob: a different key, so a new one.
    claims.push((
        bob.token.clone(),
        finished[1].clone(),
        ride_request(),
        "new",
    ));
    claims.push((
        "rr_no-such-token-0123456789".to_owned(),
        new_key(),
        ride_request(),
        "unknown",
    ));
    claims
}

/// Submits one claim to `batcher` and reduces its outcome to a [`Decided`], checking that a
/// claim that owns its key was born at `ride_created` with its first ride.
async fn claim_one(
    batcher: Arc<Batcher<Claims<RideClaim>>>,
    digest: [u8; 32],
    key: IdempotencyKey,
    signature: RequestSignature,
    first_ride: FirstRide,
    expects_key: bool,
) -> Decided {
    let attempt = idempotency::Attempt {
        token: Uuid::new_v4(),
        expects_key,
    };
    let claimed = idempotency::claim(
        &batcher,
        Caller::Token(digest),
        &key,
        &signature,
        &first_ride,
        &locking(),
        attempt,
    )
    .await
    .unwrap();
    match claimed {
        None => Decided::NoSuchUser,
        Some((user, claimed)) => match claimed.decision {
            Decision::Execute(lease) => {
                assert_eq!(lease.user_id, user.id);
                // Born at `ride_created`: its claim wrote the first ride.
                let ride = claimed.first_phase.expect("the claim's ride");
                assert_eq!(ride.idempotency_key_id, Some(lease.key_id));
                assert_eq!(ride.user_id, user.id);
                assert_eq!(lease.recovery_point, RecoveryPoint::RideCreated);
                Decided::Execute { user_id: user.id }
            }
            Decision::InUse => Decided::InUse,
            Decision::Replay(stored) => Decided::Replay { code: stored.code },
            Decision::Mismatch => Decided::Mismatch,
        },
    }
}

/// Each claim got the answer of its kind, and exactly one of the two claims of the shared new
/// key owns it.
fn assert_each_answer(claims: &[Claim], decided: Vec<Decided>, bob_id: i64) {
    let mut shared = Vec::new();
    for ((_, key, _, kind), decided) in claims.iter().zip(decided) {
        match *kind {
            "replay" => assert_eq!(decided, Decided::Replay { code: 0 }, "{key}"),
            "mismatch" => assert_eq!(decided, Decided::Mismatch),
            "new" => assert_eq!(decided, Decided::Execute { user_id: bob_id }, "{key}"),
            "shared" => shared.push(decided),
            "unknown" => assert_eq!(decided, Decided::NoSuchUser),
            other => unreachable!("{other}"),
        }
    }
    shared.sort_by_key(|decided| matches!(decided, Decided::InUse));
    assert_eq!(
        shared,
        [Decided::Execute { user_id: bob_id }, Decided::InUse],
        "exactly one of two claims of one new key owns it"
    );
}

/// A ride and its audit record for each of the eight new keys: the six, the shared key once,
/// alice's key string; each key at `ride_created` with its ride.
async fn assert_new_keys_have_their_rides(
    app: &TestApp,
    bob: &TestUser,
    claims: &[Claim],
    rides_before: usize,
) {
    let rides = app.rides().await;
    let new_rides: Vec<_> = rides.iter().filter(|r| r.user_id == bob.id).collect();
    assert_eq!(rides.len(), rides_before + 8);
    assert_eq!(new_rides.len(), 8);
    let audits = app.audit_records().await;
    for (_, key, _, kind) in claims {
        if !matches!(*kind, "new" | "shared") {
            continue;
        }
        let row = app.key_row(bob, key).await.unwrap();
        assert_eq!(row.recovery_point, RecoveryPoint::RideCreated, "{key}");
        let ride = new_rides
            .iter()
            .find(|r| r.idempotency_key_id == Some(row.id))
            .expect("the key's ride");
        assert_eq!((ride.amount, ride.currency.as_str()), (1234, "usd"));
        assert!(ride.stripe_charge_id.is_none());
        // The audit record's data is the request's parameters as the key stores them.
        let audit: Vec<_> = audits
            .iter()
            .filter(|a| a.resource_type == "ride" && a.resource_id == ride.id)
            .collect();
        assert_eq!(audit.len(), 1, "{key}: one audit record per ride");
        assert_eq!(audit[0].action, "ride.created");
        assert_eq!(audit[0].data, row.request_params, "{key}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_requests_through_batched_claims_charge_each_key_once() {
    // Few batches in flight, so the requests' claims share statements on the server.
    let app = TestApp::spawn_with(
        fake_stripe::Config::default(),
        &[("CLAIM_BATCHES_IN_FLIGHT", "1")],
    )
    .await;
    let user = app.create_user(GOOD_CARD).await;
    let channel = app.channel().await;
    let keys: Vec<String> = (0..20).map(|_| new_key()).collect();

    // The server's whole pool held while the requests arrive, so that their claims queue behind
    // the first batch and share statements.
    let mut held = Vec::new();
    for _ in 0..app.config.database.pool_size {
        held.push(app.rides.pool().get_owned().await.unwrap());
    }
    // Every key twice at once: one attempt runs it, the other replays it or finds it in use.
    let attempts = keys.iter().chain(&keys).map(|key| {
        let mut client = proto::v1::ride_service_client::RideServiceClient::new(channel.clone());
        let request = authed(&user.token, Some(key), ride_request());
        tokio::spawn(async move { client.create_ride(request).await })
    });
    let attempts: Vec<_> = attempts.collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(held);
    let mut succeeded = 0;
    for result in futures_util::future::join_all(attempts).await {
        match result.unwrap() {
            Ok(_) => succeeded += 1,
            Err(status) => assert_status(&status, Code::Aborted, reason::IDEMPOTENCY_KEY_IN_USE),
        }
    }
    assert!(succeeded >= keys.len(), "every key succeeded at least once");
    let counts = app.rides.claim_batcher().counts();
    assert!(
        counts.items > counts.statements,
        "claims shared statements: {counts:?}"
    );
    assert_eq!(app.rides().await.len(), keys.len());
    assert_eq!(app.stripe.succeeded_charges(), keys.len());
    assert_eq!(app.staged_jobs().await.len(), keys.len());
    // And each key replays its one ride afterwards.
    for key in &keys {
        let replay = app.create_ride(&user, key, ride_request()).await.unwrap();
        assert!(replayed(&replay));
    }
}

/// A claim whose statement committed but whose answer was lost (the primary died after its
/// synchronous standby, now the primary, had the commit) left the key locked by its token. Run
/// again with that token (a batch's redo, a later round) it owns the key; any other attempt is
/// refused while the lock is live; and the attempt that gave up undoes it by its token alone,
/// so a retry need not wait out the lock timeout (HA runs c6f9eaa6 and b78e994a: riders refused
/// `IDEMPOTENCY_KEY_IN_USE` for 45 s and more after a primary kill).
#[tokio::test(flavor = "multi_thread")]
async fn a_claim_whose_answer_was_lost_owns_its_key_by_its_token_and_undoes_it_by_that_token() {
    let app = TestApp::spawn().await;
    let rider = app.create_user(GOOD_CARD).await;
    let key_text = new_key();
    let key = IdempotencyKey::parse(&key_text).unwrap();
    let request = params(ride_request());
    // The claim that committed: the key and its ride, locked by the claim's token.
    let lost = app.claim(&rider, &key_text, &request).await;
    let digest = auth::token_digest(&rider.token);
    let claim_with = |token: Uuid| {
        let first_ride = first_ride(request);
        let key = key.clone();
        let app = &app;
        async move {
            idempotency::claim(
                app.rides.claim_batcher(),
                Caller::Token(digest),
                &key,
                &request.signature(),
                &first_ride,
                &locking(),
                idempotency::Attempt {
                    token,
                    expects_key: false,
                },
            )
            .await
            .unwrap()
            .expect("the rider exists")
            .1
            .decision
        }
    };

    match claim_with(lost.token).await {
        Decision::Execute(lease) => {
            assert_eq!(lease.key_id, lost.key_id);
            assert_eq!(lease.token, lost.token);
            assert_eq!(lease.recovery_point, RecoveryPoint::RideCreated);
        }
        other => panic!("the claim's own lock was not recognised: {other:?}"),
    }
    assert!(matches!(claim_with(Uuid::new_v4()).await, Decision::InUse));

    let policy = Default::default();
    let unlock = |caller: Caller, token: Uuid| Unlock::Claim {
        caller,
        key: key.clone(),
        token,
    };
    // Another token undoes nothing, whoever asks.
    for caller in [Caller::OnBehalfOf(rider.id), Caller::Token(digest)] {
        assert!(
            !unlock(caller, Uuid::new_v4())
                .once(&app.pool, policy)
                .await
                .unwrap()
        );
    }
    let row = app.key_row(&rider, &key_text).await.unwrap();
    assert_eq!(row.lock_token, Some(lost.token));
    // The claim's token does, by the rider's token as the claim was made.
    let by_token = unlock(Caller::Token(digest), lost.token);
    assert!(by_token.once(&app.pool, policy).await.unwrap());
    let row = app.key_row(&rider, &key_text).await.unwrap();
    assert_eq!((row.locked_at, row.lock_token), (None, None));
    // Once only: the unlock is fenced by the token it cleared.
    assert!(!by_token.once(&app.pool, policy).await.unwrap());
    // And the next attempt takes the key over at once, where the lost claim left it.
    match claim_with(Uuid::new_v4()).await {
        Decision::Execute(lease) => {
            assert_eq!(lease.key_id, lost.key_id);
            assert_eq!(lease.recovery_point, RecoveryPoint::RideCreated);
        }
        other => panic!("the unlocked key was not taken over: {other:?}"),
    }
}
