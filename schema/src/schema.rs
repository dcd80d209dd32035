// @generated in the shape `diesel print-schema` writes; keep it in step with `migrations/`.
// (The `schema_matches_migrations` test fails when they drift.)

diesel::table! {
    audit_records (id) {
        id -> Int8,
        action -> Text,
        created_at -> Timestamptz,
        data -> Jsonb,
        origin_ip -> Cidr,
        resource_id -> Int8,
        resource_type -> Text,
        user_id -> Int8,
    }
}

diesel::table! {
    idempotency_keys (id) {
        id -> Int8,
        created_at -> Timestamptz,
        idempotency_key -> Text,
        last_run_at -> Timestamptz,
        locked_at -> Nullable<Timestamptz>,
        lock_token -> Nullable<Uuid>,
        request_method -> Text,
        request_path -> Text,
        request_params -> Jsonb,
        response_code -> Nullable<Int4>,
        response_body -> Nullable<Jsonb>,
        recovery_point -> Text,
        user_id -> Int8,
        completer_attempts -> Int4,
        completer_next_attempt_at -> Nullable<Timestamptz>,
        completer_gave_up_at -> Nullable<Timestamptz>,
        lock_holder -> Nullable<Int8>,
    }
}

diesel::table! {
    keys_needing_attention (id) {
        id -> Int8,
        recorded_at -> Timestamptz,
        reason -> Text,
        idempotency_key_id -> Int8,
        user_id -> Int8,
        idempotency_key -> Text,
        recovery_point -> Text,
        request_params -> Jsonb,
        last_error -> Nullable<Text>,
        resolved_at -> Nullable<Timestamptz>,
    }
}

diesel::table! {
    reconciler_watermarks (name) {
        name -> Text,
        reconciled_until -> Timestamptz,
        pending_payment_intents -> Array<Text>,
        updated_at -> Timestamptz,
    }
}

diesel::table! {
    reconciliation_findings (id) {
        id -> Int8,
        kind -> Text,
        payment_intent_id -> Text,
        ride_id -> Nullable<Int8>,
        user_id -> Nullable<Int8>,
        idempotency_key_id -> Nullable<Int8>,
        provider_amount -> Nullable<Int8>,
        provider_currency -> Nullable<Text>,
        provider_status -> Nullable<Text>,
        ride_amount -> Nullable<Int8>,
        ride_currency -> Nullable<Text>,
        first_seen_at -> Timestamptz,
        last_seen_at -> Timestamptz,
        resolved_at -> Nullable<Timestamptz>,
        resolution -> Nullable<Text>,
        refund_id -> Nullable<Text>,
    }
}

diesel::table! {
    refund_audits (id) {
        id -> Int8,
        finding_id -> Int8,
        payment_intent_id -> Text,
        refund_id -> Text,
        amount -> Int8,
        currency -> Text,
        reason -> Text,
        requested_by -> Text,
        deployment_id -> Text,
        refunded_at -> Timestamptz,
    }
}

diesel::table! {
    rides (id) {
        id -> Int8,
        created_at -> Timestamptz,
        idempotency_key_id -> Nullable<Int8>,
        origin_lat -> Float8,
        origin_lon -> Float8,
        target_lat -> Float8,
        target_lon -> Float8,
        amount -> Int8,
        currency -> Text,
        stripe_charge_id -> Nullable<Text>,
        user_id -> Int8,
        deployment_id -> Nullable<Text>,
    }
}

diesel::table! {
    sent_receipts (ride_id) {
        ride_id -> Int8,
        message_id -> Text,
        sent_at -> Timestamptz,
        recorded_via -> Text,
    }
}

diesel::table! {
    receipt_claims (ride_id) {
        ride_id -> Int8,
        attempts -> Int4,
        claimed_until -> Timestamptz,
        message_id -> Text,
        created_at -> Timestamptz,
    }
}

diesel::table! {
    staged_jobs (id) {
        id -> Int8,
        created_at -> Timestamptz,
        job_name -> Text,
        job_args -> Jsonb,
        trace_context -> Jsonb,
        attempts -> Int4,
        next_attempt_at -> Nullable<Timestamptz>,
        parked_at -> Nullable<Timestamptz>,
        last_error -> Nullable<Text>,
    }
}

diesel::table! {
    users (id) {
        id -> Int8,
        created_at -> Timestamptz,
        email -> Text,
        stripe_customer_id -> Text,
        stripe_payment_method_id -> Text,
        api_token_digest -> Bytea,
    }
}

diesel::joinable!(audit_records -> users (user_id));
diesel::joinable!(idempotency_keys -> users (user_id));
diesel::joinable!(keys_needing_attention -> users (user_id));
diesel::joinable!(rides -> idempotency_keys (idempotency_key_id));
diesel::joinable!(rides -> users (user_id));
diesel::joinable!(sent_receipts -> rides (ride_id));
diesel::joinable!(receipt_claims -> rides (ride_id));
diesel::joinable!(refund_audits -> reconciliation_findings (finding_id));

diesel::allow_tables_to_appear_in_same_query!(
    audit_records,
    idempotency_keys,
    keys_needing_attention,
    receipt_claims,
    reconciler_watermarks,
    reconciliation_findings,
    refund_audits,
    rides,
    sent_receipts,
    staged_jobs,
    users,
);
