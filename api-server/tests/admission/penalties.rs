//! Who a penalty falls on: a made-up token's address, never the other riders of a rate-limited
//! rider's backend, never a peer that presented a valid credential or the internal credential,
//! and the decline budget counted across replicas.

use std::time::Duration;

use api_server::{
    auth,
    grpc::{ON_BEHALF_OF_HEADER, reason},
    testing::*,
};
use diesel_async::RunQueryDsl;
use proto::v1::ride_service_client::RideServiceClient;
use tonic::{Code, transport::Channel};

use crate::{channel_from, create, lock_users, ok, spawn, spawn_with_a_budget_of_four};

#[tokio::test(flavor = "multi_thread")]
async fn a_made_up_token_counts_against_its_address_even_when_its_caller_has_gone() {
    let app = spawn_with_a_budget_of_four(&[]).await;
    let rider = app.create_user(GOOD_CARD).await;
    let mut locker = lock_users(&app).await;
    let client = RideServiceClient::new(channel_from(&app, "127.0.0.28").await);
    // Six made-up tokens whose callers give up while their lookups wait on the lock.
    let calls: Vec<_> = (0..6)
        .map(|_| {
            let mut client = client.clone();
            tokio::spawn(async move {
                let mut request = create(&auth::generate_token());
                request.set_timeout(Duration::from_millis(300));
                client.create_ride(request).await
            })
        })
        .collect();
    for call in calls {
        let status = call.await.unwrap().unwrap_err();
        assert!(
            matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled),
            "{status:?}"
        );
    }
    diesel::sql_query("COMMIT")
        .execute(&mut locker)
        .await
        .unwrap();
    // The lookups end without their callers, find no user, and count against the address:
    // with a budget of four it is shut out, even for a valid token.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let channel = Channel::from_shared(format!("http://{}", app.addr))
        .unwrap()
        .local_address(Some("127.0.0.28".parse().unwrap()))
        .connect_lazy();
    let served = RideServiceClient::new(channel)
        .create_ride(create(&rider.token))
        .await;
    assert!(
        served.is_err(),
        "the address escaped its failed authentications by hanging up"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rate_limited_rider_does_not_shut_out_the_others_on_its_backend() {
    // A refusal budget of 4, and riders with a burst of 2 CreateRides.
    let app = spawn(
        fake_stripe::Config::default(),
        &[
            ("GRPC_REFUSALS_PER_IP_PER_SEC", "1"),
            ("RATE_LIMIT_CREATE_PER_SEC", "0.001"),
            ("RATE_LIMIT_CREATE_BURST", "2"),
        ],
    )
    .await;
    let (flooder, others) = (
        app.create_user(GOOD_CARD).await,
        app.create_user(GOOD_CARD).await,
    );
    let mut backend = RideServiceClient::new(channel_from(&app, "127.0.0.21").await);
    let mut limited = 0;
    for _ in 0..30 {
        match backend.create_ride(create(&flooder.token)).await {
            Ok(_) => {}
            Err(status) => {
                assert_status(&status, Code::ResourceExhausted, reason::RATE_LIMITED);
                limited += 1;
            }
        }
    }
    assert_eq!(limited, 28);
    // The same connection serves the backend's other riders.
    ok(backend.create_ride(create(&others.token)).await);
    ok(backend.create_ride(create(&others.token)).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn failed_authentications_never_shut_out_a_peer_that_presented_a_valid_credential() {
    let app = spawn_with_a_budget_of_four(&[]).await;
    let rider = app.create_user(GOOD_CARD).await;
    let mut backend = RideServiceClient::new(channel_from(&app, "127.0.0.22").await);
    ok(backend.create_ride(create(&rider.token)).await);
    // Far past the budget of 4: a rider of this backend with a revoked or mistyped token.
    for _ in 0..40 {
        let status = backend
            .create_ride(create(&auth::generate_token()))
            .await
            .unwrap_err();
        assert_status(&status, Code::Unauthenticated, reason::INVALID_CREDENTIALS);
    }
    ok(backend.create_ride(create(&rider.token)).await);
    // A new connection from the same address is accepted too.
    let mut again = RideServiceClient::new(channel_from(&app, "127.0.0.22").await);
    ok(again.create_ride(create(&rider.token)).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_internal_credential_is_never_shut_out() {
    let app = spawn_with_a_budget_of_four(&[]).await;
    let rider = app.create_user(GOOD_CARD).await;
    let mut completer = RideServiceClient::new(channel_from(&app, "127.0.0.23").await);
    // The internal credential without on-behalf-of metadata: refused, and never counted.
    for _ in 0..20 {
        let status = completer
            .create_ride(authed(INTERNAL_API_TOKEN, Some(&new_key()), ride_request()))
            .await
            .unwrap_err();
        assert_status(
            &status,
            Code::Unauthenticated,
            reason::ON_BEHALF_OF_REQUIRED,
        );
    }
    // It resumes the rider's key.
    let key = new_key();
    ok(app.create_ride(&rider, &key, ride_request()).await);
    let mut request = authed(INTERNAL_API_TOKEN, Some(&key), ride_request());
    request
        .metadata_mut()
        .insert(ON_BEHALF_OF_HEADER, rider.id.to_string().parse().unwrap());
    ok(completer.create_ride(request).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_decline_budget_holds_across_replicas() {
    let app = spawn(
        fake_stripe::Config::default(),
        &[("DECLINE_BUDGET_PER_10_MIN", "2")],
    )
    .await;
    // A second api-server on the same database and provider, as behind a load balancer.
    let replica = api_server::App::from_config(&app.config).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let replica_addr = listener.local_addr().unwrap();
    tokio::spawn(api_server::server::serve(
        listener,
        replica,
        std::future::pending(),
    ));
    let replica_channel = Channel::from_shared(format!("http://{replica_addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let servers = [
        RideServiceClient::new(app.channel().await),
        RideServiceClient::new(replica_channel),
    ];
    let tester = app.create_user(DECLINED_CARD).await;
    // The tester alternates between the replicas; each new key is a fresh card test.
    let mut declined = 0;
    let mut refused_on = Vec::new();
    for attempt in 0..8 {
        let mut server = servers[attempt % 2].clone();
        let status = server.create_ride(create(&tester.token)).await.unwrap_err();
        match status.code() {
            Code::FailedPrecondition => {
                assert_status(&status, Code::FailedPrecondition, reason::CARD_DECLINED);
                declined += 1;
            }
            _ => {
                assert_status(&status, Code::ResourceExhausted, reason::RATE_LIMITED);
                refused_on.push(attempt % 2);
            }
        }
    }
    // A per-process budget would allow 2 on each; counted from the database, each replica stops
    // at its first decline past the budget: budget + replicas - 1.
    assert_eq!(declined, 3, "declines charged across two replicas");
    assert_eq!(refused_on.len(), 5);
    assert!(refused_on.contains(&0) && refused_on.contains(&1));
}
