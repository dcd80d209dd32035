//! The legitimate side of the campaign: clients that keep creating rides and reading them back
//! at a steady pace, well under the per-user limits, whose latencies are kept per phase so that
//! each attack's window can be set against the quiet baseline of the same run.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use bench::latency::Latencies;
use proto::v1::{CreateRideRequest, GetRideRequest, ride_service_client::RideServiceClient};
use tonic::{Status, metadata::MetadataValue, transport::Channel};
use tonic_types::StatusExt;

/// How often each legitimate client creates a ride (and then reads it): 10 a second, a fifth of
/// the default per-user CreateRide rate.
const PACE: Duration = Duration::from_millis(100);
/// Any call slower than this counts as an error of the legitimate clients.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);

pub const PARAMS: CreateRideRequest = CreateRideRequest {
    origin_lat: Some(37.7749),
    origin_lon: Some(-122.4194),
    target_lat: Some(37.8044),
    target_lon: Some(-122.2712),
};

/// What the legitimate clients saw in one phase.
#[derive(Default)]
pub struct PhaseStats {
    pub create: Latencies,
    pub get: Latencies,
    pub errors: BTreeMap<String, u64>,
}

/// The campaign's phases, in order; legitimate calls are recorded in the current one.
#[derive(Default)]
pub struct Phases {
    current: AtomicUsize,
    /// While set, the legitimate clients skip their calls (the database-footprint runs).
    paused: AtomicBool,
    stats: Mutex<Vec<PhaseStats>>,
}

impl Phases {
    /// Starts a phase; returns its index.
    pub fn begin(&self) -> usize {
        let mut stats = self.locked();
        stats.push(PhaseStats::default());
        let index = stats.len() - 1;
        self.current.store(index, Ordering::SeqCst);
        index
    }

    pub fn pause(&self, paused: bool) {
        self.paused.store(paused, Ordering::SeqCst);
    }

    pub fn paused(&self) -> bool {
        self.paused.load(Ordering::SeqCst)
    }

    pub fn with<T>(&self, index: usize, f: impl FnOnce(&PhaseStats) -> T) -> Option<T> {
        self.locked().get(index).map(f)
    }

    fn record(&self, f: impl FnOnce(&mut PhaseStats)) {
        let index = self.current.load(Ordering::SeqCst);
        if let Some(stats) = self.locked().get_mut(index) {
            f(stats);
        }
    }

    fn locked(&self) -> std::sync::MutexGuard<'_, Vec<PhaseStats>> {
        self.stats
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A gRPC status as the report counts it: code and, where there is one, `ErrorInfo` reason.
pub fn label(status: &Status) -> String {
    match status.get_error_details().error_info() {
        Some(info) => format!("{:?}/{}", status.code(), info.reason),
        None => format!("{:?}", status.code()),
    }
}

/// A client of the api-server on a connection of its own, from `local` if given.
pub fn client(
    target: SocketAddr,
    local: Option<IpAddr>,
) -> anyhow::Result<RideServiceClient<Channel>> {
    Ok(RideServiceClient::new(
        endpoint(target, local)?.connect_lazy(),
    ))
}

fn endpoint(
    target: SocketAddr,
    local: Option<IpAddr>,
) -> anyhow::Result<tonic::transport::Endpoint> {
    Ok(Channel::from_shared(format!("http://{target}"))?
        .connect_timeout(Duration::from_secs(1))
        .timeout(CALL_TIMEOUT)
        .local_address(local))
}

/// [`client`], connected before it returns.
pub async fn connected_client(
    target: SocketAddr,
    local: Option<IpAddr>,
) -> anyhow::Result<RideServiceClient<Channel>> {
    Ok(RideServiceClient::new(
        endpoint(target, local)?.connect().await?,
    ))
}

/// A request carrying `token` and, for CreateRide, a fresh idempotency key.
pub fn authorized<T>(message: T, token: &str, with_key: bool) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Ok(value) = MetadataValue::try_from(format!("Bearer {token}")) {
        request.metadata_mut().insert("authorization", value);
    }
    if with_key && let Ok(key) = MetadataValue::try_from(uuid::Uuid::new_v4().to_string()) {
        request.metadata_mut().insert("idempotency-key", key);
    }
    request
}

/// One legitimate user's loop: create a ride, read it back, every [`PACE`], until `stop`.
async fn legitimate(target: SocketAddr, token: String, phases: Arc<Phases>, stop: Arc<AtomicBool>) {
    let Ok(mut rpc) = client(target, None) else {
        phases.record(|s| *s.errors.entry("CLIENT/BAD_TARGET".into()).or_default() += 1);
        return;
    };
    let mut tick = tokio::time::interval(PACE);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop.load(Ordering::SeqCst) {
        tick.tick().await;
        if phases.paused() {
            continue;
        }
        let started = Instant::now();
        let created = rpc.create_ride(authorized(PARAMS, &token, true)).await;
        let id = match created {
            Ok(response) => {
                let took = started.elapsed();
                phases.record(|s| s.create.record(took));
                response.into_inner().ride.map(|ride| ride.id)
            }
            Err(status) => {
                let label = format!("create {}", label(&status));
                phases.record(|s| *s.errors.entry(label).or_default() += 1);
                None
            }
        };
        let Some(id) = id else { continue };
        let started = Instant::now();
        match rpc
            .get_ride(authorized(GetRideRequest { id }, &token, false))
            .await
        {
            Ok(_) => {
                let took = started.elapsed();
                phases.record(|s| s.get.record(took));
            }
            Err(status) => {
                let label = format!("get {}", label(&status));
                phases.record(|s| *s.errors.entry(label).or_default() += 1);
            }
        }
    }
}

/// Starts the legitimate clients on a thread and runtime of their own: on the attackers'
/// runtime they would queue behind the attackers' tasks (encoding 4 MiB messages, say), and
/// the campaign would measure its own scheduling instead of the api-server.
pub fn spawn_legitimate(
    target: SocketAddr,
    tokens: Vec<String>,
    phases: &Arc<Phases>,
    stop: &Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (phases, stop) = (Arc::clone(phases), Arc::clone(stop));
    std::thread::Builder::new()
        .name("legitimate".into())
        .spawn(move || {
            runtime.block_on(async move {
                let clients = tokens.into_iter().map(|token| {
                    tokio::spawn(legitimate(
                        target,
                        token,
                        Arc::clone(&phases),
                        Arc::clone(&stop),
                    ))
                });
                futures_util::future::join_all(clients.collect::<Vec<_>>()).await;
            });
        })
}

/// How long until a new connection from a legitimate client gets a ride read back: every
/// 100 ms a fresh connection is opened and one GetRide made, for at most `limit`.
pub async fn time_to_serve(
    target: SocketAddr,
    token: &str,
    ride_id: i64,
    limit: Duration,
) -> Option<Duration> {
    let started = Instant::now();
    while started.elapsed() < limit {
        let attempt = async {
            let mut rpc = client(target, None).ok()?;
            let request = authorized(GetRideRequest { id: ride_id }, token, false);
            tokio::time::timeout(Duration::from_secs(1), rpc.get_ride(request))
                .await
                .ok()?
                .ok()
        };
        if attempt.await.is_some() {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}
