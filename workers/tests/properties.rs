//! The receipt message decoder is the boundary other teams' producers and a broker's redeliveries
//! cross: no input panics it, and everything it accepts round-trips.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use contract::message::{RECEIPT_MESSAGE_TYPE, RECEIPT_MESSAGE_VERSION, ReceiptMessage};
use proptest::prelude::*;

fn message() -> impl Strategy<Value = ReceiptMessage> {
    (
        1..i64::MAX,
        1..i64::MAX,
        "pi_[A-Za-z0-9]{1,30}",
        1..100_000_000_i64,
        "[a-z]{3}",
        0..4_000_000_000_i64,
    )
        .prop_map(
            |(ride_id, user_id, charge_id, amount, currency, secs)| ReceiptMessage {
                version: RECEIPT_MESSAGE_VERSION,
                kind: RECEIPT_MESSAGE_TYPE.to_owned(),
                ride_id,
                user_id,
                charge_id,
                amount,
                currency,
                created_at: chrono::DateTime::from_timestamp(secs, 0).unwrap(),
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn arbitrary_bytes_never_panic_the_decoder(body in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = ReceiptMessage::decode(&body);
    }

    #[test]
    fn json_shaped_garbage_never_panics_the_decoder(body in "\\{(\"[a-z_]{1,10}\":(-?[0-9]{1,25}|\"[^\"]{0,10}\"|null|true|\\[\\]),?){0,8}\\}") {
        let _ = ReceiptMessage::decode(body.as_bytes());
    }

    #[test]
    fn valid_messages_round_trip(message in message()) {
        let decoded = ReceiptMessage::decode(&message.encode().unwrap()).unwrap();
        prop_assert_eq!(decoded, message);
    }

    #[test]
    fn other_versions_are_refused(message in message(), version in 2..u32::MAX) {
        let mut other = message;
        other.version = version;
        prop_assert!(ReceiptMessage::decode(&other.encode().unwrap()).is_err());
    }
}
