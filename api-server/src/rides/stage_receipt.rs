//! Phase `charge_created`: the receipt job staged in `staged_jobs` and the key finished with the
//! stored outcome and unlocked, in one fenced statement ([`StageReceipt`], or
//! [`StageReceiptBatch`] for several requests): the receipt is committed with the ride's outcome
//! or not at all, and the enqueuer publishes it after the commit.

use contract::{BackgroundJob, Outcome, ReceiptJob, key::KeyMoved};
use diesel::{
    OptionalExtension,
    result::Error as DieselError,
    sql_types::{self, Array, BigInt, Integer, Jsonb, Text},
};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use futures_util::FutureExt;
use schema::{
    models::Ride,
    prepared::{Statement, prepared},
    store::StoreError,
};
use scoped_futures::ScopedFutureExt;

use super::Rides;
use crate::idempotency::{self, BatchStatement, Fence, FenceArrays, Lease};

impl Rides {
    /// Phase `charge_created`: the receipt job and the stored response, then finished.
    pub(super) async fn stage_receipt(
        &self,
        lease: &Lease,
        ride: Ride,
    ) -> Result<Outcome, StoreError> {
        // The receipt continues this request's trace: the enqueuer and the receipt worker pick
        // the context up from the job.
        let trace_context = serde_json::to_value(telemetry::inject_current()).unwrap_or_default();
        let job_args = ReceiptJob::from(&ride).to_args();
        let outcome = Outcome::ride_created(ride);
        let stored = outcome.to_stored();
        let receipt_due = || ReceiptDue {
            fence: lease.fence(),
            job_args: job_args.clone(),
            trace_context: trace_context.clone(),
            response_code: stored.code,
            response_body: stored.body.clone(),
        };
        let (trace_context, job_args, stored) = (&trace_context, &job_args, &stored);
        idempotency::batched_phase(&self.receipts, lease, receipt_due, || async {
            idempotency::atomic_phase(&self.pool, self.retry, lease, |conn| {
                prepared::<StageReceipt, _>(|q| {
                    q.bind::<BigInt, _>(lease.key_id)
                        .bind::<sql_types::Uuid, _>(lease.token)
                        .bind::<BigInt, _>(lease.user_id)
                        .bind::<Text, _>(ReceiptJob::JOB_NAME)
                        .bind::<Jsonb, _>(job_args)
                        .bind::<Jsonb, _>(trace_context)
                        .bind::<Integer, _>(stored.code)
                        .bind::<Jsonb, _>(&stored.body)
                })
                .get_result::<KeyMoved>(conn)
                .map(OptionalExtension::optional)
                .scope_boxed()
            })
            .await
            .map(|_| ())
        })
        .await?;
        Ok(outcome)
    }
}

/// Phase `charge_created` as one statement: the receipt job, then the key finished with the
/// stored response and unlocked.
struct StageReceipt;

impl Statement for StageReceipt {
    const SQL: &'static str = concat!(
        "WITH ",
        contract::fence!("charge_created"),
        ", job AS (INSERT INTO staged_jobs (job_name, job_args, trace_context) \
         SELECT $4, $5, $6 FROM fence RETURNING id) ",
        contract::finish_key!("$7", "$8"),
        " FROM job WHERE idempotency_keys.id = $1 AND idempotency_keys.lock_token = $2 \
         AND idempotency_keys.user_id = $3 RETURNING idempotency_keys.id"
    );
}

/// Phase `charge_created` for several keys: see [`StageReceipt`].
pub struct StageReceipts;

/// One request's part of [`StageReceipts`].
pub struct ReceiptDue {
    pub fence: Fence,
    pub job_args: serde_json::Value,
    pub trace_context: serde_json::Value,
    pub response_code: i32,
    pub response_body: serde_json::Value,
}

impl BatchStatement for StageReceipts {
    type Item = ReceiptDue;
    /// `Some` if the key was finished; `None` if its fence failed.
    type Output = Option<()>;
    const NAME: &'static str = "stage_receipt";
    /// A batch that committed finished and unlocked its keys, so a redo fails every fence and
    /// stages nothing twice.
    const REDO_AFTER_CONNECTION_LOSS: bool = true;

    async fn execute(
        &self,
        conn: &mut AsyncPgConnection,
        items: &[ReceiptDue],
    ) -> Result<Vec<Option<()>>, DieselError> {
        let fences = FenceArrays::of(items.iter().map(|item| item.fence));
        let job_args: Vec<&serde_json::Value> = items.iter().map(|item| &item.job_args).collect();
        let trace_contexts: Vec<&serde_json::Value> =
            items.iter().map(|item| &item.trace_context).collect();
        let codes: Vec<i32> = items.iter().map(|item| item.response_code).collect();
        let bodies: Vec<&serde_json::Value> =
            items.iter().map(|item| &item.response_body).collect();
        let moved = prepared::<StageReceiptBatch, _>(|q| {
            q.bind::<Array<BigInt>, _>(&fences.key_ids)
                .bind::<Array<sql_types::Uuid>, _>(&fences.tokens)
                .bind::<Array<BigInt>, _>(&fences.user_ids)
                .bind::<Array<Jsonb>, _>(&job_args)
                .bind::<Array<Jsonb>, _>(&trace_contexts)
                .bind::<Array<Integer>, _>(&codes)
                .bind::<Array<Jsonb>, _>(&bodies)
                .bind::<Text, _>(ReceiptJob::JOB_NAME)
        })
        .load::<KeyMoved>(conn)
        .await?;
        Ok(KeyMoved::per_item(items, |item| item.fence.key_id, moved))
    }
}

struct StageReceiptBatch;

impl Statement for StageReceiptBatch {
    const SQL: &'static str = concat!(
        contract::batch_fence!(
            "charge_created",
            "$4::jsonb[], $5::jsonb[], $6::int4[], $7::jsonb[]",
            "job_args, trace_context, response_code, response_body"
        ),
        // A data-modifying CTE runs to completion whether or not anything reads it, and the
        // statement commits both writes or neither.
        ", job AS (INSERT INTO staged_jobs (job_name, job_args, trace_context) \
         SELECT $8, job_args, trace_context FROM fence ORDER BY key_id) ",
        contract::finish_key!("fence.response_code", "fence.response_body"),
        " FROM fence WHERE idempotency_keys.id = ANY(ARRAY(SELECT key_id FROM fence)) \
         AND idempotency_keys.id = fence.key_id AND idempotency_keys.user_id = fence.user_id \
         RETURNING idempotency_keys.id"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `finished` must be durable before the caller is answered (`contract::unflushed!`'s table),
    /// and so must a decline, finished by `FinishKey`.
    #[test]
    fn the_outcome_is_flushed_before_the_answer() {
        for sql in [
            StageReceipt::SQL,
            StageReceiptBatch::SQL,
            contract::key::FinishKey::SQL,
        ] {
            assert!(!sql.contains("synchronous_commit"), "{sql}");
        }
    }
}
