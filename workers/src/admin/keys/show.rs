//! `workers admin key show`: everything known about one key, read-only.

use std::fmt::Write as _;

use chrono::{DateTime, Utc};
use contract::{
    Outcome,
    key::{chrono_duration, provider_idempotency_key},
};
use diesel::{ExpressionMethods, OptionalExtension, QueryDsl, SelectableHelper};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use schema::{
    Pool, RecoveryPoint,
    models::{KeyNeedingAttention, Ride},
    schema::{idempotency_keys, keys_needing_attention, sent_receipts, users},
};
use serde::Serialize;
use serde_json::Value;

use crate::admin::render::{optional_time, outcome, relative};
use crate::admin::{AdminError, AdminSettings, attention::AttentionRow, bound_waits};
use crate::redact;

use super::{KeyState, LockVerdict, lock_verdict, now_sql, ride_for_key, staged_receipt_jobs};

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
    /// When the reaper retires it: created_at + the key TTL (`contract::key::key_ttl`).
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
    /// Not to be taken over: younger than IDEMPOTENCY_LOCK_TIMEOUT_SECS, and its holder alive
    /// or the key too old to take over at once.
    pub live: bool,
    /// The liveness session of the holder the lock names: `alive`, `gone`, or `none` (no holder
    /// named: an operator's or an older server's lock, judged by the timeout alone).
    pub holder: &'static str,
    /// Why a lock that is not live may be taken over: `lock_expired` or `holder_gone`.
    pub takeover: Option<&'static str>,
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
                    now: crate::admin::db_now(conn).await?,
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
            let verdict = lock_verdict(conn, key.id, settings.lock_rule).await?;
            let mut details = key_details(&key, verdict, user_email, settings);
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
    verdict: LockVerdict,
    user_email: Option<String>,
    settings: &AdminSettings,
) -> KeyDetails {
    let lock_timeout = chrono_duration(settings.lock_rule.lock_timeout);
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
            live: verdict.state.is_live(),
            takeover: verdict.state.takeover_reason(),
            holder: match verdict.holder_alive {
                Some(true) => "alive",
                Some(false) => "gone",
                None => "none",
            },
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
    crate::admin::attention::with_key_state(conn, rows).await
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

impl KeyReport {
    /// The report as text, for a terminal.
    pub fn render(&self) -> String {
        let mut out = String::new();
        match &self.key {
            None => {
                let _ = writeln!(
                    out,
                    "The idempotency key no longer exists (reaped). Attention rows about it follow."
                );
            }
            Some(key) => key.render(&mut out, self.now),
        }
        match &self.ride {
            None if self.key.is_some() => {
                let _ = writeln!(out, "Ride: none");
            }
            None => {}
            Some(ride) => ride.render(&mut out, self.now),
        }
        if self.attention.is_empty() {
            let _ = writeln!(out, "Keys needing attention: none");
        } else {
            let _ = writeln!(out, "Keys needing attention");
            for row in &self.attention {
                let _ = writeln!(out, "  {}", crate::admin::attention::line(row, self.now));
            }
        }
        out
    }
}

/// One `label  value` line of a section.
fn line(out: &mut String, label: &str, value: String) {
    let _ = writeln!(out, "  {label:<16}{value}");
}

impl KeyDetails {
    fn render(&self, out: &mut String, now: DateTime<Utc>) {
        let key = self;
        let _ = writeln!(out, "Idempotency key {}", key.id);
        line(
            out,
            "user",
            format!(
                "{} ({})",
                key.user_id,
                key.user_email.as_deref().unwrap_or("unknown")
            ),
        );
        line(out, "key", key.idempotency_key.clone());
        line(
            out,
            "request",
            format!(
                "{} {} {}",
                key.request_method, key.request_path, key.request_params
            ),
        );
        line(out, "created_at", relative(key.created_at, now));
        line(
            out,
            "expires_at",
            optional_time(key.expires_at, now, "never"),
        );
        line(out, "last_run_at", relative(key.last_run_at, now));
        line(out, "recovery_point", key.recovery_point.to_string());
        line(out, "lock", key.lock.describe(now));
        line(
            out,
            "provider key",
            match &key.provider_idempotency_key {
                Some(provider_key) => {
                    format!("{provider_key} (the charge's idempotency key at the provider)")
                }
                None => "none yet (no ride, so no charge)".to_owned(),
            },
        );
        line(
            out,
            "completer",
            format!(
                "{} attempt(s), next attempt {}, gave up {}",
                key.completer.attempts,
                optional_time(key.completer.next_attempt_at, now, "-"),
                optional_time(key.completer.gave_up_at, now, "no")
            ),
        );
        let stored = key
            .stored_outcome
            .as_ref()
            .map_or_else(|| "none (unfinished)".to_owned(), StoredOutcome::describe);
        line(out, "stored outcome", stored);
    }
}

impl LockState {
    fn describe(&self, now: DateTime<Utc>) -> String {
        match self.locked_at {
            None => "none".to_owned(),
            Some(locked_at) => format!(
                "held since {}, holder {}, {} (expires {})",
                relative(locked_at, now),
                self.holder,
                match self.takeover {
                    _ if self.live => "LIVE: its holder may still be running",
                    Some("holder_gone") => "holder gone: abandoned, may be taken over",
                    _ => "expired: abandoned, may be taken over",
                },
                optional_time(self.expires_at, now, "?")
            ),
        }
    }
}

impl StoredOutcome {
    fn describe(&self) -> String {
        match &self.outcome {
            Some(decoded) => format!("code {}: {}", self.response_code, outcome(decoded)),
            None => format!(
                "code {}: UNDECODABLE body {} (a replay fails with INTERNAL)",
                self.response_code,
                self.undecodable
                    .as_ref()
                    .map(ToString::to_string)
                    .unwrap_or_default()
            ),
        }
    }
}

impl RideDetails {
    fn render(&self, out: &mut String, now: DateTime<Utc>) {
        let _ = writeln!(out, "Ride {}", self.id);
        line(
            out,
            "charge_id",
            self.charge_id.as_deref().unwrap_or("none").to_owned(),
        );
        line(out, "amount", format!("{} {}", self.amount, self.currency));
        line(out, "created_at", relative(self.created_at, now));
        let receipt = match (&self.receipt.sent_at, self.receipt.staged_jobs) {
            (Some(sent_at), _) => format!(
                "sent {} (message {})",
                relative(*sent_at, now),
                self.receipt.sent_message_id.as_deref().unwrap_or("?")
            ),
            (None, 0) => "not staged, not sent (in flight in RabbitMQ, dead-lettered, or \
                          never staged)"
                .to_owned(),
            (None, staged) => format!("{staged} job(s) staged, not yet published"),
        };
        line(out, "receipt", receipt);
    }
}
