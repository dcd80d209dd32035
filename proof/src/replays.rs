//! The replays: once the system is drained, every key the database holds as finished is sent
//! again, with the same parameters, to an api-server that still runs. A replay must be the first
//! final answer to the byte (so that a client that lost an answer gets the same one), marked
//! `idempotent-replayed: true`, and never a non-final answer. For the keys whose client gave up,
//! the replay is the only answer there is, and the invariants check it like a first one.

use std::{
    collections::{BTreeMap, HashMap},
    time::Duration,
};

use rides_client::RetryPolicy;
use tonic::transport::Channel;

use crate::{
    args::Args,
    clients::{Answer, KeyRecord, Seen, User, classify, grpc_endpoint, user_client},
    evidence::{self, KeyRow},
    invariants::{Violations, is_payment_refunded},
};

/// What the replays saw.
pub(crate) struct Replays {
    /// How many were replayed, how many were byte-identical, and how many had no first answer.
    pub(crate) stats: BTreeMap<&'static str, u64>,
    /// The replay's answer, by key.
    pub(crate) seen: HashMap<String, Seen>,
}

/// Replays, while the api-server still runs: every key the DB holds as finished.
pub(crate) async fn replay(
    args: &Args,
    grpc_addr: &str,
    records: &[KeyRecord],
    keys: &[KeyRow],
    users: &[User],
    v: &mut Violations,
) -> anyhow::Result<Replays> {
    let key_by_name = evidence::by_name(keys);
    let token_of: HashMap<i64, &User> = users.iter().map(|u| (u.id, u)).collect();
    let replay_channel = grpc_endpoint(args, grpc_addr)?.connect().await?;
    let mut replays = Replays {
        stats: BTreeMap::new(),
        seen: HashMap::new(),
    };
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
            set.spawn(replay_one(replay_channel.clone(), user, record));
        }
        let Some(joined) = set.join_next().await else {
            break;
        };
        let (record, seen, replayed) = joined?;
        let refunded = key_by_name
            .get(&(record.user_id, record.key.clone()))
            .is_some_and(|k| k.outcome.as_deref() == Some("payment_refunded"));
        replays.judge(v, &record, seen, replayed, refunded);
    }
    Ok(replays)
}

/// One replay: its answer, and whether it was marked as a replay.
async fn replay_one(channel: Channel, user: User, record: KeyRecord) -> (KeyRecord, Seen, bool) {
    let result = user_client(&user, channel, Vec::new())
        .with_policy(RetryPolicy::single_attempt(Duration::from_secs(20)))
        .resume_ride(record.key.as_str(), record.params)
        .await;
    // An answer that is not a success cannot carry the marker; only a success is judged by it.
    let replayed = result.as_ref().map_or(true, |created| created.replayed);
    let seen = match classify(result) {
        Answer::Final(seen) => seen,
        Answer::Retry(label) => Seen::Unexpected(label),
    };
    (record, seen, replayed)
}

impl Replays {
    /// Counts one replay and checks it against the key's first final answer.
    /// `refunded`: the key was finished as refunded, and replays PAYMENT_REFUNDED.
    fn judge(
        &mut self,
        v: &mut Violations,
        record: &KeyRecord,
        seen: Seen,
        replayed: bool,
        refunded: bool,
    ) {
        *self.stats.entry("replayed").or_default() += 1;
        if !replayed {
            v.add(
                "replay_marked",
                format!(
                    "key {} replay not marked idempotent-replayed: true",
                    record.key
                ),
            );
        }
        match same_answer(&record.seen, &seen) {
            Some(true) => *self.stats.entry("byte_identical").or_default() += 1,
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
            None => *self.stats.entry("of_client_abandoned_keys").or_default() += 1,
        }
        let refusal =
            matches!(&seen, Seen::Unexpected(label) if refunded && is_payment_refunded(label));
        if matches!(seen, Seen::Unexpected(_)) && !refusal {
            v.add(
                "replay_final",
                format!("key {}: finished key replayed as {seen:?}", record.key),
            );
        }
        self.seen.insert(record.key.clone(), seen);
    }
}

/// Whether a replay is the first final answer to the byte; `None` when the client saw none.
fn same_answer(first: &Seen, replay: &Seen) -> Option<bool> {
    match (first, replay) {
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
        _ => None, // abandoned by its client: nothing to compare with; the invariants check it
    }
}
