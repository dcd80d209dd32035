//! The campaign's command line. Every fault rate, port and size is a flag so that a failing run
//! can be repeated exactly (`--seed`) or bent towards the fault that broke it.

use std::path::PathBuf;

use clap::Parser;

#[derive(Parser, Debug, Clone)]
#[command(
    name = "proof",
    about = "Crash-and-fault campaign proving exactly-once charging and receipting"
)]
pub(crate) struct Args {
    /// Short campaign (default): 60 s of traffic and faults, the whole run under 3 minutes.
    #[arg(long, conflicts_with = "long")]
    pub(crate) short: bool,
    /// Long campaign: 600 s of traffic and faults (override with --duration-secs).
    #[arg(long)]
    pub(crate) long: bool,
    /// Seconds of traffic and faults (overrides the --short/--long default).
    #[arg(long)]
    pub(crate) duration_secs: Option<u64>,
    /// Concurrent clients: closed loops, one user each unless `--riders-per-client`.
    #[arg(long, default_value_t = 16)]
    pub(crate) clients: u32,
    /// Riders per client: each client is then a backend carrying this many riders' tokens, each
    /// key a random rider's, and every client shares one connection per api-server: the shape of
    /// the production callers (many riders, each rare, over few connections from one address).
    /// 0: one user per client with its own connections.
    #[arg(long, default_value_t = 0)]
    pub(crate) riders_per_client: u32,
    /// The api-servers at their production defaults: the per-user limits, the lock timeout, the
    /// pool and the provider timeout are left unset (the campaign otherwise lifts the limits,
    /// shortens the lock timeout to 6 s and gives api-b a pool of one). The workers keep the
    /// campaign's compressed schedules. Needs `--riders-per-client`: one-user closed loops are
    /// not the callers the limits are set for (a declining one spends its budget in seconds).
    #[arg(long, requires = "riders_per_client")]
    pub(crate) production_defaults: bool,
    /// Every gRPC hop over mutual TLS, with the certificates in this directory (`ca.pem`,
    /// `server.pem`/`.key` for the api-servers, `client.pem`/`.key` for the campaign's clients
    /// and the completer), as `deploy/local/lib.sh`'s `make_tls_certificates` writes them. The
    /// run's own RabbitMQ node then listens for `amqps://` only and the mail sink requires
    /// STARTTLS, both with the server certificate (not with `--ha` or `--shared-services`,
    /// whose brokers are plaintext).
    #[arg(long)]
    pub(crate) tls_dir: Option<PathBuf>,
    /// How many of the clients' users have the declining card `pm_card_chargeDeclined`.
    #[arg(long, default_value_t = 2)]
    pub(crate) declined_clients: u32,
    /// Fraction of keys whose client drops the call mid-request and never comes back.
    #[arg(long, default_value_t = 0.06)]
    pub(crate) drop_ratio: f64,
    /// Fraction of keys whose client makes one attempt and never retries a non-final answer.
    #[arg(long, default_value_t = 0.06)]
    pub(crate) no_retry_ratio: f64,
    /// Attempts per key for retrying clients.
    #[arg(long, default_value_t = 40)]
    pub(crate) max_tries: u32,
    /// Seed of every random choice (clients and fault schedule); random when unset.
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// Mean seconds between api-server SIGKILLs.
    #[arg(long, default_value_t = 4.0)]
    pub(crate) api_kill_every_secs: f64,
    /// Mean seconds between worker (enqueuer / receipts) SIGKILLs.
    #[arg(long, default_value_t = 7.0)]
    pub(crate) worker_kill_every_secs: f64,
    /// Mean seconds between provider fault injections.
    #[arg(long, default_value_t = 2.0)]
    pub(crate) stripe_fault_every_secs: f64,
    /// Directory of the api-server, workers and fake-stripe binaries (default: next to proof).
    #[arg(long)]
    pub(crate) bin_dir: Option<PathBuf>,
    /// Where logs, mail and the report go (default: target/proof/<run id>).
    #[arg(long)]
    pub(crate) out_dir: Option<PathBuf>,
    /// PostgreSQL server and maintenance database; the run's database is created next to it.
    #[arg(
        long,
        env = "TEST_DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub(crate) admin_url: String,
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    pub(crate) amqp_url: String,
    /// Every fixed port is below Linux's ephemeral range (32768–60999): processes restarted
    /// during the run must find their port free, and any outgoing connection may hold a port in
    /// that range (the second api-server once failed to bind 50252 so).
    #[arg(long, default_value_t = 25251)]
    pub(crate) grpc_port: u16,
    #[arg(long, default_value_t = 12311)]
    pub(crate) stripe_port: u16,
    #[arg(long, default_value_t = 2625)]
    pub(crate) smtp_port: u16,
    /// The mail sink's message search (MAIL_SEARCH_URL for the receipt worker).
    #[arg(long, default_value_t = 8626)]
    pub(crate) mail_search_port: u16,
    /// The second api-server: a pool of 1 connection with a 100 ms pool timeout, to exercise pool
    /// exhaustion, except with `--production-defaults`, where it runs at the defaults too.
    #[arg(long, default_value_t = 25252)]
    pub(crate) grpc_port_b: u16,
    /// Put HAProxy (Debian's `haproxy`) in front of both api-servers and send every call
    /// through it (`load_balancer.rs`), rather than each client picking a server per attempt. It
    /// routes to a server only while its readiness probe answers `SERVING`, and the api-servers
    /// get a drain delay, as behind a Kubernetes Service.
    #[arg(long, conflicts_with = "tls_dir")]
    pub(crate) lb: bool,
    /// `--lb`: the proxy's port.
    #[arg(long, default_value_t = 25250)]
    pub(crate) lb_port: u16,
    /// Run against the shared PostgreSQL and RabbitMQ (--admin-url, --amqp-url) instead of
    /// private ones; their restarts are then skipped.
    #[arg(long)]
    pub(crate) shared_services: bool,
    /// Run on the high-availability topology of `deploy/local/ha.sh` (PostgreSQL under Patroni
    /// with a synchronous standby, a three-node RabbitMQ cluster): PostgreSQL faults become
    /// primary SIGKILLs and planned switchovers, RabbitMQ faults SIGKILL one node at a time.
    #[arg(long, conflicts_with = "shared_services")]
    pub(crate) ha: bool,
    /// `--ha`: the first of the topology's ports (HA_PORT_BASE; the layout is in ha.sh).
    #[arg(long, default_value_t = 27000)]
    pub(crate) ha_port_base: u16,
    /// `--ha`: the fraction of PostgreSQL faults that are planned switchovers rather than kills.
    #[arg(long, default_value_t = 0.3)]
    pub(crate) switchover_ratio: f64,
    /// `--ha`: the run fails unless at least this many primary kills happened (the failover
    /// outage's goal is meant to be judged over 20 kills; a shorter run may ask for fewer).
    #[arg(long, default_value_t = 1)]
    pub(crate) ha_min_primary_kills: u32,
    /// Port of the private PostgreSQL cluster.
    #[arg(long, default_value_t = 25433)]
    pub(crate) pg_port: u16,
    /// Port of the private RabbitMQ node (its distribution port is this + 20000).
    #[arg(long, default_value_t = 5683)]
    pub(crate) amqp_port: u16,
    /// Mean seconds between PostgreSQL fast-shutdown restarts (with `--ha`: between failovers,
    /// each after the last has healed).
    #[arg(long, default_value_t = 20.0)]
    pub(crate) pg_restart_every_secs: f64,
    /// Mean seconds between RabbitMQ restarts (with `--ha`: between node kills, each after the
    /// last node is back).
    #[arg(long, default_value_t = 25.0)]
    pub(crate) rabbit_restart_every_secs: f64,
    /// Mean seconds between stalls of an api-server (SIGSTOP for longer than the lock timeout,
    /// then SIGCONT): the other api-server takes the stalled attempts' keys over.
    #[arg(long, default_value_t = 15.0)]
    pub(crate) stall_every_secs: f64,
    /// No stall at all (a rare fault otherwise fires once, early, whatever its mean): for
    /// measuring other faults alone.
    #[arg(long)]
    pub(crate) no_stalls: bool,
    /// Do not arm the api-server's crash points (needed when its binary lacks the
    /// `fault-injection` feature; proof/run.sh builds it with the feature).
    #[arg(long)]
    pub(crate) no_crash_points: bool,
    /// Rolling deploys instead of faults: `--rollouts` times during the traffic, each
    /// api-server and then each worker is replaced one at a time (SIGTERM, its drain and exit
    /// waited for, a new one started and its port waited for), with no other fault, no crash
    /// point, and every client retrying as `rides-client` does. Judged by the `rolling_*`
    /// invariants as well as every other.
    #[arg(long, conflicts_with_all = ["ha", "money"])]
    pub(crate) rolling: bool,
    /// `--rolling`: how many times every api-server and worker is replaced.
    #[arg(long, default_value_t = 3)]
    pub(crate) rollouts: u32,
    /// `--rolling` as an upgrade: the api-servers and workers start from the `api-server` and
    /// `workers` binaries in this directory (an older build; a binary it lacks comes from this
    /// build), and the first rollout replaces them with this build's, so the old and the new serve
    /// side by side on this build's schema until it is done.
    #[arg(long, requires = "rolling")]
    pub(crate) rolling_from: Option<PathBuf>,
    /// Add the money campaign (another product's look-alike charges, the reconciler refunding
    /// during traffic, riders retrying given-up keys; docs/reliability.md). The test command runs
    /// it with `--short`.
    #[arg(long)]
    pub(crate) money: bool,
    /// Money riders: each makes keys the completer gives up with a charge made, then retries them.
    #[arg(long, default_value_t = 3)]
    pub(crate) money_riders: u32,
    /// Mean milliseconds between the other product's look-alike charges.
    #[arg(long, default_value_t = 500)]
    pub(crate) other_product_every_ms: u64,
    /// Keep the database (and the RabbitMQ queues) after the run.
    #[arg(long)]
    pub(crate) keep: bool,
}

/// The campaign's lock timeout: short, so that keys a killed server held are resumed within the
/// run.
const CAMPAIGN_LOCK_TIMEOUT_SECS: u64 = 6;

impl Args {
    /// The api-servers' `IDEMPOTENCY_LOCK_TIMEOUT_SECS`.
    pub(crate) fn lock_timeout_secs(&self) -> u64 {
        if self.production_defaults {
            contract::key::DEFAULT_LOCK_TIMEOUT_SECS
        } else {
            CAMPAIGN_LOCK_TIMEOUT_SECS
        }
    }

    /// `--rolling` measures what callers see of a deploy alone: no crash point is armed, and
    /// every client retries to a final answer (none drops a call or stops after one try).
    pub(crate) fn for_rolling(mut self) -> Args {
        if self.rolling {
            self.no_crash_points = true;
            self.drop_ratio = 0.0;
            self.no_retry_ratio = 0.0;
        }
        self
    }
}
