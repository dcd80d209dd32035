//! The job registry: every job type the enqueuer publishes, with the routing key it is published
//! under and the queue it lands in. The enqueuer dispatches on it ([`find`]) and the topology
//! declares and binds one queue per entry ([`REGISTRY`]), so a new job type is its struct in
//! `contract/src/jobs.rs`, one entry here and its consumer (docs/architecture.md).

use contract::{BackgroundJob, ReceiptJob, message::ReceiptMessage};

/// One job type, as the broker sees it.
#[derive(Debug)]
pub struct JobType {
    /// `staged_jobs.job_name` (the contract's `BackgroundJob::JOB_NAME`).
    pub job_name: &'static str,
    /// The routing key it is published under, and its queue's binding.
    pub routing_key: &'static str,
    /// Its queue's name after the topology's prefix: `{prefix}.{queue_suffix}`.
    pub queue_suffix: &'static str,
    /// The message body for staged `job_args`; `None` when they do not fit the message contract.
    /// Such args are published as they are, so that the consumer rejects them into the
    /// dead-letter queue where a person sees them, instead of blocking the drain.
    pub encode: fn(&serde_json::Value) -> Option<Vec<u8>>,
}

/// Receipts: the versioned [`ReceiptMessage`] (docs/asyncapi.yaml).
pub const RECEIPT: JobType = JobType {
    job_name: ReceiptJob::JOB_NAME,
    routing_key: "ride.receipt",
    queue_suffix: "receipts",
    encode: encode_receipt,
};

/// Every job type; the topology declares a queue for each.
pub const REGISTRY: &[JobType] = &[RECEIPT];

/// The registered type of a staged job; `None` for a name nothing registers (the enqueuer routes
/// it by its name, nothing is bound to that, the broker returns it and it is set aside).
pub fn find(job_name: &str) -> Option<&'static JobType> {
    REGISTRY.iter().find(|kind| kind.job_name == job_name)
}

fn encode_receipt(args: &serde_json::Value) -> Option<Vec<u8>> {
    ReceiptJob::from_args(args)
        .ok()
        .and_then(ReceiptMessage::from_job)
        .and_then(|message| message.encode().ok())
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn names_routing_keys_and_queues_are_each_registered_once() {
        let names: HashSet<_> = REGISTRY.iter().map(|kind| kind.job_name).collect();
        let keys: HashSet<_> = REGISTRY.iter().map(|kind| kind.routing_key).collect();
        let queues: HashSet<_> = REGISTRY.iter().map(|kind| kind.queue_suffix).collect();
        assert_eq!(names.len(), REGISTRY.len());
        assert_eq!(keys.len(), REGISTRY.len());
        assert_eq!(queues.len(), REGISTRY.len());
        // The dead-letter queue is `{prefix}.dead-letter`: no job queue may take its name.
        assert!(!queues.contains("dead-letter"));
    }

    #[test]
    fn a_receipt_job_becomes_its_message_and_other_args_do_not() {
        let job = ReceiptJob {
            ride_id: 7,
            user_id: 3,
            charge_id: Some("pi_1".into()),
            amount: 2000,
            currency: "usd".into(),
            created_at: chrono::DateTime::from_timestamp(1_800_000_000, 0).unwrap(),
        };
        let kind = find(ReceiptJob::JOB_NAME).unwrap();
        let body = (kind.encode)(&job.to_args()).unwrap();
        let message = ReceiptMessage::decode(&body).unwrap();
        assert_eq!((message.ride_id, message.charge_id.as_str()), (7, "pi_1"));
        // A receipt for no charge is not a receipt message.
        let uncharged = ReceiptJob {
            charge_id: None,
            ..job
        };
        assert_eq!((kind.encode)(&uncharged.to_args()), None);
        assert_eq!((kind.encode)(&serde_json::json!({"ride_id": 7})), None);
        assert!(find("no_such_job").is_none());
    }
}
