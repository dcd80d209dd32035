//! The replays sent during the traffic and its faults: beside each charging user's client, a loop
//! that sends that user's answered keys again, as a caller that lost an answer does, and judges
//! each answer against the first, so that an outage can be measured for replays apart.

use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng, rngs::StdRng};
use rides_client::{CallError, Created};

use crate::counters::{CallKind, LiveReplays};

use super::{Answer, ClientCtx, Seen, classify, observer, retrying};

/// How long a replay loop waits between two replays: a few per second per user, so that the
/// replays are sampled as densely as the fresh calls without doubling the load.
const REPLAY_PAUSE_MS: std::ops::Range<u64> = 100..400;

/// A charging user's replays during traffic: one of the user's keys answered OK, picked at
/// random, sent again with the same parameters by a retrying client. Its answer must be the
/// first one to the byte, marked `idempotent-replayed: true` ([`LiveReplays`] keeps what was not).
pub(super) async fn replay_loop(ctx: ClientCtx, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    while Instant::now() < ctx.traffic_end {
        tokio::time::sleep(Duration::from_millis(rng.random_range(REPLAY_PAUSE_MS))).await;
        let picked = ctx.answered.lock().ok().and_then(|answered| {
            let i = rng.random_range(0..answered.len().max(1));
            answered.get(i).cloned()
        });
        let Some((rider, key, params, first)) = picked else {
            continue;
        };
        let result = ctx.riders[rider]
            .client
            .clone()
            .with_policy(retrying(&ctx.args, ctx.hard_end, false))
            .on_attempt(observer(&ctx, &key, false, CallKind::Replay))
            .resume_ride(key.as_str(), params)
            .await;
        judge_live_replay(&ctx.live_replays, &key, &first, result);
    }
}

fn judge_live_replay(
    live: &LiveReplays,
    key: &str,
    first: &Seen,
    result: Result<Created, CallError>,
) {
    let marked = result.as_ref().is_ok_and(|created| created.replayed);
    match (first, classify(result)) {
        (Seen::Ok { bytes, .. }, Answer::Final(Seen::Ok { bytes: again, .. }))
            if *bytes == again =>
        {
            if marked {
                live.outcomes.add("identical", 1);
            } else {
                live.problem("not_marked", format!("key {key}: replay not marked"));
            }
        }
        (_, Answer::Retry(label)) => live.outcomes.add(format!("gave_up/{label}"), 1),
        (_, Answer::Final(again)) => live.problem(
            "differs",
            format!(
                "key {key}: first {} ({}), replayed {} ({})",
                first.kind(),
                first.detail(),
                again.kind(),
                again.detail()
            ),
        ),
    }
}
