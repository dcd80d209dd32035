//! The error mapping's unit tests: every reason of docs/errors.md's table with its code and retry
//! rule, a real server's GOAWAY read as the server going away, statuses without our reason, and the
//! retry delay and decline code read from the details. Beside error.rs so that the mapping itself
//! reads whole.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;

use tonic_types::ErrorDetails;

use super::*;

fn with_reason(code: Code, reason: &str, domain: &str) -> Status {
    Status::with_error_details(
        code,
        "x",
        ErrorDetails::with_error_info(reason, domain, HashMap::<String, String>::new()),
    )
}

/// Every reason of the table, its code and the table's "retry?" column.
const TABLE: &[(Code, &str, bool)] = &[
    (Code::Unauthenticated, reason::MISSING_CREDENTIALS, false),
    (Code::Unauthenticated, reason::INVALID_CREDENTIALS, false),
    (Code::Unauthenticated, reason::ON_BEHALF_OF_REQUIRED, false),
    (
        Code::PermissionDenied,
        reason::ON_BEHALF_OF_NOT_ALLOWED,
        false,
    ),
    (
        Code::PermissionDenied,
        reason::INTERNAL_CREDENTIAL_NOT_ALLOWED,
        false,
    ),
    (Code::ResourceExhausted, reason::RATE_LIMITED, true),
    (
        Code::InvalidArgument,
        reason::INVALID_IDEMPOTENCY_KEY,
        false,
    ),
    (
        Code::InvalidArgument,
        reason::INVALID_IDEMPOTENCY_WAIT,
        false,
    ),
    (
        Code::InvalidArgument,
        reason::INVALID_RIDE_PARAMETERS,
        false,
    ),
    (
        Code::FailedPrecondition,
        reason::IDEMPOTENCY_KEY_REUSED,
        false,
    ),
    (Code::FailedPrecondition, reason::CARD_DECLINED, false),
    (Code::FailedPrecondition, reason::PAYMENT_REFUNDED, false),
    (Code::Aborted, reason::IDEMPOTENCY_KEY_IN_USE, true),
    (Code::Aborted, reason::IDEMPOTENCY_KEY_LOCK_LOST, true),
    (Code::Aborted, reason::CONCURRENCY_CONFLICT, true),
    (
        Code::Unavailable,
        reason::PAYMENT_PROVIDER_UNAVAILABLE,
        true,
    ),
    (Code::Unavailable, reason::DATABASE_UNAVAILABLE, true),
    (
        Code::Unavailable,
        reason::IDEMPOTENCY_KEY_NEEDS_UPGRADE,
        true,
    ),
    (Code::Internal, reason::INTERNAL, true),
    (Code::NotFound, reason::RIDE_NOT_FOUND, false),
];

#[test]
fn every_reason_has_its_variant_and_retry_rule() {
    for (code, reason, retry) in TABLE {
        let error = RidesError::from(with_reason(*code, reason, reason::ERROR_DOMAIN));
        assert!(
            !matches!(
                error,
                RidesError::UnknownReason { .. } | RidesError::Transport(_)
            ),
            "{reason} has no variant"
        );
        assert_eq!(error.is_retryable(), *retry, "{reason}");
        assert_eq!(error.label(), format!("{code:?}/{reason}"));
        assert!(error.to_string().contains(reason), "{error}");
    }
}

/// The `Internal/-` that rolling deploys showed now and then: a request sent on a connection
/// whose server had begun its graceful shutdown. A real h2 server on loopback sends its
/// GOAWAY; the client's next request is refused by h2 with the GOAWAY's NO_ERROR, which tonic
/// maps to INTERNAL.
#[tokio::test]
async fn a_request_after_the_servers_goaway_is_the_server_going_away() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (socket, _) = listener.accept().await.unwrap();
        let mut connection = h2::server::handshake(socket).await.unwrap();
        connection.graceful_shutdown();
        while let Some(request) = connection.accept().await {
            drop(request);
        }
    });
    let socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (client, connection) = h2::client::handshake(socket).await.unwrap();
    let driver = tokio::spawn(connection);
    let mut refused = None;
    for _ in 0..500 {
        match client.clone().ready().await {
            Err(error) => {
                refused = Some(error);
                break;
            }
            Ok(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    let refused = refused.expect("the client never saw the server's GOAWAY");
    assert!(refused.is_go_away() && refused.is_remote(), "{refused:?}");
    let status = Status::from_error(Box::new(refused));
    assert_eq!(status.code(), Code::Internal, "tonic's mapping of NO_ERROR");
    let error = RidesError::from(status);
    assert!(matches!(error, RidesError::ServerGoingAway(_)), "{error:?}");
    assert_eq!(error.label(), "CLIENT/GOAWAY");
    assert_eq!(error.code(), Some(Code::Unavailable));
    assert!(error.is_retryable());
    assert!(error.status().is_none(), "no answer of the server");
    // Any other h2 failure stays a transport failure under its own code.
    let reset = RidesError::from(Status::from_error(Box::new(h2::Error::from(
        h2::Reason::INTERNAL_ERROR,
    ))));
    assert!(matches!(reset, RidesError::Transport(_)), "{reset:?}");
    assert_eq!(reset.label(), "Internal/-");
    driver.abort();
    server.abort();
}

#[test]
fn statuses_without_our_reason() {
    let foreign = RidesError::from(with_reason(Code::Unavailable, "CARD_DECLINED", "x.io"));
    assert!(matches!(foreign, RidesError::Transport(_)));
    assert!(foreign.is_retryable());
    assert_eq!(foreign.label(), "Unavailable/-");
    let newer = RidesError::from(with_reason(Code::Aborted, "NEW", reason::ERROR_DOMAIN));
    assert!(matches!(&newer, RidesError::UnknownReason { reason: Some(r), .. } if r == "NEW"));
    assert!(newer.is_retryable());
    let too_big = RidesError::from(Status::out_of_range("message too large"));
    assert!(matches!(
        too_big,
        RidesError::UnknownReason { reason: None, .. }
    ));
    assert!(!too_big.is_retryable());
}

#[test]
fn reads_retry_info_and_the_decline_code() {
    let mut details = ErrorDetails::with_error_info(
        reason::RATE_LIMITED,
        reason::ERROR_DOMAIN,
        HashMap::<String, String>::new(),
    );
    details.set_retry_info(Some(Duration::from_millis(1500)));
    let limited = RidesError::from(Status::with_error_details(
        Code::ResourceExhausted,
        "slow down",
        details,
    ));
    assert!(matches!(
        limited,
        RidesError::RateLimited { retry_after: Some(after), .. } if after == Duration::from_millis(1500)
    ));
    assert_eq!(limited.retry_after(), Some(Duration::from_millis(1500)));
    let declined = RidesError::from(Status::with_error_details(
        Code::FailedPrecondition,
        "declined",
        ErrorDetails::with_error_info(
            reason::CARD_DECLINED,
            reason::ERROR_DOMAIN,
            HashMap::from([(
                reason::DECLINE_CODE.to_owned(),
                "generic_decline".to_owned(),
            )]),
        ),
    ));
    assert!(matches!(
        declined,
        RidesError::CardDeclined { decline_code: Some(code), .. } if code == "generic_decline"
    ));
}
