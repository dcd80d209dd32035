//! Configuration, read once from the environment at start-up into typed structs. Every variable
//! is documented with its default in docs/configuration.md.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

pub use telemetry::Secret;
use telemetry::settings::Vars;

use crate::{
    admission::peer::{Networks, TrustedProxies},
    idempotency::{Batching, WaitConfig},
    limits::{LimitsConfig, Rate},
};

#[derive(Clone, Debug)]
pub struct Config {
    pub database: DatabaseConfig,
    pub grpc_listen_addr: SocketAddr,
    pub stripe: StripeConfig,
    pub idempotency: IdempotencyConfig,
    pub price: Price,
    /// The completer's credential: lets its holder call CreateRide on behalf of any user. Unset
    /// disables on-behalf-of calls entirely.
    pub internal_api_token: Option<Secret>,
    pub serving: ServingConfig,
    /// Per-user limits of this process (see `crate::limits`).
    pub limits: LimitsConfig,
    pub transport: TransportConfig,
    /// Set: the gRPC listener speaks TLS only.
    pub tls: Option<TlsConfig>,
    /// Peers that may name the client they relay (`admission::peer`).
    pub trusted_proxies: TrustedProxies,
}

/// A peer's refusal budget holds this many seconds of its refill rate.
const REFUSAL_BURST_SECS: f64 = 4.0;

/// The gRPC listener's limits: what one peer, or many, may hold open (see `listener`).
#[derive(Clone, Copy, Debug)]
pub struct TransportConfig {
    /// Advertised in HTTP/2 SETTINGS: streams one connection may have open at once.
    pub max_concurrent_streams: u32,
    /// Open connections in all; more are closed right after accept.
    pub max_connections: usize,
    /// Open connections from one peer IP address; more are closed right after accept.
    pub max_connections_per_ip: usize,
    /// Descriptors under the open-file limit that no inbound connection may take: the database
    /// pool's and the provider's sockets need them, or every admitted call stalls.
    pub reserved_descriptors: u64,
    /// Calls of one peer address refused before the database (credentials, limits) that it may
    /// earn before it is shut out (`crate::penalty`).
    pub refusals_per_ip: Rate,
    pub refusal_cooldown: Duration,
    /// A connection must complete the TLS handshake (if any) and send the HTTP/2 preface within
    /// this, or it is closed.
    pub preface_timeout: Duration,
    /// HTTP/2 PING interval, and how long an unanswered PING waits before the connection closes.
    pub keepalive_interval: Duration,
    pub keepalive_timeout: Duration,
    /// A connection whose peer opens no stream and sends no data for this long is closed.
    pub idle_timeout: Duration,
    /// After this a connection is asked to go away (GOAWAY) and given `max_connection_age_grace`
    /// to finish its calls before it is closed.
    pub max_connection_age: Duration,
    pub max_connection_age_grace: Duration,
    /// Idle time before the kernel's TCP keepalive probes start.
    pub tcp_keepalive: Duration,
    /// Longest a call may run before it is answered CANCELLED (tonic's server timeout).
    pub request_timeout: Duration,
    /// Streams the peer made the server reset (protocol errors) before the connection is closed
    /// with GOAWAY: h2's reset-flood protection.
    pub max_local_error_reset_streams: usize,
}

/// PEM files for the gRPC listener. Re-read on SIGHUP and when their modification times change.
#[derive(Clone, Debug)]
pub struct TlsConfig {
    pub cert_path: PathBuf,
    pub key_path: PathBuf,
    /// Set: clients must present a certificate signed by one of these CAs (mutual TLS).
    pub client_ca_path: Option<PathBuf>,
    /// How often the files' modification times are compared.
    pub reload_interval: Duration,
}

#[derive(Clone, Copy, Debug)]
pub struct ServingConfig {
    /// How often health checks the database (`SELECT 1`): NOT_SERVING while it is unreachable.
    pub health_check_interval: Duration,
    /// After SIGTERM, how long to keep serving while health already says NOT_SERVING, so load
    /// balancers stop sending new calls before the listener closes.
    pub drain_delay: Duration,
}

#[derive(Clone, Debug)]
pub struct DatabaseConfig {
    /// May carry a password, hence secret.
    pub url: Secret,
    /// Where the liveness session connects (`DATABASE_LIVENESS_URL`, default `url`): it holds a
    /// session-level advisory lock, so it must reach PostgreSQL directly or through a
    /// session-mode pool, never a transaction-mode pooler (`schema::liveness`).
    pub liveness_url: Secret,
    pub pool_size: u32,
    /// How long a request waits for a pooled connection before it fails with UNAVAILABLE.
    pub pool_timeout: Duration,
}

/// Stripe: the `provider` crate's configuration, read here from the api-server's variables.
pub use provider::StripeConfig;

#[derive(Clone, Copy, Debug)]
pub struct IdempotencyConfig {
    /// A lock older than this is considered abandoned and may be taken over.
    pub lock_timeout: Duration,
    /// How long a key lives before the reaper retires it.
    pub key_ttl: Duration,
    /// How concurrent claims share statements.
    pub claim_batching: Batching,
    /// How concurrent requests' write phases (ride created, charge recorded, receipt staged)
    /// share statements, each phase with its own batches.
    pub phase_batching: Batching,
    /// How long, and how many, duplicates wait for the attempt in flight on their key.
    pub wait: WaitConfig,
}

/// The price of a ride, in the currency's smallest unit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Price {
    pub amount: i64,
    pub currency: String,
}

pub use telemetry::settings::ConfigError;

pub use schema::DEFAULT_DATABASE_URL;
pub const DEFAULT_GRPC_LISTEN_ADDR: &str = "127.0.0.1:50051";
pub use provider::{DEFAULT_STRIPE_API_BASE, DEFAULT_STRIPE_SECRET_KEY};

impl Config {
    pub fn from_env() -> Result<Config, ConfigError> {
        Config::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads configuration through `lookup`, so tests can configure without touching the process
    /// environment.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let vars = Vars::new(&lookup);
        let price = price(&vars)?;
        let stripe = StripeConfig::from_lookup(&lookup)?;
        let database_url = vars.string("DATABASE_URL", DEFAULT_DATABASE_URL);
        let config = Config {
            database: DatabaseConfig {
                liveness_url: Secret::new(vars.string("DATABASE_LIVENESS_URL", &database_url)),
                url: Secret::new(database_url),
                pool_size: vars.parse("DATABASE_POOL_SIZE", 16_u32)?,
                pool_timeout: vars.millis("DATABASE_POOL_TIMEOUT_MS", 5000)?,
            },
            grpc_listen_addr: vars.parse(
                "GRPC_LISTEN_ADDR",
                SocketAddr::from(([127, 0, 0, 1], 50051)),
            )?,
            idempotency: idempotency(&vars, stripe.timeout)?,
            stripe,
            price,
            serving: ServingConfig {
                health_check_interval: vars
                    .millis("HEALTH_CHECK_INTERVAL_MS", 5000)?
                    .max(Duration::from_millis(10)),
                drain_delay: vars.millis("SHUTDOWN_DRAIN_DELAY_MS", 0)?,
            },
            limits: limits(&vars)?,
            transport: transport(&vars)?,
            tls: tls_config(&vars)?,
            trusted_proxies: TrustedProxies {
                proxy_protocol: vars.parse("GRPC_TRUSTED_PROXIES", Networks::default())?,
                http: vars.parse("GRPC_TRUSTED_HTTP_PROXIES", Networks::default())?,
            },
            internal_api_token: lookup("INTERNAL_API_TOKEN")
                .filter(|token| !token.is_empty())
                .map(Secret::new),
        };
        if config
            .internal_api_token
            .as_ref()
            .is_some_and(|token| token.expose().len() < 32)
        {
            return Err(ConfigError::Invalid {
                name: "INTERNAL_API_TOKEN",
                reason: "must be at least 32 characters".into(),
            });
        }
        config.stripe.refuse_placeholders(
            config
                .internal_api_token
                .as_ref()
                .map(|token| token.expose()),
        )?;
        config.transport.validate(config.stripe.timeout)?;
        if config.database.pool_size == 0 {
            return Err(ConfigError::Invalid {
                name: "DATABASE_POOL_SIZE",
                reason: "must be at least 1".into(),
            });
        }
        // The lock must outlive a charge that is still waiting on the provider, or a second
        // attempt could take the key over while the first is mid-charge.
        if config.idempotency.lock_timeout <= config.stripe.timeout {
            return Err(ConfigError::Invalid {
                name: "IDEMPOTENCY_LOCK_TIMEOUT_SECS",
                reason: "must be longer than STRIPE_TIMEOUT_MS".into(),
            });
        }
        Ok(config)
    }
}

/// The price of a ride, in the currency's smallest unit.
fn price(vars: &Vars<'_>) -> Result<Price, ConfigError> {
    let price = Price {
        amount: vars.parse("RIDE_PRICE_AMOUNT", 2000_i64)?,
        currency: vars.string("RIDE_PRICE_CURRENCY", "usd"),
    };
    if price.amount <= 0 {
        return Err(ConfigError::Invalid {
            name: "RIDE_PRICE_AMOUNT",
            reason: "must be a positive number of cents".into(),
        });
    }
    if price.currency.len() != 3 || !price.currency.bytes().all(|b| b.is_ascii_lowercase()) {
        return Err(ConfigError::Invalid {
            name: "RIDE_PRICE_CURRENCY",
            reason: "must be a lower-case ISO 4217 code such as usd".into(),
        });
    }
    Ok(price)
}

/// The listener's limits and timeouts (docs/security.md).
fn transport(vars: &Vars<'_>) -> Result<TransportConfig, ConfigError> {
    Ok(TransportConfig {
        max_concurrent_streams: vars.parse("GRPC_MAX_CONCURRENT_STREAMS", 128)?,
        max_connections: vars.parse("GRPC_MAX_CONNECTIONS", 10_000)?,
        max_connections_per_ip: vars.parse("GRPC_MAX_CONNECTIONS_PER_IP", 256)?,
        reserved_descriptors: vars.parse(
            "GRPC_RESERVED_DESCRIPTORS",
            telemetry::accept::DEFAULT_RESERVED_DESCRIPTORS,
        )?,
        refusals_per_ip: {
            // Only failed authentications count, and an address that presented a valid
            // credential is never shut out: 40 in 4 s is no legitimate client.
            let per_sec = vars.parse("GRPC_REFUSALS_PER_IP_PER_SEC", 10.0)?;
            Rate {
                per_sec,
                burst: (per_sec * REFUSAL_BURST_SECS).max(1.0),
            }
        },
        refusal_cooldown: vars.secs("GRPC_REFUSAL_COOLDOWN_SECS", 10)?,
        preface_timeout: vars.millis("GRPC_PREFACE_TIMEOUT_MS", 10_000)?,
        keepalive_interval: vars.secs("GRPC_KEEPALIVE_INTERVAL_SECS", 60)?,
        keepalive_timeout: vars.secs("GRPC_KEEPALIVE_TIMEOUT_SECS", 20)?,
        idle_timeout: vars.millis("GRPC_IDLE_TIMEOUT_MS", 300_000)?,
        max_connection_age: vars.secs("GRPC_MAX_CONNECTION_AGE_SECS", 1800)?,
        max_connection_age_grace: vars.secs("GRPC_MAX_CONNECTION_AGE_GRACE_SECS", 60)?,
        tcp_keepalive: vars.secs("GRPC_TCP_KEEPALIVE_SECS", 60)?,
        request_timeout: vars.secs("GRPC_REQUEST_TIMEOUT_SECS", 120)?,
        max_local_error_reset_streams: vars.parse("GRPC_MAX_LOCAL_ERROR_RESET_STREAMS", 1024)?,
    })
}

/// The idempotency settings. A duplicate waits by default a little longer than the provider
/// call its key's holder may be in (`STRIPE_TIMEOUT_MS` + 1 s), so that it gets that call's answer.
fn idempotency(
    vars: &Vars<'_>,
    stripe_timeout: Duration,
) -> Result<IdempotencyConfig, ConfigError> {
    let batching = |size: &'static str, in_flight: &'static str| -> Result<Batching, ConfigError> {
        // `Batcher::new` raises 0 to 1 for both.
        Ok(Batching {
            max_size: vars.parse(size, Batching::default().max_size)?,
            in_flight: vars.parse(in_flight, Batching::default().in_flight)?,
        })
    };
    let default_wait =
        u64::try_from((stripe_timeout + WAIT_OVER_PROVIDER).as_millis()).unwrap_or(u64::MAX);
    let config = IdempotencyConfig {
        lock_timeout: contract::key::lock_timeout(vars)?,
        key_ttl: contract::key::key_ttl(vars)?,
        claim_batching: batching("CLAIM_BATCH_SIZE", "CLAIM_BATCHES_IN_FLIGHT")?,
        phase_batching: batching("PHASE_BATCH_SIZE", "PHASE_BATCHES_IN_FLIGHT")?,
        wait: WaitConfig {
            max: vars.millis("IDEMPOTENCY_WAIT_MAX_MS", default_wait)?,
            per_key: vars.parse("IDEMPOTENCY_WAITERS_PER_KEY", 8)?,
            per_process: vars.parse("IDEMPOTENCY_WAITERS_MAX", 1024)?,
        },
    };
    // Zero would be a wait nobody may take: `IDEMPOTENCY_WAIT_MAX_MS=0` is how waiting is off.
    for (name, zero) in [
        ("IDEMPOTENCY_WAITERS_PER_KEY", config.wait.per_key == 0),
        ("IDEMPOTENCY_WAITERS_MAX", config.wait.per_process == 0),
    ] {
        if zero {
            return Err(ConfigError::Invalid {
                name,
                reason: "must be at least 1 (IDEMPOTENCY_WAIT_MAX_MS=0 turns waiting off)".into(),
            });
        }
    }
    Ok(config)
}

/// How much longer than the provider timeout a duplicate waits by default.
const WAIT_OVER_PROVIDER: Duration = Duration::from_secs(1);

fn limits(vars: &Vars<'_>) -> Result<LimitsConfig, ConfigError> {
    let rate = |per_sec: &'static str, burst: &'static str, default: f64| {
        let rate = Rate {
            per_sec: vars.parse(per_sec, default)?,
            burst: vars.parse(burst, default * 2.0)?,
        };
        if !(rate.per_sec.is_finite() && rate.per_sec > 0.0) {
            return Err(ConfigError::Invalid {
                name: per_sec,
                reason: "must be a positive number of calls per second".into(),
            });
        }
        if !(rate.burst.is_finite() && rate.burst >= 1.0) {
            return Err(ConfigError::Invalid {
                name: burst,
                reason: "must be at least 1".into(),
            });
        }
        Ok(rate)
    };
    let config = LimitsConfig {
        create: rate("RATE_LIMIT_CREATE_PER_SEC", "RATE_LIMIT_CREATE_BURST", 50.0)?,
        get: rate("RATE_LIMIT_GET_PER_SEC", "RATE_LIMIT_GET_BURST", 200.0)?,
        max_concurrent_creates: vars.parse("MAX_CONCURRENT_CREATES_PER_USER", 16)?,
        decline_budget: vars.parse("DECLINE_BUDGET_PER_10_MIN", 20)?,
        max_tracked_callers: vars.parse("RATE_LIMIT_MAX_TRACKED_USERS", 100_000)?,
        unknown_token_ttl: vars.millis("UNKNOWN_TOKEN_CACHE_TTL_MS", 60_000)?,
        unknown_token_capacity: vars.parse("UNKNOWN_TOKEN_CACHE_SIZE", 10_000)?,
        known_token_ttl: vars.secs("KNOWN_TOKEN_CACHE_TTL_SECS", 3600)?,
        known_token_capacity: vars.parse("KNOWN_TOKEN_CACHE_SIZE", 1_000_000)?,
        max_concurrent_token_lookups: vars.optional("MAX_CONCURRENT_TOKEN_LOOKUPS")?,
        token_lookup_queue: vars.parse("TOKEN_LOOKUP_QUEUE_SIZE", 4096)?,
        token_lookup_wait: vars.millis("TOKEN_LOOKUP_QUEUE_TIMEOUT_MS", 2000)?,
        service_share_creates: vars.parse("SERVICE_SHARE_CREATES", 1024)?,
    };
    // Zero would refuse every call (or every new key) of every user: never what was meant.
    let zero = [
        (
            "MAX_CONCURRENT_CREATES_PER_USER",
            config.max_concurrent_creates == 0,
        ),
        ("DECLINE_BUDGET_PER_10_MIN", config.decline_budget == 0),
        (
            "RATE_LIMIT_MAX_TRACKED_USERS",
            config.max_tracked_callers == 0,
        ),
        (
            "MAX_CONCURRENT_TOKEN_LOOKUPS",
            config.max_concurrent_token_lookups == Some(0),
        ),
        (
            "TOKEN_LOOKUP_QUEUE_TIMEOUT_MS",
            config.token_lookup_wait.is_zero(),
        ),
    ];
    if let Some((name, _)) = zero.into_iter().find(|(_, zero)| *zero) {
        return Err(ConfigError::Invalid {
            name,
            reason: "must be at least 1".into(),
        });
    }
    Ok(config)
}

impl TransportConfig {
    fn validate(&self, stripe_timeout: Duration) -> Result<(), ConfigError> {
        let positive = [
            (
                "GRPC_MAX_CONCURRENT_STREAMS",
                self.max_concurrent_streams == 0,
            ),
            ("GRPC_MAX_CONNECTIONS", self.max_connections == 0),
            (
                "GRPC_MAX_CONNECTIONS_PER_IP",
                self.max_connections_per_ip == 0,
            ),
            ("GRPC_PREFACE_TIMEOUT_MS", self.preface_timeout.is_zero()),
            (
                "GRPC_KEEPALIVE_INTERVAL_SECS",
                self.keepalive_interval.is_zero(),
            ),
            (
                "GRPC_KEEPALIVE_TIMEOUT_SECS",
                self.keepalive_timeout.is_zero(),
            ),
            ("GRPC_TCP_KEEPALIVE_SECS", self.tcp_keepalive.is_zero()),
            (
                "GRPC_REFUSALS_PER_IP_PER_SEC",
                !(self.refusals_per_ip.per_sec.is_finite() && self.refusals_per_ip.per_sec > 0.0),
            ),
            (
                "GRPC_REFUSAL_COOLDOWN_SECS",
                self.refusal_cooldown.is_zero(),
            ),
            (
                "GRPC_MAX_CONNECTION_AGE_SECS",
                self.max_connection_age.is_zero(),
            ),
            (
                "GRPC_MAX_LOCAL_ERROR_RESET_STREAMS",
                self.max_local_error_reset_streams == 0,
            ),
        ];
        if let Some((name, _)) = positive.into_iter().find(|(_, zero)| *zero) {
            return Err(ConfigError::Invalid {
                name,
                reason: "must be at least 1".into(),
            });
        }
        // A CreateRide may wait on the provider for the whole Stripe timeout: cutting it short
        // would leave its key locked until the lock times out.
        if self.request_timeout <= stripe_timeout {
            return Err(ConfigError::Invalid {
                name: "GRPC_REQUEST_TIMEOUT_SECS",
                reason: "must be longer than STRIPE_TIMEOUT_MS".into(),
            });
        }
        // A valid credential vouches for its peer this long: no call of an admitted peer may
        // outlive it, or a shut-out could cut an admitted call (`penalty`).
        if self.request_timeout >= crate::penalty::VALID_CREDENTIAL_MEMORY {
            return Err(ConfigError::Invalid {
                name: "GRPC_REQUEST_TIMEOUT_SECS",
                reason: format!(
                    "must be shorter than {} s",
                    crate::penalty::VALID_CREDENTIAL_MEMORY.as_secs()
                ),
            });
        }
        // The idle timer does not see calls in flight, only what the peer sends: a call may not
        // outlive it, or a peer waiting quietly on a slow answer would be cut off.
        if self.idle_timeout <= self.request_timeout {
            return Err(ConfigError::Invalid {
                name: "GRPC_IDLE_TIMEOUT_MS",
                reason: "must be longer than GRPC_REQUEST_TIMEOUT_SECS".into(),
            });
        }
        Ok(())
    }
}

fn tls_config(vars: &Vars<'_>) -> Result<Option<TlsConfig>, ConfigError> {
    let path = |name: &str| vars.raw(name);
    let reload_interval = vars
        .secs("GRPC_TLS_RELOAD_SECS", 5)?
        .max(Duration::from_secs(1));
    match (path("GRPC_TLS_CERT"), path("GRPC_TLS_KEY")) {
        (Some(cert), Some(key)) => Ok(Some(TlsConfig {
            cert_path: cert.into(),
            key_path: key.into(),
            client_ca_path: path("GRPC_TLS_CLIENT_CA").map(PathBuf::from),
            reload_interval,
        })),
        (None, None) if path("GRPC_TLS_CLIENT_CA").is_some() => Err(ConfigError::Invalid {
            name: "GRPC_TLS_CLIENT_CA",
            reason: "needs GRPC_TLS_CERT and GRPC_TLS_KEY".into(),
        }),
        (None, None) => Ok(None),
        (Some(_), None) => Err(ConfigError::Invalid {
            name: "GRPC_TLS_KEY",
            reason: "must be set with GRPC_TLS_CERT".into(),
        }),
        (None, Some(_)) => Err(ConfigError::Invalid {
            name: "GRPC_TLS_CERT",
            reason: "must be set with GRPC_TLS_KEY".into(),
        }),
    }
}

#[cfg(test)]
mod tests;
