//! The campaign's clients: concurrent closed loops, one user each, that send CreateRide with an
//! idempotency key and retry it the way a real client would (or drop it mid-request, or give up
//! after one try), recording the final answer each key got ([`KeyRecord`]). Their records are
//! what the database, the ledger and the mail are later checked against. The replays reuse
//! [`call`] and [`classify`], so that a replay is judged by the rules of a first answer.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context;
use prost::Message;
use proto::v1::{CreateRideRequest, CreateRideResponse, ride_service_client::RideServiceClient};
use rand::{Rng, SeedableRng, rngs::StdRng};
use tokio::task::JoinHandle;
use tonic::{Code, Status, metadata::MetadataValue, transport::Channel};
use tonic_types::StatusExt;

use crate::{
    args::Args,
    counters::{Attempted, Counters, Tallies, Timeline},
    setup::{Plan, Wiring},
};

#[derive(Clone)]
pub(crate) struct User {
    pub(crate) id: i64,
    token: String,
    pub(crate) declining: bool,
}

#[derive(Clone, Debug)]
pub(crate) enum Seen {
    /// OK: the ride id, charge id, the encoded response and the expires-at header.
    Ok {
        ride_id: i64,
        charge_id: String,
        bytes: Vec<u8>,
        expires_at: Option<String>,
    },
    /// FAILED_PRECONDITION / CARD_DECLINED: code, message and encoded details.
    Declined { message: String, details: Vec<u8> },
    /// The client dropped the call mid-request, or stopped after a non-final answer.
    Abandoned(String),
    /// The client ran out of tries (or hit its deadline) without a final answer.
    GaveUp(String),
    /// An answer that must never happen (e.g. IDEMPOTENCY_KEY_REUSED for the same parameters).
    Unexpected(String),
}

impl Seen {
    pub(crate) fn detail(&self) -> String {
        match self {
            Seen::Ok {
                ride_id, charge_id, ..
            } => format!("ride {ride_id} {charge_id}"),
            Seen::Declined { message, .. } => message.clone(),
            Seen::Abandoned(s) | Seen::GaveUp(s) | Seen::Unexpected(s) => s.clone(),
        }
    }

    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Seen::Ok { .. } => "ok",
            Seen::Declined { .. } => "declined",
            Seen::Abandoned(_) => "abandoned",
            Seen::GaveUp(_) => "gave_up",
            Seen::Unexpected(_) => "unexpected",
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) struct KeyRecord {
    pub(crate) key: String,
    pub(crate) user_id: i64,
    pub(crate) client: u32,
    pub(crate) params: CreateRideRequest,
    pub(crate) attempts: u32,
    pub(crate) seen: Seen,
}

fn reason_of(status: &Status) -> String {
    status
        .get_error_details()
        .error_info()
        .map_or_else(|| "-".to_owned(), |info| info.reason.clone())
}

fn label_of(status: &Status) -> String {
    format!("{:?}/{}", status.code(), reason_of(status))
}

fn retryable(code: Code) -> bool {
    matches!(
        code,
        Code::Aborted
            | Code::Unavailable
            | Code::Internal
            | Code::Unknown
            | Code::Cancelled
            | Code::DeadlineExceeded
    )
}

pub(crate) enum Answer {
    Final(Seen),
    Retry(String),
}

pub(crate) fn classify(result: Result<tonic::Response<CreateRideResponse>, Status>) -> Answer {
    match result {
        Ok(response) => {
            let expires_at = response
                .metadata()
                .get("idempotency-key-expires-at")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let body = response.into_inner();
            let (ride_id, charge_id) = body
                .ride
                .as_ref()
                .map(|r| (r.id, r.charge_id.clone()))
                .unwrap_or_default();
            Answer::Final(Seen::Ok {
                ride_id,
                charge_id,
                bytes: body.encode_to_vec(),
                expires_at,
            })
        }
        Err(status) => {
            let reason = reason_of(&status);
            if status.code() == Code::FailedPrecondition && reason == "CARD_DECLINED" {
                Answer::Final(Seen::Declined {
                    message: status.message().to_owned(),
                    details: status.details().to_vec(),
                })
            } else if retryable(status.code()) {
                Answer::Retry(label_of(&status))
            } else {
                Answer::Final(Seen::Unexpected(label_of(&status)))
            }
        }
    }
}

pub(crate) async fn call(
    rpc: &RideServiceClient<Channel>,
    user: &User,
    key: &str,
    params: CreateRideRequest,
    client_timeout: Duration,
) -> Result<Result<tonic::Response<CreateRideResponse>, Status>, ()> {
    let mut request = tonic::Request::new(params);
    let (Ok(auth), Ok(key_value)) = (
        MetadataValue::try_from(format!("Bearer {}", user.token)),
        MetadataValue::try_from(key),
    ) else {
        return Ok(Err(Status::invalid_argument("client: bad metadata")));
    };
    request.metadata_mut().insert("authorization", auth);
    request.metadata_mut().insert("idempotency-key", key_value);
    let mut rpc = rpc.clone();
    // A client-side timeout drops the call (RST_STREAM): the server's attempt runs on detached.
    tokio::time::timeout(client_timeout, rpc.create_ride(request))
        .await
        .map_err(|_| ())
}

struct ClientCtx {
    id: u32,
    user: User,
    /// One per api-server; each attempt picks one at random, as a load balancer would.
    rpcs: Vec<RideServiceClient<Channel>>,
    faults: Arc<Counters>,
    run_id: String,
    traffic_end: Instant,
    hard_end: Instant,
    args: Args,
    attempts: Arc<Counters>,
    requests: Arc<AtomicU64>,
    retries: Arc<AtomicU64>,
    timeline: Arc<Timeline>,
}

async fn run_client(ctx: ClientCtx, seed: u64) -> Vec<KeyRecord> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut records = Vec::new();
    let mut n = 0_u32;
    while Instant::now() < ctx.traffic_end {
        n += 1;
        let key = format!("proof-{}-c{:02}-{n:07}", ctx.run_id, ctx.id);
        let params = CreateRideRequest {
            origin_lat: Some(rng.random_range(-80.0..80.0)),
            origin_lon: Some(rng.random_range(-170.0..170.0)),
            target_lat: Some(rng.random_range(-80.0..80.0)),
            target_lon: Some(rng.random_range(-170.0..170.0)),
        };
        let mode: f64 = rng.random();
        let drop_mid = mode < ctx.args.drop_ratio;
        let no_retry = !drop_mid && mode < ctx.args.drop_ratio + ctx.args.no_retry_ratio;
        let mut attempts = 0;
        let seen = loop {
            attempts += 1;
            ctx.requests.fetch_add(1, Ordering::Relaxed);
            if attempts > 1 {
                ctx.retries.fetch_add(1, Ordering::Relaxed);
            }
            let timeout = if drop_mid {
                Duration::from_millis(rng.random_range(2..300))
            } else {
                Duration::from_secs(20)
            };
            let server = rng.random_range(0..ctx.rpcs.len());
            let sent = Instant::now();
            let answer = match call(&ctx.rpcs[server], &ctx.user, &key, params, timeout).await {
                Ok(Err(status)) if server == 1 && reason_of(&status) == "DATABASE_UNAVAILABLE" => {
                    ctx.faults
                        .add("pool_exhaustion/api-b answered DATABASE_UNAVAILABLE", 1);
                    classify(Err(status))
                }
                Ok(result) => classify(result),
                Err(()) if drop_mid => {
                    ctx.attempts.add("CLIENT/DROPPED_MID_REQUEST", 1);
                    break Seen::Abandoned(format!("dropped after {}ms", timeout.as_millis()));
                }
                Err(()) => Answer::Retry("CLIENT/TIMEOUT".to_owned()),
            };
            ctx.timeline.attempt(
                sent,
                match answer {
                    Answer::Final(_) => Attempted::Answered,
                    Answer::Retry(_) => Attempted::Failed,
                },
            );
            match answer {
                Answer::Final(seen) => {
                    ctx.attempts.add(
                        match &seen {
                            Seen::Ok { .. } => "OK".to_owned(),
                            Seen::Declined { .. } => "FailedPrecondition/CARD_DECLINED".to_owned(),
                            Seen::Unexpected(label) => label.clone(),
                            _ => "?".to_owned(),
                        },
                        1,
                    );
                    break seen;
                }
                Answer::Retry(label) => {
                    ctx.attempts.add(label.clone(), 1);
                    if drop_mid || no_retry {
                        break Seen::Abandoned(format!("no retry after {label}"));
                    }
                    if attempts >= ctx.args.max_tries || Instant::now() > ctx.hard_end {
                        break Seen::GaveUp(format!("{attempts} tries, last {label}"));
                    }
                    let ceiling = Duration::from_millis(50)
                        .saturating_mul(1 << attempts.min(6))
                        .min(Duration::from_secs(2));
                    let delay = Duration::from_millis(
                        rng.random_range(0..=ceiling.as_millis() as u64).max(20),
                    );
                    tokio::time::sleep(delay).await;
                }
            }
        };
        if matches!(seen, Seen::Abandoned(_) | Seen::GaveUp(_)) {
            ctx.timeline.key_left();
        }
        records.push(KeyRecord {
            key,
            user_id: ctx.user.id,
            client: ctx.id,
            params,
            attempts,
            seen,
        });
        if ctx.user.declining {
            // Declines are instant; keep the mix dominated by charges.
            tokio::time::sleep(Duration::from_millis(rng.random_range(50..250))).await;
        }
    }
    records
}

/// The endpoint of the api-server at `addr`: plaintext, or mutual TLS with `--tls-dir`. It is
/// built where every client builds one (`proto::client`), so the campaign's clients connect as
/// real ones do.
pub(crate) fn grpc_endpoint(args: &Args, addr: &str) -> anyhow::Result<tonic::transport::Endpoint> {
    let (url, tls) = match &args.tls_dir {
        None => (
            format!("http://{addr}"),
            proto::client::ClientTls::default(),
        ),
        Some(dir) => (
            format!("https://{addr}"),
            proto::client::ClientTls {
                ca: Some(dir.join("ca.pem")),
                cert: Some(dir.join("client.pem")),
                key: Some(dir.join("client.key")),
            },
        ),
    };
    Ok(proto::client::endpoint(&url, &tls)?)
}

/// Users: the first `declined_clients` clients decline.
pub(crate) async fn create_users(
    args: &Args,
    plan: &Plan,
    wiring: &Wiring,
) -> anyhow::Result<Vec<User>> {
    let pool = schema::build_pool(
        &wiring.database_url,
        4,
        Duration::from_secs(30),
        schema::PlanCache::Auto,
    );
    let mut users = Vec::new();
    for i in 0..args.clients {
        let declining = i < args.declined_clients;
        let card = if declining {
            "pm_card_chargeDeclined"
        } else {
            "pm_card_visa"
        };
        let (user, token) = api_server::auth::create_user(
            &pool,
            &format!("proof-{}-{i}@proof.rocketrides.test", plan.run_id),
            &format!("cus_proof_{}_{i}", plan.run_id),
            card,
        )
        .await
        .with_context(|| format!("creating user {i}"))?;
        users.push(User {
            id: user.id,
            token,
            declining,
        });
    }
    Ok(users)
}

/// When traffic runs: clients start no new key after `end`, and stop retrying after `hard_end`.
#[derive(Clone, Copy)]
pub(crate) struct Window {
    pub(crate) start: Instant,
    pub(crate) end: Instant,
    hard_end: Instant,
}

impl Window {
    pub(crate) fn from_now(duration: Duration) -> Self {
        let start = Instant::now();
        let end = start + duration;
        Window {
            start,
            end,
            hard_end: end + Duration::from_secs(60),
        }
    }
}

/// The running clients; each hands back its keys' records when it is done.
pub(crate) struct Traffic {
    clients: Vec<JoinHandle<Vec<KeyRecord>>>,
}

impl Traffic {
    /// One client per user, each with a channel to either api-server.
    pub(crate) fn start(
        args: &Args,
        plan: &Plan,
        users: &[User],
        tallies: &Tallies,
        window: Window,
    ) -> anyhow::Result<Self> {
        let mut clients: Vec<JoinHandle<Vec<KeyRecord>>> = Vec::new();
        for (i, user) in users.iter().enumerate() {
            let mut rpcs = Vec::new();
            for port in [args.grpc_port, args.grpc_port_b] {
                let channel = grpc_endpoint(args, &format!("127.0.0.1:{port}"))?
                    .connect_timeout(Duration::from_secs(1))
                    .connect_lazy();
                rpcs.push(RideServiceClient::new(channel));
            }
            let ctx = ClientCtx {
                id: i as u32,
                user: user.clone(),
                rpcs,
                faults: Arc::clone(&tallies.faults),
                run_id: plan.run_id.clone(),
                traffic_end: window.end,
                hard_end: window.hard_end,
                args: args.clone(),
                attempts: Arc::clone(&tallies.attempts),
                requests: Arc::clone(&tallies.requests),
                retries: Arc::clone(&tallies.retries),
                timeline: Arc::clone(&tallies.timeline),
            };
            clients.push(tokio::spawn(run_client(
                ctx,
                plan.seed.wrapping_add(1000 + i as u64),
            )));
        }
        Ok(Traffic { clients })
    }

    /// Waits for every client to finish its last key.
    pub(crate) async fn finish(self) -> anyhow::Result<Vec<KeyRecord>> {
        let mut records: Vec<KeyRecord> = Vec::new();
        for client in self.clients {
            records.extend(client.await?);
        }
        Ok(records)
    }
}
