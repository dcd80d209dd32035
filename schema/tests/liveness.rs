//! A process's liveness session against the real PostgreSQL: it holds its holder id, a lost
//! session is replaced under a new id (the old one becomes takeable), and a session that cannot
//! be opened never makes a lock wait.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use diesel::{QueryableByName, sql_types::BigInt, sql_types::Bool};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use schema::{liveness::Liveness, testing::TestDatabase};

/// Whether some session holds `holder`'s advisory lock: a share-mode try fails only then (the
/// probe `lock_holder_is_gone` makes).
async fn held(conn: &mut AsyncPgConnection, holder: i64) -> bool {
    #[derive(QueryableByName)]
    struct Gone {
        #[diesel(sql_type = Bool)]
        gone: bool,
    }
    let row: Gone = diesel::sql_query("SELECT lock_holder_is_gone($1) AS gone")
        .bind::<BigInt, _>(holder)
        .get_result(conn)
        .await
        .unwrap();
    !row.gone
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lost_session_is_replaced_under_a_new_holder_id_and_the_old_one_is_free() {
    let db = TestDatabase::new().await;
    let url = format!("{}?application_name=liveness_under_test", db.url());
    let liveness = Liveness::start(url);
    let first = liveness.holder_for_lock().await.expect("a session opens");
    let mut conn = db.connect().await;
    assert!(held(&mut conn, first).await, "the session holds its id");
    assert!(liveness.confirm(first).await);

    diesel::sql_query(
        "WITH session AS MATERIALIZED (SELECT pid FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = 'liveness_under_test') \
         SELECT pid FROM session WHERE pg_terminate_backend(pid)",
    )
    .execute(&mut conn)
    .await
    .unwrap();

    let mut second = None;
    for _ in 0..200 {
        if let Some(holder) = liveness.holder_for_lock().await.filter(|h| *h != first) {
            second = Some(holder);
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let second = second.expect("a new session under a new id");
    assert!(
        !liveness.still_holds(first),
        "the lost session is known lost"
    );
    assert!(!liveness.confirm(first).await);
    assert!(
        !held(&mut conn, first).await,
        "the old id is free: its locks are takeable"
    );
    assert!(held(&mut conn, second).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_session_that_cannot_be_opened_never_makes_a_lock_wait() {
    let liveness = Liveness::start("postgres://postgres@127.0.0.1:1/unreachable".to_owned());
    // The first attempt is refused at once; from then on no claim waits for a session.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    for _ in 0..3 {
        assert_eq!(liveness.holder_for_lock().await, None);
    }
    let waited = started.elapsed();
    println!("three locks named no holder after {waited:?}");
    assert!(
        waited < schema::liveness::CONFIRMED_FOR,
        "a lock waited for a session that cannot be opened: {waited:?}"
    );
}
