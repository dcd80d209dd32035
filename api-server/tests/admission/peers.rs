//! Who the peer is: a trusted HTTP proxy or PROXY protocol header names the client (an untrusted
//! peer cannot), and services with client certificates get fair shares of CreateRide.

use std::{net::IpAddr, time::Duration};

use api_server::{grpc::reason, testing::*};
use proto::v1::ride_service_client::RideServiceClient;
use tonic::Code;

use crate::{
    channel_from, channel_with_header, create, forwarded_for, ok, origin_ips, spawn,
    spawn_with_a_budget_of_four,
};

#[tokio::test(flavor = "multi_thread")]
async fn a_trusted_http_proxy_names_its_clients_and_an_untrusted_peer_cannot() {
    let app = spawn_with_a_budget_of_four(&[("GRPC_TRUSTED_HTTP_PROXIES", "127.0.0.24/32")]).await;
    let rider = app.create_user(GOOD_CARD).await;
    let mut proxy = RideServiceClient::new(channel_from(&app, "127.0.0.24").await);
    // An attacker behind the proxy spends its budget and is shut out, by its own address...
    for _ in 0..5 {
        let _ = proxy
            .create_ride(forwarded_for(create("not-a-token"), "198.51.100.1"))
            .await;
    }
    let status = proxy
        .create_ride(forwarded_for(create(&rider.token), "198.51.100.1"))
        .await
        .unwrap_err();
    assert_status(&status, Code::ResourceExhausted, reason::RATE_LIMITED);
    // ...while the proxy's connection serves everyone else, and records their own address. The
    // client's own claim left of the proxy's entry is not believed.
    ok(proxy
        .create_ride(forwarded_for(
            create(&rider.token),
            "203.0.113.9, 198.51.100.2",
        ))
        .await);
    assert_eq!(
        origin_ips(&app).await.last(),
        Some(&"198.51.100.2".parse::<IpAddr>().unwrap())
    );

    // An untrusted peer's x-forwarded-for is ignored: its refusals are its own.
    let mut untrusted = RideServiceClient::new(channel_from(&app, "127.0.0.25").await);
    let mut cut = false;
    for n in 0..10 {
        let forwarded = format!("198.51.100.{}", 100 + n);
        match untrusted
            .create_ride(forwarded_for(create("not-a-token"), &forwarded))
            .await
        {
            Err(status) if status.code() == Code::Unauthenticated => {}
            Err(_) => {
                cut = true;
                break;
            }
            Ok(_) => panic!("a bad token was served"),
        }
    }
    assert!(
        cut,
        "the untrusted peer spread its refusals over forged addresses"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_proxy_protocol_header_names_the_client_only_from_a_trusted_proxy() {
    let app = spawn(
        fake_stripe::Config::default(),
        &[("GRPC_TRUSTED_PROXIES", "127.0.0.26/32")],
    )
    .await;
    let rider = app.create_user(GOOD_CARD).await;
    let header = b"PROXY TCP4 198.51.100.7 127.0.0.1 40000 50051\r\n";
    let mut relayed = RideServiceClient::new(
        channel_with_header(&app, "127.0.0.26", header)
            .await
            .unwrap(),
    );
    // The client's own x-forwarded-for, relayed after the header, names nobody.
    ok(relayed
        .create_ride(forwarded_for(create(&rider.token), "203.0.113.9"))
        .await);
    let v2 =
        b"\r\n\r\n\0\r\nQUIT\n\x21\x11\x00\x0c\xc6\x33\x64\x08\x7f\x00\x00\x01\x9c\x40\xc3\x53";
    let mut relayed_v2 =
        RideServiceClient::new(channel_with_header(&app, "127.0.0.26", v2).await.unwrap());
    ok(relayed_v2.create_ride(create(&rider.token)).await);
    assert_eq!(
        origin_ips(&app).await,
        vec![
            "198.51.100.7".parse::<IpAddr>().unwrap(),
            "198.51.100.8".parse::<IpAddr>().unwrap()
        ]
    );
    // The same header from an untrusted peer is not a PROXY header but a broken preface.
    let served = match channel_with_header(&app, "127.0.0.27", header).await {
        Ok(channel) => RideServiceClient::new(channel)
            .create_ride(create(&rider.token))
            .await
            .is_ok(),
        Err(_) => false,
    };
    assert!(!served, "an untrusted peer's PROXY header was accepted");
    assert_eq!(origin_ips(&app).await.len(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn services_with_client_certificates_get_fair_shares_of_createride_concurrency() {
    let server_ca = TestCa::new("server ca");
    let client_ca = TestCa::new("client ca");
    let files = TlsFiles::new(&server_ca, Some(&client_ca));
    let mut vars: Vec<(&str, String)> = files.env();
    vars.push(("SERVICE_SHARE_CREATES", "4".to_owned()));
    vars.push(("STRIPE_TIMEOUT_MS", "20000".to_owned()));
    let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let stripe = fake_stripe::Config {
        latency: Duration::from_secs(2),
        ..fake_stripe::Config::default()
    };
    let app = spawn(stripe, &vars).await;
    let service = |name: &str| {
        let tls = server_ca
            .client_tls()
            .identity(client_ca.client_identity(name));
        let app = &app;
        async move { RideServiceClient::new(app.tls_channel(tls).await.unwrap()) }
    };
    let (noisy, quiet) = (
        service("noisy-backend").await,
        service("quiet-backend").await,
    );
    let rider = app.create_user(GOOD_CARD).await;
    ok(noisy.clone().create_ride(create(&rider.token)).await);
    let at_provider = app.stripe.create_calls();

    // Alone, the noisy service may hold more than the whole budget of 4.
    let noisy_calls: Vec<_> = (0..6)
        .map(|_| {
            let mut noisy = noisy.clone();
            let token = rider.token.clone();
            tokio::spawn(async move { noisy.create_ride(create(&token)).await })
        })
        .collect();
    while app.stripe.create_calls() < at_provider + 6 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Another service is still served...
    let quiet_call = {
        let mut quiet = quiet.clone();
        let token = rider.token.clone();
        tokio::spawn(async move { quiet.create_ride(create(&token)).await })
    };
    while app.stripe.create_calls() < at_provider + 7 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // ...and while it has a call in flight, the noisy one, over its share of 2, is refused.
    let status = noisy
        .clone()
        .create_ride(create(&rider.token))
        .await
        .unwrap_err();
    assert_status(&status, Code::ResourceExhausted, reason::RATE_LIMITED);
    ok(quiet_call.await.unwrap());
    for call in noisy_calls {
        ok(call.await.unwrap());
    }
    // Alone again, it is served.
    ok(noisy.clone().create_ride(create(&rider.token)).await);
}
