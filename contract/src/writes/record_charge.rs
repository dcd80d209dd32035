//! Recording a charge and finishing its key: see `record_charge.sql`.

use diesel::{
    QueryResult,
    sql_types::{Array, BigInt, Bool, Integer, Jsonb, Text, Uuid as SqlUuid},
};
use diesel_async::AsyncPgConnection;
use schema::{JsonText, RecoveryPoint};
use uuid::Uuid;

use super::{KeyFence, fence_arrays, moved_per_key};
use crate::{BackgroundJob, JobToStage, ReceiptJob, StoredResponse};

schema::statement! {
    /// The one statement that records a charge, and the only one that stages a job
    /// (`record_charge.sql`).
    pub struct RecordCharge = include_str!("record_charge.sql");
    {
        key_ids: Array<BigInt> = Vec<i64>,
        tokens: Array<SqlUuid> = Vec<Uuid>,
        user_ids: Array<BigInt> = Vec<i64>,
        from_points: Array<Text> = Vec<&'static str>,
        charge_ids: Array<Text> = Vec<String>,
        ride_ids: Array<BigInt> = Vec<i64>,
        stage_receipts: Array<Bool> = Vec<bool>,
        job_names: Array<Text> = Vec<&'static str>,
        job_args: Array<Jsonb> = Vec<JsonText>,
        trace_contexts: Array<Jsonb> = Vec<JsonText>,
        response_codes: Array<Integer> = Vec<i32>,
        response_bodies: Array<Jsonb> = Vec<JsonText>,
    }
}

/// One key's charge to record.
#[derive(Clone, Debug)]
pub struct ChargeRecord {
    pub fence: KeyFence,
    /// Where the key stands: the fence moves it on only from there.
    pub from: RecoveryPoint,
    pub ride_id: i64,
    /// The provider's PaymentIntent id.
    pub charge_id: String,
    /// The receipt job to stage (`BackgroundJob::staged`), or `None` when one is already staged
    /// or sent.
    pub receipt: Option<JobToStage>,
    /// The outcome the key replays from then on.
    pub outcome: StoredResponse,
}

impl RecordCharge {
    /// Records each of `charges` whose fence passes; per charge, in order, whether its key was
    /// finished.
    pub async fn run(
        conn: &mut AsyncPgConnection,
        charges: &[ChargeRecord],
    ) -> QueryResult<Vec<bool>> {
        let fences = || charges.iter().map(|charge| charge.fence);
        let (key_ids, tokens, user_ids) = fence_arrays(fences());
        let receipt = |charge: &ChargeRecord, part: fn(&JobToStage) -> &JsonText| {
            charge
                .receipt
                .as_ref()
                .map_or_else(JsonText::null, |job| part(job).clone())
        };
        let statement = RecordCharge {
            key_ids,
            tokens,
            user_ids,
            from_points: charges.iter().map(|c| c.from.as_str()).collect(),
            charge_ids: charges.iter().map(|c| c.charge_id.clone()).collect(),
            ride_ids: charges.iter().map(|c| c.ride_id).collect(),
            stage_receipts: charges.iter().map(|c| c.receipt.is_some()).collect(),
            job_names: charges
                .iter()
                .map(|c| {
                    c.receipt
                        .as_ref()
                        .map_or(ReceiptJob::JOB_NAME, |j| j.job_name)
                })
                .collect(),
            job_args: charges
                .iter()
                .map(|c| receipt(c, |j| &j.job_args))
                .collect(),
            trace_contexts: charges
                .iter()
                .map(|c| receipt(c, |j| &j.trace_context))
                .collect(),
            response_codes: charges.iter().map(|c| c.outcome.code).collect(),
            response_bodies: charges.iter().map(|c| c.outcome.body.clone()).collect(),
        };
        let moved = statement.load(conn).await?;
        Ok(moved_per_key(fences(), moved))
    }
}
