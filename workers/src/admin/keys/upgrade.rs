//! `workers admin keys upgrade`: the upgrade step for keys an older server (one that committed the
//! charge's record apart from finishing the key) left at `started` or `charge_created`, the two
//! recovery points
//! today's api-server has no phase for (it answers such a key `IDEMPOTENCY_KEY_NEEDS_UPGRADE`).
//!
//! - A key at `started` holds nothing but itself: the phase that would have written its ride
//!   never committed, so there is no ride and no charge. It is retired (deleted), as the reaper
//!   retires keys: a retry with the same key then starts afresh, which is what resuming it would
//!   have done.
//! - A key at `charge_created` has its charge recorded on its ride and lacks only its receipt and
//!   its stored outcome: it is finished exactly as `key finish --outcome succeeded` finishes a
//!   key (the receipt staged unless one is staged or sent, the outcome stored, the lock cleared).
//!
//! Each key is one transaction of its own with the key row locked, and a key whose lock is live
//! (an older server may be running it) is left alone: run the step once no older api-server runs,
//! and again until it leaves nothing.

use diesel::{ExpressionMethods, QueryDsl};
use diesel_async::RunQueryDsl;
use provider::StripeClient;
use schema::{Pool, RecoveryPoint, schema::idempotency_keys};
use serde::Serialize;
use serde_json::json;

use crate::admin::{
    AdminError, AdminSettings, Change, ChangeReport, FinishOutcome, Mode, bound_waits,
};

use super::{FinishRequest, check_lock, expect_one, finish, load_key, ride_for_key};

/// What the step did, or would do, with every key an older server left.
#[derive(Debug, Serialize)]
pub struct UpgradeReport {
    pub mode: Mode,
    pub keys: Vec<KeyUpgrade>,
}

/// One key's part of [`UpgradeReport`].
#[derive(Debug, Serialize)]
pub struct KeyUpgrade {
    pub key_id: i64,
    pub recovery_point: RecoveryPoint,
    #[serde(flatten)]
    pub outcome: UpgradeOutcome,
}

#[derive(Debug, Serialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum UpgradeOutcome {
    /// A `started` key, deleted.
    Retired { change: ChangeReport },
    /// A `charge_created` key, finished as charged.
    Finished { change: ChangeReport },
    /// Not changed, and why (a live lock, a key that moved on meanwhile, a ride a `started` key
    /// should not have): run the step again later, or look at the key by hand.
    Left { reason: String },
}

impl UpgradeReport {
    /// The keys the step left: the command fails while there are any, so that a deploy script
    /// does not go on believing the upgrade done.
    pub fn failure(&self) -> Option<String> {
        let left = self
            .keys
            .iter()
            .filter(|key| matches!(key.outcome, UpgradeOutcome::Left { .. }))
            .count();
        (left > 0).then(|| format!("{left} key(s) left; see each key's reason and run it again"))
    }

    pub fn render(&self) -> String {
        let mut out = match self.keys.len() {
            0 => "keys upgrade: no key is at started or charge_created; nothing to do\n".to_owned(),
            n => format!("keys upgrade: {n} key(s) an older server left\n"),
        };
        for key in &self.keys {
            match &key.outcome {
                UpgradeOutcome::Retired { change } | UpgradeOutcome::Finished { change } => {
                    out.push_str(&change.render());
                }
                UpgradeOutcome::Left { reason } => out.push_str(&format!(
                    "keys upgrade {} (at {}): LEFT: {reason}\n",
                    key.key_id, key.recovery_point
                )),
            }
        }
        out
    }
}

/// Retires or finishes every key at `started` or `charge_created` (see the module doc).
pub async fn upgrade(
    pool: &Pool,
    settings: &AdminSettings,
    stripe: &StripeClient,
    mode: Mode,
) -> Result<UpgradeReport, AdminError> {
    let left_keys: Vec<(i64, RecoveryPoint)> = {
        let mut conn = pool.get().await?;
        idempotency_keys::table
            .filter(
                idempotency_keys::recovery_point
                    .eq_any([RecoveryPoint::Started, RecoveryPoint::ChargeCreated]),
            )
            .order(idempotency_keys::id)
            .select((idempotency_keys::id, idempotency_keys::recovery_point))
            .load(&mut conn)
            .await?
    };
    let mut keys = Vec::with_capacity(left_keys.len());
    for (key_id, recovery_point) in left_keys {
        let done = match recovery_point {
            RecoveryPoint::Started => retire(pool, settings, key_id, mode)
                .await
                .map(|change| UpgradeOutcome::Retired { change }),
            RecoveryPoint::ChargeCreated => {
                let request = FinishRequest {
                    key_id,
                    outcome: FinishOutcome::Succeeded,
                    charge_id: None,
                    message: None,
                    force: false,
                };
                finish(pool, settings, stripe, &request, mode)
                    .await
                    .map(|change| UpgradeOutcome::Finished { change })
            }
            RecoveryPoint::RideCreated | RecoveryPoint::Finished => continue,
        };
        let outcome = match done {
            Ok(outcome) => outcome,
            Err(AdminError::Refused(reason) | AdminError::NotFound(reason)) => {
                UpgradeOutcome::Left { reason }
            }
            Err(error) => return Err(error),
        };
        keys.push(KeyUpgrade {
            key_id,
            recovery_point,
            outcome,
        });
    }
    if mode.applies() {
        tracing::info!(keys = keys.len(), "admin: older servers' keys upgraded");
    }
    Ok(UpgradeReport { mode, keys })
}

/// Deletes a key at `started` whose lock is free and that has no ride.
async fn retire(
    pool: &Pool,
    settings: &AdminSettings,
    key_id: i64,
    mode: Mode,
) -> Result<ChangeReport, AdminError> {
    let mut conn = pool.get().await?;
    crate::admin::change_transaction(&mut conn, mode)
        .run(async |conn| {
            bound_waits(conn).await?;
            let (key, now, verdict) = load_key(conn, key_id, mode, settings.lock_rule).await?;
            if key.recovery_point != RecoveryPoint::Started {
                return Err(AdminError::Refused(format!(
                    "key {key_id} moved on to {} meanwhile; run the step again",
                    key.recovery_point
                )));
            }
            check_lock(&key, verdict, now, settings, false, "retire it")?;
            if let Some(ride) = ride_for_key(conn, &key, mode.applies()).await? {
                return Err(AdminError::Refused(format!(
                    "key {key_id} is at started but has ride {}, which no server writes without \
                     moving the key on; look at it with `workers admin key show --key-id \
                     {key_id}` and finish it by hand",
                    ride.id
                )));
            }
            let mut report = ChangeReport::new("keys upgrade", mode, key_id);
            report.changes.push(Change {
                action: "delete",
                table: "idempotency_keys",
                row: Some(key_id),
                column: None,
                from: None,
                to: json!({"recovery_point": key.recovery_point}),
            });
            report.notes.push(
                "the key held no ride and no charge: a retry with the same key starts afresh"
                    .to_owned(),
            );
            if mode.applies() {
                let deleted = diesel::delete(idempotency_keys::table.find(key_id))
                    .filter(idempotency_keys::user_id.eq(key.user_id))
                    .filter(idempotency_keys::recovery_point.eq(RecoveryPoint::Started))
                    .execute(conn)
                    .await?;
                expect_one(deleted, "idempotency_keys", key_id)?;
            }
            Ok(report)
        })
        .await
}
