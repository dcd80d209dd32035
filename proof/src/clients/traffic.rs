//! The campaign's traffic as a whole: the users it creates, the window it runs in, and the
//! clients and replay loops it starts and waits for. One client's loop is the parent module's.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Context;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

use crate::{
    args::Args,
    counters::Tallies,
    setup::{Plan, Wiring},
};

use super::{
    Answered, ClientCtx, KeyRecord, Rider, User, grpc_endpoint, replay_loop, run_client,
    user_client,
};

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
        for r in 0..args.riders_per_client.max(1) {
            let (user, token) = api_server::auth::create_user(
                &pool,
                &format!("proof-{}-{i}-{r}@proof.rocketrides.test", plan.run_id),
                &format!("cus_proof_{}_{i}_{r}", plan.run_id),
                card,
            )
            .await
            .with_context(|| format!("creating user {r} of client {i}"))?;
            users.push(User {
                id: user.id,
                token,
                declining,
                client: i,
            });
        }
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
    replays: Vec<JoinHandle<()>>,
}

impl Traffic {
    /// One client per user (or per `--riders-per-client` users), with its own channel to either
    /// api-server (or one channel to each that every client shares; with `--lb`, to the proxy
    /// instead), and a replay loop beside each charging client.
    pub(crate) fn start(
        args: &Args,
        plan: &Plan,
        users: &[User],
        tallies: &Tallies,
        window: Window,
    ) -> anyhow::Result<Self> {
        let mut clients: Vec<JoinHandle<Vec<KeyRecord>>> = Vec::new();
        let mut replays: Vec<JoinHandle<()>> = Vec::new();
        let channel = |port: u16| -> anyhow::Result<Channel> {
            Ok(grpc_endpoint(args, &format!("127.0.0.1:{port}"))?
                .connect_timeout(Duration::from_secs(1))
                .connect_lazy())
        };
        // Through the proxy alone with `--lb`, which spreads the calls; otherwise each attempt
        // picks an api-server.
        let targets = || -> anyhow::Result<(Channel, Vec<Channel>)> {
            if args.lb {
                Ok((channel(args.lb_port)?, Vec::new()))
            } else {
                Ok((channel(args.grpc_port)?, vec![channel(args.grpc_port_b)?]))
            }
        };
        // Backends carrying riders share one connection per target, as a mesh sidecar would.
        let shared = if args.riders_per_client > 0 {
            Some(targets()?)
        } else {
            None
        };
        for (i, group) in users.chunk_by(|a, b| a.client == b.client).enumerate() {
            let (first, more) = match &shared {
                Some(shared) => shared.clone(),
                None => targets()?,
            };
            let riders = group
                .iter()
                .map(|user| Rider {
                    user: user.clone(),
                    client: user_client(user, first.clone(), more.clone()),
                })
                .collect();
            let declining = group.iter().any(|user| user.declining);
            let ctx = ClientCtx {
                id: i as u32,
                riders: Arc::new(riders),
                declining,
                faults: Arc::clone(&tallies.faults),
                run_id: plan.run_id.clone(),
                traffic_end: window.end,
                hard_end: window.hard_end,
                args: args.clone(),
                attempts: Arc::clone(&tallies.attempts),
                requests: Arc::clone(&tallies.requests),
                retries: Arc::clone(&tallies.retries),
                timeline: Arc::clone(&tallies.timeline),
                answered: Answered::default(),
                live_replays: Arc::clone(&tallies.live_replays),
            };
            if !declining {
                replays.push(tokio::spawn(replay_loop(
                    ctx.clone(),
                    plan.seed.wrapping_add(2000 + i as u64),
                )));
            }
            clients.push(tokio::spawn(run_client(
                ctx,
                plan.seed.wrapping_add(1000 + i as u64),
            )));
        }
        Ok(Traffic { clients, replays })
    }

    /// Waits for every client to finish its last key, and every replay loop its last replay.
    pub(crate) async fn finish(self) -> anyhow::Result<Vec<KeyRecord>> {
        for replay in self.replays {
            replay.await?;
        }
        let mut records: Vec<KeyRecord> = Vec::new();
        for client in self.clients {
            records.extend(client.await?);
        }
        Ok(records)
    }
}
