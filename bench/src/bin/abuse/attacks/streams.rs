//! 10,000 concurrent streams on one connection: HEADERS without END_STREAM for GetRide, no
//! token, never a body, so each stream the server accepts waits for a request message. The
//! server advertises `MAX_CONCURRENT_STREAMS` and must refuse every stream beyond it.

use std::{sync::atomic::Ordering, time::Duration};

use bench::h2wire;
use serde_json::{Value, json};

use super::{Manners, RawConn, Target, lock, source};

const STREAMS: u32 = 10_000;
/// Frames written per write call.
const CHUNK: u32 = 500;

pub async fn run(target: &Target) -> anyhow::Result<Value> {
    let conn = RawConn::open(source(10, 0), target.addr, Manners::Polite).await?;
    let block = h2wire::grpc_request_block("/rides.v1.RideService/GetRide", &[]);
    let mut sent = 0u32;
    while sent < STREAMS && !conn.closed() && conn.seen.goaway().is_none() {
        let mut out = Vec::new();
        for _ in 0..CHUNK.min(STREAMS - sent) {
            h2wire::headers(&mut out, 2 * sent + 1, &block, false);
            sent += 1;
        }
        if conn.send(&out).await.is_err() {
            break;
        }
    }
    // Long enough for the server to answer every stream, and for accepted streams to show they
    // are held rather than answered.
    tokio::time::sleep(Duration::from_secs(target.secs.min(10))).await;
    let resets = lock(&conn.seen.resets).clone();
    let refused = resets.get("REFUSED_STREAM").copied().unwrap_or(0);
    let goaway = conn.seen.goaway();
    // A stream above the GOAWAY's last stream id was never processed.
    let beyond_goaway = goaway.map_or(0, |(last, _)| u64::from(sent.saturating_sub(last / 2 + 1)));
    let answered = conn.seen.resets_total() + beyond_goaway;
    Ok(json!({
        "streams_sent": sent,
        "resets_by_code": resets,
        "refused_streams": refused,
        "goaway": goaway.map(|(last, code)| json!({"last_stream_id": last, "code": code})),
        "held_open_after_wait": u64::from(sent).saturating_sub(answered),
        "connection_closed_by_server": conn.seen.closed.load(Ordering::SeqCst),
    }))
}
