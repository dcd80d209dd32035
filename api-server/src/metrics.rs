//! The api-server's OpenTelemetry instruments, created once from the global meter (a no-op until
//! `telemetry::Telemetry::init` installs a provider, as in tests).

use std::sync::LazyLock;

use opentelemetry::metrics::{Counter, Histogram, ObservableGauge, ObservableUpDownCounter};
use schema::Pool;
use telemetry::{
    attr,
    semconv::{attribute, metric},
};

pub struct Metrics {
    /// `rpc.server.call.duration`, seconds, by `rpc.system.name`, `rpc.method` (fully qualified)
    /// and `rpc.response.status_code` (the code's name); its count is the request count.
    pub rpc_duration: Histogram<f64>,
    /// CreateRide answers replayed from a finished key.
    pub replays: Counter<u64>,
    /// One atomic phase (or the charge), seconds, by `rides.phase` and `outcome`.
    pub phase_duration: Histogram<f64>,
    /// The payment provider call, seconds, by `outcome` (succeeded, declined, unavailable, rejected).
    pub provider_duration: Histogram<f64>,
    /// PaymentIntents the charge search found naming a ride that the ownership rule
    /// (`contract::ownership`) refused, by `reason`: ignored, never recorded.
    pub foreign_charges: Counter<u64>,
    /// Attempts refused because another attempt held the key, or fenced off after a takeover.
    pub lock_conflicts: Counter<u64>,
    /// Locks of other attempts taken over by a claim, by `reason`: `holder_gone` (the holder's
    /// liveness session ended: a killed or cut-off api-server), `lock_expired` (the lock
    /// timeout passed: a paused holder, or one that named no holder).
    pub takeovers: Counter<u64>,
    /// Attempts that stopped before the provider call, or did not record its result, because
    /// this process's liveness session was not confirmed or was lost (their keys may be taken
    /// over), by `step` (`charge`, `record`).
    pub liveness_fenced: Counter<u64>,
    /// Failed attempts whose unlock failed too (the database unreachable) and is retried in the
    /// background until it succeeds or the lock expires.
    pub unlock_retries: Counter<u64>,
    /// Claim statements run, by `step`: `insert_or_read` (every claim's first statement, alone or
    /// batched), `lock` (the locking inspection of a key that may need work). Divided by the
    /// CreateRides, the claim statements per request.
    pub claim_statements: Counter<u64>,
    /// Waits for the attempt in flight on a key, by `outcome`: `finished` (answered as a replay),
    /// `free` (claimed again), `timed_out`, `caller_gone`, `refused` (a waiter bound reached).
    pub waits: Counter<u64>,
    /// Reads of a key row by waiters whose holder is on another process.
    pub wait_polls: Counter<u64>,
    /// Transactions re-run after a serialization failure or deadlock.
    pub serialization_retries: Counter<u64>,
    /// Requests decided by one batched statement, by statement.
    pub batch_size: Histogram<u64>,
    /// `rides.grpc.connections.refused`: gRPC connections closed by the listener before tonic saw
    /// them (the project's own name: `rpc.` is the conventions' reserved namespace), by `reason`
    /// (`max_connections`, `max_connections_per_ip`, `preface_timeout`, `handshake_failed`).
    pub connections_refused: Counter<u64>,
    /// TLS certificate reloads, by `outcome` (`reloaded`, `failed`).
    pub tls_reloads: Counter<u64>,
    /// Calls refused by admission, by `reason`: `user_rate` (a user's rate or concurrency),
    /// `lookup_busy` (the token-lookup queue full or too slow), `decline_budget`,
    /// `failed_auth` (counted against the peer), `shut_out` (a client behind a trusted proxy).
    pub admission_refusals: Counter<u64>,
    /// Token lookups run (one per cold token, shared by concurrent calls), by `outcome`
    /// (`known`, `unknown`, `busy`, `unavailable`).
    pub token_lookups: Counter<u64>,
}

/// Bucket bounds for durations in seconds, from a millisecond statement to the longest call
/// (`GRPC_REQUEST_TIMEOUT_SECS`). The SDK's default bounds (0, 5, 10 … 10000) are sized for
/// milliseconds: in seconds every call under 5 s would land in one bucket and every quantile
/// would read the same.
const SECONDS_BOUNDARIES: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    let meter = telemetry::meter("rides-api-server");
    Metrics {
        rpc_duration: meter
            .f64_histogram(metric::RPC_SERVER_CALL_DURATION)
            .with_unit("s")
            .with_boundaries(SECONDS_BOUNDARIES.to_vec())
            .with_description("Duration of gRPC calls")
            .build(),
        replays: meter
            .u64_counter("rides.replays")
            .with_description("CreateRide answers replayed from a finished idempotency key")
            .build(),
        phase_duration: meter
            .f64_histogram("rides.phase.duration")
            .with_unit("s")
            .with_boundaries(SECONDS_BOUNDARIES.to_vec())
            .with_description("Duration of one atomic phase of CreateRide")
            .build(),
        provider_duration: meter
            .f64_histogram("rides.payment_provider.duration")
            .with_unit("s")
            .with_boundaries(SECONDS_BOUNDARIES.to_vec())
            .with_description("Duration of payment provider calls")
            .build(),
        foreign_charges: meter
            .u64_counter("rides.payment_provider.foreign_charges")
            .with_description("PaymentIntents found naming a ride that are not provably ours")
            .build(),
        lock_conflicts: meter
            .u64_counter("rides.idempotency.lock_conflicts")
            .with_description("Attempts refused or fenced off because another attempt held the key")
            .build(),
        takeovers: meter
            .u64_counter("rides.idempotency.takeovers")
            .with_description("Locks taken over by a claim, by reason (holder_gone, lock_expired)")
            .build(),
        liveness_fenced: meter
            .u64_counter("rides.idempotency.liveness_fenced")
            .with_description(
                "Attempts stopped before the charge or its record because this process's \
                 liveness session was not confirmed, by step",
            )
            .build(),
        unlock_retries: meter
            .u64_counter("rides.idempotency.unlock_retries")
            .with_description(
                "Keys unlocked in the background after the database was unreachable, by kind \
                 (lease: a failed phase's unlock failed too; claim: a failed claim may have \
                 committed)",
            )
            .build(),
        claim_statements: meter
            .u64_counter("rides.idempotency.claim_statements")
            .with_description("Claim statements run, by step")
            .build(),
        waits: meter
            .u64_counter("rides.idempotency.waits")
            .with_description("Waits for the attempt in flight on a key, by outcome")
            .build(),
        wait_polls: meter
            .u64_counter("rides.idempotency.wait_polls")
            .with_description("Key rows read by waiters whose holder is on another process")
            .build(),
        serialization_retries: meter
            .u64_counter("rides.db.serialization_retries")
            .with_description("Transactions re-run after a serialization failure or deadlock")
            .build(),
        batch_size: meter
            .u64_histogram("rides.idempotency.batch.size")
            .with_unit("{request}")
            .with_description("Requests decided by one batched statement")
            .with_boundaries(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0])
            .build(),
        connections_refused: meter
            .u64_counter("rides.grpc.connections.refused")
            .with_description("gRPC connections closed before HTTP/2, by reason")
            .build(),
        tls_reloads: meter
            .u64_counter("rides.tls.reloads")
            .with_description("Reloads of the gRPC listener's TLS certificates, by outcome")
            .build(),
        admission_refusals: meter
            .u64_counter("rides.admission.refusals")
            .with_description("Calls refused by admission, by reason")
            .build(),
        token_lookups: meter
            .u64_counter("rides.admission.token_lookups")
            .with_description("Lookups of tokens not verified lately, by outcome")
            .build(),
    }
});

/// Counts one call refused by admission.
pub fn refused(reason: &'static str) {
    metrics()
        .admission_refusals
        .add(1, &[attr("reason", reason)]);
}

pub fn metrics() -> &'static Metrics {
    &METRICS
}

/// `db.client.connection.pool.name` of the api-server's one pool (the conventions want a name
/// unique within the process; the pool has none of its own).
const POOL_NAME: &str = "api-server";

/// Reports the pool's used and idle connections (`db.client.connection.count`) and its size
/// (`db.client.connection.max`, so saturation is a ratio, not a copied number), as the
/// conventions' up-down counters (a gauge in `/metrics`), each by `db.client.connection.pool.name`.
/// Keep the returned instruments alive as long as the pool.
pub fn observe_pool(pool: &Pool, max: u32) -> [ObservableUpDownCounter<i64>; 2] {
    let pool = pool.clone();
    let meter = telemetry::meter("rides-api-server");
    [
        meter
            .i64_observable_up_down_counter(metric::DB_CLIENT_CONNECTION_COUNT)
            .with_unit("{connection}")
            .with_description("Database connections in the pool, by state")
            .with_callback(move |observer| {
                let state = pool.state();
                let idle = i64::from(state.idle_connections);
                let used = i64::from(state.connections).saturating_sub(idle);
                for (count, state) in [(used, "used"), (idle, "idle")] {
                    observer.observe(
                        count,
                        &[
                            attr(attribute::DB_CLIENT_CONNECTION_POOL_NAME, POOL_NAME),
                            attr(attribute::DB_CLIENT_CONNECTION_STATE, state),
                        ],
                    );
                }
            })
            .build(),
        meter
            .i64_observable_up_down_counter(metric::DB_CLIENT_CONNECTION_MAX)
            .with_unit("{connection}")
            .with_description("Database connections the pool may open")
            .with_callback(move |observer| {
                observer.observe(
                    i64::from(max),
                    &[attr(attribute::DB_CLIENT_CONNECTION_POOL_NAME, POOL_NAME)],
                );
            })
            .build(),
    ]
}

/// Reports what admission holds: verified tokens known (`rides.admission.known_tokens`), calls
/// waiting for a token-lookup place (`rides.admission.lookup_queue`), tokens refused from memory
/// (`rides.admission.unknown_tokens`) and callers with rate-limit buckets
/// (`rides.limits.tracked_callers`): every in-memory table a caller can grow, so a soak can show
/// each stays bounded. Keep the gauges alive as long as `admission`.
pub fn observe_admission(
    admission: &std::sync::Arc<crate::admission::Admission>,
) -> [ObservableGauge<u64>; 5] {
    type Read = fn(&crate::admission::Admission) -> usize;
    let meter = telemetry::meter("rides-api-server");
    let tables: [(&'static str, &'static str, Read); 5] = [
        (
            "rides.admission.known_tokens",
            "Verified tokens admission knows without a lookup",
            crate::admission::Admission::known_tokens,
        ),
        (
            "rides.admission.lookup_queue",
            "Calls waiting for a token-lookup place",
            crate::admission::Admission::lookups_waiting,
        ),
        (
            "rides.admission.token_lookups_in_flight",
            "Tokens being looked up now, each shared by its concurrent calls",
            crate::admission::Admission::lookups_in_flight,
        ),
        (
            "rides.admission.unknown_tokens",
            "Tokens no user has, refused from memory",
            crate::admission::Admission::unknown_tokens,
        ),
        (
            "rides.limits.tracked_callers",
            "Callers whose rate-limit buckets are held",
            crate::admission::Admission::tracked_callers,
        ),
    ];
    tables.map(|(name, description, read)| {
        let admission = std::sync::Arc::clone(admission);
        meter
            .u64_observable_gauge(name)
            .with_description(description)
            .with_callback(move |observer| observer.observe(read(&admission) as u64, &[]))
            .build()
    })
}
