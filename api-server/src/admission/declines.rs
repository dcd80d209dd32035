//! The decline budget across replicas. A card tester spreads its calls over every api-server
//! behind the load balancer (the HPA keeps 3 to 12), so a budget counted per process would be 3 to
//! 12 times the setting. The count therefore comes from what the database already stores: every
//! fresh `CARD_DECLINED` answer reads the user's declined keys within the window
//! (`idempotency_keys_declines_by_user`, a partial index of declined keys only, so the read
//! touches at most `budget` index entries) and, once the budget is spent, the replica refuses the
//! user's new keys from memory until the window frees a place.
//!
//! **Cost and bound.** One indexed read per fresh decline (legitimate riders rarely decline; a
//! tester pays for its own), none for anything else. A replica learns that a budget is spent at
//! its own next decline for that user, so a tester gets at most `budget + replicas - 1` declines
//! per window.

use std::time::Duration;

use diesel::{
    QueryableByName,
    sql_types::{BigInt, Double},
};
use diesel_async::RunQueryDsl;
use schema::{Pool, store::StoreError};

use crate::limits::DECLINE_WINDOW;

/// If `user_id` has `budget` or more declined keys within the window: how long until the oldest
/// of the newest `budget` leaves it, and the budget has a place again.
pub async fn budget_spent_for(
    pool: &Pool,
    user_id: i64,
    budget: u32,
) -> Result<Option<Duration>, StoreError> {
    #[derive(QueryableByName)]
    struct Spent {
        #[diesel(sql_type = Double)]
        frees_in_secs: f64,
    }
    let mut conn = pool.get().await.map_err(StoreError::Unavailable)?;
    let spent: Option<Spent> = diesel::sql_query(
        "SELECT EXTRACT(EPOCH FROM last_run_at + make_interval(secs => $2) - now())::float8 \
         AS frees_in_secs \
         FROM idempotency_keys \
         WHERE user_id = $1 AND response_body ->> 'outcome' = 'card_declined' \
           AND last_run_at > now() - make_interval(secs => $2) \
         ORDER BY last_run_at DESC OFFSET $3 LIMIT 1",
    )
    .bind::<BigInt, _>(user_id)
    .bind::<Double, _>(DECLINE_WINDOW.as_secs_f64())
    .bind::<BigInt, _>(i64::from(budget.saturating_sub(1)))
    .get_results(&mut conn)
    .await
    .map_err(StoreError::from)?
    .into_iter()
    .next();
    Ok(spent.map(|spent| {
        Duration::try_from_secs_f64(spent.frees_in_secs.max(0.0)).unwrap_or(DECLINE_WINDOW)
    }))
}
