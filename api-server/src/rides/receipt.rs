//! What finishing a charged ride's key writes: the receipt job staged in `staged_jobs` and the
//! stored outcome, in the statement that records the charge (`ride_created`), so the receipt is
//! committed with the ride's outcome or not at all, and the enqueuer publishes it after the commit.
//! Phase `charge_created` has no statement of its own: a key stays there only if a server from
//! before run 24 of docs/history/performance.md left it there, and `workers admin keys upgrade`
//! finishes it as this statement would have (docs/operations.md, "Upgrading").

use contract::{BackgroundJob, JobToStage, Outcome, ReceiptJob};
use schema::models::Ride;

/// What finishing a charged ride's key writes: the receipt job and the stored outcome.
#[derive(Clone, Debug)]
pub struct ReceiptAndOutcome {
    /// The receipt job's row (`contract::BackgroundJob::staged`).
    pub job: JobToStage,
    pub response_code: i32,
    pub response_body: serde_json::Value,
}

impl ReceiptAndOutcome {
    /// The outcome of `ride`, whose charge is recorded on it, and what finishing its key writes.
    /// Built inside the phase's span: the receipt continues this request's trace (the enqueuer
    /// and the receipt worker pick the context up from the job).
    pub(super) fn for_charged(ride: Ride) -> (Outcome, ReceiptAndOutcome) {
        let job = ReceiptJob::from(&ride).staged();
        let outcome = Outcome::ride_created(ride);
        let stored = outcome.to_stored();
        let receipt = ReceiptAndOutcome {
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
    pub(super) fn of(
        receipts: impl Iterator<Item = &'a ReceiptAndOutcome> + Clone,
    ) -> ReceiptArrays<'a> {
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
