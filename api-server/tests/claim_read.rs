//! A claim's read alone (`Rides::begin`, for a key its caller says it resent) writes nothing,
//! whatever it finds, even in a batch with claims that write: it runs in the caller's request,
//! where a hang-up may cut it short, so a key it wrote would be left locked by a token nobody
//! holds.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{IpAddr, Ipv4Addr};

use api_server::{
    auth::{Caller, token_digest},
    idempotency::IdempotencyKey,
    rides::{Begun, RideParams},
    testing::*,
};
use futures_util::future::join_all;

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
