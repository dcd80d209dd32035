//! The shared writes (`contract::writes`) against a real database: each moves only the keys whose
//! fence passes, writes nothing for the others, and one batch decides each key as it would alone.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use contract::{
    BackgroundJob, ReceiptJob, StoredResponse,
    writes::{ChargeRecord, FinishKey, KeyFence, KeyFinish, RecordCharge, ReleaseLock},
};
use diesel::{
    QueryableByName,
    sql_types::{BigInt, Nullable, Text, Uuid as SqlUuid},
};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use schema::{RecoveryPoint, testing::TestDatabase};
use uuid::Uuid;

/// A key at `ride_created` with its ride, locked by a fresh token.
struct Key {
    fence: KeyFence,
    ride_id: i64,
}

#[derive(QueryableByName)]
struct Id {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

async fn user(conn: &mut AsyncPgConnection) -> i64 {
    let row: Id = diesel::sql_query(
        "INSERT INTO users (email, stripe_customer_id, stripe_payment_method_id, \
         api_token_digest) VALUES ('a@example.com', 'cus_1', 'pm_card_visa', \
         sha256(gen_random_uuid()::text::bytea)) RETURNING id",
    )
    .get_result(conn)
    .await
    .unwrap();
    row.id
}

async fn locked_key(conn: &mut AsyncPgConnection, user_id: i64) -> Key {
    let token = Uuid::new_v4();
    let key: Id = diesel::sql_query(
        "INSERT INTO idempotency_keys (user_id, idempotency_key, lock_token, request_method, \
         request_path, request_params, recovery_point, locked_at) VALUES ($1, $2, $3, 'POST', \
         '/rides', '{}', 'ride_created', now()) RETURNING id",
    )
    .bind::<BigInt, _>(user_id)
    .bind::<Text, _>(token.to_string())
    .bind::<SqlUuid, _>(token)
    .get_result(conn)
    .await
    .unwrap();
    let ride: Id = diesel::sql_query(
        "INSERT INTO rides (idempotency_key_id, origin_lat, origin_lon, target_lat, target_lon, \
         amount, currency, user_id) VALUES ($1, 0, 0, 1, 1, 2000, 'usd', $2) RETURNING id",
    )
    .bind::<BigInt, _>(key.id)
    .bind::<BigInt, _>(user_id)
    .get_result(conn)
    .await
    .unwrap();
    Key {
        fence: KeyFence {
            key_id: key.id,
            user_id,
            token,
        },
        ride_id: ride.id,
    }
}

#[derive(QueryableByName, Debug, PartialEq)]
struct KeyState {
    #[diesel(sql_type = Text)]
    recovery_point: String,
    #[diesel(sql_type = Nullable<SqlUuid>)]
    lock_token: Option<Uuid>,
    #[diesel(sql_type = Nullable<Text>)]
    charge: Option<String>,
    #[diesel(sql_type = BigInt)]
    jobs: i64,
}

async fn state(conn: &mut AsyncPgConnection, key: &Key) -> KeyState {
    diesel::sql_query(
        "SELECT k.recovery_point, k.lock_token, r.stripe_charge_id AS charge, \
         (SELECT count(*) FROM staged_jobs WHERE (job_args->>'ride_id')::int8 = r.id) AS jobs \
         FROM idempotency_keys k JOIN rides r ON r.idempotency_key_id = k.id WHERE k.id = $1",
    )
    .bind::<BigInt, _>(key.fence.key_id)
    .get_result(conn)
    .await
    .unwrap()
}

fn record(key: &Key, token: Uuid, charge_id: &str, stage: bool) -> ChargeRecord {
    let job = ReceiptJob {
        ride_id: key.ride_id,
        user_id: key.fence.user_id,
        charge_id: Some(charge_id.to_owned()),
        amount: 2000,
        currency: "usd".into(),
        created_at: chrono::Utc::now(),
    };
    ChargeRecord {
        fence: KeyFence { token, ..key.fence },
        from: RecoveryPoint::RideCreated,
        ride_id: key.ride_id,
        charge_id: charge_id.to_owned(),
        receipt: stage.then(|| job.staged()),
        outcome: StoredResponse {
            code: 0,
            body: serde_json::json!({"charged": charge_id}).into(),
        },
    }
}

#[tokio::test]
async fn a_batch_records_the_charges_whose_fence_passes_and_nothing_of_the_others() {
    let db = TestDatabase::new().await;
    let mut conn = db.connect().await;
    let user_id = user(&mut conn).await;
    let (held, taken_over, already_staged) = (
        locked_key(&mut conn, user_id).await,
        locked_key(&mut conn, user_id).await,
        locked_key(&mut conn, user_id).await,
    );
    let moved = RecordCharge::run(
        &mut conn,
        &[
            record(&held, held.fence.token, "pi_held", true),
            // Its lock was taken over: this holder's token is not the key's any more.
            record(&taken_over, Uuid::new_v4(), "pi_taken", true),
            record(
                &already_staged,
                already_staged.fence.token,
                "pi_staged",
                false,
            ),
        ],
    )
    .await
    .unwrap();
    assert_eq!(moved, [true, false, true]);
    let finished = |charge: &str, jobs| KeyState {
        recovery_point: "finished".into(),
        lock_token: None,
        charge: Some(charge.into()),
        jobs,
    };
    assert_eq!(state(&mut conn, &held).await, finished("pi_held", 1));
    assert_eq!(
        state(&mut conn, &already_staged).await,
        finished("pi_staged", 0)
    );
    assert_eq!(
        state(&mut conn, &taken_over).await,
        KeyState {
            recovery_point: "ride_created".into(),
            lock_token: Some(taken_over.fence.token),
            charge: None,
            jobs: 0
        }
    );
    // Run again, the batch finds every key finished and unlocked: nothing is written twice.
    let again = RecordCharge::run(
        &mut conn,
        &[record(&held, held.fence.token, "pi_held", true)],
    )
    .await
    .unwrap();
    assert_eq!(again, [false]);
    assert_eq!(state(&mut conn, &held).await, finished("pi_held", 1));
}

#[tokio::test]
async fn a_charge_is_never_recorded_over_another_or_from_the_wrong_recovery_point() {
    let db = TestDatabase::new().await;
    let mut conn = db.connect().await;
    let user_id = user(&mut conn).await;
    let key = locked_key(&mut conn, user_id).await;
    diesel::sql_query("UPDATE rides SET stripe_charge_id = 'pi_first' WHERE id = $1")
        .bind::<BigInt, _>(key.ride_id)
        .execute(&mut conn)
        .await
        .unwrap();
    let other = record(&key, key.fence.token, "pi_second", true);
    assert_eq!(
        RecordCharge::run(&mut conn, &[other]).await.unwrap(),
        [false]
    );
    let mut ahead = record(&key, key.fence.token, "pi_first", true);
    ahead.from = RecoveryPoint::ChargeCreated;
    assert_eq!(
        RecordCharge::run(&mut conn, &[ahead]).await.unwrap(),
        [false]
    );
    let state_now = state(&mut conn, &key).await;
    assert_eq!(state_now.recovery_point, "ride_created");
    assert_eq!(
        (state_now.charge.as_deref(), state_now.jobs),
        (Some("pi_first"), 0)
    );
    // The same charge again, from where the key stands, is recorded.
    let same = record(&key, key.fence.token, "pi_first", true);
    assert_eq!(RecordCharge::run(&mut conn, &[same]).await.unwrap(), [true]);
}

#[tokio::test]
async fn finish_and_release_move_only_a_key_their_token_holds() {
    let db = TestDatabase::new().await;
    let mut conn = db.connect().await;
    let user_id = user(&mut conn).await;
    let (declined, released) = (
        locked_key(&mut conn, user_id).await,
        locked_key(&mut conn, user_id).await,
    );
    let outcome = StoredResponse {
        code: 9,
        body: serde_json::json!({"declined": true}).into(),
    };
    let stranger = KeyFence {
        token: Uuid::new_v4(),
        ..declined.fence
    };
    let finishes = [
        KeyFinish {
            fence: stranger,
            outcome: outcome.clone(),
        },
        KeyFinish {
            fence: declined.fence,
            outcome,
        },
    ];
    // The first element's key is the second's: the stranger's token fails its fence only.
    assert_eq!(
        FinishKey::run(&mut conn, &finishes).await.unwrap(),
        [false, true]
    );
    assert_eq!(state(&mut conn, &declined).await.recovery_point, "finished");

    let fences = [
        released.fence,
        declined.fence,
        KeyFence {
            token: Uuid::new_v4(),
            ..released.fence
        },
    ];
    assert_eq!(
        ReleaseLock::run(&mut conn, &fences).await.unwrap(),
        // A finished key holds no lock; a stranger's token releases nothing.
        [true, false, false]
    );
    let released_now = state(&mut conn, &released).await;
    assert_eq!(
        (
            released_now.recovery_point.as_str(),
            released_now.lock_token
        ),
        ("ride_created", None)
    );
}
