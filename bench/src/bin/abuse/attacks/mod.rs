//! The attacks, one file each. Every attack is bounded in count and time, comes from source
//! addresses of its own on loopback (127.x.y.z, never the legitimate clients' 127.0.0.1, so the
//! per-IP connection cap is measured for what it is: a bound on one peer), drops everything it
//! holds when it returns, and reports what it saw from its side as JSON. The `-own` attacks are
//! the exception on purpose: they come from the legitimate backend's own address
//! (`backend::BACKEND_ADDR`), as everything does behind a proxy that names no client.

pub mod bad_tokens;
mod big_messages;
mod card_testing;
mod fd_exhaustion;
mod idle;
mod resets;
mod rider_flood;
mod streams;

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddr},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use bench::h2wire::{self, Frame};
use serde_json::Value;
use tokio::{
    io::AsyncWriteExt,
    net::{TcpSocket, TcpStream, tcp::OwnedWriteHalf},
    task::JoinHandle,
};

/// What every attack gets.
pub struct Target {
    pub addr: SocketAddr,
    /// A legitimate user's token and one of its rides, for the probes.
    pub probe_token: String,
    pub probe_ride: i64,
    /// The card tester: an authenticated user whose card is declined.
    pub tester_token: String,
    /// The flooding rider: an authenticated user with a good card.
    pub flood_token: String,
    pub server_pid: u32,
    /// How long the attacks that are not bounded by the server's own timers last.
    pub secs: u64,
}

impl Target {
    /// The same target, for attacks of `secs` seconds.
    pub fn for_secs(&self, secs: u64) -> Target {
        Target {
            addr: self.addr,
            probe_token: self.probe_token.clone(),
            probe_ride: self.probe_ride,
            tester_token: self.tester_token.clone(),
            flood_token: self.flood_token.clone(),
            server_pid: self.server_pid,
            secs,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Attack {
    /// 10,000 concurrent streams on one connection.
    Streams,
    /// 1,000 idle and 1,000 preface-only connections, and 300 from one address.
    Idle,
    /// 4 MiB messages to every service.
    BigMessages,
    /// HEADERS+RST_STREAM floods, and streams the server has to reset itself.
    ResetFlood,
    /// 200 concurrent callers with malformed or unknown tokens.
    BadTokens,
    /// 200 concurrent callers with a fresh well-shaped token each call.
    BadTokensRandom,
    /// The same, from the legitimate backend's own address.
    BadTokensRandomOwn,
    /// One rider with a valid token flooding CreateRide, 64 in flight, from another address.
    RiderFlood,
    /// The same rider flooding from the legitimate backend's own address.
    RiderFloodOwn,
    /// One user with a declining card flooding new keys.
    CardTesting,
    /// The server's open-file limit lowered and its descriptors used up.
    FdExhaustion,
}

impl Attack {
    pub const ALL: [Attack; 11] = [
        Attack::Streams,
        Attack::Idle,
        Attack::BigMessages,
        Attack::ResetFlood,
        Attack::BadTokens,
        Attack::BadTokensRandom,
        Attack::BadTokensRandomOwn,
        Attack::CardTesting,
        Attack::RiderFlood,
        Attack::RiderFloodOwn,
        Attack::FdExhaustion,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Attack::Streams => "streams",
            Attack::Idle => "idle",
            Attack::BigMessages => "big-messages",
            Attack::ResetFlood => "reset-flood",
            Attack::BadTokens => "bad-tokens",
            Attack::BadTokensRandom => "bad-tokens-random",
            Attack::BadTokensRandomOwn => "bad-tokens-random-own",
            Attack::RiderFlood => "rider-flood",
            Attack::RiderFloodOwn => "rider-flood-own",
            Attack::CardTesting => "card-testing",
            Attack::FdExhaustion => "fd-exhaustion",
        }
    }

    /// Whether the attacker holds a valid token (its rows are expected, within its limits).
    pub fn authenticated(self) -> bool {
        match self {
            Attack::CardTesting | Attack::RiderFlood | Attack::RiderFloodOwn => true,
            Attack::Streams
            | Attack::Idle
            | Attack::BigMessages
            | Attack::ResetFlood
            | Attack::BadTokens
            | Attack::BadTokensRandom
            | Attack::BadTokensRandomOwn
            | Attack::FdExhaustion => false,
        }
    }

    pub async fn run(self, target: &Target) -> anyhow::Result<Value> {
        match self {
            Attack::Streams => streams::run(target).await,
            Attack::Idle => idle::run(target).await,
            Attack::BigMessages => big_messages::run(target).await,
            Attack::ResetFlood => resets::run(target).await,
            Attack::BadTokens => bad_tokens::run(target, bad_tokens::Tokens::Mixed, None).await,
            Attack::BadTokensRandom => {
                bad_tokens::run(target, bad_tokens::Tokens::Random, None).await
            }
            Attack::BadTokensRandomOwn => {
                let own = Some(crate::backend::BACKEND_ADDR);
                bad_tokens::run(target, bad_tokens::Tokens::Random, own).await
            }
            Attack::RiderFlood => rider_flood::run(target, crate::backend::OTHER_ADDR).await,
            Attack::RiderFloodOwn => rider_flood::run(target, crate::backend::BACKEND_ADDR).await,
            Attack::CardTesting => card_testing::run(target).await,
            Attack::FdExhaustion => fd_exhaustion::run(target).await,
        }
    }
}

/// The `n`th source address of an attack's own range `127.<range>.x.y`.
pub fn source(range: u8, n: u32) -> Ipv4Addr {
    let [_, _, x, y] = (n % 62_500).to_be_bytes();
    let index = u16::from_be_bytes([x, y]);
    Ipv4Addr::new(127, range, (index / 250) as u8, (index % 250) as u8 + 1)
}

/// A TCP connection to `target` from `from`.
pub async fn connect_from(from: Ipv4Addr, target: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::from((from, 0)))?;
    tokio::time::timeout(Duration::from_secs(5), socket.connect(target))
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
}

/// What the server sent on one raw connection.
#[derive(Default)]
pub struct Seen {
    pub resets: Mutex<BTreeMap<&'static str, u64>>,
    pub goaway: Mutex<Option<(u32, &'static str)>>,
    pub server_settings: AtomicBool,
    pub closed: AtomicBool,
    pub closed_after: Mutex<Option<Duration>>,
}

impl Seen {
    pub fn resets_total(&self) -> u64 {
        lock(&self.resets).values().sum()
    }

    pub fn goaway(&self) -> Option<(u32, &'static str)> {
        *lock(&self.goaway)
    }
}

pub fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// How a raw connection opens and behaves.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Manners {
    /// TCP only: not a byte sent.
    Silent,
    /// The preface and SETTINGS, then nothing: the server's SETTINGS and PINGs go unanswered.
    PrefaceOnly,
    /// A client that acknowledges SETTINGS and answers PINGs, so only what it sends on top is
    /// the attack.
    Polite,
}

/// A raw HTTP/2 connection: its writer, and a reader task that counts what the server sends.
pub struct RawConn {
    writer: Arc<tokio::sync::Mutex<OwnedWriteHalf>>,
    pub seen: Arc<Seen>,
    reader: JoinHandle<()>,
}

impl RawConn {
    pub async fn open(
        from: Ipv4Addr,
        target: SocketAddr,
        manners: Manners,
    ) -> std::io::Result<RawConn> {
        let opened = Instant::now();
        let (mut read, mut write) = connect_from(from, target).await?.into_split();
        if manners != Manners::Silent {
            let mut hello = h2wire::PREFACE.to_vec();
            // A large initial window: flow control never holds the server back.
            h2wire::settings(&mut hello, &[(0x4, 1 << 24)]);
            write.write_all(&hello).await?;
        }
        let writer = Arc::new(tokio::sync::Mutex::new(write));
        let seen = Arc::new(Seen::default());
        let reader = {
            let (writer, seen) = (Arc::clone(&writer), Arc::clone(&seen));
            tokio::spawn(async move {
                while let Ok(Some(frame)) = h2wire::read_frame(&mut read).await {
                    if let Some(answer) = answer(&frame, &seen, manners) {
                        let _ = writer.lock().await.write_all(&answer).await;
                    }
                }
                seen.closed.store(true, Ordering::SeqCst);
                *lock(&seen.closed_after) = Some(opened.elapsed());
            })
        };
        Ok(RawConn {
            writer,
            seen,
            reader,
        })
    }

    pub async fn send(&self, bytes: &[u8]) -> std::io::Result<()> {
        let mut writer = self.writer.lock().await;
        tokio::time::timeout(Duration::from_secs(10), writer.write_all(bytes))
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
    }

    pub fn closed(&self) -> bool {
        self.seen.closed.load(Ordering::SeqCst)
    }
}

impl Drop for RawConn {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// Counts `frame` in `seen`; the bytes to answer it with, if the manners call for an answer.
fn answer(frame: &Frame, seen: &Seen, manners: Manners) -> Option<Vec<u8>> {
    let code_name = frame.error_code().map(h2wire::error_name);
    match (frame.kind, code_name) {
        (h2wire::RST_STREAM, Some(name)) => *lock(&seen.resets).entry(name).or_default() += 1,
        (h2wire::GOAWAY, Some(name)) => {
            let last = frame
                .payload
                .get(..4)
                .and_then(|b| <[u8; 4]>::try_from(b).ok())
                .map_or(0, |b| u32::from_be_bytes(b) & 0x7FFF_FFFF);
            *lock(&seen.goaway) = Some((last, name));
        }
        _ => {}
    }
    let ack = frame.flags & h2wire::ACK != 0;
    let mut out = Vec::new();
    match frame.kind {
        h2wire::SETTINGS if !ack => {
            seen.server_settings.store(true, Ordering::SeqCst);
            if manners == Manners::Polite {
                h2wire::frame(&mut out, h2wire::SETTINGS, h2wire::ACK, 0, &[]);
            }
        }
        h2wire::PING if !ack && manners == Manners::Polite => {
            h2wire::frame(&mut out, h2wire::PING, h2wire::ACK, 0, &frame.payload);
        }
        _ => {}
    }
    (!out.is_empty()).then_some(out)
}

/// One authenticated user flooding CreateRide: `callers` concurrent callers on one connection
/// from `from`, a new key every call, for the attack's length; their answers by code/reason.
pub async fn flood(
    target: &Target,
    from: Ipv4Addr,
    token: &str,
    callers: u32,
) -> anyhow::Result<Value> {
    use crate::traffic::{PARAMS, authorized, client, label};
    let rpc = client(target.addr, Some(from.into()))?;
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..callers)
        .map(|_| {
            let (mut rpc, token, stop) = (rpc.clone(), token.to_owned(), Arc::clone(&stop));
            tokio::spawn(async move {
                let mut tally = Tally::new();
                while !stop.load(Ordering::SeqCst) {
                    let outcome = match rpc.create_ride(authorized(PARAMS, &token, true)).await {
                        Ok(_) => "OK".to_owned(),
                        Err(status) => label(&status),
                    };
                    add(&mut tally, outcome);
                }
                tally
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(target.secs)).await;
    stop.store(true, Ordering::SeqCst);
    let outcomes = merge(
        futures_util::future::join_all(tasks)
            .await
            .into_iter()
            .flatten(),
    );
    Ok(serde_json::json!({
        "from": from.to_string(),
        "callers": callers,
        "calls": outcomes.values().sum::<u64>(),
        "outcomes": outcomes,
    }))
}

/// Counts of labelled outcomes, for reports.
pub type Tally = BTreeMap<String, u64>;

pub fn add(tally: &mut Tally, label: impl Into<String>) {
    *tally.entry(label.into()).or_default() += 1;
}

/// Sums tallies from concurrent tasks.
pub fn merge(tallies: impl IntoIterator<Item = Tally>) -> Tally {
    tallies.into_iter().fold(Tally::new(), |mut all, one| {
        for (label, n) in one {
            *all.entry(label).or_default() += n;
        }
        all
    })
}

/// Quantiles of durations, in milliseconds, for reports.
pub fn quantiles_ms(mut values: Vec<Duration>) -> Value {
    values.sort();
    let at = |q: f64| {
        values
            .get(((values.len() as f64 - 1.0) * q).round() as usize)
            .map(|d| d.as_millis() as u64)
    };
    serde_json::json!({ "count": values.len(), "p50": at(0.5), "max": at(1.0) })
}
