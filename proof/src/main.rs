//! `proof`: a crash-and-fault campaign against the real Rocket Rides processes on loopback.
//!
//! It starts its own PostgreSQL cluster and RabbitMQ node ([`services`]), fake-stripe, two
//! api-servers (the second with a pool of two connections, to exhaust it), a mail sink, the
//! enqueuer and the receipt worker as separate child processes (plus `completer --once` /
//! `reaper --once` passes), and drives CreateRide with concurrent retrying clients spread over
//! both api-servers. Meanwhile it SIGKILLs the api-servers (at random, and at every crash point
//! of `api_server::fault`) and the workers, stalls an api-server past the lock timeout, restarts
//! PostgreSQL and RabbitMQ, and injects provider faults. Then it drains the system and checks
//! exactly-once charging and receipting against PostgreSQL, fake-stripe's ledger and the mail
//! sink's directory. Any violation is printed with the offending key and makes the process exit
//! non-zero. See docs/reliability.md.

mod args;
mod counters;
mod processes;
mod services;
mod setup;

use args::Args;
use counters::Counters;
use processes::{Children, Supervisor, kill_and_restart, signal};
use services::{ServerKind, Services};
use setup::{DbGuard, LOCK_TIMEOUT_SECS, Plan, STRIPE_KEY, Wiring};

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    fs::OpenOptions,
    path::Path,
    process::Stdio,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use clap::Parser;
use diesel::{
    QueryableByName,
    sql_types::{BigInt, Bool, Nullable, Text},
};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use prost::Message;
use proto::v1::{CreateRideRequest, CreateRideResponse, ride_service_client::RideServiceClient};
use rand::{Rng, SeedableRng, rngs::StdRng};
use serde_json::{Value, json};
use tokio::{process::Command, task::JoinHandle};
use tonic::{Code, Status, metadata::MetadataValue, transport::Channel};
use tonic_types::StatusExt;

// ---------------------------------------------------------------------------------------------
// Clients
// ---------------------------------------------------------------------------------------------

#[derive(Clone)]
struct User {
    id: i64,
    token: String,
    declining: bool,
}

#[derive(Clone, Debug)]
enum Seen {
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
    fn detail(&self) -> String {
        match self {
            Seen::Ok {
                ride_id, charge_id, ..
            } => format!("ride {ride_id} {charge_id}"),
            Seen::Declined { message, .. } => message.clone(),
            Seen::Abandoned(s) | Seen::GaveUp(s) | Seen::Unexpected(s) => s.clone(),
        }
    }

    fn kind(&self) -> &'static str {
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
struct KeyRecord {
    key: String,
    user_id: i64,
    client: u32,
    params: CreateRideRequest,
    attempts: u32,
    seen: Seen,
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

enum Answer {
    Final(Seen),
    Retry(String),
}

fn classify(result: Result<tonic::Response<CreateRideResponse>, Status>) -> Answer {
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

async fn call(
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

// ---------------------------------------------------------------------------------------------
// Faults
// ---------------------------------------------------------------------------------------------

fn exp_delay(rng: &mut StdRng, mean_secs: f64) -> Duration {
    let u: f64 = rng.random_range(0.0001..1.0);
    Duration::from_secs_f64((-u.ln() * mean_secs).clamp(0.3, mean_secs * 4.0))
}

/// Rare faults (restarts, stalls) come first at a random point of the traffic window's middle,
/// so even a short run has each at least once; then every `mean_secs` on average.
fn rare_fault_delay(
    rng: &mut StdRng,
    first: &mut bool,
    traffic: Duration,
    mean_secs: f64,
) -> Duration {
    if std::mem::take(first) {
        traffic.mul_f64(rng.random_range(0.15..0.5))
    } else {
        exp_delay(rng, mean_secs)
    }
}

async fn sleep_unless_stopped(stop: &AtomicBool, d: Duration) -> bool {
    let end = Instant::now() + d;
    while Instant::now() < end {
        if stop.load(Ordering::Relaxed) {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50).min(end - Instant::now())).await;
    }
    !stop.load(Ordering::Relaxed)
}

// ---------------------------------------------------------------------------------------------
// Database rows
// ---------------------------------------------------------------------------------------------

#[derive(QueryableByName, Debug)]
struct KeyRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = Text)]
    idempotency_key: String,
    #[diesel(sql_type = BigInt)]
    user_id: i64,
    #[diesel(sql_type = Text)]
    recovery_point: String,
    #[diesel(sql_type = Bool)]
    gave_up: bool,
}

#[derive(QueryableByName, Debug)]
struct RideRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = Nullable<BigInt>)]
    idempotency_key_id: Option<i64>,
    #[diesel(sql_type = BigInt)]
    user_id: i64,
    #[diesel(sql_type = Nullable<Text>)]
    stripe_charge_id: Option<String>,
}

#[derive(QueryableByName, Debug)]
struct IdRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

#[derive(QueryableByName, Debug)]
struct TextRow {
    #[diesel(sql_type = Text)]
    t: String,
}

#[derive(QueryableByName, Debug)]
struct AttentionRow {
    #[diesel(sql_type = Text)]
    idempotency_key: String,
    #[diesel(sql_type = BigInt)]
    user_id: i64,
    #[diesel(sql_type = Text)]
    reason: String,
}

#[derive(QueryableByName, Debug)]
struct CountRow {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// The proof drives api-servers it starts itself on loopback, in plaintext; the endpoint is still
/// built where every client builds one.
/// The endpoint of the api-server at `addr`: plaintext, or mutual TLS with `--tls-dir`.
fn grpc_endpoint(args: &Args, addr: &str) -> anyhow::Result<tonic::transport::Endpoint> {
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

async fn count(conn: &mut AsyncPgConnection, sql: &str) -> anyhow::Result<i64> {
    Ok(diesel::sql_query(sql)
        .get_result::<CountRow>(conn)
        .await
        .with_context(|| sql.to_owned())?
        .n)
}

// ---------------------------------------------------------------------------------------------
// Ledger and mail
// ---------------------------------------------------------------------------------------------

struct Intent {
    id: String,
    status: String,
    ride_id: Option<i64>,
}

async fn fetch_ledger(http: &reqwest::Client, base: &str) -> anyhow::Result<Vec<Intent>> {
    let mut out = Vec::new();
    let mut after: Option<String> = None;
    for _page in 0..100_000 {
        let mut url = format!("{base}/v1/payment_intents?limit=100");
        if let Some(a) = &after {
            url.push_str(&format!("&starting_after={a}"));
        }
        let body: Value = http
            .get(&url)
            .bearer_auth(STRIPE_KEY)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        let data = body["data"].as_array().cloned().unwrap_or_default();
        for pi in &data {
            out.push(Intent {
                id: pi["id"].as_str().unwrap_or_default().to_owned(),
                status: pi["status"].as_str().unwrap_or_default().to_owned(),
                ride_id: pi["metadata"]["ride_id"]
                    .as_str()
                    .and_then(|s| s.parse().ok()),
            });
        }
        after = out.last().map(|pi| pi.id.clone());
        if !body["has_more"].as_bool().unwrap_or(false) || data.is_empty() {
            return Ok(out);
        }
    }
    bail!("ledger pagination did not end")
}

/// ride id → the nanosecond stamps of the .eml files carrying `<ride-N.receipt@…>`.
fn read_mail(dir: &Path) -> anyhow::Result<(BTreeMap<i64, Vec<i128>>, u64)> {
    let mut by_ride: BTreeMap<i64, Vec<i128>> = BTreeMap::new();
    let mut unparsed = 0;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().and_then(|e| e.to_str()) != Some("eml") {
            continue;
        }
        let stamp: i128 = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.split('-').next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_default();
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let ride = text
            .lines()
            .find(|l| l.to_ascii_lowercase().starts_with("message-id:"))
            .and_then(|l| l.split("<ride-").nth(1))
            .and_then(|rest| rest.split(".receipt@").next())
            .and_then(|n| n.parse::<i64>().ok());
        match ride {
            Some(ride) => by_ride.entry(ride).or_default().push(stamp),
            None => unparsed += 1,
        }
    }
    Ok((by_ride, unparsed))
}

// ---------------------------------------------------------------------------------------------
// Main
// ---------------------------------------------------------------------------------------------

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let code = tokio::select! {
        result = campaign(args) => match result {
            Ok(true) => 0,
            Ok(false) => 1,
            Err(error) => {
                eprintln!("proof: error: {error:#}");
                2
            }
        },
        () = interrupted() => {
            eprintln!("proof: interrupted; children are killed on drop");
            130
        }
    };
    // The private servers are daemons, not children: stop them explicitly.
    if code == 130
        && let Some(services) = RUNNING_SERVICES.get()
    {
        services.stop(false).await;
    }
    // Dropping the campaign future above killed every child (kill_on_drop).
    std::process::exit(code);
}

struct Violations {
    list: Vec<String>,
    by_invariant: BTreeMap<&'static str, u64>,
}

impl Violations {
    fn add(&mut self, invariant: &'static str, what: String) {
        *self.by_invariant.entry(invariant).or_default() += 1;
        if self.list.len() < 500 {
            eprintln!("VIOLATION [{invariant}] {what}");
        }
        self.list.push(format!("[{invariant}] {what}"));
    }
}

async fn campaign(args: Args) -> anyhow::Result<bool> {
    let plan = Plan::new(&args)?;
    setup::check_ports_free(&args).await?;
    let services = setup::start_services(&args, &plan).await?;
    let wiring = Wiring::new(&args, &plan, &services)?;
    println!(
        "proof: run {}, seed {}, {}s of traffic, {} clients, database {}, out {}",
        plan.run_id,
        plan.seed,
        plan.duration.as_secs(),
        args.clients,
        wiring.db_name,
        plan.out_dir.display()
    );
    let services = Arc::new(services);
    let _ = RUNNING_SERVICES.set(Arc::clone(&services));
    let migrated = setup::migrate(&plan.bin_dir, &wiring.env).await;
    if migrated.is_err() {
        services.stop(args.keep).await;
    }
    migrated?;
    let guard = DbGuard::new(&wiring, args.keep);
    let result = run(&args, &plan, &wiring, Arc::clone(&services)).await;
    if services.pg.is_none() {
        guard.cleanup().await;
    }
    services.stop(args.keep).await;
    result
}

/// Stops and starts `kind` at random moments until traffic stops; counts it as skipped when the
/// campaign runs on the shared server.
async fn restart_at_random(
    services: Arc<Services>,
    kind: ServerKind,
    faults: Arc<Counters>,
    stop: Arc<AtomicBool>,
    mut rng: StdRng,
    traffic: Duration,
    mean: f64,
) -> anyhow::Result<()> {
    if !services.runs(kind) {
        let name = kind.label().split(' ').next().unwrap_or_default();
        faults.add(format!("{name} SKIPPED (shared server)"), 1);
        return Ok(());
    }
    let mut first = true;
    while sleep_unless_stopped(&stop, rare_fault_delay(&mut rng, &mut first, traffic, mean)).await {
        services.stop_server(kind).await?;
        faults.add(kind.label(), 1);
        tokio::time::sleep(Duration::from_millis(rng.random_range(kind.downtime_ms()))).await;
        services.start_server(kind).await?;
    }
    Ok(())
}

/// Ctrl-C or SIGTERM.
async fn interrupted() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// The private servers of this run, for the interrupt path.
static RUNNING_SERVICES: std::sync::OnceLock<Arc<Services>> = std::sync::OnceLock::new();

async fn run_once(
    bin: &Path,
    what: &str,
    env: &[(String, String)],
    log: &Path,
) -> anyhow::Result<Value> {
    let err = OpenOptions::new().create(true).append(true).open(log)?;
    let child = Command::new(bin)
        .args([what, "--once"])
        .envs(env.iter().cloned())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(err))
        .kill_on_drop(true)
        .spawn()?;
    let output = tokio::time::timeout(Duration::from_secs(90), child.wait_with_output())
        .await
        .context("--once pass timed out")??;
    if !output.status.success() {
        bail!("workers {what} --once: {}", output.status);
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text.lines().rev().find(|l| l.trim_start().starts_with('{'));
    Ok(line
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or(Value::Null))
}

fn accumulate(totals: &Counters, prefix: &str, summary: &Value) {
    if let Some(map) = summary.as_object() {
        for (k, v) in map {
            if let Some(n) = v.as_u64() {
                totals.add(format!("{prefix}.{k}"), n);
            }
        }
    }
}

#[allow(clippy::too_many_lines)]
async fn run(
    args: &Args,
    plan: &Plan,
    wiring: &Wiring,
    services: Arc<Services>,
) -> anyhow::Result<bool> {
    let mut children = Children::start(args, plan, wiring).await?;
    let workers_bin = plan.bin_dir.join("workers");
    let apis = children.apis();
    let arming = Arc::clone(&children.arming);

    // Users: the first `declined_clients` clients decline.
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

    let faults = Arc::new(Counters::default());
    let attempts = Arc::new(Counters::default());
    let maintenance = Arc::new(Counters::default());
    let requests = Arc::new(AtomicU64::new(0));
    let retries = Arc::new(AtomicU64::new(0));
    let stop_faults = Arc::new(AtomicBool::new(false));
    let stop_maintenance = Arc::new(AtomicBool::new(false));
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .no_proxy()
        .build()?;

    let traffic_start = Instant::now();
    let traffic_end = traffic_start + plan.duration;
    let hard_end = traffic_end + Duration::from_secs(60);

    // Clients.
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
            faults: Arc::clone(&faults),
            run_id: plan.run_id.clone(),
            traffic_end,
            hard_end,
            args: args.clone(),
            attempts: Arc::clone(&attempts),
            requests: Arc::clone(&requests),
            retries: Arc::clone(&retries),
        };
        clients.push(tokio::spawn(run_client(
            ctx,
            plan.seed.wrapping_add(1000 + i as u64),
        )));
    }

    let supervisor = Supervisor::start(&children, &faults);
    // Fault: api-server SIGKILL + restart, at random moments.
    let api_killer = {
        let (apis, faults, stop) = (apis.clone(), Arc::clone(&faults), Arc::clone(&stop_faults));
        let mean = args.api_kill_every_secs;
        let mut rng = StdRng::seed_from_u64(plan.seed.wrapping_add(1));
        tokio::spawn(async move {
            while sleep_unless_stopped(&stop, exp_delay(&mut rng, mean)).await {
                let pause = Duration::from_millis(rng.random_range(0..800));
                let which = &apis[rng.random_range(0..apis.len())];
                kill_and_restart(which, pause, &faults, "sigkill/api-server (random moment)")
                    .await?;
            }
            anyhow::Ok(())
        })
    };
    // Fault: an api-server stalls (SIGSTOP) for longer than the lock timeout, then resumes. Its
    // in-flight attempts' keys are taken over by retries on the other api-server meanwhile;
    // when it resumes, their fencing tokens are gone.
    let staller = {
        let (apis, faults, stop) = (apis.clone(), Arc::clone(&faults), Arc::clone(&stop_faults));
        let (mean, traffic, mut first) = (args.stall_every_secs, plan.duration, true);
        let lock_timeout: f64 = LOCK_TIMEOUT_SECS.parse().unwrap_or(6.0);
        let mut rng = StdRng::seed_from_u64(plan.seed.wrapping_add(5));
        tokio::spawn(async move {
            while sleep_unless_stopped(&stop, rare_fault_delay(&mut rng, &mut first, traffic, mean))
                .await
            {
                let which = &apis[rng.random_range(0..apis.len())];
                let Some(pid) = which.lock().await.pid() else {
                    continue;
                };
                if signal(pid, "-STOP").await {
                    faults.add("stall/api-server SIGSTOP past the lock timeout", 1);
                    let stall = lock_timeout + rng.random_range(0.5..2.5);
                    tokio::time::sleep(Duration::from_secs_f64(stall)).await;
                    signal(pid, "-CONT").await;
                }
            }
            anyhow::Ok(())
        })
    };
    // Fault: PostgreSQL fast shutdown and restart under load; RabbitMQ stop and start during
    // drains and consumption.
    let restarter = |kind: ServerKind, mean: f64, salt: u64| {
        let (services, faults, stop) = (
            Arc::clone(&services),
            Arc::clone(&faults),
            Arc::clone(&stop_faults),
        );
        let rng = StdRng::seed_from_u64(plan.seed.wrapping_add(salt));
        tokio::spawn(restart_at_random(
            services,
            kind,
            faults,
            stop,
            rng,
            plan.duration,
            mean,
        ))
    };
    let pg_restarter = restarter(ServerKind::Postgres, args.pg_restart_every_secs, 6);
    let rabbit_restarter = restarter(ServerKind::Rabbit, args.rabbit_restart_every_secs, 7);
    // Fault: enqueuer / receipt worker SIGKILL + restart.
    let worker_killer = {
        let (enq, rec, faults, stop) = (
            Arc::clone(&children.enqueuer),
            Arc::clone(&children.receipts),
            Arc::clone(&faults),
            Arc::clone(&stop_faults),
        );
        let mean = args.worker_kill_every_secs;
        let mut rng = StdRng::seed_from_u64(plan.seed.wrapping_add(2));
        tokio::spawn(async move {
            while sleep_unless_stopped(&stop, exp_delay(&mut rng, mean)).await {
                let pause = Duration::from_millis(rng.random_range(0..1000));
                if rng.random_bool(0.5) {
                    kill_and_restart(&enq, pause, &faults, "sigkill/enqueuer").await?;
                } else {
                    kill_and_restart(&rec, pause, &faults, "sigkill/receipts").await?;
                }
            }
            anyhow::Ok(())
        })
    };
    // Fault: provider faults through fake-stripe's HTTP API.
    let stripe_faulter = {
        let (faults, stop, http) = (Arc::clone(&faults), Arc::clone(&stop_faults), http.clone());
        let base = wiring.stripe_base.clone();
        let mean = args.stripe_fault_every_secs;
        let mut rng = StdRng::seed_from_u64(plan.seed.wrapping_add(3));
        tokio::spawn(async move {
            while sleep_unless_stopped(&stop, exp_delay(&mut rng, mean)).await {
                // `slow`: the charge completes 8 s later, past the api-server's Stripe timeout and its
                // key lock, so retries take the key over while the first charge is still running.
                let mode =
                    ["error_500", "timeout", "charge_then_drop", "slow"][rng.random_range(0..4)];
                let n: u64 = rng.random_range(1..=3);
                let ok = http
                    .post(format!("{base}/_faults"))
                    .json(&json!({"mode": mode, "count": n}))
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success());
                if ok {
                    faults.add(format!("stripe/{mode} (injections)"), 1);
                    faults.add(format!("stripe/{mode} (calls faulted, requested)"), n);
                } else {
                    faults.add("stripe/injection_failed", 1);
                }
            }
            anyhow::Ok(())
        })
    };
    // Periodic completer / reaper passes (they also run during faults).
    let maintainer = {
        let (maint, stop, env) = (
            Arc::clone(&maintenance),
            Arc::clone(&stop_maintenance),
            wiring.env.clone(),
        );
        let (bin, log) = (workers_bin.clone(), plan.log_dir.join("completer.log"));
        let rlog = plan.log_dir.join("reaper.log");
        tokio::spawn(async move {
            while sleep_unless_stopped(&stop, Duration::from_secs(2)).await {
                match run_once(&bin, "completer", &env, &log).await {
                    Ok(v) => {
                        maint.add("completer.passes", 1);
                        accumulate(&maint, "completer", &v);
                    }
                    Err(_) => maint.add("completer.failed_passes", 1),
                }
                match run_once(&bin, "reaper", &env, &rlog).await {
                    Ok(v) => {
                        maint.add("reaper.passes", 1);
                        accumulate(&maint, "reaper", &v);
                    }
                    Err(_) => maint.add("reaper.failed_passes", 1),
                }
            }
        })
    };

    // Progress.
    let progress = {
        let (requests, stop) = (Arc::clone(&requests), Arc::clone(&stop_faults));
        let faults = Arc::clone(&faults);
        tokio::spawn(async move {
            while sleep_unless_stopped(&stop, Duration::from_secs(10)).await {
                let f: u64 = faults.snapshot().values().sum();
                println!(
                    "proof: t+{:>4}s requests {:>6}, fault events {f}",
                    traffic_start.elapsed().as_secs(),
                    AtomicU64::load(&requests, Ordering::Relaxed)
                );
            }
        })
    };

    tokio::time::sleep_until(traffic_end.into()).await;
    stop_faults.store(true, Ordering::Relaxed);
    for task in [
        api_killer,
        worker_killer,
        stripe_faulter,
        staller,
        pg_restarter,
        rabbit_restarter,
    ] {
        task.await??;
    }
    let _ = progress.await;
    let _ = http
        .delete(format!("{}/_faults", wiring.stripe_base))
        .send()
        .await;
    println!(
        "proof: traffic stopped after {}s; faults off; waiting for clients",
        traffic_start.elapsed().as_secs()
    );
    children.disarm(&faults).await?;
    let mut records: Vec<KeyRecord> = Vec::new();
    for client in clients {
        records.extend(client.await?);
    }
    stop_maintenance.store(true, Ordering::Relaxed);
    let _ = maintainer.await;
    let clients_done = Instant::now();

    // Drain 1: the completer until no key is unfinished (bounded).
    let mut conn = schema::connect(&wiring.database_url).await?;
    let completer_deadline = Instant::now() + Duration::from_secs(if args.long { 120 } else { 45 });
    let mut unfinished = -1;
    while Instant::now() < completer_deadline {
        unfinished = count(
            &mut conn,
            "SELECT count(*) AS n FROM idempotency_keys WHERE recovery_point <> 'finished' \
             AND completer_gave_up_at IS NULL",
        )
        .await?;
        if unfinished == 0 {
            break;
        }
        match run_once(
            &workers_bin,
            "completer",
            &wiring.env,
            &plan.log_dir.join("completer.log"),
        )
        .await
        {
            Ok(v) => {
                maintenance.add("completer.passes", 1);
                accumulate(&maintenance, "completer", &v);
            }
            Err(_) => maintenance.add("completer.failed_passes", 1),
        }
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    let completer_drain = clients_done.elapsed();
    println!(
        "proof: completer drain {:.1}s, unfinished keys left {unfinished}",
        completer_drain.as_secs_f64()
    );

    // Drain 2: enqueuer and receipts (bounded).
    let receipts_deadline = Instant::now() + Duration::from_secs(if args.long { 120 } else { 40 });
    let (mut staged, mut charged, mut sent) = (0, 0, 0);
    while Instant::now() < receipts_deadline {
        staged = count(&mut conn, "SELECT count(*) AS n FROM staged_jobs").await?;
        charged = count(
            &mut conn,
            "SELECT count(*) AS n FROM rides r JOIN idempotency_keys k ON k.id = r.idempotency_key_id \
             WHERE r.stripe_charge_id IS NOT NULL AND k.recovery_point = 'finished'",
        )
        .await?;
        sent = count(&mut conn, "SELECT count(*) AS n FROM sent_receipts").await?;
        let mails: usize = read_mail(&plan.mail_dir)?.0.values().map(Vec::len).sum();
        if staged == 0 && sent >= charged && mails as i64 >= sent {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Let a straggling duplicate (if any) land before counting.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let receipts_drain = clients_done.elapsed() - completer_drain;
    println!(
        "proof: receipts drain {:.1}s (staged {staged}, finished charged rides {charged}, sent {sent})",
        receipts_drain.as_secs_f64()
    );

    // Replays, while the api-server still runs: every key the DB holds as finished.
    let mut v = Violations {
        list: Vec::new(),
        by_invariant: BTreeMap::new(),
    };
    let keys: Vec<KeyRow> = diesel::sql_query(
        "SELECT id, idempotency_key, user_id, recovery_point, \
         completer_gave_up_at IS NOT NULL AS gave_up FROM idempotency_keys",
    )
    .load(&mut conn)
    .await?;
    let key_by_name: HashMap<(i64, String), &KeyRow> = keys
        .iter()
        .map(|k| ((k.user_id, k.idempotency_key.clone()), k))
        .collect();
    let token_of: HashMap<i64, &User> = users.iter().map(|u| (u.id, u)).collect();
    let replay_channel = grpc_endpoint(args, &wiring.grpc_addr)?.connect().await?;
    let rpc = RideServiceClient::new(replay_channel);
    let mut replay_stats: BTreeMap<&'static str, u64> = BTreeMap::new();
    let mut replay_seen: HashMap<String, Seen> = HashMap::new();
    {
        let mut set = tokio::task::JoinSet::new();
        let mut queue: Vec<KeyRecord> = records
            .iter()
            .filter(|r| {
                key_by_name
                    .get(&(r.user_id, r.key.clone()))
                    .is_some_and(|k| k.recovery_point == "finished")
            })
            .cloned()
            .collect();
        while !queue.is_empty() || !set.is_empty() {
            while set.len() < 16 {
                let Some(record) = queue.pop() else { break };
                let Some(user) = token_of.get(&record.user_id).map(|u| (*u).clone()) else {
                    continue;
                };
                let rpc = rpc.clone();
                set.spawn(async move {
                    let result = call(
                        &rpc,
                        &user,
                        &record.key,
                        record.params,
                        Duration::from_secs(20),
                    )
                    .await;
                    let replayed = match &result {
                        Ok(Ok(r)) => r
                            .metadata()
                            .get("idempotent-replayed")
                            .is_some_and(|v| v.as_bytes() == b"true"),
                        _ => true,
                    };
                    let seen = match result {
                        Ok(r) => match classify(r) {
                            Answer::Final(seen) => seen,
                            Answer::Retry(label) => Seen::Unexpected(label),
                        },
                        Err(()) => Seen::Unexpected("CLIENT/TIMEOUT".to_owned()),
                    };
                    (record, seen, replayed)
                });
            }
            let Some(joined) = set.join_next().await else {
                break;
            };
            let (record, seen, replayed) = joined?;
            *replay_stats.entry("replayed").or_default() += 1;
            if !replayed {
                v.add(
                    "replay_marked",
                    format!(
                        "key {} replay not marked idempotent-replayed: true",
                        record.key
                    ),
                );
            }
            let same = match (&record.seen, &seen) {
                (
                    Seen::Ok {
                        bytes: a,
                        expires_at: ea,
                        ..
                    },
                    Seen::Ok {
                        bytes: b,
                        expires_at: eb,
                        ..
                    },
                ) => Some(a == b && (ea.is_none() || ea == eb)),
                (
                    Seen::Declined {
                        message: ma,
                        details: da,
                    },
                    Seen::Declined {
                        message: mb,
                        details: db,
                    },
                ) => Some(ma == mb && da == db),
                (Seen::Ok { .. } | Seen::Declined { .. }, _) => Some(false),
                _ => None, // abandoned by its client: nothing to compare with; checked below
            };
            match same {
                Some(true) => *replay_stats.entry("byte_identical").or_default() += 1,
                Some(false) => v.add(
                    "replay_identical",
                    format!(
                        "key {} (user {}): first answer {:?} vs replay {:?}",
                        record.key,
                        record.user_id,
                        record.seen.kind(),
                        seen.kind()
                    ),
                ),
                None => *replay_stats.entry("of_client_abandoned_keys").or_default() += 1,
            }
            if matches!(seen, Seen::Unexpected(_)) {
                v.add(
                    "replay_final",
                    format!("key {}: finished key replayed as {seen:?}", record.key),
                );
            }
            replay_seen.insert(record.key.clone(), seen);
        }
    }

    // Collect the evidence.
    let rides: Vec<RideRow> =
        diesel::sql_query("SELECT id, idempotency_key_id, user_id, stripe_charge_id FROM rides")
            .load(&mut conn)
            .await?;
    let sent_receipts: HashSet<i64> = diesel::sql_query("SELECT ride_id AS id FROM sent_receipts")
        .load::<IdRow>(&mut conn)
        .await?
        .into_iter()
        .map(|r| r.id)
        .collect();
    // Receipts whose sending attempt died after the relay took the mail: the crash window, closed.
    let recovered_at_relay = count(
        &mut conn,
        "SELECT count(*) AS n FROM sent_receipts WHERE recorded_via = 'relay_search'",
    )
    .await?;
    let claims_left = count(&mut conn, "SELECT count(*) AS n FROM receipt_claims").await?;
    let staged_rides: Vec<i64> = diesel::sql_query("SELECT job_args::text AS t FROM staged_jobs")
        .load::<TextRow>(&mut conn)
        .await?
        .into_iter()
        .filter_map(|r| serde_json::from_str::<Value>(&r.t).ok())
        .filter_map(|v| v["ride_id"].as_i64())
        .collect();
    let attention: Vec<AttentionRow> =
        diesel::sql_query("SELECT idempotency_key, user_id, reason FROM keys_needing_attention")
            .load(&mut conn)
            .await?;
    let attention_keys: HashSet<(i64, String)> = attention
        .iter()
        .map(|a| (a.user_id, a.idempotency_key.clone()))
        .collect();
    let ledger = fetch_ledger(&http, &wiring.stripe_base).await?;
    let (mail, unparsed_mail) = read_mail(&plan.mail_dir)?;
    drop(conn);

    // Stop every child before judging (the database and ledger are read).
    supervisor.stop().await;
    children.kill_all().await;

    // Indexes.
    let rides_by_key: HashMap<i64, Vec<&RideRow>> =
        rides.iter().fold(HashMap::new(), |mut m, r| {
            if let Some(k) = r.idempotency_key_id {
                m.entry(k).or_insert_with(Vec::new).push(r);
            }
            m
        });
    let ride_by_id: HashMap<i64, &RideRow> = rides.iter().map(|r| (r.id, r)).collect();
    let mut succeeded_by_ride: HashMap<i64, Vec<&Intent>> = HashMap::new();
    let mut all_by_ride: HashMap<i64, Vec<&Intent>> = HashMap::new();
    for pi in &ledger {
        match pi.ride_id {
            Some(ride) => {
                all_by_ride.entry(ride).or_default().push(pi);
                if pi.status == "succeeded" {
                    succeeded_by_ride.entry(ride).or_default().push(pi);
                }
            }
            None => v.add(
                "pi_has_ride",
                format!("PaymentIntent {} has no metadata[ride_id]", pi.id),
            ),
        }
    }
    // Per-ride receipt/charge checks for a ride that must be charged exactly once.
    let check_charged_ride = |v: &mut Violations,
                              key: &str,
                              ride: &RideRow,
                              expected_pi: Option<&str>| {
        let succeeded = succeeded_by_ride
            .get(&ride.id)
            .map_or(&[][..], Vec::as_slice);
        if succeeded.len() != 1 {
            v.add(
                "one_succeeded_pi",
                format!(
                    "key {key}: ride {} has {} succeeded PaymentIntents",
                    ride.id,
                    succeeded.len()
                ),
            );
        }
        if let Some(pi) = succeeded.first() {
            if ride.stripe_charge_id.as_deref() != Some(pi.id.as_str()) {
                v.add(
                    "ride_records_pi",
                    format!(
                        "key {key}: ride {} charge {:?} but PI {}",
                        ride.id, ride.stripe_charge_id, pi.id
                    ),
                );
            }
            if let Some(expected) = expected_pi
                && expected != pi.id
            {
                v.add(
                    "client_saw_pi",
                    format!(
                        "key {key}: client saw charge {expected}, ledger has {}",
                        pi.id
                    ),
                );
            }
        }
        let staged = staged_rides.iter().filter(|r| **r == ride.id).count();
        let receipt = staged + usize::from(sent_receipts.contains(&ride.id));
        if receipt != 1 || staged != 0 {
            v.add(
                "one_receipt",
                format!(
                    "key {key}: ride {}: staged {staged}, sent_receipts {} (want exactly one, mailed)",
                    ride.id,
                    sent_receipts.contains(&ride.id)
                ),
            );
        }
        let mails = mail.get(&ride.id).map_or(&[][..], Vec::as_slice);
        if mails.len() != 1 {
            v.add(
                "one_mail",
                format!("key {key}: ride {} has {} mails", ride.id, mails.len()),
            );
        }
    };
    let check_declined_ride = |v: &mut Violations, key: &str, ride: &RideRow| {
        let all = all_by_ride.get(&ride.id).map_or(0, Vec::len);
        let ok = succeeded_by_ride.get(&ride.id).map_or(0, Vec::len);
        if all > 1 || ok > 0 {
            v.add(
                "declined_once",
                format!(
                    "key {key}: declined ride {} has {all} PaymentIntents ({ok} succeeded)",
                    ride.id
                ),
            );
        }
        if ride.stripe_charge_id.is_some()
            || sent_receipts.contains(&ride.id)
            || mail.contains_key(&ride.id)
        {
            v.add(
                "declined_no_receipt",
                format!(
                    "key {key}: declined ride {} has a charge id, receipt or mail",
                    ride.id
                ),
            );
        }
    };

    // Per key, by what the client finally saw.
    let mut outcomes: BTreeMap<String, u64> = BTreeMap::new();
    let mut abandoned_resolution: BTreeMap<&'static str, u64> = BTreeMap::new();
    for r in &records {
        *outcomes.entry(r.seen.kind().to_owned()).or_default() += 1;
        let row = key_by_name.get(&(r.user_id, r.key.clone()));
        let key_rides = row
            .and_then(|k| rides_by_key.get(&k.id))
            .map_or(&[][..], Vec::as_slice);
        match &r.seen {
            Seen::Ok {
                ride_id, charge_id, ..
            } => {
                if token_of.get(&r.user_id).is_some_and(|u| u.declining) {
                    v.add(
                        "declining_card_never_ok",
                        format!("key {}: declining card succeeded", r.key),
                    );
                }
                match row {
                    Some(k) if k.recovery_point == "finished" => {}
                    _ => v.add(
                        "ok_key_finished",
                        format!(
                            "key {}: client saw OK but key is {:?}",
                            r.key,
                            row.map(|k| &k.recovery_point)
                        ),
                    ),
                }
                if key_rides.len() != 1 {
                    v.add(
                        "one_ride",
                        format!("key {}: {} rides", r.key, key_rides.len()),
                    );
                }
                match key_rides.first() {
                    Some(ride) => {
                        if ride.user_id != r.user_id {
                            v.add(
                                "client_saw_ride",
                                format!(
                                    "key {}: ride {} belongs to user {}",
                                    r.key, ride.id, ride.user_id
                                ),
                            );
                        }
                        if ride.id != *ride_id {
                            v.add(
                                "client_saw_ride",
                                format!(
                                    "key {}: client saw ride {ride_id}, DB has {}",
                                    r.key, ride.id
                                ),
                            );
                        }
                        check_charged_ride(&mut v, &r.key, ride, Some(charge_id));
                    }
                    None => v.add(
                        "one_ride",
                        format!("key {}: client saw ride {ride_id}, no ride in DB", r.key),
                    ),
                }
            }
            Seen::Declined { .. } => {
                if !token_of.get(&r.user_id).is_some_and(|u| u.declining) {
                    v.add(
                        "good_card_never_declined",
                        format!("key {}: good card declined", r.key),
                    );
                }
                match key_rides.first() {
                    Some(ride) => check_declined_ride(&mut v, &r.key, ride),
                    None => v.add(
                        "one_ride",
                        format!("key {}: declined but no ride row", r.key),
                    ),
                }
            }
            Seen::Abandoned(_) | Seen::GaveUp(_) => {
                let listed = attention_keys.contains(&(r.user_id, r.key.clone()));
                match row {
                    None => *abandoned_resolution.entry("never_reached_the_database").or_default() += 1,
                    Some(k) if k.recovery_point == "finished" => {
                        *abandoned_resolution.entry("finished_by_completer_or_server").or_default() += 1;
                        match (replay_seen.get(&r.key), key_rides.first()) {
                            (Some(Seen::Ok { ride_id, charge_id, .. }), Some(ride)) => {
                                if *ride_id != ride.id {
                                    v.add("client_saw_ride", format!("key {}: replay ride {ride_id}, DB {}", r.key, ride.id));
                                }
                                check_charged_ride(&mut v, &r.key, ride, Some(charge_id));
                            }
                            (Some(Seen::Declined { .. }), Some(ride)) => check_declined_ride(&mut v, &r.key, ride),
                            (other, ride) => v.add(
                                "abandoned_resolved",
                                format!("key {}: finished, replay {:?}, ride {:?}", r.key, other.map(Seen::kind), ride.map(|r| r.id)),
                            ),
                        }
                    }
                    Some(_) if listed => *abandoned_resolution.entry("listed_in_keys_needing_attention").or_default() += 1,
                    Some(k) => v.add(
                        "abandoned_resolved",
                        format!("key {} (user {}): unfinished at {} (gave_up {}) and not in keys_needing_attention", r.key, r.user_id, k.recovery_point, k.gave_up),
                    ),
                }
                if let Seen::GaveUp(why) = &r.seen {
                    eprintln!("proof: note: key {} client gave up ({why})", r.key);
                }
            }
            Seen::Unexpected(label) => {
                v.add("no_unexpected_answer", format!("key {}: {label}", r.key))
            }
        }
    }
    // Crash points: every one fired, and the api-servers died of nothing else.
    let crash_points_fired = arming.fired();
    if !args.no_crash_points {
        for point in api_server::fault::CRASH_POINTS {
            if !crash_points_fired.contains_key(*point) {
                v.add(
                    "crash_points_fired",
                    format!("crash point {point} never fired (is the api-server built with the fault-injection feature?)"),
                );
            }
        }
    }
    let fault_counts = faults.snapshot();
    let api_self_exits = fault_counts
        .get("self_exit/api-server")
        .copied()
        .unwrap_or(0)
        + fault_counts
            .get("self_exit/api-server-b")
            .copied()
            .unwrap_or(0);
    let crashes: u64 = crash_points_fired.values().sum();
    if api_self_exits > crashes {
        v.add(
            "no_unexpected_exit",
            format!("the api-servers exited {api_self_exits} times on their own but crash points fired {crashes} times: see logs/api-server*.log"),
        );
    }
    if claims_left > 0 {
        v.add(
            "one_mail",
            format!("{claims_left} receipt claims were never resolved"),
        );
    }
    // Global ledger checks.
    for (ride, pis) in &succeeded_by_ride {
        if pis.len() > 1 {
            v.add(
                "no_double_charge",
                format!(
                    "ride {ride} charged {} times: {}",
                    pis.len(),
                    pis.iter()
                        .map(|p| p.id.as_str())
                        .collect::<Vec<_>>()
                        .join(",")
                ),
            );
        }
        match ride_by_id.get(ride) {
            None => v.add(
                "pi_has_ride",
                format!("succeeded PI(s) for ride {ride} which does not exist"),
            ),
            Some(row) => {
                let listed = row
                    .idempotency_key_id
                    .and_then(|id| keys.iter().find(|k| k.id == id))
                    .is_some_and(|k| {
                        attention_keys.contains(&(k.user_id, k.idempotency_key.clone()))
                    });
                if row.stripe_charge_id.is_none() && !listed {
                    v.add("pi_has_ride", format!("ride {ride} was charged ({}) but records no charge and is not listed for attention", pis[0].id));
                }
            }
        }
    }
    for (ride, stamps) in &mail {
        if !ride_by_id.contains_key(ride) {
            v.add(
                "mail_has_ride",
                format!("{} mails for unknown ride {ride}", stamps.len()),
            );
        }
    }
    if unparsed_mail > 0 {
        v.add(
            "mail_has_ride",
            format!("{unparsed_mail} mails without a ride Message-ID"),
        );
    }
    for ride in &rides {
        if ride.stripe_charge_id.is_some() && !succeeded_by_ride.contains_key(&ride.id) {
            v.add(
                "ride_records_pi",
                format!(
                    "ride {} records charge {:?} the ledger does not hold as succeeded",
                    ride.id, ride.stripe_charge_id
                ),
            );
        }
    }

    // Every key, one JSON line each.
    let keys_jsonl: String = records
        .iter()
        .map(|r| {
            json!({"key": r.key, "user_id": r.user_id, "client": r.client, "attempts": r.attempts,
                   "seen": r.seen.kind(), "detail": r.seen.detail()})
            .to_string()
                + "\n"
        })
        .collect();
    std::fs::write(plan.out_dir.join("keys.jsonl"), keys_jsonl)?;

    // Report.
    let total = plan.started.elapsed();
    let invariants = [
        (
            "ok_key_finished",
            "every key a client saw succeed is finished",
        ),
        ("one_ride", "exactly one ride per key"),
        (
            "client_saw_ride",
            "the ride the client saw is the ride in the database",
        ),
        (
            "one_succeeded_pi",
            "exactly one succeeded PaymentIntent per charged ride",
        ),
        (
            "client_saw_pi",
            "the charge the client saw is the one in the ledger",
        ),
        (
            "ride_records_pi",
            "the ride records the ledger's PaymentIntent",
        ),
        (
            "one_receipt",
            "exactly one receipt (staged or sent) per charged ride, all drained",
        ),
        (
            "one_mail",
            "exactly one mail per charged ride, no claim left",
        ),
        (
            "crash_points_fired",
            "every api-server crash point fired at least once",
        ),
        (
            "no_unexpected_exit",
            "api-servers exited only at crash points or by our kills",
        ),
        (
            "no_double_charge",
            "no ride has two succeeded PaymentIntents",
        ),
        ("pi_has_ride", "no succeeded PaymentIntent without its ride"),
        ("mail_has_ride", "no mail for an unknown ride"),
        (
            "abandoned_resolved",
            "every abandoned key is finished or in keys_needing_attention",
        ),
        (
            "replay_identical",
            "replays are byte-identical to the first final answer",
        ),
        ("replay_marked", "replays carry idempotent-replayed: true"),
        ("replay_final", "finished keys replay a final answer"),
        (
            "declined_once",
            "declined rides: at most one PaymentIntent, none succeeded",
        ),
        (
            "declined_no_receipt",
            "declined rides: no charge id, receipt or mail",
        ),
        ("declining_card_never_ok", "declining cards never succeed"),
        ("good_card_never_declined", "good cards are never declined"),
        (
            "no_unexpected_answer",
            "no non-retryable error other than CARD_DECLINED",
        ),
    ];
    let mut invariant_json = serde_json::Map::new();
    for (id, _) in &invariants {
        invariant_json.insert(
            (*id).to_owned(),
            json!(v.by_invariant.get(id).copied().unwrap_or(0)),
        );
    }
    let passed = v.list.is_empty();
    let attention_by_reason = attention
        .iter()
        .fold(BTreeMap::<String, u64>::new(), |mut m, a| {
            *m.entry(a.reason.clone()).or_default() += 1;
            m
        });
    let report = json!({
        "run_id": plan.run_id,
        "seed": plan.seed,
        "mode": if args.long { "long" } else { "short" },
        "database": wiring.db_name,
        "traffic_secs": plan.duration.as_secs(),
        "total_secs": (total.as_secs_f64() * 10.0).round() / 10.0,
        "clients": args.clients,
        "declining_clients": args.declined_clients,
        "keys": records.len(),
        "requests": AtomicU64::load(&requests, Ordering::Relaxed),
        "retries": AtomicU64::load(&retries, Ordering::Relaxed),
        "outcomes_seen_by_clients": outcomes,
        "attempt_answers": attempts.snapshot(),
        "abandoned_keys": abandoned_resolution,
        "faults_injected": faults.snapshot(),
        "maintenance": maintenance.snapshot(),
        "drain": {
            "completer_secs": (completer_drain.as_secs_f64() * 10.0).round() / 10.0,
            "receipts_secs": (receipts_drain.as_secs_f64() * 10.0).round() / 10.0,
            "unfinished_keys_left": unfinished,
            "staged_jobs_left": staged,
        },
        "evidence": {
            "rides": rides.len(),
            "charged_rides": rides.iter().filter(|r| r.stripe_charge_id.is_some()).count(),
            "payment_intents": ledger.len(),
            "succeeded_payment_intents": ledger.iter().filter(|p| p.status == "succeeded").count(),
            "sent_receipts": sent_receipts.len(),
            "mails": mail.values().map(Vec::len).sum::<usize>(),
            "receipts_recorded_from_the_relay_search": recovered_at_relay,
            "receipt_claims_left": claims_left,
            "crash_points_fired": crash_points_fired,
            "keys_needing_attention": attention_by_reason,
        },
        "replays": replay_stats,
        "invariant_violations": invariant_json,
        "violations": v.list.iter().take(200).collect::<Vec<_>>(),
        "passed": passed,
    });
    let mut text = String::new();
    let line = |text: &mut String, k: &str, val: String| {
        text.push_str(&format!("{k:<58} {val}\n"));
    };
    text.push_str(&format!(
        "Rocket Rides proof campaign {} (seed {}, {} mode)\n",
        plan.run_id,
        plan.seed,
        if args.long { "long" } else { "short" }
    ));
    line(
        &mut text,
        "traffic / total duration",
        format!("{}s / {:.1}s", plan.duration.as_secs(), total.as_secs_f64()),
    );
    line(
        &mut text,
        "clients (declining cards)",
        format!("{} ({})", args.clients, args.declined_clients),
    );
    line(&mut text, "keys", records.len().to_string());
    line(
        &mut text,
        "requests (attempts)",
        AtomicU64::load(&requests, Ordering::Relaxed).to_string(),
    );
    line(
        &mut text,
        "retries",
        AtomicU64::load(&retries, Ordering::Relaxed).to_string(),
    );
    text.push_str("-- outcomes seen by clients\n");
    for (k, n) in &outcomes {
        line(&mut text, &format!("  {k}"), n.to_string());
    }
    text.push_str("-- abandoned / given-up keys\n");
    for (k, n) in &abandoned_resolution {
        line(&mut text, &format!("  {k}"), n.to_string());
    }
    text.push_str("-- answers per attempt\n");
    for (k, n) in attempts.snapshot() {
        line(&mut text, &format!("  {k}"), n.to_string());
    }
    text.push_str("-- faults injected\n");
    for (k, n) in faults.snapshot() {
        line(&mut text, &format!("  {k}"), n.to_string());
    }
    text.push_str("-- completer / reaper passes\n");
    for (k, n) in maintenance.snapshot() {
        line(&mut text, &format!("  {k}"), n.to_string());
    }
    text.push_str("-- evidence\n");
    for (k, val) in report["evidence"].as_object().into_iter().flatten() {
        line(&mut text, &format!("  {k}"), val.to_string());
    }
    for (k, val) in report["drain"].as_object().into_iter().flatten() {
        line(&mut text, &format!("  drain.{k}"), val.to_string());
    }
    for (k, val) in &replay_stats {
        line(&mut text, &format!("  replays.{k}"), val.to_string());
    }
    text.push_str("-- invariants\n");
    for (id, what) in &invariants {
        let n = v.by_invariant.get(id).copied().unwrap_or(0);
        line(
            &mut text,
            &format!("  {what}"),
            if n == 0 {
                "PASS".to_owned()
            } else {
                format!("FAIL ({n})")
            },
        );
    }
    text.push_str(&format!(
        "RESULT: {}\n",
        if passed { "PASS" } else { "FAIL" }
    ));
    println!("\n{text}");
    std::fs::write(
        plan.out_dir.join("report.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    std::fs::write(plan.out_dir.join("report.txt"), &text)?;
    if !v.list.is_empty() {
        std::fs::write(plan.out_dir.join("violations.txt"), v.list.join("\n"))?;
    }
    println!("proof: report in {}", plan.out_dir.display());
    Ok(passed)
}
