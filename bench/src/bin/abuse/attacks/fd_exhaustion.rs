//! Out of file descriptors: the api-server's soft `nofile` limit is lowered (prlimit) to what it
//! has open plus its descriptor reserve (`GRPC_RESERVED_DESCRIPTORS`, [`RESERVE`] by default)
//! plus [`HEADROOM`], and 300 polite HTTP/2 connections from 6 addresses use the rest up. The
//! accept loop must pause rather than spin, the connections it already serves must go on, and
//! once the attacker lets go and the limit is back, a new connection must be served again. The
//! limit is put back before the recovery is measured, whatever happens.

use std::{
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use bench::procfs::open_fds;
use futures_util::future::join_all;
use rustix::process::{Pid, Resource, Rlimit, prlimit};
use serde_json::{Value, json};

use super::{Manners, RawConn, Target, source};
use crate::traffic::time_to_serve;

const HEADROOM: u64 = 40;
/// The api-server's default `GRPC_RESERVED_DESCRIPTORS`: descriptors no connection may take.
const RESERVE: u64 = 256;
const CONNECTIONS: u32 = 300;
const ADDRESSES: u32 = 6;

/// The (soft, hard) open-file limits of `pid`, from `/proc/<pid>/limits` (`None`: unlimited).
fn nofile(pid: u32) -> anyhow::Result<(Option<u64>, Option<u64>)> {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits"))?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .ok_or_else(|| anyhow::anyhow!("no open-file limit in /proc/{pid}/limits"))?;
    let mut values = line["Max open files".len()..]
        .split_whitespace()
        .map(|v| v.parse().ok());
    Ok((values.next().flatten(), values.next().flatten()))
}

fn set_nofile(pid: u32, soft: Option<u64>, hard: Option<u64>) -> anyhow::Result<()> {
    let pid = i32::try_from(pid)
        .ok()
        .and_then(Pid::from_raw)
        .ok_or_else(|| anyhow::anyhow!("bad pid {pid}"))?;
    let limit = Rlimit {
        current: soft,
        maximum: hard,
    };
    prlimit(Some(pid), Resource::Nofile, limit)?;
    Ok(())
}

pub async fn run(target: &Target) -> anyhow::Result<Value> {
    let fds = open_fds(target.server_pid)
        .ok_or_else(|| anyhow::anyhow!("cannot read the api-server's fds"))?;
    let limit = fds as u64 + RESERVE + HEADROOM;
    let (soft, hard) = nofile(target.server_pid)?;
    set_nofile(target.server_pid, Some(limit), hard)?;
    let outcome = exhaust(target, fds, limit).await;
    set_nofile(target.server_pid, soft, hard)?;
    let mut outcome = outcome?;
    let recovered = time_to_serve(
        target.addr,
        &target.probe_token,
        target.probe_ride,
        Duration::from_secs(30),
    )
    .await;
    outcome["new_connection_served_after_release_ms"] =
        json!(recovered.map(|d| d.as_millis() as u64));
    Ok(outcome)
}

async fn exhaust(target: &Target, fds_before: usize, limit: u64) -> anyhow::Result<Value> {
    let started = Instant::now();
    let opened = join_all(
        (0..CONNECTIONS)
            .map(|n| RawConn::open(source(70, n % ADDRESSES), target.addr, Manners::Polite)),
    )
    .await;
    let conns: Vec<RawConn> = opened.into_iter().flatten().collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let served = conns
        .iter()
        .filter(|c| c.seen.server_settings.load(Ordering::SeqCst))
        .count();
    let fds_at_peak = open_fds(target.server_pid);
    // A new legitimate connection while descriptors are exhausted: expected to wait.
    let served_while_exhausted = time_to_serve(
        target.addr,
        &target.probe_token,
        target.probe_ride,
        Duration::from_secs(2),
    )
    .await;
    let hold = Duration::from_secs(target.secs).saturating_sub(started.elapsed());
    tokio::time::sleep(hold).await;
    drop(conns);
    Ok(json!({
        "fds_before": fds_before,
        "soft_limit_set_to": limit,
        "fds_at_peak": fds_at_peak,
        "connections_opened": CONNECTIONS,
        "connections_served": served,
        "new_connection_served_while_exhausted_ms": served_while_exhausted.map(|d| d.as_millis() as u64),
    }))
}
