//! Properties of everything a caller controls: the idempotency key, the bearer token, the ride
//! parameters, and the parameters a key is bound to. No input panics; what is accepted is exactly
//! what the contract says; a true retry is never mistaken for a reused key, even after the
//! parameters have been through PostgreSQL's JSONB.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use api_server::{
    auth::bearer_token,
    idempotency::IdempotencyKey,
    rides::{FieldViolation, RideParams},
};
use diesel::{
    QueryableByName,
    sql_types::{Bool, Jsonb},
};
use diesel_async::RunQueryDsl;
use proptest::prelude::*;

fn coordinate() -> impl Strategy<Value = Option<f64>> {
    prop_oneof![
        Just(None),
        any::<f64>().prop_map(Some),
        (-200.0..200.0_f64).prop_map(Some),
        prop_oneof![
            Just(-0.0),
            Just(90.0),
            Just(-90.0),
            Just(180.0),
            Just(-180.0),
            Just(f64::MIN_POSITIVE),
            Just(5e-324),
            Just(f64::NAN),
            Just(f64::INFINITY),
        ]
        .prop_map(Some),
    ]
}

fn valid(value: Option<f64>, limit: f64) -> bool {
    value.is_some_and(|v| v.is_finite() && (-limit..=limit).contains(&v))
}

fn valid_params() -> impl Strategy<Value = RideParams> {
    (
        -90.0..=90.0_f64,
        -180.0..=180.0_f64,
        -90.0..=90.0_f64,
        -180.0..=180.0_f64,
    )
        .prop_map(|(a, b, c, d)| RideParams::new(Some(a), Some(b), Some(c), Some(d)).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn key_parsing_accepts_exactly_20_to_255_visible_ascii_characters(raw in "\\PC{0,300}|[!-~]{15,260}") {
        let expected = (20..=255).contains(&raw.len()) && raw.bytes().all(|b| b.is_ascii_graphic());
        prop_assert_eq!(IdempotencyKey::parse(&raw).is_ok(), expected);
    }

    #[test]
    fn bearer_parsing_never_panics_and_returns_a_non_empty_token(raw in "\\PC{0,100}") {
        if let Some(token) = bearer_token(&raw) {
            prop_assert!(!token.is_empty());
            prop_assert!(raw.to_ascii_lowercase().trim_start().starts_with("bearer"));
        }
    }

    #[test]
    fn validation_accepts_exactly_the_contract_and_names_every_bad_field(
        origin_lat in coordinate(), origin_lon in coordinate(),
        target_lat in coordinate(), target_lon in coordinate(),
    ) {
        let checks = [
            ("origin_lat", valid(origin_lat, 90.0)),
            ("origin_lon", valid(origin_lon, 180.0)),
            ("target_lat", valid(target_lat, 90.0)),
            ("target_lon", valid(target_lon, 180.0)),
        ];
        match RideParams::new(origin_lat, origin_lon, target_lat, target_lon) {
            Ok(params) => {
                prop_assert!(checks.iter().all(|(_, ok)| *ok));
                prop_assert!(params.origin_lat.is_finite() && params.target_lon.is_finite());
            }
            Err(violations) => {
                let named: Vec<&str> = violations.iter().map(|v: &FieldViolation| v.field).collect();
                let bad: Vec<&str> = checks.iter().filter(|(_, ok)| !ok).map(|(f, _)| *f).collect();
                prop_assert_eq!(named, bad);
            }
        }
    }

    #[test]
    fn a_key_is_bound_to_exactly_its_parameters(a in valid_params(), b in valid_params()) {
        prop_assert_eq!(a.signature() == b.signature(), a == b);
        prop_assert_eq!(a.signature(), a.signature());
    }
}

#[derive(QueryableByName)]
struct Stored {
    #[diesel(sql_type = Jsonb)]
    params: schema::JsonText,
    /// The stored parameters against a retry's fresh signature, as the claim compares them.
    #[diesel(sql_type = Bool)]
    retry_binds: bool,
    /// The same against parameters one representable `f64` away in one coordinate.
    #[diesel(sql_type = Bool)]
    neighbour_binds: bool,
}

/// `params` with its origin latitude moved to the adjacent `f64` (inward at the range's edge).
fn neighbour(params: RideParams) -> RideParams {
    let bits = params.origin_lat.to_bits();
    [bits ^ 1, bits.wrapping_sub(1)]
        .into_iter()
        .find_map(|bits| {
            let lat = f64::from_bits(bits);
            RideParams::new(
                Some(lat),
                Some(params.origin_lon),
                Some(params.target_lat),
                Some(params.target_lon),
            )
            .ok()
        })
        .expect("an adjacent latitude in range")
}

/// The claim compares a retry's parameters with the stored ones in PostgreSQL (`jsonb` equality,
/// numbers as `numeric`): a true retry must bind, or it would be refused as
/// IDEMPOTENCY_KEY_REUSED, and the nearest other request must not, or it would replay another
/// ride. What JSONB gives back reads back to the same parameters.
#[tokio::test(flavor = "multi_thread")]
async fn parameters_survive_jsonb_exactly() {
    let db = schema::testing::TestDatabase::new().await;
    let mut conn = db.connect().await;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = valid_params();
    let mut cases: Vec<RideParams> = (0..300)
        .map(|_| proptest::strategy::ValueTree::current(&strategy.new_tree(&mut runner).unwrap()))
        .collect();
    cases.push(
        RideParams::new(
            Some(5e-324),
            Some(-180.0),
            Some(-0.0),
            Some(179.99999999999997),
        )
        .unwrap(),
    );
    cases.push(
        RideParams::new(
            Some(f64::MIN_POSITIVE),
            Some(1e-7),
            Some(89.999999999999),
            Some(0.1),
        )
        .unwrap(),
    );
    for params in cases {
        let signature = params.signature().params;
        let stored: Stored = diesel::sql_query(
            "WITH stored AS (SELECT $1::jsonb AS params) \
             SELECT params, params = $2::jsonb AS retry_binds, \
                    params = $3::jsonb AS neighbour_binds FROM stored",
        )
        .bind::<Jsonb, _>(&signature)
        .bind::<Jsonb, _>(&params.signature().params)
        .bind::<Jsonb, _>(&neighbour(params).signature().params)
        .get_result(&mut conn)
        .await
        .unwrap();
        assert_eq!(stored.params, signature, "{params:?}");
        assert!(stored.retry_binds, "a retry of {params:?} would be refused");
        assert!(!stored.neighbour_binds, "{params:?} binds its neighbour");
    }
}
