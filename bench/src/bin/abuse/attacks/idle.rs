//! Connections that hold a slot and do nothing: 1,000 that never send a byte, 1,000 that send
//! the preface and SETTINGS and then answer nothing (not the server's SETTINGS, not its PINGs),
//! each spread over 10 source addresses; and 300 from one address, against the per-IP cap.
//! They are held until the server closes them or [`HOLD`] passes, and the report says when the
//! server closed each kind.

use std::{
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use futures_util::future::join_all;
use serde_json::{Value, json};

use super::{Manners, RawConn, Target, lock, quantiles_ms, source};

const PER_KIND: u32 = 1_000;
const ADDRESSES: u32 = 10;
const ONE_ADDRESS: u32 = 300;
/// Long enough to see the keepalive close preface-only connections (60 s interval + 20 s
/// timeout by default).
const HOLD: Duration = Duration::from_secs(90);

async fn open_many(
    count: u32,
    from: impl Fn(u32) -> Ipv4Addr,
    target: &Target,
    manners: Manners,
) -> (Vec<RawConn>, u64) {
    let opened = join_all((0..count).map(|n| RawConn::open(from(n), target.addr, manners))).await;
    let failed = opened.iter().filter(|c| c.is_err()).count() as u64;
    (opened.into_iter().flatten().collect(), failed)
}

fn closings(conns: &[RawConn]) -> Value {
    let closed: Vec<Duration> = conns
        .iter()
        .filter_map(|c| *lock(&c.seen.closed_after))
        .collect();
    let open = conns.len() - closed.len();
    json!({ "closed_by_server_ms": quantiles_ms(closed), "still_open": open })
}

pub async fn run(target: &Target) -> anyhow::Result<Value> {
    let started = Instant::now();
    let (silent, silent_failed) = open_many(
        PER_KIND,
        |n| source(20, n % ADDRESSES),
        target,
        Manners::Silent,
    )
    .await;
    let (preface, preface_failed) = open_many(
        PER_KIND,
        |n| source(21, n % ADDRESSES),
        target,
        Manners::PrefaceOnly,
    )
    .await;
    let (crowd, crowd_failed) =
        open_many(ONE_ADDRESS, |_| source(22, 0), target, Manners::Silent).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The per-IP cap closes a connection at once; anything closed within 2 s is a refusal.
    let refused_at_once = crowd
        .iter()
        .filter(|c| lock(&c.seen.closed_after).is_some_and(|d| d < Duration::from_secs(2)))
        .count();
    let deadline = started + HOLD;
    while Instant::now() < deadline
        && !(silent.iter().chain(&preface).chain(&crowd)).all(RawConn::closed)
    {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(json!({
        "held_for_s": started.elapsed().as_secs(),
        "silent": { "opened": silent.len(), "connect_failed": silent_failed, "closing": closings(&silent) },
        "preface_only": {
            "opened": preface.len(),
            "connect_failed": preface_failed,
            "got_server_settings": preface.iter().filter(|c| c.seen.server_settings.load(std::sync::atomic::Ordering::SeqCst)).count(),
            "closing": closings(&preface),
        },
        "one_address": {
            "opened": crowd.len(),
            "connect_failed": crowd_failed,
            "closed_within_2s": refused_at_once,
            "closing": closings(&crowd),
        },
    }))
}
