//! Phase `charge_created`: the receipt job staged in `staged_jobs` and the key finished with the
//! stored outcome and unlocked, in one fenced statement ([`StageReceipt`], or
//! [`StageReceiptBatch`] for several requests): the receipt is committed with the ride's outcome
//! or not at all, and the enqueuer publishes it after the commit.
//!
//! Since run 24 of docs/history/performance.md a fresh key never stops at `charge_created`: the statement
//! that records its charge stages its receipt and finishes it too (`record_charge`, which shares
//! [`Receipt`] and the SQL below). This phase runs on its own only for a key an older server left
//! at `charge_created`.

use contract::{BackgroundJob, JobToStage, Outcome, ReceiptJob, key::KeyMoved};
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
        let (outcome, receipt) = Receipt::for_charged(ride);
        let receipt_due = || ReceiptDue {
            fence: lease.fence(),
            receipt: receipt.clone(),
        };
        let receipt = &receipt;
        idempotency::batched_phase(&self.receipts, lease, receipt_due, || async {
            idempotency::atomic_phase(&self.pool, self.retry, lease, |conn| {
                prepared::<StageReceipt, _>(|q| {
                    q.bind::<BigInt, _>(lease.key_id)
                        .bind::<sql_types::Uuid, _>(lease.token)
                        .bind::<BigInt, _>(lease.user_id)
                        .bind::<Text, _>(receipt.job.job_name)
                        .bind::<Jsonb, _>(&receipt.job.job_args)
                        .bind::<Jsonb, _>(&receipt.job.trace_context)
                        .bind::<Integer, _>(receipt.response_code)
                        .bind::<Jsonb, _>(&receipt.response_body)
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

/// What finishing a charged ride's key writes: the receipt job and the stored outcome.
#[derive(Clone, Debug)]
pub struct Receipt {
    /// The receipt job's row (`contract::BackgroundJob::staged`).
    pub job: JobToStage,
    pub response_code: i32,
    pub response_body: serde_json::Value,
}

impl Receipt {
    /// The outcome of `ride`, whose charge is recorded on it, and what finishing its key writes.
    /// Built inside the phase's span: the receipt continues this request's trace (the enqueuer
    /// and the receipt worker pick the context up from the job).
    pub(super) fn for_charged(ride: Ride) -> (Outcome, Receipt) {
        let job = ReceiptJob::from(&ride).staged();
        let outcome = Outcome::ride_created(ride);
        let stored = outcome.to_stored();
        let receipt = Receipt {
            job,
            response_code: stored.code,
            response_body: stored.body,
        };
        (outcome, receipt)
    }
}

/// A batch's receipts as the array binds of the batched statements.
pub(super) struct ReceiptArrays<'a> {
    pub job_args: Vec<&'a serde_json::Value>,
    pub trace_contexts: Vec<&'a serde_json::Value>,
    pub codes: Vec<i32>,
    pub bodies: Vec<&'a serde_json::Value>,
}

impl<'a> ReceiptArrays<'a> {
    pub(super) fn of(receipts: impl Iterator<Item = &'a Receipt> + Clone) -> ReceiptArrays<'a> {
        ReceiptArrays {
            job_args: receipts.clone().map(|r| &r.job.job_args).collect(),
            trace_contexts: receipts.clone().map(|r| &r.job.trace_context).collect(),
            codes: receipts.clone().map(|r| r.response_code).collect(),
            bodies: receipts.map(|r| &r.response_body).collect(),
        }
    }
}

/// The end of a one-request statement that finishes a charged ride's key: the receipt job (binds
/// `$name`, `$args`, `$trace`) staged for the row of CTE `$source` (the statement's last write
/// before it, so that nothing is staged if that write found nothing), then the key (`$1`, `$2`,
/// `$3`) finished with the outcome (`$code`, `$body`) and unlocked.
macro_rules! finish_with_receipt {
    ($source:literal, $name:literal, $args:literal, $trace:literal, $code:literal, $body:literal) => {
        concat!(
            "job AS (INSERT INTO staged_jobs (job_name, job_args, trace_context) SELECT ",
            $name,
            ", ",
            $args,
            ", ",
            $trace,
            " FROM ",
            $source,
            " RETURNING id) ",
            contract::finish_key!($code, $body),
            " FROM job WHERE idempotency_keys.id = $1 AND idempotency_keys.lock_token = $2 \
             AND idempotency_keys.user_id = $3 RETURNING idempotency_keys.id"
        )
    };
}
pub(super) use finish_with_receipt;

/// [`finish_with_receipt!`] for a batch: every row of CTE `$source` (the fenced requests whose
/// other writes succeeded: `key_id`, `user_id`, `job_args`, `trace_context`, `response_code`,
/// `response_body`) gets its receipt job (named by bind `$name`) and its key finished.
macro_rules! finish_batch_with_receipts {
    ($source:literal, $name:literal) => {
        concat!(
            // A data-modifying CTE runs to completion whether or not anything reads it, and the
            // statement commits both writes or neither.
            "job AS (INSERT INTO staged_jobs (job_name, job_args, trace_context) SELECT ",
            $name,
            ", job_args, trace_context FROM ",
            $source,
            " ORDER BY key_id) ",
            contract::finish_key!("src.response_code", "src.response_body"),
            " FROM ",
            $source,
            " src WHERE idempotency_keys.id = ANY(ARRAY(SELECT key_id FROM ",
            $source,
            ")) AND idempotency_keys.id = src.key_id AND idempotency_keys.user_id = src.user_id \
             RETURNING idempotency_keys.id"
        )
    };
}
pub(super) use finish_batch_with_receipts;

/// Phase `charge_created` as one statement: the receipt job, then the key finished with the
/// stored response and unlocked.
struct StageReceipt;

impl Statement for StageReceipt {
    const SQL: &'static str = concat!(
        "WITH ",
        contract::fence!("charge_created"),
        ", ",
        finish_with_receipt!("fence", "$4", "$5", "$6", "$7", "$8"),
    );
}

/// Phase `charge_created` for several keys: see [`StageReceipt`].
pub struct StageReceipts;

/// One request's part of [`StageReceipts`].
pub struct ReceiptDue {
    pub fence: Fence,
    pub receipt: Receipt,
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
        let receipts = ReceiptArrays::of(items.iter().map(|item| &item.receipt));
        let moved = prepared::<StageReceiptBatch, _>(|q| {
            q.bind::<Array<BigInt>, _>(&fences.key_ids)
                .bind::<Array<sql_types::Uuid>, _>(&fences.tokens)
                .bind::<Array<BigInt>, _>(&fences.user_ids)
                .bind::<Array<Jsonb>, _>(&receipts.job_args)
                .bind::<Array<Jsonb>, _>(&receipts.trace_contexts)
                .bind::<Array<Integer>, _>(&receipts.codes)
                .bind::<Array<Jsonb>, _>(&receipts.bodies)
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
        ", ",
        finish_batch_with_receipts!("fence", "$8"),
    );
}
