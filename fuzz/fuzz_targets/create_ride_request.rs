//! CreateRide's request validation, as the gRPC layer runs it: a protobuf body from the wire,
//! decoded by prost, converted with `RideParams::try_from` (api-server/src/grpc/mod.rs →
//! `RideParams::new`).
//!
//! Properties: no input panics; validation accepts exactly four present, finite, in-range
//! coordinates and names every other field, in order; accepted coordinates are the ones sent
//! (with -0.0 spelled 0.0); validation is deterministic; a decoded request re-encodes to the same
//! request.
#![no_main]

use api_server::rides::RideParams;
use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use prost::Message;
use proto::v1::CreateRideRequest;

fuzz_target!(|data: &[u8]| {
    // The bytes as the wire body tonic hands to prost.
    if let Ok(request) = CreateRideRequest::decode(data) {
        check(&request);
        let again = CreateRideRequest::decode(request.encode_to_vec().as_slice())
            .expect("a decoded request re-encodes to a decodable body");
        assert_eq!(
            bits(&again),
            bits(&request),
            "re-encoding changed the request"
        );
    }
    // The same bytes as field values, so that every mix of absent, odd and valid coordinates is
    // reached even by inputs that are no protobuf message.
    let mut fields = Unstructured::new(data);
    if let Ok([origin_lat, origin_lon, target_lat, target_lon]) =
        <[Option<f64>; 4]>::arbitrary(&mut fields)
    {
        check(&CreateRideRequest {
            origin_lat,
            origin_lon,
            target_lat,
            target_lon,
        });
    }
});

fn check(request: &CreateRideRequest) {
    let fields = [
        ("origin_lat", request.origin_lat, 90.0),
        ("origin_lon", request.origin_lon, 180.0),
        ("target_lat", request.target_lat, 90.0),
        ("target_lon", request.target_lon, 180.0),
    ];
    let bad: Vec<&str> = fields
        .iter()
        .filter(|(_, value, limit)| !value.is_some_and(|v| v.is_finite() && v.abs() <= *limit))
        .map(|(field, _, _)| *field)
        .collect();

    let first = RideParams::try_from(*request);
    let second = RideParams::try_from(*request);
    match (&first, &second) {
        (Ok(a), Ok(b)) => assert_eq!(coordinate_bits(a), coordinate_bits(b), "not deterministic"),
        (Err(a), Err(b)) => assert_eq!(a, b, "not deterministic"),
        _ => panic!("validation is not deterministic: {first:?} then {second:?}"),
    }

    match first {
        Ok(params) => {
            assert!(
                bad.is_empty(),
                "accepted {request:?} with bad fields {bad:?}"
            );
            let accepted = [
                params.origin_lat,
                params.origin_lon,
                params.target_lat,
                params.target_lon,
            ];
            for ((field, sent, limit), value) in fields.iter().zip(accepted) {
                let sent = sent.expect("accepted fields are present");
                assert!(
                    value.is_finite() && value.abs() <= *limit,
                    "{field} = {value}"
                );
                assert!(value == sent, "{field}: sent {sent}, accepted {value}");
                assert!(
                    value != 0.0 || value.is_sign_positive(),
                    "{field}: -0.0 must be stored as 0.0"
                );
            }
            // The signature a key is bound to is built from these values and never panics.
            let signature = params.signature();
            let params = signature.params.to_value();
            let object = params.as_object().expect("params are an object");
            assert_eq!(object.len(), 4);
            for ((field, _, _), value) in fields.iter().zip(accepted) {
                let signed = object[*field].as_f64().expect("a coordinate is a number");
                assert_eq!(
                    signed.to_bits(),
                    value.to_bits(),
                    "{field} in the signature"
                );
            }
        }
        Err(violations) => {
            let named: Vec<&str> = violations.iter().map(|v| v.field).collect();
            assert_eq!(named, bad, "violations of {request:?}");
            for violation in &violations {
                assert!(
                    violation.description.starts_with(violation.field),
                    "{violation:?}"
                );
            }
        }
    }
}

fn coordinate_bits(params: &RideParams) -> [u64; 4] {
    [
        params.origin_lat.to_bits(),
        params.origin_lon.to_bits(),
        params.target_lat.to_bits(),
        params.target_lon.to_bits(),
    ]
}

fn bits(request: &CreateRideRequest) -> [Option<u64>; 4] {
    [
        request.origin_lat.map(f64::to_bits),
        request.origin_lon.map(f64::to_bits),
        request.target_lat.map(f64::to_bits),
        request.target_lon.map(f64::to_bits),
    ]
}
