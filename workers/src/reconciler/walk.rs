//! The ledger walk: what the provider and the database say about one slice of a window, gathered
//! into a [`Ledger`] for [`classify`](super::classify). The provider's side is every PaymentIntent
//! created in the slice (listed, paged, by the pass), or the pending ones of earlier passes no
//! slice listed; the database's side is the rides created in the slice, the rides those
//! PaymentIntents record or name, and the keys of both.

use std::collections::{HashMap, HashSet};

use contract::ownership;
use diesel::{ExpressionMethods, QueryDsl, SelectableHelper};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use provider::{ListedIntent, StripeClient};
use schema::{
    RecoveryPoint,
    schema::{idempotency_keys, rides, users},
};

use super::{
    ReconcileError,
    classify::{KeyFacts, KeyOwner, Ledger, RideFacts},
    window::Window,
};

/// The ledger of `intents` (one slice's listing, or pending charges no slice listed) and, with
/// `window`, of the rides created in it that record a charge.
pub(super) async fn walk(
    conn: &mut AsyncPgConnection,
    stripe: &StripeClient,
    window: Option<&Window>,
    intents: Vec<ListedIntent>,
) -> Result<Ledger, ReconcileError> {
    let window_rides: Vec<RideFacts> = match window {
        Some(window) => {
            rides::table
                .filter(rides::created_at.ge(window.from))
                .filter(rides::created_at.lt(window.until))
                .filter(rides::stripe_charge_id.is_not_null())
                .select(RideFacts::as_select())
                .load(conn)
                .await?
        }
        None => Vec::new(),
    };
    let mut ledger = Ledger {
        deployment_id: stripe.deployment_id().as_str().to_owned(),
        rides: related_rides(conn, &intents).await?,
        intents,
        window_rides,
        ..Ledger::default()
    };
    for ride in &ledger.window_rides {
        ledger.rides.insert(ride.id, ride.clone());
    }
    (ledger.keys, ledger.owners) = keys(conn, &ledger).await?;
    let owners: Vec<i64> = ledger.owners.values().map(|owner| owner.user_id).collect();
    ledger.customers = users::table
        .filter(users::id.eq_any(&owners))
        .select((users::id, users::stripe_customer_id))
        .load::<(i64, String)>(conn)
        .await?
        .into_iter()
        .collect();
    let known: HashSet<&str> = ledger.intents.iter().map(|i| i.id.as_str()).collect();
    let unlisted: Vec<String> = ledger
        .window_rides
        .iter()
        .filter_map(|ride| ride.stripe_charge_id.clone())
        .filter(|id| !known.contains(id.as_str()))
        .collect();
    // Rides near the window's end whose charge was made after it (a retried charge), or a charge
    // the provider does not have: asked one by one, there are few.
    for id in unlisted {
        let intent = stripe.retrieve_payment_intent(&id).await?;
        ledger.looked_up.insert(id, intent);
    }
    Ok(ledger)
}

/// The rides that record one of `intents` or whose key their metadata names.
async fn related_rides(
    conn: &mut AsyncPgConnection,
    intents: &[ListedIntent],
) -> Result<HashMap<i64, RideFacts>, ReconcileError> {
    let ids: Vec<&str> = intents.iter().map(|intent| intent.id.as_str()).collect();
    let named: Vec<i64> = intents
        .iter()
        .filter_map(|intent| ownership::key_id(&intent.metadata))
        .collect();
    let recording: Vec<RideFacts> = rides::table
        .filter(rides::stripe_charge_id.eq_any(&ids))
        .select(RideFacts::as_select())
        .load(conn)
        .await?;
    let named: Vec<RideFacts> = rides::table
        .filter(rides::idempotency_key_id.eq_any(&named))
        .select(RideFacts::as_select())
        .load(conn)
        .await?;
    Ok(recording
        .into_iter()
        .chain(named)
        .map(|ride| (ride.id, ride))
        .collect())
}

/// A key's row as the walk reads it.
type KeyRowFacts = (
    i64,
    RecoveryPoint,
    Option<chrono::DateTime<chrono::Utc>>,
    i64,
);

/// The keys (still existing) of the ledger's rides and of the intents' metadata: whether each is
/// live, and whose it is.
async fn keys(
    conn: &mut AsyncPgConnection,
    ledger: &Ledger,
) -> Result<(HashMap<i64, KeyFacts>, HashMap<i64, KeyOwner>), ReconcileError> {
    let ids: Vec<i64> = ledger
        .rides
        .values()
        .filter_map(|ride| ride.idempotency_key_id)
        .chain(
            ledger
                .intents
                .iter()
                .filter_map(|intent| ownership::key_id(&intent.metadata)),
        )
        .collect();
    let rows: Vec<KeyRowFacts> = idempotency_keys::table
        .filter(idempotency_keys::id.eq_any(&ids))
        .select((
            idempotency_keys::id,
            idempotency_keys::recovery_point,
            idempotency_keys::completer_gave_up_at,
            idempotency_keys::user_id,
        ))
        .load(conn)
        .await?;
    let mut facts = HashMap::new();
    let mut owners = HashMap::new();
    for (id, recovery_point, gave_up_at, user_id) in rows {
        facts.insert(
            id,
            KeyFacts {
                recovery_point,
                completer_gave_up: gave_up_at.is_some(),
            },
        );
        owners.insert(id, KeyOwner { user_id });
    }
    Ok((facts, owners))
}
