//! The statements of a batch of receipts: one each, over arrays, for the batch's rides, its
//! claims, its already-sent rides and its records, as the api-server batches its phases (a
//! round trip per statement instead of one per receipt). Each keeps the meaning of its
//! one-receipt counterpart in [`super::claim`].

use std::{collections::HashMap, time::Duration};

use diesel::{
    ExpressionMethods, QueryDsl, QueryableByName,
    sql_types::{Array, BigInt, Double, Integer, Text},
};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use schema::schema::{rides, users};

use super::{claim::Claim, send::RideRow};

#[derive(QueryableByName)]
struct Taken {
    #[diesel(sql_type = BigInt)]
    ride_id: i64,
    #[diesel(sql_type = Integer)]
    attempts: i32,
}

#[derive(QueryableByName)]
struct RideId {
    #[diesel(sql_type = BigInt)]
    ride_id: i64,
}

/// The rides (with their riders' addresses) of `ride_ids`, by id.
pub(super) async fn rides_of(
    conn: &mut AsyncPgConnection,
    ride_ids: &[i64],
) -> Result<HashMap<i64, RideRow>, diesel::result::Error> {
    let rows: Vec<(i64, RideRow)> = rides::table
        .inner_join(users::table)
        .filter(rides::id.eq_any(ride_ids))
        .select((
            rides::id,
            (
                rides::user_id,
                rides::amount,
                rides::currency,
                rides::stripe_charge_id,
                rides::created_at,
                users::email,
            ),
        ))
        .load(conn)
        .await?;
    Ok(rows.into_iter().collect())
}

/// Takes the claims on `wanted` (ride id, message id; one entry per ride) that nobody holds or
/// whose holder's lease ran out: the claims taken. Autocommit, as the single claim: every claim
/// is durable before any of the batch's mail leaves. The rides are inserted in id order, so two
/// workers whose batches overlap lock them in the same order and cannot deadlock.
pub(super) async fn take_all(
    conn: &mut AsyncPgConnection,
    wanted: &[(i64, &str)],
    lease: Duration,
) -> Result<Vec<Claim>, diesel::result::Error> {
    let ride_ids: Vec<i64> = wanted.iter().map(|(ride_id, _)| *ride_id).collect();
    let message_ids: Vec<&str> = wanted.iter().map(|(_, message_id)| *message_id).collect();
    let deadline = Claim::deadline_from_now(lease);
    let taken: Vec<Taken> = diesel::sql_query(
        "INSERT INTO receipt_claims (ride_id, message_id, claimed_until) \
         SELECT ride_id, message_id, now() + make_interval(secs => $3) \
           FROM unnest($1::bigint[], $2::text[]) AS wanted(ride_id, message_id) \
          ORDER BY ride_id \
         ON CONFLICT (ride_id) DO UPDATE \
            SET attempts = receipt_claims.attempts + 1, \
                claimed_until = EXCLUDED.claimed_until, \
                message_id = EXCLUDED.message_id \
          WHERE receipt_claims.claimed_until <= now() \
         RETURNING ride_id, attempts",
    )
    .bind::<Array<BigInt>, _>(&ride_ids)
    .bind::<Array<Text>, _>(&message_ids)
    .bind::<Double, _>(lease.as_secs_f64())
    .load(conn)
    .await?;
    let message_of: HashMap<i64, &str> = wanted.iter().copied().collect();
    Ok(taken
        .into_iter()
        .map(|Taken { ride_id, attempts }| Claim {
            ride_id,
            message_id: message_of
                .get(&ride_id)
                .copied()
                .unwrap_or_default()
                .to_owned(),
            attempts,
            deadline,
        })
        .collect())
}

/// The rides of `claims` already recorded as sent; their claims are dropped in the same
/// statement (duplicates: nothing to mail). A statement of its own after the claims: its
/// snapshot sees a record committed while a claim waited for the row it replaced.
pub(super) async fn drop_sent(
    conn: &mut AsyncPgConnection,
    claims: &[&Claim],
) -> Result<Vec<i64>, diesel::result::Error> {
    let ride_ids: Vec<i64> = claims.iter().map(|claim| claim.ride_id).collect();
    let attempts: Vec<i32> = claims.iter().map(|claim| claim.attempts).collect();
    let sent: Vec<RideId> = diesel::sql_query(
        "WITH sent AS (SELECT ride_id FROM sent_receipts WHERE ride_id = ANY($1)), \
              dropped AS ( \
                DELETE FROM receipt_claims c \
                 USING unnest($1::bigint[], $2::int[]) AS mine(ride_id, attempts) \
                 WHERE c.ride_id = mine.ride_id AND c.attempts = mine.attempts \
                   AND c.ride_id IN (SELECT ride_id FROM sent)) \
         SELECT ride_id FROM sent",
    )
    .bind::<Array<BigInt>, _>(&ride_ids)
    .bind::<Array<Integer>, _>(&attempts)
    .load(conn)
    .await?;
    Ok(sent.into_iter().map(|row| row.ride_id).collect())
}

/// Records the mailed receipts of `claims` and releases their claims, in one statement (so one
/// transaction, as the single record's): the rides whose claim was still this attempt's.
pub(super) async fn record_all(
    conn: &mut AsyncPgConnection,
    claims: &[&Claim],
    recorded_via: &str,
) -> Result<Vec<i64>, diesel::result::Error> {
    let ride_ids: Vec<i64> = claims.iter().map(|claim| claim.ride_id).collect();
    let message_ids: Vec<&str> = claims
        .iter()
        .map(|claim| claim.message_id.as_str())
        .collect();
    let attempts: Vec<i32> = claims.iter().map(|claim| claim.attempts).collect();
    let released: Vec<RideId> = diesel::sql_query(
        "WITH mine AS ( \
           SELECT * FROM unnest($1::bigint[], $2::text[], $3::int[]) \
             AS mine(ride_id, message_id, attempts)), \
              recorded AS ( \
                INSERT INTO sent_receipts (ride_id, message_id, recorded_via) \
                SELECT ride_id, message_id, $4 FROM mine ORDER BY ride_id \
                ON CONFLICT DO NOTHING) \
         DELETE FROM receipt_claims c USING mine \
          WHERE c.ride_id = mine.ride_id AND c.attempts = mine.attempts \
         RETURNING c.ride_id",
    )
    .bind::<Array<BigInt>, _>(&ride_ids)
    .bind::<Array<Text>, _>(&message_ids)
    .bind::<Array<Integer>, _>(&attempts)
    .bind::<Text, _>(recorded_via)
    .load(conn)
    .await?;
    Ok(released.into_iter().map(|row| row.ride_id).collect())
}
