//! The Rocket Rides payments API server.
//!
//! Layout, from the outside in:
//! - [`server`]: assembles tonic with health and reflection, and drains on shutdown.
//! - [`listener`]: the accept pipeline in front of tonic: connection caps, handshake and preface
//!   deadline, idle timeout; [`tls`]: certificates, reloaded without dropping connections.
//! - [`grpc`]: the transport. Metadata and messages in, `Status` and responses out.
//! - [`rides`]: CreateRide as a state machine over recovery points (the domain), one file per
//!   phase.
//! - [`idempotency`]: the engine underneath: key claims and fenced atomic phases.
//! - the Stripe client and its error classification are the `provider` crate's, shared with the
//!   workers' reconciler.
//! - [`auth`]: API tokens, stored as digests, and who a call's [`Caller`](auth::Caller) is.
//!
//! Below it: `contract` (what this service and the workers agree on: the stored outcome, the
//! receipt job, the key's fence and finish statements) and `schema` (the database: tables,
//! models, pool, `StoreError` and the retry policy).
//! - [`admission`]: what is decided before a call's own work: who the caller is, token lookups
//!   and the caches of known and unknown tokens, whom a refusal counts against; [`limits`]:
//!   per-user rate limits and the decline budget; [`penalty`]: peers that keep failing
//!   authentication are shut out.
//! - [`config`]: typed configuration, read once from the environment.
//! - [`health_check`]: `api-server health-check`, the exec probe that speaks TLS.
//! - [`fault`]: crash points for the reliability campaign (feature `fault-injection` only).

pub mod admission;
pub mod auth;
pub mod config;
pub mod fault;
pub mod grpc;
pub mod health_check;
pub mod idempotency;
pub mod limits;
pub mod listener;
pub mod message_cap;
pub mod metrics;
pub mod penalty;
pub mod rides;
pub mod server;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tls;

use std::sync::Arc;

use config::{Config, Secret, ServingConfig, TlsConfig, TransportConfig};
use limits::LimitsConfig;
use provider::StripeClient;
use rides::Rides;
use schema::liveness::Liveness;

/// Everything a serving process shares between requests.
#[derive(Clone)]
pub struct App {
    pub rides: Arc<Rides>,
    pub internal_api_token: Option<Secret>,
    pub serving: ServingConfig,
    pub limits: LimitsConfig,
    pub transport: TransportConfig,
    pub tls: Option<TlsConfig>,
    pub trusted_proxies: admission::peer::TrustedProxies,
    pub pool_size: u32,
    /// Whether the server reports SERVING to readiness probes and load balancers (`server::serve`
    /// sets it with their health statuses).
    ready: Arc<tokio::sync::watch::Sender<bool>>,
    /// Reports pool usage while the app lives.
    _pool_gauges: [opentelemetry::metrics::ObservableUpDownCounter<i64>; 2],
}

impl App {
    /// Builds the service from configuration. No pooled connection is opened yet; the liveness
    /// session (`schema::liveness`) starts connecting in the background.
    pub fn from_config(config: &Config) -> Result<App, reqwest::Error> {
        let pool = schema::build_pool(
            config.database.url.expose(),
            config.database.pool_size,
            config.database.pool_timeout,
            // Every api-server statement finds its rows by key; see `PlanCache::Generic`.
            schema::PlanCache::Generic,
        );
        let stripe = StripeClient::new(&config.stripe)?;
        let pool_gauges = metrics::observe_pool(&pool, config.database.pool_size);
        Ok(App {
            _pool_gauges: pool_gauges,
            rides: Rides::new(
                pool,
                stripe,
                config.price.clone(),
                config.idempotency,
                Liveness::start(config.database.liveness_url.expose().to_owned()),
            ),
            internal_api_token: config.internal_api_token.clone(),
            serving: config.serving,
            limits: config.limits,
            transport: config.transport,
            tls: config.tls.clone(),
            trusted_proxies: config.trusted_proxies.clone(),
            pool_size: config.database.pool_size,
            ready: Arc::new(tokio::sync::watch::channel(false).0),
        })
    }

    /// Whether the server reports SERVING to readiness probes and load balancers (`""` and
    /// `rides.v1.RideService`), as it changes: false until `server::serve` first finds the
    /// database and the liveness session up.
    pub fn readiness(&self) -> tokio::sync::watch::Receiver<bool> {
        self.ready.subscribe()
    }
}
