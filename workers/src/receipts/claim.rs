//! The claim on a ride's receipt: a `receipt_claims` row committed before any SMTP traffic,
//! with an attempt count that fences attempts and a lease that makes a duplicate wait.

use std::time::Duration;

use diesel::{
    ExpressionMethods, OptionalExtension, QueryDsl, QueryableByName,
    sql_types::{BigInt, Double, Integer, Text},
};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use schema::{
    models::NewSentReceipt,
    schema::{receipt_claims, sent_receipts},
};
use tokio_util::sync::CancellationToken;

use super::{HandleError, ReceiptWorker};

impl ReceiptWorker {
    /// Claims the ride's receipt, waiting out another attempt's lease. `None` if shutdown came
    /// first.
    pub(super) async fn claim(
        &self,
        ride_id: i64,
        message_id: &str,
        shutdown: &CancellationToken,
    ) -> Result<Option<Claim>, HandleError> {
        loop {
            let wait = {
                let mut conn = self.pool.get().await?;
                match Claim::take(&mut conn, ride_id, message_id, self.config.claim_lease).await? {
                    Ok(claim) => return Ok(Some(claim)),
                    Err(wait) => wait,
                }
            };
            if shutdown.is_cancelled() {
                return Ok(None);
            }
            tracing::info!(
                ride_id,
                ?wait,
                "another attempt holds this receipt; waiting for it"
            );
            // A little past the lease's end, so the claim has lapsed when we look again.
            crate::worker_loop::sleep(
                shutdown,
                wait.min(self.config.claim_lease) + Duration::from_millis(20),
            )
            .await;
        }
    }

    /// Best effort: a lease that is not ended here simply runs out.
    pub(super) async fn end_lease(&self, claim: &Claim) {
        if let Ok(mut conn) = self.pool.get().await
            && let Err(error) = claim.end_lease(&mut conn).await
        {
            tracing::warn!(error = %error, ride_id = claim.ride_id, "could not end a receipt claim's lease");
        }
    }
}

/// One attempt's claim on a ride's receipt. `attempts` is its fencing token: a later attempt
/// that took the claim over has a higher count, and this one can no longer record or drop it.
#[derive(Debug)]
pub(super) struct Claim {
    pub(super) ride_id: i64,
    pub(super) message_id: String,
    pub(super) attempts: i32,
    /// When the lease ends at the latest, by this process's clock (measured from before the
    /// claim was sent, so never later than the database's `claimed_until`): a conversation
    /// that could outlast it is not started.
    pub(super) deadline: tokio::time::Instant,
}

#[derive(QueryableByName)]
struct Attempts {
    #[diesel(sql_type = Integer)]
    attempts: i32,
}

#[derive(QueryableByName)]
struct Remaining {
    #[diesel(sql_type = Double)]
    secs: f64,
}

impl Claim {
    /// Takes the claim if nobody holds it or its holder's lease ran out; otherwise returns how
    /// long that lease still runs. Autocommit: the claim must be durable before any mail leaves.
    async fn take(
        conn: &mut AsyncPgConnection,
        ride_id: i64,
        message_id: &str,
        lease: Duration,
    ) -> Result<Result<Claim, Duration>, diesel::result::Error> {
        let deadline = Claim::deadline_from_now(lease);
        let taken = diesel::sql_query(
            "INSERT INTO receipt_claims (ride_id, message_id, claimed_until) \
             VALUES ($1, $2, now() + make_interval(secs => $3)) \
             ON CONFLICT (ride_id) DO UPDATE \
                SET attempts = receipt_claims.attempts + 1, \
                    claimed_until = EXCLUDED.claimed_until, \
                    message_id = EXCLUDED.message_id \
              WHERE receipt_claims.claimed_until <= now() \
             RETURNING attempts",
        )
        .bind::<BigInt, _>(ride_id)
        .bind::<Text, _>(message_id)
        .bind::<Double, _>(lease.as_secs_f64())
        .get_result::<Attempts>(conn)
        .await
        .optional()?;
        if let Some(Attempts { attempts }) = taken {
            return Ok(Ok(Claim {
                ride_id,
                message_id: message_id.to_owned(),
                attempts,
                deadline,
            }));
        }
        let remaining = diesel::sql_query(
            "SELECT GREATEST(EXTRACT(EPOCH FROM claimed_until - now()), 0)::float8 AS secs \
               FROM receipt_claims WHERE ride_id = $1",
        )
        .bind::<BigInt, _>(ride_id)
        .get_result::<Remaining>(conn)
        .await
        .optional()?;
        // No row: the holder finished between the two statements; look again at once.
        let secs = remaining.map_or(0.0, |r| r.secs);
        Ok(Err(
            Duration::try_from_secs_f64(secs).unwrap_or(Duration::ZERO)
        ))
    }

    /// Records the receipt as sent and releases the claim, in one transaction.
    pub(super) async fn record_sent(
        &self,
        conn: &mut AsyncPgConnection,
        recorded_via: &str,
    ) -> Result<(), diesel::result::Error> {
        let released = conn
            .transaction(async |conn| {
                diesel::insert_into(sent_receipts::table)
                    .values(NewSentReceipt {
                        ride_id: self.ride_id,
                        message_id: &self.message_id,
                        recorded_via,
                    })
                    .on_conflict_do_nothing()
                    .execute(conn)
                    .await?;
                self.delete(conn).await
            })
            .await?;
        self.report_recorded(released);
        Ok(())
    }

    /// The deadline of a claim about to be taken with `lease`.
    pub(super) fn deadline_from_now(lease: Duration) -> tokio::time::Instant {
        tokio::time::Instant::now() + lease
    }

    /// Says so if the record found the claim taken over.
    pub(super) fn report_recorded(&self, released: bool) {
        if !released {
            // Only possible if a send outlived the lease, which the configuration check
            // (lease > SMTP timeout), the send's own timeout and the deadline rule out.
            tracing::error!(
                ride_id = self.ride_id,
                "a receipt claim was taken over while its mail was being sent; the rider may get it twice"
            );
        }
    }

    /// Deletes the claim if it is still this attempt's; also how a claim is dropped without a
    /// send (a duplicate, or a relay that refused the mail). True if it was still ours.
    pub(super) async fn delete(
        &self,
        conn: &mut AsyncPgConnection,
    ) -> Result<bool, diesel::result::Error> {
        let deleted = diesel::delete(
            receipt_claims::table
                .filter(receipt_claims::ride_id.eq(self.ride_id))
                .filter(receipt_claims::attempts.eq(self.attempts)),
        )
        .execute(conn)
        .await?;
        Ok(deleted == 1)
    }

    /// Ends the lease now, keeping the attempt count, so the next attempt starts at once and
    /// checks the relay first.
    async fn end_lease(&self, conn: &mut AsyncPgConnection) -> Result<(), diesel::result::Error> {
        diesel::update(
            receipt_claims::table
                .filter(receipt_claims::ride_id.eq(self.ride_id))
                .filter(receipt_claims::attempts.eq(self.attempts)),
        )
        .set(receipt_claims::claimed_until.eq(diesel::dsl::now))
        .execute(conn)
        .await
        .map(|_| ())
    }
}
