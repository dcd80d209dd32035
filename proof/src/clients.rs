//! The campaign's clients: concurrent closed loops, one user each (or, with
//! `--riders-per-client`, backends each carrying many riders over connections all of them share),
//! that send CreateRide with an idempotency key through `rides-client`, the client real services
//! use, and let it retry (or drop the call mid-request, or give up after one try), recording the
//! final answer each key got ([`KeyRecord`]). Their records are what the database, the ledger and
//! the mail are later checked against. Beside each charging user's client runs a replay loop
//! ([`live_replays::replay_loop`]) that sends that user's answered keys again during the traffic
//! and its faults, as a caller that lost an answer does, so that an outage can be measured for
//! replays and fresh work apart. The replays after the drain reuse [`user_client`] and
//! [`classify`], so that a replay is judged by the rules of a first answer. The traffic as a
//! whole (users, window, start and finish) is [`traffic`]'s.

use std::{
    collections::VecDeque,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime},
};

use prost::Message;
use proto::v1::CreateRideRequest;
use rand::{Rng, SeedableRng, rngs::StdRng};
use rides_client::{
    AttemptObserver, AttemptRecord, CallError, Created, Credential, RetryPolicy, RidesClient,
    RidesError,
};
use tonic::transport::Channel;

use crate::{
    args::Args,
    counters::{CallKind, Counters, LiveReplays, Timeline},
};

mod live_replays;
mod traffic;

use live_replays::replay_loop;
pub(crate) use traffic::{Traffic, Window, create_users};

#[derive(Clone)]
pub(crate) struct User {
    pub(crate) id: i64,
    token: String,
    pub(crate) declining: bool,
    /// The client that sends this user's calls.
    client: u32,
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

pub(crate) enum Answer {
    Final(Seen),
    /// Not final (retryable) after the call's retries: the last attempt's `Code/REASON`.
    Retry(String),
}

/// A call's result as the campaign judges it: success and card declines are final (and kept to
/// the byte, for the replays); what the client would still retry is not; anything else is an
/// answer that must never happen.
pub(crate) fn classify(result: Result<Created, CallError>) -> Answer {
    let call = match result {
        Ok(created) => {
            return Answer::Final(Seen::Ok {
                ride_id: created.ride.id,
                charge_id: created.ride.charge_id.clone(),
                bytes: created.response().encode_to_vec(),
                expires_at: created.expires_at,
            });
        }
        Err(call) => call,
    };
    if let RidesError::CardDeclined { status, .. } = &call.error {
        return Answer::Final(Seen::Declined {
            message: status.message().to_owned(),
            details: status.details().to_vec(),
        });
    }
    // A deadline stops a call between attempts: the last attempt's answer is what it saw.
    let label = match (&call.error, call.log.last()) {
        (RidesError::DeadlineExceeded { .. }, Some(last)) => last.outcome.clone(),
        (error, _) => error.label(),
    };
    if call.error.is_retryable() {
        Answer::Retry(label)
    } else {
        Answer::Final(Seen::Unexpected(label))
    }
}

/// The campaign user's client over `targets` (each attempt picks one at random, as a load
/// balancer would).
pub(crate) fn user_client(user: &User, first: Channel, more: Vec<Channel>) -> RidesClient {
    RidesClient::with_targets(first, more, Credential::user(user.token.as_str()))
}

/// A retrying client's policy: 100 ms doubling to 2 s of jitter (never under the server's
/// `RetryInfo`), `--max-tries` attempts of 20 s (of 300 ms for an `impatient` key, whose retries
/// after a client-side timeout find its first attempt still running), and no retry started after
/// `hard_end`. Every client waits for an attempt in flight with its key (the server's default,
/// sent as nothing): a retry gets that attempt's answer as a replay.
fn retrying(args: &Args, hard_end: Instant, impatient: bool) -> RetryPolicy {
    RetryPolicy {
        max_attempts: args.max_tries,
        initial_backoff: Duration::from_millis(100),
        multiplier: 2.0,
        max_backoff: Duration::from_secs(2),
        deadline: hard_end.saturating_duration_since(Instant::now()),
        attempt_timeout: if impatient {
            Duration::from_millis(300)
        } else {
            Duration::from_secs(20)
        },
        idempotency_wait: None,
    }
}

/// The share of retrying keys whose attempts time out after 300 ms.
const IMPATIENT_RATIO: f64 = 0.25;

/// The keys a client saw answered OK, newest last (at most [`ANSWERED_KEPT`]), for its replay
/// loop: which of its riders, the key, its parameters and the answer.
type Answered = Arc<std::sync::Mutex<VecDeque<(usize, String, CreateRideRequest, Seen)>>>;

const ANSWERED_KEPT: usize = 512;

/// A user and its client of both api-servers; each attempt picks one at random.
struct Rider {
    user: User,
    client: RidesClient,
}

#[derive(Clone)]
struct ClientCtx {
    id: u32,
    /// The users whose calls this client sends, each key a random one's; all decline or none.
    riders: Arc<Vec<Rider>>,
    declining: bool,
    faults: Arc<Counters>,
    run_id: String,
    traffic_end: Instant,
    hard_end: Instant,
    args: Args,
    attempts: Arc<Counters>,
    requests: Arc<AtomicU64>,
    retries: Arc<AtomicU64>,
    timeline: Arc<Timeline>,
    answered: Answered,
    live_replays: Arc<LiveReplays>,
}

async fn run_client(ctx: ClientCtx, seed: u64) -> Vec<KeyRecord> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut records = Vec::new();
    let mut n = 0_u32;
    let kind = if ctx.declining {
        CallKind::Refusal
    } else {
        CallKind::Fresh
    };
    while Instant::now() < ctx.traffic_end {
        n += 1;
        let rider = rng.random_range(0..ctx.riders.len());
        let key = format!("proof-{}-c{:02}-{n:07}", ctx.run_id, ctx.id);
        let params = random_params(&mut rng);
        let (plan, policy) = CallPlan::draw(&ctx.args, ctx.hard_end, &mut rng);
        let sent_at = SystemTime::now();
        let result = ctx.riders[rider]
            .client
            .clone()
            .with_policy(policy)
            .on_attempt(observer(&ctx, &key, plan.drop_mid, kind))
            .create_ride_with_key(key.as_str(), params)
            .await;
        let (attempts, seen) = plan.seen(result, sent_at);
        if matches!(seen, Seen::Abandoned(_) | Seen::GaveUp(_)) {
            ctx.timeline.key_left();
        }
        if let (Seen::Ok { .. }, Ok(mut answered)) = (&seen, ctx.answered.lock()) {
            if answered.len() == ANSWERED_KEPT {
                answered.pop_front();
            }
            answered.push_back((rider, key.clone(), params, seen.clone()));
        }
        records.push(KeyRecord {
            key,
            user_id: ctx.riders[rider].user.id,
            client: ctx.id,
            params,
            attempts,
            seen,
        });
        if ctx.declining {
            // Declines are instant; keep the mix dominated by charges.
            tokio::time::sleep(Duration::from_millis(rng.random_range(50..250))).await;
        }
    }
    records
}

/// A ride between two random points away from the poles and the antimeridian.
fn random_params(rng: &mut StdRng) -> CreateRideRequest {
    CreateRideRequest {
        origin_lat: Some(rng.random_range(-80.0..80.0)),
        origin_lon: Some(rng.random_range(-170.0..170.0)),
        target_lat: Some(rng.random_range(-80.0..80.0)),
        target_lon: Some(rng.random_range(-170.0..170.0)),
    }
}

/// How one key's call is sent: dropped mid-request, given a single try, or retried as
/// `rides-client` retries.
struct CallPlan {
    drop_mid: bool,
    no_retry: bool,
    /// How long a dropping call's one attempt gets before it is dropped.
    drop_after: Duration,
}

impl CallPlan {
    /// Draws the plan of the next call by `--drop-ratio` and `--no-retry-ratio`, with the retry
    /// policy it is sent under.
    fn draw(args: &Args, hard_end: Instant, rng: &mut StdRng) -> (Self, RetryPolicy) {
        let mode: f64 = rng.random();
        let drop_mid = mode < args.drop_ratio;
        let no_retry = !drop_mid && mode < args.drop_ratio + args.no_retry_ratio;
        // A dropping client gives its one attempt 2-300 ms, then drops the call (RST_STREAM):
        // the server's attempt runs on detached.
        let drop_after = Duration::from_millis(rng.random_range(2..300));
        let policy = if drop_mid {
            RetryPolicy::single_attempt(drop_after)
        } else if no_retry {
            RetryPolicy::single_attempt(Duration::from_secs(20))
        } else {
            let impatient = rng.random_bool(IMPATIENT_RATIO);
            retrying(args, hard_end, impatient)
        };
        let plan = CallPlan {
            drop_mid,
            no_retry,
            drop_after,
        };
        (plan, policy)
    }

    /// The attempts the call made and what its caller saw: a final answer, a call this plan
    /// abandoned on purpose, or a key given up (with its attempts' history).
    fn seen(&self, result: Result<Created, CallError>, sent_at: SystemTime) -> (u32, Seen) {
        let attempts = match &result {
            Ok(created) => created.attempts(),
            Err(call) => call.attempts(),
        };
        // Only for a retrying call that ended without a final answer: a key given up.
        let history = match &result {
            Err(call)
                if !self.drop_mid
                    && !self.no_retry
                    && call.log.last().is_some_and(|a| !is_final(&a.outcome)) =>
            {
                attempt_history(sent_at, &call.log)
            }
            _ => String::new(),
        };
        let seen = match classify(result) {
            Answer::Final(seen) => seen,
            Answer::Retry(label) if self.drop_mid && label == TIMEOUT => {
                Seen::Abandoned(format!("dropped after {}ms", self.drop_after.as_millis()))
            }
            Answer::Retry(label) if self.drop_mid || self.no_retry => {
                Seen::Abandoned(format!("no retry after {label}"))
            }
            Answer::Retry(label) => {
                Seen::GaveUp(format!("{attempts} tries, last {label}; {history}"))
            }
        };
        (attempts, seen)
    }
}

/// Whether an attempt's outcome is a final answer: a ride, or a stored decline.
fn is_final(outcome: &str) -> bool {
    outcome == "OK" || outcome.ends_with("/CARD_DECLINED")
}

/// A call's attempts in order, runs of the same answer from the same api-server folded, with
/// when the call began: what a key given up is explained from (`server_time` is how long the
/// attempts of the run took, the rest was the client's back-off).
fn attempt_history(sent_at: SystemTime, log: &[AttemptRecord]) -> String {
    let mut runs: Vec<(usize, &str, u32, Duration)> = Vec::new();
    for attempt in log {
        match runs.last_mut() {
            Some((target, outcome, n, server_time))
                if *target == attempt.target && *outcome == attempt.outcome =>
            {
                *n += 1;
                *server_time += attempt.elapsed;
            }
            _ => runs.push((attempt.target, &attempt.outcome, 1, attempt.elapsed)),
        }
    }
    let total: Duration = log
        .iter()
        .map(|a| a.elapsed + a.wait.unwrap_or_default())
        .sum();
    let runs: Vec<String> = runs
        .iter()
        .map(|(target, outcome, n, server_time)| {
            format!(
                "{n}x {outcome} from target {target} in {:.1}s",
                server_time.as_secs_f64()
            )
        })
        .collect();
    format!(
        "sent at unix {:.1} for {:.1}s: {}",
        sent_at
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64()),
        total.as_secs_f64(),
        runs.join(", ")
    )
}

/// The client's label of an attempt that got no answer in time.
const TIMEOUT: &str = "CLIENT/TIMEOUT";

/// Counts every attempt at `key` as it ends, so the progress lines and the report's tallies are
/// live: requests, retries, each answer by `Code/REASON`, and api-b's pool running dry.
fn observer(ctx: &ClientCtx, key: &str, drop_mid: bool, kind: CallKind) -> AttemptObserver {
    let key: Arc<str> = Arc::from(key);
    let (requests, retries) = (Arc::clone(&ctx.requests), Arc::clone(&ctx.retries));
    let (attempts, faults) = (Arc::clone(&ctx.attempts), Arc::clone(&ctx.faults));
    let timeline = Arc::clone(&ctx.timeline);
    Arc::new(move |attempt: &AttemptRecord| {
        requests.fetch_add(1, Ordering::Relaxed);
        if attempt.number > 1 {
            retries.fetch_add(1, Ordering::Relaxed);
        }
        if drop_mid && attempt.outcome == TIMEOUT {
            attempts.add("CLIENT/DROPPED_MID_REQUEST", 1);
        } else {
            attempts.add(attempt.outcome.as_str(), 1);
            // Called as the answer arrives: it was sent `elapsed` ago.
            let sent = Instant::now()
                .checked_sub(attempt.elapsed)
                .unwrap_or_else(Instant::now);
            let final_answer = is_final(&attempt.outcome);
            timeline.attempt(
                &key,
                attempt.target,
                sent,
                kind,
                (!final_answer).then_some(attempt.outcome.as_str()),
            );
        }
        if attempt.target == 1 && attempt.outcome.ends_with("/DATABASE_UNAVAILABLE") {
            faults.add("pool_exhaustion/api-b answered DATABASE_UNAVAILABLE", 1);
        }
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_calls_history_folds_runs_of_the_same_answer_from_the_same_server() {
        let attempt =
            |target: usize, outcome: &str, elapsed_ms: u64, wait_ms: Option<u64>| AttemptRecord {
                number: 0,
                target,
                outcome: outcome.to_owned(),
                elapsed: Duration::from_millis(elapsed_ms),
                retry_info: None,
                wait: wait_ms.map(Duration::from_millis),
            };
        let log = [
            attempt(0, TIMEOUT, 20_000, Some(100)),
            attempt(1, "Aborted/IDEMPOTENCY_KEY_IN_USE", 400, Some(2_000)),
            attempt(1, "Aborted/IDEMPOTENCY_KEY_IN_USE", 600, Some(2_000)),
            attempt(0, "Aborted/IDEMPOTENCY_KEY_IN_USE", 500, None),
        ];
        let sent_at = std::time::UNIX_EPOCH + Duration::from_secs(1_000);
        assert_eq!(
            attempt_history(sent_at, &log),
            format!(
                "sent at unix 1000.0 for 25.6s: 1x {TIMEOUT} from target 0 in 20.0s, \
                 2x Aborted/IDEMPOTENCY_KEY_IN_USE from target 1 in 1.0s, \
                 1x Aborted/IDEMPOTENCY_KEY_IN_USE from target 0 in 0.5s"
            )
        );
    }
}
