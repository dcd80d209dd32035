//! One rider of a backend flooding CreateRide: a valid token, new keys as fast as 64
//! concurrent callers on one connection can send them. Its per-user limits must refuse its
//! excess, and nobody else's calls: not those of the backend it shares an address with
//! (`--only rider-flood-own`), nor anyone's from elsewhere (`rider-flood`).

use std::net::Ipv4Addr;

use serde_json::Value;

use super::{Target, flood};

const CALLERS: u32 = 64;

pub async fn run(target: &Target, from: Ipv4Addr) -> anyhow::Result<Value> {
    flood(target, from, &target.flood_token, CALLERS).await
}
