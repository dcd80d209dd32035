//! The parameters an idempotency key is bound to. The first attempt stores
//! `RideParams::signature().params` in `idempotency_keys.request_params` (JSONB); every retry's
//! claim compares its own fresh signature with the stored one (in PostgreSQL, `jsonb` equality),
//! and any difference turns a true retry into IDEMPOTENCY_KEY_REUSED. PostgreSQL compares the
//! numbers as `numeric` values; this target checks the stricter property that the texts read back
//! equal as JSON values, which implies it.
//!
//! PostgreSQL stores JSON numbers as `numeric`, which prints without exponents: `1.5e-7` comes back
//! as `0.00000015`. `through_jsonb` does the same to serde_json's text, so the property is
//! checked as it happens in production, without a database (the workspace test
//! `parameters_survive_jsonb_exactly` does it against a real one, for fewer cases).
//!
//! Properties: for valid coordinates (any bit pattern, or a decimal as a client would type it),
//! the stored-and-read-back parameters equal a retry's fresh signature; the parameters as the
//! audit record stores them read back to the same coordinates; two requests share a signature
//! exactly when their coordinates are equal.
#![no_main]

use api_server::rides::RideParams;
use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

#[derive(Arbitrary, Debug)]
enum Coordinate {
    Bits(u64),
    /// `{mantissa}e{exponent}`, parsed as a client's JSON or protobuf library would.
    Decimal {
        mantissa: i64,
        exponent: i16,
    },
    Edge(u8),
}

const EDGES: [f64; 12] = [
    0.0,
    -0.0,
    90.0,
    -90.0,
    180.0,
    -180.0,
    5e-324,
    f64::MIN_POSITIVE,
    179.99999999999997,
    89.99999999999999,
    0.1,
    1e-7,
];

impl Coordinate {
    fn value(&self) -> f64 {
        match *self {
            Coordinate::Bits(bits) => f64::from_bits(bits),
            Coordinate::Decimal { mantissa, exponent } => format!("{mantissa}e{exponent}")
                .parse()
                .expect("a decimal literal parses"),
            Coordinate::Edge(index) => EDGES[usize::from(index) % EDGES.len()],
        }
    }
}

#[derive(Arbitrary, Debug)]
struct Input {
    first: [Coordinate; 4],
    other: [Coordinate; 4],
}

fn params(coordinates: &[Coordinate; 4]) -> Option<RideParams> {
    let [a, b, c, d] = coordinates.each_ref().map(|c| Some(c.value()));
    RideParams::new(a, b, c, d).ok()
}

fuzz_target!(|input: Input| {
    let Some(first) = params(&input.first) else {
        return;
    };
    let signature = first.signature();
    let stored = through_jsonb(&signature.params.to_value());

    // A retry validates the same request afresh and must match what the first attempt stored.
    let retry = params(&input.first)
        .expect("validation is deterministic")
        .signature();
    assert_eq!(retry, signature);
    assert_eq!(
        stored,
        retry.params.to_value(),
        "a retry would be refused as a reused key: stored {stored}"
    );

    // The audit record stores the signature's params as the key does; they read back to the same
    // place.
    let read: RideParams = serde_json::from_value(stored.clone()).expect("params deserialise");
    assert_eq!(bits(&read), bits(&first), "audit record {stored}");

    // Different coordinates, different signatures; equal ones, equal signatures.
    if let Some(other) = params(&input.other) {
        let same = bits(&first) == bits(&other);
        assert_eq!(
            signature == other.signature(),
            same,
            "{first:?} / {other:?}"
        );
        assert_eq!(
            stored == through_jsonb(&other.signature().params.to_value()),
            same
        );
    }
});

fn bits(params: &RideParams) -> [u64; 4] {
    [
        params.origin_lat.to_bits(),
        params.origin_lon.to_bits(),
        params.target_lat.to_bits(),
        params.target_lon.to_bits(),
    ]
}

/// Writes `params` as the api-server sends it to PostgreSQL, rewrites every number as `numeric`
/// prints it, and parses the result as the api-server reads it back.
fn through_jsonb(params: &Value) -> Value {
    let object = params.as_object().expect("params are an object");
    let fields: Vec<String> = object
        .iter()
        .map(|(name, value)| {
            let Value::Number(number) = value else {
                panic!("{name} is not a number: {value}");
            };
            format!("{name:?}:{}", numeric_text(&number.to_string()))
        })
        .collect();
    let text = format!("{{{}}}", fields.join(","));
    serde_json::from_str(&text).unwrap_or_else(|error| panic!("{text}: {error}"))
}

/// PostgreSQL's `numeric` output for a JSON number: the exact decimal value, no exponent, as many
/// fraction digits as the input had after applying the exponent, and no negative zero.
fn numeric_text(json: &str) -> String {
    let (mantissa, exponent) = match json.split_once(['e', 'E']) {
        Some((mantissa, exponent)) => (mantissa, exponent.parse::<i64>().expect("exponent")),
        None => (json, 0),
    };
    let (negative, mantissa) = match mantissa.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, mantissa),
    };
    let (integer, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = format!("{integer}{fraction}");
    // The decimal point sits `point` digits from the left of `digits`.
    let point = i64::try_from(integer.len()).expect("short") + exponent;
    let scale = (i64::try_from(fraction.len()).expect("short") - exponent).max(0);
    let padded_left = if point <= 0 {
        format!(
            "{}{digits}",
            "0".repeat(usize::try_from(1 - point).expect("small"))
        )
    } else {
        digits
    };
    let point = point.max(1);
    let total = usize::try_from(point + scale).expect("small");
    let padded = format!("{padded_left:0<total$}");
    let split = usize::try_from(point).expect("small");
    let (whole, fraction) = padded.split_at(split);
    let whole = whole.trim_start_matches('0');
    let whole = if whole.is_empty() { "0" } else { whole };
    let body = if fraction.is_empty() {
        whole.to_owned()
    } else {
        format!("{whole}.{fraction}")
    };
    let zero = body.bytes().all(|b| b == b'0' || b == b'.');
    if negative && !zero {
        format!("-{body}")
    } else {
        body
    }
}
