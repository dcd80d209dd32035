//! What the database guarantees: the schema's closed set of recovery points and key invariants,
//! and serialization failures retried until the transaction commits.

use std::sync::{
    Arc,
    atomic::{AtomicU32, Ordering},
};

use api_server::testing::*;
use diesel::{QueryableByName, result::DatabaseErrorKind, sql_types::Integer};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use schema::store::{ConflictRetry, StoreError, retry_transient};
use tokio::sync::Barrier;

#[tokio::test(flavor = "multi_thread")]
async fn the_schema_enforces_the_closed_set_of_recovery_points_and_key_invariants() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    app.create_ride(&user, &key, ride_request()).await.unwrap();
    let key_id = app.key_row(&user, &key).await.unwrap().id;
    let mut conn = app.db.connect().await;

    for statement in [
        "UPDATE idempotency_keys SET recovery_point = 'charged' WHERE id = $1",
        // Finished keys carry their outcome and no lock.
        "UPDATE idempotency_keys SET response_code = NULL WHERE id = $1",
        "UPDATE idempotency_keys SET locked_at = now(), lock_token = gen_random_uuid() WHERE id = $1",
        "UPDATE idempotency_keys SET recovery_point = 'started' WHERE id = $1",
        // A lock is a time and a token together.
        "UPDATE idempotency_keys SET recovery_point = 'started', response_code = NULL, response_body = NULL, locked_at = now() WHERE id = $1",
        // One ride per key.
        "INSERT INTO rides (idempotency_key_id, origin_lat, origin_lon, target_lat, target_lon, amount, currency, user_id) SELECT idempotency_key_id, 0, 0, 0, 0, 1, 'usd', user_id FROM rides WHERE idempotency_key_id = $1",
    ] {
        let error = diesel::sql_query(statement)
            .bind::<diesel::sql_types::BigInt, _>(key_id)
            .execute(&mut conn)
            .await
            .unwrap_err();
        assert!(
            matches!(
                error,
                diesel::result::Error::DatabaseError(
                    DatabaseErrorKind::CheckViolation | DatabaseErrorKind::UniqueViolation,
                    _
                )
            ),
            "{statement}: {error:?}"
        );
    }
}

#[derive(QueryableByName)]
struct Counter {
    #[diesel(sql_type = Integer)]
    n: i32,
}

#[tokio::test(flavor = "multi_thread")]
async fn serialization_failures_are_retried_until_the_transaction_commits() {
    let app = TestApp::spawn().await;
    let mut setup = app.db.connect().await;
    for statement in [
        "CREATE TABLE counter (id int PRIMARY KEY, n int NOT NULL)",
        "INSERT INTO counter VALUES (1, 0)",
    ] {
        diesel::sql_query(statement)
            .execute(&mut setup)
            .await
            .unwrap();
    }
    let url = app.db.url().to_owned();
    let barrier = Arc::new(Barrier::new(2));
    let attempts = Arc::new(AtomicU32::new(0));

    // The first attempt reads, lets a competitor commit an update of the same row, then writes:
    // PostgreSQL refuses it with SQLSTATE 40001, and the retry runs the whole transaction again.
    let retried = {
        let (url, barrier, attempts) = (url.clone(), barrier.clone(), attempts.clone());
        tokio::spawn(async move {
            retry_transient(ConflictRetry::default(), || {
                let (url, barrier, attempts) = (url.clone(), barrier.clone(), attempts.clone());
                async move {
                    let attempt = attempts.fetch_add(1, Ordering::SeqCst) + 1;
                    let mut conn = AsyncPgConnection::establish(&url).await.unwrap();
                    conn.build_transaction()
                        .serializable()
                        .run(async |conn| {
                            let read: Counter =
                                diesel::sql_query("SELECT n FROM counter WHERE id = 1")
                                    .get_result(conn)
                                    .await?;
                            if attempt == 1 {
                                barrier.wait().await;
                                barrier.wait().await;
                            }
                            diesel::sql_query("UPDATE counter SET n = $1 WHERE id = 1")
                                .bind::<Integer, _>(read.n + 1)
                                .execute(conn)
                                .await?;
                            Ok::<_, StoreError>(())
                        })
                        .await
                }
            })
            .await
        })
    };
    barrier.wait().await;
    let mut competitor = AsyncPgConnection::establish(&url).await.unwrap();
    diesel::sql_query("UPDATE counter SET n = n + 1 WHERE id = 1")
        .execute(&mut competitor)
        .await
        .unwrap();
    barrier.wait().await;

    retried.await.unwrap().unwrap();
    assert_eq!(
        AtomicU32::load(&attempts, Ordering::SeqCst),
        2,
        "one conflict, one retry"
    );
    let counter: Counter = diesel::sql_query("SELECT n FROM counter WHERE id = 1")
        .get_result(&mut setup)
        .await
        .unwrap();
    assert_eq!(counter.n, 2, "both increments survived");
}
