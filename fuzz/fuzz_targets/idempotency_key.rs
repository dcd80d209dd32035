//! Idempotency-key parsing: `IdempotencyKey::parse` on any string, and the gRPC layer's
//! `idempotency_key` on any header value a client can put in `idempotency-key` metadata.
//!
//! Properties: no input panics; a key is accepted exactly when it is 20 to 255 visible ASCII
//! characters, and is then the bytes sent; a refusal is `InvalidArgument` with a fixed message
//! that never echoes the input; `redacted()` (which slices bytes) and `Debug` show the first six
//! characters and nothing more.
#![no_main]

use api_server::{
    grpc::{IDEMPOTENCY_KEY_HEADER, idempotency_key},
    idempotency::{IdempotencyKey, InvalidKey},
};
use libfuzzer_sys::fuzz_target;
use tonic::{
    Code,
    metadata::{AsciiMetadataValue, MetadataMap},
};

fuzz_target!(|data: &[u8]| {
    let valid = (20..=255).contains(&data.len()) && data.iter().all(u8::is_ascii_graphic);

    if let Ok(raw) = std::str::from_utf8(data) {
        match IdempotencyKey::parse(raw) {
            Ok(key) => {
                assert!(valid, "accepted {raw:?}");
                assert_eq!(key.as_str(), raw);
                check_key(&key);
            }
            Err(_) => assert!(!valid, "refused {raw:?}"),
        }
    }

    // The metadata path. HTTP/2 carries header values that `HeaderValue` accepts (no control
    // characters but tab, any byte from 0x80 up); anything else never reaches the service.
    let Ok(value) = AsciiMetadataValue::try_from(data) else {
        return;
    };
    let mut metadata = MetadataMap::new();
    metadata.insert(IDEMPOTENCY_KEY_HEADER, value);
    match idempotency_key(&metadata) {
        Ok(key) => {
            assert!(valid, "accepted {data:?}");
            assert_eq!(key.as_str().as_bytes(), data);
            check_key(&key);
        }
        Err(status) => {
            assert!(!valid, "refused {data:?}");
            assert_eq!(status.code(), Code::InvalidArgument);
            let fixed = [
                InvalidKey::TooShort.to_string(),
                InvalidKey::TooLong.to_string(),
                InvalidKey::InvalidCharacter.to_string(),
                "the idempotency-key must be visible ASCII".to_owned(),
            ]
            .map(|description| format!("invalid idempotency-key metadata: {description}"));
            assert!(
                fixed.contains(&status.message().to_owned()),
                "unexpected message {:?}",
                status.message()
            );
        }
    }
});

fn check_key(key: &IdempotencyKey) {
    let raw = key.as_str();
    let prefix = &raw[..6];
    let redacted = key.redacted();
    assert_eq!(redacted, format!("{prefix}…"));
    assert_eq!(format!("{key:?}"), format!("IdempotencyKey({prefix}…)"));
    // What is logged can be matched back to the key, and parsing again changes nothing.
    assert_eq!(IdempotencyKey::parse(raw).as_ref(), Ok(key));
}
