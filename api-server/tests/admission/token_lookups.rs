//! The token lookups against a real database: the lookups waiting at once are read by one
//! statement, and each call gets its own token's user (or none), whatever else the statement
//! carried.

use std::time::Duration;

use api_server::{
    admission::lookup::{LookupConfig, TokenLookups},
    auth,
    testing::*,
};

#[tokio::test(flavor = "multi_thread")]
async fn lookups_waiting_together_share_a_statement_and_each_get_their_own_user() {
    let app = TestApp::spawn().await;
    let alice = app.create_user(GOOD_CARD).await;
    let bob = app.create_user(GOOD_CARD).await;
    // One connection, held by the test: the first lookup's statement waits for it while the
    // others are submitted, so they share the next statement.
    let pool = app.db.pool(1);
    let held = pool.get_owned().await.unwrap();
    let lookups = TokenLookups::new(
        LookupConfig {
            places: 16,
            max_waiting: 16,
            max_wait: Duration::from_secs(30),
        },
        pool,
    );
    let nobody = auth::token_digest("a-token-no-user-has-0000000000000");
    let asked = [
        (auth::token_digest(&alice.token), Some(alice.id)),
        (nobody, None),
        (auth::token_digest(&bob.token), Some(bob.id)),
        (
            auth::token_digest("another-token-nobody-has-00000000"),
            None,
        ),
    ];
    let runs = asked.iter().map(|(digest, _)| lookups.lookup(digest));
    let mut all = std::pin::pin!(futures_util::future::join_all(runs));
    assert!(
        futures_util::poll!(&mut all).is_pending(),
        "nothing is read while the statement waits for the connection"
    );
    drop(held);
    let found = all.await;

    for ((_, expected), found) in asked.iter().zip(found) {
        assert_eq!(found, Ok(*expected));
    }
    let counts = lookups.counts();
    assert_eq!(counts.items, asked.len() as u64, "{counts:?}");
    assert!(
        (1..=2).contains(&counts.statements),
        "the lookups shared statements: {counts:?}"
    );
}
