//! `workers admin key show|unlock|finish`: one idempotency key, and `workers admin keys upgrade`,
//! which finishes or retires every key an older server left. One file per command (`show.rs`,
//! `unlock.rs`, `finish.rs`, `upgrade.rs`); what more than one of them reads or checks is here.
//!
//! `unlock` and `finish` lock the key row (`SELECT … FOR UPDATE`) as the first statement of
//! their transaction, like every api-server phase does (`FOR NO KEY UPDATE`, which conflicts), so
//! an operator's change is ordered strictly before or after any phase and the preconditions are
//! checked against the row that is then changed. Neither reads the lock token: they only test
//! whether there is one. Clearing it fences the previous holder out: its next phase finds its
//! token gone and commits nothing (`IDEMPOTENCY_KEY_LOCK_LOST`). What fencing cannot stop is a
//! provider call the holder has already started, which is why a live lock needs `--force`.

use chrono::{DateTime, Utc};
use contract::{
    BackgroundJob, ReceiptJob,
    key::{self, LockRule, chrono_duration},
};
use diesel::{
    ExpressionMethods, OptionalExtension, QueryDsl, Queryable, QueryableByName, Selectable,
    SelectableHelper,
    sql_types::{BigInt, Bool, Double, Nullable, Text},
};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use schema::{
    RecoveryPoint,
    models::Ride,
    schema::{idempotency_keys, rides},
};
use serde_json::{Value, json};

use crate::admin::{AdminError, AdminSettings, Change, ChangeReport, Mode, render};

mod finish;
mod show;
mod unlock;
mod upgrade;

pub use finish::{DEFAULT_DECLINE_MESSAGE, FinishRequest, finish};
pub use show::{
    CompleterState, KeyDetails, KeyReport, KeySelector, LockState, ReceiptState, RideDetails,
    StoredOutcome, show,
};
pub use unlock::unlock;
pub use upgrade::{KeyUpgrade, UpgradeOutcome, UpgradeReport, upgrade};

/// Every column of a key the admin commands look at. Deliberately not `lock_token`: whether a
/// lock exists is `locked_at IS NOT NULL` (the two are set and cleared together, a CHECK
/// constraint guarantees it), and the token is read only where `key unlock` presents it back to
/// the fenced release, so it cannot be printed.
#[derive(Clone, Debug, Queryable, Selectable)]
#[diesel(table_name = idempotency_keys, check_for_backend(diesel::pg::Pg))]
struct KeyState {
    id: i64,
    created_at: DateTime<Utc>,
    idempotency_key: String,
    last_run_at: DateTime<Utc>,
    locked_at: Option<DateTime<Utc>>,
    request_method: String,
    request_path: String,
    request_params: Value,
    response_code: Option<i32>,
    response_body: Option<Value>,
    recovery_point: RecoveryPoint,
    user_id: i64,
    completer_attempts: i32,
    completer_next_attempt_at: Option<DateTime<Utc>>,
    completer_gave_up_at: Option<DateTime<Utc>>,
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    count: i64,
}

/// Receipt jobs for `ride_id` that are staged and not yet published.
async fn staged_receipt_jobs(
    conn: &mut AsyncPgConnection,
    ride_id: i64,
) -> Result<i64, AdminError> {
    let count: Count = diesel::sql_query(
        "SELECT count(*) AS count FROM staged_jobs \
         WHERE job_name = $1 AND job_args->>'ride_id' = $2",
    )
    .bind::<Text, _>(ReceiptJob::JOB_NAME)
    .bind::<Text, _>(ride_id.to_string())
    .get_result(conn)
    .await?;
    Ok(count.count)
}

fn now_sql() -> diesel::expression::SqlLiteral<diesel::sql_types::Timestamptz> {
    diesel::dsl::sql::<diesel::sql_types::Timestamptz>("now()")
}

/// What the lock rule (`contract::key::LockRule`) says of a key's lock, and whether the holder
/// its lock names is alive (`None`: it names none, as an operator's or an older server's lock).
#[derive(Clone, Copy, Debug)]
struct LockVerdict {
    state: key::LockState,
    holder_alive: Option<bool>,
}

/// Asks the lock rule about key `key_id` ([`LockVerdict`]).
async fn lock_verdict(
    conn: &mut AsyncPgConnection,
    key_id: i64,
    rule: LockRule,
) -> Result<LockVerdict, AdminError> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = Text)]
        state: String,
        #[diesel(sql_type = Nullable<Bool>)]
        holder_alive: Option<bool>,
    }
    let (timeout_secs, takeover_secs) = rule.secs();
    let row: Row = diesel::sql_query(concat!(
        "SELECT ",
        contract::lock_state_sql!("$2", "$3"),
        " AS state, CASE WHEN lock_holder IS NULL THEN NULL \
         ELSE NOT lock_holder_is_gone(lock_holder) END AS holder_alive \
         FROM idempotency_keys WHERE id = $1"
    ))
    .bind::<BigInt, _>(key_id)
    .bind::<Double, _>(timeout_secs)
    .bind::<Double, _>(takeover_secs)
    .get_result(conn)
    .await?;
    Ok(LockVerdict {
        state: key::LockState::parse(&row.state),
        holder_alive: row.holder_alive,
    })
}

/// Loads the key and what the lock rule says of its lock, locking its row when the command is
/// going to change it. A dry run takes no lock: it never delays an api-server phase.
async fn load_key(
    conn: &mut AsyncPgConnection,
    key_id: i64,
    mode: Mode,
    rule: LockRule,
) -> Result<(KeyState, DateTime<Utc>, LockVerdict), AdminError> {
    let query = idempotency_keys::table
        .find(key_id)
        .select((KeyState::as_select(), now_sql()));
    let found = if mode.applies() {
        query.for_update().first(conn).await.optional()?
    } else {
        query.first(conn).await.optional()?
    };
    let (key, now) = found.ok_or_else(|| {
        AdminError::NotFound(format!(
            "no idempotency key with id {key_id} (reaped keys are listed by \
             `workers admin keys needing-attention --all`)"
        ))
    })?;
    let verdict = lock_verdict(conn, key_id, rule).await?;
    Ok((key, now, verdict))
}

/// Refuses a live lock unless forced; returns the warning to print when forced.
fn check_lock(
    key: &KeyState,
    verdict: LockVerdict,
    now: DateTime<Utc>,
    settings: &AdminSettings,
    force: bool,
    action: &str,
) -> Result<Option<String>, AdminError> {
    let lock_timeout = chrono_duration(settings.lock_rule.lock_timeout);
    let Some(locked_at) = key.locked_at else {
        return Ok(None);
    };
    if !verdict.state.is_live() {
        return Ok(None);
    }
    let age = render::duration(now - locked_at);
    let expires = render::time(locked_at + lock_timeout);
    let holder = match verdict.holder_alive {
        Some(true) => "its holder's liveness session is alive",
        Some(false) => {
            "its holder's liveness session is gone, but the key is too old to take over before the lock expires"
        }
        None => "its lock names no holder",
    };
    let risk = format!(
        "key {} is locked by an attempt that may still be running: the lock was taken {age} ago, \
         {holder}, and IDEMPOTENCY_LOCK_TIMEOUT_SECS is {}s. Its holder (an api-server request or \
         the completer) may be in the middle of the provider charge; to {action} now would let \
         its result and yours race (its next phase is fenced out and commits nothing, but a \
         charge it has already sent still happens)",
        key.id,
        settings.lock_rule.lock_timeout.as_secs()
    );
    if force {
        Ok(Some(format!("{risk}. Proceeding because of --force.")))
    } else {
        Err(AdminError::Refused(format!(
            "{risk}. Wait until the lock expires at {expires} (then no --force is needed), or \
             re-run with --force --yes if you know the holder is dead."
        )))
    }
}

fn lock_changes(report: &mut ChangeReport, key: &KeyState) {
    if let Some(locked_at) = key.locked_at {
        report.changes.push(Change::update(
            "idempotency_keys",
            key.id,
            "locked_at",
            json!(locked_at),
            Value::Null,
        ));
        report.changes.push(Change::update(
            "idempotency_keys",
            key.id,
            "lock_token",
            json!("held"),
            Value::Null,
        ));
    }
}

async fn ride_for_key(
    conn: &mut AsyncPgConnection,
    key: &KeyState,
    lock: bool,
) -> Result<Option<Ride>, AdminError> {
    let query = rides::table
        .filter(rides::idempotency_key_id.eq(key.id))
        .filter(rides::user_id.eq(key.user_id))
        .select(Ride::as_select());
    let ride = if lock {
        query.for_update().first(conn).await.optional()?
    } else {
        query.first(conn).await.optional()?
    };
    Ok(ride)
}

/// Every applying UPDATE re-states its precondition in its WHERE clause; with the row locked it
/// cannot fail, and if it ever does the transaction rolls back rather than half-apply.
fn expect_one(updated: usize, table: &str, id: i64) -> Result<(), AdminError> {
    if updated == 1 {
        Ok(())
    } else {
        Err(AdminError::Internal(format!(
            "{table} row {id} changed under a locked transaction ({updated} rows updated); \
             rolled back, nothing was changed"
        )))
    }
}
