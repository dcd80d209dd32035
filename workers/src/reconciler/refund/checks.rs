//! Before a refund: the finding locked and still refundable, its key not live, and its
//! PaymentIntent proven ours again by the one ownership rule.

use contract::ownership::{self, KeyRecord};
use diesel::{ExpressionMethods, OptionalExtension, QueryDsl};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use provider::StripeClient;
use schema::{
    RecoveryPoint,
    models::ReconciliationFinding,
    schema::{idempotency_keys, rides, users},
};
use serde_json::json;

use crate::admin::{AdminError, Change, Mode};
use crate::reconciler::classify::KeyFacts;

/// Locks the finding (and its ride and key) and checks that refunding it is right.
pub(super) async fn lock_refundable(
    conn: &mut AsyncPgConnection,
    id: i64,
    mode: Mode,
) -> Result<ReconciliationFinding, AdminError> {
    let finding = crate::admin::findings::load(conn, id, mode).await?;
    if let Some(resolved_at) = finding.resolved_at {
        return Err(AdminError::Refused(format!(
            "finding {id} was resolved at {} ({}); nothing is refunded",
            crate::admin::render::time(resolved_at),
            finding.resolution.as_deref().unwrap_or("-")
        )));
    }
    if !finding.kind.is_refundable() {
        return Err(AdminError::Refused(format!(
            "finding {id} is {}: only unrecorded_charge findings (charges proven ours that no \
             ride stands for) are refunded; settle others at the provider and `resolve` them",
            finding.kind
        )));
    }
    let ride: Option<(Option<i64>, Option<String>)> = match finding.ride_id {
        Some(ride_id) => {
            let query = rides::table
                .find(ride_id)
                .select((rides::idempotency_key_id, rides::stripe_charge_id));
            if mode.applies() {
                query.for_update().first(conn).await.optional()?
            } else {
                query.first(conn).await.optional()?
            }
        }
        None => None,
    };
    if let Some((_, Some(recorded))) = &ride
        && *recorded == finding.payment_intent_id
    {
        return Err(AdminError::Refused(format!(
            "ride {} now records {recorded}: it is not an unrecorded charge any more; resolve the \
             finding instead",
            finding.ride_id.unwrap_or_default()
        )));
    }
    let key_id = ride
        .and_then(|(key_id, _)| key_id)
        .or(finding.idempotency_key_id);
    if let Some(key_id) = key_id {
        check_key_not_live(conn, key_id, mode).await?;
    }
    Ok(finding)
}

pub(super) async fn check_key_not_live(
    conn: &mut AsyncPgConnection,
    key_id: i64,
    mode: Mode,
) -> Result<(), AdminError> {
    let query = idempotency_keys::table.find(key_id).select((
        idempotency_keys::recovery_point,
        idempotency_keys::completer_gave_up_at,
    ));
    let key: Option<(RecoveryPoint, Option<chrono::DateTime<chrono::Utc>>)> = if mode.applies() {
        query.for_update().first(conn).await.optional()?
    } else {
        query.first(conn).await.optional()?
    };
    let live = key.is_some_and(|(recovery_point, gave_up_at)| {
        KeyFacts {
            recovery_point,
            completer_gave_up: gave_up_at.is_some(),
        }
        .is_live()
    });
    if live {
        return Err(AdminError::Refused(format!(
            "key {key_id} is unfinished and the completer has not given up on it: it may still \
             record this charge (see `workers admin key show --key-id {key_id}`)"
        )));
    }
    Ok(())
}

/// What [`prove_ours`] proved: whose charge it is.
pub(super) struct Proven {
    pub(super) key_id: i64,
    pub(super) ride_id: i64,
    /// The key is not finished: the refund finishes it ([`TOMBSTONE_REFUNDED_KEY`]). A finished
    /// key already has its final outcome (another charge recorded for the ride, a decline an
    /// operator stored) and keeps it.
    pub(super) key_unfinished: bool,
}

impl Proven {
    pub(super) fn tombstone_change(&self, outcome: &str) -> Option<Change> {
        self.key_unfinished.then(|| {
            Change::update(
                "idempotency_keys",
                self.key_id,
                "outcome",
                serde_json::Value::Null,
                json!(outcome),
            )
        })
    }
}

/// The ride as the ownership rule compares it: id, amount, currency, deployment id.
type StoredRide = (i64, i64, String, Option<String>);

/// What the database holds for the key a PaymentIntent names: the key (its user and recovery
/// point), its ride, and its user's provider customer.
struct Stored {
    key: Option<(i64, RecoveryPoint)>,
    ride: Option<StoredRide>,
    customer: Option<String>,
}

impl Stored {
    /// Reads it, locking the key row when applying (`mode`), so it stays so until the refund is
    /// recorded. Nothing for a PaymentIntent that names no key.
    async fn read(
        conn: &mut AsyncPgConnection,
        key_id: Option<i64>,
        mode: Mode,
    ) -> Result<Stored, AdminError> {
        let Some(key_id) = key_id else {
            return Ok(Stored {
                key: None,
                ride: None,
                customer: None,
            });
        };
        let query = idempotency_keys::table
            .find(key_id)
            .select((idempotency_keys::user_id, idempotency_keys::recovery_point));
        let key: Option<(i64, RecoveryPoint)> = if mode.applies() {
            query.for_update().first(conn).await.optional()?
        } else {
            query.first(conn).await.optional()?
        };
        let ride: Option<StoredRide> = rides::table
            .filter(rides::idempotency_key_id.eq(key_id))
            .select((
                rides::id,
                rides::amount,
                rides::currency,
                rides::deployment_id,
            ))
            .first(conn)
            .await
            .optional()?;
        let customer: Option<String> = match &key {
            Some((user_id, _)) => users::table
                .find(user_id)
                .select(users::stripe_customer_id)
                .first(conn)
                .await
                .optional()?,
            None => None,
        };
        Ok(Stored {
            key,
            ride,
            customer,
        })
    }
}

/// Proves the finding's PaymentIntent ours, as it stands now at the provider and in the
/// database (the key row and its ride are locked when applying, so they stay so until the
/// refund is recorded); refuses otherwise.
pub(super) async fn prove_ours(
    conn: &mut AsyncPgConnection,
    stripe: &StripeClient,
    finding: &ReconciliationFinding,
    mode: Mode,
) -> Result<Proven, AdminError> {
    let pi = &finding.payment_intent_id;
    let Some(intent) = stripe.retrieve_payment_intent(pi).await? else {
        return Err(AdminError::Refused(format!(
            "the provider has no PaymentIntent {pi}; nothing is refunded"
        )));
    };
    // The refund caps count the finding's amount: never refund more than it says.
    if finding.provider_amount != Some(intent.amount) {
        return Err(AdminError::Refused(format!(
            "PaymentIntent {pi} is of {} now, the finding says {:?}: nothing is refunded",
            intent.amount, finding.provider_amount
        )));
    }
    let key_id = ownership::key_id(&intent.metadata);
    let Stored {
        key,
        ride,
        customer,
    } = Stored::read(conn, key_id, mode).await?;
    let record = match (key_id, &key, &ride, &customer) {
        (
            Some(key_id),
            Some(_),
            Some((ride_id, amount, currency, deployment_id)),
            Some(customer),
        ) => Some(KeyRecord {
            key_id,
            deployment_id: deployment_id.as_deref(),
            customer,
            ride_id: *ride_id,
            amount: *amount,
            currency,
        }),
        _ => None,
    };
    let facts = crate::reconciler::classify::intent_facts(&intent);
    if let Err(why) = ownership::verdict(stripe.deployment_id().as_str(), &facts, record.as_ref()) {
        return Err(AdminError::Refused(format!(
            "PaymentIntent {pi} is not provably ours ({why}): nothing is refunded; check it at the \
             provider and `resolve` the finding"
        )));
    }
    if let (Some(named), Some((ride_id, _, _, _))) = (finding.ride_id, &ride)
        && named != *ride_id
    {
        return Err(AdminError::Refused(format!(
            "finding {} names ride {named}, but PaymentIntent {pi} is the charge of ride \
             {ride_id}; nothing is refunded",
            finding.id
        )));
    }
    match (key_id, key, ride) {
        (Some(key_id), Some((_, recovery_point)), Some((ride_id, _, _, _))) => Ok(Proven {
            key_id,
            ride_id,
            key_unfinished: recovery_point != RecoveryPoint::Finished,
        }),
        // The verdict above needs all three.
        _ => Err(AdminError::Internal(format!(
            "PaymentIntent {pi} was proven ours without a key"
        ))),
    }
}
