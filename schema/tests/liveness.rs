//! A process's liveness session against the real PostgreSQL: it holds its holder id, a lost
//! session is replaced under a new id (the old one becomes takeable), a session that cannot be
//! opened makes a lock wait for one quick try at most, and a lock taken once the database is
//! back asks for a session at once instead of naming no holder until the back-off ends.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

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
async fn a_session_that_cannot_be_opened_never_makes_a_lock_wait_long() {
    let liveness = Liveness::start("postgres://postgres@127.0.0.1:1/unreachable".to_owned());
    // Every try is refused at once; a lock waits at most for one it asked for.
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

#[tokio::test(flavor = "multi_thread")]
async fn a_lock_taken_once_the_database_is_back_names_a_holder_before_the_back_off_ends() {
    let db = TestDatabase::new().await;
    let up = Arc::new(AtomicBool::new(false));
    let (liveness, _) = behind_a_proxy(&db, &up).await;
    // Down for long enough that the session's back-off has grown to its longest (2 s).
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert_eq!(
        liveness.holder_for_lock().await,
        None,
        "no session while down"
    );
    up.store(true, Ordering::SeqCst);
    // Past the least pause between tries: the back-off itself runs on for up to 2 s more.
    tokio::time::sleep(schema::liveness::ASKED_TRY_AFTER + Duration::from_millis(50)).await;
    let holder = liveness
        .holder_for_lock()
        .await
        .expect("the lock asked for a session and names its holder");
    let mut conn = db.connect().await;
    assert!(held(&mut conn, holder).await);
}

/// A liveness session to `db` through a proxy that `up` switches, and the proxy's count of tries.
async fn behind_a_proxy(db: &TestDatabase, up: &Arc<AtomicBool>) -> (Liveness, Arc<AtomicUsize>) {
    let (url, tries) = schema::testing::through_switchable_proxy(db.url(), up).await;
    (Liveness::start(url), tries)
}

#[tokio::test(flavor = "multi_thread")]
async fn locks_asking_while_the_database_is_down_make_at_most_one_try_per_asked_try_pause() {
    let db = TestDatabase::new().await;
    let up = Arc::new(AtomicBool::new(false));
    let (liveness, tries) = behind_a_proxy(&db, &up).await;
    // Let the back-off grow past the asked-for pause, then ask from eight claims at once for 2 s.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = AtomicUsize::load(&tries, Ordering::SeqCst);
    let asking = Duration::from_secs(2);
    let until = Instant::now() + asking;
    let claims = (0..8).map(|_| {
        let liveness = liveness.clone();
        tokio::spawn(async move {
            while Instant::now() < until {
                assert_eq!(liveness.holder_for_lock().await, None);
            }
        })
    });
    for claim in claims.collect::<Vec<_>>() {
        claim.await.unwrap();
    }
    let asked_tries = AtomicUsize::load(&tries, Ordering::SeqCst) - before;
    let cap = (asking.as_millis() / schema::liveness::ASKED_TRY_AFTER.as_millis()) as usize + 2;
    println!("{asked_tries} tries in {asking:?} of asking (cap {cap})");
    assert!(
        asked_tries >= 2,
        "the claims asked for tries: {asked_tries}"
    );
    assert!(
        asked_tries <= cap,
        "{asked_tries} tries, more than one per pause"
    );
}
