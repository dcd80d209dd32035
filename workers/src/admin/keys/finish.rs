//! `workers admin key finish`: stores a final outcome on a stuck key, as the api-server's last
//! phase would have.

use contract::{
    BackgroundJob, JobToStage, Outcome, ReceiptJob, StoredResponse,
    key::provider_idempotency_key,
    writes::{ChargeRecord, FinishKey, KeyFence, KeyFinish, RecordCharge},
};
use diesel::{ExpressionMethods, OptionalExtension, QueryDsl};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use provider::StripeClient;
use schema::{
    Pool, RecoveryPoint,
    models::Ride,
    schema::{idempotency_keys, keys_needing_attention, rides, sent_receipts},
};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::admin::{
    AdminError, AdminSettings, Change, ChangeReport, FinishOutcome, Mode, bound_waits, render,
};

use super::{
    KeyState, check_lock, expect_one, load_key, lock_changes, ride_for_key, staged_receipt_jobs,
};

/// The decline message a replay returns when the operator gives none (Stripe's generic text).
pub const DEFAULT_DECLINE_MESSAGE: &str = "Your card was declined.";

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
/// ([`crate::admin::named_charge`]).
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
    let report = crate::admin::change_transaction(&mut conn, mode)
        .run(async |conn| {
            bound_waits(conn).await?;
            let (key, now, verdict) = load_key(conn, key_id, mode, settings.lock_rule).await?;
            if key.recovery_point == RecoveryPoint::Finished {
                return Err(AdminError::Refused(format!(
                    "key {key_id} is already finished (response code {}); its stored outcome is \
                     final and is what the client's replay returns. Nothing to do.",
                    key.response_code.unwrap_or_default()
                )));
            }
            let mut report = ChangeReport::new("key finish", mode, key_id);
            if let Some(warning) =
                check_lock(&key, verdict, now, settings, request.force, "finish it")?
            {
                report.warnings.push(warning);
            }
            let ride = ride_for_key(conn, &key, mode.applies()).await?;
            let (outcome, charge) = match request.outcome {
                FinishOutcome::Declined => (plan_declined(&key, ride.as_ref(), request)?, None),
                FinishOutcome::Succeeded => {
                    let (outcome, charge) =
                        plan_succeeded(conn, stripe, &key, ride, request, &mut report).await?;
                    (outcome, Some(charge))
                }
            };
            let stored = outcome.to_stored();
            finished_key_changes(&mut report, &key, &stored);
            let open = open_attention_rows(conn, &key, &mut report).await?;
            report.notes.push(format!(
                "a replay will answer: {}",
                render::outcome(&outcome)
            ));
            if mode.applies() {
                finish_as_the_api_server_does(conn, &key, stored, charge).await?;
                resolve_attention_rows(conn, &key, &open).await?;
            }
            Ok(report)
        })
        .await?;
    if mode.applies() {
        tracing::info!(key_id, outcome = ?request.outcome, forced = request.force, "admin: key finished");
    }
    Ok(report)
}

/// The key finished with `stored` and unlocked, as the report shows it.
fn finished_key_changes(report: &mut ChangeReport, key: &KeyState, stored: &StoredResponse) {
    let update = |column, from, to| Change::update("idempotency_keys", key.id, column, from, to);
    report.changes.push(update(
        "recovery_point",
        json!(key.recovery_point),
        json!(RecoveryPoint::Finished),
    ));
    report
        .changes
        .push(update("response_code", Value::Null, json!(stored.code)));
    report
        .changes
        .push(update("response_body", Value::Null, stored.body.to_value()));
    lock_changes(report, key);
}

/// The key's open `keys_needing_attention` rows, which finishing it resolves (in the report).
async fn open_attention_rows(
    conn: &mut AsyncPgConnection,
    key: &KeyState,
    report: &mut ChangeReport,
) -> Result<Vec<i64>, AdminError> {
    let open: Vec<i64> = keys_needing_attention::table
        .filter(keys_needing_attention::idempotency_key_id.eq(key.id))
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
    Ok(open)
}

async fn resolve_attention_rows(
    conn: &mut AsyncPgConnection,
    key: &KeyState,
    open: &[i64],
) -> Result<(), AdminError> {
    if !open.is_empty() {
        diesel::update(
            keys_needing_attention::table
                .filter(keys_needing_attention::id.eq_any(open))
                .filter(keys_needing_attention::user_id.eq(key.user_id))
                .filter(keys_needing_attention::resolved_at.is_null()),
        )
        .set(keys_needing_attention::resolved_at.eq(diesel::dsl::now))
        .execute(conn)
        .await?;
    }
    Ok(())
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

/// What a succeeded finish records with the api-server's own statement: the ride's charge id
/// and its receipt job (`None` when one is already staged or sent).
struct ChargeToRecord {
    ride_id: i64,
    charge_id: String,
    receipt: Option<JobToStage>,
}

/// Plans the ride's charge id and the receipt job of a succeeded finish, which the api-server's
/// `ride_created` statement then writes ([`finish_as_the_api_server_does`]).
async fn plan_succeeded(
    conn: &mut AsyncPgConnection,
    stripe: &StripeClient,
    key: &KeyState,
    ride: Option<Ride>,
    request: &FinishRequest,
    report: &mut ChangeReport,
) -> Result<(Outcome, ChargeToRecord), AdminError> {
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
            check_named_charge(conn, stripe, key, &ride, &given, report).await?;
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

    let charge = ChargeToRecord {
        ride_id: ride.id,
        charge_id: ride.stripe_charge_id.clone().unwrap_or_default(),
        receipt: receipt_unless_done(conn, &ride, report).await?,
    };
    Ok((Outcome::ride_created(ride), charge))
}

/// Checks `given`, a PaymentIntent the operator named, before it is recorded as the ride's
/// charge: it must be proven the ride's ([`crate::admin::named_charge`]) and recorded on no
/// other ride.
async fn check_named_charge(
    conn: &mut AsyncPgConnection,
    stripe: &StripeClient,
    key: &KeyState,
    ride: &Ride,
    given: &str,
    report: &mut ChangeReport,
) -> Result<(), AdminError> {
    let elsewhere: Option<i64> = rides::table
        .filter(rides::stripe_charge_id.eq(given))
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
    crate::admin::named_charge::check(conn, stripe, key.id, ride, given).await?;
    report.changes.push(Change::update(
        "rides",
        ride.id,
        "stripe_charge_id",
        Value::Null,
        json!(given),
    ));
    Ok(())
}

/// The receipt job of the charged `ride`, as the `ride_created` phase stages it, unless one is
/// already staged or was sent.
async fn receipt_unless_done(
    conn: &mut AsyncPgConnection,
    ride: &Ride,
    report: &mut ChangeReport,
) -> Result<Option<JobToStage>, AdminError> {
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
        return Ok(None);
    }
    let job = ReceiptJob::from(ride).staged();
    report.changes.push(Change::insert(
        "staged_jobs",
        json!({
            "job_name": job.job_name,
            "job_args": job.job_args.to_value(),
            "trace_context": job.trace_context.to_value(),
        }),
    ));
    Ok(Some(job))
}

/// Finishes the key with the api-server's own fenced statements: [`RecordCharge`] for a
/// succeeded finish (the charge on the ride, the receipt staged, the key finished), as phase
/// `ride_created` runs it, or [`FinishKey`] as a declined charge is finished. This transaction
/// already holds the row lock, so it takes the key's lock over with a token of its own (as a
/// claim takes over an expired lock) and then writes as the holder of that token.
async fn finish_as_the_api_server_does(
    conn: &mut AsyncPgConnection,
    key: &KeyState,
    outcome: StoredResponse,
    charge: Option<ChargeToRecord>,
) -> Result<(), AdminError> {
    let key_id = key.id;
    let token = Uuid::new_v4();
    let taken_over = diesel::update(idempotency_keys::table.find(key_id))
        .filter(idempotency_keys::user_id.eq(key.user_id))
        .filter(idempotency_keys::recovery_point.ne(RecoveryPoint::Finished))
        .set((
            idempotency_keys::locked_at.eq(diesel::dsl::now),
            idempotency_keys::lock_token.eq(token),
            // An operator has no liveness session: this lock is judged by the timeout alone.
            idempotency_keys::lock_holder.eq(None::<i64>),
        ))
        .execute(conn)
        .await?;
    expect_one(taken_over, "idempotency_keys", key_id)?;
    let fence = KeyFence {
        key_id,
        user_id: key.user_id,
        token,
    };
    let finished = match charge {
        Some(charge) => {
            let record = ChargeRecord {
                fence,
                from: key.recovery_point,
                ride_id: charge.ride_id,
                charge_id: charge.charge_id,
                receipt: charge.receipt,
                outcome,
            };
            RecordCharge::run(conn, &[record]).await?
        }
        None => FinishKey::run(conn, &[KeyFinish { fence, outcome }]).await?,
    };
    expect_one(
        finished.into_iter().filter(|moved| *moved).count(),
        "idempotency_keys",
        key_id,
    )
}
