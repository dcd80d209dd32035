//! The clients: the users they call as, their connections, the seeding of keys to replay, and
//! the closed loops of logical requests whose answers they count.

use std::{
    collections::BTreeMap,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context;
use bench::latency::Latencies;
use futures_util::{StreamExt, TryStreamExt};
use proto::v1::CreateRideRequest;
use rand::Rng;
use rides_client::{AttemptRecord, Credential, RetryPolicy, RidesClient};
use tonic::transport::Channel;

use crate::{
    args::{Args, policy},
    windows::Windows,
};

pub(crate) const PARAMS: CreateRideRequest = CreateRideRequest {
    origin_lat: Some(37.7749),
    origin_lon: Some(-122.4194),
    target_lat: Some(37.3382),
    target_lon: Some(-121.8863),
};

pub(crate) struct BenchUser {
    pub(crate) id: i64,
    pub(crate) token: String,
    pub(crate) customer: String,
}

/// What one client saw.
#[derive(Default)]
pub(crate) struct ClientStats {
    pub(crate) latencies: Latencies,
    /// Every attempt's answer, by `CODE/REASON`.
    pub(crate) attempts: BTreeMap<String, u64>,
    /// Measured window: logical requests finished, and those that succeeded.
    pub(crate) measured_done: u64,
    pub(crate) measured_ok: u64,
    /// New keys that ended in success (whole run, warm-up and seeding included).
    pub(crate) new_keys_ok: u64,
    /// New keys that ended in anything else after all retries.
    pub(crate) new_keys_failed: u64,
    pub(crate) replays_ok: u64,
    /// Replays of a finished key that did not come back as `idempotent-replayed: true`.
    pub(crate) replays_not_marked: u64,
    pub(crate) replays_failed: u64,
    pub(crate) aborted: u64,
}

pub(crate) struct Shared {
    pub(crate) run_id: String,
    pub(crate) policy: RetryPolicy,
    pub(crate) replay_ratio: f64,
    /// A replay says it resends its key (`idempotency-key-resent`), unless
    /// `--replays-as-first-sends`.
    pub(crate) resend_replays: bool,
    pub(crate) measure_from: Instant,
    pub(crate) deadline: Option<Instant>,
    pub(crate) remaining: Option<AtomicU64>,
    /// `--window-secs`: every measured request is also counted in its window.
    pub(crate) windows: Option<Arc<Windows>>,
}

pub(crate) enum Final {
    Ok { replayed: bool },
    Err,
}

impl ClientStats {
    pub(crate) fn absorb(&mut self, other: ClientStats) {
        self.latencies.merge(&other.latencies);
        for (k, v) in other.attempts {
            *self.attempts.entry(k).or_default() += v;
        }
        self.measured_done += other.measured_done;
        self.measured_ok += other.measured_ok;
        self.new_keys_ok += other.new_keys_ok;
        self.new_keys_failed += other.new_keys_failed;
        self.replays_ok += other.replays_ok;
        self.replays_not_marked += other.replays_not_marked;
        self.replays_failed += other.replays_failed;
        self.aborted += other.aborted;
    }
}

/// A client task's `rides-client`, as its user, over one of the shared connections.
pub(crate) fn rides_client(
    channel: &tonic::transport::Channel,
    user: &BenchUser,
    policy: &RetryPolicy,
) -> RidesClient {
    RidesClient::new(channel.clone(), Credential::user(user.token.as_str()))
        .with_policy(policy.clone())
}

/// One logical request: one `rides-client` call, which retries with the same key until a final
/// answer. Every attempt's answer is counted by its `CODE/REASON` label.
async fn request(
    shared: &Shared,
    rpc: &RidesClient,
    key: &str,
    stats: &mut ClientStats,
    replay: bool,
) -> Final {
    let started = Instant::now();
    // A replay sends a key this client has sent before, and says so.
    let result = if replay && shared.resend_replays {
        rpc.resume_ride(key, PARAMS).await
    } else {
        rpc.create_ride_with_key(key, PARAMS).await
    };
    let (log, outcome): (&[AttemptRecord], Final) = match &result {
        Ok(created) => (
            &created.log,
            Final::Ok {
                replayed: created.replayed,
            },
        ),
        Err(error) => (&error.log, Final::Err),
    };
    for attempt in log {
        let label = match (&outcome, attempt.outcome.as_str()) {
            (Final::Ok { replayed: true }, "OK") => "OK (replayed)",
            (_, label) => label,
        };
        *stats.attempts.entry(label.to_owned()).or_default() += 1;
        if label.starts_with("Aborted/") {
            stats.aborted += 1;
        }
    }
    if let Err(error) = &result
        && error.log.is_empty()
    {
        // Nothing was sent (the token or key cannot be metadata).
        *stats.attempts.entry(error.error.label()).or_default() += 1;
    }
    let measured = started >= shared.measure_from;
    if measured {
        let latency = started.elapsed();
        stats.latencies.record(latency);
        stats.measured_done += 1;
        if let Some(windows) = &shared.windows {
            let labels = log.iter().map(|attempt| attempt.outcome.as_str());
            windows.record(latency, labels, matches!(outcome, Final::Ok { .. }));
        }
    }
    match (&outcome, replay) {
        (Final::Ok { .. }, false) => stats.new_keys_ok += 1,
        (Final::Err, false) => stats.new_keys_failed += 1,
        (Final::Ok { replayed }, true) => {
            stats.replays_ok += 1;
            if !replayed {
                stats.replays_not_marked += 1;
            }
        }
        (Final::Err, true) => stats.replays_failed += 1,
    }
    if measured && matches!(outcome, Final::Ok { .. }) {
        stats.measured_ok += 1;
    }
    outcome
}

/// The run's users: one per client (or `--users`), or with `--riders` the rider pool every
/// client draws from, each created with a token a freshly started api-server has never seen.
pub(crate) async fn create_users(args: &Args, run_id: &str) -> anyhow::Result<Vec<Arc<BenchUser>>> {
    let concurrency = args.create_users_concurrency.max(1);
    let pool = schema::build_pool(
        &args.database_url,
        u32::try_from(concurrency).unwrap_or(u32::MAX),
        Duration::from_secs(30),
        schema::PlanCache::Auto,
    );
    let user_count = args.riders.or(args.users).unwrap_or(args.clients).max(1);
    let created_from = Instant::now();
    let users: Vec<Arc<BenchUser>> = futures_util::stream::iter(0..user_count)
        .map(|i| {
            let pool = &pool;
            let customer = format!("cus_bench_{run_id}_{i}");
            let email = format!("bench-{run_id}-{i}@bench.rocketrides.test");
            async move {
                let (user, token) =
                    api_server::auth::create_user(pool, &email, &customer, "pm_card_visa")
                        .await
                        .with_context(|| format!("cannot create bench user {i}"))?;
                anyhow::Ok(Arc::new(BenchUser {
                    id: user.id,
                    token,
                    customer,
                }))
            }
        })
        .buffer_unordered(concurrency)
        .try_collect()
        .await?;
    if args.riders.is_some() {
        eprintln!(
            "created {} riders in {:.1} s",
            users.len(),
            created_from.elapsed().as_secs_f64()
        );
    }
    Ok(users)
}

/// The shared HTTP/2 connections to `target` (`--target`, or `--seed-target` for the seeding):
/// `--connections`, else one per 50 clients, connected up front.
pub(crate) async fn connect(args: &Args, target: &str) -> anyhow::Result<Vec<Channel>> {
    let connections = args
        .connections
        .unwrap_or_else(|| args.clients.div_ceil(50))
        .max(1);
    let tls = proto::client::ClientTls {
        ca: args.ca.clone(),
        cert: args.client_cert.clone(),
        key: args.client_key.clone(),
    };
    let mut channels = Vec::new();
    for _ in 0..connections {
        let channel = proto::client::endpoint(target, &tls)?
            .connect()
            .await
            .with_context(|| format!("cannot connect to {target}"))?;
        channels.push(channel);
    }
    Ok(channels)
}

/// A finished key, and the rider that made it (`None`: the client's own user). A replay calls
/// as that rider: under another user the same key would be a new one, and make a new ride.
#[derive(Clone)]
pub(crate) struct RiderKey {
    rider: Option<Arc<BenchUser>>,
    key: String,
}

/// What one client made before the measured run: its counts and its finished keys.
pub(crate) type Seeded = (ClientStats, Vec<RiderKey>);

/// Seeding: finished keys to replay (`--seed-keys-per-client`), made before the clock starts.
pub(crate) async fn seed(
    args: &Args,
    run_id: &str,
    users: &[Arc<BenchUser>],
    channels: &[Channel],
) -> anyhow::Result<Vec<Seeded>> {
    let mut seeded = Vec::new();
    if args.seed_keys_per_client == 0 {
        return Ok(seeded);
    }
    let shared = Arc::new(Shared {
        run_id: run_id.to_owned(),
        policy: policy(args),
        replay_ratio: 0.0,
        resend_replays: false,
        measure_from: Instant::now() + Duration::from_secs(86_400),
        deadline: None,
        remaining: None,
        windows: None,
    });
    let started = Instant::now();
    let mut tasks = Vec::new();
    for client in 0..args.clients {
        let channel = channels[client as usize % channels.len()].clone();
        let own = rides_client(
            &channel,
            &users[client as usize % users.len()],
            &shared.policy,
        );
        let riders: Vec<Option<Arc<BenchUser>>> = (0..args.seed_keys_per_client)
            .map(|n| seed_rider(args, users, client, n))
            .collect();
        let shared = Arc::clone(&shared);
        tasks.push(tokio::spawn(async move {
            let mut stats = ClientStats::default();
            let mut finished = Vec::new();
            for (n, rider) in riders.into_iter().enumerate() {
                let key = format!("bench-{}-seed-{client:05}-{n:09}", shared.run_id);
                let rpc = match &rider {
                    Some(rider) => rides_client(&channel, rider, &shared.policy),
                    None => own.clone(),
                };
                if let Final::Ok { .. } = request(&shared, &rpc, &key, &mut stats, false).await {
                    finished.push(RiderKey { rider, key });
                }
            }
            (stats, finished)
        }));
    }
    for task in tasks {
        seeded.push(task.await?);
    }
    eprintln!(
        "seeded {} finished keys in {:.1} s",
        seeded.iter().map(|(_, keys)| keys.len()).sum::<usize>(),
        started.elapsed().as_secs_f64()
    );
    Ok(seeded)
}

/// The rider a seeding client's `n`-th key is made as, with `--riders`: riders taken
/// round-robin so that the clients together cover the pool evenly (client c, key n: rider
/// (n × clients + c) mod riders). `None` without `--riders` (the client's own user).
fn seed_rider(
    args: &Args,
    users: &[Arc<BenchUser>],
    client: u32,
    n: u32,
) -> Option<Arc<BenchUser>> {
    args.riders?;
    let index = (u64::from(n) * u64::from(args.clients) + u64::from(client))
        .checked_rem(u64::try_from(users.len()).ok()?)?;
    users.get(usize::try_from(index).ok()?).cloned()
}

/// The measured run: every client's closed loop until the deadline or the request budget; the
/// clients' counts, seeding included.
pub(crate) async fn run(
    args: &Args,
    shared: &Arc<Shared>,
    users: &[Arc<BenchUser>],
    channels: &[Channel],
    seeded: Vec<Seeded>,
) -> anyhow::Result<ClientStats> {
    let mut seeded = seeded.into_iter();
    let rider_pool = args.riders.is_some().then(|| Arc::new(users.to_vec()));
    let mut tasks = Vec::new();
    for client in 0..args.clients {
        let user = Arc::clone(&users[client as usize % users.len()]);
        let channel = channels[client as usize % channels.len()].clone();
        let (seed_stats, finished) = seeded.next().unwrap_or_default();
        let loop_ = ClientLoop {
            client,
            shared: Arc::clone(shared),
            rpc: rides_client(&channel, &user, &shared.policy),
            channel,
            rider_pool: rider_pool.clone(),
            finished,
        };
        tasks.push(tokio::spawn(async move {
            let stats = loop_.run().await;
            (seed_stats, stats)
        }));
    }
    let mut total = ClientStats::default();
    for task in tasks {
        let (seed_stats, stats) = task.await?;
        total.absorb(seed_stats);
        total.absorb(stats);
    }
    Ok(total)
}

/// One client: a closed loop of logical requests, new keys or (`--replay-ratio`) replays of its
/// own finished ones, as its user or as a rider of the pool: a random one for a new key, the one
/// that made it for a replay.
struct ClientLoop {
    client: u32,
    shared: Arc<Shared>,
    rpc: RidesClient,
    channel: Channel,
    rider_pool: Option<Arc<Vec<Arc<BenchUser>>>>,
    finished: Vec<RiderKey>,
}

impl ClientLoop {
    async fn run(mut self) -> ClientStats {
        let shared = Arc::clone(&self.shared);
        let mut stats = ClientStats::default();
        let mut n: u64 = 0;
        while goes_on(&shared) {
            let replay = !self.finished.is_empty()
                && shared.replay_ratio > 0.0
                && rand::rng().random::<f64>() < shared.replay_ratio;
            let call = if replay {
                self.finished[rand::rng().random_range(0..self.finished.len())].clone()
            } else {
                n += 1;
                self.fresh(n)
            };
            let outcome = self.call(&call, &mut stats, replay).await;
            if !replay
                && shared.replay_ratio > 0.0
                && matches!(outcome, Final::Ok { .. })
                && self.finished.len() < 100_000
            {
                self.finished.push(call);
            }
        }
        stats
    }

    /// The `n`-th new key, as a random rider of the pool (`--riders`) or as the client's user.
    fn fresh(&self, n: u64) -> RiderKey {
        let rider = self
            .rider_pool
            .as_ref()
            .map(|riders| Arc::clone(&riders[rand::rng().random_range(0..riders.len())]));
        RiderKey {
            rider,
            key: format!("bench-{}-c{:05}-{n:012}", self.shared.run_id, self.client),
        }
    }

    /// One logical request with `call`'s key, as its rider (or the client's own user).
    async fn call(&self, call: &RiderKey, stats: &mut ClientStats, replay: bool) -> Final {
        let shared = &self.shared;
        match &call.rider {
            Some(rider) => {
                let rpc = rides_client(&self.channel, rider, &shared.policy);
                request(shared, &rpc, &call.key, stats, replay).await
            }
            None => request(shared, &self.rpc, &call.key, stats, replay).await,
        }
    }
}

/// Whether the measured run goes on: before its deadline, and (`--requests`) one more request
/// taken from the budget.
fn goes_on(shared: &Shared) -> bool {
    if let Some(deadline) = shared.deadline
        && Instant::now() >= deadline
    {
        return false;
    }
    match &shared.remaining {
        Some(remaining) => remaining
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |r| r.checked_sub(1))
            .is_ok(),
        None => true,
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn users(n: i64) -> Vec<Arc<BenchUser>> {
        (0..n)
            .map(|id| {
                Arc::new(BenchUser {
                    id,
                    token: format!("token-{id}"),
                    customer: format!("cus_{id}"),
                })
            })
            .collect()
    }

    #[test]
    fn seeding_spreads_the_keys_over_every_rider_evenly() {
        let args = Args::parse_from([
            "loadgen",
            "--database-url=x",
            "--clients=64",
            "--riders=2000",
        ]);
        let users = users(2000);
        let mut keys_per_rider = vec![0_u32; users.len()];
        for client in 0..64 {
            for n in 0..2000_u32.div_ceil(64) {
                let rider = seed_rider(&args, &users, client, n).expect("a rider");
                keys_per_rider[usize::try_from(rider.id).expect("an index")] += 1;
            }
        }
        // 64 x 32 = 2048 keys over 2000 riders: every rider one, 48 of them two.
        assert_eq!(keys_per_rider.iter().min(), Some(&1));
        assert_eq!(keys_per_rider.iter().max(), Some(&2));
        let own = Args::parse_from(["loadgen", "--database-url=x", "--clients=64"]);
        assert!(seed_rider(&own, &users, 3, 7).is_none());
    }
}
