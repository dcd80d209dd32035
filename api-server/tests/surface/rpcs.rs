//! The RPCs besides CreateRide's own paths: GetRide answers only the caller's rides, health and
//! reflection answer without proto files, and oversized messages and metadata are refused.

use api_server::{grpc::reason, testing::*};
use proto::v1::GetRideRequest;
use tonic::Code;

#[tokio::test(flavor = "multi_thread")]
async fn get_ride_returns_only_the_callers_own_rides() {
    let app = TestApp::spawn().await;
    let alice = app.create_user(GOOD_CARD).await;
    let bob = app.create_user(GOOD_CARD).await;
    let created = app
        .create_ride(&alice, &new_key(), ride_request())
        .await
        .unwrap()
        .into_inner()
        .ride
        .unwrap();
    let mut client = app.client().await;

    let fetched = client
        .get_ride(authed(
            &alice.token,
            None,
            GetRideRequest { id: created.id },
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(fetched, created);

    for (user, id) in [
        (&bob, created.id),
        (&alice, created.id + 1000),
        (&alice, -1),
    ] {
        let status = client
            .get_ride(authed(&user.token, None, GetRideRequest { id }))
            .await
            .unwrap_err();
        assert_status(&status, Code::NotFound, reason::RIDE_NOT_FOUND);
    }
    let status = client
        .get_ride(tonic::Request::new(GetRideRequest { id: created.id }))
        .await
        .unwrap_err();
    assert_status(&status, Code::Unauthenticated, reason::MISSING_CREDENTIALS);
}

#[tokio::test(flavor = "multi_thread")]
async fn health_and_reflection_answer_without_proto_files() {
    use tonic_health::pb::{
        HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
    };
    use tonic_reflection::pb::v1alpha::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
    };

    let app = TestApp::spawn().await;
    let mut health = HealthClient::new(app.channel().await);
    for service in ["", "rides.v1.RideService"] {
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(status, ServingStatus::Serving as i32, "service {service:?}");
    }

    let mut reflection = ServerReflectionClient::new(app.channel().await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = reflection
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let response = responses.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        panic!("unexpected reflection answer: {response:?}");
    };
    let names: Vec<_> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.contains(&"rides.v1.RideService".to_owned()),
        "{names:?}"
    );
    assert!(
        names.contains(&"grpc.health.v1.Health".to_owned()),
        "{names:?}"
    );
}

/// A CreateRideRequest padded with an unknown field, to exceed the message size limit.
#[derive(Clone, PartialEq, prost::Message)]
struct PaddedCreateRide {
    #[prost(double, optional, tag = "1")]
    origin_lat: Option<f64>,
    #[prost(double, optional, tag = "2")]
    origin_lon: Option<f64>,
    #[prost(double, optional, tag = "3")]
    target_lat: Option<f64>,
    #[prost(double, optional, tag = "4")]
    target_lon: Option<f64>,
    #[prost(bytes = "vec", tag = "100")]
    padding: Vec<u8>,
}

#[tokio::test(flavor = "multi_thread")]
async fn oversized_messages_and_metadata_are_refused_and_write_nothing() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let request = ride_request();

    let mut grpc = tonic::client::Grpc::new(app.channel().await);
    grpc.ready().await.unwrap();
    let padded = PaddedCreateRide {
        origin_lat: request.origin_lat,
        origin_lon: request.origin_lon,
        target_lat: request.target_lat,
        target_lon: request.target_lon,
        padding: vec![7; api_server::server::MAX_REQUEST_BYTES + 1],
    };
    let status = grpc
        .unary::<_, proto::v1::CreateRideResponse, _>(
            authed(&user.token, Some(&new_key()), padded),
            tonic::codegen::http::uri::PathAndQuery::from_static(
                "/rides.v1.RideService/CreateRide",
            ),
            tonic_prost::ProstCodec::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");

    // Metadata beyond the limit is refused by the HTTP/2 layer before the service runs.
    let mut bloated = authed(&user.token, Some(&new_key()), ride_request());
    bloated.metadata_mut().insert(
        "x-padding",
        "p".repeat(api_server::server::MAX_METADATA_BYTES as usize + 1)
            .parse()
            .unwrap(),
    );
    let result = app.client().await.create_ride(bloated).await;
    assert!(result.is_err(), "oversized metadata must be refused");

    assert_eq!(app.key_count().await, 0, "nothing was written");
    assert!(app.rides().await.is_empty());
    assert_eq!(app.stripe.create_calls(), 0);
    // The server is unharmed.
    app.create_ride(&user, &new_key(), ride_request())
        .await
        .unwrap();
}
