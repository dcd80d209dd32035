//! `workers admin key show|unlock|finish`: one idempotency key.
//!
//! `unlock` and `finish` lock the key row (`SELECT … FOR UPDATE`) as the first statement of
//! their transaction, like every api-server phase does (`FOR NO KEY UPDATE`, which conflicts), so
//! an operator's change is ordered strictly before or after any phase and the preconditions are
//! checked against the row that is then changed. Neither reads the lock token: they only test
//! whether there is one. Clearing it fences the previous holder out: its next phase finds its
//! token gone and commits nothing (`IDEMPOTENCY_KEY_LOCK_LOST`). What fencing cannot stop is a
//! provider call the holder has already started, which is why a live lock needs `--force`.

use std::fmt::Write as _;

use chrono::{DateTime, Utc};
use contract::{
    BackgroundJob, Outcome, ReceiptJob, StoredResponse,
    key::{FinishKey, KeyMoved, chrono_duration, lock_is_live, provider_idempotency_key},
};
use diesel::{
    ExpressionMethods, OptionalExtension, QueryDsl, Queryable, QueryableByName, Selectable,
    SelectableHelper,
    sql_types::{self, BigInt, Integer, Jsonb, Text},
};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use provider::StripeClient;
use schema::{
    Pool, RecoveryPoint,
    models::{KeyNeedingAttention, NewStagedJob, Ride},
    prepared::prepared,
    schema::{idempotency_keys, keys_needing_attention, rides, sent_receipts, staged_jobs, users},
};
use serde::Serialize;
use serde_json::{Value, json};
use uuid::Uuid;

use super::render::{optional_time, outcome, relative};
use super::{
    AdminError, AdminSettings, Change, ChangeReport, FinishOutcome, Mode, attention::AttentionRow,
    bound_waits, render,
};
use crate::redact;

/// The decline message a replay returns when the operator gives none (Stripe's generic text).
pub const DEFAULT_DECLINE_MESSAGE: &str = "Your card was declined.";

/// Every column of a key the admin commands look at. Deliberately not `lock_token`: whether a
/// lock exists is `locked_at IS NOT NULL` (the two are set and cleared together, a CHECK
/// constraint guarantees it), and the token never needs to be read, so it cannot be printed.
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

/// How to find a key.
#[derive(Clone, Debug)]
pub enum KeySelector {
    Id(i64),
    UserKey { user_id: i64, key: String },
}

/// `key show`.
#[derive(Clone, Debug, Serialize)]
pub struct KeyReport {
    /// The database's clock, which every lock decision uses.
    pub now: DateTime<Utc>,
    /// `None` when the key no longer exists (reaped) but attention rows about it do.
    pub key: Option<KeyDetails>,
    pub ride: Option<RideDetails>,
    /// Every `keys_needing_attention` row about this key, resolved or not, oldest first.
    pub attention: Vec<AttentionRow>,
}

#[derive(Clone, Debug, Serialize)]
pub struct KeyDetails {
    pub id: i64,
    pub user_id: i64,
    /// Redacted (`r***@example.com`).
    pub user_email: Option<String>,
    pub idempotency_key: String,
    pub request_method: String,
    pub request_path: String,
    pub request_params: Value,
    pub created_at: DateTime<Utc>,
    /// When the reaper retires it: created_at + IDEMPOTENCY_KEY_TTL_HOURS.
    pub expires_at: Option<DateTime<Utc>>,
    pub last_run_at: DateTime<Utc>,
    pub recovery_point: RecoveryPoint,
    /// The idempotency key every charge attempt for this key presented to the provider: search
    /// the provider's PaymentIntents for it (or for metadata `idempotency_key_id`). Fixed when
    /// the key's ride is created (by the ride's deployment id); `None` while it has no ride, and
    /// so no charge.
    pub provider_idempotency_key: Option<String>,
    pub lock: LockState,
    pub completer: CompleterState,
    pub stored_outcome: Option<StoredOutcome>,
}

#[derive(Clone, Debug, Serialize)]
pub struct LockState {
    /// `held` or `none`. The token itself is never read.
    pub state: &'static str,
    pub locked_at: Option<DateTime<Utc>>,
    /// Younger than IDEMPOTENCY_LOCK_TIMEOUT_SECS: its holder may still be running.
    pub live: bool,
    /// When a held lock expires (may be in the past).
    pub expires_at: Option<DateTime<Utc>>,
}

#[derive(Clone, Debug, Serialize)]
pub struct CompleterState {
    pub attempts: i32,
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub gave_up_at: Option<DateTime<Utc>>,
}

#[derive(Clone, Debug, Serialize)]
pub struct StoredOutcome {
    /// The gRPC status code a replay answers with.
    pub response_code: i32,
    pub outcome: Option<Outcome>,
    /// Set instead of `outcome` when the stored body does not decode (a replay then fails).
    pub undecodable: Option<Value>,
}

#[derive(Clone, Debug, Serialize)]
pub struct RideDetails {
    pub id: i64,
    pub user_id: i64,
    pub charge_id: Option<String>,
    pub amount: i64,
    pub currency: String,
    pub created_at: DateTime<Utc>,
    pub receipt: ReceiptState,
}

#[derive(Clone, Debug, Serialize)]
pub struct ReceiptState {
    /// `send_ride_receipt` jobs for this ride still in `staged_jobs` (not yet published).
    pub staged_jobs: i64,
    pub sent_at: Option<DateTime<Utc>>,
    /// The AMQP message id (= staged job id) of the delivery that sent it.
    pub sent_message_id: Option<String>,
}

/// `key show`: everything known about one key. Read-only.
pub async fn show(
    pool: &Pool,
    settings: &AdminSettings,
    selector: &KeySelector,
) -> Result<KeyReport, AdminError> {
    let mut conn = pool.get().await?;
    conn.build_transaction()
        .read_committed()
        .read_only()
        .run(async |conn| {
            bound_waits(conn).await?;
            let query = idempotency_keys::table
                .select((KeyState::as_select(), now_sql()))
                .into_boxed();
            let query = match selector {
                KeySelector::Id(id) => query.filter(idempotency_keys::id.eq(*id)),
                KeySelector::UserKey { user_id, key } => query
                    .filter(idempotency_keys::user_id.eq(*user_id))
                    .filter(idempotency_keys::idempotency_key.eq(key.as_str())),
            };
            let found: Option<(KeyState, DateTime<Utc>)> = query.first(conn).await.optional()?;
            let key_user = found.as_ref().map(|(key, _)| key.user_id);
            let attention = attention_rows(conn, selector, key_user).await?;
            let Some((key, now)) = found else {
                if attention.is_empty() {
                    return Err(not_found(selector));
                }
                return Ok(KeyReport {
                    now: super::db_now(conn).await?,
                    key: None,
                    ride: None,
                    attention,
                });
            };
            let user_email = users::table
                .find(key.user_id)
                .select(users::email)
                .first::<String>(conn)
                .await
                .optional()?
                .map(|email| redact::email(&email));
            let ride = ride_for_key(conn, &key, false).await?;
            let provider_key = ride
                .as_ref()
                .map(|ride| provider_idempotency_key(ride.deployment_id.as_deref(), key.id));
            let ride = match ride {
                Some(ride) => Some(ride_details(conn, ride).await?),
                None => None,
            };
            let mut details = key_details(&key, user_email, now, settings);
            details.provider_idempotency_key = provider_key;
            Ok(KeyReport {
                now,
                key: Some(details),
                ride,
                attention,
            })
        })
        .await
}

fn not_found(selector: &KeySelector) -> AdminError {
    let which = match selector {
        KeySelector::Id(id) => format!("id {id}"),
        KeySelector::UserKey { user_id, .. } => format!("that key string for user {user_id}"),
    };
    AdminError::NotFound(format!(
        "no idempotency key with {which}, and no keys_needing_attention row about it"
    ))
}

fn key_details(
    key: &KeyState,
    user_email: Option<String>,
    now: DateTime<Utc>,
    settings: &AdminSettings,
) -> KeyDetails {
    let lock_timeout = chrono_duration(settings.lock_timeout);
    let key_ttl = chrono_duration(settings.key_ttl);
    KeyDetails {
        id: key.id,
        user_id: key.user_id,
        user_email,
        idempotency_key: key.idempotency_key.clone(),
        request_method: key.request_method.clone(),
        request_path: key.request_path.clone(),
        request_params: key.request_params.clone(),
        created_at: key.created_at,
        expires_at: key.created_at.checked_add_signed(key_ttl),
        last_run_at: key.last_run_at,
        recovery_point: key.recovery_point,
        provider_idempotency_key: None,
        lock: LockState {
            state: if key.locked_at.is_some() {
                "held"
            } else {
                "none"
            },
            locked_at: key.locked_at,
            live: key
                .locked_at
                .is_some_and(|locked_at| lock_is_live(locked_at, now, settings.lock_timeout)),
            expires_at: key
                .locked_at
                .and_then(|locked_at| locked_at.checked_add_signed(lock_timeout)),
        },
        completer: CompleterState {
            attempts: key.completer_attempts,
            next_attempt_at: key.completer_next_attempt_at,
            gave_up_at: key.completer_gave_up_at,
        },
        stored_outcome: key.response_code.map(|response_code| {
            let body = key.response_body.clone().unwrap_or(Value::Null);
            match serde_json::from_value::<Outcome>(body.clone()) {
                Ok(outcome) => StoredOutcome {
                    response_code,
                    outcome: Some(outcome),
                    undecodable: None,
                },
                Err(_) => StoredOutcome {
                    response_code,
                    outcome: None,
                    undecodable: Some(body),
                },
            }
        }),
    }
}

/// The attention rows about the selected key; `key_user` is the key's user when the key still
/// exists (a reaped key's rows are found by its id alone).
async fn attention_rows(
    conn: &mut AsyncPgConnection,
    selector: &KeySelector,
    key_user: Option<i64>,
) -> Result<Vec<AttentionRow>, AdminError> {
    let query = keys_needing_attention::table
        .select(KeyNeedingAttention::as_select())
        .order((
            keys_needing_attention::recorded_at,
            keys_needing_attention::id,
        ))
        .into_boxed();
    let query = match selector {
        KeySelector::Id(id) => match key_user {
            Some(user_id) => query
                .filter(keys_needing_attention::idempotency_key_id.eq(*id))
                .filter(keys_needing_attention::user_id.eq(user_id)),
            None => query.filter(keys_needing_attention::idempotency_key_id.eq(*id)),
        },
        KeySelector::UserKey { user_id, key } => query
            .filter(keys_needing_attention::user_id.eq(*user_id))
            .filter(keys_needing_attention::idempotency_key.eq(key.as_str())),
    };
    let rows: Vec<KeyNeedingAttention> = query.load(conn).await?;
    super::attention::with_key_state(conn, rows).await
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

async fn ride_details(conn: &mut AsyncPgConnection, ride: Ride) -> Result<RideDetails, AdminError> {
    let staged_jobs = staged_receipt_jobs(conn, ride.id).await?;
    let sent: Option<(DateTime<Utc>, String)> = sent_receipts::table
        .find(ride.id)
        .select((sent_receipts::sent_at, sent_receipts::message_id))
        .first(conn)
        .await
        .optional()?;
    Ok(RideDetails {
        id: ride.id,
        user_id: ride.user_id,
        charge_id: ride.stripe_charge_id,
        amount: ride.amount,
        currency: ride.currency,
        created_at: ride.created_at,
        receipt: ReceiptState {
            staged_jobs,
            sent_at: sent.as_ref().map(|(at, _)| *at),
            sent_message_id: sent.map(|(_, id)| id),
        },
    })
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

/// Loads the key, locking its row when the command is going to change it. A dry run takes no
/// lock: it never delays an api-server phase.
async fn load_key(
    conn: &mut AsyncPgConnection,
    key_id: i64,
    mode: Mode,
) -> Result<(KeyState, DateTime<Utc>), AdminError> {
    let query = idempotency_keys::table
        .find(key_id)
        .select((KeyState::as_select(), now_sql()));
    let found = if mode.applies() {
        query.for_update().first(conn).await.optional()?
    } else {
        query.first(conn).await.optional()?
    };
    found.ok_or_else(|| {
        AdminError::NotFound(format!(
            "no idempotency key with id {key_id} (reaped keys are listed by \
             `workers admin keys needing-attention --all`)"
        ))
    })
}

/// Refuses a live lock unless forced; returns the warning to print when forced.
fn check_lock(
    key: &KeyState,
    now: DateTime<Utc>,
    settings: &AdminSettings,
    force: bool,
    action: &str,
) -> Result<Option<String>, AdminError> {
    let lock_timeout = chrono_duration(settings.lock_timeout);
    let Some(locked_at) = key.locked_at else {
        return Ok(None);
    };
    if !lock_is_live(locked_at, now, settings.lock_timeout) {
        return Ok(None);
    }
    let age = render::duration(now - locked_at);
    let expires = render::time(locked_at + lock_timeout);
    let risk = format!(
        "key {} is locked by an attempt that may still be running: the lock was taken {age} ago \
         and IDEMPOTENCY_LOCK_TIMEOUT_SECS is {}s. Its holder (an api-server request or the \
         completer) may be in the middle of the provider charge; to {action} now would let its \
         result and yours race (its next phase is fenced out and commits nothing, but a charge \
         it has already sent still happens)",
        key.id,
        settings.lock_timeout.as_secs()
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
    let report = super::change_transaction(&mut conn, mode)
        .run(async |conn| {
            bound_waits(conn).await?;
            let (key, now) = load_key(conn, key_id, mode).await?;
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
            if let Some(warning) = check_lock(&key, now, settings, force, "unlock it")? {
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
                let updated = diesel::update(idempotency_keys::table.find(key_id))
                    .filter(idempotency_keys::user_id.eq(key.user_id))
                    .filter(idempotency_keys::recovery_point.ne(RecoveryPoint::Finished))
                    .filter(idempotency_keys::locked_at.is_not_null())
                    .set((
                        idempotency_keys::locked_at.eq(None::<DateTime<Utc>>),
                        idempotency_keys::lock_token.eq(None::<Uuid>),
                    ))
                    .execute(conn)
                    .await?;
                expect_one(updated, "idempotency_keys", key_id)?;
            }
            Ok(report)
        })
        .await?;
    if mode.applies() {
        tracing::info!(key_id, forced = force, "admin: key unlocked");
    }
    Ok(report)
}

/// The arguments of `key finish`.
#[derive(Clone, Debug)]
pub struct FinishRequest {
    pub key_id: i64,
    pub outcome: FinishOutcome,
    pub charge_id: Option<String>,
    pub message: Option<String>,
    pub force: bool,
}

impl FinishRequest {
    fn validate(&self) -> Result<(), AdminError> {
        match self.outcome {
            FinishOutcome::Declined if self.charge_id.is_some() => {
                return Err(AdminError::Invalid(
                    "--charge-id goes only with --outcome succeeded".into(),
                ));
            }
            FinishOutcome::Succeeded if self.message.is_some() => {
                return Err(AdminError::Invalid(
                    "--message goes only with --outcome declined (a success replays the \
                     api-server's own message)"
                        .into(),
                ));
            }
            _ => {}
        }
        if let Some(charge_id) = &self.charge_id {
            let well_formed = charge_id.len() > 3
                && charge_id.len() <= 255
                && charge_id.starts_with("pi_")
                && charge_id
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !well_formed {
                return Err(AdminError::Invalid(format!(
                    "--charge-id {charge_id:?} is not a PaymentIntent id (pi_ followed by letters \
                     and digits)"
                )));
            }
        }
        if let Some(message) = &self.message
            && (message.trim().is_empty()
                || message.chars().count() > 500
                || message.chars().any(char::is_control))
        {
            return Err(AdminError::Invalid(
                "--message must be 1 to 500 printable characters".into(),
            ));
        }
        Ok(())
    }
}

/// `key finish`: stores a final outcome on a stuck key exactly as the api-server's last phase
/// would have, so the client's replay returns it. Also clears the lock and resolves the key's
/// open `keys_needing_attention` rows.
///
/// `stripe` is asked only for a `--charge-id`, which must be provably the ride's charge
/// ([`super::named_charge`]).
pub async fn finish(
    pool: &Pool,
    settings: &AdminSettings,
    stripe: &StripeClient,
    request: &FinishRequest,
    mode: Mode,
) -> Result<ChangeReport, AdminError> {
    request.validate()?;
    let key_id = request.key_id;
    let mut conn = pool.get().await?;
    let report = super::change_transaction(&mut conn, mode)
        .run(async |conn| {
            bound_waits(conn).await?;
            let (key, now) = load_key(conn, key_id, mode).await?;
            if key.recovery_point == RecoveryPoint::Finished {
                return Err(AdminError::Refused(format!(
                    "key {key_id} is already finished (response code {}); its stored outcome is \
                     final and is what the client's replay returns. Nothing to do.",
                    key.response_code.unwrap_or_default()
                )));
            }
            let mut report = ChangeReport::new("key finish", mode, key_id);
            if let Some(warning) = check_lock(&key, now, settings, request.force, "finish it")? {
                report.warnings.push(warning);
            }
            let ride = ride_for_key(conn, &key, mode.applies()).await?;
            let outcome = match request.outcome {
                FinishOutcome::Declined => plan_declined(&key, ride.as_ref(), request)?,
                FinishOutcome::Succeeded => {
                    plan_succeeded(conn, stripe, &key, ride, request, &mut report, mode).await?
                }
            };
            let stored = outcome.to_stored();
            report.changes.push(Change::update(
                "idempotency_keys",
                key_id,
                "recovery_point",
                json!(key.recovery_point),
                json!(RecoveryPoint::Finished),
            ));
            report.changes.push(Change::update(
                "idempotency_keys",
                key_id,
                "response_code",
                Value::Null,
                json!(stored.code),
            ));
            report.changes.push(Change::update(
                "idempotency_keys",
                key_id,
                "response_body",
                Value::Null,
                stored.body.clone(),
            ));
            lock_changes(&mut report, &key);
            let open: Vec<i64> = keys_needing_attention::table
                .filter(keys_needing_attention::idempotency_key_id.eq(key_id))
                .filter(keys_needing_attention::user_id.eq(key.user_id))
                .filter(keys_needing_attention::resolved_at.is_null())
                .order(keys_needing_attention::id)
                .select(keys_needing_attention::id)
                .load(conn)
                .await?;
            for id in &open {
                report.changes.push(Change::update(
                    "keys_needing_attention",
                    *id,
                    "resolved_at",
                    Value::Null,
                    json!("now()"),
                ));
            }
            report.notes.push(format!(
                "a replay will answer: {}",
                render::outcome(&outcome)
            ));
            if mode.applies() {
                finish_as_the_api_server_does(conn, &key, &stored).await?;
                if !open.is_empty() {
                    diesel::update(
                        keys_needing_attention::table
                            .filter(keys_needing_attention::id.eq_any(&open))
                            .filter(keys_needing_attention::user_id.eq(key.user_id))
                            .filter(keys_needing_attention::resolved_at.is_null()),
                    )
                    .set(keys_needing_attention::resolved_at.eq(diesel::dsl::now))
                    .execute(conn)
                    .await?;
                }
            }
            Ok(report)
        })
        .await?;
    if mode.applies() {
        tracing::info!(key_id, outcome = ?request.outcome, forced = request.force, "admin: key finished");
    }
    Ok(report)
}

fn plan_declined(
    key: &KeyState,
    ride: Option<&Ride>,
    request: &FinishRequest,
) -> Result<Outcome, AdminError> {
    if let Some(charge_id) = ride.and_then(|ride| ride.stripe_charge_id.as_deref()) {
        return Err(AdminError::Refused(format!(
            "key {} has a charge recorded on its ride ({charge_id}): the provider accepted the \
             payment, so the key cannot be finished as declined. Finish it with --outcome \
             succeeded (refund at the provider first if the rider must not pay).",
            key.id
        )));
    }
    Ok(Outcome::CardDeclined {
        message: request
            .message
            .clone()
            .unwrap_or_else(|| DEFAULT_DECLINE_MESSAGE.to_owned()),
        decline_code: None,
    })
}

/// Plans (and, when applying, writes) the ride's charge id and the receipt job of a succeeded
/// finish, exactly as the api-server's `charge` and `stage_receipt` phases write them.
async fn plan_succeeded(
    conn: &mut AsyncPgConnection,
    stripe: &StripeClient,
    key: &KeyState,
    ride: Option<Ride>,
    request: &FinishRequest,
    report: &mut ChangeReport,
    mode: Mode,
) -> Result<Outcome, AdminError> {
    let Some(mut ride) = ride else {
        return Err(AdminError::Refused(format!(
            "key {} is at {} and has no ride, so nothing can have been paid for. Finish it with \
             --outcome declined, or unlock it and let the client or the completer run it.",
            key.id, key.recovery_point
        )));
    };
    match (ride.stripe_charge_id.clone(), request.charge_id.clone()) {
        (Some(recorded), Some(given)) if recorded != given => {
            return Err(AdminError::Refused(format!(
                "ride {} already has charge {recorded} recorded; refusing to replace it with \
                 {given}. Omit --charge-id to finish with the recorded charge.",
                ride.id
            )));
        }
        (Some(_), _) => {}
        (None, Some(given)) => {
            let elsewhere: Option<i64> = rides::table
                .filter(rides::stripe_charge_id.eq(&given))
                .select(rides::id)
                .first(conn)
                .await
                .optional()?;
            if let Some(other) = elsewhere {
                return Err(AdminError::Refused(format!(
                    "charge {given} is already recorded on ride {other}; one PaymentIntent pays \
                     for one ride. Check the PaymentIntent's metadata (ride_id) at the provider."
                )));
            }
            super::named_charge::check(conn, stripe, key.id, &ride, &given).await?;
            report.changes.push(Change::update(
                "rides",
                ride.id,
                "stripe_charge_id",
                Value::Null,
                json!(given),
            ));
            if mode.applies() {
                let updated = diesel::update(rides::table.find(ride.id))
                    .filter(rides::user_id.eq(ride.user_id))
                    .filter(rides::stripe_charge_id.is_null())
                    .set(rides::stripe_charge_id.eq(&given))
                    .execute(conn)
                    .await?;
                expect_one(updated, "rides", ride.id)?;
            }
            ride.stripe_charge_id = Some(given);
        }
        (None, None) => {
            return Err(AdminError::Refused(format!(
                "ride {} has no charge recorded. Find the PaymentIntent at the provider (its \
                 idempotency key is {}; metadata ride_id={}, idempotency_key_id={}) and pass it \
                 with --charge-id pi_…. If there is none, the charge never happened: finish with \
                 --outcome declined, or unlock the key so that the charge is retried.",
                ride.id,
                provider_idempotency_key(ride.deployment_id.as_deref(), key.id),
                ride.id,
                key.id
            )));
        }
    }

    // The receipt, staged exactly as `stage_receipt` stages it, unless it already is or was sent.
    let staged = staged_receipt_jobs(conn, ride.id).await?;
    let sent = sent_receipts::table
        .find(ride.id)
        .select(sent_receipts::ride_id)
        .first::<i64>(conn)
        .await
        .optional()?
        .is_some();
    if staged > 0 || sent {
        report.notes.push(format!(
            "no receipt job staged: ride {} already has {}",
            ride.id,
            if sent {
                "a receipt sent".to_owned()
            } else {
                format!("{staged} receipt job(s) staged")
            }
        ));
    } else {
        let job_args = ReceiptJob::from(&ride).to_args();
        let trace_context = json!({});
        let mut change = Change::insert(
            "staged_jobs",
            json!({
                "job_name": ReceiptJob::JOB_NAME,
                "job_args": job_args,
                "trace_context": trace_context,
            }),
        );
        if mode.applies() {
            let id: i64 = diesel::insert_into(staged_jobs::table)
                .values(NewStagedJob {
                    job_name: ReceiptJob::JOB_NAME,
                    job_args: &job_args,
                    trace_context: &trace_context,
                })
                .returning(staged_jobs::id)
                .get_result(conn)
                .await?;
            change.row = Some(id);
        }
        report.changes.push(change);
    }
    Ok(Outcome::ride_created(ride))
}

/// Finishes the key with the api-server's own fenced statement (`contract::key::FinishKey`): this
/// transaction already holds the row lock, so it takes the key's lock over with a token of its own
/// (as a claim takes over an expired lock) and then finishes the key as the holder of that token.
/// The recovery point, the stored outcome and the cleared lock are written by the very statement
/// a declined charge is finished with.
async fn finish_as_the_api_server_does(
    conn: &mut AsyncPgConnection,
    key: &KeyState,
    stored: &StoredResponse,
) -> Result<(), AdminError> {
    let key_id = key.id;
    let token = Uuid::new_v4();
    let taken_over = diesel::update(idempotency_keys::table.find(key_id))
        .filter(idempotency_keys::user_id.eq(key.user_id))
        .filter(idempotency_keys::recovery_point.ne(RecoveryPoint::Finished))
        .set((
            idempotency_keys::locked_at.eq(diesel::dsl::now),
            idempotency_keys::lock_token.eq(token),
        ))
        .execute(conn)
        .await?;
    expect_one(taken_over, "idempotency_keys", key_id)?;
    let finished = prepared::<FinishKey, _>(|q| {
        q.bind::<BigInt, _>(key_id)
            .bind::<sql_types::Uuid, _>(token)
            .bind::<BigInt, _>(key.user_id)
            .bind::<Integer, _>(stored.code)
            .bind::<Jsonb, _>(&stored.body)
    })
    .get_results::<KeyMoved>(conn)
    .await?;
    expect_one(finished.len(), "idempotency_keys", key_id)
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

impl KeyReport {
    /// The report as text, for a terminal.
    pub fn render(&self) -> String {
        let now = self.now;
        let mut out = String::new();
        match &self.key {
            None => {
                let _ = writeln!(
                    out,
                    "The idempotency key no longer exists (reaped). Attention rows about it follow."
                );
            }
            Some(key) => {
                let _ = writeln!(out, "Idempotency key {}", key.id);
                let line = |out: &mut String, label: &str, value: String| {
                    let _ = writeln!(out, "  {label:<16}{value}");
                };
                line(
                    &mut out,
                    "user",
                    format!(
                        "{} ({})",
                        key.user_id,
                        key.user_email.as_deref().unwrap_or("unknown")
                    ),
                );
                line(&mut out, "key", key.idempotency_key.clone());
                line(
                    &mut out,
                    "request",
                    format!(
                        "{} {} {}",
                        key.request_method, key.request_path, key.request_params
                    ),
                );
                line(&mut out, "created_at", relative(key.created_at, now));
                line(
                    &mut out,
                    "expires_at",
                    optional_time(key.expires_at, now, "never"),
                );
                line(&mut out, "last_run_at", relative(key.last_run_at, now));
                line(&mut out, "recovery_point", key.recovery_point.to_string());
                let lock = match key.lock.locked_at {
                    None => "none".to_owned(),
                    Some(locked_at) => format!(
                        "held since {}, {} (expires {})",
                        relative(locked_at, now),
                        if key.lock.live {
                            "LIVE: its holder may still be running"
                        } else {
                            "expired: abandoned, may be taken over"
                        },
                        optional_time(key.lock.expires_at, now, "?")
                    ),
                };
                line(&mut out, "lock", lock);
                line(
                    &mut out,
                    "provider key",
                    match &key.provider_idempotency_key {
                        Some(provider_key) => {
                            format!("{provider_key} (the charge's idempotency key at the provider)")
                        }
                        None => "none yet (no ride, so no charge)".to_owned(),
                    },
                );
                line(
                    &mut out,
                    "completer",
                    format!(
                        "{} attempt(s), next attempt {}, gave up {}",
                        key.completer.attempts,
                        optional_time(key.completer.next_attempt_at, now, "-"),
                        optional_time(key.completer.gave_up_at, now, "no")
                    ),
                );
                let stored = match &key.stored_outcome {
                    None => "none (unfinished)".to_owned(),
                    Some(stored) => match &stored.outcome {
                        Some(decoded) => {
                            format!("code {}: {}", stored.response_code, outcome(decoded))
                        }
                        None => format!(
                            "code {}: UNDECODABLE body {} (a replay fails with INTERNAL)",
                            stored.response_code,
                            stored
                                .undecodable
                                .as_ref()
                                .map(ToString::to_string)
                                .unwrap_or_default()
                        ),
                    },
                };
                line(&mut out, "stored outcome", stored);
            }
        }
        match &self.ride {
            None if self.key.is_some() => {
                let _ = writeln!(out, "Ride: none");
            }
            None => {}
            Some(ride) => {
                let _ = writeln!(out, "Ride {}", ride.id);
                let _ = writeln!(
                    out,
                    "  {:<16}{}",
                    "charge_id",
                    ride.charge_id.as_deref().unwrap_or("none")
                );
                let _ = writeln!(out, "  {:<16}{} {}", "amount", ride.amount, ride.currency);
                let _ = writeln!(
                    out,
                    "  {:<16}{}",
                    "created_at",
                    relative(ride.created_at, now)
                );
                let receipt = match (&ride.receipt.sent_at, ride.receipt.staged_jobs) {
                    (Some(sent_at), _) => format!(
                        "sent {} (message {})",
                        relative(*sent_at, now),
                        ride.receipt.sent_message_id.as_deref().unwrap_or("?")
                    ),
                    (None, 0) => "not staged, not sent (in flight in RabbitMQ, dead-lettered, or \
                                  never staged)"
                        .to_owned(),
                    (None, staged) => format!("{staged} job(s) staged, not yet published"),
                };
                let _ = writeln!(out, "  {:<16}{receipt}", "receipt");
            }
        }
        if self.attention.is_empty() {
            let _ = writeln!(out, "Keys needing attention: none");
        } else {
            let _ = writeln!(out, "Keys needing attention");
            for row in &self.attention {
                let _ = writeln!(out, "  {}", super::attention::line(row, now));
            }
        }
        out
    }
}
