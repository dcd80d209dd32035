//! Configuration, read once at start-up from the environment into typed structs. Every variable
//! and its default is listed in `docs/workers.md`. Each worker takes only its own section, so
//! tests build those sections directly.

use std::time::Duration;

use proto::client::ClientTls;

use contract::key::LockRule;
pub use telemetry::Secret;
use telemetry::settings::Vars;

pub use schema::DEFAULT_DATABASE_URL;
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
pub const DEFAULT_SMTP_URL: &str = "smtp://127.0.0.1:2525";
pub const DEFAULT_RECEIPT_FROM: &str = "Rocket Rides <receipts@rocketrides.test>";
pub const DEFAULT_API_SERVER_URL: &str = "http://127.0.0.1:50051";
pub const DEFAULT_TOPOLOGY_PREFIX: &str = "rides";
pub use provider::{DEFAULT_STRIPE_API_BASE, DEFAULT_STRIPE_SECRET_KEY};

#[derive(Clone, Debug)]
pub struct Config {
    pub database_url: Secret,
    pub database_pool_size: u32,
    pub amqp_url: Secret,
    pub topology_prefix: String,
    pub receipt_delivery_limit: u32,
    pub enqueuer: EnqueuerConfig,
    pub receipts: ReceiptsConfig,
    pub completer: CompleterConfig,
    pub reaper: ReaperConfig,
    pub reconciler: ReconcilerConfig,
}

#[derive(Clone, Debug)]
pub struct EnqueuerConfig {
    /// Jobs selected (and locked) per transaction.
    pub batch_size: i64,
    /// The longest an idle enqueuer sleeps between polls.
    pub idle_max: Duration,
    /// How long to wait for the broker to confirm a batch before treating it as lost.
    pub confirm_timeout: Duration,
    /// Returned or refused publications after which a job is parked for a human.
    pub max_attempts: i32,
    /// Delay before a returned or refused job is tried again, doubled per attempt up to
    /// `backoff_max`.
    pub backoff_base: Duration,
    pub backoff_max: Duration,
}

#[derive(Clone, Debug)]
pub struct ReceiptsConfig {
    /// May hold the relay's password (see `mailer`).
    pub smtp_url: Secret,
    pub from: String,
    pub smtp_timeout: Duration,
    /// Unacknowledged deliveries in flight per worker.
    pub prefetch: u16,
    /// The most deliveries handled as one batch (one claim and one record statement).
    pub batch_size: u16,
    /// How long a batch may wait to fill while others are in flight.
    pub batch_wait: Duration,
    /// SMTP connections kept open to the relay, and conversations at once.
    pub smtp_connections: u32,
    /// Delay before a temporarily failed delivery is requeued, doubled per redelivery.
    pub retry_base_delay: Duration,
    pub retry_max_delay: Duration,
    /// The relay's message search (Mailpit's API), asked before re-sending a receipt whose earlier
    /// attempt may have reached the relay. Unset: such receipts are re-sent unverified.
    pub mail_search_url: Option<String>,
    /// How long a claim on a ride's receipt lets one attempt talk to the relay undisturbed. Longer
    /// than a whole SMTP conversation (each send is cut off at `smtp_timeout`).
    pub claim_lease: Duration,
}

#[derive(Clone, Debug)]
pub struct CompleterConfig {
    pub api_server_url: String,
    /// TLS files for an `https://` `api_server_url` (`API_SERVER_CA`, `API_SERVER_CLIENT_CERT`,
    /// `API_SERVER_CLIENT_KEY`).
    pub api_server_tls: ClientTls,
    pub internal_api_token: Option<Secret>,
    /// A key is a candidate once this old and idle this long, unless its lock's holder is gone
    /// (then at once: nobody else will finish it).
    pub min_age: Duration,
    pub idle: Duration,
    /// `IDEMPOTENCY_LOCK_TIMEOUT_SECS` and the provider's key window: which locked keys are
    /// free to complete.
    pub lock_rule: LockRule,
    pub batch_size: i64,
    pub backoff_base: Duration,
    pub backoff_max: Duration,
    pub max_attempts: i32,
    /// How long a claimed key is reserved for the completer that claimed it.
    pub lease: Duration,
    pub rpc_timeout: Duration,
    /// Pause between passes of the loop.
    pub interval: Duration,
}

#[derive(Clone, Debug)]
pub struct ReaperConfig {
    pub key_ttl: Duration,
    pub lock_rule: LockRule,
    pub batch_size: i64,
    pub interval: Duration,
}

#[derive(Clone, Debug)]
pub struct ReconcilerConfig {
    /// The provider (`STRIPE_API_BASE`, `STRIPE_SECRET_KEY`, `STRIPE_TIMEOUT_MS`, the same
    /// variables as the api-server's).
    pub stripe: provider::StripeConfig,
    /// A window ends this long before now, so that a CreateRide still between its charge and the
    /// commit that records it is not read half-way.
    pub settle_delay: Duration,
    /// Each pass starts this long before the watermark, re-reading the end of the last window
    /// (a ride committed late, a provider list that lagged).
    pub overlap: Duration,
    /// Where the first pass starts when there is no watermark yet: this long before now.
    pub initial_lookback: Duration,
    /// The longest window one pass reads; a loop catching up goes on at once.
    pub max_window: Duration,
    /// A pass compares its window this much at a time, so that it holds one slice's charges and
    /// rides in memory, not the window's (an hour of overlap at 140 rides/s held 736 MB).
    pub slice: Duration,
    /// Pause between passes of the loop.
    pub interval: Duration,
    /// `--refund` refunds at most this many findings per pass (`RECONCILER_REFUND_MAX_FINDINGS`);
    /// the rest wait for the next pass or an operator's `findings refund`.
    pub refund_max_findings: u32,
    /// ... and at most this much money per pass, in the currencies' smallest units summed
    /// (`RECONCILER_REFUND_MAX_AMOUNT`).
    pub refund_max_amount: i64,
}

pub use telemetry::settings::ConfigError;

impl Config {
    pub fn from_env() -> Result<Config, ConfigError> {
        Config::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads configuration through `lookup`, so tests never touch the process environment.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let vars = Vars::new(&lookup);
        let stripe = provider::StripeConfig::from_lookup(&lookup)?;
        let lock_rule = LockRule::new(
            contract::key::lock_timeout(&vars)?,
            stripe.idempotency_window,
        );
        let config = Config {
            database_url: Secret::new(vars.string("DATABASE_URL", DEFAULT_DATABASE_URL)),
            database_pool_size: vars.positive("DATABASE_POOL_SIZE", 20)?,
            amqp_url: Secret::new(vars.string("AMQP_URL", DEFAULT_AMQP_URL)),
            topology_prefix: vars.string("AMQP_TOPOLOGY_PREFIX", DEFAULT_TOPOLOGY_PREFIX),
            receipt_delivery_limit: vars.positive("RECEIPTS_DELIVERY_LIMIT", 10)?,
            enqueuer: enqueuer(&vars)?,
            receipts: receipts(&vars)?,
            completer: completer(&vars, lock_rule)?,
            reaper: ReaperConfig {
                key_ttl: contract::key::key_ttl(&vars)?,
                lock_rule,
                batch_size: vars.positive("REAPER_BATCH_SIZE", 1000)?,
                interval: vars.secs("REAPER_INTERVAL_SECS", 600)?,
            },
            reconciler: reconciler(&vars, stripe)?,
        };
        config.reconciler.stripe.refuse_placeholders(
            config
                .completer
                .internal_api_token
                .as_ref()
                .map(|token| token.expose()),
        )?;
        Ok(config)
    }
}

fn enqueuer(vars: &Vars<'_>) -> Result<EnqueuerConfig, ConfigError> {
    Ok(EnqueuerConfig {
        batch_size: vars.positive("ENQUEUER_BATCH_SIZE", 1000)?,
        idle_max: vars.millis("ENQUEUER_IDLE_MAX_MS", 250)?,
        confirm_timeout: vars.millis("ENQUEUER_CONFIRM_TIMEOUT_MS", 30_000)?,
        max_attempts: vars.positive("ENQUEUER_MAX_ATTEMPTS", 20)?,
        // Zero would set a job aside only to select it again in the same pass.
        backoff_base: vars.positive_millis("ENQUEUER_BACKOFF_BASE_MS", 1000)?,
        backoff_max: vars.millis("ENQUEUER_BACKOFF_MAX_MS", 300_000)?,
    })
}

fn receipts(vars: &Vars<'_>) -> Result<ReceiptsConfig, ConfigError> {
    let smtp_timeout = vars.secs("SMTP_TIMEOUT_SECS", 30)?;
    let claim_lease = vars.secs("RECEIPTS_CLAIM_LEASE_SECS", 120)?;
    if claim_lease <= smtp_timeout {
        // A claim that lapses while its holder may still be sending lets a second attempt
        // send the same receipt.
        return Err(ConfigError::Invalid {
            name: "RECEIPTS_CLAIM_LEASE_SECS",
            reason: "must be longer than SMTP_TIMEOUT_SECS".into(),
        });
    }
    Ok(ReceiptsConfig {
        smtp_url: Secret::new(vars.string("SMTP_URL", DEFAULT_SMTP_URL)),
        from: vars.string("RECEIPT_FROM", DEFAULT_RECEIPT_FROM),
        smtp_timeout,
        prefetch: vars.positive("RECEIPTS_PREFETCH", 256)?,
        batch_size: vars.positive("RECEIPTS_BATCH_SIZE", 64)?,
        batch_wait: vars.millis("RECEIPTS_BATCH_WAIT_MS", 10)?,
        smtp_connections: vars
            .positive("SMTP_POOL_SIZE", crate::mailer::DEFAULT_SMTP_CONNECTIONS)?,
        retry_base_delay: vars.millis("RECEIPTS_RETRY_BASE_MS", 5000)?,
        retry_max_delay: vars.millis("RECEIPTS_RETRY_MAX_MS", 60_000)?,
        mail_search_url: vars.raw("MAIL_SEARCH_URL"),
        claim_lease,
    })
}

fn completer(vars: &Vars<'_>, lock_rule: LockRule) -> Result<CompleterConfig, ConfigError> {
    Ok(CompleterConfig {
        api_server_url: vars.string("API_SERVER_URL", DEFAULT_API_SERVER_URL),
        api_server_tls: ClientTls {
            ca: vars.path("API_SERVER_CA"),
            cert: vars.path("API_SERVER_CLIENT_CERT"),
            key: vars.path("API_SERVER_CLIENT_KEY"),
        },
        internal_api_token: vars.raw("INTERNAL_API_TOKEN").map(Secret::new),
        min_age: vars.secs("COMPLETER_MIN_AGE_SECS", 300)?,
        idle: vars.secs("COMPLETER_IDLE_SECS", 60)?,
        lock_rule,
        batch_size: vars.positive("COMPLETER_BATCH_SIZE", 100)?,
        backoff_base: vars.secs("COMPLETER_BACKOFF_BASE_SECS", 60)?,
        backoff_max: vars.secs("COMPLETER_BACKOFF_MAX_SECS", 3600)?,
        max_attempts: vars.positive("COMPLETER_MAX_ATTEMPTS", 8)?,
        lease: vars.secs("COMPLETER_LEASE_SECS", 300)?,
        rpc_timeout: vars.secs("COMPLETER_RPC_TIMEOUT_SECS", 60)?,
        interval: vars.secs("COMPLETER_INTERVAL_SECS", 30)?,
    })
}

fn reconciler(
    vars: &Vars<'_>,
    stripe: provider::StripeConfig,
) -> Result<ReconcilerConfig, ConfigError> {
    Ok(ReconcilerConfig {
        stripe,
        settle_delay: vars.secs("RECONCILER_SETTLE_SECS", 900)?,
        overlap: vars.secs("RECONCILER_OVERLAP_SECS", 3600)?,
        initial_lookback: vars.hours("RECONCILER_LOOKBACK_HOURS", 168)?,
        max_window: vars.hours("RECONCILER_MAX_WINDOW_HOURS", 24)?,
        slice: vars.positive_secs("RECONCILER_SLICE_SECS", 60)?,
        interval: vars.secs("RECONCILER_INTERVAL_SECS", 3600)?,
        refund_max_findings: vars.positive("RECONCILER_REFUND_MAX_FINDINGS", 5)?,
        refund_max_amount: vars.positive("RECONCILER_REFUND_MAX_AMOUNT", 10_000)?,
    })
}

impl CompleterConfig {
    /// The completer cannot act on anyone's behalf without the internal credential.
    pub fn token(&self) -> Result<&Secret, ConfigError> {
        self.internal_api_token
            .as_ref()
            .ok_or(ConfigError::Missing {
                name: "INTERNAL_API_TOKEN",
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults() {
        let config = Config::from_lookup(|_| None).unwrap();
        assert_eq!(config.enqueuer.batch_size, 1000);
        assert_eq!(config.enqueuer.max_attempts, 20);
        assert_eq!(config.enqueuer.backoff_base, Duration::from_millis(1000));
        assert_eq!(config.enqueuer.backoff_max, Duration::from_secs(300));
        assert_eq!(config.receipts.prefetch, 256);
        assert_eq!(config.receipts.batch_size, 64);
        assert_eq!(config.receipts.batch_wait, Duration::from_millis(10));
        assert_eq!(config.receipts.smtp_connections, 32);
        assert_eq!(config.completer.batch_size, 100);
        assert_eq!(config.completer.max_attempts, 8);
        assert_eq!(config.completer.min_age, Duration::from_secs(300));
        assert_eq!(config.reaper.key_ttl, Duration::from_secs(72 * 3600));
        assert!(config.completer.token().is_err());
        assert_eq!(config.receipts.smtp_url.expose(), DEFAULT_SMTP_URL);
        assert_eq!(config.receipts.claim_lease, Duration::from_secs(120));
        assert_eq!(config.receipts.mail_search_url, None);
        assert_eq!(config.completer.api_server_tls, ClientTls::default());
        assert_eq!(config.reconciler.settle_delay, Duration::from_secs(900));
        assert_eq!(config.reconciler.overlap, Duration::from_secs(3600));
        assert_eq!(config.reconciler.max_window, Duration::from_secs(24 * 3600));
        assert_eq!(config.reconciler.stripe.api_base, DEFAULT_STRIPE_API_BASE);
        assert!(
            !format!("{:?}", config.reconciler).contains(DEFAULT_STRIPE_SECRET_KEY),
            "the secret key never prints"
        );
    }

    #[test]
    fn rejects_nonsense() {
        let config =
            Config::from_lookup(|name| (name == "ENQUEUER_BATCH_SIZE").then(|| "0".to_owned()));
        assert!(config.is_err());
        let config = Config::from_lookup(|name| {
            (name == "ENQUEUER_BACKOFF_BASE_MS").then(|| "0".to_owned())
        });
        assert!(
            config.is_err(),
            "a zero back-off would retry a returned job at once"
        );
        let config =
            Config::from_lookup(|name| (name == "RECEIPTS_PREFETCH").then(|| "many".to_owned()));
        assert!(config.is_err());
        let config = Config::from_lookup(|name| match name {
            "SMTP_TIMEOUT_SECS" => Some("30".to_owned()),
            "RECEIPTS_CLAIM_LEASE_SECS" => Some("30".to_owned()),
            _ => None,
        });
        assert!(config.is_err(), "a claim lease must outlast a send");
    }

    #[test]
    fn refuses_a_duration_that_would_overflow_at_run_time() {
        for name in [
            "IDEMPOTENCY_LOCK_TIMEOUT_SECS",
            "COMPLETER_LEASE_SECS",
            "RECONCILER_LOOKBACK_HOURS",
            "ENQUEUER_BACKOFF_MAX_MS",
        ] {
            let config = Config::from_lookup(|asked| (asked == name).then(|| u64::MAX.to_string()));
            assert!(
                matches!(config, Err(ConfigError::Invalid { name: refused, .. }) if refused == name),
                "{name}"
            );
        }
    }
}
