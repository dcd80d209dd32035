//! The completer's internal credential: only it acts on behalf of a user, only on keys that user
//! created, and a user's own token never borrows another's identity.

use api_server::{
    grpc::{ON_BEHALF_OF_HEADER, reason},
    testing::*,
};
use tonic::Code;

fn on_behalf_of<T>(token: &str, user_id: Option<i64>, key: &str, body: T) -> tonic::Request<T> {
    let mut request = authed(token, Some(key), body);
    if let Some(user_id) = user_id {
        request
            .metadata_mut()
            .insert(ON_BEHALF_OF_HEADER, user_id.to_string().parse().unwrap());
    }
    request
}

#[tokio::test(flavor = "multi_thread")]
async fn only_the_internal_credential_acts_on_behalf_of_a_user() {
    let app = TestApp::spawn().await;
    let rider = app.create_user(GOOD_CARD).await;
    let other = app.create_user(GOOD_CARD).await;
    let mut client = app.client().await;

    assert_no_one_else_borrows_an_identity(&mut client, &rider, &other).await;
    assert_eq!(app.key_count().await, 0, "no rejected call wrote anything");

    // A key the rider never created: the internal credential creates no key and charges no
    // one, whatever user id it names.
    let key = new_key();
    let completer = |user_id: i64| {
        let mut client = client.clone();
        let key = key.clone();
        async move {
            client
                .create_ride(on_behalf_of(
                    INTERNAL_API_TOKEN,
                    Some(user_id),
                    &key,
                    ride_request(),
                ))
                .await
        }
    };
    let new_key_refused = |status: tonic::Status| {
        assert_status(
            &status,
            Code::PermissionDenied,
            reason::INTERNAL_CREDENTIAL_NOT_ALLOWED,
        );
    };
    new_key_refused(completer(rider.id).await.unwrap_err());
    assert_eq!(app.key_count().await, 0, "no rejected call wrote anything");

    // The completer's call on a key the rider created resumes it (here, replays it).
    let ride = app
        .create_ride(&rider, &key, ride_request())
        .await
        .unwrap()
        .into_inner()
        .ride
        .unwrap();
    let resumed = completer(rider.id).await.unwrap();
    assert!(replayed(&resumed));
    assert_eq!(resumed.into_inner().ride.unwrap(), ride);
    assert_eq!(app.key_row(&rider, &key).await.unwrap().user_id, rider.id);
    // The rider's key is not another user's.
    new_key_refused(completer(other.id).await.unwrap_err());
    assert_eq!(app.key_count().await, 1);
}

/// A user's token borrowing another's identity, a wrong internal token, the internal token
/// naming no user, and one naming an unknown user are each refused with their own reason.
async fn assert_no_one_else_borrows_an_identity(
    client: &mut proto::v1::ride_service_client::RideServiceClient<tonic::transport::Channel>,
    rider: &TestUser,
    other: &TestUser,
) {
    // A user's own token cannot borrow another user's identity.
    let status = client
        .create_ride(on_behalf_of(
            &other.token,
            Some(rider.id),
            &new_key(),
            ride_request(),
        ))
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::PermissionDenied,
        reason::ON_BEHALF_OF_NOT_ALLOWED,
    );
    // A wrong internal token is just a wrong token.
    let almost = format!("{}x", &INTERNAL_API_TOKEN[..INTERNAL_API_TOKEN.len() - 1]);
    let status = client
        .create_ride(on_behalf_of(
            &almost,
            Some(rider.id),
            &new_key(),
            ride_request(),
        ))
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::PermissionDenied,
        reason::ON_BEHALF_OF_NOT_ALLOWED,
    );
    // The internal token names no user by itself.
    let status = client
        .create_ride(on_behalf_of(
            INTERNAL_API_TOKEN,
            None,
            &new_key(),
            ride_request(),
        ))
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::Unauthenticated,
        reason::ON_BEHALF_OF_REQUIRED,
    );
    // An unknown user id.
    let status = client
        .create_ride(on_behalf_of(
            INTERNAL_API_TOKEN,
            Some(999_999),
            &new_key(),
            ride_request(),
        ))
        .await
        .unwrap_err();
    assert_status(&status, Code::Unauthenticated, reason::INVALID_CREDENTIALS);
}
