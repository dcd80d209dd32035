//! The configuration's unit tests: the defaults, bad values refused by name, the example
//! credentials refused against the real Stripe, and secrets kept out of `Debug` output. Beside
//! config.rs rather than inside it so that the reading code stays short enough to read whole.

use std::collections::HashMap;

use super::*;

fn config(vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
    let vars: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Config::from_lookup(|name| vars.get(name).cloned())
}

#[test]
fn defaults_match_the_readme() {
    let config = config(&[]).unwrap();
    assert_eq!(
        config.grpc_listen_addr.to_string(),
        DEFAULT_GRPC_LISTEN_ADDR
    );
    assert_eq!(config.database.url.expose(), DEFAULT_DATABASE_URL);
    assert_eq!(config.database.pool_size, 16);
    assert_eq!(config.stripe.timeout, Duration::from_secs(30));
    assert_eq!(config.stripe.api_base, DEFAULT_STRIPE_API_BASE);
    assert_eq!(
        config.stripe.idempotency_window,
        Duration::from_secs(86_400)
    );
    assert_eq!(config.idempotency.lock_timeout, Duration::from_secs(90));
    assert_eq!(
        config.database.liveness_url.expose(),
        config.database.url.expose(),
        "the liveness session goes where the pool goes unless told otherwise"
    );
    assert_eq!(config.idempotency.key_ttl, Duration::from_secs(72 * 3600));
    assert_eq!(
        config.idempotency.wait,
        WaitConfig {
            max: Duration::from_millis(31_000),
            per_key: 8,
            per_process: 1024,
        }
    );
    assert_eq!(
        config.price,
        Price {
            amount: 2000,
            currency: "usd".into()
        }
    );
    assert_default_limits(&config.limits);
    assert_eq!(config.trusted_proxies, TrustedProxies::default());
    assert_default_transport(&config.transport);
    assert!(
        config.tls.is_none(),
        "plaintext unless certificates are set"
    );
}

/// The default rate limits and admission bounds, as documented.
fn assert_default_limits(limits: &LimitsConfig) {
    assert_eq!(
        *limits,
        LimitsConfig {
            create: Rate {
                per_sec: 50.0,
                burst: 100.0
            },
            get: Rate {
                per_sec: 200.0,
                burst: 400.0
            },
            max_concurrent_creates: 16,
            decline_budget: 20,
            max_tracked_callers: 100_000,
            unknown_token_ttl: Duration::from_secs(60),
            unknown_token_capacity: 10_000,
            known_token_ttl: Duration::from_secs(3600),
            known_token_capacity: 1_000_000,
            max_concurrent_token_lookups: None,
            token_lookup_queue: 4096,
            token_lookup_wait: Duration::from_secs(2),
            service_share_creates: 1024,
        }
    );
}

/// The listener's defaults, as documented.
fn assert_default_transport(transport: &TransportConfig) {
    assert_eq!(transport.max_concurrent_streams, 128);
    assert_eq!(transport.max_connections, 10_000);
    assert_eq!(transport.max_connections_per_ip, 256);
    assert_eq!(transport.reserved_descriptors, 256);
    assert_eq!(transport.preface_timeout, Duration::from_secs(10));
    assert_eq!(transport.keepalive_interval, Duration::from_secs(60));
    assert_eq!(transport.keepalive_timeout, Duration::from_secs(20));
    assert_eq!(transport.idle_timeout, Duration::from_secs(300));
    assert_eq!(transport.max_connection_age, Duration::from_secs(1800));
    assert_eq!(transport.max_connection_age_grace, Duration::from_secs(60));
    assert_eq!(transport.tcp_keepalive, Duration::from_secs(60));
    assert_eq!(transport.request_timeout, Duration::from_secs(120));
    assert_eq!(transport.max_local_error_reset_streams, 1024);
    assert_eq!(
        transport.refusals_per_ip,
        Rate {
            per_sec: 10.0,
            burst: 40.0
        }
    );
    assert_eq!(transport.refusal_cooldown, Duration::from_secs(10));
}

/// Settings with a bad value, each with the variable its error must name.
const BAD_VALUES: &[(&[(&str, &str)], &str)] = &[
    (&[("DATABASE_POOL_SIZE", "many")], "DATABASE_POOL_SIZE"),
    (&[("DATABASE_POOL_SIZE", "0")], "DATABASE_POOL_SIZE"),
    // Refused as the reaper refuses it: one rule (`telemetry::settings::Vars::hours`).
    (
        &[("IDEMPOTENCY_KEY_TTL_HOURS", "0")],
        "IDEMPOTENCY_KEY_TTL_HOURS",
    ),
    // Under contract::key::MIN_KEY_TTL_SECS: a retry after reaping would charge again.
    (
        &[("IDEMPOTENCY_KEY_TTL_SECS", "299")],
        "IDEMPOTENCY_KEY_TTL_SECS",
    ),
    // A duration this large would overflow `Instant` arithmetic at run time.
    (
        &[("IDEMPOTENCY_LOCK_TIMEOUT_SECS", "18446744073709551615")],
        "IDEMPOTENCY_LOCK_TIMEOUT_SECS",
    ),
    (
        &[("IDEMPOTENCY_LOCK_TIMEOUT_SECS", "86401")],
        "IDEMPOTENCY_LOCK_TIMEOUT_SECS",
    ),
    (
        &[("GRPC_REFUSAL_COOLDOWN_SECS", "18446744073709551615")],
        "GRPC_REFUSAL_COOLDOWN_SECS",
    ),
    (
        &[("GRPC_MAX_CONNECTION_AGE_SECS", "18446744073709551615")],
        "GRPC_MAX_CONNECTION_AGE_SECS",
    ),
    (
        &[("STRIPE_TIMEOUT_MS", "18446744073709551615")],
        "STRIPE_TIMEOUT_MS",
    ),
    (
        &[("IDEMPOTENCY_KEY_TTL_HOURS", "5124095576030431")],
        "IDEMPOTENCY_KEY_TTL_HOURS",
    ),
    (&[("RIDE_PRICE_AMOUNT", "-5")], "RIDE_PRICE_AMOUNT"),
    (&[("RIDE_PRICE_CURRENCY", "USD")], "RIDE_PRICE_CURRENCY"),
    (&[("GRPC_LISTEN_ADDR", "nowhere")], "GRPC_LISTEN_ADDR"),
    (&[("INTERNAL_API_TOKEN", "short")], "INTERNAL_API_TOKEN"),
    (&[("GRPC_MAX_CONNECTIONS", "0")], "GRPC_MAX_CONNECTIONS"),
    (
        &[("GRPC_MAX_CONNECTION_AGE_SECS", "0")],
        "GRPC_MAX_CONNECTION_AGE_SECS",
    ),
    (
        &[("MAX_CONCURRENT_CREATES_PER_USER", "0")],
        "MAX_CONCURRENT_CREATES_PER_USER",
    ),
    (
        &[("DECLINE_BUDGET_PER_10_MIN", "0")],
        "DECLINE_BUDGET_PER_10_MIN",
    ),
    (
        &[("RATE_LIMIT_MAX_TRACKED_USERS", "0")],
        "RATE_LIMIT_MAX_TRACKED_USERS",
    ),
    (
        &[("MAX_CONCURRENT_TOKEN_LOOKUPS", "0")],
        "MAX_CONCURRENT_TOKEN_LOOKUPS",
    ),
    (
        &[("GRPC_REQUEST_TIMEOUT_SECS", "30")],
        "GRPC_REQUEST_TIMEOUT_SECS",
    ),
    (
        &[
            ("GRPC_REQUEST_TIMEOUT_SECS", "900"),
            ("GRPC_IDLE_TIMEOUT_MS", "1000000"),
        ],
        "GRPC_REQUEST_TIMEOUT_SECS",
    ),
    (
        &[("GRPC_TRUSTED_PROXIES", "10.0.0.0/8,proxy")],
        "GRPC_TRUSTED_PROXIES",
    ),
    (
        &[("GRPC_TRUSTED_HTTP_PROXIES", "proxy")],
        "GRPC_TRUSTED_HTTP_PROXIES",
    ),
    (
        &[("TOKEN_LOOKUP_QUEUE_TIMEOUT_MS", "0")],
        "TOKEN_LOOKUP_QUEUE_TIMEOUT_MS",
    ),
    (&[("GRPC_IDLE_TIMEOUT_MS", "60000")], "GRPC_IDLE_TIMEOUT_MS"),
    (&[("GRPC_TLS_CERT", "/tls/cert.pem")], "GRPC_TLS_KEY"),
    (
        &[("GRPC_TLS_CLIENT_CA", "/tls/ca.pem")],
        "GRPC_TLS_CLIENT_CA",
    ),
    (
        &[("RATE_LIMIT_CREATE_PER_SEC", "0")],
        "RATE_LIMIT_CREATE_PER_SEC",
    ),
    (&[("RATE_LIMIT_GET_BURST", "0.5")], "RATE_LIMIT_GET_BURST"),
    (
        &[
            ("IDEMPOTENCY_LOCK_TIMEOUT_SECS", "10"),
            ("STRIPE_TIMEOUT_MS", "30000"),
        ],
        "IDEMPOTENCY_LOCK_TIMEOUT_SECS",
    ),
];

#[test]
fn rejects_bad_values_by_name() {
    for &(vars, name) in BAD_VALUES {
        match config(vars) {
            Err(ConfigError::Invalid { name: got, .. }) => assert_eq!(got, name),
            Err(ConfigError::Missing { name: got }) => panic!("{got} reported missing"),
            Ok(_) => panic!("{vars:?} was accepted"),
        }
    }
}

#[test]
fn example_credentials_do_not_start_a_server_against_the_real_stripe() {
    // The staging overlay's example values (deploy/k8s/overlays/staging/secrets.fake.env).
    let fake_token = "FAKE-internal-token-0000000000000000000000000000-change-me";
    let production = [
        ("STRIPE_API_BASE", "https://api.stripe.com"),
        ("DEPLOYMENT_ID", "prod"),
        ("STRIPE_SECRET_KEY", "sk_live_9vT2mLc8bNfk7QwZp3xR"),
    ];
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut vars = production.to_vec();
        vars.extend_from_slice(extra);
        config(&vars)
    };
    for (extra, name) in [
        (
            vec![("INTERNAL_API_TOKEN", fake_token)],
            "INTERNAL_API_TOKEN",
        ),
        (
            vec![("INTERNAL_API_TOKEN", "0123456789abcdef0123456789abcdef")],
            "INTERNAL_API_TOKEN",
        ),
        (
            vec![(
                "STRIPE_SECRET_KEY",
                "sk_test_FAKE_staging_key_for_fake_stripe_only",
            )],
            "STRIPE_SECRET_KEY",
        ),
        (
            vec![("STRIPE_SECRET_KEY", DEFAULT_STRIPE_SECRET_KEY)],
            "STRIPE_SECRET_KEY",
        ),
    ] {
        match with(&extra) {
            Err(ConfigError::Invalid { name: refused, .. }) => assert_eq!(refused, name),
            other => panic!("{extra:?} was not refused: {other:?}"),
        }
    }
    assert!(with(&[("INTERNAL_API_TOKEN", "k7Qw9vT2mLc8bNfZp3xR5eLuJoYgWiXvA")]).is_ok());
    // Against fake-stripe (development: local runs, tests, bench, proof) they start.
    assert!(config(&[("INTERNAL_API_TOKEN", fake_token)]).is_ok());
}

#[test]
fn secrets_stay_out_of_debug_output() {
    let config = config(&[
        ("STRIPE_SECRET_KEY", "sk_live_very_secret"),
        ("DEPLOYMENT_ID", "prod"),
        ("DATABASE_URL", "postgres://u:hunter2@db/x"),
        (
            "INTERNAL_API_TOKEN",
            "internal-token-that-is-long-enough-0123",
        ),
    ])
    .unwrap();
    let printed = format!("{config:?}");
    assert!(!printed.contains("very_secret"));
    assert!(!printed.contains("hunter2"));
    assert!(!printed.contains("long-enough"));
}
