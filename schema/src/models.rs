//! A read struct and an insert struct per table, as crates.io does: reads select every column,
//! inserts name only what the caller decides (ids and defaults come from the database).

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use ipnet::IpNet;
use uuid::Uuid;

use crate::{
    FindingKind, RecoveryPoint,
    schema::{audit_records, idempotency_keys, rides, staged_jobs, users},
};

#[derive(Clone, Debug, Queryable, Selectable, Identifiable)]
#[diesel(table_name = users, check_for_backend(diesel::pg::Pg))]
pub struct User {
    pub id: i64,
    pub created_at: DateTime<Utc>,
    pub email: String,
    pub stripe_customer_id: String,
    pub stripe_payment_method_id: String,
    pub api_token_digest: Vec<u8>,
}

#[derive(Debug, Insertable)]
#[diesel(table_name = users)]
pub struct NewUser<'a> {
    pub email: &'a str,
    pub stripe_customer_id: &'a str,
    pub stripe_payment_method_id: &'a str,
    pub api_token_digest: &'a [u8],
}

#[derive(Clone, Debug, Queryable, QueryableByName, Selectable, Identifiable)]
#[diesel(table_name = idempotency_keys, check_for_backend(diesel::pg::Pg))]
pub struct IdempotencyKeyRow {
    pub id: i64,
    pub created_at: DateTime<Utc>,
    pub idempotency_key: String,
    pub last_run_at: DateTime<Utc>,
    pub locked_at: Option<DateTime<Utc>>,
    pub lock_token: Option<Uuid>,
    /// The liveness session of the lock's holder (`crate::liveness`), if it named one.
    pub lock_holder: Option<i64>,
    pub request_method: String,
    pub request_path: String,
    pub request_params: serde_json::Value,
    pub response_code: Option<i32>,
    pub response_body: Option<serde_json::Value>,
    pub recovery_point: RecoveryPoint,
    pub user_id: i64,
}

#[derive(Clone, Debug, PartialEq, Queryable, QueryableByName, Selectable, Identifiable)]
#[diesel(table_name = rides, check_for_backend(diesel::pg::Pg))]
pub struct Ride {
    pub id: i64,
    pub created_at: DateTime<Utc>,
    pub idempotency_key_id: Option<i64>,
    pub origin_lat: f64,
    pub origin_lon: f64,
    pub target_lat: f64,
    pub target_lon: f64,
    pub amount: i64,
    pub currency: String,
    pub stripe_charge_id: Option<String>,
    pub user_id: i64,
    /// The deployment the ride was created under; `None` for a ride from before deployment ids
    /// (`contract::key::provider_idempotency_key` says what that changes for its charge).
    pub deployment_id: Option<String>,
}

#[derive(Debug, Insertable)]
#[diesel(table_name = rides)]
pub struct NewRide<'a> {
    pub idempotency_key_id: i64,
    pub origin_lat: f64,
    pub origin_lon: f64,
    pub target_lat: f64,
    pub target_lon: f64,
    pub amount: i64,
    pub currency: &'a str,
    pub user_id: i64,
}

#[derive(Clone, Debug, Queryable, Selectable, Identifiable)]
#[diesel(table_name = audit_records, check_for_backend(diesel::pg::Pg))]
pub struct AuditRecord {
    pub id: i64,
    pub action: String,
    pub created_at: DateTime<Utc>,
    pub data: serde_json::Value,
    pub origin_ip: IpNet,
    pub resource_id: i64,
    pub resource_type: String,
    pub user_id: i64,
}

#[derive(Clone, Debug, Queryable, Selectable, Identifiable)]
#[diesel(table_name = staged_jobs, check_for_backend(diesel::pg::Pg))]
pub struct StagedJob {
    pub id: i64,
    pub created_at: DateTime<Utc>,
    pub job_name: String,
    pub job_args: serde_json::Value,
    pub trace_context: serde_json::Value,
    /// Publications the broker returned as unroutable or refused.
    pub attempts: i32,
    /// When a set-aside job is due again; `None` for a job never set aside.
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// When the enqueuer gave up on the job and left it for a human.
    pub parked_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
}

#[derive(Debug, Insertable)]
#[diesel(table_name = staged_jobs)]
pub struct NewStagedJob<'a> {
    pub job_name: &'a str,
    pub job_args: &'a serde_json::Value,
    pub trace_context: &'a serde_json::Value,
}

/// Why a key was put in front of a human (`keys_needing_attention.reason`).
pub const ATTENTION_COMPLETER_GAVE_UP: &str = "completer_gave_up";
pub const ATTENTION_REAPED_UNFINISHED: &str = "reaped_unfinished";

/// A key that automation could not finish. Kept after the key itself is reaped.
#[derive(Clone, Debug, Queryable, Selectable, Identifiable)]
#[diesel(table_name = crate::schema::keys_needing_attention, check_for_backend(diesel::pg::Pg))]
pub struct KeyNeedingAttention {
    pub id: i64,
    pub recorded_at: DateTime<Utc>,
    pub reason: String,
    pub idempotency_key_id: i64,
    pub user_id: i64,
    pub idempotency_key: String,
    pub recovery_point: RecoveryPoint,
    pub request_params: serde_json::Value,
    pub last_error: Option<String>,
    pub resolved_at: Option<DateTime<Utc>>,
}

#[derive(Debug, Insertable)]
#[diesel(table_name = crate::schema::keys_needing_attention)]
pub struct NewKeyNeedingAttention<'a> {
    pub reason: &'a str,
    pub idempotency_key_id: i64,
    pub user_id: i64,
    pub idempotency_key: &'a str,
    pub recovery_point: RecoveryPoint,
    pub request_params: &'a serde_json::Value,
    pub last_error: Option<&'a str>,
}

/// A receipt that was handed to the mail relay; at most one per ride.
#[derive(Clone, Debug, Queryable, Selectable, Identifiable)]
#[diesel(table_name = crate::schema::sent_receipts, primary_key(ride_id), check_for_backend(diesel::pg::Pg))]
pub struct SentReceipt {
    pub ride_id: i64,
    pub message_id: String,
    pub sent_at: DateTime<Utc>,
    pub recorded_via: String,
}

/// `sent_receipts.recorded_via` when the attempt that sent the mail recorded it.
pub const RECORDED_VIA_SMTP: &str = "smtp";
/// `sent_receipts.recorded_via` when a later attempt found the mail at the relay.
pub const RECORDED_VIA_RELAY_SEARCH: &str = "relay_search";

#[derive(Debug, Insertable)]
#[diesel(table_name = crate::schema::sent_receipts)]
pub struct NewSentReceipt<'a> {
    pub ride_id: i64,
    pub message_id: &'a str,
    pub recorded_via: &'a str,
}

/// A disagreement between the provider's ledger and the rides, recorded once per
/// `(kind, payment_intent_id)` by the reconciler.
#[derive(Clone, Debug, PartialEq, Queryable, Selectable, Identifiable, serde::Serialize)]
#[diesel(table_name = crate::schema::reconciliation_findings, check_for_backend(diesel::pg::Pg))]
pub struct ReconciliationFinding {
    pub id: i64,
    pub kind: FindingKind,
    pub payment_intent_id: String,
    pub ride_id: Option<i64>,
    pub user_id: Option<i64>,
    pub idempotency_key_id: Option<i64>,
    pub provider_amount: Option<i64>,
    pub provider_currency: Option<String>,
    pub provider_status: Option<String>,
    pub ride_amount: Option<i64>,
    pub ride_currency: Option<String>,
    pub first_seen_at: DateTime<Utc>,
    pub last_seen_at: DateTime<Utc>,
    pub resolved_at: Option<DateTime<Utc>>,
    pub resolution: Option<String>,
    pub refund_id: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Insertable)]
#[diesel(table_name = crate::schema::reconciliation_findings)]
pub struct NewReconciliationFinding {
    pub kind: FindingKind,
    pub payment_intent_id: String,
    pub ride_id: Option<i64>,
    pub user_id: Option<i64>,
    pub idempotency_key_id: Option<i64>,
    pub provider_amount: Option<i64>,
    pub provider_currency: Option<String>,
    pub provider_status: Option<String>,
    pub ride_amount: Option<i64>,
    pub ride_currency: Option<String>,
}
