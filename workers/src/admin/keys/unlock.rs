//! `workers admin key unlock`: clears the lock of an unfinished key.

use contract::writes::{KeyFence, ReleaseLock};
use diesel::{ExpressionMethods, QueryDsl};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use schema::{Pool, RecoveryPoint, schema::idempotency_keys};
use uuid::Uuid;

use crate::admin::{AdminError, AdminSettings, ChangeReport, Mode, bound_waits};

use super::{check_lock, expect_one, load_key, lock_changes};

/// `key unlock`: clears the lock of an unfinished key, so that the client's next retry or the
/// completer resumes it at its recovery point.
pub async fn unlock(
    pool: &Pool,
    settings: &AdminSettings,
    key_id: i64,
    force: bool,
    mode: Mode,
) -> Result<ChangeReport, AdminError> {
    let mut conn = pool.get().await?;
    let report = crate::admin::change_transaction(&mut conn, mode)
        .run(async |conn| {
            bound_waits(conn).await?;
            let (key, now, verdict) = load_key(conn, key_id, mode, settings.lock_rule).await?;
            if key.recovery_point == RecoveryPoint::Finished {
                return Err(AdminError::Refused(format!(
                    "key {key_id} is finished: its outcome is stored and replayed, and a \
                     finished key is never locked. Nothing to unlock."
                )));
            }
            if key.locked_at.is_none() {
                return Err(AdminError::Refused(format!(
                    "key {key_id} is not locked; nothing to unlock. A retry by the client or the \
                     completer can already resume it at {}.",
                    key.recovery_point
                )));
            }
            let mut report = ChangeReport::new("key unlock", mode, key_id);
            if let Some(warning) = check_lock(&key, verdict, now, settings, force, "unlock it")? {
                report.warnings.push(warning);
            }
            lock_changes(&mut report, &key);
            report.notes.push(format!(
                "the client's next retry, or the completer (keys created more than \
                 COMPLETER_MIN_AGE_SECS ago, idle COMPLETER_IDLE_SECS), resumes the key at {}",
                key.recovery_point
            ));
            if key.completer_gave_up_at.is_some() {
                report.notes.push(
                    "the completer has given up on this key and will not pick it up again; only \
                     a client retry resumes it (or finish it with `workers admin key finish`)"
                        .to_owned(),
                );
            }
            if mode.applies() {
                release_as_the_api_server_does(conn, key_id, key.user_id).await?;
            }
            Ok(report)
        })
        .await?;
    if mode.applies() {
        tracing::info!(key_id, forced = force, "admin: key unlocked");
    }
    Ok(report)
}

/// Releases the lock with the statement every unlock runs ([`ReleaseLock`]), fenced by the
/// token the lock carries now: this transaction holds the key row's lock, so that token is the
/// current holder's, read here only to be presented back (it is never shown).
async fn release_as_the_api_server_does(
    conn: &mut AsyncPgConnection,
    key_id: i64,
    user_id: i64,
) -> Result<(), AdminError> {
    let token: Option<Uuid> = idempotency_keys::table
        .find(key_id)
        .filter(idempotency_keys::user_id.eq(user_id))
        .select(idempotency_keys::lock_token)
        .first(conn)
        .await?;
    let released = match token {
        Some(token) => {
            let fence = KeyFence {
                key_id,
                user_id,
                token,
            };
            ReleaseLock::run(conn, &[fence]).await?
        }
        None => Vec::new(),
    };
    expect_one(
        released.into_iter().filter(|released| *released).count(),
        "idempotency_keys",
        key_id,
    )
}
