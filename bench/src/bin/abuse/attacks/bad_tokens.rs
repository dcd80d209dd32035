//! 200 concurrent CreateRide callers on 20 connections (20 source addresses) with tokens that
//! are not ours: malformed ones (refused from their shape alone), one well-shaped unknown token
//! (looked up once, then answered from the unknown-token cache; calls already in flight when
//! the first answer comes are looked up too), or a fresh well-shaped token on every call (the
//! worst case for the cache: each costs one indexed read, and must write nothing). With `from`,
//! every connection comes from that one address instead (the legitimate backend's, for
//! `bad-tokens-random-own`).

use std::{
    net::Ipv4Addr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use futures_util::future::join_all;
use proto::v1::ride_service_client::RideServiceClient;
use rand::{Rng, distr::Alphanumeric};
use serde_json::{Value, json};
use tonic::transport::Channel;

use super::{Tally, Target, add, merge, source};
use crate::traffic::{PARAMS, authorized, client, label};

pub const CALLERS: usize = 200;
const CONNECTIONS: u32 = 20;

#[derive(Clone, Copy)]
pub enum Tokens {
    Malformed,
    /// One unknown well-shaped token, the same for every caller.
    Repeated,
    /// Half the callers [`Tokens::Malformed`], half [`Tokens::Repeated`]: the `bad-tokens` attack.
    Mixed,
    Random,
}

/// A token of our shape (`rr_` + 43 base64url characters) that no user holds.
fn well_shaped() -> String {
    let body: String = rand::rng()
        .sample_iter(Alphanumeric)
        .take(43)
        .map(char::from)
        .collect();
    format!("rr_{body}")
}

async fn caller(
    mut rpc: RideServiceClient<Channel>,
    token: Option<String>,
    stop: Arc<AtomicBool>,
) -> Tally {
    let mut tally = Tally::new();
    while !stop.load(Ordering::SeqCst) {
        let token = token.clone().unwrap_or_else(well_shaped);
        let outcome = match rpc.create_ride(authorized(PARAMS, &token, true)).await {
            Ok(_) => "OK".to_owned(),
            Err(status) => label(&status),
        };
        add(&mut tally, outcome);
    }
    tally
}

pub async fn run(target: &Target, tokens: Tokens, from: Option<Ipv4Addr>) -> anyhow::Result<Value> {
    let range = match tokens {
        Tokens::Malformed | Tokens::Repeated | Tokens::Mixed => 50,
        Tokens::Random => 51,
    };
    let connections = (0..CONNECTIONS)
        .map(|n| client(target.addr, Some(from.unwrap_or(source(range, n)).into())))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let unknown = well_shaped();
    let stop = Arc::new(AtomicBool::new(false));
    let callers: Vec<_> = (0..CALLERS)
        .map(|n| {
            let malformed = Some("not-a-token".to_owned());
            let token = match tokens {
                Tokens::Malformed => malformed,
                Tokens::Mixed if n % 2 == 0 => malformed,
                Tokens::Repeated | Tokens::Mixed => Some(unknown.clone()),
                Tokens::Random => None,
            };
            let rpc = connections[n % connections.len()].clone();
            tokio::spawn(caller(rpc, token, Arc::clone(&stop)))
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(target.secs)).await;
    stop.store(true, Ordering::SeqCst);
    let outcomes = merge(join_all(callers).await.into_iter().flatten());
    let calls: u64 = outcomes.values().sum();
    Ok(json!({
        "callers": CALLERS,
        "calls": calls,
        "calls_per_s": calls / target.secs.max(1),
        "outcomes": outcomes,
    }))
}
