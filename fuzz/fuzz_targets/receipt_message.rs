//! The AMQP receipt message decoder (`contract::message::ReceiptMessage::decode`): the boundary
//! that other teams' producers and a broker's redeliveries cross.
//!
//! Properties: no body panics the decoder; what it accepts is a version-1 `ride.receipt` with
//! positive ids and amount, every field taken from the body as sent (an invalid body is an error,
//! never a default); an accepted message re-encodes to a body that decodes to the same message
//! and re-encodes to the same bytes. And from the other side: every message the enqueuer can
//! encode (any field values) decodes back to itself, or is refused for its non-positive ids.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use chrono::{DateTime, FixedOffset};
use libfuzzer_sys::fuzz_target;
use contract::message::{RECEIPT_MESSAGE_TYPE, RECEIPT_MESSAGE_VERSION, ReceiptMessage};

fuzz_target!(|data: &[u8]| {
    if let Ok(message) = ReceiptMessage::decode(data) {
        check_accepted(data, &message);
        round_trip(&message);
    }
    if let Ok(message) = arbitrary_message(&mut Unstructured::new(data)) {
        let positive = message.ride_id > 0 && message.user_id > 0 && message.amount > 0;
        let body = message.encode().expect("a message encodes");
        match ReceiptMessage::decode(&body) {
            Ok(decoded) => {
                assert!(positive, "accepted non-positive ids: {decoded:?}");
                assert_eq!(decoded, message);
            }
            Err(error) => assert!(
                !positive,
                "refused its own encoding of {message:?}: {error}"
            ),
        }
    }
});

fn check_accepted(data: &[u8], message: &ReceiptMessage) {
    assert_eq!(message.version, RECEIPT_MESSAGE_VERSION);
    assert_eq!(message.kind, RECEIPT_MESSAGE_TYPE);
    assert!(message.ride_id > 0 && message.user_id > 0 && message.amount > 0);
    let body: serde_json::Value = serde_json::from_slice(data).expect("an accepted body is JSON");
    let field = |name: &str| {
        body.get(name)
            .unwrap_or_else(|| panic!("accepted a body without {name}: {body}"))
    };
    assert_eq!(field("ride_id").as_i64(), Some(message.ride_id));
    assert_eq!(field("user_id").as_i64(), Some(message.user_id));
    assert_eq!(field("amount").as_i64(), Some(message.amount));
    assert_eq!(
        field("charge_id").as_str(),
        Some(message.charge_id.as_str())
    );
    assert_eq!(field("currency").as_str(), Some(message.currency.as_str()));
    let created_at = field("created_at")
        .as_str()
        .expect("created_at is a string");
    // chrono's own (relaxed RFC 3339) parser, the one its `Deserialize` uses.
    let sent: DateTime<FixedOffset> = created_at
        .parse()
        .unwrap_or_else(|error| panic!("accepted created_at {created_at:?}: {error}"));
    assert_eq!(sent, message.created_at);
}

fn round_trip(message: &ReceiptMessage) {
    let body = message.encode().expect("a decoded message encodes");
    let again = ReceiptMessage::decode(&body)
        .unwrap_or_else(|error| panic!("re-encoded {message:?} is refused: {error}"));
    assert_eq!(&again, message);
    assert_eq!(
        again.encode().expect("encodes"),
        body,
        "encoding is not stable"
    );
}

fn arbitrary_message(u: &mut Unstructured) -> arbitrary::Result<ReceiptMessage> {
    let ride_id = i64::arbitrary(u)?;
    let user_id = i64::arbitrary(u)?;
    let amount = i64::arbitrary(u)?;
    let charge_id = String::arbitrary(u)?;
    let currency = String::arbitrary(u)?;
    // chrono's whole range (about ±262,000 years), not just the dates a ride can have.
    let seconds = i64::arbitrary(u)? % 8_300_000_000_000;
    let nanos = u32::arbitrary(u)?;
    let created_at =
        DateTime::from_timestamp(seconds, nanos).ok_or(arbitrary::Error::IncorrectFormat)?;
    Ok(ReceiptMessage {
        version: RECEIPT_MESSAGE_VERSION,
        kind: RECEIPT_MESSAGE_TYPE.to_owned(),
        ride_id,
        user_id,
        charge_id,
        currency,
        amount,
        created_at,
    })
}
