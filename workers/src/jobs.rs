//! The job registry: every job type the fleet publishes and consumes. A job type is two things,
//! as in crates.io's `BackgroundJob`:
//!
//! 1. its contract type (`contract/src/jobs.rs`: the struct, its `JOB_NAME`, and where it differs
//!    from the defaults its routing key, queue and message body) and, in this crate, a handler
//!    with `run` ([`crate::consumer::JobHandler`]);
//! 2. one line in [`registry`].
//!
//! Everything else derives from the registration: the enqueuer encodes and routes staged jobs by
//! it ([`Registry::find`]), the topology declares and binds one queue per registered type, and
//! the generic consumer ([`crate::consumer::JobConsumer`]) takes deliveries off that queue.

use contract::{BackgroundJob, ReceiptJob};

/// Every job type of the fleet. A new job type is one `.register::<…>()` here.
pub fn registry() -> Registry {
    Registry::default().register::<ReceiptJob>()
}

/// One job type, as the broker sees it: what its registration derives from the contract type.
#[derive(Clone, Copy)]
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

impl JobType {
    /// The job type of `J`.
    pub fn of<J: BackgroundJob>() -> JobType {
        JobType {
            job_name: J::JOB_NAME,
            routing_key: J::ROUTING_KEY,
            queue_suffix: J::QUEUE,
            encode: J::message_body,
        }
    }
}

impl std::fmt::Debug for JobType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobType")
            .field("job_name", &self.job_name)
            .field("routing_key", &self.routing_key)
            .field("queue_suffix", &self.queue_suffix)
            .finish_non_exhaustive()
    }
}

/// Job types are equal when they are published and queued alike (the encoder is a function and
/// is not compared).
impl PartialEq for JobType {
    fn eq(&self, other: &JobType) -> bool {
        (self.job_name, self.routing_key, self.queue_suffix)
            == (other.job_name, other.routing_key, other.queue_suffix)
    }
}

impl Eq for JobType {}

/// The registered job types, in registration order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Registry {
    types: Vec<JobType>,
}

impl Registry {
    /// Adds `J`. Two types must not share a name, routing key or queue (nor take the dead-letter
    /// queue's name): [`Registry::clashes`] says whether they do, and a unit test checks
    /// [`registry`].
    #[must_use]
    pub fn register<J: BackgroundJob>(mut self) -> Registry {
        self.types.push(JobType::of::<J>());
        self
    }

    /// Whether two registered types would share a name, a route or a queue, or a type would take
    /// the dead-letter queue's name (`{prefix}.dead-letter`).
    pub fn clashes(&self) -> bool {
        let distinct = |part: fn(&JobType) -> &'static str| {
            let mut seen: Vec<&str> = self.types.iter().map(part).collect();
            seen.sort_unstable();
            seen.dedup();
            seen.len() == self.types.len()
        };
        !(distinct(|kind| kind.job_name)
            && distinct(|kind| kind.routing_key)
            && distinct(|kind| kind.queue_suffix))
            || self
                .types
                .iter()
                .any(|kind| kind.queue_suffix == "dead-letter")
    }

    /// The registered type of a staged job; `None` for a name nothing registers (the enqueuer
    /// routes it by its name, nothing is bound to that, the broker returns it and it is set aside).
    pub fn find(&self, job_name: &str) -> Option<&JobType> {
        self.types.iter().find(|kind| kind.job_name == job_name)
    }

    pub fn iter(&self) -> impl Iterator<Item = &JobType> {
        self.types.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Serialize, serde::Deserialize)]
    struct Other {
        n: i64,
    }

    impl BackgroundJob for Other {
        const JOB_NAME: &'static str = "other";
    }

    #[derive(serde::Serialize, serde::Deserialize)]
    struct SameQueue;

    impl BackgroundJob for SameQueue {
        const JOB_NAME: &'static str = "same_queue";
        const QUEUE: &'static str = "receipts";
    }

    #[test]
    fn a_registered_type_is_found_by_name_with_its_route() {
        let registry = registry().register::<Other>();
        let receipt = registry.find(ReceiptJob::JOB_NAME).unwrap();
        assert_eq!(
            (receipt.routing_key, receipt.queue_suffix),
            ("ride.receipt", "receipts")
        );
        let other = registry.find("other").unwrap();
        assert_eq!((other.routing_key, other.queue_suffix), ("other", "other"));
        let body = (other.encode)(&serde_json::json!({"n": 3})).unwrap();
        assert_eq!(body, br#"{"n":3}"#);
        assert_eq!((other.encode)(&serde_json::json!({"m": 3})), None);
        assert!(registry.find("no_such_job").is_none());
    }

    #[test]
    fn the_fleet_registers_each_name_route_and_queue_once() {
        assert!(!registry().clashes());
        assert!(!registry().register::<Other>().clashes());
        assert!(registry().register::<SameQueue>().clashes());
        assert!(registry().register::<ReceiptJob>().clashes());
    }
}
